"""The text-to-SQL recipe: execution-match reward, its read-only sandbox against adversarial
queries (each scores 0 within the time limit and the database file stays byte for byte the same),
and BIRD-format data preparation."""

from __future__ import annotations

import hashlib
import json
import time

import pyarrow.parquet as pq
import pytest

from recipes.text_to_sql import prepare_data
from recipes.text_to_sql import reward as sql_reward
from recipes.text_to_sql.reward import compute_score, execute, extract_sql, reward, score

from .learning import grpo_rewards, rose_by
from .sql_data import GOLD, make_database


@pytest.fixture
def database(tmp_path):
    return make_database(tmp_path / "concert" / "concert.sqlite")


def digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()



@pytest.mark.parametrize(("completion", "expected"), [
    ("```sql\nSELECT COUNT(id) FROM singer WHERE country='Peru'\n```", 1.0),
    # Any language tag on the fence line is dropped, not only "sql": "```sqlite" is no "ite" query.
    ("```sqlite\nSELECT COUNT(id) FROM singer WHERE country='Peru'\n```", 1.0),
    ("```sqlite3\nSELECT COUNT(id) FROM singer WHERE country='Peru'\n```", 1.0),
    ("```postgresql \nSELECT COUNT(id) FROM singer WHERE country='Peru'\n```", 1.0),
    ("```SQL\nSELECT COUNT(id) FROM singer WHERE country='Peru'```", 1.0),
    ("```\nSELECT COUNT(id) FROM singer WHERE country='Peru'\n```", 1.0),
    ("```SELECT\nCOUNT(id) FROM singer WHERE country='Peru'\n```", 1.0),  # a query's first word is no tag
    ("Here it is. SQL: select count(*) from singer where country = 'Peru'", 1.0),
    ("select count(*) from singer where country = 'Japan'", 0.0),
    ("SELECT name FROM nowhere", 0.0),
    ("not sql at all", 0.0),
])
def test_execution_match(database, completion, expected):
    assert score(completion, GOLD, database) == expected
    assert compute_score("bird", completion, GOLD, {"db_path": database}) == expected


def test_rows_compare_as_sets_and_trl_entry_point(database):
    gold = "SELECT id FROM singer WHERE id < 3 ORDER BY id"
    assert reward(["SELECT id FROM singer WHERE id IN (2, 1, 0) ORDER BY id DESC", "SELECT 0, 1, 2"],
                  gold_sql=[gold] * 2, db_path=[database] * 2) == [1.0, 0.0]
    assert extract_sql("text\n```sql\nSELECT 1\n```\nmore ```SELECT 2```") == "SELECT 2"
    with pytest.raises(ValueError, match="db_path"):
        compute_score("bird", "SELECT 1", GOLD, {})


NO_ROWS = "SELECT name FROM singer WHERE country = 'Mars'"


@pytest.mark.parametrize("completion", ["", "```sql\n```", "SQL: ;", "```sql\n-- no idea\n```",
                                        "/* nothing */ ;", "```sql\n/* unterminated\n```"])
def test_an_empty_query_scores_zero_even_when_the_gold_query_returns_no_rows(database, completion):
    assert score(completion, NO_ROWS, database) == 0.0
    assert not execute(database, extract_sql(completion)).ok


def test_a_query_returning_no_rows_still_matches_a_gold_query_returning_none(database):
    assert score("```sql\nSELECT name FROM singer WHERE age > 1000 -- nobody\n```", NO_ROWS, database) == 1.0


ADVERSARIAL = [
    "DROP TABLE singer",
    "DELETE FROM singer",
    "UPDATE singer SET age = 0",
    "INSERT INTO singer VALUES (99999, 'x', 'y', 1)",
    "CREATE TABLE evil (x)",
    "ATTACH DATABASE '/tmp/evil.sqlite' AS evil",
    "PRAGMA writable_schema = 1",
    "PRAGMA query_only = OFF",
    "SELECT 1; DROP TABLE singer",
    "SELECT load_extension('/tmp/evil.so')",
    "VACUUM INTO '/tmp/copy.sqlite'",
    # A recursive CTE that never ends, and 3,200^3 rows counted: both stopped at the time limit.
    "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT count(*) FROM r",
    "SELECT count(*) FROM singer a, singer b, singer c",
    # 10^7 rows returned: stopped at the row cap.
    "SELECT * FROM singer a, singer b",
    # Memory: a blob that grows without end, and one huge blob at once.
    "WITH RECURSIVE r(n, s) AS (SELECT 1, zeroblob(1000000) UNION ALL SELECT n + 1, s || zeroblob(1000000) FROM r) "
    "SELECT max(length(s)) FROM r",
    "SELECT length(zeroblob(2000000000))",
]


def test_adversarial_queries_score_zero_and_leave_the_database_alone(database, monkeypatch):
    monkeypatch.setattr(sql_reward, "TIME_LIMIT_S", 1.0)
    before = digest(database)
    for sql in ADVERSARIAL:
        started = time.monotonic()
        assert score(sql, GOLD, database) == 0.0, sql
        assert time.monotonic() - started < 1.0 + sql_reward.KILL_MARGIN_S, sql
        assert not execute(database, sql).ok
    assert digest(database) == before
    assert score(GOLD, GOLD, database) == 1.0  # still readable, still the same


