"""A throwaway Apache Kafka broker for the tests and the benchmarks: one KRaft node (broker and
controller in one JVM) in its own directory, listening on 127.0.0.1 only.

Kafka runs from its Maven Central jars rather than a distribution: Maven fetches them once into
$REPLICATOR_TEST_KAFKA_JARS (not REPLICATOR_KAFKA_*: every name there is a Kafka setting), else
~/.cache/replicator/kafka-broker ($XDG_CACHE_HOME), one directory per Kafka version.
`python bin/kafkaserver.py fetch` does it ahead and prints the jars' directory (bin/setup-env runs
it for the dev extra); a broker's first start does it otherwise.

The cache also keeps the classes a broker loads, as the JVM archives them (class data sharing),
for the Java that runs it: the first broker stopped cleanly writes the archive, and later ones
load it. A new broker is then ready (storage formatted, transactions served) in ~2 s on 2 idle
cores, against ~3.5 s without (3 s against 5 s on busy ones).
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient

from replicator.errors import UserError

KAFKA_VERSION = "4.1.1"
ARTIFACTS = (
    f"org.apache.kafka:kafka_2.13:{KAFKA_VERSION}",
    # Kafka logs through SLF4J 1.7; its distribution binds that to log4j2 with this jar, which the
    # Maven artifact leaves out (without it the broker logs nothing)
    "org.apache.logging.log4j:log4j-slf4j-impl:2.24.3",
)
FETCHED = "fetched"   # the artifacts, written last into the cache directory: without it a fetch starts over

# For one broker on a shared machine: internal topics of one replica and one partition (50 by
# default, created at first use: seconds on 2 cores), fewer threads
SETTINGS = {
    "process.roles": "broker,controller",
    "node.id": "1",
    "controller.listener.names": "CONTROLLER",
    "inter.broker.listener.name": "PLAINTEXT",
    "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
    "num.partitions": "1",
    "default.replication.factor": "1",
    "min.insync.replicas": "1",
    "offsets.topic.replication.factor": "1",
    "offsets.topic.num.partitions": "1",
    "transaction.state.log.replication.factor": "1",
    "transaction.state.log.min.isr": "1",
    "transaction.state.log.num.partitions": "1",
    "share.coordinator.state.topic.replication.factor": "1",
    "share.coordinator.state.topic.min.isr": "1",
    "group.initial.rebalance.delay.ms": "0",
    "num.network.threads": "2",
    "num.io.threads": "2",
    # A broker killed and started again registers once its controller has given up on its old self
    # (9 s by default): 3 s
    "broker.session.timeout.ms": "3000",
    "broker.heartbeat.interval.ms": "500",
    # compaction soon after a topic's own settings allow it (segment.ms, min.cleanable.dirty.ratio):
    # the cleaner looks for work every 100 ms rather than 15 s
    "log.cleaner.backoff.ms": "100",
    "log.cleaner.dedupe.buffer.size": str(16 * 1024 * 1024),   # 128 MB by default, of a 512 MB heap
}
JVM_OPTIONS = ("-Xmx512m", "-XX:-UsePerfData", "-Djava.awt.headless=true")
# Everything the broker logs goes to its standard output, which is its directory's server.log
LOG4J2 = """\
appender.out.type = Console
appender.out.name = out
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = out
"""
READY_PROBE_ID = "replicator-kafkaserver-ready"   # the transactional.id start() proves transactions with
# The probes' clients log the broker's refusals while it starts: not for the terminal
_QUIET = logging.getLogger("kafkaserver.probes")
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    if env.get("REPLICATOR_TEST_KAFKA_JARS"):
        root = Path(env["REPLICATOR_TEST_KAFKA_JARS"])
    else:
        root = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "replicator" / "kafka-broker"
    return root.expanduser() / KAFKA_VERSION


def _pom() -> str:
    dependencies = "".join(
        f"<dependency><groupId>{group}</groupId><artifactId>{artifact}</artifactId><version>{version}</version>"
        f"</dependency>" for group, artifact, version in (coordinates.split(":") for coordinates in ARTIFACTS))
    return (f'<project xmlns="http://maven.apache.org/POM/4.0.0"><modelVersion>4.0.0</modelVersion>'
            f"<groupId>replicator</groupId><artifactId>kafka-broker</artifactId><version>{KAFKA_VERSION}</version>"
            f"<dependencies>{dependencies}</dependencies></project>\n")


def fetch(directory: Path) -> list[Path]:
    """Kafka's jars in the cache directory, fetched with Maven unless done (for these artifacts)."""
    return fetch_with_maven(directory, _pom(), "".join(f"{coordinates}\n" for coordinates in ARTIFACTS),
                            f"Kafka {KAFKA_VERSION}'s jars")


