"""The Python face of queue_sql: queues, tables, ticks, consumers and batches.

Every method is one call of a ``replicator.*`` SQL function, whose errors
become :class:`~replicator.errors.UserError` with the function's message.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

import psycopg
from psycopg.rows import dict_row

from replicator.errors import UserError
from replicator.source import db
from replicator.source.install import has_event_triggers, require_installed
from replicator.source.row_filter import check_row_filter
from replicator.wording import counted, format_age

BATCH_WORK_MEM = "64MB"

T = TypeVar("T")
# an event as a consumer reads it: ev_id, ev_txid, ev_time, ev_type, ev_table, ev_data, ev_old
EventRow = tuple[int, int, datetime, str, int, str | None, str | None]


@dataclass(frozen=True)
class BatchInfo:
    batch_id: int
    queue_id: int
    queue_name: str
    consumer_name: str
    prev_tick_id: int
    tick_id: int
    prev_tick_time: datetime
    tick_time: datetime
    prev_snapshot: str
    cur_snapshot: str
    prev_event_seq: int
    cur_event_seq: int
    lag_seconds: float  # how long ago, by the source's clock, the batch's last tick was taken


@dataclass(frozen=True)
class CapturedTable:
    queue_name: str
    table_id: int
    name: str          # schema.table
    mode: str          # 'full' or 'pk'
    key: list[str]
    ignore: list[str]
    row_filter: str | None
    columns: list[str]  # captured columns, in event value order
    oid: int
    structure: dict[str, Any] | None  # replicator.table_structure(); None if the table is gone
    suspended: str | None = None       # why capture stopped (replicator.suspend_capture)
    old_rows: bool = False             # updates and deletes queue their old rows too (--old-rows)
    capture: str = "statement"         # 'statement' or 'row' triggers (--capture)

    @property
    def schema(self) -> str:
        return self.structure["schema"] if self.structure else self.name.split(".", 1)[0]

    @property
    def table(self) -> str:
        return self.structure["name"] if self.structure else self.name.split(".", 1)[1]


_INTERVAL = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|msec|s|sec|m|min|h|hour|d|day)s?\s*$", re.IGNORECASE)
_UNIT_SECONDS = {"ms": 0.001, "msec": 0.001, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hour": 3600,
                 "d": 86400, "day": 86400}


def parse_duration(text: str) -> timedelta:
    """'500ms', '90s', '15min', '2h', '1d' or a bare number of seconds."""
    try:
        seconds = float(text)
    except ValueError:
        match = _INTERVAL.match(text)
        if not match:
            raise UserError(f"invalid duration {text!r}: use e.g. 500ms, 30s, 15min, 2h or 1d") from None
        seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2).lower()]
    try:
        return timedelta(seconds=seconds)
    except (OverflowError, ValueError):   # inf, nan, past 999999999 days
        raise UserError(f"invalid duration {text!r}: use e.g. 500ms, 30s, 15min, 2h or 1d") from None


def format_duration(value: timedelta) -> str:
    """A duration as parse_duration reads it: in the largest unit it is a whole number of
    (500ms, 90s, 15min, 2h, 1d), else in seconds."""
    ms = round(value.total_seconds() * 1000)
    if ms == 0:
        return "0s"
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("min", 60_000), ("s", 1000)):
        if ms and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms" if ms < 1000 else f"{ms / 1000:g}s"


class Source:
    """A source database with schema replicator installed."""

    def __init__(self, conn: psycopg.Connection, *, check_installed: bool = True) -> None:
        self.conn = conn
        if check_installed:
            require_installed(conn)

    @classmethod
    def connect(cls, dsn: str | None, **kwargs: Any) -> Source:
        return cls(db.connect(dsn, **kwargs))

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, query: str, params: tuple[Any, ...] = ()) -> Any:
        with db.user_errors():
            row = self.conn.execute(query, params).fetchone()
        return row[0] if row else None

    def _value(self, kind: type[T], query: str, params: tuple[Any, ...] = ()) -> T:
        """The one value a function call returns, of the type its SQL declares."""
        value = self._maybe(kind, query, params)
        if value is None:
            raise TypeError(f"{query} returned NULL")
        return value

    def _maybe(self, kind: type[T], query: str, params: tuple[Any, ...] = ()) -> T | None:
        value = self._call(query, params)
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"{query} returned {type(value).__name__}, not {kind.__name__}")
        return value

    def _rows(self, query: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        with db.user_errors(), self.conn.cursor(row_factory=dict_row) as cur:
            return cur.execute(query, params).fetchall()

    # queues -----------------------------------------------------------------

    def create_queue(self, name: str, *, ntables: int = 3, rotation_period: timedelta = timedelta(hours=2)) -> int:
        return self._value(int, "SELECT replicator.create_queue(%s, %s::integer, %s)", (name, ntables, rotation_period))

    def drop_queue(self, name: str) -> None:
        self._call("SELECT replicator.drop_queue(%s)", (name,))

    def set_queue_config(self, name: str, **settings: int | timedelta) -> None:
        """Changes queue settings (see replicator.set_queue_config): ticker_max_count,
        ticker_max_lag, ticker_idle_period, rotation_period, consumer_idle_limit; all or none."""
        with self.conn.transaction():
            for param, value in settings.items():
                text = f"{value.total_seconds()} seconds" if isinstance(value, timedelta) else str(value)
                self._call("SELECT replicator.set_queue_config(%s, %s, %s)", (name, param, text))

    def queue_config(self, name: str) -> dict[str, Any]:
        return self._rows("SELECT queue_ticker_max_count AS ticker_max_count, queue_ticker_max_lag AS ticker_max_lag,"
                          " queue_ticker_idle_period AS ticker_idle_period, queue_rotation_period AS rotation_period,"
                          " queue_consumer_idle_limit AS consumer_idle_limit,"
                          " queue_ntables AS ntables FROM replicator.find_queue(%s)", (name,))[0]

    def queues(self) -> list[dict[str, Any]]:
        return self._rows("SELECT * FROM replicator.queue_info()")

    def queue_id(self, name: str) -> int:
        return self._value(int, "SELECT (replicator.find_queue(%s)).queue_id", (name,))

    # tables -----------------------------------------------------------------

    def add_table(self, queue: str, table: str, *, mode: str = "full", key: list[str] | None = None,
                  ignore: list[str] | None = None, where: str | None = None, old_rows: bool = False,
                  capture: str = "statement") -> int:
        """Captures a table (replicator.add_table). The row filter is checked
        first (check_row_filter): nothing of it reaches the server unless it is
        one expression. The table, key and ignored columns travel as parameters
        (the server parses the name with to_regclass and matches the columns
        against the table's)."""
        check_row_filter(where, self_contained=where is not None and not has_event_triggers(self.conn))
        return self._value(int, "SELECT replicator.add_table(%s, %s, %s, %s, %s, %s, p_old_rows => %s,"
                          " p_capture => %s)",
                           (queue, table, mode, key or None, ignore or [], where, old_rows, capture))

    def alter_table(self, queue: str, table: str, *, mode: str | None = None, key: list[str] | None = None,
                    ignore: list[str] | None = None, where: str | None = None,
                    set_where: bool = False, old_rows: bool | None = None,
                    capture: str | None = None) -> dict[str, Any]:
        """Changes a table's capture settings in place (replicator.alter_table); None
        keeps a setting, as does where unless set_where. The row filter is checked as
        add_table checks it. Returns {"changed": [...], "copy": bool}."""
        if set_where:
            check_row_filter(where, self_contained=where is not None and not has_event_triggers(self.conn))
        return self._value(dict, "SELECT replicator.alter_table(%s, %s, %s, %s, %s, %s, %s, %s, %s)",
                           (queue, table, mode, key, ignore, where, set_where, old_rows, capture))

    def follow_schema(self, queue: str, schema: str, *, mode: str = "full") -> int:
        """Captures every table of a schema, now and as they are created; returns how many were added.
        The tables there now are captured a few hundred a transaction (replicator.capture_chunk): one
        interrupted leaves the schema followed and the tables captured so far; calling it again captures
        the rest."""
        added = 0
        while chunk := self._value(int, "SELECT replicator.follow_schema(%s, %s, %s)", (queue, schema, mode)):
            added += chunk
        return added

    def grant_consumer(self, role: str) -> int:
        """Lets a role run consumers; returns the number of captured tables it may read."""
        return self._value(int, "SELECT replicator.grant_consumer(%s)", (role,))

    def table_ids(self, queue: str) -> list[int]:
        """Ids of the queue's captured tables: cheap to poll for changes."""
        return self._value(list, "SELECT coalesce(array_agg(table_id ORDER BY table_id), '{}')"
                          " FROM replicator.captured_table WHERE queue_id = (replicator.find_queue(%s)).queue_id",
                          (queue,))

    def unfollow_schema(self, queue: str, schema: str) -> None:
        """Stops capturing the tables created later in a schema; those captured stay."""
        self._call("SELECT replicator.unfollow_schema(%s, %s)", (queue, schema))

    def remove_table(self, queue: str, table: str, *, drop_from_replicas: bool = False) -> int:
        """Stops capturing a table; with drop_from_replicas, consumers drop their copy
        when they reach this point of the queue, else they keep it as it is."""
        return self._value(int, "SELECT replicator.remove_table(%s, %s, %s)", (queue, table, drop_from_replicas))

    def followed_schemas(self, queue: str | None = None) -> list[dict[str, Any]]:
        """Schemas whose new tables a queue captures (all queues' when None)."""
        if queue is not None:
            self.queue_id(queue)
        return self._rows("SELECT queue_name AS queue, schema_name AS schema, mode, since"
                          " FROM replicator.schema_info(%s)", (queue,))

    def tables(self, queue: str | None = None) -> list[CapturedTable]:
        if queue is not None:
            self.queue_id(queue)
        return [_captured_table(r) for r in self._rows("SELECT * FROM replicator.table_info(%s)", (queue,))]

    def table(self, queue: str, table_id: int) -> CapturedTable | None:
        """One table of the queue, None when the queue captures it no more (table_info, a SQL function,
        is inlined: its structure is read for this table alone)."""
        rows = self._rows("SELECT * FROM replicator.table_info(%s) WHERE table_id = %s", (queue, table_id))
        return _captured_table(rows[0]) if rows else None

    def rows_per_statement(self, queue: str | None = None) -> dict[int, float]:
        """Mean rows per statement of each captured table with row events in the
        queue's last two event tables (replicator.statement_sizes: a bounded sample),
        by table id: what tells which capture kind fits a table."""
        if queue is not None:
            self.queue_id(queue)
        return {r["table_id"]: r["rows_per_statement"]
                for r in self._rows("SELECT * FROM replicator.statement_sizes(%s)", (queue,))}

    # ticks and maintenance ----------------------------------------------------

    def tick(self, queue: str | None = None, *, force: bool = False, follow_ddl: bool = True) -> int | None:
        """One ticker pass: on one queue (returns the new tick id or None) or on all
        queues (returns the number of ticks). DDL run directly on captured tables where no
        event trigger saw it is followed first (unless not follow_ddl), in a transaction of
        its own, so that the tick includes what it queued (by the installing owner's ticker:
        a consumer's role is not granted that, and its forced ticks only tick)."""
        if follow_ddl and self._call("SELECT has_function_privilege('replicator.follow_unseen_ddl(text)', 'EXECUTE')"):
            self._call("SELECT replicator.follow_unseen_ddl(%s)", (queue,))
        if queue is None:
            return self._maybe(int, "SELECT replicator.ticker()")
        return self._maybe(int, "SELECT replicator.ticker(%s, %s)", (queue, force))

    def ticker_heartbeat(self, host: str, pid: int, started: datetime, every: timedelta) -> None:
        """Records that a ticker daemon runs (replicator.ticker_heartbeat); call at most every `every`."""
        self._call("SELECT replicator.ticker_heartbeat(%s, %s, %s, %s)", (host, pid, started, every))

    def ticker_stopped(self, host: str, pid: int) -> None:
        self._call("SELECT replicator.ticker_stopped(%s, %s)", (host, pid))

    def tickers(self) -> list[dict[str, Any]]:
        """Ticker daemons seen in the last day, and whether each is running (replicator.ticker_info)."""
        return self._rows("SELECT * FROM replicator.ticker_info()")

    def latest_tick(self, queue: str) -> int | None:
        return self._maybe(int, "SELECT max(tick_id) FROM replicator.tick"
                          " WHERE tick_queue = (replicator.find_queue(%s)).queue_id", (queue,))

    def maint(self) -> dict[str, list[str]]:
        """Rotation and tick cleanup on every queue. Each step commits on its own:
        a switch must be committed before its step 2 runs. Temporary consumers left
        idle (their process killed) are unregistered first; a rotation overdue and
        still blocked says by what, at every pass."""
        done: dict[str, list[str]] = {}
        for q in self.queues():
            name = q["queue_name"]
            actions = done.setdefault(name, [])
            for consumer in self._rows("SELECT replicator.drop_idle_temporary_consumers(%s) AS name", (name,)):
                actions.append(f"temporary consumer {consumer['name']} unregistered: idle for more than"
                               f" {format_age(q['consumer_idle_limit'].total_seconds())}, its process gone")
            rotated = False
            with db.user_errors():
                try:
                    with self.conn.transaction():
                        self.conn.execute("SET LOCAL lock_timeout = '5s'")
                        row = self.conn.execute("SELECT replicator.maint_rotate_step1(%s)", (name,)).fetchone()
                        rotated = bool(row and row[0])
                        if rotated:
                            actions.append("rotated")
                except psycopg.errors.LockNotAvailable:
                    actions.append("rotation postponed: event table busy")
            if self._call("SELECT replicator.maint_rotate_step2()"):
                actions.append("switch completed")
            if not rotated and (overdue := self.rotation_overdue(name)):
                actions.append(overdue)
            deleted = self._call("SELECT replicator.maint_tick_cleanup(%s)", (name,))
            if deleted:
                actions.append(f"{counted(deleted, 'old tick')} deleted")
        return done

    def rotation_overdue(self, queue: str) -> str | None:
        """`rotation overdue by 1h 5min: blocked by ...` naming each blocker, when the
        queue's rotation period has passed and something blocks it; else None."""
        overdue = self._maybe(timedelta, "SELECT rotation_overdue FROM replicator.queue_info()"
                              " WHERE queue_name = %s", (queue,))
        blockers = self.rotation_blockers(queue) if overdue else []
        if overdue is None or not blockers:
            return None
        named = "; ".join(f"{b['kind']} {b['name']} ({b['detail']})" for b in blockers)
        return f"rotation overdue by {format_age(overdue.total_seconds())}: blocked by {named}"

    def rotation_blockers(self, queue: str) -> list[dict[str, Any]]:
        return self._rows("SELECT * FROM replicator.rotation_blockers(%s)", (queue,))

    # consumers and batches ----------------------------------------------------

    def register_consumer(self, queue: str, consumer: str, *, temporary: bool = False) -> int:
        """Registers a consumer (replicator.register_consumer); a temporary one is for one
        run: its process unregisters it, else maint once it is idle."""
        return self._value(int, "SELECT replicator.register_consumer(%s, %s, %s)", (queue, consumer, temporary))

    def unregister_consumer(self, queue: str, consumer: str) -> bool:
        return self._value(bool, "SELECT replicator.unregister_consumer(%s, %s)", (queue, consumer))

    def set_consumer_owner(self, queue: str, consumer: str, role: str) -> None:
        """Gives a consumer to another role (the owner of schema replicator only)."""
        self._call("SELECT replicator.set_consumer_owner(%s, %s, %s)", (queue, consumer, role))

    def consumers(self) -> list[dict[str, Any]]:
        return self._rows("SELECT * FROM replicator.consumer_info()")

    def set_consumer_position(self, queue: str, consumer: str, tick_id: int) -> None:
        self._call("SELECT replicator.set_consumer_position(%s, %s, %s)", (queue, consumer, tick_id))

    def next_batch(self, queue: str, consumer: str, max_events: int | None = None) -> int | None:
        return self._maybe(int, "SELECT replicator.next_batch(%s, %s, %s)", (queue, consumer, max_events))

    def batch_info(self, batch_id: int) -> BatchInfo:
        rows = self._rows("SELECT *, prev_snapshot::text AS prev_snap, cur_snapshot::text AS cur_snap,"
                          " extract(epoch FROM clock_timestamp() - tick_time)::float8 AS lag_seconds"
                          " FROM replicator.get_batch_info(%s)", (batch_id,))
        r = rows[0]
        return BatchInfo(batch_id=batch_id, queue_id=r["queue_id"], queue_name=r["queue_name"],
                         consumer_name=r["consumer_name"], prev_tick_id=r["prev_tick_id"], tick_id=r["tick_id"],
                         prev_tick_time=r["prev_tick_time"], tick_time=r["tick_time"],
                         prev_snapshot=r["prev_snap"], cur_snapshot=r["cur_snap"],
                         prev_event_seq=r["prev_event_seq"], cur_event_seq=r["cur_event_seq"],
                         lag_seconds=r["lag_seconds"])

    def batch_event_sql(self, batch_id: int, tables: list[int] | None = None) -> str:
        return self._value(str, "SELECT replicator.batch_event_sql(%s, %s)", (batch_id, tables))

    def batch_events(self, batch_id: int, tables: list[int] | None = None, chunk_size: int = 16,
                     chunk_bytes: int = 8 << 20) -> Iterator[EventRow]:
        """The batch's events in ev_id order, streamed through a server-side cursor:
        (ev_id, ev_txid, ev_time, ev_type, ev_table, ev_data, ev_old). ev_data and ev_old (the
        old rows of a table captured with them, else None) come as JSON text: decoding them is
        the consumer's job (consumer.py).

        An event holds up to 1000 rows, so a fixed number of events per fetch
        is no memory bound: after the first fetch (chunk_size events), each fetch asks for as many
        events as fit in about chunk_bytes of ev_data at the sizes seen so far
        (at least one, at most 1000)."""
        query = self.batch_event_sql(batch_id, tables)
        # (ev_old is asked for here, not by the SQL function: consumers of the version before read its columns)
        query = query.replace("ev_data FROM", "ev_data::text, ev_old::text FROM", 1)
        with self.conn.transaction(), self.conn.cursor(name=f"batch_{batch_id}") as cur:
            # The query sorts the batch by ev_id before the first row: in memory
            # for batches of up to ~100,000 small events, not through temp files.
            self.conn.execute(f"SET LOCAL work_mem = '{BATCH_WORK_MEM}'")
            cur.execute(query)
            count = chunk_size
            while True:
                rows = cur.fetchmany(count)
                if not rows:
                    return
                size = sum(len(r[5] or "") + len(r[6] or "") for r in rows) + 64 * len(rows)
                count = max(1, min(1000, chunk_bytes * len(rows) // size))
                yield from rows
                del rows

    def finish_batch(self, batch_id: int) -> bool:
        return self._value(bool, "SELECT replicator.finish_batch(%s)", (batch_id,))


def _captured_table(r: dict[str, Any]) -> CapturedTable:
    return CapturedTable(queue_name=r["queue_name"], table_id=r["table_id"], name=r["table_name"], mode=r["mode"],
                         key=r["key"], ignore=r["ignore"], row_filter=r["row_filter"], columns=r["columns"],
                         oid=r["table_oid"], structure=r["structure"], suspended=r["suspended"],
                         old_rows=r["old_rows"], capture=r["capture"])
