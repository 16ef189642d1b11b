"""A Delta warehouse in object storage, as a user runs it: `replicator consume QUEUE --target
delta:s3://BUCKET/PREFIX` (the console script, its environment pointing at the test's S3
server, moto), kill -9 at each commit step, the `replicator delta` commands, two consumers
on one warehouse, and a wrong bucket or credentials.

The tables are read with delta-rs (the storage options ObjectStorage gives) and, once,
by Spark through s3a; the source is the oracle of tests/test_delta_target.py.
"""

from __future__ import annotations

import json
import time
from typing import Any

import psycopg
import pyarrow as pa
import pytest

pytest.importorskip("deltalake")
from deltalake import DeltaTable

from consumer_helpers import Daemon, forced_tick, run_cli, set_fast_ticks, wait_until
from replicator.consumer import Consumer
from replicator.errors import UserError
from replicator.targets.delta import log as delta_log
from replicator.targets.delta.object_storage import ObjectStorage
from replicator.targets.delta.reader import read_table, table_uris
from replicator.targets.delta.state import WarehouseState
from replicator.targets.delta.table import ReplicaTable
from replicator.targets.delta.target import DeltaTarget
from s3_helpers import MotoServer
from test_delta_target import CRASH_DDL, _one_batch_of_changes, consume_to_now, diff, primary_key, source_state


def consume_cli(dsn: str, url: str, *args: str, **env: str) -> Any:
    return run_cli(dsn, "consume", "q", "--target", f"delta:{url}", "--until-caught-up", *args, timeout=180, **env)


def table(url: str, name: str, version: int | None = None) -> DeltaTable:
    root, options = ObjectStorage(url).delta_rs()
    directory = table_uris(url)[name].removeprefix(root + "/")
    return DeltaTable(f"{root}/{directory}", storage_options=options, version=version)


def delta_rows(url: str, name: str, key: list[str], version: int | None = None) -> tuple[list[str], dict]:
    """A table read by delta-rs from the object store: its column names and {key: row}."""
    data = pa.table(table(url, name, version).scan().read_all())
    rows = data.to_pylist()
    out = {tuple(r[k] for k in key): r for r in rows}
    assert len(out) == len(rows), f"{name}: {len(rows) - len(out)} rows with a key another row has"
    return data.column_names, out


def assert_equal_to_source(conn: psycopg.Connection, url: str, tables: list[str]) -> None:
    problems = []
    for name in tables:
        qualified = name if "." in name else f"public.{name}"
        problems += diff(name, source_state(conn, name), delta_rows(url, qualified, primary_key(conn, name)))
    assert not problems, f"{len(problems)} differences:\n" + "\n".join(problems[:30])


def live_files(url: str, name: str) -> list[dict[str, Any]]:
    """The add actions of a table's current version."""
    directory = table_uris(url)[name].rsplit("/", 1)[-1]
    return list(delta_log.load(ObjectStorage(url), directory).files.values())


def position(url: str) -> tuple[str, int]:
    [(app, tick)] = WarehouseState(ObjectStorage(url)).positions().items()
    return app, tick


