"""The Spark mirror target: a warehouse directory kept equal to the source.

Real PostgreSQL, real consumer, real local Spark (one session for the run).
The oracle reads the source with SQL renderings chosen to match the Spark
types (numeric as text, timestamptz as UTC text), independently of
replicator.structure.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

pytest.importorskip("pyspark")

from consumer_helpers import REPLICATOR, Daemon, cli_env, run_cli, wait_until
from replicator.consumer import Consumer
from replicator.shutdown import StopFlag
from replicator.spark import compact, read_table, register_views
from replicator.targets.spark.target import SparkTarget
from replicator.targets.spark.warehouse import Warehouse

T_DDL = """
    CREATE TABLE t (id int PRIMARY KEY, v text, n numeric(12,2), f double precision, b boolean,
                    ts timestamptz, raw bytea, d date);
    CREATE SCHEMA s;
    CREATE TABLE s.u (k1 text, k2 int, payload jsonb, PRIMARY KEY (k1, k2));
"""


def source_rows(conn: psycopg.Connection, table: str) -> dict[tuple, dict[str, Any]]:
    """The source table as {key: row}, values rendered as the warehouse must hold them."""
    cols = conn.execute("SELECT attname, format_type(atttypid, NULL) FROM pg_attribute"
                        " WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
                        (table,)).fetchall()
    exprs = []
    for name, typ in cols:
        q = f'"{name}"'
        if typ == "timestamp with time zone":
            exprs.append(f"to_char({q} AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US')")
        elif typ in ("numeric", "jsonb", "json") or typ.endswith("[]") or typ == "date":
            exprs.append(f"{q}::text")
        else:
            exprs.append(q)
    key = [r[0] for r in conn.execute(
        "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid"
        " AND a.attnum = ANY(i.indkey) WHERE i.indrelid = %s::regclass AND i.indisprimary", (table,))]
    names = [c[0] for c in cols]
    out = {}
    for row in conn.execute(f"SELECT {', '.join(exprs)} FROM {table}"):
        record = dict(zip(names, [bytes(v) if isinstance(v, memoryview) else v for v in row]))
        out[tuple(record[k] for k in key)] = record
    return out


def warehouse_rows(spark, path: Path, table: str, key: list[str]) -> dict[tuple, dict[str, Any]]:
    from pyspark.sql import functions as F
    df = read_table(spark, path, table)
    cols = []
    for field in df.schema.fields:
        name = field.name
        if field.dataType.typeName() == "timestamp":
            cols.append(F.date_format(F.col(name), "yyyy-MM-dd HH:mm:ss.SSSSSS").alias(name))
        elif field.dataType.typeName() in ("date", "decimal"):   # as PostgreSQL prints them
            cols.append(F.col(name).cast("string").alias(name))
        else:
            cols.append(F.col(name))
    rows = [r.asDict() for r in df.select(*cols).collect()]
    out = {}
    for r in rows:
        r = {k: bytes(v) if isinstance(v, bytearray) else v for k, v in r.items()}
        out[tuple(r[k] for k in key)] = r
    assert len(out) == len(rows), f"duplicate keys in {table}"
    return out


def assert_same(conn, spark, path, table: str, view: str, key: list[str]) -> None:
    expected = source_rows(conn, table)
    actual = warehouse_rows(spark, path, view, key)
    for rows in (expected, actual):   # jsonb: compare as documents
        for r in rows.values():
            if "payload" in r and r["payload"] is not None:
                r["payload"] = json.loads(r["payload"])
    missing = expected.keys() - actual.keys()
    extra = actual.keys() - expected.keys()
    assert not missing and not extra, f"{table}: missing {sorted(missing)[:5]}, extra {sorted(extra)[:5]}"
    wrong = [(k, expected[k], actual[k]) for k in expected if expected[k] != actual[k]]
    assert not wrong, f"{table}: {len(wrong)} rows differ, e.g. {wrong[:3]}"


def consume(dsn: str, target: SparkTarget) -> int:
    consumer = Consumer(dsn, "q", target)
    try:
        return consumer.run(until_caught_up=True)
    finally:
        consumer.close()


# the randomized oracle ------------------------------------------------------------------

def _writer(dsn: str, seed: int, stop: threading.Event, errors: list[BaseException], rounds: int,
            started: threading.Event) -> None:
    rnd = random.Random(seed)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for _ in range(rounds):
                if stop.is_set():
                    return
                # random multi-row writes of concurrent writers deadlock now and then
                with contextlib.suppress(psycopg.errors.DeadlockDetected):
                    _transaction(conn, rnd)
                started.set()
    except BaseException as exc:   # reported by the test
        errors.append(exc)
    finally:
        started.set()   # whatever happened: the test must not wait for it


def _transaction(conn: psycopg.Connection, rnd: random.Random) -> None:
    with conn.transaction():
        for _ in range(rnd.randint(1, 4)):
            op = rnd.random()
            i = rnd.randint(1, 400)
            if op < 0.45:
                conn.execute(
                    "INSERT INTO t (id, v, n, f, b, ts, raw, d) VALUES (%s, %s, %s, %s, %s,"
                    " now() - %s * interval '1 minute', %s, current_date - %s) ON CONFLICT (id) DO UPDATE"
                    " SET v = excluded.v, n = excluded.n, f = excluded.f, b = excluded.b",
                    (i, f"v{rnd.randint(0, 10**6)}\t\u00e9", f"{rnd.randint(-10**6, 10**6)}.{rnd.randint(0, 99):02d}",
                     rnd.choice([rnd.random(), float("inf"), None]), rnd.choice([True, False, None]),
                     rnd.randint(0, 10**5), bytes(rnd.randrange(256) for _ in range(rnd.randint(0, 5))),
                     rnd.randint(0, 1000)))
            elif op < 0.6:
                conn.execute("DELETE FROM t WHERE id BETWEEN %s AND %s", (i, i + rnd.randint(0, 5)))
            elif op < 0.7:   # key change
                conn.execute("UPDATE t SET id = id + 1000 WHERE id = %s"
                             " AND NOT EXISTS (SELECT 1 FROM t WHERE id = %s + 1000)", (i, i))
            elif op < 0.8:
                conn.execute("UPDATE t SET v = v || 'x' WHERE id %% 7 = %s", (i % 7,))
            elif op < 0.93:
                conn.execute("INSERT INTO s.u VALUES (%s, %s, %s) ON CONFLICT (k1, k2) DO UPDATE"
                             " SET payload = excluded.payload",
                             (f"k{i % 13}", i % 17, json.dumps({"x": rnd.randint(0, 9), "y": [1, 2.5]})))
            else:
                conn.execute("DELETE FROM s.u WHERE k2 = %s", (i % 17,))


def test_randomized_oracle_concurrent_writes_truncate_and_schema_change(dsn, conn, source, tmp_path, spark,
                                                                        caplog):
    caplog.set_level(logging.INFO, logger="replicator")
    conn.execute(T_DDL)
    conn.execute("INSERT INTO t SELECT g, 'init' || g, g * 1.5, g / 3.0, g % 2 = 0, now(), '\\x00ff', current_date"
                 " FROM generate_series(1, 300) g")
    conn.execute("INSERT INTO s.u SELECT 'k' || g, g, '{\"a\": 1}' FROM generate_series(1, 20) g")
    source.create_queue("q")
    source.add_table("q", "public.t")
    source.add_table("q", "s.u")
    path = tmp_path / "wh"
    target = SparkTarget(path, spark=spark, compact_after_logs=6)
    try:
        consumer = Consumer(dsn, "q", target, poll_interval=0.05)
        stop_consumer = StopFlag()
        consumer_errors: list[BaseException] = []

        def run_consumer() -> None:
            try:
                consumer.run(stop=stop_consumer)
            except BaseException as exc:
                consumer_errors.append(exc)

        def ticker() -> None:
            with psycopg.connect(dsn, autocommit=True) as c:
                while not stop_ticker.is_set():
                    c.execute("SELECT replicator.ticker('q', true)")
                    time.sleep(0.05)

        stop_ticker = threading.Event()
        threads = [threading.Thread(target=run_consumer), threading.Thread(target=ticker)]
        for th in threads:
            th.start()
        try:
            for phase in range(3):
                stop = threading.Event()
                errors: list[BaseException] = []
                started = [threading.Event() for _ in range(2)]
                writers = [threading.Thread(target=_writer, args=(dsn, 100 * phase + w, stop, errors, 40, started[w]))
                           for w in range(2)]
                for w in writers:
                    w.start()
                for event in started:   # DDL amid the writes: once both wrote something
                    event.wait()
                if phase == 1:
                    conn.execute("TRUNCATE t")
                if phase == 2:
                    conn.execute("ALTER TABLE t ADD COLUMN extra int")     # in place: new column by attnum
                    conn.execute("UPDATE t SET extra = id * 2 WHERE id % 3 = 0")
                for w in writers:
                    w.join()
                if phase == 2:
                    conn.execute("ALTER TABLE s.u RENAME COLUMN payload TO body")
                    conn.execute("UPDATE s.u SET body = '[1]' WHERE k2 % 2 = 0")
                assert not errors, errors
                assert not consumer_errors, consumer_errors
        finally:
            stop_ticker.set()
            stop_consumer.set()
            for th in threads:
                th.join(60)
        assert not consumer_errors, consumer_errors
        consume(dsn, target)   # catch up to now
        # How many batches the run made depends on the machine: six more, one change of t
        # each, make six more log files of t, which the background compactor (due every 6)
        # must fold, whatever it did before.
        for _ in range(6):
            if target._compactor is not None:
                target._compactor.join()
            conn.execute("UPDATE t SET v = v || '.' WHERE id = (SELECT min(id) FROM t)")
            consume(dsn, target)
        if target._compactor is not None:
            target._compactor.join()
        assert target._compact_error is None, target._compact_error
        # the background compactor ran and committed a new base
        compactions = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compacted ")]
        assert any("not committed" not in m for m in compactions), compactions
        assert_same(conn, spark, path, "t", "t", ["id"])
        conn.execute("ALTER TABLE s.u RENAME COLUMN body TO payload")
        consume(dsn, target)
        assert_same(conn, spark, path, "s.u", "s__u", ["k1", "k2"])
        manifest = Warehouse(path).read()
        assert manifest["positions"], manifest
        # compaction folds the logs and changes nothing a reader sees
        compact(spark, path)
        assert all(not entry["logs"] for entry in Warehouse(path).read()["tables"].values())
        assert_same(conn, spark, path, "t", "t", ["id"])
        assert sorted(register_views(spark, path)) == ["s__u", "t"]
        assert (spark.sql("SELECT count(*) FROM t").collect()[0][0]
                == conn.execute("SELECT count(*) FROM t").fetchone()[0])
    finally:
        target.close()


# schema changes, types ------------------------------------------------------------------

def test_schema_changes_in_place_and_by_copy_keep_tables_readable(dsn, conn, source, tmp_path, spark):
    conn.execute("CREATE TABLE w (id int PRIMARY KEY, a text, b int, ts timestamp, d date, r real)")
    conn.execute("INSERT INTO w VALUES (1, 'one', 1, '2024-01-02 03:04:05.5', '2024-01-02', 1.5),"
                 " (2, 'two', 2, 'infinity', '0044-03-15 BC', 'NaN')")
    source.create_queue("q")
    source.add_table("q", "w")
    path = tmp_path / "wh"
    target = SparkTarget(path, spark=spark, compact_after_logs=0)
    consume(dsn, target)
    rows = {r["id"]: r for r in (x.asDict() for x in read_table(spark, path, "w").collect())}
    assert rows[1]["a"] == "one" and str(rows[1]["ts"]) == "2024-01-02 03:04:05.500000"
    assert str(rows[2]["ts"]) == "9999-12-31 23:59:59.999999" and rows[2]["d"] is None   # clamped / out of range
    assert rows[2]["r"] != rows[2]["r"]  # NaN
    # in place: rename, drop, add (no default): the files stay, the reader projects
    conn.execute("ALTER TABLE w RENAME COLUMN a TO a2")
    conn.execute("INSERT INTO w (id, a2, b) VALUES (3, 'three', 3)")
    conn.execute("ALTER TABLE w DROP COLUMN b")
    conn.execute("ALTER TABLE w ADD COLUMN c text")
    conn.execute("INSERT INTO w (id, a2, c) VALUES (4, 'four', 'cee')")
    generation = Warehouse(path).read()["tables"]["public.w"]["generation"]
    consume(dsn, target)
    entry = Warehouse(path).read()["tables"]["public.w"]
    assert entry["generation"] == generation, "in-place changes must not copy again"
    df = read_table(spark, path, "w")
    assert df.columns == ["id", "a2", "ts", "d", "r", "c"]
    got = {r["id"]: (r["a2"], r["c"]) for r in df.collect()}
    assert got == {1: ("one", None), 2: ("two", None), 3: ("three", None), 4: ("four", "cee")}
    # a column added with a default rewrites values: copied again, as a new generation
    conn.execute("ALTER TABLE w ADD COLUMN e int NOT NULL DEFAULT 7")
    conn.execute("UPDATE w SET e = 8 WHERE id = 4")
    consume(dsn, target)
    entry = Warehouse(path).read()["tables"]["public.w"]
    assert entry["generation"] != generation
    assert {r["id"]: r["e"] for r in read_table(spark, path, "w").collect()} == {1: 7, 2: 7, 3: 7, 4: 8}
    # DROP TABLE removes it from the warehouse
    conn.execute("DROP TABLE w")
    consume(dsn, target)
    assert "public.w" not in Warehouse(path).read()["tables"]
    target.close()


# crashes --------------------------------------------------------------------------------

@pytest.mark.parametrize("point", ["spark-log-written", "spark-manifest-written", "spark-committed"])
def test_kill_9_during_commit_keeps_one_state_and_next_run_applies_the_batch_once(dsn, conn, source, tmp_path, spark,
                                                                                   point):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    conn.execute("INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 500) g")
    source.create_queue("q")
    source.add_table("q", "t")
    path = tmp_path / "wh"
    url = f"spark:{path}"
    done = run_cli(dsn, "consume", "q", "--target", url, "--until-caught-up")
    assert done.returncode == 0, done.stderr
    before = Warehouse(path).read()
    state_before = {r["id"]: r["v"] for r in read_table(spark, path, "t").collect()}
    conn.execute("UPDATE t SET v = v || '!' WHERE id <= 100")
    conn.execute("DELETE FROM t WHERE id > 450")
    conn.execute("INSERT INTO t VALUES (1000, 'new')")
    # The consumer SIGKILLs itself at the named point of its commit (replicator.targets.spark.warehouse.crash_point).
    crashed = subprocess.run([str(REPLICATOR), "consume", "q", "--target", url, "--until-caught-up"],
                             env={**cli_env(dsn), "REPLICATOR_CRASH_AT": point}, capture_output=True, text=True,
                             timeout=120)
    assert crashed.returncode == -9, crashed.stderr
    after_crash = Warehouse(path).read()
    manifest_temps = list(path.glob("_manifest.json.*.tmp"))
    if point == "spark-committed":
        # The manifest names the batch and its position; the source was not told (finish_batch).
        assert after_crash["version"] == before["version"] + 1 and after_crash["positions"] != before["positions"]
        assert_same(conn, spark, path, "t", "t", ["id"])
    else:
        assert after_crash["version"] == before["version"] and after_crash["positions"] == before["positions"]
        assert {r["id"]: r["v"] for r in read_table(spark, path, "t").collect()} == state_before
    assert bool(manifest_temps) == (point == "spark-manifest-written"), manifest_temps
    leftovers = [p for p in path.rglob("*.parquet")
                 if str(p.relative_to(path)) not in Warehouse(path).referenced(after_crash)
                 and not any(str(q) in Warehouse(path).referenced(after_crash)
                             for q in p.relative_to(path).parents)]
    assert bool(leftovers) == (point != "spark-committed"), "an uncommitted change log is left until the next run"
    done = run_cli(dsn, "consume", "q", "--target", url, "--until-caught-up")
    assert done.returncode == 0, done.stderr
    assert_same(conn, spark, path, "t", "t", ["id"])
    assert not any(p.exists() for p in leftovers + manifest_temps), "uncommitted files must be cleaned up"
    # applied exactly once: one change log, and the next run finds nothing to do and changes nothing
    version = Warehouse(path).read()["version"]
    done = run_cli(dsn, "consume", "q", "--target", url, "--until-caught-up")
    assert done.returncode == 0, done.stderr
    assert_same(conn, spark, path, "t", "t", ["id"])
    assert len(Warehouse(path).read()["tables"]["public.t"]["logs"]) == 1
    assert len(list(path.rglob("log-*.parquet"))) == 1
    assert Warehouse(path).read()["version"] >= version


def test_truncate_makes_a_new_empty_generation_and_spills_large_batches(dsn, conn, source, tmp_path, spark,
                                                                      monkeypatch):
    import replicator.targets.spark.target as spark_target
    monkeypatch.setattr(spark_target, "LOG_SPILL_ROWS", 50)
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v int)")
    conn.execute("INSERT INTO t SELECT g, g FROM generate_series(1, 100) g")
    source.create_queue("q")
    source.add_table("q", "t")
    path = tmp_path / "wh"
    target = SparkTarget(path, spark=spark, compact_after_logs=0)
    consume(dsn, target)
    with conn.transaction():
        conn.execute("UPDATE t SET v = v + 1")
        conn.execute("TRUNCATE t")
        conn.execute("INSERT INTO t SELECT g, -g FROM generate_series(50, 230) g")
        conn.execute("UPDATE t SET v = 0 WHERE id > 200")
        conn.execute("DELETE FROM t WHERE id < 60")
    consume(dsn, target)
    entry = Warehouse(path).read()["tables"]["public.t"]
    assert entry["base"] == [] and len(entry["logs"]) >= 2, entry   # spilled once past 50 keys
    assert_same(conn, spark, path, "t", "t", ["id"])
    compact(spark, path, tables=["t"])
    assert_same(conn, spark, path, "t", "t", ["id"])
    target.close()


def test_compact_command_and_errors(dsn, conn, source, tmp_path, spark):
    from click.testing import CliRunner

    from replicator.cli import cli

    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v int)")
    source.create_queue("q")
    source.add_table("q", "t")
    path = tmp_path / "wh"
    target = SparkTarget(path, compact_after_logs=0)
    from replicator.errors import UserError
    with pytest.raises(UserError, match="another consumer is writing"):
        SparkTarget(path)
    consume(dsn, target)   # the (empty) copy
    for i in range(3):
        conn.execute("INSERT INTO t VALUES (%s, %s)", (i, i))
        consume(dsn, target)
    target.close()
    assert len(Warehouse(path).read()["tables"]["public.t"]["logs"]) == 3
    result = CliRunner().invoke(cli, ["spark", "compact", "--target", f"spark:{path}"])
    assert result.exit_code == 0, result.output
    assert "public.t: 3 log files folded into 3 rows" in result.output
    assert Warehouse(path).read()["tables"]["public.t"]["logs"] == []
    assert_same(conn, spark, path, "t", "t", ["id"])
    bad = run_cli(dsn, "spark", "compact", "--target", "sqlite:x.db")
    assert bad.returncode == 1 and "use spark:PATH" in bad.stderr
    bad = run_cli(dsn, "consume", "q", "--target", "sqlite:" + str(tmp_path / "x.db"), "--spark-master", "local")
    assert bad.returncode == 1 and "spark: target only" in bad.stderr


def test_parallel_initial_copy_reads_one_snapshot_while_the_table_changes(dsn, conn, source, tmp_path, spark,
                                                                         monkeypatch):
    import replicator.targets.parallel_copy as parallel_copy
    monkeypatch.setattr(parallel_copy, "PARALLEL_MIN_ROWS", 1)
    monkeypatch.setattr(parallel_copy, "workers_for", lambda rows: 3)
    conn.execute(T_DDL)
    conn.execute("INSERT INTO t SELECT g, repeat('x', 50) || g, g / 4.0, g, g % 2 = 0, now(), '\\x01', current_date"
                 " FROM generate_series(1, 6000) g")
    source.create_queue("q")
    source.add_table("q", "t")
    # The writes run while the workers copy: a transaction that began after the copy's
    # snapshot holds t locked, so no worker can read before it commits, and it writes and
    # commits at the copy's first progress report (the workers started, none finished).
    writer = psycopg.connect(dsn)
    reported: list[int] = []
    real_copy_parallel = parallel_copy.copy_parallel

    def copy_parallel_with_writes(snap, ranges, files, progress, taken):
        writer.execute("LOCK TABLE t IN ACCESS EXCLUSIVE MODE")

        def report(rows: int) -> None:
            if not reported:
                writer.execute("UPDATE t SET v = 'during the copy' WHERE id % 10 = 0")   # new versions in other blocks
                writer.execute("DELETE FROM t WHERE id % 10 = 1")
                writer.execute("INSERT INTO t (id, v) SELECT g, 'inserted' FROM generate_series(6001, 6300) g")
                writer.commit()
            reported.append(rows)
            progress(rows)

        return real_copy_parallel(snap, ranges, files, report, taken)

    monkeypatch.setattr(parallel_copy, "copy_parallel", copy_parallel_with_writes)
    path = tmp_path / "wh"
    target = SparkTarget(path, spark=spark, compact_after_logs=0)
    try:
        consumer = Consumer(dsn, "q", target)
        try:
            consumer.connect()
            conn.execute("UPDATE t SET v = 'before the copy' WHERE id <= 10")   # in the copy; its event is skipped
            consumer.sync_tables()
            assert reported[0] == 0 and reported[-1] == 6000, reported
            entry = Warehouse(path).read()["tables"]["public.t"]
            assert len(entry["base"]) == 3 and entry["base_rows"] == 6000, entry
            copied = {r["id"]: r["v"] for r in read_table(spark, path, "t").collect()}
            assert len(copied) == 6000 and copied[10] == "before the copy" and copied[20].startswith("xxx")
            consumer.run(until_caught_up=True)
        finally:
            consumer.close()
            writer.close()
        assert_same(conn, spark, path, "t", "t", ["id"])
        conn.execute("DELETE FROM t WHERE id % 100 = 0")
        consume(dsn, target)
        assert_same(conn, spark, path, "t", "t", ["id"])
    finally:
        target.close()


def test_a_warehouse_that_fails_to_open_is_not_left_locked(tmp_path):
    from replicator.errors import UserError
    path = tmp_path / "wh"
    path.mkdir()
    (path / "_manifest.json").write_text("{not json")
    with pytest.raises(UserError, match=r"_manifest.json is not a manifest"):
        SparkTarget(path)
    (path / "_manifest.json").unlink()
    SparkTarget(path).close()   # the failed open released the consumer lock


def _hide_first_log(path: Path) -> tuple[Path, Path]:
    """Moves the table's oldest change log file away: Spark then fails to read the table."""
    first = path / Warehouse(path).read()["tables"]["public.t"]["logs"][0]["file"]
    return first, first.rename(first.with_name("hidden-" + first.name))


