"""Connecting to the source and turning server errors a user caused into UserError."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from typing import Any

import psycopg
import psycopg.conninfo
import psycopg.pq

from replicator.errors import UserError, first_line


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
    given = parse_dsn(conninfo)
    keepalives = {name: value for name, value in KEEPALIVES.items() if name not in given}
    conn = psycopg.connect(psycopg.conninfo.make_conninfo(conninfo, **keepalives), autocommit=True,
                           application_name=application_name)
    for name, value in SESSION_SETTINGS.items():
        conn.execute("SELECT set_config(%s, %s, false)", (name, value))
    conn.autocommit = autocommit
    return conn


@cache
def secret_parameters() -> frozenset[str]:
    """The connection parameters libpq marks as secret (password, sslpassword, oauth_client_secret
    in libpq 18): its own list, so that a secret a later libpq adds is masked too."""
    return frozenset(option.keyword.decode() for option in psycopg.pq.Conninfo.get_defaults()
                     if option.dispchar == b"*")


# What libpq reads; said when it cannot read a DSN
_FORMS = ("use key=value pairs (host=HOST dbname=NAME ..., a value with spaces in single quotes) or a URI "
          "postgresql://[USER[:PASSWORD]@]HOST[:PORT]/NAME[?NAME=VALUE&...], special characters percent-encoded")


def parse_dsn(conninfo: str) -> dict[str, Any]:
    """The parameters of a DSN; one libpq cannot read is a UserError saying so and which forms it
    reads, with libpq's reason only when the DSN can hold no secret (libpq quotes the text it stopped
    at, which may be any part of a password: no masking of text libpq cannot read is safe)."""
    try:
        return psycopg.conninfo.conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError as exc:
        reason = first_line(exc)
    if _may_hold_secret(conninfo):
        raise UserError(f"invalid DSN (--dsn or $REPLICATOR_DSN): libpq cannot read it (its reason is not shown: "
                        f"it may hold a password); {_FORMS}") from None
    raise UserError(f"invalid DSN (--dsn or $REPLICATOR_DSN): {reason}; {_FORMS}") from None


def _may_hold_secret(conninfo: str) -> bool:
    """Whether a DSN libpq cannot read may hold a secret: a URI's USER:PASSWORD@, a secret's name, or
    percent-encoding (which can spell one)."""
    lowered = conninfo.lower()
    return "@" in conninfo or "%" in conninfo or any(secret in lowered for secret in secret_parameters())


def without_password(conninfo: str) -> str:
    """The connection string with each secret parameter libpq has masked, for messages and logs."""
    params = parse_dsn(conninfo)
    secrets = secret_parameters() & params.keys()
    if not secrets:
        return conninfo
    return psycopg.conninfo.make_conninfo("", **{**params, **dict.fromkeys(secrets, "***")})


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
