"""The consumer loop: fetch a batch, apply it to a target with the position,
in one target transaction, then finish the batch on the source.

Exactly once: the target's stored position is the truth. On start the
source consumer is moved to it, so a crash between the target's commit and
finish_batch() neither loses nor repeats a batch.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import secrets
import shlex
import socket
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from operator import itemgetter
from typing import Any

import psycopg

from replicator import run_loop
from replicator.errors import TargetUnavailable, UserError, first_line
from replicator.metrics import ConsumerMetrics
from replicator.shutdown import StopFlag
from replicator.source import BatchInfo, CapturedTable, Source, monitoring
from replicator.source import table_copy as source_copy
from replicator.source.txid_snapshot import snapshot_xmax, snapshot_xmin, txid_visible
from replicator.structure import RowsDecoder, TableStructure, decode_old_rows, parse_json, reconcile
from replicator.targets.protocol import RecordsOrigin, Row, Target, TargetTable
from replicator.wording import counted

log = logging.getLogger("replicator")

JOIN_BACK_KEYS = 5000
# A consumer that is behind merges ticks into one batch (one target transaction):
# at most MAX_BATCH_EVENTS events and about BATCH_ROWS row changes, at the rows per
# event of the batches applied so far (an event holds 1 to 1000 rows). Fewer, larger
# batches cost less per row: a SQLite commit writes every page the batch touched.
MAX_BATCH_EVENTS = 100000
BATCH_ROWS = 200000
RUN_ROWS = 5000  # rows of consecutive same-kind events applied in one call, at most
RECORD_COPY_SECONDS = 5.0   # a running copy's row on the source (for `status`) is written this often, at most


def batch_event_limit(max_events: int, rows_per_event: float) -> int:
    """Events to merge into the next batch: about BATCH_ROWS rows, at most max_events."""
    return max(1, min(max_events, int(BATCH_ROWS / max(rows_per_event, 1.0))))


def default_consumer_name(target: Target) -> str:
    """A stable name derived from the target: readable prefix, hash of the full
    description and of the host (two hosts with a replica at the same path are two
    consumers; sharing one name, each would take batches the other never sees)."""
    scheme, _, where = target.name.partition(":")
    digest = hashlib.sha1(f"{socket.gethostname()}:{target.name}".encode()).hexdigest()[:8]
    readable = re.sub(r"[^A-Za-z0-9]+", "_", where.rsplit("/", 1)[-1]).strip("_")[:40]
    return f"{scheme}_{readable}_{digest}"


def streams_to_stdout(target: Target) -> bool:
    return target.name.partition(":")[2] == "-"


def temporary_consumer_name(target: Target) -> str:
    """The name of a stream to stdout run without --consumer: one of its own per run.
    Host and process tell a reader where it runs; the random token makes it its own:
    two containers have the same pid (1) and may have the same host name, and a
    killed run's consumer must not be taken over by the next run with its pid. Short
    enough (at most 38 bytes: pids have 7 digits at most) for application_name ('replicator consumer NAME',
    63 bytes), which status shows."""
    scheme = target.name.partition(":")[0]
    host = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]
    return f"{scheme}_stdout_{host}_{os.getpid()}_{secrets.token_hex(4)}"


def consumer_name(target: Target, queue: str, name: str | None) -> str:
    """The consumer a target replicates `queue` as: the one whose position it holds
    (a file moved or copied elsewhere keeps its name), else `name` or the default.

    A name other than the stored one is refused: registered anew, that consumer
    would start at the current tick and the replica would silently miss every
    change queued since its last batch."""
    stored = target.positions(queue)
    others = sorted(target.queues() - {queue}) if not stored else []
    if others:
        # Their tables would share the target (one source table in both queues, copied by each).
        raise UserError(f"{target.name} holds queue {', '.join(repr(q) for q in others)}, not {queue!r}: "
                        f"replicate queue {queue!r} into a target of its own")
    if name is None:
        if len(stored) > 1:
            raise UserError(f"{target.name} holds positions of queue {queue!r} for consumers "
                            f"{', '.join(sorted(stored))}: name one with --consumer")
        return next(iter(stored), None) or default_consumer_name(target)
    if stored and name not in stored:
        held = ", ".join(repr(n) for n in sorted(stored))
        raise UserError(f"{target.name} replicates queue {queue!r} as consumer {held}, not {name!r}: "
                        f"a new consumer would skip what was queued meanwhile; use --consumer with "
                        f"the stored name, or a new target")
    return name


def _drops_rows(event: dict[str, Any]) -> bool:
    """Whether an S event asks for a copy because rows may have left the table without events (a
    partition truncated or detached, a narrower --where): a copy over a target's rows keeps them."""
    return bool(event.get("copy")) and event.get("rows_kept") is not True


def _key_columns(structure: TableStructure) -> list[tuple[str, str, bool]]:
    """What a target's rows are keyed by: each key column's name, type and nullability."""
    return [(c.name, c.type, c.not_null) for c in structure.key_columns()]


def check_captured(queue: str, tables: list[str], queue_tables: list[CapturedTable]) -> None:
    """Refuses a --tables list naming a table the queue does not capture."""
    names = {t.name for t in queue_tables}
    unknown = [f for f in tables if f not in names and f"public.{f}" not in names]
    if unknown:
        raise UserError(f"queue {queue!r} does not capture {', '.join(unknown)}")


