"""`replicator delta vacuum`: the files no version within the retention uses are deleted, and
only those. Real PostgreSQL, the console script, a local warehouse; the tables and their old
versions read with delta-rs. The warehouses vacuum is run on are written by the consumer run in
this process (what the console script runs: the tests of the command are about vacuum); then
the consumer's own VACUUM, `consume --vacuum-every`.

Delta's rule (VACUUM, delta.deletedFileRetentionDuration): a file is deleted once no current
version uses it and it was removed (a tombstone's deletionTimestamp) longer ago than the
retention; time travel to a version whose files are gone fails, and every later one reads.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("deltalake")
from deltalake import DeltaTable
from deltalake.exceptions import DeltaError

from consumer_helpers import Daemon, forced_tick, run_cli, wait_until
from replicator.targets.delta import deletion_vectors
from replicator.targets.delta import log as delta_log
from replicator.targets.delta.storage import LocalStorage
from replicator.targets.delta.target import DeltaTarget
from test_delta_target import (
    CRASH_DDL,
    _alive,
    _position,
    assert_equal_to_source,
    consume_cli,
    consume_to_now,
    delta_rows,
    log_commits,
    referenced_files,
    table_files,
)


def current_files(table_dir: Path) -> set[str]:
    """The data and deletion vector files the table's current version uses."""
    snapshot = delta_log.load(LocalStorage(table_dir.parent), table_dir.name)
    names = set(snapshot.files)
    for add in snapshot.files.values():
        if add.get("deletionVector"):
            names.add(deletion_vectors.descriptor_file(add["deletionVector"]))
    return names


def warehouse(dsn: str, conn, source, path: Path) -> None:
    """Tables t and u copied, then batches that leave deletion vectors in their files."""
    conn.execute(CRASH_DDL)
    source.create_queue("q")
    source.add_table("q", "t")
    source.add_table("q", "u")
    consume_to_now(dsn, path)
    for n in range(3):   # a few rows each: files the consumer's own OPTIMIZE leaves alone
        conn.execute("UPDATE t SET cnt = cnt + 1 WHERE id %% 20 = %s", (n,))
        conn.execute("DELETE FROM t WHERE id = %s", (200 + n,))
        conn.execute("UPDATE u SET cnt = cnt + 1 WHERE k = %s", (f"k{n + 1}",))
        consume_to_now(dsn, path)


def vacuum(dsn: str, path: Path, *args: str) -> str:
    done = run_cli(dsn, "delta", "vacuum", "--target", f"delta:{path}", *args)
    assert done.returncode == 0, done.stderr
    return str(done.stdout)


def refused(dsn: str, path: Path, *args: str) -> str:
    """vacuum refused in one line (exit status 1): the line."""
    done = run_cli(dsn, "delta", "vacuum", "--target", f"delta:{path}", *args)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and not done.stdout, (done.stdout, done.stderr)
    return lines[0]


SHORTEST = ("--retain", "1s", "--force")   # the shortest retention vacuum takes


def vacuum_past_the_shortest(dsn: str, path: Path, table: str, *args: str) -> str:
    """vacuum with the shortest retention once the files removed by the last commit are older
    than it (a second: polled, with a deadline, on what a dry run would delete)."""
    deadline = time.monotonic() + 30
    while f"{table}: " not in vacuum(dsn, path, *SHORTEST, "--dry-run"):
        assert time.monotonic() < deadline, f"nothing of {table} to delete after 30s"
    return vacuum(dsn, path, *SHORTEST, *args)


def optimize(dsn: str, path: Path) -> None:
    done = run_cli(dsn, "delta", "optimize", "--target", f"delta:{path}", "--purge")
    assert done.returncode == 0 and "public.t: " in done.stdout, (done.stdout, done.stderr)


