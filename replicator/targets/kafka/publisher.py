"""The publisher: a target that writes each batch as one Kafka transaction.

Each row change is a record on its table's topic (PREFIX.schema.table), key and value in
Debezium's JSON envelope (envelope.py); each delete is followed by a tombstone; each
schema change and table copy is a record on the schema change topic (PREFIX). Then the
commit (state.py): queue, consumer, tick, and the offsets the transaction wrote, followed on
its topic by a record per table changed and per topic written. It commits with the rows, so
Kafka holds the position of what it holds: a publisher killed at any point resumes from its
last commit (the consumer loop moves the source consumer to it), and a read_committed reader
sees every change once.

One publisher per prefix: its transactional.id, replicator.PREFIX, fences an older one
still running (Kafka aborts what that one had not committed).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from replicator.errors import TargetUnavailable, UserError
from replicator.structure import Change
from replicator.targets.crash import crash_point
from replicator.targets.kafka.envelope import (
    KEY_HEADER,
    OLD_ROW_HEADER,
    EnvelopeSettings,
    TableEnvelope,
    schema_change_key,
    schema_change_value,
    snapshot_marker,
)
from replicator.targets.kafka.settings import KafkaSettings
from replicator.targets.kafka.state import (
    COMMIT_KEY,
    SEQUENCE,
    TABLES_KEY,
    Commit,
    PublisherState,
    table_key,
    table_to_json,
    topic_key,
    topic_to_json,
)
from replicator.targets.kafka.topics import (
    SCHEMA_CONFIG,
    STATE_CONFIG,
    Topics,
    kafka_name,
    schema_topic,
    state_topic,
    table_topic,
)
from replicator.targets.protocol import OldRows, Row, TargetTable, queue_positions

log = logging.getLogger("replicator")
_OPS = {"I": "c", "U": "u", "R": "r"}
PRODUCER: dict[str, str | int | float | bool] = {
    "enable.idempotence": True,
    "linger.ms": 5,
    "compression.type": "lz4",
    "partitioner": "murmur2_random",   # the Java client's: a key goes to the partition Kafka's tools expect
    "transaction.timeout.ms": 900000,  # the brokers' default maximum: a table's copy is one transaction
    "queue.buffering.max.messages": 1000000,
}
SERVE_EVERY = 1000   # records written between two servings of their delivery reports (commit() serves them all)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


class _Event(NamedTuple):
    """Where the rows that follow come from (made for each event: a tuple is made fastest)."""
    tick: int
    event: int | None
    txid: int | None
    ts_us: int


@dataclass
class _Copy:
    """The copy of a table being published: its last row is held back until the copy's end is
    known (the next record of anything else, or the commit), to be marked the last one."""
    table: TargetTable
    envelope: TableEnvelope
    topic: str
    published: int = 0
    held: Row | None = None


def _now_us() -> int:
    return time.time_ns() // 1000


Headers = tuple[tuple[str, bytes], ...]   # a record's own, besides SEQUENCE
_Record = tuple[bytes, bytes | None, Headers]   # key, value (None: a tombstone), the record's own headers
_OLD_ROW: Headers = ((OLD_ROW_HEADER, b"true"),)


@dataclass
class _HeldRows:
    """The records of an event's updated rows, held until the next call: an UPDATE that changed keys is
    queued as a U event of its new rows and a D event of the old keys no new row kept, and Debezium
    writes the old keys' deletes first."""
    topic: str
    txid: int | None
    records: list[_Record]


def _kafka_error(exc: KafkaException) -> KafkaError:
    error: KafkaError = exc.args[0]
    return error


def _fenced(error: KafkaError) -> bool:
    """Another producer of the transactional id started since this one: another publisher took over."""
    return error.code() in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH)


