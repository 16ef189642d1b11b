"""`table alter`: a capture's settings changed in place, with an S event that
tells consumers the new settings from that point of the queue. The oracle: after
each kind of alter, with writes before, during and after it, the SQLite replica
and a replay of the JSON-lines stream hold the source's rows inside the filter,
without the ignored columns."""

from __future__ import annotations

import os
import threading
from collections import Counter

import psycopg
import pytest
from psycopg import sql

from consumer_helpers import run_cli, wait_until
from ddl_helpers import Replicas, StreamReplay, attnums, diff, replica_value, sqlite_rows
from replicator.errors import UserError
from replicator.source.install import EVENT_TRIGGERS


def expected_rows(conn: psycopg.Connection, table: str) -> Counter:
    """The source's rows as the capture's settings say a replica holds them."""
    captured, where = conn.execute(
        "SELECT ARRAY(SELECT c FROM unnest(table_columns) c WHERE c <> ALL (table_ignore)), table_where"
        " FROM replicator.captured_table WHERE table_name = %s", (table,)).fetchone()
    query = sql.SQL("SELECT {} FROM {} WHERE {}").format(
        sql.SQL(", ").join(map(sql.Identifier, captured)), sql.Identifier(table), sql.SQL(where or "true"))
    cur = conn.execute(query)
    names = [d.name for d in cur.description]
    return Counter(tuple(sorted((n, replica_value(v)) for n, v in zip(names, row))) for row in cur)


def assert_replicas_hold_the_capture(conn: psycopg.Connection, replicas: Replicas, table: str, step: str) -> None:
    expected = expected_rows(conn, table)
    problems = diff(expected, sqlite_rows(replicas.sqlite_path, table), f"sqlite {table}")
    replay = StreamReplay({f"public.{table}": attnums(conn, table)}).replay(replicas.stream())
    problems += diff(expected, replay.rows(f"public.{table}"), f"stream {table}")
    assert not problems, f"after {step!r}: {len(problems)} differences:\n" + "\n".join(problems[:20])


@pytest.fixture(params=["event triggers", "no event triggers"])
def event_triggers(request, conn) -> bool:
    if request.param == "no event triggers":
        for name in EVENT_TRIGGERS:
            conn.execute(sql.SQL("DROP EVENT TRIGGER {}").format(sql.Identifier(name)))
    return request.param == "event triggers"


@pytest.fixture(params=["full", "pk"])
def mode(request) -> str:
    """The capture mode of t: in pk mode, the keys an alter's batch holds before its S
    event are read back after it (in place) or dropped (copied again)."""
    return request.param


@pytest.fixture
def replicas(conn, source, dsn, tmp_path, event_triggers, mode):
    """Table t (id, n, s, note) of queue q, replicated."""
    source.create_queue("q")
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, n int NOT NULL, s text, note text)")
    conn.execute("INSERT INTO t SELECT g, g, 's' || g, 'note' || g FROM generate_series(1, 30) g")
    source.add_table("q", "t", mode=mode)
    replicas = Replicas(dsn, tmp_path)
    replicas.catch_up()
    yield replicas
    replicas.close()


def alter(dsn: str, *args: str) -> str:
    result = run_cli(dsn, "table", "alter", "q", "t", *args)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def wait_for_the_alter_trying_the_lock(conn: psycopg.Connection) -> None:
    """Until a `table alter` runs replicator.alter_table (which tries the table's lock for 5 s)."""
    wait_until(lambda: conn.execute("SELECT count(*) FROM pg_stat_activity WHERE state = 'active'"
                                    " AND query LIKE '%replicator.alter_table%' AND pid <> pg_backend_pid()"
                                    ).fetchone()[0], 30, "the alter to try the table's lock")


