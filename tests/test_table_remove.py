"""`table remove`: replicas keep their copy of the table as it was, no longer
updated, and say so; with --drop-from-replicas they drop it at that point of the
queue, after applying what was queued before it."""

from __future__ import annotations

from pathlib import Path

import pytest

from consumer_helpers import run_cli
from ddl_helpers import sqlite_rows, sqlite_tables, stream_lines
from replicator.consumer import Consumer
from replicator.targets import open_target


def _consumers(dsn: str, tmp_path: Path) -> list[Consumer]:
    return [Consumer(dsn, "q", open_target(f"sqlite:{tmp_path / 'replica.db'}")),
            Consumer(dsn, "q", open_target(f"jsonl:{tmp_path / 'changes.jsonl'}"))]


def _catch_up(consumers: list[Consumer]) -> None:
    for consumer in consumers:
        consumer.run(until_caught_up=True)


@pytest.fixture
def replicated(conn, source, dsn, tmp_path):
    """Tables t and u of queue q, copied into a SQLite replica and a stream."""
    source.create_queue("q")
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    conn.execute("CREATE TABLE u (id int PRIMARY KEY)")
    conn.execute("INSERT INTO t VALUES (1, 'a'), (2, 'b')")
    source.add_table("q", "t")
    source.add_table("q", "u")
    consumers = _consumers(dsn, tmp_path)
    _catch_up(consumers)
    yield consumers
    for consumer in consumers:
        consumer.close()
        consumer.target.close()


def test_table_remove_says_replicas_keep_their_copy_and_they_do(conn, dsn, tmp_path, replicated):
    conn.execute("INSERT INTO t VALUES (3, 'before removal')")
    result = run_cli(dsn, "table", "remove", "q", "t")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "1 table removed from queue q",
        "replicas keep their copy as it is, no longer updated (`table remove --drop-from-replicas` has consumers "
        "drop it at that point of the queue)"]
    conn.execute("INSERT INTO t VALUES (4, 'after removal')")
    _catch_up(replicated)
    replica = tmp_path / "replica.db"
    assert sqlite_tables(replica) == ["t", "u"]
    assert sorted(dict(r)["id"] for r in sqlite_rows(replica, "t")) == [1, 2, 3]
    assert not [line for line in stream_lines(tmp_path / "changes.jsonl") if line["op"] == "S"]


def test_table_remove_drop_from_replicas_drops_the_copy_after_what_was_queued_before(conn, dsn, tmp_path,
                                                                                    replicated):
    conn.execute("INSERT INTO t VALUES (3, 'before removal')")
    result = run_cli(dsn, "table", "remove", "q", "t", "--drop-from-replicas")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["1 table removed from queue q",
                                          "replicas drop their copy once their consumer reaches this point of the queue"]
    conn.execute("INSERT INTO t VALUES (4, 'after removal')")
    _catch_up(replicated)
    assert sqlite_tables(tmp_path / "replica.db") == ["u"]
    lines = [(line["op"], line["table"], line.get("kind")) for line in stream_lines(tmp_path / "changes.jsonl")
             if line["op"] in ("I", "S")]
    assert lines == [("I", "public.t", None), ("S", "public.t", "dropped")]
    # added again, the table is copied anew
    conn.execute("INSERT INTO t VALUES (5, 'added again')")
    run_cli(dsn, "table", "add", "q", "t")
    _catch_up(replicated)
    assert sorted(dict(r)["id"] for r in sqlite_rows(tmp_path / "replica.db", "t")) == [1, 2, 3, 4, 5]


def test_table_remove_drop_from_replicas_needs_the_tables_named(dsn, replicated):
    result = run_cli(dsn, "table", "remove", "q", "--schema", "public", "--drop-from-replicas")
    assert (result.returncode, result.stderr) == (
        1, "error: --drop-from-replicas applies to the tables named: name them\n")
