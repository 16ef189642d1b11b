"""A kafka:// URL, as the publisher (--target) and followers (--source) take it:
kafka://BROKER[,BROKER...]/PREFIX[?OPTION=VALUE&...].

PREFIX is Debezium's topic.prefix: tables go to PREFIX.schema.table, schema changes
to PREFIX, the publisher's positions to __replicator.PREFIX (topics.py). Options:

  schemas=true|false           JsonConverter's schemas.enable (default true, as Debezium's)
  decimals=precise|string|double   Debezium's decimal.handling.mode (default precise)
  partitions=N                 partitions of each table topic the publisher creates (default 1)
  replication=N                their replication factor (default: the broker's default)
  kafka.NAME=VALUE             any librdkafka setting, e.g. kafka.security.protocol=SASL_SSL;
                               kafka.socket.timeout.ms is also how long the publisher waits for
                               the brokers before it reports them unavailable (60 s by default)

Credentials belong in kafka.* options (or the broker's own means), never in the
target's name: name_of() leaves the options out of what logs and consumer names show.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlsplit

from confluent_kafka import KafkaError, KafkaException

from replicator.errors import UserError

TOPIC_CHARACTERS = re.compile(r"[A-Za-z0-9._-]+")
MAX_PREFIX = 120   # topic names hold at most 249 characters: room for schema and table
DECIMAL_MODES = ("precise", "string", "double")
_BOOLEANS = {"true": True, "false": False}
Client = TypeVar("Client")
SOCKET_TIMEOUT_MS = 60000     # librdkafka's default socket.timeout.ms
_USAGE = "use kafka://BROKER[,BROKER...]/PREFIX[?schemas=true|false&decimals=precise|string|double&partitions=N]"


@dataclass(frozen=True)
class KafkaSettings:
    brokers: str                  # librdkafka's bootstrap.servers
    prefix: str                   # Debezium's topic.prefix
    schemas: bool = True
    decimals: str = "precise"
    partitions: int = 1
    replication: int = -1         # -1: the broker's default.replication.factor
    client: dict[str, str] = field(default_factory=dict)   # kafka.* options

    @property
    def name(self) -> str:
        """What logs, errors and default consumer names show: no options (they may hold secrets)."""
        return f"kafka://{self.brokers}/{self.prefix}"

    @property
    def timeout(self) -> float:
        """Seconds a request may wait for the brokers: librdkafka's socket.timeout.ms (a bad value is
        refused when a client is made)."""
        value = self.client.get("socket.timeout.ms", "")
        return int(value if value.isdigit() else SOCKET_TIMEOUT_MS) / 1000

    def config(self, **settings: Any) -> dict[str, Any]:
        """A librdkafka configuration: the brokers, ours, then the user's kafka.* options. librdkafka
        logs through logger "replicator.kafka", errors only unless kafka.log_level says otherwise (it
        retries what it warns of: a coordinator still loading, a broker restarting)."""
        return {"bootstrap.servers": self.brokers, "log_level": 3, "logger": logging.getLogger("replicator.kafka"),
                **settings, **self.client}

    def make(self, kind: Callable[[dict[str, Any]], Client], **settings: Any) -> Client:
        """A librdkafka client (Producer, Consumer, AdminClient) of config(**settings): a kafka.* option
        librdkafka refuses is one line."""
        try:
            return kind(self.config(**settings))
        except KafkaException as exc:
            error: KafkaError = exc.args[0]
            if error.code() == KafkaError._INVALID_ARG:
                raise UserError(f"invalid kafka.* option in the Kafka URL: {error.str()} (they are librdkafka's "
                                f"settings, docs/kafka.md)") from None
            raise


def shown(url: str) -> str:
    """A Kafka URL as messages show it: without its options, which may hold credentials."""
    return url.partition("?")[0]


def parse_url(url: str) -> KafkaSettings:
    """The settings of a kafka://BROKERS/PREFIX?... URL; a bad one is one line naming what is wrong."""
    if not url.startswith("kafka://"):
        raise UserError(f"invalid Kafka URL {shown(url)!r}: {_USAGE}")
    parts = urlsplit(url)
    brokers = parts.netloc
    prefix = parts.path.strip("/")
    if not brokers or any(not b.strip() for b in brokers.split(",")):
        raise UserError(f"invalid Kafka URL {shown(url)!r}: no broker given; {_USAGE}")
    if not prefix:
        raise UserError(f"invalid Kafka URL {shown(url)!r}: no topic prefix (the PREFIX of the topics "
                        f"PREFIX.schema.table); {_USAGE}")
    if not TOPIC_CHARACTERS.fullmatch(prefix) or prefix in (".", "..") or len(prefix) > MAX_PREFIX:
        raise UserError(f"invalid topic prefix {prefix!r}: at most {MAX_PREFIX} letters, digits, '.', '_' and '-'")
    options: dict[str, object] = {}
    client: dict[str, str] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name.startswith("kafka.") and len(name) > len("kafka."):
            client[name[len("kafka."):]] = value
        elif name == "schemas":
            if value not in _BOOLEANS:
                raise UserError(f"invalid schemas={value!r} in the Kafka URL: use schemas=true or schemas=false")
            options[name] = _BOOLEANS[value]
        elif name == "decimals":
            if value not in DECIMAL_MODES:
                raise UserError(f"invalid decimals={value!r} in the Kafka URL: use one of {', '.join(DECIMAL_MODES)}")
            options[name] = value
        elif name in ("partitions", "replication"):
            if not value.isdigit() or int(value) < 1:
                raise UserError(f"invalid {name}={value!r} in the Kafka URL: a whole number, at least 1")
            options[name] = int(value)
        else:
            raise UserError(f"unknown option {name!r} in the Kafka URL: use schemas, decimals, partitions, "
                            f"replication or kafka.<librdkafka setting>")
    return KafkaSettings(brokers=brokers, prefix=prefix, client=client, **options)  # type: ignore[arg-type]
