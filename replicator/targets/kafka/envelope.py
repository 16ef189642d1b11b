"""The records of replicator's Kafka topics as Debezium's PostgreSQL connector writes them
through Kafka Connect's JsonConverter: per table, the key (the row's key columns) and the
value (Debezium's change-event envelope); per prefix, the schema-change records. And the
way back, for followers. docs/kafka.md, "Records", describes every field.

A record is JSON text spliced from parts made once per table structure (the Connect schemas,
the field names) and the values' JSON, written by one generated expression per struct.
Where a field's type cannot hold a value exactly (docs/kafka.md lists when), the value record
carries the value's text in an extra field, `replicator`, that followers read; keys are
Debezium's, so a tombstone carries its key's texts in a header (KEY_HEADER).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring
from typing import Any, NamedTuple

import msgspec

from replicator import __version__
from replicator.errors import UserError
from replicator.structure import TableStructure
from replicator.targets.kafka.values import DECIMAL_MODES, ColumnField, FieldCodec, codec_for, connect_schema, identity
from replicator.targets.protocol import Row

CONNECTOR = "replicator"
EXACT_FIELD = "replicator"
KEY_HEADER = "replicator.key"   # a tombstone's: the exact texts of its key values its fields cannot hold
# The header of a delete record whose `before` is the old row (--old-rows), not the key columns alone:
# both have the same schema, and a NOT NULL column's Debezium zero would read as a value
OLD_ROW_HEADER = "replicator.old_row"
# Debezium's SnapshotRecord values, the `snapshot` field's allowed strings
SNAPSHOT_VALUES = ("true", "first", "first_in_data_collection", "last_in_data_collection", "last", "false",
                   "incremental")
ROW_OPS = ("c", "u", "r")


def snapshot_marker(*, first_of_snapshot: bool, last_of_snapshot: bool, first_of_table: bool,
                    last_of_table: bool) -> str:
    """The `snapshot` of a copied row where it stands in its snapshot, as Debezium's snapshots
    mark theirs (RelationalSnapshotChangeEventSource): the very last row `last`, the very first
    `first`, a table's last and first `last_in_data_collection` and `first_in_data_collection`,
    any other `true`."""
    if last_of_snapshot:
        return "last"
    if first_of_snapshot:
        return "first"
    if last_of_table:
        return "last_in_data_collection"
    if first_of_table:
        return "first_in_data_collection"
    return "true"


@dataclass(frozen=True)
class EnvelopeSettings:
    """How the records are written, as the Debezium connector settings of the same names."""
    prefix: str                  # topic.prefix: `source.name`, the first part of the Connect schema names
    database: str                # `source.db`, `databaseName`
    schemas: bool = True         # JsonConverter's schemas.enable: {"schema": ..., "payload": ...}
    decimals: str = "precise"    # decimal.handling.mode: "precise" | "string" | "double"

    def __post_init__(self) -> None:
        if self.decimals not in DECIMAL_MODES:
            raise UserError(f"decimals={self.decimals!r}: choose one of {', '.join(DECIMAL_MODES)}"
                            " (Debezium's decimal.handling.mode)")


@dataclass(frozen=True)
class DecodedChange:
    """A change record as a follower applies it: rows in column order, decoded as
    replicator.structure's decoders decode captured rows; a field the record lacks is None."""
    op: str                              # c, u, r, d or t
    before: tuple[Any, ...] | None       # an update's old row (--old-rows); a delete's key columns (the other
                                         # columns None), or its old row when the record carries one
    after: tuple[Any, ...] | None
    source: dict[str, Any]


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _int64(name: str, optional: bool = True) -> dict[str, Any]:
    return {"type": "int64", "optional": optional, "field": name}


def _string(name: str, optional: bool = False) -> dict[str, Any]:
    return {"type": "string", "optional": optional, "field": name}


