"""Capture: what the generated triggers queue for each kind of write, for each
kind of table, column type and option (--key, --ignore, --where, --mode)."""

from __future__ import annotations

import json
import math
import tempfile
import uuid
from decimal import Decimal
from pathlib import Path

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql

from ddl_helpers import source_rows, sqlite_rows
from pg_helpers import examples
from queue_util import CAPTURE_KINDS, by_statement, changes, read_events
from replicator.consumer import Consumer
from replicator.errors import UserError
from replicator.source.row_filter import check_row_filter
from replicator.targets import open_target


@pytest.fixture
def q(source):
    """Queue "q" with consumer "c"; tables are added by the tests."""
    source.create_queue("q")
    source.register_consumer("q", "c")
    return source


def _triggers_on(conn, table: str) -> list[str]:
    return [r[0] for r in conn.execute(
        "SELECT tgname FROM pg_trigger WHERE tgrelid = %s::regclass AND NOT tgisinternal ORDER BY 1", (table,))]


# writes ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_insert_update_delete_and_truncate_are_captured(conn, q, capture):
    conn.execute('CREATE TABLE "t" ("id" int PRIMARY KEY, "v" text)')
    table_id = q.add_table("q", "t", capture=capture)
    conn.execute("""INSERT INTO "t" VALUES (1, 'a'), (2, 'b')""")
    conn.execute("""UPDATE "t" SET "v" = 'B' WHERE "id" = 2""")
    conn.execute("""DELETE FROM "t" WHERE "id" = 1""")
    conn.execute('TRUNCATE "t"')
    events = by_statement(read_events(q))
    assert {e.table for e in events} == {table_id}
    assert changes(events) == [
        ("I", [[1, "a"], [2, "b"]]),
        ("U", [[2, "B"]]),
        ("D", [[1]]),
        ("T", None),
    ]
    assert [e.ev_id for e in events] == sorted(e.ev_id for e in events)


@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_one_event_per_statement_and_statements_without_rows_queue_nothing(conn, q, capture):
    conn.execute('CREATE TABLE "t" ("id" int PRIMARY KEY, "v" text)')
    q.add_table("q", "t", capture=capture)
    with conn.transaction():
        conn.execute("""INSERT INTO "t" SELECT g, 'x' FROM generate_series(1, 50) g""")
        conn.execute("""UPDATE "t" SET "v" = 'nothing' WHERE "id" < 0""")
        conn.execute("""DELETE FROM "t" WHERE "id" > 1000""")
        conn.execute("""UPDATE "t" SET "v" = 'y' WHERE "id" <= 10""")
    events = by_statement(read_events(q))
    assert [(e.type, len(e.items)) for e in events] == [("I", 50), ("U", 10)]
    assert len({e.txid for e in events}) == 1


@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_key_changing_update_is_captured_as_delete_of_old_key_and_upsert_of_new_row(conn, q, capture):
    conn.execute('CREATE TABLE "t" ("id" int PRIMARY KEY, "v" text)')
    q.add_table("q", "t", capture=capture)
    conn.execute("""INSERT INTO "t" VALUES (1, 'a'), (2, 'b'), (3, 'c')""")
    by_statement(read_events(q))
    # The application's key change succeeds (never rejected) ...
    conn.execute("""UPDATE "t" SET "id" = "id" + 10, "v" = "v" || '!' WHERE "id" IN (1, 2)""")
    assert conn.execute('SELECT array_agg("id" ORDER BY "id") FROM "t"').fetchone()[0] == [3, 11, 12]
    # ... and is queued as the new rows plus the old keys no row kept.
    assert sorted(changes(by_statement(read_events(q)))) == [("D", [[1], [2]]), ("U", [[11, "a!"], [12, "b!"]])]


@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_key_shift_onto_existing_keys_deletes_only_vacated_keys(conn, q, capture):
    conn.execute('CREATE TABLE "t" ("id" int PRIMARY KEY DEFERRABLE INITIALLY DEFERRED, "v" text)')
    q.add_table("q", "t", capture=capture)
    conn.execute("""INSERT INTO "t" VALUES (1, 'a'), (2, 'b'), (3, 'c')""")
    by_statement(read_events(q))
    # Swap 1 and 2, shift 3 to 4: old keys {1,2,3}, new keys {2,1,4}: only 3 is vacated.
    conn.execute("""UPDATE "t" SET "id" = CASE "id" WHEN 1 THEN 2 WHEN 2 THEN 1 ELSE 4 END""")
    assert sorted(changes(by_statement(read_events(q)))) == [("D", [[3]]), ("U", [[1, "b"], [2, "a"], [4, "c"]])]


@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_composite_key(conn, q, capture):
    conn.execute('CREATE TABLE "t" ("a" int, "b" text, "v" int, PRIMARY KEY ("b", "a"))')
    q.add_table("q", "t", capture=capture)
    table = q.tables("q")[0]
    assert table.key == ["b", "a"]
    conn.execute("""INSERT INTO "t" VALUES (1, 'x', 10), (2, 'x', 20)""")
    conn.execute("""UPDATE "t" SET "v" = 11 WHERE "a" = 1""")
    # Keys travel in key order (b, a); rows in column order (a, b, v).
    assert changes(by_statement(read_events(q))) == [("I", [[1, "x", 10], [2, "x", 20]]), ("U", [[1, "x", 11]])]
    conn.execute("""UPDATE "t" SET "b" = 'y' WHERE "a" = 2""")
    assert sorted(changes(by_statement(read_events(q)))) == [("D", [["x", 2]]), ("U", [[2, "y", 20]])]
    conn.execute("""DELETE FROM "t" WHERE "a" = 1""")
    assert changes(by_statement(read_events(q))) == [("D", [["x", 1]])]


@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_nulls_are_captured_as_json_null(conn, q, capture):
    conn.execute('CREATE TABLE "t" ("id" int PRIMARY KEY, "a" text, "b" int, "c" jsonb, "d" int[])')
    q.add_table("q", "t", capture=capture)
    conn.execute("""INSERT INTO "t" VALUES (1, NULL, NULL, NULL, NULL), (2, '', 0, 'null', '{NULL}')""")
    conn.execute("""UPDATE "t" SET "a" = NULL, "b" = NULL, "c" = NULL, "d" = NULL WHERE "id" = 2""")
    assert changes(by_statement(read_events(q))) == [
        ("I", [[1, None, None, None, None], [2, "", 0, "null", "[null]"]]),
        ("U", [[2, None, None, None, None]]),
    ]


# types ----------------------------------------------------------------------------------------

TYPED_TABLE = """
CREATE TYPE "mood" AS ENUM ('sad', 'ok', 'it''s "complicated"');
CREATE DOMAIN "positive" AS numeric(8, 3) CHECK (VALUE > 0);
CREATE TABLE "typed" (
    "id" int PRIMARY KEY,
    "c_smallint" smallint, "c_int" int, "c_bigint" bigint,
    "c_numeric" numeric, "c_numeric_2" numeric(10, 2), "c_domain" "positive",
    "c_real" real, "c_double" double precision,
    "c_text" text, "c_varchar" varchar(10), "c_char" char(3),
    "c_bool" boolean, "c_bytea" bytea,
    "c_json" json, "c_jsonb" jsonb, "c_uuid" uuid,
    "c_date" date, "c_time" time, "c_timestamp" timestamp, "c_timestamptz" timestamptz,
    "c_interval" interval,
    "c_int_array" int[], "c_text_array" text[], "c_2d_array" numeric[][],
    "c_enum" "mood", "c_inet" inet
)"""

