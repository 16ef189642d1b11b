"""A throwaway Kafka Connect worker for the tests of what Debezium's own consumers make of
replicator's topics: one standalone worker (offsets in a file, its REST API on 127.0.0.1) with the
Debezium JDBC sink connector, and Debezium's transformations, as a plugin.

Connect and the connector run from their Maven Central jars, fetched once with Maven into
$REPLICATOR_TEST_CONNECT_JARS, else ~/.cache/replicator/kafka-connect ($XDG_CACHE_HOME), one
directory per set of versions: the worker's classpath (runtime/) and the connector's plugin
directory (plugins/debezium-connector-jdbc/), which Connect loads in a class loader of its own, as
a Connect installation loads Debezium's plugin archive. `python bin/connectserver.py fetch` does it
ahead and prints the directory (bin/setup-env runs it for the dev extra); a worker's first start
does it otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kafkaserver import fetch_with_maven, free_ports, java_binary
from replicator.errors import UserError

CONNECT_VERSION = "4.3.0"
# The JDBC sink of Debezium 3.6.1.Final is not served by the Maven repository this project reaches;
# 3.6.0.Final is (the release the reproduction used: 3.6.1 changed only array and tsvector
# bindings in the sink)
DEBEZIUM_VERSION = "3.6.0.Final"
RUNTIME = (
    f"org.apache.kafka:connect-runtime:{CONNECT_VERSION}",
    f"org.apache.kafka:connect-json:{CONNECT_VERSION}",
    # Connect logs through SLF4J 1.7, which this binds to log4j2 (as bin/kafkaserver.py's broker)
    "org.apache.logging.log4j:log4j-slf4j-impl:2.24.3",
)
# The sink's connection pool module, org.hibernate:hibernate-agroal at Hibernate 7.2.6 in Debezium's
# POM, is served only as org.hibernate.orm:hibernate-agroal, of 7.2.0 and later patch releases: the
# earliest, whose calls into Hibernate 7.2.6 (Debezium's) exist there. The other databases' drivers
# the connector brings (MySQL, MariaDB, SQL Server, Oracle: 20 MB) are left out; Kafka's own
# libraries and Jackson (the same version) come from the worker: with Jackson of its own, the plugin's
# ObjectMapper finds the worker's Jackson modules as services, of another class loader's Module.
PLUGIN = (
    f"io.debezium:debezium-connector-jdbc:{DEBEZIUM_VERSION}",
    "org.hibernate.orm:hibernate-agroal:7.2.0.Final",
    "org.postgresql:postgresql:42.7.14",
)
_PLUGIN_EXCLUSIONS = {
    "io.debezium:debezium-connector-jdbc": (
        "org.hibernate:hibernate-agroal", "com.mysql:mysql-connector-j", "org.mariadb.jdbc:mariadb-java-client",
        "com.microsoft.sqlserver:mssql-jdbc", "com.oracle.database.jdbc:ojdbc11", "org.apache.kafka:connect-api",
        "org.apache.kafka:kafka-clients", "com.fasterxml.jackson.core:*"),
    "org.hibernate.orm:hibernate-agroal": ("org.hibernate.orm:hibernate-core",),
}
PLUGIN_NAME = "debezium-connector-jdbc"
SINK_CONNECTOR = "io.debezium.connector.jdbc.JdbcSinkConnector"
JVM_OPTIONS = ("-Xmx512m", "-XX:-UsePerfData", "-Djava.awt.headless=true")
LOG4J2 = """\
appender.out.type = Console
appender.out.name = out
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = out
logger.kafka.name = org.apache.kafka
logger.kafka.level = WARN
logger.worker.name = org.apache.kafka.connect.runtime
logger.worker.level = INFO
"""
# For a worker of the tests: the sink reads what the publisher committed only, hears of new records
# and new topics of its topics.regex soon, and commits its position often (the tests wait on it)
SETTINGS = {
    "key.converter": "org.apache.kafka.connect.json.JsonConverter",
    "value.converter": "org.apache.kafka.connect.json.JsonConverter",
    "offset.flush.interval.ms": "200",
    # the plugins' service manifests, rather than a scan of every class of every jar (seconds)
    "plugin.discovery": "service_load",
    "consumer.isolation.level": "read_committed",
    "consumer.fetch.max.wait.ms": "50",
    "consumer.metadata.max.age.ms": "1000",
    "consumer.auto.offset.reset": "earliest",
}


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    if env.get("REPLICATOR_TEST_CONNECT_JARS"):
        root = Path(env["REPLICATOR_TEST_CONNECT_JARS"])
    else:
        root = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "replicator" / "kafka-connect"
    return root.expanduser() / f"connect-{CONNECT_VERSION}-debezium-{DEBEZIUM_VERSION}"


def _dependency(coordinates: str) -> str:
    group, artifact, version = coordinates.split(":")
    exclusions = "".join(f"<exclusion><groupId>{g}</groupId><artifactId>{a}</artifactId></exclusion>"
                         for g, a in (e.split(":") for e in _PLUGIN_EXCLUSIONS.get(f"{group}:{artifact}", ())))
    return (f"<dependency><groupId>{group}</groupId><artifactId>{artifact}</artifactId><version>{version}</version>"
            f"<exclusions>{exclusions}</exclusions></dependency>")


def _pom(name: str, artifacts: tuple[str, ...]) -> str:
    return (f'<project xmlns="http://maven.apache.org/POM/4.0.0"><modelVersion>4.0.0</modelVersion>'
            f"<groupId>replicator</groupId><artifactId>{name}</artifactId><version>1</version>"
            f"<dependencies>{''.join(_dependency(a) for a in artifacts)}</dependencies></project>\n")


def _marker(artifacts: tuple[str, ...]) -> str:
    return "".join(f"{a} {' '.join(_PLUGIN_EXCLUSIONS.get(a.rsplit(':', 1)[0], ()))}\n" for a in artifacts)


def fetch(directory: Path) -> tuple[list[Path], Path]:
    """The worker's classpath and its plugin path, fetched with Maven unless done."""
    runtime = fetch_with_maven(directory / "runtime", _pom("kafka-connect", RUNTIME), _marker(RUNTIME),
                               f"Kafka Connect {CONNECT_VERSION}'s jars")
    plugins = directory / "plugins"
    fetch_with_maven(plugins / PLUGIN_NAME, _pom(PLUGIN_NAME, PLUGIN), _marker(PLUGIN),
                     f"Debezium's JDBC sink connector {DEBEZIUM_VERSION}")
    return runtime, plugins


