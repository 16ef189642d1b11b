"""Incremental views end to end: PostgreSQL source, the real consumer (the
`replicator` console script), views created with `replicator view create`.
After every applied batch each view must equal its defining query run from
scratch on the replica; a kill -9 in the middle of a view refresh and schema
changes of the base tables must leave them so too (or say why not)."""

from __future__ import annotations

import random
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import psycopg

from consumer_helpers import (
    Daemon,
    assert_replica_equals_source,
    cli_env,
    forced_tick,
    run_cli,
    set_fast_ticks,
    sqlite_position,
    wait_until,
)
from views_helpers import view_differences

SCHEMA = """
    CREATE TABLE customers (id int PRIMARY KEY, region text, name text);
    CREATE TABLE orders (id int PRIMARY KEY, customer_id int, amount int, status text);
    INSERT INTO customers SELECT g, CASE WHEN g % 7 = 0 THEN NULL ELSE 'r' || (g % 4) END, 'c' || g
        FROM generate_series(1, 40) g;
    INSERT INTO orders SELECT g, CASE WHEN g % 11 = 0 THEN NULL ELSE g % 45 END, g % 100,
        (ARRAY['new', 'paid', NULL])[1 + g % 3] FROM generate_series(1, 600) g;
"""
VIEWS = {
    "by_customer": "SELECT customer_id, count(*) AS n, sum(amount) AS total, max(amount) AS top"
                   " FROM orders GROUP BY customer_id",
    "by_region": "SELECT c.region, count(*) AS n, sum(o.amount) AS total FROM orders o"
                 " JOIN customers c ON c.id = o.customer_id GROUP BY c.region HAVING count(*) > 2",
    "order_lines": "SELECT o.id, o.amount, c.name FROM orders o JOIN customers c ON c.id = o.customer_id"
                   " WHERE o.status IS NOT NULL",
    "statuses": "SELECT DISTINCT status FROM orders",
    "ranked": "SELECT id, rank() OVER (ORDER BY amount) AS r FROM orders",   # refreshed in full
}


def replica_db(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)


def assert_views_match(path: Path, views: dict[str, str] = VIEWS) -> None:
    db = replica_db(path)
    try:
        problems = [p for name, sql in views.items() if (p := view_differences(db, name, sql))]
    finally:
        db.close()
    assert not problems, "\n".join(problems)


def random_round(conn: psycopg.Connection, rng: random.Random) -> None:
    """One source transaction: inserts, updates moving orders between customers
    (and to/from NULL), deletes (some the last order of a customer), changes to
    customers, all in one transaction so both sides of the join change in a batch."""
    with conn.transaction():
        for _ in range(rng.randrange(1, 12)):
            r = rng.random()
            if r < 0.25:
                conn.execute("INSERT INTO orders VALUES (%s, %s, %s, %s) ON CONFLICT (id) DO NOTHING",
                             (rng.randrange(1, 800), rng.choice([None, *range(1, 50)]), rng.randrange(100),
                              rng.choice(["new", "paid", None])))
            elif r < 0.5:
                conn.execute("UPDATE orders SET customer_id = %s, amount = amount + 1 WHERE id %% 37 = %s",
                             (rng.choice([None, *range(1, 50)]), rng.randrange(37)))
            elif r < 0.65:
                conn.execute("DELETE FROM orders WHERE customer_id = %s", (rng.randrange(1, 50),))
            elif r < 0.75:
                conn.execute("UPDATE orders SET id = id + 1000 WHERE id = %s", (rng.randrange(1, 800),))
            elif r < 0.9:
                conn.execute("UPDATE customers SET region = %s WHERE id = %s",
                             (rng.choice([None, "r0", "r1", "r9"]), rng.randrange(1, 50)))
            else:
                conn.execute("INSERT INTO customers (id, region) VALUES (%s, %s) ON CONFLICT (id) DO UPDATE"
                             " SET region = coalesce(customers.region || 'x', 'r3')",
                             (rng.randrange(1, 50), rng.choice([None, "r2"])))


def consume(dsn: str, replica: Path) -> None:
    done = run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up")
    assert done.returncode == 0, done.stderr


