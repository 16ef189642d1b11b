"""Incremental views: the analysis of a view's defining query.

A view is a SELECT in the target's own SQL (SQLite's, or Spark SQL on a
Spark warehouse) over replicated tables. This module reads the query and
decides whether the target can keep it current incrementally, by recomputing
only the keys a batch touched:

- the GROUP BY values, for an aggregate view (any deterministic aggregate,
  HAVING allowed);
- the selected values, for a SELECT DISTINCT view;
- the keys of the base tables, for a filter/projection of one table or an
  inner equi-join of two or three tables (a view row is one combination of
  base rows, named by their keys).

Anything else is given a reason code and the offending fragment; with
policy ``auto`` such a view is refreshed in full after every batch that
touched its tables, with ``incremental`` it is refused. The maintenance
itself (capture of old and new rows, recomputation) is the target's:
see ``replicator/targets/sqlite/views/``.

The query is read twice. First into tokens as the target's own lexer reads
them (a small tokenizer per dialect, with SQLite's and Spark's rules for
comments, quoting and string escapes): what must never reach the target is
refused on these (a second statement, a `)` that closes the target's wrapper,
parameters, a statement other than a query; in Spark SQL, scripts, Java
methods, files read by path), and so are the functions of time and chance.
Then sqlglot, a maintained SQL parser, parses it into the tree its structure
is read from: tables, joins, select items, GROUP BY, HAVING, subqueries,
windows. Its tokens must be the target's (a query the two read differently,
or that sqlglot does not read, is refreshed in full: reason UNREAD), and each
node keeps its place in the text: expressions are copied verbatim into the
generated statements, which the target then checks; a generated statement
that does not prepare demotes the view to a full refresh (reason REWRITE).
"""

from __future__ import annotations

import functools
import itertools
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlglot import exp
from sqlglot.dialects.dialect import Dialect

from replicator.errors import UserError

MAX_JOIN_TABLES = 3

# Reason codes, with what they mean (`replicator view explain` prints them).
REASONS = {
    "CTE": "WITH (common table expressions) is not maintained incrementally",
    "SET_OPERATION": "UNION, INTERSECT and EXCEPT are not maintained incrementally",
    "SUBQUERY": "subqueries (in FROM, in expressions, EXISTS, IN (SELECT ...), IN table) are not maintained "
                "incrementally",
    "WINDOW_FUNCTION": "window functions depend on rows outside the changed keys",
    "LIMIT": "LIMIT/OFFSET depend on rows outside the changed keys",
    "NONDETERMINISTIC": "the query is not deterministic: recomputing some keys would not agree with the rest",
    "OUTER_JOIN": "outer joins are not maintained incrementally (inner joins are)",
    "JOIN_USING": "NATURAL joins and USING (...) are not maintained incrementally: write ON a.x = b.x",
    "TABLE_FUNCTION": "table-valued functions in FROM are not maintained incrementally",
    "TOO_MANY_TABLES": f"joins of more than {MAX_JOIN_TABLES} tables are not maintained incrementally",
    "NO_EQUI_JOIN": "every joined table must be linked to the others by an equality (a cross product is "
                    "recomputed in full)",
    "NOT_REPLICATED": "the table is not a replicated table: its changes are not seen batch by batch",
    "NO_TABLE": "the query reads no table",
    "NO_KEY": "an aggregate without GROUP BY has a single row: every change recomputes all of it",
    "DISTINCT_AGGREGATE": "SELECT DISTINCT over GROUP BY merges rows of different groups",
    "BARE_COLUMN": "a column outside any aggregate and not in GROUP BY takes the value of an arbitrary row",
    "ORDER_DEPENDENT": "the aggregate's result depends on the order rows are read in",
    "COLLATION": "a key compared under a collation other than BINARY cannot be matched exactly",
    "UNREAD": "the analysis does not read this SQL (sqlglot's parse of it): the view is refreshed in full",
    "REWRITE": "a generated maintenance statement does not run: the view is refreshed in full",
    "POLICY_FULL": "the view's policy is full",
}

_AGGREGATES = {"count", "sum", "total", "avg", "min", "max", "group_concat", "string_agg",
               "json_group_array", "json_group_object", "jsonb_group_array", "jsonb_group_object",
               "median", "percentile", "percentile_cont", "percentile_disc"}
_ORDER_DEPENDENT = {"group_concat", "string_agg", "json_group_array", "json_group_object",
                    "jsonb_group_array", "jsonb_group_object"}
_NONDETERMINISTIC = {"random", "randomblob", "changes", "total_changes", "last_insert_rowid",
                     "sqlite_offset", "load_extension",
                     # Spark SQL
                     "rand", "randn", "uuid", "shuffle", "monotonically_increasing_id",
                     "spark_partition_id", "input_file_name", "now", "curdate", "current_timezone",
                     "localtimestamp"}
# The current time, with or without parentheses (SQLite's keywords, Spark's functions).
_NOW_WORDS = {"current_timestamp", "current_date", "current_time"}
# Functions of a time value that stand for now when it is left out: the number of
# arguments a call needs to name its time value (strftime's first is the format).
_TIME_VALUE_ARGUMENTS = {"date": 1, "time": 1, "datetime": 1, "julianday": 1, "unixepoch": 1, "strftime": 2,
                         "timediff": 2, "unix_timestamp": 1}
# Spark's special values stand for the current time wherever a string becomes a date or
# a timestamp (SQLite's 'now' only as the time value of the functions above).
_SPARK_NOW_STRINGS = {"now", "today", "yesterday", "tomorrow"}


# tokens ------------------------------------------------------------------------------