def one_line_error(done: Any) -> str:
    assert done.returncode == 1, (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return str(lines[0])


# a workload through the console script, read by delta-rs and Spark ------------------------------

WORKLOAD_DDL = """
    CREATE SCHEMA s;
    CREATE TABLE t (id bigint PRIMARY KEY, amount numeric(12,2), ts timestamptz, tsn timestamp, v text,
                    cnt int NOT NULL DEFAULT 0, gone text);
    INSERT INTO t SELECT g, g * 1.5, '2024-01-01 00:00+03'::timestamptz + g * interval '1 minute',
                         '2024-01-01'::timestamp + g * interval '1 second', 'v' || g, 0, 'g'
                  FROM generate_series(1, 3000) g;
    CREATE TABLE s.u (k text PRIMARY KEY, cnt int NOT NULL DEFAULT 0);
    INSERT INTO s.u SELECT 'k' || g, 0 FROM generate_series(1, 100) g;
"""
WORKLOAD = [
    ["UPDATE t SET cnt = cnt + 1, amount = amount + 0.01 WHERE id % 3 = 0", "DELETE FROM t WHERE id BETWEEN 10 AND 30",
     "UPDATE t SET id = id + 10000 WHERE id BETWEEN 40 AND 45", "UPDATE s.u SET cnt = cnt + 1",
     "UPDATE s.u SET k = k || '+' WHERE k = 'k1'"],
    ["ALTER TABLE t ADD COLUMN extra text", "UPDATE t SET extra = 'e' WHERE id % 10 = 0",
     "ALTER TABLE t RENAME COLUMN v TO label", "ALTER TABLE t DROP COLUMN gone"],
    ["ALTER TABLE s.u ALTER COLUMN cnt TYPE bigint", "UPDATE s.u SET cnt = cnt + 5 WHERE k < 'k5'"],
    ["TRUNCATE s.u", "INSERT INTO s.u VALUES ('after', 1)", "UPDATE t SET cnt = cnt + 1 WHERE id % 7 = 0"],
]


def test_the_console_script_keeps_an_s3_warehouse_equal_to_the_source_read_by_delta_rs_and_spark(
        dsn, conn, source, s3_url, spark):
    conn.execute(WORKLOAD_DDL)
    source.create_queue("q")
    source.add_table("q", "t")
    source.add_table("q", "s.u")
    for statements in [[], *WORKLOAD]:   # a run per step: the copy, then a batch or more each
        for statement in statements:
            conn.execute(statement)
        done = consume_cli(dsn, s3_url)
        assert done.returncode == 0, done.stderr
        assert_equal_to_source(conn, s3_url, ["t", "s.u"])
    assert table(s3_url, "public.t").version() >= 4
    assert [f.type.type for f in table(s3_url, "s.u").schema().fields if f.name == "cnt"] == ["long"]
    frame = read_table(spark, f"delta:{s3_url}", "t")   # s3a, at the endpoint of the session's environment
    assert frame.columns == ["id", "amount", "ts", "tsn", "label", "cnt", "extra"]
    problems = diff("t", source_state(conn, "t"), _spark_rows(frame, ["id"]))
    assert not problems, "\n".join(problems[:30])


def _spark_rows(frame: Any, key: list[str]) -> tuple[list[str], dict]:
    data = frame.toArrow()
    return data.column_names, {tuple(r[k] for k in key): r for r in data.to_pylist()}


# kill -9 at each commit step --------------------------------------------------------------------

@pytest.mark.parametrize("point", ["delta-table-committed", "delta-committed"])
def test_kill_9_at_a_commit_step_on_s3_then_a_restart_applies_each_change_once(dsn, conn, source, s3_url, point):
    conn.execute(CRASH_DDL)
    source.create_queue("q")
    source.add_table("q", "t")
    source.add_table("q", "u")
    consume_to_now(dsn, s3_url)
    app, _ = position(s3_url)
    for round_ in range(2):
        _one_batch_of_changes(conn, round_)
        forced_tick(conn)
        before = {name: table(s3_url, name).version() for name in ("public.t", "public.u")}
        crashed = consume_cli(dsn, s3_url, REPLICATOR_CRASH_AT=point)
        assert crashed.returncode == -9, crashed.stderr
        held = {name: table(s3_url, name).transaction_version(app) or 0 for name in before}
        committed = {name for name in before if table(s3_url, name).version() > before[name]}
        assert len(committed) == (1 if point == "delta-table-committed" else 2), (before, held)
        assert (position(s3_url)[1] >= max(held.values())) == (point == "delta-committed")
        restarted = consume_cli(dsn, s3_url)
        assert restarted.returncode == 0, restarted.stderr
        assert_equal_to_source(conn, s3_url, ["t", "u"])
        for name in committed:   # the table that held the batch skipped it: the batch's one commit
            ticks = [json.loads(line)["txn"]["version"] for version in range(table(s3_url, name).version() + 1)
                     for line in _commit(s3_url, name, version) if '"txn"' in line]
            assert ticks.count(held[name]) == 1, (name, ticks)
    assert conn.execute("SELECT sum(cnt) FROM u").fetchone()[0] == 100


def _commit(url: str, name: str, version: int) -> list[str]:
    storage = ObjectStorage(url)
    directory = table_uris(url)[name].rsplit("/", 1)[-1]
    try:
        return storage.read(f"{directory}/_delta_log/{version:020d}.json").decode().splitlines()
    except FileNotFoundError:   # cleaned up after a checkpoint
        return []


# replicator delta tables | optimize | vacuum ------------------------------------------------------

def test_the_delta_commands_list_optimize_and_vacuum_an_s3_warehouse(dsn, conn, source, s3_url):
    conn.execute(CRASH_DDL)
    source.create_queue("q")
    source.add_table("q", "t")
    source.add_table("q", "u")
    consume_to_now(dsn, s3_url)   # the warehouse the commands are run on
    [(_, copied)] = WarehouseState(ObjectStorage(s3_url)).positions().items()
    for round_ in range(3):   # a few rows each: deletion vectors the consumer's OPTIMIZE leaves
        conn.execute("UPDATE t SET cnt = cnt + 1 WHERE id %% 20 = %s", (round_,))
        conn.execute("DELETE FROM t WHERE id = %s", (100 + round_,))
        conn.execute("UPDATE u SET cnt = cnt + 1 WHERE k = %s", (f"k{round_ + 1}",))
        consume_to_now(dsn, s3_url)
    target = f"delta:{s3_url}"

    listed = run_cli(dsn, "delta", "tables", "--target", target, "--json")
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) == [{"table": name, "uri": uri} for name, uri in table_uris(s3_url).items()]
    assert sorted(table_uris(s3_url)) == ["public.t", "public.u"]
    as_of = run_cli(dsn, "delta", "tables", "--target", target, "--tick", str(copied), "--json")
    assert as_of.returncode == 0, as_of.stderr
    versions = {row["table"]: row["version"] for row in json.loads(as_of.stdout)}
    assert sorted(versions) == ["public.t", "public.u"]
    copy = delta_rows(s3_url, "public.u", ["k"], versions["public.u"])[1].values()   # before the batches
    assert len(copy) == 50 and {row["cnt"] for row in copy} == {0}

    assert all(any(add.get("deletionVector") for add in live_files(s3_url, name)) for name in versions)
    optimized = run_cli(dsn, "delta", "optimize", "--target", target, "--purge")
    assert optimized.returncode == 0, optimized.stderr
    assert "public.t: " in optimized.stdout and "public.u: " in optimized.stdout, optimized.stdout
    assert [len(live_files(s3_url, name)) for name in versions] == [1, 1]
    assert not any(add.get("deletionVector") for name in versions for add in live_files(s3_url, name))
    assert_equal_to_source(conn, s3_url, ["t", "u"])

    storage = ObjectStorage(s3_url)
    before = {e.path for e in storage.list("")}
    kept = run_cli(dsn, "delta", "vacuum", "--target", target)   # 7 days: nothing is that old
    assert kept.returncode == 0 and kept.stdout.strip() == "nothing to delete", (kept.stdout, kept.stderr)
    shortest = ("--retain", "1s", "--force")   # once the files OPTIMIZE removed are older than that
    deadline = time.monotonic() + 30
    while "public.t: " not in (dry := run_cli(dsn, "delta", "vacuum", "--target", target, *shortest, "--dry-run")).stdout:
        assert dry.returncode == 0 and time.monotonic() < deadline, (dry.stdout, dry.stderr)
    vacuumed = run_cli(dsn, "delta", "vacuum", "--target", target, *shortest)
    assert vacuumed.returncode == 0, vacuumed.stderr
    after = {e.path for e in storage.list("")}
    gone = before - after
    assert gone and all("_delta_log/" not in p and ("/part-" in p or "/deletion_vector_" in p) for p in gone), gone
    assert_equal_to_source(conn, s3_url, ["t", "u"])
    conn.execute("UPDATE t SET cnt = cnt + 1")   # and the consumer goes on over the vacuumed tables
    done = consume_cli(dsn, s3_url)
    assert done.returncode == 0, done.stderr
    assert_equal_to_source(conn, s3_url, ["t", "u"])


