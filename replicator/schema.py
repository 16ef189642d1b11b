"""Table schema model: the structure a source table reports, and how its
column values are decoded from the capture encoding into target values.

The capture encoding (replicator.capture_row_json) is a JSON array of values.
Decoding keeps PostgreSQL's exact renderings where a Python type would lose
them: numerics stay text, json/arrays stay their JSON text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from typing import Any

Decoder = Callable[[Any], Any]

_INTEGER_TYPES = {"smallint", "integer", "bigint", "oid", "xid", "cid"}
_FLOAT_TYPES = {"real", "double precision"}

# One JSON parser for events, the copy and the join-back: numbers that are not
# integers stay text, so numeric values keep their exact digits and scale.
parse_json: Callable[[str], Any] = partial(json.loads, parse_float=str)


@dataclass(frozen=True)
class Column:
    name: str
    type: str          # format_type() with typmod, e.g. 'numeric(12,2)'
    base_type: str     # domains resolved, no typmod, e.g. 'numeric', 'integer[]'
    category: str      # pg_type.typcategory of the base type
    not_null: bool

    @property
    def is_array(self) -> bool:
        return self.category == "A"


@dataclass(frozen=True)
class TableStructure:
    schema: str
    name: str
    columns: tuple[Column, ...]   # captured columns, in event value order
    key: tuple[str, ...]

    @classmethod
    def from_source(cls, structure: dict[str, Any], captured: Sequence[str], key: Sequence[str]) -> "TableStructure":
        """From replicator.table_structure(), keeping the captured columns in capture order."""
        by_name = {c["name"]: c for c in structure["columns"]}
        columns = tuple(Column(name=n, type=by_name[n]["type"], base_type=by_name[n]["base_type"],
                               category=by_name[n]["category"], not_null=by_name[n]["not_null"])
                        for n in captured if n in by_name)
        return cls(schema=structure["schema"], name=structure["name"], columns=columns, key=tuple(key))

    def to_json(self) -> str:
        return json.dumps({"schema": self.schema, "name": self.name, "key": list(self.key),
                           "columns": [c.__dict__ for c in self.columns]})

    @classmethod
    def from_json(cls, text: str) -> "TableStructure":
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


def _timestamptz_to_utc(value: str) -> str:
    """ISO 8601 in UTC with offset; values Python cannot represent (infinity,
    BC, years past 9999) stay as PostgreSQL rendered them."""
    try:
        return datetime.fromisoformat(value).astimezone(timezone.utc).isoformat()
    except ValueError:
        return value


def _float(value: Any) -> Any:
    """Finite values as floats; NaN and the infinities as PostgreSQL spells
    them (SQLite would store NaN as NULL, JSON has no spelling for them)."""
    if isinstance(value, str) and value in ("NaN", "Infinity", "-Infinity"):
        return value
    return float(value)


def _bytea(value: str) -> bytes:
    if value.startswith("\\x"):
        return bytes.fromhex(value[2:])
    raise ValueError("bytea values must be captured with bytea_output = 'hex'")


def _identity(value: Any) -> Any:
    return value


def _nullable(fn: Decoder) -> Decoder:
    def decode(value: Any) -> Any:
        return None if value is None else fn(value)
    return decode


def decoder_for(column: Column) -> Decoder:
    """How a value of this column, as found in the capture encoding, becomes a
    target value (see docs/architecture.md, "Type mapping")."""
    base = column.base_type
    if column.category == "A":
        return _identity
    if base in _INTEGER_TYPES:
        return _identity
    if base == "boolean":
        return _nullable(int)
    if base in _FLOAT_TYPES:
        return _nullable(_float)
    if base == "numeric":
        return _nullable(str)
    if base == "bytea":
        return _nullable(_bytea)
    if base == "timestamp with time zone":
        return _nullable(_timestamptz_to_utc)
    return _identity


def sqlite_type(column: Column) -> str:
    """SQLite column type (affinity) for a PostgreSQL column."""
    base = column.base_type
    if column.category == "A":
        return "TEXT"
    if base in _INTEGER_TYPES or base == "boolean":
        return "INTEGER"
    if base in _FLOAT_TYPES:
        return "REAL"
    if base == "bytea":
        return "BLOB"
    return "TEXT"


def target_table_name(schema: str, name: str) -> str:
    """public.t → t, s.t → s__t."""
    return name if schema == "public" else f"{schema}__{name}"
