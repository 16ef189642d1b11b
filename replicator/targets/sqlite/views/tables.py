"""The replica's tables as the views see them: a table's columns and key for the analysis,
whether its key is the rowid, and SQLite's type affinities (whether `=` compares keys as stored)."""

from __future__ import annotations

import sqlite3
from functools import cached_property

from replicator.structure import TableStructure, target_table_name
from replicator.targets.sqlite.views.sql import quote
from replicator.views.analysis import TableInfo


class ReplicaTables:
    """The catalog the analysis reads the replica's tables from (analyse's `catalog`). Which
    tables are replicated is read once: one is made per planning."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    @cached_property
    def replicated(self) -> set[str]:
        """The replicated tables' names in the replica (lower case)."""
        names: set[str] = set()
        try:
            for (structure,) in self.db.execute("SELECT structure FROM main._replicator_tables"):
                s = TableStructure.from_json(structure)
                names.add(target_table_name(s.schema, s.name).lower())
        except sqlite3.OperationalError:
            pass
        return names

    def info(self, name: str) -> TableInfo | None:
        row = self.db.execute("SELECT name, type FROM main.sqlite_master WHERE type IN ('table', 'view')"
                              " AND name = ? COLLATE NOCASE", (name,)).fetchone()
        if row is None:
            return None
        real: str = row[0]
        kind: str = row[1]
        info = self.db.execute(f"PRAGMA main.table_info({quote(real)})").fetchall()
        columns = [(r[1], r[2] or "") for r in info]
        key = [r[1] for r in sorted((r for r in info if r[5]), key=lambda r: r[5])]
        replicated = kind == "table" and real.lower() in self.replicated
        return TableInfo(name=real, columns=columns, key=key, replicated=replicated)


def rowid_key(db: sqlite3.Connection, table: str) -> str | None:
    """The table's key column if it is the rowid (a single INTEGER PRIMARY KEY)."""
    key = [r for r in db.execute(f"PRAGMA main.table_info({quote(table)})") if r[5]]
    if len(key) != 1 or (key[0][2] or "").upper() != "INTEGER":
        return None
    # WITHOUT ROWID, or a key declared DESC: the key has an index of its own
    if any(r[3] == "pk" for r in db.execute(f"PRAGMA main.index_list({quote(table)})")):
        return None
    column: str = key[0][1]
    return column


def affinity(declared: str) -> str:
    """SQLite's column affinity of a declared type."""
    t = declared.upper()
    if "INT" in t:
        return "INTEGER"
    if any(w in t for w in ("CHAR", "CLOB", "TEXT")):
        return "TEXT"
    if not t or "BLOB" in t:
        return "BLOB"
    return "REAL" if any(w in t for w in ("REAL", "FLOA", "DOUB")) else "NUMERIC"


def compares_as_stored(key: str, other: str) -> bool:
    """Whether `key_column = other_column` compares the key's values as stored: no affinity
    is applied to them (which could make two distinct keys equal, '1' and '01' to 1)."""
    k, o = affinity(key), affinity(other)
    if k in ("INTEGER", "REAL", "NUMERIC"):
        return True
    return o in ("TEXT", "BLOB") if k == "TEXT" else o == "BLOB"
