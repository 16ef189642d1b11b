"""bin/demo, the README's first command, as a user runs it: it replicates a live
workload into SQLite and shows the replica equal to the source."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parent.parent / "bin" / "demo.py"


def demo_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG") and k != "REPLICATOR_DSN"}
    return {**env, "COLUMNS": "160", "NO_COLOR": "1", **extra}


@pytest.fixture
def demo_dir() -> Iterator[Path]:
    """A directory the postgres user can reach (pytest's tmp_path is closed to it)."""
    path = Path(tempfile.mkdtemp(prefix="replicator-demo-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.pg   # the demo starts a cluster of its own
def test_demo_replicates_its_workload_and_shows_equal_values(demo_dir):
    result = subprocess.run([sys.executable, str(DEMO), "--seconds", "2", "--dir", str(demo_dir)],
                            env=demo_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = {m[1]: (int(m[2]), int(m[3]), m[4])
            for m in re.finditer(r"│ (\w+)\s+│ (\d+)\s+│ (\d+)\s+│ (yes|NO)\s+│", result.stdout)}
    assert set(rows) == {"airport", "flight", "position_report"}, result.stdout
    for table, (source_rows, replica_rows, same) in rows.items():
        assert source_rows == replica_rows and same == "yes", (table, rows[table])
    assert rows["position_report"][0] > 0
    assert (demo_dir / "replica.db").exists()
    # each step on a line of its own (off a terminal too), nothing about an uninstall on a new cluster
    assert re.search(r"(?m)^5\. \d+ transactions written", result.stdout), result.stdout
    assert "uninstalled" not in result.stdout


def test_demo_refuses_to_drop_tables_in_a_database_it_was_pointed_at(tmp_path):
    result = subprocess.run([sys.executable, str(DEMO), "--dir", str(tmp_path)],
                            env=demo_env(REPLICATOR_DSN="host=127.0.0.1 port=1 dbname=precious"),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith("error: REPLICATOR_DSN is set") and "--reset" in result.stderr
    assert not (tmp_path / "replica.db").exists()
