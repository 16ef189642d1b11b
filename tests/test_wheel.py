"""The package as a user gets it: the built wheel, installed into a clean virtualenv with no
extras, installs replicator into a database and replicates into SQLite and streams, with no
checkout around; a target that needs an extra names it."""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from email.parser import Parser
from pathlib import Path

import psycopg
import pytest

import replicator as replicator_package
from replicator.extras import EXTRAS

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{args}:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # from a copy of the sources alone: a build/ left in the checkout would be packed again
    work = tmp_path_factory.mktemp("wheel")
    source = work / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", "demo-data", ".pytest_cache", ".hypothesis"))
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", work / "dist", source, cwd=work)
    (built,) = (work / "dist").glob("replicator-*.whl")
    assert built.name.startswith(f"replicator-{replicator_package.__version__}-")   # the version the code carries
    return built


@pytest.fixture(scope="module")
def bare_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtualenv holding the wheel installed with no extras (its dependencies from PyPI)."""
    venv = tmp_path_factory.mktemp("venv")
    _run(sys.executable, "-m", "venv", venv, cwd=venv)
    _run(venv / "bin" / "pip", "install", "-q", wheel, cwd=venv)
    return venv


@pytest.fixture
def captured(empty_dsn: str, bare_venv: Path, tmp_path: Path) -> Iterator[tuple[str, psycopg.Connection]]:
    """A database the venv's replicator installed into, queue q capturing table t."""
    replicator = bare_venv / "bin" / "replicator"
    assert _run(replicator, "--version", cwd=tmp_path).stdout == f"replicator, version {replicator_package.__version__}\n"
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        _run(replicator, "--dsn", empty_dsn, "install", cwd=tmp_path)
        _run(replicator, "--dsn", empty_dsn, "queue", "create", "q", cwd=tmp_path)
        _run(replicator, "--dsn", empty_dsn, "table", "add", "q", "t", cwd=tmp_path)
        yield empty_dsn, conn


def test_the_built_wheel_holds_the_package_its_sql_and_licence_only(wheel):
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


def test_each_extra_brings_the_modules_replicator_checks_it_by(wheel):
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        requires = Parser().parsestr(archive.read(metadata).decode()).get_all("Requires-Dist")
    brought: dict[str, set[str]] = {}
    for requirement in requires:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement).group()
        extra = re.search(r'extra == "(\w+)"', requirement)
        brought.setdefault(extra.group(1) if extra else "", set()).add(name.lower().replace("-", "_"))
    assert {extra: modules - {"replicator"} for extra, modules in brought.items() if extra in EXTRAS} \
        == {extra: set(modules) for extra, modules in EXTRAS.items()}
    assert not brought[""] & {m for modules in EXTRAS.values() for m in modules}   # the base install has none
    assert "pyspark" not in brought["delta"]   # the Delta warehouse is written without Spark


def test_a_base_install_has_no_extra_and_imports_every_base_module(bare_venv):
    python = bare_venv / "bin" / "python"
    present = _run(python, "-c", "from importlib.util import find_spec; from replicator.extras import EXTRAS; "
                                 "print([m for ms in EXTRAS.values() for m in ms if find_spec(m)])", cwd=bare_venv)
    assert present.stdout.strip() == "[]"
    # the modules lint-imports forbids the extras' packages, each imported as a base install has it
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (base,) = [c["source_modules"] for c in contracts if c["name"].startswith("a base install imports no extra")]
    imported = _run(python, "-c", f"""
import importlib, pkgutil
count = 0
for name in {base!r}:
    module = importlib.import_module(name)
    count += 1
    for found in pkgutil.walk_packages(getattr(module, "__path__", []), name + "."):
        importlib.import_module(found.name)
        count += 1
print(count)
""", cwd=bare_venv)
    assert int(imported.stdout) > len(base)


def test_a_base_install_replicates_into_sqlite_and_streams(captured, bare_venv, tmp_path):
    dsn, conn = captured
    replicator = bare_venv / "bin" / "replicator"
    conn.execute("INSERT INTO t VALUES (1, 'copied')")
    into_sqlite = (replicator, "--dsn", dsn, "consume", "q", "--target", "sqlite:replica.db", "--until-caught-up")
    into_jsonl = (replicator, "--dsn", dsn, "consume", "q", "--target", "jsonl:changes.jsonl", "--until-caught-up")
    _run(*into_sqlite, cwd=tmp_path)
    _run(*into_jsonl, cwd=tmp_path)
    conn.execute("INSERT INTO t VALUES (2, 'captured')")
    _run(*into_sqlite, cwd=tmp_path)
    _run(*into_jsonl, cwd=tmp_path)
    with sqlite3.connect(tmp_path / "replica.db") as replica:
        assert replica.execute("SELECT id, v FROM t ORDER BY id").fetchall() == [(1, "copied"), (2, "captured")]
    lines = [json.loads(line) for line in (tmp_path / "changes.jsonl").read_text().splitlines()]
    assert [(line["op"], line["row"]) for line in lines] == [("R", {"id": 1, "v": "copied"}),
                                                             ("I", {"id": 2, "v": "captured"})]


def test_a_base_install_names_the_extra_a_delta_or_kafka_target_needs(captured, bare_venv, tmp_path):
    dsn, _ = captured
    replicator = bare_venv / "bin" / "replicator"
    needs = {
        ("consume", "q", "--target", "delta:warehouse", "--once"): "the Delta target needs replicator[delta]",
        ("delta", "tables", "--target", "delta:warehouse"): "the Delta warehouse needs replicator[delta]",
        ("delta", "optimize", "--target", "delta:warehouse"): "the Delta warehouse needs replicator[delta]",
        ("delta", "vacuum", "--target", "delta:warehouse"): "the Delta warehouse needs replicator[delta]",
        ("view", "list", "--target", "delta:warehouse"): "the Delta target needs replicator[delta]",
        ("consume", "q", "--target", "kafka://127.0.0.1:9/shop", "--once"): "the Kafka target needs replicator[kafka]",
        ("consume", "--source", "kafka://127.0.0.1:9/shop", "--target", "sqlite:cache.db", "--once"):
            "a follower of Kafka topics needs replicator[kafka]",
    }
    for args, need in needs.items():
        result = subprocess.run([replicator, "--dsn", dsn, *args], cwd=tmp_path, capture_output=True, text=True,
                                timeout=60)
        extra = re.search(r"replicator\[(\w+)\]", need).group(1)
        assert (result.returncode, result.stderr) == (1, f"error: {need}: pip install 'replicator[{extra}]'\n"), args
    assert list(tmp_path.iterdir()) == []   # nothing made: no warehouse, no cache.db
