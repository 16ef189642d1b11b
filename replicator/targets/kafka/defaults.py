"""Column defaults as the `default` of their Connect fields, as Debezium's PostgreSQL connector
(3.6, PostgresDefaultValueConverter) writes them: the default expression PostgreSQL shows
(pg_get_expr) parsed when it is one literal, optionally cast ('x'::text, -5 as '-5'::integer);
a function call or CURRENT_DATE-like keyword (now(), nextval(...), gen_random_uuid()) as
Debezium's placeholder for the type (0, "", false, 1970-01-01...); anything else, and the
types Debezium has no parser for, without a default. A sink that adds a NOT NULL column
(Debezium's JDBC sink: ALTER TABLE ... ADD COLUMN ... NOT NULL DEFAULT) needs it."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation
from typing import Any

from replicator.structure import Column, decoder_for

# Debezium's: a call, possibly parenthesized and followed by more (now() + '1 day'::interval)
_FUNCTION = re.compile(r"[(]?[A-Za-z0-9_.]+\((?:.+(?:, ?.+)*)?\)")
_CURRENT = frozenset(("current_timestamp", "current_time", "current_date", "localtime", "localtimestamp"))
_QUOTED = re.compile(r"B?'((?:[^']|'')*)'(?:::[^']+)?")   # B'101': a bit string, as older PostgreSQL shows one
_BARE = re.compile(r"-?[0-9][0-9.eE+-]*|true|false")
_TYPMOD_SCALE = re.compile(r"numeric\(\d+,(-?\d+)\)")

_INTEGER_BITS = {"smallint": 16, "integer": 32, "bigint": 64}
_DATE = re.compile(r"\d{4}-\d\d-\d\d|-?infinity")
_CLOCK = r"\d\d:\d\d:\d\d(?:\.\d{1,6})?"
_TIME = re.compile(_CLOCK)
_TIMESTAMP = re.compile(rf"\d{{4}}-\d\d-\d\d {_CLOCK}|-?infinity")
_TIMESTAMPTZ = re.compile(rf"\d{{4}}-\d\d-\d\d {_CLOCK}[+-]\d\d(?::\d\d){{0,2}}|-?infinity")
_INTERVAL = re.compile(r"(?:[+-]?\d+ (?:year|mon|day)s?(?: |$))*(?:[+-]?\d+:\d\d:\d\d(?:\.\d+)?)?")
_NON_FINITE = frozenset(("NaN", "Infinity", "-Infinity"))


def _integer(bits: int) -> Callable[[str], Any]:
    def parse(text: str) -> int | None:
        number = int(text)
        return number if -2**(bits - 1) <= number < 2**(bits - 1) else None
    return parse


def _numeric(column: Column) -> Callable[[str], Any]:
    """PostgreSQL's text of the value the column stores: rounded to the column's scale."""
    typmod = _TYPMOD_SCALE.fullmatch(column.type)

    def parse(text: str) -> str | None:
        number = Decimal(text)
        if not number.is_finite():
            return None   # BigDecimal has no NaN: Debezium gives none
        if typmod is not None:
            number = number.quantize(Decimal(1).scaleb(-int(typmod[1])), rounding=ROUND_HALF_UP)
        return f"{number:f}"
    return parse


def _float(text: str) -> Any:
    return text if text in _NON_FINITE else float(text)


def _boolean(text: str) -> int | None:
    return {"true": 1, "false": 0}.get(text)


def _bits(text: str) -> str | None:
    return text if set(text) <= {"0", "1"} else None


def _matching(pattern: re.Pattern[str], decode: Callable[[Any], Any] = str, spaced: bool = False
              ) -> Callable[[str], Any]:
    """A date-time in PostgreSQL's ISO DateStyle (anything else: no default), as the capture's
    decoder gives it."""
    def parse(text: str) -> Any:
        if pattern.fullmatch(text) is None:
            return None
        return decode(text.replace(" ", "T", 1) if spaced else text)
    return parse


def _uuid(text: str) -> str:
    return str(uuid.UUID(text))


def _text(text: str) -> str:
    return text


def _parser(column: Column) -> tuple[Callable[[str], Any], str | None] | None:
    """How a literal of the column's type becomes the value the capture's decoder gives, and
    Debezium's placeholder for a generated default (None: no default); None for a type Debezium
    gives no default."""
    base = column.base_type
    if column.category == "E":
        return _text, None
    if base in _INTEGER_BITS:
        return _integer(_INTEGER_BITS[base]), "0"
    if base == "numeric":
        return _numeric(column), "0.0"
    if base in ("real", "double precision"):
        return _float, "0.0"
    if base == "boolean":
        return _boolean, "false"
    if base in ("bit", "bit varying"):
        return _bits, None
    if base in ("text", "character varying", "character", "xml"):
        return _text, ""
    if base in ("json", "jsonb"):
        return _text, "{}"
    if base == "uuid":
        return _uuid, "00000000-0000-0000-0000-000000000000"
    decoder = decoder_for(column)
    if base == "date":
        return _matching(_DATE, decoder), "1970-01-01"
    if base == "time without time zone":
        return _matching(_TIME, decoder), "00:00:00"
    if base == "timestamp without time zone":
        return _matching(_TIMESTAMP, decoder, spaced=True), "1970-01-01 00:00:00"
    if base == "timestamp with time zone":
        return _matching(_TIMESTAMPTZ, decoder), "1970-01-01 00:00:00+00"
    if base == "interval":
        return _matching(_INTERVAL), None
    return None


def _literal(expression: str) -> str | None:
    """The text of a default that is one literal, optionally cast; else None."""
    quoted = _QUOTED.fullmatch(expression)
    if quoted is not None:
        return quoted[1].replace("''", "'")
    return expression if _BARE.fullmatch(expression) else None


def default_value(column: Column) -> Any | None:
    """The column's default as the capture's decoder would give it, for the field's encoder;
    None when the field gets no `default`."""
    expression = (column.default or "").strip()
    parser = _parser(column)
    if not expression or expression.startswith("NULL") or parser is None or column.category == "A":
        return None
    parse, placeholder = parser
    generated = _FUNCTION.match(expression) is not None or expression.lower() in _CURRENT
    text = placeholder if generated else _literal(expression)
    if text is None:
        return None
    try:
        return parse(text)
    except (ValueError, InvalidOperation):
        return None
