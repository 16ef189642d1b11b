"""Reading current rows from the source: the initial copy of a table and the
PK-only join-back.

Both read rows in the capture encoding (replicator.capture_row_json), so a
target decodes copied, joined-back and queued rows with the same code.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import psycopg
from psycopg import sql
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn, TimeRemainingColumn
from rich.text import Text

from replicator.source import CapturedTable, Source, db
from replicator.structure import RowsDecoder, TableStructure, parse_json

COPY_CHUNK_ROWS = 5000
TICK_WAIT = 30.0   # seconds a copy waits for the queue another session holds

log = logging.getLogger("replicator")


def _relation(conn: psycopg.Connection, table: CapturedTable) -> sql.Composable:
    """The table's current qualified name, found by oid: a RENAME the consumer has
    not reached yet does not break reading it. Read without ONLY on purpose: the
    rows of a partitioned table or inheritance parent include its descendants',
    as its capture does (replicator.capture_tree)."""
    name = db.scalar(conn, "SELECT %s::oid::regclass::text", (table.oid,))
    return sql.SQL(name)


def _row_expr(conn: psycopg.Connection, table: CapturedTable, structure: TableStructure) -> sql.Composable:
    """The capture encoding of the structure's columns, found by attnum in the
    current table (renamed columns are read under their new name, dropped ones
    as NULL), so a consumer behind on DDL still reads rows in its own layout."""
    names: dict[int, str] = dict(conn.execute(
        "SELECT attnum, attname FROM pg_attribute WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped",
        (table.oid,)).fetchall())
    columns = [names.get(c.attnum, "") if c.attnum else c.name for c in structure.columns]
    expr = db.scalar(conn, "SELECT replicator.capture_row_json('t', %s, %s::oid::regclass)", (columns, table.oid))
    return sql.SQL(expr)


def _filter(table: CapturedTable) -> sql.Composable:
    return sql.SQL("({})").format(sql.SQL(table.row_filter)) if table.row_filter else sql.SQL("true")


class TableGone(Exception):
    """A captured table dropped before its copy: there is nothing to copy, and its queued events,
    all committed before the DROP, are already gone with it from the source."""


def decode_rows(texts: Iterable[str], decode: RowsDecoder) -> list[Sequence[Any]]:
    return decode([parse_json(text) for text in texts])


class SnapshotCopy:
    """A table's rows as of one REPEATABLE READ snapshot of the source.

    ``snapshot`` (txid_snapshot text) is known once the object is entered: events
    of transactions visible in it are already in the copy and must be skipped.
    It is made durable before it is returned (durable_tick): a source crash cannot
    take back a commit it shows, nor give its txids to new transactions, whose
    events would then be skipped as already copied.
    """

    def __init__(self, dsn: str, table: CapturedTable) -> None:
        self.dsn = dsn
        self.table = table   # as captured when the copy's snapshot was taken, once entered
        self.structure = TableStructure.from_source(table.structure or {}, table.columns, table.key)
        self.snapshot = ""
        self.estimated_rows = 0

    def __enter__(self) -> SnapshotCopy:
        """Raises TableGone when the table was dropped before it could be locked."""
        # OperationalError, not UserError: a source lost mid-copy is retried by the daemon.
        self.conn = db.open_connection(db.resolve_dsn(self.dsn), application_name="replicator copy")
        try:
            self._lock_then_take_snapshot()
            self.estimated_rows = estimated_rows(self.conn, self.table.oid)
            durable_tick(self.dsn, self.table.queue_name)
        except BaseException:
            self.conn.close()
            raise
        return self

    def _lock_then_take_snapshot(self) -> None:
        """Locks the table (ACCESS SHARE), then takes the snapshot the copy reads: a DROP or RENAME
        committed after the snapshot would leave the copy nothing to read by the table's name or
        files. LOCK TABLE takes a name and no snapshot; the name is read outside the transaction,
        then checked to still be the table's once it is locked."""
        self.conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ   # (of the transactions below)
        self.conn.read_only = True
        while True:
            name = self.conn.execute("SELECT %s::oid::regclass::text FROM pg_class WHERE oid = %s",
                                     (self.table.oid, self.table.oid)).fetchone()
            if name is None:
                raise TableGone(f"{self.table.name} was dropped before its copy")
            self.conn.autocommit = False
            try:
                # ONLY: enough to hold off a DROP or RENAME of it; PostgreSQL 12 would check the role's
                # privileges on every descendant too (the copy reads them through the table's)
                self.conn.execute(sql.SQL("LOCK TABLE ONLY {} IN ACCESS SHARE MODE").format(sql.SQL(name[0])))
                # the transaction's first query: its snapshot is the copy's
                row = self.conn.execute("SELECT txid_current_snapshot()::text, to_regclass(%s) = %s::oid",
                                        (name[0], self.table.oid)).fetchone()
                assert row is not None
                self.snapshot, locked = row
            except psycopg.errors.UndefinedTable:   # dropped or renamed since: read its name again
                locked = False
            if locked:
                self._read_captured_table()
                return
            self.conn.rollback()   # (or another table took the name meanwhile)
            self.conn.autocommit = True

    def _read_captured_table(self) -> None:
        """The table as the snapshot shows it captured: a RENAME or ALTER committed since it was listed is
        in the copy, and its schema event, visible in the snapshot, is skipped with the copy's other
        events. (A table removed from the queue meanwhile is copied as listed.)"""
        current = Source(self.conn, check_installed=False).table(self.table.queue_name, self.table.table_id)
        if current is not None and current.structure is not None:
            self.table = current
            self.structure = TableStructure.from_source(current.structure, current.columns, current.key)

    def __exit__(self, *exc: object) -> None:
        try:
            self.conn.rollback()
        finally:
            self.conn.close()

    def chunks(self) -> Iterator[list[Sequence[Any]]]:
        """Decoded rows, COPY_CHUNK_ROWS at a time, streamed with binary COPY."""
        query = sql.SQL("COPY (SELECT {expr}::text FROM {table} t WHERE {filter}) TO STDOUT (FORMAT binary)").format(
            expr=_row_expr(self.conn, self.table, self.structure),
            table=_relation(self.conn, self.table), filter=_filter(self.table))
        decode = self.structure.rows_decoder()
        with self.conn.cursor() as cur, cur.copy(query) as copy:
            copy.set_types(["text"])
            texts: list[str] = []
            for (text,) in copy.rows():
                texts.append(text)
                if len(texts) >= COPY_CHUNK_ROWS:
                    yield decode_rows(texts, decode)
                    texts = []
            if texts:
                yield decode_rows(texts, decode)