TYPED_ROWS = """
INSERT INTO "typed" VALUES
 (1, 1, 2, 3, 1.50, 1.50, 2.500, 0.5, 0.1, 'plain', 'v', 'ab', true, '\\x00ff10',
  '{"b": 1,  "a": [1, 2]}', '{"b": 1,  "a": [1, 2]}', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11',
  '2024-02-29', '23:59:59.999999', '2024-02-29 12:34:56.789012', '2024-02-29 12:34:56.789012+02',
  '1 year 2 mons 3 days 04:05:06.5', '{1,NULL,3}', '{"a,b","c\\"d",NULL,""}', '{{1.0,2.50},{3,4}}',
  'it''s "complicated"', '192.168.0.1/24'),
 (2, -32768, -2147483648, -9223372036854775808, -0.000000000000000000001, -99999999.99, 0.001,
  'NaN', 'Infinity', E'quote\\" backslash\\\\ tab\\t newline\\n unicode é 😀 \\u0001', '', '   ',
  false, '\\x', '[]', '{}', '00000000-0000-0000-0000-000000000000',
  'infinity', '00:00', '-infinity', 'infinity', '-1 day +02:00:00', '{}', '{}', '{}', 'sad', '::1'),
 (3, 32767, 2147483647, 9223372036854775807, 'NaN', 0, 99999.999, '-Infinity', '-Infinity',
  'x', 'xxxxxxxxxx', 'x', NULL, NULL, 'null', '"a string"', NULL,
  '4713-01-01 BC', NULL, '1999-12-31 23:59:59', '1970-01-01 00:00:00+00', '0', NULL, NULL, NULL, NULL, NULL),
 (4, NULL, NULL, NULL, 12345678901234567890.1234567890123, NULL, NULL, 1e-40, 1.7976931348623157e308,
  NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
  NULL, NULL, NULL, NULL, '-178000000 years', NULL, NULL, NULL, NULL, NULL)
"""


