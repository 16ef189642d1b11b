"""Lookups in a Spark warehouse by value, with pyarrow on the driver.

An incremental view refresh needs a few rows out of large files: the old rows
of a transaction's changed keys, the rows an equi-join pairs with the changed
rows, the latest rows of a table's change log, and which keys the view's
storage holds among those it recomputes. The warehouse has no index, so Spark
would scan the files whole, and on a small cluster (or local mode) a Spark
job's fixed cost (stages, scheduling, a shuffle to pick each key's latest log
row) is most of a refresh. The files are on the driver's disk (the consumer
wrote the logs there a moment ago), and pyarrow reads a column of a million
rows, then the rows that match, in tens of milliseconds, one row group at a
time (memory stays bounded by a row group and the matches, and callers bound
the matches).

Keys are compared as Spark's ``<=>`` does: NULL equals NULL; -0.0 equals
0.0 and NaN equals NaN (Spark normalizes them in joins and groups). Each key
column is first made canonical, so that files written by pyarrow (logs, copied
bases) and by Spark (compacted bases, views: INT96 timestamps, other integer
widths) compare: integers, booleans, dates and timestamps (as microseconds)
become int64, floats and decimals their exact text, strings and binaries stay.
Other types (nested, intervals) have no canonical form here: callers fall back
to Spark for them.

The merge rule is the reader's (replicator.targets.spark.reader): a key's row is the
one of the latest log file holding it (none when that is a tombstone), else
the base's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from replicator.structure import TableStructure
from replicator.targets.spark.warehouse import DELETED, SEQ, Warehouse, entry_schema, physical_name, table_files
from replicator.views.keyset import Columns, KeySet, canonical, row_numbers


def parquet_files(warehouse: Warehouse, relative: Sequence[str]) -> list[Path]:
    """The Parquet files of manifest entries (a file, or a directory Spark wrote)."""
    out: list[Path] = []
    for name in relative:
        path = warehouse.file(name)
        out.extend(sorted(p for p in path.glob("*.parquet") if not p.name.startswith(("_", "."))) if path.is_dir()
                   else [path])
    return out


def parquet_handle(path: Path) -> pq.ParquetFile:
    """A Parquet file of the warehouse, opened to read its row groups. Timestamps Spark
    wrote as INT96 (compacted bases, views' files) are read in microseconds: in
    pyarrow's default nanoseconds, a year past 2262 or before 1677 (PostgreSQL's
    infinities as the warehouse keeps them) overflows."""
    return pq.ParquetFile(path, coerce_int96_timestamp_unit="us")


def parquet_table(path: Path, columns: list[str]) -> pa.Table:
    """These columns of a Parquet file of the warehouse, read whole (see parquet_handle)."""
    return parquet_handle(path).read(columns=columns)


def _columns(present: Iterable[str], schema: pa.Schema, *, flags: bool = False) -> list[str]:
    """The columns of schema a file holds (present: its column names), with the _deleted
    flag if flags."""
    names = set(present)
    return [f.name for f in schema if f.name in names] + ([DELETED] if flags else [])


def _row_groups(path: Path, schema: pa.Schema) -> Iterator[tuple[pq.ParquetFile, int, pa.Table]]:
    """Each row group's columns of the schema (the key columns, read before the rest),
    conformed to it."""
    handle = parquet_handle(path)
    names = _columns(handle.schema_arrow.names, schema)
    for i in range(handle.metadata.num_row_groups):
        yield handle, i, _conform(handle.read_row_group(i, columns=names), schema)


def _read(path: Path, schema: pa.Schema, *, flags: bool = False) -> pa.Table:
    """A file's columns of the schema conformed to it (with the _deleted flag if flags)."""
    columns = _columns(pq.read_schema(path).names, schema, flags=flags)
    return _conform(parquet_table(path, columns), schema, flags=flags)


