"""Targets a consumer applies changes to, each in its own module or folder behind one
small protocol (protocol.py): SQLite (sqlite/), the Delta Lake warehouse (delta/), Kafka
topics (kafka/), streams (stream.py). open_target picks one by its URL, open_views a
target's view store, kafka_source the topics a follower (replicator.follower) reads; the
delta_* functions serve the `delta` commands.

The one way in to delta/ and kafka/ (and to replicator.spark_session) from the rest of
replicator: each is imported here when a URL names it, once its extra's packages are known
to be installed (replicator.extras), so that a base install runs everything else
(lint-imports checks it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from replicator.errors import UserError
from replicator.extras import require
from replicator.source import format_duration
from replicator.targets.protocol import Target
from replicator.views.protocol import ViewStore

if TYPE_CHECKING:
    from replicator.targets.delta.maintenance import Optimized, Vacuumed
    from replicator.targets.kafka.settings import KafkaSettings


# seconds: the shortest --vacuum-every. Each VACUUM lists every file of every table and reads each
# log whole, between batches (they wait meanwhile), and a file becomes deletable only once its
# table's retention (7 days unless set, at least 1s) has passed: more often would mostly list anew
# what the last run kept, at the batches' expense (and, on object storage, in requests).
VACUUM_EVERY_MIN = 60.0


def check_vacuum_every(url: str, seconds: float | None) -> None:
    """A consumer's --vacuum-every (seconds; None: no VACUUM): for a delta: target, at least
    VACUUM_EVERY_MIN. Checked before anything is opened."""
    if seconds is None:
        return
    if url.partition(":")[0] != "delta":
        raise UserError("--vacuum-every applies to a delta: target only (VACUUM deletes the files Delta "
                        "tables no longer use)")
    if not seconds >= VACUUM_EVERY_MIN:
        shown, least = (format_duration(timedelta(seconds=s)) for s in (seconds, VACUUM_EVERY_MIN))
        raise UserError(f"--vacuum-every {shown} is too often: the shortest accepted is {least} (each VACUUM lists "
                        f"every file of the warehouse, between batches; a file is deleted only once its table's "
                        f"retention has passed)")


def open_target(url: str, *, spark_master: str | None = None,
                spark_conf: dict[str, str] | None = None, vacuum_every: float | None = None) -> Target:
    """sqlite:PATH (sqlite:PATH?numeric=text: numeric values as text), jsonl:-, jsonl:PATH,
    tsv:-, tsv:PATH, delta:PATH or delta:s3://BUCKET/PREFIX (Delta Lake tables; Spark, with the
    given master and settings, only for its views; VACUUM between batches every vacuum_every
    seconds, check_vacuum_every), kafka://BROKERS/PREFIX (Kafka topics)."""
    check_vacuum_every(url, vacuum_every)
    scheme, rest = _parse(url)
    if scheme == "sqlite":
        from replicator.targets.sqlite.target import SqliteTarget, parse_url
        path, numeric = parse_url(rest)
        return SqliteTarget(Path(path), numeric=numeric)
    if scheme == "kafka":
        require("kafka", "the Kafka target")
        from replicator.targets.kafka.publisher import KafkaTarget
        from replicator.targets.kafka.settings import parse_url as parse_kafka_url
        return KafkaTarget(parse_kafka_url(url))
    if scheme in ("jsonl", "tsv"):
        from replicator.targets.stream import StreamTarget
        return StreamTarget(rest, scheme)
    require("delta", "the Delta target")
    from replicator.targets.delta.target import DeltaTarget
    return DeltaTarget(rest, spark_master=spark_master, spark_conf=spark_conf, vacuum_every=vacuum_every)


def _parse(url: str) -> tuple[str, str]:
    scheme, sep, rest = url.partition(":")
    if "=" in scheme:   # (not echoed: a database's connection string may hold a password)
        raise UserError("a target is a URL (sqlite:PATH, delta:PATH|URI, jsonl:PATH|-, tsv:PATH|- or "
                        "kafka://BROKERS/PREFIX); the source database is --dsn (or REPLICATOR_DSN)")
    if not sep or not rest:
        raise UserError(f"invalid target {url!r}: use sqlite:PATH, delta:PATH|URI, jsonl:PATH|-, tsv:PATH|- or "
                        f"kafka://BROKERS/PREFIX")
    if scheme == "spark":
        raise UserError(f"the spark: warehouse is replaced by Delta Lake tables: replicate into a new warehouse with "
                        f"--target delta:{rest} (or another path), see docs/delta.md")
    if scheme not in ("sqlite", "jsonl", "tsv", "delta", "kafka"):
        raise UserError(f"unknown target scheme {scheme!r}: use sqlite:, delta:, jsonl:, tsv: or kafka:")
    return scheme, rest