def _as_sql_literal(value):
    """A decoded JSON value as the text PostgreSQL reads back: strings as they are,
    numbers in their exact JSON spelling, booleans as true/false."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_common_types_decode_to_the_values_the_source_holds(conn, q, capture):
    conn.execute(TYPED_TABLE)
    q.add_table("q", "typed", capture=capture)
    conn.execute(TYPED_ROWS)
    (event,) = by_statement(read_events(q))
    columns = q.tables("q")[0].columns
    types = dict(conn.execute("""SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute
                                 WHERE attrelid = '"typed"'::regclass AND attnum > 0"""))
    assert len(event.items) == 4
    checked = 0
    for item in event.items:
        row = dict(zip(columns, item))
        for column, value in row.items():
            if types[column].endswith("[]") or types[column] in ("json", "jsonb"):
                # json and arrays travel as PostgreSQL's JSON text of the value
                expected = conn.execute(sql.SQL("SELECT to_json({})::text FROM {} WHERE {} = %s").format(
                    sql.Identifier(column), sql.Identifier("typed"), sql.Identifier("id")), (row["id"],)).fetchone()[0]
                assert value is None or isinstance(value, str), column
                if value is not None and types[column] == "json":
                    assert value == conn.execute('SELECT "c_json"::text FROM "typed" WHERE "id" = %s',
                                                 (row["id"],)).fetchone()[0]
                elif value is not None:
                    assert json.loads(value) == json.loads(expected), (column, value, expected)
                else:
                    assert expected is None, column
            else:
                same = conn.execute(
                    sql.SQL("SELECT {col} IS NOT DISTINCT FROM %s::{typ} FROM {tbl} WHERE {id} = %s").format(
                        col=sql.Identifier(column), typ=sql.SQL(types[column]), tbl=sql.Identifier("typed"),
                        id=sql.Identifier("id")),
                    (_as_sql_literal(value), row["id"])).fetchone()[0]
                assert same, (row["id"], column, value)
            checked += 1
    assert checked == 4 * len(columns)

    # The values a consumer sees for the first row, spelled out.
    first = dict(zip(columns, sorted(event.items)[0]))
    assert first["c_numeric"] == Decimal("1.50") and str(first["c_numeric"]) == "1.50"
    assert str(first["c_numeric_2"]) == "1.50" and str(first["c_domain"]) == "2.500"
    assert first["c_double"] == Decimal("0.1") and first["c_real"] == Decimal("0.5")
    assert first["c_bool"] is True and first["c_bytea"] == "\\x00ff10"
    assert first["c_json"] == '{"b": 1,  "a": [1, 2]}'          # json: text kept as written
    assert first["c_jsonb"] == '{"a": [1, 2], "b": 1}'          # jsonb: normalised
    assert first["c_uuid"] == "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"
    assert first["c_date"] == "2024-02-29" and first["c_time"] == "23:59:59.999999"
    assert first["c_timestamp"] == "2024-02-29T12:34:56.789012"
    assert first["c_int_array"] == "[1,null,3]"
    assert json.loads(first["c_text_array"]) == ["a,b", 'c"d', None, ""]
    assert json.loads(first["c_2d_array"]) == [[1.0, 2.5], [3, 4]]
    assert first["c_enum"] == 'it\'s "complicated"'
    second = dict(zip(columns, sorted(event.items)[1]))
    assert second["c_bigint"] == -9223372036854775808
    assert second["c_real"] == "NaN" and second["c_double"] == "Infinity"
    assert second["c_timestamp"] == "-infinity" and second["c_date"] == "infinity"


@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_captured_values_do_not_depend_on_the_writers_session_settings(dsn, conn, q, capture):
    conn.execute("""CREATE TABLE "t" ("id" int PRIMARY KEY, "b" bytea, "f" float8, "r" real, "i" interval,
                                      "fa" float8[], "ia" interval[])""")
    q.add_table("q", "t", capture=capture)
    values = ("\\x00ff", 1 / 3, 1 / 3, "-1 day +02:03:04.5", [0.1, 1 / 3], ["1 mon -2 days"])
    conn.execute('INSERT INTO "t" VALUES (1, %s, %s, %s, %s, %s, %s::interval[])', values)
    with psycopg.connect(dsn, autocommit=True) as odd:
        odd.execute("SET bytea_output = 'escape'")
        odd.execute("SET extra_float_digits = -15")
        odd.execute("SET IntervalStyle = 'sql_standard'")
        odd.execute("SET DateStyle = 'SQL, DMY'")
        odd.execute('INSERT INTO "t" VALUES (2, %s, %s, %s, %s, %s, %s::interval[])', values)
    default_row, odd_row = (item[1:] for item in sorted(e.items[0] for e in by_statement(read_events(q))))
    assert odd_row == default_row
    assert default_row[0] == "\\x00ff" and float(default_row[1]) == 1 / 3


def _pinned_settings(conn, table_id: int) -> list[str]:
    return conn.execute("SELECT proconfig FROM pg_proc WHERE oid = %s::regprocedure",
                        (f"replicator.capture_{table_id}()",)).fetchone()[0]


def test_output_settings_are_pinned_only_where_the_encoding_depends_on_them(dsn, conn, q):
    # Types whose encoding no output setting changes (bytea is hex-encoded explicitly):
    # the capture function pins search_path only, and values still do not depend on
    # the writer's session.
    conn.execute("""CREATE TYPE "mood" AS ENUM ('sad', 'ok');
                    CREATE DOMAIN "blob" AS bytea;
                    CREATE TABLE "plain" ("id" int PRIMARY KEY, "b" bytea, "db" "blob", "n" numeric,
                                          "ts" timestamp, "d" date, "tz" timestamptz, "m" "mood",
                                          "ta" text[], "u" uuid, "j" jsonb, "f" float8)""")
    plain = q.add_table("q", "plain", mode="pk")                # pk: the float column is not encoded
    assert _pinned_settings(conn, plain) == ["search_path=pg_catalog, pg_temp"]
    q.remove_table("q", "plain")
    conn.execute('ALTER TABLE "plain" DROP COLUMN "f"')
    plain = q.add_table("q", "plain")
    assert _pinned_settings(conn, plain) == ["search_path=pg_catalog, pg_temp"]
    values = ("\\x00ff", "\\x", "1.50", "2024-02-29 12:34:56.789", "2024-02-29", "2024-02-29 12:34:56+02",
              "ok", ["a", None], "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", '{"a": [1, 2.50]}')
    insert = 'INSERT INTO "plain" VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)'
    conn.execute(insert, (1, *values))
    with psycopg.connect(dsn, autocommit=True) as odd:
        odd.execute("SET bytea_output = 'escape'")
        odd.execute("SET extra_float_digits = -15")
        odd.execute("SET IntervalStyle = 'sql_standard'")
        odd.execute("SET DateStyle = 'SQL, DMY'")
        odd.execute(insert, (2, *values))
        odd.execute("""UPDATE "plain" SET "b" = '\\x0102' WHERE "id" = 2""")
    inserted_default, inserted_odd, updated = read_events(q)
    default_row, odd_row = inserted_default.items[0][1:], inserted_odd.items[0][1:]
    assert odd_row == default_row
    assert default_row[:5] == ["\\x00ff", "\\x", 1.5, "2024-02-29T12:34:56.789", "2024-02-29"]
    assert updated.items[0][:2] == [2, "\\x0102"]

    # Types whose JSON rendering an output setting changes, in any disguise: pinned.
    conn.execute("""CREATE DOMAIN "ratio" AS float8;
                    CREATE TYPE "pair" AS ("a" int, "b" int)""")
    for number, column in enumerate(["float4", "float8", "interval", "bytea[]", '"ratio"', '"ratio"[]',
                                     '"pair"', "int4range", "point", "money"]):
        conn.execute(f'CREATE TABLE "pinned_{number}" ("id" int PRIMARY KEY, "v" {column})')
        table_id = q.add_table("q", f"pinned_{number}")
        assert _pinned_settings(conn, table_id) == [
            "search_path=pg_catalog, pg_temp", "bytea_output=hex", "extra_float_digits=1",
            "IntervalStyle=postgres"], column
    # ... and a row filter, which may depend on them, and reads its strings as it was checked.
    conn.execute('CREATE TABLE "filtered" ("id" int PRIMARY KEY)')
    assert _pinned_settings(conn, q.add_table("q", "filtered", where='"id" > 0')) == [
        "search_path=pg_catalog, pg_temp", "bytea_output=hex", "extra_float_digits=1",
        "IntervalStyle=postgres", "standard_conforming_strings=on", "TimeZone=UTC", "DateStyle=ISO, MDY"]


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                     HealthCheck.too_slow])
@given(text=st.text(alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",))),
       number=st.decimals(allow_nan=False, allow_infinity=False),
       double=st.floats(),
       big=st.integers(min_value=-2**63, max_value=2**63 - 1),
       raw=st.binary(max_size=64))
def test_arbitrary_values_round_trip(conn, q, text, number, double, big, raw):
    if not q.tables("q"):
        conn.execute('CREATE TABLE "rt" ("id" bigserial PRIMARY KEY, "t" text, "n" numeric, '
                     '"d" float8, "b" bigint, "r" bytea)')
        q.add_table("q", "rt")
    conn.execute('INSERT INTO "rt" ("t", "n", "d", "b", "r") VALUES (%s, %s, %s, %s, %s)',
                 (text, number, double, big, raw))
    (event,) = read_events(q)
    _id, t, n, d, b, r = event.items[0]
    assert t == text
    assert Decimal(str(n)) == number
    if math.isnan(double):
        assert d == "NaN"
    elif math.isinf(double):
        assert d == ("Infinity" if double > 0 else "-Infinity")
    else:
        assert float(d) == double          # shortest exact spelling: no digit lost
    assert b == big
    assert bytes.fromhex(r[2:]) == raw and r.startswith("\\x")


# names ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_hostile_schema_table_and_column_names(conn, q, capture):
    conn.execute('CREATE SCHEMA "Odd ""Schema"""')
    conn.execute('''CREATE TABLE "Odd ""Schema"""."select" (
        "the Key" int, "from" text, "Mixed Case" int, "quote""d" text, "semi;colon --" text,
        "ignored col" text, PRIMARY KEY ("the Key"))''')
    conn.execute('CREATE TABLE "public"."dotted.name" ("ID" int PRIMARY KEY, "x" text)')
    table_id = q.add_table("q", '"Odd ""Schema"""."select"', ignore=["ignored col"], where='"Mixed Case" >= 0', capture=capture)
    dotted_id = q.add_table("q", '"dotted.name"', mode="pk", capture=capture)
    tables = {t.table_id: t for t in q.tables("q")}
    assert (tables[table_id].schema, tables[table_id].table) == ('Odd "Schema"', "select")
    assert tables[table_id].columns == ["the Key", "from", "Mixed Case", "quote\"d", "semi;colon --"]
    assert tables[dotted_id].key == ["ID"]

    conn.execute('''INSERT INTO "Odd ""Schema"""."select" VALUES
        (1, 'f', 1, 'q', 's', 'i'), (2, 'f', -1, 'q', 's', 'i')''')
    conn.execute('''UPDATE "Odd ""Schema"""."select" SET "ignored col" = 'j' ''')
    conn.execute('''INSERT INTO "dotted.name" VALUES (7, 'x')''')
    events = by_statement(read_events(q))
    assert [(e.table, e.type, e.items) for e in events] == [
        (table_id, "I", [[1, "f", 1, "q", "s"]]), (dotted_id, "I", [[7]])]
    conn.execute('''UPDATE "Odd ""Schema"""."select" SET "the Key" = 10 WHERE "the Key" = 1''')
    assert sorted((e.table, e.type, e.items) for e in by_statement(read_events(q))) == [
        (table_id, "D", [[1]]), (table_id, "U", [[10, "f", 1, "q", "s"]])]
    conn.execute('''DELETE FROM "Odd ""Schema"""."select"''')
    assert [(e.table, e.type, e.items) for e in by_statement(read_events(q))] == [(table_id, "D", [[10]])]

    q.remove_table("q", '"Odd ""Schema"""."select"')
    q.remove_table("q", '"dotted.name"')
    assert _triggers_on(conn, '"Odd ""Schema"""."select"') == []
    assert _triggers_on(conn, '"dotted.name"') == []


# options --------------------------------------------------------------------------------------

@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_update_touching_only_ignored_columns_queues_nothing(conn, q, capture):
    conn.execute('CREATE TABLE "t" ("id" int PRIMARY KEY, "v" text, "seen_at" timestamptz, "hits" int)')
    q.add_table("q", "t", ignore=["seen_at", "hits"], capture=capture)
    conn.execute("""INSERT INTO "t" VALUES (1, 'a', now(), 0), (2, 'b', now(), 0)""")
    by_statement(read_events(q))
    conn.execute("""UPDATE "t" SET "seen_at" = now() + interval '1 hour', "hits" = "hits" + 1""")
    conn.execute("""UPDATE "t" SET "v" = "v" WHERE "id" = 1""")   # no captured column changes either
    assert by_statement(read_events(q)) == []
    # A statement changing a captured column of one row queues that row only.
    conn.execute("""UPDATE "t" SET "hits" = "hits" + 1, "v" = CASE "id" WHEN 2 THEN 'B' ELSE "v" END""")
    assert changes(by_statement(read_events(q))) == [("U", [[2, "B"]])]


@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_ignored_columns_are_absent_from_event_data(conn, q, capture):
    conn.execute('CREATE TABLE "t" ("id" int PRIMARY KEY, "secret" text, "v" text)')
    q.add_table("q", "t", ignore=["secret"], capture=capture)
    assert q.tables("q")[0].columns == ["id", "v"]
    conn.execute("""INSERT INTO "t" VALUES (1, 'hunter2', 'a')""")
    conn.execute("""UPDATE "t" SET "v" = 'b', "secret" = 'hunter3'""")
    conn.execute("""DELETE FROM "t" """)
    events = by_statement(read_events(q))
    assert changes(events) == [("I", [[1, "a"]]), ("U", [[1, "b"]]), ("D", [[1]])]
    assert not any("hunter" in json.dumps(e.data) for e in events)


