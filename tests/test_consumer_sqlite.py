"""The consumer applying a queue into a SQLite replica: type mapping and
names, exactly-once across crashes, the initial copy, tables added while the
daemon runs, PK-only tables, readers never seeing part of a batch, and the
--once / --until-caught-up / daemon modes.

Everything runs against the session's real PostgreSQL cluster and real SQLite
files; crashes are real SIGKILLs of a real consumer process.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import closing
from datetime import datetime
from decimal import Decimal
from pathlib import Path

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer_helpers import (
    Daemon,
    assert_replica_equals_source,
    cli_env,
    consume_while_a_ddl_holds_the_copy,
    copy_while_a_ddl_holds_the_table,
    forced_tick,
    latest_tick,
    run_cli,
    run_cli_in_process,
    set_fast_ticks,
    sqlite_position,
    sqlite_primary_key,
    sqlite_reader,
    sqlite_rows,
    sqlite_types,
    wait_until,
)
from pg_helpers import examples
from replicator.consumer import Consumer
from replicator.source import Source
from replicator.targets.sqlite.target import SqliteTarget, replica_state


def consume(dsn: str, path: Path, *, tables: list[str] | None = None, once: bool = False) -> int:
    """Runs a consumer in this process until caught up (or for one batch)."""
    target = SqliteTarget(path)
    consumer = Consumer(dsn, "q", target, tables=tables)
    try:
        return consumer.run(once=once, until_caught_up=not once)
    finally:
        consumer.close()
        target.close()


def consumer_state(conn: psycopg.Connection) -> tuple[int, bool]:
    """(last_tick, batch_open) of the only consumer of queue q on the source."""
    rows = conn.execute("SELECT last_tick, batch_open FROM replicator.consumer_info() WHERE queue_name = 'q'"
                        ).fetchall()
    assert len(rows) == 1, rows
    return rows[0]


# type mapping and names -------------------------------------------------------------

TYPED_DDL = """
    CREATE TYPE mood AS ENUM ('sad', 'happy');
    CREATE DOMAIN posint AS integer CHECK (VALUE > 0);
    CREATE SCHEMA s;
    CREATE TABLE s.typed (
        id int PRIMARY KEY, i2 smallint, i8 bigint, b boolean, r real, d double precision,
        n numeric, n2 numeric(12,2), t text, vc varchar(10), ch char(3), by bytea,
        dt date, tm time, tmtz timetz, ts timestamp, tstz timestamptz, iv interval,
        j json, jb jsonb, ia int[], ta text[], u uuid, m mood, dom posint, ip inet);
    CREATE TABLE plain (k text PRIMARY KEY, v int);
"""

TYPED_ROWS = """
    INSERT INTO s.typed VALUES
    (1, -32768, 9223372036854775807, true, 1.5, 1.0000000000000002,
     123456789012345678901234567890.123456789, 1.50, E'tab\\there\\nnew "q" \\\\ \u00e9', 'abc', 'ab',
     '\\x00ff41', '2024-01-02', '03:04:05.123456', '03:04:05+02', '2024-01-02 03:04:05.123456',
     '2024-01-02 05:04:05.123456+02', '1 day 02:03:04', '{"b": 1,  "a": [1, 2.50]}',
     '{"b": 1, "a": [1, 2.50]}', '{1,NULL,3}', '{"a b","c\\"d",NULL}',
     'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', 'happy', 7, '10.0.0.1/8'),
    (2, 0, 0, false, 'NaN', 'Infinity', 'NaN', -0.01, '', '', '', '\\x', '0005-01-02', '00:00', '00:00+00',
     '2024-01-02 03:04:05', '2024-06-30 23:59:59.5-07:30', '0', 'null', '[]', '{}', '{}',
     '00000000-0000-0000-0000-000000000000', 'sad', 1, '::1'),
    (3, NULL, NULL, NULL, '-Infinity', '-Infinity', 0.0000001, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
     NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL),
    (4, NULL, NULL, NULL, NULL, -1.5e-300, NUMERIC_INFINITY, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
     NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL);
    INSERT INTO plain VALUES ('a', 1);
