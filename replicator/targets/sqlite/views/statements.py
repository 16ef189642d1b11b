"""The SQL that maintains a view, made from its plan: its full recompute, and the statements of
an incremental refresh for each way a view is maintained (aggregate and DISTINCT views by their
affected keys, folded aggregates, rooted row views, other row views). Made once per plan and
view of what a batch changed (Plan.statement_cache); nothing here runs them (see refresh.py).

Statements join in an order they fix with CROSS JOIN: the changed keys first, then each table
reached through an equality, on the helper indexes planner.py asks for. The generation of the
refresh under way is the parameter :replicator_gen."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from itertools import combinations

from replicator.targets.sqlite.views import names
from replicator.targets.sqlite.views.names import GEN_COLUMN, GEN_COLUMN_Q, ROW_COLUMN, SIGN_COLUMN
from replicator.targets.sqlite.views.plan import Plan
from replicator.targets.sqlite.views.sql import quote
from replicator.views.analysis import Analysis

# Integers whose absolute values sum to at most this add up exactly in doubles, in any
# order: avg and total folded from an integer sum then equal SQLite's own (which adds
# doubles row by row). Below 2**53, with a margin for the double the bound is kept in.
EXACT = 2 ** 52


def _cached(plan: Plan, key: Hashable, make: Callable[[], list[str]]) -> list[str]:
    """The statements `key` names, made on first use: a plan's statements stay the same."""
    stmts = plan.statement_cache.get(key)
    if stmts is None:
        stmts = plan.statement_cache[key] = make()
    return stmts


def _cached_one(plan: Plan, key: Hashable, make: Callable[[], str]) -> str:
    return _cached(plan, key, lambda: [make()])[0]


def statements(plan: Plan, with_delta: set[int]) -> list[str]:
    """Every maintenance statement for a batch that changed these occurrences."""
    a = plan.analysis
    assert a is not None
    if plan.root is not None:
        return rooted_statements(plan, tuple(sorted(with_delta)))
    if a.kind == "rows":
        key = tuple(sorted(with_delta))
        return ([changed_keys_fill(plan, i) for i in key] + [rows_count(plan, (i,)) for i in key]
                + [rows_upsert(plan, i, key) for i in key] + [rows_sweep(plan, i) for i in key])
    fold = fold_statements(plan) if plan.fold else []
    return [*fold, keys_fill(plan, tuple(sorted(with_delta))), keys_upsert(plan), keys_sweep(plan)]


def key_expressions(plan: Plan) -> list[str]:
    """The values of the storage key columns, as SQL over the query's FROM."""
    a = plan.analysis
    assert a is not None
    if plan.root is not None:
        o = a.occurrences[plan.root]
        return [f"{quote(o.alias)}.{quote(o.table.key[0])}"]
    if a.kind == "rows":
        return [f"{quote(o.alias)}.{quote(k)}" for o in a.occurrences for k in o.table.key]
    return list(a.keys)


def full_insert(plan: Plan) -> str:
    """Fills the (empty) storage with all of the view's rows."""
    storage = f"main.{quote(plan.storage)}"
    a = plan.analysis
    if plan.mode == "full" or a is None:
        return f"INSERT INTO {storage} SELECT * FROM ({plan.sql})"
    tail = ""
    if a.kind == "aggregate":
        tail = f" GROUP BY {', '.join(a.group_by)}" + (f" HAVING {a.having}" if a.having else "")
    distinct = "DISTINCT " if a.kind == "distinct" else ""
    state = "".join(f", {e}" for e in plan.fold.state_exprs()) if plan.fold else ""
    generation = "" if plan.root is not None else "0, "
    # A rooted view's rows name their rowids: an INSERT seeks each to check it is new,
    # REPLACE does not (~6 % of a full refresh; the storage is empty, root keys unique).
    verb = "INSERT OR REPLACE" if plan.root is not None else "INSERT"
    return (f"{verb} INTO {storage} SELECT {distinct}{', '.join(key_expressions(plan))}, {generation}{a.select}"
            f"{state} FROM {a.from_sql}" + (f" WHERE {a.where}" if a.where else "") + tail)


# the query's FROM and WHERE, rewritten -------------------------------------------------------

