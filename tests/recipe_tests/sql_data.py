"""A small SQLite database in BIRD's layout (``<databases>/<db_id>/<db_id>.sqlite``) and a gold query on it."""

from __future__ import annotations

import sqlite3

GOLD = "SELECT count(*) FROM singer WHERE country = 'Peru'"


def make_database(path, rows: int = 3200):
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE singer (id INTEGER PRIMARY KEY, name TEXT, country TEXT, age INTEGER)")
    db.executemany("INSERT INTO singer VALUES (?, ?, ?, ?)",
                   [(i, f"singer{i}", ["France", "Peru", "Japan"][i % 3], 20 + i % 40) for i in range(rows)])
    db.commit()
    db.close()
    return str(path)
