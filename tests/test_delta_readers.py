"""What reads the warehouse's tables, as docs/delta.md's "Readers" table says: each reader
given a table the real consumer wrote from real PostgreSQL (inserts, updates, deletes, key
changes, a column renamed and one dropped), default (`delta:PATH`) or portable
(`delta:PATH?tables=portable`), either gives the source's rows, compared value by value
through the oracle of tests/test_delta_target.py, or refuses the table (the readers that
lack deletion vectors or column mapping, on a default table).
"""

from __future__ import annotations

import base64
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from pyroaring import BitMap

pytest.importorskip("deltalake")
pytest.importorskip("polars")
import deltalake
import polars as pl

from consumer_helpers import forced_tick, run_cli
from replicator.errors import UserError
from replicator.structure import Column, TableStructure
from replicator.targets.delta import log as delta_log
from replicator.targets.delta import maintenance
from replicator.targets.delta import table as delta_table
from replicator.targets.delta.reader import table_uris
from replicator.targets.delta.state import WarehouseState
from replicator.targets.delta.storage import LocalStorage
from replicator.targets.delta.table import ReplicaTable
from replicator.targets.delta.target import DeltaTarget
from test_delta_target import (
    CRASH_DDL,
    assert_equal_to_source,
    consume_cli,
    diff,
    primary_key,
    referenced_files,
    source_state,
    table_files,
)

State = tuple[list[str], dict[tuple[Any, ...], dict[str, Any]]]


def _query_builder(uri: str) -> pa.Table:
    return pa.table(deltalake.QueryBuilder().register("t", deltalake.DeltaTable(uri))
                    .execute("SELECT * FROM t").read_all())


READERS: dict[str, Callable[[str], pa.Table]] = {
    "delta-rs QueryBuilder": _query_builder,
    "delta-rs to_pyarrow_table": lambda uri: deltalake.DeltaTable(uri).to_pyarrow_table(),
    "delta-rs to_pyarrow_dataset": lambda uri: deltalake.DeltaTable(uri).to_pyarrow_dataset().to_table(),
    "Polars read_delta": lambda uri: pl.read_delta(uri).to_arrow(),
    "Polars scan_delta": lambda uri: pl.scan_delta(uri).collect().to_arrow(),
}
# docs/delta.md's "Readers" table: which readers read a table of each kind
READS = {
    "default": {"Spark": True, "delta-rs QueryBuilder": True, "delta-rs to_pyarrow_table": False,
                "delta-rs to_pyarrow_dataset": False, "Polars read_delta": False, "Polars scan_delta": False},
    "portable": {reader: True for reader in [*READERS, "Spark"]},
}
TARGETS = {"default": "delta:{}", "portable": "delta:{}?tables=portable"}

SCHEMA = """
    CREATE TABLE t (id int PRIMARY KEY, v text, note text, n numeric(10,2), ts timestamp, gone int);
    INSERT INTO t SELECT g, 'seed ' || g, 'note ' || g, g * 1.25, '2024-01-01'::timestamp + g * interval '1 hour', g
        FROM generate_series(1, 300) g;
"""
CHANGES = [
    "INSERT INTO t (id, v, note) SELECT g, 'new ' || g, NULL FROM generate_series(301, 320) g",
    "UPDATE t SET v = 'updated', n = n + 1 WHERE id % 7 = 0",
    "DELETE FROM t WHERE id % 11 = 0",
    "UPDATE t SET id = id + 1000 WHERE id % 13 = 0",   # key changes
]
SCHEMA_CHANGES = [
    "ALTER TABLE t RENAME COLUMN note TO memo",
    "ALTER TABLE t DROP COLUMN gone",
    "UPDATE t SET memo = 'after the rename', v = NULL WHERE id % 5 = 0",
    "DELETE FROM t WHERE id % 17 = 0",
]


def _rows(data: pa.Table, key: list[str]) -> State:
    rows = data.to_pylist()
    out = {tuple(r[k] for k in key): r for r in rows}
    assert len(out) == len(rows), f"{len(rows) - len(out)} rows with a key another row has"
    return data.column_names, out