def _order(a: Analysis, start: list[int]) -> list[int]:
    """Tables in join order from start: each next one linked to those before by an equality."""
    order = list(start)
    n = len(a.occurrences)
    while len(order) < n:
        nxt = next((y for (x, _), (y, _) in a.equi + [(right, left) for left, right in a.equi]
                    if x in order and y not in order), None)
        if nxt is None:
            nxt = next(i for i in range(n) if i not in order)
        order.append(nxt)
    return order


def _from(a: Analysis, order: list[int], relations: dict[int, str], first: str | None = None,
          last: str | None = None) -> str:
    parts = [first] if first else []
    for i in order:
        o = a.occurrences[i]
        parts.append(f"{relations.get(i, 'main.' + quote(o.table.name))} AS {quote(o.alias)}")
    if last:
        parts.append(last)
    return " CROSS JOIN ".join(parts)


def _per_subset(a: Analysis, changes: dict[int, str], items: str) -> list[str]:
    """SELECT items of the query's FROM and WHERE, once per non-empty subset of the
    occurrences in `changes`, each of the subset read from its relation there."""
    return [f"SELECT {items} FROM {_from(a, _order(a, list(subset)), {i: changes[i] for i in subset})}"
            f"{_where(a, [])}"
            for size in range(1, len(changes) + 1) for subset in combinations(sorted(changes), size)]


def _where(a: Analysis, extra: list[str]) -> str:
    terms = [f"({c})" for c in a.conditions] + ([f"({a.where})"] if a.where else []) + extra
    return (" WHERE " + " AND ".join(terms)) if terms else ""


def _upsert_tail(plan: Plan) -> str:
    """Rows recomputed for a key that is still there are updated in place (indexes
    untouched) and stamped with this refresh's generation; see keys_sweep."""
    sets = ", ".join(f"{quote(c)} = excluded.{quote(c)}"
                     for c in [GEN_COLUMN] + [c for c, _ in plan.columns] + plan.state_columns)
    return f" ON CONFLICT ({', '.join(quote(c) for c in plan.key_columns)}) DO UPDATE SET {sets}"


# aggregate and DISTINCT views ----------------------------------------------------------------

def keys_fill(plan: Plan, with_delta: tuple[int, ...]) -> str:
    """The affected keys: those of every combination with at least one delta row."""
    def make() -> str:
        a = plan.analysis
        assert a is not None
        deltas = {i: f"temp.{quote(names.delta_table(a.occurrences[i].table.name))}" for i in with_delta}
        return f"INSERT INTO temp.{quote(plan.keys_table)} " + " UNION ".join(
            _per_subset(a, deltas, f"DISTINCT {', '.join(a.keys)}"))
    return _cached_one(plan, ("fill", with_delta), make)


def _keys_match(plan: Plan) -> str:
    match = " AND ".join(f"s.{quote(c)} IS k.c{j}" for j, c in enumerate(plan.key_columns))
    return (f"temp.{quote(plan.keys_table)} AS k CROSS JOIN main.{quote(plan.storage)} AS s WHERE {match}")


def keys_sweep(plan: Plan) -> str:
    """Rows of the keys that the recomputation did not give again: gone."""
    return (f"DELETE FROM main.{quote(plan.storage)} WHERE rowid IN (SELECT s.rowid FROM "
            f"{_keys_match(plan)} AND s.{GEN_COLUMN_Q} IS NOT :replicator_gen)")


def keys_upsert(plan: Plan) -> str:
    """The affected keys' rows, recomputed from the replica."""
    def make() -> str:
        a = plan.analysis
        assert a is not None
        keys = f"temp.{quote(plan.keys_table)} AS _replicator_k"
        match = [f"({e}) IS _replicator_k.c{j}" for j, e in enumerate(a.keys)]
        first = next((c for c in a.key_columns if c is not None), None)
        if first is not None:
            source = _from(a, _order(a, [first[0]]), {}, first=keys)
        else:   # no key is a plain column: one pass over the join, probing the keys
            source = _from(a, _order(a, [0]), {}, last=keys)
        # One key row matches exactly one group (keys are distinct under IS): grouping by
        # it is grouping by the key, and rows read key after key need no sorting.
        tail = " GROUP BY _replicator_k.rowid" + (f" HAVING {a.having}" if a.having else "")
        state = "".join(f", {e}" for e in plan.fold.state_exprs()) if plan.fold else ""
        return (f"INSERT INTO main.{quote(plan.storage)} SELECT {', '.join(a.keys)}, :replicator_gen, {a.select}"
                f"{state} FROM {source}{_where(a, match)}{tail}{_upsert_tail(plan)}")
    return _cached_one(plan, "upsert", make)


