"""The Spark benchmark: the Delta warehouse (``--target delta:``) side by side, in one run, with the
Spark warehouse it replaces (``spark:``, run from the commit given by --anchor) and with a plain Spark
``MERGE INTO`` of each batch as a foreachBatch user writes it. Run it through ``bin/bench-spark``.

1. Apply. For each table size (1M and 10M rows by default) a Delta table is made by writing its data
   files directly with pyarrow (copying 10M rows through PostgreSQL would measure the copy, which 4.
   measures). Then batches of 1k and 10k changes (80% updates of random existing keys, 10% inserts,
   10% deletes) are applied through the DeltaTarget as the consumer drives it: begin, upsert/delete,
   set_position, commit (deletion vectors, one data file, the table's commit, _replicator's commit).
   The first batch after opening the table also builds the key index: it is reported on its own.
   Each size is measured twice: default tables, and portable ones (``delta:URI?tables=portable``:
   copy-on-write of the files a batch touches, no deletion vectors), printed side by side.
2. Read of the current state (Spark, ``format("delta")``: count and aggregates over every column) after
   the batches (their small files and deletion vectors), after the empty batches of an idle consumer
   that purge the deletion vectors a file at a time, and after OPTIMIZE (one scan of large files): the
   ratios are what a reader pays for batches not yet folded, under load and once the consumer is idle.
3. The same 10k-change batches with Spark ``MERGE INTO`` into a Delta table with deletion vectors (a
   copy of the same table written by Spark), the session warm.
4. Initial copy: a PostgreSQL table of --copy-rows rows copied by the real consumer into a new Delta
   warehouse, and a batch of 10k row changes end to end through the queue.
The anchor: the same apply and read measurements of the ``spark:`` warehouse, by the benchmark of the
--anchor commit (its own bin/bench_spark.py, in a subprocess, on the same sizes).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
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
from replicator.targets.delta import log as delta_log
from replicator.targets.delta import maintenance
from replicator.targets.delta import schema as delta_schema
from replicator.targets.delta.actions import Action
from replicator.targets.delta.table import FILE_ROWS, ROW_GROUP, CountingWriter, file_stats
from replicator.targets.delta.target import DeltaTarget
from replicator.targets.protocol import TargetTable

console = Console()
if not console.is_terminal:
    console.width = 120

ANCHOR = "50a2e27"   # the last commit whose warehouse was spark:PATH (manifest, base and change log files)
STRUCTURE = TableStructure(schema="public", name="bench", key=("id",), columns=(
    Column("id", "bigint", "bigint", "N", True, 1),
    Column("k", "integer", "integer", "N", False, 2),
    Column("label", "text", "text", "S", False, 3),
    Column("score", "double precision", "double precision", "N", False, 4),
    Column("amount", "numeric(12,2)", "numeric", "N", False, 5),
    Column("updated_at", "timestamp with time zone", "timestamp with time zone", "D", False, 6),
))
TABLE = TargetTable(source_name="public.bench", table_id=1, mode="full", structure=STRUCTURE, copy_snapshot=None)
Row = tuple[Any, ...]


KINDS = {"default": "", "portable": "?tables=portable"}   # the warehouse's option for each kind of tables


def make_table(path: Path, rows: int, kind: str) -> None:
    """A warehouse holding public.bench with `rows` rows, its data files written directly with pyarrow."""
    target = DeltaTarget(str(path) + KINDS[kind])
    target.begin()
    target.create_table(TABLE)
    target.set_position("bench", "bench", 1)
    target.commit()
    table = target._table("public.bench")
    schema = delta_schema.arrow_schema(STRUCTURE, table.snapshot.schema)
    rng = np.random.default_rng(1)
    actions: list[Action] = []
    for start in range(0, rows, FILE_ROWS):
        n = min(FILE_ROWS, rows - start)
        ids = np.arange(start, start + n, dtype=np.int64)
        data = pa.Table.from_arrays([
            pa.array(ids),
            pa.array(rng.integers(0, 1000, n, dtype=np.int32)),
            pc.binary_join_element_wise("label-", pa.array(ids).cast(pa.string()), ""),
            pa.array(rng.random(n)),
            pa.array((ids % 100000).astype(str).astype(object) + ".50").cast(schema.field(4).type),
            pa.array(np.full(n, 1_700_000_000_000_000, dtype=np.int64)).cast(pa.timestamp("us", "UTC")),
        ], schema=schema)
        name = f"part-00000-{start:012d}-c000.snappy.parquet"
        with table.storage.open_write(f"{table.directory}/{name}") as out:
            counter = CountingWriter(out)
            pq.write_table(data, counter, row_group_size=ROW_GROUP, compression="snappy")
        actions.append({"add": {"path": name, "partitionValues": {}, "size": counter.size,
                                "modificationTime": delta_log.now_ms(), "dataChange": True,
                                "stats": json.dumps(file_stats(data))}})
    delta_log.commit(table.storage, table.snapshot, actions, operation="WRITE")
    target.close()


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


def apply_batch(target: DeltaTarget, upserts: list[Row], deletes: list[Row], tick: int) -> float:
    started = time.perf_counter()
    target.begin()
    table = target.tables()["public.bench"]
    target.upsert(table, "U", upserts)
    target.delete(table, deletes)
    target.set_position("bench", "bench", tick)
    target.commit()
    return time.perf_counter() - started


def idle_until_purged(target: DeltaTarget, tick: int) -> tuple[int, float]:
    """Empty batches, as an idle consumer gets them once the table has been quiet for
    maintenance.IDLE_PURGE_QUIET, until its idle purge has rewritten every file with a deletion
    vector (a file each): how many, and their time."""
    maintenance.IDLE_PURGE_QUIET = 0.0   # the quiet time is waited for by the consumer, not measured here
    started = time.perf_counter()
    batches = 0
    def vectors() -> int:
        return sum(1 for add in delta_log.load(target.storage, "public.bench").files.values()
                   if add.get("deletionVector"))

    left = vectors()
    while left:
        target.begin()
        target.set_position("bench", "bench", tick + batches)
        target.commit()
        batches += 1
        if vectors() >= left:
            raise RuntimeError("an idle batch purged no deletion vector (the consumer logs why)")
        left = vectors()
    return batches, time.perf_counter() - started


def read_state(spark: Any, location: str, repeat: int = 3) -> tuple[float, int]:
    """The median time of reading the table's current state whole (count, aggregates over every column)."""
    from pyspark.sql import functions as F
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        row = spark.read.format("delta").load(location).agg(
            F.count("*").alias("n"), F.sum("k"), F.max(F.length("label")), F.sum("score"),
            F.max("amount"), F.max("updated_at")).collect()[0]
        times.append(time.perf_counter() - started)
    return statistics.median(times), row["n"]


