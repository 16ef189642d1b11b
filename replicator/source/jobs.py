"""The source's background jobs: the ticker and maintenance (rotation, tick cleanup)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import psycopg

from replicator.errors import UserError
from replicator.shutdown import StopFlag
from replicator.source import Source, monitoring

if TYPE_CHECKING:
    # imported when a daemon runs: prometheus_client takes a while to load, for every command
    from replicator.metrics import DaemonMetrics, MaintMetrics, TickerMetrics

log = logging.getLogger("replicator")


def run_forever(step: Callable[[Source], object], connect: Callable[[], Source], interval: float,
                stop: StopFlag, name: str, metrics: DaemonMetrics) -> None:
    """Runs step every interval seconds; reconnects with backoff when the source goes away
    (which the metrics count, and the health reports)."""
    source: Source | None = None
    backoff = 1.0
    while not stop.is_set:
        try:
            if source is None:
                source = connect()
                log.info("%s: connected", name)
                backoff = 1.0
            step(source)
        except (psycopg.OperationalError, UserError) as exc:
            # UserError: connect() could not reach the source (db.connect turns that into one line).
            reason = str(exc).strip().splitlines()[0]
            log.warning("%s: source unavailable (%s); retrying in %.0fs", name, reason, backoff)
            metrics.source_unavailable(reason)
            if source is not None:
                source.conn.close()
                source = None
            stop.wait(backoff)
            backoff = min(backoff * 2, 30.0)
            continue
        stop.wait(interval)
    if source is not None:
        source.close()


def tick_once(source: Source) -> int:
    """Runs the ticker over every queue; returns the number of ticks made."""
    return source.tick() or 0


def maint_once(source: Source) -> dict[str, list[str]]:
    """One pass of the maint daemon: rotation and cleanup over every queue, each
    action logged; returns what was done per queue."""
    actions = source.maint()
    for queue, done in actions.items():
        for action in done:
            log.info("maint: queue %s: %s", queue, action)
    return actions


def run_ticker(connect: Callable[[], Source], interval: float, stop: StopFlag,
               metrics: TickerMetrics | None = None) -> None:
    from replicator.metrics import TickerMetrics

    watched = metrics or TickerMetrics(interval)

    def step(source: Source) -> None:
        watched.ticked(tick_once(source), monitoring.last_tick_ages(source))

    run_forever(step, connect, interval, stop, "ticker", watched)


def run_maint(connect: Callable[[], Source], interval: float, stop: StopFlag,
              metrics: MaintMetrics | None = None) -> None:
    from replicator.metrics import MaintMetrics

    watched = metrics or MaintMetrics(interval)

    def step(source: Source) -> None:
        actions = maint_once(source)
        watched.maintained([queue for queue, done in actions.items() if "rotated" in done],
                           monitoring.rotation_overdue(source))

    run_forever(step, connect, interval, stop, "maint", watched)