# folded aggregates ------------------------------------------------------------------------

def fold_statements(plan: Plan) -> list[str]:
    """[fill the fold table, update folded groups, insert new ones, delete emptied ones,
    list the groups to recompute]. See Fold and Refresher._incremental_groups."""
    return _cached(plan, "fold", lambda: _fold_statements(plan))


def _fold_statements(plan: Plan) -> list[str]:
    a, f = plan.analysis, plan.fold
    assert a is not None and f is not None
    o = a.occurrences[0]
    delta = f"temp.{quote(names.delta_table(o.table.name))} AS {quote(o.alias)}"
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
    group = f"SELECT {', '.join(inner)} FROM {delta}{_where(a, [])} GROUP BY {', '.join(a.keys)}"
    match = " AND ".join(f"s.{quote(c)} IS {d}.k{j}" for j, c in enumerate(plan.key_columns))
    # the group's new state, with the storage row's (none for a new group)
    mid = [f"{d}.k{j} AS k{j}" for j in range(nk)] + ["s.rowid AS srowid",
                                                      f"coalesce(s._replicator_n, 0) + {d}.dn AS n"]
    ok = ["1"]
    changed = ["s.rowid IS NULL", f"{d}.dn <> 0"]
    seek = plan.seek_column()
    base = f"main.{quote(o.table.name)} AS {quote(o.alias)}"
    group_rows = _where(a, [f"({e}) IS {d}.k{j}" for j, e in enumerate(a.keys)])
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
    for n, (fn, arg) in enumerate(f.outputs):
        outputs.append({"": f"i{n}", "count*": "n", "count": f"c{arg}", "sum": f"iif(c{arg} > 0, s{arg}, NULL)",
                        "total": f"CAST(s{arg} AS REAL)",
                        "avg": f"iif(c{arg} > 0, CAST(s{arg} AS REAL) / c{arg}, NULL)",
                        "min": f"min{arg}", "max": f"max{arg}"}[fn])
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
    return [fill, update, insert, delete, redo]


# row views stored by their root's rowid ---------------------------------------------------

def rooted_statements(plan: Plan, with_delta: tuple[int, ...]) -> list[str]:
    """[fill the affected rowids..., compute their rows, count those the storage has,
    write them, delete the rest].

    The affected rowids: the root table's changed keys, and the root rows of every
    combination that reads a changed row of another table (the subsets of those
    tables read from their deltas, old and new rows, the rest from the replica, as
    for the keys of an aggregate view)."""
    return _cached(plan, ("rooted", with_delta), lambda: _rooted_statements(plan, with_delta))


def _rooted_statements(plan: Plan, with_delta: tuple[int, ...]) -> list[str]:
    a = plan.analysis
    assert a is not None and plan.root is not None
    root = a.occurrences[plan.root]
    key = f"{quote(root.alias)}.{quote(root.table.key[0])}"
    affected = f"temp.{quote(plan.keys_table)}"
    stmts = []
    if plan.root in with_delta:
        stmts.append(f"INSERT OR IGNORE INTO {affected} SELECT {quote(root.table.key[0])} "
                     f"FROM temp.{quote(names.delta_table(root.table.name))}")
    others = [i for i in with_delta if i != plan.root]
    # A changed row of another table reaches the root rows its ON and WHERE columns
    # match: its old and new versions often agree on those (a customer renamed).
    changed = {i: f"(SELECT DISTINCT {', '.join(quote(c) for c in sorted(a.columns_filtered[i])) or '1'} "
                  f"FROM temp.{quote(names.delta_table(a.occurrences[i].table.name))})" for i in others}
    stmts += [f"INSERT OR IGNORE INTO {affected} {select}" for select in _per_subset(a, changed, key)]
    rows = f"temp.{quote(plan.rows_table)}"
    storage = f"main.{quote(plan.storage)}"
    source = _from(a, _order(a, [plan.root]), {}, first=f"{affected} AS _replicator_k")
    stmts.append(f"INSERT INTO {rows} SELECT _replicator_k.c0, {a.select} FROM {source}"
                 f"{_where(a, [f'{key} = _replicator_k.c0'])}")
    stmts.append(f"SELECT count(*) FROM {rows} AS r CROSS JOIN {storage} AS s WHERE s.rowid = r.r")
    columns = [quote(c) for c, _ in plan.columns]
    stmts.append(f"INSERT INTO {storage} SELECT r, {', '.join(f'v{i}' for i in range(len(columns)))} "
                 f"FROM {rows} WHERE true ON CONFLICT ({quote(ROW_COLUMN)}) DO UPDATE SET "
                 + ", ".join(f"{c} = excluded.{c}" for c in columns))
    stmts.append(f"DELETE FROM {storage} WHERE rowid IN (SELECT c0 FROM {affected} "
                 f"WHERE c0 NOT IN (SELECT r FROM {rows}))")
    return stmts


