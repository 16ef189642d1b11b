"""DDL capture at the source: S events queued by the event triggers or by
`replicator execute`, in the DDL's transaction and among its row changes;
capture triggers regenerated; new tables of followed schemas captured from
their first row; changes that would break replication refused with the way out.
"""

from __future__ import annotations

import json
import re
import threading
from decimal import Decimal

import psycopg
import pytest
from psycopg import sql

from consumer_helpers import run_cli, run_cli_in_process
from pg_helpers import dsn_of, make_captured_table_a_descendant, owned_database
from queue_util import CAPTURE_KINDS, by_statement, changes, read_events
from replicator.errors import UserError
from replicator.source import Source
from replicator.source.execute import execute_script, read_script
from replicator.source.install import EVENT_TRIGGERS, has_event_triggers, install


@pytest.fixture
def q(source):
    """Queue "q" with consumer "c"."""
    source.create_queue("q")
    source.register_consumer("q", "c")
    return source


@pytest.fixture
def no_event_triggers(conn):
    """The database as a role that may not create event triggers would have it."""
    for name in EVENT_TRIGGERS:
        conn.execute(sql.SQL("DROP EVENT TRIGGER {}").format(sql.Identifier(name)))
    assert not has_event_triggers(conn)


def schema_events(events):
    return [e for e in events if e.type == "S"]


def column_summary(event) -> list[tuple]:
    return [(c["name"], c["attnum"], c["type"], c["not_null"], c["default"]) for c in event.data["structure"]["columns"]]


# event triggers -----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", CAPTURE_KINDS)
def test_ddl_queues_a_schema_event_in_its_transaction_between_its_row_changes(conn, q, kind):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    table_id = q.add_table("q", "t", capture=kind)
    with conn.transaction():
        conn.execute("INSERT INTO t VALUES (1, 'a')")
        conn.execute("ALTER TABLE t ADD COLUMN n numeric(8,2) NOT NULL DEFAULT 1.5")
        conn.execute("INSERT INTO t VALUES (2, 'b', 2.25)")
    events = by_statement(read_events(q))
    assert [(e.type, e.table) for e in events] == [("I", table_id), ("S", table_id), ("I", table_id)]
    assert len({e.txid for e in events}) == 1 and [e.ev_id for e in events] == sorted(e.ev_id for e in events)
    s = events[1].data
    assert (s["kind"], s["tag"], s["sql"]) == ("altered", "ALTER TABLE",
                                              "ALTER TABLE t ADD COLUMN n numeric(8,2) NOT NULL DEFAULT 1.5")
    assert (s["schema"], s["name"], s["key"], s["columns"]) == ("public", "t", ["id"], ["id", "v", "n"])
    assert column_summary(events[1]) == [("id", 1, "integer", True, None), ("v", 2, "text", False, None),
                                         ("n", 3, "numeric(8,2)", True, "1.5")]
    # the capture trigger was regenerated in the same transaction: the second row has n
    assert events[0].items == [[1, "a"]] and events[2].items == [[2, "b", Decimal("2.25")]]


def test_ddl_inside_a_do_block_is_announced_between_the_blocks_writes(conn, q):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    q.add_table("q", "t")
    conn.execute("DO $$ BEGIN INSERT INTO t VALUES (1, 'a'); ALTER TABLE t ADD COLUMN n int;"
                 " INSERT INTO t VALUES (2, 'b', 2); END $$")
    assert [(e.type, e.items if e.type != "S" else e.data["columns"]) for e in read_events(q)] == [
        ("I", [[1, "a"]]), ("S", ["id", "v", "n"]), ("I", [[2, "b", 2]])]


def test_rolled_back_ddl_queues_nothing_and_leaves_capture_as_it_was(conn, q):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    q.add_table("q", "t")
    with pytest.raises(psycopg.errors.DivisionByZero), conn.transaction():
        conn.execute("ALTER TABLE t ADD COLUMN n int")
        conn.execute("SELECT 1 / 0")
    conn.execute("INSERT INTO t VALUES (1, 'a')")
    assert [(e.type, e.items) for e in read_events(q)] == [("I", [[1, "a"]])]


def test_schema_event_goes_to_every_queue_that_captures_the_table_and_no_other(conn, source):
    for name in ("q1", "q2", "q3"):
        source.create_queue(name)
        source.register_consumer(name, "c")
    conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
    conn.execute("CREATE TABLE other (id int PRIMARY KEY)")
    source.add_table("q1", "t")
    source.add_table("q2", "t")
    source.add_table("q3", "other")
    conn.execute("ALTER TABLE t RENAME TO t2")
    for name in ("q1", "q2"):
        [event] = read_events(source, name)
        assert (event.type, event.data["name"], event.data["sql"]) == ("S", "t2", "ALTER TABLE t RENAME TO t2")
    assert read_events(source, "q3") == []


def test_ddl_that_changes_nothing_targets_depend_on_queues_nothing(conn, q):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    q.add_table("q", "t")
    conn.execute("CREATE INDEX ON t (v)")
    conn.execute("ALTER TABLE t ALTER COLUMN v SET DEFAULT 'x'")
    conn.execute("COMMENT ON TABLE t IS 'hello'")
    conn.execute("CREATE TABLE unrelated (id int)")
    conn.execute("ALTER TABLE unrelated ADD COLUMN w int")
    assert read_events(q) == []


@pytest.mark.parametrize("kind", CAPTURE_KINDS)
def test_capture_follows_column_and_key_changes(conn, q, kind):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text, w int)")
    q.add_table("q", "t", capture=kind)
    conn.execute("INSERT INTO t VALUES (1, 'a', 10)")
    conn.execute("ALTER TABLE t DROP COLUMN w")
    conn.execute("ALTER TABLE t RENAME COLUMN v TO label")
    conn.execute("UPDATE t SET label = 'b'")
    conn.execute("ALTER TABLE t DROP CONSTRAINT t_pkey, ADD PRIMARY KEY (label, id)")
    conn.execute("DELETE FROM t")
    events = by_statement(read_events(q))
    assert [(e.type, e.items if e.type != "S" else e.data["key"]) for e in events] == [
        ("I", [[1, "a", 10]]),
        ("S", ["id"]),
        ("S", ["id"]),
        ("U", [[1, "b"]]),
        ("S", ["label", "id"]),
        ("D", [["b", 1]]),          # the delete carries the new key
    ]
    assert events[2].data["columns"] == ["id", "label"]
    assert [c["attnum"] for c in events[2].data["structure"]["columns"]] == [1, 2]


@pytest.mark.parametrize("kind", CAPTURE_KINDS)
def test_rewriting_values_without_a_type_change_asks_targets_for_a_copy(conn, q, kind):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, a int, v text)")
    conn.execute("CREATE TABLE p (id int PRIMARY KEY, v text) PARTITION BY RANGE (id)")
    conn.execute("CREATE TABLE p_low PARTITION OF p FOR VALUES FROM (0) TO (100)")
    t_id, p_id = q.add_table("q", "t", capture=kind), q.add_table("q", "p")
    conn.execute("INSERT INTO t VALUES (1, 1, 'a')")
    conn.execute("ALTER TABLE t ALTER COLUMN a TYPE int USING a * 2")
    conn.execute("ALTER TABLE t ALTER COLUMN v TYPE text USING upper(v)")
    conn.execute("ALTER TABLE p ALTER COLUMN v TYPE text USING upper(v)")      # rewrites its partitions
    # a rewrite of the storage only changes no value: nothing to copy
    conn.execute("ALTER TABLE t SET UNLOGGED")
    conn.execute("ALTER TABLE t SET LOGGED")
    events = by_statement(read_events(q))
    assert [(e.type, e.table, e.data.get("copy") if e.type == "S" else e.items) for e in events] == [
        ("I", t_id, [[1, 1, "a"]]), ("S", t_id, True), ("S", t_id, True), ("S", p_id, True)]
    assert [e.data["sql"] for e in events[1:]] == [
        "ALTER TABLE t ALTER COLUMN a TYPE int USING a * 2", "ALTER TABLE t ALTER COLUMN v TYPE text USING upper(v)",
        "ALTER TABLE p ALTER COLUMN v TYPE text USING upper(v)"]


