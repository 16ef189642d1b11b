"""The soak (issue 31): every daemon under a steady workload for --minutes, watched for growth.

Run it through ``bin/soak``. One throwaway PostgreSQL and one Kafka broker; the daemons run as a user
runs them, each a ``replicator`` process of its own:

    ticker      ``replicator ticker``
    maint       ``replicator maint`` (rotations, tick cleanup)
    sqlite      ``replicator consume soak --target sqlite:...``
    delta       ``replicator consume soak --target delta:... --vacuum-every 1min`` (its own OPTIMIZE, log
                cleanup after each checkpoint, and VACUUM)
    publisher   ``replicator consume soak --target kafka://...``
    follower    ``replicator consume --source kafka://... --target sqlite:...``

A writer thread commits, paced by the clock, --rate row changes/s into four tables (two with integer
keys, two with text keys): each transaction inserts ROWS_PER_STATEMENT new keys into one of them,
updates as many random ones and deletes its oldest as many, so that every table keeps its size and
whatever grows is replication's own.

The queue rotates every --rotation-period, and the soak gives the Delta tables and the Kafka topics a
retention of --retention (Delta's ``deletedFileRetentionDuration`` and ``logRetentionDuration``;
Kafka's ``delete.retention.ms``, with an eager cleaner and a segment rolled every --sample-every on the
table topics and the publisher's state topic), set as a user sets them once the copies are made: with the defaults (2 h
rotations, 7 days) the sizes grow for that long before they level, longer than a soak runs. Both
scale with the run (a twelfth and a thirtieth of it: 5 min and 2 min for an hour). What the soak
proves is that the cleanup keeps up: the sizes reach a level and stay there.

Every --sample-every seconds: each daemon's RSS (VmRSS of the process and its descendants), the queue's
size on the source (its event partitions and the tick table, pg_total_relation_size), the Delta
warehouse's data files its logs name (the current versions' and the removed ones vacuum is to delete),
those no log names, and its logs (``_delta_log``), the two SQLite replicas (with their -wal) and the
topics in the broker's log directory, all as bytes on disk (du's); and each consumer's lag: the highest
``replicator_consumer_lag_seconds`` its ``--metrics-port`` reported, read every second, since the last
sample (the follower's is from the publisher's commit). The topics saw with their segments (the active
one grows until it rolls, is compacted, and its old files go a minute later): read every second too,
their sample is the mean since the last one, and as a segment rolls every --sample-every, a sample holds
one whole period of the saw, whatever its phase (sampled once a minute, a saw of 2 minutes read as a
level that stepped when its phase drifted: the hour's run of 5ad40c4 judged the topics growing).

Flat: a series is judged from the end of the warm-up on (the first third of the run, at least the
queue's rotation through all its tables and the retention with a vacuum interval, so that every
cleanup has begun; or --warmup minutes). A least-squares line through the judged samples gives the
slope and its standard error; the series GROWS when the slope is both significant (above --sigmas
standard errors: a saw of rotations, vacuums and compactions shows in the residuals, which widen the
error, not in the slope) and material (projected over an hour, more than --max-growth percent of the
series' mean). A steady series passes whatever its noise; a leak fails once the run is long enough to
tell it from noise, and the projection says how much it matters. A short run tells only gross growth
from settling: CI's run of two minutes judges with --max-growth 2000 (and --max-lag 10: its other
worker shares the cores), which catches a size that is not cleaned at all (the queue not rotated, a
log not cleaned, topics not compacted grow tens of times over in an hour), and leaves the fine
judgement (10% an hour by default) to the long runs. Lag is judged against --max-lag at
every sample; the queue ticks every second while idle, so that a lag (its tick's age) reads as
latency from the first write.

At the end the writer stops, a forced tick marks the last write, every consumer is waited for up to
that tick (the follower: up to the publisher's commit of it), the daemons get SIGTERM, and every
replica (SQLite, Delta through delta-rs, the follower's SQLite) is compared with the source, table by
table, sorted rows. The samples (JSON, CSV) and plots (PNG) go into --report; the exit status is 1
when a replica differs, a series grows or a lag exceeds its goal.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import re
import shutil
import signal
import sqlite3
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn

import matplotlib
import psycopg
import pyarrow as pa
from confluent_kafka.admin import (  # type: ignore[attr-defined]  # (not in its __all__)
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ResourceType,
)
from deltalake import DeltaTable
from rich.console import Console
from rich.table import Table

import replicator
from bench_fanout import Daemons, children
from kafkaserver import KafkaServer, free_ports
from pgserver import PgServer
from replicator.source import parse_duration
from replicator.targets.delta import log as delta_log
from replicator.targets.delta.maintenance import _DATA_FILE, _references  # what vacuum reads of a table
from replicator.targets.delta.reader import table_uris
from replicator.targets.delta.storage import Storage
from replicator.targets.delta.url import open_storage

matplotlib.use("Agg")   # files, no display
import matplotlib.pyplot as plt

console = Console()
if not console.is_terminal:
    console.width = 140

QUEUE = "soak"
PREFIX = "soak"                     # the Kafka topics' prefix
TABLES = {"soak_int_a": False, "soak_int_b": False, "soak_text_a": True, "soak_text_b": True}   # name: text key
INITIAL_ROWS = 5_000                # rows of each table, throughout
ROWS_PER_STATEMENT = 5              # a transaction: that many inserts, updates and deletes in one table
CHANGES_PER_TRANSACTION = 3 * ROWS_PER_STATEMENT
DAEMONS = ("ticker", "maint", "sqlite", "delta", "publisher", "follower")
CONSUMERS = ("sqlite", "delta", "publisher", "follower")
VACUUM_EVERY = 60.0                 # seconds: the shortest --vacuum-every
POLL = 1.0                          # seconds between reads of the consumers' metrics and the topics' bytes
READY_TIMEOUT = 120.0               # for the daemons to report their lag
DRAIN_TIMEOUT = 300.0               # after the writes, for every consumer to reach the last tick

SCHEMA = """
CREATE TABLE {table} (id {key} PRIMARY KEY, n integer NOT NULL, v text NOT NULL);
INSERT INTO {table} SELECT {key_of_g}, 0, md5(g::text) FROM generate_series(1, {rows}) g;
"""

# One writer transaction on a table holding keys lo..hi-1: p_rows new keys from hi, as many updates
# of random keys above the ones deleted, the p_rows oldest deleted. Returns the rows it changed.
WRITE = """
CREATE FUNCTION soak_write(p_table regclass, p_text boolean, p_lo bigint, p_hi bigint, p_rows integer)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    v_key text := CASE WHEN p_text THEN $k$'k' || lpad(g::text, 12, '0')$k$ ELSE 'g' END;
    v_changed integer := 0;
    v_count integer;