def test_spark_commands_start_spark_without_the_jvms_incubator_warning(dsn, conn, source, tmp_path, spark):
    # Spark's launcher adds the jdk.incubator.vector module, and the JVM announces it on
    # every start: replicator's own Spark sessions leave that line out, and nothing else
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v int)")
    source.create_queue("q")
    source.add_table("q", "t")
    path = tmp_path / "wh"
    target = SparkTarget(path, compact_after_logs=0)
    try:
        consume(dsn, target)
        conn.execute("INSERT INTO t VALUES (1, 1)")
        consume(dsn, target)
    finally:
        target.close()
    done = run_cli(dsn, "spark", "compact", "--target", f"spark:{path}", timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("public.t: 1 log file folded into 1 row"), done
    # replicator's own log lines (compacting..., compacted...), and nothing of the JVM's
    assert done.stderr and all(re.match(r"\d{4}-\d\d-\d\d [\d:,]+ INFO (compacting|compacted) public\.t", line)
                               for line in done.stderr.splitlines()), done.stderr
    # what the JVM writes otherwise reaches stderr: Spark's own log, asked for with -v
    verbose = run_cli(dsn, "-v", "spark", "compact", "--target", f"spark:{path}", timeout=300)
    assert verbose.returncode == 0 and "WARN" in verbose.stderr, verbose.stderr
    assert "incubator" not in verbose.stderr, verbose.stderr


def test_compact_command_reports_a_damaged_manifest_and_a_spark_failure_in_one_line(dsn, conn, source, tmp_path,
                                                                                    spark):
    from click.testing import CliRunner

    from replicator.cli import cli
    from replicator.errors import UserError

    path = tmp_path / "wh"
    path.mkdir()
    (path / "_manifest.json").write_text('{"format": 1, "tables": {')
    bad = run_cli(dsn, "spark", "compact", "--target", f"spark:{path}")
    assert bad.returncode == 1, bad.stderr
    assert bad.stderr.startswith(f"error: cannot compact {path}: {path}/_manifest.json is not a manifest"), bad.stderr
    assert "restore it from a backup" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    (path / "_manifest.json").unlink()
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v int)")
    source.create_queue("q")
    source.add_table("q", "t")
    target = SparkTarget(path, spark=spark, compact_after_logs=0)
    try:
        consume(dsn, target)
        conn.execute("INSERT INTO t VALUES (1, 1)")
        consume(dsn, target)
    finally:
        target.close()
    first, _hidden = _hide_first_log(path)
    failed = CliRunner().invoke(cli, ["spark", "compact", "--target", f"spark:{path}"])
    assert failed.exit_code == 1 and isinstance(failed.exception, UserError), failed.output
    message = str(failed.exception)
    assert message.startswith(f"cannot compact {path}: Spark failed: ") and first.name in message, message
    assert "\n" not in message, message


