"""What the tests need of PostgreSQL across the versions replicator supports (12 to 18)."""

from __future__ import annotations

import psycopg
from psycopg import sql


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
