"""Installing, upgrading and removing schema "replicator"."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from pathlib import Path

import psycopg
import pytest

from consumer_helpers import run_cli, run_cli_in_process
from pg_helpers import empty_database, make_captured_table_a_descendant
from queue_util import read_events
from replicator.errors import UserError
from replicator.source import Source
from replicator.source.install import (
    EVENT_TRIGGERS,
    install,
    installed_versions,
    migrations,
    queue_sql_files,
    uninstall,
)


def _catalog(conn) -> dict[str, int]:
    """How many objects of each kind replicator has in the database."""
    return dict(conn.execute("""
        SELECT 'functions', count(*) FROM pg_proc WHERE pronamespace = 'replicator'::regnamespace
        UNION ALL SELECT 'tables', count(*) FROM pg_class WHERE relnamespace = 'replicator'::regnamespace
        UNION ALL SELECT 'triggers', count(*) FROM pg_trigger WHERE NOT tgisinternal
        UNION ALL SELECT 'event triggers', count(*) FROM pg_event_trigger""").fetchall())


def test_install_is_idempotent(dsn, conn, source):
    latest = [m.version for m in migrations()]
    conn.execute('CREATE TABLE "t" ("id" int PRIMARY KEY)')
    source.create_queue("q")
    source.add_table("q", "t")
    source.register_consumer("q", "c")
    conn.execute('INSERT INTO "t" VALUES (1)')
    before = _catalog(conn)
    assert before["functions"] > 0 and before["triggers"] == 4

    assert install(conn).applied == []
    assert install(conn).applied == []
    assert installed_versions(conn) == latest
    assert _catalog(conn) == before
    # Queued events, positions and capture survive a re-install.
    conn.execute('INSERT INTO "t" VALUES (2)')
    assert [e.items for e in read_events(source)] == [[[1]], [[2]]]


def test_install_applies_missing_migrations_to_an_older_schema(empty_dsn):
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        applied = install(conn, up_to=1).applied
        assert [m.version for m in applied] == [1]
        assert installed_versions(conn) == [1]
        assert conn.execute("SELECT to_regclass('replicator.captured_schema')").fetchone()[0] is None

        applied = install(conn).applied
        assert [m.version for m in applied] == [m.version for m in migrations()][1:]
        rows = conn.execute("SELECT version, name FROM replicator.schema_version ORDER BY version").fetchall()
        assert rows == [(m.version, m.name) for m in migrations()]
        assert (2, "captured_schema") in rows
        assert conn.execute("SELECT to_regclass('replicator.captured_schema')").fetchone()[0] == "replicator.captured_schema"
        # The upgraded schema works.
        source = Source(conn)
        source.create_queue("q")
        assert [q["queue_name"] for q in source.queues()] == ["q"]


def test_install_upgrades_a_version_2_database_in_use_and_capture_goes_on(dsn, conn, source, tmp_path):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    source.create_queue("q")
    source.add_table("q", "t")
    conn.execute("INSERT INTO t VALUES (1, 'before the upgrade')")
    replica = tmp_path / "r.db"
    assert run_cli_in_process(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up").returncode == 0
    # Back to the tables of version 2, as a database installed then would have them (no DDL capture yet).
    _back_to_version_7(conn)
    for name in EVENT_TRIGGERS:
        conn.execute(f"DROP EVENT TRIGGER {name}")
    conn.execute("ALTER TABLE replicator.captured_table DROP COLUMN table_oid, DROP COLUMN table_structure,"
                 " DROP COLUMN key_is_auto, DROP COLUMN table_catalog_xmins, DROP COLUMN table_catalog_tids,"
                 " DROP COLUMN table_storage, DROP COLUMN table_guarded, DROP COLUMN table_suspended")
    conn.execute("ALTER TABLE replicator.consumer DROP COLUMN consumer_owner")
    conn.execute("ALTER TABLE replicator.consumer DROP COLUMN consumer_temporary, DROP COLUMN consumer_pid,"
                 " DROP COLUMN consumer_usesysid, DROP COLUMN consumer_application_name")
    conn.execute("ALTER TABLE replicator.queue DROP COLUMN queue_consumer_idle_limit")
    conn.execute("DROP TABLE replicator.ticker_heartbeat")
    conn.execute("DROP TABLE replicator.consumer_copy")
    conn.execute("DELETE FROM replicator.schema_version WHERE version > 2")
    conn.execute("INSERT INTO t VALUES (2, 'queued by version 2')")

    assert [m.version for m in install(conn).applied] == [m.version for m in migrations() if m.version > 2]
    oid, structure = conn.execute("SELECT table_oid, table_structure->>'name' FROM replicator.captured_table"
                                  ).fetchone()
    assert (oid, structure) == (conn.execute("SELECT 't'::regclass::oid").fetchone()[0], "t")
    # Rows, schema changes and the consumer carry on across the upgrade.
    conn.execute("INSERT INTO t VALUES (3, 'after')")
    conn.execute("ALTER TABLE t ADD COLUMN n int")
    conn.execute("UPDATE t SET n = id")
    assert run_cli_in_process(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up").returncode == 0
    import sqlite3
    db = sqlite3.connect(replica)
    assert db.execute("SELECT id, v, n FROM t ORDER BY id").fetchall() == [
        (1, "before the upgrade", 1), (2, "queued by version 2", 2), (3, "after", 3)]
    db.close()


def _back_to_version_8(conn) -> None:
    """The tables of version 8: every table captured by statement, the kind not recorded."""
    conn.execute("ALTER TABLE replicator.captured_table DROP COLUMN table_capture")
    conn.execute("DELETE FROM replicator.schema_version WHERE version > 8")


def _back_to_version_7(conn) -> None:
    """The tables of version 7, as a database installed by that version has them: event tables without
    ev_old, captured by functions that do not write it (generated again once it is gone)."""
    for (queue_id,) in conn.execute("SELECT queue_id FROM replicator.queue").fetchall():
        conn.execute(f"ALTER TABLE replicator.event_{queue_id} DROP COLUMN ev_old")
    conn.execute("SELECT replicator.generate_capture(table_id) FROM replicator.captured_table")
    _back_to_version_8(conn)
    conn.execute("ALTER TABLE replicator.captured_table DROP COLUMN table_old_rows")
    conn.execute("DELETE FROM replicator.schema_version WHERE version > 7")


def test_install_upgrades_a_version_8_database_in_use_to_capture_kinds(dsn, conn, source):
    """Migration 0009 records each table's capture kind: the tables of before are captured by statement,
    their triggers untouched, and one can be switched to row capture after it, its events the same."""
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    source.create_queue("q")
    source.add_table("q", "t")
    source.register_consumer("q", "c")
    conn.execute("INSERT INTO t VALUES (1, 'a'), (2, 'b')")
    _back_to_version_8(conn)
    conn.execute("UPDATE t SET v = 'queued by version 8' WHERE id = 1")
    assert [m.name for m in install(conn).applied] == ["capture_kind"]
    assert [t.capture for t in source.tables("q")] == ["statement"]
    source.alter_table("q", "t", capture="row")
    conn.execute("UPDATE t SET v = 'after the upgrade' WHERE id = 2")
    events = [(e.type, e.items) for e in read_events(source) if e.type != "S"]
    assert events == [("I", [[1, "a"], [2, "b"]]), ("U", [[1, "queued by version 8"]]),
                      ("U", [[2, "after the upgrade"]])]
    assert [t.capture for t in source.tables("q")] == ["row"]


def test_install_upgrades_a_version_7_database_in_use_to_old_rows(dsn, conn, source, tmp_path):
    """Migration 0008 adds ev_old to the event tables of existing queues: events queued before it are
    consumed as before, and a table altered to --old-rows after it queues its old rows."""
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    source.create_queue("q")
    source.add_table("q", "t")
    source.register_consumer("q", "c")
    conn.execute("INSERT INTO t VALUES (1, 'a'), (2, 'b')")
    _back_to_version_7(conn)
    conn.execute("UPDATE t SET v = 'queued by version 7' WHERE id = 1")
    assert [m.name for m in install(conn).applied] == ["old_rows", "capture_kind"]
    source.alter_table("q", "t", old_rows=True)
    conn.execute("UPDATE t SET v = 'after the upgrade' WHERE id = 2")
    conn.execute("DELETE FROM t WHERE id = 1")
    events = [(e.type, e.items, e.old) for e in read_events(source) if e.type != "S"]
    assert events == [("I", [[1, "a"], [2, "b"]], None), ("U", [[1, "queued by version 7"]], None),
                      ("U", [[2, "after the upgrade"]], [[2, "b"]]), ("D", [[1]], [[1, "queued by version 7"]])]
    assert [t.old_rows for t in source.tables("q")] == [True]


def _back_to_version_5(conn) -> None:
    """The tables of version 5, as a database installed by that version has them."""
    _back_to_version_7(conn)
    conn.execute("ALTER TABLE replicator.consumer DROP COLUMN consumer_temporary, DROP COLUMN consumer_pid,"
                 " DROP COLUMN consumer_usesysid, DROP COLUMN consumer_application_name")
    conn.execute("ALTER TABLE replicator.queue DROP COLUMN queue_consumer_idle_limit")
    conn.execute("DROP TABLE replicator.ticker_heartbeat")
    conn.execute("DROP TABLE replicator.consumer_copy")
    conn.execute("DELETE FROM replicator.schema_version WHERE version > 5")


def test_the_upgrade_makes_the_durable_stdout_consumers_of_the_previous_version_temporary(dsn, conn, source):
    """That version's stream to stdout registered `jsonl_stdout_HASH8` durably (the hash of
    `jsonl:-`); nothing resumes it now. A file target named `stdout` has a name of the same
    shape (the hash of its path and host) and stays durable."""
    import hashlib

    stdout_names = [f"{fmt}_stdout_{hashlib.sha1(f'{fmt}:-'.encode()).hexdigest()[:8]}" for fmt in ("jsonl", "tsv")]
    source.create_queue("q")
    for name in [*stdout_names, "jsonl_stdout_0123abcd", "feed"]:
        source.register_consumer("q", name)
    _back_to_version_5(conn)
    install(conn)
    temporary = dict(conn.execute("SELECT consumer_name, consumer_temporary FROM replicator.consumer").fetchall())
    assert temporary == {stdout_names[0]: True, stdout_names[1]: True, "jsonl_stdout_0123abcd": False, "feed": False}
    conn.execute("UPDATE replicator.consumer SET active_time = now() - interval '2 hours'")
    maint = run_cli_in_process(dsn, "maint", "--once")
    assert maint.returncode == 0, maint.stderr
    assert sorted(name for (name,) in conn.execute("SELECT consumer_name FROM replicator.consumer")) == [
        "feed", "jsonl_stdout_0123abcd"]


def test_a_schema_of_an_older_version_is_named_with_the_versions_and_replicator_install(dsn, conn):
    conn.execute("DROP FUNCTION replicator.ticker_info()")           # version 5 had no ticker heartbeat
    _back_to_version_5(conn)
    latest = migrations()[-1]
    result = run_cli(dsn, "status")
    assert (result.returncode, result.stderr.splitlines()) == (1, [
        f"error: this database has an older version of replicator's schema (version 5) than this replicator needs "
        f"(version {latest.version}, {latest.name}): run `replicator install` to upgrade it"])
    install(conn)
    assert run_cli_in_process(dsn, "status").returncode == 0


def test_install_keeps_a_users_view_over_a_replicator_function_and_says_so(dsn, conn):
    conn.execute("CREATE VIEW queue_health AS SELECT * FROM replicator.queue_info()")
    with pytest.raises(psycopg.errors.DependentObjectsStillExist, match="queue_health"):
        install(conn)
    assert conn.execute("SELECT count(*) FROM queue_health").fetchone()[0] == 0    # still there, still works


def _functions(conn) -> set[str]:
    return {name for (name,) in conn.execute(
        "SELECT oid::regprocedure::text FROM pg_proc WHERE pronamespace = 'replicator'::regnamespace")}


def test_psql_runs_queue_sql_install_sql_to_the_functions_install_creates(conn, pg_server):
    """queue_sql/install.sql is the install order, and psql can run it too (\\ir lines)."""
    root = Path(__file__).resolve().parent.parent
    scripts = ["-c", "CREATE SCHEMA replicator"]
    for migration in migrations():
        scripts += ["-f", str(root / "migrations" / migration.path.name)]
    scripts += ["-f", str(root / "queue_sql" / "install.sql")]
    with empty_database(pg_server, "by_psql") as by_psql_dsn:
        # Debian's client where the server comes without one (npm's), with its own libpq
        psql, env = pg_server.bindir / "psql", dict(os.environ)
        if not psql.exists():
            psql = Path(shutil.which("psql") or "psql")
            env.pop("LD_LIBRARY_PATH", None)
        run = subprocess.run([str(psql), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", by_psql_dsn, *scripts],
                             capture_output=True, text=True, timeout=120, env=env)
        assert run.returncode == 0, run.stderr
        with psycopg.connect(by_psql_dsn, autocommit=True) as by_psql:
            assert _functions(by_psql) == _functions(conn)
    assert len(_functions(conn)) >= len(queue_sql_files())   # at least one function per file


def test_concurrent_installs_apply_each_migration_once(empty_dsn):
    errors: list[BaseException] = []
    start = threading.Barrier(3)

    def run() -> None:
        try:
            with psycopg.connect(empty_dsn, autocommit=True) as c:
                start.wait()
                install(c)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    with psycopg.connect(empty_dsn) as conn:
        assert installed_versions(conn) == [m.version for m in migrations()]


def test_source_refuses_a_database_without_replicator(empty_dsn):
    with psycopg.connect(empty_dsn, autocommit=True) as conn, pytest.raises(
            UserError, match="replicator is not installed in this database"):
        Source(conn)


def test_uninstall_leaves_nothing_behind_and_keeps_application_data(conn, source):
    conn.execute('CREATE SCHEMA "App ""Data"""')
    conn.execute('CREATE TABLE "App ""Data"""."Orders" ("id" int PRIMARY KEY, "v" text)')
    conn.execute('CREATE TABLE "p" ("id" int PRIMARY KEY) PARTITION BY RANGE ("id")')
    conn.execute('CREATE TABLE "p1" PARTITION OF "p" FOR VALUES FROM (0) TO (100)')
    conn.execute('CREATE TABLE "nokey" ("x" int)')
    source.create_queue("q")
    source.create_queue("other")
    source.add_table("q", '"App ""Data"""."Orders"')
    source.add_table("other", '"App ""Data"""."Orders"', mode="pk")
    source.add_table("q", "p")
    source.add_table("q", "nokey", key=["x"])
    source.register_consumer("q", "c")
    conn.execute('''INSERT INTO "App ""Data"""."Orders" VALUES (1, 'a'), (2, 'b')''')
    conn.execute('INSERT INTO "p" VALUES (1), (2)')
    conn.execute('INSERT INTO "nokey" VALUES (1)')
    source.tick("q", force=True)
    functions = [r[0] for r in conn.execute(
        "SELECT oid FROM pg_proc WHERE pronamespace = 'replicator'::regnamespace")]
    assert conn.execute("SELECT count(*) FROM pg_trigger WHERE tgfoid = ANY (%s)", (functions,)).fetchone()[0] > 0
    # superuser: DDL capture on
    assert {r[0] for r in conn.execute("SELECT evtname FROM pg_event_trigger")} == set(EVENT_TRIGGERS)
    data = {t: conn.execute(f"SELECT * FROM {t} ORDER BY 1").fetchall()
            for t in ('"App ""Data"""."Orders"', '"p"', '"nokey"')}

    uninstall(conn)

    assert conn.execute("SELECT count(*) FROM pg_namespace WHERE nspname = 'replicator'").fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM pg_proc WHERE oid = ANY (%s)", (functions,)).fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
                        " WHERE n.nspname = 'replicator' OR p.proname LIKE 'capture\\_%'").fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM pg_trigger WHERE NOT tgisinternal").fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM pg_event_trigger").fetchone()[0] == 0
    assert {t: conn.execute(f"SELECT * FROM {t} ORDER BY 1").fetchall() for t in data} == data
    # The application goes on writing; installing again starts afresh.
    conn.execute('''INSERT INTO "App ""Data"""."Orders" VALUES (3, 'c')''')
    conn.execute('UPDATE "p" SET "id" = "id" + 10')
    uninstall(conn)                                             # nothing left to remove: no error
    assert install(conn).applied == migrations()
    assert Source(conn).queues() == []