def _conform(table: pa.Table, schema: pa.Schema, *, flags: bool = False) -> pa.Table:
    """Rows of a file in the schema: columns cast to its types (a file written by Spark
    has other timestamp units and integer widths), those it lacks (added since) NULL;
    with the file's _deleted flag if flags."""
    arrays = [table.column(f.name).cast(f.type) if f.name in table.column_names else pa.nulls(table.num_rows, f.type)
              for f in schema]
    conformed = pa.Table.from_arrays(arrays, schema=schema)
    return conformed.append_column(DELETED, table.column(DELETED)) if flags else conformed


def _hits(path: Path, schema: pa.Schema, columns: list[str],
          values: KeySet) -> Iterator[tuple[pq.ParquetFile, int, pa.ChunkedArray]]:
    """Each row group of a file holding rows whose columns (of schema) hold one of the
    values, with the mask of those rows. Only those columns are read here: the caller
    reads the rest of the few rows (_read_hits), or not at all."""
    probe = pa.schema([schema.field(c) for c in dict.fromkeys(columns)])
    for handle, i, head in _row_groups(path, probe):
        if not head.num_rows:
            continue
        mask = values.mask([head.column(c) for c in columns])
        if pc.any(mask).as_py():
            yield handle, i, mask


def _read_hits(handle: pq.ParquetFile, i: int, mask: pa.ChunkedArray, schema: pa.Schema, *,
               flags: bool = False) -> pa.Table:
    """The rows of mask of a row group (see _hits), conformed to schema (with the
    _deleted flag if flags)."""
    rows = handle.read_row_group(i, columns=_columns(handle.schema_arrow.names, schema, flags=flags)).filter(mask)
    return _conform(rows, schema, flags=flags)


def _matching(path: Path, key_names: list[str], schema: pa.Schema, wanted: KeySet, *,
              flags: bool) -> Iterator[pa.Table]:
    """The rows of a file whose key is wanted, conformed to schema (with the _deleted
    flag if flags)."""
    for handle, i, mask in _hits(path, schema, key_names, wanted):
        yield _read_hits(handle, i, mask, schema, flags=flags)


def key_columns(warehouse: Warehouse, entry: dict[str, Any], files: Sequence[str]) -> pa.Table:
    """The key columns (physical names) of some of a table entry's files."""
    structure = TableStructure.from_json(entry["structure"])
    schema = entry_schema(entry)
    keys = pa.schema([schema.field(physical_name(c)) for c in structure.key_columns()])
    tables = [_read(path, keys) for path in parquet_files(warehouse, files)]
    return pa.concat_tables(tables) if tables else keys.empty_table()


_POSITION = "_replicator_position"


