"""A view's Spark SQL, before Spark runs it: names quoted, Spark's own parse checked.

Views of a Delta warehouse are queries in Spark SQL over the
warehouse's tables. The analysis (replicator.views.analysis) reads them on its
tokens; check_query is the last guard before spark.sql(), which runs a command
as soon as it is given one: Spark's own parser reads the text (which runs
nothing) and what is not a query over the tables is refused in one line.
"""

from __future__ import annotations

import re
from typing import Any

from replicator.errors import UserError
from replicator.views.analysis import SPARK_REFLECTION


def quote_spark(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def spark_error_line(exc: BaseException) -> str:
    """A Spark error's first line (PySpark's errors keep their message in `desc`)."""
    text = str(getattr(exc, "desc", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# Nodes of Spark's parsed plans that are not a query's: statements and commands (INSERT, INSERT
# OVERWRITE DIRECTORY, SET, CACHE, EXECUTE IMMEDIATE, CALL, scripts...), which spark.sql()
# runs as soon as it is given them, and scripts a query would run (SELECT TRANSFORM). Besides
# these names, any node that is a Command or a ParsedStatement.
_NOT_A_QUERY = re.compile(r"Insert|Command|Statement|Script|Execute|Compound|Procedure|UnresolvedIdentifier|^Call$")
_LOGICAL = "org.apache.spark.sql.catalyst.plans.logical."


def check_query(spark: Any, sql: str, tables: set[str]) -> set[str]:
    """Reads a view's SQL with Spark's own parser, which runs nothing, and refuses (a
    one-line UserError) what is not a query reading only the warehouse's tables
    (tables: their names, lower case), before spark.sql() is given it: a statement or
    command; a script (TRANSFORM/MAP/REDUCE); reflect/java_method; a relation that is
    not one of the tables or the query's own WITH names (`csv.`/path``, a catalog's
    table); a name given at run time (IDENTIFIER(...)). The analysis (replicator.views.analysis)
    refuses the same on the tokens; this is the parse Spark will run. Returns the names of
    the tables it reads (lower case)."""
    from py4j.java_gateway import is_instance_of

    if not hasattr(spark, "_jsparkSession"):
        raise UserError("views need a classic Spark session (not Spark Connect): its parser checks their SQL")
    try:
        plan = spark._jsparkSession.sessionState().sqlParser().parsePlan(sql)
    except Exception as exc:   # ParseException
        raise UserError(f"the view's SQL does not run on the warehouse: {spark_error_line(exc)}") from None
    gateway = spark.sparkContext._gateway

    def seq(scala: Any) -> list[Any]:
        return [scala.apply(i) for i in range(scala.size())]

    relations: list[str] = []
    names: set[str] = set()       # the query's WITH names
    plans, seen = [plan], 0
    while seen < len(plans):
        node = plans[seen]
        seen += 1
        kind = node.getClass().getSimpleName()
        if _NOT_A_QUERY.search(kind) or is_instance_of(gateway, node, _LOGICAL + "Command") \
                or is_instance_of(gateway, node, _LOGICAL + "ParsedStatement"):
            what = "a script (TRANSFORM ... USING)" if kind == "ScriptTransformation" else kind
            raise UserError(f"a view is defined by a query that only reads the warehouse's tables: Spark reads "
                            f"this SQL as {what}")
        if kind == "UnresolvedRelation":
            parts = seq(node.multipartIdentifier())
            if len(parts) != 1:
                written = ".".join(p if re.fullmatch(r"[A-Za-z_]\w*", p) else quote_spark(p) for p in parts)
                raise UserError(f"a view reads the warehouse's tables by their names (orders, s__t), not a path "
                                f"or another catalog's table: refused at {written}")
            relations.append(parts[0])
        elif kind == "UnresolvedWith":
            names.update(str(pair._1()).lower() for pair in seq(node.cteRelations()))
        expressions = seq(node.expressions())
        while expressions:
            expression = expressions.pop()
            kind = expression.getClass().getSimpleName()
            if "UnresolvedIdentifier" in kind:
                raise UserError(f"a view names its tables and functions as written: Spark reads this SQL as {kind}")
            if kind == "UnresolvedFunction":
                name = str(seq(expression.nameParts())[-1]).lower()
                if name in SPARK_REFLECTION:
                    raise UserError(f"a view cannot call Java methods ({name})")
            expressions.extend(seq(expression.children()))
        # the plans of subqueries (in expressions: innerChildren holds them, unless the node has
        # other inner plans, those of WITH's definitions) and the children
        inner = seq(node.innerChildren())
        plans.extend(seq(node.children()) + inner + [q for q in seq(node.subqueries())
                                                      if not any(q.equals(p) for p in inner)])
    unknown = sorted({r for r in relations if r.lower() not in tables | names})
    if unknown:
        raise UserError(f"the view reads {unknown[0]}, which is not a table of the warehouse: a view reads only "
                        f"the warehouse's replicated tables")
    return {r.lower() for r in relations if r.lower() not in names}
