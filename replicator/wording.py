"""How messages word counts."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`1 row`, `5,000 rows`, `2 batches`: the count, then the noun, plural (noun + s
    unless given) but for one."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def format_age(seconds: float) -> str:
    """A length of time in its largest unit and the next, as an operator reads it: `45s`,
    `1h 5min`, `2d 3h`, `2h` (the next unit left out when it is zero)."""
    units = (("d", 86400), ("h", 3600), ("min", 60), ("s", 1))
    whole = int(seconds)
    first = next((i for i, (_, size) in enumerate(units) if whole >= size), len(units) - 1)
    unit, size = units[first]
    parts = [f"{whole // size}{unit}"]
    if first + 1 < len(units) and (rest := whole % size // units[first + 1][1]):
        parts.append(f"{rest}{units[first + 1][0]}")
    return " ".join(parts)