def test_vacuum_retaining_nothing_after_optimize_deletes_the_replaced_files_and_only_them(dsn, conn, source, tmp_path):
    path = tmp_path / "wh"
    warehouse(dsn, conn, source, path)
    t = path / "public.t"
    before_optimize = DeltaTable(str(t)).version()
    optimize(dsn, path)
    assert any(f.startswith("deletion_vector_") for f in table_files(t) - current_files(t))
    (t / "notes.txt").write_text("a user's file")   # not a name Delta writers give their files
    (t / "mine").mkdir()
    (t / "mine" / "data.csv").write_text("1\n")
    (path / "README").write_text("the warehouse")
    files = {d: table_files(path / d) for d in ("public.t", "public.u", "_replicator")}
    logs = {p for p in path.rglob("*") if "_delta_log" in p.parts}

    dry = vacuum_past_the_shortest(dsn, path, "public.t", "--dry-run")
    assert "public.t: " in dry and "would be deleted" in dry, dry
    assert {d: table_files(path / d) for d in files} == files

    vacuum(dsn, path, *SHORTEST)
    for directory, had in files.items():
        kept = table_files(path / directory)
        assert kept == current_files(path / directory) | ({"notes.txt", "mine/data.csv"} & had), directory
    assert {p for p in path.rglob("*") if "_delta_log" in p.parts} == logs
    assert (path / "README").read_text() == "the warehouse"
    assert_equal_to_source(conn, path, ["t", "u"])
    # the versions from OPTIMIZE on read; one before it needs files VACUUM deleted: the reader says so
    assert delta_rows(str(t), ["id"], before_optimize + 1) == delta_rows(str(t), ["id"])
    with pytest.raises(DeltaError, match="File not found"):
        delta_rows(str(t), ["id"], before_optimize)
    conn.execute("UPDATE t SET cnt = cnt + 1")   # and the consumer goes on
    done = consume_cli(dsn, path)
    assert done.returncode == 0, done.stderr
    assert_equal_to_source(conn, path, ["t", "u"])


def _age(directory: Path, seconds: float) -> None:
    """Makes every file of a table (not its log) look written `seconds` ago."""
    then = time.time() - seconds
    for p in directory.rglob("*"):
        if p.is_file() and "_delta_log" not in p.parts:
            os.utime(p, (then, then))


def test_vacuum_keeps_a_file_removed_within_the_retention_however_long_ago_it_was_written(dsn, conn, source, tmp_path):
    path = tmp_path / "wh"
    warehouse(dsn, conn, source, path)
    t = path / "public.t"
    _age(t, 3 * 3600)   # written three hours ago; OPTIMIZE removes them now
    before_optimize = DeltaTable(str(t)).version()
    old_rows = delta_rows(str(t), ["id"], before_optimize)
    optimize(dsn, path)
    files = table_files(t)
    assert vacuum(dsn, path, "--retain", "1h", "--force").strip() == "nothing to delete"
    assert table_files(t) == files
    assert delta_rows(str(t), ["id"], before_optimize) == old_rows   # time travel within the retention
    assert "public.t: " in vacuum_past_the_shortest(dsn, path, "public.t")


def test_vacuum_deletes_a_dropped_tables_files_once_past_the_retention_and_keeps_its_log(dsn, conn, source, tmp_path):
    path = tmp_path / "wh"
    warehouse(dsn, conn, source, path)
    conn.execute("DROP TABLE u")
    consume_to_now(dsn, path)
    u = path / "public.u"
    assert DeltaTable(str(u)).count() == 0 and table_files(u), "the drop left its files: time travel"
    assert vacuum(dsn, path, "--retain", "1h", "--force").strip() == "nothing to delete"
    assert "public.u: " in vacuum_past_the_shortest(dsn, path, "public.u")
    assert table_files(u) == set()
    assert [c[0]["commitInfo"]["operation"] for c in log_commits(u)][:1] == ["CREATE OR REPLACE TABLE"]
    assert_equal_to_source(conn, path, ["t"])


def test_a_retention_of_zero_negative_or_malformed_is_refused_in_one_line_even_forced(dsn, conn, source, tmp_path):
    path = tmp_path / "wh"
    warehouse(dsn, conn, source, path)
    optimize(dsn, path)
    before = {p: p.read_bytes() for p in path.rglob("*") if p.is_file()}
    for retain in ("0s", "0", "-5", "500ms"):
        for force in ((), ("--force",)):
            line = refused(dsn, path, "--retain", retain, *force)
            assert "the smallest accepted is 1s" in line, (retain, line)
    for retain in ("a week", "-1h", "nan", ""):
        assert "invalid duration" in refused(dsn, path, "--retain", retain, "--force")
    assert {p: p.read_bytes() for p in path.rglob("*") if p.is_file()} == before


