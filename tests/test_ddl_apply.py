"""Schema changes applied to targets: after each DDL of a long sequence, run
while writer threads keep changing rows, the SQLite replica and a replay of
the JSON-lines stream equal the source, value by value. The DDL reaches the
queue by the event triggers or by `replicator execute`; the consumer may be
behind several DDLs; pgcapture's known failures are regression cases.
"""

from __future__ import annotations

import json

import psycopg
import pytest
from psycopg import sql

from consumer_helpers import LosesTheSourceOnce, apply_losing_the_source_once, run_cli, run_cli_in_process
from ddl_helpers import (
    Replicas,
    StreamReplay,
    Writers,
    assert_sqlite_equals_source,
    assert_stream_equals_source,
    attnums,
    source_rows,
    source_tables,
    sqlite_rows,
    sqlite_tables,
    stream_lines,
)
from replicator.consumer import Consumer
from replicator.errors import UserError
from replicator.source.execute import execute_script
from replicator.source.install import EVENT_TRIGGERS
from replicator.targets import open_target
from replicator.targets.sqlite.target import SqliteTarget


class Oracle:
    """Compares both replicas with the source; remembers each table's columns by
    attnum when it first appears, as a stream reader that saw its creation would."""

    def __init__(self, conn: psycopg.Connection, replicas: Replicas) -> None:
        self.conn = conn
        self.replicas = replicas
        self.layouts: dict[str, dict[int, str]] = {}
        self.note_new_tables()

    def note_new_tables(self) -> None:
        for table in source_tables(self.conn):
            self.layouts.setdefault(f"public.{table}", attnums(self.conn, table))

    def check(self, step: str) -> StreamReplay:
        self.note_new_tables()
        assert_sqlite_equals_source(self.conn, self.replicas.sqlite_path, step)
        replay = StreamReplay(self.layouts).replay(stream_lines(self.replicas.stream_path))
        assert_stream_equals_source(self.conn, replay, step)
        return replay


def base_tables(conn: psycopg.Connection, source) -> None:
    """t (full mode, through the followed schema public) and p (pk mode)."""
    source.create_queue("q")
    conn.execute("CREATE TABLE p (id int PRIMARY KEY, a int NOT NULL DEFAULT 0, b text)")
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, a int NOT NULL DEFAULT 0, b text)")
    conn.execute("INSERT INTO t SELECT g, g, 'b' || g FROM generate_series(1, 40) g")
    conn.execute("INSERT INTO p SELECT g, g, 'b' || g FROM generate_series(1, 40) g")
    source.add_table("q", "p", mode="pk")
    assert source.follow_schema("q", "public") == 1


# Each step is one script: one transaction, sent as one string (event triggers) or
# run by `replicator execute` (statement by statement, in one transaction).
DDL_STEPS = [
    "ALTER TABLE t ADD COLUMN c text",
    "ALTER TABLE t ADD COLUMN d int DEFAULT 42",
    "ALTER TABLE t ADD COLUMN e timestamptz DEFAULT now()",
    "ALTER TABLE t ADD COLUMN f float8 DEFAULT random()",
    # DDL inside a transaction, with DML before and after it
    "INSERT INTO t (id, a, b) VALUES (-1, 1, 'before'); ALTER TABLE t ADD COLUMN g int;"
    " UPDATE t SET g = id % 7, c = 'c' || id WHERE id % 3 = 0; INSERT INTO t (id, a, b, g) VALUES (-2, 2, 'after', 99)",
    "ALTER TABLE p ADD COLUMN x int DEFAULT 5",
    "ALTER TABLE t RENAME COLUMN b TO bb",
    "ALTER TABLE p RENAME COLUMN b TO bb",
    "ALTER TABLE t ALTER COLUMN d TYPE numeric(12,2) USING d / 8.0",
    "ALTER TABLE p ALTER COLUMN x TYPE bigint USING x * 1000 + id",
    # the same type: only the rewrite (no type change) tells that values changed
    "ALTER TABLE t ALTER COLUMN a TYPE int USING a * 2",
    "ALTER TABLE p ALTER COLUMN bb TYPE text USING upper(bb)",
    "ALTER TABLE t DROP COLUMN f",
    "ALTER TABLE p DROP COLUMN bb",
    "ALTER TABLE t RENAME TO t2",
    "ALTER TABLE t2 DROP CONSTRAINT t_pkey, ADD PRIMARY KEY (a, id)",       # change the primary key
    "ALTER TABLE t2 DROP CONSTRAINT t2_pkey",                               # drop it: every column is the key
    "UPDATE t2 SET c = 'k' || id WHERE id % 5 = 0; UPDATE t2 SET c = c",
    "ALTER TABLE t2 ADD PRIMARY KEY (id)",                                  # add one again
    "CREATE TABLE n (id int PRIMARY KEY, v text); INSERT INTO n SELECT g, 'n' || g FROM generate_series(1, 20) g",
    "CREATE TABLE m AS SELECT id, a, bb FROM t2",
    "UPDATE m SET a = a + 1 WHERE id % 2 = 0; UPDATE m SET bb = bb; INSERT INTO m VALUES (-5, 5, NULL)",
    "SELECT id, a INTO s FROM t2 WHERE id % 2 = 1",
    "TRUNCATE t2",
    "DROP TABLE n",
]


