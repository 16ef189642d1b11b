"""Incremental views of a SQLite target: storage, capture of changes, refresh.

A view NAME is stored in table ``_replicator_mv_NAME`` (its key columns, then
the query's columns) and read through the SQL view ``NAME``, which shows
exactly the defining query's columns. Definitions live in
``_replicator_views``; every refresh is recorded in ``_replicator_view_refresh``.

Capture. While a batch is applied, TEMP triggers on every base table of an
incremental view copy the old and new rows of each change into a TEMP delta
table of the same columns (INSERT OR REPLACE does not report the row it
replaces, so a BEFORE INSERT trigger reads it by key). TEMP objects belong to
the target's connection only and never reach the file.

Refresh, just before the batch's COMMIT, in its transaction:

- aggregate and DISTINCT views: the affected keys are the key values (GROUP BY
  values, or the selected values) of every combination of rows that has at
  least one delta row: the query's FROM/WHERE evaluated once per non-empty
  subset of its tables, those tables read from their deltas (old and new
  rows), the others from the replica. A combination that disappeared has a
  component in the delta (an old row) and the others in the replica or the
  delta; one that appeared has a new row in the delta and the others in the
  replica: so no affected key is missed; unaffected ones found too are only
  recomputed for nothing. Those keys are deleted from the storage and
  re-inserted by the defining query restricted to them (joined to the keys
  with the null-safe ``IS``);
- row views (filter/projection, inner joins): each storage row carries the keys
  of the base rows it combines; the combinations of the replica that hold a
  changed base row are upserted, each once, and the rows of every changed base
  key that did not come again are deleted;
- rooted row views, whose rows are one to one with the rows of a table with an
  INTEGER PRIMARY KEY (the others join through their keys): stored by that
  rowid, without indexes; the affected rowids' rows are computed into a TEMP
  table, then copied (see _root, _rooted_statements).

Policy ``auto`` refreshes in full instead when the change touches more than
AUTO_FULL_SHARE of the view's rows (measured: see docs/benchmarks.md).

A schema change of a base table drops that table's triggers; at commit the
dependent views are checked again and refreshed in full, or marked stale
with the reason (``replicator view list``) and left as they were.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import combinations
from typing import Any

from replicator.errors import UserError
from replicator.structure import TableStructure, target_table_name
from replicator.views.analysis import Analysis, Reason, TableInfo, analyse, quote
from replicator.views.store import check_name, check_policy

log = logging.getLogger("replicator")

VIEWS = "_replicator_views"
REFRESHES = "_replicator_view_refresh"
STORAGE_PREFIX = "_replicator_mv_"
INDEX_PREFIX = "_replicator_ix_"
# auto: once a view has a refresh history, a change whose keys would take longer to
# recompute (at the view's recent seconds per key) than its last full refresh is done
# in full; before that, one that touches more than AUTO_FULL_SHARE of the rows.
AUTO_FULL_SHARE = 0.2
AUTO_MIN_KEYS = 100            # incremental refreshes of fewer keys say little about the cost per key
AUTO_SAMPLES = 5               # incremental refreshes auto takes its cost per key from (the latest)
# auto goes full once the keys' predicted cost passes this share of the last full refresh:
# the prediction (a median cost per key) and single refreshes on a busy machine are both off
# by tens of percent, and a full refresh is never more than a full refresh.
AUTO_MARGIN = 0.6
KEEP_REFRESHES = 1000          # refresh records kept per view, besides those auto learns from
CACHE_KIB = 131072             # page cache of a connection that maintains views (KiB): see _grow_cache
COVERING_MAX_COLUMNS = 4       # GROUP BY columns plus the columns the view reads, for a covering index
_AGGREGATE_OPCODES = {"AggStep", "AggStep1", "AggFinal", "AggValue", "AggInverse"}
# the refresh records auto learns from (see _costs), kept however old
_LATEST_FULL = (f"SELECT seq, seconds FROM main.{REFRESHES} WHERE view = :view AND kind = 'full'"
                " ORDER BY seq DESC LIMIT 1")
_COST_SAMPLES = (f"SELECT seq, seconds, keys FROM main.{REFRESHES} WHERE view = :view AND kind = 'incremental'"
                 f" AND keys >= {AUTO_MIN_KEYS} ORDER BY seq DESC LIMIT {AUTO_SAMPLES}")
GEN_COLUMN = "_replicator_gen"     # the refresh that last wrote a storage row
GEN_COLUMN_Q = '"_replicator_gen"'
SIGN_COLUMN = "_replicator_sign"   # delta rows: +1 a new row, -1 an old one
ROW_COLUMN = "_replicator_row"     # storage keyed by its root table's INTEGER PRIMARY KEY: that key
# Aggregates a fold maintains from state (see _Fold); any other aggregate in a select
# item makes the view recompute its keys instead.
_FOLDABLE = {"count", "sum", "avg", "total", "min", "max"}
# Integers whose absolute values sum to at most this add up exactly in doubles, in any
# order: avg and total folded from an integer sum then equal SQLite's own (which adds
# doubles row by row). Below 2**53, with a margin for the double the bound is kept in.
EXACT = 2 ** 52


def _h(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


@dataclass
class _Counts:
    keys: int = 0
    deleted: int = 0
    inserted: int = 0
    updated: int = 0


def _affinity(declared: str) -> str:
    """SQLite's column affinity of a declared type."""
    t = declared.upper()
    if "INT" in t:
        return "INTEGER"
    if any(w in t for w in ("CHAR", "CLOB", "TEXT")):
        return "TEXT"
    if not t or "BLOB" in t:
        return "BLOB"
    return "REAL" if any(w in t for w in ("REAL", "FLOA", "DOUB")) else "NUMERIC"


def _compares_as_stored(key: str, other: str) -> bool:
    """Whether `key_column = other_column` compares the key's values as stored: no affinity
    is applied to them (which could make two distinct keys equal, '1' and '01' to 1)."""
    k, o = _affinity(key), _affinity(other)
    if k in ("INTEGER", "REAL", "NUMERIC"):
        return True
    return o in ("TEXT", "BLOB") if k == "TEXT" else o == "BLOB"


def _definition(columns: list[tuple[str, str]]) -> str:
    return ", ".join(f"{quote(c)} {t}".strip() for c, t in columns)


def _helper_index_name(table: str, columns: Sequence[str]) -> str:
    return INDEX_PREFIX + _h(table.lower() + "\0" + "\0".join(c.lower() for c in columns))


def _delta_name(table: str) -> str:
    return f"_replicator_d_{_h(table.lower())}"


def _pk_name(table: str) -> str:
    return f"_replicator_p_{_h(table.lower())}"


@dataclass
class _Fold:
    """An aggregate view maintained by folding each batch's signed delta into state
    kept in hidden storage columns: the group's row count, and per argument column
    count(x) and sum(x). count/sum/avg/total come from that state; min/max from the
    stored value and the batch's values, or, where a batch removed a group's extreme
    value, from the group's rows in the replica when that is one index seek (see
    Plan.seek_column); else, and where a sum is not an exact integer, the group is
    recomputed from its rows. Only integers are folded: a float sum would drift from a
    recomputation."""
    outputs: list[tuple[str, int | None]]   # per view column: (function, argument index), ("", None) a key item
    args: list[str]                         # argument columns, as SQL (alias.column)
    names: list[str]                        # the same columns' names
    minimum: dict[int, int] = field(default_factory=dict)   # argument -> view column holding its min
    maximum: dict[int, int] = field(default_factory=dict)
    absolute: set[int] = field(default_factory=set)          # arguments of avg/total: sum of |x| kept too

    def state(self) -> list[tuple[str, str, str]]:
        """(storage column, the value as an aggregate of the group's rows, name in the fold table)."""
        out = [("_replicator_n", "count(*)", "n")]
        for j, x in enumerate(self.args):
            out += [(f"_replicator_c{j}", f"count({x})", f"c{j}"),
                    (f"_replicator_s{j}", f"coalesce(sum({x}), 0)", f"s{j}")]
            if j in self.absolute:
                out.append((f"_replicator_a{j}", f"total(iif({x} < 0, -{x}, {x}))", f"a{j}"))
        return out

    def state_columns(self) -> list[str]:
        return [c for c, _, _ in self.state()]

    def state_exprs(self) -> list[str]:
        return [e for _, e, _ in self.state()]


@dataclass
class Plan:
    """A view as loaded: how it is stored and maintained."""
    name: str
    sql: str
    policy: str
    mode: str                              # incremental | full
    reason: Reason | None                  # why full, when it is
    analysis: Analysis | None
    columns: list[tuple[str, str]]         # the query's columns (name, declared type)
    key_columns: list[str]                 # storage key columns
    deps: set[str]                         # tables (and views) of the main database it reads, lower case
    key_types: list[str] = field(default_factory=list)   # declared types of the key columns
    indexes: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)  # helper indexes (table, cols)
    status: str = "ok"
    full_insert: str = ""
    fold: _Fold | None = None              # aggregates folded from state, when they can be
    fold_reason: str = ""                  # why not, for an aggregate view
    root: int | None = None                # row view: the occurrence whose rowid is the storage row's
    _cache: dict[Any, Any] = field(default_factory=dict)

    @property
    def fold_table(self) -> str:
        return f"_replicator_a_{_h(self.name.lower())}"

    @property
    def state_columns(self) -> list[str]:
        return self.fold.state_columns() if self.fold else []

    def _storage_layout(self) -> list[tuple[str, str]]:
        """The storage table's (column, declared type)s."""
        if self.root is not None:
            return [(ROW_COLUMN, "INTEGER PRIMARY KEY")] + self.columns
        return (list(zip(self.key_columns, self.key_types)) + ([(GEN_COLUMN, "INTEGER")] if self.key_columns else [])
                + self.columns + [(c, "") for c in self.state_columns])

    def storage_columns(self) -> list[str]:
        return [c for c, _ in self._storage_layout()]

    def storage_definition(self) -> str:
        """The storage table's column definitions."""
        return _definition(self._storage_layout())

    @property
    def storage(self) -> str:
        return STORAGE_PREFIX + self.name

    @property
    def keys_table(self) -> str:
        return f"_replicator_k_{_h(self.name.lower())}"

    @property
    def rows_table(self) -> str:
        """TEMP table of a rooted row view's recomputed rows."""
        return f"_replicator_n_{_h(self.name.lower())}"

    @property
    def tables(self) -> list[str]:
        """Base tables whose rows it recomputes from (incremental views)."""
        if self.analysis is None:
            return []
        return sorted({o.table.name for o in self.analysis.occurrences})

    def seek_column(self) -> str | None:
        """The column a fold's helper index holds right after the GROUP BY columns, when
        those are all plain columns: a group's min or max of it is one index seek (lower
        case)."""
        a = self.analysis
        if a is None or not a.key_columns or any(c is None for c in a.key_columns):
            return None
        keys = {c.lower() for _, c in a.key_columns}
        table = a.occurrences[0].table.name
        return next((cols[len(keys)].lower() for t, cols in self.indexes
                     if t == table and len(cols) > len(keys) and {c.lower() for c in cols[:len(keys)]} == keys), None)

    def _maintenance_notes(self) -> list[str]:
        if self.mode != "incremental" or self.analysis is None:
            return []
        if self.root is not None:
            o = self.analysis.occurrences[self.root]
            return [f"stored by the rowid of {o.alias}: each row of the view is one row of {o.table.name}"
                    " (the other tables join through their keys), updated in place"]
        if self.analysis.kind != "aggregate":
            return []
        if self.fold is not None:
            note = "aggregates folded from state (group count, count and sum per column)"
            extremes = {self.fold.names[j].lower() for j in [*self.fold.minimum, *self.fold.maximum]}
            seek = self.seek_column()
            if seek in extremes:
                note += (f"; a group that loses its min or max of {seek} reads the new one through the index on"
                         " the GROUP BY columns" + ("; of another column, it is recomputed from its rows"
                                                    if extremes - {seek} else ""))
            elif extremes:
                note += "; groups that lose a min or max value are recomputed from their rows"
            return [note]
        return [f"each affected group is recomputed from its rows: {self.fold_reason}"]

    def describe(self) -> dict[str, Any]:
        a = self.analysis
        return {"view": self.name, "policy": self.policy, "maintenance": self.mode,
                "kind": a.kind if a else None, "keys": a.describe_keys() if a and self.mode == "incremental" else None,
                "tables": sorted(self.deps), "reason": self.reason.as_dict() if self.reason else None,
                "reasons": [r.as_dict() for r in a.reasons] if a else [],
                "notes": (a.notes if a else []) + self._maintenance_notes(),
                "indexes": [f"{t}({', '.join(c)})" for t, c in self.indexes]}


