"""A least-privilege consumer role, granted with one command."""

import sqlite3
import subprocess
from pathlib import Path

import psycopg
import pytest

REPLICATOR = str(Path(__file__).resolve().parent.parent / ".venv" / "bin" / "replicator")


def _as(dsn: str, role: str) -> str:
    return dsn.replace("user=postgres", f"user={role}")


def test_granted_role_consumes_but_cannot_write_the_queue(dsn, conn, source, tmp_path):
    role = f"reader_{abs(hash(dsn)) % 10**8}"
    conn.execute(f'DROP ROLE IF EXISTS "{role}"')
    conn.execute(f'CREATE ROLE "{role}" LOGIN')
    conn.execute('CREATE TABLE "Odd table" (id int PRIMARY KEY, v text)')
    conn.execute('CREATE SCHEMA "Sales s"; CREATE TABLE "Sales s".t (id int PRIMARY KEY)')   # not the role's
    # granted on the parent alone: the copy reads (and locks) it, not its partitions by name
    conn.execute("CREATE TABLE parts (id int PRIMARY KEY) PARTITION BY RANGE (id);"
                 "CREATE TABLE parts_low PARTITION OF parts FOR VALUES FROM (0) TO (100)")
    source.create_queue("q")
    source.add_table("q", '"Odd table"')
    source.add_table("q", '"Sales s".t')
    source.add_table("q", "parts")
    conn.execute("""INSERT INTO "Odd table" VALUES (1, 'a'), (2, 'b'); INSERT INTO "Sales s".t VALUES (7);
                    INSERT INTO parts VALUES (3)""")

    granted = subprocess.run([REPLICATOR, "--dsn", dsn, "grant", role], capture_output=True, text=True)
    assert granted.returncode == 0, granted.stderr
    assert "3 captured table" in granted.stdout

    replica = tmp_path / "replica.db"
    consumed = subprocess.run([REPLICATOR, "--dsn", _as(dsn, role), "consume", "q", "--target",
                               f"sqlite:{replica}", "--until-caught-up"], capture_output=True, text=True)
    assert consumed.returncode == 0, consumed.stderr
    conn.execute("""UPDATE "Odd table" SET v = 'c' WHERE id = 2""")
    consumed = subprocess.run([REPLICATOR, "--dsn", _as(dsn, role), "consume", "q", "--target",
                               f"sqlite:{replica}", "--until-caught-up"], capture_output=True, text=True)
    assert consumed.returncode == 0, consumed.stderr
    with sqlite3.connect(replica) as db:
        assert db.execute('SELECT id, v FROM "Odd table" ORDER BY id').fetchall() == [(1, "a"), (2, "c")]
        assert db.execute('SELECT id FROM "Sales s__t"').fetchall() == [(7,)]
        assert db.execute("SELECT id FROM parts").fetchall() == [(3,)]

    with psycopg.connect(_as(dsn, role), autocommit=True) as reader:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            reader.execute("INSERT INTO replicator.event_1 (ev_id, ev_table, ev_slot, ev_type)"
                           " VALUES (1000, 1, 0, 'I')")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            reader.execute("SELECT replicator.create_queue('mine')")
        # Ticks and positions only through the functions: no forged snapshot for other consumers.
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            reader.execute("INSERT INTO replicator.tick (tick_queue, tick_id, tick_snapshot, tick_event_seq)"
                           " VALUES (1, 1000, '1:1:', 0)")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            reader.execute("DELETE FROM replicator.consumer")
    conn.execute(f'DROP OWNED BY "{role}"')
    conn.execute(f'DROP ROLE "{role}"')
    conn.execute('DROP SCHEMA "Sales s" CASCADE')
    conn.execute("DROP TABLE parts")


def test_grant_to_an_unknown_role_is_one_clear_error(dsn):
    result = subprocess.run([REPLICATOR, "--dsn", dsn, "grant", "nobody_here"], capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.strip() == 'error: role "nobody_here" does not exist'


@pytest.mark.parametrize("isolation", ["read committed", "repeatable read", "serializable"])
def test_application_role_without_access_to_the_queue_writes_captured_tables(dsn, conn, source, isolation):
    from queue_util import changes, read_events

    role = f"app_{abs(hash((dsn, isolation))) % 10**8}"
    conn.execute(f'DROP ROLE IF EXISTS "{role}"')
    conn.execute(f'CREATE ROLE "{role}" LOGIN')
    conn.execute("CREATE TABLE orders (id int PRIMARY KEY, v text)")
    conn.execute(f'GRANT ALL ON orders TO "{role}"')
    source.create_queue("q")
    source.add_table("q", "orders")
    source.register_consumer("q", "c")
    with psycopg.connect(_as(dsn, role), autocommit=True) as app:
        app.execute(f"SET default_transaction_isolation = '{isolation}'")
        app.execute("INSERT INTO orders VALUES (1, 'a'), (2, 'b')")
        app.execute("UPDATE orders SET v = 'c' WHERE id = 2")
        app.execute("UPDATE orders SET id = 3 WHERE id = 1")
        app.execute("DELETE FROM orders WHERE id = 2")
        app.execute("TRUNCATE orders")
        # The queue is written through the capture only: the role cannot reach it itself.
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            app.execute("SELECT count(*) FROM replicator.event_1")
    assert changes(read_events(source)) == [
        ("I", [[1, "a"], [2, "b"]]), ("U", [[2, "c"]]), ("U", [[3, "a"]]), ("D", [[1]]), ("D", [[2]]), ("T", None)]
    conn.execute(f'DROP OWNED BY "{role}"')
    conn.execute(f'DROP ROLE "{role}"')