BEGIN
    EXECUTE format('INSERT INTO %s SELECT %s, 0, md5(g::text) FROM generate_series($1, $2) g', p_table, v_key)
        USING p_hi, p_hi + p_rows - 1;
    GET DIAGNOSTICS v_count = ROW_COUNT;
    v_changed := v_changed + v_count;
    EXECUTE format('UPDATE %s SET n = n + 1, v = md5(v) WHERE id IN (SELECT %s FROM (SELECT $1 + floor(random()'
                   ' * ($2 - $1))::bigint AS g FROM generate_series(1, $3)) r)', p_table, v_key)
        USING p_lo + p_rows, p_hi, p_rows;
    GET DIAGNOSTICS v_count = ROW_COUNT;
    v_changed := v_changed + v_count;
    EXECUTE format('DELETE FROM %s WHERE id IN (SELECT %s FROM generate_series($1, $2) g)', p_table, v_key)
        USING p_lo, p_lo + p_rows - 1;
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_changed + v_count;
END $$;
"""


# the writer ------------------------------------------------------------------------------


class Writer(threading.Thread):
    """Commits rate/CHANGES_PER_TRANSACTION transactions a second, paced by the clock, round the
    tables, until stopped; counts the row changes written."""

    def __init__(self, dsn: str, rate: float) -> None:
        super().__init__(name="writer", daemon=True)
        self.dsn = dsn
        self.per_second = rate / CHANGES_PER_TRANSACTION
        self.windows = {table: [1, INITIAL_ROWS + 1] for table in TABLES}   # keys lo..hi-1 of each table
        self.changes = 0
        self.transactions = 0
        self.error: BaseException | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                started = time.monotonic()
                order = list(TABLES)
                while not self._halt.is_set():
                    due = started + self.transactions / self.per_second - time.monotonic()
                    if due > 0:
                        self._halt.wait(due)   # pacing, not synchronisation
                        continue
                    self.write(conn, order[self.transactions % len(order)])
        except BaseException as error:   # reported by the soak's checks
            self.error = error

    def write(self, conn: psycopg.Connection[Any], table: str) -> None:
        window = self.windows[table]
        row = conn.execute("SELECT soak_write(%s, %s, %s, %s, %s)",
                           (table, TABLES[table], window[0], window[1], ROWS_PER_STATEMENT)).fetchone()
        assert row is not None   # a function's call
        window[0] += ROWS_PER_STATEMENT
        window[1] += ROWS_PER_STATEMENT
        self.changes += row[0]
        self.transactions += 1

    def stop(self) -> None:
        self._halt.set()
        self.join()


# what is measured ------------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    """VmRSS of a process and its descendants (0 for one gone)."""
    total = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total = int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total + sum(rss_bytes(child) for child, _ in children(pid))


def disk_bytes(path: Path) -> int:
    """Bytes a file takes on disk, as du counts them (Kafka preallocates its index files sparse)."""
    try:
        return path.stat().st_blocks * 512
    except FileNotFoundError:   # deleted meanwhile (vacuumed, compacted)
        return 0


def tree_bytes(path: Path, only: Callable[[Path], bool] = lambda p: True) -> int:
    """Bytes on disk of the files under path (in the directories only() accepts, at any depth)."""
    return sum(disk_bytes(Path(root) / name) for root, _, files in os.walk(path) if only(Path(root))
               for name in files)


def sqlite_bytes(path: Path) -> int:
    return disk_bytes(path) + disk_bytes(Path(f"{path}-wal"))


def kafka_bytes(data: Path) -> int:
    """Bytes of the soak's topics (the table topics, the schema topic, the publisher's state topic)
    in the broker's log directory: a partition's directory is TOPIC-PARTITION."""
    return sum(tree_bytes(d) for d in data.iterdir()
               if d.is_dir() and (d.name.startswith(f"{PREFIX}.") or d.name.startswith(f"{PREFIX}-")
                                  or d.name.startswith(f"__replicator.{PREFIX}-")))


def delta_bytes(warehouse: Path) -> tuple[int, int]:
    """Bytes on disk of the warehouse's data files (and deletion vectors) its logs name, the current
    versions' and the removed ones vacuum is to delete, and of those no log names (a file a batch or
    OPTIMIZE is writing; one whose remove a checkpoint left out, were it not deleted at the checkpoint:
    vacuum would keep it 7 days, ORPHAN_SECONDS)."""
    storage = open_storage(str(warehouse))
    named = unnamed = 0
    for log in warehouse.rglob("_delta_log"):
        table = str(log.parent.relative_to(warehouse))
        in_use, removed = table_references(storage, table)
        for entry in storage.list(table):
            name = entry.path[len(table) + 1:]
            if _DATA_FILE.fullmatch(name):
                size = disk_bytes(warehouse / entry.path)
                if name in in_use or name in removed:
                    named += size
                else:
                    unnamed += size
    return named, unnamed


def table_references(storage: Storage, table: str, attempts: int = 5) -> tuple[set[str], dict[str, float]]:
    """The files a table's log names, as vacuum reads them: in use, and removed. The consumer cleans
    the log meanwhile: a log entry listed and gone before it is read is listed again."""
    def read() -> tuple[set[str], dict[str, float]]:
        return _references(storage, delta_log.load(storage, table, tombstones=True), time.time())

    for _ in range(attempts - 1):
        with contextlib.suppress(OSError):
            return read()
    return read()


QUEUE_BYTES = """
SELECT coalesce((SELECT sum(pg_total_relation_size(i.inhrelid)) FROM pg_inherits i
                 WHERE i.inhparent = replicator.event_table(q.queue_id)::regclass), 0)
       + pg_total_relation_size('replicator.tick')
