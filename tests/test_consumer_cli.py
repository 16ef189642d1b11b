"""The `consume` and `status` commands as a user runs them: the real console
script in a subprocess. Mistakes are one line and a non-zero exit, never a
traceback; status reports each consumer's lag."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest

from consumer_helpers import run_cli, sqlite_position


def assert_one_line_error(result, *fragments: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture
def queue_q(conn, source):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    source.create_queue("q")
    source.add_table("q", "t")
    return "q"


def bad_targets(tmp_path):
    not_a_database = tmp_path / "garbage.db"
    not_a_database.write_bytes(b"this is not a SQLite file" * 100)
    (tmp_path / "torn.jsonl.position").write_text('{"positions": {"q/c": 4}, "tab')
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "w.db-wal").mkdir()
    return {
        "corrupt position file (jsonl)": (f"jsonl:{tmp_path}/torn.jsonl", ["torn.jsonl.position"]),
        "unknown scheme": (f"mysql:{tmp_path}/r.db", ["mysql"]),
        "no scheme": ("replica.db", ["replica.db"]),
        "missing directory (sqlite)": (f"sqlite:{tmp_path}/no/such/dir/r.db", ["no/such/dir"]),
        "a directory (sqlite)": (f"sqlite:{tmp_path}", [str(tmp_path)]),
        "not a database (sqlite)": (f"sqlite:{not_a_database}", ["garbage.db"]),
        "missing directory (jsonl)": (f"jsonl:{tmp_path}/no/such/dir/out.jsonl", ["out.jsonl"]),
        "a directory (tsv)": (f"tsv:{tmp_path}", [str(tmp_path), "a directory", "tsv:-"]),
        "a named pipe (jsonl)": (f"jsonl:{tmp_path}/pipe", [f"{tmp_path}/pipe", "named pipe", "not a regular file",
                                                             "jsonl:-"]),
        "a device (jsonl)": ("jsonl:/dev/null", ["/dev/null", "character device", "not a regular file", "jsonl:-"]),
        "a named pipe (sqlite)": (f"sqlite:{tmp_path}/pipe", [f"{tmp_path}/pipe", "named pipe", "not a regular file"]),
        "a device (sqlite)": ("sqlite:/dev/null", ["/dev/null", "character device", "not a regular file"]),
        "a -wal that is a directory (sqlite)": (f"sqlite:{tmp_path}/w.db", [f"{tmp_path}/w.db-wal", "a directory",
                                                                            "not a regular file"]),
    }


@pytest.mark.parametrize("case", ["corrupt position file (jsonl)", "unknown scheme", "no scheme", "missing directory (sqlite)",
                                  "a directory (sqlite)", "not a database (sqlite)", "missing directory (jsonl)",
                                  "a directory (tsv)", "a named pipe (jsonl)", "a device (jsonl)",
                                  "a named pipe (sqlite)", "a device (sqlite)", "a -wal that is a directory (sqlite)"])
def test_unusable_target_is_one_error_line_and_nonzero_exit(dsn, queue_q, tmp_path, case):
    target, fragments = bad_targets(tmp_path)[case]
    result = run_cli(dsn, "consume", "q", "--target", target, "--until-caught-up")
    assert_one_line_error(result, *fragments)


@pytest.mark.parametrize("target", ["host=db password=s3cret", "dbname=shop user=app password=s3:cret"])
def test_a_connection_string_given_as_target_is_refused_naming_dsn_without_echoing_it(dsn, queue_q, target):
    """A newcomer giving --target the database: told where it goes; its text, which may hold a
    password, is not printed (with a colon in it, the part before was echoed as the scheme)."""
    result = run_cli(dsn, "consume", "q", "--target", target, "--until-caught-up")
    assert_one_line_error(result, "--dsn", "sqlite:PATH")
    assert "password" not in result.stderr


def test_unknown_queue_is_one_error_line_and_registers_nothing(dsn, conn, queue_q, tmp_path):
    result = run_cli(dsn, "consume", "nosuchq", "--target", f"sqlite:{tmp_path}/r.db", "--until-caught-up")
    assert_one_line_error(result, "nosuchq")
    assert conn.execute("SELECT count(*) FROM replicator.consumer").fetchone()[0] == 0


def test_unknown_tables_entry_is_one_error_line_and_registers_nothing(dsn, conn, queue_q, tmp_path):
    replica = tmp_path / "r.db"
    result = run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--tables", "t,nosuch",
                     "--until-caught-up")
    assert_one_line_error(result, "nosuch")
    # A consumer left registered would hold back the queue's rotation for good.
    assert conn.execute("SELECT count(*) FROM replicator.consumer").fetchone()[0] == 0
    assert sqlite_position(replica) is None


def test_two_tables_with_one_sqlite_name_stop_the_consumer_and_clobber_nothing(dsn, conn, source, tmp_path):
    conn.execute('CREATE SCHEMA s; CREATE TABLE s.t (id int PRIMARY KEY, v text); CREATE TABLE "s__t" (id int PRIMARY KEY)')
    conn.execute("INSERT INTO s.t VALUES (1, 'schema s'); INSERT INTO s__t VALUES (2)")
    source.create_queue("q")
    source.add_table("q", "s.t")
    replica = tmp_path / "r.db"
    assert run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up").returncode == 0
    source.add_table("q", "public.s__t")
    result = run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up")
    # (after the log line of its start) one error line, exit 1
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: s.t and public.s__t would both be table 's__t'") and "separate targets" in last
    db = sqlite3.connect(replica)
    assert db.execute("SELECT * FROM s__t").fetchall() == [(1, "schema s")]    # s.t's replica is intact
    db.close()
    other = run_cli(dsn, "consume", "q", "--target", f"sqlite:{tmp_path / 'other.db'}", "--tables", "public.s__t",
                    "--until-caught-up")
    assert other.returncode == 0, other.stderr


@pytest.mark.parametrize("case", ["unreachable server", "schema not installed", "once and until-caught-up"])
def test_other_consume_mistakes_are_one_error_line(empty_dsn, tmp_path, case):
    dsn = {"unreachable server": "host=127.0.0.1 port=1 user=postgres dbname=x connect_timeout=5"}.get(case, empty_dsn)
    extra = ["--once"] if case == "once and until-caught-up" else []
    result = run_cli(dsn, "consume", "q", "--target", f"sqlite:{tmp_path}/r.db", "--until-caught-up", *extra)
    assert_one_line_error(result)


def registered_consumers(conn) -> list[str]:
    return [r[0] for r in conn.execute("SELECT consumer_name FROM replicator.consumer ORDER BY 1")]


def test_a_replica_stays_the_consumer_it_was_made_as(dsn, conn, queue_q, tmp_path):
    replica = tmp_path / "r.db"
    assert run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up",
                   "--consumer", "first").returncode == 0
    conn.execute("INSERT INTO t VALUES (1, 'a')")
    # Without --consumer it resumes as the consumer whose position it holds.
    resumed = run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up")
    assert resumed.returncode == 0, resumed.stderr
    assert registered_consumers(conn) == ["first"]
    conn.execute("INSERT INTO t VALUES (2, 'b')")
    # Another name would register at the current tick and skip row 2 for good: refused.
    renamed = run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up",
                      "--consumer", "second")
    assert_one_line_error(renamed, "'first'", "'second'")
    assert registered_consumers(conn) == ["first"]
    assert run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up").returncode == 0
    db = sqlite3.connect(replica)
    assert db.execute("SELECT id, v FROM t ORDER BY id").fetchall() == [(1, "a"), (2, "b")]
    db.close()


def test_a_replica_file_moved_elsewhere_resumes_where_it_was(dsn, conn, queue_q, tmp_path):
    replica = tmp_path / "r.db"
    conn.execute("INSERT INTO t VALUES (1, 'a')")
    assert run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up").returncode == 0
    conn.execute("INSERT INTO t VALUES (2, 'b')")
    moved = tmp_path / "moved" / "replica.db"
    moved.parent.mkdir()
    replica.rename(moved)
    result = run_cli(dsn, "consume", "q", "--target", f"sqlite:{moved}", "--until-caught-up")
    assert result.returncode == 0, result.stderr
    assert len(registered_consumers(conn)) == 1
    db = sqlite3.connect(moved)
    assert db.execute("SELECT id, v FROM t ORDER BY id").fetchall() == [(1, "a"), (2, "b")]
    db.close()


def test_tables_leaving_out_a_table_the_replica_holds_is_refused(dsn, conn, source, queue_q, tmp_path):
    conn.execute("CREATE TABLE u (id int PRIMARY KEY)")
    source.add_table("q", "u")
    replica = tmp_path / "r.db"
    assert run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up").returncode == 0
    conn.execute("INSERT INTO u VALUES (1)")
    narrowed = run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--tables", "t", "--until-caught-up")
    # Its changes would be skipped while the position moves on past them.
    assert_one_line_error(narrowed, "public.u", "--tables")
    assert run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up").returncode == 0
    db = sqlite3.connect(replica)
    assert db.execute("SELECT id FROM u").fetchall() == [(1,)]
    db.close()


def test_default_consumer_names_differ_between_hosts_and_targets(monkeypatch, tmp_path):
    from replicator.consumer import default_consumer_name, temporary_consumer_name
    from replicator.targets.sqlite.target import SqliteTarget
    from replicator.targets.stream import StreamTarget

    names = {}
    for host in ("cache-1", "cache-2"):
        monkeypatch.setattr("socket.gethostname", lambda host=host: host)
        for path in (tmp_path / "a.db", tmp_path / "b.db"):
            target = SqliteTarget(path)
            names[host, path.name] = default_consumer_name(target)
            assert default_consumer_name(target) == names[host, path.name]    # stable
            target.close()
    assert len(set(names.values())) == 4, names
    # a stream to stdout without --consumer is a consumer for one run, of its host and process, with a random token
    for host in ("cache-1", "cache-2"):
        monkeypatch.setattr("socket.gethostname", lambda host=host: host)
        assert re.fullmatch(f"jsonl_stdout_{hashlib.sha1(host.encode()).hexdigest()[:8]}_{os.getpid()}_[0-9a-f]{{8}}",
                            temporary_consumer_name(StreamTarget("-", "jsonl")))


def test_status_shows_each_consumer_lag_in_ticks_events_and_seconds(dsn, conn, source, queue_q, tmp_path):
    replica = tmp_path / "r.db"
    assert run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up",
                   "--consumer", "behind").returncode == 0
    assert run_cli(dsn, "consume", "q", "--target", f"sqlite:{tmp_path}/other.db", "--until-caught-up",
                   "--consumer", "current").returncode == 0
    conn.execute("INSERT INTO t VALUES (1, 'a')")       # three statements: three events
    conn.execute("INSERT INTO t VALUES (2, 'b')")
    conn.execute("UPDATE t SET v = 'c'")
    source.tick("q", force=True)
    source.tick("q", force=True)
    assert run_cli(dsn, "consume", "q", "--target", f"sqlite:{tmp_path}/other.db", "--until-caught-up",
                   "--consumer", "current").returncode == 0
    position_age = conn.execute(
        "SELECT extract(epoch FROM clock_timestamp() - tick_time) FROM replicator.tick"
        " WHERE tick_id = %s", (sqlite_position(replica),)).fetchone()[0]

    result = run_cli(dsn, "status", "--json")
    assert result.returncode == 0, result.stderr
    consumers = {c["consumer"]: c for c in json.loads(result.stdout)["consumers"]}
    behind, current = consumers["behind"], consumers["current"]
    assert behind["last_tick"] == sqlite_position(replica)
    assert (behind["lag_ticks"], behind["lag_events"]) == (source.latest_tick("q") - behind["last_tick"], 3)
    assert behind["lag_seconds"] >= float(position_age) - 0.01
    assert (current["lag_ticks"], current["lag_events"]) == (0, 0)
    assert current["lag_seconds"] < behind["lag_seconds"]

    table = run_cli(dsn, "status", COLUMNS="250")
    assert table.returncode == 0, table.stderr
    for heading in ("lag ticks", "lag events", "lag seconds", "behind", "current"):
        assert heading in table.stdout, table.stdout


# a target that names something existing -----------------------------------------------

def files_at(path: Path) -> dict[str, str]:
    """Every file whose name starts with path's name, in its directory, with its bytes'
    hash: a check that wrote the file, or left a -wal, -shm or .position beside it, shows."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.parent.iterdir()) if p.name.startswith(path.name)}


