"""The JVM libraries replicator's Spark sessions load beyond PySpark's own: Delta Lake,
Hadoop's s3a with the AWS SDK modules it needs, and Spark's Kafka source, by Maven coordinates,
kept in a cache directory.

Chosen at each JVM start:

* The cache holds a complete resolution: the jar files themselves (spark.jars). No resolution,
  no network; the JVM starts about as fast as without them (~5 s here, against ~9 s when
  Spark's Ivy re-reads a warm cache through spark.jars.packages at every start).
* It does not: Spark resolves the packages (spark.jars.packages, Delta's documented way) with the
  cache as Ivy's directory. The first start downloads ~100 MB from Maven Central (~40 s), and the
  session records the resolution, so later starts take the first way. bin/setup-env does this
  ahead (`python -m replicator.spark_session.jars`): tests and the demo never resolve.

The cache is $REPLICATOR_SPARK_JARS, else ~/.cache/replicator/spark-jars ($XDG_CACHE_HOME), one
directory per set of coordinates (a new version resolves anew).

The cache also holds replicator's own Delta log store for S3 (ConditionalS3LogStore.java beside this
module: each commit one conditional PUT, so Spark's commits exclude the consumer's), compiled by
javac against the resolved jars by the first session that finds them (~5 s; bin/setup-env does it
ahead), one jar per version of the source. Without it (no javac: a JRE, no JDK) Delta's own is used.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path

# Delta 4.4.0 is built for Spark 4.2 (pyproject pins pyspark==4.2.0); no Delta jar exists for 4.3
DELTA = ("io.delta:delta-spark_4.2_2.13:4.4.0", "io.delta:delta-storage:4.4.0")
S3A = ("org.apache.hadoop:hadoop-aws:3.5.0",   # the Hadoop version PySpark 4.2.0 ships
       "software.amazon.awssdk:s3:2.35.4", "software.amazon.awssdk:s3-transfer-manager:2.35.4")
KAFKA = ("org.apache.spark:spark-sql-kafka-0-10_2.13:4.2.0",)   # Spark's own Kafka source: spark.read.format("kafka")
PACKAGES = DELTA + S3A + KAFKA
EXCLUDES = (
    "software.amazon.awssdk:bundle",   # every AWS service, 686 MB: s3a needs only the s3 modules above
    # Delta's Hadoop 3.4.2 client (30 MB): PySpark has its own, 3.5.0, which is the one loaded
    "org.apache.hadoop:hadoop-client-api", "org.apache.hadoop:hadoop-client-runtime",
)
RESOLVED = "resolved.txt"   # the jar files of a complete resolution, one a line
LOG_STORE_SOURCE = Path(__file__).with_name("ConditionalS3LogStore.java")
LOG_STORE = "replicator.delta.ConditionalS3LogStore"
LOG_STORE_SCHEMES = ("s3", "s3a")   # the schemes Delta gives its S3 log store (s3:// is s3a in our sessions)

log = logging.getLogger(__name__)


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    if env.get("REPLICATOR_SPARK_JARS"):
        root = Path(env["REPLICATOR_SPARK_JARS"])
    else:
        root = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "replicator" / "spark-jars"
    key = hashlib.sha256("\n".join((*PACKAGES, "", *EXCLUDES)).encode()).hexdigest()[:12]
    return root.expanduser() / key


def cached_jars(directory: Path) -> list[Path] | None:
    """The jar files of the resolution recorded in directory; None without one, or when a file is gone."""
    try:
        names = (directory / RESOLVED).read_text().split()
    except FileNotFoundError:
        return None
    jars = [directory / "jars" / name for name in names]
    return jars if jars and all(jar.is_file() for jar in jars) else None


def log_store_jar(directory: Path) -> Path:
    """Where the jar of LOG_STORE_SOURCE, as it is now, is built in directory."""
    digest = hashlib.sha256(LOG_STORE_SOURCE.read_bytes()).hexdigest()[:12]
    return directory / f"conditional-s3-log-store-{digest}.jar"


def build_log_store(directory: Path) -> Path | None:
    """The log store's jar in directory, compiled against the recorded resolution's jars and
    PySpark's Hadoop unless done; None (with a warning) when it cannot be: no resolution yet,
    no javac."""
    target = log_store_jar(directory)
    jars = cached_jars(directory)
    if target.is_file() or jars is None:
        return target if target.is_file() else None
    try:
        with tempfile.TemporaryDirectory(dir=directory) as work:
            _compile(jars, Path(work), target)
    except (OSError, subprocess.CalledProcessError) as exc:
        why = (exc.stderr.decode().strip() if isinstance(exc, subprocess.CalledProcessError) else
               "no javac (a JDK)" if isinstance(exc, FileNotFoundError) and exc.filename == "javac" else str(exc))
        log.warning("cannot build replicator's Delta log store (%s): Spark's commits to s3:// tables are not "
                    "exclusive of the consumer's (docs/delta.md, Object storage)", why)
        return None
    return target


def _compile(jars: list[Path], work: Path, target: Path) -> None:
    import pyspark

    hadoop = (Path(pyspark.__file__).parent / "jars").glob("hadoop-client-api-*.jar")
    classes = work / "classes"
    subprocess.run(["javac", "--release", "17", "-nowarn", "-d", str(classes),
                    "-cp", os.pathsep.join(map(str, (*jars, *hadoop))), str(LOG_STORE_SOURCE)],
                   check=True, capture_output=True)
    built = work / target.name
    with zipfile.ZipFile(built, "w") as jar:   # a jar is a zip of the classes
        for path in sorted(classes.rglob("*.class")):
            jar.write(path, path.relative_to(classes).as_posix())
    built.replace(target)   # whole or not at all, for another process starting Spark meanwhile


def jar_settings(directory: Path) -> dict[str, str]:
    """The cache's jar files (with the log store when it is built: Delta then writes S3 through
    it), or the settings that make Spark resolve the packages into it."""
    jars = cached_jars(directory)
    if jars is None:
        return {"spark.jars.packages": ",".join(PACKAGES), "spark.jars.excludes": ",".join(EXCLUDES),
                "spark.jars.ivy": str(directory)}
    store = log_store_jar(directory)
    if not store.is_file():
        return {"spark.jars": ",".join(str(jar) for jar in jars)}
    return {"spark.jars": ",".join(str(jar) for jar in (*jars, store)),
            **{f"spark.delta.logStore.{scheme}.impl": LOG_STORE for scheme in LOG_STORE_SCHEMES}}


def record_resolution(directory: Path) -> bool:
    """After a JVM start that resolved the packages into directory (Ivy copies the jars to
    directory/jars): records them for the next starts. False when the packages are not all
    there (the user's own spark.jars.ivy sent them elsewhere)."""
    jars = sorted(path.name for path in (directory / "jars").glob("*.jar"))
    wanted = {"{}_{}-{}.jar".format(*package.split(":")) for package in PACKAGES}
    if not wanted <= set(jars):
        return False
    temporary = directory / f".{RESOLVED}.{os.getpid()}"
    temporary.write_text("".join(f"{name}\n" for name in jars))
    temporary.replace(directory / RESOLVED)
    return True


def fetch(directory: Path) -> list[Path]:
    """Resolves the packages into directory, unless done (Spark's launcher resolves them before it
    starts the JVM, which is then shut down at once: no Spark context), and builds the log store."""
    jars = cached_jars(directory) or _resolve(directory)
    build_log_store(directory)
    return jars


def _resolve(directory: Path) -> list[Path]:
    from pyspark import SparkConf
    from pyspark.java_gateway import launch_gateway

    gateway = launch_gateway(SparkConf(loadDefaults=False).setAll(list(jar_settings(directory).items())))  # type: ignore[no-untyped-call]
    gateway.shutdown()
    gateway.proc.stdin.close()   # PySpark's JVM ends at the end of its standard input
    gateway.proc.wait()
    if not record_resolution(directory):
        raise RuntimeError(f"the Spark packages were not resolved into {directory}")
    jars = cached_jars(directory)
    assert jars is not None
    return jars


if __name__ == "__main__":
    for jar in fetch(cache_dir()):
        print(jar)
