"""Names are data, never paths: a table's name, whatever it is (`..`, `.`, `_delta_log`, the
lock file's `.replicator.lock`, a case variant of another table's), becomes a directory inside
the warehouse that is no entry of replicator's own, hidden from no reader and no other
table's. Real PostgreSQL and the real consumer where the source can name such a table; the
target's create_table as a Kafka follower calls it where only a follower's schema record can
(a source name without a schema); the tables read with delta-rs.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import boto3
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("deltalake")
from deltalake import DeltaTable
from deltalake.exceptions import DeltaError

from consumer_helpers import run_cli
from replicator.errors import UserError
from replicator.structure import Column, TableStructure
from replicator.targets.delta import maintenance
from replicator.targets.delta import schema as delta_schema
from replicator.targets.delta.object_storage import ObjectStorage
from replicator.targets.delta.reader import table_uris
from replicator.targets.delta.state import WarehouseState
from replicator.targets.delta.storage import LocalStorage
from replicator.targets.delta.target import DeltaTarget
from replicator.targets.protocol import TargetTable
from test_delta_target import consume, consume_cli, delta_rows, diff, primary_key, source_state

OWN = {"_replicator", ".replicator.lock"}   # replicator's entries at the warehouse's root


def tree(path: Path) -> dict[str, bytes]:
    """Every file under path (symlinks not followed) with its bytes."""
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def outside(tmp_path: Path, warehouse: Path) -> dict[str, bytes]:
    """The files beside the warehouse: a sibling directory, another warehouse's table."""
    return {name: data for name, data in tree(tmp_path).items() if not name.startswith(f"{warehouse.name}/")}


