"""Rotation: event tables are switched after the rotation period and the oldest is
TRUNCATEd only when nobody can need it; what blocks it is named; no dead tuples."""

from __future__ import annotations

import itertools
import random
from datetime import timedelta

import psycopg
import pytest

from consumer_helpers import run_cli
from queue_util import apply_events, read_events
from replicator.source.status import status


@pytest.fixture
def q(conn, source):
    conn.execute('CREATE TABLE "t" ("id" int PRIMARY KEY, "v" int)')
    source.create_queue("q", ntables=3, rotation_period=timedelta(hours=1))
    source.add_table("q", "t")
    return source


def _due(conn) -> None:
    """The rotation period has passed (instead of waiting an hour)."""
    conn.execute("UPDATE replicator.queue SET queue_switch_time = now() - interval '1 day'")


def _counts(conn, source) -> list[int]:
    qid = source.queue_id("q")
    return [conn.execute(f'SELECT count(*) FROM replicator."event_{qid}_{n}"').fetchone()[0] for n in range(3)]


def _current(source) -> int:
    return source.queues()[0]["current_table"]


def _blockers(source) -> list[tuple[str, str]]:
    return sorted((b["kind"], b["name"]) for b in source.rotation_blockers("q"))


def _ids(events) -> list[int]:
    return sorted(item[0] for e in events for item in e.items)


def test_maint_rotates_only_when_the_period_has_passed(conn, q):
    q.register_consumer("q", "c")
    assert "rotated" not in q.maint()["q"]
    assert _current(q) == 0
    _due(conn)
    assert q.maint()["q"][:2] == ["rotated", "switch completed"]
    assert _current(q) == 1
    assert "rotated" not in q.maint()["q"]                   # the new table's period starts now


def test_oldest_table_is_truncated_only_when_every_consumer_is_past_it(conn, q):
    q.register_consumer("q", "c")
    conn.execute('INSERT INTO "t" VALUES (0, 0)')
    _due(conn)
    assert "rotated" in q.maint()["q"]                         # to table 1: table 1 was empty
    conn.execute('INSERT INTO "t" VALUES (1, 1)')
    assert _counts(conn, q) == [1, 1, 0]

    _due(conn)
    assert "rotated" not in q.maint()["q"]                     # c has not read table 0 and 1 yet
    q.tick("q", force=True)                                    # a tick past the switch c has not reached
    assert _blockers(q) == [("consumer", "c")]
    assert _ids(read_events(q)) == [0, 1]
    assert _blockers(q) == []
    assert "rotated" in q.maint()["q"]                         # to table 2 (empty)
    conn.execute('INSERT INTO "t" VALUES (2, 2)')
    assert _counts(conn, q) == [1, 1, 1]

    _due(conn)
    assert "rotated" not in q.maint()["q"]
    assert _counts(conn, q) == [1, 1, 1]
    assert _ids(read_events(q)) == [2]
    assert "rotated" in q.maint()["q"]                         # back to table 0: its events go
    assert _current(q) == 0
    assert _counts(conn, q) == [0, 1, 1]
    conn.execute('INSERT INTO "t" VALUES (3, 3)')
    assert _ids(read_events(q)) == [3]                         # nothing lost, nothing repeated


def test_stalled_consumer_blocks_rotation_and_is_named(dsn, conn, q):
    q.register_consumer("q", "fast")
    q.register_consumer("q", "stalled")
    _due(conn)
    assert "rotated" in q.maint()["q"]
    conn.execute('INSERT INTO "t" VALUES (1, 1)')
    assert _ids(read_events(q, consumer="fast")) == [1]

    _due(conn)
    assert "rotated" not in q.maint()["q"]
    assert _blockers(q) == [("consumer", "stalled")]
    (queue,) = status(q)["queues"]
    assert [(b["kind"], b["name"]) for b in queue["rotation_blockers"]] == [("consumer", "stalled")]
    assert "not past the transactions of the previous table" in queue["rotation_blockers"][0]["detail"]
    lag = {c["consumer"]: c for c in status(q)["consumers"]}
    assert lag["stalled"]["lag_ticks"] > 0 and lag["fast"]["lag_ticks"] == 0
    shown = run_cli(dsn, "status", COLUMNS="250")
    assert shown.returncode == 0, shown.stderr
    blocked = shown.stdout[shown.stdout.index("rotation blocked by"):]
    assert "stalled" in blocked and "fast" not in blocked, shown.stdout

    assert _ids(read_events(q, consumer="stalled")) == [1]
    assert _blockers(q) == []
    assert "rotated" in q.maint()["q"]


def test_unregistered_consumer_no_longer_blocks_rotation(conn, q):
    q.register_consumer("q", "gone")
    _due(conn)
    q.maint()
    conn.execute('INSERT INTO "t" VALUES (1, 1)')
    q.tick("q", force=True)
    _due(conn)
    assert "rotated" not in q.maint()["q"]
    assert q.unregister_consumer("q", "gone")
    assert "rotated" in q.maint()["q"]


