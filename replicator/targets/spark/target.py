"""Spark target: every replicated table mirrored in a warehouse directory.

A batch costs what the batch holds, not what the table holds: its changes,
de-duplicated by key, are appended as one Parquet change log file per table
(written with pyarrow, no Spark job), and the batch becomes visible, with the
consumer position, when the manifest is replaced (replicator.targets.spark.warehouse).
Readers merge a table's base with its log (replicator.targets.spark.reader);
compaction folds the log into a new base (replicator.spark.compact), in a
background thread once a table has `compact_after_logs` log files, or with
`replicator spark compact`.

A crash at any point leaves the last committed manifest, which names only
complete files: the next run cleans up the files it had not committed and
resumes from the manifest's position, exactly once.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from replicator.errors import UserError
from replicator.structure import Change, TableStructure, target_table_name
from replicator.targets.crash import crash_point
from replicator.targets.files import file_changed
from replicator.targets.protocol import Row, TargetTable, queue_positions
from replicator.targets.spark.views import SparkViews
from replicator.targets.spark.warehouse import (
    COMPACT_LOCK,
    DECIMALS,
    LOCK,
    MANIFEST,
    MANIFEST_TMP_SUFFIX,
    OWNER_LOCK,
    Warehouse,
    arrow_table,
    make_durable,
    new_id,
    physical_schema,
    retire,
    stores_decimals,
)

log = logging.getLogger("replicator")

BASE_ROW_GROUP = 131072       # rows per row group of a copied base
BASE_FILE_ROWS = 1 << 18      # rows per file of a copied base (files are read in parallel)
LOG_SPILL_ROWS = 200_000      # distinct keys buffered per table before a log file is written
COMPACT_AFTER_LOGS = 64
COMPACT_RETRY_AFTER = 60.0    # seconds before a failed compaction is tried again, doubled per failure
COMPACT_RETRY_MAX = 3600.0
COMPACT_JOB_GROUP = "replicator-compaction"   # the background compaction's Spark jobs, cancelled at close
COMPACT_STOP_WAIT = 2.0       # seconds close() gives a stopped compaction to remove its files


def _check_warehouse_path(warehouse: Warehouse) -> None:
    """Refuses a directory that is neither a warehouse (a manifest, or only the lock files
    a consumer makes before its first commit) nor empty: the consumer deletes the files of
    its own layout that no manifest names (Warehouse.remove_orphans). Reads only; a damaged
    manifest is a ValueError."""
    path = warehouse.path
    if not path.is_dir():
        return
    if warehouse.exists():
        warehouse.read()   # a damaged manifest, found before anything is made in the directory
        return
    own = {OWNER_LOCK, LOCK, COMPACT_LOCK}
    foreign = sorted(p.name for p in path.iterdir() if p.name not in own
                     and not (p.name.startswith(f"{MANIFEST}.") and p.name.endswith(MANIFEST_TMP_SUFFIX)))
    if foreign:
        raise UserError(f"{path} is a directory that is not a Spark warehouse (no {MANIFEST}) and not empty (it holds "
                        f"{', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}): a consumer would delete "
                        f"files it does not know there, so it is left as it is; give the warehouse another path")


@dataclass
class _Pending:
    """A table's changes in the open transaction."""
    buffer: dict[tuple[Any, ...], tuple[bool, Row]] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)         # copied rows not yet in the base
    writer: pq.ParquetWriter | None = None
    writer_path: Path | None = None
    writer_rows: int = 0
    files: list[Path] = field(default_factory=list)       # written in this transaction