# row views --------------------------------------------------------------------------------

def changed_keys_fill(plan: Plan, i: int) -> str:
    """Occurrence i's table's changed keys."""
    assert plan.analysis is not None
    table = plan.analysis.occurrences[i].table
    return (f"INSERT INTO temp.{quote(names.changed_keys_table(table.name))} SELECT DISTINCT "
            f"{', '.join(quote(k) for k in table.key)} FROM temp.{quote(names.delta_table(table.name))}")


def _rows_match(plan: Plan, i: int) -> str:
    assert plan.analysis is not None
    table = plan.analysis.occurrences[i].table
    match = " AND ".join(f"s.{quote(c)} IS k.c{j}" for j, c in enumerate(plan.occurrence_key_columns(i)))
    return (f"temp.{quote(names.changed_keys_table(table.name))} AS k CROSS JOIN main.{quote(plan.storage)} AS s "
            f"WHERE {match}")


def rows_count(plan: Plan, with_delta: tuple[int, ...]) -> str:
    """Rows of the view that hold a changed base row."""
    if len(with_delta) == 1:
        return f"SELECT count(*) FROM {_rows_match(plan, with_delta[0])}"
    return ("SELECT count(*) FROM (" + " UNION ".join(f"SELECT s.rowid FROM {_rows_match(plan, i)}"
                                                      for i in with_delta) + ")")


def rows_sweep(plan: Plan, i: int) -> str:
    """Rows naming a changed key of occurrence i that the upserts did not give again: gone."""
    return (f"DELETE FROM main.{quote(plan.storage)} WHERE rowid IN (SELECT s.rowid FROM "
            f"{_rows_match(plan, i)} AND s.{GEN_COLUMN_Q} IS NOT :replicator_gen)")


def rows_upsert(plan: Plan, i: int, with_delta: tuple[int, ...]) -> str:
    """The combinations that hold a changed row of occurrence i (and none of an
    occurrence before it: each combination once)."""
    def make() -> str:
        a = plan.analysis
        assert a is not None
        o = a.occurrences[i]
        keys = f"temp.{quote(names.changed_keys_table(o.table.name))} AS _replicator_k"
        extra = [f"{quote(o.alias)}.{quote(k)} IS _replicator_k.c{j}" for j, k in enumerate(o.table.key)]
        for j in with_delta:
            if j >= i:
                continue
            other = a.occurrences[j]
            same = " AND ".join(f"_replicator_x.c{n} IS {quote(other.alias)}.{quote(k)}"
                                for n, k in enumerate(other.table.key))
            extra.append(f"NOT EXISTS (SELECT 1 FROM temp.{quote(names.changed_keys_table(other.table.name))}"
                         f" AS _replicator_x WHERE {same})")
        return (f"INSERT INTO main.{quote(plan.storage)} SELECT {', '.join(key_expressions(plan))}, :replicator_gen, "
                f"{a.select} FROM {_from(a, _order(a, [i]), {}, first=keys)}{_where(a, extra)}{_upsert_tail(plan)}")
    return _cached_one(plan, ("upsert", i, with_delta), make)
