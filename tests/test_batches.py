"""Batches: a batch holds exactly the events of the transactions that became
visible between two ticks, whole, once; and fetching one does not scan the queue."""

from __future__ import annotations

import itertools
import json

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pg_helpers import examples
from queue_util import Event, read_batches


@pytest.fixture
def t(conn, source):
    conn.execute('CREATE TABLE "t" ("id" bigint PRIMARY KEY, "conn" int NOT NULL, "stmt" bigint NOT NULL)')
    source.create_queue("q")
    source.add_table("q", "t")
    source.register_consumer("q", "c")
    return source


def _insert(conn, *ids: int) -> None:
    conn.execute('INSERT INTO "t" SELECT i, 0, 0 FROM unnest(%s::bigint[]) i', (list(ids),))


def _inserted(batch: list[Event]) -> list[int]:
    return sorted(item[0] for e in batch for item in e.items)


def test_batch_holds_exactly_the_transactions_that_became_visible_between_two_ticks(dsn, conn, t):
    with psycopg.connect(dsn, autocommit=True) as slow:
        _insert(conn, 1)                       # committed before tick 1
        slow.execute("BEGIN")
        _insert(slow, 2)                       # running at tick 1, committed before tick 2
        t.tick("q", force=True)
        _insert(conn, 3)                       # between tick 1 and tick 2
        slow.execute("COMMIT")
        slow.execute("BEGIN")
        _insert(slow, 4)                       # running at tick 2 and 3, committed after tick 3
        t.tick("q", force=True)
        t.tick("q", force=True)
        slow.execute("COMMIT")
        slow.execute("BEGIN")
        _insert(slow, 5)                       # rolled back: never in a batch
        slow.execute("ROLLBACK")
    batches = read_batches(t)                  # ticks a fourth time
    assert [_inserted(b) for b in batches] == [[1], [2, 3], [], [4]]


def test_transaction_open_across_many_ticks_arrives_whole_in_one_batch(dsn, conn, t):
    with psycopg.connect(dsn, autocommit=True) as long:
        long.execute("BEGIN")
        expected_long = []
        for i in range(10):
            _insert(long, 1000 + i)
            expected_long.append(1000 + i)
            _insert(conn, i)
            t.tick("q", force=True)
        long.execute("COMMIT")
    batches = read_batches(t)
    assert [_inserted(b) for b in batches] == [[i] for i in range(10)] + [expected_long]
    long_txids = {e.txid for b in batches for e in b if e.items[0][0] >= 1000}
    assert len(long_txids) == 1


# Random interleavings ---------------------------------------------------------------------------

WRITERS = 3

op = st.one_of(
    st.tuples(st.just("begin"), st.integers(0, WRITERS - 1)),
    st.tuples(st.just("insert"), st.integers(0, WRITERS - 1), st.integers(1, 3)),
    st.tuples(st.just("update"), st.integers(0, WRITERS - 1), st.integers(0, 1)),
    st.tuples(st.just("delete"), st.integers(0, WRITERS - 1), st.integers(0, 2)),
    st.tuples(st.just("savepoint"), st.integers(0, WRITERS - 1)),
    st.tuples(st.just("rollback_to_savepoint"), st.integers(0, WRITERS - 1)),
    st.tuples(st.just("commit"), st.integers(0, WRITERS - 1)),
    st.tuples(st.just("rollback"), st.integers(0, WRITERS - 1)),
    st.tuples(st.just("tick")),
    st.tuples(st.just("consume")),
)


class Writer:
    """One application connection and a model of the rows it owns (conn = its number:
    no other connection touches them, so no statement ever waits for a lock)."""

    def __init__(self, number: int, conn: psycopg.Connection) -> None:
        self.number = number
        self.conn = conn
        self.committed: dict[int, int] = {}       # id -> stmt, as committed
        self.rows: dict[int, int] = {}            # id -> stmt, as this connection sees them
        self.in_txn = False
        self.savepoints: list[tuple[dict[int, int], int]] = []   # (rows, len(pending)) at each savepoint
        self.pending: list[tuple[int, str, list]] = []   # (statement order, type, items) of the open txn

    def reset(self) -> None:
        self.committed, self.rows, self.in_txn, self.savepoints, self.pending = {}, {}, False, [], []


@settings(max_examples=examples(2000), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=3, max_size=50), end_with_commit=st.lists(st.booleans(), min_size=WRITERS,
                                                                            max_size=WRITERS))
