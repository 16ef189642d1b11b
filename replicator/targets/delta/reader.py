"""Reading a Delta warehouse: its tables now, or all of them as of one tick.

Every table is a Delta table any Delta reader reads as it is; what replicator
adds is the warehouse's map (``_replicator``): which directory holds which
source table, and, per tick, the version each table was left at. A batch that
changed several tables committed each separately; the versions recorded for a
tick give every table as that tick left it (time travel).

A view's result is a Delta table too (``URI/_views/<name>``), as of its own
tick: the one its last refresh brought it to, which it records; read the
tables as of that tick to read them with it. A view's version as of tick N is
its last refresh at or before N.

Spark: ``read_table(spark, URI, "public.orders")``, ``read_table(..., tick=N)``,
``read_view(spark, URI, "sales")``, ``register_tables(spark, URI)`` (catalog
tables ``replica.orders``..., and the views). Without Spark: ``table_uris(URI)``,
``view_uris(URI)``, ``versions_as_of(URI, tick)`` and ``view_versions_as_of(URI,
tick)`` for delta-rs, Polars, DuckDB.
"""

from __future__ import annotations

from typing import Any

import pyarrow.compute as pc

from replicator.errors import UserError
from replicator.structure import target_table_name
from replicator.targets.delta import log as delta_log
from replicator.targets.delta.state import DIRECTORY, WarehouseState
from replicator.targets.delta.storage import Storage
from replicator.targets.delta.url import open_storage, parse_url
from replicator.targets.delta.view_table import ViewTable, view_directories


def _strip(url: str) -> str:
    return parse_url(url.removeprefix("delta:"))[0]   # a target's ?tables= is no part of where it is


def _state(storage: Storage) -> WarehouseState:
    state = WarehouseState(storage)
    if not state.exists:
        raise UserError(f"{storage.url} is not a replicator Delta warehouse (no {DIRECTORY} table): give the URI "
                        f"of a warehouse `replicator consume --target delta:URI` writes")
    return state


def table_uris(url: str) -> dict[str, str]:
    """Source table name (schema.table) → the URI of its Delta table."""
    storage = open_storage(_strip(url))
    root, _ = storage.delta_rs()
    return {name: f"{root}/{directory}" for directory, name in sorted(_state(storage).directories().items())}


def _find(tables: dict[str, str], table: str) -> str:
    """A table by its source name (schema.table, or table for public) or catalog name (t, schema__t)."""
    for name in tables:
        schema, _, bare = name.partition(".")
        if table in (name, target_table_name(schema, bare)) or (schema == "public" and table == bare):
            return name
    raise UserError(f"no table {table!r} in the warehouse (it has {', '.join(sorted(tables)) or 'none'})")


def versions_as_of(url: str, tick: int, consumer: str | None = None) -> dict[str, tuple[str, int]]:
    """Source table name → (its Delta table's URI, the version tick `tick` left it at), from the
    versions each batch recorded in _replicator: every table as of one tick. `consumer`
    (QUEUE/CONSUMER) picks one consumer's ticks when several write the warehouse."""
    storage = open_storage(_strip(url))
    root, _ = storage.delta_rs()
    return {name: (f"{root}/{directory}", version)
            for directory, (name, version) in sorted(tick_versions(storage, tick, consumer).items())}


def consumer_of(state: WarehouseState, consumer: str | None) -> str:
    """The consumer (QUEUE/CONSUMER) whose ticks to read: the one named, or the warehouse's only one."""
    positions = state.positions()
    if consumer is None:
        if len(positions) != 1:
            raise UserError(f"{state.storage.url} holds the positions of "
                            f"{', '.join(sorted(positions)) or 'no consumer'}: name one (QUEUE/CONSUMER)")
        consumer = next(iter(positions))
    if consumer not in positions:
        raise UserError(f"{state.storage.url} holds no position of consumer {consumer}")
    return consumer


def tick_versions(storage: Storage, tick: int, consumer: str | None = None) -> dict[str, tuple[str, int]]:
    """Directory → (source table name, the version tick `tick` left it at), of the tables the
    warehouse keeps (see versions_as_of)."""
    state = _state(storage)
    consumer = consumer_of(state, consumer)
    position = state.positions()[consumer]
    if tick > position:
        raise UserError(f"tick {tick} is past the warehouse's position (tick {position} of {consumer})")
    rows = state.rows(["consumer", "tick", "table", "directory", "version"])
    rows = rows.filter(pc.and_(pc.equal(rows["consumer"], consumer), pc.less_equal(rows["tick"], tick)))
    latest: dict[str, tuple[int, str, int]] = {}
    for row in rows.to_pylist():
        seen = latest.get(row["directory"])
        if seen is None or (row["tick"], row["version"]) > (seen[0], seen[2]):
            latest[row["directory"]] = (row["tick"], row["table"], row["version"])
    live = state.directories()
    return {directory: (name, version) for directory, (_, name, version) in latest.items() if directory in live}


def view_uris(url: str) -> dict[str, str]:
    """View name → the URI of its Delta table."""
    storage = open_storage(_strip(url))
    _state(storage)
    root, _ = storage.delta_rs()
    found = {}
    for directory in view_directories(storage):
        entry = ViewTable(storage, directory).entry
        if entry is not None:
            found[entry["name"]] = f"{root}/{directory}"
    return dict(sorted(found.items()))


