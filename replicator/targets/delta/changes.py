"""What commits changed in a Delta table, and its rows read by position: the
changes a view's refresh needs, without scanning the table.

A batch's commit marks the old rows of the keys it changes in deletion vectors
and appends the new rows in a new file. So the changes between two versions
of a table are in its log: the rows a data commit marked deleted (its add
action's deletion vector less the one its remove action replaced), and the
files it added. The consumer keeps them as it commits (ReplicaTable.captures,
for the tables views read); for versions it did not keep (a view behind after
a crash, or created meanwhile) they are read from the commit files. Commits
that change no data (OPTIMIZE: ``dataChange: false``) are skipped. A portable
table's batch rewrites the files it changes (replicator.targets.delta.rewrite):
the remove of each says, in its tags, into which added file the surviving rows
went and which rows it left out, and those are the rows marked deleted (the
file they went into holds no new row). The tags are checked against the commit
and the files' row counts; a commit that removes files without re-adding them
otherwise (a copy, TRUNCATE, another writer's copy-on-write, tags that do not
check out) cannot be read as row changes: the view is refreshed in full. Rows
are read by position (pyarrow, the row groups that hold them); the files stay
on disk after OPTIMIZE or a rewrite replaced them, until VACUUM's retention.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyroaring import BitMap

from replicator.targets.delta import log as delta_log
from replicator.targets.delta import rewrite
from replicator.targets.delta import schema as delta_schema
from replicator.targets.delta.actions import Action, Add, Remove
from replicator.targets.delta.index import canonical_keys
from replicator.targets.delta.keyset import KeySet
from replicator.targets.delta.table import Captured, ReplicaTable


@dataclass
class TableChanges:
    """What the data commits of a table after one version and up to another changed."""
    table: ReplicaTable
    deleted: dict[str, BitMap] = field(default_factory=dict)   # rows marked deleted, by file
    added: dict[str, BitMap] = field(default_factory=dict)     # files added (their rows less these)
    keys: list[pa.Table] = field(default_factory=list)         # changed keys captured (key columns)
    replaced: bool = False                                      # every row removed: a copy, TRUNCATE

    @property
    def empty(self) -> bool:
        return not (self.deleted or self.added or self.keys or self.replaced)

    def changed_keys(self) -> pa.Table:
        """The changed keys (key columns, physical names; a key may be there more than once)."""
        names = key_names(self.table)
        parts = [k.rename_columns(names) for k in self.keys]
        if self.deleted:
            parts.append(read_positions(self.table, self.deleted, names))
        for path, dead in self.added.items():
            rows = read_file(self.table, path, names)
            parts.append(_alive(rows, dead))
        schema = file_schema(self.table)
        return pa.concat_tables([_conform(p, pa.schema([schema.field(n) for n in names])) for p in parts]) \
            if parts else pa.schema([schema.field(n) for n in names]).empty_table()

    def old_rows(self) -> pa.Table:
        """The rows the commits marked deleted: each changed key's row before them (and rows
        written and replaced between them)."""
        return read_positions(self.table, self.deleted)


def key_names(table: ReplicaTable) -> list[str]:
    """The physical names of the table's key columns."""
    fields = table.schema()["fields"]
    return [delta_schema.physical_name(fields[i]) for i in table.structure().key_positions()]


def file_schema(table: ReplicaTable) -> pa.Schema:
    return delta_schema.arrow_schema(table.structure(), table.schema())


def logical_names(table: ReplicaTable) -> dict[str, str]:
    """Physical column name → the column's name."""
    return {delta_schema.physical_name(f): f["name"] for f in table.schema()["fields"]}


def changes_since(table: ReplicaTable, since: int, captured: dict[int, Captured],
                  until: int | None = None) -> TableChanges | None:
    """The changes of the commits after version `since` up to `until` (the table's version):
    those captured as they were, the others read from the log. None when a commit's file is
    gone (the log was cleaned up past it)."""
    changes = TableChanges(table)
    for version in range(since + 1, (table.snapshot.version if until is None else until) + 1):
        capture = captured.get(version)
        if capture is not None:
            _add_capture(changes, capture)
            continue
        try:
            actions = delta_log.read_commit(table.storage, table.directory, version)
        except FileNotFoundError:
            return None
        _add_commit(changes, actions)
    return changes