def test_nullability_change_is_announced_and_refused_on_a_pk_mode_key(conn, q):
    conn.execute("CREATE TABLE t (code text NOT NULL, v text)")
    q.add_table("q", "t", key=["code"])
    conn.execute("ALTER TABLE t ALTER COLUMN code DROP NOT NULL")
    conn.execute("ALTER TABLE t ALTER COLUMN v SET NOT NULL")
    assert [[c[3] for c in column_summary(e)] for e in read_events(q)] == [[False, False], [False, True]]
    # pk mode reads rows back by their key: a NULL key could never be found
    conn.execute("CREATE TABLE p (id int, code text NOT NULL UNIQUE)")
    q.add_table("q", "p", mode="pk", key=["code"])
    with pytest.raises(psycopg.errors.RaiseException) as refused:
        conn.execute("ALTER TABLE p ALTER COLUMN code DROP NOT NULL")
    assert refused.value.diag.message_primary == (
        "table public.p is captured in pk mode with key (code), whose columns must stay NOT NULL")
    assert refused.value.diag.message_hint == "remove the table from its queue first: replicator table remove q public.p"
    assert read_events(q) == []


def test_structure_reports_the_default_a_column_gets_from_its_domain(conn, q):
    conn.execute("CREATE DOMAIN level AS int DEFAULT 3")
    conn.execute("CREATE DOMAIN top_level AS level")                  # holds a copy of level's default
    conn.execute("CREATE DOMAIN no_default AS level")
    conn.execute("ALTER DOMAIN no_default DROP DEFAULT")               # PostgreSQL then fills NULL
    conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
    conn.execute("INSERT INTO t VALUES (1)")
    q.add_table("q", "t")
    conn.execute("ALTER TABLE t ADD COLUMN a top_level, ADD COLUMN b no_default, ADD COLUMN c level DEFAULT 9")
    [event] = read_events(q)
    assert [(name, default) for name, _, _, _, default in column_summary(event)] == [
        ("id", None), ("a", "3"), ("b", None), ("c", "9")]
    # The rows there were: from 13 PostgreSQL fills them with the domain's default; 12 leaves
    # them NULL unless the domain has a constraint (which makes it rewrite the table). Either
    # way a consumer copies the table again (test_ddl_apply), so its replica is the source's.
    filled = 3 if conn.info.server_version >= 130000 else None
    assert conn.execute("SELECT a, b, c FROM t").fetchone() == (filled, None, 9)
    conn.execute("INSERT INTO t (id) VALUES (2)")                     # new rows get it on every version
    assert conn.execute("SELECT a, b, c FROM t WHERE id = 2").fetchone() == (3, None, 9)


@pytest.mark.parametrize("kind", CAPTURE_KINDS)
def test_change_that_removes_the_key_is_refused_with_the_way_out(conn, q, kind):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    q.add_table("q", "t", capture=kind)
    with pytest.raises(psycopg.errors.RaiseException) as refused:
        conn.execute("ALTER TABLE t DROP COLUMN id")
    assert refused.value.diag.message_primary == "table public.t is captured with key (id), which this statement removes"
    assert refused.value.diag.message_hint == "remove the table from its queue first: replicator table remove q public.t"
    assert [r[0] for r in conn.execute("SELECT attname FROM pg_attribute WHERE attrelid = 't'::regclass"
                                       " AND attnum > 0 AND NOT attisdropped ORDER BY attnum")] == ["id", "v"]
    # pk mode needs a key it can read rows back by: dropping the primary key is refused too
    conn.execute("CREATE TABLE p (id int PRIMARY KEY, v text)")
    q.add_table("q", "p", mode="pk", capture=kind)
    with pytest.raises(psycopg.errors.RaiseException) as refused:
        conn.execute("ALTER TABLE p DROP CONSTRAINT p_pkey")
    assert "pk mode with key (id)" in refused.value.diag.message_primary
    assert "ADD PRIMARY KEY" in refused.value.diag.message_hint
    assert by_statement(read_events(q)) == []
    # the way out works
    q.remove_table("q", "t")
    conn.execute("ALTER TABLE t DROP COLUMN id")


@pytest.mark.parametrize("kind", CAPTURE_KINDS)
def test_dropped_primary_key_gives_way_to_every_column_unless_a_unique_index_keeps_the_key(conn, q, kind):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text, j json)")
    conn.execute("CREATE TABLE u (id int PRIMARY KEY, v text)")
    conn.execute("CREATE UNIQUE INDEX u_id ON u (id)")
    q.add_table("q", "t", capture=kind)
    q.add_table("q", "u", capture=kind)
    conn.execute("ALTER TABLE t DROP CONSTRAINT t_pkey")
    conn.execute("ALTER TABLE u DROP CONSTRAINT u_pkey")
    conn.execute("INSERT INTO t VALUES (1, 'a', '{}'), (1, 'b', '{}')")   # the old key, twice
    conn.execute("DELETE FROM t WHERE v = 'b'")
    conn.execute("ALTER TABLE t ADD PRIMARY KEY (id)")                     # a primary key again
    conn.execute("DELETE FROM t")
    events = by_statement(read_events(q))
    assert [(e.type, e.data["key"] if e.type == "S" else e.items) for e in events] == [
        ("S", ["id", "v"]),                    # json has no equality: not part of the key
        ("I", [[1, "a", "{}"], [1, "b", "{}"]]),
        ("D", [[1, "b"]]),
        ("S", ["id"]),
        ("D", [[1]]),
    ]
    # u is still keyed by id (the unique index): nothing to announce
    assert q.tables("q")[1].key == ["id"]


def test_dropped_and_renamed_tables_are_announced_and_no_longer_captured_when_dropped(conn, q):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
    table_id = q.add_table("q", "t")
    with conn.transaction():
        conn.execute("INSERT INTO t VALUES (1)")
        conn.execute("DROP TABLE t")
    events = read_events(q)
    assert [(e.type, e.table) for e in events] == [("I", table_id), ("S", table_id)]
    assert (events[1].data["kind"], events[1].data["tag"], events[1].data["sql"]) == (
        "dropped", "DROP TABLE", "DROP TABLE t")
    assert q.tables("q") == []


def _run_ddl(conn, source, capture: str, statement: str) -> str | None:
    """Runs a DDL statement with the event triggers or through `replicator execute`;
    the message of its refusal, None if it ran."""
    try:
        if capture == "execute":
            execute_script(source, "q", statement)
        else:
            conn.execute(statement)
    except psycopg.Error as exc:     # replicator's refusal, or PostgreSQL's own
        return exc.diag.message_primary
    except UserError as exc:
        return str(exc)
    return None


def _inheritance(conn) -> list[tuple[str, str]]:
    return conn.execute("SELECT inhrelid::regclass::text, inhparent::regclass::text FROM pg_inherits"
                        " ORDER BY 1, 2").fetchall()