def test_a_retention_below_a_tables_own_is_refused_unless_forced(dsn, conn, source, tmp_path):
    path = tmp_path / "wh"
    warehouse(dsn, conn, source, path)
    optimize(dsn, path)
    _age(path / "public.t", 3 * 24 * 3600)
    before = {p: p.read_bytes() for p in path.rglob("*") if p.is_file()}
    line = refused(dsn, path, "--retain", "1h")
    assert "--retain 1h is shorter than" in line and "(7d, delta.deletedFileRetentionDuration)" in line, line
    assert "--retain 7d or more, or --force" in line, line
    assert {p: p.read_bytes() for p in path.rglob("*") if p.is_file()} == before
    assert vacuum(dsn, path).strip() == "nothing to delete"   # the tables' own retention: 7 days
    assert "public.t: " in vacuum_past_the_shortest(dsn, path, "public.t")
    assert_equal_to_source(conn, path, ["t", "u"])


def test_vacuum_deletes_only_delta_named_files_directly_in_a_tables_directory(dsn, conn, source, tmp_path):
    """Delta's VACUUM deletes files no version names once past the retention; replicator's, only
    the names Delta writers give, and not in subdirectories (none is its layout)."""
    path = tmp_path / "wh"
    warehouse(dsn, conn, source, path)
    t = path / "public.t"
    orphan = "part-00000-0b8f0d2e-0000-4000-8000-000000000000-c000.snappy.parquet"   # a crashed writer's
    ours = f".{orphan}.0123456789abcdef0123456789abcdef.tmp"                         # storage.open_write's
    theirs = ["notes.tmp", ".spark-staging.tmp", f"{orphan}.tmp", f".{orphan}.crc", "sub/" + orphan,
              "_temporary/0/" + orphan, "part-00000-x.csv"]
    for name in [orphan, ours, *theirs]:
        (t / name).parent.mkdir(parents=True, exist_ok=True)
        (t / name).write_text(name)
    _age(t, 8 * 24 * 3600)
    kept = table_files(t) - {orphan, ours}
    assert "public.t: 2 files" in vacuum(dsn, path)
    assert table_files(t) == kept
    assert_equal_to_source(conn, path, ["t", "u"])


def test_a_short_forced_retention_never_deletes_the_files_a_running_copy_has_not_committed(dsn, conn, source, tmp_path,
                                                                                            monkeypatch):
    path = tmp_path / "wh"
    warehouse(dsn, conn, source, path)
    optimize(dsn, path)   # files removed: something for the short retention to delete
    from replicator.targets.delta import table as delta_table
    from replicator.targets.delta.target import DeltaTarget

    monkeypatch.setattr(delta_table, "ROW_GROUP", 10)
    monkeypatch.setattr(delta_table, "FILE_ROWS", 20)
    t = path / "public.t"
    target = DeltaTarget(str(path))
    try:   # a copy anew of t, as the consumer runs it: a file written, and one being written
        target.begin()
        table = target.tables()["public.t"]
        target.create_table(table)
        rows = [(i, f"copied {i}", i) for i in range(1, 41)]
        target.upsert(table, "R", rows[:25])
        target.upsert(table, "R", rows[25:])
        uncommitted = table_files(t) - current_files(t) - referenced_files(t)
        assert any(n.startswith("part-") for n in uncommitted) and any(n.endswith(".tmp") for n in uncommitted)
        _age(t, 3600)   # a copy that has run for an hour
        assert "public.t: " in vacuum_past_the_shortest(dsn, path, "public.t")
        assert uncommitted <= table_files(t)
        target.commit()   # a copy's transaction: no position of its own
    finally:
        target.close()
    assert delta_rows(str(t), ["id"])[1] == {(i,): {"id": i, "v": v, "cnt": c} for i, v, c in rows}


def test_a_tables_own_retention_property_is_its_floor(dsn, conn, source, tmp_path):
    path = tmp_path / "wh"
    warehouse(dsn, conn, source, path)
    optimize(dsn, path)
    DeltaTable(str(path / "public.t")).alter.set_table_properties(
        {"delta.deletedFileRetentionDuration": "interval 10 days"})
    line = refused(dsn, path, "--retain", "8d")
    assert "public.t's retention (10d, delta.deletedFileRetentionDuration)" in line and "--retain 10d or more" in line
    assert vacuum(dsn, path, "--retain", "10d").strip() == "nothing to delete"
    DeltaTable(str(path / "public.u")).alter.set_table_properties(
        {"delta.deletedFileRetentionDuration": "a while"})
    line = refused(dsn, path, "--retain", "30d")
    assert "public.u: delta.deletedFileRetentionDuration is 'a while', not an interval Delta reads" in line, line