"""

EXPECTED = {
    1: {"id": 1, "i2": -32768, "i8": 9223372036854775807, "b": 1, "r": 1.5, "d": 1.0000000000000002,
        "n": 1.2345678901234568e+29, "n2": 1.5, "t": 'tab\there\nnew "q" \\ \u00e9',
        "vc": "abc", "ch": "ab ", "by": b"\x00\xffA", "dt": "2024-01-02", "tm": "03:04:05.123456",
        "tmtz": "03:04:05.000000+02:00", "ts": "2024-01-02T03:04:05.123456",
        "tstz": "2024-01-02T03:04:05.123456+00:00",
        "iv": "1 day 02:03:04", "j": '{"b": 1,  "a": [1, 2.50]}', "jb": '{"a": [1, 2.50], "b": 1}',
        "ia": "[1,null,3]", "ta": '["a b","c\\"d",null]', "u": "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
        "m": "happy", "dom": 7, "ip": "10.0.0.1/8"},
    2: {"id": 2, "i2": 0, "i8": 0, "b": 0, "r": "NaN", "d": "Infinity", "n": "NaN", "n2": -0.01, "t": "",
        "vc": "", "ch": "   ", "by": b"", "dt": "0005-01-02", "tm": "00:00:00.000000",
        "tmtz": "00:00:00.000000+00:00", "ts": "2024-01-02T03:04:05.000000",
        "tstz": "2024-07-01T07:29:59.500000+00:00", "iv": "00:00:00",
        "j": "null", "jb": "[]", "ia": "[]", "ta": "[]", "u": "00000000-0000-0000-0000-000000000000",
        "m": "sad", "dom": 1, "ip": "::1"},
    3: {"id": 3, "r": "-Infinity", "d": "-Infinity", "n": 1e-07},
    4: {"id": 4, "d": -1.5e-300, "n": "Infinity"},
}


def typed_rows(conn: psycopg.Connection) -> tuple[str, dict[int, dict]]:
    """TYPED_ROWS and EXPECTED for the server: numeric has infinities from PostgreSQL 14."""
    if conn.info.server_version >= 140000:
        return TYPED_ROWS.replace("NUMERIC_INFINITY", "'Infinity'"), EXPECTED
    return TYPED_ROWS.replace("NUMERIC_INFINITY", "NULL"), {**EXPECTED, 4: {"id": 4, "d": -1.5e-300}}

SQLITE_TYPES = {"id": "INTEGER", "i2": "INTEGER", "i8": "INTEGER", "b": "INTEGER", "r": "REAL", "d": "REAL",
                "n": "NUMERIC", "n2": "NUMERIC", "t": "TEXT", "vc": "TEXT", "ch": "TEXT", "by": "BLOB", "dt": "TEXT",
                "tm": "TEXT", "tmtz": "TEXT", "ts": "TEXT", "tstz": "TEXT", "iv": "TEXT", "j": "TEXT",
                "jb": "TEXT", "ia": "TEXT", "ta": "TEXT", "u": "TEXT", "m": "TEXT", "dom": "INTEGER",
                "ip": "TEXT"}

# Output settings an application session may use: the replica must not depend on them.
ODD_SESSION = ["SET bytea_output = escape", "SET extra_float_digits = 0", "SET IntervalStyle = sql_standard",
               "SET TimeZone = 'Asia/Kolkata'", "SET DateStyle = 'SQL, DMY'"]


@pytest.mark.parametrize("path", ["copy", "events", "events from a session with odd output settings",
                                  "pk join-back"])
def test_values_reach_sqlite_with_the_documented_type_mapping(dsn, conn, source, tmp_path, path):
    conn.execute(TYPED_DDL)
    rows_sql, expected_rows = typed_rows(conn)
    source.create_queue("q")
    if path == "copy":
        conn.execute(rows_sql)
    source.add_table("q", "s.typed", mode="pk" if path == "pk join-back" else "full")
    source.add_table("q", "plain")
    replica = tmp_path / "replica.db"
    consume(dsn, replica)
    if path != "copy":
        with psycopg.connect(dsn, autocommit=True) as app:
            if path.startswith("events from"):
                for statement in ODD_SESSION:
                    app.execute(statement)
            app.execute(rows_sql)
        consume(dsn, replica)

    assert sqlite_types(replica, "s__typed") == SQLITE_TYPES
    assert sqlite_primary_key(replica, "s__typed") == ["id"]
    rows = sqlite_rows(replica, "s__typed", ["id"])
    assert sorted(rows) == [(1,), (2,), (3,), (4,)]
    for row_id, expected in expected_rows.items():
        actual = rows[(row_id,)]
        want = {c: expected.get(c) for c in actual}
        assert actual == want, f"row {row_id}: " + ", ".join(
            f"{c}: {actual[c]!r} != {want[c]!r}" for c in actual if actual[c] != want[c]
            or type(actual[c]) is not type(want[c]))
        for column, value in want.items():   # 1 and 1.0 compare equal: the storage class must match too
            assert type(actual[column]) is type(value), (row_id, column, actual[column])
    assert sqlite_rows(replica, "plain", ["k"]) == {("a",): {"k": "a", "v": 1}}
    db = sqlite_reader(replica)
    try:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        db.close()


def test_replica_names_drop_public_and_join_other_schemas_with_double_underscore(dsn, conn, source, tmp_path):
    conn.execute("CREATE SCHEMA sales; CREATE TABLE sales.orders (id int PRIMARY KEY);"
                 " CREATE TABLE sales.lines (qty int, line int, order_id int, PRIMARY KEY (order_id, line));"
                 " CREATE TABLE orders (id int PRIMARY KEY); CREATE TABLE \"Mixed Case\" (id int PRIMARY KEY);"
                 " INSERT INTO sales.orders VALUES (1); INSERT INTO orders VALUES (2);"
                 " INSERT INTO \"Mixed Case\" VALUES (3)")
    source.create_queue("q")
    for name in ("sales.orders", "orders", '"Mixed Case"', "sales.lines"):
        source.add_table("q", name)
    replica = tmp_path / "r.db"
    consume(dsn, replica)
    db = sqlite_reader(replica)
    try:
        names = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'"
                                           " AND name NOT LIKE '\\_replicator%' ESCAPE '\\'")}
        assert names == {"sales__orders", "orders", "Mixed Case", "sales__lines"}
        assert db.execute("SELECT id FROM sales__orders").fetchall() == [(1,)]
        assert db.execute("SELECT id FROM orders").fetchall() == [(2,)]
        assert db.execute('SELECT id FROM "Mixed Case"').fetchall() == [(3,)]
    finally:
        db.close()
    assert sqlite_primary_key(replica, "sales__lines") == ["order_id", "line"]


def test_a_null_in_a_nullable_integer_key_stays_null(dsn, conn, source, tmp_path):
    # An INTEGER PRIMARY KEY is SQLite's rowid, which would store NULL as a new number.
    conn.execute("CREATE TABLE readings (sensor int, v text)")
    source.create_queue("q")
    source.add_table("q", "readings", key=["sensor"])
    replica = tmp_path / "r.db"
    conn.execute("INSERT INTO readings VALUES (NULL, 'unassigned'), (7, 'seven')")
    consume(dsn, replica)
    conn.execute("UPDATE readings SET v = 'still unassigned' WHERE sensor IS NULL")
    consume(dsn, replica)
    db = sqlite_reader(replica)
    try:
        assert db.execute("SELECT sensor, v FROM readings ORDER BY sensor").fetchall() == [
            (None, "still unassigned"), (7, "seven")]
    finally:
        db.close()


# generated values against the oracle --------------------------------------------------

_text = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=12)
_row = st.fixed_dictionaries({
    "i8": st.none() | st.integers(-2**63, 2**63 - 1),
    "b": st.none() | st.booleans(),
    "r": st.none() | st.floats(width=32),
    "d": st.none() | st.floats(),
    "n": st.none() | st.just(Decimal("NaN")) | st.decimals(allow_nan=False, allow_infinity=True).filter(
        lambda d: not d.is_finite() or abs(d.adjusted()) < 100),
    "t": st.none() | _text,
    "by": st.none() | st.binary(max_size=16),
    "ts": st.none() | st.datetimes(),
    # from Jan 2, year 1: a local time earlier on Jan 1 is 1 BC in UTC, which the oracle's psycopg cannot read
    "tstz": st.none() | st.datetimes(min_value=datetime(1, 1, 2), timezones=st.timezones()),
    "ta": st.none() | st.lists(st.none() | _text, max_size=4),
    "jb": st.none() | st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | _text,
                                   lambda inner: st.lists(inner, max_size=3)
                                   | st.dictionaries(_text, inner, max_size=3), max_leaves=6),
})


@pytest.fixture
def generated_setup(dsn, conn, source, tmp_path):
    conn.execute("CREATE TABLE gen (id int PRIMARY KEY, i8 bigint, b boolean, r real, d double precision,"
                 " n numeric, t text, by bytea, ts timestamp, tstz timestamptz, ta text[], jb jsonb)")
    source.create_queue("q")
    source.add_table("q", "gen")
    replica = tmp_path / "gen.db"
    consume(dsn, replica)
    return replica


@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                     HealthCheck.too_slow])
@given(rows=st.lists(_row, min_size=1, max_size=6))
def test_generated_values_match_the_oracle_after_replication(dsn, conn, generated_setup, rows):
    from psycopg.types.json import Jsonb
    replica = generated_setup
    if conn.info.server_version < 140000:        # numeric has infinities from PostgreSQL 14
        rows = [dict(row, n=None) if row["n"] is not None and row["n"].is_infinite() else row for row in rows]
    with conn.transaction():
        conn.execute("TRUNCATE gen")
        for i, row in enumerate(rows):
            values = dict(row, id=i, jb=Jsonb(row["jb"]) if row["jb"] is not None else None)
            conn.execute("INSERT INTO gen VALUES (%(id)s, %(i8)s, %(b)s, %(r)s, %(d)s, %(n)s, %(t)s, %(by)s,"
                         " %(ts)s, %(tstz)s, %(ta)s, %(jb)s)", values)
    consume(dsn, replica)
    assert_replica_equals_source(conn, replica, [("public.gen", "gen", ["id"])])


# exactly once across kill -9 ---------------------------------------------------------

KILLER = textwrap.dedent("""
    import os, signal, sys
    from replicator import cli
    from replicator.source import Source
    from replicator.targets.sqlite.target import SqliteTarget
    point, n = sys.argv[1], int(sys.argv[2])
    calls = {"n": 0}

    def die_on_nth(cls, name, when=lambda *a: True):
        original = getattr(cls, name)
        def hooked(self, *args, **kwargs):
            if when(*args):
                calls["n"] += 1
                if calls["n"] >= n:
                    os.kill(os.getpid(), signal.SIGKILL)
            return original(self, *args, **kwargs)
        setattr(cls, name, hooked)

    if point == "before finish_batch":          # the target committed, the source does not know
        die_on_nth(Source, "finish_batch")
    elif point == "in the middle of a batch":   # some rows of the batch written, not committed
        die_on_nth(SqliteTarget, "upsert", lambda table, op, rows: op != "R")
    elif point == "during the initial copy":
        die_on_nth(SqliteTarget, "upsert", lambda table, op, rows: op == "R")
    elif point == "before the target commit":   # position written, not committed
        die_on_nth(SqliteTarget, "commit")
    sys.argv = ["replicator", *sys.argv[3:]]
    cli.main()
