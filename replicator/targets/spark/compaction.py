"""Compaction: fold a table's change log into a new base.

Optimistic: the new base is written (by Spark, into a fresh directory; never
by overwriting) from the manifest read at the start, then, under the
writers' lock, committed only if the table is still in the same generation
and still begins with the same log files; logs appended meanwhile by the
consumer stay. The replaced base and logs become garbage, deleted by a later
commit once readers that listed them are done.

A compaction asked to stop (the consumer's, when the consumer stops: see
SparkTarget.close) commits nothing more: the caller cancels its Spark job, it
removes the base it was writing, and the manifest stays as it was.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replicator.errors import UserError
from replicator.targets.spark.reader import _entry, merged_physical
from replicator.targets.spark.warehouse import COMPACT_LOCK, Warehouse, make_durable, new_id
from replicator.wording import counted

log = logging.getLogger("replicator")


@dataclass
class Compacted:
    table: str
    logs: int           # log files folded in
    rows: int           # rows of the new base
    seconds: float
    committed: bool     # False: the table changed meanwhile (new generation), nothing done


class CompactionStopped(Exception):
    """A compaction stopped before it committed, as asked: the warehouse is as it was."""


def compact(spark: Any, path: Path | str, *, tables: list[str] | None = None, min_logs: int = 1,
            stop: threading.Event | None = None) -> list[Compacted]:
    """Compacts the tables (all by default) that have at least `min_logs` log files.
    Once `stop` is set it commits nothing more and raises CompactionStopped (the
    caller cancels the Spark job running then)."""
    warehouse = Warehouse(path)
    if not warehouse.exists():
        raise UserError(f"{warehouse.path} is not a replicator Spark warehouse (no manifest)")
    with warehouse.lock(COMPACT_LOCK, wait=True):
        with warehouse.lock():   # remove_orphans needs it: no manifest writer is mid-write then
            manifest = warehouse.read()
            warehouse.remove_orphans(manifest, compaction=True)
        names = [_entry(manifest, t)[0] for t in tables] if tables else list(manifest["tables"])
        done = []
        for name in names:
            entry = manifest["tables"].get(name)
            if entry is None or len(entry["logs"]) < min_logs:
                continue
            done.append(_compact_table(spark, warehouse, name, entry, stop or threading.Event()))
        return done


def _compact_table(spark: Any, warehouse: Warehouse, name: str, entry: dict[str, Any],
                   stop: threading.Event) -> Compacted:
    started = time.monotonic()
    folded = [log_["file"] for log_ in entry["logs"]]
    target = warehouse.file(f"{entry['generation']}/compact-{new_id()}")
    committed = False
    try:
        _check(stop, name)
        log.info("compacting %s: %s", name, counted(len(folded), "log file"))
        merged_physical(spark, warehouse, entry).write.mode("errorifexists").parquet(str(target))
        _check(stop, name)
        parts = sorted(target.glob("part-*.parquet"))
        make_durable(parts, warehouse.path)   # Spark does not fsync; the manifest will name them
        files = [warehouse.relative(p) for p in parts]
        rows = spark.read.parquet(str(target)).count() if files else 0
        committed = _commit(warehouse, name, entry, folded, files, rows, stop)
    finally:
        if not committed:   # stopped, failed, or the table changed meanwhile: the new base is nobody's
            shutil.rmtree(target, ignore_errors=True)
    seconds = time.monotonic() - started
    log.info("compacted %s: %s into %s in %.1fs%s", name, counted(len(folded), "log file"), counted(rows, "row"),
             seconds, "" if committed else " (not committed: the table changed meanwhile)")
    return Compacted(table=name, logs=len(folded), rows=rows, seconds=seconds, committed=committed)


def _check(stop: threading.Event, name: str) -> None:
    if stop.is_set():
        raise CompactionStopped(f"compaction of {name} stopped before it committed")


def _commit(warehouse: Warehouse, name: str, entry: dict[str, Any], folded: list[str], files: list[str], rows: int,
            stop: threading.Event) -> bool:
    """Makes the new base the table's if the table is still in the generation and log the
    compaction read (and no stop was asked); returns whether it did."""
    with warehouse.lock():
        _check(stop, name)
        manifest = warehouse.read()
        current = manifest["tables"].get(name)
        committed = (current is not None and current["generation"] == entry["generation"]
                     and [log_["file"] for log_ in current["logs"][:len(folded)]] == folded
                     and current["base"] == entry["base"])
        if committed:
            assert current is not None
            manifest.setdefault("garbage", []).append({"files": current["base"] + folded, "since": time.time()})
            current["base"] = files
            current["base_rows"] = rows
            current["logs"] = current["logs"][len(folded):]
            warehouse.collect_garbage(manifest)
            warehouse.write(manifest)
    return committed
