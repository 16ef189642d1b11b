"""SqliteViews: the views of one SQLite target, on the target's connection. The ViewStore of
replicator/views/protocol.py (create, drop, list, info, refreshes, explain, refresh_now: each call
a transaction of its own), and the hooks SqliteTarget calls in its transactions: begun loads the
views (again when another connection changed them) and installs the capture, note_write,
table_truncated and schema_changing note what the batch does, before_commit refreshes the views
just before the batch's COMMIT, rolled_back forgets the transaction.

A schema change of a base table drops that table's triggers; at commit the dependent views are
planned again and refreshed in full, or marked stale with the reason (``replicator view list``)
and left as they were. A refresh that fails marks its view stale: one broken view never stops
replication."""

from __future__ import annotations

import builtins
import json
import logging
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from replicator.errors import UserError
from replicator.targets.sqlite.views import catalog, statements, storage
from replicator.targets.sqlite.views.capture import Capture
from replicator.targets.sqlite.views.names import STORAGE_PREFIX
from replicator.targets.sqlite.views.plan import Plan, check_reads_not_itself, in_dependency_order
from replicator.targets.sqlite.views.planner import make_temp_tables, plan_view
from replicator.targets.sqlite.views.refresh import Refresher, Savepoint, grow_page_cache
from replicator.targets.sqlite.views.sql import quote
from replicator.targets.sqlite.views.tables import ReplicaTables
from replicator.views.analysis import TableInfo
from replicator.views.protocol import check_name, check_policy

log = logging.getLogger("replicator")
NOT_READ = -1   # a data_version SQLite never gives: the next begin compares the catalog's fingerprint


def _columns_changed(plan: Plan, stored: str | None) -> bool:
    """Whether the query no longer gives the columns the view was planned with."""
    planned: builtins.list[builtins.list[str]] = json.loads(stored or "[]")
    return [list(c) for c in plan.columns] != planned


