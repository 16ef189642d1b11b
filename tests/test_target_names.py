"""A replica's own tables are never a replicated table's: a source table named like one of
replicator's tables (_replicator_*) or SQLite's (sqlite_*) is replicated under an escaped
name, and the position, the tables list, the settings and the views stay replicator's.

The reproduction runs the real consumer against the session's PostgreSQL, with an ordinary
role that may only CREATE in schema public, which a queue follows."""

from __future__ import annotations

import itertools
import os
import sqlite3
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st
from psycopg import sql

from consumer_helpers import assert_replica_equals_source, run_cli, sqlite_reader
from replicator.consumer import Consumer
from replicator.errors import UserError
from replicator.structure import ESCAPED_PREFIX, RESERVED_PREFIXES, target_table_name
from replicator.targets.sqlite.target import SqliteTarget
from replicator.targets.sqlite.views import names

_roles = itertools.count()
REPLICATOR_TABLES = ("_replicator_position", "_replicator_tables", "_replicator_settings",
                     "_replicator_value_forms")


def _as(dsn: str, role: str) -> str:
    return dsn.replace("user=postgres", f"user={role}")


@pytest.fixture
def app(conn, source) -> Iterator[str]:
    """Queue q following schema public (holding t), and a role that may CREATE in public."""
    role = f"app_{os.getpid()}_{next(_roles)}"
    conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    conn.execute(sql.SQL("GRANT CREATE ON SCHEMA public TO {}").format(sql.Identifier(role)))
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text); INSERT INTO t VALUES (1, 'a')")
    source.create_queue("q")
    source.follow_schema("q", "public")
    yield role
    conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
    conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def consume(dsn: str, replica: Path) -> str:
    """Runs the consumer `replica` until caught up; its log."""
    done = run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--consumer", "replica",
                   "--until-caught-up")
    assert done.returncode == 0, done.stderr
    return done.stderr


def positions(replica: Path) -> list[tuple[str, str, int]]:
    db = sqlite_reader(replica)
    try:
        return db.execute("SELECT queue, consumer, last_tick FROM _replicator_position").fetchall()
    finally:
        db.close()


def source_position(conn: psycopg.Connection) -> int:
    row = conn.execute("SELECT last_tick FROM replicator.consumer_info()"
                       " WHERE queue_name = 'q' AND consumer_name = 'replica'").fetchone()
    assert row is not None
    last_tick: int = row[0]
    return last_tick