def drop_event_triggers(conn: psycopg.Connection) -> None:
    """The database as a role that may not create event triggers would have it."""
    for name in EVENT_TRIGGERS:
        conn.execute(sql.SQL("DROP EVENT TRIGGER {}").format(sql.Identifier(name)))


def apply_step(conn: psycopg.Connection, source, capture: str, step: str) -> None:
    """Runs a step's script; a deadlock with the writers rolls it back whole: run it again."""
    while True:
        try:
            if capture == "execute":
                execute_script(source, "q", step)
            else:
                conn.execute(step)
            return
        except psycopg.errors.DeadlockDetected:
            continue
        except UserError as exc:
            if "deadlock detected" not in str(exc):
                raise


@pytest.mark.parametrize("capture", ["event_triggers", "execute", "unseen"])
def test_replicas_equal_the_source_after_each_ddl_while_writers_run(dsn, conn, source, tmp_path, capture):
    """"unseen": no event triggers and no `replicator execute`: each DDL is run directly, as
    an administrator unaware of replicator would; the capture functions and the ticker notice."""
    if capture != "event_triggers":
        drop_event_triggers(conn)
    base_tables(conn, source)
    replicas = Replicas(dsn, tmp_path)
    oracle = Oracle(conn, replicas)
    writers = Writers(dsn, ["t", "p"]).start()
    try:
        writers.wait_for_ops(3)
        writers.pause()
        replicas.catch_up()
        oracle.check("initial copy")
        writers.resume()
        for step in DDL_STEPS:
            writers.wait_for_ops(2)                  # the DDL meets writes in flight
            apply_step(conn, source, capture, step)
            writers.wait_for_ops(3)
            writers.pause()
            replicas.catch_up()
            replay = oracle.check(step)
            writers.resume()
    finally:
        writers.stop()
        replicas.close()
    writers.check()
    assert sum(writers.ops) > 50
    if capture == "unseen":
        assert {line["tag"] for line in replay.schema_events if line["kind"] == "altered"} == {"UNSEEN DDL"}
        return
    # The stream announced each change of t, once, in the order they were made.
    announced = [line["sql"] for line in replay.schema_events if line["table"] in ("public.t", "public.t2")]
    made = ["ADD COLUMN c", "ADD COLUMN d", "ADD COLUMN e", "ADD COLUMN f", "ADD COLUMN g", "RENAME COLUMN b TO bb",
            "ALTER COLUMN d TYPE", "ALTER COLUMN a TYPE int USING a * 2", "DROP COLUMN f", "RENAME TO t2", "ADD PRIMARY KEY (a, id)",
            "DROP CONSTRAINT t2_pkey", "ADD PRIMARY KEY (id)"]
    assert len(announced) == len(made) and all(m in a for m, a in zip(made, announced)), announced
    assert [line["kind"] for line in replay.schema_events if line["table"] == "public.n"] == ["dropped"]