""")


@pytest.mark.parametrize("point,nth", [("before finish_batch", 1), ("in the middle of a batch", 3),
                                        ("during the initial copy", 2), ("before the target commit", 1)])
def test_kill_9_at_a_fixed_point_then_restart_leaves_replica_equal_to_source(dsn, conn, source, tmp_path,
                                                                               point, nth):
    conn.execute("CREATE TABLE acct (id int PRIMARY KEY, bal int NOT NULL, note text)")
    conn.execute("INSERT INTO acct SELECT g, 100, 'n' || g FROM generate_series(1, 12000) g")
    source.create_queue("q")
    source.add_table("q", "acct")
    replica = tmp_path / "r.db"
    args = ["consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up"]
    if point != "during the initial copy":
        assert run_cli_in_process(dsn, *args).returncode == 0
    # Several batches, each of several statements (events).
    for batch in range(3):
        with conn.transaction():
            conn.execute("UPDATE acct SET bal = bal - 1 WHERE id %% 7 = %s", (batch,))
            conn.execute("UPDATE acct SET bal = bal + 1 WHERE id %% 7 = %s", (batch + 1,))
            conn.execute("DELETE FROM acct WHERE id %% 50 = %s", (batch,))
            conn.execute("INSERT INTO acct VALUES (%s, 1, 'new')", (20000 + batch,))
            conn.execute("UPDATE acct SET id = id + 100000 WHERE id %% 97 = %s", (batch,))
        source.tick("q", force=True)

    killed = subprocess.run([sys.executable, "-c", KILLER, point, str(nth), *args], env=cli_env(dsn),
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, f"the kill point was not reached: {killed.stderr}"

    resumed = run_cli(dsn, *args)
    assert resumed.returncode == 0, resumed.stderr
    assert_replica_equals_source(conn, replica, [("public.acct", "acct", ["id"])])
    last_tick, batch_open = consumer_state(conn)
    assert (last_tick, batch_open) == (sqlite_position(replica), False)


# initial copy -----------------------------------------------------------------------------

def test_copy_skips_events_already_in_its_snapshot_and_applies_those_committed_after_it(dsn, conn, source,
                                                                                        tmp_path):
    """One tick per batch, so replaying an event the copy already holds would
    show: the counter would go back from 2 to 1."""
    conn.execute("CREATE TABLE counters (id int PRIMARY KEY, n int NOT NULL)")
    conn.execute("INSERT INTO counters SELECT g, 0 FROM generate_series(1, 10) g")
    source.create_queue("q")
    source.add_table("q", "counters")
    source.register_consumer("q", "c")               # the consumer's position predates the writes below
    conn.execute("UPDATE counters SET n = 1")
    source.tick("q", force=True)
    conn.execute("UPDATE counters SET n = 2")
    source.tick("q", force=True)
    replica = tmp_path / "r.db"
    target = SqliteTarget(replica)
    consumer = Consumer(dsn, "q", target, name="c", max_batch_events=1)
    try:
        with psycopg.connect(dsn) as in_progress:       # running during the copy, committed after it
            in_progress.execute("UPDATE counters SET n = 3 WHERE id = 1")
            assert consumer.run(once=True) == 1
            assert {r["n"] for r in sqlite_rows(replica, "counters", ["id"]).values()} == {2}
            in_progress.commit()
        assert consumer.run(until_caught_up=True) >= 1
    finally:
        consumer.close()
        target.close()
    rows = sqlite_rows(replica, "counters", ["id"])
    assert rows[(1,)]["n"] == 3
    assert_replica_equals_source(conn, replica, [("public.counters", "counters", ["id"])])
    assert sqlite_reader(replica).execute("SELECT copy_snapshot FROM _replicator_tables").fetchone() == (None,)


def test_writes_concurrent_with_the_copy_are_neither_lost_nor_doubled(dsn, conn, source, tmp_path):
    conn.execute("CREATE TABLE counters (id int PRIMARY KEY, n int NOT NULL, pad text)")
    conn.execute("INSERT INTO counters SELECT g, 0, repeat('x', 200) FROM generate_series(1, 100000) g")
    source.create_queue("q")
    source.add_table("q", "counters")
    source.register_consumer("q", "c")
    set_fast_ticks(conn)
    replica = tmp_path / "r.db"
    stop = threading.Event()
    written = {"updates": 0, "inserts": 0}

    def writer() -> None:
        rng = random.Random(1)
        with psycopg.connect(dsn, autocommit=True) as w:
            while not stop.is_set():
                ids = rng.sample(range(2, 100001), 20)
                w.execute("UPDATE counters SET n = n + 1 WHERE id = ANY(%s) OR id = 1", (ids,))
                written["updates"] += 1
                w.execute("INSERT INTO counters VALUES (%s, 0, 'new')", (200000 + written["inserts"],))
                written["inserts"] += 1

    thread = threading.Thread(target=writer)
    thread.start()
    ticker = Daemon(dsn, "ticker", "--interval", "0.05", log=tmp_path / "ticker.log")
    daemon = None
    try:
        wait_until(lambda: written["updates"] >= 20, 30, "writes before the copy")
        daemon = Daemon(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--consumer", "c",
                        log=tmp_path / "consumer.log")
        start = written["updates"]
        wait_until(lambda: sqlite_position(replica) and replica_has_table(replica, "counters"), 60, "the copy",
                   check=lambda: assert_alive(daemon))
        assert written["updates"] > start, "no write happened while the copy ran"
        target_tick = latest_tick(conn) + 3
        wait_until(lambda: (sqlite_position(replica) or 0) >= target_tick, 60, "batches after the copy",
                   check=lambda: assert_alive(daemon))
    finally:
        stop.set()
        thread.join(60)
        if daemon is not None:
            daemon.stop()
        ticker.stop()
    caught_up = run_cli_in_process(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--consumer", "c",
                                   "--until-caught-up")
    assert caught_up.returncode == 0, caught_up.stderr
    assert_replica_equals_source(conn, replica, [("public.counters", "counters", ["id"])])
    assert sqlite_rows(replica, "counters", ["id"])[(1,)]["n"] == written["updates"]


def test_a_copy_just_before_a_source_crash_keeps_no_lost_commit_and_skips_no_later_change(dsn, conn, source,
                                                                                          tmp_path):
    """The cluster runs with synchronous_commit = off: a crash loses the last commits,
    and PostgreSQL then gives their txids to new transactions. A copy whose snapshot
    showed them would keep rows the source lost, and skip as already copied the events
    of new transactions with those txids (below the snapshot's xmax). The WAL writer is
    held stopped, so the crash loses exactly what no synchronous commit flushed."""
    conn.execute("CREATE TABLE a (id int PRIMARY KEY); CREATE TABLE late (id int PRIMARY KEY, v text);"
                 " CREATE TABLE lost (id int)")
    conn.execute("INSERT INTO late SELECT g, 'before the add' FROM generate_series(1, 50) g")
    source.create_queue("q")
    source.add_table("q", "a")
    replica = tmp_path / "r.db"
    target = SqliteTarget(replica)
    consumer = Consumer(dsn, "q", target)
    try:
        consumer.connect()
        consumer.step()
        source.add_table("q", "late")
        source.tick("q", force=True)                       # durable: the add and everything before it
        walwriter = conn.execute("SELECT pid FROM pg_stat_activity WHERE backend_type = 'walwriter'").fetchone()[0]
        os.kill(walwriter, signal.SIGSTOP)
        try:
            conn.execute("UPDATE late SET v = 'committed just before the copy' WHERE id = 1")
            consumer.sync_tables()                         # the daemon notices late and copies it
            conn.execute("INSERT INTO lost VALUES (1)")    # committed after the copy: nothing flushes it
        finally:
            os.kill(walwriter, signal.SIGKILL)             # a crash: the server recovers from the WAL written
        wait_until(lambda: connection_lost(conn), 30, "the server to crash")
        consumer.close()
        with wait_until(lambda: try_connect(dsn), 60, "the server to recover") as after:
            lost = after.execute("SELECT count(*) FROM lost").fetchone()[0]
            assert lost == 0, "the crash lost nothing: the test proves nothing"
            after.execute("UPDATE late SET v = NULL WHERE id = 50")
            consumer.run(until_caught_up=True)
            assert_replica_equals_source(after, replica, [("public.late", "late", ["id"])])
    finally:
        consumer.close()
        target.close()


def connection_lost(conn: psycopg.Connection) -> bool:
    try:
        conn.execute("SELECT 1")
        return False
    except psycopg.OperationalError:
        return True


def try_connect(dsn: str) -> psycopg.Connection | None:
    try:
        return psycopg.connect(dsn, autocommit=True)
    except psycopg.OperationalError:
        return None


def replica_has_table(path: Path, table: str) -> bool:
    if not path.exists():
        return False
    db = sqlite_reader(path)
    try:
        return db.execute("SELECT count(*) FROM sqlite_master WHERE name = ?", (table,)).fetchone()[0] == 1
    finally:
        db.close()


def assert_alive(daemon: Daemon) -> None:
    assert daemon.alive(), f"daemon exited with {daemon.proc.returncode}:\n{daemon.log()[-3000:]}"


def test_table_added_while_the_daemon_runs_is_copied_and_followed(dsn, conn, source, tmp_path):
    conn.execute("CREATE TABLE a (id int PRIMARY KEY, v text); CREATE TABLE b (id int PRIMARY KEY, v text)")
    conn.execute("INSERT INTO b SELECT g, 'before' FROM generate_series(1, 1000) g")
    source.create_queue("q")
    source.add_table("q", "a")
    set_fast_ticks(conn)
    replica = tmp_path / "r.db"
    ticker = Daemon(dsn, "ticker", "--interval", "0.05", log=tmp_path / "ticker.log")
    daemon = Daemon(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--poll-interval", "0.05",
                    log=tmp_path / "consumer.log")
    try:
        conn.execute("INSERT INTO a VALUES (1, 'x')")
        wait_until(lambda: replica_has_table(replica, "a") and sqlite_rows(replica, "a", ["id"]), 30, "table a replicated",
                   check=lambda: assert_alive(daemon))
        with conn.transaction():
            source.add_table("q", "b")
            conn.execute("UPDATE b SET v = 'in add txn' WHERE id <= 10")
        conn.execute("INSERT INTO b SELECT g, 'after' FROM generate_series(1001, 1500) g")
        conn.execute("DELETE FROM b WHERE id BETWEEN 11 AND 20")
        tick = forced_tick(conn)                           # the ticker daemon may hold the queue
        wait_until(lambda: (sqlite_position(replica) or 0) >= tick, 30, "the daemon to pass the add",
                   check=lambda: assert_alive(daemon))
        assert_replica_equals_source(conn, replica, [("public.a", "a", ["id"]), ("public.b", "b", ["id"])])
        assert daemon.terminate() == 0
    finally:
        daemon.stop()
        ticker.stop()
    assert "Traceback" not in daemon.log()


@pytest.mark.parametrize(("ddl", "replicated"), [("DROP TABLE b", []), ("ALTER TABLE b RENAME TO b2", ["b2"])])
def test_a_table_dropped_or_renamed_while_its_initial_copy_starts_is_replicated_as_the_source_ends(
        dsn, conn, source, tmp_path, ddl, replicated):
    """DDL that commits after the consumer listed the queue's tables, before its copy read the table
    (here: holding the lock the copy waits for). A drop: the copy formatted the dead oid into SQL
    (`syntax error at or near "16671"`), or read the table by a name gone meanwhile: the consumer
    stopped at every start. A rename: the replica kept the old name (the RENAME, in the copy, is
    skipped with it). Now the copy locks the table, then reads it as its snapshot shows it."""
    replica = tmp_path / "r.db"
    copy_while_a_ddl_holds_the_table(dsn, conn, source, f"sqlite:{replica}", ddl)
    for name in replicated:
        conn.execute(f"INSERT INTO {name} VALUES (3, 'after')")
    assert run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up").returncode == 0
    assert not replica_has_table(replica, "b")
    assert_replica_equals_source(conn, replica, [(f"public.{name}", name, ["id"]) for name in ["a", *replicated]])


def test_a_new_table_renamed_onto_a_replicated_tables_name_while_its_copy_starts_waits_for_that_name(
        dsn, conn, source, tmp_path):
    """A blue/green swap that commits while the copy of the new table waits for its lock: the copy's
    snapshot shows the new table under the name the target still gives the old one (whose RENAME is in
    a batch not applied yet). Copied at once, it replaced the old table's replica, whose events a
    running consumer then passed over (a later run copied it anew)."""
    conn.execute("CREATE TABLE live (id int PRIMARY KEY, v text); CREATE TABLE green (id int PRIMARY KEY, v text)")
    conn.execute("INSERT INTO live VALUES (1, 'blue'); INSERT INTO green VALUES (2, 'green')")
    source.create_queue("q")
    source.add_table("q", "live")
    replica = tmp_path / "r.db"
    assert run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up").returncode == 0
    source.add_table("q", "green")
    consume_while_a_ddl_holds_the_copy(dsn, conn, f"sqlite:{replica}",
                                       "ALTER TABLE live RENAME TO blue; ALTER TABLE green RENAME TO live")
    # the old table's replica kept, under its old name or, once the swap's events are applied, its new one
    held = {name: sqlite_rows(replica, name, ["id"]) for name in ("live", "blue") if replica_has_table(replica, name)}
    assert any((1,) in rows for rows in held.values()), held
    assert run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up").returncode == 0
    assert_replica_equals_source(conn, replica, [("public.blue", "blue", ["id"]), ("public.live", "live", ["id"])])


def test_a_table_renamed_while_its_copy_again_starts_is_replicated_under_its_new_name_alone(dsn, conn, source,
                                                                                           tmp_path):
    """A RENAME that commits after the consumer read a rewrite's schema event, before the copy again
    read the table (here: holding the lock the copy waits for): the replica kept the old table, empty,
    beside the copy under the new name, both with the table's id (a table created later under the old
    name was then never copied: its name held by the stale one)."""
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v int)")
    conn.execute("INSERT INTO t SELECT g, g FROM generate_series(1, 20) g")
    source.create_queue("q")
    source.add_table("q", "t")
    replica = tmp_path / "r.db"
    assert run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up").returncode == 0
    conn.execute("ALTER TABLE t ALTER COLUMN v TYPE bigint")   # a rewrite: the replica is copied again
    consume_while_a_ddl_holds_the_copy(dsn, conn, f"sqlite:{replica}", "ALTER TABLE t RENAME TO t2")
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    conn.execute("INSERT INTO t VALUES (1, 'new')")
    source.add_table("q", "t")
    assert run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up").returncode == 0
    assert_replica_equals_source(conn, replica, [("public.t2", "t2", ["id"]), ("public.t", "t", ["id"])])



@pytest.mark.parametrize("swap", ["ALTER TABLE live RENAME TO blue", "DROP TABLE live"])
def test_a_table_copied_again_under_a_name_another_table_still_has_waits_for_that_name(dsn, conn, source, tmp_path,
                                                                                       swap):
    """A blue/green swap after a rewrite of the new table, all queued: the rewrite's copy again reads
    the new table under the name the target still gives the old one (whose RENAME or DROP is later in
    the queue). Copied at once, it replaced the old table's replica, and the old table's RENAME then
    took the new table's rows away under the old table's new name, or its DROP dropped them. Now the
    copy waits for a name a table the queue captures has (copied anew once it is free, as a new table
    is), and takes one a dropped table had, whose last events then are passed over."""
    conn.execute("CREATE TABLE live (id int PRIMARY KEY, v int); CREATE TABLE green (id int PRIMARY KEY, v int)")
    conn.execute("INSERT INTO live SELECT g, g FROM generate_series(1, 10) g")
    conn.execute("INSERT INTO green SELECT g, -g FROM generate_series(5, 30) g")
    source.create_queue("q")
    source.add_table("q", "live")
    source.add_table("q", "green")
    replica = tmp_path / "r.db"
    assert run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up").returncode == 0
    conn.execute("ALTER TABLE green ALTER COLUMN v TYPE bigint")   # a rewrite: the replica is copied again
    conn.execute("UPDATE green SET v = v - 100 WHERE id < 10; UPDATE live SET v = 0 WHERE id = 1")
    with conn.transaction():
        conn.execute(swap)
        conn.execute("ALTER TABLE green RENAME TO live")
    conn.execute("INSERT INTO live VALUES (100, 100)")
    kept = [("public.live", "live", ["id"])]
    if swap.startswith("ALTER"):
        conn.execute("INSERT INTO blue VALUES (100, 100)")
        kept.append(("public.blue", "blue", ["id"]))
    assert run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up").returncode == 0
    assert not replica_has_table(replica, "green")
    assert_replica_equals_source(conn, replica, kept)

# PK-only tables ------------------------------------------------------------------------------

def test_pk_mode_applies_current_source_rows_for_collapsed_keys(dsn, conn, source, tmp_path):
    conn.execute("CREATE TABLE p (id int PRIMARY KEY, v text, n int)")
    conn.execute("INSERT INTO p SELECT g, 'v' || g, 0 FROM generate_series(1, 100) g")
    source.create_queue("q")
    source.add_table("q", "p", mode="pk")
    replica = tmp_path / "r.db"
    consume(dsn, replica)
    assert len(sqlite_rows(replica, "p", ["id"])) == 100
    with conn.transaction():
        for _ in range(5):
            conn.execute("UPDATE p SET n = n + 1, v = 'five' WHERE id = 1")
        conn.execute("INSERT INTO p VALUES (1000, 'born and gone', 0)")
        conn.execute("DELETE FROM p WHERE id = 1000")
        conn.execute("DELETE FROM p WHERE id BETWEEN 2 AND 5")
        conn.execute("UPDATE p SET id = id + 500 WHERE id BETWEEN 6 AND 8")          # key change
        conn.execute("INSERT INTO p SELECT g, 'bulk', g FROM generate_series(2001, 14000) g")   # > 5000 keys
    conn.execute("UPDATE p SET v = 'later' WHERE id = 9")
    consume(dsn, replica)
    assert_replica_equals_source(conn, replica, [("public.p", "p", ["id"])])
    rows = sqlite_rows(replica, "p", ["id"])
    assert rows[(1,)] == {"id": 1, "v": "five", "n": 5}
    assert (1000,) not in rows and (6,) not in rows and (506,) in rows

    conn.execute("TRUNCATE p")
    conn.execute("INSERT INTO p VALUES (1, 'after truncate', 1)")
    consume(dsn, replica)
    assert sqlite_rows(replica, "p", ["id"]) == {(1,): {"id": 1, "v": "after truncate", "n": 1}}


def test_pk_mode_reads_back_rows_keyed_by_arrays_composites_and_jsonb(dsn, conn, source, tmp_path):
    """Such key values travel as JSON text: the join-back must turn them back into values."""
    conn.execute("CREATE TYPE pair AS (x int, y text); CREATE DOMAIN nn AS int NOT NULL;"
                 " CREATE TABLE odd (k int[], p pair, j jsonb, z float8[], n nn, v text, PRIMARY KEY (k, p, j, z))")
    source.create_queue("q")
    source.add_table("q", "odd", mode="pk")
    replica = tmp_path / "r.db"
    consume(dsn, replica)
    conn.execute("""INSERT INTO odd VALUES ('{1,2}', '(1,"a b")', '{"a": 1.50, "b": [true]}', '{0.1,2}', 1, 'x'),"""
                 """ ('{}', '(2,)', '[]', '{}', 2, 'y'), ('{3}', '(3,c)', '"s"', '{NaN}', 3, 'z')""")
    consume(dsn, replica)
    conn.execute("""UPDATE odd SET v = 'updated' WHERE k = '{1,2}'; DELETE FROM odd WHERE k = '{}'""")
    consume(dsn, replica)
    replica_rows = {k: (r["n"], r["v"]) for k, r in sqlite_rows(replica, "odd", ["k", "p", "j", "z"]).items()}
    assert replica_rows == {
        ("[1,2]", '{"x":1,"y":"a b"}', '{"a": 1.50, "b": [true]}', "[0.1,2]"): (1, "updated"),
        ("[3]", '{"x":3,"y":"c"}', '"s"', '["NaN"]'): (3, "z"),
    }


def test_pk_mode_reads_back_through_a_row_filter_and_columns_holding_percent_signs(dsn, conn, source, tmp_path):
    """The row filter is SQL text and the join-back query takes parameters: a % in
    either must stay a % (a modulo, a LIKE pattern, a column name), not a placeholder."""
    conn.execute("""CREATE TABLE pct (id int PRIMARY KEY, "share%" int, "b%s" text)""")
    conn.execute("""INSERT INTO pct SELECT g, g % 7, 'u' || g FROM generate_series(1, 30) g""")
    source.create_queue("q")
    source.add_table("q", "pct", mode="pk", where="""id % 2 = 0 AND "b%s" LIKE 'u%'""")
    replica = tmp_path / "r.db"
    consume(dsn, replica)
    conn.execute("""UPDATE pct SET "share%" = -1 WHERE id <= 10""")
    conn.execute("""INSERT INTO pct VALUES (100, 1, 'u100'), (102, 2, 'x102')""")
    consume(dsn, replica)
    rows = sqlite_rows(replica, "pct", ["id"])
    assert sorted(k for (k,) in rows) == [i for i in range(2, 31, 2)] + [100]
    assert rows[(4,)] == {"id": 4, "share%": -1, "b%s": "u4"} and rows[(12,)]["share%"] == 5


def test_pk_mode_is_refused_for_nullable_key_columns(conn, source):
    conn.execute("CREATE TABLE nokey (k int, v text); CREATE TABLE nnkey (k int NOT NULL, v text)")
    source.create_queue("q")
    from replicator.errors import UserError
    with pytest.raises(UserError, match=r"(?i)null"):
        source.add_table("q", "nokey", mode="pk", key=["k"])
    assert source.add_table("q", "nnkey", mode="pk", key=["k"]) > 0
    assert source.add_table("q", "nokey", mode="full", key=["k"]) > 0


# readers see whole batches ----------------------------------------------------------------

def test_reader_polling_the_wal_replica_never_sees_part_of_a_batch(dsn, conn, source, tmp_path):
    """Transfers keep the sum of balances constant; bulk inserts add 2500 rows
    (three 1000-row events) at once. A reader polling with its own connection
    must only ever see the invariant hold, and one state per position: rows of a
    batch committed apart from each other, or from the position, would show two."""
    conn.execute("CREATE TABLE acct (id int PRIMARY KEY, bal bigint NOT NULL);"
                 " CREATE TABLE bulk (id int PRIMARY KEY, grp int NOT NULL)")
    conn.execute("INSERT INTO acct SELECT g, 1000 FROM generate_series(1, 50) g")
    source.create_queue("q")
    source.add_table("q", "acct")
    source.add_table("q", "bulk")
    set_fast_ticks(conn)
    replica = tmp_path / "r.db"
    consume(dsn, replica)
    stop = threading.Event()
    observations: list[tuple[int, int, int]] = []
    violations: list[tuple[int, int, int]] = []
    states: dict[int, set[tuple[str, int]]] = {}

    def reader() -> None:
        db = sqlite_reader(replica)
        try:
            while not stop.is_set():
                db.execute("BEGIN")
                total, balances = db.execute("SELECT sum(bal), group_concat(bal) FROM"
                                             " (SELECT bal FROM acct ORDER BY id)").fetchone()
                count, = db.execute("SELECT count(*) FROM bulk").fetchone()
                tick, = db.execute("SELECT last_tick FROM _replicator_position").fetchone()
                db.execute("COMMIT")
                observations.append((total, count, tick))
                states.setdefault(tick, set()).add((balances, count))
                if total != 50000 or count % 2500:
                    violations.append((total, count, tick))
        finally:
            db.close()

    def transfers(seed: int) -> None:
        rng = random.Random(seed)
        with psycopg.connect(dsn, autocommit=True) as w:
            for i in range(150):
                if i % 15 == 0:     # spread the writes over many ticks
                    seen_tick = latest_tick(w)
                    wait_until(lambda: latest_tick(w) > seen_tick, 30, "the ticker")
                a, b = rng.sample(range(1, 51), 2)
                amount = rng.randint(1, 50)
                try:
                    with w.transaction():
                        w.execute("UPDATE acct SET bal = bal - %s WHERE id = %s", (amount, a))
                        w.execute("UPDATE acct SET bal = bal + %s WHERE id = %s", (amount, b))
                except psycopg.errors.DeadlockDetected:
                    pass
                if seed == 0 and i % 30 == 0:
                    w.execute("INSERT INTO bulk SELECT g, %s FROM generate_series(%s::int, %s::int) g",
                              (i, i * 10000, i * 10000 + 2499))

    ticker = Daemon(dsn, "ticker", "--interval", "0.02", log=tmp_path / "ticker.log")
    daemon = Daemon(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--poll-interval", "0.02",
                    log=tmp_path / "consumer.log")
    threads = [threading.Thread(target=reader)] + [threading.Thread(target=transfers, args=(s,))
                                                    for s in range(3)]
    try:
        wait_until(lambda: "resumes" in daemon.log(), 30, "the daemon to start", check=lambda: assert_alive(daemon))
        for t in threads:
            t.start()
        for t in threads[1:]:
            t.join(120)
        tick = forced_tick(conn)
        wait_until(lambda: (sqlite_position(replica) or 0) >= tick, 60, "the daemon to catch up",
                   check=lambda: assert_alive(daemon))
    finally:
        stop.set()
        threads[0].join(30)
        daemon.stop()
        ticker.stop()
    assert not violations, violations[:10]
    assert {tick: len(seen) for tick, seen in states.items() if len(seen) > 1} == {}
    assert len({o[2] for o in observations}) >= 5, "the reader saw too few batches to prove anything"
    assert len({o[1] for o in observations}) >= 3, "the reader never saw a bulk insert arrive"
    assert_replica_equals_source(conn, replica, [("public.acct", "acct", ["id"]), ("public.bulk", "bulk", ["id"])])


# --once, --until-caught-up, SIGTERM ---------------------------------------------------------

def test_once_applies_one_batch_and_until_caught_up_applies_everything_committed_before_it(dsn, conn, source,
                                                                                          tmp_path):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
    source.create_queue("q")
    source.add_table("q", "t")
    replica = tmp_path / "r.db"
    args = ["consume", "q", "--target", f"sqlite:{replica}"]
    assert run_cli_in_process(dsn, *args, "--until-caught-up").returncode == 0
    start = sqlite_position(replica)

    conn.execute("INSERT INTO t VALUES (1)")
    t1 = source.tick("q", force=True)
    conn.execute("INSERT INTO t VALUES (2)")          # committed, no tick yet: not in the next batch
    once = run_cli_in_process(dsn, *args, "--once")
    assert once.returncode == 0, once.stderr
    assert (start, sqlite_position(replica)) == (t1 - 1, t1)
    assert set(sqlite_rows(replica, "t", ["id"])) == {(1,)}

    assert run_cli_in_process(dsn, *args, "--once").returncode == 0     # no tick: nothing to do, still exit 0
    assert sqlite_position(replica) == t1

    conn.execute("INSERT INTO t VALUES (3)")
    with psycopg.connect(dsn) as open_txn:                   # open when the call starts: not waited for
        open_txn.execute("INSERT INTO t VALUES (4)")
        started = time.monotonic()
        caught_up = run_cli_in_process(dsn, *args, "--until-caught-up")
        assert caught_up.returncode == 0, caught_up.stderr
        assert time.monotonic() - started < 30
        assert set(sqlite_rows(replica, "t", ["id"])) == {(1,), (2,), (3,)}
        open_txn.commit()
    assert run_cli_in_process(dsn, *args, "--until-caught-up").returncode == 0
    assert set(sqlite_rows(replica, "t", ["id"])) == {(1,), (2,), (3,), (4,)}


def test_applied_batches_are_logged_per_interval_and_an_idle_queue_logs_nothing(dsn, conn, source, tmp_path,
                                                                               caplog):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
    source.create_queue("q")
    source.add_table("q", "t")
    caplog.set_level(logging.INFO, logger="replicator")

    def applied_lines(path: Path, **options: float) -> list[str]:
        """What one run until caught up logs of what it applied, times and lag as N."""
        target = SqliteTarget(path)
        consumer = Consumer(dsn, "q", target, max_batch_events=1, **options)
        caplog.clear()
        try:
            consumer.run(until_caught_up=True)
        finally:
            consumer.close()
            target.close()
        lines = [r.getMessage() for r in caplog.records if " applied " in r.getMessage()]
        for line in lines:     # seconds since the last line, and the age of the last batch's tick
            seconds, lag = map(float, re.findall(r"\b([0-9]+\.[0-9])s\b", line))
            assert 0 <= seconds < 60 and 0 <= lag < 60, line
        return [re.sub(r"\b[0-9]+\.[0-9]s\b", "Ns", line) for line in lines]

    assert applied_lines(tmp_path / "each.db", stats_interval=0) == []       # registers: nothing to apply
    assert applied_lines(tmp_path / "summed.db") == []
    conn.execute("INSERT INTO t SELECT generate_series(1, 3)")
    source.tick("q", force=True)
    conn.execute("INSERT INTO t SELECT generate_series(4, 8)")
    source.tick("q", force=True)
    assert applied_lines(tmp_path / "each.db", stats_interval=0) == [
        "queue q: 1 batch, 1 event, 3 rows applied in the last Ns; lag Ns",
        "queue q: 1 batch, 1 event, 5 rows applied in the last Ns; lag Ns"]
    [summed] = applied_lines(tmp_path / "summed.db")
    assert re.fullmatch(r"queue q: \d+ batches, 2 events, 8 rows applied in the last Ns; lag Ns", summed), summed
    assert applied_lines(tmp_path / "each.db", stats_interval=0) == []       # caught up: empty batches only


def test_daemon_finishes_the_current_batch_on_sigterm_and_exits_0(dsn, conn, source, tmp_path):
    conn.execute("CREATE TABLE big (id int PRIMARY KEY, v int)")
    source.create_queue("q")
    source.add_table("q", "big")
    replica = tmp_path / "r.db"
    args = ["consume", "q", "--target", f"sqlite:{replica}"]
    assert run_cli_in_process(dsn, *args, "--until-caught-up").returncode == 0
    conn.execute("INSERT INTO big SELECT g, g FROM generate_series(1, 300000) g")
    tick = source.tick("q", force=True)
    daemon = Daemon(dsn, *args, log=tmp_path / "consumer.log")
    try:
        wait_until(lambda: consumer_state(conn)[1], 30, "the daemon to open the batch",
                   check=lambda: assert_alive(daemon), interval=0.005)
        assert daemon.terminate() == 0, daemon.log()
    finally:
        daemon.stop()
    assert sqlite_position(replica) == tick
    db = sqlite_reader(replica)
    try:
        assert db.execute("SELECT count(*) FROM big").fetchone()[0] == 300000
    finally:
        db.close()
    assert consumer_state(conn) == (tick, False)


def durable_commits(conn: psycopg.Connection) -> None:
    """The throwaway cluster runs with synchronous_commit = off: a crash there
    loses recently committed transactions, ticks included, and a replica that
    already applied a lost tick then disagrees with the source. Tests that
    crash the server make this database's commits durable first."""
    dbname = conn.info.dbname
    conn.execute(f'ALTER DATABASE "{dbname}" SET synchronous_commit = on')


