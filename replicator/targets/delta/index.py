"""Where each live row of a Delta table is, by key: what makes a batch cost what it holds.

A batch's updates and deletes name rows by key; marking them deleted needs
their file and position. The index is built once per consumer run (reading the
key columns of the live files, less the rows their deletion vectors mark) and
kept current by the writer. A single integer key is held in two sorted NumPy
arrays (16 bytes a row) plus a dict of the keys written since; other keys in a
dict of canonical values (Arrow's Python values of the key columns).

A location is ``file_number << 32 | row``; a row is alive unless its file's
deletion vector (committed, or staged in the open transaction) marks it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
from pyroaring import BitMap

FOLD_AT = 1 << 20   # keys written since the build before they are folded into the sorted arrays


def canonical_keys(columns: Sequence[pa.Array | pa.ChunkedArray], integer: bool) -> Any:
    """The keys of rows given as Arrow key columns: an int64 array, or a list of values (tuples for
    several columns)."""
    if integer:
        return np.asarray(columns[0].to_numpy(zero_copy_only=False), dtype=np.int64)
    if len(columns) == 1:
        return _values(columns[0])
    return list(zip(*(_values(c) for c in columns)))


def _values(column: pa.Array | pa.ChunkedArray) -> list[Any]:
    """A key column's Python values. A float NaN is one key, as PostgreSQL and Spark compare
    it: every NaN becomes the one object math.nan (a dict finds a key by identity first;
    NaN is not equal to itself). -0.0 and 0.0 are one key already (equal, same hash)."""
    values: list[Any] = column.to_pylist()
    if pa.types.is_floating(column.type):
        return [math.nan if v != v else v for v in values]
    return values


def is_integer_key(types: Sequence[pa.DataType]) -> bool:
    return len(types) == 1 and pa.types.is_integer(types[0])


class KeyIndex:
    def __init__(self, integer: bool) -> None:
        self.integer = integer
        self.paths: list[str] = []
        self.number: dict[str, int] = {}
        self.deleted: list[BitMap] = []            # per file: committed and staged deletions
        self._keys = np.empty(0, dtype=np.int64)   # integer keys: sorted
        self._locations = np.empty(0, dtype=np.int64)
        self._recent: dict[Any, int] = {}         # keys written since the arrays were sorted (all keys otherwise)

    def add_file(self, path: str, keys: Any, deleted: BitMap | None = None) -> int:
        """Registers a file's keys (row order); rows in `deleted` are dead already."""
        number = len(self.paths)
        self.paths.append(path)
        self.number[path] = number
        self.deleted.append(BitMap(deleted) if deleted else BitMap())
        base = number << 32
        dead = self.deleted[number]
        values = keys.tolist() if isinstance(keys, np.ndarray) else keys
        for row, key in enumerate(values):
            if row not in dead:
                self._recent[key] = base | row
        if self.integer and len(self._recent) >= FOLD_AT + len(self._keys) // 4:
            self._fold()
        return number

    def build(self, files: Sequence[tuple[str, Any, BitMap | None]]) -> None:
        """Registers many files at once (path, keys, deleted), sorting integer keys once."""
        if not self.integer:
            for path, keys, deleted in files:
                self.add_file(path, keys, deleted)
            return
        all_keys, all_locations = [], []
        for path, keys, deleted in files:
            number = len(self.paths)
            self.paths.append(path)
            self.number[path] = number
            self.deleted.append(BitMap(deleted) if deleted else BitMap())
            rows = np.arange(len(keys), dtype=np.int64)
            if deleted:
                alive = np.ones(len(keys), dtype=bool)
                alive[np.fromiter(deleted, dtype=np.int64)] = False
                keys, rows = keys[alive], rows[alive]
            all_keys.append(np.asarray(keys, dtype=np.int64))
            all_locations.append(rows | (number << 32))
        if all_keys:
            keys = np.concatenate(all_keys)
            locations = np.concatenate(all_locations)
            order = np.argsort(keys, kind="stable")
            self._keys, self._locations = keys[order], locations[order]

    def _fold(self) -> None:
        """Sorts the recent keys into the arrays. A recent key's row in the arrays is dead (it
        was written again since), so it goes; dead rows of other keys may stay (locate checks)."""
        recent = {key: location for key, location in self._recent.items() if not self._dead(location)}
        keys = np.fromiter(self._recent.keys(), dtype=np.int64, count=len(self._recent))
        replaced = np.isin(self._keys, keys)
        base_keys, base_locations = self._keys[~replaced], self._locations[~replaced]
        new_keys = np.fromiter(recent.keys(), dtype=np.int64, count=len(recent))
        new_locations = np.fromiter(recent.values(), dtype=np.int64, count=len(recent))
        keys = np.concatenate([base_keys, new_keys])
        locations = np.concatenate([base_locations, new_locations])
        order = np.argsort(keys, kind="stable")
        self._keys, self._locations = keys[order], locations[order]
        self._recent = {}

    def _dead(self, location: int) -> bool:
        return (location & 0xFFFFFFFF) in self.deleted[location >> 32]

    def locate(self, keys: Any) -> list[int]:
        """The location of each key's live row, -1 where it has none."""
        found = [-1] * len(keys)
        if self.integer and len(self._keys):
            at = np.searchsorted(self._keys, keys)
            at[at >= len(self._keys)] = 0
            hit = self._keys[at] == keys
            found = np.where(hit, self._locations[at], -1).tolist()
        values = keys.tolist() if isinstance(keys, np.ndarray) else keys
        recent = self._recent
        for i, key in enumerate(values):
            location = recent.get(key)
            if location is not None:
                found[i] = location
            if found[i] >= 0 and self._dead(found[i]):
                found[i] = -1
        return found

    def move(self, moves: Sequence[tuple[str, np.ndarray, int, str, int]]) -> None:
        """Rows moved by a rewrite (OPTIMIZE): (old file, its rows kept in order, its row count,
        new file, the new file's row of the first). A dead row keeps its old location (the old
        file's deletions still say it is dead)."""
        remap: dict[int, np.ndarray] = {}
        for old_path, kept, total, new_path, offset in moves:
            old = self.number.get(old_path)
            if old is None:
                continue
            new = self.number.get(new_path)
            if new is None:
                new = self.number[new_path] = len(self.paths)
                self.paths.append(new_path)
                self.deleted.append(BitMap())
            table = np.full(total, -1, dtype=np.int64)
            table[kept] = (new << 32) | (offset + np.arange(len(kept), dtype=np.int64))
            remap[old] = table
        if not remap:
            return
        if len(self._locations):
            files = self._locations >> 32
            for old, table in remap.items():
                at = np.nonzero(files == old)[0]
                if len(at):
                    mapped = table[self._locations[at] & 0xFFFFFFFF]
                    self._locations[at] = np.where(mapped >= 0, mapped, self._locations[at])
        for key, location in self._recent.items():
            moved = remap.get(location >> 32)
            if moved is not None and moved[location & 0xFFFFFFFF] >= 0:
                self._recent[key] = int(moved[location & 0xFFFFFFFF])

    def mark_deleted(self, locations: Sequence[int]) -> dict[int, list[int]]:
        """Marks rows dead; returns the rows by file number."""
        by_file: dict[int, list[int]] = {}
        for location in locations:
            by_file.setdefault(location >> 32, []).append(location & 0xFFFFFFFF)
        for number, rows in by_file.items():
            self.deleted[number].update(rows)
        return by_file
