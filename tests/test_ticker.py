"""The ticker: safe to run concurrently, and ticks only when due unless forced."""

from __future__ import annotations

import itertools
import socket
import threading
import time
from datetime import timedelta

import psycopg
import pytest

from replicator.errors import UserError
from replicator.source.install import drop_event_triggers


@pytest.fixture
def q(conn, source):
    conn.execute('CREATE TABLE "t" ("id" bigserial PRIMARY KEY, "v" int)')
    source.create_queue("q")
    source.add_table("q", "t")
    return source


def _parse(snapshot: str) -> tuple[int, int, set[int]]:
    xmin, xmax, xip = snapshot.split(":")
    return int(xmin), int(xmax), {int(x) for x in xip.split(",") if x}


def _wait_for(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")


def test_concurrent_tickers_produce_strictly_increasing_ticks_with_monotonic_snapshots(dsn, conn, q):
    tickers, calls = 3, 150
    start = threading.Barrier(tickers + 2)
    done = threading.Event()
    returned: list[list[int | None]] = [[] for _ in range(tickers)]
    errors: list[BaseException] = []

    def ticker(number: int) -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as c:
                start.wait()
                for _ in range(calls):
                    returned[number].append(c.execute("SELECT replicator.ticker('q', true)").fetchone()[0])
        except BaseException as exc:       # reported by the main thread
            errors.append(exc)

    def short_writer() -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as c:
                start.wait()
                while not done.is_set():
                    c.execute('INSERT INTO "t" ("v") VALUES (1)')
        except BaseException as exc:
            errors.append(exc)

    def long_writer() -> None:
        """Keeps transactions open across ticks, so snapshots have in-progress lists."""
        try:
            with psycopg.connect(dsn, autocommit=True) as c, psycopg.connect(dsn, autocommit=True) as probe:
                start.wait()
                while not done.is_set():
                    c.execute("BEGIN")
                    c.execute('INSERT INTO "t" ("v") VALUES (2)')
                    seen = probe.execute("SELECT count(*) FROM replicator.tick").fetchone()[0]
                    while not done.is_set() and probe.execute(
                            "SELECT count(*) FROM replicator.tick").fetchone()[0] < seen + 3:
                        pass
                    c.execute("COMMIT")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=ticker, args=(i,)) for i in range(tickers)]
    threads += [threading.Thread(target=short_writer), threading.Thread(target=long_writer)]
    for thread in threads:
        thread.start()
    for thread in threads[:tickers]:
        thread.join(120)
    done.set()
    for thread in threads[tickers:]:
        thread.join(60)
    assert not errors, errors
    assert not any(thread.is_alive() for thread in threads)

    ticks = conn.execute("""SELECT tick_id, tick_snapshot::text, tick_time, tick_event_seq FROM replicator.tick
                            WHERE tick_queue = (replicator.find_queue('q')).queue_id ORDER BY tick_id""").fetchall()
    ids = [tick[0] for tick in ticks]
    made = sorted(tick_id for r in returned for tick_id in r if tick_id is not None)
    # Every tick was made by exactly one call, ids are 1..n without gaps or repeats.
    assert ids == made == list(range(1, len(ids) + 1))
    # The tickers did run into each other (a call finding the queue busy returns NULL).
    assert len(ids) >= 30 and any(tick_id is None for r in returned for tick_id in r)
    assert any(_parse(tick[1])[2] for tick in ticks)           # some snapshots list running transactions
    for (id1, snap1, time1, seq1), (id2, snap2, time2, seq2) in itertools.pairwise(ticks):
        xmin1, xmax1, xip1 = _parse(snap1)
        xmin2, xmax2, xip2 = _parse(snap2)
        assert xmin2 >= xmin1 and xmax2 >= xmax1, (id1, snap1, id2, snap2)
        # Everything visible in the earlier snapshot is visible in the later one.
        assert {x for x in xip2 if x < xmax1} <= xip1, (id1, snap1, id2, snap2)
        assert time2 >= time1 and seq2 >= seq1


