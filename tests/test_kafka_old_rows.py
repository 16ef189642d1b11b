"""Old rows on the Kafka topics (`table add/alter --old-rows`): an update's `before` is the row as
the source had it, a delete's `before` the whole deleted row, every value exact for followers, and
a follower streaming the topics carries them on."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest

from consumer_helpers import run_cli
from kafka_helpers import in_publishing_order, last_commit, payload, publish, read_committed
from kafkaserver import KafkaServer
from replicator.source import Source
from replicator.targets.kafka.envelope import OLD_ROW_HEADER, EnvelopeSettings, TableEnvelope
from test_kafka_envelope import (
    ALL_TYPES,
    ROWS,
    SETTINGS,
    TS_US,
    captured_rows,
    column,
    payload_of,
    same,
    source_of,
    table,
)

NO_SOURCE = "host=127.0.0.1 port=9 dbname=no_source_for_followers user=nobody connect_timeout=1"   # followers need none


# the envelope alone ---------------------------------------------------------------------------------


@pytest.mark.parametrize("decimals", ["precise", "string", "double"])
def test_an_updates_before_and_a_deletes_old_row_come_back_exactly_with_every_type(conn, decimals):
    """Exact texts of `before` and of `after` share the `replicator` map without mixing: each row of
    every type updated into the next comes back as it was, on both sides."""
    conn.execute(ALL_TYPES + "INSERT INTO every VALUES " + ", ".join(ROWS))
    structure, rows = captured_rows(conn, "every")
    envelope = TableEnvelope(structure, EnvelopeSettings(prefix="shop", database="appdb", decimals=decimals))
    source = source_of(envelope)
    for before, after in zip(rows, rows[1:] + rows[:1]):
        record = envelope.value("u", after, source, TS_US, before)
        payload_of(record)
        change = envelope.decode_value(record)
        assert change.op == "u"
        assert change.before is not None and same(change.before, before), (change.before, before)
        assert change.after is not None and same(change.after, after), (change.after, after)
        deleted = envelope.delete_value([before[0]], source, TS_US, before)
        payload_of(deleted)
        change = envelope.decode_value(deleted, old_row=True)
        assert change.after is None and change.before is not None and same(change.before, before)


def test_a_column_named_like_the_before_prefix_moves_the_prefix():
    """`before.` + a column name is the map key of that column's exact text in `before`; a column
    whose name starts with it (here `before.iv`, an interval: its months need the exact text) makes
    the prefix `before_.`, so no key of one row is a key of the other."""
    structure = table(column("id", "integer", category="N", not_null=True), column("iv", "interval", category="T"),
                      column("before.iv", "interval", category="T"))
    envelope = TableEnvelope(structure, SETTINGS)
    before, after = (1, "1 mon", "2 mons"), (1, "3 mons", "4 mons")
    record = envelope.value("u", after, source_of(envelope), TS_US, before)
    assert payload_of(record)["replicator"] == {"iv": "3 mons", "before.iv": "4 mons", "before_.iv": "1 mon",
                                                "before_.before.iv": "2 mons"}
    change = envelope.decode_value(record)
    assert (change.before, change.after) == (before, after)


def test_only_an_update_has_an_old_row_beside_its_row():
    structure = table(column("id", "integer", category="N", not_null=True), column("v", "text", category="S"))
    envelope = TableEnvelope(structure, SETTINGS)
    for op in ("c", "r", "t"):
        with pytest.raises(ValueError, match="old row"):
            envelope.value(op, None if op == "t" else (1, "b"), source_of(envelope), TS_US, (1, "a"))


# through the publisher and a follower ----------------------------------------------------------------

TABLE = "CREATE TABLE acc (id int PRIMARY KEY DEFERRABLE, owner text NOT NULL, balance numeric(12,2), seen bigint NOT NULL)"


def snapshot(conn: psycopg.Connection) -> dict[int, dict[str, Any]]:
    """The table's rows as the topics' payloads hold them (numeric(12,2) as decimal.handling.mode=string)."""
    return {row["id"]: row for (row,) in conn.execute(
        "SELECT jsonb_build_object('id', id, 'owner', owner, 'balance', balance::text, 'seen', seen) FROM acc")}


def table_changes(kafka: KafkaServer, prefix: str) -> list[tuple[str, Any, Any, Any, bool]]:
    """(op, key, before, after, has the old-row header) of each change record, tombstones aside, in order."""
    last_commit(kafka.bootstrap, prefix)
    records = in_publishing_order(read_committed(kafka.bootstrap, f"{prefix}.public.acc"))
    return [(p["op"], payload(r.key)["id"], p["before"], p["after"], OLD_ROW_HEADER in r.headers)
            for r in records if (p := payload(r.value)) is not None]


def test_updates_and_deletes_publish_the_sources_old_rows_as_before(dsn: str, conn: psycopg.Connection,
                                                                     source: Source, kafka: KafkaServer,
                                                                     kafka_prefix: str):
    """Each statement's records against the table as it was before it: `u` has the old row of its key,
    a key change is a `d` of the old key with its row and a `c` of the new key, a delete's `before` is
    the deleted row (with the header followers read); a table without --old-rows keeps Debezium's
    REPLICA IDENTITY DEFAULT shape."""
    conn.execute(TABLE + "; INSERT INTO acc SELECT g, 'o' || g, g * 1.5, 0 FROM generate_series(1, 30) g")
    source.create_queue("q")
    source.add_table("q", "acc", old_rows=True)
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}?decimals=string"
    assert publish(dsn, url).returncode == 0
    statements = [
        "UPDATE acc SET balance = balance + 1, seen = seen + 1 WHERE id <= 3",
        "UPDATE acc SET owner = 'x' || owner WHERE id BETWEEN 4 AND 5",
        "UPDATE acc SET id = id + 100 WHERE id IN (6, 7)",                              # key change
        "UPDATE acc SET id = CASE id WHEN 8 THEN 9 WHEN 9 THEN 8 END WHERE id IN (8, 9)",   # keys swapped
        "DELETE FROM acc WHERE id IN (10, 11)",
        "UPDATE acc SET balance = NULL WHERE id > 11 AND id < 100",                     # one event of 18 rows
    ]
    expected: list[tuple[str, Any, Any, Any, bool]] = []
    for statement in statements:
        before = snapshot(conn)
        conn.execute(statement)
        after = snapshot(conn)
        changed = [k for k in before.keys() & after.keys() if before[k] != after[k]]
        expected += [("u", k, before[k], after[k], False) for k in changed]
        expected += [("d", k, before[k], None, True) for k in before.keys() - after.keys()]
        expected += [("c", k, None, after[k], False) for k in after.keys() - before.keys()]
    published_before = len(table_changes(kafka, kafka_prefix))
    assert publish(dsn, url).returncode == 0
    got = table_changes(kafka, kafka_prefix)[published_before:]
    assert sorted(got, key=json.dumps) == sorted(expected, key=json.dumps)

    source.alter_table("q", "acc", old_rows=False)
    conn.execute("UPDATE acc SET seen = 7 WHERE id = 1; DELETE FROM acc WHERE id = 2")
    assert publish(dsn, url).returncode == 0
    # (the delete first: a delete goes before the updated rows of the event before it, keys not shared)
    assert table_changes(kafka, kafka_prefix)[published_before + len(got):] == [
        ("d", 2, {"id": 2, "owner": "", "balance": None, "seen": 0}, None, False),
        ("u", 1, None, {"id": 1, "owner": "o1", "balance": "2.50", "seen": 7}, False)]


def test_a_follower_streaming_the_topics_carries_the_old_rows(dsn: str, conn: psycopg.Connection, source: Source,
                                                              kafka: KafkaServer, kafka_prefix: str, tmp_path):
    conn.execute(TABLE + "; INSERT INTO acc VALUES (1, 'a', 1, 0), (2, 'b', 2, 0), (3, 'c', 3, 0)")
    source.create_queue("q")
    source.add_table("q", "acc", old_rows=True)
    url = f"kafka://{kafka.bootstrap}/{kafka_prefix}"
    assert publish(dsn, url).returncode == 0
    conn.execute("UPDATE acc SET owner = 'A', seen = 1 WHERE id = 1")
    conn.execute("UPDATE acc SET id = 30 WHERE id = 3")
    conn.execute("DELETE FROM acc WHERE id = 2")
    assert publish(dsn, url).returncode == 0
    stream = tmp_path / "changes.jsonl"
    done = run_cli(NO_SOURCE, "consume", "--source", url, "--target", f"jsonl:{stream}",
                   "--until-caught-up")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in stream.read_text().splitlines()]
    changes = [{k: line.get(k) for k in ("op", "key", "row", "old")} for line in lines if line["op"] in "IUD"]
    row = {k: {"id": k, "owner": owner, "balance": f"{k}.00", "seen": 0} for k, owner in ((1, "a"), (2, "b"), (3, "c"))}
    assert sorted(changes, key=json.dumps) == sorted([
        {"op": "U", "key": {"id": 1}, "row": {**row[1], "owner": "A", "seen": 1}, "old": row[1]},
        {"op": "D", "key": {"id": 3}, "row": None, "old": row[3]},
        {"op": "I", "key": {"id": 30}, "row": {**row[3], "id": 30}, "old": None},
        {"op": "D", "key": {"id": 2}, "row": None, "old": row[2]},
    ], key=json.dumps)
