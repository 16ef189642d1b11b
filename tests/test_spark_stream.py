"""The queue as a Spark streaming source: a checkpointed query replays exactly
the queue's events, in order, across a restart; executors read partitions
in parallel; committed offsets move the source consumer. With option table,
typed rows of one table: its values as Spark types, equal to the source's.

The oracle reads the same queue through another consumer, batch by batch
(one tick each), and labels rows with the columns of the S events it saw.
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import psycopg
import pytest

pytest.importorskip("pyspark")

from replicator.source import Source
from replicator.streaming.datasource import ReplicatorDataSource, ReplicatorStreamReader, read_partition


def layouts_now(source: Source) -> dict[int, tuple[Any, ...]]:
    return {t.table_id: (t.name, t.columns, t.key, t.mode) for t in source.tables("q")}


def oracle(source: Source, layouts: dict[int, tuple[Any, ...]], consumer: str = "oracle") -> list[tuple[Any, ...]]:
    """(tick, ev_id, item, op, table, key, row) of every event the consumer has not read, in order;
    layouts: the tables' layouts when the consumer was registered."""
    layouts = dict(layouts)
    out = []
    while (batch_id := source.next_batch("q", consumer)) is not None:
        tick = source.batch_info(batch_id).tick_id
        for ev_id, _txid, _time, ev_type, table_id, data, _old in source.batch_events(batch_id):
            value = None if data is None else json.loads(data, parse_float=Decimal)
            if ev_type == "S":
                layouts[table_id] = (f"{value['schema']}.{value['name']}", value.get("columns"), value.get("key"),
                                     value.get("mode"))
                out.append((tick, ev_id, 0, "S", f"{value['schema']}.{value['name']}", None, value))
                continue
            name, columns, key, mode = layouts[table_id]
            if ev_type == "T":
                out.append((tick, ev_id, 0, "T", name, None, None))
                continue
            for i, item in enumerate(value):
                if ev_type == "D" or mode == "pk":
                    out.append((tick, ev_id, i, ev_type, name, item, None))
                else:
                    row = dict(zip(columns, item))
                    out.append((tick, ev_id, i, ev_type, name, [row[k] for k in key], row))
        source.finish_batch(batch_id)
    return out


def stream_rows(spark, path) -> list[tuple[Any, ...]]:
    rows = spark.read.parquet(str(path)).orderBy("ev_id", "item").collect()
    return [(r["tick"], r["ev_id"], r["item"], r["op"], r["table"],
             None if r["key"] is None else json.loads(r["key"], parse_float=Decimal),
             None if r["row"] is None else json.loads(r["row"], parse_float=Decimal)) for r in rows]


def run_query(spark, dsn: str, sink, checkpoint, **options: str) -> None:
    reader = (spark.readStream.format("replicator").option("dsn", dsn).option("queue", "q")
              .option("partitions", "3"))
    for k, v in options.items():
        reader = reader.option(k, v)
    query = (reader.load().writeStream.format("parquet").option("path", str(sink))
             .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start())
    query.awaitTermination(240)
    assert query.exception() is None, query.exception()


def writes_part_one(conn: psycopg.Connection, source: Source) -> None:
    conn.execute("INSERT INTO t SELECT g, 'v' || g, g * 1.50 FROM generate_series(1, 50) g")
    source.tick("q", force=True)
    with conn.transaction():
        conn.execute("UPDATE t SET v = 'updated' WHERE id % 5 = 0")
        conn.execute("DELETE FROM t WHERE id > 45")
    conn.execute("UPDATE t SET id = id + 100 WHERE id = 1")   # key change: D of 1, U of 101
    conn.execute("INSERT INTO s.u VALUES ('a', 1, '{\"x\": [1, 2.50]}')")
    source.tick("q", force=True)
    conn.execute("INSERT INTO t VALUES (200, 'tail', 0.001)")   # ticked by the query itself


def writes_part_two(conn: psycopg.Connection, source: Source) -> None:
    conn.execute("ALTER TABLE t ADD COLUMN extra int")
    conn.execute("INSERT INTO t VALUES (300, 'with extra', 3, 33)")
    conn.execute("ALTER TABLE t DROP COLUMN v")
    conn.execute("UPDATE t SET extra = 7 WHERE id = 300")
    source.tick("q", force=True)
    conn.execute("TRUNCATE s.u")
    conn.execute("INSERT INTO t (id, n, extra) SELECT g, g, g FROM generate_series(400, 420) g")


