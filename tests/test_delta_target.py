"""The Delta target: every replicated table a Delta Lake table equal to the source.

Real PostgreSQL, the real consumer (the `replicator` console script, or a
Consumer in-process where a module constant is patched), real files; the
tables are read with delta-rs (the deltalake package), not with replicator's
own reader. The oracle renders the source as the Python values each Delta type
holds (Decimal for numeric(p,s), UTC datetimes for timestamptz, naive ones for
timestamp, to_json's text for json and arrays, PostgreSQL's text for the
rest), independently of replicator.structure and replicator.targets.arrow.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import struct
import threading
from collections.abc import Sequence
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

pytest.importorskip("deltalake")
from deltalake import DeltaTable

from consumer_helpers import (
    Daemon,
    LosesTheSourceOnce,
    apply_losing_the_source_once,
    copy_while_a_ddl_holds_the_table,
    forced_tick,
    run_cli,
    run_cli_in_process,
    set_fast_ticks,
    wait_until,
)
from pg_helpers import execute_retrying_deadlocks, fresh_database
from replicator.consumer import Consumer
from replicator.errors import UserError
from replicator.targets.delta import deletion_vectors
from replicator.targets.delta.reader import table_uris, versions_as_of
from replicator.targets.delta.state import WarehouseState
from replicator.targets.delta.storage import LocalStorage
from replicator.targets.delta.target import DeltaTarget

# the oracle -------------------------------------------------------------------------------

_NATIVE = ("smallint", "integer", "bigint", "boolean", "real", "double precision", "bytea", "date", "text",
           "timestamp without time zone", "timestamp with time zone")
_DOCUMENT = ("json", "jsonb")


def pg_columns(conn: psycopg.Connection, table: str) -> list[tuple[str, str]]:
    """(name, type with its modifier) of each column, in order."""
    return conn.execute("SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid ="
                        " %s::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum", (table,)).fetchall()


def primary_key(conn: psycopg.Connection, table: str) -> list[str]:
    return [r[0] for r in conn.execute(
        "SELECT a.attname FROM pg_index i CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY k(attnum, n)"
        " JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum"
        " WHERE i.indrelid = %s::regclass AND i.indisprimary ORDER BY k.n", (table,))]


def _decimal_column(typ: str) -> bool:
    if not typ.startswith("numeric("):
        return False
    precision, scale = (int(x) for x in typ[8:-1].split(","))
    return precision <= 38 and 0 <= scale <= precision


def _select(name: str, typ: str) -> str:
    quoted = f'"{name}"'
    if typ in _NATIVE or _decimal_column(typ) or typ.startswith("character varying"):
        return quoted
    if typ in _DOCUMENT or typ.endswith("[]"):
        return f"to_json({quoted})::text"
    return f"{quoted}::text"


def source_state(conn: psycopg.Connection, table: str) -> tuple[list[str], dict[tuple[Any, ...], dict[str, Any]]]:
    """The source table as {key: {column: value as the Delta table holds it}}, and its column names."""
    columns = pg_columns(conn, table)
    key = primary_key(conn, table)
    rows = conn.execute(f"SELECT {', '.join(_select(n, t) for n, t in columns)} FROM {table}").fetchall()
    out = {}
    for values in rows:
        record = {name: _expected(value, typ) for (name, typ), value in zip(columns, values)}
        out[tuple(record[k] for k in key)] = record
    return [n for n, _ in columns], out


def _expected(value: Any, typ: str) -> Any:
    if value is None:
        return None
    if typ == "real":   # a float4: the value the float32 column holds
        return struct.unpack("<f", struct.pack("<f", value))[0]
    if isinstance(value, datetime) and value.tzinfo is not None:
        return value.astimezone(UTC)
    if isinstance(value, memoryview):
        return bytes(value)
    return value


def _same(expected: Any, actual: Any) -> bool:
    if isinstance(expected, float):
        return isinstance(actual, float) and (actual == expected or (math.isnan(expected) and math.isnan(actual)))
    if isinstance(expected, datetime):
        return (isinstance(actual, datetime) and actual == expected
                and (actual.tzinfo is None) == (expected.tzinfo is None)
                and (actual.tzinfo is None or actual.utcoffset() == timedelta(0)))
    if isinstance(expected, Decimal):
        return isinstance(actual, Decimal) and actual == expected
    return type(actual) is type(expected) and actual == expected


def delta_rows(uri: str, key: Sequence[str], version: int | None = None
               ) -> tuple[list[str], dict[tuple[Any, ...], dict[str, Any]]]:
    """A Delta table read by delta-rs (at a version): its column names and {key: row}; its keys
    must be unique."""
    table = DeltaTable(uri, version=version) if version is not None else DeltaTable(uri)
    data = pa.table(table.scan().read_all())   # arro3 → pyarrow
    rows = data.to_pylist()   # string_view columns: compared as Python values
    out = {tuple(r[k] for k in key): r for r in rows}
    duplicates = len(rows) - len(out)
    assert not duplicates, f"{uri}: {duplicates} rows with a key another row has"
    return data.column_names, out


def diff(table: str, expected: tuple[list[str], dict], actual: tuple[list[str], dict]) -> list[str]:
    (want_columns, want), (got_columns, got) = expected, actual
    if want_columns != got_columns:
        return [f"{table}: columns {got_columns}, the source's are {want_columns}"]
    problems = [f"{table}: row {k} missing" for k in sorted(want.keys() - got.keys(), key=repr)]
    problems += [f"{table}: row {k} not in the source: {got[k]}" for k in sorted(got.keys() - want.keys(), key=repr)]
    for k in sorted(want.keys() & got.keys(), key=repr):
        problems += [f"{table} {k}.{c}: source {want[k][c]!r}, Delta {got[k][c]!r}"
                     for c in want_columns if not _same(want[k][c], got[k][c])]
    return problems


def assert_equal_to_source(conn: psycopg.Connection, path: Path, tables: Sequence[str]) -> None:
    uris = table_uris(str(path))
    problems = []
    for table in tables:
        qualified = table if "." in table else f"public.{table}"
        expected = source_state(conn, table)
        problems += diff(table, expected, delta_rows(uris[qualified], primary_key(conn, table)))
    assert not problems, f"{len(problems)} differences:\n" + "\n".join(problems[:30])


# the warehouse as files ------------------------------------------------------------------

def log_commits(table_dir: Path) -> list[list[dict[str, Any]]]:
    """The actions of each commit of a table's log, from version 0."""
    commits = []
    for path in sorted((table_dir / "_delta_log").glob("*.json")):
        commits.append([json.loads(line) for line in path.read_text().splitlines() if line.strip()])
    return commits


def referenced_files(table_dir: Path) -> set[str]:
    """Every file any version of the table names: data files and deletion vector files."""
    names = set()
    for commit in log_commits(table_dir):
        for action in commit:
            for kind in ("add", "remove"):
                if kind in action:
                    names.add(action[kind]["path"])
                    vector = action[kind].get("deletionVector")
                    if vector:
                        names.add(deletion_vectors.descriptor_file(vector))
    return names


