"""A Delta commit whose call failed after its file may have landed: the version is read back
and the commit finished when it is ours; when that cannot be told, nothing a version may refer
to is deleted. Then the tables stay readable and, after a restart, equal to the source.

Real PostgreSQL, real files and the S3 server (moto); the faults are injected into the
project's own storage: the log directory's fsync after the hard link fails (EIO), the commit
file cannot be read back, an S3 conditional PUT lands and its answer is lost.
"""

from __future__ import annotations

import errno
import json
import math
import os
import random
import re
import shutil
import struct
import time
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyroaring import BitMap

pytest.importorskip("deltalake")

from consumer_helpers import forced_tick
from replicator.consumer import Consumer
from replicator.errors import UserError
from replicator.targets import parallel_copy
from replicator.targets.delta import deletion_vectors, maintenance
from replicator.targets.delta import log as delta_log
from replicator.targets.delta import storage as local_storage
from replicator.targets.delta.object_storage import ObjectStorage
from replicator.targets.delta.reader import table_uris
from replicator.targets.delta.storage import LocalStorage
from replicator.targets.delta.target import DeltaTarget
from replicator.targets.delta.view_table import ViewTable, view_directory
from test_delta_target import (
    CRASH_DDL,
    _commit_by_hand,
    _one_batch_of_changes,
    assert_equal_to_source,
    delta_rows,
    log_commits,
    referenced_files,
    table_files,
    txn_commits,
)

KEYS = {"public.t": ["id"], "public.u": ["k"]}


def consume(dsn: str, url: str) -> None:
    """The consumer, in this process, up to the queue's latest tick; its target closed after."""
    target = DeltaTarget(url)
    consumer = Consumer(dsn, "q", target, name="c")
    try:
        consumer.run(until_caught_up=True)
    finally:
        consumer.close()
        target.close()


def start(conn: Any, source: Any, dsn: str, url: str) -> None:
    """Tables t and u copied, then a batch changing both waiting in the queue."""
    conn.execute(CRASH_DDL)
    source.create_queue("q")
    source.add_table("q", "t")
    source.add_table("q", "u")
    consume(dsn, url)
    _one_batch_of_changes(conn, 0)
    forced_tick(conn)


class Fault:
    """Fires once, for the commit files of one table's log."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self.fired = 0

    def due(self, path: str) -> bool:
        if self.fired or not path.rstrip("/").endswith(self.log_dir):
            return False
        self.fired += 1
        return True


def consume_with_fault(dsn: str, url: str) -> str:
    """'committed' when the consumer finished the batch, else (the name of) the failure it stopped on."""
    try:
        consume(dsn, url)
    except (OSError, UserError) as exc:
        return type(exc).__name__
    return "committed"


def assert_every_referenced_file_exists(path: Path) -> None:
    for name, uri in [*table_uris(str(path)).items(), ("_replicator", str(path / "_replicator"))]:
        missing = referenced_files(Path(uri)) - table_files(Path(uri))
        assert not missing, f"{name}: its log refers to files that were deleted: {sorted(missing)}"


def assert_readable(path: Path) -> None:
    for name, uri in table_uris(str(path)).items():
        delta_rows(uri, KEYS[name])


def failing_fsync(monkeypatch: pytest.MonkeyPatch, fault: Fault) -> None:
    """The log directory's fsync after the link fails (EIO), once."""
    real = local_storage._fsync_dir

    def fsync_dir(where: Path) -> None:
        if fault.due(where.as_posix()):
            raise OSError(errno.EIO, "Input/output error")
        real(where)

    monkeypatch.setattr(local_storage, "_fsync_dir", fsync_dir)


def test_a_commit_linked_whose_directory_fsync_fails_is_not_taken_for_written(tmp_path, monkeypatch):
    """What reads back after a failed fsync is the page cache: the entry may never reach the disk."""
    storage = LocalStorage(tmp_path)
    fault = Fault("t/_delta_log")
    failing_fsync(monkeypatch, fault)
    with pytest.raises(local_storage.NotDurable):
        storage.put_if_absent("t/_delta_log/00000000000000000000.json", b"{}")
    assert fault.fired == 1


