"""What the recipes' data preparation shares: the forms of input (a release folder, one file split
in two by a seed, a Hugging Face ``datasets`` folder), the output formats and ``--help``."""

from __future__ import annotations

import importlib
import json

import pyarrow.parquet as pq
import pytest

from recipes.common import FORMATS
from recipes.gsm8k import prepare_data

from .gsm8k_data import arithmetic_records, write_release

RECIPES = ["gsm8k", "text_to_sql", "long_context_qa"]


def questions(folder, split: str) -> list[str]:
    return [json.loads(line)["prompt"][0]["content"] for line in (folder / f"{split}.jsonl").read_text().splitlines()]


def indices(folder, split: str) -> list[int]:
    """Each row's record index in the source."""
    return [row["extra_info"]["index"] for row in pq.read_table(folder / f"{split}.parquet").to_pylist()]


def write_records(path, records: list[dict]):
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif path.suffix == ".json":
        path.write_text(json.dumps(records))
    else:
        import pyarrow as pa

        pq.write_table(pa.Table.from_pylist(records), path)
    return path


def prepare(source, out, *args: str) -> dict:
    return prepare_data.main(["--source", str(source), "--out", str(out), *args])


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_one_file_is_split_in_two_by_the_seed(tmp_path, suffix):
    records = arithmetic_records(200)
    source = write_records(tmp_path / f"problems{suffix}", records)
    prepare(source, tmp_path / "a", "--test-size", "0.1", "--seed", "3")
    prepare(source, tmp_path / "b", "--test-size", "0.1", "--seed", "3")
    prepare(source, tmp_path / "c", "--test-size", "0.1", "--seed", "4")
    train, test = indices(tmp_path / "a", "train"), indices(tmp_path / "a", "test")
    assert (len(train), len(test)) == (180, 20)
    assert sorted(train + test) == list(range(200))  # each record in one split, in the source's order
    assert train == sorted(train) and test == sorted(test)
    assert (indices(tmp_path / "b", "train"), indices(tmp_path / "b", "test")) == (train, test)
    assert questions(tmp_path / "b", "test") == questions(tmp_path / "a", "test")
    assert indices(tmp_path / "c", "test") != test and len(indices(tmp_path / "c", "test")) == 20


def test_the_test_size_is_a_fraction_or_a_count(tmp_path, capsys):
    source = write_records(tmp_path / "problems.jsonl", arithmetic_records(50))
    reports = prepare(source, tmp_path / "count", "--test-size", "7")
    assert (reports["train"].kept, reports["test"].kept) == (43, 7)
    reports = prepare(source, tmp_path / "default")
    assert (reports["train"].kept, reports["test"].kept) == (45, 5)  # a tenth
    assert "problems.jsonl (test: 5 of 50 records, seed 0): kept 5 of 5 records" in capsys.readouterr().out
    for wrong in ("0", "1.5", "-3", "half"):
        with pytest.raises(SystemExit):
            prepare(source, tmp_path / "wrong", "--test-size", wrong)
    with pytest.raises(SystemExit):  # no record would be left for training
        prepare(source, tmp_path / "wrong", "--test-size", "50")
    assert "each split needs at least one" in capsys.readouterr().err


def test_a_split_keeps_each_records_index_in_the_source(tmp_path):
    records = arithmetic_records(20)
    source = tmp_path / "problems.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records[:5]) + "not json\n"
                      + "".join(json.dumps(r) + "\n" for r in records[5:]))
    reports = prepare(source, tmp_path / "out", "--test-size", "10", "--seed", "1")
    assert reports["train"].kept + reports["test"].kept == 20
    split = next(s for s in ("train", "test") if reports[s].rejected)
    rejected = json.loads((tmp_path / "out" / f"{split}.rejected.jsonl").read_text())
    assert (rejected["index"], rejected["record"]) == (5, "not json\n")
    for name in ("train", "test"):
        for row in pq.read_table(tmp_path / "out" / f"{name}.parquet").to_pylist():
            index = row["extra_info"]["index"]
            original = records[index if index < 5 else index - 1]
            assert row["prompt"][0]["content"].startswith(original["question"])


