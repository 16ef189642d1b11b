"""DDL that no event trigger sees and nobody runs through `replicator execute` (a database
without superuser, an administrator unaware of replicator): application writes never fail
because of it, and the SQLite replica ends equal to the source, value by value. The capture
functions notice a change at the table's next statement (replicator.capture_guard); the
ticker notices the rest before its next tick (replicator.follow_unseen_ddl)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import psycopg
import pytest

from ddl_helpers import assert_sqlite_equals_source
from queue_util import CAPTURE_KINDS
from replicator.consumer import Consumer
from replicator.errors import UserError
from replicator.source import Source
from replicator.source.install import drop_event_triggers
from replicator.targets import open_target


class Replica:
    """A SQLite replica of queue q, caught up on demand by a long-lived consumer."""

    def __init__(self, dsn: str, tmp_path: Path) -> None:
        self.path = tmp_path / "replica.db"
        self.consumer = Consumer(dsn, "q", open_target(f"sqlite:{self.path}"))

    def catch_up(self) -> None:
        self.consumer.run(until_caught_up=True)

    def rows(self, query: str) -> list[tuple]:
        with sqlite3.connect(self.path) as db:
            return db.execute(query).fetchall()

    def close(self) -> None:
        self.consumer.close()
        self.consumer.target.close()


@pytest.fixture
def replica(dsn, tmp_path):
    replica = Replica(dsn, tmp_path)
    yield replica
    replica.close()


@pytest.fixture
def unseen(conn, source):
    """Queue q in a database whose DDL no event trigger captures."""
    drop_event_triggers(conn)
    source.create_queue("q")
    return source


def suspended(source: Source) -> list[str | None]:
    return [r[0] for r in source.conn.execute(
        "SELECT table_suspended FROM replicator.captured_table ORDER BY table_id")]


@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_several_changes_in_one_transaction_with_writes_between_them_are_all_followed(conn, unseen, replica, capture):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, old text, v int)")
    conn.execute("INSERT INTO t SELECT g, 'o' || g, g FROM generate_series(1, 5) g")
    unseen.add_table("q", "t", capture=capture)
    replica.catch_up()
    # a migration tool's transaction: add, backfill, rename, add again, drop the old column
    with conn.transaction():
        conn.execute("ALTER TABLE t ADD COLUMN a int")
        conn.execute("UPDATE t SET a = id * 10")
        conn.execute("ALTER TABLE t RENAME COLUMN a TO a2")
        conn.execute("INSERT INTO t (id, old, v, a2) VALUES (6, 'o6', 6, 60)")
        conn.execute("ALTER TABLE t ADD COLUMN b int")
        conn.execute("UPDATE t SET b = a2 + 1 WHERE id % 2 = 0")
        conn.execute("ALTER TABLE t DROP COLUMN old")
        conn.execute("INSERT INTO t (id, v, a2, b) VALUES (7, 7, 70, 10)")
    conn.execute("INSERT INTO t (id, v, a2, b) VALUES (8, 8, 80, 81)")
    conn.execute("UPDATE t SET b = 0 WHERE id = 1")
    replica.catch_up()
    assert_sqlite_equals_source(conn, replica.path, "one transaction")


@pytest.mark.parametrize("identity", ["DEFAULT", "FULL"])     # the guard reads the key two ways
@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_a_primary_key_replaced_directly_keys_the_replica_anew(conn, unseen, replica, identity, capture):
    conn.execute("CREATE TABLE t (a int, b int NOT NULL, v text, PRIMARY KEY (a))")   # no column row changes
    conn.execute(f"ALTER TABLE t REPLICA IDENTITY {identity}")
    conn.execute("INSERT INTO t VALUES (1, 1, 'x')")
    unseen.add_table("q", "t", capture=capture)
    replica.catch_up()
    conn.execute("ALTER TABLE t DROP CONSTRAINT t_pkey, ADD PRIMARY KEY (a, b)")
    conn.execute("INSERT INTO t VALUES (1, 2, 'y')")       # the same a: a row of its own now
    # noticed by that statement, before its row
    assert [r[0] for r in conn.execute("SELECT ev_type FROM replicator.event_1 ORDER BY ev_id DESC LIMIT 2")] == [
        "I", "S"]
    replica.catch_up()
    assert_sqlite_equals_source(conn, replica.path, "primary key replaced")


@pytest.mark.parametrize("then", ["GRANT SELECT ON t TO PUBLIC", "VACUUM FULL t", "TRUNCATE t"])
def test_a_rewrite_to_the_same_type_is_copied_again_whatever_follows_it(conn, unseen, replica, then):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, a int)")
    conn.execute("INSERT INTO t SELECT g, g FROM generate_series(1, 5) g")
    unseen.add_table("q", "t")
    replica.catch_up()
    conn.execute("ALTER TABLE t ALTER COLUMN a TYPE int USING a * 100")
    conn.execute(then)
    replica.catch_up()                    # the ticker notices, no statement having written t
    assert_sqlite_equals_source(conn, replica.path, then)
    conn.execute("INSERT INTO t VALUES (6, 6)")
    replica.catch_up()
    assert_sqlite_equals_source(conn, replica.path, "written after")


@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_a_column_added_is_captured_with_the_output_settings_pinned(dsn, conn, unseen, replica, capture):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY)")     # no type whose rendering depends on settings
    unseen.add_table("q", "t", capture=capture)
    replica.catch_up()
    conn.execute("ALTER TABLE t ADD COLUMN f float8, ADD COLUMN i interval")
    with psycopg.connect(dsn, autocommit=True) as writer:
        writer.execute("SET extra_float_digits = 0")
        writer.execute("SET IntervalStyle = 'iso_8601'")
        writer.execute("INSERT INTO t VALUES (1, 0.1::float8 + 0.2::float8, '1 day 2 hours')")
    replica.catch_up()
    # as PostgreSQL prints them with the capture's own settings, not the writer's
    assert replica.rows("SELECT id, f, i FROM t") == [(1, 0.1 + 0.2, "1 day 02:00:00")]


def test_partitions_created_attached_detached_or_dropped_directly_are_followed(conn, unseen, replica):
    conn.execute("CREATE TABLE p (id int PRIMARY KEY, v text) PARTITION BY RANGE (id)")
    conn.execute("CREATE TABLE p1 PARTITION OF p FOR VALUES FROM (0) TO (100)")
    conn.execute("CREATE TABLE p2 PARTITION OF p FOR VALUES FROM (100) TO (200)")
    conn.execute("INSERT INTO p VALUES (1, 'a'), (101, 'b')")
    unseen.add_table("q", "p")
    replica.catch_up()
    conn.execute("CREATE TABLE p3 PARTITION OF p FOR VALUES FROM (200) TO (300)")
    conn.execute("INSERT INTO p3 VALUES (201, 'written naming the new partition')")
    conn.execute("CREATE TABLE p4 (id int PRIMARY KEY, v text)")
    conn.execute("INSERT INTO p4 VALUES (301, 'brought by ATTACH')")
    conn.execute("ALTER TABLE p ATTACH PARTITION p4 FOR VALUES FROM (300) TO (400)")
    conn.execute("ALTER TABLE p DETACH PARTITION p1")
    conn.execute("DROP TABLE p2")
    replica.catch_up()
    # p1 and p4 are tables of their own too; only p and its tree are replicated
    rows = replica.rows("SELECT id, v FROM p ORDER BY id")
    assert rows == conn.execute("SELECT id, v FROM p ORDER BY id").fetchall()
    conn.execute("INSERT INTO p3 VALUES (202, 'x')")
    conn.execute("UPDATE p4 SET v = 'updated naming it' WHERE id = 301")
    conn.execute("INSERT INTO p1 VALUES (2, 'detached: not p')")
    replica.catch_up()
    rows = replica.rows("SELECT id, v FROM p ORDER BY id")
    assert rows == conn.execute("SELECT id, v FROM p ORDER BY id").fetchall()


def test_a_ddl_in_progress_neither_suspends_a_filtered_table_nor_holds_ticks_back(dsn, conn, unseen, replica):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    unseen.add_table("q", "t", where="v <> 'skip'")
    replica.catch_up()
    conn.execute("ALTER TABLE t ADD COLUMN n int")
    with psycopg.connect(dsn) as migration:                   # a second migration step, still running
        migration.execute("LOCK t IN ACCESS EXCLUSIVE MODE")
        assert unseen.tick("q", force=True) is not None
        assert suspended(unseen) == [None]
    conn.execute("INSERT INTO t VALUES (1, 'a', 1), (2, 'skip', 2)")
    replica.catch_up()
    assert replica.rows("SELECT id, v, n FROM t") == [(1, "a", 1)]


def test_a_new_table_in_a_followed_schema_locked_by_its_loader_holds_no_tick_back(dsn, conn, unseen, replica):
    conn.execute("CREATE SCHEMA app")
    unseen.follow_schema("q", "app")
    replica.catch_up()
    conn.execute("CREATE TABLE app.fresh (id int PRIMARY KEY)")
    with psycopg.connect(dsn) as loader:
        loader.execute("LOCK app.fresh IN ACCESS EXCLUSIVE MODE")
        assert unseen.tick("q", force=True) is not None
    replica.catch_up()                    # captured at the next tick, its rows copied
    conn.execute("INSERT INTO app.fresh VALUES (1)")
    replica.catch_up()
    assert replica.rows("SELECT id FROM app__fresh") == [(1,)]


def test_a_key_column_given_a_type_without_equality_suspends_the_capture(conn, unseen, replica):
    conn.execute("CREATE TABLE t (id int, k text, PRIMARY KEY (id))")
    unseen.add_table("q", "t", key=["k"])
    replica.catch_up()
    conn.execute("ALTER TABLE t ALTER COLUMN k TYPE json USING to_json(k)")
    conn.execute("INSERT INTO t VALUES (1, '\"a\"')")        # the application goes on
    conn.execute("UPDATE t SET id = 2")
    assert "type without equality" in suspended(unseen)[0]
    with pytest.raises(UserError, match=r"replicator table remove q public.t"):
        replica.catch_up()


@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_serializable_writers_following_a_change_do_not_fail_each_other(dsn, conn, unseen, replica, capture):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v int)")
    conn.execute("CREATE SCHEMA side; CREATE TABLE side.other (id int PRIMARY KEY)")
    conn.execute("INSERT INTO t SELECT g, g FROM generate_series(1, 100) g")
    unseen.add_table("q", "t", capture=capture)
    replica.catch_up()
    conn.execute("ALTER TABLE t ADD COLUMN w int")
    with psycopg.connect(dsn) as a, psycopg.connect(dsn) as b:
        for session in (a, b):
            session.execute("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE")
        a.execute("SELECT count(*) FROM side.other")
        a.execute("UPDATE t SET v = 0 WHERE id = 1")
        b.execute("UPDATE t SET v = 0 WHERE id = 99")
        b.execute("INSERT INTO side.other VALUES (1)")
        a.commit()
        b.commit()
    replica.catch_up()
    assert_sqlite_equals_source(conn, replica.path, "serializable writers")


def test_event_triggers_disabled_later_put_the_guard_in_before_the_next_tick(conn, source, replica):
    source.create_queue("q")
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, a text)")
    source.add_table("q", "t")                                # generated without the guard
    replica.catch_up()
    conn.execute("ALTER EVENT TRIGGER replicator_ddl_command_end DISABLE")
    replica.catch_up()                                        # its tick generates the guard in
    conn.execute("ALTER TABLE t RENAME COLUMN a TO b")
    conn.execute("INSERT INTO t VALUES (1, 'x')")
    replica.catch_up()
    assert_sqlite_equals_source(conn, replica.path, "renamed with the event trigger disabled")


@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_a_name_holding_the_capture_functions_quote_is_captured(conn, unseen, replica, capture):
    conn.execute('CREATE TABLE t (id int PRIMARY KEY, "a$capture$b" text)')
    unseen.add_table("q", "t", capture=capture)
    conn.execute('INSERT INTO t VALUES (1, \'x\')')
    conn.execute("ALTER TABLE t ADD COLUMN c int")
    conn.execute("INSERT INTO t VALUES (2, 'y', 2)")
    conn.execute("INSERT INTO t VALUES (3, 'z', 3)")
    replica.catch_up()
    assert_sqlite_equals_source(conn, replica.path, "quote in a column name")
    assert unseen.conn.execute("SELECT count(*) FROM replicator.event_1 WHERE ev_type = 'S'").fetchone()[0] <= 1


@pytest.mark.parametrize("where, named", [
    ("id IN (SELECT id FROM allowed)", "table allowed"),
    ("app.weight(v) > 1", "function app.weight"),
    ("v::app.label IS NOT NULL", "type app.label"),
    ("'allowed'::regclass IS NOT NULL", "a catalog object by a regclass value"),
])
def test_without_event_triggers_a_row_filter_names_only_the_row_and_built_ins(conn, unseen, where, named):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    conn.execute("CREATE TABLE allowed (id int PRIMARY KEY)")
    conn.execute("CREATE SCHEMA app; CREATE DOMAIN app.label AS text;"
                 " CREATE FUNCTION app.weight(text) RETURNS int LANGUAGE sql IMMUTABLE AS 'SELECT length($1)'")
    # dropping or changing what it names would go unseen, and every write would fail
    with pytest.raises(UserError, match=f"invalid row filter: it names {named}, which replicator cannot watch"):
        unseen.add_table("q", "t", where=where)
    assert unseen.tables("q") == []
    assert unseen.add_table("q", "t", where="lower(v) <> 'x' AND id::text <> '' AND v ~ '^a'")


def test_a_rewrite_to_the_same_type_of_a_partitioned_table_is_copied_again(conn, unseen, replica):
    conn.execute("CREATE TABLE p (id int PRIMARY KEY, a int) PARTITION BY RANGE (id)")
    conn.execute("CREATE TABLE p1 PARTITION OF p FOR VALUES FROM (0) TO (100)")
    conn.execute("INSERT INTO p SELECT g, g FROM generate_series(1, 5) g")
    unseen.add_table("q", "p")
    replica.catch_up()
    conn.execute("ALTER TABLE p ALTER COLUMN a TYPE int USING a * 100")   # its partitions get new storage
    replica.catch_up()
    assert replica.rows("SELECT id, a FROM p ORDER BY id") == conn.execute("SELECT id, a FROM p ORDER BY id").fetchall()


@pytest.mark.parametrize("recorder", ["none: serializable", "another transaction"])
@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_a_key_swap_by_a_transaction_that_cannot_record_the_change_keeps_both_rows(dsn, conn, unseen, replica,
                                                                                 capture, recorder):
    """Until the change is recorded (by another transaction, or by the ticker for SERIALIZABLE ones)
    every statement is captured by capture_drift's SQL: a row capture's must not queue the old key's
    D while another row of the statement holds it."""
    conn.execute("CREATE TABLE t (id int PRIMARY KEY DEFERRABLE, v text)")
    conn.execute("INSERT INTO t VALUES (1, 'a'), (2, 'b'), (3, 'c')")
    unseen.add_table("q", "t", capture=capture)
    replica.catch_up()
    conn.execute("ALTER TABLE t ADD COLUMN w int")
    with psycopg.connect(dsn) as writer, psycopg.connect(dsn) as recording:
        if recorder == "another transaction":
            recording.execute("UPDATE t SET v = 'c2' WHERE id = 3")   # records the change, uncommitted
        else:
            writer.execute("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE")
        writer.execute("UPDATE t SET id = 3 - id WHERE id IN (1, 2)")
        writer.commit()
        recording.commit()
    replica.catch_up()
    assert_sqlite_equals_source(conn, replica.path, "a key swap")
