"""Incremental views without PostgreSQL: what `explain` says and why (reason
codes and fragments), the `view` commands and their errors, the refresh log,
crash safety of the refresh inside the batch's transaction, views over views,
and a refresh that fails. Batches are applied through SqliteTarget's API, as
the consumer does."""

from __future__ import annotations

import json
import logging
import re
import sqlite3
import subprocess
import sys
import textwrap
import time
from contextlib import closing
from pathlib import Path

import pytest

from consumer_helpers import run_cli
from replicator.errors import UserError
from replicator.targets.sqlite.views import auto as views_auto
from replicator.targets.sqlite.views import catalog as views_catalog
from replicator.targets.sqlite.views.names import INDEX_PREFIX
from replicator.views.analysis import TableInfo, analyse
from views_helpers import open_target, table, view_differences

ORDERS = table("orders", [("id", "int", True), ("cid", "int", False), ("amount", "int", False),
                          ("status", "text", False)], ["id"], 1)
CUSTOMERS = table("customers", [("id", "int", True), ("region", "text", False), ("name", "text", False)], ["id"], 2)
REGIONS = table("regions", [("name", "text", True), ("zone", "text", False)], ["name"], 3)
PLANETS = table("planets", [("name", "text", True)], ["name"], 4)
# columns named like words of SQL's grammar (which SQLite lets a column name be)
RANKS = table("ranks", [("id", "int", True), ("k", "int", False), ("first", "int", False), ("last", "int", False),
                        ("row", "text", False)], ["id"], 5)


@pytest.fixture
def replica(tmp_path: Path) -> Path:
    path = tmp_path / "replica.db"
    t = open_target(path)
    t.begin()
    for tbl in (ORDERS, CUSTOMERS, REGIONS, PLANETS, RANKS):
        t.create_table(tbl)
    t.upsert(RANKS, "R", [(i, i % 4, i * 7 % 10, i % 3, f"r{i % 5}") for i in range(1, 41)])
    t.upsert(ORDERS, "R", [(i, i % 20 if i % 9 else None, i * 3 % 50, ["new", "paid", None][i % 3])
                           for i in range(1, 301)])
    t.upsert(CUSTOMERS, "R", [(i, ["eu", "us", None][i % 3], f"c{i}") for i in range(20)])
    t.upsert(REGIONS, "R", [("eu", "z1"), ("us", "z2")])
    t.commit()
    t.db.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT)")   # not replicated
    t.close()
    return path


@pytest.fixture
def target(replica: Path):
    t = open_target(replica)
    yield t
    t.close()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli("", *args)


# explain: reason codes and fragments -------------------------------------------------------

REFUSED = [
    ("SELECT o.id, c.name FROM orders o LEFT JOIN customers c ON c.id = o.cid", "OUTER_JOIN", "LEFT JOIN customers"),
    ("SELECT o.id FROM orders o FULL OUTER JOIN customers c ON c.id = o.cid", "OUTER_JOIN", "FULL OUTER JOIN"),
    ("SELECT id, row_number() OVER (ORDER BY amount) AS r FROM orders", "WINDOW_FUNCTION",
     "row_number() OVER (ORDER BY amount)"),
    ("SELECT id, sum(amount) OVER w FROM orders WINDOW w AS (ORDER BY id)", "WINDOW_FUNCTION", "sum(amount) OVER w"),
    ("SELECT id FROM orders ORDER BY amount LIMIT 10", "LIMIT", "LIMIT 10"),
    ("SELECT id, random() AS r FROM orders", "NONDETERMINISTIC", "random()"),
    ("SELECT id FROM orders WHERE date('now') > '2000-01-01'", "NONDETERMINISTIC", "date('now')"),
    ("SELECT id, CURRENT_TIMESTAMP FROM orders", "NONDETERMINISTIC", "CURRENT_TIMESTAMP"),
    ("SELECT id FROM orders WHERE cid IN (SELECT id FROM customers)", "SUBQUERY", "(SELECT id FROM customers)"),
    ("SELECT x.id FROM (SELECT id FROM orders) x", "SUBQUERY", "(SELECT id FROM orders)"),
    ("SELECT id FROM orders UNION SELECT id FROM customers", "SET_OPERATION", "UNION"),
    ("SELECT id FROM orders UNION ALL SELECT id FROM customers", "SET_OPERATION", "UNION ALL"),
    ("WITH x AS (SELECT id FROM orders) SELECT id FROM x", "CTE", "WITH x AS"),
    ("SELECT count(*) FROM orders", "NO_KEY", "(no GROUP BY)"),
    ("SELECT o.id FROM orders o JOIN customers c USING (id)", "JOIN_USING", "USING (id)"),
    ("SELECT * FROM orders NATURAL JOIN customers", "JOIN_USING", "NATURAL JOIN customers"),
    ("SELECT o.id, c.id FROM orders o, customers c WHERE o.amount > c.id", "NO_EQUI_JOIN", "customers AS c"),
    ("SELECT o.id FROM orders o JOIN customers c ON c.id = o.cid JOIN regions r ON r.name = c.region"
     " JOIN planets p ON p.name = r.zone", "TOO_MANY_TABLES", "orders o JOIN"),
    ("SELECT cid, amount, count(*) FROM orders GROUP BY cid", "BARE_COLUMN", "amount"),
    ("SELECT cid, group_concat(status) FROM orders GROUP BY cid", "ORDER_DEPENDENT", "group_concat(status)"),
    ("SELECT status COLLATE NOCASE, count(*) FROM orders GROUP BY status COLLATE NOCASE", "COLLATION",
     "status COLLATE NOCASE"),
    ("SELECT n.id, o.amount FROM notes n JOIN orders o ON o.id = n.id", "NOT_REPLICATED", "notes"),
    ("SELECT DISTINCT cid, count(*) FROM orders GROUP BY cid", "DISTINCT_AGGREGATE", "SELECT DISTINCT"),
    ("SELECT o.id, j.value FROM orders o, json_each('[1,2]') j", "TABLE_FUNCTION", "json_each('[1,2]')"),
    ("SELECT cid, strftime('%Y') AS y, count(*) FROM orders GROUP BY cid", "NONDETERMINISTIC", "strftime('%Y')"),
    ("SELECT id, julianday() AS day FROM orders", "NONDETERMINISTIC", "julianday()"),
    ("SELECT id FROM orders WHERE datetime(amount, 'unixepoch') < datetime('now', '-1 day')", "NONDETERMINISTIC",
     "datetime('now', '-1 day')"),
    ("SELECT k, first, count(*) FROM ranks GROUP BY k", "BARE_COLUMN", "first"),
    ("SELECT k, count(*) FROM ranks GROUP BY k HAVING max(last) > 1 AND row > 'r2'", "BARE_COLUMN",
     "HAVING max(last) > 1 AND row > 'r2'"),
]
# Spark SQL: read with the Spark dialect (the same analysis a delta: target's views run)
SPARK_REFUSED = [
    ("SELECT cid, current_timestamp() AS at, count(*) FROM orders GROUP BY cid", "NONDETERMINISTIC",
     "current_timestamp()"),
    ("SELECT id, current_date() AS day FROM orders", "NONDETERMINISTIC", "current_date()"),
    ("SELECT id, current_date AS day FROM orders", "NONDETERMINISTIC", "current_date"),
    ("SELECT id, unix_timestamp() AS at FROM orders", "NONDETERMINISTIC", "unix_timestamp()"),
    ("SELECT id, now() AS at FROM orders", "NONDETERMINISTIC", "now()"),
    ("SELECT id, curdate() AS day FROM orders", "NONDETERMINISTIC", "curdate()"),
    ("SELECT id FROM orders WHERE cast(amount AS timestamp) > TIMESTAMP 'today'", "NONDETERMINISTIC", "'today'"),
    ("SELECT id, amount FROM orders WHERE status <> 'it\\'s' LIMIT 3", "LIMIT", "LIMIT 3"),
]
CASES = [("sqlite", *r) for r in REFUSED] + [("spark", *r) for r in SPARK_REFUSED]


