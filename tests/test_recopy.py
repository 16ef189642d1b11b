"""`consume --recopy`: a target rebuilt in place, every table copied anew at the
source's current state and the position moved on, in one target transaction."""

from __future__ import annotations

import sqlite3
from contextlib import closing

import pytest

from consumer_helpers import Daemon, run_cli, sqlite_position, wait_until
from ddl_helpers import assert_sqlite_equals_source, sqlite_rows, stream_lines
from replicator.errors import UserError


def registered_consumers(conn) -> list[str]:
    return [r[0] for r in conn.execute("SELECT consumer_name FROM replicator.consumer ORDER BY 1")]


@pytest.fixture
def queue_q(conn, source):
    """Queue q capturing a (small) and b, with rows."""
    source.create_queue("q")
    conn.execute("CREATE TABLE a (id int PRIMARY KEY, v text)")
    conn.execute("CREATE TABLE b (id int PRIMARY KEY, n int)")
    conn.execute("INSERT INTO a SELECT g, 'a' || g FROM generate_series(1, 20) g")
    conn.execute("INSERT INTO b SELECT g, g FROM generate_series(1, 50) g")
    source.add_table("q", "a")
    source.add_table("q", "b")
    return source


def consume(dsn: str, target: str, *more: str) -> None:
    result = run_cli(dsn, "consume", "q", "--target", target, "--until-caught-up", *more)
    assert result.returncode == 0, result.stderr


def test_recopy_rebuilds_a_damaged_replica_in_place_keeping_its_consumer_and_views(conn, dsn, queue_q, tmp_path):
    replica = tmp_path / "r.db"
    consume(dsn, f"sqlite:{replica}")
    view = run_cli(dsn, "view", "create", "a_count", "--target", f"sqlite:{replica}",
                   "--sql", "SELECT count(*) AS n, max(id) AS top FROM a")
    assert view.returncode == 0, view.stderr
    consumers = registered_consumers(conn)
    with closing(sqlite3.connect(replica)) as db, db:   # damage it behind the consumer's back
        db.execute("DELETE FROM a WHERE id > 10")
        db.execute("UPDATE b SET n = -1")
    conn.execute("INSERT INTO a VALUES (100, 'new')")
    conn.execute("DELETE FROM b WHERE id <= 5")
    before = sqlite_position(replica)

    consume(dsn, f"sqlite:{replica}", "--recopy")
    assert_sqlite_equals_source(conn, replica, "recopy")
    assert sqlite_position(replica) > before
    assert registered_consumers(conn) == consumers
    with closing(sqlite3.connect(replica)) as db:
        assert db.execute("SELECT n, top FROM a_count").fetchall() == [(21, 100)]
    # and it goes on from there
    conn.execute("UPDATE b SET n = n * 2 WHERE id > 40")
    conn.execute("INSERT INTO a VALUES (101, 'later')")
    consume(dsn, f"sqlite:{replica}")
    assert_sqlite_equals_source(conn, replica, "after the recopy")
    with closing(sqlite3.connect(replica)) as db:
        assert db.execute("SELECT n, top FROM a_count").fetchall() == [(22, 101)]


def test_recopy_rebuilds_a_replica_older_than_the_queue_keeps_as_the_error_says(conn, dsn, queue_q, tmp_path):
    replica = tmp_path / "r.db"
    consume(dsn, f"sqlite:{replica}")
    backup = tmp_path / "backup.db"
    backup.write_bytes(replica.read_bytes())     # closed by its consumer: the whole replica is in the file
    conn.execute("INSERT INTO a VALUES (100, 'new')")
    consume(dsn, f"sqlite:{replica}")
    assert run_cli(dsn, "maint", "--once").returncode == 0     # ticks before the backup's are gone
    backup.replace(replica)

    refused = run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up")
    assert refused.returncode == 1 and "--recopy" in refused.stderr, refused.stderr
    consume(dsn, f"sqlite:{replica}", "--recopy")
    assert_sqlite_equals_source(conn, replica, "recopy of an old backup")


def test_recopy_killed_midway_leaves_the_replica_as_it_was_and_a_rerun_finishes_it(conn, dsn, queue_q, tmp_path):
    replica = tmp_path / "r.db"
    conn.execute("INSERT INTO b SELECT g, g FROM generate_series(51, 400000) g")   # a copy that takes a while
    consume(dsn, f"sqlite:{replica}")
    conn.execute("DELETE FROM a WHERE id > 15")
    consume(dsn, f"sqlite:{replica}")
    old = {t: sqlite_rows(replica, t) for t in ("a", "b")}
    old_position = sqlite_position(replica)
    conn.execute("UPDATE a SET v = 'changed'")

    daemon = Daemon(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--recopy", log=tmp_path / "recopy.log")
    try:
        wait_until(lambda: "copied public.a" in daemon.log(), 60, "the recopy of a",
                   check=lambda: daemon.alive() or pytest.fail(daemon.log()))
        daemon.kill9()
    finally:
        daemon.stop()
    assert "copied public.b" not in daemon.log(), "killed too late to be midway"
    assert {t: sqlite_rows(replica, t) for t in ("a", "b")} == old
    assert sqlite_position(replica) == old_position

    consume(dsn, f"sqlite:{replica}", "--recopy")
    assert_sqlite_equals_source(conn, replica, "recopy run again")


def test_recopy_of_a_stream_writes_each_tables_truncate_then_its_rows(conn, dsn, queue_q, tmp_path):
    stream = tmp_path / "changes.jsonl"
    consume(dsn, f"jsonl:{stream}")
    copied = len(stream_lines(stream))
    conn.execute("INSERT INTO a VALUES (100, 'new')")
    consume(dsn, f"jsonl:{stream}", "--recopy")
    lines = stream_lines(stream)[copied:]
    assert [(line["op"], line["table"]) for line in lines[:2]] == [("T", "public.a"), ("T", "public.b")]
    assert sorted(line["row"]["id"] for line in lines[2:] if line["table"] == "public.a") == [*range(1, 21), 100]
    assert {line["op"] for line in lines[2:]} == {"R"}
    assert len(lines) == 2 + 21 + 50


def test_recopy_with_tables_copies_a_table_new_to_the_target_too(conn, dsn, queue_q, tmp_path):
    replica = tmp_path / "r.db"
    consume(dsn, f"sqlite:{replica}", "--tables", "a")
    consume(dsn, f"sqlite:{replica}", "--tables", "a,b", "--recopy")
    assert_sqlite_equals_source(conn, replica, "recopy with a new table")


def test_recopy_leaves_a_table_the_queue_no_longer_captures_as_it_is(conn, dsn, queue_q, tmp_path):
    replica = tmp_path / "r.db"
    consume(dsn, f"sqlite:{replica}")
    assert run_cli(dsn, "table", "remove", "q", "b").returncode == 0
    conn.execute("DELETE FROM b")
    result = run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up", "--recopy")
    assert result.returncode == 0, result.stderr
    assert "public.b left as it is: queue q no longer captures it" in result.stderr
    assert len(sqlite_rows(replica, "b")) == 50
    assert len(sqlite_rows(replica, "a")) == 20


def test_moving_a_consumer_to_a_tick_the_queue_no_longer_keeps_names_recopy(conn, queue_q):
    queue_q.register_consumer("q", "c")
    with pytest.raises(UserError, match=r'^tick 999999 of queue "q" no longer exists: the target is older than the '
                                        r"queue keeps; rebuild it in place with replicator consume q --target \.\.\. "
                                        r"--consumer c --recopy$"):
        queue_q.set_consumer_position("q", "c", 999999)
