"""The metrics endpoint as a server, against the real console scripts: it answers GET
and HEAD of /metrics and /health only, listens only where --metrics-address says
plainly, and cannot be starved: while a thousand connections hold half-sent
requests or trickle them a byte a second, /health answers, the consumer keeps
applying, and the daemon's open files stay bounded."""

from __future__ import annotations

import http.client
import multiprocessing
import os
import re
import resource
import socket
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from email.message import Message
from pathlib import Path

import pytest

from consumer_helpers import Daemon, forced_tick, run_cli, sqlite_reader, wait_until
from replicator.metrics import CLIENT_TIMEOUT, MAX_CONNECTIONS
from test_metrics import Served

ATTACKERS = 1200            # connections an attacker keeps open (the finding's daemon failed at ~1000)
DAEMON_OPEN_FILES = 1024    # the daemon's RLIMIT_NOFILE: the usual default, the finding's
HEALTH_WITHIN = 5.0         # seconds /health may take to answer under attack
PARTIAL_HEAD = b"GET /health HTTP/1.1\r\nHost: attacker\r\nUser-Agent: slow\r\n"   # never the blank line


@contextmanager
def open_files_limit(soft: int) -> Iterator[None]:
    """This process's RLIMIT_NOFILE soft limit set to `soft` meanwhile (a child started then inherits it)."""
    old, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (old, hard))


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def request(port: int, method: str, path: str, timeout: float = 10,
            host: str = "127.0.0.1") -> tuple[int, Message, bytes]:
    """The response's status, header fields and body (HEAD: none)."""
    client = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        client.request(method, path)
        response = client.getresponse()
        return response.status, response.headers, response.read()
    finally:
        client.close()


def timed_health(port: int) -> tuple[int | str, float]:
    """/health's status (or why none came within HEALTH_WITHIN) and the seconds it took."""
    started = time.monotonic()
    try:
        status: int | str = request(port, "GET", "/health", timeout=HEALTH_WITHIN)[0]
    except OSError as exc:
        status = f"no answer: {exc!r}"
    return status, time.monotonic() - started


def replica_rows(replica: Path) -> int:
    db = sqlite_reader(replica)
    try:
        return db.execute("SELECT count(*) FROM t").fetchone()[0]
    except sqlite3.OperationalError:   # no table t yet
        return 0
    finally:
        db.close()


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:   # reset
        return True


class Attack:
    """Keeps up to `count` connections open to a port from a process of its own (as an
    attacker would: not slowed down by this one's probes), each sending the start of a
    request head and then nothing (held), or a byte a second (trickled, slowloris-style).
    Every second it opens connections again in place of those the server closed
    (counted), until three in a row do not connect within a second each."""

    def __init__(self, port: int, count: int, *, trickle: bool) -> None:
        processes = multiprocessing.get_context("fork")
        self._rounds = processes.Value("i", 0)
        self._dropped = processes.Value("i", 0)
        self._stop = processes.Event()
        self._process = processes.Process(target=self._run, args=(port, count, trickle), name="attack", daemon=True)
        self._process.start()

    @property
    def rounds(self) -> int:
        return self._rounds.value

    @property
    def dropped(self) -> int:
        return self._dropped.value

    def _run(self, port: int, count: int, trickle: bool) -> None:
        connections: list[list] = []   # [socket, bytes of the head sent]
        while True:
            still_open = []
            for connection in connections:
                if closed_by_peer(connection[0]):
                    connection[0].close()
                    self._dropped.value += 1
                else:
                    still_open.append(connection)
            connections = still_open
            failures = 0
            while len(connections) < count and failures < 3:
                try:
                    sock = socket.create_connection(("127.0.0.1", port), timeout=1)
                except OSError:   # its backlog full: the server takes no more now, or is slow to
                    failures += 1
                    continue
                failures = 0
                sock.setblocking(False)
                connections.append([sock, 0])
            for connection in connections:
                sock, sent = connection
                more = PARTIAL_HEAD[sent:sent + 1] if trickle else PARTIAL_HEAD[sent:]
                with suppress(OSError):   # closed meanwhile: seen in the next round
                    connection[1] += sock.send(more) if more else 0
            self._rounds.value += 1
            if self._stop.wait(1.0):   # the pace of the attack: a byte a second
                return

    def stop(self) -> None:
        self._stop.set()
        self._process.join(30)
        if self._process.is_alive():
            self._process.kill()


