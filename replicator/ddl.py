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
            try:
                source.conn.execute(statement)
            except psycopg.errors.RaiseException:
                raise
            except psycopg.Error as exc:
                message = exc.diag.message_primary or str(exc)
                raise UserError(f"statement {number} failed, nothing was applied: {message}") from None
            if not automatic:
                queued += source.conn.execute("SELECT replicator.sync_all(%s, %s)",
                                              (command_tag(statement), statement)).fetchone()[0]
    return queued


def execute_file(source: Source, queue: str, path: Path) -> int:
    try:
        script = path.read_text()
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}") from None
    return execute_script(source, queue, script)
