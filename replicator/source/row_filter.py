"""A row filter (--where) is read with PostgreSQL's own grammar before any of it reaches the server."""

from __future__ import annotations

from typing import Any

from replicator.errors import UserError

# Statements that write: PostgreSQL refuses them inside an expression, and so does
# check_row_filter, before the server sees them.
_WRITING_NODES = ("InsertStmt", "UpdateStmt", "DeleteStmt", "MergeStmt")


def _one_expression(sql: str) -> Any:
    """The expression X of `sql`, which must be `SELECT X` and nothing else:
    one statement, one unnamed target, no other clause. Raises ValueError with
    why not."""
    from pglast import ast, enums, parse_sql
    from pglast.parser import ParseError

    try:
        statements = parse_sql(sql)
    except ParseError as exc:
        raise ValueError(exc.args[0] if exc.args else str(exc)) from None
    if len(statements) != 1:
        raise ValueError("it makes several statements")
    select = statements[0].stmt
    if not isinstance(select, ast.SelectStmt) or select.op != enums.SetOperation.SETOP_NONE:
        raise ValueError("it is not one expression")
    extra = [name for name in ("distinctClause", "intoClause", "fromClause", "whereClause", "groupClause",
                               "havingClause", "windowClause", "valuesLists", "sortClause", "limitOffset",
                               "limitCount", "lockingClause", "withClause")
             if getattr(select, name)]
    if extra or not select.targetList or len(select.targetList) != 1:
        raise ValueError("it is not one expression")
    target = select.targetList[0]
    if target.name or target.indirection or (isinstance(target.val, ast.ColumnRef) and any(
            isinstance(f, ast.A_Star) for f in target.val.fields or ())):
        raise ValueError("it is not one expression")
    return target.val


def check_row_filter(where: str | None, *, self_contained: bool = False) -> str | None:
    """Checks a row filter (--where) with PostgreSQL's own grammar (pglast:
    libpg_query) before anything of it reaches the server, and returns it as
    given. It must be exactly one expression: alone (so no `)` of it closes a
    parenthesis it did not open) and inside the parentheses the capture puts
    around it (so a trailing `--` comment cannot swallow them). Sub-selects
    reading other tables are allowed (they run with the capture, as the
    capture function's owner); writing statements, row locks (FOR UPDATE...)
    and parameters are not. A backslash in a '...' string is refused: its
    meaning depends on standard_conforming_strings (write E'...'), and so are
    U&'...' strings, which a session with it off cannot read.
    ``self_contained`` (where no event trigger sees DDL): it may name only the
    row's columns and what pg_catalog holds, since a DDL on anything else it
    names (a table it reads, a function, type or operator of a schema) would
    go unseen and make the capture fail at every write.
    Raises UserError with why, in one line."""
    if where is None:
        return None
    if not where.strip():
        raise UserError("invalid row filter: it is empty")
    if "\x00" in where:   # the parser would stop there; PostgreSQL refuses it in text anyway
        raise _refuse("it contains a NUL character")
    _check_tokens(where)
    try:
        expression = _one_expression(f"SELECT {where}")
        _one_expression(f"SELECT ({where})")
    except ValueError as exc:
        raise _refuse(str(exc)) from None
    _check_nodes(expression, self_contained=self_contained)
    return where


def _refuse(why: str) -> UserError:
    """A row filter's refusal, in one line whatever the filter's text shown in it holds."""
    return UserError(f"invalid row filter: {' '.join(why.split())}; --where takes one SQL expression"
                     f" over the row's columns")


def _check_tokens(where: str) -> None:
    """Refuses what a row filter's tokens show: strings a session may read otherwise, parameters,
    a trailing -- comment."""
    from pglast import parser

    try:
        tokens = parser.scan(where)
    except parser.ParseError as exc:
        raise _refuse(exc.args[0] if exc.args else str(exc)) from None
    for token in tokens:
        text = where[token.start:token.end + 1]
        if token.name == "USCONST":
            raise _refuse(f"U&'...' strings cannot be read in every session ({text[:40]}): write E'\\uXXXX'")
        if token.name == "SCONST" and text[0] not in "eE$" and "\\" in text:
            raise _refuse(f"a backslash in a '...' string means what standard_conforming_strings says "
                          f"({text[:40]}): write it as E'...' with \\\\ for a backslash")
        if token.name == "PARAM":
            raise _refuse(f"it has a parameter ({text})")
    if tokens and tokens[-1].name == "SQL_COMMENT" and not set("\n\r") & set(where[tokens[-1].end + 1:]):
        raise _refuse("it ends in a -- comment, which would swallow what the capture writes after it")


def _check_nodes(expression: Any, *, self_contained: bool) -> None:
    """Refuses what a row filter's parse holds: a write, a row lock, SELECT INTO; and when
    self_contained, an object outside its row and pg_catalog (see check_row_filter)."""
    from pglast import ast
    from pglast.visitors import Visitor

    class Refuse(Visitor):
        def visit(self, ancestors: Any, node: Any) -> None:
            name = type(node).__name__
            if name in _WRITING_NODES:
                raise _refuse(f"it writes ({name.removesuffix('Stmt').upper()})")
            if isinstance(node, ast.SelectStmt) and node.lockingClause:
                raise _refuse("it locks rows (FOR UPDATE/SHARE)")
            if isinstance(node, ast.SelectStmt) and node.intoClause:
                raise _refuse("it creates a table (SELECT INTO)")
            if self_contained:
                named = _named_object(node)
                if named:
                    raise _refuse(f"it names {named}, which replicator cannot watch for changes without event "
                                  f"triggers (installed by a superuser): name only the row's columns and "
                                  f"built-in functions")

    Refuse()(expression)


# types whose values name catalog objects: resolved at every plan
_REG_TYPES = {"regclass", "regproc", "regprocedure", "regoper", "regoperator", "regtype", "regnamespace",
              "regrole", "regconfig", "regdictionary", "regcollation"}


def _named_object(node: Any) -> str | None:
    """What a row filter's parse node names outside its row and pg_catalog, if anything."""
    from pglast import ast

    def qualified(names: Any) -> str | None:
        parts = [getattr(n, "sval", None) for n in names or ()]
        if len(parts) > 1 and parts[0] != "pg_catalog":
            return ".".join(p or "?" for p in parts)
        return None

    if isinstance(node, ast.RangeVar):
        return f"table {node.relname}"
    if isinstance(node, ast.FuncCall) and qualified(node.funcname):
        return f"function {qualified(node.funcname)}"
    if isinstance(node, ast.A_Expr) and qualified(node.name):
        return f"operator {qualified(node.name)}"
    if isinstance(node, ast.TypeName):
        if qualified(node.names):
            return f"type {qualified(node.names)}"
        if node.names and getattr(node.names[-1], "sval", None) in _REG_TYPES:
            return f"a catalog object by a {node.names[-1].sval} value"
    return None
