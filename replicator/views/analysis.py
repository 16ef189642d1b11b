"""Incremental views: the analysis of a view's defining query.

A view is a SELECT in the target's own SQL (SQLite's, or Spark SQL on a
Spark warehouse) over replicated tables. This module reads the query (a
small purpose-built tokenizer per dialect and a clause splitter, not a full
SQL parser) and decides whether the target can keep it current
incrementally, by recomputing only the keys a batch touched:

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

The analysis only has to be right about the *structure* (which tables, how
they join, what the keys are): expressions are copied verbatim into the
generated statements, which SQLite then checks; a generated statement that
does not prepare demotes the view to a full refresh (reason REWRITE).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from replicator.errors import UserError

MAX_JOIN_TABLES = 3

# Reason codes, with what they mean (`replicator view explain` prints them).
REASONS = {
    "CTE": "WITH (common table expressions) is not maintained incrementally",
    "SET_OPERATION": "UNION, INTERSECT and EXCEPT are not maintained incrementally",
    "SUBQUERY": "subqueries (in FROM, in expressions, EXISTS, IN (SELECT ...)) are not maintained incrementally",
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
# Words that end a table reference in FROM (so they are not taken for its alias).
_FROM_STOP = {"join", "inner", "left", "right", "full", "outer", "cross", "natural", "on", "using", "where",
              "group", "order", "having", "limit", "window", "union", "intersect", "except", "indexed", "not",
              "as", "values"}
# Words of the expression grammar: never column names in the analysis.
_EXPR_WORDS = {"and", "or", "not", "is", "in", "like", "glob", "match", "regexp", "between", "case", "when",
               "then", "else", "end", "cast", "as", "collate", "escape", "exists", "null", "distinct", "from",
               "isnull", "notnull", "filter", "where", "asc", "desc", "over", "all", "raise", "nulls", "first",
               "last", "true", "false", "select", "partition", "by", "order", "rows", "range", "groups",
               "unbounded", "preceding", "following", "current", "row", "exclude", "no", "others", "ties"}
_CLAUSES = ("select", "from", "where", "group", "having", "window", "order", "limit")
_SET_OPERATIONS = {"union", "intersect", "except"}


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


def _norm(tokens: Sequence[Token]) -> str:
    """Token text normalized for comparing expressions (case of words, quoting)."""
    return " ".join((t.ident or "").lower() if t.ident is not None else t.text.lower() for t in tokens)


def matching(tokens: Sequence[Token], i: int) -> int:
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


def _refuse_spark_escapes(sql: str, tokens: Sequence[Token]) -> None:
    """Refuses, in Spark SQL, what would let a view do more than read the warehouse's
    tables: a script (SELECT TRANSFORM/MAP/REDUCE ... USING 'command'), a Java method
    (reflect, java_method), a name given at run time (IDENTIFIER(...)), and a qualified
    name in a FROM clause (`csv.`/path``, `parquet.dir`: Spark reads files by path, or
    another catalog's table). replicator.targets.spark.views checks Spark's own parse of the
    query for the same (this is the first look, on the tokens)."""
    def at(t: Token) -> str:
        return " ".join(sql[t.start:t.start + 40].split())

    query_level = [True]     # per open parenthesis: whether a query (SELECT ...) starts in it
    for i, t in enumerate(tokens):
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        if t.text == "(":
            query_level.append(nxt is not None and nxt.lower in ("select", "with", "values", "from"))
        elif t.text == ")":
            if len(query_level) > 1:
                query_level.pop()
        elif t.lower == "using" and nxt is not None and nxt.kind == "string":
            raise UserError(f"a view cannot run a program (SELECT TRANSFORM/MAP/REDUCE ... USING "
                            f"'command'): refused at {at(t)}")
        elif t.ident is not None and t.ident.lower() in SPARK_REFLECTION and nxt is not None and nxt.text == "(":
            raise UserError(f"a view cannot call Java methods ({t.ident.lower()}): refused at {at(t)}")
        elif t.lower == "identifier" and nxt is not None and nxt.text == "(":
            raise UserError(f"a view names its tables and functions as written, not with IDENTIFIER(...): "
                            f"refused at {at(t)}")
        elif t.lower in ("from", "join") and query_level[-1] and (i == 0 or tokens[i - 1].lower != "distinct") \
                and nxt is not None and nxt.ident is not None and i + 2 < len(tokens) and tokens[i + 2].text == ".":
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
            after = at(matching(tokens, i) + 1)
            if after.lower in ("as", "not", "materialized") or after.text == "(":
                i = matching(tokens, i) + 1    # the column list
        if at(i).lower == "as":
            i += 1
        if at(i).lower == "not":
            i += 1
        if at(i).lower == "materialized":
            i += 1
        if at(i).text != "(":
            raise UserError(f"cannot read the view's WITH clause at {at(i).text!r}")
        i = matching(tokens, i) + 1
        if at(i).text != ",":
            return tokens[i]
        i += 1


def _call_end(tokens: Sequence[Token], i: int) -> int:
    """Index of the last token of the call whose name is tokens[i]: its closing
    parenthesis, or that of the FILTER (WHERE ...) clause that is part of an aggregate."""
    close = matching(tokens, i + 1)
    if close + 2 < len(tokens) and tokens[close + 1].lower == "filter" and tokens[close + 2].text == "(":
        return matching(tokens, close + 2)
    return close


def _split_top(tokens: Sequence[Token], separator: Callable[[Token], bool]) -> list[list[Token]]:
    parts: list[list[Token]] = [[]]
    depth = 0
    for t in tokens:
        if t.text == "(":
            depth += 1
        elif t.text == ")":
            depth -= 1
        if depth == 0 and separator(t):
            parts.append([])
        else:
            parts[-1].append(t)
    return parts


def _split_alias(item: list[Token]) -> tuple[list[Token], str | None]:
    """A select item's expression and its alias (`expr AS name` or `expr name`)."""
    if len(item) >= 3 and item[-2].lower == "as" and item[-1].ident is not None:
        return item[:-2], item[-1].ident
    if len(item) >= 2:
        last, prev = item[-1], item[-2]
        if last.ident is not None and last.lower not in _EXPR_WORDS and prev.lower != "collate":
            if (prev.text == ")" or prev.kind in ("number", "string", "blob", "qident")
                    or (prev.kind == "word" and (prev.lower not in _EXPR_WORDS
                                                or prev.lower in ("end", "null", "true", "false")))):
                return item[:-1], last.ident
    return item, None


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
    distinct: bool = False
    group_by: list[str] = field(default_factory=list)
    having: str | None = None
    from_sql: str = ""                       # the FROM clause as written (without FROM)
    keys: list[str] = field(default_factory=list)         # key expressions (aggregate, distinct)
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


class _Parser:
    def __init__(self, sql: str, catalog: Callable[[str], TableInfo | None],
                 quote_identifier: Callable[[str], str], dialect: str) -> None:
        self.sql = sql
        self.catalog = catalog
        self.quote = quote_identifier
        self.dialect = dialect
        self.a = Analysis(sql=sql)

    def text(self, tokens: Sequence[Token]) -> str:
        return self.sql[tokens[0].start:tokens[-1].end] if tokens else ""

    def run(self) -> Analysis:
        tokens = tokenize(self.sql, self.dialect)
        if any(t.text == ";" for t in tokens):
            raise UserError("a view is defined by one SELECT statement, not several")
        _check_parentheses(self.sql, tokens)
        param = next((t for t in tokens if t.kind == "param"), None)
        if param is not None:
            raise UserError(f"a view's SQL cannot have parameters ({param.text})")
        if self.dialect == "spark":
            _refuse_spark_escapes(self.sql, tokens)
        first = tokens[0].lower
        if first == "with":
            # WITH ... INSERT/UPDATE/DELETE is a statement of both dialects (Spark runs it as soon as
            # it is given): only a query may follow the common table expressions.
            main = _after_ctes(tokens)
            if main.lower not in ("select", "values"):
                raise UserError(f"a view is defined by a SELECT, not WITH ... {main.text.upper()}")
            self.a.refuse("CTE", self.text(tokens[:3]))
        elif first not in ("select", "values"):
            raise UserError(f"a view is defined by a SELECT, not {tokens[0].text.upper()}")
        self._scan_everywhere(tokens)
        if first == "select":
            self._clauses(tokens)
        elif first == "values":
            self.a.refuse("NO_TABLE", self.text(tokens[:1]))
        return self.a

    # checks that apply at any depth ---------------------------------------------------

    def _scan_everywhere(self, tokens: list[Token]) -> None:
        for i, t in enumerate(tokens):
            nxt = tokens[i + 1] if i + 1 < len(tokens) else None
            if t.text == "(" and nxt is not None and nxt.lower in ("select", "with", "values"):
                self.a.refuse("SUBQUERY", self.text(tokens[i:matching(tokens, i) + 1]))
            elif t.lower == "over" and i > 0 and nxt is not None and (nxt.text == "(" or nxt.ident):
                start = i - 1
                if tokens[start].text == ")":
                    depth = 0
                    while start > 0:
                        if tokens[start].text == ")":
                            depth += 1
                        elif tokens[start].text == "(":
                            depth -= 1
                            if depth == 0:
                                break
                        start -= 1
                    start -= 1
                end = matching(tokens, i + 1) if nxt.text == "(" else i + 1
                self.a.refuse("WINDOW_FUNCTION", self.text(tokens[max(start, 0):end + 1]))
            elif t.lower in _NOW_WORDS:
                called = nxt is not None and nxt.text == "("
                self.a.refuse("NONDETERMINISTIC", self.text(tokens[i:matching(tokens, i + 1) + 1] if called
                                                            else [t]))
            elif t.kind == "word" and nxt is not None and nxt.text == "(":
                close = matching(tokens, i + 1)
                if t.lower in _NONDETERMINISTIC or self._means_now(t.lower, tokens[i + 2:close]):
                    self.a.refuse("NONDETERMINISTIC", self.text(tokens[i:close + 1]))
            elif t.kind == "string" and self.dialect == "spark" and _string_value(t) in _SPARK_NOW_STRINGS:
                self.a.refuse("NONDETERMINISTIC", t.text)

    def _means_now(self, function: str, args: list[Token]) -> bool:
        """A call of a function of a time value that leaves it out, or (SQLite) gives it as 'now'."""
        needed = _TIME_VALUE_ARGUMENTS.get(function)
        if needed is None:
            return False
        given = [arg for arg in _split_top(args, lambda t: t.text == ",") if arg]
        return len(given) < needed or (self.dialect == "sqlite" and any(
            a.kind == "string" and _string_value(a) == "now" for a in args))

    # clauses -----------------------------------------------------------------------

    def _clauses(self, tokens: list[Token]) -> None:
        marks: list[tuple[str, int]] = []
        depth = 0
        for i, t in enumerate(tokens):
            if t.text == "(":
                depth += 1
            elif t.text == ")":
                depth -= 1
            if depth:
                continue
            word = t.lower
            if word in _SET_OPERATIONS:
                following = tokens[i + 1].text.upper() if i + 1 < len(tokens) else ""
                self.a.refuse("SET_OPERATION", t.text.upper() + (" ALL" if following == "ALL" else ""))
                return
            if word == "from" and i >= 2 and tokens[i - 1].lower == "distinct" and tokens[i - 2].lower in (
                    "is", "not"):
                continue  # IS [NOT] DISTINCT FROM
            if word in ("group", "order") and i + 1 < len(tokens) and tokens[i + 1].lower == "by":
                marks.append((word, i))
            elif word in _CLAUSES and word not in ("group", "order"):
                if word == "select" and i != 0:
                    continue
                marks.append((word, i))
        parts: dict[str, list[Token]] = {}
        for n, (word, i) in enumerate(marks):
            end = marks[n + 1][1] if n + 1 < len(marks) else len(tokens)
            skip = 2 if word in ("group", "order") else 1
            if word in parts:
                raise UserError(f"the view's SQL has two {word.upper()} clauses")
            parts[word] = tokens[i + skip:end]
        if "limit" in parts:
            self.a.refuse("LIMIT", self.text(tokens[marks[[w for w, _ in marks].index("limit")][1]:]))
        if "window" in parts:
            self.a.refuse("WINDOW_FUNCTION", "WINDOW " + self.text(parts["window"]))
        if "order" in parts:
            self.a.notes.append("ORDER BY is ignored: a view's rows have no order")
        select = parts.get("select", [])
        if select and select[0].lower in ("distinct", "all"):
            self.a.distinct = select[0].lower == "distinct"
            select = select[1:]
        if not select:
            raise UserError("the view's SELECT has no columns")
        if "from" not in parts or not parts["from"]:
            self.a.refuse("NO_TABLE", self.text(tokens))
            return
        self.a.from_sql = self.text(parts["from"])
        self._from(parts["from"])
        where = parts.get("where")
        self.a.where = self.text(where) if where else None
        group = parts.get("group")
        having = parts.get("having")
        self.a.having = self.text(having) if having else None
        self._select(select, group or [], having or [])
        if where:
            self._equalities(where)
        self._joins_connected()

    # FROM ----------------------------------------------------------------------------

    def _from(self, tokens: list[Token]) -> None:
        i = 0
        n = len(tokens)
        first = True
        while i < n:
            # the join operator before a table
            if not first:
                start = i
                words = []
                if tokens[i].text == ",":
                    i += 1
                else:
                    while i < n and tokens[i].lower in ("natural", "left", "right", "full", "outer", "inner",
                                                         "cross", "join"):
                        words.append(tokens[i].lower)
                        i += 1
                        if words[-1] == "join":
                            break
                    if not words or words[-1] != "join":
                        raise UserError(f"cannot read the view's FROM clause at {self.text(tokens[i:i + 3])!r}")
                op = self.text(tokens[start:i])
                if any(w in ("left", "right", "full", "outer") for w in words):
                    self.a.refuse("OUTER_JOIN", op.upper() + " " + self.text(tokens[i:i + 1]))
                if "natural" in words:
                    self.a.refuse("JOIN_USING", op.upper() + " " + self.text(tokens[i:i + 1]))
            first = False
            if i >= n:
                raise UserError("the view's FROM clause ends with a join and no table")
            # the table
            t = tokens[i]
            if t.text == "(":
                close = matching(tokens, i)
                if not self.a.reasons or all(r.code != "SUBQUERY" for r in self.a.reasons):
                    self.a.refuse("SUBQUERY", self.text(tokens[i:close + 1]))
                i = close + 1
                occ = None
            else:
                if t.ident is None:
                    raise UserError(f"cannot read the view's FROM clause at {t.text!r}")
                name_tokens = [t]
                name_start = i
                i += 1
                while i + 1 < n and tokens[i].text == "." and tokens[i + 1].ident is not None:
                    name_tokens.append(tokens[i + 1])
                    i += 2
                if len(name_tokens) > 1 and self.dialect == "spark":
                    raise UserError(f"a view reads the warehouse's tables by their names (orders, s__t), not a "
                                    f"path or another catalog's table: refused at {self.text(name_tokens)}")
                if i < n and tokens[i].text == "(":
                    close = matching(tokens, i)
                    self.a.refuse("TABLE_FUNCTION", self.text(tokens[name_start:close + 1]))
                    i = close + 1
                    occ = None
                else:
                    schema = name_tokens[0].ident if len(name_tokens) == 2 else None
                    name = name_tokens[-1].ident or ""
                    occ = self._occurrence(name, schema, self.text(name_tokens))
            # alias
            alias = None
            if i < n and tokens[i].lower == "as":
                i += 1
                alias = tokens[i].ident if i < n else None
                i += 1
            elif i < n and tokens[i].ident is not None and tokens[i].lower not in _FROM_STOP:
                alias = tokens[i].ident
                i += 1
            if i < n and tokens[i].lower == "indexed":
                i += 3  # INDEXED BY name
            elif i + 1 < n and tokens[i].lower == "not" and tokens[i + 1].lower == "indexed":
                i += 2
            if occ is not None:
                if alias:
                    occ.alias = alias
                self.a.occurrences.append(occ)
            # the join constraint
            if i < n and tokens[i].lower == "on":
                start = i + 1
                depth = 0
                i = start
                while i < n:
                    tk = tokens[i]
                    if tk.text == "(":
                        depth += 1
                    elif tk.text == ")":
                        depth -= 1
                    elif depth == 0 and (tk.text == "," or tk.lower in ("join", "natural", "left", "right",
                                                                          "full", "inner", "cross")):
                        break
                    i += 1
                on = tokens[start:i]
                self.a.conditions.append(self.text(on))
                self._equalities(on)
            elif i < n and tokens[i].lower == "using":
                close = matching(tokens, i + 1)
                self.a.refuse("JOIN_USING", self.text(tokens[i:close + 1]))
                i = close + 1
        if len(self.a.occurrences) > MAX_JOIN_TABLES:
            self.a.refuse("TOO_MANY_TABLES", self.a.from_sql)

    def _occurrence(self, name: str, schema: str | None, text: str) -> Occurrence | None:
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

    # columns -------------------------------------------------------------------------

    def _resolve(self, tokens: Sequence[Token], i: int) -> tuple[tuple[int, str] | None, int]:
        """The column a reference starting at tokens[i] names: ((occurrence, column) or None, next index)."""
        parts = [tokens[i].ident or ""]
        j = i + 1
        while j + 1 < len(tokens) and tokens[j].text == "." and tokens[j + 1].ident is not None:
            parts.append(tokens[j + 1].ident or "")
            j += 2
        if j + 1 < len(tokens) and tokens[j].text == "." and tokens[j + 1].text == "*":
            return None, j + 2
        occs = self.a.occurrences
        column = parts[-1]
        if len(parts) >= 2:
            qualifier = parts[-2].lower()
            for n, o in enumerate(occs):
                if o.alias.lower() == qualifier:
                    real = o.table.has(column)
                    return ((n, real) if real else None), j
            return None, j
        found = [(n, o.table.has(column)) for n, o in enumerate(occs) if o.table.has(column)]
        if len(found) == 1:
            return (found[0][0], found[0][1] or column), j
        return None, j

    def _refs(self, tokens: Sequence[Token], *, outside_aggregates: bool = False
              ) -> list[tuple[tuple[int, str] | None, str]]:
        """Column references in an expression: (resolved or None, text)."""
        out: list[tuple[tuple[int, str] | None, str]] = []
        i = 0
        n = len(tokens)
        while i < n:
            t = tokens[i]
            nxt = tokens[i + 1] if i + 1 < n else None
            if t.kind == "word" and nxt is not None and nxt.text == "(":
                close = matching(tokens, i + 1)
                name = t.lower
                if name == "cast":
                    # CAST(expr AS type): the type is not a column
                    inner = tokens[i + 2:close]
                    cut = next((k for k in range(len(inner) - 1, -1, -1) if inner[k].lower == "as"), len(inner))
                    out.extend(self._refs(inner[:cut], outside_aggregates=outside_aggregates))
                elif outside_aggregates and self._is_aggregate_call(tokens, i, close):
                    close = _call_end(tokens, i)   # its FILTER clause filters the aggregate's rows
                else:
                    out.extend(self._refs(tokens[i + 2:close], outside_aggregates=outside_aggregates))
                i = close + 1
                continue
            if t.lower == "collate":
                i += 2
                continue
            if t.ident is not None and (i == 0 or tokens[i - 1].text != "."):
                resolved, j = self._resolve(tokens, i)
                if resolved is None and t.lower in _EXPR_WORDS:
                    i += 1   # a word of the grammar; the same word naming a column is that column
                    continue
                out.append((resolved, self.text(tokens[i:j])))
                i = j
                continue
            i += 1
        return out

    def _is_aggregate_call(self, tokens: Sequence[Token], i: int, close: int) -> bool:
        name = tokens[i].lower
        if name not in _AGGREGATES:
            return False
        if name in ("min", "max"):
            args = _split_top(tokens[i + 2:close], lambda t: t.text == ",")
            return len(args) == 1
        return True

    def _aggregate_calls(self, tokens: Sequence[Token]) -> list[tuple[str, str]]:
        calls = []
        for i, t in enumerate(tokens):
            if t.kind == "word" and i + 1 < len(tokens) and tokens[i + 1].text == "(":
                close = matching(tokens, i + 1)
                end = _call_end(tokens, i)
                windowed = end + 1 < len(tokens) and tokens[end + 1].lower == "over"
                if self._is_aggregate_call(tokens, i, close) and not windowed:
                    calls.append((t.lower, self.text(tokens[i:end + 1])))
        return calls

    def _equalities(self, tokens: list[Token]) -> None:
        """Records conjuncts `x = y` / `x IS y` between columns of two occurrences."""
        for conjunct in _split_top(tokens, lambda t: t.lower == "and"):
            while conjunct and conjunct[0].text == "(" and matching(conjunct, 0) == len(conjunct) - 1:
                conjunct = conjunct[1:-1]
            ops = [k for k, t in enumerate(conjunct) if t.text in ("=", "==") or t.lower == "is"]
            if len(ops) != 1:
                continue
            k = ops[0]
            left, right = conjunct[:k], conjunct[k + 1:]
            if not left or not right or (conjunct[k + 1:k + 2] and conjunct[k + 1].lower == "not"):
                continue
            lref, lend = self._resolve(left, 0) if left[0].ident is not None else (None, 0)
            rref, rend = self._resolve(right, 0) if right[0].ident is not None else (None, 0)
            if lref and rref and lend == len(left) and rend == len(right) and lref[0] != rref[0]:
                self.a.equi.append((lref, rref))
                if conjunct[k].lower != "is":
                    self.a.strict_equi.append((lref, rref))

    def _joins_connected(self) -> None:
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

    def _select(self, select: list[Token], group: list[Token], having: list[Token]) -> None:
        a = self.a
        items: list[tuple[list[Token], str | None]] = []   # (expression tokens, alias)
        expanded: list[str] = []
        for item in _split_top(select, lambda t: t.text == ","):
            if not item:
                raise UserError("the view's select list has an empty item")
            if len(item) == 1 and item[0].text == "*":
                cols = [f"{self.quote(o.alias)}.{self.quote(c)}" for o in a.occurrences for c, _ in o.table.columns]
                expanded.append(", ".join(f"{self.quote(o.alias)}.*" for o in a.occurrences) if a.occurrences
                                else "*")
                items.extend(([Token("raw", c, 0, 0)], None) for c in cols)
                continue
            if len(item) >= 3 and item[-1].text == "*" and item[-2].text == ".":
                qualifier = (item[-3].ident or "").lower()
                occ = next((o for o in a.occurrences if o.alias.lower() == qualifier), None)
                expanded.append(self.text(item))
                if occ is not None:
                    items.extend(([Token("raw", f"{self.quote(occ.alias)}.{self.quote(c)}", 0, 0)], None)
                                 for c, _ in occ.table.columns)
                continue
            expr, alias = _split_alias(item)
            expanded.append(self.text(item))
            items.append((expr, alias))
        a.select = ", ".join(expanded)
        a.items = [self.text(e) if e[0].kind != "raw" else e[0].text for e, _ in items]
        aggregate_calls = self._aggregate_calls(select) + self._aggregate_calls(having)
        aggregate = bool(group) or bool(having) or bool(aggregate_calls)
        for name, call in aggregate_calls:
            if name in _ORDER_DEPENDENT:
                a.refuse("ORDER_DEPENDENT", call)
        if not aggregate:
            if a.distinct:
                a.kind = "distinct"
                a.keys = list(a.items)
                a.key_columns = [self._plain(e) if e[0].kind != "raw" else self._plain_raw(e[0].text)
                                 for e, _ in items]
                self._check_collation([e for e, _ in items])
            else:
                a.kind = "rows"
            self._note_columns(select, [])
            return
        a.kind = "aggregate"
        if not group:
            a.refuse("NO_KEY", "(no GROUP BY)" if aggregate_calls else "HAVING " + self.text(having))
        if a.distinct:
            a.refuse("DISTINCT_AGGREGATE", "SELECT DISTINCT")
        # GROUP BY terms: ordinals and result aliases stand for the select expressions.
        aliases = {al.lower(): e for e, al in items if al}
        keys: list[list[Token]] = []
        for term in (_split_top(group, lambda t: t.text == ",") if group else []):
            if not term:
                raise UserError("the view's GROUP BY has an empty term")
            if len(term) == 1 and term[0].kind == "number" and term[0].text.isdigit():
                k = int(term[0].text)
                if not 1 <= k <= len(items):
                    raise UserError(f"GROUP BY {k}: the select list has {len(items)} columns")
                term = items[k - 1][0]
            elif (len(term) == 1 and term[0].ident is not None and term[0].ident.lower() in aliases
                  and not any(o.table.has(term[0].ident) for o in a.occurrences)):
                term = aliases[term[0].ident.lower()]
            keys.append(term)
        a.group_by = [self.text(k) if k[0].kind != "raw" else k[0].text for k in keys]
        a.keys = list(a.group_by)
        a.key_columns = [self._plain(k) if k[0].kind != "raw" else self._plain_raw(k[0].text) for k in keys]
        self._check_collation(keys)
        # Every column outside an aggregate must be a GROUP BY column (or the
        # whole expression a GROUP BY expression): else SQLite picks some row's value.
        group_norms = {_norm(k) for k in keys if k[0].kind != "raw"}
        group_cols = {c for c in a.key_columns if c is not None}
        for expr, _ in items:
            if expr[0].kind == "raw":
                ref = self._plain_raw(expr[0].text)
                if ref not in group_cols:
                    a.refuse("BARE_COLUMN", expr[0].text)
                continue
            if _norm(expr) in group_norms:
                continue
            for ref, text in self._refs(expr, outside_aggregates=True):
                if ref is None and text.lower() in aliases:
                    continue
                if ref not in group_cols:
                    a.refuse("BARE_COLUMN", self.text(expr))
                    break
        for ref, text in self._refs(having, outside_aggregates=True):
            if ref is None and text.lower() in aliases:
                continue
            if ref not in group_cols and not any(_norm(k) == text.lower() for k in keys):
                a.refuse("BARE_COLUMN", "HAVING " + self.text(having))
                break
        self._note_columns(select, group + having)

    def _note_columns(self, *parts: list[Token]) -> None:
        a = self.a
        a.columns_read = [set() for _ in a.occurrences]
        a.columns_filtered = [set() for _ in a.occurrences]
        where = tokenize(a.where, self.dialect) if a.where else []
        conds = [t for c in a.conditions for t in tokenize(c, self.dialect)]
        for tokens, filtering in [*((p, False) for p in parts), (where, True), (conds, True)]:
            for ref, _ in self._refs(tokens):
                if ref is not None:
                    a.columns_read[ref[0]].add(ref[1])
                    if filtering:
                        a.columns_filtered[ref[0]].add(ref[1])

    def _plain(self, expr: Sequence[Token]) -> tuple[int, str] | None:
        """(occurrence, column) when the expression is just a column reference."""
        if expr and expr[0].ident is not None:
            ref, end = self._resolve(expr, 0)
            if end == len(expr):
                return ref
        return None

    def _plain_raw(self, text: str) -> tuple[int, str] | None:
        return self._plain(tokenize(text, self.dialect))

    def _check_collation(self, exprs: Sequence[Sequence[Token]]) -> None:
        for expr in exprs:
            for k, t in enumerate(expr):
                if t.lower == "collate" and k + 1 < len(expr) and (expr[k + 1].ident or "").lower() != "binary":
                    self.a.refuse("COLLATION", self.text(expr) if expr[0].kind != "raw" else expr[0].text)


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
    for before, token in zip(tokens, tokens[1:]):
        gap = sql[before.end:token.start]
        if gap:
            spaces = "".join(ch if ch in " \t\n" else " " for ch in gap)
            out.append(spaces if gap.isspace() else ("\n" if "\n" in spaces else " "))
        out.append(token.text)
    return "".join(out)


def analyse(sql: str, catalog: Callable[[str], TableInfo | None],
            quote_identifier: Callable[[str], str] = quote, dialect: str = "sqlite") -> Analysis:
    """Reads a view's defining query, in the target's dialect (sqlite or spark).
    catalog(name) describes a table of the target (None if there is none);
    quote_identifier quotes a name in that dialect (the columns `*` stands for
    are written with it). Raises UserError for SQL that cannot be a view at
    all; shapes that cannot be incremental are in .reasons. The analysis's .sql
    is the query as the target stores and runs it (see definition)."""
    return _Parser(definition(sql, dialect), catalog, quote_identifier, dialect).run()
