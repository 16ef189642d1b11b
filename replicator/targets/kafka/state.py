"""The publisher's commits in __replicator.PREFIX: what each Kafka transaction holds, written
as its last record, so that it commits with the rows it describes.

Two keys, compacted: "commit", one per transaction: the queue, consumer and tick it brings
Kafka to (the position a restarted publisher resumes from), its number, the last offset the
publisher has written in each partition so far (how a follower knows it has read a whole
transaction: Kafka makes a transaction's records visible partition by partition; and, the
commits before being compacted away, where every partition ends for a new follower) and the
envelope settings; "tables",
written when they change: the tables the publisher replicates, as a file target keeps them.

Every record the publisher writes carries a header SEQUENCE, "COMMIT.INDEX": its transaction
and its place in it. A follower applies the records of all topics in that order.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from replicator.errors import UserError
from replicator.structure import TableStructure
from replicator.targets.kafka.settings import KafkaSettings
from replicator.targets.protocol import TargetTable

SEQUENCE = "replicator.sequence"
COMMIT_KEY = b"commit"
TABLES_KEY = b"tables"
READ_TIMEOUT = 30.0


@dataclass
class Commit:
    """One Kafka transaction of the publisher."""
    number: int
    queue: str
    consumer: str
    tick: int
    ts_ms: int
    # topic → partition → the last offset the publisher wrote there, in this transaction or before
    offsets: dict[str, dict[int, int]] = field(default_factory=dict)
    envelope: dict[str, Any] = field(default_factory=dict)              # schemas, decimals
    records: int = 0                                                    # in this transaction
    offset: int = -1                                                    # of this record in the state topic

    def to_json(self) -> bytes:
        return json.dumps({"commit": self.number, "queue": self.queue, "consumer": self.consumer, "tick": self.tick,
                           "ts_ms": self.ts_ms, "records": self.records, "envelope": self.envelope,
                           "offsets": {t: {str(p): o for p, o in parts.items()} for t, parts in self.offsets.items()}
                           }).encode()

    @classmethod
    def from_json(cls, data: bytes, offset: int) -> Commit:
        d = json.loads(data)
        return cls(number=d["commit"], queue=d["queue"], consumer=d["consumer"], tick=d["tick"], ts_ms=d["ts_ms"],
                   records=d["records"], envelope=d["envelope"], offset=offset,
                   offsets={t: {int(p): o for p, o in parts.items()} for t, parts in d["offsets"].items()})


def tables_to_json(tables: dict[str, TargetTable]) -> bytes:
    return json.dumps({name: {"table_id": t.table_id, "mode": t.mode, "structure": t.structure.to_json(),
                              "copy_snapshot": t.copy_snapshot} for name, t in tables.items()}).encode()


def tables_from_json(data: bytes) -> dict[str, TargetTable]:
    return {name: TargetTable(source_name=name, table_id=t["table_id"], mode=t["mode"],
                              structure=TableStructure.from_json(t["structure"]), copy_snapshot=t["copy_snapshot"])
            for name, t in json.loads(data).items()}


def where(message: Message) -> tuple[str, int, int]:
    """Topic, partition and offset of a record read (a record, not an event, has all three)."""
    topic, partition, offset = message.topic(), message.partition(), message.offset()
    assert topic is not None and partition is not None and offset is not None
    return topic, partition, offset


def data(value: bytes | str | None) -> bytes:
    """A key or value that cannot be missing (the publisher writes each)."""
    if value is None:
        raise UserError("a record replicator's publisher wrote has lost its key or value: the topic holds records "
                        "replicator did not write")
    return value.encode() if isinstance(value, str) else value


def sequence_of(message: Message) -> tuple[int, int]:
    """(commit, index) from a record's SEQUENCE header."""
    headers = message.headers() or []
    for name, value in headers.items() if isinstance(headers, dict) else headers:
        if name == SEQUENCE and value is not None:
            commit, _, index = data(value).partition(b".")
            return int(commit), int(index)
    raise UserError(f"record {message.offset()} of {message.topic()}[{message.partition()}] has no {SEQUENCE} "
                    f"header: the topic holds records replicator's publisher did not write")


def committed_consumer(settings: KafkaSettings, **extra: Any) -> Consumer:
    """A consumer of committed records only, assigned by hand, committing nothing to Kafka."""
    settings_: dict[str, Any] = {
        "group.id": "replicator", "enable.auto.commit": False, "enable.auto.offset.store": False,
        "isolation.level": "read_committed", "enable.partition.eof": True, "auto.offset.reset": "earliest", **extra}
    return settings.make(Consumer, **settings_)


def read_to_end(consumer: Consumer, topic: str, start: int, what: str, brokers: str) -> Iterator[Message]:
    """The committed records of partition 0 of topic from offset start to its current end."""
    consumer.assign([TopicPartition(topic, 0, start)])
    try:
        while True:
            message = consumer.poll(READ_TIMEOUT)
            if message is None:
                raise UserError(f"no answer reading {what} ({topic}) within {READ_TIMEOUT:.0f}s: is Kafka at "
                                f"{brokers} up?")
            error = message.error()
            if error is None:
                yield message
            elif error.code() in (KafkaError._PARTITION_EOF, KafkaError.UNKNOWN_TOPIC_OR_PART):
                return
            else:
                raise KafkaException(error)
    finally:
        consumer.unassign()


@dataclass
class PublisherState:
    """What a publisher resumes from: its last commit and tables, read from the state topic."""
    commit: Commit | None = None
    tables: dict[str, TargetTable] = field(default_factory=dict)

    @classmethod
    def read(cls, settings: KafkaSettings, topic: str) -> PublisherState:
        state = cls()
        consumer = committed_consumer(settings)
        try:
            for message in read_to_end(consumer, topic, 0, "the publisher's commits", settings.brokers):
                value = message.value()
                if value is None:
                    continue
                if message.key() == COMMIT_KEY:
                    state.commit = Commit.from_json(data(value), where(message)[2])
                elif message.key() == TABLES_KEY:
                    state.tables = tables_from_json(data(value))
        finally:
            consumer.close()
        return state