def test_ticker_without_force_ticks_only_when_due(conn, q):
    first = q.tick("q", force=True)
    conn.execute("""UPDATE replicator.queue SET queue_ticker_max_count = 3,
                    queue_ticker_max_lag = '10 minutes', queue_ticker_idle_period = '1 hour'""")

    def age_last_tick(by: timedelta) -> None:
        conn.execute("UPDATE replicator.tick SET tick_time = tick_time - %s"
                     " WHERE tick_id = (SELECT max(tick_id) FROM replicator.tick)", (by,))

    assert q.tick("q") is None                                 # nothing happened
    conn.execute('INSERT INTO "t" ("v") VALUES (1)')
    conn.execute('INSERT INTO "t" ("v") SELECT g FROM generate_series(1, 100) g')   # one event
    assert q.tick("q") is None                                 # 2 events < max_count, lag not reached
    conn.execute('INSERT INTO "t" ("v") VALUES (3)')
    assert q.tick("q") == first + 1                            # max_count events
    assert q.tick("q") is None

    conn.execute('INSERT INTO "t" ("v") VALUES (4)')
    age_last_tick(timedelta(minutes=9))
    assert q.tick("q") is None                                 # 1 event, lag below max_lag
    age_last_tick(timedelta(minutes=2))
    assert q.tick("q") == first + 2                            # 1 event, lag past max_lag

    age_last_tick(timedelta(minutes=59))
    assert q.tick("q") is None                                 # no event: idle period not over
    age_last_tick(timedelta(minutes=2))
    assert q.tick("q") == first + 3                            # no event, idle period over
    assert q.tick("q") is None
    assert q.tick("q", force=True) == first + 4                # forced


def test_ticker_of_every_queue_ticks_the_queues_that_are_due(conn, q):
    q.create_queue("idle")
    q.tick("q", force=True)
    q.tick("idle", force=True)
    conn.execute("UPDATE replicator.queue SET queue_ticker_max_count = 1, queue_ticker_idle_period = '1 hour'")
    assert q.tick() == 0
    conn.execute('INSERT INTO "t" ("v") VALUES (1)')
    assert q.tick() == 1
    assert [r["last_tick"] for r in q.queues()] == [1, 2]      # ordered by name: idle, q


def test_ticker_refuses_a_snapshot_that_would_be_stale(dsn, q):
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        with pytest.raises(psycopg.errors.RaiseException, match="READ COMMITTED"):
            c.execute("SELECT replicator.ticker('q', true)")


def test_ticker_of_unknown_queue_is_a_clear_error(q):
    with pytest.raises(UserError, match='queue "nope" does not exist'):
        q.tick("nope")


def test_registering_a_consumer_while_a_ticker_holds_the_queue_waits_for_its_tick(dsn, conn, q):
    # A ticker inside a transaction not committed yet holds the queue (the queue has no tick yet).
    with psycopg.connect(dsn, autocommit=True) as ticker:
        ticker.execute("BEGIN")
        assert ticker.execute("SELECT replicator.ticker('q', true)").fetchone()[0] == 1
        result: list = []

        def register() -> None:
            try:
                with psycopg.connect(dsn, autocommit=True) as c:
                    result.append(c.execute("SELECT replicator.register_consumer('q', 'late')").fetchone()[0])
            except BaseException as exc:
                result.append(exc)

        thread = threading.Thread(target=register)
        thread.start()
        _wait_for(lambda: result or conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND query LIKE '%%register_consumer%%'").fetchone()[0] == 1,
            "register_consumer to wait for the ticker's lock")
        ticker.execute("COMMIT")
        thread.join(30)
    assert result == [1]
    assert [(c["consumer_name"], c["last_tick"]) for c in q.consumers()] == [("late", 1)]


def test_ticker_daemon_keeps_retrying_while_the_source_is_unreachable(dsn, q):
    from replicator.shutdown import StopFlag
    from replicator.source import Source
    from replicator.source.jobs import run_ticker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        unreachable = f"host=127.0.0.1 port={s.getsockname()[1]} user=postgres dbname=x connect_timeout=5"
    attempts: list[str] = []
    stop = StopFlag()

    def connect() -> Source:
        """The source is down for the first two attempts, then back."""
        attempts.append("try")
        if len(attempts) <= 2:
            return Source.connect(unreachable)
        stop.set()                                  # one pass on the real source, then stop
        return Source.connect(dsn)

    run_ticker(connect, 0.01, stop)
    assert len(attempts) == 3
    assert q.queues()[0]["last_tick"] == 1          # the reconnected ticker ticked the new queue