def test_random_interleavings_deliver_each_committed_statement_once_in_its_transactions_batch(
        interleaving_env, ops, end_with_commit):
    source, writers, ids, stmts, consumers = interleaving_env
    conn0 = writers[0].conn
    for w in writers:                                     # a clean start: no rows, new consumer
        if w.conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            w.conn.execute("ROLLBACK")
        w.reset()
    conn0.execute('DELETE FROM "t"')   # cheaper than TRUNCATE, which makes new files
    source.tick("q", force=True)
    consumer = f"c{next(consumers)}"
    source.register_consumer("q", consumer)

    ticks = 0                                             # ticks since the consumer's position
    expected: list[list[tuple[int, str, list]]] = [[]]    # per batch: (statement order, type, items)
    got: list[list[Event]] = []
    order = itertools.count()

    def run(w: Writer, ev_type: str, query: str, params: tuple, items: list, rows_after: dict) -> None:
        cur = w.conn.execute(query, params)
        assert cur.rowcount == len(items)
        w.rows = rows_after
        if items:
            w.pending.append((next(order), ev_type, sorted(items)))
        if not w.in_txn:                                  # autocommit statement
            commit(w)

    def commit(w: Writer) -> None:
        expected[ticks].extend(w.pending)
        w.committed = dict(w.rows)
        w.pending, w.savepoints, w.in_txn = [], [], False

    def drop(w: Writer) -> None:
        w.rows = dict(w.committed)
        w.pending, w.savepoints, w.in_txn = [], [], False

    for step in ops:
        kind = step[0]
        if kind == "tick":
            source.tick("q", force=True)
            ticks += 1
            expected.append([])
            continue
        if kind == "consume":
            got.extend(read_batches(source, "q", consumer, tick=False))
            continue
        w = writers[step[1]]
        if kind == "begin" and not w.in_txn:
            w.conn.execute("BEGIN")
            w.in_txn = True
        elif kind == "insert":
            new = [next(ids) for _ in range(step[2])]
            stmt = next(stmts)
            run(w, "I", 'INSERT INTO "t" SELECT i, %s, %s FROM unnest(%s::bigint[]) i',
                (w.number, stmt, new), [[i, w.number, stmt] for i in new], {**w.rows, **{i: stmt for i in new}})
        elif kind == "update":
            stmt = next(stmts)
            hit = [i for i in w.rows if i % 2 == step[2]]
            run(w, "U", 'UPDATE "t" SET "stmt" = %s WHERE "conn" = %s AND "id" %% 2 = %s',
                (stmt, w.number, step[2]), [[i, w.number, stmt] for i in hit], {**w.rows, **{i: stmt for i in hit}})
        elif kind == "delete":
            hit = [i for i in w.rows if i % 3 == step[2]]
            run(w, "D", 'DELETE FROM "t" WHERE "conn" = %s AND "id" %% 3 = %s',
                (w.number, step[2]), [[i] for i in hit], {i: s for i, s in w.rows.items() if i not in hit})
        elif kind == "savepoint" and w.in_txn:
            w.conn.execute(f'SAVEPOINT "sp{len(w.savepoints)}"')
            w.savepoints.append((dict(w.rows), len(w.pending)))
        elif kind == "rollback_to_savepoint" and w.savepoints:
            w.conn.execute(f'ROLLBACK TO SAVEPOINT "sp{len(w.savepoints) - 1}"')
            rows, npending = w.savepoints[-1]
            w.rows, w.pending = dict(rows), w.pending[:npending]
        elif kind == "commit" and w.in_txn:
            w.conn.execute("COMMIT")
            commit(w)
        elif kind == "rollback" and w.in_txn:
            w.conn.execute("ROLLBACK")
            drop(w)

    for w, do_commit in zip(writers, end_with_commit):
        if w.in_txn:
            w.conn.execute("COMMIT" if do_commit else "ROLLBACK")
            commit(w) if do_commit else drop(w)
    source.tick("q", force=True)
    ticks += 1
    expected.append([])
    got.extend(read_batches(source, "q", consumer, tick=False))

    # The source holds what the model says, and the batches say the same.
    assert dict(conn0.execute('SELECT "id", "stmt" FROM "t"').fetchall()) == {
        i: s for w in writers for i, s in w.committed.items()}
    assert len(got) == ticks
    # Batch k holds the statements of the transactions committed between the consumer's
    # k-th and (k+1)-th tick, in statement order.
    assert [[(e.type, sorted(e.items)) for e in batch] for batch in got] == \
           [[(ev_type, items) for _order, ev_type, items in sorted(batch)] for batch in expected[:ticks]]
    batches_of_txid: dict[int, set[int]] = {}
    for number, batch in enumerate(got):
        for e in batch:
            batches_of_txid.setdefault(e.txid, set()).add(number)
    assert all(len(found) == 1 for found in batches_of_txid.values())


