"""The Delta target's parallel initial copy: worker processes read block ranges of a table in the
copy's snapshot and write its data files themselves, on a local path and on object storage.

Real PostgreSQL, the real consumer in-process (PARALLEL_MIN_ROWS is patched low so that a
small table is split; REPLICATOR_COPY_WORKERS=2 on this 2-core machine), real worker
processes, real files and the moto S3 server; tables read with delta-rs.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("deltalake")
from deltalake import DeltaTable

import replicator.targets.parallel_copy as parallel_copy
from consumer_helpers import cli_env, wait_until
from replicator.consumer import Consumer
from replicator.errors import UserError
from replicator.targets.delta import deletion_vectors, maintenance
from replicator.targets.delta.reader import table_uris
from replicator.targets.delta.storage import Entry
from replicator.targets.delta.target import DeltaTarget
from replicator.targets.delta.url import open_storage

ROWS = 20_000
DDL = """
    CREATE TABLE t (id bigint PRIMARY KEY, v text, n numeric(12,2), ts timestamptz, flag boolean);
    INSERT INTO t SELECT g, repeat('x', 40) || g, g / 4.0, '2024-01-01 00:00+02'::timestamptz + g * interval '1 minute',
                         g % 3 = 0
        FROM generate_series(1, 20000) g;
    ANALYZE t;
"""
WORKER = "replicator copy worker"   # the application_name of a worker's backend


@pytest.fixture(params=["local", "s3"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "wh")
    return str(request.getfixturevalue("s3_url"))


@pytest.fixture
def two_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel_copy, "PARALLEL_MIN_ROWS", 1000)
    monkeypatch.setenv("REPLICATOR_COPY_WORKERS", "2")


@pytest.fixture
def table(conn: psycopg.Connection, source: Any) -> str:
    conn.execute(DDL)
    source.create_queue("q")
    source.add_table("q", "t")
    return "public.t"


# the oracle -------------------------------------------------------------------------------

def source_rows(conn: psycopg.Connection) -> dict[int, tuple[Any, ...]]:
    return {r[0]: (r[1], r[2], r[3] and r[3].astimezone(UTC), r[4])
            for r in conn.execute("SELECT id, v, n, ts, flag FROM t")}


def delta_table(url: str, version: int | None = None) -> DeltaTable:
    _, options = open_storage(url).delta_rs()
    return DeltaTable(table_uris(url)["public.t"], version=version, storage_options=options)


def delta_rows(url: str) -> dict[int, tuple[Any, ...]]:
    """The table as delta-rs reads it; its keys must be unique."""
    rows = pa.table(delta_table(url).scan().read_all()).to_pylist()
    out = {r["id"]: (r["v"], r["n"], r["ts"], r["flag"]) for r in rows}
    assert len(out) == len(rows), f"{len(rows) - len(out)} rows with a key another row has"
    return out


def assert_equal_to_source(conn: psycopg.Connection, url: str) -> None:
    expected, actual = source_rows(conn), delta_rows(url)
    problems = [f"{k}: source {expected.get(k)}, Delta {actual.get(k)}"
                for k in sorted(expected.keys() | actual.keys()) if expected.get(k) != actual.get(k)]
    assert not problems, f"{len(problems)} differences:\n" + "\n".join(problems[:20])


def table_files(url: str) -> list[Entry]:
    """Files of the table's directory outside its log (a partly written file included)."""
    return [e for e in open_storage(url).list("public.t") if "/_delta_log/" not in e.path]


def log_actions(url: str) -> list[list[dict[str, Any]]]:
    """The actions of each commit of the table's log, from version 0."""
    storage = open_storage(url)
    commits = sorted(e.path for e in storage.list("public.t/_delta_log") if e.path.endswith(".json"))
    return [[json.loads(line) for line in storage.read(path).decode().splitlines()] for path in commits]


