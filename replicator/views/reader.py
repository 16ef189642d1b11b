"""The analysis read from sqlglot's tree of a view's query (replicator.views.analysis)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from sqlglot import exp

from replicator.errors import UserError
from replicator.views.guards import lexical_reasons
from replicator.views.shape import MAX_JOIN_TABLES, Analysis, Occurrence, TableInfo
from replicator.views.syntax_tree import SPAN, Unread
from replicator.views.tokens import Token, balanced, count_arguments, matching

_AGGREGATES = {"count", "sum", "total", "avg", "min", "max", "group_concat", "string_agg",
               "json_group_array", "json_group_object", "jsonb_group_array", "jsonb_group_object",
               "median", "percentile", "percentile_cont", "percentile_disc"}
_ORDER_DEPENDENT = {"group_concat", "string_agg", "json_group_array", "json_group_object",
                    "jsonb_group_array", "jsonb_group_object"}


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


class Reader:
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
        span = node.meta_get(SPAN)
        if span is None and isinstance(node, exp.Identifier) and node.meta_get("start") is not None:
            span = (node.meta_get("start"), node.meta_get("end") + 1)
        if span is None:
            raise Unread("", f"the parse does not say where its {node.key} is")
        return (int(span[0]), int(span[1]))

    def text(self, node: exp.Expr) -> str:
        """The node's text, which the generated statements copy: whole tokens, parentheses
        balanced (never a cut string or an open parenthesis: else Unread)."""
        start, end = self.span(node)
        i, j = self.starting.get(start), self.ending.get(end)
        if i is None or j is None or not balanced(self.tokens[i:j + 1]):
            raise Unread(self.sql[start:end][:40], "the parse places a node across tokens or parentheses")
        return self.sql[start:end]

    def known(self, node: exp.Expr, parts: set[str]) -> None:
        """Raises Unread when node has a part (an argument in sqlglot's tree) not in parts."""
        for key, value in node.args.items():
            if value and key not in parts:
                first = value[0] if isinstance(value, list) else value
                raise Unread(self.text(first) if isinstance(first, exp.Expr) else key,
                              f"a part of {node.key} it does not read ({key})")

    def run(self, tree: exp.Expr) -> Analysis:
        if self.dialect == "spark":
            self.refuse_qualified_tables(tree)
        found = lexical_reasons(self.sql, self.tokens, self.dialect) + self.nested(tree)
        for _, code, fragment in sorted(found, key=lambda f: f[0]):
            self.a.refuse(code, fragment)
        if self.tokens[0].lower != "with":
            self.statement(tree)
        return self.a

    def refuse_qualified_tables(self, tree: exp.Expr) -> None:
        """Refuses (Spark SQL) a table named with a qualifier: a path, or another catalog's table."""
        for table in tree.find_all(exp.Table):
            if table.args.get("db") or table.args.get("catalog"):
                raise UserError(f"a view reads the warehouse's tables by their names (orders, s__t), not a "
                                f"path or another catalog's table: refused at {self.name_text(table)}")

    def nested(self, tree: exp.Expr) -> list[tuple[int, str, str]]:
        """The subqueries and windows anywhere in the query, as (position, code, fragment)."""
        found = []
        for node in tree.walk():
            if isinstance(node, (exp.Select, exp.SetOperation, exp.Values)):
                around = self.parenthesized(node)
                if around is not None:
                    found.append((around[0], "SUBQUERY", self.sql[around[0]:around[1]]))
            elif isinstance(node, exp.In) and node.args.get("field") is not None:   # SQLite's `x IN table`
                found.append((self.span(node)[0], "SUBQUERY", self.text(node)))
            elif isinstance(node, exp.Window) and node.args.get("over"):
                found.append((self.over(node), "WINDOW_FUNCTION", self.text(node)))
        return found

    def statement(self, tree: exp.Expr) -> None:
        """The query's top statement: a SELECT is read; VALUES and set operations are reasons."""
        if isinstance(tree, exp.Values):
            self.a.refuse("NO_TABLE", self.tokens[0].text)
        elif isinstance(tree, exp.SetOperation):
            while isinstance(tree.this, exp.SetOperation):
                tree = tree.this
            self.a.refuse("SET_OPERATION", tree.key.upper() + ("" if tree.args.get("distinct") else " ALL"))
        elif isinstance(tree, exp.Select):
            self.clauses(tree)
        else:
            raise Unread(self.sql[:40], f"sqlglot reads a {tree.key}")

    def parenthesized(self, node: exp.Expr) -> tuple[int, int] | None:
        """The text of a query with the parentheses around it (a subquery), when it has them."""
        start, end = self.span(node)
        i, j = self.starting.get(start), self.ending.get(end)
        if i is None or j is None:
            return None
        tokens = self.tokens
        if tokens[i].text == "(" and matching(tokens, i) == j:   # its span has them
            return start, end
        if i > 0 and j + 1 < len(tokens) and tokens[i - 1].text == "(" and matching(tokens, i - 1) == j + 1:
            return tokens[i - 1].start, tokens[j + 1].end
        return None

    def token_at(self, start: int) -> int:
        """The index of the token that starts there (a node's text starts with a token)."""
        if start not in self.starting:
            raise Unread(self.sql[start:start + 40], "a node's text does not start with a token")
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
        span = node.meta_get(SPAN)
        if span is None:
            if node.meta_get("start") is not None:   # written, not made by sqlglot: it must have its text
                raise Unread("", f"the parse does not say where its {node.key} call is")
            return None
        i, j = self.starting.get(span[0]), self.ending.get(span[1])
        tokens = self.tokens
        if i is None or j is None or tokens[i].ident is None or i + 1 >= j or tokens[i + 1].text != "(" \
                or matching(tokens, i + 1) != j:
            return None
        return (tokens[i].ident or "").lower(), count_arguments(tokens[i + 2:j])

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
                self.join_kind(join, first_token)
            self.source(source)
            if join is not None:
                self.join_condition(join)
        if len(a.occurrences) > MAX_JOIN_TABLES:
            a.refuse("TOO_MANY_TABLES", a.from_sql)

    def join_kind(self, join: exp.Join, first_token: int) -> None:
        """Refuses a join other than an inner one (first_token: its table's, after the join's words)."""
        self.known(join, _JOIN_PARTS)
        words = self.tokens[self.token_at(self.span(join)[0]):first_token]
        op = self.sql[words[0].start:words[-1].end].upper() if words else ""
        at = f"{op} {self.tokens[first_token].text}"
        if join.method not in ("", "NATURAL") or join.kind not in ("", "INNER", "CROSS", "OUTER", "SEMI", "ANTI"):
            raise Unread(op, "a join it does not read")
        if join.side or join.kind in ("OUTER", "SEMI", "ANTI"):
            self.a.refuse("OUTER_JOIN", at)
        if join.method == "NATURAL":
            self.a.refuse("JOIN_USING", at)

    def source(self, source: exp.Expr) -> None:
        """A FROM item: a table of the target is an occurrence; a subquery or a table function, a reason."""
        a = self.a
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

    def join_condition(self, join: exp.Join) -> None:
        """A join's ON (its equalities link the tables), or its USING (a reason)."""
        on = join.args.get("on")
        if on is not None:
            self.a.conditions.append(self.text(on))
            self.filters.append(on)
            self.equalities(on)
        elif join.args.get("using"):
            self.a.refuse("JOIN_USING", f"USING ({', '.join(self.text(u) for u in join.args['using'])})")

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
        """The select list, GROUP BY and HAVING: the view's kind (rows, distinct, aggregate), its
        keys, and the columns it reads."""
        items = self.items(nodes)
        calls = [c for item in items if item.node is not None for c in self.aggregate_calls(item.node)]
        calls += self.aggregate_calls(having) if having is not None else []
        for name, call in calls:
            if name in _ORDER_DEPENDENT:
                self.a.refuse("ORDER_DEPENDENT", call)
        read = [item.node for item in items if item.node is not None]
        if group is None and having is None and not calls:
            self.rows_or_distinct(items)
        else:
            self.grouped(items, group, having, aggregates=bool(calls))
            read += [node for node in (group, having) if node is not None]
        self.note_columns(read)

    def items(self, nodes: list[exp.Expr]) -> list[_Item]:
        """The select items, `*` and `t.*` standing for the columns they expand to; the select
        list (`*` expanded) and the items' texts, calls and columns recorded."""
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
                raise Unread(self.text(node), "an item of several names")
            else:
                expanded.append(self.text(node))
                items.append(_Item(node, self.text(node)))
        a.select = ", ".join(expanded)
        a.items = [item.text for item in items]
        a.item_calls = [self.item_call(item) for item in items]
        a.item_columns = [self.key_column(item) for item in items]
        return items

    def rows_or_distinct(self, items: list[_Item]) -> None:
        """A view without aggregates: its rows, or (SELECT DISTINCT) its selected values as keys."""
        a = self.a
        if not a.distinct:
            a.kind = "rows"
            return
        a.kind = "distinct"
        a.keys = list(a.items)
        a.key_items = list(range(len(items)))
        a.key_columns = [self.key_column(item) for item in items]
        self.check_collation(items)

    def grouped(self, items: list[_Item], group: exp.Group | None, having: exp.Expr | None, *,
                aggregates: bool) -> None:
        """An aggregate view: its GROUP BY terms are its keys."""
        a = self.a
        a.kind = "aggregate"
        if group is None:
            a.refuse("NO_KEY", "(no GROUP BY)" if aggregates else "HAVING " + (a.having or ""))
        if a.distinct:
            a.refuse("DISTINCT_AGGREGATE", "SELECT DISTINCT")
        aliases = {item.alias.lower(): item for item in items if item.alias}
        keys = self.group_keys(group, items, aliases) if group is not None else []
        a.group_by = [k.text for k in keys]
        a.keys = list(a.group_by)
        a.key_columns = [self.key_column(k) for k in keys]
        a.key_items = [self.item_of(k, items) for k in keys]
        self.check_collation(keys)
        self.refuse_bare_columns(items, keys, having, aliases)

    def group_keys(self, group: exp.Group, items: list[_Item], aliases: dict[str, _Item]) -> list[_Item]:
        """The GROUP BY terms: ordinals and result aliases stand for the select expressions."""
        self.known(group, {"expressions"})   # (GROUP BY ALL, ROLLUP, CUBE, GROUPING SETS)
        keys: list[_Item] = []
        for term in group.expressions:
            if isinstance(term, exp.Literal) and not term.is_string and term.name.isdigit():
                k = int(term.name)
                if not 1 <= k <= len(items):
                    raise UserError(f"GROUP BY {k}: the select list has {len(items)} columns")
                keys.append(items[k - 1])
            elif (isinstance(term, exp.Column) and not term.table and term.name.lower() in aliases
                  and not any(o.table.has(term.name) for o in self.a.occurrences)):
                keys.append(aliases[term.name.lower()])
            elif isinstance(term, (exp.Rollup, exp.Cube, exp.GroupingSets)):
                raise Unread(self.text(term), "grouping sets")
            else:
                keys.append(_Item(term, self.text(term)))
        return keys

    def refuse_bare_columns(self, items: list[_Item], keys: list[_Item], having: exp.Expr | None,
                            aliases: dict[str, _Item]) -> None:
        """Every column outside an aggregate must be a GROUP BY column (or the whole expression
        a GROUP BY expression): else SQLite picks some row's value."""
        a = self.a
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
        if having is not None and bare(having, or_key=True):
            a.refuse("BARE_COLUMN", "HAVING " + (a.having or ""))

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
        column = next((c for c in node.find_all(exp.Column) if c.meta_get(SPAN) == span), None)
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
