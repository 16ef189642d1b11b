"""How a view of a Delta warehouse is computed by Spark and maintained.

The analysis (replicator.views.analysis) reads a view's query; ViewPlan turns it
into the Spark SQL a refresh runs: the whole query (a full refresh), the query
restricted to some keys (an incremental one), the keys a change affects. A
view's record (its entry: a dict the warehouse stores with the view) keeps the
plan, its state and its last refreshes; the policy ``auto`` reads those to
choose between an incremental and a full refresh. Used by the Delta
warehouse's views (replicator.targets.delta.views).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from replicator.errors import UserError
from replicator.targets.delta.spark_sql import quote_spark, spark_error_line
from replicator.views.analysis import Analysis, Reason, TableInfo, analyse

AUTO_FULL_SHARE = 0.2          # auto: a change touching more of the view is refreshed in full
AUTO_RETRY_AFTER = 50          # auto: full refreshes chosen on cost before an incremental one is tried again


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def view_keys(analysis: Analysis) -> tuple[list[str], list[str]]:
    """An incremental view's key expressions and the storage columns that hold them."""
    if analysis.kind == "rows":
        return ([f"{quote_spark(o.alias)}.{quote_spark(k)}" for o in analysis.occurrences for k in o.table.key],
                [f"_replicator_k{i}_{j}" for i, o in enumerate(analysis.occurrences) for j in range(len(o.table.key))])
    return list(analysis.keys), [f"_replicator_k{j}" for j in range(len(analysis.keys))]


@dataclass
class ViewPlan:
    """How a view is computed and maintained, from its definition and the tables as they are."""
    name: str
    sql: str
    policy: str
    mode: str                       # incremental | full
    reason: Reason | None           # why full, when it is
    analysis: Analysis
    columns: list[str]              # the query's columns
    deps: list[str]                 # source names of the tables it reads
    key_exprs: list[str]
    key_columns: list[str]          # storage key columns

    def select(self, relations: dict[int, str] | None = None, semi: tuple[str, str] | None = None,
               any_of: list[tuple[str, str]] | None = None) -> str:
        """The query giving the storage rows (key columns, then the query's columns):
        relations replaces tables by other relations; semi = (relation, condition)
        keeps the combinations matching it (its columns are _replicator_x.c0...),
        any_of = [(relation, condition), ...] those matching any of them (each
        condition naming its relation _replicator_x too). The relations are small
        key sets: broadcast, so the tables' side is filtered where it is scanned
        rather than shuffled to meet them."""
        a = self.analysis
        if self.mode != "incremental":
            return self.sql
        relations = relations or {}
        parts = [f"{relations.get(i, quote_spark(o.table.name))} AS {quote_spark(o.alias)}"
                 for i, o in enumerate(a.occurrences)]
        source = " CROSS JOIN ".join(parts)
        hint = ""
        if semi is not None:
            source += f" LEFT SEMI JOIN {semi[0]} AS _replicator_x ON {semi[1]}"
            hint = "/*+ BROADCAST(_replicator_x) */ "
        terms = [f"({c})" for c in a.conditions] + ([f"({a.where})"] if a.where else [])
        if any_of:
            # Spark turns EXISTS under OR into existence joins (broadcast hash joins on
            # small sides): one scan of the tables for all the key sets, no union of
            # per-set queries to de-duplicate.
            terms.append("(" + " OR ".join(f"EXISTS (SELECT 1 FROM {r} AS _replicator_x WHERE {c})"
                                           for r, c in any_of) + ")")
        where = (" WHERE " + " AND ".join(terms)) if terms else ""
        keys = ", ".join(f"{e} AS {k}" for e, k in zip(self.key_exprs, self.key_columns))
        distinct = "DISTINCT " if a.kind == "distinct" else ""
        tail = ""
        if a.kind == "aggregate":
            tail = f" GROUP BY {', '.join(a.group_by)}" + (f" HAVING {a.having}" if a.having else "")
        return f"SELECT {hint}{distinct}{keys}, {a.select} FROM {source}{where}{tail}"

    def affected_keys(self, subset: tuple[int, ...], delta: dict[int, str]) -> str:
        """Key values of the combinations whose occurrences in subset are read from their delta."""
        a = self.analysis
        parts = [f"{delta[i] if i in subset else quote_spark(o.table.name)} AS {quote_spark(o.alias)}"
                 for i, o in enumerate(a.occurrences)]
        terms = [f"({c})" for c in a.conditions] + ([f"({a.where})"] if a.where else [])
        where = (" WHERE " + " AND ".join(terms)) if terms else ""
        keys = ", ".join(f"{e} AS c{j}" for j, e in enumerate(self.key_exprs))
        return f"SELECT DISTINCT {keys} FROM {' CROSS JOIN '.join(parts)}{where}"

    def occurrence_keys(self, i: int) -> list[str]:
        before = sum(len(o.table.key) for o in self.analysis.occurrences[:i])
        return self.key_columns[before:before + len(self.analysis.occurrences[i].table.key)]

    def key_homes(self) -> list[int | None]:
        """Per storage key, the query's column that is it (its index), so that a store need
        not keep the key twice; None where no column is (a row view's base key left out of
        the select list, a GROUP BY expression not selected)."""
        a = self.analysis
        if self.mode != "incremental" or len(a.items) != len(self.columns):
            return [None] * len(self.key_columns)
        if a.kind == "rows":
            homes = [next((n for n, c in enumerate(a.item_columns)
                           if c is not None and c[0] == i and c[1].lower() == k.lower()), None)
                     for i, o in enumerate(a.occurrences) for k in o.table.key]
        else:
            homes = list(a.key_items)
        seen: set[int] = set()
        out: list[int | None] = []
        for home in homes:   # a column two keys are (GROUP BY a, a) holds the first
            out.append(None if home is None or home in seen else home)
            if home is not None:
                seen.add(home)
        return out

    def describe(self) -> dict[str, Any]:
        a = self.analysis
        return {"policy": self.policy, "maintenance": self.mode, "kind": a.kind,
                "keys": a.describe_keys() if self.mode == "incremental" else None,
                "tables": sorted(self.deps), "reason": self.reason.as_dict() if self.reason else None,
                "reasons": [r.as_dict() for r in a.reasons], "notes": a.notes, "indexes": []}


