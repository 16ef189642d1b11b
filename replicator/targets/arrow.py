"""PostgreSQL values as Arrow: the types and arrays of the Parquet files replicator writes
(the Delta tables) and of the typed streaming rows. See docs/spark.md,
"Type mapping"."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pyarrow as pa

from replicator.errors import UserError
from replicator.structure import Column

log = logging.getLogger("replicator")

_INT_TYPES = {"smallint": pa.int16(), "integer": pa.int32(), "bigint": pa.int64(),
              "oid": pa.int64(), "xid": pa.int64(), "cid": pa.int64()}
_TIMESTAMP_MAX = datetime(9999, 12, 31, 23, 59, 59, 999999)
DECIMAL_MAX_PRECISION = 38   # Spark's DecimalType



def decimal_type(column: Column) -> pa.DataType | None:
    """DECIMAL(p,s) for a numeric(p,s) column whose type Spark has (p <= 38, 0 <= s <= p);
    None for unconstrained numeric (any precision and scale, NaN, infinities), larger
    precisions, negative scales, and a domain (its typmod is not recorded)."""
    if column.base_type != "numeric" or column.category == "A":
        return None
    declared = re.fullmatch(r"numeric\((\d+),(-?\d+)\)", column.type)
    if declared is None:
        return None
    precision, scale = int(declared[1]), int(declared[2])
    if not (1 <= precision <= DECIMAL_MAX_PRECISION and 0 <= scale <= precision):
        return None
    return pa.decimal128(precision, scale)


def arrow_type(column: Column, *, decimals: bool = True) -> pa.DataType:
    """The Parquet/Spark type of a PostgreSQL column (see docs/spark.md, "Type mapping").
    numeric(p,s) is DECIMAL(p,s) where Spark has it (decimals=False: text, as a table
    copied before replicator stored decimals keeps it); json, arrays, intervals, uuids...
    stay text."""
    base = column.base_type
    if column.category == "A":
        return pa.string()
    if base in _INT_TYPES:
        return _INT_TYPES[base]
    if base == "boolean":
        return pa.bool_()
    if base == "real":
        return pa.float32()
    if base == "double precision":
        return pa.float64()
    if base == "bytea":
        return pa.binary()
    if base == "date":
        return pa.date32()
    if base == "timestamp without time zone":
        return pa.timestamp("us")
    if base == "timestamp with time zone":
        return pa.timestamp("us", tz="UTC")
    if decimals:
        return decimal_type(column) or pa.string()
    return pa.string()


_FLOATS = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


def _temporal(value: str | None, typ: pa.DataType) -> Any:
    """One date/timestamp text Arrow could not parse: infinities clamp to the
    ends of the range, values outside it (BC, past 9999) become NULL."""
    if value is None:
        return None
    if value in ("infinity", "-infinity"):
        if pa.types.is_date(typ):
            return datetime(9999, 12, 31).date() if value == "infinity" else datetime(1, 1, 1).date()
        end = _TIMESTAMP_MAX if value == "infinity" else datetime(1, 1, 1)
        return end.replace(tzinfo=UTC) if typ.tz else end
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    if pa.types.is_date(typ):
        return parsed.date()
    return parsed.astimezone(UTC) if typ.tz else parsed


def arrow_array(values: Sequence[Any], typ: pa.DataType, *, label: str = "") -> pa.Array:
    """Decoded consumer values (replicator.structure decoders) as an Arrow array (label:
    the table and column, named in a warning about NaN in a decimal column)."""
    if pa.types.is_floating(typ):
        try:
            return pa.array(values, type=typ)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):   # NaN, Infinity as text
            return pa.array([_FLOATS.get(v, v) if isinstance(v, str) else v for v in values], type=typ)
    if pa.types.is_boolean(typ):   # decoded as 0/1
        try:
            return pa.array(values, type=pa.int8()).cast(typ)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):
            return pa.array([None if v is None else bool(v) for v in values], type=typ)
    if pa.types.is_date(typ) or pa.types.is_timestamp(typ):
        try:
            return pa.array(values, type=pa.string()).cast(typ)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return pa.array([_temporal(v, typ) for v in values], type=typ)
    if pa.types.is_decimal(typ):
        try:   # PostgreSQL's text of a numeric(p,s) has the scale's digits: the cast is exact
            return pa.array(values, type=pa.string()).cast(typ)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):   # NaN, or values decoded otherwise
            return pa.array([_decimal(v, label) for v in values], type=typ)   # a value it would change raises
    if pa.types.is_integer(typ):
        try:   # inferred, not converted: pa.array(values, type=int64) truncates 5.7 to 5
            inferred = pa.array(values)
            if pa.types.is_integer(inferred.type) or pa.types.is_null(inferred.type):
                return inferred.cast(typ)   # safe: a value out of the type's range raises
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
            pass
        # oid, xid, cid: PostgreSQL's JSON has them as text
        return pa.array([_integer(v, typ, label) for v in values], type=typ)
    if pa.types.is_string(typ):
        try:
            return pa.array(values, type=typ)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):
            return pa.array([v if v is None or isinstance(v, str) else str(v) for v in values], type=typ)
    return pa.array(values, type=typ)


_nan_warned: set[str] = set()
_INTEGER_TEXT = re.compile(r"-?[0-9]+")   # PostgreSQL's text of an integer (ASCII digits only)


def _integer(value: Any, typ: pa.DataType, label: str) -> int | None:
    """One value for an integer column: an int, or an integer's text, in the type's range; anything
    else (a fraction, a bool, other digits) is refused rather than stored as another number."""
    if value is None:
        return None
    number = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and _INTEGER_TEXT.fullmatch(value):
        number = int(value)
    bits = typ.bit_width
    low, high = (-(1 << (bits - 1)), 1 << (bits - 1)) if pa.types.is_signed_integer(typ) else (0, 1 << bits)
    if number is None or not low <= number < high:
        raise UserError(f"{label}: {value!r} is not a value of its type {typ} (an integer from {low} to {high - 1})")
    return number


def _decimal(value: Any, label: str) -> Decimal | None:
    """One numeric value for a DECIMAL column: NaN, which a decimal cannot hold, is NULL
    (a warning per column and process); anything else must fit exactly."""
    if value is None:
        return None
    number = value if isinstance(value, Decimal) else Decimal(str(value))
    if number.is_nan():
        if label not in _nan_warned:
            _nan_warned.add(label)
            log.warning("%s: NaN in a numeric column is NULL in the warehouse (a DECIMAL has no NaN)", label)
        return None
    return number