SOURCE_SCHEMA = {
    "type": "struct",
    "fields": [
        _string("version"), _string("connector"), _string("name"), _int64("ts_ms", optional=False),
        {"type": "string", "optional": True, "name": "io.debezium.data.Enum", "version": 1,
         "parameters": {"allowed": ",".join(SNAPSHOT_VALUES)}, "default": "false", "field": "snapshot"},
        _string("db"), _string("sequence", optional=True), _int64("ts_us"), _int64("ts_ns"), _string("schema"),
        _string("table"), _int64("txId"), _int64("lsn"), _int64("xmin"), _string("origin", optional=True),
        _int64("origin_lsn"), _int64("tick", optional=False), _int64("event"),
    ],
    "optional": False, "name": "io.debezium.connector.postgresql.Source", "version": 1, "field": "source",
}
_TRANSACTION_SCHEMA = {
    "type": "struct",
    "fields": [_string("id"), _int64("total_order", optional=False), _int64("data_collection_order", optional=False)],
    "optional": True, "name": "event.block", "version": 1, "field": "transaction",
}
_STRING_MAP = {"type": "map", "keys": {"type": "string", "optional": False},
               "values": {"type": "string", "optional": False}}


def _exact_schema(name: str) -> dict[str, Any]:
    """The extra field of exact texts: column name -> the value's text."""
    return {**_STRING_MAP, "optional": True, "field": name}


def _record(schema: dict[str, Any], settings: EnvelopeSettings) -> tuple[str, str]:
    """The text around a payload: JsonConverter's envelope with schemas, nothing without."""
    if not settings.schemas:
        return "", ""
    return f'{{"schema":{_json(schema)},"payload":', "}"


Slot = tuple[int, FieldCodec] | str    # the value at this index of the input, or a constant JSON text


def _struct_encoder(names: Sequence[str], slots: Sequence[Slot]) -> Callable[[Sequence[Any]], str]:
    """One generated f-string writing a Connect struct's JSON from a sequence of values, e.g.
    f'{p0}{("null" if r[0] is None else r[0])}{p1}{("null" if r[1] is None else e1(r[1]))}{p2}'
    with p0 = '{"id":', p1 = ',"name":', p2 = '}'."""
    env: dict[str, Any] = {"q": encode_basestring}
    code: list[str] = []
    literal = "{"

    def flush(text: str) -> None:
        env[f"p{len(code)}"] = text
        code.append(f"{{p{len(code)}}}")

    for position, (name, slot) in enumerate(zip(names, slots)):
        literal += ("," if position else "") + encode_basestring(name) + ":"
        if isinstance(slot, str):
            literal += slot
            continue
        index, codec = slot
        flush(literal)
        literal = ""
        value = f"r[{index}]"
        if codec.inline is not None:
            expression = codec.inline.format(v=value)
        else:
            env[f"e{index}"] = codec.encode
            expression = f"e{index}({value})"
        code.append(f'{{("null" if {value} is None else {expression})}}')
    flush(literal + "}")
    encoder: Callable[[Sequence[Any]], str] = eval(f"lambda r: f'{''.join(code)}'", env)  # names and slots only
    return encoder


def _exact_encoder(names: Sequence[str], fields: Sequence[ColumnField]) -> Callable[[Sequence[Any]], str] | None:
    """The JSON of the `replicator` field of a sequence of values: the exact texts of the
    values their fields cannot hold, or null; None when no field ever loses a value."""
    lossy = [(encode_basestring(name), f.codec.exact, i) for i, (name, f) in enumerate(zip(names, fields))
             if f.codec.exact is not None]
    if not lossy:
        return None

    def exact(values: Sequence[Any]) -> str:
        texts = [f"{name}:{encode_basestring(text)}" for name, lose, i in lossy
                 if values[i] is not None and (text := lose(values[i])) is not None]
        return f"{{{','.join(texts)}}}" if texts else "null"
    return exact


def _loads(data: bytes) -> Any:
    """JSON as json.loads reads it: by msgspec, faster, and by json where msgspec refuses what json
    takes (NaN, 1e400, lone surrogates, a BOM or UTF-16). Where both take a text they read the same."""
    try:
        return msgspec.json.decode(data)
    except msgspec.DecodeError:
        return json.loads(data)


def _parse_payload(data: bytes, head: bytes, schemas: bool) -> Any:
    """The payload of a record: the schema not parsed again when it is the expected one."""
    if not schemas:
        return _loads(data)
    if data.startswith(head):
        return _loads(data[len(head):-1])
    return _loads(data)["payload"]


