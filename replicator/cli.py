"""Command line: a thin skin over the library (source/, consumer.py, targets/, views/).

Every error a user can cause ends as one line on stderr and exit status 1.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import logging
import os
import signal
import sqlite3
import sys
import threading
from collections.abc import Callable
from datetime import date, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click
import psycopg
from rich.console import Console
from rich.table import Table
from rich.text import Text

from replicator import __version__
from replicator.errors import UserError, first_line, printable
from replicator.shutdown import StopFlag
from replicator.source import Source, db, format_duration, jobs, parse_duration
from replicator.source import install as installer
from replicator.wording import counted, format_age

if TYPE_CHECKING:
    from replicator.metrics import DaemonMetrics  # imported when served: prometheus_client takes a while to load

console = Console()


class Context:
    def __init__(self, dsn: str | None) -> None:
        self.dsn = dsn

    def connect(self) -> psycopg.Connection:
        return db.connect(self.dsn)

    def source(self) -> Source:
        return Source(self.connect())


pass_ctx = click.make_pass_decorator(Context)


def _split(values: str | None) -> list[str]:
    return [v.strip() for v in values.split(",") if v.strip()] if values else []


def _json_default(value: Any) -> Any:
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, Decimal):
        return str(value)
    return str(value)


def _print_rows(rows: list[dict[str, Any]], title: str | None = None) -> None:
    """A table of rows that never cuts a cell: piped, as wide as its widest row; on a
    terminal, cells too wide for it wrap (names must stay whole: they are typed back
    into commands such as `queue unregister`)."""
    if not rows:
        console.print(Text(printable(f"(no {title or 'rows'})")))
        return
    # Cells are Text, never markup, their control characters escaped: names come from the database
    # ("feed[b]eu", "[/x]", an escape sequence that would clear the terminal).
    table = Table(title=Text(printable(title)) if title else None, title_justify="left")
    for column in rows[0]:
        table.add_column(Text(printable(column)), overflow="fold")
    for row in rows:
        table.add_row(*(Text(printable("" if v is None else ", ".join(map(str, v)) if isinstance(v, list) else str(v)))
                        for v in row.values()))
    if console.is_terminal:
        console.print(table)
    else:
        width = Console(width=1 << 20).measure(table).maximum
        Console(width=width, no_color=True).print(table)


@click.group()
@click.option("--dsn", envvar="REPLICATOR_DSN", help="Source database (libpq string or URI); "
              "default $REPLICATOR_DSN, else libpq's PG* variables.")
@click.option("-v", "--verbose", is_flag=True, help="Log debug messages.")
@click.version_option(__version__, prog_name="replicator")
@click.pass_context
def cli(ctx: click.Context, dsn: str | None, verbose: bool) -> None:
    """Trigger-based change capture and replication for PostgreSQL.

    \b
    Example:
        replicator --dsn postgresql://localhost/app install
        replicator queue create main
        replicator table add main public.orders public.customers
        replicator ticker &
        replicator consume main --target sqlite:replica.db
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLineFormatter("%(asctime)s %(levelname)s %(message)s"))
    logging.basicConfig(handlers=[handler])
    _log_debug(verbose)
    ctx.obj = Context(dsn)


class _OneLineFormatter(logging.Formatter):
    """Each message one line: control characters of the names it holds (a table named "a\\nINFO b")
    are escaped, so no name splits a log line or forges one. A traceback stays as it is."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return printable(super().formatMessage(record))


def _log_debug(verbose: bool) -> None:
    logging.getLogger().setLevel(logging.DEBUG if verbose else logging.INFO)
    logging.getLogger("py4j").setLevel(logging.DEBUG if verbose else logging.WARNING)   # its INFO is Spark's plumbing


def _verbose_after_the_command(group: click.Group) -> None:
    """-v works after a command's name too (replicator consume main -v), as before it."""
    for command in group.commands.values():
        if isinstance(command, click.Group):
            _verbose_after_the_command(command)
        else:
            command.params.append(click.Option(
                ["-v", "--verbose"], is_flag=True, expose_value=False, help="Log debug messages.",
                callback=lambda ctx, param, value: _log_debug(True) if value else None))


# install ---------------------------------------------------------------------

@cli.command()
@pass_ctx
def install(ctx: Context) -> None:
    """Create or upgrade schema "replicator" in the source. Idempotent.

    \b
    Example:
        replicator install
    """
    with ctx.connect() as conn:
        result = installer.install(conn)
        version = max(installer.installed_versions(conn))
    if result.applied:
        click.echo(f"applied migrations {', '.join(f'{m.version:04d}_{m.name}' for m in result.applied)}")
    click.echo(f"replicator schema at version {version}")
    if not result.event_triggers:
        click.echo("event triggers not allowed for this role: DDL run directly on a captured table is noticed "
                   "at its next statement and before each tick; `replicator execute QUEUE FILE.sql` names "
                   "each change by its statement")


@cli.command()
@click.option("--yes", is_flag=True, help="Confirm: queued events are lost.")
@pass_ctx
def uninstall(ctx: Context, yes: bool) -> None:
    """Remove schema "replicator", its triggers and event triggers. Application data is untouched.

    \b
    Example:
        replicator uninstall --yes
    """
    if not yes:
        raise UserError("uninstall drops every queue and its events: confirm with --yes")
    with ctx.connect() as conn:
        installer.uninstall(conn)
    click.echo("replicator uninstalled")


# queues ----------------------------------------------------------------------

@cli.group()
def queue() -> None:
    """Create, configure, drop and list queues; unregister their consumers, or give them to another role."""


# When a tick is due and when a consumer is idle. `queue create` sets them, to these defaults when not
# given: the defaults of replicator.queue's columns, which a queue created in SQL gets (tests/test_docs.py
# checks that the two agree); `queue config` changes only those given.
NEW_QUEUE_DEFAULTS: dict[str, Any] = {"ticker_max_count": 500, "ticker_max_lag": "3s", "ticker_idle_period": "60s",
                                      "consumer_idle_limit": "1h"}
_TICKER_OPTIONS = [
    ("ticker_max_count", int, "Events that make a tick due."),
    ("ticker_max_lag", None, "Pending events make a tick due after this long."),
    ("ticker_idle_period", None, "A tick is made after this long without events."),
    ("consumer_idle_limit", None, "A consumer unseen this long is idle: status and maint say so, and maint "
                                  "unregisters it if it is a temporary one."),
]

_F = TypeVar("_F", bound=Callable[..., Any])


def _ticker_options(new_queue: bool) -> Callable[[_F], _F]:
    def decorate(f: _F) -> _F:
        for name, kind, help_text in reversed(_TICKER_OPTIONS):
            f = click.option(f"--{name.replace('_', '-')}", type=kind, help=help_text,
                             default=NEW_QUEUE_DEFAULTS[name] if new_queue else None, show_default=new_queue)(f)
        return f
    return decorate


