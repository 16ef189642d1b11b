"""Stream targets: one JSON object (jsonl) or one line of tab-separated
key/value pairs (tsv) per change, to a file or stdout; a file stream resumed
after a crash repeats no line and loses none."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from collections import Counter
from pathlib import Path

import psycopg
import pytest

from consumer_helpers import (
    Daemon,
    LosesTheSourceOnce,
    apply_losing_the_source_once,
    cli_env,
    run_cli,
    run_cli_in_process,
    set_fast_ticks,
    wait_until,
)
from replicator.consumer import Consumer
from replicator.targets.stream import StreamTarget


def read_jsonl(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    assert text == "" or text.endswith("\n"), "a partial last line"
    return [json.loads(line) for line in text.splitlines()]


def unescape_tsv(field: str) -> str | None:
    if field == "\\N":
        return None
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\":
            out.append({"t": "\t", "n": "\n", "r": "\r", "\\": "\\"}[field[i + 1]])
            i += 2
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_tsv_line(line: str) -> dict[str, str | None]:
    fields = line.split("\t")
    assert len(fields) % 2 == 0, f"odd number of fields: {line!r}"
    return {unescape_tsv(fields[i]): unescape_tsv(fields[i + 1]) for i in range(0, len(fields), 2)}


@pytest.fixture
def queue_t(conn, source):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text, n numeric, b bytea, f float8)")
    conn.execute("INSERT INTO t VALUES (1, 'copied', 1.50, '\\x00ff', 'NaN')")
    source.create_queue("q")
    source.add_table("q", "t")


def write_changes(conn: psycopg.Connection) -> None:
    conn.execute("INSERT INTO t VALUES (2, E'tab\\there\\nline \\\\ back', 2, NULL, 1.5)")
    conn.execute("UPDATE t SET v = 'updated' WHERE id = 1")
    conn.execute("UPDATE t SET id = 3 WHERE id = 2")
    conn.execute("DELETE FROM t WHERE id = 1")
    conn.execute("TRUNCATE t")
    conn.execute("INSERT INTO t VALUES (4, NULL, NULL, NULL, NULL)")


def test_jsonl_file_has_one_json_object_per_change(dsn, conn, queue_t, tmp_path):
    out = tmp_path / "changes.jsonl"
    assert run_cli_in_process(dsn, "consume", "q", "--target", f"jsonl:{out}", "--until-caught-up").returncode == 0
    write_changes(conn)
    result = run_cli_in_process(dsn, "consume", "q", "--target", f"jsonl:{out}", "--until-caught-up")
    assert result.returncode == 0, result.stderr
    records = read_jsonl(out)
    assert records[0] == {"op": "R", "table": "public.t", "key": {"id": 1},
                          "row": {"id": 1, "v": "copied", "n": "1.50", "b": "\\x00ff", "f": "NaN"}}
    key_change = sorted(records[3:5], key=lambda r: r["op"])
    assert records[1:3] + key_change + records[5:] == [
        {"op": "I", "table": "public.t", "key": {"id": 2},
         "row": {"id": 2, "v": "tab\there\nline \\ back", "n": "2", "b": None, "f": 1.5}},
        {"op": "U", "table": "public.t", "key": {"id": 1},
         "row": {"id": 1, "v": "updated", "n": "1.50", "b": "\\x00ff", "f": "NaN"}},
        {"op": "D", "table": "public.t", "key": {"id": 2}},
        {"op": "U", "table": "public.t", "key": {"id": 3},
         "row": {"id": 3, "v": "tab\there\nline \\ back", "n": "2", "b": None, "f": 1.5}},
        {"op": "D", "table": "public.t", "key": {"id": 1}},
        {"op": "T", "table": "public.t"},
        {"op": "I", "table": "public.t", "key": {"id": 4},
         "row": {"id": 4, "v": None, "n": None, "b": None, "f": None}},
    ]


def test_jsonl_to_stdout_writes_only_change_objects_on_stdout(dsn, conn, queue_t, source, tmp_path):
    stdout = tmp_path / "stdout"
    daemon = Daemon(dsn, "consume", "q", "--target", "jsonl:-", "--poll-interval", "0.05",
                    log=tmp_path / "consumer.log", stdout=stdout)
    try:
        wait_until(lambda: stdout.read_bytes().count(b"\n") >= 1, 30, "the copied row",
                   check=lambda: daemon.alive() or pytest.fail(daemon.log()))
        write_changes(conn)
        source.tick("q", force=True)
        wait_until(lambda: stdout.read_bytes().count(b"\n") >= 8, 30, "the changes",
                   check=lambda: daemon.alive() or pytest.fail(daemon.log()))
        assert daemon.terminate() == 0
    finally:
        daemon.stop()
    records = [json.loads(line) for line in stdout.read_text(encoding="utf-8").splitlines()]
    assert [r["op"] for r in records][:3] == ["R", "I", "U"]
    assert sorted(r["op"] for r in records[3:]) == ["D", "D", "I", "T", "U"]
    assert all(r["table"] == "public.t" for r in records)


def test_tsv_has_escaped_tab_separated_key_value_pairs(dsn, conn, queue_t, tmp_path):
    out = tmp_path / "changes.tsv"
    assert run_cli_in_process(dsn, "consume", "q", "--target", f"tsv:{out}", "--until-caught-up").returncode == 0
    write_changes(conn)
    assert run_cli_in_process(dsn, "consume", "q", "--target", f"tsv:{out}", "--until-caught-up").returncode == 0
    lines = out.read_text(encoding="utf-8").split("\n")
    assert lines[-1] == ""
    records = [parse_tsv_line(line) for line in lines[:-1]]
    assert len(records) == 8
    assert records[0] == {"op": "R", "table": "public.t", "key.id": "1", "row.id": "1", "row.v": "copied",
                          "row.n": "1.50", "row.b": "\\x00ff", "row.f": "NaN"}
    assert records[1] == {"op": "I", "table": "public.t", "key.id": "2", "row.id": "2",
                          "row.v": "tab\there\nline \\ back", "row.n": "2", "row.b": None, "row.f": "1.5"}
    assert "\t" not in lines[1].split("\t")[9] and "\\t" in lines[1] and "\\n" in lines[1] and "\\\\" in lines[1]
    assert {"op": "T", "table": "public.t"} in records
    assert records[-1]["row.v"] is None and lines[-2].split("\t")[9] == "\\N"


@pytest.mark.parametrize("fmt", ["jsonl", "tsv"])
def test_with_old_rows_an_update_and_a_delete_carry_the_old_row_as_old(dsn, conn, queue_t, source, tmp_path, fmt):
    """jsonl: "old", the row before the change, on U and D lines (none on the new key's U of a key change);
    tsv: its columns as old.COLUMN pairs."""
    source.alter_table("q", "t", old_rows=True)
    out = tmp_path / f"changes.{fmt}"
    assert run_cli_in_process(dsn, "consume", "q", "--target", f"{fmt}:{out}", "--until-caught-up").returncode == 0
    write_changes(conn)
    assert run_cli_in_process(dsn, "consume", "q", "--target", f"{fmt}:{out}", "--until-caught-up").returncode == 0
    copied = {"id": 1, "v": "copied", "n": "1.50", "b": "\\x00ff", "f": "NaN"}
    inserted = {"id": 2, "v": "tab\there\nline \\ back", "n": "2", "b": None, "f": 1.5}
    if fmt == "jsonl":
        records = read_jsonl(out)
        changes = [(r["op"], r["key"], r.get("old")) for r in records if r["op"] in "UD"]
    else:
        records = [parse_tsv_line(line) for line in out.read_text(encoding="utf-8").splitlines()]
        changes = [(r["op"], {"id": int(r["key.id"] or 0)},
                    {k[4:]: v for k, v in r.items() if k.startswith("old.")} or None) for r in records if r["op"] in "UD"]
        copied = {k: None if v is None else str(v) for k, v in copied.items()}
        inserted = {k: None if v is None else str(v) for k, v in inserted.items()}
    assert sorted(changes, key=repr) == sorted([
        ("U", {"id": 1}, copied),
        ("D", {"id": 2}, inserted), ("U", {"id": 3}, None),    # the key change
        ("D", {"id": 1}, {**copied, "v": "updated"})], key=repr)


def test_pk_mode_stream_shows_one_line_per_collapsed_key_with_the_current_row(dsn, conn, source, tmp_path):
    conn.execute("CREATE TABLE p (id int PRIMARY KEY, n int)")
    conn.execute("INSERT INTO p VALUES (1, 0), (2, 0)")
    source.create_queue("q")
    source.add_table("q", "p", mode="pk")
    out = tmp_path / "changes.jsonl"
    assert run_cli_in_process(dsn, "consume", "q", "--target", f"jsonl:{out}", "--until-caught-up").returncode == 0
    with conn.transaction():
        for _ in range(5):
            conn.execute("UPDATE p SET n = n + 1 WHERE id = 1")
        conn.execute("INSERT INTO p VALUES (3, 0)")
        conn.execute("DELETE FROM p WHERE id = 3")
        conn.execute("DELETE FROM p WHERE id = 2")
    conn.execute("UPDATE p SET n = 100 WHERE id = 1")      # later than the batch: read back anyway
    assert run_cli_in_process(dsn, "consume", "q", "--target", f"jsonl:{out}", "--until-caught-up").returncode == 0
    changes = read_jsonl(out)[2:]                          # after the two copied rows
    upserts = [r for r in changes if r["op"] != "D"]
    assert upserts == [{"op": "U", "table": "public.p", "key": {"id": 1}, "row": {"id": 1, "n": 100}}]
    assert sorted(r["key"]["id"] for r in changes if r["op"] == "D") == [2, 3]


STREAM_KILLER = textwrap.dedent("""
    import os, signal, sys
    from replicator import cli
    from replicator.source import Source
    from replicator.targets import stream
    point, n = sys.argv[1], int(sys.argv[2])
    calls = {"n": 0}

    def nth_call_dies(obj, name, when=lambda *a: True):
        original = getattr(obj, name)
        def hooked(*args, **kwargs):
            if when(*args):
                calls["n"] += 1
                if calls["n"] >= n:
                    os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)
        setattr(obj, name, hooked)

    if point == "lines synced, sidecar not replaced":
        nth_call_dies(stream.os, "replace", lambda src, dst: str(dst).endswith(".position"))
    elif point == "sidecar replaced, batch not finished":
        nth_call_dies(Source, "finish_batch")
    elif point == "in the middle of a batch":
        nth_call_dies(stream.StreamTarget, "_write")
    sys.argv = ["replicator", *sys.argv[3:]]
    cli.main()