@pytest.mark.pg   # a cluster of its own
def test_a_tick_and_what_it_shows_survive_a_crash_under_asynchronous_commit():
    # A cluster whose WAL writer waits 10 s: without the ticker's synchronous commit, a
    # crash right after a tick loses it (and the next tick would reuse its id).
    from pgserver import PgServer
    from replicator.source import Source
    from replicator.source.install import install

    server = PgServer(settings={"wal_writer_delay": "10000ms", "synchronous_commit": "off"})
    server.init().start()
    try:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            install(conn)
            conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
            source = Source(conn)
            source.create_queue("q")
            source.add_table("q", "t")
            first = source.tick("q", force=True)
            conn.execute("INSERT INTO t VALUES (1)")        # committed asynchronously
            tick = source.tick("q", force=True)
            snapshot = conn.execute("SELECT tick_snapshot::text FROM replicator.tick WHERE tick_id = %s",
                                    (tick,)).fetchone()[0]
        server.restart("immediate")
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            assert conn.execute("SELECT tick_snapshot::text FROM replicator.tick WHERE tick_id = %s",
                                (tick,)).fetchone() == (snapshot,)
            assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == 1
            assert conn.execute("SELECT count(*) FROM replicator.event_1 WHERE ev_type = 'I'").fetchone()[0] == 1
            assert Source(conn).tick("q", force=True) == tick + 1 and tick == first + 1
    finally:
        server.stop("immediate")
        import shutil
        shutil.rmtree(server.basedir, ignore_errors=True)


def test_a_role_holding_any_advisory_lock_cannot_stop_the_ticker(dsn, conn, q):
    # ticker() used an advisory key, which any role that may connect can take and hold
    with psycopg.connect(dsn, autocommit=True) as squatter:
        for (queue_id,) in conn.execute("SELECT queue_id FROM replicator.queue").fetchall():
            squatter.execute("SELECT pg_advisory_lock(2026112201, %s)", (queue_id,))
        assert q.tick("q", force=True) is not None


def test_without_event_triggers_a_pass_captures_a_followed_schemas_new_tables_a_chunk_at_a_time(conn, source):
    """Tables created in a followed schema where no event trigger sees it are captured by the ticker's
    passes: thousands at once in one pass would exhaust the server's lock table and stop ticks."""
    drop_event_triggers(conn)
    conn.execute("CREATE OR REPLACE FUNCTION replicator.capture_chunk() RETURNS integer"
                 " LANGUAGE sql IMMUTABLE AS 'SELECT 3'")
    source.create_queue("q")
    conn.execute("CREATE SCHEMA app")
    source.follow_schema("q", "app")
    for n in range(5):
        conn.execute(f"CREATE TABLE app.t{n} (id int PRIMARY KEY)")
    captured = []
    for _ in range(3):
        source.tick()
        captured.append(len(source.tables("q")))
    assert captured == [3, 5, 5]


@pytest.mark.parametrize("event_triggers", [True, False], ids=["event triggers", "no event triggers"])
def test_an_idle_ticker_pass_takes_no_transaction_id_per_captured_table(dsn, conn, source, event_triggers):
    """A pass follows DDL no event trigger saw (replicator.sync_drifted): it locked every captured
    table's record first, a row lock in a subtransaction, that is a transaction id and WAL a table a
    pass (1,002 ids a pass at 1,000 tables: a wraparound VACUUM every few days at one pass a second).
    Now it reads the catalogs first and locks only a table with something to follow."""
    if not event_triggers:
        drop_event_triggers(conn)
    source.create_queue("q")
    tables = 30
    for n in range(tables):
        conn.execute(f"CREATE TABLE t{n} (id int PRIMARY KEY, v text)")
        source.add_table("q", f"t{n}")
    source.tick()
    passes = 5
    before = conn.execute("SELECT txid_current()").fetchone()[0]
    for _ in range(passes):
        source.tick()
    used = conn.execute("SELECT txid_current()").fetchone()[0] - before - 1
    assert used <= 2 * passes, f"{used} transaction ids for {passes} passes over {tables} idle tables"
    conn.execute("ALTER TABLE t7 ADD COLUMN w int")   # and DDL is still followed
    source.tick()
    assert "w" in conn.execute("SELECT table_columns FROM replicator.captured_table WHERE table_name = 't7'").fetchone()[0]
