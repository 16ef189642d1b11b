"""The apply path's fast paths give exactly what the plain code gives:
parse_json, the timestamptz shortcut, generated row decoders, and runs of
consecutive events applied in one target call."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from functools import partial

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replicator.consumer import Consumer
from replicator.structure import Column, _timestamptz_to_utc, decoder_for, parse_json, rows_decoder
from replicator.targets import open_target

plain_parse = partial(json.loads, parse_float=str)


def plain_timestamptz(value):
    return datetime.fromisoformat(value).astimezone(UTC).isoformat(timespec="microseconds")


def plain_decode(decoders, items):
    return [tuple(d(v) for d, v in zip(decoders, item)) for item in items]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=12)


@given(json_values, st.sampled_from(["", " ", "\n"]), st.sampled_from(["", " ", "\t\n"]))
def test_parse_json_is_json_loads_with_text_floats(value, before, after):
    text = before + json.dumps(value) + after
    assert parse_json(text) == plain_parse(text)


@pytest.mark.parametrize("text", ["", "[1,", "[1] x", "[1][2]", "nul", " "])
def test_parse_json_raises_what_json_loads_raises(text):
    with pytest.raises(json.JSONDecodeError):
        plain_parse(text)
    with pytest.raises(json.JSONDecodeError):
        parse_json(text)


def _pg_rendering(moment: datetime, offset_minutes: int, digits: int) -> str:
    """A timestamptz as PostgreSQL's JSON renders it: fraction without trailing zeros."""
    local = moment.astimezone(timezone(timedelta(minutes=offset_minutes)))
    text = f"{local.year:04d}" + local.strftime("-%m-%dT%H:%M:%S")   # %Y: no padding below 1000
    fraction = f"{local.microsecond:06d}"[:digits].rstrip("0")
    if fraction:
        text += "." + fraction
    sign = "-" if offset_minutes < 0 else "+"
    return f"{text}{sign}{abs(offset_minutes) // 60:02d}:{abs(offset_minutes) % 60:02d}"


@settings(max_examples=500)
@given(st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30), timezones=st.just(UTC)),
       st.sampled_from([0, 0, 0, 60, -210, 330]), st.integers(0, 6))
def test_timestamptz_shortcut_gives_what_the_conversion_gives(moment, offset, digits):
    text = _pg_rendering(moment, offset, digits)
    assert _timestamptz_to_utc(text) == plain_timestamptz(text)


@pytest.mark.parametrize(("text", "expected"), [
    (None, None), ("infinity", "infinity"), ("-infinity", "-infinity"),
    ("2020-01-01T00:00:00+00:00 BC", "-2019-01-01T00:00:00.000000+00:00"),
    ("12345-01-01T00:00:00+00:00", "+12345-01-01T00:00:00.000000+00:00"),
    ("12345-01-01T00:00:00.12345+00:00", "+12345-01-01T00:00:00.123450+00:00"),
    ("0999-06-01T12:00:00.5+00:00", "0999-06-01T12:00:00.500000+00:00"),
    ("2020-01-01T00:00:00.100000+00:00", "2020-01-01T00:00:00.100000+00:00")])
def test_timestamptz_values_the_shortcut_does_not_take_get_the_one_form(text, expected):
    assert _timestamptz_to_utc(text) == expected


def col(base_type: str, category: str = "N") -> Column:
    return Column(name="c", type=base_type, base_type=base_type, category=category, not_null=False)


COLUMNS = [col("bigint"), col("text", "S"), col("boolean", "B"), col("double precision"), col("numeric"),
           col("timestamp with time zone", "D"), col("bytea", "U"), col("integer[]", "A"), col("jsonb", "U")]

VALUES = {
    "bigint": st.none() | st.integers(),
    "text": st.none() | st.text(),
    "boolean": st.none() | st.booleans(),
    "double precision": st.none() | st.integers() | st.sampled_from(["NaN", "Infinity", "-Infinity", "1.5", "-0.0"]),
    "numeric": st.none() | st.integers() | st.sampled_from(["1.50", "-0.000", "12345678901234567890.1"]),
    "timestamp with time zone": st.none() | st.sampled_from(["2024-02-29T23:59:59.999999+00:00",
                                                             "2024-02-29T23:59:59+01:00", "infinity"]),
    "bytea": st.none() | st.binary(max_size=8).map(lambda b: "\\x" + b.hex()),
    "integer[]": st.none() | st.sampled_from(["[1, 2]", "[]"]),
    "jsonb": st.none() | st.sampled_from(['{"a": 1}', "[]"]),
}


@st.composite
def table_and_items(draw):
    columns = draw(st.lists(st.sampled_from(COLUMNS), min_size=1, max_size=6))
    row = st.tuples(*(VALUES[c.base_type] for c in columns)).map(list)
    items = draw(st.lists(row, max_size=5))
    return columns, items


@given(table_and_items())
def test_generated_row_decoder_gives_what_per_value_decoding_gives(case):
    columns, items = case
    decoders = [decoder_for(c) for c in columns]
    expected = plain_decode(decoders, items)
    got = rows_decoder(decoders)([list(i) for i in items])
    assert [tuple(r) for r in got] == expected


