"""Delta target: every replicated table a Delta Lake table, on a local path or object storage.

``--target delta:URI`` keeps, under URI, one Delta table per replicated table
(``URI/<schema>.<table>``) that Spark (``spark.read.format("delta")``) and
delta-rs read as they are, and the warehouse's own table ``URI/_replicator``
(replicator.targets.delta.state) with the consumer positions and the versions
each tick left. ``delta:URI?tables=portable`` makes a warehouse whose tables
have no deletion vectors and no column mapping (copy-on-write:
replicator.targets.delta.rewrite), for the readers without them (Polars,
delta-rs' to_pyarrow_table); a warehouse keeps the kind it was created with.

No JVM: the consumer writes Parquet files, deletion vectors and the Delta log
itself (replicator.targets.delta.table). A batch is one commit per table it
changed, each with the transaction id (consumer, tick), then one commit of
``_replicator`` that moves the position. A crash between them leaves tables
that hold the batch and a position before it: the batch is applied again, and
the tables that hold it skip it.

One consumer process writes a local warehouse at a time (a lock file). On
object storage, commits are conditional writes: a second writer loses its
commit and never overwrites one; a second consumer (no lock file there keeps
it out) stops in one line at the first commit of the other's it finds, and
other writers' commits (a user's DELETE or OPTIMIZE) are taken in.

Views (replicator.targets.delta.views) are refreshed after the commit, each with
a commit of its own: Spark, which computes them, is started in a background
thread when the warehouse has views, and never delays a batch's tables or
position; a view behind them catches up at a later commit.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
import re
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from replicator.errors import UserError, first_line
from replicator.source import format_duration
from replicator.source.monitoring import Every
from replicator.structure import Change, TableStructure
from replicator.targets.crash import crash_point
from replicator.targets.delta import log as delta_log
from replicator.targets.delta import maintenance
from replicator.targets.delta.state import DIRECTORY as STATE_DIRECTORY
from replicator.targets.delta.state import FORGOTTEN, WarehouseState
from replicator.targets.delta.storage import LocalStorage, Storage, recorded_directory
from replicator.targets.delta.table import ReplicaTable
from replicator.targets.delta.url import TABLES_OPTION, open_storage, parse_url
from replicator.targets.delta.view_table import view_directories
from replicator.targets.protocol import OldRows, Row, TargetTable, queue_positions
from replicator.wording import counted

if TYPE_CHECKING:
    from replicator.targets.delta.views import DeltaViews

log = logging.getLogger("replicator")

LOCK = ".replicator.lock"   # local warehouses: held by the consumer writing it (a dot file: readers skip it)
VIEWS_DISCOVER_SECONDS = 30.0   # how often the consumer looks for views created (or dropped) meanwhile


def table_meta(table: TargetTable) -> dict[str, Any]:
    return {"source_name": table.source_name, "table_id": table.table_id, "mode": table.mode,
            "structure": table.structure.to_json(), "copy_snapshot": table.copy_snapshot}


def target_table(meta: dict[str, Any]) -> TargetTable:
    return TargetTable(source_name=meta["source_name"], table_id=meta["table_id"], mode=meta["mode"],
                       structure=TableStructure.from_json(meta["structure"]), copy_snapshot=meta["copy_snapshot"])


def directory_name(source_name: str) -> str:
    """A new table's directory: its schema-qualified name, characters other than letters, digits,
    '.', '_' and '-' replaced (object stores and Hadoop paths take these as they are). A name
    starting with '.' or '_' gets the prefix 'table-': readers (Spark, Delta, Hadoop) skip such
    directories as hidden, and every entry of replicator's own (_replicator, _views, the lock
    file, a table's _delta_log) starts so, as do '.' and '..': no table takes one, or leaves the
    warehouse. Storage refuses a path out of it all the same."""
    name = re.sub(r"[^\w.-]", "_", source_name)[:120]
    return name if name and not name.startswith((".", "_")) else f"table-{name}"


class _Tables:
    """The consumer's warehouse as its views see it (replicator.targets.delta.views.Warehouse):
    the tables as the consumer committed them."""

    def __init__(self, target: DeltaTarget) -> None:
        self.target = target
        self.storage = target.storage

    def directories(self) -> dict[str, str]:
        return self.target.state.directories()

    def table(self, directory: str) -> ReplicaTable:
        return self.target._open(directory)

    def versions(self) -> dict[str, int]:
        return {d: self.table(d).snapshot.version for d in self.directories()}

    def position(self) -> tuple[str, int] | None:
        return self.target._last

    def refresh(self) -> None:
        """Nothing to read: the consumer's tables are as it committed them."""