@pytest.mark.parametrize("capture", ["event_triggers", "execute"])
def test_ddl_that_would_let_an_inheritance_tree_miss_changes_is_refused_and_rolled_back(conn, q, capture):
    if capture == "execute":
        for name in EVENT_TRIGGERS:
            conn.execute(sql.SQL("DROP EVENT TRIGGER {}").format(sql.Identifier(name)))
    conn.execute("CREATE TABLE p (id int PRIMARY KEY, v text)")
    conn.execute("CREATE TABLE c () INHERITS (p)")
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    conn.execute("CREATE TABLE other (id int NOT NULL, v text)")
    conn.execute("CREATE FOREIGN DATA WRAPPER dummy")
    conn.execute("CREATE SERVER nowhere FOREIGN DATA WRAPPER dummy")
    p_id = q.add_table("q", "p")
    q.add_table("q", "t")
    version = conn.info.server_version
    if version >= 180000:
        conn.execute("CREATE TABLE nn (id int NOT NULL NO INHERIT, v text)")   # NO INHERIT: new in 18
        q.add_table("q", "nn", key=["id"])
    tree = _inheritance(conn)
    refusals = {
        # a captured table made a child: statements naming its parent would bypass its triggers
        "ALTER TABLE t INHERIT other": r'^table (public\.)?t is captured \(queue "q"\) and cannot be an inheritance'
                                       r" child of (public\.)?other .*: remove it from its queue \(replicator table"
                                       r" remove q (public\.)?t\) and capture (public\.)?other instead",
        "ALTER TABLE t INHERIT p": r'^table (public\.)?t is captured on its own \(queue "q"\) and cannot also be'
                                   r" part of the capture of (public\.)?p, its ancestor: remove it first",
        "CREATE TABLE m () INHERITS (c, other)":
            r"^table (public\.)?m inherits from (public\.)?other as well as from (public\.)?p ",
        "ALTER TABLE c ALTER COLUMN id DROP NOT NULL":
            r"^key column\(s\) id of (public\.)?p may be NULL in its descendant (public\.)?c ",
        "CREATE FOREIGN TABLE f () INHERITS (p) SERVER nowhere":
            r"^table (public\.)?p cannot be captured with its descendant (public\.)?f, which is not a plain table",
    }
    # PostgreSQL's own refusals, where it refuses first (`execute` names the statement)
    postgres = r"^(statement 1 failed, nothing was applied: )?"
    if version < 130000:
        # 12 refuses to make a table carrying triggers with transition tables (the capture's,
        # statement-level) an inheritance child; 13 refuses row-level ones only
        for statement in ("ALTER TABLE t INHERIT other", "ALTER TABLE t INHERIT p"):
            refusals[statement] = postgres + (r'trigger "_replicator_\d+_del" prevents table "t" from becoming an'
                                              r" inheritance child$")
    if version >= 180000:
        # 18 keeps a NOT NULL a child inherits; one declared NO INHERIT leaves a new child's key nullable
        refusals["ALTER TABLE c ALTER COLUMN id DROP NOT NULL"] = (
            postgres + r'cannot drop inherited constraint "p_id_not_null" of relation "c"$')
        refusals["CREATE TABLE nn_kid () INHERITS (nn)"] = (
            r"^key column\(s\) id of (public\.)?nn may be NULL in its descendant (public\.)?nn_kid ")
    for statement, message in refusals.items():
        refused = _run_ddl(conn, q, capture, statement)
        assert refused is not None and re.search(message, refused), (statement, refused)
        assert _inheritance(conn) == tree, statement
    assert conn.execute("SELECT to_regclass('m'), to_regclass('f'), to_regclass('nn_kid')").fetchone() == (
        None, None, None)
    assert read_events(q) == []
    # application writes are captured as before
    conn.execute("INSERT INTO c VALUES (1, 'c'); INSERT INTO t VALUES (2, 't')")
    assert [(e.table == p_id, e.type, e.items) for e in read_events(q)] == [(True, "I", [[1, "c"]]),
                                                                            (False, "I", [[2, "t"]])]


@pytest.mark.parametrize("capture", ["event_triggers", "execute"])
def test_foreign_partition_is_refused_with_detach_partition_as_the_way_out(conn, q, capture):
    if capture == "execute":
        for name in EVENT_TRIGGERS:
            conn.execute(sql.SQL("DROP EVENT TRIGGER {}").format(sql.Identifier(name)))
    conn.execute("CREATE FOREIGN DATA WRAPPER dummy")
    conn.execute("CREATE SERVER nowhere FOREIGN DATA WRAPPER dummy")
    conn.execute("CREATE TABLE p (id int NOT NULL, v text) PARTITION BY RANGE (id)")
    q.add_table("q", "p", key=["id"])
    refused = _run_ddl(conn, q, capture,
                       "CREATE FOREIGN TABLE fp PARTITION OF p FOR VALUES FROM (0) TO (10) SERVER nowhere")
    # (PostgreSQL refuses NO INHERIT on a partition)
    assert refused is not None and re.match(
        r"^table (public\.)?p cannot be captured with its descendant (public\.)?fp, which is not a plain table"
        r" .*: detach it \(ALTER TABLE (public\.)?p DETACH PARTITION (public\.)?fp\) or do not capture", refused
    ), refused
    assert conn.execute("SELECT to_regclass('fp')").fetchone()[0] is None


def _capture_tree_walks(conn, statement: str) -> int:
    """How many times the statement (its event trigger) walks a capture tree."""
    with conn.transaction():
        conn.execute("SET LOCAL track_functions = 'all'")
        conn.execute(statement)
        return conn.execute("SELECT coalesce(sum(calls), 0) FROM pg_stat_xact_user_functions"
                            " WHERE schemaname = 'replicator' AND funcname = 'capture_tree'").fetchone()[0]


def test_a_new_partition_walks_the_tree_as_often_with_forty_partitions_as_with_two(conn, q):
    for table, count in (("small", 2), ("big", 40)):
        conn.execute(f"CREATE TABLE {table} (id int PRIMARY KEY) PARTITION BY RANGE (id)")
        for n in range(count):
            conn.execute(f"CREATE TABLE {table}_{n} PARTITION OF {table} FOR VALUES FROM ({n * 10}) TO ({n * 10 + 10})")
        q.add_table("q", table)
    walks = [_capture_tree_walks(conn, f"CREATE TABLE {table}_new PARTITION OF {table} FOR VALUES FROM (1000) TO (1010)")
             for table in ("small", "big")]
    assert walks[0] == walks[1], walks


@pytest.mark.parametrize("capture", ["event_triggers", "execute"])
@pytest.mark.parametrize(("where", "ddl"), [
    ('"v" > 0', "ALTER TABLE t RENAME COLUMN v TO w"),
    ('"v" > 0', "ALTER TABLE t DROP COLUMN v"),
    # resolves with the session's search_path (public.>), not with the capture's (pg_catalog)
    ('"v" > 0', "ALTER TABLE t ALTER COLUMN v TYPE text"),
    ('"public"."positive"("v")', "DROP FUNCTION public.positive(int)"),
])
def test_ddl_that_breaks_a_row_filter_is_refused_with_the_way_out_and_writes_keep_working(conn, q, capture,
                                                                                          where, ddl):
    conn.execute("CREATE FUNCTION public.text_gt_int(text, int) RETURNS boolean LANGUAGE sql IMMUTABLE"
                 " AS $$ SELECT length($1) > $2 $$")
    conn.execute("CREATE OPERATOR public.> (LEFTARG = text, RIGHTARG = int, FUNCTION = public.text_gt_int)")
    conn.execute("CREATE FUNCTION public.positive(int) RETURNS boolean LANGUAGE sql IMMUTABLE"
                 " AS $$ SELECT $1 > 0 $$")
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v int)")
    # added while event triggers were there (without them, a filter naming a function of a
    # schema is refused: test_ddl_unseen), then the DDL goes through `replicator execute`
    q.add_table("q", "t", where=where)
    if capture == "execute":
        for name in EVENT_TRIGGERS:
            conn.execute(sql.SQL("DROP EVENT TRIGGER {}").format(sql.Identifier(name)))
    refused = _run_ddl(conn, q, capture, ddl)
    assert refused is not None and re.match(
        r"^this statement breaks the row filter of public\.t \(.+\): change the filter first"
        r" \(replicator table alter q public\.t --where \.\.\. or --no-where\), then run the statement again$",
        refused), refused
    conn.execute("INSERT INTO t VALUES (1, 1), (2, -2)")      # the application is not affected
    conn.execute("UPDATE t SET v = -v")
    assert changes(read_events(q)) == [("I", [[1, 1]]), ("U", [[2, 2]]), ("D", [[1]])]


