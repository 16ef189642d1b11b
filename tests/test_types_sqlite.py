"""Values keep their meaning in the replica (docs/sqlite.md, "Type mapping"):
numeric compares, sorts and aggregates as a number in SQLite (the answers of the
same queries in PostgreSQL), keys keep rows apart, `?numeric=text` keeps the
digits, date-times have one ISO 8601 form in SQLite and in streams, replicas of
the previous version keep their forms until their tables are copied again, and
incremental views over numeric columns equal their full recompute."""

from __future__ import annotations

import json
import math
import sqlite3
from contextlib import closing
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest

from consumer_helpers import run_cli, sqlite_reader, sqlite_rows, sqlite_types
from replicator import structure
from replicator.consumer import Consumer
from replicator.errors import UserError
from replicator.structure import Column
from replicator.targets.sqlite import target as sqlite_target
from replicator.targets.sqlite import types
from replicator.targets.sqlite.target import SqliteTarget, parse_url
from types_helpers import RENDERED, TIMES, TYPES, change, create, documented_time
from views_helpers import view_differences


def consume(dsn: str, path: Path, numeric: str | None = None) -> None:
    """A consumer of queue q, in this process, until caught up."""
    target = SqliteTarget(path, numeric=numeric)
    consumer = Consumer(dsn, "q", target)
    try:
        consumer.run(until_caught_up=True)
    finally:
        consumer.close()
        target.close()


def both(conn: psycopg.Connection, replica: Path, query: str) -> tuple[list[tuple], list[tuple]]:
    """The rows of one query in PostgreSQL and in the replica."""
    db = sqlite_reader(replica)
    try:
        return conn.execute(query).fetchall(), db.execute(query).fetchall()
    finally:
        db.close()


# numeric -------------------------------------------------------------------------------------

AMOUNTS = ["998.75", "6250.00", "1000.00", "1000.01", "-0.01", "0.00", "-6250.00", "12.5", "999.99", "NaN",
           "4200.10", "100.00", None]
RATIOS = ["0.1", "0.1234567890123456789", "-3", "12345678901234567890", "1e-20", "NaN", "0.000", None, "2.5",
          "99999999999999.5", "1.1", "7", "8"]


def test_numeric_queries_in_sqlite_give_postgresqls_answers(dsn, conn, source, tmp_path):
    conn.execute("CREATE TABLE pay (id int PRIMARY KEY, amount numeric(12,2), ratio numeric)")
    rows = list(zip(range(len(AMOUNTS)), AMOUNTS, RATIOS))
    conn.cursor().executemany("INSERT INTO pay VALUES (%s, %s, %s)", rows[:6])     # copied
    source.create_queue("q")
    source.add_table("q", "pay")
    replica = tmp_path / "r.db"
    consume(dsn, replica)
    conn.cursor().executemany("INSERT INTO pay VALUES (%s, %s, %s)", rows[6:])     # events
    conn.execute("UPDATE pay SET amount = amount * 2 WHERE id = 11")
    consume(dsn, replica)

    assert sqlite_types(replica, "pay") == {"id": "INTEGER", "amount": "NUMERIC", "ratio": "NUMERIC"}
    for query in ["SELECT count(*) FROM pay WHERE amount > 1000",        # NaN is above every number in both
                  "SELECT count(*) FROM pay WHERE amount BETWEEN -1 AND 999.99",
                  "SELECT id FROM pay WHERE amount IS NOT NULL ORDER BY amount, id",
                  "SELECT id FROM pay WHERE ratio IS NOT NULL ORDER BY ratio DESC, id",
                  "SELECT count(*) FROM pay WHERE ratio < 1"]:
        in_postgresql, in_sqlite = both(conn, replica, query)
        assert in_sqlite == in_postgresql, query
    in_postgresql, in_sqlite = both(conn, replica, "SELECT max(amount), min(amount), round(sum(amount), 2),"
                                                   " round(avg(amount), 2) FROM pay WHERE amount <> 'NaN'")
    assert in_sqlite == [tuple(float(v) for v in in_postgresql[0])]
    assert in_sqlite[0][0] == 6250       # the numeric max, not the text max ('998.75')
    # each value the nearest double of PostgreSQL's (exactly it up to 15 digits), NaN as text
    stored = sqlite_rows(replica, "pay", ["id"])
    for row_id, *_ in rows:
        source_row = conn.execute("SELECT amount::text, ratio::text FROM pay WHERE id = %s", (row_id,)).fetchone()
        for value, text in zip((stored[(row_id,)]["amount"], stored[(row_id,)]["ratio"]), source_row):
            if text is None or text == "NaN":
                assert value == text
            else:
                assert value == float(Decimal(text)) and isinstance(value, int | float), (row_id, text, value)
    assert stored[(1,)]["amount"] == 6250 and isinstance(stored[(1,)]["amount"], int)
    assert stored[(0,)]["ratio"] == 0.1 and stored[(1,)]["ratio"] == 0.12345678901234568


