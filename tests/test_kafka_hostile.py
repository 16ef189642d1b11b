"""Kafka topics written by something other than the publisher (issue 26, findings 3-7): a plain,
non-transactional confluent_kafka Producer with write access to the topics, or an operator's topic
reset. Nothing is applied that the publisher did not commit; a follower stops in one line naming
the record and the way out; --skip-record gets past a record the publisher did not write.

Everything is real: PostgreSQL, the session's broker, the `replicator` command, SQLite replicas."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from consumer_helpers import Daemon, forced_tick, run_cli, wait_until
from kafka_helpers import SEQUENCE_HEADER, last_commit, read_committed, replay, topic_ends
from kafkaserver import KafkaServer
from replicator.errors import UserError
from replicator.follower import follower as follower_module
from replicator.follower.follower import Follower
from replicator.shutdown import StopFlag
from replicator.source import Source
from replicator.targets.kafka.envelope import KEY_HEADER
from replicator.targets.kafka.settings import parse_url
from replicator.targets.sqlite.target import SqliteTarget


def publish(dsn: str, url: str, *args: str) -> None:
    result = run_cli(dsn, "consume", "q", "--target", url, "--until-caught-up", *args)
    assert result.returncode == 0, result.stderr


def follow(dsn: str, url: str, db: Path | str, *args: str) -> subprocess.CompletedProcess[str]:
    """A follower run --until-caught-up into db (a SQLite file, or a target URL)."""
    target = db if isinstance(db, str) else f"sqlite:{db}"
    return run_cli(dsn, "consume", "--source", url, "--target", target, "--until-caught-up", *args, timeout=180)


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def replica(path: Path) -> dict[int, Any]:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    try:
        return dict(db.execute('SELECT id, v FROM "orders"').fetchall())
    finally:
        db.close()


def source_rows(conn: psycopg.Connection) -> dict[int, Any]:
    return dict(conn.execute("SELECT id, v FROM orders").fetchall())


def plain_write(bootstrap: str, topic: str, key: bytes | None, value: bytes | None,
                header: bytes | None = None, *, headers: Sequence[tuple[str, bytes]] = ()) -> int:
    """A record written by a plain producer (no transaction), with the sequence header given and any
    other headers; returns its offset."""
    producer = Producer({"bootstrap.servers": bootstrap})
    offsets: list[int] = []
    all_headers = ([(SEQUENCE_HEADER, header)] if header else []) + list(headers)
    producer.produce(topic, value, key, partition=0, headers=all_headers or None,
                     on_delivery=lambda error, message: offsets.append(message.offset()))
    assert producer.flush(30) == 0
    return offsets[0]


def forged_commit(bootstrap: str, prefix: str, **changes: Any) -> tuple[int, dict[str, Any]]:
    """The publisher's last commit, changed, written again by a plain producer: its offset and value."""
    commit = last_commit(bootstrap, prefix)
    assert commit is not None
    forged = {**commit, **changes}
    offset = plain_write(bootstrap, f"__replicator.{prefix}", b"commit", json.dumps(forged).encode(),
                         b"%d.%d" % (forged["commit"], forged["records"]))
    return offset, forged


# finding 3 ---------------------------------------------------------------------------------

def test_a_publisher_does_not_resume_from_a_commit_a_plain_producer_wrote(
        dsn: str, conn: psycopg.Connection, orders: str, kafka: KafkaServer, kafka_prefix: str,
        tmp_path: Path) -> None:
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    conn.execute("INSERT INTO orders SELECT g, 'late' || g FROM generate_series(6, 8) g")
    tick = forced_tick(conn)
    offset, _ = forged_commit(kafka.bootstrap, kafka_prefix, tick=tick, commit=99)
    publish(dsn, url)
    rows = replay(read_committed(kafka.bootstrap, f"{kafka_prefix}.public.orders"))[f"{kafka_prefix}.public.orders"]
    assert sorted(row["id"] for row in rows.values()) == list(range(1, 9))
    # a follower stops at the forged commit, naming it; passed over, it equals the source
    db = tmp_path / "f.db"
    forged = f"__replicator.{kafka_prefix}:0:{offset}"
    line = one_error_line(follow(dsn, url, db))
    assert forged in line and "--skip-record" in line
    result = follow(dsn, url, db, "--skip-record", forged)
    assert result.returncode == 0, result.stderr
    assert f"record {forged} passed over" in result.stderr
    assert replica(db) == source_rows(conn)