def test_ignoring_a_key_column_is_refused(conn, q):
    conn.execute('CREATE TABLE "t" ("id" int PRIMARY KEY, "v" text)')
    with pytest.raises(UserError, match="key column id cannot be ignored"):
        q.add_table("q", "t", ignore=["id"])


@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_row_filter_queues_only_rows_inside_it(conn, q, capture):
    conn.execute('CREATE TABLE "t" ("id" int PRIMARY KEY, "kind" text, "v" int)')
    q.add_table("q", "t", where=""""kind" <> 'debug'""", capture=capture)
    conn.execute("""INSERT INTO "t" VALUES (1, 'info', 1), (2, 'debug', 2), (3, 'info', 3)""")
    conn.execute("""UPDATE "t" SET "v" = "v" + 10 WHERE "id" = 2""")          # outside: nothing
    conn.execute("""UPDATE "t" SET "kind" = 'debug' WHERE "id" = 1""")       # leaves the filter: D
    conn.execute("""UPDATE "t" SET "kind" = 'info' WHERE "id" = 2""")        # enters the filter: U
    conn.execute("""DELETE FROM "t" WHERE "id" = 1""")                       # outside: nothing
    conn.execute("""DELETE FROM "t" WHERE "id" = 3""")                       # inside: D
    assert changes(by_statement(read_events(q))) == [
        ("I", [[1, "info", 1], [3, "info", 3]]),
        ("D", [[1]]),
        ("U", [[2, "info", 12]]),
        ("D", [[3]]),
    ]


def test_invalid_row_filter_is_refused_at_add_time(conn, q):
    conn.execute('CREATE TABLE "t" ("id" int PRIMARY KEY)')
    with pytest.raises(UserError, match="invalid row filter"):
        q.add_table("q", "t", where='"no_such_column" > 1')
    assert _triggers_on(conn, '"t"') == []


def test_row_filter_is_checked_at_add_time_as_the_capture_runs_it(conn, q):
    """The capture runs the filter with a pinned search_path and over the changed rows,
    not the table: a filter that would fail there fails at add time, never at write time."""
    conn.execute('CREATE TABLE "t" ("id" int PRIMARY KEY, "v" int)')
    conn.execute('CREATE FUNCTION "public"."is_visible"(int) RETURNS boolean LANGUAGE sql IMMUTABLE'
                 ' AS $$ SELECT $1 > 0 $$')
    for bad in ('"is_visible"("v")', '"t"."v" > 0', '"id" IN (SELECT "id" FROM "t")'):
        with pytest.raises(UserError, match="invalid row filter"):
            q.add_table("q", "t", where=bad)
        assert _triggers_on(conn, '"t"') == []
    conn.execute('INSERT INTO "t" VALUES (1, 1)')          # the application is not affected
    q.add_table("q", "t", where='"public"."is_visible"("v") AND "id" NOT IN (SELECT "id" FROM "public"."t" WHERE false)')
    conn.execute('INSERT INTO "t" VALUES (2, 2), (3, -3)')
    assert changes(read_events(q)) == [("I", [[2, 2]])]
    conn.execute('UPDATE "t" SET "v" = -"v"')
    assert sorted(changes(read_events(q))) == [("D", [[1], [2]]), ("U", [[3, 3]])]


# user text: a row filter is one expression, and nothing of it runs before it is accepted ----------

@pytest.fixture
def marker_file():
    """A path the server can write (shown by each test first), removed after the test."""
    path = Path(tempfile.gettempdir()) / f"replicator-test-{uuid.uuid4().hex}"
    yield path
    path.unlink(missing_ok=True)


@pytest.fixture
def ddl_ran(conn):
    """Whether any DDL ran since: an event trigger advances a sequence, which a rollback
    does not take back (a stacked DROP TABLE that ran, then failed, still shows)."""
    conn.execute('CREATE TABLE "t" ("id" int PRIMARY KEY)')
    conn.execute('CREATE TABLE "other" ("id" int)')
    conn.execute('CREATE SEQUENCE "public"."ddl_ran"')
    conn.execute('CREATE FUNCTION "public"."note_ddl"() RETURNS event_trigger LANGUAGE plpgsql'
                 " AS $$ BEGIN PERFORM pg_catalog.nextval('public.ddl_ran'); END $$")
    conn.execute('CREATE EVENT TRIGGER "note_ddl" ON ddl_command_end EXECUTE FUNCTION "public"."note_ddl"()')
    yield lambda: conn.execute('SELECT is_called FROM "public"."ddl_ran"').fetchone()[0]
    conn.execute('DROP EVENT TRIGGER "note_ddl"')


def _server_can_write(conn, path: Path) -> None:
    """Proves a test's `path does not exist` means something: COPY TO PROGRAM reaches it."""
    # the program reads its input: one that exits first breaks COPY's pipe, and COPY fails
    conn.execute(f"COPY (SELECT 1) TO PROGRAM 'cat > /dev/null; touch {path}'")
    assert path.exists()
    path.unlink()


STACKED_FILTERS = [
    # issue 15: the filter pasted into the check's EXECUTE ran a COPY TO PROGRAM as the superuser
    "true) LIMIT 0; COPY (SELECT 1) TO PROGRAM 'touch {file}'; SELECT 1 WHERE (true",
    'true) LIMIT 0; DROP TABLE "public"."other"; SELECT 1 WHERE (true',
    '"id" > 0) UNION ALL SELECT 1 FROM "public"."t" o WHERE (true) LIMIT 0; CREATE TABLE "public"."made" (); SELECT (1',
]


@pytest.mark.parametrize("stacked", STACKED_FILTERS)
def test_a_row_filter_stacking_statements_runs_none_of_them_and_is_refused(conn, q, marker_file, ddl_ran, stacked):
    _server_can_write(conn, marker_file)
    with pytest.raises(UserError, match=r"^invalid row filter") as refused:
        q.add_table("q", "t", where=stacked.format(file=marker_file))
    assert "\n" not in str(refused.value)
    assert not marker_file.exists()
    assert not ddl_ran()
    assert conn.execute("SELECT to_regclass('other'), to_regclass('made')").fetchone() == ("other", None)
    assert _triggers_on(conn, '"t"') == []


@pytest.mark.parametrize("stacked", STACKED_FILTERS)
def test_the_sql_functions_refuse_a_stacked_row_filter_without_running_it(conn, q, marker_file, ddl_ran, stacked):
    """Callers of replicator.add_table in SQL skip the Python check: the server's own check
    (row_filter_error, also run after DDL) only ever plans one statement."""
    _server_can_write(conn, marker_file)
    where = stacked.format(file=marker_file)
    with pytest.raises(psycopg.errors.RaiseException, match=r"invalid row filter for public.t: it is not one expression"):
        conn.execute("SELECT replicator.add_table('q', 't', 'full', NULL, '{}', %s)", (where,))
    assert conn.execute("SELECT replicator.row_filter_error('t', %s)", (where,)).fetchone()[0].startswith(
        "it is not one expression")
    assert not marker_file.exists()
    assert not ddl_ran()
    assert conn.execute("SELECT to_regclass('other'), to_regclass('made')").fetchone() == ("other", None)
    assert _triggers_on(conn, '"t"') == []


