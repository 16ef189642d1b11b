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
import re
import struct
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
    """'committed' when the consumer finished the batch, else the failure it stopped on."""
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


@pytest.mark.parametrize("directory", ["public.t", "_replicator"])
def test_a_commit_whose_directory_fsync_fails_after_the_link_is_finished(dsn, conn, source, tmp_path, monkeypatch,
                                                                         directory):
    path = tmp_path / "wh"
    start(conn, source, dsn, str(path))
    fault = Fault(f"{directory}/_delta_log")
    real = local_storage._fsync_dir

    def fsync_dir(where: Path) -> None:
        if fault.due(where.as_posix()):
            raise OSError(errno.EIO, "Input/output error")
        real(where)

    monkeypatch.setattr(local_storage, "_fsync_dir", fsync_dir)
    outcome = consume_with_fault(dsn, str(path))
    monkeypatch.undo()
    assert fault.fired == 1
    assert_every_referenced_file_exists(path)
    assert_readable(path)
    assert outcome == "committed"   # the version read back is the consumer's: the commit is finished
    assert_equal_to_source(conn, path, ["t", "u"])


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
    assert (unreadable.fired, outcome) == (1, "OSError")
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
    assert (unreadable.fired, outcome) == (1, "OSError")
    consume(dsn, str(path))   # the table, left out of _replicator, copied again into its directory
    assert_equal_to_source(conn, path, ["t"])


def test_an_optimize_whose_directory_fsync_fails_after_the_link_is_finished(dsn, conn, source, tmp_path,
                                                                             monkeypatch):
    path = tmp_path / "wh"
    start(conn, source, dsn, str(path))
    with monkeypatch.context() as patched:   # the batch, its deletion vectors left for the OPTIMIZE
        patched.setattr(maintenance, "PURGE_RATIO", 2.0)
        patched.setattr(maintenance, "IDLE_PURGE_RATIO", 2.0)
        consume(dsn, str(path))
    fault = Fault("public.t/_delta_log")
    real = local_storage._fsync_dir

    def fsync_dir(where: Path) -> None:
        if fault.due(where.as_posix()):
            raise OSError(errno.EIO, "Input/output error")
        real(where)

    monkeypatch.setattr(local_storage, "_fsync_dir", fsync_dir)
    try:
        done = maintenance.optimize(LocalStorage(path), ["public.t"], everything=True)
    except OSError as exc:
        done = exc
    monkeypatch.undo()
    assert fault.fired == 1
    assert_every_referenced_file_exists(path)
    assert_readable(path)
    assert not isinstance(done, OSError) and [(r.table, r.committed) for r in done] == [("public.t", True)], done
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