def tree_at(root: Path) -> dict[str, str]:
    """Every file and directory under root, files with their bytes' hash."""
    return {str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


def application_database(path: Path, journal: str) -> None:
    """An application's own SQLite file, with a table named like the captured one."""
    with closing(sqlite3.connect(path)) as db:
        db.execute(f"PRAGMA journal_mode = {journal}")
        db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, note TEXT)")
        db.executemany("INSERT INTO t VALUES (?, ?)", [(1, "mine"), (2, "also mine")])
        db.commit()


@pytest.mark.parametrize("journal", ["delete", "wal"])
def test_an_application_sqlite_database_given_as_target_is_refused_untouched(dsn, conn, queue_q, tmp_path,
                                                                             journal):
    app = tmp_path / "app.db"
    application_database(app, journal)
    conn.execute("INSERT INTO t VALUES (10, 'from the source')")
    before = files_at(app)
    assert list(before) == ["app.db"]
    result = run_cli(dsn, "consume", "q", "--target", f"sqlite:{app}", "--until-caught-up")
    assert result.returncode == 1
    assert_one_line_error(result, str(app), "not a replica", "another path")
    assert files_at(app) == before          # byte for byte, and no -wal, -shm or -journal left beside it
    with closing(sqlite3.connect(app)) as db:
        assert db.execute("SELECT id, note FROM t ORDER BY id").fetchall() == [(1, "mine"), (2, "also mine")]
    assert registered_consumers(conn) == []