@pytest.mark.parametrize("dialect,sql,code,fragment", CASES,
                         ids=[f"{r[0]}-{r[2]}-{i}" for i, r in enumerate(CASES)])
def test_explain_names_the_reason_and_the_fragment(target, dialect, sql, code, fragment):
    if dialect == "sqlite":
        result = target.views.explain(sql)
        assert result["maintenance"] == "full", result
        reasons = result["reasons"]
        assert target.views.explain(sql, "incremental")["maintenance"] == "refused"
        if code == "WINDOW_FUNCTION":   # not taken for an unknown aggregate too
            assert {r["code"] for r in reasons} == {code}, reasons
    else:
        reasons = [r.as_dict() for r in analyse(sql, target.views.table_info, dialect="spark").reasons]
    fragments = [r["fragment"] for r in reasons if r["code"] == code]
    assert fragments, reasons
    assert any(fragment in f for f in fragments), (fragments, fragment)


def test_the_spark_dialect_reads_backslash_escapes_and_double_quoted_strings(target):
    sql = "SELECT id, amount FROM orders WHERE status <> 'it\\'s' AND status <> \"say \\\"hi\\\"\""
    analysis = analyse(sql, target.views.table_info, dialect="spark")
    assert (analysis.incremental, analysis.kind) == (True, "rows")
    assert analysis.where == "status <> 'it\\'s' AND status <> \"say \\\"hi\\\"\""
    with pytest.raises(UserError, match="unterminated string"):   # not SQLite's way of quoting
        analyse(sql, target.views.table_info)


INCREMENTAL = [
    ("SELECT id, amount FROM orders WHERE amount > 10", "rows", "orders(id)"),
    ("SELECT * FROM orders", "rows", "orders(id)"),
    ("SELECT cid, count(*), sum(amount), avg(amount), min(amount), max(amount), count(DISTINCT status),"
     " total(amount) FROM orders GROUP BY cid HAVING sum(amount) > 3", "aggregate", "cid"),
    ("SELECT DISTINCT status FROM orders", "distinct", "status"),
    ("SELECT o.id, c.name FROM orders o JOIN customers c ON c.id = o.cid", "rows", "o(id), c(id)"),
    ("SELECT r.zone, count(*) FROM orders o INNER JOIN customers c ON o.cid = c.id, regions r"
     " WHERE r.name = c.region GROUP BY r.zone", "aggregate", "r.zone"),
    ("SELECT id, amount FROM orders ORDER BY amount", "rows", "orders(id)"),
    ("select CID as k, COUNT(*) from main.ORDERS group by k", "aggregate", "CID"),
    ("SELECT cid, count(*) FILTER (WHERE amount > 2) AS big FROM orders GROUP BY cid"
     " HAVING sum(amount) FILTER (WHERE status = 'new') > 3", "aggregate", "cid"),
    ("SELECT k, first, last, count(*) FROM ranks GROUP BY k, first, last HAVING min(row) > 'r0'", "aggregate",
     "k, first, last"),
]


@pytest.mark.parametrize("sql,kind,keys", INCREMENTAL)
def test_explain_accepts_the_supported_shapes(target, sql, kind, keys):
    result = target.views.explain(sql, "incremental")
    assert result["maintenance"] == "incremental", result
    assert (result["kind"], result["keys"]) == (kind, keys)
    assert result["statements"]["incremental"]


@pytest.mark.parametrize("sql,root", [
    ("SELECT o.id, c.name FROM orders o JOIN customers c ON c.id = o.cid", "o"),
    ("SELECT c.name, o.amount FROM customers c JOIN orders o ON o.cid = c.id WHERE o.amount > 1", "o"),
    ("SELECT o.id, r.zone FROM orders o, customers c, regions r WHERE c.id = o.cid AND r.name = c.region", "o"),
    ("SELECT amount FROM orders WHERE status = 'new'", "orders"),
    # not one to one: joined on a column that is not the other's key; a table without a rowid key
    ("SELECT a.id, b.id FROM orders a JOIN orders b ON a.cid = b.cid", None),
    ("SELECT name, zone FROM regions", None),
    # planets.name is TEXT: compared with an INTEGER it is read as a number, '1' and '01' both match 1
    ("SELECT c.id, p.name FROM customers c JOIN planets p ON p.name = c.id", None),
])
def test_a_row_view_one_to_one_with_a_rowid_table_is_stored_by_its_rowid(target, sql, root):
    notes = target.views.explain(sql, "incremental")["notes"]
    stored = [n for n in notes if n.startswith("stored by the rowid of ")]
    assert stored == ([f"stored by the rowid of {root}: each row of the view is one row of orders"
                       " (the other tables join through their keys), updated in place"] if root else []), notes


def test_a_key_that_two_values_match_keeps_both_rows(target):
    """planets '1' and '01' both join customer 1: the view has two rows for it, maintained."""
    sql = "SELECT c.id, c.name, p.name AS planet FROM customers c JOIN planets p ON p.name = c.id"
    target.begin()
    target.upsert(CUSTOMERS, "R", [(1, "eu", "ann"), (2, "us", "bob")])
    target.upsert(PLANETS, "R", [("1",), ("01",), ("2",)])
    target.commit()
    target.views.create("moons", sql, "incremental")
    target.begin()
    target.upsert(CUSTOMERS, "U", [(1, "eu", "anne")])
    target.upsert(PLANETS, "U", [("001",)])
    target.delete(PLANETS, [("2",)])
    target.commit()
    assert sorted(target.db.execute("SELECT * FROM moons")) == [(1, "anne", "001"), (1, "anne", "01"),
                                                                 (1, "anne", "1")]
    assert view_differences(target.db, "moons", sql) is None


def test_explain_refuses_what_is_not_a_view(target):
    for sql, message in [("DELETE FROM orders", "a view is defined by a SELECT"),
                         ("SELECT 1; SELECT 2", "one SELECT statement"),
                         ("SELECT * FROM nowhere", "not a table of the target"),
                         ("SELECT nope FROM orders", "does not run on the target: no such column"),
                         ("SELECT id FROM orders WHERE id = ?", "parameters")]:
        with pytest.raises(UserError, match=message):
            target.views.explain(sql)


NOT_ONE_SELECT = [
    ("SELECT id FROM orders; DELETE FROM orders", "one SELECT statement, not several"),
    ("SELECT id FROM orders;\nATTACH DATABASE 'elsewhere.db' AS elsewhere", "one SELECT statement, not several"),
    ("SELECT id FROM orders -- the ids\n; PRAGMA writable_schema = 1", "one SELECT statement, not several"),
    # a ) closing the parenthesis a target wraps the query in: SELECT * FROM (query)
    ("SELECT id FROM orders) UNION SELECT id FROM (SELECT id FROM customers",
     "a ) that closes no parenthesis of its own (at: ) UNION SELECT id FROM (SELECT id FROM"),
    ("SELECT id FROM orders) AS x, (SELECT 1", "a ) that closes no parenthesis of its own"),
    ("SELECT id FROM orders WHERE (id > 1", "unbalanced parenthesis"),
    # a statement after common table expressions writes (Spark runs it when it is given)
    ("WITH x AS (SELECT id FROM orders) DELETE FROM orders WHERE id IN (SELECT id FROM x)",
     "a view is defined by a SELECT, not WITH ... DELETE"),
    ("WITH x AS (SELECT id FROM orders) INSERT INTO notes SELECT id, 'x' FROM x",
     "a view is defined by a SELECT, not WITH ... INSERT"),
    ("WITH x(a) AS (SELECT id FROM orders) UPDATE orders SET amount = 0", "not WITH ... UPDATE"),
    ("PRAGMA writable_schema = 1", "a view is defined by a SELECT, not PRAGMA"),
    ("ATTACH DATABASE 'elsewhere.db' AS elsewhere", "a view is defined by a SELECT, not ATTACH"),
    ("CREATE TABLE t AS SELECT id FROM orders", "a view is defined by a SELECT, not CREATE"),
]


