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
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SystemExit(f"the value {text!r} is not valid YAML: {getattr(exc, 'problem', None) or exc}") from None


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
        """Count the record under its reason's first clause (the summary stays one line per kind of
        problem) and keep the full reason (the SQLite error, the path) for the rejected file."""
        self.rejected[reason.split(":")[0]] += 1
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
        path = folder / f"{split}.rejected.jsonl"
        if not self.rejects:
            path.unlink(missing_ok=True)  # an earlier run's rejects would be mistaken for this one's
            return None
        with path.open("w", encoding="utf-8") as out:
            for row in self.rejects:
                out.write(json.dumps(row, default=str) + "\n")
        return path


def prepare_rows(path: str | Path, prepare) -> tuple[list, PrepReport]:
    """``prepare(record, index)`` over the records of ``path``; a ValueError rejects the record
    with its message as the reason."""
    report, rows = PrepReport(str(path)), []
    for index, record in read_records(path):
        try:
            rows.append(prepare(record, index))
            report.keep()
        except ValueError as exc:
            report.reject(index, str(exc), record)
    return rows, report


def text_field(record: dict, key: str, *, required: bool = True) -> str:
    """``record[key]`` stripped; ValueError naming the field when it is not text (or, when
    ``required``, missing or blank). An optional field that is absent or null is ``""``."""
    value = record.get(key)
    if value is None and not required:
        return ""
    if value is not None and not isinstance(value, str):
        raise ValueError(f"malformed {key}: expected text, got {type(value).__name__}")
    if required and not (value or "").strip():
        raise ValueError(f"missing {key}")
    return value.strip()


def list_field(record: dict, key: str) -> list:
    """``record[key]`` when it is a list (``[]`` when absent); ValueError naming the field otherwise."""
    value = record.get(key, [])
    if not isinstance(value, list):
        raise ValueError(f"malformed {key}: expected a list, got {type(value).__name__}")
    return value


def write_split(rows: list[dict], folder: str | Path, split: str, report: PrepReport) -> None:
    """``<split>.jsonl`` and ``<split>.parquet`` of ``rows``, the rejected records beside them, and
    the report printed. SystemExit when no record was kept: an empty split is a wrong source or
    databases folder far more often than a wanted result, and training on it would fail later."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    outputs = (folder / f"{split}.jsonl", folder / f"{split}.parquet")
    for path in outputs:  # never leave an earlier run's rows beside this run's report
        path.unlink(missing_ok=True)
    rejects = report.write_rejects(folder, split)
    print(report.summary() + (f"\n  rejected records: {rejects}" if rejects else ""))
    if not rows:
        why = f"each record's reason is in {rejects}" if rejects else "it holds no record"
        raise SystemExit(f"{split}: no record of {report.source} could be used ({why}); "
                         f"{outputs[0].name} and {outputs[1].name} were not written")
    with outputs[0].open("w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")
    pq.write_table(pa.Table.from_pylist(rows), outputs[1])