def write_around(conn: psycopg.Connection, dsn: str, args: list[str], round_: int) -> str:
    """Alters t with writes before it, from a transaction holding t while the alter tries its lock, from a
    transaction (reading t) older than the alter's that writes after it, and after it."""
    base = 1000 * round_
    conn.execute("INSERT INTO t SELECT g, g, 'before', 'x' FROM generate_series(%s::int, %s::int) g", (base, base + 9))
    conn.execute("UPDATE t SET n = n + 1, s = s || '+' WHERE id % 3 = 0")
    with psycopg.connect(dsn) as held, psycopg.connect(dsn) as older:
        held.execute("UPDATE t SET n = n + 100, note = 'held' WHERE id % 4 = 0")   # not committed yet
        older.execute("SELECT txid_current(), count(*) FROM t")      # a transaction older than the alter's
        outcome: list[str] = []
        worker = threading.Thread(target=lambda: outcome.append(alter(dsn, *args)))
        worker.start()
        wait_for_the_alter_trying_the_lock(conn)
        held.execute("DELETE FROM t WHERE id % 7 = 0")
        held.commit()
        worker.join(60)
        assert outcome, "the alter did not finish"
        older.execute("INSERT INTO t VALUES (%s::int, %s::int, 'older', 'y')", (base + 500, base + 500))
        older.execute("UPDATE t SET n = n * 2 WHERE id % 5 = 0")
        older.commit()
    conn.execute("INSERT INTO t SELECT g, g, 'after', 'z' FROM generate_series(%s::int, %s::int) g", (base + 20, base + 29))
    conn.execute("UPDATE t SET n = n - 1, note = note || '!' WHERE id % 2 = 1")
    return outcome[0]


def test_table_alter_where_copies_the_table_again_and_rows_enter_and_leave(conn, dsn, replicas):
    said = write_around(conn, dsn, ["--where", "n % 2 = 0"], 1)
    assert said == "t of queue q: where changed; targets copy it again at that point of the queue"
    replicas.catch_up()
    assert_replicas_hold_the_capture(conn, replicas, "t", "--where")
    assert write_around(conn, dsn, ["--where", "n > 500"], 2).startswith("t of queue q: where changed")
    replicas.catch_up()
    assert_replicas_hold_the_capture(conn, replicas, "t", "another --where")
    write_around(conn, dsn, ["--no-where"], 3)
    replicas.catch_up()
    assert_replicas_hold_the_capture(conn, replicas, "t", "--no-where")


def test_table_alter_ignore_drops_the_column_in_place_and_no_ignore_copies_it_back(conn, dsn, replicas):
    said = write_around(conn, dsn, ["--ignore", "note"], 1)
    assert said == "t of queue q: ignore changed; targets change their copy in place at that point of the queue"
    replicas.catch_up()
    assert_replicas_hold_the_capture(conn, replicas, "t", "--ignore note")
    schema = [line for line in replicas.stream() if line["op"] == "S"]
    assert [(s["kind"], s["tag"], s["columns"]) for s in schema] == [("altered", "TABLE ALTER", ["id", "n", "s"])]
    assert [line["op"] for line in replicas.stream()].count("R") == 30, "no copy for a column ignored"
    # an update of the ignored column alone queues nothing
    streamed = len(replicas.stream())
    conn.execute("UPDATE t SET note = 'unseen'")
    replicas.catch_up()
    assert len(replicas.stream()) == streamed

    said = write_around(conn, dsn, ["--no-ignore"], 2)
    assert said == "t of queue q: ignore changed; targets copy it again at that point of the queue"
    replicas.catch_up()
    assert_replicas_hold_the_capture(conn, replicas, "t", "--no-ignore")
    assert sorted(dict(r)["note"] for r in sqlite_rows(replicas.sqlite_path, "t"))[:1] != [None]


def test_table_alter_mode_changes_no_row_and_later_changes_apply_in_the_new_mode(conn, dsn, replicas, mode):
    other = "full" if mode == "pk" else "pk"
    said = write_around(conn, dsn, ["--mode", other], 1)
    assert said == "t of queue q: mode changed; targets change their copy in place at that point of the queue"
    replicas.catch_up()
    assert_replicas_hold_the_capture(conn, replicas, "t", f"--mode {other}")
    assert [line["op"] for line in replicas.stream()].count("R") == 30, "no copy for a mode change"
    assert replicas.consumers[0].target.tables()["public.t"].mode == other
    write_around(conn, dsn, ["--mode", mode], 2)
    replicas.catch_up()
    assert_replicas_hold_the_capture(conn, replicas, "t", f"--mode {mode}")
    assert replicas.consumers[0].target.tables()["public.t"].mode == mode


