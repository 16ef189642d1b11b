"""The consumer benchmark: apply throughput into SQLite and end-to-end latency.

Run it through ``bin/bench-apply``. One run, on a throwaway cluster:

1. Throughput. A cache-like workload (multi-row inserts, single-row inserts,
   single- and multi-row updates, single- and multi-row deletes, interleaved,
   a few statements per transaction) is written to one table captured by two
   queues, one in full mode and one in pk mode, so both queues hold the same
   row changes. Then, side by side:

   a. raw bound: the same batches fetched with the batch query and
      ``json.loads`` + ``executemany``'d into a plain SQLite table, with none of
      replicator's logic (no decoding, no position, no table state);
   b. ``Consumer.run(until_caught_up=True)`` in full mode into a fresh SQLite file;
   c. the same in pk mode (join-back included).

   Throughput is row changes per second (an event row of the queue carries one
   statement's changes, up to 1000 rows).

2. Latency. A writer commits single-row INSERTs at a steady rate; the real
   daemons run as subprocesses (``replicator ticker`` at a fast interval with
   the queue's ticker_max_lag lowered, ``replicator consume`` polling); a
   reader polls the SQLite file and records when each row becomes visible.
   Latency is commit (client side, after COMMIT returned) to visible in SQLite.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import multiprocessing
import os
import platform
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from rich.console import Console
from rich.table import Table

from pgserver import PgServer
from replicator import consumer as consumer_mod
from replicator.consumer import Consumer
from replicator.source import Source
from replicator.source.install import install
from replicator.targets.sqlite import target as sqlite_target
from replicator.targets.sqlite.target import SqliteTarget

console = Console()
if not console.is_terminal:
    console.width = 120
REPLICATOR = str(Path(sys.executable).with_name("replicator"))

SCHEMA = """
CREATE TABLE cache_item (
    id          bigint PRIMARY KEY,
    cache_key   text NOT NULL,
    value       text,
    hits        integer NOT NULL DEFAULT 0,
    score       double precision,
    active      boolean NOT NULL DEFAULT true,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- One round: about 10,000 row changes in about 4,000 statements and 1,000
-- transactions, the kinds interleaved as a cache's writers would.
CREATE PROCEDURE bench_round(p_first bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_next bigint := p_first;
    v_id bigint;
    i integer;
    k integer;
BEGIN
    FOR i IN 1..1000 LOOP
        IF i % 25 = 1 THEN
            -- cache fill: a 100-row INSERT (40 per round)
            INSERT INTO cache_item (id, cache_key, value, hits, score, updated_at)
            SELECT g, 'key:' || g, md5(g::text) || md5((g + 1)::text), 0, g / 7.0, clock_timestamp()
            FROM generate_series(v_next, v_next + 99) g;
            v_next := v_next + 100;
        END IF;
        -- a single-row INSERT
        INSERT INTO cache_item (id, cache_key, value, score, updated_at)
        VALUES (v_next, 'key:' || v_next, md5(v_next::text), random(), clock_timestamp());
        v_next := v_next + 1;
        -- two or three single-row UPDATEs of random entries
        FOR k IN 1..(2 + i % 2) LOOP
            v_id := 1 + floor(random() * (v_next - 1))::bigint;
            UPDATE cache_item SET hits = hits + 1, score = random(), updated_at = clock_timestamp()
            WHERE id = v_id;
        END LOOP;
        IF i % 50 = 0 THEN
            -- a 100-row UPDATE (20 per round)
            v_id := 1 + floor(random() * greatest(v_next - 100, 1))::bigint;
            UPDATE cache_item SET hits = hits + 1, active = NOT active, updated_at = clock_timestamp()
            WHERE id >= v_id AND id < v_id + 100;
        END IF;
        IF i % 5 < 2 THEN
            -- a single-row DELETE (400 per round)
            v_id := 1 + floor(random() * (v_next - 1))::bigint;
            DELETE FROM cache_item WHERE id = v_id;
        END IF;
        IF i = 500 THEN
            -- expiry: a 100-row DELETE
            v_id := 1 + floor(random() * greatest(v_next - 100, 1))::bigint;
            DELETE FROM cache_item WHERE id >= v_id AND id < v_id + 100;
        END IF;
        COMMIT;
    END LOOP;
END;
$$;

CREATE TABLE latency_item (
    id          bigint PRIMARY KEY,
    payload     text NOT NULL,
    written_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""

T = TypeVar("T")

ROUND_IDS = 5000        # new ids per round
ROUND_ROWS = 10000      # about this many row changes per round


@dataclass
class Result:
    name: str
    rows: int
    events: int
    seconds: float
    cpu: float
    server: float

    @property
    def rate(self) -> float:
        return self.rows / self.seconds if self.seconds else 0.0


# setup and load ---------------------------------------------------------------------------


def setup(dsn: str, sqlite_dir: Path) -> int:
    """Schema, queues and consumers, before anything is written: the raw
    consumer is registered and each mode's seed replica holds its initial
    copy (of the still-empty table). Returns the tick all of them start from."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        install(conn)
        conn.execute(SCHEMA)
    with Source.connect(dsn) as src:
        for queue, table, mode in (("bench_full", "cache_item", "full"), ("bench_pk", "cache_item", "pk"),
                                   ("bench_lat", "latency_item", "full")):
            src.create_queue(queue)
            src.add_table(queue, table, mode=mode)
            src.tick(queue, force=True)
        start = src.register_consumer("bench_full", "raw")
    for queue in ("bench_full", "bench_pk"):
        c = Consumer(dsn, queue, SqliteTarget(sqlite_dir / f"seed_{queue}.db"), name=f"{queue}_sqlite")
        c.connect()
        c.sync_tables()
        position = c.target.positions(queue).get(c.name)
        c.close()
        c.target.close()
        assert position == start, (position, start)
    return start


def fresh_replica(dsn: str, sqlite_dir: Path, queue: str, path: Path) -> Consumer:
    """A replica as its seed was left (empty table, position at the start
    tick), connected: the consumer resumes from there."""
    shutil.copyfile(sqlite_dir / f"seed_{queue}.db", path)
    c = Consumer(dsn, queue, SqliteTarget(path), name=f"{queue}_sqlite")
    c.connect()
    return c


def load(dsn: str, rows: int) -> None:
    rounds = max(1, round(rows / ROUND_ROWS))
    with psycopg.connect(dsn, autocommit=True) as conn, Source(conn) as src:
        conn.execute("SELECT setseed(0.42)")
        started = time.monotonic()
        for r in range(rounds):
            conn.execute("CALL bench_round(%s)", (r * ROUND_IDS + 1,))
            src.tick("bench_full", force=True)
            src.tick("bench_pk", force=True)
            console.print(f"  loading: round {r + 1}/{rounds}, {time.monotonic() - started:.0f}s", end="\r")
        console.print()
        conn.execute("VACUUM ANALYZE")


def queue_size(dsn: str, queue: str) -> tuple[int, int]:
    """(events, row changes) queued in a queue."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        found = conn.execute("SELECT replicator.event_table((replicator.find_queue(%s)).queue_id)",
                             (queue,)).fetchone()
        assert found is not None   # a function call: one row
        size = conn.execute(f"SELECT count(*), coalesce(sum(json_array_length(ev_data::json)), 0)::bigint"
                            f" FROM {found[0]} WHERE ev_data IS NOT NULL").fetchone()
        assert size is not None    # aggregates: one row
        return size[0], size[1]


# (a) the raw bound -------------------------------------------------------------------------


def raw_apply(dsn: str, queue: str, consumer: str, start_tick: int, path: Path) -> tuple[int, int, float]:
    """The raw bound: every batch fetched as replicator fetches it
    (Source.batch_events: the batch query through a server-side cursor), each
    event json.loads'ed and its items executemany'd as they are into a plain
    SQLite table with the target's pragmas: no decoding, no table state, no
    position. Returns (events, row changes, server CPU seconds)."""
    lite = sqlite3.connect(path, isolation_level=None)
    for pragma in getattr(sqlite_target, "PRAGMAS", ("journal_mode = WAL", "synchronous = NORMAL")):
        lite.execute(f"PRAGMA {pragma}")
    lite.execute("CREATE TABLE cache_item (id INTEGER, cache_key TEXT, value TEXT, hits INTEGER, score REAL,"
                 " active INTEGER, updated_at TEXT, PRIMARY KEY (id))")
    upsert = "INSERT OR REPLACE INTO cache_item VALUES (?, ?, ?, ?, ?, ?, ?)"
    delete = "DELETE FROM cache_item WHERE id = ?"
    events = rows = 0
    rows_per_event = 1000.0  # batches sized as the consumer sizes them
    loads = json.loads
    with Source.connect(dsn) as src:
        server = backend_cpu(src.conn.info.backend_pid)
        src.set_consumer_position(queue, consumer, start_tick)
        src.tick(queue, force=True)
        while True:
            limit = getattr(consumer_mod, "batch_event_limit", lambda m, _: m)(consumer_mod.MAX_BATCH_EVENTS,
                                                                               rows_per_event)
            batch = src.next_batch(queue, consumer, limit)
            if batch is None:
                break
            batch_events = batch_rows = 0
            lite.execute("BEGIN")
            for _id, _txid, _time, ev_type, _table, data, _old in src.batch_events(batch):
                assert data is not None   # only T events have none: the workload truncates nothing
                items = loads(data)
                lite.executemany(delete if ev_type == "D" else upsert, items)
                batch_events += 1
                batch_rows += len(items)
            lite.execute("COMMIT")
            events += batch_events
            rows += batch_rows
            if batch_events:
                rows_per_event = max(1.0, batch_rows / batch_events, rows_per_event / 2)
            src.finish_batch(batch)
        server = backend_cpu(src.conn.info.backend_pid) - server
    lite.close()
    return events, rows, server


def backend_cpu(pid: int) -> float:
    """CPU seconds a local PostgreSQL backend has used (utime + stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(fn: Callable[[], T], profile: Path | None = None) -> tuple[T, float, float]:
    prof = cProfile.Profile() if profile else None
    started, cpu = time.perf_counter(), time.process_time()
    if prof:
        prof.enable()
    value = fn()
    if prof:
        prof.disable()
        prof.dump_stats(str(profile))
    return value, time.perf_counter() - started, time.process_time() - cpu


def sqlite_count(path: Path, table: str) -> int:
    with sqlite3.connect(path) as lite:
        count: int = lite.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
        return count


# latency -----------------------------------------------------------------------------------


def _writer(dsn: str, rate: float, seconds: float, out: Any) -> None:
    """Single-row INSERTs, one transaction each, at a steady rate; sends the
    client-side commit time of each id."""
    n = int(rate * seconds)
    times = [0.0] * n
    with psycopg.connect(dsn, autocommit=True) as conn:
        payload = "x" * 64
        started = time.monotonic()
        for i in range(n):
            due = started + i / rate
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            conn.execute("INSERT INTO latency_item (id, payload) VALUES (%s, %s)", (i + 1, payload))
            times[i] = time.time()
    out.send(times)
    out.close()


def latency(dsn: str, sqlite_path: Path, *, rate: float, seconds: float, tick_interval: float,
            ticker_max_lag: str, poll_interval: float, reader_interval: float) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE replicator.queue SET queue_ticker_max_lag = %s::interval WHERE queue_name = 'bench_lat'",
                     (ticker_max_lag,))
    env = {**os.environ, "REPLICATOR_DSN": dsn}
    with open(sqlite_path.with_suffix(".log"), "w") as log:   # the daemons write to their own copies of it
        procs = [subprocess.Popen([REPLICATOR, "consume", "bench_lat", "--target", f"sqlite:{sqlite_path}",
                                   "--poll-interval", str(poll_interval)], env=env, stderr=log),
                 subprocess.Popen([REPLICATOR, "ticker", "--interval", str(tick_interval)], env=env, stderr=log)]
    try:
        deadline = time.monotonic() + 60
        while True:  # the consumer has copied the (empty) table
            try:
                with sqlite3.connect(sqlite_path) as lite:
                    lite.execute("SELECT 1 FROM latency_item LIMIT 1").fetchall()
                break
            except sqlite3.Error:
                if time.monotonic() > deadline:
                    raise RuntimeError("the consumer did not start") from None
                time.sleep(0.05)
        n = int(rate * seconds)
        seen = [0.0] * (n + 1)
        receive, send = multiprocessing.Pipe(duplex=False)
        writer = multiprocessing.get_context("spawn").Process(target=_writer, args=(dsn, rate, seconds, send))
        writer.start()
        lite = sqlite3.connect(sqlite_path, isolation_level=None)
        last = 0
        deadline = time.monotonic() + seconds + 60
        while last < n and time.monotonic() < deadline:
            rows = lite.execute("SELECT id FROM latency_item WHERE id > ? ORDER BY id", (last,)).fetchall()
            if rows:
                now = time.time()
                for (i,) in rows:
                    seen[i] = now
                last = rows[-1][0]
            time.sleep(reader_interval)
        lite.close()
        commits = receive.recv()
        writer.join()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
    if last < n:
        raise RuntimeError(f"only {last} of {n} rows reached SQLite")
    warmup = int(rate)  # the first second
    lat = sorted((seen[i + 1] - commits[i]) * 1000 for i in range(warmup, n))
    achieved = (n - 1) / (commits[-1] - commits[0])
    return {"rows": len(lat), "rate": achieved, "p50": pct(lat, 50), "p90": pct(lat, 90), "p99": pct(lat, 99),
            "max": lat[-1], "mean": statistics.fmean(lat)}


def pct(values: list[float], p: float) -> float:
    return values[min(len(values) - 1, max(0, round(p / 100 * len(values)) - 1))]


# main --------------------------------------------------------------------------------------


def throughput(args: argparse.Namespace, figures: dict[str, Any], dsn: str, workdir: Path, start: int) -> None:
    console.print(f"[bold]loading ~{args.rows:,} row changes[/] (each queued in a full-mode and a pk-mode queue)")
    t0 = time.monotonic()
    load(dsn, args.rows)
    figures["load_seconds"] = time.monotonic() - t0
    events, rows = queue_size(dsn, "bench_full")
    console.print(f"  queued {rows:,} row changes in {events:,} events per queue")
    with psycopg.connect(dsn) as conn:
        counted = conn.execute("SELECT count(*) FROM cache_item").fetchone()
        assert counted is not None   # an aggregate: one row
        expected = counted[0]

    def profile(name: str, run: int) -> Path | None:
        return args.profile / f"{name}.prof" if args.profile and run == 0 else None

    names = ("(a) raw bound", "(b) replicator, full mode", "(c) replicator, pk mode")
    runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in names}
    load_before = os.getloadavg()[0]
    for run in range(args.repeat):
        path = workdir / f"raw_{run}.db"
        (ev, rw, server), secs, cpu = measure(partial(raw_apply, dsn, "bench_full", "raw", start, path),
                                              profile("raw", run))
        assert (ev, rw) == (events, rows), ((ev, rw), (events, rows))
        runs[names[0]].append((secs, cpu, server))
        counts = {path.name: sqlite_count(path, "cache_item")}
        for name, queue in zip(names[1:], ("bench_full", "bench_pk")):
            path = workdir / f"{queue}_{run}.db"
            c = fresh_replica(dsn, workdir, queue, path)
            assert c.source is not None
            pid = c.source.conn.info.backend_pid
            server = backend_cpu(pid)
            _, secs, cpu = measure(partial(c.run, until_caught_up=True), profile(queue[6:], run))
            server = backend_cpu(pid) - server
            c.close()
            c.target.close()
            runs[name].append((secs, cpu, server))
            counts[path.name] = sqlite_count(path, "cache_item")
        if set(counts.values()) != {expected}:  # every replica agrees with the source
            raise SystemExit(f"replicas disagree with the source ({expected} rows): {counts}")
        console.print(f"  run {run + 1}/{args.repeat}: " + ", ".join(
            f"{name[:3]} {rows / r[-1][0]:,.0f}/s" for name, r in runs.items()))
        for path in workdir.glob(f"*_{run}.db*"):
            path.unlink()

    load_after = os.getloadavg()[0]
    results = [Result(name, rows, events, statistics.median(x[0] for x in r), statistics.median(x[1] for x in r),
                      statistics.median(x[2] for x in r)) for name, r in runs.items()]
    raw = results[0].rate
    table = Table(title=f"Apply throughput into SQLite: {rows:,} row changes in {events:,} events "
                        f"({rows / events:.1f} rows/event), median of {args.repeat} runs")
    for col in ("apply", "seconds", "row changes/s", "events/s", "vs raw", "client CPU s", "server CPU s"):
        table.add_column(col, justify="left" if col == "apply" else "right")
    for r in results:
        table.add_row(r.name, f"{r.seconds:.2f}", f"{r.rate:,.0f}", f"{r.events / r.seconds:,.0f}",
                      f"{r.rate / raw:.0%}", f"{r.cpu:.2f}", f"{r.server:.2f}")
    console.print(table)
    console.print("row changes: rows inserted, updated or deleted; an event is one queue row (one statement's "
                  "changes, up to 1000 rows). client CPU: this process; server CPU: its PostgreSQL backend. "
                  f"Load average {load_before:.1f} before, {load_after:.1f} after, on {os.cpu_count()} CPUs.")
    figures["throughput"] = {"rows": rows, "events": events, "repeat": args.repeat,
                             "loadavg": [load_before, load_after], "results": [
        {"name": r.name, "seconds": r.seconds, "rows_per_s": r.rate, "events_per_s": r.events / r.seconds,
         "vs_raw": r.rate / raw, "client_cpu": r.cpu, "server_cpu": r.server, "runs": runs[r.name]}
        for r in results]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-apply", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="row changes to queue (default 1,000,000)")
    parser.add_argument("--rate", type=float, default=2000, help="latency: writes per second (default 2000)")
    parser.add_argument("--seconds", type=float, default=20, help="latency: seconds of steady writes (default 20)")
    parser.add_argument("--tick-interval", type=float, default=0.05, help="latency: ticker interval (default 0.05)")
    parser.add_argument("--ticker-max-lag", default="20ms", help="latency: the queue's ticker_max_lag (default 20ms)")
    parser.add_argument("--poll-interval", type=float, default=0.02,
                        help="latency: the consumer's --poll-interval (default 0.02)")
    parser.add_argument("--reader-interval", type=float, default=0.002,
                        help="latency: the reader's SQLite polling interval (default 0.002)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="throughput: runs of each apply over the same queue, the median is reported (default 3)")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--profile", type=Path,
                        help="write cProfile stats of each apply's first run to DIR/{raw,full,pk}.prof "
                             "(slows that run)")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    parser.add_argument("--keep", action="store_true", help="keep the SQLite files (their directory is printed)")
    args = parser.parse_args(argv)

    figures: dict[str, Any] = {"rows_requested": args.rows, "python": platform.python_version(),
                               "sqlite": sqlite3.sqlite_version, "cpus": os.cpu_count()}
    workdir = Path(tempfile.mkdtemp(prefix="replicator-bench-apply-"))
    if args.keep:
        console.print(f"SQLite files in {workdir}")
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    try:
        _run(args, figures, workdir)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


def _run(args: argparse.Namespace, figures: dict[str, Any], workdir: Path) -> None:
    with PgServer() as server:
        dsn = server.dsn
        with psycopg.connect(dsn, autocommit=True) as conn:
            version = conn.execute("SHOW server_version").fetchone()
            assert version is not None   # SHOW: one row
            figures["postgres"] = version[0]
        start = setup(dsn, workdir)
        if not args.skip_throughput:
            throughput(args, figures, dsn, workdir, start)
        if not args.skip_latency:
            console.print(f"[bold]latency[/]: {args.rate:,.0f} single-row writes/s for {args.seconds:.0f}s, "
                          f"ticker every {args.tick_interval}s (ticker_max_lag {args.ticker_max_lag}), "
                          f"consumer polling every {args.poll_interval}s")
            lat = latency(dsn, workdir / "latency.db", rate=args.rate, seconds=args.seconds,
                          tick_interval=args.tick_interval, ticker_max_lag=args.ticker_max_lag,
                          poll_interval=args.poll_interval, reader_interval=args.reader_interval)
            table = Table(title="End-to-end latency: commit in PostgreSQL → visible in SQLite")
            for col in ("writes", "achieved writes/s", "p50 ms", "p90 ms", "p99 ms", "max ms"):
                table.add_column(col, justify="right")
            table.add_row(f"{lat['rows']:,}", f"{lat['rate']:,.0f}", f"{lat['p50']:.0f}", f"{lat['p90']:.0f}",
                          f"{lat['p99']:.0f}", f"{lat['max']:.0f}")
            console.print(table)
            figures["latency"] = {**lat, "tick_interval": args.tick_interval, "ticker_max_lag": args.ticker_max_lag,
                                  "poll_interval": args.poll_interval}


if __name__ == "__main__":
    sys.exit(main())
