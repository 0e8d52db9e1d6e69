"""A recipe's reward on a learnable task: GRPO through TRL on Arctic (CPU, fp32) over a prepared
data set, the mean reward of each step returned."""

from __future__ import annotations

from pathlib import Path


def grpo_rewards(policy: Path, reward, data: Path, out: Path, *, steps: int, lr: float,
                 completion_tokens: int) -> list[float]:
    from datasets import load_dataset
    from trl import GRPOConfig

    from arctic_trl import GRPOTrainer

    train = load_dataset("json", data_files=str(data / "train.jsonl"), split="train")
    args = GRPOConfig(output_dir=str(out), max_steps=steps, learning_rate=lr, per_device_train_batch_size=16,
                      num_generations=8, max_completion_length=completion_tokens, temperature=1.0, logging_steps=1,
                      report_to="none", use_cpu=True, bf16=False, seed=0, save_strategy="no",
                      gradient_checkpointing=False, lr_scheduler_type="constant", beta=0.0)
    trainer = GRPOTrainer(model=str(policy), reward_funcs=reward, args=args, train_dataset=train)
    trainer.train()
    return [h["reward"] for h in trainer.state.log_history if "reward" in h]


def rose_by(rewards: list[float], margin: float, window: int = 4) -> bool:
    return sum(rewards[-window:]) / window > sum(rewards[:window]) / window + margin
