"""Incremental views of a Delta warehouse.

A view is a query in Spark SQL over the warehouse's tables, named as the SQLite
target names them (``public.t`` → ``t``, ``s.t`` → ``s__t``); its result is a
Delta table (replicator.targets.delta.view_table) that any Delta reader reads as
it is. The analysis is the SQLite views' too (replicator.views.analysis, in Spark's
dialect); the plans are replicator.targets.delta.view_plan; Spark computes the rows.

**Refresh, after the tables' commit.** The consumer commits a batch's tables and
its position without Spark, then refreshes the views that read a table the
batch changed: its own commit of each view's table, with the transaction id
(QUEUE/CONSUMER, tick) of the batch. A view is as of its own tick: it equals its
query over the tables at the versions it records (those of its tick), and a
crash between the tables' commit and the views' leaves it behind, not wrong.
The consumer starts Spark in a background thread when the warehouse has views
and commits its batches meanwhile; a view behind the tables (Spark still
starting, a crash, a view created while the consumer ran) is caught up at the
next commit, incrementally over the changes since the versions it records
(replicator.targets.delta.changes: what the consumer captured as it wrote, or
the tables' logs), in full when those are gone from the log.

**Incremental refresh** (replicator.targets.delta.view_refresh): the changed
keys, their old rows (read by position where the commits marked them deleted)
and their new rows (found by the table's key index) give the affected keys of
an aggregate or DISTINCT view and the changed combinations of a row view; the
view's rows for those are recomputed by Spark over the tables at the view's
versions, and written as a batch is (new rows in a new file, the replaced and
deleted ones marked in deletion vectors).
A full refresh has Spark write the whole result as the table's new version.
Policy ``auto`` refreshes in full when a change touches more than
AUTO_FULL_SHARE of the view or the refresh history says a full refresh is
cheaper; a view whose tables are replaced (copied again, TRUNCATE) is refreshed
in full; one whose tables change structure is analysed again, and marked stale
with the reason when its query no longer runs or gives other columns.

The `view` commands work beside a running consumer: each writes the view's
table with a conditional commit; whoever loses the race reads the winner's
commit and refreshes again from there.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import pyarrow.parquet as pq

from replicator.errors import UserError
from replicator.structure import TableStructure, target_table_name
from replicator.targets.delta import log as delta_log
from replicator.targets.delta import maintenance
from replicator.targets.delta import schema as delta_schema
from replicator.targets.delta.actions import Add, records
from replicator.targets.delta.changes import TableChanges, changes_since
from replicator.targets.delta.reader import consumer_of, tick_versions
from replicator.targets.delta.spark_sql import check_query, spark_error_line
from replicator.targets.delta.state import WarehouseState
from replicator.targets.delta.storage import Storage
from replicator.targets.delta.table import Captured, ReplicaTable
from replicator.targets.delta.view_plan import (
    ViewPlan,
    apply_plan,
    cost_says_full,
    now,
    plan_view,
    record_refresh,
    stored_plan,
)
from replicator.targets.delta.view_refresh import Refresher
from replicator.targets.delta.view_table import ViewTable, view_directories, view_directory, view_structure
from replicator.views.analysis import TableInfo
from replicator.views.protocol import check_name, check_policy

log = logging.getLogger("replicator")

KEEP_REFRESHES = 20            # refresh records kept in a view's record (each commit's parameters keep them all)
COMMIT_ATTEMPTS = 3            # a view's refresh done again after losing its commit to another writer
CAPTURE_MAX_KEYS = 2_000_000   # changed keys kept in memory per table for views behind; past it, the log has them


class Warehouse(Protocol):
    """What the views need of the warehouse: its tables and the position they are at."""
    storage: Storage

    def directories(self) -> dict[str, str]:
        """{directory: source table name} of the tables as the position has them."""
        ...

    def table(self, directory: str) -> ReplicaTable: ...

    def versions(self) -> dict[str, int]:
        """{directory: version} of the tables as of the position."""
        ...

    def position(self) -> tuple[str, int] | None:
        """(QUEUE/CONSUMER, tick) the views are brought to; None: the warehouse has none."""
        ...

    def refresh(self) -> None:
        """Reads what was committed since (before an operation of the views)."""
        ...


class ReadWarehouse:
    """The warehouse as the `view` commands see it, beside a consumer that may be writing
    it: the tables at the versions of the position (recorded in _replicator), which a
    batch being committed does not change."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.state = WarehouseState(storage)
        self._tables: dict[str, ReplicaTable] = {}
        self._versions: dict[str, int] | None = None

    def directories(self) -> dict[str, str]:
        return {d: n for d, n in self.state.directories().items() if d in self.versions()}

    def table(self, directory: str) -> ReplicaTable:
        if directory not in self._tables:
            self._tables[directory] = ReplicaTable(self.storage, directory)
        return self._tables[directory]

    def position(self) -> tuple[str, int] | None:
        positions = self.state.positions()
        if not positions:
            return None
        app = consumer_of(self.state, None)
        return app, positions[app]

    def refresh(self) -> None:
        delta_log.refresh(self.storage, self.state.snapshot)
        for table in self._tables.values():
            if delta_log.refresh(self.storage, table.snapshot):
                table.index = None
        self._versions = None

    def versions(self) -> dict[str, int]:
        if self._versions is None:
            position = self.position()
            self._versions = {} if position is None else {
                d: v for d, (_, v) in tick_versions(self.storage, position[1], position[0]).items()}
        return self._versions