@pytest.mark.parametrize("sql,message", NOT_ONE_SELECT)
def test_view_sql_that_is_not_one_select_is_refused_before_the_target_sees_it(target, sql, message):
    before = list(target.db.iterdump())
    statements: list[str] = []
    target.db.set_trace_callback(statements.append)
    for attempt in (lambda: target.views.create("v", sql), lambda: target.views.explain(sql)):
        with pytest.raises(UserError, match=re.escape(message)) as refused:
            attempt()
        assert "\n" not in str(refused.value)
    target.db.set_trace_callback(None)
    assert not [s for s in statements if sql[:20] in s], statements   # no statement of the target has it
    assert list(target.db.iterdump()) == before
    assert target.views.list() == []


@pytest.mark.parametrize("sql,message", [(sql, message) for sql, message in NOT_ONE_SELECT if "PRAGMA" not in sql]
                         + [("WITH x AS (SELECT 1 AS a) INSERT OVERWRITE DIRECTORY '/tmp/x' USING parquet"
                             " SELECT * FROM x", "not WITH ... INSERT")])
def test_spark_view_sql_that_is_not_one_select_is_refused_by_the_analysis(sql, message):
    """On a Delta warehouse the analysis is all that stands before spark.sql(), which
    runs a command (INSERT, even after WITH) as soon as it is given."""
    with pytest.raises(UserError, match=re.escape(message)):
        analyse(sql, lambda name: None, dialect="spark")


# Spark's lexer ends a -- comment at \r as well as \n, goes on past a backslash-newline, and
# nests /* */: each of these is an INSERT to Spark, text the analysis once took for a comment
# or a string (a SELECT).
SPARK_HIDDEN_STATEMENTS = [
    "-- x\rINSERT OVERWRITE DIRECTORY '/tmp/v' USING csv\nSELECT 1 AS a",
    "-- x\\\nSELECT \"\nINSERT OVERWRITE DIRECTORY '/tmp/v' USING csv SELECT 1 AS a --\"",
    "/* /* */ SELECT \"*/ INSERT OVERWRITE DIRECTORY '/tmp/v' USING csv SELECT 1 AS a --\"",
]


@pytest.mark.parametrize("sql", SPARK_HIDDEN_STATEMENTS, ids=["cr", "backslash-newline", "nested"])
def test_spark_view_sql_is_read_with_sparks_comment_rules(sql):
    with pytest.raises(UserError, match=re.escape("a view is defined by a SELECT, not INSERT")):
        analyse(sql, lambda name: None, dialect="spark")


def test_spark_view_sql_is_stored_and_run_without_its_comments(target):
    """Spark is given the tokens the analysis read and nothing else: comments (and hints)
    become spaces, the rest of the layout stays."""
    sql = ("SELECT id, /* the /* nested */ amount */ amount -- per order\r\n  FROM orders\t"
           "/*+ BROADCAST(orders) */ WHERE status <> '-- /* not a comment'\u00a0;  -- end")
    analysis = analyse(sql, target.views.table_info, dialect="spark")
    assert analysis.sql == "SELECT id, amount\nFROM orders WHERE status <> '-- /* not a comment'"
    assert (analysis.incremental, analysis.kind, analysis.where) == (True, "rows", "status <> '-- /* not a comment'")
    with pytest.raises(UserError, match="unterminated comment"):
        analyse("SELECT id FROM orders /* /* */", target.views.table_info, dialect="spark")


# What would let a Spark view do more than read the warehouse's tables.
SPARK_ESCAPES = [
    ("SELECT TRANSFORM(id) USING 'touch /tmp/pwned' AS (b) FROM orders", "cannot run a program"),
    ("SELECT TRANSFORM(id) ROW FORMAT DELIMITED USING \"sh -c 'id'\" FROM orders", "cannot run a program"),
    ("SELECT id, reflect('java.lang.System', 'getProperty', 'user.home') AS h FROM orders",
     "cannot call Java methods (reflect)"),
    ("SELECT id, `JAVA_METHOD`('java.lang.System', 'getProperty', 'user.home') AS h FROM orders",
     "cannot call Java methods (java_method)"),
    ("SELECT cid, max(try_reflect('java.lang.System', 'exit', 1)) FROM orders GROUP BY cid", "try_reflect"),
    ("SELECT * FROM csv.`/etc/passwd`", "not a path or another catalog's table: refused at csv.`/etc/passwd`"),
    ("SELECT o.id FROM orders o JOIN text.`/etc/passwd` p ON true", "refused at text.`/etc/passwd`"),
    ("SELECT id FROM orders, parquet.`/data/elsewhere`", "refused at parquet.`/data/elsewhere`"),
    ("SELECT id FROM orders WHERE status IN (SELECT value FROM text.`/etc/passwd`)",
     "refused at text.`/etc/passwd`"),
    ("SELECT * FROM parquet.orders", "refused at parquet.orders"),
    ("SELECT * FROM spark_catalog.default.orders", "refused at spark_catalog.default.orders"),
    ("SELECT * FROM IDENTIFIER('orders')", "not with IDENTIFIER(...)"),
]


@pytest.mark.parametrize("sql,message", SPARK_ESCAPES)
def test_spark_view_sql_that_runs_programs_calls_java_or_reads_files_is_refused(target, sql, message):
    with pytest.raises(UserError, match=re.escape(message)) as refused:
        analyse(sql, target.views.table_info, dialect="spark")
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("sql", [
    "SELECT id, transform(array(amount), x -> x + 1) AS more FROM orders",   # the function, not the script
    "SELECT id FROM orders WHERE cid IS DISTINCT FROM amount",
    "SELECT o.id, extract(YEAR FROM DATE '2020-01-02') AS y, trim(BOTH 'x' FROM o.status) AS s FROM orders o",
    "SELECT o.id, c.region FROM orders o JOIN customers c USING (id)",
    "SELECT id, map(1, 2) AS m, reflection FROM (SELECT id, 1 AS reflection FROM orders) AS s",
])
def test_spark_view_sql_with_words_like_those_still_reads(target, sql):
    analyse(sql, target.views.table_info, dialect="spark")


def test_view_sql_with_parentheses_semicolons_and_quotes_inside_strings_still_makes_views(target):
    sql = ("SELECT id, (amount + (1)) AS a, 'x); DROP TABLE orders; --' AS s, \"a)\" FROM"
           " (SELECT id, amount, status AS \"a)\" FROM orders) AS o WHERE (\"a)\" <> ')' OR \"a)\" IS NULL)")
    target.views.create("v", sql)
    assert view_differences(target.db, "v", sql) is None
    assert target.db.execute("SELECT count(*) FROM v").fetchone() == (300,)


# What reading the query's structure from sqlglot's tree changed ------------------------------

def test_a_value_in_a_table_is_a_subquery_and_the_view_follows_that_table(target):
    """SQLite's `x IN table` reads the table: the hand-written analysis took it for a
    column, kept the view incrementally, and missed the table's changes."""
    sql = "SELECT id, amount FROM orders WHERE status IN planets"
    reasons = target.views.explain(sql)["reasons"]
    assert [(r["code"], r["fragment"]) for r in reasons] == [("SUBQUERY", "status IN planets")]
    target.views.create("listed", sql)
    target.begin()
    target.upsert(PLANETS, "U", [("new",)])
    target.commit()
    assert view_differences(target.db, "listed", sql) is None
    assert target.db.execute("SELECT count(*) FROM listed").fetchone() == (100,)