""")


@pytest.mark.parametrize("fmt", ["jsonl", "tsv"])
@pytest.mark.parametrize("point,nth", [("lines synced, sidecar not replaced", 1),
                                        ("sidecar replaced, batch not finished", 1),
                                        ("in the middle of a batch", 40)])
def test_file_stream_resumed_after_kill_9_repeats_and_loses_no_line(dsn, conn, source, tmp_path, fmt, point,
                                                                    nth):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    source.create_queue("q")
    source.add_table("q", "t")
    crashed, clean = tmp_path / f"crashed.{fmt}", tmp_path / f"clean.{fmt}"
    for out in (crashed, clean):      # both copy the empty table and start at the same tick
        assert run_cli_in_process(dsn, "consume", "q", "--target", f"{fmt}:{out}", "--until-caught-up").returncode == 0
    ticks = source.latest_tick("q")
    for i in range(1, 61):
        conn.execute("INSERT INTO t VALUES (%s, %s)", (i, f"v\t{i}"))
        if i % 20 == 0:
            conn.execute("UPDATE t SET v = v || '!' WHERE id % 3 = 0")
            source.tick("q", force=True)
    assert source.latest_tick("q") == ticks + 3

    args = ["consume", "q", "--target", f"{fmt}:{crashed}", "--until-caught-up"]
    killed = subprocess.run([sys.executable, "-c", STREAM_KILLER, point, str(nth), *args], env=cli_env(dsn),
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, f"the kill point was not reached: {killed.stderr}"
    resumed = run_cli(dsn, *args)
    assert resumed.returncode == 0, resumed.stderr
    assert run_cli_in_process(dsn, "consume", "q", "--target", f"{fmt}:{clean}", "--until-caught-up").returncode == 0

    crashed_lines = crashed.read_text(encoding="utf-8").splitlines()
    assert len(crashed_lines) == 60 + 6 + 13 + 20    # 60 inserts; updates of ids divisible by 3
    assert crashed_lines == clean.read_text(encoding="utf-8").splitlines()


def test_writes_concurrent_with_the_copy_reach_the_stream_exactly_once(dsn, conn, source, tmp_path):
    """Every inserted id appears once: as a copied row (R) or as an insert (I),
    never both, although the consumer's position predates the copy."""
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, pad text)")
    conn.execute("INSERT INTO t SELECT g, repeat('x', 100) FROM generate_series(1, 50000) g")
    source.create_queue("q")
    source.add_table("q", "t")
    source.register_consumer("q", "c")
    set_fast_ticks(conn)
    out = tmp_path / "changes.jsonl"
    stop = threading.Event()
    inserted = {"n": 0}

    def writer() -> None:
        with psycopg.connect(dsn, autocommit=True) as w:
            while not stop.is_set():
                w.execute("INSERT INTO t VALUES (%s, 'new')", (100000 + inserted["n"],))
                inserted["n"] += 1

    thread = threading.Thread(target=writer)
    thread.start()
    ticker = Daemon(dsn, "ticker", "--interval", "0.05", log=tmp_path / "ticker.log")
    daemon = None
    try:
        wait_until(lambda: inserted["n"] >= 100, 30, "inserts before the consumer starts")
        daemon = Daemon(dsn, "consume", "q", "--target", f"jsonl:{out}", "--consumer", "c",
                        log=tmp_path / "consumer.log")
        sidecar = out.with_name(out.name + ".position")
        wait_until(lambda: sidecar.exists() and json.loads(sidecar.read_text())["tables"], 60, "the copy",
                   check=lambda: daemon.alive() or pytest.fail(daemon.log()))
        after_copy = inserted["n"]
        wait_until(lambda: inserted["n"] >= after_copy + 100, 30, "inserts after the copy")
    finally:
        stop.set()
        thread.join(30)
        if daemon is not None:
            daemon.stop()
        ticker.stop()
    result = run_cli_in_process(dsn, "consume", "q", "--target", f"jsonl:{out}", "--consumer", "c", "--until-caught-up")
    assert result.returncode == 0, result.stderr
    records = read_jsonl(out)
    counts = Counter(r["key"]["id"] for r in records)
    doubled = [k for k, n in counts.items() if n > 1]
    assert not doubled, f"{len(doubled)} ids written twice, e.g. {doubled[:5]}"
    assert set(counts) == set(range(1, 50001)) | set(range(100000, 100000 + inserted["n"]))
    ops = Counter(r["op"] for r in records)
    assert ops["R"] > 50000 and ops["I"] >= 100, ops        # inserts landed both in and after the copy