def setup_queue(conn: psycopg.Connection, source: Source) -> dict[int, tuple[Any, ...]]:
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text, n numeric)")
    conn.execute("CREATE SCHEMA s; CREATE TABLE s.u (k text, j int, doc jsonb, PRIMARY KEY (k, j))")
    source.create_queue("q")
    source.add_table("q", "t")
    source.add_table("q", "s.u", mode="pk")
    source.register_consumer("q", "oracle")
    source.register_consumer("q", "spark_q")   # the stream's consumer starts with the oracle
    return layouts_now(source)


def test_checkpointed_query_replays_the_queue_exactly_once_in_order(dsn, conn, source, tmp_path, spark):
    layouts = setup_queue(conn, source)
    sink, checkpoint = tmp_path / "sink", tmp_path / "checkpoint"
    writes_part_one(conn, source)
    run_query(spark, dsn, sink, checkpoint)
    first = stream_rows(spark, sink)
    assert first and first[-1][5] == [200]
    writes_part_two(conn, source)
    run_query(spark, dsn, sink, checkpoint)   # restarts from the checkpoint
    got = stream_rows(spark, sink)
    source.tick("q", force=True)
    expected = oracle(source, layouts)
    assert [g[1:3] for g in got] == [e[1:3] for e in expected], "gaps or duplicates"
    assert got == expected
    ops = {g[3] for g in got}
    assert ops == {"I", "U", "D", "S", "T"}
    # committed offsets moved the stream's consumer: the queue can rotate past it. (Spark
    # commits a micro-batch's offset to the source when it plans the next one.)
    last_tick = conn.execute("SELECT last_tick FROM replicator.consumer_info()"
                             " WHERE consumer_name = 'spark_q'").fetchone()[0]
    assert first[-1][0] <= last_tick <= got[-1][0]
    # nothing new: a third run adds nothing
    run_query(spark, dsn, sink, checkpoint)
    assert stream_rows(spark, sink) == got


def test_partitions_split_a_range_and_cover_it_exactly(dsn, conn, source):
    layouts = setup_queue(conn, source)
    writes_part_one(conn, source)
    writes_part_two(conn, source)
    reader = ReplicatorStreamReader({"dsn": dsn, "queue": "q", "consumer": "spark_q", "partitions": "4"})
    start = reader.initialOffset()
    end = reader.latestOffset(start, None)
    assert end["tick"] > start["tick"]
    parts = reader.partitions(start, end)
    assert len(parts) == 4
    rows = [row for p in parts for row in read_partition(p)]
    assert len({(r[1], r[2]) for r in rows}) == len(rows)
    assert sorted((r[1], r[2]) for r in rows) == [(e[1], e[2]) for e in oracle(source, layouts)]
    # layouts follow the S events: the end offset knows t's columns after DROP COLUMN v
    t_layout = next(layout for layout in end["layouts"].values() if layout["name"] == "public.t")
    assert t_layout["columns"] == ["id", "n", "extra"]
    # a read limit stops at the tick that keeps the micro-batch under it (one tick at least)
    from pyspark.sql.streaming.datasource import ReadMaxRows
    assert reader.latestOffset(start, ReadMaxRows(1))["tick"] == start["tick"] + 1
    reader.commit(end)
    assert conn.execute("SELECT last_tick FROM replicator.consumer_info() WHERE consumer_name = 'spark_q'"
                        ).fetchone()[0] == end["tick"]
    assert reader.partitions(end, end) == []
    assert reader.latestOffset(end, None)["tick"] == end["tick"]


def test_available_now_on_a_queue_that_never_ticked_makes_its_first_tick(dsn, conn, source):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
    source.create_queue("q")
    source.add_table("q", "t")
    assert source.latest_tick("q") is None
    reader = ReplicatorStreamReader({"dsn": dsn, "queue": "q"})
    reader.prepareForTriggerAvailableNow()
    start = reader.initialOffset()
    assert start["tick"] == source.latest_tick("q") is not None
    assert reader.latestOffset(start, None) == start