def test_failed_background_compaction_is_retried_after_a_backoff(dsn, conn, source, tmp_path, spark, caplog):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v int)")
    source.create_queue("q")
    source.add_table("q", "t")
    path = tmp_path / "wh"
    target = SparkTarget(path, spark=spark, compact_after_logs=2, compact_retry_after=3600)
    try:
        consume(dsn, target)   # the (empty) copy
        conn.execute("INSERT INTO t VALUES (1, 1)")
        consume(dsn, target)
        first, hidden = _hide_first_log(path)
        conn.execute("INSERT INTO t VALUES (2, 2)")
        consume(dsn, target)   # the second log file: a compaction starts, and cannot read the first
        failed = target._compactor
        assert failed is not None
        failed.join()
        assert target._compact_error is not None
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "compaction of" in r.getMessage()]
        assert len(warnings) == 1 and warnings[0].exc_info is None, warnings
        assert "retried in 3600s" in warnings[0].getMessage() and "\n" not in warnings[0].getMessage()
        conn.execute("INSERT INTO t VALUES (3, 3)")
        consume(dsn, target)
        assert target._compactor is failed, "retried before the backoff was over"
        hidden.rename(first)
        target.compact_retry_after = 0   # the backoff is over
        conn.execute("INSERT INTO t VALUES (4, 4)")
        consume(dsn, target)
        assert target._compactor is not failed, "compaction was not retried"
        target._compactor.join()
        assert target._compact_error is None, target._compact_error
        assert Warehouse(path).read()["tables"]["public.t"]["logs"] == []
        assert_same(conn, spark, path, "t", "t", ["id"])
    finally:
        target.close()


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_warehouse_deleted_under_the_running_consumer_stops_it_at_the_next_batch(dsn, conn, source, tmp_path,
                                                                                     how):
    import shutil

    from replicator.errors import UserError
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v int)")
    source.create_queue("q")
    source.add_table("q", "t")
    path = tmp_path / "wh"
    target = SparkTarget(path, compact_after_logs=0)   # no compaction: no Spark
    consumer = Consumer(dsn, "q", target)
    try:
        consumer.run(until_caught_up=True)
        position = consumer.source.conn.execute(
            "SELECT last_tick FROM replicator.consumer_info() WHERE queue_name = 'q'").fetchone()[0]
        if how == "deleted":
            shutil.rmtree(path)
        else:   # a copy put in its place (an older one, restored)
            shutil.copytree(path, tmp_path / "copy")
            shutil.rmtree(path)
            (tmp_path / "copy").rename(path)
        conn.execute("INSERT INTO t VALUES (1, 1)")
        source.tick("q", force=True)
        with pytest.raises(UserError, match=rf"{path} was {how}.*consumer stopped"):
            consumer.run(until_caught_up=True)
        assert conn.execute("SELECT last_tick FROM replicator.consumer_info() WHERE queue_name = 'q'"
                            ).fetchone()[0] == position
    finally:
        consumer.close()
        target.close()


