"""Prometheus metrics and a health endpoint for the daemons (consume, ticker, maint).

Each daemon keeps its metrics in a registry of its own, with the standard process,
platform and garbage-collector collectors (memory, CPU, open files: what tells a
leak or a busy loop). `serve` exposes them over HTTP on a daemon thread: the
metrics at /metrics, and /health answering 200 while the daemon keeps up, else 503
with the reason as a short JSON object. docs/monitoring.md lists every metric.

The HTTP server is one of its own, on one thread with a bounded number of
connections and a deadline for each: http.server and wsgiref (which
prometheus_client's own server uses) give every connection a thread that waits
on it without end, so that a thousand half-sent requests exhaust the daemon's
file descriptors and its source connection with them.
"""

from __future__ import annotations

import gzip
import ipaddress
import json
import logging
import re
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from http import HTTPStatus
from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    disable_created_metrics,
)
from prometheus_client.exposition import choose_encoder, gzip_accepted

from replicator.errors import UserError, first_line

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


# the endpoint ------------------------------------------------------------------

MAX_CONNECTIONS = 64    # scrapers and probes come a few at a time
CLIENT_TIMEOUT = 5.0    # seconds a client has to send its request head, then again to take the response
MAX_HEAD = 8192         # bytes of a request head
WILDCARDS = ("0.0.0.0", "::")
_ACCEPTS_PER_PASS = 8   # fewer than MAX_CONNECTIONS: a flood cannot close a connection before its request is read
_BACKLOG = 1024         # connections the kernel holds until accepted: a burst waits there rather than being refused
_HEAD_END = re.compile(rb"\r?\n\r?\n")
_LINE_END = re.compile(r"\r?\n")
_VERSION = re.compile(r"HTTP/1\.[01]")
_HOST_NAME = re.compile(r"(?!-)[\w-]{1,63}(?<!-)(\.(?!-)[\w-]{1,63}(?<!-))*\.?", re.ASCII)   # _: a container's name

Answer = tuple[int, list[tuple[str, str]], bytes]   # status, header fields, body
Route = Callable[[Mapping[str, str]], Answer]       # from the request's header fields (names in lower case)


def _message(status: int, fields: Iterable[tuple[str, str]], body: bytes, head_only: bool = False) -> bytes:
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", *(f"{name}: {value}" for name, value in fields),
             f"Content-Length: {len(body)}", "Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1") + (b"" if head_only else body)


def _text(status: int, text: str, *fields: tuple[str, str]) -> Answer:
    return status, [("Content-Type", "text/plain; charset=utf-8"), *fields], f"{text}\n".encode()


def _respond(routes: Mapping[str, Route], head: bytes) -> bytes:
    """The whole response to a request head."""
    request_line, *field_lines = _LINE_END.split(head.decode("latin-1"))
    parts = request_line.split(" ")
    if len(parts) != 3 or not _VERSION.fullmatch(parts[2]):
        return _message(*_text(400, "bad request: an HTTP/1.x request line expected"))
    method, target, _ = parts
    fields = {name.strip().lower(): value.strip()
              for name, colon, value in (line.partition(":") for line in field_lines) if colon}
    path = target.partition("?")[0]   # a query string is ignored
    return _message(*_route(routes, method, path, fields), head_only=method == "HEAD")


def _route(routes: Mapping[str, Route], method: str, path: str, fields: Mapping[str, str]) -> Answer:
    """GET and HEAD of the routes' exact paths, nothing else."""
    route = routes.get(path)
    if route is None:
        return _text(404, f"not found: this endpoint serves {' and '.join(routes)}")
    if method not in ("GET", "HEAD"):
        return _text(405, f"method not allowed: {path} answers GET and HEAD", ("Allow", "GET, HEAD"))
    try:
        return route(fields)
    except Exception as exc:   # the endpoint's thread must go on: a bug shows to the scraper, not as its death
        log.debug("%s %s failed", method, path, exc_info=True)
        return _text(500, f"{path} failed: {first_line(exc)}")