def table_files(table_dir: Path) -> set[str]:
    """The files of a table outside its log (with dot files: a temporary file left is one too)."""
    return {p.relative_to(table_dir).as_posix() for p in table_dir.rglob("*")
            if p.is_file() and "_delta_log" not in p.relative_to(table_dir).parts}


def txn_commits(table_dir: Path, app: str) -> list[int]:
    """The tick of each commit of the table carrying a transaction id of consumer `app`."""
    return [a["txn"]["version"] for commit in log_commits(table_dir) for a in commit
            if "txn" in a and a["txn"]["appId"] == app]


def the_position(path: Path) -> tuple[str, int]:
    [(app, tick)] = WarehouseState(LocalStorage(path)).positions().items()
    return app, tick


def consume(dsn: str, target: DeltaTarget, **options: Any) -> int:
    consumer = Consumer(dsn, "q", target, name="c", **options)
    try:
        return consumer.run(until_caught_up=True)
    finally:
        consumer.close()


def consume_cli(dsn: str, path: Path, option: str = "", **env: str) -> Any:
    """The consumer run to now (option: the target's, `?tables=portable`)."""
    return run_cli(dsn, "consume", "q", "--target", f"delta:{path}{option}", "--until-caught-up", timeout=180, **env)


def consume_to_now(dsn: str, path: Path | str, option: str = "") -> None:
    """consume_cli's run in this process, where the console script is not what a test is about."""
    done = run_cli_in_process(dsn, "consume", "q", "--target", f"delta:{path}{option}", "--until-caught-up")
    assert done.returncode == 0, done.stderr


# 1. the randomized oracle ------------------------------------------------------------------

SCHEMA = """
    CREATE SCHEMA s;
    CREATE TABLE ti (id int PRIMARY KEY, v text, n numeric(12,2), f float8, r real, flag boolean, ts timestamptz,
                     tsn timestamp, d date, blob bytea, doc jsonb, tags text[], big numeric, cnt int NOT NULL DEFAULT 0);
    CREATE TABLE tt (k text PRIMARY KEY, v text, cnt bigint NOT NULL DEFAULT 0);
    CREATE TABLE s.tc (a int, b text, qty bigint, note text, PRIMARY KEY (a, b));
    INSERT INTO ti (id, v, n, f, r, flag, ts, tsn, d, doc, tags, big)
        SELECT g, 'seed ' || g, g * 1.25, g / 3.0, g / 4.0, g % 2 = 0, '2024-01-01 00:00+02'::timestamptz + g * interval
               '1 hour', '2024-01-01'::timestamp + g * interval '1 minute', '2024-01-01'::date + g,
               jsonb_build_object('g', g), ARRAY['a' || g, NULL], g * 1000000000000.000001
        FROM generate_series(1, 120) g;
    INSERT INTO tt SELECT 'k' || g, 'seed', 0 FROM generate_series(1, 60) g;
    INSERT INTO s.tc SELECT g % 15, 'b' || (g / 15), g, 'seed' FROM generate_series(1, 60) g;
"""
TABLES = ["ti", "tt", "s.tc"]
DDL = {
    "truncate": ["TRUNCATE tt", "INSERT INTO tt VALUES ('after truncate', 'x', 1)"],
    "add column": ["ALTER TABLE ti ADD COLUMN extra text", "UPDATE ti SET extra = 'e' || id WHERE id % 5 = 0"],
    "drop column": ["ALTER TABLE ti DROP COLUMN blob"],
    "rename column": ["ALTER TABLE s.tc RENAME COLUMN note TO memo"],
    "type change": ["ALTER TABLE tt ALTER COLUMN cnt TYPE numeric(20,0)"],   # rewrites: the table is copied again
}
TEXTS = ["", "plain", "tab\there", "new\nline", "quote'\"", "\u00fcn\u00efc\u00f8d\u00e9 \u2713", None]


def _timestamptz(rng: random.Random) -> datetime | None:
    if rng.random() < 0.1:
        return None
    tz = timezone(timedelta(minutes=rng.choice([-570, 0, 60, 330])))
    return datetime(rng.randint(1970, 2040), rng.randint(1, 12), rng.randint(1, 28), rng.randint(0, 23),
                    rng.randint(0, 59), rng.randint(0, 59), rng.choice([0, rng.randint(0, 999999)]), tzinfo=tz)


def _statement(rng: random.Random) -> tuple[str, Any]:
    i = rng.randint(1, 200)
    kind = rng.choices(["ti upsert", "ti update", "ti blob", "ti delete", "ti key", "ti many", "tt upsert",
                        "tt update", "tt delete", "tt key", "tc insert", "tc update", "tc delete", "tc key"],
                       weights=[8, 8, 2, 3, 2, 1, 5, 5, 2, 2, 5, 4, 2, 2])[0]
    if kind == "ti upsert":
        ts = _timestamptz(rng)
        return ("INSERT INTO ti (id, v, n, f, r, flag, ts, tsn, d, doc, tags, big) VALUES (%s, %s, %s, %s, %s, %s, %s,"
                " %s, %s, %s, %s, %s) ON CONFLICT (id) DO UPDATE SET v = excluded.v, n = excluded.n, f = excluded.f,"
                " r = excluded.r, ts = excluded.ts, cnt = ti.cnt + 1",
                (i, rng.choice(TEXTS), Decimal(rng.randint(-10**11, 10**11)) / 100,
                 rng.choice([None, math.nan, math.inf, -math.inf, 0.0, rng.uniform(-1e6, 1e6), 1e-300]),
                 rng.choice([None, math.nan, 0.1, -3.25, 1e30]), rng.choice([True, False, None]), ts,
                 None if ts is None else ts.replace(tzinfo=None),
                 rng.choice([None, date(rng.randint(1, 9999), rng.randint(1, 12), rng.randint(1, 28))]),
                 rng.choice([None, json.dumps({"n": rng.randint(-99, 99), "s": rng.choice(TEXTS[:-1]),
                                               "x": [1.5, None, True]})]),
                 rng.choice([None, [], [rng.choice(TEXTS), "b"]]),
                 rng.choice([None, Decimal("NaN"), Decimal(rng.randint(-10**30, 10**30)).scaleb(-rng.randint(0, 40))])))
    if kind == "ti update":
        return "UPDATE ti SET cnt = cnt + 1, v = %s, flag = %s WHERE id = %s", (rng.choice(TEXTS),
                                                                                rng.choice([True, None]), i)
    if kind == "ti blob":
        return "UPDATE ti SET blob = %s WHERE id = %s", (rng.randbytes(rng.randint(0, 9)), i)
    if kind == "ti delete":
        return "DELETE FROM ti WHERE id BETWEEN %s AND %s", (i, i + rng.randint(0, 3))
    if kind == "ti key":
        return "UPDATE ti SET id = %s WHERE id = %s", (rng.randint(1, 200), i)
    if kind == "ti many":
        return "UPDATE ti SET cnt = cnt + 1 WHERE id %% 7 = %s", (rng.randint(0, 6),)
    k = f"k{rng.randint(1, 80)}"
    if kind == "tt upsert":
        return ("INSERT INTO tt VALUES (%s, %s, 0) ON CONFLICT (k) DO UPDATE SET v = excluded.v, cnt = tt.cnt + 1",
                (k, rng.choice(TEXTS)))
    if kind == "tt update":
        return "UPDATE tt SET cnt = cnt + 1 WHERE k = %s", (k,)
    if kind == "tt delete":
        return "DELETE FROM tt WHERE k = %s", (k,)
    if kind == "tt key":
        return "UPDATE tt SET k = k || '+' WHERE k = %s AND length(k) < 8", (k,)
    a, b = rng.randint(0, 20), rng.choice(["b0", "b1", "b2", "b3", "tab\tb", "b\u00e9"])
    if kind == "tc insert":
        return ("INSERT INTO s.tc VALUES (%s, %s, %s, %s) ON CONFLICT (a, b) DO UPDATE SET qty = s.tc.qty + 1",
                (a, b, rng.randint(-2**62, 2**62), rng.choice(TEXTS)))
    if kind == "tc update":
        return "UPDATE s.tc SET qty = qty + 1 WHERE a = %s", (a,)
    if kind == "tc delete":
        return "DELETE FROM s.tc WHERE a = %s AND b = %s", (a, b)
    return "UPDATE s.tc SET b = b || '+' WHERE a = %s AND length(b) < 6", (a,)


