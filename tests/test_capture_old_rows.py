"""Capture with old rows (`table add/alter --old-rows`, as REPLICA IDENTITY FULL): what the
triggers queue in ev_old for each UPDATE and DELETE, item for item beside ev_data."""

from __future__ import annotations

import pytest

from queue_util import CAPTURE_KINDS, Event, by_statement, read_events
from replicator.source.install import drop_event_triggers


@pytest.fixture
def q(source):
    """Queue "q" with consumer "c"; tables are added by the tests."""
    source.create_queue("q")
    source.register_consumer("q", "c")
    return source


def pairs(events: list[Event]) -> list[tuple[str, list[tuple[list, list | None]]]]:
    """(type, [(item, its old row)]) per event, items sorted by repr (a statement's row order is not defined)."""
    result = []
    for e in events:
        old = e.old if e.old is not None else [None] * len(e.items)
        assert len(old) == len(e.items), e
        result.append((e.type, sorted(zip(e.items, old), key=repr)))
    return result


@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_update_and_delete_queue_the_old_rows_beside_the_new_rows_and_keys(conn, q, capture):
    conn.execute('CREATE TABLE "t" ("id" int PRIMARY KEY, "v" text, "n" int)')
    q.add_table("q", "t", old_rows=True, capture=capture)
    conn.execute("""INSERT INTO "t" VALUES (1, 'a', 10), (2, 'b', 20), (3, 'c', 30)""")
    conn.execute("""UPDATE "t" SET "v" = 'B', "n" = "n" + 1 WHERE "id" = 2""")
    conn.execute("""UPDATE "t" SET "n" = NULL WHERE "id" IN (1, 3)""")
    conn.execute("""DELETE FROM "t" WHERE "id" = 1""")
    conn.execute("""DELETE FROM "t" WHERE "id" >= 2""")
    events = by_statement(read_events(q))
    assert [e.old for e in events if e.type == "I"] == [None]
    assert pairs(events[1:]) == [
        ("U", [([2, "B", 21], [2, "b", 20])]),
        ("U", [([1, "a", None], [1, "a", 10]), ([3, "c", None], [3, "c", 30])]),
        ("D", [([1], [1, "a", None])]),
        ("D", [([2], [2, "B", 21]), ([3], [3, "c", None])]),
    ]


def test_key_changes_pair_each_old_row_with_the_new_row_of_its_key(conn, q):
    """A key change is a D of the old key (its old row) and a U of the new key without an old row;
    a permutation of keys pairs each key's old and new row; every old row is queued exactly once."""
    # (deferrable: the key is checked at the end of each statement, so keys may be permuted)
    conn.execute('CREATE TABLE "t" ("id" int PRIMARY KEY DEFERRABLE, "v" text)')
    q.add_table("q", "t", old_rows=True)
    conn.execute("""INSERT INTO "t" VALUES (1, 'a'), (2, 'b'), (3, 'c')""")
    read_events(q)
    conn.execute("""UPDATE "t" SET "id" = "id" + 10, "v" = "v" || '!' WHERE "id" IN (1, 2)""")
    assert sorted(pairs(read_events(q))) == [
        ("D", [([1], [1, "a"]), ([2], [2, "b"])]),
        ("U", [([11, "a!"], None), ([12, "b!"], None)]),
    ]
    conn.execute("""UPDATE "t" SET "id" = CASE "id" WHEN 3 THEN 12 WHEN 12 THEN 3 ELSE "id" END""")
    assert pairs(read_events(q)) == [
        ("U", [([11, "a!"], [11, "a!"]), ([12, "c"], [12, "b!"]), ([3, "b!"], [3, "c"])]),
    ]
    conn.execute("""UPDATE "t" SET "id" = "id" + 1""")   # 3 -> 4, 11 -> 12, 12 -> 13: 12 kept, 3 and 11 gone
    assert sorted(pairs(read_events(q))) == [
        ("D", [([11], [11, "a!"]), ([3], [3, "b!"])]),
        ("U", [([12, "a!"], [12, "c"]), ([13, "c"], None), ([4, "b!"], None)]),
    ]


@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_multi_row_statements_past_one_event_keep_each_old_row_with_its_item(conn, q, capture):
    conn.execute('CREATE TABLE "t" ("id" int PRIMARY KEY, "v" int)')
    q.add_table("q", "t", old_rows=True, capture=capture)
    conn.execute("""INSERT INTO "t" SELECT g, g FROM generate_series(1, 2500) g""")
    read_events(q)
    conn.execute("""UPDATE "t" SET "v" = -"v" WHERE "id" <= 1500""")   # the fast form: at most 1000 rows an event
    conn.execute("""UPDATE "t" SET "v" = "v" * 10 WHERE "id" > 2000""")
    conn.execute("""UPDATE "t" SET "id" = "id" + 10000 WHERE "id" > 2400""")
    conn.execute("""DELETE FROM "t" WHERE "id" <= 1200""")
    events = read_events(q)
    assert all(len(e.items) <= 1000 for e in events)
    changed = [(e.type, item, old) for e in events for item, old in zip(e.items, e.old)]
    updates = {item[0]: (item, old) for t, item, old in changed if t == "U"}
    assert len(updates) == 1500 + 500 + 100
    for key, (item, old) in updates.items():
        if key <= 1500:
            assert (item, old) == ([key, -key], [key, key])
        elif key > 10000:
            assert old is None and item[1] == (key - 10000) * 10
    assert all(updates[k] == ([k, k * 10], [k, k]) for k in range(2001, 2401))
    deleted = sorted((item, old) for t, item, old in changed if t == "D")
    assert deleted == sorted([([k], [k, k * 10]) for k in range(2401, 2501)]
                             + [([k], [k, -k]) for k in range(1, 1201)])


