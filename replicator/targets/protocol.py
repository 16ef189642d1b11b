"""The protocol every target implements, and what the consumer hands it.

A target holds the replica and, for exactly-once delivery, the consumer's
position, written in the same transaction as the rows it covers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

from replicator.structure import Change, TableStructure

Row = Sequence[Any]
# The old rows of an upsert's or a delete's rows, one per row (None: that row has none, e.g. the new
# row of a key change), for a table captured with --old-rows; None for other tables. Targets whose
# records have a place for them carry them (Kafka's `before`, a stream's "old"); the others ignore them.
OldRows = Sequence[Row | None] | None


@dataclass
class TargetTable:
    """What a target knows of a replicated table."""
    source_name: str             # schema.table in the source
    table_id: int                # captured table id in the queue
    mode: str                    # 'full' or 'pk'
    structure: TableStructure
    copy_snapshot: str | None    # events visible in it are already in the copy
    # the copy was written over the rows the target held, no truncate first (copies_over_rows): the
    # rows that events the copy holds removed are removed after it
    copied_over_rows: bool = False


class Target(Protocol):
    """Every method after begin() runs in the target's open transaction."""

    name: str            # a stable description, the default consumer name derives from it
    exactly_once: bool   # whether position and rows commit atomically
    # whether a renamed table is copied again rather than renamed in place (Kafka: a topic per table
    # name; the records before the rename stay on the old name's topic)
    copies_renamed_tables: bool
    # whether a table copied again after a schema change is written over the rows the target holds
    # rather than in place of them (Kafka: a sink of the topics never sees the table empty); the
    # consumer then removes the rows that events the copy holds removed (consumer._held_by_copy)
    copies_over_rows: bool

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
    def forget_positions(self, queue: str) -> None:
        """Removes every position of `queue`, in the transaction begun (a follower rebuilt in place); a
        target that cannot be rebuilt so (a stream, Kafka) refuses."""
        ...
    def create_table(self, table: TargetTable) -> None: ...
    def save_table(self, table: TargetTable) -> None: ...
    def drop_table(self, table: TargetTable) -> None: ...
    def alter_table(self, old: TargetTable, new: TargetTable, changes: list[Change]) -> None: ...
    def schema_event(self, table: TargetTable, event: dict[str, Any]) -> None: ...

    def upsert(self, table: TargetTable, op: str, rows: Iterable[Row], old_rows: OldRows = None) -> None: ...
    def delete(self, table: TargetTable, keys: Iterable[Row], old_rows: OldRows = None) -> None: ...
    def truncate(self, table: TargetTable) -> None: ...

    def copy_from(self, table: TargetTable, snap: Any, progress: Callable[[int], None]) -> int | None:
        """Copies a new table itself from the source snapshot `snap` (a
        replicator.source.table_copy.SnapshotCopy), e.g. in parallel, and returns the rows
        copied; None leaves the copy to the consumer (upsert of op 'R')."""
        ...


@runtime_checkable
class RecordsOrigin(Protocol):
    """A target whose records say where each change came from (Kafka's `source` block): the
    consumer tells it the source database and, before each event's rows, the event."""

    def origin(self, database: str, queue: str) -> None: ...

    def event(self, tick: int, ev_id: int | None, txid: int | None, ev_time: datetime | None) -> None:
        """The rows that follow come from this event of the batch ending at tick (ev_id None: rows
        read back from the source for pk-mode keys)."""
        ...


def settle(target: Target) -> None:
    """At the end of a run that stops by itself: what the target keeps behind its position (a
    Delta warehouse's views, while Spark starts) is brought up to it. Targets that keep nothing
    behind have no settle()."""
    method = getattr(target, "settle", None)
    if method is not None:
        method()


def tend(target: Target) -> None:
    """Between two steps of a run, never within a target transaction: what the target does on a
    schedule of its own (a Delta warehouse's VACUUM every --vacuum-every). Targets with nothing
    of the kind have no tend()."""
    method = getattr(target, "tend", None)
    if method is not None:
        method()


def queue_positions(positions: dict[str, int], queue: str) -> dict[str, int]:
    """The positions of `queue` among a target's positions stored as {"QUEUE/CONSUMER": tick}."""
    prefix = f"{queue}/"
    return {key[len(prefix):]: tick for key, tick in positions.items() if key.startswith(prefix)}
