"""What the daemons read and record for an operator to watch: a consumer's lag
and the copy it runs, each queue's latest tick and overdue rotation (replicator.queue_info). Each is one
cheap query, run every few seconds at most (replicator.metrics, `status`)."""

from __future__ import annotations

import math
import time
from typing import Any

from psycopg.rows import dict_row

from replicator.source import Source, db

READ_EVERY_SECONDS = 5.0   # what a daemon reads for its metrics (lag, tick ages) is read this often, at most


class Every:
    """Says when something done at most once every `seconds` is due (the first time: at once)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._last = -math.inf

    def due(self) -> bool:
        now = time.monotonic()
        if now - self._last < self.seconds:
            return False
        self._last = now
        return True


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


def consumer_lag(source: Source, queue: str, consumer: str) -> dict[str, Any] | None:
    """A consumer's lag (ticks, events, seconds) and the age of its queue's latest
    tick, in seconds; None if the consumer is not registered."""
    with db.user_errors(), source.conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(
            "SELECT lag_ticks, lag_events, lag_seconds,"
            " (SELECT extract(epoch FROM clock_timestamp() - t.tick_time)::float8 FROM replicator.tick t"
            "  WHERE t.tick_queue = (replicator.find_queue(%s)).queue_id ORDER BY t.tick_id DESC LIMIT 1)"
            " AS last_tick_age FROM replicator.consumer_info() WHERE queue_name = %s AND consumer_name = %s",
            (queue, queue, consumer)).fetchone()


def last_tick_ages(source: Source) -> dict[str, float | None]:
    """Seconds since each queue's latest tick (None: the queue has none yet)."""
    return {q["queue_name"]: q["last_tick_age"] for q in source.queues()}


def rotation_overdue(source: Source) -> dict[str, float]:
    """Seconds each queue is past its rotation period since its last switch (0: not due)."""
    return {q["queue_name"]: q["rotation_overdue"].total_seconds() if q["rotation_overdue"] else 0.0
            for q in source.queues()}
