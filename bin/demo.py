"""The demo: a throwaway PostgreSQL, a live flight-tracking workload, replication
into SQLite by the real `replicator` daemons, and a side-by-side comparison.

Run it through bin/demo, which sets up the environment first.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import psycopg
from rich.console import Console
from rich.live import Live
from rich.table import Table

from pgserver import PgServer
from replicator.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
REPLICATOR = str(Path(sys.executable).with_name("replicator"))
console = Console()

SCHEMA = """
CREATE TABLE airport (
    code        text PRIMARY KEY,
    name        text NOT NULL,
    city        text NOT NULL
);
CREATE TABLE flight (
    flight_id   bigint PRIMARY KEY,
    callsign    text NOT NULL,
    origin      text NOT NULL REFERENCES airport,
    destination text NOT NULL REFERENCES airport,
    status      text NOT NULL DEFAULT 'scheduled',
    departed_at timestamptz,
    fare        numeric(10, 2)
);
CREATE TABLE position_report (
    flight_id   bigint NOT NULL REFERENCES flight ON DELETE CASCADE,
    reported_at timestamptz NOT NULL,
    lat         double precision NOT NULL,
    lon         double precision NOT NULL,
    altitude_ft integer NOT NULL,
    PRIMARY KEY (flight_id, reported_at)
);
"""

AIRPORTS = [("CDG", "Charles de Gaulle", "Paris"), ("FRA", "Frankfurt", "Frankfurt"),
            ("AMS", "Schiphol", "Amsterdam"), ("MAD", "Barajas", "Madrid"),
            ("FCO", "Fiumicino", "Rome"), ("LHR", "Heathrow", "London")]

LATEST_POSITIONS = """
SELECT f.callsign, f.origin || '→' || f.destination AS route, f.status,
       p.altitude_ft, round(p.lat, 3) AS lat, round(p.lon, 3) AS lon, p.reported_at
FROM flight f
JOIN position_report p ON p.flight_id = f.flight_id
WHERE p.reported_at = (SELECT max(reported_at) FROM position_report q WHERE q.flight_id = f.flight_id)
  AND f.status = 'airborne'