def test_table_alter_key_copies_the_table_again_with_the_new_key(conn, dsn, replicas):
    conn.execute("CREATE UNIQUE INDEX ON t (n, id)")
    said = write_around(conn, dsn, ["--key", "n,id"], 1)
    assert said == "t of queue q: key changed; targets copy it again at that point of the queue"
    replicas.catch_up()
    assert_replicas_hold_the_capture(conn, replicas, "t", "--key n,id")
    assert replicas.consumers[0].target.tables()["public.t"].structure.key == ("n", "id")


def test_table_alter_with_nothing_to_change_is_refused_in_one_line(dsn, replicas, mode):
    for args, message in [
            ((), "error: nothing to change: give --mode, --key, --ignore, --no-ignore, --where, --no-where, "
                 "--old-rows, --no-old-rows or --capture"),
            (("--mode", mode, "--no-where"),
             'error: table public.t of queue "q" already has these settings: nothing to change'),
            (("--where", "n > 1", "--no-where"), "error: --where and --no-where exclude each other")]:
        result = run_cli(dsn, "table", "alter", "q", "t", *args)
        assert (result.returncode, result.stderr.splitlines()) == (1, [message]), args


def test_table_alter_checks_settings_as_table_add_does(conn, source, dsn, replicas):
    conn.execute("CREATE TABLE u (id int PRIMARY KEY, n int)")
    for args in (["--where", "nope > 1"], ["--where", "true); DROP TABLE t; SELECT (1"], ["--ignore", "id"],
                 ["--ignore", "missing"], ["--key", "missing"]):
        with pytest.raises(UserError) as added:
            source.add_table("q", "u", **{args[0][2:]: args[1] if args[0] == "--where" else [args[1]]})
        altered = run_cli(dsn, "table", "alter", "q", "t", *args)
        assert altered.returncode == 1 and len(altered.stderr.splitlines()) == 1, altered.stderr
        assert altered.stderr.strip().replace("public.t", "TABLE").replace(" t ", " TABLE ") == \
            f"error: {added.value}".replace("public.u", "TABLE").replace(" u ", " TABLE "), args
    # nothing changed
    assert conn.execute("SELECT table_where, table_ignore, table_key FROM replicator.captured_table"
                        " WHERE table_name = 't'").fetchone() == (None, [], ["id"])


def test_table_alter_is_refused_to_a_role_that_may_not_write_the_table(conn, source, dsn):
    source.create_queue("q")
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, n int)")
    source.add_table("q", "t")
    role = f"alterer_{os.getpid()}"
    conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    try:
        # every privilege of schema replicator, and reading the table only
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA replicator TO {0}; GRANT ALL ON ALL TABLES IN SCHEMA replicator"
                             " TO {0}; GRANT ALL ON ALL SEQUENCES IN SCHEMA replicator TO {0};"
                             " GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA replicator TO {0};"
                             " GRANT SELECT ON t TO {0}").format(sql.Identifier(role)))
        refused = run_cli(dsn.replace("user=postgres", f"user={role}"), "table", "alter", "q", "t", "--where", "n > 1")
        assert (refused.returncode, refused.stderr.splitlines()) == (1, [
            "error: database: permission denied for table t"])
    finally:
        conn.execute(sql.SQL("DROP OWNED BY {0}; DROP ROLE {0}").format(sql.Identifier(role)))
    assert conn.execute("SELECT table_where FROM replicator.captured_table").fetchone() == (None,)


def test_a_ddl_refused_for_breaking_a_row_filter_goes_through_after_the_way_out_it_names(conn, source, dsn):
    source.create_queue("q")
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, n int)")
    source.add_table("q", "t", where="n > 0")
    with pytest.raises(psycopg.errors.RaiseException, match=r"replicator table alter q public\.t --where"):
        conn.execute("ALTER TABLE t DROP COLUMN n")
    assert run_cli(dsn, "table", "alter", "q", "t", "--no-where").returncode == 0
    conn.execute("ALTER TABLE t DROP COLUMN n")


