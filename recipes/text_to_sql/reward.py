"""Text-to-SQL's reward: execution match. The predicted and the gold query both run on the task's
SQLite database and the reward is 1.0 when they return the same set of rows (BIRD's execution
accuracy), else 0.0. An empty query (nothing but whitespace, semicolons and comments) scores 0.0:
SQLite would run it and return no rows, matching every gold query that returns none.

Every query runs in a child process of its own (this file, run as a script) that can only read:
the database is opened read-only and immutable, ``PRAGMA query_only`` is on, and an authorizer
allows nothing but reading tables and calling functions (no writes, ``ATTACH``, ``PRAGMA``, schema
changes). The child stops itself at the time limit (SQLite's progress handler), returns at most
``max_rows`` rows, builds no value over 10 MB and caps its memory; the parent kills it if it
still runs a second later. A
query that writes, attaches, loops, explodes or crashes the child scores 0, and neither the
database nor the trainer notices.

Entry points: ``reward`` for TRL (dataset columns ``gold_sql`` and ``db_path``) and
``compute_score`` for verl (``ground_truth`` is the gold SQL, ``extra_info["db_path"]`` the database).
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

TIME_LIMIT_S = 5.0
MAX_ROWS = 10_000
MEMORY_BYTES = 2 << 30
MAX_VALUE_BYTES = 10_000_000  # the longest string or blob a query may build
KILL_MARGIN_S = 1.0  # the parent kills a child still running this long past its own limit
_FENCE = re.compile(r"```(.*?)```", re.DOTALL)
# A fence line's info string (```sqlite3, ```postgresql, ...): one word alone on the opening line.
# A query's first keyword is never a language tag, so "```SELECT\n* FROM t```" keeps its SELECT.
_LANGUAGE_TAG = re.compile(r"[ \t]*(?!(?:select|with|values)\b)[^\s`]*[ \t]*\n", re.IGNORECASE)
_COMMENT = re.compile(r"--[^\n]*|/\*.*?(?:\*/|$)", re.DOTALL)


@dataclass(frozen=True)
class Execution:
    ok: bool
    rows: frozenset = frozenset()
    error: str = ""


def extract_sql(completion: str) -> str:
    """The query in a completion: its last fenced code block (without the fence line's language
    tag), else the text after a final "SQL:", else the whole text."""
    blocks = _FENCE.findall(completion)
    if blocks:
        block = blocks[-1]
        tag = _LANGUAGE_TAG.match(block)
        return (block[tag.end() :] if tag else block).strip()
    marker = completion.rfind("SQL:")
    return (completion[marker + 4 :] if marker >= 0 else completion).strip()


def is_empty(sql: str) -> bool:
    """Whether ``sql`` holds no statement: only whitespace, semicolons and comments. SQLite runs
    such a query and returns no rows, which would match every gold query that returns none."""
    return not _COMMENT.sub(" ", sql).replace(";", " ").strip()


def execute(db_path: str, sql: str, *, time_limit_s: float | None = None, max_rows: int = MAX_ROWS) -> Execution:
    """Run ``sql`` on the database in a read-only child process (``TIME_LIMIT_S`` by default); an
    empty query fails."""
    if is_empty(sql):
        return Execution(False, error="the query is empty")
    time_limit_s = time_limit_s or TIME_LIMIT_S
    request = json.dumps({"db": db_path, "sql": sql, "time_limit_s": time_limit_s, "max_rows": max_rows})
    try:
        done = subprocess.run([sys.executable, "-I", __file__], input=request, capture_output=True, text=True,
                              timeout=time_limit_s + KILL_MARGIN_S)
    except subprocess.TimeoutExpired:
        return Execution(False, error="killed at the time limit")
    if done.returncode != 0 or not done.stdout:
        return Execution(False, error=f"the query's process died (exit {done.returncode})")
    answer = json.loads(done.stdout)
    if not answer["ok"]:
        return Execution(False, error=answer["error"])
    return Execution(True, frozenset(tuple(row) for row in answer["rows"]))


@functools.lru_cache(maxsize=4096)
def execute_gold(db_path: str, sql: str) -> Execution:
    """Gold queries repeat (one per sample of a prompt): each runs once."""
    return execute(db_path, sql)


def score(completion: str, gold_sql: str, db_path: str) -> float:
    predicted = execute(db_path, extract_sql(completion))
    if not predicted.ok:
        return 0.0
    gold = execute_gold(db_path, gold_sql)
    return float(gold.ok and predicted.rows == gold.rows)


def reward(completions: list, gold_sql: list[str], db_path: list[str], **kwargs) -> list[float]:
    """TRL reward function (completions as strings or chat messages); queries run in parallel."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(score, texts, gold_sql, db_path))


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """verl custom reward function."""
    if not extra_info or "db_path" not in extra_info:
        raise ValueError("text-to-SQL rows need extra_info.db_path (recipes.text_to_sql.prepare_data writes it)")
    return score(solution_str, ground_truth, extra_info["db_path"])


# ---- the child process ----------------------------------------------------------------------

def _child() -> None:
    import resource
    import sqlite3
    import time
    from urllib.parse import quote

    request = json.loads(sys.stdin.read())
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    allowed = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
    deadline = time.monotonic() + request["time_limit_s"]
    try:
        db = sqlite3.connect(f"file:{quote(request['db'])}?mode=ro&immutable=1", uri=True)
        db.execute("PRAGMA query_only = ON")
        db.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
        db.set_authorizer(lambda action, *args: sqlite3.SQLITE_OK if action in allowed else sqlite3.SQLITE_DENY)
        db.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
        cursor = db.execute(request["sql"])
        rows = cursor.fetchmany(request["max_rows"] + 1)
        if len(rows) > request["max_rows"]:
            raise RuntimeError(f"more than {request['max_rows']} rows")
        answer = {"ok": True, "rows": [[_plain(v) for v in row] for row in rows]}
    except (sqlite3.Error, RuntimeError, MemoryError, OverflowError, ValueError) as exc:
        answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    sys.stdout.write(json.dumps(answer))


def _plain(value: object) -> object:
    return value.hex() if isinstance(value, bytes) else value


if __name__ == "__main__":
    _child()
