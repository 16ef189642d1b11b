"""replicator for Spark users: the Delta warehouse a consumer keeps, and the queue as a streaming source.

* The warehouse: ``replicator consume QUEUE --target delta:URI`` keeps every replicated
  table current as a Delta table (replicator.targets.delta), which Spark reads as it is
  (``spark.read.format("delta")``). :func:`read_table` reads one by its source name, now or
  as of a tick (all tables as one tick left them: :func:`versions_as_of`);
  :func:`register_tables` puts them and the views in the session's catalog
  (``replica.orders``), :func:`register_views` makes them temporary views (``orders``);
  :func:`read_view` reads an incremental view
  (``replicator view ... --target delta:URI``).
* The queue as a streaming source: ``spark.readStream.format("replicator")``
  (:class:`ReplicatorDataSource` of replicator.streaming, registered by
  :func:`get_session` or ``spark.dataSource.register(ReplicatorDataSource)``).

Names are imported lazily: importing this module does not load PySpark.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import import_module
from typing import Any

__all__ = [
    "ReplicatorDataSource",
    "get_session",
    "read_table",
    "read_view",
    "register_tables",
    "register_views",
    "table_uris",
    "versions_as_of",
]

_WHERE = {"read_table": "replicator.targets.delta.reader", "read_view": "replicator.targets.delta.reader",
          "register_tables": "replicator.targets.delta.reader", "table_uris": "replicator.targets.delta.reader",
          "register_views": "replicator.targets.delta.reader",
          "versions_as_of": "replicator.targets.delta.reader",
          "ReplicatorDataSource": "replicator.streaming.datasource"}


def get_session(master: str | None = None, conf: Mapping[str, str] | None = None,
                app_name: str = "replicator") -> Any:
    """The process's Spark session (replicator.spark_session.session), with the
    streaming source (format "replicator") registered in it."""
    from replicator.spark_session.session import get_session as target_session
    from replicator.streaming.datasource import ReplicatorDataSource

    spark = target_session(master, conf, app_name)
    spark.dataSource.register(ReplicatorDataSource)
    return spark


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(name)
    return getattr(import_module(module), name)
