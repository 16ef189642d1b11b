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