class _MergedLog:
    """Rows of change log files merged as the reader merges them: a key's row is the
    one of the newest file holding it, none when that is a tombstone; the base's row of
    a key the log holds is not current.

    The rows are given file by file, newest first, each file as parts (row groups, or
    the Parquet files of a log Spark wrote) with the _deleted flag; keep picks those of
    a part that `current` may give back (all when None): the others still hide the
    older rows of their keys. Which rows are their key's newest is found once, by
    grouping all the keys read: checking each file's keys against those of the newer
    files would hash all of those again for every file (Arrow keeps no hash table
    between calls), quadratic in the number of files until compaction. A file holds a
    key once (one row per key), so its first row in that order is its newest."""

    def __init__(self, files: Iterable[list[pa.Table]], key_names: list[str],
                 keep: Callable[[pa.Table], pa.Table] | None = None) -> None:
        self.key_names = key_names
        self.keys: list[pa.Table] = []     # the key columns of every row read, part after part
        self._kept: list[pa.Table] = []    # the rows keep picked, with their position among those read
        self._files = 0                    # files holding rows: with one, its rows are all their key's newest
        read = 0
        for parts in files:   # consumed one file at a time: only the keys and the kept rows stay
            for part in parts:
                self.keys.append(part.select(key_names))
                numbered = part.append_column(_POSITION, pc.add(row_numbers(part.num_rows), read))
                self._kept.append(numbered if keep is None else keep(numbered))
                read += part.num_rows
            self._files += any(part.num_rows for part in parts)
        self._read = read

    @cached_property
    def _canonical(self) -> list[pa.ChunkedArray]:
        """The keys read, one canonical column per key column: each key made canonical
        once (the parts of one file written by Spark and pyarrow may differ in types)."""
        columns = [[chunk for part in self.keys for chunk in canonical(part.column(k)).chunks]
                   for k in self.key_names]
        return [pa.chunked_array(chunks, chunks[0].type) for chunks in columns]

    @cached_property
    def _firsts(self) -> pa.Array:
        """The position of each key's first row read, its newest (NULLs group together,
        as Spark's <=> compares them)."""
        keys = pa.table({f"k{j}": c for j, c in enumerate(self._canonical)} | {_POSITION: row_numbers(self._read)})
        # one thread: faster here than splitting the many small chunks of the parts
        return keys.group_by([f"k{j}" for j in range(len(self._canonical))], use_threads=False).aggregate(
            [(_POSITION, "min")]).column(f"{_POSITION}_min").combine_chunks()

    @cached_property
    def current(self) -> list[pa.Table]:
        """Each part's kept rows that are their key's newest and not tombstones (without
        the _deleted flag), newest file first."""
        newest = None
        if self._files > 1:   # a flag per row read, set at the firsts (numpy: Arrow has no scatter)
            flags = np.zeros(self._read, dtype=bool)
            flags[self._firsts.to_numpy()] = True
            newest = pa.array(flags)
        out = []
        for rows in self._kept:
            live = pc.invert(rows.column(DELETED))
            if newest is not None:
                live = pc.and_(live, pc.take(newest, rows.column(_POSITION)))
            out.append(rows.filter(live).drop_columns([_POSITION, DELETED]))
        return out

    @cached_property
    def settled(self) -> KeySet | None:
        """The keys the log holds (None when it holds none)."""
        if not self._read:
            return None
        if self._files == 1:
            return KeySet(self._canonical)
        return KeySet([c.take(self._firsts) for c in self._canonical])

    def unsettled(self, rows: pa.Table) -> pa.Table:
        """The rows (of the base) whose key the log does not hold: the current ones."""
        return rows if self.settled is None else self.settled.keep(rows, self.key_names, inside=False)


def old_rows(warehouse: Warehouse, entry: dict[str, Any], keys: Columns) -> pa.Table:
    """The rows a manifest table entry holds for these keys (key columns in the
    structure's key order), in its physical schema."""
    structure = TableStructure.from_json(entry["structure"])
    schema = entry_schema(entry)
    key_names = [physical_name(c) for c in structure.key_columns()]
    wanted = KeySet(keys)
    base_files, log_files = table_files(entry)
    log = _MergedLog(([*_matching(path, key_names, schema, wanted, flags=True)]
                      for path in reversed(parquet_files(warehouse, log_files))), key_names)
    found = log.current + [log.unsettled(rows) for path in parquet_files(warehouse, base_files)
                           for rows in _matching(path, key_names, schema, wanted, flags=False)]
    return pa.concat_tables(found) if found else schema.empty_table()


def logged_rows(warehouse: Warehouse, entry: dict[str, Any], log_files: Sequence[str]) -> pa.Table:
    """The rows some of a table entry's log files set (the latest of each key,
    tombstones left out), in its physical schema."""
    return logged_rows_and_keys(warehouse, entry, log_files)[0]


def logged_rows_and_keys(warehouse: Warehouse, entry: dict[str, Any],
                         log_files: Sequence[str]) -> tuple[pa.Table, pa.Table]:
    """logged_rows, and the key columns of all the files' rows (as key_columns has
    them: a key in two files is there twice), each file read once."""
    structure = TableStructure.from_json(entry["structure"])
    schema = entry_schema(entry)
    key_names = [physical_name(c) for c in structure.key_columns()]
    log = _log_of(warehouse, log_files, schema, key_names)
    keys = pa.schema([schema.field(k) for k in key_names])
    return (pa.concat_tables(log.current) if log.current else schema.empty_table(),
            pa.concat_tables(log.keys) if log.keys else keys.empty_table())