def test_a_publisher_whose_last_commit_is_at_a_tick_the_source_consumer_is_not_at_stops_in_one_line(
        dsn: str, conn: psycopg.Connection, orders: str, kafka: KafkaServer, kafka_prefix: str) -> None:
    """A commit in a transaction of another transactional.id (a principal the ACLs let write) passes the
    marker check: the publisher checks its tick against the source consumer's."""
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    conn.execute("INSERT INTO orders SELECT g, 'late' || g FROM generate_series(6, 8) g")
    tick = forced_tick(conn)
    commit = last_commit(kafka.bootstrap, kafka_prefix)
    assert commit is not None
    transactional_write(kafka.bootstrap, kafka_prefix, {**commit, "commit": commit["commit"] + 1, "tick": tick})
    line = one_error_line(run_cli(dsn, "consume", "q", "--target", url, "--until-caught-up"))
    assert f"at tick {tick}, but consumer" in line


def transactional_write(bootstrap: str, prefix: str, commit: dict[str, Any]) -> None:
    """A commit record, and a topic record for each topic it lists, written in a transaction of a
    transactional.id other than the publisher's."""
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"other.{prefix}"})
    producer.init_transactions(30)
    producer.begin_transaction()
    records = [(b"commit", commit), *((b"topic:" + topic.encode(), parts) for topic, parts in commit["last"].items())]
    for index, (key, value) in enumerate(records, commit["records"]):
        producer.produce(f"__replicator.{prefix}", json.dumps(value).encode(), key,
                         headers=[(SEQUENCE_HEADER, b"%d.%d" % (commit["commit"], index))])
    producer.commit_transaction(30)


# finding 4 ---------------------------------------------------------------------------------

def test_a_follower_applies_nothing_after_a_commit_numbered_far_ahead_by_a_plain_producer(
        dsn: str, conn: psycopg.Connection, orders: str, kafka: KafkaServer, kafka_prefix: str,
        tmp_path: Path) -> None:
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    db = tmp_path / "f.db"
    assert follow(dsn, url, db).returncode == 0
    offset, _ = forged_commit(kafka.bootstrap, kafka_prefix, commit=10 ** 12)
    conn.execute("INSERT INTO orders VALUES (6, 'six')")
    publish(dsn, url)
    forged = f"__replicator.{kafka_prefix}:0:{offset}"
    assert forged in one_error_line(follow(dsn, url, db))
    assert follow(dsn, url, db, "--skip-record", forged).returncode == 0
    assert replica(db) == source_rows(conn)


def target_rows(kind: str, path: Path, table: str = "orders") -> dict[int, Any]:
    """The rows (id, v) of a table in a follower's SQLite file or Delta warehouse (read by delta-rs)."""
    if kind == "sqlite":
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
        try:
            return dict(db.execute(f'SELECT id, v FROM "{table}"').fetchall())
        finally:
            db.close()
    import pyarrow as pa
    from deltalake import DeltaTable

    from replicator.targets.delta.reader import table_uris
    rows = pa.table(DeltaTable(table_uris(str(path))[f"public.{table}"]).scan().read_all()).to_pylist()
    return {row["id"]: row["v"] for row in rows}


