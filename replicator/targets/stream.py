"""Stream target: one line per change, as JSON (jsonl) or tab-separated
key/value pairs (tsv), to stdout or a file.

A file stream is exactly-once: on commit the file is flushed and synced,
then a sidecar file ``PATH.position`` records the position and the file's
length; on start the file is cut back to that length, so lines of a batch
that was not committed are written again once, never twice. On stdout nothing
is stored: every run starts, like a Debezium snapshot, with the current rows
of every table (op "R") and then follows the changes from the source
consumer's position, which a crash may leave one batch behind (at least once).
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TextIO

from replicator.errors import UserError
from replicator.structure import Change, TableStructure
from replicator.targets.files import file_changed, special_file
from replicator.targets.protocol import OldRows, Row, TargetTable, queue_positions


def _json_value(value: Any) -> Any:
    if isinstance(value, bytes):
        return "\\x" + value.hex()
    return value


def _tsv_escape(value: Any) -> str:
    if value is None:
        return "\\N"
    if isinstance(value, bytes):
        value = "\\x" + value.hex()
    return (str(value).replace("\\", "\\\\").replace("\t", "\\t")
            .replace("\n", "\\n").replace("\r", "\\r"))


_NONE = itertools.repeat(None)   # the old rows of rows that have none


def _committed_tables(state: dict[str, Any]) -> dict[str, TargetTable]:
    return {name: TargetTable(source_name=name, table_id=t["table_id"], mode=t["mode"],
                              structure=TableStructure.from_json(t["structure"]), copy_snapshot=t["copy_snapshot"])
            for name, t in state["tables"].items()}


class StreamTarget:
    copies_renamed_tables = False
    copies_over_rows = False

    def __init__(self, where: str, fmt: str) -> None:
        self.format = fmt
        self.name = f"{fmt}:{where}"
        # _state is what the last commit recorded; _tables and _positions are the open
        # batch's, set back to it by a rollback (a retried batch starts from the commit)
        self._tables: dict[str, TargetTable] = {}
        self._state: dict[str, Any] = {"positions": {}, "tables": {}, "length": 0}
        self._positions: dict[str, int] = {}
        if where == "-":
            self.exactly_once = False
            self.path: Path | None = None
            self.out: TextIO = sys.stdout
        else:
            self.exactly_once = True
            self.path = Path(where).expanduser().resolve()
            self.name = f"{fmt}:{self.path}"
            self._state_path = self.path.with_name(self.path.name + ".position")
            for name in (self.path, self._state_path):
                if kind := special_file(name):
                    raise UserError(f"cannot write a {fmt} stream to {self.path}: "
                                    f"{'it' if name == self.path else name} is {kind}, not a regular file (a file "
                                    f"stream is cut back to its last committed length on start); give the path of a "
                                    f"regular file, or stream to stdout with `--target {fmt}:-` and redirect it")
            try:
                if self._state_path.exists():
                    self._state = json.loads(self._state_path.read_text())
                self._tables = _committed_tables(self._state)
                self._positions = dict(self._state["positions"])
                length = int(self._state["length"])
                self._check_existing(length)
                self.out = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 (open while the target is)
                try:
                    fcntl.flock(self.out.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    self.out.close()
                    raise UserError(f"another consumer is writing {self.path}") from None
                self.out.truncate(length)
                self.out.seek(length)
            except OSError as exc:
                raise UserError(f"cannot write {self.path}: {exc.strerror}") from None
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise UserError(f"{self._state_path} is not a position file replicator wrote ({exc!r}): restore "
                                f"it, or stream into a new file") from None

    def _check_existing(self, length: int) -> None:
        """Refuses a file this stream did not write (no position file beside it), and one
        that lost lines its position file records: cut back to the recorded length, the
        first would lose what it holds, the second would be padded with NUL bytes."""
        assert self.path is not None
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            size = None
        if not self._state_path.exists():
            if size:
                raise UserError(f"{self.path} exists and is not a stream a consumer wrote (no {self._state_path.name} "
                                f"beside it): it is left as it is; give the stream another path")
            return
        if size is None and length:
            raise UserError(f"{self.path} is gone, but {self._state_path.name} records {length:,} bytes of it: "
                            f"put it back, or move {self._state_path} aside and run the same `replicator consume` "
                            f"again to start a new stream (every table copied anew)")
        if size is not None and size < length:
            raise UserError(f"{self.path} holds {size:,} bytes, fewer than the {length:,} its "
                            f"{self._state_path.name} records: lines are missing; it is left as it is: restore it, "
                            f"or move it and {self._state_path.name} aside and run the same `replicator consume` "
                            f"again to start a new stream (every table copied anew)")

    def _check_file(self) -> None:
        """Stops the consumer when the file it writes is no longer the one at its path
        (deleted, replaced): it would go on writing lines nobody reads."""
        assert self.path is not None
        how = file_changed(self.path, self.out.fileno())
        if how:
            how = "replaced by another file" if how == "replaced" else how
            raise UserError(f"{self.path} was {how} while the consumer was writing it; the consumer stopped before "
                            f"committing another batch: put the file back, or move it and {self._state_path.name} "
                            f"aside and run the same `replicator consume` again to start a new stream (every table "
                            f"copied anew)")

    # state -----------------------------------------------------------------------

    def positions(self, queue: str) -> dict[str, int]:
        return queue_positions(self._positions, queue)

    def queues(self) -> set[str]:
        return {key.partition("/")[0] for key in self._positions}

    def set_position(self, queue: str, consumer: str, tick_id: int) -> None:
        self._positions[f"{queue}/{consumer}"] = tick_id

    def forget_positions(self, queue: str) -> None:
        raise UserError(f"{self.name} cannot be rebuilt in place: a stream's lines, read as they come, cannot be "
                        f"taken back")

    def tables(self) -> dict[str, TargetTable]:
        return dict(self._tables)

    def save_table(self, table: TargetTable) -> None:
        self._tables[table.source_name] = table

    # transactions ------------------------------------------------------------------

    def begin(self) -> None:
        if self.path is not None:
            self._check_file()

    def commit(self) -> None:
        self.out.flush()
        state = {"positions": dict(self._positions),
                 "tables": {name: {"table_id": t.table_id, "mode": t.mode, "structure": t.structure.to_json(),
                                   "copy_snapshot": t.copy_snapshot} for name, t in self._tables.items()},
                 "length": self._state["length"]}
        if self.path is not None:
            self._check_file()
            os.fsync(self.out.fileno())
            state["length"] = self.out.tell()
            tmp = self._state_path.with_name(self._state_path.name + ".tmp")
            tmp.write_text(json.dumps(state))
            os.replace(tmp, self._state_path)
        self._state = state

    def rollback(self) -> None:
        """Back to the last commit: the file's length, and the tables and positions it
        recorded (a table copied or altered by the batch is not, so a retry does it again)."""
        if self.path is not None:
            self.out.truncate(self._state["length"])
            self.out.seek(self._state["length"])
        self._tables = _committed_tables(self._state)
        self._positions = dict(self._state["positions"])

    def close(self) -> None:
        if self.path is not None:
            self.out.close()

    # tables ------------------------------------------------------------------------

    def create_table(self, table: TargetTable) -> None:
        self.save_table(table)

    def drop_table(self, table: TargetTable) -> None:
        self._tables.pop(table.source_name, None)

    def alter_table(self, old: TargetTable, new: TargetTable, changes: list[Change]) -> None:
        self._tables.pop(old.source_name, None)
        self.save_table(new)

    def schema_event(self, table: TargetTable, event: dict[str, Any]) -> None:
        """One line per schema change, in order with the row changes. "structure"
        describes every column with its attnum, which identifies it through renames:
        a reader tells a RENAME COLUMN from a DROP and an ADD by it."""
        record = {"op": "S", "table": table.source_name,
                  **{k: event.get(k) for k in ("kind", "tag", "sql", "schema", "name", "key", "columns")}}
        if event.get("structure"):
            record["structure"] = [{k: c.get(k) for k in ("name", "attnum", "type", "not_null", "default")}
                                   for c in event["structure"]["columns"]]
        self._write(record)

    # changes -------------------------------------------------------------------------

    def _write(self, record: dict[str, Any]) -> None:
        if self.format == "jsonl":
            self.out.write(json.dumps(record, default=str, ensure_ascii=False) + "\n")
            return
        pairs: list[tuple[str, Any]] = []
        for field, value in record.items():
            if isinstance(value, dict):
                pairs.extend((f"{field}.{k}", v) for k, v in value.items())
            else:
                pairs.append((field, value))
        self.out.write("\t".join(f"{_tsv_escape(k)}\t{_tsv_escape(v)}" for k, v in pairs) + "\n")

    def _values(self, row: Row) -> list[Any]:
        return [_json_value(v) for v in row] if self.format == "jsonl" else list(row)

    def upsert(self, table: TargetTable, op: str, rows: Iterable[Row], old_rows: OldRows = None) -> None:
        """A line per row; with old rows, "old" holds the row before the change (none for a
        row whose key is new)."""
        names = table.structure.column_names
        key_positions = table.structure.key_positions()
        for row, old in zip(rows, old_rows or _NONE):
            values = self._values(row)
            record = {"op": op, "table": table.source_name, "key": {names[i]: values[i] for i in key_positions},
                      "row": dict(zip(names, values))}
            if old is not None:
                record["old"] = dict(zip(names, self._values(old)))
            self._write(record)

    def delete(self, table: TargetTable, keys: Iterable[Row], old_rows: OldRows = None) -> None:
        """A line per key; with old rows, "old" holds the row deleted."""
        key = table.structure.key
        names = table.structure.column_names
        for values, old in zip(keys, old_rows or _NONE):
            record = {"op": "D", "table": table.source_name, "key": dict(zip(key, self._values(values)))}
            if old is not None:
                record["old"] = dict(zip(names, self._values(old)))
            self._write(record)

    def truncate(self, table: TargetTable) -> None:
        self._write({"op": "T", "table": table.source_name})

    def copy_from(self, table: TargetTable, snap: Any, progress: Callable[[int], None]) -> None:
        """The consumer copies through upsert()."""
        return None