def durable_tick(dsn: str, queue: str) -> int:
    """Makes a tick now, after the caller's snapshot, and returns its id.

    A source crash loses the WAL not yet flushed (commits under synchronous_commit =
    off, rollbacks always), and PostgreSQL then gives the txids it has no WAL of to
    new transactions: a copy snapshot taken just before the crash could show lost
    commits, and take new transactions, with txids below its xmax, for ones already
    copied (their events skipped). A tick commits synchronously: its commit record
    flushes every commit the snapshot shows, and its txid, at or above the
    snapshot's xmax, is never given again. Another ticker's tick may predate the
    snapshot: wait for one of our own. It only ticks, as a consumer role's ticks do:
    DDL no event trigger saw is the ticker's to follow, and following it here checked
    every captured table at each table's copy (N² checks for a copy of N tables)."""
    deadline = time.monotonic() + TICK_WAIT
    with db.open_connection(db.resolve_dsn(dsn), application_name="replicator copy") as conn:
        source = Source(conn, check_installed=False)
        while (tick := source.tick(queue, force=True, follow_ddl=False)) is None:
            if time.monotonic() > deadline:   # the caller's copy holds a table lock: give it up, try again later
                raise psycopg.OperationalError(f"queue {queue} held by another session for {TICK_WAIT:g}s: "
                                               f"the copy is tried again")
            time.sleep(0.01)
        return tick


def estimated_rows(conn: psycopg.Connection, oid: int) -> int:
    """The planner's row estimate of a table and its descendants (a copy reads them
    all), from pg_class.reltuples as of the last VACUUM or ANALYZE; 0: unknown (a table
    never analyzed has -1). A row filter is not applied to it."""
    return int(db.scalar(conn, """
        WITH RECURSIVE tree(oid) AS (SELECT %s::oid
                                     UNION ALL SELECT i.inhrelid FROM pg_inherits i JOIN tree ON i.inhparent = tree.oid)
        SELECT coalesce(sum(greatest(c.reltuples, 0)), 0)::bigint FROM tree JOIN pg_class c ON c.oid = tree.oid""",
                         (oid,)))