@pytest.mark.parametrize("capture", ["event_triggers", "execute"])
@pytest.mark.parametrize("ddl", ["ALTER TABLE other RENAME COLUMN ref TO r", "DROP TABLE other"])
def test_ddl_on_a_table_a_row_filter_reads_is_refused_with_the_way_out(conn, q, capture, ddl):
    conn.execute("CREATE TABLE other (ref int)")
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v int)")
    q.add_table("q", "t", where='"id" IN (SELECT "ref" FROM "public"."other")')   # with event triggers
    if capture == "execute":
        for name in EVENT_TRIGGERS:
            conn.execute(sql.SQL("DROP EVENT TRIGGER {}").format(sql.Identifier(name)))
    refused = _run_ddl(conn, q, capture, ddl)
    assert refused is not None and re.match(
        r"^this statement breaks the row filter of public\.t \(.+\): change the filter first"
        r" \(replicator table alter q public\.t --where \.\.\. or --no-where\), then run the statement again$",
        refused), refused
    conn.execute("INSERT INTO other VALUES (1); INSERT INTO t VALUES (1, 1), (2, 2)")
    assert changes(read_events(q)) == [("I", [[1, 1]])]


def _waits_for_a_lock_on(relation: str, statement: str, dsn: str, observer, holder) -> bool:
    """Runs the statement on a connection of its own while `holder` keeps its lock;
    whether it had to wait for a lock on the relation (pg_locks). Once it waited, or
    ran to its end, the holder's transaction ends, releasing the lock."""
    errors: list[BaseException] = []
    with psycopg.connect(dsn, autocommit=True) as session:
        pid = session.info.backend_pid

        def run() -> None:
            try:
                session.execute(statement)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        waited = False
        while thread.is_alive() and not waited:
            waited = observer.execute("SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = %s AND NOT granted"
                                      " AND relation = %s::regclass)", (pid, relation)).fetchone()[0]
        holder.rollback()
        thread.join()
    assert not errors, (statement, errors)
    return waited


def test_ddl_elsewhere_does_not_wait_behind_a_lock_on_a_filtered_table(dsn, conn, q):
    conn.execute("CREATE TABLE f (id int PRIMARY KEY, v int)")
    conn.execute("CREATE TABLE u (id int PRIMARY KEY, a int)")
    q.add_table("q", "f", where='"v" > 0')
    q.add_table("q", "u")
    statements = ["CREATE TEMP TABLE scratch (a int)", "CREATE TABLE w (id int)", "CREATE INDEX ON u (a)",
                  "COMMENT ON TABLE u IS 'u'", "GRANT SELECT ON u TO PUBLIC", "ALTER TABLE u ADD COLUMN b int",
                  "DROP TABLE w"]
    conn.execute("CREATE FUNCTION public.one() RETURNS int LANGUAGE sql AS 'SELECT 1'")
    waited = []
    with psycopg.connect(dsn) as holder:
        for statement in statements:
            # an application transaction holding the filtered table (a long migration, say)
            holder.execute("LOCK TABLE f IN ACCESS EXCLUSIVE MODE")
            if _waits_for_a_lock_on("f", statement, dsn, conn, holder):
                waited.append(statement)
        # a command that may break any filter checks them all, and so waits
        holder.execute("LOCK TABLE f IN ACCESS EXCLUSIVE MODE")
        assert _waits_for_a_lock_on("f", "DROP FUNCTION public.one()", dsn, conn, holder)
    assert waited == []
    assert [t.name for t in q.tables("q")] == ["public.f", "public.u"]


# followed schemas ---------------------------------------------------------------------------

def test_tables_created_in_a_followed_schema_are_captured_from_their_first_row(dsn, conn, q):
    conn.execute("CREATE SCHEMA app")
    result = run_cli_in_process(dsn, "table", "add", "q", "--schema", "app")
    assert result.returncode == 0 and "following schema app" in result.stdout
    # one client string, simple query protocol: one transaction
    conn.execute("CREATE TABLE app.a (id int PRIMARY KEY, v text); INSERT INTO app.a VALUES (1, 'x'), (2, 'y')")
    conn.execute("CREATE TABLE app.b AS SELECT g AS id FROM generate_series(1, 3) g")
    conn.execute("SELECT 1 AS id INTO app.c")
    conn.execute("CREATE TABLE elsewhere (id int PRIMARY KEY)")
    conn.execute("INSERT INTO app.b VALUES (4)")
    events = read_events(q)
    ids = {t.name: t.table_id for t in q.tables("q")}
    assert set(ids) == {"app.a", "app.b", "app.c"}
    assert [(e.type, e.table, e.data["kind"] if e.type == "S" else e.items) for e in events] == [
        ("S", ids["app.a"], "created"), ("I", ids["app.a"], [[1, "x"], [2, "y"]]),
        ("S", ids["app.b"], "created"),              # its rows reach consumers by their copy
        ("S", ids["app.c"], "created"),
        ("I", ids["app.b"], [[4]]),
    ]
    assert events[0].txid == events[1].txid
    assert [e.data["tag"] for e in schema_events(events)] == ["CREATE TABLE", "CREATE TABLE AS", "SELECT INTO"]
    assert events[2].data["key"] == ["id"]           # keyless: every comparable column is the key


def test_followed_schemas_are_listed_by_table_list_and_status_until_unfollowed(dsn, conn, q):
    conn.execute("CREATE SCHEMA app; CREATE SCHEMA \"Sales\"")
    q.follow_schema("q", "app", mode="pk")
    q.follow_schema("q", "Sales")
    listed = run_cli_in_process(dsn, "table", "list", "q")
    assert listed.returncode == 0, listed.stderr
    assert "followed schemas" in listed.stdout
    assert re.search(r"q\s*│\s*Sales\s*│\s*full", listed.stdout) and re.search(r"q\s*│\s*app\s*│\s*pk", listed.stdout)
    report = json.loads(run_cli_in_process(dsn, "status", "--json").stdout)
    assert sorted((s["queue"], s["schema"], s["mode"]) for s in report["schemas"]) == [("q", "Sales", "full"),
                                                                                        ("q", "app", "pk")]
    assert run_cli_in_process(dsn, "table", "remove", "q", "--schema", "Sales", "--schema", "app").returncode == 0
    assert "followed schemas" not in run_cli_in_process(dsn, "table", "list").stdout
    assert json.loads(run_cli_in_process(dsn, "status", "--json").stdout)["schemas"] == []


SMALL_CHUNKS = ("CREATE OR REPLACE FUNCTION replicator.capture_chunk() RETURNS integer"
                " LANGUAGE sql IMMUTABLE AS 'SELECT 3'")   # (500: a test of its effect would need thousands)


