"""`replicator execute`: run a SQL script on the source and queue its schema
changes, for databases where the DDL event triggers could not be created.

Each statement runs in one transaction with the others; after each one the
captured tables are compared with the catalog (replicator.sync_all), so a
script that mixes DDL and DML queues every change in order: rows written
after an ALTER TABLE are captured with the new columns.
"""

from __future__ import annotations

from pathlib import Path

import psycopg
import sqlparse
from psycopg import sql

from . import db
from .errors import UserError
from .install import has_event_triggers
from .source import Source


def split_statements(script: str) -> list[str]:
    """Statements of a script, without empty ones and comment-only ones."""
    statements = []
    for text in sqlparse.split(script):
        stripped = sqlparse.format(text, strip_comments=True).strip().rstrip(";").strip()
        if stripped:
            statements.append(text.strip())
    return statements


def command_tag(statement: str) -> str:
    """'ALTER TABLE', 'CREATE TABLE', 'INSERT'...: the statement's leading keywords."""
    parsed = sqlparse.parse(statement)[0]
    words = [t.normalized for t in parsed.flatten() if t.is_keyword][:2]
    if words and words[0] in ("CREATE", "ALTER", "DROP") and len(words) > 1:
        return " ".join(words)
    return words[0] if words else "UNKNOWN"


def execute_script(source: Source, queue: str, script: str) -> int:
    """Runs the script in one transaction; returns the number of schema events queued."""
    source.queue_id(queue)
    statements = split_statements(script)
    if not statements:
        raise UserError("the script holds no SQL statement")
    automatic = has_event_triggers(source.conn)
    queued = 0
    with db.user_errors(), source.conn.transaction():
        for number, statement in enumerate(statements, 1):
            before = None if automatic else _last_event_ids(source.conn)
            try:
                source.conn.execute(statement)
            except psycopg.errors.RaiseException:
                raise
            except psycopg.Error as exc:
                message = exc.diag.message_primary or str(exc)
                raise UserError(f"statement {number} failed, nothing was applied: {message}") from None
            if not automatic:
                count = source.conn.execute("SELECT replicator.sync_all(%s, %s)",
                                            (command_tag(statement), statement)).fetchone()[0]
                if count:
                    _refuse_altered_and_written(source.conn, number, before or {})
                queued += count
    return queued


def _last_event_ids(conn: psycopg.Connection) -> dict[int, int]:
    return dict(conn.execute("SELECT queue_id, replicator.last_event_id(queue_id) FROM replicator.queue").fetchall())


def _refuse_altered_and_written(conn: psycopg.Connection, number: int, before: dict[int, int]) -> None:
    """A statement that both changed a captured table's structure and wrote its rows
    (a DO block, a function): its rows were captured by the capture function of the
    old structure, yet the schema event can only follow them. Without event triggers
    their order is unknown, so the script is refused rather than replicated wrong."""
    for queue_id, last in before.items():
        rows = conn.execute(sql.SQL(
            "SELECT DISTINCT s.ev_data->>'schema', s.ev_data->>'name' FROM {events} s"
            " WHERE s.ev_txid = txid_current() AND s.ev_type = 'S' AND s.ev_id > %(last)s"
            " AND s.ev_data->>'kind' = 'altered'"
            " AND EXISTS (SELECT 1 FROM {events} r WHERE r.ev_txid = s.ev_txid AND r.ev_table = s.ev_table"
            "             AND r.ev_type <> 'S' AND r.ev_id > %(last)s AND r.ev_id < s.ev_id)").format(
                events=sql.SQL(conn.execute("SELECT replicator.event_table(%s)", (queue_id,)).fetchone()[0])),
            {"last": last}).fetchall()
        if rows:
            names = ", ".join(f"{schema}.{name}" for schema, name in sorted(rows))
            raise UserError(f"statement {number} both changes the structure of {names} and writes its rows; "
                            f"without event triggers their order cannot be captured, nothing was applied: "
                            f"run the schema change and the writes as separate statements")


def execute_file(source: Source, queue: str, path: Path) -> int:
    try:
        script = path.read_text()
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}") from None
    return execute_script(source, queue, script)
