"""The scale benchmark (issue 31): what N captured tables cost, for N in --tables (10, 100, 1000).

Run it through ``bin/bench-scale``. One throwaway PostgreSQL cluster, a database per N, each with N
tables ``scale.tNNNNN (id int PRIMARY KEY, v text)`` of ROWS rows, captured by one queue as a user would,
through the ``replicator`` console script (subprocesses, timed from start to exit) or the library call a
command is a skin over (timed in this process):

    install             ``replicator install`` (before the tables are captured)
    table add           ``replicator table add scale --schema scale``: the N tables at once
    ticker --once       ``replicator ticker --once`` (one forced tick of every queue)
    ticker pass         ``Source.tick()``, the ticker daemon's pass, nothing due, tables idle; and the
                        transaction ids and WAL bytes a pass uses (a ticker passes every second);
                        and the pass without event triggers (disabled: a managed service's install)
    forced tick         ``Source.tick(queue, force=True)``, tables idle / with events in min(100, N) tables
    status              ``replicator status``, and the library call it prints (``status.status``)
    initial copy        ``replicator consume scale --target sqlite:... --until-caught-up`` into a new file;
                        its max RSS and the transaction ids it used
    consumer start      ``replicator consume ... --once`` on that file, a batch of one update waiting:
                        process start to the batch applied (and the process gone); its max RSS
    batch               a running consumer (``Consumer.step()``, in this process, warm) applying the
                        batch of one transaction that updates a row in each of min(100, N) tables, and
                        one that updates one table: the batch's time as step() measures it
    Kafka (--kafka)     ``replicator consume scale --target kafka://...`` (the publisher's initial copy,
                        until caught up), then a follower's bootstrap from the topics into a new SQLite
                        file, ``consume --source kafka://... --until-caught-up``, and its max RSS

Each timing is the median of --repeat runs (install, table add, the copies: once). Every replica is
checked (its tables, and the last update). ``--source-only 10000`` measures the source side alone
(install, table add, ticks, status) at that size.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo
from rich.console import Console
from rich.table import Table

import replicator
from kafkaserver import KafkaServer
from pgserver import PgServer
from replicator.consumer import Consumer
from replicator.source import Source, status
from replicator.targets.sqlite.target import SqliteTarget

console = Console()
if not console.is_terminal:
    console.width = 140
REPLICATOR = str(Path(sys.executable).with_name("replicator"))
QUEUE = "scale"
SCHEMA = "scale"
ROWS = 3                  # rows per table
TOUCHED = 100             # tables a "wide" batch updates (at most N)
TOUCHED_LABEL = f"min({TOUCHED}, N) tables"
CREATE_CHUNK = 500        # tables created per transaction (lock table)
START_GOAL = 10.0         # seconds: consumer start at 1,000 tables (issue 31)
FLAT = 1.5                # a measure is "flat" in N where 10x the tables cost at most this many times more
SLACK = 1.1               # worse than linear: N times the tables cost more than SLACK * N times as much

# Set up per N ---------------------------------------------------------------------------


def create_tables(dsn: str, n: int) -> None:
    """N tables of ROWS rows, CREATE_CHUNK a transaction (each holds locks until its commit)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {SCHEMA}")
        for first in range(1, n + 1, CREATE_CHUNK):
            last = min(n, first + CREATE_CHUNK - 1)
            conn.execute(sql.SQL("""
                DO $$ BEGIN
                  FOR i IN {first}..{last} LOOP
                    EXECUTE format('CREATE TABLE {schema}.t%s (id int PRIMARY KEY, v text)', lpad(i::text, 5, '0'));
                    EXECUTE format('INSERT INTO {schema}.t%s SELECT g, md5(g::text) FROM generate_series(1, {rows}) g',
                                   lpad(i::text, 5, '0'));
                  END LOOP;
                END $$""").format(first=first, last=last, schema=sql.SQL(SCHEMA), rows=ROWS))
        # One transaction updating a row in each of the first p_count tables: a batch touching that many.
        conn.execute(sql.SQL("""
            CREATE PROCEDURE public.touch(p_count int, p_round int) LANGUAGE plpgsql AS $$ BEGIN
              FOR i IN 1..p_count LOOP
                EXECUTE format('UPDATE {schema}.t%s SET v = %L WHERE id = 1', lpad(i::text, 5, '0'),
                               'round ' || p_round);
              END LOOP;
            END $$""").format(schema=sql.SQL(SCHEMA)))


# Timing ---------------------------------------------------------------------------------