def setup_views(dsn: str, conn: psycopg.Connection, source, replica: Path) -> None:
    conn.execute(SCHEMA)
    source.create_queue("q")
    source.add_table("q", "orders")
    source.add_table("q", "customers")
    consume(dsn, replica)
    for name, sql in VIEWS.items():
        policy = "auto" if name == "ranked" else "incremental"   # small tables: auto would often go full
        created = run_cli(dsn, "view", "create", name, "--target", f"sqlite:{replica}", "--sql", sql,
                          "--policy", policy)
        assert created.returncode == 0, created.stderr
        assert ("maintained incrementally" in created.stdout) == (name != "ranked"), created.stdout


def test_views_follow_every_batch_of_the_real_consumer(dsn, conn, source, tmp_path):
    replica = tmp_path / "r.db"
    setup_views(dsn, conn, source, replica)
    assert_views_match(replica)
    rng = random.Random(7)
    for _ in range(6):
        for _ in range(rng.randrange(1, 4)):
            random_round(conn, rng)
            source.tick("q", force=True)
        consume(dsn, replica)
        assert_replica_equals_source(conn, replica, [("public.orders", "orders", ["id"]),
                                                     ("public.customers", "customers", ["id"])])
        assert_views_match(replica)
    db = replica_db(replica)
    kinds = dict(db.execute("SELECT view, group_concat(DISTINCT kind) FROM _replicator_view_refresh"
                            " WHERE reason <> 'CREATE' GROUP BY view"))
    db.close()
    assert "incremental" in kinds["by_customer"] and "incremental" in kinds["order_lines"], kinds
    assert kinds["ranked"] == "full", kinds
    listed = run_cli(dsn, "view", "list", "--target", f"sqlite:{replica}", "--json")
    assert listed.returncode == 0
    assert '"WINDOW_FUNCTION"' in listed.stdout


def test_a_view_created_while_the_daemon_runs_is_maintained_by_it(dsn, conn, source, tmp_path):
    conn.execute(SCHEMA)
    source.create_queue("q")
    source.add_table("q", "orders")
    source.add_table("q", "customers")
    set_fast_ticks(conn)
    replica = tmp_path / "r.db"
    ticker = Daemon(dsn, "ticker", "--interval", "0.05", log=tmp_path / "ticker.log")
    daemon = Daemon(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--poll-interval", "0.05",
                    log=tmp_path / "consumer.log")
    try:
        wait_until(lambda: sqlite_position(replica), 30, "the consumer's first position")
        tick = forced_tick(conn)                           # the ticker daemon may hold the queue
        wait_until(lambda: (sqlite_position(replica) or 0) >= tick, 30, "the copy")
        for name in ("by_customer", "order_lines"):
            created = run_cli(dsn, "view", "create", name, "--target", f"sqlite:{replica}", "--sql", VIEWS[name],
                              "--policy", "incremental")
            assert created.returncode == 0, created.stderr
        rng = random.Random(3)
        for _ in range(4):
            random_round(conn, rng)
        tick = forced_tick(conn)
        wait_until(lambda: (sqlite_position(replica) or 0) >= tick, 30, "the daemon to apply the changes")
        assert_views_match(replica, {n: VIEWS[n] for n in ("by_customer", "order_lines")})
        assert daemon.terminate() == 0
    finally:
        daemon.stop()
        ticker.stop()
    assert "Traceback" not in daemon.log()
    db = replica_db(replica)
    kinds = {k for (k,) in db.execute("SELECT kind FROM _replicator_view_refresh WHERE reason <> 'CREATE'")}
    db.close()
    assert "incremental" in kinds


KILLER = textwrap.dedent("""
    import os, signal, sys
    from replicator import cli
    from replicator.targets.sqlite.views.refresh import Refresher
    n = int(sys.argv[1])
    calls = {"n": 0}
    original = Refresher.refresh
    def refresh(self, plan, **kwargs):
        calls["n"] += 1
        if calls["n"] >= n:     # the batch's rows, and some views, refreshed: not committed
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, plan, **kwargs)
    Refresher.refresh = refresh
    sys.argv = ["replicator", *sys.argv[2:]]
    cli.main()
""")


