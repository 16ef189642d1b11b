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

With option "table" (schema.table), one typed row per change of that table
instead: its columns with Spark types, then _change_type, _commit_version,
_commit_timestamp, _txid, _event_time, _ev_id, _item (replicator.streaming.typed).
The schema is read from the source when the stream is defined (load()); a
column added later stops the query before the first change that has it
(option schemaEvolutionMode: addNewColumns, the default; none: carry on
without it), so that a stream defined again shows it.

Offsets are ticks: {"tick": N, "layouts": {...}}. Spark checkpoints them; a
micro-batch (start, end] holds the events of transactions visible in tick
end's snapshot and not in tick start's, split into ev_id ranges that
executors fetch in parallel (option "partitions"). The layouts (columns and
key of each table as of the offset's tick) are carried forward through the S
events of each range, so rows are labelled with the columns they were
captured with even across DDL. When Spark commits an offset, the source
consumer (option "consumer", default spark_<queue>, spark_<queue>_<table> for a
typed stream) moves to its tick: the
queue can rotate past it. latestOffset ticks the queue when events wait
behind its last tick, so a query sees what was committed before it ran.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

from replicator.source import db
from replicator.source.txid_snapshot import txid_visible
from replicator.streaming.typed import EVOLUTION_MODES, TypedSchema, layout_structure, spark_schema, typed_batches

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


def _window_sql(conn: psycopg.Connection, queue_id: int, prev_snapshot: str, cur_snapshot: str,
                tables: list[int] | None) -> str:
    """The query of the events between two ticks, as a batch's (replicator.window_event_sql)."""
    try:
        sql: str = db.scalar(conn, "SELECT replicator.window_event_sql(%s, %s, %s, %s)",
                             (queue_id, prev_snapshot, cur_snapshot, tables))
    except psycopg.errors.UndefinedFunction:
        raise RuntimeError("the source's schema replicator is older than this package (no "
                           "replicator.window_event_sql): run `replicator install` there") from None
    return sql


def _layout(data: dict[str, Any], *, typed: bool) -> dict[str, Any]:
    """A table's layout from an S event's data; a typed stream's also has its columns' types."""
    layout = {"name": f"{data['schema']}.{data['name']}", "columns": list(data.get("columns") or []),
              "key": list(data.get("key") or []), "mode": data.get("mode", "full")}
    if typed:
        layout["structure"] = layout_structure(data["structure"], layout["columns"], layout["key"])
    return layout


def _qualified(table: str) -> str:
    return table if "." in table else f"public.{table}"


def _find_table(conn: psycopg.Connection, queue: str, table: str) -> tuple[str, dict[str, Any]]:
    """(table id, typed layout) of a table the queue captures, as the catalog has it now."""
    name = _qualified(table)
    for table_id, layout in _catalog_layouts(conn, queue, typed=True).items():
        if layout["name"] == name and "structure" in layout:
            return table_id, layout
    raise ValueError(f"table {name} is not captured by queue {queue} (replicator table add {queue} {name})")


def _catalog_layouts(conn: psycopg.Connection, queue: str, *, typed: bool,
                     table_id: str | None = None) -> dict[str, Any]:
    """The layouts of the queue's tables (of one table: table_id) as the catalog has them now."""
    rows = conn.execute("SELECT table_id, table_name, mode, key, columns, structure FROM replicator.table_info(%s)"
                        " WHERE %s::int IS NULL OR table_id = %s::int", (queue, table_id, table_id)).fetchall()
    layouts = {}
    for tid, name, mode, key, columns, structure in rows:
        layout = {"name": name, "columns": list(columns), "key": list(key), "mode": mode}
        if typed and structure is not None:
            layout["structure"] = layout_structure(structure, layout["columns"], layout["key"])
        layouts[str(tid)] = layout
    return layouts


def _first_tick(txid: int, ticks: list[tuple[int, str, datetime]]) -> int:
    """The index of the first of the ticks whose snapshot sees the transaction (snapshots only grow)."""
    lo, hi = 0, len(ticks) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if txid_visible(txid, ticks[mid][1]):
            hi = mid
        else:
            lo = mid + 1
    return lo


@dataclass
class ReplicatorPartition(InputPartition):
    dsn: str
    event_sql: str                     # the window's events (replicator.window_event_sql)
    lo: int | None                     # ev_id > lo (None: unbounded)
    hi: int | None                     # ev_id <= hi (None: unbounded)
    ticks: list[tuple[int, str, datetime]]   # (tick id, snapshot, time) of the ticks in (start, end], ascending
    layouts: dict[str, Any]            # as of the start tick
    timeline: list[tuple[int, str, Any]] = field(default_factory=list)  # (ev_id, table id, layout|None)


class ReplicatorDataSource(DataSource):
    """format("replicator"): options dsn, queue; consumer, partitions, maxEventsPerTrigger; table,
    schemaEvolutionMode."""

    @classmethod
    def name(cls) -> str:
        return "replicator"

    def schema(self) -> Any:
        """The untyped rows' schema; with option table, that table's typed rows' (read from the source)."""
        options = _options(dict(self.options))
        if not options.get("table"):
            return SCHEMA
        with psycopg.connect(options["dsn"], autocommit=True, application_name="replicator spark schema") as conn:
            db.scalar(conn, "SELECT (replicator.find_queue(%s)).queue_id", (options["queue"],))
            _table_id, layout = _find_table(conn, options["queue"], options["table"])
        return spark_schema(layout)

    def streamReader(self, schema: Any) -> ReplicatorStreamReader:
        return ReplicatorStreamReader(dict(self.options), schema)


def _options(options: dict[str, str]) -> dict[str, str]:
    options = {k.lower(): v for k, v in options.items()}
    missing = [o for o in ("dsn", "queue") if not options.get(o)]
    if missing:
        raise ValueError(f"format('replicator') needs option(s) {', '.join(missing)}")
    mode = options.get("schemaevolutionmode", EVOLUTION_MODES[0])
    if mode not in EVOLUTION_MODES:
        raise ValueError(f"format('replicator'): option schemaEvolutionMode is {mode!r}: use "
                         f"{' or '.join(EVOLUTION_MODES)}")
    return options


class ReplicatorStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, options: dict[str, str], schema: Any = None) -> None:
        options = _options(options)
        self.dsn = options["dsn"]
        self.queue = options["queue"]
        # a typed stream: the table's name, the query's schema (its types and attnums)
        self.table = _qualified(options["table"]) if options.get("table") else None
        self.typed = TypedSchema.from_spark(schema) if self.table else None
        self.new_columns_stop = options.get("schemaevolutionmode", EVOLUTION_MODES[0]) == "addNewColumns"
        self._table_id: str | None = None
        self.consumer = options.get("consumer") or (f"spark_{self.queue}_{self.table}" if self.table
                                                     else f"spark_{self.queue}")
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

    def _tables(self, conn: psycopg.Connection) -> list[int] | None:
        """The table ids whose events the stream reads: a typed stream's table, else all (None)."""
        if self.table is None:
            return None
        if self._table_id is None:
            self._table_id = _find_table(conn, self.queue, self.table)[0]
        return [int(self._table_id)]

    def _catalog_layouts(self, conn: psycopg.Connection) -> dict[str, Any]:
        tables = self._tables(conn)
        return _catalog_layouts(conn, self.queue, typed=tables is not None,
                                table_id=None if tables is None else str(tables[0]))

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
            catalog = self._catalog_layouts(conn)
            layouts = {**catalog, **start["layouts"]}
            ticks = self._snapshots(conn, queue_id, start["tick"], end)
            timeline = self._timeline(conn, ticks, queue_id)
            if self.typed is not None and self.new_columns_stop:
                ticks, timeline = self._before_new_columns(ticks, timeline, layouts, catalog)
            for _ev_id, _txid, table_id, layout in timeline:
                if layout is None:
                    layouts.pop(table_id, None)
                else:
                    layouts[table_id] = layout
        self._last = {"tick": ticks[-1][0], "layouts": layouts}
        return self._last

    def _before_new_columns(self, ticks: list[tuple[int, str, datetime]], timeline: list[tuple[int, int, str, Any]],
                            layouts: dict[str, Any], catalog: dict[str, Any]
                            ) -> tuple[list[tuple[int, str, datetime]], list[tuple[int, int, str, Any]]]:
        """A typed stream's range cut before the tick of the first change of its table that has a column
        the query's schema lacks and the table still has (a stream defined again shows it); raises
        when that is the range's first tick. Columns dropped since are not waited for."""
        typed, table_id = self.typed, self._table_id
        assert typed is not None and table_id is not None
        now = catalog.get(table_id)
        lacking = {c.attnum: c.name for c in typed.unshown(now)} if now else {}

        def has_lacking(layout: dict[str, Any] | None) -> bool:
            return layout is not None and any(c.attnum in lacking for c in typed.unshown(layout))

        if not lacking:
            return ticks, timeline
        # the index in ticks of the first tick whose rows may have one: 0 when the start layout has it
        at = 0 if has_lacking(layouts.get(table_id)) else next(
            (_first_tick(txid, ticks[1:]) + 1 for _, txid, _, layout in timeline if has_lacking(layout)), None)
        if at is None:
            return ticks, timeline
        if at <= 1:
            raise RuntimeError(
                f"{self.table} has column(s) {', '.join(lacking.values())} from tick {ticks[at][0]} on that this "
                f"query's schema, fixed when the stream was defined, lacks: the query stops here, having delivered "
                f"every change before. Define the stream again (load() reads the table's columns) and start it from "
                f"the same checkpoint to read them (or set option schemaEvolutionMode to none: go on without them)")
        return ticks[:at], [e for e in timeline if _first_tick(e[1], ticks[1:]) + 1 < at]

    def _snapshots(self, conn: psycopg.Connection, queue_id: int, start: int,
                   end: int) -> list[tuple[int, str, datetime]]:
        return [(t, s, time) for t, s, time in conn.execute(
            "SELECT tick_id, tick_snapshot::text, tick_time FROM replicator.tick WHERE tick_queue = %s"
            " AND tick_id BETWEEN %s AND %s ORDER BY tick_id", (queue_id, start, end))]

    def _timeline(self, conn: psycopg.Connection, ticks: list[tuple[int, str, datetime]],
                  queue_id: int) -> list[tuple[int, int, str, Any]]:
        """The S events between the first and the last of the ticks: (ev_id, txid, table id, layout
        after it, None when dropped, or suspended and removed since)."""
        events = _window_sql(conn, queue_id, ticks[0][1], ticks[-1][1], self._tables(conn))
        out = []
        for ev_id, txid, table_id, data in conn.execute(
                f"SELECT ev_id, ev_txid, ev_table, ev_data::text FROM ({events}) w WHERE ev_type = 'S' ORDER BY ev_id"):
            event = json.loads(data)
            if event.get("kind") == "suspended" and conn.execute(
                    "SELECT 1 FROM replicator.captured_table WHERE table_id = %s", (table_id,)).fetchone():
                # a DDL no event trigger saw took what its capture needs (replicator.suspend_capture)
                raise RuntimeError(f"event {ev_id}: {event.get('reason')}; its capture is suspended and the "
                                   f"stream stops here: {event.get('hint')}")
            out.append((ev_id, txid, str(table_id), None if event.get("kind") in ("dropped", "suspended")
                        else _layout(event, typed=self.typed is not None)))
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
            timeline = [(ev_id, table_id, layout)
                        for ev_id, _, table_id, layout in self._timeline(conn, ticks, queue_id)]
            layouts = {**self._catalog_layouts(conn), **start["layouts"]}
            events = _window_sql(conn, queue_id, ticks[0][1], ticks[-1][1], self._tables(conn))
        lo, hi = seqs[start["tick"]], seqs[end["tick"]]
        n = max(1, min(self.partitions_count, hi - lo))
        bounds = [lo + (hi - lo) * i // n for i in range(n + 1)]
        self._last = end
        return [ReplicatorPartition(dsn=self.dsn, event_sql=events, lo=None if i == 0 else bounds[i],
                                    hi=None if i == n - 1 else bounds[i + 1], ticks=ticks[1:],
                                    layouts=layouts, timeline=timeline)
                for i in range(n)]

    # Spark hands read() the partitions partitions() made: narrower than the base's InputPartition
    def read(self, partition: ReplicatorPartition) -> Iterator[Any]:  # type: ignore[override]
        if self.typed is not None:
            return typed_batches(partition_events(partition), self.typed)
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


def partition_events(p: ReplicatorPartition) -> Iterator[tuple[Any, ...]]:
    """The events of one partition in ev_id order, each with its tick and its table's layout:
    (tick, tick time, layout, ev_id, txid, ev_time, ev_type, table id, data)."""
    bounds = [(" AND ev_id > %s", p.lo), (" AND ev_id <= %s", p.hi)]
    where = "".join(condition for condition, bound in bounds if bound is not None)
    params = [bound for _, bound in bounds if bound is not None]
    changes: dict[str, tuple[list[int], list[Any]]] = {}
    for ev_id, table_id, layout in p.timeline:
        ids, layouts = changes.setdefault(table_id, ([], []))
        ids.append(ev_id)
        layouts.append(layout)
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
                tick, _, tick_time = p.ticks[_first_tick(txid, p.ticks)]
                yield tick, tick_time, layout, ev_id, txid, ev_time, ev_type, table_id, data
        conn.rollback()


def read_partition(p: ReplicatorPartition) -> Iterator[tuple[Any, ...]]:
    """The untyped rows of one partition, in ev_id order (runs on an executor)."""
    for tick, _, layout, ev_id, txid, ev_time, ev_type, table_id, data in partition_events(p):
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
