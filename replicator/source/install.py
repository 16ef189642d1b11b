"""Installing, upgrading and removing schema "replicator" in the source database.

``install`` applies the numbered scripts of ``migrations/`` that
``replicator.schema_version`` does not list, then re-applies every file of
``queue_sql/`` (all ``CREATE OR REPLACE``), in one transaction.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib.resources import files
from importlib.resources.abc import Traversable

import psycopg
from psycopg import sql

from replicator.errors import UserError
from replicator.source import db
from replicator.wording import counted

# In the repository, the top-level folders migrations/ and queue_sql/; in a wheel, inside the package.
MIGRATIONS_DIR: Traversable = files("replicator.migrations")
QUEUE_SQL_DIR: Traversable = files("replicator.queue_sql")
_INSTALL_LOCK = 2026112200
MIN_SERVER_VERSION = 120000   # PostgreSQL 12: what is older is refused (docs/architecture.md, "PostgreSQL versions")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    path: Traversable


def queue_sql_files() -> list[Traversable]:
    """The files of queue_sql/ in the order its install.sql runs them (`\\ir FILE` lines)."""
    listed = [line.split(None, 1)[1].strip() for line in (QUEUE_SQL_DIR / "install.sql").read_text().splitlines()
              if line.startswith("\\ir ")]
    present = {f.name for f in QUEUE_SQL_DIR.iterdir() if f.name.endswith(".sql")} - {"install.sql"}
    if sorted(listed) != sorted(present):
        raise RuntimeError(f"queue_sql/install.sql must list each file of queue_sql/ once: it lists {listed},"
                           f" the folder holds {sorted(present)}")
    return [QUEUE_SQL_DIR / name for name in listed]


def migrations() -> list[Migration]:
    found = []
    for path in sorted((f for f in MIGRATIONS_DIR.iterdir() if f.name.endswith(".sql")), key=lambda f: f.name):
        match = re.fullmatch(r"(\d{4})_(\w+)\.sql", path.name)
        if not match:
            raise RuntimeError(f"migration file name must look like 0001_name.sql: {path.name}")
        found.append(Migration(int(match.group(1)), match.group(2), path))
    return found


def installed_versions(conn: psycopg.Connection) -> list[int]:
    """Versions recorded in replicator.schema_version; [] when not installed."""
    exists = db.scalar(conn, "SELECT to_regclass('replicator.schema_version') IS NOT NULL")
    if not exists:
        return []
    return [row[0] for row in conn.execute("SELECT version FROM replicator.schema_version ORDER BY version")]


def require_installed(conn: psycopg.Connection) -> None:
    """Refuses a database without schema replicator, or with an older version of it
    than this replicator's (its functions would be missing or differ)."""
    installed = installed_versions(conn)
    if not installed:
        raise UserError("replicator is not installed in this database: run `replicator install`")
    needed = migrations()[-1]
    if installed[-1] < needed.version:
        raise UserError(f"this database has an older version of replicator's schema (version {installed[-1]}) than "
                        f"this replicator needs (version {needed.version}, {needed.name}): run `replicator install` "
                        f"to upgrade it")


@dataclass(frozen=True)
class InstallResult:
    applied: list[Migration]
    event_triggers: bool   # DDL is captured as it runs; else it is noticed afterwards (capture_drift.sql)


