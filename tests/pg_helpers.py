"""What the tests need of PostgreSQL across the versions replicator supports (12 to 18):
databases and roles of their own on the session's cluster, dropped whatever the server version."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg import sql

from pgserver import PgServer
from replicator.source.install import install

_names = itertools.count()
# The compatibility run (bin/test-pg-versions) runs the randomized tests at a fraction of their
# examples: another server version needs the behaviours they reach, which a few examples reach, and
# their full depth runs in the main suite beside it on the same two cores (docs/testing.md).
EXAMPLES_SCALE = float(os.environ.get("REPLICATOR_EXAMPLES_SCALE", "1"))


def examples(n: int) -> int:
    """A randomized test's max_examples: n, scaled for the run (at least 1)."""
    return max(1, round(n * EXAMPLES_SCALE))


def unique_name(prefix: str) -> str:
    """A database or role name no other test of the run uses (the process id: one per
    pytest-xdist worker, each with a cluster of its own)."""
    return f"{prefix}_{os.getpid()}_{next(_names)}"


def dsn_of(server: PgServer, dbname: str, user: str = "postgres") -> str:
    """The DSN of a database of the server, as a role."""
    return psycopg.conninfo.make_conninfo(server.dsn, dbname=dbname, user=user)


@contextmanager
def empty_database(server: PgServer, prefix: str = "test", template: str = "template1") -> Iterator[str]:
    """A new database, a copy of `template` (by default empty: replicator not installed),
    dropped on leaving; its DSN."""
    name = unique_name(prefix)
    with psycopg.connect(server.dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(name), sql.Identifier(template)))
    try:
        yield dsn_of(server, name)
    finally:
        with psycopg.connect(server.dsn, autocommit=True) as admin:
            drop_database(admin, name)


@contextmanager
def fresh_database(server: PgServer, prefix: str = "test") -> Iterator[str]:
    """A new database with replicator installed, dropped on leaving (the `dsn` fixture's, and
    one per Hypothesis example, where that fixture would be shared by all); its DSN."""
    with empty_database(server, prefix, installed_template(server)) as dsn:
        yield dsn


_installed_templates: dict[tuple[str, int], str] = {}


def installed_template(server: PgServer) -> str:
    """The name of a database of the server that replicator was installed in, made on the first
    call: copying it takes a fraction of the time an install takes (CREATE DATABASE ... TEMPLATE).
    It takes no connection (ALLOW_CONNECTIONS false: not even autovacuum's), since a database
    being copied must have none."""
    key = (str(server.basedir), server.port)
    if key not in _installed_templates:
        name = unique_name("installed")
        with psycopg.connect(server.dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        with psycopg.connect(dsn_of(server, name), autocommit=True) as conn:
            install(conn)
        with psycopg.connect(server.dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS false").format(sql.Identifier(name)))
        _installed_templates[key] = name
    return _installed_templates[key]


@contextmanager
def owned_database(server: PgServer, prefix: str) -> Iterator[str]:
    """A login role that is not superuser owning a new database of its name, both dropped on
    leaving; the role's name (its DSN: dsn_of(server, role, role))."""
    role = unique_name(prefix)
    with psycopg.connect(server.dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        admin.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(role), sql.Identifier(role)))
    try:
        yield role
    finally:
        with psycopg.connect(server.dsn, autocommit=True) as admin:
            drop_database(admin, role)
            admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


def execute_retrying_deadlocks(conn: psycopg.Connection, statements: list[str]) -> None:
    """Runs each statement, again when a deadlock with concurrent writers picked it as the victim."""
    for statement in statements:
        for attempt in range(20):
            try:
                conn.execute(statement)
                break
            except psycopg.errors.DeadlockDetected:
                if attempt == 19:
                    raise


def drop_database(admin: psycopg.Connection, name: str) -> None:
    """DROP DATABASE IF EXISTS, ending the sessions still in it (WITH (FORCE) from
    PostgreSQL 13; before it, by pg_terminate_backend until none is left)."""
    drop = sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name))
    if admin.info.server_version >= 130000:
        admin.execute(drop + sql.SQL(" WITH (FORCE)"))
        return
    while True:
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
        try:
            admin.execute(drop)
            return
        except psycopg.errors.ObjectInUse:     # a session connected meanwhile
            continue


def make_captured_table_a_descendant(conn: psycopg.Connection, table: str, statement: str) -> None:
    """Runs `statement`, an ATTACH PARTITION or INHERIT making `table`, captured on its own, a
    descendant: a state older versions of replicator let a database reach. PostgreSQL 12 refuses
    to make a table carrying triggers with transition tables a partition or an inheritance child
    (13 refuses row-level ones only), so its capture triggers are dropped around the statement
    and made again, past the event triggers: the same state on every version."""
    (table_id,) = conn.execute("SELECT table_id FROM replicator.captured_table WHERE table_oid = %s::regclass",
                               (table,)).fetchone()
    with conn.transaction():
        conn.execute("SELECT set_config('replicator.in_ddl', 'on', true)")
        conn.execute("SELECT replicator.drop_capture_triggers(%s)", (table_id,))
        conn.execute(statement)
        conn.execute("SELECT replicator.create_capture_triggers(%s, %s::regclass)", (table_id, table))