def test_stream_shows_the_schema_change_between_the_row_changes_of_its_transaction(dsn, conn, source, tmp_path):
    source.create_queue("q")
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    source.add_table("q", "t")
    stream = tmp_path / "changes.jsonl"
    target = open_target(f"jsonl:{stream}")
    consumer = Consumer(dsn, "q", target)
    try:
        consumer.run(until_caught_up=True)
        with conn.transaction():
            conn.execute("INSERT INTO t VALUES (1, 'a')")
            conn.execute("ALTER TABLE t ADD COLUMN w int")
            conn.execute("INSERT INTO t VALUES (2, 'b', 20)")
            conn.execute("UPDATE t SET w = 10 WHERE id = 1")
        conn.execute("INSERT INTO t VALUES (3, 'c', 30)")
        conn.execute("ALTER TABLE t RENAME COLUMN v TO label")
        conn.execute("DELETE FROM t WHERE id = 2")
        conn.execute("ALTER TABLE t RENAME TO things")
        conn.execute("UPDATE things SET label = 'C' WHERE id = 3")
        consumer.run(until_caught_up=True)
    finally:
        consumer.close()
        target.close()
    lines = [(line["op"], line["table"], line["sql"] if line["op"] == "S" else line.get("row") or line["key"])
             for line in stream_lines(stream)]
    assert lines == [
        ("I", "public.t", {"id": 1, "v": "a"}),
        ("S", "public.t", "ALTER TABLE t ADD COLUMN w int"),
        ("I", "public.t", {"id": 2, "v": "b", "w": 20}),
        ("U", "public.t", {"id": 1, "v": "a", "w": 10}),
        ("I", "public.t", {"id": 3, "v": "c", "w": 30}),
        ("S", "public.t", "ALTER TABLE t RENAME COLUMN v TO label"),
        ("D", "public.t", {"id": 2}),
        ("S", "public.t", "ALTER TABLE t RENAME TO things"),
        ("U", "public.things", {"id": 3, "label": "C", "w": 30}),
    ]
    schema_lines = [line for line in stream_lines(stream) if line["op"] == "S"]
    assert [(s["kind"], s["tag"], s["schema"], s["name"], s["columns"]) for s in schema_lines] == [
        ("altered", "ALTER TABLE", "public", "t", ["id", "v", "w"]),
        ("altered", "ALTER TABLE", "public", "t", ["id", "label", "w"]),
        ("altered", "ALTER TABLE", "public", "things", ["id", "label", "w"]),
    ]
    # attnum tells the reader that "label" is "v" renamed, not a new column
    assert {c["name"]: c["attnum"] for c in schema_lines[1]["structure"]} == {"id": 1, "label": 2, "w": 3}


def test_consumer_behind_several_ddls_catches_up_across_them(dsn, conn, source, tmp_path):
    base_tables(conn, source)
    sqlite_path, stream_path = tmp_path / "replica.db", tmp_path / "changes.jsonl"
    layouts = {}

    def consume_all(step: str) -> None:
        for target in (f"sqlite:{sqlite_path}", f"jsonl:{stream_path}"):
            result = run_cli_in_process(dsn, "consume", "q", "--target", target, "--until-caught-up")
            assert result.returncode == 0, result.stderr
        for table in source_tables(conn):
            layouts.setdefault(f"public.{table}", attnums(conn, table))
        assert_sqlite_equals_source(conn, sqlite_path, step)
        assert_stream_equals_source(conn, StreamReplay(layouts).replay(stream_lines(stream_path)), step)

    consume_all("initial copy")
    # While no consumer runs: in place changes, re-copies, a table swapped for a new one
    # of the same name, a table created and one dropped, rows written between them all.
    for script in [
        "ALTER TABLE t ADD COLUMN c text; UPDATE t SET c = 'c' || id WHERE id < 10",
        "ALTER TABLE p ADD COLUMN x int DEFAULT 7; UPDATE p SET a = a + 1 WHERE id % 4 = 0",
        "ALTER TABLE t ADD COLUMN ts timestamptz DEFAULT now(); DELETE FROM t WHERE id % 9 = 0",
        "ALTER TABLE p RENAME COLUMN b TO bb; UPDATE p SET bb = bb || '!' WHERE id < 5",
        "ALTER TABLE t RENAME COLUMN b TO bb; INSERT INTO t (id, a, bb) VALUES (100, 1, 'new')",
        "ALTER TABLE t ALTER COLUMN a TYPE bigint USING a * 3; UPDATE t SET a = a + 1 WHERE id = 100",
        "ALTER TABLE p DROP COLUMN x; DELETE FROM p WHERE id = 3",
        "ALTER TABLE t RENAME TO t_old; CREATE TABLE t (id int PRIMARY KEY, note text);"
        " INSERT INTO t VALUES (1, 'fresh'), (2, 'fresh'); INSERT INTO t_old (id, a) VALUES (101, 1)",
        "CREATE TABLE keep AS SELECT id, bb FROM t_old WHERE id < 20",
        "CREATE TABLE gone (id int PRIMARY KEY); INSERT INTO gone VALUES (1)",
        "UPDATE gone SET id = 2; DROP TABLE gone",
        "UPDATE keep SET bb = NULL WHERE id < 5; UPDATE t SET note = 'updated' WHERE id = 2",
    ]:
        conn.execute(script)
    consume_all("catching up")
    assert set(source_tables(conn)) == {"t", "t_old", "p", "keep"}


# pgcapture's known failures ------------------------------------------------------------------

