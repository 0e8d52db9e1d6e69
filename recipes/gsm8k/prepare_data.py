"""GSM8K-format records (``question``, ``answer`` ending in ``#### <number>``) to the rows TRL,
verl and SkyRL read.

    python -m recipes.gsm8k.prepare_data --source ~/gsm8k --out ~/data/gsm8k
    python -m recipes.gsm8k.prepare_data --source my_problems.jsonl --test-size 0.1 --seed 0 \\
        --format trl verl skyrl --out ~/data/my_problems

``--source`` is GSM8K's release (a folder with ``train.jsonl`` and ``test.jsonl``; ``.json`` or
``.parquet`` files work too), a folder a Hugging Face ``DatasetDict`` with ``train`` and ``test``
was saved to (both used as they are), or one set of records: a ``.jsonl``/``.json``/``.parquet``
file or a saved ``Dataset`` folder, split into train and test by ``--test-size`` (a fraction or a
count, default a tenth) drawn with ``--seed``.

Writes per split, as ``--format`` asks (default: ``trl verl``): ``<split>.jsonl`` (TRL: ``prompt``
as chat messages, ``answer``), ``<split>.parquet`` (verl: ``data_source``, ``prompt``, ``ability``,
``reward_model.ground_truth``, ``extra_info``), ``<split>.skyrl.parquet`` (SkyRL: ``prompt``,
``env_class`` ``gsm8k``, skyrl-gym's GSM8K environment, ``reward_spec.ground_truth``,
``extra_info``). Records without a question or a numeric ``####`` answer are counted, listed in
``<split>.rejected.jsonl`` and left out.
"""

from __future__ import annotations

import argparse
import re
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

from recipes.common import (PrepReport, SourceSplit, add_format_argument, description, parse_test_size,
                            prepare_records, read_splits, write_split)
from recipes.gsm8k.reward import gold_answer, parse_number

DATA_SOURCE = "openai/gsm8k"
ENV_CLASS = "gsm8k"  # skyrl-gym's own GSM8K environment: the number after "####" equal to reward_spec's
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
    gold = plain_number(gold_answer(answer))
    prompt = [{"role": "user", "content": f"{question.strip()} {INSTRUCTION}"}]
    return {"data_source": DATA_SOURCE, "prompt": prompt, "answer": gold, "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": gold}, "extra_info": {"split": split, "index": index}}


def plain_number(gold: str) -> str:
    """``gold`` as digits, a sign and a point ("$1,200" -> "1200", "5 apples" -> "5"): skyrl-gym's
    GSM8K environment compares the completion's "#### <digits>" (commas dropped) with the ground
    truth as text, so a currency sign or a unit there would never match. The TRL and verl rewards
    compare numbers: they score the plain form the same. A number with no finite decimal form (2/3)
    stays as it is."""
    if re.fullmatch(r"-?[0-9.]+", gold):
        return gold  # already plain (GSM8K's own answers): kept as written, "8.00" included
    value = parse_number(gold)
    decimal = Decimal(value.numerator) / Decimal(value.denominator)
    return format(decimal.normalize(), "f") if Fraction(decimal) == value else gold


def prepare_split(source: SourceSplit, out: Path, split: str, formats: list[str]) -> PrepReport:
    rows, report = prepare_records(source.label, source.records,
                                   lambda record, index: prepare_record(record, index, split))
    write_split(rows, out, split, report, formats, ENV_CLASS)
    return report


def main(argv: list[str] | None = None) -> dict[str, PrepReport]:
    parser = argparse.ArgumentParser(description=description(__doc__))
    parser.add_argument("--source", required=True, type=Path,
                        help="a folder with train.jsonl and test.jsonl, a Hugging Face dataset folder, or one "
                             ".jsonl/.json/.parquet file to split")
    parser.add_argument("--test-size", type=parse_test_size, default=None,
                        help="for a source of one set of records: the test split's share (0.1) or count (20); "
                             "default 0.1")
    parser.add_argument("--seed", type=int, default=0, help="the seed drawing the test split")
    add_format_argument(parser)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    try:
        splits = read_splits(args.source, size=args.test_size, seed=args.seed)
    except ValueError as exc:
        parser.error(str(exc))
    return {split: prepare_split(source, args.out, split, args.formats) for split, source in splits.items()}


if __name__ == "__main__":
    main()