@pytest.mark.parametrize("how", ["deleted", "replaced by another file"])
def test_a_stream_file_deleted_under_the_running_consumer_stops_it_at_the_next_batch(dsn, conn, queue_t, source,
                                                                                      tmp_path, how):
    from replicator.errors import UserError
    from replicator.targets.stream import StreamTarget
    out = tmp_path / "changes.jsonl"
    target = StreamTarget(str(out), "jsonl")
    consumer = Consumer(dsn, "q", target)
    try:
        consumer.run(until_caught_up=True)
        position = target.positions("q")
        if how == "deleted":
            out.unlink()
        else:
            out.with_name("other").write_text("")
            out.with_name("other").replace(out)
        write_changes(conn)
        source.tick("q", force=True)
        with pytest.raises(UserError, match=rf"{out} was {how.split()[0]} .*consumer stopped"):
            consumer.run(until_caught_up=True)
        assert target.positions("q") == position
        assert json.loads(out.with_name(out.name + ".position").read_text())["positions"] == {
            f"q/{name}": tick for name, tick in position.items()}
    finally:
        consumer.close()
        target.close()


def test_a_second_consumer_of_one_stream_file_is_refused(tmp_path):
    """Each would cut the file back to the length it recorded, over the other's lines."""
    from replicator.errors import UserError
    from replicator.targets.stream import StreamTarget
    out = tmp_path / "changes.jsonl"
    first = StreamTarget(str(out), "jsonl")
    try:
        with pytest.raises(UserError, match="another consumer is writing"):
            StreamTarget(str(out), "tsv")
    finally:
        first.close()
    StreamTarget(str(out), "jsonl").close()