class _RowsPerSecond(ProgressColumn):
    def render(self, task: Task) -> Text:
        return Text(f"{task.speed:,.0f} rows/s" if task.speed else "", style="progress.data.speed")


class CopyProgress:
    """Shows a table's copy as it runs: on a terminal, a progress bar on stderr
    (rows, rows/s, time left from the estimate); off a terminal, a log line every
    `interval` seconds. `update(rows)` takes the rows copied so far, and passes
    them on to `on_update`."""

    def __init__(self, table: str, estimated_rows: int, interval: float,
                 on_update: Callable[[int], None]) -> None:
        self.table = table
        self.estimated_rows = estimated_rows
        self.interval = interval
        self.on_update = on_update
        self.started = self._logged = time.monotonic()
        self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                             _RowsPerSecond(), TimeRemainingColumn(), console=Console(stderr=True),
                             disable=not sys.stderr.isatty())
        self._task = self._bar.add_task(escape(f"copy {table}"), total=estimated_rows or None)

    def __enter__(self) -> CopyProgress:
        self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.stop()

    def update(self, rows: int) -> None:
        # beyond the estimate the time left is unknown
        self._bar.update(self._task, completed=rows, total=self.estimated_rows if rows <= self.estimated_rows else None)
        self.on_update(rows)
        now = time.monotonic()
        if self._bar.disable and now - self._logged >= self.interval:
            self._logged = now
            log.info("copy %s: %s", self.table, progress_line(rows, self.estimated_rows, now - self.started))

    def done(self, rows: int) -> None:
        self._bar.update(self._task, completed=rows, total=rows)


def progress_line(rows: int, estimated_rows: int, seconds: float) -> str:
    """'1,200,000 of ~2,000,000 rows (60%), 64,000 rows/s, ~12s left'; without the
    estimate (unknown, or passed) '2,100,000 rows, 64,000 rows/s'."""
    rate = rows / seconds if seconds > 0 else 0.0
    if not estimated_rows or rows > estimated_rows:
        return f"{rows:,} rows, {rate:,.0f} rows/s"
    left = f", ~{(estimated_rows - rows) / rate:.0f}s left" if rate else ""
    return f"{rows:,} of ~{estimated_rows:,} rows ({100 * rows // estimated_rows}%), {rate:,.0f} rows/s{left}"


def fetch_current_rows(conn: psycopg.Connection, table: CapturedTable, structure: TableStructure,
                       keys: Sequence[Sequence[Any]]) -> list[Sequence[Any]]:
    """The PK-only join-back: current rows of the given keys (as found in
    events: JSON values in key order), in one query. Keys whose row is gone,
    or outside the table's row filter, are simply not returned."""
    key_columns = structure.key_columns()
    record = sql.SQL(", ").join(sql.SQL("{} {}").format(sql.Identifier(c.name), sql.SQL(c.type))
                                for c in key_columns)
    join = sql.SQL(" AND ").join(sql.SQL("t.{0} = k.{0}").format(sql.Identifier(c.name)) for c in key_columns)
    # Arrays, composites and jsonb travel as their JSON text in a string (capture_row_json):
    # parse it back into a JSON value, which jsonb_to_recordset turns into the column's type.
    structured = [c.name for c in key_columns if c.category in ("A", "C") or c.base_type == "jsonb"]
    # The keys go in as a literal, not a parameter: with parameters, every % of the query
    # (in the row filter's SQL, in a column name) would be read as a placeholder.
    payload = sql.SQL("{}::jsonb").format(sql.Literal(json.dumps([dict(zip(structure.key, key)) for key in keys])))
    keys_json: sql.Composable = payload
    if structured:
        keys_json = sql.SQL("(SELECT jsonb_agg(e || jsonb_build_object({})) FROM jsonb_array_elements({}) e)"
                            ).format(sql.SQL(", ").join(sql.SQL("{0}, (e->>{0})::jsonb").format(sql.Literal(name))
                                                        for name in structured), payload)
    # the filter reads the table alone: a key column it names would be ambiguous beside k's
    query = sql.SQL("SELECT {expr}::text FROM (SELECT * FROM {table} WHERE {filter}) t"
                    " JOIN jsonb_to_recordset({keys}) AS k({record}) ON {join}").format(
        expr=_row_expr(conn, table, structure), table=_relation(conn, table), keys=keys_json,
        record=record, join=join, filter=_filter(table))
    texts = [row[0] for row in conn.execute(query)]
    return decode_rows(texts, structure.rows_decoder())