def merge_batches(spark: Any, location: str, rows: int, repeat: int, figures: dict[str, Any]) -> None:
    """The same batches as a foreachBatch user applies them: MERGE INTO a Delta table (deletion vectors
    on) that Spark wrote from the same rows."""
    from pyspark.sql import types as T
    copy = f"{location}-merge"
    spark.read.format("delta").load(location).write.format("delta").option(
        "delta.enableDeletionVectors", "true").save(copy)
    spark.sql(f"ALTER TABLE delta.`{copy}` SET TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')")
    schema = T.StructType([T.StructField("id", T.LongType()), T.StructField("k", T.IntegerType()),
                           T.StructField("label", T.StringType()), T.StructField("score", T.DoubleType()),
                           T.StructField("amount", T.StringType()), T.StructField("updated_at", T.StringType()),
                           T.StructField("op", T.StringType())])
    rnd = random.Random(rows + 1)
    next_id = [rows * 2]
    times = []
    for _ in range(repeat + 1):
        upserts, deletes = change_batch(rows, 10000, rnd, next_id)
        latest = {u[0]: (*u, "u") for u in upserts} | {d[0]: (d[0], None, None, None, None, None, "d") for d in deletes}
        batch = spark.createDataFrame(list(latest.values()), schema)   # a key once, as MERGE needs
        batch = batch.selectExpr("id", "k", "label", "score", "CAST(amount AS DECIMAL(12,2)) AS amount",
                                 "CAST(updated_at AS TIMESTAMP) AS updated_at", "op")
        batch.createOrReplaceTempView("batch")
        started = time.perf_counter()
        spark.sql(f"""MERGE INTO delta.`{copy}` t USING batch s ON t.id = s.id
                      WHEN MATCHED AND s.op = 'd' THEN DELETE
                      WHEN MATCHED THEN UPDATE SET k = s.k, label = s.label, score = s.score, amount = s.amount,
                                                   updated_at = s.updated_at
                      WHEN NOT MATCHED AND s.op <> 'd' THEN INSERT (id, k, label, score, amount, updated_at)
                           VALUES (s.id, s.k, s.label, s.score, s.amount, s.updated_at)""")
        times.append(time.perf_counter() - started)
    figures["merge_10000"] = statistics.median(times[1:])   # the first pays for planning and code generation
    console.print(f"  Spark MERGE INTO, 10k changes: median {figures['merge_10000']:.2f}s of {repeat} "
                  f"(first {times[0]:.1f}s)")


