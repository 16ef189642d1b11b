"""The views' catalog in the replica: ``_replicator_views`` holds each view's definition, how
it is maintained and its state (status, rows, the seq of its latest refresh, a version bumped
by every change of definition or plan, which other connections look for); every refresh is
recorded in ``_replicator_view_refresh``, which keeps the last KEEP_REFRESHES per view and those
the policy auto learns from."""

from __future__ import annotations

import itertools
import json
import sqlite3
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from replicator.errors import UserError
from replicator.structure import ascii_lower
from replicator.targets.sqlite.views.auto import COST_SAMPLES, LATEST_FULL
from replicator.targets.sqlite.views.names import REFRESHES, VIEWS
from replicator.targets.sqlite.views.plan import Plan
from replicator.targets.sqlite.views.sql import quote

KEEP_REFRESHES = 1000          # refresh records kept per view, besides those auto learns from


@dataclass
class Counts:
    """What a refresh did: the keys it recomputed, and the view's rows it deleted, inserted, updated."""
    keys: int = 0
    deleted: int = 0
    inserted: int = 0
    updated: int = 0


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def exists(db: sqlite3.Connection) -> bool:
    return db.execute("SELECT 1 FROM main.sqlite_master WHERE type = 'table' AND name = ?",
                      (VIEWS,)).fetchone() is not None


def ensure(db: sqlite3.Connection) -> None:
    db.execute(f"CREATE TABLE IF NOT EXISTS main.{VIEWS} (name TEXT PRIMARY KEY, sql TEXT NOT NULL,"
               " policy TEXT NOT NULL, maintenance TEXT NOT NULL, reason TEXT, columns TEXT, deps TEXT,"
               " status TEXT NOT NULL DEFAULT 'ok', status_reason TEXT, rows INTEGER NOT NULL DEFAULT 0,"
               " seq INTEGER NOT NULL DEFAULT 0, version INTEGER NOT NULL DEFAULT 1, created_at TEXT,"
               " refreshed_at TEXT)")
    db.execute(f"CREATE TABLE IF NOT EXISTS main.{REFRESHES} (view TEXT, seq INTEGER, at TEXT, kind TEXT,"
               " reason TEXT, keys INTEGER, rows_deleted INTEGER, rows_inserted INTEGER,"
               " rows_updated INTEGER, seconds REAL,"
               " PRIMARY KEY (view, seq))")


def fingerprint(db: sqlite3.Connection) -> str | None:
    """The views and their versions: it changes with any definition or plan (None: no catalog)."""
    if not exists(db):
        return None
    row = db.execute(f"SELECT group_concat(name || ':' || version, ',') FROM "
                     f"(SELECT name, version FROM main.{VIEWS} ORDER BY name)").fetchone()
    return str(row[0] or "")


def stored_deps(db: sqlite3.Connection) -> dict[str, set[str]]:
    """The tables each view reads, as last planned."""
    if not exists(db):
        return {}
    return {name: set(json.loads(deps or "[]"))
            for name, deps in db.execute(f"SELECT name, deps FROM main.{VIEWS}")}


def definitions(db: sqlite3.Connection) -> list[tuple[str, str, str, str, str | None]]:
    """(name, sql, policy, status, columns as planned) of every view, by name."""
    return db.execute(f"SELECT name, sql, policy, status, columns FROM main.{VIEWS} ORDER BY name").fetchall()


def definition(db: sqlite3.Connection, name: str) -> tuple[str, str, str | None, str] | None:
    """(sql, policy, columns as planned, status) of a view."""
    row: tuple[str, str, str | None, str] | None = db.execute(
        f"SELECT sql, policy, columns, status FROM main.{VIEWS} WHERE name = ?", (name,)).fetchone()
    return row


def find(db: sqlite3.Connection, name: str) -> tuple[str, str, str, str]:
    """(name as defined, sql, policy, status) of a view named so, in any case."""
    row: tuple[str, str, str, str] | None = db.execute(
        f"SELECT name, sql, policy, status FROM main.{VIEWS} WHERE name = ? COLLATE NOCASE",
        (name,)).fetchone() if exists(db) else None
    if row is None:
        raise UserError(f"no view {name!r} in this target (see `replicator view list`)")
    return row


