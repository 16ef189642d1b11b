"""The SQLite column type a PostgreSQL column is replicated as (its type affinity)."""

from __future__ import annotations

from replicator.structure import FLOAT_TYPES, INTEGER_TYPES, Column


def sqlite_type(column: Column) -> str:
    """SQLite column type (affinity) for a PostgreSQL column."""
    base = column.base_type
    if column.category == "A":
        return "TEXT"
    if base in INTEGER_TYPES or base == "boolean":
        return "INTEGER"
    if base in FLOAT_TYPES:
        return "REAL"
    if base == "bytea":
        return "BLOB"
    return "TEXT"
