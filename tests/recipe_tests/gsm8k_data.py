"""Small data sets in GSM8K's public format (``question``, ``answer`` with ``#### <number>``)."""

from __future__ import annotations

import json
import random
from pathlib import Path

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def arithmetic_records(count: int, seed: int = 0, answer: int | None = None) -> list[dict]:
    """Questions like "What is 3 + 4?" with a GSM8K-style worked answer; ``answer`` fixes every
    result to one number (a task a tiny random model can learn)."""
    rng, records = random.Random(seed), []
    while len(records) < count:
        a, b, op = rng.randrange(1, 10), rng.randrange(1, 10), rng.choice(list(OPERATIONS))
        result = OPERATIONS[op](a, b)
        if answer is not None and result != answer:
            continue
        records.append({"question": f"What is {a} {op} {b}?",
                        "answer": f"{a} {op} {b} = <<{a}{op}{b}={result}>>{result}\n#### {result}"})
    return records


def write_release(folder: Path, train: list, test: list, extra_train_lines: list[str] = ()) -> Path:
    """GSM8K's release layout: ``train.jsonl`` and ``test.jsonl`` (plus raw lines, e.g. broken ones)."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, records in (("train", train), ("test", test)):
        lines = [json.dumps(r) for r in records] + (list(extra_train_lines) if split == "train" else [])
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return folder
