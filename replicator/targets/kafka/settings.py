"""A kafka:// URL, as the publisher (--target) and followers (--source) take it:
kafka://BROKER[,BROKER...]/PREFIX[?OPTION=VALUE&...], and the librdkafka settings a user adds.

PREFIX is Debezium's topic.prefix: tables go to PREFIX.schema.table, schema changes
to PREFIX, the publisher's positions to __replicator.PREFIX (topics.py). Options:

  schemas=true|false           JsonConverter's schemas.enable (default true, as Debezium's)
  decimals=precise|string|double   Debezium's decimal.handling.mode (default precise)
  partitions=N                 partitions of each table topic the publisher creates (default 1)
  replication=N                their replication factor (default: the broker's default)
  kafka.NAME=VALUE             a librdkafka setting of CLIENT_SETTINGS, e.g. kafka.security.protocol=SASL_SSL;
                               kafka.socket.timeout.ms is also how long the publisher waits for
                               the brokers before it reports them unavailable (60 s by default)

The same settings come from the environment (REPLICATOR_KAFKA_SASL_PASSWORD: sasl.password) and
from a librdkafka properties file ($REPLICATOR_KAFKA_CONFIG); secrets come only from there, never
from the command line, where ps shows them. A setting outside CLIENT_SETTINGS is refused before
any client is made: the ones replicator's guarantees rest on (isolation.level, transactional.id,
group.id, the brokers), the ones that load code or run commands (plugin.library.paths,
ssl.engine.location, sasl.kerberos.*) and TLS verification switched off.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qsl

from confluent_kafka import KafkaError, KafkaException

from replicator.errors import UserError

# One or two names (Debezium's server.database style), each of letters, digits, '_' and '-', the
# first not starting with "__" (Kafka's internal topics): with at most one dot a prefix's topics
# (PREFIX: 1-2 parts, PREFIX.schema.table: 3-4 parts, __replicator.PREFIX) are never another's.
PREFIX = re.compile(r"(?!__)[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)?")
MAX_PREFIX = 120   # topic names hold at most 249 characters: room for schema and table
_BROKER = re.compile(r"([A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\])(:(?P<port>[0-9]{1,5}))?")
DECIMAL_MODES = ("precise", "string", "double")
_BOOLEANS = {"true": True, "false": False}
Client = TypeVar("Client")
SOCKET_TIMEOUT_MS = 60000     # librdkafka's default socket.timeout.ms
_USAGE = "use kafka://BROKER[,BROKER...]/PREFIX[?schemas=true|false&decimals=precise|string|double&partitions=N]"
ENVIRONMENT = "REPLICATOR_KAFKA_"
CONFIG_FILE = "REPLICATOR_KAFKA_CONFIG"

# The librdkafka settings a user may give (docs/kafka.md lists them): None, any value; else the
# values allowed. An allowlist: a setting librdkafka adds later stays out until it is looked at.
CLIENT_SETTINGS: dict[str, frozenset[str] | None] = {
    name: None for name in (
        # who and how: authentication and TLS (files and secrets, never code)
        "client.id", "client.rack", "security.protocol", "sasl.mechanism", "sasl.mechanisms",
        "sasl.username", "sasl.password", "sasl.oauthbearer.method",
        "sasl.oauthbearer.client.id", "sasl.oauthbearer.client.secret", "sasl.oauthbearer.scope",
        "sasl.oauthbearer.extensions", "sasl.oauthbearer.token.endpoint.url",
        "ssl.ca.location", "ssl.ca.pem", "ssl.crl.location", "ssl.certificate.location", "ssl.certificate.pem",
        "ssl.key.location", "ssl.key.pem", "ssl.key.password", "ssl.keystore.location", "ssl.keystore.password",
        "ssl.curves.list", "ssl.sigalgs.list",
        # the network
        "socket.timeout.ms", "socket.connection.setup.timeout.ms", "socket.keepalive.enable",
        "connections.max.idle.ms", "reconnect.backoff.ms", "reconnect.backoff.max.ms", "retry.backoff.ms",
        "retry.backoff.max.ms", "broker.address.family", "broker.address.ttl", "client.dns.lookup",
        "metadata.max.age.ms", "topic.metadata.refresh.interval.ms",
        # sizes and batching
        "message.max.bytes", "receive.message.max.bytes", "fetch.max.bytes", "max.partition.fetch.bytes",
        "fetch.wait.max.ms", "queued.max.messages.kbytes", "queued.min.messages", "compression.type",
        "compression.codec", "compression.level", "linger.ms", "queue.buffering.max.ms", "batch.size",
        "batch.num.messages", "queue.buffering.max.messages", "queue.buffering.max.kbytes",
        "transaction.timeout.ms",
        # librdkafka's own log (forwarded to logger replicator.kafka): its configuration dump (debug=conf)
        # redacts SECRETS; what else it shows whole (the token endpoint URL) holds none
        "log_level", "debug")
} | {
    # TLS verification may be named, not switched off
    "enable.ssl.certificate.verification": frozenset({"true"}),
    "ssl.endpoint.identification.algorithm": frozenset({"https"}),
}
# librdkafka logs it whole (when a token cannot be fetched, and its configuration under debug=conf):
# it may hold no credentials
TOKEN_ENDPOINT = "sasl.oauthbearer.token.endpoint.url"
# Settings that hold secrets: never on the command line.
SECRETS = frozenset({"sasl.password", "sasl.oauthbearer.client.secret", "ssl.key.password", "ssl.key.pem",
                     "ssl.keystore.password"})
# Why the settings users reach for most are refused (any other outside CLIENT_SETTINGS: not passed on).
_REFUSED = {
    "bootstrap.servers": "the brokers are the URL's BROKER list",
    "metadata.broker.list": "the brokers are the URL's BROKER list",
    "isolation.level": "followers read committed records only (read_committed)",
    "transactional.id": "the publisher's transactions fence another publisher of the prefix",
    "enable.idempotence": "the publisher's exactly once rests on it",
    "group.id": "replicator names its consumer groups",
    "enable.auto.commit": "positions are stored in the target, never in Kafka",
    "enable.auto.offset.store": "positions are stored in the target, never in Kafka",
    "auto.offset.reset": "followers read their topics from where their target says",
    "plugin.library.paths": "it loads code into replicator",
    "interceptors": "it loads code into replicator",
    "ssl.engine.location": "it loads code into replicator",
    "ssl.providers": "it loads code into replicator",
    "sasl.kerberos.kinit.cmd": "it runs a command",
    # librdkafka's Kerberos runs kinit through a shell, the principal and keytab pasted in unquoted
    **dict.fromkeys(("sasl.kerberos.principal", "sasl.kerberos.keytab", "sasl.kerberos.service.name",
                     "sasl.kerberos.min.time.before.relogin"),
                    "Kerberos (GSSAPI) runs a shell command made of these settings"),
    "enable.ssl.certificate.verification": "TLS verification stays on",
    "ssl.cipher.suites": "it can admit ciphers that authenticate no broker (aNULL, @SECLEVEL=0): TLS verification "
                         "stays on (OpenSSL's default list applies)",
    "ssl.endpoint.identification.algorithm": "the brokers' host names are verified (https)",
}


def environment_name(setting: str) -> str:
    """The environment variable a setting may come from: sasl.password: REPLICATOR_KAFKA_SASL_PASSWORD."""
    return ENVIRONMENT + setting.upper().replace(".", "_")


_FROM_ENVIRONMENT = {environment_name(name): name for name in CLIENT_SETTINGS}


@dataclass(frozen=True)
class KafkaSettings:
    brokers: str                  # librdkafka's bootstrap.servers
    prefix: str                   # Debezium's topic.prefix
    schemas: bool = True
    decimals: str = "precise"
    partitions: int = 1
    replication: int = -1         # -1: the broker's default.replication.factor
    # librdkafka settings of CLIENT_SETTINGS (may hold secrets: never shown)
    client: dict[str, str] = field(default_factory=dict, repr=False)

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
        """A librdkafka configuration: the brokers, ours, then the user's settings (CLIENT_SETTINGS
        holds none of those replicator relies on). librdkafka logs through logger "replicator.kafka",
        errors only unless kafka.log_level says otherwise (it retries what it warns of: a coordinator
        still loading, a broker restarting)."""
        return {"bootstrap.servers": self.brokers, "log_level": 3, "logger": logging.getLogger("replicator.kafka"),
                **settings, **self.client}

    def make(self, kind: Callable[[dict[str, Any]], Client], **settings: Any) -> Client:
        """A librdkafka client (Producer, Consumer, AdminClient) of config(**settings): a setting
        librdkafka refuses is one line."""
        try:
            return kind(self.config(**settings))
        except KafkaException as exc:
            error: KafkaError = exc.args[0]
            if error.code() == KafkaError._INVALID_ARG:
                raise UserError(f"invalid Kafka setting: {error.str()} (they are librdkafka's "
                                f"settings, docs/kafka.md)") from None
            raise


def shown(url: str) -> str:
    """A Kafka URL as messages show it: without its options, which may hold settings, nor anything
    before its last '@' whatever slashes precede it (credentials, which parse_url refuses); nothing of
    it when a '?' precedes that '@' (a password holding '?', or an option's value holding '@')."""
    before, at, after = url.rpartition("@")
    if not at:
        return url.partition("?")[0]
    return "…" if "?" in before else f"…@{after.partition('?')[0]}"


def parse_url(url: str, environ: Mapping[str, str] | None = None) -> KafkaSettings:
    """The settings of a kafka://BROKERS/PREFIX?... URL, with the librdkafka settings of the
    environment (os.environ unless given) and of the file $REPLICATOR_KAFKA_CONFIG names; a bad
    one is one line naming what is wrong, never a secret."""
    environ = os.environ if environ is None else environ
    if not url.startswith("kafka://"):
        raise UserError(f"invalid Kafka URL {shown(url)!r}: {_USAGE}")
    base, _, query = url[len("kafka://"):].partition("?")
    if "@" in base:
        raise UserError("the Kafka URL holds credentials (USER:PASSWORD@): the command line shows them to ps "
                        "and logs; set REPLICATOR_KAFKA_SASL_USERNAME and REPLICATOR_KAFKA_SASL_PASSWORD "
                        "instead (docs/kafka.md, Credentials)")
    brokers, _, path = base.partition("/")
    _check_brokers(url, brokers)
    prefix = path.strip("/")
    if not prefix:
        raise UserError(f"invalid Kafka URL {shown(url)!r}: no topic prefix (the PREFIX of the topics "
                        f"PREFIX.schema.table); {_USAGE}")
    if not PREFIX.fullmatch(prefix) or len(prefix) > MAX_PREFIX:
        raise UserError(f"invalid topic prefix {prefix!r}: one name, or two joined by a dot, of at most "
                        f"{MAX_PREFIX} letters, digits, '_' and '-' in all, not starting with '__' (docs/kafka.md)")
    options: dict[str, object] = {}
    from_url: dict[str, str] = {}
    given: set[str] = set()
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name in given:
            raise UserError(f"option {name!r} is given twice in the Kafka URL: give it once")
        given.add(name)
        if name.startswith("kafka."):
            setting = name[len("kafka."):]
            if setting in SECRETS:
                raise UserError(f"{name} in the Kafka URL would show in ps and logs: set {environment_name(setting)} "
                                f"or put it in the file ${CONFIG_FILE} names (docs/kafka.md, Credentials)")
            from_url[setting] = _checked(setting, value, "in the Kafka URL")
        elif name == "schemas":
            if value not in _BOOLEANS:
                raise UserError(f"invalid schemas={value!r} in the Kafka URL: use schemas=true or "
                                f"schemas=false")
            options[name] = _BOOLEANS[value]
        elif name == "decimals":
            if value not in DECIMAL_MODES:
                raise UserError(f"invalid decimals={value!r} in the Kafka URL: use one of "
                                f"{', '.join(DECIMAL_MODES)}")
            options[name] = value
        elif name in ("partitions", "replication"):
            if not value.isdigit() or int(value) < 1:
                raise UserError(f"invalid {name}={value!r} in the Kafka URL: a whole number, at least 1")
            options[name] = int(value)
        else:
            raise UserError(f"unknown option {name!r} in the Kafka URL: use schemas, decimals, partitions, "
                            f"replication or kafka.<librdkafka setting>")
    client = _merged([(f"the file ${CONFIG_FILE} names", _from_file(environ.get(CONFIG_FILE))),
                      ("the environment", _from_environment(environ)), ("the Kafka URL", from_url)])
    return KafkaSettings(brokers=brokers, prefix=prefix, client=client, **options)  # type: ignore[arg-type]


def _check_brokers(url: str, brokers: str) -> None:
    if not brokers or any(not b.strip() for b in brokers.split(",")):
        raise UserError(f"invalid Kafka URL {shown(url)!r}: no broker given; {_USAGE}")
    for broker in brokers.split(","):
        match = _BROKER.fullmatch(broker)
        port = match and match.group("port")
        if match is None or (port is not None and not 0 < int(port) < 65536):
            raise UserError(f"invalid broker {broker!r} in the Kafka URL: HOST, HOST:PORT or "
                            f"[IPV6]:PORT, PORT from 1 to 65535")


def _checked(setting: str, value: str, where: str) -> str:
    """value, if the setting is one a user may give with that value; else one line saying why not,
    showing no value but those the setting allows."""
    allowed = CLIENT_SETTINGS.get(setting)
    if setting not in CLIENT_SETTINGS or (allowed is not None and value not in allowed):
        why = _REFUSED.get(setting, "not one of the librdkafka settings replicator passes on")
        only = f" (only {', '.join(sorted(allowed))})" if allowed else ""
        raise UserError(f"Kafka setting {setting!r} {where} is refused{only}: {why} (docs/kafka.md lists "
                        f"the settings)")
    if setting == TOKEN_ENDPOINT and any(mark in value for mark in "@?"):
        raise UserError(f"Kafka setting {setting!r} {where} is refused with credentials or a query in it: librdkafka "
                        f"logs the URL unredacted; put the client's secret in sasl.oauthbearer.client.secret")
    return value


def _from_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The settings of REPLICATOR_KAFKA_* variables; one of another name is refused (a typo, or a
    setting outside CLIENT_SETTINGS)."""
    settings = {}
    for variable, value in environ.items():
        if not variable.startswith(ENVIRONMENT) or variable == CONFIG_FILE:
            continue
        setting = _FROM_ENVIRONMENT.get(variable)
        if setting is None:
            raise UserError(f"environment variable {variable} names no Kafka setting replicator passes "
                            f"on (docs/kafka.md lists them; REPLICATOR_KAFKA_SASL_PASSWORD is sasl.password)")
        settings[setting] = _checked(setting, value, f"in ${variable}")
    return settings


def _from_file(path: str | None) -> dict[str, str]:
    """The settings of a properties file: NAME=VALUE lines (spaces around NAME and VALUE dropped), blank
    lines, and comments starting with # or !. A line of another syntax, or naming no setting, is named by its
    number only (it may hold a secret)."""
    if not path:
        return {}
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not a text file"
        raise UserError(f"cannot read the Kafka settings file {path} (${CONFIG_FILE}): {reason}") from None
    settings: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith(("#", "!")):
            continue
        name, equals, value = line.partition("=")
        name = name.strip()
        where = f"in {path} line {number}"
        # a line of another syntax ("NAME: VALUE", "NAME VALUE") or a misspelt name may hold a secret:
        # named by its number only
        if not equals or (name not in CLIENT_SETTINGS and name not in _REFUSED):
            raise UserError(f"Kafka settings file {path} line {number} is not NAME=VALUE with NAME a librdkafka "
                            f"setting replicator passes on (docs/kafka.md lists them)")
        if name in settings:
            raise UserError(f"Kafka setting {name!r} is given twice {where}: give it once")
        settings[name] = _checked(name, value.strip(), where)
    return settings


def _merged(sources: list[tuple[str, dict[str, str]]]) -> dict[str, str]:
    """One dictionary of the settings of each source; a setting two sources give differently is refused
    (which to apply would be a guess)."""
    merged: dict[str, str] = {}
    given_in: dict[str, str] = {}
    for where, settings in sources:
        for name, value in settings.items():
            if name in merged and merged[name] != value:
                raise UserError(f"Kafka setting {name!r} is given differently in {given_in[name]} and in {where}: "
                                f"give it once")
            merged[name] = value
            given_in[name] = where
    return merged