def test_a_query_sqlglot_does_not_parse_is_refreshed_in_full(target):
    """A column named glob is SQLite's (its GLOB is a keyword it also takes for a name), not
    sqlglot's: the view is kept by full refreshes (UNREAD), as it was incrementally before."""
    patterns = table("patterns", [("id", "int", True), ("glob", "text", False)], ["id"], 10)
    target.begin()
    target.create_table(patterns)
    target.upsert(patterns, "R", [(1, "a*"), (2, None)])
    target.commit()
    sql = "SELECT id, glob FROM patterns WHERE glob IS NOT NULL"
    result = target.views.explain(sql)
    assert result["maintenance"] == "full" and [r["code"] for r in result["reasons"]] == ["UNREAD"], result
    assert "sqlglot" in result["reasons"][0]["message"]
    assert target.views.explain(sql, "incremental")["maintenance"] == "refused"
    target.views.create("globs", sql)
    target.begin()
    target.upsert(patterns, "U", [(2, "b?"), (3, "c")])
    target.commit()
    assert view_differences(target.db, "globs", sql) is None


@pytest.mark.parametrize("sql,code,fragment", [
    # once a one-line error (cannot read the view's FROM clause): now read
    ("SELECT o.id FROM orders o LEFT SEMI JOIN customers c ON c.id = o.cid", "OUTER_JOIN", "LEFT SEMI JOIN customers"),
    ("SELECT id FROM orders TABLESAMPLE (10 PERCENT)", "UNREAD", "TABLESAMPLE (10 PERCENT)"),
    ("SELECT id, v FROM orders LATERAL VIEW explode(array(1, 2)) e AS v", "UNREAD", "LATERAL VIEW explode"),
    ("SELECT id FROM orders DISTRIBUTE BY id", "UNREAD", "DISTRIBUTE BY id"),
    # once BARE_COLUMN
    ("SELECT cid, count(*) FROM orders GROUP BY ROLLUP(cid)", "UNREAD", "ROLLUP(cid)"),
    # once incremental: Spark reads `0 AS x1F` where sqlglot reads a hex number (their tokens differ)
    ("SELECT id, amount FROM orders WHERE amount > 0x1F", "UNREAD", "0x1F"),
])
def test_spark_sql_the_analysis_reads_now_or_leaves_to_full_refreshes(target, sql, code, fragment):
    reasons = analyse(sql, target.views.table_info, dialect="spark").reasons
    assert reasons and reasons[0].code == code and fragment in reasons[0].fragment, reasons


def test_null_safe_equalities_join_tables(target):
    """`IS NOT DISTINCT FROM` (and Spark's <=>) link two tables as `IS` does (once NO_EQUI_JOIN)."""
    sql = "SELECT o.id, c.name FROM orders o JOIN customers c ON c.id IS NOT DISTINCT FROM o.cid"
    assert target.views.explain(sql, "incremental")["maintenance"] == "incremental"
    target.views.create("paired", sql, "incremental")
    target.begin()
    target.upsert(ORDERS, "U", [(1, 4, 1, "new"), (2, None, 1, "new")])
    target.upsert(CUSTOMERS, "U", [(4, "eu", "four")])
    target.delete(CUSTOMERS, [(5,)])
    target.commit()
    assert view_differences(target.db, "paired", sql) is None
    spark = analyse("SELECT o.id, c.name FROM orders o JOIN customers c ON c.id <=> o.cid", target.views.table_info,
                    dialect="spark")
    assert (spark.incremental, spark.equi, spark.strict_equi) == (True, [((1, "id"), (0, "cid"))], [])


def test_a_scalar_max_of_group_columns_is_folded_with_the_aggregates(target):
    """max(cid, 0) is no aggregate: a GROUP BY expression to the fold (once not folded)."""
    sql = "SELECT cid, max(cid, 0) AS m, count(*) AS n FROM orders GROUP BY cid"
    notes = target.views.explain(sql, "incremental")["notes"]
    assert any(n.startswith("aggregates folded from state") for n in notes), notes
    target.views.create("bounded", sql, "incremental")
    target.begin()
    target.upsert(ORDERS, "U", [(1, -3, 5, "new"), (2, None, 1, "new")])
    target.delete(ORDERS, [(3,)])
    target.commit()
    assert view_differences(target.db, "bounded", sql) is None


def test_a_window_with_filter_is_named_whole_and_operators_are_not_columns(target):
    sql = "SELECT cid, count(*) FILTER (WHERE amount > 1) OVER (PARTITION BY cid) AS c FROM orders"
    reasons = target.views.explain(sql)["reasons"]
    assert [(r["code"], r["fragment"]) for r in reasons] == [
        ("WINDOW_FUNCTION", "count(*) FILTER (WHERE amount > 1) OVER (PARTITION BY cid)")]   # once from FILTER
    info = {"patterns": TableInfo("patterns", [("id", "INTEGER"), ("name", "TEXT"), ("glob", "TEXT")], ["id"], True)}
    a = analyse("SELECT id FROM patterns WHERE name GLOB 'x*'", info.get)
    assert (a.columns_read, a.columns_filtered) == ([{"id", "name"}], [{"name"}])   # once glob too


def test_spark_paths_are_refused_wherever_a_table_is_named():
    """(once only after FROM or JOIN: this comma join in a subquery was left to Spark's parse)"""
    sql = "SELECT id FROM orders WHERE status IN (SELECT name FROM customers, csv.`/etc/passwd`)"
    with pytest.raises(UserError, match=re.escape("refused at csv.`/etc/passwd`")):
        analyse(sql, lambda name: None, dialect="spark")
    # also where sqlglot does not read the query (0x1F: UNREAD), from the target's tokens alone
    sql = "SELECT id FROM orders o, csv.`/etc/passwd` p WHERE amount = 0x1F"
    with pytest.raises(UserError, match=re.escape("refused at csv.`/etc/passwd`")):
        analyse(sql, lambda name: None, dialect="spark")


def test_expressions_are_copied_as_written_not_as_sqlglot_writes_them(target):
    """sqlglot writes CAST(x AS NUMERIC) as CAST(x AS REAL) in SQLite (1 would become 1.0),
    and Spark's 'it''s' as CONCAT('it', 's') (its), so the generated statements copy the
    query's own text."""
    sql = "SELECT id, CAST(substr(status, 1, 0) || id AS NUMERIC) AS n, 'it''s' AS s FROM orders"
    assert analyse(sql, target.views.table_info).items == ["id", "CAST(substr(status, 1, 0) || id AS NUMERIC)",
                                                            "'it''s'"]
    target.views.create("numbers", sql, "incremental")
    target.begin()
    target.upsert(ORDERS, "U", [(1, 2, 3, "new")])
    target.commit()
    assert view_differences(target.db, "numbers", sql) is None
    assert target.db.execute("SELECT typeof(n) FROM numbers WHERE id = 1").fetchone() == ("integer",)
    spark = analyse("SELECT id, 'it''s' AS s FROM orders", target.views.table_info, dialect="spark")
    assert spark.items == ["id", "'it''s'"]


def test_what_sqlglot_logs_is_not_a_view_commands_output(replica):
    """sqlglot warns of a JSON path it does not parse (SQLite's '$[#-1]', the last element)."""
    created = cli("view", "create", "last", "--target", f"sqlite:{replica}", "--sql",
                  "SELECT id, json_extract('[1, 2]', '$[#-1]') AS last FROM orders")
    assert (created.returncode, created.stderr) == (0, ""), created
    assert created.stdout.strip() == "view last created: 300 rows, maintained incrementally"


# the commands --------------------------------------------------------------------------