def test_numeric_values_beyond_the_double_range_are_infinite_or_zero_and_their_digits_kept_as_text(
        dsn, conn, source, tmp_path):
    # SQLite turns any number-like text in a NUMERIC column into a number: such values
    # cannot stay TEXT there (docs/sqlite.md, "Type mapping"); ?numeric=text keeps them.
    huge, tiny = "1" + "0" * 400, "0." + "0" * 400 + "1"
    longer_than_int_converts = "9" * 5000   # an integer Python's int() refuses (sys.get_int_max_str_digits())
    values = {1: huge, 2: "-" + huge, 3: tiny, 4: "Infinity", 5: "1e308", 6: longer_than_int_converts}
    conn.execute("CREATE TABLE big (id int PRIMARY KEY, v numeric)")
    conn.execute("INSERT INTO big VALUES (1, %s), (2, %s)", (values[1], values[2]))        # copied
    source.create_queue("q")
    source.add_table("q", "big")
    consume(dsn, tmp_path / "r.db")
    consume(dsn, tmp_path / "t.db", numeric="text")
    conn.cursor().executemany("INSERT INTO big VALUES (%s, %s)", [(k, v) for k, v in values.items() if k > 2])
    consume(dsn, tmp_path / "r.db")
    consume(dsn, tmp_path / "t.db", numeric="text")
    printed = dict(conn.execute("SELECT id, v::text FROM big").fetchall())
    with closing(sqlite3.connect(tmp_path / "r.db")) as db:
        assert dict((k, (v, t)) for k, v, t in db.execute("SELECT id, v, typeof(v) FROM big")) == {
            1: (math.inf, "real"), 2: (-math.inf, "real"), 3: (0, "integer"), 4: ("Infinity", "text"),
            5: (1e308, "real"), 6: (math.inf, "real")}
    with closing(sqlite3.connect(tmp_path / "t.db")) as db:
        assert dict(db.execute("SELECT id, v FROM big")) == printed
    assert printed[1] == huge and printed[3] == tiny and printed[6] == longer_than_int_converts