@contextmanager
def open_views(url: str, *, spark_master: str | None = None,
               spark_conf: dict[str, str] | None = None) -> Iterator[ViewStore]:
    """The view store of the target named by URL, for the `view` commands.
    The replica must exist already (a view is defined over replicated tables).
    A Delta warehouse is used without taking the consumer's place: a consumer
    may be writing it meanwhile."""
    scheme, rest = _parse(url)
    if scheme in ("jsonl", "tsv", "kafka"):
        raise UserError(f"a {scheme}: stream has no tables to define views on: use a sqlite: or delta: target")
    if scheme == "sqlite":
        from replicator.targets.sqlite.target import SqliteTarget, is_replica, parse_url

        rest, numeric = parse_url(rest)
        if not is_replica(replica := Path(rest).expanduser()):
            what = "is not a replica" if replica.exists() else "does not exist"
            raise UserError(f"no replica at {rest} (it {what}): views are defined over the tables "
                            f"`replicator consume` replicates into it")
        target = SqliteTarget(Path(rest), numeric=numeric)
        try:
            yield target.views
        finally:
            target.close()
        return
    require("delta", "the Delta target")
    from replicator.spark_session.session import get_session
    from replicator.targets.delta.state import WarehouseState
    from replicator.targets.delta.url import open_storage
    from replicator.targets.delta.url import parse_url as parse_delta_url
    from replicator.targets.delta.views import DeltaViews, ReadWarehouse, Session

    rest = parse_delta_url(rest)[0]   # the kind of tables is the consumer's concern
    try:
        storage = open_storage(rest)
        exists = WarehouseState(storage).exists
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read the Delta warehouse {rest}: {exc}") from None
    if not exists:
        raise UserError(f"no warehouse at {rest}: views are defined over the tables `replicator consume` "
                        f"replicates into it")
    yield DeltaViews(ReadWarehouse(storage),
                     Session(lambda: get_session(spark_master, spark_conf, app_name="replicator view")))


def kafka_source(url: str) -> KafkaSettings:
    """The publisher's topics a follower's --source kafka://BROKERS/PREFIX names."""
    if not url.startswith("kafka:"):   # (not echoed: a database's connection string may hold a password)
        raise UserError("--source takes a publisher's topics, kafka://BROKERS/PREFIX; the source database "
                        "is --dsn (or REPLICATOR_DSN)")
    require("kafka", "a follower of Kafka topics")
    from replicator.targets.kafka.settings import parse_url
    return parse_url(url)


def _warehouse(url: str) -> str:
    """The warehouse a `delta` command's --target delta:PATH|URI names, without its scheme and options."""
    scheme, _, where = url.partition(":")
    if scheme != "delta" or not where:
        raise UserError(f"invalid target {url!r}: use delta:PATH or delta:s3://BUCKET/PREFIX")
    require("delta", "the Delta warehouse")
    from replicator.targets.delta.url import parse_url
    return parse_url(where)[0]   # each table is read and optimized as the kind it is


def delta_uris(url: str) -> tuple[dict[str, str], dict[str, str]]:
    """The warehouse's tables (schema.table) and views, each → the URI of its Delta table."""
    where = _warehouse(url)
    from replicator.targets.delta import reader
    return reader.table_uris(where), reader.view_uris(where)


def delta_versions(url: str, tick: int, consumer: str | None) -> tuple[dict[str, tuple[str, int]],
                                                                         dict[str, tuple[str, int]]]:
    """The warehouse's tables and views as of tick `tick`, each → (its URI, its version then)."""
    where = _warehouse(url)
    from replicator.targets.delta import reader
    return reader.versions_as_of(where, tick, consumer), reader.view_versions_as_of(where, tick, consumer)


def delta_optimize(url: str, tables: list[str] | None, *, everything: bool) -> list[Optimized]:
    """Delta OPTIMIZE of the warehouse's tables (replicator.targets.delta.maintenance)."""
    where = _warehouse(url)
    from replicator.targets.delta import maintenance
    from replicator.targets.delta.url import open_storage
    return maintenance.optimize(open_storage(where), tables, everything=everything)


def delta_vacuum(url: str, *, retention: float | None, force: bool, dry_run: bool) -> list[Vacuumed]:
    """Delta VACUUM of the warehouse's tables (replicator.targets.delta.maintenance)."""
    where = _warehouse(url)
    from replicator.targets.delta import maintenance
    from replicator.targets.delta.url import open_storage
    return maintenance.vacuum(open_storage(where), retention=retention, force=force, dry_run=dry_run)
