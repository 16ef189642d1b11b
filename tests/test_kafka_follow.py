"""Followers of a Kafka publisher: `replicator consume --source kafka://BROKERS/PREFIX --target ...`.

A publisher (`replicator consume q --target kafka://BROKERS/PREFIX`) turns queue q into topics;
followers apply them to targets of their own. Everything is real: a PostgreSQL source, the
session's Kafka broker (or a broker of the test's own, to restart), the `replicator` console
script run as subprocesses, SQLite files, Delta tables read with delta-rs, JSON-lines files.
Followers run with a DSN that reaches no database: they never need the source.

1. The randomized oracle: concurrent writes and schema changes; a follower (a daemon killed once,
   then a new one bootstrapping) equals the source and a direct consumer's replica of the queue.
2. Kill -9 of a follower applying big batches: restarted, it equals the source, nothing twice.
3. A new follower bootstraps from topics Kafka has really compacted, with the source database gone.
4. --tables: only the topics of the tables named, a table followed through a rename, a later run
   that leaves a followed table out refused.
5. Followers into delta: and jsonl: targets.
6. A broker restart under a follower daemon.
7. The follower's lag metrics and /health.
8. Bad command lines: one line, exit 1.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import re
import sqlite3
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, ResourceType
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from psycopg import sql
from psycopg.types.json import Jsonb

from consumer_helpers import (
    Daemon,
    assert_replica_equals_source,
    forced_tick,
    run_cli,
    set_fast_ticks,
    sqlite_reader,
    wait_until,
)
from ddl_helpers import StreamReplay, assert_stream_equals_source, attnums, stream_lines
from kafka_helpers import FETCH_WAIT, Record, last_commit, read_committed, replay, replaying
from kafkaserver import KafkaServer
from pg_helpers import execute_retrying_deadlocks, fresh_database
from replicator.follower.follower import Follower
from replicator.structure import target_table_name
from replicator.targets import open_target
from replicator.targets.delta.reader import table_uris
from replicator.targets.kafka.settings import parse_url
from replicator.targets.kafka.topics import state_topic, table_topic
from test_kafka_publish import source_rows

# A follower needs no source: every one runs with a DSN that reaches no database.
NO_SOURCE = "host=127.0.0.1 port=9 dbname=no_source_for_followers user=nobody connect_timeout=1"


# running publishers and followers -----------------------------------------------------------

def url_of(server: KafkaServer, prefix: str) -> str:
    return f"kafka://{server.bootstrap}/{prefix}"


def publish(dsn: str, url: str) -> None:
    """Publishes what queue q holds now (`consume q --target URL --until-caught-up`)."""
    done = run_cli(dsn, "consume", "q", "--target", url, "--until-caught-up", timeout=180)
    assert done.returncode == 0, done.stderr


def follow(url: str, target: str, *args: str, dsn: str = NO_SOURCE) -> subprocess.CompletedProcess[str]:
    """`replicator consume --source URL --target TARGET ARGS`, run to its end."""
    return run_cli(dsn, "consume", "--source", url, "--target", target, *args, timeout=180)


def follow_all(url: str, target: str, *args: str, dsn: str = NO_SOURCE) -> None:
    """A follower applies everything committed to Kafka before it started."""
    done = follow(url, target, "--until-caught-up", *args, dsn=dsn)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def follower_daemon(url: str, target: str, log: Path, *args: str) -> Daemon:
    return Daemon(NO_SOURCE, "consume", "--source", url, "--target", target, "--poll-interval", "0.05", *args, log=log)


def follower_positions(path: Path, prefix: str) -> dict[str, int]:
    """What a follower stored in its SQLite target: TOPIC:PARTITION → the next offset, "tick" and "commit"."""
    if not path.exists():
        return {}
    db = sqlite_reader(path)
    try:
        return dict(db.execute("SELECT consumer, last_tick FROM _replicator_position WHERE queue = ?",
                               (f"kafka:{prefix}",)).fetchall())
    except sqlite3.OperationalError:   # not a replica yet
        return {}
    finally:
        db.close()


def alive(daemon: Daemon) -> None:
    assert daemon.alive(), daemon.log()[-3000:]


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one line a command a user got wrong prints (exit status 1, no traceback)."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


# the source and the replicas ----------------------------------------------------------------

def captured(conn: psycopg.Connection) -> list[tuple[str, str, list[str]]]:
    """(schema.table, its replica table, its key) of each table queue q captures."""
    return [(name, target_table_name(*name.split(".", 1)), key) for name, key in conn.execute(
        "SELECT table_name, key FROM replicator.table_info('q') ORDER BY 1").fetchall()]


def assert_follower_equals_source(conn: psycopg.Connection, path: Path) -> None:
    """Every captured table, value by value, and no other table in the replica; the row counts
    equal the source's (a row applied twice would be one more)."""
    tables = captured(conn)
    assert sorted(sqlite_contents(path)) == sorted(replica for _, replica, _ in tables)
    assert_replica_equals_source(conn, path, tables)
    db = sqlite_reader(path)
    try:
        for name, replica, _ in tables:
            schema, table = name.split(".", 1)
            want = conn.execute(sql.SQL("SELECT count(*) FROM {}.{}").format(sql.Identifier(schema),
                                                                              sql.Identifier(table))).fetchone()[0]
            assert db.execute(f'SELECT count(*) FROM "{replica}"').fetchone()[0] == want, name
    finally:
        db.close()


Contents = dict[str, tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]]


def sqlite_contents(path: Path) -> Contents:
    """Each replica table of a SQLite file (not replicator's own): its columns (name, declared type,
    place in the key) and its rows, each value with its storage class (typeof), sorted."""
    db = sqlite_reader(path)
    try:
        names = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'"
                                          " AND name NOT LIKE '\\_replicator%' ESCAPE '\\' ORDER BY name")]
        contents = {}
        for name in names:
            columns = [(r[1], r[2], r[5]) for r in db.execute(f'PRAGMA table_info("{name}")')]
            typed = ", ".join(f'typeof("{c}"), "{c}"' for c, _, _ in columns)
            contents[name] = (columns, sorted(db.execute(f'SELECT {typed} FROM "{name}"').fetchall(), key=repr))
        return contents
    finally:
        db.close()


def assert_same_replicas(follower: Path, direct: Path) -> None:
    """A follower's SQLite replica and a direct consumer's: the same tables, columns, values and
    storage classes."""
    got, want = sqlite_contents(follower), sqlite_contents(direct)
    assert sorted(got) == sorted(want), "tables differ"
    problems = []
    for table, (columns, rows) in want.items():
        if got[table][0] != columns:
            problems.append(f"{table}: columns {got[table][0]}, the direct consumer's {columns}")
            continue
        extra, missing = Counter(got[table][1]) - Counter(rows), Counter(rows) - Counter(got[table][1])
        problems += [f"{table}: only the follower has {row}" for row in extra]
        problems += [f"{table}: only the direct consumer has {row}" for row in missing]
    assert not problems, f"{len(problems)} differences:\n" + "\n".join(problems[:30])


