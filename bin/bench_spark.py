"""The Spark benchmark: batch apply, compaction, reads and the initial copy of
the Spark mirror target. Run it through ``bin/bench-spark``.

1. Apply. For each table size (1M and 10M rows by default) a warehouse table
   is made by writing its base Parquet directly with pyarrow (not through the
   queue: copying 10M rows through PostgreSQL would take most of the run and
   measure the copy, which 4. measures). Then batches of 1k and 10k changes
   (80% updates of random existing keys, 10% inserts, 10% deletes) are applied
   through the SparkTarget as the consumer drives it: begin, upsert/delete,
   set_position, commit (change log written, fsynced, manifest replaced).
   Side by side: the copy-on-write alternative, rewriting the table with
   pyarrow for one 10k batch (read, anti-join the batch's keys, append, write).
2. Compaction of each table after the apply batches (Spark, local mode).
3. Read of the current state (Spark: count and aggregates over every column),
   merge-on-read with the logs and again after compaction.
4. Initial copy: a PostgreSQL table of --copy-rows rows copied by the real
   consumer into a new warehouse (snapshot, binary COPY, decode, Arrow, Parquet).
5. Incremental views (--view-rows, 0 to skip): on the 1M-row table and a
   1,000-row dimension, batches changing 1 % of both refreshed incrementally
   in their commit, against a full recompute of the same view: a GROUP BY
   view (100,000 groups of about 10 rows) and a two-table join view. Each
   batch's incremental refresh is followed by a full recompute of each view,
   so that both are measured as warm; the refreshes of the first
   --view-warmup batches are not counted (they pay for compiling code paths).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table

from replicator.structure import Column, TableStructure
from replicator.targets.protocol import TargetTable
from replicator.targets.spark.target import BASE_FILE_ROWS, SparkTarget
from replicator.targets.spark.warehouse import Warehouse, entry_schema

console = Console()
if not console.is_terminal:
    console.width = 120

STRUCTURE = TableStructure(schema="public", name="bench", key=("id",), columns=(
    Column("id", "bigint", "bigint", "N", True, 1),
    Column("k", "integer", "integer", "N", False, 2),
    Column("label", "text", "text", "S", False, 3),
    Column("score", "double precision", "double precision", "N", False, 4),
    Column("amount", "numeric(12,2)", "numeric", "N", False, 5),
    Column("updated_at", "timestamp with time zone", "timestamp with time zone", "D", False, 6),
))
TABLE = TargetTable(source_name="public.bench", table_id=1, mode="full", structure=STRUCTURE, copy_snapshot=None)
DIM = TargetTable(source_name="public.dim", table_id=2, mode="full", copy_snapshot=None,
                  structure=TableStructure(schema="public", name="dim", key=("k",), columns=(
                      Column("k", "integer", "integer", "N", True, 1), Column("name", "text", "text", "S", False, 2))))
VIEWS = {"GROUP BY": "SELECT amount, count(*) AS n, sum(score) AS total, min(score) AS lo, max(score) AS hi"
                     " FROM bench GROUP BY amount",
         "join": "SELECT b.id, b.score, d.name FROM bench b JOIN dim d ON d.k = b.k"}


def make_warehouse(path: Path, rows: int) -> None:
    """A warehouse holding public.bench with `rows` rows, base written directly with pyarrow."""
    path.mkdir(parents=True)
    target = SparkTarget(path, compact_after_logs=0)
    target.begin()
    target.create_table(TABLE)
    target.set_position("bench", "bench", 1)
    target.commit()
    target.close()
    entry = target.manifest["tables"]["public.bench"]
    schema = entry_schema(entry)
    files: list[str] = []
    rng = np.random.default_rng(1)
    for start in range(0, rows, BASE_FILE_ROWS):
        n = min(BASE_FILE_ROWS, rows - start)
        ids = np.arange(start, start + n, dtype=np.int64)
        data = pa.Table.from_arrays([
            pa.array(ids),
            pa.array(rng.integers(0, 1000, n, dtype=np.int32)),
            pc.binary_join_element_wise("label-", pa.array(ids).cast(pa.string()), ""),
            pa.array(rng.random(n)),
            pa.array((ids % 100000).astype(str).astype(object) + ".50").cast(schema.field("c5").type),
            pa.array(np.full(n, 1_700_000_000_000_000, dtype=np.int64)).cast(pa.timestamp("us", "UTC")),
        ], schema=schema)
        relative = f"{entry['generation']}/base-{len(files):05d}.parquet"
        (path / relative).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(data, path / relative, row_group_size=131072)
        files.append(relative)
    warehouse = Warehouse(path)
    with warehouse.lock():
        manifest = warehouse.read()
        manifest["tables"]["public.bench"]["base"] = files
        manifest["tables"]["public.bench"]["base_rows"] = rows
        warehouse.write(manifest)


Row = tuple[Any, ...]


def change_batch(rows: int, size: int, rnd: random.Random, next_id: list[int]) -> tuple[list[Row], list[Row]]:
    upserts: list[Row] = []
    deletes: list[Row] = []
    for _ in range(size):
        r = rnd.random()
        if r < 0.8:
            i = rnd.randrange(rows)
        elif r < 0.9:
            i = next_id[0]
            next_id[0] += 1
        else:
            deletes.append((rnd.randrange(rows),))
            continue
        upserts.append((i, rnd.randrange(1000), f"label-{i}-{rnd.randrange(10**6)}", rnd.random(),
                        f"{rnd.randrange(10**6)}.25", "2025-01-02T03:04:05.123456+00:00"))
    return upserts, deletes


def apply_batch(target: SparkTarget, upserts: list[Row], deletes: list[Row], tick: int) -> float:
    started = time.perf_counter()
    target.begin()
    table = target.tables()["public.bench"]
    target.upsert(table, "U", upserts)
    target.delete(table, deletes)
    target.set_position("bench", "bench", tick)
    target.commit()
    return time.perf_counter() - started


def rewrite_table(path: Path, upserts: list[Row], deletes: list[Row]) -> float:
    """Copy-on-write: the whole table read and written again for one batch (pyarrow)."""
    from replicator.targets.spark.warehouse import arrow_table
    entry = Warehouse(path).read()["tables"]["public.bench"]
    started = time.perf_counter()
    data = pq.read_table([str(path / f) for f in entry["base"]])
    keys = pa.array([u[0] for u in upserts] + [d[0] for d in deletes], pa.int64())
    kept = data.filter(pc.invert(pc.is_in(data.column("c1"), value_set=keys)))
    out = pa.concat_tables([kept, arrow_table(STRUCTURE, upserts, decimals=True)])
    target = path / "rewrite.parquet"
    pq.write_table(out, target, row_group_size=131072)
    seconds = time.perf_counter() - started
    target.unlink()
    return seconds


def read_state(spark: Any, path: Path) -> tuple[float, int]:
    from pyspark.sql import functions as F

    from replicator.targets.spark.reader import read_table
    started = time.perf_counter()
    row = read_table(spark, path, "bench").agg(
        F.count("*").alias("n"), F.sum("k"), F.max(F.length("label")), F.sum("score"),
        F.max("amount"), F.max("updated_at")).collect()[0]
    return time.perf_counter() - started, row["n"]


def spark_log_write(spark: Any, workdir: Path, repeat: int, name: str) -> float:
    """The alternative to pyarrow for a batch: the same 10k-change log written by a Spark job
    (into workdir/NAME-<i>: the warm-up and the measured run write apart)."""
    from pyspark.sql import types as T

    from replicator.targets.spark.reader import spark_type
    from replicator.targets.spark.warehouse import arrow_table
    rnd = random.Random(7)
    times = []
    for i in range(repeat):
        upserts, _ = change_batch(1_000_000, 10000, rnd, [1_000_000])
        data = arrow_table(STRUCTURE, upserts, decimals=True, seq=i + 1)
        schema = T.StructType([T.StructField(f.name, spark_type(f.type), True) for f in data.schema])
        started = time.perf_counter()
        spark.createDataFrame(data, schema=schema).coalesce(1).write.parquet(
            str(workdir / f"{name}-{i}"))
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def bench_table(args: argparse.Namespace, spark: Any, workdir: Path, rows: int, figures: dict[str, Any]) -> None:
    path = workdir / f"wh-{rows}"
    started = time.perf_counter()
    make_warehouse(path, rows)
    console.print(f"[bold]{rows:,} rows[/]: base written with pyarrow in {time.perf_counter() - started:.1f}s")
    target = SparkTarget(path, compact_after_logs=0)
    rnd = random.Random(rows)
    next_id = [rows]
    out: dict[str, Any] = {"rows": rows}
    tick = 2
    for size in (1000, 10000):
        times = []
        for _ in range(args.repeat):
            upserts, deletes = change_batch(rows, size, rnd, next_id)
            times.append(apply_batch(target, upserts, deletes, tick))
            tick += 1
        out[f"apply_{size}"] = statistics.median(times)
        console.print(f"  apply {size:,} changes: median {out[f'apply_{size}']:.3f}s of {args.repeat}")
    upserts, deletes = change_batch(rows, 10000, rnd, next_id)
    out["rewrite_10000"] = rewrite_table(path, upserts, deletes)
    console.print(f"  copy-on-write of one 10k batch (pyarrow): {out['rewrite_10000']:.2f}s")
    target.close()
    logs = len(Warehouse(path).read()["tables"]["public.bench"]["logs"])
    read_state(spark, path)   # warm-up: JIT, file listing caches
    out["read_with_logs"], count = read_state(spark, path)
    console.print(f"  read current state ({logs} log files): {out['read_with_logs']:.2f}s ({count:,} rows)")
    from replicator.targets.spark.compaction import compact
    started = time.perf_counter()
    compact(spark, path)
    out["compact"] = time.perf_counter() - started
    console.print(f"  compaction of {logs} log files: {out['compact']:.1f}s")
    out["read_compacted"], count2 = read_state(spark, path)
    assert count2 == count, (count, count2)
    console.print(f"  read current state (compacted): {out['read_compacted']:.2f}s")
    out["logs"] = logs
    figures.setdefault("tables", []).append(out)
    shutil.rmtree(path, ignore_errors=True)


def bench_copy(args: argparse.Namespace, workdir: Path, figures: dict[str, Any]) -> None:
    from pgserver import PgServer
    from replicator.consumer import Consumer
    from replicator.source import Source
    from replicator.source.install import install

    with PgServer() as server:
        dsn = server.dsn
        with psycopg.connect(dsn, autocommit=True) as conn:
            install(conn)
            conn.execute("CREATE TABLE bench (id bigint PRIMARY KEY, k int, label text, score float8,"
                         " amount numeric(12,2), updated_at timestamptz)")
            conn.execute("INSERT INTO bench SELECT g, g %% 1000, 'label-' || g, random(), (g %% 100000) + 0.5,"
                         " now() FROM generate_series(1, %s) g", (args.copy_rows,))
            conn.execute("ANALYZE bench")
            with Source(conn) as source:
                source.create_queue("bench")
                source.add_table("bench", "public.bench")
        target = SparkTarget(workdir / "copy", compact_after_logs=0)
        consumer = Consumer(dsn, "bench", target)
        started = time.perf_counter()
        consumer.connect()
        consumer.sync_tables()
        seconds = time.perf_counter() - started
        figures["copy"] = {"rows": args.copy_rows, "seconds": seconds, "rows_per_s": args.copy_rows / seconds}
        console.print(f"[bold]initial copy[/]: {args.copy_rows:,} rows in {seconds:.1f}s = "
                      f"{args.copy_rows / seconds:,.0f} rows/s")
        # End to end: one batch of 10k row changes through the queue (fetch, decode, apply, commit).
        times = []
        with psycopg.connect(dsn, autocommit=True) as conn:
            for i in range(args.repeat):
                with conn.transaction():
                    conn.execute("UPDATE bench SET k = k + 1, updated_at = now() WHERE id %% 125 = %s", (i,))
                    conn.execute("INSERT INTO bench SELECT g, 0, 'new', 0, 0, now()"
                                 " FROM generate_series(%s::bigint, %s::bigint) g",
                                 (args.copy_rows + 1 + i * 1000, args.copy_rows + 1000 + i * 1000))
                    conn.execute("DELETE FROM bench WHERE id %% 1000 = %s AND id <= %s", (500 + i, args.copy_rows))
                assert consumer.source is not None   # connected above
                consumer.source.tick("bench", force=True)
                stats = consumer.step()
                assert stats is not None
                times.append((stats.seconds, stats.rows))
        figures["batch_end_to_end"] = {"seconds": statistics.median(t for t, _ in times),
                                       "rows": statistics.median(r for _, r in times)}
        console.print(f"[bold]end to end[/]: a batch of {figures['batch_end_to_end']['rows']:,.0f} row changes "
                      f"on the {args.copy_rows:,}-row table applied in {figures['batch_end_to_end']['seconds']:.3f}s"
                      f" (median of {args.repeat}: fetch, decode, change log, manifest)")
        consumer.close()
        target.close()


def bench_views(args: argparse.Namespace, spark: Any, workdir: Path, figures: dict[str, Any]) -> None:
    from replicator.targets.spark.views import SparkViews

    rows = args.view_rows
    path = workdir / "views"
    make_warehouse(path, rows)
    target = SparkTarget(path, spark=spark, compact_after_logs=0)
    target.begin()
    target.create_table(DIM)
    target.upsert(DIM, "R", [(k, f"name-{k}") for k in range(1000)])
    target.commit()
    views = SparkViews(target.warehouse, lambda: spark)
    names = {shape: f"v{i}" for i, shape in enumerate(VIEWS)}
    for shape, sql in VIEWS.items():
        views.create(names[shape], sql, "incremental")
    rnd = random.Random(11)
    next_id = [rows]
    tick = 2
    warm: dict[str, int] = {}
    for n in range(args.view_warmup + args.repeat):   # each batch: 1 % of the table, 1 % of the dimension
        if n == args.view_warmup:
            # the first refreshes of a process compile code paths (JIT, Spark's codegen):
            # they are left out
            warm = {shape: views.refreshes(names[shape], 1)[0]["seq"] for shape in VIEWS}
        upserts, deletes = change_batch(rows, rows // 100, rnd, next_id)
        target.begin()
        target.upsert(target.tables()["public.bench"], "U", upserts)
        target.delete(target.tables()["public.bench"], deletes)
        target.upsert(target.tables()["public.dim"], "U",
                      [(k, f"name-{k}-{tick}") for k in rnd.sample(range(1000), 10)])
        target.set_position("bench", "bench", tick)
        target.commit()
        tick += 1
        # the full recompute of the same state, after each batch rather than after all
        # of them: both kinds are measured as warm (the JVM keeps getting faster over
        # the first refreshes of a process)
        for shape in VIEWS:
            views.refresh_now(names[shape], full=True)
    target.close()
    out = {}
    for shape in VIEWS:
        log = [r for r in views.refreshes(names[shape], 100) if r["seq"] > warm.get(shape, 0)]
        incremental = [r["seconds"] for r in log if r["kind"] == "incremental"]
        full = [r["seconds"] for r in log if r["kind"] == "full" and r["reason"] == "MANUAL"]
        out[shape] = {"incremental": statistics.median(incremental), "full": statistics.median(full),
                      "keys": statistics.median(r["keys"] for r in log if r["kind"] == "incremental"),
                      "view_rows": views.info(names[shape])["rows"]}
        console.print(f"  view {shape}: incremental {out[shape]['incremental']:.2f}s, full recompute "
                      f"{out[shape]['full']:.2f}s ({out[shape]['full'] / out[shape]['incremental']:.1f}x), "
                      f"{out[shape]['keys']:,.0f} keys, {out[shape]['view_rows']:,} view rows")
    figures["views"] = {"rows": rows, **out}
    shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-spark", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000000,10000000", help="table sizes in rows (default 1M,10M)")
    parser.add_argument("--repeat", type=int, default=5, help="batches of each size, the median is reported")
    parser.add_argument("--copy-rows", type=int, default=1_000_000, help="rows of the initial copy (default 1M)")
    parser.add_argument("--skip-copy", action="store_true")
    parser.add_argument("--view-rows", type=int, default=1_000_000,
                        help="rows of the base table of the views benchmark (default 1M; 0 skips it)")
    parser.add_argument("--view-warmup", type=int, default=1,
                        help="batches refreshed before the views benchmark measures (default 1)")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    figures: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                               "pyarrow": pa.__version__}
    workdir = Path(tempfile.mkdtemp(prefix="replicator-bench-spark-"))
    try:
        from replicator.targets.spark.session import get_session
        started = time.perf_counter()
        spark = get_session(None, {"spark.driver.memory": "6g", "spark.sql.shuffle.partitions": "4"},
                            app_name="bench-spark")
        figures["spark"] = spark.version
        figures["spark_start"] = time.perf_counter() - started
        console.print(f"Spark {spark.version} local session started in {figures['spark_start']:.1f}s")
        spark_log_write(spark, workdir, 1, "warm-up")
        figures["spark_log_write_10000"] = spark_log_write(spark, workdir, args.repeat, "spark-log")
        console.print(f"a 10k-change log written by a Spark job instead of pyarrow: "
                      f"median {figures['spark_log_write_10000']:.3f}s (the table size does not matter)")
        for rows in (int(s) for s in args.sizes.split(",") if s.strip()):
            bench_table(args, spark, workdir, rows, figures)
        if not args.skip_copy:
            bench_copy(args, workdir, figures)
        if args.view_rows:
            console.print(f"[bold]incremental views[/] on {args.view_rows:,} rows, 1 % changed per batch")
            bench_views(args, spark, workdir, figures)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    table = Table(title="Spark mirror target (seconds unless noted)")
    for col in ("table rows", "apply 1k", "apply 10k", "rewrite 10k (CoW)", "log files", "read (logs)",
                "compact", "read (compacted)"):
        table.add_column(col, justify="right")
    for t in figures.get("tables", []):
        table.add_row(f"{t['rows']:,}", f"{t['apply_1000']:.3f}", f"{t['apply_10000']:.3f}",
                      f"{t['rewrite_10000']:.2f}", str(t["logs"]), f"{t['read_with_logs']:.2f}",
                      f"{t['compact']:.1f}", f"{t['read_compacted']:.2f}")
    console.print(table)
    if "copy" in figures:
        console.print(f"initial copy: {figures['copy']['rows_per_s']:,.0f} rows/s "
                      f"({figures['copy']['rows']:,} rows in {figures['copy']['seconds']:.1f}s)")
    if "views" in figures:
        for shape in VIEWS:
            v = figures["views"][shape]
            console.print(f"view {shape}: incremental {v['incremental']:.2f}s against full {v['full']:.2f}s "
                          f"= {v['full'] / v['incremental']:.1f}x")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
