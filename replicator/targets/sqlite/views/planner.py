"""Planning a view: its definition analysed against the replica as it is now, and the Plan of how
it is stored and maintained. An incremental view's storage key (the rowid of its root table, the
keys of every base table of a row view, the GROUP BY or DISTINCT values), whether its aggregates
fold from state, the helper indexes its statements seek through, and the TEMP tables they use;
its statements are then prepared (not run), and a view one of them does not prepare for is
refreshed in full instead (REWRITE): a misreading of the query costs speed, not correctness."""

from __future__ import annotations

import sqlite3
from typing import Any

from replicator.errors import UserError
from replicator.targets.sqlite.views import names, statements, temp
from replicator.targets.sqlite.views.capture import Capture
from replicator.targets.sqlite.views.names import ROW_COLUMN
from replicator.targets.sqlite.views.plan import Fold, Plan
from replicator.targets.sqlite.views.sql import quote
from replicator.targets.sqlite.views.tables import ReplicaTables, compares_as_stored, rowid_key
from replicator.views.analysis import Analysis, Reason, analyse

COVERING_MAX_COLUMNS = 4       # GROUP BY columns plus the columns the view reads, for a covering index
_AGGREGATE_OPCODES = {"AggStep", "AggStep1", "AggFinal", "AggValue", "AggInverse"}
# Aggregates a fold maintains from state (see Fold); any other function name called in
# a select item makes the view recompute its keys instead.
_FOLDABLE = {"count", "sum", "avg", "total", "min", "max"}


def plan_view(db: sqlite3.Connection, capture: Capture, name: str, sql: str, policy: str) -> Plan:
    """Analyses a definition against the target as it is now. Raises UserError
    when the SQL does not run here."""
    analysis = analyse(sql, ReplicaTables(db).info)
    sql = analysis.sql
    columns, deps, aggregates = _probe(db, sql)
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
            _build(db, capture, plan)
        except sqlite3.Error as exc:
            plan.mode, plan.reason = "full", Reason("REWRITE", "", str(exc))
            plan.key_columns, plan.key_types, plan.indexes = [], [], []
            plan.fold, plan.fold_reason, plan.root = None, "", None
            plan.statement_cache.clear()
    if plan.mode == "full":
        plan.full_insert = statements.full_insert(plan)
    return plan


def _probe(db: sqlite3.Connection, sql: str) -> tuple[list[tuple[str, str]], set[str], bool]:
    """The query's columns (names and declared types, as a view of it has them),
    the tables it reads, and whether it aggregates. Runs nothing."""
    deps: set[str] = set()

    def authorize(action: int, arg1: Any, arg2: Any, dbname: Any, source: Any) -> int:
        if action == sqlite3.SQLITE_READ and dbname == "main" and arg1:
            deps.add(str(arg1).lower())
        return sqlite3.SQLITE_OK

    db.set_authorizer(authorize)
    try:
        opcodes = {row[1] for row in db.execute(f"EXPLAIN {sql}")}
    except sqlite3.Error as exc:
        raise UserError(f"the view's SQL does not run on the target: {exc}") from None
    finally:
        db.set_authorizer(None)
    probe = "_replicator_probe"
    try:
        db.execute(f"DROP VIEW IF EXISTS temp.{probe}")
        db.execute(f"CREATE TEMP VIEW {probe} AS {sql}")
        columns = [(r[1], r[2] or "") for r in db.execute(f"PRAGMA temp.table_info({probe})")]
        db.execute(f"DROP VIEW temp.{probe}")
    except sqlite3.Error as exc:
        raise UserError(f"the view's SQL does not run on the target: {exc}") from None
    return columns, deps, bool(opcodes & _AGGREGATE_OPCODES)


def _build(db: sqlite3.Connection, capture: Capture, plan: Plan) -> None:
    """Plans an incremental view's maintenance, and prepares its statements to check them."""
    a = plan.analysis
    assert a is not None
    if a.kind == "rows":
        plan.root = _root(db, a)
    if plan.root is not None:
        plan.key_columns = [ROW_COLUMN]
    elif a.kind == "rows":
        plan.key_columns = [f"_replicator_k{i}_{j}" for i, o in enumerate(a.occurrences)
                            for j in range(len(o.table.key))]
    else:
        plan.key_columns = [f"_replicator_k{j}" for j in range(len(a.keys))]
    # Key columns everywhere (storage, temp key tables) get the declared type of the
    # key expression: the same affinity on both sides of IS keeps indexes usable.
    probe = "_replicator_probe_k"
    db.execute(f"DROP VIEW IF EXISTS temp.{probe}")
    db.execute(f"CREATE TEMP VIEW {probe} AS SELECT {', '.join(statements.key_expressions(plan))} FROM {a.from_sql}")
    plan.key_types = [r[2] or "" for r in db.execute(f"PRAGMA temp.table_info({probe})")]
    db.execute(f"DROP VIEW temp.{probe}")
    if a.kind == "aggregate":
        plan.fold, plan.fold_reason = _plan_fold(a)
    plan.full_insert = statements.full_insert(plan)
    plan.indexes = _helper_indexes(db, a)
    make_temp_tables(db, capture, plan)
    _prepare(db, plan)


