"""The queue as a Spark streaming source (PySpark's Python Data Source API).

    spark.dataSource.register(ReplicatorDataSource)   # get_session() does it
    changes = (spark.readStream.format("replicator")
               .option("dsn", "host=... dbname=app").option("queue", "main").load())

One row per changed row (statement-level events are split into their items):

    tick    the tick closing the change's batch: the first tick whose snapshot
            sees the transaction (the same for every source of the queue)
    ev_id   event id (queue order); item: the row's index in the event
    txid, time
    op      I, U, D (rows), T (truncate), S (schema change)
    table   schema.table as of the change
    key     JSON array of the key values (I, U, D)
    row     JSON object of the row (I, U of full-mode tables); for S the event
            data (statement, kind, resulting structure)

Values are in the capture encoding: numerics keep their digits, json,
arrays and composites are their JSON text, bytea is \\x-hex text.

Offsets are ticks: {"tick": N, "layouts": {...}}. Spark checkpoints them; a
micro-batch (start, end] holds the events of transactions visible in tick
end's snapshot and not in tick start's, split into ev_id ranges that
executors fetch in parallel (option "partitions"). The layouts (columns and
key of each table as of the offset's tick) are carried forward through the S
events of each range, so rows are labelled with the columns they were
captured with even across DDL. When Spark commits an offset, the source
consumer (option "consumer", default spark_<queue>) moves to its tick: the
queue can rotate past it. latestOffset ticks the queue when events wait
behind its last tick, so a query sees what was committed before it ran.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

from replicator.source import db
from replicator.source.snapshots import txid_visible

try:  # PySpark >= 4.1
    from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow
except ImportError:  # pragma: no cover
    class SupportsTriggerAvailableNow:  # type: ignore[no-redef]
        pass

SCHEMA = ("tick BIGINT, ev_id BIGINT, item INT, txid BIGINT, time TIMESTAMP, op STRING, `table` STRING, "
          "key STRING, row STRING")
DEFAULT_PARTITIONS = 4


class _Number(str):
    """A JSON number that is not an integer, kept as its text."""


def _loads(text: str) -> Any:
    return json.loads(text, parse_float=_Number)


def _dump(value: Any) -> str:
    if isinstance(value, _Number):
        return str.__str__(value)
    return json.dumps(value, ensure_ascii=False)


def _object(names: list[str], values: list[Any]) -> str:
    return "{" + ", ".join(f"{json.dumps(n, ensure_ascii=False)}: {_dump(v)}" for n, v in zip(names, values)) + "}"


def _array(values: list[Any]) -> str:
    return "[" + ", ".join(_dump(v) for v in values) + "]"


def _window_sql(conn: psycopg.Connection, queue_id: int, prev_snapshot: str, cur_snapshot: str) -> str:
    """The query of the events between two ticks, as a batch's (replicator.window_event_sql)."""
    try:
        sql: str = db.scalar(conn, "SELECT replicator.window_event_sql(%s, %s, %s)",
                        (queue_id, prev_snapshot, cur_snapshot))
    except psycopg.errors.UndefinedFunction:
        raise RuntimeError("the source's schema replicator is older than this package (no "
                           "replicator.window_event_sql): run `replicator install` there") from None
    return sql


def _layout(data: dict[str, Any]) -> dict[str, Any]:
    return {"name": f"{data['schema']}.{data['name']}", "columns": list(data.get("columns") or []),
            "key": list(data.get("key") or []), "mode": data.get("mode", "full")}


@dataclass
class ReplicatorPartition(InputPartition):
    dsn: str
    event_sql: str                     # the window's events (replicator.window_event_sql)
    lo: int | None                     # ev_id > lo (None: unbounded)
    hi: int | None                     # ev_id <= hi (None: unbounded)
    ticks: list[tuple[int, str]]       # (tick id, snapshot) of the ticks in (start, end], ascending
    layouts: dict[str, Any]            # as of the start tick
    timeline: list[tuple[int, str, Any]] = field(default_factory=list)  # (ev_id, table id, layout|None)


