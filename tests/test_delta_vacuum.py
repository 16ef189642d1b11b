"""`replicator delta vacuum`: the files no version within the retention uses are deleted, and
only those. Real PostgreSQL, the console script, a local warehouse; the tables and their old
versions read with delta-rs.

Delta's rule (VACUUM, delta.deletedFileRetentionDuration): a file is deleted once no current
version uses it and it was removed (a tombstone's deletionTimestamp) longer ago than the
retention; time travel to a version whose files are gone fails, and every later one reads.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

pytest.importorskip("deltalake")
from deltalake import DeltaTable
from deltalake.exceptions import DeltaError

from consumer_helpers import run_cli
from replicator.targets.delta import deletion_vectors
from replicator.targets.delta import log as delta_log
from replicator.targets.delta.storage import LocalStorage
from test_delta_target import (
    CRASH_DDL,
    assert_equal_to_source,
    consume_cli,
    delta_rows,
    log_commits,
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
    done = consume_cli(dsn, path)
    assert done.returncode == 0, done.stderr
    for n in range(3):   # a few rows each: files the consumer's own OPTIMIZE leaves alone
        conn.execute("UPDATE t SET cnt = cnt + 1 WHERE id %% 20 = %s", (n,))
        conn.execute("DELETE FROM t WHERE id = %s", (200 + n,))
        conn.execute("UPDATE u SET cnt = cnt + 1 WHERE k = %s", (f"k{n + 1}",))
        done = consume_cli(dsn, path)
        assert done.returncode == 0, done.stderr


def vacuum(dsn: str, path: Path, *args: str) -> str:
    done = run_cli(dsn, "delta", "vacuum", "--target", f"delta:{path}", *args)
    assert done.returncode == 0, done.stderr
    return str(done.stdout)


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

    dry = vacuum(dsn, path, "--retain", "0s", "--dry-run")
    assert "public.t: " in dry and "would be deleted" in dry, dry
    assert {d: table_files(path / d) for d in files} == files

    vacuum(dsn, path, "--retain", "0s")
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
    assert vacuum(dsn, path, "--retain", "1h").strip() == "nothing to delete"
    assert table_files(t) == files
    assert delta_rows(str(t), ["id"], before_optimize) == old_rows   # time travel within the retention
    assert "public.t: " in vacuum(dsn, path, "--retain", "0s")


def test_vacuum_deletes_a_dropped_tables_files_once_past_the_retention_and_keeps_its_log(dsn, conn, source, tmp_path):
    path = tmp_path / "wh"
    warehouse(dsn, conn, source, path)
    conn.execute("DROP TABLE u")
    done = consume_cli(dsn, path)
    assert done.returncode == 0, done.stderr
    u = path / "public.u"
    assert DeltaTable(str(u)).count() == 0 and table_files(u), "the drop left its files: time travel"
    assert vacuum(dsn, path, "--retain", "1h").strip() == "nothing to delete"
    assert "public.u: " in vacuum(dsn, path, "--retain", "0s")
    assert table_files(u) == set()
    assert [c[0]["commitInfo"]["operation"] for c in log_commits(u)][:1] == ["CREATE OR REPLACE TABLE"]
    assert_equal_to_source(conn, path, ["t"])
