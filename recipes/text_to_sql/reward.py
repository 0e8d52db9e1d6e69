"""Text-to-SQL's reward: execution match. The predicted and the gold query both run on the task's
SQLite database and the reward is 1.0 when they return the same set of rows (BIRD's execution
accuracy), else 0.0. Only a single query is a prediction: an empty one (nothing but whitespace,
semicolons and comments) and any statement that is not a SELECT, WITH or VALUES query (``REINDEX``,
``PRAGMA``, ``WITH ... DELETE``, ...) score 0.0: SQLite would run some of them and return no rows,
matching every gold query that returns none.

Every query runs in a child process of its own (this file, run as a script) that can only read.
Its layers, each of which stops an attack alone (``LAYERS`` names them):

- the authorizer allows nothing but reading tables and calling functions (no writes, ``ATTACH``,
  ``PRAGMA``, schema changes), and not ``fts3_tokenizer``, which hands out a heap pointer;
- ``PRAGMA query_only`` refuses writes even through a writable connection;
- the database file is opened read-only and immutable (``mode=ro&immutable=1``): no write and no
  journal even without the two above;
- its memory is capped (``MEMORY_BYTES`` of address space): a query that builds huge values fails;
- it stops encoding rows once its answer passes ``MAX_ANSWER_BYTES``.

It also stops itself at the time limit (SQLite's progress handler), returns at most ``max_rows``
rows and builds no value over ``MAX_VALUE_BYTES``. The parent reads at most ``MAX_ANSWER_BYTES``
of its answer (more scores 0, whatever the child does) and kills it if it still runs a second past
the time limit. A query that writes, attaches, loops, explodes or crashes the child scores 0, and
neither the database nor the trainer (its time or its memory) notices.

Entry points: ``reward`` for TRL (dataset columns ``gold_sql`` and ``db_path``) and
``compute_score`` for verl (``ground_truth`` is the gold SQL, ``extra_info["db_path"]`` the database).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import resource
import selectors
import sqlite3
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import quote

TIME_LIMIT_S = 5.0
MAX_ROWS = 10_000
MEMORY_BYTES = 2 << 30
MAX_VALUE_BYTES = 10_000_000  # the longest string or blob a query may build
# The longest answer (rows as JSON) the parent reads: 10,000 rows of a few short columns fit; the
# trainer holds up to 8 answers at once, parsed.
MAX_ANSWER_BYTES = 4_000_000
KILL_MARGIN_S = 1.0  # the parent kills a child still running this long past its own limit
# The child's layers, all on. Tests turn all but one off to show that one stops its attack alone.
LAYERS = frozenset({"authorizer", "query_only", "read_only_file", "memory_limit", "answer_limit"})
_FENCE = re.compile(r"```(.*?)```", re.DOTALL)
# A fence line's info string (```sqlite3, ```postgresql, ...): one word alone on the opening line.
# A query's first keyword is never a language tag, so "```SELECT\n* FROM t```" keeps its SELECT.
_LANGUAGE_TAG = re.compile(r"[ \t]*(?!(?:select|with|values)\b)[^\s`]*[ \t]*\n", re.IGNORECASE)
_COMMENT = re.compile(r"--[^\n]*|/\*.*?(?:\*/|$)", re.DOTALL)
_LEADING_NOISE = re.compile(r"(?:\s|;|--[^\n]*|/\*.*?(?:\*/|\Z))*", re.DOTALL)
_QUERY_KEYWORD = re.compile(r"(?:select|with|values)\b", re.IGNORECASE)
_CHUNK_BYTES = 1 << 16
_MAX_ERROR_CHARS = 1_000  # an error answer stays far below MAX_ANSWER_BYTES
_NOT_A_QUERY = "the statement is not a query (SELECT, WITH or VALUES)"


@dataclass(frozen=True)
class Execution:
    ok: bool
    rows: frozenset = frozenset()
    error: str = ""


class AnswerTooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"the answer is larger than {limit} bytes")


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


def is_query(sql: str) -> bool:
    """Whether ``sql``'s first keyword (after whitespace, semicolons and comments) starts a query:
    SELECT, WITH or VALUES. Checked before the statement runs: ``VACUUM INTO`` would write a file.
    ``WITH ... DELETE`` passes here; the child refuses it as a statement that returns no columns."""
    return _QUERY_KEYWORD.match(sql, _LEADING_NOISE.match(sql).end()) is not None


def execute(db_path: str, sql: str, *, time_limit_s: float | None = None, max_rows: int = MAX_ROWS) -> Execution:
    """Run the query ``sql`` on the database in a read-only child process (``TIME_LIMIT_S`` by
    default); an empty query or a statement that is no query fails."""
    if is_empty(sql):
        return Execution(False, error="the query is empty")
    if not is_query(sql):
        return Execution(False, error=_NOT_A_QUERY)
    time_limit_s = time_limit_s or TIME_LIMIT_S
    request = {"db": db_path, "sql": sql, "time_limit_s": time_limit_s, "max_rows": max_rows,
               "memory_bytes": MEMORY_BYTES, "max_value_bytes": MAX_VALUE_BYTES,
               "max_answer_bytes": MAX_ANSWER_BYTES, "layers": sorted(LAYERS)}
    try:
        status, answer = _run_child(request, time_limit_s + KILL_MARGIN_S)
    except TimeoutError:
        return Execution(False, error="killed at the time limit")
    except AnswerTooLarge as exc:
        return Execution(False, error=str(exc))
    if status != 0 or not answer:
        return Execution(False, error=f"the query's process died (exit {status})")
    answer = json.loads(answer)
    if not answer["ok"]:
        return Execution(False, error=answer["error"])
    return Execution(True, frozenset(tuple(row) for row in answer["rows"]))


def _run_child(request: dict, timeout_s: float) -> tuple[int, bytes]:
    """The child's exit status and answer. It is killed when it runs past ``timeout_s``
    (TimeoutError) or its answer grows past ``MAX_ANSWER_BYTES`` (AnswerTooLarge): the caller never
    holds more than that, whatever the query returns."""
    deadline = time.monotonic() + timeout_s
    with subprocess.Popen([sys.executable, "-I", __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL) as child:
        try:
            _send(child.stdin, json.dumps(request).encode())
            answer = _read_at_most(child.stdout, MAX_ANSWER_BYTES, deadline)
            status = child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            raise TimeoutError from None
        except BaseException:
            child.kill()
            raise
    return status, answer


def _send(stream, data: bytes) -> None:
    """Write and close; a child that died before reading says so by its exit status."""
    with contextlib.suppress(BrokenPipeError):
        stream.write(data)
    with contextlib.suppress(BrokenPipeError):  # flushing what the write left
        stream.close()


def _read_at_most(stream, limit: int, deadline: float) -> bytes:
    """All of ``stream``, read as it comes: AnswerTooLarge as soon as it passes ``limit`` bytes,
    TimeoutError when it has not ended by ``deadline``."""
    answer = bytearray()
    with selectors.DefaultSelector() as selector:  # poll/epoll: no FD_SETSIZE limit in a busy trainer
        selector.register(stream, selectors.EVENT_READ)
        while True:
            if not selector.select(deadline - time.monotonic()):
                raise TimeoutError
            chunk = os.read(stream.fileno(), _CHUNK_BYTES)
            if not chunk:
                return bytes(answer)
            answer += chunk
            if len(answer) > limit:
                raise AnswerTooLarge(limit)


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

_ALLOWED_ACTIONS = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
_DENIED_FUNCTIONS = {"fts3_tokenizer"}  # returns a heap pointer (and with two arguments, installs one)


class NotAQuery(Exception):
    pass


def _child() -> None:
    request = json.loads(sys.stdin.read())
    layers = set(request["layers"])
    if "memory_limit" in layers:
        resource.setrlimit(resource.RLIMIT_AS, (request["memory_bytes"], request["memory_bytes"]))
    answer_limit = request["max_answer_bytes"] if "answer_limit" in layers else None
    try:
        cursor = _connect(request, layers).execute(request["sql"])
        if cursor.description is None:  # it ran, but returns no columns: WITH ... DELETE and the like
            raise NotAQuery(_NOT_A_QUERY)
        rows = _encoded_rows(cursor, request["max_rows"], answer_limit)
    except (NotAQuery, AnswerTooLarge) as exc:
        _write_failure(str(exc))
    except (sqlite3.Error, RuntimeError, MemoryError, OverflowError, ValueError) as exc:
        _write_failure(f"{type(exc).__name__}: {exc}")
    else:
        sys.stdout.write(_rows_answer(rows))


def _connect(request: dict, layers: set[str]) -> sqlite3.Connection:
    options = "?mode=ro&immutable=1" if "read_only_file" in layers else ""
    db = sqlite3.connect(f"file:{quote(request['db'])}{options}", uri=True)
    if "query_only" in layers:
        db.execute("PRAGMA query_only = ON")  # before the authorizer, which denies every PRAGMA
    db.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, request["max_value_bytes"])
    if "authorizer" in layers:
        db.set_authorizer(_authorize)
    deadline = time.monotonic() + request["time_limit_s"]
    db.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
    return db


def _authorize(action: int, arg1: str | None, arg2: str | None, *_where) -> int:
    """Reading tables and calling functions, nothing else; for SQLITE_FUNCTION, arg2 is its name."""
    if action == sqlite3.SQLITE_FUNCTION and arg2.lower() in _DENIED_FUNCTIONS:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK if action in _ALLOWED_ACTIONS else sqlite3.SQLITE_DENY


def _encoded_rows(cursor: sqlite3.Cursor, max_rows: int, max_bytes: int | None) -> list[str]:
    """Each row as JSON, fetched and encoded one at a time so that an answer too long for the
    parent stops here, before it is all built (``max_bytes`` counts the whole answer)."""
    rows, size = [], len(_rows_answer([]))
    for row in cursor:
        if len(rows) == max_rows:
            raise RuntimeError(f"more than {max_rows} rows")
        rows.append(json.dumps([_plain(v) for v in row]))
        size += len(rows[-1]) + 1  # ASCII (json.dumps escapes the rest): characters are bytes
        if max_bytes is not None and size > max_bytes:
            raise AnswerTooLarge(max_bytes)
    return rows


def _rows_answer(rows: list[str]) -> str:
    return '{"ok": true, "rows": [' + ",".join(rows) + "]}"


def _write_failure(error: str) -> None:
    sys.stdout.write(json.dumps({"ok": False, "error": error[:_MAX_ERROR_CHARS]}))


def _plain(value: object) -> object:
    return value.hex() if isinstance(value, bytes) else value


if __name__ == "__main__":
    _child()
