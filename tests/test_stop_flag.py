"""StopFlag: how daemons (consume, ticker, maint) learn they must stop."""

from __future__ import annotations

import os
import random
import signal
import threading

import pytest

from replicator.shutdown import StopFlag


@pytest.fixture
def restore_signals():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_set_from_another_thread_wakes_a_wait():
    stop = StopFlag()
    threading.Timer(0.01, stop.set).start()
    assert stop.wait(60) is True
    assert stop.is_set


def test_wait_times_out_when_not_set():
    stop = StopFlag()
    assert stop.wait(0.001) is False
    assert not stop.is_set


@pytest.mark.timeout(60)
def test_sigterm_at_any_moment_of_a_polling_loop_stops_it(restore_signals):
    # A daemon's idle loop is `while not stop.wait(poll)`. The signal may land at
    # any bytecode of it, including inside wait() (wait(0) spends its time there):
    # a flag whose wait() holds a lock the handler needs hangs here.
    rng = random.Random(20261122)
    for _ in range(300):
        stop = StopFlag().install()
        sender = threading.Timer(rng.uniform(0, 0.003), os.kill, (os.getpid(), signal.SIGTERM))
        sender.start()
        while not stop.wait(0):
            pass
        sender.join()
        assert stop.is_set


def test_sigint_sets_the_flag_instead_of_interrupting(restore_signals):
    # Ctrl-C in a terminal running `replicator consume`: the current batch finishes, no
    # KeyboardInterrupt lands in the middle of it.
    stop = StopFlag().install()
    os.kill(os.getpid(), signal.SIGINT)
    assert stop.wait(60) is True