def _warehouse(conn: psycopg.Connection, dsn: str, target: str) -> str:
    """The table t replicated by the consumer (CLI) into the target, through every kind of change;
    its URI."""
    conn.execute(SCHEMA)
    conn.execute("SELECT replicator.create_queue('q')")
    conn.execute("SELECT replicator.add_table('q', 't')")
    for statements in ([], CHANGES, SCHEMA_CHANGES):
        for statement in statements:
            conn.execute(statement)
        done = run_cli(dsn, "consume", "q", "--target", target, "--until-caught-up", timeout=180)
        assert done.returncode == 0, done.stderr
    # the delta commands take the target as the consumer does, and treat each table as the kind it is
    optimized = run_cli(dsn, "delta", "optimize", "--target", target, "--purge")
    assert optimized.returncode == 0, optimized.stderr
    return table_uris(target.removeprefix("delta:").partition("?")[0])["public.t"]


def _reads(name: str, read: Callable[[], pa.Table], expected: State, key: list[str]) -> bool:
    """Whether the reader reads the table (then it must give the source's rows); False when it
    refuses it."""
    try:
        data = read()
    except Exception as exc:
        assert "columnMapping" in str(exc) or "deletionVectors" in str(exc), f"{name}: {exc}"
        return False
    problems = diff(name, expected, _rows(data, key))
    assert not problems, f"{len(problems)} differences:\n" + "\n".join(problems[:30])
    return True


@pytest.mark.parametrize("kind", sorted(TARGETS))
def test_each_reader_reads_the_table_as_the_docs_say(dsn, conn, tmp_path, spark, kind):
    uri = _warehouse(conn, dsn, TARGETS[kind].format(tmp_path / "wh"))
    expected, key = source_state(conn, "t"), primary_key(conn, "t")
    reads = {name: _reads(name, lambda read=read: read(uri), expected, key) for name, read in READERS.items()}
    reads["Spark"] = _reads("Spark", lambda: spark.read.format("delta").load(uri).toArrow(), expected, key)
    assert reads == READS[kind]
    # the warehouse keeps its kind: a consumer asked for the other one is refused in one line
    other = TARGETS["portable" if kind == "default" else "default"].format(tmp_path / "wh")
    refused = run_cli(dsn, "consume", "q", "--target", other, "--until-caught-up")
    assert refused.returncode == 1
    assert refused.stderr.strip() == (f"error: {tmp_path / 'wh'} holds {kind} tables: use --target "
                                      f"{TARGETS[kind].format(tmp_path / 'wh')} (a warehouse keeps the kind of tables "
                                      f"it was created with; for the other kind, replicate into a new warehouse)")


def test_an_unknown_kind_of_tables_is_refused_in_one_line_before_anything_is_written(tmp_path):
    with pytest.raises(UserError, match=r"^invalid target option tables='fast': use delta:URI \(deletion vectors"):
        DeltaTarget(f"{tmp_path / 'wh'}?tables=fast")
    assert not (tmp_path / "wh").exists()


def test_a_portable_table_stays_exact_through_spills_a_copy_changed_in_its_batch_renames_and_another_writer(
        tmp_path, monkeypatch):
    """The copy-on-write paths the consumer test does not reach, on a table in-process: a batch
    written out in parts (its own files rewritten), a copy and changes to its rows in one
    transaction, a rename and a drop, OPTIMIZE, and a commit lost to delta-rs' DELETE and staged
    again; after each commit delta-rs' to_pyarrow_table reads the model's rows, no deletion vector
    is written, and no file is left that no version names."""
    monkeypatch.setattr(delta_table, "SPILL_KEYS", 300)
    monkeypatch.setattr(delta_table, "ROW_GROUP", 256)
    monkeypatch.setattr(delta_table, "FILE_ROWS", 1000)   # a copy in several files
    key, v, w = Column("id", "bigint", "bigint", "N", True, 1), Column("v", "text", "text", "S", False, 2), \
        Column("w", "integer", "integer", "N", False, 3)
    structure = TableStructure("public", "t", (key, v, w), ("id",))

    def meta(s: TableStructure) -> dict[str, Any]:
        return {"source_name": "public.t", "table_id": 1, "mode": "full", "structure": s.to_json(),
                "copy_snapshot": None}

    uri = str(tmp_path / "public.t")
    table = ReplicaTable(LocalStorage(tmp_path), "public.t", portable=True)
    rng = random.Random(27)
    model: dict[int, tuple[Any, ...]] = {}

    def changes(count: int, width: int) -> None:
        for _ in range(count):
            i = rng.randrange(1, 3000)
            if i == 5:
                continue   # another writer deletes it
            if rng.random() < 0.2:
                table.change((i,), True, (i, *[None] * (width - 1)))
                model.pop(i, None)
            else:
                row = (i, f"r{rng.randrange(10**6)}", *[rng.randrange(100)] * (width - 2))
                table.change((i,), False, row)
                model[i] = row

    def check(names: list[str]) -> None:
        rows = deltalake.DeltaTable(uri).to_pyarrow_table().to_pylist()
        assert {r["id"]: tuple(r[n] for n in names) for r in rows} == model
        assert not list(Path(uri).glob("deletion_vector_*.bin"))
        assert table_files(Path(uri)) <= referenced_files(Path(uri))

    table.reset(meta(structure), structure)   # a copy, then changes to its rows, in one transaction
    copied = [(i, f"c{i}", i % 7) for i in range(1, 2500)]
    table.copy(copied)
    model.update({r[0]: r for r in copied})
    changes(700, 3)   # past SPILL_KEYS: written out in parts
    table.commit("q/c", 1)
    check(["id", "v", "w"])
    changes(200, 3)
    table.commit("q/c", 2)
    check(["id", "v", "w"])
    renamed = TableStructure("public", "t", (key, Column("label", "text", "text", "S", False, 2)), ("id",))
    changes(50, 3)
    table.alter(meta(renamed), renamed)   # w dropped, v renamed: the table rewritten
    model = {k: r[:2] for k, r in model.items()}
    changes(50, 2)
    table.commit("q/c", 3)
    check(["id", "label"])
    maintenance.optimize_table(table, everything=True)   # the key index follows the rows it moves
    changes(100, 2)
    deltalake.DeltaTable(uri).delete("id = 5")   # between the batch's changes and its commit
    model.pop(5, None)
    table.commit("q/c", 4)
    check(["id", "label"])
    assert deltalake.DeltaTable(uri).transaction_version("q/c") == 4


