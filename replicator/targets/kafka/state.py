"""The publisher's state in __replicator.PREFIX, written in each of its Kafka transactions, so
that it commits with the rows it describes. Compacted, keyed so that no record grows with the
number of tables: a record's size grows with what its transaction wrote or changed only.

- "commit", first of the transaction's records here, one per transaction: the queue, consumer
  and tick it brings Kafka to (the position a restarted publisher resumes from), its number, how
  many records the transaction wrote before it (their indexes, below), the first offset and
  number of records it wrote in each partition (`written`: a follower checks each record against
  them) and the last offset (`last`: how a follower knows it has read the whole transaction:
  Kafka makes a transaction's records visible partition by partition), the partitions it wrote
  only, and the envelope settings.
- "table:NAME", after it, for each table whose entry the transaction changed: the table as a
  file target keeps it; a tombstone for a table no longer replicated (a rename: a tombstone and
  a record). The last of each key is the set a restarted publisher resumes with.
- "topic:TOPIC", last, for each topic the transaction wrote (a table's, the schema change topic):
  where each of its partitions ends (its last offset, as of this commit); a tombstone for a table
  topic no table holds any more (its table dropped: an operator may delete it). The last of each
  key is where every partition ends: what a new follower reads to. Written after the commit:
  compaction removes a record once it has cleaned a later one of its key, and with it the commit
  of that later record's transaction, which comes before it and removes the commits before it:
  while a commit is there, a topic record of a commit up to it is gone only for a later one that
  is up to it too.

Publishers before these keys wrote whole records: "tables" (every table, before the commit),
and commits whose `offsets` held the last offset of every partition written so far (cumulative).
Both are read still: a "tables" record replaces the set (its tombstone empties it), a cumulative
commit every partition's end. The first transaction of a publisher of this version on such a
topic writes every table's and every topic's record, and a tombstone of "tables".

Kafka cannot say which producer wrote a record; a record of a committed transaction is followed,
in its partition, by the transaction's marker, which readers are not given (transactions()): a
commit counts only with one, and a record that does not decode stops a follower at it, named as
--skip-record takes it (bad_record). docs/kafka.md, Trust model.

Every record the publisher writes carries a header SEQUENCE, "COMMIT.INDEX": its transaction
and its place in it. A follower applies the records of all topics in that order.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, IsolationLevel, KafkaError, KafkaException, Message, TopicPartition
from confluent_kafka.admin import (  # type: ignore[attr-defined]  # (OffsetSpec is not in its __all__)
    AdminClient,
    ConfigResource,
    OffsetSpec,
    ResourceType,
)

from replicator.errors import UserError
from replicator.structure import TableStructure
from replicator.targets.kafka.settings import KafkaSettings
from replicator.targets.protocol import TargetTable

log = logging.getLogger("replicator")

SEQUENCE = "replicator.sequence"
COMMIT_KEY = b"commit"
TABLE_KEY = b"table:"     # + the table's name
TOPIC_KEY = b"topic:"     # + the topic's name
TABLES_KEY = b"tables"    # every table, as publishers before TABLE_KEY wrote them (read only)
READ_TIMEOUT = 30.0


@dataclass
class Commit:
    """One Kafka transaction of the publisher."""
    number: int
    queue: str
    consumer: str
    tick: int
    ts_ms: int
    # topic → partition → the last offset this transaction wrote there; in the commits of publishers before
    # topic records (cumulative), the last offset written there so far, in every partition
    offsets: dict[str, dict[int, int]] = field(default_factory=dict)
    envelope: dict[str, Any] = field(default_factory=dict)              # schemas, decimals
    records: int = 0                                                    # in this transaction
    # topic → partition → (first offset, records) this transaction wrote there, but the state topic; None in
    # the commits of publishers before it was written (their records are checked less: docs/kafka.md)
    written: dict[str, dict[int, tuple[int, int]]] | None = None
    offset: int = -1                                                    # of this record in the state topic
    cumulative: bool = False
    # read by a follower: the topic records of this transaction, and of those Kafka compacted the commits of
    # since the commit read before (topic → partition → last offset; None: the topic is no longer listed)
    topics: dict[str, dict[int, int] | None] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps({"commit": self.number, "queue": self.queue, "consumer": self.consumer, "tick": self.tick,
                           "ts_ms": self.ts_ms, "records": self.records, "envelope": self.envelope,
                           "last": {t: {str(p): o for p, o in parts.items()} for t, parts in self.offsets.items()},
                           **({} if self.written is None else {"written": {
                               t: {str(p): list(w) for p, w in parts.items()} for t, parts in self.written.items()}})
                           }).encode()

    @classmethod
    def from_record(cls, message: Message) -> Commit:
        """The commit a record of the state topic holds; a record that holds none is a located UserError."""
        try:
            d = json.loads(data(message.value()))
            cumulative = "offsets" in d
            commit = cls(number=d["commit"], queue=d["queue"], consumer=d["consumer"], tick=d["tick"],
                         ts_ms=d["ts_ms"], records=d["records"], envelope=d["envelope"], offset=where(message)[2],
                         offsets=_partition_offsets(d["offsets" if cumulative else "last"]), cumulative=cumulative)
            if "written" in d:
                commit.written = {t: {int(p): (w[0], w[1]) for p, w in parts.items()}
                                  for t, parts in d["written"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise bad_record(message, f"is no commit ({type(exc).__name__}: {exc})") from None
        numbers = [commit.number, commit.tick, commit.ts_ms, commit.records,
                   *(o for parts in commit.offsets.values() for o in parts.values()),
                   *(n for parts in (commit.written or {}).values() for w in parts.values() for n in w)]
        if (not all(type(n) is int and n >= 0 for n in numbers) or commit.number < 1
                or not isinstance(commit.queue, str) or not isinstance(commit.consumer, str)
                or not isinstance(commit.envelope, dict)
                or commit.envelope.get("decimals") not in ("precise", "string", "double")
                or type(commit.envelope.get("schemas")) is not bool):
            raise bad_record(message, "is no commit (a field is missing or of the wrong type)")
        return commit

    def lists(self, topic: str) -> bool | None:
        """Whether the topic is listed as of this commit (False: its table was dropped), None when the commit
        says nothing of it (a commit of this version: its transaction did not write it)."""
        if self.cumulative:
            return topic in self.offsets
        if topic not in self.topics:
            return None
        return self.topics[topic] is not None


def _partition_offsets(parts_of: dict[str, dict[str, int]]) -> dict[str, dict[int, int]]:
    return {t: _offsets(parts) for t, parts in parts_of.items()}


def _offsets(parts: dict[str, int]) -> dict[int, int]:
    offsets = {int(p): o for p, o in parts.items()}
    if not all(type(o) is int and o >= 0 for o in offsets.values()):
        raise ValueError("an offset is no number")
    return offsets


def table_key(name: str) -> bytes:
    return TABLE_KEY + name.encode()


def topic_key(topic: str) -> bytes:
    return TOPIC_KEY + topic.encode()


def table_to_json(t: TargetTable) -> bytes:
    return json.dumps({"table_id": t.table_id, "mode": t.mode, "structure": t.structure.to_json(),
                       "copy_snapshot": t.copy_snapshot, "copied_over_rows": t.copied_over_rows}).encode()


def _table(name: str, t: dict[str, Any]) -> TargetTable:
    return TargetTable(source_name=name, table_id=t["table_id"], mode=t["mode"],
                       structure=TableStructure.from_json(t["structure"]), copy_snapshot=t["copy_snapshot"],
                       copied_over_rows=t.get("copied_over_rows", False) is True)


def tables_from_record(message: Message) -> dict[str, TargetTable]:
    """The set a "tables" record (of a publisher before TABLE_KEY) holds; empty for its tombstone."""
    try:
        value = message.value()
        return {} if value is None else {name: _table(name, t) for name, t in json.loads(value).items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise bad_record(message, f"is no list of tables ({type(exc).__name__}: {exc})") from None


def table_from_record(message: Message) -> tuple[str, TargetTable | None]:
    """A "table:NAME" record's name and table (None: a tombstone)."""
    try:
        name = data(message.key())[len(TABLE_KEY):].decode()
        value = message.value()
        return name, None if value is None else _table(name, json.loads(value))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise bad_record(message, f"is no table ({type(exc).__name__}: {exc})") from None


