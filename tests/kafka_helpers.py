"""Helpers for the tests of the Kafka publisher and its followers: running a publisher (the real
`replicator` console script), reading what Kafka committed the way any read_committed reader does
(a plain confluent_kafka consumer, not replicator's own reader), decoding the JSON records, and
replaying a table topic into the rows it describes."""

from __future__ import annotations

import json
import subprocess
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition

from consumer_helpers import Daemon, run_cli, wait_until

SEQUENCE_HEADER = "replicator.sequence"
READ_TIMEOUT = 60.0


@dataclass(frozen=True)
class Record:
    """A record as a read_committed consumer got it."""
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: dict[str, bytes]

    @property
    def sequence(self) -> tuple[int, int]:
        """(commit, index) of the publisher's replicator.sequence header: its order among all topics."""
        commit, _, index = self.headers[SEQUENCE_HEADER].partition(b".")
        return int(commit), int(index)

    @property
    def key_payload(self) -> Any:
        return payload(self.key)

    @property
    def value_payload(self) -> Any:
        """The value's payload (None for a tombstone)."""
        return payload(self.value)


def payload(data: bytes | None) -> Any:
    """A JsonConverter record's payload: the document itself without schemas, its `payload` with."""
    if data is None:
        return None
    document = json.loads(data)
    if isinstance(document, dict) and document.keys() == {"schema", "payload"}:
        return document["payload"]
    return document


# How long the broker holds a fetch that finds nothing new (500 ms by default): a reader at a
# partition's end hears so that much later
FETCH_WAIT = {"fetch.wait.max.ms": 10}


def consumer(bootstrap: str, **settings: str | int | bool) -> Consumer:
    """A read_committed consumer assigned by hand (a group of its own: it commits nothing anyone reads)."""
    return Consumer({"bootstrap.servers": bootstrap, "group.id": f"test-reader-{uuid.uuid4()}",
                     "enable.auto.commit": False, "isolation.level": "read_committed", **FETCH_WAIT, **settings})


def read_committed(bootstrap: str, topic: str, isolation: str = "read_committed") -> list[Record]:
    """Every committed record of every partition of the topic, from its start to its end as it is
    now (a read_committed reader's end: the last stable offset), partition by partition. With
    isolation read_uncommitted: every record written, committed or not, to the partitions' ends."""
    reader = consumer(bootstrap, **{"isolation.level": isolation})
    records: list[Record] = []
    try:
        metadata = reader.list_topics(topic, timeout=READ_TIMEOUT).topics.get(topic)
        if metadata is None or metadata.error is not None:
            return []
        ends = {TopicPartition(topic, p): wait_until(lambda p=p: _end_offset(reader, TopicPartition(topic, p)),
                                                     READ_TIMEOUT, f"the end of {topic}[{p}]")[0]
                for p in metadata.partitions}
        ends = {tp: end for tp, end in ends.items() if end > 0}   # empty partitions: nothing to read
        if not ends:
            return []
        reader.assign([TopicPartition(topic, tp.partition, OFFSET_BEGINNING) for tp in ends])

        def at_end() -> bool:
            for message in reader.consume(1000, 0.1):
                if message.error():
                    raise KafkaException(message.error())
                headers = message.headers() or []
                records.append(Record(topic, message.partition() or 0, message.offset() or 0, message.key(),
                                      message.value(), {name: value or b"" for name, value in headers}))
            return all(position.offset >= ends[TopicPartition(topic, position.partition)]
                       for position in reader.position(list(ends)))

        wait_until(at_end, READ_TIMEOUT, f"the end of {topic}", interval=0)
    finally:
        reader.close()
    return sorted(records, key=lambda r: (r.partition, r.offset))


def _end_offset(reader: Consumer, partition: TopicPartition) -> tuple[int] | None:
    """(the partition's end,), None while Kafka says to ask again (a new topic's leader not elected yet)."""
    try:
        _, end = reader.get_watermark_offsets(partition, timeout=READ_TIMEOUT)
    except KafkaException as exc:
        if exc.args[0].retriable():
            return None
        raise
    return (end,)


