"""The publisher's state topic at many tables (issue 31), and the state topics older publishers wrote.

The state topic holds a record per table and per table topic, each written when it changes: a
commit's records grow with what its transaction wrote, never with the number of tables. A topic
written by a publisher before these records (a whole "tables" record, commits listing every
partition) is still followed, and the first publisher of this version on it writes every table
and topic record. Real PostgreSQL, a real broker, the `replicator` console script.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]  # (not in its stub)

from consumer_helpers import run_cli, wait_until
from kafka_helpers import Record, last_commit, read_committed
from kafkaserver import KafkaServer
from replicator.structure import target_table_name
from replicator.targets.kafka.settings import parse_url
from replicator.targets.kafka.state import PublisherState
from replicator.targets.kafka.topics import STATE_CONFIG, state_topic, table_topic
from test_kafka_follow import assert_follower_equals_source, follow_all, publish, sqlite_contents, url_of

SEQUENCE = "replicator.sequence"
# Each table's copy is a transaction of its own: 1,000 tables take about 5 minutes (REPLICATOR_MANY_TABLES=1000),
# 100 about 25 s. At 100 the records of publishers before this version were past the bounds asserted: a commit of
# 3.3 KB (every partition), a "tables" record of 47 KB (at 1,000: 32 KB and 477 KB)
TABLES = int(os.environ.get("REPLICATOR_MANY_TABLES", "100"))
COMMIT_BOUND = 1024      # bytes: a commit that wrote two tables, whatever their number
RECORD_BOUND = 16 * 1024


def create_tables(conn: psycopg.Connection, schema: str, count: int) -> None:
    """`count` small tables in the schema, a few rows each, made in one statement."""
    conn.execute(f"""
        CREATE SCHEMA {schema};
        DO $$ BEGIN
            FOR i IN 1..{count} LOOP
                EXECUTE format('CREATE TABLE {schema}.t%s (id int PRIMARY KEY, v text)', i);
                EXECUTE format('INSERT INTO {schema}.t%s SELECT g, ''v'' || g FROM generate_series(1, 3) g', i);
            END LOOP;
        END $$""")


def capture_schema(dsn: str, conn: psycopg.Connection, schema: str) -> None:
    conn.execute("SELECT replicator.create_queue('q')")
    result = run_cli(dsn, "table", "add", "q", "--schema", schema, timeout=600)
    assert result.returncode == 0, result.stderr


def state_of(bootstrap: str, prefix: str) -> list[Record]:
    return read_committed(bootstrap, state_topic(prefix))


def key_of(record: Record) -> bytes:
    return record.key or b""


def test_at_many_tables_a_batch_of_two_writes_small_state_records_and_a_follower_bootstraps_equal(
        dsn: str, conn: psycopg.Connection, kafka: KafkaServer, kafka_prefix: str, tmp_path: Path) -> None:
    create_tables(conn, "many", TABLES)
    capture_schema(dsn, conn, "many")
    url = url_of(kafka, kafka_prefix)
    publish(dsn, url)   # the initial copy of every table
    copied = last_commit(kafka.bootstrap, kafka_prefix)
    assert copied is not None
    conn.execute("UPDATE many.t1 SET v = 'changed' WHERE id = 1; DELETE FROM many.t2 WHERE id = 2")   # one tick
    publish(dsn, url)

    state = state_of(kafka.bootstrap, kafka_prefix)
    batch = [r for r in state if r.sequence[0] > copied["commit"]]
    commits = [r for r in batch if key_of(r) == b"commit"]
    assert commits and all(len(r.value or b"") < COMMIT_BOUND for r in commits), [r.value for r in commits]
    assert sorted(key_of(r) for r in batch if r not in commits) == sorted(
        b"topic:" + table_topic(kafka_prefix, "many", t).encode() for t in ("t1", "t2"))
    assert max(len(r.value or b"") for r in state) < RECORD_BOUND
    # every table's and topic's record is there, the last of each key
    assert len({key_of(r) for r in state if key_of(r).startswith(b"table:")}) == TABLES
    assert len({key_of(r) for r in state if key_of(r).startswith(b"topic:")}) == TABLES + 1   # and the schema topic

    path = tmp_path / "follower.db"
    follow_all(url, f"sqlite:{path}")
    assert_follower_equals_source(conn, path)
    conn.execute("UPDATE many.t3 SET v = 'later' WHERE id = 3")
    publish(dsn, url)
    follow_all(url, f"sqlite:{path}")   # and follows a commit that lists one topic
    assert_follower_equals_source(conn, path)


# a state topic of a publisher before per-table and per-topic records --------------------------------------

def old_format(state: list[Record]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The last commit and the tables of a state topic, as a publisher before table and topic records wrote
    them: the commit listing the last offset of every partition (`offsets`), the tables in one record."""
    commit: dict[str, Any] = {}
    tables: dict[str, Any] = {}
    offsets: dict[str, Any] = {}
    for record in state:
        key = key_of(record)
        if key == b"commit":
            commit = json.loads(record.value or b"")
        elif key.startswith(b"table:"):
            tables[key[len(b"table:"):].decode()] = json.loads(record.value or b"")
        elif key.startswith(b"topic:"):
            offsets[key[len(b"topic:"):].decode()] = json.loads(record.value or b"")
    old = {name: value for name, value in commit.items() if name != "last"}
    return {**old, "offsets": offsets, "records": commit["records"] + 1}, tables