def topic_to_json(ends: dict[int, int]) -> bytes:
    return json.dumps({str(p): o for p, o in ends.items()}).encode()


def topic_from_record(message: Message) -> tuple[str, dict[int, int] | None]:
    """A "topic:TOPIC" record's topic and the last offset of each of its partitions (None: a tombstone)."""
    try:
        topic = data(message.key())[len(TOPIC_KEY):].decode()
        value = message.value()
        return topic, None if value is None else _offsets(json.loads(value))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise bad_record(message, f"is no topic's end ({type(exc).__name__}: {exc})") from None


def where(message: Message) -> tuple[str, int, int]:
    """Topic, partition and offset of a record read (a record, not an event, has all three)."""
    topic, partition, offset = message.topic(), message.partition(), message.offset()
    assert topic is not None and partition is not None and offset is not None
    return topic, partition, offset


def located(message: Message) -> str:
    """TOPIC:PARTITION:OFFSET, as --skip-record takes it."""
    topic, partition, offset = where(message)
    return f"{topic}:{partition}:{offset}"


def bad_record(message: Message, what: str) -> UserError:
    """A record replicator's publisher did not write: the follower stops at it, naming the way past."""
    return UserError(f"record {located(message)} {what}: the publisher did not write it (check who may write the "
                     f"topics: docs/kafka.md, Trust model); to pass over it, run the follower again with "
                     f"--skip-record {located(message)}")


