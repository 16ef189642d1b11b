"""The model of a view as loaded: its Plan (how it is stored and maintained), the Fold of an
aggregate view kept from state, and the order views are refreshed in (after the views they read).
How a plan is made from a definition is replicator.targets.sqlite.views.planner."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from replicator.errors import UserError
from replicator.targets.sqlite.views import names
from replicator.targets.sqlite.views.names import GEN_COLUMN, ROW_COLUMN, STORAGE_PREFIX
from replicator.targets.sqlite.views.sql import column_definitions
from replicator.views.analysis import Analysis, Reason


@dataclass
class Fold:
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
    fold: Fold | None = None               # aggregates folded from state, when they can be
    fold_reason: str = ""                  # why not, for an aggregate view
    root: int | None = None                # row view: the occurrence whose rowid is the storage row's
    # the maintenance statements made so far (see statements.py), by what they are for
    statement_cache: dict[Hashable, list[str]] = field(default_factory=dict)

    @classmethod
    def unplanned(cls, name: str, sql: str, policy: str, status: str = "ok") -> Plan:
        """A view known by its definition only: stale, or no longer planned."""
        return cls(name=name, sql=sql, policy=policy, mode="full", reason=None, analysis=None,
                   columns=[], key_columns=[], deps=set(), status=status)

    @property
    def storage(self) -> str:
        return STORAGE_PREFIX + self.name

    @property
    def keys_table(self) -> str:
        return names.keys_table(self.name)

    @property
    def rows_table(self) -> str:
        """TEMP table of a rooted row view's recomputed rows."""
        return names.rows_table(self.name)

    @property
    def fold_table(self) -> str:
        return names.fold_table(self.name)

    @property
    def state_columns(self) -> list[str]:
        return self.fold.state_columns() if self.fold else []

    def _storage_layout(self) -> list[tuple[str, str]]:
        """The storage table's (column, declared type)s."""
        if self.root is not None:
            return [(ROW_COLUMN, "INTEGER PRIMARY KEY"), *self.columns]
        return (list(zip(self.key_columns, self.key_types)) + ([(GEN_COLUMN, "INTEGER")] if self.key_columns else [])
                + self.columns + [(c, "") for c in self.state_columns])

    def storage_columns(self) -> list[str]:
        return [c for c, _ in self._storage_layout()]

    def storage_definition(self) -> str:
        """The storage table's column definitions."""
        return column_definitions(self._storage_layout())

    def occurrence_key_columns(self, i: int) -> list[str]:
        """The storage key columns of a row view that hold occurrence i's key."""
        a = self.analysis
        assert a is not None
        before = sum(len(o.table.key) for o in a.occurrences[:i])
        return self.key_columns[before:before + len(a.occurrences[i].table.key)]

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
        if a is None:
            return None
        plain = [c for c in a.key_columns if c is not None]
        if not plain or len(plain) != len(a.key_columns):
            return None
        keys = {c.lower() for _, c in plain}
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


def in_dependency_order(plans: list[Plan]) -> list[Plan]:
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
                visit(other, (*path, p.name))
        seen.add(p.name)
        done.append(p)

    for p in sorted(plans, key=lambda p: p.name):
        visit(p, ())
    return done


def check_reads_not_itself(plan: Plan, plans: list[Plan]) -> None:
    """Refuses a view that would read itself, through the views it reads."""
    storages = {p.storage.lower(): p for p in plans}
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