@pytest.mark.parametrize("journal", ["delete", "wal"])
def test_view_commands_on_an_application_database_leave_it_untouched(dsn, tmp_path, journal):
    app = tmp_path / "app.db"
    application_database(app, journal)
    before = files_at(app)
    for args in (["view", "list"], ["view", "create", "v", "--sql", "SELECT id FROM t"], ["view", "drop", "v"],
                 ["view", "explain", "--sql", "SELECT id FROM t"]):
        result = run_cli(dsn, *args, "--target", f"sqlite:{app}")
        assert result.returncode == 1
        assert_one_line_error(result, "no replica at", "is not a replica")
        assert files_at(app) == before, args


def files_and_times_at(path: Path) -> dict[str, tuple[str, int]]:
    """files_at, with each file's mtime: a write of the same bytes shows too."""
    return {name: (digest, (path.parent / name).stat().st_mtime_ns) for name, digest in files_at(path).items()}


@pytest.mark.parametrize("shm", ["with its -shm", "without its -shm"])
def test_an_application_wal_database_with_a_live_wal_is_refused_with_its_files_untouched(dsn, conn, queue_q,
                                                                                         tmp_path, shm):
    """The files of an application's WAL-mode database as it left them, changes still in
    its -wal (killed, or open elsewhere): reading the -wal means mapping the -shm, which
    writes it, or creates it when missing. Neither the check nor the refusal touches them."""
    app = tmp_path / "app.db"
    with closing(sqlite3.connect(tmp_path / "live.db")) as db:
        db.execute("PRAGMA journal_mode = wal")
        db.execute("PRAGMA wal_autocheckpoint = 0")
        db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, note TEXT)")
        db.execute("INSERT INTO t VALUES (1, 'mine')")
        db.commit()
        for suffix in ("", "-wal") + (("-shm",) if shm == "with its -shm" else ()):
            shutil.copyfile(f"{tmp_path}/live.db{suffix}", f"{app}{suffix}")
    assert Path(f"{app}-wal").stat().st_size > 0
    before = files_and_times_at(app)
    result = run_cli(dsn, "consume", "q", "--target", f"sqlite:{app}", "--until-caught-up")
    assert result.returncode == 1
    assert_one_line_error(result, str(app), "another path")
    assert files_and_times_at(app) == before
    for args in (["view", "list"], ["view", "create", "v", "--sql", "SELECT id FROM t"]):
        result = run_cli(dsn, *args, "--target", f"sqlite:{app}")
        assert_one_line_error(result, "no replica at", "is not a replica")
        assert files_and_times_at(app) == before, args
    assert registered_consumers(conn) == []