def test_prepare_bird_records(tmp_path, database):
    databases = tmp_path  # <databases>/<db_id>/<db_id>.sqlite
    records = [
        {"db_id": "concert", "question": "How many singers are from Peru?", "evidence": "Peru is a country",
         "SQL": GOLD},
        {"db_id": "concert", "question": "Names?", "evidence": "", "SQL": "SELECT name FROM singer WHERE id < 2"},
        {"db_id": "missing_db", "question": "Q?", "evidence": "", "SQL": "SELECT 1"},
        {"db_id": "concert", "question": "Q?", "evidence": "", "SQL": "SELECT nope FROM singer"},
        {"db_id": "concert", "question": "", "SQL": "SELECT 1"},
        "a string",
        {"db_id": "concert", "question": "Q?", "evidence": 5, "SQL": GOLD},
        {"db_id": "concert", "question": "Q?", "evidence": None, "SQL": "-- only a comment"},
        {"db_id": ["concert"], "question": "Q?", "SQL": GOLD},
    ]
    source = tmp_path / "train.json"
    source.write_text(json.dumps(records))
    report = prepare_data.main(["--records", str(source), "--databases", str(databases), "--split", "train",
                                "--out", str(tmp_path / "out")])
    assert report.kept == 2
    assert report.rejected == {"no database": 1, "the gold query fails": 2, "missing question": 1,
                               "not a JSON object": 1, "malformed evidence": 1, "malformed db_id": 1}
    rejected = [json.loads(line) for line in (tmp_path / "out" / "train.rejected.jsonl").read_text().splitlines()]
    reasons = {row["index"]: row["reason"] for row in rejected}  # in full, not only their first clause
    assert reasons[2] == f"no database: {(databases / 'missing_db' / 'missing_db.sqlite').resolve()}"
    assert reasons[3] == "the gold query fails: OperationalError: no such column: nope"
    assert reasons[6] == "malformed evidence: expected text, got int"
    assert reasons[7] == "the gold query fails: the query is empty"
    rows = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    prompt = rows[0]["prompt"][0]["content"]
    assert "CREATE TABLE singer" in prompt and "Evidence: Peru is a country" in prompt and "How many" in prompt
    assert rows[0]["extra_info"]["db_path"] == database
    assert compute_score("bird", f"```sql\n{GOLD}\n```", rows[0]["reward_model"]["ground_truth"],
                         rows[0]["extra_info"]) == 1.0


def test_a_split_with_no_usable_record_fails_and_leaves_no_rows_behind(tmp_path, database):
    good = tmp_path / "good.json"
    good.write_text(json.dumps([{"db_id": "concert", "question": "How many?", "SQL": GOLD}]))
    out = tmp_path / "out"
    prepare_data.main(["--records", str(good), "--databases", str(tmp_path), "--out", str(out)])
    assert (out / "train.parquet").exists() and not (out / "train.rejected.jsonl").exists()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"db_id": "elsewhere", "question": "Q?", "SQL": GOLD}]))
    refused = (r"train: no record of .*bad.json could be used \(each record's reason is in "
               r".*train.rejected.jsonl\); train.jsonl and train.parquet were not written")
    with pytest.raises(SystemExit, match=refused):
        prepare_data.main(["--records", str(bad), "--databases", str(tmp_path), "--out", str(out)])
    assert sorted(path.name for path in out.iterdir()) == ["train.rejected.jsonl"]  # the earlier rows are gone
    bad.write_text("[]")
    with pytest.raises(SystemExit, match="could be used \\(it holds no record\\)"):
        prepare_data.main(["--records", str(bad), "--databases", str(tmp_path), "--out", str(out)])
    assert not list(out.iterdir())


def sft_on_the_answer_format(policy, out, prompts: list[list[dict]], steps: int = 80):
    """A few steps of plain supervised fine-tuning that teach the tiny random policy the answer's
    form ("SELECT <digit>") with random digits: it then writes queries that run, mostly wrong."""
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(policy), AutoModelForCausalLM.from_pretrained(policy)
    optimizer, rng = torch.optim.AdamW(model.parameters(), lr=3e-3), random.Random(0)
    torch.manual_seed(0)
    for _ in range(steps):
        batch = []
        for prompt in rng.sample(prompts, 4):
            text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            head = tokenizer(text, add_special_tokens=False)["input_ids"]
            answer = tokenizer(f"SELECT {rng.randrange(10)}{tokenizer.eos_token}", add_special_tokens=False)["input_ids"]
            batch.append((head, answer))
        loss = 0.0
        for head, answer in batch:
            ids = torch.tensor([head + answer])
            labels = ids.clone()
            labels[0, : len(head)] = -100
            loss = loss + model(input_ids=ids, labels=labels).loss / len(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.slow
def test_the_sql_reward_rises_on_a_learnable_task(tiny_policy, tmp_path):
    """Every question's gold query returns 7: after a short SFT on the form "SELECT <digit>", GRPO
    through TRL on Arctic with the execution-match reward learns the digit."""
    make_database(tmp_path / "db" / "concert" / "concert.sqlite", rows=280)  # 7 singers of each age
    records = [{"db_id": "concert", "question": f"How many singers are {age} years old?", "evidence": "",
                "SQL": f"SELECT count(*) FROM singer WHERE age = {age}"} for age in range(20, 52)]
    (tmp_path / "train.json").write_text(json.dumps(records))
    prepare_data.main(["--records", str(tmp_path / "train.json"), "--databases", str(tmp_path / "db"),
                       "--out", str(tmp_path / "data")])
    prompts = [json.loads(line)["prompt"] for line in (tmp_path / "data" / "train.jsonl").read_text().splitlines()]
    policy = sft_on_the_answer_format(tiny_policy, tmp_path / "sft", prompts)
    rewards = grpo_rewards(policy, reward, tmp_path / "data", tmp_path / "run", steps=24, lr=5e-4,
                           completion_tokens=12)
    print("SQL execution reward per step:", [round(r, 3) for r in rewards])
    assert rose_by(rewards, 0.2), rewards
