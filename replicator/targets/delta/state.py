"""The warehouse's own Delta table, ``_replicator``: consumer positions, and which version
of each table every tick left.

A batch changes several tables, each with a commit of its own; the batch is
complete when this table's commit records it:

- its application transactions are the consumers' positions (appId
  ``QUEUE/CONSUMER``, version = the last tick applied);
- its rows say, per tick, the version each table changed by the batch was left
  at (consumer, tick, table, directory, version, committed_at): reading every
  table at its version as of one tick gives them all as of that tick
  (replicator.targets.delta.reader.tables_as_of);
- its configuration ``replicator.tables`` names the directory of each table.

Rows older than the time-travel window (the table's ``delta.logRetentionDuration``)
go when its files are folded into one (compact), all but the newest of each
consumer and table: the version a tick at the window's start reads. The
positions are its transactions, kept.
"""

from __future__ import annotations

import contextlib
import io
import json
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from replicator.errors import UserError
from replicator.targets.delta import log as delta_log
from replicator.targets.delta import schema as delta_schema
from replicator.targets.delta.actions import Action, Add, Stats
from replicator.targets.delta.storage import Storage
from replicator.targets.delta.table import COMPRESSION

DIRECTORY = "_replicator"
TABLES = "replicator.tables"
# the version of a position forgotten (DeltaTarget.forget_positions): a txn action stays in the log
# whatever comes after it, so a later one says the position is gone
FORGOTTEN = -(2**63)
KIND = "replicator.tableKind"   # the kind of the warehouse's tables: "default" or "portable" (DeltaTarget)
SCHEMA = pa.schema([pa.field("consumer", pa.string()), pa.field("tick", pa.int64()),
                    pa.field("table", pa.string()), pa.field("directory", pa.string()),
                    pa.field("version", pa.int64()), pa.field("committed_at", pa.timestamp("us", tz="UTC"))])
_DELTA_SCHEMA = {"type": "struct", "fields": [
    {"name": "consumer", "type": "string", "nullable": False, "metadata": {}},
    {"name": "tick", "type": "long", "nullable": False, "metadata": {}},
    {"name": "table", "type": "string", "nullable": False, "metadata": {}},
    {"name": "directory", "type": "string", "nullable": False, "metadata": {}},
    {"name": "version", "type": "long", "nullable": False, "metadata": {}},
    {"name": "committed_at", "type": "timestamp", "nullable": False, "metadata": {}}]}


