"""The Delta warehouse as a Spark user meets it: real PostgreSQL, the real consumer, Spark
in local mode with Delta's jar (one session for the run: the `spark` fixture).

The tables are read by Spark alone (``spark.read.format("delta")``, replicator's
read_table/register_tables, SQL time travel, DESCRIBE HISTORY/DETAIL) and compared
value by value with the source through the oracle of tests/test_delta_target.py:
the Python values each documented Delta type holds (Decimal for numeric(p,s), UTC
instants for timestamptz, naive datetimes for timestamp...). Spark's rows come
through Arrow (DataFrame.toArrow), which keeps the types exactly.

Spark is slow here: each test makes few Spark actions, over small tables.
"""

from __future__ import annotations

import json
import shutil
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest

pytest.importorskip("pyspark")
pytest.importorskip("deltalake")
from deltalake import DeltaTable

from replicator.targets.delta import log as delta_log
from replicator.targets.delta.reader import read_table, register_tables, register_views, table_uris
from replicator.targets.delta.storage import LocalStorage
from replicator.targets.delta.target import DeltaTarget
from test_delta_target import consume, diff, log_commits, primary_key, source_state

State = tuple[list[str], dict[tuple[Any, ...], dict[str, Any]]]


def spark_rows(frame: Any, key: list[str]) -> State:
    """A DataFrame's column names and {key: row}, its values as Arrow gives them to Python."""
    data = frame.toArrow()
    rows = data.to_pylist()
    out = {tuple(r[k] for k in key): r for r in rows}
    assert len(out) == len(rows), f"{len(rows) - len(out)} rows with a key another row has"
    return data.column_names, out


def assert_same(name: str, expected: State, actual: State) -> None:
    problems = diff(name, expected, actual)
    assert not problems, f"{len(problems)} differences:\n" + "\n".join(problems[:30])


def database() -> str:
    """A catalog database of the test's own (the session and its catalog last the whole run)."""
    return f"replica_{uuid.uuid4().hex[:8]}"


# 1. the tables, their types, the catalog, every tick ----------------------------------------------

TYPES_DDL = """
    CREATE SCHEMA s;
    CREATE TABLE t (id bigint PRIMARY KEY, amount numeric(12,2), ts timestamptz, tsn timestamp, d date,
                    flag boolean, small smallint, i int, f float8, r real, blob bytea, v text, doc jsonb,
                    tags text[], big numeric, u uuid, gone int);
    INSERT INTO t SELECT g, g * 10.25, '2024-03-01 12:00+05'::timestamptz + g * interval '1 day 1 second',
                         '2024-03-01 12:00'::timestamp + g * interval '1 minute', '2024-03-01'::date + g,
                         g % 2 = 0, g % 300, g * 1000, g / 7.0, g / 4.0, decode(md5(g::text), 'hex'), 'v' || g,
                         jsonb_build_object('g', g, 'list', jsonb_build_array(1, 'two')), ARRAY['a' || g, NULL],
                         g * 123456789012345678.000001, md5(g::text)::uuid, g
                  FROM generate_series(1, 400) g;
    UPDATE t SET f = 'NaN' WHERE id = 1;
    UPDATE t SET f = 'Infinity', r = '-Infinity' WHERE id = 2;
    UPDATE t SET amount = NULL, ts = NULL, tsn = NULL, d = NULL, flag = NULL, blob = NULL, v = NULL WHERE id = 3;
    UPDATE t SET v = E'tab\\there, new\\nline, \u00fcn\u00efc\u00f8d\u00e9', amount = -9999999999.99 WHERE id = 4;
    CREATE TABLE s.u (k text PRIMARY KEY, cnt int NOT NULL DEFAULT 0, at timestamptz);
    INSERT INTO s.u SELECT 'k' || g, g, '2000-01-01 00:00+00'::timestamptz + g * interval '1 hour'
                    FROM generate_series(1, 50) g;
"""
STEPS = [   # one batch each, after the copy
    ["UPDATE t SET amount = amount + 0.01, v = v || '!' WHERE id % 3 = 0",   # updates, deletes, key changes
     "DELETE FROM t WHERE id BETWEEN 100 AND 109", "UPDATE t SET id = id + 1000 WHERE id BETWEEN 200 AND 204",
     "INSERT INTO t (id, amount, ts, v) VALUES (5000, 1.5, '1999-12-31 23:59:59.999999-08', 'new')",
     "UPDATE s.u SET cnt = cnt + 1 WHERE cnt % 2 = 0", "UPDATE s.u SET k = k || '+' WHERE k = 'k7'",
     "DELETE FROM s.u WHERE k = 'k8'"],
    ["ALTER TABLE t ADD COLUMN extra text", "UPDATE t SET extra = 'x' || id WHERE id % 5 = 0"],
    ["ALTER TABLE t RENAME COLUMN v TO label", "UPDATE t SET label = 'renamed' WHERE id = 6"],
    ["ALTER TABLE t DROP COLUMN gone", "DELETE FROM t WHERE id = 7"],
    ["ALTER TABLE s.u ALTER COLUMN cnt TYPE bigint", "UPDATE s.u SET cnt = cnt * 1000000000 WHERE k = 'k9'"],
    ["TRUNCATE s.u", "INSERT INTO s.u VALUES ('after truncate', 1, now())", "UPDATE t SET amount = 0 WHERE id < 20"],
]
SPARK_TYPES = {"id": "bigint", "amount": "decimal(12,2)", "ts": "timestamp", "tsn": "timestamp_ntz", "d": "date",
               "flag": "boolean", "small": "smallint", "i": "int", "f": "double", "r": "float", "blob": "binary",
               "label": "string", "doc": "string", "tags": "string", "big": "string", "u": "string",
               "extra": "string"}