# what is in a warehouse besides replicator's own files -------------------------------------

def _warehouse_with_a_table(path: Path) -> Path:
    """A warehouse holding one table (a base and a change log), written without Spark;
    returns the directory of the table's generation."""
    from replicator.structure import Column, TableStructure
    from replicator.targets.protocol import TargetTable

    columns = (Column(name="id", type="bigint", base_type="bigint", category="N", not_null=True, attnum=1),)
    table = TargetTable(source_name="public.orders", table_id=1, mode="full", copy_snapshot=None,
                        structure=TableStructure(schema="public", name="orders", columns=columns, key=("id",)))
    target = SparkTarget(path, compact_after_logs=0)
    try:
        for tick, (mode, rows) in enumerate([("R", [(1,), (2,)]), ("U", [(3,)])]):
            target.begin()
            if mode == "R":
                target.create_table(table)
            target.upsert(table, mode, rows)
            target.set_position("q", "c", tick + 1)
            target.commit()
    finally:
        target.close()
    return path / Warehouse(path).read()["tables"]["public.orders"]["generation"]


def _tree(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): p.read_bytes().hex() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("where", ["a-table-name", "named-like-a-table-directory", "in-a-generation",
                                   "to-a-file"])
def test_a_symlink_in_the_warehouse_stops_the_consumer_and_what_it_points_to_is_kept(tmp_path, where):
    from replicator.errors import UserError

    path = tmp_path / "wh"
    generation = _warehouse_with_a_table(path)
    victim = tmp_path / "victim"
    (victim / "g-0123456789ab").mkdir(parents=True)
    (victim / "keep.txt").write_text("kept")
    (victim / "g-0123456789ab" / "log-000000000009-0123456789ab.parquet").write_text("kept too")
    link, target = {"a-table-name": (path / "orders", victim),
                    "named-like-a-table-directory": (path / "orders-0123456789ab", victim),
                    "in-a-generation": (generation / "compact-0123456789ab", victim),
                    "to-a-file": (generation / "log-000000000009-0123456789ab.parquet", victim / "keep.txt")}[where]
    link.symlink_to(target)
    victim_before, warehouse_before = _tree(victim), _tree(path)
    with pytest.raises(UserError, match=re.escape(f"holds {link.relative_to(path)} (a symbolic link), which "
                                                  f"replicator did not make")) as refused:
        SparkTarget(path)
    assert "\n" not in str(refused.value) and "move it out of the warehouse" in str(refused.value)
    assert _tree(victim) == victim_before and _tree(path) == warehouse_before
    link.unlink()
    SparkTarget(path).close()   # the way out