class Metrics:
    """The metrics and /health a daemon started with --metrics-port 0 serves, at the port it logged."""

    def __init__(self, daemon: Daemon) -> None:
        found = wait_until(lambda: re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", daemon.log()), 60,
                           "the metrics port in the log", check=lambda: alive(daemon))
        self.url = f"http://127.0.0.1:{found.group(1)}"

    def value(self, name: str, **labels: str) -> float | None:
        """The sample's value, None while the daemon does not export it."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            text = response.read().decode()
        for line in text.splitlines():
            sample, _, value = line.rpartition(" ")
            found_name, _, found_labels = sample.partition("{")
            if found_name == name and all(f'{k}="{v}"' in found_labels for k, v in labels.items()):
                return float(value)
        return None

    def health(self) -> tuple[int, dict[str, Any]]:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())


# 1. the randomized oracle ----------------------------------------------------------------------------

ORACLE_SCHEMA = """
    CREATE SCHEMA s;
    CREATE TABLE acct (id int PRIMARY KEY, owner text, bal numeric(12,2), f float8, r real, flag boolean,
                       ts timestamptz, tsn timestamp, d date, blob bytea, tags text[], doc jsonb, u uuid,
                       cnt int NOT NULL DEFAULT 0);
    CREATE TABLE s.items (a int, b text, qty bigint, note text, PRIMARY KEY (a, b));
    CREATE TABLE pk_t (id bigint PRIMARY KEY, v text, n int NOT NULL DEFAULT 0);
    CREATE TABLE bag (a int NOT NULL, b text, c text);
    CREATE TABLE ren (id int PRIMARY KEY, a int);
    CREATE TABLE s.gone (id int PRIMARY KEY, a int);
    INSERT INTO acct (id, owner, bal, f, ts) SELECT g, 'seed ' || g, g * 1.25, g / 3.0,
        '2024-01-01 00:00+02'::timestamptz + g * interval '1 hour' FROM generate_series(1, 150) g;
    INSERT INTO s.items SELECT g % 20, 'k' || (g / 20), g, 'seed' FROM generate_series(1, 60) g;
    INSERT INTO pk_t SELECT g, 'seed', 0 FROM generate_series(1, 100) g;
    INSERT INTO bag SELECT g, CASE WHEN g % 2 = 0 THEN 'b' || g END, 'seed' FROM generate_series(1, 80) g;
    INSERT INTO ren SELECT g, g FROM generate_series(1, 40) g;
    INSERT INTO s.gone SELECT g, g FROM generate_series(1, 40) g;
