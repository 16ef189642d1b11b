"""Incremental views against their definition: a hypothesis state machine
applies random batches of changes through SqliteTarget's own API (begin,
upsert, delete, truncate, commit; rollbacks; reopening the file as a
restarted consumer would) and, after every batch, compares each view with its
defining query run from scratch, as multisets.

The batches move rows between groups, delete the last row of a group, use
NULL group keys, NULL join keys and NULL key columns, and change both (or
all three) sides of a join in one batch. Aggregates folded from state (count,
sum, avg, total, min, max of INTEGER columns) also see groups emptied and
refilled in one batch, the row holding a group's min or max deleted or moved,
NULL sums, and floats, text and sums past 2**53 in an INTEGER column (which
the fold must leave to a recomputation of the group), and values shifted
between two rows of a group, which keep its count and sum but not the sum of
their absolute values that says whether avg and total are exact.
"""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from replicator.targets.sqlite.views import auto as views_auto
from views_helpers import open_target, table, view_differences

ORDERS = table("orders", [("id", "int", True), ("cid", "int", False), ("amount", "int", False),
                          ("status", "text", False)], ["id"], 1)
CUSTOMERS = table("customers", [("id", "int", True), ("region", "text", False), ("name", "text", False)], ["id"], 2)
REGIONS = table("regions", [("name", "text", True), ("zone", "text", False)], ["name"], 3)
ITEMS = table("items", [("sku", "text", True), ("variant", "text", False), ("price", "float", False)],
              ["sku", "variant"], 4, schema="shop")
LEDGER = table("ledger", [("id", "int", True), ("k", "int", False), ("v", "int", False)], ["id"], 5)

VIEWS: dict[str, str] = {
    # single table, GROUP BY with every kind of aggregate
    "by_customer": "SELECT cid, count(*) AS n, sum(amount) AS total, min(amount) AS lo, max(amount) AS hi,"
                   " avg(amount) AS mean, count(DISTINCT status) AS statuses, total(amount) AS t"
                   " FROM orders GROUP BY cid",
    # WHERE, two GROUP BY columns, HAVING
    "busy": "SELECT cid, status, count(*) AS n FROM orders WHERE amount > 10 GROUP BY cid, status"
            " HAVING count(*) > 1",
    # filter and projection
    "positive": "SELECT id, cid, amount * 2 AS double FROM orders WHERE status IS NOT 'void'",
    "everything": "SELECT * FROM orders",
    # DISTINCT
    "pairs": "SELECT DISTINCT status, cid FROM orders",
    # two-table join (rows), NULL join keys
    "order_customer": "SELECT o.id, o.amount, c.name, c.region FROM orders o JOIN customers c ON o.cid = c.id",
    # two-table join, GROUP BY a column of the other table (NULL groups)
    "by_region": "SELECT c.region, count(*) AS n, sum(o.amount) AS total FROM orders AS o"
                 " INNER JOIN customers AS c ON c.id = o.cid GROUP BY c.region",
    # three tables, aggregate and rows, comma join
    "by_zone": "SELECT r.zone, count(*) AS n, sum(o.amount) AS total, max(c.name) AS top FROM orders o"
               " JOIN customers c ON o.cid = c.id JOIN regions r ON r.name = c.region GROUP BY r.zone",
    "located": "SELECT o.id, c.id AS customer, r.name AS region FROM orders o, customers c, regions r"
               " WHERE o.cid = c.id AND c.region = r.name AND o.amount >= 0",
    # rows one to one with the second table's (stored by its rowid), WHERE over both tables
    "customer_orders": "SELECT c.name, o.id, o.amount FROM customers c JOIN orders o ON o.cid = c.id"
                       " WHERE o.amount > c.id",
    # self-join
    "siblings": "SELECT a.id, b.id AS other FROM orders a JOIN orders b ON a.cid = b.cid AND a.id < b.id",
    # keys that are expressions, GROUP BY an alias and an ordinal
    "buckets": "SELECT amount % 3 AS bucket, count(*) AS n FROM orders GROUP BY amount % 3",
    "by_status": "SELECT coalesce(status, '?') AS s, count(*) AS n FROM orders GROUP BY s",
    "ordinal": "SELECT cid + 1, sum(amount) FROM orders GROUP BY 1",
    # a table of another schema, a key with a NULL-able column, float values
    "variants": "SELECT variant, sum(price) AS total, count(*) AS n FROM shop__items GROUP BY variant",
    "pricey": "SELECT sku, variant, price FROM shop__items WHERE price > 10",
    # folded from state: every foldable aggregate; WHERE and an expression key; NULL sums
    "folded": "SELECT cid, count(*) AS n, count(amount) AS c, sum(amount) AS total, avg(amount) AS mean,"
              " total(amount) AS t, min(amount) AS lo, max(amount) AS hi, min(id) AS first FROM orders GROUP BY cid",
    "folded_where": "SELECT status, cid % 2 AS parity, min(amount) AS lo, max(o.id) AS top, count(*)"
                    " FROM orders AS o WHERE amount > 3 GROUP BY status, cid % 2",
    # keys that are all expressions (no index reaches a group's rows): a lost min or max is recomputed
    "folded_expression": "SELECT cid % 3 AS k, min(amount) AS lo, max(amount) AS hi, count(*) FROM orders"
                         " GROUP BY cid % 3",
    # a foldable aggregate next to one that is not (max of a TEXT column): recomputed by key
    "mixed": "SELECT cid, sum(amount) AS total, max(status) AS top FROM orders GROUP BY cid",
    # an INTEGER column holding floats, text and large values: those groups are recomputed
    "ledger_sums": "SELECT k, count(*) AS n, sum(v) AS s, avg(v) AS mean, total(v) AS t, min(v) AS lo,"
                   " max(v) AS hi, count(v) AS c FROM ledger GROUP BY k",
    # avg and total alone: no min/max whose change would mark a group changed
    "ledger_means": "SELECT k, avg(v), total(v) FROM ledger GROUP BY k",
    # aggregates with FILTER clauses (recomputed by key), also in HAVING
    "filtered": "SELECT cid, count(*) FILTER (WHERE amount > 10) AS big, sum(amount) FILTER (WHERE status = 'new')"
                " AS fresh, count(*) AS n FROM orders GROUP BY cid HAVING count(*) FILTER (WHERE status IS NULL) < 3",
}
FOLDED = {"folded", "folded_where", "folded_expression", "ledger_sums", "ledger_means", "folded_auto", "buckets",
          "by_status", "ordinal"}
