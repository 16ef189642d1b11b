"""SQL text as the SQLite views write and read it: names quoted, column definitions, and which
aggregate a select item calls (for folding it).

The one module of the SQLite views that uses the analysis's tokenizer (tokenize, matching,
quote of replicator.views.analysis): when a parser replaces it, this module is what changes."""

from __future__ import annotations

from dataclasses import dataclass

from replicator.views.analysis import matching, quote, tokenize

__all__ = ["AGGREGATE_FUNCTIONS", "AggregateCall", "aggregate_call", "column_definitions", "quote"]

# SQLite's aggregate functions (and those of its usual extensions): a select item that calls
# one aggregates.
AGGREGATE_FUNCTIONS = {"count", "sum", "avg", "total", "min", "max", "group_concat", "string_agg",
                       "json_group_array", "json_group_object", "jsonb_group_array", "jsonb_group_object",
                       "median", "percentile", "percentile_cont", "percentile_disc"}


def column_definitions(columns: list[tuple[str, str]]) -> str:
    """The column definitions of a CREATE TABLE: (name, declared type)s."""
    return ", ".join(f"{quote(c)} {t}".strip() for c, t in columns)


@dataclass(frozen=True)
class AggregateCall:
    """A select item that calls an aggregate, as far as folding it needs."""
    function: str                          # lower case, when the item is that one call and nothing else; else ""
    star: bool                             # its argument is *
    column: tuple[str | None, str] | None  # its argument when that is a column: (qualifier, name)


def aggregate_call(item: str) -> AggregateCall | None:
    """The aggregate call of a select item (an expression, without its alias); None when it calls
    none (a GROUP BY expression)."""
    tokens = tokenize(item)
    calls = [t for k, t in enumerate(tokens) if t.kind == "word" and t.lower in AGGREGATE_FUNCTIONS
             and k + 1 < len(tokens) and tokens[k + 1].text == "("]
    if not calls:
        return None
    if len(calls) != 1 or tokens[1].text != "(" or matching(tokens, 1) != len(tokens) - 1:
        return AggregateCall("", star=False, column=None)   # a FILTER clause, an expression of aggregates
    arg = tokens[2:-1]
    star = len(arg) == 1 and arg[0].text == "*"
    qualifier = None
    if len(arg) == 3 and arg[1].text == "." and arg[0].ident is not None:
        qualifier, arg = arg[0].ident, arg[2:]
    name = arg[0].ident if len(arg) == 1 and arg[0].kind in ("word", "qident") else None
    return AggregateCall(tokens[0].lower, star=star, column=None if name is None else (qualifier, name))