FROM replicator.queue q WHERE q.queue_name = %s
"""

LAG = re.compile(r'^replicator_consumer_lag_seconds\{[^}]*\} (\S+)$', re.MULTILINE)


def scrape_lag(port: int) -> float | None:
    """The lag a daemon's /metrics reports (None: none yet, or not answering)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            text = response.read().decode()
    except OSError:
        return None
    match = LAG.search(text)
    return float(match[1]) if match else None


class Watch(threading.Thread):
    """Reads every consumer's lag and the topics' bytes each POLL seconds; take() gives the highest
    lag of each and the topics' mean bytes since the last take() (None before a first read)."""

    def __init__(self, ports: dict[str, int], kafka_data: Path) -> None:
        super().__init__(name="watch", daemon=True)
        self.ports = ports
        self.kafka_data = kafka_data
        self.highest: dict[str, float] = {}
        self.topic_bytes: list[int] = []
        self.error: Exception | None = None   # what stopped it (the run then stops: Soak.check)
        self._lock = threading.Lock()
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            while not self._halt.wait(POLL):   # polling interval
                topics = kafka_bytes(self.kafka_data)
                lags = {name: scrape_lag(port) for name, port in self.ports.items()}
                with self._lock:
                    self.topic_bytes.append(topics)
                    for name, lag in lags.items():
                        if lag is not None:
                            self.highest[name] = max(lag, self.highest.get(name, 0.0))
        except Exception as exc:   # (no lag read any more would read as none)
            self.error = exc

    def take(self) -> tuple[dict[str, float], int | None]:
        with self._lock:
            highest, self.highest = self.highest, {}
            topics, self.topic_bytes = self.topic_bytes, []
        return highest, round(sum(topics) / len(topics)) if topics else None

    def stop(self) -> None:
        self._halt.set()
        self.join()