def test_install_replaces_a_function_whose_result_type_changed(dsn, conn, source):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
    source.create_queue("q")
    source.add_table("q", "t")
    # An older version's function with another result type: CREATE OR REPLACE alone cannot replace it.
    conn.execute("DROP FUNCTION replicator.table_info(text)")
    conn.execute("CREATE FUNCTION replicator.table_info(p_queue_name text DEFAULT NULL)"
                 " RETURNS TABLE (old_column int) LANGUAGE sql AS 'SELECT 1'")
    install(conn)
    assert [t.name for t in source.tables("q")] == ["public.t"]
    conn.execute("INSERT INTO t VALUES (1)")
    assert conn.execute("SELECT count(*) FROM replicator.event_1 WHERE ev_type = 'I'").fetchone()[0] == 1


def test_install_refuses_a_server_older_than_12_in_one_line(empty_dsn):
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        version = conn.info.parameter_status("server_version")
        if conn.info.server_version >= 120000:
            pytest.skip(f"needs a server older than 12, not {version}: bin/test-pg-versions runs it on 11")
        result = run_cli(empty_dsn, "install")
        assert result.returncode == 1
        assert result.stderr.strip() == (f"error: replicator needs PostgreSQL 12 or later, and this server is"
                                         f" PostgreSQL {version}: nothing was installed")
        assert conn.execute("SELECT to_regnamespace('replicator')").fetchone()[0] is None