@pytest.mark.parametrize("escape", [
    'true) OR (true',                                        # closes the wrapper's parenthesis, opens another
    'true) UNION ALL SELECT 1 FROM "pg_class" WHERE (true',
    'true) LIMIT 0 --',                                      # a trailing comment swallows the wrapper's )
    '"id" > 0) --',
    '"id" > 0 -- the small ones',
    '"id" > 0 /* unterminated',
    '"id" > 0)',
    '("id" > 0',
    '"id" AS "x"',
    '"id" > 0 FOR UPDATE',
    '"id" IN (SELECT "id" FROM "public"."t" FOR UPDATE)',     # a row lock taken by every write
    '"id" IN (WITH d AS (DELETE FROM "public"."t" RETURNING "id") SELECT "id" FROM d)',
    """"id" > 0 AND 'C:\\' <> ''""",                         # a backslash in '...': E'...' says what it means
    '"id" = $1',
    '"id" > 0\x00) OR (true',                               # the parser would stop at the NUL
    '',
])
def test_a_row_filter_that_is_not_one_expression_is_refused_in_one_line(conn, q, escape):
    conn.execute('CREATE TABLE "t" ("id" int PRIMARY KEY)')
    with pytest.raises(UserError, match=r"^invalid row filter") as refused:
        q.add_table("q", "t", where=escape)
    assert "\n" not in str(refused.value)
    assert _triggers_on(conn, '"t"') == []


def test_key_and_ignored_columns_must_be_the_tables_and_run_nothing(conn, q, ddl_ran):
    """--key and --ignore are matched against the table's columns and written as quoted
    identifiers: a name that is SQL is an unknown column."""
    hostile = 'id") FROM "public"."t"; DROP TABLE "public"."other"; SELECT ("id'
    for options in ({"key": [hostile]}, {"ignore": [hostile]}, {"key": ["id", hostile]}):
        with pytest.raises(UserError, match=r"^table public.t has no column "):
            q.add_table("q", "t", **options)
    with pytest.raises(UserError, match=r"^invalid table name"):
        q.add_table("q", 't; DROP TABLE "public"."other"')
    assert not ddl_ran()
    assert _triggers_on(conn, '"t"') == []
    conn.execute('ALTER TABLE "t" ADD COLUMN "odd "")"" name" int')   # a real column named like SQL
    q.add_table("q", "t", ignore=['odd ")" name'])
    conn.execute('INSERT INTO "t" VALUES (1, 2)')
    assert changes(read_events(q)) == [("I", [[1]])]


# Fragments an adversary strings together after a valid filter: quotes, comments,
# parentheses, statement separators and the statements they would smuggle in.
_FRAGMENTS = [")", "(", ";", " -- ", "\n", "/*", "*/", "'", "''", "$$", "$q$", "E'\\''", "\\", '"', " ", ",", "1",
              " OR true", " DROP TABLE \"other\"", " UNION ALL SELECT 1 FROM pg_class", " LIMIT 0", " FROM \"t\"",
              " WHERE (", " CREATE TABLE \"made\" ()", " AND \"id\" IN (", " SELECT ", " FOR UPDATE", " AS x"]


@settings(max_examples=examples(400), deadline=None)
@given(suffix=st.lists(st.sampled_from(_FRAGMENTS), max_size=12).map("".join))
def test_an_accepted_row_filter_is_exactly_one_expression_wherever_it_is_wrapped(suffix):
    """Whatever is appended to a filter: either it is refused, or the statements the server
    check and the capture build around it parse as one statement whose conditions are
    exactly the filter's expression."""
    from pglast import parse_sql

    where = '"id" > 0' + suffix
    try:
        check_row_filter(where)
    except UserError:
        return
    alone = parse_sql(f"SELECT ({where})")[0].stmt.targetList[0].val
    wrapped = parse_sql(f"SELECT 1 FROM t n WHERE ({where}) UNION ALL SELECT 1 FROM t o WHERE ({where}) LIMIT 0")
    assert len(wrapped) == 1
    union = wrapped[0].stmt
    assert union.larg.whereClause == alone and union.rarg.whereClause == alone
    assert union.limitCount is not None and not union.larg.fromClause[1:] and not union.rarg.fromClause[1:]


# a filter's end, a statement after it, and what would reopen the wrapper, with noise between
_STACKING = st.tuples(
    st.sampled_from([")", "))", ") LIMIT 0", ") OR (true)", ") UNION ALL SELECT 1 FROM pg_class WHERE (true)", ""]),
    st.sampled_from([";", " ;\n", "; /* */ "]),
    st.sampled_from(['CREATE TABLE "public"."made" ()', 'DROP TABLE "public"."other"']),
    st.sampled_from([";", "; SELECT (1", "; SELECT 1 WHERE (true", " --", "; -- ", "/*"]),
    st.lists(st.sampled_from(_FRAGMENTS), max_size=3).map("".join)).map("".join)


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                     HealthCheck.too_slow])
@given(suffix=_STACKING)
def test_no_row_filter_runs_a_statement_of_its_own_when_added(conn, q, ddl_ran, suffix):
    for add in (lambda where: q.add_table("q", "t", where=where),
                lambda where: conn.execute("SELECT replicator.add_table('q', 't', 'full', NULL, '{}', %s)", (where,))):
        try:
            add('"id" > 0' + suffix)
        except (UserError, psycopg.errors.RaiseException, psycopg.errors.SyntaxError):
            pass
        else:
            q.remove_table("q", "t")
        assert not ddl_ran()
        assert conn.execute("SELECT to_regclass('other'), to_regclass('made')").fetchone() == ("other", None)
        assert _triggers_on(conn, '"t"') == []


LEGITIMATE_FILTERS = [
    # (filter, the rows it keeps among ROWS, by id)
    (""""kind" <> 'a;b'""", {2, 3, 4, 5}),
    (""""kind" = $$x); DROP TABLE "other"; --$$ OR "kind" = $q$it's$q$""", {2, 3}),
    ("""(("v" + 1) * 2) > ((4 + (2)))""", {3, 4, 5}),
    (""""v" IN (1, 3, 5)""", {1, 3, 5}),
    (""""id" NOT IN (SELECT "id" FROM "public"."other")""", {2, 3, 4, 5}),
    ("""pg_catalog.length("kind") > 3 AND pg_catalog.upper("kind") <> 'TAB' || pg_catalog.chr(9) || 'HERE'""",
     {2, 3, 5}),
    (""""kind" = E'tab\\there' OR "kind" = E'back\\\\slash'""", {4, 5}),
    ("""/* leading */ "v" >= 2 -- a comment ending its line
        AND "v" <= 4""", {2, 3, 4}),
    (""""kind" LIKE 'x)%' OR "kind" = 'it''s'""", {2, 3}),
]
ROWS = [(1, "a;b", 1), (2, "x); DROP TABLE \"other\"; --", 2), (3, "it's", 3), (4, "tab\there", 4),
        (5, "back\\slash", 5)]


@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_legitimate_row_filters_are_accepted_and_capture_the_rows_they_name(conn, q, capture):
    """Semicolons in string literals, dollar quotes, nested parentheses, IN lists,
    sub-selects and function calls, E'' strings, comments: one expression each."""
    conn.execute('CREATE TABLE "other" ("id" int)')
    conn.execute('INSERT INTO "other" VALUES (1)')
    ids = {}
    for n, (where, _kept) in enumerate(LEGITIMATE_FILTERS):
        conn.execute(f'CREATE TABLE "t{n}" ("id" int PRIMARY KEY, "kind" text, "v" int)')
        ids[q.add_table("q", f"t{n}", where=where, capture=capture)] = n
        conn.execute(f'INSERT INTO "t{n}" VALUES ' + ", ".join(["(%s, %s, %s)"] * len(ROWS)),
                     [value for row in ROWS for value in row])
    captured = {n: set() for n in range(len(LEGITIMATE_FILTERS))}
    for event in by_statement(read_events(q)):
        assert event.type == "I"
        captured[ids[event.table]] |= {item[0] for item in event.items}
    assert captured == {n: kept for n, (_where, kept) in enumerate(LEGITIMATE_FILTERS)}
    assert [t.row_filter for t in sorted(q.tables("q"), key=lambda t: t.table_id)] == [
        where for where, _kept in LEGITIMATE_FILTERS]                     # kept as written