@pytest.mark.parametrize("trickle", [False, True], ids=["half-sent requests held", "a byte a second"])
def test_health_answers_and_the_consumer_keeps_applying_while_a_thousand_connections_hold_the_metrics_port(
        dsn, conn, queue_q, tmp_path, trickle):
    replica = tmp_path / "r.db"
    with open_files_limit(DAEMON_OPEN_FILES):
        served = Served(dsn, tmp_path / "consumer.log", "consume", "q", "--target", f"sqlite:{replica}",
                        "--poll-interval", "0.05")
    port = int(served.url.rpartition(":")[2])
    attack = None
    try:
        rows = 10
        wait_until(lambda: replica_rows(replica) == rows, 60, "the copy", check=served.check)
        wait_until(lambda: served.health()[0] == 200, 60, "healthy", check=served.check)
        bound = open_files(served.daemon.pid) + MAX_CONNECTIONS + 16
        with open_files_limit(max(resource.getrlimit(resource.RLIMIT_NOFILE)[0], ATTACKERS + 256)):
            attack = Attack(port, ATTACKERS, trickle=trickle)
            wait_until(lambda: attack.rounds or open_files(served.daemon.pid) >= bound, 120,
                       "the attack's connections opened (or the daemon's open files past the bound)")
            attacked_until = time.monotonic() + 3 * CLIENT_TIMEOUT   # past the timeout of the first connections
            while time.monotonic() < attacked_until:
                status, seconds = timed_health(port)
                assert status == 200, f"/health under attack: {status} after {seconds:.1f}s"
                rows += 1
                conn.execute("INSERT INTO t VALUES (%s, 'under attack')", (1000 + rows,))
                forced_tick(conn)
                wait_until(lambda: replica_rows(replica) == rows, 30, "the replica keeping up under attack",
                           check=served.check)
                files = open_files(served.daemon.pid)
                assert files < bound, f"the daemon holds {files} open files under attack (bound {bound})"
            assert attack.dropped >= ATTACKERS   # the server closes what it holds, not only the newest
    finally:
        if attack is not None:
            attack.stop()
        served.stop()


def test_a_connection_that_sends_no_whole_request_head_is_closed_after_the_timeout(dsn, tmp_path):
    served = Served(dsn, tmp_path / "ticker.log", "ticker")
    port = int(served.url.rpartition(":")[2])
    try:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(PARTIAL_HEAD)
            sock.setblocking(False)
            started = time.monotonic()
            wait_until(lambda: closed_by_peer(sock), CLIENT_TIMEOUT + 10, "the connection closed by the daemon",
                       check=served.check)
            assert time.monotonic() - started >= CLIENT_TIMEOUT - 1
    finally:
        served.stop()


def test_only_metrics_and_health_are_served_at_their_exact_paths(dsn, tmp_path):
    served = Served(dsn, tmp_path / "ticker.log", "ticker", "--interval", "0.05")
    port = int(served.url.rpartition(":")[2])
    try:
        wait_until(lambda: served.health()[0] == 200, 60, "healthy", check=served.check)
        for path in ("/", "/HEALTH", "/health/", "/Metrics", "/metrics/", "/metrics/x", "/favicon.ico", "//health",
                     "http://127.0.0.1/health"):
            status, _, body = request(port, "GET", path)
            assert (status, body) == (404, b"not found: this endpoint serves /metrics and /health\n"), path
        status, headers, body = request(port, "GET", "/metrics?probe=1")   # a query string is ignored
        assert status == 200 and b"replicator_ticks_total" in body
        assert headers["Content-Type"].startswith("text/plain")
        assert request(port, "GET", "/health?probe=1")[::2] == (200, b'{"status": "ok"}')
    finally:
        served.stop()