def test_a_ddl_changing_the_key_or_adding_a_column_amid_writes_leaves_the_replicas_equal_to_the_source(
        conn, dsn, replicas, mode):
    # In pk mode, keys queued before the change are in the batch with it: read back in
    # the new layout after a change in place, left out after a copy with another key.
    conn.execute("UPDATE t SET s = s || '+' WHERE id <= 3")
    conn.execute("DELETE FROM t WHERE id = 4")
    conn.execute("ALTER TABLE t ADD COLUMN extra text")
    conn.execute("UPDATE t SET extra = 'e', s = s || '*' WHERE id BETWEEN 3 AND 6")
    replicas.catch_up()
    assert_replicas_hold_the_capture(conn, replicas, "t", "ADD COLUMN")
    conn.execute("UPDATE t SET s = s || '+' WHERE id <= 3")
    conn.execute("ALTER TABLE t DROP CONSTRAINT t_pkey, ADD PRIMARY KEY (n, id)")
    conn.execute("UPDATE t SET s = s || '!' WHERE id BETWEEN 2 AND 8")
    replicas.catch_up()
    replicas.catch_up()
    assert_replicas_hold_the_capture(conn, replicas, "t", "a new primary key")
    assert replicas.consumers[0].target.tables()["public.t"].structure.key == ("n", "id")


def test_table_alter_held_by_a_long_writer_gives_up_after_5s_naming_it_and_the_applications_writes_go_on(
        conn, source, dsn):
    """The alter tries the lock 20 ms at a time for 5 s: the application's writes go on
    meanwhile, even with a statement_timeout far shorter than that, and the alter is
    refused naming the writer, nothing changed."""
    import subprocess

    from consumer_helpers import REPLICATOR, cli_env

    source.create_queue("q")
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, n int)")
    source.add_table("q", "t")
    with psycopg.connect(dsn) as writer, psycopg.connect(dsn, autocommit=True) as application:
        writer.execute("INSERT INTO t VALUES (1, 1)")                # a long transaction, not committed
        writer_pid = writer.info.backend_pid
        altering = subprocess.Popen([REPLICATOR, "table", "alter", "q", "t", "--where", "n > 0"],
                                    env=cli_env(dsn), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_for_the_alter_trying_the_lock(conn)
            application.execute("SET statement_timeout = '500ms'")
            for key in range(2, 12):                                  # while the alter keeps trying
                application.execute("INSERT INTO t VALUES (%s, %s)", (key, key))
            assert altering.poll() is None, "the alter ended before the application's writes"
            _, stderr = altering.communicate(timeout=60)
        finally:
            altering.kill()
            altering.wait()
        assert altering.returncode == 1 and stderr.splitlines() == [
            f"error: table public.t was held by writers at every try for 5s (pid {writer_pid}): nothing was "
            f"changed; retry once a long transaction among them has ended, or when the table is written less"], stderr
        writer.commit()
    assert conn.execute("SELECT table_where FROM replicator.captured_table").fetchone() == (None,)
    assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == 11
    assert conn.execute("SELECT count(*) FROM replicator.event_1 WHERE ev_type = 'S'").fetchone()[0] == 0


def test_table_alter_gets_its_lock_on_a_table_written_without_a_pause(conn, source, dsn):
    """Writers that each hold the table for a moment, together all the time: a try of
    20 ms finds a gap between their writes (a NOWAIT alone seldom would)."""
    source.create_queue("q")
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, n int)")
    conn.execute("INSERT INTO t SELECT g, g FROM generate_series(1, 40) g")
    source.add_table("q", "t")
    stop = threading.Event()
    failures: list[BaseException] = []

    def write(first: int) -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as writer:
                writer.execute("SET statement_timeout = '500ms'")
                while not stop.is_set():
                    with writer.transaction():
                        writer.execute("UPDATE t SET n = n + 1 WHERE id %% 4 = %s", (first,))
                        writer.execute("SELECT pg_sleep(0.005)")
        except BaseException as exc:
            failures.append(exc)

    writers = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for thread in writers:
        thread.start()
    try:
        assert alter(dsn, "--where", "n > 0")
    finally:
        stop.set()
        for thread in writers:
            thread.join(30)
    assert not failures, failures
    assert conn.execute("SELECT table_where FROM replicator.captured_table").fetchone() == ("n > 0",)