class WarehouseState:
    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.snapshot = delta_log.load(storage, DIRECTORY)

    @property
    def exists(self) -> bool:
        return self.snapshot.exists

    def positions(self) -> dict[str, int]:
        """{"QUEUE/CONSUMER": tick}, but those forgotten."""
        return {app: tick for app, tick in self.snapshot.txns.items() if tick != FORGOTTEN}

    def directories(self) -> dict[str, str]:
        """{directory: source table name} of the tables replicator keeps."""
        if not self.snapshot.exists:
            return {}
        directories: dict[str, str] = json.loads(self.snapshot.configuration.get(TABLES, "{}"))
        return directories

    def kind(self) -> str | None:
        """The kind of the warehouse's tables, recorded at its first commit (None: not yet, or
        recorded by no version before this one)."""
        return self.snapshot.configuration.get(KIND) if self.snapshot.exists else None

    def every_directory(self) -> set[str]:
        """The directories of the tables replicator keeps and of those it dropped (recorded
        in this table's rows)."""
        return set(self.directories()) | set(self.rows(["directory"]).column("directory").to_pylist())

    def rows(self, columns: list[str]) -> pa.Table:
        """This table's rows (those columns), read from its files on this thread: delta-rs'
        to_pyarrow_table() aborts a short-lived process at its exit now and then."""
        tables = []
        for path in sorted(self.snapshot.files):
            with self.storage.open_read(delta_log.table_file(self.storage, DIRECTORY, path)) as f:
                tables.append(delta_log.read_parquet(f.read(), columns))
        return pa.concat_tables(tables) if tables else SCHEMA.empty_table().select(columns)

    def commit(self, position: tuple[str, int] | None, versions: Iterable[tuple[str, str, int]],
               directories: dict[str, str], others: dict[str, int] | None = None, *, kind: str) -> None:
        """Records a transaction: the position (consumer, tick), the (table, directory, version) of
        each table it committed, and the directories of the tables as it leaves them; `others`,
        positions stored beside it (a follower's offsets). A transaction without a position (a
        table's copy) records its versions at the positions the consumers have."""
        actions: list[Action] = []
        if not self.snapshot.exists:
            actions.append({"protocol": {"minReaderVersion": 1, "minWriterVersion": 2}})
        if not self.snapshot.exists or directories != self.directories() or kind != self.kind():
            configuration = {delta_schema.LOG_RETENTION: delta_schema.LOG_RETENTION_WINDOW,
                             **self.snapshot.configuration, TABLES: json.dumps(directories, sort_keys=True),
                             KIND: kind}
            old = self.snapshot.metadata
            actions.append({"metaData": {
                "id": (old["id"] if old else "") or str(uuid.uuid4()), "name": None,
                "description": "replicator: consumer positions and the table versions of each tick",
                "format": {"provider": "parquet", "options": {}}, "schemaString": json.dumps(_DELTA_SCHEMA),
                "partitionColumns": [], "configuration": configuration,
                "createdTime": (old.get("createdTime") if old else None) or delta_log.now_ms()}})
        rows = [(consumer, tick, table, directory, version)
                for consumer, tick in ([position] if position is not None else self.positions().items())
                for table, directory, version in versions]
        if rows:
            now = datetime.fromtimestamp(delta_log.now_ms() / 1000, UTC)
            actions.append({"add": self._write(pa.Table.from_pylist(
                [{"consumer": consumer, "tick": tick, "table": table, "directory": directory, "version": version,
                  "committed_at": now} for consumer, tick, table, directory, version in rows], schema=SCHEMA))})
        for app, version in [*(others or {}).items(), *([position] if position is not None else [])]:
            actions.append({"txn": {"appId": app, "version": version, "lastUpdated": delta_log.now_ms()}})
        if not actions:
            return
        while True:
            try:
                delta_log.commit(self.storage, self.snapshot, actions, operation="WRITE")
                return
            except delta_log.CommitConflict:
                self.take_in_others()   # left to take in: an OPTIMIZE of this table; then again
            except BaseException:
                # whether the commit landed is not known: its rows file is left (VACUUM deletes it if
                # no version refers to it), and the log read again as it is now
                with contextlib.suppress(Exception):
                    self.snapshot = delta_log.load(self.storage, DIRECTORY)
                raise

    def forget(self, apps: set[str]) -> None:
        """Forgets the positions `apps`, and the rows recording table versions at their ticks (a
        follower rebuilt from topics made anew numbers its ticks anew), in a commit of its own."""
        if not apps:
            return
        rows = self.rows(SCHEMA.names).cast(SCHEMA).to_pylist()
        kept = [row for row in rows if row["consumer"] not in apps]
        now = delta_log.now_ms()
        actions: list[Action] = []
        if len(kept) < len(rows):
            actions += self._removes(now, data_change=True)
            if kept:
                actions.append({"add": self._write(pa.Table.from_pylist(kept, schema=SCHEMA))})
        actions += [{"txn": {"appId": app, "version": FORGOTTEN, "lastUpdated": now}} for app in sorted(apps)]
        delta_log.commit(self.storage, self.snapshot, actions, operation="WRITE")

    def take_in_others(self) -> None:
        """Reads the commits made by other processes since this snapshot. One with a position or
        the tables' directories is another consumer's: a warehouse has one consumer (locally its
        lock file keeps a second out; on object storage two started at once both found it
        empty), so this one stops rather than take the other's tables over."""
        commits = delta_log.refresh(self.storage, self.snapshot)
        rivals = sorted({a["txn"]["appId"] for c in commits for a in c if "txn" in a})
        if rivals or any("metaData" in a for c in commits for a in c):
            who = " ".join(["another consumer", *rivals[:1]])
            raise UserError(f"{who} writes {self.storage.url}: one consumer writes a warehouse; stop the other one")

    def kept_versions(self, window: float) -> dict[str, int]:
        """Directory → the oldest version a tick within the last `window` seconds reads: the
        one the newest row before the window records (of each consumer, the oldest). Log
        cleanup keeps it readable, though its commit may be older than the log retention
        (a table not changed since, then OPTIMIZEd)."""
        cutoff = datetime.fromtimestamp(delta_log.now_ms() / 1000 - window, UTC)
        newest: dict[tuple[str, str], tuple[int, int]] = {}
        for row in self.rows(["consumer", "directory", "tick", "version", "committed_at"]).to_pylist():
            key = (row["consumer"], row["directory"])
            if row["committed_at"] < cutoff and (row["tick"], row["version"]) > newest.get(key, (-1, -1)):
                newest[key] = (row["tick"], row["version"])
        kept: dict[str, int] = {}
        for (_, directory), (_, version) in newest.items():
            kept[directory] = min(version, kept.get(directory, version))
        return kept

    def compact(self, window: float, due: int) -> int | None:
        """Once the table has `due` files (a batch that changed tables adds one): its rows in one
        file, less those committed longer than `window` seconds ago but the newest of each
        consumer and directory (by tick, then version: the one tick_versions picks for a tick at
        the window's start). Returns the rows dropped; None when not due, or when another
        commit came first (it is done again next time)."""
        if len(self.snapshot.files) < due:
            return None
        cutoff = datetime.fromtimestamp(delta_log.now_ms() / 1000 - window, UTC)
        rows = self.rows(SCHEMA.names).cast(SCHEMA).to_pylist()
        newest: dict[tuple[str, str], dict[str, Any]] = {}
        for row in rows:
            seen = newest.get((row["consumer"], row["directory"]))
            if row["committed_at"] < cutoff and (seen is None or (row["tick"], row["version"])
                                                 > (seen["tick"], seen["version"])):
                newest[(row["consumer"], row["directory"])] = row
        kept = [row for row in rows if row["committed_at"] >= cutoff or
                newest[(row["consumer"], row["directory"])] is row]
        actions = self._removes(delta_log.now_ms(), data_change=len(kept) < len(rows))
        if kept:
            actions.append({"add": {**self._write(pa.Table.from_pylist(kept, schema=SCHEMA)),
                                    "dataChange": len(kept) < len(rows)}})
        try:
            delta_log.commit(self.storage, self.snapshot, actions, operation="OPTIMIZE",
                             parameters={"predicate": json.dumps(f"committed_at < '{_timestamp(cutoff)}'")})
        except delta_log.CommitConflict:
            if kept:
                self.storage.delete(f"{DIRECTORY}/{actions[-1]['add']['path']}")
            self.take_in_others()
            return None
        return len(rows) - len(kept)

    def _removes(self, now: int, *, data_change: bool) -> list[Action]:
        """Remove actions of every file of this table."""
        return [{"remove": {"path": path, "deletionTimestamp": now, "dataChange": data_change,
                            "extendedFileMetadata": True, "partitionValues": {},
                            "size": self.snapshot.files[path].get("size")}} for path in sorted(self.snapshot.files)]

    def _write(self, data: pa.Table) -> Add:
        """Writes rows as a new data file of this table: its add action."""
        buffer = io.BytesIO()
        pq.write_table(data, buffer, compression=COMPRESSION)
        path = f"part-00000-{uuid.uuid4()}-c000.{COMPRESSION}.parquet"
        self.storage.write(f"{DIRECTORY}/{path}", buffer.getvalue())
        # every column's bounds: delta-rs's pyarrow dataset (to_pyarrow_table(filters=...)) drops a
        # file whose statistics lack a filtered column's
        columns = data.to_pydict()
        least, most = min(columns["committed_at"]), max(columns["committed_at"])
        floor = least.replace(microsecond=least.microsecond // 1000 * 1000)   # bounds in milliseconds
        top = most.replace(microsecond=most.microsecond // 1000 * 1000)
        ceiling = top if top == most else top + timedelta(milliseconds=1)
        stats: Stats = {"numRecords": data.num_rows,
                        "minValues": {**{name: min(values) for name, values in columns.items()},
                                      "committed_at": _timestamp(floor)},
                        "maxValues": {**{name: max(values) for name, values in columns.items()},
                                      "committed_at": _timestamp(ceiling)},
                        "nullCount": {name: 0 for name in SCHEMA.names}}
        return {"path": path, "partitionValues": {}, "size": buffer.tell(), "modificationTime": delta_log.now_ms(),
                "dataChange": True, "stats": delta_log.json_text(stats)}


def _timestamp(value: datetime) -> str:
    """A timestamp as Delta statistics write it (UTC, milliseconds)."""
    return value.isoformat(timespec="milliseconds").replace("+00:00", "Z")
