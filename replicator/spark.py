"""replicator for Spark users: the warehouse a consumer keeps, and the queue as a streaming source.

* The mirror: ``replicator consume QUEUE --target spark:PATH`` keeps every
  replicated table current in a warehouse directory (replicator.targets.spark).
  Read it with :func:`read_table` / :func:`register_views`, fold change logs
  into new bases with :func:`compact`. Incremental views over the tables
  (``replicator view ... --target spark:PATH``) are read with :func:`read_view`.
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
    "compact",
    "get_session",
    "read_table",
    "read_view",
    "register_views",
    "table_names",
]

_WHERE = {"read_table": "replicator.targets.spark.reader", "read_view": "replicator.targets.spark.reader",
          "register_views": "replicator.targets.spark.reader", "table_names": "replicator.targets.spark.reader",
          "compact": "replicator.targets.spark.compaction",
          "ReplicatorDataSource": "replicator.streaming.datasource"}


def get_session(master: str | None = None, conf: Mapping[str, str] | None = None,
                app_name: str = "replicator") -> Any:
    """The process's Spark session (replicator.targets.spark.session), with the
    streaming source (format "replicator") registered in it."""
    from replicator.streaming.datasource import ReplicatorDataSource
    from replicator.targets.spark.session import get_session as target_session

    spark = target_session(master, conf, app_name)
    spark.dataSource.register(ReplicatorDataSource)
    return spark


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(name)
    return getattr(import_module(module), name)