def test_a_schemas_tables_are_captured_a_chunk_a_transaction(dsn, conn, q):
    """table add --schema captured every table of the schema in one transaction, each holding about
    four locks to its commit: a schema of thousands failed with "out of shared memory" on a stock
    server (bin/bench-scale, 10,000 tables), slowing as the transaction grew."""
    conn.execute(SMALL_CHUNKS)
    conn.execute("""
        CREATE TABLE captured_by (xid bigint);   -- the transaction that captured each table
        CREATE FUNCTION note_capture() RETURNS trigger LANGUAGE plpgsql AS
            'BEGIN INSERT INTO captured_by VALUES (txid_current()); RETURN NULL; END';
        CREATE CONSTRAINT TRIGGER note_capture AFTER INSERT ON replicator.captured_table
            DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION note_capture();
        CREATE SCHEMA app""")
    for n in range(8):
        conn.execute(f"CREATE TABLE app.t{n} (id int PRIMARY KEY)")
    result = run_cli_in_process(dsn, "table", "add", "q", "--schema", "app")
    assert result.returncode == 0 and result.stdout.startswith("8 tables added"), result
    assert {t.name for t in q.tables("q")} == {f"app.t{n}" for n in range(8)}
    sizes = conn.execute("SELECT count(*) FROM captured_by GROUP BY xid ORDER BY min(xid)").fetchall()
    assert sizes == [(3,), (3,), (2,)]


def test_inheritance_child_created_in_a_followed_schema_is_captured_as_rows_of_its_parent(conn, q):
    conn.execute("CREATE SCHEMA app")
    q.follow_schema("q", "app")
    conn.execute("CREATE TABLE app.p (id int PRIMARY KEY, v text)")
    conn.execute("CREATE TABLE app.c (extra int) INHERITS (app.p)")
    conn.execute("INSERT INTO app.c VALUES (1, 'c', 9); UPDATE app.p SET v = 'via p'")
    [parent] = q.tables("q")
    assert parent.name == "app.p"
    assert [(e.type, e.table, e.data["kind"] if e.type == "S" else e.items) for e in read_events(q)] == [
        ("S", parent.table_id, "created"),
        ("I", parent.table_id, [[1, "c"]]),
        ("U", parent.table_id, [[1, "via p"]]),
    ]


def test_inheritance_child_the_queue_cannot_capture_is_warned_about_once_and_not_retried(conn, q):
    conn.execute("CREATE SCHEMA app")
    conn.execute("CREATE SCHEMA other")
    conn.execute("CREATE TABLE other.base (id int PRIMARY KEY)")
    conn.execute("CREATE TABLE app.old_kid () INHERITS (other.base)")
    warnings: list[str] = []
    conn.add_notice_handler(lambda d: warnings.append(d.message_primary) if d.severity_nonlocalized == "WARNING"
                            else None)
    refusal = ("replicator: app.{0} is not captured: table app.{0} inherits from other.base (statements naming"
               " other.base change its rows without firing its triggers): capture other.base instead, which"
               " includes its rows: replicator table add q other.base")
    conn.execute("SELECT replicator.follow_schema('q', 'app')")
    assert warnings == [refusal.format("old_kid")]                  # when first followed
    conn.execute("CREATE TABLE app.kid (extra int) INHERITS (other.base)")
    assert warnings == [refusal.format("old_kid"), refusal.format("kid")]     # when created
    with conn.transaction():
        conn.execute("SET LOCAL track_functions = 'all'")
        conn.execute("CREATE TABLE app.t (id int PRIMARY KEY)")
        conn.execute("ALTER TABLE app.t ADD COLUMN v text")
        conn.execute("CREATE TABLE elsewhere (id int)")
        add_table_calls = conn.execute("SELECT coalesce(sum(calls), 0) FROM pg_stat_xact_user_functions"
                                       " WHERE schemaname = 'replicator' AND funcname = 'add_table'").fetchone()[0]
    # not retried: one add_table (app.t), no warning again
    assert add_table_calls == 1
    assert len(warnings) == 2
    assert [t.name for t in q.tables("q")] == ["app.t"]


# replicator execute -------------------------------------------------------------------------

def test_execute_queues_schema_events_in_order_with_the_scripts_row_changes(conn, q, no_event_triggers, tmp_path):
    conn.execute("CREATE SCHEMA app")
    conn.execute("CREATE TABLE app.t (id int PRIMARY KEY, v text)")
    q.follow_schema("q", "app")
    ids = {t.name: t.table_id for t in q.tables("q")}
    assert [(e.type, e.data["tag"]) for e in read_events(q)] == [("S", "FOLLOW SCHEMA")]
    # without event triggers a DDL outside `execute` is noticed afterwards, before the next tick
    conn.execute("CREATE TABLE app.unseen (id int PRIMARY KEY)")
    assert [(e.type, e.data["kind"], e.data["tag"]) for e in read_events(q)] == [("S", "created", "UNSEEN DDL")]
    conn.execute("DROP TABLE app.unseen")
    assert [(e.type, e.data["kind"], e.data["tag"]) for e in read_events(q)] == [("S", "dropped", "DROP TABLE")]
    script = tmp_path / "migration.sql"
    script.write_text("""
        -- add a column, fill it
        INSERT INTO app.t VALUES (1, 'before');
        ALTER TABLE app.t ADD COLUMN n int;
        UPDATE app.t SET n = 7 WHERE id = 1;  /* a comment */
        CREATE TABLE app.new (id int PRIMARY KEY, s text); INSERT INTO app.new VALUES (1, 'semi;colon');
        ALTER TABLE app.t RENAME TO renamed;
        DROP TABLE app.new;
    """)
    queued = execute_script(q, "q", script.read_text())
    assert queued == 4
    events = read_events(q)
    new_id = events[3].table
    assert [(e.type, e.table, e.data["kind"] if e.type == "S" else e.items) for e in events] == [
        ("I", ids["app.t"], [[1, "before"]]),
        ("S", ids["app.t"], "altered"),
        ("U", ids["app.t"], [[1, "before", 7]]),
        ("S", new_id, "created"),
        ("I", new_id, [[1, "semi;colon"]]),
        ("S", ids["app.t"], "altered"),
        ("S", new_id, "dropped"),
    ]
    assert len({e.txid for e in events}) == 1
    # each event names its own statement, through its semicolon (a comment between statements is neither's)
    assert [(e.data["tag"], e.data["sql"]) for e in schema_events(events)] == [
        ("ALTER TABLE", "ALTER TABLE app.t ADD COLUMN n int;"),
        ("CREATE TABLE", "CREATE TABLE app.new (id int PRIMARY KEY, s text);"),
        ("ALTER TABLE", "ALTER TABLE app.t RENAME TO renamed;"),
        ("DROP TABLE", "DROP TABLE app.new;"),
    ]
    assert events[5].data["name"] == "renamed" and events[1].data["columns"] == ["id", "v", "n"]


@pytest.mark.parametrize("event_triggers", [True, False], ids=["event triggers", "no event triggers"])
def test_execute_says_how_many_schema_changes_it_queued_whoever_queued_them(conn, dsn, q, tmp_path, event_triggers):
    if not event_triggers:
        for name in EVENT_TRIGGERS:
            conn.execute(sql.SQL("DROP EVENT TRIGGER {}").format(sql.Identifier(name)))
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    q.add_table("q", "t")
    q.create_queue("other")
    conn.execute("CREATE TABLE o (id int PRIMARY KEY)")
    q.add_table("other", "o")
    script = tmp_path / "migration.sql"
    script.write_text("ALTER TABLE t ADD COLUMN n int; INSERT INTO t VALUES (1, 'a', 1);"
                      " ALTER TABLE t RENAME COLUMN v TO w; ALTER TABLE o ADD COLUMN n int;")
    result = run_cli_in_process(dsn, "execute", "q", str(script))
    assert result.returncode == 0, result.stderr
    # two of queue q's (o is another queue's table)
    assert result.stdout.strip() == f"{script} applied; 2 schema changes queued"
    assert [e.type for e in read_events(q)] == ["S", "I", "S"]


