"""Consumers with a lifecycle and a ticker that is seen: a stream to stdout is a
consumer for one run unless named, idle consumers are reported (temporary ones
unregistered), maint says what blocks an overdue rotation, a dead ticker is named
as the blocker, and text output never cuts a name."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
from datetime import timedelta

import psycopg
import pytest

from consumer_helpers import REPLICATOR, Daemon, cli_env, run_cli, wait_until
from replicator.errors import UserError
from replicator.source import jobs
from replicator.source.status import status


@pytest.fixture
def q(conn, source):
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    conn.execute("INSERT INTO t VALUES (1, 'copied')")
    source.create_queue("q", rotation_period=timedelta(hours=1))
    source.add_table("q", "t")
    return source


def _consumers(source) -> dict[str, dict]:
    return {c["consumer"]: c for c in status(source)["consumers"]}


def _due(conn) -> None:
    """The rotation period has passed a day ago (instead of waiting)."""
    conn.execute("UPDATE replicator.queue SET queue_switch_time = now() - interval '1 day'")


def _unseen_for_two_hours(conn, consumer: str) -> None:
    """The consumer was last seen two hours ago (the queue's idle limit is one)."""
    conn.execute("UPDATE replicator.consumer SET active_time = now() - interval '2 hours' WHERE consumer_name = %s",
                 (consumer,))


def _connected(conn, consumer: str) -> bool:
    return conn.execute("SELECT replicator.consumer_connected(c) FROM replicator.consumer c WHERE consumer_name = %s",
                        (consumer,)).fetchone()[0]


# a stream to stdout ------------------------------------------------------------------------

def test_the_help_example_leaves_no_consumer_behind_and_rotation_is_not_blocked_by_it(dsn, conn, q):
    result = run_cli(dsn, "consume", "q", "--target", "jsonl:-", "--until-caught-up")
    assert result.returncode == 0, result.stderr
    assert [json.loads(line)["op"] for line in result.stdout.splitlines()] == ["R"]
    assert "temporary consumer jsonl_stdout_" in result.stderr      # it was registered for the run ...
    assert _consumers(q) == {}                                      # ... and no longer is
    _due(conn)
    maint = run_cli(dsn, "maint", "--once")
    assert maint.returncode == 0, maint.stderr
    assert maint.stdout.startswith("q: rotated"), maint.stdout


def test_a_stdout_stream_is_shown_temporary_while_it_runs_and_unregistered_by_sigterm(dsn, conn, q, tmp_path):
    daemon = Daemon(dsn, "consume", "q", "--target", "tsv:-", "--poll-interval", "0.05",
                    log=tmp_path / "consumer.log", stdout=tmp_path / "out.tsv")
    try:
        (name,) = wait_until(lambda: _consumers(q), 30, "the consumer registered",
                             check=lambda: daemon.alive() or pytest.fail(daemon.log()))
        shown = _consumers(q)[name]
        assert (shown["temporary"], shown["connected"], shown["idle"]) == (True, True, False)
        assert "temporary" in run_cli(dsn, "status").stdout
        assert daemon.terminate() == 0
    finally:
        daemon.stop()
    assert _consumers(q) == {}


def test_sigterm_during_until_caught_up_unregisters_the_temporary_consumer(dsn, q, tmp_path):
    q.tick("q", force=True)                 # registering needs no tick of its own
    with psycopg.connect(dsn) as ticker:    # holds the queue as a ticker would: the run waits for its tick
        ticker.execute("SELECT FROM replicator.queue FOR NO KEY UPDATE")
        daemon = Daemon(dsn, "consume", "q", "--target", "jsonl:-", "--until-caught-up",
                        log=tmp_path / "consumer.log", stdout=tmp_path / "out.jsonl")
        try:
            wait_until(lambda: _consumers(q), 30, "the consumer registered",
                       check=lambda: daemon.alive() or pytest.fail(daemon.log()))
            assert daemon.terminate() == 130                        # interrupted, as by Ctrl-C
        finally:
            daemon.stop()
    assert _consumers(q) == {}, daemon.log()
    assert "Traceback" not in daemon.log()


def test_a_stdout_stream_ending_in_an_error_unregisters_its_temporary_consumer(dsn, conn, q):
    # `| head -1`: the reader goes away, the next line written fails the run
    proc = subprocess.Popen([str(REPLICATOR), "consume", "q", "--target", "jsonl:-", "--poll-interval", "0.05"],
                            env=cli_env(dsn), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None and json.loads(proc.stdout.readline())["op"] == "R"
        proc.stdout.close()
        conn.execute("INSERT INTO t VALUES (2, 'after the reader left')")
        q.tick("q", force=True)
        assert proc.wait(60) == 1                                   # as click ends on a broken pipe: silently
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = proc.stderr.read().decode() if proc.stderr else ""
    assert _consumers(q) == {}, stderr
    assert "Traceback" not in stderr


def test_a_temporary_consumer_killed_is_unregistered_by_maint_once_idle_past_the_limit(dsn, conn, q, tmp_path):
    daemon = Daemon(dsn, "consume", "q", "--target", "jsonl:-", "--poll-interval", "0.05",
                    log=tmp_path / "consumer.log", stdout=tmp_path / "out.jsonl")
    try:
        (name,) = wait_until(lambda: _consumers(q), 30, "the consumer registered",
                             check=lambda: daemon.alive() or pytest.fail(daemon.log()))
        daemon.kill9()
    finally:
        daemon.stop()
    wait_until(lambda: not _connected(conn, name), 30, "the killed consumer's session to end")
    kept = run_cli(dsn, "maint", "--once")                          # seen just now: not idle yet
    assert kept.returncode == 0 and "unregistered" not in kept.stdout, kept.stdout + kept.stderr
    assert list(_consumers(q)) == [name]

    _unseen_for_two_hours(conn, name)
    assert _consumers(q)[name]["idle"]
    maint = run_cli(dsn, "maint", "--once")
    assert maint.returncode == 0, maint.stderr
    assert f"temporary consumer {name} unregistered: idle for more than 1h, its process gone" in maint.stdout
    assert _consumers(q) == {}


def test_a_temporary_consumer_still_connected_is_not_unregistered_however_long_unseen(q, conn, dsn, tmp_path):
    """A long initial copy polls no batch for as long: its connection says it is there."""
    daemon = Daemon(dsn, "consume", "q", "--target", "jsonl:-", "--poll-interval", "0.05",
                    log=tmp_path / "consumer.log", stdout=tmp_path / "out.jsonl")
    try:
        (name,) = wait_until(lambda: _consumers(q), 30, "the consumer registered",
                             check=lambda: daemon.alive() or pytest.fail(daemon.log()))
        daemon.proc.send_signal(signal.SIGSTOP)                     # connected, polling nothing
        _unseen_for_two_hours(conn, name)
        assert "unregistered" not in run_cli(dsn, "maint", "--once").stdout
        assert not _consumers(q)[name]["idle"]
        daemon.proc.send_signal(signal.SIGCONT)
        assert daemon.terminate() == 0
    finally:
        daemon.stop()
    assert _consumers(q) == {}


def test_a_named_stdout_consumer_stays_registered_and_is_reported_idle_never_unregistered(dsn, conn, q):
    result = run_cli(dsn, "consume", "q", "--target", "jsonl:-", "--consumer", "feed", "--until-caught-up")
    assert result.returncode == 0, result.stderr
    assert (_consumers(q)["feed"]["temporary"], _consumers(q)["feed"]["idle"]) == (False, False)

    _unseen_for_two_hours(conn, "feed")
    feed = json.loads(run_cli(dsn, "status", "--json").stdout)["consumers"][0]
    assert (feed["consumer"], feed["idle"], feed["connected"]) == ("feed", True, False)
    assert feed["idle_seconds"] >= 7200
    maint = run_cli(dsn, "maint", "--once")
    assert maint.returncode == 0, maint.stderr
    assert ("consumer feed idle: not seen for 2h, not connected; it holds back rotation: start it again, or if it"
            " is retired: replicator queue unregister q feed") in maint.stdout
    assert list(_consumers(q)) == ["feed"]
    assert "idle" in run_cli(dsn, "status").stdout

    conn.execute("INSERT INTO t VALUES (2, 'meanwhile')")
    again = run_cli(dsn, "consume", "q", "--target", "jsonl:-", "--consumer", "feed", "--until-caught-up")
    assert again.returncode == 0, again.stderr
    assert {"id": 2} in [json.loads(line)["key"] for line in again.stdout.splitlines()]
    assert list(_consumers(q)) == ["feed"] and not _consumers(q)["feed"]["idle"]


def test_the_consumer_idle_limit_is_a_queue_setting(dsn, conn, q):
    _gone(conn, _register_from_a_session(dsn, "q", "c"))           # its daemon stopped
    conn.execute("UPDATE replicator.consumer SET active_time = now() - interval '3 hours'")
    assert _consumers(q)["c"]["idle"]
    changed = run_cli(dsn, "queue", "config", "q", "--consumer-idle-limit", "1d")
    assert changed.returncode == 0 and "consumer_idle_limit: 1d" in changed.stdout, changed.stdout + changed.stderr
    assert not _consumers(q)["c"]["idle"]
    created = run_cli(dsn, "queue", "create", "other", "--consumer-idle-limit", "30min")
    assert created.returncode == 0, created.stderr
    assert json.loads(run_cli(dsn, "queue", "config", "other", "--json").stdout)["consumer_idle_limit"] == 1800.0
    bad = run_cli(dsn, "queue", "config", "q", "--consumer-idle-limit", "0")
    assert bad.returncode == 1 and bad.stderr.startswith("error: consumer_idle_limit must be positive"), bad.stderr


def test_the_maint_daemon_logs_an_idle_consumer_once_per_idle_episode(dsn, conn, q, caplog):
    _gone(conn, _register_from_a_session(dsn, "q", "c"))           # its daemon stopped
    maint = jobs.Maint()
    caplog.set_level(logging.INFO, logger="replicator")
    _unseen_for_two_hours(conn, "c")
    maint(q)
    maint(q)
    assert [r.getMessage() for r in caplog.records if "idle" in r.getMessage()] == [
        "maint: queue q: consumer c idle: not seen for 2h, not connected; it holds back rotation: start it again,"
        " or if it is retired: replicator queue unregister q c"]
    q.next_batch("q", "c")                                          # seen again ...
    maint(q)
    _unseen_for_two_hours(conn, "c")                                # ... and idle again: said again
    maint(q)
    assert len([r for r in caplog.records if "idle" in r.getMessage()]) == 2


def test_two_temporary_consumers_of_one_host_and_process_have_names_of_their_own_that_fit_application_name():
    """Two containers may both run as pid 1 under the same host name; a killed run's
    consumer must not be taken over by the next run with its pid."""
    from replicator.consumer import Consumer
    from replicator.targets import open_target

    first, second = (Consumer("", "q", open_target("jsonl:-")), Consumer("", "q", open_target("tsv:-")))
    assert first.temporary and second.temporary
    assert first.name.split("_")[:4] == second.name.replace("tsv_", "jsonl_", 1).split("_")[:4]   # host, pid
    assert len({first.name.replace("jsonl_", "", 1), second.name.replace("tsv_", "", 1)}) == 2
    # the longest: scheme jsonl and a pid of 7 digits (pid_max is 2**22 at most)
    longest = len(first.name.encode()) - len(str(os.getpid())) + len(str(2 ** 22))
    assert len(b"replicator consumer ") + longest <= 63


def _register_from_a_session(dsn: str, queue: str, consumer: str, *, temporary: bool = False,
                             application_name: str | None = None) -> psycopg.Connection:
    """A session that registers the consumer as its daemon does, and stays connected."""
    from replicator.source import Source

    session = psycopg.connect(dsn, autocommit=True,
                              application_name=application_name or f"replicator consumer {consumer}")
    Source(session).register_consumer(queue, consumer, temporary=temporary)
    return session


def _gone(conn, session: psycopg.Connection) -> None:
    pid = session.info.backend_pid
    session.close()
    wait_until(lambda: not conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()[0],
               30, "the closed session to end")


def test_a_consumer_name_on_two_queues_is_idle_on_the_one_whose_daemon_is_gone(dsn, conn, q):
    q.create_queue("other")
    running = _register_from_a_session(dsn, "q", "c")
    _gone(conn, _register_from_a_session(dsn, "other", "c"))       # the daemon of queue other, dead
    try:
        conn.execute("UPDATE replicator.consumer SET active_time = now() - interval '2 hours'")
        idle = {(c["queue"], c["consumer"]): c["idle"] for c in status(q)["consumers"]}
        assert idle == {("q", "c"): False, ("other", "c"): True}
    finally:
        running.close()


def test_a_connected_consumer_with_a_long_utf8_name_is_not_idle(dsn, conn, q):
    name = "réplique_" + "é" * 40                                  # 'replicator consumer NAME': over 63 bytes
    running = _register_from_a_session(dsn, "q", name)
    try:
        _unseen_for_two_hours(conn, name)
        assert not _consumers(q)[name]["idle"]
        assert _connected(conn, name)
    finally:
        running.close()


def test_maint_keeps_a_connected_temporary_consumer_and_drops_one_whose_session_is_gone(dsn, conn, q):
    """Its registering session counts, not its name: a session of another pid setting the
    same application_name does not keep it."""
    running = _register_from_a_session(dsn, "q", "jsonl_stdout_1_2_kept", temporary=True)
    _gone(conn, _register_from_a_session(dsn, "q", "jsonl_stdout_1_3_gone", temporary=True))
    impostor = psycopg.connect(dsn, autocommit=True, application_name="replicator consumer jsonl_stdout_1_3_gone")
    try:
        conn.execute("UPDATE replicator.consumer SET active_time = now() - interval '2 hours'")
        maint = run_cli(dsn, "maint", "--once")
        assert maint.returncode == 0, maint.stderr
        assert "temporary consumer jsonl_stdout_1_3_gone unregistered" in maint.stdout, maint.stdout
        assert list(_consumers(q)) == ["jsonl_stdout_1_2_kept"]
    finally:
        running.close()
        impostor.close()


def test_registering_a_temporary_consumer_durably_makes_it_durable_and_a_durable_one_is_never_made_temporary(
        dsn, conn, q):
    q.register_consumer("q", "jsonl_stdout_1_2_copied", temporary=True)
    result = run_cli(dsn, "consume", "q", "--target", "jsonl:-", "--consumer", "jsonl_stdout_1_2_copied",
                     "--until-caught-up")
    assert result.returncode == 0, result.stderr
    assert _consumers(q)["jsonl_stdout_1_2_copied"]["temporary"] is False
    _unseen_for_two_hours(conn, "jsonl_stdout_1_2_copied")
    assert "unregistered" not in run_cli(dsn, "maint", "--once").stdout
    assert list(_consumers(q)) == ["jsonl_stdout_1_2_copied"]

    with pytest.raises(UserError, match='consumer "jsonl_stdout_1_2_copied" of queue "q" is durable: '
                                        'a run for once cannot take it'):
        q.register_consumer("q", "jsonl_stdout_1_2_copied", temporary=True)
    assert _consumers(q)["jsonl_stdout_1_2_copied"]["temporary"] is False


# rotation and the ticker --------------------------------------------------------------------

def test_maint_says_what_blocks_an_overdue_rotation_at_every_pass(dsn, conn, q, caplog):
    q.register_consumer("q", "c")
    _due(conn)
    assert "rotated" in q.maint()["q"]
    conn.execute("INSERT INTO t VALUES (2, 'in the new table')")
    q.tick("q", force=True)                                         # past the switch; c is not
    _due(conn)
    for _ in range(2):
        shown = run_cli(dsn, "maint", "--once")
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.startswith("q: rotation overdue by 23h"), shown.stdout
        assert "blocked by consumer c (at tick " in shown.stdout and "nothing to do" not in shown.stdout
    caplog.set_level(logging.INFO, logger="replicator")
    maint = jobs.Maint()
    maint(q)
    maint(q)
    overdue = [r for r in caplog.records if "rotation overdue" in r.getMessage()]
    assert len(overdue) == 2 and all(r.levelno == logging.WARNING for r in overdue)


def test_a_stopped_ticker_is_the_blocker_and_status_says_no_ticker_runs(dsn, conn, q, tmp_path):
    q.register_consumer("q", "c")
    _due(conn)
    assert "rotated" in q.maint()["q"]
    _due(conn)                                                      # no tick since the switch
    report = json.loads(run_cli(dsn, "status", "--json").stdout)
    (queue,) = report["queues"]
    assert (queue["ticker_running"], report["tickers"]) == (False, [])
    assert queue["last_tick_age"] >= 0
    assert [(b["kind"], b["name"]) for b in queue["rotation_blockers"]] == [("tick", "q")]   # not consumer c
    assert "is `replicator ticker` running?" in queue["rotation_blockers"][0]["detail"]
    text = run_cli(dsn, "status").stdout
    assert "no ticker running: none has left a heartbeat in the last day" in text
    assert "last tick age" in text

    q.set_queue_config("q", ticker_idle_period=timedelta(milliseconds=100))
    ticker = Daemon(dsn, "ticker", "--interval", "0.05", log=tmp_path / "ticker.log")
    try:
        wait_until(lambda: status(q)["queues"][0]["ticker_running"], 30, "the ticker's heartbeat",
                   check=lambda: ticker.alive() or pytest.fail(ticker.log()))
        first = q.tickers()[0]["last_seen"]
        ticked = q.latest_tick("q") or 0
        wait_until(lambda: (q.latest_tick("q") or 0) >= ticked + 3, 30, "three passes that ticked")
        assert q.tickers()[0]["last_seen"] == first                  # the heartbeat is not written at every pass
        assert "no ticker running" not in run_cli(dsn, "status").stdout
        assert [b["kind"] for b in q.rotation_blockers("q")] == ["consumer"]   # ticked past the switch: c lags
        assert ticker.terminate() == 0
    finally:
        ticker.stop()
    assert q.tickers() == []                                        # a ticker that stops says so


def test_after_a_switch_with_a_ticker_running_the_queue_waits_for_its_next_tick_and_the_ticker_is_not_blamed(
        conn, q):
    """On an idle queue, the first tick after a switch comes up to the idle period later."""
    q.register_consumer("q", "c")
    _due(conn)
    assert "rotated" in q.maint()["q"]
    conn.execute("SELECT replicator.ticker_heartbeat('ticker-host', 4242, now(), interval '10 seconds')")
    assert status(q)["queues"][0]["ticker_running"]
    assert q.rotation_blockers("q") == []                         # not due: nothing to say
    _due(conn)
    (blocker,) = q.rotation_blockers("q")
    assert (blocker["kind"], blocker["name"]) == ("tick", "q")
    assert blocker["detail"].startswith("waiting for the next tick after the switch at "), blocker["detail"]
    assert "replicator ticker" not in blocker["detail"]
    assert "rotated" not in q.maint()["q"]                       # still blocked until that tick


def test_a_running_ticker_is_blamed_when_the_last_tick_is_older_than_the_idle_period_and_a_minute(conn, q):
    q.register_consumer("q", "c")
    _due(conn)
    assert "rotated" in q.maint()["q"]
    conn.execute("SELECT replicator.ticker_heartbeat('ticker-host', 4242, now(), interval '10 seconds')")
    conn.execute("UPDATE replicator.tick SET tick_time = now() - interval '2 minutes 1 second'")   # idle period 1min
    (blocker,) = q.rotation_blockers("q")
    assert blocker["kind"] == "tick" and blocker["detail"].endswith("is `replicator ticker` running?"), blocker


# output --------------------------------------------------------------------------------------

def test_piped_text_output_never_cuts_a_name_and_json_keys_are_the_same_everywhere(dsn, q):
    long_name = "sqlite_" + "a_very_long_replica_name_" * 5 + "1a2b3c4d"
    q.register_consumer("q", long_name)
    for args in (["status"], ["queue", "list"], ["table", "list"]):
        shown = run_cli(dsn, *args)                                 # piped, no COLUMNS
        assert shown.returncode == 0, shown.stderr
        assert "…" not in shown.stdout, shown.stdout
    assert long_name in run_cli(dsn, "status").stdout

    (queue,) = json.loads(run_cli(dsn, "queue", "list", "--json").stdout)
    (table,) = json.loads(run_cli(dsn, "table", "list", "--json").stdout)
    report = json.loads(run_cli(dsn, "status", "--json").stdout)
    assert queue["queue"] == table["queue"] == report["queues"][0]["queue"] == report["tables"][0]["queue"] == "q"
    assert (report["consumers"][0]["queue"], report["consumers"][0]["consumer"]) == ("q", long_name)
    assert table["table"] == report["tables"][0]["table"] == "public.t"
    for row in (queue, table, report["queues"][0], report["consumers"][0], report["tables"][0]):
        assert not {"queue_name", "consumer_name", "table_name"} & row.keys()


def test_on_a_terminal_a_cell_too_wide_wraps_whole_never_cut(monkeypatch):
    from io import StringIO

    from rich.console import Console

    from replicator import cli

    screen = StringIO()
    monkeypatch.setattr(cli, "console", Console(file=screen, force_terminal=True, width=60, color_system=None))
    long_name = "sqlite_" + "a_very_long_replica_name_" * 5 + "1a2b3c4d"
    cli._print_rows([{"queue": "q", "consumer": long_name}], "consumers")
    lines = screen.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 60 and "…" not in screen.getvalue()
    cells = "".join(line.split("│")[2].strip() for line in lines if line.count("│") == 3)
    assert long_name in cells