def test_a_file_that_is_not_sqlite_is_refused_untouched(dsn, conn, queue_q, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes, not a database\n" * 40)
    before = files_at(notes)
    result = run_cli(dsn, "consume", "q", "--target", f"sqlite:{notes}", "--until-caught-up")
    assert result.returncode == 1
    assert_one_line_error(result, str(notes), "not a SQLite database", "another path")
    assert files_at(notes) == before
    assert registered_consumers(conn) == []


def test_a_wal_left_without_its_database_is_refused_untouched(dsn, conn, queue_q, tmp_path):
    """SQLite would replay the WAL of a deleted replica into the new file: pages of a
    database whose other pages are gone."""
    replica = tmp_path / "r.db"
    assert run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up").returncode == 0
    with closing(sqlite3.connect(replica)) as db:    # a replica with changes in its WAL, as a running one has
        db.execute("PRAGMA wal_autocheckpoint = 0")
        db.execute("INSERT INTO t VALUES (1, 'in the WAL')")
        db.commit()
        left = {name: Path(f"{replica}{name}").read_bytes() for name in ("-wal", "-shm")}
    replica.unlink()
    for name, data in left.items():
        Path(f"{replica}{name}").write_bytes(data)
    before = files_at(replica)
    result = run_cli(dsn, "consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up")
    assert result.returncode == 1
    assert_one_line_error(result, f"{replica}-wal", "aside")
    assert files_at(replica) == before


@pytest.mark.parametrize("fmt", ["jsonl", "tsv"])
def test_an_existing_stream_file_without_its_position_file_is_refused_untouched(dsn, conn, queue_q, tmp_path, fmt):
    out = tmp_path / f"events.{fmt}"
    out.write_text("a line of some other program's log\n" * 10)
    conn.execute("INSERT INTO t VALUES (1, 'a')")
    before = files_at(out)
    result = run_cli(dsn, "consume", "q", "--target", f"{fmt}:{out}", "--until-caught-up")
    assert result.returncode == 1
    assert_one_line_error(result, str(out), f"{out.name}.position", "another path")
    assert files_at(out) == before          # and no events.jsonl.position made
    assert registered_consumers(conn) == []


@pytest.mark.parametrize("scheme", ["sqlite", "jsonl", "tsv"])
def test_an_empty_file_is_taken_as_a_new_target(dsn, conn, queue_q, tmp_path, scheme):
    """A 0-byte file holds nothing to lose (`touch replica.db`): it becomes the target."""
    path = tmp_path / f"new.{scheme}"
    path.touch()
    conn.execute("INSERT INTO t VALUES (1, 'a')")
    result = run_cli(dsn, "consume", "q", "--target", f"{scheme}:{path}", "--until-caught-up")
    assert result.returncode == 0, result.stderr
    if scheme == "sqlite":
        with closing(sqlite3.connect(path)) as db:
            assert db.execute("SELECT id, v FROM t").fetchall() == [(1, "a")]
    else:
        assert path.read_text().count("\n") == 1         # the copied row


@pytest.mark.parametrize("what", ["shorter", "missing"])
def test_a_stream_file_that_lost_lines_its_position_file_records_is_refused(dsn, conn, queue_q, tmp_path, what):
    out = tmp_path / "events.jsonl"
    conn.execute("INSERT INTO t SELECT g, 'row ' || g FROM generate_series(1, 20) g")
    assert run_cli(dsn, "consume", "q", "--target", f"jsonl:{out}", "--until-caught-up").returncode == 0
    if what == "shorter":
        out.write_bytes(out.read_bytes()[:100])
    else:
        out.unlink()
    before = files_at(out)
    conn.execute("INSERT INTO t VALUES (100, 'later')")
    result = run_cli(dsn, "consume", "q", "--target", f"jsonl:{out}", "--until-caught-up")
    assert result.returncode == 1
    assert_one_line_error(result, str(out), "events.jsonl.position")
    assert files_at(out) == before          # not padded with NUL bytes to the recorded length


@pytest.mark.parametrize("scheme", ["sqlite", "jsonl"])
def test_a_target_holding_another_queue_is_refused(dsn, conn, source, queue_q, tmp_path, scheme):
    conn.execute("CREATE TABLE u (id int PRIMARY KEY)")
    source.create_queue("other")
    source.add_table("other", "u")
    path = tmp_path / f"r.{scheme}"
    assert run_cli(dsn, "consume", "q", "--target", f"{scheme}:{path}", "--until-caught-up").returncode == 0
    before = files_at(path)
    result = run_cli(dsn, "consume", "other", "--target", f"{scheme}:{path}", "--until-caught-up")
    assert result.returncode == 1
    assert_one_line_error(result, "queue 'q'", "'other'")
    assert files_at(path) == before
    assert [c for c in registered_consumers(conn) if "other" in c] == []


def test_a_non_empty_directory_that_is_not_a_warehouse_is_refused_untouched(dsn, conn, queue_q, tmp_path):
    pytest.importorskip("pyarrow")
    data = tmp_path / "data"
    (data / "exports" / "2024").mkdir(parents=True)
    (data / "exports" / "2024" / "orders.csv").write_text("id,amount\n1,10\n")
    (data / "README").write_text("our data\n")
    before = tree_at(data)
    for args in (["consume", "q", "--target", f"delta:{data}", "--until-caught-up"],
                 ["delta", "optimize", "--target", f"delta:{data}"], ["view", "list", "--target", f"delta:{data}"]):
        result = run_cli(dsn, *args)
        assert result.returncode == 1
        assert_one_line_error(result, str(data), *(["another path"] if args[0] == "consume" else []))
        assert tree_at(data) == before, args
    assert registered_consumers(conn) == []


def test_a_replica_older_than_the_queue_keeps_is_told_how_to_rebuild_it(dsn, conn, queue_q, tmp_path):
    replica = tmp_path / "r.db"
    consume = ["consume", "q", "--target", f"sqlite:{replica}", "--until-caught-up"]
    conn.execute("INSERT INTO t VALUES (1, 'a')")
    assert run_cli(dsn, *consume).returncode == 0
    backup = tmp_path / "backup.db"
    shutil.copyfile(replica, backup)       # closed by its consumer: the whole replica is in the file
    conn.execute("INSERT INTO t VALUES (2, 'b')")
    assert run_cli(dsn, *consume).returncode == 0
    assert run_cli(dsn, "maint", "--once").returncode == 0     # ticks before the consumer's are gone
    os.replace(backup, replica)             # the old backup restored

    result = run_cli(dsn, *consume)
    assert result.returncode == 1
    assert_one_line_error(result, str(replica), "no longer has", "replicator consume q", "--recopy")
    # The way out it gives works as written.
    command = re.search(r"run `(replicator consume [^`]*)`", result.stderr)
    assert command, result.stderr
    rebuilt = run_cli(dsn, *shlex.split(command.group(1))[1:], "--until-caught-up")
    assert rebuilt.returncode == 0, rebuilt.stderr
    with closing(sqlite3.connect(replica)) as db:
        assert db.execute("SELECT id, v FROM t ORDER BY id").fetchall() == [(1, "a"), (2, "b")]
    assert len(registered_consumers(conn)) == 1
