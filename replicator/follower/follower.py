"""A follower: applies a publisher's topics to a target of its own (SQLite, Delta, a stream),
exactly once, without touching the source database.

The publisher's commit records (replicator.targets.kafka.state) say, for each Kafka transaction,
the last offset it wrote in each partition it wrote; its topic records, where each partition of a
topic ends. The follower reads the commits that came since its position, then every partition
they wrote (a new follower: every partition the topic records list) up to its end at the last of
them, and applies the records of all of them in the publisher's order (each record's SEQUENCE
header): row changes, tombstones, truncates and the schema changes of the schema change topic,
which it repeats as target calls (create, alter, drop). The offset after each partition's part,
and the tick the publisher had reached, are stored in the target as positions of the queue
"kafka:PREFIX" in the same target transaction.

A new follower starts at offset 0 of every topic: compacted table topics hold each row's
last record (and the last truncate), the schema change topic every change, so replaying them
in order builds every table as of the last commit.

Nothing is trusted for having been read: a commit counts only when a transaction wrote it
(state.transactions), commit numbers and stored offsets only move forward within the partitions,
each record a step reads is one of the commits applied, within the offsets and count its commit
wrote in its partition, of a sequence read once (all checked before any is applied), and decodes;
anything else stops the follower in one line naming the record (--skip-record passes over it).
docs/kafka.md, Trust model.

A topic the commits stop listing (its table dropped: a tombstone of its topic record) may be deleted
and made anew: its stored offset is marked, and reading it again starts where the commit that lists
it again wrote.
"""

from __future__ import annotations

import gc
import heapq
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from operator import itemgetter

from confluent_kafka import Consumer, KafkaError, KafkaException, Message

from replicator import run_loop
from replicator.errors import UserError
from replicator.follower.history import TableHistory, schema_change_of
from replicator.follower.reader import CONSUMER_SETTINGS, Partition, PartitionReader
from replicator.metrics import ConsumerMetrics
from replicator.shutdown import StopFlag
from replicator.structure import TableStructure, reconcile
from replicator.targets.kafka.envelope import KEY_HEADER, OLD_ROW_HEADER, EnvelopeSettings, TableEnvelope
from replicator.targets.kafka.settings import KafkaSettings
from replicator.targets.kafka.state import (
    COMMIT_KEY,
    TABLE_KEY,
    TABLES_KEY,
    TOPIC_KEY,
    Commit,
    bad_record,
    committed_consumer,
    data,
    header_values,
    located,
    partition_bounds,
    sequence_of,
    tombstones_kept_ms,
    topic_from_record,
    transactions,
    where,
)
from replicator.targets.kafka.topics import schema_topic, state_topic, table_topic
from replicator.targets.protocol import Row, Target, TargetTable
from replicator.wording import counted, format_age

log = logging.getLogger("replicator")
Sequenced = tuple[tuple[int, int], Message]   # a record read, after its (commit, index) from its SEQUENCE header

BATCH_RECORDS = 200000   # records of several commits applied in one target transaction, about
TICK = "tick"            # the position that holds the publisher's tick (the others are TOPIC:PARTITION)
COMMIT = "commit"        # and the number of the publisher's commit applied last
COMMIT_MS = "commit_ms"  # and when the publisher made it (its clock, ms since the epoch)
RUN_ROWS = 5000          # rows applied in one target call, at most (a bootstrap reads whole tables)
READ_COMMITS_TIMEOUT = 60.0   # seconds --until-caught-up may take to read the commits to their end
PROBE_EVERY = 5.0        # seconds between the metadata requests that ask whether Kafka is back after an outage
TOMBSTONES_REREAD = 600.0   # seconds between reads of the table topics' delete.retention.ms while running
PROBE_TIMEOUT = 1.0      # seconds one may take
START_TIMEOUT = 10.0     # seconds the first metadata request may take, at most: less when the URL's
                         # kafka.socket.timeout.ms says so (as the publisher's admin requests, topics.py)
VISIBLE_WAIT = 30.0      # seconds a partition may stay short of the offset a commit names (Kafka ends a
                         # transaction partition by partition) before the follower gives up


@dataclass
class FollowStats:
    commit: int
    tick: int
    records: int = 0
    seconds: float = 0.0
    lag_seconds: float = 0.0   # from the publisher's commit to the follower's


@dataclass
class _Summary:
    """What a running follower applied since its last INFO line."""
    target: str
    source: str
    started: float
    records: int = 0
    tick: int = 0
    lag_seconds: float = 0.0

    def add(self, stats: FollowStats) -> None:
        self.records += stats.records
        self.tick = stats.tick
        self.lag_seconds = stats.lag_seconds

    def flush(self) -> None:
        """Logs one line, unless nothing was applied since the last, and starts counting again."""
        now = time.monotonic()
        if self.records:
            log.info("%s: %s applied from %s in the last %.1fs; at tick %s, lag %.1fs", self.target,
                     counted(self.records, "record"), self.source, now - self.started, self.tick, self.lag_seconds)
        self.started, self.records = now, 0


