"""Targets a consumer applies changes to, behind one small protocol.

A target holds the replica and, for exactly-once delivery, the consumer's
position, written in the same transaction as the rows it covers.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..errors import UserError
from ..schema import Change, TableStructure

Row = Sequence[Any]


@dataclass
class TargetTable:
    """What a target knows of a replicated table."""
    source_name: str             # schema.table in the source
    table_id: int                # captured table id in the queue
    mode: str                    # 'full' or 'pk'
    structure: TableStructure
    copy_snapshot: str | None    # events visible in it are already in the copy


class Target(Protocol):
    """Every method after begin() runs in the target's open transaction."""

    name: str            # a stable description, the default consumer name derives from it
    exactly_once: bool   # whether position and rows commit atomically

    def positions(self, queue: str) -> dict[str, int]:
        """The last tick applied of each consumer of `queue` this target holds."""
        ...
    def queues(self) -> set[str]:
        """The queues this target holds positions of."""
        ...
    def tables(self) -> dict[str, TargetTable]: ...

    def begin(self) -> None: ...
    def commit(self) -> None: ...
    def rollback(self) -> None: ...
    def close(self) -> None: ...

    def set_position(self, queue: str, consumer: str, tick_id: int) -> None: ...
    def create_table(self, table: TargetTable) -> None: ...
    def save_table(self, table: TargetTable) -> None: ...
    def drop_table(self, table: TargetTable) -> None: ...
    def alter_table(self, old: TargetTable, new: TargetTable, changes: list[Change]) -> None: ...
    def schema_event(self, table: TargetTable, event: dict[str, Any]) -> None: ...

    def upsert(self, table: TargetTable, op: str, rows: Iterable[Row]) -> None: ...
    def delete(self, table: TargetTable, keys: Iterable[Row]) -> None: ...
    def truncate(self, table: TargetTable) -> None: ...

    def copy_from(self, table: TargetTable, snap: Any, progress: Callable[[int], None]) -> int | None:
        """Copies a new table itself from the source snapshot `snap` (a
        replicator.copy.SnapshotCopy), e.g. in parallel, and returns the rows
        copied; None leaves the copy to the consumer (upsert of op 'R')."""
        ...


def queue_positions(positions: dict[str, int], queue: str) -> dict[str, int]:
    """The positions of `queue` among a target's positions stored as {"QUEUE/CONSUMER": tick}."""
    prefix = f"{queue}/"
    return {key[len(prefix):]: tick for key, tick in positions.items() if key.startswith(prefix)}


def file_changed(path: str | Path, mine: int | tuple[int, int]) -> str:
    """How the file at `path` differs from the one a target writes, given as the descriptor
    it holds open or as the (st_dev, st_ino) it had: "" when it is that file, "deleted"
    when nothing is there, "replaced" when another file is. One stat(), before each batch:
    a target whose file was deleted or replaced would go on writing what nobody reads."""
    if isinstance(mine, int):
        st = os.fstat(mine)
        mine = (st.st_dev, st.st_ino)
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return "deleted"
    return "" if (st.st_dev, st.st_ino) == mine else "replaced"


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def special_file(path: str | Path) -> str | None:
    """What is at `path` when it is neither a regular file nor nothing ("a directory", "a
    named pipe (FIFO)", ...; symbolic links followed), else None. A target's files are
    read back, cut back and written at offsets: only a regular file can be one."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def set_aside(target: Target) -> str:
    """How to move a target's files out of the way, so that a consumer builds it anew."""
    scheme, _, where = target.name.partition(":")
    if scheme == "sqlite":
        return f"move {where} aside (with its -wal and -shm files, if there)"
    if scheme == "spark":
        return f"move the directory {where} aside"
    return f"move {where} and {where}.position aside"


def open_target(url: str, *, spark_master: str | None = None,
                spark_conf: dict[str, str] | None = None) -> Target:
    """sqlite:PATH, jsonl:-, jsonl:PATH, tsv:-, tsv:PATH, spark:PATH (a warehouse directory;
    Spark, with the given master and settings, only for compaction)."""
    scheme, sep, rest = url.partition(":")
    if not sep or not rest:
        raise UserError(f"invalid target {url!r}: use sqlite:PATH, spark:PATH, jsonl:PATH|- or tsv:PATH|-")
    if scheme == "sqlite":
        from .sqlite import SqliteTarget
        return SqliteTarget(Path(rest))
    if scheme in ("jsonl", "tsv"):
        from .stream import StreamTarget
        return StreamTarget(rest, scheme)
    if scheme == "spark":
        from .spark import SparkTarget
        return SparkTarget(Path(rest), master=spark_master, conf=spark_conf)
    raise UserError(f"unknown target scheme {scheme!r}: use sqlite:, spark:, jsonl: or tsv:")
