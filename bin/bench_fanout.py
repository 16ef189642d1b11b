"""The fan-out benchmark (issue 19): SQLite replicas fed through Kafka against as many direct
consumers of the queue, the same workload, in one run. Run it through ``bin/bench-fanout``.

One throwaway PostgreSQL (with pg_stat_statements) and one Kafka broker; ``replicator ticker`` runs
throughout. A writer process commits small transactions at a steady rate (--rate row changes/s):
each inserts one row, whose id is a marker, and updates UPDATES random rows. Four phases, each of
--seconds of writes:

    direct, N   N (--followers) daemons ``replicator consume QUEUE --target sqlite:...``
    direct, 1   the same with all but one stopped and unregistered
    Kafka, N    one publisher (``consume QUEUE --target kafka://...``) and N followers
                (``consume --source kafka://... --target sqlite:...``)
    Kafka, 1    the same with all followers but one stopped

The phase with N replicas comes first in each mode, so that its replicas start from a small table (a new
follower reads the topics' whole history). Per phase, over the writes' window:

    source CPU  utime + stime of the cluster's processes (/proc: the postmaster, the children it
                reaped, the children alive), per second; also without the writer's own backend
    queries     top-level statements counted by pg_stat_statements, the writer's role left out
    connections the source's client connections at the end, the writer's and the benchmark's left out
    lag         from a transaction's commit (the source's clock after its COMMIT) to the first read
                that finds its marker in a replica: every replica's max(id) is read, read-only, every
                POLL_INTERVAL; one sample per marker and replica
    clients     CPU of the replicator processes (ticker included), of the broker's JVM, and of the
                whole machine (/proc/stat), with the load average

The machine has fewer cores than 50 replicas can use. PostgreSQL and the Kafka broker stand for
servers of their own, the writer for the application: they go first for the CPU (benchmark_first,
source_first), so that every phase gets the same writes. Each replicator process runs in a session
of its own, as on a machine of its own (the kernel shares the CPU between sessions first, where
autogroups are on); they share what is left with the machine's other jobs.

Every replica is checked against the source after each phase. Then throughput: with the daemons
stopped, --burst-rows row changes are queued (the same transactions, by a procedure); the time of
``consume --until-caught-up`` of the publisher, of one follower and, for comparison, of one direct
consumer, less the time of a second run with nothing to do (start-up), gives row changes/s, by the
wall clock and per CPU second of the process.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import platform
import resource
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NoReturn

import psycopg
from psycopg.conninfo import make_conninfo
from rich.console import Console
from rich.table import Table

import replicator
from kafkaserver import KafkaServer
from pgserver import PgServer
from replicator.source import Source, parse_duration
from replicator.source.install import install
from replicator.targets.kafka.settings import parse_url
from replicator.targets.kafka.state import PublisherState
from replicator.targets.kafka.topics import state_topic

console = Console()
if not console.is_terminal:
    console.width = 120
REPLICATOR = str(Path(sys.executable).with_name("replicator"))
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

QUEUE = "fanout"
PREFIX = "fanout"              # the Kafka topics' prefix
TABLE = "fanout_item"
WRITER_ROLE = "bench_writer"   # the writer's statements are told apart from replication's by their role
INITIAL_ROWS = 10_000          # rows before the capture starts: the updates' first targets, each replica's copy
UPDATES = 3                    # updates per writer transaction, after its insert
CHANGES_PER_TRANSACTION = 1 + UPDATES
POLL_INTERVAL = 0.05           # seconds between reads of a replica's last marker: the lag's resolution
READY_TIMEOUT = 600.0          # for new replicas to copy or bootstrap the table
DRAIN_TIMEOUT = 300.0          # after the writes, for every replica to reach the last marker
STOP_TIMEOUT = 30.0            # for a daemon to finish its batch after SIGTERM
AHEAD_NICE = -10               # the nice of the servers' sessions and of the writer (source_first)
# The source's cost counts as flat in the followers where going from 1 to N of them adds at most this share of what
# going from 1 to N direct consumers adds (two runs of one phase differ by up to a quarter in queries/s here)
FLAT = 0.1
PUBLISHER_GOAL = 100_000       # row changes/s

SCHEMA = f"""
CREATE TABLE {TABLE} (
    id          bigint PRIMARY KEY,
    n           integer NOT NULL DEFAULT 0,
    payload     text NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
INSERT INTO {TABLE} (id, payload) SELECT g, md5(g::text) FROM generate_series(1, {INITIAL_ROWS}) g;

-- p_count writer transactions from marker p_first on, each committed: a new row (its id is the
-- marker), then p_updates updates of random rows among those before it. Returns each one's commit
-- time (after its COMMIT, seconds since the epoch).
CREATE PROCEDURE fanout_write(p_first bigint, p_count integer, p_updates integer,
                              INOUT p_commits double precision[] DEFAULT NULL)
LANGUAGE plpgsql AS $$
DECLARE
    v_id bigint;
BEGIN
    p_commits := '{{}}';
    FOR i IN p_first..p_first + p_count - 1 LOOP
        INSERT INTO {TABLE} (id, payload) VALUES (i, md5(i::text));
        FOR k IN 1..p_updates LOOP
            v_id := 1 + floor(random() * i)::bigint;   -- a variable: random() in WHERE would scan the table
            UPDATE {TABLE} SET n = n + 1, updated_at = clock_timestamp() WHERE id = v_id;
        END LOOP;
        COMMIT;
        p_commits := p_commits || extract(epoch FROM clock_timestamp())::double precision;
    END LOOP;
END;
$$;

CREATE EXTENSION pg_stat_statements;
CREATE ROLE {WRITER_ROLE} LOGIN;
GRANT SELECT, INSERT, UPDATE ON {TABLE} TO {WRITER_ROLE};
"""


# CPU from /proc ------------------------------------------------------------------------------


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat from the third (state) on: the command name before may hold spaces."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def process_cpu(pid: int) -> float:
    """CPU seconds a process has used (utime + stime)."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def children(parent: int) -> Iterator[tuple[int, list[str]]]:
    """The processes alive whose parent is `parent`: pid and _stat()."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                fields = _stat(int(entry.name))
            except OSError:   # ended meanwhile
                continue
            if int(fields[1]) == parent:
                yield int(entry.name), fields


def cluster_cpu(postmaster: int) -> float:
    """CPU seconds a PostgreSQL cluster has used: its postmaster, the children it has reaped (cutime +
    cstime: backends that ended count too) and the children alive."""
    ticks = sum(int(value) for value in _stat(postmaster)[11:15])
    ticks += sum(int(fields[11]) + int(fields[12]) for _, fields in children(postmaster))
    return ticks / CLOCK_TICKS


def _children_cpu() -> float:
    """CPU seconds of this process's children waited for (user + system)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def machine_cpu() -> float:
    """CPU seconds the whole machine has spent busy, all cores (/proc/stat: all but idle and iowait)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(values) - values[3] - values[4]) / CLOCK_TICKS


# the replicator processes ------------------------------------------------------------------


class Daemons:
    """The replicator processes of the benchmark, each logging to LOGS/NAME.log, each in a session of
    its own (as on a machine of its own; Ctrl-C reaches the benchmark only, which stops them). They
    end with the benchmark: stop_all() in a finally, or SIGKILL from the kernel if it dies first
    (setpriv --pdeathsig: a follower told to stop finishes its step, which needs the broker)."""

    def __init__(self, logs: Path, env: dict[str, str]) -> None:
        self.logs = logs
        self.env = env
        self.running: dict[str, subprocess.Popen[bytes]] = {}

    def _command(self, args: Sequence[str]) -> list[str]:
        return ["setpriv", "--pdeathsig", "KILL", REPLICATOR, *args]

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        with open(self.logs / f"{name}.log", "ab") as log:
            process = subprocess.Popen(self._command(args), env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        self.running[name] = process
        return process

    def run(self, name: str, *args: str) -> tuple[float, float]:
        """Runs `replicator ARGS` to its end; returns its wall-clock seconds and its CPU seconds (user + system,
        its threads included)."""
        cpu = _children_cpu()
        started = time.perf_counter()
        with open(self.logs / f"{name}.log", "ab") as log:
            result = subprocess.run(self._command(args), env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        seconds = time.perf_counter() - started
        if result.returncode != 0:
            raise RuntimeError(f"`replicator {' '.join(args)}` failed ({result.returncode}); {self.tail(name)}")
        return seconds, _children_cpu() - cpu

    def check(self) -> None:
        """Raises if a daemon has ended."""
        for name, process in self.running.items():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited ({process.returncode}); {self.tail(name)}")

    def tail(self, name: str, lines: int = 20) -> str:
        text = (self.logs / f"{name}.log").read_text(errors="replace").splitlines()[-lines:]
        return "the end of its log:\n" + "\n".join(text)

    def stop(self, *names: str) -> None:
        """SIGTERM (each finishes its batch), then SIGKILL to those not gone in STOP_TIMEOUT."""
        processes = [self.running.pop(name) for name in names]
        for process in processes:
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT
        for process in processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def stop_all(self) -> None:
        self.stop(*self.running)

    def cpu(self) -> float:
        """CPU seconds the running daemons have used."""
        return sum(process_cpu(process.pid) for process in self.running.values())


# replicas ----------------------------------------------------------------------------------


class Replica:
    """A SQLite replica as the benchmark reads it (read-only): when each marker was first seen."""

    def __init__(self, name: str, path: Path) -> None:
        self.name = name
        self.path = path
        self.last = 0                                 # the last marker seen
        self.seen: list[tuple[float, int]] = []       # (time, last marker) each time it grew
        self._db: sqlite3.Connection | None = None

    def observe(self) -> int:
        """Reads the last marker; a replica not made yet, or busy for 0.1 s, keeps the last one seen."""
        try:
            if self._db is None:
                if not self.path.exists():
                    return self.last
                self._db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, isolation_level=None, timeout=0.1)
            marker = self._db.execute(f"SELECT max(id) FROM {TABLE}").fetchone()[0] or 0
        except sqlite3.Error:   # no table yet (copying), or locked
            self.close()
            return self.last
        if marker > self.last:
            self.last = marker
            self.seen.append((time.time(), marker))
        return self.last

    def forget(self) -> None:
        """Starts a phase: only its markers count."""
        self.seen.clear()

    def lags(self, first: int, commits: Sequence[float]) -> list[float]:
        """Seconds from each commit (marker first, first + 1, ...) to the first read that found its marker."""
        lags = []
        seen = iter(self.seen)
        at, marker = next(seen, (0.0, 0))
        for i, committed in enumerate(commits):
            while marker < first + i:
                at, marker = next(seen)   # every marker is seen: the phase waited for the last
            lags.append(at - committed)
        return lags

    def checksum(self) -> tuple[int, int]:
        assert self._db is not None   # observed up to the phase's last marker
        count, total = self._db.execute(f"SELECT count(*), sum(n) FROM {TABLE}").fetchone()
        return count, total

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


def poll(replicas: Sequence[Replica], done: Callable[[], bool]) -> int:
    """Reads every replica's last marker each POLL_INTERVAL until done(); returns the rounds made."""
    rounds = 0
    next_round = time.monotonic()
    while not done():
        for replica in replicas:
            replica.observe()
        rounds += 1
        next_round += POLL_INTERVAL
        delay = next_round - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:   # a round took longer: go on from now, without a burst of rounds to catch up
            next_round = time.monotonic()
    return rounds


# the writer --------------------------------------------------------------------------------


@dataclass
class Writes:
    commits: list[float]   # the commit time of each transaction, server side (its marker: first + index)
    backend_cpu: float     # CPU seconds of the writer's backend over the writes


def _write(dsn: str, first: int, per_second: float, seconds: float, channel: Connection) -> None:
    """The writer, in a process of its own: says it is connected, waits for "go", commits
    transactions at a steady rate, sends the Writes, and waits for "close": a backend that ends
    while the cluster's CPU is read may be missed (between its exit and the postmaster's wait).
    A call commits the transactions due: one, unless the writer fell behind (a round trip can take
    longer than the interval between two transactions on a busy machine)."""
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            backend = conn.info.backend_pid
            channel.send("connected")
            channel.recv()
            cpu = process_cpu(backend)
            count = int(per_second * seconds)
            commits: list[float] = []
            started = time.monotonic()
            while len(commits) < count:
                delay = started + len(commits) / per_second - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                due = min(count, 1 + int((time.monotonic() - started) * per_second))
                commits += _one(conn.execute("CALL fanout_write(%s, %s, %s)",
                                             (first + len(commits), due - len(commits), UPDATES)))[0]
            channel.send(Writes(commits, process_cpu(backend) - cpu))
            channel.recv()
    except KeyboardInterrupt:   # Ctrl-C reaches this process too: the benchmark reports it
        pass


# the CPU: servers first --------------------------------------------------------------------


def session_nice(pid: int, nice: int) -> int | None:
    """Sets the nice of the session of pid (its autogroup: with kernel.sched_autogroup_enabled, the
    kernel shares the CPU between sessions first, then within each); returns the nice it had, None
    where there are no autogroups or no right to (root or CAP_SYS_NICE)."""
    autogroup = Path(f"/proc/{pid}/autogroup")
    try:
        before = int(autogroup.read_text().rsplit("nice", 1)[1])
        autogroup.write_text(f"{nice}\n")
    except (OSError, IndexError, ValueError):
        return None
    return before


@contextmanager
def benchmark_first() -> Iterator[bool]:
    """This session (the benchmark, the broker, the writer) first for the CPU until the end of the
    block; yields whether it was done."""
    own = session_nice(os.getpid(), AHEAD_NICE)
    try:
        yield own is not None
    finally:
        if own is not None:
            session_nice(os.getpid(), own)


def source_first(postmaster: int, writer: int) -> bool:
    """Every PostgreSQL process first for the CPU (each backend is a session of its own), and the
    writer ahead of the others in the benchmark's session; returns whether it was done (root or
    CAP_SYS_NICE)."""
    try:
        os.setpriority(os.PRIO_PROCESS, writer, AHEAD_NICE)
    except PermissionError:
        return False
    return all([session_nice(pid, AHEAD_NICE) is not None for pid, _ in children(postmaster)])


# measuring ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Usage:
    """Counters at one moment: CPU seconds and statements."""
    at: float
    source: float
    clients: float
    broker: float
    machine: float
    queries: int          # top-level statements, the writer's left out
    writer_queries: int


@dataclass
class Phase:
    mode: str
    replicas: int
    seconds: float           # of writes
    written: int             # row changes
    source_cpu: float        # CPU seconds per second, every PostgreSQL process
    writer_cpu: float        # of which the writer's backend
    queries: float           # statements per second, the writer's left out
    connections: int         # the source's client connections at the end, the writer's and the benchmark's left out
    writer_queries: float
    clients_cpu: float       # the replicator processes
    broker_cpu: float
    machine_cpu: float       # busy cores
    load: float              # 1-minute load average at the end
    lag_p50: float
    lag_p99: float
    lag_max: float
    lag_samples: int
    read_interval: float     # achieved seconds between reads of a replica
    source_first: bool       # whether PostgreSQL and the writer went first for the CPU (source_first)

    @property
    def name(self) -> str:
        return f"{self.mode} ×{self.replicas}"

    @property
    def replication_cpu(self) -> float:
        return self.source_cpu - self.writer_cpu


@dataclass
class Throughput:
    name: str
    rows: int
    seconds: float     # `consume --until-caught-up`, wall clock
    startup: float     # the same with nothing to do
    cpu: float         # the CPU seconds of each (user + system): on a loaded machine, the wall clock is
    startup_cpu: float  # also the other jobs' share

    @property
    def rate(self) -> float:
        return self.rows / (self.seconds - self.startup)

    @property
    def cpu_rate(self) -> float:
        """Row changes per CPU second."""
        return self.rows / (self.cpu - self.startup_cpu)


def percentile(ordered: Sequence[float], p: float) -> float:
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))]