def replica_tables(replica: Path) -> set[str]:
    db = sqlite_reader(replica)
    try:
        return {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    finally:
        db.close()


def test_a_role_creating_a_table_named_like_the_position_table_leaves_the_replicas_position_alone(
        dsn, conn, app, tmp_path):
    replica = tmp_path / "r.db"
    consume(dsn, replica)
    with psycopg.connect(_as(dsn, app), autocommit=True) as hostile:
        hostile.execute("CREATE TABLE public._replicator_position (queue text, consumer text, last_tick bigint,"
                        " PRIMARY KEY (queue, consumer))")
        hostile.execute("INSERT INTO public._replicator_position VALUES ('q', 'evil', 9)")
    conn.execute("INSERT INTO t VALUES (2, 'b')")
    consume(dsn, replica)
    assert positions(replica) == [("q", "replica", source_position(conn))]
    escaped = target_table_name("public", "_replicator_position")
    assert escaped in replica_tables(replica)
    assert_replica_equals_source(conn, replica, [("public._replicator_position", escaped, ["queue", "consumer"]),
                                                 ("public.t", "t", ["id"])])

    conn.execute("INSERT INTO t VALUES (3, 'c')")
    at = source_position(conn)
    log = consume(dsn, replica)
    assert f"consumer replica resumes queue q at tick {at}" in log
    assert "evil" not in log
    assert positions(replica) == [("q", "replica", source_position(conn))]
    assert_replica_equals_source(conn, replica, [("public.t", "t", ["id"])])


HOSTILE_NAMES = ["_replicator_tables", "_replicator_settings", "sqlite_master", "sqlite_x",
                 "_replicator_view_refresh", "_replicator_views", "_REPLICATOR_POSITION", "_replicator_value_forms"]


def test_tables_named_like_replicators_or_sqlites_own_replicate_under_escaped_names_touching_none(
        dsn, conn, app, tmp_path):
    replica = tmp_path / "r.db"
    consume(dsn, replica)
    db = sqlite3.connect(replica)
    try:
        before = {name: db.execute(f"SELECT * FROM {name}").fetchall() for name in REPLICATOR_TABLES[1:]}
    finally:
        db.close()
    with psycopg.connect(_as(dsn, app), autocommit=True) as hostile:
        for name in HOSTILE_NAMES:
            table = sql.Identifier("public", name)
            hostile.execute(sql.SQL("CREATE TABLE {} (source_name text PRIMARY KEY, name text, value text)"
                                    ).format(table))
            hostile.execute(sql.SQL("INSERT INTO {} VALUES ('public.t', 'numeric', 'evil')").format(table))
    conn.execute("INSERT INTO t VALUES (2, 'b')")
    consume(dsn, replica)

    tables = replica_tables(replica)
    assert {target_table_name("public", name) for name in HOSTILE_NAMES} <= tables
    assert_replica_equals_source(conn, replica, [(f"public.{name}", target_table_name("public", name),
                                                  ["source_name"]) for name in HOSTILE_NAMES]
                                 + [("public.t", "t", ["id"])])
    assert positions(replica) == [("q", "replica", source_position(conn))]
    db = sqlite3.connect(replica)
    try:
        after = {name: db.execute(f"SELECT * FROM {name}").fetchall() for name in REPLICATOR_TABLES[1:]}
        recorded = {r[0] for r in db.execute("SELECT source_name FROM _replicator_tables")}
    finally:
        db.close()
    assert after["_replicator_settings"] == before["_replicator_settings"]
    assert recorded == {"public.t", *(f"public.{name}" for name in HOSTILE_NAMES)}
    assert "_replicator_views" not in tables and "_replicator_view_refresh" not in tables


# the mapping ---------------------------------------------------------------------------------

def test_names_outside_the_reserved_space_are_mapped_as_before():
    assert target_table_name("public", "orders") == "orders"
    assert target_table_name("s", "t") == "s__t"
    assert target_table_name("public", "_my_table") == "_my_table"
    assert target_table_name("public", "Mixed Case") == "Mixed Case"
    assert target_table_name("s", "_replicator_position") == "s___replicator_position"
    assert target_table_name("s", "sqlite_master") == "s__sqlite_master"


def test_reserved_names_are_escaped_readably_and_without_capitals():
    assert target_table_name("public", "_replicator_position") == "_replicator_src6_public__replicator_position"
    assert target_table_name("public", "sqlite_master") == "_replicator_src6_public_sqlite_master"
    assert target_table_name("sqlite_s", "t") == "_replicator_src8_sqlite_s_t"
    upper = target_table_name("public", "_REPLICATOR_POSITION")
    assert upper == upper.lower() and upper != target_table_name("public", "_replicator_position")


def test_no_object_of_replicators_is_named_in_the_escaped_tables_space():
    own = [*REPLICATOR_TABLES, names.VIEWS, names.REFRESHES, names.STORAGE_PREFIX, names.INDEX_PREFIX,
           names.helper_index("t", ["a"]), names.delta_table("t"), names.changed_keys_table("t"),
           names.capture_trigger("t"), names.keys_table("v"), names.rows_table("v"), names.fold_table("v")]
    assert all(n.lower().startswith(RESERVED_PREFIXES) for n in own)
    assert not [n for n in own if n.lower().startswith(ESCAPED_PREFIX)]


_names = st.text(st.sampled_from("_aAbB.0_"), max_size=6)
_reserved = st.sampled_from(["_replicator", "_REPLICATOR", "sqlite_", "SQLite_", "_Replicator_x"])


@given(st.lists(st.tuples(st.one_of(st.just("public"), _names, _reserved.map(lambda p: p + "s")),
                          st.one_of(_names, st.tuples(_reserved, _names).map("".join))),
                unique=True, min_size=2, max_size=8))
def test_no_two_source_tables_in_the_reserved_space_become_one_table_even_ignoring_case(tables):
    escaped = [(schema, name) for schema, name in tables
               if target_table_name(schema, name) != (name if schema == "public" else f"{schema}__{name}")]
    mapped = {target_table_name(schema, name).lower() for schema, name in escaped}
    assert len(mapped) == len(escaped)
    plain = {target_table_name(schema, name).lower() for schema, name in tables if (schema, name) not in escaped}
    assert not mapped & plain
    assert not {m for m in mapped if not m.startswith("_replicator_src")}
    assert not {p for p in plain if p.startswith(("_replicator", "sqlite_"))}


# views ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["_replicator_position", "sqlite_master", "t", "T",
                                  "_replicator_src6_public_sqlite_master"])