@pytest.mark.parametrize("capture", ["event_triggers", "execute"])
def test_create_table_as_and_select_into_rows_reach_the_targets_exactly_once(dsn, conn, source, tmp_path, capture):
    if capture == "execute":
        drop_event_triggers(conn)
    source.create_queue("q")
    conn.execute("CREATE SCHEMA app")
    conn.execute("CREATE TABLE app.src (id int PRIMARY KEY, v text)")
    conn.execute("INSERT INTO app.src SELECT g, CASE WHEN g % 3 = 0 THEN NULL ELSE 'v' || g END"
                 " FROM generate_series(1, 30) g")
    source.follow_schema("q", "app")
    sqlite_path, stream_path = tmp_path / "replica.db", tmp_path / "changes.jsonl"
    targets = [open_target(f"sqlite:{sqlite_path}"), open_target(f"jsonl:{stream_path}")]
    consumers = [Consumer(dsn, "q", target) for target in targets]
    try:
        for consumer in consumers:
            consumer.run(until_caught_up=True)
        apply_step(conn, source, capture, "CREATE TABLE app.copied AS SELECT id, v FROM app.src WHERE id <= 20")
        apply_step(conn, source, capture, "SELECT id, v INTO app.selected FROM app.src WHERE id > 20")
        # a CREATE TABLE AS followed by writes in its transaction
        apply_step(conn, source, capture, "CREATE TABLE app.busy AS SELECT id, v FROM app.src WHERE id <= 5;"
                                          " INSERT INTO app.busy VALUES (6, 'six')")
        for consumer in consumers:
            consumer.run(until_caught_up=True)
        # Keyless tables are keyed on every column; rows with NULLs are rewritten, not doubled.
        conn.execute("UPDATE app.copied SET v = v")
        conn.execute("UPDATE app.copied SET id = id + 100 WHERE id % 2 = 0")
        conn.execute("DELETE FROM app.selected WHERE id % 2 = 0")
        conn.execute("UPDATE app.busy SET v = 'x' WHERE v IS NULL")
        for consumer in consumers:
            consumer.run(until_caught_up=True)
    finally:
        for consumer in consumers:
            consumer.close()
            consumer.target.close()
    for table, count in [("copied", 20), ("selected", 5), ("busy", 6)]:
        expected = source_rows(conn, table, "app")
        assert sum(expected.values()) == count
        assert sqlite_rows(sqlite_path, f"app__{table}") == expected, table
    lines = stream_lines(stream_path)
    replay = StreamReplay({}).replay(lines)
    # Keyed on every column, a replica collapses a row delivered twice into one: count
    # what was delivered instead. Rows are distinct (by id), so each was delivered once
    # (by the copy, or as an insert after it), never both: as many as were written.
    for table, written in [("copied", 20), ("selected", 10), ("busy", 6)]:
        assert replay.rows(f"app.{table}") == source_rows(conn, table, "app", numeric="text"), table
        delivered = [line["row"]["id"] for line in lines
                     if line["table"] == f"app.{table}" and line["op"] in ("R", "I")]
        assert len(delivered) == written and len(set(delivered)) == written, (table, sorted(delivered))


def test_create_table_and_insert_sent_as_one_string_reach_the_targets_exactly_once(dsn, conn, source, tmp_path):
    source.create_queue("q")
    conn.execute("CREATE SCHEMA app")
    source.follow_schema("q", "app")
    sqlite_path, stream_path = tmp_path / "replica.db", tmp_path / "changes.jsonl"
    for target in (f"sqlite:{sqlite_path}", f"jsonl:{stream_path}"):
        assert run_cli_in_process(dsn, "consume", "q", "--target", target, "--until-caught-up").returncode == 0
    # one string, simple query protocol: both statements in one implicit transaction
    conn.execute("CREATE TABLE app.orders (id int PRIMARY KEY, total numeric(10,2), at timestamptz DEFAULT now());"
                 " INSERT INTO app.orders (id, total) SELECT g, g * 1.5 FROM generate_series(1, 50) g;"
                 " UPDATE app.orders SET total = 0 WHERE id = 1")
    conn.execute("INSERT INTO app.orders (id, total) VALUES (51, 7.25)")
    for target in (f"sqlite:{sqlite_path}", f"jsonl:{stream_path}"):
        result = run_cli_in_process(dsn, "consume", "q", "--target", target, "--until-caught-up")
        assert result.returncode == 0, result.stderr
    expected = source_rows(conn, "orders", "app")
    assert sum(expected.values()) == 51
    assert sqlite_rows(sqlite_path, "app__orders") == expected
    lines = [line for line in stream_lines(stream_path) if line["table"] == "app.orders"]
    assert StreamReplay({}).replay(lines).rows("app.orders") == source_rows(conn, "orders", "app", numeric="text")
    assert sorted(line["key"]["id"] for line in lines if line["op"] in ("R", "I")) == list(range(1, 52))


