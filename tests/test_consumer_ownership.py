"""Consumers belong to the role that registered them: a role given `replicator grant`
reads, moves and unregisters its own consumers only, and executes no function of
schema replicator but the consumer's. A consumer refuses a batch that does not
start at its target's position."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from consumer_helpers import run_cli, run_cli_in_process
from pg_helpers import drop_database, dsn_of, owned_database, unique_name
from replicator.consumer import Consumer
from replicator.errors import UserError
from replicator.source.install import install
from replicator.targets.sqlite.target import SqliteTarget


def _as(dsn: str, role: str) -> str:
    return psycopg.conninfo.make_conninfo(dsn, user=role)


def _new_role(conn: psycopg.Connection, prefix: str) -> str:
    role = unique_name(prefix)
    conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    return role


def _drop_roles(conn: psycopg.Connection, roles: list[str]) -> None:
    for role in roles:
        conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


@pytest.fixture
def granted(conn, source) -> Iterator[tuple[str, str]]:
    """Queue q capturing t, and two roles a and b given `replicator grant`."""
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    source.create_queue("q")
    source.add_table("q", "t")
    roles = [_new_role(conn, "a"), _new_role(conn, "b")]
    for role in roles:
        source.grant_consumer(role)
    yield roles[0], roles[1]
    _drop_roles(conn, roles)


def _consumer_row(conn: psycopg.Connection, name: str) -> tuple[object, ...] | None:
    return conn.execute("SELECT consumer_owner, last_tick, next_tick, batch_id FROM replicator.consumer"
                        " WHERE consumer_name = %s", (name,)).fetchone()


# another role's consumer ---------------------------------------------------------------------

REFUSED_TO_ANOTHER_ROLE = {
    "set_consumer_position": "SELECT replicator.set_consumer_position('q', 'b_replica', {tick})",
    "unregister_consumer": "SELECT replicator.unregister_consumer('q', 'b_replica')",
    "next_batch": "SELECT replicator.next_batch('q', 'b_replica', 1000)",
    "finish_batch": "SELECT replicator.finish_batch({batch})",
    "get_batch_info": "SELECT * FROM replicator.get_batch_info({batch})",
    "batch_event_sql": "SELECT replicator.batch_event_sql({batch})",
    "set_consumer_copy": "SELECT replicator.set_consumer_copy('q', 'b_replica', 'public.t', 1, 2)",
}


@pytest.mark.parametrize("call", list(REFUSED_TO_ANOTHER_ROLE), ids=list(REFUSED_TO_ANOTHER_ROLE))
def test_granted_role_cannot_move_read_or_unregister_another_roles_consumer(dsn, conn, source, granted, call):
    a, b = granted
    with psycopg.connect(_as(dsn, b), autocommit=True) as owner:
        owner.execute("SELECT replicator.register_consumer('q', 'b_replica')")
        conn.execute("INSERT INTO t VALUES (1, 'x')")
        later_tick = source.tick("q", force=True)
        batch = owner.execute("SELECT replicator.next_batch('q', 'b_replica')").fetchone()[0]
        before = _consumer_row(conn, "b_replica")
        with psycopg.connect(_as(dsn, a), autocommit=True) as other, pytest.raises(
                psycopg.errors.InsufficientPrivilege,
                match=f'consumer "b_replica" of queue "q" belongs to role "{b}", not "{a}"'):
            other.execute(REFUSED_TO_ANOTHER_ROLE[call].format(tick=later_tick, batch=batch))
        assert _consumer_row(conn, "b_replica") == before
        # its owner may: the refusal is about who calls
        assert owner.execute("SELECT tick_id FROM replicator.get_batch_info(%s)", (batch,)).fetchone()[0] == later_tick
        assert owner.execute("SELECT replicator.finish_batch(%s)", (batch,)).fetchone()[0] is True
    assert _consumer_row(conn, "b_replica") == (b, later_tick, None, None)


def test_second_granted_role_cannot_take_over_a_consumer_by_registering_its_name(dsn, conn, granted, tmp_path):
    a, b = granted
    with psycopg.connect(_as(dsn, b), autocommit=True) as owner:
        tick = owner.execute("SELECT replicator.register_consumer('q', 'b_replica')").fetchone()[0]
        assert owner.execute("SELECT replicator.register_consumer('q', 'b_replica')").fetchone()[0] == tick
    with psycopg.connect(_as(dsn, a), autocommit=True) as other, pytest.raises(psycopg.errors.InsufficientPrivilege,
                       match=f'belongs to role "{b}", not "{a}": connect as "{b}", or use another consumer name'):
        other.execute("SELECT replicator.register_consumer('q', 'b_replica')")
    # a daemon started under that name stops with that one line
    result = run_cli(_as(dsn, a), "consume", "q", "--target", f"sqlite:{tmp_path / 'r.db'}", "--consumer",
                     "b_replica", "--once")
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1].startswith(
        f'error: database: consumer "b_replica" of queue "q" belongs to role "{b}", not "{a}"')
    assert _consumer_row(conn, "b_replica") == (b, tick, None, None)


def test_consumer_belongs_to_the_set_role_and_its_members_not_to_the_session_user(dsn, conn, source, granted):
    a, b = granted
    member = _new_role(conn, "m")
    try:
        conn.execute(sql.SQL("GRANT {} TO {}").format(sql.Identifier(b), sql.Identifier(member)))
        # registered by a superuser session under SET ROLE: the role's, not the superuser's
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(b)))
            tick = admin.execute("SELECT replicator.register_consumer('q', 'b_replica')").fetchone()[0]
            admin.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(a)))
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match=f'belongs to role "{b}", not "{a}"'):
                admin.execute("SELECT replicator.set_consumer_position('q', 'b_replica', %s)", (tick,))
        assert _consumer_row(conn, "b_replica")[0] == b
        conn.execute("INSERT INTO t VALUES (1, 'x')")
        later_tick = source.tick("q", force=True)
        # a member of the owner may use it
        with psycopg.connect(_as(dsn, member), autocommit=True) as m:
            batch = m.execute("SELECT replicator.next_batch('q', 'b_replica')").fetchone()[0]
            assert m.execute("SELECT replicator.finish_batch(%s)", (batch,)).fetchone()[0] is True
        assert _consumer_row(conn, "b_replica") == (b, later_tick, None, None)
        # the owner of schema replicator (here a superuser) may move it
        source.set_consumer_position("q", "b_replica", tick)
        assert _consumer_row(conn, "b_replica") == (b, tick, None, None)
    finally:
        _drop_roles(conn, [member])


# functions a granted role may execute ---------------------------------------------------------

INTERNAL_CALLS = {
    "add_table": "SELECT replicator.add_table('q', 'other')",
    "generate_capture": "SELECT replicator.generate_capture(1)",
    "maint_rotate_step1": "SELECT replicator.maint_rotate_step1('q')",
    "maint_tick_cleanup": "SELECT replicator.maint_tick_cleanup('q')",
    "drop_queue": "SELECT replicator.drop_queue('q')",
    "set_consumer_owner": "SELECT replicator.set_consumer_owner('q', 'c', current_user)",
    "grant_consumer": "SELECT replicator.grant_consumer(current_user)",
    "ticker": "SELECT replicator.ticker()",
}


@pytest.mark.parametrize("function", list(INTERNAL_CALLS), ids=list(INTERNAL_CALLS))
def test_granted_role_cannot_call_internal_functions(dsn, conn, granted, function):
    a, _ = granted
    conn.execute("CREATE TABLE other (id int PRIMARY KEY)")
    with psycopg.connect(_as(dsn, a), autocommit=True) as other, pytest.raises(
            psycopg.errors.InsufficientPrivilege, match=f"permission denied for function {function}"):
        other.execute(INTERNAL_CALLS[function])


def test_public_executes_no_function_and_a_granted_role_exactly_the_consumer_functions(dsn, conn, source, granted):
    a, _ = granted
    conn.execute("CREATE TABLE later (id int PRIMARY KEY)")
    source.add_table("q", "later")                      # a capture function made after install
    nobody = _new_role(conn, "nobody")
    try:
        executable = """
            SELECT array_agg(p.oid::regprocedure::text ORDER BY p.oid::regprocedure::text) FROM pg_proc p
            WHERE p.pronamespace = 'replicator'::regnamespace AND has_function_privilege(%s, p.oid, 'EXECUTE')"""
        assert conn.execute(executable, (nobody,)).fetchone()[0] is None
        captures = conn.execute("SELECT count(*) FROM pg_proc WHERE pronamespace = 'replicator'::regnamespace"
                                " AND proname ~ '^capture_[0-9]+$'").fetchone()[0]
        assert captures == 2
        consumer_functions = conn.execute("SELECT array_agg(f::text ORDER BY f::text)"
                                          " FROM replicator.consumer_functions() f").fetchone()[0]
        assert conn.execute(executable, (a,)).fetchone()[0] == consumer_functions
        assert "replicator.next_batch(text,text,bigint)" in consumer_functions
    finally:
        _drop_roles(conn, [nobody])


# installed by the database owner, not a superuser ----------------------------------------------

@pytest.fixture
def owner(pg_server) -> Iterator[str]:
    """A role that is not superuser owning a database of its name."""
    with owned_database(pg_server, "owner") as role:
        yield role


def test_non_superuser_install_lets_a_granted_role_consume_and_its_owner_manage_it(pg_server, owner, tmp_path):
    owner_dsn = dsn_of(pg_server, owner, owner)
    with psycopg.connect(pg_server.dsn, autocommit=True) as admin:
        reader = _new_role(admin, "reader")
    reader_dsn = _as(owner_dsn, reader)
    try:
        assert run_cli_in_process(owner_dsn, "install").returncode == 0
        with psycopg.connect(owner_dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text); INSERT INTO t VALUES (1, 'a')")
        for args in (("queue", "create", "q"), ("table", "add", "q", "t"), ("grant", reader)):
            result = run_cli_in_process(owner_dsn, *args)
            assert result.returncode == 0, result.stderr
        replica = tmp_path / "r.db"
        consume = ("consume", "q", "--target", f"sqlite:{replica}", "--consumer", "r", "--until-caught-up")
        result = run_cli_in_process(reader_dsn, *consume)
        assert result.returncode == 0, result.stderr
        # install again: the functions are created anew, the grant carries over
        assert run_cli_in_process(owner_dsn, "install").returncode == 0
        with psycopg.connect(owner_dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO t VALUES (2, 'b')")
        result = run_cli_in_process(reader_dsn, *consume)
        assert result.returncode == 0, result.stderr
        with sqlite3.connect(replica) as db:
            assert db.execute("SELECT id, v FROM t ORDER BY id").fetchall() == [(1, "a"), (2, "b")]
        # what status and table list call is granted too
        status = run_cli_in_process(reader_dsn, "status", "--json")
        assert status.returncode == 0, status.stderr
        assert [(c["consumer"], c["owner"]) for c in json.loads(status.stdout)["consumers"]] == [("r", reader)]
        listed = run_cli_in_process(reader_dsn, "table", "list", "q", "--json")
        assert listed.returncode == 0, listed.stderr
        assert [t["table"] for t in json.loads(listed.stdout)] == ["public.t"]
        # the installing owner may unregister the reader's consumer
        result = run_cli_in_process(owner_dsn, "queue", "unregister", "q", "r")
        assert result.returncode == 0, result.stderr
        assert "consumer r of queue q unregistered" in result.stdout
    finally:
        with psycopg.connect(pg_server.dsn, autocommit=True) as admin:
            # the reader's privileges go with the database
            drop_database(admin, owner)
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(reader)))


# consumers registered before owners were recorded -------------------------------------------

def test_consumers_from_before_owners_belong_to_the_schema_owner_who_can_give_them_away(dsn, conn, source, granted):
    a, _ = granted
    with psycopg.connect(_as(dsn, a), autocommit=True) as reader:
        reader.execute("SELECT replicator.register_consumer('q', 'legacy')")
    # back to the tables of version 3, as a database installed then would have them
    conn.execute("ALTER TABLE replicator.consumer DROP COLUMN consumer_owner")
    conn.execute("DELETE FROM replicator.schema_version WHERE version = 4")
    assert [m.version for m in install(conn).applied] == [4]
    assert _consumer_row(conn, "legacy")[0] == "postgres"

    with psycopg.connect(_as(dsn, a), autocommit=True) as reader:
        with pytest.raises(psycopg.errors.InsufficientPrivilege,
                           match=f'belongs to role "postgres", not "{a}".*can give it to "{a}" with: '
                                 f'replicator queue owner q legacy {a}'):
            reader.execute("SELECT replicator.next_batch('q', 'legacy')")
        refused = run_cli(_as(dsn, a), "queue", "owner", "q", "legacy", a)
        assert refused.returncode == 1
        assert "permission denied for function set_consumer_owner" in refused.stderr
        given = run_cli_in_process(dsn, "queue", "owner", "q", "legacy", a)
        assert given.returncode == 0, given.stderr
        assert given.stdout.strip() == f"consumer legacy of queue q belongs to {a}"
        conn.execute("INSERT INTO t VALUES (1, 'x')")
        source.tick("q", force=True)
        assert reader.execute("SELECT replicator.next_batch('q', 'legacy')").fetchone()[0] is not None
    assert _consumer_row(conn, "legacy")[0] == a


def test_install_takes_back_the_write_privileges_older_versions_granted(dsn, conn, source, granted):
    a, b = granted
    with psycopg.connect(_as(dsn, b), autocommit=True) as reader:
        reader.execute("SELECT replicator.register_consumer('q', 'b_replica')")
    # what `replicator grant` gave before consumers' positions went through the functions
    conn.execute(sql.SQL("GRANT INSERT, UPDATE, DELETE ON replicator.consumer, replicator.tick TO {}; "
                         "GRANT USAGE ON SEQUENCE replicator.batch_id_seq TO {}").format(
                             sql.Identifier(a), sql.Identifier(a)))
    install(conn)
    with psycopg.connect(_as(dsn, a), autocommit=True) as reader:
        for statement in ("UPDATE replicator.consumer SET consumer_owner = current_user",
                          "DELETE FROM replicator.tick", "SELECT nextval('replicator.batch_id_seq')"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                reader.execute(statement)
        assert reader.execute("SELECT count(*) FROM replicator.consumer").fetchone()[0] == 1   # reads stay
    assert _consumer_row(conn, "b_replica")[0] == b


# defence in depth: the consumer checks where a batch starts ----------------------------------

def test_consumer_refuses_a_batch_that_does_not_start_at_its_targets_position(dsn, conn, source, tmp_path):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    source.create_queue("q")
    source.add_table("q", "t")
    replica = tmp_path / "r.db"
    target = SqliteTarget(replica)
    consumer = Consumer(dsn, "q", target, name="c")
    try:
        consumer.connect()
        conn.execute("INSERT INTO t SELECT g, 'first' FROM generate_series(1, 3) g")
        source.tick("q", force=True)
        assert consumer.step() is not None
        position = target.positions("q")["c"]
        conn.execute("INSERT INTO t SELECT g, 'skipped' FROM generate_series(4, 6) g")
        skipped_to = source.tick("q", force=True)
        conn.execute("INSERT INTO t SELECT g, 'after' FROM generate_series(7, 9) g")
        source.tick("q", force=True)
        # another session moves the consumer past events its target never applied
        source.set_consumer_position("q", "c", skipped_to)

        with pytest.raises(UserError, match=rf"starts at tick {skipped_to}, but sqlite:\S+ holds tick {position} "
                                            r"for consumer 'c': another session moved this consumer"):
            consumer.step()
        assert target.positions("q") == {"c": position}
        with sqlite3.connect(replica) as db:
            assert db.execute("SELECT count(*) FROM t").fetchone()[0] == 3
        last_tick, batch_open = conn.execute("SELECT last_tick, batch_open FROM replicator.consumer_info()"
                                             " WHERE consumer_name = 'c'").fetchone()
        assert (last_tick, batch_open) == (skipped_to, True)      # not finished

        # started again, it moves the source back to its target's position: nothing is lost
        consumer.close()
        consumer.run(until_caught_up=True)
        with sqlite3.connect(replica) as db:
            assert db.execute("SELECT count(*), min(id), max(id) FROM t").fetchone() == (9, 1, 9)
    finally:
        consumer.close()
        target.close()


def test_a_batch_another_session_of_the_consumer_closed_is_refused_with_what_to_do(dsn, conn, source):
    """Two daemons of one consumer: one opens the batch, the other applies and closes it before the
    first reads it (a race the Delta s3 test of two consumers meets)."""
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    source.create_queue("q")
    source.add_table("q", "t")
    source.register_consumer("q", "c")
    conn.execute("INSERT INTO t VALUES (1, 'one')")
    source.tick("q", force=True)
    batch_id = source.next_batch("q", "c")
    assert batch_id is not None and source.finish_batch(batch_id)
    with pytest.raises(UserError, match=rf"^batch {batch_id} is not open: another session of its consumer finished "
                                        r"it, moved or unregistered the consumer; run one daemon per consumer$"):
        source.batch_info(batch_id)
    with pytest.raises(UserError, match=rf"^batch {batch_id} is not open: another session"):
        list(source.batch_events(batch_id))