def data(value: bytes | str | None) -> bytes:
    """A key or value that cannot be missing (the publisher writes each)."""
    if value is None:
        raise ValueError("no value")
    return value.encode() if isinstance(value, str) else value


def header_values(message: Message, header: str) -> list[str | bytes | None]:
    """The values of a record's headers of that name."""
    headers = message.headers() or []
    return [value for name, value in (headers.items() if isinstance(headers, dict) else headers) if name == header]


def sequence_of(message: Message) -> tuple[int, int]:
    """(commit, index) from a record's SEQUENCE header."""
    # (read for each record a follower reads: one pass over the headers, no list made)
    headers: list[tuple[str, str | bytes | None]] = message.headers() or []  # type: ignore[assignment]  # (read: a list)
    value = None
    count = 0
    for name, header in headers:
        if name == SEQUENCE:
            value, count = header, count + 1
    if count != 1 or value is None:
        raise bad_record(message, f"has no {SEQUENCE} header, or more than one")
    commit, dot, index = data(value).partition(b".")
    if not (dot and commit.isdigit() and index.isdigit()):
        raise bad_record(message, f"has a {SEQUENCE} header that is not COMMIT.INDEX")
    return int(commit), int(index)


def _commit_number(message: Message) -> int | None:
    try:
        return sequence_of(message)[0]
    except UserError:
        return None


def transactions(messages: list[Message], end: int | None) -> tuple[list[tuple[list[Message], bool]], list[Message]]:
    """The state topic's records in runs that one transaction of the publisher ends with, each with whether
    Kafka shows it is one: a run is records of consecutive offsets and one SEQUENCE commit number; the
    transaction's COMMIT marker takes the offset after its last record, which no reader is given, so the
    record read next (or the end, when the partition's end was reached) is at least two offsets further.
    A plain producer's records have no marker. Returns the runs, and the last records, whose run cannot
    be told yet (what follows them has not been read: the end is None)."""
    runs: list[tuple[list[Message], bool]] = []
    run: list[Message] = []
    for i, message in enumerate(messages):
        run.append(message)
        offset = where(message)[2]
        following = where(messages[i + 1])[2] if i + 1 < len(messages) else end
        if following is None:
            return runs, run
        if (following == offset + 1 and i + 1 < len(messages)
                and None is not _commit_number(messages[i + 1]) == _commit_number(message)):
            continue   # the same transaction goes on
        runs.append((run, following >= offset + 2))
        run = []
    return runs, []


