"""PostgreSQL columns as Kafka Connect fields, typed as Debezium's PostgreSQL connector types
them (time.precision.mode=adaptive, interval.handling.mode=numeric, binary.handling.mode=bytes,
decimal.handling.mode as chosen): per column the field's schema, the JSON text of a value as
replicator's decoders give it (replicator.structure), the way back from the parsed JSON, and
the value's exact text where the field's type cannot hold it (docs/kafka.md, "Records")."""

from __future__ import annotations

import json
import math
import re
from base64 import b64decode
from binascii import b2a_base64
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from json.encoder import encode_basestring
from typing import Any

from replicator.structure import Column, decoder_for, parse_json
from replicator.targets.kafka import temporal
from replicator.targets.kafka.defaults import default_value

NON_FINITE = frozenset(("NaN", "Infinity", "-Infinity"))
DECIMAL_MODES = ("precise", "string", "double")
# What Debezium writes for PostgreSQL's infinities: for timestamps pgjdbc's PGStatement numbers;
# for dates PostgreSQL's own (the 32-bit extremes of days since 2000, which the move to 1970
# wraps around to June 5877611 BC).
TIMESTAMP_INFINITY_MICROS = {"infinity": 9_223_372_036_825_200_000, "-infinity": -9_223_372_036_832_400_000}
DATE_INFINITY_DAYS = {"infinity": -2_147_472_692, "-infinity": -2_147_472_691}
# decimal.handling.mode=string spells the special values with Java's enum names
_SPECIAL_DECIMAL_NAMES = {"NaN": "NAN", "Infinity": "POSITIVE_INFINITY", "-Infinity": "NEGATIVE_INFINITY"}
_DECIMAL_SPECIALS = {name: text for text, name in _SPECIAL_DECIMAL_NAMES.items()}
_LONG_DIGITS = 4000    # int() and str() refuse decimals past 4300 digits (sys.get_int_max_str_digits)
_LONG_NUMBER = 10**_LONG_DIGITS
_TYPMOD = re.compile(r"\((\d+)(?:,(-?\d+))?\)")


@dataclass(frozen=True)
class FieldCodec:
    """How the values of one column are one field of a Connect struct."""
    schema: dict[str, Any]             # the field's Connect schema, without "optional" and "field"
    encode: Callable[[Any], str]       # a decoded value (not None) -> the payload's JSON text
    decode: Callable[[Any], Any]       # the parsed payload value (not None) -> the decoded value
    # A decoded value (not None) -> its exact text when `encode` loses it (else None); no
    # function when it never does.
    exact: Callable[[Any], str | None] | None = None
    # The payload Debezium writes for a required field without a value (the columns a delete's
    # `before` does not have): its converters' fallback, a zero.
    fallback: str = "0"
    # The JSON text PostgreSQL's to_json writes for a decoded value as an array element: an
    # array whose text is its elements' so written needs no exact text.
    render: Callable[[Any], str] = encode_basestring
    # The encoding as an expression of `{v}` (and of `q`, encode_basestring), for the generated
    # struct encoders; None: a call of `encode`.
    inline: str | None = None


def connect_schema(schema: dict[str, Any], *, optional: bool, field_name: str | None = None) -> dict[str, Any]:
    """A Connect schema in the key order JsonConverter writes: the type and its parts,
    "optional", then name, version, doc, parameters, default; then the field's name."""
    ordered: dict[str, Any] = {k: schema[k] for k in ("type", "items", "keys", "values", "fields") if k in schema}
    ordered["optional"] = optional
    ordered.update((k, v) for k, v in schema.items() if k not in ordered)
    if field_name is not None:
        ordered["field"] = field_name
    return ordered


def _named(literal: str, name: str, **parameters: str) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": literal, "name": name, "version": 1}
    if parameters:
        schema["parameters"] = parameters
    return schema


# integers, booleans, floats, text --------------------------------------------------------------

_INT_TYPES = {"smallint": "int16", "integer": "int32", "bigint": "int64", "oid": "int64", "xid": "int64",
              "cid": "int64"}


def _integer(literal: str, column: Column) -> FieldCodec:
    # oid, xid and cid come out of the capture as text (json_build_array quotes them)
    textual = column.base_type in ("oid", "xid", "cid")
    return FieldCodec({"type": literal}, encode=str, decode=str if textual else identity, render=str,
                      inline="{v}")


