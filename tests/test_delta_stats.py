"""The statistics of the Delta files replicator writes never lie: a column's minValues and
maxValues in a file's stats bound every value of the column in that file, or the column has
no bounds there (unknown, which every reader takes as "may match"); nullCount and numRecords
are exact. Readers skip files by them (Spark's data skipping, delta-rs' pruning), so a bound
that lies loses rows.

Real PostgreSQL, the real consumer (in-process where a module constant is patched to make
row groups small), real files; each file's stats checked against its Parquet values; the
tables read with delta-rs (QueryBuilder, whose DataFusion scan prunes files by their
stats) and Spark (the session-scoped `spark` fixture, a few reads), each with and without
skipping.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, date, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("deltalake")
from deltalake import DeltaTable, QueryBuilder

import replicator.source.table_copy as table_copy
import replicator.targets.delta.table as delta_table
from pg_helpers import fresh_database
from replicator.targets.delta import log as delta_log
from replicator.targets.delta.reader import table_uris
from replicator.targets.delta.storage import LocalStorage
from replicator.targets.delta.target import DeltaTarget
from test_delta_target import _commit_by_hand, consume

# the check of every file's stats against its values ----------------------------------------------


def _bound(value: Any, typ: pa.DataType) -> Any:
    """A minValues/maxValues entry as a value comparable with the column's Python values."""
    if pa.types.is_timestamp(typ):
        parsed = datetime.fromisoformat(value)
        return parsed.astimezone(UTC) if typ.tz else parsed
    if pa.types.is_date(typ):
        return date.fromisoformat(value)
    if pa.types.is_decimal(typ):
        return Decimal(repr(value))
    return value


def lies(stats: dict[str, Any], data: pa.Table, label: str = "") -> list[str]:
    """What in a file's stats does not hold of its rows (data: every physical row, deleted or not:
    the bounds are written for all of them): a bound some value is outside of, a nullCount or a
    numRecords that is not the file's."""
    problems = []
    if stats.get("numRecords") != data.num_rows:
        problems.append(f"{label}numRecords {stats.get('numRecords')}, the file has {data.num_rows} rows")
    for name, column in zip(data.column_names, data.columns):
        count = stats.get("nullCount", {}).get(name)
        if count is not None and count != column.null_count:
            problems.append(f"{label}{name}: nullCount {count}, the file has {column.null_count}")
        values = [v for v in column.to_pylist() if v is not None]
        # NaN is above every number to readers (Spark, DataFusion): no maximum bounds it
        for kind, holds in (("minValues", lambda bound, v: v != v or bound <= v),
                            ("maxValues", lambda bound, v: v == v and bound >= v)):
            if name not in stats.get(kind, {}):
                continue
            bound = _bound(stats[kind][name], column.type)
            outside = [v for v in values if not holds(bound, v)]
            if outside:
                problems.append(f"{label}{name}: {kind} {stats[kind][name]!r}, the file holds {outside[0]!r}")
    return problems


def stats_problems(warehouse: Path, directory: str) -> list[str]:
    """The lies in the stats of a table's live files (columns named by their physical names)."""
    snapshot = delta_log.load(LocalStorage(warehouse), directory)
    problems = []
    for path, add in snapshot.files.items():
        problems += lies(json.loads(add["stats"]), pq.read_table(warehouse / directory / path), f"{path} ")
    return problems


def assert_stats_bound_values(warehouse: Path, table: str) -> None:
    directory = table_uris(str(warehouse))[table][len(str(warehouse)) + 1:]
    problems = stats_problems(warehouse, directory)
    assert not problems, f"{len(problems)} lies:\n" + "\n".join(problems[:20])


def delta_rs_ids(uri: str, where: str) -> list[int]:
    """The ids of the rows delta-rs' QueryBuilder gives for a predicate (files pruned by their stats)."""
    result = QueryBuilder().register("t", DeltaTable(uri)).execute(f"SELECT id FROM t WHERE {where}").read_all()
    return sorted(pa.table(result).column("id").to_pylist())


def spark_ids(spark: Any, uri: str, where: str) -> list[int]:
    """The ids of the rows Spark gives for a predicate (data skipping on, as by default)."""
    return sorted(r.id for r in spark.read.format("delta").load(uri).where(where).select("id").collect())


# 1. the reproduction -----------------------------------------------------------------------