def test_execute_orders_a_statement_that_changes_a_table_and_then_writes_its_rows(conn, q, no_event_triggers):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    q.add_table("q", "t")
    # the capture function notices the change it was not told of (capture_guard) and
    # announces it before the rows written after it, in their new layout
    execute_script(q, "q", "INSERT INTO t VALUES (1, 'a');"
                           " DO $$ BEGIN ALTER TABLE t ADD COLUMN n int; INSERT INTO t VALUES (2, 'b', 2); END $$;")
    assert [(e.type, e.data["columns"] if e.type == "S" else e.items) for e in read_events(q)] == [
        ("I", [[1, "a"]]), ("S", ["id", "v", "n"]), ("I", [[2, "b", 2]])]
    # a DO block writing one table and changing another is fine
    conn.execute("CREATE TABLE log (id int PRIMARY KEY)")
    q.add_table("q", "log")
    assert execute_script(q, "q", "DO $$ BEGIN ALTER TABLE t ADD COLUMN n2 int; INSERT INTO log VALUES (1); END $$") == 1


def test_execute_applies_nothing_when_a_statement_fails(dsn, conn, q, no_event_triggers, tmp_path):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    q.add_table("q", "t")
    script = tmp_path / "broken.sql"
    script.write_text("ALTER TABLE t ADD COLUMN n int;\nINSERT INTO t VALUES (1, 'a', 1);\nINSERT INTO nowhere VALUES (1);\n")
    result = run_cli(dsn, "execute", "q", str(script))
    assert result.returncode == 1
    assert result.stderr.strip() == ('error: statement 3 failed, nothing was applied: '
                                     'relation "nowhere" does not exist')
    assert read_events(q) == []
    assert conn.execute("SELECT count(*) FROM pg_attribute WHERE attrelid = 't'::regclass AND attname = 'n'"
                        ).fetchone()[0] == 0


def test_execute_runs_each_statement_as_postgresql_reads_the_script(conn, q, no_event_triggers):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    q.add_table("q", "t")
    # a column named begin (an unreserved keyword) once made the rest of the script one statement
    assert execute_script(q, "q", "ALTER TABLE t ADD COLUMN begin int;\n"
                                  "INSERT INTO t VALUES (1, 'a', 2);\n"
                                  "ALTER TABLE t RENAME COLUMN begin TO since;") == 2
    assert [(e.type, e.data["sql"] if e.type == "S" else e.items) for e in read_events(q)] == [
        ("S", "ALTER TABLE t ADD COLUMN begin int;"), ("I", [[1, "a", 2]]),
        ("S", "ALTER TABLE t RENAME COLUMN begin TO since;")]
    # comments nest; E'' strings escape quotes; dollar quotes hold what they hold
    assert execute_script(q, "q", "UPDATE t SET v = 'b'; /* a /* nested; */ comment; */ UPDATE t SET v = E'c\\';';"
                                  " UPDATE t SET v = $x$d;$$;$x$ || v") == 0
    assert [e.items for e in read_events(q)] == [[[1, "b", 2]], [[1, "c';", 2]], [[1, "d;$$;c';", 2]]]


def test_execute_refuses_a_script_postgresql_cannot_read_before_running_anything(dsn, conn, q, no_event_triggers,
                                                                                   tmp_path):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    conn.execute("CREATE SEQUENCE s")
    q.add_table("q", "t")
    script = tmp_path / "broken.sql"
    script.write_text("INSERT INTO t VALUES (nextval('s'), 'a');\nALTER TABLE t\n  ADD COLUMN m int int;\n")
    result = run_cli(dsn, "execute", "q", str(script))
    assert result.returncode == 1
    assert result.stderr.strip() == ('error: cannot read the script at line 3, nothing was applied: '
                                     'syntax error at or near "int"')
    # nothing ran: not even the sequence, which a rollback would not take back, moved
    assert conn.execute("SELECT last_value, is_called FROM s").fetchone() == (1, False)
    for text, error in [("SELECT 1;\n\\set x 1\nSELECT 2", ' at line 2, nothing was applied: syntax error at or near "\\"'),
                        ("SELECT 1; SELECT (", ", nothing was applied: syntax error at end of input"),
                        # PostgreSQL would read the script up to the NUL only
                        ("SELECT 1;\n\x00 DROP TABLE t", " at line 2, nothing was applied: it holds a NUL character")]:
        with pytest.raises(UserError) as refused:
            execute_script(q, "q", text)
        assert str(refused.value) == f"cannot read the script{error}", text
    assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == 0 and read_events(q) == []
    script.write_bytes(b"INSERT INTO t VALUES (1, '\xff');\n")
    result = run_cli(dsn, "execute", "q", str(script))
    assert result.returncode == 1
    assert result.stderr.strip() == f"error: cannot read {script}: it is not utf-8 text (byte 0xff at offset 26)"


def test_execute_asks_for_a_copy_when_a_statement_rewrites_a_captured_table(conn, q, no_event_triggers):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, a int)")
    conn.execute("CREATE TABLE p (id int PRIMARY KEY, v text) PARTITION BY RANGE (id)")
    conn.execute("CREATE TABLE p_low PARTITION OF p FOR VALUES FROM (0) TO (100)")
    t_id, p_id = q.add_table("q", "t"), q.add_table("q", "p")
    assert execute_script(q, "q", "INSERT INTO t VALUES (1, 1); ALTER TABLE t ALTER COLUMN a TYPE int USING a * 2;"
                                  " ALTER TABLE p ALTER COLUMN v TYPE text USING upper(v);"
                                  " UPDATE t SET a = a + 1; TRUNCATE t") == 2
    events = read_events(q)
    # the TRUNCATE replaced t's storage too, but its T event says all: no copy for it
    assert [(e.type, e.table, e.data.get("copy") if e.type == "S" else e.items) for e in events] == [
        ("I", t_id, [[1, 1]]), ("S", t_id, True), ("S", p_id, True), ("U", t_id, [[1, 3]]), ("T", t_id, [])]


def test_execute_asks_no_copy_when_a_statement_only_moves_the_storage(conn, q, no_event_triggers):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, a int)")
    t_id = q.add_table("q", "t")
    conn.execute("INSERT INTO t VALUES (1, 1)")
    read_events(q)
    conn.execute("CREATE TABLE café (id int PRIMARY KEY)")
    q.add_table("q", "café")
    storage_only = [("t", "ALTER TABLE t SET UNLOGGED"), ("t", "ALTER TABLE ONLY public.t /* back */ SET LOGGED;"),
                    ("t", "CLUSTER t USING t_pkey"), ("café", "ALTER TABLE café SET UNLOGGED"),
                    ("café", "ALTER TABLE IF EXISTS ONLY public.\"café\" SET LOGGED, SET TABLESPACE pg_default"),
                    ("t", "ALTER TABLE t* SET UNLOGGED, SET WITHOUT CLUSTER")]
    for table, statement in storage_only:
        node = conn.execute("SELECT relfilenode FROM pg_class WHERE oid = %s::regclass", (table,)).fetchone()[0]
        assert execute_script(q, "q", statement) == 0, statement
        assert conn.execute("SELECT relfilenode FROM pg_class WHERE oid = %s::regclass", (table,)).fetchone()[0] != node
    assert read_events(q) == []
    # with a value-changing action in the same statement, it is a rewrite
    assert execute_script(q, "q", "ALTER TABLE t SET UNLOGGED, ALTER COLUMN a TYPE int USING a * 2") == 1
    assert [(e.type, e.table, e.data.get("copy")) for e in read_events(q)] == [("S", t_id, True)]


