"""The incremental views benchmark on a Delta warehouse (``--target delta:``), beside
the Spark warehouse's it replaces (``spark:``, by the views part of bin/bench_spark.py of the
--anchor commit, in a subprocess) in the same run. Run it through ``bin/bench-delta-views``.

A Delta warehouse holds ``bench`` (--view-rows rows, 1M by default; the schema
of bin/bench_spark.py) and a 1,000-row dimension ``dim``, written through
DeltaTarget as the consumer writes them. The views are bench_spark's: a GROUP BY
(``amount``: ~10 rows a group) and a two-table join. Batches change 1 % of
``bench`` (80 % updates, 10 % inserts, 10 % deletes) and 1 % of ``dim``, committed
through DeltaTarget (begin, upsert/delete, set_position, commit): the consumer's
refresh of the views, after the tables' commit, is recorded per view; after each
batch the same views are recomputed in full (``view refresh --full``), so that
both are measured as warm, as bench_spark measures them. The refreshes of the
first --view-warmup batches are not counted (they pay for compiling code paths).
Then --repeat more batches without full recomputes between them: the refreshes of
a consumer that runs on (a full recompute rewrites a view's table, whose key
index the next refresh builds again). Also measured: the tables' commit (the
batch's tables and position, before the views are refreshed) with and without
views reading them, and the Spark session's start.

The anchor: the same views on a ``spark:`` warehouse of the same rows, measured by the
anchor commit's own benchmark (``bench_spark.py --sizes "" --skip-copy --view-rows N``).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench_spark import ANCHOR, TABLE, change_batch, run_anchor_bench
from replicator.structure import Column, TableStructure
from replicator.targets.delta.storage import LocalStorage
from replicator.targets.delta.target import DeltaTarget
from replicator.targets.delta.views import DeltaViews, ReadWarehouse, Session
from replicator.targets.protocol import TargetTable

DIM = TargetTable(source_name="public.dim", table_id=2, mode="full", copy_snapshot=None,
                  structure=TableStructure(schema="public", name="dim", key=("k",), columns=(
                      Column("k", "integer", "integer", "N", True, 1), Column("name", "text", "text", "S", False, 2))))
VIEWS = {"GROUP BY": "SELECT amount, count(*) AS n, sum(score) AS total, min(score) AS lo, max(score) AS hi"
                     " FROM bench GROUP BY amount",
         "join": "SELECT b.id, b.score, d.name FROM bench b JOIN dim d ON d.k = b.k"}


def make_warehouse(path: Path, rows: int, spark: Any) -> DeltaTarget:
    """A Delta warehouse holding bench (rows) and dim (1,000 rows), copied through DeltaTarget."""
    target = DeltaTarget(str(path), session=lambda: spark)
    target.begin()
    target.create_table(TABLE)
    rng = np.random.default_rng(1)
    for start in range(0, rows, 100_000):
        ids = range(start, min(start + 100_000, rows))
        ks, scores = rng.integers(0, 1000, len(ids)), rng.random(len(ids))
        target.upsert(TABLE, "R", [(i, int(k), f"label-{i}", float(s), f"{i % 100000}.50",
                                    "2023-11-14T22:13:20+00:00") for i, k, s in zip(ids, ks, scores)])
    target.create_table(DIM)
    target.upsert(DIM, "R", [(k, f"name-{k}") for k in range(1000)])
    target.set_position("bench", "bench", 1)
    target.commit()
    return target


_committed: list[float] = []   # when each commit reached the views' refresh: its tables and position committed


def _timed_refresh(refresh: Any) -> Any:
    def timed(self: DeltaTarget, *, wait: bool) -> None:
        _committed.append(time.perf_counter())
        refresh(self, wait=wait)
    return timed


DeltaTarget._refresh_views = _timed_refresh(DeltaTarget._refresh_views)   # type: ignore[method-assign]


def apply(target: DeltaTarget, rows: int, rnd: random.Random, next_id: list[int], tick: int) -> float:
    """One batch: 1 % of bench, 1 % of dim; returns how long the commit of its tables and
    position took (the views' refresh follows)."""
    upserts, deletes = change_batch(rows, rows // 100, rnd, next_id)
    target.begin()
    target.upsert(target.tables()["public.bench"], "U", upserts)
    target.delete(target.tables()["public.bench"], deletes)
    target.upsert(target.tables()["public.dim"], "U", [(k, f"name-{k}-{tick}") for k in rnd.sample(range(1000), 10)])
    target.set_position("bench", "bench", tick)
    started = time.perf_counter()
    target.commit()
    return _committed[-1] - started


def bench_delta(args: argparse.Namespace, spark: Any, workdir: Path) -> dict[str, Any]:
    rows = args.view_rows
    path = workdir / "delta"
    started = time.perf_counter()
    target = make_warehouse(path, rows, spark)
    print(f"delta: {rows:,} rows copied in {time.perf_counter() - started:.1f}s", flush=True)
    rnd = random.Random(11)
    next_id = [rows]
    tick = 2
    # the tables' commit without views (the views' changes are not captured then)
    plain = []
    for _ in range(args.repeat):
        plain.append(apply(target, rows, rnd, next_id, tick))
        tick += 1
    target.close()
    views = DeltaViews(ReadWarehouse(LocalStorage(path)), Session(lambda: spark))
    names = {shape: f"v{i}" for i, shape in enumerate(VIEWS)}
    for shape, sql in VIEWS.items():
        views.create(names[shape], sql, "incremental")
    target = DeltaTarget(str(path), session=lambda: spark)
    warm: dict[str, int] = {}
    commits = []
    for n in range(args.view_warmup + args.repeat):
        if n == args.view_warmup:
            warm = {shape: views.refreshes(names[shape], 1)[0]["seq"] for shape in VIEWS}
        commit = apply(target, rows, rnd, next_id, tick)
        if n >= args.view_warmup:
            commits.append(commit)
        tick += 1
        for shape in VIEWS:
            views.refresh_now(names[shape], full=True)
    alternating = {shape: views.refreshes(names[shape], 1)[0]["seq"] for shape in VIEWS}
    for _ in range(args.repeat + 1):   # (the first builds the views' key indexes again)
        apply(target, rows, rnd, next_id, tick)
        tick += 1
    target.close()
    out: dict[str, Any] = {"rows": rows, "commit_without_views": statistics.median(plain),
                           "commit_with_views": statistics.median(commits)}
    print(f"delta: a batch's tables and position committed in {out['commit_without_views']:.3f}s without views, "
          f"{out['commit_with_views']:.3f}s with views reading them (medians)", flush=True)
    for shape in VIEWS:
        records = views.refreshes(names[shape], 100)
        log = [r for r in records if warm.get(shape, 0) < r["seq"] <= alternating[shape]]
        incremental = [r["seconds"] for r in log if r["kind"] == "incremental"]
        full = [r["seconds"] for r in log if r["kind"] == "full" and r["reason"] == "MANUAL"]
        steady = [r["seconds"] for r in records if r["seq"] > alternating[shape] + 1 and r["kind"] == "incremental"]
        out[shape] = {"incremental": statistics.median(incremental), "full": statistics.median(full),
                      "steady": statistics.median(steady), "incremental_all": incremental, "full_all": full,
                      "steady_all": steady,
                      "keys": statistics.median(r["keys"] for r in log if r["kind"] == "incremental"),
                      "view_rows": views.info(names[shape])["rows"]}
        print(f"delta: view {shape}: incremental {out[shape]['incremental']:.2f}s, full recompute "
              f"{out[shape]['full']:.2f}s ({out[shape]['full'] / out[shape]['incremental']:.1f}x), "
              f"{out[shape]['keys']:,.0f} keys, {out[shape]['view_rows']:,} view rows; without full recomputes "
              f"between: incremental {out[shape]['steady']:.2f}s", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_delta_views", description=__doc__.split("\n\n")[0])
    parser.add_argument("--view-rows", type=int, default=1_000_000, help="rows of bench (default 1M)")
    parser.add_argument("--repeat", type=int, default=3, help="measured batches (default 3)")
    parser.add_argument("--view-warmup", type=int, default=1, help="batches not measured (default 1)")
    parser.add_argument("--anchor", default=ANCHOR, help=f"the commit whose spark: warehouse's views are measured "
                                                         f"beside (default {ANCHOR}); 'none' skips them")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    from replicator.spark_session.session import get_session

    started = time.perf_counter()
    spark = get_session(None, {"spark.driver.memory": "6g", "spark.sql.shuffle.partitions": "4"},
                        app_name="bench-delta-views")
    figures: dict[str, Any] = {"spark_start": time.perf_counter() - started}
    print(f"Spark {spark.version} with Delta started in {figures['spark_start']:.1f}s", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="replicator-bench-delta-views-"))
    try:
        figures["delta"] = bench_delta(args, spark, workdir)
        if args.anchor != "none":
            print(f"anchor: the spark: warehouse's views, by the benchmark of {args.anchor}", flush=True)
            figures["spark"] = run_anchor_bench(args.anchor, workdir, [
                "--sizes", "", "--skip-copy", "--repeat", str(args.repeat), "--view-rows", str(args.view_rows),
                "--view-warmup", str(args.view_warmup)])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for shape in VIEWS:
        d = figures["delta"][shape]
        line = (f"view {shape}: delta incremental {d['incremental']:.2f}s / full {d['full']:.2f}s (incremental "
                f"without full recomputes between: {d['steady']:.2f}s)")
        if figures.get("spark"):
            s = figures["spark"]["views"][shape]
            line += f"; spark incremental {s['incremental']:.2f}s / full {s['full']:.2f}s"
        print(line)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
