"""Incremental views of a Spark warehouse.

A view is a query in Spark SQL over the warehouse's tables, named as the
SQLite target names them (``public.t`` → ``t``, ``s.t`` → ``s__t``). Its
rows are stored like a table's, a base plus change log files merged on read
by the view's keys, under ``PATH/_views/``; the manifest names them and holds
the definition and the refresh history. The consumer refreshes the views a
batch touched in the batch's commit, holding the manifest lock: one manifest
names the batch's table changes, the views' new files and the position.

The analysis is the SQLite target's (replicator.views.analysis), and so is the
strategy (replicator/targets/sqlite/views/), with the old rows read from
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

What is a lookup by key is done on the driver with pyarrow
(replicator.targets.spark.lookup), not by Spark: the warehouse has no index, so Spark
would scan whole tables for a few rows, and its fixed cost per job and stage
(a few hundred milliseconds on one machine) was most of a refresh. The
driver reads the old rows of the changed keys, which view keys are stored
among those recomputed (hence the deletions and the counts), and, for row
views, the rows an equi-join pairs with the changed rows, so that such a
view's refresh scans no table; a table's change log is handed to Spark's
queries as local relations rather than merged by a shuffle. Spark evaluates
the query (one job over the table for an aggregate view) and the view's log
is written by pyarrow. A view whose keys pyarrow cannot compare as Spark does,
or a transaction of more than DRIVER_MAX_KEYS keys, is refreshed by Spark
alone, the same way with joins instead of lookups.

A full refresh writes a new base. Policy ``auto`` refreshes in full when the
change touches more than AUTO_FULL_SHARE of the view. A view whose tables are
replaced (TRUNCATE, copied again) is refreshed in full; one whose tables
change structure is analysed again, and marked stale with the reason when
its query no longer runs or gives other columns.
"""

from __future__ import annotations

import builtins
import logging
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import reduce
from itertools import combinations
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from replicator.errors import UserError
from replicator.structure import TableStructure, target_table_name
from replicator.targets.spark import lookup
from replicator.targets.spark.reader import (
    current_names,
    entry_frame,
    logged_rows,
    merge_frames,
    physical_struct,
    read_parquet,
    storage_frame,
    storage_schema,
    value_names,
)
from replicator.targets.spark.warehouse import (
    DELETED,
    SEQ,
    VIEWS_DIR,
    Warehouse,
    entry_schema,
    make_durable,
    new_id,
    physical_name,
    retire,
    table_files,
)
from replicator.views import keyset
from replicator.views.analysis import TableInfo
from replicator.views.keyset import KeySet
from replicator.views.plan import (
    ViewPlan,
    apply_plan,
    cost_says_full,
    plan_view,
    record_refresh,
    stored_plan,
    too_large,
)
from replicator.views.plan import now as _now
from replicator.views.spark_sql import check_query, quote_spark
from replicator.views.spark_sql import spark_error_line as _first_line
from replicator.views.store import check_name, check_policy

log = logging.getLogger("replicator")

REWRITE_AFTER_LOGS = 16        # a view's log files folded into a new base past this many
KEEP_REFRESHES = 100           # refresh records kept per view
DRIVER_MAX_KEYS = 1_000_000    # changed keys (rows looked up) past which a refresh's lookups are Spark's
LOCAL_LOG_ROWS = 100_000       # a table's change log rows up to which queries read them from the driver


def _arrow_safe(entry: dict[str, Any]) -> bool:
    """Whether the view's columns have types that Spark's Arrow conversion gives and a
    Parquet file written by pyarrow holds as Spark reads them back (atomic types but
    intervals, variants and the like; arrays, maps and structs of them)."""
    from pyspark.sql import types as T

    def safe(t: Any) -> bool:
        if isinstance(t, T.ArrayType):
            return safe(t.elementType)
        if isinstance(t, T.MapType):
            return safe(t.keyType) and safe(t.valueType)
        if isinstance(t, T.StructType):
            return all(safe(f.dataType) for f in t.fields)
        return keyset.spark_arrow_type(t) is not None
    return all(safe(f.dataType) for f in storage_schema(entry).fields)


def _null_safe(left: Any, right: Any, pairs: list[tuple[str, str]]) -> Any:
    return reduce(lambda a, b: a & b, [left[x].eqNullSafe(right[y]) for x, y in pairs])


def _parquet_rows(directory: Any) -> int:
    return sum(pq.ParquetFile(f).metadata.num_rows for f in directory.glob("*.parquet"))