def test_daemon_survives_a_source_outage_longer_than_its_first_backoff(dsn, conn, source, tmp_path, pg_server):
    durable_commits(conn)
    conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
    source.create_queue("q")
    source.add_table("q", "t")
    replica = tmp_path / "r.db"
    daemon = Daemon(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--poll-interval", "0.05",
                    log=tmp_path / "consumer.log")
    try:
        wait_until(lambda: replica_has_table(replica, "t"), 30, "the daemon to copy t",
                   check=lambda: assert_alive(daemon))
        conn.close()
        source.conn.close()
        pg_server.stop("immediate")
        try:
            wait_until(lambda: daemon.log().count("reconnecting") >= 3, 30, "three failed reconnections",
                       check=lambda: assert_alive(daemon))
        finally:
            pg_server.start()
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("INSERT INTO t VALUES (1)")
            tick = c.execute("SELECT replicator.ticker('q', true)").fetchone()[0]
        wait_until(lambda: (sqlite_position(replica) or 0) >= tick, 60, "the daemon to apply after the outage",
                   check=lambda: assert_alive(daemon))
        assert set(sqlite_rows(replica, "t", ["id"])) == {(1,)}
        assert daemon.terminate() == 0
    finally:
        daemon.stop()


# the replica's files changed under a running consumer -----------------------------------