def _ticker_settings(max_count: int | None, max_lag: str | None, idle_period: str | None,
                     consumer_idle_limit: str | None) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    if consumer_idle_limit is not None:
        settings["consumer_idle_limit"] = parse_duration(consumer_idle_limit)
    if max_count is not None:
        settings["ticker_max_count"] = max_count
    if max_lag is not None:
        settings["ticker_max_lag"] = parse_duration(max_lag)
    if idle_period is not None:
        settings["ticker_idle_period"] = parse_duration(idle_period)
    return settings


@queue.command("create")
@click.argument("name")
@click.option("--rotation-period", default="2h", show_default=True,
              help="How long an event table is written before the next (e.g. 30min, 2h).")
@click.option("--tables", "ntables", default=3, show_default=True, type=int,
              help="Number of event tables rotated through.")
@_ticker_options(new_queue=True)
@pass_ctx
def queue_create(ctx: Context, name: str, rotation_period: str, ntables: int, ticker_max_count: int | None,
                 ticker_max_lag: str | None, ticker_idle_period: str | None, consumer_idle_limit: str | None) -> None:
    """Create a queue.

    \b
    Example:
        replicator queue create main --rotation-period 1h --tables 3
        replicator queue create fast --ticker-max-lag 0.5s --ticker-idle-period 10s
        replicator queue create nightly --consumer-idle-limit 2d
    """
    settings = _ticker_settings(ticker_max_count, ticker_max_lag, ticker_idle_period, consumer_idle_limit)
    with ctx.source() as source, source.conn.transaction():
        source.create_queue(name, ntables=ntables, rotation_period=parse_duration(rotation_period))
        source.set_queue_config(name, **settings)
    click.echo(f"queue {name} created")


@queue.command("config")
@click.argument("name")
@click.option("--rotation-period", help="How long an event table is written before the next (e.g. 30min, 2h).")
@_ticker_options(new_queue=False)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def queue_config(ctx: Context, name: str, rotation_period: str | None, ticker_max_count: int | None,
                 ticker_max_lag: str | None, ticker_idle_period: str | None, consumer_idle_limit: str | None,
                 as_json: bool) -> None:
    """Show a queue's settings, and change those given. The ticker and
    maintenance use them from their next pass.

    \b
    Example:
        replicator queue config main
        replicator queue config main --ticker-max-lag 1s --rotation-period 30min
        replicator queue config main --consumer-idle-limit 6h
    """
    settings = _ticker_settings(ticker_max_count, ticker_max_lag, ticker_idle_period, consumer_idle_limit)
    if rotation_period is not None:
        settings["rotation_period"] = parse_duration(rotation_period)
    with ctx.source() as source:
        source.set_queue_config(name, **settings)
        config = source.queue_config(name)
    if as_json:
        click.echo(json.dumps(config, default=_json_default, indent=2))
        return
    for key, value in config.items():
        click.echo(f"{key}: {format_duration(value) if isinstance(value, timedelta) else value}")


@queue.command("drop")
@click.argument("name")
@click.option("--force", is_flag=True, help="Drop it though consumers are registered (their pending events are lost).")
@pass_ctx
def queue_drop(ctx: Context, name: str, force: bool) -> None:
    """Drop a queue, its capture triggers and its events.

    \b
    Example:
        replicator queue drop main
    """
    with ctx.source() as source:
        source.queue_id(name)
        consumers = [c["consumer_name"] for c in source.consumers() if c["queue_name"] == name]
        if consumers and not force:
            raise UserError(f"queue {name} has consumers ({', '.join(consumers)}) whose pending events would be lost:"
                            f" stop them and unregister them (replicator queue unregister), or pass --force")
        source.drop_queue(name)
    click.echo(f"queue {name} dropped")


@queue.command("unregister")
@click.argument("queue_name", metavar="QUEUE")
@click.argument("consumer")
@pass_ctx
def queue_unregister(ctx: Context, queue_name: str, consumer: str) -> None:
    """Forget CONSUMER of QUEUE (a replica retired, a consumer that failed after
    registering): rotation no longer waits for it. Started again, the consumer resumes
    from its replica's position only while the queue still holds that tick.

    \b
    Example:
        replicator queue unregister main sqlite_old_replica_1a2b3c4d
    """
    with ctx.source() as source:
        if not source.unregister_consumer(queue_name, consumer):
            raise UserError(f"queue {queue_name} has no consumer {consumer!r} (see: replicator status)")
    click.echo(f"consumer {consumer} of queue {queue_name} unregistered")


@queue.command("owner")
@click.argument("queue_name", metavar="QUEUE")
@click.argument("consumer")
@click.argument("role")
@pass_ctx
def queue_owner(ctx: Context, queue_name: str, consumer: str, role: str) -> None:
    """Give CONSUMER of QUEUE to ROLE, which alone (with the owner of schema
    replicator and superusers) may then run, move or unregister it. For a consumer
    registered before owners were recorded (it belongs to the owner of schema
    replicator), or a replica another role runs now. Only the owner of schema
    replicator may.

    \b
    Example:
        replicator queue owner main sqlite_replica_1a2b3c4d replica_reader
    """
    with ctx.source() as source:
        source.set_consumer_owner(queue_name, consumer, role)
    click.echo(f"consumer {consumer} of queue {queue_name} belongs to {role}")


@queue.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def queue_list(ctx: Context, as_json: bool) -> None:
    """List queues.

    \b
    Example:
        replicator queue list
    """
    from replicator.source.status import queue_rows

    with ctx.source() as source:
        rows = queue_rows(source)
    if as_json:
        click.echo(json.dumps(rows, default=_json_default, indent=2))
    else:
        _print_rows([{"queue": r["queue"], "tables": r["tables"], "consumers": r["consumers"],
                      "event tables": r["ntables"], "current": r["current_table"],
                      "rotation": format_duration(r["rotation_period"]), "last tick": r["last_tick"],
                      "last tick age": _age(r["last_tick_age"]), "events since tick": r["events_since_tick"]}
                     for r in rows], "queues")


def _age(seconds: float | None) -> str:
    return "" if seconds is None else format_age(seconds)


# tables ----------------------------------------------------------------------

@cli.group()
def table() -> None:
    """Add, remove and list captured tables."""


@table.command("add")
@click.argument("queue_name", metavar="QUEUE")
@click.argument("tables", nargs=-1)
@click.option("--schema", "schemas", multiple=True,
              help="Follow a whole schema: its tables now (500 a transaction: run again after an interruption) "
                   "and those created later.")
@click.option("--mode", type=click.Choice(["full", "pk"]), default="full", show_default=True,
              help="full: queue whole rows; pk: queue keys, the consumer reads rows back.")
