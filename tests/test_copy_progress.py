"""A table's initial copy shows its progress: log lines off a terminal (rows, the
estimate, rows/s, time left), and `replicator status` shows the copy each consumer
runs, from a row the consumer keeps on the source while it copies."""

from __future__ import annotations

import json
import re

from consumer_helpers import Daemon, run_cli, sqlite_reader, wait_until
from replicator.source.status import status
from replicator.source.table_copy import estimated_rows, progress_line

ROWS = 400_000
PROGRESS = re.compile(r"copy public\.t: ([\d,]+) of ~([\d,]+) rows \((\d+)%\), ([\d,]+) rows/s, ~(\d+)s left")


def _large_table(conn, source, rows: int = ROWS) -> None:
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    conn.execute("INSERT INTO t SELECT g, repeat('x', 40) FROM generate_series(1, %s) g", (rows,))
    conn.execute("ANALYZE t")
    source.create_queue("q")
    source.add_table("q", "t")


def _copy(source) -> dict | None:
    consumers = status(source)["consumers"]
    return consumers[0]["copy"] if consumers else None


def test_progress_line_gives_rows_of_the_estimate_rate_and_time_left():
    assert progress_line(1_200_000, 2_000_000, 18.75) == \
        "1,200,000 of ~2,000,000 rows (60%), 64,000 rows/s, ~12s left"


def test_progress_line_at_the_start_gives_the_estimate_without_rate_or_time_left():
    assert progress_line(0, 2_000_000, 0.0) == "0 of ~2,000,000 rows (0%), 0 rows/s"


def test_progress_line_without_an_estimate_or_past_it_gives_rows_and_rate_only():
    assert progress_line(5000, 0, 2.0) == "5,000 rows, 2,500 rows/s"
    assert progress_line(3000, 2000, 1.0) == "3,000 rows, 3,000 rows/s"


def test_estimate_is_unknown_before_analyze_and_sums_a_partitioned_tables_partitions(conn):
    conn.execute("CREATE TABLE never_analyzed (id int)")
    conn.execute("INSERT INTO never_analyzed SELECT generate_series(1, 100)")
    oid = conn.execute("SELECT 'never_analyzed'::regclass::oid").fetchone()[0]
    assert estimated_rows(conn, oid) == 0
    conn.execute("CREATE TABLE p (id int) PARTITION BY RANGE (id)")
    conn.execute("CREATE TABLE p1 PARTITION OF p FOR VALUES FROM (0) TO (1000)")
    conn.execute("CREATE TABLE p2 PARTITION OF p FOR VALUES FROM (1000) TO (3000)")
    conn.execute("INSERT INTO p SELECT generate_series(0, 2999)")
    conn.execute("ANALYZE p1, p2")
    assert estimated_rows(conn, conn.execute("SELECT 'p'::regclass::oid").fetchone()[0]) == 3000


def test_copy_off_a_terminal_logs_progress_lines_then_the_copied_line_and_leaves_no_copy_in_status(
        dsn, conn, source, tmp_path):
    _large_table(conn, source)
    result = run_cli(dsn, "consume", "q", "--target", f"sqlite:{tmp_path}/r.db", "--until-caught-up",
                     "--progress-interval", "0.05")
    assert result.returncode == 0, result.stderr
    lines = [m for m in map(PROGRESS.search, result.stderr.splitlines()) if m]
    assert len(lines) >= 2, result.stderr
    done = [int(m.group(1).replace(",", "")) for m in lines]
    assert done == sorted(done) and 0 < done[0] < ROWS
    assert {m.group(2) for m in lines} == {f"{ROWS:,}"}
    assert all(int(m.group(4).replace(",", "")) > 0 for m in lines)
    assert f"copied public.t: {ROWS:,} rows in" in result.stderr
    assert _copy(source) is None   # cleared when the copy ended


def test_status_shows_the_copy_a_consumer_runs_and_one_left_by_a_killed_consumer_until_it_starts_again(
        dsn, conn, source, tmp_path):
    _large_table(conn, source)
    replica = tmp_path / "r.db"
    daemon = Daemon(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--progress-interval", "0.05",
                    log=tmp_path / "consumer.log")
    try:
        def check() -> None:
            assert daemon.alive(), daemon.log()

        copy = wait_until(lambda: (c := _copy(source)) and c["rows"] > 0 and c, 120, "a copy in status",
                          interval=0.01, check=check)
        assert copy["table"] == "public.t"
        assert 0 < copy["rows"] < ROWS and copy["estimated_rows"] == ROWS
        assert copy["rows_per_second"] > 0 and copy["started"] <= copy["updated"]
        daemon.kill9()
    finally:
        daemon.stop()
    left = json.loads(run_cli(dsn, "status", "--json").stdout)["consumers"][0]["copy"]
    assert left["table"] == "public.t" and left["rows"] >= copy["rows"]
    text = run_cli(dsn, "status", COLUMNS="250").stdout
    assert "copies running" in text and f"of ~{ROWS:,} rows" in text and "s ago" in text
    result = run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up")
    assert result.returncode == 0, result.stderr
    assert _copy(source) is None
    assert sqlite_reader(replica).execute("SELECT count(*) FROM t").fetchone()[0] == ROWS
