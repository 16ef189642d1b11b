"""Sets of key values compared as Spark compares them, with pyarrow on the driver.

An incremental view refresh looks rows up by value on the driver (the old rows
of changed keys, rows an equi-join pairs with changed rows, the view's stored
keys) rather than in a Spark job, whose fixed cost is most of a small refresh.
Keys are compared as Spark's ``<=>`` does: NULL equals NULL; -0.0 equals 0.0
and NaN equals NaN (Spark normalizes them in joins and groups). Each key column
is first made canonical, so that files written by pyarrow and by Spark (other
timestamp units, INT96, other integer widths) compare: integers, booleans,
dates and timestamps (as microseconds) become int64, floats and decimals their
exact text, strings and binaries stay. Other types (nested, intervals) have no
canonical form here: callers fall back to Spark for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

Columns = Sequence[pa.Array | pa.ChunkedArray]


_MICROS = {"s": 1_000_000, "ms": 1_000, "us": 1, "ns": None}


def canonical(values: pa.Array | pa.ChunkedArray) -> pa.ChunkedArray:
    """A key column in its canonical form; NULLs stay NULL."""
    if isinstance(values, pa.Array):
        values = pa.chunked_array([values], values.type)
    typ = values.type
    if pa.types.is_timestamp(typ):
        raw = values.cast(pa.timestamp(typ.unit)).cast(pa.int64())   # the instant (UTC), without the zone
        factor = _MICROS[typ.unit]
        return pc.divide(raw, 1000) if factor is None else pc.multiply(raw, factor)
    if pa.types.is_date(typ):
        return values.cast(pa.date32()).cast(pa.int32()).cast(pa.int64())
    if pa.types.is_integer(typ) or pa.types.is_boolean(typ):
        return values.cast(pa.int64())
    if pa.types.is_floating(typ):
        # x + 0.0 turns -0.0 into 0.0; the shortest text that reads back as the value
        # is exact and one per value (NaN is "nan" whatever its bits)
        return pc.add(values.cast(pa.float64()), 0.0).cast(pa.string())
    if pa.types.is_decimal(typ):
        return values.cast(pa.string())
    if pa.types.is_large_string(typ):
        return values.cast(pa.string())
    if pa.types.is_large_binary(typ):
        return values.cast(pa.binary())
    if pa.types.is_string(typ) or pa.types.is_binary(typ):
        return values
    raise TypeError(f"no canonical form for key type {typ}")


_EMPTY = {pa.int64(): pa.scalar(0, pa.int64()), pa.string(): pa.scalar("", pa.string()),
          pa.binary(): pa.scalar(b"", pa.binary())}


class KeySet:
    """A set of key tuples, NULL-safe, that masks the rows of other key columns."""

    def __init__(self, columns: Columns) -> None:
        self.width = len(columns)
        self.columns = [canonical(c) for c in columns]
        self.size = len(self.columns[0]) if self.columns else 0

    @cached_property
    def _lookup(self) -> pa.Array | pa.Table:
        """What mask looks rows up in, built once: the values (one column) or the
        (is NULL, value) pairs (several)."""
        if self.width == 1:
            return self.columns[0].combine_chunks()
        return pa.table(_pairs(self.columns))

    def mask(self, columns: Columns) -> pa.ChunkedArray:
        """Which rows of these key columns (in the set's order) are in the set."""
        assert len(columns) == self.width
        values = [canonical(c) for c in columns]
        n = len(values[0])
        if self.width == 1:
            return pc.is_in(values[0], value_set=self._lookup, skip_nulls=False)
        # several columns: a semi-join on (is NULL, value or a filler) pairs, which have no
        # NULL (a hash join never matches NULLs); the rows found are marked by position
        left = _pairs(values)
        positions = row_numbers(n)
        left["_replicator_row"] = positions
        found = pa.table(left).join(self._lookup, keys=[k for k in left if k != "_replicator_row"],
                                    join_type="left semi").column("_replicator_row")
        return pa.chunked_array([pc.is_in(positions, value_set=found.combine_chunks())])

    def keep(self, table: pa.Table, columns: list[str], *, inside: bool = True) -> pa.Table:
        """The rows of a table whose key (these columns) is in the set (or, inside
        False, is not)."""
        if not table.num_rows or not self.size:
            return table.slice(0, 0) if inside else table
        mask = self.mask([table.column(c) for c in columns])
        return table.filter(mask if inside else pc.invert(mask))


def row_numbers(n: int) -> pa.Array:
    """0, 1, ... n - 1."""
    return pa.array(np.arange(n, dtype=np.int64))


def _pairs(values: list[pa.ChunkedArray]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for j, v in enumerate(values):
        out[f"_replicator_n{j}"] = pc.is_null(v)
        out[f"_replicator_v{j}"] = pc.fill_null(v, _EMPTY[v.type])
    return out


def category(typ: pa.DataType) -> str | None:
    """The kind of values a column holds, as Spark compares them without a cast: two
    columns of one category compare in canonical form as Spark's `=` does; of two
    (an integer and a string, a date and a timestamp) Spark casts one first, which
    canonical forms do not follow."""
    if pa.types.is_integer(typ):
        return "integer"
    if pa.types.is_timestamp(typ):
        return "timestamp" if typ.tz else "timestamp_ntz"
    if pa.types.is_decimal(typ):   # the text of a decimal has its scale's digits
        return f"decimal({typ.scale})"
    for name, test in (("boolean", pa.types.is_boolean), ("float", pa.types.is_floating), ("date", pa.types.is_date),
                       ("string", lambda t: pa.types.is_string(t) or pa.types.is_large_string(t)),
                       ("binary", lambda t: pa.types.is_binary(t) or pa.types.is_large_binary(t))):
        if test(typ):
            return name
    return None


def _groups(table: pa.Table, columns: list[str]) -> pa.Table:
    """The distinct values of these columns with their row counts (count_all),
    compared in canonical form, NULLs together: as Spark groups them."""
    values = pa.table({f"c{j}": canonical(table.column(c)) for j, c in enumerate(columns)})
    return values.group_by(values.column_names).aggregate([([], "count_all")])


def distinct(table: pa.Table, columns: list[str]) -> int:
    """How many distinct values these columns hold."""
    return _groups(table, columns).num_rows if table.num_rows else 0


def largest_group(table: pa.Table, columns: list[str]) -> int:
    """How many rows of the table share the most common value of these columns; 0
    for no rows."""
    if not table.num_rows:
        return 0
    largest: int = pc.max(_groups(table, columns).column("count_all")).as_py()
    return largest


def spark_arrow_type(spark_type: Any) -> pa.DataType | None:
    """The Arrow type a key column of this Spark type is written with (Spark reads it back
    as that type); None for types outside the canonical ones."""
    from pyspark.sql import types as T
    simple = {T.LongType: pa.int64(), T.IntegerType: pa.int32(), T.ShortType: pa.int16(), T.ByteType: pa.int8(),
              T.BooleanType: pa.bool_(), T.DoubleType: pa.float64(), T.FloatType: pa.float32(),
              T.StringType: pa.string(), T.BinaryType: pa.binary(), T.DateType: pa.date32(),
              T.TimestampType: pa.timestamp("us", tz="UTC"), T.TimestampNTZType: pa.timestamp("us")}
    for cls, typ in simple.items():
        if type(spark_type) is cls:
            return typ
    if isinstance(spark_type, T.DecimalType):
        return pa.decimal128(spark_type.precision, spark_type.scale)
    return None
