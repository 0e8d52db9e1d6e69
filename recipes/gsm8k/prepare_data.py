"""GSM8K's public release (``train.jsonl`` / ``test.jsonl``: ``question``, ``answer`` ending in
``#### <number>``) to the rows TRL and verl read.

    python -m recipes.gsm8k.prepare_data --source ~/gsm8k --out ~/data/gsm8k

Writes ``<split>.jsonl`` (TRL: ``prompt`` as chat messages, ``answer``) and ``<split>.parquet``
(verl: ``data_source``, ``prompt``, ``ability``, ``reward_model.ground_truth``, ``extra_info``) per
split; records without a question or a numeric ``####`` answer are counted, listed in
``<split>.rejected.jsonl`` and left out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from recipes.common import PrepReport, prepare_rows, write_split
from recipes.gsm8k.reward import gold_answer

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."


def prepare_record(record: object, index: int, split: str) -> dict:
    """One prepared row; ValueError names what is wrong with the record."""
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    question, answer = record.get("question"), record.get("answer")
    if not isinstance(question, str) or not question.strip():
        raise ValueError("no question")
    if not isinstance(answer, str):
        raise ValueError("no answer")
    gold = gold_answer(answer)
    prompt = [{"role": "user", "content": f"{question.strip()} {INSTRUCTION}"}]
    return {"data_source": DATA_SOURCE, "prompt": prompt, "answer": gold, "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": gold}, "extra_info": {"split": split, "index": index}}


def prepare_split(path: Path, out: Path, split: str) -> PrepReport:
    rows, report = prepare_rows(path, lambda record, index: prepare_record(record, index, split))
    write_split(rows, out, split, report)
    return report


def main(argv: list[str] | None = None) -> dict[str, PrepReport]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", required=True, type=Path, help="folder with GSM8K's train.jsonl / test.jsonl")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    splits = {split: args.source / f"{split}.jsonl" for split in ("train", "test")}
    missing = [str(p) for p in splits.values() if not p.exists()]
    if missing:
        parser.error(f"not found: {', '.join(missing)}")
    return {split: prepare_split(path, args.out, split) for split, path in splits.items()}


if __name__ == "__main__":
    main()