class Writer(threading.Thread):
    """Seeded transactions of 1-4 statements; a statement a schema change made invalid,
    or that collides with a key, is skipped (a savepoint); a deadlock aborts its transaction.
    Now and then it waits for the next tick (the changes spread over batches), or holds a
    transaction open across two ticks."""

    def __init__(self, dsn: str, seed: int, transactions: int) -> None:
        super().__init__(name=f"writer-{seed}")
        self.dsn, self.rng, self.transactions = dsn, random.Random(seed), transactions
        self.started = threading.Event()
        self.committed = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn, \
                    psycopg.connect(self.dsn, autocommit=True) as ticks:
                conn.execute("SET lock_timeout = '5s'")
                for _ in range(self.transactions):
                    self._transaction(conn, ticks)
                    self.started.set()
                    if self.rng.random() < 0.3:
                        self._ticks_pass(ticks, 1)
        except BaseException as exc:   # reported by the test
            self.error = exc
        finally:
            self.started.set()

    def _transaction(self, conn: psycopg.Connection, ticks: psycopg.Connection) -> None:
        statements = [_statement(self.rng) for _ in range(self.rng.randint(1, 4))]
        spans_ticks = self.rng.random() < 0.1
        with contextlib.suppress(psycopg.errors.DeadlockDetected, psycopg.errors.LockNotAvailable):
            with conn.transaction():
                for n, (sql, params) in enumerate(statements):
                    if spans_ticks and n == len(statements) // 2:
                        self._ticks_pass(ticks, 2)
                    with contextlib.suppress(psycopg.errors.UniqueViolation,
                                             psycopg.errors.UndefinedColumn), conn.transaction():
                        conn.execute(sql, params)
            self.committed += 1

    @staticmethod
    def _ticks_pass(ticks: psycopg.Connection, count: int) -> None:
        def latest() -> int:
            return ticks.execute("SELECT coalesce(max(tick_id), 0) FROM replicator.tick").fetchone()[0]
        start = latest()
        wait_until(lambda: latest() >= start + count, 30, f"{count} ticks")


@settings(max_examples=4, deadline=None, phases=[Phase.generate], database=None,
          suppress_health_check=list(HealthCheck))
@given(seeds=st.lists(st.integers(0, 2**32 - 1), min_size=2, max_size=2, unique=True),
       ddl_order=st.permutations(sorted(DDL)), kills=st.lists(st.booleans(), min_size=5, max_size=5))
def test_delta_tables_equal_the_source_after_concurrent_writes_and_schema_changes(pg_server, tmp_path_factory,
                                                                                   seeds, ddl_order, kills):
    with fresh_database(pg_server, "delta") as dsn:
        _randomized_example(dsn, tmp_path_factory.mktemp("delta"), seeds, ddl_order, kills)


def _randomized_example(dsn: str, tmp: Path, seeds: list[int], ddl_order: list[str], kills: list[bool]) -> None:
    path = tmp / "wh"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)
        conn.execute("SELECT replicator.create_queue('q')")
        for table in TABLES:
            conn.execute("SELECT replicator.add_table('q', %s)", (table,))
        set_fast_ticks(conn, max_lag="50 ms", idle="300 ms", max_count=50)
        ticker = Daemon(dsn, "ticker", "--interval", "0.1", log=tmp / "ticker.log")
        logs: list[Path] = []

        def start_consumer() -> Daemon:
            logs.append(tmp / f"consume-{len(logs)}.log")
            return Daemon(dsn, "consume", "q", "--target", f"delta:{path}", "--poll-interval", "0.05", log=logs[-1])

        consumer = start_consumer()
        try:
            wait_until(lambda: len(_tables(path)) == 3, 60, "the copy", check=lambda: _alive(consumer))
            uri = table_uris(str(path))["public.tt"]
            tt_id = DeltaTable(uri).metadata().id
            for phase, name in enumerate(ddl_order):
                writers = [Writer(dsn, seed + phase, 25) for seed in seeds]
                for w in writers:
                    w.start()
                for w in writers:   # the schema change amid the writes
                    w.started.wait(60)
                execute_retrying_deadlocks(conn, DDL[name])
                if kills[phase]:   # whatever it is doing: a batch of the schema change is applied again
                    consumer.kill9()
                    consumer = start_consumer()
                for w in writers:
                    w.join(120)
                    assert not w.is_alive() and w.error is None, w.error
                    assert w.committed > 0
                # the daemon applies the phase (a batch or more) before the next one starts
                tick = forced_tick(conn)
                wait_until(lambda: _position(path) >= tick, 60, f"tick {tick} applied", check=lambda: _alive(consumer))
            _alive(consumer)
            assert consumer.terminate() == 0, consumer.log()
        finally:
            consumer.stop()
            ticker.stop()
        consume_to_now(dsn, path)
        assert_equal_to_source(conn, path, TABLES)
        # the type change copied tt again: a new version of the same Delta table, in the same directory
        assert table_uris(str(path))["public.tt"] == uri
        table = DeltaTable(uri)
        assert table.metadata().id == tt_id
        assert [f.type.type for f in table.schema().fields if f.name == "cnt"] == ["decimal(20,0)"]
        all_logs = "".join(p.read_text() for p in logs)
        assert "Traceback" not in all_logs and "error" not in all_logs, all_logs[-3000:]
        # the daemon applied the run in many batches (one commit of a table per batch that changed it)
        versions = {name: DeltaTable(uri).version() for name, uri in table_uris(str(path)).items()}
        assert all(version >= 5 for version in versions.values()), versions
        print(json.dumps({"seeds": seeds, "ddl": ddl_order, "kills": kills, "versions": versions,
                          "rows": {t: len(source_state(conn, t)[1]) for t in TABLES}}))