def fetch_with_maven(directory: Path, pom: str, marker: str, what: str) -> list[Path]:
    """The jars of the POM's runtime dependencies in directory/jars, fetched with Maven unless a fetch
    wrote the marker (the artifacts' list) last into directory/FETCHED: without it, or with another
    list, the directory is emptied and the fetch starts over."""
    jars = directory / "jars"
    try:
        fetched = (directory / FETCHED).read_text() == marker
    except FileNotFoundError:
        fetched = False
    if not fetched:
        mvn = shutil.which("mvn")
        if mvn is None:
            raise UserError(f"Maven (mvn) not found, which fetches {what}: install the 'maven' package")
        shutil.rmtree(directory, ignore_errors=True)   # a half fetch, and class archives of other jars
        directory.mkdir(parents=True)
        with tempfile.TemporaryDirectory(prefix="replicator-kafka-maven-") as project:
            (Path(project) / "pom.xml").write_text(pom)
            # a local repository of this fetch's own, not ~/.m2: Maven leaves there the POMs of versions
            # it did not choose, without their jars, and Spark's resolution fails on any of them it needs
            result = subprocess.run([mvn, "-q", "-B", "-f", f"{project}/pom.xml",
                                     f"-Dmaven.repo.local={project}/repository",
                                     "dependency:copy-dependencies", f"-DoutputDirectory={jars}",
                                     "-DincludeScope=runtime"],
                                    capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"Maven could not fetch {what}:\n{result.stdout}{result.stderr}")
        (directory / FETCHED).write_text(marker)
    return sorted(jars.glob("*.jar"))


def java_binary() -> Path:
    home = os.environ.get("JAVA_HOME")
    found = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    if found is None or not Path(found).is_file():
        raise UserError("Java not found, which runs Kafka and Connect: install Java 17 or newer, or set JAVA_HOME")
    return Path(found)


