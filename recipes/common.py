"""What every recipe's data preparation shares: reading records (a public release's files, one
file to split in two, a Hugging Face ``datasets`` folder), counting and keeping the ones that
cannot be used (never dropped silently), and writing the prepared rows in the formats the
frameworks read (jsonl for TRL, parquet for verl, parquet in SkyRL's layout for SkyRL)."""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

RECORD_FILES = (".jsonl", ".json", ".parquet")
# Each output format's file, per split. SkyRL's has a name of its own: its rows differ from verl's
# and both may sit in one folder.
FORMATS = {"trl": "{split}.jsonl", "verl": "{split}.parquet", "skyrl": "{split}.skyrl.parquet"}
DEFAULT_FORMATS = ("trl", "verl")


def description(doc: str) -> str:
    """A module docstring's first paragraph as one line of plain text, for ``--help`` (its first
    line alone can stop mid-sentence)."""
    return " ".join(doc.strip().split("\n\n")[0].replace("``", "").split())


def add_format_argument(parser: argparse.ArgumentParser) -> None:
    files = ", ".join(f"{name}: {pattern.format(split='<split>')}" for name, pattern in FORMATS.items())
    parser.add_argument("--format", dest="formats", nargs="+", choices=list(FORMATS), default=list(DEFAULT_FORMATS),
                        metavar="FORMAT", help=f"the files to write, one or more of {files} "
                                               f"(default: {' '.join(DEFAULT_FORMATS)})")


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
    yields its text, for the caller to reject), a ``.json`` file holding a list, a ``.parquet``
    file, or a folder a Hugging Face ``Dataset`` was saved to (``save_to_disk``)."""
    path = Path(path)
    if path.is_dir():
        yield from enumerate(_saved_dataset(path))
        return
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        yield from enumerate(pq.read_table(path).to_pylist())
        return
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


def _load_from_disk(path: Path):
    """The ``Dataset`` or ``DatasetDict`` saved in ``path``; ValueError when it holds neither."""
    if not any((path / name).exists() for name in ("dataset_info.json", "dataset_dict.json")):
        raise ValueError(f"{path}: neither a file of records nor a folder a Hugging Face dataset was saved to")
    import datasets  # only for this form of input: the other forms need no datasets install

    return datasets.load_from_disk(str(path))


def _saved_dataset(path: Path):
    """The ``Dataset`` saved in ``path``; a ``DatasetDict`` of one split stands for that split."""
    saved = _load_from_disk(path)
    if hasattr(saved, "keys"):  # a DatasetDict
        if len(saved) != 1:
            raise ValueError(f"{path} holds the splits {', '.join(saved)}: name one of their folders "
                             f"(e.g. {path / next(iter(saved))})")
        return next(iter(saved.values()))
    return saved


def parse_test_size(text: str) -> float | int:
    """``--test-size``: a fraction of the records (between 0 and 1) or a count of them (1 or more)."""
    try:
        number = float(text)
    except ValueError:
        number = -1.0
    if 0 < number < 1:
        return number
    if number >= 1 and number.is_integer():
        return int(number)
    raise argparse.ArgumentTypeError(f"expected a fraction between 0 and 1 or a whole count, got {text!r}")


def split_records(records: list, size: float | int, seed: int) -> tuple[list, list]:
    """``(train, test)`` of ``records``: ``size`` of them (a count, or a fraction rounded) drawn at
    random with ``seed`` for the test split, the rest for training, each in the source's order."""
    count = size if isinstance(size, int) else round(size * len(records))
    if not 0 < count < len(records):
        raise ValueError(f"a test split of {size} from {len(records)} records leaves {count} for testing and "
                         f"{len(records) - count} for training: each split needs at least one")
    drawn = set(random.Random(seed).sample(range(len(records)), count))
    return ([r for i, r in enumerate(records) if i not in drawn], [r for i, r in enumerate(records) if i in drawn])


@dataclass
class SourceSplit:
    """One split's records and where they came from (the report's first line names it)."""

    label: str
    records: list[tuple[int, object]]


def read_splits(source: str | Path, *, size: float | int | None = None, seed: int = 0,
                names: tuple[str, str] = ("train", "test")) -> dict[str, SourceSplit]:
    """The ``names`` splits (train, test) of ``source``. A source that has them is read as it is: a
    folder with a file per split (``train.jsonl``, ``test.parquet``, ...), or a folder a
    ``DatasetDict`` with those splits was saved to. Any other source is one set of records (a
    ``.jsonl``/``.json``/``.parquet`` file, a saved ``Dataset`` or one-split ``DatasetDict``) and
    is split by ``size`` (default: a tenth) and ``seed``. ValueError on a source of neither form,
    or on ``size`` for a source that has its splits already."""
    source = Path(source)
    if not source.exists():
        raise ValueError(f"not found: {source}")
    given = _given_splits(source, names)
    if given is not None:
        if size is not None:  # refused rather than ignored: the user expects a split that would not happen
            raise ValueError(f"{source} has its own {' and '.join(names)} splits: --test-size splits one set of "
                             f"records (a file, or a dataset folder of one split)")
        return given
    records = list(read_records(source))
    size = 0.1 if size is None else size
    splits = dict(zip(names, split_records(records, size, seed), strict=True))
    return {name: SourceSplit(f"{source} ({name}: {len(part)} of {len(records)} records, seed {seed})", part)
            for name, part in splits.items()}


