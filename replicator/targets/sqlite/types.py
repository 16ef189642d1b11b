"""The SQLite column type a PostgreSQL column is replicated as (its type affinity), and
how a numeric value is stored in it (see README.md, "SQLite type mapping").

numeric columns are NUMERIC by default: values are stored as SQLite integers (integral
values that fit 64 bits) or doubles, so they compare, sort and aggregate as numbers. A
double holds 15 significant digits exactly; a key column that may hold more (numeric
without precision, or of more than 15 digits) stays TEXT as PostgreSQL prints it, so
that two keys never become one row. With `sqlite:PATH?numeric=text` every numeric column
is TEXT as PostgreSQL prints it (the exact digits and scale, as before this choice).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from replicator.structure import FLOAT_TYPES, INTEGER_TYPES, Column, Decoder, RowsDecoder, identity, rows_decoder

NUMERIC_MODES = ("number", "text")
EXACT_DIGITS = 15    # significant digits every double holds exactly (DBL_DIG)

_PRECISION = re.compile(r"numeric\((\d+)")
_NON_FINITE = frozenset(("NaN", "Infinity", "-Infinity"))
_INFINITIES = frozenset(("infinity", "-infinity"))
_INT64 = range(-2**63, 2**63)
_EXACT_DOUBLE = 2.0**53   # below it every integer is a double exactly


def sqlite_type(column: Column, *, key: bool = False, numeric: str = "number") -> str:
    """SQLite column type (affinity) for a PostgreSQL column, a key column or not."""
    base = column.base_type
    if column.category == "A":
        return "TEXT"
    if base in INTEGER_TYPES or base == "boolean":
        return "INTEGER"
    if base in FLOAT_TYPES:
        return "REAL"
    if base == "numeric":
        exact = (m := _PRECISION.match(column.type)) is not None and int(m.group(1)) <= EXACT_DIGITS
        return "NUMERIC" if numeric == "number" and (exact or not key) else "TEXT"
    if base == "bytea":
        return "BLOB"
    return "TEXT"


def sqlite_number(value: Any) -> Any:
    """A numeric value, as the decoders give it (PostgreSQL's text), as a SQLite integer
    or double: converted by Python (correctly rounded; SQLite's own conversion of text
    keeps 15 digits). NaN and the infinities stay text, as PostgreSQL spells them."""
    if value is None or value in _NON_FINITE:
        return value
    number = float(value)
    if -_EXACT_DOUBLE < number < _EXACT_DOUBLE:
        return number     # SQLite stores an integral double in a NUMERIC column as an integer
    exact = Decimal(value)
    if exact == exact.to_integral_value() and int(exact) in _INT64:
        return int(exact)
    return number


# Tables made before the one date-time form (README.md, "SQLite type mapping") keep the
# form their rows have until they are copied again: new values are written back in it.
# It was PostgreSQL's rendering (trailing zeros of a fraction dropped, "0044-03-15 BC",
# "10000-01-01"), except for timestamptz in UTC with four-digit years, written by Python's
# isoformat() (no fraction when it is zero, else all six digits). A BC or past-9999
# timestamptz comes back in UTC (it was written in the writing session's time zone).
LEGACY_FORMS = 1
FORMS = 2


def _legacy_clock(clock: str) -> str:
    return clock.rstrip("0").rstrip(".") if "." in clock else clock


def _legacy_date(value: Any) -> Any:
    """"-0043-03-15" → "0044-03-15 BC", "+10000-01-01" → "10000-01-01"; with what follows
    the date written before the " BC"."""
    if value is None or value in _INFINITIES:
        return value
    end = value.index("-", 1) if value[0] in "+-" else 4
    year = int(value[:end])
    if year <= 0:
        return f"{1 - year:04d}{value[end:]} BC"
    return f"{year:04d}{value[end:]}"


def _legacy_timestamp(value: Any) -> Any:
    if value is None or value in _INFINITIES:
        return value
    at = value.index("T")
    return _legacy_date(value[:at] + "T" + _legacy_clock(value[at + 1:]))


def _legacy_timestamptz(value: Any) -> Any:
    if value is None or value in _INFINITIES:
        return value
    if value[4] == "-" and value[:4] != "0000":   # AD, four digits: as isoformat() wrote it
        return value[:19] + "+00:00" if value[19:26] == ".000000" else value
    legacy = _legacy_timestamp(value[:-6])
    return legacy[:-3] + "+00:00 BC" if legacy.endswith(" BC") else legacy + "+00:00"


def _legacy_timetz(value: Any) -> Any:
    if value is None:
        return None
    at = max(value.rfind("+"), value.rfind("-"))
    hours, minutes, *seconds = value[at:].split(":")
    offset = hours + (f":{minutes}" if minutes != "00" or seconds else "") + (f":{seconds[0]}" if seconds else "")
    return _legacy_clock(value[:at]) + offset


def _legacy_time(value: Any) -> Any:
    return None if value is None else _legacy_clock(value)


_LEGACY = {"timestamp with time zone": _legacy_timestamptz, "timestamp without time zone": _legacy_timestamp,
           "date": _legacy_date, "time without time zone": _legacy_time, "time with time zone": _legacy_timetz}


def value_adapters(columns: Sequence[Column], declared: Sequence[str], forms: int) -> list[Decoder]:
    """For each column (declared in SQLite as `declared`, in a table of `forms`), what
    turns a decoded value into the value its SQLite column stores: numeric values of
    NUMERIC columns as numbers (TEXT ones, of keys, of `numeric=text` replicas and of
    tables made before, keep the text), date-times of tables made before in their form."""
    adapters: list[Decoder] = []
    for column, declared_type in zip(columns, declared):
        if column.category == "A":
            adapters.append(identity)
        elif column.base_type == "numeric" and declared_type.upper() == "NUMERIC":
            adapters.append(sqlite_number)
        elif forms == LEGACY_FORMS and column.base_type in _LEGACY:
            adapters.append(_LEGACY[column.base_type])
        else:
            adapters.append(identity)
    return adapters


def adapter(adapters: Sequence[Decoder]) -> RowsDecoder | None:
    """One function applying the adapters to a list of rows; None when none changes anything."""
    return None if all(a is identity for a in adapters) else rows_decoder(adapters)