def siblings(tmp_path: Path) -> None:
    """Files a name leading out of the warehouse would reach, of the names vacuum once deleted."""
    old = time.time() - 30 * 24 * 3600
    for name in ("sibling/part-00000-1b8f0d2e-0000-4000-8000-000000000000-c000.snappy.parquet", "sibling/notes.txt",
                 ".part-00000-x.snappy.parquet.0123456789abcdef0123456789abcdef.tmp"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(name.encode())
        os.utime(tmp_path / name, (old, old))


def readable_directories(warehouse: Path) -> dict[str, str]:
    """{directory: source name} of the tables, each a directory of its own at the root."""
    tables = table_uris(str(warehouse))
    directories = {uri.rsplit("/", 1)[1]: name for name, uri in tables.items()}
    for name, uri in tables.items():
        assert Path(uri).parent == warehouse, (name, uri)
    return directories


def assert_no_entry_of_replicator_or_hidden(directories: dict[str, str]) -> None:
    for directory, name in directories.items():
        assert directory not in OWN | {"_views", "_delta_log", ".", ".."}, (name, directory)
        assert not directory.startswith(("_", ".")), f"{name}: {directory} is hidden from Spark and Delta readers"
    folded = [d.casefold() for d in directories]
    assert len(set(folded)) == len(folded), f"directories equal but for case: {sorted(directories)}"


# through the source ----------------------------------------------------------------------

ODD_TABLES = """
    CREATE SCHEMA ".replicator";
    CREATE TABLE ".replicator".lock (id int PRIMARY KEY, v text);
    CREATE TABLE public."..." (id int PRIMARY KEY, v text);
    CREATE TABLE public.".." (id int PRIMARY KEY, v text);
    CREATE SCHEMA "_views";
    CREATE TABLE "_views".v (id int PRIMARY KEY, v text);
    CREATE TABLE public."T" (id int PRIMARY KEY, v text);
    CREATE TABLE public.t (id int PRIMARY KEY, v text);
    CREATE TABLE public.orders (id int PRIMARY KEY, v text);
"""
# (the table as PostgreSQL names it, its source name)
ODD = [('".replicator".lock', ".replicator.lock"), ('public."..."', "public...."), ('public.".."', "public..."),
       ('"_views".v', "_views.v"), ('public."T"', "public.T"), ("public.t", "public.t"),
       ("public.orders", "public.orders")]


def test_tables_named_like_the_warehouses_own_entries_replicate_inside_it_each_in_a_directory_of_its_own(
        dsn, conn, source, tmp_path):
    conn.execute(ODD_TABLES)
    source.create_queue("q")
    for table, _ in ODD:
        source.add_table("q", table)
        conn.execute(f"INSERT INTO {table} SELECT g, %s || g FROM generate_series(1, 20) g", (table,))
    siblings(tmp_path)
    path = tmp_path / "wh"
    before = outside(tmp_path, path)
    done = consume_cli(dsn, path)
    assert done.returncode == 0, done.stderr
    for table, _ in ODD:
        conn.execute(f"UPDATE {table} SET v = v || '!' WHERE id % 3 = 0")
        conn.execute(f"DELETE FROM {table} WHERE id = 7")
    done = consume_cli(dsn, path)
    assert done.returncode == 0, done.stderr

    directories = readable_directories(path)
    assert sorted(directories.values()) == sorted(name for _, name in ODD)
    assert_no_entry_of_replicator_or_hidden(directories)
    uris = table_uris(str(path))
    problems = []
    for table, name in ODD:
        problems += diff(name, source_state(conn, table), delta_rows(uris[name], primary_key(conn, table)))
    assert not problems, problems
    assert outside(tmp_path, path) == before


# as a follower names them ----------------------------------------------------------------

STRUCTURE_COLUMNS = (Column("id", "bigint", "bigint", "N", True, 1), Column("v", "text", "text", "S", False, 2))
FOLLOWED = ["..", ".", "_delta_log", "_replicator", "_views", ".replicator.lock", "public.orders", "Public.Orders",
            "a/../../b", "/etc/x"]


def followed_table(name: str, table_id: int) -> TargetTable:
    schema, _, bare = name.rpartition(".")
    return TargetTable(source_name=name, table_id=table_id, mode="full", copy_snapshot=None,
                       structure=TableStructure(schema=schema, name=bare, columns=STRUCTURE_COLUMNS, key=("id",)))


def follow(path: Path | str, names: list[str], tick: int, rows: dict[str, list[tuple[int, str]]]) -> None:
    """One transaction as a follower runs it: each table copied (anew, the second time)."""
    target = DeltaTarget(str(path))
    try:
        target.begin()
        known = target.tables()
        for n, name in enumerate(names):
            table = known.get(name) or followed_table(name, n + 1)
            target.create_table(table)
            target.upsert(table, "R", rows[name])
        target.set_position("q", "c", tick)
        target.commit()
    finally:
        target.close()


def delta_table(uri: str, options: dict[str, str] | None = None) -> dict[int, str]:
    data = pa.table(DeltaTable(uri, storage_options=options).scan().read_all())
    return dict(zip(data.column("id").to_pylist(), data.column("v").to_pylist()))


def test_a_followed_table_named_dot_dot_or_after_an_entry_of_replicator_stays_inside_the_warehouse(tmp_path):
    siblings(tmp_path)
    path = tmp_path / "wh"
    before = outside(tmp_path, path)
    rows = {name: [(i, f"{name} {i}") for i in range(1, 30)] for name in FOLLOWED}
    follow(path, FOLLOWED, 1, rows)
    rows = {name: [(i, f"{name} again {i}") for i in range(5, 40)] for name in FOLLOWED}
    follow(path, FOLLOWED, 2, rows)   # the warehouse opens again, with them

    assert outside(tmp_path, path) == before
    directories = readable_directories(path)
    assert sorted(directories.values()) == sorted(FOLLOWED)
    assert_no_entry_of_replicator_or_hidden(directories)
    uris = table_uris(str(path))
    for name in FOLLOWED:
        assert delta_table(uris[name]) == dict(rows[name]), name


def test_a_followed_table_named_dot_dot_stays_inside_an_s3_warehouse(s3_url):
    bucket, prefix = s3_url.removeprefix("s3://").split("/", 1)
    s3 = boto3.client("s3")
    s3.put_object(Bucket=bucket, Key="beside/_delta_log/00000000000000000000.json", Body=b"another table's")
    names = ["..", ".", ".replicator.lock", "public.orders"]
    rows = {name: [(i, f"{name} {i}") for i in range(1, 30)] for name in names}
    follow(s3_url, names, 1, rows)
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket) for o in page["Contents"]]
    assert [k for k in keys if not k.startswith(f"{prefix}/")] == ["beside/_delta_log/00000000000000000000.json"]
    uris = table_uris(s3_url)
    assert sorted(uris) == sorted(names)
    for name in names:
        assert uris[name].startswith(f"{s3_url}/table-") or name == "public.orders", uris[name]
        assert delta_table(uris[name], ObjectStorage(s3_url).delta_rs()[1]) == dict(rows[name]), name


