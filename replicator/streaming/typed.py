"""Typed rows of one table for the streaming source (option "table").

The schema is the table's columns with the warehouse's type mapping
(arrow_type: numeric(p,s) → DECIMAL(p,s), timestamptz → TIMESTAMP, ...), then
change-feed columns named as Delta's change data feed names them. Each field
of the table's columns carries its attnum in its metadata, so a column is
found through renames. Rows go to Spark as Arrow record batches of that
schema, decoded as the consumer decodes them (replicator.structure decoders,
arrow_array).

A row's values follow the layout it was captured with: a column the schema
has and the layout lacks (dropped, not captured in pk mode, deleted row's
non-key columns, TRUNCATE) is NULL; a column whose type changed is cast to the
schema's type, and a value that type cannot hold stops the query.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pyarrow as pa
from pyspark.sql.pandas.types import from_arrow_type, to_arrow_schema
from pyspark.sql.types import StructField, StructType

from replicator.structure import Column, RowsDecoder, TableStructure, decoder_for, identity, parse_json, rows_decoder
from replicator.targets.arrow import arrow_array, arrow_type

ATTNUM = "replicator.attnum"   # field metadata: the column's attnum
CHANGE_TYPES = {"I": "insert", "U": "update_postimage", "D": "delete", "T": "truncate"}
_UTC = pa.timestamp("us", tz="UTC")
METADATA = (("_change_type", pa.string()), ("_commit_version", pa.int64()), ("_commit_timestamp", _UTC),
            ("_txid", pa.int64()), ("_event_time", _UTC), ("_ev_id", pa.int64()), ("_item", pa.int32()))
BATCH_ROWS = 10_000
EVOLUTION_MODES = ("addNewColumns", "none")


def layout_structure(structure: dict[str, Any], columns: Sequence[str], key: Sequence[str]) -> dict[str, Any]:
    """What a typed layout keeps of a table_structure(): its captured columns in capture order."""
    captured = TableStructure.from_source(structure, columns, key)
    return {"key": list(captured.key), "columns": [c.__dict__ for c in captured.columns]}


def _structure(layout: dict[str, Any]) -> TableStructure:
    schema, _, name = layout["name"].partition(".")
    data = layout["structure"]
    return TableStructure(schema=schema, name=name, key=tuple(data["key"]),
                          columns=tuple(Column(**c) for c in data["columns"]))


def shown_columns(layout: dict[str, Any]) -> list[Column]:
    """The columns a layout's rows hold: all captured columns, only the key in pk mode."""
    structure = _structure(layout)
    return list(structure.columns) if layout["mode"] == "full" else structure.key_columns()


def spark_schema(layout: dict[str, Any]) -> StructType:
    """The typed stream's schema for a table of this layout."""
    columns = shown_columns(layout)
    clash = sorted({c.name for c in columns} & {name for name, _ in METADATA})
    if clash:
        raise ValueError(f"table {layout['name']} has column(s) {', '.join(clash)}, which the typed stream "
                         f"uses for its change columns: rename them in a view, or read the untyped stream")
    return StructType([StructField(c.name, from_arrow_type(arrow_type(c)), True, {ATTNUM: c.attnum})
                       for c in columns] + [StructField(n, from_arrow_type(t), True) for n, t in METADATA])


@dataclass(frozen=True)
class TypedSchema:
    """The query's schema as the reader uses it: Arrow types, the table fields' attnums."""
    arrow: pa.Schema
    attnums: tuple[int, ...]    # of the table's fields, which come first

    @classmethod
    def from_spark(cls, schema: StructType) -> TypedSchema:
        attnums = tuple(f.metadata[ATTNUM] for f in schema.fields if ATTNUM in (f.metadata or {}))
        names = [f.name for f in schema.fields[len(attnums):]]
        if not attnums or names != [n for n, _ in METADATA]:
            raise ValueError("format('replicator') with option table makes its schema from the table's "
                             "columns: leave out .schema(...)")
        return cls(arrow=to_arrow_schema(schema, timezone="UTC"), attnums=attnums)

    def unshown(self, layout: dict[str, Any]) -> list[Column]:
        """The columns of a layout's rows that this schema lacks."""
        return [c for c in shown_columns(layout) if c.attnum not in self.attnums]


@dataclass(frozen=True)
class _Shape:
    """How the items of one layout's events of one kind become rows of the query's table columns."""
    positions: tuple[int, ...]              # per table field: its index in an item, -1 when the item lacks it
    captured: tuple[Column | None, ...]     # per table field: the column it was captured as
    decode: RowsDecoder                     # of rows already in the fields' order

    def rows(self, items: list[Any]) -> list[Sequence[Any]]:
        positions = self.positions
        return self.decode([[item[p] if p >= 0 else None for p in positions] for item in items])