def bench_table(args: argparse.Namespace, spark: Any, workdir: Path, rows: int, kind: str,
                figures: dict[str, Any]) -> None:
    path = workdir / f"wh-{rows}-{kind}"
    started = time.perf_counter()
    make_table(path, rows, kind)
    console.print(f"[bold]{rows:,} rows, {kind} tables[/]: data files written with pyarrow in "
                  f"{time.perf_counter() - started:.1f}s")
    location = str(path / "public.bench")
    out: dict[str, Any] = {"rows": rows, "kind": kind}
    target = DeltaTarget(str(path) + KINDS[kind])
    rnd = random.Random(rows)
    next_id = [rows]
    tick = 2
    upserts, deletes = change_batch(rows, 10000, rnd, next_id)
    out["first_batch_10000"] = apply_batch(target, upserts, deletes, tick)
    tick += 1
    console.print(f"  first batch of 10k changes (builds the key index): {out['first_batch_10000']:.2f}s")
    for size in (1000, 10000):
        times = []
        for _ in range(args.repeat):
            upserts, deletes = change_batch(rows, size, rnd, next_id)
            times.append(apply_batch(target, upserts, deletes, tick))
            tick += 1
        out[f"apply_{size}"] = statistics.median(times)
        console.print(f"  apply {size:,} changes: median {out[f'apply_{size}']:.3f}s of {args.repeat}")
    files = len(delta_log.load(target.storage, "public.bench").files)
    read_state(spark, location, 1)   # warm-up: JIT, file listing caches
    out["read_after_batches"], count = read_state(spark, location)
    console.print(f"  read current state ({files} files{', deletion vectors' if kind == 'default' else ''}): "
                  f"{out['read_after_batches']:.2f}s "
                  f"({count:,} rows)")
    out["idle_batches"], out["idle_seconds"] = idle_until_purged(target, tick)
    target.close()
    read_state(spark, location, 1)
    out["read_after_idle"], count_idle = read_state(spark, location)
    assert count_idle == count, (count, count_idle)
    console.print(f"  the consumer idle: {out['idle_batches']} empty batches purged the deletion vectors in "
                  f"{out['idle_seconds']:.1f}s; read current state after them: {out['read_after_idle']:.2f}s")
    started = time.perf_counter()
    maintenance.optimize(target.storage, everything=True)
    out["optimize"] = time.perf_counter() - started
    read_state(spark, location, 1)
    out["read_optimized"], count2 = read_state(spark, location)
    assert count2 == count, (count, count2)
    out["files"] = files
    console.print(f"  OPTIMIZE: {out['optimize']:.1f}s; read current state after it: {out['read_optimized']:.2f}s "
                  f"(ratio {out['read_after_batches'] / out['read_optimized']:.2f})")
    if args.merge_repeat and kind == "default":
        merge_batches(spark, location, rows, args.merge_repeat, out)
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
        target = DeltaTarget(str(workdir / "copy"))
        consumer = Consumer(dsn, "bench", target)
        started = time.perf_counter()
        consumer.connect()
        consumer.sync_tables()
        seconds = time.perf_counter() - started
        figures["copy"] = {"rows": args.copy_rows, "seconds": seconds, "rows_per_s": args.copy_rows / seconds}
        console.print(f"[bold]initial copy[/]: {args.copy_rows:,} rows in {seconds:.1f}s = "
                      f"{args.copy_rows / seconds:,.0f} rows/s")
        times = []
        with psycopg.connect(dsn, autocommit=True) as conn:
            for i in range(args.repeat + 1):
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
        times = times[1:]   # the first batch builds the key index
        figures["batch_end_to_end"] = {"seconds": statistics.median(t for t, _ in times),
                                       "rows": statistics.median(r for _, r in times)}
        console.print(f"[bold]end to end[/]: a batch of {figures['batch_end_to_end']['rows']:,.0f} row changes "
                      f"on the {args.copy_rows:,}-row table applied in {figures['batch_end_to_end']['seconds']:.3f}s"
                      f" (median of {args.repeat}: fetch, decode, deletion vectors, data file, commits)")
        consumer.close()
        target.close()


