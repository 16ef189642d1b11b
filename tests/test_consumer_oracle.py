"""The randomized oracle test of the consumer.

Writer threads change the source concurrently (inserts, upserts, updates,
deletes, key changes, TRUNCATE, bulk statements past the 1000-row event split,
transactions spanning several ticks) on a full-mode table of many types, a
composite-key table in another schema, a PK-only table, and a table added to
the queue while everything runs. Meanwhile the real daemons run as
subprocesses: `replicator ticker` and `replicator consume q --target
sqlite:PATH`; the consumer is killed with SIGKILL at random points and
restarted, and the source server itself crashes once (`pg_ctl -m immediate`)
under it - the consumer must reconnect on its own.

Then `--until-caught-up` and every table of the replica is compared with the
source value by value, through an oracle that maps psycopg's Python values to
the SQLite representation independently of replicator's decoders.

Hypothesis draws the writers' seeds and the kill schedule; each example runs
in a database of its own, and three examples keep the test under two minutes,
once with the tables captured by statement and once by row (--capture).
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
import uuid
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

import psycopg
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from psycopg.types.json import Jsonb

from consumer_helpers import (
    Daemon,
    assert_replica_equals_source,
    run_cli_in_process,
    set_fast_ticks,
    sqlite_position,
    wait_until,
)
from pg_helpers import examples, fresh_database
from queue_util import CAPTURE_KINDS

TABLES = [("public.acct", "acct", ["id"]), ("s.items", "s__items", ["a", "b"]),
          ("public.pk_t", "pk_t", ["id"]), ("public.late", "late", ["id"])]

SCHEMA = """
    CREATE SCHEMA s;
    CREATE TABLE acct (id int PRIMARY KEY, owner text, bal numeric(12,2), f float8, r real, flag boolean,
                       ts timestamptz, tsn timestamp, d date, blob bytea, tags text[], doc jsonb, u uuid);
    CREATE TABLE s.items (a int, b text, qty bigint, note text, PRIMARY KEY (a, b));
    CREATE TABLE pk_t (id bigint PRIMARY KEY, v text, n int);
    CREATE TABLE late (id int PRIMARY KEY, v text);
    INSERT INTO acct (id, owner, bal, f) SELECT g, 'seed ' || g, g * 1.25, g / 3.0 FROM generate_series(1, 150) g;
    INSERT INTO s.items SELECT g % 20, 'k' || (g / 20), g, 'seed' FROM generate_series(1, 60) g;
    INSERT INTO pk_t SELECT g, 'seed', 0 FROM generate_series(1, 100) g;
    INSERT INTO late SELECT g, 'before the add' FROM generate_series(1, 50) g;
"""

TEXTS = ["", "plain", "tab\there", "new\nline", "quote'\"", "back\\slash", "\u00fcn\u00efc\u00f8d\u00e9 \u2713",
         "x" * 60, None]


class Values:
    """Random column values with the edge cases the type mapping must keep."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def text(self):
        return self.rng.choice(TEXTS)

    def numeric(self):
        return None if self.rng.random() < 0.1 else Decimal(self.rng.randint(-10**11, 10**11)) / 100

    def double(self):
        return self.rng.choice([None, math.nan, math.inf, -math.inf, 0.0, 1e-300, -2.5e300,
                                self.rng.uniform(-1e6, 1e6), 1.0000000000000002])

    def real(self):
        return self.rng.choice([None, math.nan, math.inf, 0.5, -3.25, 0.1, 1e30])

    def timestamptz(self):
        if self.rng.random() < 0.1:
            return None
        tz = timezone(timedelta(minutes=self.rng.choice([-570, -60, 0, 60, 330, 765])))
        return datetime(self.rng.randint(1990, 2040), self.rng.randint(1, 12), self.rng.randint(1, 28),
                        self.rng.randint(0, 23), self.rng.randint(0, 59), self.rng.randint(0, 59),
                        self.rng.choice([0, 500000, self.rng.randint(0, 999999)]), tzinfo=tz)

    def timestamp(self):
        value = self.timestamptz()
        return None if value is None else value.replace(tzinfo=None)

    def date(self):
        return None if self.rng.random() < 0.1 else date(self.rng.randint(1, 9999), self.rng.randint(1, 12),
                                                         self.rng.randint(1, 28))

    def blob(self):
        return None if self.rng.random() < 0.2 else self.rng.randbytes(self.rng.randint(0, 12))

    def tags(self):
        return None if self.rng.random() < 0.2 else [self.text() for _ in range(self.rng.randint(0, 3))]

    def doc(self):
        if self.rng.random() < 0.2:
            return None
        return Jsonb({"n": self.rng.randint(-10**6, 10**6), "s": self.text(), "ok": self.rng.random() < 0.5,
                      "list": [self.rng.randint(0, 9), None, 0.5], "nested": {"t": self.text()}})

    def uuid(self):
        return None if self.rng.random() < 0.2 else uuid.UUID(int=self.rng.getrandbits(128))

    def acct_row(self, row_id: int) -> tuple:
        return (row_id, self.text(), self.numeric(), self.double(), self.real(), self.rng.choice([True, False, None]),
                self.timestamptz(), self.timestamp(), self.date(), self.blob(), self.tags(), self.doc(), self.uuid())