AUTO_VIEWS = {"by_customer_auto": VIEWS["by_customer"], "order_customer_auto": VIEWS["order_customer"],
              "folded_auto": VIEWS["folded"]}

ids = st.integers(1, 12)
cids = st.one_of(st.none(), st.integers(0, 4))
amounts = st.one_of(st.none(), st.integers(-5, 40))
statuses = st.sampled_from([None, "new", "old", "void"])
regions = st.sampled_from([None, "eu", "us", "apac", "mars"])
zones = st.sampled_from([None, "z1", "z2"])
skus = st.sampled_from(["a", "b", "c"])
variants = st.sampled_from([None, "x", "y"])
prices = st.one_of(st.none(), st.floats(0, 30, allow_nan=False).map(lambda f: round(f, 2)))
ledger_values = st.one_of(st.none(), st.integers(-3, 30), st.integers(-3, 3).map(lambda i: 2 ** 51 + i),
                          st.just(-(2 ** 51)), st.integers(-3, 3).map(lambda i: 2 ** 53 + i),
                          st.integers(-3, 3).map(lambda i: -(2 ** 53) + i), st.just(2.5), st.just("abc"))

operations = st.one_of(
    st.tuples(st.just("upsert"), st.just(ORDERS), st.tuples(ids, cids, amounts, statuses)),
    st.tuples(st.just("upsert"), st.just(ORDERS), st.tuples(ids, cids, amounts, statuses)),
    st.tuples(st.just("delete"), st.just(ORDERS), st.tuples(ids)),
    st.tuples(st.just("upsert"), st.just(CUSTOMERS), st.tuples(st.integers(0, 4), regions,
                                                               st.sampled_from(["ann", "bob", None]))),
    st.tuples(st.just("delete"), st.just(CUSTOMERS), st.tuples(st.integers(0, 4))),
    st.tuples(st.just("upsert"), st.just(REGIONS), st.tuples(st.sampled_from(["eu", "us", "apac", "mars"]), zones)),
    st.tuples(st.just("delete"), st.just(REGIONS), st.tuples(st.sampled_from(["eu", "us", "apac", "mars"]))),
    st.tuples(st.just("upsert"), st.just(ITEMS), st.tuples(skus, variants, prices)),
    st.tuples(st.just("delete"), st.just(ITEMS), st.tuples(skus, variants)),
    st.tuples(st.just("upsert"), st.just(LEDGER), st.tuples(st.integers(1, 8), st.one_of(st.none(), st.integers(0, 2)),
                                                            ledger_values)),
    st.tuples(st.just("delete"), st.just(LEDGER), st.tuples(st.integers(1, 8))),
)
batches = st.lists(operations, min_size=1, max_size=10)


class ViewMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.TemporaryDirectory()
        self.path = Path(self.dir.name) / "replica.db"
        self.target = open_target(self.path)

    @initialize(seed=st.lists(operations, max_size=25), share=st.sampled_from([0.2, 0.5, 1.0]))
    def create(self, seed: list[Any], share: float) -> None:
        views_auto.AUTO_FULL_SHARE = share
        t = self.target
        t.begin()
        for tbl in (ORDERS, CUSTOMERS, REGIONS, ITEMS, LEDGER):
            t.create_table(tbl)
        t.commit()
        self._apply(seed)
        for name, sql in VIEWS.items():
            info = t.views.create(name, sql, "incremental")
            assert info["maintenance"] == "incremental", info
        for name, sql in AUTO_VIEWS.items():
            t.views.create(name, sql, "auto")

    def _apply(self, ops: list[Any], *, commit: bool = True) -> None:
        t = self.target
        t.begin()
        try:
            for kind, tbl, values in ops:
                if kind == "upsert":
                    t.upsert(tbl, "U", [values])
                else:
                    t.delete(tbl, [values])
        except BaseException:
            t.rollback()
            raise
        if commit:
            t.commit()
        else:
            t.rollback()

    @rule(ops=batches)
    def batch(self, ops: list[Any]) -> None:
        self._apply(ops)

    @rule(ops=batches)
    def rolled_back_batch(self, ops: list[Any]) -> None:
        self._apply(ops, commit=False)

    @rule(cid=cids, refill=st.lists(st.tuples(ids, amounts, statuses), max_size=3), ops=batches)
    def empty_and_refill_a_group(self, cid: Any, refill: list[Any], ops: list[Any]) -> None:
        """Every order of a group deleted, then (maybe) new ones in it, in one batch."""
        t = self.target
        t.begin()
        t.delete(ORDERS, t.db.execute("SELECT id FROM orders WHERE cid IS ?", (cid,)).fetchall())
        t.upsert(ORDERS, "U", [(i, cid, amount, status) for i, amount, status in refill])
        for kind, tbl, values in ops:
            (t.upsert(tbl, "U", [values]) if kind == "upsert" else t.delete(tbl, [values]))
        t.commit()

    @rule(which=st.sampled_from(["min", "max"]), move=st.booleans(), amount=amounts)
    def remove_an_extreme(self, which: str, move: bool, amount: Any) -> None:
        """The order holding some group's min or max amount deleted, or moved to another group
        with a new amount."""
        t = self.target
        row = t.db.execute(f"SELECT id, cid, status FROM orders WHERE amount = (SELECT {which}(amount) FROM orders)"
                           " ORDER BY id LIMIT 1").fetchone()
        if row is None:
            return
        t.begin()
        if move:
            t.upsert(ORDERS, "U", [(row[0], (row[1] or 0) + 1, amount, row[2])])
        else:
            t.delete(ORDERS, [(row[0],)])
        t.commit()

    @rule(pair=st.lists(st.integers(1, 8), min_size=2, max_size=2, unique=True),
          k=st.one_of(st.none(), st.integers(0, 2)), values=st.tuples(st.integers(-3, 30), st.integers(-3, 30)),
          shift=st.sampled_from([1, 2 ** 52 + 1, 2 ** 53 + 1, 2 ** 53 + 2, -(2 ** 53 + 1), 2 ** 54 + 3]),
          back=st.booleans())
    def shift_within_a_group(self, pair: list[int], k: Any, values: tuple[int, int], shift: int,
                             back: bool) -> None:
        """Two ledger rows of group k, then, in a batch of its own, shift added to one and
        taken from the other: count and sum stay, the values (and the sum of their
        absolute values, which says whether doubles add them exactly) do not. With back,
        a third batch shifts them back: the group, recomputed after the shift, is exact
        again though its count and sum never changed."""
        (a, b), (va, vb) = pair, values
        for s in [0, shift, 0] if back else [0, shift]:
            self._apply([("upsert", LEDGER, (a, k, va + s)), ("upsert", LEDGER, (b, k, vb - s))])

    @rule(which=st.sampled_from([ORDERS, CUSTOMERS, REGIONS, ITEMS, LEDGER]), ops=batches)
    def truncate_then_batch(self, which: Any, ops: list[Any]) -> None:
        t = self.target
        t.begin()
        t.truncate(which)
        for kind, tbl, values in ops:
            (t.upsert(tbl, "U", [values]) if kind == "upsert" else t.delete(tbl, [values]))
        t.commit()

    @rule()
    def reopen(self) -> None:
        """A consumer restart: a new connection, no TEMP objects."""
        self.target.close()
        self.target = open_target(self.path)

    @invariant()
    def views_match_their_queries(self) -> None:
        if not self.target.views.plans and not self.target.views.list():
            return
        db = self.target.db
        problems = [p for name, sql in {**VIEWS, **AUTO_VIEWS}.items()
                    if (p := view_differences(db, name, sql)) is not None]
        assert not problems, "\n".join(problems)
        stale = [v for v in self.target.views.list() if v["status"] != "ok"]
        assert not stale, stale

    def teardown(self) -> None:
        views_auto.AUTO_FULL_SHARE = 0.2
        self.target.close()
        self.dir.cleanup()


ViewMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.filter_too_much])
TestViewMachine = ViewMachine.TestCase


def test_incremental_refreshes_happen() -> None:
    """The machine above would pass with full refreshes only: make sure the
    incremental path is what runs on small changes."""
    with tempfile.TemporaryDirectory() as d:
        t = open_target(Path(d) / "r.db")
        t.begin()
        for tbl in (ORDERS, CUSTOMERS):
            t.create_table(tbl)
        t.upsert(ORDERS, "R", [(i, i % 50, i, "new") for i in range(1000)])
        t.upsert(CUSTOMERS, "R", [(i, f"r{i % 20}", f"c{i}") for i in range(50)])
        t.commit()
        for name in ("by_customer", "order_customer", "by_region", "pairs", "positive", "folded"):
            t.views.create(name, VIEWS[name], "auto")
        t.begin()
        t.upsert(ORDERS, "U", [(1, 7, 5, "old")])
        t.upsert(CUSTOMERS, "U", [(3, "us", "x")])
        t.commit()
        kinds = {v["view"]: (v["last_refresh"]["kind"], v["last_refresh"]["keys"]) for v in t.views.list()}
        # order_customer is stored by the orders' rowid: its keys are the rows it recomputed
        # (order 1 and the 20 orders of customer 3)
        assert kinds == {"by_customer": ("incremental", 2), "order_customer": ("incremental", 21),
                         "by_region": ("incremental", 4), "pairs": ("incremental", 2),
                         "positive": ("incremental", 1), "folded": ("incremental", 2)}, kinds
        for name in kinds:
            assert view_differences(t.db, name, VIEWS[name]) is None
        t.close()


def test_every_view_is_incremental() -> None:
    with tempfile.TemporaryDirectory() as d:
        t = open_target(Path(d) / "r.db")
        t.begin()
        for tbl in (ORDERS, CUSTOMERS, REGIONS, ITEMS, LEDGER):
            t.create_table(tbl)
        t.commit()
        for name, sql in itertools.chain(VIEWS.items()):
            explained = t.views.explain(sql)
            assert explained["maintenance"] == "incremental", (name, explained)
            folded = any("folded from state" in n for n in explained["notes"])
            assert folded == (name in FOLDED), (name, explained["notes"])
        t.close()