class KafkaTarget:
    exactly_once = True
    # A renamed table is published anew on its new name's topic (a DROP of the old name): a new
    # follower then finds each table whole on one topic, and a table created later under the old
    # name cannot compact the renamed table's rows away.
    copies_renamed_tables = True
    # A copy again after a schema change is `r` records over the rows sinks hold, never a truncate
    # first (a sink would show the table empty, or lose it, until the copy's rows came); followers
    # replace the table at its create record, marked `again`
    copies_over_rows = True
    # its position is in topics others may be able to write: it must match the source consumer's
    resumes_where_the_source_is = True

    def __init__(self, settings: KafkaSettings) -> None:
        self.settings = settings
        self.name = settings.name
        self.topics = Topics(settings)
        self._timeout = settings.timeout   # a flush or a transaction call waits this long for the brokers
        self._state_topic = state_topic(settings.prefix)
        self._schema_topic = schema_topic(settings.prefix)
        try:
            self.topics.ensure(self._state_topic, STATE_CONFIG)
            self.topics.ensure(self._schema_topic, SCHEMA_CONFIG)
        except TargetUnavailable as exc:
            raise UserError(f"cannot start publishing to {self.name}: {exc}") from None
        try:
            self.producer = self._start_producer()
        except KafkaException as exc:
            raise UserError(f"cannot start publishing to {self.name}: {_kafka_error(exc).str()}") from None
        state = PublisherState.read(settings, self._state_topic)
        self._envelope_settings = {"schemas": settings.schemas, "decimals": settings.decimals}
        if state.commit is not None and state.commit.envelope != self._envelope_settings:
            raise UserError(f"{self.name} was published with {_options(state.commit.envelope)}: publish with the "
                            f"same options (a topic's records must all decode alike), or to another prefix")
        self._committed = state
        self._tables = dict(state.tables)
        self._position = _position_of(state.commit)
        self._database = ""
        self._envelopes: dict[str, TableEnvelope] = {}
        self._in_transaction = False
        self._aborting = False   # an abort an outage cut short, resumed before the next transaction
        # a new producer takes over before the next transaction: this one stopped on a fatal error, or
        # aborted a transaction that wrote records
        self._replace = False
        self._number = state.commit.number if state.commit else 0
        self._index = self._served = 0
        self._offsets: dict[tuple[str, int], int] = {}
        self._written: dict[tuple[str, int], list[int]] = {}   # partition → [first offset, records] of this transaction
        self._dropped_topics: set[str] = set()   # by this transaction
        self._errors: list[tuple[KafkaError, str, int]] = []   # the error, the record's topic and size
        self._unlocated = False   # a record of this transaction delivered at an offset Kafka did not say
        self._on_delivery = self._delivered   # (a bound method made once, not for each record)
        self._tables_changed: set[str] = set()   # the names of the tables saved or dropped in this transaction
        # a schema event, and the event it came in, until the table call that follows it
        self._pending_event: tuple[TargetTable, dict[str, Any], _Event] | None = None
        self._event = _Event(tick=self._tick(), event=None, txid=None, ts_us=0)
        self._sources: dict[str, str] = {}
        self._copy: _Copy | None = None
        self._held: _HeldRows | None = None

    # where the records come from (replicator.targets.protocol.RecordsOrigin) ------------------

    def origin(self, database: str, queue: str) -> None:
        if database != self._database:
            self._database = database
            self._envelopes.clear()
            self._sources.clear()

    def event(self, tick: int, ev_id: int | None, txid: int | None, ev_time: datetime | None) -> None:
        ts_us = (ev_time - _EPOCH) // _MICROSECOND if ev_time is not None else _now_us()
        self._event = _Event(tick, ev_id, txid, ts_us)
        self._sources.clear()

    # state ----------------------------------------------------------------------------------

    def positions(self, queue: str) -> dict[str, int]:
        return queue_positions(self._position, queue)

    def queues(self) -> set[str]:
        return {key.partition("/")[0] for key in self._position}

    def set_position(self, queue: str, consumer: str, tick_id: int) -> None:
        self._position = {f"{queue}/{consumer}": tick_id}

    def forget_positions(self, queue: str) -> None:
        raise UserError(f"{self.name} keeps its position in its commits, which stay: publish to a new prefix to "
                        f"start anew")

    def tables(self) -> dict[str, TargetTable]:
        # copies, and copies kept: the consumer changes its tables in place (copy_snapshot), and a
        # batch rolled back must find the tables as the last commit left them
        return {name: replace(table) for name, table in self._tables.items()}

    def save_table(self, table: TargetTable) -> None:
        self._tables[table.source_name] = replace(table)
        self._tables_changed.add(table.source_name)

    # transactions -----------------------------------------------------------------------------

    def begin(self) -> None:
        if self._aborting:   # on this producer: fenced meanwhile, it stops here (a new one would fence the other)
            self._call(self.producer.abort_transaction, self._timeout)
            self._aborting = False
        if self._replace:
            # first without a producer: a new one fences whoever holds the transactional id now
            self._stop_if_committed_since(PublisherState.read(self.settings, self._state_topic))
            self._stop_if_committed_since(self._replace_producer())
        self._serve(self.producer.poll, 0)   # librdkafka's log lines and errors since
        self._call(self.producer.begin_transaction)
        # until the consumer says where the records come from (a batch's events): from the position
        # the transaction starts at (a table's copy)
        self._event = _Event(tick=self._tick(), event=None, txid=None, ts_us=_now_us())
        self._sources.clear()
        self._copy = None
        self._in_transaction = True
        self._number += 1
        self._index = self._served = 0   # _served: the record index at which delivery reports were last served
        self._offsets.clear()
        self._written.clear()
        self._dropped_topics.clear()
        self._errors.clear()
        self._unlocated = False

    def commit(self) -> None:
        self._release()
        self._end_copy()
        if self._pending_event is not None:   # a schema change no table call followed
            self._schema_record("ALTER", "event", self._pending_event[0], {})
        self._flush()
        crash_point("kafka-records-sent")
        ((key, tick),) = self._position.items()
        queue, _, consumer = key.partition("/")
        last: dict[str, dict[int, int]] = {}
        written: dict[str, dict[int, tuple[int, int]]] = {}
        for (topic, partition), offset in self._offsets.items():
            last.setdefault(topic, {})[partition] = offset
            first, count = self._written[(topic, partition)]
            written.setdefault(topic, {})[partition] = (first, count)
        commit = Commit(number=self._number, queue=queue, consumer=consumer, tick=tick,
                        ts_ms=int(time.time() * 1000), offsets=last, envelope=self._envelope_settings,
                        records=self._index, written=written)
        self._produce(self._state_topic, COMMIT_KEY, commit.to_json())
        # after the commit (state.py): a record per table changed, and per topic written (where its
        # partitions end) or dropped; on a topic of a publisher before these records, every one of them
        whole = self._committed.commit is not None and self._committed.commit.cumulative
        if whole:
            self._produce(self._state_topic, TABLES_KEY, None)
        for name in self._tables if whole else self._tables_changed:
            table = self._tables.get(name)
            self._produce(self._state_topic, table_key(name), None if table is None else table_to_json(table))
        ends = dict(self._committed.ends)
        for topic, parts in last.items():
            ends[topic] = {**ends.get(topic, {}), **parts}
        for topic in self._dropped_topics:
            ends.pop(topic, None)
            self._produce(self._state_topic, topic_key(topic), None)
        for topic in ends if whole else set(last) - self._dropped_topics:
            self._produce(self._state_topic, topic_key(topic), topic_to_json(ends[topic]))
        self._flush()
        crash_point("kafka-commit-sent")
        # Once asked, Kafka may commit the batch whatever this call says: until Kafka says how the
        # transaction ended, neither the batch again nor an abort may follow
        try:
            self._call(self.producer.commit_transaction, self._timeout, until_known=f"the commit of tick {tick}")
        except TargetUnavailable:
            if not self._replace:
                raise
            # a new producer's start ends the transaction, committed if Kafka had the commit: the state says
            held = self._replace_producer(until_known=f"the commit of tick {tick}").commit
            if held is None or held.number != self._number:
                self._in_transaction = False   # ended, aborted, by the new producer's start
                raise
        crash_point("kafka-committed")
        self._in_transaction = False
        self._committed = PublisherState(commit=commit, tables=dict(self._tables), ends=ends)
        self._tables_changed.clear()

    def rollback(self) -> None:
        """Aborts the open transaction (its records are never visible to read_committed readers);
        back to the last commit's tables and position."""
        if self._in_transaction:
            self._in_transaction = False
            self._abort()
        self._number = self._committed.commit.number if self._committed.commit else 0
        self._tables = dict(self._committed.tables)
        self._position = _position_of(self._committed.commit)
        self._tables_changed.clear()
        self._pending_event = None
        self._copy = None
        self._held = None

    def _abort(self) -> None:
        try:
            self.producer.abort_transaction(self._timeout)
        except KafkaException as exc:
            error = _kafka_error(exc)
            if _fenced(error):   # the publisher that took over ended it; the next call here stops this one
                return
            if error.fatal():    # a new producer's start ends it
                self._replace = True
                return
            self._aborting = error.retriable()   # Kafka unreachable
        # A produce Kafka wrote without answering (a broker killed, a connection cut) may have left records in
        # the aborted transaction, whose sequence numbers this producer would send again: Kafka answers those
        # as duplicates, with the aborted records' offsets, and the next commit would lose them. A new
        # producer writes in a new epoch, whose sequences nothing written holds.
        self._replace = self._replace or self._index > 0

    def close(self) -> None:
        if self._in_transaction:
            self.rollback()

    def _stop_if_committed_since(self, state: PublisherState) -> None:
        """Stops when Kafka holds a commit after this publisher's last: its own, whose outcome an error hid
        (the source must be moved to it, as a publisher starting does), or one of another publisher that
        took over meanwhile."""
        held = state.commit
        if held is not None and (self._committed.commit is None or held.number != self._committed.commit.number):
            raise UserError(f"Kafka holds a commit of {self.name} (tick {held.tick}) after this publisher's last: "
                            f"one whose outcome an error hid, or another publisher took over; start it again (it "
                            f"resumes from that tick), one publisher per prefix")

    def _start_producer(self) -> Producer:
        """The transactional producer of replicator.PREFIX, ready: its start fences an older producer
        of the id (another publisher's, or this one's) and ends that one's open transaction,
        committed if its commit had reached Kafka, else aborted."""
        producer = self.settings.make(Producer, **PRODUCER,
                                      **{"transactional.id": f"replicator.{self.settings.prefix}"})
        producer.init_transactions(self._timeout)
        return producer

    def _replace_producer(self, until_known: str = "") -> PublisherState:
        """A new producer for one a fatal error stopped (a broker killed can leave the idempotent producer's
        sequence numbers behind its own, which it cannot recover from) or that aborted records, as a new
        publisher would start; and the state Kafka holds then. With until_known, an outage is waited out."""
        with contextlib.suppress(KafkaException):
            self.producer.purge()

        def start() -> None:
            self.producer = self._start_producer()

        self._call(start, until_known=until_known)
        self._replace = self._aborting = False
        log.info("a new Kafka producer took over")
        return PublisherState.read(self.settings, self._state_topic)

    def _call(self, method: Callable[..., None], *args: Any, until_known: str = "") -> None:
        """A transaction call, retried while Kafka says it may succeed; an outage that outlasts the
        timeout (socket.timeout.ms) is TargetUnavailable (the consumer aborts and retries the batch
        later), a fenced publisher a UserError. With until_known (what the call does), an outage
        is waited out, a line logged each timeout."""
        deadline = time.monotonic() + self._timeout
        while True:
            try:
                method(*args)
                return
            except KafkaException as exc:
                error = _kafka_error(exc)
                if not error.retriable() or error.fatal():
                    raise self._failure(error) from None
                if time.monotonic() >= deadline:
                    if not until_known:
                        raise self._failure(error) from None
                    log.warning("target unavailable (Kafka at %s: %s); %s resumes when Kafka answers",
                                self.settings.brokers, error.str(), until_known)
                    deadline = time.monotonic() + self._timeout
                time.sleep(0.2)

    def _failure(self, error: KafkaError) -> Exception:
        """What an error of Kafka's means: this publisher fenced by another, a UserError (it stops);
        else the brokers cannot take the batch now, TargetUnavailable."""
        if _fenced(error):
            return UserError(f"another publisher took over {self.name} (transactional.id "
                             f"replicator.{self.settings.prefix}): this one stops; run one publisher per prefix")
        if error.fatal():   # this producer can do nothing more: the next transaction starts a new one
            self._replace, self._aborting = True, False
        return TargetUnavailable(f"Kafka at {self.settings.brokers}: {error.str()}")

    def _serve(self, wait: Callable[[float], int], timeout: float) -> int:
        """The producer's poll or flush: delivery reports served, waiting up to timeout. confluent_kafka
        raises a fatal error (this producer fenced) out of them, as a SystemError when a delivery report
        is served after it: caused by it, or with no cause at all (the report's callback cleared it)."""
        try:
            return wait(timeout)
        except KafkaException as exc:
            raise self._failure(_kafka_error(exc)) from None
        except SystemError as exc:
            fatal = exc.__cause__ if isinstance(exc.__cause__, KafkaException) else self._fatal_error()
            if fatal is None:
                raise
            raise self._failure(_kafka_error(fatal)) from None

    def _fatal_error(self) -> KafkaException | None:
        """The fatal error the producer stopped on, if it did: a producer's start asked of one started answers
        with it, else with a state error, at once and changing nothing (librdkafka's transaction states). A
        call that times out is left in progress, blocking every other transaction call: it is called again."""
        for _ in range(3):
            try:
                self.producer.init_transactions(self._timeout)
            except KafkaException as exc:
                error = _kafka_error(exc)
                if error.code() != KafkaError._TIMED_OUT:
                    return exc if error.fatal() else None
        return None

    def _flush(self) -> None:
        left = self._serve(self.producer.flush, self._timeout)
        if left:
            raise TargetUnavailable(f"Kafka at {self.settings.brokers} took none of the last {left:,} records "
                                    f"within {self._timeout:g}s")
        for error, topic, size in self._errors:
            if error.code() == KafkaError.MSG_SIZE_TOO_LARGE:   # the broker's limit, below the producer's
                raise UserError(_too_large(topic, size))
        if self._errors:
            raise self._failure(self._errors[0][0])
        if self._unlocated:   # the commit could not say where the records are: this transaction is aborted
            raise TargetUnavailable(f"Kafka at {self.settings.brokers} took records without saying at which "
                                    f"offsets (a produce it retried); the batch is written again")

    # records ------------------------------------------------------------------------------------

    def _delivered(self, error: KafkaError | None, message: Message) -> None:
        """Notes the offset of each record written: a partition's reports come in order, so the last
        one noted is its last offset, the first one its first in this transaction."""
        if error is not None:
            self._errors.append((error, message.topic() or "", len(message.value() or b"")))
            return
        tp, offset = (message.topic(), message.partition()), message.offset()
        if offset is None:   # a retried produce Kafka had written already (librdkafka: DUPLICATE_SEQUENCE_NUMBER)
            self._unlocated = True
            return
        self._offsets[tp] = offset  # type: ignore[index]
        written = self._written.setdefault(tp, [offset, 0])  # type: ignore[arg-type]
        written[1] += 1

    def _produce(self, topic: str, key: bytes, value: bytes | None, partition: int = -1,
                 headers: Headers = ()) -> None:
        """headers: the record's own, after the SEQUENCE header every record has."""
        if self._copy is not None:   # anything but a copied row: the copy has ended
            self._end_copy()
        all_headers: list[tuple[str, str | bytes | None]] = [(SEQUENCE, b"%d.%d" % (self._number, self._index)),
                                                             *headers]
        self._index += 1
        while True:
            try:
                self.producer.produce(topic, value, key, partition=partition, headers=all_headers,
                                      on_delivery=self._on_delivery)
                return
            except BufferError:   # librdkafka's queue is full: let it send
                self._serve(self.producer.poll, 0.05)
            except KafkaException as exc:
                error = _kafka_error(exc)
                if error.code() == KafkaError.MSG_SIZE_TOO_LARGE:   # the producer's limit
                    raise UserError(_too_large(topic, len(value or b""))) from None
                raise self._failure(error) from None

    def _envelope(self, table: TargetTable) -> TableEnvelope:
        envelope = self._envelopes.get(table.source_name)
        if envelope is None or envelope.structure is not table.structure:
            envelope = self._envelopes[table.source_name] = TableEnvelope(table.structure, self._settings())
        return envelope

    def _settings(self) -> EnvelopeSettings:
        return EnvelopeSettings(prefix=self.settings.prefix, database=self._database, schemas=self.settings.schemas,
                                decimals=self.settings.decimals)

    def _source(self, table: TargetTable, envelope: TableEnvelope) -> str:
        """The source block of the current event for table, made once."""
        cached = self._sources.get(table.source_name)
        if cached is None:
            e = self._event
            cached = self._sources[table.source_name] = envelope.source(
                ts_us=e.ts_us, snapshot="false", tick=e.tick, event=e.event, txid=e.txid)
        return cached

    def _tick(self) -> int:
        return next(iter(self._position.values()), 0)

    def topic(self, table: TargetTable) -> str:
        return table_topic(self.settings.prefix, table.structure.schema, table.structure.name)

    def upsert(self, table: TargetTable, op: str, rows: Iterable[Row], old_rows: OldRows = None) -> None:
        """A record per row. With old rows (--old-rows), an update's `before` is its old row, and an
        updated row without one is a create: its key is new (a key change), as Debezium writes it."""
        self._release()   # (rows held before anything else)
        if op == "R":
            self._copy_rows(table, rows)
            return
        envelope = self._envelope(table)
        source = self._source(table, envelope)
        ts_us = _now_us()
        topic = self.topic(table)
        debezium_op = _OPS[op]
        records: list[_Record]
        if old_rows is None:
            records = [(envelope.row_key(row), envelope.value(debezium_op, row, source, ts_us), ()) for row in rows]
        else:
            records = [(envelope.row_key(row),
                        envelope.value("c" if old is None else debezium_op, row, source, ts_us, old), ())
                       for row, old in zip(rows, old_rows)]
        if op == "U" and self._event.event is not None:   # an event's updated rows: see delete()
            self._held = _HeldRows(topic, self._event.txid, records)
            return
        self._write(topic, records)

    def _copy_rows(self, table: TargetTable, rows: Iterable[Row]) -> None:
        """Rows of a table's copy (op 'r'), each marked where it stands in the copy: a copy is a
        snapshot of one table (Debezium's markers: the first row `first`, the last `last`). The
        last row given is held back: only the next record of anything else, or the commit, says
        it was the copy's last."""
        copy = self._copy
        if copy is None or copy.table.table_id != table.table_id:
            if copy is not None:
                self._end_copy()
            copy = _Copy(table=table, envelope=self._envelope(table), topic=self.topic(table))
        ts_us = _now_us()
        middle = copy.envelope.source(ts_us=ts_us, snapshot="true", tick=self._tick(), event=None, txid=None)
        for row in rows:
            if copy.held is not None:
                self._copy = None   # (not the copy's end)
                self._copied(copy, copy.held, middle, ts_us, last=False)
            copy.held = row
        self._copy = copy
        self._serve(self.producer.poll, 0)

    def _end_copy(self) -> None:
        """The copy's last row, marked so."""
        copy, self._copy = self._copy, None
        if copy is not None and copy.held is not None:
            self._copied(copy, copy.held, None, _now_us(), last=True)

    def _copied(self, copy: _Copy, row: Row, middle: str | None, ts_us: int, *, last: bool) -> None:
        """One copied row's records; middle: the source block of rows neither first nor last."""
        first = copy.published == 0
        copy.published += 1
        if first or last or middle is None:
            source = copy.envelope.source(ts_us=ts_us, tick=self._tick(), event=None, txid=None,
                                          snapshot=snapshot_marker(first_of_snapshot=first, last_of_snapshot=last,
                                                                   first_of_table=first, last_of_table=last))
        else:
            source = middle
        self._produce(copy.topic, copy.envelope.row_key(row), copy.envelope.value("r", row, source, ts_us))

    def delete(self, table: TargetTable, keys: Iterable[Row], old_rows: OldRows = None) -> None:
        """A 'd' record (`before` the old row with --old-rows, else the key) and its tombstone per key.
        The deletes of an UPDATE's old keys come before its new rows, as Debezium writes a key change:
        the rows of the event just before, held, when they are of the same table and transaction and
        none has a key deleted here (operations on other keys commute: a reader ends with the same
        rows, in whichever order it applies them)."""
        envelope = self._envelope(table)
        source = self._source(table, envelope)
        ts_us = _now_us()
        topic = self.topic(table)
        deletes = [(envelope.key(values), envelope.delete_value(values, source, ts_us, old),
                    envelope.key_header(values), old is not None)
                   for values, old in zip(keys, old_rows or itertools.repeat(None))]
        held = self._held
        if held is not None and not (held.topic == topic and held.txid == self._event.txid
                                     and not {d[0] for d in deletes} & {key for key, _, _ in held.records}):
            self._release()
        held, self._held = self._held, None
        # each delete's tombstone: compaction forgets the row; its header holds what the key cannot
        self._write(topic, (record for key, value, key_header, old_row in deletes
                            for record in ((key, value, _OLD_ROW if old_row else ()),
                                           (key, None, () if key_header is None else ((KEY_HEADER, key_header),)))))
        if held is not None:
            self._write(topic, held.records)

    def _release(self) -> None:
        """Writes the updated rows held, which no delete of their UPDATE's old keys followed."""
        held, self._held = self._held, None
        if held is not None:
            self._write(held.topic, held.records)

    def _write(self, topic: str, records: Iterable[_Record]) -> None:
        for key, value, headers in records:
            self._produce(topic, key, value, headers=headers)
        if self._index >= self._served + SERVE_EVERY:   # not at each call: most write one row
            self._serve(self.producer.poll, 0)
            self._served = self._index

    def truncate(self, table: TargetTable) -> None:
        """A 't' record in every partition of the table's topic: a reader of any partition sees it
        in order with that partition's rows."""
        self._release()
        envelope = self._envelope(table)
        source = self._source(table, envelope)
        topic = self.topic(table)
        value = envelope.value("t", None, source, _now_us())
        for partition in range(self.topics.ensure_table(topic)):
            self._produce(topic, envelope.truncate_key(), value, partition)

    def copy_from(self, table: TargetTable, snap: Any, progress: Callable[[int], None]) -> None:
        """The consumer copies through upsert() (op 'r' records)."""
        return None

    # tables and schema changes ---------------------------------------------------------------

    def _schema_record(self, change: str, call: str, table: TargetTable, replicator: dict[str, Any]) -> None:
        """A record on the schema change topic: Debezium's schema change event (change CREATE, ALTER or
        DROP, with the statement of the pending schema event as its ddl), and in its `replicator` member
        the target call a follower repeats (create, alter, drop, or event alone)."""
        self._release()
        pending, self._pending_event = self._pending_event, None
        event, origin = (pending[1], pending[2]) if pending else (None, self._event)
        payload = json.loads(json.dumps({"call": call, "table_id": table.table_id, "mode": table.mode,
                                         "name": table.source_name, "structure": table.structure.to_json(),
                                         "event": event, **replicator}, default=str))
        envelope = self._envelope(table)
        ts_ms = int(time.time() * 1000)
        source = envelope.source(ts_us=origin.ts_us, snapshot="false", tick=origin.tick, event=origin.event,
                                 txid=origin.txid)
        value = schema_change_value(self._settings(), change=change, structure=table.structure,
                                    ddl=event.get("sql") if event else None, source=source, ts_ms=ts_ms,
                                    replicator=payload)
        self._produce(self._schema_topic, schema_change_key(self._settings()), value)

    def _claim_topic(self, table: TargetTable) -> str:
        """The table's topic, unless another table publishes there; one of the same name is the table it
        replaces (dropped and created again in one batch: the consumer makes the new one over the old)."""
        topic = self.topic(table)
        for other in self._tables.values():
            # (a table of the same name is the one this replaces: dropped and created again)
            if other.source_name != table.source_name and kafka_name(self.topic(other)) == kafka_name(topic):
                raise UserError(f"{table.source_name} and {other.source_name} would both publish to topic {topic} "
                                f"(characters a topic name cannot hold become '_', and Kafka reads '.' as '_'): "
                                f"rename one, or replicate it through another queue")
        self.topics.ensure_table(topic)
        self._dropped_topics.discard(topic)   # listed again: written in this transaction
        return topic

    def create_table(self, table: TargetTable) -> None:
        topic = self._claim_topic(table)
        # a table held already is copied again: followers take no other create of a table they hold
        again = any(held.table_id == table.table_id for held in self._tables.values())
        self.save_table(table)
        self._schema_record("CREATE", "create", table, {"topic": topic, **({"again": True} if again else {})})

    def alter_table(self, old: TargetTable, new: TargetTable, changes: list[Change]) -> None:
        topic = self._claim_topic(new)
        self._tables.pop(old.source_name, None)
        self._tables_changed.add(old.source_name)
        self.save_table(new)
        self._schema_record("ALTER", "alter", new, {"topic": topic, "old_name": old.source_name})

    def drop_table(self, table: TargetTable) -> None:
        held = self._tables.get(table.source_name)
        if held is not None and held.table_id == table.table_id:   # not a table of its name created since
            del self._tables[table.source_name]
            self._tables_changed.add(table.source_name)
            self._forget_topic(table)
        self._schema_record("DROP", "drop", table, {"topic": self.topic(table)})

    def _forget_topic(self, table: TargetTable) -> None:
        """The commits stop listing a dropped table's topic (unless a table holds it again): a
        new follower has nothing to read there, and an operator may delete it (it is looked for
        again when a table takes it)."""
        topic = self.topic(table)
        if all(self.topic(other) != topic for other in self._tables.values()):
            self._dropped_topics.add(topic)
            self.topics.forget(topic)

    def schema_event(self, table: TargetTable, event: dict[str, Any]) -> None:
        """Kept for the schema change record of the table call that follows it (alter, drop, or the
        copy again): one record per change, with the statement as Debezium's `ddl`."""
        self._pending_event = (table, event, self._event)


def _position_of(commit: Commit | None) -> dict[str, int]:
    return {} if commit is None else {f"{commit.queue}/{commit.consumer}": commit.tick}


def _too_large(topic: str, size: int) -> str:
    return (f"a record of {size:,} bytes for {topic} is larger than Kafka takes: raise the producer's limit "
            f"(?kafka.message.max.bytes=N in the URL) and the topic's max.message.bytes")


def _options(envelope: dict[str, Any]) -> str:
    return "&".join(f"{k}={str(v).lower()}" for k, v in sorted(envelope.items()))
