"""Reading a Delta warehouse: its tables now, or all of them as of one tick.

Every table is a Delta table any Delta reader reads as it is; what replicator
adds is the warehouse's map (``_replicator``): which directory holds which
source table, and, per tick, the version each table was left at. A batch that
changed several tables committed each separately; the versions recorded for a
tick give every table as that tick left it (time travel).

Spark: ``read_table(spark, URI, "public.orders")``, ``read_table(..., tick=N)``,
``register_tables(spark, URI)`` (catalog tables ``replica.orders``...). Without
Spark: ``table_uris(URI)`` and ``versions_as_of(URI, tick)`` for delta-rs,
Polars, DuckDB.
"""

from __future__ import annotations

from typing import Any

import pyarrow.compute as pc

from replicator.errors import UserError
from replicator.structure import target_table_name
from replicator.targets.delta.state import DIRECTORY, WarehouseState
from replicator.targets.delta.storage import Storage, open_storage


def _strip(url: str) -> str:
    return url.removeprefix("delta:")


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
    from deltalake import DeltaTable

    storage = open_storage(_strip(url))
    state = _state(storage)
    positions = state.positions()
    if consumer is None:
        if len(positions) != 1:
            raise UserError(f"{storage.url} holds the positions of {', '.join(sorted(positions)) or 'no consumer'}: "
                            f"name one (QUEUE/CONSUMER)")
        consumer = next(iter(positions))
    if consumer not in positions:
        raise UserError(f"{storage.url} holds no position of consumer {consumer}")
    if tick > positions[consumer]:
        raise UserError(f"tick {tick} is past the warehouse's position (tick {positions[consumer]} of {consumer})")
    root, options = storage.delta_rs()
    rows = DeltaTable(f"{root}/{DIRECTORY}", storage_options=options).to_pyarrow_table(
        columns=["consumer", "tick", "table", "directory", "version"])
    rows = rows.filter(pc.and_(pc.equal(rows["consumer"], consumer), pc.less_equal(rows["tick"], tick)))
    latest: dict[str, tuple[int, str, int]] = {}
    for row in rows.to_pylist():
        seen = latest.get(row["directory"])
        if seen is None or (row["tick"], row["version"]) > (seen[0], seen[2]):
            latest[row["directory"]] = (row["tick"], row["table"], row["version"])
    live = state.directories()
    return {name: (f"{root}/{directory}", version) for directory, (_, name, version) in sorted(latest.items())
            if directory in live}


def read_table(spark: Any, url: str, table: str, *, tick: int | None = None, consumer: str | None = None) -> Any:
    """A replicated table as a DataFrame: now, or as of tick `tick` (time travel to the
    version the tick left it at)."""
    if tick is None:
        uris = table_uris(url)
        return spark.read.format("delta").load(_spark_location(uris[_find(uris, table)]))
    versions = versions_as_of(url, tick, consumer)
    uri, version = versions[_find({n: u for n, (u, _) in versions.items()}, table)]
    return spark.read.format("delta").option("versionAsOf", version).load(_spark_location(uri))


def register_tables(spark: Any, url: str, database: str = "replica") -> list[str]:
    """Registers every table in the session's catalog as ``DATABASE.t`` (``DATABASE.schema__t``
    outside schema public), a table over its Delta location (it follows the table as the
    consumer writes it). Returns the names registered."""
    from replicator.views.spark_sql import quote_spark

    spark.sql(f"CREATE DATABASE IF NOT EXISTS {quote_spark(database)}")
    names = []
    for source_name, uri in table_uris(url).items():
        schema, _, bare = source_name.partition(".")
        name = f"{quote_spark(database)}.{quote_spark(target_table_name(schema, bare))}"
        location = _spark_location(uri).replace("'", "\\'")
        spark.sql(f"CREATE TABLE IF NOT EXISTS {name} USING delta LOCATION '{location}'")
        names.append(name)
    return names


def _spark_location(uri: str) -> str:
    """A URI as Hadoop names it (s3:// is s3a:// there)."""
    return "s3a://" + uri.removeprefix("s3://") if uri.startswith("s3://") else uri