class Cli:
    """`replicator ARGS` as a user runs it, against one database."""

    def __init__(self, dsn: str, logs: Path) -> None:
        # the subprocesses run the replicator package this benchmark imports, wherever it is installed from
        self.env = {**os.environ, "REPLICATOR_DSN": dsn, "PYTHONPATH": str(Path(replicator.__file__).parents[1])}
        self.logs = logs

    def run(self, *args: str) -> tuple[float, float]:
        """Runs the command to its end: wall-clock seconds and max RSS (MB)."""
        with open(self.logs, "ab") as log:
            log.write(f"$ replicator {' '.join(args)}\n".encode())
            log.flush()
            started = time.perf_counter()
            process = subprocess.Popen([REPLICATOR, *args], env=self.env, stdin=subprocess.DEVNULL,
                                       stdout=log, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(process.pid, 0)
            seconds = time.perf_counter() - started
            process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            raise RuntimeError(f"`replicator {' '.join(args)}` failed ({process.returncode}): see {self.logs}")
        return seconds, usage.ru_maxrss / 1024


def timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def median(runs: int, fn: Callable[[], float]) -> float:
    return statistics.median(fn() for _ in range(runs))


# One size -------------------------------------------------------------------------------


def measure(server: PgServer, n: int, args: argparse.Namespace, workdir: Path, source_only: bool,
            kafka: KafkaServer | None, figures: dict[str, float]) -> None:
    """Every measure at N tables, in a database of its own, into figures as they are taken."""
    db = f"scale_{n}"
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {db}")
    dsn = make_conninfo(server.dsn, dbname=db)
    cli = Cli(dsn, workdir / f"{db}.log")
    console.print(f"[bold]{n:,} tables[/]")
    figures["create tables"] = timed(lambda: create_tables(dsn, n))
    figures["install"] = cli.run("install")[0]
    cli.run("queue", "create", QUEUE)
    figures["table add --schema"] = cli.run("table", "add", QUEUE, "--schema", SCHEMA)[0]
    console.print(f"  created in {figures['create tables']:.1f}s, captured in {figures['table add --schema']:.1f}s")
    touched = min(TOUCHED, n)
    with psycopg.connect(dsn, autocommit=True) as writer, Source.connect(dsn) as src:
        src.tick(QUEUE, force=True)
        figures["ticker --once"] = median(args.repeat, lambda: cli.run("ticker", "--once")[0])
        figures["ticker pass, idle"] = median(args.repeat, lambda: timed(src.tick))
        figures["ticker pass, idle: xids"], figures["ticker pass, idle: WAL bytes"] = ticker_pass_cost(writer, src)
        with without_event_triggers(writer, src):
            figures["ticker pass, idle, no event triggers"] = median(args.repeat, lambda: timed(src.tick))
        figures["forced tick, idle"] = median(args.repeat, lambda: timed(lambda: src.tick(QUEUE, force=True)))
        rounds = iter(range(1, 1_000_000))

        def touch(count: int) -> None:
            writer.execute("CALL public.touch(%s, %s)", (count, next(rounds)))

        def tick_after_touch() -> float:
            touch(touched)
            return timed(lambda: src.tick(QUEUE, force=True))

        figures[f"forced tick, events in {TOUCHED_LABEL}"] = median(args.repeat, tick_after_touch)
        figures["status"] = median(args.repeat, lambda: cli.run("status")[0])
        figures["status, library call"] = median(args.repeat, lambda: timed(lambda: status.status(src)))
        if source_only:
            return

        replica = workdir / f"{db}.db"
        target = ("--target", f"sqlite:{replica}")
        xid = next_xid(writer)
        figures["initial copy"], figures["initial copy RSS MB"] = cli.run("consume", QUEUE, *target,
                                                                          "--until-caught-up")
        figures["initial copy: xids"] = next_xid(writer) - xid - 1
        console.print(f"  initial copy {figures['initial copy']:.1f}s")

        def start() -> tuple[float, float]:
            touch(1)
            src.tick(QUEUE, force=True)
            return cli.run("consume", QUEUE, *target, "--once")

        starts = [start() for _ in range(args.repeat)]
        figures["consumer start"] = statistics.median(s[0] for s in starts)
        figures["consumer start RSS MB"] = statistics.median(s[1] for s in starts)

        consumer = Consumer(dsn, QUEUE, SqliteTarget(replica))
        try:
            consumer.connect()
            consumer.run(until_caught_up=True)   # warm: the tables' state loaded

            def batch(count: int) -> float:
                touch(count)
                src.tick(QUEUE, force=True)
                stats = consumer.step()
                assert stats is not None and stats.rows == count, stats
                return stats.seconds

            figures[f"batch touching {TOUCHED_LABEL}"] = median(args.repeat, lambda: batch(touched))
            figures["batch touching 1 table"] = median(args.repeat, lambda: batch(1))
        finally:
            consumer.close()
            consumer.target.close()
        last = writer.execute(f"SELECT v FROM {SCHEMA}.t00001 WHERE id = 1").fetchone()
    check_replica(replica, n, last)
    if kafka is not None:
        url = f"kafka://{kafka.bootstrap}/{db}"
        figures["Kafka: publisher's initial copy"] = cli.run("consume", QUEUE, "--target", url, "--until-caught-up")[0]
        follower = workdir / f"{db}-follower.db"
        figures["Kafka: follower bootstrap"], figures["Kafka: follower bootstrap RSS MB"] = cli.run(
            "consume", "--source", url, "--target", f"sqlite:{follower}", "--until-caught-up")
        check_replica(follower, n, last)


@contextlib.contextmanager
def without_event_triggers(conn: psycopg.Connection[Any], src: Source) -> Iterator[None]:
    """Replicator's event triggers disabled, as where no superuser installed it (a managed service):
    a pass then checks every captured table against the catalogs (replicator.sync_drifted). The
    first pass after each switch generates every capture again (its guard changes)."""
    triggers = ("replicator_ddl_command_end", "replicator_sql_drop", "replicator_table_rewrite")
    for name in triggers:
        conn.execute(f"ALTER EVENT TRIGGER {name} DISABLE")
    src.tick()
    try:
        yield
    finally:
        for name in triggers:
            conn.execute(f"ALTER EVENT TRIGGER {name} ENABLE")
        src.tick()


def ticker_pass_cost(conn: psycopg.Connection[Any], src: Source, passes: int = 10) -> tuple[float, float]:
    """Transaction ids and WAL bytes an idle ticker pass uses, the mean of `passes` (nothing else runs
    in the cluster meanwhile): what a ticker every second costs the source over months (wraparound
    vacuums, WAL)."""
    wal = "SELECT pg_current_wal_insert_lsn()::text"
    xid, lsn = next_xid(conn), one(conn, wal)
    for _ in range(passes):
        src.tick()
    xids = next_xid(conn) - xid - 1
    return xids / passes, float(one(conn, f"SELECT pg_wal_lsn_diff(({wal})::pg_lsn, %s::pg_lsn)", (lsn,))) / passes


def next_xid(conn: psycopg.Connection[Any]) -> int:
    """The transaction id this call takes (the next one: the call's own transaction takes an id)."""
    xid: int = one(conn, "SELECT txid_current()")
    return xid


def one(conn: psycopg.Connection[Any], query: str, params: tuple[Any, ...] = ()) -> Any:
    row = conn.execute(query, params).fetchone()
    assert row is not None   # a function call or an aggregate: one row
    return row[0]


def check_replica(path: Path, n: int, last: tuple[str] | None) -> None:
    """The replica holds every table, and the last touch of the first."""
    with sqlite3.connect(path) as lite:
        tables = lite.execute("SELECT count(*) FROM _replicator_tables").fetchone()[0]
        held = lite.execute(f"SELECT v FROM {SCHEMA}__t00001 WHERE id = 1").fetchone()   # schema.table's name there
    if tables != n or held != last:
        raise RuntimeError(f"replica {path}: {tables} tables (expected {n}), t00001 row 1 {held} (source: {last})")


# Report ---------------------------------------------------------------------------------

GOALS = {
    "table add --schema": "≤ linear",
    "ticker --once": "≤ linear",
    "ticker pass, idle": "≤ linear",
    "ticker pass, idle, no event triggers": "≤ linear",
    "forced tick, idle": "≤ linear",
    "status": "≤ linear",
    "initial copy": "≤ linear",
    "status, library call": "≤ linear",
    "initial copy: xids": "≤ linear",
    "ticker pass, idle: xids": "≤ linear",
    "consumer start": f"≤ {START_GOAL:.0f} s at 1,000; ≤ linear",
    "consumer start RSS MB": "≤ linear",
    f"forced tick, events in {TOUCHED_LABEL}": "≤ linear",
    f"batch touching {TOUCHED_LABEL}": f"flat from {TOUCHED} tables",
    "batch touching 1 table": "flat",
    "Kafka: publisher's initial copy": "≤ linear",
    "Kafka: follower bootstrap": "≤ linear",
    "ticker pass, idle: WAL bytes": "≤ linear",
}


def goal_of(name: str) -> str:
    return GOALS.get(name, "")


def verdict(name: str, sizes: list[int], values: list[float | None]) -> str:
    """Whether the measure meets its goal between the sizes measured: worse than linear where N times
    the tables cost more than N times as much; not flat where more than FLAT times as much."""
    goal = goal_of(name)
    if not goal:
        return ""
    misses = []
    compared = 0
    for (a, va), (b, vb) in itertools.pairwise(zip(sizes, values, strict=True)):
        flat = goal.startswith("flat")
        # (a batch touching min(100, N) tables touches more of them up to 100: flat from there)
        if va is None or vb is None or va <= 0 or (flat and "min(" in name and a < TOUCHED):
            continue
        compared += 1
        if vb / va > (FLAT if flat else SLACK * b / a):
            misses.append(f"{vb / va:.1f}× {a:,}→{b:,}")
    if name == "consumer start" and 1000 in sizes:
        at = values[sizes.index(1000)]
        if at is not None and at > START_GOAL:
            misses.append(f"{at:.1f} s at 1,000")
    return "no: " + ", ".join(misses) if misses else "yes" if compared else ""


def report(results: dict[int, dict[str, float]]) -> None:
    sizes = sorted(results)
    names = list(dict.fromkeys(name for n in sizes for name in results[n]))
    table = Table(title=f"Scale: what N captured tables cost ({ROWS} rows a table); seconds unless MB")
    table.add_column("measure")
    for n in sizes:
        table.add_column(f"N={n:,}", justify="right")
    for a, b in itertools.pairwise(sizes):
        table.add_column(f"×{a:,}→{b:,}", justify="right")
    table.add_column("goal")
    table.add_column("met")
    for name in names:
        values = [results[n].get(name) for n in sizes]
        ratios = [f"{vb / va:.1f}" if va and vb is not None else "" for va, vb in itertools.pairwise(values)]
        cells = ("" if v is None else f"{v:.3g}" if v < 100 else f"{v:.0f}" for v in values)
        table.add_row(name, *cells, *ratios, goal_of(name), verdict(name, sizes, values))
    console.print(table)
    console.print(f"Ratios: the measure at the larger N over the smaller; linear is the ratio of the Ns "
                  f"(worse than linear: more than {SLACK}× that). "
                  f"Commands (install, table add, ticker --once, status, consume) are timed from process start "
                  f"to exit, Python start-up included (`replicator --version`: {cli_startup():.2f} s); ticks and "
                  f"batches in this process. \"batch touching K tables\": one transaction updating a row in "
                  f"each of K tables, applied by a running consumer. Flat: at most {FLAT}× for 10× "
                  f"the tables. Load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs at the end.")


def cli_startup() -> float:
    return min(timed(lambda: subprocess.run([REPLICATOR, "--version"], capture_output=True, check=True))
               for _ in range(3))


# main -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", default="10,100,1000", help="numbers of tables, comma-separated "
                                                                "(default 10,100,1000)")
    parser.add_argument("--source-only", type=int, metavar="N", action="append", default=[],
                        help="also measure the source side alone (no consumer) at N tables (repeatable)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each repeated measure, the median is "
                                                              "reported (default 3)")
    parser.add_argument("--quick", action="store_true", help="10 and 100 tables, one run each (about a minute)")
    parser.add_argument("--kafka", action="store_true",
                        help="also publish each size to a Kafka broker (bin/kafkaserver.py) and time a follower's "
                             "bootstrap from its topics into SQLite")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    parser.add_argument("--keep", action="store_true", help="keep the replicas and logs (their directory is printed)")
    args = parser.parse_args(argv)
    if args.quick:
        args.tables, args.repeat = "10,100", 1
    sizes = sorted(int(n) for n in args.tables.split(",") if n)

    workdir = Path(tempfile.mkdtemp(prefix="replicator-bench-scale-"))
    if args.keep:
        console.print(f"replicas and logs in {workdir}")
    results: dict[int, dict[str, float]] = {}
    runs = [(n, False) for n in sizes] + [(n, True) for n in args.source_only]
    try:
        with PgServer() as server, contextlib.ExitStack() as stack:
            kafka = stack.enter_context(KafkaServer()) if args.kafka else None
            for n, source_only in runs:
                try:   # a size that fails still reports what it measured, and the sizes before it
                    measure(server, n, args, workdir, source_only, None if source_only else kafka,
                            results.setdefault(n, {}))
                except Exception as exc:
                    console.print(f"[red]{n:,} tables: failed[/]: {exc}")
                if args.json:
                    args.json.write_text(json.dumps({"python": platform.python_version(), "cpus": os.cpu_count(),
                                                     "results": results}, indent=2) + "\n")
        report(results)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