def _readd(storage: LocalStorage, snapshot: delta_log.Snapshot, path: str, add: dict, remove: dict | None = None) -> None:
    """As another writer: the file at path removed (remove: the remove's fields beyond the path)
    and `add` added."""
    old = snapshot.files[path]
    vector = {"deletionVector": old["deletionVector"]} if old.get("deletionVector") else {}
    fields = {"deletionTimestamp": delta_log.now_ms(), **vector} if remove is None else remove
    delta_log.commit(storage, snapshot, [
        {"remove": {"path": path, "dataChange": False, "extendedFileMetadata": True, "partitionValues": {},
                    "size": old["size"], **fields}},
        {"add": add},
    ], operation="OPTIMIZE")


def test_vacuum_keeps_a_file_the_current_version_names_by_absolute_uri(dsn, conn, source, tmp_path):
    """The Delta protocol lets an add name its file by absolute URI (another writer, a clone):
    the file is in use, and vacuum compares it with the listing relative to the table, as Delta's
    VACUUM does."""
    path = tmp_path / "wh"
    warehouse(dsn, conn, source, path)
    t = path / "public.t"
    storage = LocalStorage(path)
    snapshot = delta_log.load(storage, "public.t")
    source_path, add = next(iter(sorted(snapshot.files.items())))
    name = f"part-00000-{uuid.uuid4()}-c000.snappy.parquet"
    shutil.copy(t / source_path, t / name)
    _readd(storage, snapshot, source_path, {**add, "path": (t / name).as_uri()})
    rows = delta_rows(str(t), ["id"])
    _age(t, 8 * 24 * 3600)   # the files were written more than 7 days ago
    vacuum(dsn, path)        # the tables' own retention, 7 days: nothing removed is past it
    assert name in table_files(t), "vacuum deleted a file the current version uses"
    assert delta_rows(str(t), ["id"]) == rows


def test_vacuum_keeps_a_deletion_vector_the_current_version_names_by_absolute_uri(dsn, conn, source, tmp_path):
    """A deletion vector of storageType 'p' is named by absolute URI: it is in use too."""
    path = tmp_path / "wh"
    warehouse(dsn, conn, source, path)
    t = path / "public.t"
    storage = LocalStorage(path)
    snapshot = delta_log.load(storage, "public.t")
    file, add = next((p, a) for p, a in sorted(snapshot.files.items()) if a.get("deletionVector"))
    vector = add["deletionVector"]
    dv_file = deletion_vectors.descriptor_file(vector)
    absolute = {**vector, "storageType": "p", "pathOrInlineDv": (t / dv_file).as_uri()}
    _readd(storage, snapshot, file, {**add, "deletionVector": absolute},
           {"deletionTimestamp": delta_log.now_ms()})   # the remove names no vector: the 'p' one only
    _age(t, 8 * 24 * 3600)
    vacuum(dsn, path)
    assert dv_file in table_files(t), "vacuum deleted a deletion vector the current version uses"


def test_vacuum_stops_in_one_line_deleting_nothing_when_the_log_names_a_file_outside_the_table(dsn, conn, source,
                                                                                               tmp_path):
    """A path that leaves the table (another table's file by URI, a '..') cannot be compared with
    the table's listing: vacuum says so and deletes nothing, anywhere."""
    path = tmp_path / "wh"
    warehouse(dsn, conn, source, path)
    optimize(dsn, path)
    storage = LocalStorage(path)
    u = delta_log.load(storage, "public.u")
    elsewhere = next(iter(u.files))
    snapshot = delta_log.load(storage, "public.t")
    source_path, add = next(iter(sorted(snapshot.files.items())))
    _readd(storage, snapshot, source_path, {**add, "path": (path / "public.u" / elsewhere).as_uri()})
    files = {d: table_files(path / d) for d in ("public.t", "public.u", "_replicator")}
    line = refused(dsn, path, *SHORTEST)
    assert "public.t" in line and elsewhere in line and "nothing vacuumed" in line, line
    assert {d: table_files(path / d) for d in files} == files


