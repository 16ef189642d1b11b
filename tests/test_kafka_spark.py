"""The example of docs/kafka.md ("Reading the topics with Spark"), run: Spark's own Kafka source
reads a publisher's topic with read_committed, and the current image it derives (the last record
of each key, unless a delete) equals the source table, although the topic also holds the records
of a transaction a killed publisher left open (aborted when the next one started)."""

from __future__ import annotations

import signal
from decimal import Decimal
from typing import Any

import pytest

from consumer_helpers import run_cli

pytest.importorskip("pyspark")


def current_image(spark: Any, bootstrap: str, topic: str) -> Any:
    """docs/kafka.md's example: the last record of each key that is not a delete."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    raw = (spark.read.format("kafka")
           .option("kafka.bootstrap.servers", bootstrap)
           .option("subscribe", topic)
           .option("kafka.isolation.level", "read_committed")
           .option("startingOffsets", "earliest")
           .load())
    schema = "payload STRUCT<op: STRING, after: STRUCT<id: INT, customer: STRING, total: STRING>>"
    changes = raw.select("key", "offset", F.from_json(F.col("value").cast("string"), schema).alias("v"))
    return (changes.withColumn("n", F.row_number().over(Window.partitionBy("key").orderBy(F.desc("offset"))))
            .where("n = 1 AND v IS NOT NULL AND v.payload.op <> 'd'")
            .select("v.payload.after.*"))


def test_spark_reads_the_current_image_of_a_table_from_its_topic_with_read_committed(
        dsn, conn, source, kafka, kafka_prefix, spark):
    from pyspark.sql import functions as F

    conn.execute("CREATE TABLE orders (id int PRIMARY KEY, customer text, total numeric(12,2))")
    conn.execute("INSERT INTO orders SELECT g, 'c' || g % 7, g * 1.25 FROM generate_series(1, 300) g")
    source.create_queue("q")
    source.add_table("q", "orders")
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}?decimals=string"
    assert run_cli(dsn, "consume", "q", "--target", url, "--until-caught-up").returncode == 0   # the copy
    conn.execute("UPDATE orders SET total = total + 1 WHERE id % 3 = 0")
    conn.execute("DELETE FROM orders WHERE id % 10 = 0")
    conn.execute("INSERT INTO orders VALUES (1000, 'late', 9.99)")
    killed = run_cli(dsn, "consume", "q", "--target", url, "--until-caught-up",
                     REPLICATOR_CRASH_AT="kafka-commit-sent")
    assert killed.returncode == -signal.SIGKILL   # the batch's records are in the topic, not committed
    assert run_cli(dsn, "consume", "q", "--target", url, "--until-caught-up").returncode == 0

    topic = f"{kafka_prefix}.public.orders"
    image = current_image(spark, kafka.bootstrap, topic)
    got = {r.id: (r.customer, Decimal(r.total)) for r in image.collect()}
    want = {i: (c, t) for i, c, t in conn.execute("SELECT id, customer, total FROM orders").fetchall()}
    assert got == want

    # read_committed: each change once; the aborted transaction's copies show without it
    def updates(isolation: str) -> int:
        raw = (spark.read.format("kafka").option("kafka.bootstrap.servers", kafka.bootstrap)
               .option("subscribe", topic).option("kafka.isolation.level", isolation)
               .option("startingOffsets", "earliest").load())
        ops = raw.select(F.get_json_object(F.col("value").cast("string"), "$.payload.op").alias("op"))
        return ops.where("op = 'u'").count()
    assert updates("read_committed") == 100
    assert updates("read_uncommitted") == 200
