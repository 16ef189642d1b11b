"""What the daemons record for an operator to watch: the copy a consumer runs.
Each is one cheap query, run every few seconds at most (`status`)."""

from __future__ import annotations

from typing import Any

from psycopg.rows import dict_row

from replicator.source import Source, db


def record_copy(source: Source, queue: str, consumer: str, table: str | None, rows: int = 0,
                estimated_rows: int = 0) -> None:
    """Records the table a consumer copies (replicator.set_consumer_copy), or None: no copy runs."""
    with db.user_errors():
        source.conn.execute("SELECT replicator.set_consumer_copy(%s, %s, %s, %s, %s)",
                            (queue, consumer, table, rows, estimated_rows or None))


def copies(source: Source) -> dict[tuple[str, str], dict[str, Any]]:
    """The copies consumers run, by (queue, consumer)."""
    with db.user_errors(), source.conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute("SELECT * FROM replicator.consumer_copy_info()").fetchall()
    return {(r.pop("queue_name"), r.pop("consumer_name")): {"table": r.pop("table_name"), **r} for r in rows}