def test_numeric_keys_beyond_fifteen_digits_stay_text_and_keep_rows_apart(dsn, conn, source, tmp_path):
    conn.execute("CREATE TABLE k (k numeric PRIMARY KEY, v text); CREATE TABLE k2 (k numeric(15,2) PRIMARY KEY,"
                 " v text); CREATE TABLE amounts (id int PRIMARY KEY, amount numeric(12,2))")
    keys = ["1.0000000000000001", "1.0000000000000002", "12345678901234567890", "12345678901234567891", "5.00"]
    conn.cursor().executemany("INSERT INTO k VALUES (%s, 'copied')", [(k,) for k in keys])
    conn.execute("INSERT INTO k2 VALUES (1.50, 'a'), (1234567890123.45, 'b'); INSERT INTO amounts VALUES (1, 5)")
    source.create_queue("q")
    for name in ("k", "k2", "amounts"):
        source.add_table("q", name)
    replica = tmp_path / "r.db"
    consume(dsn, replica)
    conn.execute("UPDATE k SET v = 'updated' WHERE k = 1.0000000000000001; DELETE FROM k WHERE k = 12345678901234567891;"
                 " UPDATE k2 SET v = 'c' WHERE k = 1.5; DELETE FROM k2 WHERE k = 1234567890123.45")
    consume(dsn, replica)

    assert sqlite_types(replica, "k")["k"] == "TEXT" and sqlite_types(replica, "k2")["k"] == "NUMERIC"
    assert sqlite_rows(replica, "k", ["k"]) == {
        (k,): {"k": k, "v": "updated" if k == keys[0] else "copied"} for k in keys if k != keys[3]}
    assert sqlite_rows(replica, "k2", ["k"]) == {(1.5,): {"k": 1.5, "v": "c"}}
    db = sqlite_reader(replica)
    try:
        # A text key matches the text PostgreSQL prints, not a number literal (TEXT affinity
        # makes the literal text) ...
        assert db.execute("SELECT v FROM k WHERE k = '5.00'").fetchall() == [("copied",)]
        assert db.execute("SELECT v FROM k WHERE k = 5").fetchall() == []
        assert db.execute("SELECT v FROM k WHERE CAST(k AS NUMERIC) = 5").fetchall() == [("copied",)]
        # ... compares as a number with a NUMERIC column (NUMERIC affinity makes it a number) ...
        assert db.execute("SELECT a.id FROM k JOIN amounts a ON a.amount = k.k").fetchall() == [(1,)]
        # ... and sorts as text
        assert [k for (k,) in db.execute("SELECT k FROM k ORDER BY k")] == sorted(keys[:3] + keys[4:])
    finally:
        db.close()


def test_numeric_text_option_keeps_postgresqls_digits_and_is_kept_by_the_replica(dsn, conn, source, tmp_path):
    conn.execute("CREATE TABLE pay (id int PRIMARY KEY, amount numeric(12,2), ratio numeric);"
                 " INSERT INTO pay VALUES (1, 1.50, 0.10), (2, 0, 12345678901234567890.123456789),"
                 " (3, -0.01, 'NaN')")
    source.create_queue("q")
    source.add_table("q", "pay")
    replica = tmp_path / "r.db"
    done = run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}?numeric=text", "--until-caught-up")
    assert done.returncode == 0, done.stderr
    conn.execute("INSERT INTO pay VALUES (4, 7, 1.000); CREATE TABLE later (id int PRIMARY KEY, n numeric(5,1));"
                 " INSERT INTO later VALUES (1, 2.0)")
    source.add_table("q", "later")
    done = run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up")   # as recorded
    assert done.returncode == 0, done.stderr

    assert sqlite_types(replica, "pay") == {"id": "INTEGER", "amount": "TEXT", "ratio": "TEXT"}
    assert {k: (r["amount"], r["ratio"]) for (k,), r in sqlite_rows(replica, "pay", ["id"]).items()} == {
        1: ("1.50", "0.10"), 2: ("0.00", "12345678901234567890.123456789"), 3: ("-0.01", "NaN"),
        4: ("7.00", "1.000")}
    assert sqlite_rows(replica, "later", ["id"]) == {(1,): {"id": 1, "n": "2.0"}}

    before = replica.read_bytes()
    refused = run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}?numeric=number", "--until-caught-up")
    assert refused.returncode == 1
    assert refused.stderr.count("\n") == 1 and "was made with numeric=text" in refused.stderr
    assert "copy every table anew into a new replica" in refused.stderr and "Traceback" not in refused.stderr
    assert replica.read_bytes() == before
    bad = run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}?numeric=exact", "--until-caught-up")
    assert bad.returncode == 1 and "numeric=text" in bad.stderr and bad.stderr.count("\n") == 1