def test_spark_reads_every_table_equal_to_the_source_with_the_documented_types_now_and_as_of_each_tick(
        dsn, conn, source, tmp_path, spark):
    conn.execute(TYPES_DDL)
    source.create_queue("q")
    source.add_table("q", "t")
    source.add_table("q", "s.u")
    path = tmp_path / "wh"
    url = f"delta:{path}"
    states: list[tuple[int, dict[str, State]]] = []   # (tick, {table: the source then})
    target = DeltaTarget(str(path))
    try:
        for statements in [[], *STEPS]:
            for statement in statements:
                conn.execute(statement)
            consume(dsn, target)
            [tick] = target.positions("q").values()
            states.append((tick, {"t": source_state(conn, "t"), "s.u": source_state(conn, "s.u")}))
    finally:
        target.close()
    keys = {"t": primary_key(conn, "t"), "s.u": primary_key(conn, "s.u")}
    now = states[-1][1]

    # now: by path with Spark alone, and through replicator's reader
    frame = spark.read.format("delta").load(str(path / "public.t"))
    assert {f.name: f.dataType.simpleString() for f in frame.schema.fields} == SPARK_TYPES
    assert_same("t", now["t"], spark_rows(frame, keys["t"]))
    assert_same("s.u", now["s.u"], spark_rows(read_table(spark, url, "s.u"), keys["s.u"]))
    [total] = spark.sql(f"SELECT sum(amount) AS total FROM delta.`{path / 'public.t'}`").toArrow().to_pylist()
    assert total == {"total": conn.execute("SELECT sum(amount) FROM t").fetchone()[0]}
    assert isinstance(total["total"], Decimal)

    # the session's catalog: replica.t, and replica.s__u for a schema other than public
    db = database()
    assert sorted(register_tables(spark, url, db)) == [f"`{db}`.`s__u`", f"`{db}`.`t`"]
    assert_same("t", now["t"], spark_rows(spark.table(f"{db}.t"), keys["t"]))
    assert_same("s.u", now["s.u"], spark_rows(spark.sql(f"SELECT * FROM {db}.s__u"), keys["s.u"]))
    # registered again over another warehouse (a copy): the names follow it; and as temporary
    # views, named as in the catalog
    other = tmp_path / "other"
    shutil.copytree(path, other)
    register_tables(spark, f"delta:{other}", db)
    location = spark.sql(f"DESCRIBE DETAIL {db}.t").first()["location"]
    assert location.removeprefix("file:").rstrip("/") == str(other / "public.t")
    assert_same("t", now["t"], spark_rows(spark.table(f"{db}.t"), keys["t"]))
    assert sorted(register_views(spark, url)) == ["s__u", "t"]
    assert_same("t", now["t"], spark_rows(spark.table("t"), keys["t"]))

    # every tick that changed a table, with Spark's time travel to the version the tick left
    for n, (tick, then) in enumerate(states):
        for name in ("t", "s.u"):
            if n == 0 or then[name] != states[n - 1][1][name]:
                assert_same(f"{name}@{tick}", then[name],
                            spark_rows(read_table(spark, url, name, tick=tick), keys[name]))


