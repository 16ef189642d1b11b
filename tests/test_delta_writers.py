"""The Delta warehouse beside other writers of its tables: Spark (DELETE, UPDATE, OPTIMIZE,
ALTER TABLE SET TBLPROPERTIES), delta-rs and `replicator delta optimize` commit to a replica
table between the consumer's commits (the consumer runs in-process, so each writer acts at a
known moment), and the table stays the source plus what they did, or the consumer refuses in
one line.

The oracle: the replica applies the source's changes as key-level upserts and deletes on top
of whatever the table holds; a row another writer deleted stays deleted, and one it updated
keeps its values, until the source changes that key again.
"""

from __future__ import annotations

import json
import random
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("deltalake")
from deltalake import DeltaTable, write_deltalake
from deltalake.exceptions import DeltaError

from consumer_helpers import forced_tick, run_cli
from replicator.errors import UserError
from replicator.targets.delta import maintenance
from replicator.targets.delta.maintenance import optimize
from replicator.targets.delta.reader import table_uris
from replicator.targets.delta.storage import LocalStorage
from replicator.targets.delta.target import DeltaTarget
from test_delta_target import _commit_by_hand, consume, log_commits

ROWS = 1000
DDL = f"""
    CREATE TABLE t (id bigint PRIMARY KEY, v text, n int NOT NULL DEFAULT 0);
    INSERT INTO t SELECT g, 'v' || g, 0 FROM generate_series(1, {ROWS}) g;
"""
Rows = dict[int, dict[str, Any]]


def replica(uri: str) -> Rows:
    """The table's live rows by id, as delta-rs reads them (two live rows of a key fail)."""
    rows = pa.table(DeltaTable(uri).scan().read_all()).to_pylist()
    out = {r["id"]: r for r in rows}
    assert len(out) == len(rows), f"{len(rows) - len(out)} rows with the id of another row"
    return out


def source(conn: Any, ids: list[int] | None = None) -> Rows:
    """The source's rows (of ids: those of them it has), as the replica holds them."""
    query = "SELECT id, v, n FROM t" + (" WHERE id = ANY(%s)" if ids is not None else "")
    return {r[0]: {"id": r[0], "v": r[1], "n": r[2]} for r in conn.execute(query, [ids] if ids is not None else [])}


class Model:
    """The table as the oracle wants it: the source's rows as of the batches the consumer applied,
    key by key, over what other writers did."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.rows = source(conn)
        self.changed: set[int] = set()   # keys the source changed since the last batch applied

    def source_changes(self, statement: str, ids: list[int]) -> None:
        self.conn.execute(statement)
        self.changed.update(ids)

    def batch_applied(self) -> None:
        now = source(self.conn, sorted(self.changed))
        for key in self.changed:
            if key in now:
                self.rows[key] = now[key]
            else:
                self.rows.pop(key, None)
        self.changed = set()


def setup(dsn: str, conn: Any, source_: Any, path: Path) -> tuple[DeltaTarget, str]:
    conn.execute(DDL)
    source_.create_queue("q")
    source_.add_table("q", "t")
    target = DeltaTarget(str(path))
    consume(dsn, target)
    return target, table_uris(str(path))["public.t"]


@pytest.fixture(autouse=True)
def purge_when_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """An idle tick purges at once, as it does once a table has been quiet for IDLE_PURGE_QUIET."""
    monkeypatch.setattr(maintenance, "IDLE_PURGE_QUIET", 0.0)


def idle_tick(dsn: str, conn: Any, target: DeltaTarget) -> None:
    """A batch that changes no table: the consumer purges a file's deleted rows then."""
    forced_tick(conn)
    consume(dsn, target)


# 1. each finding, alone -------------------------------------------------------------------------------