def test_a_copy_with_a_long_string_and_an_infinite_timestamp_in_one_row_group_is_skipped_by_no_reader(
        dsn, conn, source, tmp_path, monkeypatch, spark):
    # a copy written in row groups of 8 rows (131072 unpatched: 135001 rows, the snapshot's 5000-row
    # chunks gathered, fail alike): the long notes and the infinite timestamp are in a row group whose
    # bounds main could not give; the other row groups' must not stand for the whole file
    monkeypatch.setattr(table_copy, "COPY_CHUNK_ROWS", 8)
    monkeypatch.setattr(delta_table, "ROW_GROUP", 8)
    conn.execute("CREATE TABLE t (id bigint PRIMARY KEY, note text, ts timestamptz)")
    conn.execute("INSERT INTO t SELECT g, 'n' || g, '2024-01-01 00:00+00'::timestamptz + g * interval '1 second'"
                 " FROM generate_series(1, 20) g")
    conn.execute("UPDATE t SET note = repeat('a', 100) WHERE id = 7")
    conn.execute("UPDATE t SET note = repeat('z', 100) || 'y' WHERE id = 8")   # above its bound's prefix
    conn.execute("UPDATE t SET ts = 'infinity' WHERE id = 9")
    path = tmp_path / "wh"
    uri = _copied(dsn, source, path)
    above = "note > '" + "z" * 100 + "'"
    assert delta_rs_ids(uri, "note < 'b'") == [7]
    assert delta_rs_ids(uri, above) == [8]
    assert delta_rs_ids(uri, "ts > '2030-01-01T00:00:00Z'") == [9]
    assert spark_ids(spark, uri, "note < 'b'") == [7]
    assert spark_ids(spark, uri, above) == [8]
    assert spark_ids(spark, uri, "ts > '2030-01-01'") == [9]
    assert_stats_bound_values(path, "public.t")


def _copied(dsn, source, path):
    """Table t captured in queue q and copied into a warehouse at path: its Delta table's URI."""
    source.create_queue("q")
    source.add_table("q", "t")
    target = DeltaTarget(str(path))
    try:
        consume(dsn, target)
    finally:
        target.close()
    return table_uris(str(path))["public.t"]


def test_a_string_bound_with_a_character_beyond_plane_1_skips_no_row_in_delta_rs_or_spark(dsn, conn, source,
                                                                                         tmp_path, spark):
    # delta-rs' JSON reader (arrow-json) decodes the \ud840\udc00 escape of U+20000 as U+10000, below
    # U+1FFFF: a maximum escaped so skips the file for note > '\U0001ffff'
    conn.execute("CREATE TABLE t (id bigint PRIMARY KEY, note text)")
    conn.execute("INSERT INTO t VALUES (1, %s)", ["\U00020000"])
    path = tmp_path / "wh"
    uri = _copied(dsn, source, path)
    for where in ("note > '\U0001ffff'", "note = '\U00020000'", "note < '\U00020001'"):
        assert delta_rs_ids(uri, where) == [1], where
        assert spark_ids(spark, uri, where) == [1], where
    assert_stats_bound_values(path, "public.t")


def test_the_files_replicator_writes_are_zstd_parquet(dsn, conn, source, tmp_path):
    conn.execute("CREATE TABLE t (id bigint PRIMARY KEY, v text)")
    conn.execute("INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 10) g")
    source.create_queue("q")
    source.add_table("q", "t")
    path = tmp_path / "wh"
    target = DeltaTarget(str(path))
    try:
        consume(dsn, target)   # the copy's file
        conn.execute("UPDATE t SET v = 'changed' WHERE id = 3")
        consume(dsn, target)   # a batch's file, and the _replicator table's
    finally:
        target.close()
    files = sorted(path.rglob("part-*.parquet"))
    assert {f.parent.name for f in files} == {"_replicator", "public.t"}, files
    codecs = {pq.ParquetFile(f).metadata.row_group(0).column(0).compression for f in files}
    assert codecs == {"ZSTD"}, codecs
    assert sorted(r["v"] for r in pa.table(DeltaTable(table_uris(str(path))["public.t"]).scan().read_all())
                  .to_pylist())[-1] == "v9"