def test_a_question_mark_elsewhere_in_a_sqlite_path_is_part_of_the_path():
    assert parse_url("r.db") == ("r.db", None)
    assert parse_url("/data/r.db?numeric=text") == ("/data/r.db", "text")
    assert parse_url("/data/what?/r.db") == ("/data/what?/r.db", None)
    assert parse_url("/data/a?numeric=text/r.db") == ("/data/a?numeric=text/r.db", None)
    assert parse_url("r.db?numeric=text?numeric=number") == ("r.db?numeric=text", "number")
    with pytest.raises(UserError, match="numeric='exact'"):
        parse_url("r.db?numeric=exact")


@pytest.mark.parametrize(("text", "expected"), [
    (None, None), ("NaN", "NaN"), ("Infinity", "Infinity"), ("-Infinity", "-Infinity"), ("1.50", 1.5),
    ("5", 5.0), ("-0.0", -0.0), ("0.1", 0.1), ("12345678901234567.00", 12345678901234567),
    ("9223372036854775807", 9223372036854775807), ("9223372036854775808", 9.223372036854775808e18),
    ("123456789012345678901234567890.5", 1.2345678901234568e29)])
def test_numeric_values_become_python_numbers_correctly_rounded(text, expected):
    value = types.sqlite_number(text)
    assert value == expected and type(value) is type(expected)


# date-times ----------------------------------------------------------------------------------

FORMS = {   # PostgreSQL's JSON rendering -> the one form
    "timestamp without time zone": [
        ("2024-01-02T03:04:05", "2024-01-02T03:04:05.000000"), ("2024-01-02T03:04:05.5", "2024-01-02T03:04:05.500000"),
        ("2024-01-02T03:04:05.123456", "2024-01-02T03:04:05.123456"), ("infinity", "infinity"),
        ("-infinity", "-infinity"), ("0044-03-15T12:00:00.25 BC", "-0043-03-15T12:00:00.250000"),
        ("0001-01-01T00:00:00 BC", "0000-01-01T00:00:00.000000"),
        ("10000-01-01T00:00:00", "+10000-01-01T00:00:00.000000")],
    "timestamp with time zone": [
        ("2024-01-02T03:04:05+00:00", "2024-01-02T03:04:05.000000+00:00"),
        ("2024-01-02T05:04:05.5+02:00", "2024-01-02T03:04:05.500000+00:00"),
        ("2024-01-01T21:10:37+05:53:28", "2024-01-01T15:17:09.000000+00:00"),
        ("infinity", "infinity"), ("-infinity", "-infinity"),
        ("0044-03-15T00:30:00.25+01:00 BC", "-0043-03-14T23:30:00.250000+00:00"),
        ("0001-01-01T00:30:00+01:00", "0000-12-31T23:30:00.000000+00:00"),
        ("9999-12-31T23:30:00-01:00", "+10000-01-01T00:30:00.000000+00:00")],
    "date": [("2024-01-02", "2024-01-02"), ("0044-03-15 BC", "-0043-03-15"), ("10000-01-01", "+10000-01-01"),
             ("infinity", "infinity"), ("-infinity", "-infinity")],
    "time without time zone": [("03:04:05", "03:04:05.000000"), ("03:04:05.25", "03:04:05.250000"),
                               ("24:00:00", "24:00:00.000000")],
    "time with time zone": [("03:04:05+05:30", "03:04:05.000000+05:30"), ("03:04:05.1-08", "03:04:05.100000-08:00"),
                            ("03:04:05-00:00:12", "03:04:05.000000-00:00:12")],
}


def column(base_type: str, name: str = "c") -> Column:
    return Column(name=name, type=base_type, base_type=base_type, category="D", not_null=False)


@pytest.mark.parametrize(("base_type", "rendered", "expected"),
                         [(t, r, e) for t, cases in FORMS.items() for r, e in cases])
