"""Incremental views of a Spark warehouse.

A view is a query in Spark SQL over the warehouse's tables, named as the
SQLite target names them (``public.t`` → ``t``, ``s.t`` → ``s__t``). Its
rows are stored like a table's, a base plus change log files merged on read
by the view's keys, under ``PATH/_views/``; the manifest names them and holds
the definition and the refresh history. The consumer refreshes the views a
batch touched in the batch's commit, holding the manifest lock: one manifest
names the batch's table changes, the views' new files and the position.

The analysis is the SQLite target's (replicator.views), and so is the
strategy (replicator/targets/sqlite_views.py), with the old rows read from
the state before the batch instead of captured by triggers:

- aggregate and DISTINCT views: the affected keys are the key values of every
  combination of rows with at least one changed row, the query's FROM/WHERE
  evaluated once per non-empty subset of its changed tables, those read from
  their delta (the old and new rows of the changed keys). The defining query
  restricted to those keys (a null-safe semi-join, which Spark pushes below
  the aggregate) gives their new rows; keys it no longer gives are deleted.
- row views (filter/projection, inner joins): a view row is named by the keys
  of the base rows it combines; the combinations holding a changed base row
  are recomputed, the view rows naming a changed key and not given again are
  deleted.

A full refresh writes a new base. Policy ``auto`` refreshes in full when the
change touches more than AUTO_FULL_SHARE of the view. A view whose tables are
replaced (TRUNCATE, copied again) is refreshed in full; one whose tables
change structure is analysed again, and marked stale with the reason when
its query no longer runs or gives other columns.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import reduce
from itertools import combinations
from typing import Any

import pyarrow.parquet as pq

from ..errors import UserError
from ..schema import TableStructure, target_table_name
from ..views import Analysis, Reason, TableInfo, analyse, check_name, check_policy
from .reader import entry_frame, logged_rows, merge_on_read, read_parquet
from .warehouse import DELETED, SEQ, Warehouse, make_durable, new_id, retire

log = logging.getLogger("replicator")

VIEWS_DIR = "_views"
AUTO_FULL_SHARE = 0.2          # auto: a change touching more of the view is refreshed in full
AUTO_RETRY_AFTER = 50          # auto: full refreshes chosen on cost before an incremental one is tried again
REWRITE_AFTER_LOGS = 16        # a view's log files folded into a new base past this many
KEEP_REFRESHES = 100           # refresh records kept per view


def quote_spark(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "desc", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def view_frame(spark: Any, warehouse: Warehouse, entry: dict[str, Any]) -> Any:
    """A view's rows (its query's columns, by their names) from a manifest entry."""
    from pyspark.sql import functions as F

    merged = _storage_frame(spark, warehouse, entry)
    return merged.select(*[F.col(p).alias(c) for p, c in zip(_value_names(entry), entry["columns"])])


def _value_names(entry: dict[str, Any]) -> list[str]:
    return [f"_replicator_v{j}" for j in range(len(entry["columns"]))]


def _storage_schema(entry: dict[str, Any], *, log: bool = False) -> Any:
    from pyspark.sql import types as T
    schema = T.StructType.fromJson(entry["schema"])
    if log:
        schema = T.StructType([*schema.fields, T.StructField(SEQ, T.LongType(), True),
                               T.StructField(DELETED, T.BooleanType(), True)])
    return schema


def _storage_frame(spark: Any, warehouse: Warehouse, entry: dict[str, Any]) -> Any:
    base = read_parquet(spark, [str(warehouse.file(f)) for f in entry["base"]], _storage_schema(entry))
    if not entry["key_columns"]:
        return base
    return merge_on_read(spark, base, [str(warehouse.file(log["file"])) for log in entry["logs"]],
                         _storage_schema(entry, log=True), entry["key_columns"])


def _null_safe(left: Any, right: Any, pairs: list[tuple[str, str]]) -> Any:
    return reduce(lambda a, b: a & b, [left[x].eqNullSafe(right[y]) for x, y in pairs])


def _parquet_rows(directory: Any) -> int:
    return sum(pq.ParquetFile(f).metadata.num_rows for f in directory.glob("*.parquet"))


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

    def select(self, relations: dict[int, str] | None = None, semi: tuple[str, str] | None = None) -> str:
        """The query giving the storage rows (key columns, then the query's columns):
        relations replaces tables by other relations; semi = (relation, condition)
        keeps the combinations matching it (its columns are _replicator_x.c0...)."""
        a = self.analysis
        if self.mode != "incremental":
            return self.sql
        relations = relations or {}
        parts = [f"{relations.get(i, quote_spark(o.table.name))} AS {quote_spark(o.alias)}"
                 for i, o in enumerate(a.occurrences)]
        source = " CROSS JOIN ".join(parts)
        if semi is not None:
            source += f" LEFT SEMI JOIN {semi[0]} AS _replicator_x ON {semi[1]}"
        terms = [f"({c})" for c in a.conditions] + ([f"({a.where})"] if a.where else [])
        where = (" WHERE " + " AND ".join(terms)) if terms else ""
        keys = ", ".join(f"{e} AS {k}" for e, k in zip(self.key_exprs, self.key_columns))
        distinct = "DISTINCT " if a.kind == "distinct" else ""
        tail = ""
        if a.kind == "aggregate":
            tail = f" GROUP BY {', '.join(a.group_by)}" + (f" HAVING {a.having}" if a.having else "")
        return f"SELECT {distinct}{keys}, {a.select} FROM {source}{where}{tail}"

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

    def describe(self) -> dict[str, Any]:
        a = self.analysis
        return {"policy": self.policy, "maintenance": self.mode, "kind": a.kind,
                "keys": a.describe_keys() if self.mode == "incremental" else None,
                "tables": sorted(self.deps), "reason": self.reason.as_dict() if self.reason else None,
                "reasons": [r.as_dict() for r in a.reasons], "notes": a.notes, "indexes": []}


class _Changes:
    """A transaction's changes to the warehouse's tables as Spark sees them, computed
    once for all the views that read them: each changed table's keys and delta (the
    old rows of those keys, from the table before, and their new rows, from the
    transaction's log files: one scan of the table)."""

    def __init__(self, session: Callable[[], Any], warehouse: Warehouse, before: dict[str, Any],
                 after: dict[str, Any], logs: dict[str, list[str]]) -> None:
        self._session, self.warehouse, self.before, self.after, self.logs = session, warehouse, before, after, logs
        self._keys: dict[str, tuple[Any, int]] = {}
        self._delta: dict[str, str] = {}
        self._cached: list[Any] = []

    @property
    def spark(self) -> Any:
        return self._session()

    def _structure(self, source_name: str) -> TableStructure:
        return TableStructure.from_json(self.after["tables"][source_name]["structure"])

    def keys(self, source_name: str) -> tuple[Any, int]:
        """The table's changed keys (columns c0...) and how many there are."""
        if source_name not in self._keys:
            from pyspark.sql import functions as F
            physical = [f"c{c.attnum}" if c.attnum else "n_" + c.name
                        for c in self._structure(source_name).key_columns()]
            files = [str(self.warehouse.file(f)) for f in self.logs[source_name]]
            keys = self.spark.read.parquet(*files).select(
                *[F.col(p).alias(f"c{j}") for j, p in enumerate(physical)]).distinct().cache()
            self._cached.append(keys)
            self._keys[source_name] = (keys, keys.count())
        return self._keys[source_name]

    def delta(self, source_name: str) -> str:
        """A temporary view of the old and new rows of the table's changed keys."""
        if source_name not in self._delta:
            keys, _ = self.keys(source_name)
            pairs = [(k, f"c{j}") for j, k in enumerate(self._structure(source_name).key)]
            old = entry_frame(self.spark, self.warehouse, self.before["tables"][source_name])
            new = logged_rows(self.spark, self.warehouse, self.after["tables"][source_name], self.logs[source_name])
            rows = old.join(keys, _null_safe(old, keys, pairs), "left_semi").unionByName(new).cache()
            self._cached.append(rows)
            name = f"_replicator_delta_{len(self._delta)}"
            rows.createOrReplaceTempView(name)
            self._delta[source_name] = name
        return self._delta[source_name]

    def release(self) -> None:
        for frame in self._cached:
            frame.unpersist()


class SparkViews:
    """The views of one Spark warehouse: definitions, refresh, the `view` commands."""

    def __init__(self, warehouse: Warehouse, session: Callable[[], Any]) -> None:
        self.warehouse = warehouse
        self._session = session
        self._spark: Any = None

    @property
    def spark(self) -> Any:
        if self._spark is None:
            self._spark = self._session()
        return self._spark

    # the tables as a manifest has them --------------------------------------------------

    @staticmethod
    def _table_names(manifest: dict[str, Any]) -> dict[str, str]:
        """Target name (lower case) → source name."""
        out = {}
        for source_name, entry in manifest["tables"].items():
            s = TableStructure.from_json(entry["structure"])
            out[target_table_name(s.schema, s.name).lower()] = source_name
        return out

    def _catalog(self, manifest: dict[str, Any]) -> Callable[[str], TableInfo | None]:
        names = self._table_names(manifest)

        def lookup(name: str) -> TableInfo | None:
            source_name = names.get(name.lower())
            if source_name is None:
                return None
            s = TableStructure.from_json(manifest["tables"][source_name]["structure"])
            return TableInfo(name=target_table_name(s.schema, s.name), columns=[(c.name, c.type) for c in s.columns],
                             key=list(s.key), replicated=True)
        return lookup

    def _register_tables(self, manifest: dict[str, Any]) -> None:
        for entry in manifest["tables"].values():
            s = TableStructure.from_json(entry["structure"])
            entry_frame(self.spark, self.warehouse, entry).createOrReplaceTempView(
                target_table_name(s.schema, s.name))

    # planning ------------------------------------------------------------------------------

    def plan(self, manifest: dict[str, Any], name: str, sql: str, policy: str) -> ViewPlan:
        """Analyses a definition against the warehouse as the manifest has it (its
        tables registered as temporary views). Raises UserError when the SQL does not
        run on it."""
        analysis = analyse(sql, self._catalog(manifest), quote_spark, "spark")
        sql = analysis.sql
        self._register_tables(manifest)
        try:
            frame = self.spark.sql(sql)
            analyzed = frame._jdf.queryExecution().analyzed().toString()
        except Exception as exc:   # AnalysisException, ParseException
            raise UserError(f"the view's SQL does not run on the warehouse: {_first_line(exc)}") from None
        columns = list(frame.columns)
        duplicated = sorted({c for c in columns if [x.lower() for x in columns].count(c.lower()) > 1})
        if duplicated:
            raise UserError(f"the view's columns must have distinct names: alias {', '.join(duplicated)}")
        if "Aggregate [" in analyzed and analysis.kind != "aggregate":
            analysis.refuse("NO_KEY", "(aggregate function)", "an aggregate the analysis does not know")
        names = self._table_names(manifest)
        read = {alias.strip("`").split(".")[-1].lower() for alias in re.findall(r"SubqueryAlias (\S+)", analyzed)}
        deps = sorted({names[n] for n in read if n in names} | {names[o.table.name.lower()] for o in analysis.occurrences
                                                   if o.table.name.lower() in names})
        reason = analysis.reasons[0] if analysis.reasons else None
        mode = "incremental" if reason is None else "full"
        if policy == "full":
            mode, reason = "full", Reason("POLICY_FULL", "--policy full")
        if mode == "incremental":
            if analysis.kind == "rows":
                key_exprs = [f"{quote_spark(o.alias)}.{quote_spark(k)}" for o in analysis.occurrences
                             for k in o.table.key]
                key_columns = [f"_replicator_k{i}_{j}" for i, o in enumerate(analysis.occurrences)
                               for j in range(len(o.table.key))]
            else:
                key_exprs = list(analysis.keys)
                key_columns = [f"_replicator_k{j}" for j in range(len(key_exprs))]
        else:
            key_exprs, key_columns = [], []
        plan = ViewPlan(name=name, sql=sql, policy=policy, mode=mode, reason=reason, analysis=analysis,
                        columns=columns, deps=deps, key_exprs=key_exprs, key_columns=key_columns)
        if mode == "incremental":
            try:
                rewritten = self.spark.sql(plan.select())
                if len(rewritten.columns) != len(key_columns) + len(columns):
                    raise ValueError(f"it gives {len(rewritten.columns) - len(key_columns)} columns, "
                                     f"the query {len(columns)}")
            except Exception as exc:
                plan.mode, plan.reason = "full", Reason("REWRITE", "", _first_line(exc))
                plan.key_exprs, plan.key_columns = [], []
        return plan

    def _plan_of(self, manifest: dict[str, Any], name: str) -> ViewPlan:
        entry = manifest["views"][name]
        return self.plan(manifest, name, entry["sql"], entry["policy"])

    # the view commands -----------------------------------------------------------------

    @contextmanager
    def _committing(self) -> Iterator[dict[str, Any]]:
        """The latest manifest, under the lock, written back if the block succeeds."""
        with self.warehouse.lock():
            manifest = self.warehouse.read()
            manifest.setdefault("views", {})
            yield manifest
            self.warehouse.collect_garbage(manifest)
            self.warehouse.write(manifest)

    def _find(self, manifest: dict[str, Any], name: str) -> str:
        found = next((n for n in manifest.get("views", {}) if n.lower() == name.lower()), None)
        if found is None:
            raise UserError(f"no view {name!r} in the warehouse {self.warehouse.path} (see `replicator view list`)")
        return found

    def create(self, name: str, sql: str, policy: str = "auto") -> dict[str, Any]:
        check_name(name)
        check_policy(policy)
        if not self.warehouse.exists():
            raise UserError(f"{self.warehouse.path} is not a replicator Spark warehouse yet: views are defined "
                            f"over the tables `replicator consume` replicates into it")
        with self._committing() as manifest:
            if any(n.lower() == name.lower() for n in manifest["views"]):
                raise UserError(f"view {name!r} exists: drop it first (`replicator view drop {name}`)")
            if name.lower() in self._table_names(manifest):
                raise UserError(f"the warehouse already has a table named {name!r}")
            plan = self.plan(manifest, name, sql, policy)
            if policy == "incremental" and plan.mode != "incremental":
                assert plan.reason is not None
                raise UserError(f"view {name} cannot be maintained incrementally: {plan.reason.code}: "
                                f"{plan.reason.message} (at: {plan.reason.fragment}); "
                                f"use --policy auto to refresh it in full")
            entry = {"sql": plan.sql, "policy": policy, "created_at": _now(), "dir": f"{VIEWS_DIR}/{name}-{new_id()}",
                     "generation": "", "base": [], "logs": [], "rows": 0, "seq": 0, "refreshes": [],
                     "status": "ok", "status_reason": None}
            self._apply_plan(entry, plan)
            manifest["views"][name] = entry
            try:
                self._full(manifest, name, plan, "CREATE")
            except Exception as exc:   # the query analyses but fails on the rows (ANSI overflow, raise_error...)
                shutil.rmtree(self.warehouse.file(entry["dir"]), ignore_errors=True)   # what it wrote, named nowhere
                raise UserError(f"view {name} not created: its query fails on the warehouse: "
                                f"{_first_line(exc)}") from None
        return self.info(name)

    def drop(self, name: str) -> None:
        with self._committing() as manifest:
            entry = manifest["views"].pop(self._find(manifest, name))
            retire(manifest, [entry["dir"]])

    def refresh_now(self, name: str, *, full: bool = False) -> tuple[dict[str, Any], bool]:
        """Recomputes a view that needs it (stale, or maintained in full), or any
        view with full. Returns its state and whether it was recomputed."""
        with self._committing() as manifest:
            real = self._find(manifest, name)
            entry = manifest["views"][real]
            recompute = full or entry["status"] != "ok" or entry["maintenance"] == "full"
            if recompute:
                plan = self._plan_of(manifest, real)
                if plan.columns != entry["columns"] and entry["status"] == "ok":
                    raise UserError(f"view {real} now gives other columns: drop it and create it again")
                self._apply_plan(entry, plan)
                entry["status"], entry["status_reason"] = "ok", None
                self._full(manifest, real, plan, "MANUAL")
        return self.info(real), recompute

    def info(self, name: str) -> dict[str, Any]:
        manifest = self.warehouse.read()
        real = self._find(manifest, name)
        return next(v for v in self.list() if v["view"] == real)

    def list(self) -> list[dict[str, Any]]:
        out = []
        for name, entry in sorted(self.warehouse.read().get("views", {}).items()):
            reason = entry["reason"]
            last = entry["refreshes"][-1] if entry["refreshes"] else None
            out.append({"view": name, "policy": entry["policy"], "maintenance": entry["maintenance"],
                        "status": entry["status"], "status_reason": entry["status_reason"], "rows": entry["rows"],
                        "reason": reason["code"] if reason else None,
                        "reason_message": reason["message"] if reason else None,
                        "fragment": reason["fragment"] if reason else None,
                        "last_refresh": dict(last) if last else None, "sql": entry["sql"]})
        return out

    def refreshes(self, name: str, limit: int = 20) -> list[dict[str, Any]]:
        manifest = self.warehouse.read()
        entry = manifest["views"][self._find(manifest, name)]
        return list(reversed(entry["refreshes"][-limit:]))

    def explain(self, sql: str, policy: str = "auto") -> dict[str, Any]:
        """What create would do with this SQL, without doing it."""
        check_policy(policy)
        plan = self.plan(self.warehouse.read(), "explain", sql, policy)
        out = plan.describe()
        out["statements"] = {"full": plan.select()}
        if plan.mode == "incremental":
            out["statements"]["incremental"] = [plan.select(semi=("<keys>", "..."))]
        if policy == "incremental" and plan.mode != "incremental":
            out["maintenance"] = "refused"
        return out

    # refresh after a batch ---------------------------------------------------------------

    def refresh_after(self, before: dict[str, Any], after: dict[str, Any], ops: list[tuple[Any, ...]]) -> None:
        """Refreshes, in manifest `after` (before's tables with a transaction's
        operations replayed), every view that transaction changed. A view whose
        refresh fails is marked stale with the reason; the batch goes on."""
        views = after.get("views", {})
        if not views:
            return
        logs: dict[str, list[str]] = {}
        replaced: dict[str, str] = {}
        for op in ops:
            if op[0] == "logs":
                logs.setdefault(op[1], []).extend(e["file"] for e in op[2])
            elif op[0] == "generation":
                replaced[op[1]] = "TABLE_REPLACED"
            elif op[0] in ("rename", "drop"):
                replaced[op[1]] = "SCHEMA_CHANGE"
            elif op[0] == "meta" and op[1] in before["tables"] and op[1] in after["tables"] and (
                    before["tables"][op[1]]["structure"] != after["tables"][op[1]]["structure"]):
                replaced[op[1]] = "SCHEMA_CHANGE"
        if not logs and not replaced:
            return
        changes = _Changes(lambda: self.spark, self.warehouse, before, after, logs)
        try:
            self._refresh_changed(after, views, logs, replaced, changes)
        finally:
            changes.release()

    def _refresh_changed(self, after: dict[str, Any], views: dict[str, Any], logs: dict[str, list[str]],
                         replaced: dict[str, str], changes: _Changes) -> None:
        registered = False
        for name in list(views):
            entry = views[name]
            deps = set(entry["deps"])
            if entry["status"] != "ok" or not deps & (set(logs) | set(replaced)):
                continue
            if not registered:
                self._register_tables(after)
                registered = True
            started = time.perf_counter()
            try:
                why = next((replaced[d] for d in sorted(deps) if d in replaced), None)
                if why == "SCHEMA_CHANGE":
                    plan = self._revalidate(after, name)
                    if plan is None:
                        continue
                else:
                    plan = self._stored_plan(after, name)
                if why is None and plan.mode == "incremental":
                    self._incremental(after, name, plan, changes, started)
                else:
                    self._full(after, name, plan, why or (entry["reason"] or {}).get("code") or "FULL")
            except Exception as exc:   # Spark failed on it: the others and the batch go on
                log.warning("view %s: refresh failed, the view is stale: %s", name, _first_line(exc))
                entry["status"], entry["status_reason"] = "stale", f"REFRESH_FAILED: {_first_line(exc)}"

    def _stored_plan(self, manifest: dict[str, Any], name: str) -> ViewPlan:
        """The plan of a view whose tables kept their structure (no Spark job)."""
        entry = manifest["views"][name]
        analysis = analyse(entry["sql"], self._catalog(manifest), quote_spark, "spark")
        reason = Reason(entry["reason"]["code"], entry["reason"]["fragment"]) if entry["reason"] else None
        return ViewPlan(name=name, sql=entry["sql"], policy=entry["policy"], mode=entry["maintenance"],
                        reason=reason, analysis=analysis, columns=list(entry["columns"]), deps=list(entry["deps"]),
                        key_exprs=list(entry["key_exprs"]), key_columns=list(entry["key_columns"]))

    def _revalidate(self, manifest: dict[str, Any], name: str) -> ViewPlan | None:
        """After a schema change of its tables: the view's plan now, or None when it
        must be rebuilt (marked stale, with why)."""
        entry = manifest["views"][name]
        try:
            plan = self._plan_of(manifest, name)
        except UserError as exc:
            entry["status"], entry["status_reason"] = "stale", f"SCHEMA_CHANGE: {exc}"
            return None
        if plan.columns != entry["columns"]:
            entry["status"], entry["status_reason"] = "stale", (
                f"SCHEMA_CHANGE: the query now gives columns {', '.join(plan.columns)}: drop the view and "
                f"create it again")
            return None
        self._apply_plan(entry, plan)
        return plan

    @staticmethod
    def _apply_plan(entry: dict[str, Any], plan: ViewPlan) -> None:
        entry.update({"maintenance": plan.mode, "reason": plan.reason.as_dict() if plan.reason else None,
                      "kind": plan.analysis.kind, "columns": plan.columns, "deps": plan.deps,
                      "key_exprs": plan.key_exprs, "key_columns": plan.key_columns})

    def _record(self, entry: dict[str, Any], kind: str, reason: str, seconds: float, *, keys: int | None,
                deleted: int, inserted: int, updated: int) -> None:
        entry["seq"] += 1
        entry["refreshes"].append({"seq": entry["seq"], "at": _now(), "kind": kind, "reason": reason, "keys": keys,
                                   "rows_deleted": deleted, "rows_inserted": inserted, "rows_updated": updated,
                                   "seconds": round(seconds, 6)})
        del entry["refreshes"][:-KEEP_REFRESHES]

    def _full(self, manifest: dict[str, Any], name: str, plan: ViewPlan, reason: str) -> None:
        """Recomputes all of the view into a new base."""
        started = time.perf_counter()
        entry = manifest["views"][name]
        frame = self.spark.sql(plan.select()).toDF(*plan.key_columns, *_value_names(entry))
        generation = f"{entry['dir']}/g-{new_id()}"
        base = f"{generation}/base"
        self._write(frame, base)
        rows = _parquet_rows(self.warehouse.file(base))
        old_rows = entry["rows"]
        if entry["generation"]:
            retire(manifest, [entry["generation"]])
        # the storage's schema is the frame's: key and value columns, nullable
        entry.update({"generation": generation, "base": [base], "logs": [], "rows": rows,
                      "schema": frame.schema.jsonValue()})
        for field in entry["schema"]["fields"]:
            field["nullable"] = True
        self._record(entry, "full", reason, time.perf_counter() - started, keys=None, deleted=old_rows,
                     inserted=rows, updated=0)

    def _incremental(self, after: dict[str, Any], name: str, plan: ViewPlan, changes: _Changes,
                     started: float) -> None:
        """Recomputes the keys the transaction's table changes touched."""
        spark = self.spark
        entry = after["views"][name]
        a = plan.analysis
        names = self._table_names(after)
        occurrence_source = [names[o.table.name.lower()] for o in a.occurrences]
        with_delta = [i for i, s in enumerate(occurrence_source) if s in changes.logs]
        if not with_delta:
            return
        costly = self._cost_says_full(entry, plan)
        if costly is not None:
            self._full(after, name, plan, costly)
            return
        state = _storage_frame(spark, self.warehouse, entry)
        key_pairs = [(k, k) for k in plan.key_columns]
        cached: list[Any] = []

        def keep(frame: Any) -> Any:
            cached.append(frame.cache())
            return frame
        try:
            if a.kind == "rows":
                upserts, olds, n_keys = [], [], 0
                for i in with_delta:
                    keys, count = changes.keys(occurrence_source[i])
                    n_keys += count
                    relation = f"_replicator_pk{i}"
                    keys.createOrReplaceTempView(relation)
                    o = a.occurrences[i]
                    cond = " AND ".join(f"{quote_spark(o.alias)}.{quote_spark(k)} <=> _replicator_x.c{j}"
                                        for j, k in enumerate(o.table.key))
                    upserts.append(spark.sql(plan.select(semi=(relation, cond))))
                    own = plan.occurrence_keys(i)
                    olds.append(state.join(keys, _null_safe(state, keys, [(k, f"c{j}") for j, k in enumerate(own)]),
                                           "left_semi").select(*plan.key_columns))
                n_view_keys = n_keys
                if self._too_large(entry, plan, n_keys):
                    self._full(after, name, plan, f"THRESHOLD: {n_keys} changed keys, view of {entry['rows']} rows")
                    return
                recomputed = keep(reduce(lambda x, y: x.unionByName(y), upserts)
                                  .toDF(*plan.key_columns, *_value_names(entry)).dropDuplicates(plan.key_columns))
                existing = keep(reduce(lambda x, y: x.unionByName(y), olds).distinct())
            else:
                delta = {i: changes.delta(occurrence_source[i]) for i in with_delta}
                selects = [plan.affected_keys(subset, delta) for size in range(1, len(with_delta) + 1)
                           for subset in combinations(with_delta, size)]
                affected = keep(spark.sql(" UNION ".join(selects)))
                n_view_keys = affected.count()
                if self._too_large(entry, plan, n_view_keys):
                    self._full(after, name, plan,
                               f"THRESHOLD: {n_view_keys} affected keys, view of {entry['rows']} rows")
                    return
                affected.createOrReplaceTempView("_replicator_keys")
                cond = " AND ".join(f"({e}) <=> _replicator_x.c{j}" for j, e in enumerate(plan.key_exprs))
                recomputed = keep(spark.sql(plan.select(semi=("_replicator_keys", cond)))
                                  .toDF(*plan.key_columns, *_value_names(entry)))
                keys_named = affected.toDF(*plan.key_columns)
                existing = keep(state.join(keys_named, _null_safe(state, keys_named, key_pairs), "left_semi")
                                .select(*plan.key_columns))
            n_existing = existing.count()
            gone = existing.join(recomputed, _null_safe(existing, recomputed, key_pairs), "left_anti")
            n_upserts, n_deleted = self._write_log(after, entry, recomputed, gone)
            self._record(entry, "incremental" if n_view_keys else "none", "" if n_view_keys else "NO_AFFECTED_KEYS",
                         time.perf_counter() - started, keys=n_view_keys, deleted=n_deleted,
                         inserted=n_upserts - (n_existing - n_deleted), updated=n_existing - n_deleted)
            entry["rows"] += n_upserts - n_existing
        finally:
            for frame in cached:
                frame.unpersist()

    @staticmethod
    def _cost_says_full(entry: dict[str, Any], plan: ViewPlan) -> str | None:
        """auto: why a full refresh is expected to be cheaper, from the view's refresh
        history (Spark's fixed cost per job makes a small view's full refresh the
        cheaper one); an incremental one is tried again now and then."""
        if plan.policy != "auto":
            return None
        history = entry["refreshes"][-50:]
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

    def _write(self, frame: Any, path: str) -> None:
        """Writes a DataFrame as the Parquet directory `path` of the warehouse, made
        durable before a manifest names it (Spark does not fsync)."""
        directory = self.warehouse.file(path)
        frame.write.parquet(str(directory))
        make_durable(sorted(directory.glob("*.parquet")), self.warehouse.path)

    def _too_large(self, entry: dict[str, Any], plan: ViewPlan, keys: int) -> bool:
        return plan.policy == "auto" and keys > AUTO_FULL_SHARE * max(entry["rows"], 1)

    def _write_log(self, manifest: dict[str, Any], entry: dict[str, Any], upserts: Any, gone: Any) -> tuple[int, int]:
        """One change log for the view: upserts and deletions, one row per key.
        Returns how many of each it holds (an empty one is not kept)."""
        from pyspark.sql import functions as F

        seq = manifest["next_seq"]
        schema = _storage_schema(entry)
        values = [f for f in schema.fields if f.name not in entry["key_columns"]]
        deletions = gone.select(*entry["key_columns"], *[F.lit(None).cast(f.dataType).alias(f.name) for f in values])
        frame = (upserts.withColumn(DELETED, F.lit(False))
                 .unionByName(deletions.withColumn(DELETED, F.lit(True)))
                 .withColumn(SEQ, F.lit(seq).cast("long")))
        path = f"{entry['generation']}/log-{seq:012d}-{new_id()}"
        directory = self.warehouse.file(path)
        self._write(frame.select(*[f.name for f in schema.fields], SEQ, DELETED), path)
        flags = [pq.read_table(f, columns=[DELETED]).column(0).to_pylist() for f in directory.glob("*.parquet")]
        rows = sum(len(f) for f in flags)
        deleted = sum(sum(1 for d in f if d) for f in flags)
        if not rows:
            shutil.rmtree(directory)
            return 0, 0
        manifest["next_seq"] = seq + 1
        entry["logs"].append({"file": path, "seq": seq, "rows": rows})
        if len(entry["logs"]) >= REWRITE_AFTER_LOGS:
            self._rewrite(manifest, entry)
        return rows - deleted, deleted

    def _rewrite(self, manifest: dict[str, Any], entry: dict[str, Any]) -> None:
        """Folds the view's change log into a new base (a new generation)."""
        generation = f"{entry['dir']}/g-{new_id()}"
        base = f"{generation}/base"
        self._write(_storage_frame(self.spark, self.warehouse, entry), base)
        retire(manifest, [entry["generation"]])
        entry.update({"generation": generation, "base": [base], "logs": []})