def referenced(url: str) -> set[str]:
    """Every file any version of the table names."""
    names = set()
    for commit in log_actions(url):
        for action in commit:
            for kind in ("add", "remove"):
                if kind in action:
                    names.add(f"public.t/{action[kind]['path']}")
                    vector = action[kind].get("deletionVector")
                    if vector:
                        names.add(f"public.t/{deletion_vectors.descriptor_file(vector)}")
    return names


def assert_files_match_their_add_actions(url: str, adds: list[dict[str, Any]]) -> None:
    """Each data file has the table's physical column names and field ids, and the size and
    statistics (rows, the key's bounds) its add action gives."""
    storage = open_storage(url)
    [metadata] = [a["metaData"] for a in log_actions(url)[0] if "metaData" in a]
    fields = json.loads(metadata["schemaString"])["fields"]
    ids = {f["metadata"]["delta.columnMapping.physicalName"]: f["metadata"]["delta.columnMapping.id"] for f in fields}
    key = fields[0]["metadata"]["delta.columnMapping.physicalName"]
    sizes = {e.path: e.size for e in table_files(url)}
    for add in adds:
        stats = json.loads(add["stats"])
        with storage.open_read(f"public.t/{add['path']}") as f:
            parquet = pq.ParquetFile(f)
            assert {c.name: int(c.metadata[b"PARQUET:field_id"]) for c in parquet.schema_arrow} == ids
            keys = parquet.read(columns=[key]).column(0).to_pylist()
        assert add["size"] == sizes[f"public.t/{add['path']}"]
        assert (stats["numRecords"], stats["minValues"][key], stats["maxValues"][key]) == (
            len(keys), min(keys), max(keys))


def consume(dsn: str, target: DeltaTarget) -> int:
    consumer = Consumer(dsn, "q", target, name="c")
    try:
        return consumer.run(until_caught_up=True)
    finally:
        consumer.close()


def workers_waiting(conn: psycopg.Connection, count: int) -> Callable[[], bool]:
    """Whether `count` workers' backends wait for a lock (the test's, on t)."""
    return lambda: conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
                                " AND wait_event_type = 'Lock'", (WORKER,)).fetchone()[0] == count


Action = Callable[[psycopg.Connection], None]


@pytest.fixture
def during_the_copy(monkeypatch: pytest.MonkeyPatch, dsn: str) -> Iterator[Callable[..., list[int]]]:
    """Runs an action (given an autocommit connection) once the copy has taken its snapshot. With
    stall_workers, while the copy's workers wait: a LOCK TABLE t IN ACCESS EXCLUSIVE MODE queued
    behind the copy's own lock on t holds back their reads; at the copy's first progress report, once
    the workers wait for it, the action runs, then the LOCK is cancelled. Without, before the workers
    start. Returns the progress reports seen."""
    holder = psycopg.connect(dsn)
    admin = psycopg.connect(dsn, autocommit=True)
    reported: list[int] = []
    actions: list[tuple[Action, bool]] = []
    real = parallel_copy.copy_parallel

    def lock_behind_the_copy() -> None:
        try:
            holder.execute("LOCK TABLE t IN ACCESS EXCLUSIVE MODE")
        except psycopg.errors.QueryCanceled:
            holder.rollback()

    def copy_parallel(snap, ranges, files, progress, taken):
        action, stall_workers = actions.pop(0) if actions else (None, False)
        if action is not None and not stall_workers:
            action(admin)
            action = None
        queued = threading.Thread(target=lock_behind_the_copy)
        if action is not None:
            queued.start()
            wait_until(lambda: admin.execute("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s",
                                             (holder.info.backend_pid,)).fetchone()[0], 60, "the LOCK to queue")

        def report(rows: int) -> None:
            nonlocal action
            if action is not None:
                wait_until(workers_waiting(admin, len(ranges)), 60, "the workers waiting for t")
                action, run = None, action
                try:
                    run(admin)
                finally:
                    holder.cancel()
                    queued.join()
            reported.append(rows)
            progress(rows)

        return real(snap, ranges, files, report, taken)

    monkeypatch.setattr(parallel_copy, "copy_parallel", copy_parallel)

    def arm(action: Action, stall_workers: bool = True) -> list[int]:
        actions.append((action, stall_workers))
        return reported

    try:
        yield arm
    finally:
        holder.close()
        admin.close()