@pytest.mark.parametrize("kind", ["sqlite", "delta"])
def test_a_follower_of_topics_deleted_and_made_anew_stops_in_one_line_and_recopy_rebuilds_it(
        dsn: str, conn: psycopg.Connection, orders: str, kafka: KafkaServer, kafka_prefix: str,
        tmp_path: Path, kind: str) -> None:
    """The new topics number their commits from 1 again, below those the target holds: a Delta table's own
    record of the commit it holds (a txn action) must not hold the rebuild back, nor, later, a table created
    where one the old topics dropped was. A Delta rebuild killed midway is run again, not gone on from."""
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    conn.execute("CREATE TABLE tmp (id int PRIMARY KEY, v text); INSERT INTO tmp VALUES (1, 'old')")
    conn.execute("SELECT replicator.add_table('q', 'tmp')")
    publish(dsn, url)
    for i in range(6, 9):   # commits and offsets beyond those the new topics will have
        conn.execute("INSERT INTO orders VALUES (%s, 'x')", (i,))
        forced_tick(conn)
        publish(dsn, url)
    conn.execute("DROP TABLE tmp")
    publish(dsn, url)
    db = tmp_path / "f.db"
    target = f"{kind}:{db}"
    assert follow(dsn, url, target).returncode == 0
    topics = [kafka_prefix, f"{kafka_prefix}.public.orders", f"{kafka_prefix}.public.tmp", f"__replicator.{kafka_prefix}"]
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    for future in admin.delete_topics(topics).values():
        future.result(30)
    wait_until(lambda: not set(topics) & set(admin.list_topics(timeout=10).topics), 30, "the topics deleted")
    conn.execute("DELETE FROM orders WHERE id = 1")
    publish(dsn, url, "--consumer", "again")   # a new publisher copies the tables into new topics
    line = one_error_line(follow(dsn, url, target))
    assert "made anew" in line and "--recopy" in line
    assert 1 in target_rows(kind, db)   # nothing applied: the replica is as the old topics left it
    if kind == "delta":   # the rebuild killed between the table's commit and the warehouse's
        crashed = run_cli(dsn, "consume", "--source", url, "--target", target, "--until-caught-up", "--recopy",
                          timeout=180, REPLICATOR_CRASH_AT="delta-table-committed")
        assert crashed.returncode == -9, crashed.stderr
        assert "stopped midway; run the follower again with --recopy" in one_error_line(follow(dsn, url, target))
    assert follow(dsn, url, target, "--recopy").returncode == 0
    assert target_rows(kind, db) == source_rows(conn)
    conn.execute("UPDATE orders SET v = 'later' WHERE id = 2")
    conn.execute("CREATE TABLE tmp (id int PRIMARY KEY, v text); INSERT INTO tmp VALUES (1, 'new'), (2, 'new')")
    conn.execute("SELECT replicator.add_table('q', 'tmp')")
    publish(dsn, url, "--consumer", "again")
    assert follow(dsn, url, target).returncode == 0   # on from the rebuild's positions
    assert target_rows(kind, db) == source_rows(conn)
    assert target_rows(kind, db, "tmp") == {1: "new", 2: "new"}


# finding 5 ---------------------------------------------------------------------------------

def test_a_create_record_written_again_by_a_plain_producer_does_not_empty_the_table(
        dsn: str, conn: psycopg.Connection, orders: str, kafka: KafkaServer, kafka_prefix: str,
        tmp_path: Path) -> None:
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    db = tmp_path / "f.db"
    assert follow(dsn, url, db).returncode == 0
    create = read_committed(kafka.bootstrap, kafka_prefix)[0]
    commit = last_commit(kafka.bootstrap, kafka_prefix)
    assert commit is not None
    offset = plain_write(kafka.bootstrap, kafka_prefix, create.key, create.value, b"%d.0" % (commit["commit"] + 1))
    conn.execute("ALTER TABLE orders ADD COLUMN w int")   # the next commit covers the schema topic's end
    conn.execute("INSERT INTO orders VALUES (6, 'six')")
    publish(dsn, url)
    forged = f"{kafka_prefix}:0:{offset}"
    for target in (db, tmp_path / "new.db"):   # a follower, and a new one
        assert forged in one_error_line(follow(dsn, url, target))
        assert follow(dsn, url, target, "--skip-record", forged).returncode == 0
        assert replica(target) == source_rows(conn)


# finding 6 ---------------------------------------------------------------------------------

