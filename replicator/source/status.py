"""What `replicator status` reports: queues with their last tick's age and whether a
ticker runs, tables, consumers with their lag, whether they are idle and the copy each runs, and what keeps
each queue from rotating. Keys are the same everywhere JSON names a thing (`queue`,
`consumer`, `table`, `schema`), `queue list --json` included."""

from __future__ import annotations

import shlex
from typing import Any

from replicator.source import Source, monitoring
from replicator.wording import format_age


def queue_rows(source: Source) -> list[dict[str, Any]]:
    """The queues as `queue list --json` and `status --json` show them."""
    return [_renamed(q, queue_name="queue") for q in source.queues()]


def consumer_rows(source: Source) -> list[dict[str, Any]]:
    """The consumers, each with the copy it runs ("copy": table, rows, estimated_rows, started,
    updated, rows_per_second, seconds_since_update), or None."""
    copies = monitoring.copies(source)
    return [_renamed({**c, "copy": copies.get((c["queue_name"], c["consumer_name"]))},
                     queue_name="queue", consumer_name="consumer") for c in source.consumers()]


def rounded(value: float | None) -> float | None:
    """A mean rows per statement as the outputs show it: two decimals; None where no event was sampled."""
    return None if value is None else round(value, 2)


def status(source: Source) -> dict[str, Any]:
    sizes = source.rows_per_statement()
    return {
        "queues": [{**q, "rotation_blockers": source.rotation_blockers(q["queue"])} for q in queue_rows(source)],
        "tickers": source.tickers(),
        "tables": [{"queue": t.queue_name, "table": t.name, "mode": t.mode, "key": t.key,
                    "ignore": t.ignore, "where": t.row_filter, "exists": t.structure is not None,
                    "old_rows": t.old_rows, "capture": t.capture,
                    "rows_per_statement": rounded(sizes.get(t.table_id)), "suspended": t.suspended}
                   for t in source.tables()],
        "schemas": source.followed_schemas(),
        "consumers": consumer_rows(source),
    }


def idle_line(consumer: dict[str, Any]) -> str:
    """What `maint` says of an idle consumer (a row of Source.consumers()), with the way out."""
    name, queue = consumer["consumer_name"], consumer["queue_name"]
    return (f"consumer {name} idle: not seen for {format_age(consumer['idle_seconds'])}, not connected; it holds"
            f" back rotation: start it again, or if it is retired: replicator queue unregister"
            f" {shlex.quote(queue)} {shlex.quote(name)}")


def _renamed(row: dict[str, Any], **names: str) -> dict[str, Any]:
    return {names.get(key, key): value for key, value in row.items()}