@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_row_filter_and_ignored_columns_with_old_rows(conn, q, capture):
    """Rows entering the filter have no old row (the target never had them); rows leaving it are a D with
    their old row; an update of ignored columns only queues nothing."""
    conn.execute('CREATE TABLE "t" ("id" int PRIMARY KEY, "v" text, "seen" int)')
    q.add_table("q", "t", old_rows=True, where="\"v\" <> 'hidden'", ignore=["seen"], capture=capture)
    conn.execute("""INSERT INTO "t" VALUES (1, 'a', 0), (2, 'hidden', 0), (3, 'c', 0)""")
    by_statement(read_events(q))
    conn.execute("""UPDATE "t" SET "seen" = "seen" + 1""")
    assert by_statement(read_events(q)) == []
    conn.execute("""UPDATE "t" SET "v" = CASE "id" WHEN 1 THEN 'hidden' WHEN 2 THEN 'b' ELSE 'C' END""")
    assert sorted(pairs(by_statement(read_events(q)))) == [
        ("D", [([1], [1, "a"])]),
        ("U", [([2, "b"], None), ([3, "C"], [3, "c"])]),
    ]
    conn.execute("""DELETE FROM "t" """)
    assert pairs(by_statement(read_events(q))) == [("D", [([2], [2, "b"]), ([3], [3, "C"])])]


@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_keys_with_nulls_pair_as_the_capture_compares_keys(conn, q, capture):
    """A --key column may be NULL in full mode: old and new rows of such a key pair (NULLs equal, as EXCEPT
    compares the keys that decide what vanished)."""
    conn.execute('CREATE TABLE "t" ("a" int, "b" int, "v" text)')
    q.add_table("q", "t", key=["a", "b"], old_rows=True, capture=capture)
    conn.execute("""INSERT INTO "t" VALUES (1, NULL, 'x'), (2, 2, 'y')""")
    by_statement(read_events(q))
    conn.execute("""UPDATE "t" SET "v" = "v" || '!', "a" = CASE WHEN "a" = 2 THEN 2 ELSE 1 END""")
    conn.execute("""UPDATE "t" SET "b" = 5 WHERE "b" IS NULL""")
    events = by_statement(read_events(q))
    assert pairs(events[:1]) == [("U", [([1, None, "x!"], [1, None, "x"]), ([2, 2, "y!"], [2, 2, "y"])])]
    assert sorted(pairs(events[1:])) == [("D", [([1, None], [1, None, "x!"])]), ("U", [([1, 5, "x!"], None)])]


def test_tables_without_old_rows_queue_none(conn, q):
    conn.execute('CREATE TABLE "t" ("id" int PRIMARY KEY, "v" text)')
    q.add_table("q", "t")
    conn.execute("""INSERT INTO "t" SELECT g, 'x' FROM generate_series(1, 1500) g""")
    conn.execute("""UPDATE "t" SET "v" = 'y'""")
    conn.execute("""UPDATE "t" SET "id" = "id" + 10000 WHERE "id" < 5""")
    conn.execute("""DELETE FROM "t" """)
    events = read_events(q)
    assert {e.type for e in events} == {"I", "U", "D"}
    assert all(e.old is None for e in events)


def test_pk_mode_with_old_rows_is_refused(conn, q):
    conn.execute('CREATE TABLE "t" ("id" int PRIMARY KEY, "v" text)')
    with pytest.raises(Exception, match=r"old rows \(--old-rows\) need full mode"):
        q.add_table("q", "t", mode="pk", old_rows=True)
    q.add_table("q", "t", mode="pk")
    with pytest.raises(Exception, match=r"old rows \(--old-rows\) need full mode"):
        q.alter_table("q", "t", old_rows=True)
    assert q.alter_table("q", "t", mode="full", old_rows=True)["changed"] == ["mode", "old_rows"]
    with pytest.raises(Exception, match=r"old rows \(--old-rows\) need full mode"):
        q.alter_table("q", "t", mode="pk")


@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_a_statement_after_ddl_no_event_trigger_saw_queues_the_old_rows_in_the_new_layout(conn, q, capture):
    """Without event triggers, the first statement after a DDL on the table is captured by the capture of
    a structure it follows then (replicator.capture_drift): with the old rows too, in the new columns."""
    drop_event_triggers(conn)
    conn.execute('CREATE TABLE "t" ("id" int PRIMARY KEY, "v" text)')
    q.add_table("q", "t", old_rows=True, capture=capture)
    conn.execute("""INSERT INTO "t" VALUES (1, 'a'), (2, 'b')""")
    conn.execute('ALTER TABLE "t" ADD COLUMN "n" int')
    conn.execute("""UPDATE "t" SET "n" = "id" * 10, "v" = upper("v")""")
    conn.execute("""DELETE FROM "t" WHERE "id" = 1""")
    events = [e for e in by_statement(read_events(q)) if e.type != "S"]
    assert pairs(events[1:]) == [
        ("U", [([1, "A", 10], [1, "a", None]), ([2, "B", 20], [2, "b", None])]),
        ("D", [([1], [1, "A", 10])]),
    ]