class StreamLosingTheSourceOnce(LosesTheSourceOnce, StreamTarget):
    pass


def _replayed(path: Path) -> dict[str, dict[str, object]]:
    """The table's rows as a reader of the stream rebuilds them, by key."""
    rows: dict[str, dict[str, object]] = {}
    for record in map(json.loads, path.read_text().splitlines()):
        if record["op"] == "T":
            rows.clear()
        elif record["op"] == "D":
            rows.pop(json.dumps(record["key"]), None)
        elif record["op"] in ("R", "I", "U"):
            rows[json.dumps(record["key"])] = record["row"]
    return rows


@pytest.mark.parametrize("ddl", ["ALTER TABLE t ADD COLUMN b text", "ALTER TABLE t ALTER COLUMN a TYPE numeric(12,2)"],
                         ids=["altered in place", "copied again"])
def test_a_batch_that_changed_a_table_and_failed_is_written_again_whole_to_the_file(dsn, conn, source, tmp_path, ddl):
    source.create_queue("q")
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, a numeric(10,2))")
    conn.execute("INSERT INTO t VALUES (1, 1.5)")
    source.add_table("q", "t")
    path = tmp_path / "out.jsonl"
    # one batch: a row, the schema change, a row after it
    apply_losing_the_source_once(dsn, conn, StreamLosingTheSourceOnce(str(path), "jsonl"),
                                 ["INSERT INTO t VALUES (2, 2.5)", ddl, "INSERT INTO t VALUES (3, 3.5)"])
    assert sorted(row["id"] for row in _replayed(path).values()) == [1, 2, 3]
    assert [op for op in (json.loads(line)["op"] for line in path.read_text().splitlines())].count("S") == 1