@dataclass
class Sample:
    seconds: float                 # since the writes began
    written: int                   # row changes written so far
    rss: dict[str, int]            # daemon: bytes
    sizes: dict[str, int]          # what: bytes
    lag: dict[str, float]          # consumer: the highest lag since the last sample, seconds


# the run ---------------------------------------------------------------------------------


class Soak:
    """One run: the servers started, setup, the daemons, the writes with their samples, the end."""

    def __init__(self, args: argparse.Namespace, workdir: Path, server: PgServer, kafka: KafkaServer,
                 daemons: Daemons) -> None:
        self.args = args
        self.workdir = workdir
        self.dsn = server.dsn
        self.kafka = kafka
        self.kafka_url = f"kafka://{kafka.bootstrap}/{PREFIX}"
        self.daemons = daemons
        self.sqlite = workdir / "replica.db"
        self.follower = workdir / "follower.db"
        self.warehouse = workdir / "warehouse"
        self.ports = dict(zip(CONSUMERS, free_ports(len(CONSUMERS)), strict=True))
        self.samples: list[Sample] = []
        self.written = 0   # row changes, once the writes end

    def setup(self) -> None:
        """The tables, the queue, and every replica's copy before the daemons start."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            for table, text in TABLES.items():
                conn.execute(SCHEMA.format(table=table, key="text" if text else "bigint", rows=INITIAL_ROWS,
                                           key_of_g="'k' || lpad(g::text, 12, '0')" if text else "g"))
            conn.execute(WRITE)
        self.daemons.run("setup", "install")
        self.daemons.run("setup", "queue", "create", QUEUE, "--rotation-period", self.args.rotation_period,
                         "--tables", str(self.args.queue_tables), "--ticker-max-lag", "500ms",
                         # ticks every second while idle too: a consumer's lag, its tick's age, reads as its latency
                         # from the first write on (not the age of an idle queue's last tick)
                         "--ticker-idle-period", "1s")
        for table in TABLES:
            self.daemons.run("setup", "table", "add", QUEUE, table)
        console.print("initial copies")
        for name, args in self.consume_args().items():
            self.daemons.run(f"{name}-copy", *args, "--until-caught-up")
        self.shorten_delta_retention()
        self.shorten_kafka_retention()

    def consume_args(self) -> dict[str, tuple[str, ...]]:
        return {"sqlite": ("consume", QUEUE, "--target", f"sqlite:{self.sqlite}"),
                "delta": ("consume", QUEUE, "--target", f"delta:{self.warehouse}"),
                "publisher": ("consume", QUEUE, "--target", self.kafka_url),
                "follower": ("consume", "--source", self.kafka_url, "--target", f"sqlite:{self.follower}")}

    def shorten_delta_retention(self) -> None:
        """Every Delta table of the warehouse (the map _replicator too) keeps removed files and log
        entries for --retention, as a user sets it with delta-rs."""
        interval = f"interval {int(parse_duration(self.args.retention).total_seconds())} seconds"
        for log in sorted(self.warehouse.rglob("_delta_log")):
            DeltaTable(str(log.parent)).alter.set_table_properties(
                {"delta.deletedFileRetentionDuration": interval, "delta.logRetentionDuration": interval})

    def shorten_kafka_retention(self) -> None:
        """The table topics and the state topic keep tombstones for --retention, roll a segment every
        --sample-every (a sample's mean then spans one period of their saw) and clean it soon."""
        retention = str(int(parse_duration(self.args.retention).total_seconds() * 1000))
        segment = str(int(self.args.sample_every * 1000))
        admin = AdminClient({"bootstrap.servers": self.kafka.bootstrap})
        topics = [t for t in admin.list_topics(timeout=30).topics
                  if t.startswith(f"{PREFIX}.") or t == f"__replicator.{PREFIX}"]
        entries = [ConfigEntry(name, value, incremental_operation=AlterConfigOpType.SET)
                   for name, value in (("segment.ms", segment), ("delete.retention.ms", retention),
                                       ("min.cleanable.dirty.ratio", "0.1"))]
        futures = admin.incremental_alter_configs([ConfigResource(ResourceType.TOPIC, t, incremental_configs=entries)
                                                   for t in topics])
        for future in futures.values():
            future.result(timeout=30)

    def start_daemons(self) -> None:
        self.daemons.start("ticker", "ticker", "--interval", "0.2")
        self.daemons.start("maint", "maint", "--interval", "5")
        for name, args in self.consume_args().items():
            extra = ("--vacuum-every", "1min") if name == "delta" else ()
            self.daemons.start(name, *args, *extra, "--metrics-port", str(self.ports[name]))
        self.wait_ready()

    def wait_ready(self) -> None:
        """Until every consumer reports its lag (connected, its position read): the writes start then."""
        deadline = time.monotonic() + READY_TIMEOUT
        while any(scrape_lag(port) is None for port in self.ports.values()):
            self.daemons.check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"a consumer reported no lag in {READY_TIMEOUT:.0f}s")
            time.sleep(0.5)   # polling interval

    def run(self) -> None:
        """The writes for --minutes, a sample every --sample-every seconds (the first at the start)."""
        writer = Writer(self.dsn, self.args.rate)
        watch = Watch(self.ports, self.kafka.directory / "data")
        watch.start()
        writer.start()
        started = time.monotonic()
        end = started + self.args.minutes * 60
        try:
            with psycopg.connect(self.dsn, autocommit=True) as monitor:
                while True:
                    now = time.monotonic()
                    self.samples.append(self.sample(monitor, now - started, writer, watch))
                    self.check(writer, watch)
                    self.show(self.samples[-1])
                    following = started + len(self.samples) * self.args.sample_every
                    if following > end + 1e-6:
                        break
                    time.sleep(max(0.0, following - time.monotonic()))   # pacing, not synchronisation
        finally:
            writer.stop()
            watch.stop()
        self.check(writer, watch)
        self.written = writer.changes

    def check(self, writer: Writer, watch: Watch) -> None:
        if writer.error is not None:
            raise RuntimeError(f"the writer failed: {writer.error}")
        if watch.error is not None:
            raise RuntimeError(f"reading the lags and the topics failed: {watch.error!r}")
        self.daemons.check()

    def sample(self, monitor: psycopg.Connection[Any], seconds: float, writer: Writer, watch: Watch) -> Sample:
        rss = {name: rss_bytes(self.daemons.running[name].pid) for name in DAEMONS}
        queue = monitor.execute(QUEUE_BYTES, (QUEUE,)).fetchone()
        assert queue is not None   # the queue exists
        named, unnamed = delta_bytes(self.warehouse)
        lags, topics = watch.take()
        sizes = {"queue": int(queue[0]),
                 "delta files": named,
                 "delta unnamed": unnamed,
                 "delta logs": tree_bytes(self.warehouse, lambda p: "_delta_log" in p.parts),
                 "sqlite": sqlite_bytes(self.sqlite),
                 "follower sqlite": sqlite_bytes(self.follower),
                 "kafka topics": kafka_bytes(self.kafka.directory / "data") if topics is None else topics}
        return Sample(round(seconds, 1), writer.changes, rss, sizes, lags)

    def show(self, s: Sample) -> None:
        rss = " ".join(f"{name} {b / 2**20:.0f}" for name, b in s.rss.items())
        sizes = " ".join(f"{name} {b / 2**20:.1f}" for name, b in s.sizes.items())
        lag = " ".join(f"{name} {v:.1f}" for name, v in s.lag.items())
        console.print(f"{s.seconds:6.0f}s {s.written:>10,} written | RSS MB {rss} | MB {sizes} | lag s {lag}")

    # the end -------------------------------------------------------------------------------

    def drain(self) -> None:
        """Every consumer up to a tick taken after the last write; then the daemons stopped."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            last = forced_tick(conn)
            deadline = time.monotonic() + DRAIN_TIMEOUT
            while True:
                behind = self.behind(conn, last)
                if not behind:
                    break
                self.daemons.check()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"not caught up {DRAIN_TIMEOUT:.0f}s after the writes: {', '.join(behind)}")
                time.sleep(0.5)   # polling interval
        self.daemons.stop_all()

    def behind(self, conn: psycopg.Connection[Any], tick: int) -> list[str]:
        """The consumers short of tick: the source's consumers by their positions, the follower by
        the publisher's tick it holds."""
        short = [name for name, at in conn.execute(
            "SELECT c.consumer_name, c.last_tick FROM replicator.consumer c JOIN replicator.queue q USING (queue_id)"
            " WHERE q.queue_name = %s", (QUEUE,)).fetchall() if at < tick]
        with sqlite3.connect(f"file:{self.follower}?mode=ro", uri=True, timeout=30) as lite:
            row = lite.execute("SELECT last_tick FROM _replicator_position WHERE queue = ? AND consumer = 'tick'",
                               (f"kafka:{PREFIX}",)).fetchone()
        lite.close()
        if row is None or row[0] < tick:
            short.append("follower")
        return short

    def compare(self) -> dict[str, list[str]]:
        """Each replica's tables that differ from the source's (sorted rows)."""
        with psycopg.connect(self.dsn) as conn:
            source = {t: sorted(conn.execute(f"SELECT id, n, v FROM {t}").fetchall()) for t in TABLES}
        uris = table_uris(f"delta:{self.warehouse}")
        replicas: dict[str, Callable[[str], list[tuple[Any, ...]]]] = {
            "sqlite": lambda t: sqlite_rows(self.sqlite, t),
            "delta": lambda t: delta_rows(uris[f"public.{t}"]),
            "follower": lambda t: sqlite_rows(self.follower, t)}
        return {name: [t for t in TABLES if read(t) != source[t]] for name, read in replicas.items()}


