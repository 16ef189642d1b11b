"""Helpers for the schema-change tests: an oracle of what a replica must hold,
a replay of the JSON-lines stream, and writer threads that keep changing rows
while DDL runs.

The oracle maps the values psycopg reads from the source (docs/sqlite.md, "Type
mapping") without using replicator.structure, so it checks the consumer's
decoding instead of repeating it.
"""

from __future__ import annotations

import json
import random
import sqlite3
import threading
from collections import Counter
from datetime import UTC, date, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from consumer_helpers import sqlite_numeric
from replicator.consumer import Consumer
from replicator.targets import open_target

# the oracle ----------------------------------------------------------------------------

def replica_value(value: Any, numeric: str = "number") -> Any:
    """What the SQLite replica (and, with numeric "text", a JSON-lines row) holds for a
    source value."""
    if value is None or (isinstance(value, (int, str)) and not isinstance(value, bool)):
        return value
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float):
        return value
    if isinstance(value, Decimal):
        if numeric == "text" or not value.is_finite():
            return format(value, "f")      # as PostgreSQL prints it: scale kept, no exponent
        return sqlite_numeric(value)
    if isinstance(value, datetime):
        if value.tzinfo is None:
            return value.isoformat(timespec="microseconds")
        return value.astimezone(UTC).isoformat(timespec="microseconds")
    if isinstance(value, date):
        return value.isoformat()
    raise TypeError(f"the DDL tests use no {type(value).__name__} values")


def source_tables(conn: psycopg.Connection, schema: str = "public") -> list[str]:
    return [r[0] for r in conn.execute(
        "SELECT relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %s AND c.relkind IN ('r', 'p') ORDER BY 1", (schema,))]


def source_rows(conn: psycopg.Connection, table: str, schema: str = "public", numeric: str = "number") -> Counter:
    """The table's rows as a multiset of {column: replica value} items (numeric "text": as
    a stream has them)."""
    # never prepared: the table's columns change under it (by DDL on other connections)
    cur = conn.execute(sql.SQL("SELECT * FROM {}.{}").format(sql.Identifier(schema), sql.Identifier(table)),
                       prepare=False)
    names = [d.name for d in cur.description]
    return Counter(tuple(sorted((n, replica_value(v, numeric)) for n, v in zip(names, row))) for row in cur)