@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_pk_mode_queues_keys_only(conn, q, capture):
    conn.execute('CREATE TABLE "t" ("a" int, "b" int, "payload" text, PRIMARY KEY ("a", "b"))')
    q.add_table("q", "t", mode="pk", capture=capture)
    conn.execute("""INSERT INTO "t" VALUES (1, 1, 'big'), (1, 2, 'big')""")
    conn.execute("""UPDATE "t" SET "payload" = 'bigger' WHERE "b" = 1""")
    events = by_statement(read_events(q))
    assert changes(events) == [("I", [[1, 1], [1, 2]]), ("U", [[1, 1]])]
    conn.execute("""UPDATE "t" SET "b" = 3 WHERE "b" = 2""")
    events += (key_change := by_statement(read_events(q)))
    assert sorted(changes(key_change)) == [("D", [[1, 2]]), ("U", [[1, 3]])]
    conn.execute("""DELETE FROM "t" WHERE "b" = 1""")
    events += (deleted := by_statement(read_events(q)))
    assert changes(deleted) == [("D", [[1, 1]])]
    assert not any("big" in json.dumps(e.data) for e in events)


def test_table_without_primary_key_is_refused_at_add_time(conn, q):
    conn.execute('CREATE TABLE "nokey" ("id" int UNIQUE, "v" text)')
    with pytest.raises(UserError) as info:
        q.add_table("q", "nokey")
    assert str(info.value) == "table public.nokey has no primary key: give the key columns with --key COL,..."
    assert q.tables("q") == [] and _triggers_on(conn, '"nokey"') == []
    conn.execute("""INSERT INTO "nokey" VALUES (1, 'a')""")          # the application is not affected
    assert read_events(q) == []


@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_key_option_captures_a_table_without_primary_key(conn, q, capture):
    conn.execute('CREATE TABLE "nokey" ("code" text NOT NULL, "n" int NOT NULL, "v" text)')
    q.add_table("q", "nokey", key=["code", "n"], capture=capture)
    (table,) = q.tables("q")
    assert table.key == ["code", "n"] and table.structure["key"] == ["code", "n"]
    conn.execute("""INSERT INTO "nokey" VALUES ('a', 1, 'x'), ('b', 2, 'y')""")
    assert changes(by_statement(read_events(q))) == [("I", [["a", 1, "x"], ["b", 2, "y"]])]
    conn.execute("""UPDATE "nokey" SET "n" = 3 WHERE "code" = 'b'""")
    assert sorted(changes(by_statement(read_events(q)))) == [("D", [["b", 2]]), ("U", [["b", 3, "y"]])]
    conn.execute("""DELETE FROM "nokey" WHERE "code" = 'a'""")
    assert changes(by_statement(read_events(q))) == [("D", [["a", 1]])]


def test_unknown_key_column_is_refused(conn, q):
    conn.execute('CREATE TABLE "nokey" ("id" int)')
    with pytest.raises(UserError, match="has no column nope"):
        q.add_table("q", "nokey", key=["nope"])


def test_statement_of_more_than_1000_rows_is_split_into_several_events(conn, q):
    conn.execute('CREATE TABLE "t" ("id" int PRIMARY KEY, "v" int)')
    q.add_table("q", "t")
    conn.execute("""INSERT INTO "t" SELECT g, 0 FROM generate_series(1, 2500) g""")
    conn.execute("""UPDATE "t" SET "v" = 1""")
    conn.execute("""DELETE FROM "t" WHERE "id" <= 1500""")
    events = read_events(q)
    for ev_type, count in (("I", 2500), ("U", 2500), ("D", 1500)):
        parts = [e for e in events if e.type == ev_type]
        assert len(parts) >= 2 and all(1 <= len(e.items) <= 1000 for e in parts), ev_type
        ids = sorted(item[0] for e in parts for item in e.items)
        assert ids == list(range(1, count + 1)), ev_type
    assert all(item == [item[0], 1] for e in events if e.type == "U" for item in e.items)


@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_application_writes_still_work(conn, q, capture):
    conn.execute('CREATE TABLE "t" ("id" int PRIMARY KEY, "v" text)')
    conn.execute('CREATE TABLE "src" ("id" int, "v" text)')
    q.add_table("q", "t", capture=capture)
    conn.execute("""INSERT INTO "src" VALUES (1, 'from src'), (5, 'five')""")
    conn.execute("""INSERT INTO "t" VALUES (1, 'a'), (2, 'b'), (3, 'c')""")
    conn.execute("""INSERT INTO "t" VALUES (3, 'C'), (4, 'd') ON CONFLICT ("id") DO UPDATE SET "v" = excluded."v" """)
    conn.execute("""INSERT INTO "t" VALUES (4, 'ignored') ON CONFLICT DO NOTHING""")
    conn.execute("""WITH "gone" AS (DELETE FROM "t" WHERE "id" = 2 RETURNING "id", "v")
                    INSERT INTO "t" SELECT "id" + 100, "v" FROM "gone" """)
    conn.execute("""UPDATE "t" SET "v" = "src"."v" FROM "src" WHERE "src"."id" = "t"."id" """)
    conn.execute("""DELETE FROM "t" USING "src" WHERE "src"."id" = "t"."id" AND "src"."v" = 'from src'""")
    final = dict(conn.execute('SELECT "id", "v" FROM "t"').fetchall())
    assert final == {3: "C", 4: "d", 102: "b"}
    assert _replayed(by_statement(read_events(q))) == final


def _replayed(events) -> dict:
    """The rows (id, v) that applying the events in order leaves."""
    state: dict = {}
    for e in events:
        for item in e.items:
            if e.type == "D":
                state.pop(item[0], None)
            else:
                state[item[0]] = item[1]
    return state


@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_merge_is_captured(conn, q, capture):
    if conn.info.server_version < 150000:
        pytest.skip(f"MERGE exists from PostgreSQL 15, not in {conn.info.parameter_status('server_version')}")
    conn.execute('CREATE TABLE "t" ("id" int PRIMARY KEY, "v" text)')
    conn.execute('CREATE TABLE "src" ("id" int, "v" text)')
    q.add_table("q", "t", capture=capture)
    conn.execute("""INSERT INTO "t" VALUES (1, 'a'), (2, 'b'), (3, 'c')""")
    conn.execute("""INSERT INTO "src" VALUES (1, 'merged'), (2, 'delete'), (5, 'five')""")
    # one statement inserting, updating and deleting
    conn.execute("""MERGE INTO "t" USING "src" ON "t"."id" = "src"."id"
                    WHEN MATCHED AND "src"."v" = 'delete' THEN DELETE
                    WHEN MATCHED THEN UPDATE SET "v" = "src"."v"
                    WHEN NOT MATCHED THEN INSERT VALUES ("src"."id", "src"."v")""")
    final = dict(conn.execute('SELECT "id", "v" FROM "t"').fetchall())
    assert final == {1: "merged", 3: "c", 5: "five"}
    events = by_statement(read_events(q))
    assert sorted(e.type for e in events) == ["D", "I", "I", "U"]
    assert _replayed(events) == final