class SqliteViews:
    """The views of one SQLite target, maintained on the target's connection."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self.capture = Capture(db)
        self.refresher = Refresher(db, self.capture)
        self.plans: list[Plan] = []               # in refresh order (a view after the views it reads)
        # (data_version, catalog fingerprint) of the plans held; None: they may not be the catalog's
        self._loaded: tuple[int, str | None] | None = None
        self._forced: dict[str, str] = {}         # view -> why it is refreshed in full at commit
        self._revalidate: dict[str, str] = {}     # view -> the schema change that calls for it

    @property
    def active(self) -> bool:
        """Whether there is any view: writes are noted."""
        return bool(self.plans)

    # hooks called by SqliteTarget -------------------------------------------------------

    def begun(self) -> None:
        """In a new write transaction: picks up definitions other processes
        changed, installs the capture triggers."""
        version: int = self.db.execute("PRAGMA data_version").fetchone()[0]
        if self._loaded is None or version != self._loaded[0]:
            fingerprint = catalog.fingerprint(self.db)
            if self._loaded is None or fingerprint != self._loaded[1]:
                self._load()
            elif self._loaded[0] == NOT_READ:   # a rollback took back the TEMP tables its transaction made
                for plan in self._incremental():
                    make_temp_tables(self.db, self.capture, plan)
            self._loaded = (version, fingerprint)
            # a view to check again gets its indexes when it is installed
            storage.restore_indexes(self.db, [p for p in self._incremental() if p.name not in self._revalidate])
        if self.active:
            self.capture.arm(t for p in self._incremental() for t in p.tables)

    def _incremental(self) -> builtins.list[Plan]:
        """The plans maintained from captured changes: valid, incremental."""
        return [p for p in self.plans if p.status == "ok" and p.mode == "incremental"]

    def note_write(self, table: str) -> None:
        if self.active:
            self.capture.wrote(table)

    def table_truncated(self, table: str) -> None:
        """Before DELETE FROM table: its dependents are refreshed in full (no capture of every row)."""
        if not self.active:
            return
        self.capture.bypass(table)
        low = table.lower()
        for plan in self.plans:
            if low in plan.deps:
                self._forced.setdefault(plan.name, "TRUNCATE")

    def schema_changing(self, table: str, dropping: tuple[str, ...] = ()) -> None:
        """Before a DDL on table (re-create, drop, alter): removes the triggers
        and helper indexes that would block or outlive it; the dependent views
        are checked again at commit."""
        if not catalog.exists(self.db):
            return
        self.capture.bypass(table)
        if dropping:
            storage.drop_helper_indexes_on(self.db, table, dropping)
        low = table.lower()
        for name, deps in catalog.stored_deps(self.db).items():
            if low in deps:
                self._revalidate.setdefault(name, f"schema change of {table}")

    def before_commit(self) -> None:
        """Refreshes the views from this transaction's changes."""
        try:
            if self._revalidate:
                for name, why in list(self._revalidate.items()):
                    self._revalidate_view(name, why)
            if self.capture.written or self._forced:
                changed = set(self.capture.written)
                for plan in self.plans:
                    forced = self._forced.get(plan.name)
                    if plan.status != "ok" or (forced is None and not (plan.deps & changed)):
                        continue
                    if self._refresh_or_mark_stale(plan, forced):
                        changed.add(plan.storage.lower())
            self.capture.empty_deltas()
        finally:
            self.capture.forget_writes()
            self._forced.clear()
            self._revalidate.clear()

    def rolled_back(self) -> None:
        """Temp objects created or dropped in the transaction are back as they were: look again.
        The plans are kept unless the transaction changed them or had views to check again (a
        batch retried after a failure would otherwise plan every view anew)."""
        self.capture.rolled_back()
        self._forced.clear()
        if self._loaded is not None and not self._revalidate:
            self._loaded = (NOT_READ, self._loaded[1])   # the catalog's fingerprint decides at the next begin
        else:
            self._loaded = None
        self._revalidate.clear()

    def force_full(self, name: str, why: str) -> None:
        """Refreshes view `name` in full at this transaction's commit."""
        self._forced[name] = why

    # loading and planning ----------------------------------------------------------------

    def table_info(self, name: str) -> TableInfo | None:
        """A table of the replica as the analysis sees it."""
        return ReplicaTables(self.db).info(name)

    def _plan(self, name: str, sql: str, policy: str) -> Plan:
        return plan_view(self.db, self.capture, name, sql, policy)

    def _load(self) -> None:
        self.plans = []
        if not catalog.exists(self.db):
            return
        plans = []
        for name, sql, policy, status, columns in catalog.definitions(self.db):
            if status != "ok":
                plans.append(Plan.unplanned(name, sql, policy, status))
                continue
            try:
                plan = self._plan(name, sql, policy)
            except UserError as exc:
                self._revalidate.setdefault(name, str(exc))
                plans.append(Plan.unplanned(name, sql, policy, "stale"))
                continue
            if plan.policy == "incremental" and plan.mode != "incremental":
                self._revalidate.setdefault(name, "new reading of the view's query (by another version "
                                                  "of replicator than the one that created it)")
            elif _columns_changed(plan, columns):
                self._revalidate.setdefault(name, "the view's query no longer gives the same columns")
            elif storage.layout(self.db, plan) != plan.storage_columns():
                # made by another version (e.g. without the state of folded aggregates)
                self._revalidate.setdefault(name, "a new storage layout")
            plans.append(plan)
        self.plans = in_dependency_order(plans)
        if self.active:
            grow_page_cache(self.db)

    def _revalidate_view(self, name: str, why: str) -> str | None:
        """Plans a view again after a schema change: installs it and schedules a
        full refresh, or marks it stale. Returns the error, if any."""
        row = catalog.definition(self.db, name)
        if row is None:
            return None
        sql, policy, columns, status = row
        old = next((p for p in self.plans if p.name == name), None)
        self.db.execute("SAVEPOINT replicator_view")
        try:
            plan = self._plan(name, sql, policy)
            if policy == "incremental" and plan.mode != "incremental":
                raise UserError("it can no longer be maintained incrementally:"
                                f" {plan.reason.code if plan.reason else ''}"
                                f" {plan.reason.message if plan.reason else ''}")
            self._install(plan, rebuild=_columns_changed(plan, columns)
                          or old is None or old.key_columns != plan.key_columns or old.mode != plan.mode
                          or storage.layout(self.db, plan) != plan.storage_columns())
        except (UserError, sqlite3.Error) as exc:
            self.db.execute("ROLLBACK TO replicator_view")
            self.db.execute("RELEASE replicator_view")
            if status == "ok":
                log.warning("view %s is stale after a %s: %s", name, why, exc)
                self._mark_stale(old or Plan.unplanned(name, sql, policy),
                                 f"SCHEMA_CHANGE: {why}: {exc}; rebuild it (view drop, view create)"
                                 f" or run view refresh once the query runs again")
            return str(exc)
        self.db.execute("RELEASE replicator_view")
        self._forced[name] = "SCHEMA_CHANGE"
        self.plans = in_dependency_order([p for p in self.plans if p.name != name] + [plan])
        self._loaded = None   # re-arm at the next transaction
        return None

    def _install(self, plan: Plan, *, rebuild: bool) -> None:
        """Records a (re)validated plan: storage, indexes, catalog row."""
        if rebuild:
            storage.create(self.db, plan)
        storage.ensure_helper_indexes(self.db, plan)
        catalog.set_plan(self.db, plan)

    # refresh -------------------------------------------------------------------------------

    def _refresh_or_mark_stale(self, plan: Plan, forced: str | None) -> bool:
        """Refreshes one view: a view that fails is marked stale, the batch goes on (see
        Savepoint). Returns whether its rows changed."""
        savepoint = Savepoint(self.db)
        try:
            changed = self.refresher.refresh(plan, full_reason=forced, savepoint=savepoint)
        except sqlite3.Error as exc:
            if savepoint.copying:
                raise
            savepoint.undo()
            log.warning("view %s: refresh failed, the view is stale: %s", plan.name, exc)
            self._mark_stale(plan, f"REFRESH_FAILED: {exc}")
            return False
        savepoint.release()
        return changed

    def _mark_stale(self, plan: Plan, why: str) -> None:
        plan.status = "stale"
        catalog.mark_stale(self.db, plan.name, why)
        self._loaded = None

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

    def create(self, name: str, sql: str, policy: str = "auto") -> dict[str, Any]:
        check_name(name)
        check_policy(policy)
        try:
            self._create(name, sql, policy)
        except sqlite3.Error as exc:   # the query prepares but fails on the rows (an overflow, bad JSON...)
            raise UserError(f"view {name} not created: its query fails on the target: {exc}") from None
        grow_page_cache(self.db)
        return self.info(name)

    def _create(self, name: str, sql: str, policy: str) -> None:
        with self._transaction():
            catalog.ensure(self.db)
            if catalog.has(self.db, name):
                raise UserError(f"view {name!r} exists: drop it first (`replicator view drop {name}`)")
            if self.db.execute("SELECT 1 FROM main.sqlite_master WHERE name = ? COLLATE NOCASE",
                               (name,)).fetchone():
                raise UserError(f"the target already has a table, view or index named {name!r}")
            plan = self._plan(name, sql, policy)
            if policy == "incremental" and plan.mode != "incremental":
                assert plan.reason is not None
                raise UserError(f"view {name} cannot be maintained incrementally: {plan.reason.code}: "
                                f"{plan.reason.message} (at: {plan.reason.fragment}); "
                                f"use --policy auto to refresh it in full")
            check_reads_not_itself(plan, self.plans)
            catalog.add(self.db, plan)
            self._install(plan, rebuild=True)
            self.refresher.refresh(plan, full_reason="CREATE")
            self.plans = in_dependency_order([*self.plans, plan])
            # the plans held are the catalog's again: the next transaction need not plan every view
            # anew (n views created on one connection would cost n² plannings)
            if self._loaded is not None:
                self._loaded = (self._loaded[0], catalog.fingerprint(self.db))

    def drop(self, name: str) -> None:
        with self._transaction():
            real = catalog.find(self.db, name)[0]
            plan = next((p for p in self.plans if p.name == real), None)
            storage_table = (STORAGE_PREFIX + real).lower()
            readers = [p.name for p in self.plans if p.name != real and storage_table in p.deps]
            if readers:
                raise UserError(f"view {real} is read by view(s) {', '.join(readers)}: drop them first")
            storage.drop(self.db, real)
            catalog.remove(self.db, real)
            if plan is not None:
                self.db.execute(f"DROP TABLE IF EXISTS temp.{quote(plan.keys_table)}")
            self.plans = [p for p in self.plans if p.name != real]
            storage.drop_unused_helper_indexes(self.db, self.plans)
            self._loaded = None

    def refresh_now(self, name: str, *, full: bool = False) -> tuple[dict[str, Any], bool]:
        """Recomputes a view when it needs it (stale after a schema change, or
        maintained in full) or when asked to (full). Returns its state and
        whether it was recomputed."""
        with self._transaction():
            real, _sql, _policy, status = catalog.find(self.db, name)
            if status != "ok":
                error = self._revalidate_view(real, "view refresh")
                if error is not None:
                    raise UserError(f"view {real} cannot be refreshed: {error}")
            plan = next(p for p in self.plans if p.name == real)
            recompute = full or plan.mode == "full" or real in self._forced
            if recompute:
                self.force_full(real, "MANUAL")
        return self.info(real), recompute

    def info(self, name: str) -> dict[str, Any]:
        found = next((v for v in self.list() if v["view"].lower() == name.lower()), None)
        if found is None:
            raise UserError(f"no view {name!r} in this target (see `replicator view list`)")
        return found

    def list(self) -> builtins.list[dict[str, Any]]:
        return catalog.views(self.db)

    def refreshes(self, name: str, limit: int = 20) -> builtins.list[dict[str, Any]]:
        return catalog.refreshes(self.db, catalog.find(self.db, name)[0], limit)

    def explain(self, sql: str, policy: str = "auto") -> dict[str, Any]:
        """What create would do with this SQL, without doing it."""
        check_policy(policy)
        self.db.execute("BEGIN")
        try:
            plan = self._plan("explain", sql, policy)
            out = plan.describe()
            del out["view"]
            out["statements"] = self._explain_statements(plan)
        finally:
            self.db.execute("ROLLBACK")
            self.rolled_back()
        if policy == "incremental" and plan.mode != "incremental":
            out["maintenance"] = "refused"
        return out

    @staticmethod
    def _explain_statements(plan: Plan) -> dict[str, Any]:
        if plan.mode != "incremental" or plan.analysis is None:
            return {"full": plan.full_insert}
        every = set(range(len(plan.analysis.occurrences)))
        return {"full": plan.full_insert, "incremental": statements.statements(plan, every)}