# 2. the log as Spark shows it, and Spark writing the tables between batches -----------------------

WRITERS_DDL = """
    CREATE TABLE t (id int PRIMARY KEY, v text, cnt int NOT NULL DEFAULT 0, at timestamp);
    INSERT INTO t SELECT g, 'v' || g, 0, '2024-01-01'::timestamp + g * interval '1 hour' FROM generate_series(1, 600) g;
"""


def _batches_until_version(dsn: str, conn: psycopg.Connection, target: DeltaTarget, uri: str, version: int) -> None:
    """Batches of a few changes until the table is at the version (the next commit is version + 1)."""
    round_ = 0
    while DeltaTable(uri).version() < version:
        round_ += 1
        conn.execute("UPDATE t SET cnt = cnt + 1 WHERE id %% 50 = %s", (round_ % 50,))
        conn.execute("DELETE FROM t WHERE id = %s", (500 + round_,))
        consume(dsn, target)
    assert DeltaTable(uri).version() == version, "the consumer's OPTIMIZE moved the table past the version"


def test_spark_shows_our_commits_and_features_and_its_own_writes_between_batches_keep_the_table_exact(
        dsn, conn, source, tmp_path, spark):
    conn.execute(WRITERS_DDL)
    source.create_queue("q")
    source.add_table("q", "t")
    path = tmp_path / "wh"
    target = DeltaTarget(str(path))
    try:
        consume(dsn, target)
        uri = table_uris(str(path))["public.t"]
        table = f"delta.`{uri}`"
        _batches_until_version(dsn, conn, target, uri, 3)

        history = spark.sql(f"DESCRIBE HISTORY {table}").toArrow().to_pylist()
        ours = [commit[0]["commitInfo"] for commit in log_commits(Path(uri))]
        assert [(h["version"], h["operation"], h["engineInfo"]) for h in sorted(history, key=lambda h: h["version"])] \
            == [(n, info["operation"], "replicator") for n, info in enumerate(ours)]
        assert {"CREATE OR REPLACE TABLE", "MERGE"} <= {h["operation"] for h in history}
        [detail] = spark.sql(f"DESCRIBE DETAIL {table}").toArrow().to_pylist()
        assert (detail["minReaderVersion"], detail["minWriterVersion"]) == (3, 7)
        assert set(detail["tableFeatures"]) >= {"columnMapping", "deletionVectors", "timestampNtz"}, detail
        properties = dict(detail["properties"])
        assert properties["delta.columnMapping.mode"] == "name"
        assert properties["delta.enableDeletionVectors"] == "true"
        assert detail["numFiles"] == len(DeltaTable(uri).file_uris())

        # a user's UPDATE in Spark, reverted by the source's next change of those rows; a user's DELETE,
        # mirrored in the source; then the consumer goes on (its next commit comes after Spark's)
        spark.sql(f"UPDATE {table} SET v = 'by spark', cnt = -1 WHERE id <= 5")
        spark.sql(f"DELETE FROM {table} WHERE id BETWEEN 10 AND 12")
        conn.execute("DELETE FROM t WHERE id BETWEEN 10 AND 12")
        conn.execute("UPDATE t SET cnt = cnt + 1 WHERE id <= 5 OR id % 7 = 0")
        consume(dsn, target)
        assert_same("t after Spark's UPDATE and DELETE", source_state(conn, "t"),
                    spark_rows(spark.read.format("delta").load(uri), ["id"]))

        # Spark's OPTIMIZE as the tenth version: Spark checkpoints it; then batches change rows of the
        # files it wrote, by this consumer and by one started anew (which reads Spark's checkpoint)
        _batches_until_version(dsn, conn, target, uri, 9)
        spark.sql(f"OPTIMIZE {table}")
        assert (Path(uri) / "_delta_log" / f"{10:020d}.checkpoint.parquet").exists()
        conn.execute("UPDATE t SET cnt = cnt + 1, v = v || '.' WHERE id % 4 = 0")
        conn.execute("UPDATE t SET id = id + 1000 WHERE id BETWEEN 300 AND 302")
        consume(dsn, target)
    finally:
        target.close()
    conn.execute("UPDATE t SET cnt = cnt + 1 WHERE id % 5 = 0")
    conn.execute("DELETE FROM t WHERE id BETWEEN 20 AND 25")
    target = DeltaTarget(str(path))
    try:
        consume(dsn, target)
    finally:
        target.close()
    operations = [commit[0]["commitInfo"]["operation"] for commit in log_commits(Path(uri))]
    assert {"UPDATE", "DELETE", "OPTIMIZE"} <= set(operations), operations
    assert_same("t", source_state(conn, "t"), spark_rows(spark.read.format("delta").load(uri), ["id"]))
    assert conn.execute("SELECT count(*) FROM t WHERE cnt = 0").fetchone()[0] < 600


