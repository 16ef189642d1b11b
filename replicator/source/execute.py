"""`replicator execute`: run a SQL script on the source and queue its schema
changes, for databases where the DDL event triggers could not be created.

Each statement runs in one transaction with the others; after each one the
captured tables are compared with the catalog (replicator.sync_all), so a
script that mixes DDL and DML queues every change in order: rows written
after an ALTER TABLE are captured with the new columns. Where a statement
rewrote a captured table's rows (its storage changed: ALTER COLUMN ... TYPE
... USING, even to the same type), targets are asked to copy it again, as the
table_rewrite event trigger does; not where only the storage moved (SET
LOGGED/UNLOGGED, SET TABLESPACE, SET ACCESS METHOD, CLUSTER, VACUUM FULL).
"""

from __future__ import annotations

import re
from pathlib import Path

import psycopg
import sqlparse
from psycopg import sql
from sqlparse import tokens
from sqlparse.lexer import tokenize

from replicator.errors import UserError
from replicator.source import Source, db
from replicator.source.install import has_event_triggers


def split_statements(script: str) -> list[str]:
    """Statements of a script, without empty ones and comment-only ones."""
    statements = []
    for text in sqlparse.split(script):
        stripped = sqlparse.format(text, strip_comments=True).strip().rstrip(";").strip()
        if stripped:
            statements.append(text.strip())
    return statements


# Statements that end or split the script's one transaction: a COMMIT inside it would
# make "nothing applied on failure" false, a ROLLBACK would drop what came before.
_TRANSACTION_CONTROL = {"BEGIN", "START", "COMMIT", "END", "ROLLBACK", "ABORT", "SAVEPOINT", "RELEASE"}
# Words between CREATE and the kind of object, absent from PostgreSQL's command tags.
_CREATE_MODIFIERS = {"OR", "REPLACE", "UNIQUE", "TEMP", "TEMPORARY", "UNLOGGED", "GLOBAL", "LOCAL",
                     "RECURSIVE", "TRUSTED", "PROCEDURAL", "CONSTRAINT"}
_TWO_WORD_OBJECTS = {("MATERIALIZED", "VIEW"), ("FOREIGN", "TABLE"), ("EVENT", "TRIGGER")}
_DML = {"SELECT", "INSERT", "UPDATE", "DELETE", "MERGE", "VALUES", "TABLE"}


def top_level_words(statement: str) -> list[str]:
    """The statement's keywords and names, upper case, outside parentheses,
    literals and comments: 'CREATE TABLE t (a int) AS ...' gives CREATE, TABLE,
    T, AS, ... and nothing of the column list."""
    words: list[str] = []
    depth = 0
    for ttype, value in tokenize(statement):
        if ttype in tokens.Punctuation:
            depth += (value == "(") - (value == ")")
        elif depth == 0 and (ttype in tokens.Keyword or ttype in tokens.Name):
            words.extend(value.upper().split())
    return words


def command_tag(statement: str) -> str:
    """The statement's command tag as PostgreSQL's event triggers name it:
    'ALTER TABLE', 'CREATE TABLE AS', 'SELECT INTO', 'CREATE INDEX' (also for
    CREATE UNIQUE INDEX), 'TRUNCATE TABLE', 'INSERT'..."""
    words = top_level_words(statement)
    if not words:
        return "UNKNOWN"
    verb, rest = words[0], words[1:]
    if verb == "WITH":   # the statement the common table expressions are for
        verb = next((w for w in rest if w in _DML), verb)
    if verb in ("CREATE", "ALTER", "DROP"):
        if verb == "CREATE":
            rest = [w for w in rest if w not in _CREATE_MODIFIERS]
        kind = rest[:2] if tuple(rest[:2]) in _TWO_WORD_OBJECTS else rest[:1]
        tag = " ".join([verb, *kind])
        if tag == "CREATE TABLE" and "AS" in rest:
            return "CREATE TABLE AS"
        return tag
    if verb == "SELECT" and "INTO" in rest:
        return "SELECT INTO"
    if verb in ("TRUNCATE", "LOCK"):
        return f"{verb} TABLE"
    return verb


def transaction_control(statement: str) -> str | None:
    """The statement's leading words when it controls the transaction (BEGIN,
    COMMIT, SAVEPOINT, PREPARE TRANSACTION...), else None."""
    words = top_level_words(statement)
    if words[:1] and words[0] in _TRANSACTION_CONTROL:
        return "START TRANSACTION" if words[0] == "START" else words[0]
    if words[:2] == ["PREPARE", "TRANSACTION"]:
        return "PREPARE TRANSACTION"
    return None


def _refuse_transaction_control(statements: list[str]) -> None:
    for number, statement in enumerate(statements, 1):
        control = transaction_control(statement)
        if control:
            raise UserError(f"statement {number} ({control}) controls the transaction, nothing was applied: "
                            f"`replicator execute` runs the whole script in one transaction; remove it")


# Statements that give a table new storage with the same values: no copy needed. A
# TRUNCATE's trigger already queued what targets need (a T, or a copy for a partition).
_STORAGE_ONLY_TAGS = {"CLUSTER", "VACUUM", "REINDEX", "TRUNCATE TABLE"}
_NAME = r'(?:"(?:[^"]|"")+"|[A-Z_][A-Z0-9_$]*)'
_STORAGE_ACTION = (rf"(?:SET (?:LOGGED|UNLOGGED)|SET TABLESPACE {_NAME}(?: NOWAIT)?|SET ACCESS METHOD {_NAME}"
                   rf"|SET WITHOUT CLUSTER|CLUSTER ON {_NAME})")