class ConnectError(RuntimeError):
    """The worker's REST API refused a request: its status and what it said."""


class ConnectServer:
    """One standalone Connect worker in its own directory: worker.properties, the source offsets
    file (a sink keeps its position in Kafka, as consumer group connect-NAME), the log (worker.log).

    The worker is sent SIGTERM when the thread that started it ends (setpriv), so that an
    interrupted test run leaves no JVM behind."""

    def __init__(self, bootstrap: str, directory: str | Path | None = None) -> None:
        self.bootstrap = bootstrap
        self.directory = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="replicator-connect-"))
        (self.port,) = free_ports(1)
        self.process: subprocess.Popen[bytes] | None = None
        self.started_in: float | None = None   # seconds from the JVM's start to its REST API serving the plugin

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.directory / "worker.log"

    def start(self, timeout: float = 180) -> ConnectServer:
        """Starts the worker and returns once its REST API lists the JDBC sink connector."""
        runtime, plugins = fetch(cache_dir())
        self.directory.mkdir(parents=True, exist_ok=True)
        settings = {**SETTINGS, "bootstrap.servers": self.bootstrap, "listeners": self.url,
                    "offset.storage.file.filename": str(self.directory / "offsets"), "plugin.path": str(plugins)}
        config = self.directory / "worker.properties"
        config.write_text("".join(f"{key}={value}\n" for key, value in settings.items()))
        (self.directory / "log4j2.properties").write_text(LOG4J2)
        logging = f"-Dlog4j2.configurationFile={self.directory / 'log4j2.properties'}"
        command = [str(java_binary()), *JVM_OPTIONS, logging, "-cp", ":".join(str(jar) for jar in runtime),
                   "org.apache.kafka.connect.cli.ConnectStandalone", str(config)]
        began = time.monotonic()
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(["setpriv", "--pdeathsig", "TERM", *command], stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT)
        while not self._serves_the_sink():
            if self.process.poll() is not None:
                raise RuntimeError(f"the Connect worker exited ({self.process.returncode}) before serving its REST API;"
                                   f" the end of {self.log}:\n{self.log_tail()}")
            if time.monotonic() - began > timeout:
                self.stop()
                raise RuntimeError(f"the Connect worker did not serve the JDBC sink in {timeout:.0f} s; the end of "
                                   f"{self.log}:\n{self.log_tail()}")
            time.sleep(0.1)   # polling interval, not synchronisation
        self.started_in = time.monotonic() - began
        return self

    def _serves_the_sink(self) -> bool:
        try:
            plugins = self.request("GET", "/connector-plugins")
        except (OSError, ConnectError):
            return False
        return any(plugin["class"] == SINK_CONNECTOR for plugin in plugins)

    def request(self, method: str, path: str, body: Any = None) -> Any:
        """A call of the REST API: its JSON answer (None for an empty one); ConnectError on an error status."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                text = response.read()
        except urllib.error.HTTPError as error:
            raise ConnectError(f"{method} {path}: {error.code} {error.read().decode(errors='replace')}") from None
        return json.loads(text) if text else None

    def create_connector(self, name: str, config: Mapping[str, str]) -> None:
        self.request("POST", "/connectors", {"name": name, "config": dict(config)})

    def delete_connector(self, name: str) -> None:
        self.request("DELETE", f"/connectors/{name}")

    def status(self, name: str) -> dict[str, Any]:
        """The connector's and its tasks' states (RUNNING, FAILED with its `trace`...)."""
        status: dict[str, Any] = self.request("GET", f"/connectors/{name}/status")
        return status

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def stop(self, timeout: float = 60) -> None:
        """Shuts the worker down (SIGTERM: it stops its connectors first) and waits for its end."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise RuntimeError(f"the Connect worker did not stop in {timeout:.0f} s; the end of {self.log}:\n"
                               f"{self.log_tail()}") from None

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> ConnectServer:
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
    print(cache_dir())
