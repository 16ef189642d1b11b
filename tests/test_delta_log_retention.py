"""A Delta warehouse's logs kept for the time-travel window, and no longer: every version a
reader may travel to within it reads (delta-rs, replicator's versions_as_of), the older ones
are gone; and the commands that read the warehouse exit 0 after they succeed.

Real PostgreSQL, the real consumer and the `replicator` console script, local warehouses.
Commits are aged by running the consumer with its clock (commit timestamps, _replicator's
committed_at) in the past and setting its log files' modification times to match: the time
Delta's log cleanup goes by for a commit without an in-commit timestamp.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

pytest.importorskip("deltalake")
from deltalake import DeltaTable
from deltalake.exceptions import DeltaError

from consumer_helpers import run_cli
from replicator.targets.delta import log as delta_log
from replicator.targets.delta import maintenance
from replicator.targets.delta.object_storage import ObjectStorage
from replicator.targets.delta.reader import versions_as_of
from replicator.targets.delta.state import WarehouseState
from replicator.targets.delta.storage import LocalStorage
from replicator.targets.delta.target import DeltaTarget
from test_delta_target import CRASH_DDL, consume, consume_to_now, delta_rows, diff, source_state

DAY = 86400.0
TABLES = ("public.t", "public.u", "_replicator")


def _age_new_log_files(path: Path, when: float) -> None:
    """The log files written since `when` (those the last batch wrote) made as old as `when`."""
    for log_file in path.glob("*/_delta_log/*"):
        if log_file.stat().st_mtime > when:
            os.utime(log_file, (when, when))


def _versions(path: Path) -> dict[str, int]:
    return {table: delta_log.load(LocalStorage(path), table).version for table in TABLES}


def _readable(uri: str, version: int) -> bool:
    try:
        DeltaTable(uri, version=version)
    except DeltaError:
        return False
    return True


def _as_of(path: Path, tick: int, states: dict[str, Any]) -> list[str]:
    """How each table read at the version tick `tick` left it differs from the source then."""
    versions = versions_as_of(str(path), tick)
    problems = []
    for name in ("t", "u"):
        uri, version = versions[f"public.{name}"]
        problems += diff(f"{name}@{tick}", states[name], delta_rows(uri, [states[name][0][0]], version))
    return problems


def test_every_version_within_the_log_retention_reads_and_older_ones_are_gone(dsn, conn, source, tmp_path,
                                                                             monkeypatch):
    """Batches 10 days ago (before the 7-day window), 3 days ago and now; then `replicator delta
    vacuum`. Every version from the one current at the window's start on reads, with delta-rs
    and as of each tick of the window; the versions before it are gone; _replicator's rows
    before the window are down to the newest of each table; a killed writer's temporary file
    in a log is gone once old."""
    monkeypatch.setattr(delta_log, "CHECKPOINT_EVERY", 4)
    monkeypatch.setattr(maintenance, "SMALL_FILES_DUE", 3)
    conn.execute(CRASH_DDL)
    source.create_queue("q")
    source.add_table("q", "t")
    source.add_table("q", "u")
    path = tmp_path / "wh"
    clock = [0.0]
    monkeypatch.setattr(delta_log, "now_ms", lambda: int(clock[0] * 1000))
    ticks: list[tuple[int, int, dict[str, Any]]] = []   # (age in days, tick, source states)
    latest: dict[int, dict[str, int]] = {}              # age in days → the versions its last batch left
    target = DeltaTarget(str(path))
    try:
        for age, batches in ((10, 6), (3, 6), (0, 3)):
            for n in range(batches):
                clock[0] = time.time() - age * DAY + n * 60
                with conn.transaction():
                    conn.execute("UPDATE t SET cnt = cnt + 1 WHERE id %% 5 = %s", (n % 5,))
                    conn.execute("DELETE FROM t WHERE id = %s", (age * 10 + n + 1,))
                    conn.execute("UPDATE u SET cnt = cnt + 1 WHERE k = %s", (f"k{n + 1}",))
                consume(dsn, target)
                if age:
                    _age_new_log_files(path, clock[0])
                [tick] = target.positions("q").values()
                ticks.append((age, tick, {name: source_state(conn, name) for name in ("t", "u")}))
                latest[age] = _versions(path)
    finally:
        target.close()
    stale = path / "public.t" / "_delta_log" / f".{0:020d}.json.{'0' * 32}.tmp"   # a killed writer's
    fresh = path / "public.t" / "_delta_log" / f".{1:020d}.json.{'1' * 32}.tmp"   # one being written
    stale.write_bytes(b"{}")
    fresh.write_bytes(b"{}")
    os.utime(stale, (time.time() - DAY, time.time() - DAY))
    done = run_cli(dsn, "delta", "vacuum", "--target", f"delta:{path}")
    assert done.returncode == 0, done.stderr

    start = ticks[5]   # the tick current at the window's start, then those within it
    recorded = {f"{name}": version for name, (_, version) in versions_as_of(str(path), start[1]).items()}
    for table in TABLES:   # kept: the version current 7 days ago, and the one the window's first tick reads
        uri = str(path / table)
        oldest, newest = min(latest[10][table], recorded.get(table, latest[10][table])), latest[0][table]
        unreadable = [v for v in range(oldest, newest + 1) if not _readable(uri, v)]
        assert not unreadable, f"{table}: versions {unreadable} within the window do not read"
        # gone: those below the newest checkpoint at or before it (a reader starts there)
        base = max(v for v in delta_log.checkpoints(p.name for p in (path / table / "_delta_log").iterdir())
                   if v <= oldest)
        assert base > 0 and not [v for v in range(base) if _readable(uri, v)], (table, oldest, base)
        assert DeltaTable(uri).metadata().configuration.get("delta.logRetentionDuration") == "interval 7 days"
    for _, tick, states in [start, *ticks[6:]]:
        problems = _as_of(path, tick, states)
        assert not problems, "\n".join(problems[:20])
    rows = pa.table(DeltaTable(str(path / "_replicator")).scan().read_all()).to_pylist()
    before = sorted((r["directory"], r["tick"]) for r in rows if r["tick"] <= start[1])
    assert before == [("public.t", start[1]), ("public.u", start[1])]
    assert not stale.exists() and fresh.exists()


def test_a_log_with_checkpoints_and_no_last_checkpoint_file_is_read_from_its_newest_checkpoint(dsn, conn, source,
                                                                                              tmp_path, monkeypatch):
    """_last_checkpoint is optional (PROTOCOL.md): a reader finds the checkpoints by listing."""
    monkeypatch.setattr(delta_log, "CHECKPOINT_EVERY", 3)
    conn.execute(CRASH_DDL)
    source.create_queue("q")
    source.add_table("q", "t")
    path = tmp_path / "wh"
    target = DeltaTarget(str(path))
    try:
        for n in range(7):
            conn.execute("UPDATE t SET cnt = cnt + 1 WHERE id %% 7 = %s", (n,))
            consume(dsn, target)
    finally:
        target.close()
    storage = LocalStorage(path)
    for table in ("public.t", "_replicator"):   # the log before the newest checkpoint gone too
        maintenance.clean_log(storage, delta_log.load(storage, table), retention=0)
        (path / table / "_delta_log" / "_last_checkpoint").unlink()
        assert not (path / table / "_delta_log" / f"{0:020d}.json").exists()
    conn.execute("UPDATE t SET cnt = cnt + 1")
    target = DeltaTarget(str(path))
    try:
        consume(dsn, target)
    finally:
        target.close()
    assert not diff("t", source_state(conn, "t"), delta_rows(str(path / "public.t"), ["id"]))


def test_delta_tables_with_a_tick_and_delta_optimize_exit_0_every_time(dsn, conn, source, tmp_path):
    """delta-rs' to_pyarrow_table() aborted the process at its exit now and then (status 134,
    'terminate called without an active exception') after it printed its output: 22 times in 80
    for a script calling it alone, 2 in 40 for `versions_as_of` on a loaded machine. A few runs
    (each a process start, seconds on a busy machine) catch it only sometimes."""
    conn.execute(CRASH_DDL)
    source.create_queue("q")
    source.add_table("q", "t")
    source.add_table("q", "u")
    path = tmp_path / "wh"
    consume_to_now(dsn, path)   # the commands' exits are the test
    [tick] = WarehouseState(LocalStorage(path)).positions().values()
    commands = [("delta", "tables", "--target", f"delta:{path}", "--tick", str(tick), "--json"),
                ("delta", "optimize", "--target", f"delta:{path}")]
    runs = [commands[n % 2] for n in range(6)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda args: run_cli(dsn, *args), runs))
    failed = [(args[1], r.returncode, r.stderr[-300:]) for args, r in zip(runs, results, strict=True) if r.returncode]
    assert not failed


def test_log_cleanup_on_object_storage_writes_the_checkpoint_it_keeps_and_deletes_only_below(
        dsn, conn, source, s3_url, monkeypatch):
    """On S3 (moto) through the warehouse's storage: keeping version 2 of a log whose first
    checkpoint is later writes one at 2 (delta-rs), and deletes versions 0 and 1 only."""
    monkeypatch.setattr(delta_log, "CHECKPOINT_EVERY", 4)
    conn.execute(CRASH_DDL)
    source.create_queue("q")
    source.add_table("q", "t")
    target = DeltaTarget(s3_url)
    try:
        for n in range(6):
            conn.execute("UPDATE t SET cnt = cnt + 1 WHERE id %% 6 = %s", (n,))
            consume(dsn, target)
    finally:
        target.close()
    storage = ObjectStorage(s3_url)
    snapshot = delta_log.load(storage, "public.t")
    assert min(delta_log.checkpoints(delta_log.log_names(storage, "public.t"))) > 2
    deleted = maintenance.clean_log(storage, snapshot, retention=0, keep=2)
    names = delta_log.log_names(storage, "public.t")
    assert deleted == 2 and f"{2:020d}.checkpoint.parquet" in names
    assert sorted(n for n in names if n.endswith(".json"))[0] == f"{2:020d}.json"
    root, options = storage.delta_rs()
    for version in range(snapshot.version + 1):
        try:
            DeltaTable(f"{root}/public.t", version=version, storage_options=options)
            readable = True
        except DeltaError:
            readable = False
        assert readable == (version >= 2), version
    assert delta_log.load(storage, "public.t").files == snapshot.files


def test_log_cleanup_goes_by_in_commit_timestamps_where_another_writer_enabled_them(tmp_path):
    """A table whose commits carry in-commit timestamps (delta-rs' commits, made so as Spark
    writes them: commitInfo first, the feature in the protocol): versions 0-3 stamped 10 days
    ago, 4-5 now, every file 10 days old. The 7-day log retention keeps from version 3 (from
    the checkpoint at 2), whatever the files' times say."""
    from deltalake import write_deltalake

    uri = tmp_path / "t"
    for n in range(6):
        write_deltalake(str(uri), pa.table({"a": [n]}), mode="append")
    old, now = int((time.time() - 10 * DAY) * 1000), int(time.time() * 1000)
    for version in range(6):
        commit = uri / "_delta_log" / f"{version:020d}.json"
        actions = [json.loads(line) for line in commit.read_text().splitlines()]
        for action in actions:
            if "commitInfo" in action:
                action["commitInfo"]["inCommitTimestamp"] = (old if version <= 3 else now) + version
            if "protocol" in action:
                action["protocol"] = {"minReaderVersion": 1, "minWriterVersion": 7,
                                      "writerFeatures": ["inCommitTimestamp"]}
            if "metaData" in action:
                action["metaData"]["configuration"] = {"delta.enableInCommitTimestamps": "true",
                                                       "delta.logRetentionDuration": "interval 7 days"}
        actions.sort(key=lambda action: "commitInfo" not in action)
        commit.write_text("".join(json.dumps(action) + "\n" for action in actions))
    for version in (2, 5):
        DeltaTable(str(uri), version=version).create_checkpoint()
    for log_file in (uri / "_delta_log").iterdir():
        os.utime(log_file, (old / 1000, old / 1000))
    storage = LocalStorage(tmp_path)
    maintenance.clean_log(storage, delta_log.load(storage, "t"))
    assert [v for v in range(6) if _readable(str(uri), v)] == [2, 3, 4, 5]