def test_install_stops_on_a_partition_captured_on_its_own_and_names_the_way_out(dsn, conn, source):
    conn.execute("CREATE TABLE p (id int PRIMARY KEY) PARTITION BY RANGE (id)")
    conn.execute("CREATE TABLE p1 (id int PRIMARY KEY)")
    source.create_queue("q")
    source.add_table("q", "p1")
    # captured on its own, then made a partition: what older versions allowed
    make_captured_table_a_descendant(conn, "p1", "ALTER TABLE p ATTACH PARTITION p1 FOR VALUES FROM (0) TO (100)")
    before = _catalog(conn)
    functions = conn.execute("SELECT array_agg(oid ORDER BY oid) FROM pg_proc"
                             " WHERE pronamespace = 'replicator'::regnamespace").fetchone()[0]

    result = run_cli(dsn, "install")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "error: install stopped, nothing was changed: this version captures a partition or an inheritance child"
        " only with its root, and 1 captured table is not captured so: table public.p1 is captured"
        ' (queue "q") and cannot be a partition of public.p (statements naming public.p change its rows without'
        " firing its triggers): remove it from its queue (replicator table remove q public.p1) and capture"
        " public.p instead, which includes its rows; then run `replicator install` again")
    assert _catalog(conn) == before          # the version installed before is still there, untouched
    assert conn.execute("SELECT array_agg(oid ORDER BY oid) FROM pg_proc"
                        " WHERE pronamespace = 'replicator'::regnamespace").fetchone()[0] == functions
    # the way out it names
    assert run_cli_in_process(dsn, "table", "remove", "q", "public.p1").returncode == 0
    assert run_cli_in_process(dsn, "install").returncode == 0
    source.add_table("q", "p")


