"""The Kafka publisher and its followers at their edges: a follower after it caught up, options of
the envelope, tables dropped, renamed and created again, compaction, outages longer than the waits,
memory of a bootstrap, mistakes on the command line (first written as a review's reproductions).

Each test states what docs/kafka.md or the issue promises:
real PostgreSQL, a real broker (the session's `kafka`, or `own_kafka` to kill), the real
`replicator` command (or a KafkaTarget in-process where a module constant is shortened), real
SQLite replicas and stream files."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from contextlib import closing
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Message, TopicPartition
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewTopic,
    ResourceType,
)

from consumer_helpers import Daemon, run_cli, run_cli_in_process, sqlite_reader, wait_until
from kafka_helpers import FETCH_WAIT, read_committed
from kafkaserver import KafkaServer
from replicator.errors import TargetUnavailable, UserError
from replicator.follower import follower as follower_module
from replicator.follower import reader
from replicator.follower.follower import Follower
from replicator.source import Source
from replicator.targets.kafka.publisher import KafkaTarget
from replicator.targets.kafka.settings import parse_url
from replicator.targets.kafka.state import committed_consumer
from replicator.targets.sqlite.target import SqliteTarget
from test_kafka_follow import publish_until_cleaned

# helpers -----------------------------------------------------------------------------------


def publish(dsn: str, url: str, **env: str) -> None:
    """Publishes every change committed so far (the copies of new tables included)."""
    result = run_cli(dsn, "consume", "q", "--target", url, "--until-caught-up", **env)
    assert result.returncode == 0, result.stderr


def follow(dsn: str, url: str, target: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """A follower run --until-caught-up; its first read of the commits may wait 5 s (see
    test_a_follower_until_caught_up_applies_what_was_committed_whatever_its_poll_interval)."""
    return run_cli(dsn, "consume", "--source", url, "--target", target, "--until-caught-up", "--poll-interval", "5",
                   *args, timeout=timeout)


def replica(path: Path, table: str) -> dict[int, Any]:
    """{id: v} of a replica table; {} while the table does not exist."""
    if not path.exists():
        return {}
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    try:
        return dict(db.execute(f'SELECT id, v FROM "{table}"').fetchall())
    except sqlite3.OperationalError:
        return {}
    finally:
        db.close()


def source_table(conn: psycopg.Connection, table: str) -> dict[int, Any]:
    return dict(conn.execute(f"SELECT id, v FROM {table}").fetchall())


def create_compacting_topic(bootstrap: str, topic: str, **config: str) -> None:
    """A table topic made ahead of the publisher (docs/kafka.md: used as it is) whose log Kafka
    cleans soon: a segment per 100 ms, cleaned as soon as any of it is overwritten."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    settings = {"cleanup.policy": "compact", "segment.ms": "100", "min.cleanable.dirty.ratio": "0.01", **config}
    admin.create_topics([NewTopic(topic, 1, 1, config=settings)])[topic].result(30)