@dataclass
class BatchStats:
    batch_id: int
    tick_id: int
    events: int = 0
    rows: int = 0
    seconds: float = 0.0
    lag_seconds: float = 0.0  # from the batch's last tick to its commit


@dataclass
class _Summary:
    """What a running consumer applied since its last INFO line."""
    queue: str
    started: float
    batches: int = 0
    events: int = 0
    rows: int = 0
    lag_seconds: float = 0.0

    def add(self, stats: BatchStats) -> None:
        self.batches += 1
        self.events += stats.events
        self.rows += stats.rows
        self.lag_seconds = stats.lag_seconds

    def flush(self) -> None:
        """Logs one line, unless every batch since the last was empty (an idle
        queue logs nothing), and starts counting again."""
        now = time.monotonic()
        if self.events:
            log.info("queue %s: %s, %s, %s applied in the last %.1fs; lag %.1fs", self.queue,
                     counted(self.batches, "batch", "batches"), counted(self.events, "event"),
                     counted(self.rows, "row"), now - self.started, self.lag_seconds)
        self.started, self.batches, self.events, self.rows = now, 0, 0, 0


_Origin = tuple[int | None, datetime | None]   # an event's transaction and time


@dataclass
class _PendingKeys:
    """PK-only keys collected from events, joined back in chunks; each with the transaction and
    time of the last event that named it (a RecordsOrigin target's source of the row read back)."""
    keys: dict[int, dict[tuple[Any, ...], _Origin]] = field(default_factory=dict)

    def add(self, table: int, items: Iterable[list[Any]], origin: _Origin) -> int:
        bucket = self.keys.setdefault(table, {})
        bucket.update(dict.fromkeys(map(tuple, items), origin))
        return len(bucket)


class _Run:
    """Consecutive row events of one full-mode table and one type, with old rows or
    without, applied to the target in one call: fewer calls, same changes in the same
    order (a target applies the rows of a call in order)."""

    __slots__ = ("ev_type", "old_rows", "rows", "table", "target")

    def __init__(self, target: Target) -> None:
        self.target = target
        self.table: TargetTable | None = None
        self.ev_type = ""
        self.rows: list[Sequence[Any]] = []
        self.old_rows: list[Row | None] | None = None

    def add(self, table: TargetTable, ev_type: str, rows: list[Sequence[Any]],
            old_rows: list[Row | None] | None) -> None:
        """Adds an event's decoded rows and, for a table captured with --old-rows, their
        old rows (lists the run may keep and extend)."""
        if (table is self.table and ev_type == self.ev_type and (old_rows is None) == (self.old_rows is None)
                and len(self.rows) < RUN_ROWS):
            self.rows += rows
            if self.old_rows is not None and old_rows is not None:
                self.old_rows += old_rows
        else:
            self.flush()
            self.table, self.ev_type, self.rows, self.old_rows = table, ev_type, rows, old_rows

    def flush(self) -> None:
        if self.table is not None and self.rows:
            if self.ev_type == "D":
                self.target.delete(self.table, self.rows, old_rows=self.old_rows)
            else:
                self.target.upsert(self.table, self.ev_type, self.rows, old_rows=self.old_rows)
        self.table, self.rows, self.old_rows = None, [], None


class _CopyWatch:
    """A table's copy as an operator sees it from outside: the consumer's metrics,
    and a row on the source that `replicator status` shows, written from the
    consumer's own connection at most every RECORD_COPY_SECONDS (or progress
    interval) and deleted when the copy ends."""

    def __init__(self, consumer: Consumer, table: str, estimated_rows: int) -> None:
        self.consumer = consumer
        self.table = table
        self.estimated_rows = estimated_rows
        self._record_due = monitoring.Every(min(RECORD_COPY_SECONDS, consumer.progress_interval))
        self.update(0)

    def _record(self, table: str | None, rows: int) -> None:
        source = self.consumer.source
        # A copy again after a schema change runs inside a batch's transaction on that
        # connection: a row written there would be seen by no one before it is deleted.
        if source is not None and source.conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
            monitoring.record_copy(source, self.consumer.queue, self.consumer.name, table, rows,
                                   self.estimated_rows)

    def update(self, rows: int) -> None:
        self.consumer.metrics.copy_progress(self.table, rows, self.estimated_rows)
        if self._record_due.due():
            self._record(self.table, rows)

    def ended(self) -> None:
        self.consumer.metrics.copy_ended(self.table)
        # A source gone mid-copy cannot be told; the consumer clears the row when it reconnects.
        with contextlib.suppress(psycopg.OperationalError):
            self._record(None, 0)


