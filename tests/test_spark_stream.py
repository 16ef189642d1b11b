"""The queue as a Spark streaming source: a checkpointed query replays exactly
the queue's events, in order, across a restart; executors read partitions
in parallel; committed offsets move the source consumer.

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
from replicator.streaming.datasource import ReplicatorStreamReader, read_partition


def layouts_now(source: Source) -> dict[int, tuple[Any, ...]]:
    return {t.table_id: (t.name, t.columns, t.key, t.mode) for t in source.tables("q")}


def oracle(source: Source, layouts: dict[int, tuple[Any, ...]], consumer: str = "oracle") -> list[tuple[Any, ...]]:
    """(tick, ev_id, item, op, table, key, row) of every event the consumer has not read, in order;
    layouts: the tables' layouts when the consumer was registered."""
    layouts = dict(layouts)
    out = []
    while (batch_id := source.next_batch("q", consumer)) is not None:
        tick = source.batch_info(batch_id).tick_id
        for ev_id, _txid, _time, ev_type, table_id, data in source.batch_events(batch_id):
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
