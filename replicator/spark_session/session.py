"""A Spark session with defaults that work on a single machine, that reads and writes Delta tables.

Local mode unless a master is given. Executors' Python is the running
interpreter (so they import the same replicator and pyarrow), the driver
binds to the loopback address, the UI is off unless asked for. Settings that
size the JVM (spark.driver.memory) only take effect before the JVM starts,
i.e. in the first session of a process.

Delta Lake is in every session (its SQL extension and catalog, and its jars:
replicator.spark_session.jars), with partition counts for a few cores: Spark's
200 shuffle partitions and Delta's 50 for reading a table's log made every first
read of a small table take tens of seconds on 2 cores. s3:// and s3a:// paths go
through Hadoop's s3a, at the endpoint the environment names (AWS_ENDPOINT_URL, as
for replicator's own S3 clients: replicator.s3_endpoint); s3a reads the
credentials from the environment itself (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY). Delta
commits to them through replicator's log store (jars.py, ConditionalS3LogStore.java): each
commit one conditional PUT, so that Spark's commits and the consumer's exclude each other.
The user's --spark-conf settings win over all of these, except that the lists
spark.jars, spark.jars.packages, spark.jars.excludes and spark.sql.extensions
are added to ours rather than replacing them (a jar of one's own keeps Delta's).

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
from replicator.extras import require
from replicator.s3_endpoint import s3_endpoint
from replicator.spark_session.jars import PACKAGES, build_log_store, cache_dir, jar_settings, record_resolution

_CORES = os.cpu_count() or 2
DEFAULTS = {
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": str(max(4, 2 * _CORES)),
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.parquet.compression.codec": "snappy",
    "spark.driver.memory": "2g",
}
DELTA = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
    "spark.databricks.delta.snapshotPartitions": str(min(max(2, _CORES), 4)),
}
APPENDED = ("spark.jars", "spark.jars.packages", "spark.jars.excludes", "spark.sql.extensions")


QUIET_LOG4J = Path(__file__).with_name("log4j2-quiet.properties")
INCUBATOR_WARNING = b"WARNING: Using incubator modules:"


def s3a_settings(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """s3:// paths as s3a ones (the URL replicator and delta-rs are given works in Spark too),
    at the environment's endpoint (path-style, as S3-compatible servers want it)."""
    settings = {"spark.hadoop.fs.s3.impl": "org.apache.hadoop.fs.s3a.S3AFileSystem",
                "spark.hadoop.fs.AbstractFileSystem.s3.impl": "org.apache.hadoop.fs.s3a.S3A"}
    endpoint = s3_endpoint(environ)
    if endpoint.url:
        settings.update({"spark.hadoop.fs.s3a.endpoint": endpoint.url,
                         "spark.hadoop.fs.s3a.path.style.access": "true",
                         "spark.hadoop.fs.s3a.connection.ssl.enabled": str(not endpoint.plain_http).lower()})
    if endpoint.region:
        settings["spark.hadoop.fs.s3a.endpoint.region"] = endpoint.region
    return settings


def session_settings(conf: Mapping[str, str] | None, environ: Mapping[str, str] | None = None,
                     jars: Path | None = None) -> dict[str, str]:
    """replicator's settings (DEFAULTS, DELTA, the jars in or for the cache directory `jars`,
    s3a) under the user's conf."""
    ours = {**DEFAULTS, **DELTA, **jar_settings(jars or cache_dir(environ)), **s3a_settings(environ)}
    theirs = dict(conf or {})
    settings = {**ours, **theirs}
    for key in APPENDED:
        if ours.get(key) and theirs.get(key):
            settings[key] = f"{ours[key]},{theirs[key]}"
    return settings


def get_session(master: str | None = None, conf: Mapping[str, str] | None = None,
                app_name: str = "replicator") -> Any:
    """The process's Spark session, created with the settings above on first use."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    require("spark", "Spark (views on a Delta warehouse, reading it from Spark)")
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app_name).master(master or os.environ.get("SPARK_MASTER", "local[*]"))
    jars = cache_dir()
    build_log_store(jars)
    settings = session_settings(conf, jars=jars)
    if not logging.getLogger("replicator").isEnabledFor(logging.DEBUG):
        # the JVM's start-up lines and log records (a failing query's stack trace, twice) would
        # surround replicator's one-line errors; -v keeps them
        settings.setdefault("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile={QUIET_LOG4J}")
        logging.getLogger("SQLQueryContextLogger").setLevel(logging.CRITICAL)   # PySpark's JSON records of them
    for key, value in settings.items():
        builder = builder.config(key, value)
    resolving = PACKAGES[0] in settings.get("spark.jars.packages", "")
    try:
        _start_jvm(master or os.environ.get("SPARK_MASTER", "local[*]"), app_name, settings)
        spark = builder.getOrCreate()
    except Exception as exc:  # the JVM did not start: no Java, bad master, no Maven Central
        hint = f" (Spark's first start downloads Delta Lake's jars from Maven Central into {jars})" if resolving else ""
        raise UserError(f"cannot start Spark ({master or 'local'}): {str(exc).strip().splitlines()[0]}{hint}") from None
    if resolving:
        with contextlib.suppress(OSError):   # a cache it cannot write: the next start resolves again
            record_resolution(jars)
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
