"""What `replicator status` reports: queues, tables, consumers and their lag,
and what keeps each queue from rotating."""

from __future__ import annotations

from typing import Any

from replicator.source import Source


def status(source: Source) -> dict[str, Any]:
    queues = source.queues()
    return {
        "queues": [{**q, "rotation_blockers": source.rotation_blockers(q["queue_name"])} for q in queues],
        "tables": [{"queue": t.queue_name, "table": t.name, "mode": t.mode, "key": t.key,
                    "ignore": t.ignore, "where": t.row_filter, "exists": t.structure is not None,
                    "suspended": t.suspended}
                   for t in source.tables()],
        "schemas": source.followed_schemas(),
        "consumers": source.consumers(),
    }