def run_anchor_bench(anchor: str, workdir: Path, arguments: list[str]) -> dict[str, Any] | None:
    """The anchor commit's own bin/bench_spark.py, run in a subprocess from a tree of that commit with
    these arguments; its figures (None when it failed)."""
    root = Path(__file__).resolve().parent.parent
    tree = workdir / "anchor"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(root), "archive", anchor], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    for folder in ("migrations", "queue_sql"):   # mapped into the package by its pyproject (an editable install)
        (tree / "replicator" / folder).symlink_to(tree / folder)
    out = workdir / "anchor.json"
    env = {**os.environ, "PYTHONPATH": f"{tree}:{tree / 'bin'}"}
    done = subprocess.run([sys.executable, str(tree / "bin" / "bench_spark.py"), *arguments, "--json", str(out)],
                          env=env, cwd=tree)
    if done.returncode != 0:
        console.print(f"[red]the anchor's benchmark failed (exit {done.returncode})[/]")
        return None
    figures: dict[str, Any] = json.loads(out.read_text())
    return figures


def run_anchor(args: argparse.Namespace, workdir: Path) -> dict[str, Any] | None:
    """The spark: warehouse measured by the anchor commit's own benchmark, on the same sizes."""
    console.print(f"[bold]anchor[/]: the spark: warehouse, by the benchmark of {args.anchor}")
    return run_anchor_bench(args.anchor, workdir, ["--sizes", args.sizes, "--repeat", str(args.repeat),
                                                   "--skip-copy", "--view-rows", "0"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-spark", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000000,10000000", help="table sizes in rows (default 1M,10M)")
    parser.add_argument("--repeat", type=int, default=5, help="batches of each size, the median is reported")
    parser.add_argument("--merge-repeat", type=int, default=3,
                        help="Spark MERGE INTO batches per size, the median is reported (0 skips them)")
    parser.add_argument("--copy-rows", type=int, default=1_000_000, help="rows of the initial copy (default 1M)")
    parser.add_argument("--kinds", default="default,portable",
                        help="the kinds of tables measured at each size, side by side (default both)")
    parser.add_argument("--skip-copy", action="store_true")
    parser.add_argument("--anchor", default=ANCHOR, help=f"the commit whose spark: warehouse is measured beside "
                                                         f"(default {ANCHOR}); 'none' skips it")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    figures: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                               "pyarrow": pa.__version__}
    workdir = Path(tempfile.mkdtemp(prefix="replicator-bench-spark-"))
    try:
        anchor = run_anchor(args, workdir) if args.anchor != "none" else None
        from replicator.spark_session.session import get_session
        started = time.perf_counter()
        spark = get_session(None, {"spark.driver.memory": "6g", "spark.sql.shuffle.partitions": "4"},
                            app_name="bench-spark")
        figures["spark"] = spark.version
        figures["spark_start"] = time.perf_counter() - started
        console.print(f"Spark {spark.version} local session started in {figures['spark_start']:.1f}s")
        for rows in (int(s) for s in args.sizes.split(",") if s.strip()):
            for kind in (k.strip() for k in args.kinds.split(",") if k.strip()):
                bench_table(args, spark, workdir, rows, kind, figures)
        if not args.skip_copy:
            bench_copy(args, workdir, figures)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    old = {t["rows"]: t for t in (anchor or {}).get("tables", [])}
    table = Table(title=f"Delta warehouse, side by side with spark: ({args.anchor}) and Spark MERGE INTO "
                        f"(seconds)")
    for col in ("table rows", "tables", "apply 1k", "apply 10k", "10k: spark:", "10k: MERGE INTO", "first 10k (index)",
                "read after batches", "read after idle", "read optimized", "ratio", "ratio idle",
                "read spark: (logs)", "read spark: (compacted)"):
        table.add_column(col, justify="right")
    for t in figures.get("tables", []):
        o = old.get(t["rows"], {}) if t["kind"] == "default" else {}
        table.add_row(f"{t['rows']:,}", t["kind"], f"{t['apply_1000']:.3f}", f"{t['apply_10000']:.3f}",
                      f"{o['apply_10000']:.3f}" if o else "-",
                      f"{t['merge_10000']:.2f}" if "merge_10000" in t else "-", f"{t['first_batch_10000']:.2f}",
                      f"{t['read_after_batches']:.2f}", f"{t['read_after_idle']:.2f}", f"{t['read_optimized']:.2f}",
                      f"{t['read_after_batches'] / t['read_optimized']:.2f}",
                      f"{t['read_after_idle'] / t['read_optimized']:.2f}",
                      f"{o['read_with_logs']:.2f}" if o else "-", f"{o['read_compacted']:.2f}" if o else "-")
    console.print(table)
    if "copy" in figures:
        console.print(f"initial copy: {figures['copy']['rows_per_s']:,.0f} rows/s "
                      f"({figures['copy']['rows']:,} rows in {figures['copy']['seconds']:.1f}s)")
    if args.json:
        args.json.write_text(json.dumps({**figures, "anchor": anchor}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
