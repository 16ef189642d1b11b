"""A replicated table's Delta schema, protocol and configuration.

Columns use column mapping by name: each field has a stable id and a physical
name (the column's name inside the Parquet files), so renaming or dropping a
column is a metadata commit that rewrites no file, and a column added later is
NULL in the files written before. Fields carry the source column's attnum
(``replicator.attnum``), which identifies a column through renames, and its
PostgreSQL type as the column comment.

A portable table (``delta:URI?tables=portable``) has no column mapping: its fields
carry none of column mapping's metadata (Spark refuses to turn column mapping on
over it), each column's name in the files is its name, and renaming or dropping
one rewrites the files (replicator.targets.delta.rewrite). Its files' Parquet field
ids are the columns' attnums, which identify a column through renames as column
mapping's ids do.

A column may also be typed in Delta's own types (base type DELTA_TYPED, its
type a Delta type name): a view's columns, whose types are Spark's.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from replicator.errors import UserError
from replicator.structure import Column, TableStructure
from replicator.targets.arrow import arrow_type
from replicator.targets.delta.actions import Metadata, Protocol, configuration_of

ATTNUM = "replicator.attnum"
FIELD_ID = "delta.columnMapping.id"
PHYSICAL_NAME = "delta.columnMapping.physicalName"
MAX_COLUMN_ID = "delta.columnMapping.maxColumnId"
TABLE_META = "replicator.table"   # configuration key: the TargetTable replicator keeps of it (JSON)
# how long the log keeps a version readable: the time-travel window docs/delta.md promises (the
# files' retention, delta.deletedFileRetentionDuration, is 7 days too); a value another writer set is kept
LOG_RETENTION = "delta.logRetentionDuration"
LOG_RETENTION_WINDOW = "interval 7 days"


def delta_type(typ: pa.DataType) -> str:
    """The Delta (Spark) type name of an Arrow type replicator.targets.arrow produces."""
    if pa.types.is_int16(typ):
        return "short"
    if pa.types.is_int32(typ):
        return "integer"
    if pa.types.is_int64(typ):
        return "long"
    if pa.types.is_boolean(typ):
        return "boolean"
    if pa.types.is_float32(typ):
        return "float"
    if pa.types.is_float64(typ):
        return "double"
    if pa.types.is_binary(typ):
        return "binary"
    if pa.types.is_date(typ):
        return "date"
    if pa.types.is_timestamp(typ):
        return "timestamp" if typ.tz else "timestamp_ntz"
    if pa.types.is_decimal(typ):
        return f"decimal({typ.precision},{typ.scale})"
    return "string"


DELTA_TYPED = "delta"   # a Column's base type when its type is a Delta type name (a view's column)
_DELTA_ARROW = {"byte": pa.int8(), "short": pa.int16(), "integer": pa.int32(), "long": pa.int64(),
                "boolean": pa.bool_(), "float": pa.float32(), "double": pa.float64(), "binary": pa.binary(),
                "date": pa.date32(), "timestamp": pa.timestamp("us", tz="UTC"), "timestamp_ntz": pa.timestamp("us"),
                "string": pa.string()}


def arrow_type_of(name: str) -> pa.DataType | None:
    """The Arrow type of a Delta type name (atomic types); None for the others."""
    decimal = re.fullmatch(r"decimal\((\d+),(\d+)\)", name)
    if decimal:
        return pa.decimal128(int(decimal[1]), int(decimal[2]))
    return _DELTA_ARROW.get(name)


def column_arrow_type(column: Column) -> pa.DataType:
    """A column's Arrow type: its Delta type's, or PostgreSQL's mapping (replicator.targets.arrow)."""
    if column.base_type == DELTA_TYPED:
        typ = arrow_type_of(column.type)
        assert typ is not None, f"column {column.name} has no Arrow type for Delta type {column.type}"
        return typ
    return arrow_type(column)


def _column_delta_type(column: Column) -> str:
    return column.type if column.base_type == DELTA_TYPED else delta_type(arrow_type(column))


