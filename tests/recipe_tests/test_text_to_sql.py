"""The text-to-SQL recipe: execution-match reward, its read-only sandbox against adversarial
queries (each scores 0 within the time limit and the database file stays byte for byte the same;
each of the child's layers alone stops the attack it is there for), the caller's memory bounded
whatever a query returns, and BIRD-format data preparation."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

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
    # Writes that start as a query: they pass the check of the statement's kind and reach the sandbox.
    "WITH x AS (SELECT 1) DELETE FROM singer",
    "WITH x AS (SELECT 1) UPDATE singer SET age = 0",
    "WITH x AS (SELECT 1) INSERT INTO singer VALUES (99999, 'x', 'y', 1)",
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


@pytest.mark.slow
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


NOT_QUERIES = [
    "REINDEX",  # no index to rebuild: it reaches no authorizer check and returns no rows
    "VACUUM",
    "ANALYZE",
    "BEGIN",
    "PRAGMA table_info(singer)",
    "-- a comment first\n/* and another */ REINDEX",
    "WITH gone AS (SELECT 1) DELETE FROM singer",
    "EXPLAIN SELECT name FROM singer",  # it returns rows, but of bytecode
    "SELECT fts3_tokenizer('simple')",  # a heap address
]


@pytest.mark.parametrize("sql", NOT_QUERIES)
def test_only_a_query_is_a_prediction(database, sql):
    assert score(f"```sql\n{sql}\n```", NO_ROWS, database) == 0.0
    assert not execute(database, sql).ok


@pytest.mark.parametrize("completion", [
    "```sql\n-- the query\n/* Mars */ ;SELECT name FROM singer WHERE age > 1000\n```",
    "```sql\nWITH old AS (SELECT name FROM singer WHERE age > 1000) SELECT * FROM old\n```",
    "```sql\nVALUES (1) EXCEPT VALUES (1)\n```",
])
def test_queries_after_comments_and_with_or_values_queries_are_predictions(database, completion):
    assert score(completion, NO_ROWS, database) == 1.0


WRITE = "WITH gone AS (SELECT 1) DELETE FROM singer"


def test_with_every_layer_off_only_queries_still_run(database, tmp_path, monkeypatch):
    """The statement's kind is checked outside the sandbox: before it runs (``VACUUM INTO`` would
    write a file, a second statement would run after the first) and after (a ``WITH ... DELETE``
    returns no columns)."""
    monkeypatch.setattr(sql_reward, "LAYERS", frozenset())
    copy = tmp_path / "copy.sqlite"
    assert not execute(database, f"VACUUM INTO '{copy}'").ok
    assert not copy.exists()
    assert "one statement at a time" in execute(database, "SELECT 1; DELETE FROM singer").error
    assert execute(database, WRITE).error == "the statement is not a query (SELECT, WITH or VALUES)"
    assert score(WRITE, NO_ROWS, database) == 0.0


@pytest.mark.parametrize(("layer", "refusal"), [
    ("authorizer", "not authorized"),
    ("query_only", "attempt to write a readonly database"),
    ("read_only_file", "attempt to write a readonly database"),
])
def test_each_layer_alone_stops_a_write(database, monkeypatch, layer, refusal):
    """With every other layer off, the write reaches SQLite (with none, it runs: the test above)
    and this layer refuses it, leaving the database and its folder as they were (no journal)."""
    monkeypatch.setattr(sql_reward, "LAYERS", frozenset({layer}))
    before, files = digest(database), sorted(Path(database).parent.iterdir())
    assert refusal in execute(database, WRITE).error
    assert digest(database) == before and sorted(Path(database).parent.iterdir()) == files


def test_the_authorizer_alone_refuses_fts3_tokenizer(database, monkeypatch):
    monkeypatch.setattr(sql_reward, "LAYERS", frozenset())
    assert execute(database, "SELECT fts3_tokenizer('simple')").ok  # a heap address, without the authorizer
    monkeypatch.setattr(sql_reward, "LAYERS", frozenset({"authorizer"}))
    refused = execute(database, "SELECT fts3_tokenizer('simple')")
    assert not refused.ok and "not authorized to use function: fts3_tokenizer" in refused.error


ROOT = Path(__file__).resolve().parents[2]
# ``execute`` in a fresh Python, with the child's layers and memory cap given, reporting its result
# and the peak resident memory (MB) of the caller and of the query's child (its only child). The
# caller's peak is its VmHWM: its ru_maxrss would include the pytest process it was forked from.
MEASURE = """
import json, re, resource, sys
from recipes.text_to_sql import reward
settings = json.loads(sys.argv[1])
reward.LAYERS, reward.MEMORY_BYTES = frozenset(settings["layers"]), settings["memory_bytes"]
done = reward.execute(settings["db"], settings["sql"])
caller_kb = int(re.search(r"VmHWM:\\s*(\\d+) kB", open("/proc/self/status").read()).group(1))
child_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(json.dumps({"ok": done.ok, "error": done.error, "caller_mb": caller_kb // 1024, "child_mb": child_kb // 1024}))
"""


def execute_measured(database, sql: str, layers, memory_bytes: int = sql_reward.MEMORY_BYTES) -> dict:
    settings = {"db": database, "sql": sql, "layers": sorted(layers), "memory_bytes": memory_bytes}
    done = subprocess.run([sys.executable, "-c", MEASURE, json.dumps(settings)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=True)
    return json.loads(done.stdout)


# 40 strings of 9 MB built at once (each under the 10 MB value cap), returned as 40 lengths.
HUGE_VALUES = ("WITH RECURSIVE r(i, s) AS (SELECT 1, printf('%.*c', 100000, 'x') UNION ALL SELECT i + 1, s FROM r "
               "WHERE i < 90) SELECT " + ", ".join(f"length(group_concat(s, '{i}'))" for i in range(40)) + " FROM r")


def test_the_memory_limit_alone_stops_a_query_that_builds_huge_values(database):
    """Under a 256 MB cap (2 GiB in training, where 2,000 columns of 10 MB would do the same), the
    query fails inside the cap; without it, it succeeds and its process grows past the cap."""
    cap_mb = 256
    free = execute_measured(database, HUGE_VALUES, layers=set(), memory_bytes=cap_mb << 20)
    assert free["ok"] and free["child_mb"] > cap_mb, free
    capped = execute_measured(database, HUGE_VALUES, layers={"memory_limit"}, memory_bytes=cap_mb << 20)
    assert capped["error"].startswith("MemoryError") and capped["child_mb"] < cap_mb, capped


# 10,000 rows of 10 KB: a 100 MB answer, built and sent in a second when nothing stops it.
HUGE_ANSWER = ("WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r WHERE i < 10000) "
               "SELECT i, printf('%.*c', 10000, 'x') FROM r")


def test_a_huge_answer_costs_the_caller_no_memory(database):
    """The child sends its whole 100 MB answer (its own answer limit off): the caller reads a few
    MB of it, kills it and scores 0. Reading it all would take the caller past 100 MB."""
    sent = execute_measured(database, HUGE_ANSWER, layers=sql_reward.LAYERS - {"answer_limit"})
    assert not sent["ok"] and sent["error"] == f"the answer is larger than {sql_reward.MAX_ANSWER_BYTES} bytes"
    assert sent["child_mb"] > 100 and sent["caller_mb"] < 50, sent
    assert score(HUGE_ANSWER, HUGE_ANSWER, database) == 0.0


def test_the_answer_limit_alone_stops_the_child_building_a_huge_answer(database):
    stopped = execute_measured(database, HUGE_ANSWER, layers={"answer_limit"})
    assert stopped["error"] == f"the answer is larger than {sql_reward.MAX_ANSWER_BYTES} bytes"
    assert stopped["child_mb"] < 50 and stopped["caller_mb"] < 50, stopped


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
            answer = tokenizer(f"SELECT {rng.randrange(10)}{tokenizer.eos_token}",
                               add_special_tokens=False)["input_ids"]
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