class _Payload(msgspec.Struct):
    """The members of a value record's payload a follower reads; msgspec skips the others
    (transaction, the times) and leaves `source` unparsed."""
    op: Any
    source: msgspec.Raw
    before: Any = None
    after: Any = None
    exact: Any = msgspec.field(default=None, name=EXACT_FIELD)


_PAYLOAD: msgspec.json.Decoder[_Payload] = msgspec.json.Decoder(_Payload)


class _Record(msgspec.Struct):
    """A value record with a schema other than the expected one: its payload, the schema skipped."""
    payload: _Payload


_RECORD: msgspec.json.Decoder[_Record] = msgspec.json.Decoder(_Record)


def _value_payload(data: bytes, head: bytes, schemas: bool) -> _Payload:
    """A value record's _Payload, read as _parse_payload reads it (it does, where msgspec refuses)."""
    whole = schemas and not data.startswith(head)
    text = data[len(head):-1] if schemas and not whole else data
    try:
        if not text.isascii():   # msgspec skips members without checking their UTF-8, which json.loads does
            text.decode("utf-8", "surrogatepass")
        return _RECORD.decode(text).payload if whole else _PAYLOAD.decode(text)
    except (msgspec.DecodeError, UnicodeDecodeError):
        payload = _parse_payload(data, head, schemas)
        return _Payload(op=payload["op"], source=msgspec.Raw(json.dumps(payload["source"]).encode()),
                        before=payload.get("before"), after=payload.get("after"), exact=payload.get(EXACT_FIELD))


class RowChange(NamedTuple):
    """A change record's rows as a follower applies them: DecodedChange without the source."""
    op: str
    before: tuple[Any, ...] | None
    after: tuple[Any, ...] | None


def _struct_decoder(names: Sequence[str], fields: Sequence[ColumnField]) -> Callable[[Any], tuple[Any, ...]]:
    """One generated expression reading a parsed Connect struct (no exact texts) into the values
    in field order, e.g. lambda s: (s.get('id'), (None if (v1 := s.get('at')) is None else d1(v1)),)
    for an integer and a timestamp field."""
    env: dict[str, Any] = {}
    items = []
    for i, (name, f) in enumerate(zip(names, fields)):
        if f.codec.decode is identity:
            items.append(f"s.get({name!r})")
        else:
            env[f"d{i}"] = f.codec.decode
            items.append(f"(None if (v{i} := s.get({name!r})) is None else d{i}(v{i}))")
    decoder: Callable[[Any], tuple[Any, ...]] = eval(f"lambda s: ({', '.join(items)},)", env)  # names only
    return decoder