# two consumers on one warehouse ----------------------------------------------------------------

SECOND = {"the same consumer again": [], "another consumer": ["--consumer", "other"]}


@pytest.mark.parametrize("second", SECOND)
def test_a_second_consumer_of_an_s3_warehouse_stops_in_one_line_and_the_first_keeps_it_exact(
        dsn, conn, source, s3_url, tmp_path, second):
    """What happens: the same consumer started again takes the batch the running one takes; of
    their two commits of a table's next version one loses, finds the other's transaction id and
    stops, or finds at the source that the other closed the batch and stops (and the winner too
    when the loser's start moved the source's consumer back under it: it says so); two that never
    take the same batch both go on. Another consumer is refused at its start (the warehouse holds the first's
    position). Either way the warehouse stays whole: a run after them makes it exact."""
    conn.execute(CRASH_DDL)
    source.create_queue("q")
    source.add_table("q", "t")
    source.add_table("q", "u")
    set_fast_ticks(conn)
    done = consume_cli(dsn, s3_url, "--consumer", "c")
    assert done.returncode == 0, done.stderr
    names = [["--consumer", "c"], SECOND[second]]
    ticker = Daemon(dsn, "ticker", "--interval", "0.1", log=tmp_path / "ticker.log")
    args = ("consume", "q", "--target", f"delta:{s3_url}", "--poll-interval", "0.05")
    consumers = [Daemon(dsn, *args, *name, log=tmp_path / f"consume-{n}.log") for n, name in enumerate(names)]
    try:
        for round_ in range(12):
            _one_batch_of_changes(conn, round_ + 2)
            tick = forced_tick(conn)
            wait_until(lambda: position(s3_url)[1] >= tick or not any(c.alive() for c in consumers), 60,
                       f"tick {tick} applied")
        survivors = [c for c in consumers if c.alive()]
        stopped = [c for c in consumers if not c.alive()]
    finally:
        for c in consumers:
            c.stop()
        ticker.stop()
    logs = {n: c.log() for n, c in enumerate(consumers)}
    errors = [[line for line in c.log().splitlines() if line.startswith("error: ")] for c in stopped]
    assert all(len(lines) == 1 and "Traceback" not in c.log() for c, lines in zip(stopped, errors)), logs
    said = [lines[0] for lines in errors]
    if second == "another consumer":
        assert len(survivors) == 1 and said == [f"error: delta:{s3_url} replicates queue 'q' as consumer 'c', not "
                                                f"'other': a new consumer would skip what was queued meanwhile; use "
                                                f"--consumer with the stored name, or a new target"], logs
    else:   # a loser stops at its commit (the other's is there) or at the source (the other closed the batch);
        # the winner too if the loser's start moved the source's consumer back meanwhile
        assert all(line.startswith("error: another consumer q/c writes ")
                   or (line.startswith("error: batch ") and "another session" in line) for line in said), logs
        assert survivors or any("another session moved this consumer on the source" in line for line in said), logs
    assert WarehouseState(ObjectStorage(s3_url)).positions().keys() == {"q/c"}
    done = consume_cli(dsn, s3_url, "--consumer", "c")
    assert done.returncode == 0, done.stderr
    assert_equal_to_source(conn, s3_url, ["t", "u"])


