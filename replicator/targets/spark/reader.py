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

from replicator.errors import UserError
from replicator.structure import TableStructure, target_table_name
from replicator.targets.spark.warehouse import DELETED, SEQ, Warehouse, entry_schema, physical_name, table_files


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
    if pa.types.is_decimal(typ):
        return T.DecimalType(typ.precision, typ.scale)
    return T.StringType()


def physical_struct(entry: dict[str, Any], *, log: bool = False) -> Any:
    """The Spark schema of a manifest table entry's files (physical column names)."""
    from pyspark.sql import types as T
    return T.StructType([T.StructField(f.name, spark_type(f.type), True) for f in entry_schema(entry, log=log)])


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


def latest_changes(spark: Any, log_paths: list[str], log_schema: Any, keys: list[str]) -> Any:
    """The change log files' rows, the latest of each key (files have one row per key,
    a later ``_seq`` wins), tombstones (``_deleted``) included."""
    return _latest(spark.read.schema(log_schema).parquet(*log_paths), len(log_paths), keys)


def _latest(changes: Any, files: int, keys: list[str]) -> Any:
    """The latest row of each key of a read of `files` change log files."""
    from pyspark.sql import functions as F
    from pyspark.sql.window import Window

    if files > 1:
        latest = Window.partitionBy(*keys).orderBy(F.col(SEQ).desc())
        changes = changes.withColumn("_rank", F.row_number().over(latest)).where("_rank = 1").drop("_rank")
    return changes


def merge_on_read(spark: Any, base: Any, log_paths: list[str], log_schema: Any, keys: list[str]) -> Any:
    """A base DataFrame with change log files folded in: the latest row of each key wins."""
    from pyspark.sql import functions as F

    if not log_paths:
        return base
    logged = spark.read.schema(log_schema).parquet(*log_paths)
    changes = _latest(logged, len(log_paths), keys)
    # Every key of any log file is touched, whichever row of it wins: the broadcast side
    # reads the key columns of the files as they are, not the latest rows, so the scan of
    # the base does not wait for the shuffle and sort that pick them (a stage less in line).
    touched = logged.select(*[F.col(k).alias(f"_key_{k}") for k in keys])
    return merge_frames(base, changes.where(~F.col(DELETED)), touched, keys)


def merge_frames(base: Any, current: Any, touched: Any, keys: list[str]) -> Any:
    """The base's rows whose key the log does not touch (touched: the key columns of
    every log row, named _key_<k>), and the log's current rows (tombstones left out)."""
    from pyspark.sql import functions as F

    condition = reduce(lambda a, b: a & b, [base[k].eqNullSafe(touched[f"_key_{k}"]) for k in keys])
    return base.join(F.broadcast(touched), condition, "left_anti").unionByName(current.select(*base.columns))


def current_names(frame: Any, structure: TableStructure) -> Any:
    """A frame of a table's physical columns with the columns' current names."""
    from pyspark.sql import functions as F

    return frame.select(*[F.col(physical_name(c)).alias(c.name) for c in structure.columns])


def read_parquet(spark: Any, paths: list[str], schema: Any) -> Any:
    """Parquet files (or directories of them) with a known schema; none: an empty frame."""
    if paths:
        return spark.read.schema(schema).parquet(*paths)
    return spark.createDataFrame([], schema)


def merged_physical(spark: Any, warehouse: Warehouse, entry: dict[str, Any]) -> Any:
    """The current rows of a manifest table entry, with physical column names."""
    structure = TableStructure.from_json(entry["structure"])
    base_files, log_files = table_files(entry)
    base = read_parquet(spark, [str(warehouse.file(f)) for f in base_files], physical_struct(entry))
    return merge_on_read(spark, base, [str(warehouse.file(f)) for f in log_files],
                         physical_struct(entry, log=True), [physical_name(c) for c in structure.key_columns()])


