"""The source's background jobs: the ticker and maintenance (rotation, tick cleanup,
idle consumers)."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

import psycopg

from replicator.errors import UserError, first_line
from replicator.shutdown import StopFlag
from replicator.source import Source, monitoring
from replicator.source.status import idle_line

if TYPE_CHECKING:
    # imported when a daemon runs: prometheus_client takes a while to load, for every command
    from replicator.metrics import DaemonMetrics, MaintMetrics, TickerMetrics

log = logging.getLogger("replicator")

HEARTBEAT_EVERY = 10.0   # seconds between a ticker's heartbeats at most (its pass interval if longer)


def run_forever(step: Callable[[Source], object], connect: Callable[[], Source], interval: float,
                stop: StopFlag, name: str, metrics: DaemonMetrics,
                finish: Callable[[Source], object] | None = None) -> None:
    """Runs step every interval seconds; reconnects with backoff when the source goes away
    (which the metrics count, and the health reports). finish runs once on the last
    connection when stopped."""
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
            reason = first_line(exc)
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
        if finish is not None:
            try:
                finish(source)
            except (psycopg.Error, UserError) as exc:
                log.warning("%s: %s", name, first_line(exc))
        source.close()


class Ticker:
    """The ticker daemon's pass: ticks every queue when due, and leaves a heartbeat
    (replicator.ticker_heartbeat) at most every HEARTBEAT_EVERY seconds, so that
    `status` tells a dead ticker from a slow consumer without the source
    collecting a dead tuple at every pass."""

    def __init__(self, interval: float) -> None:
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.started = datetime.now(UTC)
        self.every = timedelta(seconds=max(HEARTBEAT_EVERY, interval))
        self._heartbeat_due = monitoring.Every(self.every.total_seconds())

    def __call__(self, source: Source) -> int:
        if self._heartbeat_due.due():
            source.ticker_heartbeat(self.host, self.pid, self.started, self.every)
        return source.tick() or 0

    def stopped(self, source: Source) -> None:
        source.ticker_stopped(self.host, self.pid)


class Maint:
    """The maint daemon's pass: rotation and cleanup over every queue, each action
    logged (an overdue rotation with its blockers at every pass); an idle consumer
    is logged once when it becomes idle, again only after it was seen meanwhile."""

    def __init__(self) -> None:
        self._idle: set[tuple[str, str]] = set()

    def __call__(self, source: Source) -> dict[str, list[str]]:
        actions = source.maint()
        for queue, done in actions.items():
            for action in done:
                log.log(logging.WARNING if action.startswith("rotation overdue") else logging.INFO,
                        "maint: queue %s: %s", queue, action)
        idle = {(c["queue_name"], c["consumer_name"]): c for c in source.consumers() if c["idle"]}
        for key in sorted(idle.keys() - self._idle):
            log.warning("maint: queue %s: %s", key[0], idle_line(idle[key]))
        self._idle = set(idle)
        return actions


def run_ticker(connect: Callable[[], Source], interval: float, stop: StopFlag,
               metrics: TickerMetrics | None = None) -> None:
    from replicator.metrics import TickerMetrics

    ticker = Ticker(interval)
    watched = metrics or TickerMetrics(interval)
    ages_due = monitoring.Every(monitoring.READ_EVERY_SECONDS)   # not a queue_info() at every pass

    def step(source: Source) -> None:
        watched.ticked(ticker(source), monitoring.last_tick_ages(source) if ages_due.due() else None)

    run_forever(step, connect, interval, stop, "ticker", watched, finish=ticker.stopped)


def run_maint(connect: Callable[[], Source], interval: float, stop: StopFlag,
              metrics: MaintMetrics | None = None) -> None:
    from replicator.metrics import MaintMetrics

    maint = Maint()
    watched = metrics or MaintMetrics(interval)

    def step(source: Source) -> None:
        actions = maint(source)
        watched.maintained([queue for queue, done in actions.items() if "rotated" in done],
                           monitoring.rotation_overdue(source))

    run_forever(step, connect, interval, stop, "maint", watched)