def test_methods_other_than_get_and_head_are_405_and_head_answers_the_headers_only(dsn, tmp_path):
    served = Served(dsn, tmp_path / "ticker.log", "ticker", "--interval", "0.05")
    port = int(served.url.rpartition(":")[2])
    try:
        wait_until(lambda: served.health()[0] == 200, 60, "healthy", check=served.check)
        for method in ("POST", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "get"):
            for path in ("/metrics", "/health"):
                status, headers, _ = request(port, method, path)
                assert (status, headers["Allow"]) == (405, "GET, HEAD"), (method, path)
        _, get_headers, get_body = request(port, "GET", "/health")
        status, headers, body = request(port, "HEAD", "/health")
        assert (status, body) == (200, b"")
        assert headers["Content-Length"] == get_headers["Content-Length"] == str(len(get_body))
        assert headers["Content-Type"] == get_headers["Content-Type"] == "application/json"
        status, headers, body = request(port, "HEAD", "/metrics")
        assert (status, body) == (200, b"") and int(headers["Content-Length"]) > 1000
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"not http\r\n\r\n")
            assert sock.recv(100).startswith(b"HTTP/1.1 400 Bad Request\r\n")
    finally:
        served.stop()


@pytest.mark.parametrize("address", ["", "0", "127.1", "0x7f000001", "::0", "0:0:0:0:0:0:0:0", "::ffff:0.0.0.0",
                                     "localhost:9700", "no-such-host.invalid"])
def test_a_metrics_address_neither_an_ip_address_in_full_nor_a_host_name_that_resolves_is_one_error_line(
        dsn, address):
    result = run_cli(dsn, "ticker", "--metrics-port", "0", "--metrics-address", address, timeout=30)
    assert result.returncode == 1, result.stderr
    line, = result.stderr.strip().splitlines()
    assert line.startswith("error: --metrics-address ") and (
        "neither an IP address written in full nor a host name" in line or "every interface: write 0.0.0.0 or ::"
        in line or "does not resolve" in line), line


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::"])
def test_every_interface_is_served_when_asked_for_by_its_wildcard_with_a_warning(dsn, tmp_path, wildcard):
    log = tmp_path / "ticker.log"
    daemon = Daemon(dsn, "ticker", "--metrics-port", "0", "--metrics-address", wildcard, log=log)
    try:
        found = wait_until(lambda: re.search(r"metrics on http://\S+:(\d+)/metrics", daemon.log()), 60,
                           "the metrics port in the log", check=lambda: daemon.alive() or pytest.fail(daemon.log()))
        assert (f"WARNING --metrics-address {wildcard} listens on every interface: /metrics and /health are open "
                f"to the network") in daemon.log()
        assert request(int(found.group(1)), "GET", "/metrics")[0] == 200   # 127.0.0.1 among every interface
    finally:
        daemon.stop()


def test_a_host_name_that_resolves_is_served_on_its_address(dsn, tmp_path):
    served_log = tmp_path / "ticker.log"
    daemon = Daemon(dsn, "ticker", "--metrics-port", "0", "--metrics-address", "localhost", log=served_log)
    try:
        found = wait_until(lambda: re.search(r"metrics on http://(\S+):(\d+)/metrics", daemon.log()), 60,
                           "the metrics port in the log", check=lambda: daemon.alive() or pytest.fail(daemon.log()))
        assert found.group(1) in ("127.0.0.1", "[::1]")
        assert "WARNING" not in daemon.log()
        assert request(int(found.group(2)), "GET", "/metrics", host=found.group(1).strip("[]"))[0] == 200
    finally:
        daemon.stop()