def test_a_file_the_user_put_in_the_warehouse_stops_the_consumer_and_is_kept(tmp_path):
    """Only files named as replicator names its own, that no manifest names, are a crashed
    run's leftovers; nothing is deleted while something else is there."""
    from replicator.errors import UserError

    path = tmp_path / "wh"
    generation = _warehouse_with_a_table(path)
    leftover = generation / "log-000000000099-0123456789ab.parquet"   # as a crash before the commit leaves it
    leftover.write_text("not committed")
    mine = [generation / "notes.txt", generation.parent / "README", path / "exports" / "orders.csv"]
    for p in mine:
        p.parent.mkdir(exist_ok=True)
        p.write_text("the user's")
    with pytest.raises(UserError, match=r"holds exports \(a directory\), orders-\w+/README \(a file\), "
                                        r"orders-\w+/g-\w+/notes.txt \(a file\), which replicator did not make.*"
                                        r"move them out of the warehouse") as refused:
        SparkTarget(path)
    assert "\n" not in str(refused.value)
    assert all(p.read_text() == "the user's" for p in mine) and leftover.exists()
    for p in mine:
        p.rename(tmp_path / p.name)
    (path / "exports").rmdir()
    SparkTarget(path).close()
    assert not leftover.exists(), "replicator's own leftover is removed"
    assert sorted(p.name for p in generation.iterdir()) == sorted(
        Path(f).name for f in Warehouse(path).referenced(Warehouse(path).read()))


