"""Capture, the shapes of the generated code (replicator.generate_capture): the one-event
form of statements of up to 1000 rows and its limits, the look for vanished keys of an
UPDATE only when keys may have changed, writing straight into the current partition."""

from __future__ import annotations

from datetime import timedelta

import pytest

from queue_util import changes, read_events


@pytest.fixture
def q(source):
    source.create_queue("q")
    source.register_consumer("q", "c")
    return source


def _due(conn) -> None:
    conn.execute("UPDATE replicator.queue SET queue_switch_time = now() - interval '1 day'")


@pytest.mark.parametrize("rows", [1000, 1001])
def test_statement_at_the_limit_of_one_event(conn, q, rows):
    conn.execute('CREATE TABLE "t" ("id" int PRIMARY KEY, "v" int)')
    q.add_table("q", "t")
    conn.execute(f'INSERT INTO "t" SELECT g, 0 FROM generate_series(1, {rows}) g')
    conn.execute('UPDATE "t" SET "v" = 1')
    conn.execute('DELETE FROM "t"')
    events = read_events(q)
    for ev_type in "IUD":
        parts = [e for e in events if e.type == ev_type]
        assert sorted(item[0] for e in parts for item in e.items) == list(range(1, rows + 1)), ev_type
        assert all(1 <= len(e.items) <= 1000 for e in parts)
        assert len(parts) == (1 if rows == 1000 else 2), ev_type
    assert all(item[1] == 1 for e in events if e.type == "U" for item in e.items)


def test_update_keeping_the_keys_in_another_order_queues_no_delete(conn, q):
    # The keys of the old and new rows are the same set, not the same list: the
    # update takes the exact form, which finds no vanished key.
    conn.execute('CREATE TABLE "t" ("id" int PRIMARY KEY DEFERRABLE INITIALLY DEFERRED, "v" text)')
    q.add_table("q", "t")
    conn.execute("""INSERT INTO "t" VALUES (1, 'a'), (2, 'b')""")
    read_events(q)
    conn.execute('UPDATE "t" SET "id" = 3 - "id"')
    assert changes(read_events(q)) == [("U", [[1, "b"], [2, "a"]])]


def test_key_change_in_a_large_update_is_found(conn, q):
    conn.execute('CREATE TABLE "t" ("id" int PRIMARY KEY, "v" int)')
    q.add_table("q", "t", mode="pk")
    conn.execute('INSERT INTO "t" SELECT g, 0 FROM generate_series(1, 500) g')
    read_events(q)
    # One row of 500 changes its key; its old key is deleted, the others are upserts.
    conn.execute('UPDATE "t" SET "v" = 1, "id" = CASE WHEN "id" = 250 THEN 1000 ELSE "id" END')
    events = read_events(q)
    assert [e.items for e in events if e.type == "D"] == [[[250]]]
    assert sorted(i[0] for e in events if e.type == "U" for i in e.items) == sorted(set(range(1, 501)) - {250} | {1000})


def test_nullable_key_column(conn, q):
    conn.execute('CREATE TABLE "t" ("k" text, "v" int)')
    q.add_table("q", "t", key=["k"])
    conn.execute("""INSERT INTO "t" VALUES (NULL, 1), ('a', 2)""")
    read_events(q)
    conn.execute('UPDATE "t" SET "v" = "v" + 10 WHERE "k" IS NULL')       # NULL key kept
    assert changes(read_events(q)) == [("U", [[None, 11]])]
    conn.execute("""UPDATE "t" SET "k" = 'b' WHERE "k" IS NULL""")          # NULL key vacated
    assert sorted(changes(read_events(q))) == [("D", [[None]]), ("U", [["b", 11]])]
    conn.execute("""UPDATE "t" SET "k" = NULL WHERE "k" = 'a'""")           # and taken
    assert sorted(changes(read_events(q))) == [("D", [["a"]]), ("U", [[None, 2]])]


def test_row_moving_to_another_partition_is_a_key_change(conn, q):
    conn.execute('CREATE TABLE "p" ("id" int PRIMARY KEY, "v" text) PARTITION BY RANGE ("id")')
    conn.execute('CREATE TABLE "p_low" PARTITION OF "p" FOR VALUES FROM (0) TO (100)')
    conn.execute('CREATE TABLE "p_high" PARTITION OF "p" FOR VALUES FROM (100) TO (200)')
    q.add_table("q", "p")
    conn.execute("""INSERT INTO "p" VALUES (1, 'a'), (2, 'b')""")
    read_events(q)
    conn.execute("""UPDATE "p" SET "id" = "id" + 100 WHERE "id" = 1""")
    assert sorted(changes(read_events(q))) == [("D", [[1]]), ("U", [[101, "a"]])]
    conn.execute("""UPDATE "p" SET "v" = 'B' WHERE "id" = 2""")
    assert changes(read_events(q)) == [("U", [[2, "B"]])]


@pytest.mark.parametrize("ntables", [3, 10])
def test_events_go_to_the_current_event_table(conn, source, ntables):
    # Up to 8 event tables, capture writes into the current one by name; with more,
    # through the partitioned parent. Either way, rotation moves the writes along.
    conn.execute('CREATE TABLE "t" ("id" int PRIMARY KEY, "v" int)')
    source.create_queue("q", ntables=ntables, rotation_period=timedelta(hours=1))
    qid = source.queue_id("q")
    source.add_table("q", "t")

    def counts() -> list[int]:
        return [conn.execute(f'SELECT count(*) FROM replicator."event_{qid}_{n}"').fetchone()[0]
                for n in range(ntables)]

    for expected_slot in range(ntables + 1):
        conn.execute('INSERT INTO "t" VALUES (%s, 0)', (expected_slot,))
        conn.execute('UPDATE "t" SET "v" = 1 WHERE "id" = %s', (expected_slot,))
        conn.execute('DELETE FROM "t" WHERE "id" = %s', (expected_slot,))
        conn.execute('TRUNCATE "t"')
        assert counts()[expected_slot % ntables] == 4
        _due(conn)
        assert "rotated" in source.maint()["q"]