class Session:
    """The Spark session of the views: started on first use, or in a background thread
    (the consumer's, which commits batches meanwhile)."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self._factory = factory
        self._spark: Any = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self.started_at = 0.0
        self.seconds = 0.0   # how long it took to start

    def start(self) -> None:
        if self._thread is None and not self._done.is_set():
            self.started_at = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="replicator-views-spark", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            self._spark = self._factory()
        except BaseException as exc:   # reported by get()
            self._error = exc
        finally:
            self.seconds = time.monotonic() - self.started_at
            self._done.set()

    @property
    def ready(self) -> bool:
        return self._done.is_set()

    def get(self, *, wait: bool = True) -> Any:
        """The session (None while it starts, if not wait); raises what starting it raised."""
        if self._thread is None and not self._done.is_set():
            self.started_at = time.monotonic()
            self._run()
        if wait:
            self._done.wait()
        if not self._done.is_set():
            return None
        if self._error is not None:
            raise self._error
        return self._spark


@dataclass
class _Target:
    """What a refresh brings a view to: the tables' versions, and the tick they are of."""
    versions: dict[str, int]
    app: str | None
    tick: int | None


def structure_digest(table: ReplicaTable) -> str:
    """A short digest of a table's structure: a view records it, to tell a schema change."""
    meta = table.meta
    return hashlib.sha1((meta or {}).get("structure", "").encode()).hexdigest()[:16]


