"""The source's background jobs: the ticker and maintenance (rotation, tick cleanup)."""

from __future__ import annotations

import faulthandler
import logging
import os
import select
import signal
from collections.abc import Callable

import psycopg

from .errors import UserError
from .source import Source

log = logging.getLogger("replicator")


class StopFlag:
    """Set by SIGTERM/SIGINT (or set()); loops finish their current step and return.

    A pipe, not a threading.Event: a signal handler runs between two bytecodes
    of the main thread, possibly while that thread holds the Event's lock
    inside wait(), and Event.set() from the handler would then deadlock.
    Writing to a pipe takes no lock, and wakes a wait() in any thread."""

    def __init__(self) -> None:
        self._set = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)

    def __del__(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    def install(self) -> "StopFlag":
        """Makes SIGTERM/SIGINT set the flag, and SIGUSR1 print every thread's
        stack to stderr (where a daemon that seems stuck is waiting)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.set())
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        return self

    def set(self) -> None:
        self._set = True
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full of earlier wake-ups: a wait() returns anyway

    @property
    def is_set(self) -> bool:
        return self._set

    def wait(self, seconds: float) -> bool:
        """Sleeps up to seconds, less if the flag is set; returns the flag."""
        if not self._set:
            select.select([self._wake_r], [], [], seconds)
        return self._set


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
    """One pass of the maint daemon: rotation and cleanup over every queue, each
    action logged; returns what was done per queue."""
    actions = source.maint()
    for queue, done in actions.items():
        for action in done:
            log.info("maint: queue %s: %s", queue, action)
    return actions


def run_ticker(connect: Callable[[], Source], interval: float, stop: StopFlag) -> None:
    run_forever(tick_once, connect, interval, stop, "ticker")


def run_maint(connect: Callable[[], Source], interval: float, stop: StopFlag) -> None:
    run_forever(maint_once, connect, interval, stop, "maint")