def test_execute_warns_once_about_an_inheritance_child_the_queue_cannot_capture_and_checks_it_once(
        conn, q, no_event_triggers):
    # Every statement of the script passes the relations it touched so far (app.kid from the
    # first on): checking the child's tree again at each would be quadratic work.
    conn.execute("CREATE SCHEMA app")
    conn.execute("CREATE TABLE base (id int PRIMARY KEY)")
    q.follow_schema("q", "app")
    warnings: list[str] = []
    q.conn.add_notice_handler(lambda d: warnings.append(d.message_primary)
                              if d.severity_nonlocalized == "WARNING" else None)
    q.conn.execute("SET track_functions = 'pl'")
    with q.conn.transaction():     # the script's transaction runs inside it: its counters can be read
        assert execute_script(q, "q", "CREATE TABLE app.kid () INHERITS (base); ALTER TABLE app.kid ADD COLUMN v int;"
                                      " INSERT INTO app.kid VALUES (1, 2); CREATE TABLE app.t (id int PRIMARY KEY)") == 1
        calls = dict(q.conn.execute("SELECT funcname, calls FROM pg_stat_xact_user_functions"
                                    " WHERE schemaname = 'replicator'"
                                    " AND funcname IN ('follow_new_tables', 'warn_once')").fetchall())
    # check_capture_tree refuses app.kid, and a call ending in an error is not counted
    # (pg_stat_xact_user_functions): each check of it shows as the warn_once that follows.
    # One call per statement, and one before them (DDL run directly since: follow_unseen_ddl)
    assert calls == {"follow_new_tables": 5, "warn_once": 1}
    assert [w.split(": table ")[0] for w in warnings] == ["replicator: app.kid is not captured"]
    assert [t.name for t in q.tables("q")] == ["app.t"]


def test_a_table_of_a_followed_schema_without_a_usable_key_is_warned_about_once(conn, q):
    conn.execute("CREATE SCHEMA app")
    q.follow_schema("q", "app")
    warnings: list[str] = []
    conn.add_notice_handler(lambda d: warnings.append(d.message_primary)
                            if d.severity_nonlocalized == "WARNING" else None)
    conn.execute("CREATE TABLE app.doc (body json)")
    conn.execute("CREATE TABLE app.t (id int PRIMARY KEY)")
    conn.execute("ALTER TABLE app.t ADD COLUMN v int")
    assert warnings == ["replicator: app.doc has no column usable as a key and is not captured"]
    # still tried again at every DDL: once it has a usable column, it is captured, keyed by
    # every comparable column: identical rows would be one on targets, which it says
    conn.execute("ALTER TABLE app.doc ADD COLUMN id int")
    assert sorted(t.name for t in q.tables("q")) == ["app.doc", "app.t"]
    assert len(warnings) == 2 and warnings[1].startswith("replicator: app.doc has no primary key: captured with")
    conn.execute("ALTER TABLE app.doc ADD COLUMN n int")
    assert len(warnings) == 2


def test_a_table_of_a_followed_schema_is_removed_once_the_schema_is_no_longer_followed(conn, q):
    conn.execute("CREATE SCHEMA app; CREATE TABLE app.a (id int PRIMARY KEY); CREATE TABLE app.b (id int PRIMARY KEY)")
    q.follow_schema("q", "app")
    # removed while followed, the next DDL in the schema would capture it again
    with pytest.raises(UserError, match=r'which queue "q" follows.*table remove q --schema app'):
        q.remove_table("q", "app.a")
    q.unfollow_schema("q", "app")
    q.remove_table("q", "app.a")
    conn.execute("CREATE TABLE app.c (id int PRIMARY KEY); ALTER TABLE app.a ADD COLUMN v int")
    assert [t.name for t in q.tables("q")] == ["app.b"]   # captured so far: stays
    with pytest.raises(UserError, match='does not follow schema app'):
        q.unfollow_schema("q", "app")


def test_execute_checks_only_the_capture_trees_its_script_touches(conn, q, no_event_triggers):
    conn.execute("CREATE TABLE p (id int PRIMARY KEY) PARTITION BY RANGE (id)")
    conn.execute("CREATE TABLE p1 (id int PRIMARY KEY)")
    conn.execute("CREATE TABLE u (id int PRIMARY KEY)")
    q.add_table("q", "p1")
    q.add_table("q", "u")
    # captured on its own, then made a partition: what an older version allowed
    make_captured_table_a_descendant(conn, "p1", "ALTER TABLE p ATTACH PARTITION p1 FOR VALUES FROM (0) TO (100)")
    assert execute_script(q, "q", "ALTER TABLE u ADD COLUMN v text; INSERT INTO u VALUES (1, 'a');"
                                  " INSERT INTO p VALUES (1)") == 1
    with pytest.raises(UserError, match=r'^table (public\.)?p1 is captured \(queue "q"\) and cannot be a partition of'):
        execute_script(q, "q", "ALTER TABLE u ADD COLUMN w int; ALTER TABLE p ADD COLUMN v text")
    assert conn.execute("SELECT count(*) FROM pg_attribute WHERE attrelid = 'u'::regclass AND attname = 'w'"
                        ).fetchone()[0] == 0


def test_execute_refuses_transaction_control_before_running_anything(dsn, conn, q, no_event_triggers, tmp_path):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    q.add_table("q", "t")
    for control in ["BEGIN", "START TRANSACTION", "COMMIT", "END", "ROLLBACK", "ABORT", "SAVEPOINT s",
                    "RELEASE SAVEPOINT s", "ROLLBACK TO SAVEPOINT s", "PREPARE TRANSACTION 'x'"]:
        with pytest.raises(UserError, match=r"^statement 2 \((START TRANSACTION|PREPARE TRANSACTION|[A-Z]+)\) "
                                             r"controls the transaction, nothing was applied"):
            execute_script(q, "q", f"INSERT INTO t VALUES (1, 'a'); {control}; ALTER TABLE t ADD COLUMN n int")
    script = tmp_path / "migration.sql"
    script.write_text("ALTER TABLE t ADD COLUMN n int;\nCOMMIT;\nINSERT INTO t VALUES (1, 'a', 1);\n")
    result = run_cli(dsn, "execute", "q", str(script))
    assert result.returncode == 1
    assert result.stderr.strip() == ("error: statement 2 (COMMIT) controls the transaction, nothing was applied: "
                                     "`replicator execute` runs the whole script in one transaction; remove it")
    assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == 0
    assert read_events(q) == []
    # a column named begin (an unreserved keyword) once hid the COMMIT after it
    with pytest.raises(UserError, match=r"^statement 2 \(COMMIT\) controls the transaction, nothing was applied"):
        execute_script(q, "q", "ALTER TABLE t ADD COLUMN begin int; COMMIT; INSERT INTO nowhere VALUES (1)")
    assert conn.execute("SELECT count(*) FROM pg_attribute WHERE attrelid = 't'::regclass AND attname = 'begin'"
                        ).fetchone()[0] == 0
    # a DO block and a prepared statement (even one named transaction) are no transaction control
    assert execute_script(q, "q", "PREPARE ins AS INSERT INTO t VALUES (2, 'b'); EXECUTE ins;"
                                  " DO $$ BEGIN PERFORM 1; END $$; DEALLOCATE ins;"
                                  " PREPARE transaction AS SELECT 1; DEALLOCATE transaction") == 0
    assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == 1