def _add_capture(changes: TableChanges, capture: Captured) -> None:
    if capture.reset:
        changes.replaced = True
        return
    for path, rows in capture.deleted.items():
        changes.deleted.setdefault(path, BitMap()).update(rows)
    changes.keys.extend(capture.keys)


def _add_commit(changes: TableChanges, actions: list[Action]) -> None:
    """One commit's data changes (see the module docstring)."""
    removed = {a["remove"]["path"]: a["remove"] for a in actions if "remove" in a and a["remove"].get("dataChange")}
    added = {a["add"]["path"]: a["add"] for a in actions if "add" in a and a["add"].get("dataChange")}
    table = changes.table
    rewritten = _rewrites(table, {path: removed[path] for path in removed.keys() - added.keys()}, added, removed)
    if rewritten is None:
        changes.replaced = True
        return
    left_out, moved = rewritten
    for path, rows in left_out.items():
        changes.deleted.setdefault(path, BitMap()).update(rows)
    for path, add in added.items():
        now = table.deletion_vector(add) or BitMap()
        if path in removed:
            before = table.deletion_vector(removed[path]) or BitMap()
            changes.deleted.setdefault(path, BitMap()).update(now - before)
        elif path not in moved:
            changes.added[path] = now


def _rewrites(table: ReplicaTable, gone: dict[str, Remove], added: dict[str, Add],
              removed: dict[str, Remove]) -> tuple[dict[str, BitMap], set[str]] | None:
    """The files a commit removed without adding them again (gone: their remove actions), read as
    a portable table's rewrites: the rows each left out that were live before (by file), and the
    added files that hold the others (no new rows). None unless every one is a rewrite whose tags
    check out: the file it names is one the commit adds (no other rewrite's, not removed, without
    a deletion vector), the positions left out are the file's and include the rows deleted
    before, and the two files' row counts (their Parquet footers) add up."""
    left_out: dict[str, BitMap] = {}
    moved: set[str] = set()
    for path, remove in gone.items():
        told = rewrite.told_rewrite(remove)
        if told is None:
            return None
        into, dropped = told
        if into is not None and (into not in added or into in removed or into in moved
                                 or added[into].get("deletionVector")):
            return None
        before = table.deletion_vector(remove) or BitMap()
        try:
            rows = _file_rows(table, path)
            kept = _file_rows(table, into) if into is not None else 0
        except FileNotFoundError:   # VACUUM deleted it: its rows cannot be read either
            return None
        if (dropped and dropped.max() >= rows) or not before <= dropped or rows - len(dropped) != kept:
            return None
        left_out[path] = dropped - before
        if into is not None:
            moved.add(into)
    return left_out, moved


def _file_rows(table: ReplicaTable, path: str) -> int:
    """A data file's rows (deleted ones too), from its Parquet footer."""
    with table.storage.open_read(table.file(path)) as f:
        rows: int = delta_log.parquet_file(f).metadata.num_rows
    return rows


def current_rows(table: ReplicaTable, keys: pa.Table) -> pa.Table:
    """The live rows of these keys (key columns, physical names), found by the table's
    index and read by position."""
    index = table.ensure_index()
    schema = file_schema(table)
    names = key_names(table)
    columns = [keys.column(j).cast(schema.field(n).type) for j, n in enumerate(names)]
    by_file: dict[str, BitMap] = {}
    for location in index.locate(canonical_keys(columns, index.integer)):
        if location >= 0:
            by_file.setdefault(index.paths[location >> 32], BitMap()).add(location & 0xFFFFFFFF)
    return read_positions(table, by_file)