@pytest.mark.parametrize("how", ["deleted", "replaced by another file", "its -wal deleted"])
def test_a_replica_deleted_under_the_running_consumer_stops_it_at_the_next_batch(dsn, conn, source, tmp_path, how):
    from replicator.errors import UserError
    conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
    source.create_queue("q")
    source.add_table("q", "t")
    replica = tmp_path / "r.db"
    target = SqliteTarget(replica)
    consumer = Consumer(dsn, "q", target)
    try:
        consumer.run(until_caught_up=True)
        position = consumer_state(conn)[0]
        if how == "deleted":
            for path in tmp_path.glob("r.db*"):
                path.unlink()
        elif how == "replaced by another file":
            other = tmp_path / "other.db"
            sqlite3.connect(other).close()
            other.replace(replica)
        else:
            Path(f"{replica}-wal").unlink()
        conn.execute("INSERT INTO t VALUES (1)")
        forced_tick(conn)
        word = "replaced" if how.startswith("replaced") else "deleted"
        with pytest.raises(UserError, match=rf"{re.escape(str(replica))}(-wal)? was {word}.*consumer stopped"):
            consumer.run(until_caught_up=True)
        # Nothing was acknowledged: the batch is the source's to give again.
        assert consumer_state(conn)[0] == position
    finally:
        consumer.close()
        target.close()