class _Changes:
    """A transaction's changes to the warehouse's tables as Spark sees them, computed
    once for all the views that read them: each changed table's keys (read from the
    transaction's log files, no scan of the table) and delta (the old rows of those
    keys, from the table before, and their new rows, from the log files).

    The old rows are looked up on the driver with pyarrow (replicator.targets.spark.lookup)
    when the keys are few enough to hold there, DRIVER_MAX_KEYS: a Spark job would
    scan the table whole for them, and its fixed cost is most of a refresh."""

    def __init__(self, session: Callable[[], Any], warehouse: Warehouse, before: dict[str, Any],
                 after: dict[str, Any], logs: dict[str, list[str]]) -> None:
        self._session, self.warehouse, self.before, self.after, self.logs = session, warehouse, before, after, logs
        self._keys: dict[str, Any] = {}
        self._key_tables: dict[str, pa.Table] = {}
        self._key_sets: dict[str, KeySet] = {}
        self._counts: dict[str, int] = {}
        self._delta_rows: dict[str, pa.Table] = {}
        self._new_rows: dict[str, pa.Table] = {}
        self._delta: dict[tuple[str, bool], tuple[str, Any]] = {}
        self._delta_uses: dict[tuple[str, bool], int] = {}
        self._cached: list[Any] = []

    @property
    def spark(self) -> Any:
        return self._session()

    def _structure(self, source_name: str) -> TableStructure:
        return TableStructure.from_json(self.after["tables"][source_name]["structure"])

    def _key_physical(self, source_name: str) -> list[str]:
        return [physical_name(c) for c in self._structure(source_name).key_columns()]

    def keys(self, source_name: str) -> Any:
        """The table's changed keys (columns c0...): the key columns of the transaction's
        log files as they are. A key in two of them (a batch spilled) is there twice,
        which the semi-joins and existence joins they serve do not mind; not caching
        them keeps Spark from running a job to fill the cache, and the files are
        small enough to be read again by each query."""
        if source_name not in self._keys:
            from pyspark.sql import functions as F
            files = [str(self.warehouse.file(f)) for f in self.logs[source_name]]
            log_schema = physical_struct(self.after["tables"][source_name], log=True)
            self._keys[source_name] = read_parquet(self.spark, files, log_schema).select(
                *[F.col(p).alias(f"c{j}") for j, p in enumerate(self._key_physical(source_name))])
        return self._keys[source_name]

    def key_table(self, source_name: str) -> pa.Table:
        """The key columns of the transaction's log files for the table, read by pyarrow
        (the consumer wrote them on this disk a moment ago): no Spark job."""
        if source_name not in self._key_tables:
            self._key_tables[source_name] = lookup.key_columns(self.warehouse, self.after["tables"][source_name],
                                                               self.logs[source_name])
        return self._key_tables[source_name]

    def key_set(self, source_name: str) -> KeySet:
        """The table's changed keys as a KeySet, built once for all the views: it makes
        them canonical, and its lookup table is built on first use."""
        if source_name not in self._key_sets:
            table = self.key_table(source_name)
            self._key_sets[source_name] = KeySet([table.column(c) for c in table.column_names])
        return self._key_sets[source_name]

    def count(self, source_name: str) -> int:
        """How many keys the transaction changed in the table: the distinct key values
        of its log files."""
        if source_name not in self._counts:
            table = self.key_table(source_name)
            self._counts[source_name] = keyset.distinct(table, table.column_names)
        return self._counts[source_name]

    def delta_rows(self, source_name: str) -> pa.Table:
        """The old and new rows of the table's changed keys, looked up with pyarrow
        (physical column names)."""
        if source_name not in self._delta_rows:
            keys = self.key_table(source_name)
            self._delta_rows[source_name] = pa.concat_tables([
                lookup.old_rows(self.warehouse, self.before["tables"][source_name],
                                [keys.column(c) for c in keys.column_names]),
                self.new_rows(source_name)])
        return self._delta_rows[source_name]

    def new_rows(self, source_name: str) -> pa.Table:
        """The rows the transaction set in the table (each changed key's latest, deleted
        ones left out), read by pyarrow (physical column names)."""
        if source_name not in self._new_rows:
            self._new_rows[source_name] = lookup.logged_rows(self.warehouse, self.after["tables"][source_name],
                                                             self.logs[source_name])
        return self._new_rows[source_name]

    def delta(self, source_name: str, uses: int = 1, *, driver: bool = False) -> str:
        """A temporary view of the old and new rows of the table's changed keys.

        driver: the rows are looked up with pyarrow and handed to Spark as a local
        relation (no job to read them, none to broadcast them). Otherwise a Spark
        semi-join of the table before with the keys; it is not cached while one
        query reads it once: Spark then reads only the columns that query needs
        (the scan is most of the cost). Read more than once (uses, or another
        view), it is cached."""
        from pyspark.sql import functions as F

        slot = (source_name, driver)
        if slot not in self._delta:
            structure = self._structure(source_name)
            if driver:
                frame = current_names(self.spark.createDataFrame(self.delta_rows(source_name),
                                                                 schema=physical_struct(self.after["tables"][source_name])),
                                     structure)
            else:
                keys = self.keys(source_name)
                pairs = [(k, f"c{j}") for j, k in enumerate(structure.key)]
                old = entry_frame(self.spark, self.warehouse, self.before["tables"][source_name])
                new = logged_rows(self.spark, self.warehouse, self.after["tables"][source_name],
                                  self.logs[source_name])
                frame = old.join(F.broadcast(keys), _null_safe(old, keys, pairs), "left_semi").unionByName(new)
            name = f"_replicator_delta_{len(self._delta)}"
            frame.createOrReplaceTempView(name)
            self._delta[slot] = (name, frame)
        name, frame = self._delta[slot]
        self._delta_uses[slot] = self._delta_uses.get(slot, 0) + uses
        if not driver and self._delta_uses[slot] > 1 and not any(f is frame for f in self._cached):
            # cached by plan: queries over the temporary view from now on read the cache
            self._cached.append(frame.cache())
        return name

    def release(self) -> None:
        for frame in self._cached:
            frame.unpersist()


