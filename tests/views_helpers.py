"""Helpers for the incremental view tests: replica tables made directly
through SqliteTarget (no PostgreSQL), and comparing a view with its
defining query run from scratch."""

from __future__ import annotations

import sqlite3
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from replicator.structure import Column, TableStructure
from replicator.targets.protocol import TargetTable
from replicator.targets.sqlite.target import SqliteTarget

_TYPES = {"int": ("integer", "N"), "text": ("text", "S"), "float": ("double precision", "N")}


def table(name: str, columns: Sequence[tuple[str, str, bool]], key: Sequence[str], table_id: int,
          schema: str = "public") -> TargetTable:
    """A TargetTable as the consumer would make it: columns are (name, int|text|float, not null)."""
    cols = tuple(Column(name=n, type=_TYPES[t][0], base_type=_TYPES[t][0], category=_TYPES[t][1], not_null=nn,
                        attnum=i + 1) for i, (n, t, nn) in enumerate(columns))
    return TargetTable(source_name=f"{schema}.{name}", table_id=table_id, mode="full",
                       structure=TableStructure(schema=schema, name=name, columns=cols, key=tuple(key)),
                       copy_snapshot=None)


def _exact(value: Any) -> tuple[str, Any]:
    """A value with its storage class: 3 and 3.0 differ, as they do to typeof()."""
    return (type(value).__name__, value)


def multiset(db: sqlite3.Connection, sql: str) -> Counter[tuple[Any, ...]]:
    return Counter(tuple(_exact(v) for v in row) for row in db.execute(sql))


def view_differences(db: sqlite3.Connection, name: str, sql: str) -> str | None:
    """None when the view holds exactly the rows of its query (as multisets), else a description.
    Exactly: an integer is not its float, and floats must agree to the bit (a recomputed group
    reads its rows in the order the query does, through the same index, so even sums of
    doubles come out the same; folded ones are exact in any order)."""
    have = multiset(db, f'SELECT * FROM "{name}"')
    want = multiset(db, sql)
    if have == want:
        # the row count the catalog keeps (`view list`) follows each refresh's counts
        recorded = db.execute("SELECT rows FROM _replicator_views WHERE name = ? AND status = 'ok'",
                              (name,)).fetchone()
        if recorded is not None and recorded[0] != sum(have.values()):
            return f"view {name}: {sum(have.values())} rows, the catalog says {recorded[0]}"
        return None
    missing = want - have
    extra = have - want
    return (f"view {name}: {sum(missing.values())} row(s) missing {sorted(missing, key=repr)[:5]}, "
            f"{sum(extra.values())} extra {sorted(extra, key=repr)[:5]}")


def open_target(path: Path) -> SqliteTarget:
    return SqliteTarget(path)
