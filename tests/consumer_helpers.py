"""Helpers for the consumer tests: running the real `replicator` console script,
waiting on observable conditions, reading a SQLite replica with a separate
connection, and an oracle mapping PostgreSQL values (as psycopg returns them)
to what the SQLite replica must hold.

The oracle is written independently of replicator.structure on purpose: it maps
psycopg's Python values, not the capture encoding.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, date, datetime
from datetime import time as dtime
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg

if TYPE_CHECKING:
    from replicator.source import Source

REPLICATOR = Path(sys.executable).with_name("replicator")


# processes ---------------------------------------------------------------------------

def cli_env(dsn: str) -> dict[str, str]:
    env = dict(os.environ, REPLICATOR_DSN=dsn, PYTHONUNBUFFERED="1")
    env.pop("PGDATABASE", None)
    # each command the tests run would otherwise compile replicator's modules anew (~0.5 s): bytecode
    # goes to __pycache__ (ignored by git) once
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def run_cli(dsn: str, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    """Runs `replicator ARGS` to completion (env: extra environment variables)."""
    return subprocess.run([str(REPLICATOR), *args], env={**cli_env(dsn), **env}, capture_output=True, text=True,
                          timeout=timeout)


def run_cli_in_process(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Runs `replicator ARGS` to completion in this process (click's CliRunner), for a test of what
    a command does where the process is not under test: it spares a Python start and the CLI's
    imports (~0.5 s). A failure raises, with its traceback (main's one-line errors are run_cli's)."""
    from click.testing import CliRunner

    from replicator.cli import cli

    result = CliRunner().invoke(cli, ["--dsn", dsn, *args], catch_exceptions=False)
    return subprocess.CompletedProcess(["replicator", *args], result.exit_code, result.stdout, result.stderr)