# How long a broker holds a fetch that finds nothing new (librdkafka: 500 ms). A partition's end is
# known only from such an empty answer: every read to the end (a publisher's state at its start, a
# follower's tables, a commit checked as a transaction's end) waited it out, a follower's latency
# too. An idle consumer asks ten times a second instead of twice; fetch.wait.max.ms overrides it.
FETCH_WAIT_MS = 100


def committed_consumer(settings: KafkaSettings, **extra: Any) -> Consumer:
    """A consumer of committed records only, assigned by hand, committing nothing to Kafka."""
    settings_: dict[str, Any] = {
        "group.id": "replicator", "enable.auto.commit": False, "enable.auto.offset.store": False,
        "isolation.level": "read_committed", "enable.partition.eof": True, "auto.offset.reset": "earliest",
        "fetch.wait.max.ms": FETCH_WAIT_MS, **extra}
    return settings.make(Consumer, **settings_)


def read_to_end(consumer: Consumer, topic: str, start: int, what: str, brokers: str,
                end: list[int] | None = None) -> Iterator[Message]:
    """The committed records of partition 0 of topic from offset start to its current end (appended to
    `end`, when given)."""
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
                if end is not None:
                    end.append((message.offset() or 0) if error.code() == KafkaError._PARTITION_EOF else 0)
                return
            else:
                raise KafkaException(error)
    finally:
        consumer.unassign()


@dataclass
class PublisherState:
    """What a publisher resumes from: its last commit, tables, and where each partition of the table
    topics ends (topic → partition → last offset), read from the state topic."""
    commit: Commit | None = None
    tables: dict[str, TargetTable] = field(default_factory=dict)
    ends: dict[str, dict[int, int]] = field(default_factory=dict)

    @classmethod
    def read(cls, settings: KafkaSettings, topic: str) -> PublisherState:
        """The last commit, and the tables, that transactions of the publisher wrote; records a plain producer
        wrote to the topic are passed over, said at WARNING (the followers stop at them)."""
        state = cls()
        consumer = committed_consumer(settings)
        end: list[int] = []
        try:
            messages = list(read_to_end(consumer, topic, 0, "the publisher's commits", settings.brokers, end))
        finally:
            consumer.close()
        state._read(messages, end[0] if end else None)
        if state.commit is not None:
            _check_ends(settings, state, topic)
        return state

    def _read(self, messages: list[Message], end: int | None) -> None:
        runs, _ = transactions(messages, end)
        for run, transactional in runs:
            if not transactional:
                log.warning("%s passed over: no transaction of the publisher wrote %s (check who may write "
                            "the topics: docs/kafka.md, Trust model)", ", ".join(located(m) for m in run),
                            "them" if len(run) > 1 else "it")
                continue
            for message in run:
                key = message.key() or b""
                if key == COMMIT_KEY:
                    self.commit = Commit.from_record(message)
                    if self.commit.cumulative:
                        self.ends = dict(self.commit.offsets)
                elif key == TABLES_KEY:
                    self.tables = tables_from_record(message)
                elif key.startswith(TABLE_KEY):
                    name, table = table_from_record(message)
                    _put(self.tables, name, table)
                elif key.startswith(TOPIC_KEY):
                    topic, ends = topic_from_record(message)
                    _put(self.ends, topic, ends)


def _put(entries: dict[str, Any], key: str, value: Any) -> None:
    """A compacted record's value kept under its key, or the key dropped for a tombstone (None)."""
    if value is None:
        entries.pop(key, None)
    else:
        entries[key] = value