def topic_keys(bootstrap: str, topic: str) -> list[bytes | None]:
    """The keys of the committed records of partition 0 of topic, from its start to its end now."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"review-{uuid.uuid4()}",
                         "enable.auto.commit": False, "isolation.level": "read_committed",
                         "enable.partition.eof": True, **FETCH_WAIT})
    try:
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        keys: list[bytes | None] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            message = consumer.poll(1.0)
            if message is None:
                continue
            error = message.error()
            if error is None:
                keys.append(message.key())
                continue
            if error.code() == error._PARTITION_EOF:
                return keys
            raise KafkaException(error)
        raise AssertionError(f"no end of {topic} within 30 s")
    finally:
        consumer.close()


def key_of(row_id: int, records: list[bytes | None]) -> int:
    """How many records have the key of row id (Debezium's key JSON of an int column `id`)."""
    return sum(1 for key in records if key is not None and json.loads(key)["payload"] == {"id": row_id})


def first_commit_from(bootstrap: str, topic: str, offset: int) -> int:
    """The number of the first commit record of state topic `topic` at offset or past it."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"first-{uuid.uuid4()}",
                         "enable.auto.commit": False, "isolation.level": "read_committed", **FETCH_WAIT})
    try:
        consumer.assign([TopicPartition(topic, 0, offset)])
        while True:
            message = consumer.poll(30)
            assert message is not None and message.error() is None, f"no commit in {topic} from {offset} within 30s"
            if message.key() == b"commit":
                number: int = json.loads(message.value())["commit"]
                return number
    finally:
        consumer.close()


def keep_tombstones(bootstrap: str, topic: str, ms: int) -> None:
    """Sets the topic's delete.retention.ms."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    entry = ConfigEntry("delete.retention.ms", str(ms), incremental_operation=AlterConfigOpType.SET)
    for future in admin.incremental_alter_configs([ConfigResource(ResourceType.TOPIC, topic,
                                                                  incremental_configs=[entry])]).values():
        future.result()


def bootstrapped_follower(dsn: str, url: str, db: Path, log: Path) -> Daemon:
    """A follower daemon into SQLite file db, once it has bootstrapped the 5 rows of orders."""
    follower = Daemon(dsn, "consume", "--source", url, "--target", f"sqlite:{db}", "--poll-interval", "0.05", log=log)
    try:
        wait_until(lambda: len(replica(db, "orders")) == 5, 60, "the follower's bootstrap",
                   check=lambda: follower.alive() or pytest.fail(follower.log()))
    except BaseException:
        follower.stop()
        raise
    return follower


# followers ---------------------------------------------------------------------------------


def test_a_running_follower_applies_what_is_published_after_it_has_caught_up(
        dsn: str, conn: psycopg.Connection, orders: str, kafka: KafkaServer, kafka_prefix: str,
        tmp_path: Path) -> None:
    """reader.py: once a partition reached its end (an EOF event), _at_end() holds until a new record
    is buffered, and _fetch() polls only while it does not: available() on the commit topic never
    polls again, so a follower daemon never sees a commit made after its first catch-up."""
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    db = tmp_path / "follower.db"
    follower = bootstrapped_follower(dsn, url, db, tmp_path / "follower.log")
    try:
        def running() -> None:
            assert follower.alive(), follower.log()
        conn.execute("INSERT INTO orders VALUES (6, 'later')")
        publish(dsn, url)
        wait_until(lambda: 6 in replica(db, "orders"), 60,
                   "the running follower to apply the commit published after its catch-up", check=running)
    finally:
        follower.stop()


def test_a_partition_read_to_its_end_keeps_its_end_while_nothing_new_comes(
        dsn: str, conn: psycopg.Connection, orders: str, kafka: KafkaServer, kafka_prefix: str) -> None:
    """reader.py available(): Kafka reports a partition's end once (an EOF event), until a record comes
    past it. available() forgot the end it had read and waited for another: a commit read with its end
    while the follower applied the commit before (one consumer reads all partitions) could never be
    told to end a transaction, and the follower held it unapplied until the publisher committed again
    (seen: a follower daemon a tick behind for minutes after its publisher stopped)."""
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    tp = (f"__replicator.{kafka_prefix}", 0)
    partitions = reader.PartitionReader(committed_consumer(parse_url(url)), print)
    try:
        partitions.assign({tp: 0})
        commits = partitions.available(tp, 10.0)
        end = partitions.end(tp)
        assert commits and end is not None and end >= commits[-1].offset() + 2   # the transaction's marker
        assert partitions.available(tp, 0.5) == []
        assert partitions.end(tp) == end
    finally:
        partitions.consumer.close()


def test_a_follower_behind_by_longer_than_its_topics_keep_tombstones_stops_in_one_line_and_recopy_rebuilds_it(
        dsn: str, conn: psycopg.Connection, orders: str, kafka: KafkaServer, kafka_prefix: str,
        tmp_path: Path) -> None:
    """follower.py _check_tombstones_kept(): once Kafka has cleaned a delete's record and then its
    tombstone (delete.retention.ms after compaction reached it), a follower that had not read them keeps
    the row, silently. A follower whose next commit is older than the topics keep tombstones stops
    before it, saying to rebuild it with --recopy (here the topic keeps them 1 ms: every commit is
    older), which rebuilds it in place without the row; commits that wrote no table topic (an idle
    queue's) are applied."""
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    db = tmp_path / "follower.db"
    assert follow(dsn, url, f"sqlite:{db}").returncode == 0
    keep_tombstones(kafka.bootstrap, f"{kafka_prefix}.public.orders", 1)
    publish(dsn, url)   # an idle queue's batch: a commit that wrote no table topic, applied however old
    assert follow(dsn, url, f"sqlite:{db}").returncode == 0
    conn.execute("DELETE FROM orders WHERE id = 3")
    publish(dsn, url)
    result = follow(dsn, url, f"sqlite:{db}")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    line = result.stderr.splitlines()[-1]
    assert "longer than its topics keep a delete's tombstone (delete.retention.ms" in line and "--recopy" in line
    assert 3 in replica(db, "orders")   # nothing of the commit applied
    rebuilt = follow(dsn, url, f"sqlite:{db}", "--recopy")   # in place, from the topics as a new follower reads
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert sorted(replica(db, "orders")) == [1, 2, 4, 5]


def test_a_follower_whose_next_commits_kafka_compacted_away_is_as_old_as_the_commit_it_applied_last(
        dsn: str, conn: psycopg.Connection, orders: str, kafka: KafkaServer, kafka_prefix: str,
        tmp_path: Path) -> None:
    """A follower stopped for longer than the topics keep tombstones finds, the state topic compacted,
    the last few commits only, made minutes ago: it took their age for its own and went on, keeping
    the rows deleted meanwhile whose tombstones were gone (found by review). The commits since the one
    it applied last are as old as just after it: here the table topic keeps tombstones 12 s, the state
    topic is compacted while the publisher goes on (a delete among its commits), and the follower, run
    again once its commit is older than that, stops in one line."""
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    db = tmp_path / "follower.db"
    assert follow(dsn, url, f"sqlite:{db}").returncode == 0
    applied = time.monotonic()
    state = f"__replicator.{kafka_prefix}"
    target = SqliteTarget(db)
    [queue] = target.queues()
    read_to = target.positions(queue)[f"{state}:0"]   # where it reads the state topic from next
    last = target.positions(queue)["commit"]
    target.close()
    keep_tombstones(kafka.bootstrap, f"{kafka_prefix}.public.orders", 12_000)
    conn.execute("DELETE FROM orders WHERE id = 3")

    def next_commit_compacted(_: dict[str, int]) -> bool:
        """The commit after the one the follower applied is gone from where it reads next."""
        return first_commit_from(kafka.bootstrap, state, read_to) > last + 1

    publish_until_cleaned(dsn, url, kafka.bootstrap, [state], ["UPDATE orders SET v = v || '.' WHERE id = 1"],
                          tmp_path / "publisher.log", next_commit_compacted)
    # the follower's commit older than the topic keeps tombstones (less a tenth), the last commits not
    wait_until(lambda: time.monotonic() - applied > 12, 30, "the applied commit to age past 12 s")
    publish(dsn, url)
    result = follow(dsn, url, f"sqlite:{db}")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "Kafka has compacted the commits since away" in result.stderr.splitlines()[-1], result.stderr
    assert 3 in replica(db, "orders")   # nothing applied


def test_a_follower_that_bootstrapped_then_falls_behind_by_longer_than_its_topics_keep_tombstones_stops(
        dsn: str, conn: psycopg.Connection, orders: str, kafka: KafkaServer, kafka_prefix: str,
        tmp_path: Path) -> None:
    """follower.py _check_tombstones_kept(): a bootstrap's commits made before it began are not checked
    (a tombstone Kafka removed took its row's records with it), but those made since are, in the same
    run. The setting was read only at a run's start, of the topics the target had read: a follower
    that bootstrapped never checked anything until restarted. Here the topic keeps tombstones 1 ms: the
    bootstrap goes through, the running daemon stops before the next commit, in one line."""
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    keep_tombstones(kafka.bootstrap, f"{kafka_prefix}.public.orders", 1)
    db = tmp_path / "follower.db"
    follower = bootstrapped_follower(dsn, url, db, tmp_path / "follower.log")
    try:
        conn.execute("DELETE FROM orders WHERE id = 3")
        publish(dsn, url)
        wait_until(lambda: not follower.alive(), 60, "the follower to stop")
        assert follower.proc.returncode == 1
        lines = follower.log().strip().splitlines()
        assert "longer than its topics keep a delete's tombstone (delete.retention.ms" in lines[-1], lines
        assert "Traceback" not in follower.log()
        assert 3 in replica(db, "orders")   # nothing of the commit applied
    finally:
        follower.stop()



def test_a_bootstrap_that_has_run_longer_than_its_topics_keep_tombstones_stops_in_one_line(
        dsn: str, conn: psycopg.Connection, orders: str, kafka: KafkaServer, kafka_prefix: str,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """follower.py _check_tombstones_kept(): a bootstrap misses a tombstone Kafka removed while it ran (the
    row's records read before); its commits made before it began count as old as the bootstrap. Here the
    topic keeps tombstones 1 ms and the bootstrap reads a commit a step (BATCH_RECORDS shortened): it
    stops before its second step, nothing of it applied. Before, a bootstrap was never checked."""
    monkeypatch.setattr(follower_module, "BATCH_RECORDS", 1)
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    conn.execute("DELETE FROM orders WHERE id = 3")
    publish(dsn, url)
    keep_tombstones(kafka.bootstrap, f"{kafka_prefix}.public.orders", 1)
    target = SqliteTarget(tmp_path / "follower.db")
    follower = Follower(parse_url(url), target)
    try:
        with pytest.raises(UserError, match=r"by commit \d+, its bootstrap began .* ago, longer than its topics keep"):
            follower.run(until_caught_up=True)
    finally:
        follower.close()
        target.close()
    assert 3 in replica(tmp_path / "follower.db", "orders")

READ_AGAIN = """
import sys
from replicator.follower.reader import PartitionReader
from replicator.targets.kafka.settings import parse_url
from replicator.targets.kafka.state import committed_consumer

tp = (sys.argv[2], 0)
reader = PartitionReader(committed_consumer(parse_url(sys.argv[1])), print)
reader.assign({tp: 0})
print(len(reader.available(tp, 10.0)), flush=True)   # every record so far, and the partition's end
last = int(sys.stdin.readline())                     # the offset of a record committed since
print(len(list(reader.records(tp, last))), flush=True)
"""


def test_a_partition_read_to_its_end_is_read_again_up_to_an_offset_committed_since(
        dsn: str, conn: psycopg.Connection, orders: str, kafka: KafkaServer, kafka_prefix: str) -> None:
    """reader.py, the same stale end as above, in records(): a partition that reached its end (here
    by a first read; in a follower, also when Kafka has made a commit visible on the commit topic
    before on a table's partition: "Kafka shows a committed transaction partition by partition")
    is never fetched again, and records() spins for ever on a CPU: the step never ends."""
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    topic = f"{kafka_prefix}.public.orders"
    script = subprocess.Popen([sys.executable, "-c", READ_AGAIN, url, topic], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert script.stdout is not None and script.stdin is not None
        assert script.stdout.readline().strip() == "5"
        conn.execute("INSERT INTO orders VALUES (6, 'later')")
        publish(dsn, url)
        last = len(topic_keys(kafka.bootstrap, topic))   # offsets 0-4, a marker at 5: the new record is at 6
        script.stdin.write(f"{last}\n")
        script.stdin.flush()
        try:
            out, _ = script.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("records() still running 30 s later")
        assert out.strip() == "1"
    finally:
        script.kill()
        script.wait()


@pytest.mark.parametrize("options", ["schemas=false", "decimals=string", "decimals=double"])
def test_a_follower_applies_a_prefix_published_with_other_envelope_options(
        dsn: str, conn: psycopg.Connection, source: Source, kafka: KafkaServer, kafka_prefix: str, tmp_path: Path,
        options: str) -> None:
    """follower.py _envelope(): the follower decodes every record as schemas=true, decimals=precise
    (EnvelopeSettings' defaults), whatever the commits' envelope options say: a prefix published
    with ?schemas=false or ?decimals=string|double (docs/kafka.md: the URL options) cannot be followed."""
    conn.execute("CREATE TABLE prices (id int PRIMARY KEY, v numeric(12,2))")
    conn.execute("INSERT INTO prices VALUES (1, 1234.50), (2, -0.25)")
    source.create_queue("q")
    source.add_table("q", "prices")
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}?{options}"
    publish(dsn, url)
    db = tmp_path / "follower.db"
    result = follow(dsn, url, f"sqlite:{db}")
    assert result.returncode == 0, result.stderr
    assert {k: float(v) for k, v in replica(db, "prices").items()} == {1: 1234.5, 2: -0.25}


def test_a_record_delivered_without_its_offset_makes_the_publisher_write_the_batch_again(
        dsn: str, conn: psycopg.Connection, source: Source, kafka: KafkaServer, kafka_prefix: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """publisher.py _delivered(): librdkafka reports a produce it retried, which Kafka had written already
    (DUPLICATE_SEQUENCE_NUMBER), as delivered with no offset. A commit naming no offset there is one no
    follower may believe (seen in CI on a loaded machine: the follower stopped at it), so the publisher
    aborts that transaction and writes the batch again."""
    conn.execute("CREATE TABLE prices (id int PRIMARY KEY, v numeric(12,2))")
    conn.execute("INSERT INTO prices SELECT g, g / 4.0 FROM generate_series(1, 40) g")
    source.create_queue("q")
    source.add_table("q", "prices")
    unlocated: list[str] = []
    delivered = KafkaTarget._delivered

    def the_first_row_without_its_offset(self: KafkaTarget, error: Any, message: Message) -> None:
        if error is None and not unlocated and message.topic() == f"{kafka_prefix}.public.prices":
            unlocated.append(f"{message.topic()}:{message.partition()}:{message.offset()}")
            message = Message(topic=message.topic(), partition=message.partition(), key=message.key(),
                              value=message.value())   # as librdkafka reports it: offset() is None
        delivered(self, error, message)

    monkeypatch.setattr(KafkaTarget, "_delivered", the_first_row_without_its_offset)
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    result = run_cli_in_process(dsn, "consume", "q", "--target", url, "--until-caught-up")
    assert result.returncode == 0, result.stderr
    assert unlocated, "no record of the table was delivered"
    db = tmp_path / "follower.db"
    followed = follow(dsn, url, f"sqlite:{db}")
    assert followed.returncode == 0, followed.stderr
    assert replica(db, "prices") == {i: pytest.approx(i / 4) for i in range(1, 41)}
    assert "without saying at which offsets" in caplog.text


def test_a_stream_follower_writes_each_delete_once(
        dsn: str, conn: psycopg.Connection, orders: str, kafka: KafkaServer, kafka_prefix: str,
        tmp_path: Path) -> None:
    """follower.py _apply(): a delete is two records, the 'd' and its tombstone, and each is applied
    as a delete: a stream target (jsonl:, tsv:) gets every delete twice, where a consumer of the
    queue writes it once ("applies the topics to any target exactly once")."""
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    stream = tmp_path / "changes.jsonl"
    assert follow(dsn, url, f"jsonl:{stream}").returncode == 0
    conn.execute("DELETE FROM orders WHERE id = 3")
    publish(dsn, url)
    result = follow(dsn, url, f"jsonl:{stream}")
    assert result.returncode == 0, result.stderr
    deletes = [line for line in map(json.loads, stream.read_text().splitlines()) if line["op"] == "D"]
    assert deletes == [{"op": "D", "table": "public.orders", "key": {"id": 3}}]


def test_a_new_follower_keeps_the_rows_of_a_renamed_table_once_a_new_table_of_its_old_name_is_compacted(
        dsn: str, conn: psycopg.Connection, source: Source, orders: str, kafka: KafkaServer, kafka_prefix: str,
        tmp_path: Path) -> None:
    """A renamed table's later records go to the topic of its new name; the records before the rename
    stay in the old topic, where a new table of the old name (ALTER TABLE t RENAME TO t_old; CREATE
    TABLE t, the migration replicator's consumer handles) writes records of the same keys: compaction
    keeps only the new table's, and a new follower's bootstrap loses the renamed table's rows
    (docs/kafka.md: "the replay builds every table as of the publisher's last commit")."""
    topic = f"{kafka_prefix}.public.orders"
    create_compacting_topic(kafka.bootstrap, topic)
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)                                          # 'r' records of ids 1 to 5
    conn.execute("ALTER TABLE orders RENAME TO orders_old")
    publish(dsn, url)
    conn.execute("CREATE TABLE orders (id int PRIMARY KEY, v text)")
    conn.execute("INSERT INTO orders VALUES (1, 'new table')")
    source.add_table("q", "orders")
    publish(dsn, url)
    before = tmp_path / "before.db"
    assert follow(dsn, url, f"sqlite:{before}").returncode == 0
    assert replica(before, "orders_old") == source_table(conn, "orders_old")   # right before compaction

    def compacted() -> bool:
        conn.execute("INSERT INTO orders SELECT coalesce(max(id), 0) + 1, 'rolls' FROM orders")
        publish(dsn, url)   # a later record: only closed segments are cleaned
        return key_of(1, topic_keys(kafka.bootstrap, topic)) == 1
    wait_until(compacted, 90, "Kafka to clean the old table's record of id 1", interval=0.5)

    after = tmp_path / "after.db"
    result = follow(dsn, url, f"sqlite:{after}")
    assert result.returncode == 0, result.stderr
    assert replica(after, "orders_old") == source_table(conn, "orders_old")
    assert replica(after, "orders") == source_table(conn, "orders")
def test_a_row_deleted_after_its_table_was_renamed_stays_deleted_in_a_new_follower_once_kafka_cleaned_it(
        dsn: str, conn: psycopg.Connection, orders: str, kafka: KafkaServer, kafka_prefix: str,
        tmp_path: Path) -> None:
    """The rows copied before a rename stay in the old topic; a delete after the rename is a 'd' and a
    tombstone in the new topic, which the cleaner drops in time (delete.retention.ms, a day by
    default, 0 here): a new follower then replays the old topic's record of the row and nothing
    deletes it: the row is back (docs/kafka.md: "the replay builds every table as of the
    publisher's last commit")."""
    new_topic = f"{kafka_prefix}.public.orders_old"
    create_compacting_topic(kafka.bootstrap, new_topic, **{"delete.retention.ms": "0"})
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)                                          # 'r' records of ids 1 to 5 in PREFIX.public.orders
    conn.execute("ALTER TABLE orders RENAME TO orders_old")
    publish(dsn, url)
    conn.execute("DELETE FROM orders_old WHERE id = 3")
    publish(dsn, url)

    def cleaned() -> bool:
        conn.execute("UPDATE orders_old SET v = v || '.' WHERE id = 1")
        publish(dsn, url)   # a later record: only closed segments are cleaned
        return key_of(3, topic_keys(kafka.bootstrap, new_topic)) == 0
    wait_until(cleaned, 90, "Kafka to clean the delete of id 3 and its tombstone", interval=0.5)

    db = tmp_path / "follower.db"
    result = follow(dsn, url, f"sqlite:{db}")
    assert result.returncode == 0, result.stderr
    assert replica(db, "orders_old") == source_table(conn, "orders_old")


def publish_and_delete_the_topic_of_a_dropped_table(dsn: str, conn: psycopg.Connection, source: Source,
                                                   bootstrap: str, prefix: str) -> str:
    """Publishes orders and customers, drops orders, deletes its topic; returns the URL."""
    conn.execute("CREATE TABLE customers (id int PRIMARY KEY, v text)")
    conn.execute("INSERT INTO customers VALUES (1, 'ann')")
    source.add_table("q", "customers")
    url = f"kafka://{bootstrap}/{prefix}"
    publish(dsn, url)
    conn.execute("DROP TABLE orders")
    publish(dsn, url)
    topic = f"{prefix}.public.orders"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.delete_topics([topic])[topic].result(30)
    return url


def test_a_new_follower_does_not_bring_back_truncated_rows_once_a_row_of_null_key_followed_the_truncate(
        dsn: str, conn: psycopg.Connection, source: Source, kafka: KafkaServer, kafka_prefix: str,
        tmp_path: Path) -> None:
    """envelope.py truncate_key(): a truncate's key is every key field null, optional: byte for byte
    the key of a row whose --key column is NULL (docs/kafka.md: such a column "may be NULL"). Such a
    row written after a TRUNCATE is, to compaction, a newer record of the truncate's key: the
    truncate goes, and a new follower's bootstrap brings back the rows truncated."""
    conn.execute("CREATE TABLE codes (code text, v text)")
    conn.execute("INSERT INTO codes VALUES ('a', 'truncated')")
    source.create_queue("q")
    source.add_table("q", "codes", key=["code"])
    topic = f"{kafka_prefix}.public.codes"
    create_compacting_topic(kafka.bootstrap, topic)
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    conn.execute("TRUNCATE codes")
    publish(dsn, url)
    conn.execute("INSERT INTO codes VALUES (NULL, 'after the truncate')")
    publish(dsn, url)

    rolling = iter(range(1_000_000))

    def truncate_cleaned() -> bool:
        conn.execute("INSERT INTO codes VALUES (%s, 'rolls the segment')", (f"r{next(rolling)}",))
        publish(dsn, url)   # a later record: only closed segments are cleaned
        nulls = [key for key in topic_keys(kafka.bootstrap, topic)
                 if key is not None and json.loads(key)["payload"] == {"code": None}]
        return len(nulls) == 1
    wait_until(truncate_cleaned, 90, "Kafka to clean the truncate record", interval=0.5)

    db = tmp_path / "follower.db"
    result = follow(dsn, url, f"sqlite:{db}")
    assert result.returncode == 0, result.stderr
    with closing(sqlite_reader(db)) as reader_db:
        held = reader_db.execute("SELECT code, v FROM codes").fetchall()
    assert sorted(held, key=repr) == sorted(conn.execute("SELECT code, v FROM codes").fetchall(), key=repr)


def test_a_follower_resuming_past_a_delete_compaction_removed_deletes_by_its_tombstones_exact_key(
        dsn: str, conn: psycopg.Connection, source: Source, kafka: KafkaServer, kafka_prefix: str,
        tmp_path: Path) -> None:
    """Keys are Debezium's: an interval key with months is Debezium's MicroDuration in its record key.
    Compaction cleans a delete's record before its tombstone (kept delete.retention.ms): a follower
    that resumes after that reads the tombstone alone, and deletes the row by the exact key its
    replicator.key header holds."""
    conn.execute("CREATE TABLE spans (k interval PRIMARY KEY, v text)")
    conn.execute("INSERT INTO spans VALUES ('1 mon', 'deleted'), ('2 days', 'kept')")
    source.create_queue("q")
    source.add_table("q", "spans")
    topic = f"{kafka_prefix}.public.spans"
    create_compacting_topic(kafka.bootstrap, topic, **{"delete.retention.ms": "86400000"})
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    db = tmp_path / "follower.db"
    assert follow(dsn, url, f"sqlite:{db}").returncode == 0
    conn.execute("DELETE FROM spans WHERE k = '1 mon'")
    publish(dsn, url)

    rolling = iter(range(1_000_000))
    month = {"k": 2_629_800_000_000}

    def delete_cleaned() -> bool:
        conn.execute("UPDATE spans SET v = %s WHERE k = '2 days'", (f"rolls {next(rolling)}",))
        publish(dsn, url)   # a later record: only closed segments are cleaned
        return sum(key is not None and json.loads(key)["payload"] == month
                   for key in topic_keys(kafka.bootstrap, topic)) == 1   # its copied row and delete gone
    wait_until(delete_cleaned, 90, "Kafka to clean the delete record", interval=0.5)

    result = follow(dsn, url, f"sqlite:{db}")
    assert result.returncode == 0, result.stderr
    with closing(sqlite_reader(db)) as reader_db:
        held = reader_db.execute("SELECT k, v FROM spans").fetchall()
    conn.execute("SET IntervalStyle = 'postgres'")
    assert held == conn.execute("SELECT k::text, v FROM spans").fetchall()


def test_a_new_follower_finishes_when_the_topic_of_a_dropped_table_was_deleted(
        dsn: str, conn: psycopg.Connection, source: Source, orders: str, kafka: KafkaServer, kafka_prefix: str,
        tmp_path: Path) -> None:
    """The commits hold every partition's last offset for ever, those of dropped tables' topics too
    (the publisher writes no tombstones for a dropped table's rows: an operator deletes the topic).
    reader.records() then waits for ever for the records the commit says the deleted topic holds,
    saying nothing: --until-caught-up never returns."""
    url = publish_and_delete_the_topic_of_a_dropped_table(dsn, conn, source, kafka.bootstrap, kafka_prefix)
    db = tmp_path / "follower.db"
    try:
        result = follow(dsn, url, f"sqlite:{db}", timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("a new follower still running after 60 s, silent")
    assert result.returncode == 0, result.stderr
    assert replica(db, "customers") == {1: "ann"}


def test_a_follower_until_caught_up_applies_what_was_committed_whatever_its_poll_interval(
        dsn: str, orders: str, kafka: KafkaServer, kafka_prefix: str, tmp_path: Path) -> None:
    """follower.py run(): the goal of --until-caught-up is the last commit read within one
    --poll-interval ("Seconds to wait when no batch is ready", 0.2 by default, 0 allowed); a first
    fetch slower than that (0 here; a loaded machine with the default: this file's envelope tests
    got empty replicas that way under load) leaves no goal, and the run ends at once, exit status
    0, having applied nothing."""
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    db = tmp_path / "follower.db"
    result = run_cli(dsn, "consume", "--source", url, "--target", f"sqlite:{db}", "--until-caught-up",
                     "--poll-interval", "0")
    assert result.returncode == 0, result.stderr
    assert len(replica(db, "orders")) == 5


def test_a_follower_until_caught_up_that_cannot_reach_kafka_fails_in_one_line(
        dsn: str, conn: psycopg.Connection, orders: str, own_kafka: KafkaServer, kafka_prefix: str,
        tmp_path: Path) -> None:
    """follower.py run(): --until-caught-up takes as its goal the commits read within one
    --poll-interval; with Kafka unreachable there are none, and the run ends at once with exit
    status 0, as if caught up, having applied nothing (docs/kafka.md: "--until-caught-up
    everything committed to Kafka before the start"). Its first metadata request waits 2 s
    (kafka.socket.timeout.ms), not the 10 s it may take by default: the same path, sooner."""
    url = f"kafka://{own_kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    own_kafka.kill()
    db = tmp_path / "follower.db"
    try:
        result = follow(dsn, f"{url}?kafka.socket.timeout.ms=2000", f"sqlite:{db}", timeout=90)
    except subprocess.TimeoutExpired:   # waiting for Kafka to come back would do too
        return
    assert result.returncode == 1, (result.returncode, replica(db, "orders"))
    assert "Kafka" in result.stderr.splitlines()[-1]


def test_a_follower_of_a_prefix_nothing_publishes_is_refused_in_one_line_before_making_its_target(
        dsn: str, kafka: KafkaServer, kafka_prefix: str, tmp_path: Path) -> None:
    """A mistyped prefix: no commit topic, no table; the follower would end with exit status 0 (its
    target made, holding a position), as a consumer of a queue that does not exist does not. Refused,
    it leaves nothing behind: no SQLite file a later run (with the prefix right) would take for its own."""
    result = follow(dsn, f"kafka://{kafka.bootstrap}/{kafka_prefix}_typo", f"sqlite:{tmp_path / 'follower.db'}")
    assert result.returncode == 1
    assert f"{kafka_prefix}_typo" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "follower.db").exists()


def test_a_follower_with_tables_the_prefix_does_not_publish_is_refused_in_one_line(
        dsn: str, orders: str, kafka: KafkaServer, kafka_prefix: str, tmp_path: Path) -> None:
    """--tables ordres (a typo): the follower follows nothing, with exit status 0; a consumer of the
    queue refuses it ("queue 'q' does not capture ordres")."""
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    assert run_cli(dsn, "consume", "q", "--target", f"sqlite:{tmp_path / 'direct.db'}", "--tables", "ordres",
                   "--until-caught-up").returncode == 1
    result = follow(dsn, url, f"sqlite:{tmp_path / 'follower.db'}", "--tables", "ordres")
    assert result.returncode == 1
    assert "ordres" in result.stderr


def test_a_new_follower_with_tables_naming_a_table_renamed_since_it_was_published_follows_it(
        dsn: str, conn: psycopg.Connection, orders: str, kafka: KafkaServer, kafka_prefix: str,
        tmp_path: Path) -> None:
    """follower.py: --tables is matched against the name in each schema change, so the CREATE of a
    table since renamed (under its old name) is skipped, and its rename then fails: "alters table
    public.orders, which this follower never saw created: follow into a new target" (a new target is
    what this is); the rows copied before the rename are in the old name's topic, which
    _followed_topics() never adds (docs/kafka.md: "A table renamed at the source is followed to its
    new topic")."""
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    conn.execute("ALTER TABLE orders RENAME TO orders_old")
    conn.execute("INSERT INTO orders_old VALUES (6, 'after the rename')")
    publish(dsn, url)
    db = tmp_path / "follower.db"
    result = follow(dsn, url, f"sqlite:{db}", "--tables", "orders_old")
    assert result.returncode == 0, result.stderr
    assert replica(db, "orders_old") == source_table(conn, "orders_old")


def test_a_follower_until_caught_up_applies_every_commit_made_before_it_started_however_many(
        dsn: str, conn: psycopg.Connection, orders: str, kafka: KafkaServer, kafka_prefix: str,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """follower.py run(): the goal of --until-caught-up is the last commit of one read of the commit
    topic, which stops when that partition holds BUFFERED records (it is paused): a follower more
    than BUFFERED (20,000) commits behind stops there, exit status 0, short of what was committed
    before it started (docs/kafka.md: "--until-caught-up everything committed to Kafka before the
    start"). BUFFERED and FETCH shortened to 4 and 2 commits: the same path, with 12 commits."""
    monkeypatch.setattr(reader, "BUFFERED", 4)
    monkeypatch.setattr(reader, "FETCH", 2)
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    for row in range(6, 18):   # a commit each
        conn.execute("INSERT INTO orders VALUES (%s, 'one a commit')", (row,))
        publish(dsn, url)
    target = SqliteTarget(tmp_path / "follower.db")
    follower = Follower(parse_url(url), target)
    try:
        follower.run(until_caught_up=True)
    finally:
        follower.close()
        target.close()
    assert replica(tmp_path / "follower.db", "orders") == source_table(conn, "orders")


def test_a_bootstrap_holds_at_most_a_few_partitions_worth_of_records_whatever_the_number_of_tables(
        dsn: str, conn: psycopg.Connection, source: Source, kafka: KafkaServer, kafka_prefix: str,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """reader.py: a follower bootstrapping a prefix of N tables holds about BUFFERED records in all,
    each partition paused at its share, not N times a partition's limit (10 GB for 500 tables of 1 kB
    rows, before). BUFFERED and FETCH shortened to 10 and 5 records, 12 tables of 40 rows."""
    monkeypatch.setattr(reader, "BUFFERED", 10)
    monkeypatch.setattr(reader, "MIN_SHARE", 1)
    monkeypatch.setattr(reader, "FETCH", 5)
    source.create_queue("q")
    for n in range(12):
        conn.execute(f"CREATE TABLE t{n} (id int PRIMARY KEY, v text)")
        conn.execute(f"INSERT INTO t{n} SELECT g, 'row' FROM generate_series(1, 40) g")
        source.add_table("q", f"t{n}")
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    peak = 0

    class MeasuredReader(reader.PartitionReader):
        def _route(self, message: Any) -> None:
            nonlocal peak
            super()._route(message)
            peak = max(peak, sum(len(buffer) for buffer in self._buffers.values()))

    monkeypatch.setattr(follower_module, "PartitionReader", MeasuredReader)
    target = SqliteTarget(tmp_path / "follower.db")
    follower = Follower(parse_url(url), target)
    try:
        assert follower.step(wait=1.0) is not None   # the first commits: the copies of several tables
    finally:
        follower.close()
        target.close()
    assert replica(tmp_path / "follower.db", "t0") == source_table(conn, "t0")
    # each partition's share, plus what librdkafka had fetched before a pause took hold: far from the
    # 13 x BUFFERED (and more) a limit per partition let 13 partitions hold
    assert peak <= 8 * reader.BUFFERED, f"{peak} records buffered at once"


# errors and credentials --------------------------------------------------------------------


@pytest.mark.parametrize("role", ["publisher", "follower"])
def test_an_unknown_librdkafka_option_is_one_line_naming_it_not_an_internal_error(
        dsn: str, orders: str, kafka: KafkaServer, kafka_prefix: str, tmp_path: Path, role: str) -> None:
    """settings.py passes kafka.* options to librdkafka unchecked: a mistyped one is a KafkaException
    that cli.main reports as "internal error ... please report it"."""
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}?kafka.sasl.mechanisms=PLAIN&kafka.secuirty.protocol=SASL_SSL"
    args = (["consume", "q", "--target", url] if role == "publisher" else
            ["consume", "--source", url, "--target", f"sqlite:{tmp_path / 'follower.db'}"])
    result = run_cli(dsn, *args, "--until-caught-up")
    assert result.returncode == 1
    assert "internal error" not in result.stderr, result.stderr
    assert "secuirty.protocol" in result.stderr


@pytest.mark.parametrize("mistake", ["queue and --source", "one slash"])
def test_an_error_about_a_kafka_url_never_shows_its_options(dsn: str, tmp_path: Path, mistake: str) -> None:
    """docs/kafka.md: "logs and consumer names never show options" (kafka.sasl.password among them);
    cli.consume prints the whole --source URL when QUEUE is given too, settings.parse_url the whole
    URL it cannot read."""
    options = "kafka.sasl.username=app&kafka.sasl.password=s3cret"
    replica_url = f"sqlite:{tmp_path / 'f.db'}"
    if mistake == "queue and --source":
        args = ["q", "--source", f"kafka://127.0.0.1:9/shop?{options}", "--target", replica_url]
    else:
        args = ["--source", f"kafka:/127.0.0.1:9/shop?{options}", "--target", replica_url]
    result = run_cli(dsn, "consume", *args)
    assert result.returncode == 1
    assert "s3cret" not in result.stderr, result.stderr


# the publisher -----------------------------------------------------------------------------


def test_a_table_dropped_and_created_again_before_the_publisher_applied_the_drop_is_published(
        dsn: str, conn: psycopg.Connection, source: Source, kafka: KafkaServer, kafka_prefix: str,
        tmp_path: Path) -> None:
    """publisher.py _claim_topic(): the consumer copies the new table (sync_tables, before the batch
    holding the DROP) while the dropped one, of the same name and topic, is still among the
    publisher's tables: "public.t and public.t would both publish to topic ...", at every start,
    for good. A consumer into SQLite takes the same queue."""
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    conn.execute("INSERT INTO t VALUES (1, 'old')")
    source.create_queue("q")
    source.follow_schema("q", "public")   # the new t is captured as it is created
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    conn.execute("DROP TABLE t")
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    conn.execute("INSERT INTO t VALUES (2, 'new')")
    direct = run_cli(dsn, "consume", "q", "--target", f"sqlite:{tmp_path / 'direct.db'}", "--until-caught-up")
    assert direct.returncode == 0, direct.stderr
    publish(dsn, url)
    db = tmp_path / "follower.db"
    result = follow(dsn, url, f"sqlite:{db}")
    assert result.returncode == 0, result.stderr
    assert replica(db, "t") == {2: "new"}


def test_a_delta_follower_stores_the_offset_of_each_partition_and_reads_on_from_it(
        dsn: str, conn: psycopg.Connection, orders: str, kafka: KafkaServer, kafka_prefix: str,
        tmp_path: Path) -> None:
    """The Delta target keeps one position per transaction (the last set_position(): the follower's
    "tick"), so none of a follower's offsets is stored: each run reads every topic from offset 0 and
    replaces every table (CREATE OR REPLACE, then the whole topic again); docs/kafka.md: "The offset
    reached in each partition ... stored in the target ... resumes from them"."""
    pytest.importorskip("deltalake")
    from replicator.targets import open_target

    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    warehouse = f"delta:{tmp_path / 'lake'}"
    assert follow(dsn, url, warehouse).returncode == 0
    conn.execute("UPDATE orders SET v = 'changed' WHERE id = 1")
    publish(dsn, url)
    result = follow(dsn, url, warehouse)
    assert result.returncode == 0, result.stderr
    assert "1 record applied" in result.stderr, result.stderr   # the update alone, as a SQLite follower reads
    target = open_target(warehouse)
    try:
        positions = target.positions(f"kafka:{kafka_prefix}")
    finally:
        target.close()
    assert f"{kafka_prefix}.public.orders:0" in positions, positions


def test_a_record_larger_than_its_topic_takes_stops_the_publisher_in_one_line(
        dsn: str, conn: psycopg.Connection, orders: str, kafka: KafkaServer, kafka_prefix: str) -> None:
    """publisher.py _flush(): the broker's refusal of a record larger than the topic's
    max.message.bytes (a topic made by an operator, or the producer's limit raised as the
    publisher's own message for client-side refusals advises) is not fatal to librdkafka, so it
    is TargetUnavailable: the consumer retries the batch for ever, "target unavailable", and
    --until-caught-up never ends."""
    create_compacting_topic(kafka.bootstrap, f"{kafka_prefix}.public.orders", **{"max.message.bytes": "20000"})
    conn.execute("INSERT INTO orders SELECT 6, string_agg(md5(g::text), '') FROM generate_series(1, 2000) g")
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    try:
        result = run_cli(dsn, "consume", "q", "--target", url, "--until-caught-up", timeout=90)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the publisher still retrying after 90 s: {(exc.stderr or b'')[-300:]!r}")
    assert result.returncode == 1
    assert "max.message.bytes" in result.stderr.splitlines()[-1], result.stderr


def test_a_publisher_publishes_again_once_kafka_is_back_after_an_outage_longer_than_its_timeout(
        dsn: str, conn: psycopg.Connection, orders: str, own_kafka: KafkaServer, kafka_prefix: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """publisher.py rollback(): the abort of a transaction whose broker is away times out and is
    ignored; librdkafka keeps that abort in progress until abort_transaction() is called again, so
    every begin_transaction() after it fails (_CONFLICT) and the consumer retries the batch for
    ever, Kafka back or not (docs/kafka.md: "While a broker is unreachable the publisher retries
    the batch"). The wait (socket.timeout.ms, 60 s) shortened to 3 s: the same path, sooner."""
    url = f"kafka://{own_kafka.bootstrap}/{kafka_prefix}?kafka.socket.timeout.ms=3000"
    publish(dsn, url)
    target = KafkaTarget(parse_url(url))
    try:
        table = target.tables()["public.orders"]
        (queue,) = target.queues()
        ((consumer, tick),) = target.positions(queue).items()

        def batch(value: str) -> None:
            """A batch as the consumer applies one: rolled back when Kafka cannot take it."""
            target.begin()
            try:
                target.upsert(table, "U", [(1, value)])
                target.producer.flush(10)   # the rows are in the transaction, on the broker
                if value == "lost":
                    own_kafka.kill()
                target.set_position(queue, consumer, tick)
                target.commit()
            except BaseException:
                target.rollback()
                raise

        with pytest.raises(TargetUnavailable):
            batch("lost")
        own_kafka.start()
        deadline = time.monotonic() + 60
        while True:
            try:
                batch("after the outage")
                break
            except TargetUnavailable as exc:
                assert time.monotonic() < deadline, f"still unavailable 60 s after Kafka came back: {exc}"
    finally:
        target.close()


class _FlushLosingItsError:
    """A producer whose flush raises a fatal error as confluent_kafka once did in CI for a fenced producer:
    a SystemError with no cause (it raises a KafkaException, or a SystemError caused by one)."""

    def __init__(self, producer: Any) -> None:
        self.producer = producer
        self.errors_lost = 0

    def flush(self, timeout: float) -> int:
        try:
            left: int = self.producer.flush(timeout)
        except (KafkaException, SystemError):
            self.errors_lost += 1
            raise SystemError("<built-in method flush> returned NULL without setting an exception") from None
        return left

    def __getattr__(self, name: str) -> Any:
        return getattr(self.producer, name)


def test_a_fenced_publisher_stops_in_one_line_when_its_flush_loses_the_fatal_error(
        dsn: str, conn: psycopg.Connection, orders: str, kafka: KafkaServer, kafka_prefix: str) -> None:
    """A fenced publisher says another publisher took over, whatever form the fatal error comes out of its
    flush in (a bare SystemError stopped it in a traceback); and it never starts a producer again, which
    would fence the publisher that took over."""
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    first = KafkaTarget(parse_url(url))
    second = None
    try:
        table = first.tables()["public.orders"]
        (queue,) = first.queues()
        ((consumer, tick),) = first.positions(queue).items()
        first.begin()
        first.upsert(table, "U", [(1, "from the publisher before it was fenced")])
        first.producer.flush(10)
        second = KafkaTarget(parse_url(url))   # its producer's start fences the first's
        first.upsert(table, "U", [(1, "from the fenced publisher")])   # refused: the producer stops (fatal)
        flush = first.producer = _FlushLosingItsError(first.producer)  # type: ignore[assignment]
        first.set_position(queue, consumer, tick)
        with pytest.raises(UserError, match="another publisher took over"):
            first.commit()
        assert flush.errors_lost >= 1
        first.rollback()
        second.begin()
        second.upsert(table, "U", [(1, "from the publisher that took over")])
        second.set_position(queue, consumer, tick)
        second.commit()
    finally:
        first.close()
        if second is not None:
            second.close()


@pytest.mark.parametrize("abort", ["while the broker is stopped", "once it goes on"])
def test_a_batch_published_again_after_an_abort_is_in_the_commit_when_the_broker_wrote_its_first_try_unanswered(
        dsn: str, conn: psycopg.Connection, orders: str, own_kafka: KafkaServer, kafka_prefix: str,
        abort: str) -> None:
    """The broker stopped while a produce was in flight: the producer gives up on it, the publisher aborts the
    transaction, and the broker, going on, writes the records into the aborted transaction. The batch
    published again must be in its commit: the producer sent it with the sequence numbers of the records
    written unanswered, Kafka answered it as their duplicate, at their offsets, and the commit held none of
    it (a CI failure of the broker-restart test)."""
    url = f"kafka://{own_kafka.bootstrap}/{kafka_prefix}?kafka.socket.timeout.ms=2000"
    topic = f"{kafka_prefix}.public.orders"
    publish(dsn, url)
    target = KafkaTarget(parse_url(url))
    assert own_kafka.process is not None
    broker = own_kafka.process.pid
    try:
        table = target.tables()["public.orders"]
        (queue,) = target.queues()
        ((consumer, tick),) = target.positions(queue).items()
        target.begin()
        target.upsert(table, "U", [(2, "answered, aborted")])
        target.producer.flush(30)   # the partition is in the transaction: the next record is sent at once
        os.kill(broker, signal.SIGSTOP)
        try:
            target.upsert(table, "U", [(1, "written unanswered, aborted")])
            target.set_position(queue, consumer, tick)
            with pytest.raises(TargetUnavailable):
                target.commit()
            if abort == "while the broker is stopped":
                target.rollback()
        finally:
            os.kill(broker, signal.SIGCONT)
        if abort == "once it goes on":
            target.rollback()

        def published_again() -> bool:
            try:
                target.begin()
                target.upsert(table, "U", [(1, "published again")])
                target.set_position(queue, consumer, tick)
                target.commit()
            except TargetUnavailable:   # the broker catching up
                target.rollback()
                return False
            return True

        wait_until(published_again, 60, "the batch published again")
    finally:
        target.close()
    assert "written unanswered, aborted" in update_values(own_kafka.bootstrap, topic, "read_uncommitted")
    assert update_values(own_kafka.bootstrap, topic, "read_committed") == ["published again"]


def update_values(bootstrap: str, topic: str, isolation: str) -> list[str]:
    """The `v` of each update record of the topic a reader of that isolation level reads."""
    return [r.value_payload["after"]["v"] for r in read_committed(bootstrap, topic, isolation)
            if r.value is not None and r.value_payload["op"] == "u"]


def test_a_publisher_that_aborted_records_stops_at_its_next_batch_rather_than_fence_one_that_took_over(
        dsn: str, conn: psycopg.Connection, orders: str, kafka: KafkaServer, kafka_prefix: str) -> None:
    """A publisher starts a new producer after aborting records; one that took over meanwhile, and committed,
    must go on: the first stops in one line at its next batch (its new producer fenced the other, which
    stopped too at its next commit)."""
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    first = KafkaTarget(parse_url(url))
    second = None
    try:
        table = first.tables()["public.orders"]
        (queue,) = first.queues()
        ((consumer, tick),) = first.positions(queue).items()
        first.begin()
        first.upsert(table, "U", [(1, "aborted")])
        first.rollback()
        second = KafkaTarget(parse_url(url))
        for row in [(1, "from the publisher that took over"), (2, "from it again")]:
            if row[0] == 2:
                with pytest.raises(UserError, match="another publisher took over"):
                    first.begin()
            second.begin()
            second.upsert(table, "U", [row])
            second.set_position(queue, consumer, tick)
            second.commit()
    finally:
        first.close()
        if second is not None:
            second.close()
    assert update_values(kafka.bootstrap, f"{kafka_prefix}.public.orders", "read_committed") == [
        "from the publisher that took over", "from it again"]


def test_a_batch_rolled_back_finds_the_tables_as_the_last_commit_left_them(
        dsn: str, conn: psycopg.Connection, orders: str, kafka: KafkaServer, kafka_prefix: str) -> None:
    """The consumer clears a table's copy snapshot in place (its events then stop being skipped) and
    saves it; a batch rolled back after that must see the snapshot again, or its retry publishes the
    events the copy holds a second time."""
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    target = KafkaTarget(parse_url(url))
    try:
        committed = target.tables()["public.orders"].copy_snapshot
        target.begin()
        table = target.tables()["public.orders"]
        table.copy_snapshot = None if committed else "1:1:"   # in place, as the consumer does
        target.save_table(table)
        target.rollback()
        assert target.tables()["public.orders"].copy_snapshot == committed
    finally:
        target.close()