class SqliteViews:
    """The views of one SQLite target, maintained on the target's connection."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self.plans: list[Plan] = []          # in refresh order (a view after the views it reads)
        self.active = False                   # any view loaded: writes are noted
        self._loaded = False
        self._data_version: int | None = None
        self._fingerprint: str | None = None
        self._armed: set[str] = set()         # tables whose capture triggers are installed
        self._touched: set[str] = set()       # tables written in this transaction (lower case)
        self._forced: dict[str, str] = {}     # view -> why it is refreshed in full at commit
        self._revalidate: dict[str, str] = {}  # view -> the schema change that calls for it
        self._replicated: set[str] | None = None
        self._guarding = self._guarded = self._copying = False   # see _refresh_guarded

    # hooks called by SqliteTarget -------------------------------------------------------

    def begun(self) -> None:
        """In a new write transaction: picks up definitions other processes
        changed, installs the capture triggers."""
        version = self.db.execute("PRAGMA data_version").fetchone()[0]
        if not self._loaded or version != self._data_version:
            self._data_version = version
            fingerprint = self._read_fingerprint()
            if not self._loaded or fingerprint != self._fingerprint:
                self._load()
                self._fingerprint = fingerprint
            self._restore_indexes()
        if self.active:
            self._arm()

    def note_write(self, table: str) -> None:
        if self.active:
            self._touched.add(table.lower())

    def table_truncated(self, table: str) -> None:
        """Before DELETE FROM table: its dependents are refreshed in full (no capture of every row)."""
        if not self.active:
            return
        low = table.lower()
        self._disarm(low)
        self._touched.add(low)
        for plan in self.plans:
            if low in plan.deps:
                self._forced.setdefault(plan.name, "TRUNCATE")

    def schema_changing(self, table: str, dropping: tuple[str, ...] = ()) -> None:
        """Before a DDL on table (re-create, drop, alter): removes the triggers
        and helper indexes that would block or outlive it; the dependent views
        are checked again at commit."""
        low = table.lower()
        if not self._has_catalog():
            return
        self._disarm(low)
        if dropping:
            drop = {c.lower() for c in dropping}
            for index, columns in self._helper_indexes(table):
                if drop & {c.lower() for c in columns}:
                    self.db.execute(f"DROP INDEX IF EXISTS main.{quote(index)}")
        self._touched.add(low)
        for name, deps in self._stored_deps().items():
            if low in deps:
                self._revalidate.setdefault(name, f"schema change of {table}")
        self._replicated = None

    def before_commit(self) -> None:
        """Refreshes the views from this transaction's changes."""
        try:
            if self._revalidate:
                for name, why in list(self._revalidate.items()):
                    self._revalidate_view(name, why)
            if self._touched or self._forced:
                changed = set(self._touched)
                for plan in self.plans:
                    forced = self._forced.get(plan.name)
                    if plan.status != "ok" or (forced is None and not (plan.deps & changed)):
                        continue
                    if self._refresh_guarded(plan, forced):
                        changed.add(plan.storage.lower())
            for table in self._armed:
                self.db.execute(f"DELETE FROM temp.{quote(_delta_name(table))}")
        finally:
            self._touched.clear()
            self._forced.clear()
            self._revalidate.clear()

    def rolled_back(self) -> None:
        """Temp objects created or dropped in the transaction are back as they were: look again."""
        self._touched.clear()
        self._forced.clear()
        self._revalidate.clear()
        self._loaded = False
        self._armed.clear()

    # catalog ----------------------------------------------------------------------------

    def _has_catalog(self) -> bool:
        return self.db.execute("SELECT 1 FROM main.sqlite_master WHERE type = 'table' AND name = ?",
                               (VIEWS,)).fetchone() is not None

    def _ensure_catalog(self) -> None:
        self.db.execute(f"CREATE TABLE IF NOT EXISTS main.{VIEWS} (name TEXT PRIMARY KEY, sql TEXT NOT NULL,"
                        " policy TEXT NOT NULL, maintenance TEXT NOT NULL, reason TEXT, columns TEXT, deps TEXT,"
                        " status TEXT NOT NULL DEFAULT 'ok', status_reason TEXT, rows INTEGER NOT NULL DEFAULT 0,"
                        " seq INTEGER NOT NULL DEFAULT 0, version INTEGER NOT NULL DEFAULT 1, created_at TEXT,"
                        " refreshed_at TEXT)")
        self.db.execute(f"CREATE TABLE IF NOT EXISTS main.{REFRESHES} (view TEXT, seq INTEGER, at TEXT, kind TEXT,"
                        " reason TEXT, keys INTEGER, rows_deleted INTEGER, rows_inserted INTEGER,"
                        " rows_updated INTEGER, seconds REAL,"
                        " PRIMARY KEY (view, seq))")

    def _read_fingerprint(self) -> str | None:
        if not self._has_catalog():
            return None
        row = self.db.execute(f"SELECT group_concat(name || ':' || version, ',') FROM "
                              f"(SELECT name, version FROM main.{VIEWS} ORDER BY name)").fetchone()
        return row[0] or ""

    def _stored_deps(self) -> dict[str, set[str]]:
        if not self._has_catalog():
            return {}
        return {name: set(json.loads(deps or "[]"))
                for name, deps in self.db.execute(f"SELECT name, deps FROM main.{VIEWS}")}

    def _replicated_tables(self) -> set[str]:
        if self._replicated is None:
            names = set()
            try:
                for (structure,) in self.db.execute("SELECT structure FROM main._replicator_tables"):
                    s = TableStructure.from_json(structure)
                    names.add(target_table_name(s.schema, s.name).lower())
            except sqlite3.OperationalError:
                pass
            self._replicated = names
        return self._replicated

    def table_info(self, name: str) -> TableInfo | None:
        row = self.db.execute("SELECT name, type FROM main.sqlite_master WHERE type IN ('table', 'view')"
                              " AND name = ? COLLATE NOCASE", (name,)).fetchone()
        if row is None:
            return None
        real, kind = row
        info = self.db.execute(f"PRAGMA main.table_info({quote(real)})").fetchall()
        columns = [(r[1], r[2] or "") for r in info]
        key = [r[1] for r in sorted((r for r in info if r[5]), key=lambda r: r[5])]
        replicated = kind == "table" and real.lower() in self._replicated_tables()
        return TableInfo(name=real, columns=columns, key=key, replicated=replicated)

    # planning -----------------------------------------------------------------------------

    def plan(self, name: str, sql: str, policy: str) -> Plan:
        """Analyses a definition against the target as it is now. Raises UserError
        when the SQL does not run here."""
        self._replicated = None
        analysis = analyse(sql, self.table_info)
        sql = analysis.sql
        columns, deps, aggregates = self._probe(sql)
        # (a window function compiles to the same steps as an aggregate; it is refused on its own)
        if aggregates and analysis.kind != "aggregate" and not any(
                r.code == "WINDOW_FUNCTION" for r in analysis.reasons):
            analysis.refuse("NO_KEY", "(aggregate function)", "an aggregate the analysis does not know")
        reason = analysis.reasons[0] if analysis.reasons else None
        mode = "incremental" if reason is None else "full"
        if policy == "full":
            mode, reason = "full", Reason("POLICY_FULL", "--policy full")
        plan = Plan(name=name, sql=sql, policy=policy, mode=mode, reason=reason, analysis=analysis,
                    columns=columns, key_columns=[], deps=deps)
        if mode == "incremental":
            try:
                self._build(plan)
            except sqlite3.Error as exc:
                plan.mode, plan.reason = "full", Reason("REWRITE", "", str(exc))
                plan.key_columns, plan.key_types, plan.indexes = [], [], []
                plan.fold, plan.fold_reason, plan.root = None, "", None
                plan._cache.clear()
        if plan.mode == "full":
            plan.full_insert = f"INSERT INTO main.{quote(plan.storage)} SELECT * FROM ({sql})"
        return plan

    def _probe(self, sql: str) -> tuple[list[tuple[str, str]], set[str], bool]:
        """The query's columns (names and declared types, as a view of it has them),
        the tables it reads, and whether it aggregates. Runs nothing."""
        deps: set[str] = set()

        def authorize(action: int, arg1: Any, arg2: Any, dbname: Any, source: Any) -> int:
            if action == sqlite3.SQLITE_READ and dbname == "main" and arg1:
                deps.add(str(arg1).lower())
            return sqlite3.SQLITE_OK

        self.db.set_authorizer(authorize)
        try:
            opcodes = {row[1] for row in self.db.execute(f"EXPLAIN {sql}")}
        except sqlite3.Error as exc:
            raise UserError(f"the view's SQL does not run on the target: {exc}") from None
        finally:
            self.db.set_authorizer(None)
        probe = "_replicator_probe"
        try:
            self.db.execute(f"DROP VIEW IF EXISTS temp.{probe}")
            self.db.execute(f"CREATE TEMP VIEW {probe} AS {sql}")
            columns = [(r[1], r[2] or "") for r in self.db.execute(f"PRAGMA temp.table_info({probe})")]
            self.db.execute(f"DROP VIEW temp.{probe}")
        except sqlite3.Error as exc:
            raise UserError(f"the view's SQL does not run on the target: {exc}") from None
        return columns, deps, bool(opcodes & _AGGREGATE_OPCODES)

    def _order(self, a: Analysis, start: list[int]) -> list[int]:
        """Tables in join order from start: each next one linked to those before by an equality."""
        order = list(start)
        n = len(a.occurrences)
        while len(order) < n:
            nxt = next((y for (x, _), (y, _) in a.equi + [(r, l) for l, r in a.equi]
                        if x in order and y not in order), None)
            if nxt is None:
                nxt = next(i for i in range(n) if i not in order)
            order.append(nxt)
        return order

    def _from(self, a: Analysis, order: list[int], relations: dict[int, str], first: str | None = None,
              last: str | None = None) -> str:
        parts = [first] if first else []
        for i in order:
            o = a.occurrences[i]
            parts.append(f"{relations.get(i, 'main.' + quote(o.table.name))} AS {quote(o.alias)}")
        if last:
            parts.append(last)
        return " CROSS JOIN ".join(parts)

    def _per_subset(self, a: Analysis, changes: dict[int, str], items: str) -> list[str]:
        """SELECT items of the query's FROM and WHERE, once per non-empty subset of the
        occurrences in `changes`, each of the subset read from its relation there."""
        return [f"SELECT {items} FROM {self._from(a, self._order(a, list(subset)), {i: changes[i] for i in subset})}"
                f"{self._where(a, [])}"
                for size in range(1, len(changes) + 1) for subset in combinations(sorted(changes), size)]

    @staticmethod
    def _where(a: Analysis, extra: list[str]) -> str:
        terms = [f"({c})" for c in a.conditions] + ([f"({a.where})"] if a.where else []) + extra
        return (" WHERE " + " AND ".join(terms)) if terms else ""

    @staticmethod
    def _plan_fold(a: Analysis) -> tuple[_Fold | None, str]:
        """Whether an aggregate view's aggregates can be folded from state (see _Fold), and why not."""
        if len(a.occurrences) != 1:
            return None, "a join (aggregates are folded for a single table)"
        if a.having:
            return None, "HAVING"
        o = a.occurrences[0]
        types = {c.lower(): (c, t) for c, t in o.table.columns}
        fold = _Fold(outputs=[], args=[], names=[])
        for n, (item, call) in enumerate(zip(a.items, a.item_calls)):
            if call is None:
                fold.outputs.append(("", None))   # a GROUP BY expression (the analysis checked)
                continue
            fn, arg = call
            if fn == "count" and arg == "*":
                fold.outputs.append(("count*", None))
                continue
            column = types.get(arg[1].lower()) if fn in _FOLDABLE and isinstance(arg, tuple) else None
            if column is None:   # (a FILTER clause, DISTINCT, an expression of aggregates: not folded)
                return None, f"{item} (not a plain count, sum, avg, total, min or max of a column)"
            if "INT" not in column[1].upper():
                return None, f"{item} (the column is not INTEGER: a sum of floats would drift)"
            x = f"{quote(o.alias)}.{quote(column[0])}"
            if x not in fold.args:
                fold.args.append(x)
                fold.names.append(column[0])
            j = fold.args.index(x)
            fold.outputs.append((fn, j))
            if fn == "min":
                fold.minimum.setdefault(j, n)
            elif fn == "max":
                fold.maximum.setdefault(j, n)
            elif fn in ("avg", "total"):
                fold.absolute.add(j)
        return fold, ""

    def _build(self, plan: Plan) -> None:
        """Generates (and prepares, to check them) the maintenance statements."""
        a = plan.analysis
        assert a is not None
        storage = f"main.{quote(plan.storage)}"
        select = a.select
        tail = ""
        if a.kind == "aggregate":
            tail = f" GROUP BY {', '.join(a.group_by)}" + (f" HAVING {a.having}" if a.having else "")
        distinct = "DISTINCT " if a.kind == "distinct" else ""
        if a.kind == "rows":
            plan.root = self._root(a)
        if plan.root is not None:
            o = a.occurrences[plan.root]
            key_exprs = [f"{quote(o.alias)}.{quote(o.table.key[0])}"]
            plan.key_columns = [ROW_COLUMN]
        elif a.kind == "rows":
            key_exprs = [f"{quote(o.alias)}.{quote(k)}" for o in a.occurrences for k in o.table.key]
            plan.key_columns = [f"_replicator_k{i}_{j}" for i, o in enumerate(a.occurrences)
                                for j in range(len(o.table.key))]
        else:
            key_exprs = list(a.keys)
            plan.key_columns = [f"_replicator_k{j}" for j in range(len(key_exprs))]
        keyed = ", ".join(f"{e}" for e in key_exprs)
        # Key columns everywhere (storage, temp key tables) get the declared type of the
        # key expression: the same affinity on both sides of IS keeps indexes usable.
        probe = "_replicator_probe_k"
        self.db.execute(f"DROP VIEW IF EXISTS temp.{probe}")
        self.db.execute(f"CREATE TEMP VIEW {probe} AS SELECT {keyed} FROM {a.from_sql}")
        plan.key_types = [r[2] or "" for r in self.db.execute(f"PRAGMA temp.table_info({probe})")]
        self.db.execute(f"DROP VIEW temp.{probe}")
        if a.kind == "aggregate":
            plan.fold, plan.fold_reason = self._plan_fold(a)
        state = "".join(f", {e}" for e in plan.fold.state_exprs()) if plan.fold else ""
        generation = "" if plan.root is not None else "0, "
        # A rooted view's rows name their rowids: an INSERT seeks each to check it is new,
        # REPLACE does not (~6 % of a full refresh; the storage is empty, root keys unique).
        verb = "INSERT OR REPLACE" if plan.root is not None else "INSERT"
        plan.full_insert = (f"{verb} INTO {storage} SELECT {distinct}{keyed}, {generation}{select}{state}"
                            f" FROM {a.from_sql}" + (f" WHERE {a.where}" if a.where else "") + tail)
        # helper indexes: join columns, and the first table's GROUP BY / DISTINCT columns
        wanted: list[tuple[str, tuple[str, ...]]] = []
        def covering(i: int, cols: tuple[str, ...]) -> tuple[str, ...]:
            """cols, then the other columns the view reads of occurrence i, if that stays
            small: the rows of a key are then read from the index alone."""
            rowid = (self._rowid_key(a.occurrences[i].table.name) or "").lower()
            rest = sorted(c for c in a.columns_read[i] if c not in cols and c.lower() != rowid)
            return cols + tuple(rest) if len(cols) + len(rest) <= COVERING_MAX_COLUMNS else cols

        for (i, ci), (j, cj) in a.equi:     # join columns: plain indexes (every apply maintains them)
            wanted.append((a.occurrences[i].table.name, (ci,)))
            wanted.append((a.occurrences[j].table.name, (cj,)))
        if a.kind != "rows":
            first = next((c for c in a.key_columns if c is not None), None)
            if first is not None:
                cols = tuple(dict.fromkeys(c[1] for c in a.key_columns if c is not None and c[0] == first[0]))
                wanted.append((a.occurrences[first[0]].table.name, covering(first[0], cols)))
        # longest first: an index that covers a shorter one's columns serves both
        plan.indexes = sorted(dict.fromkeys(wanted), key=lambda w: -len(w[1]))
        # temp tables the statements use
        for o in a.occurrences:
            self._ensure_delta(o.table.name)
        if plan.root is not None:
            self._ensure_keys(plan.keys_table, ["INTEGER PRIMARY KEY"])
            self._ensure_rows_table(plan)
        elif a.kind == "rows":
            for i, o in enumerate(a.occurrences):
                before = sum(len(x.table.key) for x in a.occurrences[:i])
                self._ensure_keys(_pk_name(o.table.name), plan.key_types[before:before + len(o.table.key)])
        else:
            self._ensure_keys(plan.keys_table, plan.key_types)
        if plan.fold:
            self._ensure_fold_table(plan)
        # Prepared against a stand-in for the storage (which may not exist yet, or have other columns).
        stand_in = "_replicator_probe_mv"
        self.db.execute(f"DROP TABLE IF EXISTS temp.{stand_in}")
        self.db.execute(f"CREATE TEMP TABLE {stand_in} ({plan.storage_definition()})")
        if plan.root is None:
            self.db.execute(f"CREATE UNIQUE INDEX temp.{stand_in}_k ON {stand_in} "
                            f"({', '.join(quote(c) for c in plan.key_columns)})")
        try:
            for stmt in self._statements(plan, set(range(len(a.occurrences)))) + [plan.full_insert]:
                self.db.execute("EXPLAIN " + stmt.replace(storage, f"temp.{stand_in}"), {"replicator_gen": 0})
        finally:
            self.db.execute(f"DROP TABLE temp.{stand_in}")

    def _ensure_temp(self, name: str, columns: list[tuple[str, str]], before: Callable[[], None] = lambda: None
                     ) -> bool:
        """TEMP table `name` of these (column, declared type)s, made again if it has others
        (an INTEGER PRIMARY KEY declared so), after calling before. Returns whether it was
        (re)made."""
        have = [(r[1], (r[2] or "") + (" PRIMARY KEY" if r[5] else ""))
                for r in self.db.execute(f"PRAGMA temp.table_info({quote(name)})")]
        if have == columns:
            return False
        before()
        self.db.execute(f"DROP TABLE IF EXISTS temp.{quote(name)}")
        self.db.execute(f"CREATE TEMP TABLE {quote(name)} ({_definition(columns)})")
        return True

    def _ensure_delta(self, table: str) -> None:
        """TEMP table of the base table's columns and declared types (same affinities)."""
        columns = [(r[1], r[2] or "") for r in self.db.execute(f"PRAGMA main.table_info({quote(table)})")]
        # its triggers go first: none may be left writing into a table that is not there
        self._ensure_temp(_delta_name(table), columns + [(SIGN_COLUMN, "INTEGER")],
                          before=lambda: self._disarm(table.lower()))

    def _ensure_keys(self, name: str, types: list[str]) -> None:
        """TEMP table of keys c0, c1... of these types, indexed (a rowid table: by its rowid)."""
        cols = [f"c{j}" for j in range(len(types))]
        if self._ensure_temp(name, list(zip(cols, types))) and types != ["INTEGER PRIMARY KEY"]:
            self.db.execute(f"CREATE INDEX temp.{quote(name + '_i')} ON {quote(name)} ({', '.join(cols)})")

    def _ensure_rows_table(self, plan: Plan) -> None:
        """TEMP table of a rooted row view's recomputed rows: rowid, the view's columns."""
        self._ensure_temp(plan.rows_table, [("r", "INTEGER PRIMARY KEY")]
                          + [(f"v{i}", "") for i in range(len(plan.columns))])

    def _ensure_fold_table(self, plan: Plan) -> None:
        """TEMP table of a batch's folded groups: key, the storage row (if any), what to do
        with it, the group's new view columns and state."""
        assert plan.fold is not None
        self._ensure_temp(plan.fold_table, [(f"k{j}", t) for j, t in enumerate(plan.key_types)]
                          + [(c, "") for c in ["srowid", "act"] + [f"v{i}" for i in range(len(plan.columns))]
                             + [f"t{j}" for j in range(len(plan.state_columns))]])

    def _statements(self, plan: Plan, with_delta: set[int]) -> list[str]:
        """Every maintenance statement for a batch that changed these occurrences."""
        a = plan.analysis
        assert a is not None
        if plan.root is not None:
            return self._rooted_statements(plan, tuple(sorted(with_delta)))
        if a.kind == "rows":
            key = tuple(sorted(with_delta))
            return ([self._pk_fill(plan, i) for i in key] + [self._rows_count(plan, (i,)) for i in key]
                    + [self._rows_upsert(plan, i, key) for i in key] + [self._rows_sweep(plan, i) for i in key])
        fold = self._fold_statements(plan) if plan.fold else []
        return fold + [self._keys_fill(plan, tuple(sorted(with_delta))), self._keys_upsert(plan),
                       self._keys_sweep(plan)]

    def _upsert_tail(self, plan: Plan) -> str:
        """Rows recomputed for a key that is still there are updated in place (indexes
        untouched) and stamped with this refresh's generation; see _keys_sweep."""
        sets = ", ".join(f"{quote(c)} = excluded.{quote(c)}"
                         for c in [GEN_COLUMN] + [c for c, _ in plan.columns] + plan.state_columns)
        return f" ON CONFLICT ({', '.join(quote(c) for c in plan.key_columns)}) DO UPDATE SET {sets}"

    # statements: aggregate and DISTINCT views ---------------------------------------------

    def _keys_fill(self, plan: Plan, with_delta: tuple[int, ...]) -> str:
        cached = plan._cache.get(("fill", with_delta))
        if cached:
            return cached
        a = plan.analysis
        assert a is not None
        deltas = {i: f"temp.{quote(_delta_name(a.occurrences[i].table.name))}" for i in with_delta}
        stmt = f"INSERT INTO temp.{quote(plan.keys_table)} " + " UNION ".join(
            self._per_subset(a, deltas, f"DISTINCT {', '.join(a.keys)}"))
        plan._cache[("fill", with_delta)] = stmt
        return stmt

    def _keys_match(self, plan: Plan) -> str:
        match = " AND ".join(f"s.{quote(c)} IS k.c{j}" for j, c in enumerate(plan.key_columns))
        return (f"temp.{quote(plan.keys_table)} AS k CROSS JOIN main.{quote(plan.storage)} AS s WHERE {match}")

    def _keys_sweep(self, plan: Plan) -> str:
        """Rows of the keys that the recomputation did not give again: gone."""
        return (f"DELETE FROM main.{quote(plan.storage)} WHERE rowid IN (SELECT s.rowid FROM "
                f"{self._keys_match(plan)} AND s.{GEN_COLUMN_Q} IS NOT :replicator_gen)")

    def _keys_upsert(self, plan: Plan) -> str:
        cached = plan._cache.get("upsert")
        if cached:
            return cached
        a = plan.analysis
        assert a is not None
        keys = f"temp.{quote(plan.keys_table)} AS _replicator_k"
        match = [f"({e}) IS _replicator_k.c{j}" for j, e in enumerate(a.keys)]
        first = next((c for c in a.key_columns if c is not None), None)
        if first is not None:
            source = self._from(a, self._order(a, [first[0]]), {}, first=keys)
        else:   # no key is a plain column: one pass over the join, probing the keys
            source = self._from(a, self._order(a, [0]), {}, last=keys)
        # One key row matches exactly one group (keys are distinct under IS): grouping by
        # it is grouping by the key, and rows read key after key need no sorting.
        tail = " GROUP BY _replicator_k.rowid" + (f" HAVING {a.having}" if a.having else "")
        state = "".join(f", {e}" for e in plan.fold.state_exprs()) if plan.fold else ""
        stmt = (f"INSERT INTO main.{quote(plan.storage)} SELECT {', '.join(a.keys)}, :replicator_gen, {a.select}"
                f"{state} FROM {source}{self._where(a, match)}{tail}{self._upsert_tail(plan)}")
        plan._cache["upsert"] = stmt
        return stmt

    # statements: folded aggregates --------------------------------------------------------

    def _fold_statements(self, plan: Plan) -> list[str]:
        """[fill the fold table, update folded groups, insert new ones, delete emptied ones,
        list the groups to recompute]. See _Fold and _incremental."""
        cached = plan._cache.get("fold")
        if cached:
            return cached
        a, f = plan.analysis, plan.fold
        assert a is not None and f is not None
        o = a.occurrences[0]
        delta = f"temp.{quote(_delta_name(o.table.name))} AS {quote(o.alias)}"
        sign = quote(SIGN_COLUMN)
        nk = len(plan.key_columns)
        d = "_replicator_d"   # the batch's groups: named apart from the view's alias, which the lookup uses
        # the batch's signed change per group
        inner = [f"{e} AS k{j}" for j, e in enumerate(a.keys)]
        inner += [f"{item} AS i{n}" for n, (item, (fn, _)) in enumerate(zip(a.items, f.outputs)) if not fn]
        inner.append(f"sum({sign}) AS dn")
        for j, x in enumerate(f.args):
            inner.append(f"sum(iif({x} IS NULL, 0, {sign})) AS dc{j}")
            # -x, not sign * x: a text value gives a float sum (and a recomputation), not 0
            inner.append(f"sum(iif({sign} > 0, {x}, -{x})) AS ds{j}")
            if j in f.absolute:
                inner.append(f"total(iif({x} < 0, -{x}, {x}) * {sign}) AS da{j}")
            if j in f.minimum:
                inner += [f"min(iif({sign} > 0, {x}, NULL)) AS pmin{j}", f"min(iif({sign} < 0, {x}, NULL)) AS mmin{j}"]
            if j in f.maximum:
                inner += [f"max(iif({sign} > 0, {x}, NULL)) AS pmax{j}", f"max(iif({sign} < 0, {x}, NULL)) AS mmax{j}"]
        group = f"SELECT {', '.join(inner)} FROM {delta}{self._where(a, [])} GROUP BY {', '.join(a.keys)}"
        match = " AND ".join(f"s.{quote(c)} IS {d}.k{j}" for j, c in enumerate(plan.key_columns))
        # the group's new state, with the storage row's (none for a new group)
        mid = [f"{d}.k{j} AS k{j}" for j in range(nk)] + ["s.rowid AS srowid",
                                                          f"coalesce(s._replicator_n, 0) + {d}.dn AS n"]
        ok = ["1"]
        changed = ["s.rowid IS NULL", f"{d}.dn <> 0"]
        seek = plan.seek_column()
        base = f"main.{quote(o.table.name)} AS {quote(o.alias)}"
        group_rows = self._where(a, [f"({e}) IS {d}.k{j}" for j, e in enumerate(a.keys)])
        for j, x in enumerate(f.args):
            mid.append(f"coalesce(s._replicator_c{j}, 0) + {d}.dc{j} AS c{j}")
            mid.append(f"coalesce(s._replicator_s{j}, 0) + coalesce({d}.ds{j}, 0) AS s{j}")
            ok.append(f"typeof(s{j}) = 'integer' AND c{j} >= 0")
            if j in f.absolute:
                mid.append(f"coalesce(s._replicator_a{j}, 0) + {d}.da{j} AS a{j}")
                ok.append(f"a{j} <= {EXACT}")
            changed += [f"{d}.dc{j} <> 0", f"{d}.ds{j} <> 0"]
            if j in f.absolute:
                # Count and sum can stay while |x| sums change (2 + 0 -> 2**53 + 2 - 2**53): the
                # new abs-sum must be stored, or a later batch checks exactness against a stale one.
                changed.append(f"{d}.da{j} <> 0")
            for kind, col in (("min", f.minimum.get(j)), ("max", f.maximum.get(j))):
                if col is None:
                    continue
                old = f"s.{quote(plan.columns[col][0])}"
                p, m = f"{d}.p{kind}{j}", f"{d}.m{kind}{j}"
                lt = "<" if kind == "min" else ">"
                gt = ">" if kind == "min" else "<"
                # Old values gone (m) all beyond the stored extreme: it stays, or a new value beats
                # it. Else a new value beyond every value gone is the extreme. Else the group's rows
                # in the replica (already changed) have it: read by one index seek, when it is one
                # (not for a group gone), or the group is recomputed (one pass for all of them).
                extreme = (f"CASE WHEN {m} IS NULL OR {m} {gt} {old} THEN CASE WHEN {p} IS NULL THEN {old}"
                           f" WHEN {old} IS NULL OR {p} {lt} {old} THEN {p} ELSE {old} END")
                if f.names[j].lower() == seek:
                    mid.append(f"{extreme} WHEN {p} {lt} {m} OR coalesce(s._replicator_n, 0) + {d}.dn <= 0 THEN {p}"
                               f" ELSE (SELECT {kind}({x}) FROM {base}{group_rows}) END AS {kind}{j}")
                else:
                    mid.append(f"{extreme} ELSE {p} END AS {kind}{j}")
                    mid.append(f"coalesce({m} IS NULL OR {m} {gt} {old} OR {p} {lt} {m}, 0) AS ok{kind}{j}")
                    ok.append(f"ok{kind}{j}")
                changed.append(f"{p} IS NOT NULL OR {m} IS NOT NULL")
        mid.append(f"{' OR '.join(f'({c})' for c in changed)} AS changed")
        mid += [f"{d}.i{n} AS i{n}" for n, (fn, _) in enumerate(f.outputs) if not fn]
        outputs = []
        for n, (fn, j) in enumerate(f.outputs):
            outputs.append({"": f"i{n}", "count*": "n", "count": f"c{j}", "sum": f"iif(c{j} > 0, s{j}, NULL)",
                            "total": f"CAST(s{j} AS REAL)", "avg": f"iif(c{j} > 0, CAST(s{j} AS REAL) / c{j}, NULL)",
                            "min": f"min{j}", "max": f"max{j}"}[fn])
        state = [name for _, _, name in f.state()]
        act = (f"CASE WHEN n < 0 THEN 4 WHEN n = 0 THEN iif(srowid IS NULL, 0, 3) WHEN NOT ({' AND '.join(ok)})"
               f" THEN 4 WHEN srowid IS NULL THEN 2 WHEN changed THEN 1 ELSE 0 END")
        table = f"temp.{quote(plan.fold_table)}"
        fill = (f"INSERT INTO {table} SELECT {', '.join(f'k{j}' for j in range(nk))}, srowid, {act}, "
                f"{', '.join(outputs + state)} FROM (SELECT {', '.join(mid)} FROM ({group}) AS {d} "
                f"LEFT JOIN main.{quote(plan.storage)} AS s ON {match})")
        agg_cols = [n for n, (fn, _) in enumerate(f.outputs) if fn]
        targets = [quote(plan.columns[n][0]) for n in agg_cols] + [quote(c) for c in plan.state_columns]
        values = [f"a.v{n}" for n in agg_cols] + [f"a.t{j}" for j in range(len(state))]
        update = (f"UPDATE main.{quote(plan.storage)} AS s SET ({', '.join(targets)}) = ({', '.join(values)}) "
                  f"FROM {table} AS a WHERE s.rowid = a.srowid AND a.act = 1")
        insert = (f"INSERT INTO main.{quote(plan.storage)} SELECT {', '.join(f'k{j}' for j in range(nk))}, "
                  f":replicator_gen, {', '.join(f'v{n}' for n in range(len(f.outputs)))}, "
                  f"{', '.join(f't{j}' for j in range(len(state)))} FROM {table} WHERE act = 2")
        delete = (f"DELETE FROM main.{quote(plan.storage)} WHERE rowid IN "
                  f"(SELECT srowid FROM {table} WHERE act = 3)")
        redo = (f"INSERT INTO temp.{quote(plan.keys_table)} SELECT {', '.join(f'k{j}' for j in range(nk))} "
                f"FROM {table} WHERE act = 4")
        stmts = [fill, update, insert, delete, redo]
        plan._cache["fold"] = stmts
        return stmts

    # statements: row views stored by their root's rowid --------------------------------------

    def _root(self, a: Analysis) -> int | None:
        """The occurrence whose rows are the view's rows one to one, if there is one with an
        INTEGER PRIMARY KEY: every other table joins, directly or through another, by `=`
        on all of its key columns (unique, and `=` matches no NULL: at most one row each)."""
        types = [{c.lower(): t for c, t in o.table.columns} for o in a.occurrences]
        pairs = [((x, cx), (y, cy)) for (x, cx), (y, cy) in a.strict_equi + [(r, l) for l, r in a.strict_equi]
                 if _compares_as_stored(types[y].get(cy.lower(), ""), types[x].get(cx.lower(), ""))]
        for root, o in enumerate(a.occurrences):
            if self._rowid_key(o.table.name) is None:
                continue
            bound = {root}
            grew = True
            while grew:
                grew = False
                for j, other in enumerate(a.occurrences):
                    if j in bound or not other.table.key:
                        continue
                    joined = {cy.lower() for (x, _), (y, cy) in pairs if x in bound and y == j}
                    if all(k.lower() in joined for k in other.table.key):
                        bound.add(j)
                        grew = True
            if len(bound) == len(a.occurrences):
                return root
        return None

    def _rowid_key(self, table: str) -> str | None:
        """The table's key column if it is the rowid (a single INTEGER PRIMARY KEY)."""
        key = [r for r in self.db.execute(f"PRAGMA main.table_info({quote(table)})") if r[5]]
        if len(key) != 1 or (key[0][2] or "").upper() != "INTEGER":
            return None
        # WITHOUT ROWID, or a key declared DESC: the key has an index of its own
        if any(r[3] == "pk" for r in self.db.execute(f"PRAGMA main.index_list({quote(table)})")):
            return None
        return key[0][1]

    def _rooted_statements(self, plan: Plan, with_delta: tuple[int, ...]) -> list[str]:
        """[fill the affected rowids..., compute their rows, count those the storage has,
        write them, delete the rest].

        The affected rowids: the root table's changed keys, and the root rows of every
        combination that reads a changed row of another table (the subsets of those
        tables read from their deltas, old and new rows, the rest from the replica, as
        for the keys of an aggregate view)."""
        cached = plan._cache.get(("rooted", with_delta))
        if cached:
            return cached
        a = plan.analysis
        assert a is not None and plan.root is not None
        root = a.occurrences[plan.root]
        key = f"{quote(root.alias)}.{quote(root.table.key[0])}"
        affected = f"temp.{quote(plan.keys_table)}"
        stmts = []
        if plan.root in with_delta:
            stmts.append(f"INSERT OR IGNORE INTO {affected} SELECT {quote(root.table.key[0])} "
                         f"FROM temp.{quote(_delta_name(root.table.name))}")
        others = [i for i in with_delta if i != plan.root]
        # A changed row of another table reaches the root rows its ON and WHERE columns
        # match: its old and new versions often agree on those (a customer renamed).
        changed = {i: f"(SELECT DISTINCT {', '.join(quote(c) for c in sorted(a.columns_filtered[i])) or '1'} "
                      f"FROM temp.{quote(_delta_name(a.occurrences[i].table.name))})" for i in others}
        stmts += [f"INSERT OR IGNORE INTO {affected} {select}" for select in self._per_subset(a, changed, key)]
        rows = f"temp.{quote(plan.rows_table)}"
        storage = f"main.{quote(plan.storage)}"
        source = self._from(a, self._order(a, [plan.root]), {}, first=f"{affected} AS _replicator_k")
        stmts.append(f"INSERT INTO {rows} SELECT _replicator_k.c0, {a.select} FROM {source}"
                     f"{self._where(a, [f'{key} = _replicator_k.c0'])}")
        stmts.append(f"SELECT count(*) FROM {rows} AS r CROSS JOIN {storage} AS s WHERE s.rowid = r.r")
        columns = [quote(c) for c, _ in plan.columns]
        stmts.append(f"INSERT INTO {storage} SELECT r, {', '.join(f'v{i}' for i in range(len(columns)))} "
                     f"FROM {rows} WHERE true ON CONFLICT ({quote(ROW_COLUMN)}) DO UPDATE SET "
                     + ", ".join(f"{c} = excluded.{c}" for c in columns))
        stmts.append(f"DELETE FROM {storage} WHERE rowid IN (SELECT c0 FROM {affected} "
                     f"WHERE c0 NOT IN (SELECT r FROM {rows}))")
        plan._cache[("rooted", with_delta)] = stmts
        return stmts

    # statements: row views ------------------------------------------------------------------

    def _occurrence_keys(self, plan: Plan, i: int) -> list[str]:
        a = plan.analysis
        assert a is not None
        before = sum(len(o.table.key) for o in a.occurrences[:i])
        return plan.key_columns[before:before + len(a.occurrences[i].table.key)]

    def _pk_fill(self, plan: Plan, i: int) -> str:
        table = plan.analysis.occurrences[i].table  # type: ignore[union-attr]
        return (f"INSERT INTO temp.{quote(_pk_name(table.name))} SELECT DISTINCT "
                f"{', '.join(quote(k) for k in table.key)} FROM temp.{quote(_delta_name(table.name))}")

    def _rows_match(self, plan: Plan, i: int) -> str:
        table = plan.analysis.occurrences[i].table  # type: ignore[union-attr]
        match = " AND ".join(f"s.{quote(c)} IS k.c{j}" for j, c in enumerate(self._occurrence_keys(plan, i)))
        return (f"temp.{quote(_pk_name(table.name))} AS k CROSS JOIN main.{quote(plan.storage)} AS s "
                f"WHERE {match}")

    def _rows_count(self, plan: Plan, with_delta: tuple[int, ...]) -> str:
        """Rows of the view that hold a changed base row."""
        if len(with_delta) == 1:
            return f"SELECT count(*) FROM {self._rows_match(plan, with_delta[0])}"
        return ("SELECT count(*) FROM (" + " UNION ".join(f"SELECT s.rowid FROM {self._rows_match(plan, i)}"
                                                          for i in with_delta) + ")")

    def _rows_sweep(self, plan: Plan, i: int) -> str:
        return (f"DELETE FROM main.{quote(plan.storage)} WHERE rowid IN (SELECT s.rowid FROM "
                f"{self._rows_match(plan, i)} AND s.{GEN_COLUMN_Q} IS NOT :replicator_gen)")

    def _rows_upsert(self, plan: Plan, i: int, with_delta: tuple[int, ...]) -> str:
        """The combinations that hold a changed row of occurrence i (and none of an
        occurrence before it: each combination once)."""
        cached = plan._cache.get(("upsert", i, with_delta))
        if cached:
            return cached
        a = plan.analysis
        assert a is not None
        o = a.occurrences[i]
        keys = f"temp.{quote(_pk_name(o.table.name))} AS _replicator_k"
        extra = [f"{quote(o.alias)}.{quote(k)} IS _replicator_k.c{j}" for j, k in enumerate(o.table.key)]
        for j in with_delta:
            if j >= i:
                continue
            other = a.occurrences[j]
            same = " AND ".join(f"_replicator_x.c{n} IS {quote(other.alias)}.{quote(k)}"
                                for n, k in enumerate(other.table.key))
            extra.append(f"NOT EXISTS (SELECT 1 FROM temp.{quote(_pk_name(other.table.name))} AS _replicator_x "
                         f"WHERE {same})")
        key_exprs = ", ".join(f"{quote(x.alias)}.{quote(k)}" for x in a.occurrences for k in x.table.key)
        stmt = (f"INSERT INTO main.{quote(plan.storage)} SELECT {key_exprs}, :replicator_gen, {a.select} "
                f"FROM {self._from(a, self._order(a, [i]), {}, first=keys)}{self._where(a, extra)}"
                f"{self._upsert_tail(plan)}")
        plan._cache[("upsert", i, with_delta)] = stmt
        return stmt

    # capture -------------------------------------------------------------------------------

    def _arm(self) -> None:
        """Installs the capture triggers of every base table of an incremental view."""
        needed = {t.lower(): t for p in self.plans if p.status == "ok" and p.mode == "incremental"
                  for t in p.tables}
        for low in list(self._armed - set(needed)):
            self._disarm(low)
        for low, table in needed.items():
            if low in self._armed:
                continue
            self._ensure_delta(table)
            delta = quote(_delta_name(table))
            info = self.db.execute(f"PRAGMA main.table_info({quote(table)})").fetchall()
            columns = [r[1] for r in info]
            key = [r[1] for r in sorted((r for r in info if r[5]), key=lambda r: r[5])]
            new = ", ".join(f"NEW.{quote(c)}" for c in columns) + ", 1"
            old = ", ".join(f"OLD.{quote(c)}" for c in columns) + ", -1"
            trigger = f"_replicator_t_{_h(low)}"
            target = f"main.{quote(table)}"
            # INSERT OR REPLACE deletes the row it replaces without firing DELETE triggers
            # (unless recursive_triggers, which makes REPLACE much slower): the row about
            # to be replaced is read by key before the insert instead.
            # `=`, not IS: a NULL in a key never conflicts, so nothing is replaced then.
            match = " AND ".join(f"{quote(k)} = NEW.{quote(k)}" for k in key)
            self.db.execute(f"CREATE TEMP TRIGGER IF NOT EXISTS {quote(trigger + '_b')} BEFORE INSERT ON {target}"
                            f" BEGIN INSERT INTO {delta} SELECT {', '.join(quote(c) for c in columns)}, -1 FROM {target}"
                            f" WHERE {match}; END")
            self.db.execute(f"CREATE TEMP TRIGGER IF NOT EXISTS {quote(trigger + '_i')} AFTER INSERT ON {target}"
                            f" BEGIN INSERT INTO {delta} VALUES ({new}); END")
            self.db.execute(f"CREATE TEMP TRIGGER IF NOT EXISTS {quote(trigger + '_d')} AFTER DELETE ON {target}"
                            f" BEGIN INSERT INTO {delta} VALUES ({old}); END")
            self.db.execute(f"CREATE TEMP TRIGGER IF NOT EXISTS {quote(trigger + '_u')} AFTER UPDATE ON {target}"
                            f" BEGIN INSERT INTO {delta} VALUES ({old}); INSERT INTO {delta} VALUES ({new}); END")
            self._armed.add(low)

    def _disarm(self, low: str) -> None:
        trigger = f"_replicator_t_{_h(low)}"
        for suffix in ("_b", "_i", "_d", "_u"):
            self.db.execute(f"DROP TRIGGER IF EXISTS temp.{quote(trigger + suffix)}")
        self._armed.discard(low)

    # loading -------------------------------------------------------------------------------

    def _load(self) -> None:
        self.plans = []
        self._loaded = True
        if not self._has_catalog():
            self.active = False
            return
        rows = self.db.execute(f"SELECT name, sql, policy, status, columns FROM main.{VIEWS} ORDER BY name"
                               ).fetchall()
        plans = []
        for name, sql, policy, status, columns in rows:
            if status != "ok":
                plans.append(Plan(name=name, sql=sql, policy=policy, mode="full", reason=None, analysis=None,
                                  columns=[], key_columns=[], deps=set(), status=status))
                continue
            try:
                plan = self.plan(name, sql, policy)
            except UserError as exc:
                self._revalidate.setdefault(name, str(exc))
                plans.append(Plan(name=name, sql=sql, policy=policy, mode="full", reason=None, analysis=None,
                                  columns=[], key_columns=[], deps=set(), status="stale"))
                continue
            if [list(c) for c in plan.columns] != json.loads(columns or "[]") or (
                    plan.policy == "incremental" and plan.mode != "incremental"):
                self._revalidate.setdefault(name, "the view's query no longer gives the same columns")
            elif self._layout(plan) != plan.storage_columns():
                # made by another version (e.g. without the state of folded aggregates)
                self._revalidate.setdefault(name, "a new storage layout")
            plans.append(plan)
        self.plans = _in_dependency_order(plans)
        self.active = bool(self.plans)
        if self.active:
            self._grow_cache()

    def _grow_cache(self) -> None:
        """Recomputing keys reads and writes pages all over the base tables and the
        views: a page cache of SQLite's default 2 MB makes each of those a system call,
        and with fewer pages than a batch dirties (its rows, their indexes, the view's
        pages) SQLite spills them to the WAL in the middle of the transaction: the 1M-row
        join of docs/benchmarks.md refreshes a 1 % batch in 110 ms with 64 MB, 75 with 128."""
        size = self.db.execute("PRAGMA cache_size").fetchone()[0]
        if -CACHE_KIB < size < 0 or 0 <= size < CACHE_KIB // 4:
            self.db.execute(f"PRAGMA cache_size = -{CACHE_KIB}")

    # refresh --------------------------------------------------------------------------------

    def _refresh_guarded(self, plan: Plan, forced: str | None) -> bool:
        """Refreshes one view: a view that fails is marked stale, the batch goes on.
        Returns whether its rows changed.

        What a failed refresh wrote is undone by a savepoint, which _guard opens before
        the first statement that computes a view's values while writing its storage. A
        rooted row view computes its rows into a TEMP table and then only copies them:
        it needs none (a savepoint journals the original of every page it touches, half
        the refresh's time on a 1M-row join). A copy can only fail on I/O (a full disk):
        the batch fails whole then, as it would applying its rows."""
        self._guarding, self._guarded, self._copying = True, False, False
        try:
            changed = self.refresh(plan, full_reason=forced)
        except sqlite3.Error as exc:
            if self._copying:
                raise
            if self._guarded:
                self.db.execute("ROLLBACK TO replicator_view")
                self.db.execute("RELEASE replicator_view")
            log.warning("view %s: refresh failed, the view is stale: %s", plan.name, exc)
            self._mark_stale(plan, f"REFRESH_FAILED: {exc}")
            return False
        finally:
            self._guarding = False
        if self._guarded:
            self.db.execute("RELEASE replicator_view")
        return changed

    def _guard(self) -> None:
        """Opens the savepoint of the refresh under way (see _refresh_guarded), once."""
        if self._guarding and not self._guarded:
            self.db.execute("SAVEPOINT replicator_view")
            self._guarded = True

    def refresh(self, plan: Plan, *, full_reason: str | None = None) -> bool:
        """Refreshes one view from this transaction's deltas (or in full) and records it.
        Returns whether its rows changed."""
        started = time.perf_counter()
        rows, seq = self.db.execute(f"SELECT rows, seq FROM main.{VIEWS} WHERE name = ?", (plan.name,)).fetchone()
        counts = _Counts()
        if full_reason is None and plan.mode == "full":
            full_reason = plan.reason.code if plan.reason else "POLICY_FULL"
        if full_reason is None:
            a = plan.analysis
            assert a is not None
            with_delta = {i for i, o in enumerate(a.occurrences) if o.table.name.lower() in self._touched}
            if any(a.occurrences[i].table.name.lower() not in self._armed for i in with_delta):
                full_reason = "UNTRACKED"
            elif with_delta:
                full_reason = self._incremental(plan, with_delta, rows, seq + 1, counts, started)
        if full_reason is not None:
            kind, reason = "full", full_reason
            self._guard()
            counts.deleted, counts.inserted = self._full(plan)
            counts.updated = 0
            rows = counts.inserted
        else:
            rows += counts.inserted - counts.deleted
            kind, reason = ("incremental", "") if counts.keys else ("none", "NO_AFFECTED_KEYS")
        self._record(plan, kind, reason, counts, time.perf_counter() - started, rows)
        return bool(counts.deleted or counts.inserted or counts.updated)

    def _incremental(self, plan: Plan, with_delta: set[int], rows: int, gen: int, counts: _Counts,
                     started: float) -> str | None:
        """Recomputes the affected keys; returns why it must be a full refresh instead, if so."""
        a = plan.analysis
        assert a is not None
        key = tuple(sorted(with_delta))
        costs = self._costs(plan) if plan.policy == "auto" else None
        if plan.policy == "auto":
            # A large change is seen before any key is computed: changed rows against
            # the (approximate) size of their tables, or the cost they predict.
            changed = sum(self._delta_rows(a.occurrences[i].table.name) for i in key) // 2
            size = sum(self._rows_estimate(a.occurrences[i].table.name) for i in key) if costs is None else 0
            why = self._auto_says_full(costs, changed, changed, size, "base rows changed")
            if why:
                return why
        if plan.root is not None:
            return self._incremental_rooted(plan, key, rows, costs, counts, started)
        if a.kind == "rows":
            return self._incremental_rows(plan, key, rows, gen, costs, counts, started)
        return self._incremental_groups(plan, key, rows, gen, costs, counts, started)

    @staticmethod
    def _auto_says_full(costs: tuple[float, float] | None, keys: int, touched: int, rows: int,
                        what: str, started: float | None = None) -> str | None:
        """Why auto refreshes in full: the keys' predicted cost (from the view's refresh
        log) beyond a full refresh's, or, without that history, the rows they touch past
        AUTO_FULL_SHARE of the rows. Once the keys are found (`started`: when the refresh
        began), what finding them took is spent either way: only the rest is weighed."""
        if costs is not None:
            spent = time.perf_counter() - started if started is not None else 0.0
            if keys * costs[0] - spent > AUTO_MARGIN * costs[1]:
                return (f"COST: about {keys} keys at {costs[0] * 1e6:.0f} µs each, a full refresh "
                        f"takes {costs[1] * 1000:.0f} ms")
            return None
        if touched > AUTO_FULL_SHARE * max(rows, 1):
            return f"THRESHOLD: {touched} of {rows} {what}"
        return None

    def _incremental_rooted(self, plan: Plan, key: tuple[int, ...], rows: int,
                            costs: tuple[float, float] | None, counts: _Counts, started: float) -> str | None:
        """A rooted row view: its affected rowids, their rows computed into a TEMP table
        (where a failing expression fails before anything is written), then copied."""
        *fills, compute, present, write, sweep = self._rooted_statements(plan, key)
        self.db.execute(f"DELETE FROM temp.{quote(plan.keys_table)}")
        self.db.execute(f"DELETE FROM temp.{quote(plan.rows_table)}")
        counts.keys = sum(self.db.execute(stmt).rowcount for stmt in fills)
        if not counts.keys:
            return None
        if plan.policy == "auto":
            why = self._auto_says_full(costs, counts.keys, counts.keys, rows, "rows", started)
            if why:
                return why
        computed = self.db.execute(compute).rowcount
        counts.updated = self.db.execute(present).fetchone()[0]
        self._copying = True
        self.db.execute(write)
        counts.deleted = self.db.execute(sweep).rowcount
        counts.inserted = computed - counts.updated
        return None

    def _incremental_rows(self, plan: Plan, key: tuple[int, ...], rows: int, gen: int,
                          costs: tuple[float, float] | None, counts: _Counts, started: float) -> str | None:
        """Other row views: the combinations holding a changed base row are upserted with
        generation `gen` (updated in place, or inserted with a rowid above the largest one
        before); the rows naming a changed key that did not get it are gone (swept)."""
        a = plan.analysis
        assert a is not None
        storage = f"main.{quote(plan.storage)}"
        params = {"replicator_gen": gen}
        for table in {a.occurrences[i].table.name for i in key}:
            self.db.execute(f"DELETE FROM temp.{quote(_pk_name(table))}")
        filled: set[str] = set()
        for i in key:
            if a.occurrences[i].table.name not in filled:
                filled.add(a.occurrences[i].table.name)
                counts.keys += self.db.execute(self._pk_fill(plan, i)).rowcount
        if not counts.keys:
            return None
        if plan.policy == "auto":
            # no history yet: count the rows the keys touch (an index scan per key)
            touched = counts.keys if costs is not None else max(counts.keys, sum(
                self.db.execute(self._rows_count(plan, (i,))).fetchone()[0] for i in key))
            why = self._auto_says_full(costs, counts.keys, touched, rows, "rows", started)
            if why:
                return why
        self._guard()
        before = self.db.execute(f"SELECT coalesce(max(rowid), 0) FROM {storage}").fetchone()[0]
        upserted = sum(self.db.execute(self._rows_upsert(plan, i, key), params).rowcount for i in key)
        counts.deleted = sum(self.db.execute(self._rows_sweep(plan, i), params).rowcount for i in key)
        counts.inserted = self.db.execute(f"SELECT count(*) FROM {storage} WHERE rowid > ?", (before,)).fetchone()[0]
        counts.updated = upserted - counts.inserted
        return None

    def _incremental_groups(self, plan: Plan, key: tuple[int, ...], rows: int, gen: int,
                            costs: tuple[float, float] | None, counts: _Counts, started: float) -> str | None:
        """Aggregate and DISTINCT views: the batch's delta folded into the groups it can
        be (see _Fold), the other affected keys recomputed from their rows and upserted
        with generation `gen`; their rows that did not get it are gone (swept). A fold
        that recomputes no group only copies what its TEMP table holds: no savepoint."""
        storage = f"main.{quote(plan.storage)}"
        params = {"replicator_gen": gen}
        self.db.execute(f"DELETE FROM temp.{quote(plan.keys_table)}")
        folding = plan.fold is not None
        if folding:
            fill, update, insert, delete, redo = self._fold_statements(plan)
            self.db.execute(f"DELETE FROM temp.{quote(plan.fold_table)}")
            try:
                counts.keys = self.db.execute(fill).rowcount
            except sqlite3.OperationalError as exc:
                if "overflow" not in str(exc):
                    raise
                folding = False   # a sum of the batch overflows: recompute its groups
        if not folding:
            counts.keys = self.db.execute(self._keys_fill(plan, key)).rowcount
        if not counts.keys:
            return None
        # the groups recomputed from their rows: a fold's others cost what the batch's rows
        # do, however large a share of the view they are (every group of a view of a few)
        recomputed = self.db.execute(redo).rowcount if folding else counts.keys
        if plan.policy == "auto":
            why = self._auto_says_full(costs, counts.keys, recomputed, rows,
                                       "groups to recompute" if folding else "keys", started)
            if why:
                return why
        recompute = recomputed > 0
        if recompute:
            self._guard()
        else:
            self._copying = True
        if folding:
            counts.updated = self.db.execute(update).rowcount
            counts.inserted = self.db.execute(insert, params).rowcount
            counts.deleted = self.db.execute(delete).rowcount
        if recompute:
            # new rows get rowids above the largest one left (the fold may have deleted it)
            mark = self.db.execute(f"SELECT coalesce(max(rowid), 0) FROM {storage}").fetchone()[0]
            upserted = self.db.execute(self._keys_upsert(plan), params).rowcount
            counts.deleted += self.db.execute(self._keys_sweep(plan), params).rowcount
            new = self.db.execute(f"SELECT count(*) FROM {storage} WHERE rowid > ?", (mark,)).fetchone()[0]
            counts.updated += upserted - new
            counts.inserted += new
        return None

    def _costs(self, plan: Plan) -> tuple[float, float] | None:
        """(median seconds per key of its latest incremental refreshes of AUTO_MIN_KEYS keys
        or more, seconds of its latest full refresh), from the view's refresh log (however
        many refreshes ago: _record keeps them); None while there is too little of it."""
        full = self.db.execute(_LATEST_FULL, {"view": plan.name}).fetchone()
        per_key = [seconds / keys for _, seconds, keys in self.db.execute(_COST_SAMPLES, {"view": plan.name})]
        if full is None or len(per_key) < 2:
            return None
        return sorted(per_key)[len(per_key) // 2], full[1]

    def _delta_rows(self, table: str) -> int:
        """Rows in a delta table: rows are only added to it in a transaction, so the span of
        their rowids (count(*) reads every page: a large change spills them to a file)."""
        name = f"temp.{quote(_delta_name(table))}"
        # two subqueries: min() and max() in one SELECT scan the table, alone each is one seek
        low, high = self.db.execute(f"SELECT (SELECT min(rowid) FROM {name}), (SELECT max(rowid) FROM {name})"
                                    ).fetchone()
        return 0 if low is None else high - low + 1

    def _rows_estimate(self, table: str) -> int:
        """Rows of a table, roughly and cheaply: the span of its rowids."""
        name = f"main.{quote(table)}"
        low, high = self.db.execute(f"SELECT (SELECT min(rowid) FROM {name}), (SELECT max(rowid) FROM {name})"
                                    ).fetchone()
        return 0 if low is None else high - low + 1

    def _full(self, plan: Plan) -> tuple[int, int]:
        """Recomputes all of it. The key indexes are built again afterwards: one
        sort beats maintaining them row by row (and keeps auto's full refresh as
        cheap as a view without keys)."""
        deleted = self.db.execute(f"SELECT rows FROM main.{VIEWS} WHERE name = ?", (plan.name,)).fetchone()[0]
        indexes = self.db.execute("SELECT name, sql FROM main.sqlite_master WHERE type = 'index' AND tbl_name = ?"
                                  " AND sql IS NOT NULL", (plan.storage,)).fetchall()
        for name, _ in indexes:
            self.db.execute(f"DROP INDEX main.{quote(name)}")
        self.db.execute(f"DELETE FROM main.{quote(plan.storage)}")
        inserted = self.db.execute(plan.full_insert).rowcount
        for _, sql in indexes:
            self.db.execute(sql)
        return deleted, inserted

    def _record(self, plan: Plan, kind: str, reason: str, counts: _Counts, seconds: float, rows: int) -> None:
        now = _now()
        seq = self.db.execute(f"UPDATE main.{VIEWS} SET rows = ?, seq = seq + 1, refreshed_at = ?"
                              f" WHERE name = ? RETURNING seq", (rows, now, plan.name)).fetchone()[0]
        self.db.execute(f"INSERT INTO main.{REFRESHES} VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (plan.name, seq, now, kind, reason, counts.keys if kind != "full" or counts.keys else None,
                         counts.deleted, counts.inserted, counts.updated, round(seconds, 6)))
        if seq > KEEP_REFRESHES:
            self.db.execute(f"DELETE FROM main.{REFRESHES} WHERE view = :view AND seq <= :old"
                            f" AND seq NOT IN (SELECT seq FROM ({_LATEST_FULL}))"
                            f" AND seq NOT IN (SELECT seq FROM ({_COST_SAMPLES}))",
                            {"view": plan.name, "old": seq - KEEP_REFRESHES})

    def _mark_stale(self, plan: Plan, why: str) -> None:
        plan.status = "stale"
        self.db.execute(f"UPDATE main.{VIEWS} SET status = 'stale', status_reason = ?, version = version + 1"
                        " WHERE name = ?", (why, plan.name))
        self._record(plan, "none", why.split(":")[0], _Counts(), 0.0,
                     self.db.execute(f"SELECT rows FROM main.{VIEWS} WHERE name = ?", (plan.name,)).fetchone()[0])
        self._loaded = False

    # storage and indexes ---------------------------------------------------------------

    def _create_storage(self, plan: Plan) -> None:
        storage = quote(plan.storage)
        self.db.execute(f"DROP VIEW IF EXISTS main.{quote(plan.name)}")
        self.db.execute(f"DROP TABLE IF EXISTS main.{storage}")
        self.db.execute(f"CREATE TABLE main.{storage} ({plan.storage_definition()})")
        for _, create in self._storage_indexes(plan):
            self.db.execute(create)
        self.db.execute(f"CREATE VIEW main.{quote(plan.name)} AS SELECT "
                        f"{', '.join(quote(c) for c, _ in plan.columns)} FROM main.{storage}")

    def _storage_indexes(self, plan: Plan) -> list[tuple[str, str]]:
        """(name, CREATE INDEX) of each index of a view's storage: the unique key (the
        upserts' conflict target; it also serves the first table's keys) and, for a row
        view, each other table's keys. A rooted view is stored by its rowid: none."""
        a = plan.analysis
        if plan.mode != "incremental" or a is None or plan.root is not None:
            return []
        storage = quote(plan.storage)
        indexes = [(plan.storage + "_k", "UNIQUE INDEX", plan.key_columns)]
        if a.kind == "rows":
            indexes += [(plan.storage + f"_k{i}", "INDEX", self._occurrence_keys(plan, i))
                        for i in range(1, len(a.occurrences))]
        return [(name, f"CREATE {kind} main.{quote(name)} ON {storage} ({', '.join(quote(c) for c in columns)})")
                for name, kind, columns in indexes]

    def _restore_indexes(self) -> None:
        """Makes again the views' storage and helper indexes another connection dropped
        (by hand, say): without them each affected key would scan a table."""
        for plan in self.plans:
            if plan.status != "ok" or plan.mode != "incremental" or plan.name in self._revalidate:
                continue   # a view to check again gets its indexes when it is installed
            try:
                made = self._ensure_indexes(plan)
                have = {r[1] for r in self.db.execute(f"PRAGMA main.index_list({quote(plan.storage)})")}
                for name, create in self._storage_indexes(plan):
                    if name not in have:
                        self.db.execute(create)
                        made.append(name)
            except sqlite3.Error as exc:
                # a table dropped by hand too: the view's refresh fails and marks it stale
                log.warning("view %s: its indexes could not be made again: %s", plan.name, exc)
                continue
            if made:
                log.warning("view %s: made its dropped indexes again: %s", plan.name, ", ".join(made))

    def _layout(self, plan: Plan) -> list[str]:
        """The columns of a view's storage table as it is."""
        return [r[1] for r in self.db.execute(f"PRAGMA main.table_info({quote(plan.storage)})")]

    def _helper_indexes(self, table: str) -> list[tuple[str, list[str]]]:
        out = []
        for row in self.db.execute(f"PRAGMA main.index_list({quote(table)})").fetchall():
            if row[1].startswith(INDEX_PREFIX):
                out.append((row[1], [r[2] for r in self.db.execute(f"PRAGMA main.index_info({quote(row[1])})")]))
        return out

    def _ensure_indexes(self, plan: Plan) -> list[str]:
        """Makes the helper indexes a view's maintenance seeks through, unless an index
        of the table already starts with their columns. Returns the names of those made."""
        made = []
        for table, columns in plan.indexes:
            want = [c.lower() for c in columns]
            if want[0] == (self._rowid_key(table) or "").lower():
                continue   # the rowid
            covered = False
            for row in self.db.execute(f"PRAGMA main.index_list({quote(table)})").fetchall():
                have = [(r[2] or "").lower() for r in self.db.execute(f"PRAGMA main.index_info({quote(row[1])})")]
                if have[:len(want)] == want and not row[4]:   # not a partial index
                    covered = True
                    break
            if not covered:
                name = _helper_index_name(table, columns)
                self.db.execute(f"CREATE INDEX main.{quote(name)} ON {quote(table)} "
                                f"({', '.join(quote(c) for c in columns)})")
                made.append(name)
        return made

    def _drop_unused_indexes(self) -> None:
        """Helper indexes no view needs any more."""
        needed = set()
        for plan in self.plans:
            for table, columns in plan.indexes:
                needed.add(_helper_index_name(table, columns))
        rows = self.db.execute("SELECT name FROM main.sqlite_master WHERE type = 'index'"
                               " AND substr(name, 1, ?) = ?", (len(INDEX_PREFIX), INDEX_PREFIX)).fetchall()
        for (name,) in rows:
            if name not in needed:
                self.db.execute(f"DROP INDEX IF EXISTS main.{quote(name)}")

    # schema changes -------------------------------------------------------------------

    def _revalidate_view(self, name: str, why: str) -> str | None:
        """Plans a view again after a schema change: installs it and schedules a
        full refresh, or marks it stale. Returns the error, if any."""
        row = self.db.execute(f"SELECT sql, policy, columns, status FROM main.{VIEWS} WHERE name = ?",
                              (name,)).fetchone()
        if row is None:
            return None
        sql, policy, columns, status = row
        old = next((p for p in self.plans if p.name == name), None)
        self.db.execute("SAVEPOINT replicator_view")
        try:
            plan = self.plan(name, sql, policy)
            if policy == "incremental" and plan.mode != "incremental":
                raise UserError(f"it can no longer be maintained incrementally: {plan.reason.code if plan.reason else ''}"
                                f" {plan.reason.message if plan.reason else ''}")
            self._install(plan, rebuild=[list(c) for c in plan.columns] != json.loads(columns or "[]")
                          or old is None or old.key_columns != plan.key_columns or old.mode != plan.mode
                          or self._layout(plan) != plan.storage_columns())
        except (UserError, sqlite3.Error) as exc:
            self.db.execute("ROLLBACK TO replicator_view")
            self.db.execute("RELEASE replicator_view")
            stale = old or Plan(name=name, sql=sql, policy=policy, mode="full", reason=None, analysis=None,
                                columns=[], key_columns=[], deps=set())
            if status == "ok":
                log.warning("view %s is stale after a %s: %s", name, why, exc)
                self._mark_stale(stale, f"SCHEMA_CHANGE: {why}: {exc}; rebuild it (view drop, view create)"
                                        f" or run view refresh once the query runs again")
            return str(exc)
        self.db.execute("RELEASE replicator_view")
        self._forced[name] = "SCHEMA_CHANGE"
        self.plans = _in_dependency_order([p for p in self.plans if p.name != name] + [plan])
        self.active = True
        self._loaded = False   # re-arm at the next transaction
        return None

    def _install(self, plan: Plan, *, rebuild: bool) -> None:
        """Records a (re)validated plan: storage, indexes, catalog row."""
        if rebuild:
            self._create_storage(plan)
        self._ensure_indexes(plan)
        self.db.execute(f"UPDATE main.{VIEWS} SET maintenance = ?, reason = ?, columns = ?, deps = ?, status = 'ok',"
                        " status_reason = NULL, version = version + 1 WHERE name = ?",
                        (plan.mode, json.dumps(plan.reason.as_dict()) if plan.reason else None,
                         json.dumps([list(c) for c in plan.columns]), json.dumps(sorted(plan.deps)), plan.name))

    # the library API (each call in a transaction of its own) ---------------------------------

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        self.db.execute("PRAGMA busy_timeout = 60000")
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            raise UserError(f"the target is busy: {exc}") from None
        try:
            self.begun()
            yield
            self.before_commit()
            self.db.execute("COMMIT")
        except BaseException:
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            self.rolled_back()
            raise

    def _get(self, name: str) -> tuple[Any, ...]:
        row = self.db.execute(f"SELECT name, sql, policy, status FROM main.{VIEWS} WHERE name = ?"
                              f" COLLATE NOCASE", (name,)).fetchone() if self._has_catalog() else None
        if row is None:
            raise UserError(f"no view {name!r} in this target (see `replicator view list`)")
        return row

    def create(self, name: str, sql: str, policy: str = "auto") -> dict[str, Any]:
        check_name(name)
        check_policy(policy)
        try:
            self._create(name, sql, policy)
        except sqlite3.Error as exc:   # the query prepares but fails on the rows (an overflow, bad JSON...)
            raise UserError(f"view {name} not created: its query fails on the target: {exc}") from None
        self._grow_cache()
        return self.info(name)

    def _create(self, name: str, sql: str, policy: str) -> None:
        with self._transaction():
            self._ensure_catalog()
            if self.db.execute(f"SELECT 1 FROM main.{VIEWS} WHERE name = ? COLLATE NOCASE", (name,)).fetchone():
                raise UserError(f"view {name!r} exists: drop it first (`replicator view drop {name}`)")
            if self.db.execute("SELECT 1 FROM main.sqlite_master WHERE name = ? COLLATE NOCASE",
                               (name,)).fetchone():
                raise UserError(f"the target already has a table, view or index named {name!r}")
            plan = self.plan(name, sql, policy)
            if policy == "incremental" and plan.mode != "incremental":
                assert plan.reason is not None
                raise UserError(f"view {name} cannot be maintained incrementally: {plan.reason.code}: "
                                f"{plan.reason.message} (at: {plan.reason.fragment}); "
                                f"use --policy auto to refresh it in full")
            self._check_cycle(plan)
            now = _now()
            self.db.execute(f"INSERT INTO main.{VIEWS} (name, sql, policy, maintenance, created_at) "
                            "VALUES (?, ?, ?, ?, ?)", (name, plan.sql, policy, plan.mode, now))
            self._install(plan, rebuild=True)
            self.refresh(plan, full_reason="CREATE")
            self.plans = _in_dependency_order(self.plans + [plan])
            self.active = True
            self._loaded = False

    def _check_cycle(self, plan: Plan) -> None:
        storages = {p.storage.lower(): p for p in self.plans}
        seen: set[str] = set()
        stack = [plan]
        while stack:
            p = stack.pop()
            for dep in p.deps:
                other = storages.get(dep)
                if other is not None and other.name not in seen:
                    if other.name == plan.name:
                        raise UserError(f"view {plan.name} would read itself")
                    seen.add(other.name)
                    stack.append(other)

    def drop(self, name: str) -> None:
        with self._transaction():
            real = self._get(name)[0]
            plan = next((p for p in self.plans if p.name == real), None)
            storage = (STORAGE_PREFIX + real).lower()
            readers = [p.name for p in self.plans if p.name != real and storage in p.deps]
            if readers:
                raise UserError(f"view {real} is read by view(s) {', '.join(readers)}: drop them first")
            self.db.execute(f"DROP VIEW IF EXISTS main.{quote(real)}")
            self.db.execute(f"DROP TABLE IF EXISTS main.{quote(STORAGE_PREFIX + real)}")
            self.db.execute(f"DELETE FROM main.{VIEWS} WHERE name = ?", (real,))
            self.db.execute(f"DELETE FROM main.{REFRESHES} WHERE view = ?", (real,))
            if plan is not None:
                self.db.execute(f"DROP TABLE IF EXISTS temp.{quote(plan.keys_table)}")
            self.plans = [p for p in self.plans if p.name != real]
            self._drop_unused_indexes()
            self._loaded = False

    def refresh_now(self, name: str, *, full: bool = False) -> tuple[dict[str, Any], bool]:
        """Recomputes a view when it needs it (stale after a schema change, or
        maintained in full) or when asked to (full). Returns its state and
        whether it was recomputed."""
        with self._transaction():
            real, _sql, _policy, status = self._get(name)
            if status != "ok":
                error = self._revalidate_view(real, "view refresh")
                if error is not None:
                    raise UserError(f"view {real} cannot be refreshed: {error}")
            plan = next(p for p in self.plans if p.name == real)
            recompute = full or plan.mode == "full" or real in self._forced
            if recompute:
                self._forced[real] = "MANUAL"
        return self.info(real), recompute

    def info(self, name: str) -> dict[str, Any]:
        found = next((v for v in self.list() if v["view"].lower() == name.lower()), None)
        if found is None:
            raise UserError(f"no view {name!r} in this target (see `replicator view list`)")
        return found

    def list(self) -> list[dict[str, Any]]:
        if not self._has_catalog():
            return []
        out = []
        for row in self.db.execute(
                f"SELECT v.name, v.policy, v.maintenance, v.reason, v.status, v.status_reason, v.rows, v.sql,"
                f" r.at, r.kind, r.reason, r.keys, r.rows_deleted, r.rows_inserted, r.rows_updated, r.seconds"
                f" FROM main.{VIEWS} v LEFT JOIN main.{REFRESHES} r ON r.view = v.name AND r.seq = v.seq"
                f" ORDER BY v.name"):
            (name, policy, mode, reason, status, status_reason, rows, sql, at, kind, last_reason, keys,
             deleted, inserted, updated, seconds) = row
            reason_d = json.loads(reason) if reason else None
            out.append({"view": name, "policy": policy, "maintenance": mode, "status": status,
                        "status_reason": status_reason, "rows": rows,
                        "reason": reason_d["code"] if reason_d else None,
                        "reason_message": reason_d["message"] if reason_d else None,
                        "fragment": reason_d["fragment"] if reason_d else None,
                        "last_refresh": {"at": at, "kind": kind, "reason": last_reason, "keys": keys,
                                         "rows_deleted": deleted, "rows_inserted": inserted,
                                         "rows_updated": updated, "seconds": seconds} if at else None,
                        "sql": sql})
        return out

    def refreshes(self, name: str, limit: int = 20) -> list[dict[str, Any]]:
        real = self._get(name)[0]
        cur = self.db.execute(f"SELECT seq, at, kind, reason, keys, rows_deleted, rows_inserted, rows_updated,"
                              f" seconds FROM "
                              f"main.{REFRESHES} WHERE view = ? ORDER BY seq DESC LIMIT ?", (real, limit))
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r)) for r in cur]

    def explain(self, sql: str, policy: str = "auto") -> dict[str, Any]:
        """What create would do with this SQL, without doing it."""
        check_policy(policy)
        self.db.execute("BEGIN")
        try:
            self._replicated = None
            plan = self.plan("explain", sql, policy)
            out = plan.describe()
            del out["view"]
            out["statements"] = self._explain_statements(plan)
        finally:
            self.db.execute("ROLLBACK")
            self.rolled_back()
        if policy == "incremental" and plan.mode != "incremental":
            out["maintenance"] = "refused"
        return out

    def _explain_statements(self, plan: Plan) -> dict[str, Any]:
        if plan.mode != "incremental" or plan.analysis is None:
            return {"full": plan.full_insert}
        every = set(range(len(plan.analysis.occurrences)))
        return {"full": plan.full_insert, "incremental": self._statements(plan, every)}


def _in_dependency_order(plans: list[Plan]) -> list[Plan]:
    """Views after the views they read (a view reads another through its storage table)."""
    by_storage = {p.storage.lower(): p for p in plans}
    done: list[Plan] = []
    seen: set[str] = set()

    def visit(p: Plan, path: tuple[str, ...]) -> None:
        if p.name in seen or p.name in path:
            return
        for dep in sorted(p.deps):
            other = by_storage.get(dep)
            if other is not None:
                visit(other, path + (p.name,))
        seen.add(p.name)
        done.append(p)

    for p in sorted(plans, key=lambda p: p.name):
        visit(p, ())
    return done
