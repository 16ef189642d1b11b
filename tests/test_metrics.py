"""The daemons' Prometheus metrics and health endpoint, scraped over HTTP from the
real console scripts: counters move with a workload, the health turns 503 when the
source is unreachable or the lag passes --health-max-lag, and the sample alert
rules of docs/alerts.yml and the Grafana dashboard of docs/grafana-dashboard.json
query only metrics and labels the daemons export."""

from __future__ import annotations

import json
import re
import socket
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Iterable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import promql_parser
import psycopg
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from consumer_helpers import Daemon, forced_tick, run_cli, sqlite_reader, wait_until
from replicator.metrics import ConsumerMetrics, MaintMetrics, TickerMetrics
from replicator.source import monitoring

DOCS = Path(__file__).parent.parent / "docs"
ALERTS = DOCS / "alerts.yml"
DASHBOARD = DOCS / "grafana-dashboard.json"
SCRAPE_SERIES = {"up"}                # a series Prometheus makes of each scrape
SCRAPE_LABELS = {"job", "instance"}   # labels Prometheus puts on every series it scrapes
GRAFANA_VARIABLE = re.compile(r"\$(?:\{(\w+)[^}]*\}|(\w+))")
GRAFANA_RANGES = {"__rate_interval": "1m", "__interval": "1m", "__range": "1h"}
LABEL_VALUES = re.compile(r"label_values\((.+),\s*(\w+)\)")


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


# queries of the metrics: docs/alerts.yml, docs/grafana-dashboard.json -------------------

def _exported_names(dsn: str, tmp_path: Path) -> set[str]:
    """The name of every metric the three daemons export, scraped from the real console scripts."""
    daemons = [Served(dsn, tmp_path / "consumer.log", "consume", "q", "--target", f"sqlite:{tmp_path}/r.db"),
               Served(dsn, tmp_path / "ticker.log", "ticker"),
               Served(dsn, tmp_path / "maint.log", "maint")]
    try:
        return set().union(*(d.names() for d in daemons))
    finally:
        for d in daemons:
            d.stop()


def _exported_labels() -> dict[str, set[str]]:
    """The label names of each sample the daemons' metrics can carry, from the exposition of their
    registries with every series set: a daemon scraped at rest lacks some (a copy's exist only while
    it copies, a queue's rotation counter once the queue rotated; a counter or a gauge without a
    series exports no label name)."""
    consumer = ConsumerMetrics("q", "c", 60)
    consumer.applied(1, 1)
    consumer.lag(1, 1, 1.0, 1.0)
    consumer.copy_progress("public.t", 1, 2)
    ticker = TickerMetrics(1)
    ticker.ticked(1, {"q": 1.0})
    maint = MaintMetrics(1)
    maint.maintained(["q"], {"q": 0.0})
    labels: dict[str, set[str]] = defaultdict(set)
    for metrics in (consumer, ticker, maint):
        for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
            for sample in family.samples:
                labels[sample.name] |= sample.labels.keys()
    return labels


def _parsed(query: str) -> Any:
    """A query parsed by a PromQL parser (unknown functions, argument types, syntax: an error), with
    Grafana's variables given values of their kind: ranges a duration, the others a regular expression."""
    return promql_parser.parse(GRAFANA_VARIABLE.sub(lambda m: GRAFANA_RANGES.get(m[1] or m[2], ".*"), query))


def _selectors(expr: Any) -> list[Any]:
    found: list[Any] = []
    promql_parser.walk(expr, lambda node: found.append(node) if isinstance(node, promql_parser.VectorSelector)
                       else None)
    return found


def _label_uses(expr: Any) -> list[tuple[str, str]]:
    """(metric, label) for each label the query reads: in a selector's matchers, and in the by
    or without of an aggregation, or the on, ignoring or group_left of a binary operation, for
    every metric selected under it."""
    uses: list[tuple[str, str]] = []

    def visit(node: Any) -> None:
        labels: list[str] = []
        under: list[Any] = []
        if isinstance(node, promql_parser.VectorSelector):
            matchers = [*node.matchers.matchers, *(m for group in node.matchers.or_matchers for m in group)]
            uses.extend((node.name, m.name) for m in matchers)
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            labels, under = node.modifier.labels, [node.expr]
        elif isinstance(node, promql_parser.BinaryExpr) and node.modifier is not None:
            matching = node.modifier.matching
            labels = [*(matching.labels if matching else []), *(node.modifier.group_labels or [])]
            under = [node.lhs, node.rhs]
        uses.extend((s.name, label) for side in under for s in _selectors(side) for label in labels)

    promql_parser.walk(expr, visit)
    return uses