def test_partition_written_directly_is_captured(conn, q):
    conn.execute('CREATE TABLE "p" ("id" int PRIMARY KEY, "v" text) PARTITION BY RANGE ("id")')
    conn.execute('CREATE TABLE "p_low" PARTITION OF "p" FOR VALUES FROM (0) TO (100)')
    conn.execute('CREATE TABLE "p_high" PARTITION OF "p" FOR VALUES FROM (100) TO (200) PARTITION BY RANGE ("id")')
    conn.execute('CREATE TABLE "p_high_a" PARTITION OF "p_high" FOR VALUES FROM (100) TO (200)')
    table_id = q.add_table("q", "p")
    conn.execute("""INSERT INTO "p" VALUES (1, 'parent'), (150, 'parent')""")
    conn.execute("""INSERT INTO "p_low" VALUES (2, 'leaf')""")
    conn.execute("""INSERT INTO "p_high" VALUES (151, 'sub-parent')""")
    conn.execute("""UPDATE "p_high_a" SET "v" = 'leaf update' WHERE "id" = 150""")
    conn.execute("""DELETE FROM "p_low" WHERE "id" = 1""")
    events = read_events(q)
    assert {e.table for e in events} == {table_id}
    assert changes(events) == [
        ("I", [[1, "parent"], [150, "parent"]]),
        ("I", [[2, "leaf"]]),
        ("I", [[151, "sub-parent"]]),
        ("U", [[150, "leaf update"]]),
        ("D", [[1]]),
    ]
    q.remove_table("q", "p")
    for name in ("p", "p_low", "p_high", "p_high_a"):
        assert _triggers_on(conn, f'"{name}"') == [], name


def test_table_wider_than_100_columns(conn, q):
    columns = ", ".join(f'"c{i}" int' for i in range(150))
    conn.execute(f'CREATE TABLE "wide" ("id" int PRIMARY KEY, {columns}, "j" jsonb, "a" text[])')
    q.add_table("q", "wide", ignore=["c149"])
    conn.execute(f'''INSERT INTO "wide" VALUES (1, {", ".join(str(i) for i in range(150))}, '{{"k": 1}}', '{{x,y}}')''')
    conn.execute('UPDATE "wide" SET "c149" = -1')               # ignored column only: nothing
    conn.execute('UPDATE "wide" SET "c0" = -1')
    (inserted, updated) = read_events(q)
    assert inserted.items == [[1, *range(149), '{"k": 1}', '["x","y"]']]
    assert updated.type == "U" and updated.items == [[1, -1, *range(1, 149), '{"k": 1}', '["x","y"]']]


def test_key_without_equality_is_refused(conn, q):
    conn.execute('CREATE TABLE "docs" ("doc" json, "v" int)')
    with pytest.raises(UserError, match="cannot be compared"):
        q.add_table("q", "docs", key=["doc"])


def test_partition_created_after_table_add_is_captured(conn, q):
    conn.execute('CREATE TABLE "p" ("id" int PRIMARY KEY, "v" text) PARTITION BY RANGE ("id")')
    conn.execute('CREATE TABLE "p_low" PARTITION OF "p" FOR VALUES FROM (0) TO (100)')
    q.add_table("q", "p")
    conn.execute('CREATE TABLE "p_high" PARTITION OF "p" FOR VALUES FROM (100) TO (200)')
    conn.execute("""INSERT INTO "p_high" VALUES (150, 'leaf')""")
    assert [(e.type, e.items) for e in read_events(q) if e.type != "S"] == [("I", [[150, "leaf"]])]


def test_truncating_one_partition_makes_targets_copy_the_table_again(dsn, conn, q, tmp_path):
    conn.execute('CREATE TABLE "p" ("id" int PRIMARY KEY, "v" text) PARTITION BY RANGE ("id")')
    conn.execute('CREATE TABLE "p_low" PARTITION OF "p" FOR VALUES FROM (0) TO (100)')
    conn.execute('CREATE TABLE "p_high" PARTITION OF "p" FOR VALUES FROM (100) TO (200) PARTITION BY RANGE ("id")')
    conn.execute('CREATE TABLE "p_high_a" PARTITION OF "p_high" FOR VALUES FROM (100) TO (150)')
    conn.execute('CREATE TABLE "p_high_b" PARTITION OF "p_high" FOR VALUES FROM (150) TO (200)')
    table_id = q.add_table("q", "p")
    conn.execute("""INSERT INTO "p" SELECT g, 'v' || g FROM generate_series(1, 10) g""")
    conn.execute("""INSERT INTO "p" SELECT g, 'v' || g FROM generate_series(100, 199, 10) g""")
    replica = tmp_path / "replica.db"
    consumer = Consumer(dsn, "q", open_target(f"sqlite:{replica}"))
    try:
        consumer.run(until_caught_up=True)
        read_events(q)
        steps = [
            # one partition emptied among writes of its transaction; the others keep their rows
            """INSERT INTO "p" VALUES (11, 'low'), (105, 'high'); TRUNCATE "p_low";"""
            """ INSERT INTO "p_low" VALUES (12, 'after')""",
            'TRUNCATE "p_high_a", "p_low"',            # two partitions: one copy
            'TRUNCATE "p_high"',                       # a partition that is partitioned itself
            "INSERT INTO p VALUES (1, 'again'), (160, 'again'); TRUNCATE p",   # the whole table: T only
        ]
        queued, rows = [], []
        for step in steps:
            conn.execute(step)
            events = read_events(q)
            assert {e.table for e in events} == {table_id} and len({e.txid for e in events}) == 1
            queued.append([(e.type, e.data.get("copy") if e.type == "S" else len(e.items)) for e in events])
            consumer.run(until_caught_up=True)
            assert sqlite_rows(replica, "p") == source_rows(conn, "p"), step
            rows.append(sum(sqlite_rows(replica, "p").values()))
    finally:
        consumer.close()
        consumer.target.close()
    # no T for a partition (it would empty every partition at targets): a copy, once per transaction
    assert queued == [[("I", 2), ("S", True), ("I", 1)], [("S", True)], [("S", True)], [("I", 2), ("T", 0)]]
    assert rows == [12, 5, 0, 0]


def _inheritance_tree(conn) -> None:
    """p; its child c, whose columns are in another order after an extra one (other
    attnums than p's); c's child g, with one more column. Rows in each."""
    conn.execute('CREATE TABLE "p" ("id" int PRIMARY KEY, "v" text)')
    conn.execute('CREATE TABLE "c" ("extra" text, "v" text, "id" int NOT NULL)')
    conn.execute('ALTER TABLE "c" INHERIT "p"')
    conn.execute('CREATE TABLE "g" ("more" int) INHERITS ("c")')
    conn.execute("""INSERT INTO "p" SELECT i, 'p' || i FROM generate_series(1, 6) i""")
    conn.execute("""INSERT INTO "c" SELECT 'x', 'c' || i, i FROM generate_series(10, 16) i""")
    conn.execute("""INSERT INTO "g" ("id", "v", "more") SELECT i, 'g' || i, i FROM generate_series(20, 26) i""")