def test_a_forced_vacuum_on_s3_keeps_a_file_the_current_version_names_by_absolute_uri(dsn, conn, source, s3_url):
    """Another writer re-adds a file by its absolute s3:// URI: the current version uses it; even
    the shortest forced retention only costs time travel, never the current version."""
    from replicator.targets.delta.object_storage import ObjectStorage
    from test_delta_s3 import consume_cli as consume_s3
    from test_delta_s3 import delta_rows as s3_rows

    conn.execute(CRASH_DDL)
    source.create_queue("q")
    source.add_table("q", "t")
    done = consume_s3(dsn, s3_url)
    assert done.returncode == 0, done.stderr
    storage = ObjectStorage(s3_url)
    snapshot = delta_log.load(storage, "public.t")
    name, add = next(iter(sorted(snapshot.files.items())))
    removed_at = delta_log.now_ms()
    delta_log.commit(storage, snapshot, [
        {"remove": {"path": name, "deletionTimestamp": removed_at, "dataChange": False,
                    "extendedFileMetadata": True, "partitionValues": {}, "size": add["size"]}},
        {"add": {**add, "path": f"{s3_url}/public.t/{name}", "dataChange": False}},
    ], operation="RESTORE")
    rows = s3_rows(s3_url, "public.t", ["id"])
    while True:   # until a vacuum started once the remove was older than the shortest retention (1s)
        started = time.time()
        done = run_cli(dsn, "delta", "vacuum", "--target", f"delta:{s3_url}", *SHORTEST)
        assert done.returncode == 0, done.stderr
        if "public.t: " in done.stdout or started > removed_at / 1000 + 1:
            break
    assert storage.exists(f"public.t/{name}"), f"vacuum deleted a file the current version uses: {done.stdout}"
    assert s3_rows(s3_url, "public.t", ["id"]) == rows


@pytest.mark.parametrize("stamp", [{}, {"deletionTimestamp": 0}], ids=["absent", "another-writers-clock-at-0"])
def test_vacuum_keeps_a_file_removed_just_now_whose_remove_has_no_or_a_skewed_timestamp(dsn, conn, source, tmp_path,
                                                                                        stamp):
    """deletionTimestamp is optional and comes from another writer's clock: as Delta's VACUUM,
    vacuum also keeps a file whose own modification time is within the retention, and takes a
    remove without a timestamp as made now."""
    path = tmp_path / "wh"
    warehouse(dsn, conn, source, path)
    t = path / "public.t"
    storage = LocalStorage(path)
    snapshot = delta_log.load(storage, "public.t")
    first, add = next(iter(sorted(snapshot.files.items())))
    written = f"part-00000-{uuid.uuid4()}-c000.snappy.parquet"
    shutil.copy(t / first, t / written)
    _readd(storage, snapshot, first, {**add, "path": written, "dataChange": False})
    before = snapshot.version
    rows = delta_rows(str(t), ["id"], before)
    again = f"part-00000-{uuid.uuid4()}-c000.snappy.parquet"   # the file just written, rewritten again
    shutil.copy(t / written, t / again)
    vector = {"deletionVector": add["deletionVector"]} if add.get("deletionVector") else {}
    _readd(storage, snapshot, written, {**add, "path": again, "dataChange": False}, {**vector, **stamp})
    vacuum(dsn, path)   # no --retain, no --force: the tables' 7 days
    assert written in table_files(t), "vacuum deleted a file written and removed a moment ago"
    assert delta_rows(str(t), ["id"], before) == rows   # time travel within the retention


def test_a_tables_retention_property_under_a_second_is_refused_in_one_line(dsn, conn, source, tmp_path):
    """docs/delta.md: a retention under 1s is refused always, a table's own
    delta.deletedFileRetentionDuration too (0 would delete what the last commit removed, under
    any reader of the previous version); a --retain of 1s or more, forced, is taken instead."""
    path = tmp_path / "wh"
    warehouse(dsn, conn, source, path)
    t = path / "public.t"
    before_optimize = DeltaTable(str(t)).version()
    optimize(dsn, path)
    DeltaTable(str(t)).alter.set_table_properties({"delta.deletedFileRetentionDuration": "interval 0 seconds"})
    files = table_files(t)
    line = refused(dsn, path)
    assert "public.t: delta.deletedFileRetentionDuration is 'interval 0 seconds', under the 1s" in line, line
    assert table_files(t) == files
    delta_rows(str(t), ["id"], before_optimize)   # the version just replaced still reads
    assert "public.t: " in vacuum_past_the_shortest(dsn, path, "public.t")