def test_a_deletion_vector_on_a_file_added_without_num_records_comes_with_the_files_count(dsn, conn, source,
                                                                                           tmp_path, spark):
    conn.execute("CREATE TABLE t (id bigint PRIMARY KEY, v text)")
    conn.execute("INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 10) g")
    source.create_queue("q")
    source.add_table("q", "t")
    path = tmp_path / "wh"
    target = DeltaTarget(str(path))
    try:
        consume(dsn, target)
        uri = table_uris(str(path))["public.t"]
        directory = uri[len(str(path)) + 1:]
        [add] = delta_log.load(LocalStorage(path), directory).files.values()
        # another writer adds the file again without stats (a writer that collects none; stats are optional)
        _commit_by_hand(Path(uri), [{"add": {k: v for k, v in add.items() if k != "stats"} | {"dataChange": False}}])
        conn.execute("UPDATE t SET v = 'changed' WHERE id = 3")
        consume(dsn, target)
    finally:
        target.close()
    vectors = [a for a in delta_log.load(LocalStorage(path), directory).files.values() if a.get("deletionVector")]
    assert [a["path"] for a in vectors] == [add["path"]]
    # Delta requires numRecords, the physical rows, of a file with a deletion vector
    assert json.loads(vectors[0]["stats"] or "{}").get("numRecords") == 10, vectors[0]
    rows = pa.table(DeltaTable(uri).scan().read_all()).to_pylist()
    assert sorted((r["id"], r["v"]) for r in rows) == sorted([(i, f"v{i}") for i in range(1, 11) if i != 3]
                                                             + [(3, "changed")])
    assert spark.read.format("delta").load(uri).count() == 10   # Spark counts by numRecords less the vectors


# 2. the bounds of a file written in parts, for values of every kind ------------------------------------

_EDGE_CHARS = ["a", "b", "z", "\u00e9", "\ud7ff", "\ue000", "\uffff", "\U0001f600", "\U0010ffff"]
TEXT = st.one_of(st.none(),
                 st.text(st.characters(codec="utf-8"), max_size=70),   # any character PostgreSQL holds
                 st.text(st.sampled_from(_EDGE_CHARS), min_size=60, max_size=70))   # around the prefix's length
TIMESTAMP = st.one_of(st.none(), st.datetimes(), st.sampled_from([datetime.min, datetime.max]))
COLUMNS = {
    "note": (pa.string(), TEXT),
    "ts": (pa.timestamp("us", tz="UTC"), TIMESTAMP.map(lambda t: None if t is None else t.replace(tzinfo=UTC))),
    "tsn": (pa.timestamp("us"), TIMESTAMP),
    "d": (pa.date32(), st.one_of(st.none(), st.dates())),
    "i": (pa.int64(), st.one_of(st.none(), st.integers(-(1 << 63), (1 << 63) - 1))),
    "n": (pa.decimal128(12, 2), st.one_of(st.none(), st.decimals(-(10**10) + 1, 10**10 - 1, places=2))),
    "f": (pa.float64(), st.one_of(st.none(), st.floats())),
    "r": (pa.float32(), st.one_of(st.none(), st.floats(width=32))),
}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(*(strategy for _, strategy in COLUMNS.values())), min_size=1, max_size=12),
       st.lists(st.integers(1, 5), min_size=1, max_size=12))
def test_the_stats_of_a_file_written_in_row_groups_bound_every_value_of_it(rows, sizes):
    schema = pa.schema([(name, typ) for name, (typ, _) in COLUMNS.items()])
    data = pa.Table.from_pylist([dict(zip(COLUMNS, row)) for row in rows], schema=schema)
    parts, start = [], 0
    for size in sizes:
        if start < data.num_rows:
            parts.append(data.slice(start, size))
            start += size
    parts.append(data.slice(start))
    assert lies(delta_table.file_stats(data), data) == []
    assert lies(delta_table.merged_stats([delta_table.file_stats(part) for part in parts]), data) == []


def test_bounds_are_kept_where_they_can_be_given():
    data = pa.table({"note": ["b" * 100, "c" * 100, "\U0010ffff" * 100], "id": [3, 1, 2]})
    stats = delta_table.merged_stats([delta_table.file_stats(data.slice(0, 2)), delta_table.file_stats(data.slice(2))])
    assert stats["minValues"] == {"note": "b" * 64, "id": 1} and stats["maxValues"] == {"id": 3}
    stats = delta_table.file_stats(data.slice(0, 2))
    assert stats["maxValues"] == {"note": "c" * 63 + "d", "id": 3}


def test_a_zero_bound_holds_both_zeros_as_readers_order_them():
    # DataFusion (delta-rs) orders floats totally, -0.0 below 0.0: a minimum of 0.0 over a -0.0 skips it
    for values in ([0.0, -0.0, 2.0], [-0.0, -1.0], [0.0]):
        stats = delta_table.file_stats(pa.table({"f": values}))
        low, high = stats["minValues"]["f"], stats["maxValues"]["f"]
        assert low == min(values) and (low != 0 or math.copysign(1, low) == -1)
        assert high == max(values) and (high != 0 or math.copysign(1, high) == 1)