class _Changes:
    """Consecutive row changes of one table and kind, applied in one target call, with the
    old rows the records carry (`before`, of tables captured with --old-rows)."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.table: TargetTable | None = None
        self.kind = ""
        self.rows: list[Row] = []
        self.old_rows: list[Row | None] = []

    def add(self, table: TargetTable, kind: str, row: Row, old_row: Row | None) -> None:
        if table is not self.table or kind != self.kind or len(self.rows) >= RUN_ROWS:
            self.flush()
            self.table, self.kind = table, kind
        self.rows.append(row)
        self.old_rows.append(old_row)

    def flush(self) -> None:
        if self.table is not None and self.rows:
            old_rows = self.old_rows if any(old is not None for old in self.old_rows) else None
            if self.kind == "D":
                self.target.delete(self.table, self.rows, old_rows=old_rows)
            else:
                self.target.upsert(self.table, self.kind, self.rows, old_rows=old_rows)
        self.table, self.rows, self.old_rows = None, [], []


_KINDS = {"c": "I", "u": "U", "r": "R"}


def _key_header(message: Message) -> bytes | None:
    """A tombstone's KEY_HEADER: the exact texts of the key values its key's fields cannot hold."""
    values = header_values(message, KEY_HEADER)
    if len(values) > 1:
        raise ValueError(f"{len(values)} {KEY_HEADER} headers")
    return data(values[0]) if values else None


@contextmanager
def _cycles_uncollected() -> Iterator[None]:
    """Python's cyclic garbage collector paused: a step holds up to BATCH_RECORDS records, a few objects
    each and none in a cycle, which its full collections scanned again and again (a fifth of the CPU of a
    follower catching up); reference counting frees them as ever."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def wait_for_publisher(settings: KafkaSettings, stop: StopFlag, waits: bool) -> None:
    """Before a follower makes its target: a run that stops by itself refuses a prefix nothing is
    published to (its commit topic is missing: a typo would follow nothing, in silence, and leave a
    target behind); a daemon waits for its publisher, saying so."""
    consumer = committed_consumer(settings, **{"group.id": f"replicator-follower.{settings.prefix}"})
    try:
        if _published(consumer, settings):
            return
        message = (f"nothing is published to {settings.name} (no topic {state_topic(settings.prefix)}): check the "
                   f"prefix, or start its publisher (`replicator consume QUEUE --target {settings.name}`)")
        if not waits:
            raise UserError(message + " first")
        log.warning("%s; waiting for it", message)
        while not stop.is_set and not _published(consumer, settings):
            stop.wait(PROBE_EVERY)
    finally:
        consumer.close()


def _published(consumer: Consumer, settings: KafkaSettings) -> bool:
    """Whether a publisher has written to the prefix (its commit topic exists)."""
    try:
        topics = consumer.list_topics(timeout=min(START_TIMEOUT, settings.timeout)).topics
    except KafkaException as exc:
        raise UserError(f"cannot reach Kafka at {settings.brokers}: {exc.args[0].str()}") from None
    return state_topic(settings.prefix) in topics


