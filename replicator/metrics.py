"""Prometheus metrics and a health endpoint for the daemons (consume, ticker, maint).

Each daemon keeps its metrics in a registry of its own, with the standard process,
platform and garbage-collector collectors (memory, CPU, open files: what tells a
leak or a busy loop). `serve` exposes them over HTTP on a daemon thread: the
metrics at /metrics, and /health answering 200 while the daemon keeps up, else 503
with the reason, both as a short JSON object. docs/monitoring.md lists every metric.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    disable_created_metrics,
    make_wsgi_app,
)

from replicator.errors import UserError

log = logging.getLogger("replicator")

MIN_STALL_SECONDS = 60.0   # a daemon's loop may pause this long (a large batch, a view's refresh)

Health = tuple[bool, dict[str, Any]]


class DaemonMetrics:
    """What every daemon reports: errors by kind, and whether its loop runs and
    reaches the source (its health)."""

    def __init__(self, max_stall: float) -> None:
        self.registry = CollectorRegistry()
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            self.registry.register(collector)
        self.errors = Counter("replicator_errors", "Errors the daemon's loop met and retried, by kind",
                              ["kind"], registry=self.registry)
        for kind in ("source_unavailable", "target_unavailable"):
            self.errors.labels(kind)   # 0 until one: rate() sees the first
        self.max_stall = max(max_stall, MIN_STALL_SECONDS)
        self._started = time.monotonic()
        self._last_run: float | None = None   # None: not yet
        self._unavailable: tuple[str, str] | None = None   # (what, reason)

    def ran(self) -> None:
        """The loop made progress, with the source reachable."""
        self._last_run = time.monotonic()
        self._unavailable = None

    def source_unavailable(self, reason: str) -> None:
        self.errors.labels("source_unavailable").inc()
        self._unavailable = ("source unavailable", reason)

    def target_unavailable(self, reason: str) -> None:
        self.errors.labels("target_unavailable").inc()
        self._unavailable = ("target unavailable", reason)

    def health(self) -> Health:
        if self._unavailable is not None:
            return False, {"status": self._unavailable[0], "reason": self._unavailable[1]}
        now = time.monotonic()
        if self._last_run is None:
            return False, {"status": "starting", "reason": f"no pass of the loop completed yet, "
                                                           f"{now - self._started:.0f}s after the start"}
        idle = now - self._last_run
        if idle > self.max_stall:
            return False, {"status": "stalled", "reason": f"the loop has not made progress for {idle:.0f}s "
                                                          f"(limit {self.max_stall:.0f}s)"}
        return True, {"status": "ok"}


def _set_per_queue(gauge: Gauge, values: Mapping[str, float], shown: set[str]) -> None:
    """Sets a per-queue gauge to exactly these queues: a dropped queue's series goes away."""
    for queue in shown - values.keys():
        gauge.remove(queue)
    for queue, value in values.items():
        gauge.labels(queue).set(value)
    shown.clear()
    shown.update(values)