"""
# bag is keyed by (a, b), b nullable: SQLite never finds a NULL key taken, so a row applied twice
# would be two rows
ORACLE_DDL = {
    "add column": ["ALTER TABLE acct ADD COLUMN extra text", "UPDATE acct SET extra = 'e' || id WHERE id % 5 = 0"],
    "drop column": ["ALTER TABLE acct DROP COLUMN blob"],
    "rename column": ["ALTER TABLE s.items RENAME COLUMN note TO memo"],
    "type change": ["ALTER TABLE pk_t ALTER COLUMN n TYPE numeric(20,0)"],   # rewrites: copied again
    "rename table": ["ALTER TABLE ren RENAME TO ren2"],
    "drop table": ["DROP TABLE s.gone"],
    "create table": ["CREATE TABLE s.fresh (id int PRIMARY KEY, v text)",   # s is followed: captured at once
                     "INSERT INTO s.fresh SELECT g, 'f' || g FROM generate_series(1, 30) g"],
}
TEXTS = ["", "plain", "tab\there", "new\nline", "quote'\"", "\u00fcn\u00efc\u00f8d\u00e9 \u2713", None]


def _timestamptz(rng: random.Random) -> datetime | None:
    if rng.random() < 0.1:
        return None
    tz = timezone(timedelta(minutes=rng.choice([-570, 0, 60, 330])))
    return datetime(rng.randint(1970, 2040), rng.randint(1, 12), rng.randint(1, 28), rng.randint(0, 23),
                    rng.randint(0, 59), rng.randint(0, 59), rng.choice([0, rng.randint(0, 999999)]), tzinfo=tz)


def _acct_row(rng: random.Random, row_id: int) -> tuple[Any, ...]:
    ts = _timestamptz(rng)
    return (row_id, rng.choice(TEXTS), rng.choice([None, Decimal(rng.randint(-10**11, 10**11)) / 100]),
            rng.choice([None, math.nan, math.inf, -math.inf, 0.0, rng.uniform(-1e6, 1e6), 1e-300]),
            rng.choice([None, math.nan, 0.1, -3.25, 1e30]), rng.choice([True, False, None]), ts,
            None if ts is None else ts.replace(tzinfo=None),
            rng.choice([None, date(rng.randint(1, 9999), rng.randint(1, 12), rng.randint(1, 28))]),
            rng.choice([None, [], [rng.choice(TEXTS), "b"]]),
            rng.choice([None, Jsonb({"n": rng.randint(-99, 99), "s": rng.choice(TEXTS[:-1]), "x": [1.5, None, True]})]),
            rng.choice([None, uuid.UUID(int=rng.getrandbits(128))]))


def _oracle_statement(rng: random.Random) -> tuple[str, Any]:
    """One statement of the workload: (SQL, parameters). `ren` and `s.gone` are {ren} and {gone}, which
    the writer names by oid (a RENAME does not stop it; after the DROP it skips them)."""
    kind = rng.choices(
        ["acct upsert", "acct update", "acct blob", "acct delete", "acct key", "acct many", "acct truncate",
         "items upsert", "items update", "items delete", "items key", "pk insert", "pk update", "pk delete",
         "pk key", "bag insert", "bag update", "bag delete", "bag key", "ren write", "ren delete", "gone write",
         "fresh write"],
        weights=[8, 8, 2, 3, 2, 1, 0.5, 5, 4, 2, 2, 4, 5, 2, 2, 4, 3, 2, 1, 3, 1, 2, 2])[0]
    i = rng.randint(1, 250)
    if kind == "acct upsert":
        return ("INSERT INTO acct (id, owner, bal, f, r, flag, ts, tsn, d, tags, doc, u) VALUES (%s, %s, %s, %s,"
                " %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (id) DO UPDATE SET owner = excluded.owner,"
                " bal = excluded.bal, f = excluded.f, r = excluded.r, ts = excluded.ts, tags = excluded.tags,"
                " doc = excluded.doc, cnt = acct.cnt + 1", _acct_row(rng, i))
    if kind == "acct update":
        return "UPDATE acct SET cnt = cnt + 1, owner = %s, flag = %s WHERE id = %s", (rng.choice(TEXTS),
                                                                                     rng.choice([True, None]), i)
    if kind == "acct blob":
        return "UPDATE acct SET blob = %s WHERE id = %s", (rng.randbytes(rng.randint(0, 9)), i)
    if kind == "acct delete":
        return "DELETE FROM acct WHERE id BETWEEN %s AND %s", (i, i + rng.randint(0, 3))
    if kind == "acct key":
        return "UPDATE acct SET id = %s WHERE id = %s", (rng.randint(1, 250), i)
    if kind == "acct many":
        return "UPDATE acct SET cnt = cnt + 1 WHERE id %% 7 = %s", (rng.randint(0, 6),)
    if kind == "acct truncate":   # and seeded again: the table keeps rows of every kind
        return ("TRUNCATE acct; INSERT INTO acct (id, owner, bal, f, ts) SELECT g, 'again ' || g, g * 0.75, g / 7.0,"
                " now() FROM generate_series(1, 120) g"), None
    a, b = rng.randint(0, 20), rng.choice(["k0", "k1", "k2", "tab\tk", "k\u00e9"])
    if kind == "items upsert":
        return ("INSERT INTO s.items (a, b, qty) VALUES (%s, %s, %s) ON CONFLICT (a, b) DO UPDATE"
                " SET qty = s.items.qty + 1", (a, b, rng.randint(-2**62, 2**62)))
    if kind == "items update":
        return "UPDATE s.items SET qty = qty + 1, note = %s WHERE a = %s", (rng.choice(TEXTS), a)
    if kind == "items delete":
        return "DELETE FROM s.items WHERE a = %s AND b = %s", (a, b)
    if kind == "items key":
        return "UPDATE s.items SET b = b || '+' WHERE a = %s AND length(b) < 6", (a,)
    if kind == "pk insert":
        return "INSERT INTO pk_t VALUES (%s, %s, 0) ON CONFLICT DO NOTHING", (i, rng.choice(TEXTS))
    if kind == "pk update":
        return "UPDATE pk_t SET n = n + 1, v = %s WHERE id IN (%s, %s)", (rng.choice(TEXTS), i, i * 2)
    if kind == "pk delete":
        return "DELETE FROM pk_t WHERE id = %s", (i,)
    if kind == "pk key":
        return "UPDATE pk_t SET id = %s WHERE id = %s", (rng.randint(1, 250), i)
    if kind == "bag insert":   # a NULL b now and then: rows with a NULL in their key
        return "INSERT INTO bag VALUES (%s, %s, 'new')", (rng.randint(1000, 10**9), rng.choice([None, f"b{i}"]))
    if kind == "bag update":
        return "UPDATE bag SET c = %s WHERE a %% 9 = %s", (rng.choice(TEXTS), rng.randint(0, 8))
    if kind == "bag delete":
        return "DELETE FROM bag WHERE a = %s", (i,)
    if kind == "bag key":
        return "UPDATE bag SET b = coalesce(b, 'was null') || '+' WHERE a = %s", (i,)
    if kind == "ren delete":
        return "DELETE FROM {ren} WHERE id = %s", (rng.randint(1, 60),)
    if kind in ("ren write", "gone write"):
        table = "{ren}" if kind == "ren write" else "{gone}"
        return (f"INSERT INTO {table} VALUES (%s, %s) ON CONFLICT (id) DO UPDATE SET a = excluded.a",
                (rng.randint(1, 60), rng.randint(0, 999)))
    return ("INSERT INTO s.fresh VALUES (%s, %s) ON CONFLICT (id) DO UPDATE SET v = excluded.v",
            (rng.randint(1, 60), rng.choice(TEXTS)))


class OracleWriter(threading.Thread):
    """Seeded transactions of 1-4 statements; a statement a schema change made invalid, or that collides
    with a key, is skipped (a savepoint); a deadlock aborts its transaction. Now and then a transaction
    stays open across two ticks."""

    def __init__(self, dsn: str, seed: str, transactions: int, tables_by_oid: dict[str, int]) -> None:
        super().__init__(name=f"writer-{seed}")
        self.dsn, self.rng, self.transactions, self.tables_by_oid = dsn, random.Random(seed), transactions, tables_by_oid
        self.started = threading.Event()
        self.committed = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn, \
                    psycopg.connect(self.dsn, autocommit=True) as ticks:
                conn.execute("SET lock_timeout = '5s'")
                for _ in range(self.transactions):
                    self._transaction(conn, ticks)
                    self.started.set()
        except BaseException as exc:   # reported by the test
            self.error = exc
        finally:
            self.started.set()

    def _transaction(self, conn: psycopg.Connection, ticks: psycopg.Connection) -> None:
        statements = [_oracle_statement(self.rng) for _ in range(self.rng.randint(1, 4))]
        spans_ticks = self.rng.random() < 0.1
        with contextlib.suppress(psycopg.errors.DeadlockDetected, psycopg.errors.LockNotAvailable):
            with conn.transaction():
                for n, (statement, params) in enumerate(statements):
                    if spans_ticks and n == len(statements) // 2:
                        start = _latest_tick(ticks)
                        wait_until(lambda: _latest_tick(ticks) >= start + 2, 30, "two ticks")
                    if placeholder := re.search(r"\{(\w+)\}", statement):
                        table = conn.execute("SELECT oid::regclass::text FROM pg_class WHERE oid = %s",
                                             (self.tables_by_oid[placeholder[1]],)).fetchone()
                        if table is None:   # dropped
                            continue
                        statement = statement.replace(placeholder[0], table[0])
                    with contextlib.suppress(psycopg.errors.UniqueViolation, psycopg.errors.UndefinedColumn,
                                             psycopg.errors.UndefinedTable), conn.transaction():
                        conn.execute(statement, params)
            self.committed += 1


def _latest_tick(conn: psycopg.Connection) -> int:
    return conn.execute("SELECT coalesce(max(tick_id), 0) FROM replicator.tick").fetchone()[0]


@settings(max_examples=2, deadline=None, phases=[Phase.generate], database=None,
          suppress_health_check=list(HealthCheck))
@given(seeds=st.lists(st.integers(0, 2**32 - 1), min_size=2, max_size=2, unique=True),
       ddl_order=st.permutations(sorted(ORACLE_DDL)), kill_at=st.integers(0, len(ORACLE_DDL) - 1))
def test_followers_equal_the_source_and_a_direct_consumer_after_concurrent_writes_and_schema_changes(
        pg_server: Any, kafka: KafkaServer, kafka_prefix: str, tmp_path_factory: pytest.TempPathFactory,
        seeds: list[int], ddl_order: list[str], kill_at: int) -> None:
    with fresh_database(pg_server, "kfollow") as dsn:
        _oracle_example(dsn, url_of(kafka, f"{kafka_prefix}_{uuid.uuid4().hex[:6]}"),
                        tmp_path_factory.mktemp("oracle"), seeds, ddl_order, kill_at)


def _oracle_example(dsn: str, url: str, tmp: Path, seeds: list[int], ddl_order: list[str], kill_at: int) -> None:
    live, direct, fresh = tmp / "live.db", tmp / "direct.db", tmp / "fresh.db"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(ORACLE_SCHEMA)
        conn.execute("SELECT replicator.create_queue('q')")
        for table, mode, key in [("acct", "full", None), ("pk_t", "pk", None), ("bag", "full", ["a", "b"]),
                                 ("ren", "full", None)]:
            conn.execute("SELECT replicator.add_table('q', %s, %s, %s)", (table, mode, key))
        conn.execute("SELECT replicator.follow_schema('q', 's', 'full')")
        set_fast_ticks(conn, max_lag="50 ms", idle="300 ms", max_count=50)
        tables_by_oid = {name: conn.execute("SELECT %s::regclass::oid", (table,)).fetchone()[0]
                         for name, table in (("ren", "ren"), ("gone", "s.gone"))}
        registered = run_cli(dsn, "consume", "q", "--target", f"sqlite:{direct}", "--until-caught-up")
        assert registered.returncode == 0, registered.stderr

        ticker = Daemon(dsn, "ticker", "--interval", "0.1", log=tmp / "ticker.log")
        publisher = Daemon(dsn, "consume", "q", "--target", url, "--poll-interval", "0.05", log=tmp / "publisher.log")
        logs: list[Path] = []

        def start_follower() -> Daemon:
            logs.append(tmp / f"follower-{len(logs)}.log")
            return follower_daemon(url, f"sqlite:{live}", logs[-1])

        follower = start_follower()
        try:
            # every table copied first (a consumer copying a table dropped meanwhile fails, publisher or not)
            wait_until(lambda: live.exists() and len(sqlite_contents(live)) == 6, 120, "the follower to hold the copies",
                       check=lambda: (alive(follower), alive(publisher)))
            for phase, name in enumerate(ddl_order):
                writers = [OracleWriter(dsn, f"{seed}/{phase}", 10, tables_by_oid) for seed in seeds]
                for w in writers:
                    w.start()
                for w in writers:   # the schema change amid the writes
                    w.started.wait(60)
                execute_retrying_deadlocks(conn, ORACLE_DDL[name])
                if phase == kill_at:   # whatever it is applying
                    assert follower.kill9() == -9
                    follower = start_follower()
                for w in writers:
                    w.join(120)
                    assert not w.is_alive() and w.error is None, w.error
            alive(publisher)
            assert publisher.terminate() == 0, publisher.log()
            # a follower SIGTERMed before its start installed its handler dies of the signal: the one
            # restarted last terminates once it applied all the publisher committed
            bootstrap, _, prefix = url.removeprefix("kafka://").partition("/")
            published = (last_commit(bootstrap, prefix) or {}).get("commit", 0)
            wait_until(lambda: follower_positions(live, prefix).get("commit", 0) >= published, 120,
                       f"the follower to apply commit {published}", check=lambda: alive(follower))
            assert follower.terminate() == 0, follower.log()
        finally:
            for daemon in (follower, publisher, ticker):
                daemon.stop()

        publish(dsn, url)
        caught_up = run_cli(dsn, "consume", "q", "--target", f"sqlite:{direct}", "--until-caught-up")
        assert caught_up.returncode == 0, caught_up.stderr
        follow_all(url, f"sqlite:{live}")   # the daemon's target, to the end of the topics
        follow_all(url, f"sqlite:{fresh}")  # a new follower, from the topics alone

        assert_follower_equals_source(conn, live)
        assert_same_replicas(live, direct)
        assert_same_replicas(fresh, direct)
        assert {"ren2", "s__fresh"} <= set(sqlite_contents(live)) and "s__gone" not in sqlite_contents(live)
        all_logs = "".join(p.read_text() for p in logs)
        assert "Traceback" not in all_logs and "error" not in all_logs, all_logs[-3000:]
        print(json.dumps({"seeds": seeds, "ddl": ddl_order, "kill_at": kill_at,
                          "rows": {name: len(rows) for name, (_, rows) in sqlite_contents(live).items()}}))


# 2. kill -9 ------------------------------------------------------------------------------------------

KILL_SCHEMA = """
    CREATE TABLE bag (a int NOT NULL, b text, c text);
    CREATE TABLE big (id int PRIMARY KEY, v text, n int NOT NULL DEFAULT 0);
    INSERT INTO bag SELECT g, CASE WHEN g % 2 = 0 THEN 'b' || g END, 'seed' FROM generate_series(1, 10000) g;
    INSERT INTO big SELECT g, 'v' || g, 0 FROM generate_series(1, 10000) g;