class TableEnvelope:
    """The key and value records of one table in one structure."""

    def __init__(self, structure: TableStructure, settings: EnvelopeSettings) -> None:
        self.structure = structure
        self.settings = settings
        columns = structure.columns
        self._fields = [ColumnField(c, codec_for(c, settings.decimals)) for c in columns]
        self._names = [c.name for c in columns]
        self._key_positions = structure.key_positions()
        self._key_fields = key_fields = [self._fields[i] for i in self._key_positions]
        key_names = list(structure.key)
        names = f"{settings.prefix}.{structure.schema}.{structure.name}"

        self._row = _struct_encoder(self._names, [(i, f.codec) for i, f in enumerate(self._fields)])
        self._row_exact = _exact_encoder(self._names, self._fields)
        # An update's `before` (--old-rows) has its exact texts in the same map as `after`'s, each under
        # its column name after a prefix no column name starts with ("before.", one more "_" each time).
        self._before_prefix = "before."
        while any(name.startswith(self._before_prefix) for name in self._names):
            self._before_prefix = self._before_prefix[:-1] + "_."
        self._before_exact = _exact_encoder([self._before_prefix + name for name in self._names], self._fields)
        self._key_index = key_index = {position: index for index, position in enumerate(self._key_positions)}
        self._delete_before = _struct_encoder(self._names, [
            (key_index[i], f.codec) if i in key_index else f.missing for i, f in enumerate(self._fields)])
        self._key = _struct_encoder(key_names, [(i, f.codec) for i, f in enumerate(key_fields)])
        self._row_key = _struct_encoder(key_names, [(i, self._fields[i].codec) for i in self._key_positions])
        self._read_row = _struct_decoder(self._names, self._fields)
        self._read_key = _struct_decoder(key_names, key_fields)
        self._key_exact = _exact_encoder(key_names, key_fields)

        value_struct: dict[str, Any] = {"type": "struct", "fields": [f.schema for f in self._fields],
                                        "optional": True, "name": f"{names}.Value"}
        envelope = {
            "type": "struct",
            "fields": [{**value_struct, "field": "before"}, {**value_struct, "field": "after"}, SOURCE_SCHEMA,
                       _TRANSACTION_SCHEMA, _string("op"), _int64("ts_ms"), _int64("ts_us"), _int64("ts_ns"),
                       _exact_schema(EXACT_FIELD)],
            "optional": False, "name": f"{names}.Envelope", "version": 2,
        }
        self._value_head, self._value_tail = _record(envelope, settings)
        self._value_head_bytes = self._value_head.encode()

        # Debezium's key: the key columns' fields only. Values a field cannot hold exactly are in
        # the value's `replicator` map (a tombstone's in its KEY_HEADER)
        key_schema = {"type": "struct", "fields": [f.schema for f in key_fields], "optional": False,
                      "name": f"{names}.Key"}
        self._key_head, self._key_tail = _record(key_schema, settings)
        self._key_head_bytes = self._key_head.encode()
        # every key field null (optional, for the record to be valid Connect data): no row's key when a key
        # column is NOT NULL. When none is, a row's key can be all null too (compaction would keep one of
        # the two): an extra field, an empty map, named unlike every key column, tells the truncate's
        truncate_fields = [connect_schema({k: v for k, v in f.schema.items() if k not in ("optional", "field")},
                                          optional=True, field_name=f.column.name) for f in key_fields]
        payload = [f"{encode_basestring(name)}:null" for name in key_names]
        exact_field = EXACT_FIELD
        while exact_field in key_names:
            exact_field += "_"
        if not any(f.column.not_null for f in key_fields):
            truncate_fields.append(_exact_schema(exact_field))
            payload.append(f"{encode_basestring(exact_field)}:{{}}")
        head, tail = _record({**key_schema, "fields": truncate_fields}, settings)
        self._truncate_key = f"{head}{{{','.join(payload)}}}{tail}".encode()
        self._former_exact_field = exact_field

        self._source_head = (f'{{"version":{encode_basestring(__version__)},"connector":"{CONNECTOR}",'
                             f'"name":{encode_basestring(settings.prefix)},')
        self._source_middle = (f',"db":{encode_basestring(settings.database)},"sequence":null,')
        self._source_table = (f',"schema":{encode_basestring(structure.schema)},'
                              f'"table":{encode_basestring(structure.name)},')

    # the publisher's side --------------------------------------------------------------------

    def key(self, key_values: Sequence[Any]) -> bytes:
        """The key record of a row: its key values, in structure.key order, as Debezium's."""
        return f"{self._key_head}{self._key(key_values)}{self._key_tail}".encode()

    def row_key(self, row: Row) -> bytes:
        """The key record of a row (in column order): key(), read from the row itself."""
        return f"{self._key_head}{self._row_key(row)}{self._key_tail}".encode()

    def key_header(self, key_values: Sequence[Any]) -> bytes | None:
        """A tombstone's KEY_HEADER: the exact texts of the key values their fields cannot hold
        (a JSON map, column name -> text); None when there are none."""
        exact = "null" if self._key_exact is None else self._key_exact(key_values)
        return None if exact == "null" else exact.encode()

    def truncate_key(self) -> bytes:
        """The key of a truncate record (compacted topics refuse records without a key): every key
        field null, which no row's key is (docs/kafka.md, Key)."""
        return self._truncate_key

    def source(self, *, ts_us: int, snapshot: str, tick: int, event: int | None, txid: int | None) -> str:
        """The JSON of the `source` block of the rows of one captured event: ts_us its time in
        microseconds, snapshot Debezium's (snapshot_marker(), or "false"), tick the queue tick its
        batch ends at, event the event id (None in a copy), txid the transaction that wrote it."""
        if snapshot not in SNAPSHOT_VALUES:
            raise ValueError(f"snapshot {snapshot!r} is not one of {', '.join(SNAPSHOT_VALUES)}")
        return (f'{self._source_head}"ts_ms":{ts_us // 1000},"snapshot":"{snapshot}"{self._source_middle}'
                f'"ts_us":{ts_us},"ts_ns":{ts_us * 1000}{self._source_table}'
                f'"txId":{"null" if txid is None else txid},"lsn":null,"xmin":null,"origin":null,'
                f'"origin_lsn":null,"tick":{tick},"event":{"null" if event is None else event}}}')

    def value(self, op: str, after: Row | None, source: str, ts_us: int, before: Row | None = None) -> bytes:
        """The value record of an insert, update or copied row (op c, u, r: `after` the full
        row in column order; `before` null, or an update's old row, of a table captured with
        --old-rows) or of a truncate (op t, no row)."""
        if op in ROW_OPS and after is not None and (before is None or op == "u"):
            row = self._row(after)
            exact = "null" if self._row_exact is None else self._row_exact(after)
        elif op == "t" and after is None and before is None:
            row = exact = "null"
        else:
            raise ValueError(f"op {op!r} with {'a' if after is not None else 'no'} row"
                             f"{' and an old row' if before is not None else ''}")
        if before is None:
            return self._value("null", row, op, source, ts_us, exact)
        before_exact = "null" if self._before_exact is None else self._before_exact(before)
        if before_exact != "null":
            exact = before_exact if exact == "null" else f"{exact[:-1]},{before_exact[1:]}"
        return self._value(self._row(before), row, op, source, ts_us, exact)

    def delete_value(self, key_values: Sequence[Any], source: str, ts_us: int, old_row: Row | None = None) -> bytes:
        """The value record of a delete: `before` the old row of a table captured with --old-rows,
        else the key columns' values and no other column's (null, or Debezium's zero in a NOT NULL
        column), with the exact texts of the key values in `replicator`; `after` null."""
        if old_row is not None:
            exact = "null" if self._row_exact is None else self._row_exact(old_row)
            return self._value(self._row(old_row), "null", "d", source, ts_us, exact)
        exact = "null" if self._key_exact is None else self._key_exact(key_values)
        return self._value(self._delete_before(key_values), "null", "d", source, ts_us, exact)

    def _value(self, before: str, after: str, op: str, source: str, ts_us: int, exact: str) -> bytes:
        """ts_us: when the publisher wrote the record, in microseconds."""
        return (f'{self._value_head}{{"before":{before},"after":{after},"source":{source},"transaction":null,'
                f'"op":"{op}","ts_ms":{ts_us // 1000},"ts_us":{ts_us},"ts_ns":{ts_us * 1000},'
                f'"{EXACT_FIELD}":{exact}}}{self._value_tail}').encode()

    # the followers' side ---------------------------------------------------------------------

    def decode_key(self, data: bytes, header: bytes | None = None) -> tuple[Any, ...]:
        """The key values of a key record, in structure.key order: exact with the tombstone's
        KEY_HEADER, else as far as the key's fields hold them."""
        payload = _parse_payload(data, self._key_head_bytes, self.settings.schemas)
        # (a publisher before this version wrote the texts in the key, in a field named unlike its columns)
        exact = payload.get(self._former_exact_field) if header is None else _loads(header)
        if not isinstance(exact, dict | None):
            raise ValueError(f"header {KEY_HEADER} is no map of texts")
        if not exact:
            return self._read_key(payload)
        return self._decode_struct(payload, self._key_fields, exact)

    def deleted_key(self, change: DecodedChange | RowChange) -> tuple[Any, ...]:
        """The key values of a delete, exact: from its value's `before` and `replicator` map."""
        if change.op != "d" or change.before is None:
            raise ValueError(f"op {change.op!r} is no delete with its key in `before`")
        return tuple(change.before[i] for i in self._key_positions)

    def decode_value(self, data: bytes, old_row: bool = False) -> DecodedChange:
        """A value record back into the change it holds; old_row: a delete's `before` is its old
        row (the publisher says so in a header), not its key columns alone."""
        payload = _value_payload(data, self._value_head_bytes, self.settings.schemas)
        op, before, after = self._rows(payload, old_row)
        return DecodedChange(op=op, before=before, after=after, source=_loads(bytes(payload.source)))

    def row_change(self, data: bytes, old_row: bool = False) -> RowChange:
        """decode_value without the source block, which a follower does not apply (nor parse)."""
        return self._rows(_value_payload(data, self._value_head_bytes, self.settings.schemas), old_row)

    def _rows(self, payload: _Payload, old_row: bool) -> RowChange:
        exact = payload.exact or {}
        op = payload.op
        before, after = payload.before, payload.after
        before_exact = exact
        if op == "u" and exact:
            prefix = self._before_prefix
            before_exact = {name[len(prefix):]: text for name, text in exact.items() if name.startswith(prefix)}
        decoded_before = None if before is None else self._decode_row(before, before_exact)
        if op == "d" and decoded_before is not None and not old_row:   # the other columns hold no value
            decoded_before = tuple(v if i in self._key_index else None for i, v in enumerate(decoded_before))
        return RowChange(op, decoded_before, None if after is None else self._decode_row(after, exact))

    def _decode_row(self, struct: Any, exact: dict[str, str]) -> tuple[Any, ...]:
        return self._read_row(struct) if not exact else self._decode_struct(struct, self._fields, exact)

    @staticmethod
    def _decode_struct(struct: dict[str, Any], fields: Sequence[ColumnField], exact: dict[str, str]) -> tuple[Any, ...]:
        values = []
        for f in fields:
            name = f.column.name
            value = struct.get(name)
            values.append(exact[name] if name in exact else None if value is None else f.codec.decode(value))
        return tuple(values)


