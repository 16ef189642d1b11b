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

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

pytest.importorskip("deltalake")
from deltalake import DeltaTable

from consumer_helpers import forced_tick, run_cli
from replicator.errors import UserError
from replicator.targets.delta.reader import table_uris
from replicator.targets.delta.target import DeltaTarget
from test_delta_target import consume, log_commits

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
    from replicator.targets.delta.storage import LocalStorage
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
