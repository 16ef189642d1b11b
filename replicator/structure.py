"""Table schema model: the structure a source table reports, and how its
column values are decoded from the capture encoding into target values.

The capture encoding (replicator.capture_row_json) is a JSON array of values.
Decoding keeps PostgreSQL's exact renderings where a Python type would lose
them: numerics stay text (the SQLite target makes numbers of them in
NUMERIC columns: targets/sqlite/types.py), json/arrays stay their JSON text;
date-times get one ISO 8601 form (below).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

Decoder = Callable[[Any], Any]

INTEGER_TYPES = {"smallint", "integer", "bigint", "oid", "xid", "cid"}
FLOAT_TYPES = {"real", "double precision"}

# One JSON parser for events, the copy and the join-back: numbers that are not
# integers stay text, so numeric values keep their exact digits and scale.
_JSON = json.JSONDecoder(parse_float=str)
# set by JSONDecoder.__init__; typeshed does not declare it
_scan_json: Callable[[str, int], tuple[Any, int]] = _JSON.scan_once  # type: ignore[attr-defined]
# Integers of more digits than int() converts (sys.get_int_max_str_digits()), a numeric without
# fraction, stay text too; only text holding one is parsed by this slower decoder.
_JSON_LONG_INTEGERS = json.JSONDecoder(parse_float=str,
                                       parse_int=lambda digits: int(digits) if len(digits) < 4000 else digits)


def parse_json(text: str) -> Any:
    """json.loads(text, parse_float=str), without building a decoder per call
    and, for text that is one JSON value with nothing around it (as
    PostgreSQL renders ev_data), without the whitespace matching around it."""
    try:
        value, end = _scan_json(text, 0)
    except StopIteration:
        return _JSON.decode(text)  # leading whitespace, or the error json.loads raises
    except ValueError as exc:
        if "integer string conversion" not in str(exc):
            raise
        return _JSON_LONG_INTEGERS.decode(text)
    if end != len(text):
        return _JSON.decode(text)
    return value


@dataclass(frozen=True)
class Column:
    name: str
    type: str          # format_type() with typmod, e.g. 'numeric(12,2)'
    base_type: str     # domains resolved, no typmod, e.g. 'numeric', 'integer[]'
    category: str      # pg_type.typcategory of the base type
    not_null: bool
    attnum: int = 0    # identifies the column through renames
    default: str | None = None


@dataclass(frozen=True)
class TableStructure:
    schema: str
    name: str
    columns: tuple[Column, ...]   # captured columns, in event value order
    key: tuple[str, ...]

    @classmethod
    def from_source(cls, structure: dict[str, Any], captured: Sequence[str], key: Sequence[str]) -> TableStructure:
        """From replicator.table_structure(), keeping the captured columns in capture order."""
        by_name = {c["name"]: c for c in structure["columns"]}
        columns = tuple(Column(name=n, type=by_name[n]["type"], base_type=by_name[n]["base_type"],
                               category=by_name[n]["category"], not_null=by_name[n]["not_null"],
                               attnum=by_name[n]["attnum"], default=by_name[n]["default"])
                        for n in captured if n in by_name)
        return cls(schema=structure["schema"], name=structure["name"], columns=columns, key=tuple(key))

    def to_json(self) -> str:
        return json.dumps({"schema": self.schema, "name": self.name, "key": list(self.key),
                           "columns": [c.__dict__ for c in self.columns]})

    @classmethod
    def from_json(cls, text: str) -> TableStructure:
        data = json.loads(text)
        return cls(schema=data["schema"], name=data["name"], key=tuple(data["key"]),
                   columns=tuple(Column(**c) for c in data["columns"]))

    @property
    def qualified_name(self) -> str:
        return f"{self.schema}.{self.name}"

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]

    def key_columns(self) -> list[Column]:
        by_name = {c.name: c for c in self.columns}
        return [by_name[k] for k in self.key]

    def key_positions(self) -> list[int]:
        names = self.column_names
        return [names.index(k) for k in self.key]

    def row_decoders(self) -> list[Decoder]:
        return [decoder_for(c) for c in self.columns]

    def key_decoders(self) -> list[Decoder]:
        return [decoder_for(c) for c in self.key_columns()]

    def rows_decoder(self) -> RowsDecoder:
        """Decodes a list of captured rows (JSON arrays in column order)."""
        return rows_decoder(self.row_decoders())

    def keys_decoder(self) -> RowsDecoder:
        """Decodes a list of captured keys (JSON arrays in key order)."""
        return rows_decoder(self.key_decoders())


@dataclass(frozen=True)
class Change:
    """One step of reconciling a target table with a new source structure."""
    action: str                  # 'rename_table', 'rename_column', 'drop_column', 'add_column'
    name: str = ""               # the column (old name) or, for rename_table, the new table
    new_name: str = ""
    column: Column | None = None


def reconcile(old: TableStructure, new: TableStructure) -> list[Change] | None:
    """The in-place changes that turn a table of structure `old` into `new`,
    matching columns by attnum; None when the source rewrote values that no
    event carries (a column added with a default or NOT NULL, a type change)
    or the key or its nullability changed: then the table must be copied again."""
    old_by_attnum = {c.attnum: c for c in old.columns}
    new_by_attnum = {c.attnum: c for c in new.columns}
    renamed = {old_by_attnum[a].name: c.name for a, c in new_by_attnum.items() if a in old_by_attnum}
    if tuple(renamed.get(k, "") for k in old.key) != new.key:
        return None
    if [c.not_null for c in old.key_columns()] != [c.not_null for c in new.key_columns()]:
        return None     # a key that may hold NULL is stored differently (SQLite: not the rowid)
    changes: list[Change] = []
    if (old.schema, old.name) != (new.schema, new.name):
        changes.append(Change("rename_table", name=old.qualified_name, new_name=new.qualified_name))
    for attnum, column in old_by_attnum.items():
        if attnum not in new_by_attnum:
            changes.append(Change("drop_column", name=column.name))
    for attnum, column in new_by_attnum.items():
        before = old_by_attnum.get(attnum)
        if before is None:
            if column.default is not None or column.not_null:
                return None
            changes.append(Change("add_column", name=column.name, column=column))
        elif before.type != column.type:
            return None
        elif before.name != column.name:
            changes.append(Change("rename_column", name=before.name, new_name=column.name))
    return changes


# Date-times have one form in every target (README.md, "SQLite type mapping"): ISO 8601
# with a 'T' and all six fractional digits (PostgreSQL drops trailing zeros, and the
# whole fraction when it is zero), timestamptz in UTC with "+00:00", years outside
# 0001-9999 written as ISO 8601's expanded years (astronomical numbering: 1 BC is 0000,
# 44 BC is -0043, past 9999 a "+"), 'infinity' and '-infinity' as PostgreSQL spells them.
_INFINITIES = frozenset(("infinity", "-infinity"))
_DATETIME = re.compile(r"(\d{4,})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)(?:\.(\d{1,6}))?"
                       r"(?:([+-])(\d\d)(?::(\d\d))?(?::(\d\d))?)?( BC)?")
_DATE = re.compile(r"(\d{4,})-(\d\d)-(\d\d)( BC)?")
_OFFSET = re.compile(r"([+-])(\d\d)(?::(\d\d))?(?::(\d\d))?")
_GREGORIAN_CYCLE = 400   # years: the calendar repeats itself, weekdays and leap days included


def _year(year: int) -> str:
    """An astronomical year as ISO 8601 writes it: four digits, a sign outside 0000-9999."""
    if year < 0:
        return f"-{-year:04d}"
    return f"{year:04d}" if year <= 9999 else f"+{year}"


def _astronomical(year: str, bc: str | None) -> int:
    return 1 - int(year) if bc else int(year)


def _datetime_iso(value: str, *, utc: bool) -> str:
    """A timestamp(tz) PostgreSQL rendered that Python's datetime cannot hold (BC, past
    9999) in the one form: moved by whole 400-year cycles into Python's range to convert
    its offset, then back."""
    m = _DATETIME.fullmatch(value)
    if m is None:
        return value
    year, month, day, hour, minute, second, fraction, sign, oh, om, osec, bc = m.groups()
    year_number = _astronomical(year, bc)
    shift = (year_number - 2000) // _GREGORIAN_CYCLE * _GREGORIAN_CYCLE
    moment = datetime(year_number - shift, int(month), int(day), int(hour), int(minute), int(second),
                      int((fraction or "").ljust(6, "0")))
    if utc:
        offset = timedelta(hours=int(oh or 0), minutes=int(om or 0), seconds=int(osec or 0))
        moment = (moment - offset) if sign != "-" else (moment + offset)
    text = f"{_year(moment.year + shift)}{moment.isoformat(timespec='microseconds')[4:]}"
    return text + "+00:00" if utc else text


def _timestamptz_to_utc(value: str | None) -> str | None:
    """ISO 8601 in UTC with "+00:00" and six fractional digits."""
    if value is None:
        return None
    # Already in UTC with a year of four digits: only the fraction to complete (most
    # sessions write in UTC).
    if value.endswith("+00:00") and value[4] == "-":
        if len(value) == 32:
            return value
        if len(value) == 25:
            return value[:19] + ".000000+00:00"
        if len(value) > 26 and value[19] == ".":
            return value[:-6].ljust(26, "0") + "+00:00"
    if value in _INFINITIES:
        return value
    try:
        return datetime.fromisoformat(value).astimezone(UTC).isoformat(timespec="microseconds")
    except (ValueError, OverflowError):   # BC, past 9999, or moved past either end by its offset
        return _datetime_iso(value, utc=True)


def _timestamp(value: str | None) -> str | None:
    """ISO 8601 with six fractional digits."""
    if value is None:
        return None
    if value[4] == "-" and value[-1].isdigit():   # a year of four digits, AD
        if len(value) == 26:
            return value
        if len(value) == 19:
            return value + ".000000"
        if 20 < len(value) < 26:
            return value.ljust(26, "0")
    if value in _INFINITIES:
        return value
    return _datetime_iso(value, utc=False)


def _date(value: str | None) -> str | None:
    """ISO 8601; BC and past 9999 in expanded years (see above)."""
    if value is None or len(value) == 10 or value in _INFINITIES:
        return value
    m = _DATE.fullmatch(value)
    if m is None:
        return value
    year, month, day, bc = m.groups()
    return f"{_year(_astronomical(year, bc))}-{month}-{day}"


def _clock(value: str) -> str:
    """HH:MM:SS with six fractional digits."""
    if len(value) == 8:
        return value + ".000000"
    return value.ljust(15, "0")


def _time(value: str | None) -> str | None:
    return None if value is None else _clock(value)


def _timetz(value: str | None) -> str | None:
    """HH:MM:SS with six fractional digits and its offset as ±HH:MM (±HH:MM:SS when it has
    seconds); PostgreSQL writes -08 for -08:00."""
    if value is None:
        return None
    at = max(value.rfind("+"), value.rfind("-"))
    m = _OFFSET.fullmatch(value, at) if at > 0 else None
    if m is None:
        return value
    sign, hours, minutes, seconds = m.groups()
    offset = f"{sign}{hours}:{minutes or '00'}" + (f":{seconds}" if seconds else "")
    return _clock(value[:at]) + offset


_NON_FINITE = frozenset(("NaN", "Infinity", "-Infinity"))


def _float(value: Any) -> Any:
    """Finite values as floats; NaN and the infinities as PostgreSQL spells
    them (SQLite would store NaN as NULL, JSON has no spelling for them)."""
    if value is None or value in _NON_FINITE:
        return value
    return float(value)


def _bytea(value: str | None) -> bytes | None:
    if value is None:
        return None
    if value.startswith("\\x"):
        return bytes.fromhex(value[2:])
    raise ValueError("bytea values must be captured with bytea_output = 'hex'")


def _bool(value: Any) -> int | None:
    return None if value is None else int(value)


def _numeric(value: Any) -> str | None:
    return None if value is None else str(value)


def identity(value: Any) -> Any:
    """The decoder of values a target stores as the capture encoding has them."""
    return value


RowsDecoder = Callable[[list[Any]], list[Sequence[Any]]]


def rows_decoder(decoders: Sequence[Decoder]) -> RowsDecoder:
    """One function decoding a list of captured rows (or keys) into target rows.

    Values whose decoder is the identity are not touched: when every column's
    is, rows are the parsed arrays themselves; otherwise each row becomes a
    tuple built by one generated expression that calls only the other
    columns' decoders, e.g. ``lambda r: (r[0], r[1], d2(r[2]))``. A row with
    fewer values than decoders (or, for the identity, another number of
    values) is decoded as zip() would, as before.
    """
    decoders = list(decoders)
    n = len(decoders)

    def by_zip(items: list[Any]) -> list[Sequence[Any]]:
        return [tuple(d(v) for d, v in zip(decoders, item)) for item in items]

    if all(d is identity for d in decoders):
        def same(items: list[Any]) -> list[Sequence[Any]]:
            for item in items:
                if len(item) != n:
                    return by_zip(items)
            return items
        return same

    env = {f"d{i}": d for i, d in enumerate(decoders) if d is not identity}
    body = ", ".join(f"r[{i}]" if d is identity else f"d{i}(r[{i}])" for i, d in enumerate(decoders))
    row = eval(f"lambda r: ({body},)", env)  # only column positions and env names: no outside text

    def decode(items: list[Any]) -> list[Sequence[Any]]:
        try:
            return list(map(row, items))
        except IndexError:
            return by_zip(items)
    return decode


def decode_old_rows(decode: RowsDecoder, items: list[list[Any] | None]) -> list[Sequence[Any] | None]:
    """An event's old rows (ev_old, of a table captured with --old-rows): each item's old row
    decoded as the rows are, None where the item has none (the new row of a key change)."""
    decoded = iter(decode([item for item in items if item is not None]))
    return [None if item is None else next(decoded) for item in items]


def decoder_for(column: Column) -> Decoder:
    """How a value of this column, as found in the capture encoding, becomes a
    target value (see README.md, "SQLite type mapping", and docs/spark.md, "Type mapping")."""
    base = column.base_type
    if column.category == "A":
        return identity
    if base in INTEGER_TYPES:
        return identity
    if base == "boolean":
        return _bool
    if base in FLOAT_TYPES:
        return _float
    if base == "numeric":
        return _numeric
    if base == "bytea":
        return _bytea
    if base == "timestamp with time zone":
        return _timestamptz_to_utc
    if base == "timestamp without time zone":
        return _timestamp
    if base == "date":
        return _date
    if base == "time without time zone":
        return _time
    if base == "time with time zone":
        return _timetz
    return identity


# The names a target keeps for its own objects: replicator's tables, the views' catalog,
# storage and indexes (_replicator_*), and SQLite's (sqlite_*), ignoring ASCII case as SQLite
# compares names. None of replicator's own objects starts with ESCAPED_PREFIX: that part of
# the space holds the replicated tables whose names fall in it.
RESERVED_PREFIXES = ("_replicator", "sqlite_")
ESCAPED_PREFIX = "_replicator_src"
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def ascii_lower(name: str) -> str:
    """name with its ASCII capitals in lower case: names equal so are one to SQLite, which
    ignores the case of ASCII letters only (the Kelvin sign is not k)."""
    return name.translate(_ASCII_LOWER)


def target_table_name(schema: str, name: str) -> str:
    """A source table's name in a target: public.t → t, s.t → s__t, unless that name is in
    the reserved space (RESERVED_PREFIXES): then _replicator_src<N>[u<MASK>]_<schema>_<table>,
    N the schema's length, MASK (hexadecimal) the places of the ASCII capitals in schema and
    table, both in lower case: public._replicator_position → _replicator_src6_public__replicator_position.
    No source table can name a target's own object, and no two escaped tables share a name,
    even ignoring case (the escaped name has no capital and tells schema, table and capitals)."""
    plain = name if schema == "public" else f"{schema}__{name}"
    if not ascii_lower(plain).startswith(RESERVED_PREFIXES):
        return plain
    capitals = sum(1 << i for i, c in enumerate(schema + name) if "A" <= c <= "Z")
    mask = f"u{capitals:x}" if capitals else ""
    return ascii_lower(f"{ESCAPED_PREFIX}{len(schema)}{mask}_{schema}_{name}")