def in_publishing_order(records: list[Record]) -> list[Record]:
    """Records of several topics (or partitions) in the order the publisher wrote them."""
    return sorted(records, key=lambda r: r.sequence)


def last_commit(bootstrap: str, prefix: str) -> dict[str, Any] | None:
    """The publisher's last commit record (on __replicator.PREFIX), None before its first; returned
    once read_committed readers see every record of every commit so far (where the topic records say
    each partition ends): Kafka ends a transaction partition by partition, after the producer's
    commit has returned, and the last commit names only the partitions it wrote."""
    state = read_committed(bootstrap, f"__replicator.{prefix}")
    commits = [r for r in state if r.key == b"commit"]
    if not commits or commits[-1].value is None:
        return None
    commit: dict[str, Any] = json.loads(commits[-1].value)
    ends = _topic_ends(state) or commit["last"]   # (the topic records hold every commit's last, this one's too)
    reader = consumer(bootstrap)
    try:
        listed = reader.list_topics(timeout=READ_TIMEOUT).topics   # (a topic a test deleted has no end to wait for)
        for topic, offsets in ends.items():
            if topic not in listed:
                continue
            for partition, offset in offsets.items():
                where = TopicPartition(topic, int(partition))
                wait_until(lambda: (_end_offset(reader, where) or (0,))[0] > offset, READ_TIMEOUT,
                           f"the commit's records in {topic}[{partition}]")
    finally:
        reader.close()
    return commit


def topic_ends(bootstrap: str, prefix: str) -> dict[str, dict[str, int]]:
    """Where the publisher's topic records say each partition ends: topic → partition → its last offset."""
    return _topic_ends(read_committed(bootstrap, f"__replicator.{prefix}"))


def _topic_ends(state: list[Record]) -> dict[str, dict[str, int]]:
    """The ends the last record of each topic key says (a record a later one replaced is not read)."""
    last = {(r.key or b"")[len(b"topic:"):].decode(): r.value for r in state if (r.key or b"").startswith(b"topic:")}
    return {topic: json.loads(value) for topic, value in last.items() if value is not None}


def replay(records: list[Record]) -> dict[str, dict[Any, dict[str, Any]]]:
    """The rows a table topic's records leave, as a consumer of Debezium's topics applies them:
    per table topic, {key as JSON text: the row (the last `after`)}; a delete or a tombstone
    removes the key, a truncate every row of its partition. Records in offset order per partition."""
    last = deque(replaying(records), maxlen=1)
    return last[0] if last else {}


def replaying(records: list[Record]) -> Iterator[dict[str, dict[Any, dict[str, Any]]]]:
    """The rows as replay() gives them, after each record in turn: what a sink applying the records
    one by one shows at each point (the same dict, changed in place)."""
    tables: dict[str, dict[Any, dict[str, Any]]] = {}
    partitions: dict[tuple[str, Any], int] = {}
    for record in sorted(records, key=lambda r: (r.topic, r.partition, r.offset)):
        rows = tables.setdefault(record.topic, {})
        key = json.dumps(record.key_payload, sort_keys=True)
        value = record.value_payload
        if value is None or value["op"] == "d":
            rows.pop(key, None)
        elif value["op"] == "t":
            for other in [k for k in rows if partitions[(record.topic, k)] == record.partition]:
                del rows[other]
        else:
            rows[key] = value["after"]
            partitions[(record.topic, key)] = record.partition
        yield tables


def publish(dsn: str, url: str, *args: str, queue: str = "q", timeout: float = 120,
            **env: str) -> subprocess.CompletedProcess[str]:
    """`replicator consume QUEUE --target URL --until-caught-up ARGS` to its end (env: extra variables)."""
    return run_cli(dsn, "consume", queue, "--target", url, "--until-caught-up", *args, timeout=timeout, **env)


def publisher_daemon(dsn: str, url: str, log: Any, *args: str, queue: str = "q") -> Daemon:
    """`replicator consume QUEUE --target URL` running, polling often; its stderr in the file log."""
    return Daemon(dsn, "consume", queue, "--target", url, "--poll-interval", "0.05", *args, log=log)