def _consume(dsn: str, target: DeltaTarget, name: str) -> None:
    consumer = Consumer(dsn, "q", target, name=name)
    try:
        consumer.run(until_caught_up=True)
    finally:
        consumer.close()


@pytest.mark.parametrize("race", ["another host's consumer registered first", "the same consumer copied first"])
def test_a_second_consumer_starting_a_new_s3_warehouse_at_once_stops_in_one_line_and_leaves_it_whole(
        dsn, conn, source, s3_url, monkeypatch, race):
    """Two consumers started on a new warehouse at once, both finding it empty (object stores have no
    lock file): two hosts (two consumer names), or the same command twice."""
    conn.execute(CRASH_DDL)
    source.create_queue("q")
    source.add_table("q", "t")
    source.add_table("q", "u")
    if race == "another host's consumer registered first":
        name, first, second = "c1", DeltaTarget(s3_url), DeltaTarget(s3_url)
        _consume(dsn, first, name)
        consume_second = lambda: _consume(dsn, second, "c2")  # noqa: E731
    else:   # the first copies the tables after the second registered, before the second commits its copy
        name, second = "c", DeltaTarget(s3_url)
        commit = ReplicaTable.commit
        started: list[DeltaTarget] = []

        def first_copies_meanwhile(table: ReplicaTable, *args: Any) -> Any:
            monkeypatch.setattr(ReplicaTable, "commit", commit)
            started.append(DeltaTarget(s3_url))
            _consume(dsn, started[0], name)
            return commit(table, *args)

        monkeypatch.setattr(ReplicaTable, "commit", first_copies_meanwhile)
        consume_second = lambda: _consume(dsn, second, name)  # noqa: E731
    try:
        with pytest.raises(UserError) as stopped:
            consume_second()
    finally:
        second.close()
    if race == "another host's consumer registered first":
        assert str(stopped.value) == (f"another consumer q/c1 writes {s3_url}: one consumer writes a warehouse; "
                                      f"stop the other one")
    else:
        first = started[0]
        assert str(stopped.value) == (f"another consumer writes {s3_url}/public.t: one consumer writes a "
                                      f"warehouse's tables; stop the other one")
    state = WarehouseState(ObjectStorage(s3_url))
    assert state.positions().keys() == {f"q/{name}"}
    assert state.directories() == {"public.t": "public.t", "public.u": "public.u"}
    assert {e.path.split("/")[0] for e in ObjectStorage(s3_url).list("")} == {"_replicator", "public.t", "public.u"}
    conn.execute("UPDATE t SET cnt = cnt + 1")
    try:   # the first goes on
        _consume(dsn, first, name)
    finally:
        first.close()
    assert_equal_to_source(conn, s3_url, ["t", "u"])
    assert conn.execute("SELECT sum(cnt) FROM t").fetchone()[0] == 300


