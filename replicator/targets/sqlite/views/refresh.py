"""Refreshing a view, in the batch's transaction just before its COMMIT: incrementally from the
transaction's deltas (what the policy auto decides, see auto.py), or in full; each refresh is
recorded in the refresh log.

- aggregate and DISTINCT views: the affected keys are the key values (GROUP BY values, or the
  selected values) of every combination of rows that has at least one delta row: the query's
  FROM/WHERE evaluated once per non-empty subset of its tables, those tables read from their
  deltas (old and new rows), the others from the replica. A combination that disappeared has a
  component in the delta (an old row) and the others in the replica or the delta; one that
  appeared has a new row in the delta and the others in the replica: so no affected key is
  missed; unaffected ones found too are only recomputed for nothing. The batch's delta is folded
  into the groups it can be (see Fold); the other affected keys are recomputed by the defining
  query restricted to them (joined to the keys with the null-safe ``IS``) and upserted with the
  refresh's generation, and their rows that did not get it are swept;
- row views (filter/projection, inner joins): each storage row carries the keys of the base rows
  it combines; the combinations of the replica that hold a changed base row are upserted, each
  once, and the rows of every changed base key that did not come again are deleted;
- rooted row views, whose rows are one to one with the rows of a table with an INTEGER PRIMARY
  KEY (the others join through their keys): stored by that rowid, without indexes; the affected
  rowids' rows are computed into a TEMP table, then copied (see statements.rooted_statements)."""

from __future__ import annotations

import sqlite3
import time

from replicator.targets.sqlite.views import auto, catalog, names, statements
from replicator.targets.sqlite.views.capture import Capture
from replicator.targets.sqlite.views.catalog import Counts
from replicator.targets.sqlite.views.plan import Plan
from replicator.targets.sqlite.views.sql import quote

CACHE_KIB = 131072             # page cache of a connection that maintains views (KiB): see grow_page_cache


def grow_page_cache(db: sqlite3.Connection) -> None:
    """Recomputing keys reads and writes pages all over the base tables and the
    views: a page cache of SQLite's default 2 MB makes each of those a system call,
    and with fewer pages than a batch dirties (its rows, their indexes, the view's
    pages) SQLite spills them to the WAL in the middle of the transaction: the 1M-row
    join of docs/benchmarks.md refreshes a 1 % batch in 110 ms with 64 MB, 75 with 128."""
    size = db.execute("PRAGMA cache_size").fetchone()[0]
    if -CACHE_KIB < size < 0 or 0 <= size < CACHE_KIB // 4:
        db.execute(f"PRAGMA cache_size = -{CACHE_KIB}")


class Savepoint:
    """Undoes what a failed refresh wrote, so that the batch goes on without that view.

    Opened only before the first statement that computes a view's values while writing its
    storage: a savepoint journals the original of every page the refresh then touches (half the
    refresh's time on a 1M-row join). A rooted row view computes its rows into a TEMP table and
    then only copies them: it needs none. A copy can only fail on I/O (a full disk): the batch
    fails whole then, as it would applying its rows."""

    NAME = "replicator_view"

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self.opened = False
        self.copying = False   # a failure from now on is the batch's

    def before_computing(self) -> None:
        if not self.opened:
            self.db.execute(f"SAVEPOINT {self.NAME}")
            self.opened = True

    def before_copying(self) -> None:
        self.copying = True

    def release(self) -> None:
        if self.opened:
            self.db.execute(f"RELEASE {self.NAME}")

    def undo(self) -> None:
        if self.opened:
            self.db.execute(f"ROLLBACK TO {self.NAME}")
            self.db.execute(f"RELEASE {self.NAME}")