@pytest.mark.parametrize("mode", ["full", "pk"])
@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_inheritance_parent_replica_is_the_parent_with_its_descendants_whatever_table_a_statement_names(
        dsn, conn, q, tmp_path, mode, capture):
    _inheritance_tree(conn)
    table_id = q.add_table("q", "p", mode=mode, capture=capture)
    assert [_triggers_on(conn, f'"{t}"') for t in ("p", "c", "g")] == [[
        f"_replicator_{table_id}_{op}" for op in ("del", "ins", "trunc", "upd")]] * 3
    replica = tmp_path / "replica.db"
    consumer = Consumer(dsn, "q", open_target(f"sqlite:{replica}"))
    try:
        consumer.run(until_caught_up=True)
        assert sum(sqlite_rows(replica, "p").values()) == 20
        by_statement(read_events(q))
        steps = [
            """INSERT INTO "p" VALUES (7, 'p7'); INSERT INTO "c" ("id", "v") VALUES (17, 'c17');"""
            """ INSERT INTO "g" ("id", "v", "more") VALUES (27, 'g27', 0)""",
            # naming the parent: only its trigger fires, its transition tables hold every descendant's rows
            """UPDATE "p" SET "v" = "v" || '!' WHERE "id" % 2 = 0""",
            """UPDATE "p" SET "id" = "id" + 1000 WHERE "id" IN (3, 11, 21)""",     # keys change in each table
            """DELETE FROM "p" WHERE "id" % 3 = 0""",
            # naming a child: its trigger fires, for its rows and its child's
            """UPDATE "c" SET "v" = upper("v"), "extra" = 'y'""",
            """UPDATE "g" SET "id" = -"id" WHERE "id" < 25""",
            """DELETE FROM "c" WHERE "id" > 1000""",
            # a TRUNCATE that empties part of the tree: a copy; the whole tree: a T
            """TRUNCATE ONLY "p\"""",
            """TRUNCATE "g\"""",
            """INSERT INTO "p" VALUES (1, 'again'); TRUNCATE "c\"""",
            """INSERT INTO "g" ("id", "v") VALUES (30, 'g30'); TRUNCATE "p\"""",
            """INSERT INTO "p" VALUES (1, 'p'); INSERT INTO "c" ("id", "v") VALUES (2, 'c');"""
            """ INSERT INTO "g" ("id", "v") VALUES (3, 'g')""",
        ]
        truncates, sizes = [], []
        for step in steps:
            conn.execute(step)
            events = by_statement(read_events(q))
            assert {e.table for e in events} == {table_id}, step
            if "TRUNCATE" in step:
                truncates.append([(e.type, e.data.get("copy") if e.type == "S" else len(e.items)) for e in events])
            consumer.run(until_caught_up=True)
            assert sqlite_rows(replica, "p") == source_rows(conn, "p"), step
            sizes.append(sum(sqlite_rows(replica, "p").values()))
    finally:
        consumer.close()
        consumer.target.close()
    assert truncates == [[("S", True)], [("S", True)], [("I", 1), ("S", True)], [("I", 1), ("T", 0)]]
    assert sizes == [23, 23, 23, 17, 17, 17, 16, 10, 5, 1, 0, 3]


def test_a_partition_or_inheritance_child_is_refused_on_its_own_with_the_way_out(conn, q):
    _inheritance_tree(conn)
    conn.execute('CREATE TABLE "pt" ("id" int PRIMARY KEY) PARTITION BY RANGE ("id")')
    conn.execute('CREATE TABLE "pt_1" PARTITION OF "pt" FOR VALUES FROM (0) TO (10)')
    refusals = {
        "c": "table c inherits from p (statements naming p change its rows without firing its triggers):"
             " capture p instead, which includes its rows: replicator table add q p",
        "g": "table g inherits from c (statements naming c change its rows without firing its triggers):"
             " capture p instead, which includes its rows: replicator table add q p",
        "pt_1": "table pt_1 is a partition of pt (statements naming pt change its rows without firing its"
                " triggers): capture pt instead, which includes its rows: replicator table add q pt",
    }
    for table, message in refusals.items():
        with pytest.raises(UserError) as refused:
            q.add_table("q", table)
        assert str(refused.value) == message
        assert _triggers_on(conn, f'"{table}"') == []
    q.add_table("q", "p")
    with pytest.raises(UserError, match=r'^table c inherits from p, which queue "q" captures with its descendants:'
                                        r' its rows are captured already, as rows of p$'):
        q.add_table("q", "c")
    # trees whose capture could miss changes
    conn.execute('CREATE TABLE "r" ("id" int PRIMARY KEY)')
    conn.execute('CREATE TABLE "other" ("id" int NOT NULL)')
    conn.execute('CREATE TABLE "kid" () INHERITS ("r", "other")')
    with pytest.raises(UserError, match=r"^table kid inherits from other as well as from r \(statements naming"
                                        r" other would change its rows"):
        q.add_table("q", "r")
    conn.execute('ALTER TABLE "kid" NO INHERIT "other"')
    if conn.info.server_version < 180000:
        conn.execute('ALTER TABLE "kid" ALTER COLUMN "id" DROP NOT NULL')
        with pytest.raises(UserError, match=r"^key column\(s\) id of r may be NULL in its descendant kid"):
            q.add_table("q", "r")
    else:
        # PostgreSQL 18 keeps a NOT NULL a child inherits; one declared NO INHERIT (new in 18) is not inherited
        with pytest.raises(psycopg.errors.InvalidTableDefinition, match=r'^cannot drop inherited constraint'):
            conn.execute('ALTER TABLE "kid" ALTER COLUMN "id" DROP NOT NULL')
        conn.execute('CREATE TABLE "nn" ("id" int NOT NULL NO INHERIT)')
        conn.execute('CREATE TABLE "nn_kid" () INHERITS ("nn")')
        with pytest.raises(UserError, match=r"^key column\(s\) id of nn may be NULL in its descendant nn_kid"):
            q.add_table("q", "nn", key=["id"])
        assert _triggers_on(conn, '"nn"') == _triggers_on(conn, '"nn_kid"') == []
    assert _triggers_on(conn, '"r"') == _triggers_on(conn, '"kid"') == []
    conn.execute('ALTER TABLE "kid" ALTER COLUMN "id" SET NOT NULL')      # the way out
    q.add_table("q", "r")
    conn.execute('INSERT INTO "kid" VALUES (1)')
    assert changes(read_events(q)) == [("I", [[1]])]


@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_a_stored_row_filter_reads_its_strings_the_same_whatever_the_writers_session(conn, q, capture):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    # stored through the SQL function (the Python check refuses a backslash in a plain string)
    conn.execute(r"""SELECT replicator.add_table('q', 't', 'full', NULL, '{}', 'v <> ''a\b''', p_capture => %s)""",
                 (capture,))
    conn.execute("SET standard_conforming_strings = off")      # the writer's session reads 'a\b' as 'ab'
    conn.execute(r"INSERT INTO t VALUES (1, E'a\\b'), (2, 'ab')")
    conn.execute("RESET standard_conforming_strings")
    # the filter keeps its meaning as checked: only the row holding a backslash is left out
    assert changes(by_statement(read_events(q))) == [("I", [[2, "ab"]])]


@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_columns_named_like_the_capture_functions_variables_are_captured_and_filtered(conn, q, capture):
    conn.execute('CREATE TABLE t (id int PRIMARY KEY, found bool, tg_op text, v_slot int, "capture" text)')
    q.add_table("q", "t", where="found AND tg_op <> 'skip' AND v_slot > 0", capture=capture)
    conn.execute("INSERT INTO t VALUES (1, true, 'a', 1, 'c'), (2, false, 'b', 1, 'c'), (3, true, 'skip', 1, 'c')")
    conn.execute("UPDATE t SET v_slot = 2 WHERE id = 1")
    conn.execute("DELETE FROM t WHERE id = 1")
    assert changes(by_statement(read_events(q))) == [("I", [[1, True, "a", 1, "c"]]), ("U", [[1, True, "a", 2, "c"]]),
                                       ("D", [[1]])]


@pytest.mark.parametrize("capture", CAPTURE_KINDS)
def test_a_row_filter_keeps_the_same_rows_whatever_the_writers_time_zone_and_date_style(dsn, conn, q, capture):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, ts timestamptz, d date)")
    q.add_table("q", "t", where="ts < '2024-01-01 00:00' AND d > '01/02/2024'", capture=capture)    # UTC; January 2nd
    for number, (zone, style) in enumerate([("UTC", "ISO, MDY"), ("Asia/Tokyo", "SQL, DMY")], 1):
        with psycopg.connect(dsn, autocommit=True) as writer:
            writer.execute(f"SET TimeZone = '{zone}'")
            writer.execute(f"SET DateStyle = '{style}'")
            # the same instant (2023-12-31 20:00 UTC) and the same day (2024-01-15) from each session
            writer.execute("INSERT INTO t VALUES (%s, '2023-12-31 20:00+00', '2024-01-15')", (number,))
    assert [e.items[0][0] for e in by_statement(read_events(q))] == [1, 2]
