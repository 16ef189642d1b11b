"""The documented PostgreSQL types (the type tables of docs/delta.md and docs/sqlite.md): a table t of
every one, its values, and the changes that carry them through the queue; the targets' type
tests (test_delta_types.py, test_types_sqlite.py) replicate it and compare it with the source
rendered as each target's docs say.
"""

from __future__ import annotations

import re

import psycopg

TYPES_SETUP = """
    CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
    CREATE TYPE pair AS (a int, b text);
    CREATE DOMAIN positive AS integer CHECK (VALUE > 0);
    CREATE DOMAIN amount AS numeric(12,2);
"""
RENDERED = "CASE WHEN {0} IS NOT NULL THEN format('%s', {0}) END"   # PostgreSQL's text: its output function's (inet's ::text differs)
ROWS = 3   # each type's values: one a row, the copy's rows 1..3, the events' rows 4..6

# (column, PostgreSQL type, Delta type, its values (SQL), the value the Delta table holds (SQL over {}))
TYPES: list[tuple[str, str, str, list[str], str]] = [
    ("i2", "smallint", "short", ["-32768", "32767", "NULL"], "{}"),
    ("i4", "integer", "integer", ["-2147483648", "2147483647", "0"], "{}"),
    ("i8", "bigint", "long", ["-9223372036854775808", "9223372036854775807", "NULL"], "{}"),
    ("o", "oid", "long", ["0", "4294967295", "5"], "{}::bigint"),
    ("x", "xid", "long", ["'0'", "'4294967295'", "'5'"], "{}::text::bigint"),
    ("c", "cid", "long", ["'0'", "'4294967295'", "NULL"], "{}::text::bigint"),
    ("x8", "xid8", "string", ["'0'", "'18446744073709551615'", "'5'"], RENDERED),
    ("pos", "positive", "integer", ["1", "2147483647", "NULL"], "{}"),
    ("flag", "boolean", "boolean", ["true", "false", "NULL"], "{}"),
    ("r", "real", "float", ["1.5", "'NaN'", "'-Infinity'"], "{}"),
    ("f", "double precision", "double", ["'Infinity'", "'NaN'", "-0.000001"], "{}"),
    ("blob", "bytea", "binary", ["'\\x00ff'", "''", "NULL"], "{}"),
    ("d", "date", "date", ["'2024-02-29'", "'-infinity'", "'0044-03-15 BC'"],
     "CASE WHEN {0} IS NULL THEN NULL WHEN {0} < '0001-01-01' AND isfinite({0}) THEN NULL WHEN isfinite({0}) THEN {0}"
     " WHEN {0} > 'epoch' THEN '9999-12-31'::date ELSE '0001-01-01'::date END"),
    ("ts", "timestamp", "timestamp_ntz", ["'2024-01-02 03:04:05.123456'", "'infinity'", "'10000-01-01'"],
     "CASE WHEN {0} IS NULL THEN NULL WHEN {0} > '9999-12-31 23:59:59.999999' AND isfinite({0}) THEN NULL WHEN isfinite({0}) THEN {0}"
     " WHEN {0} > 'epoch' THEN '9999-12-31 23:59:59.999999'::timestamp ELSE '0001-01-01'::timestamp END"),
    ("tstz", "timestamptz", "timestamp", ["'2024-01-02 05:04:05.5+02'", "'-infinity'", "NULL"],
     "CASE WHEN {0} IS NULL THEN NULL WHEN isfinite({0}) THEN {0} WHEN {0} > 'epoch' THEN '9999-12-31 23:59:59.999999+00'::timestamptz"
     " ELSE '0001-01-01 00:00+00'::timestamptz END"),
    ("t", "time", "string", ["'12:34:56.789'", "'24:00:00'", "'00:00:00'"], RENDERED),
    ("ttz", "timetz", "string", ["'12:34:56+02'", "'03:04:05.1-00:00:12'", "'23:59:59.999999-08'"], RENDERED),
    ("n", "numeric(12,2)", "decimal(12,2)", ["-9999999999.99", "'NaN'", "0.5"], "NULLIF({}, 'NaN')"),
    ("n38", "numeric(38,0)", "decimal(38,0)", ["99999999999999999999999999999999999999", "-1", "NULL"], "{}"),
    ("nu", "numeric", "string", ["0.10", "'NaN'", "'-Infinity'"], RENDERED),
    ("n40", "numeric(40,2)", "string", ["12345678901234567890123456789012345678.50", "1", "NULL"], RENDERED),
    ("nneg", "numeric(5,-2)", "string", ["1234567", "-50", "NULL"], RENDERED),
    ("amt", "amount", "string", ["1.50", "'NaN'", "NULL"], RENDERED),
    ("m", "money", "string", ["12.34", "-0.01", "NULL"], RENDERED),
    ("txt", "text", "string", ["E'tab\\there, new\\nline, \u00fcn\u00efc\u00f8d\u00e9'", "''", "NULL"], "{}"),
    ("vc", "varchar(5)", "string", ["'abc'", "''", "NULL"], "{}"),
    ("ch", "char(3)", "string", ["'a'", "'abc'", "NULL"], RENDERED),
    ("qc", '"char"', "string", ["'x'", "NULL", "'y'"], RENDERED),
    ("nm", "name", "string", ["'pg_class'", "'x'", "NULL"], RENDERED),
    ("u", "uuid", "string", ["'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'", "NULL", "gen_random_uuid()"], RENDERED),
    ("iv", "interval", "string", ["'1 year 2 mons 3 days 04:05:06.7'", "'-1 day'", "NULL"], RENDERED),
    ("ip", "inet", "string", ["'192.168.0.1/24'", "'::1'", "NULL"], RENDERED),
    ("net", "cidr", "string", ["'10.0.0.0/8'", "'2001:db8::/32'", "NULL"], RENDERED),
    ("mac", "macaddr", "string", ["'08:00:2b:01:02:03'", "NULL", "'ff:ff:ff:ff:ff:ff'"], RENDERED),
    ("mac8", "macaddr8", "string", ["'08:00:2b:01:02:03:04:05'", "NULL", "NULL"], RENDERED),
    ("b4", "bit(4)", "string", ["B'1010'", "B'0000'", "NULL"], RENDERED),
    ("vb", "varbit", "string", ["B'0011'", "B''", "NULL"], RENDERED),
    ("e", "mood", "string", ["'happy'", "'sad'", "NULL"], RENDERED),
    ("rg", "int4range", "string", ["'[1,10)'", "'empty'", "NULL"], RENDERED),
    ("pt", "point", "string", ["'(1.5,-2)'", "NULL", "'(0,0)'"], RENDERED),
    ("js", "json", "string", ["'{\"b\": 1,  \"a\": [1.50, null]}'", "'null'", "NULL"], RENDERED),
    ("jb", "jsonb", "string", ["'{\"b\": 1, \"a\": [1.50, null]}'", "'\"text\"'", "NULL"], RENDERED),
    ("ints", "integer[]", "string", ["'{1,NULL,3}'", "'{}'", "'{{1,2},{3,4}}'"], "to_json({})::text"),
    ("texts", "text[]", "string", ["ARRAY['a', NULL, 'quote\"']", "NULL", "'{}'"], "to_json({})::text"),
    ("comp", "pair", "string", ["ROW(1, 'x')", "ROW(NULL, NULL)", "NULL"], "to_json({})::text"),
    ("rc", "regclass", "string", ["'pg_class'", "'information_schema.tables'", "NULL"], RENDERED),
    ("rt", "regtype", "string", ["'integer'", "'text[]'", "NULL"], RENDERED),
    ("rp", "regproc", "string", ["'now'", "NULL", "NULL"], RENDERED),
    ("rn", "regnamespace", "string", ["'public'", "'pg_catalog'", "NULL"], RENDERED),
    ("tid_", "tid", "string", ["'(0,1)'", "'(4294967295,65535)'", "NULL"], RENDERED),
    ("lsn", "pg_lsn", "string", ["'16/B374D848'", "'0/0'", "NULL"], RENDERED),
    ("xm", "xml", "string", ["'<a b=\"1\">x</a>'", "NULL", "NULL"], RENDERED),
    ("tsv", "tsvector", "string", ["'a fat cat'", "''", "NULL"], RENDERED),
]
TIMES = {"t", "ttz"}