def test_execute_names_statements_with_the_command_tags_of_the_event_triggers(conn, q):
    conn.execute("CREATE SCHEMA app")
    conn.execute("CREATE SCHEMA app2")
    q.follow_schema("q", "app")
    q.follow_schema("q", "app2")
    script = ("CREATE TABLE {s}.a (id int PRIMARY KEY, v text); CREATE TABLE {s}.b AS SELECT 1 AS id;"
              " SELECT 2 AS id INTO {s}.c; CREATE UNLOGGED TABLE {s}.d AS SELECT 3 AS id;"
              " ALTER TABLE {s}.a ADD COLUMN w int; DROP TABLE {s}.b; (SELECT 4 AS id INTO {s}.e);"
              " ALTER TABLE {s}.a ADD COLUMN begin int; CREATE TABLE {s}.f (id int PRIMARY KEY)")
    conn.execute(script.format(s="app"))
    by_event_triggers = [e.data["tag"] for e in schema_events(read_events(q))]
    for name in EVENT_TRIGGERS:
        conn.execute(sql.SQL("DROP EVENT TRIGGER {}").format(sql.Identifier(name)))
    execute_script(q, "q", script.format(s="app2"))
    assert [e.data["tag"] for e in schema_events(read_events(q))] == by_event_triggers == [
        "CREATE TABLE", "CREATE TABLE AS", "SELECT INTO", "CREATE TABLE AS", "ALTER TABLE", "DROP TABLE",
        "SELECT INTO", "ALTER TABLE", "CREATE TABLE"]
    tags = {"CREATE UNIQUE INDEX i ON t (a)": "CREATE INDEX", "create index on t (a)": "CREATE INDEX",
            "CREATE OR REPLACE VIEW v AS SELECT 1": "CREATE VIEW", "TRUNCATE t": "TRUNCATE TABLE",
            "WITH x AS (SELECT 1 AS id) SELECT id INTO y FROM x": "SELECT INTO",
            "SELECT 1 AS id INTO y UNION SELECT 2": "SELECT INTO", "CREATE MATERIALIZED VIEW m AS SELECT 1": (
                "CREATE MATERIALIZED VIEW"), "VALUES (1)": "SELECT", "TABLE t": "SELECT",
            "ALTER TABLE t RENAME COLUMN a TO b": "ALTER TABLE", "ALTER VIEW v RENAME COLUMN a TO b": "ALTER VIEW",
            "ALTER TABLE IF EXISTS t RENAME TO u": "ALTER TABLE", "ALTER TABLE t SET SCHEMA s": "ALTER TABLE",
            "ALTER MATERIALIZED VIEW m OWNER TO r": "ALTER MATERIALIZED VIEW", "DROP FOREIGN TABLE f": (
                "DROP FOREIGN TABLE"), "CREATE USER u": "CREATE ROLE", "ALTER USER u NOLOGIN": "ALTER ROLE",
            "GRANT r TO u": "GRANT ROLE", "REVOKE SELECT ON t FROM u": "REVOKE",
            "CREATE USER MAPPING FOR u SERVER s": "CREATE USER MAPPING",
            "CREATE DEFAULT CONVERSION c FOR 'LATIN1' TO 'UTF8' FROM f": "CREATE CONVERSION",
            "CREATE TEXT SEARCH DICTIONARY d (TEMPLATE = simple)": "CREATE TEXT SEARCH DICTIONARY",
            "ALTER DEFAULT PRIVILEGES GRANT SELECT ON TABLES TO u": "ALTER DEFAULT PRIVILEGES",
            "SECURITY LABEL ON TABLE t IS 'x'": "SECURITY LABEL", "REFRESH MATERIALIZED VIEW m": (
                "REFRESH MATERIALIZED VIEW"), "CREATE PROCEDURE p() LANGUAGE sql BEGIN ATOMIC SELECT 1; END": (
                "CREATE PROCEDURE"), "ALTER ROUTINE f() STABLE": "ALTER ROUTINE", "DROP ROUTINE f": "DROP ROUTINE",
            "CREATE OPERATOR CLASS c FOR TYPE int USING btree AS OPERATOR 1 <": "CREATE OPERATOR CLASS",
            "COMMENT ON COLUMN t.a IS 'x'": "COMMENT", "DECLARE c CURSOR FOR SELECT 1": "DECLARE CURSOR",
            "RESET ALL": "RESET", "SET LOCAL work_mem = '1MB'": "SET", "DISCARD TEMP": "DISCARD TEMP",
            "DEALLOCATE ALL": "DEALLOCATE ALL", "ANALYZE t": "ANALYZE", "END": "COMMIT",
            "ROLLBACK TO SAVEPOINT s": "ROLLBACK", "COMMIT PREPARED 'x'": "COMMIT PREPARED"}
    assert {s: statement.tag for s, statement in zip(tags, read_script(";\n".join(tags)))} == tags


# installing without the privilege -----------------------------------------------------------

@pytest.fixture
def owner_dsn(pg_server):
    """A database owned by a role that is not superuser (it may not create event triggers)."""
    with owned_database(pg_server, "app") as role:
        yield dsn_of(pg_server, role, role)


def test_install_without_the_privilege_says_so_and_execute_captures_ddl(owner_dsn, tmp_path):
    result = run_cli_in_process(owner_dsn, "install")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == (
        "event triggers not allowed for this role: DDL run directly on a captured table is noticed at its next "
        "statement and before each tick; `replicator execute QUEUE FILE.sql` names each change by its statement")
    with psycopg.connect(owner_dsn, autocommit=True) as conn:
        assert install(conn).event_triggers is False            # again: idempotent, same answer
        assert not has_event_triggers(conn)
        source = Source(conn)
        source.create_queue("q")
        source.register_consumer("q", "c")
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        source.add_table("q", "t")
        conn.execute("INSERT INTO t VALUES (1, 'a')")
        script = tmp_path / "change.sql"
        script.write_text("ALTER TABLE t ADD COLUMN n int DEFAULT 5;\nINSERT INTO t (id, v) VALUES (2, 'b');\n")
        result = run_cli_in_process(owner_dsn, "execute", "q", str(script))
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == f"{script} applied; 1 schema change queued"
        events = read_events(source)
        assert [(e.type, e.items if e.type != "S" else e.data["columns"]) for e in events] == [
            ("I", [[1, "a"]]), ("S", ["id", "v", "n"]), ("I", [[2, "b", 5]])]
        assert column_summary(events[1])[2] == ("n", 3, "integer", False, "5")



@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_a_captured_table_attached_as_a_partition_is_refused_or_its_writes_through_the_parent_captured(
        conn, q, capture):
    conn.execute("CREATE TABLE pp (id int NOT NULL, v text) PARTITION BY RANGE (id)")
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    q.add_table("q", "t", capture=capture)
    try:
        conn.execute("ALTER TABLE pp ATTACH PARTITION t FOR VALUES FROM (0) TO (100)")
    except psycopg.Error:
        return   # refused: statements naming pp cannot bypass t's capture
    conn.execute("INSERT INTO pp VALUES (1, 'x')")
    conn.execute("UPDATE pp SET v = 'y'")
    events = [(e.type, e.items) for e in read_events(q)]
    if capture == "statement" and events == []:
        # PostgreSQL 12 refuses the ATTACH (the test passes there); later versions accept it
        pytest.xfail("ATTACH PARTITION of a table captured on its own is neither refused nor followed")
    assert events == [("I", [[1, "x"]]), ("U", [[1, "y"]])]