def install(conn: psycopg.Connection, *, up_to: int | None = None) -> InstallResult:
    """Creates or upgrades schema replicator. Idempotent.

    ``up_to`` stops at a migration version (used to fabricate old schemas in tests).
    Event triggers are created where the role may (superuser); elsewhere
    install carries on without them.
    """
    if conn.info.server_version < MIN_SERVER_VERSION:
        raise UserError(f"replicator needs PostgreSQL 12 or later, and this server is PostgreSQL "
                        f"{conn.info.parameter_status('server_version')}: nothing was installed")
    applied: list[Migration] = []
    event_triggers = False
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_INSTALL_LOCK,))
        conn.execute("SET LOCAL check_function_bodies = off")
        conn.execute("SET LOCAL client_min_messages = warning")
        # replicator's own DDL: its event triggers, which would run while the functions
        # they call are dropped and created again, let it pass (as they do their own)
        conn.execute("SELECT set_config('replicator.in_ddl', 'on', true)")
        conn.execute("CREATE SCHEMA IF NOT EXISTS replicator")
        conn.execute("REVOKE ALL ON SCHEMA replicator FROM PUBLIC")
        done = set(installed_versions(conn))
        for migration in migrations():
            if migration.version in done or (up_to is not None and migration.version > up_to):
                continue
            conn.execute(migration.path.read_text())
            conn.execute("INSERT INTO replicator.schema_version (version, name) VALUES (%s, %s)",
                         (migration.version, migration.name))
            applied.append(migration)
        if up_to is None:
            _drop_library_functions(conn)
            for path in queue_sql_files():
                conn.execute(path.read_text())
            _refuse_invalid_capture_trees(conn)
            # first: a capture function checks its table's catalog rows at every
            # statement only where no event trigger captures DDL
            event_triggers = _create_event_triggers(conn)
            _regenerate_captures(conn)
            _restrict_functions(conn)
    return InstallResult(applied, event_triggers)


def _create_event_triggers(conn: psycopg.Connection) -> bool:
    try:
        with conn.transaction():
            conn.execute("SELECT replicator.create_event_triggers()")
        return True
    except psycopg.errors.InsufficientPrivilege:
        return False


EVENT_TRIGGERS = ("replicator_ddl_command_end", "replicator_sql_drop", "replicator_table_rewrite")


def has_event_triggers(conn: psycopg.Connection) -> bool:
    """Whether DDL is captured automatically: every event trigger is there and
    enabled (without the table_rewrite one, a rewrite would go unnoticed)."""
    return bool(db.scalar(conn, "SELECT count(*) = %s FROM pg_event_trigger WHERE evtname = ANY (%s)"
                          " AND evtenabled <> 'D'", (len(EVENT_TRIGGERS), list(EVENT_TRIGGERS))))


def _drop_library_functions(conn: psycopg.Connection) -> None:
    """Drops the functions of queue_sql/ before they are created again: CREATE OR
    REPLACE cannot change a function's result type or arguments, and a function
    a newer version no longer has must not linger. Generated capture functions
    stay (the triggers use them); the event triggers go and are created again.
    Without CASCADE: an object of the user's built on a function (a monitoring
    view over queue_info(), say) stops the install with PostgreSQL's message
    naming it, instead of vanishing."""
    drop_event_triggers(conn)
    conn.execute("""
        DO $$
        DECLARE
            f regprocedure;
        BEGIN
            FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
                     WHERE p.pronamespace = 'replicator'::regnamespace AND p.proname !~ '^capture_[0-9]+$'
            LOOP
                EXECUTE format('DROP FUNCTION %s', f);
            END LOOP;
        END $$""")


def drop_event_triggers(conn: psycopg.Connection) -> None:
    for (name,) in conn.execute(
            "SELECT evtname FROM pg_event_trigger WHERE evtname LIKE 'replicator\\_%'").fetchall():
        conn.execute(sql.SQL("DROP EVENT TRIGGER {}").format(sql.Identifier(name)))