def test_column_added_with_default_now_holds_the_source_values_on_targets(dsn, conn, source, tmp_path):
    source.create_queue("q")
    conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
    conn.execute("INSERT INTO t SELECT generate_series(1, 10)")
    source.add_table("q", "t")
    sqlite_path = tmp_path / "replica.db"
    assert run_cli_in_process(dsn, "consume", "q", "--target", f"sqlite:{sqlite_path}", "--until-caught-up").returncode == 0
    conn.execute("ALTER TABLE t ADD COLUMN seen timestamptz DEFAULT now(), ADD COLUMN r float8 DEFAULT random()")
    conn.execute("ALTER TABLE t ADD COLUMN n int NOT NULL DEFAULT 3")
    conn.execute("INSERT INTO t (id) VALUES (11)")
    assert run_cli_in_process(dsn, "consume", "q", "--target", f"sqlite:{sqlite_path}", "--until-caught-up").returncode == 0
    replica = sqlite_rows(sqlite_path, "t")
    assert replica == source_rows(conn, "t")
    assert len({dict(row)["seen"] for row in replica}) == 2       # the ALTER's now(), the INSERT's
    assert all(dict(row)["seen"] is not None and dict(row)["n"] == 3 for row in replica)


def test_column_added_with_a_domain_default_holds_the_source_values_on_targets(dsn, conn, source, tmp_path):
    source.create_queue("q")
    conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
    conn.execute("INSERT INTO t SELECT generate_series(1, 10)")
    source.add_table("q", "t")
    sqlite_path = tmp_path / "replica.db"
    consume = ["consume", "q", "--target", f"sqlite:{sqlite_path}", "--until-caught-up"]
    assert run_cli_in_process(dsn, *consume).returncode == 0
    # existing rows get the domain's default; a nested domain has its base's
    conn.execute("CREATE DOMAIN level AS int DEFAULT 3; CREATE DOMAIN top_level AS level CHECK (VALUE > 0)")
    conn.execute("ALTER TABLE t ADD COLUMN lvl top_level")
    # without a constraint, PostgreSQL 12 leaves them NULL (13 fills them): new rows get it anyway
    conn.execute("CREATE DOMAIN plain_level AS int DEFAULT 4")
    conn.execute("ALTER TABLE t ADD COLUMN plain plain_level")
    conn.execute("INSERT INTO t (id) VALUES (11)")
    assert run_cli_in_process(dsn, *consume).returncode == 0
    replica = sqlite_rows(sqlite_path, "t")
    assert replica == source_rows(conn, "t")
    assert {dict(row)["lvl"] for row in replica} == {3}
    filled = 4 if conn.info.server_version >= 130000 else None
    assert sorted((dict(row)["id"], dict(row)["plain"]) for row in replica) == [
        (i, filled) for i in range(1, 11)] + [(11, 4)]


def test_row_with_a_null_key_written_after_drop_not_null_replicates_exactly(dsn, conn, source, tmp_path):
    source.create_queue("q")
    conn.execute("CREATE TABLE t (code text NOT NULL, v text)")
    conn.execute("INSERT INTO t VALUES ('a', 'one')")
    source.add_table("q", "t", key=["code"])
    sqlite_path = tmp_path / "replica.db"
    consume = ["consume", "q", "--target", f"sqlite:{sqlite_path}", "--until-caught-up"]
    assert run_cli_in_process(dsn, *consume).returncode == 0
    conn.execute("ALTER TABLE t ALTER COLUMN code DROP NOT NULL")
    conn.execute("INSERT INTO t VALUES (NULL, 'two')")
    conn.execute("UPDATE t SET v = 'three' WHERE code IS NULL")     # an upsert of the NULL key
    assert run_cli_in_process(dsn, *consume).returncode == 0
    assert sqlite_rows(sqlite_path, "t") == source_rows(conn, "t")
    assert sum(sqlite_rows(sqlite_path, "t").values()) == 2


