"""The test broker (bin/kafkaserver.py) does what the Kafka publisher and its followers rely on:
transactions that read_committed consumers see whole or not at all, compacted topics, and data
and producer fencing that outlive a crash of the broker."""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from consumer_helpers import wait_until
from kafkaserver import KafkaServer


def create_topic(bootstrap: str, name: str, config: dict[str, str] | None = None) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})   # kept until the answer: its end cancels the request
    admin.create_topics([NewTopic(name, 1, 1, config=config or {})])[name].result(30)


Record = tuple[bytes | None, bytes | None]   # key, value


def read_topic(bootstrap: str, topic: str, isolation: str = "read_committed") -> list[Record]:
    """The (key, value) records of the topic's one partition, from its start to its end as it is now."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{uuid.uuid4()}",
                         "enable.auto.commit": False, "isolation.level": isolation})
    try:
        partition = TopicPartition(topic, 0)
        # read_committed: the end is the last stable offset, where the last transaction's marker ends
        _, end = consumer.get_watermark_offsets(partition, timeout=30)
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        records: list[Record] = []

        def at_end() -> bool:
            message = consumer.poll(0.2)
            if message is not None:
                if message.error():
                    raise KafkaException(message.error())
                records.append((message.key(), message.value()))
            (position,) = consumer.position([partition])
            return position.offset >= end

        wait_until(at_end, 30, f"the end of {topic} (offset {end})", interval=0)
        return records
    finally:
        consumer.close()


def transactional_producer(bootstrap: str, transactional_id: str) -> Producer:
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": transactional_id})
    producer.init_transactions(30)
    return producer


def produce_in_transaction(producer: Producer, topic: str, values: list[bytes], *, commit: bool = True) -> None:
    producer.begin_transaction()
    for value in values:
        producer.produce(topic, value=value)
    if commit:
        producer.commit_transaction(30)
    else:
        producer.flush(30)   # the records reach the broker before they are aborted
        producer.abort_transaction(30)


def test_read_committed_consumer_sees_committed_transactions_and_not_aborted_ones(kafka: KafkaServer,
                                                                                  kafka_prefix: str) -> None:
    topic = f"{kafka_prefix}_events"
    create_topic(kafka.bootstrap, topic)
    producer = transactional_producer(kafka.bootstrap, f"{kafka_prefix}_publisher")
    produce_in_transaction(producer, topic, [b"first", b"second"])
    produce_in_transaction(producer, topic, [b"aborted"], commit=False)
    produce_in_transaction(producer, topic, [b"third"])

    assert [value for _, value in read_topic(kafka.bootstrap, topic)] == [b"first", b"second", b"third"]
    # the aborted record is in the log: read_uncommitted sees it
    assert b"aborted" in [value for _, value in read_topic(kafka.bootstrap, topic, "read_uncommitted")]


def test_compacted_topic_takes_keyed_records_and_soon_keeps_only_each_keys_last(kafka: KafkaServer,
                                                                             kafka_prefix: str) -> None:
    topic = f"{kafka_prefix}_table"
    # a segment per 100 ms, cleaned as soon as any of it is overwritten
    create_topic(kafka.bootstrap, topic, {"cleanup.policy": "compact", "segment.ms": "100",
                                          "min.cleanable.dirty.ratio": "0.01"})
    producer = Producer({"bootstrap.servers": kafka.bootstrap})
    failures: list[KafkaError] = []

    def delivered(error: KafkaError | None, _: object) -> None:
        if error is not None:
            failures.append(error)

    def produce(key: bytes, value: bytes) -> None:
        producer.produce(topic, key=key, value=value, on_delivery=delivered)
        producer.flush(30)

    produce(b"row-1", b"old")
    produce(b"row-1", b"new")
    produce(b"row-2", b"only")
    assert failures == []
    assert read_topic(kafka.bootstrap, topic) == [(b"row-1", b"old"), (b"row-1", b"new"), (b"row-2", b"only")]

    def compacted() -> bool:
        produce(b"row-3", b"rolls the segment")   # only the closed segments are compacted
        return (b"row-1", b"old") not in read_topic(kafka.bootstrap, topic)

    wait_until(compacted, 30, "the log cleaner to drop row-1's old value", interval=0.1)
    assert {key: value for key, value in read_topic(kafka.bootstrap, topic)} == {
        b"row-1": b"new", b"row-2": b"only", b"row-3": b"rolls the segment"}


def test_committed_records_outlive_a_killed_broker_and_a_new_producer_fences_the_old(own_kafka: KafkaServer) -> None:
    bootstrap = own_kafka.bootstrap
    create_topic(bootstrap, "events")
    old = transactional_producer(bootstrap, "publisher")
    produce_in_transaction(old, "events", [b"before the crash"])

    own_kafka.kill()
    own_kafka.restart()

    assert own_kafka.bootstrap == bootstrap
    assert read_topic(bootstrap, "events") == [(None, b"before the crash")]
    new = transactional_producer(bootstrap, "publisher")
    with pytest.raises(KafkaException) as fenced:
        produce_in_transaction(old, "events", [b"from the fenced producer"])
    assert fenced.value.args[0].code() == KafkaError._FENCED
    old.purge()   # its record, never to be sent, and the report that says so: no warning at its end
    old.poll(0)
    produce_in_transaction(new, "events", [b"after the crash"])
    assert read_topic(bootstrap, "events") == [(None, b"before the crash"), (None, b"after the crash")]