def test_replicator_delta_optimize_between_batches_does_not_crash_the_consumer_and_its_rows_stay(
        dsn, conn, source, tmp_path):
    path = tmp_path / "wh"
    target, uri = setup(dsn, conn, source, path)
    model = Model(conn)
    try:
        model.source_changes("UPDATE t SET n = n + 1 WHERE id % 20 = 0", list(range(20, ROWS + 1, 20)))
        consume(dsn, target)   # deletion vectors in the copy's file, and the consumer's index holds it
        model.batch_applied()
        optimized = run_cli(dsn, "delta", "optimize", "--target", f"delta:{path}", "--purge")
        assert optimized.returncode == 0, optimized.stderr
        idle_tick(dsn, conn, target)   # the consumer's purge finds the files gone
        model.source_changes("UPDATE t SET v = 'after' WHERE id IN (601, 602)", [601, 602])
        model.source_changes("DELETE FROM t WHERE id = 603", [603])
        consume(dsn, target)
        model.batch_applied()
    finally:
        target.close()
    assert replica(uri) == model.rows


def test_a_row_another_writer_marked_deleted_stays_deleted_after_an_idle_purge_lost_to_it(
        dsn, conn, source, tmp_path):
    """Another writer's deletion vector (as Spark's DELETE writes it) on a file the consumer's idle
    purge was rewriting: the purge gives up, and the next batch's vector for that file keeps the
    other writer's row deleted."""
    from replicator.targets.delta.table import ReplicaTable

    path = tmp_path / "wh"
    target, uri = setup(dsn, conn, source, path)
    model = Model(conn)
    try:
        model.source_changes("UPDATE t SET n = n + 1 WHERE id % 20 = 0", list(range(20, ROWS + 1, 20)))
        consume(dsn, target)
        model.batch_applied()
        other = ReplicaTable(LocalStorage(path), "public.t")   # another process's writer: row of id 599 deleted
        other.change((599,), True, (599, None, None))
        other.commit(None, None)
        model.rows.pop(599)
        idle_tick(dsn, conn, target)
        model.source_changes("UPDATE t SET v = 'after' WHERE id = 601", [601])
        consume(dsn, target)
        model.batch_applied()
    finally:
        target.close()
    assert replica(uri) == model.rows


def test_append_only_set_by_delta_rs_while_the_consumer_runs_stops_the_next_batch_in_one_line(
        dsn, conn, source, tmp_path):
    path = tmp_path / "wh"
    target, uri = setup(dsn, conn, source, path)
    try:
        conn.execute("UPDATE t SET n = n + 1 WHERE id = 5")
        consume(dsn, target)
        DeltaTable(uri).alter.set_table_properties({"delta.appendOnly": "true"})
        version = DeltaTable(uri).version()
        conn.execute("UPDATE t SET n = n + 1 WHERE id = 6")
        with pytest.raises(UserError) as refused:
            consume(dsn, target)
    finally:
        target.close()
    assert str(refused.value) == (
        f"{path}/public.t has delta.appendOnly = true, which another writer set: replicator updates and deletes "
        f"rows there; unset it (Spark: ALTER TABLE delta.`{path}/public.t` SET TBLPROPERTIES "
        f"('delta.appendOnly' = 'false'))")
    assert DeltaTable(uri).version() == version   # nothing written over it
    assert not any("remove" in a for c in log_commits(Path(uri))[version + 1:] for a in c)


def test_a_table_record_another_writer_replaced_stops_the_batch_in_one_line_naming_the_way_out(
        dsn, conn, source, tmp_path):
    """A RESTORE to before a schema change of the source (as Spark's RESTORE TABLE commits the older
    metaData) while the consumer runs: the table's replicator.table record is another writer's
    doing, not another consumer's."""
    path = tmp_path / "wh"
    target, uri = setup(dsn, conn, source, path)
    try:
        before = [a["metaData"] for c in log_commits(Path(uri)) for a in c if "metaData" in a][-1]
        conn.execute("ALTER TABLE t ADD COLUMN w text")
        conn.execute("UPDATE t SET w = 'w' WHERE id = 5")
        consume(dsn, target)
        _commit_by_hand(Path(uri), [{"metaData": before}])
        conn.execute("UPDATE t SET n = n + 1 WHERE id = 6")
        with pytest.raises(UserError) as refused:
            consume(dsn, target)
    finally:
        target.close()
    assert str(refused.value) == (
        f"{path}/public.t: its replicator.table record was changed by another writer; copy the table again: "
        f"`replicator consume ... --recopy`")


