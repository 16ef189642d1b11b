"""Parallel initial copy into a Spark warehouse.

The copy's REPEATABLE READ snapshot is exported (pg_export_snapshot) and the
table's blocks are split into ranges; one worker process per range imports
the snapshot (SET TRANSACTION SNAPSHOT), reads its range with binary COPY
(a TID range scan), decodes the rows and writes its own Parquet base files.
Every worker sees exactly the rows of the copy's snapshot, so the catch-up
rules of the initial copy hold unchanged. Decoding is what bounds a copy, so
processes (not threads) share it out over the cores.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

import psycopg
import pyarrow.parquet as pq
from psycopg import sql

from replicator.source import db
from replicator.structure import TableStructure
from replicator.targets.spark.warehouse import arrow_table, physical_schema

PARALLEL_MIN_ROWS = 500_000     # smaller tables are copied by the consumer process alone
ROW_GROUP = 131072
FILE_ROWS = 1 << 18

_progress: Any = None


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


def copy_parallel(conn: psycopg.Connection, dsn: str, select: sql.Composable, structure: TableStructure,
                  ranges: list[tuple[int | None, int | None]], prefix: Path,
                  progress: Callable[[int], None], *, decimals: bool) -> list[tuple[Path, int]]:
    """Runs the copy's SELECT (the capture encoding of a table aliased t) over
    the block ranges in worker processes; returns the Parquet files written
    and their row counts (numerics as decimals or text: the generation's flag).
    `conn` holds the copy's snapshot (open transaction)."""
    exported = conn.execute("SELECT pg_export_snapshot()").fetchone()
    assert exported is not None   # a function call: one row
    snapshot_id = exported[0]
    query = select.as_string(conn)
    context = multiprocessing.get_context("spawn")   # the consumer may run threads (compaction, a JVM)
    counter = context.Value("q", 0)
    with ProcessPoolExecutor(max_workers=len(ranges), mp_context=context, initializer=_init,
                             initargs=(counter,)) as pool:
        futures = [pool.submit(_copy_range, dsn, snapshot_id, query, lo, hi, structure.to_json(),
                               decimals, f"{prefix}-w{i:02d}") for i, (lo, hi) in enumerate(ranges)]
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=0.5, return_when=FIRST_EXCEPTION)
            progress(counter.value)
            for future in done:
                future.result()   # raises a worker's error here
    progress(counter.value)
    return [(Path(path), rows) for future in futures for path, rows in future.result()]


def _init(counter: Any) -> None:
    global _progress
    _progress = counter


def _copy_range(dsn: str, snapshot_id: str, query: str, lo: int | None, hi: int | None, structure_json: str,
                decimals: bool, prefix: str) -> list[tuple[str, int]]:
    structure = TableStructure.from_json(structure_json)
    decode = structure.rows_decoder()
    where = []
    if lo is not None:
        where.append(f"t.ctid >= '({lo},0)'::tid")
    if hi is not None:
        where.append(f"t.ctid < '({hi},0)'::tid")
    copy_sql = f"COPY ({query}{' AND ' + ' AND '.join(where) if where else ''}) TO STDOUT (FORMAT binary)"
    files: list[tuple[str, int]] = []
    writer: pq.ParquetWriter | None = None
    path = ""
    in_file = 0
    texts: list[str] = []

    def flush() -> None:
        nonlocal writer, path, in_file, texts
        if not texts:
            return
        if writer is None:
            path = f"{prefix}-{len(files):03d}.parquet"
            writer = pq.ParquetWriter(path, physical_schema(structure, decimals=decimals), compression="snappy")
            in_file = 0
        from replicator.structure import parse_json
        rows = decode([parse_json(t) for t in texts])
        writer.write_table(arrow_table(structure, rows, decimals=decimals), row_group_size=ROW_GROUP)
        in_file += len(texts)
        if _progress is not None:
            with _progress.get_lock():
                _progress.value += len(texts)
        texts = []
        if in_file >= FILE_ROWS:
            close()

    def close() -> None:
        nonlocal writer
        if writer is not None:
            writer.close()   # made durable with the rest of the transaction, when the consumer commits
            files.append((path, in_file))
            writer = None

    # db.open_connection: the session settings the row encoding depends on (floats, intervals).
    with db.open_connection(db.resolve_dsn(dsn), autocommit=False, application_name="replicator copy worker") as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.read_only = True
        conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot_id)))
        with conn.cursor() as cur, cur.copy(copy_sql) as copy:
            copy.set_types(["text"])
            for (text,) in copy.rows():
                texts.append(text)
                if len(texts) >= ROW_GROUP:
                    flush()
        flush()
        close()
        conn.rollback()
    return files
