"""The records of the Kafka topics (replicator.targets.kafka.envelope): keys and values as
Debezium's PostgreSQL connector writes them through Kafka Connect's JsonConverter, valid
Connect data for their schemas, and exact for followers: every value of every type comes
back as replicator's decoders gave it, special values included. No broker is needed."""

from __future__ import annotations

import base64
import calendar
import json
import math
from collections.abc import Sequence
from datetime import date
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replicator import __version__
from replicator.errors import UserError
from replicator.source.db import SESSION_SETTINGS
from replicator.structure import Column, TableStructure, parse_json
from replicator.targets.kafka.envelope import (
    DecodedChange,
    EnvelopeSettings,
    TableEnvelope,
    decode_schema_change,
    schema_change_key,
    schema_change_value,
)

SETTINGS = EnvelopeSettings(prefix="shop", database="appdb")
TS_US = 1_700_000_000_123_456   # microseconds


def column(name: str, type_: str, base_type: str | None = None, category: str = "X", not_null: bool = False,
           default: str | None = None) -> Column:
    return Column(name=name, type=type_, base_type=base_type or type_, category=category, not_null=not_null,
                  default=default)


ID = column("id", "integer", category="N", not_null=True)


def table(*columns: Column, key: Sequence[str] = ("id",), name: str = "t") -> TableStructure:
    return TableStructure(schema="public", name=name, columns=tuple(columns), key=tuple(key))


def source_of(envelope: TableEnvelope, **changes: Any) -> str:
    return envelope.source(**{"ts_us": TS_US - 5, "snapshot": "false", "tick": 7, "event": 42, "txid": 1234,
                              **changes})


# Connect data as JsonConverter reads it ------------------------------------------------------

INT_RANGES = {"int8": 8, "int16": 16, "int32": 32, "int64": 64}
JACKSON_NON_FINITE = {"NaN", "Infinity", "-Infinity"}   # Jackson quotes Java's non-finite doubles


def connect_errors(schema: dict[str, Any], value: Any, path: str = "$") -> list[str]:
    """Where a payload does not fit its Connect schema, as JsonConverter with schemas reads it:
    required fields present, every value of its schema's type, logical types' forms."""
    if value is None:
        return [] if schema.get("optional") or "default" in schema else [f"{path}: null for a required field"]
    kind = schema["type"]
    if kind == "struct":
        if not isinstance(value, dict):
            return [f"{path}: a struct is not an object"]
        names = [f["field"] for f in schema["fields"]]
        errors = [f"{path}: {k} is not a field" for k in value if k not in names]
        for f in schema["fields"]:
            errors += connect_errors(f, value.get(f["field"]), f"{path}.{f['field']}")
        return errors
    if kind in INT_RANGES:
        bits = INT_RANGES[kind]
        fits = isinstance(value, int) and not isinstance(value, bool) and -2**(bits - 1) <= value < 2**(bits - 1)
        return [] if fits else [f"{path}: {value!r} is not {kind}"]
    if kind in ("float", "double"):
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return [] if number or value in JACKSON_NON_FINITE else [f"{path}: {value!r} is not {kind}"]
    if kind == "boolean":
        return [] if isinstance(value, bool) else [f"{path}: {value!r} is not boolean"]
    if kind == "string":
        return [] if isinstance(value, str) else [f"{path}: {value!r} is not a string"]
    if kind == "bytes":
        try:
            base64.b64decode(value, validate=True)
        except (TypeError, ValueError):
            return [f"{path}: {value!r} is not base64"]
        return []
    if kind == "array":
        if not isinstance(value, list):
            return [f"{path}: an array is not a list"]
        return [e for i, item in enumerate(value) for e in connect_errors(schema["items"], item, f"{path}[{i}]")]
    if kind == "map":
        if schema["keys"]["type"] != "string" or not isinstance(value, dict):
            return [f"{path}: a map of strings is not an object"]
        return [e for k, v in value.items() for e in connect_errors(schema["values"], v, f"{path}[{k}]")]
    return [f"{path}: unknown type {kind}"]


def payload_of(record: bytes, envelope_settings: EnvelopeSettings = SETTINGS) -> Any:
    """The payload of a record, checked against its schema as JsonConverter would."""
    data = json.loads(record)
    if not envelope_settings.schemas:
        assert "schema" not in data or "payload" not in data
        return data
    assert set(data) == {"schema", "payload"}
    errors = connect_errors(data["schema"], data["payload"])
    assert not errors, errors
    return data["payload"]