_STORAGE_ONLY_ALTER = re.compile(
    rf"ALTER TABLE (?:IF EXISTS )?(?:ONLY )?{_NAME}(?: ?\. ?{_NAME})*(?: \*)? {_STORAGE_ACTION}"
    rf"(?: ?, ?{_STORAGE_ACTION})*"
    rf"|ALTER TABLE ALL IN TABLESPACE {_NAME}(?: OWNED BY {_NAME}(?: ?, ?{_NAME})*)?"
    rf" SET TABLESPACE {_NAME}(?: NOWAIT)?")


def storage_only(statement: str, tag: str) -> bool:
    """Whether the statement can give captured tables new storage (relfilenode)
    but not new values: CLUSTER, VACUUM FULL, REINDEX, TRUNCATE (its trigger queued
    what targets need), and an ALTER TABLE whose every action is SET LOGGED /
    UNLOGGED, SET TABLESPACE, SET ACCESS METHOD (or CLUSTER ON, SET WITHOUT
    CLUSTER). As the table_rewrite event trigger, which tells by the rewrite's
    reason, `execute` then asks targets for no copy. Anything else that changed a
    relfilenode (an ALTER TABLE mixing SET LOGGED with ALTER COLUMN ... TYPE)
    counts as a rewrite."""
    if tag in _STORAGE_ONLY_TAGS:
        return True
    if tag != "ALTER TABLE":
        return False
    text = " ".join(sqlparse.format(statement, strip_comments=True).split()).rstrip(";").strip().upper()
    return _STORAGE_ONLY_ALTER.fullmatch(text) is not None


def execute_script(source: Source, queue: str, script: str) -> int:
    """Runs the script in one transaction; returns the number of schema events it
    queued into `queue`, whoever queued them (the event triggers, or sync_all here)."""
    queue_id = source.queue_id(queue)
    statements = split_statements(script)
    if not statements:
        raise UserError("the script holds no SQL statement")
    _refuse_transaction_control(statements)
    automatic = has_event_triggers(source.conn)
    if not automatic:
        # DDL run directly since is followed first, and every capture function gets its
        # guard (replicator.capture_guard): a statement that changes a captured table and
        # then writes it (a DO block, a function) has its rows captured in the new layout,
        # after the change's S event
        with db.user_errors():
            source.conn.execute("SELECT replicator.follow_unseen_ddl(%s)", (queue,))
    with db.user_errors(), source.conn.transaction():
        # Each statement's storage "after" is the next one's "before" (read once). It is
        # read before sync_all, which may capture a table the statement created (a
        # followed schema): a later rewrite of it is then not seen, and need not be,
        # since targets copy a new table after this transaction committed.
        storage = None if automatic else _captured_storage(source.conn)
        for number, statement in enumerate(statements, 1):
            tag = command_tag(statement)
            try:
                source.conn.execute(statement)
            except psycopg.errors.RaiseException:
                raise
            except psycopg.Error as exc:
                message = exc.diag.message_primary or str(exc)
                raise UserError(f"statement {number} failed, nothing was applied: {message}") from None
            if not automatic:
                after = _captured_storage(source.conn)
                rewritten = _rewritten(storage or {}, after, source.conn, storage_only(statement, tag))
                storage = after
                source.conn.execute("SELECT replicator.sync_all(%s, %s, %s::oid[])", (tag, statement, rewritten))
        return _schema_events_queued(source.conn, queue_id)


def _schema_events_queued(conn: psycopg.Connection, queue_id: int) -> int:
    """S events the open transaction queued into the queue (its event table is
    indexed on ev_txid)."""
    event_table = db.scalar(conn, "SELECT replicator.event_table(%s)", (queue_id,))
    query = sql.SQL("SELECT count(*) FROM {} WHERE ev_txid = txid_current() AND ev_type = 'S'").format(
        sql.SQL(event_table))   # quoted by the server: replicator.event_table()
    row = conn.execute(query).fetchone()
    return int(row[0]) if row else 0


def _captured_storage(conn: psycopg.Connection) -> dict[int, tuple[int, int]]:
    """relfilenode of each relation holding rows of a captured table (the table or
    a descendant), and the oid of that captured table."""
    return {relid: (node, table) for relid, node, table in
            conn.execute("SELECT relid, relfilenode, table_oid FROM replicator.captured_storage()")}


def _rewritten(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]],
               conn: psycopg.Connection, only_storage: bool) -> list[int]:
    """Relations whose storage the statement replaced: their rows were rewritten
    without row triggers (no event trigger tells, without the privilege), unless
    the statement only moves storage (see storage_only). A relation gone (a
    dropped partition or inheritance child) took its rows out of its captured
    table without row triggers: that table counts as rewritten."""
    rewritten = set() if only_storage else {
        oid for oid, (node, _) in before.items() if oid in after and after[oid][0] != node}
    gone = [oid for oid in before if oid not in after]     # dropped, or no longer in the tree
    if gone:
        existing = {oid for (oid,) in conn.execute("SELECT oid FROM pg_class WHERE oid = ANY (%s::oid[])", (gone,))}
        rewritten |= {before[oid][1] for oid in gone if oid not in existing}
    return sorted(rewritten)


def execute_file(source: Source, queue: str, path: Path) -> int:
    try:
        script = path.read_text()
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}") from None
    return execute_script(source, queue, script)