def test_the_columns_a_view_reads_are_paired_with_their_fields_by_attnum_after_another_writer_reorders_them(
        dsn, conn, source, tmp_path):
    """Another writer's reordering of the fields (the table's record keeps the source's order): a view's
    query sees each column under its own Delta name and type, the key under the key's."""
    from replicator.targets.delta.views import DeltaViews, ReadWarehouse, Session

    path = tmp_path / "wh"
    target, uri = setup(dsn, conn, source, path)
    target.close()
    metadata = [a["metaData"] for c in log_commits(Path(uri)) for a in c if "metaData" in a][-1]
    schema = json.loads(metadata["schemaString"])
    schema["fields"].reverse()
    _commit_by_hand(Path(uri), [{"metaData": {**metadata, "schemaString": json.dumps(schema)}}])
    info = DeltaViews(ReadWarehouse(LocalStorage(path)), Session(lambda: None))._catalog()("t")
    assert info is not None
    assert (info.columns, info.key) == ([("id", "bigint"), ("v", "text"), ("n", "integer")], ["id"])


# timestamptz keys and INT96 files, as Spark writes Parquet -----------------------------------------

def _optimize_as_spark_writes(table_dir: Path, *, int96: bool = True) -> None:
    """Another writer's OPTIMIZE of the table, its file written as Spark writes Parquet by default
    (spark.sql.parquet.outputTimestampType INT96: replicator's views set TIMESTAMP_MICROS for this
    reason, views.py _write): every live row into one new file, the old files removed."""
    live = pa.table(DeltaTable(str(table_dir)).scan().read_all())   # logical names
    metadata = [a["metaData"] for c in log_commits(table_dir) for a in c if "metaData" in a][-1]
    fields = json.loads(metadata["schemaString"])["fields"]
    physical = {f["name"]: f["metadata"]["delta.columnMapping.physicalName"] for f in fields}
    data = live.rename_columns([physical[n] for n in live.column_names])
    path = f"part-00000-{uuid.uuid4()}-c000.snappy.parquet"
    pq.write_table(data, table_dir / path, use_deprecated_int96_timestamps=int96)
    stats = {"numRecords": data.num_rows}
    actions: list[dict[str, Any]] = [
        {"remove": {"path": a["path"], "deletionTimestamp": 0, "dataChange": False, "extendedFileMetadata": True,
                    "partitionValues": {}, "size": a["size"], **({"deletionVector": a["deletionVector"]}
                                                                 if a.get("deletionVector") else {})}}
        for a in _live_adds(table_dir)]
    actions.append({"add": {"path": path, "partitionValues": {}, "size": (table_dir / path).stat().st_size,
                            "modificationTime": 0, "dataChange": False, "stats": json.dumps(stats)}})
    _commit_by_hand(table_dir, actions)


@pytest.mark.parametrize("int96", [True, False], ids=["int96", "micros"])
def test_a_timestamptz_keyed_table_after_another_writers_int96_rewrite_keeps_one_row_per_key(
        dsn, conn, source, tmp_path, int96):
    """After another writer rewrote the table's rows as Spark writes Parquet (INT96 timestamps:
    pyarrow reads them as naive timestamp[ns]), the consumer's key index (KeyIndex over
    canonical_keys: to_pylist values, naive datetimes there, aware ones in the batch) no longer
    finds those keys: an UPDATE of the source adds a second row of the key, a DELETE deletes nothing."""
    conn.execute("""
        CREATE TABLE tz (ts timestamptz PRIMARY KEY, v text);
        INSERT INTO tz SELECT '2024-01-01 00:00+00'::timestamptz + g * interval '1 hour', 'v' || g
                       FROM generate_series(1, 10) g;
    """)
    source.create_queue("q")
    source.add_table("q", "tz")
    path = tmp_path / "wh"
    target = DeltaTarget(str(path))
    try:
        consume(dsn, target)
        uri = table_uris(str(path))["public.tz"]
        _optimize_as_spark_writes(Path(uri), int96=int96)
        conn.execute("UPDATE tz SET v = 'updated' WHERE ts = '2024-01-01 01:00+00'")
        conn.execute("DELETE FROM tz WHERE ts = '2024-01-01 02:00+00'")
        consume(dsn, target)
    finally:
        target.close()
    rows = pa.table(DeltaTable(uri).scan().read_all()).to_pylist()
    expected = {r[0]: r[1] for r in conn.execute("SELECT ts, v FROM tz")}
    assert len(rows) == len(expected), f"{len(rows)} rows for {len(expected)} keys: {sorted(r['v'] for r in rows)}"
    assert {r["ts"]: r["v"] for r in rows} == expected