def plan_view(spark: Any, name: str, sql: str, policy: str, catalog: Callable[[str], TableInfo | None],
              names: dict[str, str], prepare: Callable[[str], None]) -> ViewPlan:
    """Analyses a definition against the warehouse's tables: catalog describes a table
    by name, names maps the tables' names (lower case) to their source names, and
    prepare(sql) checks the query (check_query) and registers the tables as Spark
    sees them. Raises UserError when the SQL does not run on them."""
    analysis = analyse(sql, catalog, quote_spark, "spark")
    sql = analysis.sql
    prepare(sql)
    try:
        frame = spark.sql(sql)
        analyzed = frame._jdf.queryExecution().analyzed().toString()
    except Exception as exc:   # AnalysisException, ParseException
        raise UserError(f"the view's SQL does not run on the warehouse: {spark_error_line(exc)}") from None
    columns = list(frame.columns)
    duplicated = sorted({c for c in columns if [x.lower() for x in columns].count(c.lower()) > 1})
    if duplicated:
        raise UserError(f"the view's columns must have distinct names: alias {', '.join(duplicated)}")
    if "Aggregate [" in analyzed and analysis.kind != "aggregate":
        analysis.refuse("NO_KEY", "(aggregate function)", "an aggregate the analysis does not know")
    read = {alias.strip("`").split(".")[-1].lower() for alias in re.findall(r"SubqueryAlias (\S+)", analyzed)}
    deps = sorted({names[n] for n in read if n in names}
                  | {names[o.table.name.lower()] for o in analysis.occurrences if o.table.name.lower() in names})
    reason = analysis.reasons[0] if analysis.reasons else None
    mode = "incremental" if reason is None else "full"
    if policy == "full":
        mode, reason = "full", Reason("POLICY_FULL", "--policy full")
    key_exprs, key_columns = view_keys(analysis) if mode == "incremental" else ([], [])
    plan = ViewPlan(name=name, sql=sql, policy=policy, mode=mode, reason=reason, analysis=analysis,
                    columns=columns, deps=deps, key_exprs=key_exprs, key_columns=key_columns)
    if mode == "incremental":
        try:
            rewritten = spark.sql(plan.select())
            if len(rewritten.columns) != len(key_columns) + len(columns):
                raise ValueError(f"it gives {len(rewritten.columns) - len(key_columns)} columns, "
                                 f"the query {len(columns)}")
        except Exception as exc:
            plan.mode, plan.reason = "full", Reason("REWRITE", "", spark_error_line(exc))
            plan.key_exprs, plan.key_columns = [], []
    return plan