def identity(value: Any) -> Any:
    """The decode of a field whose parsed JSON value is the decoded value (a follower's generated
    decoders read such a field as it is)."""
    return value


def _boolean() -> FieldCodec:
    return FieldCodec({"type": "boolean"}, encode=lambda v: "true" if v else "false", decode=int,
                      fallback="false", render=lambda v: "true" if v else "false",
                      inline='("true" if {v} else "false")')


def _float_text(value: Any) -> str:
    """JSON for a float; NaN and the infinities quoted as Jackson writes Java's (and as
    PostgreSQL spells them)."""
    return repr(value) if value.__class__ is float else f'"{value}"'


def _float(literal: str) -> FieldCodec:
    return FieldCodec({"type": literal}, encode=_float_text, decode=identity, fallback="0.0", render=_float_text)


def _string(name: str | None = None) -> FieldCodec:
    schema = _named("string", name) if name else {"type": "string"}
    return FieldCodec(schema, encode=encode_basestring, decode=identity, fallback='""', inline="q({v})")


def _other(value: Any) -> str:
    """A value of a type without its own field as a string (composites, ranges... are text
    already; a JSON value inside an array is written back as JSON)."""
    return encode_basestring(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))


def _text(schema_name: str | None = None) -> FieldCodec:
    return FieldCodec(_string(schema_name).schema, encode=_other, decode=identity, fallback='""', render=_other)


# numeric -------------------------------------------------------------------------------------

def _b64(data: bytes) -> str:
    return b2a_base64(data, newline=False).decode("ascii")


def _int(digits: str) -> int:
    return int(digits) if len(digits) < _LONG_DIGITS else int(Decimal(digits))


def _digits(number: int) -> str:
    return str(number) if -_LONG_NUMBER < number < _LONG_NUMBER else str(Decimal(number))