# the consumer's own VACUUM: consume --vacuum-every -----------------------------------------------

def test_a_consumer_with_vacuum_every_deletes_the_files_removed_past_their_tables_retention_and_only_them(
        dsn, conn, source, tmp_path):
    """The first VACUUM comes at the start, after the first step: t's removed files, past t's own
    retention of 1s, go; u's stay (its retention is 7 days)."""
    path = tmp_path / "wh"
    warehouse(dsn, conn, source, path)
    optimize(dsn, path)   # the files with deletion vectors of t and u rewritten: the old ones removed
    optimized = time.time()
    t, u = path / "public.t", path / "public.u"
    DeltaTable(str(t)).alter.set_table_properties({"delta.deletedFileRetentionDuration": "interval 1 seconds"})
    removed = {name: (t / name).stat().st_size for name in table_files(t) - current_files(t)}
    u_files = table_files(u)
    assert removed and u_files - current_files(u)
    # the first VACUUM comes at once: t's removed files past its retention by then (time is the condition)
    wait_until(lambda: time.time() - optimized > 1.5, 10, "t's removed files past its retention of 1s")
    daemon = Daemon(dsn, "consume", "q", "--target", f"delta:{path}", "--vacuum-every", "1min",
                    "--poll-interval", "0.05", log=tmp_path / "consume.log")
    try:
        line = wait_until(lambda: next((x for x in daemon.log().splitlines() if "vacuum" in x), None), 60,
                          "the consumer's first VACUUM", check=lambda: _alive(daemon))
        assert f"INFO vacuum deleted {len(removed)} files ({sum(removed.values()):,} bytes) of 1 table in " in line, \
            daemon.log()
        assert table_files(t) == current_files(t)
        assert table_files(u) == u_files
        conn.execute("UPDATE t SET cnt = cnt + 1 WHERE id <= 5")   # and the consumer goes on
        tick = forced_tick(conn)
        wait_until(lambda: _position(path) >= tick, 60, f"tick {tick} applied", check=lambda: _alive(daemon))
        assert daemon.terminate() == 0, daemon.log()
    finally:
        daemon.stop()
    assert_equal_to_source(conn, path, ["t", "u"])


def named_files(table_dir: Path) -> set[str]:
    """The files the table's log names: its current version's and its removes' (of its last
    checkpoint and the commits after it)."""
    snapshot = delta_log.load(LocalStorage(table_dir.parent), table_dir.name, tombstones=True)
    assert snapshot.tombstones is not None
    names = set()
    for action in [*snapshot.files.values(), *snapshot.tombstones.values()]:
        names.add(action["path"])
        if action.get("deletionVector"):
            names.add(deletion_vectors.descriptor_file(action["deletionVector"]))
    return names


def test_a_consumer_with_vacuum_every_deletes_the_removed_files_its_checkpoint_forgets(dsn, conn, source, tmp_path):
    """delta-rs' checkpoint leaves out the removes past the table's retention: the consumer deletes
    their files then, as vacuum would, where vacuum would have found them named by no log and kept
    them 7 days whatever the retention (issue 31's soak: the warehouse held 7 days of them)."""
    path = tmp_path / "wh"
    warehouse(dsn, conn, source, path)
    t = path / "public.t"
    DeltaTable(str(t)).alter.set_table_properties({"delta.deletedFileRetentionDuration": "interval 1 seconds"})
    checkpoints = {name for name in os.listdir(t / "_delta_log") if ".checkpoint." in name}
    daemon = Daemon(dsn, "consume", "q", "--target", f"delta:{path}", "--vacuum-every", "1h",
                    "--poll-interval", "0.05", log=tmp_path / "consume.log")
    try:
        wait_until(lambda: "INFO vacuum deleted" in daemon.log(), 60, "the consumer's first VACUUM",
                   check=lambda: _alive(daemon))

        def batch(n: int) -> None:   # one commit of t: a deletion vector replaced, the old one removed
            conn.execute("UPDATE t SET cnt = cnt + 1 WHERE id %% 20 = %s", (n % 20,))
            tick = forced_tick(conn)
            wait_until(lambda: _position(path) >= tick, 60, f"tick {tick} applied", check=lambda: _alive(daemon))

        for n in range(3):
            batch(n)
        removed = table_files(t) - current_files(t)
        assert removed
        removed_at = time.time()
        wait_until(lambda: time.time() - removed_at > 1.5, 10, "their removes past t's retention of 1s")
        n = 3
        while not {name for name in os.listdir(t / "_delta_log") if ".checkpoint." in name} - checkpoints:
            assert n < 3 + 2 * delta_log.CHECKPOINT_EVERY, "no checkpoint of t"
            batch(n)
            n += 1
        batch(n)   # applied after the checkpoint's vacuum ended (one step at a time)
        assert not removed & table_files(t), daemon.log()
        assert table_files(t) <= named_files(t)
        assert daemon.terminate() == 0, daemon.log()
    finally:
        daemon.stop()
    assert_equal_to_source(conn, path, ["t", "u"])