class ReplicatorDataSource(DataSource):
    """format("replicator"): options dsn, queue; consumer, partitions, maxEventsPerTrigger."""

    @classmethod
    def name(cls) -> str:
        return "replicator"

    def schema(self) -> str:
        return SCHEMA

    def streamReader(self, schema: Any) -> ReplicatorStreamReader:
        return ReplicatorStreamReader(dict(self.options))


class ReplicatorStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, options: dict[str, str]) -> None:
        options = {k.lower(): v for k, v in options.items()}
        missing = [o for o in ("dsn", "queue") if not options.get(o)]
        if missing:
            raise ValueError(f"format('replicator') needs option(s) {', '.join(missing)}")
        self.dsn = options["dsn"]
        self.queue = options["queue"]
        self.consumer = options.get("consumer") or f"spark_{self.queue}"
        self.partitions_count = max(1, int(options.get("partitions", DEFAULT_PARTITIONS)))
        self.max_events = int(options["maxeventspertrigger"]) if options.get("maxeventspertrigger") else None
        self._last: dict[str, Any] | None = None
        self._until: int | None = None     # Trigger.AvailableNow: the last tick to read

    # connections -------------------------------------------------------------------

    def _connect(self) -> psycopg.Connection:
        return psycopg.connect(self.dsn, autocommit=True, application_name=f"replicator spark {self.consumer}")

    def _queue(self, conn: psycopg.Connection) -> int:
        queue_id: int = db.scalar(conn, "SELECT (replicator.find_queue(%s)).queue_id", (self.queue,))
        return queue_id

    def _catalog_layouts(self, conn: psycopg.Connection) -> dict[str, Any]:
        rows = conn.execute("SELECT table_id, table_name, mode, key, columns FROM replicator.table_info(%s)",
                            (self.queue,)).fetchall()
        return {str(tid): {"name": name, "columns": list(columns), "key": list(key), "mode": mode}
                for tid, name, mode, key, columns in rows}

    # offsets -------------------------------------------------------------------------

    def initialOffset(self) -> dict[str, Any]:
        with self._connect() as conn:
            tick = db.scalar(conn, "SELECT replicator.register_consumer(%s, %s)", (self.queue, self.consumer))
            self._last = {"tick": tick, "layouts": self._catalog_layouts(conn)}
        return self._last

    def getDefaultReadLimit(self) -> Any:
        from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows
        if self.max_events:
            return ReadMaxRows(self.max_events)
        return ReadAllAvailable()

    def _tick(self, conn: psycopg.Connection, queue_id: int) -> int | None:
        """The queue's latest tick, after ticking it if events wait behind its last tick.
        None: the queue has no tick yet and another ticker holds it (making its first)."""
        last = conn.execute("SELECT tick_id, tick_event_seq FROM replicator.tick WHERE tick_queue = %s"
                            " ORDER BY tick_id DESC LIMIT 1", (queue_id,)).fetchone()
        # A queue that never ticked has no tick yet: make its first.
        if last is not None and db.scalar(conn, "SELECT replicator.last_event_id(%s)", (queue_id,)) <= last[1]:
            latest: int = last[0]
            return latest
        tick: int | None = db.scalar(conn, "SELECT replicator.ticker(%s, true)", (self.queue,))
        if tick is not None:
            return tick
        newest: int | None = db.scalar(conn, "SELECT max(tick_id) FROM replicator.tick WHERE tick_queue = %s",
                                  (queue_id,))
        return newest

    def prepareForTriggerAvailableNow(self) -> None:
        with self._connect() as conn:
            queue_id = self._queue(conn)
            self._until = self._tick(conn, queue_id)

    def latestOffset(self, start: dict[str, Any] | None = None, limit: Any = None) -> dict[str, Any]:
        start = start or self._last or self.initialOffset()
        max_rows = getattr(limit, "max_rows", None)
        with self._connect() as conn:
            queue_id = self._queue(conn)
            until = self._until if self._until is not None else self._tick(conn, queue_id)
            found = conn.execute("SELECT tick_event_seq FROM replicator.tick WHERE tick_queue = %s"
                                 " AND tick_id = %s", (queue_id, start["tick"])).fetchone()
            if found is None:
                raise _rotated_past(self.queue, start["tick"], until)
            start_seq = found[0]
            end = db.scalar(
                conn, "SELECT coalesce(max(tick_id) FILTER (WHERE tick_event_seq - %s <= %s), min(tick_id))"
                " FROM replicator.tick WHERE tick_queue = %s AND tick_id > %s AND tick_id <= %s",
                (start_seq, max_rows if max_rows is not None else 2**62, queue_id, start["tick"], until))
            if end is None:
                return start
            # tables added since the start offset: as the catalog has them (their DDL since is in the S events)
            layouts = {**self._catalog_layouts(conn), **start["layouts"]}
            for _ev_id, table_id, layout in self._timeline(conn, start["tick"], end, queue_id):
                if layout is None:
                    layouts.pop(table_id, None)
                else:
                    layouts[table_id] = layout
        self._last = {"tick": end, "layouts": layouts}
        return self._last

    def _snapshots(self, conn: psycopg.Connection, queue_id: int, start: int, end: int) -> list[tuple[int, str]]:
        return [(t, s) for t, s in conn.execute(
            "SELECT tick_id, tick_snapshot::text FROM replicator.tick WHERE tick_queue = %s"
            " AND tick_id BETWEEN %s AND %s ORDER BY tick_id", (queue_id, start, end))]

    def _timeline(self, conn: psycopg.Connection, start: int, end: int,
                  queue_id: int) -> list[tuple[int, str, Any]]:
        """The S events of (start, end]: (ev_id, table id, layout after it, None when dropped, or
        suspended and removed since)."""
        ticks = self._snapshots(conn, queue_id, start, end)
        events = _window_sql(conn, queue_id, ticks[0][1], ticks[-1][1])
        out = []
        for ev_id, table_id, data in conn.execute(f"SELECT ev_id, ev_table, ev_data::text FROM ({events}) w"
                                                  " WHERE ev_type = 'S' ORDER BY ev_id"):
            event = json.loads(data)
            if event.get("kind") == "suspended" and conn.execute(
                    "SELECT 1 FROM replicator.captured_table WHERE table_id = %s", (table_id,)).fetchone():
                # a DDL no event trigger saw took what its capture needs (replicator.suspend_capture)
                raise RuntimeError(f"event {ev_id}: {event.get('reason')}; its capture is suspended and the "
                                   f"stream stops here: {event.get('hint')}")
            out.append((ev_id, str(table_id),
                        None if event.get("kind") in ("dropped", "suspended") else _layout(event)))
        return out

    # micro-batches --------------------------------------------------------------------

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[ReplicatorPartition]:
        if start["tick"] == end["tick"]:
            return []
        with self._connect() as conn:
            queue_id = self._queue(conn)
            ticks = self._snapshots(conn, queue_id, start["tick"], end["tick"])
            if not ticks or ticks[0][0] != start["tick"] or ticks[-1][0] != end["tick"]:
                raise _rotated_past(self.queue, start["tick"], end["tick"])
            seqs: dict[int, int] = dict(conn.execute(
                "SELECT tick_id, tick_event_seq FROM replicator.tick WHERE tick_queue = %s AND tick_id IN (%s, %s)",
                (queue_id, start["tick"], end["tick"])).fetchall())
            timeline = self._timeline(conn, start["tick"], end["tick"], queue_id)
            layouts = {**self._catalog_layouts(conn), **start["layouts"]}
            events = _window_sql(conn, queue_id, ticks[0][1], ticks[-1][1])
        lo, hi = seqs[start["tick"]], seqs[end["tick"]]
        n = max(1, min(self.partitions_count, hi - lo))
        bounds = [lo + (hi - lo) * i // n for i in range(n + 1)]
        self._last = end
        return [ReplicatorPartition(dsn=self.dsn, event_sql=events, lo=None if i == 0 else bounds[i],
                                    hi=None if i == n - 1 else bounds[i + 1], ticks=ticks[1:],
                                    layouts=layouts, timeline=timeline)
                for i in range(n)]

    # Spark hands read() the partitions partitions() made: narrower than the base's InputPartition
    def read(self, partition: ReplicatorPartition) -> Iterator[tuple[Any, ...]]:  # type: ignore[override]
        return read_partition(partition)

    def commit(self, end: dict[str, Any]) -> None:
        """Spark has the micro-batch up to `end`: the source consumer moves there."""
        with self._connect() as conn:
            conn.execute("SELECT replicator.set_consumer_position(%s, %s, %s)",
                         (self.queue, self.consumer, end["tick"]))
        self._last = end

    def stop(self) -> None:
        pass


def _rotated_past(queue: str, start: int, end: int | None) -> RuntimeError:
    return RuntimeError(f"ticks {start}..{end} of queue {queue} no longer exist: the query is too far behind "
                        f"(the queue rotated past it). Restart it with a new checkpoint location: it starts at "
                        f"the queue's current position, without the changes in between")


def read_partition(p: ReplicatorPartition) -> Iterator[tuple[Any, ...]]:
    """The rows of one partition, in ev_id order (runs on an executor)."""
    bounds = [(" AND ev_id > %s", p.lo), (" AND ev_id <= %s", p.hi)]
    where = "".join(condition for condition, bound in bounds if bound is not None)
    params = [bound for _, bound in bounds if bound is not None]
    changes: dict[str, tuple[list[int], list[Any]]] = {}
    for ev_id, table_id, layout in p.timeline:
        ids, layouts = changes.setdefault(table_id, ([], []))
        ids.append(ev_id)
        layouts.append(layout)
    tick_snapshots = [s for _, s in p.ticks]
    tick_ids = [t for t, _ in p.ticks]
    with psycopg.connect(p.dsn, autocommit=False, application_name="replicator spark reader") as conn:
        with conn.cursor(name="replicator_spark_events") as cur:
            cur.itersize = 2000
            cur.execute(f"SELECT ev_id, ev_txid, ev_time, ev_type, ev_table, ev_data::text FROM ({p.event_sql}) w"
                        f" WHERE true{where} ORDER BY ev_id", params)
            for ev_id, txid, ev_time, ev_type, table_id, data in cur:
                table_key = str(table_id)
                layout = p.layouts.get(table_key)
                if table_key in changes:
                    ids, layouts = changes[table_key]
                    i = bisect.bisect_left(ids, ev_id)
                    if i > 0:
                        layout = layouts[i - 1] or layout
                # the first tick whose snapshot sees the transaction (snapshots only grow)
                lo_i, hi_i = 0, len(tick_snapshots) - 1
                while lo_i < hi_i:
                    mid = (lo_i + hi_i) // 2
                    if txid_visible(txid, tick_snapshots[mid]):
                        hi_i = mid
                    else:
                        lo_i = mid + 1
                tick = tick_ids[lo_i]
                if ev_type == "S":
                    event = json.loads(data)
                    name = f"{event.get('schema')}.{event.get('name')}"
                    yield (tick, ev_id, 0, txid, ev_time, ev_type, name, None, data)
                    continue
                name = layout["name"] if layout else f"table {table_id}"
                if ev_type == "T":
                    yield (tick, ev_id, 0, txid, ev_time, ev_type, name, None, None)
                    continue
                items = _loads(data)
                if layout is not None and layout["mode"] == "full" and ev_type != "D":
                    columns = layout["columns"]
                    positions = [columns.index(k) for k in layout["key"]]
                    for i, item in enumerate(items):
                        yield (tick, ev_id, i, txid, ev_time, ev_type, name,
                               _array([item[k] for k in positions]), _object(columns, item))
                else:
                    for i, item in enumerate(items):
                        yield (tick, ev_id, i, txid, ev_time, ev_type, name, _array(item), None)
        conn.rollback()
