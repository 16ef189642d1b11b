"""sqlglot's tree of a view's query, each node marked with its place in the text, and the check
that sqlglot read the target's tokens. Part of the analysis (replicator.views.analysis)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from sqlglot import exp
from sqlglot.dialects.dialect import Dialect

from replicator.views.tokens import Token

SPAN = "replicator_span"   # a node's place in the query: (start, end) offsets of its text

# sqlglot logs as warnings some of what it reads leniently (a JSON path it does not parse, as
# SQLite's '$[#-1]'): the analysis says what it does not read in its reasons, and the output
# of a view command or of the consumer is replicator's own.
logging.getLogger("sqlglot").setLevel(logging.ERROR)


class Unread(Exception):
    """sqlglot does not read the query (or reads it otherwise than the target): where, and why."""

    def __init__(self, fragment: str, detail: str) -> None:
        super().__init__(detail)
        self.fragment = fragment
        self.detail = detail


def _mark(node: exp.Expr, tokens: Sequence[Any], first: int, stop: int) -> None:
    """Records that node's text spans tokens[first:stop], widening what it spans already,
    or, on a node met for the first time, what its children span (a method given a node it
    adds to, like _parse_alias, starts after it)."""
    span = node.meta_get(SPAN)
    start, end = (tokens[first].start, tokens[stop - 1].end + 1) if first < stop else (None, None)
    if span is not None:
        if start is not None and (start < span[0] or end > span[1]):
            node.meta[SPAN] = (min(start, span[0]), max(end, span[1]))
        return
    spans = [s for s in (c.meta_get(SPAN) for c in node.iter_expressions()) if s]
    if start is not None:
        spans.append((start, end))
    if spans:
        node.meta[SPAN] = (min(s[0] for s in spans), max(s[1] for s in spans))


@functools.cache
def _parser_class(dialect: str) -> type[Any]:
    """sqlglot's parser of the dialect, made to record where each node's text is (sqlglot
    keeps the place of names and literals only): each of its parse methods (sqlglot names
    them _parse...) marks the node it returns with the tokens it consumed, and a function
    is marked before a FILTER or OVER clause wraps it (by _parse_window, from the
    function's first token, where the method that called it started)."""
    base = type(Dialect.get_or_raise(dialect).parser())

    def recording(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def parse(self: Any, *args: Any, **kwargs: Any) -> Any:
            start = self._index
            if name == "_parse_window" and args and isinstance(args[0], exp.Expr) and self.replicator_starts:
                _mark(args[0], self._tokens, self.replicator_starts[-1], start)
            self.replicator_starts.append(start)
            try:
                node = method(self, *args, **kwargs)
            finally:
                self.replicator_starts.pop()
            if isinstance(node, exp.Expr):
                _mark(node, self._tokens, start, self._index)
            return node
        return parse

    methods = {name: recording(name, getattr(base, name)) for name in dir(base) if name.startswith("_parse")}
    return type(f"Recording{base.__name__}", (base,), methods)


def parse(sql: str, tokens: Sequence[Token], dialect: str) -> exp.Expr:
    """sqlglot's tree of the query, read with its comments blanked out (the tokens say where
    they are: sqlglot's rules for them are not the target's). Raises Unread when sqlglot
    does not parse it, or reads other tokens than the target's (see _check_tokens)."""
    blanked = [" "] * len(sql)
    for t in tokens:
        blanked[t.start:t.end] = sql[t.start:t.end]
    text = "".join(blanked)
    sqlglot_dialect = Dialect.get_or_raise(dialect)
    parser = _parser_class(dialect)(dialect=sqlglot_dialect)
    parser.replicator_starts = []
    try:
        theirs = sqlglot_dialect.tokenize(text)
        _check_tokens(sql, tokens, theirs)
        trees = parser.parse(theirs, text)
    except Unread:
        raise
    except Exception as exc:   # its ParseError, TokenError, and on some input others (an IndexError for Spark's
        # SELECT MAP(...) USING): sqlglot does not read this query
        error = (getattr(exc, "errors", None) or [{}])[0]
        where = " ".join(((error.get("start_context") or "") + (error.get("highlight") or "")).split())
        description = error.get("description") or (str(exc).splitlines() or [type(exc).__name__])[0]
        raise Unread(where[-40:], f"sqlglot: {description}") from None
    tree = trees[0] if len(trees) == 1 else None
    if not isinstance(tree, exp.Expr):
        raise Unread("", "sqlglot reads no single statement")
    return tree


def _check_tokens(sql: str, tokens: Sequence[Token], theirs: Sequence[Any]) -> None:
    """Raises Unread unless sqlglot's tokens are the target's: each one of them or a run of
    them (a keyword of several words), or a piece of a string, number or operator of the
    target's (Spark's 'it''s' is two adjacent strings to sqlglot, SQLite's .5 a dot and 5,
    << two <), names and strings where the target has them; none of the target's left out
    (taken for a comment)."""
    def refuse(start: int, why: str) -> Unread:
        return Unread(" ".join(sql[start:start + 40].split()), why)

    covered = [False] * len(tokens)
    j = 0
    for token in theirs:
        start, end = token.start, token.end + 1
        while j < len(tokens) and tokens[j].end <= start:
            j += 1
        if j == len(tokens) or start < tokens[j].start:
            raise refuse(start, "sqlglot reads a token where the target reads a comment or space")
        mine = tokens[j]
        kind = token.token_type.name
        quoted = mine.kind in ("string", "blob")
        if mine.kind in ("string", "blob", "number", "op") and end <= mine.end \
                and (start, end) != (mine.start, mine.end) and quoted == kind.endswith("STRING"):
            covered[j] = True      # a piece of it
            continue
        k = j
        while k + 1 < len(tokens) and tokens[k].end < end:
            k += 1
        if start != mine.start or tokens[k].end != end or (k > j and any(t.kind != "word" for t in tokens[j:k + 1])) \
                or (mine.kind == "qident") != (kind == "IDENTIFIER") \
                or quoted != (kind.endswith("STRING") and mine.kind != "number"):
            raise refuse(start, "sqlglot reads this text otherwise than the target")
        covered[j:k + 1] = [True] * (k + 1 - j)
    if not all(covered):
        raise refuse(tokens[covered.index(False)].start, "sqlglot skips this text")