class FanoutBench:
    """One run on a cluster and a broker started: setup, the phases of each mode, throughput, the report."""

    def __init__(self, args: argparse.Namespace, workdir: Path, server: PgServer, monitor: psycopg.Connection,
                 kafka: KafkaServer, daemons: Daemons) -> None:
        self.args = args
        self.workdir = workdir
        self.dsn = server.dsn
        self.writer_dsn = make_conninfo(server.dsn, user=WRITER_ROLE)
        self.kafka = kafka
        self.kafka_url = f"kafka://{kafka.bootstrap}/{PREFIX}"
        self.daemons = daemons
        self.postmaster = int((server.datadir / "postmaster.pid").read_text().split("\n", 1)[0])
        self.monitor = monitor   # the benchmark's own connection: setup, counters, checksums
        self.next_id = INITIAL_ROWS + 1
        self.phases: list[Phase] = []
        self.throughputs: list[Throughput] = []
        self.poll_option = ("--poll-interval", str(args.poll_interval))

    def setup(self) -> None:
        install(self.monitor)
        self.monitor.execute(SCHEMA)
        with Source.connect(self.dsn) as source:
            source.create_queue(QUEUE)
            source.set_queue_config(QUEUE, ticker_max_lag=parse_duration(self.args.ticker_max_lag))
            source.add_table(QUEUE, TABLE)
        self.daemons.start("ticker", "ticker", "--interval", str(self.args.tick_interval))

    # phases ----------------------------------------------------------------------------------

    def direct(self) -> None:
        count = self.args.followers
        names = [f"direct-{i:02}" for i in range(count)]
        replicas = [Replica(name, self.workdir / f"{name}.db") for name in names]
        for name, replica in zip(names, replicas):
            self.daemons.start(name, "consume", QUEUE, "--target", f"sqlite:{replica.path}",
                               "--consumer", name.replace("-", "_"), *self.poll_option)
        self.wait_ready("direct", replicas)
        self.phase("direct", replicas)
        self.daemons.stop(*names[1:])
        with Source.connect(self.dsn) as source:
            for name in names[1:]:
                source.unregister_consumer(QUEUE, name.replace("-", "_"))
        self.phase("direct", replicas[:1])
        self.daemons.stop(names[0])   # registered still: the throughput part times it
        for replica in replicas:
            replica.close()

    def via_kafka(self) -> None:
        count = self.args.followers
        self.daemons.start("publisher", "consume", QUEUE, "--target", self.kafka_url, *self.poll_option)
        self.wait_published()
        names = [f"kafka-{i:02}" for i in range(count)]
        replicas = [Replica(name, self.workdir / f"{name}.db") for name in names]
        for name, replica in zip(names, replicas):
            self.daemons.start(name, "consume", "--source", self.kafka_url, "--target", f"sqlite:{replica.path}",
                               *self.poll_option)
        self.wait_ready("Kafka", replicas)
        self.phase("Kafka", replicas)
        self.daemons.stop(*names[1:])
        self.phase("Kafka", replicas[:1])
        self.daemons.stop(names[0], "publisher")
        for replica in replicas:
            replica.close()

    def wait_published(self) -> None:
        """Waits for the publisher's first commit (the table's copy): followers start from a prefix published."""
        settings = parse_url(self.kafka_url)
        deadline = time.monotonic() + READY_TIMEOUT
        while PublisherState.read(settings, state_topic(PREFIX)).commit is None:
            self.daemons.check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the publisher committed nothing in {READY_TIMEOUT:.0f}s; "
                                   f"{self.daemons.tail('publisher')}")
            time.sleep(0.5)

    def wait_ready(self, mode: str, replicas: Sequence[Replica]) -> None:
        """Waits for every new replica to hold the source's rows (the writer is idle)."""
        console.print(f"[bold]{mode}[/]: {len(replicas)} replicas starting")
        started = time.monotonic()
        while True:
            behind = [r for r in replicas if r.observe() < self.next_id - 1]
            if not behind:
                break
            self.daemons.check()
            if time.monotonic() - started > READY_TIMEOUT:
                raise RuntimeError(f"{len(behind)} replicas not ready after {READY_TIMEOUT:.0f}s, e.g. "
                                   f"{behind[0].name}; {self.daemons.tail(behind[0].name)}")
            time.sleep(0.2)
        console.print(f"  ready in {time.monotonic() - started:.0f}s (copy or bootstrap of {self.next_id - 1:,} rows)")

    def usage(self) -> Usage:
        queries, writer_queries = _one(self.monitor.execute(
            "SELECT coalesce(sum(s.calls) FILTER (WHERE r.rolname <> %s), 0),"
            " coalesce(sum(s.calls) FILTER (WHERE r.rolname = %s), 0)"
            " FROM pg_stat_statements s JOIN pg_roles r ON r.oid = s.userid", (WRITER_ROLE, WRITER_ROLE)))
        assert self.kafka.process is not None   # started
        return Usage(at=time.monotonic(), source=cluster_cpu(self.postmaster), clients=self.daemons.cpu(),
                     broker=process_cpu(self.kafka.process.pid), machine=machine_cpu(), queries=int(queries),
                     writer_queries=int(writer_queries))

    def phase(self, mode: str, replicas: Sequence[Replica]) -> None:
        """One phase: the writes, measured, then every replica caught up and checked."""
        args = self.args
        console.print(f"  {mode} ×{len(replicas)}: {args.rate:,.0f} row changes/s for {args.seconds:.0f}s")
        first = self.next_id
        channel, writer_end = multiprocessing.Pipe()
        writer = multiprocessing.get_context("spawn").Process(
            target=_write, args=(self.writer_dsn, first, args.rate / CHANGES_PER_TRANSACTION, args.seconds, writer_end),
            daemon=True)
        writer.start()
        try:
            connected_by = time.monotonic() + 60
            while not channel.poll(0.1):
                if not writer.is_alive() or time.monotonic() > connected_by:
                    raise RuntimeError("the writer did not connect (its error, if any, is above)")
            channel.recv()   # connected
            assert writer.pid is not None   # started
            prioritized = source_first(self.postmaster, writer.pid)
            for replica in replicas:
                replica.forget()
            before = self.usage()
            channel.send("go")
            rounds = poll(replicas, lambda: channel.poll() or not writer.is_alive())
            if not channel.poll():
                raise RuntimeError(f"the writer failed ({writer.exitcode}): its error is above")
            writes: Writes = channel.recv()
            after = self.usage()
            connections = self.connections()
            channel.send("close")
            writer.join()
        finally:
            if writer.is_alive():
                writer.terminate()
        last = first + len(writes.commits) - 1
        drain_until = time.monotonic() + DRAIN_TIMEOUT
        poll(replicas, lambda: all(r.last >= last for r in replicas) or time.monotonic() > drain_until)
        behind = [r for r in replicas if r.last < last]
        if behind:
            lagging = behind[0]
            raise RuntimeError(f"{len(behind)} replicas short of the last marker {DRAIN_TIMEOUT:.0f}s after the "
                               f"writes, e.g. {lagging.name} at {lagging.last}; {self.daemons.tail(lagging.name)}")
        self.next_id = last + 1
        self.daemons.check()
        self.check_replicas(replicas)
        lags = sorted(itertools.chain.from_iterable(r.lags(first, writes.commits) for r in replicas))
        seconds = after.at - before.at
        result = Phase(
            mode=mode, replicas=len(replicas), seconds=seconds,
            written=len(writes.commits) * CHANGES_PER_TRANSACTION,
            source_cpu=(after.source - before.source) / seconds, writer_cpu=writes.backend_cpu / seconds,
            queries=(after.queries - before.queries) / seconds, connections=connections,
            writer_queries=(after.writer_queries - before.writer_queries) / seconds,
            clients_cpu=(after.clients - before.clients) / seconds, broker_cpu=(after.broker - before.broker) / seconds,
            machine_cpu=(after.machine - before.machine) / seconds, load=os.getloadavg()[0],
            lag_p50=percentile(lags, 50), lag_p99=percentile(lags, 99), lag_max=lags[-1], lag_samples=len(lags),
            read_interval=seconds / max(rounds, 1), source_first=prioritized)
        self.phases.append(result)
        console.print(f"    source CPU {result.source_cpu:.2f} s/s, {result.queries:,.0f} queries/s; lag p50 "
                      f"{result.lag_p50:.2f}s, p99 {result.lag_p99:.2f}s; machine {result.machine_cpu:.1f} cores busy, "
                      f"load {result.load:.1f}")

    def connections(self) -> int:
        count: int = _one(self.monitor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' AND usename <> %s"
            " AND pid <> pg_backend_pid()", (WRITER_ROLE,)))[0]
        return count

    def source_checksum(self) -> tuple[int, int]:
        count, total = _one(self.monitor.execute(f"SELECT count(*), sum(n) FROM {TABLE}"))
        return count, total

    def check_replicas(self, replicas: Sequence[Replica]) -> None:
        expected = self.source_checksum()
        for replica in replicas:
            if replica.checksum() != expected:
                raise RuntimeError(f"{replica.name} differs from the source: (rows, sum(n)) {replica.checksum()} "
                                   f"against {expected}")

    # throughput ------------------------------------------------------------------------------

    def throughput(self) -> None:
        """The burst queued with every daemon but the ticker stopped, then one catch-up run each."""
        transactions = -(-self.args.burst_rows // CHANGES_PER_TRANSACTION)
        rows = transactions * CHANGES_PER_TRANSACTION
        console.print(f"[bold]throughput[/]: queueing {rows:,} row changes")
        started = time.monotonic()
        with psycopg.connect(self.writer_dsn, autocommit=True) as conn:
            conn.execute("CALL fanout_write(%s, %s, %s)", (self.next_id, transactions, UPDATES))
        self.next_id += transactions
        console.print(f"  queued in {time.monotonic() - started:.0f}s")
        direct, follower = self.workdir / "direct-00.db", self.workdir / "kafka-00.db"
        for name, args in (
                ("publisher", ("consume", QUEUE, "--target", self.kafka_url)),
                ("follower", ("consume", "--source", self.kafka_url, "--target", f"sqlite:{follower}")),
                ("direct consumer", ("consume", QUEUE, "--target", f"sqlite:{direct}", "--consumer", "direct_00"))):
            seconds, cpu = self.daemons.run(f"{name}-burst", *args, "--until-caught-up")
            startup, startup_cpu = self.daemons.run(f"{name}-idle", *args, "--until-caught-up")
            self.throughputs.append(Throughput(name, rows, seconds, startup, cpu, startup_cpu))
            console.print(f"  {name}: {seconds:.1f}s (start-up {startup:.1f}s): "
                          f"{self.throughputs[-1].rate:,.0f} row changes/s; CPU {cpu:.1f}s (start-up "
                          f"{startup_cpu:.1f}s): {self.throughputs[-1].cpu_rate:,.0f} row changes per CPU second")
        for path in (direct, follower):
            replica = Replica(path.stem, path)
            replica.observe()
            self.check_replicas([replica])
            replica.close()

    # report ----------------------------------------------------------------------------------

    def report(self, benchmark_first: bool) -> dict[str, Any]:
        args = self.args
        by_name = {p.name: p for p in self.phases}
        count = args.followers
        columns = ["direct ×1", f"direct ×{count}", "Kafka ×1", f"Kafka ×{count}"]
        phases = [by_name[c] for c in columns]
        kafka = phases[2:]
        table = Table(title=f"Fan-out: {count} SQLite replicas through Kafka against {count} direct consumers, "
                            f"{args.rate:,.0f} row changes/s, {args.seconds:.0f}s a phase")
        for column in ("", *columns, "goal", "met"):
            table.add_column(column, justify="left" if column in ("", "goal", "met") else "right")

        def flat(value: Callable[[Phase], float]) -> str:
            share = (value(phases[3]) - value(phases[2])) / (value(phases[1]) - value(phases[0]))
            return f"{_met(share <= FLAT)}: {round(share, 2) + 0.0:.0%} of direct's"   # + 0.0: no "-0%"

        def row(label: str, value: Callable[[Phase], str], goal: str = "", met: str = "") -> None:
            table.add_row(label, *(value(p) for p in phases), goal, met)

        row("source CPU, s/s", lambda p: f"{p.source_cpu:.2f}")
        row("  without the writer", lambda p: f"{p.replication_cpu:.2f}", "Kafka: flat",
            flat(lambda p: p.replication_cpu))
        row("source queries/s", lambda p: f"{p.queries:,.0f}", "Kafka: flat", flat(lambda p: p.queries))
        row("source connections", lambda p: f"{p.connections}", "Kafka: flat", flat(lambda p: p.connections))
        row("lag p50, s", lambda p: f"{p.lag_p50:.2f}", "Kafka: ≤ 1 s", _met(max(p.lag_p50 for p in kafka) <= 1))
        row("lag p99, s", lambda p: f"{p.lag_p99:.2f}", "Kafka: ≤ 3 s", _met(max(p.lag_p99 for p in kafka) <= 3))
        row("lag max, s", lambda p: f"{p.lag_max:.2f}")
        row("written, changes/s", lambda p: f"{p.written / p.seconds:,.0f}", f"{args.rate:,.0f}")
        row("applied, changes", lambda p: f"{p.written * p.replicas:,}")
        row("replicator CPU, s/s", lambda p: f"{p.clients_cpu:.2f}")
        row("broker CPU, s/s", lambda p: f"{p.broker_cpu:.2f}")
        row("busy cores, load", lambda p: f"{p.machine_cpu:.1f}, {p.load:.1f}")
        rates = {t.name: t.rate for t in self.throughputs}
        table.add_row("publisher, changes/s", "", "", f"{rates['publisher']:,.0f}", "", f"≥ {PUBLISHER_GOAL:,}",
                      _met(rates["publisher"] >= PUBLISHER_GOAL))
        share = rates["follower"] / rates["direct consumer"]
        table.add_row("one replica, changes/s", f"{rates['direct consumer']:,.0f}", "", f"{rates['follower']:,.0f}",
                      "", "Kafka: ≥ 1.0× direct", f"{_met(share >= 1)}: {share:.2f}×")
        per_cpu = {t.name: t.cpu_rate for t in self.throughputs}
        table.add_row("… per CPU second", f"{per_cpu['direct consumer']:,.0f}", "", f"{per_cpu['follower']:,.0f}",
                      "", "", f"{per_cpu['follower'] / per_cpu['direct consumer']:.2f}× (publisher "
                      f"{per_cpu['publisher']:,.0f})")
        console.print(table)
        priority = (f"it, every PostgreSQL process and the broker first for the CPU (their sessions at nice "
                    f"{AHEAD_NICE}: servers of their own); each replicator process in a session of its own"
                    if benchmark_first and all(p.source_first for p in self.phases) else
                    "not first for the CPU, nor PostgreSQL and the broker (that needs root or CAP_SYS_NICE, and "
                    "autogroups): where the replicas keep the machine busy, it writes less")
        worst_read = max(p.read_interval for p in self.phases)
        startups = ", ".join(f"{t.name} {t.startup:.1f}s" for t in self.throughputs)
        console.print(" ".join((
            f"Writer: transactions of 1 insert + {UPDATES} updates, as role {WRITER_ROLE}; {priority}.",
            "Source CPU: utime + stime of every PostgreSQL process (/proc), and without the writer's backend;",
            "queries: top-level statements (pg_stat_statements), the writer's left out; connections: client",
            "connections at the end of the phase, the writer's and the benchmark's left out.",
            f"Flat: going from 1 to {count} followers adds at most {FLAT:.0%} of what going from 1 to {count} direct",
            "consumers adds (the percentage shown).",
            f"Ticker --interval {args.tick_interval}, queue ticker_max_lag {args.ticker_max_lag}; consumers, publisher",
            f"and followers --poll-interval {args.poll_interval}.",
            "Lag: commit (the source's clock after COMMIT) to the first read finding the row in a replica, each",
            "replica read every",
            f"{POLL_INTERVAL * 1000:.0f} ms (achieved: {worst_read * 1000:.0f} ms at worst),",
            f"{sum(p.lag_samples for p in self.phases):,} samples. Applied: each replica checked against the source.",
            "CPU of the replicator processes (ticker included) and of the broker's JVM; busy cores of the",
            f"machine's {os.cpu_count()} and load average, other jobs included.",
            f"Throughput: {self.throughputs[0].rows:,} row changes queued, `consume --until-caught-up` less a run",
            f"with nothing to do ({startups}).")))
        return {"rate": args.rate, "seconds": args.seconds, "followers": count, "tick_interval": args.tick_interval,
                "ticker_max_lag": args.ticker_max_lag, "poll_interval": args.poll_interval,
                "read_interval": POLL_INTERVAL, "python": platform.python_version(), "cpus": os.cpu_count(),
                "phases": [asdict(p) for p in self.phases],
                "throughput": [{**asdict(t), "rate": t.rate, "cpu_rate": t.cpu_rate} for t in self.throughputs]}


def _met(ok: bool) -> str:
    return "yes" if ok else "no"


def _one(cursor: psycopg.Cursor[Any]) -> Any:
    """The row of a query that returns one (an aggregate)."""
    row = cursor.fetchone()
    assert row is not None
    return row


# main --------------------------------------------------------------------------------------


def _interrupt(signum: int, frame: object) -> NoReturn:
    raise KeyboardInterrupt


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    logs = workdir / "logs"
    logs.mkdir()
    # the daemons run the replicator package this benchmark imports, wherever it is installed from
    env = {**os.environ, "PYTHONPATH": str(Path(replicator.__file__).parents[1]), "PYTHONUNBUFFERED": "1"}
    with PgServer(settings={"shared_preload_libraries": "'pg_stat_statements'"}) as server, \
            psycopg.connect(server.dsn, autocommit=True) as monitor:
        env["REPLICATOR_DSN"] = server.dsn
        console.print("starting a Kafka broker")
        with KafkaServer() as kafka:
            daemons = Daemons(logs, env)
            bench = FanoutBench(args, workdir, server, monitor, kafka, daemons)
            try:
                with benchmark_first() as prioritized:
                    bench.setup()
                    bench.direct()
                    bench.via_kafka()
                    bench.throughput()
                return bench.report(prioritized)
            finally:
                daemons.stop_all()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-fanout", description=__doc__.split("\n\n")[0])
    parser.add_argument("--followers", type=int, default=50, help="replicas of each mode (default 50)")
    parser.add_argument("--seconds", type=float, default=60, help="seconds of writes a phase (default 60)")
    parser.add_argument("--rate", type=float, default=2000, help="row changes written per second (default 2000)")
    parser.add_argument("--burst-rows", type=int, default=500_000,
                        help="throughput: row changes queued for the publisher and a replica (default 500,000)")
    parser.add_argument("--tick-interval", type=float, default=0.1, help="the ticker's --interval (default 0.1)")
    parser.add_argument("--ticker-max-lag", default="200ms", help="the queue's ticker_max_lag (default 200ms)")
    parser.add_argument("--poll-interval", type=float, default=0.2,
                        help="--poll-interval of every consumer, the publisher and the followers (default 0.2)")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    parser.add_argument("--keep", action="store_true", help="keep the replicas and logs (their directory is printed)")
    args = parser.parse_args(argv)
    if args.followers < 2:
        parser.error("--followers: at least 2 (the phases compare N replicas with one)")

    signal.signal(signal.SIGTERM, _interrupt)   # SIGTERM cleans up as Ctrl-C does
    workdir = Path(tempfile.mkdtemp(prefix="replicator-bench-fanout-"))
    if args.keep:
        console.print(f"replicas and logs in {workdir}")
    try:
        figures = run(args, workdir)
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