@pytest.mark.parametrize("capture", ["event_triggers", "execute"])
def test_inheritance_children_created_inherited_and_dropped_keep_the_parents_replica_equal(
        dsn, conn, source, tmp_path, capture):
    if capture == "execute":
        drop_event_triggers(conn)
    source.create_queue("q")
    # parent is captured with its descendants: its replica is SELECT * FROM parent
    conn.execute("CREATE TABLE parent (id int PRIMARY KEY, a int, b text)")
    conn.execute("CREATE TABLE child () INHERITS (parent)")
    conn.execute("CREATE TABLE grandchild (PRIMARY KEY (id), g int) INHERITS (child)")
    conn.execute("INSERT INTO parent SELECT i, i, 'p' || i FROM generate_series(1, 10) i")
    conn.execute("INSERT INTO child SELECT i, i, 'c' || i FROM generate_series(11, 20) i")
    conn.execute("INSERT INTO grandchild SELECT i, i, 'g' || i, i FROM generate_series(21, 30) i")
    source.add_table("q", "parent")
    replica = tmp_path / "replica.db"
    consume = ["consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up"]
    assert run_cli_in_process(dsn, *consume).returncode == 0
    steps = [
        # recursing to every descendant, while the statement names the parent only
        "ALTER TABLE parent ADD COLUMN c int;"
        " INSERT INTO child VALUES (31, 1, 'x', 5); UPDATE grandchild SET c = id WHERE id < 25",
        # a new child, written through its own name and through its parent's
        "CREATE TABLE late () INHERITS (parent); INSERT INTO late SELECT i, i, 'l', i FROM generate_series(100, 110) i;"
        " UPDATE parent SET b = 'late!' WHERE id > 105",
        # a table with rows (its columns in another order, one more) joins the tree
        "CREATE TABLE joiner (extra text, c int, b text, a int, id int NOT NULL);"
        " INSERT INTO joiner SELECT 'e', 1, 'j', i, i FROM generate_series(200, 210) i;"
        " ALTER TABLE joiner INHERIT parent",
        "UPDATE joiner SET a = -a, extra = 'f'; DELETE FROM parent WHERE id % 4 = 0",
        # its rows leave with it; it is captured no more
        "ALTER TABLE joiner NO INHERIT parent; INSERT INTO joiner VALUES ('gone', 0, 'x', 0, 300);"
        " UPDATE parent SET a = a + 1",
        "DROP TABLE late",
        "ALTER TABLE parent DROP COLUMN b; INSERT INTO grandchild VALUES (32, 2, 7, 8)",
        "ALTER TABLE parent ALTER COLUMN a TYPE int USING a * 10",   # rewrites the descendants' rows
    ]
    sizes = []
    for step in steps:
        apply_step(conn, source, capture, step)
        assert run_cli_in_process(dsn, *consume).returncode == 0
        assert sqlite_rows(replica, "parent") == source_rows(conn, "parent"), step
        sizes.append(sum(sqlite_rows(replica, "parent").values()))
    assert sizes == [31, 42, 53, 40, 32, 24, 25, 25]
    assert sqlite_tables(replica) == ["parent"]
    assert [t.name for t in source.tables("q")] == ["public.parent"]
    tags = [e["tag"] for (e,) in conn.execute("SELECT ev_data FROM replicator.event_1 WHERE ev_type = 'S'"
                                              " ORDER BY ev_id") if e.get("copy")]
    # the INHERIT, the NO INHERIT, the DROP and the rewrite asked for a copy, nothing else
    assert tags == ["ALTER TABLE", "ALTER TABLE", "DROP TABLE", "ALTER TABLE"]


@pytest.mark.parametrize("capture", ["event_triggers", "execute"])
def test_partitions_created_attached_and_detached_keep_the_replica_equal(dsn, conn, source, tmp_path, capture):
    source.create_queue("q")
    conn.execute("CREATE TABLE p (id int PRIMARY KEY, v text) PARTITION BY RANGE (id)")
    conn.execute("CREATE TABLE p_low PARTITION OF p FOR VALUES FROM (0) TO (100)")
    conn.execute("INSERT INTO p SELECT g, 'low' || g FROM generate_series(1, 50) g")
    source.add_table("q", "p")
    replica = tmp_path / "replica.db"
    consume = ["consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up"]
    assert run_cli_in_process(dsn, *consume).returncode == 0
    steps = [
        # rows written through a new partition, named directly
        "CREATE TABLE p_mid PARTITION OF p FOR VALUES FROM (100) TO (200);"
        " INSERT INTO p_mid SELECT g, 'mid' || g FROM generate_series(100, 120) g; UPDATE p_mid SET v = 'x'",
        # a table with rows attached: they join p without a row trigger
        "CREATE TABLE p_high (id int PRIMARY KEY, v text);"
        " INSERT INTO p_high SELECT g, 'high' || g FROM generate_series(200, 230) g;"
        " ALTER TABLE p ATTACH PARTITION p_high FOR VALUES FROM (200) TO (300)",
        "UPDATE p SET v = v || '!' WHERE id % 3 = 0; DELETE FROM p_high WHERE id > 225",
        # rows leave p with the partition; the detached table is not captured any more
        "ALTER TABLE p DETACH PARTITION p_low; INSERT INTO p_low VALUES (99, 'detached'); UPDATE p SET v = 'y'",
    ]
    for step in steps:
        apply_step(conn, source, capture, step)
        assert run_cli_in_process(dsn, *consume).returncode == 0
        assert sqlite_rows(replica, "p") == source_rows(conn, "p"), step
    assert "p_low" not in sqlite_tables(replica)
    tags = [e["tag"] for (e,) in conn.execute("SELECT ev_data FROM replicator.event_1 WHERE ev_type = 'S'"
                                              " ORDER BY ev_id") if e.get("copy")]
    assert tags == ["ALTER TABLE", "ALTER TABLE"]   # the attach and the detach asked for a copy, nothing else


