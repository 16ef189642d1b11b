"""Crash injection for the tests of targets that commit in several steps (kill -9 at a named point)."""

from __future__ import annotations

import os
import signal


def crash_point(name: str) -> None:
    """Crash injection for tests: REPLICATOR_CRASH_AT=NAME (or NAME@N, the Nth
    time) makes the process SIGKILL itself when it reaches point NAME."""
    wanted = os.environ.get("REPLICATOR_CRASH_AT")
    if not wanted:
        return
    point, _, nth = wanted.partition("@")
    if point != name:
        return
    count = _crash_counts.get(name, 0) + 1
    _crash_counts[name] = count
    if count >= int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)


_crash_counts: dict[str, int] = {}