def stored_plan(name: str, entry: dict[str, Any], catalog: Callable[[str], TableInfo | None],
                check: Callable[[str], object]) -> ViewPlan:
    """The plan of a view whose tables kept their structure, from its entry (no Spark job):
    check(sql) is check_query's guard (a view stored by an older replicator is read again)."""
    analysis = analyse(entry["sql"], catalog, quote_spark, "spark")
    check(analysis.sql)
    reason = Reason(entry["reason"]["code"], entry["reason"]["fragment"]) if entry["reason"] else None
    # the key expressions as the query (read now, without comments) has them
    key_exprs = view_keys(analysis)[0] if entry["maintenance"] == "incremental" else []
    if len(key_exprs) != len(entry["key_columns"]):
        raise UserError(f"view {name}'s query no longer gives its {len(entry['key_columns'])} keys: "
                        f"refresh it in full (`replicator view refresh {name} --full`)")
    return ViewPlan(name=name, sql=analysis.sql, policy=entry["policy"], mode=entry["maintenance"],
                    reason=reason, analysis=analysis, columns=list(entry["columns"]), deps=list(entry["deps"]),
                    key_exprs=key_exprs, key_columns=list(entry["key_columns"]))


def apply_plan(entry: dict[str, Any], plan: ViewPlan) -> None:
    """Records a plan in the view's entry."""
    entry.update({"maintenance": plan.mode, "reason": plan.reason.as_dict() if plan.reason else None,
                  "kind": plan.analysis.kind, "columns": plan.columns, "deps": plan.deps,
                  "key_exprs": plan.key_exprs, "key_columns": plan.key_columns})


def record_refresh(entry: dict[str, Any], kind: str, reason: str, seconds: float, *, keys: int | None,
                   deleted: int, inserted: int, updated: int, keep: int) -> dict[str, Any]:
    """Appends a refresh record to the view's entry and returns it; keeps the last `keep`,
    and the latest full one."""
    entry["seq"] += 1
    record = {"seq": entry["seq"], "at": now(), "kind": kind, "reason": reason, "keys": keys,
              "rows_deleted": deleted, "rows_inserted": inserted, "rows_updated": updated,
              "seconds": round(seconds, 6)}
    entry["refreshes"].append(record)
    kept = entry["refreshes"][-keep:]
    if not any(r["kind"] == "full" for r in kept):
        # auto weighs incremental refreshes against the latest full one, however old
        kept[:0] = [r for r in entry["refreshes"] if r["kind"] == "full"][-1:]
    entry["refreshes"] = kept
    return record


def cost_says_full(entry: dict[str, Any], plan: ViewPlan) -> str | None:
    """auto: why a full refresh is expected to be cheaper, from the view's refresh
    history (Spark's fixed cost per job makes a small view's full refresh the
    cheaper one); an incremental one is tried again now and then."""
    if plan.policy != "auto":
        return None
    history = entry["refreshes"]
    full = next((r["seconds"] for r in reversed(history) if r["kind"] == "full"), None)
    incremental = [r["seconds"] for r in reversed(history) if r["kind"] == "incremental"][:5]
    if full is None or len(incremental) < 2:
        return None
    since = 0
    for r in reversed(history):
        if not (r["reason"] or "").startswith("COST"):
            break
        since += 1
    median = sorted(incremental)[len(incremental) // 2]
    if median > full and since < AUTO_RETRY_AFTER:
        return f"COST: incremental refreshes take about {median * 1000:.0f} ms, a full one {full * 1000:.0f} ms"
    return None


def too_large(plan: ViewPlan, keys: int, rows: int) -> bool:
    """auto: whether a change of `keys` keys touches too much of a view of `rows` rows for
    an incremental refresh to pay."""
    return plan.policy == "auto" and keys > AUTO_FULL_SHARE * max(rows, 1)
