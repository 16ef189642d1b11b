"""The tests' Spark session, checked before each test that uses it: a session whose JVM
died, was stopped or stalls in one test (on a loaded machine: py4j errors such as
"SparkSession does not exist in the JVM" in every later test) is replaced, not inherited."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

PROBE_SECONDS = 60.0   # a one-row job takes well under a second; minutes only on a JVM that is gone or stuck


def answers(spark: Any, seconds: float) -> bool:
    """Whether the session runs a one-row job within `seconds` (in a thread of its own: a
    call into a stalled JVM never returns)."""
    outcome: list[bool] = []

    def probe() -> None:
        try:
            outcome.append(spark.range(1).count() == 1)
        except Exception:   # py4j's errors of a JVM that is gone, Spark's of a stopped context
            outcome.append(False)

    thread = threading.Thread(target=probe, name="spark-probe", daemon=True)
    thread.start()
    thread.join(seconds)
    return outcome == [True]


def discard_jvm() -> None:
    """Kills the process's JVM and makes PySpark forget it and its sessions, so that the next
    session starts a JVM of its own (replicator.spark_session.session starts one only where
    PySpark knows none)."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    gateway = SparkContext._gateway
    if gateway is not None:
        proc = getattr(gateway, "proc", None)   # set by pyspark's launch_gateway
        if proc is not None:
            proc.kill()
            proc.wait()
        gateway.shutdown(raise_exception=False)
    SparkContext._gateway = None
    SparkContext._jvm = None
    SparkContext._active_spark_context = None
    SparkSession._instantiatedSession = None
    SparkSession._activeSession = None


class SparkSessions:
    """One session at a time, from `start`: the same one for every test while it answers."""

    def __init__(self, start: Callable[[], Any]) -> None:
        self._start = start
        self._session: Any = None

    def healthy(self) -> Any:
        if self._session is not None and not answers(self._session, PROBE_SECONDS):
            warnings.warn(f"the Spark session did not run a one-row job within {PROBE_SECONDS:.0f} s: "
                          f"a new one replaces it", stacklevel=1)
            discard_jvm()
            self._session = None
        if self._session is None:
            self._session = self._start()
        return self._session

    def stop(self) -> None:
        if self._session is not None:
            self._session.stop()