def _tables(path: Path) -> dict[str, str]:
    """table_uris(), empty while the warehouse is not one yet."""
    with contextlib.suppress(UserError):
        return table_uris(str(path))
    return {}


def _position(path: Path) -> int:
    positions = WarehouseState(LocalStorage(path)).positions()
    return max(positions.values(), default=0)


def _alive(daemon: Daemon) -> None:
    assert daemon.alive(), daemon.log()[-3000:]


# 2-3. kill -9 at every commit step, and a retried batch skipped per table ----------------------

CRASH_DDL = """
    CREATE TABLE t (id int PRIMARY KEY, v text, cnt int NOT NULL DEFAULT 0);
    CREATE TABLE u (k text PRIMARY KEY, cnt int NOT NULL DEFAULT 0);
    INSERT INTO t SELECT g, 'v' || g, 0 FROM generate_series(1, 300) g;
    INSERT INTO u SELECT 'k' || g, 0 FROM generate_series(1, 50) g;
"""


def _one_batch_of_changes(conn: psycopg.Connection, round_: int) -> None:
    """Changes to both tables, in one transaction: one batch that commits t and u."""
    with conn.transaction():
        conn.execute("UPDATE t SET cnt = cnt + 1, v = v || '!' WHERE id %% 3 = %s", (round_ % 3,))
        conn.execute("DELETE FROM t WHERE id = %s", (10 + round_,))
        conn.execute("INSERT INTO t VALUES (%s, 'new', 0)", (1000 + round_,))
        conn.execute("UPDATE t SET id = id + 2000 WHERE id = %s", (20 + round_,))
        conn.execute("UPDATE u SET cnt = cnt + 1")
        conn.execute("UPDATE u SET k = k || '+' WHERE k = %s", (f"k{round_ + 1}",))
        if round_ == 1:   # schema changes in the batch: applied again over a table that has them
            conn.execute("ALTER TABLE u ADD COLUMN extra int")
            conn.execute("UPDATE u SET extra = cnt * 10 WHERE k < 'k3'")
            conn.execute("ALTER TABLE t RENAME COLUMN v TO w")


@pytest.mark.parametrize(("point", "option"), [("delta-table-committed", ""), ("delta-table-committed@2", ""),
                                               ("delta-committed", ""), ("delta-table-committed", "?tables=portable")])
def test_kill_9_at_each_commit_step_then_a_restart_applies_each_change_once(dsn, conn, source, tmp_path, point,
                                                                           option):
    conn.execute(CRASH_DDL)
    source.create_queue("q")
    source.add_table("q", "t")
    source.add_table("q", "u")
    path = tmp_path / "wh"
    consume_to_now(dsn, path, option)
    uris = table_uris(str(path))
    app, _ = the_position(path)
    for round_ in range(2):
        _one_batch_of_changes(conn, round_)
        tick = forced_tick(conn)
        before = {name: DeltaTable(uri).version() for name, uri in uris.items()}
        crashed = consume_cli(dsn, path, option, REPLICATOR_CRASH_AT=point)
        assert crashed.returncode == -9, crashed.stderr
        after = {name: DeltaTable(uri).version() for name, uri in uris.items()}
        held = {name: DeltaTable(uri).transaction_version(app) or 0 for name, uri in uris.items()}
        holding = {name for name, applied in held.items() if applied >= tick}
        # what the kill left: the tables committed before it (with the batch's tick: the
        # consumer's own forced tick, at or past ours), the position before the batch unless
        # the kill came after _replicator's commit
        expected_holding = {"delta-table-committed": 1, "delta-table-committed@2": 2, "delta-committed": 2}[point]
        assert len(holding) == expected_holding, (held, after)
        batch_tick = max(held.values())
        assert {name for name in uris if after[name] > before[name]} == holding
        assert (the_position(path)[1] >= batch_tick) == (point == "delta-committed")
        # the batch again (no tick since: the same batch), then to now
        again = run_cli(dsn, "consume", "q", "--target", f"delta:{path}{option}", "--once")
        assert again.returncode == 0, again.stderr
        assert the_position(path)[1] == batch_tick
        for name, uri in uris.items():
            # a table that held the batch skipped it; the others took it: each its commit once
            assert txn_commits(Path(uri), app).count(batch_tick) == 1, (name, batch_tick, txn_commits(Path(uri), app))
            if name in holding:
                # nothing committed for it since, but an OPTIMIZE of the idle consumer (no row changed)
                since = [c[0]["commitInfo"]["operation"] for c in log_commits(Path(uri))][after[name] + 1:]
                assert set(since) <= {"OPTIMIZE"}, (name, since)
        assert_equal_to_source(conn, path, ["t", "u"])
        consume_to_now(dsn, path, option)
        assert_equal_to_source(conn, path, ["t", "u"])
        assert conn.execute("SELECT sum(cnt) FROM u").fetchone()[0] == 50 * (round_ + 1)
    # a portable warehouse's tables: copy-on-write (no deletion vector), no column mapping
    assert {bool(option)} == {"columnMapping" not in (DeltaTable(uri).protocol().reader_features or [])
                              for uri in uris.values()}
    assert (not option) == any(any(Path(uri).glob("deletion_vector_*.bin")) for uri in uris.values())


def test_kill_9_during_an_initial_copy_then_a_restart_copies_the_table_once(dsn, conn, source, tmp_path):
    conn.execute("CREATE TABLE big (id int PRIMARY KEY, v text, n numeric(10,2))")
    conn.execute("INSERT INTO big SELECT g, md5(g::text), g / 100.0 FROM generate_series(1, 400000) g")
    source.create_queue("q")
    source.add_table("q", "big")
    path = tmp_path / "wh"
    table_dir = path / "public.big"
    daemon = Daemon(dsn, "consume", "q", "--target", f"delta:{path}", log=tmp_path / "consume.log")
    try:
        # a data file of the copy is being written (the first row group is out)
        wait_until(lambda: table_dir.exists() and any(p.suffix == ".tmp" for p in table_dir.iterdir()), 120,
                   "the copy's first data file", check=lambda: _alive(daemon))
        daemon.kill9()
    finally:
        daemon.stop()
    assert not (table_dir / "_delta_log").exists(), "the kill came after the copy's commit: make the table larger"
    conn.execute("UPDATE big SET v = 'changed' WHERE id % 1000 = 0")
    done = consume_cli(dsn, path)
    assert done.returncode == 0, done.stderr
    assert_equal_to_source(conn, path, ["big"])
    assert [c[0]["commitInfo"]["operation"] for c in log_commits(table_dir)][:1] == ["CREATE OR REPLACE TABLE"]


# 4. every table as of one tick ------------------------------------------------------------------