def test_query_behind_a_rotated_queue_fails_saying_it_is_too_far_behind(dsn, conn, source, tmp_path, spark):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    source.create_queue("q")
    source.add_table("q", "t")
    source.register_consumer("q", "spark_q")
    sink, checkpoint = tmp_path / "sink", tmp_path / "checkpoint"
    conn.execute("INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 5) g")
    run_query(spark, dsn, sink, checkpoint)   # checkpoints an offset at the queue's last tick
    checkpointed = max(r[0] for r in stream_rows(spark, sink))
    # The query stays stopped; its consumer is unregistered, the queue moves on and rotates.
    source.unregister_consumer("q", "spark_q")
    conn.execute("INSERT INTO t VALUES (6, 'after the checkpoint')")
    latest = source.tick("q", force=True)
    conn.execute("UPDATE replicator.queue SET queue_switch_time = now() - interval '1 day'")
    assert conn.execute("SELECT replicator.maint_rotate_step1('q')").fetchone()[0]
    assert conn.execute("SELECT replicator.maint_rotate_step2()").fetchone()[0] == 1
    conn.execute("SELECT replicator.maint_tick_cleanup('q')")
    assert [r[0] for r in conn.execute("SELECT tick_id FROM replicator.tick")] == [latest]
    assert checkpointed < latest
    query = (spark.readStream.format("replicator").option("dsn", dsn).option("queue", "q").load()
             .writeStream.format("parquet").option("path", str(sink)).option("checkpointLocation", str(checkpoint))
             .trigger(availableNow=True).start())
    from pyspark.errors import StreamingQueryException
    with pytest.raises(StreamingQueryException) as failed:
        query.awaitTermination(240)
    error = str(failed.value)
    assert "RuntimeError: ticks" in error and "the query is too far behind (the queue rotated past it)" in error, error
    assert "Restart it with a new checkpoint location" in error, error


def test_a_capture_suspended_by_ddl_nobody_announced_stops_the_stream_with_the_way_out(dsn, conn, source):
    from replicator.source.install import drop_event_triggers

    drop_event_triggers(conn)
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    source.create_queue("q")
    source.add_table("q", "t")
    reader = ReplicatorStreamReader({"dsn": dsn, "queue": "q"})
    start = reader.initialOffset()
    conn.execute("ALTER TABLE t DROP COLUMN id")                # its key, directly
    conn.execute("INSERT INTO t VALUES ('a')")
    source.tick("q", force=True)
    with pytest.raises(RuntimeError, match=r"capture is suspended.*replicator table remove q public\.t"):
        reader.latestOffset(start, None)


# typed rows of one table (option "table") -------------------------------------------------

TYPED_COLUMNS = """id int PRIMARY KEY, amount numeric(12,2), at timestamptz, flag boolean, n bigint, small smallint,
    name text, data bytea, tags text[], doc jsonb, local timestamp, day date, ratio real, score double precision,
    free numeric"""
# the source's values as the typed stream holds them (docs/spark.md, "Type mapping"): arrays, json and numeric
# without a scale as their text, infinite timestamps at the ends of Spark's range
TYPED_SELECT = ("SELECT id, amount, {at}, flag, n, small, name, data, to_json(tags)::text AS tags, doc::text AS doc, "
                "{local}, day, ratio, score, free::text AS free{extra} FROM orders").format(
    at="CASE at WHEN 'infinity' THEN '9999-12-31 23:59:59.999999+00' WHEN '-infinity' THEN '0001-01-01 00:00+00'"
       " ELSE at END AS at",
    local="CASE local WHEN 'infinity' THEN '9999-12-31 23:59:59.999999' WHEN '-infinity' THEN '0001-01-01'"
          " ELSE local END AS local", extra="{extra}")
SPARK_TYPES = {"id": "int", "amount": "decimal(12,2)", "at": "timestamp", "flag": "boolean", "n": "bigint",
               "small": "smallint", "name": "string", "data": "binary", "tags": "string", "doc": "string",
               "local": "timestamp_ntz", "day": "date", "ratio": "float", "score": "double", "free": "string",
               "_change_type": "string", "_commit_version": "bigint", "_commit_timestamp": "timestamp",
               "_txid": "bigint", "_event_time": "timestamp", "_ev_id": "bigint", "_item": "int"}
CHANGE_TYPES = {"I": "insert", "U": "update_postimage", "D": "delete", "T": "truncate"}


def typed_options(dsn: str, table: str, **options: str) -> dict[str, str]:
    return {"dsn": dsn, "queue": "q", "table": table, "consumer": "typed", **options}


def typed_reader(dsn: str, table: str, **options: str) -> ReplicatorStreamReader:
    """The reader of a stream defined now (its schema read from the source), as Spark makes it."""
    opts = typed_options(dsn, table, **options)
    return ReplicatorStreamReader(opts, ReplicatorDataSource(opts).schema())