def test_commands_create_explain_list_refresh_drop(replica):
    url = f"sqlite:{replica}"
    created = cli("view", "create", "per_customer", "--target", url, "--sql",
                  "SELECT cid, count(*) AS n, sum(amount) AS total FROM orders GROUP BY cid")
    assert created.returncode == 0, created.stderr
    assert created.stdout.strip() == "view per_customer created: 21 rows, maintained incrementally"
    created = cli("view", "create", "ranked", "--target", url, "--sql",
                  "SELECT id, rank() OVER (ORDER BY amount) AS r FROM orders")
    assert created.returncode == 0, created.stderr
    assert "refreshed in full after each batch (WINDOW_FUNCTION:" in created.stdout
    assert "(at: rank() OVER (ORDER BY amount))" in created.stdout

    explained = cli("view", "explain", "--target", url, "--sql",
                    "SELECT o.id FROM orders o LEFT JOIN customers c ON c.id = o.cid LIMIT 3")
    assert explained.returncode == 0, explained.stderr
    assert explained.stdout.splitlines() == [
        "not incremental: full refresh after each batch that changes its tables",
        "  LIMIT: LIMIT/OFFSET depend on rows outside the changed keys (at: LIMIT 3)",
        "  OUTER_JOIN: outer joins are not maintained incrementally (inner joins are) (at: LEFT JOIN customers)"]
    explained = cli("view", "explain", "per_customer", "--target", url)
    assert explained.stdout.splitlines()[0] == "incremental: aggregate view, maintained by key (cid)"
    as_json = json.loads(cli("view", "explain", "ranked", "--target", url, "--json").stdout)
    assert as_json["reasons"][0]["code"] == "WINDOW_FUNCTION"

    listed = json.loads(cli("view", "list", "--target", url, "--json").stdout)
    assert [(v["view"], v["maintenance"], v["reason"], v["rows"]) for v in listed] == [
        ("per_customer", "incremental", None, 21), ("ranked", "full", "WINDOW_FUNCTION", 300)]
    assert listed[1]["fragment"] == "rank() OVER (ORDER BY amount)"
    table = cli("view", "list", "--target", url)
    assert "per_customer" in table.stdout and "WINDOW_FUNCTION" in table.stdout

    refreshed = cli("view", "refresh", "per_customer", "--target", url)
    assert "is up to date" in refreshed.stdout
    refreshed = cli("view", "refresh", "per_customer", "--target", url, "--full")
    assert refreshed.stdout.strip() == "view per_customer recomputed: 21 rows"
    assert cli("view", "refresh", "ranked", "--target", url).stdout.strip() == "view ranked recomputed: 300 rows"

    assert cli("view", "drop", "ranked", "--target", url).stdout.strip() == "view ranked dropped"
    db = sqlite3.connect(replica)
    names = {n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE name LIKE '%ranked%'")}
    db.close()
    assert names == set()


@pytest.mark.parametrize("args,message", [
    (["view", "create", "v", "--target", "sqlite:/nonexistent/r.db", "--sql", "SELECT 1"], "error: no replica at"),
    (["view", "create", "v", "--target", "sqlite:{notes}", "--sql", "SELECT 1"], "(it is not a replica)"),
    (["view", "create", "v", "--target", "jsonl:-", "--sql", "SELECT 1"], "has no tables to define views on"),
    (["view", "create", "v", "--target", "delta:/nonexistent/w", "--sql", "SELECT 1"], "error: no warehouse at"),
    (["view", "create", "v", "--target", "{url}", "--sql", "SELEKT 1"], "a view is defined by a SELECT"),
    (["view", "create", "v", "--target", "{url}", "--sql", "SELECT * FROM nope"], "nope, which is not a table"),
    (["view", "create", "v", "--target", "{url}", "--sql", "SELECT nope FROM orders"], "no such column: nope"),
    (["view", "create", "orders", "--target", "{url}", "--sql", "SELECT id FROM orders"], "already has a table"),
    (["view", "create", "9v", "--target", "{url}", "--sql", "SELECT id FROM orders"], "invalid view name"),
    (["view", "create", "_replicator_x", "--target", "{url}", "--sql", "SELECT id FROM orders"], "reserved"),
    (["view", "create", "v", "--target", "{url}", "--policy", "incremental", "--sql",
      "SELECT id FROM orders LIMIT 1"], "cannot be maintained incrementally: LIMIT"),
    (["view", "create", "v", "--target", "{url}", "--sql", "@/nonexistent.sql"], "cannot read /nonexistent.sql"),
    (["view", "drop", "v", "--target", "{url}"], "no view 'v'"),
    (["view", "refresh", "v", "--target", "{url}"], "no view 'v'"),
    (["view", "explain", "--target", "{url}"], "name a view, or give the query with --sql"),
    (["view", "explain", "v", "--target", "{url}", "--sql", "SELECT id FROM orders"], "not both"),
    (["view", "create", "v", "--target", "{url}", "--sql", "@"], "--sql @ needs a file name"),
    (["view", "create", "v", "--target", "{url}", "--policy", "full", "--sql",
      "SELECT id, json_extract(status, '$.a') AS a FROM orders"],
     "error: view v not created: its query fails on the target: malformed JSON"),
])
def test_command_errors_are_one_line_and_exit_1(replica, args, message):
    notes = replica.parent / "notes.db"   # a SQLite file no consumer wrote
    with closing(sqlite3.connect(notes)) as db:
        db.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY)")
    result = cli(*[a.replace("{url}", f"sqlite:{replica}").replace("{notes}", str(notes)) for a in args])
    assert result.returncode == 1, result
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    assert message in result.stderr, result.stderr
    assert not Path("/nonexistent/r.db").exists()
    with closing(sqlite3.connect(notes)) as db:   # left as it was
        assert db.execute("SELECT name FROM sqlite_master").fetchall() == [("notes",)]
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "delete"


@pytest.mark.parametrize("policy", ["full", "incremental", "auto"])
def test_a_query_ending_in_a_semicolon_or_a_comment_makes_a_view(replica, policy):
    url = f"sqlite:{replica}"
    query = "SELECT id, amount FROM orders WHERE amount > 10"
    endings = [";", " -- the large ones", " ;\n-- the large ones\n", "\n/* large */;;"]
    for n, ending in enumerate(endings):
        created = cli("view", "create", f"v{n}", "--target", url, "--policy", policy, "--sql", query + ending)
        assert created.returncode == 0, created.stderr
    t = open_target(replica)
    try:
        assert {v["sql"] for v in t.views.list()} == {query}   # stored as it runs
        t.begin()
        t.upsert(ORDERS, "U", [(1, 2, 49, "new"), (2, 2, 1, "new")])
        t.commit()
        for n in range(len(endings)):
            assert view_differences(t.db, f"v{n}", query) is None
    finally:
        t.close()


def test_a_query_that_fails_on_the_rows_is_refused_at_create_and_leaves_nothing(target):
    sql = "SELECT id, json_extract(status, '$.a') AS a FROM orders"   # 'new' is not JSON
    before = target.db.execute("SELECT count(*) FROM sqlite_master").fetchone()
    for policy in ("full", "incremental"):
        with pytest.raises(UserError, match=r"^view v not created: its query fails on the target: malformed JSON$"):
            target.views.create("v", sql, policy)
    assert target.views.list() == []
    assert target.db.execute("SELECT count(*) FROM sqlite_master").fetchone() == before


def test_create_twice_and_a_view_others_read(target):
    target.views.create("per_customer", "SELECT cid, count(*) AS n FROM orders GROUP BY cid")
    with pytest.raises(UserError, match="exists: drop it first"):
        target.views.create("PER_customer", "SELECT 1 FROM orders")
    # a view over a view: refreshed in full, after the one it reads
    info = target.views.create("busiest", "SELECT max(n) AS most, count(*) AS customers FROM per_customer")
    assert (info["maintenance"], info["reason"]) == ("full", "NOT_REPLICATED")
    with pytest.raises(UserError, match="read by view"):
        target.views.drop("per_customer")
    target.begin()
    target.upsert(ORDERS, "U", [(i, 5, 1, "new") for i in range(1, 120)])
    target.commit()
    for name, sql in [("per_customer", "SELECT cid, count(*) AS n FROM orders GROUP BY cid"),
                      ("busiest", "SELECT max(n) AS most, count(*) AS customers FROM per_customer")]:
        assert view_differences(target.db, name, sql) is None
    assert target.db.execute("SELECT most FROM busiest").fetchone()[0] == \
        target.db.execute("SELECT count(*) FROM orders WHERE cid = 5").fetchone()[0]