def test_install_asks_targets_to_copy_an_inheritance_parent_its_old_capture_missed_rows_of(dsn, conn, source,
                                                                                           tmp_path):
    import sqlite3

    conn.execute("CREATE TABLE p (id int PRIMARY KEY, v text)")
    conn.execute("CREATE TABLE c () INHERITS (p)")
    source.create_queue("q")
    table_id = source.add_table("q", "p")
    # as versions before inheritance trees were captured had it: the triggers on p alone
    with conn.transaction():
        conn.execute("SELECT set_config('replicator.in_ddl', 'on', true)")
        for op in ("ins", "upd", "del", "trunc"):
            conn.execute(f"DROP TRIGGER _replicator_{table_id}_{op} ON c")
    replica = tmp_path / "r.db"
    assert run_cli_in_process(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up").returncode == 0
    conn.execute("INSERT INTO p VALUES (1, 'p'); INSERT INTO c VALUES (2, 'missed by the old capture')")

    install(conn)
    conn.execute("INSERT INTO c VALUES (3, 'captured')")
    install(conn)                           # once only: the capture covers c now
    assert run_cli_in_process(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up").returncode == 0
    db = sqlite3.connect(replica)
    assert db.execute("SELECT id, v FROM p ORDER BY id").fetchall() == [
        (1, "p"), (2, "missed by the old capture"), (3, "captured")]
    db.close()
    assert conn.execute("SELECT ev_table, ev_data->>'copy', ev_data->>'tag' FROM replicator.event_1"
                        " WHERE ev_type = 'S' ORDER BY ev_id").fetchall() == [(table_id, "true", "REPLICATOR INSTALL")]