def typed_range(reader: ReplicatorStreamReader, start: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The next offset and the rows of the micro-batch up to it, as the executors read them."""
    end = reader.latestOffset(start, None)
    rows = []
    for part in reader.partitions(start, end):
        for batch in reader.read(part):
            assert batch.schema.equals(reader.typed.arrow)
            rows += batch.to_pylist()
    return end, sorted(rows, key=lambda r: (r["_ev_id"], r["_item"]))


def table_part(row: dict[str, Any]) -> dict[str, Any]:
    """The table's columns of a typed row, NaN as a string (NaN equals nothing)."""
    return {k: "NaN" if v != v else v for k, v in row.items() if not k.startswith("_")}


def fold(rows: list[dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    """The table's state after the typed rows, applied in order by id."""
    state: dict[Any, dict[str, Any]] = {}
    for row in sorted(rows, key=lambda r: (r["_ev_id"], r["_item"])):
        if row["_change_type"] == "truncate":
            state.clear()
        elif row["_change_type"] == "delete":
            del state[row["id"]]
        else:
            state[row["id"]] = table_part(row)
    return state


def source_rows(conn: psycopg.Connection, extra: str = "") -> dict[Any, dict[str, Any]]:
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        return {r["id"]: table_part(r) for r in cur.execute(TYPED_SELECT.format(extra=extra))}


def typed_writes_part_one(conn: psycopg.Connection, source: Source) -> None:
    conn.execute("""INSERT INTO orders VALUES
        (1, 12.50, '2024-03-01 10:00:00.123456+02', true, 9007199254740993, -32768, 'café', '\\x00ff10', '{a,"b c",NULL}',
         '{"x": [1, 2.50]}', '2024-03-01 10:00:00.5', '2024-02-29', 0.25, 1e300, 3.14159265358979323846264338327950288),
        (2, -0.01, 'infinity', false, NULL, 7, '', '\\x', '{}', 'null', '-infinity', '0001-01-01', 'NaN', '-Infinity',
         'NaN'),
        (3, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)""")
    conn.execute("INSERT INTO other VALUES (1)")
    source.tick("q", force=True)
    with conn.transaction():
        conn.execute("UPDATE orders SET amount = amount * 2, name = 'twice' WHERE id = 1")
        conn.execute("DELETE FROM orders WHERE id = 3")
    conn.execute("INSERT INTO orders (id, amount) SELECT g, g / 100.0 FROM generate_series(10, 40) g")
    conn.execute("UPDATE orders SET id = id + 100 WHERE id = 10")   # key change: D of 10, U of 110
    source.tick("q", force=True)
    conn.execute("INSERT INTO orders (id, amount, at) VALUES (50, 99999999.99, '1999-12-31 23:59:59.999999-08')")


def run_typed_query(frame, sink, checkpoint) -> Any:
    query = (frame.writeStream.format("parquet").option("path", str(sink)).option("checkpointLocation", str(checkpoint))
             .trigger(availableNow=True).start())
    try:
        query.awaitTermination(240)
    except Exception as e:   # the query failed: StreamingQueryException
        return e
    assert query.exception() is None, query.exception()
    return None


def sink_rows(spark, sink) -> list[dict[str, Any]]:
    table = spark.read.option("mergeSchema", "true").parquet(str(sink)).toArrow()
    return sorted(table.to_pylist(), key=lambda r: (r["_ev_id"], r["_item"]))


def test_typed_rows_of_a_table_equal_the_source_values_exactly_once_across_restarts_and_an_added_column(
        dsn, conn, source, tmp_path, spark):
    conn.execute(f"CREATE TABLE orders ({TYPED_COLUMNS})")
    conn.execute("CREATE TABLE other (id int PRIMARY KEY)")
    source.create_queue("q")
    source.add_table("q", "orders")
    source.add_table("q", "other")
    source.register_consumer("q", "oracle")
    source.register_consumer("q", "typed")
    layouts = layouts_now(source)
    sink, checkpoint = tmp_path / "sink", tmp_path / "checkpoint"

    def define():
        return (spark.readStream.format("replicator").option("dsn", dsn).option("queue", "q")
                .option("table", "orders").option("consumer", "typed").option("partitions", "3").load())

    frame = define()
    assert {f.name: f.dataType.simpleString() for f in frame.schema.fields} == SPARK_TYPES
    assert list(frame.schema.fieldNames()) == list(SPARK_TYPES)
    typed_writes_part_one(conn, source)
    assert run_typed_query(frame, sink, checkpoint) is None
    first = sink_rows(spark, sink)
    assert fold(first) == source_rows(conn)
    assert first[-1]["id"] == 50   # committed before the query ran: it ticked the queue itself

    # A column added mid-stream: the query delivers what came before it, then stops.
    conn.execute("INSERT INTO orders (id, name) VALUES (60, 'before the column')")
    source.tick("q", force=True)
    conn.execute("ALTER TABLE orders ADD COLUMN extra int")
    conn.execute("INSERT INTO orders (id, name, extra) VALUES (61, 'with the column', 7)")
    conn.execute("UPDATE orders SET extra = 8 WHERE id = 1")
    failed = run_typed_query(frame, sink, checkpoint)
    assert failed is not None and "orders has column(s) extra from tick" in str(failed), failed
    assert "Define the stream again" in str(failed)
    assert [r["id"] for r in sink_rows(spark, sink)[len(first):]] == [60]
    # Defined again, the stream has the column and goes on from its checkpoint.
    frame = define()
    assert frame.schema["extra"].dataType.simpleString() == "int"
    assert run_typed_query(frame, sink, checkpoint) is None
    second = sink_rows(spark, sink)
    assert fold(second) == source_rows(conn, extra=", extra")
    assert {r["id"]: r["extra"] for r in second if r["id"] in (1, 61) and r["_ev_id"] > first[-1]["_ev_id"]} == \
        {1: 8, 61: 7}

    conn.execute("TRUNCATE orders")
    conn.execute("INSERT INTO orders (id, extra) VALUES (70, 70)")
    assert run_typed_query(frame, sink, checkpoint) is None   # a restart from the checkpoint
    got = sink_rows(spark, sink)
    truncate = [r for r in got if r["_change_type"] == "truncate"]
    assert len(truncate) == 1 and all(v is None for v in table_part(truncate[0]).values())
    assert fold(got) == source_rows(conn, extra=", extra")

    # exactly once, in queue order: the oracle's changes of the table, with their ticks
    source.tick("q", force=True)
    expected = [(e[1], e[2], CHANGE_TYPES[e[3]], e[0], None if e[5] is None else e[5][0])
                for e in oracle(source, layouts) if e[3] != "S" and e[4] == "public.orders"]
    assert [(r["_ev_id"], r["_item"], r["_change_type"], r["_commit_version"], r["id"]) for r in got] == expected
    assert all(r["_commit_timestamp"] >= r["_event_time"] for r in got)
    ticks = dict(conn.execute("SELECT tick_id, tick_time FROM replicator.tick"))
    assert all(r["_commit_timestamp"] == ticks[r["_commit_version"]] for r in got)


def test_typed_rows_keep_the_columns_the_query_started_with_through_renames_drops_and_type_changes(dsn, conn, source):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text, amount numeric(12,2), gone int)")
    source.create_queue("q")
    source.add_table("q", "t")
    reader = typed_reader(dsn, "t")
    start = reader.initialOffset()
    conn.execute("INSERT INTO t VALUES (1, 'a', 1.50, 1)")
    conn.execute("ALTER TABLE t RENAME COLUMN v TO w")
    conn.execute("INSERT INTO t VALUES (2, 'b', 2.25, 2)")
    conn.execute("ALTER TABLE t DROP COLUMN gone")
    conn.execute("ALTER TABLE t ALTER COLUMN amount TYPE numeric(14,4)")
    conn.execute("INSERT INTO t VALUES (3, 'c', 3.5)")
    conn.execute("DELETE FROM t WHERE id = 1")
    end, rows = typed_range(reader, start)
    assert [(r["_change_type"], table_part(r)) for r in rows] == [
        ("insert", {"id": 1, "v": "a", "amount": Decimal("1.50"), "gone": 1}),
        ("insert", {"id": 2, "v": "b", "amount": Decimal("2.25"), "gone": 2}),   # w, under the query's name
        ("insert", {"id": 3, "v": "c", "amount": Decimal("3.50"), "gone": None}),
        ("delete", {"id": 1, "v": None, "amount": None, "gone": None})]   # a delete carries the key
    # a value the query's DECIMAL(12,2) cannot hold stops it, naming the column and the way out
    conn.execute("INSERT INTO t VALUES (4, 'd', 4.1234)")
    with pytest.raises(RuntimeError, match=r"public\.t\.amount: a value captured as numeric\(14,4\) does not fit "
                                           r"this query's type decimal128\(12, 2\).*Define the stream again"):
        typed_range(reader, end)
    # defined again, the stream reads the new types
    assert [table_part(r) for r in typed_range(typed_reader(dsn, "t"), end)[1]] == [
        {"id": 4, "w": "d", "amount": Decimal("4.1234")}]


def test_a_pk_mode_table_streams_its_key_only(dsn, conn, source):
    conn.execute("CREATE SCHEMA s; CREATE TABLE s.u (k text, j int, doc jsonb, PRIMARY KEY (k, j))")
    source.create_queue("q")
    source.add_table("q", "s.u", mode="pk")
    reader = typed_reader(dsn, "s.u")
    assert [f.name for f in reader.typed.arrow][:3] == ["k", "j", "_change_type"]
    start = reader.initialOffset()
    conn.execute("INSERT INTO s.u VALUES ('a', 1, '{}'), ('b', 2, '[]')")
    conn.execute("UPDATE s.u SET doc = 'null' WHERE k = 'a'")
    conn.execute("DELETE FROM s.u WHERE k = 'b'")
    conn.execute("TRUNCATE s.u")
    _, rows = typed_range(reader, start)
    assert [(r["_change_type"], r["k"], r["j"]) for r in rows] == [
        ("insert", "a", 1), ("insert", "b", 2), ("update_postimage", "a", 1), ("delete", "b", 2),
        ("truncate", None, None)]


def test_a_column_added_mid_range_ends_the_range_before_it_then_stops_unless_told_to_go_on(dsn, conn, source):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
    conn.execute("CREATE TABLE other (id int PRIMARY KEY)")
    source.create_queue("q")
    source.add_table("q", "t")
    source.add_table("q", "other")
    reader = typed_reader(dsn, "t")
    going_on = typed_reader(dsn, "t", consumer="going_on", schemaEvolutionMode="none")
    stale = typed_reader(dsn, "t", consumer="stale")   # its first offset comes after the column
    start = reader.initialOffset()
    assert going_on.initialOffset()["tick"] == start["tick"]
    conn.execute("INSERT INTO t VALUES (1)")
    before = source.tick("q", force=True)
    conn.execute("INSERT INTO other VALUES (1)")   # not the table's: no row
    conn.execute("ALTER TABLE t ADD COLUMN extra int")
    conn.execute("INSERT INTO t VALUES (2, 2)")
    end, rows = typed_range(reader, start)
    assert end["tick"] == before and [r["id"] for r in rows] == [1]
    with pytest.raises(RuntimeError, match=r"public\.t has column\(s\) extra from tick \d+ on that this "
                                           r"query's schema, fixed when the stream was defined, lacks: the query "
                                           r"stops here"):
        reader.latestOffset(end, None)
    # option schemaEvolutionMode none: the rows go on without the column
    assert [(r["id"], "extra" in r) for r in typed_range(going_on, start)[1]] == [(1, False), (2, False)]
    # a query whose first offset already has the column stops at its first change
    stale_start = stale.initialOffset()
    conn.execute("INSERT INTO t VALUES (3, 3)")
    with pytest.raises(RuntimeError, match=rf"public\.t has column\(s\) extra from tick {stale_start['tick']} on"):
        stale.latestOffset(stale_start, None)
    # a column dropped again before the query is defined again is not waited for
    conn.execute("ALTER TABLE t DROP COLUMN extra")
    conn.execute("INSERT INTO t VALUES (4)")
    assert [r["id"] for r in typed_range(reader, end)[1]] == [2, 3, 4]


def test_a_typed_stream_refuses_a_table_the_queue_does_not_capture_and_a_schema_of_its_own(dsn, conn, source):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
    source.create_queue("q")
    with pytest.raises(ValueError, match=r"^table public\.t is not captured by queue q \(replicator table add q "
                                         r"public\.t\)$"):
        ReplicatorDataSource(typed_options(dsn, "t")).schema()
    source.add_table("q", "t")
    from pyspark.sql.types import IntegerType, StructField, StructType
    with pytest.raises(ValueError, match=r"makes its schema from the table's columns: leave out \.schema"):
        ReplicatorStreamReader(typed_options(dsn, "t"), StructType([StructField("id", IntegerType())]))
    with pytest.raises(ValueError, match=r"option schemaEvolutionMode is 'rescue': use addNewColumns or none"):
        typed_reader(dsn, "t", schemaEvolutionMode="rescue")