@click.option("--key", help="Key columns (COL,...) for a table without a primary key.")
@click.option("--ignore", help="Columns not captured (COL,...); an update touching only them queues nothing.")
@click.option("--where", "where", help="SQL condition over the row; rows outside it are not queued.")
@click.option("--old-rows", is_flag=True,
              help="Queue the old row of each UPDATE and DELETE too (as REPLICA IDENTITY FULL): Kafka's `before`, "
                   "a stream's \"old\". Full mode only.")
@click.option("--capture", type=click.Choice(["statement", "row"]), default="statement", show_default=True,
              help="statement: a trigger a statement, over its transition tables (cheaper from a few rows a "
                   "statement); row: a trigger a row, the same events (cheaper for single-row statements: `table "
                   "list` shows rows per statement).")
@pass_ctx
def table_add(ctx: Context, queue_name: str, tables: tuple[str, ...], schemas: tuple[str, ...], mode: str,
              key: str | None, ignore: str | None, where: str | None, old_rows: bool, capture: str) -> None:
    """Capture TABLE... (schema.table or table) into QUEUE.

    \b
    Example:
        replicator table add main public.orders --ignore updated_at
        replicator table add main audit_log --key id --mode pk --where "kind <> 'debug'"
        replicator table add main --schema sales
        replicator table add main public.accounts --old-rows
        replicator table add main public.sessions --capture row
    """
    if not tables and not schemas:
        raise UserError("name the tables to add, or follow a schema with --schema NAME")
    if schemas and (key or ignore or where or old_rows or capture != "statement"):
        raise UserError("--key, --ignore, --where, --old-rows and --capture apply to the tables named, not to a "
                        "schema's: follow the schema and add those tables in two commands")
    if old_rows and mode == "pk":
        raise UserError("--old-rows needs --mode full: pk mode queues keys only (the consumer reads rows back as "
                        "they are then, with no old row)")
    added = 0
    with ctx.source() as source:
        with source.conn.transaction():
            for name in tables:
                source.add_table(queue_name, name, mode=mode, key=_split(key), ignore=_split(ignore), where=where,
                                 old_rows=old_rows, capture=capture)
                added += 1
        for schema in schemas:   # a few hundred tables a transaction (Source.follow_schema)
            added += source.follow_schema(queue_name, schema, mode=mode)
    click.echo(f"{counted(added, 'table')} added to queue {queue_name}"
               + (f"; following schema {', '.join(schemas)}" if schemas else ""))


@table.command("remove")
@click.argument("queue_name", metavar="QUEUE")
@click.argument("tables", nargs=-1)
@click.option("--schema", "schemas", multiple=True,
              help="Stop following a schema (before its tables are removed): tables created later are not captured.")
@click.option("--drop-from-replicas", is_flag=True,
              help="Consumers drop their copy of the tables once they have applied what was queued before.")
@pass_ctx
def table_remove(ctx: Context, queue_name: str, tables: tuple[str, ...], schemas: tuple[str, ...],
                 drop_from_replicas: bool) -> None:
    """Stop capturing TABLE... into QUEUE. Replicas keep their copy as it is, no
    longer updated, unless --drop-from-replicas.

    \b
    Example:
        replicator table remove main public.orders
        replicator table remove main public.orders --drop-from-replicas
        replicator table remove main --schema sales sales.archive
    """
    if not tables and not schemas:
        raise UserError("name the tables to remove, or stop following a schema with --schema NAME")
    if drop_from_replicas and not tables:
        raise UserError("--drop-from-replicas applies to the tables named: name them")
    with ctx.source() as source, source.conn.transaction():
        for schema in schemas:
            source.unfollow_schema(queue_name, schema)
        for name in tables:
            source.remove_table(queue_name, name, drop_from_replicas=drop_from_replicas)
    click.echo(f"{counted(len(tables), 'table')} removed from queue {queue_name}"
               + (f"; no longer following schema {', '.join(schemas)}" if schemas else ""))
    if drop_from_replicas:
        click.echo("replicas drop their copy once their consumer reaches this point of the queue")
    elif tables:
        click.echo("replicas keep their copy as it is, no longer updated (`table remove --drop-from-replicas` "
                   "has consumers drop it at that point of the queue)")


@table.command("alter")
@click.argument("queue_name", metavar="QUEUE")
@click.argument("table_name", metavar="TABLE")
@click.option("--mode", type=click.Choice(["full", "pk"]), help="full: queue whole rows; pk: queue keys.")
@click.option("--key", help="New key columns (COL,...): targets copy the table again.")
@click.option("--ignore", help="The columns not captured (COL,...), replacing the list: newly ignored columns are "
                               "dropped from replicas, columns no longer ignored copied again.")
@click.option("--no-ignore", is_flag=True, help="Capture every column again (targets copy the table again).")
@click.option("--where", "where", help="New row filter: targets copy the table again.")
@click.option("--no-where", is_flag=True, help="Capture every row again (targets copy the table again).")
@click.option("--old-rows/--no-old-rows", "old_rows", default=None,
              help="Queue the old row of each UPDATE and DELETE too, or no longer: from the first statement after "
                   "the change commits (full mode only).")
@click.option("--capture", type=click.Choice(["statement", "row"]),
              help="Capture by statement or by row from the next statement on: the same events (the switch keeps "
                   "readers out too, for as long as replacing the triggers takes).")
@pass_ctx
def table_alter(ctx: Context, queue_name: str, table_name: str, mode: str | None, key: str | None,
                ignore: str | None, no_ignore: bool, where: str | None, no_where: bool,
                old_rows: bool | None, capture: str | None) -> None:
    """Change how TABLE of QUEUE is captured, in place: settings not given are
    kept. Consumers apply the changes queued before with the old settings and
    copy the table again only where they lack rows or values.

    \b
    Example:
        replicator table alter main orders --where "status <> 'draft'"
        replicator table alter main users --ignore last_seen,login_count
        replicator table alter main audit_log --mode full --no-where
        replicator table alter main accounts --old-rows
        replicator table alter main sessions --capture row
    """
    if where is not None and no_where:
        raise UserError("--where and --no-where exclude each other")
    if ignore is not None and no_ignore:
        raise UserError("--ignore and --no-ignore exclude each other")
    if ignore is not None and not _split(ignore):
        raise UserError("--ignore needs one or more column names (--no-ignore captures every column again)")
    if key is not None and not _split(key):
        raise UserError("--key needs one or more column names")
    if (mode is None and key is None and ignore is None and not no_ignore and where is None and not no_where
            and old_rows is None and capture is None):
        raise UserError("nothing to change: give --mode, --key, --ignore, --no-ignore, --where, --no-where, "
                        "--old-rows, --no-old-rows or --capture")
    if mode == "pk" and old_rows:
        raise UserError("--old-rows needs --mode full: pk mode queues keys only (the consumer reads rows back as "
                        "they are then, with no old row)")
    new_ignore = [] if no_ignore else None if ignore is None else _split(ignore)
    with ctx.source() as source, source.conn.transaction():
        result = source.alter_table(queue_name, table_name, mode=mode, key=_split(key) or None, ignore=new_ignore,
                                    where=where, set_where=where is not None or no_where, old_rows=old_rows,
                                    capture=capture)
    how = ("targets copy it again at that point of the queue" if result["copy"]
           else "targets change their copy in place at that point of the queue")
    click.echo(f"{table_name} of queue {queue_name}: {', '.join(result['changed'])} changed; {how}")


