"""The daemons' Prometheus metrics and health endpoint, scraped over HTTP from the
real console scripts: counters move with a workload, the health turns 503 when the
source is unreachable or the lag passes --health-max-lag, and the sample alert
rules of docs/alerts.yml name only metrics the daemons export."""

from __future__ import annotations

import json
import re
import socket
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path

import psycopg
import yaml

from consumer_helpers import Daemon, forced_tick, run_cli, sqlite_reader, wait_until
from replicator.source import monitoring

ALERTS = Path(__file__).parent.parent / "docs" / "alerts.yml"
METRIC_NAME = re.compile(r"\breplicator_[a-z_]+")


class Served:
    """A daemon started with --metrics-port 0, and the port it logged."""

    def __init__(self, dsn: str, log: Path, *args: str) -> None:
        self.daemon = Daemon(dsn, *args, "--metrics-port", "0", log=log)
        found = wait_until(lambda: re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", self.daemon.log()),
                           60, "the metrics port in the log", check=self.check)
        self.url = f"http://127.0.0.1:{found.group(1)}"

    def check(self) -> None:
        assert self.daemon.alive(), self.daemon.log()

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            return response.read().decode()

    def value(self, name: str, **labels: str) -> float | None:
        """The sample's value, None if the daemon does not export it (yet)."""
        for line in self.metrics().splitlines():
            sample, _, value = line.rpartition(" ")
            found_name, _, found_labels = sample.partition("{")
            if found_name == name and all(f'{k}="{v}"' in found_labels for k, v in labels.items()):
                return float(value)
        return None

    def names(self) -> set[str]:
        text = self.metrics()
        return set(re.findall(r"^# TYPE (\S+)", text, re.M)) | set(re.findall(r"^(\w+)[{ ]", text, re.M))

    def health(self) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def stop(self) -> None:
        self.daemon.stop()


def _consumer_name(conn) -> str:
    return wait_until(lambda: conn.execute("SELECT consumer_name FROM replicator.consumer").fetchone(), 60,
                      "the consumer registered")[0]


def test_consumer_counts_what_it_copies_and_applies_reports_its_lag_and_is_healthy_when_caught_up(
        dsn, conn, queue_q, tmp_path):
    replica = tmp_path / "r.db"
    served = Served(dsn, tmp_path / "consumer.log", "consume", "q", "--target", f"sqlite:{replica}",
                    "--poll-interval", "0.05")
    try:
        name = _consumer_name(conn)
        labels = {"queue": "q", "consumer": name}
        wait_until(lambda: served.value("replicator_copied_rows_total", **labels) == 10, 60, "the copy counted",
                   check=served.check)
        before = served.value("replicator_batches_total", **labels)
        for first in (100, 200, 300):
            conn.execute("INSERT INTO t SELECT g, 'new' FROM generate_series(%s::int, %s::int) g", (first, first + 99))
        forced_tick(conn)
        wait_until(lambda: served.value("replicator_rows_applied_total", **labels) == 300, 60,
                   "300 rows applied", check=served.check)
        assert served.value("replicator_events_applied_total", **labels) == 3   # one per statement
        assert served.value("replicator_batches_total", **labels) > before
        assert sqlite_reader(replica).execute("SELECT count(*) FROM t").fetchone()[0] == 310
        wait_until(lambda: served.value("replicator_consumer_lag_seconds", **labels) is not None, 30,
                   "the lag read", check=served.check)
        assert served.value("replicator_consumer_lag_ticks", **labels) >= 0
        assert served.value("replicator_consumer_lag_events", **labels) >= 0
        assert served.value("replicator_last_tick_age_seconds", queue="q") >= 0
        assert served.value("replicator_errors_total", kind="source_unavailable") == 0
        assert served.value("process_resident_memory_bytes") > 0
        status, report = served.health()
        assert (status, report["status"]) == (200, "ok")
    finally:
        served.stop()


def test_consumer_health_is_503_while_the_source_is_unreachable_and_200_once_it_is_back(
        pg_server, dsn, conn, queue_q, tmp_path):
    dbname = conn.info.dbname
    admin = psycopg.connect(pg_server.dsn, autocommit=True)   # a database cannot shut out its own sessions
    served = Served(dsn, tmp_path / "consumer.log", "consume", "q", "--target", f"sqlite:{tmp_path}/r.db",
                    "--poll-interval", "0.05")
    try:
        wait_until(lambda: served.health()[0] == 200, 60, "healthy: connected, a pass done", check=served.check)
        admin.execute(f'ALTER DATABASE "{dbname}" ALLOW_CONNECTIONS false')
        try:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                         " WHERE application_name LIKE 'replicator consumer%'")
            status, report = wait_until(lambda: (h := served.health())[1]["status"] == "source unavailable" and h,
                                        60, "unhealthy", check=served.check)
            assert status == 503 and report["reason"]
            assert served.value("replicator_errors_total", kind="source_unavailable") >= 1
        finally:
            admin.execute(f'ALTER DATABASE "{dbname}" ALLOW_CONNECTIONS true')
        wait_until(lambda: served.health()[0] == 200, 60, "healthy again", check=served.check)
    finally:
        served.stop()
        admin.close()