def _log_of(warehouse: Warehouse, log_files: Sequence[str], schema: pa.Schema, key_names: list[str],
            keep: Callable[[pa.Table], pa.Table] | None = None) -> _MergedLog:
    """Log files of a table read whole, merged."""
    return _MergedLog(([_read(path, schema, flags=True)] for path in reversed(parquet_files(warehouse, log_files))),
                      key_names, keep)


def rows_matching(warehouse: Warehouse, entry: dict[str, Any], columns: list[str], values: KeySet,
                  limit: int) -> pa.Table | None:
    """The current rows of a manifest table entry whose columns (physical names; any
    columns, not only the key) hold one of the values, in its physical schema; None
    when there are more than limit. Only those columns are read from the base,
    then its row groups holding a match."""
    structure = TableStructure.from_json(entry["structure"])
    schema = entry_schema(entry)
    key_names = [physical_name(c) for c in structure.key_columns()]
    base_files, log_files = table_files(entry)
    # every row of the log hides the base's row of its key, matching or not
    log = _log_of(warehouse, log_files, schema, key_names, keep=lambda rows: values.keep(rows, columns))
    found = list(log.current)
    count = sum(rows.num_rows for rows in found)
    if count > limit:
        return None
    for path in parquet_files(warehouse, base_files):
        for handle, i, mask in _hits(path, schema, columns, values):
            if count + pc.sum(mask).as_py() > limit:   # before reading the rows
                return None
            rows = log.unsettled(_read_hits(handle, i, mask, schema))
            count += rows.num_rows
            found.append(rows)
    return pa.concat_tables(found) if found else schema.empty_table()


def stored_keys(warehouse: Warehouse, entry: dict[str, Any], keys: list[str],
                wanted: list[tuple[list[str], KeySet]]) -> pa.Table:
    """The key columns of a view's stored rows (entry: its manifest entry, keys: its
    key columns) that match any of wanted: (columns, a set of their values). Only
    the key columns are read."""

    def matching(table: pa.Table) -> pa.Table:
        masks = [key_set.mask([table.column(c) for c in columns]) for columns, key_set in wanted]
        mask = masks[0]
        for other in masks[1:]:
            mask = pc.or_(mask, other)
        return table.filter(mask)

    def row_groups(path: Path) -> Iterator[pa.Table]:
        handle = parquet_handle(path)
        return (handle.read_row_group(i, columns=keys) for i in range(handle.metadata.num_row_groups))

    # a log is a directory of Parquet files (those of its upserts and of its tombstones)
    log = _MergedLog(([matching(parquet_table(path, [*keys, DELETED]))
                       for path in parquet_files(warehouse, [view_log["file"]])]
                      for view_log in reversed(entry["logs"])), keys)
    parts = log.current + [log.unsettled(matching(rows)) for path in parquet_files(warehouse, entry["base"])
                           for rows in row_groups(path)]
    found = [t for t in parts if t.num_rows] or parts[:1]
    if not found:
        return pa.table({k: pa.array([], pa.null()) for k in keys})
    return pa.concat_tables([t.cast(found[0].schema) for t in found])


def tombstones(keys: pa.Table, schema: pa.Schema, seq: int) -> pa.Table:
    """Change log rows deleting these keys: the key columns (cast to schema, the view's
    storage types) with _seq and _deleted; the value columns are left out, and Spark
    reads them as NULL."""
    arrays = [keys.column(f.name).cast(f.type) for f in schema]
    return pa.Table.from_arrays([*arrays, pa.array([seq] * keys.num_rows, pa.int64()),
                                 pa.array([True] * keys.num_rows, pa.bool_())],
                                schema=pa.schema([*schema, pa.field(SEQ, pa.int64()), pa.field(DELETED, pa.bool_())]))