def test_garbage_collection_follows_no_link_out_of_the_warehouse(tmp_path):
    """A replaced generation is deleted by a later commit; a table directory moved elsewhere
    and linked meanwhile is not deleted through the link."""
    path = tmp_path / "wh"
    generation = _warehouse_with_a_table(path)
    warehouse = Warehouse(path)
    manifest = warehouse.read()
    manifest["garbage"] = [{"files": [warehouse.relative(generation)], "since": 0.0}]
    table_dir = generation.parent
    moved = tmp_path / "elsewhere"
    table_dir.rename(moved)
    table_dir.symlink_to(moved)
    before = _tree(moved)
    assert warehouse.collect_garbage(manifest, retention=0)
    assert _tree(moved) == before and before
    table_dir.unlink()
    moved.rename(table_dir)
    manifest["garbage"] = [{"files": [warehouse.relative(generation)], "since": 0.0}]
    assert warehouse.collect_garbage(manifest, retention=0)
    assert not table_dir.exists(), "the generation, and the table directory it emptied, are deleted"


def test_a_compaction_removes_only_its_own_leftovers_and_follows_no_link(tmp_path):
    path = tmp_path / "wh"
    generation = _warehouse_with_a_table(path)
    unfinished = generation / "compact-0123456789ab"   # a crashed compaction's output
    (unfinished / "_temporary" / "0").mkdir(parents=True)
    (unfinished / "_temporary" / "0" / "part-00000-x.snappy.parquet").write_text("partial")
    (unfinished / "part-00001-x.snappy.parquet").write_text("partial")
    (unfinished / ".part-00001-x.snappy.parquet.crc").write_text("partial")
    victim = tmp_path / "victim"
    (victim / "g-0123456789ab" / "compact-0123456789ab").mkdir(parents=True)
    (victim / "g-0123456789ab" / "compact-0123456789ab" / "part-00000.parquet").write_text("kept")
    (path / "linked-0123456789ab").symlink_to(victim)
    (generation / "hidden-log.parquet").write_text("the consumer's to judge")
    warehouse = Warehouse(path)
    with warehouse.lock():
        assert warehouse.remove_orphans(warehouse.read(), compaction=True) == 3
    assert not unfinished.exists()
    assert (victim / "g-0123456789ab" / "compact-0123456789ab" / "part-00000.parquet").read_text() == "kept"
    assert (generation / "hidden-log.parquet").exists()