# a copy while the table changes ----------------------------------------------------------------

def test_a_parallel_copy_of_a_table_changed_during_it_equals_the_source(dsn, conn, table, url, two_workers,
                                                                       during_the_copy):
    def change_the_table(admin: psycopg.Connection) -> None:
        # committed after the copy's snapshot, before its workers read: events the consumer applies after the copy
        with admin.transaction():
            admin.execute("UPDATE t SET v = 'during the copy' WHERE id % 10 = 0")   # new versions in other blocks
            admin.execute("DELETE FROM t WHERE id % 10 = 1")
            admin.execute("INSERT INTO t (id, v) SELECT g, 'inserted' FROM generate_series(20001, 20300) g")

    reported = during_the_copy(change_the_table, stall_workers=False)
    target = DeltaTarget(url)
    try:
        conn.execute("UPDATE t SET v = 'before the copy' WHERE id <= 10")   # in the copy; its event is skipped
        consume(dsn, target)
        assert reported[0] == 0 and reported[-1] == ROWS, reported
        # the copy: one commit of one file per worker, of the rows of its snapshot
        first = [a for a in log_actions(url)[0] if "add" in a]
        assert sorted(a["add"]["path"].split("-")[1] for a in first) == ["00000", "00001"], first
        assert sum(json.loads(a["add"]["stats"])["numRecords"] for a in first) == ROWS
        assert_files_match_their_add_actions(url, [a["add"] for a in first])
        copied = pa.table(delta_table(url, version=0).scan().read_all()).select(["id", "v"]).to_pylist()
        assert len(copied) == ROWS and {r["id"]: r["v"] for r in copied}[10] == "before the copy"
        consume(dsn, target)   # the changes committed during the copy (after the first run's goal)
        assert_equal_to_source(conn, url)
        # changes to the copied rows: found through the index built from the workers' files
        conn.execute("DELETE FROM t WHERE id % 100 = 0")
        conn.execute("UPDATE t SET flag = NULL WHERE id % 7 = 0")
        consume(dsn, target)
        assert_equal_to_source(conn, url)
    finally:
        target.close()
    assert {e.path for e in table_files(url)} == referenced(url)


# a worker failing, the consumer killed ---------------------------------------------------------

def test_a_worker_losing_the_source_rolls_the_copy_back_in_one_line_and_the_copy_runs_again(
        dsn, conn, table, url, two_workers, during_the_copy, caplog):
    def terminate_a_worker(admin: psycopg.Connection) -> None:
        [(terminated,)] = admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                                        " WHERE application_name = %s ORDER BY pid LIMIT 1", (WORKER,)).fetchall()
        assert terminated

    during_the_copy(terminate_a_worker)
    target = DeltaTarget(url)
    try:
        with caplog.at_level(logging.WARNING, logger="replicator"):
            consume(dsn, target)
    finally:
        target.close()
    # one line for the failed copy; the consumer reconnected and copied the table again
    [warning] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warning.startswith("source unavailable (terminating connection due to administrator command")
    assert "\n" not in warning
    assert_equal_to_source(conn, url)
    # the failed copy's files: none committed, none left
    copy, *later = log_actions(url)
    assert copy[0]["commitInfo"]["operation"] == "CREATE OR REPLACE TABLE"
    assert len([a for a in copy if "add" in a]) == 2 and not [a for c in later for a in c if "add" in a]
    assert {e.path for e in table_files(url)} == referenced(url)