def test_date_times_are_decoded_into_one_iso_form(base_type, rendered, expected):
    assert structure.decoder_for(column(base_type))(rendered) == expected


def previous_decoder(base_type: str, rendered: str) -> str:
    """What the version before the one form stored: PostgreSQL's rendering, timestamptz
    through Python's isoformat() where it could parse it."""
    if base_type == "timestamp with time zone":
        try:
            return datetime.fromisoformat(rendered).astimezone(UTC).isoformat()
        except (ValueError, OverflowError):
            return rendered
    return rendered


@pytest.mark.parametrize(("base_type", "rendered"), [(t, r) for t, cases in FORMS.items() for r, _ in cases
                                                     if t != "timestamp with time zone" or r.endswith("+00:00")
                                                     or r.endswith("infinity")])
def test_tables_of_the_previous_version_get_their_values_in_its_forms(base_type, rendered):
    legacy = types.value_adapters([column(base_type)], ["TEXT"], types.LEGACY_FORMS)[0]
    assert legacy(structure.decoder_for(column(base_type))(rendered)) == previous_decoder(base_type, rendered)


DATETIMES = """
    CREATE TABLE moments (id int PRIMARY KEY, ts timestamp, tstz timestamptz, t time, ttz timetz, d date);
    INSERT INTO moments VALUES
        (1, '2024-01-02 03:04:05', '2024-01-02 03:04:05+00', '03:04:05', '03:04:05+00', '2024-01-02'),
        (2, '2024-01-02 03:04:05.5', '2024-01-02 05:04:05.123456+02', '03:04:05.25', '03:04:05.1-08', '0999-12-31'),
        (3, 'infinity', 'infinity', '24:00:00', '00:00:00+05:30', 'infinity'),
        (4, '-infinity', '-infinity', '00:00:00', '23:59:59.999999-00:00:12', '-infinity'),
        (5, '0044-03-15 12:00:00.25 BC', '0044-03-15 12:00:00+00 BC', NULL, NULL, '0044-03-15 BC'),
        (6, '10000-01-01 00:00:00', '12345-06-07 08:09:10.5+00', NULL, NULL, '10000-01-01'),
        (7, '1999-12-31 23:59:59.999999', '1999-12-31 23:00:00-01', '23:59:59.999999', NULL, '1999-12-31');
"""
MOMENTS = {
    1: ("2024-01-02T03:04:05.000000", "2024-01-02T03:04:05.000000+00:00", "03:04:05.000000",
        "03:04:05.000000+00:00", "2024-01-02"),
    2: ("2024-01-02T03:04:05.500000", "2024-01-02T03:04:05.123456+00:00", "03:04:05.250000",
        "03:04:05.100000-08:00", "0999-12-31"),
    3: ("infinity", "infinity", "24:00:00.000000", "00:00:00.000000+05:30", "infinity"),
    4: ("-infinity", "-infinity", "00:00:00.000000", "23:59:59.999999-00:00:12", "-infinity"),
    5: ("-0043-03-15T12:00:00.250000", "-0043-03-15T12:00:00.000000+00:00", None, None, "-0043-03-15"),
    6: ("+10000-01-01T00:00:00.000000", "+12345-06-07T08:09:10.500000+00:00", None, None, "+10000-01-01"),
    7: ("1999-12-31T23:59:59.999999", "2000-01-01T00:00:00.000000+00:00", "23:59:59.999999", None, "1999-12-31"),
}