def test_a_view_named_like_a_replicator_table_or_a_replicated_table_is_refused(dsn, conn, app, tmp_path, name):
    replica = tmp_path / "r.db"
    with psycopg.connect(_as(dsn, app), autocommit=True) as hostile:
        hostile.execute("CREATE TABLE public.sqlite_master (id int PRIMARY KEY)")
    consume(dsn, replica)
    target = SqliteTarget(replica)
    try:
        with pytest.raises(UserError, match=r"reserved|already has a table"):
            target.views.create(name, "SELECT id FROM t")
    finally:
        target.close()
    assert replica_tables(replica) >= {"t", "_replicator_src6_public_sqlite_master", *REPLICATOR_TABLES}


# replicas made before escaping --------------------------------------------------------------

def _unescaped(schema: str, name: str) -> str:
    return name if schema == "public" else f"{schema}__{name}"


def _made_by_an_older_version(dsn: str, replica: Path, monkeypatch: pytest.MonkeyPatch,
                              view: tuple[str, str] | None = None) -> None:
    """Replicates queue q into replica as a version before escaping did (and creates view (name, sql))."""
    with monkeypatch.context() as old_version:
        old_version.setattr("replicator.targets.sqlite.target.target_table_name", _unescaped)
        target = SqliteTarget(replica)
        consumer = Consumer(dsn, "q", target, name="replica")
        try:
            consumer.run(until_caught_up=True)
            if view is not None:
                target.views.create(*view)
        finally:
            consumer.close()
            target.close()
    db = sqlite3.connect(replica, isolation_level=None)
    try:   # an older version recorded no table names
        db.execute("DELETE FROM _replicator_settings WHERE name = 'table_names'")
    finally:
        db.close()


def test_a_replica_made_before_escaping_gets_its_reserved_tables_renamed_and_goes_on(
        dsn, conn, app, tmp_path, monkeypatch):
    conn.execute("CREATE TABLE public._replicator_audit (id int PRIMARY KEY, v text);"
                 " INSERT INTO public._replicator_audit VALUES (1, 'a')")
    replica = tmp_path / "r.db"
    _made_by_an_older_version(dsn, replica, monkeypatch)
    assert "_replicator_audit" in replica_tables(replica)

    conn.execute("INSERT INTO public._replicator_audit VALUES (2, 'b'); INSERT INTO t VALUES (2, 'b')")
    consume(dsn, replica)
    escaped = target_table_name("public", "_replicator_audit")
    assert "_replicator_audit" not in replica_tables(replica)
    assert_replica_equals_source(conn, replica, [("public._replicator_audit", escaped, ["id"]),
                                                 ("public.t", "t", ["id"])])
    assert positions(replica) == [("q", "replica", source_position(conn))]


def test_a_replica_an_older_version_let_a_source_table_take_over_is_refused_untouched(dsn, conn, app, tmp_path):
    replica = tmp_path / "r.db"
    consume(dsn, replica)
    db = sqlite3.connect(replica, isolation_level=None)
    try:
        [structure] = db.execute("SELECT structure FROM _replicator_tables WHERE source_name = 'public.t'").fetchone()
        db.execute("INSERT INTO _replicator_tables VALUES ('public._replicator_position', 99, 'full', ?, NULL)",
                   (structure.replace('"name": "t"', '"name": "_replicator_position"'),))
        db.execute("DELETE FROM _replicator_settings WHERE name = 'table_names'")   # as an older version made it
    finally:
        db.close()
    before = replica.read_bytes()
    done = run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--consumer", "replica", "--once")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: {replica} holds source table public._replicator_position in place of replicator's own table "
        f"_replicator_position (an older replicator did not keep replicated tables apart from its own): what the "
        f"replica says of itself cannot be trusted; move it aside and run `replicator consume` again to build the "
        f"replica anew")
    assert replica.read_bytes() == before