def test_a_timestamptz_keyed_row_spark_updated_is_replaced_by_the_sources_next_change_of_its_key(
        dsn, conn, source, tmp_path, spark):
    """docs/delta.md, Other writers: a row Spark updated keeps its values until the source changes
    that key again, then the key's row is the source's. Spark writes the updated row with an INT96
    timestamp (its default outputTimestampType): the consumer's index does not find it, and the key
    ends with two rows."""
    conn.execute("""
        CREATE TABLE tz (ts timestamptz PRIMARY KEY, v text);
        INSERT INTO tz SELECT '2024-01-01 00:00+00'::timestamptz + g * interval '1 hour', 'v' || g
                       FROM generate_series(1, 10) g;
    """)
    source.create_queue("q")
    source.add_table("q", "tz")
    path = tmp_path / "wh"
    target = DeltaTarget(str(path))
    try:
        consume(dsn, target)
        uri = table_uris(str(path))["public.tz"]
        spark.sql(f"UPDATE delta.`{uri}` SET v = 'spark' WHERE ts = TIMESTAMP '2024-01-01 01:00:00+00:00'")
        conn.execute("UPDATE tz SET v = 'source' WHERE ts = '2024-01-01 01:00+00'")
        consume(dsn, target)
    finally:
        target.close()
    rows = pa.table(DeltaTable(uri).scan().read_all()).to_pylist()
    expected = {r[0]: r[1] for r in conn.execute("SELECT ts, v FROM tz")}
    assert len(rows) == len(expected), f"{len(rows)} rows for {len(expected)} keys: {sorted(r['v'] for r in rows)}"
    assert {r["ts"]: r["v"] for r in rows} == expected


def test_replicators_optimize_of_a_file_spark_wrote_keeps_an_infinity_timestamp(dsn, conn, source, tmp_path):
    """A file another writer wrote as Spark writes Parquet (INT96 timestamps) holding timestamptz
    'infinity' (9999-12-31 23:59:59.999999 in the table): log.read_parquet reads INT96 as
    nanoseconds, which overflow past 2262, and _live_rows' cast refuses the wrapped value: the
    consumer's purge and `replicator delta optimize --purge` fail on it (ArrowInvalid, no one line)."""
    conn.execute("""
        CREATE TABLE ti (id int PRIMARY KEY, ts timestamptz);
        INSERT INTO ti SELECT g, CASE WHEN g = 1 THEN 'infinity'::timestamptz ELSE '2024-01-01 00:00+00' END
                       FROM generate_series(1, 10) g;
    """)
    source.create_queue("q")
    source.add_table("q", "ti")
    path = tmp_path / "wh"
    target = DeltaTarget(str(path))
    try:
        consume(dsn, target)
        uri = table_uris(str(path))["public.ti"]
        _optimize_as_spark_writes(Path(uri))
        conn.execute("DELETE FROM ti WHERE id = 5")   # a deletion vector on the file Spark wrote
        consume(dsn, target)
    finally:
        target.close()
    optimize(LocalStorage(path), everything=True)
    rows = {r["id"]: r["ts"] for r in pa.table(DeltaTable(uri).scan().read_all()).to_pylist()}
    assert len(rows) == 9 and rows[1].year == 9999


# 2. the randomized schedule: every writer at random moments between the consumer's commits ------------

APPENDED = 100_000   # keys other writers append from (the source's stay below)


