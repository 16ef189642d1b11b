"""A view's storage in the replica, and the indexes its maintenance seeks through.

A view NAME is stored in table ``_replicator_mv_NAME`` (its key columns, then the query's
columns) and read through the SQL view ``NAME``, which shows exactly the defining query's
columns. Its key indexes are the upserts' conflict targets; helper indexes on base tables serve
the join columns and GROUP BY columns statements seek through. Without them every affected key
would scan a table: one another connection dropped is made again."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterable, Sequence

from replicator.targets.sqlite.views import names
from replicator.targets.sqlite.views.names import INDEX_PREFIX
from replicator.targets.sqlite.views.plan import Plan
from replicator.targets.sqlite.views.sql import quote
from replicator.targets.sqlite.views.tables import rowid_key

log = logging.getLogger("replicator")


def create(db: sqlite3.Connection, plan: Plan) -> None:
    """The view's storage table (empty) with its key indexes, and the SQL view over it."""
    storage = quote(plan.storage)
    db.execute(f"DROP VIEW IF EXISTS main.{quote(plan.name)}")
    db.execute(f"DROP TABLE IF EXISTS main.{storage}")
    db.execute(f"CREATE TABLE main.{storage} ({plan.storage_definition()})")
    for _, create_index in key_indexes(plan):
        db.execute(create_index)
    db.execute(f"CREATE VIEW main.{quote(plan.name)} AS SELECT "
               f"{', '.join(quote(c) for c, _ in plan.columns)} FROM main.{storage}")


def drop(db: sqlite3.Connection, name: str) -> None:
    """A view's SQL view and storage table."""
    db.execute(f"DROP VIEW IF EXISTS main.{quote(name)}")
    db.execute(f"DROP TABLE IF EXISTS main.{quote(names.STORAGE_PREFIX + name)}")


def layout(db: sqlite3.Connection, plan: Plan) -> list[str]:
    """The columns of a view's storage table as it is."""
    return [r[1] for r in db.execute(f"PRAGMA main.table_info({quote(plan.storage)})")]


def key_indexes(plan: Plan) -> list[tuple[str, str]]:
    """(name, CREATE INDEX) of each index of a view's storage: the unique key (the
    upserts' conflict target; it also serves the first table's keys) and, for a row
    view, each other table's keys. A rooted view is stored by its rowid: none."""
    a = plan.analysis
    if plan.mode != "incremental" or a is None or plan.root is not None:
        return []
    storage = quote(plan.storage)
    indexes = [(plan.storage + "_k", "UNIQUE INDEX", plan.key_columns)]
    if a.kind == "rows":
        indexes += [(plan.storage + f"_k{i}", "INDEX", plan.occurrence_key_columns(i))
                    for i in range(1, len(a.occurrences))]
    return [(name, f"CREATE {kind} main.{quote(name)} ON {storage} ({', '.join(quote(c) for c in columns)})")
            for name, kind, columns in indexes]


def ensure_helper_indexes(db: sqlite3.Connection, plan: Plan) -> list[str]:
    """Makes the helper indexes a view's maintenance seeks through, unless an index
    of the table already starts with their columns. Returns the names of those made."""
    made = []
    for table, columns in plan.indexes:
        want = [c.lower() for c in columns]
        if want[0] == (rowid_key(db, table) or "").lower():
            continue   # the rowid
        covered = False
        for row in db.execute(f"PRAGMA main.index_list({quote(table)})").fetchall():
            have = [(r[2] or "").lower() for r in db.execute(f"PRAGMA main.index_info({quote(row[1])})")]
            if have[:len(want)] == want and not row[4]:   # not a partial index
                covered = True
                break
        if not covered:
            name = names.helper_index(table, columns)
            db.execute(f"CREATE INDEX main.{quote(name)} ON {quote(table)} "
                       f"({', '.join(quote(c) for c in columns)})")
            made.append(name)
    return made


def restore_indexes(db: sqlite3.Connection, plans: Iterable[Plan]) -> None:
    """Makes again the storage and helper indexes of these views that another connection
    dropped (by hand, say)."""
    for plan in plans:
        try:
            made = ensure_helper_indexes(db, plan)
            have = {r[1] for r in db.execute(f"PRAGMA main.index_list({quote(plan.storage)})")}
            for name, create_index in key_indexes(plan):
                if name not in have:
                    db.execute(create_index)
                    made.append(name)
        except sqlite3.Error as exc:
            # a table dropped by hand too: the view's refresh fails and marks it stale
            log.warning("view %s: its indexes could not be made again: %s", plan.name, exc)
            continue
        if made:
            log.warning("view %s: made its dropped indexes again: %s", plan.name, ", ".join(made))


def drop_helper_indexes_on(db: sqlite3.Connection, table: str, columns: Sequence[str]) -> None:
    """The helper indexes of a table that hold any of these columns (which they would keep
    from being dropped)."""
    drop = {c.lower() for c in columns}
    for row in db.execute(f"PRAGMA main.index_list({quote(table)})").fetchall():
        if row[1].startswith(INDEX_PREFIX):
            held = [r[2] for r in db.execute(f"PRAGMA main.index_info({quote(row[1])})")]
            if drop & {c.lower() for c in held}:
                db.execute(f"DROP INDEX IF EXISTS main.{quote(row[1])}")


def drop_unused_helper_indexes(db: sqlite3.Connection, plans: Iterable[Plan]) -> None:
    """Helper indexes none of these views needs."""
    needed = {names.helper_index(table, columns) for plan in plans for table, columns in plan.indexes}
    rows = db.execute("SELECT name FROM main.sqlite_master WHERE type = 'index'"
                      " AND substr(name, 1, ?) = ?", (len(INDEX_PREFIX), INDEX_PREFIX)).fetchall()
    for (name,) in rows:
        if name not in needed:
            db.execute(f"DROP INDEX IF EXISTS main.{quote(name)}")