# a wrong bucket, refused credentials -------------------------------------------------------------

@pytest.fixture(scope="module")
def checking_s3_server(tmp_path_factory: pytest.TempPathFactory):
    """A moto server that checks credentials: it knows none, so every key is refused."""
    server = MotoServer(tmp_path_factory.mktemp("moto-auth") / "moto.log", env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    server.start()
    yield server
    server.stop()


def test_a_missing_bucket_or_refused_credentials_stop_the_consumer_in_one_line(dsn, conn, source, s3_url, s3_server,
                                                                                 checking_s3_server):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
    source.create_queue("q")
    source.add_table("q", "t")
    missing = one_line_error(consume_cli(dsn, "s3://no-such-bucket/wh"))
    assert missing == (f"error: s3://no-such-bucket/wh: the bucket 'no-such-bucket' does not exist at "
                       f"{s3_server.endpoint}: create it, or correct the warehouse URL")
    refused = one_line_error(consume_cli(dsn, s3_url, **checking_s3_server.environment()))
    assert refused.startswith(f"error: {s3_url}: access denied (InvalidAccessKeyId) at {checking_s3_server.endpoint}")
    listed = one_line_error(run_cli(dsn, "delta", "tables", "--target", "delta:s3://no-such-bucket/wh"))
    assert "does not exist" in listed