PORTABLE = "?tables=portable"


def test_a_portable_rename_batch_killed_before_the_position_commit_restarts_equal_to_the_source(
        dsn, conn, source, tmp_path):
    """kill -9 after both tables committed a batch renaming t.v, before _replicator's commit: the
    restart applies the batch again over tables rewound to the position's schema, whose names (a
    portable table's physical names) are no longer the files' columns: files are read by field id."""
    path = tmp_path / "wh"
    conn.execute(CRASH_DDL)
    source.create_queue("q")
    source.add_table("q", "t")
    source.add_table("q", "u")
    assert consume_cli(dsn, path, PORTABLE).returncode == 0
    with conn.transaction():
        conn.execute("UPDATE t SET cnt = cnt + 1 WHERE id <= 3")
        conn.execute("UPDATE u SET cnt = cnt + 1 WHERE k = 'k1'")
        conn.execute("ALTER TABLE t RENAME COLUMN v TO w")
        conn.execute("UPDATE t SET w = 'after' WHERE id = 4")
    forced_tick(conn)
    crashed = consume_cli(dsn, path, PORTABLE, REPLICATOR_CRASH_AT="delta-table-committed@2")
    assert crashed.returncode == -9, crashed.stderr
    again = consume_cli(dsn, path, PORTABLE)
    assert again.returncode == 0, again.stderr
    assert_equal_to_source(conn, path, ["t", "u"])


def test_a_portable_batch_rewrites_a_file_the_log_names_by_absolute_uri(tmp_path):
    """An add naming its file by absolute URI (the protocol allows it; another writer, a clone):
    the rewrite of a portable table reads it through ReplicaTable.file, as a default table does."""
    import shutil
    import uuid

    from test_delta_vacuum import _readd

    key, v = Column("id", "bigint", "bigint", "N", True, 1), Column("v", "text", "text", "S", False, 2)
    structure = TableStructure("public", "t", (key, v), ("id",))
    meta = {"source_name": "public.t", "table_id": 1, "mode": "full", "structure": structure.to_json(),
            "copy_snapshot": None}
    storage = LocalStorage(tmp_path)
    table = ReplicaTable(storage, "public.t", portable=True)
    table.reset(meta, structure)
    table.copy([(i, f"v{i}") for i in range(10)])
    table.commit("q/c", 1)
    snapshot = delta_log.load(storage, "public.t")
    [(path, add)] = snapshot.files.items()
    name = f"part-00000-{uuid.uuid4()}-c000.snappy.parquet"
    shutil.copy(tmp_path / "public.t" / path, tmp_path / "public.t" / name)
    _readd(storage, snapshot, path, {**add, "path": (tmp_path / "public.t" / name).as_uri()})
    table = ReplicaTable(storage, "public.t")
    table.change((3,), False, (3, "changed"))
    table.commit("q/c", 2)
    rows = deltalake.DeltaTable(str(tmp_path / "public.t")).to_pyarrow_table().to_pylist()
    assert sorted((r["id"], r["v"]) for r in rows) == [(i, "changed" if i == 3 else f"v{i}") for i in range(10)]