def test_a_scheduled_vacuum_that_fails_is_one_warning_and_runs_again_an_interval_later(dsn, conn, source, tmp_path,
                                                                                       caplog):
    """Between batches (DeltaTarget.tend, which the run loop calls after each step): a VACUUM
    refused (here, a table's retention property no interval) costs only space."""
    path = tmp_path / "wh"
    warehouse(dsn, conn, source, path)
    optimize(dsn, path)
    t = path / "public.t"
    DeltaTable(str(t)).alter.set_table_properties({"delta.deletedFileRetentionDuration": "a while"})
    files = table_files(t)
    assert files - current_files(t)
    caplog.set_level(logging.INFO, logger="replicator")
    target = DeltaTarget(str(path), vacuum_every=0.05)

    def vacuumed() -> list[logging.LogRecord]:
        target.tend()
        return [r for r in caplog.records if "vacuum" in r.getMessage()]

    try:
        [failed] = wait_until(vacuumed, 30, "the first VACUUM")
        assert failed.levelno == logging.WARNING and failed.getMessage() == (
            "vacuum failed (the consumer goes on; tried again in 50ms): public.t: delta.deletedFileRetentionDuration "
            "is 'a while', not an interval Delta reads (e.g. 'interval 7 days'): correct the table's property")
        assert table_files(t) == files
        DeltaTable(str(t)).alter.set_table_properties({"delta.deletedFileRetentionDuration": "interval 1 seconds"})
        caplog.clear()
        # again each interval: the files removed by the OPTIMIZE are past t's retention within a second
        wait_until(lambda: vacuumed() and table_files(t) == current_files(t), 30, "t's removed files deleted")
        runs = [(r.levelno, r.getMessage()) for r in caplog.records]
        assert runs and all(level == logging.INFO and message.startswith("vacuum deleted ")
                            for level, message in runs), runs
    finally:
        target.close()
    conn.execute("UPDATE t SET cnt = cnt + 1")
    consume_to_now(dsn, path)
    assert_equal_to_source(conn, path, ["t", "u"])


@pytest.mark.parametrize(("target", "every", "error"), [
    ("sqlite:{path}/replica.db", "1h", "--vacuum-every applies to a delta: target only"),
    ("jsonl:{path}/out.jsonl", "1h", "--vacuum-every applies to a delta: target only"),
    ("delta:{path}/wh", "59s", "--vacuum-every 59s is too often: the shortest accepted is 1min"),
    ("delta:{path}/wh", "0", "--vacuum-every 0s is too often: the shortest accepted is 1min"),
    ("delta:{path}/wh", "-1h", "invalid duration '-1h'"),
    ("delta:{path}/wh", "daily", "invalid duration 'daily'"),
])
def test_a_vacuum_every_for_another_target_or_too_often_is_refused_in_one_line(dsn, tmp_path, target, every, error):
    """Before the source or the target is opened: nothing created."""
    url = target.format(path=tmp_path)
    for what in (["q"], ["--source", "kafka://localhost:9/shop"]):   # a consumer of a queue; a follower
        done = run_cli(dsn, "consume", *what, "--target", url, "--vacuum-every", every)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 1 and len(lines) == 1 and error in lines[0], (done.stdout, done.stderr)
    assert list(tmp_path.iterdir()) == []