class Follower:
    def __init__(self, settings: KafkaSettings, target: Target, *, tables: list[str] | None = None,
                 poll_interval: float = 0.2, stats_interval: float = 30.0, health_max_lag: float = 300.0,
                 skip: Iterable[str] = (), recopy: bool = False) -> None:
        self.settings = settings
        # rebuild the target in place: read as a new follower, and in the transaction of the first step,
        # which applies every commit read, drop what the target holds first (_tables_held)
        self.recopy = recopy
        self.skip = frozenset(skip)   # records to pass over, TOPIC:PARTITION:OFFSET (--skip-record)
        self._skipped: set[str] = set()   # those met
        self._stop = StopFlag()
        self.target = target
        self.queue = f"kafka:{settings.prefix}"
        others = sorted(target.queues() - {self.queue})
        if others:
            raise UserError(f"{target.name} holds queue {', '.join(repr(q) for q in others)}: a follower of "
                            f"{settings.name} needs a target of its own")
        self.name = settings.prefix
        self.metrics = ConsumerMetrics(self.queue, target.name, health_max_lag)
        self.poll_interval = poll_interval
        self.stats_interval = stats_interval
        self.table_filter = [t if "." in t else f"public.{t}" for t in tables or []]
        self._state = (state_topic(settings.prefix), 0)
        self._schema = (schema_topic(settings.prefix), 0)
        # with --tables: the ids of the tables followed (None: every table), every topic each has had,
        # and the offset of the schema change topic from which a table created under a name listed
        # is followed too (before it, the names were resolved at start)
        self._followed: set[int] | None = None
        self._topics: dict[int, set[str]] = {}
        self._names_resolved_until = 0
        self._step_commits: dict[int, Commit] = {}   # number → each commit of the step being applied
        if self.table_filter:
            self._follow_tables()
        self.consumer = committed_consumer(settings, **{"group.id": f"replicator-follower.{settings.prefix}",
                                                        "error_cb": self._client_error, **CONSUMER_SETTINGS})
        self.reader = PartitionReader(self.consumer, self._outage)
        self._commits: list[Commit] = []   # read, not applied yet
        self._compacted: dict[str, dict[int, int] | None] = {}   # topic records of commits Kafka compacted away
        self._state_sequences: set[tuple[int, int]] = set()   # of the state topic's records but the commits
        self._unchecked: list[Message] = []   # of the state topic, read before what follows them was
        self._goal: Commit | None = None             # the last commit of the step being applied
        self._envelopes: dict[int, TableEnvelope] = {}
        self._envelope_settings = EnvelopeSettings(prefix=settings.prefix, database="")   # as the commits give
        self._unreachable: str | None = None   # why Kafka is unreachable, while it is
        # how long the table topics it has read keep a tombstone (None: none read), of which topics, when
        self._tombstones_kept_ms: int | None = None
        self._tombstones_topics: set[str] = set()
        self._tombstones_read = -math.inf
        self._undescribed: set[str] = set()   # topics whose settings it may not read (said once)
        # when a bootstrap (no table topic read before this run) began, by this host's clock
        self._bootstrap_began_ms: float | None = None
        self._probed = 0.0                       # when it was last asked whether it is back

    def _follow_tables(self) -> None:
        """The tables --tables names, followed by id. At the first run, the tables of those names now
        (one renamed before is read from each of its topics). At later runs, the tables the target
        holds, which --tables must name by a name each has or had (one renamed since is still
        followed); a name of another table the target lacks is refused (its earlier rows are not
        here)."""
        history = TableHistory.read(self.settings, self._schema[0], self.skip)
        self._topics = history.topics
        wanted = set(self.table_filter)
        published = {name for names in history.names.values() for name in names}
        unknown = sorted(wanted - published)
        if unknown:   # a typo would follow nothing, in silence
            raise UserError(f"{self.settings.name} has published no table {', '.join(unknown)}: --tables names "
                            f"tables its publisher's queue captures")
        if not self._positions():
            self._followed = {table_id for table_id in history.names if history.current(table_id) in wanted}
            self._names_resolved_until = history.end
            return
        held = {t.table_id: t.source_name for t in self.target.tables().values()}
        left_out = sorted(name for table_id, name in held.items() if not wanted & set(history.names.get(table_id, ())))
        if left_out:
            raise UserError(f"{self.target.name} follows {', '.join(left_out)}, which --tables leaves out: its changes "
                            f"would be skipped from now on; list it in --tables, or rebuild the target with these "
                            f"--tables (--recopy)")
        named = {name for table_id in held for name in history.names.get(table_id, ())}
        position = self._offset(self._schema)
        added = sorted(name for table_id in history.names
                       if (name := history.current(table_id)) in wanted - named and table_id not in held
                       and history.first[table_id] < position)
        if added:
            raise UserError(f"{self.target.name} has not followed {', '.join(added)}, which --tables lists: its "
                            f"earlier changes are not in it; to follow it, rebuild the target (--recopy)")
        self._followed = set(held)

    def _client_error(self, error: KafkaError) -> None:
        """librdkafka's errors of the client as a whole, which it retries (and logs) itself: every broker
        down is an outage."""
        if error.code() == KafkaError._ALL_BROKERS_DOWN:
            self._outage(error.str())

    def _outage(self, reason: str) -> None:
        """Kafka unreachable: said once, and by /health until it answers again."""
        if self._unreachable is None:
            log.warning("Kafka at %s unavailable (%s); waiting for it", self.settings.brokers, reason)
            self.metrics.source_unavailable(reason)
        self._unreachable = reason

    def _reachable(self, applied: bool) -> bool:
        """Whether Kafka answers: after an outage, once a step applied records or a metadata request
        succeeds (one every PROBE_EVERY seconds: each makes librdkafka try, and log, its connections
        again)."""
        if self._unreachable is None:
            return True
        if not applied:
            if time.monotonic() - self._probed < PROBE_EVERY:
                return False
            self._probed = time.monotonic()
            try:
                self.consumer.list_topics(timeout=PROBE_TIMEOUT)
            except KafkaException:
                return False
        log.info("Kafka at %s reachable again", self.settings.brokers)
        self._unreachable = None
        return True

    def close(self) -> None:
        self.consumer.close()

    # positions -----------------------------------------------------------------------------

    def _positions(self) -> dict[str, int]:
        """The positions the target holds, none while it is to be rebuilt (--recopy)."""
        return {} if self.recopy else self.target.positions(self.queue)

    def _offset(self, tp: Partition) -> int:
        """Where reading tp goes on: after the last record read, but in a topic the commits stopped listing
        (its table dropped: an operator may then delete it, and a table created again makes it anew) at the
        first offset the commit listing it again wrote there."""
        stored = self._positions().get(f"{tp[0]}:{tp[1]}", 0)
        unlisted = stored < 0
        for number in sorted(self._step_commits):
            commit = self._step_commits[number]
            if commit.lists(tp[0]) is False and tp[0] not in (self._state[0], self._schema[0]):
                unlisted = True
            elif unlisted and commit.written is not None and tp[1] in commit.written.get(tp[0], {}):
                return commit.written[tp[0]][tp[1]][0]
        return -stored - 1 if stored < 0 else stored   # commits without `written` (older publishers): as before

    # reading ---------------------------------------------------------------------------------

    def _passed_over(self, message: Message) -> bool:
        """Whether --skip-record names the record (said at WARNING when it does)."""
        if not self.skip or located(message) not in self.skip:
            return False
        log.warning("record %s passed over (--skip-record)", located(message))
        self._skipped.add(located(message))
        return True

    def _read_commits(self, wait: float) -> None:
        """Commit records that came since the last read (or the position, at first), each checked: written
        by a transaction (state.transactions), numbered after the one before."""
        self.reader.assign({self._state: self._offset(self._state)})
        # a record passed over still takes its offset: its gap is no transaction marker
        runs, self._unchecked = transactions(self._unchecked + self.reader.available(self._state, wait),
                                             self.reader.end(self._state))
        for whole, transactional in runs:
            run = [m for m in whole if not self._passed_over(m)]
            if run and not transactional:
                raise bad_record(run[0], "is of no transaction: no transaction marker follows it (a record another "
                                         "producer wrote in the marker's place makes a commit the publisher wrote "
                                         "look the same: pass over the commit, and that record, if so)")
            commit: Commit | None = None   # the run's, read first (its topic records follow it)
            for message in run:
                key = message.key() or b""
                if key != COMMIT_KEY:
                    if key != TABLES_KEY and not key.startswith((TABLE_KEY, TOPIC_KEY)):
                        raise bad_record(message, "has a key no record of the state topic has")
                    # counted among its commit's records: seen, read here
                    number, _ = sequence = sequence_of(message)
                    self._state_sequences.add(sequence)
                    if key.startswith(TOPIC_KEY):
                        topic, ends = topic_from_record(message)
                        if commit is not None:
                            commit.topics[topic] = ends
                        elif number > self._last_commit():   # its commit compacted away (else: one applied)
                            self._compacted[topic] = ends
                    continue
                commit = Commit.from_record(message)
                if sequence_of(message)[0] != commit.number:
                    raise bad_record(message, f"is commit {commit.number}, but its header says another")
                last = self._last_commit()
                if commit.number <= last:
                    raise UserError(f"commit {commit.number} ({located(message)}) comes after commit {last}: the "
                                    f"topics of {self.settings.name} were deleted and made anew (their commits number "
                                    f"from 1 again), or something else writes them; {self.target.name} holds what the "
                                    f"old ones held: rebuild it from the new ones (run the follower again with "
                                    f"--recopy)")
                commit.topics, self._compacted = self._compacted, {}
                self._commits.append(commit)

    def _last_commit(self) -> int:
        """The number of the last commit read, or applied."""
        return self._commits[-1].number if self._commits else self._positions().get(COMMIT, 0)

    def _stored_offsets(self) -> dict[Partition, int]:
        """The offset the target holds of each partition the follower has read, but those of topics the
        commits stopped listing."""
        stored: dict[Partition, int] = {}
        for name, offset in self._positions().items():
            topic, _, number = name.rpartition(":")
            if topic and number.isdigit() and offset >= 0:   # not the tick, the commit number, nor unlisted
                stored[(topic, int(number))] = offset
        return stored

    def _check_positions(self) -> None:
        """Stops when a stored offset lies past its partition's end, or before its start: the topics were
        deleted and made anew (or records the follower had not read were deleted); and when it holds
        tables but no position: a rebuild killed after it forgot them (a Delta warehouse's)."""
        if not self.recopy and not self._positions() and self.target.tables():
            raise UserError(f"{self.target.name} holds tables but no position of {self.settings.name}: its rebuild "
                            f"(--recopy) was stopped midway; run the follower again with --recopy")
        stored = self._stored_offsets()
        try:
            bounds = partition_bounds(self.settings, stored)
        except KafkaException as exc:
            raise UserError(f"cannot reach Kafka at {self.settings.brokers}: {exc.args[0].str()}") from None
        for tp, (low, high) in bounds.items():   # a dropped table's topic may be gone
            offset = stored[tp]
            if not low <= offset <= high:
                raise UserError(f"{self.target.name} has read {tp[0]}:{tp[1]} up to offset {offset}, but the "
                                f"partition holds offsets {low} to {high}: the topics of {self.settings.name} were "
                                f"deleted and made anew, or records it had not read were deleted; rebuild it from the "
                                f"topics: run the follower again with --recopy")
        if not stored:
            self._bootstrap_began_ms = time.time() * 1000
        try:
            self._read_tombstones_kept()
        except KafkaException as exc:
            raise UserError(f"cannot reach Kafka at {self.settings.brokers}: {exc.args[0].str()}") from None

    def _read_tombstones_kept(self) -> None:
        """How long the table topics the follower has read keep a tombstone, asked of Kafka when it has read
        another topic since, or TOMBSTONES_REREAD seconds after it last asked."""
        topics = {topic for (topic, _) in self._stored_offsets()} - {self._state[0], self._schema[0]}
        if topics == self._tombstones_topics and time.monotonic() - self._tombstones_read < TOMBSTONES_REREAD:
            return
        self._tombstones_kept_ms = tombstones_kept_ms(self.settings, topics, self._undescribed)
        self._tombstones_topics = topics
        self._tombstones_read = time.monotonic()

    def _check_tombstones_kept(self) -> None:
        """Stops before a commit that wrote table topics, older than they keep tombstones (less a tenth, at
        most an hour, for the clocks of the publisher's host and this one): Kafka may have cleaned a delete
        published since the follower last read, record and tombstone, and the follower would keep the
        row deleted. (Commits of an idle queue write no table topic.) A bootstrap reads compacted topics
        from their start: it misses a tombstone only if Kafka removed it while the bootstrap ran
        (compaction removed the row's older records with it, when it first reached it), so its commits
        made before it began are as old as the bootstrap. The commits made since the one applied last
        may be gone from the state topic, compacted away (a follower stopped for days finds the last few
        only): those are as old as just after it."""
        positions = self._positions()
        applied = positions.get(COMMIT, 0)
        compacted = COMMIT_MS in positions and bool(self._commits) and self._commits[0].number > applied + 1
        commit = next((c for c in self._commits if c.written is None or set(c.written) - {self._schema[0]}
                       or set(c.topics) - {self._schema[0]}), None)   # (topics: of commits compacted away too)
        if commit is None and not compacted:
            return
        try:
            self._read_tombstones_kept()
        except KafkaException as exc:   # the last setting read stands; asked again at the next commit
            log.warning("cannot read delete.retention.ms of the topics of %s: %s", self.settings.name,
                        exc.args[0].str())
        kept = self._tombstones_kept_ms
        if kept is None:
            return
        if compacted:
            age = time.time() * 1000 - positions[COMMIT_MS]
            if age > kept - min(kept // 10, 3600 * 1000):
                raise UserError(f"{self.target.name} applied commit {applied} of {self.settings.name} "
                                f"{format_age(age / 1000)} ago, and Kafka has compacted the commits since away: they "
                                f"may have deleted rows longer ago than its topics keep a delete's tombstone "
                                f"(delete.retention.ms: {format_age(kept / 1000)}), their rows kept here; run it "
                                f"again with --recopy (it rebuilds the target from the topics), and raise "
                                f"delete.retention.ms on the topics to stop for longer")
        if commit is None:
            return
        began = self._bootstrap_began_ms
        since = began if began is not None and began > commit.ts_ms else commit.ts_ms
        age = time.time() * 1000 - since
        if age > kept - min(kept // 10, 3600 * 1000):
            when = "published" if since == commit.ts_ms else "its bootstrap began"
            raise UserError(f"{self.target.name} is behind {self.settings.name} by commit {commit.number}, "
                            f"{when} {format_age(age / 1000)} ago, longer than its topics keep a delete's "
                            f"tombstone (delete.retention.ms: {format_age(kept / 1000)}): deletes since may be gone "
                            f"from them, their rows kept here; run it again with --recopy (it rebuilds the target "
                            f"from the topics), and raise delete.retention.ms on the topics to stop for longer")

    def _next_goal(self) -> tuple[Commit, dict[Partition, int], set[str]] | None:
        """The commits to apply next (about BATCH_RECORDS records), as their last commit, the last
        offset at it of each partition they wrote (a new follower: of every partition), and the topics
        they stop listing."""
        if not self._commits:
            return None
        self._check_tombstones_kept()
        records = 0
        taken = 0
        for commit in self._commits:
            taken += 1
            records += commit.records
            if records >= BATCH_RECORDS and not self.recopy:   # a rebuild is one target transaction
                break
        goal = self._commits[taken - 1]
        self._step_commits = {c.number: c for c in self._commits[:taken]}
        del self._commits[:taken]
        # what the commits say last of each topic: where its partitions end, None when no longer listed (a
        # commit Kafka kept has every topic record of commits up to it that compaction left: state.py)
        listed: dict[str, dict[int, int] | None] = {}
        for commit in self._step_commits.values():
            if commit.cumulative:   # a publisher's before topic records: every topic listed, the others dropped
                listed = dict.fromkeys({t for t, _ in self._stored_offsets()}) | commit.offsets
            listed.update(commit.topics)
        return (goal, {(topic, partition): last for topic, parts in listed.items() if parts is not None
                       for partition, last in parts.items()},
                {topic for topic, parts in listed.items() if parts is None})

    # applying --------------------------------------------------------------------------------

    def step(self, wait: float = 0.0) -> FollowStats | None:
        # commits read already are applied at once: only a step with none waits for one to come
        self._read_commits(0.0 if self._commits else wait)
        planned = self._next_goal()
        if planned is None:
            return None
        goal, ends, unlisted = planned
        self._goal = goal
        self._use_envelope(goal)
        started = time.monotonic()
        stats = FollowStats(commit=goal.number, tick=goal.tick)
        with _cycles_uncollected():
            self.target.begin()
            try:
                # every partition assigned at once: their first fetches go together
                self._assign([tp for tp in ends if tp[0] in self._known_topics(ends)] + [self._schema], ends)
                schema_records = list(self._partition(self._schema, ends))
                topics = self._followed_topics(schema_records, ends)
                streams: list[Iterable[Sequenced]] = [[(sequence_of(m), m) for m in schema_records]]
                read = [self._schema] if self._schema in ends else []
                for tp in sorted(ends):
                    if tp[0] in topics:
                        streams.append((sequence_of(m), m) for m in self._partition(tp, ends))
                        read.append(tp)
                if not schema_records:   # most steps: one partition's records, read as they are
                    del streams[0]
                # checked whole before any is applied: of two records of one sequence, neither is
                records = list(streams[0] if len(streams) == 1 else heapq.merge(*streams, key=itemgetter(0)))
                self._check_sequences(records, self._positions().get(COMMIT, 0), goal.number)
                stats.records = self._apply(records, self._tables_held())
                for tp in read:
                    self.target.set_position(self.queue, f"{tp[0]}:{tp[1]}", ends[tp] + 1)
                self._mark_unlisted(unlisted)
                self.target.set_position(self.queue, f"{self._state[0]}:0", goal.offset + 1)
                self.target.set_position(self.queue, TICK, goal.tick)
                self.target.set_position(self.queue, COMMIT_MS, goal.ts_ms)
                # last: the step's own position, rising at each but a rebuild's (a Delta table's txn version)
                self.target.set_position(self.queue, COMMIT, goal.number)
                self.target.commit()
            except BaseException:
                self.target.rollback()
                raise
        if self.recopy:
            log.info("%s rebuilt from the topics of %s, at commit %s", self.target.name, self.settings.name,
                     goal.number)
            self.recopy = False
        stats.seconds = time.monotonic() - started
        stats.lag_seconds = max(0.0, time.time() - goal.ts_ms / 1000)
        return stats

    def _mark_unlisted(self, unlisted: set[str]) -> None:
        """The stored offsets of topics the goal no longer lists, marked (negative, -1 - offset): the topic
        may be deleted and made anew before it is listed again (_offset)."""
        for name, offset in self._positions().items():
            topic, _, number = name.rpartition(":")
            if (topic and number.isdigit() and offset >= 0 and topic in unlisted
                    and topic not in (self._state[0], self._schema[0])):
                self.target.set_position(self.queue, name, -1 - offset)
                self.reader.forget((topic, int(number)))

    def _assign(self, partitions: list[Partition], ends: dict[Partition, int]) -> None:
        self.reader.assign({tp: self._offset(tp) for tp in partitions if tp in ends and self._offset(tp) <= ends[tp]})

    def _partition(self, tp: Partition, ends: dict[Partition, int]) -> Iterator[Message]:
        if tp not in ends or self._offset(tp) > ends[tp]:
            return iter(())
        self._assign([tp], ends)
        records = self.reader.records(tp, ends[tp], self._stalled(tp, ends[tp]))
        return (m for m in records if not self._passed_over(m)) if self.skip else records

    def _stalled(self, tp: Partition, last: int) -> Callable[[float], None]:
        """What a read waiting for tp to reach offset last does each second: stops when asked to, and gives
        up once Kafka, asked after VISIBLE_WAIT seconds, says the partition ends before it (an outage, or a
        partition that has the offset now, is waited out)."""
        patience = VISIBLE_WAIT

        def check(seconds: float) -> None:
            nonlocal patience
            if self._stop.is_set:
                raise run_loop.Stopped
            if seconds <= patience:
                return
            try:
                bounds = partition_bounds(self.settings, [tp])
            except KafkaException as exc:
                self._outage(exc.args[0].str())
                bounds = {tp: (0, last + 1)}
            if bounds.get(tp, (0, 0))[1] > last:   # unreachable, or the offset is there: wait on
                patience = seconds + VISIBLE_WAIT
                return
            assert self._goal is not None
            commit = f"{self._state[0]}:0:{self._goal.offset}"
            raise UserError(f"commit {self._goal.number} ({commit}) says the publisher wrote {tp[0]}:{tp[1]} up "
                            f"to offset {last}, but the partition has ended before it for {VISIBLE_WAIT:.0f}s: "
                            f"the publisher did not write that commit (pass over it with --skip-record {commit}), "
                            f"or the topics were deleted and made anew (rebuild the target: --recopy)")
        return check

    def _use_envelope(self, commit: Commit) -> None:
        """Records are read as the publisher wrote them, which its commits say: with schemas or not,
        numerics as Decimals, strings or doubles."""
        settings = EnvelopeSettings(prefix=self.settings.prefix, database="", schemas=commit.envelope["schemas"],
                                    decimals=commit.envelope["decimals"])
        if settings != self._envelope_settings:
            if settings.decimals == "double":
                log.debug("%s publishes numerics as doubles: followers get them rounded", self.settings.name)
            self._envelope_settings = settings
            self._envelopes.clear()

    def _known_topics(self, ends: dict[Partition, int]) -> set[str]:
        """The table topics to read, as far as known before this step's schema changes: all, or every
        topic the tables followed have had."""
        if self._followed is None:
            return {topic for topic, _ in ends} - {self._state[0], self._schema[0]}
        return {topic for table_id in self._followed for topic in self._topics.get(table_id, ())}

    def _followed_topics(self, schema_records: list[Message], ends: dict[Partition, int]) -> set[str]:
        """The table topics to read: the known ones, and those the followed tables get in these schema
        changes (a renamed table's records go to a new topic; a table created under a name --tables
        lists is followed)."""
        topics = self._known_topics(ends)
        if self._followed is None:
            return topics
        for message in schema_records:
            change = schema_change_of(message)
            table_id, topic = change["table_id"], change.get("topic")
            if (change["call"] == "create" and change["name"] in self.table_filter
                    and where(message)[2] >= self._names_resolved_until):
                self._followed.add(table_id)
            if table_id in self._followed and topic is not None:
                self._topics.setdefault(table_id, set()).add(topic)
                topics.add(topic)
        return topics

    def _check_sequences(self, records: list[Sequenced], applied: int, goal: int) -> None:
        """Each record read must be one the commits after commit `applied` up to commit `goal` cover: of one of
        their numbers, within the count of records its commit gives, and within the offsets and count it
        says it wrote in the record's partition (when the commit is still there to say), and no sequence
        twice, nor one of a record of the state topic."""
        seen: dict[tuple[int, int], Message] = {}
        counts: dict[tuple[int, str, int], int] = {}   # (commit, topic, partition) → records read
        for sequence, message in records:
            number, index = sequence
            commit = self._step_commits.get(number)
            if not applied < number <= goal or (commit is not None and index >= commit.records):
                raise bad_record(message, f"is record {number}.{index}, which no commit from {applied + 1} to "
                                          f"{goal} holds")
            if sequence in self._state_sequences:
                raise bad_record(message, f"is record {number}.{index}, which is a record of the state topic")
            if sequence in seen:
                first, second = located(seen[sequence]), located(message)
                raise UserError(f"records {first} and {second} are both record {number}.{index}: the publisher "
                                f"wrote one of them at most; neither is applied; check which it did not write "
                                f"(docs/kafka.md, Trust model), and run the follower again with --skip-record "
                                f"TOPIC:PARTITION:OFFSET of that one")
            seen[sequence] = message
            if commit is None or commit.written is None:
                continue   # compacted away, or of an older publisher: docs/kafka.md, Trust model
            topic, partition, offset = where(message)
            first_offset, count = commit.written.get(topic, {}).get(partition, (-1, 0))
            # (a topic dropped in its commit is no longer listed: its count bounds it)
            if not first_offset <= offset <= commit.offsets.get(topic, {}).get(partition, offset):
                raise bad_record(message, f"is record {number}.{index}, but commit {number} wrote no record at "
                                          f"that offset of {topic}:{partition}")
            read = counts[(number, topic, partition)] = counts.get((number, topic, partition), 0) + 1
            if read > count:
                raise UserError(f"{topic}:{partition} holds more records of commit {number} than the {count} it "
                                f"wrote there, from offset {first_offset} on: one of them the publisher did not "
                                f"write; none of them is applied; check which (docs/kafka.md, Trust model), and run "
                                f"the follower again with --skip-record TOPIC:PARTITION:OFFSET of that one")
        self._state_sequences = {s for s in self._state_sequences if s[0] > goal}

    def _tables_held(self) -> dict[int, TargetTable]:
        """The target's tables by id; a rebuild (--recopy) drops them, and forgets every position, in the
        transaction that makes them anew from the topics."""
        tables = self.target.tables()
        if not self.recopy:
            return {t.table_id: t for t in tables.values()}
        for table in tables.values():
            self.target.drop_table(table)
        self.target.forget_positions(self.queue)
        return {}

    def _apply(self, records: Iterable[Sequenced], tables: dict[int, TargetTable]) -> int:
        """Applies checked records in order, to the tables held (by id); returns how many."""
        by_topic = {table_topic(self.settings.prefix, t.structure.schema, t.structure.name): t
                    for t in tables.values()}
        changes = _Changes(self.target)
        deletes: dict[tuple[str, int], bytes | None] = {}   # partition → the key of its last record, a delete's
        truncated: set[tuple[int, int]] = set()   # (table id, commit) of each truncate applied
        count = 0
        for (number, _), message in records:
            count += 1
            topic = message.topic()
            table = by_topic.get(topic)  # type: ignore[arg-type]
            if topic != self._schema[0] and table is None and self._followed is not None:
                continue   # a table not followed, before or after a followed one in the same topic
            if topic == self._schema[0]:
                changes.flush()
                self._schema_change(message, tables, by_topic, truncated)
                continue
            if table is None:
                raise UserError(f"{topic} holds changes of a table this follower has no structure of (its schema "
                                f"changes came before this follower's position): rebuild the target (--recopy): "
                                f"a rebuild reads every table the topics list")
            partition: Partition = (topic, message.partition())  # type: ignore[assignment]
            deleted, deletes[partition] = deletes.get(partition), None
            kind, row, old_row = self._decoded(message, table)
            if kind == "tombstone":
                # the row is gone; applied unless it follows its delete record (cleaned away by Kafka after a
                # while: then the tombstone alone says so)
                if deleted != message.key():
                    changes.add(table, "D", row, None)
            elif kind == "T":
                changes.flush()
                self.target.truncate(table)
                truncated.add((table.table_id, number))
            else:
                if kind == "D":
                    deletes[partition] = message.key()
                changes.add(table, kind, row, old_row)
        changes.flush()
        return count

    def _decoded(self, message: Message, table: TargetTable) -> tuple[str, Row, Row | None]:
        """What a change record says: (kind, the key or row, the old row if it carries one); kind I,
        U, R, D, T or tombstone."""
        envelope = self._envelope(table)
        try:
            value = message.value()
            if value is None:
                return "tombstone", envelope.decode_key(data(message.key()), _key_header(message)), None
            # `before` whole: of a delete it is the old row only where the header says so (its key columns are
            # read the same either way), which only a delete's header is asked
            change = envelope.row_change(value, old_row=True)
            if change.op == "d":   # the exact key: a key's fields may not hold it (docs/kafka.md, Key)
                old_row = bool(header_values(message, OLD_ROW_HEADER))
                return "D", envelope.deleted_key(change), change.before if old_row else None
            if change.op == "t":
                return "T", (), None
            if change.op not in _KINDS or change.after is None:
                raise ValueError(f"op {change.op!r} without a row")
            return _KINDS[change.op], change.after, change.before
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            raise bad_record(message, f"is no change of {table.source_name} ({type(exc).__name__}: {exc})") from None

    def _envelope(self, table: TargetTable) -> TableEnvelope:
        envelope = self._envelopes.get(table.table_id)
        if envelope is None or envelope.structure is not table.structure:
            envelope = self._envelopes[table.table_id] = TableEnvelope(table.structure, self._envelope_settings)
        return envelope

    def _schema_change(self, message: Message, tables: dict[int, TargetTable], by_topic: dict[str, TargetTable],
                       truncated: set[tuple[int, int]]) -> None:
        """Repeats the publisher's target call on this follower's target. A create of a table held is a copy
        again, which the publisher marks (`again`), or, before it did, truncated first in the same commit;
        it replaces the table's rows here (the rows before it that the copy lacks are gone)."""
        change = schema_change_of(message)
        call, table_id = change["call"], change["table_id"]
        if self._followed is not None and table_id not in self._followed:
            return
        old = tables.get(table_id)
        if (call == "create" and old is not None and change.get("again") is not True
                and (table_id, sequence_of(message)[0]) not in truncated):
            raise bad_record(message, f"creates {old.source_name} again, which this follower holds, as no copy again "
                                      f"does (applied, it would empty the table)")
        if call == "create" and old is not None:
            # a copy again, published over the rows sinks hold (no truncate before it): this target is
            # told the copy replaces them, as a consumer of the queue tells it (a stream: T, S, the rows)
            self.target.truncate(old)
        if change.get("event") and old is not None:
            self.target.schema_event(old, change["event"])
        structure = TableStructure.from_json(change["structure"])
        new = TargetTable(source_name=change["name"], table_id=table_id, mode=change["mode"],
                          structure=structure, copy_snapshot=None)
        if call == "create":
            self.target.create_table(new)
        elif call == "alter":
            if old is None:
                raise UserError(f"the schema change topic alters table {change['old_name']}, which this follower "
                                f"never saw created: follow into a new target")
            changes = reconcile(old.structure, structure)
            if changes is None:
                raise UserError(f"cannot follow the change of {old.source_name} into {change['name']} in place: "
                                f"follow into a new target")
            self.target.alter_table(old, new, changes)
        elif call == "drop":
            if old is not None:
                self.target.drop_table(old)
            tables.pop(table_id, None)
            by_topic.pop(change["topic"], None)
            return
        elif call == "event":
            return
        else:
            raise UserError(f"the schema change topic holds a change this version of replicator cannot follow "
                            f"({call!r}): upgrade the follower")
        if old is not None:
            by_topic.pop(table_topic(self.settings.prefix, old.structure.schema, old.structure.name), None)
        tables[table_id] = new
        by_topic[change["topic"]] = new

    # running ---------------------------------------------------------------------------------

    def run(self, *, once: bool = False, until_caught_up: bool = False, stop: StopFlag | None = None) -> int:
        """Runs until stopped, for one step (once), or until every commit made before the call is
        applied (until_caught_up). Returns the number of steps that applied something."""
        stop = self._stop = stop or StopFlag()
        self._check_positions()
        applied = run_loop.run(self, stop, once=once, until_caught_up=until_caught_up)
        if self.recopy:
            log.warning("%s has no commit to rebuild %s from: it is left as it was", self.settings.name,
                        self.target.name)
        for record in sorted(self.skip - self._skipped):
            log.warning("--skip-record %s: no such record was read (the follower is past it, or it is not there)",
                        record)
        return applied

    # what run_loop asks of an Applier

    idle_pause = 0.0   # a step waits for commits itself, up to poll_interval

    def summary(self) -> _Summary:
        return _Summary(self.target.name, self.settings.name, time.monotonic())

    def reconnect(self) -> bool:
        return False   # librdkafka reconnects by itself; _reachable() tells when Kafka is back

    def goal(self, stop: StopFlag) -> int | None:
        """The last commit Kafka holds now, for until_caught_up; None when it holds none."""
        deadline = time.monotonic() + READ_COMMITS_TIMEOUT
        self._read_commits(self.poll_interval)
        while not self.reader.at_end(self._state):
            if time.monotonic() > deadline:
                raise UserError(f"cannot read the commits of {self.settings.name} to their end within "
                                f"{READ_COMMITS_TIMEOUT:.0f}s: is Kafka at {self.settings.brokers} up?")
            self._read_commits(max(self.poll_interval, 0.1))
        return self._commits[-1].number if self._commits else None

    def next_step(self) -> FollowStats | None:
        return self.step(wait=self.poll_interval)

    def stepped(self, stats: FollowStats | None) -> None:
        if self._reachable(applied=stats is not None):
            self.metrics.ran()
        if stats is not None:
            self.metrics.applied(stats.records, stats.records)
            self.metrics.lag(len(self._commits), sum(c.records for c in self._commits), stats.lag_seconds, None)
            log.debug("commit %s (tick %s): %s in %.3fs", stats.commit, stats.tick,
                      counted(stats.records, "record"), stats.seconds)
        elif not self._commits:
            self.metrics.lag(0, 0, 0.0, None)

    def caught_up(self, goal: int, stats: FollowStats | None) -> bool:
        return stats is not None and stats.commit >= goal

    def outage(self, error: Exception) -> str | None:
        return None   # Kafka unreachable is waited out within a step (_outage, _reachable)