# the schema-change topic ---------------------------------------------------------------------

SCHEMA_CHANGES = ("CREATE", "ALTER", "DROP")
_SCHEMA_CHANGE_KEY = {"type": "struct", "fields": [_string("databaseName")], "optional": False,
                      "name": "replicator.SchemaChangeKey", "version": 1}


def _array_of(schema: dict[str, Any], name: str, optional: bool) -> dict[str, Any]:
    return {"type": "array", "items": schema, "optional": optional, "field": name}


def _int32(name: str, optional: bool = True) -> dict[str, Any]:
    return {"type": "int32", "optional": optional, "field": name}


def _boolean(name: str) -> dict[str, Any]:
    return {"type": "boolean", "optional": True, "field": name}


_COLUMN_SCHEMA = {
    "type": "struct",
    "fields": [_string("name"), _int32("jdbcType", optional=False), _int32("nativeType"), _string("typeName"),
               _string("typeExpression", optional=True), _string("charsetName", optional=True), _int32("length"),
               _int32("scale"), _int32("position", optional=False), _boolean("optional"),
               _boolean("autoIncremented"), _boolean("generated"), _string("comment", optional=True),
               _string("defaultValueExpression", optional=True),
               _array_of({"type": "string", "optional": False}, "enumValues", optional=True)],
    "optional": False, "name": "io.debezium.connector.schema.Column", "version": 1,
}
_TABLE_SCHEMA = {
    "type": "struct",
    "fields": [_string("defaultCharsetName", optional=True),
               _array_of({"type": "string", "optional": False}, "primaryKeyColumnNames", optional=True),
               _array_of(_COLUMN_SCHEMA, "columns", optional=False), _string("comment", optional=True)],
    "optional": True, "name": "io.debezium.connector.schema.Table", "version": 1, "field": "table",
}
_CHANGE_SCHEMA = {"type": "struct", "fields": [_string("type"), _string("id"), _TABLE_SCHEMA], "optional": False,
                  "name": "io.debezium.connector.schema.Change", "version": 1}
