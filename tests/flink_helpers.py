"""Flink's `debezium-json` format, run for real on our records: flink-json's own deserializer
(tests/flink/DebeziumJsonRead.java) with Flink 2.2's jars, fetched once by Maven into
~/.cache/replicator/flink-json/VERSION ($XDG_CACHE_HOME) with the program compiled beside them."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

FLINK_VERSION = "2.2.0"
ARTIFACTS = (f"org.apache.flink:flink-json:{FLINK_VERSION}", f"org.apache.flink:flink-table-runtime:{FLINK_VERSION}")
PROGRAM = Path(__file__).parent / "flink" / "DebeziumJsonRead.java"


def _cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "replicator" / "flink-json" / FLINK_VERSION


def classpath() -> str:
    """The jars and the compiled program: fetched and compiled unless done (for this program's text)."""
    cache = _cache()
    jars, classes, compiled = cache / "jars", cache / "classes", cache / "compiled.java"
    if not (jars / "fetched").exists():
        shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir(parents=True)
        dependencies = "".join(f"<dependency><groupId>{g}</groupId><artifactId>{a}</artifactId><version>{v}</version>"
                               f"</dependency>" for g, a, v in (c.split(":") for c in ARTIFACTS))
        with tempfile.TemporaryDirectory(prefix="replicator-flink-maven-") as project:
            pom = Path(project) / "pom.xml"
            pom.write_text('<project xmlns="http://maven.apache.org/POM/4.0.0"><modelVersion>4.0.0</modelVersion>'
                           f"<groupId>replicator</groupId><artifactId>flink-json</artifactId><version>1</version>"
                           f"<dependencies>{dependencies}</dependencies></project>\n")
            subprocess.run(["mvn", "-q", "-B", "-f", str(pom), f"-Dmaven.repo.local={project}/repository",
                            "dependency:copy-dependencies", f"-DoutputDirectory={jars}", "-DincludeScope=runtime"],
                           check=True, capture_output=True, text=True)
        (jars / "fetched").write_text("\n".join(ARTIFACTS))
    source = PROGRAM.read_text()
    if not compiled.exists() or compiled.read_text() != source:
        shutil.rmtree(classes, ignore_errors=True)
        subprocess.run(["javac", "-cp", f"{jars}/*", "-d", str(classes), str(PROGRAM)], check=True,
                       capture_output=True, text=True)
        compiled.write_text(source)
    return f"{jars}/*{os.pathsep}{classes}"


def read_with_flink(values: list[bytes], columns: str, schemas: bool = True) -> subprocess.CompletedProcess[bytes]:
    """Flink's changelog rows of the record values ("+I\\t[...]" lines), as its debezium-json format makes
    them; columns: "name:TYPE,..." (INT, BIGINT, STRING)."""
    return subprocess.run(["java", "-cp", classpath(), "DebeziumJsonRead", columns, str(schemas).lower()],
                          input=b"".join(v + b"\n" for v in values), capture_output=True, timeout=120)