def test_policies_and_the_auto_threshold(target, monkeypatch):
    sql = "SELECT cid, count(DISTINCT amount) AS amounts FROM orders GROUP BY cid"   # groups recomputed
    for policy in ("auto", "incremental", "full"):
        target.views.create(f"v_{policy}", sql, policy)
    folded = "SELECT cid, sum(amount) AS total FROM orders GROUP BY cid"
    target.views.create("folded_auto", folded, "auto")

    def last() -> dict[str, tuple[str, str]]:
        return {v["view"]: (v["last_refresh"]["kind"], v["last_refresh"]["reason"]) for v in target.views.list()}

    target.begin()
    target.upsert(ORDERS, "U", [(1, 3, 7, "new")])       # 2 of 21 groups
    target.commit()
    assert last() == {"v_auto": ("incremental", ""), "v_incremental": ("incremental", ""),
                      "v_full": ("full", "POLICY_FULL"), "folded_auto": ("incremental", "")}
    target.begin()
    target.upsert(ORDERS, "U", [(i, i % 19, 7, "new") for i in range(1, 60)])   # every group
    target.commit()
    kinds = last()
    assert kinds["v_auto"][0] == "full" and kinds["v_auto"][1].startswith("THRESHOLD: 21 of 21 keys")
    assert kinds["v_incremental"] == ("incremental", "")
    # folded, every group costs what the batch's rows cost: still incremental
    assert kinds["folded_auto"] == ("incremental", "")
    assert target.views.refreshes("folded_auto")[0]["keys"] == 21
    target.begin()
    target.delete(ORDERS, [(i,) for i in range(1, 60) if i % 19 in (2, 3)])   # groups 2 and 3 emptied
    target.upsert(ORDERS, "U", [(i, i % 19, 7.5, "new") for i in range(1, 60) if i % 19 > 3])  # not integers
    target.commit()
    kinds = last()     # groups whose sum is no longer an exact integer are recomputed from their rows
    assert kinds["folded_auto"][0] == "full" and kinds["folded_auto"][1].startswith("THRESHOLD: 15 of 21 groups")
    monkeypatch.setattr(views_auto, "AUTO_FULL_SHARE", 1.0)
    target.begin()
    target.upsert(ORDERS, "U", [(i, i % 19, 8, "new") for i in range(1, 60)])
    target.commit()
    assert last()["v_auto"] == ("incremental", "")
    assert view_differences(target.db, "folded_auto", folded) is None
    target.begin()
    target.upsert(PLANETS, "U", [("mars",)])    # no view reads it: nothing recorded
    target.commit()
    target.begin()
    target.upsert(ORDERS, "U", [(1000, None, 1, "void")])
    target.delete(ORDERS, [(1000,)])           # in and out in one batch: recomputed, no change
    target.commit()
    for policy in ("auto", "incremental", "full"):
        assert view_differences(target.db, f"v_{policy}", sql) is None
    assert view_differences(target.db, "folded_auto", folded) is None
    log = target.views.refreshes("folded_auto")
    assert [r["kind"] for r in log[:2]] == ["incremental", "incremental"]
    # order 1000 in and out of the NULL group: folded, the group's row is left as it was
    assert log[0]["keys"] == 1 and (log[0]["rows_deleted"], log[0]["rows_inserted"], log[0]["rows_updated"]) == (0, 0, 0)


def test_a_group_that_loses_its_min_or_max_reads_the_new_one_from_the_replica_and_stays_folded(target):
    sql = ("SELECT cid, count(*) AS n, min(amount) AS lo, max(amount) AS hi FROM orders"
           " WHERE status IS NOT 'paid' GROUP BY cid")
    target.views.create("extremes", sql, "incremental")
    # each group gets an extreme of its own, then loses it
    target.begin()
    target.upsert(ORDERS, "U", [(1000, 3, -100, "new"), (1001, 4, 1000, None), (1002, None, -100, "new")])
    target.commit()

    def generations() -> dict[int | None, int]:
        return dict(target.db.execute("SELECT _replicator_k0, _replicator_gen FROM _replicator_mv_extremes"
                                      " WHERE _replicator_k0 IN (3, 4) OR _replicator_k0 IS NULL"))

    before = generations()
    target.begin()
    target.delete(ORDERS, [(1000,)])
    target.upsert(ORDERS, "U", [(1001, 4, 5, None), (1002, None, 7, "new")])
    target.commit()
    assert view_differences(target.db, "extremes", sql) is None
    assert dict(target.db.execute("SELECT cid, lo FROM extremes WHERE cid = 3 OR cid IS NULL")) == {
        cid: target.db.execute("SELECT min(amount) FROM orders WHERE cid IS ? AND status IS NOT 'paid'",
                               (cid,)).fetchone()[0] for cid in (3, None)}
    assert target.db.execute("SELECT hi FROM extremes WHERE cid = 4").fetchone()[0] < 1000
    last = target.views.refreshes("extremes")[0]
    assert last["kind"] == "incremental" and last["keys"] == 3 and last["rows_updated"] == 3
    # folded: a group recomputed from its rows would carry this refresh's generation
    assert generations() == before


def test_a_fold_whose_table_is_aliased_like_its_own_names_reads_each_group_alone(target):
    # the fold names the batch's groups d and their keys k0...: a base table aliased d with
    # a column k0 must not capture those names in the lookup of a lost min or max
    pairs = table("pairs", [("id", "int", True), ("k0", "int", False), ("x", "int", False)], ["id"], 9)
    target.begin()
    target.create_table(pairs)
    target.upsert(pairs, "R", [(i, i % 3, i) for i in range(1, 31)])
    target.commit()
    sql = "SELECT d.k0, min(d.x) AS lo, max(d.x) AS hi FROM pairs AS d GROUP BY d.k0"
    target.views.create("spread", sql, "incremental")
    target.begin()
    target.delete(pairs, [(1,), (30,)])    # group 1's min, group 0's max
    target.commit()
    assert view_differences(target.db, "spread", sql) is None


def test_a_view_whose_statements_do_not_prepare_is_refreshed_in_full_and_correct(target):
    # `c` in WHERE is an alias of the select list: the generated statements do not prepare
    sql = "SELECT cid AS c, min(amount) AS lo, count(*) AS n FROM orders WHERE c > 3 GROUP BY cid"
    info = target.views.create("aliased", sql, "auto")
    assert (info["maintenance"], info["reason"]) == ("full", "REWRITE")
    target.begin()
    target.upsert(ORDERS, "U", [(1, 5, -7, "new")])
    target.commit()
    assert view_differences(target.db, "aliased", sql) is None


def test_indexes_dropped_by_another_connection_are_made_again_at_the_next_batch(target, replica, caplog):
    grouped = "SELECT cid, count(*) AS n, min(amount) AS lo FROM orders GROUP BY cid"
    paired = "SELECT o.id, c.name FROM orders o JOIN customers c ON c.region = o.status"   # no root: keyed
    target.views.create("grouped", grouped, "incremental")
    target.views.create("paired", paired, "incremental")

    def indexes() -> dict[str, str]:
        return dict(target.db.execute("SELECT name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL"))

    made = indexes()
    assert {"_replicator_mv_grouped_k", "_replicator_mv_paired_k", "_replicator_mv_paired_k1"} <= set(made)
    assert any(n.startswith(INDEX_PREFIX) for n in made)
    other = sqlite3.connect(replica)
    for name in made:
        other.execute(f'DROP INDEX "{name}"')
    other.commit()
    other.close()
    with caplog.at_level(logging.WARNING, logger="replicator"):
        target.begin()
        target.upsert(ORDERS, "U", [(1, 2, -5, "paid"), (2, 2, 99, "eu")])
        target.commit()
    assert indexes() == made
    assert "made its dropped indexes again" in caplog.text
    for name, sql in (("grouped", grouped), ("paired", paired)):
        assert view_differences(target.db, name, sql) is None
    plan = target.db.execute("EXPLAIN QUERY PLAN SELECT min(amount) FROM orders WHERE cid = 2").fetchall()
    assert "USING COVERING INDEX" in " ".join(r[3] for r in plan)
    # the storage itself dropped by hand: the batch commits, the view is marked stale
    other = sqlite3.connect(replica)
    other.execute('DROP VIEW "grouped"')
    other.execute('DROP TABLE "_replicator_mv_grouped"')
    other.commit()
    other.close()
    target.begin()
    target.upsert(ORDERS, "U", [(3, 2, 1, "paid")])
    target.commit()
    assert target.db.execute("SELECT amount FROM orders WHERE id = 3").fetchone()[0] == 1
    assert {v["view"]: v["status"] for v in target.views.list()} == {"grouped": "stale", "paired": "ok"}
    assert view_differences(target.db, "paired", paired) is None