def has(db: sqlite3.Connection, name: str) -> bool:
    """Whether a view is named so, in any case."""
    return db.execute(f"SELECT 1 FROM main.{VIEWS} WHERE name = ? COLLATE NOCASE", (name,)).fetchone() is not None


def add(db: sqlite3.Connection, plan: Plan) -> None:
    db.execute(f"INSERT INTO main.{VIEWS} (name, sql, policy, maintenance, created_at) VALUES (?, ?, ?, ?, ?)",
               (plan.name, plan.sql, plan.policy, plan.mode, now()))


def set_plan(db: sqlite3.Connection, plan: Plan) -> None:
    """Records how a view is maintained now, and that it is ok."""
    db.execute(f"UPDATE main.{VIEWS} SET maintenance = ?, reason = ?, columns = ?, deps = ?, status = 'ok',"
               " status_reason = NULL, version = version + 1 WHERE name = ?",
               (plan.mode, json.dumps(plan.reason.as_dict()) if plan.reason else None,
                json.dumps([list(c) for c in plan.columns]), json.dumps(sorted(plan.deps)), plan.name))


@contextmanager
def following_renames(db: sqlite3.Connection, renamed: Mapping[str, str]) -> Iterator[None]:
    """Around the renaming of base tables (old name -> new) in a transaction: the views' stored
    queries then name the tables by their new names. SQLite rewrites them, as exactly as it
    reads them: each query that runs now is a TEMP view while the tables are renamed, which
    ALTER TABLE ... RENAME edits as it edits the schema's views (the table's name where the
    query reads the table; a CTE, an alias, a string or a comment of that name stay). A query
    that does not run now (a table it reads was dropped) is left as it is: it fails as before."""
    helpers: dict[str, tuple[str, str]] = {}   # view -> (its TEMP view, the text SQLite stores of it)
    taken = {ascii_lower(n) for (n,) in db.execute("SELECT name FROM main.sqlite_master")}
    free = (n for n in (f"_replicator_renaming_view_{i}" for i in itertools.count()) if n not in taken)
    for name, sql in db.execute(f"SELECT name, sql FROM main.{VIEWS}").fetchall() if exists(db) else []:
        helper = next(free)   # no table's name: the query would read the view in its place
        try:
            db.execute(f"CREATE TEMP VIEW {quote(helper)} AS {sql}")
            db.execute(f"SELECT * FROM temp.{quote(helper)} LIMIT 0")
        except sqlite3.Error:
            db.execute(f"DROP VIEW IF EXISTS temp.{quote(helper)}")
            continue
        helpers[name] = (helper, f"CREATE VIEW {quote(helper)} AS ")
    yield
    lowered = {old.lower(): new.lower() for old, new in renamed.items()}   # as deps keeps them
    for name, (helper, head) in helpers.items():
        (stored,) = db.execute("SELECT sql FROM temp.sqlite_master WHERE name = ?", (helper,)).fetchone()
        db.execute(f"DROP VIEW temp.{quote(helper)}")
        if not stored.startswith(head):   # not as SQLite has stored its views so far: left as it was
            continue
        db.execute(f"UPDATE main.{VIEWS} SET sql = ?, version = version + 1 WHERE name = ? AND sql != ?",
                   (stored[len(head):], name, stored[len(head):]))
        for (deps,) in db.execute(f"SELECT deps FROM main.{VIEWS} WHERE name = ? AND deps IS NOT NULL",
                                  (name,)).fetchall():
            db.execute(f"UPDATE main.{VIEWS} SET deps = ? WHERE name = ?",
                       (json.dumps(sorted(lowered.get(d, d) for d in json.loads(deps))), name))


def remove(db: sqlite3.Connection, name: str) -> None:
    db.execute(f"DELETE FROM main.{VIEWS} WHERE name = ?", (name,))
    db.execute(f"DELETE FROM main.{REFRESHES} WHERE view = ?", (name,))