_TOKENS = {
    "sqlite": re.compile(r"""
   (?P<ws>\s+)
  |(?P<comment>--[^\n]*|/\*.*?(?:\*/|\Z))
  |(?P<blob>[xX]'[0-9a-fA-F]*')
  |(?P<string>'(?:[^']|'')*')
  |(?P<qident>"(?:[^"]|"")*"|`(?:[^`]|``)*`|\[[^\]]*\])
  |(?P<number>0[xX][0-9a-fA-F]+|(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)
  |(?P<param>\?\d*|[:@$][A-Za-z_][A-Za-z0-9_]*)
  |(?P<word>[A-Za-z_\u0080-\U0010ffff][A-Za-z0-9_$\u0080-\U0010ffff]*)
  |(?P<op>\|\||->>|->|<<|>>|<=|>=|==|!=|<>|[-+*/%<>=~&|(),.;])
""", re.S | re.X),
    # Spark SQL: strings in '...' or "..." with backslash escapes or doubled quotes (and raw r'...'),
    # names only in backquotes, [ ] subscripts, typed number literals (10L, 1.5BD). Comments as
    # Spark's lexer (SqlBaseLexer) reads them: `--` ends at \r or \n but goes on past a
    # backslash-newline; `/* */` nests (read by tokenize, not by this pattern), and a hint
    # `/*+ ... */` is taken for a comment too (a view's text goes to Spark without them).
    # Words are letters, digits and _ only: Spark ends a name at any other character (its
    # spaces include no-break and other Unicode spaces, which \s matches).
    "spark": re.compile(r"""
   (?P<ws>\s+)
  |(?P<comment>--(?:\\\n|[^\r\n])*)
  |(?P<blob>[xX]'[0-9a-fA-F]*')
  |(?P<string>[rR]'[^']*'|[rR]"[^"]*"|'(?:[^'\\]|\\.|'')*'|"(?:[^"\\]|\\.|"")*")
  |(?P<qident>`(?:[^`]|``)*`)
  |(?P<number>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?(?:(?:[bB][dD]|[lLsSyYdDfF])(?![A-Za-z0-9_]))?)
  |(?P<param>\?|:[A-Za-z_][A-Za-z0-9_]*)
  |(?P<word>[^\W\d]\w*)
  |(?P<op>\|\||->|=>|<=>|<<|>>>|>>|<=|>=|==|!=|<>|!<|!>|::|[-+*/%<>=~&|^!(),.;\[\]])
""", re.S | re.X),
}


def _bracketed_comment_end(sql: str, pos: int) -> int:
    """The end of the Spark comment starting with /* at pos: comments nest, as in Spark's
    lexer (a /*+ inside one opens nothing); -1 when it is not closed."""
    depth, i, n = 1, pos + 2, len(sql)
    while i < n:
        if sql.startswith("*/", i):
            depth -= 1
            i += 2
            if not depth:
                return i
        elif sql.startswith("/*", i) and not sql.startswith("/*+", i):
            depth += 1
            i += 2
        else:
            i += 1
    return -1


@dataclass(frozen=True)
class Token:
    kind: str      # word, qident, string, blob, number, param, op
    text: str
    start: int
    end: int

    @property
    def lower(self) -> str:
        return self.text.lower() if self.kind == "word" else ""

    @property
    def ident(self) -> str | None:
        """The identifier this token names (words and quoted identifiers), else None."""
        if self.kind == "word":
            return self.text
        if self.kind == "qident":
            q = self.text[0]
            inner = self.text[1:-1]
            return inner if q == "[" else inner.replace(q * 2, q)
        return None


def tokenize(sql: str, dialect: str = "sqlite") -> list[Token]:
    pattern = _TOKENS[dialect]
    tokens: list[Token] = []
    pos = 0
    while pos < len(sql):
        if dialect == "spark" and sql.startswith("/*", pos):
            end = _bracketed_comment_end(sql, pos)
            if end < 0:
                raise UserError("the view's SQL has an unterminated comment")
            pos = end
            continue
        m = pattern.match(sql, pos)
        if m is None:
            if sql[pos] in "'\"`[":
                raise UserError("the view's SQL has an unterminated string or quoted name")
            raise UserError(f"cannot read the view's SQL at {sql[pos:pos + 20]!r}")
        kind = m.lastgroup or ""
        if kind == "comment" and m.group().startswith("/*") and not m.group().endswith("*/"):
            raise UserError("the view's SQL has an unterminated comment")
        if kind not in ("ws", "comment"):
            tokens.append(Token(kind, m.group(), m.start(), m.end()))
        pos = m.end()
    return tokens


def _string_value(t: Token) -> str:
    """A string literal's text, trimmed and lower case (for comparing it with special values)."""
    return t.text.lstrip("rR")[1:-1].strip().lower()


def quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _matching(tokens: Sequence[Token], i: int) -> int:
    """Index of the parenthesis closing the one at i."""
    depth = 0
    for j in range(i, len(tokens)):
        if tokens[j].text == "(":
            depth += 1
        elif tokens[j].text == ")":
            depth -= 1
            if depth == 0:
                return j
    raise UserError("the view's SQL has an unbalanced parenthesis")


def _balanced(tokens: Sequence[Token]) -> bool:
    depth = 0
    for t in tokens:
        depth += (t.text == "(") - (t.text == ")")
        if depth < 0:
            return False
    return depth == 0


def _check_parentheses(sql: str, tokens: Sequence[Token]) -> None:
    """Refuses a query whose parentheses do not balance: targets put the query
    inside their own (`SELECT * FROM (query)`), which a `)` of it must not close."""
    depth = 0
    for t in tokens:
        if t.kind == "op" and t.text == "(":
            depth += 1
        elif t.kind == "op" and t.text == ")":
            depth -= 1
            if depth < 0:
                raise UserError(f"the view's SQL has a ) that closes no parenthesis of its own "
                                f"(at: {' '.join(sql[t.start:t.start + 40].split())})")
    if depth:
        raise UserError("the view's SQL has an unbalanced parenthesis")


# Spark SQL functions that call any Java method (the consumer would run them at every refresh).
SPARK_REFLECTION = {"reflect", "java_method", "try_reflect"}


# words after which a query's FROM list has ended (a comma is no longer between tables)
_FROM_LIST_ENDS = {"on", "using", "where", "group", "having", "window", "qualify", "order", "sort", "cluster",
                   "distribute", "limit", "union", "intersect", "except", "minus", "lateral", "pivot", "unpivot"}