def test_the_refresh_log_keeps_the_last_records_and_those_auto_learns_from(target, monkeypatch):
    monkeypatch.setattr(views_catalog, "KEEP_REFRESHES", 5)
    target.views.create("v", "SELECT id, amount FROM orders WHERE amount > 10", "incremental")
    for seq in (2, 3):    # incremental refreshes of enough keys to learn a cost per key from
        target.db.execute("INSERT INTO _replicator_view_refresh VALUES ('v', ?, '', 'incremental', '', 100,"
                          " 0, 0, 100, 0.01)", (seq,))
    target.db.execute("UPDATE _replicator_views SET seq = 3 WHERE name = 'v'")
    for i in range(12):
        target.begin()
        target.upsert(ORDERS, "U", [(1, 2, i, "new")])
        target.commit()
    log = target.views.refreshes("v", 100)
    assert [r["seq"] for r in log] == [15, 14, 13, 12, 11, 3, 2, 1]
    assert (log[-1]["kind"], log[-1]["reason"]) == ("full", "CREATE")


def test_auto_learns_the_cost_of_keys_however_many_small_refreshes_ago(target):
    sql = "SELECT o.id, o.amount, c.name FROM orders o JOIN customers c ON c.id = o.cid"
    target.views.create("lines", sql, "auto")
    # two incremental refreshes of 100 keys at 10 ms a key, then 40 of one key each
    records = [(seq, 100, 1.0) for seq in (2, 3)] + [(seq, 1, 0.0001) for seq in range(4, 44)]
    target.db.executemany("INSERT INTO _replicator_view_refresh VALUES ('lines', ?, '', 'incremental', '', ?,"
                          " 0, 0, 1, ?)", records)
    target.db.execute("UPDATE _replicator_views SET seq = 43 WHERE name = 'lines'")
    target.begin()
    target.upsert(ORDERS, "U", [(1, 2, 40, "new"), (2, 3, 41, "new")])
    target.commit()
    last = target.views.refreshes("lines")[0]
    assert last["kind"] == "full" and last["reason"].startswith("COST: about 2 keys at 10000 µs"), last
    assert view_differences(target.db, "lines", sql) is None


def test_a_refresh_that_fails_marks_the_view_stale_and_the_batch_commits(target):
    target.views.create("absolute", "SELECT id, abs(amount) AS a FROM orders", "incremental")
    target.views.create("fine", "SELECT cid, count(*) AS n FROM orders GROUP BY cid", "incremental")
    target.views.create("total", "SELECT cid, sum(abs(amount)) AS s FROM orders GROUP BY cid", "incremental")
    before = {name: sorted(target.db.execute(f"SELECT * FROM {name}"), key=repr) for name in ("absolute", "total")}
    target.begin()
    target.upsert(ORDERS, "U", [(5, 1, -9223372036854775808, "new"), (6, 1, 1, "new")])   # abs() overflows
    target.commit()
    state = {v["view"]: (v["status"], v["status_reason"]) for v in target.views.list()}
    assert state["absolute"][0] == "stale" and "integer overflow" in state["absolute"][1]
    assert state["total"][0] == "stale" and "integer overflow" in state["total"][1]
    # stale views are left as they were: row 6's change is not half applied
    assert {name: sorted(target.db.execute(f"SELECT * FROM {name}"), key=repr) for name in before} == before
    assert state["fine"] == ("ok", None)
    assert target.db.execute("SELECT amount FROM orders WHERE id = 5").fetchone() == (-9223372036854775808,)
    assert view_differences(target.db, "fine", "SELECT cid, count(*) AS n FROM orders GROUP BY cid") is None
    target.begin()
    target.upsert(ORDERS, "U", [(5, 1, 5, "new")])
    target.commit()
    info, recomputed = target.views.refresh_now("absolute")
    assert recomputed and info["status"] == "ok"
    assert view_differences(target.db, "absolute", "SELECT id, abs(amount) AS a FROM orders") is None


def test_a_copy_that_fails_fails_the_batch_whole(target):
    """A rooted view computes its rows into TEMP, then copies them without a savepoint: a
    copy can fail only on I/O (here: refused by an authorizer), and then the commit fails,
    the batch rolls back, nothing is marked stale."""
    target.views.create("plain", "SELECT id, amount FROM orders", "incremental")
    before = (sorted(target.db.execute("SELECT * FROM orders"), key=repr),
              sorted(target.db.execute("SELECT * FROM plain"), key=repr))

    def refuse_view_writes(action, arg1, arg2, dbname, source):
        writes = (sqlite3.SQLITE_INSERT, sqlite3.SQLITE_UPDATE, sqlite3.SQLITE_DELETE)
        return sqlite3.SQLITE_DENY if action in writes and arg1 == "_replicator_mv_plain" else sqlite3.SQLITE_OK

    target.begin()
    target.upsert(ORDERS, "U", [(1, 1, 99, "new")])
    target.db.set_authorizer(refuse_view_writes)
    with pytest.raises(sqlite3.DatabaseError, match="not authorized"):
        target.commit()
    target.db.set_authorizer(None)
    target.rollback()
    assert (sorted(target.db.execute("SELECT * FROM orders"), key=repr),
            sorted(target.db.execute("SELECT * FROM plain"), key=repr)) == before
    assert [(v["status"], v["last_refresh"]["kind"]) for v in target.views.list()] == [("ok", "full")]


CRASHER = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, sys.argv[2])
    from pathlib import Path
    from views_helpers import open_target
    from test_views import ORDERS, CUSTOMERS
    t = open_target(Path(sys.argv[1]))
    t.begin()
    t.upsert(ORDERS, "U", [(i, 1, 1, "crash") for i in range(1, 100)])
    t.upsert(CUSTOMERS, "U", [(1, "crash", "crash")])
    t.views.before_commit()           # every view refreshed, in the transaction
    os._exit(9)                       # and the process dies before COMMIT