def _field(column: Column, name: str, key: bool, mapping: tuple[int, str] | None) -> dict[str, Any]:
    """A column's field; mapping: its column mapping id and physical name (None: a portable table's)."""
    metadata: dict[str, Any] = {} if mapping is None else {FIELD_ID: mapping[0], PHYSICAL_NAME: mapping[1]}
    metadata[ATTNUM] = column.attnum
    if column.base_type != DELTA_TYPED:
        metadata["comment"] = f"PostgreSQL {column.type}"
    return {"name": name, "type": _column_delta_type(column), "nullable": not (key and column.not_null),
            "metadata": metadata}


def _derived(delta_name: str, source_name: str) -> bool:
    """Whether a Delta name is the one the naming rule gives a column of this source name."""
    suffixed = re.fullmatch(re.escape(source_name) + r"_([2-9]|[1-9]\d+)", delta_name)   # _2 ... _10 ...
    return delta_name == source_name or suffixed is not None


# Readers fold case in their own ways (Spark as Java, character by character; others by Unicode's
# lower case): names equal under any of these folds count as equal.
def _folded(name: str) -> set[tuple[int, str]]:
    return {(0, name.casefold()), (1, name.lower()), (2, name.upper().lower())}


def delta_names(columns: Sequence[Column], old: dict[int, str]) -> list[str]:
    """The Delta names of a table's columns, distinct ignoring case as Delta readers compare
    them (PostgreSQL's "Val" and val are two columns). A column keeps the name it has in the
    table (old: by attnum) while that name is its source name's; the other columns take their
    source names, and a name another column has (ignoring case) gets the first free suffix
    _2, _3... (in attnum order): "Val" beside val is Val_2 while both are there and after
    either is dropped; a column renamed takes its new name."""
    names: dict[int, str] = {}
    taken: set[tuple[int, str]] = set()

    def free(name: str) -> bool:
        return not _folded(name) & taken

    def claim(column: Column, name: str) -> None:
        names[column.attnum] = name
        taken.update(_folded(name))

    ordered = sorted(columns, key=lambda c: c.attnum)
    for column in ordered:
        kept = old.get(column.attnum)
        if kept is not None and _derived(kept, column.name) and free(kept):
            claim(column, kept)
    for column in ordered:
        if column.attnum not in names and free(column.name):
            claim(column, column.name)
    for column in ordered:
        if column.attnum not in names:
            suffix = 2
            while not free(f"{column.name}_{suffix}"):
                suffix += 1
            claim(column, f"{column.name}_{suffix}")
    return [names[c.attnum] for c in columns]


def table_schema(structure: TableStructure, old: dict[str, Any] | None, max_column_id: int,
                 *, fresh: bool, portable: bool = False) -> tuple[dict[str, Any], int]:
    """The schema of a table of this structure, and the new maxColumnId. A column keeps the
    id and physical name it has in the old schema (found by attnum, its type unchanged)
    unless fresh (a table copied anew: every column new), and its name (delta_names). A
    portable table's columns have neither (no column mapping)."""
    old_fields = {} if old is None else {f["metadata"].get(ATTNUM): f for f in old["fields"]}
    kept = {} if fresh else old_fields
    names = delta_names(structure.columns, {attnum: f["name"] for attnum, f in old_fields.items()})
    fields = []
    for column, name in zip(structure.columns, names):
        previous = kept.get(column.attnum)
        key = column.name in structure.key
        if portable:
            mapping = None
        elif previous is not None and previous["type"] == _column_delta_type(column):
            mapping = (previous["metadata"][FIELD_ID], previous["metadata"][PHYSICAL_NAME])
        else:
            max_column_id += 1
            mapping = (max_column_id, f"col-{uuid.uuid4()}")
        fields.append(_field(column, name, key, mapping))
    return {"type": "struct", "fields": fields}, max_column_id


def physical_name(field: dict[str, Any]) -> str:
    """A column's name in the data files: its column mapping physical name, else (no column
    mapping: a portable table) its name."""
    name: str = field["metadata"].get(PHYSICAL_NAME, field["name"])
    return name


def parquet_field_id(field: dict[str, Any]) -> int:
    """The Parquet field id replicator writes for a column: its column mapping id, else (a
    portable table) its attnum; either follows the column through renames."""
    metadata = field["metadata"]
    return int(metadata[FIELD_ID] if FIELD_ID in metadata else metadata[ATTNUM])


