"""The policy `auto`: whether a view's refresh goes full instead of incremental, decided per batch
(measured: see docs/benchmarks.md).

Before any key is computed, by the changed base rows against the tables' size (the span of their
rowids), or, with history, the cost they predict. Once a view has a refresh history, a change
whose keys would take longer to recompute (at the view's recent seconds per key) than its last
full refresh is done in full; before that, one that touches more than AUTO_FULL_SHARE of the
rows."""

from __future__ import annotations

import sqlite3
import time

from replicator.targets.sqlite.views import names
from replicator.targets.sqlite.views.names import REFRESHES
from replicator.targets.sqlite.views.sql import quote

AUTO_FULL_SHARE = 0.2
AUTO_MIN_KEYS = 100            # incremental refreshes of fewer keys say little about the cost per key
AUTO_SAMPLES = 5               # incremental refreshes auto takes its cost per key from (the latest)
# auto goes full once the keys' predicted cost passes this share of the last full refresh:
# the prediction (a median cost per key) and single refreshes on a busy machine are both off
# by tens of percent, and a full refresh is never more than a full refresh.
AUTO_MARGIN = 0.6
# the refresh records auto learns from (see learned_costs), which the refresh log keeps however old
LATEST_FULL = (f"SELECT seq, seconds FROM main.{REFRESHES} WHERE view = :view AND kind = 'full'"
               " ORDER BY seq DESC LIMIT 1")
COST_SAMPLES = (f"SELECT seq, seconds, keys FROM main.{REFRESHES} WHERE view = :view AND kind = 'incremental'"
                f" AND keys >= {AUTO_MIN_KEYS} ORDER BY seq DESC LIMIT {AUTO_SAMPLES}")


def learned_costs(db: sqlite3.Connection, view: str) -> tuple[float, float] | None:
    """(median seconds per key of its latest incremental refreshes of AUTO_MIN_KEYS keys
    or more, seconds of its latest full refresh), from the view's refresh log (however
    many refreshes ago: catalog.record keeps them); None while there is too little of it."""
    full = db.execute(LATEST_FULL, {"view": view}).fetchone()
    per_key: list[float] = [seconds / keys for _, seconds, keys in db.execute(COST_SAMPLES, {"view": view})]
    if full is None or len(per_key) < 2:
        return None
    latest_full: float = full[1]
    return sorted(per_key)[len(per_key) // 2], latest_full


def says_full(costs: tuple[float, float] | None, keys: int, touched: int, rows: int,
              what: str, started: float | None = None) -> str | None:
    """Why auto refreshes in full: the keys' predicted cost (from the view's refresh
    log) beyond a full refresh's, or, without that history, the rows they touch past
    AUTO_FULL_SHARE of the rows. Once the keys are found (`started`: when the refresh
    began), what finding them took is spent either way: only the rest is weighed."""
    if costs is not None:
        spent = time.perf_counter() - started if started is not None else 0.0
        if keys * costs[0] - spent > AUTO_MARGIN * costs[1]:
            return (f"COST: about {keys} keys at {costs[0] * 1e6:.0f} µs each, a full refresh "
                    f"takes {costs[1] * 1000:.0f} ms")
        return None
    if touched > AUTO_FULL_SHARE * max(rows, 1):
        return f"THRESHOLD: {touched} of {rows} {what}"
    return None


def changed_rows(db: sqlite3.Connection, table: str) -> int:
    """Rows in a table's delta: rows are only added to it in a transaction, so the span of
    their rowids (count(*) reads every page: a large change spills them to a file)."""
    return _rowid_span(db, f"temp.{quote(names.delta_table(table))}")


def table_rows(db: sqlite3.Connection, table: str) -> int:
    """Rows of a table, roughly and cheaply: the span of its rowids."""
    return _rowid_span(db, f"main.{quote(table)}")


def _rowid_span(db: sqlite3.Connection, name: str) -> int:
    # two subqueries: min() and max() in one SELECT scan the table, alone each is one seek
    low, high = db.execute(f"SELECT (SELECT min(rowid) FROM {name}), (SELECT max(rowid) FROM {name})").fetchone()
    return 0 if low is None else int(high - low + 1)
