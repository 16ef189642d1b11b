"""SQLite target: the embedded default.

The replica is a SQLite file in WAL mode, so readers are never blocked and
never see part of a batch. The consumer position and the list of replicated
tables live in two tables of the same file, written in the same transaction
as the rows: a crash at any point leaves the file at a batch boundary.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable
from contextlib import closing
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..schema import Change, Column, TableStructure, sqlite_type, target_table_name
from . import Row, TargetTable
from .sqlite_views import SqliteViews

# WAL: readers are never blocked and see whole batches. FULL: a commit is on
# disk before the source is told the batch is finished; with NORMAL a power
# loss could take back batches whose ticks and events the source has since
# cleaned up (an fsync of the WAL per batch: about 0.3 ms here). A page cache
# of 64 MiB instead of SQLite's 2 MiB: random key updates of a table of more
# than a few MB otherwise go to the OS per page.
PRAGMAS = ("journal_mode = WAL", "synchronous = FULL", "cache_size = -65536")
_STATE = "_replicator_position"
_TABLES = "_replicator_tables"


def is_replica(path: Path) -> bool:
    """Whether a SQLite file is one a consumer writes, read without changing it
    (opening it as a target would make any SQLite file one)."""
    if not path.is_file():
        return False
    try:
        with closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as db:
            return db.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (_TABLES,)).fetchone() is not None
    except sqlite3.DatabaseError as exc:
        raise UserError(f"cannot use {path} as a SQLite target: {exc}") from None


def quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


class SqliteTarget:
    exactly_once = True

    def __init__(self, path: Path) -> None:
        self.path = path.expanduser().resolve()
        self.name = f"sqlite:{self.path}"
        if not self.path.parent.is_dir():
            raise UserError(f"cannot create {self.path}: directory {self.path.parent} does not exist")
        try:
            self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            for pragma in PRAGMAS:
                self.db.execute(f"PRAGMA {pragma}")
            self.db.execute(f"CREATE TABLE IF NOT EXISTS {_STATE} (queue TEXT, consumer TEXT, last_tick INTEGER,"
                            " PRIMARY KEY (queue, consumer))")
            self.db.execute(f"CREATE TABLE IF NOT EXISTS {_TABLES} (source_name TEXT PRIMARY KEY,"
                            " table_id INTEGER, mode TEXT, structure TEXT, copy_snapshot TEXT)")
            self.views = SqliteViews(self.db)   # incremental views, refreshed in commit()
        except sqlite3.Error as exc:
            raise UserError(f"cannot use {self.path} as a SQLite target: {exc}") from None
        self._statements: dict[tuple[str, str], str] = {}

    # state ---------------------------------------------------------------------

    def positions(self, queue: str) -> dict[str, int]:
        return dict(self.db.execute(f"SELECT consumer, last_tick FROM {_STATE} WHERE queue = ?", (queue,)))

    def set_position(self, queue: str, consumer: str, tick_id: int) -> None:
        self.db.execute(f"INSERT OR REPLACE INTO {_STATE} (queue, consumer, last_tick) VALUES (?, ?, ?)",
                        (queue, consumer, tick_id))

    def tables(self) -> dict[str, TargetTable]:
        return {name: TargetTable(source_name=name, table_id=table_id, mode=mode,
                                  structure=TableStructure.from_json(structure), copy_snapshot=snapshot)
                for name, table_id, mode, structure, snapshot in self.db.execute(
                    f"SELECT source_name, table_id, mode, structure, copy_snapshot FROM {_TABLES}")}

    def save_table(self, table: TargetTable) -> None:
        self.db.execute(f"INSERT OR REPLACE INTO {_TABLES} VALUES (?, ?, ?, ?, ?)",
                        (table.source_name, table.table_id, table.mode, table.structure.to_json(),
                         table.copy_snapshot))

    # transactions ----------------------------------------------------------------

    def begin(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            self.views.begun()
        except BaseException:
            self.rollback()
            raise

    def commit(self) -> None:
        self.views.before_commit()
        self.db.execute("COMMIT")

    def rollback(self) -> None:
        if self.db.in_transaction:
            self.db.execute("ROLLBACK")
        self.views.rolled_back()

    def close(self) -> None:
        self.db.close()

    # tables ------------------------------------------------------------------------

    @staticmethod
    def table_name(table: TargetTable) -> str:
        return target_table_name(table.structure.schema, table.structure.name)

    def create_table(self, table: TargetTable) -> None:
        """(Re)creates the replica table, empty, and records it."""
        self._check_name_is_free(table)
        s = table.structure
        name = quote(self.table_name(table))
        columns = [f"{quote(c.name)} {self._column_type(s, c)}" for c in s.columns]
        self.views.schema_changing(self.table_name(table))
        self.db.execute(f"DROP TABLE IF EXISTS {name}")
        self.db.execute(f"CREATE TABLE {name} ({', '.join(columns)}, "
                        f"PRIMARY KEY ({', '.join(quote(k) for k in s.key)}))")
        self._statements.clear()
        self.save_table(table)

    @staticmethod
    def _column_type(structure: TableStructure, column: Column) -> str:
        """sqlite_type(), except for a nullable one-column INTEGER key: declared INTEGER it
        would be an alias of the rowid, which stores NULL as a new number; INT has the
        same affinity and stores NULL."""
        declared = sqlite_type(column)
        if declared == "INTEGER" and structure.key == (column.name,) and not column.not_null:
            return "INT"
        return declared

    def _check_name_is_free(self, table: TargetTable) -> None:
        """Two source tables must not become one SQLite table (public."s__t" and s.t,
        or "T" and t: SQLite names are case-insensitive)."""
        name = self.table_name(table)
        for other in self.tables().values():
            if other.source_name != table.source_name and self.table_name(other).lower() == name.lower():
                raise UserError(f"{other.source_name} and {table.source_name} would both be table {name!r} of "
                                f"{self.name}: replicate them into separate targets (consume --tables)")

    def drop_table(self, table: TargetTable) -> None:
        self.views.schema_changing(self.table_name(table))
        self.db.execute(f"DROP TABLE IF EXISTS {quote(self.table_name(table))}")
        self.db.execute(f"DELETE FROM {_TABLES} WHERE source_name = ?", (table.source_name,))
        self._statements.clear()

    def alter_table(self, old: TargetTable, new: TargetTable, changes: list[Change]) -> None:
        """Applies a reconciled schema change in place (see schema.reconcile)."""
        if self.table_name(new).lower() != self.table_name(old).lower():
            self._check_name_is_free(new)
        name = quote(self.table_name(old))
        self.views.schema_changing(self.table_name(old), tuple(c.name for c in changes if c.action == "drop_column"))
        if self.table_name(new) != self.table_name(old):
            self.views.schema_changing(self.table_name(new))
        for change in changes:
            if change.action == "rename_table":
                name = quote(self.table_name(new))
                self.db.execute(f"ALTER TABLE {quote(self.table_name(old))} RENAME TO {name}")
            elif change.action == "rename_column":
                self.db.execute(f"ALTER TABLE {name} RENAME COLUMN {quote(change.name)} TO {quote(change.new_name)}")
            elif change.action == "drop_column":
                self.db.execute(f"ALTER TABLE {name} DROP COLUMN {quote(change.name)}")
            elif change.action == "add_column":
                assert change.column is not None
                self.db.execute(f"ALTER TABLE {name} ADD COLUMN {quote(change.name)} {sqlite_type(change.column)}")
        if old.source_name != new.source_name:
            self.db.execute(f"DELETE FROM {_TABLES} WHERE source_name = ?", (old.source_name,))
        self.save_table(new)
        self._statements.clear()

    def schema_event(self, table: TargetTable, event: dict[str, Any]) -> None:
        """Nothing to record: the replica's structure is the record."""

    # changes -----------------------------------------------------------------------

    def _statement(self, table: TargetTable, kind: str) -> str:
        cached = self._statements.get((table.source_name, kind))
        if cached:
            return cached
        s = table.structure
        name = quote(self.table_name(table))
        if kind == "upsert":
            stmt = (f"INSERT OR REPLACE INTO {name} ({', '.join(quote(c) for c in s.column_names)}) "
                    f"VALUES ({', '.join('?' for _ in s.columns)})")
        else:
            # IS matches NULL keys too (a --key column may be nullable) and still uses the index.
            stmt = f"DELETE FROM {name} WHERE " + " AND ".join(f"{quote(k)} IS ?" for k in s.key)
        self._statements[(table.source_name, kind)] = stmt
        return stmt

    def upsert(self, table: TargetTable, op: str, rows: Iterable[Row]) -> None:
        self.views.note_write(self.table_name(table))
        if op != "R" and not all(c.not_null for c in table.structure.key_columns()):
            # A NULL in a SQLite key never conflicts (INSERT OR REPLACE would add a second
            # row): a key with nullable columns (--key, the automatic key) is replaced by
            # hand, row by row, so that rows of one call with the same key replace each other.
            delete, insert = self._statement(table, "delete"), self._statement(table, "upsert")
            positions = table.structure.key_positions()
            for row in rows:
                self.db.execute(delete, [row[i] for i in positions])
                self.db.execute(insert, row)
            return
        self.db.executemany(self._statement(table, "upsert"), rows)

    def delete(self, table: TargetTable, keys: Iterable[Row]) -> None:
        self.views.note_write(self.table_name(table))
        self.db.executemany(self._statement(table, "delete"), keys)

    def truncate(self, table: TargetTable) -> None:
        self.views.table_truncated(self.table_name(table))
        self.db.execute(f"DELETE FROM {quote(self.table_name(table))}")

    def copy_from(self, table: TargetTable, snap: Any, progress: Callable[[int], None]) -> None:
        """The consumer copies through upsert()."""
        return None