def _restrict_functions(conn: psycopg.Connection) -> None:
    """Revokes EXECUTE on every function of schema replicator from PUBLIC, and from
    every role but the owner any write on its tables and sequences; then
    grants the consumer functions again to the roles `replicator grant` gave USAGE
    on the schema (PUBLIC has none): the functions were just created anew, without
    their grants. Functions created later are generated capture functions, which
    revoke it themselves: `ALTER DEFAULT PRIVILEGES IN SCHEMA` cannot take back
    PUBLIC's EXECUTE (a per-schema default only adds to the global one), and the
    global form would change every function the installing role creates in the
    database."""
    conn.execute("REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA replicator FROM PUBLIC")
    conn.execute("""
        SELECT replicator.grant_consumer_functions(r.rolname)
        FROM pg_namespace n CROSS JOIN LATERAL aclexplode(n.nspacl) a JOIN pg_roles r ON r.oid = a.grantee
        WHERE n.nspname = 'replicator' AND a.privilege_type = 'USAGE' AND a.grantee <> n.nspowner""")
    # Write privileges earlier versions granted consumers (INSERT, UPDATE, DELETE on consumer
    # and tick; sequences), or anyone gave by hand: with them a role could move another's
    # consumer or forge a tick past the functions' checks. Reads stay (`replicator grant`).
    conn.execute("""
        DO $$
        DECLARE
            r record;
        BEGIN
            FOR r IN SELECT DISTINCT c.oid::regclass AS rel, c.relkind, g.rolname
                     FROM pg_class c CROSS JOIN LATERAL aclexplode(c.relacl) a
                     JOIN pg_roles g ON g.oid = a.grantee
                     WHERE c.relnamespace = 'replicator'::regnamespace AND a.grantee <> c.relowner
                       AND a.privilege_type IN ('INSERT', 'UPDATE', 'DELETE', 'TRUNCATE', 'REFERENCES',
                                                'TRIGGER', 'USAGE')
            LOOP
                EXECUTE format(CASE WHEN r.relkind = 'S' THEN 'REVOKE USAGE, UPDATE ON SEQUENCE %s FROM %I'
                                    ELSE 'REVOKE INSERT, UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER'
                                         ' ON %s FROM %I' END, r.rel, r.rolname);
            END LOOP;
        END $$""")


def _refuse_invalid_capture_trees(conn: psycopg.Connection) -> None:
    """Stops the install, rolled back whole, when a captured table's capture tree is
    one this version refuses: a partition or an inheritance child captured on its own,
    or a tree holding one (older versions accepted them). Carrying on would leave
    every DDL touching such a tree failing, at a time nobody chose; stopping here,
    the version installed before keeps running, and its `replicator table remove`
    is the way out the message names."""
    problems = [problem for (problem,) in conn.execute(
        "SELECT problem FROM replicator.capture_tree_problems() ORDER BY table_id")]
    if problems:
        raise UserError(f"install stopped, nothing was changed: this version captures a partition or an "
                        f"inheritance child only with its root, and {counted(len(problems), 'captured table')} "
                        f"{'is' if len(problems) == 1 else 'are'} not captured so: {'; '.join(problems)}; then run "
                        f"`replicator install` again")


def _regenerate_captures(conn: psycopg.Connection) -> None:
    """Regenerates every capture function, so an upgrade reaches existing tables.
    A table whose capture did not cover all its descendants (an inheritance parent
    captured by an older version: rows written naming a child were missed) queues
    an S event with "copy": true once the new capture covers them: targets copy
    the table again, as after a descendant was attached."""
    missing = db.scalar(conn, "SELECT replicator.trees_missing_triggers()")
    conn.execute("""
        SELECT replicator.generate_capture(table_id) FROM replicator.captured_table
        WHERE to_regclass(quote_ident(table_schema) || '.' || quote_ident(table_name)) IS NOT NULL
        ORDER BY table_id""")
    conn.execute("""
        UPDATE replicator.captured_table
        SET table_structure = replicator.table_structure(table_oid, table_key)
        WHERE table_structure IS NULL AND table_oid IS NOT NULL""")
    for table_id in missing:
        conn.execute("SELECT replicator.queue_copy_event(%s, 'REPLICATOR INSTALL', NULL)", (table_id,))


def uninstall(conn: psycopg.Connection) -> None:
    """Removes schema replicator with every capture trigger and event trigger.
    Application tables and their data are not touched."""
    with conn.transaction():
        if installed_versions(conn):
            conn.execute("SELECT replicator.drop_capture(table_id) FROM replicator.captured_table")
        drop_event_triggers(conn)
        conn.execute("DROP SCHEMA IF EXISTS replicator CASCADE")