def test_hugging_face_dataset_folders(tmp_path):
    import datasets

    records = arithmetic_records(40)
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "one"))
    reports = prepare(tmp_path / "one", tmp_path / "out_one", "--test-size", "0.25")
    assert (reports["train"].kept, reports["test"].kept) == (30, 10)

    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(records[:32]),
                                   "test": datasets.Dataset.from_list(records[32:])})
    splits.save_to_disk(str(tmp_path / "two"))
    reports = prepare(tmp_path / "two", tmp_path / "out_two")
    assert (reports["train"].kept, reports["test"].kept) == (32, 8)  # its own splits, as they are
    assert [q.split(" Let's")[0] for q in questions(tmp_path / "out_two", "test")] == [
        r["question"] for r in records[32:]]
    with pytest.raises(SystemExit):  # --test-size would be ignored: refused instead
        prepare(tmp_path / "two", tmp_path / "out_wrong", "--test-size", "0.5")

    datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}).save_to_disk(str(tmp_path / "train_only"))
    reports = prepare(tmp_path / "train_only", tmp_path / "out_train_only", "--test-size", "4")
    assert (reports["train"].kept, reports["test"].kept) == (36, 4)


def test_the_release_folder_still_works_and_a_half_one_is_named(tmp_path, capsys):
    source = write_release(tmp_path / "gsm8k", arithmetic_records(6), arithmetic_records(3, seed=1))
    reports = prepare(source, tmp_path / "out")
    assert (reports["train"].kept, reports["test"].kept) == (6, 3)
    with pytest.raises(SystemExit):
        prepare(source, tmp_path / "out", "--test-size", "0.5")
    (source / "test.jsonl").unlink()
    with pytest.raises(SystemExit):
        prepare(source, tmp_path / "out")
    assert "no test split (test.jsonl, .json or .parquet) beside train.jsonl" in capsys.readouterr().err


def test_the_default_formats_are_trls_and_verls_and_skyrl_is_one_more(tmp_path):
    source = write_release(tmp_path / "gsm8k", arithmetic_records(6), arithmetic_records(3, seed=1))
    prepare(source, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "test.jsonl", "test.parquet", "train.jsonl", "train.parquet"]
    prepare(source, tmp_path / "out", "--format", "skyrl")  # the earlier run's files go: one run's rows
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["test.skyrl.parquet", "train.skyrl.parquet"]
    rows = pq.read_table(tmp_path / "out" / "train.skyrl.parquet").to_pylist()
    gold = arithmetic_records(6)[0]["answer"].split("#### ")[1]
    assert rows[0]["env_class"] == "gsm8k" and rows[0]["reward_spec"] == {"method": "rule", "ground_truth": gold}
    assert set(rows[0]) == {"data_source", "prompt", "env_class", "reward_spec", "extra_info"}
    prepare(source, tmp_path / "all", "--format", *FORMATS)
    assert len(list((tmp_path / "all").iterdir())) == 2 * len(FORMATS)


@pytest.mark.parametrize(("answer", "ground_truth"), [
    ("#### 72", "72"), ("#### -3", "-3"), ("#### 8.00", "8.00"),  # plain: as written
    ("#### 1,234", "1234"), ("#### $1,200", "1200"), ("#### 5 apples", "5"), ("#### 3/4", "0.75"),
    ("#### \u22124", "-4"), ("#### 2/3", "2/3"),  # no finite decimal form: as written
])
def test_the_ground_truth_is_a_plain_number_for_skyrls_text_match(tmp_path, answer, ground_truth):
    source = write_records(tmp_path / "one.jsonl", [{"question": "Q?", "answer": answer}] * 2)
    prepare(source, tmp_path / "out", "--test-size", "1", "--format", "skyrl", "verl")
    for name in ("train.skyrl.parquet", "train.parquet"):
        row = pq.read_table(tmp_path / "out" / name).to_pylist()[0]
        assert (row.get("reward_spec") or row.get("reward_model"))["ground_truth"] == ground_truth


@pytest.mark.parametrize("recipe", RECIPES)
def test_help_describes_the_script_in_whole_sentences(recipe, capsys):
    module = importlib.import_module(f"recipes.{recipe}.prepare_data")
    with pytest.raises(SystemExit):
        module.main(["--help"])
    text = capsys.readouterr().out
    description = " ".join(text.split("\n\n")[1].split())  # the paragraph after the usage lines
    assert description.endswith(".") and description.count("(") == description.count(")"), description
    assert "``" not in description  # the docstring's markup is not for a terminal
    assert "--format" in text and "skyrl" in text


def test_gsm8k_help_says_what_the_answer_ends_in(capsys):
    with pytest.raises(SystemExit):
        prepare_data.main(["--help"])
    description = " ".join(capsys.readouterr().out.split("\n\n")[1].split())
    assert description == ("GSM8K-format records (question, answer ending in #### <number>) to the rows TRL, "
                           "verl and SkyRL read.")