def test_consumer_health_is_503_when_its_lag_exceeds_health_max_lag(dsn, conn, queue_q, tmp_path):
    served = Served(dsn, tmp_path / "consumer.log", "consume", "q", "--target", f"sqlite:{tmp_path}/r.db",
                    "--health-max-lag", "1ms")
    try:
        status, report = wait_until(lambda: (h := served.health())[1]["status"] == "lagging" and h, 60,
                                    "lagging", check=served.check)
        assert status == 503 and "exceeds 0.001s" in report["reason"]
        assert report["lag_seconds"] > 0.001
    finally:
        served.stop()


def test_ticker_counts_ticks_and_reports_each_queues_last_tick_age(dsn, conn, queue_q, tmp_path):
    served = Served(dsn, tmp_path / "ticker.log", "ticker", "--interval", "0.05")
    try:
        conn.execute("INSERT INTO t VALUES (1000, 'x')")
        wait_until(lambda: (served.value("replicator_ticks_total") or 0) >= 1, 60, "a tick counted",
                   check=served.check)
        age = wait_until(lambda: served.value("replicator_last_tick_age_seconds", queue="q"), 30,
                         "the tick age", check=served.check)
        assert 0 < age < 60
        assert served.health()[0] == 200
    finally:
        served.stop()


def test_maint_counts_rotations_and_reports_how_overdue_a_rotation_is(dsn, conn, source, queue_q, tmp_path):
    conn.execute("UPDATE replicator.queue SET queue_switch_time = now() - interval '3 hours'")
    overdue = monitoring.rotation_overdue(source)["q"]
    assert timedelta(hours=1) <= timedelta(seconds=overdue) < timedelta(hours=1, minutes=1)
    served = Served(dsn, tmp_path / "maint.log", "maint", "--interval", "0.05")
    try:
        wait_until(lambda: served.value("replicator_rotations_total", queue="q") == 1, 60, "a rotation counted",
                   check=served.check)
        assert served.value("replicator_rotation_overdue_seconds", queue="q") == 0
        assert served.health()[0] == 200
    finally:
        served.stop()


def test_sample_alert_rules_parse_and_name_only_metrics_the_daemons_export(dsn, conn, queue_q, tmp_path):
    rules = [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]
    assert {"ReplicatorConsumerLagging", "ReplicatorConsumerDown", "ReplicatorNoTicks",
            "ReplicatorRotationOverdue", "ReplicatorCopyStalled"} <= {rule["alert"] for rule in rules}
    named = {name for rule in rules for name in METRIC_NAME.findall(rule["expr"])}
    daemons = [Served(dsn, tmp_path / "consumer.log", "consume", "q", "--target", f"sqlite:{tmp_path}/r.db"),
               Served(dsn, tmp_path / "ticker.log", "ticker"),
               Served(dsn, tmp_path / "maint.log", "maint")]
    try:
        exported = set().union(*(d.names() for d in daemons))
    finally:
        for d in daemons:
            d.stop()
    assert named and named <= exported, named - exported


def test_a_metrics_port_in_use_or_with_once_is_one_error_line(dsn, queue_q):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli(dsn, "ticker", "--metrics-port", str(port))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: cannot serve metrics on 127.0.0.1:{port}: Address already in use"]
    result = run_cli(dsn, "maint", "--once", "--metrics-port", "0")
    assert result.returncode == 1
    assert result.stderr.strip() == "error: --metrics-port serves a running daemon: leave out --once"


def test_consumer_exports_a_copy_in_progress_and_is_healthy_while_it_progresses(dsn, conn, source, tmp_path):
    rows = 300_000
    conn.execute("CREATE TABLE big (id int PRIMARY KEY, v text)")
    conn.execute("INSERT INTO big SELECT g, repeat('x', 40) FROM generate_series(1, %s) g", (rows,))
    conn.execute("ANALYZE big")
    source.create_queue("q")
    source.add_table("q", "big")
    served = Served(dsn, tmp_path / "consumer.log", "consume", "q", "--target", f"sqlite:{tmp_path}/r.db")
    try:
        copied = wait_until(lambda: served.value("replicator_copy_rows", table="public.big"), 60,
                            "a copy in progress", interval=0.01, check=served.check)
        assert 0 < copied < rows
        assert served.value("replicator_copy_estimated_rows", table="public.big") == rows
        status, report = served.health()
        assert (status, report["status"], report["table"]) == (200, "copying", "public.big")
        wait_until(lambda: served.value("replicator_copied_rows_total") == rows, 120, "the copy done",
                   check=served.check)
        assert served.value("replicator_copy_rows", table="public.big") is None   # no stalled copy left
    finally:
        served.stop()
