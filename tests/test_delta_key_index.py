"""The Delta table's key index for keys other than a single integer: 64-bit hashes, each hit
checked against the key its data file holds. Collisions are forced (every key one hash, or
four hashes for all keys) and the replica must still be the model of the source's changes
through inserts, updates, deletes, key changes, folds, OPTIMIZE's moves and a consumer started
again (the index built from the files). The tables are written by ReplicaTable as the consumer
drives it and read back with delta-rs; no PostgreSQL, no Spark."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

pytest.importorskip("deltalake")
from deltalake import DeltaTable

from replicator.structure import Column, TableStructure
from replicator.targets.delta import index as key_index
from replicator.targets.delta import maintenance
from replicator.targets.delta.index import HashedKeys, KeyIndex, key_hashes, python_keys
from replicator.targets.delta.storage import LocalStorage
from replicator.targets.delta.table import ReplicaTable


def constant_hash(columns: Any) -> np.ndarray:
    return np.zeros(len(columns[0]), dtype=np.int64)


def four_hashes(columns: Any) -> np.ndarray:
    return key_hashes(columns) & 3


# the hash -----------------------------------------------------------------------------------

def test_equal_keys_hash_alike_whatever_their_arrow_layout():
    texts = ["", "a", "abcdefgh", "abcdefghi", "x" * 17, None, "\u00fcn\u00efc\u00f8d\u00e9 \u2713"]
    plain = key_hashes([pa.array(texts)])
    assert len(set(plain.tolist())) == len(texts)
    assert (key_hashes([pa.array(texts, pa.large_string())]) == plain).all()
    assert (key_hashes([pa.chunked_array([pa.array(texts[:3]), pa.array(texts[3:])])]) == plain).all()
    assert (key_hashes([pa.array(texts).slice(2, 4)]) == plain[2:6]).all()   # an offset into the buffers
    floats = key_hashes([pa.array([0.0, -0.0, math.nan, -math.nan, float("inf"), None])]).tolist()
    assert floats[0] == floats[1] and floats[2] == floats[3] and len(set(floats)) == 4
    numbers = pa.array([1, -1, None], pa.decimal128(12, 2))
    assert (key_hashes([numbers.slice(1)]) == key_hashes([numbers])[1:]).all()


def test_a_composite_keys_columns_hash_in_order_and_null_is_a_value_of_its_own():
    a, b = pa.array(["x", "y", None, ""]), pa.array(["y", "x", "", None])
    hashes = key_hashes([a, b]).tolist()
    assert len(set(hashes)) == 4
    assert hashes[0] != key_hashes([b, a]).tolist()[0]


# the index, over files held in memory ----------------------------------------------------------

class Files:
    """Data files' key columns, read as the table reads them; counts the rows read."""

    def __init__(self) -> None:
        self.keys: dict[str, list[str]] = {}
        self.read = 0

    def add(self, index: KeyIndex, path: str, keys: list[str]) -> None:
        self.keys[path] = keys
        index.add_file(path, HashedKeys([pa.array(keys)]))

    def read_keys(self, path: str, rows: np.ndarray) -> list[Any]:
        self.read += len(rows)
        return python_keys([pa.array(self.keys[path]).take(pa.array(rows))])


def test_a_key_absent_whose_hash_live_rows_have_is_not_found(monkeypatch):
    monkeypatch.setattr(key_index, "key_hashes", constant_hash)
    files = Files()
    index = KeyIndex(False, files.read_keys)
    files.add(index, "f1", ["a", "b"])
    files.add(index, "f2", ["c"])
    assert index.locate(HashedKeys([pa.array(["c", "z", "a", "b"])])) == [1 << 32, -1, 0, 1]
    assert files.read == 3   # each live row of the hash, once


def test_two_live_keys_of_one_hash_are_told_apart_after_a_fold_and_a_move(monkeypatch):
    monkeypatch.setattr(key_index, "key_hashes", constant_hash)
    monkeypatch.setattr(key_index, "FOLD_AT", 3)
    files = Files()
    index = KeyIndex(False, files.read_keys)
    index.build([])
    files.add(index, "f1", ["a", "b"])
    index.mark_deleted(index.locate(HashedKeys([pa.array(["a"])])))   # "a" written again
    files.add(index, "f2", ["a", "c"])   # folded: "b", "a", "c" live under one hash, the first "a" dead
    assert not index._recent and len(index._keys) == 3
    files.keys["f3"] = ["x", "b"]   # OPTIMIZE: f1's live row after another file's
    index.move([("f1", np.array([1]), 2, "f3", 1)])
    assert index.locate(HashedKeys([pa.array(["a", "b", "c", "d"])])) == [1 << 32, 2 << 32 | 1, 1 << 32 | 1, -1]


# the table, as the consumer writes it ----------------------------------------------------------