def test_a_shm_truncated_under_the_running_consumer_stops_it_with_a_message_not_sigbus(dsn, conn, source, tmp_path):
    """A -shm file cut short under a process that maps it makes the process's next access
    to it a SIGBUS, which ends it without a word (another program's cleanup, a copy over
    the replica's files). Checked before each batch, the consumer stops first, with a line."""
    conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
    source.create_queue("q")
    source.add_table("q", "t")
    replica = tmp_path / "r.db"
    daemon = Daemon(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--poll-interval", "0.05",
                    log=tmp_path / "consumer.log")
    try:
        wait_until(lambda: replica_has_table(replica, "t"), 30, "the daemon to copy t",
                   check=lambda: assert_alive(daemon))
        # and to apply the batch after the copy: cut short in the middle of a batch, the -shm
        # kills it by SIGBUS (test_a_sigbus_in_the_consumer_is_reported_with_its_stack_not_silent)
        wait_until(lambda: sqlite_position(replica) == latest_tick(conn), 30, "the daemon to catch up",
                   check=lambda: assert_alive(daemon))
        os.truncate(f"{replica}-shm", 0)
        conn.execute("INSERT INTO t VALUES (1)")
        forced_tick(conn)
        wait_until(lambda: daemon.proc.poll() is not None, 30, "the daemon to stop")
        rc = daemon.proc.returncode
        last = daemon.log().strip().splitlines()[-1]
        assert rc == 1, daemon.log()
        assert last.startswith("error: ") and f"{replica}-shm was truncated" in last, daemon.log()
    finally:
        daemon.stop()


