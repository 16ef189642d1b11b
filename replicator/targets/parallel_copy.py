"""Parallel initial copy of a large table, for the warehouse targets (Delta, Spark).

The copy's REPEATABLE READ snapshot is exported (pg_export_snapshot) and the
table's blocks are split into ranges; one worker process per range imports
the snapshot (SET TRANSACTION SNAPSHOT), reads its range with binary COPY
(a TID range scan), decodes the rows and hands them to the target's writer
of data files (a RangeFiles the target gives, sent to each worker). Every
worker sees exactly the rows of the copy's snapshot, so the catch-up rules of
the initial copy hold unchanged. Decoding is what bounds a copy, so processes
(not threads) share it out over the cores.

The files a worker wrote are handed back when it ends (``taken``), for the
target to put in its open transaction, which commits them or, rolled back,
deletes them. A failing worker stops the others at their next chunk; a worker
that fails or is stopped deletes what it wrote itself, and so does one whose
consumer is gone (killed): a kill leaves at most a partly written file, which
no commit names.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Generic, Protocol, TypeVar

import psycopg
from psycopg import sql

from replicator.errors import UserError
from replicator.source import db
from replicator.source import snapshot_copy as source_copy
from replicator.structure import TableStructure

PARALLEL_MIN_ROWS = 500_000     # smaller tables are copied by the consumer process alone
CHUNK_ROWS = 131072             # rows a worker decodes and hands its writer at a time (a row group)

F = TypeVar("F")
F_co = TypeVar("F_co", covariant=True)


class RangeWriter(Protocol[F_co]):
    """One worker's writer of data files."""

    def write(self, rows: list[Sequence[Any]]) -> None:
        """Decoded rows (CHUNK_ROWS, fewer at the end), in the table structure's column order."""
        ...

    def close(self) -> Sequence[F_co]:
        """Completes the files; returns what the target needs to take each into its transaction."""
        ...

    def abort(self, error: BaseException) -> None:
        """The copy failed: deletes the files written, abandons the one being written."""
        ...


class RangeFiles(Protocol[F_co]):
    """A target's description of where and how a copy's workers write (picklable: each worker
    process gets a copy and opens its writer from it)."""

    def writer(self, worker: int) -> RangeWriter[F_co]: ...


class CopyStopped(Exception):
    """A worker stopped before the end of its range: another failed, or its consumer is gone."""