def forced_tick(conn: psycopg.Connection[Any]) -> int:
    """A tick after every write: a forced tick is skipped (NULL) while the ticker holds the queue."""
    while True:
        row = conn.execute("SELECT replicator.ticker(%s, true)", (QUEUE,)).fetchone()
        if row is not None and row[0] is not None:
            return int(row[0])
        time.sleep(0.1)   # the ticker's pass is short


def sqlite_rows(path: Path, table: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as lite:
        rows = sorted(lite.execute(f"SELECT id, n, v FROM {table}").fetchall())
    lite.close()
    return rows


def delta_rows(uri: str) -> list[tuple[Any, ...]]:
    data = pa.table(DeltaTable(uri).scan().read_all()).select(["id", "n", "v"])   # arro3 → pyarrow
    return sorted(tuple(row.values()) for row in data.to_pylist())


# judging ---------------------------------------------------------------------------------


@dataclass
class Trend:
    series: str
    mean: float
    slope_per_hour: float          # of the least-squares line, in the series' unit
    stderr_per_hour: float
    growth_per_hour: float         # the slope over an hour, percent of the mean
    flat: bool


def trend(name: str, times: Sequence[float], values: Sequence[float], sigmas: float, max_growth: float) -> Trend:
    """The least-squares line through (times, values): flat unless its slope is both above sigmas
    standard errors and, over an hour, above max_growth percent of the mean."""
    n = len(times)
    mean_t, mean_v = sum(times) / n, sum(values) / n
    sxx = sum((t - mean_t) ** 2 for t in times)
    slope = sum((t - mean_t) * (v - mean_v) for t, v in zip(times, values)) / sxx
    residuals = sum((v - mean_v - slope * (t - mean_t)) ** 2 for t, v in zip(times, values))
    stderr = math.sqrt(residuals / (n - 2) / sxx)
    growth = 100 * slope * 3600 / mean_v if mean_v else 0.0
    grows = slope > sigmas * stderr and growth > max_growth
    return Trend(name, mean_v, slope * 3600, stderr * 3600, growth, not grows)


def judge(samples: Sequence[Sample], args: argparse.Namespace) -> list[Trend]:
    """Every RSS and every size, from the warm-up on."""
    series = {f"RSS {name}": [float(s.rss[name]) for s in samples] for name in DAEMONS}
    series |= {name: [float(s.sizes[name]) for s in samples] for name in samples[0].sizes}
    judged = [i for i, s in enumerate(samples) if s.seconds >= args.warmup_seconds]
    times = [samples[i].seconds for i in judged]
    return [trend(name, times, [values[i] for i in judged], args.sigmas, args.max_growth)
            for name, values in series.items()]


def worst_lags(samples: Sequence[Sample]) -> dict[str, float]:
    return {name: max((s.lag.get(name, 0.0) for s in samples), default=0.0) for name in CONSUMERS}


# the report ------------------------------------------------------------------------------


def write_report(directory: Path, samples: Sequence[Sample], trends: Sequence[Trend], summary: dict[str, Any],
                 args: argparse.Namespace) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "soak.json").write_text(json.dumps({**summary, "samples": [asdict(s) for s in samples],
                                                     "trends": [asdict(t) for t in trends]}, indent=2) + "\n")
    with open(directory / "samples.csv", "w", newline="") as out:
        writer = csv.writer(out)
        columns = [f"rss {n}" for n in DAEMONS] + list(samples[0].sizes) + [f"lag {n}" for n in CONSUMERS]
        writer.writerow(["seconds", "written", *columns])
        for s in samples:
            writer.writerow([s.seconds, s.written, *(s.rss[n] for n in DAEMONS), *s.sizes.values(),
                             *(s.lag.get(n, "") for n in CONSUMERS)])
    times = [s.seconds / 60 for s in samples]
    plot(directory / "rss.png", "RSS of each daemon", "MB", times,
         {n: [s.rss[n] / 2**20 for s in samples] for n in DAEMONS}, args)
    plot(directory / "queue.png", "The queue on the source (event partitions, ticks)", "MB", times,
         {"queue": [s.sizes["queue"] / 2**20 for s in samples]}, args)
    plot(directory / "storage.png", "Replicas and topics on disk", "MB", times,
         {n: [s.sizes[n] / 2**20 for s in samples] for n in samples[0].sizes if n != "queue"}, args)
    plot(directory / "lag.png", f"Highest lag between samples (goal ≤ {args.max_lag:g} s)", "seconds", times,
         {n: [s.lag.get(n, math.nan) for s in samples] for n in CONSUMERS}, args)