@pytest.mark.parametrize("columns", [[col("bigint"), col("text", "S")], [col("bigint"), col("boolean", "B")]])
def test_rows_of_another_length_are_decoded_as_zip_decodes_them(columns):
    decoders = [decoder_for(c) for c in columns]
    items = [[1, True], [2], [3, False, "extra"]]
    got = rows_decoder(decoders)([list(i) for i in items])
    assert [tuple(r) for r in got] == plain_decode(decoders, items)


def test_runs_of_events_keep_the_order_of_changes_across_tables_and_types(dsn, conn, source, tmp_path):
    conn.execute("CREATE TABLE a (id int PRIMARY KEY, v text)")
    conn.execute("CREATE TABLE b (id int PRIMARY KEY, v text)")
    source.create_queue("q")
    source.add_table("q", "a")
    source.add_table("q", "b")
    stream = tmp_path / "changes.jsonl"
    target = open_target(f"jsonl:{stream}")
    consumer = Consumer(dsn, "q", target, name="c")
    try:
        consumer.run(until_caught_up=True)
        with conn.transaction():
            conn.execute("INSERT INTO a VALUES (1, 'x')")
            conn.execute("INSERT INTO a VALUES (2, 'x')")
            conn.execute("UPDATE a SET v = 'y' WHERE id = 1")
            conn.execute("UPDATE a SET v = 'z' WHERE id = 1")
            conn.execute("INSERT INTO b VALUES (1, 'x')")
            conn.execute("UPDATE a SET v = 'w' WHERE id = 1")
            conn.execute("DELETE FROM a WHERE id = 1")
            conn.execute("DELETE FROM a WHERE id = 2")
            conn.execute("INSERT INTO a VALUES (1, 'again')")
        conn.execute("INSERT INTO a SELECT g, 'many' FROM generate_series(10, 12) g")
        conn.execute("INSERT INTO a VALUES (13, 'one')")
        consumer.run(until_caught_up=True)
    finally:
        consumer.close()
        target.close()
    lines = [json.loads(line) for line in stream.read_text().splitlines()]
    assert [(r["op"], r["table"], r.get("row", r.get("key"))) for r in lines] == [
        ("I", "public.a", {"id": 1, "v": "x"}),
        ("I", "public.a", {"id": 2, "v": "x"}),
        ("U", "public.a", {"id": 1, "v": "y"}),
        ("U", "public.a", {"id": 1, "v": "z"}),
        ("I", "public.b", {"id": 1, "v": "x"}),
        ("U", "public.a", {"id": 1, "v": "w"}),
        ("D", "public.a", {"id": 1}),
        ("D", "public.a", {"id": 2}),
        ("I", "public.a", {"id": 1, "v": "again"}),
        ("I", "public.a", {"id": 10, "v": "many"}),
        ("I", "public.a", {"id": 11, "v": "many"}),
        ("I", "public.a", {"id": 12, "v": "many"}),
        ("I", "public.a", {"id": 13, "v": "one"}),
    ]


def test_runs_of_updates_to_one_key_leave_the_last_values_in_sqlite(dsn, conn, source, tmp_path):
    import sqlite3
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v int)")
    source.create_queue("q")
    source.add_table("q", "t")
    target = open_target(f"sqlite:{tmp_path / 'r.db'}")
    consumer = Consumer(dsn, "q", target, name="c")
    try:
        consumer.run(until_caught_up=True)
        with conn.transaction():
            conn.execute("INSERT INTO t VALUES (1, 0), (2, 0)")
            for i in range(1, 50):
                conn.execute("UPDATE t SET v = %s WHERE id = 1", (i,))
            conn.execute("DELETE FROM t WHERE id = 2")
            conn.execute("INSERT INTO t VALUES (2, 7)")
            conn.execute("DELETE FROM t WHERE id = 2")
        consumer.run(until_caught_up=True)
    finally:
        consumer.close()
        target.close()
    with sqlite3.connect(tmp_path / "r.db") as lite:
        assert lite.execute("SELECT id, v FROM t ORDER BY id").fetchall() == [(1, 49)]


def test_batches_are_sized_by_rows_at_the_rows_per_event_seen():
    from replicator.consumer import BATCH_ROWS, batch_event_limit
    assert batch_event_limit(100000, 1000.0) == BATCH_ROWS // 1000
    assert batch_event_limit(100000, 1.0) == 100000          # the cap
    assert batch_event_limit(1, 2.5) == 1                    # a user's smaller cap wins
    assert batch_event_limit(100000, 1e9) == 1               # at least one event (next_batch: one tick)


def test_a_consumer_learns_rows_per_event_and_forgets_a_bulk_load_by_halves(dsn, conn, source, tmp_path):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v int)")
    source.create_queue("q")
    source.add_table("q", "t")
    target = open_target(f"sqlite:{tmp_path / 'r.db'}")
    consumer = Consumer(dsn, "q", target, name="c")
    try:
        consumer.run(until_caught_up=True)
        conn.execute("INSERT INTO t SELECT g, 0 FROM generate_series(1, 999) g")
        consumer.run(until_caught_up=True)
        assert consumer.rows_per_event == 999.0
        for i in range(1, 11):
            conn.execute("UPDATE t SET v = v + 1 WHERE id = %s", (i,))
        consumer.run(until_caught_up=True)
        assert consumer.rows_per_event == 499.5
    finally:
        consumer.close()
        target.close()