def test_a_warehouse_keeps_its_kind_when_every_table_was_dropped_and_refuses_the_other_in_one_line(
        dsn, conn, source, tmp_path):
    """A default warehouse whose tables were all dropped: a consumer given ?tables=portable is refused
    (a table created again in a dropped one's directory would keep that log's kind, a new one
    would be portable); the default consumer recreates them, every one a default table."""
    conn.execute(CRASH_DDL)
    source.create_queue("q")
    source.add_table("q", "t")
    source.add_table("q", "u")
    path = tmp_path / "wh"
    assert consume_cli(dsn, path).returncode == 0
    conn.execute("DROP TABLE t")
    conn.execute("DROP TABLE u")
    assert consume_cli(dsn, path).returncode == 0
    conn.execute("CREATE TABLE u (k text PRIMARY KEY, other int)")
    conn.execute("CREATE TABLE w (k text PRIMARY KEY, other int)")
    conn.execute("INSERT INTO u VALUES ('again', 1)")
    conn.execute("INSERT INTO w VALUES ('new', 1)")
    source.add_table("q", "u")
    source.add_table("q", "w")
    before = sorted(p.relative_to(path) for p in path.rglob("*") if p.name != ".lock")
    refused = consume_cli(dsn, path, PORTABLE)
    assert refused.returncode == 1
    assert refused.stderr.strip().startswith(f"error: {path} holds default tables: use --target delta:{path} ")
    assert sorted(p.relative_to(path) for p in path.rglob("*") if p.name != ".lock") == before
    assert consume_cli(dsn, path).returncode == 0
    conn.execute("UPDATE u SET other = 2")
    assert consume_cli(dsn, path).returncode == 0
    assert_equal_to_source(conn, path, ["u", "w"])
    storage = LocalStorage(path)
    assert {name: ReplicaTable(storage, d).portable for d, name in WarehouseState(storage).directories().items()} \
        == {"public.u": False, "public.w": False}


def test_filtered_reads_of_a_portable_table_are_as_the_readers_table_says(dsn, conn, source, tmp_path):
    """docs/delta.md's Readers table: Polars' scan_delta filtered gives the source's rows; delta-rs'
    to_pyarrow_dataset() filtered leaves out each file without a bound of the filtered column (a
    boolean column, a float column holding NaN, a column added after the file was written)."""
    path = tmp_path / "wh"
    conn.execute("""
        CREATE TABLE t (id int PRIMARY KEY, flag boolean, x double precision);
        INSERT INTO t SELECT g, g % 2 = 0, CASE WHEN g = 3 THEN 'NaN'::float8 ELSE g END FROM generate_series(1, 20) g;
    """)
    source.create_queue("q")
    source.add_table("q", "t")
    assert consume_cli(dsn, path, PORTABLE).returncode == 0
    conn.execute("UPDATE t SET x = x + 0.5 WHERE id = 4")
    assert consume_cli(dsn, path, PORTABLE).returncode == 0
    conn.execute("ALTER TABLE t ADD COLUMN w int")   # a metadata commit: the files before it lack w
    conn.execute("INSERT INTO t VALUES (21, true, 1, 1)")
    assert consume_cli(dsn, path, PORTABLE).returncode == 0
    uri = table_uris(str(path))["public.t"]
    _, rows = source_state(conn, "t")
    expected = {"flag = true": sorted(k[0] for k, r in rows.items() if r["flag"]),
                "x < 100": sorted(k[0] for k, r in rows.items() if r["x"] < 100),   # NaN: false in SQL, Arrow, Polars
                "w is null": sorted(k[0] for k, r in rows.items() if r["w"] is None)}
    scanned = {name: sorted(pl.scan_delta(uri).filter(where).collect()["id"].to_list())
               for name, where in (("flag = true", pl.col("flag")), ("x < 100", pl.col("x") < 100),
                                   ("w is null", pl.col("w").is_null()))}
    assert scanned == expected
    dataset = deltalake.DeltaTable(uri).to_pyarrow_dataset()
    given = {name: sorted(dataset.to_table(filter=where).column("id").to_pylist())
             for name, where in (("flag = true", ds.field("flag") == True),  # noqa: E712
                                 ("x < 100", ds.field("x") < 100), ("w is null", ds.field("w").is_null()))}
    # the files with bounds of x: the batch's (id 4, updated) and the last (id 21); none of flag, nor of w before it
    assert given == {"flag = true": [], "x < 100": [4, 21], "w is null": []}
    assert sorted(dataset.to_table().column("id").to_pylist()) == sorted(k[0] for k in rows)   # unfiltered: all