def _refuse_spark_escapes(sql: str, tokens: Sequence[Token]) -> None:
    """Refuses, in Spark SQL, what would let a view do more than read the warehouse's
    tables: a script (SELECT TRANSFORM/MAP/REDUCE ... USING 'command'), a Java method
    (reflect, java_method), a name given at run time (IDENTIFIER(...)), and a qualified
    name in a FROM clause (`csv.`/path``, `parquet.dir`: Spark reads files by path, or
    another catalog's table). replicator.views.spark_sql.check_query checks Spark's own parse of the
    query for the same (this is the first look, on the tokens)."""
    def at(t: Token) -> str:
        return " ".join(sql[t.start:t.start + 40].split())

    query_level = [True]     # per open parenthesis: whether a query (SELECT ...) starts in it
    in_from = [False]        # per open parenthesis: whether its query's FROM list is being read
    for i, t in enumerate(tokens):
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        qualified_next = nxt is not None and nxt.ident is not None and i + 2 < len(tokens) and tokens[i + 2].text == "."
        if t.text == "(":
            query_level.append(nxt is not None and nxt.lower in ("select", "with", "values", "from"))
            in_from.append(False)
        elif t.text == ")":
            if len(query_level) > 1:
                query_level.pop()
                in_from.pop()
        elif t.lower == "using" and nxt is not None and nxt.kind == "string":
            raise UserError(f"a view cannot run a program (SELECT TRANSFORM/MAP/REDUCE ... USING "
                            f"'command'): refused at {at(t)}")
        elif t.ident is not None and t.ident.lower() in SPARK_REFLECTION and nxt is not None and nxt.text == "(":
            raise UserError(f"a view cannot call Java methods ({t.ident.lower()}): refused at {at(t)}")
        elif t.lower == "identifier" and nxt is not None and nxt.text == "(":
            raise UserError(f"a view names its tables and functions as written, not with IDENTIFIER(...): "
                            f"refused at {at(t)}")
        elif t.lower in ("from", "join") and query_level[-1] and (i == 0 or tokens[i - 1].lower != "distinct"):
            in_from[-1] = True
        elif t.lower in _FROM_LIST_ENDS:
            in_from[-1] = False
        if in_from[-1] and (t.lower in ("from", "join") or t.text == ",") and qualified_next:
            assert nxt is not None
            raise UserError(f"a view reads the warehouse's tables by their names (orders, s__t), not a path or "
                            f"another catalog's table: refused at {at(nxt)}")


def _after_ctes(tokens: Sequence[Token]) -> Token:
    """The first token after the common table expressions of a query starting with
    WITH: `WITH [RECURSIVE] name [(columns)] [AS] [[NOT] MATERIALIZED] (query), ...`
    (AS is optional in Spark SQL)."""
    def at(i: int) -> Token:
        if i >= len(tokens):
            raise UserError("the view's SQL ends inside its WITH clause")
        return tokens[i]

    i = 2 if at(1).lower == "recursive" else 1
    while True:
        if at(i).ident is None:
            raise UserError(f"cannot read the view's WITH clause at {at(i).text!r}")
        i += 1
        if at(i).text == "(":
            after = at(_matching(tokens, i) + 1)
            if after.lower in ("as", "not", "materialized") or after.text == "(":
                i = _matching(tokens, i) + 1    # the column list
        if at(i).lower == "as":
            i += 1
        if at(i).lower == "not":
            i += 1
        if at(i).lower == "materialized":
            i += 1
        if at(i).text != "(":
            raise UserError(f"cannot read the view's WITH clause at {at(i).text!r}")
        i = _matching(tokens, i) + 1
        if at(i).text != ",":
            return tokens[i]
        i += 1


def _refuse_what_is_not_a_query(sql: str, tokens: Sequence[Token], dialect: str) -> None:
    """Refuses SQL that would do more than one query if the target were given it."""
    if any(t.text == ";" for t in tokens):
        raise UserError("a view is defined by one SELECT statement, not several")
    _check_parentheses(sql, tokens)
    param = next((t for t in tokens if t.kind == "param"), None)
    if param is not None:
        raise UserError(f"a view's SQL cannot have parameters ({param.text})")
    if dialect == "spark":
        _refuse_spark_escapes(sql, tokens)
    first = tokens[0].lower
    if first == "with":
        # WITH ... INSERT/UPDATE/DELETE is a statement of both dialects (Spark runs it as soon as
        # it is given): only a query may follow the common table expressions.
        main = _after_ctes(tokens)
        if main.lower not in ("select", "values"):
            raise UserError(f"a view is defined by a SELECT, not WITH ... {main.text.upper()}")
    elif first not in ("select", "values"):
        raise UserError(f"a view is defined by a SELECT, not {tokens[0].text.upper()}")


def _lexical_reasons(sql: str, tokens: Sequence[Token], dialect: str) -> list[tuple[int, str, str]]:
    """The reasons read on the tokens, as (position, code, fragment): WITH, and the calls of
    time and chance (by their names as written): a function of them, the current time with
    or without parentheses, a time function without its time value (or, in SQLite, with
    'now'), and in Spark SQL the strings that stand for now."""
    found = [(tokens[0].start, "CTE", sql[tokens[0].start:tokens[2].end])] if tokens[0].lower == "with" else []
    for i, t in enumerate(tokens):
        called = i + 1 < len(tokens) and tokens[i + 1].text == "("
        close = _matching(tokens, i + 1) if called else i
        if t.lower in _NOW_WORDS or (t.kind == "word" and called and (
                t.lower in _NONDETERMINISTIC or _means_now(t.lower, tokens[i + 2:close], dialect))):
            found.append((t.start, "NONDETERMINISTIC", sql[t.start:tokens[close].end]))
        elif t.kind == "string" and dialect == "spark" and _string_value(t) in _SPARK_NOW_STRINGS:
            found.append((t.start, "NONDETERMINISTIC", t.text))
    return found


def _means_now(function: str, args: Sequence[Token], dialect: str) -> bool:
    """A call of a function of a time value that leaves it out, or (SQLite) gives it as 'now'."""
    needed = _TIME_VALUE_ARGUMENTS.get(function)
    if needed is None:
        return False
    return _count_arguments(args) < needed or (dialect == "sqlite" and any(
        a.kind == "string" and _string_value(a) == "now" for a in args))


def _count_arguments(args: Sequence[Token]) -> int:
    """How many arguments the tokens between a call's parentheses are."""
    depth, count = 0, int(bool(args))
    for t in args:
        depth += (t.text == "(") - (t.text == ")")
        count += depth == 0 and t.text == ","
    return count