def sqlite_tables(path: Path) -> list[str]:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return sorted(r[0] for r in db.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE '\\_replicator%' ESCAPE '\\'"))
    finally:
        db.close()


def sqlite_rows(path: Path, table: str) -> Counter:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        cur = db.execute(f'SELECT * FROM "{table}"')
        names = [d[0] for d in cur.description]
        return Counter(tuple(sorted(zip(names, row))) for row in cur)
    finally:
        db.close()


def diff(expected: Counter, actual: Counter, what: str) -> list[str]:
    problems = [(repr(row), f"{what}: missing from the replica ({n}x): {dict(row)}")
                for row, n in (expected - actual).items()]
    problems += [(repr(row), f"{what}: in the replica but not in the source ({n}x): {dict(row)}")
                 for row, n in (actual - expected).items()]
    return [problem for _, problem in sorted(problems)]   # a row's two versions side by side


def assert_sqlite_equals_source(conn: psycopg.Connection, path: Path, step: str = "") -> None:
    """Every table of schema public, value by value, and no table more or less."""
    tables = source_tables(conn)
    assert sqlite_tables(path) == sorted(tables), f"after {step!r}: tables differ"
    problems = [p for t in tables for p in diff(source_rows(conn, t), sqlite_rows(path, t), t)]
    assert not problems, f"after {step!r}: {len(problems)} differences:\n" + "\n".join(problems[:20])


# the JSON-lines stream -----------------------------------------------------------------

def stream_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def attnums(conn: psycopg.Connection, table: str) -> dict[int, str]:
    return dict(conn.execute("SELECT attnum, attname FROM pg_attribute WHERE attrelid = %s::regclass"
                             " AND attnum > 0 AND NOT attisdropped", (table,)).fetchall())


class StreamReplay:
    """Rebuilds the tables from a JSON-lines stream the way a reader of the
    stream would: rows by key; an S line renames, drops and adds columns by
    attnum (its "structure") and renames the table; T empties it.

    Also checks that every row line has the columns the table had at that
    point of the stream: rows written before a schema change in the old
    layout, rows after it in the new one."""

    def __init__(self, layouts: dict[str, dict[int, str]]) -> None:
        self.layouts = dict(layouts)          # source name -> {attnum: column}, known from the source
        self.tables: dict[str, dict[tuple, dict[str, Any]]] = {}
        self.columns: dict[str, set[str]] = {}
        self.schema_events: list[dict[str, Any]] = []

    def replay(self, lines: list[dict[str, Any]]) -> StreamReplay:
        for number, line in enumerate(lines, 1):
            name, op = line["table"], line["op"]
            rows = self.tables.setdefault(name, {})
            if op == "S":
                self.schema_events.append(line)
                self._schema(line)
            elif op == "T":
                rows.clear()
            elif op == "D":
                rows.pop(tuple(line["key"].values()), None)
            else:
                assert op in ("I", "U", "R"), line
                layout = self.columns.setdefault(name, set(line["row"]))
                assert set(line["row"]) == layout, (
                    f"line {number}: row of {name} has columns {sorted(line['row'])}, the table has "
                    f"{sorted(layout)} at that point of the stream")
                rows[tuple(line["key"].values())] = line["row"]
        return self

    def _schema(self, line: dict[str, Any]) -> None:
        old = line["table"]
        rows = self.tables.pop(old, {})
        if line["kind"] == "dropped":
            self.columns.pop(old, None)
            return
        new = f"{line['schema']}.{line['name']}"
        before = self.layouts.pop(old, {}) if line["kind"] == "created" else self.layouts.pop(old)
        after = {c["attnum"]: c["name"] for c in line["structure"] if c["name"] in line["columns"]}
        renamed = {before[a]: after[a] for a in before if a in after}
        self.tables[new] = {key: {**{c: None for c in line["columns"]},
                                  **{renamed[c]: v for c, v in row.items() if c in renamed}}
                            for key, row in rows.items()}
        self.layouts[new] = after
        self.columns.pop(old, None)
        self.columns[new] = set(line["columns"])

    def rows(self, table: str) -> Counter:
        return Counter(tuple(sorted(row.items())) for row in self.tables.get(table, {}).values())


def assert_stream_equals_source(conn: psycopg.Connection, replay: StreamReplay, step: str = "") -> None:
    tables = source_tables(conn)
    present = sorted(n.split(".", 1)[1] for n, rows in replay.tables.items() if n.startswith("public."))
    assert sorted(tables) == [t for t in present if t in tables] and set(present) <= set(tables), (
        f"after {step!r}: stream tables {present}, source tables {tables}")
    problems = [p for t in tables
                for p in diff(source_rows(conn, t, numeric="text"), replay.rows(f"public.{t}"), f"stream {t}")]
    assert not problems, f"after {step!r}: {len(problems)} differences:\n" + "\n".join(problems[:20])


# writers ---------------------------------------------------------------------------------

class Writers:
    """Threads inserting, updating and deleting rows of some tables, each on its
    own connection, until stopped; pause() returns once every writer is parked
    between transactions, so the source is quiet while a test compares.

    Writers name tables by oid (a RENAME does not stop them) and write only the
    columns id and a, which the DDL under test leaves in place. A writer that
    meets an error other than a deadlock or a table renamed under it records it
    and stops; check() raises it."""

    def __init__(self, dsn: str, tables: list[str], *, count: int = 2) -> None:
        self.dsn = dsn
        with psycopg.connect(dsn) as conn:
            self.oids = [conn.execute("SELECT %s::regclass::oid", (t,)).fetchone()[0] for t in tables]
        self.errors: list[BaseException] = []
        self.ops = [0] * count
        self._cond = threading.Condition()
        self._paused = False
        self._parked = 0
        self._stopped = False
        self._threads = [threading.Thread(target=self._run, args=(n,), daemon=True) for n in range(count)]

    def start(self) -> Writers:
        for thread in self._threads:
            thread.start()
        return self

    def _gate(self) -> bool:
        with self._cond:
            if self._paused and not self._stopped:
                self._parked += 1
                self._cond.notify_all()
                self._cond.wait_for(lambda: not self._paused or self._stopped)
                self._parked -= 1
            return not self._stopped

    def _run(self, number: int) -> None:
        rnd = random.Random(number)
        ids: dict[int, list[int]] = {oid: [] for oid in self.oids}
        next_id = (number + 1) * 1_000_000
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                while self._gate():
                    try:
                        with conn.transaction():
                            for _ in range(rnd.choice((1, 1, 1, 3))):
                                oid = rnd.choice(self.oids)
                                table = sql.SQL(conn.execute("SELECT %s::regclass::text", (oid,)).fetchone()[0])
                                action = rnd.random()
                                if action < 0.5 or not ids[oid]:
                                    next_id += 1
                                    conn.execute(sql.SQL("INSERT INTO {} (id, a) VALUES (%s, %s)").format(table),
                                                 (next_id, rnd.randrange(1000)))
                                    ids[oid].append(next_id)
                                elif action < 0.85:
                                    conn.execute(sql.SQL("UPDATE {} SET a = a + 1 WHERE id = ANY(%s)").format(table),
                                                 (rnd.sample(ids[oid], min(3, len(ids[oid]))),))
                                else:
                                    victim = ids[oid].pop(rnd.randrange(len(ids[oid])))
                                    conn.execute(sql.SQL("DELETE FROM {} WHERE id = %s").format(table), (victim,))
                    except (psycopg.errors.DeadlockDetected, psycopg.errors.UndefinedTable):
                        continue
                    with self._cond:
                        self.ops[number] += 1
                        self._cond.notify_all()
        except BaseException as exc:  # reported by check()
            self.errors.append(exc)
            with self._cond:
                self._stopped = True
                self._cond.notify_all()

    def check(self) -> None:
        if self.errors:
            raise AssertionError(f"a writer failed: {self.errors[0]!r}") from self.errors[0]

    def wait_for_ops(self, more: int, timeout: float = 30) -> None:
        """Returns once every writer has committed `more` transactions since the call."""
        with self._cond:
            goal = [n + more for n in self.ops]
            done = self._cond.wait_for(lambda: self._stopped or all(n >= g for n, g in zip(self.ops, goal)),
                                       timeout)
        self.check()
        assert done, "writers made no progress"

    def pause(self, timeout: float = 30) -> None:
        with self._cond:
            self._paused = True
            done = self._cond.wait_for(lambda: self._stopped or self._parked == len(self._threads), timeout)
        self.check()
        assert done, "writers did not pause"

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(30)


class Replicas:
    """A SQLite replica and a JSON-lines stream of queue q, each applied by its own
    long-lived consumer (as a daemon would), brought up to date on demand."""

    def __init__(self, dsn: str, tmp_path: Path) -> None:
        self.dsn = dsn
        self.sqlite_path = tmp_path / "replica.db"
        self.stream_path = tmp_path / "changes.jsonl"
        self.consumers = [Consumer(dsn, "q", open_target(f"sqlite:{self.sqlite_path}")),
                          Consumer(dsn, "q", open_target(f"jsonl:{self.stream_path}"))]

    def catch_up(self) -> None:
        for consumer in self.consumers:
            consumer.run(until_caught_up=True)

    def close(self) -> None:
        for consumer in self.consumers:
            consumer.close()
            consumer.target.close()

    def stream(self) -> list[dict]:
        return stream_lines(self.stream_path)
