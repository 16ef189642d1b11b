"""The real `replicator` console script: every mistake a user can make ends in one
line on stderr and a non-zero exit, never a traceback; and the happy path works."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg
import pytest

from replicator.errors import UserError
from replicator.source import db
from replicator.source.db import parse_dsn

SCRIPT = Path(sys.executable).parent / "replicator"


def run(*args: str, dsn: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG") and k != "REPLICATOR_DSN"}
    env.update(COLUMNS="200", NO_COLOR="1")
    command = [str(SCRIPT), *(["--dsn", dsn] if dsn is not None else []), *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)


def run_all(commands: list[list[str]], dsn: str) -> list[subprocess.CompletedProcess[str]]:
    """Runs independent invocations side by side (each one is a fresh interpreter)."""
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda args: run(*args, dsn=dsn), commands))


def assert_user_error(result: subprocess.CompletedProcess[str], *fragments: str) -> str:
    """Exit 1, exactly one line on stderr, starting with "error:" and naming the problem."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert result.returncode == 1, (result.returncode, result.stderr)
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def assert_usage_error(result: subprocess.CompletedProcess[str], *fragments: str) -> str:
    """A mistake in the command line itself: exit 2 (click's), one line on stderr
    naming the problem and where the usage is."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--help)" in lines[0], result.stderr
    assert result.returncode == 2, (result.returncode, result.stderr)
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


@pytest.fixture
def app(dsn):
    """A database with replicator installed, queue "q" and two application tables."""
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute('CREATE TABLE "orders" ("id" int PRIMARY KEY, "v" text)')
        c.execute('CREATE TABLE "nokey" ("id" int, "v" text)')
        c.execute("SELECT replicator.create_queue('q')")
    return dsn


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_is_one_line(tmp_path):
    dsn = f"host=127.0.0.1 port={_free_port()} user=postgres dbname=nowhere connect_timeout=5"
    for result in run_all([["install"], ["ticker"]], dsn):
        assert_user_error(result, "cannot connect to", dsn)


def test_a_password_in_the_dsn_is_masked_in_errors():
    port = _free_port()
    for dsn in (f"postgresql://postgres:s3cret@127.0.0.1:{port}/nowhere?connect_timeout=5",
                f"host=127.0.0.1 port={port} user=postgres password=s3cret dbname=nowhere connect_timeout=5"):
        for result in run_all([["status"], ["ticker"]], dsn):
            line = assert_user_error(result, "cannot connect to", "password=***", f"port={port}")
            assert "s3cret" not in result.stderr, line


def test_malformed_dsn_is_one_line():
    assert_user_error(run("status", dsn="host=127.0.0.1 no_such_option=1"), "no_such_option")


def test_dsn_from_the_environment(app):
    env_run = subprocess.run([str(SCRIPT), "queue", "list", "--json"], capture_output=True, text=True,
                             env={**os.environ, "REPLICATOR_DSN": app}, timeout=60)
    assert env_run.returncode == 0, env_run.stderr
    assert [q["queue"] for q in json.loads(env_run.stdout)] == ["q"]


def test_schema_not_installed_is_one_line(empty_dsn):
    for result in run_all([["table", "add", "q", "t"], ["ticker"]], empty_dsn):
        assert_user_error(result, "replicator is not installed", "replicator install")


def test_unknown_queue_is_one_line_and_consume_makes_no_replica_for_it(app, tmp_path):
    replica = tmp_path / "r.db"
    for result in run_all([["table", "add", "nope", "orders"], ["queue", "drop", "nope"],
                           ["consume", "nope", "--target", f"sqlite:{replica}", "--until-caught-up"]], app):
        assert_user_error(result, 'queue "nope" does not exist')
    assert_user_error(run("consume", "q", "--target", f"sqlite:{replica}", "--tables", "orders,nope", dsn=app),
                      "queue 'q' does not capture orders, nope")
    assert not replica.exists()


def test_unknown_table_is_one_line(app):
    missing, dotted, removed = run_all([
        ["table", "add", "q", "public.no_such_table"], ["table", "add", "q", "a.b.c.d"],
        ["table", "remove", "q", "orders"]], app)
    assert_user_error(missing, "public.no_such_table does not exist")
    assert_user_error(dotted, "a.b.c.d")
    assert_user_error(removed, 'table orders is not in queue "q"')


def test_key_ignore_and_where_are_refused_with_a_schema_rather_than_ignored(app):
    with psycopg.connect(app, autocommit=True) as c:
        c.execute("CREATE SCHEMA sales")
    results = run_all([["table", "add", "q", "--schema", "sales", option, value]
                       for option, value in (("--key", "id"), ("--ignore", "v"), ("--where", "id > 0"))], app)
    for result in results:
        assert_user_error(result, "apply to the tables named, not to a schema's")
    assert run("table", "list", "q", dsn=app).stdout == "(no tables)\n"       # nor a schema followed


def test_a_table_is_removed_by_the_name_table_list_shows(app):
    with psycopg.connect(app, autocommit=True) as c:
        c.execute('CREATE TABLE "Mixed Case" (id int PRIMARY KEY); CREATE TABLE "Camel" (id int PRIMARY KEY)')
    assert run("table", "add", "q", '"Mixed Case"', '"Camel"', dsn=app).returncode == 0
    listed = json.loads(run("table", "list", "q", "--json", dsn=app).stdout)
    assert {t["table"] for t in listed} == {"public.Mixed Case", "public.Camel"}
    for shown in ("public.Mixed Case", "public.Camel"):   # as shown, not SQL syntax
        removed = run("table", "remove", "q", shown, dsn=app)
        assert removed.returncode == 0, removed.stderr
    assert json.loads(run("table", "list", "q", "--json", dsn=app).stdout) == []
    assert_user_error(run("table", "remove", "q", "public.Mixed Case", dsn=app), "is not in queue")


def test_duplicate_queue_and_table_are_one_line(app):
    assert_user_error(run("queue", "create", "q", dsn=app), 'queue "q" already exists')
    assert run("table", "add", "q", "orders", dsn=app).returncode == 0
    assert_user_error(run("table", "add", "q", "orders", dsn=app), "already in queue")


def test_an_option_missing_its_value_points_to_its_command_help():
    assert_usage_error(run("view", "create", "v", "--target", "sqlite:r.db", "--sql"), "'--sql' requires an argument",
                       "(see: replicator view create --help)")


def test_the_spark_warehouse_it_replaced_is_refused_with_the_way_to_delta(app, tmp_path):
    for args in (["view", "list", "--target", f"spark:{tmp_path}"], ["consume", "q", "--target", f"spark:{tmp_path}", "--once"]):
        assert_user_error(run(*args, dsn=app), "the spark: warehouse is replaced by Delta Lake tables",
                          f"--target delta:{tmp_path}")
    assert list(tmp_path.iterdir()) == []


def test_views_on_a_delta_warehouse_without_the_spark_extra_name_the_extra(app, tmp_path):
    # what a plain install (no pyspark) does: the import fails
    blocked = ("import sys; sys.modules['pyspark'] = None; sys.argv[0] = 'replicator';"
               " from replicator.cli import main; main()")
    assert run("consume", "q", "--target", f"delta:{tmp_path}", "--until-caught-up", dsn=app).returncode == 0
    result = subprocess.run([sys.executable, "-c", blocked, "view", "create", "v", "--target", f"delta:{tmp_path}",
                             "--sql", "SELECT count(*) AS n FROM orders"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "REPLICATOR_DSN": app})
    assert_user_error(result, "Spark (views on a Delta warehouse, reading it from Spark) needs",
                      "pip install 'replicator[spark]'")


def test_bad_options_are_refused(app):
    mode, tables, period, few, where, ignore, nothing, command = run_all([
        ["table", "add", "q", "orders", "--mode", "everything"], ["queue", "create", "r", "--tables", "many"],
        ["queue", "create", "r", "--rotation-period", "soon"], ["queue", "create", "r", "--tables", "1"],
        ["table", "add", "q", "orders", "--where", "no_such_column > 1"],
        ["table", "add", "q", "orders", "--ignore", "id"], ["table", "add", "q"], ["no-such-command"]], app)
    assert_usage_error(mode, "--mode", "everything", "replicator table add --help")
    assert_usage_error(tables, "--tables")
    assert_user_error(period, "invalid duration")
    assert_user_error(few, "between 2 and 100")
    assert_user_error(where, "invalid row filter")
    assert_user_error(ignore, "cannot be ignored")
    assert_user_error(nothing, "name the tables")
    assert_usage_error(command, "no-such-command")
    infinite, huge, many, interval, poll = run_all([
        ["queue", "create", "r", "--rotation-period", "inf"], ["queue", "create", "r", "--rotation-period", "1e20"],
        ["queue", "create", "r", "--tables", "3000000000"], ["ticker", "--interval", "-1"],
        ["consume", "q", "--target", "jsonl:-", "--poll-interval", "-0.5"]], app)
    assert_user_error(infinite, "invalid duration 'inf'")
    assert_user_error(huge, "invalid duration '1e20'")
    assert_user_error(many, "out of range")
    assert_usage_error(interval, "--interval", "-1")
    assert_usage_error(poll, "--poll-interval")


def test_user_text_that_would_run_sql_of_its_own_is_refused_in_one_line_and_runs_nothing(app):
    """Issue 15: a --where filter ran stacked statements while it was checked (a file written by
    the server, as the installing superuser). A filter, a table name: one expression, one name."""
    marker = Path(tempfile.gettempdir()) / f"replicator-cli-{uuid.uuid4().hex}"
    with psycopg.connect(app, autocommit=True) as c:   # the server can write there
        # (a program that reads the rows: touch may exit before the server writes to its pipe, which
        # then fails the COPY with "could not close pipe to external command: Broken pipe")
        c.execute(f"COPY (SELECT 1) TO PROGRAM 'cat > {marker}'")
    assert marker.exists()
    marker.unlink()
    try:
        issue, dropping, comment, wrapper, table_name, schema = run_all([
            ["table", "add", "q", "nokey", "--key", "id", "--where",
             f"true) LIMIT 0; COPY (SELECT 1) TO PROGRAM 'touch {marker}'; SELECT 1 WHERE (true"],
            ["table", "add", "q", "nokey", "--key", "id", "--where",
             'true) LIMIT 0; DROP TABLE "public"."orders"; SELECT 1 WHERE (true'],
            ["table", "add", "q", "orders", "--where", '"id" > 0) --'],        # swallows the wrapper's )
            ["table", "add", "q", "orders", "--where", "true) OR (true"],      # closes the wrapper's (
            ["table", "add", "q", 'orders; DROP TABLE "public"."nokey"'],
            ["table", "add", "q", "--schema", 'public; DROP TABLE "public"."nokey"']], app)
        assert not marker.exists()
        for result in (issue, dropping, comment, wrapper):
            assert_user_error(result, "invalid row filter")
        assert_user_error(table_name, "invalid table name")
        assert_user_error(schema, 'schema public; DROP TABLE "public"."nokey" does not exist')
    finally:
        marker.unlink(missing_ok=True)
    with psycopg.connect(app, autocommit=True) as c:
        assert c.execute("SELECT to_regclass('public.orders'), to_regclass('public.nokey')").fetchone() == (
            "orders", "nokey")
        assert c.execute("SELECT count(*) FROM replicator.captured_table").fetchone() == (0,)
        assert c.execute("SELECT count(*) FROM pg_trigger WHERE NOT tgisinternal").fetchone() == (0,)


def test_a_where_with_semicolons_dollar_quotes_and_parentheses_inside_is_accepted(app):
    added = run("table", "add", "q", "orders", "--where",
                "(v <> 'a;b' AND id IN (1, (2), 3)) OR v = $$x); DROP TABLE orders; --$$ OR pg_catalog.length(v) > 9",
                dsn=app)
    assert added.returncode == 0, added.stderr
    listed = json.loads(run("table", "list", "q", "--json", dsn=app).stdout)
    assert listed[0]["where"] == ("(v <> 'a;b' AND id IN (1, (2), 3)) OR v = $$x); DROP TABLE orders; --$$"
                                  " OR pg_catalog.length(v) > 9")


def test_queue_ticker_settings_at_create_and_with_config(app):
    created = run("queue", "create", "fast", "--ticker-max-count", "50", "--ticker-max-lag", "250ms",
                  "--ticker-idle-period", "10s", dsn=app)
    assert created.returncode == 0, created.stderr
    shown = json.loads(run("queue", "config", "fast", "--json", dsn=app).stdout)
    assert shown == {"ticker_max_count": 50, "ticker_max_lag": 0.25, "ticker_idle_period": 10.0,
                     "rotation_period": 7200.0, "consumer_idle_limit": 3600.0, "ntables": 3}   # durations in seconds
    changed = run("queue", "config", "fast", "--ticker-max-lag", "0.5", "--rotation-period", "30min",
                  "--consumer-idle-limit", "2d", dsn=app)
    assert changed.returncode == 0, changed.stderr
    assert ("ticker_max_lag: 500ms" in changed.stdout and "rotation_period: 30min" in changed.stdout
            and "consumer_idle_limit: 2d" in changed.stdout)   # as written
    with psycopg.connect(app, autocommit=True) as c:   # the ticker reads what was set
        assert c.execute("SELECT queue_ticker_max_count, queue_ticker_max_lag::text FROM replicator.queue"
                         " WHERE queue_name = 'fast'").fetchone() == (50, "00:00:00.5")
    zero, negative, unknown, bad = run_all([
        ["queue", "config", "fast", "--ticker-max-count", "0"], ["queue", "config", "fast", "--ticker-max-lag", "-1"],
        ["queue", "config", "nope", "--ticker-max-count", "5"], ["queue", "create", "r", "--ticker-max-lag", "soon"]],
        app)
    assert_user_error(zero, "ticker_max_count must be a positive integer")
    assert_user_error(negative, "ticker_max_lag must be positive")
    assert_user_error(unknown, 'queue "nope"')
    assert_user_error(bad, "invalid duration")
    with psycopg.connect(app, autocommit=True) as c:   # a refused create leaves no queue behind
        assert c.execute("SELECT count(*) FROM replicator.queue WHERE queue_name = 'r'").fetchone()[0] == 0


def test_table_without_key_is_one_line_and_adds_nothing(app):
    line = assert_user_error(run("table", "add", "q", "orders", "nokey", dsn=app))
    assert line == "error: table public.nokey has no primary key: give the key columns with --key COL,..."
    # One transaction: orders, named before the refused table, was not added either.
    tables = json.loads(run("table", "list", "q", "--json", dsn=app).stdout)
    assert tables == []
    result = run("table", "add", "q", "nokey", "--key", "id", dsn=app)
    assert result.returncode == 0, result.stderr


def test_uninstall_needs_yes(app):
    assert_user_error(run("uninstall", dsn=app), "--yes")
    with psycopg.connect(app) as c:                       # nothing was removed
        assert c.execute("SELECT to_regnamespace('replicator') IS NOT NULL").fetchone()[0]


def test_happy_path(empty_dsn):
    def ok(*args: str) -> str:
        result = run(*args, dsn=empty_dsn)
        assert result.returncode == 0, (args, result.stderr)
        assert "Traceback" not in result.stderr and "error" not in result.stderr.lower(), result.stderr
        return result.stdout

    with psycopg.connect(empty_dsn, autocommit=True) as c:
        c.execute('CREATE TABLE "orders" ("id" int PRIMARY KEY, "v" text, "seen" timestamptz)')
    assert "replicator schema at version" in ok("install")
    assert "applied migrations" not in ok("install")
    assert "queue main created" in ok("queue", "create", "main", "--rotation-period", "30min", "--tables", "4")
    assert "1 table added to queue main" in ok("table", "add", "main", "public.orders", "--ignore", "seen")
    assert json.loads(ok("table", "list", "main", "--json")) == [
        {"queue": "main", "table": "public.orders", "mode": "full", "key": ["id"], "ignore": ["seen"],
         "where": None, "old_rows": False, "capture": "statement", "rows_per_statement": None, "suspended": None}]
    with psycopg.connect(empty_dsn, autocommit=True) as c:
        c.execute("SELECT replicator.register_consumer('main', 'reader')")
        c.execute("""INSERT INTO "orders" VALUES (1, 'a', now()), (2, 'b', now())""")
    assert ok("ticker", "--once").strip() == "1 tick"

    report = json.loads(ok("status", "--json"))
    (queue,) = report["queues"]
    assert (queue["queue"], queue["ntables"], queue["tables"], queue["consumers"]) == ("main", 4, 1, 1)
    assert queue["rotation_blockers"] == []
    (consumer,) = report["consumers"]
    assert (consumer["consumer"], consumer["lag_ticks"], consumer["lag_events"]) == ("reader", 1, 1)
    assert "main" in ok("status")
    assert "main" in ok("queue", "list")

    assert ok("maint", "--once").startswith("main: ")
    assert "1 table removed from queue main" in ok("table", "remove", "main", "public.orders")
    refused = run("queue", "drop", "main", dsn=empty_dsn)          # a consumer is registered
    assert_user_error(refused, "queue main has consumers (reader)", "--force")
    assert "consumer reader of queue main unregistered" in ok("queue", "unregister", "main", "reader")
    assert_user_error(run("queue", "unregister", "main", "reader", dsn=empty_dsn), "no consumer 'reader'")
    assert "queue main dropped" in ok("queue", "drop", "main")
    ok("queue", "create", "other")
    with psycopg.connect(empty_dsn, autocommit=True) as c:
        c.execute("SELECT replicator.register_consumer('other', 'gone')")
    assert "queue other dropped" in ok("queue", "drop", "other", "--force")
    assert json.loads(ok("queue", "list", "--json")) == []
    assert "replicator uninstalled" in ok("uninstall", "--yes")
    with psycopg.connect(empty_dsn) as c:
        assert c.execute("SELECT to_regnamespace('replicator')").fetchone()[0] is None
        assert c.execute('SELECT count(*) FROM "orders"').fetchone()[0] == 2


def test_a_table_name_that_needs_quotes_is_refused_saying_how_to_quote_it(app):
    with psycopg.connect(app, autocommit=True) as c:
        c.execute('CREATE SCHEMA sales; CREATE TABLE sales."Edge Case" (id int PRIMARY KEY)')
    assert_user_error(run("table", "add", "q", "sales.Edge Case", dsn=app),
                      "invalid table name: sales.Edge Case", 'written quoted, as in SQL: s."Edge Case"')
    assert run("table", "add", "q", 'sales."Edge Case"', dsn=app).returncode == 0


def test_verbose_works_after_the_command_as_before_it(app, tmp_path):
    with psycopg.connect(app, autocommit=True) as c:
        c.execute("SELECT replicator.add_table('q', 'orders')")
        c.execute("INSERT INTO orders VALUES (1, 'a')")
    for n, args in enumerate((["-v", "consume", "q"], ["consume", "q", "-v"])):
        result = run(*args, "--target", f"jsonl:{tmp_path / f'{n}.jsonl'}", "--until-caught-up", dsn=app)
        assert result.returncode == 0, result.stderr
        assert " DEBUG batch " in result.stderr, result.stderr
    quiet = run("consume", "q", "--target", f"jsonl:{tmp_path / 'quiet.jsonl'}", "--until-caught-up", dsn=app)
    assert quiet.returncode == 0 and " DEBUG " not in quiet.stderr, quiet.stderr



def test_names_with_brackets_are_printed_as_they_are_not_read_as_markup(app):
    with psycopg.connect(app, autocommit=True) as c:
        c.execute('CREATE TABLE "[b]t[/b]" (id int PRIMARY KEY)')
        c.execute("""SELECT replicator.add_table('q', '"[b]t[/b]"')""")
        c.execute("SELECT replicator.register_consumer('q', 'feed[b]eu')")
        c.execute("SELECT replicator.register_consumer('q', '[/x]')")
    for args in (["status"], ["table", "list", "q"], ["queue", "list"]):
        result = run(*args, dsn=app)
        assert result.returncode == 0 and "Traceback" not in result.stderr, (args, result.stderr)
        assert args == ["queue", "list"] or "[b]t[/b]" in result.stdout, (args, result.stdout)
    status = run("status", dsn=app).stdout
    assert "feed[b]eu" in status and "[/x]" in status, status


def test_table_alter_refuses_an_empty_ignore_or_key_list_in_one_line(app):
    assert run("table", "add", "q", "orders", "--ignore", "v", dsn=app).returncode == 0
    assert_user_error(run("table", "alter", "q", "orders", "--ignore", "", dsn=app),
                      "--ignore needs one or more column names", "--no-ignore")
    assert_user_error(run("table", "alter", "q", "orders", "--ignore", " , ", dsn=app), "--ignore needs")
    assert_user_error(run("table", "alter", "q", "orders", "--key", "", dsn=app), "--key needs")
    assert json.loads(run("table", "list", "q", "--json", dsn=app).stdout)[0]["ignore"] == ["v"]   # unchanged


def test_old_rows_with_pk_mode_or_a_schema_is_refused_in_one_line_and_changes_nothing(app):
    with psycopg.connect(app, autocommit=True) as c:
        c.execute("CREATE SCHEMA sales")
        c.execute('CREATE TABLE "keys" ("id" int PRIMARY KEY, "v" text)')
    add_pk, add_schema, add_pk_then, alter_pk = run_all([
        ["table", "add", "q", "orders", "--mode", "pk", "--old-rows"],
        ["table", "add", "q", "--schema", "sales", "--old-rows"],
        ["table", "add", "q", "keys", "--mode", "pk"],
        ["table", "alter", "q", "orders", "--mode", "pk", "--old-rows"]], app)
    assert_user_error(add_pk, "--old-rows needs --mode full")
    assert_user_error(add_schema, "apply to the tables named, not to a schema's")
    assert_user_error(alter_pk, "--old-rows needs --mode full")
    assert add_pk_then.returncode == 0, add_pk_then.stderr
    # a pk-mode table altered to old rows, and an old-rows table altered to pk mode: the server's refusal
    assert_user_error(run("table", "alter", "q", "keys", "--old-rows", dsn=app),
                      "old rows (--old-rows) need full mode, not pk mode")
    assert run("table", "add", "q", "orders", "--old-rows", dsn=app).returncode == 0
    assert_user_error(run("table", "alter", "q", "orders", "--mode", "pk", dsn=app),
                      "old rows (--old-rows) need full mode, not pk mode")
    assert_user_error(run("table", "alter", "q", "orders", "--old-rows", dsn=app), "already has these settings")
    assert [(t["table"], t["mode"], t["old_rows"]) for t in json.loads(run("table", "list", "q", "--json", dsn=app).stdout)
            ] == [("public.keys", "pk", False), ("public.orders", "full", True)]
    assert run("table", "alter", "q", "orders", "--no-old-rows", dsn=app).stdout == (
        "orders of queue q: old_rows changed; targets change their copy in place at that point of the queue\n")


def test_a_name_that_means_two_captured_tables_names_the_one_sql_means(app):
    # "Orders" as SQL is orders; as `table list` shows names, it is "Orders": SQL wins
    with psycopg.connect(app, autocommit=True) as c:
        c.execute('CREATE TABLE "Orders" (id int PRIMARY KEY)')
    assert run("table", "add", "q", '"Orders"', "orders", dsn=app).returncode == 0
    for _ in range(3):
        assert run("table", "alter", "q", "Orders", "--mode", "pk", dsn=app).returncode == 0
        modes = {t["table"]: t["mode"] for t in json.loads(run("table", "list", "q", "--json", dsn=app).stdout)}
        assert modes == {"public.orders": "pk", "public.Orders": "full"}
        assert run("table", "alter", "q", "Orders", "--mode", "full", dsn=app).returncode == 0
    assert run("table", "remove", "q", "Orders", dsn=app).returncode == 0
    assert [t["table"] for t in json.loads(run("table", "list", "q", "--json", dsn=app).stdout)] == ["public.Orders"]


@pytest.mark.parametrize("dsn", [
    "postgresql://postgres:s3cret@[::1/nowhere",          # libpq quotes the whole URI it cannot read
    "postgresql://postgres:s3cret@localhost/db?no_such=1",
    "postgresql://postgres:s3%zzcret@localhost/db",
    "host=localhost password=s3 cret dbname=db",          # the password's second word: a keyword without "="
    "host=localhost password='s3cret dbname=db",
])
def test_a_dsn_libpq_cannot_read_is_one_line_without_its_password(dsn, tmp_path):
    for result in run_all([["status"], ["ticker"], ["consume", "q", "--target", f"sqlite:{tmp_path / 'r.db'}"]], dsn):
        line = assert_user_error(result, "invalid DSN")
        assert "s3" not in line and "cret" not in line, line


def test_a_name_holding_a_newline_never_splits_a_log_line_or_an_error(app, tmp_path):
    """Names come from the database and the command line: a newline in one is escaped where replicator
    prints it (its log lines and its one-line errors), so none forges a line of its own."""
    name = "evil\nINFO fake line"
    with psycopg.connect(app, autocommit=True) as c:
        c.execute(f'CREATE TABLE "{name}" (id int PRIMARY KEY, v text)')
        c.execute(f'INSERT INTO "{name}" VALUES (1, \'a\')')
    added = run("table", "add", "q", f'"{name}"', dsn=app)
    assert added.returncode == 0, added.stderr
    assert_user_error(run("table", "add", "q", "public.nope\nINFO fake line", dsn=app), "nope\\nINFO fake line")
    result = run("consume", "q", "--target", f"sqlite:{tmp_path / 'r.db'}", "--until-caught-up", dsn=app)
    assert result.returncode == 0, result.stderr
    assert "evil\\nINFO fake line" in result.stderr, result.stderr
    assert not any(line.startswith("INFO fake line") for line in result.stderr.splitlines()), result.stderr


@pytest.mark.parametrize("dsn", [
    "host=localhost sslpassword=s3 cret dbname=db",             # sslpassword: the client key's passphrase
    "postgresql://localhost/db?sslpassword=s3 cret",
    "postgresql://postgres:s3@cret word@localhost/db",           # a password holding "@" (and a space)
    "postgresql://localhost:5432/db?password=s3@cret%zz",        # "@" in the query's password
    'host=localhost password=s3"cret dbname=db x',               # a quote in the secret
])
def test_a_dsn_libpq_cannot_read_shows_no_part_of_any_secret_and_the_forms_it_takes(dsn):
    with pytest.raises(UserError) as raised:
        parse_dsn(dsn)
    message = str(raised.value)
    assert "cret" not in message, message
    assert "invalid DSN" in message and "postgresql://" in message and "key=value" in message, message


def test_a_dsn_without_secrets_libpq_cannot_read_is_named_by_libpqs_reason():
    with pytest.raises(UserError, match='invalid connection option "no_such_option"'):
        parse_dsn("host=localhost no_such_option=1")


@pytest.mark.parametrize("secret", ["password", "sslpassword", "oauth_client_secret"])
def test_a_server_out_of_reach_is_named_without_any_secret_parameter_of_the_dsn(secret):
    """The ticker and maint log this line and report it as /health's reason while the source is away."""
    with pytest.raises(UserError) as raised:
        db.connect(f"host=127.0.0.1 port={_free_port()} sslmode=disable {secret}=s3cret connect_timeout=2")
    assert "cannot connect" in str(raised.value) and f"{secret}=***" in str(raised.value), str(raised.value)
    assert "s3cret" not in str(raised.value), str(raised.value)