@pytest.mark.parametrize("capture", ["event_triggers", "execute", "unseen"])
def test_a_partition_detached_changed_and_attached_again_in_one_transaction_keeps_the_replica_equal(
        dsn, conn, source, tmp_path, capture):
    """Partition maintenance. PostgreSQL 12 refuses to attach a table that carries triggers with
    transition tables, the capture's included (13 refuses row-level ones only). The event
    triggers and `replicator execute` take a detached partition's capture triggers away with
    the DETACH, so attaching it again works on 12 too. Run directly where no event trigger sees
    it ("unseen"), the partition keeps them until the ticker follows the DETACH: 12 refuses the
    ATTACH until then, naming the trigger, and nothing of the transaction is applied."""
    if capture != "event_triggers":
        drop_event_triggers(conn)
    source.create_queue("q")
    conn.execute("CREATE TABLE p (id int PRIMARY KEY, v text) PARTITION BY RANGE (id)")
    conn.execute("CREATE TABLE p_low PARTITION OF p FOR VALUES FROM (0) TO (100)")
    conn.execute("CREATE TABLE p_mid PARTITION OF p FOR VALUES FROM (100) TO (200)")
    conn.execute("INSERT INTO p SELECT g, 'v' || g FROM generate_series(1, 150) g")
    source.add_table("q", "p")
    replica = tmp_path / "replica.db"
    consume = ["consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up"]
    assert run_cli_in_process(dsn, *consume).returncode == 0
    detach = "ALTER TABLE p DETACH PARTITION p_mid"
    change_and_attach = ("UPDATE p_mid SET v = 'archived'; DELETE FROM p_mid WHERE id > 140;"
                         " ALTER TABLE p ATTACH PARTITION p_mid FOR VALUES FROM (100) TO (200)")
    if capture == "unseen" and conn.info.server_version < 130000:
        with pytest.raises(psycopg.errors.FeatureNotSupported,
                           match=r'^trigger "_replicator_1_del" prevents table "p_mid" from becoming a partition'):
            conn.execute(f"{detach}; {change_and_attach}")
        assert conn.execute("SELECT count(*) FROM p WHERE v = 'archived'").fetchone()[0] == 0
        conn.execute(detach)
        source.tick("q")                            # the ticker follows the DETACH first
        conn.execute(change_and_attach)
    else:
        apply_step(conn, source, capture, f"{detach}; {change_and_attach}")
    source.tick("q")
    assert run_cli_in_process(dsn, *consume).returncode == 0
    assert sqlite_rows(replica, "p") == source_rows(conn, "p")
    assert sum(sqlite_rows(replica, "p").values()) == 140
    assert conn.execute("SELECT count(*) FROM p WHERE v = 'archived'").fetchone()[0] == 41
    # p_mid carries the capture triggers again: a write naming it is captured
    conn.execute("UPDATE p_mid SET v = 'back' WHERE id = 100")
    assert run_cli_in_process(dsn, *consume).returncode == 0
    assert sqlite_rows(replica, "p") == source_rows(conn, "p")


# refusals and unsupported changes ------------------------------------------------------------

def test_dropping_the_primary_key_keeps_rows_with_the_old_key_apart(dsn, conn, source, tmp_path):
    source.create_queue("q")
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    conn.execute("INSERT INTO t VALUES (1, 'a'), (2, 'b')")
    source.add_table("q", "t")
    sqlite_path = tmp_path / "replica.db"
    target = open_target(f"sqlite:{sqlite_path}")
    consumer = Consumer(dsn, "q", target)
    try:
        consumer.run(until_caught_up=True)
        conn.execute("ALTER TABLE t DROP CONSTRAINT t_pkey")
        conn.execute("INSERT INTO t VALUES (1, 'another one')")      # the old key, twice
        consumer.run(until_caught_up=True)
        assert sqlite_rows(sqlite_path, "t") == source_rows(conn, "t")
        conn.execute("DELETE FROM t WHERE v = 'a'")
        conn.execute("ALTER TABLE t ADD PRIMARY KEY (id)")
        conn.execute("UPDATE t SET v = 'one' WHERE id = 1")
        consumer.run(until_caught_up=True)
        assert sqlite_rows(sqlite_path, "t") == source_rows(conn, "t")
        assert sum(source_rows(conn, "t").values()) == 2
    finally:
        consumer.close()
        target.close()