ACCT_COLUMNS = "id, owner, bal, f, r, flag, ts, tsn, d, blob, tags, doc, u"
ACCT_INSERT = f"INSERT INTO acct ({ACCT_COLUMNS}) VALUES ({', '.join(['%s'] * 13)})"


def random_op(rng: random.Random, values: Values, bulk_base: int):
    """One statement: (sql, params)."""
    kind = rng.choices(
        ["acct insert", "acct upsert", "acct update", "acct update many", "acct delete", "acct key change",
         "acct bulk", "acct truncate", "items insert", "items update", "items delete", "items key change",
         "pk insert", "pk update", "pk delete", "pk key change", "pk truncate", "late write", "late delete"],
        weights=[8, 6, 10, 3, 4, 3, 1, 0.2, 5, 4, 2, 2, 5, 6, 3, 2, 0.2, 6, 2])[0]
    i = rng.randint(1, 300)
    if kind == "acct insert":
        return ACCT_INSERT + " ON CONFLICT DO NOTHING", values.acct_row(i)
    if kind == "acct upsert":
        return (ACCT_INSERT + " ON CONFLICT (id) DO UPDATE SET owner = excluded.owner, bal = excluded.bal,"
                " f = excluded.f, ts = excluded.ts, tags = excluded.tags, doc = excluded.doc"), values.acct_row(i)
    if kind == "acct update":
        return ("UPDATE acct SET bal = %s, f = %s, r = %s, flag = %s, ts = %s, tsn = %s, d = %s, blob = %s,"
                " tags = %s, doc = %s, u = %s WHERE id = %s",
                (values.numeric(), values.double(), values.real(), rng.choice([True, False, None]),
                 values.timestamptz(), values.timestamp(), values.date(), values.blob(), values.tags(),
                 values.doc(), values.uuid(), i))
    if kind == "acct update many":
        return "UPDATE acct SET bal = coalesce(bal, 0) + 1, owner = %s WHERE id %% %s = %s", \
            (values.text(), rng.randint(2, 9), rng.randint(0, 1))
    if kind == "acct delete":
        return "DELETE FROM acct WHERE id = %s OR id BETWEEN %s AND %s", (i, i + 3, i + rng.randint(3, 6))
    if kind == "acct key change":
        return "UPDATE acct SET id = %s WHERE id = %s", (rng.randint(1, 300), i)
    if kind == "acct bulk":   # 1200 rows: two capture events of one statement
        if rng.random() < 0.5:
            return ("INSERT INTO acct (id, owner, bal, f) SELECT g, 'bulk', g, g FROM generate_series(%s::int,"
                    " %s::int) g ON CONFLICT (id) DO UPDATE SET owner = 'bulk again'"), (bulk_base, bulk_base + 1199)
        return "DELETE FROM acct WHERE id >= %s", (bulk_base,)
    if kind == "acct truncate":
        return "TRUNCATE acct", None
    a, b = rng.randint(0, 25), rng.choice(["k0", "k1", "k2", "k3", "tab\tkey", "k\u00e9"])
    if kind == "items insert":
        return ("INSERT INTO s.items VALUES (%s, %s, %s, %s) ON CONFLICT (a, b) DO UPDATE SET qty = s.items.qty + 1",
                (a, b, rng.randint(-2**62, 2**62), values.text()))
    if kind == "items update":
        return "UPDATE s.items SET qty = qty + 1, note = %s WHERE a = %s", (values.text(), a)
    if kind == "items delete":
        return "DELETE FROM s.items WHERE a = %s AND b = %s", (a, b)
    if kind == "items key change":
        return "UPDATE s.items SET b = b || '+' WHERE a = %s AND length(b) < 8", (a,)
    j = rng.randint(1, 250)
    if kind == "pk insert":
        return "INSERT INTO pk_t VALUES (%s, %s, 0) ON CONFLICT DO NOTHING", (j, values.text())
    if kind == "pk update":
        return "UPDATE pk_t SET n = n + 1, v = %s WHERE id IN (%s, %s, %s)", (values.text(), j, j + 7, j * 2)
    if kind == "pk delete":
        return "DELETE FROM pk_t WHERE id = %s", (j,)
    if kind == "pk key change":
        return "UPDATE pk_t SET id = %s WHERE id = %s", (rng.randint(1, 250), j)
    if kind == "pk truncate":
        return "TRUNCATE pk_t", None
    if kind == "late write":
        return ("INSERT INTO late VALUES (%s, %s) ON CONFLICT (id) DO UPDATE SET v = excluded.v",
                (rng.randint(1, 120), values.text()))
    return "DELETE FROM late WHERE id = %s", (rng.randint(1, 120),)


