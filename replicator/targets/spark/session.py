"""A Spark session with defaults that work on a single machine.

Local mode unless a master is given. Executors' Python is the running
interpreter (so they import the same replicator and pyarrow), the driver
binds to the loopback address, the UI is off unless asked for. Settings that
size the JVM (spark.driver.memory) only take effect before the JVM starts,
i.e. in the first session of a process.

The JVM replicator starts writes to a pipe that replicator forwards to its own
stderr, less one line: Spark's launcher always adds the incubator module
jdk.incubator.vector (for its vectorized BLAS), and the JVM says so on every start
("WARNING: Using incubator modules: jdk.incubator.vector"), with no option to
silence it. Everything else the JVM writes (its errors, Spark's log with -v) is
passed on as it is.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from replicator.errors import UserError

DEFAULTS = {
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "8",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.parquet.compression.codec": "snappy",
    "spark.driver.memory": "2g",
}


QUIET_LOG4J = Path(__file__).with_name("log4j2-quiet.properties")
INCUBATOR_WARNING = b"WARNING: Using incubator modules:"


def parse_conf(pairs: list[str] | tuple[str, ...] | None) -> dict[str, str]:
    """KEY=VALUE strings (from --spark-conf) as a dict."""
    conf: dict[str, str] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise UserError(f"invalid --spark-conf {pair!r}: use KEY=VALUE")
        conf[key.strip()] = value.strip()
    return conf


def get_session(master: str | None = None, conf: Mapping[str, str] | None = None,
                app_name: str = "replicator") -> Any:
    """The process's Spark session, created with the defaults above on first use."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        raise UserError("the Spark target needs PySpark: pip install 'replicator[spark]'") from None
    builder = SparkSession.builder.appName(app_name).master(master or os.environ.get("SPARK_MASTER", "local[*]"))
    settings = {**DEFAULTS, **(conf or {})}
    if not logging.getLogger("replicator").isEnabledFor(logging.DEBUG):
        # the JVM's start-up lines and log records (a failing query's stack trace, twice) would
        # surround replicator's one-line errors; -v keeps them
        settings.setdefault("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile={QUIET_LOG4J}")
        logging.getLogger("SQLQueryContextLogger").setLevel(logging.CRITICAL)   # PySpark's JSON records of them
    for key, value in settings.items():
        builder = builder.config(key, value)
    try:
        _start_jvm(master or os.environ.get("SPARK_MASTER", "local[*]"), app_name, settings)
        spark = builder.getOrCreate()
    except Exception as exc:  # the JVM did not start: no Java, bad master
        raise UserError(f"cannot start Spark ({master or 'local'}): {str(exc).strip().splitlines()[0]}") from None
    return spark


def _start_jvm(master: str, app_name: str, settings: Mapping[str, str]) -> None:
    """Starts the process's JVM, if none runs, with its stderr forwarded by
    _forward_stderr, and the Spark context on it (the session builder then uses it)."""
    from pyspark import SparkConf, SparkContext
    from pyspark.java_gateway import launch_gateway

    if SparkContext._gateway is not None:   # started already (one JVM per process, kept across sessions)
        return
    conf = SparkConf(loadDefaults=False).setMaster(master).setAppName(app_name).setAll(list(settings.items()))
    read_fd, write_fd = os.pipe()
    threading.Thread(target=_forward_stderr, args=(read_fd,), name="replicator-jvm-stderr", daemon=True).start()
    try:
        gateway = launch_gateway(conf, popen_kwargs={"stderr": write_fd})  # type: ignore[no-untyped-call]
    finally:
        os.close(write_fd)   # the JVM holds its own copy: the pipe ends when the JVM does
    SparkContext(conf=conf, gateway=gateway)


def _forward_stderr(read_fd: int) -> None:
    """Copies the JVM's stderr to replicator's, line by line, less the incubator warning.
    It drains the pipe to its end whatever happens to a write (a closed stderr), so the
    JVM never blocks on a full pipe."""
    with os.fdopen(read_fd, "rb") as pipe:   # buffered: a line is still forwarded once it is whole
        for line in pipe:
            if not line.startswith(INCUBATOR_WARNING):
                with contextlib.suppress(OSError):
                    os.write(2, line)