def row_count(db: sqlite3.Connection, name: str) -> int:
    """The view's rows, as its latest refresh left them."""
    count: int = db.execute(f"SELECT rows FROM main.{VIEWS} WHERE name = ?", (name,)).fetchone()[0]
    return count


def rows_and_seq(db: sqlite3.Connection, name: str) -> tuple[int, int]:
    """The view's rows and the seq of its latest refresh."""
    count, seq = db.execute(f"SELECT rows, seq FROM main.{VIEWS} WHERE name = ?", (name,)).fetchone()
    return count, seq


def record(db: sqlite3.Connection, view: str, kind: str, reason: str, counts: Counts, seconds: float,
           rows: int) -> None:
    """Records a refresh (its kind: full, incremental, none) and the view's rows after it."""
    at = now()
    seq = db.execute(f"UPDATE main.{VIEWS} SET rows = ?, seq = seq + 1, refreshed_at = ?"
                     f" WHERE name = ? RETURNING seq", (rows, at, view)).fetchone()[0]
    db.execute(f"INSERT INTO main.{REFRESHES} VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
               (view, seq, at, kind, reason, counts.keys if kind != "full" or counts.keys else None,
                counts.deleted, counts.inserted, counts.updated, round(seconds, 6)))
    if seq > KEEP_REFRESHES:
        db.execute(f"DELETE FROM main.{REFRESHES} WHERE view = :view AND seq <= :old"
                   f" AND seq NOT IN (SELECT seq FROM ({LATEST_FULL}))"
                   f" AND seq NOT IN (SELECT seq FROM ({COST_SAMPLES}))",
                   {"view": view, "old": seq - KEEP_REFRESHES})


def mark_stale(db: sqlite3.Connection, view: str, why: str) -> None:
    """Records that a view is no longer refreshed, and why (`CODE: detail`)."""
    db.execute(f"UPDATE main.{VIEWS} SET status = 'stale', status_reason = ?, version = version + 1"
               " WHERE name = ?", (why, view))
    record(db, view, "none", why.split(":")[0], Counts(), 0.0, row_count(db, view))


def views(db: sqlite3.Connection) -> list[dict[str, Any]]:
    """Every view with its state and latest refresh, by name (`replicator view list`)."""
    if not exists(db):
        return []
    out = []
    for row in db.execute(
            f"SELECT v.name, v.policy, v.maintenance, v.reason, v.status, v.status_reason, v.rows, v.sql,"
            f" r.at, r.kind, r.reason, r.keys, r.rows_deleted, r.rows_inserted, r.rows_updated, r.seconds"
            f" FROM main.{VIEWS} v LEFT JOIN main.{REFRESHES} r ON r.view = v.name AND r.seq = v.seq"
            f" ORDER BY v.name"):
        (name, policy, mode, reason, status, status_reason, count, sql, at, kind, last_reason, keys,
         deleted, inserted, updated, seconds) = row
        reason_d = json.loads(reason) if reason else None
        out.append({"view": name, "policy": policy, "maintenance": mode, "status": status,
                    "status_reason": status_reason, "rows": count,
                    "reason": reason_d["code"] if reason_d else None,
                    "reason_message": reason_d["message"] if reason_d else None,
                    "fragment": reason_d["fragment"] if reason_d else None,
                    "last_refresh": {"at": at, "kind": kind, "reason": last_reason, "keys": keys,
                                     "rows_deleted": deleted, "rows_inserted": inserted,
                                     "rows_updated": updated, "seconds": seconds} if at else None,
                    "sql": sql})
    return out


def refreshes(db: sqlite3.Connection, name: str, limit: int) -> list[dict[str, Any]]:
    """A view's latest refreshes, newest first."""
    cur = db.execute(f"SELECT seq, at, kind, reason, keys, rows_deleted, rows_inserted, rows_updated,"
                     f" seconds FROM main.{REFRESHES} WHERE view = ? ORDER BY seq DESC LIMIT ?", (name, limit))
    columns = [d[0] for d in cur.description]
    return [dict(zip(columns, r)) for r in cur]