class Consumer:
    def __init__(self, dsn: str, queue: str, target: Target, *, name: str | None = None,
                 tables: list[str] | None = None, poll_interval: float = 0.2,
                 stats_interval: float = 30.0, max_batch_events: int = MAX_BATCH_EVENTS,
                 recopy: bool = False, progress_interval: float = 10.0, health_max_lag: float = 300.0) -> None:
        self.dsn = dsn
        self.queue = queue
        self.target = target
        # A stream to stdout stores no position: without a name, nothing would ever resume
        # it, so it is a consumer for this run only, which must not hold back rotation after it.
        self.temporary = name is None and streams_to_stdout(target)
        self.name = temporary_consumer_name(target) if self.temporary else consumer_name(target, queue, name)
        self.table_filter = tables
        self.poll_interval = poll_interval
        self.stats_interval = stats_interval
        self.max_batch_events = max_batch_events
        self.progress_interval = progress_interval
        self.metrics = ConsumerMetrics(queue, self.name, health_max_lag)
        self._lag_due = monitoring.Every(monitoring.READ_EVERY_SECONDS)
        self.rows_per_event = 1000.0  # until a batch shows the queue's
        self.source: Source | None = None
        self._table_ids: list[int] | None = None
        self._following: dict[int, TargetTable] = {}
        self._captured: dict[int, CapturedTable] = {}
        self._deferred = False
        self._connected_once = False
        self._registered = False   # by this process, at least once
        self.recopy = recopy   # rebuild the target in place at the next connect()

    # connection and start-up -------------------------------------------------------

    def connect(self) -> Source:
        from replicator.source import db
        application_name = f"replicator consumer {self.name}"
        if self._connected_once:
            # Reconnecting after an outage: OperationalError goes to run(), which retries
            # with backoff (db.connect would turn it into a UserError and end the daemon).
            conn = db.open_connection(db.resolve_dsn(self.dsn), application_name=application_name)
        else:
            conn = db.connect(self.dsn, application_name=application_name)
        self.source = Source(conn)
        self.source.queue_id(self.queue)
        if isinstance(self.target, RecordsOrigin):
            self.target.origin(conn.info.dbname, self.queue)
        if not self._connected_once:
            # Checked before registering: a consumer left registered by a typo would hold back rotation.
            self._check_table_filter(self.source.tables(self.queue))
        self._table_ids = None
        if self.temporary and self._registered and not any(
                c["queue_name"] == self.queue and c["consumer_name"] == self.name for c in self.source.consumers()):
            raise UserError(f"temporary consumer {self.name} was unregistered while the source was unreachable (idle "
                            f"past the queue's consumer idle limit): what was queued meanwhile may be gone; run the "
                            f"command again, or give --consumer NAME to keep a registered position")
        last_tick = self.source.register_consumer(self.queue, self.name, temporary=self.temporary)
        self._registered = True
        position = self.target.positions(self.queue).get(self.name)
        if self.recopy:
            self._recopy()
        elif position is None:
            self.target.begin()
            self.target.set_position(self.queue, self.name, last_tick)
            self.target.commit()
            log.info("%sconsumer %s registered on queue %s at tick %s%s", "temporary " if self.temporary else "",
                     self.name, self.queue, last_tick,
                     " (unregistered when this run ends; --consumer NAME registers one that stays)"
                     if self.temporary else "")
        else:
            if getattr(self.target, "resumes_where_the_source_is", False):
                self._check_resume(position)
            try:
                self.source.set_consumer_position(self.queue, self.name, position)
            except UserError as exc:
                if "no longer exists" not in str(exc):   # replicator.set_consumer_position: the tick is gone
                    raise
                command = (f"replicator consume {shlex.quote(self.queue)} --target {shlex.quote(self.target.name)} "
                           f"--consumer {shlex.quote(self.name)} --recopy")
                raise UserError(f"{self.target.name} holds queue {self.queue!r} at tick {position}, which the source "
                                f"no longer has (the target is older than what the queue keeps: restored from an "
                                f"old backup, or its consumer was unregistered meanwhile): rebuild it in place: run "
                                f"`{command}` (with your other options): it copies every table anew") from None
            log.info("consumer %s resumes queue %s at tick %s", self.name, self.queue, position)
        self._connected_once = True
        return self.source

    def _check_resume(self, position: int) -> None:
        """A target whose position others could have written (a Kafka publisher's commits) resumes only where
        the source consumer is: at its last tick, or at the end of the batch it has open (the target
        committed the batch, finish_batch did not run)."""
        assert self.source is not None
        info = next(c for c in self.source.consumers()
                    if c["queue_name"] == self.queue and c["consumer_name"] == self.name)
        ticks = {info["last_tick"]}
        if info["batch_open"]:
            batch = self.source.next_batch(self.queue, self.name)   # the batch open
            if batch is not None:
                ticks.add(self.source.batch_info(batch).tick_id)
        if position not in ticks:
            raise UserError(f"{self.target.name} holds queue {self.queue!r} at tick {position}, but consumer "
                            f"{self.name} is at tick {info['last_tick']}: the target's position was not written "
                            f"by this consumer (check who may write it), or the source was restored; publish to a "
                            f"new target")

    def _recopy(self) -> None:
        """Rebuilds the target in place: every table it replicates, and every one the
        queue captures for it, copied anew at the source's current state, with the
        position moved to the queue's latest tick, in one target transaction (a crash
        leaves the target as it was). The source consumer is moved first, so that the
        events after that tick are kept while the copies run; the copies skip those
        their snapshots already hold, as an initial copy does. Tables the queue no
        longer captures are left as they are."""
        assert self.source is not None
        tick = self.source.latest_tick(self.queue)
        assert tick is not None   # register_consumer made one if the queue had none
        self.source.set_consumer_position(self.queue, self.name, tick)
        captured = {t.table_id: t for t in self.source.tables(self.queue) if self._wanted(t) and t.structure}
        held = {t.table_id: t for t in self.target.tables().values()}
        log.info("consumer %s copies %s anew from queue %s at tick %s", self.name,
                 counted(len(captured), "table"), self.queue, tick)
        self.target.begin()
        try:
            for table in held.values():
                current = captured.get(table.table_id)
                if current is None:
                    log.info("%s left as it is: queue %s no longer captures it", table.source_name, self.queue)
                    continue
                # A stream says the copy replaces every row (T); a table renamed since goes by its new name.
                self.target.truncate(table)
                if current.name != table.source_name:
                    self.target.drop_table(table)
            for current in captured.values():
                with self._snapshot_of(current) as snap:
                    holder = held.get(current.table_id)
                    if (holder is not None and holder.source_name == current.name
                            and (snap is None or snap.table.name != holder.source_name)):
                        self.target.drop_table(holder)   # dropped or renamed since it was listed
                    if snap is not None:
                        self.copy_table(snap)
            self.target.set_position(self.queue, self.name, tick)
            self.target.commit()
        except BaseException:
            self.target.rollback()
            raise
        self.recopy = False   # a reconnect resumes from the new position

    def close(self) -> None:
        """Ends the run: a temporary consumer is unregistered (if that fails, maint does
        it once the consumer is idle), and the connection closed."""
        if self.temporary and self._registered:
            self._unregister_temporary()
        self._disconnect()

    def _disconnect(self) -> None:
        if self.source is not None:
            self.source.close()
            self.source = None

    def _unregister_temporary(self) -> None:
        from replicator.source import db
        try:
            if not self._unregister_through_its_connection():
                self._disconnect()
                self.source = Source(db.open_connection(db.resolve_dsn(self.dsn)))
                self.source.unregister_consumer(self.queue, self.name)
            log.debug("temporary consumer %s unregistered from queue %s", self.name, self.queue)
        except (psycopg.Error, UserError) as exc:
            log.warning("temporary consumer %s left registered on queue %s (%s): maint unregisters it once it is"
                        " idle", self.name, self.queue, first_line(exc))

    def _unregister_through_its_connection(self) -> bool:
        """Unregisters the consumer through the run's connection; False, having done nothing, when it has none
        usable: lost, or interrupted within a command (SIGINT, SIGTERM: another command is in progress)."""
        if self.source is None or self.source.conn.broken:
            return False
        try:
            self.source.conn.rollback()   # interrupted inside a transaction
            self.source.unregister_consumer(self.queue, self.name)
        except psycopg.Error:
            return False
        return True

    # tables --------------------------------------------------------------------------

    def _wanted(self, table: CapturedTable) -> bool:
        if not self.table_filter:
            return True
        return any(table.name == f or (("." not in f) and table.name == f"public.{f}") for f in self.table_filter)

    def _check_table_filter(self, queue_tables: list[CapturedTable]) -> None:
        """--tables names tables the queue captures, and leaves out none the target
        already replicates: such a table would silently stop following its source."""
        if not self.table_filter:
            return
        check_captured(self.queue, self.table_filter, queue_tables)
        held = {t.table_id for t in self.target.tables().values()}
        left_out = sorted(t.name for t in queue_tables if t.table_id in held and not self._wanted(t))
        if left_out:
            raise UserError(f"{self.target.name} replicates {', '.join(left_out)} of queue {self.queue!r}, which "
                            f"--tables leaves out: its changes would be skipped from now on; list it in "
                            f"--tables, or replicate into a new target")

    def sync_tables(self) -> None:
        """Copies tables new to the target; cheap when the queue's tables did not change."""
        assert self.source is not None
        ids = self.source.table_ids(self.queue)
        if ids == self._table_ids:
            return
        queue_tables = self.source.tables(self.queue)
        self._check_table_filter(queue_tables)
        captured = [t for t in queue_tables if self._wanted(t)]
        known = {t.table_id: t for t in self.target.tables().values()}
        by_name = self.target.tables()
        self._deferred = False
        copied_as: dict[int, CapturedTable] = {}   # as the copy's snapshot shows them (a --where altered since)
        def name_held(name: str, table_id: int) -> bool:
            """Another captured table still has this name in the target: its RENAME (ALTER TABLE t
            RENAME TO t_old; CREATE TABLE t) is in a batch not applied yet. Copy once that batch
            has freed the name."""
            holder = by_name.get(name)
            return holder is not None and holder.table_id != table_id and holder.table_id in ids

        for table in captured:
            if table.table_id not in known and table.structure is not None:
                if name_held(table.name, table.table_id):
                    self._deferred = True
                    continue
                self.target.begin()
                try:
                    with self._snapshot_of(table) as snap:
                        # (a table dropped since is not replicated: its events went with it)
                        if snap is not None and name_held(snap.table.name, table.table_id):
                            self._deferred = True   # renamed since it was listed, onto such a name
                        elif snap is not None:
                            self.copy_table(snap)
                            copied_as[table.table_id] = snap.table
                    self.target.commit()
                except BaseException:
                    self.target.rollback()
                    raise
        self._captured = {t.table_id: copied_as.get(t.table_id, t) for t in captured}
        # Tables no queue captures any more (dropped, removed) are still followed: their
        # last events, a DROP's S event among them, are still in the queue.
        still_captured = {t.table_id for t in self.source.tables()}
        self._following = {t.table_id: t for t in self.target.tables().values()
                           if t.table_id in self._captured or t.table_id not in still_captured}
        self._table_ids = None if self._deferred else ids

    @contextlib.contextmanager
    def _snapshot_of(self, table: CapturedTable) -> Iterator[source_copy.SnapshotCopy | None]:
        """The snapshot a copy of the table reads, the table locked and as the snapshot shows it
        captured (what to do with the target's table is decided from it: a RENAME may have committed
        since the table was listed); None when the table was dropped since."""
        with contextlib.ExitStack() as held:
            try:
                snap: source_copy.SnapshotCopy | None = held.enter_context(source_copy.SnapshotCopy(self.dsn, table))
            except source_copy.TableGone as gone:
                log.info("%s: not copied", gone)
                snap = None
            yield snap

    @contextlib.contextmanager
    def _snapshot_of_captured(self, table_id: int) -> Iterator[source_copy.SnapshotCopy | None]:
        """_snapshot_of the table the queue captures under this id now; None when it captures it no
        more, or the table was dropped."""
        assert self.source is not None
        listed = self.source.table(self.queue, table_id)
        if listed is None or listed.structure is None:
            yield None
            return
        with self._snapshot_of(listed) as snap:
            yield snap

    def copy_table(self, snap: source_copy.SnapshotCopy, over_rows: bool = False) -> TargetTable:
        """(Re)creates the table in the target and copies it from the snapshot, in the target's
        open transaction. Events visible in that snapshot are skipped for the table from then on;
        over_rows: the copy is written over the rows the target holds, no truncate first (see
        _held_by_copy)."""
        table = snap.table
        started = time.monotonic()
        rows = 0
        target_table = TargetTable(source_name=table.name, table_id=table.table_id, mode=table.mode,
                                   structure=snap.structure, copy_snapshot=snap.snapshot, copied_over_rows=over_rows)
        self.target.create_table(target_table)
        watch = _CopyWatch(self, table.name, snap.estimated_rows)
        try:
            with source_copy.CopyProgress(table.name, snap.estimated_rows, self.progress_interval,
                                          watch.update) as progress:
                # A target may copy a large table itself, in parallel (Spark);
                # None means it leaves the copy to this loop.
                copied = self.target.copy_from(target_table, snap, progress.update)
                if copied is not None:
                    rows = copied
                else:
                    for chunk in snap.chunks():
                        self.target.upsert(target_table, "R", chunk)
                        rows += len(chunk)
                        progress.update(rows)
                progress.done(rows)
        finally:
            watch.ended()
        log.info("copied %s: %s in %.1fs", table.name, counted(rows, "row"), time.monotonic() - started)
        return target_table

    # batches ---------------------------------------------------------------------------

    def step(self) -> BatchStats | None:
        """Applies the next batch, if there is one."""
        assert self.source is not None
        self.sync_tables()
        batch_id = self.source.next_batch(self.queue, self.name,
                                          batch_event_limit(self.max_batch_events, self.rows_per_event))
        if batch_id is None:
            return None
        started = time.monotonic()
        info = self.source.batch_info(batch_id)
        self._check_batch_start(info)
        stats = BatchStats(batch_id=batch_id, tick_id=info.tick_id)
        self.target.begin()
        try:
            self._apply_events(batch_id, info.tick_id, stats)
            for table in self._following.values():
                if table.copy_snapshot and snapshot_xmin(info.cur_snapshot) >= snapshot_xmax(table.copy_snapshot):
                    table.copy_snapshot = None
                    self.target.save_table(table)
            self.target.set_position(self.queue, self.name, info.tick_id)
            self.target.commit()
            stats.lag_seconds = info.lag_seconds + time.monotonic() - started
        except BaseException:
            self.target.rollback()
            self._table_ids = None  # reload table state (copy snapshots) from the target
            raise
        self.source.finish_batch(batch_id)
        if self._deferred:
            self.sync_tables()
        if stats.rows:
            # Up at once, down by half a batch: a bulk load's rows per event are not
            # forgotten at the first batch of small events.
            self.rows_per_event = max(1.0, stats.rows / stats.events, self.rows_per_event / 2)
        stats.seconds = time.monotonic() - started
        log.debug("batch %s (tick %s): %s, %s in %.3fs", batch_id, info.tick_id, counted(stats.events, "event"),
                  counted(stats.rows, "row"), stats.seconds)
        return stats

    def _check_batch_start(self, info: BatchInfo) -> None:
        """Refuses a batch that does not start at the target's position (the batch is
        left open, nothing applied): another session moved this consumer on the
        source, and applying the batch would skip or repeat events. Ownership of
        consumers keeps other roles out; this catches the rest (an administrator,
        a second daemon of the same role)."""
        position = self.target.positions(self.queue).get(self.name)
        if info.prev_tick_id != position:
            held = "no position" if position is None else f"tick {position}"
            raise UserError(f"batch {info.batch_id} of queue {self.queue!r} starts at tick {info.prev_tick_id}, "
                            f"but {self.target.name} holds {held} for consumer {self.name!r}: another session "
                            f"moved this consumer on the source; nothing was applied. Stop that session and "
                            f"start this consumer again: it moves the source back to the target's position")

    def _apply_events(self, batch_id: int, tick_id: int, stats: BatchStats) -> None:
        assert self.source is not None
        following = self._following
        pending = _PendingKeys()
        decoders: dict[int, tuple[RowsDecoder, RowsDecoder]] = {}
        run = _Run(self.target)
        origin = self.target if isinstance(self.target, RecordsOrigin) else None
        # Only a consumer of some of the queue's tables has the batch read filtered: the filter is a
        # list of every followed table, in the query's text (a batch of one table cost more at 1,000
        # tables); events of tables not followed are skipped below either way.
        every = self._table_ids is not None and following.keys() >= set(self._table_ids)
        for ev_id, txid, ev_time, ev_type, table_id, data, old in self.source.batch_events(
                batch_id, None if every else list(following)):
            table = following.get(table_id)
            if table is None or self._held_by_copy(table, (tick_id, ev_id, txid, ev_time, ev_type), data, pending, run,
                                                    stats):
                decoders.pop(table_id, None)   # (the table may have been copied again)
                continue
            stats.events += 1
            if origin is not None:   # each event's rows in a call of their own, told where they come from
                run.flush()
                origin.event(tick_id, ev_id, txid, ev_time)
            if ev_type == "T":
                run.flush()
                if self._join_back(table, pending, stats) and origin is not None:
                    origin.event(tick_id, ev_id, txid, ev_time)   # the truncate's, again
                self.target.truncate(table)
                continue
            if ev_type not in ("I", "U", "D", "S"):
                raise UserError(f"event {ev_id} of batch {batch_id} has type {ev_type!r}, which this "
                                f"version of replicator cannot apply: upgrade the consumer")
            if data is None:
                raise RuntimeError(f"event {ev_id} ({ev_type}) of table {table.source_name} has no data")
            if ev_type == "I" or ev_type == "U" or ev_type == "D":
                items = parse_json(data)
                stats.rows += len(items)
                if table.mode == "pk":
                    if pending.add(table.table_id, items, (txid, ev_time)) >= JOIN_BACK_KEYS:
                        run.flush()
                        self._join_back(table, pending, stats)
                    continue
                decode = decoders.get(table_id)
                if decode is None:
                    decode = decoders[table_id] = (table.structure.rows_decoder(), table.structure.keys_decoder())
                run.add(table, ev_type, decode[ev_type == "D"](items),
                        None if old is None else decode_old_rows(decode[0], parse_json(old)))
                continue
            run.flush()
            # S: PK-only keys pending are read back later in the new layout, by attnum (a
            # change in place keeps the key: reconcile). A table copied again holds the rows
            # of its copy, newer than those keys, which may have another key's shape: they go.
            if not self._apply_schema_change(table, ev_id, parse_json(data)):
                pending.keys.pop(table.table_id, None)
            decoders.pop(table_id, None)
        run.flush()
        if origin is not None:
            origin.event(tick_id, None, None, None)
        for table in following.values():
            self._join_back(table, pending, stats)

    def _apply_schema_change(self, table: TargetTable, ev_id: int, event: dict[str, Any]) -> bool:
        """Reconciles the target table with the structure an S event carries:
        in place where no value changed, else by copying the table again (in
        this transaction, within the snapshot rules of the initial copy).
        True when the table was altered in place, with its key unchanged (the
        keys of earlier events still name its rows); False when it was copied
        again, dropped or left behind."""
        kind = event.get("kind")
        if kind == "dropped":
            self.target.schema_event(table, event)
            self.target.drop_table(table)
            del self._following[table.table_id]
            log.info("event %s: %s dropped (%s)", ev_id, table.source_name, event.get("tag"))
            return False
        if kind == "suspended":
            # A DDL run without event triggers took what its capture needs (replicator.suspend_capture)
            assert self.source is not None
            if any(t.table_id == table.table_id for t in self.source.tables(self.queue)):
                raise UserError(f"event {ev_id}: {event.get('reason')}; its capture is suspended and its replica "
                                f"stops here: {event.get('hint')}")
            # removed since, as the event said to: the table added again is copied anew
            del self._following[table.table_id]
            log.info("event %s: %s left behind (its capture was suspended, then removed)", ev_id, table.source_name)
            return False
        if kind not in ("created", "altered"):
            raise UserError(f"event {ev_id} is a schema change of kind {kind!r} on {table.source_name}, which "
                            f"this version of replicator cannot apply: upgrade the consumer, or remove the table "
                            f"from the queue and add it again")
        new_structure = TableStructure.from_source(event["structure"], event["columns"], event["key"])
        # "copy": rows changed without row triggers (a rewrite; a descendant attached, detached, dropped or truncated)
        changes = None if event.get("copy") else reconcile(table.structure, new_structure)
        if changes and self.target.copies_renamed_tables and any(c.action == "rename_table" for c in changes):
            changes = None
        if changes is not None:
            # reconcile copies a table whose key changed: pending keys still name its rows
            assert [c.attnum for c in new_structure.key_columns()] == [c.attnum for c in table.structure.key_columns()]
            self.target.schema_event(table, event)
            # `table alter --mode` changes no row: later events are applied in the new mode
            new_table = TargetTable(source_name=new_structure.qualified_name, table_id=table.table_id,
                                    mode=event.get("mode", table.mode), structure=new_structure,
                                    copy_snapshot=table.copy_snapshot, copied_over_rows=table.copied_over_rows)
            self.target.alter_table(table, new_table, changes)
            self._following[table.table_id] = new_table
            log.info("event %s: %s altered in place (%s)", ev_id, new_table.source_name, event.get("tag"))
            return True
        with self._snapshot_of_captured(table.table_id) as snap:
            if snap is None:
                self._dropped_since(table, event)
                return False
            if self._name_held(snap.table.name, table.table_id):
                self._copy_once_free(table, snap.table.name, event)
                return False
            self._copy_again(table, snap, event)
        log.info("event %s: %s copied again after %s", ev_id, snap.table.name, event.get("tag"))
        return False

    def _name_held(self, name: str, table_id: int) -> bool:
        """Whether another table the queue captures has this name in the target, as the batch applied so
        far left it: its RENAME is in an event not applied yet (a blue/green swap). A table the queue no
        longer captures that has it (dropped, its DROP later in the queue) yields it, as to an initial
        copy (sync_tables), and is followed no more: its last events would act on the copy now under its
        name."""
        assert self.source is not None
        holder = next((t for t in self._following.values() if t.source_name == name and t.table_id != table_id), None)
        if holder is None:
            return False
        if holder.table_id in self.source.table_ids(self.queue):
            return True
        del self._following[holder.table_id]
        return False

    def _copy_once_free(self, table: TargetTable, name: str, event: dict[str, Any]) -> None:
        """A copy again that would take a name another table still has in the target (_name_held): the
        table's replica goes, and sync_tables copies it anew once the name is free, as a new table (its
        events until then are in that copy)."""
        log.info("%s is copied again once %s, which another table has in %s, is free", table.source_name, name,
                 self.target.name)
        self._dropped_since(table, event)
        self._captured.pop(table.table_id, None)
        self._table_ids = None
        self._deferred = True

    def _copy_again(self, table: TargetTable, snap: source_copy.SnapshotCopy, event: dict[str, Any]) -> None:
        """Replaces the table's replica by a copy from the snapshot, after its schema change."""
        current = snap.table
        self._captured[table.table_id] = current
        # The copy replaces every row: a stream says so (T) before the change and the copied
        # rows; a target the copy is written over (Kafka) never shows the table empty, when the
        # change only rewrote values: not when rows may have left without events ("copy" without
        # "rows_kept": a partition truncated or detached, a narrower --where), the key changed (rows under the
        # old key would stay) or keys of a pk-mode table are pending. The copy is in the table's
        # current structure (later S events are in the copy): the change announced is to that
        # structure.
        over_rows = (self.target.copies_over_rows and not _drops_rows(event)
                     and table.mode == current.mode == "full"
                     and _key_columns(table.structure) == _key_columns(snap.structure))
        if not over_rows:
            self.target.truncate(table)
        self.target.schema_event(table, {**event, "schema": current.schema, "name": current.table,
                                         "key": current.key, "columns": current.columns,
                                         "structure": current.structure})
        if current.name != table.source_name:
            self.target.drop_table(table)
        self._following[table.table_id] = self.copy_table(snap, over_rows)

    def _dropped_since(self, table: TargetTable, event: dict[str, Any]) -> None:
        """A table to copy again that was dropped since its event: its rows cannot be read back, and
        the table ends dropped (its DROP, later in the queue, is the last word on it): dropped now."""
        self.target.schema_event(table, {"kind": "dropped", "tag": event.get("tag"), "sql": event.get("sql"),
                                         "schema": table.structure.schema, "name": table.structure.name})
        self.target.drop_table(table)
        del self._following[table.table_id]

    def _held_by_copy(self, table: TargetTable, event: tuple[int, int, int, Any, str], data: str | None,
                      pending: _PendingKeys, run: _Run, stats: BatchStats) -> bool:
        """Whether the table's copy holds the event's changes (it is then skipped). For a target the copy
        was written over (Kafka), the rows a delete or truncate held removed are not in the copy, but the
        target (a sink of the topics) still has them from before it: a delete's keys are read back
        (deleted where the source lacks them now; later events apply after, as for pk-mode keys); a
        truncate, or a copy that rows left without events asked for, is published as a truncate, and
        the table copied again. `event` is (tick, event id, txid, time, type)."""
        tick_id, ev_id, txid, ev_time, ev_type = event
        if not (table.copy_snapshot and txid_visible(txid, table.copy_snapshot)):
            return False
        if not table.copied_over_rows or ev_type not in ("D", "T", "S"):
            return True
        if ev_type == "S" and not _drops_rows(parse_json(data) if data is not None else {}):
            return True
        run.flush()
        if ev_type == "D":
            if data is not None and pending.add(table.table_id, parse_json(data), (txid, ev_time)) >= JOIN_BACK_KEYS:
                self._join_back(table, pending, stats)
            return True
        with self._snapshot_of_captured(table.table_id) as snap:
            if snap is None:
                return True   # dropped since: its DROP follows
            pending.keys.pop(table.table_id, None)
            if isinstance(self.target, RecordsOrigin):
                self.target.event(tick_id, ev_id, txid, ev_time)
            if self._name_held(snap.table.name, table.table_id):
                self._copy_once_free(table, snap.table.name, {})
                return True
            self.target.truncate(table)
            if snap.table.name != table.source_name:   # renamed since
                self.target.drop_table(table)
            self._captured[table.table_id] = snap.table
            self._following[table.table_id] = self.copy_table(snap)
        return True

    def _join_back(self, table: TargetTable, pending: _PendingKeys, stats: BatchStats) -> bool:
        """Applies the current source rows of the table's pending keys: upsert
        the rows found, delete the keys not found. A RecordsOrigin target is told,
        before each row, the transaction and time of the last event that named its
        key. True when it applied anything."""
        assert self.source is not None
        keys = pending.keys.pop(table.table_id, None)
        if not keys or table.table_id not in self._captured:
            # (a table no longer captured cannot be read back: its DROP event follows)
            return False
        key_list = list(keys)
        rows = source_copy.fetch_current_rows(self.source.conn, self._captured[table.table_id],
                                              table.structure, key_list)
        positions = table.structure.key_positions()
        key_of = (lambda row: (row[positions[0]],)) if len(positions) == 1 else itemgetter(*positions)
        decoded = [tuple(k) for k in table.structure.keys_decoder()(key_list)]
        found = set(map(key_of, rows))
        missing = [k for k in decoded if k not in found]
        if not isinstance(self.target, RecordsOrigin):
            self.target.delete(table, missing)
            self.target.upsert(table, "U", rows)
            return True
        origins = dict(zip(decoded, keys.values()))
        by_origin: dict[_Origin, tuple[list[Any], list[Any]]] = {}
        for row in rows:
            by_origin.setdefault(origins.get(key_of(row), (None, None)), ([], []))[0].append(row)
        for key in missing:
            by_origin.setdefault(origins[key], ([], []))[1].append(key)
        for (txid, ev_time), (found_rows, gone) in by_origin.items():
            self.target.event(stats.tick_id, None, txid, ev_time)
            self.target.delete(table, gone)   # (a key change: the old key's delete first, as Debezium's)
            self.target.upsert(table, "U", found_rows)
        return True

    # running -----------------------------------------------------------------------------

    def run(self, *, once: bool = False, until_caught_up: bool = False, stop: StopFlag | None = None) -> int:
        """Runs until stopped (daemon), for one batch (once) or until every
        transaction committed before the call is applied (until_caught_up).
        Reconnects with backoff when the source goes away. Logs what it applied
        every stats_interval seconds, and on return. Returns the number of
        batches applied."""
        return run_loop.run(self, stop or StopFlag(), once=once, until_caught_up=until_caught_up)

    # what run_loop asks of an Applier

    @property
    def idle_pause(self) -> float:
        return self.poll_interval

    def summary(self) -> _Summary:
        return _Summary(self.queue, time.monotonic())

    def reconnect(self) -> bool:
        if self.source is not None:
            return False
        monitoring.record_copy(self.connect(), self.queue, self.name, None)   # one a kill left
        return True

    def goal(self, stop: StopFlag) -> int | None:
        """A tick taken now, for until_caught_up: another ticker holding the queue only delays it.
        None when stopped while waiting."""
        assert self.source is not None
        while not stop.is_set:
            tick = self.source.tick(self.queue, force=True)
            if tick is not None:
                return tick
            stop.wait(0.01)
        return None

    def next_step(self) -> BatchStats | None:
        return self.step()

    def stepped(self, stats: BatchStats | None) -> None:
        if stats is not None:
            self.metrics.applied(stats.events, stats.rows)
        self._read_lag()
        self.metrics.ran()

    def caught_up(self, goal: int, stats: BatchStats | None) -> bool:
        position = self.target.positions(self.queue).get(self.name)
        return position is not None and position >= goal

    def outage(self, error: Exception) -> str | None:
        if isinstance(error, psycopg.OperationalError):
            reason = first_line(error)
            self.metrics.source_unavailable(reason)
            self._disconnect()
            return f"source unavailable ({reason}); reconnecting"
        if isinstance(error, TargetUnavailable):
            # The batch was rolled back and stays open on the source: the next step applies it again.
            reason = first_line(error)
            self.metrics.target_unavailable(reason)
            return f"target unavailable ({reason}); retrying"
        return None

    def _read_lag(self) -> None:
        """Reads the lag from the source for the metrics and health, every
        monitoring.READ_EVERY_SECONDS at most: a query per batch would cost more than a small batch."""
        assert self.source is not None
        if not self._lag_due.due():
            return
        lag = monitoring.consumer_lag(self.source, self.queue, self.name)
        if lag is not None:
            self.metrics.lag(lag["lag_ticks"], lag["lag_events"], lag["lag_seconds"], lag["last_tick_age"])