class ConsumerMetrics(DaemonMetrics):
    """A consumer's lag, what it applied and what it copies. Healthy while it
    reaches the source and either copies a table (making progress) or lags
    less than max_lag seconds."""

    def __init__(self, queue: str, consumer: str, max_lag: float) -> None:
        super().__init__(max_lag)
        self.max_lag = max_lag
        labels = ["queue", "consumer"]
        r = self.registry

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(queue, consumer)

        # Gauges without a value until the first reading of the lag: not a lag of 0 meanwhile.
        self._lag_gauges = [
            Gauge("replicator_consumer_lag_ticks", "Ticks of the queue the consumer has not applied", labels,
                  registry=r),
            Gauge("replicator_consumer_lag_events", "Events queued after the consumer's position", labels,
                  registry=r),
            Gauge("replicator_consumer_lag_seconds",
                  "Age of the consumer's position: seconds since the tick it applied last was taken", labels,
                  registry=r)]
        self._last_tick_age = Gauge("replicator_last_tick_age_seconds", "Seconds since the queue's latest tick",
                                    ["queue"], registry=r)
        self.batches = counter("replicator_batches", "Batches applied")
        self.events = counter("replicator_events_applied", "Events applied")
        self.rows = counter("replicator_rows_applied", "Row changes applied (an event holds 1 to 1000)")
        self.copied_rows = counter("replicator_copied_rows", "Rows copied by initial copies and copies again "
                                                             "(also by copies that failed, to be retried)")
        self._copy_rows = Gauge("replicator_copy_rows", "Rows copied so far of the table being copied",
                                [*labels, "table"], registry=r)
        self._copy_estimate = Gauge("replicator_copy_estimated_rows",
                                    "Row estimate of the table being copied (0: unknown)",
                                    [*labels, "table"], registry=r)
        self._labels = (queue, consumer)
        self._lag: float | None = None
        self._copying: dict[str, Any] | None = None

    def applied(self, events: int, rows: int) -> None:
        self.batches.inc()
        self.events.inc(events)
        self.rows.inc(rows)

    def lag(self, ticks: int, events: int, seconds: float, last_tick_age: float | None) -> None:
        for gauge, value in zip(self._lag_gauges, (ticks, events, seconds)):
            gauge.labels(*self._labels).set(value)
        if last_tick_age is not None:
            self._last_tick_age.labels(self._labels[0]).set(last_tick_age)
        self._lag = seconds

    def copy_progress(self, table: str, rows: int, estimated_rows: int) -> None:
        self.copied_rows.inc(rows - (self._copying["rows"] if self._copying else 0))
        self._copy_rows.labels(*self._labels, table).set(rows)
        self._copy_estimate.labels(*self._labels, table).set(estimated_rows)
        self._copying = {"table": table, "rows": rows}
        self.ran()

    def copy_ended(self, table: str) -> None:
        """The copy's series go away: a finished copy is not a stalled one."""
        self._copy_rows.remove(*self._labels, table)
        self._copy_estimate.remove(*self._labels, table)
        self._copying = None

    def health(self) -> Health:
        healthy, report = super().health()
        if not healthy:
            return healthy, report
        if self._copying is not None:
            return True, {"status": "copying", **self._copying}
        if self._lag is not None and self._lag > self.max_lag:
            return False, {"status": "lagging", "reason": f"lag {self._lag:.1f}s exceeds {self.max_lag:g}s",
                           "lag_seconds": self._lag}
        return True, {"status": "ok", "lag_seconds": self._lag}


class TickerMetrics(DaemonMetrics):
    """Ticks made, and each queue's latest tick's age (whichever ticker made it)."""

    def __init__(self, interval: float) -> None:
        super().__init__(3 * interval)
        self.ticks = Counter("replicator_ticks", "Ticks this ticker made", registry=self.registry)
        self._tick_age = Gauge("replicator_last_tick_age_seconds", "Seconds since the queue's latest tick",
                               ["queue"], registry=self.registry)
        self._queues: set[str] = set()

    def ticked(self, ticks: int, last_tick_ages: Mapping[str, float | None] | None) -> None:
        """A pass made `ticks` ticks; the queues' latest tick ages when they were read (None: not this pass)."""
        self.ticks.inc(ticks)
        if last_tick_ages is not None:
            _set_per_queue(self._tick_age, {q: a for q, a in last_tick_ages.items() if a is not None},
                           self._queues)
        self.ran()


class MaintMetrics(DaemonMetrics):
    """Rotations done, and how long past its rotation period each queue is."""

    def __init__(self, interval: float) -> None:
        super().__init__(3 * interval)
        self.rotations = Counter("replicator_rotations", "Event table rotations this maint started",
                                 ["queue"], registry=self.registry)
        self._overdue = Gauge("replicator_rotation_overdue_seconds",
                              "Seconds the queue's rotation is past due (0: not due)", ["queue"],
                              registry=self.registry)
        self._queues: set[str] = set()

    def maintained(self, rotated: Iterable[str], overdue: Mapping[str, float]) -> None:
        for queue in rotated:
            self.rotations.labels(queue).inc()
        _set_per_queue(self._overdue, overdue, self._queues)
        self.ran()


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:   # a line per scrape is noise
        pass


def _app(metrics: DaemonMetrics) -> Callable[..., Any]:
    exposition = make_wsgi_app(metrics.registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if environ.get("PATH_INFO") == "/health":
            healthy, report = metrics.health()
            start_response("200 OK" if healthy else "503 Service Unavailable",
                           [("Content-Type", "application/json")])
            return [json.dumps(report).encode()]
        return exposition(environ, start_response)

    return app


def serve(metrics: DaemonMetrics, address: str, port: int) -> int:
    """Serves /metrics and /health on a daemon thread; returns the port (port 0:
    one the system chose, also logged)."""
    disable_created_metrics()   # a _created series beside each counter: noise for an operator
    server_class = _Server6 if ":" in address else _Server
    try:
        server = make_server(address, port, _app(metrics), server_class, _QuietHandler)
    except OSError as exc:
        raise UserError(f"cannot serve metrics on {address}:{port}: {exc.strerror or exc}") from None
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    shown = f"[{address}]" if ":" in address else address
    log.info("metrics on http://%s:%s/metrics, health on /health", shown, server.server_port)
    return server.server_port