def same(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Equal values of equal types (1 is not 1.0 nor True)."""
    return len(a) == len(b) and all(type(x) is type(y) and x == y for x, y in zip(a, b))


def round_trip(structure: TableStructure, row: Sequence[Any], envelope_settings: EnvelopeSettings = SETTINGS) -> None:
    """A row through every record a publisher writes of it, back through a follower's decoding."""
    envelope = TableEnvelope(structure, envelope_settings)
    source = source_of(envelope)
    key = [row[i] for i in structure.key_positions()]
    key_record, header = envelope.key(key), envelope.key_header(key)
    payload_of(key_record, envelope_settings)
    assert same(envelope.decode_key(key_record, header), key), (envelope.decode_key(key_record, header), key)
    for op in ("c", "u", "r"):
        record = envelope.value(op, row, source, TS_US)
        payload_of(record, envelope_settings)
        change = envelope.decode_value(record)
        assert change.op == op and change.before is None
        assert change.after is not None and same(change.after, row), (change.after, row)
    deleted = envelope.decode_value(envelope.delete_value(key, source, TS_US))
    assert deleted.before is not None and deleted.after is None
    assert same(envelope.deleted_key(deleted), key)


# every type, as PostgreSQL renders it --------------------------------------------------------

ALL_TYPES = """
    CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
    CREATE TYPE pair AS (a int, b text);
    CREATE DOMAIN price AS numeric(8, 2);
    CREATE TABLE every (
        id int PRIMARY KEY, i2 smallint, i8 bigint, o oid, b boolean, r real, d double precision,
        n numeric(12,2), nv numeric, nneg numeric(3,-2), np price, by bytea, t text, vc varchar(10), ch char(3),
        c1 "char", nm name, u uuid, j json, jb jsonb, x xml, dt date, tm time, tm3 time(3), ttz timetz,
        ts timestamp, ts3 timestamp(3), tstz timestamptz, tstz0 timestamptz(0), tstz3 timestamptz(3), iv interval,
        m money, b1 bit(1), b4 bit(4), vb varbit, ip inet, cd cidr, mac macaddr, pt point, rg int4range,
        md mood, pr pair, ia int[], ta text[], na numeric(5,2)[], fa float8[], tza timestamptz[], ia2 int[][],
        jba jsonb[], ba bytea[], bla boolean[], da date[], ma mood[], nva numeric[],
        xi xid, ci cid, x8 xid8, rc regclass, rt regtype, tid_ tid, lsn pg_lsn, mac8 macaddr8, tsv tsvector);
"""
ROWS = [
    "(1, 1, 1, 1, true, 1.5, 0.1, 1234.50, 1.50, 1200, 9.99, '\\x00ff', 'plain', 'abc', 'ab', 'x', 'nm',"
    " 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '{\"a\": 1,  \"b\": [2]}', '{\"b\": [2], \"a\": 1}', '<a>x</a>',"
    " '2024-01-02', '03:04:05.123456', '03:04:05.123', '03:04:05.5-08', '2024-01-02 03:04:05.5',"
    " '2024-01-02 03:04:05.123', '2024-01-02 05:04:05.123456+02', '2024-01-02 03:04:05+00', '2024-01-02 03:04:05.1+00',"
    " '1 year 2 mons 3 days 04:05:06.78', 12.34, '1', '0101', '0011', '192.168.0.1/24', '10.0.0.0/8',"
    " '08:00:2b:01:02:03', '(1.5,2)', '[1,5)', 'happy', '(1,x)', '{1,NULL,3}', '{a,\"b c\",NULL}', '{1.50,NULL}',"
    " '{1.5,NaN,1e16,123456789012}', '{\"2024-01-02 03:04:05+02\"}', '{{1,2},{3,4}}', '{\"{\\\"a\\\": 1}\"}',"
    " '{\"\\\\x01\"}', '{t,f}', '{2024-01-02,\"0044-03-15 BC\"}', '{ok,sad}', '{5.00,NaN}')",
    "(2, -32768, -9223372036854775808, 4294967295, false, '-Infinity', 'NaN', -9999999999.99, 'NaN', -99900,"
    " -0.01, '', E'tab\\there \\\"q\\\" \\\\ é \U0001F600 \\u0001', '', '   ', ' ', '', '00000000-0000-0000-0000-000000000000',"
    " '[]', 'null', '', '0044-03-15 BC', '24:00:00', '00:00:00', '24:00:00+00', '0044-03-15 12:00:00.25 BC',"
    " '-infinity', '0044-03-15 00:30:00.25+01:00 BC', '-infinity', '0001-01-01 00:30:00.05+01', '-1 days -00:00:01',"
    " -0.01, '0', '0000', '', '::1', '::/0', 'ff:ff:ff:ff:ff:ff', '(0,0)', 'empty', 'sad', '(,)', '{}', '{}', '{}',"
    " '{-Infinity}', '{}', '{}', '{}', '{}', '{}', '{\"10000-01-01\"}', '{}', '{}')",
    "(3, 32767, 9223372036854775807, 0, NULL, 'NaN', 'Infinity', 'NaN', 'Infinity', 0, NULL, NULL,"
    " NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 'infinity', '23:59:59.999999', NULL,"
    " '00:00:00.000001+15:59', '294276-12-31 23:59:59.999999', 'infinity', '294276-12-31 23:59:59.999999+00',"
    " 'infinity', '10000-01-01 00:00:00+00', '1 mon -00:00:00.000001', NULL, NULL, NULL, NULL, NULL, NULL, NULL,"
    " NULL, NULL, NULL, NULL, '{NULL}', '{NULL}', '{NaN}', '{NULL}', '{NULL}', NULL, NULL, NULL, NULL, NULL, NULL,"
    " '{NULL,0.000000000000000000001}')",
    "(4, 0, 0, NULL, NULL, 3.4028235e38, 1.7976931348623157e308, 0, '-Infinity', NULL, NULL, NULL, NULL, NULL, NULL,"
    " NULL, NULL, NULL, NULL, NULL, NULL, '-infinity', NULL, NULL, '23:59:59.999999-15:59', '-infinity',"
    " '4713-11-24 00:00:00 BC', '-infinity', '4714-11-24 00:00:00+00 BC', NULL, '-178956970 years -8 mons -2147483647 days"
    " -2562047788:00:54.775807', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,"
    " NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)",
    "(5, NULL, NULL, NULL, NULL, 1e-45, 5e-324, 0.01, 12345678901234567890.123456789012345678901234567890, NULL,"
    " NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, '5874897-12-31', NULL, NULL,"
    " '12:00:00+05:53:28', '1999-12-31 23:59:59.999999', '1999-12-31 23:59:59.999', '1999-12-31 23:00:00-01',"
    " '1999-12-31 23:59:59.6+00', '1999-12-31 23:59:59.9996+00', '100 hours', NULL, NULL, NULL, NULL, NULL, NULL, NULL,"
    " NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)",
    "(6, NULL, NULL, NULL, NULL, NULL, NULL, NULL, (repeat('9', 5000) || '.5')::numeric, NULL, NULL, NULL, NULL, NULL, NULL,"
    " NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, '294247-01-10 04:00:25.2', NULL, NULL, NULL, NULL,"
    " '00:00:01.5', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,"
    " NULL, NULL, NULL, NULL, NULL, NULL)",
]


# the values of the columns after nva, a row each
MORE_TYPES = ["'5', '0', '5', 'pg_class', 'integer', '(0,1)', '16/B374D848', '08:00:2b:01:02:03:04:05', 'a fat cat'",
              "'4294967295', '4294967295', '18446744073709551615', 'information_schema.tables', 'text[]',"
              " '(4294967295,65535)', '0/0', NULL, ''"] + ["NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL"] * 4
ROWS = [row[:-1] + ", " + more + ")" for row, more in zip(ROWS, MORE_TYPES, strict=True)]


def captured_rows(conn: Any, name: str) -> tuple[TableStructure, list[Sequence[Any]]]:
    """A table's structure as replicator reads it and its rows in the capture encoding,
    decoded as the consumer decodes them, read by a session in another time zone."""
    for setting, value in {**SESSION_SETTINGS, "TimeZone": "Asia/Kolkata"}.items():
        conn.execute("SELECT set_config(%s, %s, false)", (setting, value))
    raw = conn.execute("SELECT replicator.table_structure(%s::regclass)", (name,)).fetchone()[0]
    names = [c["name"] for c in raw["columns"]]
    structure = TableStructure.from_source(raw, names, raw["key"])
    expression = conn.execute("SELECT replicator.capture_row_json('a', %s, %s::regclass)", (names, name)).fetchone()[0]
    texts = [text for (text,) in conn.execute(f"SELECT {expression}::text FROM {name} a ORDER BY 1")]
    return structure, structure.rows_decoder()([parse_json(text) for text in texts])


@pytest.mark.parametrize("schemas", [True, False])
@pytest.mark.parametrize("decimals", ["precise", "string", "double"])
def test_every_type_postgresql_renders_comes_back_exactly(conn, schemas, decimals):
    conn.execute(ALL_TYPES + "INSERT INTO every VALUES " + ", ".join(ROWS))
    structure, rows = captured_rows(conn, "every")
    assert len(rows) == len(ROWS)
    envelope_settings = EnvelopeSettings(prefix="shop", database="appdb", schemas=schemas, decimals=decimals)
    for row in rows:
        round_trip(structure, row, envelope_settings)
        # each column as the key too (where PostgreSQL can compare it)
        for position, c in enumerate(structure.columns):
            if row[position] is not None and c.base_type not in ("json", "xml", "point"):
                keyed = TableStructure(structure.schema, structure.name, structure.columns, (c.name,))
                round_trip(keyed, row, envelope_settings)


def test_values_of_every_type_are_typed_as_debeziums(conn):
    conn.execute(ALL_TYPES + "INSERT INTO every VALUES " + ", ".join(ROWS))
    structure, rows = captured_rows(conn, "every")
    envelope = TableEnvelope(structure, SETTINGS)
    record = json.loads(envelope.value("c", rows[0], source_of(envelope), TS_US))
    after = record["payload"]["after"]
    fields = {f["field"]: f for f in record["schema"]["fields"][1]["fields"]}

    def typed(name: str) -> tuple[Any, ...]:
        f = fields[name]
        return (f["type"], f.get("name"), f.get("parameters"), after[name])

    assert typed("i2")[0] == "int16" and typed("i8")[0] == "int64" and typed("o") == ("int64", None, None, 1)
    assert typed("xi") == ("int64", None, None, 5) and typed("ci") == ("int64", None, None, 0)
    assert [typed(name) for name in ("x8", "rc", "tid_", "lsn")] == [
        ("string", None, None, "5"), ("string", None, None, "pg_class"), ("string", None, None, "(0,1)"),
        ("string", None, None, "16/B374D848")]
    assert typed("b") == ("boolean", None, None, True) and typed("r") == ("float", None, None, 1.5)
    assert typed("n") == ("bytes", "org.apache.kafka.connect.data.Decimal",
                          {"scale": "2", "connect.decimal.precision": "12"}, base64.b64encode(bytes([1, 226, 58])).decode())
    assert typed("nv")[:2] == ("struct", "io.debezium.data.VariableScaleDecimal")
    assert after["nv"] == {"scale": 2, "value": "AJY="}     # 150: 0x00 0x96, as Java's BigInteger.toByteArray()
    assert typed("nneg") == ("bytes", "org.apache.kafka.connect.data.Decimal",
                             {"scale": "-2", "connect.decimal.precision": "3"}, "DA==")     # 12 hundreds
    assert typed("np")[1] == "io.debezium.data.VariableScaleDecimal"     # a domain's typmod is not recorded
    assert typed("by") == ("bytes", None, None, "AP8=")
    assert typed("u")[:2] == ("string", "io.debezium.data.Uuid") and typed("j")[:2] == ("string", "io.debezium.data.Json")
    assert after["j"] == '{"a": 1,  "b": [2]}' and after["jb"] == '{"a": 1, "b": [2]}'
    assert typed("x")[:2] == ("string", "io.debezium.data.Xml")
    assert typed("dt") == ("int32", "io.debezium.time.Date", None, 19724)
    assert typed("tm") == ("int64", "io.debezium.time.MicroTime", None, 11045123456)
    assert typed("tm3") == ("int32", "io.debezium.time.Time", None, 11045123)
    assert typed("ttz") == ("string", "io.debezium.time.ZonedTime", None, "11:04:05.5Z")
    assert typed("ts") == ("int64", "io.debezium.time.MicroTimestamp", None, 1704164645500000)
    assert typed("ts3") == ("int64", "io.debezium.time.Timestamp", None, 1704164645123)
    assert typed("tstz") == ("string", "io.debezium.time.ZonedTimestamp", None, "2024-01-02T03:04:05.123456Z")
    assert after["tstz0"] == "2024-01-02T03:04:05Z" and after["tstz3"] == "2024-01-02T03:04:05.100Z"
    assert typed("iv") == ("int64", "io.debezium.time.MicroDuration", None,
                           int(((((14 * 30.4375 + 3) * 24 + 4) * 60 + 5) * 60 + 6.78) * 1e6))
    assert typed("m") == ("string", None, None, "$12.34") and typed("b1") == ("boolean", None, None, True)
    assert typed("b4") == ("bytes", "io.debezium.data.Bits", {"length": "4"}, "BQ==")
    assert typed("vb")[2] == {"length": str(2**31 - 1)} and after["vb"] == "Aw=="
    assert typed("md") == ("string", None, None, "happy") and typed("pr") == ("string", None, None, '{"a":1,"b":"x"}')
    assert fields["ia"]["items"] == {"type": "int32", "optional": True} and after["ia"] == [1, None, 3]
    assert after["ta"] == ["a", "b c", None] and after["ia2"] == [1, 2, 3, 4]
    assert fields["na"]["items"]["parameters"] == {"scale": "2", "connect.decimal.precision": "5"}
    assert after["fa"] == [1.5, "NaN", 1e16, 123456789012.0] and after["tza"] == ["2024-01-02T01:04:05.000000Z"]
    assert after["bla"] == [True, False] and after["da"] == [19724, -735160]
    # what a Debezium type cannot hold exactly travels in `replicator`: here the offset of a
    # timetz, the months of an interval, a 2-D array, PostgreSQL's spellings in arrays
    assert record["payload"]["replicator"] == {
        "ttz": "03:04:05.500000-08:00", "iv": "1 year 2 mons 3 days 04:05:06.78", "fa": '[1.5,"NaN",1e+16,123456789012]',
        "vb": "0011", "tza": '["2024-01-02T06:34:05+05:30"]', "ia2": "[[1,2],[3,4]]", "jba": '[{"a": 1}]',
        "da": '["2024-01-02","0044-03-15 BC"]', "nva": '[5.00,"NaN"]'}


# values hypothesis makes, in the decoders' forms ---------------------------------------------

def year_text(year: int) -> str:
    return f"-{-year:04d}" if year < 0 else f"{year:04d}" if year <= 9999 else f"+{year}"


@st.composite
def dates(draw: Any, last_year: int = 5874897) -> tuple[str, int]:
    """A date in the one form and its days since 1970, counted by Python's calendar (moved by
    whole 400-year cycles into its years)."""
    year = draw(st.integers(-4713, last_year))
    month = draw(st.integers(1, 12))
    cycles = (year - 2000) // 400
    shifted = year - cycles * 400
    day = draw(st.integers(1, calendar.monthrange(shifted, month)[1]))
    days = date(shifted, month, day).toordinal() - date(1970, 1, 1).toordinal() + cycles * 146_097
    return f"{year_text(year)}-{month:02d}-{day:02d}", days


@st.composite
def timestamps(draw: Any, digits: int = 6) -> tuple[str, int]:
    text, days = draw(dates(last_year=294276))
    micros = draw(st.integers(0, 86_399_999_999)) // 10**(6 - digits) * 10**(6 - digits)
    second, fraction = divmod(micros, 1_000_000)
    clock = f"{second // 3600:02d}:{second // 60 % 60:02d}:{second % 60:02d}.{fraction:06d}"
    return f"{text}T{clock}", days * 86_400_000_000 + micros


def pg_float(value: float) -> Any:
    if math.isnan(value):
        return "NaN"
    return value if math.isfinite(value) else ("Infinity" if value > 0 else "-Infinity")


def numerics(precision: int | None = None, scale: int = 0) -> st.SearchStrategy[str]:
    """numeric values as PostgreSQL prints them: within numeric(p,s) if given (s digits after
    the point), else of any scale and up to 5000 digits; NaN and the infinities."""
    digits = "0123456789"
    if precision is None:
        whole = st.one_of(st.text(digits, min_size=1, max_size=30),
                          st.builds(lambda d, n: d * n, st.sampled_from(digits[1:]), st.integers(4300, 5000)))
        places = st.integers(0, 40)
    else:
        whole = st.text(digits, min_size=1, max_size=precision - scale)
        places = st.just(scale)

    @st.composite
    def finite(draw: Any) -> str:
        text = draw(whole).lstrip("0") or "0"
        count = draw(places)
        if count:
            text += "." + draw(st.text(digits, min_size=count, max_size=count))
        return f"-{text}" if draw(st.booleans()) and text.strip("0.") else text

    return st.one_of(st.sampled_from(["NaN", "Infinity", "-Infinity"]), finite())


def timetzs() -> st.SearchStrategy[str]:
    @st.composite
    def make(draw: Any) -> str:
        micros = draw(st.integers(0, 86_400_000_000))
        second, fraction = divmod(micros, 1_000_000)
        offset = draw(st.integers(-(15 * 3600 + 59 * 60 + 59), 15 * 3600 + 59 * 60 + 59))
        sign, offset = ("-" if offset < 0 else "+"), abs(offset)
        zone = f"{sign}{offset // 3600:02d}:{offset // 60 % 60:02d}" + (f":{offset % 60:02d}" if offset % 60 else "")
        return f"{second // 3600:02d}:{second // 60 % 60:02d}:{second % 60:02d}.{fraction:06d}{zone}"
    return make()


TEXTS = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"))
HYPOTHESIS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# a column type, its category and the values replicator's decoders give of it
VALUES: list[tuple[str, str, str, st.SearchStrategy[Any]]] = [
    ("smallint", "smallint", "N", st.integers(-2**15, 2**15 - 1)),
    ("bigint", "bigint", "N", st.integers(-2**63, 2**63 - 1)),
    ("oid", "oid", "N", st.integers(0, 2**32 - 1).map(str)),
    ("boolean", "boolean", "B", st.integers(0, 1)),
    ("real", "real", "N", st.floats(width=32).map(pg_float)),
    ("double precision", "double precision", "N", st.floats().map(pg_float)),
    ("numeric(12,2)", "numeric", "N", numerics(12, 2)),
    ("numeric(38,10)", "numeric", "N", numerics(38, 10)),
    ("numeric(5,0)", "numeric", "N", numerics(5, 0)),
    ("numeric", "numeric", "N", numerics()),
    ("text", "text", "S", TEXTS),
    ("character varying(20)", "character varying", "S", TEXTS),
    ("bytea", "bytea", "U", st.binary()),
    ("date", "date", "D", st.one_of(dates().map(lambda d: d[0]), st.sampled_from(["infinity", "-infinity"]))),
    ("timestamp without time zone", "timestamp without time zone", "D",
     st.one_of(timestamps().map(lambda t: t[0]), st.sampled_from(["infinity", "-infinity"]))),
    ("timestamp(3) without time zone", "timestamp without time zone", "D", timestamps(3).map(lambda t: t[0])),
    ("timestamp with time zone", "timestamp with time zone", "D",
     st.one_of(timestamps().map(lambda t: t[0] + "+00:00"), st.sampled_from(["infinity", "-infinity"]))),
    ("timestamp(0) with time zone", "timestamp with time zone", "D", timestamps(0).map(lambda t: t[0] + "+00:00")),
    ("timestamp(2) with time zone", "timestamp with time zone", "D", timestamps(2).map(lambda t: t[0] + "+00:00")),
    ("time without time zone", "time without time zone", "D",
     st.integers(0, 86_400_000_000).map(lambda m: f"{m // 3_600_000_000:02d}:{m // 60_000_000 % 60:02d}:"
                                                  f"{m // 1_000_000 % 60:02d}.{m % 1_000_000:06d}")),
    ("time with time zone", "time with time zone", "D", timetzs()),
    ("bit varying", "bit varying", "V", st.text(alphabet="01", max_size=80)),
    ("bit(12)", "bit", "V", st.text(alphabet="01", min_size=12, max_size=12)),
    ("integer[]", "integer[]", "A", st.lists(st.one_of(st.none(), st.integers(-2**31, 2**31 - 1))).map(
        lambda items: json.dumps(items, separators=(",", ":")))),
    ("text[]", "text[]", "A", st.lists(st.one_of(st.none(), TEXTS)).map(
        lambda items: json.dumps(items, separators=(",", ":"), ensure_ascii=False))),
    ("numeric(12,2)[]", "numeric[]", "A", st.lists(st.one_of(st.none(), numerics(12, 2))).map(
        lambda items: "[" + ",".join("null" if i is None else f'"{i}"' if i[-1] == "y" or i == "NaN" else i
                                     for i in items) + "]")),
]


CASES = [(*case, decimals) for case in VALUES
         for decimals in (("precise", "string", "double") if case[1].startswith("numeric") else ("precise",))]


@pytest.mark.parametrize(("type_", "base_type", "category", "values", "decimals"), CASES,
                         ids=[f"{case[0]}-{case[4]}" for case in CASES])
def test_values_come_back_exactly_in_values_and_keys(type_, base_type, category, values, decimals):
    envelope_settings = EnvelopeSettings(prefix="shop", database="appdb", decimals=decimals)
    as_value = table(ID, column("v", type_, base_type, category))
    as_key = table(column("k", type_, base_type, category, not_null=True), column("v", "text", category="S"), key=["k"])

    @HYPOTHESIS
    @given(value=st.one_of(st.none(), values))
    def check(value: Any) -> None:
        round_trip(as_value, (1, value), envelope_settings)
        if value is not None and category != "A":
            round_trip(as_key, (value, "x"), envelope_settings)
    check()


@pytest.mark.parametrize(("type_", "base_type", "values"), [
    ("numeric", "numeric", numerics()), ("time with time zone", "time with time zone", timetzs()),
    ("interval", "interval", st.sampled_from(["1 mon", "30 days 10:30:00", "1 day", "24:00:00", "-1 days +24:00:00",
                                              "00:00:00", "1 year", "12 mons", "-00:00:00.5"])),
    ("timestamp without time zone", "timestamp without time zone",
     st.one_of(timestamps().map(lambda t: t[0]), st.just("infinity"))),
    ("bit varying", "bit varying", st.text(alphabet="01", max_size=12))])
def test_distinct_keys_are_distinct_key_records_with_their_tombstone_headers(type_, base_type, values):
    """Where Debezium's type writes two keys alike (a month and 30.4375 days; the same UTC time at
    two offsets) the key records are alike, as Debezium's: a tombstone's header and a delete's
    value still tell which row went."""
    envelope = TableEnvelope(table(column("k", type_, base_type, not_null=True), key=["k"]), SETTINGS)

    @HYPOTHESIS
    @given(a=values, b=values)
    def check(a: str, b: str) -> None:
        assert ((envelope.key([a]), envelope.key_header([a])) == (envelope.key([b]), envelope.key_header([b]))) == (
            a == b)
    check()


@HYPOTHESIS
@given(day=dates(), moment=timestamps())
def test_date_times_are_the_days_and_microseconds_python_counts(day, moment):
    envelope = TableEnvelope(table(ID, column("d", "date"), column("ts", "timestamp without time zone")), SETTINGS)
    after = payload_of(envelope.value("c", (1, day[0], moment[0]), source_of(envelope), TS_US))["after"]
    assert after["d"] == day[1]
    # past the number Debezium writes for infinity: infinity, and the exact text beside
    assert after["ts"] == min(moment[1], 9_223_372_036_825_200_000)


# column defaults -----------------------------------------------------------------------------

DEFAULTS = """
CREATE TYPE color AS ENUM ('red', 'green');
CREATE TABLE defaults (
    id serial PRIMARY KEY, zero int NOT NULL DEFAULT 0, negative int DEFAULT -5,
    big bigint DEFAULT 9223372036854775807, small smallint DEFAULT -3, amount numeric(8,2) NOT NULL DEFAULT 1.5,
    free numeric DEFAULT -2.25, ratio real DEFAULT 1.5, huge double precision DEFAULT -1e300,
    flag boolean NOT NULL DEFAULT false, quote text DEFAULT 'it''s', label varchar(5) NOT NULL DEFAULT 'x',
    day date DEFAULT '2024-01-02', clock time DEFAULT '12:34:56.5', moment timestamp(3) DEFAULT '2024-01-02 03:04:05.25',
    zoned timestamptz DEFAULT '2024-01-02 03:04:05+02', span interval DEFAULT '1 mon 2 days',
    one bit(1) DEFAULT B'1', three bit(3) DEFAULT B'101', doc jsonb DEFAULT '{"a": 1}',
    fixed uuid DEFAULT 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', hue color DEFAULT 'red',
    -- generated: Debezium's placeholders
    made uuid DEFAULT gen_random_uuid(), stamp timestamptz NOT NULL DEFAULT now(), today date DEFAULT current_date,
    lowered text DEFAULT lower('X'),
    -- none: expressions, NULL, values a Debezium field cannot hold, types Debezium has no default for
    summed int DEFAULT (1 + 2), joined text DEFAULT 'a' || 'b', nothing text DEFAULT NULL, nan numeric(8,2) DEFAULT 'NaN',
    tz timetz DEFAULT '12:00+02', raw bytea DEFAULT '\\x00', plain text);
"""
DEBEZIUMS_DEFAULTS = {
    "id": 0, "zero": 0, "negative": -5, "big": 9223372036854775807, "small": -3, "amount": "AJY=", "ratio": 1.5,
    "huge": -1e300, "flag": False, "quote": "it's", "label": "x", "day": 19724, "clock": 45_296_500_000,
    "moment": 1_704_164_645_250, "zoned": "2024-01-02T01:04:05.000000Z", "span": 2_802_600_000_000, "one": True,
    "three": "BQ==", "doc": '{"a": 1}', "fixed": "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", "hue": "red",
    "made": "00000000-0000-0000-0000-000000000000", "stamp": "1970-01-01T00:00:00.000000Z", "today": 0,
    "lowered": "",
}
GENERATED = {"id", "made", "stamp", "today", "lowered"}


def test_field_schemas_have_the_column_defaults_debezium_writes(conn):
    """As Debezium's PostgresDefaultValueConverter: a literal default in the field's Connect
    representation, a generated one as Debezium's placeholder for its type, none for other
    expressions (VariableScaleDecimal's struct, which Connect takes no default of, neither)."""
    conn.execute("SET TimeZone = 'America/New_York'")   # the session that declares them: its offset in pg_get_expr
    conn.execute(DEFAULTS)
    conn.execute("INSERT INTO defaults DEFAULT VALUES")
    structure, (row,) = captured_rows(conn, "defaults")
    envelope = TableEnvelope(structure, SETTINGS)
    record = json.loads(envelope.value("c", row, source_of(envelope), TS_US))
    fields = record["schema"]["fields"][1]["fields"]
    assert {f["field"]: f["default"] for f in fields if "default" in f} == DEBEZIUMS_DEFAULTS
    for f in fields:
        assert not connect_errors({k: v for k, v in f.items() if k != "default"}, f.get("default"))
        if f["field"] in DEBEZIUMS_DEFAULTS and f["field"] not in GENERATED:   # what a row gets by default
            assert record["payload"]["after"][f["field"]] == f["default"], f["field"]
    # in the key's schema too, after the parameters as JsonConverter writes them
    assert json.loads(envelope.key([1]))["schema"]["fields"] == [
        {"type": "int32", "optional": False, "default": 0, "field": "id"}]
    assert list(next(f for f in fields if f["field"] == "amount")) == [
        "type", "optional", "name", "version", "parameters", "default", "field"]
    as_strings = TableEnvelope(structure, EnvelopeSettings(prefix="shop", database="appdb", decimals="string"))
    value = json.loads(as_strings.value("c", row, source_of(as_strings), TS_US))["schema"]["fields"][1]["fields"]
    assert {f["field"]: f.get("default") for f in value if f["field"] in ("amount", "free")} == {
        "amount": "1.50", "free": "-2.25"}


# records as Debezium's -----------------------------------------------------------------------

ORDERS = table(ID, column("customer", "text", category="S", not_null=True), column("amount", "numeric(12,2)", "numeric"),
               column("placed", "timestamp with time zone"), column("paid", "boolean"),
               column("weight", "double precision", not_null=True), name="orders")
ORDER = (7, "ann", "1234.50", "2024-01-02T03:04:05.123456+00:00", 1, 1.5)


def test_a_value_is_debeziums_envelope_with_its_schema():
    envelope = TableEnvelope(ORDERS, SETTINGS)
    record = json.loads(envelope.value("c", ORDER, source_of(envelope), TS_US))
    schema, payload = record["schema"], record["payload"]
    assert (schema["type"], schema["name"], schema["version"], schema["optional"]) == (
        "struct", "shop.public.orders.Envelope", 2, False)
    assert [f["field"] for f in schema["fields"]] == [
        "before", "after", "source", "transaction", "op", "ts_ms", "ts_us", "ts_ns", "replicator"]
    before, after = schema["fields"][:2]
    assert before["name"] == after["name"] == "shop.public.orders.Value" and before["optional"] and after["optional"]
    assert after["fields"][:2] == [{"type": "int32", "optional": False, "field": "id"},
                                   {"type": "string", "optional": False, "field": "customer"}]
    assert schema["fields"][2]["name"] == "io.debezium.connector.postgresql.Source"
    assert schema["fields"][3]["name"] == "event.block"
    assert payload == {
        "before": None,
        "after": {"id": 7, "customer": "ann", "amount": "AeI6", "placed": "2024-01-02T03:04:05.123456Z", "paid": True,
                  "weight": 1.5},
        "source": {"version": __version__, "connector": "replicator", "name": "shop", "ts_ms": 1_700_000_000_123,
                   "snapshot": "false", "db": "appdb", "sequence": None, "ts_us": 1_700_000_000_123_451,
                   "ts_ns": 1_700_000_000_123_451_000, "schema": "public", "table": "orders", "txId": 1234,
                   "lsn": None, "xmin": None, "origin": None, "origin_lsn": None, "tick": 7, "event": 42},
        "transaction": None, "op": "c", "ts_ms": 1_700_000_000_123, "ts_us": 1_700_000_000_123_456,
        "ts_ns": 1_700_000_000_123_456_000, "replicator": None}
    assert not connect_errors(schema, payload)


def test_without_schemas_a_record_is_its_payload():
    plain = EnvelopeSettings(prefix="shop", database="appdb", schemas=False)
    envelope, with_schemas = TableEnvelope(ORDERS, plain), TableEnvelope(ORDERS, SETTINGS)
    source = source_of(envelope)
    assert json.loads(envelope.value("u", ORDER, source, TS_US)) == json.loads(
        with_schemas.value("u", ORDER, source, TS_US))["payload"]
    assert json.loads(envelope.key([7])) == {"id": 7}
    assert json.loads(envelope.truncate_key()) == {"id": None}
    assert json.loads(schema_change_key(plain)) == {"databaseName": "appdb"}


def test_op_codes_and_their_rows():
    envelope = TableEnvelope(ORDERS, SETTINGS)
    source = source_of(envelope, snapshot="true", event=None)
    for op in ("c", "u", "r"):
        assert payload_of(envelope.value(op, ORDER, source, TS_US))["op"] == op
    truncated = payload_of(envelope.value("t", None, source, TS_US))
    assert (truncated["op"], truncated["before"], truncated["after"]) == ("t", None, None)
    assert truncated["source"]["snapshot"] == "true" and truncated["source"]["event"] is None
    for op, row in (("d", ORDER), ("c", None), ("t", ORDER)):
        with pytest.raises(ValueError, match="op"):
            envelope.value(op, row, source, TS_US)
    with pytest.raises(ValueError, match="snapshot"):
        source_of(envelope, snapshot="yes")
    assert envelope.decode_value(envelope.value("t", None, source, TS_US)) == DecodedChange(
        op="t", before=None, after=None, source=json.loads(source))


def test_a_delete_has_the_key_before_and_nothing_after():
    """As Debezium's with REPLICA IDENTITY DEFAULT: the key columns; a NOT NULL column holds
    Debezium's fallback zero (a null would not be valid Connect data), a nullable one null."""
    envelope = TableEnvelope(ORDERS, SETTINGS)
    record = envelope.delete_value([7], source_of(envelope), TS_US)
    payload = payload_of(record)
    assert payload["op"] == "d" and payload["after"] is None
    assert payload["before"] == {"id": 7, "customer": "", "amount": None, "placed": None, "paid": None, "weight": 0.0}
    assert envelope.decode_value(record).before == (7, None, None, None, None, None)


def test_keys_are_the_key_columns_in_key_order():
    structure = table(column("a", "text", category="S", not_null=True), column("b", "bigint", not_null=True),
                      column("c", "text", category="S"), key=["b", "a"])
    envelope = TableEnvelope(structure, SETTINGS)
    record = json.loads(envelope.key([5, "x"]))
    assert record["schema"] == {"type": "struct", "fields": [{"type": "int64", "optional": False, "field": "b"},
                                                             {"type": "string", "optional": False, "field": "a"}],
                                "optional": False, "name": "shop.public.t.Key"}
    assert record["payload"] == {"b": 5, "a": "x"}
    assert envelope.decode_key(envelope.key([5, "x"])) == (5, "x")


def test_names_are_written_as_json_strings():
    odd = 'a "quoted"\\name é'
    structure = TableStructure(schema='s"1', name="t\n", columns=(column(odd, "integer", not_null=True),
                                                                   column("{p0}", "text", category="S")), key=(odd,))
    envelope = TableEnvelope(structure, SETTINGS)
    record = envelope.value("c", (1, "x"), source_of(envelope), TS_US)
    payload = payload_of(record)
    assert payload["after"] == {odd: 1, "{p0}": "x"} and json.loads(record)["schema"]["name"] == 'shop.s"1.t\n.Envelope'
    assert (payload["source"]["schema"], payload["source"]["table"]) == ('s"1', "t\n")
    assert payload_of(envelope.key([1])) == {odd: 1} and envelope.decode_key(envelope.key([1])) == (1,)
    assert envelope.decode_value(record).after == (1, "x")


def test_a_truncate_key_has_every_key_field_null_and_optional_as_no_row_key_has():
    envelope = TableEnvelope(ORDERS, SETTINGS)
    record = json.loads(envelope.truncate_key())
    assert record["payload"] == {"id": None}
    assert record["schema"]["fields"] == [{"type": "int32", "optional": True, "field": "id"}]
    assert not connect_errors(record["schema"], record["payload"])


def test_a_truncate_key_of_nullable_key_columns_only_has_an_empty_map_no_row_key_has():
    """Every key column nullable: a row's key can be every field null too, which compaction would
    take for the truncate's."""
    nullable = TableEnvelope(table(column("k", "text", category="S"), column("v", "integer"), key=["k"]), SETTINGS)
    record = json.loads(nullable.truncate_key())
    assert record["payload"] == {"k": None, "replicator": {}}
    assert not connect_errors(record["schema"], record["payload"])
    assert nullable.key([None]) != nullable.truncate_key()


def test_a_nullable_key_column_is_an_optional_key_field():
    envelope = TableEnvelope(table(column("k", "text", category="S"), column("v", "integer"), key=["k"]), SETTINGS)
    assert payload_of(envelope.key([None])) == {"k": None}
    assert envelope.decode_key(envelope.key([None])) == (None,)


def test_a_key_is_debeziums_even_when_its_fields_cannot_hold_its_values():
    """Values a key's fields cannot hold exactly are in the value's `replicator` map only (a
    delete's, for `before`), and in a tombstone's header: the key has Debezium's fields alone."""
    structure = table(column("k", "interval", not_null=True), column("n", "numeric", not_null=True),
                      column("v", "text", category="S"), key=["k", "n"])
    envelope = TableEnvelope(structure, SETTINGS)
    ordinary = json.loads(envelope.key(["00:00:01.5", "1.50"]))
    assert ordinary["payload"] == {"k": 1_500_000, "n": {"scale": 2, "value": "AJY="}}
    lossy = json.loads(envelope.key(["1 mon", "NaN"]))
    assert lossy["schema"] == ordinary["schema"]
    assert [f["field"] for f in lossy["schema"]["fields"]] == ["k", "n"]
    assert lossy["payload"] == {"k": 2_629_800_000_000, "n": {"scale": 0, "value": "AA=="}}
    assert envelope.key_header(["00:00:01.5", "1.50"]) is None
    header = envelope.key_header(["1 mon", "NaN"])
    assert header is not None and json.loads(header) == {"k": "1 mon", "n": "NaN"}
    assert envelope.decode_key(envelope.key(["1 mon", "NaN"]), header) == ("1 mon", "NaN")
    deleted = envelope.delete_value(["1 mon", "NaN"], source_of(envelope), TS_US)
    assert payload_of(deleted)["replicator"] == {"k": "1 mon", "n": "NaN"}
    change = envelope.decode_value(deleted)
    assert change.before == ("1 mon", "NaN", None) and envelope.deleted_key(change) == ("1 mon", "NaN")
    row = ("1 mon", "NaN", "x")
    assert envelope.decode_value(envelope.value("u", row, source_of(envelope), TS_US)).after == row


def test_a_key_an_earlier_publisher_wrote_with_its_exact_texts_is_read_exactly():
    """Publishers before keys were Debezium's wrote the texts in the key, in a field named unlike
    its columns: a follower of their topics still applies a tombstone of such a key exactly."""
    envelope = TableEnvelope(table(column("replicator", "interval", not_null=True), key=["replicator"]), SETTINGS)
    former = {"schema": {"type": "struct", "optional": False, "name": "shop.public.t.Key", "fields": [
        {"type": "int64", "optional": False, "name": "io.debezium.time.MicroDuration", "version": 1,
         "field": "replicator"},
        {"type": "map", "keys": {"type": "string", "optional": False}, "values": {"type": "string", "optional": False},
         "optional": True, "field": "replicator_"}]},
        "payload": {"replicator": 2_629_800_000_000, "replicator_": {"replicator": "1 mon"}}}
    assert envelope.decode_key(json.dumps(former).encode()) == ("1 mon",)


def test_keys_that_differ_only_in_what_their_fields_cannot_hold_are_one_record_key():
    """Debezium's MicroDuration of 1 mon is 30 days 10:30:00's: Kafka compacts the two rows' records
    as one key's (docs/kafka.md, Key)."""
    envelope = TableEnvelope(table(column("k", "interval", not_null=True), key=["k"]), SETTINGS)
    assert envelope.key(["1 mon"]) == envelope.key(["30 days 10:30:00"])


# special values ------------------------------------------------------------------------------

def test_special_numeric_values_are_null_or_zero_in_precise_mode_with_their_text_beside():
    structure = table(ID, column("a", "numeric(12,2)", "numeric"), column("b", "numeric(12,2)", "numeric", not_null=True),
                      column("c", "numeric"), column("d", "numeric", not_null=True))
    envelope = TableEnvelope(structure, SETTINGS)
    row = (1, "NaN", "Infinity", "-Infinity", "NaN")
    payload = payload_of(envelope.value("c", row, source_of(envelope), TS_US))
    assert payload["after"] == {"id": 1, "a": None, "b": "AA==", "c": None, "d": {"scale": 0, "value": "AA=="}}
    assert payload["replicator"] == {"a": "NaN", "b": "Infinity", "c": "-Infinity", "d": "NaN"}
    assert envelope.decode_value(envelope.value("c", row, source_of(envelope), TS_US)).after == row


@pytest.mark.parametrize(("decimals", "expected", "exact"), [
    ("precise", ["AeI6", {"scale": 3, "value": "AQ=="}, None, "/w==", {"scale": 0, "value": "AIA="}], {"n": "NaN"}),
    ("string", ["1234.50", "0.001", "NAN", "-0.01", "128"], None),
    ("double", [1234.5, 0.001, "NaN", -0.01, 128.0], {"a": "1234.50", "b": "128"}),
])
def test_decimal_handling_modes(decimals, expected, exact):
    structure = table(ID, column("a", "numeric(12,2)", "numeric"), column("v", "numeric"),
                      column("n", "numeric(5,2)", "numeric"), column("s", "numeric(5,2)", "numeric"),
                      column("b", "numeric"))
    envelope = TableEnvelope(structure, EnvelopeSettings(prefix="shop", database="appdb", decimals=decimals))
    row = (1, "1234.50", "0.001", "NaN", "-0.01", "128")
    payload = payload_of(envelope.value("c", row, source_of(envelope), TS_US))
    assert [payload["after"][name] for name in ("a", "v", "n", "s", "b")] == expected
    assert payload["replicator"] == exact
    assert envelope.decode_value(envelope.value("c", row, source_of(envelope), TS_US)).after == row


def test_an_unknown_decimal_mode_is_one_clear_line():
    with pytest.raises(UserError) as refused:
        EnvelopeSettings(prefix="shop", database="appdb", decimals="exact")
    assert str(refused.value) == "decimals='exact': choose one of precise, string, double (Debezium's decimal.handling.mode)"


def test_infinite_and_extreme_date_times_are_debeziums_numbers():
    structure = table(ID, column("d", "date"), column("ts", "timestamp without time zone"),
                      column("ms", "timestamp(3) without time zone", "timestamp without time zone"),
                      column("tz", "timestamp with time zone"))
    envelope = TableEnvelope(structure, SETTINGS)
    rows = {
        (1, "infinity", "infinity", "infinity", "infinity"): (-2147472692, 9223372036825200000, 9223372036825200,
                                                               "infinity"),
        (2, "-infinity", "-infinity", "-infinity", "-infinity"): (-2147472691, -9223372036832400000,
                                                                   -9223372036832400, "-infinity"),
        # Debezium's tests: 4713 BC and year 294247; dates and timestamptz far out
        (3, "+5874897-12-31", "-4712-12-31T23:59:59.999999", "+294247-01-01T23:59:59.999000",
         "+21016-11-04T06:51:30.000000+00:00"): (2145042905, -210831897600000001, 9223371331199999,
                                                 "+21016-11-04T06:51:30.000000Z"),
    }
    for row, expected in rows.items():
        payload = payload_of(envelope.value("c", row, source_of(envelope), TS_US))
        assert tuple(payload["after"][n] for n in ("d", "ts", "ms", "tz")) == expected
        assert payload["replicator"] is None
    past = (4, None, "+294276-12-31T23:59:59.999999", "+294247-01-10T04:00:25.200000", None)
    payload = payload_of(envelope.value("c", past, source_of(envelope), TS_US))
    assert (payload["after"]["ts"], payload["after"]["ms"]) == (9223372036825200000, 9223372036825200)
    assert payload["replicator"] == {"ts": past[2], "ms": past[3]}
    assert envelope.decode_value(envelope.value("c", past, source_of(envelope), TS_US)).after == past


def test_bit_strings_are_debeziums_bits():
    """Debezium's own expectations: '11'::bit(2) is [3], '1'::bit(7) [64], ...; bit(1) a boolean."""
    structure = table(ID, column("b2", "bit(2)", "bit"), column("b7", "bit(7)", "bit"), column("b24", "bit(24)", "bit"),
                      column("b64", "bit(64)", "bit"), column("v", "bit varying"), column("one", "bit(1)", "bit"))
    envelope = TableEnvelope(structure, SETTINGS)
    row = (1, "00", "1000000", "000000110000001000000001", "1" + "0" * 63, "111011010001000110000001000000001", "1")
    payload = payload_of(envelope.value("c", row, source_of(envelope), TS_US))
    as_bytes = {n: list(base64.b64decode(payload["after"][n])) for n in ("b2", "b7", "b24", "b64", "v")}
    assert as_bytes == {"b2": [], "b7": [64], "b24": [1, 2, 3], "b64": [0, 0, 0, 0, 0, 0, 0, 128], "v": [1, 2, 35, 218, 1]}
    assert payload["after"]["one"] is True and payload["replicator"] is None


def test_non_finite_floats_are_quoted_as_jackson_writes_them():
    envelope = TableEnvelope(table(ID, column("f", "double precision"), column("r", "real")), SETTINGS)
    for text in ("NaN", "Infinity", "-Infinity"):
        record = envelope.value("c", (1, text, text), source_of(envelope), TS_US)
        assert payload_of(record)["after"] == {"id": 1, "f": text, "r": text}
        assert envelope.decode_value(record).after == (1, text, text)


def test_a_record_of_another_structure_is_read_by_its_field_names():
    """A follower decodes with the structure it holds: fields the record lacks are None."""
    old = TableEnvelope(table(ID, column("a", "text", category="S")), SETTINGS)
    new = TableEnvelope(table(ID, column("a", "text", category="S"), column("b", "integer")), SETTINGS)
    record = old.value("c", (1, "x"), source_of(old), TS_US)
    assert new.decode_value(record).after == (1, "x", None)


# the schema-change topic ---------------------------------------------------------------------

def test_schema_change_records_are_debeziums_with_replicators_member():
    structure = table(ID, column("name", "character varying(20)", "character varying", "S", not_null=True),
                      column("amount", "numeric(12,2)", "numeric"),
                      column("at", "timestamp(3) with time zone", "timestamp with time zone"),
                      column("tags", "text[]", category="A"),
                      column("serial", "bigint", not_null=True, default="nextval('t_serial_seq'::regclass)"),
                      name="Odd \"name\"")
    envelope = TableEnvelope(structure, SETTINGS)
    member = {"table_id": 3, "mode": "full", "structure": structure.to_json()}
    record = schema_change_value(SETTINGS, change="ALTER", structure=structure, ddl="ALTER TABLE ...",
                                 source=source_of(envelope), ts_ms=TS_US, replicator=member)
    payload = payload_of(record)
    assert json.loads(record)["schema"]["name"] == "replicator.SchemaChangeValue"
    assert (payload["databaseName"], payload["schemaName"], payload["ddl"], payload["ts_ms"]) == (
        "appdb", "public", "ALTER TABLE ...", TS_US)
    assert payload["source"]["table"] == 'Odd "name"'
    (change,) = payload["tableChanges"]
    assert (change["type"], change["id"]) == ("ALTER", '"public"."Odd ""name"""')
    assert change["table"]["primaryKeyColumnNames"] == ["id"]
    columns = {c["name"]: c for c in change["table"]["columns"]}
    assert [c["position"] for c in change["table"]["columns"]] == [1, 2, 3, 4, 5, 6]
    assert {k: columns["name"][k] for k in ("jdbcType", "typeName", "typeExpression", "length", "scale", "optional")} == {
        "jdbcType": 12, "typeName": "varchar", "typeExpression": "character varying(20)", "length": 20, "scale": None,
        "optional": False}
    assert (columns["amount"]["typeName"], columns["amount"]["length"], columns["amount"]["scale"]) == ("numeric", 12, 2)
    assert (columns["at"]["typeName"], columns["at"]["length"], columns["at"]["scale"]) == ("timestamptz", None, 3)
    assert (columns["tags"]["jdbcType"], columns["tags"]["typeName"]) == (2003, "_text")
    assert columns["serial"]["autoIncremented"] and columns["serial"]["defaultValueExpression"].startswith("nextval(")
    assert decode_schema_change(record) == member
    key = json.loads(schema_change_key(SETTINGS))
    assert key["payload"] == {"databaseName": "appdb"} and key["schema"]["name"] == "replicator.SchemaChangeKey"
    assert not connect_errors(key["schema"], key["payload"])


@pytest.mark.parametrize("change", ["CREATE", "DROP"])
def test_schema_change_types(change):
    plain = EnvelopeSettings(prefix="shop", database="appdb", schemas=False)
    envelope = TableEnvelope(ORDERS, plain)
    record = schema_change_value(plain, change=change, structure=ORDERS, ddl=None, source=source_of(envelope),
                                 ts_ms=TS_US, replicator={"n": 1})
    payload = json.loads(record)
    assert payload["tableChanges"][0]["type"] == change and payload["ddl"] is None
    assert decode_schema_change(record) == {"n": 1}
    with pytest.raises(ValueError, match="RENAME"):
        schema_change_value(plain, change="RENAME", structure=ORDERS, ddl=None, source=source_of(envelope),
                            ts_ms=TS_US, replicator={})
