"""What the analysis of a view's query finds: its kind, tables, keys and items, and the reasons
it cannot be kept current incrementally (replicator.views.analysis)."""

from __future__ import annotations

from dataclasses import dataclass, field

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
