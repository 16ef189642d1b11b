"""numeric(p,s) in the Spark warehouse: DECIMAL(p,s) where Spark has the precision, exact
text where it does not, NaN as NULL with a warning; tables copied as text by an
older replicator keep their text until they are copied again."""

from __future__ import annotations

import logging
from decimal import Decimal

import pytest

pytest.importorskip("pyspark")

from replicator.consumer import Consumer
from replicator.spark import compact, read_table, read_view, register_views
from replicator.targets.spark.target import SparkTarget
from replicator.targets.spark.views import SparkViews
from replicator.targets.spark.warehouse import DECIMALS, Warehouse


def consume(dsn: str, target: SparkTarget) -> None:
    consumer = Consumer(dsn, "q", target)
    try:
        consumer.run(until_caught_up=True)
    finally:
        consumer.close()


def type_names(frame) -> dict[str, str]:
    return {f.name: f.dataType.simpleString() for f in frame.schema.fields}


def source_numerics(conn, table: str, columns: list[str]) -> dict[int, tuple]:
    """The rows as Decimals (NaN as None: what a DECIMAL column holds), text columns as text."""
    out = {}
    for row in conn.execute(f"SELECT id, {', '.join(columns)} FROM {table}"):
        out[row[0]] = tuple(None if isinstance(v, Decimal) and v.is_nan() else v for v in row[1:])
    return out


def test_numeric_with_a_precision_is_a_decimal_through_copy_logs_compaction_and_views(dsn, conn, source, tmp_path,
                                                                                       spark, caplog):
    conn.execute("CREATE TABLE m (id int PRIMARY KEY, amount numeric(12,2), fine numeric(38,10),"
                 " free numeric, huge numeric(40,2), whole numeric(5))")
    conn.execute("INSERT INTO m SELECT g, g * 1.25, g / 7.0, g / 3.0, 10.0 ^ 37 + g, g FROM generate_series(1, 200) g")
    conn.execute("INSERT INTO m VALUES (201, 'NaN', -0.0000000001, 'NaN', -1, -99999)")
    source.create_queue("q")
    source.add_table("q", "m")
    path = tmp_path / "wh"
    target = SparkTarget(path, spark=spark, compact_after_logs=0)
    try:
        caplog.set_level(logging.WARNING, logger="replicator")
        consume(dsn, target)   # the initial copy: the base
        assert Warehouse(path).read()["tables"]["public.m"][DECIMALS] is True
        frame = read_table(spark, path, "m")
        # a precision Spark has: DECIMAL; unconstrained numeric and precisions past 38: exact text
        assert type_names(frame) == {"id": "int", "amount": "decimal(12,2)", "fine": "decimal(38,10)",
                                     "free": "string", "huge": "string", "whole": "decimal(5,0)"}
        # the change logs carry the decimals too, and a view sums them as decimals
        conn.execute("UPDATE m SET amount = amount + 0.01, fine = fine * 2 WHERE id % 3 = 0")
        conn.execute("DELETE FROM m WHERE id % 10 = 0")
        conn.execute("INSERT INTO m VALUES (300, 9999999999.99, 1234567890123456789012345678.9012345678, 1e-30,"
                     " 5 * 10.0 ^ 37, 0)")
        consume(dsn, target)
        SparkViews(target.warehouse, lambda: spark).create(
            "totals", "SELECT whole % 4 AS bucket, sum(amount) AS total, max(amount) AS hi, count(*) AS n FROM m"
                      " GROUP BY whole % 4", "incremental")
        conn.execute("UPDATE m SET amount = amount * 2 WHERE id < 50")
        conn.execute("DELETE FROM m WHERE id BETWEEN 60 AND 70")
        consume(dsn, target)
        entry = Warehouse(path).read()["tables"]["public.m"]
        assert entry["logs"], "the changes are in change logs"

        def check() -> None:
            frame = read_table(spark, path, "m")
            got = {r["id"]: (r["amount"], r["fine"], r["free"], r["huge"], r["whole"]) for r in frame.collect()}
            expected = source_numerics(conn, "m", ["amount", "fine", "free::text", "huge::text", "whole"])
            assert got == expected
            register_views(spark, path)
            total = spark.sql("SELECT sum(amount) AS s, max(amount) AS hi FROM m")
            assert type_names(total) == {"s": "decimal(22,2)", "hi": "decimal(12,2)"}
            s, hi = conn.execute("SELECT sum(amount), max(amount) FROM m WHERE amount <> 'NaN'").fetchone()
            assert tuple(total.collect()[0]) == (s, hi)
            view = read_view(spark, path, "totals")
            assert type_names(view)["total"] == "decimal(22,2)" and type_names(view)["hi"] == "decimal(12,2)"
            expected_view = {tuple(r) for r in conn.execute(
                "SELECT whole % 4, sum(amount) FILTER (WHERE amount <> 'NaN'), max(amount) FILTER (WHERE amount <>"
                " 'NaN'), count(*) FROM m GROUP BY whole % 4")}
            assert {tuple(r) for r in view.collect()} == expected_view

        check()
        # compaction writes the base with Spark: the same types, the same values
        assert [c.committed for c in compact(spark, path)] == [True]
        assert Warehouse(path).read()["tables"]["public.m"]["logs"] == []
        check()
        nan_warnings = [r.getMessage() for r in caplog.records if "NaN" in r.getMessage()]
        assert nan_warnings == ["public.m.amount: NaN in a numeric column is NULL in the Spark warehouse (a DECIMAL "
                                "has no NaN)"], nan_warnings
    finally:
        target.close()