def test_each_table_read_at_the_version_a_tick_left_equals_the_source_at_that_tick(dsn, conn, source, tmp_path):
    conn.execute(CRASH_DDL)
    source.create_queue("q")
    source.add_table("q", "t")
    source.add_table("q", "u")
    path = tmp_path / "wh"
    steps = [
        [],                                                                   # the copy
        ["UPDATE t SET cnt = cnt + 1 WHERE id <= 100", "DELETE FROM t WHERE id = 5"],      # t only
        ["DELETE FROM u WHERE k = 'k7'", "UPDATE u SET cnt = 3 WHERE k = 'k8'"],           # u only
        ["BEGIN", "UPDATE t SET v = 'both' WHERE id = 7", "UPDATE u SET cnt = 4", "COMMIT"],  # both, one batch
        ["ALTER TABLE t ADD COLUMN extra text", "UPDATE t SET extra = 'x' WHERE id < 20"],  # a new schema
        ["TRUNCATE u", "INSERT INTO u VALUES ('only', 1)"],
        ["ALTER TABLE u ALTER COLUMN cnt TYPE bigint", "UPDATE u SET cnt = 2"],           # copied again
    ]
    states: list[tuple[int, dict[str, Any]]] = []   # (tick, {table: source state})
    target = DeltaTarget(str(path))
    try:
        for statements in steps:
            for statement in statements:
                conn.execute(statement)
            consume(dsn, target)   # tick (the consumer forces one), apply up to it
            [tick] = target.positions("q").values()
            states.append((tick, {name: source_state(conn, name) for name in ("t", "u")}))
    finally:
        target.close()
    recorded: dict[int, dict[str, int]] = {}
    for tick, state in states:
        versions = versions_as_of(str(path), tick)
        assert sorted(versions) == ["public.t", "public.u"], (tick, versions)
        recorded[tick] = {name: version for name, (_, version) in versions.items()}
        problems = []
        for name in ("t", "u"):
            uri, version = versions[f"public.{name}"]
            problems += diff(f"{name}@{tick}", state[name], delta_rows(uri, [state[name][0][0]], version))
        assert not problems, "\n".join(problems[:20])
    # a table a batch did not change stays at its version; the batch of both moved both
    ticks = [tick for tick, _ in states]
    assert recorded[ticks[1]]["public.u"] == recorded[ticks[0]]["public.u"]
    assert recorded[ticks[2]]["public.t"] == recorded[ticks[1]]["public.t"]
    assert all(recorded[ticks[3]][n] > recorded[ticks[2]][n] for n in ("public.t", "public.u"))
    rows = pa.table(DeltaTable(str(path / "_replicator")).scan().read_all()).to_pylist()
    assert sorted(r["table"] for r in rows if r["tick"] == ticks[3]) == ["public.t", "public.u"]


# 5. a transaction larger than the keys a table stages ------------------------------------------

def test_a_batch_past_spill_keys_is_one_commit_per_table_and_stays_exact(dsn, conn, source, tmp_path, monkeypatch):
    import replicator.targets.delta.maintenance as maintenance
    import replicator.targets.delta.table as delta_table

    monkeypatch.setattr(delta_table, "SPILL_KEYS", 100)
    monkeypatch.setattr(maintenance, "due", lambda table: False)   # the batch's own commits only: no OPTIMIZE after
    conn.execute(CRASH_DDL)
    conn.execute("INSERT INTO t SELECT g, 'v' || g, 0 FROM generate_series(301, 1500) g")
    source.create_queue("q")
    source.add_table("q", "t")
    source.add_table("q", "u")
    path = tmp_path / "wh"
    target = DeltaTarget(str(path))
    try:
        consume(dsn, target)
        uris = table_uris(str(path))
        before = {name: DeltaTable(uri).version() for name, uri in uris.items()}
        with conn.transaction():
            for _ in range(3):   # each key again after its row was written out (spilled) already
                conn.execute("UPDATE t SET cnt = cnt + 1, v = v || '.'")
            conn.execute("DELETE FROM t WHERE id % 5 = 0")
            conn.execute("UPDATE t SET id = id + 10000 WHERE id % 7 = 0")
            conn.execute("INSERT INTO t SELECT g, 'ins', 0 FROM generate_series(20001, 20300) g")
            conn.execute("UPDATE t SET cnt = cnt + 1 WHERE id % 3 = 0")
            conn.execute("UPDATE u SET cnt = cnt + 1")
        consume(dsn, target)
    finally:
        target.close()
    assert_equal_to_source(conn, path, ["t", "u"])
    after = {name: DeltaTable(uri).version() for name, uri in uris.items()}
    assert after == {name: version + 1 for name, version in before.items()}, (before, after)
    [commit] = log_commits(Path(uris["public.t"]))[-1:]
    new_files = [a["add"] for a in commit if "add" in a and a["add"]["path"] not in
                 {f["remove"]["path"] for f in commit if "remove" in f}]
    assert len(new_files) > 10, "the batch was not written out in parts"
    assert any(add.get("deletionVector") for add in new_files), "no part holds rows a later part replaced"
    assert conn.execute("SELECT sum(cnt) FROM t").fetchone()[0] > 3000


# 6. safety ------------------------------------------------------------------------------------