TEXT = TableStructure("public", "t", (Column("k", "text", "text", "S", True, 1),
                                      Column("v", "text", "text", "S", False, 2)), ("k",))
INTEGER = TableStructure("public", "t", (Column("k", "bigint", "bigint", "N", True, 1),
                                         Column("v", "text", "text", "S", False, 2)), ("k",))
COMPOSITE = TableStructure("public", "t", (Column("a", "integer", "integer", "N", True, 1),
                                           Column("b", "text", "text", "S", True, 2),
                                           Column("v", "text", "text", "S", False, 3)), ("a", "b"))


def _key(structure: TableStructure, n: int) -> tuple[Any, ...]:
    if structure is INTEGER:
        return (n,)
    return (f"k{n}",) if structure is TEXT else (n % 7, f"b{n}")


def _replica(path: Path, structure: TableStructure) -> dict[tuple[Any, ...], str]:
    rows = pa.table(DeltaTable(str(path / "public.t")).scan().read_all()).to_pylist()
    width = len(structure.key)
    out = {tuple(r[c.name] for c in structure.columns[:width]): r["v"] for r in rows}
    assert len(out) == len(rows), f"{len(rows) - len(out)} rows with the key of another row"
    return out


@pytest.mark.parametrize(("structure", "hashing"), [
    *((structure, hashing) for structure in (TEXT, COMPOSITE) for hashing in (constant_hash, four_hashes, key_hashes)),
    (INTEGER, key_hashes)],   # (an integer key is its own code)
    ids=["text-one-hash", "text-four", "text-real", "int-text-one-hash", "int-text-four", "int-text-real", "integer"])
@pytest.mark.parametrize("portable", [False, True], ids=["default", "portable"])
def test_the_replica_is_the_model_through_changes_optimize_and_a_restart_whatever_the_hashes_collide(
        tmp_path, monkeypatch, structure, hashing, portable):
    monkeypatch.setattr(key_index, "key_hashes", hashing)
    monkeypatch.setattr(key_index, "FOLD_AT", 16)   # folds between batches
    rng = random.Random(7)
    storage = LocalStorage(tmp_path)
    meta = {"source_name": "public.t", "table_id": 1, "mode": "full", "structure": structure.to_json(),
            "copy_snapshot": None}
    table = ReplicaTable(storage, "public.t", portable=portable)
    table.reset(meta, structure)
    table.copy([(*_key(structure, n), f"v{n}") for n in range(120)])
    table.commit(None, None)
    model = {_key(structure, n): f"v{n}" for n in range(120)}
    fresh = iter(range(1000, 100000))
    gone: list[tuple[Any, ...]] = []
    for tick in range(1, 13):
        live = sorted(model)
        for key in rng.sample(live, 12):   # updates
            model[key] = f"u{tick}"
            table.change(key, False, (*key, f"u{tick}"))
        for key in rng.sample(live, 4) + gone[-2:]:   # deletes, and deletes of keys gone already
            model.pop(key, None)
            table.change(key, True, (*key, None))
            gone.append(key)
        for key in gone[:2]:   # keys deleted before, inserted again
            model[key] = f"again{tick}"
            table.change(key, False, (*key, f"again{tick}"))
        gone = gone[2:]
        for old in rng.sample(sorted(model), 3):   # key changes: the old key deleted, the new inserted
            new = _key(structure, next(fresh))
            model[new] = model.pop(old)
            table.change(old, True, (*old, None))
            table.change(new, False, (*new, model[new]))
        for _ in range(5):   # inserts
            new = _key(structure, next(fresh))
            model[new] = f"i{tick}"
            table.change(new, False, (*new, f"i{tick}"))
        table.commit("q/c", tick)
        if tick == 4:
            index = table.index
            done = maintenance.optimize_table(table, everything=True)
            assert done is not None and done.committed and table.index is index   # moved, not built again
        if tick == 8:   # the consumer started again: the index is built from the files
            table = ReplicaTable(storage, "public.t")
        assert _replica(tmp_path, structure) == model, f"after tick {tick}"