class Schedule:
    """A seeded schedule of the source's batches, idle ticks and other writers' commits on one
    replica table, checked against the Model after each step."""

    def __init__(self, seed: int, dsn: str, conn: Any, path: Path, target: DeltaTarget, uri: str, spark: Any) -> None:
        self.rng = random.Random(seed)
        self.dsn, self.conn, self.path, self.target, self.uri, self.spark = dsn, conn, path, target, uri, spark
        self.model = Model(conn)
        self.step = 0
        self.done: list[str] = []

    def ids(self, count: int) -> list[int]:
        return sorted(self.rng.sample(sorted(self.model.rows), count))

    def run(self) -> None:
        """Each other writer once, in a random order, each followed by nothing, an idle tick (the
        consumer's purge then meets its commit), a batch, or both."""
        others = [self.spark_delete, self.spark_update, self.spark_optimize, self.spark_properties, self.append_only,
                  self.delta_rs_delete, self.delta_rs_append, self.delta_rs_optimize, self.replicator_optimize]
        self.rng.shuffle(others)
        followers: list[list[Any]] = [[], [self.idle], [self.source_batch], [self.idle, self.source_batch]]
        for other in others:
            for action in [other, *self.rng.choice(followers)]:
                self.act(action)
        self.act(self.source_batch)

    def act(self, action: Any) -> None:
        self.step += 1
        self.done.append(action.__name__)
        action()
        assert replica(self.uri) == self.model.rows, f"after {self.done}"

    def consume(self) -> None:
        consume(self.dsn, self.target)
        self.model.batch_applied()

    def source_batch(self) -> None:
        """Updates, deletes and inserts of the source, in one batch."""
        rng, n = self.rng, self.step
        ids = rng.sample(range(1, ROWS + 50), 12)
        for key in ids:
            kind = rng.random()
            self.model.source_changes(
                f"DELETE FROM t WHERE id = {key}" if kind < 0.2 else
                f"INSERT INTO t VALUES ({key}, 'b{n}-{key}', {n}) ON CONFLICT (id) DO UPDATE SET v = excluded.v, "
                f"n = t.n + 1", [key])
        self.consume()

    def idle(self) -> None:
        """A batch that changes nothing: the consumer purges a file's deleted rows."""
        forced_tick(self.conn)
        self.consume()

    def spark_delete(self) -> None:
        ids = self.ids(3)
        self.spark.sql(f"DELETE FROM delta.`{self.uri}` WHERE id IN ({', '.join(map(str, ids))})")
        for key in ids:
            self.model.rows.pop(key)

    def spark_update(self) -> None:
        ids = self.ids(3)
        self.spark.sql(f"UPDATE delta.`{self.uri}` SET v = 'spark {self.step}' WHERE id IN ({', '.join(map(str, ids))})")
        for key in ids:
            self.model.rows[key] = {**self.model.rows[key], "v": f"spark {self.step}"}

    def spark_optimize(self) -> None:
        self.spark.sql(f"OPTIMIZE delta.`{self.uri}`")

    def spark_properties(self) -> None:
        self.spark.sql(f"ALTER TABLE delta.`{self.uri}` SET TBLPROPERTIES ('test.step' = '{self.step}')")

    def delta_rs_delete(self) -> None:
        ids = self.ids(2)
        DeltaTable(self.uri).delete(f"id IN ({', '.join(map(str, ids))})")
        for key in ids:
            self.model.rows.pop(key)

    def delta_rs_append(self) -> None:
        key = APPENDED + self.step
        row = {"id": key, "v": f"delta-rs {self.step}", "n": self.step}
        write_deltalake(self.uri, pa.table({"id": pa.array([key], pa.int64()), "v": [row["v"]],
                                            "n": pa.array([self.step], pa.int32())}), mode="append")
        self.model.rows[key] = row

    def delta_rs_optimize(self) -> None:
        """delta-rs does not rewrite tables with column mapping: its documented refusal, the table unchanged."""
        version = DeltaTable(self.uri).version()
        with pytest.raises(DeltaError, match="Column mapping is not supported for write operation 'OPTIMIZE'"):
            DeltaTable(self.uri).optimize.compact()
        assert DeltaTable(self.uri).version() == version

    def replicator_optimize(self) -> None:
        optimize(LocalStorage(self.path), everything=True)

    def append_only(self) -> None:
        """Spark makes the table append-only: the next batch that removes rows is refused in one line,
        and applied once the property is unset."""
        where = f"{self.path}/public.t"
        self.spark.sql(f"ALTER TABLE delta.`{self.uri}` SET TBLPROPERTIES ('delta.appendOnly' = 'true')")
        key = self.rng.choice(sorted(self.model.rows.keys() & source(self.conn).keys()))   # a row the batch replaces
        self.model.source_changes(f"UPDATE t SET n = n + 1 WHERE id = {key}", [key])
        with pytest.raises(UserError) as refused:
            consume(self.dsn, self.target)
        assert str(refused.value) == (
            f"{where} has delta.appendOnly = true, which another writer set: replicator updates and deletes rows "
            f"there; unset it (Spark: ALTER TABLE delta.`{where}` SET TBLPROPERTIES ('delta.appendOnly' = 'false'))")
        assert replica(self.uri) == self.model.rows   # nothing written
        self.spark.sql(f"ALTER TABLE delta.`{self.uri}` SET TBLPROPERTIES ('delta.appendOnly' = 'false')")
        self.consume()