def test_a_worker_process_killed_fails_the_copy_in_one_line_and_leaves_no_file_referenced(
        dsn, conn, table, tmp_path, two_workers, during_the_copy):
    def kill_a_worker(_: psycopg.Connection) -> None:
        workers = [p for p in multiprocessing.active_children() if p.name.startswith("replicator copy worker")]
        assert len(workers) == 2, workers
        os.kill(workers[0].pid, signal.SIGKILL)

    during_the_copy(kill_a_worker)
    url = str(tmp_path / "wh")
    target = DeltaTarget(url)
    try:
        with pytest.raises(UserError) as error:
            consume(dsn, target)
        assert re.fullmatch(r"copying public\.t: copy worker [01] ended abruptly \(killed by SIGKILL: out of memory\?\);"
                            r" REPLICATOR_COPY_WORKERS=1 copies in the consumer process alone", str(error.value))
        assert not (tmp_path / "wh" / "public.t" / "_delta_log").exists()
        consume(dsn, target)   # copied again
    finally:
        target.close()
    assert_equal_to_source(conn, url)
    # what the killed copy left, no version names: VACUUM's to delete once older than the retention
    week_ago = time.time() - 8 * 24 * 3600
    for path in (tmp_path / "wh" / "public.t").iterdir():
        if path.is_file():
            os.utime(path, (week_ago, week_ago))
    maintenance.vacuum(open_storage(url))
    assert {e.path for e in table_files(url)} == referenced(url)


CONSUME = """
import sys
import replicator.targets.parallel_copy as parallel_copy
from replicator.consumer import Consumer
from replicator.targets.delta.target import DeltaTarget
parallel_copy.PARALLEL_MIN_ROWS = 1000
Consumer(sys.argv[1], "q", DeltaTarget(sys.argv[2]), name="c").run(until_caught_up=True)
"""


def copy_workers(parent: int) -> list[int]:
    """The pids of the copy worker processes `parent` started (spawned Pythons)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            command = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError):   # a process that ended meanwhile
            continue
        if ppid == parent and b"spawn_main" in command:
            pids.append(int(stat.parent.name))
    return pids


def test_a_consumer_killed_during_a_parallel_copy_leaves_no_file_and_a_restart_copies_the_table_once(
        dsn, conn, source, tmp_path, two_workers):
    conn.execute("CREATE TABLE t (id bigint PRIMARY KEY, v text, n numeric(12,2), ts timestamptz, flag boolean)")
    conn.execute("INSERT INTO t SELECT g, md5(g::text), g / 100.0, now(), g % 2 = 0 FROM generate_series(1, 400000) g")
    conn.execute("ANALYZE t")
    source.create_queue("q")
    source.add_table("q", "t")
    url = str(tmp_path / "wh")
    table_dir = tmp_path / "wh" / "public.t"
    consumer = subprocess.Popen([sys.executable, "-c", CONSUME, dsn, url], env=cli_env(dsn),
                                stderr=open(tmp_path / "consume.log", "wb"))  # noqa: SIM115
    try:
        # a worker has written the first row group of its range (200k rows): a file being written, and
        # 69k rows to go for it; the other has not got that far
        wait_until(lambda: table_dir.exists() and any(p.suffix == ".tmp" for p in table_dir.iterdir()), 120,
                   "a worker's first data file", check=lambda: consumer.poll() is None or pytest.fail(
                       (tmp_path / "consume.log").read_text()))
        workers = copy_workers(consumer.pid)
        assert len(workers) == 2, workers
        consumer.kill()
        consumer.wait()
        # the workers see their consumer gone at their next row group, delete what they wrote, and end
        wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in workers), 60, "the workers' end")
    finally:
        if consumer.poll() is None:
            consumer.kill()
            consumer.wait()
    assert sorted(p.name for p in table_dir.iterdir()) == []
    conn.execute("UPDATE t SET v = 'changed' WHERE id % 1000 = 0")
    target = DeltaTarget(url)
    try:
        consume(dsn, target)
    finally:
        target.close()
    assert_equal_to_source(conn, url)
    assert [c[0]["commitInfo"]["operation"] for c in log_actions(url)][:1] == ["CREATE OR REPLACE TABLE"]
    assert {e.path for e in table_files(url)} == referenced(url)