def _helper_indexes(db: sqlite3.Connection, a: Analysis) -> list[tuple[str, tuple[str, ...]]]:
    """(table, columns) of the indexes the statements seek through: join columns, and the first
    table's GROUP BY / DISTINCT columns; longest first: an index that covers a shorter one's
    columns serves both."""
    wanted: list[tuple[str, tuple[str, ...]]] = []

    def covering(i: int, cols: tuple[str, ...]) -> tuple[str, ...]:
        """cols, then the other columns the view reads of occurrence i, if that stays
        small: the rows of a key are then read from the index alone."""
        rowid = (rowid_key(db, a.occurrences[i].table.name) or "").lower()
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
    return sorted(dict.fromkeys(wanted), key=lambda w: -len(w[1]))


def make_temp_tables(db: sqlite3.Connection, capture: Capture, plan: Plan) -> None:
    """The TEMP tables the statements use: deltas, keys, and a rooted view's rows or a fold's groups."""
    a = plan.analysis
    assert a is not None
    for o in a.occurrences:
        capture.ensure_delta(o.table.name)
    if plan.root is not None:
        temp.ensure_keys_table(db, plan.keys_table, ["INTEGER PRIMARY KEY"])
        temp.ensure_rows_table(db, plan)
    elif a.kind == "rows":
        for i, o in enumerate(a.occurrences):
            before = sum(len(x.table.key) for x in a.occurrences[:i])
            temp.ensure_keys_table(db, names.changed_keys_table(o.table.name),
                                   plan.key_types[before:before + len(o.table.key)])
    else:
        temp.ensure_keys_table(db, plan.keys_table, plan.key_types)
    if plan.fold:
        temp.ensure_fold_table(db, plan)


def _prepare(db: sqlite3.Connection, plan: Plan) -> None:
    """Prepares every statement, against a stand-in for the storage (which may not exist yet,
    or have other columns). Raises sqlite3.Error for one that does not prepare."""
    a = plan.analysis
    assert a is not None
    storage = f"main.{quote(plan.storage)}"
    stand_in = "_replicator_probe_mv"
    db.execute(f"DROP TABLE IF EXISTS temp.{stand_in}")
    db.execute(f"CREATE TEMP TABLE {stand_in} ({plan.storage_definition()})")
    if plan.root is None:
        db.execute(f"CREATE UNIQUE INDEX temp.{stand_in}_k ON {stand_in} "
                   f"({', '.join(quote(c) for c in plan.key_columns)})")
    try:
        for stmt in [*statements.statements(plan, set(range(len(a.occurrences)))), plan.full_insert]:
            db.execute("EXPLAIN " + stmt.replace(storage, f"temp.{stand_in}"), {"replicator_gen": 0})
    finally:
        db.execute(f"DROP TABLE temp.{stand_in}")


def _plan_fold(a: Analysis) -> tuple[Fold | None, str]:
    """Whether an aggregate view's aggregates can be folded from state (see Fold), and why not."""
    if len(a.occurrences) != 1:
        return None, "a join (aggregates are folded for a single table)"
    if a.having:
        return None, "HAVING"
    o = a.occurrences[0]
    types = {c.lower(): (c, t) for c, t in o.table.columns}
    fold = Fold(outputs=[], args=[], names=[])
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


def _root(db: sqlite3.Connection, a: Analysis) -> int | None:
    """The occurrence whose rows are the view's rows one to one, if there is one with an
    INTEGER PRIMARY KEY: every other table joins, directly or through another, by `=`
    on all of its key columns (unique, and `=` matches no NULL: at most one row each)."""
    types = [{c.lower(): t for c, t in o.table.columns} for o in a.occurrences]
    pairs = [((x, cx), (y, cy)) for (x, cx), (y, cy) in a.strict_equi + [(right, left) for left, right in a.strict_equi]
             if compares_as_stored(types[y].get(cy.lower(), ""), types[x].get(cx.lower(), ""))]
    for root, o in enumerate(a.occurrences):
        if rowid_key(db, o.table.name) is None:
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
