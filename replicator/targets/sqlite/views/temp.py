"""The TEMP tables of view maintenance, each made to the layout its statements expect (and made
again when it has another): the work tables of a view's refresh here, a base table's delta in
capture.py. TEMP objects belong to the target's connection only and never reach the file."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

from replicator.targets.sqlite.views.plan import Plan
from replicator.targets.sqlite.views.sql import column_definitions, quote


def ensure_temp(db: sqlite3.Connection, name: str, columns: list[tuple[str, str]],
                before: Callable[[], None] = lambda: None) -> bool:
    """TEMP table `name` of these (column, declared type)s, made again if it has others
    (an INTEGER PRIMARY KEY declared so), after calling before. Returns whether it was
    (re)made."""
    have = [(r[1], (r[2] or "") + (" PRIMARY KEY" if r[5] else ""))
            for r in db.execute(f"PRAGMA temp.table_info({quote(name)})")]
    if have == columns:
        return False
    before()
    db.execute(f"DROP TABLE IF EXISTS temp.{quote(name)}")
    db.execute(f"CREATE TEMP TABLE {quote(name)} ({column_definitions(columns)})")
    return True


def ensure_keys_table(db: sqlite3.Connection, name: str, types: list[str]) -> None:
    """TEMP table of keys c0, c1... of these types, indexed (a rowid table: by its rowid)."""
    cols = [f"c{j}" for j in range(len(types))]
    if ensure_temp(db, name, list(zip(cols, types))) and types != ["INTEGER PRIMARY KEY"]:
        db.execute(f"CREATE INDEX temp.{quote(name + '_i')} ON {quote(name)} ({', '.join(cols)})")


def ensure_rows_table(db: sqlite3.Connection, plan: Plan) -> None:
    """TEMP table of a rooted row view's recomputed rows: rowid, the view's columns."""
    ensure_temp(db, plan.rows_table, [("r", "INTEGER PRIMARY KEY")]
                + [(f"v{i}", "") for i in range(len(plan.columns))])


def ensure_fold_table(db: sqlite3.Connection, plan: Plan) -> None:
    """TEMP table of a batch's folded groups: key, the storage row (if any), what to do
    with it, the group's new view columns and state."""
    assert plan.fold is not None
    ensure_temp(db, plan.fold_table, [(f"k{j}", t) for j, t in enumerate(plan.key_types)]
                + [(c, "") for c in ["srowid", "act"] + [f"v{i}" for i in range(len(plan.columns))]
                   + [f"t{j}" for j in range(len(plan.state_columns))]])