@pytest.mark.parametrize(("directory", "on_disk"), [("public.t", True), ("public.t", False), ("_replicator", True),
                                                    ("_replicator", False)])
def test_a_commit_whose_directory_fsync_fails_stops_the_consumer_and_a_restart_completes_the_batch(
        dsn, conn, source, tmp_path, monkeypatch, directory, on_disk):
    """The consumer stops with the batch unacknowledged and its files kept; after a crash the
    commit's entry is there or not (on_disk): either way the restart ends equal to the source,
    each batch committed once."""
    path = tmp_path / "wh"
    start(conn, source, dsn, str(path))
    fault = Fault(f"{directory}/_delta_log")
    with monkeypatch.context() as patched:
        failing_fsync(patched, fault)
        outcome = consume_with_fault(dsn, str(path))
    assert (fault.fired, outcome) == (1, "CommitUnknown")
    assert_every_referenced_file_exists(path)
    assert_readable(path)
    if not on_disk:   # the crash lost the entry: the version is absent, its files unreferenced
        log_dir = Path(table_uris(str(path)).get(directory, path / directory)) / "_delta_log"
        max(log_dir.glob("*.json")).unlink()
    consume(dsn, str(path))
    assert_every_referenced_file_exists(path)
    assert_equal_to_source(conn, path, ["t", "u"])
    for name, uri in table_uris(str(path)).items():
        ticks = txn_commits(Path(uri), "q/c")
        assert len(ticks) == len(set(ticks)), (name, ticks)


def test_vacuum_deletes_a_views_full_refresh_files_no_version_names_once_past_the_retention(dsn, conn, source,
                                                                                            tmp_path):
    """A view's full refresh writes its files into full-<uuid>/ of the view's table: when its
    commit's outcome was unknown and it did not land, nothing else deletes them."""
    path = tmp_path / "wh"
    start(conn, source, dsn, str(path))
    replica = Path(table_uris(str(path))["public.t"])
    view = path / view_directory("v")
    shutil.copytree(replica, view)   # a Delta table under _views, as a view's
    orphan = "part-00000-0b8f0d2e-0000-4000-8000-000000000000-c000.snappy.parquet"
    old, young = f"full-{uuid.uuid4()}/{orphan}", f"full-{uuid.uuid4()}/{orphan}"
    placed = [view / old, view / young, view / "sub" / orphan, replica / old]
    for file in placed:
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text("rows")
        if file != view / young:
            then = time.time() - 8 * 24 * 3600
            os.utime(file, (then, then))
    vacuumed = {v.table: v.files for v in maintenance.vacuum(LocalStorage(path))}
    assert vacuumed.get(view_directory("v")) == 1, vacuumed
    assert [f.exists() for f in placed] == [False, True, True, True]
    assert_readable(path)


def landed_then_unreadable(monkeypatch: pytest.MonkeyPatch, directory: str) -> tuple[Fault, Fault]:
    """The next commit of the table at `directory` lands, then its call fails (EIO), and so does
    reading it back once."""
    written, unreadable = Fault(f"{directory}/_delta_log"), Fault(f"{directory}/_delta_log")
    put_if_absent, read = LocalStorage.put_if_absent, LocalStorage.read

    def landed_then_failed(self: LocalStorage, where: str, data: bytes) -> bool:
        done = put_if_absent(self, where, data)
        if done and written.due(where.rsplit("/", 1)[0]):
            raise OSError(errno.EIO, "Input/output error")
        return done

    def read_failing_once(self: LocalStorage, where: str) -> bytes:
        if written.fired and where.endswith(".json") and unreadable.due(where.rsplit("/", 1)[0]):
            raise OSError(errno.EIO, "Input/output error")
        return read(self, where)

    monkeypatch.setattr(LocalStorage, "put_if_absent", landed_then_failed)
    monkeypatch.setattr(LocalStorage, "read", read_failing_once)
    return written, unreadable