def test_a_table_named_like_a_view_stops_the_consumer_in_one_line_until_the_view_is_dropped(dsn, conn, app,
                                                                                               tmp_path):
    replica = tmp_path / "r.db"
    consume(dsn, replica)
    target = f"sqlite:{replica}"
    made = run_cli(dsn, "view", "create", "summary", "--target", target, "--sql", "SELECT count(*) AS n FROM t")
    assert made.returncode == 0, made.stderr
    with psycopg.connect(_as(dsn, app), autocommit=True) as hostile:
        hostile.execute("CREATE TABLE public.\"Summary\" (id int PRIMARY KEY); INSERT INTO \"Summary\" VALUES (1)")
    before = positions(replica)
    stopped = run_cli(dsn, "consume", "q", "--target", target, "--consumer", "replica", "--until-caught-up")
    assert stopped.returncode == 1
    assert stopped.stderr.strip().splitlines()[-1] == (
        f"error: public.Summary would be table 'Summary' of {target}, which has view 'summary' of that name: drop "
        f"the view (`replicator view drop summary --target {target}`) and run the consumer again, or leave the "
        f"table out of this target (consume --tables)")
    assert positions(replica) == before
    with closing(sqlite_reader(replica)) as db:
        assert db.execute("SELECT n FROM summary").fetchall() == [(1,)]

    assert run_cli(dsn, "view", "drop", "summary", "--target", target).returncode == 0
    consume(dsn, replica)
    assert_replica_equals_source(conn, replica, [('public.Summary', "Summary", ["id"]), ("public.t", "t", ["id"])])


def test_a_table_renamed_into_the_reserved_space_is_renamed_to_its_escaped_name(dsn, conn, app, tmp_path):
    replica = tmp_path / "r.db"
    with psycopg.connect(_as(dsn, app), autocommit=True) as hostile:
        hostile.execute("CREATE TABLE public.x (name text PRIMARY KEY, value text); INSERT INTO x VALUES ('a', 'b')")
        consume(dsn, replica)
        hostile.execute("ALTER TABLE x RENAME TO \"_replicator_Settings\"")
        hostile.execute("INSERT INTO \"_replicator_Settings\" VALUES ('numeric', 'evil')")
    consume(dsn, replica)
    escaped = target_table_name("public", "_replicator_Settings")
    assert "x" not in replica_tables(replica)
    assert_replica_equals_source(conn, replica, [("public._replicator_Settings", escaped, ["name"])])
    with closing(sqlite_reader(replica)) as db:
        assert db.execute("SELECT name, value FROM _replicator_settings ORDER BY name").fetchall() == [
            ("numeric", "number"), ("table_names", "escaped")]
    assert positions(replica) == [("q", "replica", source_position(conn))]


def test_a_replica_whose_tables_list_an_older_version_replaced_with_a_source_table_is_refused(dsn, conn, app,
                                                                                               tmp_path):
    replica = tmp_path / "r.db"
    consume(dsn, replica)
    db = sqlite3.connect(replica, isolation_level=None)
    try:   # as an older version copied public._replicator_tables (source_name, name, value) over it
        db.execute("DROP TABLE _replicator_tables")
        db.execute("CREATE TABLE _replicator_tables (source_name TEXT PRIMARY KEY, name TEXT, value TEXT)")
        db.execute("INSERT INTO _replicator_tables VALUES ('public.t', 'numeric', 'evil')")
    finally:
        db.close()
    done = run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--consumer", "replica", "--once")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: {replica} holds source table public._replicator_tables in place of replicator's own table "
        f"_replicator_tables (an older replicator did not keep replicated tables apart from its own): what the "
        f"replica says of itself cannot be trusted; move it aside and run `replicator consume` again to build the "
        f"replica anew")