def test_kill_9_in_the_middle_of_the_view_refreshes_then_restart(dsn, conn, source, tmp_path):
    replica = tmp_path / "r.db"
    setup_views(dsn, conn, source, replica)
    rng = random.Random(11)
    for _ in range(3):
        random_round(conn, rng)
        source.tick("q", force=True)
    args = ["consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up"]
    killed = subprocess.run([sys.executable, "-c", KILLER, "3", *args], env=cli_env(dsn),
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, f"the kill point was not reached: {killed.stderr}"
    assert_views_match(replica)      # the last committed state is consistent
    consume(dsn, replica)
    assert_replica_equals_source(conn, replica, [("public.orders", "orders", ["id"]),
                                                 ("public.customers", "customers", ["id"])])
    assert_views_match(replica)


def view_state(replica: Path) -> dict[str, tuple[str, str | None]]:
    db = replica_db(replica)
    try:
        return {n: (s, r) for n, s, r in db.execute("SELECT name, status, status_reason FROM _replicator_views")}
    finally:
        db.close()


def test_schema_changes_of_base_tables_revalidate_the_views(dsn, conn, source, tmp_path):
    replica = tmp_path / "r.db"
    setup_views(dsn, conn, source, replica)
    target = f"sqlite:{replica}"
    # a column the views do not read: re-validated, refreshed in full, still incremental
    conn.execute("ALTER TABLE orders ADD COLUMN note text")
    conn.execute("UPDATE orders SET note = 'x', amount = amount + 1 WHERE id < 50")
    source.tick("q", force=True)
    consume(dsn, replica)
    assert all(s == "ok" for s, _ in view_state(replica).values()), view_state(replica)
    assert_views_match(replica)
    db = replica_db(replica)
    reasons = {r for (r,) in db.execute("SELECT reason FROM _replicator_view_refresh WHERE view = 'by_customer'")}
    db.close()
    assert "SCHEMA_CHANGE" in reasons
    # a type change: the consumer copies the table again; the views follow
    conn.execute("ALTER TABLE orders ALTER COLUMN amount TYPE bigint")
    conn.execute("UPDATE orders SET amount = amount * 2 WHERE id < 100")
    source.tick("q", force=True)
    consume(dsn, replica)
    assert all(s == "ok" for s, _ in view_state(replica).values()), view_state(replica)
    assert_views_match(replica)
    # a column a view reads is dropped: that view is stale and says why; the others go on
    conn.execute("ALTER TABLE customers DROP COLUMN name")
    conn.execute("UPDATE orders SET amount = 1 WHERE id < 10")
    source.tick("q", force=True)
    consume(dsn, replica)
    state = view_state(replica)
    assert state["order_lines"][0] == "stale" and "name" in state["order_lines"][1], state
    assert state["by_customer"][0] == "ok" and state["by_region"][0] == "ok"
    assert_views_match(replica, {n: s for n, s in VIEWS.items() if n != "order_lines"})
    listed = run_cli(dsn, "view", "list", "--target", target)
    assert "STALE: SCHEMA_CHANGE" in listed.stdout
    refreshed = run_cli(dsn, "view", "refresh", "order_lines", "--target", target)
    assert refreshed.returncode == 1 and refreshed.stderr.count("\n") == 1, refreshed.stderr
    assert refreshed.stderr.startswith("error: view order_lines cannot be refreshed")
    # rebuilt with a query that runs again
    assert run_cli(dsn, "view", "drop", "order_lines", "--target", target).returncode == 0
    fixed = "SELECT o.id, o.amount, c.region FROM orders o JOIN customers c ON c.id = o.customer_id"
    assert run_cli(dsn, "view", "create", "order_lines", "--target", target, "--sql", fixed).returncode == 0
    random_round(conn, random.Random(5))
    source.tick("q", force=True)
    consume(dsn, replica)
    assert_views_match(replica, {**VIEWS, "order_lines": fixed})
    # the base table is dropped in the source: its views are stale, nothing else breaks
    conn.execute("DROP TABLE customers")
    conn.execute("UPDATE orders SET amount = 2 WHERE id < 10")
    source.tick("q", force=True)
    consume(dsn, replica)
    state = view_state(replica)
    assert state["by_region"][0] == "stale" and state["by_customer"][0] == "ok", state
    assert_views_match(replica, {"by_customer": VIEWS["by_customer"]})
