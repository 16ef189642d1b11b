"""Parallel initial copy of a large table, for the warehouse targets (Delta, Spark).

The copy's REPEATABLE READ snapshot is exported (pg_export_snapshot) and the
table's blocks are split into ranges; one worker process per range imports
the snapshot (SET TRANSACTION SNAPSHOT), reads its range with binary COPY
(a TID range scan), decodes the rows and hands them to the target's writer
of data files (a RangeFiles the target gives, sent to each worker). Every
worker sees exactly the rows of the copy's snapshot, so the catch-up rules of
the initial copy hold unchanged. Decoding is what bounds a copy, so processes
(not threads) share it out over the cores.

The files a worker wrote are handed back once every worker has ended
(``taken``), for the target to put in its open transaction, which commits
them or, rolled back, deletes them. A failing worker stops the others at
their next chunk; a worker that fails or is stopped deletes what it wrote,
and so does one whose consumer is gone (killed), which then ends: what a
kill leaves is at most a partly written file, or the files of a range the
consumer had taken, which no commit names. The workers are plain processes
with a pipe each, not a pool, whose idle workers would outlive a killed
consumer.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Generic, Protocol, TypeVar

import psycopg
from psycopg import sql

from replicator.errors import UserError
from replicator.source import db
from replicator.source import table_copy as source_copy
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
    workers: list[_Worker[F]] = []
    try:
        for i, (lo, hi) in enumerate(ranges):
            task = _Range(snap.dsn, exported[0], query, lo, hi, snap.structure.to_json(), files, i)
            reader, writer = context.Pipe(duplex=False)
            process = context.Process(target=_copy_range, args=(task, writer, counter, stop, os.getpid()),
                                      name=f"replicator copy worker {i}", daemon=True)
            process.start()
            writer.close()   # the worker's end only in the worker: its death is an end of file here
            workers.append(_Worker(i, process, reader))
        error = _collect(workers, lambda: progress(counter.value), stop)
    finally:
        stop.set()   # the others stop at their next chunk (all ended: a no-op)
        _collect(workers, lambda: None, stop)   # an exception above: the workers' ends still awaited
        for worker in workers:
            if worker.files is not None:
                taken(worker.files)
    if error is not None:
        if isinstance(error, _Died):
            raise UserError(f"copying {snap.table.name}: {error}; REPLICATOR_COPY_WORKERS=1 copies in the "
                            f"consumer process alone") from None
        raise error
    progress(counter.value)
    return int(counter.value)


class _Worker(Generic[F]):
    def __init__(self, number: int, process: BaseProcess, reader: Connection) -> None:
        self.number, self.process, self.reader = number, process, reader
        self.ended = False
        self.files: Sequence[F] | None = None   # what it wrote, when it completed its range


class _Died(Exception):
    """A worker process that ended without a word (killed)."""


def _collect(workers: list[_Worker[F]], tick: Callable[[], None], stop: Any) -> BaseException | None:
    """Waits for every worker's end (its files, or its error), calling tick every half second;
    returns the first error, once every worker has ended (the first error stops the others)."""
    error: BaseException | None = None
    while running := [w for w in workers if not w.ended]:
        ready = wait([w.reader for w in running], timeout=0.5)
        tick()
        for worker in running:
            if worker.reader not in ready:
                continue
            try:
                outcome, value = worker.reader.recv()
            except EOFError:
                worker.process.join()
                outcome, value = "error", _Died(f"copy worker {worker.number} ended abruptly "
                                                f"({_how(worker.process.exitcode)})")
            worker.ended = True
            worker.reader.close()
            worker.process.join()
            if outcome == "files":
                worker.files = value
            elif error is None:
                error = value
                stop.set()
    return error


def _how(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name
        return f"killed by {name}: out of memory?" if exitcode == -signal.SIGKILL else f"killed by {name}"
    return f"exit status {exitcode}"


# the workers ------------------------------------------------------------------------------

class _Range(Generic[F]):
    """One worker's task."""

    def __init__(self, dsn: str, snapshot_id: str, query: str, lo: int | None, hi: int | None, structure: str,
                 files: RangeFiles[F], worker: int) -> None:
        self.dsn, self.snapshot_id, self.query, self.lo, self.hi = dsn, snapshot_id, query, lo, hi
        self.structure, self.files, self.worker = structure, files, worker


class _Stop:
    """Whether a worker should stop: another failed (the shared event), or its consumer is gone."""

    def __init__(self, event: Any, parent: int) -> None:
        self.event, self.parent = event, parent

    def check(self) -> None:
        if self.event.is_set():
            raise CopyStopped("stopped: another worker of the copy failed")
        if os.getppid() != self.parent:
            raise CopyStopped("stopped: the consumer that started the copy is gone")


def _copy_range(task: _Range[F], out: Connection, counter: Any, event: Any, parent: int) -> None:
    """A worker process: copies its range, then sends ("files", what it wrote) or ("error", exception)."""
    stop = _Stop(event, parent)
    writer: RangeWriter[F] | None = None
    try:
        writer = task.files.writer(task.worker)   # opens the storage: may fail too
        outcome: tuple[str, Any] = ("files", _write_range(task, writer, counter, stop))
    except BaseException as exc:
        exc.add_note(f"in copy worker {task.worker}:\n{''.join(traceback.format_tb(exc.__traceback__))}")
        outcome = ("error", exc)
    try:
        out.send(outcome)
    except Exception as exc:
        if writer is not None and outcome[0] == "files":   # its consumer is gone: nobody takes the files
            writer.abort(exc)
            return
        with contextlib.suppress(Exception):   # an error that does not pickle: its text
            out.send(("error", RuntimeError(f"{type(outcome[1]).__name__}: {outcome[1]} ({exc})")))


def _write_range(task: _Range[F], writer: RangeWriter[F], counter: Any, stop: _Stop) -> Sequence[F]:
    decode = TableStructure.from_json(task.structure).rows_decoder()
    where = []
    if task.lo is not None:
        where.append(f"t.ctid >= '({task.lo},0)'::tid")
    if task.hi is not None:
        where.append(f"t.ctid < '({task.hi},0)'::tid")
    copy_sql = f"COPY ({task.query}{' AND ' + ' AND '.join(where) if where else ''}) TO STDOUT (FORMAT binary)"
    texts: list[str] = []

    def flush() -> None:
        nonlocal texts
        stop.check()
        if not texts:
            return
        writer.write(source_copy.decode_rows(texts, decode))
        with counter.get_lock():
            counter.value += len(texts)
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
