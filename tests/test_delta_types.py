"""Every PostgreSQL type of docs/delta.md's type mapping, copied and changed through the queue,
becomes the documented Delta type holding the documented value: read back with delta-rs, and
once with Spark. The oracle renders the source in SQL as the docs say each type is written
(a number, PostgreSQL's text, its JSON text...), and time/timetz in the docs' form, independently
of replicator.structure and replicator.targets.arrow.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest

pytest.importorskip("deltalake")

from replicator.errors import UserError
from replicator.targets.arrow import arrow_array
from replicator.targets.delta.reader import table_uris
from replicator.targets.delta.target import DeltaTarget
from test_delta_target import consume, delta_rows, diff, log_commits
from types_helpers import TIMES, TYPES, change, create, documented_time


def documented_value(name: str, value: Any) -> Any:
    if value is None:
        return None
    if name in TIMES:
        return documented_time(value)
    if isinstance(value, memoryview):
        return bytes(value)
    if isinstance(value, datetime) and value.tzinfo is not None:
        return value.astimezone(UTC)
    return value


def documented_state(conn: psycopg.Connection) -> tuple[list[str], dict[tuple[Any, ...], dict[str, Any]]]:
    """Table t as docs/delta.md says the Delta table holds it: its column names and {(id,): row}."""
    names = ["id"] + [name for name, *_ in TYPES]
    renders = ["id"] + [render.format(name) for name, _, _, _, render in TYPES]
    rows = conn.execute(f"SELECT {', '.join(renders)} FROM t").fetchall()
    state = {}
    for values in rows:
        row = {name: documented_value(name, value) for name, value in zip(names, values)}
        state[(row["id"],)] = row
    return names, state


def delta_types(table_dir: Path) -> dict[str, str]:
    """{column: Delta type} of the table's latest schema, from its log."""
    schemas = [a["metaData"]["schemaString"] for commit in log_commits(table_dir) for a in commit if "metaData" in a]
    return {f["name"]: f["type"] for f in json.loads(schemas[-1])["fields"]}


def replicate_every_type(dsn: str, conn: psycopg.Connection, source: Any, path: Path) -> None:
    """Rows copied, then changed through the queue, each step consumed into warehouse path."""
    create(conn, copied=True)
    source.create_queue("q")
    source.add_table("q", "t")
    target = DeltaTarget(str(path))
    try:
        consume(dsn, target)
        change(conn)
        consume(dsn, target)
    finally:
        target.close()


def test_every_documented_type_is_copied_and_changed_into_its_documented_delta_type_and_value(
        dsn, conn, source, tmp_path):
    path = tmp_path / "wh"
    replicate_every_type(dsn, conn, source, path)
    assert delta_types(path / "public.t") == {"id": "integer", **{name: typ for name, _, typ, _, _ in TYPES}}
    expected = documented_state(conn)
    assert sorted(expected[1]) == [(1,), (2,), (4,), (5,), (6,)]
    problems = diff("t", expected, delta_rows(table_uris(str(path))["public.t"], ["id"]))
    assert not problems, f"{len(problems)} differences:\n" + "\n".join(problems)


SPARK_NAMES = {"short": "smallint", "integer": "int", "long": "bigint"}   # Spark's names of Delta's types


def test_spark_reads_every_documented_type_as_delta_rs_does(dsn, conn, source, tmp_path, spark):
    path = tmp_path / "wh"
    replicate_every_type(dsn, conn, source, path)
    frame = spark.read.format("delta").load(str(path / "public.t"))
    assert {f.name: f.dataType.simpleString() for f in frame.schema.fields} == {
        "id": "int", **{name: SPARK_NAMES.get(typ, typ) for name, _, typ, _, _ in TYPES}}
    data = frame.toArrow()
    rows = {(r["id"],): r for r in data.to_pylist()}
    problems = diff("t", documented_state(conn), (data.column_names, rows))
    assert not problems, f"{len(problems)} differences:\n" + "\n".join(problems)


# integers given as text (oid, xid, cid): arrow_array takes an integer's text, nothing else ----------

@pytest.mark.parametrize("value", [5.7, "\u0663\u0664"])
def test_an_int64_column_refuses_a_value_that_is_not_an_integers_text_rather_than_storing_another_number(value):
    """arrow_array's integer fallback is int(v): a float is truncated (5.7 → 5), and digits of other
    scripts (Arabic-Indic '٣٤', which PostgreSQL's integer input refuses) are taken as 34 silently."""
    with pytest.raises(UserError):
        arrow_array([value], pa.int64(), label="public.t.o")


@pytest.mark.parametrize("value", ["5.5", "", str(2 ** 64)])
def test_an_int64_column_refuses_a_value_that_is_no_int64_in_one_line_naming_the_column(value):
    """int('5.5') and int('') raise ValueError, 2**64 OverflowError (not caught at all): a traceback
    ('internal error') where a UserError naming the column is due, as arrow_array's decimal path gives."""
    with pytest.raises(UserError, match=r"public\.t\.o"):
        arrow_array([value], pa.int64(), label="public.t.o")
