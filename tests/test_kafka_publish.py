"""The Kafka publisher, `replicator consume QUEUE --target kafka://BROKERS/PREFIX`, against a real
broker and a real PostgreSQL.

1. The records docs/kafka.md describes: the initial copy, each kind of change, truncates in every
   partition, the `source` block, schema changes in order with the rows, the commit record, and
   records without schemas.
2. Exactly once through kill -9 at each commit step, and through random kills of the daemon.
3. A broker killed and restarted under a running publisher.
4. A second publisher of the prefix fencing the first.
5. Bad input refused in one line.

What Kafka holds is read by a plain read_committed consumer (kafka_helpers), never by replicator's
own reader, and checked against two oracles: the queue's events, read by a consumer of the test's
own registered beside the publisher (each event's rows are records exactly once), and the source's
tables (replaying the topics gives them)."""

from __future__ import annotations

import contextlib
import json
import random
import socket
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from consumer_helpers import (
    Daemon,
    copy_while_a_ddl_holds_the_table,
    forced_tick,
    run_cli,
    set_fast_ticks,
    wait_until,
)
from kafka_helpers import (
    Record,
    in_publishing_order,
    last_commit,
    publish,
    publisher_daemon,
    read_committed,
    replay,
    replaying,
    topic_ends,
)
from kafkaserver import KafkaServer
from pg_helpers import fresh_database
from queue_util import Event, read_events
from replicator.source import Source

ORACLE = "oracle"   # the test's own consumer of the queue: the events the publisher must publish
ROW_OPS = {"I": "c", "U": "u", "D": "d"}   # event type → Debezium op


# the source and the oracle -------------------------------------------------------------------

TABLES_DDL = """
    CREATE TABLE t (id int PRIMARY KEY, v text, n bigint NOT NULL DEFAULT 0);
    CREATE TABLE u (a int, b text, qty int, PRIMARY KEY (a, b));
    INSERT INTO t SELECT g, 'v' || g, 0 FROM generate_series(1, 200) g;
    INSERT INTO u SELECT g % 10, 'b' || (g / 10), g FROM generate_series(1, 50) g;
"""


def capture(source: Source, *tables: str) -> None:
    source.create_queue("q")
    for table in tables:
        source.add_table("q", table)


def url(kafka: KafkaServer, prefix: str, options: str = "") -> str:
    return f"kafka://{kafka.bootstrap}/{prefix}{'?' + options if options else ''}"


def key_text(key: Any) -> str:
    return json.dumps(key, sort_keys=True)


def source_rows(conn: psycopg.Connection, table: str) -> dict[str, dict[str, Any]]:
    """The source table as {key as JSON text: the row as JSON}: what its topic's replay must give
    (the tables' columns are of types whose Debezium payload is their JSON: int, bigint, text)."""
    key = [r[0] for r in conn.execute(
        "SELECT a.attname FROM pg_index i CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY k(attnum, n)"
        " JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum"
        " WHERE i.indrelid = %s::regclass AND i.indisprimary ORDER BY k.n", (table,))]
    return {key_text({k: row[k] for k in key}): row
            for (row,) in conn.execute(f"SELECT to_jsonb(x) FROM {table} x")}


def topic_of(prefix: str, table: str) -> str:
    return f"{prefix}.public.{table}"


def table_records(bootstrap: str, prefix: str, tables: tuple[str, ...]) -> list[Record]:
    """The records of the tables' topics, all of the publisher's last commit among them."""
    last_commit(bootstrap, prefix)
    return [r for table in tables for r in read_committed(bootstrap, topic_of(prefix, table))]


def assert_topics_replay_to_the_source(conn: psycopg.Connection, bootstrap: str, prefix: str,
                                       tables: tuple[str, ...]) -> None:
    replayed = replay(table_records(bootstrap, prefix, tables))
    for table in tables:
        expected, got = source_rows(conn, table), replayed.get(topic_of(prefix, table), {})
        missing = sorted(expected.keys() - got.keys())
        extra = sorted(got.keys() - expected.keys())
        differ = sorted(k for k in expected.keys() & got.keys() if expected[k] != got[k])
        assert not (missing or extra or differ), (f"{table}: {len(missing)} rows missing {missing[:5]}, "
                                                  f"{len(extra)} extra {extra[:5]}, {len(differ)} differ "
                                                  f"{[(expected[k], got[k]) for k in differ[:3]]}")


class Oracle:
    """A consumer of the queue of the test's own, registered once the publisher has copied the
    tables: the events it reads are the changes the publisher must publish."""

    def __init__(self, source: Source) -> None:
        self.source = source
        source.register_consumer("q", ORACLE)
        self.events: list[Event] = []

    def changes(self, prefix: str, partition_count: int) -> Counter[tuple]:
        """(topic, op, key, event id) of every change record the events so far make (tombstones
        aside): each inserted, updated or deleted row one record, a truncate one per partition."""
        self.events += read_events(self.source, "q", ORACLE)
        return expected_changes(self.events, self.source, prefix, partition_count)


def expected_changes(events: list[Event], source: Source, prefix: str, partition_count: int) -> Counter[tuple]:
    tables = {t.table_id: t for t in source.tables("q")}
    changes: Counter[tuple] = Counter()
    for event in events:
        table = tables[event.table]
        topic = topic_of(prefix, table.table)
        positions = [table.columns.index(k) for k in table.key]
        if event.type == "T":
            # every key field null: no row's key (the tables' keys are NOT NULL)
            truncate_key = key_text({k: None for k in table.key})
            changes[(topic, "t", truncate_key, event.ev_id)] += partition_count
        elif event.type in ROW_OPS:
            for item in event.items:
                values = item if event.type == "D" else [item[p] for p in positions]
                changes[(topic, ROW_OPS[event.type], key_text(dict(zip(table.key, values))), event.ev_id)] += 1
    return changes


def published_changes(records: list[Record]) -> Counter[tuple]:
    return Counter((r.topic, r.value_payload["op"], key_text(r.key_payload), r.value_payload["source"]["event"])
                   for r in records if r.value is not None and r.value_payload["op"] != "r")