# 3. random rows through the real consumer, read with data skipping ---------------------------------------

ROW = st.tuples(TEXT.filter(lambda t: t is None or "\x00" not in t),
                st.one_of(st.none(), st.sampled_from(["infinity", "-infinity"]), st.datetimes().map(str)),
                st.one_of(st.none(), st.sampled_from(["infinity", "-infinity", "2030-01-01"]), st.dates().map(str)),
                st.one_of(st.none(), st.floats(width=64)),
                st.one_of(st.none(), st.decimals(-(10**10) + 1, 10**10 - 1, places=2)),
                st.one_of(st.none(), st.dictionaries(TEXT.filter(lambda t: t is not None and "\x00" not in t),
                                                     st.integers(), max_size=3)),
                st.one_of(st.none(), st.lists(TEXT.filter(lambda t: t is None or "\x00" not in t), max_size=3)))
PREDICATES = [
    ("note < {text}", lambda r, x: r["note"] is not None and r["note"] < x),
    ("note > {text}", lambda r, x: r["note"] is not None and r["note"] > x),
    ("note = {text}", lambda r, x: r["note"] == x),
    ("note IS NULL", lambda r, x: r["note"] is None),
    ("note IS NOT NULL", lambda r, x: r["note"] is not None),
    ("ts > '2030-01-01T00:00:00'", lambda r, x: r["ts"] is not None and r["ts"] > datetime(2030, 1, 1)),
    ("ts < '1990-01-01T00:00:00'", lambda r, x: r["ts"] is not None and r["ts"] < datetime(1990, 1, 1)),
    ("d >= '2030-01-01'", lambda r, x: r["d"] is not None and r["d"] >= date(2030, 1, 1)),
    ("n > 0", lambda r, x: r["n"] is not None and r["n"] > 0),
    ("f > 1", lambda r, x: r["f"] is not None and (math.isnan(r["f"]) or r["f"] > 1)),   # NaN above every number
    ("f < -1", lambda r, x: r["f"] is not None and not math.isnan(r["f"]) and r["f"] < -1),
]


def _insert(conn: psycopg.Connection, rows: list[tuple[Any, ...]], first: int) -> None:
    with conn.cursor() as cur:
        cur.executemany("INSERT INTO t VALUES (%s, %s, %s::timestamp, %s::date, %s, %s, %s::jsonb, %s)",
                        [(first + i, note, ts, d, f, n, None if doc is None else json.dumps(doc), tags)
                         for i, (note, ts, d, f, n, doc, tags) in enumerate(rows)])


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(ROW, min_size=1, max_size=30), st.lists(ROW, max_size=10), st.lists(TEXT.filter(bool), min_size=1,
                                                                                       max_size=3))
def test_random_rows_copied_and_changed_are_read_with_data_skipping_as_without(pg_server, tmp_path_factory,
                                                                               copied, changed, texts):
    with fresh_database(pg_server, "stats") as dsn, psycopg.connect(dsn, autocommit=True) as conn, \
            pytest.MonkeyPatch.context() as patch:
        patch.setattr(table_copy, "COPY_CHUNK_ROWS", 3)   # a copy in row groups of 3 rows
        patch.setattr(delta_table, "ROW_GROUP", 3)
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, note text, ts timestamp, d date, f float8,"
                     " n numeric(12,2), doc jsonb, tags text[])")
        _insert(conn, copied, 0)
        conn.execute("SELECT replicator.create_queue('q')")
        conn.execute("SELECT replicator.add_table('q', 't')")
        path = tmp_path_factory.mktemp("stats") / "wh"
        target = DeltaTarget(str(path))
        try:
            consume(dsn, target)
            conn.execute("DELETE FROM t WHERE id % 3 = 0")   # deletion vectors in the copy's file
            _insert(conn, changed, 1000)
            consume(dsn, target)
        finally:
            target.close()
        assert_stats_bound_values(path, "public.t")
        uri = table_uris(str(path))["public.t"]
        rows = pa.table(DeltaTable(uri).scan().read_all()).to_pylist()
        for text in texts:
            for predicate, holds in PREDICATES:
                literal = "'" + text.replace("'", "''") + "'"
                where = predicate.format(text=literal)
                assert delta_rs_ids(uri, where) == sorted(r["id"] for r in rows if holds(r, text)), where