@pytest.mark.parametrize("how", ["copy", "events"])
def test_date_times_have_one_form_in_sqlite_and_in_jsonl(dsn, conn, source, tmp_path, how):
    create, rows = DATETIMES.split("INSERT", 1)
    conn.execute(create)
    if how == "copy":
        conn.execute("INSERT" + rows)
    source.create_queue("q")
    source.add_table("q", "moments")
    replica, stream = tmp_path / "r.db", tmp_path / "changes.jsonl"
    consume(dsn, replica)
    done = run_cli(dsn, "consume", "q", "--target", f"jsonl:{stream}", "--until-caught-up")
    assert done.returncode == 0, done.stderr
    if how == "events":
        with psycopg.connect(dsn, autocommit=True) as app:
            app.execute("SET TimeZone = 'Asia/Kolkata'; SET DateStyle = 'SQL, DMY'")
            app.execute("INSERT" + rows)
        consume(dsn, replica)
        done = run_cli(dsn, "consume", "q", "--target", f"jsonl:{stream}", "--until-caught-up")
        assert done.returncode == 0, done.stderr

    names = ["ts", "tstz", "t", "ttz", "d"]
    in_sqlite = {k: tuple(r[n] for n in names) for (k,), r in sqlite_rows(replica, "moments", ["id"]).items()}
    assert in_sqlite == MOMENTS
    streamed = [json.loads(line) for line in stream.read_text().splitlines()]
    in_jsonl = {c["row"]["id"]: tuple(c["row"][n] for n in names) for c in streamed if c["op"] in ("I", "R")}
    assert in_jsonl == MOMENTS
    # As text, AD values of four-digit years and the infinities sort as PostgreSQL sorts them.
    ordinary = "SELECT id FROM moments WHERE id NOT IN (5, 6) ORDER BY {}, id"
    for name in ("ts", "tstz", "d"):
        in_postgresql, in_sqlite_order = both(conn, replica, ordinary.format(name))
        assert in_sqlite_order == in_postgresql, name


# replicas of the previous version ----------------------------------------------------------------

def previous_sqlite_type(column: Column, **_: object) -> str:
    """The previous version's mapping: numeric as TEXT."""
    return "TEXT" if column.base_type == "numeric" else types.sqlite_type(column)


def previous_decoder_for(column: Column) -> structure.Decoder:
    """The previous version's decoders: date-times as PostgreSQL rendered them, timestamptz
    through isoformat()."""
    if column.category != "A" and column.base_type in types._LEGACY:
        return lambda value: None if value is None else previous_decoder(column.base_type, value)
    return current_decoder_for(column)


current_decoder_for = structure.decoder_for
OLD_TABLE = """
    CREATE TABLE old (id int PRIMARY KEY, amount numeric(12,2), ts timestamp, tstz timestamptz, t time);
    INSERT INTO old VALUES (1, 1.50, '2024-01-02 03:04:05', '2024-01-02 03:04:05+00', '03:04:05'),
                           (2, 1000.00, '2024-01-02 03:04:05.5', '2024-01-02 03:04:05.25+00', '03:04:05.5');
"""


