"""Reading a Spark warehouse: each table's current state as a DataFrame.

Merge-on-read: the base minus the keys the change log touched, plus the
log's latest upserts. The log is small (what happened since the last
compaction), so the anti-join against it is broadcast and the base is
scanned once, without a shuffle. Columns are projected from their physical
names (c<attnum>) to the names the manifest's structure gives them now;
columns added after a file was written read as NULL.
"""

from __future__ import annotations

from functools import reduce
from pathlib import Path
from typing import Any

import pyarrow as pa

from ..errors import UserError
from ..schema import TableStructure, target_table_name
from .warehouse import DELETED, SEQ, Warehouse, arrow_type, physical_name, table_files


def spark_type(typ: pa.DataType) -> Any:
    from pyspark.sql import types as T
    if pa.types.is_int16(typ):
        return T.ShortType()
    if pa.types.is_int32(typ):
        return T.IntegerType()
    if pa.types.is_int64(typ):
        return T.LongType()
    if pa.types.is_boolean(typ):
        return T.BooleanType()
    if pa.types.is_float32(typ):
        return T.FloatType()
    if pa.types.is_float64(typ):
        return T.DoubleType()
    if pa.types.is_binary(typ):
        return T.BinaryType()
    if pa.types.is_date(typ):
        return T.DateType()
    if pa.types.is_timestamp(typ):
        return T.TimestampType() if typ.tz else T.TimestampNTZType()
    return T.StringType()


def _physical_struct(structure: TableStructure, *, log: bool = False) -> Any:
    from pyspark.sql import types as T
    fields = [T.StructField(physical_name(c), spark_type(arrow_type(c)), True) for c in structure.columns]
    if log:
        fields += [T.StructField(SEQ, T.LongType(), True), T.StructField(DELETED, T.BooleanType(), True)]
    return T.StructType(fields)


def table_names(path: Path | str) -> dict[str, str]:
    """View name (as the SQLite target names tables: t, or schema__t) → source name."""
    manifest = Warehouse(path).read()
    out = {}
    for name, entry in manifest["tables"].items():
        s = TableStructure.from_json(entry["structure"])
        out[target_table_name(s.schema, s.name)] = name
    return out


def _entry(manifest: dict[str, Any], table: str) -> tuple[str, dict[str, Any]]:
    tables = manifest["tables"]
    if table in tables:
        return table, tables[table]
    if f"public.{table}" in tables:
        return f"public.{table}", tables[f"public.{table}"]
    for name, entry in tables.items():
        s = TableStructure.from_json(entry["structure"])
        if target_table_name(s.schema, s.name) == table:
            return name, entry
    raise UserError(f"table {table!r} is not in the warehouse")


def merged_physical(spark: Any, warehouse: Warehouse, entry: dict[str, Any]) -> Any:
    """The current rows of a manifest table entry, with physical column names."""
    from pyspark.sql import functions as F
    from pyspark.sql.window import Window

    structure = TableStructure.from_json(entry["structure"])
    schema = _physical_struct(structure)
    columns = [f.name for f in schema.fields]
    base_files, log_files = table_files(entry)
    if base_files:
        base = spark.read.schema(schema).parquet(*[str(warehouse.file(f)) for f in base_files])
    else:
        base = spark.createDataFrame([], schema)
    if not log_files:
        return base
    keys = [physical_name(c) for c in structure.key_columns()]
    changes = spark.read.schema(_physical_struct(structure, log=True)).parquet(
        *[str(warehouse.file(f)) for f in log_files])
    if len(log_files) > 1:   # each file has one row per key: the latest file wins
        latest = Window.partitionBy(*keys).orderBy(F.col(SEQ).desc())
        changes = changes.withColumn("_rank", F.row_number().over(latest)).where("_rank = 1").drop("_rank")
    touched = changes.select(*[F.col(k).alias(f"_key_{k}") for k in keys])
    condition = reduce(lambda a, b: a & b, [base[k].eqNullSafe(touched[f"_key_{k}"]) for k in keys])
    kept = base.join(F.broadcast(touched), condition, "left_anti")
    return kept.unionByName(changes.where(~F.col(DELETED)).select(*columns))


def read_table(spark: Any, path: Path | str, table: str) -> Any:
    """The current state of a replicated table (schema.table, or its view name)
    as a DataFrame, as of the manifest read now."""
    from pyspark.sql import functions as F

    warehouse = Warehouse(path)
    if not warehouse.exists():
        raise UserError(f"{warehouse.path} is not a replicator Spark warehouse (no manifest)")
    _, entry = _entry(warehouse.read(), table)
    structure = TableStructure.from_json(entry["structure"])
    merged = merged_physical(spark, warehouse, entry)
    return merged.select(*[F.col(physical_name(c)).alias(c.name) for c in structure.columns])


def register_views(spark: Any, path: Path | str) -> list[str]:
    """Registers a temporary view per replicated table (named as the SQLite
    target names tables: public.t → t, s.t → s__t); returns the view names.
    Views hold the state of this call: register again to see later batches."""
    warehouse = Warehouse(path)
    manifest = warehouse.read()
    names = []
    for name in manifest["tables"]:
        s = TableStructure.from_json(manifest["tables"][name]["structure"])
        view = target_table_name(s.schema, s.name)
        read_table(spark, path, name).createOrReplaceTempView(view)
        names.append(view)
    return names