@pytest.mark.parametrize("directory", ["public.t", "_replicator"])
def test_a_commit_whose_outcome_cannot_be_read_back_deletes_nothing_and_a_restart_completes_the_batch(
        dsn, conn, source, tmp_path, monkeypatch, directory):
    path = tmp_path / "wh"
    start(conn, source, dsn, str(path))
    written, unreadable = landed_then_unreadable(monkeypatch, directory)
    outcome = consume_with_fault(dsn, str(path))
    monkeypatch.undo()
    assert written.fired == 1
    assert_every_referenced_file_exists(path)
    assert_readable(path)
    assert (unreadable.fired, outcome) == (1, "CommitUnknown")
    consume(dsn, str(path))   # started again: the batch completed (a table holding it skips it)
    assert_every_referenced_file_exists(path)
    assert_equal_to_source(conn, path, ["t", "u"])
    for name, uri in table_uris(str(path)).items():
        ticks = txn_commits(Path(uri), "q/c")
        assert len(ticks) == len(set(ticks)), (name, ticks)   # each batch committed once


def test_a_parallel_copy_whose_commit_cannot_be_read_back_keeps_its_files_and_a_restart_copies_again(
        dsn, conn, source, tmp_path, monkeypatch):
    conn.execute("CREATE TABLE t (id bigint PRIMARY KEY, v text)")
    conn.execute("INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 5000) g")
    conn.execute("ANALYZE t")
    source.create_queue("q")
    source.add_table("q", "t")
    monkeypatch.setattr(parallel_copy, "PARALLEL_MIN_ROWS", 1000)
    monkeypatch.setenv("REPLICATOR_COPY_WORKERS", "2")
    path = tmp_path / "wh"
    written, unreadable = landed_then_unreadable(monkeypatch, "public.t")
    outcome = consume_with_fault(dsn, str(path))
    assert written.fired == 1
    table_dir = path / "public.t"
    [copy] = [c for c in log_commits(table_dir) if any("add" in a for a in c)]
    assert any(a["add"]["path"].startswith("part-00001-") for a in copy if "add" in a)   # a second worker's file
    missing = referenced_files(table_dir) - table_files(table_dir)
    assert not missing, f"the copy's version refers to files that were deleted: {sorted(missing)}"
    assert (unreadable.fired, outcome) == (1, "CommitUnknown")
    consume(dsn, str(path))   # the table, left out of _replicator, copied again into its directory
    assert_equal_to_source(conn, path, ["t"])


def test_an_optimize_whose_directory_fsync_fails_keeps_its_files_and_the_table_readable(dsn, conn, source, tmp_path,
                                                                                      monkeypatch):
    path = tmp_path / "wh"
    start(conn, source, dsn, str(path))
    with monkeypatch.context() as patched:   # the batch, its deletion vectors left for the OPTIMIZE
        patched.setattr(maintenance, "PURGE_RATIO", 2.0)
        patched.setattr(maintenance, "IDLE_PURGE_QUIET", math.inf)
        consume(dsn, str(path))
    fault = Fault("public.t/_delta_log")
    with monkeypatch.context() as patched:
        failing_fsync(patched, fault)
        with pytest.raises(delta_log.CommitUnknown):
            maintenance.optimize(LocalStorage(path), ["public.t"], everything=True)
    assert fault.fired == 1
    assert_every_referenced_file_exists(path)
    assert_readable(path)
    assert_equal_to_source(conn, path, ["t", "u"])


def answer_lost(monkeypatch: pytest.MonkeyPatch, fault: Fault) -> None:
    """ObjectStorage's conditional PUT performs the request, then fails as its client does when
    every retry's answer was lost."""
    put_if_absent: Callable[[ObjectStorage, str, bytes], bool] = ObjectStorage.put_if_absent

    def lost(self: ObjectStorage, where: str, data: bytes) -> bool:
        done = put_if_absent(self, where, data)
        if done and fault.due(where.rsplit("/", 1)[0]):
            raise UserError(f"{self.url}: Generic S3 error: request or response body error: operation timed out")
        return done

    monkeypatch.setattr(ObjectStorage, "put_if_absent", lost)