def assert_deletes_are_followed_by_their_tombstone(records: list[Record]) -> None:
    ordered = in_publishing_order(records)
    deletes = [i for i, r in enumerate(ordered) if r.value is not None and r.value_payload["op"] == "d"]
    for i in deletes:
        tombstone = ordered[i + 1] if i + 1 < len(ordered) else None
        assert tombstone is not None and tombstone.value is None and tombstone.key == ordered[i].key, \
            f"the delete {ordered[i].key!r} at {ordered[i].sequence} is not followed by its tombstone"
    assert sum(r.value is None for r in records) == len(deletes), "a tombstone without its delete"


def assert_published_exactly_once(oracle: Oracle, bootstrap: str, prefix: str, tables: tuple[str, ...],
                                  partition_count: int = 1) -> None:
    """Every change the oracle consumer reads from the queue is a record once, and no other is."""
    expected = oracle.changes(prefix, partition_count)
    records = table_records(bootstrap, prefix, tables)
    got = published_changes(records)
    missing, extra = expected - got, got - expected
    if missing:   # (which of them a transaction wrote that is not committed: aborted, or still open)
        written = published_changes([r for table in tables
                                     for r in read_committed(bootstrap, topic_of(prefix, table), "read_uncommitted")])
        uncommitted = f" ({sum((missing & (written - got)).values())} of them in records not committed)"
    assert not missing and not extra, (f"{sum(missing.values())} changes missing{uncommitted if missing else ''} "
                                       f"{list(missing.items())[:5]}, "
                                       f"{sum(extra.values())} published too often {list(extra.items())[:5]}")
    assert expected, "the workload made no change"
    assert_deletes_are_followed_by_their_tombstone(records)


def assert_copied_once(records: list[Record], keys: set[str]) -> None:
    copied = Counter(key_text(r.key_payload) for r in records if r.value is not None and r.value_payload["op"] == "r")
    assert set(copied) == keys and set(copied.values()) == {1}, \
        f"{len(keys - set(copied))} rows not copied, {sum(n > 1 for n in copied.values())} copied twice"


def assert_succeeded(result: Any) -> None:
    assert result.returncode == 0, result.stderr


def one_line_error(result: Any) -> str:
    """The error a run stopped with: exit status 1, one line, no traceback."""
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), result.stderr
    return last


def clock_ms(conn: psycopg.Connection, rounding: str = "floor") -> int:
    """The source's clock in milliseconds since 1970 (rounding: floor or ceil)."""
    return conn.execute(f"SELECT {rounding}(extract(epoch FROM clock_timestamp()) * 1000)::bigint").fetchone()[0]


# 1. the records ------------------------------------------------------------------------------

def test_an_initial_copy_is_a_create_record_then_op_r_records_keyed_by_the_rows_keys(dsn, conn, source, kafka,
                                                                                      kafka_prefix):
    conn.execute(TABLES_DDL)
    capture(source, "t", "u")
    assert_succeeded(publish(dsn, url(kafka, kafka_prefix)))

    assert last_commit(kafka.bootstrap, kafka_prefix) is not None   # and its records visible
    for table in ("t", "u"):
        records = read_committed(kafka.bootstrap, topic_of(kafka_prefix, table))
        rows = source_rows(conn, table)
        assert_copied_once(records, set(rows))
        for record in records:
            value = record.value_payload
            assert value["op"] == "r" and value["before"] is None
            assert value["after"] == rows[key_text(record.key_payload)]
            assert value["source"]["event"] is None and value["source"]["txId"] is None
        # a table's copy is a snapshot of its own, marked as Debezium marks a snapshot's rows
            assert (value["source"]["schema"], value["source"]["table"]) == ("public", table)
        markers = [r.value_payload["source"]["snapshot"] for r in in_publishing_order(records)]
        assert markers == ["first"] + ["true"] * (len(rows) - 2) + ["last"]
    creates = [r.value_payload for r in read_committed(kafka.bootstrap, kafka_prefix)]
    assert [(c["tableChanges"][0]["type"], c["tableChanges"][0]["id"]) for c in creates] == [
        ("CREATE", '"public"."t"'), ("CREATE", '"public"."u"')]
    assert [c["name"] for c in creates[1]["tableChanges"][0]["table"]["columns"]] == ["a", "b", "qty"]
    assert creates[1]["tableChanges"][0]["table"]["primaryKeyColumnNames"] == ["a", "b"]


