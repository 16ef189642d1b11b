"""Shared fixtures: one throwaway PostgreSQL cluster per test session, a fresh database
per test, replicator installed in it (and two small captured tables in queue q: queue_q,
orders); one S3-compatible server (moto) per test session, a fresh bucket per test; one
Spark session at a time, replaced when it stops answering (spark); one Kafka broker per
test session (kafka), a topic prefix per test (kafka_prefix), and a private broker for a
test that kills or restarts it (own_kafka). Each test is marked with the servers it needs."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import psycopg
import pytest
from hypothesis import HealthCheck, settings
from xdist.remote import Producer
from xdist.workermanage import WorkerController

from consumer_helpers import set_fast_ticks
from kafkaserver import KafkaServer
from pg_helpers import empty_database, fresh_database
from pgserver import PgServer
from replicator.source import Source
from s3_helpers import MotoServer
from spark_helpers import SparkSessions
from xdist_groups import FileGroupScheduling, make_scheduler, start, stop, tell_worker, write_groups

_kafka_prefix_counter = itertools.count()

# The server a test needs, by the fixture that gives it: a marker each (registered in
# pyproject.toml), so that `-m 'not spark and not kafka'` leaves out the slow ones
# (docs/testing.md). A test that starts a server of its own is marked by hand.
SERVER_MARKERS = {"pg_server": "pg", "spark_sessions": "spark", "kafka": "kafka", "own_kafka": "kafka", "s3_server": "s3"}

# Hypothesis's timing checks fail a run for the machine's load, not the code's: on 2 shared cores
# one draw can wait seconds for the CPU. Tests that set suppress_health_check set their own.
settings.register_profile("replicator", suppress_health_check=[HealthCheck.too_slow], deadline=None)
settings.load_profile("replicator")

# Under pytest-xdist's --dist loadgroup the tests of a shared JVM run on one worker, so that
# one Spark session and one broker start, not one per worker (a test of both goes with Spark).
JVM_GROUPS = ("spark", "kafka")


@pytest.hookimpl(tryfirst=True)   # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for fixture in getattr(item, "fixturenames", ()):   # every fixture the test uses, directly or not
            if fixture in SERVER_MARKERS:
                item.add_marker(SERVER_MARKERS[fixture])
        group = next((name for name in JVM_GROUPS if item.get_closest_marker(name)), None)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    write_groups(config, items)


# The groups reach xdist's scheduler through files (xdist_groups says why).
def pytest_configure(config: pytest.Config) -> None:
    start(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    stop(config)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: WorkerController) -> None:
    tell_worker(node)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> FileGroupScheduling | None:
    return make_scheduler(config, log)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    server = PgServer()
    server.init().start()
    try:
        yield server
    finally:
        server.destroy()


@pytest.fixture
def empty_dsn(pg_server: PgServer) -> Iterator[str]:
    """DSN of a new, empty database (replicator not installed)."""
    with empty_database(pg_server) as dsn:
        yield dsn


@pytest.fixture
def dsn(pg_server: PgServer) -> Iterator[str]:
    """DSN of a new database with replicator installed (a copy of one installed once per session)."""
    with fresh_database(pg_server) as dsn:
        yield dsn


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection]:
    """An autocommit connection to the test database, for the application's writes."""
    with psycopg.connect(dsn, autocommit=True) as c:
        yield c


@pytest.fixture
def source(dsn: str) -> Iterator[Source]:
    with Source.connect(dsn) as s:
        yield s


@pytest.fixture
def queue_q(conn: psycopg.Connection, source: Source) -> str:
    """Queue q capturing t (id, v) with 10 rows, ticking fast."""
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    conn.execute("INSERT INTO t SELECT g, 'seed' FROM generate_series(1, 10) g")
    source.create_queue("q")
    source.add_table("q", "t")
    set_fast_ticks(conn)
    return "q"


@pytest.fixture
def orders(conn: psycopg.Connection, source: Source) -> str:
    """Queue q capturing orders (id, v) with rows 1 to 5."""
    conn.execute("CREATE TABLE orders (id int PRIMARY KEY, v text)")
    conn.execute("INSERT INTO orders SELECT g, 'v' || g FROM generate_series(1, 5) g")
    source.create_queue("q")
    source.add_table("q", "orders")
    return "orders"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_url(s3_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> str:
    """A warehouse URL in a new bucket of the test server, with the environment that
    points obstore, delta-rs and boto3 at it (the Spark session's JVM has it from its start)."""
    s3_server.apply_env(monkeypatch)
    return f"s3://{s3_server.create_bucket()}/warehouse"


@pytest.fixture(scope="session")
def spark_sessions(s3_server: MotoServer) -> Iterator[SparkSessions]:
    """Local Spark sessions for the test run, one at a time (starting one takes ~10 s);
    the streaming source is registered in each. Their JVM starts with the test S3
    server's environment, so its s3a reaches the buckets of s3_url."""
    pytest.importorskip("pyspark")
    from replicator.spark import get_session

    def start() -> object:
        with pytest.MonkeyPatch.context() as env:
            s3_server.apply_env(env)
            return get_session("local[2]", {"spark.sql.shuffle.partitions": "4", "spark.default.parallelism": "4",
                                            "spark.driver.memory": "2g", "spark.ui.enabled": "false"},
                               app_name="replicator tests")

    sessions = SparkSessions(start)
    try:
        yield sessions
    finally:
        sessions.stop()


@pytest.fixture
def spark(spark_sessions: SparkSessions) -> object:
    """The run's Spark session, shared by the tests while it answers; one whose JVM died
    or stalls in an earlier test is replaced first (spark_helpers)."""
    return spark_sessions.healthy()


# A consumer at a partition's end hears so when the broker's long poll (fetch.wait.max.ms: 100 ms as
# replicator sets it, 500 ms librdkafka's default) comes back empty: every read to the end (a
# publisher's start, a follower's step) waits that long. replicator's clients in the tests, the
# commands' too, take a shorter one from the environment (a setting users may give as well,
# docs/kafka.md).
KAFKA_CLIENT_ENV = {"REPLICATOR_KAFKA_FETCH_WAIT_MAX_MS": "50"}


@pytest.fixture(scope="session")
def kafka_client_env() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as env:
        for name, value in KAFKA_CLIENT_ENV.items():
            env.setenv(name, value)
        yield


@pytest.fixture(scope="session")
def kafka(kafka_client_env: None) -> Iterator[KafkaServer]:
    """The session's broker: tests share it, each with topics of its own (kafka_prefix)."""
    server = KafkaServer().start()
    try:
        yield server
    finally:
        server.destroy()


@pytest.fixture
def kafka_prefix() -> str:
    """A topic name prefix no other test uses: the session broker's topics outlive their test."""
    return f"t{os.getpid()}_{next(_kafka_prefix_counter)}"


@pytest.fixture
def own_kafka(kafka_client_env: None) -> Iterator[KafkaServer]:
    """A broker of the test's own, which it may kill, stop and restart."""
    server = KafkaServer().start()
    try:
        yield server
    finally:
        server.destroy()