@pytest.mark.parametrize("directory", ["public.t", "_replicator"])
def test_an_s3_commit_whose_answer_is_lost_is_finished(dsn, conn, source, s3_url, monkeypatch, directory):
    from test_delta_s3 import assert_equal_to_source as assert_s3_equal_to_source
    from test_delta_s3 import table

    start(conn, source, dsn, s3_url)
    fault = Fault(f"{directory}/_delta_log")
    with monkeypatch.context() as patched:
        answer_lost(patched, fault)
        outcome = consume_with_fault(dsn, s3_url)
    assert fault.fired == 1
    present = {entry.path for entry in ObjectStorage(s3_url).list("")}
    for name in ("public.t", "public.u", "_replicator"):
        directory = table_uris(s3_url)[name].rsplit("/", 1)[-1] if name in KEYS else name
        for add in delta_log.load(ObjectStorage(s3_url), directory).files.values():
            named = [add["path"], *filter(None, [deletion_vectors.descriptor_file(add.get("deletionVector") or {})
                                                  if add.get("deletionVector") else None])]
            missing = [f for f in named if f"{directory}/{f}" not in present]
            assert not missing, f"{name}: its version refers to files that were deleted: {missing}"
        if name in KEYS:
            table(s3_url, name).version()
    assert outcome == "committed"
    assert_s3_equal_to_source(conn, s3_url, ["t", "u"])


# another writer's files: paths as URIs, deletion vectors as Delta's reader reads them ---------

MOVED = "moved by hand 100%.snappy.parquet"


def native_vector(positions: list[int]) -> bytes:
    """A RoaringBitmapArray in Delta's native serialization: magic 1681511376, the number of
    bitmaps (int32 LE), then each bitmap's size (int32 LE) and the bitmap (Roaring's format)."""
    bitmap = BitMap(positions).serialize()
    return struct.pack("<iii", 1681511376, 1, len(bitmap)) + bitmap


def portable_vector(positions: list[int]) -> bytes:
    bitmap = BitMap(positions).serialize()
    return struct.pack("<iqi", 1681511377, 1, 0) + bitmap


def vector_file(vector: bytes) -> bytes:
    """A deletion vector file holding one vector (at offset 1)."""
    return bytes([1]) + struct.pack(">i", len(vector)) + vector + struct.pack(">I", zlib.crc32(vector))


def move_with_deletions(table_dir: Path, gone: set[int], storage_type: str) -> None:
    """Another writer's commit: the table's one file moved to a name a URI encodes (a space, a
    '%'), rows of keys `gone` marked deleted in a vector of the given kind."""
    [add] = delta_log.load(LocalStorage(table_dir.parent), table_dir.name).files.values()
    data = (table_dir / add["path"]).read_bytes()
    keys = pq.read_table(pa.BufferReader(data)).column(0).to_pylist()   # the key column comes first
    positions = [i for i, key in enumerate(keys) if key in gone]
    (table_dir / MOVED).write_bytes(data)
    file_id = uuid.uuid4()
    name = f"deletion_vector_{file_id}.bin"
    if storage_type == "native":
        vector = native_vector(positions)
        where = {"storageType": "u", "pathOrInlineDv": deletion_vectors.z85_encode(file_id.bytes)}
    else:
        vector = portable_vector(positions)
        where = {"storageType": "p", "pathOrInlineDv": f"file:{quote((table_dir / name).as_posix())}"}
    (table_dir / name).write_bytes(vector_file(vector))
    stats = {**json.loads(add["stats"]), "tightBounds": False}
    moved = {**add, "path": quote(MOVED), "stats": json.dumps(stats),
             "deletionVector": {**where, "offset": 1, "sizeInBytes": len(vector), "cardinality": len(positions)}}
    _commit_by_hand(table_dir, [{"remove": {"path": add["path"], "deletionTimestamp": 0, "dataChange": True}},
                                {"add": moved}])