@table.command("list")
@click.argument("queue_name", metavar="[QUEUE]", required=False)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def table_list(ctx: Context, queue_name: str | None, as_json: bool) -> None:
    """List captured tables, of one queue or of all, and the schemas whose new
    tables are captured (--json: the tables only; `status --json` has both).
    Each table's capture kind comes with the mean rows per statement written
    to it, from a bounded sample of the queue (its last two event tables, up
    to 10,000 row events of each): statement capture fits tables written
    several rows a statement, row capture tables written one row at a time.

    \b
    Example:
        replicator table list main
    """
    from replicator.source.status import rounded
    with ctx.source() as source:
        sizes = source.rows_per_statement(queue_name)
        rows = [{"queue": t.queue_name, "table": t.name, "mode": t.mode, "key": t.key,
                 "ignore": t.ignore, "where": t.row_filter, "old_rows": t.old_rows, "capture": t.capture,
                 "rows_per_statement": rounded(sizes.get(t.table_id)), "suspended": t.suspended}
                for t in source.tables(queue_name)]
        schemas = [] if as_json else source.followed_schemas(queue_name)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    _print_rows(rows, "tables")
    if schemas:
        _print_rows(_schema_rows(schemas), "followed schemas")


def _schema_rows(schemas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Followed schemas as the text output shows them."""
    return [{**s, "since": _timestamp(s["since"])} for s in schemas]


def _timestamp(value: datetime) -> str:
    """A time as the text output shows it, to the second."""
    return value.strftime("%Y-%m-%d %H:%M:%S")


# jobs ------------------------------------------------------------------------

_METRICS_OPTIONS = [
    click.option("--metrics-port", type=click.IntRange(0, 65535),
                 help="Serve Prometheus metrics on this port (/metrics), and /health (docs/monitoring.md); "
                      "0: a free port, logged."),
    click.option("--metrics-address", default="127.0.0.1", show_default=True,
                 help="Address the metrics listen on; 0.0.0.0 or :: for every interface."),
]


def _metrics_options(f: Any) -> Any:
    for option in reversed(_METRICS_OPTIONS):
        f = option(f)
    return f


def _serve_metrics(metrics: DaemonMetrics, address: str, port: int | None, once: bool) -> None:
    from replicator.metrics import serve

    if port is None:
        return
    if once:
        raise UserError("--metrics-port serves a running daemon: leave out --once")
    serve(metrics, address, port)



@cli.command()
@click.option("--once", is_flag=True, help="Tick every queue once (forced) and exit.")
@click.option("--interval", default=1.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Seconds between passes.")
@_metrics_options
@pass_ctx
def ticker(ctx: Context, once: bool, interval: float, metrics_port: int | None, metrics_address: str) -> None:
    """Cut the event stream into batches: insert ticks when due.

    \b
    Example:
        replicator ticker --interval 0.5
        replicator ticker --metrics-port 9701
    """
    from replicator.metrics import TickerMetrics

    metrics = TickerMetrics(interval)
    _serve_metrics(metrics, metrics_address, metrics_port, once)
    if once:
        with ctx.source() as source:
            ticks = [source.tick(q["queue_name"], force=True) for q in source.queues()]
        click.echo(counted(sum(t is not None for t in ticks), "tick"))
        return
    ctx.source().close()
    jobs.run_ticker(ctx.source, interval, StopFlag().install(), metrics)


@cli.command()
@click.option("--once", is_flag=True, help="One pass and exit.")
@click.option("--interval", default=30.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Seconds between passes.")
@_metrics_options
@pass_ctx
def maint(ctx: Context, once: bool, interval: float, metrics_port: int | None, metrics_address: str) -> None:
    """Rotate event tables, clean up old ticks, unregister temporary consumers
    whose process is gone; say what blocks a rotation overdue, and which
    consumers are idle.

    \b
    Example:
        replicator maint --once
        replicator maint --metrics-port 9702
    """
    from replicator.metrics import MaintMetrics

    metrics = MaintMetrics(interval)
    _serve_metrics(metrics, metrics_address, metrics_port, once)
    if once:
        from replicator.source.status import idle_line

        with ctx.source() as source:
            actions = source.maint()   # printed below, not logged
            idle = [c for c in source.consumers() if c["idle"]]
        for queue_name, done in actions.items():
            done += [idle_line(c) for c in idle if c["queue_name"] == queue_name]
            for line in done or ["nothing to do"]:   # a line each: what maint did, what blocks it, who is idle
                click.echo(f"{queue_name}: {line}")
        return
    ctx.source().close()
    jobs.run_maint(ctx.source, interval, StopFlag().install(), metrics)


@cli.command()
@click.argument("queue_name", metavar="QUEUE")
@click.argument("script", type=click.Path(dir_okay=False, path_type=Path))
@pass_ctx
def execute(ctx: Context, queue_name: str, script: Path) -> None:
    """Run SCRIPT (SQL) on the source in one transaction and queue its schema
    changes, in order with its row changes. Needed where event triggers could
    not be created; harmless where they exist.

    \b
    Example:
        replicator execute main migrations/2024_add_column.sql
    """
    from replicator.source.execute import execute_file

    with ctx.source() as source:
        queued = execute_file(source, queue_name, script)
    click.echo(f"{script} applied; {counted(queued, 'schema change')} queued")


@cli.command()
@click.argument("queue_name", metavar="[QUEUE]", required=False)
@click.option("--target", "target_url", required=True,
              help="sqlite:PATH (sqlite:PATH?numeric=text: numeric values as text), delta:PATH or "
                   "delta:s3://BUCKET/PREFIX (Delta Lake tables; delta:PATH?tables=portable: without deletion "
                   "vectors and column mapping, for Polars and delta-rs' to_pyarrow_table), jsonl:PATH, "
                   "jsonl:- (stdout), tsv:PATH or tsv:-, or kafka://BROKERS/PREFIX (publish Debezium-compatible "
                   "topics, docs/kafka.md).")
@click.option("--source", "source_url", metavar="kafka://BROKERS/PREFIX",
              help="Follow a publisher's Kafka topics instead of a queue of the source database (no QUEUE).")
@click.option("--consumer", "consumer_name",
              help="Consumer name; default derived from the target. A stream to stdout (jsonl:-, tsv:-) without it "
                   "is a temporary consumer, unregistered when the command ends.")
@click.option("--tables", help="Only these tables of the queue (T,...).")
@click.option("--skip-record", "skip_records", multiple=True, metavar="TOPIC:PARTITION:OFFSET",
              help="A follower passes over this record, one its publisher did not write, at which it stopped "
                   "(repeatable; docs/kafka.md).")
@click.option("--once", is_flag=True, help="Apply one batch and exit.")
@click.option("--until-caught-up", is_flag=True, help="Tick, apply everything committed before now, exit.")
@click.option("--recopy", is_flag=True,
              help="First rebuild the target in place: copy every table anew (a follower: from the topics), in "
                   "one target transaction.")
@click.option("--poll-interval", default=0.2, show_default=True, type=click.FloatRange(min=0),
              help="Seconds to wait when no batch is ready.")
@click.option("--stats-interval", default=30.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds between log lines of what was applied (batches, events, rows, lag); 0: a line a batch.")
@click.option("--progress-interval", default=10.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Seconds between log lines of a table's copy when stderr is not a terminal (a terminal shows "
                   "a progress bar).")
@_metrics_options
@click.option("--health-max-lag", default="5min", show_default=True,
              help="/health answers 503 when the consumer lags more than this (e.g. 30s, 5min).")
@click.option("--spark-master", help="delta: targets: Spark master for the views "
                                     "(default: $SPARK_MASTER, else local[*]).")
@click.option("--spark-conf", multiple=True, metavar="KEY=VALUE",
              help="delta: targets: a Spark setting for the views (repeatable).")
@click.option("--vacuum-every", metavar="DURATION",
              help="delta: targets: between batches, VACUUM the warehouse this often (e.g. 6h, 1d; at least 1min), "
                   "as `replicator delta vacuum` does, each table keeping its own retention; the first at the "
                   "start. Default: never (docs/delta.md).")
@pass_ctx
def consume(ctx: Context, queue_name: str | None, source_url: str | None, target_url: str,
            consumer_name: str | None, tables: str | None, skip_records: tuple[str, ...],
            once: bool, until_caught_up: bool, recopy: bool, poll_interval: float, stats_interval: float,
            progress_interval: float, metrics_port: int | None, metrics_address: str, health_max_lag: str,
            spark_master: str | None, spark_conf: tuple[str, ...], vacuum_every: str | None) -> None:
    """Replicate QUEUE into a target, exactly once. Runs as a daemon unless
    --once or --until-caught-up; SIGTERM/SIGINT finish the current batch and exit 0.
    A stream to stdout without --consumer copies every table, follows the queue and
    unregisters its temporary consumer when it ends; with --consumer it stays
    registered and a new run resumes from its position (at least once).
    --recopy rebuilds a target older than the queue keeps (or one wanted fresh)
    before it applies anything: a crash leaves the target as it was. A follower
    rebuilt so reads the topics as a new follower does (one behind by longer than
    they keep tombstones, or of topics made anew).

    \b
    Example:
        replicator consume main --target sqlite:replica.db
        replicator consume main --target jsonl:- --until-caught-up
        replicator consume main --target jsonl:- --consumer audit_feed
        replicator consume main --target delta:/data/warehouse
        replicator consume main --target delta:s3://lake/replica
        replicator consume main --target delta:s3://lake/replica --vacuum-every 1d
        replicator consume main --target sqlite:replica.db --recopy --until-caught-up
        replicator consume main --target sqlite:replica.db --metrics-port 9700 --health-max-lag 10min
        replicator consume main --target kafka://broker1:9092,broker2:9092/shop
        replicator consume --source kafka://broker1:9092/shop --target sqlite:cache.db --tables orders
        replicator consume --source kafka://broker1:9092/shop --target sqlite:cache.db --recopy
    """
    from replicator.consumer import Consumer, check_captured
    from replicator.targets import check_vacuum_every, open_target

    if once and until_caught_up:
        raise UserError("--once and --until-caught-up exclude each other")
    vacuum_seconds = parse_duration(vacuum_every).total_seconds() if vacuum_every is not None else None
    check_vacuum_every(target_url, vacuum_seconds)
    if source_url is not None:
        if queue_name is not None:
            raise UserError("give QUEUE or --source, not both: a follower of Kafka topics reads no queue")
        if consumer_name:
            raise UserError("--consumer applies to consumers of a queue, not to followers of Kafka topics (a "
                            "follower's position is kept in its target)")
        _follow(source_url, target_url, _split(tables) or None, skip_records, once=once,
                until_caught_up=until_caught_up, recopy=recopy,
                poll_interval=poll_interval, stats_interval=stats_interval, metrics_port=metrics_port,
                metrics_address=metrics_address, health_max_lag=parse_duration(health_max_lag).total_seconds(),
                spark_master=spark_master, spark_conf=_spark_conf(spark_conf), vacuum_every=vacuum_seconds)
        return
    if queue_name is None:
        raise UserError("give the QUEUE to replicate (or --source kafka://BROKERS/PREFIX to follow a publisher)")
    if skip_records:
        raise UserError("--skip-record applies to followers of Kafka topics (--source), not to consumers of a queue")
    if (spark_master or spark_conf) and not target_url.startswith("delta:"):
        raise UserError("--spark-master and --spark-conf apply to a delta: target only (Spark computes "
                        "their views)")
    max_lag = parse_duration(health_max_lag).total_seconds()
    with ctx.source() as source:   # a mistyped queue or table makes no target (opening one may create its file)
        check_captured(queue_name, _split(tables), source.tables(queue_name))
    target = open_target(target_url, spark_master=spark_master, spark_conf=_spark_conf(spark_conf),
                         vacuum_every=vacuum_seconds)
    consumer = Consumer(db.resolve_dsn(ctx.dsn), queue_name, target, name=consumer_name,
                        tables=_split(tables) or None, poll_interval=poll_interval, stats_interval=stats_interval,
                        recopy=recopy, progress_interval=progress_interval, health_max_lag=max_lag)
    stop = StopFlag() if once or until_caught_up else StopFlag().install()
    if consumer.temporary and (once or until_caught_up):
        # SIGTERM ends the run as Ctrl-C does, through the finally below, which unregisters it.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        _serve_metrics(consumer.metrics, metrics_address, metrics_port, once=False)
        consumer.run(once=once, until_caught_up=until_caught_up, stop=stop)
    finally:
        consumer.close()
        target.close()


def _follow(source_url: str, target_url: str, tables: list[str] | None, skip_records: tuple[str, ...], *,
            once: bool, until_caught_up: bool, recopy: bool,
            poll_interval: float, stats_interval: float, metrics_port: int | None, metrics_address: str,
            health_max_lag: float, spark_master: str | None, spark_conf: dict[str, str],
            vacuum_every: float | None) -> None:
    from replicator.targets import kafka_source, open_target

    settings = kafka_source(source_url)
    for record in skip_records:
        topic, _, offset = record.rpartition(":")
        if not (topic.rpartition(":")[0] and topic.rpartition(":")[2].isdigit() and offset.isdigit()):
            raise UserError(f"--skip-record {record}: give TOPIC:PARTITION:OFFSET, as the follower's error names it")
    if target_url.startswith("kafka:"):
        raise UserError("a follower writes a target of its own (sqlite:, delta:, jsonl:, tsv:), not Kafka")
    if recopy and target_url.startswith(("jsonl:", "tsv:")):
        raise UserError("--recopy rebuilds a SQLite or Delta target: a stream's lines, read as they come, cannot "
                        "be taken back; start a new stream (move the file and its state file aside)")
    # before the first Kafka request: a SIGTERM while the follower starts ends it at its first step
    stop = StopFlag() if once or until_caught_up else StopFlag().install()
    from replicator.follower.follower import Follower, wait_for_publisher  # kafka_source() found the kafka extra
    wait_for_publisher(settings, stop, waits=not (once or until_caught_up))
    if stop.is_set:
        return
    target = open_target(target_url, spark_master=spark_master, spark_conf=spark_conf, vacuum_every=vacuum_every)
    try:
        follower = Follower(settings, target, tables=tables, poll_interval=poll_interval,
                            stats_interval=stats_interval, health_max_lag=health_max_lag, skip=skip_records,
                            recopy=recopy)
        try:
            _serve_metrics(follower.metrics, metrics_address, metrics_port, once=False)
            follower.run(once=once, until_caught_up=until_caught_up, stop=stop)
        finally:
            follower.close()
    finally:
        target.close()


def _spark_conf(pairs: tuple[str, ...]) -> dict[str, str]:
    """--spark-conf's KEY=VALUE strings as a dict."""
    conf: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise UserError(f"invalid --spark-conf {pair!r}: use KEY=VALUE")
        conf[key.strip()] = value.strip()
    return conf


@cli.group()
def delta() -> None:
    """Delta warehouse maintenance and inspection (targets delta:PATH or delta:URI)."""


@delta.command("tables")
@click.option("--target", "target_url", required=True, help="delta:PATH or delta:URI, the warehouse.")
@click.option("--tick", type=click.IntRange(min=1), help="The versions tick N left (time travel), instead of now.")
@click.option("--consumer", "consumer_name", metavar="QUEUE/CONSUMER",
              help="With --tick: whose ticks, when several consumers write the warehouse.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def delta_tables(target_url: str, tick: int | None, consumer_name: str | None, as_json: bool) -> None:
    """List the warehouse's tables and views and where they are: each a Delta table
    any Delta reader opens. With --tick, the version of each as tick N left it: read
    them at those versions (versionAsOf) to see every table as of that tick (a view:
    its last refresh at or before tick N).

    \b
    Example:
        replicator delta tables --target delta:/data/warehouse
        replicator delta tables --target delta:/data/warehouse --tick 1200 --json
    """
    from replicator.targets import delta_uris, delta_versions

    rows: list[dict[str, Any]]
    views: list[dict[str, Any]]
    if tick is None:
        table_uris, view_uris = delta_uris(target_url)
        rows = [{"table": name, "uri": uri} for name, uri in table_uris.items()]
        views = [{"view": name, "uri": uri} for name, uri in view_uris.items()]
    else:
        table_versions, view_versions = delta_versions(target_url, tick, consumer_name)
        rows = [{"table": name, "uri": uri, "version": version} for name, (uri, version) in table_versions.items()]
        views = [{"view": name, "uri": uri, "version": version} for name, (uri, version) in view_versions.items()]
    if as_json:
        click.echo(json.dumps(rows + views, indent=2))
    else:
        _print_rows(rows)
        if views:
            _print_rows(views)


@delta.command("optimize")
@click.option("--target", "target_url", required=True, help="delta:PATH or delta:URI, the warehouse.")
@click.option("--table", "tables", multiple=True, help="Only this table (schema.table); repeatable.")
@click.option("--purge", is_flag=True, help="Also rewrite every file with deleted rows (not only those past 20%).")
def delta_optimize(target_url: str, tables: tuple[str, ...], purge: bool) -> None:
    """Rewrite the small files batches append, and the files with many deleted rows,
    into large files (Delta OPTIMIZE; readers see the same rows throughout). The
    consumer does this by itself as files accumulate; safe while it runs.

    \b
    Example:
        replicator delta optimize --target delta:/data/warehouse
        replicator delta optimize --target delta:s3://lake/replica --table public.orders --purge
    """
    from replicator.targets import delta_optimize

    done = delta_optimize(target_url, list(tables) or None, everything=purge)
    for d in done:
        click.echo(f"{d.table}: {counted(d.files, 'file')} into {counted(d.written, 'file')} "
                   f"({counted(d.rows, 'row')}) in {d.seconds:.1f}s"
                   + ("" if d.committed else " (not committed: the consumer changed them meanwhile; run again)"))
    if not done:
        click.echo("nothing to optimize")


@delta.command("vacuum")
@click.option("--target", "target_url", required=True, help="delta:PATH or delta:URI, the warehouse.")
@click.option("--retain", help="Keep files removed less than this long ago (time travel within it still works); "
                               "default: each table's delta.deletedFileRetentionDuration (7d unless set).")
@click.option("--force", is_flag=True, help="Take a --retain shorter than a table's retention (at least 1s).")
@click.option("--dry-run", is_flag=True, help="Say what would be deleted, delete nothing.")
def delta_vacuum(target_url: str, retain: str | None, force: bool, dry_run: bool) -> None:
    """Delete the files no current table version uses, once removed longer than --retain
    ago, and old log entries (Delta VACUUM). Only files of the names Delta writers give are
    deleted; a file no version ever named (a copy still writing it) only directly in a table's
    directory, once older than the table's retention and 7 days.

    \b
    Example:
        replicator delta vacuum --target delta:/data/warehouse --dry-run
        replicator delta vacuum --target delta:s3://lake/replica --retain 30d
    """
    from replicator.targets import delta_vacuum

    retention = parse_duration(retain).total_seconds() if retain is not None else None
    done = delta_vacuum(target_url, retention=retention, force=force, dry_run=dry_run)
    for d in done:
        click.echo(f"{d.table}: {counted(d.files, 'file')} ({d.bytes:,} bytes) "
                   f"{'would be ' if dry_run else ''}deleted")
    if not done:
        click.echo("nothing to delete")


@cli.command()
@click.argument("role")
@pass_ctx
def grant(ctx: Context, role: str) -> None:
    """Let ROLE run consumers with least privilege: read queues, events and
    captured tables, keep its own position. Run it again after adding tables.

    \b
    Example:
        replicator grant replica_reader
    """
    with ctx.source() as source:
        tables = source.grant_consumer(role)
    click.echo(f"{role} may consume; it reads {counted(tables, 'captured table')}")


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def status(ctx: Context, as_json: bool) -> None:
    """Show queues, tables, followed schemas, consumers, their lag, and what blocks rotation.

    \b
    Example:
        replicator status --json
    """
    from replicator.source.status import status as collect

    with ctx.source() as source:
        report = collect(source)
    if as_json:
        click.echo(json.dumps(report, default=_json_default, indent=2))
        return
    _print_rows([{"queue": q["queue"], "tables": q["tables"], "consumers": q["consumers"],
                  "current table": f"{q['current_table']}/{q['ntables']}",
                  "last switch": _timestamp(q["last_switch"]),
                  "last tick": q["last_tick"], "last tick age": _age(q["last_tick_age"]),
                  "events since tick": q["events_since_tick"]}
                 for q in report["queues"]], "queues")
    if report["queues"] and not any(t["running"] for t in report["tickers"]):
        click.echo(f"no ticker running: {_last_ticker(report['tickers'])}; batches are cut only by forced ticks"
                   f" (start `replicator ticker`)")
    _print_rows(report["tables"], "tables")
    if report["schemas"]:
        _print_rows(_schema_rows(report["schemas"]), "followed schemas")
    _print_rows([{"queue": c["queue"], "consumer": c["consumer"], "owner": c["owner"],
                  "last tick": c["last_tick"], "lag ticks": c["lag_ticks"], "lag events": c["lag_events"],
                  "lag seconds": f"{c['lag_seconds']:.1f}", "batch open": c["batch_open"],
                  "last seen": f"{_age(c['idle_seconds'])} ago", "state": _consumer_state(c)}
                 for c in report["consumers"]], "consumers")
    copies = [{"queue": c["queue"], "consumer": c["consumer"], **_copy_row(c["copy"])}
              for c in report["consumers"] if c["copy"]]
    if copies:
        _print_rows(copies, "copies running")
    blockers = [{"queue": q["queue"], **b} for q in report["queues"] for b in q["rotation_blockers"]]
    if blockers:
        _print_rows(blockers, "rotation blocked by")


def _last_ticker(tickers: list[dict[str, Any]]) -> str:
    if not tickers:
        return "none has left a heartbeat in the last day"
    last = tickers[0]
    return f"the last one seen, pid {last['pid']} on {last['host']}, {_timestamp(last['last_seen'])}"


def _consumer_state(consumer: dict[str, Any]) -> str:
    """idle, connected; temporary (a stdout stream's, unregistered when it ends or by maint once idle)."""
    state = "idle" if consumer["idle"] else "connected" if consumer["connected"] else ""
    return ", ".join(filter(None, [state, "temporary" if consumer["temporary"] else ""]))


def _copy_row(copy: dict[str, Any]) -> dict[str, Any]:
    """A running copy as status shows it; its age since the consumer last updated it tells
    a consumer killed mid-copy (which clears it when it starts again)."""
    from replicator.source.table_copy import progress_line

    seconds = (copy["updated"] - copy["started"]).total_seconds()
    return {"table": copy["table"], "progress": progress_line(copy["rows"], copy["estimated_rows"] or 0, seconds),
            "started": _timestamp(copy["started"]),
            "updated": f"{copy['seconds_since_update']:.0f}s ago"}


# views -------------------------------------------------------------------------

@cli.group()
def view() -> None:
    """Incremental views: SQL views of a SQLite, Delta or Spark target kept current after every batch."""


def _view_sql(sql: str) -> str:
    """--sql TEXT, or --sql @FILE."""
    if sql.startswith("@"):
        if not sql[1:]:
            raise UserError("--sql @ needs a file name: --sql @FILE")
        try:
            return Path(sql[1:]).read_text()
        except OSError as exc:
            raise UserError(f"cannot read {sql[1:]}: {exc.strerror}") from None
    return sql


def _reason_line(reason: dict[str, Any] | None) -> str:
    if not reason:
        return ""
    fragment = f" (at: {reason['fragment']})" if reason.get("fragment") else ""
    return f"{reason['code']}: {reason['message']}{fragment}"


_TARGET_HELP = "sqlite:PATH or delta:PATH|URI, the replica the view reads."
_POLICY_HELP = ("auto: incremental when the query allows it, else (and for large changes) a full refresh; "
                "incremental: refuse queries that cannot be; full: always recompute.")


@view.command("create")
@click.argument("name")
@click.option("--target", "target_url", required=True, help=_TARGET_HELP)
@click.option("--sql", "sql", required=True,
              help="The defining SELECT, in the target's dialect: SQLite or Spark SQL (or @FILE).")
@click.option("--policy", type=click.Choice(["auto", "incremental", "full"]), default="auto", show_default=True,
              help=_POLICY_HELP)
def view_create(name: str, target_url: str, sql: str, policy: str) -> None:
    """Create view NAME over replicated tables and compute it now. `replicator
    consume` keeps it current after every batch, in the batch's transaction.

    \b
    Example:
        replicator view create sales_by_customer --target sqlite:replica.db \\
            --sql "SELECT customer_id, count(*) AS orders, sum(amount) AS total FROM orders GROUP BY customer_id"
    """
    from replicator.targets import open_views

    with open_views(target_url) as views:
        info = views.create(name, _view_sql(sql), policy)
    if info["maintenance"] == "incremental":
        how = "maintained incrementally"
    else:
        reason = {'code': info['reason'], 'message': info['reason_message'], 'fragment': info['fragment']}
        how = f"refreshed in full after each batch ({_reason_line(reason)})"
    click.echo(f"view {info['view']} created: {counted(info['rows'], 'row')}, {how}")


@view.command("explain")
@click.argument("name", required=False)
@click.option("--target", "target_url", required=True, help=_TARGET_HELP)
@click.option("--sql", "sql", help="The SELECT to explain (or @FILE); default: the SQL of view NAME.")
@click.option("--policy", type=click.Choice(["auto", "incremental", "full"]), default="auto", show_default=True,
              help=_POLICY_HELP)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output, with the generated SQL.")
def view_explain(name: str | None, target_url: str, sql: str | None, policy: str, as_json: bool) -> None:
    """Say whether a query can be maintained incrementally, and if not, why
    (reason code and the SQL fragment at fault). Changes nothing.

    \b
    Example:
        replicator view explain --target sqlite:replica.db --sql "SELECT * FROM orders LIMIT 10"
        replicator view explain sales_by_customer --target sqlite:replica.db
    """
    from replicator.targets import open_views

    if name is not None and sql is not None:
        raise UserError("name a view or give the query with --sql, not both")
    if name is None and sql is None:
        raise UserError("name a view, or give the query with --sql")
    with open_views(target_url) as views:
        if name is not None:
            sql = views.info(name)["sql"]
        assert sql is not None   # NAME or --sql: checked above
        result = views.explain(_view_sql(sql), policy)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    if result["maintenance"] == "incremental":
        click.echo(f"incremental: {result['kind']} view, maintained by key ({result['keys']})")
        click.echo(f"tables: {', '.join(result['tables'])}")
        if result["indexes"]:
            click.echo(f"indexes used: {', '.join(result['indexes'])}")
    else:
        verdict = "refused with --policy incremental" if result["maintenance"] == "refused" else \
            "full refresh after each batch that changes its tables"
        click.echo(f"not incremental: {verdict}")
        shown = result["reasons"] or ([result["reason"]] if result["reason"] else [])
        for reason in shown:
            click.echo(f"  {_reason_line(reason)}")
    for note in result["notes"]:
        click.echo(f"note: {note}")


@view.command("list")
@click.option("--target", "target_url", required=True, help=_TARGET_HELP)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def view_list(target_url: str, as_json: bool) -> None:
    """List the target's views: how each is maintained and why, its last refresh.

    \b
    Example:
        replicator view list --target sqlite:replica.db
    """
    from replicator.targets import open_views

    with open_views(target_url) as views:
        rows = views.list()
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("(no views)")
        return
    width = max(len(v["view"]) for v in rows)
    for v in rows:
        status = "ok" if v["status"] == "ok" else f"STALE: {v['status_reason']}"
        if v.get("tick") is not None:   # a Delta warehouse's view: as of its own tick
            status += f", as of tick {v['tick']}" + (" (behind the tables: the consumer catches it up)"
                                                     if v.get("behind") else "")
        click.echo(f"{v['view']:<{width}}  {v['maintenance']} (policy {v['policy']}), {counted(v['rows'], 'row')},"
                   f" {status}")
        last = v["last_refresh"]
        if last:
            done = last["kind"] + (f" ({last['reason'].split(':')[0]})" if last.get("reason") else "")
            if last.get("keys") is not None:
                done += f", {counted(last['keys'], 'key')}"
            done += (f", -{last['rows_deleted']} +{last['rows_inserted']} ~{last['rows_updated'] or 0} rows"
                     f" in {last['seconds'] * 1000:.1f} ms at {last['at']}")
            click.echo(f"{'':<{width}}  last refresh: {done}")
        if v["reason"]:
            click.echo(f"{'':<{width}}  why full: {v['reason']}: {v['reason_message']} (at: {v['fragment']})")


@view.command("refresh")
@click.argument("name")
@click.option("--target", "target_url", required=True, help=_TARGET_HELP)
@click.option("--full", is_flag=True, help="Recompute it even if it is up to date.")
def view_refresh(name: str, target_url: str, full: bool) -> None:
    """Recompute view NAME if it needs it (stale after a schema change, or
    maintained in full), or always with --full.

    \b
    Example:
        replicator view refresh sales_by_customer --target sqlite:replica.db --full
    """
    from replicator.targets import open_views

    with open_views(target_url) as views:
        info, recomputed = views.refresh_now(name, full=full)
    if recomputed:
        click.echo(f"view {info['view']} recomputed: {counted(info['rows'], 'row')}")
    else:
        click.echo(f"view {info['view']} is up to date (maintained incrementally after every batch); "
                   f"--full recomputes it")


@view.command("drop")
@click.argument("name")
@click.option("--target", "target_url", required=True, help=_TARGET_HELP)
def view_drop(name: str, target_url: str) -> None:
    """Drop view NAME and what it stored. The replicated tables are untouched.

    \b
    Example:
        replicator view drop sales_by_customer --target sqlite:replica.db
    """
    from replicator.targets import open_views

    with open_views(target_url) as views:
        views.drop(name)
    click.echo(f"view {name} dropped")


def _command_named(args: list[str]) -> str:
    """The command path the arguments name, for the errors click raises without a
    context (an option missing its value)."""
    path = ["replicator"]
    command: click.Command = cli
    for arg in args:
        if isinstance(command, click.Group) and arg in command.commands:
            command = command.commands[arg]
            path.append(arg)
    return " ".join(path)


_verbose_after_the_command(cli)


def main() -> NoReturn:
    # A fatal signal (SIGBUS, SIGSEGV) is reported with the stack it hit, not in silence:
    # SQLite maps a replica's -shm file, and a page of it that is cut off or cannot be
    # allocated under the process kills it with SIGBUS (the SQLite target checks its files
    # before each batch; a change in the middle of one is met there).
    faulthandler.enable(all_threads=True)
    try:
        _run()
    except SystemExit as exc:
        _exit(exc.code)
    _exit(0)


def _exit(code: str | int | None) -> NoReturn:
    """Ends the process as sys.exit(code) would. Once Arrow has run (a Delta target), the C++ teardown
    of its thread pools can abort the process after its work is done (SIGABRT, "terminate called without
    an active exception": apache/arrow#34314): then the interpreter's own exit steps run (threads
    joined, exit handlers), and the process ends without the C++ ones."""
    if "pyarrow" not in sys.modules:
        sys.exit(code)
    if isinstance(code, str):
        click.echo(code, err=True)
    getattr(threading, "_shutdown")()   # noqa: B009 (not in typeshed): what the interpreter's exit does first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError):   # a reader gone (| head): what it took is all it wanted
            stream.flush()
    os._exit(1 if isinstance(code, str) else code or 0)


def _run() -> None:
    """The command line's command; a mistake is one line and a non-zero exit."""
    try:
        cli(standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.UsageError as exc:
        # One line, like every other mistake, naming where the full usage is.
        command = exc.ctx.command_path if exc.ctx else _command_named(sys.argv[1:])
        _fail(f"{exc.format_message()} (see: {command} --help)", exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except UserError as exc:
        _fail(str(exc))
    except psycopg.Error as exc:
        message = (exc.diag.message_primary if getattr(exc, "diag", None) and exc.diag.message_primary
                   else first_line(exc))
        _fail(f"database: {message}")
    except sqlite3.Error as exc:
        from replicator.targets.sqlite.target import sqlite_error
        _fail(f"sqlite: {sqlite_error(exc)}")
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename else ""
        _fail(f"{exc.strerror or exc}{where}")
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:
        # A bug, not a mistake of the user's: one line still, the traceback on request.
        if os.environ.get("REPLICATOR_DEBUG"):
            raise
        _fail(f"internal error: {type(exc).__name__}: {exc} (REPLICATOR_DEBUG=1 shows the traceback; please "
              f"report it)")


def _fail(message: str, status: int = 1) -> NoReturn:
    """An error as one line on stderr (control characters escaped: a name holding a newline cannot
    split it), then exit."""
    click.echo(f"error: {printable(message)}", err=True)
    sys.exit(status)
