"""The publisher: a target that writes each batch as one Kafka transaction.

Each row change is a record on its table's topic (PREFIX.schema.table), key and value in
Debezium's JSON envelope (envelope.py); each delete is followed by a tombstone; each
schema change and table copy is a record on the schema change topic (PREFIX). The last
record of the transaction is the commit (state.py): queue, consumer, tick, and the offsets
the transaction wrote. It commits with the rows, so Kafka holds the position of what it
holds: a publisher killed at any point resumes from its last commit (the consumer loop
moves the source consumer to it), and a read_committed reader sees every change once.

One publisher per prefix: its transactional.id, replicator.PREFIX, fences an older one
still running (Kafka aborts what that one had not committed).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from operator import itemgetter
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from replicator.errors import TargetUnavailable, UserError
from replicator.structure import Change
from replicator.targets.crash import crash_point
from replicator.targets.kafka.envelope import EnvelopeSettings, TableEnvelope, schema_change_key, schema_change_value
from replicator.targets.kafka.settings import KafkaSettings
from replicator.targets.kafka.state import (
    COMMIT_KEY,
    SEQUENCE,
    TABLES_KEY,
    Commit,
    PublisherState,
    tables_to_json,
)
from replicator.targets.kafka.topics import SCHEMA_CONFIG, STATE_CONFIG, Topics, schema_topic, state_topic, table_topic
from replicator.targets.protocol import Row, TargetTable, queue_positions

KAFKA_TIMEOUT = 60.0          # seconds a flush or a transaction call may wait for the brokers
_OPS = {"I": "c", "U": "u", "R": "r"}
PRODUCER: dict[str, str | int | float | bool] = {
    "enable.idempotence": True,
    "linger.ms": 5,
    "compression.type": "lz4",
    "partitioner": "murmur2_random",   # the Java client's: a key goes to the partition Kafka's tools expect
    "transaction.timeout.ms": 900000,  # the brokers' default maximum: a table's copy is one transaction
    "queue.buffering.max.messages": 1000000,
}


@dataclass(frozen=True)
class _Event:
    """Where the rows that follow come from."""
    tick: int
    event: int | None
    txid: int | None
    ts_ms: int


def _kafka_error(exc: KafkaException) -> KafkaError:
    error: KafkaError = exc.args[0]
    return error


class KafkaTarget:
    exactly_once = True

    def __init__(self, settings: KafkaSettings) -> None:
        self.settings = settings
        self.name = settings.name
        self.topics = Topics(settings)
        self._state_topic = state_topic(settings.prefix)
        self._schema_topic = schema_topic(settings.prefix)
        self.topics.ensure(self._state_topic, STATE_CONFIG)
        self.topics.ensure(self._schema_topic, SCHEMA_CONFIG)
        self.producer = Producer(settings.config(**{**PRODUCER, "transactional.id": f"replicator.{settings.prefix}"}))
        try:
            self.producer.init_transactions(KAFKA_TIMEOUT)
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
        self._number = state.commit.number if state.commit else 0
        self._index = 0
        self._offsets: dict[tuple[str, int], int] = {}
        self._errors: list[KafkaError] = []
        self._tables_changed = False
        self._pending_event: tuple[TargetTable, dict[str, Any]] | None = None
        self._event = _Event(tick=self._tick(), event=None, txid=None, ts_ms=0)
        self._sources: dict[str, str] = {}

    # where the records come from (replicator.targets.protocol.RecordsOrigin) ------------------

    def origin(self, database: str, queue: str) -> None:
        if database != self._database:
            self._database = database
            self._envelopes.clear()
            self._sources.clear()

    def event(self, tick: int, ev_id: int | None, txid: int | None, ev_time: datetime | None) -> None:
        ts_ms = int((ev_time.timestamp() if ev_time is not None else time.time()) * 1000)
        self._event = _Event(tick=tick, event=ev_id, txid=txid, ts_ms=ts_ms)
        self._sources.clear()

    # state ----------------------------------------------------------------------------------

    def positions(self, queue: str) -> dict[str, int]:
        return queue_positions(self._position, queue)

    def queues(self) -> set[str]:
        return {key.partition("/")[0] for key in self._position}

    def set_position(self, queue: str, consumer: str, tick_id: int) -> None:
        self._position = {f"{queue}/{consumer}": tick_id}

    def tables(self) -> dict[str, TargetTable]:
        return dict(self._tables)

    def save_table(self, table: TargetTable) -> None:
        self._tables[table.source_name] = table
        self._tables_changed = True

    # transactions -----------------------------------------------------------------------------

    def begin(self) -> None:
        self._call(self.producer.begin_transaction)
        self._in_transaction = True
        self._number += 1
        self._index = 0
        self._offsets.clear()
        self._errors.clear()

    def commit(self) -> None:
        if self._pending_event is not None:   # a schema change no table call followed
            self._schema_record("ALTER", "event", self._pending_event[0], {})
        self._flush()
        crash_point("kafka-records-sent")
        ((key, tick),) = self._position.items()
        queue, _, consumer = key.partition("/")
        offsets = {topic: dict(parts) for topic, parts in (self._committed.commit.offsets
                                                           if self._committed.commit else {}).items()}
        for (topic, partition), offset in self._offsets.items():
            offsets.setdefault(topic, {})[partition] = offset
        commit = Commit(number=self._number, queue=queue, consumer=consumer, tick=tick,
                        ts_ms=int(time.time() * 1000), offsets=offsets, envelope=self._envelope_settings,
                        records=self._index)
        self._produce(self._state_topic, COMMIT_KEY, commit.to_json())
        if self._tables_changed:
            self._produce(self._state_topic, TABLES_KEY, tables_to_json(self._tables))
        self._flush()
        crash_point("kafka-commit-sent")
        self._call(self.producer.commit_transaction, KAFKA_TIMEOUT)
        crash_point("kafka-committed")
        self._in_transaction = False
        self._committed = PublisherState(commit=commit, tables=dict(self._tables))
        self._tables_changed = False

    def rollback(self) -> None:
        """Aborts the open transaction (its records are never visible to read_committed readers);
        back to the last commit's tables and position."""
        if self._in_transaction:
            self._in_transaction = False
            # fenced or unreachable: the next publisher's init_transactions aborts it
            with contextlib.suppress(KafkaException):
                self.producer.abort_transaction(KAFKA_TIMEOUT)
        self._number = self._committed.commit.number if self._committed.commit else 0
        self._tables = dict(self._committed.tables)
        self._position = _position_of(self._committed.commit)
        self._tables_changed = False
        self._pending_event = None

    def close(self) -> None:
        if self._in_transaction:
            self.rollback()

    def _call(self, method: Callable[..., None], *args: Any) -> None:
        """A transaction call, retried while Kafka says it may succeed; an outage that outlasts
        KAFKA_TIMEOUT is TargetUnavailable (the consumer aborts and retries the batch later), a
        fenced publisher a UserError."""
        deadline = time.monotonic() + KAFKA_TIMEOUT
        while True:
            try:
                method(*args)
                return
            except KafkaException as exc:
                error = _kafka_error(exc)
                if error.fatal() or error.code() in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED,
                                                     KafkaError.INVALID_PRODUCER_EPOCH):
                    raise UserError(f"another publisher took over {self.name} (transactional.id "
                                    f"replicator.{self.settings.prefix}): this one stops; run one publisher per "
                                    f"prefix") from None
                if error.retriable() and time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
                raise TargetUnavailable(f"Kafka at {self.settings.brokers}: {error.str()}") from None

    def _flush(self) -> None:
        left = self.producer.flush(KAFKA_TIMEOUT)
        if left:
            raise TargetUnavailable(f"Kafka at {self.settings.brokers} took none of the last {left:,} records "
                                    f"within {KAFKA_TIMEOUT:.0f}s")
        if self._errors:
            error = self._errors[0]
            if error.fatal():
                raise UserError(f"publishing to {self.name} failed: {error.str()}")
            raise TargetUnavailable(f"Kafka at {self.settings.brokers}: {error.str()}")

    # records ------------------------------------------------------------------------------------

    def _delivered(self, error: KafkaError | None, message: Message) -> None:
        """Notes the offset of each record written: a partition's reports come in order, so the last
        one noted is its last offset."""
        if error is not None:
            self._errors.append(error)
            return
        self._offsets[(message.topic(), message.partition())] = message.offset()  # type: ignore[index,assignment]

    def _produce(self, topic: str, key: bytes, value: bytes | None, partition: int = -1) -> None:
        headers: list[tuple[str, str | bytes | None]] = [(SEQUENCE, b"%d.%d" % (self._number, self._index))]
        self._index += 1
        while True:
            try:
                self.producer.produce(topic, value, key, partition=partition, headers=headers,
                                      on_delivery=self._delivered)
                return
            except BufferError:   # librdkafka's queue is full: let it send
                self.producer.poll(0.05)
            except KafkaException as exc:
                error = _kafka_error(exc)
                if error.code() == KafkaError.MSG_SIZE_TOO_LARGE:
                    raise UserError(f"a record of {len(value or b''):,} bytes for {topic} is larger than Kafka takes: "
                                    f"raise the producer's limit (?kafka.message.max.bytes=N in the URL) and the "
                                    f"topic's max.message.bytes") from None
                raise

    def _envelope(self, table: TargetTable) -> TableEnvelope:
        envelope = self._envelopes.get(table.source_name)
        if envelope is None or envelope.structure is not table.structure:
            envelope = self._envelopes[table.source_name] = TableEnvelope(table.structure, self._settings())
        return envelope

    def _settings(self) -> EnvelopeSettings:
        return EnvelopeSettings(prefix=self.settings.prefix, database=self._database, schemas=self.settings.schemas,
                                decimals=self.settings.decimals)

    def _source(self, table: TargetTable, envelope: TableEnvelope, snapshot: bool) -> str:
        """The source block of the current event (or of a copy's rows) for table, made once."""
        cached = self._sources.get(table.source_name) if not snapshot else None
        if cached is not None:
            return cached
        e = self._event
        if snapshot:
            source = envelope.source(ts_ms=int(time.time() * 1000), snapshot="true", tick=self._tick(),
                                     event=None, txid=None)
        else:
            source = self._sources[table.source_name] = envelope.source(
                ts_ms=e.ts_ms, snapshot="false", tick=e.tick, event=e.event, txid=e.txid)
        return source

    def _tick(self) -> int:
        return next(iter(self._position.values()), 0)

    def topic(self, table: TargetTable) -> str:
        return table_topic(self.settings.prefix, table.structure.schema, table.structure.name)

    def upsert(self, table: TargetTable, op: str, rows: Iterable[Row]) -> None:
        envelope = self._envelope(table)
        source = self._source(table, envelope, snapshot=op == "R")
        ts_ms = int(time.time() * 1000)
        topic = self.topic(table)
        debezium_op = _OPS[op]
        key_of = itemgetter(*table.structure.key_positions())
        single = len(table.structure.key) == 1
        for row in rows:
            key = key_of(row)
            self._produce(topic, envelope.key((key,) if single else key),
                          envelope.value(debezium_op, row, source, ts_ms))
        self.producer.poll(0)

    def delete(self, table: TargetTable, keys: Iterable[Row]) -> None:
        envelope = self._envelope(table)
        source = self._source(table, envelope, snapshot=False)
        ts_ms = int(time.time() * 1000)
        topic = self.topic(table)
        for values in keys:
            key = envelope.key(values)
            self._produce(topic, key, envelope.delete_value(values, source, ts_ms))
            self._produce(topic, key, None)   # the tombstone: compaction forgets the row
        self.producer.poll(0)

    def truncate(self, table: TargetTable) -> None:
        """A 't' record in every partition of the table's topic: a reader of any partition sees it
        in order with that partition's rows."""
        envelope = self._envelope(table)
        source = self._source(table, envelope, snapshot=False)
        topic = self.topic(table)
        value = envelope.value("t", None, source, int(time.time() * 1000))
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
        event, self._pending_event = self._pending_event, None
        payload = json.loads(json.dumps({"call": call, "table_id": table.table_id, "mode": table.mode,
                                         "name": table.source_name, "structure": table.structure.to_json(),
                                         "event": event[1] if event else None, **replicator}, default=str))
        envelope = self._envelope(table)
        ts_ms = int(time.time() * 1000)
        source = envelope.source(ts_ms=ts_ms, snapshot="false", tick=self._tick(), event=self._event.event,
                                 txid=self._event.txid)
        value = schema_change_value(self._settings(), change=change, structure=table.structure,
                                    ddl=event[1].get("sql") if event else None, source=source, ts_ms=ts_ms,
                                    replicator=payload)
        self._produce(self._schema_topic, schema_change_key(self._settings()), value)

    def _claim_topic(self, table: TargetTable) -> str:
        """The table's topic, unless another table publishes there; one of the same name is the table it
        replaces (dropped and created again in one batch: the consumer makes the new one over the old)."""
        topic = self.topic(table)
        for other in self._tables.values():
            if (other.table_id != table.table_id and other.source_name != table.source_name
                    and self.topic(other) == topic):
                raise UserError(f"{table.source_name} and {other.source_name} would both publish to topic {topic} "
                                f"(characters a topic name cannot hold become '_'): rename one, or replicate it "
                                f"through another queue")
        self.topics.ensure_table(topic)
        return topic

    def create_table(self, table: TargetTable) -> None:
        topic = self._claim_topic(table)
        self.save_table(table)
        self._schema_record("CREATE", "create", table, {"topic": topic})

    def alter_table(self, old: TargetTable, new: TargetTable, changes: list[Change]) -> None:
        topic = self._claim_topic(new)
        self._tables.pop(old.source_name, None)
        self.save_table(new)
        self._schema_record("ALTER", "alter", new, {"topic": topic, "old_name": old.source_name})

    def drop_table(self, table: TargetTable) -> None:
        self._tables.pop(table.source_name, None)
        self._tables_changed = True
        self._schema_record("DROP", "drop", table, {"topic": self.topic(table)})

    def schema_event(self, table: TargetTable, event: dict[str, Any]) -> None:
        """Kept for the schema change record of the table call that follows it (alter, drop, or the
        copy again): one record per change, with the statement as Debezium's `ddl`."""
        self._pending_event = (table, event)


def _position_of(commit: Commit | None) -> dict[str, int]:
    return {} if commit is None else {f"{commit.queue}/{commit.consumer}": commit.tick}


def _options(envelope: dict[str, Any]) -> str:
    return "&".join(f"{k}={str(v).lower()}" for k, v in sorted(envelope.items()))