def test_a_sigbus_in_the_consumer_is_reported_with_its_stack_not_silent(dsn, conn, source, tmp_path):
    """What the file checks cannot prevent (a -shm cut short in the middle of a batch)
    still ends the process by SIGBUS: it says so, with where it was."""
    conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
    source.create_queue("q")
    source.add_table("q", "t")
    replica = tmp_path / "r.db"
    daemon = Daemon(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--poll-interval", "0.05",
                    log=tmp_path / "consumer.log")
    try:
        wait_until(lambda: replica_has_table(replica, "t"), 30, "the daemon to copy t",
                   check=lambda: assert_alive(daemon))
        os.kill(daemon.pid, signal.SIGBUS)
        wait_until(lambda: daemon.proc.poll() is not None, 30, "the daemon to stop")
        assert daemon.proc.returncode == -signal.SIGBUS
        assert "Fatal Python error: Bus error" in daemon.log() and "most recent call first" in daemon.log()
    finally:
        daemon.stop()


def test_a_replica_deleted_under_a_running_consumer_is_rebuilt_by_following_its_stop_message(dsn, conn, source,
                                                                                              tmp_path):
    """`rm replica.db` under a running consumer: it stops and says to run the same command
    again, which then builds the replica anew. The consumer's -wal and -shm, left by the
    SQLite connection it closes, would be refused as a WAL without its database: it
    removes them, found by the identity of those it had open."""
    conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
    conn.execute("INSERT INTO t VALUES (1)")
    source.create_queue("q")
    source.add_table("q", "t")
    replica = tmp_path / "r.db"
    consume_args = ["consume", "q", "--target", f"sqlite:{replica}", "--poll-interval", "0.05"]
    daemon = Daemon(dsn, *consume_args, log=tmp_path / "consumer.log")
    try:
        wait_until(lambda: replica_has_table(replica, "t"), 30, "the daemon to copy t",
                   check=lambda: assert_alive(daemon))
        replica.unlink()
        conn.execute("INSERT INTO t VALUES (2)")
        forced_tick(conn)
        wait_until(lambda: daemon.proc.poll() is not None, 30, "the daemon to stop")
        assert daemon.proc.returncode == 1, daemon.log()
        last = daemon.log().strip().splitlines()[-1]
    finally:
        daemon.stop()
    assert last.startswith(f"error: {replica} was deleted"), last
    assert "run the same `replicator consume` again to build the replica anew" in last, last
    assert "aside" not in last, last                     # nothing else to do first
    rebuilt = run_cli_in_process(dsn, *consume_args, "--until-caught-up")
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert set(sqlite_rows(replica, "t", ["id"])) == {(1,), (2,)}