def view_versions_as_of(url: str, tick: int, consumer: str | None = None) -> dict[str, tuple[str, int]]:
    """View name → (its Delta table's URI, the version of its last refresh at or before tick
    `tick`): the view as of that tick, unless it was behind the tables then (`replicator
    view list` says when a view is). Views created after the tick are left out."""
    storage = open_storage(_strip(url))
    state = _state(storage)
    consumer = consumer_of(state, consumer)
    root, _ = storage.delta_rs()
    found = {}
    for directory in view_directories(storage):
        vt = ViewTable(storage, directory)
        entry = vt.entry
        version = _refreshed_by(storage, directory, vt.table.snapshot.version, consumer, tick) if entry else None
        if entry is not None and version is not None:
            found[entry["name"]] = (f"{root}/{directory}", version)
    return dict(sorted(found.items()))


def _refreshed_by(storage: Storage, directory: str, latest: int, consumer: str, tick: int) -> int | None:
    """The last version of a view's table committed for a tick of the consumer at or before
    `tick` (its commits carry txn(consumer, tick)); None when its log holds none. Where log
    cleanup took the commits before a checkpoint, the checkpoint's version stands for the
    refresh its txn records."""
    for version in range(latest, -1, -1):
        try:
            actions = delta_log.read_commit(storage, directory, version)
        except FileNotFoundError:
            kept = delta_log.checkpoints(delta_log.log_names(storage, directory)).get(version + 1)
            if kept is None:
                return None
            at = delta_log.Snapshot(directory)
            delta_log.read_checkpoint(storage, at, kept)
            return version + 1 if at.txns.get(consumer, tick + 1) <= tick else None
        for action in actions:
            txn = action.get("txn")
            if txn and txn["appId"] == consumer and txn["version"] <= tick:
                return version
    return None


def read_view(spark: Any, url: str, view: str, *, tick: int | None = None, consumer: str | None = None) -> Any:
    """A view's rows as a DataFrame: as of its last refresh, or as of tick `tick`."""
    uris = view_uris(url) if tick is None else {n: u for n, (u, _) in view_versions_as_of(url, tick, consumer).items()}
    name = next((n for n in uris if n.lower() == view.lower()), None)
    if name is None:
        raise UserError(f"no view {view!r} in the warehouse{'' if tick is None else f' as of tick {tick}'} "
                        f"(it has {', '.join(sorted(uris)) or 'none'})")
    reader = spark.read.format("delta")
    if tick is not None:
        reader = reader.option("versionAsOf", view_versions_as_of(url, tick, consumer)[name][1])
    return reader.load(_spark_location(uris[name]))


def read_table(spark: Any, url: str, table: str, *, tick: int | None = None, consumer: str | None = None) -> Any:
    """A replicated table as a DataFrame: now, or as of tick `tick` (time travel to the
    version the tick left it at)."""
    if tick is None:
        uris = table_uris(url)
        return spark.read.format("delta").load(_spark_location(uris[_find(uris, table)]))
    versions = versions_as_of(url, tick, consumer)
    uri, version = versions[_find({n: u for n, (u, _) in versions.items()}, table)]
    return spark.read.format("delta").option("versionAsOf", version).load(_spark_location(uri))


def _catalog_names(url: str) -> dict[str, str]:
    """Catalog name (t, schema__t, a view's name) → the Spark location of its Delta table."""
    names = {}
    for source_name, uri in table_uris(url).items():
        schema, _, bare = source_name.partition(".")
        names[target_table_name(schema, bare)] = _spark_location(uri)
    for view, uri in view_uris(url).items():
        names[view] = _spark_location(uri)
    return names


def register_tables(spark: Any, url: str, database: str = "replica") -> list[str]:
    """Registers every table in the session's catalog as ``DATABASE.t`` (``DATABASE.schema__t``
    outside schema public), and every view as ``DATABASE.<view>``, an external table over its
    Delta location (it follows the table as the consumer writes it). A name registered before
    over another location (another warehouse, a table renamed since) is registered again.
    Returns the names registered."""
    from replicator.targets.delta.spark_sql import quote_spark

    spark.sql(f"CREATE DATABASE IF NOT EXISTS {quote_spark(database)}")
    names = []
    for bare, location in _catalog_names(url).items():
        name = f"{quote_spark(database)}.{quote_spark(bare)}"
        if spark.catalog.tableExists(f"{quote_spark(database)}.{quote_spark(bare)}"):
            detail = spark.sql(f"DESCRIBE DETAIL {name}").first()
            if detail is None or _without_scheme(detail["location"]) != _without_scheme(location):
                kind = spark.sql(f"DESCRIBE TABLE EXTENDED {name}").where("col_name = 'Type'").first()
                if kind is None or kind["data_type"] != "EXTERNAL":
                    raise UserError(f"{database}.{bare} is a table of the catalog's own, not one over a warehouse: "
                                    f"register the warehouse in another database (database=...)")
                spark.sql(f"DROP TABLE {name}")   # external: its files stay
        quoted = location.replace("\\", "\\\\").replace("'", "\\'")
        spark.sql(f"CREATE TABLE IF NOT EXISTS {name} USING delta LOCATION '{quoted}'")
        names.append(name)
    return names


def register_views(spark: Any, url: str) -> list[str]:
    """Registers every table and view of the warehouse as a temporary view of the session, named as
    in the catalog (t, schema__t, the view's name): ``spark.sql("SELECT ... FROM orders")``. Returns
    the names registered."""
    names = []
    for name, location in _catalog_names(url).items():
        spark.read.format("delta").load(location).createOrReplaceTempView(name)
        names.append(name)
    return names


def _without_scheme(location: str) -> str:
    return location.removeprefix("file:").rstrip("/")


def _spark_location(uri: str) -> str:
    """A URI as Hadoop names it (s3:// is s3a:// there)."""
    return "s3a://" + uri.removeprefix("s3://") if uri.startswith("s3://") else uri