_SCHEMA_CHANGE_VALUE = {
    "type": "struct",
    "fields": [SOURCE_SCHEMA, _int64("ts_ms", optional=False), _string("databaseName", optional=True),
               _string("schemaName", optional=True), _string("ddl", optional=True),
               _array_of(_CHANGE_SCHEMA, "tableChanges", optional=False), _string(EXACT_FIELD, optional=True)],
    "optional": False, "name": "replicator.SchemaChangeValue", "version": 1,
}

# PostgreSQL's type names (pg_type.typname) and the java.sql.Types codes PostgreSQL's JDBC
# driver reports, which Debezium writes for a column.
_TYPE_NAMES = {"smallint": "int2", "integer": "int4", "bigint": "int8", "real": "float4",
               "double precision": "float8", "boolean": "bool", "character varying": "varchar",
               "character": "bpchar", "time without time zone": "time", "time with time zone": "timetz",
               "timestamp without time zone": "timestamp", "timestamp with time zone": "timestamptz",
               "bit varying": "varbit", '"char"': "char"}
_JDBC_TYPES = {"int2": 5, "int4": 4, "int8": -5, "oid": -5, "float4": 7, "float8": 8, "money": 8, "numeric": 2,
               "bool": -7, "bit": -7, "bpchar": 1, "char": 1, "varchar": 12, "text": 12, "name": 12, "bytea": -2,
               "date": 91, "time": 92, "timetz": 92, "timestamp": 93, "timestamptz": 93, "xml": 2009}