# 3. a table as the writer leaves it between OPTIMIZEs ------------------------------------------------

def test_spark_reads_a_table_of_many_small_files_with_deletion_vectors_a_checkpoint_and_renamed_columns(
        dsn, conn, source, tmp_path, spark, monkeypatch):
    from replicator.targets.delta import maintenance

    # the table as the writer leaves it between OPTIMIZEs: the consumer's own (after 8 small files,
    # and while idle) are held off
    monkeypatch.setattr(maintenance, "due", lambda table: False)
    monkeypatch.setattr(maintenance, "purge_next", lambda tables: None)
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text, cnt int NOT NULL DEFAULT 0, note text)")
    conn.execute("INSERT INTO t SELECT g, 'v' || g, 0, 'n' || g FROM generate_series(1, 2000) g")
    source.create_queue("q")
    source.add_table("q", "t")
    path = tmp_path / "wh"
    target = DeltaTarget(str(path))
    try:
        consume(dsn, target)
        [first_tick] = target.positions("q").values()
        first = source_state(conn, "t")
        for n in range(24):
            conn.execute("UPDATE t SET cnt = cnt + 1 WHERE id BETWEEN %s AND %s", (n * 12 + 1, n * 12 + 12))
            conn.execute("DELETE FROM t WHERE id = %s", (1000 + n,))
            if n:   # a row of the last batch's file: a deletion vector in a small file too
                conn.execute("UPDATE t SET cnt = cnt + 10 WHERE id = %s", (n * 12 - 11,))
            if n == 20:
                conn.execute("ALTER TABLE t RENAME COLUMN v TO label")
            if n == 22:
                conn.execute("ALTER TABLE t RENAME COLUMN note TO v")   # the old name, another column
            consume(dsn, target)
    finally:
        target.close()
    uri = table_uris(str(path))["public.t"]
    files = delta_log.load(LocalStorage(path), "public.t").files.values()
    assert len(files) > 20 and sum(1 for f in files if f.get("deletionVector")) > 1, files
    checkpoint = json.loads((Path(uri) / "_delta_log" / "_last_checkpoint").read_text())["version"]
    assert 0 < checkpoint < DeltaTable(uri).version(), "Spark reads a checkpoint and the commits after it"
    assert [c[0]["commitInfo"]["operation"] for c in log_commits(Path(uri))].count("OPTIMIZE") == 0

    frame = spark.read.format("delta").load(uri)
    assert frame.columns == ["id", "label", "cnt", "v"]
    assert_same("t", source_state(conn, "t"), spark_rows(frame, ["id"]))
    assert_same(f"t@{first_tick}", first, spark_rows(read_table(spark, f"delta:{path}", "t", tick=first_tick), ["id"]))