def test_a_follower_waiting_for_offsets_no_partition_reaches_stops_on_sigterm_and_in_one_line(
        dsn: str, conn: psycopg.Connection, orders: str, kafka: KafkaServer, kafka_prefix: str,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit written in a transaction of another transactional.id (a principal the ACLs let write)
    passes the marker check: its offsets past the partitions' ends are waited for a bounded time."""
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    db = tmp_path / "f.db"
    assert follow(dsn, url, db).returncode == 0
    commit = last_commit(kafka.bootstrap, kafka_prefix)
    assert commit is not None
    forged = {**commit, "commit": commit["commit"] + 1,
              "last": {topic: {p: o + 1000 for p, o in parts.items()}
                       for topic, parts in topic_ends(kafka.bootstrap, kafka_prefix).items()}}
    transactional_write(kafka.bootstrap, kafka_prefix, forged)
    # a daemon: SIGTERM stops it promptly, its target transaction rolled back
    daemon = Daemon(dsn, "consume", "--source", url, "--target", f"sqlite:{db}", "--poll-interval", "0.05",
                    log=tmp_path / "daemon.log")
    try:
        wait_until(lambda: _writing(db), 60, "the daemon waiting inside a target transaction",
                   check=lambda: _alive(daemon))
        started = time.monotonic()
        assert daemon.terminate(timeout=10) == 0
        assert time.monotonic() - started < 10
    finally:
        daemon.stop()
    sqlite3.connect(db, timeout=1).execute("BEGIN IMMEDIATE").connection.rollback()   # no transaction left open
    # in process, with a short wait: one line naming the commit
    monkeypatch.setattr(follower_module, "VISIBLE_WAIT", 2.0)
    target = SqliteTarget(db)
    follower = Follower(parse_url(url), target)
    try:
        with pytest.raises(UserError, match=r"commit \d+ \(__replicator\.\S+:0:\d+\) says the publisher wrote"):
            follower.run(until_caught_up=True, stop=StopFlag())
    finally:
        follower.close()
        target.close()
    assert replica(db) == {i: f"v{i}" for i in range(1, 6)}
    # a restarted publisher does not copy the forged offsets into its commits
    result = run_cli(dsn, "consume", "q", "--target", url, "--until-caught-up")
    assert "says offset" in one_error_line(result)


def _alive(daemon: Daemon) -> None:
    assert daemon.alive(), daemon.log()


def _writing(db: Path) -> bool:
    """Whether another connection holds SQLite's write lock on db."""
    if not db.exists():
        return False
    try:
        sqlite3.connect(db, timeout=0).execute("BEGIN IMMEDIATE").connection.rollback()
    except sqlite3.OperationalError:
        return True
    return False


# finding 7 ---------------------------------------------------------------------------------

@pytest.mark.parametrize("poison", ["no header", "not JSON", "no change", "schema without structure",
                                    "tombstone key header not JSON", "tombstone key header no map",
                                    "topic end not JSON", "topic end not offsets"])
def test_a_poison_record_stops_a_follower_in_one_line_and_skip_record_gets_past_it(
        dsn: str, conn: psycopg.Connection, orders: str, kafka: KafkaServer, kafka_prefix: str,
        tmp_path: Path, poison: str) -> None:
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    db = tmp_path / "f.db"
    assert follow(dsn, url, db).returncode == 0
    commit = last_commit(kafka.bootstrap, kafka_prefix)
    assert commit is not None
    header = b"%d.0" % (commit["commit"] + 1)
    topic = f"{kafka_prefix}.public.orders"
    if poison == "no header":
        offset = plain_write(kafka.bootstrap, topic, b"{}", b"{}")
    elif poison == "not JSON":
        offset = plain_write(kafka.bootstrap, topic, b"k", b"\xff not json", header)
    elif poison == "no change":
        offset = plain_write(kafka.bootstrap, topic, b"{}", b'{"payload": {"op": "c"}}', header)
    elif poison.startswith("topic end"):   # a state record saying where a table topic ends (state.py)
        forged = b"\xff not json" if poison.endswith("JSON") else b'{"0": "far"}'
        offset = plain_write(kafka.bootstrap, f"__replicator.{kafka_prefix}", b"topic:" + topic.encode(), forged,
                             header)
        topic = f"__replicator.{kafka_prefix}"
    elif poison.startswith("tombstone"):   # a genuine key, the exact texts its header claims to hold forged
        key = next(r.key for r in read_committed(kafka.bootstrap, topic) if r.key_payload == {"id": 1})
        forged = b"{not json" if poison.endswith("not JSON") else b'["1"]'
        offset = plain_write(kafka.bootstrap, topic, key, None, header, headers=[(KEY_HEADER, forged)])
    else:
        topic = kafka_prefix
        value = {"payload": {"replicator": json.dumps({"call": "create", "table_id": 1, "name": "x", "mode": "full"})}}
        offset = plain_write(kafka.bootstrap, topic, b"k", json.dumps(value).encode(), header)
        conn.execute("ALTER TABLE orders ADD COLUMN w int")
    conn.execute("INSERT INTO orders VALUES (6, 'six')")
    publish(dsn, url)
    poisoned = f"{topic}:0:{offset}"
    for target in (db, tmp_path / "new.db"):   # a follower, and a new one
        line = one_error_line(follow(dsn, url, target))
        assert poisoned in line and "internal error" not in line
        result = follow(dsn, url, target, "--skip-record", poisoned)
        assert result.returncode == 0, result.stderr
        assert replica(target) == source_rows(conn)


def test_skip_record_takes_topic_partition_offset_only(dsn: str, kafka: KafkaServer, kafka_prefix: str,
                                                      tmp_path: Path) -> None:
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    assert "TOPIC:PARTITION:OFFSET" in one_error_line(follow(dsn, url, tmp_path / "f.db", "--skip-record", "x:1"))


def forged_row(bootstrap: str, prefix: str, row_id: int, header: bytes) -> int:
    """The last committed record of row `row_id` in the orders topic, its v made 'forged', written again by a
    plain producer with the given replicator.sequence header; returns its offset."""
    topic = f"{prefix}.public.orders"
    genuine = [r for r in read_committed(bootstrap, topic) if r.value is not None and r.key_payload == {"id": row_id}]
    assert genuine, "no record of the row to copy"
    value = re.sub(rb'"v": ?"[^"]*"', b'"v": "forged"', genuine[-1].value or b"")
    assert b"forged" in value
    return plain_write(bootstrap, topic, genuine[-1].key, value, header)


@pytest.mark.usefixtures("orders")
def test_following_the_error_line_of_a_duplicated_sequence_never_applies_the_forged_record(
        dsn: str, conn: psycopg.Connection, kafka: KafkaServer, kafka_prefix: str,
        tmp_path: Path) -> None:
    """A plain producer writes a record with the header of the publisher's next record before the publisher
    does: the follower applies the forged one (first in the merge) and names the genuine one as `again`,
    so --skip-record as the line says drops the genuine record and keeps the forged one."""
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    db = tmp_path / "f.db"
    assert follow(dsn, url, db).returncode == 0
    commit = last_commit(kafka.bootstrap, kafka_prefix)
    assert commit is not None
    forged_row(kafka.bootstrap, kafka_prefix, 1, b"%d.0" % (commit["commit"] + 1))
    conn.execute("UPDATE orders SET v = 'six' WHERE id = 1")
    publish(dsn, url)
    result = follow(dsn, url, db)
    assert result.returncode == 1, result.stderr
    skip = re.search(r"--skip-record (\S+)", result.stderr)
    assert skip is not None, result.stderr
    result = follow(dsn, url, db, "--skip-record", skip.group(1))
    assert replica(db).get(1) != "forged", (skip.group(1), result.stderr)


@pytest.mark.usefixtures("orders")
def test_a_follower_with_tables_does_not_apply_a_record_forged_with_the_sequence_of_a_table_it_does_not_follow(
        dsn: str, conn: psycopg.Connection, source: Source, kafka: KafkaServer, kafka_prefix: str,
        tmp_path: Path) -> None:
    """The sequence checks pass over the topics of tables a --tables follower does not follow: a forged record
    carrying the header of a genuine record there is no duplicate, and is applied."""
    conn.execute("CREATE TABLE other (id int PRIMARY KEY, v text)")
    source.add_table("q", "other")
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    db = tmp_path / "f.db"
    assert follow(dsn, url, db, "--tables", "orders").returncode == 0
    commit = last_commit(kafka.bootstrap, kafka_prefix)
    assert commit is not None
    forged_row(kafka.bootstrap, kafka_prefix, 1, b"%d.0" % (commit["commit"] + 1))
    with conn.transaction():   # record 0 of the next commit goes to other's topic, record 1 to orders'
        conn.execute("INSERT INTO other VALUES (1, 'o')")
        conn.execute("INSERT INTO orders VALUES (6, 'six')")
    publish(dsn, url)
    result = follow(dsn, url, db, "--tables", "orders")
    assert replica(db).get(1) != "forged", result.stderr


@pytest.mark.usefixtures("orders")
def test_a_follower_does_not_apply_a_record_forged_with_the_sequence_of_a_table_record(
        dsn: str, conn: psycopg.Connection, kafka: KafkaServer, kafka_prefix: str,
        tmp_path: Path) -> None:
    """A commit that changes the tables counts the `table:` record of the state topic among its records (after
    it): a record of a table topic carrying that index is none of the commit's records before it, which stops
    the follower before it applies anything of the step; passed over, the follower catches up."""
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    db = tmp_path / "f.db"
    assert follow(dsn, url, db).returncode == 0   # at commit N
    conn.execute("ALTER TABLE orders ADD COLUMN w int")
    conn.execute("UPDATE orders SET v = 'one' WHERE id = 1")
    publish(dsn, url)   # commit N+1 changes the tables
    state = read_committed(kafka.bootstrap, f"__replicator.{kafka_prefix}")
    tables = [r for r in state if (r.key or b"").startswith(b"table:")][-1]
    number, index = tables.sequence
    assert [r for r in state if r.key == b"commit"][-1].sequence == (number, index - 1)   # the table record's index
    offset = forged_row(kafka.bootstrap, kafka_prefix, 1, b"%d.%d" % (number, index))
    conn.execute("INSERT INTO orders VALUES (6, 'six', 6)")
    publish(dsn, url)   # commit N+2 covers the forged record's offset
    result = follow(dsn, url, db)   # N+1 and N+2 in one step: stops at the forged record, applying neither
    forged = f"{kafka_prefix}.public.orders:0:{offset}"
    assert result.returncode == 1 and f"--skip-record {forged}" in one_error_line(result), result.stderr
    assert replica(db).get(1) == "v1"
    result = follow(dsn, url, db, "--skip-record", forged)
    assert result.returncode == 0, result.stderr
    assert replica(db) == source_rows(conn)


@pytest.mark.usefixtures("orders")
def test_passing_over_the_record_after_a_commit_no_marker_follows_does_not_make_a_forged_commit_count(
        dsn: str, conn: psycopg.Connection, kafka: KafkaServer, kafka_prefix: str, tmp_path: Path) -> None:
    """A plain producer writes a commit and, right after it, any record: the follower stops at the commit.
    Passing over the record after it leaves no gap that reads as the commit's transaction marker: the
    follower stops at the commit again, and the forged row it covers is never applied."""
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    publish(dsn, url)
    db = tmp_path / "f.db"
    assert follow(dsn, url, db).returncode == 0
    commit = last_commit(kafka.bootstrap, kafka_prefix)
    assert commit is not None
    number = commit["commit"] + 1
    row = forged_row(kafka.bootstrap, kafka_prefix, 1, b"%d.0" % number)
    state = f"__replicator.{kafka_prefix}"
    forged = {**commit, "commit": number, "records": 1,
              "last": {**commit["last"], f"{kafka_prefix}.public.orders": {"0": row}}}
    offset = plain_write(kafka.bootstrap, state, b"commit", json.dumps(forged).encode(), b"%d.1" % number)
    assert plain_write(kafka.bootstrap, state, b"x", b"{}") == offset + 1
    result = follow(dsn, url, db)
    assert result.returncode == 1 and f"{state}:0:{offset}" in result.stderr
    assert f"--skip-record {state}:0:{offset}" in one_error_line(result)
    result = follow(dsn, url, db, "--skip-record", f"{state}:0:{offset + 1}")
    assert result.returncode == 1 and f"--skip-record {state}:0:{offset}" in result.stderr.splitlines()[-1]
    assert replica(db).get(1) != "forged", result.stderr


@pytest.mark.usefixtures("orders")
def test_a_table_dropped_whose_topic_the_operator_deleted_then_created_again_reaches_a_follower_whole(
        dsn: str, conn: psycopg.Connection, kafka: KafkaServer, kafka_prefix: str, tmp_path: Path) -> None:
    """The publisher stops listing a dropped table's topic so that "an operator may delete it"
    (publisher._forget_topic); a table created again under the name gets a new topic from offset 0. The
    follower keeps its offset in the old topic, and reads the new one from there: the rows before it are
    lost without a word (or, the new topic shorter, it refuses to start, saying the topics were made anew)."""
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    for i in range(6, 12):   # the old topic: offsets 0 to 10
        conn.execute("INSERT INTO orders VALUES (%s, 'x')", (i,))
    publish(dsn, url)
    db = tmp_path / "f.db"
    assert follow(dsn, url, db).returncode == 0
    conn.execute("DROP TABLE orders")
    publish(dsn, url)
    assert follow(dsn, url, db).returncode == 0   # the table dropped on the follower too
    topic = f"{kafka_prefix}.public.orders"
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    for future in admin.delete_topics([topic]).values():
        future.result(30)
    wait_until(lambda: topic not in admin.list_topics(timeout=10).topics, 30, "the dropped table's topic deleted")
    conn.execute("CREATE TABLE orders (id int PRIMARY KEY, v text)")
    conn.execute("INSERT INTO orders SELECT g, 'new' || g FROM generate_series(1, 30) g")
    conn.execute("SELECT replicator.add_table('q', 'orders')")
    publish(dsn, url)
    result = follow(dsn, url, db)
    assert result.returncode == 0, result.stderr
    assert replica(db) == source_rows(conn)


@pytest.mark.usefixtures("orders")
def test_a_follower_reading_a_commits_records_while_the_broker_is_down_waits_for_it(
        dsn: str, conn: psycopg.Connection, own_kafka: KafkaServer, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An outage longer than VISIBLE_WAIT while a step reads the partitions a commit names is taken for a
    commit the publisher did not write: the follower (a daemon too) stops, telling the operator to
    --skip-record a genuine commit, where before it waited for Kafka."""
    monkeypatch.setattr(follower_module, "VISIBLE_WAIT", 2.0)   # 30 s in production; the outage is longer
    url = f"kafka://{own_kafka.bootstrap}/shop"
    publish(dsn, url)
    db = tmp_path / "f.db"
    target = SqliteTarget(db)
    follower = Follower(parse_url(url), target)
    try:
        wait_until(lambda: (follower._read_commits(0.2), follower._commits)[1], 60, "the commit read")
        own_kafka.kill()
        done = threading.Event()

        def restart() -> None:
            done.wait(3.0)   # with the broker's start, an outage longer than VISIBLE_WAIT
            own_kafka.restart()
            # the broker gets SIGTERM when the thread that started it ends (setpriv --pdeathsig): this one
            # lives until the step is over (a Timer's thread ended at once, and the broker with it)
            done.wait()

        restarting = threading.Thread(target=restart)
        restarting.start()
        try:
            stats = follower.step()
        finally:
            done.set()
            restarting.join()
        assert stats is not None
    finally:
        follower.close()
        target.close()
    assert replica(db) == source_rows(conn)
