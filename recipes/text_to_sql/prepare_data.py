"""BIRD's public release (``train.json`` / ``dev.json``: ``db_id``, ``question``, ``evidence``,
``SQL``; one SQLite database per ``db_id`` under ``<split>_databases/<db_id>/<db_id>.sqlite``) to
the rows verl (and TRL, SkyRL) read.

    python -m recipes.text_to_sql.prepare_data --records ~/bird/train/train.json \\
        --databases ~/bird/train/train_databases --split train --out ~/data/bird

Each prompt holds the database's schema (its CREATE statements), the evidence and the question.
Every gold query is run once through the reward's read-only sandbox: records whose database is
missing or whose gold query fails, runs past the time limit or returns too many rows are counted,
listed in ``<split>.rejected.jsonl`` and left out.

``--records`` may also be a ``.jsonl`` or ``.parquet`` file or a saved Hugging Face dataset folder
of BIRD's fields. ``--format`` picks the files (default ``trl verl``: ``<split>.jsonl`` and
``<split>.parquet``); ``skyrl`` writes ``<split>.skyrl.parquet`` for the ``text_to_sql``
environment of ``recipes.skyrl_env``, which scores with this recipe's reward.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

from recipes.common import PrepReport, add_format_argument, description, prepare_rows, text_field, write_split
from recipes.text_to_sql.reward import execute

DATA_SOURCE = "bird"
ENV_CLASS = "text_to_sql"  # SkyRL's environment for these rows: recipes.skyrl_env registers it
INSTRUCTION = "Write one SQLite query that answers the question. Put it in a ```sql code block."


@functools.cache
def schema(db_path: str) -> str:
    """The database's CREATE statements, read through the sandbox."""
    result = execute(db_path, "SELECT sql FROM sqlite_master WHERE sql IS NOT NULL AND type IN ('table', 'view')")
    if not result.ok:
        raise ValueError(f"the database cannot be read: {result.error}")
    return ";\n".join(sorted(row[0] for row in result.rows)) + ";"


def prepare_record(record: object, index: int, split: str, databases: Path) -> dict:
    """One prepared row; ValueError names what is wrong with the record."""
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    db_id, question, gold_sql = (text_field(record, key) for key in ("db_id", "question", "SQL"))
    evidence = text_field(record, "evidence", required=False)
    db_path = (databases / db_id / f"{db_id}.sqlite").resolve()
    if not db_path.exists():
        raise ValueError(f"no database: {db_path}")
    gold = execute(str(db_path), gold_sql)
    if not gold.ok:
        raise ValueError(f"the gold query fails: {gold.error}")
    content = (f"Database schema:\n{schema(str(db_path))}\n\n" + (f"Evidence: {evidence}\n" if evidence else "")
               + f"Question: {question}\n\n{INSTRUCTION}")
    return {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": content}], "ability": "sql",
            "gold_sql": gold_sql, "db_path": str(db_path),
            "reward_model": {"style": "rule", "ground_truth": gold_sql},
            "extra_info": {"split": split, "index": index, "db_id": db_id, "db_path": str(db_path)}}


def main(argv: list[str] | None = None) -> PrepReport:
    parser = argparse.ArgumentParser(description=description(__doc__))
    parser.add_argument("--records", required=True, type=Path, help="BIRD's train.json or dev.json")
    parser.add_argument("--databases", required=True, type=Path, help="the <split>_databases folder")
    parser.add_argument("--split", default="train")
    add_format_argument(parser)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    for path in (args.records, args.databases):
        if not path.exists():
            parser.error(f"not found: {path}")
    rows, report = prepare_rows(args.records, lambda record, index: prepare_record(record, index, args.split,
                                                                                 args.databases))
    write_split(rows, args.out, args.split, report, args.formats, ENV_CLASS)
    return report


if __name__ == "__main__":
    main()