def plot(path: Path, title: str, unit: str, minutes: Sequence[float], lines: dict[str, list[float]],
         args: argparse.Namespace) -> None:
    figure, axes = plt.subplots(figsize=(9, 4.5))
    for name, values in lines.items():
        axes.plot(minutes, values, marker=".", label=name)
    axes.axvline(args.warmup_seconds / 60, color="grey", linestyle=":", label="warm-up ends")
    axes.set(title=title, xlabel="minutes of writes", ylabel=unit)
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def print_report(trends: Sequence[Trend], lags: dict[str, float], differing: dict[str, list[str]],
                 args: argparse.Namespace, rate: float) -> None:
    table = Table(title=f"Soak: {args.minutes:g} min at {rate:,.0f} row changes/s (asked {args.rate:,.0f}), "
                        f"judged after {args.warmup_seconds / 60:.1f} min")
    for column in ("series", "mean", "slope / h", "± s.e. / h", "growth / h", "flat"):
        table.add_column(column, justify="left" if column == "series" else "right")
    for t in trends:
        table.add_row(t.series, f"{t.mean / 2**20:.1f} MB", f"{t.slope_per_hour / 2**20:+.2f} MB",
                      f"{t.stderr_per_hour / 2**20:.2f} MB", f"{t.growth_per_hour:+.1f}%",
                      yes(t.flat))
    for name, lag in lags.items():
        table.add_row(f"lag {name}", "", "", "", f"max {lag:.1f} s", yes(lag <= args.max_lag))
    for name, tables in differing.items():
        table.add_row(f"replica {name}", "", "", "", "equal" if not tables else "differs: " + ", ".join(tables),
                      yes(not tables))
    console.print(table)
    console.print(f"Flat: after the warm-up, not (slope > {args.sigmas:g} standard errors and growth over an hour "
                  f"> {args.max_growth:g}% of the mean). Load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} "
                  f"CPUs at the end.")