class TypedBatches:
    """Collects one table's changes into record batches of the query's schema, in event order.

    A batch holds up to BATCH_ROWS rows whose columns were captured with the
    same Arrow types (rows that lack a column go with any); add() returns the
    batches it completed."""

    def __init__(self, schema: TypedSchema) -> None:
        self.schema = schema
        self._shapes: dict[tuple[int, str], _Shape] = {}
        self._captured: list[Column | None] = [None] * len(schema.attnums)
        self._rows: list[Sequence[Any]] = []
        self._meta: list[tuple[Any, ...]] = []
        self._name = ""

    def _shape(self, layout: dict[str, Any], kind: str) -> _Shape:
        shape = self._shapes.get((id(layout), kind))
        if shape is None:
            structure = _structure(layout)
            columns = {"row": list(structure.columns), "key": structure.key_columns(), "none": []}[kind]
            by_attnum = {c.attnum: i for i, c in enumerate(columns)}
            positions = tuple(by_attnum.get(a, -1) for a in self.schema.attnums)
            captured = tuple(columns[p] if p >= 0 else None for p in positions)
            decode = rows_decoder([identity if c is None else decoder_for(c) for c in captured])
            shape = self._shapes[(id(layout), kind)] = _Shape(positions, captured, decode)
        return shape

    def add(self, layout: dict[str, Any], ev_type: str, data: str | None,
            meta: tuple[int, datetime, int, datetime, int]) -> list[pa.RecordBatch]:
        """One event: meta is (tick, tick time, txid, event time, ev_id)."""
        kind = "none" if ev_type == "T" else "row" if layout["mode"] == "full" and ev_type != "D" else "key"
        shape = self._shape(layout, kind)
        done = []
        if len(self._rows) >= BATCH_ROWS or not self._fits(shape):
            done = self.flush()
        self._name = layout["name"]
        self._captured = [mine or theirs for mine, theirs in zip(self._captured, shape.captured)]
        change = CHANGE_TYPES[ev_type]
        tick, tick_time, txid, ev_time, ev_id = meta
        items = [[]] if kind == "none" else parse_json(data or "[]")
        self._rows.extend(shape.rows(items))
        self._meta.extend((change, tick, tick_time, txid, ev_time, ev_id, i) for i in range(len(items)))
        return done

    def _fits(self, shape: _Shape) -> bool:
        """Whether the shape's columns have the Arrow types of the rows collected (a type changed between)."""
        return all(mine is None or theirs is None or arrow_type(mine) == arrow_type(theirs)
                   for mine, theirs in zip(self._captured, shape.captured))

    def flush(self) -> list[pa.RecordBatch]:
        if not self._rows:
            return []
        arrays = [self._array(values, column, field) for values, column, field
                  in zip(zip(*self._rows), self._captured, self.schema.arrow)]
        for values, field in zip(zip(*self._meta), list(self.schema.arrow)[len(self.schema.attnums):]):
            arrays.append(pa.array(values, type=field.type))
        self._rows, self._meta = [], []
        self._captured = [None] * len(self.schema.attnums)
        return [pa.RecordBatch.from_arrays(arrays, schema=self.schema.arrow)]

    def _array(self, values: Sequence[Any], column: Column | None, field: pa.Field) -> pa.Array:
        if column is None:
            return pa.nulls(len(values), field.type)
        label = f"{self._name}.{column.name}"
        captured = arrow_array(values, arrow_type(column), label=label)
        if captured.type == field.type:
            return captured
        try:   # the column's type changed since the query started
            return captured.cast(field.type, safe=True)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise RuntimeError(f"{label}: a value captured as {column.type} does not fit this query's type "
                               f"{field.type} (the column's type changed after the query started): {e}. "
                               f"Define the stream again (load() reads the table's new types) and start it "
                               f"from the same checkpoint") from None


def typed_batches(events: Iterator[tuple[Any, ...]], schema: TypedSchema) -> Iterator[pa.RecordBatch]:
    """Record batches of a partition's events of the table (datasource.partition_events); S events
    make no row."""
    batches = TypedBatches(schema)
    for tick, tick_time, layout, ev_id, txid, ev_time, ev_type, _table_id, data in events:
        if ev_type == "S" or layout is None:
            continue
        yield from batches.add(layout, ev_type, data, (tick, tick_time, txid, ev_time, ev_id))
    yield from batches.flush()