class Writer(threading.Thread):
    """Runs a seeded list of transactions against the source; survives the
    source crashing under it (a transaction cut by the crash is simply lost)."""

    def __init__(self, dsn: str, seed: int, transactions: int, bulk_base: int, errors: list[str]) -> None:
        super().__init__(name=f"writer-{seed}")
        self.dsn, self.seed, self.transactions, self.bulk_base = dsn, seed, transactions, bulk_base
        self.errors = errors
        self.committed = 0
        self.long_committed = 0
        self.aborted = 0
        self.done = 0
        self.watcher: psycopg.Connection | None = None   # reads the latest tick (_latest_tick)

    def connect(self) -> psycopg.Connection:
        deadline = time.monotonic() + 90
        while True:
            try:
                conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=5)
                conn.execute("SET lock_timeout = '5s'")
                return conn
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported by the test
            self.errors.append(f"{self.name}: {type(exc).__name__}: {exc}")

    def _run(self) -> None:
        rng = random.Random(self.seed)
        values = Values(rng)
        conn = self.connect()
        for done in range(1, self.transactions + 1):
            self.done = done
            long = rng.random() < 0.12
            first = [random_op(rng, values, self.bulk_base) for _ in range(rng.randint(1, 4))]
            second = [random_op(rng, values, self.bulk_base) for _ in range(rng.randint(1, 3))] if long else []
            try:
                with conn.transaction():
                    self._ops(conn, first)
                    if long:   # spans ticks: the ticker must tick twice while it is open
                        start = self._latest_tick()
                        deadline = time.monotonic() + 10
                        while self._latest_tick() < start + 2 and time.monotonic() < deadline:
                            time.sleep(0.02)
                        self._ops(conn, second)
                self.committed += 1
                self.long_committed += long
            except (psycopg.errors.DeadlockDetected, psycopg.errors.LockNotAvailable,
                    psycopg.errors.SerializationFailure):
                self.aborted += 1
            except psycopg.OperationalError:
                self.aborted += 1
                if conn.broken or conn.closed:
                    conn = self.connect()
        conn.close()
        if self.watcher is not None:
            self.watcher.close()

    def _latest_tick(self) -> int:
        # Outside the writer's transaction's snapshot: a sequence-like max over committed ticks, on a
        # connection kept for it (made again after the crash), not a new one at each poll.
        if self.watcher is None or self.watcher.broken or self.watcher.closed:
            self.watcher = psycopg.connect(self.dsn, autocommit=True, connect_timeout=5)
        return self.watcher.execute("SELECT coalesce(max(tick_id), 0) FROM replicator.tick").fetchone()[0]

    @staticmethod
    def _ops(conn: psycopg.Connection, ops) -> None:
        for statement, params in ops:
            try:
                with conn.transaction():     # a savepoint: a key collision skips this statement only
                    conn.execute(statement, params)
            except (psycopg.errors.UniqueViolation, psycopg.errors.NumericValueOutOfRange):
                pass


def position(path: Path) -> int:
    return sqlite_position(path) or 0


@pytest.mark.parametrize("capture", CAPTURE_KINDS)
@settings(max_examples=examples(3), deadline=None, phases=[Phase.generate], database=None,
          suppress_health_check=list(HealthCheck))
@given(seeds=st.lists(st.integers(0, 2**32 - 1), min_size=3, max_size=3, unique=True),
       kill_after_ticks=st.lists(st.integers(0, 4), min_size=4, max_size=5),
       add_table_at=st.integers(0, 3), crash_source_at=st.integers(1, 3))
def test_replica_equals_source_after_concurrent_writes_kills_and_a_source_crash(
        pg_server, tmp_path_factory, capture, seeds, kill_after_ticks, add_table_at, crash_source_at):
    # the throwaway cluster runs with synchronous_commit = off: the crash loses the last
    # transactions committed, as in production with that setting; the ticks a replica
    # applied survive it (the ticker commits synchronously)
    with fresh_database(pg_server, "oracle") as dsn:
        run_example(dsn, pg_server, tmp_path_factory.mktemp("oracle"), capture, seeds, kill_after_ticks,
                    add_table_at, crash_source_at)