class SparkViews:
    """The views of one Spark warehouse: definitions, refresh, the `view` commands."""

    def __init__(self, warehouse: Warehouse, session: Callable[[], Any]) -> None:
        self.warehouse = warehouse
        self._session = session
        self._spark: Any = None
        self._tables_of: dict[str, Any] | None = None   # the manifest whose tables are registered
        self._tables_done: set[str] = set()
        self._registering = 0.0                          # seconds spent registering tables, in all
        self._checked: set[tuple[str, frozenset[str]]] = set()   # queries check_query accepted

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

    def _register_tables(self, manifest: dict[str, Any], only: set[str] | None = None) -> None:
        """Registers the tables as the manifest has them (only: those of these source
        names) as temporary views, each once per manifest: a refresh asks for the
        tables its queries read when it runs them (a row view whose rows are looked
        up on the driver reads none)."""
        began = time.perf_counter()
        if manifest is not self._tables_of:
            self._tables_of, self._tables_done = manifest, set()   # (the reference keeps its id unique)
        for source_name, entry in manifest["tables"].items():
            if (only is not None and source_name not in only) or source_name in self._tables_done:
                continue
            s = TableStructure.from_json(entry["structure"])
            self._table_frame(entry).createOrReplaceTempView(target_table_name(s.schema, s.name))
            self._tables_done.add(source_name)
        self._registering += time.perf_counter() - began

    def _elapsed(self, started: float, registering: float) -> float:
        """Seconds since started, less those spent registering tables since (a refresh
        record counts the refresh, not the temporary views it reads, as it always has)."""
        return time.perf_counter() - started - (self._registering - registering)

    def _table_frame(self, entry: dict[str, Any]) -> Any:
        """A table's current rows, as reader.entry_frame has them, for the views'
        queries. While its change log holds at most LOCAL_LOG_ROWS rows, the log's
        side of the merge is read by pyarrow and handed to Spark as local relations
        (each key's latest row, and every key the log touched): the query then has
        no stage that scans the log files, shuffles and sorts them to pick the
        latest rows, and broadcasts their keys (a few stages in line before the
        table's scan starts, on every refresh, full or incremental). The base is
        Spark's to scan."""
        from pyspark.sql import types as T

        rows = sum(log.get("rows", LOCAL_LOG_ROWS + 1) for log in entry["logs"])
        if not entry["logs"] or rows > LOCAL_LOG_ROWS:
            return entry_frame(self.spark, self.warehouse, entry)
        structure = TableStructure.from_json(entry["structure"])
        keys = [physical_name(c) for c in structure.key_columns()]
        base_files, log_files = table_files(entry)
        schema = physical_struct(entry)
        base = read_parquet(self.spark, [str(self.warehouse.file(f)) for f in base_files], schema)
        latest_rows, touched = lookup.logged_rows_and_keys(self.warehouse, entry, log_files)
        latest = self.spark.createDataFrame(latest_rows, schema=schema)
        touched_frame = self.spark.createDataFrame(
            touched.rename_columns([f"_key_{k}" for k in keys]),
            schema=T.StructType([T.StructField(f"_key_{f.name}", f.dataType, True) for f in schema.fields
                                 if f.name in keys]))
        return current_names(merge_frames(base, latest, touched_frame, keys), structure)

    # planning ------------------------------------------------------------------------------

    def plan(self, manifest: dict[str, Any], name: str, sql: str, policy: str) -> ViewPlan:
        """Analyses a definition against the warehouse as the manifest has it (its
        tables registered as temporary views). Raises UserError when the SQL does not
        run on it."""
        def prepare(sql: str) -> None:
            self._check(manifest, sql)
            self._register_tables(manifest)
        return plan_view(self.spark, name, sql, policy, self._catalog(manifest), self._table_names(manifest), prepare)

    def _check(self, manifest: dict[str, Any], sql: str) -> None:
        """check_query, once per query and set of tables (the consumer checks a stored view's
        query before each refresh runs it: one written before these checks is refused there)."""
        tables = frozenset(self._table_names(manifest))
        if (sql, tables) not in self._checked:
            check_query(self.spark, sql, set(tables))
            self._checked.add((sql, tables))

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
        found: str | None = next((n for n in manifest.get("views", {}) if n.lower() == name.lower()), None)
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
            entry: dict[str, Any] = {
                "sql": plan.sql, "policy": policy, "created_at": _now(), "dir": f"{VIEWS_DIR}/{name}-{new_id()}",
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

    # the method shadows the builtin in the class body: signatures below say builtins.list
    def list(self) -> builtins.list[dict[str, Any]]:
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

    def refreshes(self, name: str, limit: int = 20) -> builtins.list[dict[str, Any]]:
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

    def refresh_after(self, before: dict[str, Any], after: dict[str, Any], ops: builtins.list[tuple[Any, ...]]) -> None:
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
            elif op[0] in ("rename", "drop") or (
                    op[0] == "meta" and op[1] in before["tables"] and op[1] in after["tables"]
                    and before["tables"][op[1]]["structure"] != after["tables"][op[1]]["structure"]):
                replaced[op[1]] = "SCHEMA_CHANGE"
        if not logs and not replaced:
            return
        changes = _Changes(lambda: self.spark, self.warehouse, before, after, logs)
        try:
            self._refresh_changed(after, views, logs, replaced, changes)
        finally:
            changes.release()

    def _refresh_changed(self, after: dict[str, Any], views: dict[str, Any], logs: dict[str, builtins.list[str]],
                         replaced: dict[str, str], changes: _Changes) -> None:
        for name in list(views):
            entry = views[name]
            deps = set(entry["deps"])
            if entry["status"] != "ok" or not deps & (set(logs) | set(replaced)):
                continue
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
        return stored_plan(name, manifest["views"][name], self._catalog(manifest),
                           lambda sql: self._check(manifest, sql))

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
        apply_plan(entry, plan)

    @staticmethod
    def _record(entry: dict[str, Any], kind: str, reason: str, seconds: float, *, keys: int | None,
                deleted: int, inserted: int, updated: int) -> None:
        """Appends a refresh record to the view's manifest entry; keeps the last
        KEEP_REFRESHES, and the latest full one."""
        record_refresh(entry, kind, reason, seconds, keys=keys, deleted=deleted, inserted=inserted, updated=updated,
                       keep=KEEP_REFRESHES)

    def _full(self, manifest: dict[str, Any], name: str, plan: ViewPlan, reason: str) -> None:
        """Recomputes all of the view into a new base."""
        started, registering = time.perf_counter(), self._registering
        entry = manifest["views"][name]
        self._register_tables(manifest, set(plan.deps))
        frame = self.spark.sql(plan.select()).toDF(*plan.key_columns, *value_names(entry))
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
        self._record(entry, "full", reason, self._elapsed(started, registering), keys=None, deleted=old_rows,
                     inserted=rows, updated=0)

    def _incremental(self, after: dict[str, Any], name: str, plan: ViewPlan, changes: _Changes,
                     started: float) -> None:
        """Recomputes the keys the transaction's table changes touched.

        Spark's fixed cost per job and stage is most of a small refresh, so it runs
        as few as it can, and the driver does with pyarrow what is a lookup
        (replicator.targets.spark.lookup): the changed keys are counted from the log files;
        an aggregate view's affected keys come from the old rows of those keys,
        looked up in the table as it was, and their new rows (by pyarrow for plain
        column keys, else by a small Spark job over them, local); the view's rows
        for the affected keys are computed by one job over the tables as they are,
        filtered by the broadcast keys, and collected; which of those keys the view
        held, hence the deletions and the counts, is read from its key columns, and
        the log is written by pyarrow. A row view needs no old rows (its rows are
        named by the base keys themselves), and where its equi-joins lead from the
        changed rows to the others, those are looked up too: no table is scanned.

        When a key of the view's storage has a type pyarrow cannot compare as Spark
        does, or the transaction changed more than DRIVER_MAX_KEYS keys, all of it
        is done by Spark (_write_log_spark)."""
        from pyspark.sql import functions as F

        spark = self.spark
        registering = self._registering
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
        values = value_names(entry)
        driver = (self._key_arrow_schema(entry) is not None
                  and sum(changes.count(s) for s in {occurrence_source[i] for i in with_delta}) <= DRIVER_MAX_KEYS)
        affected: Any = None
        try:
            if a.kind == "rows":
                n_view_keys = sum(changes.count(occurrence_source[i]) for i in with_delta)
                if self._too_large(entry, plan, n_view_keys):
                    self._full(after, name, plan,
                               f"THRESHOLD: {n_view_keys} changed keys, view of {entry['rows']} rows")
                    return
                local = self._changed_rows_local(plan, with_delta, occurrence_source, changes, values) \
                    if driver else None
                key_views: dict[int, str] = {}
                if local is None:
                    self._register_tables(after, set(entry["deps"]))
                    # read by the existence joins of several changed occurrences, and by
                    # _stored_rows when there are no lookups: registered once for both
                    if len(with_delta) > 1 or not driver:
                        key_views = self._key_views(with_delta, occurrence_source, changes)
                    recomputed, bound = self._changed_rows(plan, with_delta, occurrence_source, changes, values,
                                                           key_views), None
                else:
                    recomputed, bound = local
                if driver:
                    wanted = [(plan.occurrence_keys(i), changes.key_set(occurrence_source[i])) for i in with_delta]
                    written = self._write_log(after, entry, recomputed, wanted,
                                              collect=bound is not None and bound <= DRIVER_MAX_KEYS
                                              and _arrow_safe(entry))
                else:
                    written = self._write_log_spark(after, entry, recomputed, self._stored_rows(plan, key_views, entry))
            else:
                self._register_tables(after, set(entry["deps"]))
                found = self._affected_on_driver(plan, entry, occurrence_source, changes) if driver else None
                if found is not None:
                    keys_frame = spark.createDataFrame(found, schema=self._key_struct(entry, "c"))
                    n_view_keys = found.num_rows
                else:
                    subsets = [subset for size in range(1, len(with_delta) + 1)
                               for subset in combinations(with_delta, size)]
                    uses = Counter(i for subset in subsets for i in subset)
                    delta = {i: changes.delta(occurrence_source[i], uses[i], driver=driver) for i in with_delta}
                    selects = [plan.affected_keys(subset, delta) for subset in subsets]
                    affected = spark.sql(" UNION ".join(selects))
                    if driver:
                        # on the driver: counted there, and a local relation from then on,
                        # which Spark broadcasts without a job
                        found = affected.toArrow()
                        n_view_keys = found.num_rows
                        keys_frame = spark.createDataFrame(found, schema=affected.schema)
                        affected = None
                    else:
                        # cached and counted: one job (the threshold needs the count before
                        # the refresh is chosen), then read from memory by the joins below
                        affected = keys_frame = affected.cache()
                        n_view_keys = affected.count()
                if self._too_large(entry, plan, n_view_keys):
                    self._full(after, name, plan,
                               f"THRESHOLD: {n_view_keys} affected keys, view of {entry['rows']} rows")
                    return
                if not n_view_keys:
                    self._record(entry, "none", "NO_AFFECTED_KEYS", self._elapsed(started, registering), keys=0,
                                 deleted=0, inserted=0, updated=0)
                    return
                keys_frame.createOrReplaceTempView("_replicator_keys")
                cond = " AND ".join(f"({e}) <=> _replicator_x.c{j}" for j, e in enumerate(plan.key_exprs))
                recomputed = spark.sql(plan.select(semi=("_replicator_keys", cond))).toDF(*plan.key_columns, *values)
                if found is not None:
                    # an aggregate gives a row per affected key at most: few enough to
                    # collect when the keys are (and a local file is written without
                    # the commit protocol of a Spark write)
                    found_keys = KeySet([found.column(c) for c in found.column_names])
                    written = self._write_log(after, entry, recomputed, [(plan.key_columns, found_keys)],
                                              collect=n_view_keys <= DRIVER_MAX_KEYS and _arrow_safe(entry))
                else:
                    state = storage_frame(spark, self.warehouse, entry)
                    keys_named = keys_frame.toDF(*plan.key_columns)
                    existing = state.join(F.broadcast(keys_named),
                                          _null_safe(state, keys_named, [(k, k) for k in plan.key_columns]),
                                          "left_semi").select(*plan.key_columns)
                    written = self._write_log_spark(after, entry, recomputed, existing)
            n_upserts, n_deleted, n_existing = written
            self._record(entry, "incremental", "", self._elapsed(started, registering), keys=n_view_keys,
                         deleted=n_deleted, inserted=n_upserts - (n_existing - n_deleted),
                         updated=n_existing - n_deleted)
            entry["rows"] += n_upserts - n_existing
        finally:
            if affected is not None:
                affected.unpersist()

    @staticmethod
    def _key_views(with_delta: builtins.list[int], occurrence_source: builtins.list[str],
                   changes: _Changes) -> dict[int, str]:
        """Registers the changed keys (columns c0...) of each changed occurrence i as the
        temporary view _replicator_pk<i>; returns the names by occurrence."""
        names = {}
        for i in with_delta:
            names[i] = f"_replicator_pk{i}"
            changes.keys(occurrence_source[i]).createOrReplaceTempView(names[i])
        return names

    def _changed_rows(self, plan: ViewPlan, with_delta: builtins.list[int], occurrence_source: builtins.list[str],
                      changes: _Changes, values: builtins.list[str], key_views: dict[int, str]) -> Any:
        """A row view's recomputed rows: the combinations holding a changed base row,
        from the tables as they are. With one changed occurrence, its table is
        replaced by the transaction's new rows of it (the table as it is has no
        other rows for those keys): that table is not read at all. With several,
        one query keeps the combinations matching any of their key sets (key_views,
        existence joins under one OR), so each table is scanned once and no
        combination twice."""
        spark = self.spark
        a = plan.analysis
        if len(with_delta) == 1:
            i = with_delta[0]
            source = occurrence_source[i]
            logged_rows(spark, self.warehouse, changes.after["tables"][source], changes.logs[source]) \
                .createOrReplaceTempView("_replicator_new")
            select = plan.select(relations={i: "_replicator_new"})
        else:
            restrict = []
            for i, relation in key_views.items():
                o = a.occurrences[i]
                restrict.append((relation, " AND ".join(
                    f"{quote_spark(o.alias)}.{quote_spark(k)} <=> _replicator_x.c{j}"
                    for j, k in enumerate(o.table.key))))
            select = plan.select(any_of=restrict)
        return spark.sql(select).toDF(*plan.key_columns, *values)

    def _changed_rows_local(self, plan: ViewPlan, with_delta: builtins.list[int], occurrence_source: builtins.list[str],
                            changes: _Changes, values: builtins.list[str]) -> tuple[Any, int] | None:
        """A row view's recomputed rows from rows looked up on the driver, when the
        view's equi-joins lead there: no table is scanned. Per changed occurrence i
        (a branch), i reads the transaction's new rows of its table; each other
        occurrence reads the rows of its table (as it is) that an equi-join
        condition pairs with the rows found for a neighbour (lookup.rows_matching),
        a superset of those its combinations can hold, which the query then
        filters; a changed occurrence of an earlier branch leaves out its changed
        keys (those combinations are that branch's). Returns the rows and a bound on
        how many there are; None when an occurrence is not reached through conditions
        between columns of one category, or more than DRIVER_MAX_KEYS rows would be
        held (the caller scans with Spark)."""
        a = plan.analysis
        after = changes.after
        structures = [TableStructure.from_json(after["tables"][s]["structure"]) for s in occurrence_source]
        columns = [{c.name: c for c in st.columns} for st in structures]
        entries = [after["tables"][s] for s in occurrence_source]
        types = [entry_schema(e) for e in entries]
        pairs = [(x, y) for x, y in a.equi] + [(y, x) for x, y in a.equi]
        held = 0
        branches = []
        combinations_bound = 0
        for i in with_delta:
            found: dict[int, pa.Table] = {i: changes.new_rows(occurrence_source[i])}
            bound = found[i].num_rows
            if not bound:   # the transaction only deleted rows of i: no combination holds a new one
                found.update({j: types[j].empty_table() for j in range(len(a.occurrences)) if j != i})
            while len(found) < len(a.occurrences):
                reached = next(((j, r) for (r, _), (j, _) in pairs if r in found and j not in found), None)
                if reached is None:
                    return None
                j, r = reached
                link = [(physical_name(columns[r][cr]), physical_name(columns[j][cj]))
                        for (rr, cr), (jj, cj) in pairs if rr == r and jj == j]
                if any(keyset.category(types[r].field(pr).type) is None
                       or keyset.category(types[r].field(pr).type) != keyset.category(types[j].field(pj).type)
                       for pr, pj in link):
                    return None
                paired = KeySet([found[r].column(pr) for pr, _ in link])
                rows = lookup.rows_matching(self.warehouse, after["tables"][occurrence_source[j]],
                                            [pj for _, pj in link], paired, DRIVER_MAX_KEYS - held)
                if rows is None:
                    return None
                if j in with_delta and j < i:
                    key = [physical_name(c) for c in structures[j].key_columns()]
                    rows = changes.key_set(occurrence_source[j]).keep(rows, key, inside=False)
                found[j] = rows
                held += rows.num_rows
                # a row found so far pairs with at most as many rows of j as j holds for
                # one value of the link: the branch's combinations are at most the
                # product of those (counted on canonical values, as the join compares)
                bound *= keyset.largest_group(rows, [pj for _, pj in link])
            names = {}
            for j, rows in found.items():
                names[j] = f"_replicator_r{i}_{j}"
                current_names(self.spark.createDataFrame(rows, schema=physical_struct(entries[j])),
                              structures[j]).createOrReplaceTempView(names[j])
            branches.append(plan.select(relations=names))
            combinations_bound += bound
        return self.spark.sql(" UNION ALL ".join(branches)).toDF(*plan.key_columns, *values), combinations_bound

    def _stored_rows(self, plan: ViewPlan, key_views: dict[int, str], entry: dict[str, Any]) -> Any:
        """The key columns of a row view's stored rows naming a changed key (key_views:
        the changed occurrences' keys), by Spark (one scan of the view's storage, the
        key sets broadcast)."""
        spark = self.spark
        storage_frame(spark, self.warehouse, entry).createOrReplaceTempView("_replicator_state")
        stored = []
        for i, relation in key_views.items():
            stored.append((relation, " AND ".join(f"_replicator_s.{quote_spark(k)} <=> _replicator_x.c{j}"
                                                  for j, k in enumerate(plan.occurrence_keys(i)))))
        columns = ", ".join(quote_spark(k) for k in plan.key_columns)
        if len(stored) == 1:
            return spark.sql(f"SELECT /*+ BROADCAST(_replicator_x) */ {columns} FROM _replicator_state AS "
                             f"_replicator_s LEFT SEMI JOIN {stored[0][0]} AS _replicator_x ON {stored[0][1]}")
        exists = " OR ".join(f"EXISTS (SELECT 1 FROM {r} AS _replicator_x WHERE {c})" for r, c in stored)
        return spark.sql(f"SELECT {columns} FROM _replicator_state AS _replicator_s WHERE {exists}")

    def _affected_on_driver(self, plan: ViewPlan, entry: dict[str, Any], occurrence_source: builtins.list[str],
                            changes: _Changes) -> pa.Table | None:
        """An aggregate (or DISTINCT) view's affected keys (columns c0...) computed by
        pyarrow, when they are plain columns of its one table, read without a filter:
        the distinct values of those columns in the delta. None otherwise (Spark
        evaluates the key expressions), and for float keys, whose -0.0 and 0.0 (and
        NaNs) Arrow would keep apart where Spark's grouping makes them one."""
        a = plan.analysis
        plain = [k for k in a.key_columns if k is not None]
        if len(a.occurrences) != 1 or a.conditions or a.where or not a.key_columns \
                or len(plain) != len(a.key_columns):
            return None
        schema = self._key_struct(entry, "c")
        if any(f.dataType.typeName() in ("float", "double") for f in schema.fields):
            return None
        structure = changes._structure(occurrence_source[0])
        by_name = {c.name: c for c in structure.columns}
        physical = [physical_name(by_name[k[1]]) for k in plain]
        rows = changes.delta_rows(occurrence_source[0])
        distinct = rows.select(physical).group_by(physical).aggregate([])
        types = [keyset.spark_arrow_type(f.dataType) for f in schema.fields]
        return pa.Table.from_arrays([distinct.column(p).cast(t) for p, t in zip(physical, types)],
                                    names=[f.name for f in schema.fields])

    @staticmethod
    def _key_struct(entry: dict[str, Any], prefix: str | None = None) -> Any:
        """The Spark schema of the view's key columns (renamed prefix0... if given)."""
        from pyspark.sql import types as T
        fields = {f.name: f for f in storage_schema(entry).fields}
        return T.StructType([T.StructField(f"{prefix}{j}" if prefix else k, fields[k].dataType, True)
                             for j, k in enumerate(entry["key_columns"])])

    @staticmethod
    def _key_arrow_schema(entry: dict[str, Any]) -> pa.Schema | None:
        """The Arrow schema of the view's key columns as its log files hold them, when
        pyarrow can compare them as Spark does; None otherwise."""
        fields = {f.name: f for f in storage_schema(entry).fields}
        types = [keyset.spark_arrow_type(fields[k].dataType) for k in entry["key_columns"]]
        if any(t is None for t in types):
            return None
        return pa.schema([pa.field(k, t) for k, t in zip(entry["key_columns"], types)])

    @staticmethod
    def _cost_says_full(entry: dict[str, Any], plan: ViewPlan) -> str | None:
        return cost_says_full(entry, plan)

    def _write(self, frame: Any, path: str) -> None:
        """Writes a DataFrame as the Parquet directory `path` of the warehouse, made
        durable before a manifest names it (Spark does not fsync)."""
        directory = self.warehouse.file(path)
        frame.write.parquet(str(directory))
        make_durable(sorted(directory.glob("*.parquet")), self.warehouse.path)

    def _too_large(self, entry: dict[str, Any], plan: ViewPlan, keys: int) -> bool:
        return too_large(plan, keys, entry["rows"])

    def _write_log(self, manifest: dict[str, Any], entry: dict[str, Any], upserts: Any,
                   wanted: builtins.list[tuple[builtins.list[str], KeySet]], *,
                   collect: bool = False) -> tuple[int, int, int]:
        """One change log for the view: the recomputed rows (upserts), and deletions
        of the stored keys matching wanted (see lookup.stored_keys) that were not
        recomputed, found and written by pyarrow into the same directory (one log,
        one _seq: their keys are not the upserts'). The upserts are written by
        Spark, or with collect collected and written by pyarrow (the caller knows
        they are few). Returns how many upserts and deletions it holds and how many
        stored keys matched (an empty log is not kept)."""
        from pyspark.sql import functions as F

        seq = manifest["next_seq"]
        keys = entry["key_columns"]
        key_schema = self._key_arrow_schema(entry)
        assert key_schema is not None
        path = f"{entry['generation']}/log-{seq:012d}-{new_id()}"
        directory = self.warehouse.file(path)
        columns = [f.name for f in storage_schema(entry).fields]
        parts: list[Path] = []
        if collect:
            rows = upserts.select(*columns).toArrow()
            directory.mkdir(parents=True)
            recomputed = rows.select(keys)
            if rows.num_rows:
                part = directory / f"part-upserts-{new_id()}.parquet"
                pq.write_table(rows.append_column(SEQ, pa.array([seq] * rows.num_rows, pa.int64()))
                               .append_column(DELETED, pa.array([False] * rows.num_rows, pa.bool_())),
                               part, compression="snappy")
                parts.append(part)
        else:
            # _seq from a one-row local relation rather than a literal: a literal is
            # compiled into the stage's generated code, a new class every batch
            stamp = self.spark.createDataFrame([(seq, False)], f"{SEQ} long, {DELETED} boolean")
            upserts.crossJoin(F.broadcast(stamp)).select(*columns, SEQ, DELETED).write.parquet(str(directory))
            parts = sorted(directory.glob("*.parquet"))
            written = [lookup.parquet_table(p, keys) for p in parts]
            recomputed = pa.concat_tables([t.cast(written[0].schema) for t in written]) if written \
                else pa.table({k: pa.array([], pa.null()) for k in keys})
        existing = lookup.stored_keys(self.warehouse, entry, keys, wanted)
        gone = KeySet([recomputed.column(k) for k in keys]).keep(existing, keys, inside=False)
        if gone.num_rows:
            deletions = directory / f"part-deleted-{new_id()}.parquet"
            pq.write_table(lookup.tombstones(gone, key_schema, seq), deletions, compression="snappy")
            parts.append(deletions)
        return self._keep_log(manifest, entry, path, seq, upserts=recomputed.num_rows, deleted=gone.num_rows,
                              existing=existing.num_rows, parts=parts)

    def _write_log_spark(self, manifest: dict[str, Any], entry: dict[str, Any], upserts: Any,
                         existing: Any) -> tuple[int, int, int]:
        """One change log for the view: the recomputed rows, and deletions of the
        stored keys (existing) not recomputed, one row per key. Returns how many
        upserts and deletions it holds and how many of its keys the view held
        (an empty one is not kept). One job: a full outer join of the two sides
        (both small) gives the rows and, observed as they are written, the counts,
        with no count job that would compute either side again."""
        from pyspark.sql import Observation
        from pyspark.sql import functions as F

        seq = manifest["next_seq"]
        schema = storage_schema(entry)
        keys = entry["key_columns"]
        values = [f.name for f in schema.fields if f.name not in keys]
        new = upserts.withColumn("_replicator_new", F.lit(True))
        old = existing.select(*[F.col(k).alias(f"_replicator_e{j}") for j, k in enumerate(keys)],
                              F.lit(True).alias("_replicator_old"))
        joined = new.join(old, _null_safe(new, old, [(k, f"_replicator_e{j}") for j, k in enumerate(keys)]),
                          "full_outer")
        counts = Observation()
        joined = joined.observe(counts, F.count("_replicator_new").alias("upserts"),
                                F.count("_replicator_old").alias("existing"),
                                F.count_if(F.col("_replicator_new").isNull()).alias("deleted"))
        # a key column is the recomputed row's, or the stored one's for a deletion (a
        # NULL key is a value: the side is told by its marker, not by coalesce)
        frame = joined.select(*[F.when(F.col("_replicator_new"), F.col(k)).otherwise(F.col(f"_replicator_e{j}"))
                                .alias(k) for j, k in enumerate(keys)],
                              *values, F.lit(seq).cast("long").alias(SEQ),
                              F.col("_replicator_new").isNull().alias(DELETED))
        path = f"{entry['generation']}/log-{seq:012d}-{new_id()}"
        self._write(frame, path)   # durable already
        observed = counts.get
        return self._keep_log(manifest, entry, path, seq, upserts=observed["upserts"], deleted=observed["deleted"],
                              existing=observed["existing"])

    def _keep_log(self, manifest: dict[str, Any], entry: dict[str, Any], path: str, seq: int, *, upserts: int,
                  deleted: int, existing: int, parts: Sequence[Path] = ()) -> tuple[int, int, int]:
        """Names a view's new log (the directory path, its rows stamped seq, the
        manifest's next_seq) in its entry, its files (parts) made durable first; an
        empty log (no upserts, no deletions) is removed instead. Past
        REWRITE_AFTER_LOGS logs the view's log is folded into a new base. Returns
        (upserts, deleted, existing: the stored keys the log's matched)."""
        if upserts + deleted:
            make_durable(parts, self.warehouse.path)
            manifest["next_seq"] = seq + 1
            entry["logs"].append({"file": path, "seq": seq, "rows": upserts + deleted})
            if len(entry["logs"]) >= REWRITE_AFTER_LOGS:
                self._rewrite(manifest, entry)
        else:
            shutil.rmtree(self.warehouse.file(path))
        return upserts, deleted, existing

    def _rewrite(self, manifest: dict[str, Any], entry: dict[str, Any]) -> None:
        """Folds the view's change log into a new base (a new generation)."""
        generation = f"{entry['dir']}/g-{new_id()}"
        base = f"{generation}/base"
        self._write(storage_frame(self.spark, self.warehouse, entry), base)
        retire(manifest, [entry["generation"]])
        entry.update({"generation": generation, "base": [base], "logs": []})