def test_changes_are_c_u_d_tombstone_and_t_records_with_their_tick_event_and_transaction(dsn, conn, source, kafka,
                                                                                          kafka_prefix):
    conn.execute(TABLES_DDL)
    capture(source, "t")
    target = url(kafka, kafka_prefix, "partitions=3")
    assert_succeeded(publish(dsn, target))
    now_us = "(extract(epoch FROM now()) * 1000000)::bigint"   # the transaction's start: its events' ev_time
    with conn.transaction():
        (txid, written) = conn.execute(f"SELECT txid_current(), {now_us}").fetchone()
        conn.execute("INSERT INTO t VALUES (1000, 'new', 1)")
        conn.execute("UPDATE t SET v = 'changed' WHERE id = 5")
        conn.execute("DELETE FROM t WHERE id = 6")
        conn.execute("UPDATE t SET id = 2000 WHERE id = 7")   # a key change
    with conn.transaction():
        (truncating, truncated) = conn.execute(f"SELECT txid_current(), {now_us}").fetchone()
        conn.execute("TRUNCATE t")
        conn.execute("INSERT INTO t VALUES (1, 'after the truncate', 0)")
    publishing = time.time_ns() // 1000
    assert_succeeded(publish(dsn, target))
    published = time.time_ns() // 1000

    commit = last_commit(kafka.bootstrap, kafka_prefix)
    assert commit is not None
    records = read_committed(kafka.bootstrap, topic_of(kafka_prefix, "t"))
    assert {r.partition for r in records} == {0, 1, 2}
    changes = [r for r in in_publishing_order(records) if r.sequence[0] == commit["commit"]]
    seen = [(r.value_payload["op"] if r.value is not None else "tombstone", r.key_payload["id"]) for r in changes]
    assert seen == [("c", 1000),
                    # a delete before the updated rows of the event just before it (other keys): Debezium's
                    # order for a key change, queued as the new row (U), then the key that vanished (D)
                    ("d", 6), ("tombstone", 6), ("u", 5),
                    ("d", 7), ("tombstone", 7), ("u", 2000),
                    ("t", None), ("t", None), ("t", None), ("c", 1)]
    truncates = [r for r in changes if r.value is not None and r.value_payload["op"] == "t"]
    assert sorted(r.partition for r in truncates) == [0, 1, 2]
    values = {(r.value_payload["op"], r.key_payload["id"]): r.value_payload for r in changes if r.value is not None}
    assert values[("c", 1000)]["after"] == {"id": 1000, "v": "new", "n": 1}
    assert values[("u", 5)]["after"] == {"id": 5, "v": "changed", "n": 0}
    assert values[("u", 5)]["before"] is None
    assert values[("d", 6)]["before"] == {"id": 6, "v": None, "n": 0} and values[("d", 6)]["after"] is None
    assert values[("t", None)]["after"] is None and values[("t", None)]["before"] is None

    sources = [r.value_payload["source"] for r in changes if r.value is not None]
    assert {s["tick"] for s in sources} == {commit["tick"]}
    events = [s["event"] for s in sources]
    # I, U, D, U and D of the key change, T, I
    assert [events[i] for i in (0, 2, 1, 4, 3, 5, 8)] == sorted(set(events)) and len(set(events)) == 7
    assert [s["txId"] for s in sources] == [txid] * 5 + [truncating] * 4
    # the event's time to the microsecond (the queue's ev_time), in every unit
    assert [(s["ts_ms"], s["ts_us"], s["ts_ns"]) for s in sources] == [
        (us // 1000, us, us * 1000) for us in [written] * 5 + [truncated] * 4]
    assert {(s["snapshot"], s["db"], s["connector"], s["name"], s["origin"], s["origin_lsn"]) for s in sources} == {
        ("false", conn.info.dbname, "replicator", kafka_prefix, None, None)}
    # when the publisher wrote each record, to the microsecond
    written_at = [(r.value_payload["ts_ms"], r.value_payload["ts_us"], r.value_payload["ts_ns"])
                  for r in changes if r.value is not None]
    assert all(publishing <= us <= published and (ms, ns) == (us // 1000, us * 1000) for ms, us, ns in written_at)


def test_rows_of_a_pk_mode_table_have_the_transaction_and_time_of_the_last_event_that_changed_them(
        dsn, conn, source, kafka, kafka_prefix):
    """A pk-mode table's rows are read back from the source when the batch is applied: their source
    block is the last event of the batch that named the row's key (its transaction and time), the
    event id null (the row is applied at the read, not at the event's place)."""
    conn.execute(TABLES_DDL)
    source.create_queue("q")
    source.add_table("q", "t", mode="pk")
    target = url(kafka, kafka_prefix)
    assert_succeeded(publish(dsn, target))
    now_us = "(extract(epoch FROM now()) * 1000000)::bigint"
    origins: dict[int, tuple[int, int]] = {}   # key → (txid, ev_time) of the last transaction that changed it
    for keys, statements in (([1, 2, 3], ["UPDATE t SET v = 'first' WHERE id IN (1, 2)", "DELETE FROM t WHERE id = 3"]),
                             ([2, 1000], ["UPDATE t SET v = 'second' WHERE id = 2",
                                          "INSERT INTO t VALUES (1000, 'new', 0)"])):
        with conn.transaction():
            origin = conn.execute(f"SELECT txid_current(), {now_us}").fetchone()
            for statement in statements:
                conn.execute(statement)
        origins.update(dict.fromkeys(keys, origin))
    assert_succeeded(publish(dsn, target))

    commit = last_commit(kafka.bootstrap, kafka_prefix)
    assert commit is not None
    records = read_committed(kafka.bootstrap, topic_of(kafka_prefix, "t"))
    changes = [r for r in records if r.sequence[0] == commit["commit"] and r.value is not None]
    assert sorted((r.key_payload["id"], r.value_payload["op"]) for r in changes) == [
        (1, "u"), (2, "u"), (3, "d"), (1000, "u")]
    for record in changes:
        s = record.value_payload["source"]
        txid, us = origins[record.key_payload["id"]]
        assert (s["txId"], s["ts_us"], s["ts_ms"], s["event"], s["tick"]) == (txid, us, us // 1000, None,
                                                                               commit["tick"]), record.key_payload


def test_a_copy_again_marks_its_rows_as_a_snapshot(dsn, conn, source, kafka, kafka_prefix):
    conn.execute(TABLES_DDL)
    capture(source, "u")
    target = url(kafka, kafka_prefix)
    assert_succeeded(publish(dsn, target))
    conn.execute("ALTER TABLE u ADD COLUMN flag boolean NOT NULL DEFAULT true")   # rewrites: copied again
    assert_succeeded(publish(dsn, target))

    commit = last_commit(kafka.bootstrap, kafka_prefix)
    assert commit is not None
    copied = [r for r in in_publishing_order(read_committed(kafka.bootstrap, topic_of(kafka_prefix, "u")))
              if r.sequence[0] == commit["commit"] and r.value is not None and r.value_payload["op"] == "r"]
    assert len(copied) == 50
    assert [r.value_payload["source"]["snapshot"] for r in copied] == ["first"] + ["true"] * 48 + ["last"]


ROWS_LEAVING = {
    # a pk-mode table's delete pending when the same batch copies it again
    "pk-mode delete, then a column added": (
        "CREATE TABLE w (id int PRIMARY KEY, v text); INSERT INTO w SELECT g, 'v' FROM generate_series(1, 6) g",
        {"mode": "pk"},
        lambda conn, source: conn.execute("DELETE FROM w WHERE id = 3; "
                                          "ALTER TABLE w ADD COLUMN n int NOT NULL DEFAULT 7")),
    # rows gone without a row trigger: the copy again must not be written over the sink's rows
    "a partition truncated": (
        "CREATE TABLE w (id int PRIMARY KEY, v text) PARTITION BY RANGE (id); "
        "CREATE TABLE w1 PARTITION OF w FOR VALUES FROM (0) TO (4); "
        "CREATE TABLE w2 PARTITION OF w FOR VALUES FROM (4) TO (10); "
        "INSERT INTO w SELECT g, 'v' FROM generate_series(1, 6) g",
        {},
        lambda conn, source: conn.execute("TRUNCATE w1")),
    # a rewrite's copy keeps the sink's rows: the partition's truncate after it asks for its own copy
    "a column's type changed, then a partition truncated, in one transaction": (
        "CREATE TABLE w (id int PRIMARY KEY, v text) PARTITION BY RANGE (id); "
        "CREATE TABLE w1 PARTITION OF w FOR VALUES FROM (0) TO (4); "
        "CREATE TABLE w2 PARTITION OF w FOR VALUES FROM (4) TO (10); "
        "INSERT INTO w SELECT g, 'v' FROM generate_series(1, 6) g",
        {},
        lambda conn, source: conn.execute("ALTER TABLE w ALTER COLUMN v TYPE varchar(10); TRUNCATE w1")),
    "a narrower --where": (
        "CREATE TABLE w (id int PRIMARY KEY, v text); INSERT INTO w SELECT g, 'v' FROM generate_series(1, 6) g",
        {},
        lambda conn, source: source.alter_table("q", "w", where="id > 3", set_where=True)),
}


@pytest.mark.parametrize("case", ROWS_LEAVING)
def test_a_copy_again_after_rows_left_without_events_leaves_a_sink_only_the_sources_rows(
        dsn, conn, source, kafka, kafka_prefix, case):
    """A copy written over a sink's rows leaves the rows no event removed: such copies are preceded by
    a truncate, as a copy after rows left must be."""
    ddl, options, change = ROWS_LEAVING[case]
    conn.execute(ddl)
    source.create_queue("q")
    source.add_table("q", "w", **options)
    target = url(kafka, kafka_prefix)
    assert_succeeded(publish(dsn, target))
    change(conn, source)
    assert_succeeded(publish(dsn, target))
    replayed = replay(table_records(kafka.bootstrap, kafka_prefix, ("w",)))[topic_of(kafka_prefix, "w")]
    where = "WHERE id > 3" if case == "a narrower --where" else ""
    assert set(replayed) == {json.dumps({"id": i}) for (i,) in conn.execute(f"SELECT id FROM w {where}")}


def test_truncates_an_initial_copy_holds_publish_nothing(dsn, conn, source, kafka, kafka_prefix):
    """The copy has the rows after them: a truncate record (where Flink stops) and a copy again
    would repeat what the copy says."""
    conn.execute("CREATE TABLE a (id int PRIMARY KEY); CREATE TABLE b (id int PRIMARY KEY, v text)")
    source.create_queue("q")
    source.add_table("q", "a")
    target = url(kafka, kafka_prefix)
    assert_succeeded(publish(dsn, target))
    source.add_table("q", "b")
    for _ in range(3):
        conn.execute("TRUNCATE b; INSERT INTO b SELECT g, 'w' FROM generate_series(1, 20) g")
    conn.execute("DELETE FROM b WHERE id <= 5")
    assert_succeeded(publish(dsn, target))
    records = table_records(kafka.bootstrap, kafka_prefix, ("b",))
    assert Counter(r.value_payload["op"] if r.value is not None else "tombstone" for r in records) == {"r": 15}


def test_a_pk_mode_key_change_deletes_the_old_key_first(dsn, conn, source, kafka, kafka_prefix):
    conn.execute("CREATE TABLE p (id int PRIMARY KEY, v text); INSERT INTO p SELECT g, 'v' FROM generate_series(1, 5) g")
    source.create_queue("q")
    source.add_table("q", "p", mode="pk")
    target = url(kafka, kafka_prefix)
    assert_succeeded(publish(dsn, target))
    first = last_commit(kafka.bootstrap, kafka_prefix)["commit"]
    conn.execute("UPDATE p SET id = 100 WHERE id = 1")
    assert_succeeded(publish(dsn, target))
    records = [r for r in in_publishing_order(table_records(kafka.bootstrap, kafka_prefix, ("p",)))
               if r.sequence[0] > first]
    assert [(r.value_payload["op"] if r.value is not None else "tombstone", r.key_payload["id"]) for r in records] == [
        ("d", 1), ("tombstone", 1), ("u", 100)]


KEYS = list(range(1, 25))   # the keys a row of k may take


@settings(max_examples=4, deadline=None, phases=[Phase.generate], database=None,
          suppress_health_check=list(HealthCheck))
@given(steps=st.lists(st.one_of(st.permutations(KEYS),
                                st.tuples(st.sampled_from(["move", "shift", "update and delete"]),
                                          st.sampled_from(KEYS), st.sampled_from(KEYS))),
                      min_size=3, max_size=8))
def test_key_changes_delete_the_old_keys_first_and_each_transaction_replays_to_the_source(
        pg_server: Any, kafka: KafkaServer, kafka_prefix: str, steps: list[Any]) -> None:
    """Rows swapping keys within one statement (a deferrable key: `id = 3 - id`, `id = id + 1`), and
    transactions updating one row and deleting another: a reader applying the records in order holds
    the source's rows at the end of every transaction, and in a transaction of one UPDATE every delete
    comes before the updated rows (Debezium's order for a key change)."""
    with fresh_database(pg_server, "keys") as dsn, psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE k (id int PRIMARY KEY DEFERRABLE INITIALLY DEFERRED, v text)")
        conn.execute("INSERT INTO k SELECT g, 'v' || g FROM generate_series(1, 12) g")
        capture(Source(conn), "k")
        prefix = f"{kafka_prefix}_{uuid.uuid4().hex[:6]}"
        assert_succeeded(publish(dsn, url(kafka, prefix)))
        copied = last_commit(kafka.bootstrap, prefix)
        assert copied is not None
        states: dict[int, dict[str, Any]] = {}   # txid → the source's rows after it
        one_update: set[int] = set()
        for step in steps:
            try:
                with conn.transaction():
                    (txid,) = conn.execute("SELECT txid_current()").fetchone()
                    if isinstance(step, list):   # every row to the key the permutation gives its key
                        conn.execute("UPDATE k SET id = (%s::int[])[id], v = v || '>' || id", (step,))
                    elif step[0] == "move":   # a row to another key
                        conn.execute("UPDATE k SET id = %s WHERE id = %s", step[1:])
                    elif step[0] == "shift":   # the rows of a range one key up
                        conn.execute("UPDATE k SET id = id + 1 WHERE id BETWEEN %s AND %s", sorted(step[1:]))
                    else:
                        conn.execute("UPDATE k SET v = v || '!' WHERE id = %s", step[1:2])
                        conn.execute("DELETE FROM k WHERE id = %s", step[2:])
            # rolled back: a key taken (at COMMIT), or a row shifted past the last key, which a permutation has none for
            except (psycopg.errors.UniqueViolation, psycopg.errors.NotNullViolation):
                continue
            states[txid] = source_rows(conn, "k")
            if isinstance(step, list) or step[0] != "update and delete":
                one_update.add(txid)
        assert_succeeded(publish(dsn, url(kafka, prefix)))
        every = in_publishing_order(table_records(kafka.bootstrap, prefix, ("k",)))   # one partition
        final = source_rows(conn, "k")   # (every step may have rolled back: a key taken)
    records = [r for r in every if r.sequence[0] > copied["commit"]]
    txids = []   # of each record (a tombstone: its delete's)
    for record in records:
        txids.append(record.value_payload["source"]["txId"] if record.value is not None else txids[-1])
    assert set(txids) <= set(states)   # (a transaction that changed no row has none)
    assert replay(every)[topic_of(prefix, "k")] == final
    copy = len(every) - len(records)
    for index, rows in enumerate(replaying(every)):
        n = index - copy   # the record's in `records`
        if n >= 0 and (n + 1 == len(records) or txids[n + 1] != txids[n]):
            assert rows[topic_of(prefix, "k")] == states[txids[n]], f"after transaction {txids[n]}"
    for txid in one_update:
        ops = [r.value_payload["op"] if r.value is not None else "tombstone"
               for r, t in zip(records, txids, strict=True) if t == txid]
        assert ops == sorted(ops, key=lambda op: op == "u"), ops


def test_schema_changes_are_records_on_the_prefix_topic_in_order_with_the_rows(dsn, conn, source, kafka,
                                                                                kafka_prefix):
    conn.execute(TABLES_DDL)
    capture(source, "t")
    assert_succeeded(publish(dsn, url(kafka, kafka_prefix)))
    started = clock_ms(conn)
    conn.execute("INSERT INTO t VALUES (1000, 'before', 0)")
    conn.execute("ALTER TABLE t ADD COLUMN w int")
    conn.execute("INSERT INTO t VALUES (1001, 'added', 0, 7)")
    conn.execute("ALTER TABLE t RENAME COLUMN v TO renamed")
    conn.execute("UPDATE t SET renamed = 'after' WHERE id = 1001")
    conn.execute("DROP TABLE t")
    ended = clock_ms(conn, "ceil")
    assert_succeeded(publish(dsn, url(kafka, kafka_prefix)))

    commit = last_commit(kafka.bootstrap, kafka_prefix)
    assert commit is not None
    records = read_committed(kafka.bootstrap, kafka_prefix) + read_committed(kafka.bootstrap,
                                                                            topic_of(kafka_prefix, "t"))
    batch = [r.value_payload for r in in_publishing_order(records) if r.sequence[0] == commit["commit"]]

    def described(value: dict[str, Any]) -> tuple[Any, ...]:
        if "tableChanges" in value:
            change = value["tableChanges"][0]
            return change["type"], value["ddl"], [c["name"] for c in change["table"]["columns"]]
        return value["op"], value["after"]

    assert [described(v) for v in batch] == [
        ("c", {"id": 1000, "v": "before", "n": 0}),
        ("ALTER", "ALTER TABLE t ADD COLUMN w int", ["id", "v", "n", "w"]),
        ("c", {"id": 1001, "v": "added", "n": 0, "w": 7}),
        ("ALTER", "ALTER TABLE t RENAME COLUMN v TO renamed", ["id", "renamed", "n", "w"]),
        ("u", {"id": 1001, "renamed": "after", "n": 0, "w": 7}),
        ("DROP", "DROP TABLE t", ["id", "renamed", "n", "w"]),
    ]
    schema_changes = [v for v in batch if "tableChanges" in v]
    assert {(v["databaseName"], v["schemaName"], v["tableChanges"][0]["id"]) for v in schema_changes} == {
        (conn.info.dbname, "public", '"public"."t"')}
    # the source of a schema change is its event's, as a row's is
    sources = [v["source"] for v in batch]
    assert {s["tick"] for s in sources} == {commit["tick"]}
    assert [s["event"] for s in sources] == sorted(s["event"] for s in sources)
    assert all(started <= s["ts_ms"] <= ended for s in sources), (started, [s["ts_ms"] for s in sources], ended)


def test_the_commit_holds_the_source_consumers_tick_and_its_partitions_last_offsets_and_topic_records_every_end(
        dsn, conn, source, kafka, kafka_prefix):
    conn.execute(TABLES_DDL)
    capture(source, "t", "u")
    target = url(kafka, kafka_prefix, "partitions=2")
    assert_succeeded(publish(dsn, target))
    conn.execute("UPDATE t SET n = n + 1 WHERE id % 3 = 0")
    conn.execute("DELETE FROM u WHERE a = 1")
    assert_succeeded(publish(dsn, target))

    commit = last_commit(kafka.bootstrap, kafka_prefix)
    assert commit is not None
    (consumer,) = [c for c in source.consumers() if c["queue_name"] == "q"]
    assert (commit["queue"], commit["consumer"], commit["tick"]) == ("q", consumer["consumer_name"],
                                                                     consumer["last_tick"])
    assert commit["envelope"] == {"schemas": True, "decimals": "precise"}
    last_offsets: dict[str, dict[str, int]] = {}   # of every partition
    written: dict[str, dict[str, int]] = {}        # of the partitions the last batch wrote
    for topic in (kafka_prefix, topic_of(kafka_prefix, "t"), topic_of(kafka_prefix, "u")):
        for record in read_committed(kafka.bootstrap, topic):
            last_offsets.setdefault(topic, {})[str(record.partition)] = record.offset
            if record.sequence[0] == commit["commit"]:
                written.setdefault(topic, {})[str(record.partition)] = record.offset
    assert commit["last"] == written and set(written) == {topic_of(kafka_prefix, "t"), topic_of(kafka_prefix, "u")}
    assert len(last_offsets[topic_of(kafka_prefix, "t")]) == 2
    assert topic_ends(kafka.bootstrap, kafka_prefix) == last_offsets


def test_records_without_schemas_are_the_payload_alone(dsn, conn, source, kafka, kafka_prefix):
    conn.execute(TABLES_DDL)
    capture(source, "u")
    target = url(kafka, kafka_prefix, "schemas=false")
    assert_succeeded(publish(dsn, target))
    conn.execute("UPDATE u SET qty = -1 WHERE a = 2 AND b = 'b0'")
    assert_succeeded(publish(dsn, target))

    assert last_commit(kafka.bootstrap, kafka_prefix) is not None   # and its records visible
    records = read_committed(kafka.bootstrap, topic_of(kafka_prefix, "u"))
    key, value = json.loads(records[-1].key or b""), json.loads(records[-1].value or b"")
    assert key == {"a": 2, "b": "b0"}
    assert value["op"] == "u" and value["after"] == {"a": 2, "b": "b0", "qty": -1}
    assert all("schema" not in json.loads(r.value or b"{}") for r in records)
    (create,) = read_committed(kafka.bootstrap, kafka_prefix)
    assert json.loads(create.value or b"")["tableChanges"][0]["type"] == "CREATE"
    commit = last_commit(kafka.bootstrap, kafka_prefix)
    assert commit is not None and commit["envelope"] == {"schemas": False, "decimals": "precise"}


# 2. exactly once through kill -9 ----------------------------------------------------------------

def changes_in_one_transaction(conn: psycopg.Connection, round_: int) -> None:
    """Every kind of change to both tables, one transaction: one batch."""
    with conn.transaction():
        conn.execute("UPDATE t SET n = n + 1, v = v || '!' WHERE id %% 3 = %s", (round_ % 3,))
        conn.execute("DELETE FROM t WHERE id = %s", (10 + round_,))
        conn.execute("INSERT INTO t VALUES (%s, 'new', 0)", (1000 + round_,))
        conn.execute("UPDATE t SET id = id + 2000 WHERE id = %s", (20 + round_,))
        conn.execute("UPDATE u SET qty = qty + 1")
        conn.execute("UPDATE u SET b = b || '+' WHERE a = %s", (round_,))
        if round_ == 1:
            conn.execute("TRUNCATE u")
            conn.execute("INSERT INTO u VALUES (1, 'after the truncate', 1)")


def start_published(dsn: str, conn: psycopg.Connection, source: Source, target: str) -> tuple[Oracle, set[str]]:
    """The tables copied to Kafka, then the oracle registered: it reads every later change. Returns
    it and the keys of t the copy held."""
    conn.execute(TABLES_DDL)
    capture(source, "t", "u")
    copied = set(source_rows(conn, "t"))
    assert_succeeded(publish(dsn, target))
    return Oracle(source), copied


@pytest.mark.parametrize("point", ["kafka-records-sent", "kafka-commit-sent", "kafka-committed"])
def test_kill_9_at_each_commit_step_then_a_restart_publishes_each_change_once(dsn, conn, source, kafka,
                                                                              kafka_prefix, point):
    target = url(kafka, kafka_prefix, "partitions=2")
    oracle, copied = start_published(dsn, conn, source, target)
    for round_ in range(2):
        changes_in_one_transaction(conn, round_)
        before = last_commit(kafka.bootstrap, kafka_prefix)
        crashed = publish(dsn, target, REPLICATOR_CRASH_AT=point)
        assert crashed.returncode == -9, crashed.stderr
        after = last_commit(kafka.bootstrap, kafka_prefix)
        assert before is not None and after is not None
        # only a kill after Kafka's commit leaves Kafka ahead of the source
        assert (after["commit"] > before["commit"]) == (point == "kafka-committed")
        assert_succeeded(publish(dsn, target))
        assert_published_exactly_once(oracle, kafka.bootstrap, kafka_prefix, ("t", "u"), partition_count=2)
        assert_topics_replay_to_the_source(conn, kafka.bootstrap, kafka_prefix, ("t", "u"))
    assert_copied_once(read_committed(kafka.bootstrap, topic_of(kafka_prefix, "t")), copied)


@pytest.mark.parametrize("point", ["kafka-records-sent@2", "kafka-commit-sent@2"])
def test_kill_9_in_the_initial_copy_then_a_restart_copies_each_row_once(dsn, conn, source, kafka, kafka_prefix,
                                                                        point):
    conn.execute(TABLES_DDL)
    capture(source, "t")
    target = url(kafka, kafka_prefix)
    # the first Kafka transaction registers the consumer, the second is the copy
    crashed = publish(dsn, target, REPLICATOR_CRASH_AT=point)
    assert crashed.returncode == -9, crashed.stderr
    assert read_committed(kafka.bootstrap, topic_of(kafka_prefix, "t")) == []
    assert_succeeded(publish(dsn, target))
    assert_copied_once(table_records(kafka.bootstrap, kafka_prefix, ("t",)), set(source_rows(conn, "t")))
    assert len(read_committed(kafka.bootstrap, kafka_prefix)) == 1   # one CREATE


class Workload(threading.Thread):
    """Seeded transactions of one to four statements over t and u: inserts, upserts, updates of
    many rows, deletes, key changes, now and then a TRUNCATE; a statement that collides with a key
    is skipped (a savepoint). Stops after `transactions`, or when told to (`stopping`); `pace`
    seconds apart."""

    def __init__(self, dsn: str, seed: int, transactions: int, pace: float = 0.0) -> None:
        super().__init__(name=f"workload-{seed}")
        self.dsn, self.rng, self.transactions, self.pace = dsn, random.Random(seed), transactions, pace
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                for _ in range(self.transactions):
                    if self.stopping.wait(self.pace):
                        return
                    with conn.transaction():
                        for _ in range(self.rng.randint(1, 4)):
                            statement, parameters = self.statement()
                            with contextlib.suppress(psycopg.errors.UniqueViolation), conn.transaction():
                                conn.execute(statement, parameters)
        except BaseException as exc:   # reported by the test
            self.error = exc

    def statement(self) -> tuple[str, tuple[Any, ...]]:
        rng = self.rng
        i, a = rng.randint(1, 300), rng.randint(0, 12)
        return rng.choices([
            ("INSERT INTO t VALUES (%s, %s, 0) ON CONFLICT (id) DO UPDATE SET v = excluded.v, n = t.n + 1",
             (i, f"w{rng.random():.3f}")),
            ("UPDATE t SET n = n + 1 WHERE id %% 11 = %s", (rng.randint(0, 10),)),
            ("DELETE FROM t WHERE id BETWEEN %s AND %s", (i, i + rng.randint(0, 2))),
            ("UPDATE t SET id = %s WHERE id = %s", (rng.randint(1, 300), i)),
            ("INSERT INTO u VALUES (%s, %s, %s) ON CONFLICT (a, b) DO UPDATE SET qty = u.qty + 1",
             (a, f"b{rng.randint(0, 5)}", i)),
            ("UPDATE u SET b = b || '+' WHERE a = %s AND length(b) < 6", (a,)),
            ("DELETE FROM u WHERE a = %s", (a,)),
            ("TRUNCATE u", ()),
        ], weights=[8, 2, 3, 3, 6, 2, 2, 0.3])[0]


def test_a_publisher_killed_at_random_moments_under_writes_publishes_each_change_once(dsn, conn, source, kafka,
                                                                                      kafka_prefix, tmp_path):
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    target = url(kafka, kafka_prefix, "partitions=3")
    oracle, _ = start_published(dsn, conn, source, target)
    copied = last_commit(kafka.bootstrap, kafka_prefix)
    set_fast_ticks(conn, max_lag="50 ms", idle="200 ms", max_count=40)
    ticker = Daemon(dsn, "ticker", "--interval", "0.05", log=tmp_path / "ticker.log")
    logs: list[Path] = []

    def start() -> Daemon:
        logs.append(tmp_path / f"publisher-{len(logs)}.log")
        return publisher_daemon(dsn, target, logs[-1])

    daemon = start()
    workload = Workload(dsn, seed, 400)
    workload.start()
    kills = 0
    try:
        while workload.is_alive() or kills < 4:
            # once it has started (a loaded machine can take seconds to start Python), a random
            # moment of its work, not a wait for a state
            wait_until(lambda: "resumes queue" in daemon.log(), 60, "the publisher's start",
                       check=lambda: daemon.alive() or pytest.fail(daemon.log()))
            time.sleep(rng.uniform(0.1, 1.2))
            assert daemon.alive(), daemon.log()[-3000:]
            assert daemon.kill9() == -9
            kills += 1
            daemon = start()
        during = last_commit(kafka.bootstrap, kafka_prefix)
        workload.join()
        assert workload.error is None, workload.error
        # SIGTERM ends a daemon that has started (not one still starting: that one it kills)
        wait_until(lambda: "resumes queue" in daemon.log(), 60, "the last publisher's start",
                   check=lambda: daemon.alive() or pytest.fail(daemon.log()))
        assert daemon.terminate() == 0, daemon.log()[-3000:]
    finally:
        daemon.stop()
        ticker.stop()
    assert_succeeded(publish(dsn, target))
    assert_published_exactly_once(oracle, kafka.bootstrap, kafka_prefix, ("t", "u"), partition_count=3)
    assert_topics_replay_to_the_source(conn, kafka.bootstrap, kafka_prefix, ("t", "u"))
    text = "".join(p.read_text() for p in logs)
    assert "Traceback" not in text and "\nerror: " not in text, text[-3000:]
    assert copied is not None and during is not None
    assert during["commit"] > copied["commit"]   # it published between the kills, not only after them


# 3. a broker restart -----------------------------------------------------------------------------

def test_a_broker_killed_and_restarted_under_a_running_publisher_loses_and_repeats_nothing(dsn, conn, source,
                                                                                           own_kafka, tmp_path):
    prefix = "restart"
    # the publisher says the broker is unavailable after 3 s (socket.timeout.ms), not the default 60 s
    target = url(own_kafka, prefix, "partitions=2&kafka.socket.timeout.ms=3000")
    oracle, _ = start_published(dsn, conn, source, target)
    set_fast_ticks(conn, max_lag="50 ms", idle="200 ms", max_count=40)
    ticker = Daemon(dsn, "ticker", "--interval", "0.05", log=tmp_path / "ticker.log")
    daemon = publisher_daemon(dsn, target, tmp_path / "publisher.log")
    workload = Workload(dsn, 7, 100000, pace=0.01)   # until stopped
    try:
        workload.start()
        wait_until(lambda: (last_commit(own_kafka.bootstrap, prefix) or {}).get("commit", 0) >= 5, 60,
                   "batches published", check=lambda: daemon.alive() or pytest.fail(daemon.log()))
        own_kafka.kill()
        wait_until(lambda: "target unavailable" in daemon.log(), 60, "the publisher to notice",
                   check=lambda: daemon.alive() or pytest.fail(daemon.log()))
        own_kafka.start()
        workload.stopping.set()
        workload.join()
        assert workload.error is None, workload.error
        tick = forced_tick(conn)
        wait_until(lambda: (last_commit(own_kafka.bootstrap, prefix) or {}).get("tick", 0) >= tick, 120,
                   f"tick {tick} published", check=lambda: daemon.alive() or pytest.fail(daemon.log()))
        assert daemon.terminate() == 0, daemon.log()[-3000:]
    finally:
        workload.stopping.set()
        daemon.stop()
        ticker.stop()
    assert "Traceback" not in daemon.log(), daemon.log()[-3000:]
    assert_published_exactly_once(oracle, own_kafka.bootstrap, prefix, ("t", "u"), partition_count=2)
    assert_topics_replay_to_the_source(conn, own_kafka.bootstrap, prefix, ("t", "u"))


@pytest.mark.parametrize(("ddl", "published"), [("DROP TABLE b", ["a"]), ("ALTER TABLE b RENAME TO b2", ["a", "b2"])])
def test_a_table_dropped_or_renamed_while_its_initial_copy_starts_is_published_as_the_source_ends(
        dsn, conn, source, kafka, kafka_prefix, ddl, published):
    """DDL that commits after the publisher listed the queue's tables, before its copy read the table
    (holding the lock the copy waits for): the topics replay to the tables the source ends with, and
    the topic of the name the table had holds none of its rows."""
    target = url(kafka, kafka_prefix)
    copy_while_a_ddl_holds_the_table(dsn, conn, source, target, ddl)
    for name in published[1:]:
        conn.execute(f"INSERT INTO {name} VALUES (3, 'after')")
    assert_succeeded(publish(dsn, target))
    assert_topics_replay_to_the_source(conn, kafka.bootstrap, kafka_prefix, tuple(published))
    assert not replay(table_records(kafka.bootstrap, kafka_prefix, ("b",))).get(topic_of(kafka_prefix, "b"))


# 4. a second publisher -----------------------------------------------------------------------------

def test_a_second_publisher_fences_the_first_which_stops_in_one_line_when_it_commits(dsn, conn, source, kafka,
                                                                                     kafka_prefix, tmp_path):
    target = url(kafka, kafka_prefix)
    oracle, _ = start_published(dsn, conn, source, target)
    first = publisher_daemon(dsn, target, tmp_path / "first.log")
    try:
        changes_in_one_transaction(conn, 0)
        tick = forced_tick(conn)
        wait_until(lambda: (last_commit(kafka.bootstrap, kafka_prefix) or {}).get("tick", 0) >= tick, 60,
                   "the first publisher's batch", check=lambda: first.alive() or pytest.fail(first.log()))
        # the second starts (its producer fences the first's) and finds nothing to publish
        assert_succeeded(run_cli(dsn, "consume", "q", "--target", target, "--once"))
        assert first.alive()
        changes_in_one_transaction(conn, 1)
        forced_tick(conn)
        assert first.proc.wait(60) == 1
    finally:
        first.stop()
    lines = [line for line in first.log().splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "another publisher took over" in lines[0], first.log()
    assert "Traceback" not in first.log()
    assert_succeeded(publish(dsn, target))
    assert_published_exactly_once(oracle, kafka.bootstrap, kafka_prefix, ("t", "u"))
    assert_topics_replay_to_the_source(conn, kafka.bootstrap, kafka_prefix, ("t", "u"))


# 5. bad input ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("address", "says"), [
    ("{broker}", "no topic prefix"),
    ("{broker}/shop?colour=red", "unknown option 'colour'"),
    ("{broker}/shop?partitions=0", "invalid partitions='0'"),
    ("{broker}/shop?schemas=maybe", "invalid schemas='maybe'"),
    ("{broker}/shop?decimals=float", "invalid decimals='float'"),
    ("{broker}/sh op", "invalid topic prefix"),
    ("{broker}/shop?kafka.no.such=1", "Kafka setting 'no.such' in the Kafka URL is refused"),
    ("{broker}/shop?kafka.socket.timeout.ms=soon", 'Invalid value for configuration property "socket.timeout.ms"'),
])
def test_a_bad_url_is_one_line(dsn, conn, source, kafka, address, says):
    conn.execute(TABLES_DDL)
    capture(source, "t")
    line = one_line_error(publish(dsn, "kafka://" + address.format(broker=kafka.bootstrap)))
    assert says in line, line


def test_an_unreachable_broker_is_one_line_within_the_socket_timeout(dsn, conn, source):
    conn.execute(TABLES_DDL)
    capture(source, "t")
    with socket.socket() as unused:   # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    started = time.monotonic()
    line = one_line_error(publish(dsn, f"kafka://127.0.0.1:{port}/shop?kafka.socket.timeout.ms=2000"))
    assert f"cannot reach Kafka at 127.0.0.1:{port}" in line, line
    assert time.monotonic() - started < 15


def test_a_prefix_published_with_other_decimals_is_refused_in_one_line(dsn, conn, source, kafka, kafka_prefix):
    conn.execute(TABLES_DDL)
    capture(source, "t")
    assert_succeeded(publish(dsn, url(kafka, kafka_prefix)))
    line = one_line_error(publish(dsn, url(kafka, kafka_prefix, "decimals=string")))
    assert "was published with decimals=precise&schemas=true" in line, line
    assert_succeeded(publish(dsn, url(kafka, kafka_prefix, "decimals=precise")))


@pytest.mark.parametrize("refused_by", ["the producer", "the broker"])
def test_a_record_larger_than_kafka_takes_is_one_line(dsn, conn, source, kafka, kafka_prefix, refused_by):
    conn.execute(TABLES_DDL)
    capture(source, "t")
    # the producer's limit raised past the broker's (1 MB): the broker refuses the record
    options = "kafka.message.max.bytes=8000000" if refused_by == "the broker" else ""
    target = url(kafka, kafka_prefix, options)
    assert_succeeded(publish(dsn, target))
    # random text: 2 MB that compression does not bring under 1 MB
    conn.execute("UPDATE t SET v = (SELECT string_agg(md5(random()::text), '') FROM generate_series(1, 64000))"
                 " WHERE id = 1")
    line = one_line_error(publish(dsn, target, timeout=60))
    assert f"for {topic_of(kafka_prefix, 't')} is larger than Kafka takes" in line, line
