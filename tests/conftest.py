"""Shared fixtures: one throwaway PostgreSQL cluster per test session, a fresh
database per test, replicator installed in it."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import psycopg
import pytest

from pg_helpers import drop_database
from pgserver import PgServer
from replicator.source import Source
from replicator.source.install import install

_db_counter = itertools.count()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    server = PgServer()
    server.init().start()
    try:
        yield server
    finally:
        server.destroy()


def _dsn_for(server: PgServer, dbname: str) -> str:
    return f"host=127.0.0.1 port={server.port} user=postgres dbname={dbname}"


@pytest.fixture
def empty_dsn(pg_server: PgServer) -> Iterator[str]:
    """DSN of a new, empty database (replicator not installed)."""
    name = f"test_{os.getpid()}_{next(_db_counter)}"
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield _dsn_for(pg_server, name)
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        drop_database(conn, name)


@pytest.fixture
def dsn(empty_dsn: str) -> str:
    """DSN of a new database with replicator installed."""
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        install(conn)
    return empty_dsn


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection]:
    """An autocommit connection to the test database, for the application's writes."""
    with psycopg.connect(dsn, autocommit=True) as c:
        yield c


@pytest.fixture
def source(dsn: str) -> Iterator[Source]:
    with Source.connect(dsn) as s:
        yield s


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
    """One local Spark session for the whole test run (starting one takes ~10 s);
    the streaming source is registered in it."""
    pytest.importorskip("pyspark")
    from replicator.spark import get_session

    session = get_session("local[2]", {"spark.sql.shuffle.partitions": "4", "spark.default.parallelism": "4",
                                       "spark.driver.memory": "2g", "spark.ui.enabled": "false"},
                          app_name="replicator tests")
    try:
        yield session
    finally:
        session.stop()