def test_a_replica_overwritten_in_place_under_the_running_consumer_stops_it_and_leaves_the_file_as_copied(
        dsn, conn, source, tmp_path):
    """shutil.copyfile(other.db, replica.db) keeps the replica's inode: only the header
    tells (no replicator application id). The consumer stops before its next batch and
    neither commits into the file now there nor checkpoints its WAL into it on close; its
    -wal and -shm, which SQLite would replay into that file, are removed."""
    from replicator.errors import UserError
    conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
    source.create_queue("q")
    source.add_table("q", "t")
    replica, other = tmp_path / "r.db", tmp_path / "other.db"
    with closing(sqlite3.connect(other)) as db:
        db.execute("CREATE TABLE notes (note TEXT)")
        db.execute("INSERT INTO notes VALUES ('mine')")
        db.commit()
    target = SqliteTarget(replica)
    consumer = Consumer(dsn, "q", target)
    try:
        conn.execute("INSERT INTO t VALUES (1)")
        consumer.run(until_caught_up=True)
        position = consumer_state(conn)[0]
        assert Path(f"{replica}-wal").stat().st_size > 0       # batches not yet checkpointed into the file
        shutil.copyfile(other, replica)
        conn.execute("INSERT INTO t VALUES (2)")
        forced_tick(conn)
        with pytest.raises(UserError, match=rf"{re.escape(str(replica))} was overwritten in place.*consumer "
                                            rf"stopped.*left it as it now is"):
            consumer.run(until_caught_up=True)
        assert consumer_state(conn)[0] == position
    finally:
        consumer.close()
        target.close()
    assert replica.read_bytes() == other.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.db", "r.db"]


def _replica_of_one_row(dsn: str, conn: psycopg.Connection, source: Source, tmp_path: Path) -> Path:
    """A replica of queue q holding table t with one row."""
    conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
    source.create_queue("q")
    source.add_table("q", "t")
    replica = tmp_path / "r.db"
    conn.execute("INSERT INTO t VALUES (1)")
    consume(dsn, replica)
    return replica


def test_a_replica_without_the_application_id_is_adopted_and_followed_while_only_its_wal_has_it(dsn, conn, source,
                                                                                                tmp_path):
    """A replica made before the application id has 0 there: opened, it gets replicator's.
    While a reader holds the checkpoint back, the id is only in the WAL: the header check
    before each batch does not take the main file's 0 for another file."""
    replica = _replica_of_one_row(dsn, conn, source, tmp_path)
    with closing(sqlite3.connect(replica)) as db:
        db.execute("PRAGMA application_id = 0")
        db.commit()

    def application_id() -> int:
        return int.from_bytes(replica.read_bytes()[68:72], "big")

    assert application_id() == 0
    reader = sqlite_reader(replica)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM t").fetchone()
    target = SqliteTarget(replica)
    consumer = Consumer(dsn, "q", target)
    try:
        assert application_id() == 0                        # set, but in the WAL only
        conn.execute("INSERT INTO t VALUES (2)")
        assert consumer.run(until_caught_up=True) >= 1
        reader.close()
        conn.execute("INSERT INTO t VALUES (3)")
        consumer.run(until_caught_up=True)
    finally:
        consumer.close()
        target.close()
    assert application_id() == 0x52504C43            # "RPLC"
    assert set(sqlite_rows(replica, "t", ["id"])) == {(1,), (2,), (3,)}


def test_a_live_replica_whose_main_file_is_behind_its_wal_is_still_taken_for_the_replica(dsn, conn, source,
                                                                                         tmp_path):
    """Between checkpoints a replica's main file may hold pages of several commits, readable only
    with its WAL (a checkpoint readers held back halfway): the replica is known by the id in its
    header, not by reading its tables without the WAL (which read as malformed there)."""
    replica = _replica_of_one_row(dsn, conn, source, tmp_path)
    image = bytearray(replica.read_bytes())
    page = int.from_bytes(image[16:18], "big")
    image[100:page] = b"\xff" * (page - 100)             # the schema's page as no one commit wrote it
    replica.write_bytes(bytes(image))
    Path(f"{replica}-wal").write_bytes(b"\x00" * 32)      # and a WAL beside it
    assert replica_state(replica) == "replica"
