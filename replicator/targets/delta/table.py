"""One replicated table as a Delta table: its changes staged in the open transaction,
then committed as one Delta commit.

Merge-on-read with deletion vectors: a batch's upserts are appended as one new
data file, and the rows they replace and the rows deleted are marked in the
deletion vectors of their files (replicator.targets.delta.index finds them by
key). Nothing is rewritten, so a batch costs what it holds, however large the
table. Compaction (replicator.targets.delta.maintenance) folds small files and
purges deletion vectors later. A portable table (``delta:URI?tables=portable``)
has no deletion vectors: the files a batch touches are rewritten instead
(replicator.targets.delta.rewrite).

The commit carries the transaction id ``txn(appId=QUEUE/CONSUMER, version=TICK)``:
a table whose recorded version is at or past a batch's tick has that batch
already, and the batch is skipped for it (a retry after a crash is a no-op).
Replaying a batch over a table that holds part of it is harmless: a change sets
a key's whole row, so the end state is the same.

A table views read keeps what each commit changed (``captures``: the rows it
marked deleted, by file and position, and the changed keys), so that the views
are refreshed without reading the table; other tables keep nothing.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from functools import partial
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyroaring import BitMap

from replicator.errors import UserError
from replicator.structure import TableStructure
from replicator.targets.arrow import arrow_array
from replicator.targets.delta import deletion_vectors as dv
from replicator.targets.delta import log as delta_log
from replicator.targets.delta import rewrite
from replicator.targets.delta import schema as delta_schema
from replicator.targets.delta.actions import Action, Add, Metadata, Remove, Stats, configuration_of
from replicator.targets.delta.index import KeyIndex, canonical_keys, is_integer_key, key_codes, python_keys
from replicator.targets.delta.storage import Storage

FILE_ROWS = 1 << 20          # rows per data file of a copy (Spark reads a file per task: large files read fastest)
ROW_GROUP = 131072
COMPRESSION = "zstd"         # the data files' Parquet codec (Spark, delta-rs and Polars read it: tested)
SPILL_KEYS = 500_000         # changed keys staged per table before they are written out mid-transaction
COMMIT_ATTEMPTS = 5
APPEND_ONLY = "delta.appendOnly"
COLUMN_MAPPING = "delta.columnMapping.mode"


@dataclass
class _Writing:
    """A data file being written (a copy's rows)."""
    path: str
    stack: contextlib.ExitStack
    writer: pq.ParquetWriter
    counter: CountingWriter
    rows: int = 0
    stats: list[Stats] = field(default_factory=list)   # per row group


@dataclass
class Staged:
    """What the open transaction does to the table."""
    meta: dict[str, Any] | None = None              # the TargetTable's record, when it changes
    structure: TableStructure | None = None          # the table's structure as the transaction leaves it
    schema: dict[str, Any] | None = None             # a new schema (metaData)
    max_column_id: int = 0
    reset: bool = False                              # every committed file removed (a copy, TRUNCATE, drop)
    dropped: bool = False
    fresh: bool = False                              # made where no table was: its log's ticks are not its own
    copy_rows: list[Sequence[Any]] = field(default_factory=list)
    writing: _Writing | None = None
    new_files: dict[str, Add] = field(default_factory=dict)   # path → add action, written
    changes: dict[Any, tuple[bool, Sequence[Any]]] = field(default_factory=dict)   # key → (deleted, row)
    touched: set[str] = field(default_factory=set)   # committed files whose deletion vector grows
    spilled: bool = False
    superseded: set[str] = field(default_factory=set)   # files it wrote, then rewrote (portable): deleted at its end
    rewrites: dict[str, rewrite.Rewrite] = field(default_factory=dict)   # touched files rewritten (portable)
    vector_file: str | None = None                   # the deletion vectors of the commit being made
    deleted_rows: dict[str, list[int]] = field(default_factory=dict)   # captured: rows marked deleted, by file
    changed_keys: list[pa.Table] = field(default_factory=list)          # captured: key columns of the changes


@dataclass
class Captured:
    """What one commit of a table did, for the views that read it: the rows it marked
    deleted (the old rows of the keys it changed, and rows the same transaction wrote
    and replaced), by file and row; the changed keys (key columns, physical names);
    whether it removed every row (a copy, TRUNCATE, drop)."""
    version: int
    deleted: dict[str, list[int]]
    keys: list[pa.Table]
    reset: bool


class CountingWriter(io.RawIOBase):
    """Counts the bytes written through it (a data file's size, for its add action)."""

    def __init__(self, out: IO[bytes]) -> None:
        self.out, self.size = out, 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.size += len(data)
        self.out.write(data)
        return len(data)


class ReplicaTable:
    """A Delta table at `directory` of the warehouse; see the module docstring."""

    def __init__(self, storage: Storage, directory: str, snapshot: delta_log.Snapshot | None = None, *,
                 portable: bool = False) -> None:
        self.storage = storage
        self.directory = directory
        self.snapshot = snapshot or delta_log.load(storage, directory)
        self._new_portable = portable   # the kind of the table when this creates it; an existing one keeps its own
        self.index: KeyIndex | None = None
        self.staged: Staged | None = None
        # the table's metaData as of the consumer's position, when a crash left it holding a batch
        # past it: the batch is applied again in the structure it was captured in (DeltaTarget)
        self.rewound: Metadata | None = None
        self._vectors: dict[str, bytes] = {}   # deletion vector files read
        self.captures: list[Captured] | None = None   # what each commit did, while views read the table

    # what is committed -------------------------------------------------------------------

    @property
    def meta(self) -> dict[str, Any] | None:
        """The TargetTable record (None: not a table replicator keeps, or dropped)."""
        if not self.snapshot.exists:
            return None
        metadata = self.rewound if self.rewound is not None else self.snapshot.metadata
        text = configuration_of(metadata).get(delta_schema.TABLE_META)
        return json.loads(text) if text else None

    @property
    def portable(self) -> bool:
        """Written without column mapping and deletion vectors (replicator.targets.delta.rewrite)."""
        if self.snapshot.exists and self.snapshot.protocol:
            return delta_schema.is_portable(self.snapshot.protocol)
        return self._new_portable

    def structure(self) -> TableStructure:
        if self.staged is not None and self.staged.structure is not None:
            return self.staged.structure
        meta = self.meta
        assert meta is not None, f"{self.directory} is not a replicated table"
        return TableStructure.from_json(meta["structure"])

    def schema(self) -> dict[str, Any]:
        if self.staged is not None and self.staged.schema is not None:
            return self.staged.schema
        if self.rewound is not None:
            schema: dict[str, Any] = json.loads(self.rewound["schemaString"])
            return schema
        return self.snapshot.schema

    def applied(self, app: str) -> int | None:
        """The last tick of consumer `app` ("QUEUE/CONSUMER") the table holds."""
        return self.snapshot.txns.get(app)

    def deletion_vector(self, add: Add | Remove) -> BitMap | None:
        descriptor = add.get("deletionVector")
        if not descriptor:
            return None
        return dv.read(descriptor, self._read_vector_file)

    def release_unused(self) -> None:
        """After a commit (its own, or OPTIMIZE's): what the table holds in memory that the new version
        does not need goes. The key index, once it holds more old files than it is worth
        (KeyIndex.rebuild_due: built again when next needed); the deletion vector files read or written
        that the table's files no longer use (a batch writes one: every one was kept for the consumer's
        life, and a Delta consumer grew by ~4 MB a minute under bin/soak; one needed again, an older
        version's for a view, is read again)."""
        if self.index is not None and self.index.rebuild_due(len(self.snapshot.files)):
            self.index = None
        used = {dv.descriptor_file(descriptor) for add in self.snapshot.files.values()
                if (descriptor := add.get("deletionVector"))}
        self._vectors = {name: data for name, data in self._vectors.items() if name in used}

    def _read_vector_file(self, named: str) -> bytes:
        data = self._vectors.get(named)
        if data is None:
            data = self._vectors[named] = self.storage.read(self.file(named))
        return data

    def file(self, path: str) -> str:
        """The storage path of a file the table's log names (an add's path: a URI)."""
        return delta_log.table_file(self.storage, self.directory, path)

    # the transaction ----------------------------------------------------------------------

    def _stage(self) -> Staged:
        if self.staged is None:
            self.staged = Staged(max_column_id=delta_schema.max_column_id(self.snapshot.metadata))
        return self.staged

    def reset(self, meta: dict[str, Any], structure: TableStructure) -> None:
        """The table anew (a copy follows, or TRUNCATE): every row removed, the schema the
        structure's (fresh column ids when the structure is not the table's)."""
        staged = self._stage()
        self._discard_files(staged)
        # a dropped table's directory, taken again, has a log but no structure: every column new
        same = (self.snapshot.exists and self.meta is not None and not staged.reset
                and structure == self.structure())
        schema, staged.max_column_id = delta_schema.table_schema(
            structure, None if not self.snapshot.exists else self.schema(), staged.max_column_id, fresh=not same,
            portable=self.portable)
        staged.schema, staged.structure, staged.meta = schema, structure, meta
        staged.reset, staged.dropped = True, False
        staged.changes, staged.touched, staged.rewrites, staged.copy_rows = {}, set(), {}, []
        self.index = None   # built from the transaction's files when a change needs it

    def truncate(self) -> None:
        staged = self._stage()
        structure = self.structure()
        meta = staged.meta if staged.meta is not None else self.meta
        assert meta is not None
        self.reset(meta, structure)

    def drop(self) -> None:
        """Removes every row, and the table from what replicator keeps (its log stays: time travel)."""
        self.truncate()
        staged = self._stage()
        staged.dropped = True

    def alter(self, meta: dict[str, Any], structure: TableStructure) -> None:
        """A new structure in place (columns added, dropped, renamed): a metadata commit; the
        staged rows follow the new column order."""
        staged = self._stage()
        self._close_copy_file(staged)
        old = self.structure()
        if old != structure:
            positions = {c.attnum: i for i, c in enumerate(old.columns)}
            def moved(row: Sequence[Any]) -> list[Any]:
                return [row[positions[c.attnum]] if c.attnum in positions else None for c in structure.columns]
            staged.changes = {k: (deleted, moved(row)) for k, (deleted, row) in staged.changes.items()}
            staged.copy_rows = [moved(row) for row in staged.copy_rows]
        schema, staged.max_column_id = delta_schema.table_schema(structure, self.schema(), staged.max_column_id,
                                                                 fresh=False, portable=self.portable)
        # no column mapping: a column renamed or dropped is renamed or dropped in the files
        if self.portable and rewrite.needs_rewrite(self.schema(), schema):
            rewrite.rewrite_table(self, staged, self.schema(), schema, structure)
        staged.schema, staged.structure, staged.meta = schema, structure, meta

    def set_meta(self, meta: dict[str, Any]) -> None:
        staged = self._stage()
        staged.meta = meta
        if staged.schema is None:
            staged.schema = self.schema()

    def copy(self, rows: Sequence[Sequence[Any]]) -> None:
        """Rows of a copy (after reset): written into large data files as they come."""
        staged = self._stage()
        staged.copy_rows.extend(rows)
        if len(staged.copy_rows) >= ROW_GROUP:
            self._write_copy_rows(staged)

    def take_files(self, files: Sequence[tuple[str, int, Stats]]) -> None:
        """Data files written for the transaction by others (a parallel copy's workers, after
        reset()): (path in the table's directory, size, statistics) each, added by its commit,
        deleted by its rollback."""
        staged = self._stage()
        # no index yet: one built later, when a change needs it, reads these files' keys too
        assert staged.reset and self.index is None, "a copy's files are taken right after reset()"
        for path, size, stats in files:
            staged.new_files[path] = self._add_action(path, size, stats)

    def change(self, key: Any, deleted: bool, row: Sequence[Any]) -> None:
        staged = self._stage()
        staged.changes[key] = (deleted, row)
        if len(staged.changes) >= SPILL_KEYS:
            self._apply_changes(staged)
            staged.spilled = True

    def add_files(self, adds: dict[str, Add]) -> None:
        """Data files another writer (Spark) wrote into the table's directory, added by the
        transaction (path → add action; the table's columns by their physical names)."""
        staged = self._stage()
        self._close_copy_file(staged)
        staged.new_files.update(adds)
        self.index = None   # their keys are read when next needed

    def rollback(self) -> None:
        staged, self.staged = self.staged, None
        if staged is None:
            return
        self._discard_files(staged)
        self.index = None   # it holds the transaction's deletions and files: built again when needed

    def _abandon(self) -> None:
        """Ends the transaction after a commit whose outcome is not known (replicator.targets.delta.log
        commit: an error it could not resolve): its version may exist and refer to the files the
        transaction wrote, so they are left (VACUUM deletes them if no version does), not rolled
        back; the table is read again from its log, as it is now."""
        self.staged, self.index = None, None
        with contextlib.suppress(Exception):   # unreadable now: it is read again at the next start
            self.snapshot = delta_log.load(self.storage, self.directory)

    def _discard_files(self, staged: Staged) -> None:
        """Deletes the data files the transaction wrote (no version refers to them: the
        transaction never committed, or lost its version to another writer)."""
        writing, staged.writing = staged.writing, None
        if writing is not None:
            with contextlib.suppress(Exception):
                writing.writer.close()
            with contextlib.suppress(Exception):
                writing.stack.close()
            self.storage.delete(f"{self.directory}/{writing.path}")
        for path in staged.new_files.keys() | staged.superseded:
            self.storage.delete(f"{self.directory}/{path}")
        staged.new_files, staged.superseded = {}, set()

    # writing ------------------------------------------------------------------------------

    def _integer_key(self, structure: TableStructure, schema: dict[str, Any]) -> bool:
        types = [f.type for f in delta_schema.arrow_schema(structure, schema)]
        positions = structure.key_positions()
        # NULL is no integer: a key column that may be NULL (a view's) is kept as values
        return is_integer_key([types[i] for i in positions]) and not any(schema["fields"][i]["nullable"]
                                                                         for i in positions)

    def _arrow(self, rows: Sequence[Sequence[Any]]) -> pa.Table:
        structure, schema = self.structure(), self.schema()
        target = delta_schema.arrow_schema(structure, schema)
        columns = list(zip(*rows)) if rows else [() for _ in structure.columns]
        arrays = [arrow_array(values, f.type, label=f"{structure.qualified_name}.{column.name}")
                  for values, f, column in zip(columns, target, structure.columns)]
        return pa.Table.from_arrays(arrays, schema=target)

    def _new_path(self) -> str:
        return f"part-00000-{uuid.uuid4()}-c000.{COMPRESSION}.parquet"

    def _write_copy_rows(self, staged: Staged) -> None:
        if not staged.copy_rows:
            return
        data = self._arrow(staged.copy_rows)
        staged.copy_rows = []
        if staged.writing is None:
            path = self._new_path()
            stack = contextlib.ExitStack()
            try:
                out = stack.enter_context(self.storage.open_write(f"{self.directory}/{path}"))
                counter = CountingWriter(out)
                writer = pq.ParquetWriter(counter, data.schema, compression=COMPRESSION)
            except BaseException:
                stack.close()
                raise
            staged.writing = _Writing(path, stack, writer, counter)
        writing = staged.writing
        writing.writer.write_table(data, row_group_size=ROW_GROUP)
        writing.rows += data.num_rows
        writing.stats.append(file_stats(data))
        if writing.rows >= FILE_ROWS:
            self._close_copy_file(staged)

    def _close_copy_file(self, staged: Staged) -> None:
        self._write_copy_rows(staged)
        writing, staged.writing = staged.writing, None
        if writing is None:
            return
        writing.writer.close()
        writing.stack.close()
        staged.new_files[writing.path] = self._add_action(writing.path, writing.counter.size,
                                                           merged_stats(writing.stats))

    def _write_file(self, data: pa.Table) -> str:
        path = self._new_path()
        with self.storage.open_write(f"{self.directory}/{path}") as out:
            counter = CountingWriter(out)
            pq.write_table(data, counter, compression=COMPRESSION, row_group_size=ROW_GROUP)
        staged = self._stage()
        staged.new_files[path] = self._add_action(path, counter.size, file_stats(data))
        return path

    def _add_action(self, path: str, size: int, stats: Stats) -> Add:
        return {"path": path, "partitionValues": {}, "size": size, "modificationTime": delta_log.now_ms(),
                "dataChange": True, "stats": delta_log.json_text(stats)}

    def ensure_index(self) -> KeyIndex:
        """The index of the live rows: committed files (less a reset's) and the transaction's."""
        if self.index is not None:
            return self.index
        structure, schema = self.structure(), self.schema()
        file_schema = delta_schema.arrow_schema(structure, schema)
        key_fields = [file_schema.field(i) for i in structure.key_positions()]
        index = KeyIndex(self._integer_key(structure, schema), partial(self._row_keys, key_fields))
        staged = self.staged
        files: list[tuple[str, np.ndarray, BitMap | None]] = []
        committed = {} if staged is not None and staged.reset else self.snapshot.files
        for path, add in committed.items():
            files.append((path, self._file_keys(path, key_fields, index.integer), self.deletion_vector(add)))
        for path in (staged.new_files if staged is not None else {}):
            files.append((path, self._file_keys(path, key_fields, index.integer), None))
        index.build(files)
        self.index = index
        return index

    def _file_keys(self, path: str, key_fields: list[pa.Field], integer: bool) -> np.ndarray:
        """The key codes (index.key_codes) of a data file's rows (key_fields: the table's Arrow fields,
        with their Parquet field ids; rewrite.file_columns finds them; a file written before a key
        column existed has none: NULL). Cast to the table's types: another writer's file may hold
        others (Spark's INT96 timestamps are naive), and keys compare by value and type."""
        with self.storage.open_read(self.file(path)) as f:
            parquet = delta_log.parquet_file(f)
            names = rewrite.file_columns(parquet.schema_arrow, [(k.name, rewrite.field_id(k)) for k in key_fields])
            table = parquet.read(columns=[n for n in names if n is not None])
            rows = parquet.metadata.num_rows
        columns = [table.column(n).cast(k.type) if n is not None else pa.nulls(rows, k.type)
                   for n, k in zip(names, key_fields)]
        return key_codes(canonical_keys(columns, integer))

    def _row_keys(self, key_fields: list[pa.Field], path: str, rows: np.ndarray) -> list[Any]:
        """The keys of rows of a data file (sorted positions) as Python values (index.python_keys),
        read as _file_keys reads them, but only the row groups that hold the rows: what the key
        index checks a hashed key's candidates against."""
        with self.storage.open_read(self.file(path)) as f:
            parquet = delta_log.parquet_file(f)
            names = rewrite.file_columns(parquet.schema_arrow, [(k.name, rewrite.field_id(k)) for k in key_fields])
            present = [n for n in names if n is not None]
            parts = []
            start = 0
            for group in range(parquet.metadata.num_row_groups):
                size = parquet.metadata.row_group(group).num_rows
                low, high = np.searchsorted(rows, [start, start + size])
                if high > low and present:
                    read = parquet.read_row_group(group, columns=present)
                    parts.append(read.take(pa.array(rows[low:high] - start)))
                start += size
        found = pa.concat_tables(parts) if parts else None
        columns = [found.column(n).cast(k.type) if found is not None and n is not None
                   else pa.nulls(len(rows), k.type) for n, k in zip(names, key_fields)]
        return python_keys(columns)

    def _apply_changes(self, staged: Staged) -> None:
        """The staged changes into files and deletion vectors: the rows they replace or delete
        marked deleted, the new rows written as one data file."""
        self._close_copy_file(staged)
        if not staged.changes:
            return
        changes, staged.changes = list(staged.changes.values()), {}
        self._apply(staged, self._arrow([row for _, row in changes]),
                    pa.array([not deleted for deleted, _ in changes], type=pa.bool_()))

    def change_rows(self, upserts: pa.Table, deleted: pa.Table) -> None:
        """Changes given as Arrow tables (a view's recomputed rows): rows to upsert (the
        table's columns, in order, one row per key) and keys to delete (its key columns,
        in key order, none of the upserted keys), applied at once."""
        staged = self._stage()
        self._apply_changes(staged)
        target = delta_schema.arrow_schema(self.structure(), self.schema())
        rows = pa.Table.from_arrays([c.cast(f.type) for c, f in zip(upserts.columns, target)], schema=target)
        key_of = {i: j for j, i in enumerate(self.structure().key_positions())}
        gone = pa.Table.from_arrays([deleted.column(key_of[i]).cast(f.type) if i in key_of else
                                     pa.nulls(deleted.num_rows, f.type) for i, f in enumerate(target)], schema=target)
        self._apply(staged, pa.concat_tables([rows, gone]),
                    pa.array([True] * rows.num_rows + [False] * gone.num_rows, type=pa.bool_()))

    def _apply(self, staged: Staged, data: pa.Table, upsert: pa.Array) -> None:
        """Rows of changed keys (upsert: which are upserts, the others deletions): the rows
        they replace or delete marked deleted, the upserts written as one data file."""
        index = self.ensure_index()
        positions = self.structure().key_positions()
        keys = canonical_keys([data.column(i) for i in positions], index.integer)
        located = [location for location in index.locate(keys) if location >= 0]
        if self.captures is not None:
            where = np.asarray(located, dtype=np.int64)
            numbers = where >> 32
            for number in np.unique(numbers).tolist():
                rows = (where[numbers == number] & 0xFFFFFFFF).tolist()
                staged.deleted_rows.setdefault(index.paths[number], []).extend(rows)
            staged.changed_keys.append(data.select(positions))
        marked = index.mark_deleted(located)
        if self.portable:
            rewrite.rewrite_files(self, staged, index, marked)
        else:
            staged.touched.update(index.paths[n] for n in marked if index.paths[n] not in staged.new_files)
        upserts = data.filter(upsert)
        if upserts.num_rows:
            path = self._write_file(upserts)
            index.add_file(path, canonical_keys([upserts.column(i) for i in positions], index.integer))

    def check_writable(self, actions: Sequence[Action] = ()) -> None:
        """Refuses, in one line, a table another writer left as replicator cannot write it: a Delta
        feature replicator does not write, column mapping other than by name, columns that are not
        its PostgreSQL table's; and, when given the actions of a commit, rows removed from an
        append-only table (Delta's rule: an append-only table takes only rearranging removes)."""
        where = f"{self.storage.url}/{self.directory}"
        spark = f"ALTER TABLE delta.`{where}`"
        unsupported = delta_schema.unsupported_features(self.snapshot.protocol)
        if unsupported:
            names = ", ".join(unsupported)
            raise UserError(f"{where} has the Delta table feature {names}, which another writer enabled and "
                            f"replicator does not write: remove it (Spark: {spark} DROP FEATURE {unsupported[0]})")
        configuration = self.snapshot.configuration if self.snapshot.exists else {}
        if configuration.get(APPEND_ONLY, "false").lower() == "true" and any(
                a["remove"].get("dataChange", True) for a in actions if "remove" in a):
            raise UserError(f"{where} has {APPEND_ONLY} = true, which another writer set: replicator updates and "
                            f"deletes rows there; unset it (Spark: {spark} SET TBLPROPERTIES "
                            f"('{APPEND_ONLY}' = 'false'))")
        if self.meta is None or (self.staged is not None and self.staged.reset):   # a copy writes the table anew
            return
        mode, wanted = configuration.get(COLUMN_MAPPING, "none"), "none" if self.portable else "name"
        features = delta_schema.reader_features(self.snapshot.protocol)
        if mode != wanted or (not self.portable and "deletionVectors" not in features):
            how = "without column mapping" if self.portable else "by name mapping, with deletion vectors"
            # a portable table's copy keeps the protocol Spark upgraded (column mapping's reader version)
            recopy = "" if self.portable else ", or copy the table anew (consume --recopy)"
            raise UserError(f"{where} has {COLUMN_MAPPING} = {mode}, which another writer set: replicator writes "
                            f"the table's columns {how}; set it back (Spark: {spark} SET TBLPROPERTIES "
                            f"('{COLUMN_MAPPING}' = '{wanted}')){recopy}")
        changed = self._foreign_columns()
        if changed:
            raise UserError(f"{where}: another writer changed its columns ({changed}); replicator writes the "
                            f"columns of its PostgreSQL table: undo the change (Spark: RESTORE TABLE "
                            f"delta.`{where}` TO VERSION AS OF the version before it), or copy the table anew "
                            f"(consume --recopy)")

    def _foreign_columns(self) -> str:
        """The committed schema's columns that are not its committed structure's, in order (another
        writer's ADD, DROP, reordering): '' when there are none. A column is known by its attnum;
        a rename keeps it (and its physical name: files read the same), a type change needs the
        typeWidening feature (refused as such)."""
        meta = json.loads(self.snapshot.configuration[delta_schema.TABLE_META])
        columns = TableStructure.from_json(meta["structure"]).columns
        fields = self.snapshot.schema["fields"]
        ours = [c.attnum for c in columns]
        theirs = [f["metadata"].get(delta_schema.ATTNUM) for f in fields]
        changes = [f"{f['name']} added" for f, attnum in zip(fields, theirs) if attnum not in ours]
        changes += [f"{c.name} dropped" for c in columns if c.attnum not in theirs]
        if not changes and ours != theirs:
            changes.append("columns reordered")
        return ", ".join(changes)

    def _check_latest(self, actions: Sequence[Action] = ()) -> None:
        """check_writable; a refusal over a version another writer has committed past is a conflict
        instead: the commit reads theirs and checks the table again (what was refused may be undone)."""
        try:
            self.check_writable(actions)
        except UserError:
            if self.storage.exists(delta_log.commit_path(self.directory, self.snapshot.version + 1)):
                raise delta_log.CommitConflict(f"{self.directory} has commits of another writer past version "
                                               f"{self.snapshot.version}") from None
            raise

    def taken_in(self, commits: list[list[Action]]) -> None:
        """Other writers' commits, read into the snapshot (a maintenance commit that lost its
        version): what depends on the table's state is derived again before the next commit: the
        key index (their files, their deletion vectors: built again when next needed), and
        whether replicator may still write the table."""
        if commits:
            self.index = None
            self.check_writable()

    def _actions(self, staged: Staged, app: str | None, tick: int | None) -> list[Action]:
        self._apply_changes(staged)
        actions: list[Action] = []
        if staged.schema is not None or staged.meta is not None:
            schema = staged.schema or self.schema()
            protocol = delta_schema.protocol(schema, self.snapshot.protocol, portable=self.portable)
            if protocol != self.snapshot.protocol:
                actions.append({"protocol": protocol})
            meta = staged.meta if staged.meta is not None else self.meta
            assert meta is not None
            metadata = delta_schema.metadata(self.snapshot.metadata, schema, staged.max_column_id, meta,
                                             meta.get("description") or
                                             f"PostgreSQL table {meta.get('source_name', '')}, replicated by "
                                             f"replicator", portable=self.portable)
            if staged.dropped:
                metadata["configuration"].pop(delta_schema.TABLE_META, None)
            actions.append({"metaData": metadata})
        now = delta_log.now_ms()
        index = self.index
        if staged.reset:
            actions += [{"remove": _remove(add, now)} for add in self.snapshot.files.values()]
        for path in sorted(staged.touched):
            add = self.snapshot.files[path]
            assert index is not None
            remove = _remove(add, now)
            if self.portable:   # rewritten: the tags say into which file, and which rows it left out
                remove["tags"] = staged.rewrites[path].tags()
            actions.append({"remove": remove})
        vectors = dv.VectorFile()
        for path in sorted(staged.touched) if not self.portable else ():   # a portable table's are rewritten
            add = self.snapshot.files[path].copy()
            assert index is not None
            add["deletionVector"] = vectors.add(index.deleted[index.number[path]])
            add["dataChange"] = True
            add["stats"] = self._stats_with_deletions(path, add)
            actions.append({"add": add})
        for path, add in staged.new_files.items():
            deleted = index.deleted[index.number[path]] if index is not None and path in index.number else None
            if deleted:
                add = {**add, "deletionVector": vectors.add(deleted), "stats": self._stats_with_deletions(path, add)}
            actions.append({"add": add})
        if len(vectors.data) > 1:
            self.storage.write(f"{self.directory}/{vectors.name}", bytes(vectors.data))
            self._vectors[vectors.name] = bytes(vectors.data)
            staged.vector_file = vectors.name
        if app is not None and tick is not None:
            actions.append({"txn": {"appId": app, "version": tick, "lastUpdated": now}})
        return actions

    def _stats_with_deletions(self, path: str, add: Add) -> str:
        """A file's stats once rows of it are marked deleted: its bounds loose (they may no longer
        be reached), and numRecords, which Delta requires of a file with a deletion vector, read
        from the file's footer when the writer that added it left it out (exact: the physical rows)."""
        text = add.get("stats")
        stats = json.loads(text) if text else {}
        if "numRecords" not in stats:
            with self.storage.open_read(self.file(path)) as f:
                stats["numRecords"] = pq.ParquetFile(f).metadata.num_rows
        stats["tightBounds"] = False
        return delta_log.json_text(stats)

    def commit(self, app: str | None, tick: int | None, *, retry: bool = True,
               parameters: dict[str, Any] | None = None) -> int | None:
        """Commits the staged work (with the transaction id when tick is given); returns the
        new version, None when there was nothing to commit. When another writer took the
        version, the work is staged again over its commit, or with retry False
        CommitConflict is raised (the staged work is kept: roll it back). parameters:
        the commit's operationParameters."""
        staged = self.staged
        if staged is None:
            return None
        self._close_copy_file(staged)
        for attempt in range(COMMIT_ATTEMPTS):
            changes, files = dict(staged.changes), dict(staged.new_files)
            captured = ({path: list(rows) for path, rows in staged.deleted_rows.items()}, list(staged.changed_keys))
            try:
                self._check_latest()   # again over each other writer's commit read (a feature it added...)
                actions = self._actions(staged, app, tick)
                if not actions:
                    self.staged = None
                    return None
                self._check_latest(actions)
                operation = ("CREATE OR REPLACE TABLE" if staged.reset and not self.snapshot.exists else
                             "WRITE" if staged.reset else "MERGE" if staged.touched or staged.new_files else
                             "SET TBLPROPERTIES")
                version = delta_log.commit(self.storage, self.snapshot, actions, operation=operation,
                                           parameters=parameters)
            except delta_log.CommitUnknown:   # a UserError, but its version may refer to the files
                self._abandon()
                raise
            except UserError:   # a refusal: nothing was committed
                self._discard_attempt(staged, files)
                raise
            except delta_log.CommitConflict:
                self._discard_attempt(staged, files)
                if not retry:
                    raise
                self._after_conflict(staged, app, attempt)
                # the changes are located again over the other writer's commit (and captured again)
                staged.changes = changes
                staged.deleted_rows, staged.changed_keys = captured
                continue
            except BaseException:
                self._abandon()
                raise
            self.staged = None
            self.rewound = None
            self.release_unused()
            if self.captures is None:   # else views read the rows it replaced there: VACUUM deletes them later
                for path in staged.superseded - staged.new_files.keys():
                    self.storage.delete(f"{self.directory}/{path}")
            if self.captures is not None:
                self.captures.append(Captured(version, staged.deleted_rows, staged.changed_keys, staged.reset))
            return version
        raise UserError(f"{self.directory}: {COMMIT_ATTEMPTS} commits in a row lost to other writers of the table")

    def _discard_attempt(self, staged: Staged, files: dict[str, Add]) -> None:
        """Deletes what a commit that lost its version wrote: its deletion vectors, and the data
        file of the changes it applied (files: the transaction's files before it)."""
        if staged.vector_file is not None:
            self.storage.delete(f"{self.directory}/{staged.vector_file}")
            self._vectors.pop(staged.vector_file, None)
            staged.vector_file = None
        for path in staged.new_files.keys() - files.keys():
            self.storage.delete(f"{self.directory}/{path}")
        staged.new_files = files

    def _after_conflict(self, staged: Staged, app: str | None, attempt: int) -> None:
        """Another writer committed first: read what it did, and stage the work again over it
        (the transaction's files are kept; its deletion vectors are recomputed)."""
        record = self.meta
        commits = delta_log.refresh(self.storage, self.snapshot)
        # another consumer of the queue (the same one run twice, or two started on a new warehouse
        # at once): its batches or its copy of the table (a record of its own) are not to be taken over
        queue = None if app is None else app.partition("/")[0]
        rivals = sorted({a["txn"]["appId"] for c in commits for a in c
                         if "txn" in a and a["txn"]["appId"].partition("/")[0] == queue})
        if rivals or (self.meta != record and _metadata_by_replicator(commits)):
            who = " ".join(["another consumer", *rivals[:1]])
            raise UserError(f"{who} writes {self.storage.url}/{self.directory}: one consumer writes a warehouse's "
                            f"tables; stop the other one")
        if self.meta != record:   # Spark's REPLACE TABLE, a RESTORE to before a schema change of the source
            raise UserError(f"{self.storage.url}/{self.directory}: its {delta_schema.TABLE_META} record was changed "
                            f"by another writer; copy the table again: `replicator consume ... --recopy`")
        if staged.spilled:
            raise UserError(f"{self.directory} was changed by another writer during a large batch; the batch is "
                            f"applied again when the consumer is started again")
        # the deletions staged so far were located in files that may be gone: start over from the changes
        self.index = None
        staged.touched, staged.rewrites = set(), {}


def _metadata_by_replicator(commits: list[list[Action]]) -> bool:
    """Whether one of these commits that set the table's metaData is replicator's (another consumer's copy)."""
    return any(any("metaData" in a for a in commit)
               and any(a.get("commitInfo", {}).get("engineInfo") == delta_log.ENGINE for a in commit)
               for commit in commits)


def _remove(add: Add, now: int) -> Remove:
    remove: Remove = {"path": add["path"], "deletionTimestamp": now, "dataChange": True, "extendedFileMetadata": True,
              "partitionValues": add.get("partitionValues", {}), "size": add.get("size")}
    if add.get("deletionVector"):
        remove["deletionVector"] = add["deletionVector"]
    return remove


STRING_BOUND_MAX = 64   # code points of a string bound: a longer minimum is cut to its prefix, a longer
                        # maximum to its prefix with the last character raised (the prefix itself is smaller)
_LAST_CODE_POINT = 0x10FFFF
_SURROGATES = range(0xD800, 0xE000)


def file_stats(data: pa.Table) -> Stats:
    """A data file's statistics (keyed by physical names, as column mapping has them): row and null
    counts, and the bounds of the columns whose values compare in Spark as in Arrow. A bound bounds
    every value of its column (readers skip the file by it); one that cannot be given is left out,
    which readers take as unknown."""
    minimum, maximum, nulls = {}, {}, {}
    for name, column in zip(data.column_names, data.columns):
        nulls[name] = column.null_count
        low, high = _bounds(column)
        if low is not None:
            minimum[name] = low
        if high is not None:
            maximum[name] = high
    return {"numRecords": data.num_rows, "minValues": minimum, "maxValues": maximum, "nullCount": nulls}


def _bounds(column: pa.ChunkedArray) -> tuple[Any, Any]:
    """(lower bound, upper bound) of a column's values, each None when there is none to give."""
    typ = column.type
    if not (pa.types.is_integer(typ) or pa.types.is_floating(typ) or pa.types.is_date(typ)
            or pa.types.is_timestamp(typ) or pa.types.is_string(typ)
            or (pa.types.is_decimal(typ) and typ.precision <= 15)):
        return None, None
    if pa.types.is_floating(typ) and pc.any(pc.is_nan(column)).as_py():   # NaN: above every number to readers
        return None, None
    found = pc.min_max(column).as_py()
    low, high = found["min"], found["max"]
    if low is None:
        return None, None
    if pa.types.is_floating(typ):   # JSON has no infinities; a zero bound holds both zeros (-0.0 < 0.0 to DataFusion)
        low, high = (-0.0 if low == 0 else low), (0.0 if high == 0 else high)
        return (None if math.isinf(low) else low), (None if math.isinf(high) else high)
    if pa.types.is_string(typ):
        return low[:STRING_BOUND_MAX], _string_ceiling(high)
    if pa.types.is_timestamp(typ):   # statistics hold milliseconds: the bounds widen to them
        floor = high.replace(microsecond=high.microsecond // 1000 * 1000)
        try:
            ceiling = _timestamp(floor if floor == high else floor + timedelta(milliseconds=1), typ)
        except OverflowError:   # within a millisecond of year 9999's end ('infinity'): no upper bound to give
            ceiling = None
        return _timestamp(low.replace(microsecond=low.microsecond // 1000 * 1000), typ), ceiling
    return _json(low), _json(high)


def _timestamp(value: datetime, typ: pa.TimestampType) -> str:
    """A timestamp bound as Delta statistics write it (milliseconds; UTC with Z for a timestamp with
    a time zone)."""
    return value.replace(tzinfo=None).isoformat(timespec="milliseconds") + ("Z" if typ.tz else "")


def _string_ceiling(value: str) -> str | None:
    """An upper bound of `value` of at most STRING_BOUND_MAX code points: the value, or its prefix
    with the last character that can be raised raised (larger in code point order, which is UTF-8's
    byte order, Spark's and delta-rs' string order); None when every character is the last one."""
    if len(value) <= STRING_BOUND_MAX:
        return value
    prefix = value[:STRING_BOUND_MAX]
    for end in range(len(prefix), 0, -1):
        point = ord(prefix[end - 1]) + 1
        if point in _SURROGATES:
            point = _SURROGATES.stop
        if point <= _LAST_CODE_POINT:
            return prefix[:end - 1] + chr(point)
    return None


def merged_stats(parts: Sequence[Stats]) -> Stats:
    """The statistics of a file written in parts (row groups; file_stats each). A column's bound is
    the parts' only when every part holding a value of the column has one: a part without (NaN, a
    timestamp at year 9999's end) leaves the file without it, never bounded by the others'."""
    minimum: dict[str, Any] = {}
    maximum: dict[str, Any] = {}
    nulls: dict[str, Any] = {}
    unbounded: set[tuple[str, str]] = set()
    for part in parts:
        for name, count in part["nullCount"].items():
            nulls[name] = nulls.get(name, 0) + count
            if count == part["numRecords"]:   # NULLs only: nothing to bound
                continue
            for kind, pick, merged, values in (("min", min, minimum, part["minValues"]),
                                               ("max", max, maximum, part["maxValues"])):
                value = values.get(name)
                if value is None:
                    unbounded.add((kind, name))
                    merged.pop(name, None)
                elif (kind, name) not in unbounded:
                    old = merged.get(name)
                    merged[name] = value if old is None else pick(old, value)
    return {"numRecords": sum(part["numRecords"] for part in parts), "minValues": minimum, "maxValues": maximum,
            "nullCount": nulls}


def _json(value: Any) -> Any:
    if isinstance(value, Decimal):
        return float(value)
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return value