def unscaled_bytes(number: int) -> bytes:
    """Big-endian two's complement in the fewest bytes, as Java's BigInteger.toByteArray()."""
    return number.to_bytes((number if number >= 0 else ~number).bit_length() // 8 + 1, "big", signed=True)


def _unscaled(data: str) -> int:
    return int.from_bytes(b64decode(data), "big", signed=True)


def _scale_of(text: str) -> int:
    point = text.find(".")
    return 0 if point < 0 else len(text) - point - 1


def decimal_text(unscaled: int, scale: int) -> str:
    """PostgreSQL's text of unscaled * 10**-scale: `scale` digits after the point."""
    if scale <= 0:
        return _digits(unscaled * 10**-scale)
    digits = _digits(abs(unscaled)).rjust(scale + 1, "0")
    return f"{'-' if unscaled < 0 else ''}{digits[:-scale]}.{digits[-scale:]}"


def _fixed_decimal(column: Column, precision: int, scale: int) -> FieldCodec:
    """numeric(p,s): Connect's Decimal of scale s. NaN and the infinities, which it cannot hold
    (Debezium stops on them), are null, or Debezium's fallback zero in a NOT NULL column."""
    special = '"AA=="' if column.not_null else "null"

    def encode(text: str) -> str:
        if text in NON_FINITE:
            return special
        digits = text.replace(".", "")
        shift = scale - _scale_of(text)
        if shift >= 0:
            return f'"{_b64(unscaled_bytes(_int(digits) * 10**shift))}"'
        return f'"{_b64(unscaled_bytes(round(Decimal(text).scaleb(scale))))}"'   # finer than its type: rounded

    def exact(text: str) -> str | None:
        return text if text in NON_FINITE or _scale_of(text) > max(scale, 0) else None

    schema = _named("bytes", "org.apache.kafka.connect.data.Decimal", scale=str(scale),
                    **{"connect.decimal.precision": str(precision)})
    return FieldCodec(schema, encode=encode, decode=lambda data: decimal_text(_unscaled(data), scale), exact=exact,
                      fallback='"AA=="', render=_numeric_render)


_VARIABLE_SCALE = {"type": "struct", "fields": [{"type": "int32", "optional": False, "field": "scale"},
                                                {"type": "bytes", "optional": False, "field": "value"}],
                   "name": "io.debezium.data.VariableScaleDecimal", "version": 1, "doc": "Variable scaled decimal"}


def _variable_decimal(column: Column) -> FieldCodec:
    """numeric without a scale: Debezium's VariableScaleDecimal, of the scale PostgreSQL shows
    (Debezium drops trailing zeros: 1.50 is scale 2 here, 1 there; the same number)."""
    special = '{"scale":0,"value":"AA=="}' if column.not_null else "null"

    def encode(text: str) -> str:
        if text in NON_FINITE:
            return special
        return f'{{"scale":{_scale_of(text)},"value":"{_b64(unscaled_bytes(_int(text.replace(".", ""))))}"}}'

    return FieldCodec(_VARIABLE_SCALE, encode=encode,
                      decode=lambda data: decimal_text(_unscaled(data["value"]), data["scale"]),
                      exact=lambda text: text if text in NON_FINITE else None,
                      fallback='{"scale":0,"value":"AA=="}', render=_numeric_render)


def _double_text(text: str) -> str:
    if text in NON_FINITE:
        return f'"{text}"'
    number = float(text)
    return _float_text(number) if math.isfinite(number) else f'"{"-" if number < 0 else ""}Infinity"'


def _double_decimal() -> FieldCodec:
    """decimal.handling.mode=double: the nearest double; the exact text when the double's
    shortest text is another."""
    def exact(text: str) -> str | None:
        return None if text in NON_FINITE or repr(float(text)) == text else text

    return FieldCodec({"type": "double"}, encode=_double_text,
                      decode=lambda v: v if isinstance(v, str) else repr(v), exact=exact, fallback="0.0",
                      render=_numeric_render)


def _string_decimal() -> FieldCodec:
    """decimal.handling.mode=string: PostgreSQL's text, the special values as Debezium names them."""
    return FieldCodec({"type": "string"}, encode=lambda v: f'"{_SPECIAL_DECIMAL_NAMES.get(v, v)}"',
                      decode=lambda v: _DECIMAL_SPECIALS.get(v, v), fallback='""', render=_numeric_render)


def _numeric_render(text: str) -> str:
    return f'"{text}"' if text in NON_FINITE else text


def _numeric(column: Column, decimals: str) -> FieldCodec:
    if decimals == "double":
        return _double_decimal()
    if decimals == "string":
        return _string_decimal()
    typmod = _TYPMOD.search(column.type) if column.type.startswith("numeric(") else None
    if typmod is None:
        return _variable_decimal(column)
    return _fixed_decimal(column, int(typmod[1]), int(typmod[2] or 0))


# binary and bit strings -----------------------------------------------------------------------

def _bytea() -> FieldCodec:
    return FieldCodec({"type": "bytes"}, encode=lambda v: f'"{_b64(v)}"', decode=b64decode, fallback='""',
                      render=lambda v: f'"\\\\x{v.hex()}"')


def _bits(column: Column) -> FieldCodec:
    """bit(1) is a boolean; longer bit strings are Debezium's Bits: the bits as one number in
    little-endian bytes, its length the declared one (2^31 - 1 for varbit without one)."""
    typmod = _TYPMOD.search(column.type)
    declared = int(typmod[1]) if typmod else None
    if column.base_type == "bit" and declared == 1:
        return FieldCodec({"type": "boolean"}, encode=lambda v: "true" if v == "1" else "false",
                          decode=lambda v: "1" if v else "0", fallback="false")
    fixed = declared if column.base_type == "bit" else None

    def encode(bits: str) -> str:
        number = int(bits, 2) if bits else 0
        return f'"{_b64(number.to_bytes((number.bit_length() + 7) // 8, "little"))}"'

    def decode(data: str) -> str:
        number = int.from_bytes(b64decode(data), "little")
        if fixed is not None:
            return format(number, f"0{fixed}b")
        return format(number, "b") if number else ""

    def exact(bits: str) -> str | None:
        return None if fixed is not None or bits == (bits.lstrip("0") or "") else bits

    return FieldCodec(_named("bytes", "io.debezium.data.Bits", length=str(declared or 2**31 - 1)),
                      encode=encode, decode=decode, exact=exact, fallback='""')


# date-times ------------------------------------------------------------------------------------

def _precision(column: Column) -> int | None:
    typmod = _TYPMOD.search(column.type)
    return int(typmod[1]) if typmod else None


def _date() -> FieldCodec:
    def encode(date: str) -> str:
        days = DATE_INFINITY_DAYS.get(date)
        return str(temporal.epoch_days(date) if days is None else days)

    def decode(days: int) -> str:
        for text, sentinel in DATE_INFINITY_DAYS.items():
            if days == sentinel:
                return text
        return temporal.date_text(days)

    return FieldCodec(_named("int32", "io.debezium.time.Date"), encode=encode, decode=decode)


def _time(column: Column) -> FieldCodec:
    """time(0..3) in milliseconds (Time), else microseconds (MicroTime), since midnight."""
    precision = _precision(column)
    if precision is not None and precision <= 3:
        return FieldCodec(_named("int32", "io.debezium.time.Time"),
                          encode=lambda v: str(temporal.clock_micros(v) // 1000),
                          decode=lambda ms: temporal.clock_text(ms * 1000))
    return FieldCodec(_named("int64", "io.debezium.time.MicroTime"), encode=lambda v: str(temporal.clock_micros(v)),
                      decode=temporal.clock_text)


def _timestamp(column: Column) -> FieldCodec:
    """timestamp(0..3) in milliseconds (Timestamp), else microseconds (MicroTimestamp), since
    1970; the infinities as Debezium's. A timestamp at or past the positive infinity's number
    (year 294247) is written as infinity, with its exact text."""
    precision = _precision(column)
    unit = 1000 if precision is not None and precision <= 3 else 1
    infinities = {text: micros // unit for text, micros in TIMESTAMP_INFINITY_MICROS.items()}
    beyond = infinities["infinity"]

    def encode(timestamp: str) -> str:
        number = infinities.get(timestamp)
        if number is None:
            number = min(temporal.epoch_micros(timestamp) // unit, beyond)
        return str(number)

    def exact(timestamp: str) -> str | None:
        if timestamp in infinities or timestamp[0] != "+":   # only years past 9999 can reach it
            return None
        return timestamp if temporal.epoch_micros(timestamp) // unit >= beyond else None

    def decode(number: int) -> str:
        for text, sentinel in infinities.items():
            if number == sentinel:
                return text
        return temporal.timestamp_text(number * unit)

    name = "io.debezium.time.Timestamp" if unit == 1000 else "io.debezium.time.MicroTimestamp"
    return FieldCodec(_named("int64", name), encode=encode, decode=decode, exact=exact)


def _timestamptz(column: Column) -> FieldCodec:
    """ZonedTimestamp: ISO 8601 in UTC with "Z", as many fractional digits as the column's
    precision (six without one, none for timestamptz(0)); the infinities as PostgreSQL's."""
    kept = _precision(column)
    kept = 6 if kept is None else kept
    cut = len("+00:00") + 6 - kept + (kept == 0)    # from the one form: the offset, the digits not kept (and ".")

    def encode(timestamp: str) -> str:
        if timestamp[-1] == "y":    # infinity
            return f'"{timestamp}"'
        return f'"{timestamp[:-cut]}Z"'

    def decode(text: str) -> str:
        if text[-1] == "y":
            return text
        body = text[:-1]
        point = body.rfind(".")
        if point < 0:
            return f"{body}.000000+00:00"
        return f"{body[:point + 1]}{body[point + 1:].ljust(6, '0')}+00:00"

    return FieldCodec(_named("string", "io.debezium.time.ZonedTimestamp"), encode=encode, decode=decode,
                      fallback='"1970-01-01T00:00:00Z"')


def _timetz() -> FieldCodec:
    """ZonedTime: the time of day in UTC; the exact text when the offset was not +00:00."""
    return FieldCodec(_named("string", "io.debezium.time.ZonedTime"),
                      encode=lambda v: f'"{temporal.utc_clock(v)}"', decode=temporal.timetz_from_utc,
                      exact=lambda v: None if v.endswith("+00:00") else v, fallback='"00:00:00Z"')


def _interval() -> FieldCodec:
    """MicroDuration, Debezium's approximation (a month is 30.4375 days); the exact text unless
    the interval is hours, minutes and seconds only."""
    def exact(interval: str) -> str | None:
        return None if temporal.clock_interval_text(temporal.interval_micros(interval)) == interval else interval

    return FieldCodec(_named("int64", "io.debezium.time.MicroDuration"),
                      encode=lambda v: str(temporal.interval_micros(v)), decode=temporal.clock_interval_text,
                      exact=exact)


# arrays --------------------------------------------------------------------------------------

def _flatten(value: Any) -> list[Any]:
    """The elements of a (multidimensional) array, in PostgreSQL's order."""
    if not isinstance(value, list):
        return [value]
    return [e for item in value for e in _flatten(item)] if any(isinstance(v, list) for v in value) else value


def _array(column: Column, decimals: str) -> FieldCodec:
    """A Connect array of the element type's field: PostgreSQL's JSON text parsed and each
    element decoded as a column of that type would be. The exact text when the array is
    multidimensional, an element loses its value, or PostgreSQL's JSON of the decoded
    elements is another text (its spellings of floats and date-times)."""
    # int2vector and the like are arrays without "[]": elements of no known type
    typed = column.base_type.endswith("[]")
    element = Column(name=column.name, type=column.type[:-2] if typed else "", category="",
                     base_type=column.base_type[:-2] if typed else "", not_null=False)
    element_decoder = decoder_for(element)
    codec = codec_for(element, decimals)
    encode_element, element_exact = codec.encode, codec.exact

    def elements(text: str) -> list[Any]:
        return [None if e is None else element_decoder(e) for e in _flatten(parse_json(text))]

    def encode(text: str) -> str:
        return f"[{','.join('null' if e is None else encode_element(e) for e in elements(text))}]"

    def decode(items: list[Any]) -> str:
        return f"[{','.join('null' if e is None else codec.render(codec.decode(e)) for e in items)}]"

    def exact(text: str) -> str | None:
        values = elements(text)
        if element_exact is not None and any(e is not None and element_exact(e) is not None for e in values):
            return text
        rendered = f"[{','.join('null' if e is None else codec.render(e) for e in values)}]"
        return None if rendered == text else text

    schema = {"type": "array", "items": connect_schema(codec.schema, optional=True)}
    return FieldCodec(schema, encode=encode, decode=decode, exact=exact, fallback="[]")


# the mapping ---------------------------------------------------------------------------------

_STRING_NAMES = {"uuid": "io.debezium.data.Uuid", "json": "io.debezium.data.Json", "jsonb": "io.debezium.data.Json",
                 "xml": "io.debezium.data.Xml", "ltree": "io.debezium.data.Ltree",
                 "tsvector": "io.debezium.data.Tsvector"}
_STRING_TYPES = {"text", "character varying", "character", '"char"', "name", "citext"}


def codec_for(column: Column, decimals: str = "precise") -> FieldCodec:   # noqa: C901 -- a flat case per type
    """The field of a column (docs/kafka.md, "Records", has the table)."""
    base = column.base_type
    if column.category == "A" or base.endswith("[]"):
        return _array(column, decimals)
    if base in _INT_TYPES:
        return _integer(_INT_TYPES[base], column)
    if base == "boolean":
        return _boolean()
    if base == "real":
        return _float("float")
    if base == "double precision":
        return _float("double")
    if base == "numeric":
        return _numeric(column, decimals)
    if base == "bytea":
        return _bytea()
    if base in ("bit", "bit varying"):
        return _bits(column)
    if base == "date":
        return _date()
    if base == "time without time zone":
        return _time(column)
    if base == "time with time zone":
        return _timetz()
    if base == "timestamp without time zone":
        return _timestamp(column)
    if base == "timestamp with time zone":
        return _timestamptz(column)
    if base == "interval":
        return _interval()
    if base in _STRING_TYPES:
        return _string()
    return _text(_STRING_NAMES.get(base))


@dataclass(frozen=True)
class ColumnField:
    """A column as a field of the table's Connect structs."""
    column: Column
    codec: FieldCodec
    schema: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        schema = self.codec.schema
        default = default_value(self.column)
        if default is not None and schema["type"] != "struct":   # Connect takes no struct default (KAFKA-12694)
            schema = {**schema, "default": json.loads(self.codec.encode(default))}
        object.__setattr__(self, "schema", connect_schema(schema, optional=not self.column.not_null,
                                                          field_name=self.column.name))

    @property
    def missing(self) -> str:
        """The payload of the field without a value: null, or Debezium's fallback when required."""
        return self.codec.fallback if self.column.not_null else "null"