class Daemon:
    """A long-running `replicator ARGS` subprocess whose stderr goes to a log file."""

    def __init__(self, dsn: str, *args: str, log: Path, stdout: Path | None = None) -> None:
        self.log_path = log
        self._log = open(log, "ab")  # noqa: SIM115 (open while the daemon runs)
        self._stdout = open(stdout, "wb") if stdout else None  # noqa: SIM115
        self.proc = subprocess.Popen([str(REPLICATOR), *args], env=cli_env(dsn),
                                     stdout=self._stdout or subprocess.DEVNULL, stderr=self._log)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill9(self) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        rc = self.proc.wait(30)
        self._close()
        return rc

    def _close(self) -> None:
        for f in (self._log, self._stdout):
            if f is not None and not f.closed:
                f.close()

    def terminate(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            # Still running: its stacks (SIGUSR1, see StopFlag.install) say where it waits.
            self.proc.send_signal(signal.SIGUSR1)
            wait_until(lambda: "most recent call first" in self.log(), 10, "the daemon's stack dump")
            raise AssertionError(f"still running {timeout}s after SIGTERM:\n{self.log()[-6000:]}") from None
        self._close()
        return rc

    def stop(self) -> None:
        """Best-effort cleanup (tests' finally blocks)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self._close()


def wait_until(condition: Callable[[], Any], timeout: float, what: str, *,
               interval: float = 0.02, check: Callable[[], None] | None = None) -> Any:
    """Polls condition until it returns a true value; fails after timeout.
    check() runs on every poll and may fail early (e.g. a daemon died)."""
    deadline = time.monotonic() + timeout
    while True:
        if check is not None:
            check()
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


# the SQLite replica, seen by a reader of its own -------------------------------------

def sqlite_reader(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None, timeout=30)
    return db


def sqlite_position(path: Path, queue: str = "q") -> int | None:
    """The consumer position stored in the replica (None while there is none)."""
    if not path.exists():
        return None
    db = sqlite_reader(path)
    try:
        row = db.execute("SELECT max(last_tick) FROM _replicator_position WHERE queue = ?", (queue,)).fetchone()
        return row[0]
    except sqlite3.OperationalError:
        return None
    finally:
        db.close()


def sqlite_rows(path: Path, table: str, key: Sequence[str]) -> dict[tuple[Any, ...], dict[str, Any]]:
    db = sqlite_reader(path)
    try:
        cur = db.execute(f'SELECT * FROM "{table}"')
        names = [d[0] for d in cur.description]
        rows = [dict(zip(names, r)) for r in cur]
    finally:
        db.close()
    out = {tuple(r[k] for k in key): r for r in rows}
    assert len(out) == len(rows), f"duplicate keys in replica table {table}"
    return out


def sqlite_types(path: Path, table: str) -> dict[str, str]:
    db = sqlite_reader(path)
    try:
        return {r[1]: r[2] for r in db.execute(f'PRAGMA table_info("{table}")')}
    finally:
        db.close()


def sqlite_primary_key(path: Path, table: str) -> list[str]:
    db = sqlite_reader(path)
    try:
        cols = [(r[5], r[1]) for r in db.execute(f'PRAGMA table_info("{table}")') if r[5]]
    finally:
        db.close()
    return [name for _, name in sorted(cols)]


def set_fast_ticks(conn: psycopg.Connection, queue: str = "q", *, max_lag: str = "50 ms",
                   idle: str = "500 ms", max_count: int = 200) -> None:
    """Makes a running ticker tick often (test queues should not wait PgQ's 3 s)."""
    conn.execute("UPDATE replicator.queue SET queue_ticker_max_lag = %s, queue_ticker_idle_period = %s,"
                 " queue_ticker_max_count = %s WHERE queue_name = %s", (max_lag, idle, max_count, queue))


def latest_tick(conn: psycopg.Connection, queue: str = "q") -> int:
    return conn.execute("SELECT coalesce(max(tick_id), 0) FROM replicator.tick"
                        " WHERE tick_queue = (SELECT queue_id FROM replicator.queue WHERE queue_name = %s)",
                        (queue,)).fetchone()[0]


def forced_tick(conn: psycopg.Connection, queue: str = "q") -> int:
    """A tick taken after every change committed so far, whatever else ticks. A forced
    tick is skipped (NULL) while another ticker holds the queue (a ticker daemon, a
    consumer making its copy snapshot durable), and that ticker's tick may predate the
    changes: try again until one of ours is made."""
    return wait_until(lambda: conn.execute("SELECT replicator.ticker(%s, true)", (queue,)).fetchone()[0], 30,
                      f"a forced tick of queue {queue}")


# the oracle ----------------------------------------------------------------------------

def expected_sqlite_value(value: Any, pg_type: str = "", *, numeric_as: str = "number") -> Any:
    """What the SQLite replica must hold for a value psycopg read from the source
    from a column of type pg_type (format_type() without typmod); a numeric one
    stored as a number (a NUMERIC column) or as PostgreSQL's text (numeric_as "text").

    Values whose representation is only defined up to an equivalence (JSON
    documents, ISO 8601 date-times) are returned as a ("json", obj) /
    ("timestamptz", dt) / ... marker that same_value() compares.
    """
    if value is None:
        return None
    if pg_type in ("json", "jsonb") or pg_type.endswith("[]"):
        return ("json", value)
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "Infinity" if value > 0 else "-Infinity"
        return value
    if isinstance(value, Decimal):
        if value.is_nan():
            return "NaN"
        if value.is_infinite():
            return "Infinity" if value > 0 else "-Infinity"
        if numeric_as == "text":
            return format(value, "f")
        return sqlite_numeric(value)
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, datetime):
        return ("timestamptz", value) if value.tzinfo is not None else ("timestamp", value)
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, dtime):
        return ("time", value)
    if isinstance(value, (list, dict)):
        return ("json", value)
    raise TypeError(f"no oracle mapping for {type(value).__name__} {value!r}")


def sqlite_numeric(value: Decimal) -> int | float:
    """A finite numeric in a NUMERIC column: the integer when it is one of 64 bits, else the
    nearest double, which SQLite keeps as an integer when it is one of 64 bits."""
    if value == value.to_integral_value() and -2**63 <= value < 2**63:
        return int(value)
    nearest = float(value)
    return int(nearest) if nearest.is_integer() and -2**63 <= nearest < 2**63 else nearest