def read_positions(table: ReplicaTable, by_file: dict[str, BitMap], columns: Sequence[str] | None = None) -> pa.Table:
    """Rows of the table's files by position (file → rows), in its current schema (or
    these of its columns): only the row groups that hold them are read."""
    schema = file_schema(table)
    wanted = schema if columns is None else pa.schema([schema.field(c) for c in columns])
    parts = []
    for path, rows in by_file.items():
        if not rows:
            continue
        positions = np.fromiter(rows, dtype=np.int64, count=len(rows))
        with table.storage.open_read(table.file(path)) as f:
            parquet = delta_log.parquet_file(f)
            present = [n for n in wanted.names if n in set(parquet.schema_arrow.names)]
            start = 0
            for group in range(parquet.metadata.num_row_groups):
                size = parquet.metadata.row_group(group).num_rows
                low, high = np.searchsorted(positions, [start, start + size])
                if high > low:
                    rows_read = parquet.read_row_group(group, columns=present)
                    parts.append(_conform(rows_read.take(pa.array(positions[low:high] - start)), wanted))
                start += size
    return pa.concat_tables(parts) if parts else wanted.empty_table()


def read_file(table: ReplicaTable, path: str, columns: Sequence[str] | None = None) -> pa.Table:
    """A data file's rows (all of them: deleted ones too), in the table's current schema."""
    schema = file_schema(table)
    wanted = schema if columns is None else pa.schema([schema.field(c) for c in columns])
    with table.storage.open_read(table.file(path)) as f:
        parquet = delta_log.parquet_file(f)
        present = [n for n in wanted.names if n in set(parquet.schema_arrow.names)]
        return _conform(parquet.read(columns=present), wanted)


def rows_matching(table: ReplicaTable, wanted: Sequence[tuple[Sequence[str], KeySet]], limit: int,
                  columns: Sequence[str] | None = None) -> pa.Table | None:
    """The live rows of the table whose columns hold one of the values, for any of wanted
    (columns: physical names, values: a KeySet), in its schema (or these of its columns);
    None when there are more than limit. The columns compared are read first, then the
    row groups holding a match."""
    schema = file_schema(table)
    out = schema if columns is None else pa.schema([schema.field(c) for c in columns])
    probe = pa.schema([schema.field(c) for c in dict.fromkeys(c for names, _ in wanted for c in names)])
    found: list[pa.Table] = []
    count = 0
    for path, add in table.snapshot.files.items():
        dead = _positions(table.deletion_vector(add))
        with table.storage.open_read(table.file(path)) as f:
            parquet = delta_log.parquet_file(f)
            names = set(parquet.schema_arrow.names)
            start = 0
            for group in range(parquet.metadata.num_row_groups):
                size = parquet.metadata.row_group(group).num_rows
                head = _conform(parquet.read_row_group(group, columns=[n for n in probe.names if n in names]), probe)
                mask = None
                for keys, values in wanted:
                    hit = values.mask([head.column(c) for c in keys])
                    mask = hit if mask is None else pc.or_(mask, hit)
                assert mask is not None
                if len(dead):
                    mask = pc.and_(mask, pa.array(_live_mask(dead, start, size)))
                hits = pc.sum(mask).as_py() or 0
                if count + hits > limit:
                    return None
                if hits:
                    rows = parquet.read_row_group(group, columns=[n for n in out.names if n in names])
                    found.append(_conform(rows.filter(mask), out))
                    count += hits
                start += size
    return pa.concat_tables(found) if found else out.empty_table()


def _positions(dead: BitMap | None) -> np.ndarray:
    """A deletion vector's rows, sorted."""
    return np.asarray(dead.to_array(), dtype=np.int64) if dead else np.empty(0, dtype=np.int64)


def _live_mask(dead: np.ndarray, start: int, size: int) -> np.ndarray:
    """Which of the rows start..start+size are not among the deleted ones (sorted)."""
    alive = np.ones(size, dtype=bool)
    low, high = np.searchsorted(dead, [start, start + size])
    alive[dead[low:high] - start] = False
    return alive


def _alive(rows: pa.Table, dead: BitMap) -> pa.Table:
    if not dead:
        return rows
    return rows.filter(pa.array(_live_mask(_positions(dead), 0, rows.num_rows)))


def _conform(rows: pa.Table, schema: pa.Schema) -> pa.Table:
    """Rows in the schema: columns cast to its types, those a file lacks (added since) NULL."""
    return pa.Table.from_arrays([rows.column(f.name).cast(f.type) if f.name in rows.column_names
                                 else pa.nulls(rows.num_rows, f.type) for f in schema], schema=schema)