class DeltaTarget:
    exactly_once = True
    copies_renamed_tables = False
    copies_over_rows = False

    def __init__(self, url: str, *, spark_master: str | None = None, spark_conf: dict[str, str] | None = None,
                 session: Callable[[], Any] | None = None, vacuum_every: float | None = None) -> None:
        url, self.portable = parse_url(url)
        self.storage: Storage = open_storage(url)
        self.name = f"delta:{self.storage.url}{TABLES_OPTION + 'portable' if self.portable else ''}"
        self._lock_fd = -1
        try:
            if isinstance(self.storage, LocalStorage):
                self._lock_local(self.storage.root)
            self.state = WarehouseState(self.storage)
            if not self.state.exists:
                self._check_new_warehouse()
            self._check_directories()
            self._tables: dict[str, ReplicaTable] = {}
            for directory in self.state.directories():
                self._open(directory)
            self._check_kind()
            self._rewind_ahead()
        except (OSError, ValueError) as exc:
            self.close()
            raise UserError(f"cannot use {self.storage.url} as a Delta warehouse: {exc}") from None
        except BaseException:
            self.close()
            raise
        # set in the open transaction; the last one set is the batch's: its tick versions each table's txn
        self._positions: dict[str, int] = {}
        self._directories: dict[str, str] | None = None   # as the open transaction leaves them
        positions = self.state.positions()
        self._last: tuple[str, int] | None = next(iter(positions.items())) if len(positions) == 1 else None
        self._changed: dict[str, float] = {}   # a table directory: when this consumer last committed a change of it
        self._session = session or (lambda: _spark_session(spark_master, spark_conf))
        self._views: DeltaViews | None = None   # once the warehouse has views
        self._views_due = Every(VIEWS_DISCOVER_SECONDS)
        self._views_waiting = False
        self._views_failed = False   # Spark would not start: the views are left alone for this run
        # VACUUM every vacuum_every seconds (None: never), the first after the first step: what a
        # killed run left (files no log names) goes at the next start, once past the retention
        self._vacuum_every = vacuum_every
        self._vacuum_at = math.inf if vacuum_every is None else time.monotonic()
        self._views_due.due()
        try:
            self._discover_views()
        except Exception as exc:   # the tables are replicated all the same
            log.warning("views: cannot read them (they are not refreshed): %s", first_line(exc))

    # the warehouse ----------------------------------------------------------------------

    def _lock_local(self, root: Path) -> None:
        if not root.parent.is_dir():
            raise UserError(f"cannot create {root}: directory {root.parent} does not exist")
        if root.exists() and not root.is_dir():
            raise UserError(f"{root} is not a directory: give the warehouse another path")
        if root.is_dir() and not (root / STATE_DIRECTORY).exists():
            self._check_new_warehouse()   # before the lock file: a refused directory is left as it was
        root.mkdir(exist_ok=True)
        self._lock_fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"another consumer is writing the Delta warehouse {root}") from None

    def _check_new_warehouse(self) -> None:
        """Refuses a place that holds files and is not a warehouse: replicator writes only its own
        tables, and a directory of the same name there would be someone else's."""
        foreign = sorted({entry.path.split("/", 1)[0] for entry in self.storage.list("")} - {LOCK})
        if foreign:
            raise UserError(f"{self.storage.url} holds {', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''} "
                            f"and is not a replicator Delta warehouse (no {STATE_DIRECTORY}): give the warehouse "
                            f"another path, or an empty one")

    def _check_directories(self) -> None:
        """The directories _replicator records are kept as they are (only new tables get
        directory_name's), unless one is no directory of the warehouse's own: an older
        version's table named '..' wrote outside it."""
        for directory, name in sorted(self.state.directories().items()):
            recorded_directory(self.storage.url, directory, "nothing written", name)

    def _check_kind(self) -> None:
        """A warehouse's tables are of one kind, chosen when it is created (recorded in _replicator;
        a warehouse an older version made: the kind of every table it has or had, a dropped one's
        log kept): a consumer asked for the other kind is refused, so a table created again in a
        dropped one's directory is of the warehouse's kind."""
        recorded = self.state.kind()
        if recorded is not None:
            kinds = {recorded}
        else:
            logs = (self._tables.get(d) or ReplicaTable(self.storage, d) for d in sorted(self.state.every_directory()))
            kinds = {self._kind(table.portable) for table in logs if table.snapshot.exists}
        if len(kinds) > 1:
            raise UserError(f"{self.storage.url} holds tables of both kinds (default and portable), which no "
                            f"consumer writes: replicate into a new warehouse")
        if kinds and kinds != {self._kind(self.portable)}:
            have = "default" if self.portable else "portable"
            option = "" if self.portable else TABLES_OPTION + "portable"
            raise UserError(f"{self.storage.url} holds {have} tables: use --target delta:{self.storage.url}{option} "
                            f"(a warehouse keeps the kind of tables it was created with; for the other kind, "
                            f"replicate into a new warehouse)")

    @staticmethod
    def _kind(portable: bool) -> str:
        return "portable" if portable else "default"

    def _rewind_ahead(self) -> None:
        """A crash between a batch's table commits and _replicator's leaves tables holding the
        batch past the position. The batch is applied again from the position, maybe as part
        of a longer one, and its rows are captured in the structure before it: such a table
        shows the structure (and takes rows in it) as of the position until it commits again
        or the position passes it (its commit for the batch is then skipped)."""
        positions = self.state.positions()
        ahead = {directory for directory, table in self._tables.items()
                 if any((table.applied(app) or 0) > tick for app, tick in positions.items())}
        if not ahead:
            return
        from replicator.targets.delta.reader import tick_versions
        for app, tick in positions.items():
            for directory, (_, version) in tick_versions(self.storage, tick, app).items():
                table = self._tables.get(directory)
                if directory in ahead and table is not None and (table.applied(app) or 0) > tick:
                    table.rewound = delta_log.metadata_at(self.storage, directory, version)

    def _open(self, directory: str) -> ReplicaTable:
        table = self._tables.get(directory)
        if table is None:
            table = self._tables[directory] = ReplicaTable(self.storage, directory, portable=self.portable)
        return table

    def _table(self, source_name: str) -> ReplicaTable:
        directories = self._directories if self._directories is not None else self.state.directories()
        for directory, name in directories.items():
            if name == source_name:
                return self._open(directory)
        raise KeyError(source_name)

    # state ---------------------------------------------------------------------------

    def positions(self, queue: str) -> dict[str, int]:
        return queue_positions(self.state.positions(), queue)

    def queues(self) -> set[str]:
        return {key.partition("/")[0] for key in self.state.positions()}

    def tables(self) -> dict[str, TargetTable]:
        """The tables as committed: each table's own record, which commits with its rows."""
        tables = {}
        for directory in self.state.directories():
            meta = self._open(directory).meta
            if meta is not None:
                tables[meta["source_name"]] = target_table(meta)
        return tables

    # transactions --------------------------------------------------------------------

    def begin(self) -> None:
        self.state.take_in_others()   # one read: a second consumer is stopped before it writes
        self._positions = {}
        self._directories = dict(self.state.directories())

    def set_position(self, queue: str, consumer: str, tick_id: int) -> None:
        """Several positions may be set in one transaction (a follower's offsets): all are stored;
        the last one set is the batch's."""
        key = f"{queue}/{consumer}"
        self._positions.pop(key, None)
        self._positions[key] = tick_id

    def forget_positions(self, queue: str) -> None:
        """Committed at once, before the transaction makes its tables (a follower's rebuild, its tables
        dropped): a rebuild killed midway leaves a warehouse of no position, which a follower does not
        go on from, and until the rebuild commits, no table's own record of a tick holds it back (the
        rebuild's commits may be numbered anew). Tables a killed rebuild dropped, still listed, go."""
        assert self._directories is not None
        self.state.forget({f"{queue}/{consumer}" for consumer in self.positions(queue)})
        self._positions = {key: tick for key, tick in self._positions.items() if not key.startswith(f"{queue}/")}
        self._directories = {directory: name for directory, name in self._directories.items()
                             if self._open(directory).meta is not None}

    @property
    def _position(self) -> tuple[str, int] | None:
        return next(reversed(self._positions.items()), None)

    def commit(self) -> None:
        assert self._directories is not None, "no open transaction: call begin() first"
        app, tick = self._position if self._position is not None else (None, None)
        versions = []
        committed = []
        for directory, table in self._tables.items():
            if table.staged is None:
                continue
            # the tick its log holds, which a batch retried after a crash skips; but not in a directory no
            # table held (a dropped table's ticks), nor while the position is forgotten (a follower's rebuild,
            # whose commits may be numbered anew)
            applied = (table.applied(app) if app is not None and not table.staged.fresh
                       and self.state.snapshot.txns.get(app) != FORGOTTEN else None)
            if app is not None and applied is not None and tick is not None and applied >= tick:
                if applied > tick and applied <= self.state.positions().get(app, 0):
                    # ahead of the batch, not ahead of the position as a crash leaves it: what feeds the
                    # warehouse went back (a follower's topics made anew number their commits from 1 again)
                    raise UserError(f"{directory} holds tick {applied} of {app}, past tick {tick} this batch ends "
                                    f"at: what feeds the warehouse went back (topics made anew, a source restored); "
                                    f"rebuild the warehouse into a new directory (a follower's: --recopy)")
                log.debug("%s holds tick %s already: the batch is skipped for it", directory, applied)
                table.rollback()
                continue
            version = table.commit(app, tick)
            crash_point("delta-table-committed")
            if version is not None:
                versions.append((self._directories.get(directory, directory), directory, version))
                committed.append(table)
        others = dict(list(self._positions.items())[:-1])
        self.state.commit(self._position, versions, self._directories, others=others, kind=self._kind(self.portable))
        if self._position is not None:   # tables that held this batch already show their own structure again
            for table in self._tables.values():
                if table.rewound is not None and (table.applied(self._position[0]) or 0) <= self._position[1]:
                    table.rewound = None
        crash_point("delta-committed")
        self._directories = None
        position = self._position
        self._positions = {}
        if position is not None:
            self._last = position
            self._refresh_views(wait=False)
        self._maintain(committed)

    def _maintain(self, committed: list[ReplicaTable]) -> None:
        """After a commit: OPTIMIZE of the tables it left with many small files or many deleted
        rows, and checkpoints. A failure here costs only speed: logged, and the consumer goes on."""
        try:
            now = time.monotonic()
            self._changed.update((table.directory, now) for table in committed)
            if not committed:   # idle: a file with deletions of a quiet table at a time
                quiet = [table for table in self._tables.values()
                         if now - self._changed.get(table.directory, -math.inf) >= maintenance.IDLE_PURGE_QUIET]
                done = maintenance.purge_next(quiet)
                if done is not None:
                    log.debug("purged deleted rows of %s: %s rewritten (%s) in %.1fs", done.table,
                              counted(done.files, "file"), counted(done.rows, "row"), done.seconds)
            for table in committed:
                if table.meta is not None and maintenance.due(table):
                    done = maintenance.optimize_table(table)
                    if done is not None:
                        log.info("optimized %s: %s into %s (%s) in %.1fs%s", table.directory,
                                 counted(done.files, "file"), counted(done.written, "file"), counted(done.rows, "row"),
                                 done.seconds, "" if done.committed else " (not committed: another writer changed it)")
            maintenance.compact_state(self.state)
        except Exception as exc:
            log.warning("optimize after the commit failed (the consumer goes on; `replicator delta optimize` runs "
                        "it): %s", first_line(exc))
        views = [vt.table for vt in self._views.discovered()] if self._views is not None else []
        self._checkpoint(list(self._tables.values()) + views)

    def _checkpoint(self, tables: list[ReplicaTable]) -> None:
        """A checkpoint of each log that grew by CHECKPOINT_EVERY commits since the last
        (delta-rs writes it): readers and the next start replay no more than that; then, with
        --vacuum-every, the files it no longer names as removed go (maintenance.Tombstones), and
        the log's entries older than its retention (maintenance.clean_log)."""
        due = [t.snapshot for t in tables if t.snapshot.commits_since_checkpoint >= delta_log.CHECKPOINT_EVERY]
        if self.state.snapshot.commits_since_checkpoint >= delta_log.CHECKPOINT_EVERY:
            due.append(self.state.snapshot)
        needed: dict[str, int] | None = None
        for snapshot in due:
            tombstones = None
            if self._vacuum_every is not None:
                try:
                    tombstones = maintenance.Tombstones.read(self.storage, snapshot.table)
                except Exception as exc:   # the checkpoint still saves reading; the files stay (7 days)
                    log.warning("vacuum of %s at its checkpoint skipped: %s", snapshot.table, first_line(exc))
            try:
                delta_log.write_checkpoint(self.storage, snapshot.table,
                                           tombstones.snapshot.version if tombstones is not None else None)
                snapshot.commits_since_checkpoint = 0
            except Exception as exc:   # a checkpoint only saves reading: the consumer goes on
                log.warning("checkpoint of %s failed: %s", snapshot.table, first_line(exc))
                snapshot.commits_since_checkpoint = 0
                continue
            try:
                files, size = tombstones.vacuum() if tombstones is not None else (0, 0)
                if files:
                    log.debug("vacuum deleted %s (%s bytes) of %s at its checkpoint", counted(files, "file"),
                              f"{size:,}", snapshot.table)
            except Exception as exc:   # they stay for `replicator delta vacuum` (7 days old): nothing lost
                log.warning("vacuum of %s at its checkpoint failed: %s", snapshot.table, first_line(exc))
            try:
                if needed is None:
                    needed = self.state.kept_versions(maintenance.log_retention(self.state.snapshot))
                maintenance.clean_log(self.storage, snapshot, keep=needed.get(snapshot.table))
            except Exception as exc:   # the log stays longer: nothing lost
                log.warning("log cleanup of %s failed: %s", snapshot.table, first_line(exc))

    def tend(self) -> None:
        """Between batches (protocol.tend): once due, VACUUM of every table, view and _replicator
        of the warehouse, as `replicator delta vacuum` runs it (each table's own retention; a file
        no log names only once older than 7 days: a copy's files are never taken). One line says
        what it deleted; a failure (another writer, storage) costs only space: logged, and tried
        again an interval later. The next is due an interval after this one ends."""
        if self._vacuum_every is None or time.monotonic() < self._vacuum_at or self._directories is not None:
            return   # (a transaction open: never within a batch's commits)
        started = time.monotonic()
        try:
            done = maintenance.vacuum(self.storage)
        except Exception as exc:
            log.warning("vacuum failed (the consumer goes on; tried again in %s): %s",
                        format_duration(timedelta(seconds=self._vacuum_every)), first_line(exc))
        else:
            files, size = sum(d.files for d in done), sum(d.bytes for d in done)
            log.info("vacuum deleted %s (%s bytes) of %s in %.1fs", counted(files, "file"), f"{size:,}",
                     counted(len(done), "table"), time.monotonic() - started)
        finally:
            self._vacuum_at = time.monotonic() + self._vacuum_every

    def rollback(self) -> None:
        for table in self._tables.values():
            table.rollback()
        self._directories = None
        self._positions = {}

    # views ------------------------------------------------------------------------------

    def _discover_views(self) -> None:
        """Looks for the warehouse's views (at start, then every VIEWS_DISCOVER_SECONDS):
        the tables they read keep what their commits change, and Spark is started in the
        background for them."""
        if self._views is None:
            if self._views_failed or not view_directories(self.storage):
                return
            from replicator.targets.delta.views import DeltaViews, Session
            self._views = DeltaViews(_Tables(self), Session(self._session))
        found = self._views.discover()
        if found:
            self._views.session.start()
        directories = self.state.directories()
        watched = self._views.watched()
        for directory in directories:
            table = self._open(directory)
            if directory in watched:
                self._views.capture(table)
            else:
                table.captures = None

    def _refresh_views(self, *, wait: bool) -> None:
        """Brings the views up to the last commit, once Spark has started (wait: until it
        has). A failure costs the views their freshness, never the batch."""
        if self._views_due.due():
            self._discover_views()
        views = self._views
        if views is None or self._last is None:
            return
        views.take_captures(self._tables)
        if not views.discovered():
            return
        views.session.start()
        if not (wait or views.session.ready):
            if not self._views_waiting:
                log.info("views: Spark is starting; the views catch up once it has (the tables are committed "
                         "meanwhile)")
                self._views_waiting = True
            return
        try:
            views.session.get()
        except Exception as exc:
            log.warning("views are not refreshed by this consumer: cannot start Spark: %s", first_line(exc))
            self._views, self._views_failed = None, True
            for table in self._tables.values():
                table.captures = None
            return
        if self._views_waiting:
            log.info("views: Spark started in %.1fs; the views catch up", views.session.seconds)
            self._views_waiting = False
        views.catch_up(*self._last)
        crash_point("delta-views-refreshed")

    def settle(self) -> None:
        """Brings the views up to the position, waiting for Spark to start if it must (the end
        of `consume --until-caught-up` or `--once`)."""
        self._refresh_views(wait=True)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if getattr(self, "_tables", None):
                self.rollback()
        with contextlib.suppress(Exception):   # once Spark runs, the views are brought up to the last commit
            views: DeltaViews | None = getattr(self, "_views", None)
            if views is not None and views.session.ready and self._last is not None:
                self._refresh_views(wait=False)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    # tables --------------------------------------------------------------------------

    def create_table(self, table: TargetTable) -> None:
        """A new table, or a table copied anew: a new version of the same Delta table."""
        assert self._directories is not None
        try:
            replica = self._table(table.source_name)
        except KeyError:
            directory = self._free_directory(directory_name(table.source_name), table.table_id)
            self._directories[directory] = table.source_name
            replica = self._open(directory)
        fresh = replica.meta is None   # a new directory, or a dropped table's: its log's ticks are not this table's
        replica.reset(table_meta(table), table.structure)
        assert replica.staged is not None
        replica.staged.fresh = replica.staged.fresh or fresh

    def _free_directory(self, wanted: str, table_id: int) -> str:
        """wanted, or wanted-2, -3...: a directory no kept table has, compared without case (object
        stores served through case-insensitive gateways, macOS and Windows folders, and Spark's
        catalog fold it): public.T and public.t both replicate, the second one created taking
        public.t-2, rather than one refused. A dropped table's is taken again (dropped in this
        transaction too), and so is one holding this very table, which a crash left out of
        _replicator (the table committed, the warehouse's commit not)."""
        assert self._directories is not None
        taken = {directory.casefold() for directory in self._directories}
        candidate, n = wanted, 1
        while candidate.casefold() in taken or not self._reusable(candidate, table_id):
            n += 1
            candidate = f"{wanted}-{n}"
        return candidate

    def _reusable(self, directory: str, table_id: int) -> bool:
        replica = self._open(directory)
        meta = replica.meta
        return (meta is None or meta["table_id"] == table_id
                or (replica.staged is not None and replica.staged.dropped))

    def save_table(self, table: TargetTable) -> None:
        self._table(table.source_name).set_meta(table_meta(table))

    def drop_table(self, table: TargetTable) -> None:
        assert self._directories is not None
        replica = self._table(table.source_name)
        replica.drop()
        self._directories.pop(replica.directory, None)

    def alter_table(self, old: TargetTable, new: TargetTable, changes: list[Change]) -> None:
        """In place: a metadata commit (columns by id: renames and drops rewrite no file)."""
        assert self._directories is not None
        replica = self._table(old.source_name)
        replica.alter(table_meta(new), new.structure)
        self._directories[replica.directory] = new.source_name

    def schema_event(self, table: TargetTable, event: dict[str, Any]) -> None:
        """Nothing to record: the table's schema and record are the record."""

    def upsert(self, table: TargetTable, op: str, rows: Iterable[Row], old_rows: OldRows = None) -> None:
        replica = self._table(table.source_name)
        if op == "R":
            replica.copy(rows if isinstance(rows, list) else list(rows))
            return
        positions = table.structure.key_positions()
        change = replica.change
        for row in rows:
            change(tuple(row[i] for i in positions), False, row)

    def delete(self, table: TargetTable, keys: Iterable[Row], old_rows: OldRows = None) -> None:
        replica = self._table(table.source_name)
        positions = table.structure.key_positions()
        width = len(table.structure.columns)
        for key in keys:
            key = tuple(key)
            row: list[Any] = [None] * width
            for i, value in zip(positions, key):
                row[i] = value
            replica.change(key, True, row)

    def truncate(self, table: TargetTable) -> None:
        self._table(table.source_name).truncate()

    def copy_from(self, table: TargetTable, snap: Any, progress: Callable[[int], None]) -> int | None:
        """The initial copy of a large table, split over worker processes that read ranges of it
        in the copy's snapshot and write its data files themselves (replicator.targets.parallel_copy,
        replicator.targets.delta.copy_files); the files join the table's open transaction. None:
        not splittable or small, copied through upsert()."""
        from replicator.targets import parallel_copy
        from replicator.targets.delta.copy_files import DataFiles

        workers = parallel_copy.workers_for(snap.estimated_rows)
        ranges = parallel_copy.block_ranges(snap.conn, snap.table.oid, workers)
        if ranges is None:
            return None
        replica = self._table(table.source_name)
        files = DataFiles(self.storage.url, replica.directory, table.structure.to_json(), replica.schema())
        return parallel_copy.copy_parallel(snap, ranges, files, progress, replica.take_files)


def _spark_session(master: str | None, conf: dict[str, str] | None) -> Any:
    from replicator.spark_session.session import get_session
    return get_session(master, conf, app_name="replicator consumer")