@pytest.mark.parametrize("storage_type", ["native", "absolute path"])
def test_another_writers_file_named_by_an_encoded_uri_with_its_deletion_vector_is_read(dsn, conn, source, tmp_path,
                                                                                       storage_type):
    path = tmp_path / "wh"
    conn.execute(CRASH_DDL)
    source.create_queue("q")
    source.add_table("q", "t")
    consume(dsn, str(path))
    table_dir = Path(table_uris(str(path))["public.t"])
    move_with_deletions(table_dir, {1, 2, 3, 4, 5}, storage_type)   # as Spark's DELETE ... WHERE id <= 5
    conn.execute("DELETE FROM t WHERE id <= 5")
    conn.execute("UPDATE t SET cnt = cnt + 1 WHERE id <= 10")   # rows of the moved file, some deleted already
    forced_tick(conn)
    consume(dsn, str(path))
    assert_equal_to_source(conn, path, ["t"])
    maintenance.optimize(LocalStorage(path), everything=True)   # the moved file's live rows rewritten
    assert_equal_to_source(conn, path, ["t"])
    # what replicator writes is a URI: the moved file re-added (its deletion vector grown) as the log
    # names it, its own files named with characters that need no encoding
    ours = {a["add"]["path"] for commit in log_commits(table_dir) if commit[0]["commitInfo"].get("engineInfo") ==
            delta_log.ENGINE for a in commit if "add" in a}
    assert quote(MOVED) in ours
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", p) for p in ours - {quote(MOVED)}), ours


def test_a_native_deletion_vector_reads_as_the_portable_one_and_one_past_2_32_rows_is_refused():
    positions = [0, 5, 70_000, 1 << 20, (1 << 32) - 1]
    assert list(deletion_vectors.deserialize(native_vector(positions))) == positions
    assert list(deletion_vectors.deserialize(portable_vector(positions))) == positions
    empty_second = native_vector(positions) + struct.pack("<i", len(BitMap().serialize())) + BitMap().serialize()
    empty_second = empty_second[:4] + struct.pack("<i", 2) + empty_second[8:]
    assert list(deletion_vectors.deserialize(empty_second)) == positions
    past = native_vector([1]) + struct.pack("<i", len(BitMap([7]).serialize())) + BitMap([7]).serialize()
    past = past[:4] + struct.pack("<i", 2) + past[8:]
    with pytest.raises(UserError, match="past 2\\*\\*32"):
        deletion_vectors.deserialize(past)
    with pytest.raises(ValueError, match="not a deletion vector"):
        deletion_vectors.deserialize(struct.pack("<iq", 1234, 0))


def stored(vector: bytes, cardinality: int) -> tuple[dict[str, Any], bytes]:
    """A descriptor of the vector stored at offset 1 of a vector file, and the file's data."""
    return ({"storageType": "u", "pathOrInlineDv": deletion_vectors.z85_encode(bytes(16)), "offset": 1,
             "sizeInBytes": len(vector), "cardinality": cardinality}, vector_file(vector))


@pytest.mark.parametrize(("vector", "cardinality", "why"), [
    (native_vector([1, 2, 3])[:4] + struct.pack("<i", -1) + native_vector([1, 2, 3])[8:], 3, "counts -1 bitmaps"),
    (native_vector([1, 2, 3])[:4] + struct.pack("<i", 1 << 30) + native_vector([1, 2, 3])[8:], 3, "bitmaps in"),
    (native_vector([1, 2, 3])[:8] + struct.pack("<i", -5) + native_vector([1, 2, 3])[12:], 3, "is -5 bytes"),
    (native_vector([1, 2, 3])[:8] + struct.pack("<i", 1 << 20) + native_vector([1, 2, 3])[12:], 3, "past its end"),
    (portable_vector([1, 2, 3])[:-3], 3, "Could not deserialize"),
    (struct.pack("<i", 1681511376), 0, "ends early"),
    (native_vector([1, 2, 3]), 2, "marks 3 rows, its descriptor 2"),
], ids=["negative count", "oversized count", "negative size", "oversized size", "truncated bitmap", "truncated header",
        "rows differ from the cardinality"])
