"""Where each live row of a Delta table is, by key: what makes a batch cost what it holds.

A batch's updates and deletes name rows by key; marking them deleted needs
their file and position. The index is built once per consumer run (reading the
key columns of the live files, less the rows their deletion vectors mark) and
kept current by the writer. Every key is held as a 64-bit code in two sorted
NumPy arrays (16 bytes a row) plus a dict of the codes written since (folded
into the arrays from FOLD_AT on): a single integer key is its own code; any
other key (text, several columns, floats...) is its hash (key_hashes).

A hash may be shared by two keys, so a hashed key is never trusted on its hash:
every live row whose hash is the key's is a candidate, and its key is read
from its data file (only the key columns of the row groups holding candidates)
and compared with the one sought. That is exact whatever the hash: every live
row has an entry under its key's hash (entries are never overwritten while
their row lives, only dropped once it is dead), and a key has at most one live
row (the writer marks it deleted before writing the key again). The hash's
quality only sets how many candidates are read. A batch pays a read of the
key columns of the row groups its updates and deletes hit.

A location is ``file_number << 32 | row``; a row is alive unless its file's
deletion vector (committed, or staged in the open transaction) marks it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
from pyroaring import BitMap

# Keys written since the arrays were sorted are in a dict (about 100 bytes each) until FOLD_AT plus a
# sixteenth of the arrays' rows, then folded into them (a sort of the arrays): about 6 bytes a row of a
# large table, 6.5 MB for a small one. The entries of dead rows (deleted, or written again) go at a fold,
# which as many rows marked dead start too: at most a sixteenth more entries than live rows, and FOLD_AT.
FOLD_AT = 1 << 16
# the files it knows (OPTIMIZE's removed ones too) past twice the table's, at which it is built again
REBUILD_FILES_AT = 1000
HASH_SLICE = 1 << 16   # rows hashed at once (the temporary arrays are a few times the slice's bytes)

# what reads the keys of rows of a data file (path, sorted rows), as canonical_keys gives them
KeyReader = Callable[[str, np.ndarray], list[Any]]

_U64 = np.uint64
_M1, _M2 = _U64(0xBF58476D1CE4E5B9), _U64(0x94D049BB133111EB)
_GOLDEN = _U64(0x9E3779B97F4A7C15)
_LENGTH_SALT = _U64(0x243F6A8885A308D3)
_NULL = _U64(0x6A09E667F3BCC909)   # a NULL's code: any value may share it (hashes are checked)
_ALL = _U64(0xFFFFFFFFFFFFFFFF)


class HashedKeys:
    """Keys other than a single integer: their hashes, and their Arrow columns (for the values of
    those whose hash the index holds, compared with the rows' keys)."""

    def __init__(self, columns: Sequence[pa.Array | pa.ChunkedArray]) -> None:
        self.columns = list(columns)
        self.hashes = key_hashes(columns)

    def __len__(self) -> int:
        return len(self.hashes)

    def values(self, rows: np.ndarray) -> list[Any]:
        """The keys of these rows, as Python values (canonical: see _values)."""
        indices = pa.array(rows, type=pa.int64())
        return python_keys([c.take(indices) for c in self.columns])


Keys = np.ndarray | HashedKeys


def canonical_keys(columns: Sequence[pa.Array | pa.ChunkedArray], integer: bool) -> Keys:
    """The keys of rows given as Arrow key columns (of the table's key types): an int64 array
    for a single integer key, else HashedKeys."""
    if integer:
        return np.asarray(columns[0].to_numpy(zero_copy_only=False), dtype=np.int64)
    return HashedKeys(columns)


def key_codes(keys: Keys) -> np.ndarray:
    """The int64 codes the index holds: integer keys themselves, other keys' hashes."""
    return keys.hashes if isinstance(keys, HashedKeys) else keys


def python_keys(columns: Sequence[pa.Array | pa.ChunkedArray]) -> list[Any]:
    """Keys as Python values: a column's values, tuples for several columns."""
    if len(columns) == 1:
        return _values(columns[0])
    return list(zip(*(_values(c) for c in columns)))


def _values(column: pa.Array | pa.ChunkedArray) -> list[Any]:
    """A key column's Python values. A float NaN is one key, as PostgreSQL and Spark compare
    it: every NaN becomes the one object math.nan (tuples compare by identity first; NaN is
    not equal to itself). -0.0 and 0.0 are one key already (equal)."""
    values: list[Any] = column.to_pylist()
    if pa.types.is_floating(column.type):
        return [math.nan if v != v else v for v in values]
    return values


def same_key(a: Any, b: Any) -> bool:
    return a is b or bool(a == b)


def is_integer_key(types: Sequence[pa.DataType]) -> bool:
    return len(types) == 1 and pa.types.is_integer(types[0])


# hashing ----------------------------------------------------------------------------------

def key_hashes(columns: Sequence[pa.Array | pa.ChunkedArray]) -> np.ndarray:
    """A 64-bit hash of each row's key (int64), computed from the columns' Arrow buffers with
    NumPy: keys equal as Python values (python_keys) hash alike. Each column's values give a
    code (an integer's bits; a float's, -0.0 and NaN made one; a string's bytes hashed a word at
    a time; NULL a constant), and the codes are mixed in column order. The columns must be of
    the table's key types (callers cast them): the codes are of the values' bytes in that type.
    The index needs the hash stable within a process only (it is built once per run); these are
    stable across processes too, but for a type hashed by Python's hash (none a key column has)."""
    hashed: np.ndarray | None = None
    for column in columns:
        codes = column_codes(column)
        hashed = _mix(codes + _GOLDEN) if hashed is None else _mix(hashed * _GOLDEN + codes)
    if hashed is None:
        return np.empty(0, dtype=np.int64)
    return hashed.view(np.int64)


def column_codes(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A uint64 code of each value: equal values, equal codes."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    parts = [_codes(chunk.slice(start, HASH_SLICE)) for chunk in chunks
             for start in range(0, len(chunk), HASH_SLICE)]
    return np.concatenate(parts) if parts else np.empty(0, dtype=_U64)


def _codes(array: pa.Array) -> np.ndarray:
    typ = array.type
    if array.null_count == len(array):   # its buffers may be absent
        return np.full(len(array), _NULL, dtype=_U64)
    if (pa.types.is_string(typ) or pa.types.is_binary(typ) or pa.types.is_large_string(typ)
            or pa.types.is_large_binary(typ)):
        codes = _bytes_codes(array)
    elif pa.types.is_floating(typ):
        values = np.asarray(array.to_numpy(zero_copy_only=False), dtype=np.float64)   # float32: exact
        values = np.where(np.isnan(values), np.nan, values) + 0.0   # one NaN; -0.0 + 0.0 is 0.0
        codes = values.view(_U64)
    elif pa.types.is_boolean(typ):
        codes = np.asarray(array.fill_null(False).to_numpy(zero_copy_only=False), dtype=_U64)
    elif _fixed_width(typ):   # integers, dates, timestamps, decimals: their bytes
        codes = _fixed_codes(array, typ.bit_width // 8)
    else:   # no other type is a key column's (replicator.targets.delta.schema): Python's hash, within a process
        codes = np.fromiter((hash(v) for v in _values(array)), dtype=np.int64, count=len(array)).view(_U64)
    if array.null_count:
        valid = np.asarray(array.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
        codes = np.where(valid, codes, _NULL)
    return codes


def _fixed_width(typ: pa.DataType) -> bool:
    try:
        width: int = typ.bit_width
        fields: int = typ.num_fields
    except ValueError:
        return False
    return width % 8 == 0 and fields == 0


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 that spreads every input bit."""
    x = x ^ (x >> _U64(30))
    x = x * _M1
    x = x ^ (x >> _U64(27))
    x = x * _M2
    mixed: np.ndarray = x ^ (x >> _U64(31))
    return mixed


def _fixed_codes(array: pa.Array, width: int) -> np.ndarray:
    n = len(array)
    raw = np.frombuffer(array.buffers()[1], dtype=np.uint8)[array.offset * width:(array.offset + n) * width]
    words = -(-width // 8)
    padded = np.zeros((n, words * 8), dtype=np.uint8)
    padded[:, :width] = raw.reshape(n, width)
    values = padded.view(_U64)   # (n, words)
    if words == 1:
        return values[:, 0].copy()
    salt = np.arange(1, words + 1, dtype=_U64) * _GOLDEN
    return _mix(_mix(values + salt).sum(axis=1, dtype=_U64))


def _bytes_codes(array: pa.Array) -> np.ndarray:
    """A code of each value's bytes: the sum of its 8-byte words, each mixed with its place,
    mixed with its length. The words are read from the data buffer at any byte offset (two
    aligned words shifted together); bytes past a value's end are masked."""
    n = len(array)
    large = pa.types.is_large_string(array.type) or pa.types.is_large_binary(array.type)
    buffers = array.buffers()
    offsets = np.frombuffer(buffers[1], dtype=np.int64 if large else np.int32)[array.offset:array.offset + n + 1]
    offsets = offsets.astype(np.int64)
    start = int(offsets[0]) if n else 0
    ends = offsets - start
    size = int(ends[-1]) if n else 0
    padded = np.zeros((size // 8 + 2) * 8, dtype=np.uint8)
    if size:
        padded[:size] = np.frombuffer(buffers[2], dtype=np.uint8)[start:start + size]
    aligned = padded.view(_U64)
    lengths = np.diff(ends)
    counts = (lengths + 7) // 8
    first = np.cumsum(counts) - counts   # each value's first word among all words
    value = np.repeat(np.arange(n), counts)
    place = np.arange(len(value)) - first[value]
    at = ends[:-1][value] + 8 * place   # the word's byte offset
    word_at = at >> 3
    shift = ((at & 7) << 3).astype(_U64)
    # (x << 1) << (63 - s) is x << (64 - s), and 0 for s = 0 (a shift by 64 is undefined)
    words = (aligned[word_at] >> shift) | ((aligned[word_at + 1] << _U64(1)) << (_U64(63) - shift))
    left = ends[1:][value] - at
    mask = np.where(left >= 8, _ALL, (_U64(1) << (np.minimum(left, 7) * 8).astype(_U64)) - _U64(1))
    mixed = _mix((words & mask) + (place.astype(_U64) + _U64(1)) * _GOLDEN)
    sums = np.zeros(len(mixed) + 1, dtype=_U64)
    np.cumsum(mixed, out=sums[1:])
    total = sums[first + counts] - sums[first]
    return _mix(total ^ _mix(lengths.astype(_U64) + _LENGTH_SALT))


# the index --------------------------------------------------------------------------------

class KeyIndex:
    def __init__(self, integer: bool, read_keys: KeyReader | None = None) -> None:
        """read_keys: what reads rows' keys from a data file, to check a hashed key's candidates
        (needed unless integer)."""
        assert integer or read_keys is not None, "hashed keys are checked against their files"
        self.integer = integer
        self.read_keys = read_keys
        self.paths: list[str] = []
        self.number: dict[str, int] = {}
        self.deleted: list[BitMap] = []            # per file: committed and staged deletions
        self._keys = np.empty(0, dtype=np.int64)   # codes (integer keys or hashes): sorted
        self._locations = np.empty(0, dtype=np.int64)
        self._recent: dict[int, int] = {}         # codes written since the arrays were sorted
        # hashed keys: the further live rows of a code _recent holds for another row (a collision)
        self._shared: dict[int, list[int]] = {}
        self._shared_rows = 0
        self.live = 0                              # rows alive among those it holds an entry of
        # the rows marked dead since the arrays were sorted (then every entry of the arrays was alive)
        self._marked: list[np.ndarray] = []
        self._marked_rows = 0

    def add_file(self, path: str, keys: Keys, deleted: BitMap | None = None) -> int:
        """Registers a file's keys (row order); rows in `deleted` are dead already."""
        number = len(self.paths)
        self.paths.append(path)
        self.number[path] = number
        self.deleted.append(BitMap(deleted) if deleted else BitMap())
        base = number << 32
        dead = self.deleted[number]
        recent = self._recent
        for row, code in enumerate(key_codes(keys).tolist()):
            if row in dead:
                continue
            self.live += 1
            if not self.integer:
                held = recent.get(code)
                if held is not None and not self._dead(held):   # another key's live row: both stay
                    self._shared.setdefault(code, []).append(base | row)
                    self._shared_rows += 1
                    continue
            recent[code] = base | row
        if len(recent) + self._shared_rows >= FOLD_AT + len(self._keys) // 16:
            self._fold()
        return number

    def build(self, files: Sequence[tuple[str, np.ndarray, BitMap | None]]) -> None:
        """Registers many files at once (path, key codes (key_codes), deleted), sorting them once.
        Hashed keys may share a code: the arrays then hold it once per live row."""
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
            self.live += len(rows)
        if all_keys:
            keys = np.concatenate(all_keys)
            locations = np.concatenate(all_locations)
            order = np.argsort(keys, kind="stable")
            self._keys, self._locations = keys[order], locations[order]

    def _fold(self) -> None:
        """Sorts the live rows of the recent codes into the arrays, whose entries of dead rows go. (Hashed
        keys: a code written again may also be another key's, still alive, and stays then.)"""
        entries = [*self._recent.items(), *((code, location) for code, locations in self._shared.items()
                                            for location in locations)]
        entries = [(code, location) for code, location in entries if not self._dead(location)]
        keys, locations = self._keys, self._locations
        if self._marked:
            alive = ~np.isin(locations, np.concatenate(self._marked))
            keys, locations = keys[alive], locations[alive]
        keys = np.concatenate([keys, np.fromiter((c for c, _ in entries), dtype=np.int64, count=len(entries))])
        locations = np.concatenate([locations, np.fromiter((loc for _, loc in entries), dtype=np.int64,
                                                           count=len(entries))])
        if entries:
            order = np.argsort(keys, kind="stable")
            keys, locations = keys[order], locations[order]
        self._keys, self._locations = keys, locations
        self._recent, self._shared, self._shared_rows = {}, {}, 0
        self._marked, self._marked_rows = [], 0

    def _dead(self, location: int) -> bool:
        return (location & 0xFFFFFFFF) in self.deleted[location >> 32]

    def locate(self, keys: Keys) -> list[int]:
        """The location of each key's live row, -1 where it has none."""
        if isinstance(keys, HashedKeys):
            return self._locate_hashed(keys)
        found = [-1] * len(keys)
        if len(self._keys):
            at = np.searchsorted(self._keys, keys)
            at[at >= len(self._keys)] = 0
            hit = self._keys[at] == keys
            found = np.where(hit, self._locations[at], -1).tolist()
        recent = self._recent
        for i, key in enumerate(keys.tolist()):
            location = recent.get(key)
            if location is not None:
                found[i] = location
            if found[i] >= 0 and self._dead(found[i]):
                found[i] = -1
        return found

    def _locate_hashed(self, keys: HashedKeys) -> list[int]:
        """Each key's candidates (the live rows of its hash), checked against their files' keys."""
        codes = keys.hashes
        sought: list[int] = []      # (which key, a candidate row of it), as two lists
        candidates: list[int] = []
        if len(self._keys):
            low = np.searchsorted(self._keys, codes, side="left")
            counts = np.searchsorted(self._keys, codes, side="right") - low
            which = np.repeat(np.arange(len(codes)), counts)
            at = np.repeat(low - (np.cumsum(counts) - counts), counts) + np.arange(len(which))
            sought, candidates = which.tolist(), self._locations[at].tolist()
        recent, shared = self._recent, self._shared
        if recent:
            for i, code in enumerate(codes.tolist()):
                location = recent.get(code)
                if location is not None:
                    sought.append(i)
                    candidates.append(location)
                    for location in shared.get(code, ()):
                        sought.append(i)
                        candidates.append(location)
        pairs = [(i, location) for i, location in zip(sought, candidates) if not self._dead(location)]
        found = [-1] * len(codes)
        if not pairs:
            return found
        stored = self._stored_keys(sorted({location for _, location in pairs}))
        asked = sorted({i for i, _ in pairs})
        wanted = dict(zip(asked, keys.values(np.asarray(asked, dtype=np.int64))))
        for i, location in pairs:
            if found[i] < 0 and same_key(wanted[i], stored[location]):
                found[i] = location
        return found

    def _stored_keys(self, locations: list[int]) -> dict[int, Any]:
        """The keys of rows (sorted locations) as their data files hold them, a file read at a time."""
        assert self.read_keys is not None
        out: dict[int, Any] = {}
        where = np.asarray(locations, dtype=np.int64)
        numbers = where >> 32
        for number in np.unique(numbers).tolist():
            at = where[numbers == number]
            values = self.read_keys(self.paths[number], at & 0xFFFFFFFF)
            out.update(zip(at.tolist(), values))
        return out

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

        def moved(location: int) -> int:
            table = remap.get(location >> 32)
            if table is not None and table[location & 0xFFFFFFFF] >= 0:
                return int(table[location & 0xFFFFFFFF])
            return location

        for key, location in self._recent.items():
            self._recent[key] = moved(location)
        for key, locations in self._shared.items():
            self._shared[key] = [moved(location) for location in locations]

    def mark_deleted(self, locations: Sequence[int]) -> dict[int, list[int]]:
        """Marks rows dead; returns the rows by file number."""
        if len(locations):
            self._marked.append(np.asarray(locations, dtype=np.int64))
            self._marked_rows += len(locations)
        by_file: dict[int, list[int]] = {}
        for location in locations:
            by_file.setdefault(location >> 32, []).append(location & 0xFFFFFFFF)
        for number, rows in by_file.items():
            held = len(self.deleted[number])
            self.deleted[number].update(rows)
            self.live -= len(self.deleted[number]) - held
        # (at least its dead entries: a key written again while in the dict leaves none, but is marked)
        if self._marked_rows >= FOLD_AT + len(self._keys) // 16:
            self._fold()
        return by_file

    def rebuild_due(self, files: int) -> bool:
        """Whether the index is to be built again (from a table of `files` files): every file it was told
        of stays until then, OPTIMIZE's removed ones too. Built again once they are twice the table's
        (and REBUILD_FILES_AT): a build's cost, reading every file's keys, is then paid by as many files."""
        return len(self.paths) > 2 * files + REBUILD_FILES_AT

    @property
    def entries(self) -> int:
        """The rows it holds an entry of, live or dead."""
        return len(self._keys) + len(self._recent) + self._shared_rows