def test_vacuum_of_a_warehouse_with_such_tables_deletes_nothing_outside_their_directories(dsn, tmp_path):
    siblings(tmp_path)
    path = tmp_path / "wh"
    names = ["..", ".", "public.orders"]   # the reproduction: vacuum deleted the sibling's, _replicator's, orders' files
    rows = {name: [(i, f"{name} {i}") for i in range(1, 30)] for name in names}
    follow(path, names, 1, rows)
    follow(path, names, 2, rows)   # a copy anew: each table's first files removed
    before_outside = outside(tmp_path, path)
    mine = path / "mine"
    mine.mkdir()
    (mine / "part-00000-1b8f0d2e-0000-4000-8000-000000000000-c000.snappy.parquet").write_text("a user's")
    old = time.time() - 30 * 24 * 3600
    os.utime(mine / "part-00000-1b8f0d2e-0000-4000-8000-000000000000-c000.snappy.parquet", (old, old))
    done = run_cli(dsn, "delta", "vacuum", "--target", f"delta:{path}", "--retain", "1s", "--force")
    assert done.returncode == 0, done.stderr
    assert outside(tmp_path, path) == before_outside
    assert (mine / "part-00000-1b8f0d2e-0000-4000-8000-000000000000-c000.snappy.parquet").read_text() == "a user's"
    uris = table_uris(str(path))
    for name in names:
        assert delta_table(uris[name]) == dict(rows[name]), name


@pytest.mark.parametrize("directory", ["..", ".", "../wh2", "/tmp"])
def test_a_warehouse_that_records_a_table_outside_its_own_directory_is_refused_in_one_line(tmp_path, directory):
    """A warehouse an older version wrote with a table in `..`: refused, nothing written or deleted."""
    path = tmp_path / "wh"
    follow(path, ["public.orders"], 1, {"public.orders": [(1, "one")]})
    state = WarehouseState(LocalStorage(path))
    state.commit(None, [], {**state.directories(), directory: "odd"}, kind="default")
    siblings(tmp_path)
    before = tree(tmp_path)
    with pytest.raises(UserError, match=f"table odd.*{re.escape(repr(directory))}"):
        DeltaTarget(str(path))
    with pytest.raises(UserError, match=f"directory {re.escape(repr(directory))}.*nothing vacuumed"):
        maintenance.vacuum(LocalStorage(path), retention=1, force=True)
    assert tree(tmp_path) == before


# column names ------------------------------------------------------------------------------

COLUMNS = """
    CREATE TABLE c (id int PRIMARY KEY, val text, "Val" text, "VAL" int, val_2 text,
                    "odd name, ;{}()=" text, "tab\tnew
line.dot" text);
    INSERT INTO c SELECT g, 'val ' || g, 'Val ' || g, g, 'val_2 ' || g, 'odd ' || g, 'tab ' || g
                  FROM generate_series(1, 20) g;
"""
# A source name and the Delta name of a column (docs/delta.md, "Column names"): each the second of
# its name ignoring case gets the first free suffix, val_2 (a source name) keeping its own
COPIED = ["id", "val", "Val_3", "VAL_4", "val_2", "odd name, ;{}()=", "tab\tnew\nline.dot"]
ALTERED = [   # each step one batch, then the Delta names
    (["ALTER TABLE c DROP COLUMN val", "UPDATE c SET \"Val\" = 'updated' WHERE id % 3 = 0"],
     ["id", "Val_3", "VAL_4", "val_2", "odd name, ;{}()=", "tab\tnew\nline.dot"]),
    (["ALTER TABLE c RENAME COLUMN \"VAL\" TO other", "ALTER TABLE c ADD COLUMN \"OTHER\" text",
      "ALTER TABLE c ADD COLUMN val text", "UPDATE c SET \"OTHER\" = 'O', val = 'again', other = -id WHERE id < 5",
      "DELETE FROM c WHERE id = 7"],
     ["id", "Val_3", "other", "val_2", "odd name, ;{}()=", "tab\tnew\nline.dot", "OTHER_2", "val"]),
    (["ALTER TABLE c RENAME COLUMN \"Val\" TO \"vAL\"", "INSERT INTO c (id, \"vAL\", val) VALUES (100, 'a', 'b')"],
     ["id", "vAL_3", "other", "val_2", "odd name, ;{}()=", "tab\tnew\nline.dot", "OTHER_2", "val"]),
]


def as_delta_names(state: tuple[list[str], dict], names: list[str]) -> tuple[list[str], dict]:
    """The source state (source_state) with each column under its Delta name, by position."""
    columns, rows = state
    return names, {k: {n: row[c] for c, n in zip(columns, names)} for k, row in rows.items()}