def old_rows_of_changes(lines: list[dict], table: str) -> dict[int, bool]:
    """Replays a stream's lines of a table, checking that each line's "old" is the row the replay holds at
    its key just before (no change lost or doubled before it); returns, by line number, whether each U and
    D line had one. A U line of a key the replay lacks (a key change's new key) has none."""
    rows: dict[tuple, dict] = {}
    had: dict[int, bool] = {}
    for number, line in enumerate(lines):
        if line["table"] != table or line["op"] == "S":
            continue
        if line["op"] == "T":
            rows.clear()
            continue
        key = tuple(line["key"].values())
        if line["op"] in ("U", "D"):
            had[number] = "old" in line
            if "old" in line:
                assert line["old"] == rows.get(key), line
        if line["op"] == "D":
            rows.pop(key, None)
        else:
            rows[key] = line["row"]
    return had


@pytest.mark.parametrize("event_triggers", ["event triggers"], indirect=True)
@pytest.mark.parametrize("mode", ["full"], indirect=True)
def test_table_alter_old_rows_takes_effect_at_its_s_event_with_no_change_lost_or_doubled(conn, dsn, replicas):
    """Changes committed before the alter have no old row, those of statements after it commits (an older
    transaction's too) have theirs, each the row the replica had; --no-old-rows takes them away the same way.
    The S event of each alter is the point in the stream where they start or stop."""
    for round_, args in ((1, ["--old-rows"]), (2, ["--no-old-rows"])):
        assert "old_rows changed" in write_around(conn, dsn, args, round_)
        conn.execute("UPDATE t SET id = id + 10000 WHERE id % 11 = 0")   # key changes
        replicas.catch_up()
        assert_replicas_hold_the_capture(conn, replicas, "t", " ".join(args))
    lines = replicas.stream()
    first, second = [i for i, line in enumerate(lines) if line["op"] == "S" and line.get("tag") == "TABLE ALTER"]
    had = old_rows_of_changes(lines, "public.t")
    before = [old for number, old in had.items() if number < first]
    during = {number: old for number, old in had.items() if first < number < second}
    after = [old for number, old in had.items() if number > second]
    assert before and not any(before)
    assert after and not any(after)
    # with old rows, every U and D has one but the rows of the key changes' new keys
    new_keys = {lines[number]["key"]["id"] for number, old in during.items() if not old}
    assert new_keys and all(lines[n]["op"] == "U" for n, old in during.items() if not old)
    assert all(k > 10000 for k in new_keys), new_keys


def test_table_alter_capture_switches_kinds_both_ways_amid_writes_and_the_replicas_stay_the_source(
        conn, dsn, replicas, mode):
    """Writers never stop while `--capture` replaces the triggers (it waits, as the other settings do,
    for a moment no writer holds the table): every change is queued once, by one kind or the other."""
    stop = threading.Event()
    writes: list[int] = []
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as w:
                i = 0
                while not stop.is_set():
                    i += 1
                    w.execute("INSERT INTO t VALUES (%s, %s, 'w', 'w')", (100000 + i, i))
                    w.execute("UPDATE t SET n = n + 1, s = s || '.' WHERE id = %s", (i % 30 + 1,))
                    w.execute("UPDATE t SET id = %s WHERE id = %s", (200000 + i, 100000 + i - 1))   # a key change
                    w.execute("DELETE FROM t WHERE id = %s", (200000 + i - 3,))
                    with w.transaction():
                        w.execute("UPDATE t SET note = %s WHERE id BETWEEN %s AND %s", (str(i), i % 20 + 1, i % 20 + 5))
                    writes.append(i)
        except BaseException as e:   # reported by the test, not lost with the thread
            errors.append(e)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for kind in ("row", "statement", "row"):
            seen = len(writes)
            wait_until(lambda: len(writes) > seen + 5, 30, "the writer to write")
            assert alter(dsn, "--capture", kind) == (
                "t of queue q: capture changed; targets change their copy in place at that point of the queue")
            conn.execute("UPDATE t SET n = n + 1000 WHERE id <= 10")
    finally:
        stop.set()
        thread.join(30)
    assert not errors, errors
    replicas.catch_up()
    assert_replicas_hold_the_capture(conn, replicas, "t", "--capture row, statement, row")
    assert [line["op"] for line in replicas.stream()].count("R") == 30, "no copy for a capture kind change"
    assert conn.execute("SELECT table_capture FROM replicator.captured_table").fetchone()[0] == "row"