def definition(sql: str, dialect: str = "sqlite") -> str:
    """A view's query as it is stored and run: up to its last token. Trailing semicolons
    and comments go: a target wraps the query in other SQL (`SELECT * FROM (query)`),
    which a `;` breaks and a trailing `-- comment` swallows.

    Spark's is rebuilt from the tokens, without its comments (and hints): Spark is given
    only what the analysis read, so that no reading of a comment other than this
    tokenizer's can turn text it skipped into a statement. The spacing between tokens
    stays (a comment becomes a space, other spaces ASCII ones)."""
    tokens = tokenize(sql, dialect)
    while tokens and tokens[-1].text == ";":
        tokens.pop()
    if not tokens:
        raise UserError("the view's SQL is empty")
    if dialect != "spark":
        return sql[:tokens[-1].end]
    out = [tokens[0].text]
    for before, token in itertools.pairwise(tokens):
        gap = sql[before.end:token.start]
        if gap:
            spaces = "".join(ch if ch in " \t\n" else " " for ch in gap)
            out.append(spaces if gap.isspace() else ("\n" if "\n" in spaces else " "))
        out.append(token.text)
    return "".join(out)


# sqlglot's tree ----------------------------------------------------------------------

_SPAN = "replicator_span"   # a node's place in the query: (start, end) offsets of its text

# sqlglot logs as warnings some of what it reads leniently (a JSON path it does not parse, as
# SQLite's '$[#-1]'): the analysis says what it does not read in its reasons, and the output
# of a view command or of the consumer is replicator's own.
logging.getLogger("sqlglot").setLevel(logging.ERROR)


class _Unread(Exception):
    """sqlglot does not read the query (or reads it otherwise than the target): where, and why."""

    def __init__(self, fragment: str, detail: str) -> None:
        super().__init__(detail)
        self.fragment = fragment
        self.detail = detail


def _mark(node: exp.Expr, tokens: Sequence[Any], first: int, stop: int) -> None:
    """Records that node's text spans tokens[first:stop], widening what it spans already,
    or, on a node met for the first time, what its children span (a method given a node it
    adds to, like _parse_alias, starts after it)."""
    span = node.meta_get(_SPAN)
    start, end = (tokens[first].start, tokens[stop - 1].end + 1) if first < stop else (None, None)
    if span is not None:
        if start is not None and (start < span[0] or end > span[1]):
            node.meta[_SPAN] = (min(start, span[0]), max(end, span[1]))
        return
    spans = [s for s in (c.meta_get(_SPAN) for c in node.iter_expressions()) if s]
    if start is not None:
        spans.append((start, end))
    if spans:
        node.meta[_SPAN] = (min(s[0] for s in spans), max(s[1] for s in spans))


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


def _parse(sql: str, tokens: Sequence[Token], dialect: str) -> exp.Expr:
    """sqlglot's tree of the query, read with its comments blanked out (the tokens say where
    they are: sqlglot's rules for them are not the target's). Raises _Unread when sqlglot
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
    except _Unread:
        raise
    except Exception as exc:   # its ParseError, TokenError, and on some input others (an IndexError for Spark's
        # SELECT MAP(...) USING): sqlglot does not read this query
        error = (getattr(exc, "errors", None) or [{}])[0]
        where = " ".join(((error.get("start_context") or "") + (error.get("highlight") or "")).split())
        description = error.get("description") or (str(exc).splitlines() or [type(exc).__name__])[0]
        raise _Unread(where[-40:], f"sqlglot: {description}") from None
    tree = trees[0] if len(trees) == 1 else None
    if not isinstance(tree, exp.Expr):
        raise _Unread("", "sqlglot reads no single statement")
    return tree


def _check_tokens(sql: str, tokens: Sequence[Token], theirs: Sequence[Any]) -> None:
    """Raises _Unread unless sqlglot's tokens are the target's: each one of them or a run of
    them (a keyword of several words), or a piece of a string, number or operator of the
    target's (Spark's 'it''s' is two adjacent strings to sqlglot, SQLite's .5 a dot and 5,
    << two <), names and strings where the target has them; none of the target's left out
    (taken for a comment)."""
    def refuse(start: int, why: str) -> _Unread:
        return _Unread(" ".join(sql[start:start + 40].split()), why)

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


# the analysis ------------------------------------------------------------------------

@dataclass
class Reason:
    code: str
    fragment: str
    detail: str = ""

    @property
    def message(self) -> str:
        text = REASONS.get(self.code, self.code)
        return f"{text}{': ' + self.detail if self.detail else ''}"

    def as_dict(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message, "fragment": self.fragment}


@dataclass
class TableInfo:
    """What the analysis needs of a table in the target."""
    name: str
    columns: list[tuple[str, str]]   # (name, declared type), in table order
    key: list[str]                   # primary key columns, in key order
    replicated: bool

    def has(self, column: str) -> str | None:
        low = column.lower()
        return next((c for c, _ in self.columns if c.lower() == low), None)


@dataclass
class Occurrence:
    """A table in the view's FROM clause."""
    table: TableInfo
    alias: str           # the name its columns are qualified with in the query
    text: str            # as written, for messages