@pytest.mark.parametrize("seed", [1])   # each seed's schedule takes ~6 Spark commits: CI runs one
def test_the_replica_is_the_source_plus_what_other_writers_did_whenever_they_write(dsn, conn, source, tmp_path,
                                                                                    spark, seed):
    path = tmp_path / "wh"
    target, uri = setup(dsn, conn, source, path)
    try:
        Schedule(seed, dsn, conn, path, target, uri, spark).run()
    finally:
        target.close()


def test_replicator_delta_optimize_purges_rows_of_a_file_delta_rs_wrote(dsn, conn, source, tmp_path):
    """delta-rs writes text as string_view, which Arrow cannot filter: the rewrite casts it first."""
    path = tmp_path / "wh"
    target, uri = setup(dsn, conn, source, path)
    model = Model(conn)
    try:
        DeltaTable(uri).delete("id = 7")   # the copy's file rewritten by delta-rs
        model.rows.pop(7)
        model.source_changes("UPDATE t SET n = n + 1 WHERE id % 10 = 0", list(range(10, ROWS + 1, 10)))
        consume(dsn, target)   # deletion vectors in delta-rs' file
        model.batch_applied()
        assert [r.table for r in optimize(LocalStorage(path), everything=True)] == ["public.t"]
        assert not any(add.get("deletionVector") for add in _live_adds(Path(uri)))
        model.source_changes("UPDATE t SET v = 'after' WHERE id < 30", list(range(1, 30)))
        consume(dsn, target)
        model.batch_applied()
    finally:
        target.close()
    assert replica(uri) == model.rows


def _live_adds(table_dir: Path) -> list[dict[str, Any]]:
    live: dict[str, dict[str, Any]] = {}
    for commit in log_commits(table_dir):
        for action in commit:
            if "remove" in action:
                live.pop(action["remove"]["path"], None)
        for action in commit:
            if "add" in action:
                live[action["add"]["path"]] = action["add"]
    return list(live.values())


def test_a_column_another_writer_adds_stops_the_next_batch_in_one_line_naming_the_way_out(
        dsn, conn, source, tmp_path):
    """As Spark's ALTER TABLE ADD COLUMNS commits it (delta-rs refuses to alter a table with column
    mapping): the column, its id and physical name in the metadata."""
    path = tmp_path / "wh"
    target, uri = setup(dsn, conn, source, path)
    try:
        conn.execute("UPDATE t SET n = n + 1 WHERE id = 5")
        consume(dsn, target)
        metadata = [a["metaData"] for c in log_commits(Path(uri)) for a in c if "metaData" in a][-1]
        schema = json.loads(metadata["schemaString"])
        schema["fields"].append({"name": "theirs", "type": "string", "nullable": True, "metadata": {
            "delta.columnMapping.id": 99, "delta.columnMapping.physicalName": "col-theirs"}})
        configuration = {**metadata["configuration"], "delta.columnMapping.maxColumnId": "99"}
        _commit_by_hand(Path(uri), [{"metaData": {**metadata, "schemaString": json.dumps(schema),
                                                  "configuration": configuration}}])
        version = DeltaTable(uri).version()
        conn.execute("UPDATE t SET n = n + 1 WHERE id = 6")
        with pytest.raises(UserError) as refused:
            consume(dsn, target)
    finally:
        target.close()
    where = f"{path}/public.t"
    assert str(refused.value) == (
        f"{where}: another writer changed its columns (theirs added); replicator writes the columns of its "
        f"PostgreSQL table: undo the change (Spark: RESTORE TABLE delta.`{where}` TO VERSION AS OF the version "
        f"before it), or copy the table anew (consume --recopy)")
    assert DeltaTable(uri).version() == version