def _json_equal(a: Any, b: Any) -> bool:
    """JSON documents equal as values (numbers compared exactly, as Decimals)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, Decimal)) and isinstance(b, (int, Decimal)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def same_value(expected: Any, actual: Any) -> bool:
    """Compares an expected_sqlite_value() with what the replica holds."""
    if isinstance(expected, tuple) and len(expected) == 2 and isinstance(expected[0], str):
        kind, value = expected
        if not isinstance(actual, str):
            return False
        if kind == "json":
            return _json_equal(json.loads(actual, parse_float=Decimal), _decimalize(value))
        if kind == "timestamptz":
            # ISO 8601, converted to UTC, with its offset written out and six fractional digits.
            return actual == value.astimezone(UTC).isoformat(timespec="microseconds")
        if kind in ("timestamp", "time"):
            return actual == value.isoformat(timespec="microseconds")
        raise AssertionError(kind)
    if isinstance(expected, float):
        return isinstance(actual, float) and actual == expected
    if isinstance(expected, int):
        return type(actual) is int and actual == expected
    return type(actual) is type(expected) and actual == expected


def _decimalize(value: Any) -> Any:
    if isinstance(value, float):
        return Decimal(repr(value))
    if isinstance(value, list):
        return [_decimalize(v) for v in value]
    if isinstance(value, dict):
        return {k: _decimalize(v) for k, v in value.items()}
    return value


def source_rows(conn: psycopg.Connection, qualified: str, key: Sequence[str]) -> dict[tuple[Any, ...], dict[str, Any]]:
    schema, _, name = qualified.partition(".")
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        rows = cur.execute(f'SELECT * FROM "{schema}"."{name}"').fetchall()
    return {tuple(r[k] for k in key): r for r in rows}


def column_types(conn: psycopg.Connection, qualified: str) -> dict[str, str]:
    schema, _, name = qualified.partition(".")
    return dict(conn.execute(
        "SELECT a.attname, format_type(a.atttypid, NULL) FROM pg_attribute a"
        " WHERE a.attrelid = format('%%I.%%I', %s::text, %s::text)::regclass AND a.attnum > 0"
        " AND NOT a.attisdropped", (schema, name)).fetchall())


def numeric_precisions(conn: psycopg.Connection, qualified: str) -> dict[str, int | None]:
    """The precision of each numeric column (None: numeric without one)."""
    schema, _, name = qualified.partition(".")
    return dict(conn.execute(
        "SELECT column_name, numeric_precision FROM information_schema.columns"
        " WHERE table_schema = %s AND table_name = %s AND data_type = 'numeric'", (schema, name)).fetchall())


def numeric_storage(column: str, precision: int | None, key: Sequence[str], numeric: str) -> str:
    """How a replica stores a numeric column (docs/sqlite.md, "Type mapping"): as a
    number, except in a `numeric=text` replica and in a key column that may hold more
    digits than a double keeps (15)."""
    if numeric == "text" or (column in key and (precision is None or precision > 15)):
        return "text"
    return "number"


def diff_replica(conn: psycopg.Connection, sqlite_path: Path, qualified: str, replica_name: str,
                 key: Sequence[str], numeric: str = "number") -> list[str]:
    """Every difference between a source table and its replica, value by value."""
    expected = source_rows(conn, qualified, key)
    actual = sqlite_rows(sqlite_path, replica_name, key)
    types = column_types(conn, qualified)
    numeric_as = {column: numeric_storage(column, precision, key, numeric)
                  for column, precision in numeric_precisions(conn, qualified).items()}
    problems = []
    for k in sorted(set(expected) - set(actual), key=repr):
        problems.append(f"{qualified}: row {k} missing from the replica")
    for k in sorted(set(actual) - set(expected), key=repr):
        problems.append(f"{qualified}: row {k} in the replica but not in the source: {actual[k]}")
    for k in sorted(set(expected) & set(actual), key=repr):
        src, rep = expected[k], actual[k]
        if set(src) != set(rep):
            problems.append(f"{qualified}: columns differ: {sorted(src)} vs {sorted(rep)}")
            continue
        for column, value in src.items():
            want = expected_sqlite_value(value, types[column], numeric_as=numeric_as.get(column, "number"))
            if not same_value(want, rep[column]):
                problems.append(f"{qualified} {k}.{column}: source {value!r} -> expected {want!r},"
                                f" replica has {rep[column]!r}")
    return problems


def assert_replica_equals_source(conn: psycopg.Connection, sqlite_path: Path,
                                 tables: Sequence[tuple[str, str, Sequence[str]]], numeric: str = "number") -> None:
    problems = [p for qualified, replica, key in tables
                for p in diff_replica(conn, sqlite_path, qualified, replica, key, numeric)]
    assert not problems, f"{len(problems)} differences:\n" + "\n".join(problems[:40])


class LosesTheSourceOnce:
    """A target mixin whose next set_position after `fail` is set finds the source
    gone, as when it stops between a batch's events and its end: the consumer rolls
    the batch back and applies it again after reconnecting."""

    fail = False

    def set_position(self, queue: str, consumer: str, tick: int) -> None:
        if self.fail:
            self.fail = False
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        super().set_position(queue, consumer, tick)  # type: ignore[misc]


def apply_losing_the_source_once(dsn: str, conn: psycopg.Connection, target: LosesTheSourceOnce,
                                 statements: list[str]) -> None:
    """Brings `target` up to date with queue q, then runs `statements` (queued as one batch)
    and applies that batch with the source lost at its end: rolled back, then applied
    again after reconnecting. Closes the target."""
    from replicator.consumer import Consumer

    consumer = Consumer(dsn, "q", target, name="c")  # type: ignore[arg-type]
    try:
        consumer.run(until_caught_up=True)
        for statement in statements:
            conn.execute(statement)
        target.fail = True
        consumer.run(until_caught_up=True)
        assert not target.fail, "the batch did not reach its position"
    finally:
        consumer.close()
        target.close()  # type: ignore[attr-defined]


def consume_while_a_ddl_holds_the_copy(dsn: str, conn: psycopg.Connection, target: str, ddl: str) -> None:
    """`consume q --until-caught-up` into the target while DDL run in another session holds its table's
    lock: the DDL commits once the consumer's copy waits for that lock."""
    with psycopg.connect(dsn) as ddl_session:
        ddl_session.execute(ddl)   # its lock held until the commit below
        consumer = subprocess.Popen([str(REPLICATOR), "consume", "q", "--target", target, "--until-caught-up"],
                                    env=cli_env(dsn), stderr=subprocess.PIPE, text=True)

        def running() -> None:
            if consumer.poll() is not None:
                raise AssertionError(f"the consumer ended: {consumer.stderr.read()}")   # type: ignore[union-attr]

        try:
            wait_until(lambda: conn.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                            "AND application_name = 'replicator copy'").fetchone()[0], 60,
                       f"the copy to wait for the lock {ddl} holds", check=running)
            ddl_session.commit()
            _, stderr = consumer.communicate(timeout=120)
        finally:
            consumer.kill()
    assert consumer.returncode == 0, stderr


def copy_while_a_ddl_holds_the_table(dsn: str, conn: psycopg.Connection, source: Source, target: str,
                                     ddl: str) -> None:
    """Tables a and b captured by queue q, a row each and a change of each queued; then their initial copy
    into the target while `ddl` (a DROP or RENAME of b) holds b's lock (consume_while_a_ddl_holds_the_copy)."""
    conn.execute("CREATE TABLE a (id int PRIMARY KEY, v text); CREATE TABLE b (id int PRIMARY KEY, v text)")
    conn.execute("INSERT INTO a VALUES (1, 'a'); INSERT INTO b VALUES (1, 'b')")
    source.create_queue("q")
    source.add_table("q", "a")
    source.add_table("q", "b")
    conn.execute("INSERT INTO b VALUES (2, 'queued'); INSERT INTO a VALUES (2, 'queued')")
    consume_while_a_ddl_holds_the_copy(dsn, conn, target, ddl)
