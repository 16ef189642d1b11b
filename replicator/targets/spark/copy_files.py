"""The base files a parallel copy's workers write into a Spark warehouse (replicator.targets.parallel_copy).

Each worker writes its rows as base files of the table's generation, ``PREFIX-wNN-MMM.parquet``
of up to FILE_ROWS rows, and hands back each file's path and row count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from replicator.structure import TableStructure
from replicator.targets.spark.warehouse import arrow_table, physical_schema

ROW_GROUP = 131072
FILE_ROWS = 1 << 18

WrittenFile = tuple[Path, int]   # path, rows


@dataclass(frozen=True)
class BaseFiles:
    """Where and how a copy's workers write base files (sent to each worker)."""
    prefix: Path          # of every file's name, in the generation's directory
    structure: str        # the table's TableStructure (JSON)
    decimals: bool        # numerics as decimals or text: the generation's flag

    def writer(self, worker: int) -> BaseFileWriter:
        return BaseFileWriter(self, worker)


class BaseFileWriter:
    """One worker's files (the RangeWriter of replicator.targets.parallel_copy)."""

    def __init__(self, files: BaseFiles, worker: int) -> None:
        self.files, self.worker = files, worker
        self.structure = TableStructure.from_json(files.structure)
        self.written: list[WrittenFile] = []
        self._writer: pq.ParquetWriter | None = None
        self._path = Path()
        self._rows = 0

    def write(self, rows: list[Sequence[Any]]) -> None:
        if not rows:
            return
        if self._writer is None:
            self._path = Path(f"{self.files.prefix}-w{self.worker:02d}-{len(self.written):03d}.parquet")
            self._writer = pq.ParquetWriter(self._path, physical_schema(self.structure, decimals=self.files.decimals),
                                            compression="snappy")
            self._rows = 0
        self._writer.write_table(arrow_table(self.structure, rows, decimals=self.files.decimals),
                                 row_group_size=ROW_GROUP)
        self._rows += len(rows)
        if self._rows >= FILE_ROWS:
            self._close()

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()   # made durable with the rest of the transaction, when the consumer commits
            self.written.append((self._path, self._rows))
            self._writer = None

    def close(self) -> list[WrittenFile]:
        self._close()
        return self.written

    def abort(self, error: BaseException) -> None:
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
            self._writer = None
            self._path.unlink(missing_ok=True)
        for path, _ in self.written:
            path.unlink(missing_ok=True)
        self.written = []
