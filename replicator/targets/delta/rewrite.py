"""Copy-on-write for portable tables (``delta:URI?tables=portable``): what a batch changes
is rewritten instead of marked in deletion vectors, and a column renamed or dropped
rewrites the table instead of being a metadata change of column mapping.

A file a batch deletes or replaces rows of is read, and its surviving rows are
written as a new file (nothing else: the batch's new rows are appended as one file
of their own, as on any table); the commit removes the old file and adds the new
one. The key index follows the rows moved, as after OPTIMIZE. A file the open
transaction wrote itself is superseded the same way: deleted once the transaction
ends (committed or rolled back), never before, since a commit that loses its
version to another writer is staged again from the transaction's files (and not
when views read the table: their refresh reads the rows replaced there; VACUUM
deletes it later).

The remove action of a file rewritten says so in its tags (Delta's free-form
string map): the file its surviving rows went into (none when no row survived)
and the positions of the rows it left out (a Roaring bitmap, base64). So a
reader of the log (replicator.targets.delta.changes, a view behind its table)
takes the commit for the rows it replaced, as it takes a default table's
deletion vectors, not for a table replaced; it checks the tags against the
commit and the files first (another writer's remove has none).

Renaming or dropping a column rewrites every live row under the new names: the
transaction then replaces every file (as a copy does), and cannot be staged again
over another writer's commit (it is applied again when the consumer restarts).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
from pyroaring import BitMap

from replicator.structure import TableStructure
from replicator.targets.delta import log as delta_log
from replicator.targets.delta import schema as delta_schema
from replicator.targets.delta.actions import Add, Remove
from replicator.targets.delta.index import KeyIndex
from replicator.targets.delta.storage import Storage


class Table(Protocol):
    """What a rewrite uses of a table (replicator.targets.delta.table.ReplicaTable)."""
    storage: Storage
    directory: str
    snapshot: delta_log.Snapshot
    index: KeyIndex | None

    def structure(self) -> TableStructure: ...
    def schema(self) -> dict[str, Any]: ...
    def deletion_vector(self, add: Add | Remove) -> BitMap | None: ...
    def file(self, path: str) -> str: ...
    def _write_file(self, data: pa.Table) -> str: ...


REWRITTEN_INTO = "replicator.rewrittenInto"   # remove tags: the file a rewritten file's surviving rows went into
ROWS_LEFT_OUT = "replicator.rowsLeftOut"      # and the positions of its rows left out (base64 of a Roaring bitmap)


@dataclass(frozen=True)
class Rewrite:
    """What became of a committed file the transaction rewrote: its rows, the file its surviving
    rows are in now (None: none survived), and their positions in it (kept[i]: the position in
    the committed file of the new file's row i)."""
    rows: int
    into: str | None
    kept: np.ndarray

    def tags(self) -> dict[str, str]:
        """The tags of the committed file's remove action (see the module docstring)."""
        left_out = BitMap()
        left_out.add_range(0, self.rows)
        left_out.difference_update(BitMap(self.kept.tolist()))
        tags = {ROWS_LEFT_OUT: base64.b64encode(left_out.serialize()).decode()}
        if self.into is not None:
            tags[REWRITTEN_INTO] = self.into
        return tags


def told_rewrite(remove: Remove) -> tuple[str | None, BitMap] | None:
    """What a remove action's tags say of its file's rewrite: the file its surviving rows went
    into (None: none survived) and the positions of the rows left out; None when they say
    nothing readable (another writer's remove, tags malformed). Still to be checked against
    the commit and the files (replicator.targets.delta.changes)."""
    tags = remove.get("tags") or {}
    left_out, into = tags.get(ROWS_LEFT_OUT), tags.get(REWRITTEN_INTO)
    if not isinstance(left_out, str) or not isinstance(into, (str, type(None))):
        return None
    try:
        return into, BitMap.deserialize(base64.b64decode(left_out, validate=True))
    except (binascii.Error, ValueError):
        return None


class Transaction(Protocol):
    """What a rewrite changes of the table's open transaction (replicator.targets.delta.table.Staged)."""
    new_files: dict[str, Add]
    touched: set[str]
    rewrites: dict[str, Rewrite]
    superseded: set[str]
    reset: bool
    spilled: bool


def rewrite_files(table: Table, staged: Transaction, index: KeyIndex, numbers: Iterable[int]) -> None:
    """Rewrites the files (index numbers) some of whose rows were just marked deleted: their
    survivors into a new file each; a committed file is removed by the commit, one the
    transaction wrote is superseded. What became of each committed file is kept (its remove's
    tags), through rewrites of its rewrite."""
    target = delta_schema.arrow_schema(table.structure(), table.schema())
    for number in sorted(set(numbers)):
        path = index.paths[number]
        data = _read(table, path, target)
        kept = np.setdiff1d(np.arange(data.num_rows, dtype=np.int64),
                            np.asarray(index.deleted[number].to_array(), dtype=np.int64), assume_unique=True)
        new_path = None
        if len(kept):
            new_path = table._write_file(data.take(pa.array(kept)))
            index.move([(path, kept, data.num_rows, new_path, 0)])
        if path in staged.new_files:
            del staged.new_files[path]
            staged.superseded.add(path)
            source = next((f for f, done in staged.rewrites.items() if done.into == path), None)
            if source is not None:   # a committed file's rewrite, rewritten
                done = staged.rewrites[source]
                staged.rewrites[source] = Rewrite(done.rows, new_path, done.kept[kept])
        else:
            staged.touched.add(path)   # removed by the commit, and not added again (a portable table)
            staged.rewrites[path] = Rewrite(data.num_rows, new_path, kept)


def needs_rewrite(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether a portable table's new schema renames or drops a column of the old one (its files
    hold the old names); adding a column rewrites nothing (older files lack it: NULL)."""
    names = {f["metadata"].get(delta_schema.ATTNUM): f["name"] for f in new["fields"]}
    return any(names.get(f["metadata"].get(delta_schema.ATTNUM)) != delta_schema.physical_name(f)
               for f in old["fields"])


def rewrite_table(table: Table, staged: Transaction, old: dict[str, Any], new: dict[str, Any],
                  structure: TableStructure) -> None:
    """Every live row of the table, written again under the new schema's names (columns found by
    attnum; a dropped one left out): the transaction then replaces every file, as a copy does.
    Changes still staged stay staged (they are located in the new files)."""
    before = delta_schema.arrow_schema(table.structure(), old)   # alter() sets the new structure after
    after = delta_schema.arrow_schema(structure, new)
    renamed = {f["metadata"].get(delta_schema.ATTNUM): delta_schema.physical_name(f)
               for f in new["fields"]}   # attnum → the column's new name
    index = table.index
    files: dict[str, BitMap] = {}
    if not staged.reset:
        for path, add in table.snapshot.files.items():
            if path not in staged.touched:
                files[path] = table.deletion_vector(add) or BitMap()
    for path in staged.new_files:
        files[path] = BitMap()
    for path in files:
        if index is not None and path in index.number:
            files[path] = index.deleted[index.number[path]]
    written = dict(staged.new_files)
    staged.new_files = {}
    for path, dead in files.items():
        data = _read(table, path, before)
        if dead:
            alive = np.ones(data.num_rows, dtype=bool)
            alive[np.asarray(dead.to_array(), dtype=np.int64)] = False
            data = data.filter(pa.array(alive))
        columns = {renamed[attnum]: data.column(delta_schema.physical_name(f))
                   for f in old["fields"] if (attnum := f["metadata"].get(delta_schema.ATTNUM)) in renamed}
        if data.num_rows:
            table._write_file(pa.Table.from_arrays([columns[f.name] if f.name in columns else
                                                    pa.nulls(data.num_rows, f.type) for f in after], schema=after))
    staged.superseded.update(written)
    staged.reset, staged.touched, staged.rewrites, staged.spilled = True, set(), {}, True
    table.index = None   # built from the new files when a change needs it


def _read(table: Table, path: str, schema: pa.Schema) -> pa.Table:
    """A data file's rows (all of them) in the schema (a column the file lacks: NULL)."""
    with table.storage.open_read(table.file(path)) as f:
        parquet = delta_log.parquet_file(f)
        names = file_columns(parquet.schema_arrow, [(field.name, field_id(field)) for field in schema])
        data = parquet.read(columns=[n for n in names if n is not None])
    return pa.Table.from_arrays([data.column(name).cast(field.type) if name is not None
                                 else pa.nulls(data.num_rows, field.type) for name, field in zip(names, schema)],
                                schema=schema)


def field_id(field: pa.Field) -> int | None:
    value = (field.metadata or {}).get(b"PARQUET:field_id")
    return int(value) if value is not None else None


def file_columns(file: pa.Schema, wanted: Sequence[tuple[str, int | None]]) -> list[str | None]:
    """The column of a data file holding each wanted column (its physical name, its field id),
    None where the file has none: the column with its Parquet field id (replicator writes the
    column's id, schema.parquet_field_id: a portable table's file names the column as it was
    named when the file was written, which a schema older or newer than the file's does not),
    else, in a file another writer wrote without ids, the column of its name."""
    by_id = {i: f.name for f in file if (i := field_id(f)) is not None}
    unnamed = {f.name for f in file if field_id(f) is None}
    return [by_id.get(field_id) if field_id is not None and field_id in by_id
            else name if name in unnamed else None for name, field_id in wanted]
