"""What the analysis refuses on the tokens of a view's query, before any parse: what must never
reach the target (a second statement, a `)` that closes the target's wrapper, parameters, a
statement other than a query; in Spark SQL, scripts, Java methods, files read by path), and the
reasons read there (WITH, the functions of time and chance). Part of the analysis
(replicator.views.analysis)."""

from __future__ import annotations

from collections.abc import Sequence

from replicator.errors import UserError
from replicator.views.tokens import Token, count_arguments, matching, string_value

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
    another catalog's table). replicator.targets.delta.spark_sql.check_query checks Spark's own parse of the
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


def refuse_what_is_not_a_query(sql: str, tokens: Sequence[Token], dialect: str) -> None:
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


def lexical_reasons(sql: str, tokens: Sequence[Token], dialect: str) -> list[tuple[int, str, str]]:
    """The reasons read on the tokens, as (position, code, fragment): WITH, and the calls of
    time and chance (by their names as written): a function of them, the current time with
    or without parentheses, a time function without its time value (or, in SQLite, with
    'now'), and in Spark SQL the strings that stand for now."""
    found = [(tokens[0].start, "CTE", sql[tokens[0].start:tokens[2].end])] if tokens[0].lower == "with" else []
    for i, t in enumerate(tokens):
        called = i + 1 < len(tokens) and tokens[i + 1].text == "("
        close = matching(tokens, i + 1) if called else i
        if t.lower in _NOW_WORDS or (t.kind == "word" and called and (
                t.lower in _NONDETERMINISTIC or _means_now(t.lower, tokens[i + 2:close], dialect))):
            found.append((t.start, "NONDETERMINISTIC", sql[t.start:tokens[close].end]))
        elif t.kind == "string" and dialect == "spark" and string_value(t) in _SPARK_NOW_STRINGS:
            found.append((t.start, "NONDETERMINISTIC", t.text))
    return found


def _means_now(function: str, args: Sequence[Token], dialect: str) -> bool:
    """A call of a function of a time value that leaves it out, or (SQLite) gives it as 'now'."""
    needed = _TIME_VALUE_ARGUMENTS.get(function)
    if needed is None:
        return False
    return count_arguments(args) < needed or (dialect == "sqlite" and any(
        a.kind == "string" and string_value(a) == "now" for a in args))