def _query_problems(queries: Iterable[str], exported: set[str]) -> list[str]:
    """What is wrong with these queries: one that does not parse, a metric the daemons do not
    export, a label that metric does not carry."""
    labels = _exported_labels()
    problems = []
    for query in queries:
        try:
            expr = _parsed(query)
        except ValueError as exc:
            problems.append(f"{query}: {exc}")
            continue
        problems += [f"{query}: {s.name} is not exported" for s in _selectors(expr)
                     if s.name not in exported | SCRAPE_SERIES]
        problems += [f"{query}: {metric} has no label {label}" for metric, label in _label_uses(expr)
                     if label not in SCRAPE_LABELS and label not in labels.get(metric, set())]
    return problems


def _dashboard_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, also those a collapsed row holds."""
    for panel in panels:
        yield panel
        yield from _dashboard_panels(panel.get("panels", []))


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


def test_sample_alert_rules_parse_and_query_only_metrics_and_labels_the_daemons_export(dsn, queue_q, tmp_path):
    rules = [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]
    assert {"ReplicatorConsumerLagging", "ReplicatorConsumerDown", "ReplicatorNoTicks",
            "ReplicatorRotationOverdue", "ReplicatorCopyStalled"} <= {rule["alert"] for rule in rules}
    assert _query_problems([rule["expr"] for rule in rules], _exported_names(dsn, tmp_path)) == []


def test_grafana_dashboard_queries_only_metrics_and_labels_the_daemons_export_and_charts_each(
        dsn, queue_q, tmp_path):
    dashboard = json.loads(DASHBOARD.read_text())
    source = "${DS_PROMETHEUS}"   # an input: the importer chooses the Prometheus
    assert [i["pluginId"] for i in dashboard["__inputs"] if f"${{{i['name']}}}" == source] == ["prometheus"]
    every = list(_dashboard_panels(dashboard["panels"]))
    assert len({p["id"] for p in every}) == len(every)   # Grafana tells panels apart by id
    panels = [p for p in every if p["type"] != "row"]
    assert panels and all(p["targets"] and p["datasource"]["uid"] == source for p in panels)
    targets = [t for p in panels for t in p["targets"]]
    assert all(t["expr"] and t["datasource"]["uid"] == source for t in targets)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"queue", "consumer"} <= variables.keys()
    assert all(v["datasource"]["uid"] == source for v in variables.values())
    # label_values(selector, label) lists the label's values among the selector's series
    found = [LABEL_VALUES.fullmatch(v["definition"]) for v in variables.values()]
    assert all(found), [v["definition"] for v in variables.values()]
    queries = [t["expr"] for t in targets] + [f"count by ({m[2]}) ({m[1]})" for m in found if m]
    assert _query_problems(queries, exported := _exported_names(dsn, tmp_path)) == []
    charted = {s.name for query in queries for s in _selectors(_parsed(query))}
    families = {"lag": {"replicator_consumer_lag_seconds", "replicator_consumer_lag_ticks",
                        "replicator_consumer_lag_events"},
                "throughput": {"replicator_rows_applied_total", "replicator_events_applied_total",
                               "replicator_batches_total"},
                "errors": {"replicator_errors_total"},
                "ticks": {"replicator_ticks_total", "replicator_last_tick_age_seconds"},
                "rotation": {"replicator_rotation_overdue_seconds", "replicator_rotations_total"},
                "copy progress": {"replicator_copy_rows", "replicator_copy_estimated_rows",
                                  "replicator_copied_rows_total"},
                "health": {"up"},
                "process": {"process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds"}}
    assert {family: names - charted for family, names in families.items() if names - charted} == {}
    assert {name for name in exported if name.startswith("replicator_")} - charted == set()


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