def create(conn: psycopg.Connection, *, copied: bool) -> None:
    """Table t of every type; rows 1..3 now when copied (the copy reads them)."""
    conn.execute(TYPES_SETUP)
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, "
                 + ", ".join(f"{name} {typ}" for name, typ, *_ in TYPES) + ")")
    if copied:
        insert(conn, range(1, ROWS + 1))


def insert(conn: psycopg.Connection, ids: range) -> None:
    for row, id_ in enumerate(ids):
        conn.execute(f"INSERT INTO t VALUES ({id_}, " + ", ".join(values[row] for _, _, _, values, _ in TYPES) + ")")


def change(conn: psycopg.Connection) -> None:
    """Rows 4..6 inserted; row 1 updated to row 5's values, row 3 deleted: events of every type."""
    insert(conn, range(ROWS + 1, 2 * ROWS + 1))
    columns = ", ".join(name for name, *_ in TYPES)
    conn.execute(f"UPDATE t SET ({columns}) = (SELECT {columns} FROM t WHERE id = 5) WHERE id = 1")
    conn.execute("DELETE FROM t WHERE id = 3")


def documented_time(text: str) -> str:
    """time/timetz as docs/delta.md says they are written: six fractional digits, an offset as ±HH:MM
    (and its seconds when it has some)."""
    match = re.fullmatch(r"(\d\d:\d\d:\d\d)(?:\.(\d+))?([+-]\d\d(?::\d\d){0,2})?", text)
    assert match, text
    offset = match[3] or ""
    if len(offset) == 3:
        offset += ":00"
    return f"{match[1]}.{(match[2] or '').ljust(6, '0')}{offset}"