_JDBC_ARRAY, _JDBC_OTHER = 2003, 1111


def _type_name(base_type: str) -> str:
    if base_type.endswith("[]"):
        return "_" + _type_name(base_type[:-2])
    return _TYPE_NAMES.get(base_type, base_type)


def _column_change(structure: TableStructure, position: int) -> dict[str, Any]:
    column = structure.columns[position]
    type_name = _type_name(column.base_type)
    typmod = column.type[column.type.find("(") + 1:column.type.find(")")].split(",") if "(" in column.type else []
    timed = column.base_type.startswith(("time", "interval"))   # a precision, no length
    return {
        "name": column.name,
        "jdbcType": _JDBC_ARRAY if type_name.startswith("_") else _JDBC_TYPES.get(type_name, _JDBC_OTHER),
        "nativeType": None, "typeName": type_name, "typeExpression": column.type, "charsetName": None,
        "length": int(typmod[0]) if typmod and not timed else None,
        "scale": int(typmod[-1]) if typmod and (timed or len(typmod) == 2) else None,
        "position": position + 1, "optional": not column.not_null,
        "autoIncremented": (column.default or "").startswith("nextval("), "generated": False, "comment": None,
        "defaultValueExpression": column.default, "enumValues": None,
    }


def schema_change_key(settings: EnvelopeSettings) -> bytes:
    """The key of every schema-change record: the database."""
    head, tail = _record(_SCHEMA_CHANGE_KEY, settings)
    return f'{head}{{"databaseName":{encode_basestring(settings.database)}}}{tail}'.encode()


def schema_change_value(settings: EnvelopeSettings, *, change: str, structure: TableStructure, ddl: str | None,
                        source: str, ts_ms: int, replicator: dict[str, Any]) -> bytes:
    """A schema change as Debezium's relational connectors describe one: the statement, the
    table's columns as they are after it (before it, for DROP), and `replicator`, a JSON
    string of what followers need (`decode_schema_change`)."""
    if change not in SCHEMA_CHANGES:
        raise ValueError(f"schema change {change!r} is not one of {', '.join(SCHEMA_CHANGES)}")
    table = {"defaultCharsetName": None, "primaryKeyColumnNames": list(structure.key),
             "columns": [_column_change(structure, i) for i in range(len(structure.columns))], "comment": None}
    table_id = '"{}"."{}"'.format(structure.schema.replace('"', '""'), structure.name.replace('"', '""'))
    rest = _json({"databaseName": settings.database, "schemaName": structure.schema, "ddl": ddl,
                  "tableChanges": [{"type": change, "id": table_id, "table": table}],
                  EXACT_FIELD: _json(replicator)})
    head, tail = _record(_SCHEMA_CHANGE_VALUE, settings)
    return f'{head}{{"source":{source},"ts_ms":{ts_ms},{rest[1:]}{tail}'.encode()


def decode_schema_change(data: bytes) -> dict[str, Any]:
    """The `replicator` member of a schema-change record."""
    record = json.loads(data)
    payload = record["payload"] if "schema" in record and "payload" in record else record
    member: dict[str, Any] = json.loads(payload[EXACT_FIELD])
    return member