def arrow_schema(structure: TableStructure, schema: dict[str, Any]) -> pa.Schema:
    """The Parquet schema of the table's data files: physical names and field ids, in the structure's
    order (each column's field found by attnum: another writer may have reordered the fields)."""
    fields = {f["metadata"].get(ATTNUM): f for f in schema["fields"]}
    missing = [c.name for c in structure.columns if c.attnum not in fields]
    if missing:
        raise UserError(f"{structure.qualified_name}: another writer dropped its column {missing[0]} from the Delta "
                        f"table; undo the change, or copy the table anew (consume --recopy)")
    return pa.schema([pa.field(physical_name(fields[c.attnum]), column_arrow_type(c),
                               metadata={b"PARQUET:field_id": str(parquet_field_id(fields[c.attnum])).encode()})
                      for c in structure.columns])


# the table features replicator writes; appendOnly: a table with delta.appendOnly true is refused rows removed;
# variantType (delta-rs lists it on a table it alters): no column of replicator's is a variant, and another
# writer's column is refused (ReplicaTable.check_writable)
WRITES = {"columnMapping", "deletionVectors", "timestampNtz", "invariants", "appendOnly", "variantType"}


def unsupported_features(protocol: Protocol | None) -> list[str]:
    """The writer features of a table's protocol that replicator does not write (another writer
    enabled them, e.g. Spark's changeDataFeed): a Delta writer must not write such a table."""
    return sorted(set(writer_features(protocol)) - WRITES)


def reader_features(protocol: Protocol | None) -> list[str]:
    return (protocol.get("readerFeatures") or []) if protocol is not None else []


def writer_features(protocol: Protocol | None) -> list[str]:
    return (protocol.get("writerFeatures") or []) if protocol is not None else []


def protocol(schema: dict[str, Any], old: Protocol | None = None, *, portable: bool = False) -> Protocol:
    """Reader 3 / writer 7 with the table features the schema uses (NOT NULL columns are
    the writer feature "invariants"), and those the table has already (none is ever dropped).
    A portable table (see is_portable) has neither columnMapping nor deletionVectors."""
    features = [] if portable else ["columnMapping", "deletionVectors"]
    if any(f["type"] == "timestamp_ntz" for f in schema["fields"]):
        features.append("timestampNtz")
    features += [f for f in reader_features(old) if f not in features]
    # a NOT NULL column is an invariant to Delta writers: Spark refuses a table whose protocol
    # does not list the (writer-only) feature then
    writer = features + (["invariants"] if any(not f["nullable"] for f in schema["fields"]) else [])
    writer += [f for f in writer_features(old) if f not in writer]
    return {"minReaderVersion": 3, "minWriterVersion": 7, "readerFeatures": features, "writerFeatures": writer}


def is_portable(protocol: Protocol) -> bool:
    """Whether a table is portable: written without column mapping (each column's physical name
    is its name) and without deletion vectors (a batch rewrites the files it changes), for the
    readers that lack those features (delta-rs' to_pyarrow_table, Polars)."""
    return "columnMapping" not in reader_features(protocol)


def metadata(old: Metadata | None, schema: dict[str, Any], max_column_id: int, meta: dict[str, Any],
             description: str, *, portable: bool = False) -> Metadata:
    """A metaData action: the table's id and creation time kept from the old one."""
    configuration = {LOG_RETENTION: LOG_RETENTION_WINDOW, **configuration_of(old)}
    configuration[TABLE_META] = json.dumps(meta, sort_keys=True)
    if not portable:
        configuration.update({MAX_COLUMN_ID: str(max_column_id), "delta.columnMapping.mode": "name",
                              "delta.enableDeletionVectors": "true"})
    return {"id": (old["id"] if old else "") or str(uuid.uuid4()), "name": None, "description": description,
            "format": {"provider": "parquet", "options": {}}, "schemaString": json.dumps(schema),
            "partitionColumns": [], "configuration": configuration,
            "createdTime": (old.get("createdTime") if old else None) or time.time_ns() // 1_000_000}


def max_column_id(metadata: Metadata | None) -> int:
    return int(configuration_of(metadata).get(MAX_COLUMN_ID, 0))
