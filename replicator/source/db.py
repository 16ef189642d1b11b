"""Connecting to the source and turning server errors a user caused into UserError."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
import psycopg.conninfo

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


# A password in a DSN: a URI's user:password@ or ?password= parameter; key=value's password=, quoted
# (to the end if the quote is never closed) or unquoted (to the next space)
_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_URI_PASSWORDS = (re.compile(r"^([^/]*//[^/?#@:]*:)[^@]*(?=@)"), re.compile(r"([?&]password=)[^&]*", re.IGNORECASE))
_KEY_VALUE_PASSWORD = re.compile(r"(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*(?:'|$)|\S+)", re.IGNORECASE)


def parse_dsn(conninfo: str) -> dict[str, Any]:
    """The parameters of a DSN; one libpq cannot read is a UserError saying why, its password masked
    (libpq's message quotes the text it stopped at: a URI whole)."""
    try:
        return psycopg.conninfo.conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError as exc:
        first_reason = first_line(exc)
    uri = _URI.match(conninfo) is not None
    masked = conninfo
    for password in _URI_PASSWORDS if uri else (_KEY_VALUE_PASSWORD,):
        masked = password.sub(r"\1***", masked)
    try:
        psycopg.conninfo.conninfo_to_dict(masked)
        reason = _unquoted(first_reason)   # the mistake is in the password (a quote never closed)
    except psycopg.ProgrammingError as exc:
        # libpq quotes the word it stopped at: of a key=value DSN, maybe the rest of a password that
        # holds a space; of a URI, the URI (masked)
        reason = first_line(exc) if uri or masked == conninfo else _unquoted(first_line(exc))
    raise UserError(f"invalid DSN (--dsn or $REPLICATOR_DSN): {reason}") from None


def _unquoted(message: str) -> str:
    """libpq's message without the text it quotes (but its "=")."""
    return re.sub(r'"[^"]*"', lambda quoted: quoted.group() if quoted.group() == '"="' else '"…"', message)


def without_password(conninfo: str) -> str:
    """The connection string with its password masked, for messages and logs."""
    params = parse_dsn(conninfo)
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
