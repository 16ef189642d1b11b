"""What `replicator status` reports: queues, tables, consumers, their lag and
the copy each runs, and what keeps each queue from rotating."""

from __future__ import annotations

from typing import Any

from replicator.source import Source, monitoring


def status(source: Source) -> dict[str, Any]:
    queues = source.queues()
    return {
        "queues": [{**q, "rotation_blockers": source.rotation_blockers(q["queue_name"])} for q in queues],
        "tables": [{"queue": t.queue_name, "table": t.name, "mode": t.mode, "key": t.key,
                    "ignore": t.ignore, "where": t.row_filter, "exists": t.structure is not None,
                    "suspended": t.suspended}
                   for t in source.tables()],
        "schemas": source.followed_schemas(),
        "consumers": with_copies(source.consumers(), monitoring.copies(source)),
    }


def with_copies(consumers: list[dict[str, Any]], copies: dict[tuple[str, str], dict[str, Any]]) -> list[dict[str, Any]]:
    """Each consumer with the copy it runs ("copy": table, rows, estimated_rows, started,
    updated, rows_per_second, seconds_since_update), or None."""
    return [{**c, "copy": copies.get((c["queue_name"], c["consumer_name"]))} for c in consumers]