def test_old_open_transaction_blocks_rotation_and_is_named(dsn, conn, q):
    q.register_consumer("q", "c")
    with psycopg.connect(dsn, autocommit=True) as old, psycopg.connect(dsn, autocommit=True) as young:
        old.execute("BEGIN")
        old.execute('INSERT INTO "t" VALUES (1, 1)')           # writes into table 0 ...
        _due(conn)
        assert "rotated" in q.maint()["q"]                     # ... and stays open across the switch
        read_events(q)                                          # the consumer keeps up
        young.execute("BEGIN")
        young.execute('INSERT INTO "t" VALUES (2, 2)')         # began after the switch: not a blocker

        _due(conn)
        assert "rotated" not in q.maint()["q"]
        blockers = q.rotation_blockers("q")
        transactions = [b for b in blockers if b["kind"] == "transaction"]
        assert [b["name"] for b in transactions] == [f"pid {old.info.backend_pid}"]
        assert 'INSERT INTO "t" VALUES (1, 1)' in transactions[0]["detail"]
        # The consumer cannot be past a transaction still running: it is named too.
        assert [b["name"] for b in blockers if b["kind"] == "consumer"] == ["c"]
        (queue,) = status(q)["queues"]
        assert f"pid {old.info.backend_pid}" in [b["name"] for b in queue["rotation_blockers"]]

        old.execute("COMMIT")
        young.execute("COMMIT")
    assert _ids(read_events(q)) == [1, 2]
    assert _blockers(q) == []
    assert "rotated" in q.maint()["q"]


def _dead_tuples(conn, source) -> dict[str, tuple[int, int | None]]:
    """(pgstattuple's dead tuples, pg_stat_user_tables.n_dead_tup) per event table. The
    statistics are flushed on demand from PostgreSQL 15; before it a collector process
    receives them when it may, so only pgstattuple's exact count is read (None)."""
    qid = source.queue_id("q")
    flushed = conn.info.server_version >= 150000
    if flushed:
        conn.execute("SELECT pg_stat_force_next_flush()")
        conn.execute("SELECT pg_stat_clear_snapshot()")
    out = {}
    for n in range(3):
        name = f"event_{qid}_{n}"
        exact = conn.execute("SELECT dead_tuple_count FROM pgstattuple(%s::regclass)",
                             (f'replicator."{name}"',)).fetchone()[0]
        stat = conn.execute("SELECT n_dead_tup FROM pg_stat_user_tables WHERE schemaname = 'replicator'"
                            " AND relname = %s", (name,)).fetchone()[0] if flushed else None
        out[name] = (exact, stat)
    return out


def test_long_run_leaves_no_dead_tuples_and_loses_no_event(conn, q):
    conn.execute("CREATE EXTENSION pgstattuple")
    consumers = {"every_cycle": 1, "every_fourth": 4}
    for name in consumers:
        q.register_consumer("q", name)
    replicas: dict[str, dict] = {name: {} for name in consumers}
    seen_ids: dict[str, list[int]] = {name: [] for name in consumers}
    rng = random.Random(20261122)
    keys = itertools.count(1)
    statements = 0
    rotations = 0
    for cycle in range(40):
        with conn.transaction():
            new = [next(keys) for _ in range(rng.randint(1, 30))]
            conn.execute('INSERT INTO "t" SELECT k, 0 FROM unnest(%s::int[]) k', (new,))
            statements += 1
            if conn.execute('UPDATE "t" SET "v" = "v" + 1 WHERE "id" %% 3 = %s', (cycle % 3,)).rowcount:
                statements += 1
        if conn.execute('DELETE FROM "t" WHERE "id" %% 7 = %s', (cycle % 7,)).rowcount:
            statements += 1
        if cycle % 10 == 9 and conn.execute('UPDATE "t" SET "id" = "id" + 100000 WHERE "id" < 10').rowcount:
            statements += 2                                     # a key change: D of old keys, U of new rows
        for name, every in consumers.items():
            if cycle % every == 0:
                events = read_events(q, consumer=name)
                apply_events(replicas[name], events, [0])
                seen_ids[name] += [e.ev_id for e in events]
        _due(conn)
        rotations += "rotated" in q.maint()["q"]
    for name in consumers:
        events = read_events(q, consumer=name)
        apply_events(replicas[name], events, [0])
        seen_ids[name] += [e.ev_id for e in events]

    source_rows = {(row[0],): list(row) for row in conn.execute('SELECT "id", "v" FROM "t"')}
    assert rotations >= 9                                       # three times round the tables, at least
    for name in consumers:
        assert replicas[name] == source_rows, name
        assert len(seen_ids[name]) == len(set(seen_ids[name])) == statements, name
    assert seen_ids["every_cycle"] == seen_ids["every_fourth"]
    assert all(exact == 0 and stat in (0, None) for exact, stat in _dead_tuples(conn, q).values()), \
        _dead_tuples(conn, q)
    # Ticks no consumer needs are cleaned up.
    q.maint()
    assert conn.execute("SELECT count(*) FROM replicator.tick").fetchone()[0] <= 2
