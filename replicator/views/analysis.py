"""Incremental views: the analysis of a view's defining query.

A view is a SELECT in the target's own SQL (SQLite's, or Spark SQL on a Delta
warehouse) over replicated tables. This module reads the query and
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

Its parts: replicator.views.tokens (the tokenizers, the stored definition),
replicator.views.guards (what is refused, and the reasons read, on the tokens),
replicator.views.syntax_tree (sqlglot's tree, with each node's place in the text),
replicator.views.reader (the analysis read from that tree) and replicator.views.shape
(what it finds: Analysis, its reasons).
"""

from __future__ import annotations

from collections.abc import Callable

from replicator.views.guards import SPARK_REFLECTION, lexical_reasons, refuse_what_is_not_a_query
from replicator.views.reader import Reader
from replicator.views.shape import Analysis, Reason, TableInfo
from replicator.views.syntax_tree import Unread, parse
from replicator.views.tokens import definition, quote, tokenize

# what the targets use of the analysis (its parts are modules of their own: see above)
__all__ = ["SPARK_REFLECTION", "Analysis", "Reason", "TableInfo", "analyse", "quote"]


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
    refuse_what_is_not_a_query(sql, tokens, dialect)
    try:
        return Reader(sql, tokens, catalog, quote_identifier, dialect).run(parse(sql, tokens, dialect))
    except Unread as unread:
        # what the tokens say, then that sqlglot does not read the rest: the view is refreshed in full
        a = Analysis(sql=sql)
        for _, code, fragment in sorted(lexical_reasons(sql, tokens, dialect), key=lambda f: f[0]):
            a.refuse(code, fragment)
        a.refuse("UNREAD", unread.fragment, unread.detail)
        return a
