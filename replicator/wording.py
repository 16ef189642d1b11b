"""How messages word counts."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`1 row`, `5,000 rows`, `2 batches`: the count, then the noun, plural (noun + s
    unless given) but for one."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