def workers_for(estimated_rows: int) -> int:
    """Worker processes for a table: REPLICATOR_COPY_WORKERS, else half the cores
    (each worker keeps a PostgreSQL backend busy encoding rows), at most 8; one
    (no split) for tables under PARALLEL_MIN_ROWS. On 2 cores a split does not pay:
    the consumer and its backend already keep both busy."""
    if estimated_rows < PARALLEL_MIN_ROWS:
        return 1
    configured = os.environ.get("REPLICATOR_COPY_WORKERS")
    if configured:
        return max(1, int(configured))
    return max(1, min((os.cpu_count() or 1) // 2, 8))


def block_ranges(conn: psycopg.Connection, oid: int, workers: int) -> list[tuple[int | None, int | None]] | None:
    """Block ranges splitting a plain table (None: not splittable, copy it in one piece)."""
    found = conn.execute(
        "SELECT relkind, pg_relation_size(oid) / current_setting('block_size')::bigint FROM pg_class WHERE oid = %s",
        (oid,)).fetchone()
    if found is None:
        raise RuntimeError(f"the table of oid {oid} being copied is gone (dropped during the copy?)")
    relkind, blocks = found
    if relkind != "r" or workers < 2 or blocks < workers:
        return None
    bounds = [blocks * i // workers for i in range(workers + 1)]
    return [(None if i == 0 else bounds[i], None if i == workers - 1 else bounds[i + 1]) for i in range(workers)]


def copy_parallel(snap: source_copy.SnapshotCopy, ranges: list[tuple[int | None, int | None]],
                  files: RangeFiles[F], progress: Callable[[int], None], taken: Callable[[Sequence[F]], None]) -> int:
    """Copies the table of `snap` (a SnapshotCopy: its connection holds the copy's snapshot)
    over the block ranges in worker processes; returns the rows copied. Each worker's files
    go to `taken` once the workers have ended, also when the copy fails: those of the
    workers that completed their range (the others deleted theirs)."""
    conn = snap.conn
    exported = conn.execute("SELECT pg_export_snapshot()").fetchone()
    assert exported is not None   # a function call: one row
    query = sql.SQL("SELECT {expr}::text FROM {table} t WHERE {filter}").format(
        expr=source_copy._row_expr(conn, snap.table, snap.structure),
        table=source_copy._relation(conn, snap.table), filter=source_copy._filter(snap.table)).as_string(conn)
    context = multiprocessing.get_context("spawn")   # the consumer may run threads (compaction, a JVM)
    counter = context.Value("q", 0)
    stop = context.Event()
    with ProcessPoolExecutor(max_workers=len(ranges), mp_context=context, initializer=_init,
                             initargs=(counter, stop, os.getpid())) as pool:
        futures = [pool.submit(_copy_range, _Range(snap.dsn, exported[0], query, lo, hi, snap.structure.to_json(),
                                                   files, i)) for i, (lo, hi) in enumerate(ranges)]
        try:
            pending = set(futures)
            while pending:
                done, pending = wait(pending, timeout=0.5, return_when=FIRST_EXCEPTION)
                progress(counter.value)
                for future in done:
                    future.result()   # raises a worker's error here
        except BrokenProcessPool:
            raise UserError(f"copying {snap.table.name}: a worker process of the parallel copy ended abruptly "
                            f"(killed? out of memory?); REPLICATOR_COPY_WORKERS=1 copies in the consumer "
                            f"process alone") from None
        finally:
            stop.set()   # the others stop at their next chunk (done: a no-op)
            pool.shutdown(wait=True)
            for future in futures:
                if not future.cancelled() and future.exception() is None:
                    taken(future.result())
    progress(counter.value)
    return int(counter.value)


# the workers ------------------------------------------------------------------------------

_progress: Any = None
_stop: Any = None
_parent = 0


def _init(counter: Any, stop: Any, parent: int) -> None:
    global _progress, _stop, _parent
    _progress, _stop, _parent = counter, stop, parent


class _Range(Generic[F]):
    """One worker's task."""

    def __init__(self, dsn: str, snapshot_id: str, query: str, lo: int | None, hi: int | None, structure: str,
                 files: RangeFiles[F], worker: int) -> None:
        self.dsn, self.snapshot_id, self.query, self.lo, self.hi = dsn, snapshot_id, query, lo, hi
        self.structure, self.files, self.worker = structure, files, worker


def _check_stop() -> None:
    if _stop is not None and _stop.is_set():
        raise CopyStopped("stopped: another worker of the copy failed")
    if _parent and os.getppid() != _parent:
        raise CopyStopped("stopped: the consumer that started the copy is gone")


def _copy_range(task: _Range[F]) -> Sequence[F]:
    decode = TableStructure.from_json(task.structure).rows_decoder()
    where = []
    if task.lo is not None:
        where.append(f"t.ctid >= '({task.lo},0)'::tid")
    if task.hi is not None:
        where.append(f"t.ctid < '({task.hi},0)'::tid")
    copy_sql = f"COPY ({task.query}{' AND ' + ' AND '.join(where) if where else ''}) TO STDOUT (FORMAT binary)"
    writer = task.files.writer(task.worker)
    texts: list[str] = []

    def flush() -> None:
        nonlocal texts
        _check_stop()
        if not texts:
            return
        writer.write(source_copy.decode_rows(texts, decode))
        if _progress is not None:
            with _progress.get_lock():
                _progress.value += len(texts)
        texts = []

    try:
        # db.open_connection: the session settings the row encoding depends on (floats, intervals).
        with db.open_connection(db.resolve_dsn(task.dsn), autocommit=False,
                                application_name="replicator copy worker") as conn:
            conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            conn.read_only = True
            conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(task.snapshot_id)))
            with conn.cursor() as cur, cur.copy(copy_sql) as copy:
                copy.set_types(["text"])
                for (text,) in copy.rows():
                    texts.append(text)
                    if len(texts) >= CHUNK_ROWS:
                        flush()
            flush()
            conn.rollback()
        return writer.close()
    except BaseException as exc:
        writer.abort(exc)
        raise