def test_another_writers_malformed_deletion_vector_is_refused_in_one_line(vector, cardinality, why):
    """Each passes its CRC: what it says is checked as Delta's reader checks it (counts, sizes,
    the rows against the descriptor's cardinality); the deleted rows are never guessed."""
    descriptor, data = stored(vector, cardinality)
    with pytest.raises(UserError, match=re.escape(why)) as refused:
        deletion_vectors.read(descriptor, lambda _: data)
    assert "deletion_vector_" in str(refused.value) and "\n" not in str(refused.value)


def test_a_deletion_vector_that_fails_its_checksum_or_lies_past_its_file_is_refused_in_one_line():
    descriptor, data = stored(native_vector([1, 2, 3]), 3)
    damaged = data[:-1] + bytes([data[-1] ^ 1])
    with pytest.raises(UserError, match="fails its checksum"):
        deletion_vectors.read(descriptor, lambda _: damaged)
    with pytest.raises(UserError, match="past the file's end"):
        deletion_vectors.read({**descriptor, "offset": 2}, lambda _: data)
    with pytest.raises(UserError, match="before the file's first vector"):
        deletion_vectors.read({**descriptor, "offset": -3}, lambda _: data)
    with pytest.raises(UserError, match="an inline deletion vector"):
        deletion_vectors.read({"storageType": "i", "pathOrInlineDv": "~~~~~", "cardinality": 0}, lambda _: b"")


def test_a_log_path_that_decodes_to_a_nul_byte_is_refused_in_one_line(tmp_path):
    """An add path is a URI from another writer: '%00' decodes to a NUL, which no file name holds
    (the filesystem would raise ValueError: an internal error)."""
    storage = LocalStorage(tmp_path)
    (tmp_path / "public.t").mkdir()
    assert delta_log.relative_file(storage, "public.t", "part-0%00.parquet") is None
    with pytest.raises(UserError, match="outside the table"):
        delta_log.table_file(storage, "public.t", "part-0%00.parquet")


# a view's commit whose outcome is not known (Spark: one test) ---------------------------------

def test_a_view_whose_create_and_refresh_commits_landed_unread_is_told_as_such_and_stays_maintained(
        spark, tmp_path, monkeypatch):
    """The view's commit lands, its call fails (EIO) and so does reading it back: `view create`
    says it may have been created (never 'not created: its query fails', a second create being
    refused as it exists); the consumer's refresh after a batch leaves the view maintained (not
    stale): the next batch's reload tells what landed."""
    pytest.importorskip("pyspark")
    from replicator.targets.delta import target as delta_target
    from test_delta_views import (
        VIEWS,
        Model,
        assert_views_equal_their_queries,
        commit_batch,
        delta_views,
        start_warehouse,
    )

    monkeypatch.setattr(delta_target, "VIEWS_DISCOVER_SECONDS", 0.0)
    path = tmp_path / "wh"
    target = start_warehouse(lambda p: DeltaTarget(str(p), session=lambda: spark), path, Model(random.Random(1)))
    try:
        views = delta_views(spark, path)
        with monkeypatch.context() as patched:
            written, unreadable = landed_then_unreadable(patched, view_directory("pairs"))
            with pytest.raises(UserError, match=r"view pairs may have been created \(the warehouse's storage "
                                                r"failed: .*Input/output error\): `replicator view list` tells"):
                views.create("pairs", VIEWS["pairs"], "incremental")
        assert (written.fired, unreadable.fired) == (1, 1)
        assert [(v["view"], v["status"]) for v in views.list()] == [("pairs", "ok")]
        before = ViewTable(LocalStorage(path), view_directory("pairs")).table.snapshot.version
        with monkeypatch.context() as patched:
            written, unreadable = landed_then_unreadable(patched, view_directory("pairs"))
            commit_batch(target, [(1, 7, 70, "new")])
            target.settle()
        assert (written.fired, unreadable.fired) == (1, 1)
        assert ViewTable(LocalStorage(path), view_directory("pairs")).table.snapshot.version > before   # it landed
        commit_batch(target, [(2, 7, 80, "newer")])
        target.settle()
    finally:
        target.close()
    assert [(v["view"], v["status"]) for v in views.list()] == [("pairs", "ok")]
    assert_views_equal_their_queries(spark, path, ["pairs"])
