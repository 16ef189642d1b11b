"""How a daemon is asked to stop: SIGTERM/SIGINT set a flag its loop waits on."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import select
import signal


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

    def install(self) -> StopFlag:
        """Makes SIGTERM/SIGINT set the flag, and SIGUSR1 print every thread's
        stack to stderr (where a daemon that seems stuck is waiting)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.set())
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        return self

    def set(self) -> None:
        self._set = True
        with contextlib.suppress(BlockingIOError):   # the pipe is full of earlier wake-ups: a wait() returns anyway
            os.write(self._wake_w, b"x")

    @property
    def is_set(self) -> bool:
        return self._set

    def wait(self, seconds: float) -> bool:
        """Sleeps up to seconds, less if the flag is set; returns the flag."""
        if not self._set:
            select.select([self._wake_r], [], [], seconds)
        return self._set