class SparkTarget:
    exactly_once = True

    def __init__(self, path: Path | str, *, master: str | None = None, conf: Mapping[str, str] | None = None,
                 spark: Any = None, compact_after_logs: int = COMPACT_AFTER_LOGS,
                 compact_retry_after: float = COMPACT_RETRY_AFTER) -> None:
        self.warehouse = Warehouse(path)
        if not self.warehouse.path.parent.is_dir():
            raise UserError(f"cannot create {self.warehouse.path}: directory {self.warehouse.path.parent} "
                            f"does not exist")
        try:
            _check_warehouse_path(self.warehouse)
            self.warehouse.path.mkdir(exist_ok=True)
            # One consumer process writes a warehouse: it removes what a crashed one left.
            self._owner = os.open(self.warehouse.path / OWNER_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                try:
                    fcntl.flock(self._owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise UserError(f"another consumer is writing the Spark warehouse {self.warehouse.path}"
                                    ) from None
                with self.warehouse.lock():
                    manifest = self.warehouse.read()
                    self.warehouse.remove_orphans(manifest, compaction=False)
            except BaseException:   # a failed start must not keep the warehouse locked from the next one
                os.close(self._owner)
                raise
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot use {self.warehouse.path} as a Spark warehouse: {exc}") from None
        self.name = f"spark:{self.warehouse.path}"
        self.master = master
        self.conf = dict(conf or {})
        self._spark = spark
        self.compact_after_logs = compact_after_logs
        self.compact_retry_after = compact_retry_after
        self.manifest = manifest              # the committed manifest
        self.work: dict[str, Any] | None = None  # the manifest as the open transaction sees it
        self._ops: list[tuple[Any, ...]] = []
        self._pending: dict[str, _Pending] = {}
        self._compactor: threading.Thread | None = None
        self._compact_stop = threading.Event()
        self._compact_error: Exception | None = None   # the last compaction's, None once one succeeds
        self._compact_failures = 0                        # in a row: the retry delay doubles with each
        self._compact_failed_at = 0.0                     # time.monotonic() of the last failure
        self._spark_lock = threading.Lock()
        self.views = SparkViews(self.warehouse, self.spark)

    def spark(self) -> Any:
        """The Spark session (started on first use: compaction, views)."""
        from replicator.targets.spark.session import get_session
        with self._spark_lock:
            if self._spark is None:
                self._spark = get_session(self.master, self.conf, app_name="replicator consumer")
            return self._spark

    # state ---------------------------------------------------------------------------

    def positions(self, queue: str) -> dict[str, int]:
        return queue_positions(self.manifest["positions"], queue)

    def queues(self) -> set[str]:
        return {key.partition("/")[0] for key in self.manifest["positions"]}

    def tables(self) -> dict[str, TargetTable]:
        return {name: _target_table(name, entry) for name, entry in self.manifest["tables"].items()}

    def _op(self, *op: Any) -> None:
        assert self.work is not None, "no open transaction: call begin() first"
        self._ops.append(op)
        _replay(self.work, [op])

    def set_position(self, queue: str, consumer: str, tick_id: int) -> None:
        self._op("position", f"{queue}/{consumer}", tick_id)

    def save_table(self, table: TargetTable) -> None:
        self._op("meta", table.source_name, _meta(table))

    # transactions --------------------------------------------------------------------

    def _check_directory(self) -> None:
        """Stops the consumer when the warehouse directory it writes is no longer the one at
        its path (deleted, replaced, or moved): its lock file, held open, tells."""
        how = file_changed(self.warehouse.path / OWNER_LOCK, self._owner)
        if how:
            how = "deleted or moved away" if how == "deleted" else how
            raise UserError(f"the Spark warehouse {self.warehouse.path} was {how} while the consumer was writing it; "
                            f"the consumer stopped before committing another batch: put it back, or run the same "
                            f"`replicator consume` again to build a new one (every table copied anew)")

    def begin(self) -> None:
        self._check_directory()
        self.work = copy.deepcopy(self.manifest)
        self._ops = []
        self._pending = {}

    def commit(self) -> None:
        assert self.work is not None
        self._check_directory()
        for name in list(self._pending):
            self._flush(name)
            self._close_base(name)
        # Before the manifest names them: data and directory entries (parallel copy workers' files included).
        make_durable([path for pending in self._pending.values() for path in pending.files], self.warehouse.path)
        crash_point("spark-log-written")
        with self.warehouse.lock():
            manifest = self.warehouse.read()
            before = copy.deepcopy(manifest) if manifest.get("views") else None
            manifest["next_seq"] = max(manifest["next_seq"], self.work["next_seq"])
            _replay(manifest, self._ops)
            if before is not None:
                # Under the lock: a view created meanwhile (`replicator view create`) is refreshed too.
                self.views.refresh_after(before, manifest, self._ops)
                crash_point("spark-views-refreshed")
            self.warehouse.collect_garbage(manifest)
            self.warehouse.write(manifest)
        crash_point("spark-committed")
        self.manifest = manifest
        self.work = None
        self._ops = []
        self._pending = {}
        self._maybe_compact()

    def rollback(self) -> None:
        for pending in self._pending.values():
            self._discard(pending)
        self._pending = {}
        self._ops = []
        self.work = None

    def close(self) -> None:
        self.rollback()
        self._stop_compaction()
        if self._owner >= 0:
            os.close(self._owner)
            self._owner = -1

    # tables --------------------------------------------------------------------------

    def _entry(self, name: str) -> dict[str, Any]:
        assert self.work is not None
        entry: dict[str, Any] = self.work["tables"][name]
        return entry

    def create_table(self, table: TargetTable) -> None:
        """Starts a new generation of the table: an empty base, no log."""
        assert self.work is not None
        name = table.source_name
        old = self.work["tables"].get(name)
        table_dir = old["dir"] if old else f"{_dir_name(table.structure)}-{new_id()}"
        self._discard(self._pending.pop(name, None))
        self._op("generation", name, {"dir": table_dir, "generation": f"{table_dir}/g-{new_id()}",
                                      "base": [], "base_rows": 0, "logs": [], DECIMALS: True, **_meta(table)})
        self._pending[name] = _Pending()

    def drop_table(self, table: TargetTable) -> None:
        self._discard(self._pending.pop(table.source_name, None))
        self._op("drop", table.source_name)

    def alter_table(self, old: TargetTable, new: TargetTable, changes: list[Change]) -> None:
        """In place: columns are stored by attnum, so only the recorded structure changes."""
        self._flush(old.source_name)
        self._close_base(old.source_name)
        if old.source_name != new.source_name:
            self._op("rename", old.source_name, new.source_name)
            if old.source_name in self._pending:
                self._pending[new.source_name] = self._pending.pop(old.source_name)
        self._op("meta", new.source_name, _meta(new))

    def schema_event(self, table: TargetTable, event: dict[str, Any]) -> None:
        """Nothing to record: the manifest's structure is the record."""

    # changes -------------------------------------------------------------------------

    def _table_pending(self, name: str) -> _Pending:
        pending = self._pending.get(name)
        if pending is None:
            pending = self._pending[name] = _Pending()
        return pending

    def upsert(self, table: TargetTable, op: str, rows: Iterable[Row]) -> None:
        pending = self._table_pending(table.source_name)
        if op == "R":   # the copy of a new generation: straight into its base
            pending.rows.extend(rows)
            if len(pending.rows) >= BASE_ROW_GROUP:
                self._write_base(table.source_name, pending)
            return
        positions = table.structure.key_positions()
        buffer = pending.buffer
        for row in rows:
            buffer[tuple(row[i] for i in positions)] = (False, row)
        if len(buffer) >= LOG_SPILL_ROWS:
            self._flush(table.source_name)

    def delete(self, table: TargetTable, keys: Iterable[Row]) -> None:
        pending = self._table_pending(table.source_name)
        buffer = pending.buffer
        positions = table.structure.key_positions()
        width = len(table.structure.columns)
        for key in keys:
            key = tuple(key)
            row: list[Any] = [None] * width
            for i, value in zip(positions, key):
                row[i] = value
            buffer[key] = (True, row)
        if len(buffer) >= LOG_SPILL_ROWS:
            self._flush(table.source_name)

    def copy_from(self, table: TargetTable, snap: Any, progress: Callable[[int], None]) -> int | None:
        """The initial copy of a large table, split over worker processes that read
        ranges of it in the copy's snapshot and write base files themselves
        (replicator.targets.parallel_copy, replicator.targets.spark.copy_files). None:
        not splittable or small, copy it through upsert()."""
        from replicator.targets import parallel_copy
        from replicator.targets.spark.copy_files import BaseFiles, WrittenFile

        workers = parallel_copy.workers_for(snap.estimated_rows)
        ranges = parallel_copy.block_ranges(snap.conn, snap.table.oid, workers)
        if ranges is None:
            return None
        name = table.source_name
        pending = self._table_pending(name)
        directory = self.warehouse.file(self._entry(name)["generation"])
        directory.mkdir(parents=True, exist_ok=True)
        prefix = directory / f"base-{new_id()}"
        files: list[WrittenFile] = []
        try:
            rows = parallel_copy.copy_parallel(
                snap, ranges, BaseFiles(prefix, table.structure.to_json(), stores_decimals(self._entry(name))),
                progress, files.extend)
        finally:   # written files are the transaction's, whatever happens
            pending.files.extend(prefix.parent.glob(prefix.name + "-*.parquet"))
        for path, count in sorted(files):
            self._op("base", name, self.warehouse.relative(path), count)
        return rows

    def truncate(self, table: TargetTable) -> None:
        """A new, empty generation: cost independent of the table's size."""
        entry = self._entry(table.source_name)
        self.create_table(_target_table(table.source_name, entry))

    # files ---------------------------------------------------------------------------

    def _structure(self, name: str) -> TableStructure:
        return TableStructure.from_json(self._entry(name)["structure"])

    def _flush(self, name: str) -> None:
        """Writes the table's buffered changes as one change log file."""
        pending = self._pending.get(name)
        if pending is None or not pending.buffer:
            return
        assert self.work is not None
        entry = self._entry(name)
        seq = self.work["next_seq"]
        self.work["next_seq"] = seq + 1
        changes = list(pending.buffer.values())
        pending.buffer = {}
        data = arrow_table(self._structure(name), [row for _, row in changes], decimals=stores_decimals(entry),
                           seq=seq, deleted=[deleted for deleted, _ in changes])
        path = self.warehouse.file(f"{entry['generation']}/log-{seq:012d}-{new_id()}.parquet")
        path.parent.mkdir(parents=True, exist_ok=True)
        pending.files.append(path)
        pq.write_table(data, path, compression="snappy")
        self._op("logs", name, [{"file": self.warehouse.relative(path), "seq": seq, "rows": len(changes),
                                 "deletes": sum(1 for deleted, _ in changes if deleted)}])

    def _write_base(self, name: str, pending: _Pending) -> None:
        if not pending.rows:
            return
        entry = self._entry(name)
        structure = self._structure(name)
        if pending.writer is None:
            path = self.warehouse.file(f"{entry['generation']}/base-{len(entry['base']):05d}.parquet")
            path.parent.mkdir(parents=True, exist_ok=True)
            pending.files.append(path)
            pending.writer = pq.ParquetWriter(path, physical_schema(structure, decimals=stores_decimals(entry)),
                                              compression="snappy")
            pending.writer_path = path
            pending.writer_rows = 0
        pending.writer.write_table(arrow_table(structure, pending.rows, decimals=stores_decimals(entry)),
                                   row_group_size=BASE_ROW_GROUP)
        pending.writer_rows += len(pending.rows)
        pending.rows = []
        if pending.writer_rows >= BASE_FILE_ROWS:
            self._close_base(name)

    def _close_base(self, name: str) -> None:
        pending = self._pending.get(name)
        if pending is None:
            return
        if pending.rows:
            self._write_base(name, pending)
        if pending.writer is None:
            return
        pending.writer.close()
        assert pending.writer_path is not None
        self._op("base", name, self.warehouse.relative(pending.writer_path), pending.writer_rows)
        pending.writer = None
        pending.writer_path = None

    @staticmethod
    def _discard(pending: _Pending | None) -> None:
        if pending is None:
            return
        if pending.writer is not None:
            pending.writer.close()
            pending.writer = None
        for path in pending.files:
            path.unlink(missing_ok=True)
        pending.files = []

    # compaction ----------------------------------------------------------------------

    def _maybe_compact(self) -> None:
        if self.compact_after_logs <= 0:
            return
        if self._compactor is not None and self._compactor.is_alive():
            return
        if self._compact_failures and time.monotonic() - self._compact_failed_at < self._retry_delay():
            return
        due = [name for name, entry in self.manifest["tables"].items()
               if len(entry["logs"]) >= self.compact_after_logs]
        if not due:
            return
        self._compactor = threading.Thread(target=self._compact, args=(due,), name="replicator-compact",
                                           daemon=True)
        self._compactor.start()

    def _stop_compaction(self) -> None:
        """Stops a running background compaction, promptly: it commits nothing from now on
        (it checks the stop under the writers' lock, which this takes once, so a commit
        under way is over) and its Spark jobs are cancelled. It gets COMPACT_STOP_WAIT
        seconds to remove what it wrote; Spark may be busy planning a job for longer
        (which cannot be cancelled), and then the compaction is left to the process's
        exit: the manifest names none of its files, and the next compaction removes them."""
        compactor = self._compactor
        if compactor is None or not compactor.is_alive():
            return
        self._compact_stop.set()
        with contextlib.suppress(OSError), self.warehouse.lock():   # (a warehouse deleted meanwhile: no commit either)
            pass
        deadline = time.monotonic() + COMPACT_STOP_WAIT
        while compactor.is_alive() and time.monotonic() < deadline:
            if self._spark is not None:   # again while it runs: a job started after a cancellation is not one
                self._spark.sparkContext.cancelJobGroup(COMPACT_JOB_GROUP)
            compactor.join(0.2)
        if compactor.is_alive():
            log.info("the background compaction is left unfinished, uncommitted: the next one removes its files")

    def _retry_delay(self) -> float:
        return min(self.compact_retry_after * 2.0 ** (self._compact_failures - 1), COMPACT_RETRY_MAX)

    def _compact(self, names: list[str]) -> None:
        from replicator.targets.spark.compaction import compact
        from replicator.targets.spark.errors import error_line
        try:
            spark = self.spark()
            # this thread's jobs (PySpark pins a JVM thread to it): _stop_compaction cancels them
            spark.sparkContext.setJobGroup(COMPACT_JOB_GROUP, "replicator: background compaction",
                                           interruptOnCancel=True)
            compact(spark, self.warehouse.path, tables=names, stop=self._compact_stop)
        except Exception as exc:
            if self._compact_stop.is_set():   # CompactionStopped, or the cancelled job's error
                log.info("compaction of %s stopped: the consumer is stopping (the warehouse is as it was)",
                         ", ".join(names))
                return
            # the consumer goes on; the logs only grow until a retry succeeds
            self._compact_error = exc
            self._compact_failures += 1
            self._compact_failed_at = time.monotonic()
            log.warning("compaction of %s failed (retried in %.0fs, or run `replicator spark compact`): %s",
                        ", ".join(names), self._retry_delay(), error_line(exc))
        else:
            self._compact_error = None
            self._compact_failures = 0


def _dir_name(structure: TableStructure) -> str:
    name = target_table_name(structure.schema, structure.name)
    return "".join(ch if ch.isalnum() or ch in "_-" else "_" for ch in name)[:60] or "table"


def _meta(table: TargetTable) -> dict[str, Any]:
    return {"table_id": table.table_id, "mode": table.mode, "structure": table.structure.to_json(),
            "copy_snapshot": table.copy_snapshot}


def _target_table(name: str, entry: Mapping[str, Any]) -> TargetTable:
    return TargetTable(source_name=name, table_id=entry["table_id"], mode=entry["mode"],
                       structure=TableStructure.from_json(entry["structure"]), copy_snapshot=entry["copy_snapshot"])


def _replay(manifest: dict[str, Any], ops: list[tuple[Any, ...]]) -> None:
    """Applies a transaction's operations to a manifest: the consumer's own view
    while the transaction is open, and the latest committed manifest (which a
    compaction may have changed meanwhile) when it commits."""
    tables = manifest["tables"]
    for op in ops:
        kind = op[0]
        if kind == "position":
            manifest["positions"][op[1]] = op[2]
        elif kind == "meta":
            tables[op[1]].update(op[2])
        elif kind == "generation":
            old = tables.get(op[1])
            if old is not None and old["generation"] != op[2]["generation"]:
                retire(manifest, [old["generation"]])
            tables[op[1]] = copy.deepcopy(op[2])
        elif kind == "base":
            tables[op[1]]["base"].append(op[2])
            tables[op[1]]["base_rows"] += op[3]
        elif kind == "logs":
            tables[op[1]]["logs"].extend(copy.deepcopy(op[2]))
        elif kind == "rename":
            tables[op[2]] = tables.pop(op[1])
        elif kind == "drop":
            old = tables.pop(op[1], None)
            if old is not None:
                retire(manifest, [old["generation"]])
        else:
            raise AssertionError(f"unknown manifest operation {kind}")