def test_a_replica_of_the_previous_version_keeps_its_forms_until_a_table_is_copied_again(
        dsn, conn, source, tmp_path, monkeypatch):
    conn.execute(OLD_TABLE)
    source.create_queue("q")
    source.add_table("q", "old")
    replica = tmp_path / "r.db"
    # made by the previous version: its type mapping and decoders, no record of forms or settings
    with monkeypatch.context() as previous:
        previous.setattr(sqlite_target, "sqlite_type", previous_sqlite_type)
        previous.setattr(structure, "decoder_for", previous_decoder_for)
        consume(dsn, replica)
    db = sqlite3.connect(replica)
    db.execute("DROP TABLE _replicator_value_forms")
    db.execute("DROP TABLE _replicator_settings")
    db.commit()
    db.close()
    made = sqlite_rows(replica, "old", ["id"])
    assert made[(1,)] == {"id": 1, "amount": "1.50", "ts": "2024-01-02T03:04:05",
                          "tstz": "2024-01-02T03:04:05+00:00", "t": "03:04:05"}

    conn.execute("INSERT INTO old VALUES (3, 2.50, '2024-01-03 00:00:00', '2024-01-03 00:00:00+00', '00:00:00'),"
                 " (4, 3.25, '2024-01-03 00:00:00.5', '2024-01-03 00:00:00.5+00', '00:00:00.5');"
                 " CREATE TABLE fresh (id int PRIMARY KEY, amount numeric(12,2), ts timestamp);"
                 " INSERT INTO fresh VALUES (1, 1.50, '2024-01-02 03:04:05')")
    source.add_table("q", "fresh")
    consume(dsn, replica)
    assert sqlite_types(replica, "old")["amount"] == "TEXT"
    kept = sqlite_rows(replica, "old", ["id"])
    assert {k: kept[k] for k in made} == made        # old rows untouched
    assert kept[(3,)] == {"id": 3, "amount": "2.50", "ts": "2024-01-03T00:00:00",
                          "tstz": "2024-01-03T00:00:00+00:00", "t": "00:00:00"}
    assert kept[(4,)] == {"id": 4, "amount": "3.25", "ts": "2024-01-03T00:00:00.5",
                          "tstz": "2024-01-03T00:00:00.500000+00:00", "t": "00:00:00.5"}
    # a table added since is the new version's
    assert sqlite_rows(replica, "fresh", ["id"]) == {(1,): {"id": 1, "amount": 1.5, "ts": "2024-01-02T03:04:05.000000"}}

    # a column added in place follows its table's forms: TEXT beside the old table's numerics
    conn.execute("ALTER TABLE old ADD COLUMN extra numeric(12,2); ALTER TABLE fresh ADD COLUMN extra numeric(12,2);"
                 " INSERT INTO old (id, extra) VALUES (5, 4.75); INSERT INTO fresh VALUES (2, 1, now(), 4.75)")
    consume(dsn, replica)
    assert (sqlite_types(replica, "old")["extra"], sqlite_types(replica, "fresh")["extra"]) == ("TEXT", "NUMERIC")
    assert sqlite_rows(replica, "old", ["id"])[(5,)]["extra"] == "4.75"
    assert sqlite_rows(replica, "fresh", ["id"])[(2,)]["extra"] == 4.75

    conn.execute("ALTER TABLE old ALTER COLUMN amount TYPE numeric(14,2)")   # copied again
    consume(dsn, replica)
    assert sqlite_types(replica, "old")["amount"] == "NUMERIC"
    assert sqlite_rows(replica, "old", ["id"])[(1,)] == {
        "id": 1, "amount": 1.5, "ts": "2024-01-02T03:04:05.000000", "tstz": "2024-01-02T03:04:05.000000+00:00",
        "t": "03:04:05.000000", "extra": None}
    assert sqlite_types(replica, "old")["extra"] == "NUMERIC"


# views ---------------------------------------------------------------------------------------

def test_incremental_views_of_numeric_columns_equal_their_full_recompute(dsn, conn, source, tmp_path):
    conn.execute("CREATE TABLE orders (id int PRIMARY KEY, customer_id int, amount numeric(12,2));"
                 " INSERT INTO orders SELECT g, g % 5, (g * 37 % 1000) + 0.25 * (g % 4) FROM generate_series(1, 200) g;"
                 " INSERT INTO orders VALUES (2001, 1, 6250.00), (2003, 1, 998.75)")
    source.create_queue("q")
    source.add_table("q", "orders")
    replica = tmp_path / "r.db"
    consume(dsn, replica)
    sql = ("SELECT customer_id, count(*) AS n, round(sum(amount), 2) AS total, max(amount) AS top,"
           " min(amount) AS low FROM orders GROUP BY customer_id")
    created = run_cli(dsn, "view", "create", "by_customer", "--target", f"sqlite:{replica}", "--sql", sql,
                      "--policy", "incremental")
    assert created.returncode == 0 and "maintained incrementally" in created.stdout, created.stderr

    conn.execute("UPDATE orders SET amount = amount + 0.01 WHERE id % 7 = 0; DELETE FROM orders WHERE id % 11 = 0;"
                 " INSERT INTO orders VALUES (1003, 2, 7000.50), (1004, 3, -12.75); DELETE FROM orders WHERE id = 2003")
    consume(dsn, replica)
    db = sqlite_reader(replica)
    try:
        assert view_differences(db, "by_customer", sql) is None
        top = db.execute("SELECT top FROM by_customer WHERE customer_id = 1").fetchone()[0]
    finally:
        db.close()
    assert top == 6250       # the numeric max, not the text max ('999.x')