def test_a_name_holding_an_escape_sequence_reaches_no_terminal_through_a_list(app):
    name = "evil\n\x1b[2Jpublic.forged"
    with psycopg.connect(app, autocommit=True) as c:
        c.execute(f'CREATE TABLE "{name}" (id int PRIMARY KEY)')
    added = run("table", "add", "q", f'"{name}"', dsn=app)
    assert added.returncode == 0, added.stderr
    for listing in (["table", "list", "q"], ["status"]):
        listed = run(*listing, dsn=app)
        assert listed.returncode == 0, listed.stderr
        assert "\x1b" not in listed.stdout and "evil\\n\\x1b[2Jpublic.forged" in listed.stdout, repr(listed.stdout)
    as_json = run("table", "list", "q", "--json", dsn=app).stdout
    assert "\x1b" not in as_json and [t["table"] for t in json.loads(as_json)] == [f"public.{name}"]


def test_capture_kind_bad_or_partitioned_is_refused_in_one_line_and_list_shows_the_kind(app):
    with psycopg.connect(app, autocommit=True) as c:
        c.execute("CREATE SCHEMA sales")
        c.execute("CREATE TABLE parts (id int PRIMARY KEY) PARTITION BY RANGE (id)")
    bogus_add, bogus_alter, schema, parted = run_all([
        ["table", "add", "q", "orders", "--capture", "bogus"],
        ["table", "alter", "q", "orders", "--capture", "bogus"],
        ["table", "add", "q", "--schema", "sales", "--capture", "row"],
        ["table", "add", "q", "parts", "--capture", "row"]], app)
    assert_usage_error(bogus_add, "--capture", "bogus", "replicator table add --help")
    assert_usage_error(bogus_alter, "--capture", "bogus", "replicator table alter --help")
    assert_user_error(schema, "apply to the tables named, not to a schema's")
    assert_user_error(parted, "table public.parts is partitioned: capture it by statement (--capture statement)")
    assert json.loads(run("table", "list", "q", "--json", dsn=app).stdout) == []
    assert run("table", "add", "q", "orders", "--capture", "row", dsn=app).returncode == 0
    assert_user_error(run("table", "alter", "q", "orders", "--capture", "row", dsn=app), "already has these settings")
    assert [(t["table"], t["capture"]) for t in json.loads(run("table", "list", "q", "--json", dsn=app).stdout)
            ] == [("public.orders", "row")]
    assert run("table", "alter", "q", "orders", "--capture", "statement", dsn=app).stdout == (
        "orders of queue q: capture changed; targets change their copy in place at that point of the queue\n")