class Refresher:
    """Refreshes the views of a target's connection from the changes its capture holds."""

    def __init__(self, db: sqlite3.Connection, capture: Capture) -> None:
        self.db = db
        self.capture = capture

    def refresh(self, plan: Plan, *, full_reason: str | None = None, savepoint: Savepoint | None = None) -> bool:
        """Refreshes one view from this transaction's deltas (or in full) and records it.
        Returns whether its rows changed. Without a savepoint, a failure is the caller's to undo."""
        started = time.perf_counter()
        rows, seq = catalog.rows_and_seq(self.db, plan.name)
        counts = Counts()
        if full_reason is None and plan.mode == "full":
            full_reason = plan.reason.code if plan.reason else "POLICY_FULL"
        if full_reason is None:
            a = plan.analysis
            assert a is not None
            with_delta = self.capture.changed(a)
            if any(not self.capture.captured(a.occurrences[i].table.name) for i in with_delta):
                full_reason = "UNTRACKED"
            elif with_delta:
                full_reason = self._incremental(plan, with_delta, rows, seq + 1, counts, started, savepoint)
        if full_reason is not None:
            kind, reason = "full", full_reason
            if savepoint:
                savepoint.before_computing()
            counts.deleted, counts.inserted = self._full(plan)
            counts.updated = 0
            rows = counts.inserted
        else:
            rows += counts.inserted - counts.deleted
            kind, reason = ("incremental", "") if counts.keys else ("none", "NO_AFFECTED_KEYS")
        catalog.record(self.db, plan.name, kind, reason, counts, time.perf_counter() - started, rows)
        return bool(counts.deleted or counts.inserted or counts.updated)

    def _incremental(self, plan: Plan, with_delta: set[int], rows: int, gen: int, counts: Counts,
                     started: float, savepoint: Savepoint | None) -> str | None:
        """Recomputes the affected keys; returns why it must be a full refresh instead, if so."""
        a = plan.analysis
        assert a is not None
        key = tuple(sorted(with_delta))
        costs = auto.learned_costs(self.db, plan.name) if plan.policy == "auto" else None
        if plan.policy == "auto":
            # A large change is seen before any key is computed: changed rows against
            # the (approximate) size of their tables, or the cost they predict.
            changed = sum(auto.changed_rows(self.db, a.occurrences[i].table.name) for i in key) // 2
            size = sum(auto.table_rows(self.db, a.occurrences[i].table.name) for i in key) if costs is None else 0
            why = auto.says_full(costs, changed, changed, size, "base rows changed")
            if why:
                return why
        if plan.root is not None:
            return self._incremental_rooted(plan, key, rows, costs, counts, started, savepoint)
        if a.kind == "rows":
            return self._incremental_rows(plan, key, rows, gen, costs, counts, started, savepoint)
        return self._incremental_groups(plan, key, rows, gen, costs, counts, started, savepoint)

    def _incremental_rooted(self, plan: Plan, key: tuple[int, ...], rows: int, costs: tuple[float, float] | None,
                            counts: Counts, started: float, savepoint: Savepoint | None) -> str | None:
        """A rooted row view: its affected rowids, their rows computed into a TEMP table
        (where a failing expression fails before anything is written), then copied."""
        *fills, compute, present, write, sweep = statements.rooted_statements(plan, key)
        self.db.execute(f"DELETE FROM temp.{quote(plan.keys_table)}")
        self.db.execute(f"DELETE FROM temp.{quote(plan.rows_table)}")
        counts.keys = sum(self.db.execute(stmt).rowcount for stmt in fills)
        if not counts.keys:
            return None
        if plan.policy == "auto":
            why = auto.says_full(costs, counts.keys, counts.keys, rows, "rows", started)
            if why:
                return why
        computed = self.db.execute(compute).rowcount
        counts.updated = self.db.execute(present).fetchone()[0]
        if savepoint:
            savepoint.before_copying()
        self.db.execute(write)
        counts.deleted = self.db.execute(sweep).rowcount
        counts.inserted = computed - counts.updated
        return None

    def _incremental_rows(self, plan: Plan, key: tuple[int, ...], rows: int, gen: int,
                          costs: tuple[float, float] | None, counts: Counts, started: float,
                          savepoint: Savepoint | None) -> str | None:
        """Other row views: the combinations holding a changed base row are upserted with
        generation `gen` (updated in place, or inserted with a rowid above the largest one
        before); the rows naming a changed key that did not get it are gone (swept)."""
        a = plan.analysis
        assert a is not None
        storage = f"main.{quote(plan.storage)}"
        params = {"replicator_gen": gen}
        for table in {a.occurrences[i].table.name for i in key}:
            self.db.execute(f"DELETE FROM temp.{quote(names.changed_keys_table(table))}")
        filled: set[str] = set()
        for i in key:
            if a.occurrences[i].table.name not in filled:
                filled.add(a.occurrences[i].table.name)
                counts.keys += self.db.execute(statements.changed_keys_fill(plan, i)).rowcount
        if not counts.keys:
            return None
        if plan.policy == "auto":
            # no history yet: count the rows the keys touch (an index scan per key)
            touched = counts.keys if costs is not None else max(counts.keys, sum(
                self.db.execute(statements.rows_count(plan, (i,))).fetchone()[0] for i in key))
            why = auto.says_full(costs, counts.keys, touched, rows, "rows", started)
            if why:
                return why
        if savepoint:
            savepoint.before_computing()
        before = self.db.execute(f"SELECT coalesce(max(rowid), 0) FROM {storage}").fetchone()[0]
        upserted = sum(self.db.execute(statements.rows_upsert(plan, i, key), params).rowcount for i in key)
        counts.deleted = sum(self.db.execute(statements.rows_sweep(plan, i), params).rowcount for i in key)
        counts.inserted = self.db.execute(f"SELECT count(*) FROM {storage} WHERE rowid > ?", (before,)).fetchone()[0]
        counts.updated = upserted - counts.inserted
        return None

    def _incremental_groups(self, plan: Plan, key: tuple[int, ...], rows: int, gen: int,
                            costs: tuple[float, float] | None, counts: Counts, started: float,
                            savepoint: Savepoint | None) -> str | None:
        """Aggregate and DISTINCT views: the batch's delta folded into the groups it can
        be (see Fold), the other affected keys recomputed from their rows and upserted
        with generation `gen`; their rows that did not get it are gone (swept). A fold
        that recomputes no group only copies what its TEMP table holds: no savepoint."""
        storage = f"main.{quote(plan.storage)}"
        params = {"replicator_gen": gen}
        self.db.execute(f"DELETE FROM temp.{quote(plan.keys_table)}")
        folding = plan.fold is not None
        if folding:
            fill, update, insert, delete, redo = statements.fold_statements(plan)
            self.db.execute(f"DELETE FROM temp.{quote(plan.fold_table)}")
            try:
                counts.keys = self.db.execute(fill).rowcount
            except sqlite3.OperationalError as exc:
                if "overflow" not in str(exc):
                    raise
                folding = False   # a sum of the batch overflows: recompute its groups
        if not folding:
            counts.keys = self.db.execute(statements.keys_fill(plan, key)).rowcount
        if not counts.keys:
            return None
        # the groups recomputed from their rows: a fold's others cost what the batch's rows
        # do, however large a share of the view they are (every group of a view of a few)
        recomputed = self.db.execute(redo).rowcount if folding else counts.keys
        if plan.policy == "auto":
            why = auto.says_full(costs, counts.keys, recomputed, rows,
                                 "groups to recompute" if folding else "keys", started)
            if why:
                return why
        recompute = recomputed > 0
        if savepoint:
            if recompute:
                savepoint.before_computing()
            else:
                savepoint.before_copying()
        if folding:
            counts.updated = self.db.execute(update).rowcount
            counts.inserted = self.db.execute(insert, params).rowcount
            counts.deleted = self.db.execute(delete).rowcount
        if recompute:
            # new rows get rowids above the largest one left (the fold may have deleted it)
            mark = self.db.execute(f"SELECT coalesce(max(rowid), 0) FROM {storage}").fetchone()[0]
            upserted = self.db.execute(statements.keys_upsert(plan), params).rowcount
            counts.deleted += self.db.execute(statements.keys_sweep(plan), params).rowcount
            new = self.db.execute(f"SELECT count(*) FROM {storage} WHERE rowid > ?", (mark,)).fetchone()[0]
            counts.updated += upserted - new
            counts.inserted += new
        return None

    def _full(self, plan: Plan) -> tuple[int, int]:
        """Recomputes all of it. The key indexes are built again afterwards: one
        sort beats maintaining them row by row (and keeps auto's full refresh as
        cheap as a view without keys)."""
        deleted = catalog.row_count(self.db, plan.name)
        indexes = self.db.execute("SELECT name, sql FROM main.sqlite_master WHERE type = 'index' AND tbl_name = ?"
                                  " AND sql IS NOT NULL", (plan.storage,)).fetchall()
        for name, _ in indexes:
            self.db.execute(f"DROP INDEX main.{quote(name)}")
        self.db.execute(f"DELETE FROM main.{quote(plan.storage)}")
        inserted = self.db.execute(plan.full_insert).rowcount
        for _, sql in indexes:
            self.db.execute(sql)
        return deleted, inserted