def yes(ok: bool) -> str:
    return "yes" if ok else "[red]NO[/]"


# main ------------------------------------------------------------------------------------


def _interrupt(signum: int, frame: object) -> NoReturn:
    raise KeyboardInterrupt


def soak(args: argparse.Namespace, workdir: Path) -> int:
    logs = workdir / "logs"
    logs.mkdir()
    # the daemons run the replicator package this soak imports, wherever it is installed from
    env = {**os.environ, "PYTHONPATH": str(Path(replicator.__file__).parents[1]), "PYTHONUNBUFFERED": "1"}
    with PgServer() as server:
        env["REPLICATOR_DSN"] = server.dsn
        console.print("starting a Kafka broker")
        with KafkaServer() as kafka:
            daemons = Daemons(logs, env)
            run = Soak(args, workdir, server, kafka, daemons)
            try:
                run.setup()
                run.start_daemons()
                console.print(f"writing {args.rate:,.0f} row changes/s for {args.minutes:g} min")
                run.run()
                run.drain()
            finally:
                daemons.stop_all()
            differing = run.compare()
    samples = run.samples
    trends = judge(samples, args)
    lags = worst_lags(samples)
    rate = run.written / (args.minutes * 60)
    ok = (all(t.flat for t in trends) and all(v <= args.max_lag for v in lags.values())
          and not any(differing.values()))
    summary = {"ok": ok, "rate": args.rate, "written_rate": rate, "minutes": args.minutes,
               "sample_every": args.sample_every, "warmup_seconds": args.warmup_seconds,
               "sigmas": args.sigmas, "max_growth": args.max_growth,
               "max_lag": args.max_lag, "rotation_period": args.rotation_period, "retention": args.retention,
               "worst_lags": lags, "differing": differing, "cpus": os.cpu_count()}
    write_report(args.report, samples, trends, summary, args)
    print_report(trends, lags, differing, args, rate)
    console.print(f"report: {args.report}")
    return 0 if ok else 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60, help="minutes of writes (default 60)")
    parser.add_argument("--report", type=Path, required=True, help="directory for the samples and the plots")
    parser.add_argument("--rate", type=float, default=2000, help="row changes written per second (default 2000)")
    parser.add_argument("--sample-every", type=float, default=60,
                        help="seconds between samples, and the topics' segment.ms (default 60)")
    parser.add_argument("--warmup", type=float,
                        help="minutes not judged (default: the first third, at least the queue's rotation "
                             "through its tables and the retention with a vacuum interval)")
    parser.add_argument("--rotation-period", help="the queue's rotation period (default: a twelfth of the run, "
                                                  "at least 10s: 5min for an hour)")
    parser.add_argument("--queue-tables", type=int, default=3, help="the queue's event tables (default 3)")
    parser.add_argument("--retention",
                        help="the Delta tables' file and log retention, the topics' delete.retention.ms "
                             "(default: a thirtieth of the run, at least 10s: 2min for an hour)")
    parser.add_argument("--sigmas", type=float, default=3, help="a slope is significant above this many "
                                                                "standard errors (default 3)")
    parser.add_argument("--max-growth", type=float, default=10,
                        help="a significant slope fails above this growth over an hour, percent of the "
                             "mean (default 10)")
    parser.add_argument("--max-lag", type=float, default=5, help="the lag goal, seconds (default 5)")
    parser.add_argument("--keep", action="store_true", help="keep the replicas and logs (their directory is printed)")
    args = parser.parse_args(argv)
    for name in ("minutes", "rate", "sample_every"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be more than 0")
    run = args.minutes * 60
    args.rotation_period = args.rotation_period or f"{max(10, round(run / 12))}s"
    args.retention = args.retention or f"{max(10, round(run / 30))}s"
    rotation = parse_duration(args.rotation_period).total_seconds()
    retention = parse_duration(args.retention).total_seconds()
    cycle = max(args.queue_tables * rotation, retention + VACUUM_EVERY)   # every size's cleanup under way
    args.warmup_seconds = max(run / 3, cycle) if args.warmup is None else args.warmup * 60
    if (args.minutes * 60 - args.warmup_seconds) / args.sample_every < 3:
        parser.error(f"fewer than 3 samples after the warm-up ({args.warmup_seconds:.0f}s): a longer run or more "
                     f"frequent samples")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)   # SIGTERM cleans up as Ctrl-C does
    workdir = Path(tempfile.mkdtemp(prefix="replicator-soak-"))
    workdir.chmod(0o755)
    if args.keep:
        console.print(f"replicas and logs in {workdir}")
    try:
        return soak(args, workdir)
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