def run_example(dsn, pg_server, tmp, capture, seeds, kill_after_ticks, add_table_at, crash_source_at) -> None:
    replica = tmp / "replica.db"
    with psycopg.connect(dsn, autocommit=True) as setup:
        setup.execute(SCHEMA)
        setup.execute("SELECT replicator.create_queue('q')")
        setup.execute("SELECT replicator.add_table('q', 'acct', p_capture => %s)", (capture,))
        setup.execute("SELECT replicator.add_table('q', 's.items', p_capture => %s)", (capture,))
        setup.execute("SELECT replicator.add_table('q', 'pk_t', 'pk', p_capture => %s)", (capture,))
        set_fast_ticks(setup, max_lag="50 ms", idle="300 ms", max_count=100)

    consume = ["consume", "q", "--target", f"sqlite:{replica}", "--poll-interval", "0.05"]
    logs: list[Path] = []

    def start_consumer() -> Daemon:
        logs.append(tmp / f"consumer-{len(logs)}.log")
        return Daemon(dsn, *consume, log=logs[-1])

    ticker = Daemon(dsn, "ticker", "--interval", "0.1", log=tmp / "ticker.log")
    consumer = start_consumer()
    errors: list[str] = []
    writers = [Writer(dsn, seed, transactions=80, bulk_base=10000 * (n + 1), errors=errors)
               for n, seed in enumerate(seeds)]
    kills = 0
    crashed = False
    try:
        wait_until(lambda: position(replica) > 0, 60, "the consumer to register and copy",
                   check=lambda: consumer.alive() or fail_with_log(consumer))
        for w in writers:
            w.start()

        for n, ticks in enumerate(kill_after_ticks):
            if n == add_table_at:
                added = run_cli_in_process(dsn, "table", "add", "q", "late", "--capture", capture)
                assert added.returncode == 0, added.stderr
            if n == crash_source_at:
                # Crash the source under a consumer that is connected and applying batches.
                started_at = position(replica)
                wait_until(lambda: "resumes queue" in consumer.log() and position(replica) > started_at, 60,
                           "the consumer to apply a batch", check=lambda: consumer.alive() or fail_with_log(consumer))
                before = position(replica)
                pg_server.restart("immediate")
                crashed = True
                # The same consumer process reconnects by itself and moves on.
                wait_until(lambda: position(replica) > before, 90, "the consumer to resume after the crash",
                           check=lambda: consumer.alive() or fail_with_log(consumer))
            start = position(replica)
            wait_until(lambda: position(replica) >= start + ticks, 60, f"{ticks} more ticks applied",
                       check=lambda: consumer.alive() or fail_with_log(consumer))
            consumer.kill9()
            kills += 1
            consumer = start_consumer()

        for w in writers:
            w.join(180)
            assert not w.is_alive(), f"{w.name} is stuck at transaction {w.done}"
        assert not errors, errors

        # The daemon takes SIGTERM at whatever it is doing and exits 0.
        wait_until(lambda: "resumes queue" in consumer.log(), 60, "the last consumer to start",
                   check=lambda: consumer.alive() or fail_with_log(consumer))
        assert consumer.terminate() == 0, consumer.log()
    finally:
        for w in writers:
            w.join(60) if w.is_alive() else None
        consumer.stop()
        ticker.stop()

    caught_up = run_cli_in_process(dsn, *consume, "--until-caught-up")
    assert caught_up.returncode == 0, caught_up.stderr

    with psycopg.connect(dsn, autocommit=True) as check:
        assert_replica_equals_source(check, replica, TABLES)
        consumer_tick, batch_open = check.execute(
            "SELECT last_tick, batch_open FROM replicator.consumer_info()").fetchone()
        assert (consumer_tick, batch_open) == (sqlite_position(replica), False)
        sizes = {name: check.execute(f"SELECT count(*) FROM {name}").fetchone()[0] for name, _, _ in TABLES}

    # The run proved something: writers committed, long transactions spanned ticks,
    # the consumer was killed and the source crashed while it ran.
    assert kills == len(kill_after_ticks) and crashed
    assert sum(w.committed for w in writers) >= 120, [(w.committed, w.aborted) for w in writers]
    assert sum(w.long_committed for w in writers) >= 1
    assert sizes["public.late"] > 0
    all_logs = "".join(p.read_text(errors="replace") for p in logs)
    assert "Traceback" not in all_logs and "error:" not in all_logs, all_logs[-3000:]
    assert "source unavailable" in all_logs     # the crash was seen and survived
    print(json.dumps({"seeds": seeds, "kills": kill_after_ticks, "add_at": add_table_at,
                      "crash_at": crash_source_at, "rows": sizes,
                      "committed": [w.committed for w in writers], "aborted": [w.aborted for w in writers]}))


def fail_with_log(daemon: Daemon) -> bool:
    raise AssertionError(f"consumer exited with {daemon.proc.returncode}:\n{daemon.log()[-3000:]}")
