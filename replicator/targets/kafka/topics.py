"""The topics of a prefix, and creating them with the settings each needs.

- PREFIX.schema.table: one per captured table, compacted (cleanup.policy=compact): once
  Kafka has cleaned it, it holds each row's latest record, a delete's tombstone for a
  while, and the last TRUNCATE, which is what a new follower bootstraps from.
- PREFIX: schema changes (Debezium's schema change topic), kept for ever (retention.ms=-1):
  a follower replays a table's structure from it, so none may be cleaned away.
- __replicator.PREFIX: the publisher's commits (state.py), compacted: the last of each
  key is what a publisher resumes from. Named apart so that a subscription to PREFIX\\..*
  (a Connect sink's topics.regex) takes the tables only.

No topic of one prefix is another's: a prefix is one or two names and starts with no "__"
(settings.PREFIX), so PREFIX has one or two parts, a table topic three or four. Kafka also reads '.'
and '_' as one (kafka_name): a topic colliding so with an existing one (prefixes x.y and x_y) is
refused naming both before Kafka is asked; two tables of one prefix whose names map to the same
topic, or to colliding ones, are refused by the publisher (_claim_topic).
"""

from __future__ import annotations

import functools
import math
import re
import time

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]  # not in its stub

from replicator.errors import TargetUnavailable, UserError
from replicator.targets.kafka.settings import KafkaSettings

_NOT_IN_TOPIC = re.compile(r"[^A-Za-z0-9_-]")
LISTING_AGE = 10.0   # seconds a listing of the topics is answered from
ADMIN_TIMEOUT = 30.0   # at most: less when the URL's kafka.socket.timeout.ms says so
# what an admin request fails with while the brokers are away (a restart): the batch is tried again later
_UNREACHABLE = (KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._TIMED_OUT, KafkaError._MSG_TIMED_OUT)


@functools.cache   # a publisher asks for the topic of each row's table
def table_topic(prefix: str, schema: str, table: str) -> str:
    """PREFIX.schema.table, each character a topic name cannot hold replaced by '_' (as Debezium
    does); a dot inside a name too, so that the parts stay apart."""
    return f"{prefix}.{_NOT_IN_TOPIC.sub('_', schema)}.{_NOT_IN_TOPIC.sub('_', table)}"


def kafka_name(topic: str) -> str:
    """A topic's name as Kafka compares them: '.' read as '_' (their metric names would be one), so that
    Kafka refuses PREFIX.a.b_c beside PREFIX.a_b.c, and prefix x_y's topics beside x.y's."""
    return topic.replace(".", "_")


def schema_topic(prefix: str) -> str:
    return prefix


def state_topic(prefix: str) -> str:
    return f"__replicator.{prefix}"


# A delete's tombstone is kept a week (Kafka's default: a day): a follower stopped longer than
# that may miss deletes (docs/kafka.md, "Followers")
TOMBSTONES_KEPT_MS = str(7 * 24 * 3600 * 1000)
TABLE_CONFIG = {"cleanup.policy": "compact", "delete.retention.ms": TOMBSTONES_KEPT_MS}
SCHEMA_CONFIG = {"cleanup.policy": "delete", "retention.ms": "-1", "retention.bytes": "-1"}
# Small segments and an eager cleaner: a publisher starting reads this topic whole. Its tombstones (a
# table topic no longer listed: state.py) are kept as long as the table topics'.
STATE_CONFIG = {"cleanup.policy": "compact", "segment.ms": "600000", "min.cleanable.dirty.ratio": "0.1",
                "delete.retention.ms": TOMBSTONES_KEPT_MS}


class Topics:
    """Creates topics once per process; knows their partition counts. Brokers out of reach are
    TargetUnavailable (a consumer retries the batch); a topic refused is a UserError."""

    def __init__(self, settings: KafkaSettings) -> None:
        self.settings = settings
        self.admin = settings.make(AdminClient)
        self.timeout = min(ADMIN_TIMEOUT, settings.timeout)
        self._partitions: dict[str, int] = {}
        self._listing: dict[str, int] = {}
        self._listed_at = -math.inf

    def ensure(self, topic: str, config: dict[str, str], partitions: int = 1) -> int:
        """Creates topic unless it exists; returns its number of partitions."""
        if topic in self._partitions:
            return self._partitions[topic]
        listing = self._listed(fresh=False)
        count = listing.get(topic)
        if count is None:
            self._refuse_clash(topic, listing)
            count = self._create(topic, config, partitions)
        self._partitions[topic] = count
        return count

    def forget(self, topic: str) -> None:
        """What it knows of a topic an operator may delete now: ensure() looks for it again."""
        self._partitions.pop(topic, None)
        self._listing.pop(topic, None)

    def ensure_table(self, topic: str) -> int:
        return self.ensure(topic, TABLE_CONFIG, self.settings.partitions)

    def _create(self, topic: str, config: dict[str, str], partitions: int) -> int:
        """Creates topic; returns its partition count (the existing topic's, when another made it meanwhile)."""
        futures = self.admin.create_topics([NewTopic(topic, num_partitions=partitions,
                                                     replication_factor=self.settings.replication, config=config)],
                                           request_timeout=self.timeout)
        try:
            futures[topic].result(timeout=self.timeout)
            return partitions
        except KafkaException as exc:
            error = exc.args[0]
        if error.retriable() or error.code() in _UNREACHABLE:
            raise TargetUnavailable(f"cannot create topic {topic} at {self.settings.brokers}: {error.str()}") from None
        listing = self._listed(fresh=True)   # the listing answered from may be older than the topic or its clash
        if error.name() == "TOPIC_ALREADY_EXISTS":
            return listing.get(topic, partitions)
        self._refuse_clash(topic, listing)
        # refused: a policy, an ACL, a bad setting
        raise UserError(f"cannot create topic {topic} at {self.settings.brokers}: {error.str()}") from None

    def _listed(self, fresh: bool) -> dict[str, int]:
        """The partition counts of the brokers' topics, listed again when fresh or LISTING_AGE old: a copy of
        many tables asks for a topic per table, and a listing per topic made it quadratic."""
        if fresh or time.monotonic() - self._listed_at > LISTING_AGE:
            try:
                # all topics: a request naming one may create it with the broker's defaults (auto.create.topics.enable)
                metadata = self.admin.list_topics(timeout=self.timeout)
            except KafkaException as exc:
                raise TargetUnavailable(f"cannot reach Kafka at {self.settings.brokers}: "
                                        f"{exc.args[0].str()}") from None
            self._listing = {name: len(found.partitions) for name, found in metadata.topics.items()
                             if found.error is None}
            self._listed_at = time.monotonic()
        return self._listing

    def _refuse_clash(self, topic: str, listing: dict[str, int]) -> None:
        clash = next((name for name in [*listing, *self._partitions]
                      if name != topic and kafka_name(name) == kafka_name(topic)), None)
        if clash is not None:
            raise UserError(f"topic {topic} would collide with topic {clash} at {self.settings.brokers}: Kafka "
                            f"reads '.' and '_' in topic names as one; publish under a prefix whose topics differ "
                            f"in more than that (docs/kafka.md, The URL)")