def test_a_view_over_a_table_renamed_on_the_first_open_reads_it_by_its_new_name(dsn, conn, app, tmp_path,
                                                                                 monkeypatch):
    conn.execute("CREATE TABLE public._replicator_audit (id int PRIMARY KEY, v text);"
                 " INSERT INTO public._replicator_audit VALUES (1, 'a')")
    replica = tmp_path / "r.db"
    # a string and a comment of that name are not the table: they stay as written
    query = "SELECT count(*) AS n, '_replicator_audit' AS s FROM /* _replicator_audit */ _replicator_AUDIT"
    _made_by_an_older_version(dsn, replica, monkeypatch, ("audits", query))

    conn.execute("INSERT INTO public._replicator_audit VALUES (2, 'b')")
    log = consume(dsn, replica)   # the new version renames _replicator_audit on open
    escaped = target_table_name("public", "_replicator_audit")
    assert escaped in replica_tables(replica)
    refreshed = run_cli(dsn, "view", "refresh", "audits", "--target", f"sqlite:{replica}", "--full")
    assert refreshed.returncode == 0, (log, refreshed.stderr)
    with closing(sqlite_reader(replica)) as db:
        assert db.execute("SELECT n FROM audits").fetchall() == [(2,)]
        assert db.execute("SELECT sql FROM _replicator_views").fetchall() == [
            (f"SELECT count(*) AS n, '_replicator_audit' AS s FROM /* _replicator_audit */ \"{escaped}\"",)]


def test_the_first_open_of_an_older_replica_renames_its_tables_whatever_their_order(dsn, conn, app, tmp_path,
                                                                                    monkeypatch):
    """public._replicator_audit was _replicator_audit, and a table named like its escaped name was
    itself: the first one's new name is the second one's old one."""
    escaped = target_table_name("public", "_replicator_audit")
    conn.execute("CREATE TABLE public._replicator_audit (id int PRIMARY KEY, v text);"
                 " INSERT INTO public._replicator_audit VALUES (1, 'audit')")
    conn.execute(f'CREATE TABLE public."{escaped}" (id int PRIMARY KEY, v text);'
                 f" INSERT INTO public.\"{escaped}\" VALUES (1, 'other')")
    replica = tmp_path / "r.db"
    _made_by_an_older_version(dsn, replica, monkeypatch)

    conn.execute("INSERT INTO public._replicator_audit VALUES (2, 'audit')")
    consume(dsn, replica)
    consume(dsn, replica)   # and a second open renames nothing
    assert_replica_equals_source(conn, replica, [
        ("public._replicator_audit", escaped, ["id"]),
        (f"public.{escaped}", target_table_name("public", escaped), ["id"])])


def test_a_renaming_that_cannot_be_done_is_refused_in_one_line_leaving_the_replica_as_it_was(dsn, conn, app,
                                                                                            tmp_path, monkeypatch):
    conn.execute("CREATE TABLE public._replicator_audit (id int PRIMARY KEY, v text);"
                 " INSERT INTO public._replicator_audit VALUES (1, 'a')")
    conn.execute("CREATE TABLE public._replicator_x (id int PRIMARY KEY)")
    replica = tmp_path / "r.db"
    _made_by_an_older_version(dsn, replica, monkeypatch)
    escaped = target_table_name("public", "_replicator_x")
    db = sqlite3.connect(replica, isolation_level=None)
    try:   # a table of someone else's under the second one's new name
        db.execute(f'CREATE TABLE "{escaped.upper()}" (x)')
    finally:
        db.close()
    before = replica.read_bytes()
    done = run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--consumer", "replica", "--once")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith(
        f"error: cannot rename table _replicator_x of {replica} (source table public._replicator_x) to {escaped}, the "
        f"name this version gives it: ")
    assert replica.read_bytes() == before


def test_names_sqlite_tells_apart_are_two_tables_though_python_folds_them_alike(dsn, conn, app, tmp_path):
    """SQLite ignores the case of ASCII letters only: the Kelvin sign is not k to it."""
    conn.execute('CREATE TABLE public."\u212a" (id int PRIMARY KEY); INSERT INTO public."\u212a" VALUES (1)')
    conn.execute('CREATE TABLE public."k" (id int PRIMARY KEY); INSERT INTO public."k" VALUES (2)')
    replica = tmp_path / "r.db"
    consume(dsn, replica)
    assert_replica_equals_source(conn, replica, [("public.\u212a", "\u212a", ["id"]), ("public.k", "k", ["id"])])
