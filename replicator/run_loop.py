"""The run loop of the two daemons that apply changes to a target: the consumer (a queue's batches)
and the follower (a publisher's Kafka commits).

A run steps until stopped (a daemon), for one step (once), or until the target's position reaches
the goal taken when the run began (until_caught_up: everything committed before it). What it
applied is summed up in one log line every stats_interval seconds and when it ends. When what a
step reads or writes cannot be reached (the applier says which errors mean that), the step is
tried again after a pause that doubles from FIRST_BACKOFF up to MAX_BACKOFF seconds; a step or a
reconnection that succeeds brings the pause back to FIRST_BACKOFF. Between steps the target
tends to itself (protocol.tend: a Delta warehouse's scheduled VACUUM).
"""

from __future__ import annotations

import logging
import time
from typing import Protocol, TypeVar

from replicator.shutdown import StopFlag
from replicator.targets.protocol import Target, settle, tend

log = logging.getLogger("replicator")

FIRST_BACKOFF = 0.5
MAX_BACKOFF = 15.0

Stats = TypeVar("Stats")
StatsIn = TypeVar("StatsIn", contravariant=True)


class Stopped(Exception):
    """The stop flag, set while a step waited: the step was rolled back, and the run ends."""


class Summary(Protocol[StatsIn]):
    """What a run applied since its last summary line."""

    started: float   # time.monotonic() of the last line, or of the run's start

    def add(self, stats: StatsIn) -> None: ...

    def flush(self) -> None:
        """Logs one line (none when nothing was applied) and counts again from now."""


class Applier(Protocol[Stats]):
    """What the loop runs: its steps, each one target transaction, and what it does around them."""

    @property
    def target(self) -> Target: ...

    @property
    def stats_interval(self) -> float: ...

    @property
    def idle_pause(self) -> float:
        """Seconds to wait after a step that found nothing (0: the step waited itself)."""

    def summary(self) -> Summary[Stats]: ...

    def reconnect(self) -> bool:
        """Connects what a step needs if it is not connected; True when it connected (an outage is over)."""

    def goal(self, stop: StopFlag) -> int | None:
        """The position until_caught_up runs to, taken now; None: none to reach (or stopped meanwhile)."""

    def next_step(self) -> Stats | None:
        """Applies what came next, in one target transaction; None when nothing had come."""

    def stepped(self, stats: Stats | None) -> None:
        """After each step: the metrics, what the step applied and how far behind the applier is."""

    def caught_up(self, goal: int, stats: Stats | None) -> bool:
        """Whether the target's position has reached goal."""

    def outage(self, error: Exception) -> str | None:
        """For an error that means the source or the target cannot be reached now: recorded (metrics,
        a connection dropped), the warning to log, to which the pause is added ("... in 0.5s"); None
        for any other error, which ends the run."""


def run(applier: Applier[Stats], stop: StopFlag, *, once: bool = False, until_caught_up: bool = False) -> int:
    """Runs applier's steps until stop is set, for one step (once), or until its position reaches the
    goal taken at the start (until_caught_up); the target settled before a run that stops by itself
    returns. Returns the number of steps that applied something."""
    summary = applier.summary()
    applied = 0
    goal: int | None = None
    backoff = FIRST_BACKOFF
    try:
        while not stop.is_set:
            try:
                if applier.reconnect():
                    backoff = FIRST_BACKOFF
                if until_caught_up and goal is None:
                    goal = applier.goal(stop)
                    if goal is None:
                        break
                stats = applier.next_step()
                backoff = FIRST_BACKOFF
                if stats is not None:
                    applied += 1
                    summary.add(stats)
                applier.stepped(stats)
                tend(applier.target)   # the step's transaction is over: committed, or rolled back by a raise
                if time.monotonic() - summary.started >= applier.stats_interval:
                    summary.flush()
                if once or (goal is not None and applier.caught_up(goal, stats)):
                    settle(applier.target)
                    return applied
                if stats is None and applier.idle_pause:
                    stop.wait(applier.idle_pause)
            except Stopped:
                break
            except Exception as error:
                warning = applier.outage(error)
                if warning is None:
                    raise
                log.warning("%s in %.1fs", warning, backoff)
                stop.wait(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)
        return applied
    finally:
        summary.flush()