def _given_splits(source: Path, names: tuple[str, ...]) -> dict[str, SourceSplit] | None:
    """The splits ``source`` has already (a file per split, or a saved DatasetDict holding them),
    else None."""
    if source.is_file():
        return None
    files = {name: next((source / f"{name}{suffix}" for suffix in RECORD_FILES
                         if (source / f"{name}{suffix}").exists()), None) for name in names}
    if all(files.values()):
        return {name: SourceSplit(str(path), list(read_records(path))) for name, path in files.items()}
    if (source / "dataset_dict.json").exists():
        saved = _load_from_disk(source)
        if all(name in saved for name in names):
            return {name: SourceSplit(f"{source} [{name}]", list(enumerate(saved[name]))) for name in names}
        if len(saved) == 1:
            return None  # one set of records: read_records reads it
        raise ValueError(f"{source} holds the splits {', '.join(saved)}, not {' and '.join(names)}: name one of "
                         f"their folders (e.g. {source / next(iter(saved))}) to split it")
    if any(files.values()):
        missing = [name for name, path in files.items() if path is None]
        raise ValueError(f"{source}: no {' or '.join(missing)} split ({missing[0]}.jsonl, .json or .parquet) "
                         f"beside {', '.join(path.name for path in files.values() if path)}")
    if not (source / "dataset_info.json").exists():
        raise ValueError(f"{source}: expected a file per split ({', '.join(f'{n}.jsonl' for n in names)}; or "
                         f".json, .parquet), a folder a Hugging Face dataset was saved to, or one file of records")
    return None  # a saved Dataset: one set of records


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
    return prepare_records(str(path), read_records(path), prepare)


def prepare_records(source: str, records: Iterable[tuple[int, object]], prepare) -> tuple[list, PrepReport]:
    """``prepare(record, index)`` over ``(index, record)`` pairs read from ``source``; a ValueError
    rejects the record with its message as the reason."""
    report, rows = PrepReport(source), []
    for index, record in records:
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


def skyrl_row(row: dict, env_class: str) -> dict:
    """A prepared row as SkyRL's PromptDataset reads it (the layout of SkyRL's
    ``examples/gsm8k/gsm8k_dataset.py``): the chat ``prompt``, the skyrl-gym ``env_class`` that
    scores it, and ``reward_spec.ground_truth``. The other columns reach the environment as extras."""
    return {"data_source": row["data_source"], "prompt": row["prompt"], "env_class": env_class,
            "reward_spec": {"method": "rule", "ground_truth": row["reward_model"]["ground_truth"]},
            "extra_info": row["extra_info"]}


def write_split(rows: list[dict], folder: str | Path, split: str, report: PrepReport,
                formats: Iterable[str] = DEFAULT_FORMATS, env_class: str | None = None) -> None:
    """``rows`` in each of ``formats`` (see :data:`FORMATS`; SkyRL's rows name ``env_class``), the
    rejected records beside them, and the report printed. SystemExit when no record was kept: an
    empty split is a wrong source or databases folder far more often than a wanted result, and
    training on it would fail later."""
    folder = Path(folder)
    outputs = {name: folder / FORMATS[name].format(split=split) for name in formats}
    if "skyrl" in outputs and not env_class:
        raise ValueError("SkyRL's rows need the env_class that scores them")
    folder.mkdir(parents=True, exist_ok=True)
    for pattern in FORMATS.values():  # never leave an earlier run's rows, of any format, beside this run's report
        (folder / pattern.format(split=split)).unlink(missing_ok=True)
    rejects = report.write_rejects(folder, split)
    print(report.summary() + (f"\n  rejected records: {rejects}" if rejects else ""))
    if not rows:
        why = f"each record's reason is in {rejects}" if rejects else "it holds no record"
        names = [path.name for path in outputs.values()]
        written = ", ".join(names[:-1]) + " and " + names[-1] + " were" if len(names) > 1 else names[0] + " was"
        raise SystemExit(f"{split}: no record of {report.source} could be used ({why}); {written} not written")
    for name, path in outputs.items():
        write_rows([skyrl_row(row, env_class) for row in rows] if name == "skyrl" else rows, path)


def write_rows(rows: list[dict], path: Path) -> None:
    """``rows`` as a ``.jsonl`` file (one JSON object a line) or a ``.parquet`` file."""
    if path.suffix == ".jsonl":
        with path.open("w", encoding="utf-8") as out:  # line by line: long-context rows add up to gigabytes
            for row in rows:
                out.write(json.dumps(row) + "\n")
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
