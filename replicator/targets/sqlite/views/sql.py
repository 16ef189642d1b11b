"""SQL text as the SQLite views write it: names quoted, column definitions."""

from __future__ import annotations

from replicator.views.analysis import quote

__all__ = ["column_definitions", "quote"]


def column_definitions(columns: list[tuple[str, str]]) -> str:
    """The column definitions of a CREATE TABLE: (name, declared type)s."""
    return ", ".join(f"{quote(c)} {t}".strip() for c, t in columns)