class DeltaViews:
    """The views of a Delta warehouse: the `view` commands, and their refresh by the consumer."""

    def __init__(self, warehouse: Warehouse, session: Session) -> None:
        self.warehouse = warehouse
        self.session = session
        self._views: dict[str, ViewTable] = {}           # directory → view table, as discovered
        # the temporary views of the tables this operation registered: name → (location, version);
        # forgotten between operations (another user of the session may register its own)
        self._registered: dict[str, tuple[str, int]] = {}
        self._checked: dict[tuple[str, frozenset[str]], set[str]] = {}   # check_query's answers
        self.captured: dict[str, dict[int, Captured]] = {}   # directory → version → what its commit did
        self._clean: dict[tuple[str, str], int] = {}     # (view, table): versions read to hold no data change

    @property
    def spark(self) -> Any:
        return self.session.get()

    def _begin(self) -> None:
        """The start of an operation: the warehouse as committed now, tables registered anew."""
        self.warehouse.refresh()
        self._registered = {}

    # the views ---------------------------------------------------------------------------

    def discover(self) -> dict[str, ViewTable]:
        """The warehouse's views (listed anew: `view create` may have made one), by directory."""
        found = {}
        for directory in view_directories(self.warehouse.storage):
            vt = self._views.get(directory) or ViewTable(self.warehouse.storage, directory)
            vt.reload()
            if vt.entry is not None:
                found[directory] = vt
        self._views = found
        return found

    def discovered(self) -> builtins.list[ViewTable]:
        return builtins.list(self._views.values())

    def watched(self) -> set[str]:
        """The directories of the tables the views read."""
        return {d for vt in self._views.values() for d in (vt.entry or {}).get("tables", {})}

    def _find(self, name: str) -> ViewTable:
        vt = ViewTable(self.warehouse.storage, view_directory(name))
        if vt.entry is None:
            raise UserError(f"no view {name!r} in the warehouse {self.warehouse.storage.url} "
                            f"(see `replicator view list`)")
        return vt

    # the tables as Spark reads them -----------------------------------------------------

    def _names(self) -> dict[str, str]:
        """The tables' names as views read them (lower case) → source names."""
        out = {}
        for source_name in self.warehouse.directories().values():
            schema, _, bare = source_name.partition(".")
            out[target_table_name(schema, bare).lower()] = source_name
        return out

    def _directory_of(self) -> dict[str, str]:
        return {name: d for d, name in self.warehouse.directories().items()}

    def _catalog(self) -> Callable[[str], TableInfo | None]:
        names, directory_of = self._names(), self._directory_of()

        def lookup(name: str) -> TableInfo | None:
            source_name = names.get(name.lower())
            if source_name is None:
                return None
            table = self.warehouse.table(directory_of[source_name])
            s = table.structure()
            # the columns as Spark reads them: their Delta names (distinct ignoring case, schema.delta_names),
            # each its column's by attnum (another writer may have reordered the fields)
            field_name = {f["metadata"].get(delta_schema.ATTNUM): f["name"] for f in table.schema()["fields"]}
            delta_name = {c.name: field_name.get(c.attnum, c.name) for c in s.columns}   # dropped: Spark says so
            return TableInfo(name=target_table_name(s.schema, s.name),
                             columns=[(delta_name[c.name], c.type) for c in s.columns],
                             key=[delta_name[k] for k in s.key], replicated=True)
        return lookup

    def _location(self, directory: str) -> str:
        """A table's location as Spark (Hadoop) names it: a path, or s3a:// for s3://."""
        root, _ = self.warehouse.storage.delta_rs()
        uri = f"{root}/{directory}"
        return "s3a://" + uri.removeprefix("s3://") if uri.startswith("s3://") else uri

    def _register(self, source_names: set[str], versions: dict[str, int]) -> None:
        """Registers these tables as temporary views of their names, each read at its version
        (time travel: what a batch commits meanwhile does not change them)."""
        directory_of = self._directory_of()
        spark = self.spark
        registered = self._registered
        for source_name in sorted(source_names):
            directory = directory_of[source_name]
            schema, _, bare = source_name.partition(".")
            name = target_table_name(schema, bare)
            wanted = (self._location(directory), versions[directory])
            if registered.get(name) == wanted:
                continue
            spark.read.format("delta").option("versionAsOf", wanted[1]).load(wanted[0]).createOrReplaceTempView(name)
            registered[name] = wanted

    def _check(self, sql: str) -> set[str]:
        """check_query (once per query and set of tables); the source names of the tables it reads."""
        names = self._names()
        tables = frozenset(names)
        if (sql, tables) not in self._checked:
            self._checked[(sql, tables)] = check_query(self.spark, sql, set(tables))
        return {names[n] for n in self._checked[(sql, tables)] if n in names}

    def plan(self, name: str, sql: str, policy: str, versions: dict[str, int]) -> ViewPlan:
        def prepare(sql: str) -> None:
            self._register(self._check(sql), versions)
        return plan_view(self.spark, name, sql, policy, self._catalog(), self._names(), prepare)

    # the view commands -------------------------------------------------------------------

    def create(self, name: str, sql: str, policy: str = "auto") -> dict[str, Any]:
        check_name(name)
        check_policy(policy)
        self._begin()
        position = self.warehouse.position()
        if position is None:
            raise UserError(f"{self.warehouse.storage.url} holds no table yet: views are defined over the tables "
                            f"`replicator consume` replicates into it")
        if name.lower() in self._names():
            raise UserError(f"the warehouse already has a table named {name!r}")
        # a view's table is of the warehouse's kind (its tables are all of one: DeltaTarget)
        portable = any(self.warehouse.table(d).portable for d in self.warehouse.directories())
        vt = ViewTable(self.warehouse.storage, view_directory(name), portable=portable)
        if vt.entry is not None:
            raise UserError(f"view {vt.entry['name']!r} exists: drop it first (`replicator view drop {name}`)")
        target = _Target(self.warehouse.versions(), *position)
        plan = self.plan(name, sql, policy, target.versions)
        if policy == "incremental" and plan.mode != "incremental":
            assert plan.reason is not None
            raise UserError(f"view {name} cannot be maintained incrementally: {plan.reason.code}: "
                            f"{plan.reason.message} (at: {plan.reason.fragment}); "
                            f"use --policy auto to refresh it in full")
        reserved = [c for c in plan.columns if c.lower().startswith("_replicator")]
        if reserved:
            raise UserError(f"the view's column {reserved[0]}: names starting with _replicator are reserved: "
                            f"alias it")
        entry: dict[str, Any] = {"name": name, "sql": plan.sql, "policy": policy, "created_at": now(), "seq": 0,
                                 "refreshes": [], "status": "ok", "status_reason": None, "tables": {}, "ticks": {}}
        apply_plan(entry, plan)
        try:
            with self._committing(vt):
                self._full(vt, entry, plan, target, "CREATE", time.perf_counter())
        except delta_log.CommitUnknown as exc:   # its commit may have landed: never "not created"
            raise UserError(f"view {name} may have been created (the warehouse's storage failed: "
                            f"{exc.reason}): `replicator view list` tells") from None
        except UserError:
            raise
        except delta_log.CommitConflict:
            raise UserError(f"view {name} not created: another `view create {name}` made it meanwhile") from None
        except Exception as exc:   # the query analyses but fails on the rows (ANSI overflow, raise_error...)
            raise UserError(f"view {name} not created: its query fails on the warehouse: "
                            f"{spark_error_line(exc)}") from None
        return self.info(name)

    def drop(self, name: str) -> None:
        self._begin()
        vt = self._find(name)
        for _ in range(COMMIT_ATTEMPTS):
            vt.table.drop()
            try:
                vt.table.commit(None, None, retry=False)
                return
            except delta_log.CommitConflict:
                vt.table.rollback()
                vt.reload()
                if vt.entry is None:
                    return
        raise UserError(f"view {name} not dropped: its table was changed meanwhile, {COMMIT_ATTEMPTS} times")

    def refresh_now(self, name: str, *, full: bool = False) -> tuple[dict[str, Any], bool]:
        """Recomputes a view that needs it (stale, maintained in full, behind the tables),
        or any view with full. Returns its state and whether it was recomputed."""
        self._begin()
        vt = self._find(name)
        entry = vt.entry
        assert entry is not None
        position = self.warehouse.position()
        assert position is not None
        target = _Target(self.warehouse.versions(), *position)
        behind = self._behind(vt, target.versions)
        if not (full or entry["status"] != "ok" or entry["maintenance"] == "full" or behind):
            return self.info(entry["name"]), False
        plan = self.plan(entry["name"], entry["sql"], entry["policy"], target.versions)
        if plan.columns != entry["columns"] and entry["status"] == "ok":
            raise UserError(f"view {entry['name']} now gives other columns: drop it and create it again")
        for _ in range(COMMIT_ATTEMPTS):
            entry = dict(entry)
            apply_plan(entry, plan)
            entry["status"], entry["status_reason"] = "ok", None
            try:
                with self._committing(vt):
                    self._full(vt, entry, plan, target, "MANUAL" if full or not behind else "CATCH_UP",
                               time.perf_counter())
                return self.info(entry["name"]), True
            except delta_log.CommitConflict:   # the consumer refreshed it meanwhile: over its commit
                vt.reload()
                if vt.entry is None:
                    raise UserError(f"view {name} was dropped meanwhile") from None
                entry = vt.entry
        raise UserError(f"view {name} not refreshed: its table was changed meanwhile, {COMMIT_ATTEMPTS} times")

    def info(self, name: str) -> dict[str, Any]:
        self._begin()
        return self._describe(self._find(name))

    # the method shadows the builtin in the class body: signatures below say builtins.list
    def list(self) -> builtins.list[dict[str, Any]]:
        self._begin()
        return sorted((self._describe(vt) for vt in self.discover().values()), key=lambda v: v["view"])

    def refreshes(self, name: str, limit: int = 20) -> builtins.list[dict[str, Any]]:
        entry = self._find(name).entry
        assert entry is not None
        return builtins.list(reversed(entry["refreshes"][-limit:]))

    def explain(self, sql: str, policy: str = "auto") -> dict[str, Any]:
        """What create would do with this SQL, without doing it."""
        check_policy(policy)
        self._begin()
        plan = self.plan("explain", sql, policy, self.warehouse.versions())
        out = plan.describe()
        out["statements"] = {"full": plan.select()}
        if plan.mode == "incremental":
            out["statements"]["incremental"] = [plan.select(semi=("<keys>", "..."))]
        if policy == "incremental" and plan.mode != "incremental":
            out["maintenance"] = "refused"
        return out

    def _describe(self, vt: ViewTable) -> dict[str, Any]:
        entry = vt.entry
        assert entry is not None
        reason = entry["reason"]
        last = entry["refreshes"][-1] if entry["refreshes"] else None
        root, _ = self.warehouse.storage.delta_rs()
        ticks = entry.get("ticks") or {}
        return {"view": entry["name"], "policy": entry["policy"], "maintenance": entry["maintenance"],
                "status": entry["status"], "status_reason": entry["status_reason"], "rows": vt.rows(),
                "reason": reason["code"] if reason else None,
                "reason_message": reason["message"] if reason else None,
                "fragment": reason["fragment"] if reason else None,
                "last_refresh": dict(last) if last else None, "sql": entry["sql"],
                "uri": f"{root}/{vt.directory}", "version": vt.table.snapshot.version,
                "tick": max(ticks.values()) if ticks else None,
                "behind": self._behind(vt, self.warehouse.versions())}

    def _behind(self, vt: ViewTable, versions: dict[str, int]) -> bool:
        """Whether a table the view reads changed data after the version it records (and up
        to these versions: those of the position)."""
        entry = vt.entry
        assert entry is not None
        for directory, recorded in entry["tables"].items():
            if directory not in versions:
                return True   # dropped since: the view is refreshed (or goes stale) when the consumer sees it
            if versions[directory] <= recorded["version"]:
                continue   # the view holds these versions (or later ones, of the batch being committed)
            changes = changes_since(self.warehouse.table(directory), recorded["version"], {}, versions[directory])
            if changes is None or not changes.empty:
                return True
        return False

    # refresh after a batch -----------------------------------------------------------------

    def catch_up(self, app: str, tick: int) -> None:
        """Brings every view up to the tables as they are (the consumer's, after it committed
        tick `tick`): each refresh commits on its own; a view whose refresh fails is marked
        stale with the reason, and the others go on."""
        self._begin()
        versions = self.warehouse.versions()
        for vt in builtins.list(self._views.values()):
            try:
                self._catch_up(vt, _Target(versions, app, tick))
            except delta_log.CommitUnknown as exc:   # the refresh may have landed: the next reload tells
                log.warning("view %s: whether its refresh was committed is not known (the warehouse's storage "
                            "failed: %s): the next batch reads its table again", vt.directory,
                            exc.reason)
            except Exception as exc:   # Spark failed on it, its query no longer runs...: the others go on
                why = spark_error_line(exc)
                try:
                    entry = vt.entry
                    if entry is not None:
                        self._stale(vt, dict(entry), f"REFRESH_FAILED: {why}")
                except Exception as again:   # its table cannot be written: it stays behind
                    vt.table.rollback()
                    log.warning("view %s: refresh failed, it stays behind the tables: %s (%s)", vt.directory,
                                why, spark_error_line(again))
        self._forget_captures()

    def _catch_up(self, vt: ViewTable, target: _Target) -> None:
        for _ in range(COMMIT_ATTEMPTS):
            vt.reload()
            entry = vt.entry
            if entry is None:   # dropped
                self._views.pop(vt.directory, None)
                return
            if entry["status"] != "ok":
                return
            try:
                with self._committing(vt):
                    self._refresh(vt, dict(entry), target)
                return
            except delta_log.CommitConflict:
                continue   # `view refresh` or `view drop` committed meanwhile: from its commit again

    @contextmanager
    def _committing(self, vt: ViewTable) -> Iterator[None]:
        """A view's refresh: what it staged is rolled back if it fails."""
        try:
            yield
        except BaseException:
            vt.table.rollback()
            raise

    def _refresh(self, vt: ViewTable, entry: dict[str, Any], target: _Target) -> None:
        """Brings one view to the target versions, incrementally when it can."""
        directories = self.warehouse.directories()
        recorded = entry["tables"]
        changed_structure = any(d not in directories or directories[d] != r["name"]
                                or structure_digest(self.warehouse.table(d)) != r["structure"]
                                for d, r in recorded.items())
        moved = {d for d, r in recorded.items() if d in target.versions and target.versions[d] != r["version"]
                 and target.versions[d] > self._clean.get((vt.directory, d), -1)}
        if not changed_structure and not moved:
            return
        started = time.perf_counter()
        if changed_structure:
            plan = self._revalidate(vt, entry, target)
            if plan is not None:
                self._full(vt, entry, plan, target, "SCHEMA_CHANGE", started)
            return
        changes: dict[str, TableChanges | None] = {
            d: changes_since(self.warehouse.table(d), recorded[d]["version"], self.captured.get(d, {}))
            for d in moved}
        if all(c is not None and c.empty for c in changes.values()):
            for d in moved:   # OPTIMIZE only: nothing to refresh
                self._clean[(vt.directory, d)] = target.versions[d]
            return
        plan = stored_plan(entry["name"], entry, self._catalog(), self._check)
        why = None
        if any(c is None for c in changes.values()):
            why = "CATCH_UP: the tables' logs no longer hold the changes since the view's versions"
        elif any(c is not None and c.replaced for c in changes.values()):
            why = "TABLE_REPLACED"
        elif plan.mode != "incremental":
            why = (entry["reason"] or {}).get("code") or "FULL"
        else:
            why = cost_says_full(entry, plan)
        if why is not None:
            self._full(vt, entry, plan, target, why, started)
            return
        known = {d: c for d, c in changes.items() if c is not None}
        refresher = Refresher(self.spark, plan, entry, vt, self.warehouse, known,
                              lambda names: self._register(names, target.versions))
        done = refresher.run()
        if done.full is not None:
            self._full(vt, entry, plan, target, done.full, started)
            return
        record = record_refresh(entry, done.kind, "", time.perf_counter() - started, keys=done.keys,
                                deleted=done.deleted, inserted=done.inserted, updated=done.updated,
                                keep=KEEP_REFRESHES)
        self._commit(vt, entry, target, record, vt.table.structure())

    def _revalidate(self, vt: ViewTable, entry: dict[str, Any], target: _Target) -> ViewPlan | None:
        """After a schema change of its tables: the view's plan now, or None when it must be
        rebuilt (marked stale, with why: committed)."""
        try:
            plan = self.plan(entry["name"], entry["sql"], entry["policy"], target.versions)
        except UserError as exc:
            self._stale(vt, entry, f"SCHEMA_CHANGE: {exc}")
            return None
        if plan.columns != entry["columns"]:
            self._stale(vt, entry, f"SCHEMA_CHANGE: the query now gives columns {', '.join(plan.columns)}: drop the "
                                   f"view and create it again")
            return None
        apply_plan(entry, plan)
        return plan

    def _stale(self, vt: ViewTable, entry: dict[str, Any], why: str) -> None:
        log.warning("view %s is stale: %s", entry["name"], why)
        entry["status"], entry["status_reason"] = "stale", why
        vt.table.set_meta(vt.meta(entry, vt.table.structure()))
        vt.table.commit(None, None, retry=False)

    # full refresh ------------------------------------------------------------------------------

    def _full(self, vt: ViewTable, entry: dict[str, Any], plan: ViewPlan, target: _Target, reason: str,
              started: float) -> None:
        """Recomputes all of the view: Spark writes its rows as files of the view's table,
        committed as its new version."""
        spark = self.spark
        deps = set(plan.deps)
        self._register(deps, target.versions)
        frame = spark.sql(plan.select()).toDF(*plan.key_columns, *plan.columns)
        homes = plan.key_homes()
        hidden = [k for k, home in zip(plan.key_columns, homes) if home is None]
        stored_keys = [k if home is None else plan.columns[home] for k, home in zip(plan.key_columns, homes)]
        columns = [*plan.columns, *hidden]
        types = {f.name: f.dataType for f in frame.schema.fields}
        structure = view_structure(entry["name"], [(c, _delta_type(c, types[c])) for c in columns], stored_keys)
        entry["stored_keys"] = stored_keys
        old_rows = vt.rows() if vt.entry is not None else 0
        vt.table.reset(vt.meta(entry, structure), structure)
        fields = vt.table.schema()["fields"]
        physical = [delta_schema.physical_name(f) for f in fields]
        prefix = f"full-{uuid.uuid4()}"
        self._write(frame.select(*columns).toDF(*physical), f"{vt.directory}/{prefix}")
        adds = self._written(vt.directory, prefix)
        vt.table.add_files(adds)
        rows = sum(records(a) or 0 for a in adds.values())
        entry["tables"] = self._recorded(deps, target.versions)
        record = record_refresh(entry, "full", reason, time.perf_counter() - started, keys=None, deleted=old_rows,
                                inserted=rows, updated=0, keep=KEEP_REFRESHES)
        self._commit(vt, entry, target, record, structure)

    def _write(self, frame: Any, directory: str) -> None:
        """Spark writes a frame as Parquet files under a directory of the warehouse
        (timestamps as microseconds, which every Delta reader reads; not INT96)."""
        spark = self.spark
        key = "spark.sql.parquet.outputTimestampType"
        before = spark.conf.get(key, None)
        spark.conf.set(key, "TIMESTAMP_MICROS")
        try:
            frame.write.parquet(self._location(directory))
        except BaseException:
            for entry in self.warehouse.storage.list(directory):
                self.warehouse.storage.delete(entry.path)
            raise
        finally:
            if before is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, before)

    def _written(self, directory: str, prefix: str) -> dict[str, Add]:
        """The data files Spark wrote under directory/prefix, as add actions (relative to the
        table); what else it left (_SUCCESS, checksums, empty files) is deleted."""
        storage = self.warehouse.storage
        adds: dict[str, Add] = {}
        for entry in storage.list(f"{directory}/{prefix}"):
            name = entry.path.rsplit("/", 1)[-1]
            rows = 0
            if name.startswith("part-") and name.endswith(".parquet"):
                with storage.open_read(entry.path) as f:
                    rows = pq.ParquetFile(f).metadata.num_rows
            if not rows:
                storage.delete(entry.path)
                continue
            path = entry.path[len(directory) + 1:]
            adds[path] = {"path": path, "partitionValues": {}, "size": entry.size,
                          "modificationTime": delta_log.now_ms(), "dataChange": True,
                          "stats": delta_log.json_text({"numRecords": rows})}
        return adds

    def _recorded(self, deps: set[str], versions: dict[str, int]) -> dict[str, dict[str, Any]]:
        """What a view records of the tables it reads: their names, versions and structures."""
        directory_of = self._directory_of()
        return {directory_of[name]: {"name": name, "version": versions[directory_of[name]],
                                     "structure": structure_digest(self.warehouse.table(directory_of[name]))}
                for name in sorted(deps)}

    def _commit(self, vt: ViewTable, entry: dict[str, Any], target: _Target, record: dict[str, Any],
                structure: TableStructure) -> None:
        """Commits a refresh: the rows it staged and the view's record, with the transaction id
        (QUEUE/CONSUMER, tick) of the versions it brought the view to."""
        if target.app is not None and target.tick is not None:
            entry["ticks"] = {**entry.get("ticks", {}), target.app: target.tick}
        for directory, recorded in entry["tables"].items():
            if directory in target.versions:
                recorded["version"] = target.versions[directory]
        vt.table.set_meta(vt.meta(entry, structure))
        vt.table.commit(target.app, target.tick, retry=False, parameters={"refresh": json.dumps(record)})
        for directory in entry["tables"]:
            self._clean.pop((vt.directory, directory), None)
        self._maintain(vt)

    def _maintain(self, vt: ViewTable) -> None:
        """OPTIMIZE of a view's table once its refreshes left many small files or many deleted rows."""
        try:
            if maintenance.due(vt.table):
                maintenance.optimize_table(vt.table)
        except Exception as exc:   # costs only speed
            log.warning("optimize of view %s failed: %s", vt.directory, spark_error_line(exc))

    # captures -----------------------------------------------------------------------------------

    def capture(self, table: ReplicaTable) -> None:
        """Keeps what the table's commits do from now on (it is read by a view)."""
        if table.captures is None:
            table.captures = []

    def take_captures(self, tables: dict[str, ReplicaTable]) -> None:
        """Moves what the tables' last commits did into the views' keeping (by version)."""
        for directory, table in tables.items():
            if table.captures:
                kept = self.captured.setdefault(directory, {})
                for capture in table.captures:
                    kept[capture.version] = capture
                table.captures = []
                if sum(k.num_rows for c in kept.values() for k in c.keys) > CAPTURE_MAX_KEYS:
                    kept.clear()   # the views behind read those commits from the log instead

    def _forget_captures(self) -> None:
        """Drops what every view reading a table holds already."""
        for directory, kept in self.captured.items():
            held = [vt.entry["tables"][directory]["version"] for vt in self._views.values()
                    if vt.entry is not None and directory in vt.entry["tables"]]
            floor = min(held) if held else None
            for version in [v for v in kept if floor is None or v <= floor]:
                del kept[version]


def _delta_type(column: str, spark_type: Any) -> str:
    """The Delta type of a view's column (Spark's type); UserError for a type a view's table
    does not hold."""
    from pyspark.sql import types as T

    if isinstance(spark_type, (T.CharType, T.VarcharType)):
        return "string"
    name = spark_type.jsonValue()
    if isinstance(name, str) and delta_schema.arrow_type_of(name) is not None:
        return name
    raise UserError(f"the view's column {column} has type {spark_type.simpleString()}, which a view's Delta table "
                    f"does not hold: cast it (CAST({column} AS STRING), or a number, date or timestamp)")

