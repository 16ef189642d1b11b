"""Bounded memory: one source transaction of a million rows is applied by a
real `replicator consume` process whose peak RSS stays under 300 MB."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from consumer_helpers import REPLICATOR, cli_env, run_cli, sqlite_position, sqlite_reader

ROWS = 1_000_000
RSS_LIMIT_KB = 300 * 1024


# A process's ru_maxrss counts the memory of the process it was forked from
# (the high-water mark survives exec): forked from this test run, large by now,
# the consumer would inherit its size. A small launcher forks it instead and
# reports the consumer's own figure.
LAUNCHER = """
import os, sys
pid = os.fork()
if pid == 0:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.execv(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss)
"""


def peak_rss_kb(dsn: str, *args: str, log: Path, timeout: float = 120) -> tuple[int, int]:
    """Runs `replicator ARGS` and returns (exit status, peak RSS in KiB) of that process alone."""
    with open(log, "wb") as stderr:
        result = subprocess.run([sys.executable, "-c", LAUNCHER, str(REPLICATOR), *args], env=cli_env(dsn),
                                stdout=subprocess.PIPE, stderr=stderr, timeout=timeout, text=True)
    status, rss = result.stdout.split()
    return int(status), int(rss)


@pytest.mark.parametrize("path", ["events", "pk join-back", "initial copy", "events of 1 KB rows"])
def test_a_million_row_transaction_is_applied_in_bounded_memory(dsn, conn, source, tmp_path, path):
    """A million narrow rows (200,000 rows of 1 KB for the wide case: a fetch
    of a fixed number of 1000-row events held ~450 MB of them)."""
    rows = 200_000 if "1 KB" in path else ROWS
    conn.execute("CREATE TABLE narrow (id int PRIMARY KEY, v int, pad text)")
    source.create_queue("q")
    source.add_table("q", "narrow", mode="pk" if path == "pk join-back" else "full")
    replica = tmp_path / "r.db"
    args = ["consume", "q", "--target", f"sqlite:{replica}"]
    if path != "initial copy":
        assert run_cli(dsn, *args, "--until-caught-up").returncode == 0     # copies the empty table
    conn.execute("INSERT INTO narrow SELECT g, g, %s FROM generate_series(1, %s) g",
                 ("x" * 1000 if "1 KB" in path else None, rows))

    started = time.monotonic()
    status, peak_kb = peak_rss_kb(dsn, *args, "--until-caught-up", log=tmp_path / "consumer.log")
    elapsed = time.monotonic() - started
    assert status == 0, (tmp_path / "consumer.log").read_text()
    db = sqlite_reader(replica)
    try:
        assert db.execute("SELECT count(*), sum(v) FROM narrow").fetchone() == (rows, rows * (rows + 1) // 2)
    finally:
        db.close()
    assert sqlite_position(replica) == source.latest_tick("q")
    print(f"{path}: peak RSS {peak_kb / 1024:.0f} MB, {elapsed:.1f}s")
    assert peak_kb < RSS_LIMIT_KB, f"consumer peak RSS {peak_kb / 1024:.0f} MB"
    assert elapsed < 60, f"applying {rows} rows took {elapsed:.0f}s"