"""


class BigBatches(threading.Thread):
    """Transactions of some 8,000 row changes each, one a tick (a batch, a Kafka transaction), until
    stopped: updates of half of big and of a quarter of bag, rows added to bag (a third with a NULL in
    their key), a few deletes. Each waits for the publisher to publish the one before, and for the
    follower to apply (applied(): the tick it holds) the one before that: it is kept busy, never far
    behind."""

    def __init__(self, dsn: str, applied: Callable[[], int]) -> None:
        super().__init__(name="big batches")
        self.dsn = dsn
        self.applied = applied
        self.stopped = threading.Event()
        self.rounds = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                ticks: list[int] = []
                while not self.stopped.is_set():
                    r = self.rounds
                    with conn.transaction():
                        conn.execute("UPDATE big SET n = n + 1 WHERE id %% 2 = %s", (r % 2,))
                        conn.execute("INSERT INTO bag SELECT g, CASE WHEN g %% 3 <> 0 THEN 'r' || g END, 'new'"
                                     " FROM generate_series(%s, %s) g", (100000 + r * 200, 100199 + r * 200))
                        conn.execute("UPDATE bag SET c = %s WHERE a %% 4 = %s", (f"round {r}", r % 4))
                        conn.execute("DELETE FROM big WHERE id %% 101 = %s", (r % 101,))
                    self.rounds += 1
                    ticks.append(forced_tick(conn))
                    wait_until(lambda: self.stopped.is_set() or conn.execute(
                        "SELECT min(last_tick) FROM replicator.consumer_info()").fetchone()[0] >= ticks[-1], 120,
                        "the publisher to publish the round")
                    wait_until(lambda: self.stopped.is_set() or len(ticks) < 2 or self.applied() >= ticks[-2], 120,
                               "the follower to apply the round before")
        except BaseException as exc:   # reported by the test
            self.error = exc


def writes_since(path: Path, start_ns: int) -> bool:
    """Whether the SQLite file's WAL was written since then."""
    wal = path.with_name(path.name + "-wal")
    return wal.exists() and wal.stat().st_mtime_ns > start_ns