def test_sigterm_stops_the_consumer_during_a_background_compaction_and_the_warehouse_stays_exact(
        dsn, conn, source, tmp_path, spark):
    conn.execute("CREATE TABLE big (id int PRIMARY KEY, v text, n numeric(12,2))")
    conn.execute(f"INSERT INTO big SELECT g, md5(g::text), g / 100.0 FROM generate_series(1, {BIG_ROWS}) g")
    source.create_queue("q")
    source.add_table("q", "big")
    path = tmp_path / "wh"
    target = SparkTarget(path, compact_after_logs=0)
    try:
        consume(dsn, target)   # the copy
        # 70 log files, past the 64 that make the consumer compact: rows written again as they are
        table = target.tables()["public.big"]
        for (row,) in zip(conn.execute("SELECT id, v, n::text FROM big WHERE id % 1000 = 1 ORDER BY id LIMIT 70")):
            target.begin()
            target.upsert(table, "U", [row])
            target.commit()
    finally:
        target.close()
    logs = len(Warehouse(path).read()["tables"]["public.big"]["logs"])
    assert logs == 70
    daemon = Daemon(dsn, "consume", "q", "--target", f"spark:{path}", "--poll-interval", "0.05",
                    log=tmp_path / "consume.log")
    try:
        conn.execute("DELETE FROM big WHERE id = 2")   # the daemon's batch: after its commit, a compaction starts
        source.tick("q", force=True)
        wait_until(lambda: "compacting public.big" in daemon.log(), 600, "the background compaction to start",
                   check=lambda: assert_alive(daemon))
        assert daemon.terminate(timeout=120) == 0, daemon.log()
    finally:
        daemon.stop()
    log = daemon.log()
    # stopped (its Spark job cancelled), or left uncommitted while Spark was still planning it
    assert ("compaction of public.big stopped: the consumer is stopping" in log
            or "background compaction is left unfinished, uncommitted" in log), log
    assert "compacted public.big" not in log, log
    # nothing of the compaction was committed, and what the manifest names reads as the source
    assert len(Warehouse(path).read()["tables"]["public.big"]["logs"]) == logs + 1
    assert_same(conn, spark, path, "big", "big", ["id"])
    # the next compaction removes what the stopped one may have left, and commits
    [done] = compact(spark, path)
    assert done.committed
    entry = Warehouse(path).read()["tables"]["public.big"]
    generation = path / entry["generation"]
    assert {p.name for p in generation.glob("compact-*")} == {Path(entry["base"][0]).parent.name}
    assert_same(conn, spark, path, "big", "big", ["id"])


BIG_ROWS = 1_000_000   # a compaction of it takes seconds: long enough to be stopped midway


def assert_alive(daemon: Daemon) -> None:
    assert daemon.alive(), daemon.log()