ORDER BY p.altitude_ft DESC
LIMIT 8
"""


def run_cli(dsn: str, *args: str) -> None:
    subprocess.run([REPLICATOR, "--dsn", dsn, *args], check=True)


def workload_step(conn: psycopg.Connection, rng: random.Random, next_id: list[int]) -> None:
    """One transaction of the flight tracker: schedule, depart, report, land."""
    with conn.transaction():
        action = rng.random()
        if action < 0.15:
            origin, destination = rng.sample([a[0] for a in AIRPORTS], 2)
            conn.execute("INSERT INTO flight (flight_id, callsign, origin, destination, fare)"
                         " VALUES (%s, %s, %s, %s, %s)",
                         (next_id[0], f"RP{next_id[0]:04d}", origin, destination, round(rng.uniform(49, 899), 2)))
            next_id[0] += 1
        elif action < 0.30:
            conn.execute("UPDATE flight SET status = 'airborne', departed_at = now()"
                         " WHERE flight_id = (SELECT flight_id FROM flight WHERE status = 'scheduled'"
                         " ORDER BY random() LIMIT 1)")
        elif action < 0.38:
            # Landed flights leave the cache: their reports go with them (ON DELETE CASCADE).
            conn.execute("DELETE FROM flight WHERE flight_id = (SELECT flight_id FROM flight"
                         " WHERE status = 'airborne' ORDER BY departed_at LIMIT 1)"
                         " AND (SELECT count(*) FROM flight WHERE status = 'airborne') > 12")
        else:
            # Five airborne flights report: climbing to cruise, drifting along a random track.
            conn.execute("""
                INSERT INTO position_report (flight_id, reported_at, lat, lon, altitude_ft)
                SELECT f.flight_id, clock_timestamp(), 40 + random() * 15, -5 + random() * 20,
                       least(37000, 1500 + extract(epoch FROM clock_timestamp() - f.departed_at) * 3000)::int
                FROM (SELECT flight_id, departed_at FROM flight WHERE status = 'airborne'
                      ORDER BY random() LIMIT 5) f""")


def counts_sqlite(path: Path) -> dict[str, int]:
    if not path.exists():
        return {}
    with sqlite3.connect(path) as db:
        names = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'"
                                          " AND name NOT LIKE '\\_replicator%' ESCAPE '\\'")]
        return {n: db.execute(f'SELECT count(*) FROM "{n}"').fetchone()[0] for n in names}


def counts_pg(conn: psycopg.Connection) -> dict[str, int]:
    counts = {}
    for t in ("airport", "flight", "position_report"):
        row = conn.execute(f"SELECT count(*) FROM {t}").fetchone()
        assert row is not None   # an aggregate: one row
        counts[t] = row[0]
    return counts


def live_table(pg: dict[str, int], lite: dict[str, int], elapsed: float, seconds: float) -> Table:
    table = Table(title=f"replicating… {elapsed:4.1f}s / {seconds:.0f}s", title_justify="left")
    table.add_column("table")
    table.add_column("source rows", justify="right")
    table.add_column("replica rows", justify="right")
    for name, n in pg.items():
        table.add_row(name, str(n), str(lite.get(name, "—")))
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=15.0, help="how long the workload runs")
    parser.add_argument("--dir", type=Path, default=ROOT / "demo-data", help="where the cluster and replica go")
    parser.add_argument("--reset", action="store_true",
                        help="with REPLICATOR_DSN: allow dropping the demo's tables and schema replicator there")
    args = parser.parse_args()
    if os.environ.get("REPLICATOR_DSN") and not args.reset:
        print("error: REPLICATOR_DSN is set: the demo would drop tables airport, flight, position_report and "
              "schema replicator in that database; pass --reset to allow it, or unset REPLICATOR_DSN for a "
              "throwaway cluster", file=sys.stderr)
        return 2
    args.dir.mkdir(parents=True, exist_ok=True)
    replica = args.dir / "replica.db"
    for suffix in ("", "-wal", "-shm"):
        Path(str(replica) + suffix).unlink(missing_ok=True)

    server = None
    dsn = os.environ.get("REPLICATOR_DSN")
    if not dsn:
        console.print("[bold]1.[/] starting a throwaway PostgreSQL in", args.dir / "pg")
        server = PgServer(args.dir / "pg")
        if server.is_running():
            server.stop("immediate")
        shutil.rmtree(args.dir / "pg", ignore_errors=True)
        server = PgServer(args.dir / "pg").init().start()
        dsn = server.dsn
    daemons: list[subprocess.Popen[bytes]] = []
    try:
        conn = psycopg.connect(dsn, autocommit=True)
        conn.execute("DROP TABLE IF EXISTS position_report, flight, airport")
        conn.execute(SCHEMA)
        conn.cursor().executemany("INSERT INTO airport VALUES (%s, %s, %s)", AIRPORTS)

        console.print("[bold]2.[/] installing replicator and capturing the tables")
        if server is None:   # a database of the user's (--reset): what an earlier demo left goes
            run_cli(dsn, "uninstall", "--yes")
        run_cli(dsn, "install")
        run_cli(dsn, "queue", "create", "flights", "--ticker-max-lag", "100ms")
        run_cli(dsn, "table", "add", "flights", "airport", "flight")
        run_cli(dsn, "table", "add", "flights", "position_report", "--mode", "pk")

        console.print("[bold]3.[/] starting the ticker and the SQLite consumer daemons")
        with open(args.dir / "daemons.log", "w") as log:   # the daemons write to their own copies of it
            daemons.append(subprocess.Popen([REPLICATOR, "--dsn", dsn, "ticker", "--interval", "0.1"],
                                            stdout=log, stderr=log))
            daemons.append(subprocess.Popen([REPLICATOR, "--dsn", dsn, "consume", "flights",
                                             "--target", f"sqlite:{replica}"], stdout=log, stderr=log))

        console.print(f"[bold]4.[/] running a flight-tracking workload for {args.seconds:.0f}s")
        rng = random.Random(7)
        next_id = [1]
        started = time.monotonic()
        transactions = 0
        with Live(console=console, refresh_per_second=4) as live:
            while (elapsed := time.monotonic() - started) < args.seconds:
                workload_step(conn, rng, next_id)
                transactions += 1
                if transactions % 50 == 0:
                    live.update(live_table(counts_pg(conn), counts_sqlite(replica), elapsed, args.seconds))
        if not console.is_terminal:
            console.line()   # off a terminal, Live leaves its last table without a line end

        console.print(f"[bold]5.[/] {transactions} transactions written; letting the replica catch up")
        # The consumer daemon stops first: two consumers of one replica at once would move
        # each other's position, which each refuses. Its run to now then applies the rest.
        for daemon in reversed(daemons):
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(timeout=30)
        caught_up = subprocess.run([REPLICATOR, "--dsn", dsn, "consume", "flights", "--target", f"sqlite:{replica}",
                                    "--until-caught-up"], stderr=subprocess.PIPE, text=True)
        if caught_up.returncode:
            last = caught_up.stderr.strip().splitlines() or [f"exit status {caught_up.returncode}"]
            console.print(f"the replica did not catch up: {last[-1]}", markup=False)
            return 1

        show_result(conn, replica)
        console.print(f"\nThe replica stays in [bold]{replica}[/]; open it with: sqlite3 {replica}", soft_wrap=True)
        return 0
    finally:
        for daemon in daemons:
            if daemon.poll() is None:
                daemon.kill()
        if server is not None:
            server.stop()


def comparable(value: object) -> object:
    """A source value as the replica stores it (docs/sqlite.md, "Type mapping")."""
    if isinstance(value, Decimal):   # NUMERIC: an integer when it is one, else a double
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, datetime):
        moment = value.astimezone(UTC) if value.tzinfo else value
        return moment.isoformat(timespec="microseconds")
    return value


def show_result(conn: psycopg.Connection, replica: Path) -> None:
    table = Table(title="source PostgreSQL vs SQLite replica", title_justify="left")
    for column in ("table", "source rows", "replica rows", "same values"):
        table.add_column(column)
    lite = sqlite3.connect(replica)
    for name in ("airport", "flight", "position_report"):
        source_rows = sorted((tuple(map(comparable, row)) for row in conn.execute(f"SELECT * FROM {name}")), key=repr)
        replica_rows = sorted(lite.execute(f"SELECT * FROM {name}"), key=repr)
        same = source_rows == replica_rows
        table.add_row(name, str(len(source_rows)), str(len(replica_rows)), "[green]yes[/]" if same else "[red]NO[/]")
    console.print(table)

    answer = Table(title="answered from the replica: airborne flights, latest position, highest first",
                   title_justify="left")
    cursor = lite.execute(LATEST_POSITIONS)
    for described in cursor.description:
        answer.add_column(described[0])
    for row in cursor:
        answer.add_row(*(str(v) for v in row))
    console.print(answer)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