def _portable_table(path: Path, rows: int = 100) -> tuple[ReplicaTable, int]:
    """A portable table (id bigint key, v text) of rows 0..rows-1, and its version."""
    key, v = Column("id", "bigint", "bigint", "N", True, 1), Column("v", "text", "text", "S", False, 2)
    structure = TableStructure("public", "t", (key, v), ("id",))
    meta = {"source_name": "public.t", "table_id": 1, "mode": "full", "structure": structure.to_json(),
            "copy_snapshot": None}
    table = ReplicaTable(LocalStorage(path), "public.t", portable=True)
    table.reset(meta, structure)
    table.copy([(i, f"v{i}") for i in range(rows)])
    version = table.commit("q/c", 1)
    assert version is not None
    return table, version


def test_the_changes_of_a_portable_batch_read_from_the_log_are_row_changes(tmp_path):
    """changes.py's reading of a portable table's update commit (no capture, as a view behind its
    table reads it): it names the rows the batch replaced, not a table replaced."""
    from replicator.targets.delta.changes import changes_since

    table, created = _portable_table(tmp_path)
    table.change((7,), False, (7, "changed"))
    table.commit("q/c", 2)
    changes = changes_since(ReplicaTable(LocalStorage(tmp_path), "public.t"), created, {})
    assert changes is not None and not changes.replaced
    # the key's old row (read from the file the batch rewrote) and its new row: as on a default table
    assert changes.changed_keys().column(0).to_pylist() == [7, 7]
    assert changes.old_rows().to_pylist() == [{"id": 7, "v": "v7"}]
    [batch_file] = changes.added   # the batch's new rows; the rewritten file holds none
    assert pq.read_table(tmp_path / "public.t" / batch_file).to_pylist() == [{"id": 7, "v": "changed"}]


def test_the_changes_of_portable_batches_rewriting_a_file_twice_or_emptying_it_are_the_rows_replaced(
        tmp_path, monkeypatch):
    """A batch written out in parts rewrites its rewrite of a file (the remove's tags name the
    last one, and the rows left out of the first), and a batch deleting every row of a file
    removes it with no rewrite: both read from the log as the rows they replaced."""
    from replicator.targets.delta.changes import changes_since

    monkeypatch.setattr(delta_table, "SPILL_KEYS", 10)
    table, created = _portable_table(tmp_path, 30)
    # two parts: the second rewrites the first's rewrite of the copy's file (rows 10..14) and its new rows (5..9)
    for i in [*range(10), *range(5, 15)]:
        table.change((i,), False, (i, f"w{i}"))
    after_spill = table.commit("q/c", 2)
    [rewritten] = [a["remove"] for a in delta_log_actions(tmp_path, after_spill) if "remove" in a]
    changes = changes_since(ReplicaTable(LocalStorage(tmp_path), "public.t"), created, {})
    assert changes is not None and not changes.replaced
    assert sorted(r["id"] for r in changes.old_rows().to_pylist()) == list(range(15))
    assert {r["v"] for r in changes.old_rows().to_pylist()} == {f"v{i}" for i in range(15)}
    assert set(changes.deleted) == {rewritten["path"]}
    for i in range(30):
        table.change((i,), True, (i, None))
    emptied = table.commit("q/c", 3)
    removes = [a["remove"] for a in delta_log_actions(tmp_path, emptied) if "remove" in a]
    assert len(removes) == 3 and not any("replicator.rewrittenInto" in r["tags"] for r in removes)
    changes = changes_since(ReplicaTable(LocalStorage(tmp_path), "public.t"), after_spill, {})
    assert changes is not None and not changes.replaced and not changes.added
    assert sorted(r["id"] for r in changes.old_rows().to_pylist()) == list(range(30))


def delta_log_actions(path: Path, version: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (path / delta_log.commit_path("public.t", version)).read_text().splitlines()]


def _untagged(remove: dict[str, Any], adds: list[dict[str, Any]]) -> None:
    del remove["tags"]


def _into_a_file_not_added(remove: dict[str, Any], adds: list[dict[str, Any]]) -> None:
    remove["tags"]["replicator.rewrittenInto"] = "part-00000-elsewhere.parquet"