# every documented type -----------------------------------------------------------------------

# docs/sqlite.md's "Type mapping": the columns of types_helpers.TYPES by how SQLite holds them
INTEGERS = {"i2", "i4", "i8", "o", "x", "c", "pos"}
FLOATS = {"r", "f"}
NUMERICS = {"n", "n38", "nu", "n40", "nneg", "amt"}
FLOAT_WORDS = {"NaN", "Infinity", "-Infinity"}


def iso_date(text: str) -> str:
    """PostgreSQL's ISO date as the one form: astronomical years, expanded past 9999."""
    if text.endswith("infinity"):
        return text
    day, bc = text.removesuffix(" BC"), text.endswith(" BC")
    year, rest = day.split("-", 1)
    number = 1 - int(year) if bc else int(year)
    sign = "-" if number < 0 else "+" if number > 9999 else ""
    return f"{sign}{abs(number):04d}-{rest}"


def sqlite_value(name: str, text: str | None) -> Any:
    """A value as docs/sqlite.md's table says SQLite holds it, from PostgreSQL's text of it."""
    if text is None or name in TIMES:
        return text if text is None else documented_time(text)
    if name in INTEGERS:
        return int(text)
    if name == "flag":
        return {"t": 1, "f": 0}[text]
    if name in FLOATS | NUMERICS and text in FLOAT_WORDS:
        return text
    if name in FLOATS:
        return float(text)
    if name in NUMERICS:
        number = Decimal(text)
        whole = number == number.to_integral_value() and -2**63 <= number < 2**63
        return int(number) if whole else float(number)
    if name == "blob":
        return bytes.fromhex(text[2:])
    if name == "d":
        return iso_date(text)
    if name == "ts":
        day, _, time = text.partition(" ")
        return text if text.endswith("infinity") else f"{iso_date(day)}T{documented_time(time)}"
    if name == "tstz":
        return text if text.endswith("infinity") else text.replace(" ", "T") + "+00:00"
    return text


def documented_sqlite_state(conn: psycopg.Connection) -> dict[tuple[Any, ...], dict[str, Any]]:
    renders = {"tstz": "CASE WHEN isfinite(tstz) THEN to_char(tstz AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US')"
                       " ELSE tstz::text END"}
    columns = [name for name, *_ in TYPES]
    texts = [renders.get(name) or (render.format(name) if render.startswith("to_json") else RENDERED.format(name))
             for name, _, _, _, render in TYPES]
    state = {}
    for id_, *values in conn.execute(f"SELECT id, {', '.join(texts)} FROM t").fetchall():
        state[(id_,)] = {"id": id_, **{name: sqlite_value(name, text) for name, text in zip(columns, values)}}
    return state


def typed(rows: dict[tuple[Any, ...], dict[str, Any]]) -> dict[tuple[Any, ...], dict[str, tuple[str, Any]]]:
    """Rows with each value's Python type beside it: 1 and 1.0, '1' and 1 differ."""
    return {k: {c: (type(v).__name__, v) for c, v in row.items()} for k, row in rows.items()}


def test_every_documented_type_is_copied_and_changed_into_the_documented_sqlite_value(dsn, conn, source, tmp_path):
    create(conn, copied=True)
    source.create_queue("q")
    source.add_table("q", "t")
    replica = tmp_path / "r.db"
    consume(dsn, replica)
    change(conn)
    consume(dsn, replica)
    expected = documented_sqlite_state(conn)
    assert sorted(expected) == [(1,), (2,), (4,), (5,), (6,)]
    assert typed(sqlite_rows(replica, "t", ["id"])) == typed(expected)