@pytest.mark.parametrize("structure", [INTEGER, TEXT], ids=["integer", "text"])
def test_the_index_of_a_table_whose_rows_come_and_go_stays_bounded(tmp_path, monkeypatch, structure):
    """A deleted row's entry stayed in the index, and every file it was told of (OPTIMIZE's removed
    ones too), until the consumer restarted: a table whose rows come and go (a queue, a window of
    recent rows) grew the consumer without bound (bin/soak: +368 MB an hour at 2,000 changes/s); then
    it held up to as many dead entries as live rows (32 bytes a row). A fold drops the entries of dead
    rows, and as many of them make one: at most FOLD_AT and a sixteenth more entries than live rows;
    the index is built again once its files are twice the table's. The deletion vector files the table
    read or wrote, one a batch, grew too: it keeps those its files use."""
    monkeypatch.setattr(key_index, "FOLD_AT", 16)
    monkeypatch.setattr(key_index, "REBUILD_FILES_AT", 8)
    storage = LocalStorage(tmp_path)
    meta = {"source_name": "public.t", "table_id": 1, "mode": "full", "structure": structure.to_json(),
            "copy_snapshot": None}

    def key(n: int) -> tuple[Any, ...]:
        return (n,) if structure is INTEGER else (f"k{n}",)

    table = ReplicaTable(storage, "public.t")
    table.reset(meta, structure)
    table.copy([(*key(n), "v") for n in range(50)])
    table.commit(None, None)
    indexes, held = set(), []
    for tick in range(1, 61):   # ten rows in, the ten oldest out: 50 rows live throughout
        for n in range(50 + 10 * (tick - 1), 50 + 10 * tick):
            table.change(key(n), False, (*key(n), f"v{tick}"))
        for n in range(10 * (tick - 1), 10 * tick):
            table.change(key(n), True, (*key(n), None))
        table.commit("q/c", tick)
        if tick % 20 == 0:
            assert maintenance.optimize_table(table, everything=True) is not None
        index = table.ensure_index()
        indexes.add(id(index))
        held.append((index.entries, len(index.paths), len(table.snapshot.files)))
        assert len(table._vectors) <= len(table.snapshot.files), f"{len(table._vectors)} vector files held"
    assert all(entries <= 50 + 16 + entries // 16 and paths <= 2 * files + 8 + 2 for entries, paths, files in held), held
    assert len(indexes) > 1   # built again as it went
    for tick in range(61, 65):   # deletes alone: a fold without a row written
        for n in range(600 + 10 * (tick - 61), 610 + 10 * (tick - 61)):
            table.change(key(n), True, (*key(n), None))
        table.commit("q/c", tick)
        index = table.ensure_index()
        assert index.entries <= index.live + 16 + index.entries // 16, (index.entries, index.live)
    assert _replica(tmp_path, structure) == {key(n): f"v{(n - 50) // 10 + 1}" for n in range(640, 650)}


TYPED = TableStructure("public", "t", (
    Column("f", "double precision", "double precision", "N", True, 1), Column("r", "real", "real", "N", True, 2),
    Column("n", "numeric(12,2)", "numeric", "N", True, 3),
    Column("ts", "timestamp with time zone", "timestamp with time zone", "D", True, 4),
    Column("d", "date", "date", "D", True, 5), Column("by", "bytea", "bytea", "U", True, 6),
    Column("flag", "boolean", "boolean", "B", True, 7), Column("s", "smallint", "smallint", "N", True, 8),
    Column("v", "text", "text", "S", False, 9)), ("f", "r", "n", "ts", "d", "by", "flag", "s"))


def test_keys_of_every_key_type_are_one_key_however_their_values_are_written(tmp_path):
    """-0.0 is 0.0, every NaN one NaN, 1.5 is 1.50 in a numeric(12,2), an instant is one whatever
    its offset: written again so, a key replaces its row (in the batch's index, and in one built
    from the files)."""
    storage = LocalStorage(tmp_path)
    meta = {"source_name": "public.t", "table_id": 1, "mode": "full", "structure": TYPED.to_json(),
            "copy_snapshot": None}
    one = (0.0, 1.0, "1.50", "2024-01-01 00:00:00+00:00", "2024-01-01", b"\x00ab", 1, 1)
    one_again = (-0.0, 1.0, "1.5", "2024-01-01 02:00:00+02:00", "2024-01-01", b"\x00ab", 1, 1)
    nan = (math.nan, math.nan, "-3.00", "1999-12-31 23:59:59.5+00:00", "1999-12-31", b"", 0, -1)
    nan_again = (-float("nan"), float("nan"), "-3", "2000-01-01 00:59:59.5+01:00", "1999-12-31", b"", 0, -1)
    other = (math.inf, -0.0, "0", "2024-01-01 00:00:00+00:00", "2024-01-02", b"\xff" * 9, 0, 7)
    table = ReplicaTable(storage, "public.t")
    table.reset(meta, TYPED)
    for key, value in ((one, "a"), (nan, "b"), (other, "c")):
        table.change(key, False, (*key, value))
    table.commit("q/c", 1)
    table.change(one_again, False, (*one_again, "a2"))
    table.change(nan_again, False, (*nan_again, "b2"))
    table.commit("q/c", 2)
    assert sorted(r["v"] for r in pa.table(DeltaTable(str(tmp_path / "public.t")).scan().read_all()).to_pylist()) \
        == ["a2", "b2", "c"]
    table = ReplicaTable(storage, "public.t")   # started again
    table.change(one, False, (*one, "a3"))
    table.change(nan_again, True, (*nan_again, None))
    table.commit("q/c", 3)
    assert sorted(r["v"] for r in pa.table(DeltaTable(str(tmp_path / "public.t")).scan().read_all()).to_pylist()) \
        == ["a3", "c"]