class _Client:
    """One connection: its request head as it arrives, then the response as it leaves,
    then what the client still sends until it closes (discarded: closing with it
    unread would reset the connection before the client reads the response)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.deadline = time.monotonic() + CLIENT_TIMEOUT
        self.head = bytearray()
        self.response: memoryview | None = None   # None: the head is not complete yet
        self.answered = False


class _Endpoint:
    """An HTTP/1.1 server of a few small responses on one thread, which no client can
    starve nor make hold more than MAX_CONNECTIONS descriptors: a connection that
    does not send its request head within CLIENT_TIMEOUT, or take the response within
    as much again, is closed, and a connection beyond MAX_CONNECTIONS closes the
    oldest one: a new one never waits behind a flood, and is read before
    MAX_CONNECTIONS more come (its request is there: a client sends it at once, and
    on Linux the kernel hands a connection over with its first bytes). Each
    connection carries one request: answered with Connection: close."""

    def __init__(self, listener: socket.socket, routes: Mapping[str, Route]) -> None:
        self._listener = listener
        self._routes = routes
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ)
        self._clients: dict[socket.socket, _Client] = {}   # oldest first

    def run(self) -> None:
        while True:
            ready = self._selector.select(self._wait())
            for key, _ in ready:
                if key.data is not None:
                    self._serve(key.data)
            if any(key.fileobj is self._listener for key, _ in ready):
                self._accept()   # after the clients served: a client closed for room was not among them
            self._expire()

    def _wait(self) -> float | None:
        deadline = min((client.deadline for client in self._clients.values()), default=None)
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_PASS):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, ConnectionAbortedError):
                return
            except OSError:   # out of descriptors (EMFILE): ours go first, else the daemon needs them
                if self._clients:
                    self._close(next(iter(self._clients.values())))
                else:
                    time.sleep(0.1)   # the connection waits in the backlog; no busy loop meanwhile
                return
            if len(self._clients) >= MAX_CONNECTIONS:
                self._close(next(iter(self._clients.values())))
            sock.setblocking(False)
            client = _Client(sock)
            self._clients[sock] = client
            self._selector.register(sock, selectors.EVENT_READ, client)

    def _serve(self, client: _Client) -> None:
        try:
            if client.response is None:
                self._read(client)
            elif client.answered:
                if not client.sock.recv(4096):
                    self._close(client)
            else:
                self._write(client)
        except BlockingIOError:
            pass
        except OSError:
            self._close(client)

    def _read(self, client: _Client) -> None:
        data = client.sock.recv(4096)
        if not data:
            self._close(client)
            return
        client.head += data
        head = bytes(client.head).lstrip(b"\r\n")
        end = _HEAD_END.search(head)
        if end is not None:
            response = _respond(self._routes, head[:end.start()])
        elif len(head) > MAX_HEAD:
            response = _message(*_text(431, f"request head over {MAX_HEAD} bytes"))
        else:
            return
        client.response = memoryview(response)
        client.deadline = time.monotonic() + CLIENT_TIMEOUT
        self._selector.modify(client.sock, selectors.EVENT_WRITE, client)
        self._write(client)

    def _write(self, client: _Client) -> None:
        assert client.response is not None
        client.response = client.response[client.sock.send(client.response):]
        if not client.response:
            client.sock.shutdown(socket.SHUT_WR)
            client.answered = True
            self._selector.modify(client.sock, selectors.EVENT_READ, client)

    def _expire(self) -> None:
        now = time.monotonic()
        for client in [c for c in self._clients.values() if c.deadline <= now]:
            self._close(client)

    def _close(self, client: _Client) -> None:
        self._selector.unregister(client.sock)
        del self._clients[client.sock]
        client.sock.close()


def _routes(metrics: DaemonMetrics) -> dict[str, Route]:
    def exposition(fields: Mapping[str, str]) -> Answer:
        encoder, content_type = choose_encoder(fields.get("accept", ""))
        body = encoder(metrics.registry)
        if gzip_accepted(fields.get("accept-encoding", "")):
            return 200, [("Content-Type", content_type), ("Content-Encoding", "gzip")], gzip.compress(body)
        return 200, [("Content-Type", content_type)], body

    def health(fields: Mapping[str, str]) -> Answer:
        healthy, report = metrics.health()
        return 200 if healthy else 503, [("Content-Type", "application/json")], json.dumps(report).encode()

    return {"/metrics": exposition, "/health": health}


def _bind_address(address: str, port: int) -> tuple[socket.AddressFamily, tuple[Any, ...]]:
    """The family and socket address that --metrics-address names: an IP address written
    in full, or a host name that resolves; every interface only as 0.0.0.0 or ::."""
    try:
        literal: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(address)
    except ValueError:
        literal = None
    if literal is None and (not _HOST_NAME.fullmatch(address) or _numeric(address)):
        raise UserError(f"--metrics-address {address!r} is neither an IP address written in full nor a host name "
                        f"(127.0.0.1 by default; 0.0.0.0 or :: for every interface)")
    if literal is not None and _wildcard(literal) and address not in WILDCARDS:
        raise UserError(f"--metrics-address {address} means every interface: write 0.0.0.0 or :: to ask for that")
    try:
        found = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_NUMERICHOST if literal else 0)
    except socket.gaierror as exc:
        raise UserError(f"--metrics-address {address} does not resolve: {exc.strerror}") from None
    if literal is None and any(_wildcard(ipaddress.ip_address(info[4][0])) for info in found):
        raise UserError(f"--metrics-address {address} resolves to every interface: write 0.0.0.0 or :: to ask "
                        f"for that")
    family, _, _, _, sockaddr = found[0]
    return family, sockaddr


def _numeric(address: str) -> bool:
    """Whether the system reads it as an IP address, such as 0 or 127.1 (shorthands of inet_aton)."""
    try:
        socket.getaddrinfo(address, None, flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        return False
    return True


def _wildcard(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return ip.is_unspecified or (mapped is not None and mapped.is_unspecified)


def serve(metrics: DaemonMetrics, address: str, port: int) -> int:
    """Serves /metrics and /health on a daemon thread; returns the port (port 0:
    one the system chose, also logged)."""
    disable_created_metrics()   # a _created series beside each counter: noise for an operator
    family, sockaddr = _bind_address(address, port)
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # a restart finds its port free
        if hasattr(socket, "TCP_DEFER_ACCEPT"):   # Linux: a connection is accepted with its request's first bytes,
            # so that a flood cannot close it before they are read (nor one that sends nothing take a descriptor)
            listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, int(CLIENT_TIMEOUT))
        listener.bind(sockaddr)
        listener.listen(_BACKLOG)
    except OSError as exc:
        listener.close()
        raise UserError(f"cannot serve metrics on {address}:{port}: {exc.strerror or exc}") from None
    listener.setblocking(False)
    if address in WILDCARDS:
        log.warning("--metrics-address %s listens on every interface: /metrics and /health are open to the network",
                    address)
    threading.Thread(target=_Endpoint(listener, _routes(metrics)).run, name="metrics", daemon=True).start()
    host, bound_port = listener.getsockname()[:2]
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    log.info("metrics on http://%s:%s/metrics, health on /health", shown, bound_port)
    return int(bound_port)