""")


def test_a_crash_after_the_refresh_before_the_commit_leaves_rows_and_views_as_they_were(replica):
    views = {"per_customer": "SELECT cid, count(*) AS n FROM orders GROUP BY cid",
             "lines": "SELECT o.id, c.name FROM orders o JOIN customers c ON c.id = o.cid"}
    t = open_target(replica)
    for name, sql in views.items():
        t.views.create(name, sql, "incremental")
    before = {name: sorted(t.db.execute(f"SELECT * FROM {name}").fetchall(), key=repr) for name in views}
    t.close()
    crashed = subprocess.run([sys.executable, "-c", CRASHER, str(replica), str(Path(__file__).parent)],
                             capture_output=True, text=True, timeout=60)
    assert crashed.returncode == 9, crashed.stderr
    t = open_target(replica)
    assert t.db.execute("SELECT count(*) FROM orders WHERE status = 'crash'").fetchone() == (0,)
    for name, sql in views.items():
        assert sorted(t.db.execute(f"SELECT * FROM {name}").fetchall(), key=repr) == before[name]
        assert view_differences(t.db, name, sql) is None
    # the same changes, now committed by a new connection (new TEMP triggers)
    t.begin()
    t.upsert(ORDERS, "U", [(i, 1, 1, "crash") for i in range(1, 100)])
    t.upsert(CUSTOMERS, "U", [(1, "crash", "crash")])
    t.commit()
    for name, sql in views.items():
        assert view_differences(t.db, name, sql) is None
    assert {v["last_refresh"]["kind"] for v in t.views.list()} == {"incremental"}
    t.close()


def test_views_are_planned_once_per_create_and_again_only_when_the_catalog_changed(replica, monkeypatch):
    """Planning a view parses and analyses its query: n views created on one connection, or a
    batch rolled back, must not plan every view again; a create rolled back at its commit must."""
    from replicator.targets.sqlite.views import sqlite_views
    planned: list[str] = []
    real_plan = sqlite_views.plan_view
    monkeypatch.setattr(sqlite_views, "plan_view", lambda db, capture, name, sql, policy: (
        planned.append(name), real_plan(db, capture, name, sql, policy))[1])
    views = {"per_customer": "SELECT cid, count(*) AS n FROM orders GROUP BY cid",
             "lines": "SELECT o.id, c.name FROM orders o JOIN customers c ON c.id = o.cid",
             "statuses": "SELECT DISTINCT status FROM orders"}
    target = open_target(replica)
    for name, sql in views.items():
        target.views.create(name, sql, "incremental")
    assert planned == list(views)
    for outcome in ("rollback", "commit"):
        target.begin()
        target.upsert(ORDERS, "U", [(1, 2, 3, outcome)])
        getattr(target, outcome)()
    assert planned == list(views)
    # a restarted consumer's first batch plans the views and makes their TEMP tables in its
    # transaction: rolled back, they are gone, and the next batch makes them again
    target.close()
    target = open_target(replica)
    for outcome in ("rollback", "commit"):
        target.begin()
        target.upsert(ORDERS, "U", [(1, 2, 3, outcome)])
        target.upsert(CUSTOMERS, "U", [(2, "eu", outcome)])
        getattr(target, outcome)()
    assert sorted(planned) == sorted([*views, *views])
    assert target.db.execute("SELECT status FROM orders WHERE id = 1").fetchone() == ("commit",)
    for name, sql in views.items():
        assert view_differences(target.db, name, sql) is None
    # the plans held include a view whose create did not commit: planned again from the catalog
    def commit_fails() -> None:
        raise sqlite3.OperationalError("disk I/O error")
    target.views.before_commit = commit_fails
    with pytest.raises(UserError, match="disk I/O error"):
        target.views.create("ids", "SELECT id FROM orders", "incremental")
    del target.views.before_commit
    planned.clear()
    target.begin()
    target.upsert(ORDERS, "U", [(2, 2, 3, "after")])
    target.commit()
    assert sorted(planned) == sorted(views) and "ids" not in [v["view"] for v in target.views.list()]
    for name, sql in views.items():
        assert view_differences(target.db, name, sql) is None
    target.close()


def test_schema_changes_through_the_target_api(target):
    """The hooks the consumer's schema changes go through: add, rename and drop of
    columns (DROP COLUMN must not be blocked by the capture triggers or the helper
    indexes), a table copied again, truncated, dropped."""
    from replicator.structure import Change, Column
    views = {"per_customer": "SELECT cid, count(*) AS n, sum(amount) AS s FROM orders GROUP BY cid",
             "lines": "SELECT o.id, o.status, c.name FROM orders o JOIN customers c ON c.id = o.cid"}
    for name, sql in views.items():
        target.views.create(name, sql, "incremental")

    def state() -> dict[str, str]:
        return {v["view"]: v["status"] for v in target.views.list()}

    new_col = Column(name="note", type="text", base_type="text", category="S", not_null=False, attnum=5)
    wider = table("orders", [("id", "int", True), ("cid", "int", False), ("amount", "int", False),
                             ("status", "text", False), ("note", "text", False)], ["id"], 1)
    target.begin()
    target.alter_table(ORDERS, wider, [Change("add_column", name="note", column=new_col)])
    target.upsert(wider, "U", [(1, 7, 1, "x", "n")])
    target.commit()
    assert state() == {"per_customer": "ok", "lines": "ok"}
    for name, sql in views.items():
        assert view_differences(target.db, name, sql) is None
    # drop a column the aggregate reads (amount): it is indexed by the view's helper index
    narrow = table("orders", [("id", "int", True), ("cid", "int", False), ("status", "text", False),
                              ("note", "text", False)], ["id"], 1)
    target.begin()
    target.alter_table(wider, narrow, [Change("drop_column", name="amount")])
    target.upsert(narrow, "U", [(2, 7, "y", "m")])
    target.commit()
    assert state() == {"per_customer": "stale", "lines": "ok"}
    reason = next(v["status_reason"] for v in target.views.list() if v["view"] == "per_customer")
    assert "amount" in reason and reason.startswith("SCHEMA_CHANGE")
    assert view_differences(target.db, "lines", views["lines"]) is None
    # the incremental machinery still runs for the other view
    target.begin()
    target.upsert(narrow, "U", [(3, 2, "z", "m")])
    target.truncate(CUSTOMERS)
    target.upsert(CUSTOMERS, "U", [(2, "eu", "back")])
    target.commit()
    assert view_differences(target.db, "lines", views["lines"]) is None
    assert target.views.refreshes("lines")[0]["reason"] == "TRUNCATE"
    target.begin()
    target.upsert(narrow, "U", [(4, 2, "z", "m")])
    target.commit()
    assert target.views.refreshes("lines")[0]["kind"] == "incremental"
    # the customers table copied again (same name): re-validated, refreshed in full
    target.begin()
    target.create_table(CUSTOMERS)
    target.upsert(CUSTOMERS, "R", [(2, "us", "again")])
    target.commit()
    assert target.views.refreshes("lines")[0]["reason"] == "SCHEMA_CHANGE"
    assert view_differences(target.db, "lines", views["lines"]) is None
    target.begin()
    target.drop_table(CUSTOMERS)
    target.commit()
    assert state()["lines"] == "stale"


def test_auto_learns_the_cost_of_keys_from_its_refresh_log(target):
    sql = "SELECT o.id, o.amount, c.name FROM orders o JOIN customers c ON c.id = o.cid"
    target.views.create("lines", sql, "auto")
    full = target.views.refreshes("lines")[0]["seconds"]
    # two incremental refreshes of 100 keys at 10 ms a key: far dearer than the full refresh
    for seq in (100, 101):
        target.db.execute("INSERT INTO _replicator_view_refresh VALUES ('lines', ?, '', 'incremental', '', 100,"
                          " 0, 0, 100, 1.0)", (seq,))
    target.db.execute("UPDATE _replicator_views SET seq = 101 WHERE name = 'lines'")
    target.begin()
    target.upsert(ORDERS, "U", [(1, 2, 40, "new"), (2, 3, 41, "new")])
    target.commit()
    last = target.views.refreshes("lines")[0]
    assert last["kind"] == "full" and last["reason"].startswith("COST: about 2 keys at 10000 µs"), (last, full)
    assert view_differences(target.db, "lines", sql) is None


def test_auto_weighs_only_the_cost_left_once_the_keys_are_found():
    """Keys found through a join can be many more than the rows changed: when the
    search says so, what it took is spent whichever way auto goes."""
    costs = (0.001, 1.0)                # 1 ms a key, 1 s a full refresh
    decide = views_auto.says_full
    assert decide(costs, 800, 800, 0, "keys") is not None                      # 0.8 s predicted: full
    searched_for = time.perf_counter() - 0.3                                   # 0.3 s of it spent already
    assert decide(costs, 800, 800, 0, "keys", searched_for) is None            # 0.5 s left: incremental
    assert decide(costs, 1200, 1200, 0, "keys", searched_for) is not None     # 0.9 s left: full