@dataclass
class Analysis:
    sql: str
    kind: str = "rows"                       # rows | aggregate | distinct
    reasons: list[Reason] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    occurrences: list[Occurrence] = field(default_factory=list)
    conditions: list[str] = field(default_factory=list)   # inner join conditions (ON), as SQL
    where: str | None = None
    select: str = ""                         # the select list as SQL, `*` expanded
    items: list[str] = field(default_factory=list)        # select expressions, aliases removed
    # per item, the aggregate call it is: (function, argument), the argument "*", a column
    # (occurrence, column) or None (another expression); ("", None) when it has aggregates in
    # a larger expression (or with FILTER); None when it has none
    item_calls: list[tuple[str, tuple[int, str] | str | None] | None] = field(default_factory=list)
    distinct: bool = False
    group_by: list[str] = field(default_factory=list)
    having: str | None = None
    from_sql: str = ""                       # the FROM clause as written (without FROM)
    keys: list[str] = field(default_factory=list)         # key expressions (aggregate, distinct)
    key_items: list[int | None] = field(default_factory=list)  # per key, the select item that is it
    item_columns: list[tuple[int, str] | None] = field(default_factory=list)  # per item, the column it is
    key_columns: list[tuple[int, str] | None] = field(default_factory=list)  # plain column keys
    equi: list[tuple[tuple[int, str], tuple[int, str]]] = field(default_factory=list)
    strict_equi: list[tuple[tuple[int, str], tuple[int, str]]] = field(default_factory=list)  # `=`: no NULLs
    columns_read: list[set[str]] = field(default_factory=list)               # per occurrence
    columns_filtered: list[set[str]] = field(default_factory=list)           # per occurrence: by ON, WHERE

    @property
    def incremental(self) -> bool:
        return not self.reasons

    def refuse(self, code: str, fragment: str, detail: str = "") -> None:
        if not any(r.code == code and r.fragment == fragment for r in self.reasons):
            self.reasons.append(Reason(code, fragment.strip()[:200], detail))

    def describe_keys(self) -> str:
        if self.kind == "rows":
            return ", ".join(f"{o.alias}({', '.join(o.table.key)})" for o in self.occurrences)
        return ", ".join(self.keys)


@dataclass
class _Item:
    """A select item: its expression (None for a column `*` stands for), as written."""
    node: exp.Expr | None
    text: str
    alias: str | None = None
    column: tuple[int, str] | None = None   # the column `*` stands for


# The parts of a query, a join and a table the analysis reads; any other (QUALIFY, LATERAL
# VIEW, TABLESAMPLE, a column list of an alias ...) could change its rows: UNREAD.
_SELECT_PARTS = {"expressions", "distinct", "from_", "joins", "where", "group", "having", "order", "limit", "offset",
                 "windows", "with_"}
_JOIN_PARTS = {"this", "on", "using", "side", "kind", "method"}
_TABLE_PARTS = {"this", "db", "catalog", "alias", "indexed"}


