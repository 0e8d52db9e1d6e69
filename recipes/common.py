"""What every recipe's data preparation shares: reading a public release's records, counting and
keeping the ones that cannot be used (never dropped silently), and writing the prepared rows in
the formats the frameworks read (jsonl for TRL, parquet for verl)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml


def parse_value(text: str) -> object:
    """A command-line value as YAML reads it, except that YAML 1.1's yes/no/on/off stay words
    (``--set trl.save_strategy=no`` means the string)."""
    if text.strip().lower() in {"yes", "no", "on", "off", "y", "n"}:
        return text
    return yaml.safe_load(text)


def read_records(path: str | Path) -> Iterator[tuple[int, object]]:
    """``(index, record)`` of a ``.jsonl`` file (one record per line; a line that is not JSON
    yields its text, for the caller to reject) or of a ``.json`` file holding a list."""
    path = Path(path)
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as lines:
            for index, line in enumerate(lines):
                if line.strip():
                    try:
                        yield index, json.loads(line)
                    except json.JSONDecodeError:
                        yield index, line
        return
    records = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(records, list):
        raise ValueError(f"{path}: expected a JSON list of records")
    yield from enumerate(records)


@dataclass
class PrepReport:
    """How many records were kept, and each rejected one with its reason."""

    source: str
    kept: int = 0
    rejected: Counter = field(default_factory=Counter)
    rejects: list[dict] = field(default_factory=list)

    def keep(self) -> None:
        self.kept += 1

    def reject(self, index: int, reason: str, record: object) -> None:
        self.rejected[reason] += 1
        self.rejects.append({"index": index, "reason": reason, "record": record})

    def withdraw(self, index: int, reason: str, record: object) -> None:
        """Reject a record kept earlier (a later stage found it unusable)."""
        self.kept -= 1
        self.reject(index, reason, record)

    def summary(self) -> str:
        total = self.kept + sum(self.rejected.values())
        lines = [f"{self.source}: kept {self.kept} of {total} records"]
        lines += [f"  rejected {count}: {reason}" for reason, count in self.rejected.most_common()]
        return "\n".join(lines)

    def write_rejects(self, folder: Path, split: str) -> Path | None:
        if not self.rejects:
            return None
        path = folder / f"{split}.rejected.jsonl"
        with path.open("w", encoding="utf-8") as out:
            for row in self.rejects:
                out.write(json.dumps(row, default=str) + "\n")
        return path


def prepare_rows(path: str | Path, prepare) -> tuple[list, PrepReport]:
    """``prepare(record, index)`` over the records of ``path``; a ValueError rejects the record
    with its message's first clause as the reason."""
    report, rows = PrepReport(str(path)), []
    for index, record in read_records(path):
        try:
            rows.append(prepare(record, index))
            report.keep()
        except ValueError as exc:
            report.reject(index, str(exc).split(":")[0], record)
    return rows, report


def write_split(rows: list[dict], folder: str | Path, split: str, report: PrepReport) -> None:
    """``<split>.jsonl`` and ``<split>.parquet`` of ``rows``, the rejected records beside them, and
    the report printed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / f"{split}.jsonl").open("w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")
    if rows:
        pq.write_table(pa.Table.from_pylist(rows), folder / f"{split}.parquet")
    rejects = report.write_rejects(folder, split)
    print(report.summary() + (f"\n  rejected records: {rejects}" if rejects else ""))