def write_old_state(bootstrap: str, prefix: str) -> int:
    """The state topic made anew holding what a publisher before table and topic records would have left: a
    transaction of the publisher's transactional.id with a whole "tables" record and a commit after it.
    Returns the commit's number."""
    commit, tables = old_format(state_of(bootstrap, prefix))
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.delete_topics([state_topic(prefix)])[state_topic(prefix)].result(30)

    def created() -> bool:   # (Kafka deletes a topic in the background: created anew once it is gone)
        future = admin.create_topics([NewTopic(state_topic(prefix), 1, 1, config=STATE_CONFIG)])[state_topic(prefix)]
        try:
            future.result(30)
        except KafkaException as exc:
            assert exc.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS, exc
            return False
        return True

    wait_until(created, 60, f"{state_topic(prefix)} deleted, to be made anew")
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"replicator.{prefix}"})
    producer.init_transactions(30)
    producer.begin_transaction()
    number: int = commit["commit"]
    index: int = commit["records"]
    producer.produce(state_topic(prefix), json.dumps(tables).encode(), b"tables",
                     headers=[(SEQUENCE, b"%d.%d" % (number, index - 1))])
    producer.produce(state_topic(prefix), json.dumps(commit).encode(), b"commit",
                     headers=[(SEQUENCE, b"%d.%d" % (number, index))])
    producer.commit_transaction(30)
    return number


def test_a_state_topic_an_older_publisher_wrote_is_followed_before_and_after_the_publisher_is_upgraded(
        dsn: str, conn: psycopg.Connection, kafka: KafkaServer, kafka_prefix: str, tmp_path: Path) -> None:
    create_tables(conn, "few", 3)
    capture_schema(dsn, conn, "few")
    url = url_of(kafka, kafka_prefix)
    publish(dsn, url)
    number = write_old_state(kafka.bootstrap, kafka_prefix)
    old = tmp_path / "old.db"
    follow_all(url, f"sqlite:{old}")   # bootstraps from the old commit's offsets
    assert_follower_equals_source(conn, old)

    conn.execute("UPDATE few.t1 SET v = 'upgraded' WHERE id = 1")
    publish(dsn, url)   # the publisher of this version, on the old state topic
    commit = last_commit(kafka.bootstrap, kafka_prefix)
    assert commit is not None and "offsets" not in commit
    # every table and topic written, a record per key, and the old "tables" record's key emptied
    since = {key_of(r): r.value for r in state_of(kafka.bootstrap, kafka_prefix) if r.sequence[0] > number}
    tables = {t: f"table:few.{t}".encode() for t in ("t1", "t2", "t3")}
    topics = {t: b"topic:" + table_topic(kafka_prefix, "few", t).encode() for t in ("t1", "t2", "t3")}
    assert since.pop(b"tables") is None and since.pop(b"commit")
    assert set(since) == {*tables.values(), *topics.values(), b"topic:" + kafka_prefix.encode()}
    assert None not in since.values()
    conn.execute("DROP TABLE few.t3")
    publish(dsn, url)
    since = {key_of(r): r.value for r in state_of(kafka.bootstrap, kafka_prefix) if r.sequence[0] > number}
    assert since[tables["t3"]] is None and since[topics["t3"]] is None   # t3's entries gone
    assert set(PublisherState.read(parse_url(url, environ={}), state_topic(kafka_prefix)).tables) == {
        "few.t1", "few.t2"}

    follow_all(url, f"sqlite:{old}")   # goes on from the old commit
    assert_follower_equals_source(conn, old)
    new = tmp_path / "new.db"
    follow_all(url, f"sqlite:{new}")   # bootstraps from the old and new records
    assert_follower_equals_source(conn, new)
    assert target_table_name("few", "t3") not in {*sqlite_contents(new), *sqlite_contents(old)}
