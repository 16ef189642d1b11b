"""The package as a user gets it: the built wheel, installed into a clean virtualenv,
installs replicator into a database and captures from it, with no checkout around."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import psycopg

import replicator as replicator_package

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{args}:\n{result.stdout}\n{result.stderr}"
    return result


def test_the_built_wheel_installs_into_a_clean_venv_and_captures(dsn, tmp_path):
    # from a copy of the sources alone: a build/ left in the checkout would be packed again
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", "demo-data", ".pytest_cache", ".hypothesis"))
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp_path / "dist", source, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("replicator-*.whl")
    assert wheel.name.startswith(f"replicator-{replicator_package.__version__}-")   # the version the code carries
    names = zipfile.ZipFile(wheel).namelist()
    assert f"replicator-{replicator_package.__version__}.dist-info/licenses/LICENSE" in names
    shipped = {Path(n).name for n in names if n.endswith(".sql")}
    assert {p.name for p in (ROOT / "queue_sql").glob("*.sql")} | {p.name for p in (ROOT / "migrations").glob("*.sql")} \
        == shipped
    assert all(n.startswith(("replicator/", "replicator-")) for n in names), names   # no top-level folders
    modules = {n.removesuffix(".py").replace("/", ".") for n in names if n.endswith(".py")}
    package = {str(p.relative_to(ROOT).with_suffix("")).replace("/", ".") for p in (ROOT / "replicator").rglob("*.py")}
    assert modules - {"replicator.migrations.__init__", "replicator.queue_sql.__init__"} == package
    assert not any("bench" in m or "pgserver" in m for m in modules)   # bin/'s helpers stay out

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    _run(venv / "bin" / "pip", "install", "-q", wheel, cwd=tmp_path)
    # the Delta warehouse is written without Spark: the base install has what it needs, and no PySpark
    _run(venv / "bin" / "python", "-c", "import replicator.targets.delta.object_storage, deltalake, pyroaring, numpy",
         cwd=tmp_path)
    assert subprocess.run([venv / "bin" / "python", "-c", "import pyspark"], capture_output=True).returncode != 0
    replicator = venv / "bin" / "replicator"
    assert _run(replicator, "--version", cwd=tmp_path).stdout == f"replicator, version {replicator_package.__version__}\n"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP SCHEMA replicator CASCADE")             # the fixture's install, from the checkout
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        _run(replicator, "--dsn", dsn, "install", cwd=tmp_path)
        _run(replicator, "--dsn", dsn, "queue", "create", "q", cwd=tmp_path)
        _run(replicator, "--dsn", dsn, "table", "add", "q", "t", cwd=tmp_path)
        conn.execute("INSERT INTO t VALUES (1, 'copied')")
        consume = (replicator, "--dsn", dsn, "consume", "q", "--target", "jsonl:changes.jsonl", "--until-caught-up")
        _run(*consume, cwd=tmp_path)
        conn.execute("INSERT INTO t VALUES (2, 'captured')")
        _run(*consume, cwd=tmp_path)
    lines = [json.loads(line) for line in (tmp_path / "changes.jsonl").read_text().splitlines()]
    assert [(line["op"], line["row"]) for line in lines] == [("R", {"id": 1, "v": "copied"}),
                                                             ("I", {"id": 2, "v": "captured"})]
