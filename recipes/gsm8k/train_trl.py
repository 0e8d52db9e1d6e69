"""GRPO on GSM8K with TRL's GRPOTrainer on the Arctic backend (one GPU, no Ray cluster).

    python -m recipes.gsm8k.prepare_data --source ~/gsm8k --out ~/data/gsm8k
    python -m recipes.gsm8k.train_trl --model ~/models/qwen3-1.7b --data ~/data/gsm8k --out runs/gsm8k

A plain TRL script: the dataset is the prepared ``train.jsonl``, the reward is
``recipes.gsm8k.reward.reward``, and the only Arctic-specific line is the GRPOTrainer import.
``--config`` is a YAML file with GRPOConfig's keywords under ``trl`` and the backend's settings
under ``arctic`` (default: ``trl_h200.yaml`` beside this file); ``--set trl.max_steps=2`` overrides
one key.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml
from datasets import load_dataset
from trl import GRPOConfig

from arctic_trl import GRPOTrainer  # was: from trl import GRPOTrainer
from recipes.common import parse_value
from recipes.gsm8k.reward import reward

DEFAULT_CONFIG = Path(__file__).with_name("trl_h200.yaml")


def load_config(path: Path, overrides: list[str]) -> dict:
    """The YAML config with ``section.key=value`` overrides (values parsed as YAML)."""
    config = yaml.safe_load(path.read_text())
    for item in overrides:
        dotted, _, value = item.partition("=")
        if not value:
            raise SystemExit(f"--set {item!r}: expected key=value")
        *parents, leaf = dotted.split(".")
        if not parents or parents[0] not in config:  # a key outside the config's sections would be ignored
            raise SystemExit(f"--set {item!r}: the key must start with one of the config's sections "
                             f"({', '.join(f'{section}.' for section in config)})")
        node = config
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = parse_value(value)
    return config


def main(argv: list[str] | None = None, callbacks: list | None = None) -> GRPOTrainer:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a local model folder or a Hugging Face Hub model id")
    parser.add_argument("--data", required=True, type=Path, help="the folder prepare_data wrote")
    parser.add_argument("--out", required=True, help="TRL's output_dir")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    args = parser.parse_args(argv)
    config = load_config(args.config, args.set)
    train = load_dataset("json", data_files=str(args.data / "train.jsonl"), split="train")
    trainer = GRPOTrainer(model=args.model, reward_funcs=reward, train_dataset=train,
                          args=GRPOConfig(output_dir=args.out, **config["trl"]), arctic=config.get("arctic"),
                          callbacks=callbacks)
    trainer.train()
    return trainer


if __name__ == "__main__":
    main()