def test_a_table_copied_as_text_keeps_its_text_until_a_type_change_copies_it_as_decimal(dsn, conn, source,
                                                                                        tmp_path, spark):
    conn.execute("CREATE TABLE o (id int PRIMARY KEY, amount numeric(10,2))")
    source.create_queue("q")
    source.add_table("q", "o")
    path = tmp_path / "wh"
    target = SparkTarget(path, spark=spark, compact_after_logs=0)
    try:
        consume(dsn, target)   # the (empty) copy
    finally:
        target.close()
    # a warehouse of the replicator before decimals: its entries have no flag
    warehouse = Warehouse(path)
    with warehouse.lock():
        manifest = warehouse.read()
        del manifest["tables"]["public.o"][DECIMALS]
        warehouse.write(manifest)
    target = SparkTarget(path, spark=spark, compact_after_logs=0)
    try:
        conn.execute("INSERT INTO o SELECT g, g * 1.5 FROM generate_series(1, 50) g")
        consume(dsn, target)
        conn.execute("UPDATE o SET amount = 0.07 WHERE id = 7")
        consume(dsn, target)
        compact(spark, path)   # the base Spark writes follows the stored schema: text
        conn.execute("UPDATE o SET amount = 12345678.91 WHERE id = 8")
        consume(dsn, target)
        frame = read_table(spark, path, "o")
        assert type_names(frame) == {"id": "int", "amount": "string"}
        expected = {i: str(a) for i, a in conn.execute("SELECT id, amount FROM o")}
        assert {r["id"]: r["amount"] for r in frame.collect()} == expected
        # a type change copies the table again (the source's rule): now as DECIMAL
        generation = Warehouse(path).read()["tables"]["public.o"]["generation"]
        conn.execute("ALTER TABLE o ALTER COLUMN amount TYPE numeric(12,2)")
        conn.execute("UPDATE o SET amount = 9999999999.99 WHERE id = 9")
        consume(dsn, target)
        entry = Warehouse(path).read()["tables"]["public.o"]
        assert entry["generation"] != generation and entry[DECIMALS] is True
        frame = read_table(spark, path, "o")
        assert type_names(frame) == {"id": "int", "amount": "decimal(12,2)"}
        assert {r["id"]: r["amount"] for r in frame.collect()} == dict(conn.execute("SELECT id, amount FROM o"))
    finally:
        target.close()


def test_a_value_a_decimal_would_change_is_refused_not_rounded():
    import pyarrow as pa

    from replicator.targets.arrow import arrow_array

    typ = pa.decimal128(12, 2)
    assert arrow_array(["1.50", None, "-0.01"], typ).to_pylist() == [Decimal("1.50"), None, Decimal("-0.01")]
    for wrong in (["1.505"], [Decimal("1.505")], ["12345678901.00"]):
        with pytest.raises(pa.ArrowInvalid):
            arrow_array(wrong, typ)


def test_decimal_types_follow_the_declared_precision_and_scale():
    from replicator.structure import Column
    from replicator.targets.arrow import arrow_type

    def typ(declared: str, base: str = "numeric", *, decimals: bool = True) -> str:
        return str(arrow_type(Column("x", declared, base, "N", False, 1), decimals=decimals))

    assert typ("numeric(12,2)") == "decimal128(12, 2)"
    assert typ("numeric(38,38)") == "decimal128(38, 38)"
    assert typ("numeric(12,2)", decimals=False) == "string"   # a generation copied as text
    for declared in ("numeric", "numeric(39,2)", "numeric(5,-2)", "numeric(2,4)", "money_domain"):
        assert typ(declared) == "string", declared
