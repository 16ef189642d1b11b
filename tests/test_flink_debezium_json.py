"""Flink reads our topics: its own `debezium-json` format (flink-json 2.2's deserializer, as a Flink SQL
table `'format' = 'debezium-json'` reads a Kafka topic) turns the records of a table captured with
--old-rows into a changelog whose retractions (-U, -D) each take back a row Flink holds, and which ends
as the source's table. Without old rows, Flink refuses an update (its `before` is null)."""

from __future__ import annotations

import json
from collections import Counter

import psycopg

from flink_helpers import read_with_flink
from kafka_helpers import in_publishing_order, last_commit, publish, read_committed
from kafkaserver import KafkaServer
from replicator.source import Source

COLUMNS = "id:INT,owner:STRING,balance:STRING,seen:BIGINT"


def topic_values(kafka: KafkaServer, prefix: str) -> list[bytes]:
    last_commit(kafka.bootstrap, prefix)
    records = in_publishing_order(read_committed(kafka.bootstrap, f"{prefix}.public.acc"))
    return [r.value for r in records if r.value is not None]


def test_flink_reads_the_updates_of_a_table_with_old_rows_as_retractions_of_the_rows_it_holds(
        dsn: str, conn: psycopg.Connection, source: Source, kafka: KafkaServer, kafka_prefix: str):
    conn.execute("CREATE TABLE acc (id int PRIMARY KEY DEFERRABLE, owner text NOT NULL, balance numeric(12,2),"
                 " seen bigint NOT NULL); INSERT INTO acc SELECT g, 'o' || g, g * 1.5, 0 FROM generate_series(1, 20) g")
    source.create_queue("q")
    source.add_table("q", "acc", old_rows=True)
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}?decimals=string"
    assert publish(dsn, url).returncode == 0      # the copy: +I rows
    conn.execute("UPDATE acc SET balance = balance + 1, seen = seen + 1 WHERE id <= 5")
    conn.execute("UPDATE acc SET id = id + 100 WHERE id IN (6, 7)")
    conn.execute("UPDATE acc SET id = CASE id WHEN 8 THEN 9 ELSE 8 END WHERE id IN (8, 9)")
    conn.execute("DELETE FROM acc WHERE id > 15 AND id < 100")
    conn.execute("UPDATE acc SET owner = 'x', balance = NULL WHERE id % 2 = 0")
    assert publish(dsn, url).returncode == 0
    flink = read_with_flink(topic_values(kafka, kafka_prefix), COLUMNS)
    assert flink.returncode == 0, flink.stderr.decode()
    changelog = [(kind, json.loads(row)) for kind, row in (line.split("\t") for line in flink.stdout.decode().splitlines())]
    kinds = Counter(kind for kind, _ in changelog)
    assert kinds["-U"] == kinds["+U"] > 0 and kinds["-D"] > 0, kinds
    held: Counter[tuple] = Counter()
    for kind, row in changelog:
        if kind in ("-U", "-D"):
            assert held[tuple(row)] > 0, (kind, row, "retracts a row Flink does not hold")
            held[tuple(row)] -= 1
        else:
            held[tuple(row)] += 1
    expected = Counter(tuple(r) for r in conn.execute(
        "SELECT id, owner, balance::text, seen FROM acc"))
    assert +held == expected


def test_without_old_rows_flink_refuses_an_update_for_its_null_before(dsn: str, conn: psycopg.Connection,
                                                                     source: Source, kafka: KafkaServer,
                                                                     kafka_prefix: str):
    conn.execute("CREATE TABLE acc (id int PRIMARY KEY, owner text NOT NULL, balance numeric(12,2), seen bigint NOT NULL);"
                 " INSERT INTO acc VALUES (1, 'a', 1, 0)")
    source.create_queue("q")
    source.add_table("q", "acc")
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}?decimals=string"
    assert publish(dsn, url).returncode == 0
    conn.execute("UPDATE acc SET seen = 1")
    assert publish(dsn, url).returncode == 0
    flink = read_with_flink(topic_values(kafka, kafka_prefix), COLUMNS)
    assert flink.returncode == 1 and b'The "before" field of UPDATE message is null' in flink.stderr