def bytes_written(daemon: Daemon) -> int:
    """What the process has written so far (its SQLite pages, its log)."""
    for line in Path(f"/proc/{daemon.pid}/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError("no wchar in /proc/PID/io")


@settings(max_examples=2, deadline=None, phases=[Phase.generate], database=None,
          suppress_health_check=list(HealthCheck))
@given(kill_after=st.lists(st.integers(0, 1_500_000), min_size=3, max_size=3))
def test_a_follower_killed_while_it_applies_big_batches_then_restarted_applies_each_change_once(
        pg_server: Any, kafka: KafkaServer, kafka_prefix: str, tmp_path_factory: pytest.TempPathFactory,
        kill_after: list[int]) -> None:
    tmp = tmp_path_factory.mktemp("kill")
    url = url_of(kafka, f"{kafka_prefix}_{uuid.uuid4().hex[:6]}")
    prefix = url.rpartition("/")[2]
    path = tmp / "follower.db"
    with fresh_database(pg_server, "kfollow") as dsn, psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(KILL_SCHEMA)
        conn.execute("SELECT replicator.create_queue('q')")
        conn.execute("SELECT replicator.add_table('q', 'big')")
        # keyed by (a, b), b nullable: SQLite never finds a NULL key taken, so a row applied twice is two rows
        conn.execute("SELECT replicator.add_table('q', 'bag', 'full', '{a,b}')")
        publisher = Daemon(dsn, "consume", "q", "--target", url, "--poll-interval", "0.05", log=tmp / "publisher.log")
        writer = BigBatches(dsn, lambda: follower_positions(path, prefix).get("tick", 0))
        logs = [tmp / "follower-0.log"]
        started = time.time_ns()
        follower = follower_daemon(url, f"sqlite:{path}", logs[-1])
        ticks_at_kills = []
        try:
            wait_until(lambda: conn.execute("SELECT count(*) FROM replicator.consumer_info()").fetchone()[0], 60,
                       "the publisher to register", check=lambda: alive(publisher))
            writer.start()
            for threshold in kill_after:
                # a point of its work: once it has written that many bytes more after its first write to the
                # target, whatever it is doing
                wait_until(lambda: writes_since(path, started), 120, "the follower to write its target",
                           check=lambda: (alive(follower), alive(publisher)))
                goal = bytes_written(follower) + threshold
                wait_until(lambda: bytes_written(follower) >= goal, 120, f"the follower to write {threshold} bytes",
                           check=lambda: (alive(follower), alive(publisher)))
                assert follower.kill9() == -9
                ticks_at_kills.append(follower_positions(path, prefix).get("tick", 0))
                logs.append(tmp / f"follower-{len(logs)}.log")
                started = time.time_ns()
                follower = follower_daemon(url, f"sqlite:{path}", logs[-1])
            wait_until(lambda: follower_positions(path, prefix).get("tick", 0) > ticks_at_kills[-1], 120,
                       "the last follower to go on", check=lambda: alive(follower))
            # the kills fell among several rounds of big batches (a loaded machine may be slower to make them)
            wait_until(lambda: writer.rounds >= 3 or writer.error, 300, "the writer's third round")
            writer.stopped.set()
            writer.join(60)
            assert writer.error is None, writer.error
            assert publisher.terminate() == 0, publisher.log()
            assert follower.terminate() == 0, follower.log()
        finally:
            writer.stopped.set()
            for daemon in (follower, publisher):
                daemon.stop()
        publish(dsn, url)
        follow_all(url, f"sqlite:{path}")
        assert_follower_equals_source(conn, path)
        assert ticks_at_kills == sorted(ticks_at_kills)
        all_logs = "".join(p.read_text() for p in logs)
        assert "Traceback" not in all_logs and "error" not in all_logs, all_logs[-3000:]
        print(json.dumps({"kill_after": kill_after, "ticks_at_kills": ticks_at_kills, "rounds": writer.rounds}))


# 3. bootstrap from compacted topics ------------------------------------------------------------------

COMPACTED = {"segment.ms": "100", "min.cleanable.dirty.ratio": "0.01", "delete.retention.ms": "0"}


def count_records(bootstrap: str, topic: str) -> int:
    """The committed records partition 0 of the topic holds now, from its start to its end."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"counter-{uuid.uuid4()}",
                         "enable.auto.commit": False, "isolation.level": "read_committed",
                         "enable.partition.eof": True, **FETCH_WAIT})
    try:
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        count = 0
        while True:
            message = consumer.poll(30)
            assert message is not None, f"no end of {topic} within 30s"
            error = message.error()
            if error is not None:
                if error.code() == error._PARTITION_EOF:
                    return count
                raise KafkaException(error)
            count += 1
    finally:
        consumer.close()


def compact(bootstrap: str, topics: list[str]) -> None:
    """Sets the topics to be cleaned as soon as Kafka may: a segment every 100 ms, cleaned once 1% of it
    is overwritten, tombstones dropped at the first cleaning."""
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 3})
    resources = [ConfigResource(ResourceType.TOPIC, topic, incremental_configs=[
        ConfigEntry(name, value, incremental_operation=AlterConfigOpType.SET) for name, value in COMPACTED.items()])
        for topic in topics]
    for future in admin.incremental_alter_configs(resources).values():
        future.result(30)


def publish_until_cleaned(dsn: str, url: str, bootstrap: str, topics: list[str], rolls: list[str], log: Path,
                          cleaned: Callable[[dict[str, int]], bool]) -> dict[str, int]:
    """Compacts the topics (compact()), then publishes the `rolls` statements again and again (new records
    roll the segments: only closed ones are cleaned) until cleaned(the topics' record counts); returns
    those counts. Everything is published when it returns."""
    compact(bootstrap, topics)
    with psycopg.connect(dsn, autocommit=True) as conn:
        set_fast_ticks(conn)
        ticker = Daemon(dsn, "ticker", "--interval", "0.1", log=log.with_suffix(".ticker.log"))
        publisher = Daemon(dsn, "consume", "q", "--target", url, "--poll-interval", "0.05", log=log)
        try:
            def counts() -> dict[str, int] | None:
                for statement in rolls:
                    conn.execute(statement)
                alive(publisher)
                now = {topic: count_records(bootstrap, topic) for topic in topics}
                return now if cleaned(now) else None

            after: dict[str, int] = wait_until(counts, 120, f"Kafka to clean {topics}", interval=0.5)
            forced_tick(conn)
            assert publisher.terminate() == 0, publisher.log()
        finally:
            publisher.stop()
            ticker.stop()
    publish(dsn, url)
    return after


@contextlib.contextmanager
def database_moved_away(pg_server: Any, dsn: str) -> Iterator[None]:
    """The database of dsn renamed while in the block: a client of dsn finds no such database."""
    name = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    with psycopg.connect(pg_server.dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
        admin.execute(sql.SQL("ALTER DATABASE {} RENAME TO {}").format(sql.Identifier(name),
                                                                        sql.Identifier(f"{name}_away")))
        try:
            yield
        finally:
            admin.execute(sql.SQL("ALTER DATABASE {} RENAME TO {}").format(sql.Identifier(f"{name}_away"),
                                                                            sql.Identifier(name)))


BOOTSTRAP_SCHEMA = """
    CREATE TABLE t (id int PRIMARY KEY, v text, n int NOT NULL DEFAULT 0);
    CREATE TABLE u (k text PRIMARY KEY, v text);
    INSERT INTO t SELECT g, 'v' || g, 0 FROM generate_series(1, 2000) g;
    INSERT INTO u SELECT 'k' || g, 'seed' FROM generate_series(1, 300) g;
"""
BOOTSTRAP_HISTORY = [
    ["UPDATE t SET n = n + 1", "UPDATE t SET n = n + 1, v = v || '+'"],
    ["DELETE FROM t WHERE id % 4 = 0", "UPDATE t SET id = id + 10000 WHERE id % 10 = 1"],
    ["TRUNCATE u", "INSERT INTO u SELECT 'k' || g, 'after the truncate' FROM generate_series(1, 100) g"],
    ["ALTER TABLE t ADD COLUMN note text", "UPDATE t SET note = 'n' || id WHERE id % 7 = 0", "UPDATE t SET n = n + 1"],
]


def test_a_new_follower_bootstraps_from_topics_kafka_compacted_and_never_touches_the_source(
        pg_server: Any, dsn: str, kafka: KafkaServer, kafka_prefix: str, tmp_path: Path) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(BOOTSTRAP_SCHEMA)
        conn.execute("SELECT replicator.create_queue('q')")
        conn.execute("SELECT replicator.add_table('q', 't')")
        conn.execute("SELECT replicator.add_table('q', 'u')")
        url = url_of(kafka, kafka_prefix)
        publish(dsn, url)
        for statements in BOOTSTRAP_HISTORY:
            for statement in statements:
                conn.execute(statement)
            publish(dsn, url)
        topics = [table_topic(kafka_prefix, "public", "t"), table_topic(kafka_prefix, "public", "u"),
                  state_topic(kafka_prefix)]
        before = {topic: count_records(kafka.bootstrap, topic) for topic in topics}
    after = publish_until_cleaned(
        dsn, url, kafka.bootstrap, topics, ["UPDATE t SET n = n + 1 WHERE id = 2", "UPDATE u SET v = 'x' WHERE k = 'k1'"],
        tmp_path / "publisher.log", lambda now: all(now[topic] < before[topic] for topic in topics))
    assert after[topics[0]] < before[topics[0]] / 2, (before, after)   # t's rows' older records are gone

    path = tmp_path / "follower.db"
    with database_moved_away(pg_server, dsn):
        follow_all(url, f"sqlite:{path}", dsn=dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert_follower_equals_source(conn, path)
        assert [c[0] for c in sqlite_contents(path)["t"][0]] == ["id", "v", "n", "note"]


def test_a_row_deleted_after_its_table_was_renamed_stays_deleted_for_a_new_follower_after_compaction(
        dsn: str, conn: psycopg.Connection, kafka: KafkaServer, kafka_prefix: str, tmp_path: Path) -> None:
    # A renamed table is published anew on its new name's topic: its rows' earlier records on the
    # former topic come before the table's DROP there, so no cleaned tombstone can bring one back.
    conn.execute("CREATE TABLE r (id int PRIMARY KEY, v text)")
    conn.execute("INSERT INTO r SELECT g, 'before the rename' FROM generate_series(1, 100) g")
    conn.execute("SELECT replicator.create_queue('q')")
    conn.execute("SELECT replicator.add_table('q', 'r')")
    url = url_of(kafka, kafka_prefix)
    publish(dsn, url)
    conn.execute("ALTER TABLE r RENAME TO r2")
    publish(dsn, url)
    conn.execute("DELETE FROM r2 WHERE id <= 50")
    publish(dsn, url)
    topic = table_topic(kafka_prefix, "public", "r2")
    # the deletes cleaned, then their tombstones: the 50 rows left, and a record of the row rolling the segments
    publish_until_cleaned(dsn, url, kafka.bootstrap, [topic], ["UPDATE r2 SET v = 'rolls' WHERE id = 100"],
                          tmp_path / "publisher.log", lambda now: now[topic] <= 55)
    path = tmp_path / "follower.db"
    follow_all(url, f"sqlite:{path}")
    assert_follower_equals_source(conn, path)


# a copy again after a schema change, as sinks of the topics see it ----------------------------------

RECOPY_SCHEMA = """
    CREATE TABLE t (id int PRIMARY KEY, v text, n int NOT NULL DEFAULT 0);
    INSERT INTO t SELECT g, 'v' || g, 0 FROM generate_series(1, 300) g;
"""
# made after the schema change, before the publisher copies t again: its copy holds them
AFTER_THE_SCHEMA_CHANGE = [
    "DELETE FROM t WHERE id % 10 = 0",
    "UPDATE t SET id = id + 1000 WHERE id % 10 = 1",
    "UPDATE t SET v = 'changed' WHERE id % 10 = 2",
    "INSERT INTO t (id, v) SELECT g, 'new' FROM generate_series(2001, 2050) g",
]


def recopied(dsn: str, conn: psycopg.Connection, url: str, topic: str, bootstrap: str,
             statements: list[str]) -> tuple[list[Record], list[Record], dict[str, list[int]]]:
    """t published, then `ALTER TABLE t ADD COLUMN ... NOT NULL DEFAULT` (copied again) and the statements,
    published in one run: (the records before it, those of the run, t's layout as first copied)."""
    conn.execute(RECOPY_SCHEMA)
    layouts = {"public.t": attnums(conn, "t")}
    conn.execute("SELECT replicator.create_queue('q')")
    conn.execute("SELECT replicator.add_table('q', 't')")
    publish(dsn, url)
    before = last_commit(bootstrap, url.rpartition("/")[2])
    assert before is not None
    conn.execute("ALTER TABLE t ADD COLUMN flag boolean NOT NULL DEFAULT true")
    for statement in statements:
        conn.execute(statement)
    publish(dsn, url)
    last_commit(bootstrap, url.rpartition("/")[2])
    records = read_committed(bootstrap, topic)
    return ([r for r in records if r.sequence[0] <= before["commit"]],
            [r for r in records if r.sequence[0] > before["commit"]], layouts)


def test_a_copy_again_after_a_schema_change_never_empties_a_sink_and_leaves_it_equal_to_the_source(
        dsn: str, conn: psycopg.Connection, kafka: KafkaServer, kafka_prefix: str, tmp_path: Path) -> None:
    """No truncate before the copy: a sink applying the records one by one holds, at every point, every
    row it held before that the source still holds (rows the source deleted may go), and at the end the
    source's rows, those the changes the copy holds deleted gone too; a follower equals the source."""
    url, topic = url_of(kafka, kafka_prefix), table_topic(kafka_prefix, "public", "t")
    old, new, layouts = recopied(dsn, conn, url, topic, kafka.bootstrap, AFTER_THE_SCHEMA_CHANGE)
    assert not [r for r in new if r.value is not None and r.value_payload["op"] == "t"]
    assert {r.value_payload["op"] for r in new if r.value is not None} == {"r", "d"}
    source = source_rows(conn, "t")
    kept = replay(old)[topic].keys() & source.keys()
    assert len(kept) == 240
    for n, rows in enumerate(replaying(old + new)):
        if n >= len(old):
            missing = kept - rows.get(topic, {}).keys()
            assert not missing, f"after record {n - len(old)} of the copy again, {len(missing)} rows are missing"
    assert replay(old + new)[topic] == source
    path, stream = tmp_path / "follower.db", tmp_path / "changes.jsonl"
    follow_all(url, f"sqlite:{path}")
    assert_follower_equals_source(conn, path)
    follow_all(url, f"jsonl:{stream}")   # told the copy replaces the rows: T, S, the rows
    assert_stream_equals_source(conn, StreamReplay(layouts).replay(stream_lines(stream)))


def test_a_truncate_the_copy_again_holds_is_published_then_the_table_copied_again(
        dsn: str, conn: psycopg.Connection, kafka: KafkaServer, kafka_prefix: str, tmp_path: Path) -> None:
    """The source truncated t after the schema change: the only records that empty a sink are a
    truncate of the source's, and the copy after it."""
    url, topic = url_of(kafka, kafka_prefix), table_topic(kafka_prefix, "public", "t")
    old, new, _ = recopied(dsn, conn, url, topic, kafka.bootstrap,
                        ["TRUNCATE t", "INSERT INTO t (id, v) SELECT g, 'after' FROM generate_series(1, 20) g"])
    ops = [r.value_payload["op"] for r in new if r.value is not None]
    assert ops == ["r"] * 20 + ["t"] + ["r"] * 20, Counter(ops)   # (each copy is of the source as it is then)
    assert replay(old + new)[topic] == source_rows(conn, "t")
    path = tmp_path / "follower.db"
    follow_all(url, f"sqlite:{path}")
    assert_follower_equals_source(conn, path)


# 4. --tables ---------------------------------------------------------------------------------------

def follow_in_process(url: str, path: Path, tables: list[str]) -> set[str]:
    """A follower of `tables` run in this process until caught up: the topics it was assigned."""
    target = open_target(f"sqlite:{path}")
    try:
        follower = Follower(parse_url(url), target, tables=tables)
        try:
            follower.run(until_caught_up=True)
            return {tp.topic for tp in follower.consumer.assignment()}
        finally:
            follower.close()
    finally:
        target.close()


def test_a_follower_of_some_tables_reads_only_their_topics_through_renames_and_tables_created_again(
        dsn: str, conn: psycopg.Connection, kafka: KafkaServer, kafka_prefix: str, tmp_path: Path) -> None:
    for name in ("a", "b", "c"):
        conn.execute(f"CREATE TABLE {name} (id int PRIMARY KEY, v text)")
        conn.execute(f"INSERT INTO {name} SELECT g, '{name}' || g FROM generate_series(1, 30) g")
    conn.execute("SELECT replicator.create_queue('q')")
    for name in ("a", "b", "c"):
        conn.execute("SELECT replicator.add_table('q', %s)", (name,))
    url = url_of(kafka, kafka_prefix)
    publish(dsn, url)
    path = tmp_path / "follower.db"
    others = {table_topic(kafka_prefix, "public", name) for name in ("b", "c")}

    assigned = follow_in_process(url, path, ["a"])
    assert assigned == {table_topic(kafka_prefix, "public", "a"), kafka_prefix, state_topic(kafka_prefix)}
    assert list(sqlite_contents(path)) == ["a"]
    assert_replica_equals_source(conn, path, [("public.a", "a", ["id"])])

    conn.execute("ALTER TABLE a RENAME TO a2")
    conn.execute("INSERT INTO a2 VALUES (100, 'after the rename')")
    conn.execute("UPDATE a2 SET v = 'changed' WHERE id <= 3")
    conn.execute("UPDATE b SET v = 'changed'")
    publish(dsn, url)
    # the same follower, as its first run named it: the table under its new name, from its new topic
    assigned = follow_in_process(url, path, ["a"])
    assert table_topic(kafka_prefix, "public", "a2") in assigned and not assigned & others, assigned
    assert list(sqlite_contents(path)) == ["a2"]
    assert_replica_equals_source(conn, path, [("public.a2", "a2", ["id"])])
    # and again later, as a daemon restarted with the same command line
    conn.execute("UPDATE a2 SET v = 'again' WHERE id = 10")
    conn.execute("DROP TABLE b")   # for later: b dropped in a batch of its own
    publish(dsn, url)
    follow_all(url, f"sqlite:{path}", "--tables", "a")
    assert_replica_equals_source(conn, path, [("public.a2", "a2", ["id"])])

    # a later run that leaves the followed table out, or adds one, is refused, its target left as it was
    before = sqlite_contents(path)
    line = one_error_line(follow(url, f"sqlite:{path}", "--tables", "c", "--until-caught-up"))
    assert "follows public.a2, which --tables leaves out" in line, line
    line = one_error_line(follow(url, f"sqlite:{path}", "--tables", "a,c", "--until-caught-up"))
    assert "has not followed public.c, which --tables lists" in line, line
    assert sqlite_contents(path) == before
    # rebuilt in place for the tables it lists now (--recopy), as a new follower of them would be
    follow_all(url, f"sqlite:{path}", "--tables", "a2,c", "--recopy")
    assert sorted(sqlite_contents(path)) == ["a2", "c"]
    assert_replica_equals_source(conn, path, [("public.a2", "a2", ["id"]), ("public.c", "c", ["id"])])

    # a new follower of the table by its new name: its rows from both of its topics
    fresh = tmp_path / "fresh.db"
    assert not follow_in_process(url, fresh, ["a2"]) & others
    assert list(sqlite_contents(fresh)) == ["a2"]
    assert_replica_equals_source(conn, fresh, [("public.a2", "a2", ["id"])])

    # tables dropped and created again under their names, b in two batches, c in one: a new follower of
    # each gets the table now, from a topic that holds the dropped one's rows too
    conn.execute("DROP TABLE c")
    for name in ("b", "c"):
        conn.execute(f"CREATE TABLE {name} (id int PRIMARY KEY, w text)")
        conn.execute(f"INSERT INTO {name} SELECT g, 'new {name} ' || g FROM generate_series(20, 40) g")
        conn.execute("SELECT replicator.add_table('q', %s)", (name,))
    publish(dsn, url)
    for name in ("b", "c"):
        again = tmp_path / f"{name}.db"
        follow_all(url, f"sqlite:{again}", "--tables", name)
        assert list(sqlite_contents(again)) == [name]
        assert_replica_equals_source(conn, again, [(f"public.{name}", name, ["id"])])


# 5. delta: and jsonl: targets ------------------------------------------------------------------------

SHOP = """
    CREATE TABLE orders (id int PRIMARY KEY, customer text, amount numeric(12,2), placed timestamptz);
    CREATE TABLE lines (o int, n int, item text, PRIMARY KEY (o, n));
    INSERT INTO orders SELECT g, 'c' || (g % 7), g * 1.25, '2024-01-01 00:00+02'::timestamptz + g * interval '1 hour'
        FROM generate_series(1, 200) g;
    INSERT INTO lines SELECT g % 50, g, 'item ' || g FROM generate_series(1, 300) g;
"""
SHOP_CHANGES = [
    ["UPDATE orders SET amount = amount + 1, customer = NULL WHERE id % 3 = 0", "DELETE FROM orders WHERE id > 190",
     "UPDATE orders SET id = id + 1000 WHERE id = 5", "INSERT INTO lines VALUES (7, 1000, 'tab\tand\nnewline')"],
    ["TRUNCATE lines", "INSERT INTO lines SELECT g % 10, g, 'again ' || g FROM generate_series(1, 40) g",
     "ALTER TABLE orders ADD COLUMN note text", "UPDATE orders SET note = 'n' || id WHERE id < 20"],
]


def delta_rows(path: Path, table: str) -> Counter:
    """The rows of a follower's Delta table, read by delta-rs, as (column, type, value) items."""
    deltalake = pytest.importorskip("deltalake")
    import pyarrow as pa

    from replicator.targets.delta.reader import table_uris

    data = pa.table(deltalake.DeltaTable(table_uris(str(path))[table]).scan().read_all())
    return Counter(tuple(sorted((k, type(v).__name__, v) for k, v in row.items())) for row in data.to_pylist())


def source_typed_rows(conn: psycopg.Connection, table: str) -> Counter:
    """The source's rows as psycopg reads them, as (column, type, value) items: the Python types delta-rs
    gives a follower's Delta table (numeric(12,2) a Decimal, timestamptz a datetime)."""
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        rows = cur.execute(sql.SQL("SELECT * FROM {}").format(sql.Identifier(table))).fetchall()
    return Counter(tuple(sorted((k, type(v).__name__, v) for k, v in row.items())) for row in rows)


def test_followers_into_delta_and_jsonl_targets_equal_the_source(dsn: str, conn: psycopg.Connection,
                                                                 kafka: KafkaServer, kafka_prefix: str,
                                                                 tmp_path: Path) -> None:
    conn.execute(SHOP)
    conn.execute("SELECT replicator.create_queue('q')")
    conn.execute("SELECT replicator.add_table('q', 'orders')")
    conn.execute("SELECT replicator.add_table('q', 'lines')")
    url = url_of(kafka, kafka_prefix)
    publish(dsn, url)
    warehouse, stream = tmp_path / "warehouse", tmp_path / "changes.jsonl"
    layouts = {f"public.{table}": attnums(conn, table) for table in ("orders", "lines")}   # as first copied
    for statements in SHOP_CHANGES:
        for statement in statements:
            conn.execute(statement)
        publish(dsn, url)
    follow_all(url, f"delta:{warehouse}")
    follow_all(url, f"jsonl:{stream}")

    for table in ("orders", "lines"):
        assert delta_rows(warehouse, f"public.{table}") == source_typed_rows(conn, table), table
    lines = stream_lines(stream)
    assert_stream_equals_source(conn, StreamReplay(layouts).replay(lines))
    assert {line["op"] for line in lines} >= {"S", "R", "I", "U", "D", "T"}

    # each applies what comes next once: the stream's lines of the earlier run are not written again
    conn.execute("UPDATE orders SET note = 'later' WHERE id = 1")
    publish(dsn, url)
    follow_all(url, f"delta:{warehouse}")
    follow_all(url, f"jsonl:{stream}")
    assert delta_rows(warehouse, "public.orders") == source_typed_rows(conn, "orders")
    assert stream_lines(stream)[:len(lines)] == lines and len(stream_lines(stream)) == len(lines) + 1
    assert_stream_equals_source(conn, StreamReplay(layouts).replay(stream_lines(stream)))

    # the Delta warehouse rebuilt in place from the topics (--recopy) for orders alone, then followed on
    # (the positions of lines' topic forgotten for good); a stream's lines cannot be taken back: refused
    follow_all(url, f"delta:{warehouse}", "--tables", "orders", "--recopy")
    assert set(table_uris(str(warehouse))) == {"public.orders"}
    assert delta_rows(warehouse, "public.orders") == source_typed_rows(conn, "orders")
    conn.execute("UPDATE orders SET note = 'rebuilt' WHERE id = 3")
    conn.execute("DELETE FROM lines")
    publish(dsn, url)
    follow_all(url, f"delta:{warehouse}", "--tables", "orders")
    assert set(table_uris(str(warehouse))) == {"public.orders"}
    assert delta_rows(warehouse, "public.orders") == source_typed_rows(conn, "orders")
    written = stream_lines(stream)
    line = one_error_line(follow(url, f"jsonl:{stream}", "--until-caught-up", "--recopy"))
    assert "--recopy rebuilds a SQLite or Delta target" in line, line
    assert stream_lines(stream) == written


ODD = """
    CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
    CREATE TABLE odd (id int PRIMARY KEY, iv interval, tz timetz, m money, r int4range, bits bit varying(8),
                      b1 bit(3), big numeric, n2 numeric(6,2), mo mood, ip inet, pt point, arr int[][],
                      ts3 timestamp(3), t0 time(0), d date, tstz timestamptz, j json, x xml, c char(4), f4 real,
                      f8 float8, i8 bigint, o oid);
    INSERT INTO odd VALUES
     (1, '1 year 2 mons 3 days 04:05:06.789', '11:04:05.5+03:30', 12.34, '[1,5)', B'0101', B'101', 'NaN', 1234.50,
      'happy', '10.0.0.1/8', '(1.5,2)', '{{1,2},{3,NULL}}', '2024-01-02 03:04:05.123', '24:00:00', 'infinity',
      '-infinity', '{"a": [1, 2.50]}', '<a>x</a>', 'ab', 'NaN', '-Infinity', -9223372036854775808, 4000000000),
     (2, '-00:00:00.000001', '00:00:00-15:59', -0.01, 'empty', B'', B'000', '123456789012345678901234567890.123456789',
      -0.5, 'sad', '::1', '(0,0)', '{}', '294276-12-31 23:59:59.999', '00:00:00', '0044-03-15 BC',
      '2024-01-01 00:00:00.000001+00', '[]', '', '    ', 1e-38, 5e-324, 9223372036854775807, 0),
     (3, NULL, NULL, NULL, NULL, NULL, NULL, 'Infinity', NULL, NULL, NULL, NULL, NULL, 'infinity', NULL,
      '5874897-12-31', 'infinity', 'null', NULL, NULL, 3.4e38, 1.7976931348623157e308, 0, NULL),
     (4, '100 years', '23:59:59.999999+00', 92233720368547758.07, '(,)', B'11111111', B'111', '-0.000000001',
      9999.99, 'ok', '2001:db8::/32', '(-1e300,1e-300)', '{{{1}}}', '-infinity', '12:34:56', '2000-02-29',
      '-infinity', '{"k": "\\u00e9"}', '<?xml version="1.0"?><r/>', 'z', 0.1, 0.1, 1, 1);
"""


def test_followers_of_each_envelope_option_hold_what_a_direct_consumer_holds(
        dsn: str, conn: psycopg.Connection, kafka: KafkaServer, kafka_prefix: str, tmp_path: Path) -> None:
    """Values a Connect field cannot hold exactly (they travel as text too), records without schemas,
    numerics as strings, several partitions a table: each follower's replica is the direct consumer's,
    value for value and storage class for class."""
    conn.execute(ODD)
    conn.execute("SELECT replicator.create_queue('q')")
    conn.execute("SELECT replicator.add_table('q', 'odd')")
    direct = tmp_path / "direct.db"
    urls = [url_of(kafka, kafka_prefix), url_of(kafka, f"{kafka_prefix}_payload") + "?schemas=false",
            url_of(kafka, f"{kafka_prefix}_strings") + "?decimals=string&partitions=3"]
    for url in urls:
        publish(dsn, url)
    conn.execute("UPDATE odd SET id = id + 10")   # every key changed: deletes and updates
    conn.execute("DELETE FROM odd WHERE id = 13")
    conn.execute("INSERT INTO odd (id, big, n2) VALUES (20, '1.50', 1.5)")
    for url in urls:
        publish(dsn, url)
    done = run_cli(dsn, "consume", "q", "--target", f"sqlite:{direct}", "--until-caught-up")
    assert done.returncode == 0, done.stderr
    for n, url in enumerate(urls):
        follow_all(url, f"sqlite:{tmp_path / f'follower-{n}.db'}")
        assert_same_replicas(tmp_path / f"follower-{n}.db", direct)


SPANS = """
    CREATE TABLE spans (k interval PRIMARY KEY, v text);
    INSERT INTO spans VALUES ('1 mon', 'a'), ('30 days 10:30:00', 'b'), ('1 year 2 mons -3 days', 'c'),
                             ('00:00:01.5', 'd'), ('-1 mons', 'e'), ('2 mons', 'f');
"""


def test_a_follower_of_interval_keys_with_months_stays_equal_to_the_source(
        dsn: str, conn: psycopg.Connection, kafka: KafkaServer, kafka_prefix: str, tmp_path: Path) -> None:
    """Keys are Debezium's: an interval with months is Debezium's MicroDuration (1 mon and 30 days
    10:30:00 are one record key). A follower applies each change by the exact value its record's
    value holds, a live one and one that starts from the topics."""
    conn.execute(SPANS)
    conn.execute("SELECT replicator.create_queue('q')")
    conn.execute("SELECT replicator.add_table('q', 'spans')")
    url = url_of(kafka, kafka_prefix)

    def assert_equal_to_the_source(path: Path) -> None:
        conn.execute("SET IntervalStyle = 'postgres'")
        want = sorted(conn.execute("SELECT k::text, v FROM spans").fetchall())
        assert sorted(sqlite_contents(path)["spans"][1]) == [("text", k, "text", v) for k, v in want]

    publish(dsn, url)
    live = tmp_path / "live.db"
    follow_all(url, f"sqlite:{live}")
    assert_equal_to_the_source(live)
    conn.execute("UPDATE spans SET v = 'changed' WHERE k = '1 mon'")
    conn.execute("DELETE FROM spans WHERE k IN ('30 days 10:30:00', '-1 mons')")
    conn.execute("UPDATE spans SET k = '3 mons' WHERE k = '1 year 2 mons -3 days'")   # a key change
    conn.execute("INSERT INTO spans VALUES ('30 days 10:30:00', 'again')")
    publish(dsn, url)
    follow_all(url, f"sqlite:{live}")
    assert_equal_to_the_source(live)
    fresh = tmp_path / "fresh.db"
    follow_all(url, f"sqlite:{fresh}")
    assert_equal_to_the_source(fresh)


# 6. a broker restart ---------------------------------------------------------------------------------

def test_a_follower_daemon_waits_for_a_restarted_broker_then_catches_up(dsn: str, conn: psycopg.Connection,
                                                                        own_kafka: KafkaServer,
                                                                        tmp_path: Path) -> None:
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    conn.execute("INSERT INTO t SELECT g, 'seed' FROM generate_series(1, 50) g")
    conn.execute("SELECT replicator.create_queue('q')")
    conn.execute("SELECT replicator.add_table('q', 't')")
    set_fast_ticks(conn)
    url = url_of(own_kafka, "shop")
    path = tmp_path / "follower.db"
    ticker = Daemon(dsn, "ticker", "--interval", "0.1", log=tmp_path / "ticker.log")
    publisher = Daemon(dsn, "consume", "q", "--target", url, "--poll-interval", "0.05", log=tmp_path / "publisher.log")
    follower = follower_daemon(url, f"sqlite:{path}", tmp_path / "follower.log", "--metrics-port", "0")
    daemons = (ticker, publisher, follower)

    def applied(tick: int) -> bool:
        return follower_positions(path, "shop").get("tick", 0) >= tick

    try:
        conn.execute("UPDATE t SET v = 'before' WHERE id <= 10")
        tick = forced_tick(conn)
        wait_until(lambda: applied(tick), 60, "the update applied", check=lambda: [alive(d) for d in daemons])

        metrics = Metrics(follower)
        own_kafka.kill()
        conn.execute("INSERT INTO t SELECT g, 'while Kafka is down' FROM generate_series(51, 80) g")
        _, report = wait_until(lambda: (h := metrics.health())[0] == 503 and h, 60,
                               "the follower to see Kafka gone", check=lambda: alive(follower))
        assert report["status"] == "source unavailable", report
        assert f"Kafka at {own_kafka.bootstrap} unavailable" in follower.log()
        own_kafka.restart()
        conn.execute("UPDATE t SET v = 'after' WHERE id > 70")
        tick = forced_tick(conn)
        wait_until(lambda: applied(tick), 120, "the follower to catch up", check=lambda: [alive(d) for d in daemons])
        wait_until(lambda: metrics.health()[0] == 200, 10, "the follower to be healthy again")
        assert metrics.value("replicator_errors_total", kind="source_unavailable") == 1
        for daemon in (follower, publisher):
            assert daemon.terminate() == 0, daemon.log()
    finally:
        for daemon in daemons:
            daemon.stop()
    assert_follower_equals_source(conn, path)
    assert "Traceback" not in follower.log(), follower.log()


# 7. lag and health ------------------------------------------------------------------------------

@pytest.fixture
def published(dsn: str, conn: psycopg.Connection, kafka: KafkaServer, kafka_prefix: str) -> str:
    """Table t of queue q, published: the URL of its topics."""
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    conn.execute("INSERT INTO t SELECT g, 'seed ' || g FROM generate_series(1, 20) g")
    conn.execute("SELECT replicator.create_queue('q')")
    conn.execute("SELECT replicator.add_table('q', 't')")
    url = url_of(kafka, kafka_prefix)
    publish(dsn, url)
    return url


def test_a_follower_daemon_exports_its_lag_and_counts_under_its_queue_and_is_healthy_when_caught_up(
        dsn: str, conn: psycopg.Connection, published: str, kafka_prefix: str, tmp_path: Path) -> None:
    path = tmp_path / "follower.db"
    daemon = follower_daemon(published, f"sqlite:{path}", tmp_path / "follower.log", "--metrics-port", "0")
    try:
        metrics = Metrics(daemon)
        queue = f"kafka:{kafka_prefix}"
        # the copy's rows at least (a record each, and the table's creation)
        applied = wait_until(lambda: metrics.value("replicator_rows_applied_total", queue=queue), 60,
                             "the follower's first commit", check=lambda: alive(daemon))
        assert applied >= 20

        conn.execute("UPDATE t SET v = 'changed' WHERE id <= 5")
        publish(dsn, published)
        wait_until(lambda: (metrics.value("replicator_rows_applied_total", queue=queue) or 0) >= applied + 5, 60,
                   "the update applied", check=lambda: alive(daemon))
        wait_until(lambda: metrics.value("replicator_consumer_lag_ticks", queue=queue) == 0, 60, "no commit left")
        lag = metrics.value("replicator_consumer_lag_seconds", queue=queue)
        assert lag is not None and 0 <= lag < 60
        status, report = metrics.health()
        assert (status, report["status"]) == (200, "ok"), report
        assert daemon.terminate() == 0, daemon.log()
    finally:
        daemon.stop()
    assert_follower_equals_source(conn, path)


# 8. bad command lines ------------------------------------------------------------------------------

def test_a_follower_command_line_that_cannot_work_is_one_line_and_exit_1(dsn: str, published: str,
                                                                          tmp_path: Path) -> None:
    path = tmp_path / "follower.db"
    target = f"sqlite:{path}"
    refused = {
        ("q", "--source", published, "--target", target): "give QUEUE or --source, not both",
        ("--source", published, "--target", published + "_again"): "a follower writes a target of its own",
        ("--source", published, "--target", target, "--consumer", "c"): "--consumer applies to consumers of a queue",
        ("--source", "http://127.0.0.1:9092/shop", "--target", target): "--source takes a publisher's topics",
        ("--source", "kafka:127.0.0.1:9092/shop", "--target", target): "invalid Kafka URL",
        ("--source", published + "?decimals=float", "--target", target): "invalid decimals='float'",
    }
    for args, message in refused.items():
        assert message in one_error_line(run_cli(NO_SOURCE, "consume", *args)), args
    assert not path.exists()   # nothing made

    # a replica of queue q is no follower's target: its rows would mix
    done = run_cli(dsn, "consume", "q", "--target", target, "--until-caught-up")
    assert done.returncode == 0, done.stderr
    before = sqlite_contents(path)
    line = one_error_line(follow(published, target, "--until-caught-up"))
    assert "holds queue 'q'" in line and "a target of its own" in line, line
    assert sqlite_contents(path) == before
    assert follower_positions(path, published.rpartition("/")[2]) == {}