def _a_row_left_out_not_counted(remove: dict[str, Any], adds: list[dict[str, Any]]) -> None:
    remove["tags"]["replicator.rowsLeftOut"] = base64.b64encode(BitMap([7, 8]).serialize()).decode()


def _rows_left_out_past_the_file(remove: dict[str, Any], adds: list[dict[str, Any]]) -> None:
    remove["tags"]["replicator.rowsLeftOut"] = base64.b64encode(BitMap([100]).serialize()).decode()


def _rows_left_out_malformed(remove: dict[str, Any], adds: list[dict[str, Any]]) -> None:
    remove["tags"]["replicator.rowsLeftOut"] = "not base64!"


def _into_the_batchs_own_file(remove: dict[str, Any], adds: list[dict[str, Any]]) -> None:
    remove["tags"]["replicator.rewrittenInto"] = next(a["path"] for a in adds
                                                      if a["path"] != remove["tags"]["replicator.rewrittenInto"])


@pytest.mark.parametrize("tamper", [_untagged, _into_a_file_not_added, _a_row_left_out_not_counted,
                                    _rows_left_out_past_the_file, _rows_left_out_malformed,
                                    _into_the_batchs_own_file])
def test_a_rewrite_whose_tags_do_not_check_out_is_read_as_the_table_replaced(tmp_path, tamper):
    """The rewrite tags are a writer's word: a remove without them (Spark's, delta-rs' copy-on-write),
    or with tags the commit and the files' row counts contradict, is read as the table replaced
    (a view refreshed in full), never as a guess at its rows."""
    from replicator.targets.delta.changes import changes_since

    table, created = _portable_table(tmp_path)
    table.change((7,), False, (7, "changed"))
    version = table.commit("q/c", 2)
    actions = delta_log_actions(tmp_path, version)
    [remove] = [a["remove"] for a in actions if "remove" in a]
    tamper(remove, [a["add"] for a in actions if "add" in a])
    (tmp_path / delta_log.commit_path("public.t", version)).write_text("".join(json.dumps(a) + "\n" for a in actions))
    changes = changes_since(ReplicaTable(LocalStorage(tmp_path), "public.t"), created, {})
    assert changes is not None and changes.replaced


def test_spark_enables_column_mapping_on_a_portable_table_and_the_consumer_refuses_it_until_undone(
        dsn, conn, source, tmp_path, spark):
    """A portable table is a Delta table without column mapping: Spark may turn it on (to rename a
    column, or make it a default table), which it refuses while the fields carry column mapping's
    metadata (DELTA_ENABLING_COLUMN_MAPPING_DISALLOWED_WHEN_COLUMN_MAPPING_METADATA_ALREADY_EXISTS).
    The consumer then refuses the table in one line, writing nothing (docs/delta.md, "Other
    writers"), until Spark turns it off again; Spark leaves it a table Polars refuses all the same."""
    path = tmp_path / "wh"
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text); INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 10) g")
    source.create_queue("q")
    source.add_table("q", "t")
    assert consume_cli(dsn, path, PORTABLE).returncode == 0
    uri = table_uris(str(path))["public.t"]
    fields = json.loads(ReplicaTable(LocalStorage(path), "public.t").snapshot.metadata["schemaString"])["fields"]
    assert not any(key.startswith("delta.columnMapping") for f in fields for key in f["metadata"])
    spark.sql(f"ALTER TABLE delta.`{uri}` SET TBLPROPERTIES ('delta.columnMapping.mode' = 'name')")
    conn.execute("UPDATE t SET v = 'changed' WHERE id = 3")
    version = ReplicaTable(LocalStorage(path), "public.t").snapshot.version
    refused = consume_cli(dsn, path, PORTABLE)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == (
        f"error: {uri} has delta.columnMapping.mode = name, which another writer set: replicator writes the table's "
        f"columns without column mapping; set it back (Spark: ALTER TABLE delta.`{uri}` SET TBLPROPERTIES "
        f"('delta.columnMapping.mode' = 'none'))")
    assert ReplicaTable(LocalStorage(path), "public.t").snapshot.version == version
    spark.sql(f"ALTER TABLE delta.`{uri}` SET TBLPROPERTIES ('delta.columnMapping.mode' = 'none')")
    assert consume_cli(dsn, path, PORTABLE).returncode == 0
    assert_equal_to_source(conn, path, ["t"])
    # Spark leaves the protocol at column mapping's reader version: Polars still refuses the table
    with pytest.raises(Exception, match="reader version 2"):
        pl.read_delta(uri)