def test_columns_whose_names_differ_only_in_case_get_distinct_delta_names_that_stay_through_ddl_and_restarts(
        dsn, conn, source, tmp_path, spark):
    conn.execute(COLUMNS)
    source.create_queue("q")
    source.add_table("q", "c")
    path = tmp_path / "wh"
    done = consume_cli(dsn, path)
    assert done.returncode == 0, done.stderr
    uri = table_uris(str(path))["public.c"]
    problems = diff("c", as_delta_names(source_state(conn, "c"), COPIED), delta_rows(uri, ["id"]))
    assert not problems, problems

    for statements, names in ALTERED:
        for statement in statements:
            conn.execute(statement)
        done = consume_cli(dsn, path)   # a consumer started anew each time
        assert done.returncode == 0, done.stderr
        problems = diff("c", as_delta_names(source_state(conn, "c"), names), delta_rows(uri, ["id"]))
        assert not problems, problems

    # Spark reads it, with the names Delta has
    frame = spark.read.format("delta").load(uri)
    assert frame.columns == names
    rows = {r["id"]: r for r in frame.toArrow().to_pylist()}
    assert rows == {k[0]: r for k, r in as_delta_names(source_state(conn, "c"), names)[1].items()}


def test_a_table_an_earlier_version_wrote_with_names_equal_ignoring_case_gets_distinct_ones_at_its_next_schema_change(
        dsn, conn, source, tmp_path, monkeypatch):
    conn.execute('CREATE TABLE c (id int PRIMARY KEY, val text, "Val" text); INSERT INTO c VALUES (1, \'a\', \'A\')')
    source.create_queue("q")
    source.add_table("q", "c")
    path = tmp_path / "wh"
    with monkeypatch.context() as earlier:   # the earlier version: Delta names the source's
        earlier.setattr(delta_schema, "delta_names", lambda columns, old: [c.name for c in columns])
        target = DeltaTarget(str(path))
        try:
            consume(dsn, target)
        finally:
            target.close()
    uri = table_uris(str(path))["public.c"]
    with pytest.raises(DeltaError, match="Duplicate field name"):
        delta_rows(uri, ["id"])
    conn.execute("ALTER TABLE c ADD COLUMN extra int; INSERT INTO c VALUES (2, 'b', 'B', 2)")
    target = DeltaTarget(str(path))
    try:
        consume(dsn, target)
    finally:
        target.close()
    names = ["id", "val", "Val_2", "extra"]
    assert not diff("c", as_delta_names(source_state(conn, "c"), names), delta_rows(uri, ["id"]))


def test_column_names_any_reader_folds_into_one_get_distinct_delta_names():
    names = ["i", "\u0131", "\u212a", "k", "ss", "\u00df", "Straße", "STRASSE"]   # dotless i, Kelvin sign, sharp s
    columns = [Column(name, "text", "text", "S", False, attnum) for attnum, name in enumerate(names, 1)]
    assert delta_schema.delta_names(columns, {}) == [
        "i", "\u0131_2", "\u212a", "k_2", "ss", "\u00df_2", "Straße", "STRASSE_2"]


def test_a_columns_delta_name_with_a_two_digit_suffix_stays_when_another_column_is_dropped():
    """docs/delta.md: a column keeps its Delta name while its source name stays. "Val" beside val,
    val_2 ... val_9 is Val_10; schema._derived accepts only suffixes matching _[2-9]\\d*, so Val_10
    is not recognised as its own at the next schema change and becomes Val_5 once val_5 is dropped."""
    names = ["val", *[f"val_{i}" for i in range(2, 10)], "Val"]
    columns = [Column(name, "text", "text", "S", False, attnum) for attnum, name in enumerate(names, 1)]
    first = delta_schema.delta_names(columns, {})
    assert first[-1] == "Val_10"
    old = {c.attnum: n for c, n in zip(columns, first)}
    after_drop = [c for c in columns if c.name != "val_5"]
    assert delta_schema.delta_names(after_drop, old)[-1] == "Val_10"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["val", "Val", "VAL", "vAl", "val_2", "Val_2", "val_10", "Val_1", "val_02"]),
                min_size=1, max_size=16),
       st.data())
def test_every_columns_delta_name_stays_when_other_columns_are_dropped(sources, data):
    """The stability rule for any suffix the naming rule gives (_2 ... _16 here): a column keeps its
    Delta name while its source name stays, whichever other columns are dropped."""
    columns = [Column(name, "text", "text", "S", False, attnum) for attnum, name in enumerate(sources, 1)]
    first = dict(zip((c.attnum for c in columns), delta_schema.delta_names(columns, {})))
    kept = data.draw(st.lists(st.sampled_from(columns), unique_by=lambda c: c.attnum))
    kept.sort(key=lambda c: c.attnum)
    assert delta_schema.delta_names(kept, first) == [first[c.attnum] for c in kept]
