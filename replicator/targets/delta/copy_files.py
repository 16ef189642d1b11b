"""The data files a parallel copy's workers write into a Delta table (replicator.targets.parallel_copy).

Each worker opens the warehouse's storage from its URL (a local directory or an
object store) and writes its rows, in the table's Parquet schema (physical
column names and field ids: replicator.targets.delta.schema), into files of
up to FILE_ROWS rows, as the consumer writes a copy's files itself
(replicator.targets.delta.table). It hands back, per file, what the file's
add action needs: its path, size and statistics; the consumer takes them into
the table's open transaction (ReplicaTable.take_files).

Files are named as Spark names a task's output, ``part-<worker>-<copy id>-c<n>``,
so a warehouse's VACUUM recognises what a killed copy left.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from replicator.structure import TableStructure
from replicator.targets.arrow import arrow_array
from replicator.targets.delta import schema as delta_schema
from replicator.targets.delta.actions import Stats
from replicator.targets.delta.storage import Storage
from replicator.targets.delta.table import COMPRESSION, FILE_ROWS, ROW_GROUP, CountingWriter, file_stats, merged_stats
from replicator.targets.delta.url import open_storage

WrittenFile = tuple[str, int, Stats]   # path in the table's directory, size, statistics


@dataclass(frozen=True)
class DataFiles:
    """Where and how a copy's workers write a table's data files (sent to each worker)."""
    url: str                      # the warehouse, as open_storage takes it
    directory: str                # the table's directory in it
    structure: str                # the table's TableStructure (JSON)
    schema: dict[str, Any]        # its Delta schema, as the copy's transaction leaves it
    copy_id: str = field(default_factory=lambda: str(uuid.uuid4()))

    def writer(self, worker: int) -> DataFileWriter:
        return DataFileWriter(self, worker)


class DataFileWriter:
    """One worker's files (the RangeWriter of replicator.targets.parallel_copy)."""

    def __init__(self, files: DataFiles, worker: int) -> None:
        self.files, self.worker = files, worker
        self.storage: Storage = open_storage(files.url)
        self.structure = TableStructure.from_json(files.structure)
        self.target = delta_schema.arrow_schema(self.structure, files.schema)
        self.written: list[WrittenFile] = []
        self._stack: contextlib.ExitStack | None = None
        self._writer: pq.ParquetWriter | None = None
        self._counter: CountingWriter | None = None
        self._path = ""
        self._rows = 0
        self._stats: list[Stats] = []

    def _arrow(self, rows: Sequence[Sequence[Any]]) -> pa.Table:
        columns = list(zip(*rows))
        arrays = [arrow_array(values, f.type, label=f"{self.structure.qualified_name}.{column.name}")
                  for values, f, column in zip(columns, self.target, self.structure.columns)]
        return pa.Table.from_arrays(arrays, schema=self.target)

    def write(self, rows: list[Sequence[Any]]) -> None:
        if not rows:
            return
        data = self._arrow(rows)
        if self._writer is None:
            self._open()
        assert self._writer is not None
        self._writer.write_table(data, row_group_size=ROW_GROUP)
        self._rows += data.num_rows
        self._stats.append(file_stats(data))
        if self._rows >= FILE_ROWS:
            self._close()

    def _open(self) -> None:
        self._path = f"part-{self.worker:05d}-{self.files.copy_id}-c{len(self.written):03d}.{COMPRESSION}.parquet"
        stack = contextlib.ExitStack()
        try:
            out = stack.enter_context(self.storage.open_write(f"{self.files.directory}/{self._path}"))
            self._counter = CountingWriter(out)
            self._writer = pq.ParquetWriter(self._counter, self.target, compression=COMPRESSION)
        except BaseException:
            stack.close()
            raise
        self._stack, self._rows, self._stats = stack, 0, []

    def _close(self) -> None:
        writer, stack, counter = self._writer, self._stack, self._counter
        if writer is None or stack is None or counter is None:
            return
        self._writer = self._stack = self._counter = None
        writer.close()
        stack.close()   # the file complete and durable (an object store's upload completed)
        self.written.append((self._path, counter.size, merged_stats(self._stats)))

    def close(self) -> list[WrittenFile]:
        self._close()
        return self.written

    def abort(self, error: BaseException) -> None:
        writer, stack = self._writer, self._stack
        self._writer = self._stack = self._counter = None
        if writer is not None and stack is not None:
            with contextlib.suppress(Exception):
                writer.close()
            with contextlib.suppress(Exception):
                # the error goes into open_write: the partial file (an upload) is abandoned, not completed
                stack.__exit__(type(error), error, error.__traceback__)
        for path, _, _ in self.written:
            with contextlib.suppress(Exception):
                self.storage.delete(f"{self.files.directory}/{path}")
        self.written = []