def partition_bounds(settings: KafkaSettings, partitions: Iterable[tuple[str, int]]) -> dict[tuple[str, int],
                                                                                        tuple[int, int]]:
    """(first offset, end) of each partition a read_committed reader sees, asked in one request each (a
    partition of a topic deleted is left out)."""
    wanted = [TopicPartition(topic, partition) for topic, partition in partitions]
    if not wanted:
        return {}
    admin = settings.make(AdminClient)
    answers = []
    for spec in (OffsetSpec.earliest(), OffsetSpec.latest()):  # type: ignore[no-untyped-call]
        answers.append(admin.list_offsets({tp: spec for tp in wanted}, isolation_level=IsolationLevel.READ_COMMITTED,
                                          request_timeout=READ_TIMEOUT))
    bounds = {}
    for tp in wanted:
        try:
            bounds[(tp.topic, tp.partition)] = (_answer(answers[0][tp]).offset, _answer(answers[1][tp]).offset)
        except KafkaException as exc:
            if exc.args[0].code() not in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_PARTITION):
                raise
    return bounds


def _answer(future: Future[Any]) -> Any:
    """An admin request's answer. librdkafka may hold an offsets request past its request_timeout
    while the partition's leader is away (until it is back): a follower waiting on it would hang for
    as long, where it is to say Kafka is out of reach and wait on."""
    try:
        return future.result(timeout=READ_TIMEOUT + 5)
    except TimeoutError:
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT, f"no answer within {READ_TIMEOUT + 5:.0f}s")) from None


def tombstones_kept_ms(settings: KafkaSettings, topics: Iterable[str], undescribed: set[str]) -> int | None:
    """How long the topics keep a delete's tombstone once compaction reaches it (the least of their
    delete.retention.ms), asked in one request; None when none of them exists. A topic whose settings
    may not be read is added to `undescribed`, with a warning the first time."""
    wanted = [ConfigResource(ResourceType.TOPIC, topic) for topic in sorted(set(topics))]
    if not wanted:
        return None
    kept = []
    admin = settings.make(AdminClient)   # (kept while its answers come: a client destroyed drops them)
    for resource, future in admin.describe_configs(wanted, request_timeout=READ_TIMEOUT).items():
        try:
            value = _answer(future)["delete.retention.ms"].value
        except KafkaException as exc:
            if exc.args[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED and resource.name not in undescribed:
                undescribed.add(resource.name)
                log.warning("cannot read delete.retention.ms of topic %s (DescribeConfigs not granted: docs/kafka.md, "
                            "Trust model): a follower behind by longer than it keeps tombstones is not stopped",
                            resource.name)
            elif exc.args[0].code() not in (KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.UNKNOWN_TOPIC_OR_PART):
                raise
            continue
        if not (value or "").isdigit():
            raise UserError(f"Kafka says topic {resource.name} keeps tombstones {value!r} ms (delete.retention.ms), "
                            f"not a number: check the topic's settings")
        kept.append(int(value))
    return min(kept, default=None)


def _check_ends(settings: KafkaSettings, state: PublisherState, topic: str) -> None:
    """The ends a publisher writes its topic records from: each within its partition."""
    assert state.commit is not None
    offsets = {(name, partition): offset
               for name, parts in state.ends.items() for partition, offset in parts.items()}
    for (name, partition), (_, end) in partition_bounds(settings, offsets).items():
        if offsets[(name, partition)] >= end:
            raise UserError(f"the state of {topic} (its last commit: {topic}:0:{state.commit.offset}) says offset "
                            f"{offsets[(name, partition)]} of {name}:{partition} was written, but the partition ends "
                            f"at {end}: the publisher did not write that commit, or the topics were deleted and made "
                            f"anew; check who may write the topics (docs/kafka.md, Trust model), or publish to a new "
                            f"prefix")