@pytest.fixture
def interleaving_env(dsn, conn, t):
    writers = [Writer(i, psycopg.connect(dsn, autocommit=True)) for i in range(WRITERS)]
    try:
        yield t, writers, itertools.count(1), itertools.count(1), itertools.count(1)
    finally:
        for w in writers:
            w.conn.close()


# Fetching a batch --------------------------------------------------------------------------------

def _plan_nodes(node: dict):
    yield node
    for child in node.get("Plans", []):
        yield from _plan_nodes(child)


def test_fetching_a_batch_does_not_scan_the_whole_queue(dsn, conn, t):
    # Many events from many transactions, spread over every event table by rotation.
    for table in range(3):
        conn.execute("""DO $$ BEGIN
                            FOR i IN 1..1500 LOOP
                                INSERT INTO "t" SELECT g, 0, i FROM generate_series(i * 10, i * 10 + 2) g
                                    ON CONFLICT ("id") DO UPDATE SET "stmt" = excluded."stmt";
                                DELETE FROM "t" WHERE "id" = i * 10 + 1;
                                COMMIT;
                            END LOOP;
                        END $$""")
        if table < 2:
            read_batches(t)                                # the consumer keeps up: rotation is not blocked
            conn.execute("UPDATE replicator.queue SET queue_switch_time = now() - interval '1 day'")
            assert t.maint()["q"][0] == "rotated"
    queue_id = t.queue_id("q")
    counts = [conn.execute(f'SELECT count(*) FROM replicator."event_{queue_id}_{n}"').fetchone()[0]
              for n in range(3)]
    assert min(counts) >= 3000, counts

    read_batches(t)
    with psycopg.connect(dsn, autocommit=True) as open_txn:
        open_txn.execute("BEGIN")
        open_txn.execute('INSERT INTO "t" VALUES (-100000, 1, 1)')
        conn.execute('INSERT INTO "t" VALUES (-100001, 1, 1)')
        # The tick closing this batch lists the open transaction as in progress.
        assert [[e.items for e in b] for b in read_batches(t)] == [[[[-100001, 1, 1]]]]
        open_txn.execute("COMMIT")
    t.tick("q", force=True)
    conn.execute(f'ANALYZE replicator."event_{queue_id}"')
    for n in range(3):
        conn.execute(f'ANALYZE replicator."event_{queue_id}_{n}"')

    batch_id = t.next_batch("q", "c")
    info = t.batch_info(batch_id)
    assert info.prev_snapshot.count(":") == 2 and info.prev_snapshot.split(":")[2] != ""
    query = t.batch_event_sql(batch_id)
    plan = conn.execute("EXPLAIN (FORMAT JSON) " + query).fetchone()[0][0]["Plan"]
    nodes = list(_plan_nodes(plan))
    kinds = {n["Node Type"] for n in nodes}
    assert "Seq Scan" not in kinds, json.dumps(plan, indent=1)
    index_nodes = [n for n in nodes if n["Node Type"] in ("Index Scan", "Bitmap Index Scan", "Index Only Scan")]
    assert index_nodes and all("ev_txid" in n.get("Index Cond", "") for n in index_nodes), json.dumps(plan, indent=1)
    # both parts of the lookup: the txid range and the previous tick's in-progress list
    conds = " ".join(n["Index Cond"] for n in index_nodes)
    assert "ev_txid >=" in conds and f"ev_txid = {info.prev_snapshot.split(':')[2]}" in conds, conds
    scanned = {n["Relation Name"] for n in nodes if "Relation Name" in n}
    assert scanned == {f"event_{queue_id}_{n}" for n in range(3)}

    events = [e for e in t.batch_events(batch_id)]
    assert [json.loads(e[5]) for e in events] == [[[-100000, 1, 1]]]