def _class_archive(java: Path) -> Path:
    """Where the classes a broker loads are archived for this Java (a JVM ignores, with a warning in
    its log, an archive another JVM wrote)."""
    binary = java.resolve()
    stat = binary.stat()
    key = hashlib.sha256(f"{binary}\n{stat.st_size}\n{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir() / f"classes-{key}.jsa"


def free_ports(count: int) -> list[int]:
    """Distinct free ports: the sockets stay bound until all are chosen."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _cluster_id() -> str:
    """A random cluster id as Kafka writes them (a UUID in URL-safe base64), not starting with '-'
    (the storage tool would take it for an option)."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):
            return text


class KafkaServer:
    """One Kafka node in its own directory: server.properties, the data (data/), the log (server.log).

    The broker process is sent SIGTERM when the thread that started it ends, so that an interrupted
    test run leaves no broker behind."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="replicator-kafka-"))
        self.port, self.controller_port = free_ports(2)
        self.process: subprocess.Popen[bytes] | None = None
        self._archive_draft = self.directory / "classes.jsa"   # written at a clean stop, then kept in the cache

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.directory / "server.log"

    @property
    def config(self) -> Path:
        return self.directory / "server.properties"

    def _settings(self) -> dict[str, str]:
        return {
            **SETTINGS,
            "listeners": f"PLAINTEXT://{self.bootstrap},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://{self.bootstrap}",
            # a static quorum of this node: its address is read from here at each start, not from the data
            "controller.quorum.voters": f"1@127.0.0.1:{self.controller_port}",
            "log.dirs": str(self.directory / "data"),
        }

    def _shared_classes(self) -> tuple[str, ...]:
        """The JVM option that loads the class archive, once there is one."""
        archive = _class_archive(java_binary())
        return (f"-XX:SharedArchiveFile={archive}",) if archive.exists() else ()

    def _java_command(self, *arguments: str, options: tuple[str, ...] = ()) -> list[str]:
        classpath = os.pathsep.join(str(jar) for jar in fetch(cache_dir()))   # in one order, as the archive wants
        return [str(java_binary()), *JVM_OPTIONS, *options,
                f"-Dlog4j2.configurationFile={self.directory / 'log4j2.properties'}", "-cp", classpath, *arguments]

    def init(self) -> KafkaServer:
        """Writes the configuration (this object's ports) and formats the storage unless formatted."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.config.write_text("".join(f"{key}={value}\n" for key, value in self._settings().items()))
        (self.directory / "log4j2.properties").write_text(LOG4J2)
        if not (self.directory / "data" / "meta.properties").exists():
            # the storage tool runs for a moment: no optimising compiler
            options = (*self._shared_classes(), "-XX:TieredStopAtLevel=1")
            result = subprocess.run(self._java_command("kafka.tools.StorageTool", "format", "--config",
                                                       str(self.config), "--cluster-id", _cluster_id(),
                                                       options=options),
                                    capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"formatting the Kafka storage failed:\n{result.stdout}{result.stderr}")
        return self

    def start(self, timeout: float = 120) -> KafkaServer:
        """Starts the broker and returns once it serves metadata and transactions."""
        self.init()
        sharing = self._shared_classes() or (f"-XX:ArchiveClassesAtExit={self._archive_draft}",)
        with open(self.log, "ab") as log:
            # setpriv: SIGTERM to the broker when the thread that started it ends
            self.process = subprocess.Popen(
                ["setpriv", "--pdeathsig", "TERM", *self._java_command("kafka.Kafka", str(self.config),
                                                                       options=sharing)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        self._wait_until("accepting connections", self._accepts_connections, deadline)
        self._wait_until("answering a metadata request", self._serves_metadata, deadline)
        # a new producer each time, waiting longer each time: one that is told to retry (the transaction
        # state topic is being created, then loaded) does so only 500 ms later (librdkafka's timer)
        waits = (min(2.0, 0.2 * 1.5**attempt) for attempt in itertools.count())
        self._wait_until("serving transactions", lambda: self._serves_transactions(next(waits)), deadline)
        return self

    def _wait_until(self, state: str, ready: Callable[[], bool], deadline: float) -> None:
        assert self.process is not None
        while not ready():
            if self.process.poll() is not None:
                raise RuntimeError(f"the Kafka broker exited ({self.process.returncode}) before {state}; "
                                   f"the end of {self.log}:\n{self._log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"the Kafka broker was not {state} in time; the end of {self.log}:\n"
                                   f"{self._log_tail()}")

    def _accepts_connections(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            return True
        except OSError:
            time.sleep(0.05)   # polling interval, not synchronisation
            return False

    def _serves_metadata(self) -> bool:
        admin = AdminClient({"bootstrap.servers": self.bootstrap}, logger=_QUIET)
        try:
            return bool(admin.list_topics(timeout=1).brokers)
        except KafkaException:
            return False

    def _serves_transactions(self, wait: float) -> bool:
        """A transactional producer's first step, which creates the transaction state topic."""
        producer = Producer({"bootstrap.servers": self.bootstrap, "transactional.id": READY_PROBE_ID},
                            logger=_QUIET)
        try:
            producer.init_transactions(wait)
            return True
        except KafkaException as error:
            reason: KafkaError = error.args[0]
            if reason.retriable():
                return False
            raise

    def _log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 60) -> None:
        """Shuts the broker down cleanly (SIGTERM) and waits for its end."""
        if self.process is None or not self.is_running():
            return
        self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"the Kafka broker did not stop in {timeout:.0f} s; the end of {self.log}:\n"
                               f"{self._log_tail()}") from None
        if self._archive_draft.exists():
            self._archive_draft.replace(_class_archive(java_binary()))

    def kill(self) -> None:
        """Ends the broker at once (SIGKILL), as a crash would."""
        if self.process is not None and self.is_running():
            self.process.kill()
            self.process.wait()

    def restart(self) -> KafkaServer:
        """Starts the broker again (stopped first if running), on the same ports with the same data."""
        self.stop()
        return self.start()

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> KafkaServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.destroy()


if __name__ == "__main__":
    if sys.argv[1:] != ["fetch"]:
        sys.exit(f"usage: {sys.argv[0]} fetch")
    try:
        fetch(cache_dir())
    except UserError as error:
        sys.exit(str(error))
    print(cache_dir() / "jars")
