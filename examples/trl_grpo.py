"""A plain TRL GRPO script, switched to the Arctic backend by one import (runs on the CPU).

The policy is the demo's tiny random Qwen3 (built locally: no downloads); the reward is verifiable
and easy to learn: the share of completion tokens that are digits.

    uv run python examples/trl_grpo.py [--steps 12] [--plain]

``--plain`` runs the same script on ``trl.GRPOTrainer`` itself, for comparison.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from datasets import Dataset
from trl import GRPOConfig

from arctic_core.demo.task import CountingTask
from arctic_core.demo.tiny_model import save_tiny_policy
from arctic_trl import GRPOTrainer  # the one-line switch (was: from trl import GRPOTrainer)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--plain", action="store_true", help="run on trl.GRPOTrainer instead")
    parser.add_argument("--out", default=None)
    parser.add_argument("--beta", type=float, default=0.0, help="KL coefficient (TRL's defaults otherwise)")
    cli = parser.parse_args(argv)
    trainer_class = GRPOTrainer
    if cli.plain:
        from trl import GRPOTrainer as trainer_class

    folder = tempfile.mkdtemp(prefix="tiny-policy-")
    save_tiny_policy(folder, CountingTask().corpus(), seed=0)
    from transformers import AutoTokenizer

    digits = set(AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids(list("0123456789")))

    def digit_share(completion_ids, **kwargs) -> list[float]:
        return [sum(t in digits for t in ids) / max(len(ids), 1) for ids in completion_ids]

    dataset = Dataset.from_dict({"prompt": [f"count up from {d}:" for d in range(1, 9)] * 4})
    args = GRPOConfig(
        output_dir=cli.out or tempfile.mkdtemp(prefix="trl-grpo-"), max_steps=cli.steps, learning_rate=3e-3,
        per_device_train_batch_size=16, num_generations=8, max_completion_length=12, temperature=1.0,
        logging_steps=1, report_to="none", use_cpu=True, bf16=False, seed=0, save_strategy="no",
        gradient_checkpointing=False, lr_scheduler_type="constant", beta=cli.beta,
    )
    trainer = trainer_class(model=folder, reward_funcs=digit_share, args=args, train_dataset=dataset)
    trainer.train()
    return trainer.state.log_history


if __name__ == "__main__":
    history = main(sys.argv[1:])
    rewards = [round(h["reward"], 3) for h in history if "reward" in h]
    print("reward per step:", rewards)
