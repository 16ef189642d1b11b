"""The source's background jobs: the ticker and maintenance (rotation, tick cleanup)."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

import psycopg

from .errors import UserError
from .source import Source

log = logging.getLogger("replicator")


class StopFlag:
    """Set by SIGTERM/SIGINT; loops finish their current step and return."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def install(self) -> "StopFlag":
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._event.set())
        return self

    def set(self) -> None:
        self._event.set()

    @property
    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, seconds: float) -> bool:
        return self._event.wait(seconds)


def run_forever(step: Callable[[Source], object], connect: Callable[[], Source], interval: float,
                stop: StopFlag, name: str) -> None:
    """Runs step every interval seconds; reconnects with backoff when the source goes away."""
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
            log.warning("%s: source unavailable (%s); retrying in %.0fs", name, str(exc).strip().splitlines()[0], backoff)
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
    return source.tick()


def maint_once(source: Source) -> dict[str, list[str]]:
    """Runs rotation and cleanup over every queue; returns what was done per queue."""
    actions = source.maint()
    for queue, done in actions.items():
        for action in done:
            log.info("maint: queue %s: %s", queue, action)
    return actions


def run_ticker(connect: Callable[[], Source], interval: float, stop: StopFlag) -> None:
    run_forever(tick_once, connect, interval, stop, "ticker")


def run_maint(connect: Callable[[], Source], interval: float, stop: StopFlag) -> None:
    run_forever(maint_once, connect, interval, stop, "maint")
