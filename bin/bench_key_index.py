"""The Delta target's key index at scale (issue 31): its bytes a row and build time for a text key
and a composite (integer, text) key, and what a batch then costs, its hits checked against the
files. No PostgreSQL, no Spark: a table of ROWS rows is written as a copy's workers write it
(files of FILE_ROWS rows, row groups of ROW_GROUP), the index built as a consumer started again
builds it, then a batch of updates (keys of the table) and inserts (new keys) is applied and
committed as the consumer applies one. With --churn N, N batches follow that each delete the
table's oldest --batch rows and insert as many new ones (a table whose rows come and go), and the
entries the index holds are reported against its live rows, at their most.

    PYTHONPATH=.:bin .venv/bin/python bin/bench_key_index.py --rows 10000000
    PYTHONPATH=.:bin .venv/bin/python bin/bench_key_index.py --rows 1000000 --churn 150 --baseline-rows 0

Bytes a row: what the index holds once built (its NumPy arrays and dicts, traced by tracemalloc),
over the live rows. The old index (a dict of the keys' Python values) is measured beside it on
--baseline-rows of the same keys.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from replicator.structure import Column, TableStructure
from replicator.targets.delta import schema as delta_schema
from replicator.targets.delta.index import canonical_keys, python_keys
from replicator.targets.delta.storage import LocalStorage
from replicator.targets.delta.table import COMPRESSION, FILE_ROWS, ROW_GROUP, CountingWriter, ReplicaTable, file_stats

KINDS: dict[str, TableStructure] = {
    "text": TableStructure("public", "t", (Column("k", "text", "text", "S", True, 1),
                                           Column("v", "bigint", "bigint", "N", False, 2)), ("k",)),
    "int-text": TableStructure("public", "t", (Column("a", "integer", "integer", "N", True, 1),
                                               Column("b", "text", "text", "S", True, 2),
                                               Column("v", "bigint", "bigint", "N", False, 3)), ("a", "b")),
}


def text_keys(numbers: np.ndarray) -> pa.Array:
    """Keys as text of 20 characters in no order (a UUID's prefix, say): 'k' + 19 hex digits."""
    scrambled = (numbers.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(1)
    return pa.array([f"k{n:019x}" for n in scrambled.tolist()], type=pa.string())


def key_columns(kind: str, numbers: np.ndarray) -> list[pa.Array]:
    if kind == "text":
        return [text_keys(numbers)]
    return [pa.array((numbers % 1000).astype(np.int32)), text_keys(numbers)]


def write_table(path: Path, kind: str, rows: int) -> ReplicaTable:
    structure = KINDS[kind]
    meta = {"source_name": "public.t", "table_id": 1, "mode": "full", "structure": structure.to_json(),
            "copy_snapshot": None}
    storage = LocalStorage(path)
    table = ReplicaTable(storage, "public.t")
    table.reset(meta, structure)
    target = delta_schema.arrow_schema(table.structure(), table.schema())
    files = []
    for number, start in enumerate(range(0, rows, FILE_ROWS)):
        numbers = np.arange(start, min(start + FILE_ROWS, rows), dtype=np.int64)
        columns = [*key_columns(kind, numbers), pa.array(numbers)]
        data = pa.Table.from_arrays(columns, schema=target)
        name = f"part-{number:05d}-bench-c000.{COMPRESSION}.parquet"
        with storage.open_write(f"public.t/{name}") as out:
            counter = CountingWriter(out)
            pq.write_table(data, counter, compression=COMPRESSION, row_group_size=ROW_GROUP)
        files.append((name, counter.size, file_stats(data)))
    table.take_files(files)
    table.commit(None, None)
    return ReplicaTable(storage, "public.t")   # as a consumer started again finds it


def traced(fn: Callable[[], Any]) -> tuple[Any, float, int, int]:
    """fn's result, seconds, the bytes it left allocated and its peak (NumPy's and Python's)."""
    tracemalloc.start()
    started = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - started
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return result, seconds, held, peak


def measure(kind: str, rows: int, batch: int, baseline_rows: int, churn: int, out: Any) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-key-index-") as tmp:
        started = time.perf_counter()
        table = write_table(Path(tmp), kind, rows)
        print(f"{kind}: {rows:,} rows written in {time.perf_counter() - started:.1f} s", file=out, flush=True)
        index, build, held, peak = traced(table.ensure_index)
        arrays = index._keys.nbytes + index._locations.nbytes
        print(f"{kind}: index built in {build:.1f} s (reading the key columns, hashing, sorting); "
              f"{held / rows:.1f} bytes a row held ({arrays / rows:.1f} in its arrays), peak "
              f"{peak / rows:.1f} bytes a row while building", file=out, flush=True)
        rng = np.random.default_rng(1)
        hits = rng.choice(rows, size=batch, replace=False)
        hits.sort()
        absent = np.arange(rows, rows + batch, dtype=np.int64)
        for label, numbers in (("hits", hits), ("absent keys", absent)):
            keys = canonical_keys(key_columns(kind, numbers), index.integer)
            times = []
            for _ in range(3):
                started = time.perf_counter()
                found = index.locate(keys)
                times.append(time.perf_counter() - started)
            assert sum(f >= 0 for f in found) == (batch if label == "hits" else 0)
            print(f"{kind}: locate {batch:,} {label}: {statistics.median(times):.3f} s (median of 3)",
                  file=out, flush=True)
        started = time.perf_counter()
        for numbers in (hits, absent):   # updates, then inserts: as a consumer stages a batch
            for key in python_keys(key_columns(kind, numbers)):
                key = key if isinstance(key, tuple) else (key,)
                table.change(key, False, (*key, -1))
        staged = time.perf_counter() - started
        started = time.perf_counter()
        table.commit("q/c", 1)
        print(f"{kind}: a batch of {batch:,} updates and {batch:,} inserts committed in "
              f"{time.perf_counter() - started:.2f} s ({staged:.2f} s to stage its rows)", file=out, flush=True)
        if churn:
            come_and_go(table, kind, rows + batch, batch, churn, out)
    if baseline_rows:
        numbers = np.arange(baseline_rows, dtype=np.int64)
        columns = key_columns(kind, numbers)
        old, seconds, held, _ = traced(lambda: {k: i for i, k in enumerate(python_keys(columns))})
        print(f"{kind}: the old index (a dict of Python values) at {baseline_rows:,} rows: "
              f"{held / baseline_rows:.1f} bytes a row, built in {seconds:.1f} s", file=out, flush=True)
        del old


def come_and_go(table: ReplicaTable, kind: str, end: int, batch: int, batches: int, out: Any) -> None:
    """Batches deleting the oldest rows (keys 0, 1, ...) and inserting as many new ones (from end on);
    prints the most entries the index held a live row, and the most recent codes it held."""
    most, recent, started = 0.0, 0, time.perf_counter()
    for n in range(batches):
        gone = np.arange(n * batch, (n + 1) * batch, dtype=np.int64)
        new = np.arange(end + n * batch, end + (n + 1) * batch, dtype=np.int64)
        for key in python_keys(key_columns(kind, gone)):
            key = key if isinstance(key, tuple) else (key,)
            table.change(key, True, (*key, None))
        for key in python_keys(key_columns(kind, new)):
            key = key if isinstance(key, tuple) else (key,)
            table.change(key, False, (*key, n))
        table.commit("q/c", n + 2)
        index = table.ensure_index()
        most = max(most, index.entries / index.live)
        recent = max(recent, len(index._recent))
    seconds = time.perf_counter() - started
    print(f"{kind}: {batches} batches of {batch:,} deletes and {batch:,} inserts in {seconds:.1f} s: at most"
          f" {most:.3f} entries a live row ({16 * most:.1f} bytes a row at 16 an entry), and "
          f"{recent:,} recent codes", file=out, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--batch", type=int, default=10_000, help="updates (and as many inserts) a batch")
    parser.add_argument("--baseline-rows", type=int, default=1_000_000, help="0: no baseline")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--churn", type=int, default=0, help="batches of deletes and inserts after the batch")
    args = parser.parse_args(argv)
    for kind in args.kinds.split(","):
        measure(kind, args.rows, args.batch, args.baseline_rows, args.churn, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