def _tree(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_directory_that_is_not_a_warehouse_is_refused_in_one_line_and_left_as_it_was(dsn, conn, source, tmp_path):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
    source.create_queue("q")
    source.add_table("q", "t")
    path = tmp_path / "mine"
    (path / "public.t").mkdir(parents=True)
    (path / "public.t" / "data.csv").write_text("1\n")
    (path / "notes.txt").write_text("the user's")
    before = _tree(path)
    refused = consume_cli(dsn, path)
    assert refused.returncode == 1, refused.stderr
    assert refused.stderr.startswith("error: ") and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "is not a replicator Delta warehouse" in refused.stderr and "notes.txt" in refused.stderr, refused.stderr
    assert _tree(path) == before
    assert sorted(p.name for p in path.iterdir()) == ["notes.txt", "public.t"]


def test_a_second_consumer_of_a_local_warehouse_is_refused(dsn, conn, source, tmp_path):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
    source.create_queue("q")
    source.add_table("q", "t")
    path = tmp_path / "wh"
    daemon = Daemon(dsn, "consume", "q", "--target", f"delta:{path}", "--poll-interval", "0.05",
                    log=tmp_path / "consume.log")
    try:
        wait_until(lambda: _position(path) > 0 if (path / "_replicator").exists() else False, 60,
                   "the first consumer to start", check=lambda: _alive(daemon))
        for consumer in ([], ["--consumer", "other"]):
            second = run_cli(dsn, "consume", "q", "--target", f"delta:{path}", "--until-caught-up", *consumer)
            assert second.returncode == 1, second.stderr
            assert second.stderr.strip() == f"error: another consumer is writing the Delta warehouse {path}", \
                second.stderr
        conn.execute("INSERT INTO t VALUES (1)")
        tick = forced_tick(conn)
        wait_until(lambda: _position(path) >= tick, 60, "the first consumer to go on", check=lambda: _alive(daemon))
    finally:
        daemon.stop()
    assert_equal_to_source(conn, path, ["t"])


class LosingDelta(LosesTheSourceOnce, DeltaTarget):
    """A Delta target whose batch is rolled back once at its end (the source lost)."""


def test_a_rolled_back_batch_leaves_no_file_behind(dsn, conn, source, tmp_path, monkeypatch):
    import replicator.targets.delta.table as delta_table

    monkeypatch.setattr(delta_table, "SPILL_KEYS", 50)   # files written before the rollback
    conn.execute(CRASH_DDL)
    source.create_queue("q")
    source.add_table("q", "t")
    source.add_table("q", "u")
    path = tmp_path / "wh"
    apply_losing_the_source_once(dsn, conn, LosingDelta(str(path)), [
        "UPDATE t SET cnt = cnt + 1", "DELETE FROM u WHERE k < 'k3'", "INSERT INTO u VALUES ('new', 1)",
        "ALTER TABLE u ALTER COLUMN cnt TYPE bigint",   # u copied again in the batch
        "UPDATE u SET cnt = cnt + 1"])
    assert_equal_to_source(conn, path, ["t", "u"])
    for name, uri in table_uris(str(path)).items():
        assert table_files(Path(uri)) == referenced_files(Path(uri)), name
    assert conn.execute("SELECT sum(cnt) FROM t").fetchone()[0] == 300


# 7. another writer of a table between two batches ------------------------------------------------

def _commit_by_hand(table_dir: Path, actions: list[dict[str, Any]]) -> None:
    """The table's next version, as another Delta writer would write it."""
    version = DeltaTable(str(table_dir)).version() + 1
    info = {"commitInfo": {"timestamp": 0, "operation": "SET TBLPROPERTIES", "operationParameters": {},
                           "engineInfo": "another writer"}}
    with open(table_dir / "_delta_log" / f"{version:020d}.json", "x") as f:
        f.write("".join(json.dumps(a) + "\n" for a in [info, *actions]))


@pytest.mark.parametrize("writer", ["an empty commit", "delta-rs delete", "delta-rs update"])
def test_another_writer_between_two_batches_is_taken_in_and_the_table_stays_exact(dsn, conn, source, tmp_path,
                                                                                  writer):
    conn.execute(CRASH_DDL)
    source.create_queue("q")
    source.add_table("q", "t")
    source.add_table("q", "u")
    path = tmp_path / "wh"
    target = DeltaTarget(str(path))
    try:
        consume(dsn, target)
        conn.execute("UPDATE t SET cnt = cnt + 1 WHERE id % 2 = 0")   # deletion vectors in the copy's file
        consume(dsn, target)
        uri = table_uris(str(path))["public.t"]
        version = DeltaTable(uri).version()
        if writer == "an empty commit":
            _commit_by_hand(Path(uri), [])
        elif writer == "delta-rs delete":   # rewrites the file holding the row, without it
            assert DeltaTable(uri).delete("id = 9")["num_deleted_rows"] == 1
            conn.execute("DELETE FROM t WHERE id = 9")
        else:
            assert DeltaTable(uri).update(updates={"v": "'by delta-rs'"}, predicate="id = 8")["num_updated_rows"] == 1
            conn.execute("UPDATE t SET v = 'by delta-rs' WHERE id = 8")
        assert DeltaTable(uri).version() == version + 1
        # the next batch changes rows of the file the other writer removed or rewrote
        conn.execute("UPDATE t SET cnt = cnt + 1 WHERE id % 3 = 0")
        conn.execute("DELETE FROM t WHERE id BETWEEN 40 AND 45")
        conn.execute("UPDATE t SET id = id + 1000 WHERE id BETWEEN 50 AND 52")
        conn.execute("UPDATE u SET cnt = cnt + 1")
        consume(dsn, target)
        operations = [c[0]["commitInfo"].get("operation") for c in log_commits(Path(uri))]
        # the batch's one commit after the other writer's (then, maybe, the consumer's OPTIMIZE)
        assert operations[version + 2] == "MERGE" and set(operations[version + 3:]) <= {"OPTIMIZE"}, operations
        assert_equal_to_source(conn, path, ["t", "u"])
        # the commit that lost its version to the other writer left none of its files
        assert table_files(Path(uri)) == referenced_files(Path(uri))
        conn.execute("UPDATE t SET cnt = cnt + 1")   # and the batches after it
        consume(dsn, target)
        assert_equal_to_source(conn, path, ["t", "u"])
    finally:
        target.close()
    assert conn.execute("SELECT count(*) FROM t WHERE cnt = 0").fetchone()[0] == 0


# copies in many files, and keys of other types ----------------------------------------------------

def test_a_copy_in_many_files_and_row_groups_then_changes_to_its_rows_in_the_same_batch(dsn, conn, source, tmp_path,
                                                                                     monkeypatch):
    import replicator.source.table_copy as table_copy
    import replicator.targets.delta.table as delta_table

    monkeypatch.setattr(table_copy, "COPY_CHUNK_ROWS", 300)
    monkeypatch.setattr(delta_table, "FILE_ROWS", 1000)
    monkeypatch.setattr(delta_table, "ROW_GROUP", 256)
    conn.execute("CREATE TABLE t (id bigint PRIMARY KEY, v text, cnt int NOT NULL)")
    conn.execute("INSERT INTO t SELECT g, 'v' || g, 0 FROM generate_series(1, 4500) g")
    conn.execute("CREATE TABLE k (id text, at timestamptz, amount numeric(10,2), d date, flag boolean, v int,"
                 " PRIMARY KEY (id, at, amount, d, flag))")
    conn.execute("INSERT INTO k SELECT 'k' || g, '2024-01-01 00:00+05'::timestamptz + g * interval '1 second',"
                 " g / 100.0, '2024-01-01'::date + g, g % 2 = 0, 0 FROM generate_series(1, 3000) g")
    source.create_queue("q")
    source.add_table("q", "t")
    source.add_table("q", "k")
    path = tmp_path / "wh"
    target = DeltaTarget(str(path))
    try:
        consume(dsn, target)
        uri = table_uris(str(path))["public.t"]
        files = [pq.ParquetFile(f) for f in DeltaTable(uri).file_uris()]
        assert len(files) == 4 and all(f.metadata.num_row_groups > 4 for f in files), [f.metadata for f in files]
        assert_equal_to_source(conn, path, ["t", "k"])
        with conn.transaction():   # copied again, and its rows changed, in one batch
            conn.execute("ALTER TABLE t ALTER COLUMN cnt TYPE bigint")
            conn.execute("UPDATE t SET cnt = cnt + 1 WHERE id % 3 = 0")
            conn.execute("DELETE FROM t WHERE id % 10 = 1")
        conn.execute("UPDATE k SET v = v + 1 WHERE v = 0 AND amount > 10")
        conn.execute("UPDATE k SET at = at + interval '1 hour', amount = amount + 0.01 WHERE flag")   # key changes
        conn.execute("DELETE FROM k WHERE d > '2031-01-01'")
        consume(dsn, target)
        conn.execute("UPDATE t SET cnt = cnt + 1 WHERE id % 4 = 0")   # rows of every copy file, every row group
        conn.execute("UPDATE k SET v = v + 1")
        consume(dsn, target)
    finally:
        target.close()
    assert_equal_to_source(conn, path, ["t", "k"])


def test_a_consumer_started_again_reads_the_logs_from_delta_rs_checkpoints(dsn, conn, source, tmp_path, monkeypatch):
    import replicator.targets.delta.log as delta_log

    monkeypatch.setattr(delta_log, "CHECKPOINT_EVERY", 3)
    conn.execute(CRASH_DDL)
    source.create_queue("q")
    source.add_table("q", "t")
    source.add_table("q", "u")
    path = tmp_path / "wh"
    for run in range(3):   # a new target each run: the logs read from their checkpoints
        target = DeltaTarget(str(path))
        try:
            for n in range(4):
                conn.execute("UPDATE t SET cnt = cnt + 1 WHERE id %% 4 = %s", (n,))
                conn.execute("DELETE FROM t WHERE id = %s", (100 * run + n + 1,))
                conn.execute("UPDATE u SET k = k || '+' WHERE k = %s", (f"k{run * 4 + n + 1}",))
                consume(dsn, target)
        finally:
            target.close()
        assert_equal_to_source(conn, path, ["t", "u"])
    for directory in ("public.t", "public.u", "_replicator"):
        assert (path / directory / "_delta_log" / "_last_checkpoint").exists(), directory
    assert conn.execute("SELECT sum(cnt) FROM t").fetchone()[0] > 0


def test_a_dropped_table_leaves_the_warehouse_and_one_created_again_takes_its_directory(dsn, conn, source, tmp_path):
    conn.execute(CRASH_DDL)
    source.create_queue("q")
    source.add_table("q", "t")
    source.add_table("q", "u")
    path = tmp_path / "wh"
    target = DeltaTarget(str(path))
    try:
        consume(dsn, target)
        [dropped_at] = target.positions("q").values()
        conn.execute("DROP TABLE u")
        consume(dsn, target)
        assert sorted(table_uris(str(path))) == ["public.t"]
        assert DeltaTable(str(path / "public.u")).count() == 0   # its log stays: time travel
        conn.execute("CREATE TABLE u (k text PRIMARY KEY, other int)")
        conn.execute("INSERT INTO u VALUES ('again', 1)")
        source.add_table("q", "u")
        consume(dsn, target)
        conn.execute("UPDATE u SET other = 2")
        consume(dsn, target)
    finally:
        target.close()
    assert table_uris(str(path))["public.u"] == str(path / "public.u")
    assert_equal_to_source(conn, path, ["t", "u"])
    uri, version = versions_as_of(str(path), dropped_at)["public.u"]
    assert len(delta_rows(uri, ["k"], version)[1]) == 50   # the table before the drop


@pytest.mark.parametrize(("ddl", "replicated"), [("DROP TABLE b", ["a"]), ("ALTER TABLE b RENAME TO b2", ["a", "b2"])])
def test_a_table_dropped_or_renamed_while_its_initial_copy_starts_is_replicated_as_the_source_ends(
        dsn, conn, source, tmp_path, ddl, replicated):
    """DDL that commits after the consumer listed the queue's tables, before its copy read the table
    (holding the lock the copy waits for): the warehouse holds the tables the source ends with."""
    path = tmp_path / "wh"
    copy_while_a_ddl_holds_the_table(dsn, conn, source, f"delta:{path}", ddl)
    for name in replicated[1:]:
        conn.execute(f"INSERT INTO {name} VALUES (3, 'after')")
    assert run_cli(dsn, "consume", "q", "--target", f"delta:{path}", "--until-caught-up").returncode == 0
    assert sorted(table_uris(str(path))) == [f"public.{name}" for name in replicated]
    assert_equal_to_source(conn, path, replicated)


@pytest.mark.parametrize("batch", ["a copy again", "a batch written out in parts"])
def test_another_writer_before_a_copy_or_a_spilled_batch(dsn, conn, source, tmp_path, monkeypatch, batch):
    import replicator.targets.delta.table as delta_table

    monkeypatch.setattr(delta_table, "SPILL_KEYS", 40)
    conn.execute(CRASH_DDL)
    source.create_queue("q")
    source.add_table("q", "t")
    source.add_table("q", "u")
    path = tmp_path / "wh"
    target = DeltaTarget(str(path))
    try:
        consume(dsn, target)
        uri = table_uris(str(path))["public.t"]
        assert DeltaTable(uri).delete("id = 9")["num_deleted_rows"] == 1
        conn.execute("DELETE FROM t WHERE id = 9")
        if batch == "a copy again":
            conn.execute("ALTER TABLE t ALTER COLUMN cnt TYPE bigint")
            conn.execute("UPDATE t SET cnt = 5 WHERE id < 20")
            consume(dsn, target)
        else:   # taken in only when it commits: the batch stops, and is applied again by the next run
            conn.execute("UPDATE t SET cnt = cnt + 1")
            with pytest.raises(UserError, match=r"public\.t was changed by another writer during a large batch") as e:
                consume(dsn, target)
            assert "\n" not in str(e.value)
    finally:
        target.close()
    if batch != "a copy again":
        target = DeltaTarget(str(path))
        try:
            consume(dsn, target)
        finally:
            target.close()
    assert_equal_to_source(conn, path, ["t", "u"])
    assert table_files(Path(uri)) == referenced_files(Path(uri))


def test_a_table_given_a_feature_replicator_does_not_write_stops_the_consumer_in_one_line(dsn, conn, source,
                                                                                         tmp_path):
    conn.execute(CRASH_DDL)
    source.create_queue("q")
    source.add_table("q", "t")
    path = tmp_path / "wh"
    assert consume_cli(dsn, path).returncode == 0
    uri = table_uris(str(path))["public.t"]
    snapshot = DeltaTable(uri)
    protocol = json.loads((Path(uri) / "_delta_log" / f"{0:020d}.json").read_text().splitlines()[1])["protocol"]
    protocol["writerFeatures"] = [*protocol["writerFeatures"], "changeDataFeed"]
    _commit_by_hand(Path(uri), [{"protocol": protocol}])   # as Spark's SET TBLPROPERTIES enableChangeDataFeed does
    version = snapshot.version() + 1
    conn.execute("UPDATE t SET cnt = cnt + 1")
    stopped = consume_cli(dsn, path)
    assert stopped.returncode == 1
    assert stopped.stderr.strip().splitlines()[-1] == (
        f"error: {path}/public.t has the Delta table feature changeDataFeed, which another writer enabled and "
        f"replicator does not write: remove it (Spark: ALTER TABLE delta.`{path}/public.t` DROP FEATURE "
        f"changeDataFeed)")
    assert DeltaTable(uri).version() == version   # nothing written over it


def test_a_commit_another_writer_malformed_stops_the_consumer_in_one_line_and_nothing_is_written_over_it(
        dsn, conn, source, tmp_path):
    conn.execute(CRASH_DDL)
    source.create_queue("q")
    source.add_table("q", "t")
    path = tmp_path / "wh"
    assert consume_cli(dsn, path).returncode == 0
    uri = table_uris(str(path))["public.t"]
    version = DeltaTable(uri).version() + 1
    _commit_by_hand(Path(uri), [{"txn": {"appId": "another/app", "version": "7"}}])
    conn.execute("UPDATE t SET cnt = cnt + 1")
    stopped = consume_cli(dsn, path)
    assert stopped.returncode == 1
    assert stopped.stderr.strip().splitlines()[-1] == (
        f"error: {path}/public.t/_delta_log/{version:020d}.json line 2 is not a Delta log entry replicator can "
        f"read: its txn.version is a string, not an integer; repair the table's log with the writer that made "
        f"it, or restore the file")
    assert sorted(p.name for p in (Path(uri) / "_delta_log").glob("*.json"))[-1] == f"{version:020d}.json"


def test_the_key_index_follows_the_rows_an_optimize_moves_and_later_changes_stay_exact(tmp_path):
    from replicator.structure import Column, TableStructure
    from replicator.targets.delta import maintenance
    from replicator.targets.delta.storage import LocalStorage
    from replicator.targets.delta.table import ReplicaTable

    structure = TableStructure("public", "t", (Column("id", "bigint", "bigint", "N", True, 1),
                                               Column("v", "text", "text", "S", False, 2)), ("id",))
    meta = {"source_name": "public.t", "table_id": 1, "mode": "full", "structure": structure.to_json(),
            "copy_snapshot": None}
    storage = LocalStorage(tmp_path)
    table = ReplicaTable(storage, "public.t")
    table.reset(meta, structure)
    table.copy([(i, f"v{i}") for i in range(5000)])
    table.commit(None, None)
    expected = {i: f"v{i}" for i in range(5000)}
    for tick in range(1, 6):   # small files and deletion vectors for OPTIMIZE to fold and purge
        for i in range(tick, 5000, 7):
            table.change((i,), False, (i, f"u{tick}-{i}"))
            expected[i] = f"u{tick}-{i}"
        for i in range(tick * 3, 5000, 97):
            table.change((i,), True, (i, None))
            expected.pop(i, None)
        table.commit("q/c", tick)
    index = table.index
    assert index is not None
    done = maintenance.optimize_table(table, everything=True)
    assert done is not None and done.committed and table.index is index   # moved, not thrown away
    for i in range(0, 5000, 5):   # changes located through the moved index
        table.change((i,), False, (i, f"after-{i}"))
        expected[i] = f"after-{i}"
    table.commit("q/c", 6)
    rows = pa.table(DeltaTable(str(tmp_path / "public.t")).scan().read_all()).to_pylist()
    assert len(rows) == len(expected)
    assert {r["id"]: r["v"] for r in rows} == expected


def test_a_copys_full_files_are_not_folded_again_and_folds_write_files_of_file_rows(tmp_path, monkeypatch):
    """A copy's files hold FILE_ROWS rows each; narrow rows make them smaller than SMALL_FILE_BYTES,
    and folding them as a batch's small files would rewrite the whole table at the first batch
    (seconds at 10M rows) into files twice as large (Spark reads a file per task)."""
    from replicator.structure import Column, TableStructure
    from replicator.targets.delta import maintenance
    from replicator.targets.delta import table as delta_table
    from replicator.targets.delta.table import ReplicaTable

    monkeypatch.setattr(delta_table, "FILE_ROWS", 1000)
    monkeypatch.setattr(delta_table, "ROW_GROUP", 250)
    monkeypatch.setattr(maintenance, "FILE_ROWS", 1000)
    structure = TableStructure("public", "t", (Column("id", "bigint", "bigint", "N", True, 1),
                                               Column("v", "text", "text", "S", False, 2)), ("id",))
    meta = {"source_name": "public.t", "table_id": 1, "mode": "full", "structure": structure.to_json(),
            "copy_snapshot": None}
    table = ReplicaTable(LocalStorage(tmp_path), "public.t")
    table.reset(meta, structure)
    for start in range(0, 9000, 250):   # as a copy's chunks come
        table.copy([(i, f"v{i}") for i in range(start, start + 250)])
    table.commit(None, None)
    copied = set(table.snapshot.files)
    assert len(copied) == 9 >= maintenance.SMALL_FILES_DUE
    for tick in range(1, maintenance.SMALL_FILES_DUE + 1):   # a small file per batch
        table.change((9000 + tick,), False, (9000 + tick, "new"))
        table.change((tick,), True, (tick, None))
        table.commit("q/c", tick)
        if tick < maintenance.SMALL_FILES_DUE:
            assert not maintenance.due(table)
    assert maintenance.due(table)
    done = maintenance.optimize_table(table)
    assert done is not None and done.committed
    assert done.files == maintenance.SMALL_FILES_DUE   # the batches' files, none of the copy's
    assert copied <= set(table.snapshot.files)
    done = maintenance.optimize_table(table, everything=True)   # every file with deletions: the copy's too
    assert done is not None and done.committed
    sizes = [json.loads(add["stats"])["numRecords"] for add in table.snapshot.files.values()]
    assert sum(sizes) == 9000 and max(sizes) <= 1000, sizes


def test_an_idle_consumer_purges_a_file_whose_deletion_vector_marks_a_single_row_once_its_table_is_quiet(
        tmp_path, monkeypatch):
    """Spark reads a file with a deletion vector about a third slower however few rows it marks
    (docs/benchmarks.md): while idle (a batch that changed no table) the consumer rewrites such a
    file, so that a table that stops changing is read as a purged one; not while the table still
    changes (a row at a time, each change would cost a file's rewrite)."""
    from replicator.structure import Column, TableStructure
    from replicator.targets.delta import log as delta_log
    from replicator.targets.delta import maintenance
    from replicator.targets.protocol import TargetTable

    structure = TableStructure("public", "t", (Column("id", "bigint", "bigint", "N", True, 1),
                                               Column("v", "text", "text", "S", False, 2)), ("id",))
    table = TargetTable(source_name="public.t", table_id=1, mode="full", copy_snapshot=None, structure=structure)
    target = DeltaTarget(str(tmp_path))
    try:
        target.begin()
        target.create_table(table)
        target.upsert(table, "R", [(i, f"v{i}") for i in range(1000)])
        target.set_position("q", "c", 1)
        target.commit()
        target.begin()
        target.delete(table, [(7,)])
        target.set_position("q", "c", 2)
        target.commit()
        vectors = [add["deletionVector"]["cardinality"] for add in delta_log.load(target.storage, "public.t").files.values()
                   if add.get("deletionVector")]
        assert vectors == [1]
        target.begin()   # idle, the table changed a moment ago
        target.set_position("q", "c", 3)
        target.commit()
        assert [add for add in delta_log.load(target.storage, "public.t").files.values()
                if add.get("deletionVector")], "purged before the table was quiet"
        monkeypatch.setattr(maintenance, "IDLE_PURGE_QUIET", 0.0)   # as if IDLE_PURGE_QUIET had passed
        target.begin()
        target.set_position("q", "c", 4)
        target.commit()
    finally:
        target.close()
    files = delta_log.load(target.storage, "public.t").files.values()
    assert not any(add.get("deletionVector") for add in files)
    assert sum(json.loads(add["stats"])["numRecords"] for add in files) == 999
    _, rows = delta_rows(str(tmp_path / "public.t"), ["id"])
    assert sorted(rows) == [(i,) for i in range(1000) if i != 7]