def logged_rows(spark: Any, warehouse: Warehouse, entry: dict[str, Any], log_files: list[str]) -> Any:
    """The rows some of a table entry's log files set (their latest, tombstones left
    out), with the columns' current names: a transaction's new rows, without reading
    the table."""
    from pyspark.sql import functions as F

    structure = TableStructure.from_json(entry["structure"])
    changes = latest_changes(spark, [str(warehouse.file(f)) for f in log_files], physical_struct(entry, log=True),
                             [physical_name(c) for c in structure.key_columns()])
    return current_names(changes.where(~F.col(DELETED)), structure)


def entry_frame(spark: Any, warehouse: Warehouse, entry: dict[str, Any]) -> Any:
    """The current rows of a manifest table entry, with the columns' current names."""
    return current_names(merged_physical(spark, warehouse, entry), TableStructure.from_json(entry["structure"]))


# ---- the stored rows of an incremental view (targets/spark/views.py keeps them)

def view_frame(spark: Any, warehouse: Warehouse, entry: dict[str, Any]) -> Any:
    """A view's rows (its query's columns, by their names) from a manifest entry."""
    from pyspark.sql import functions as F

    merged = storage_frame(spark, warehouse, entry)
    return merged.select(*[F.col(p).alias(c) for p, c in zip(value_names(entry), entry["columns"])])


def value_names(entry: dict[str, Any]) -> list[str]:
    return [f"_replicator_v{j}" for j in range(len(entry["columns"]))]


def storage_schema(entry: dict[str, Any], *, log: bool = False) -> Any:
    from pyspark.sql import types as T
    schema = T.StructType.fromJson(entry["schema"])
    if log:
        schema = T.StructType([*schema.fields, T.StructField(SEQ, T.LongType(), True),
                               T.StructField(DELETED, T.BooleanType(), True)])
    return schema


def storage_frame(spark: Any, warehouse: Warehouse, entry: dict[str, Any]) -> Any:
    base = read_parquet(spark, [str(warehouse.file(f)) for f in entry["base"]], storage_schema(entry))
    if not entry["key_columns"]:
        return base
    return merge_on_read(spark, base, [str(warehouse.file(log["file"])) for log in entry["logs"]],
                         storage_schema(entry, log=True), entry["key_columns"])


def read_table(spark: Any, path: Path | str, table: str) -> Any:
    """The current state of a replicated table (schema.table, or its view name)
    as a DataFrame, as of the manifest read now."""
    warehouse = Warehouse(path)
    if not warehouse.exists():
        raise UserError(f"{warehouse.path} is not a replicator Spark warehouse (no manifest)")
    _, entry = _entry(warehouse.read(), table)
    return entry_frame(spark, warehouse, entry)


def register_views(spark: Any, path: Path | str) -> list[str]:
    """Registers a temporary view per replicated table (named as the SQLite
    target names tables: public.t → t, s.t → s__t) and per incremental view
    (by its name); returns the names. They hold the state of this call:
    register again to see later batches."""
    warehouse = Warehouse(path)
    manifest = warehouse.read()
    names = []
    for entry in manifest["tables"].values():
        s = TableStructure.from_json(entry["structure"])
        view = target_table_name(s.schema, s.name)
        entry_frame(spark, warehouse, entry).createOrReplaceTempView(view)
        names.append(view)
    for name, entry in manifest.get("views", {}).items():
        view_frame(spark, warehouse, entry).createOrReplaceTempView(name)
        names.append(name)
    return names


def read_view(spark: Any, path: Path | str, name: str) -> Any:
    """The rows of incremental view NAME (`replicator view create --target spark:PATH`)."""
    warehouse = Warehouse(path)
    views = warehouse.read().get("views", {})
    entry = next((e for n, e in views.items() if n.lower() == name.lower()), None)
    if entry is None:
        raise UserError(f"no view {name!r} in the warehouse {warehouse.path}")
    return view_frame(spark, warehouse, entry)
