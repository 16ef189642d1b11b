"""`replicator execute`: run a SQL script on the source and queue its schema
changes, for databases where the DDL event triggers could not be created.

Each statement runs in one transaction with the others; after each one the
captured tables are compared with the catalog (replicator.sync_all), so a
script that mixes DDL and DML queues every change in order: rows written
after an ALTER TABLE are captured with the new columns. Where a statement
rewrote a captured table's rows (its storage changed: ALTER COLUMN ... TYPE
... USING, even to the same type), targets are asked to copy it again, as the
table_rewrite event trigger does; not where only the storage moved (SET
LOGGED/UNLOGGED, SET TABLESPACE, SET ACCESS METHOD, CLUSTER).

Scripts are read with PostgreSQL's own parser (pglast) before anything runs:
each statement is run and named as the server reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psycopg
from pglast import ast, parse_sql
from pglast.enums import AlterTableType
from pglast.parser import ParseError
from psycopg import sql

from replicator.errors import UserError
from replicator.source import Source, db
from replicator.source.command_tag import command_tag
from replicator.source.install import has_event_triggers


@dataclass(frozen=True)
class Statement:
    """One statement of a script, as PostgreSQL's grammar reads it (pglast)."""
    text: str            # through its semicolon, without the comments before it
    tree: ast.Node
    tag: str             # as the event triggers name it (command_tag)


def read_script(script: str) -> list[Statement]:
    """The script's statements, split and read by PostgreSQL's own parser
    (libpg_query, through pglast), as the server will read them (with
    standard_conforming_strings on, its default). Raises UserError, naming the
    line, for a script it cannot read: nothing of it has run then."""
    if "\0" in script:     # the parser, as libpq, would read the script only up to it
        raise _unreadable(script, script.index("\0"), "it holds a NUL character")
    try:
        raws = parse_sql(script)
    except ParseError as exc:
        message, index = exc.args
        raise _unreadable(script, index, message) from None
    return [_statement(script, raw) for raw in raws]


def _statement(script: str, raw: ast.RawStmt) -> Statement:
    """The statement the parser found at raw.stmt_location (a character index)."""
    start = raw.stmt_location or 0
    end = start + raw.stmt_len if raw.stmt_len else len(script)    # no length: the last, without semicolon
    tree = raw.stmt
    assert tree is not None     # the parser leaves out empty statements
    return Statement(script[start:end + 1].strip(), tree, command_tag(tree))


def _unreadable(script: str, index: int | None, why: str) -> UserError:
    """The refusal of a script unreadable at `index` (None: at its end)."""
    line = None if index is None else script.count("\n", 0, index) + 1
    where = f" at line {line}" if line else ""
    return UserError(f"cannot read the script{where}, nothing was applied: {why}")


def _refuse_transaction_control(statements: list[Statement]) -> None:
    """A COMMIT inside the script's one transaction would make "nothing applied on
    failure" false, a ROLLBACK would drop what came before."""
    for number, statement in enumerate(statements, 1):
        if isinstance(statement.tree, ast.TransactionStmt):
            raise UserError(f"statement {number} ({statement.tag}) controls the transaction, nothing was applied: "
                            f"`replicator execute` runs the whole script in one transaction; remove it")


# ALTER TABLE actions that give a table new storage with the same values.
_STORAGE_ACTIONS = {AlterTableType.AT_SetLogged, AlterTableType.AT_SetUnLogged, AlterTableType.AT_SetTableSpace,
                    AlterTableType.AT_SetAccessMethod, AlterTableType.AT_ClusterOn, AlterTableType.AT_DropCluster}


def storage_only(statement: ast.Node) -> bool:
    """Whether the statement can give captured tables new storage (relfilenode)
    but not new values: CLUSTER, REINDEX, TRUNCATE (its trigger queued what
    targets need), ALTER TABLE ALL IN TABLESPACE, and an ALTER TABLE whose every
    action is SET LOGGED / UNLOGGED, SET TABLESPACE, SET ACCESS METHOD (or
    CLUSTER ON, SET WITHOUT CLUSTER). As the table_rewrite event trigger, which
    tells by the rewrite's reason, `execute` then asks targets for no copy.
    Anything else that changed a relfilenode (an ALTER TABLE mixing SET LOGGED
    with ALTER COLUMN ... TYPE) counts as a rewrite."""
    if isinstance(statement, ast.AlterTableStmt):
        return all(command.subtype in _STORAGE_ACTIONS for command in statement.cmds or ())
    return isinstance(statement, (ast.ClusterStmt, ast.ReindexStmt, ast.TruncateStmt, ast.AlterTableMoveAllStmt))


def execute_script(source: Source, queue: str, script: str) -> int:
    """Runs the script in one transaction; returns the number of schema events it
    queued into `queue`, whoever queued them (the event triggers, or sync_all here)."""
    statements = read_script(script)
    queue_id = source.queue_id(queue)
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
            try:
                source.conn.execute(statement.text)
            except psycopg.errors.RaiseException:
                raise
            except psycopg.Error as exc:
                message = exc.diag.message_primary or str(exc)
                raise UserError(f"statement {number} failed, nothing was applied: {message}") from None
            if not automatic:
                after = _captured_storage(source.conn)
                rewritten = _rewritten(storage or {}, after, source.conn, storage_only(statement.tree))
                storage = after
                source.conn.execute("SELECT replicator.sync_all(%s, %s, %s::oid[])",
                                    (statement.tag, statement.text, rewritten))
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
    except UnicodeDecodeError as exc:
        raise UserError(f"cannot read {path}: it is not {exc.encoding} text "
                        f"(byte 0x{exc.object[exc.start]:02x} at offset {exc.start})") from None
    return execute_script(source, queue, script)