def test_unknown_schema_change_stops_the_consumer_naming_the_event_and_the_way_out(dsn, conn, source, tmp_path):
    source.create_queue("q")
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    table_id = source.add_table("q", "t")
    sqlite_path = tmp_path / "replica.db"
    assert run_cli_in_process(dsn, "consume", "q", "--target", f"sqlite:{sqlite_path}", "--until-caught-up").returncode == 0
    conn.execute("INSERT INTO t VALUES (1, 'before')")
    # what a newer source would queue for a change this consumer does not know
    ev_id = conn.execute("SELECT replicator.insert_schema_event(%s, '{\"kind\": \"partitioned\", "
                         "\"tag\": \"ALTER TABLE\"}')", (table_id,)).fetchone()[0]
    conn.execute("INSERT INTO t VALUES (2, 'after')")
    result = run_cli(dsn, "consume", "q", "--target", f"sqlite:{sqlite_path}", "--until-caught-up")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: event {ev_id} is a schema change of kind 'partitioned' on public.t, which this version of "
        f"replicator cannot apply: upgrade the consumer, or remove the table from the queue and add it again")
    assert "Traceback" not in result.stderr
    # nothing of the batch was applied: not the row before the event either
    assert sqlite_rows(sqlite_path, "t") == {}
    with pytest.raises(UserError, match=f"event {ev_id} is a schema change"):
        consumer = Consumer(dsn, "q", open_target(f"sqlite:{sqlite_path}"))
        try:
            consumer.run(until_caught_up=True)
        finally:
            consumer.close()
            consumer.target.close()


def test_a_key_dropped_where_no_event_trigger_sees_it_suspends_the_capture_not_the_application(
        dsn, conn, source, tmp_path):
    drop_event_triggers(conn)
    source.create_queue("q")
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, code text NOT NULL UNIQUE, v text)")
    conn.execute("INSERT INTO t SELECT g, 'c' || g, 'v' || g FROM generate_series(1, 10) g")
    source.add_table("q", "t")
    replicas = Replicas(dsn, tmp_path)
    try:
        replicas.catch_up()
        conn.execute("ALTER TABLE t DROP COLUMN id")              # its key, directly
        conn.execute("INSERT INTO t VALUES ('c11', 'v11')")       # the application goes on writing
        conn.execute("UPDATE t SET v = 'w' WHERE code = 'c3'")
        conn.execute("DELETE FROM t WHERE code = 'c4'")
        for consumer in replicas.consumers:
            with pytest.raises(UserError, match=r"captured with key \(id\).*replicator table remove q public\.t"):
                consumer.run(until_caught_up=True)
        assert [t.name for t in source.tables("q")] == ["public.t"]
        listed = json.loads(run_cli_in_process(dsn, "table", "list", "--json").stdout)
        assert "captured with key (id)" in listed[0]["suspended"]
        # the way out the message names: remove it and add it again, with a key it has
        source.remove_table("q", "t")
        source.add_table("q", "t", key=["code"])
        conn.execute("UPDATE t SET v = 'after' WHERE code = 'c5'")
        replicas.catch_up()
        assert_sqlite_equals_source(conn, replicas.sqlite_path, "added again")
    finally:
        replicas.close()


class SqliteTargetLosingTheSourceOnce(LosesTheSourceOnce, SqliteTarget):
    pass


def test_a_batch_that_altered_a_table_and_failed_is_applied_again_in_the_old_layout(dsn, conn, source, tmp_path):
    source.create_queue("q")
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, a numeric(10,2))")
    conn.execute("INSERT INTO t VALUES (1, 1.5)")
    source.add_table("q", "t")
    # one batch: a row in the old layout, a column added in place, a row in the new one
    apply_losing_the_source_once(dsn, conn, SqliteTargetLosingTheSourceOnce(tmp_path / "replica.db"),
                                 ["INSERT INTO t VALUES (2, 2.5)", "ALTER TABLE t ADD COLUMN b numeric(10,2)",
                                  "INSERT INTO t VALUES (3, 3.5, 3.25)"])
    assert sqlite_rows(tmp_path / "replica.db", "t") == source_rows(conn, "t")
