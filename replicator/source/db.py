"""Connecting to the source and turning server errors a user caused into UserError."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
import psycopg.conninfo

from replicator.errors import UserError


def resolve_dsn(dsn: str | None) -> str:
    """--dsn, else $REPLICATOR_DSN, else "" (libpq then reads the PG* variables)."""
    return dsn or os.environ.get("REPLICATOR_DSN", "")


# The output settings the capture functions pin: rows read back by a consumer
# (initial copy, PK-only join-back) must be encoded exactly like queued rows.
SESSION_SETTINGS = {"bytea_output": "hex", "extra_float_digits": "1", "IntervalStyle": "postgres"}


# A source that vanishes without closing the connection (a host down, a network
# cut) must not leave a daemon blocked on a dead socket for the kernel's two hours.
KEEPALIVES = {"keepalives": "1", "keepalives_idle": "30", "keepalives_interval": "10", "keepalives_count": "3"}


def open_connection(conninfo: str, *, autocommit: bool = True,
                    application_name: str = "replicator") -> psycopg.Connection:
    """Opens a connection with replicator's session settings and TCP keepalives
    (where the DSN sets none); raises psycopg.OperationalError when the server is
    unreachable, for callers that retry."""
    given = psycopg.conninfo.conninfo_to_dict(conninfo)
    keepalives = {name: value for name, value in KEEPALIVES.items() if name not in given}
    conn = psycopg.connect(psycopg.conninfo.make_conninfo(conninfo, **keepalives), autocommit=True,
                           application_name=application_name)
    for name, value in SESSION_SETTINGS.items():
        conn.execute("SELECT set_config(%s, %s, false)", (name, value))
    conn.autocommit = autocommit
    return conn


def without_password(conninfo: str) -> str:
    """The connection string with its password masked, for messages and logs."""
    params = psycopg.conninfo.conninfo_to_dict(conninfo)
    if "password" not in params:
        return conninfo
    return psycopg.conninfo.make_conninfo("", **{**params, "password": "***"})


def connect(dsn: str | None, *, autocommit: bool = True, application_name: str = "replicator") -> psycopg.Connection:
    """Opens a connection; failure is a UserError naming the server."""
    conninfo = resolve_dsn(dsn)
    try:
        return open_connection(conninfo, autocommit=autocommit, application_name=application_name)
    except psycopg.OperationalError as exc:
        lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
        reason = lines[0] if lines else "connection failed"
        where = without_password(conninfo) or "the server named by the PG* environment variables"
        raise UserError(f"cannot connect to {where}: {reason}") from None


def scalar(conn: psycopg.Connection[Any], query: str, params: Sequence[Any] | None = None) -> Any:
    """The first value of the one row a query returns."""
    row = conn.execute(query, params).fetchone()
    if row is None:
        raise RuntimeError(f"no row from {query}")
    return row[0]


@contextmanager
def user_errors() -> Iterator[None]:
    """Maps errors raised by replicator's SQL functions (RAISE EXCEPTION) and
    missing-schema errors to UserError; anything else propagates."""
    try:
        yield
    except psycopg.errors.RaiseException as exc:
        raise UserError(exc.diag.message_primary or str(exc)) from None
    except (psycopg.errors.InvalidSchemaName, psycopg.errors.UndefinedFunction,
            psycopg.errors.UndefinedTable) as exc:
        message = exc.diag.message_primary or str(exc)
        if "replicator" in message:
            raise UserError("replicator is not installed in this database: run `replicator install`") from None
        raise