class _Reader:
    """Reads the analysis from sqlglot's tree of the query. The text of a node is the query's
    own (the span its parse recorded), and the target's tokens answer what the tree leaves
    out: a function's name and arguments as written, and where parentheses are."""

    def __init__(self, sql: str, tokens: Sequence[Token], catalog: Callable[[str], TableInfo | None],
                 quote_identifier: Callable[[str], str], dialect: str) -> None:
        self.sql = sql
        self.tokens = tokens
        self.catalog = catalog
        self.quote = quote_identifier
        self.dialect = dialect
        self.a = Analysis(sql=sql)
        self.starting = {t.start: i for i, t in enumerate(tokens)}   # token index by where it starts
        self.ending = {t.end: i for i, t in enumerate(tokens)}
        self.filters: list[exp.Expr] = []   # WHERE and ON conditions

    def span(self, node: exp.Expr) -> tuple[int, int]:
        span = node.meta_get(_SPAN)
        if span is None and isinstance(node, exp.Identifier) and node.meta_get("start") is not None:
            span = (node.meta_get("start"), node.meta_get("end") + 1)
        if span is None:
            raise _Unread("", f"the parse does not say where its {node.key} is")
        return (int(span[0]), int(span[1]))

    def text(self, node: exp.Expr) -> str:
        """The node's text, which the generated statements copy: whole tokens, parentheses
        balanced (never a cut string or an open parenthesis: else _Unread)."""
        start, end = self.span(node)
        i, j = self.starting.get(start), self.ending.get(end)
        if i is None or j is None or not _balanced(self.tokens[i:j + 1]):
            raise _Unread(self.sql[start:end][:40], "the parse places a node across tokens or parentheses")
        return self.sql[start:end]

    def known(self, node: exp.Expr, parts: set[str]) -> None:
        """Raises _Unread when node has a part (an argument in sqlglot's tree) not in parts."""
        for key, value in node.args.items():
            if value and key not in parts:
                first = value[0] if isinstance(value, list) else value
                raise _Unread(self.text(first) if isinstance(first, exp.Expr) else key,
                              f"a part of {node.key} it does not read ({key})")

    def run(self, tree: exp.Expr) -> Analysis:
        if self.dialect == "spark":
            for table in tree.find_all(exp.Table):
                if table.args.get("db") or table.args.get("catalog"):
                    raise UserError(f"a view reads the warehouse's tables by their names (orders, s__t), not a "
                                    f"path or another catalog's table: refused at {self.name_text(table)}")
        found = _lexical_reasons(self.sql, self.tokens, self.dialect)
        for node in tree.walk():
            if isinstance(node, (exp.Select, exp.SetOperation, exp.Values)):
                around = self.parenthesized(node)
                if around is not None:
                    found.append((around[0], "SUBQUERY", self.sql[around[0]:around[1]]))
            elif isinstance(node, exp.In) and node.args.get("field") is not None:   # SQLite's `x IN table`
                found.append((self.span(node)[0], "SUBQUERY", self.text(node)))
            elif isinstance(node, exp.Window) and node.args.get("over"):
                found.append((self.over(node), "WINDOW_FUNCTION", self.text(node)))
        for _, code, fragment in sorted(found, key=lambda f: f[0]):
            self.a.refuse(code, fragment)
        if self.tokens[0].lower == "with":
            return self.a
        if isinstance(tree, exp.Values):
            self.a.refuse("NO_TABLE", self.tokens[0].text)
        elif isinstance(tree, exp.SetOperation):
            while isinstance(tree.this, exp.SetOperation):
                tree = tree.this
            self.a.refuse("SET_OPERATION", tree.key.upper() + ("" if tree.args.get("distinct") else " ALL"))
        elif isinstance(tree, exp.Select):
            self.clauses(tree)
        else:
            raise _Unread(self.sql[:40], f"sqlglot reads a {tree.key}")
        return self.a

    def parenthesized(self, node: exp.Expr) -> tuple[int, int] | None:
        """The text of a query with the parentheses around it (a subquery), when it has them."""
        start, end = self.span(node)
        i, j = self.starting.get(start), self.ending.get(end)
        if i is None or j is None:
            return None
        tokens = self.tokens
        if tokens[i].text == "(" and _matching(tokens, i) == j:   # its span has them
            return start, end
        if i > 0 and j + 1 < len(tokens) and tokens[i - 1].text == "(" and _matching(tokens, i - 1) == j + 1:
            return tokens[i - 1].start, tokens[j + 1].end
        return None

    def token_at(self, start: int) -> int:
        """The index of the token that starts there (a node's text starts with a token)."""
        if start not in self.starting:
            raise _Unread(self.sql[start:start + 40], "a node's text does not start with a token")
        return self.starting[start]

    def over(self, window: exp.Expr) -> int:
        """Where a window's OVER is."""
        start, end = self.span(window)
        depth = 0
        for t in self.tokens[self.token_at(start):]:
            if t.start >= end:
                break
            depth += (t.text == "(") - (t.text == ")")
            if depth == 0 and t.lower == "over":
                return t.start
        return start

    def call(self, node: exp.Expr) -> tuple[str, int] | None:
        """The name and number of arguments of a function call, as written: the node's text is
        `name(...)`."""
        if not isinstance(node, exp.Func):
            return None
        span = node.meta_get(_SPAN)
        if span is None:
            if node.meta_get("start") is not None:   # written, not made by sqlglot: it must have its text
                raise _Unread("", f"the parse does not say where its {node.key} call is")
            return None
        i, j = self.starting.get(span[0]), self.ending.get(span[1])
        tokens = self.tokens
        if i is None or j is None or tokens[i].ident is None or i + 1 >= j or tokens[i + 1].text != "(" \
                or _matching(tokens, i + 1) != j:
            return None
        return (tokens[i].ident or "").lower(), _count_arguments(tokens[i + 2:j])

    def aggregate(self, node: exp.Expr) -> str | None:
        """The name of the aggregate function node calls, if it is one (min and max of one
        argument: of two or more they are scalar functions)."""
        call = self.call(node)
        if call is None or call[0] not in _AGGREGATES or (call[0] in ("min", "max") and call[1] != 1):
            return None
        return call[0]

    def aggregate_calls(self, node: exp.Expr) -> list[tuple[str, str]]:
        """The aggregate calls in node (not windows): their names and texts, with FILTER."""
        calls = []
        for n in node.walk():
            name = self.aggregate(n)
            outer = n.parent if isinstance(n.parent, exp.Filter) else n
            if name is not None and not isinstance(outer.parent, exp.Window):
                calls.append((self.span(outer)[0], name, self.text(outer)))
        return [(name, text) for _, name, text in sorted(calls)]

    def columns(self, node: exp.Expr, *, outside_aggregates: bool = False) -> list[exp.Column]:
        """The column references in node (outside_aggregates: not in an aggregate's arguments
        or FILTER)."""
        def aggregated(n: exp.Expr) -> bool:
            return outside_aggregates and (self.aggregate(n) is not None
                                           or (isinstance(n, exp.Filter) and self.aggregate(n.this) is not None))

        return [n for n in node.walk(bfs=False, prune=aggregated)
                if isinstance(n, exp.Column) and not isinstance(n.this, exp.Star)]

    def resolve(self, column: exp.Column) -> tuple[int, str] | None:
        """The (occurrence, column) a reference names, when it is one of the FROM tables'."""
        occs = self.a.occurrences
        name = column.name
        if column.table:
            qualifier = column.table.lower()
            for n, o in enumerate(occs):
                if o.alias.lower() == qualifier:
                    real = o.table.has(name)
                    return (n, real) if real else None
            return None
        found = [(n, real) for n, o in enumerate(occs) if (real := o.table.has(name))]
        return found[0] if len(found) == 1 else None

    def plain(self, node: exp.Expr) -> tuple[int, str] | None:
        """(occurrence, column) when the expression is just a column reference."""
        if isinstance(node, exp.Column) and not isinstance(node.this, exp.Star):
            return self.resolve(node)
        return None

    @staticmethod
    def normal(node: exp.Expr) -> exp.Expr:
        """The expression with its names in lower case and unquoted, for comparing expressions."""
        copy = node.copy()
        for identifier in copy.find_all(exp.Identifier):
            identifier.set("this", identifier.name.lower())
            identifier.set("quoted", False)
        return copy

    def name_text(self, table: exp.Table) -> str:
        parts = [p for p in (table.args.get("catalog"), table.args.get("db"), table.this) if p is not None]
        return self.sql[self.span(parts[0])[0]:self.span(parts[-1])[1]]

    # clauses -----------------------------------------------------------------------

    def clauses(self, select: exp.Select) -> None:
        a = self.a
        self.known(select, _SELECT_PARTS)
        ends = [n for n in (select.args.get("limit"), select.args.get("offset")) if n is not None]
        if ends:
            a.refuse("LIMIT", self.sql[min(self.span(n)[0] for n in ends):])
        windows = select.args.get("windows")
        if windows:
            a.refuse("WINDOW_FUNCTION", "WINDOW " + self.sql[self.span(windows[0])[0]:self.span(windows[-1])[1]])
        if select.args.get("order"):
            a.notes.append("ORDER BY is ignored: a view's rows have no order")
        distinct = select.args.get("distinct")
        if distinct is not None:
            self.known(distinct, set())   # (DISTINCT ON)
            a.distinct = True
        if not select.expressions:
            raise UserError("the view's SELECT has no columns")
        source = select.args.get("from_")
        if source is None:
            a.refuse("NO_TABLE", self.sql)
            return
        self.from_(source.this, select.args.get("joins") or [])
        where = select.args.get("where")
        if where is not None:
            a.where = self.text(where.this)
            self.filters.append(where.this)
        having = select.args.get("having")
        a.having = self.text(having.this) if having is not None else None
        self.select(select.expressions, select.args.get("group"), having.this if having is not None else None)
        if where is not None:
            self.equalities(where.this)
        self.joins_connected()

    # FROM ----------------------------------------------------------------------------

    def from_(self, first: exp.Expr, joins: list[exp.Join]) -> None:
        a = self.a
        a.from_sql = self.sql[self.span(first)[0]:self.span(joins[-1] if joins else first)[1]]
        for join, source in [(None, first), *((j, j.this) for j in joins)]:
            first_token = self.token_at(self.span(source)[0])
            if join is not None:
                self.known(join, _JOIN_PARTS)
                words = self.tokens[self.token_at(self.span(join)[0]):first_token]
                op = self.sql[words[0].start:words[-1].end].upper() if words else ""
                at = f"{op} {self.tokens[first_token].text}"
                if join.method not in ("", "NATURAL") or join.kind not in ("", "INNER", "CROSS", "OUTER", "SEMI",
                                                                           "ANTI"):
                    raise _Unread(op, "a join it does not read")
                if join.side or join.kind in ("OUTER", "SEMI", "ANTI"):
                    a.refuse("OUTER_JOIN", at)
                if join.method == "NATURAL":
                    a.refuse("JOIN_USING", at)
            if isinstance(source, exp.Subquery):
                if all(r.code != "SUBQUERY" for r in a.reasons):
                    a.refuse("SUBQUERY", self.text(source))
            elif isinstance(source, exp.Table) and isinstance(source.this, exp.Identifier):
                self.known(source, _TABLE_PARTS)
                alias = source.args.get("alias")
                if alias is not None:
                    self.known(alias, {"this"})   # (names for its columns)
                schema = ".".join(p.name for p in (source.args.get("catalog"), source.args.get("db")) if p)
                occ = self.occurrence(source.name, schema or None, self.name_text(source))
                if occ is not None:
                    occ.alias = source.alias or occ.alias
                    a.occurrences.append(occ)
            else:   # a table-valued function, VALUES ...
                a.refuse("TABLE_FUNCTION", self.text(source.this if isinstance(source, exp.Table) else source))
            if join is not None and join.args.get("on") is not None:
                a.conditions.append(self.text(join.args["on"]))
                self.filters.append(join.args["on"])
                self.equalities(join.args["on"])
            elif join is not None and join.args.get("using"):
                a.refuse("JOIN_USING", f"USING ({', '.join(self.text(u) for u in join.args['using'])})")
        if len(a.occurrences) > MAX_JOIN_TABLES:
            a.refuse("TOO_MANY_TABLES", a.from_sql)

    def occurrence(self, name: str, schema: str | None, text: str) -> Occurrence | None:
        if schema is not None and schema.lower() not in ("main",):
            self.a.refuse("NOT_REPLICATED", text, "only tables of the replica's main database are followed")
            return None
        info = self.catalog(name)
        if info is None:
            raise UserError(f"the view reads {text}, which is not a table of the target")
        if not info.replicated:
            self.a.refuse("NOT_REPLICATED", text)
        elif not info.key:
            self.a.refuse("NOT_REPLICATED", text, "it has no primary key")
        return Occurrence(table=info, alias=name, text=text)

    def equalities(self, condition: exp.Expr) -> None:
        """Records conjuncts `x = y` / `x IS y` (null-safe) between columns of two occurrences."""
        def conjuncts(node: exp.Expr) -> Iterator[exp.Expr]:
            if isinstance(node, exp.And):
                yield from conjuncts(node.this)
                yield from conjuncts(node.expression)
            else:
                yield node

        for conjunct in conjuncts(condition):
            while isinstance(conjunct, exp.Paren):
                conjunct = conjunct.this
            if isinstance(conjunct, (exp.EQ, exp.NullSafeEQ)):
                left, right = self.plain(conjunct.this), self.plain(conjunct.expression)
                if left and right and left[0] != right[0]:
                    self.a.equi.append((left, right))
                    if isinstance(conjunct, exp.EQ):
                        self.a.strict_equi.append((left, right))

    def joins_connected(self) -> None:
        occs = self.a.occurrences
        if len(occs) < 2 or len(occs) > MAX_JOIN_TABLES:
            return
        reached = {0}
        changed = True
        while changed:
            changed = False
            for (a, _), (b, _) in self.a.equi:
                if (a in reached) != (b in reached):
                    reached |= {a, b}
                    changed = True
        for n, o in enumerate(occs):
            if n not in reached:
                self.a.refuse("NO_EQUI_JOIN", o.text + (f" AS {o.alias}" if o.alias != o.table.name else ""))

    # SELECT, GROUP BY, HAVING -----------------------------------------------------------

    def select(self, nodes: list[exp.Expr], group: exp.Group | None, having: exp.Expr | None) -> None:
        a = self.a
        items: list[_Item] = []
        expanded: list[str] = []
        for node in nodes:
            if isinstance(node, exp.Star):
                self.known(node, set())   # (* EXCEPT, REPLACE ...)
                expanded.append(", ".join(f"{self.quote(o.alias)}.*" for o in a.occurrences) if a.occurrences
                                else "*")
                items.extend(_Item(None, f"{self.quote(o.alias)}.{self.quote(c)}", column=(n, c))
                             for n, o in enumerate(a.occurrences) for c, _ in o.table.columns)
            elif isinstance(node, exp.Column) and isinstance(node.this, exp.Star):
                qualifier = node.table.lower()
                expanded.append(self.text(node))
                items.extend(_Item(None, f"{self.quote(o.alias)}.{self.quote(c)}", column=(n, c))
                             for n, o in enumerate(a.occurrences) if o.alias.lower() == qualifier
                             for c, _ in o.table.columns)
            elif isinstance(node, exp.Alias):
                expanded.append(self.text(node))
                items.append(_Item(node.this, self.text(node.this), node.alias))
            elif isinstance(node, exp.Aliases):
                raise _Unread(self.text(node), "an item of several names")
            else:
                expanded.append(self.text(node))
                items.append(_Item(node, self.text(node)))
        a.select = ", ".join(expanded)
        a.items = [item.text for item in items]
        a.item_calls = [self.item_call(item) for item in items]
        a.item_columns = [self.key_column(item) for item in items]
        calls = [c for item in items if item.node is not None for c in self.aggregate_calls(item.node)]
        calls += self.aggregate_calls(having) if having is not None else []
        for name, call in calls:
            if name in _ORDER_DEPENDENT:
                a.refuse("ORDER_DEPENDENT", call)
        read = [item.node for item in items if item.node is not None]
        if group is None and having is None and not calls:
            if a.distinct:
                a.kind = "distinct"
                a.keys = list(a.items)
                a.key_items = list(range(len(items)))
                a.key_columns = [self.key_column(item) for item in items]
                self.check_collation(items)
            else:
                a.kind = "rows"
            self.note_columns(read)
            return
        a.kind = "aggregate"
        if group is None:
            a.refuse("NO_KEY", "(no GROUP BY)" if calls else "HAVING " + (a.having or ""))
        if a.distinct:
            a.refuse("DISTINCT_AGGREGATE", "SELECT DISTINCT")
        # GROUP BY terms: ordinals and result aliases stand for the select expressions.
        aliases = {item.alias.lower(): item for item in items if item.alias}
        keys: list[_Item] = []
        if group is not None:
            self.known(group, {"expressions"})   # (GROUP BY ALL, ROLLUP, CUBE, GROUPING SETS)
            read.append(group)
        for term in group.expressions if group is not None else []:
            if isinstance(term, exp.Literal) and not term.is_string and term.name.isdigit():
                k = int(term.name)
                if not 1 <= k <= len(items):
                    raise UserError(f"GROUP BY {k}: the select list has {len(items)} columns")
                keys.append(items[k - 1])
            elif (isinstance(term, exp.Column) and not term.table and term.name.lower() in aliases
                  and not any(o.table.has(term.name) for o in a.occurrences)):
                keys.append(aliases[term.name.lower()])
            elif isinstance(term, (exp.Rollup, exp.Cube, exp.GroupingSets)):
                raise _Unread(self.text(term), "grouping sets")
            else:
                keys.append(_Item(term, self.text(term)))
        a.group_by = [k.text for k in keys]
        a.keys = list(a.group_by)
        a.key_columns = [self.key_column(k) for k in keys]
        a.key_items = [self.item_of(k, items) for k in keys]
        self.check_collation(keys)
        # Every column outside an aggregate must be a GROUP BY column (or the
        # whole expression a GROUP BY expression): else SQLite picks some row's value.
        group_exprs = [self.normal(k.node) for k in keys if k.node is not None]
        group_cols = {c for c in a.key_columns if c is not None}

        def bare(node: exp.Expr, *, or_key: bool) -> bool:
            """Whether node reads a column outside aggregates that is not a GROUP BY column
            (or_key: nor a GROUP BY expression); a result alias is not a column."""
            for column in self.columns(node, outside_aggregates=True):
                ref = self.resolve(column)
                if ref is None and not column.table and column.name.lower() in aliases:
                    continue
                if ref not in group_cols and not (or_key and self.normal(column) in group_exprs):
                    return True
            return False

        for item in items:
            if item.node is None:
                if item.column not in group_cols:
                    a.refuse("BARE_COLUMN", item.text)
            elif self.normal(item.node) not in group_exprs and bare(item.node, or_key=False):
                a.refuse("BARE_COLUMN", item.text)
        if having is not None:
            read.append(having)
            if bare(having, or_key=True):
                a.refuse("BARE_COLUMN", "HAVING " + (a.having or ""))
        self.note_columns(read)

    def key_column(self, item: _Item) -> tuple[int, str] | None:
        return item.column if item.node is None else self.plain(item.node)

    def item_of(self, key: _Item, items: list[_Item]) -> int | None:
        """The select item a GROUP BY term is: itself (an ordinal, an alias), the same column,
        or the same expression; None when the select list does not hold it."""
        column = self.key_column(key)
        for i, item in enumerate(items):
            if item is key or (column is not None and self.key_column(item) == column):
                return i
            if key.node is not None and item.node is not None and self.normal(item.node) == self.normal(key.node):
                return i
        return None

    def item_call(self, item: _Item) -> tuple[str, tuple[int, str] | str | None] | None:
        """The aggregate call the item is (see Analysis.item_calls)."""
        node = item.node
        calls = [n for n in node.walk() if self.aggregate(n) is not None] if node is not None else []
        if node is None or not calls:
            return None
        name = self.aggregate(node)
        if len(calls) != 1 or name is None:
            return "", None
        start, end = self.span(node)
        args = self.tokens[self.token_at(start) + 2:self.ending[end]]
        if [t.text for t in args] == ["*"]:
            return name, "*"
        span = (args[0].start, args[-1].end) if args else None
        column = next((c for c in node.find_all(exp.Column) if c.meta_get(_SPAN) == span), None)
        return name, self.plain(column) if column is not None else None

    def note_columns(self, read: list[exp.Expr]) -> None:
        a = self.a
        a.columns_read = [set() for _ in a.occurrences]
        a.columns_filtered = [set() for _ in a.occurrences]
        for nodes, filtering in ((read, False), (self.filters, True)):
            for node in nodes:
                for column in self.columns(node):
                    ref = self.resolve(column)
                    if ref is not None:
                        a.columns_read[ref[0]].add(ref[1])
                        if filtering:
                            a.columns_filtered[ref[0]].add(ref[1])

    def check_collation(self, items: list[_Item]) -> None:
        for item in items:
            if item.node is not None and any(c.expression.name.lower() != "binary"
                                             for c in item.node.find_all(exp.Collate)):
                self.a.refuse("COLLATION", item.text)


def analyse(sql: str, catalog: Callable[[str], TableInfo | None],
            quote_identifier: Callable[[str], str] = quote, dialect: str = "sqlite") -> Analysis:
    """Reads a view's defining query, in the target's dialect (sqlite or spark).
    catalog(name) describes a table of the target (None if there is none);
    quote_identifier quotes a name in that dialect (the columns `*` stands for
    are written with it). Raises UserError for SQL that cannot be a view at
    all; shapes that cannot be incremental are in .reasons. The analysis's .sql
    is the query as the target stores and runs it (see definition)."""
    sql = definition(sql, dialect)
    tokens = tokenize(sql, dialect)
    _refuse_what_is_not_a_query(sql, tokens, dialect)
    try:
        return _Reader(sql, tokens, catalog, quote_identifier, dialect).run(_parse(sql, tokens, dialect))
    except _Unread as unread:
        # what the tokens say, then that sqlglot does not read the rest: the view is refreshed in full
        a = Analysis(sql=sql)
        for _, code, fragment in sorted(_lexical_reasons(sql, tokens, dialect), key=lambda f: f[0]):
            a.refuse(code, fragment)
        a.refuse("UNREAD", unread.fragment, unread.detail)
        return a
