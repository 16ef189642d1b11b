"""Spark faces of replicator.

* The mirror: ``replicator consume QUEUE --target spark:PATH`` keeps every
  replicated table current in a warehouse directory (replicator.targets.spark
  writes it, replicator.spark.warehouse describes it). Read it with
  :func:`read_table` / :func:`register_views`, fold change logs into new bases
  with :func:`compact`. Incremental views over the tables (replicator.spark.views,
  ``replicator view ... --target spark:PATH``) are read with :func:`read_view`.
* The queue as a streaming source: ``spark.readStream.format("replicator")``
  (:class:`ReplicatorDataSource`, registered by :func:`get_session` or
  ``spark.dataSource.register(ReplicatorDataSource)``).

Names are imported lazily: the consumer writes the warehouse with pyarrow
only and does not load PySpark unless it compacts or refreshes views.
"""

from __future__ import annotations

from typing import Any

__all__ = ["read_table", "read_view", "register_views", "table_names", "compact", "get_session",
           "ReplicatorDataSource"]

_WHERE = {"read_table": "reader", "read_view": "reader", "register_views": "reader", "table_names": "reader",
          "compact": "compaction",
          "get_session": "session", "ReplicatorDataSource": "source"}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(name)
    from importlib import import_module
    return getattr(import_module(f"{__name__}.{module}"), name)
