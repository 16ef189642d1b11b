"""SQLite target: the embedded default.

The replica is a SQLite file in WAL mode, so readers are never blocked and
never see part of a batch. The consumer position and the list of replicated
tables live in two tables of the same file, written in the same transaction
as the rows: a crash at any point leaves the file at a batch boundary.
"""

from __future__ import annotations

import itertools
import os
import sqlite3
from collections.abc import Callable, Iterable
from contextlib import closing, suppress
from pathlib import Path
from typing import Any, NoReturn

from replicator.errors import UserError
from replicator.structure import Change, Column, RowsDecoder, TableStructure, ascii_lower, target_table_name
from replicator.targets.files import file_changed, special_file
from replicator.targets.protocol import OldRows, Row, TargetTable
from replicator.targets.sqlite.types import FORMS, LEGACY_FORMS, NUMERIC_MODES, adapter, sqlite_type, value_adapters
from replicator.targets.sqlite.views.catalog import following_renames as views_following_renames
from replicator.targets.sqlite.views.names import REFRESHES, STORAGE_PREFIX, VIEWS
from replicator.targets.sqlite.views.sqlite_views import SqliteViews

# WAL: readers are never blocked and see whole batches. FULL: a commit is on
# disk before the source is told the batch is finished; with NORMAL a power
# loss could take back batches whose ticks and events the source has since
# cleaned up (an fsync of the WAL per batch: about 0.3 ms here). A page cache
# of 64 MiB instead of SQLite's 2 MiB: random key updates of a table of more
# than a few MB otherwise go to the OS per page.
PRAGMAS = ("journal_mode = WAL", "synchronous = FULL", "cache_size = -65536")
_STATE = "_replicator_position"
_TABLES = "_replicator_tables"
# The replica's settings: how numeric values are stored ("numeric": number or text), chosen
# when it is made, kept for its life.
_SETTINGS = "_replicator_settings"
# The forms of each table's values (types.FORMS); a table without a row was made before
# they were recorded and keeps the forms of then (types.LEGACY_FORMS) until copied again.
_FORMS = "_replicator_value_forms"
_NUMERIC_OPTION = "?numeric="


# What makes a SQLite file a replica: replicator's own tables (both are created in
# the file's first transaction; a file of an older version may hold only the first).
# Any other SQLite file is an application's: opened as a target, its tables of the
# captured names would be dropped and replaced, so it is refused, and the check
# neither writes it nor leaves a -wal or -shm beside it.
_MARKERS = (_STATE, _TABLES)
_HEADER = b"SQLite format 3\x00"
_SIDE_FILES = ("-wal", "-shm")
# PRAGMA application_id of a replica ("RPLC"), at offset 68 of the file's header: read
# before each batch, it tells the replica from another file copied over it in place.
APPLICATION_ID = 0x52504C43


def _size(path: str | Path) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def _application_id(header: bytes) -> int:
    return int.from_bytes(header[68:72], "big")


def _main_file_tables(path: Path) -> set[str]:
    """replicator's tables found in the main file alone. Opened read-only and immutable,
    SQLite reads that one file and opens nothing beside it: any other way of reading a
    WAL-mode database maps its -shm, which writes it (or creates it, and a -wal). A
    replica's tables are created before it turns to WAL mode, so they are in the main file.
    Read again after an error: a page being checkpointed into the file by a running
    consumer may be read half written."""
    uri = f"{path.resolve().as_uri()}?mode=ro&immutable=1"
    attempts = 3
    while True:
        try:
            with closing(sqlite3.connect(uri, uri=True)) as db:
                return {name for (name,) in db.execute(
                    f"SELECT name FROM sqlite_master WHERE name IN ({', '.join('?' for _ in _MARKERS)})", _MARKERS)}
        except sqlite3.DatabaseError as exc:
            attempts -= 1
            if not attempts or getattr(exc, "sqlite_errorname", "") == "SQLITE_NOTADB":
                raise


def replica_state(path: Path) -> str:
    """What is at `path`, found without writing anything there: "new" (no file, or an
    empty one: nothing to lose), "replica", "foreign" (another SQLite database), "foreign
    id" (replicator's tables under another application's id), "foreign wal" (no
    replicator table in the main file, and a -wal, which cannot be read without writing
    the -shm), "not sqlite", "not a file" (the path, its -wal or its -shm) or "orphan wal"
    (no file, or an empty one, but a -wal: SQLite would replay it into a new one). Raises
    UserError when it cannot be read."""
    path = path.expanduser()
    if any(special_file(f"{path}{suffix}") for suffix in ("", *_SIDE_FILES)):
        return "not a file"
    try:
        wal = _size(f"{path}-wal")
        try:
            st = path.stat()
        except FileNotFoundError:
            return "orphan wal" if wal else "new"
        if st.st_size == 0:
            return "orphan wal" if wal else "new"
        with open(path, "rb") as f:
            header = f.read(100)
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}") from None
    if not header.startswith(_HEADER):
        return "not sqlite"
    if _application_id(header) == APPLICATION_ID:
        # A replica's id is in its header from its first commit. Its tables are not read
        # then: without its WAL, the main file of a live replica may hold pages of several
        # commits (a checkpoint that readers held back) and read as malformed.
        return "replica"
    try:
        names = _main_file_tables(path)
    except sqlite3.DatabaseError as exc:
        if getattr(exc, "sqlite_errorname", "") == "SQLITE_NOTADB":
            return "not sqlite"
        if wal:
            return "foreign wal"     # unreadable without its -wal, which cannot be read without writing
        raise UserError(f"cannot read {path} as a SQLite database ({exc}): give the replica another path, or "
                        f"repair it with sqlite3") from None
    if not names:
        return "foreign wal" if wal else "foreign"
    return "replica" if _application_id(header) in (0, APPLICATION_ID) else "foreign id"


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


# What SQLite's terse I/O errors mean for a replica's files (sqlite3.Error.sqlite_errorname).
_ERROR_HINTS = {
    "SQLITE_IOERR_SHMSIZE": "its -shm file cannot grow: is the filesystem full?",
    "SQLITE_IOERR_SHMMAP": "its -shm file cannot be mapped into memory: SQLite's WAL mode needs a local filesystem",
    "SQLITE_IOERR_SHMOPEN": "its -shm file cannot be opened: is it writable, and the directory?",
    "SQLITE_IOERR_SHMLOCK": "its -shm file cannot be locked: SQLite's WAL mode needs a local filesystem",
    "SQLITE_READONLY_CANTINIT": "its -shm file is not writable",
    "SQLITE_READONLY_DIRECTORY": "its directory is not writable (SQLite creates the -wal and -shm files there)",
    "SQLITE_FULL": "the filesystem is full",
}


def sqlite_error(exc: sqlite3.Error) -> str:
    """A SQLite error with what its code says about the replica's files, where that helps."""
    name = getattr(exc, "sqlite_errorname", None)
    hint = _ERROR_HINTS.get(name or "")
    return f"{exc} ({name}: {hint})" if hint else str(exc)


def _regrow(shm: str, size: int) -> None:
    """Gives a -shm cut short its size back, zero-filled: closing the connection (which
    reads it to checkpoint) then rebuilds its content from the WAL instead of dying of
    SIGBUS. Allocated, not sparse, where the filesystem allows: a page that cannot be
    allocated when written is a SIGBUS too."""
    try:
        fd = os.open(shm, os.O_RDWR)
    except OSError:
        return
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError:
            os.ftruncate(fd, max(size, os.fstat(fd).st_size))
    except OSError:
        pass
    finally:
        os.close(fd)


def _no_checkpoint_on_close(db: sqlite3.Connection) -> bool:
    """Keeps SQLite from copying the WAL into the database file when `db` closes
    (SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE), for a file that is no longer the replica. Python
    3.12 has Connection.setconfig; before it, the call goes through ctypes with the
    connection's handle (CPython's sqlite3 Connection holds it first after the object
    header). False where neither can be done."""
    if hasattr(db, "setconfig"):
        db.setconfig(sqlite3.SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, True)   # type: ignore[attr-defined]
        return True
    try:
        import _sqlite3
        import ctypes
        config = ctypes.CDLL(_sqlite3.__file__).sqlite3_db_config
    except (ImportError, OSError, AttributeError):
        return False
    handle = ctypes.c_void_p.from_address(id(db) + object.__basicsize__)
    done = ctypes.c_int(0)
    no_ckpt_on_close = 1006   # SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE
    return config(handle, ctypes.c_int(no_ckpt_on_close), ctypes.c_int(1), ctypes.byref(done)) == 0 and done.value == 1


def is_replica(path: Path) -> bool:
    """Whether a SQLite file is one a consumer writes, read without changing it
    (opening it as a target would make any SQLite file one)."""
    return replica_state(path) == "replica"


def check_target_path(path: Path) -> None:
    """Refuses a path holding something other than a replica: an application's SQLite
    database, a file of another kind, a directory. Nothing there is changed."""
    state = replica_state(path)
    if state in ("new", "replica"):
        return
    if state == "orphan wal":
        raise UserError(f"{path}-wal is there without a database in {path} (left by a replica deleted under a "
                        f"consumer that was then killed?): SQLite would replay it into a new replica; move "
                        f"{path}-wal and {path}-shm aside, or give the replica another path")
    if state == "not a file":
        name, kind = next((f"{path}{suffix}", kind) for suffix in ("", *_SIDE_FILES)
                          if (kind := special_file(f"{path}{suffix}")))
        raise UserError(f"cannot use {path} as a SQLite target: {'it' if name == str(path) else name} is {kind}, "
                        f"not a regular file (a replica is a SQLite file, its -wal and -shm beside it); give the "
                        f"replica the path of a regular file, or of none (it is created)")
    if state == "foreign wal":
        raise UserError(f"{path} is a SQLite database without table {_TABLES} in its main file, and its -wal holds "
                        f"changes not yet in it, which cannot be read without writing its -shm: it is left as it is; "
                        f"give the replica another path (if it is a replica made by an older replicator, checkpoint "
                        f"it first: `sqlite3 {path} 'PRAGMA wal_checkpoint'`)")
    what = {
        "foreign": f"a SQLite database that is not a replica (it has no table {_TABLES}): a consumer would drop "
                   f"and replace its tables of the replicated names",
        "foreign id": f"a SQLite database that is not a replica (it has replicator's tables, but the application "
                      f"id in its header is not replicator's, {APPLICATION_ID:#010x})",
        "not sqlite": "a file that is not a SQLite database: a consumer would overwrite it",
    }[state]
    raise UserError(f"{path} is {what}, so it is left as it is; give the replica another path")


def parse_url(rest: str) -> tuple[str, str | None]:
    """The path and the numeric option of a `sqlite:` target URL without its scheme:
    PATH, or PATH?numeric=number|text (a `?` elsewhere is part of the path)."""
    path, option, numeric = rest.rpartition(_NUMERIC_OPTION)
    if not option or "/" in numeric:
        return rest, None
    if numeric not in NUMERIC_MODES:
        raise UserError(f"invalid target option numeric={numeric!r}: use sqlite:PATH?numeric=number (numbers, "
                        f"the default) or sqlite:PATH?numeric=text (PostgreSQL's exact digits)")
    return path, numeric


def quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _name_before_escaping(source: TableStructure) -> str:
    """A source table's name in replicas of versions before structure.target_table_name escaped any."""
    return source.name if source.schema == "public" else f"{source.schema}__{source.name}"


class SqliteTarget:
    exactly_once = True
    copies_renamed_tables = False
    copies_over_rows = False

    def __init__(self, path: Path, *, numeric: str | None = None) -> None:
        """numeric: how numeric values are stored (types.NUMERIC_MODES) in a new replica;
        an existing one keeps its own, and one given that differs is refused."""
        self.path = path.expanduser().resolve()
        self.name = f"sqlite:{self.path}"
        if not self.path.parent.is_dir():
            raise UserError(f"cannot create {self.path}: directory {self.path.parent} does not exist")
        check_target_path(self.path)
        try:
            self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            # Both tables and the application id in one transaction, before WAL mode
            # (switching to it writes a first page): a new file is never left a SQLite
            # database without them, and they are in the main file (see replica_state).
            self.db.execute("BEGIN")
            self.db.execute(f"CREATE TABLE IF NOT EXISTS {_STATE} (queue TEXT, consumer TEXT, last_tick INTEGER,"
                            " PRIMARY KEY (queue, consumer))")
            self.db.execute(f"CREATE TABLE IF NOT EXISTS {_TABLES} (source_name TEXT PRIMARY KEY,"
                            " table_id INTEGER, mode TEXT, structure TEXT, copy_snapshot TEXT)")
            self.db.execute(f"CREATE TABLE IF NOT EXISTS {_SETTINGS} (name TEXT PRIMARY KEY, value TEXT NOT NULL)")
            self.db.execute(f"CREATE TABLE IF NOT EXISTS {_FORMS} (table_name TEXT PRIMARY KEY COLLATE NOCASE,"
                            " forms INTEGER NOT NULL)")
            self.numeric = self._numeric_mode(numeric)
            self._escape_reserved_names()
            # 0: a new file, or a replica made before replicator marked them (adopted).
            unmarked = self.db.execute("PRAGMA application_id").fetchone()[0] == 0
            if unmarked:
                self.db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            self.db.execute("COMMIT")
            for pragma in PRAGMAS:
                self.db.execute(f"PRAGMA {pragma}")
            if unmarked:
                self.db.execute("PRAGMA wal_checkpoint(PASSIVE)")   # the id into the main file, if no reader holds it
            self.views = SqliteViews(self.db)   # incremental views, refreshed in commit()
            self.db.execute(f"SELECT count(*) FROM {_STATE}").fetchone()   # opens the -wal and -shm
            # The files this connection writes: one deleted, replaced or overwritten under it
            # is noticed before the next batch (see _check_files). The main file is held open
            # to read its header; closed only after SQLite's connection (closing a descriptor
            # of a file drops every POSIX lock this process holds on it, SQLite's too).
            self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except sqlite3.Error as exc:
            raise UserError(f"cannot use {self.path} as a SQLite target: {sqlite_error(exc)}") from None
        except OSError as exc:
            raise UserError(f"cannot use {self.path} as a SQLite target: {exc.strerror}") from None
        self._statements: dict[tuple[str, str], str] = {}
        self._adapters: dict[str, tuple[RowsDecoder | None, RowsDecoder | None]] = {}
        self._files = {suffix: _identity(f"{self.path}{suffix}") for suffix in _SIDE_FILES}
        self._shm_size = _size(f"{self.path}-shm")
        # Application ids the main file's header may show: 0 too while an adopted
        # replica's id is still only in the WAL.
        self._ids = {APPLICATION_ID}
        if _application_id(os.pread(self._fd, 100, 0)) != APPLICATION_ID:
            self._ids.add(0)
        self._stopped: str | None = None   # why, once the file is no longer the replica

    def _numeric_mode(self, numeric: str | None) -> str:
        """The replica's numeric mode: recorded when it is first opened by this version
        (`numeric`, else number); another one asked for is refused (in the transaction
        that would have recorded it: nothing is written)."""
        recorded = self.db.execute(f"SELECT value FROM {_SETTINGS} WHERE name = 'numeric'").fetchone()
        if recorded is None:
            chosen = numeric or "number"
            self.db.execute(f"INSERT INTO {_SETTINGS} VALUES ('numeric', ?)", (chosen,))
            return chosen
        if numeric is not None and numeric != recorded[0]:
            self.db.execute("ROLLBACK")
            self.db.close()
            raise UserError(f"{self.path} was made with numeric={recorded[0]}, which a replica keeps: to have "
                            f"numeric={numeric}, copy every table anew into a new replica (another path, or move this "
                            f"one aside, with ?numeric={numeric}); or leave the option out to go on with this one")
        mode: str = recorded[0]
        return mode

    def _escape_reserved_names(self) -> None:
        """Gives the tables a version before escaping made under reserved names (a source
        table public._replicator_x was table _replicator_x) their escaped names
        (structure.target_table_name), once: then `table_names` = escaped is recorded in the
        settings (a new replica has it from the start). A source table that replaced one of
        replicator's own took the replica over (its position or its tables list may be the
        source's rows): refused, with the way out."""
        columns = [r[1] for r in self.db.execute(f"PRAGMA main.table_info({_TABLES})")]
        if columns != ["source_name", "table_id", "mode", "structure", "copy_snapshot"]:
            self._taken_over(f"public.{_TABLES}", _TABLES)
        try:
            recorded = [TableStructure.from_json(structure)
                        for (structure,) in self.db.execute(f"SELECT structure FROM {_TABLES}")]
        except (ValueError, KeyError, TypeError):
            self._taken_over(f"public.{_TABLES}", _TABLES)
        if self.db.execute(f"SELECT 1 FROM {_SETTINGS} WHERE name = 'table_names' AND value = 'escaped'").fetchone():
            return
        own = {ascii_lower(n) for n in (_STATE, _TABLES, _SETTINGS, _FORMS, VIEWS, REFRESHES)}
        renames: dict[str, TableStructure] = {}   # a table of the replica -> the source table it holds
        for s in recorded:
            old = _name_before_escaping(s)
            if old == target_table_name(s.schema, s.name):
                continue
            if ascii_lower(old) in own or ascii_lower(old).startswith(STORAGE_PREFIX):
                self._taken_over(s.qualified_name, old)
            if self._has_name(old):
                renames[old] = s
        with views_following_renames(self.db, {old: target_table_name(s.schema, s.name)
                                               for old, s in renames.items()}):
            # Through names nothing has: a table's new name may be another one's old name.
            free = (n for n in (f"_replicator_renaming_table_{i}" for i in itertools.count()) if not self._has_name(n))
            steps = {old: next(free) for old in renames}
            for old, step in steps.items():
                self._rename(old, step, renames[old])
            for old, s in renames.items():
                self._rename(steps[old], target_table_name(s.schema, s.name), s)
        self.db.execute(f"INSERT OR REPLACE INTO {_SETTINGS} VALUES ('table_names', 'escaped')")

    def _rename(self, table: str, to: str, source: TableStructure) -> None:
        """Renames a table of the replica and its value forms' row; one SQLite refuses (another
        table already has that name) stops the open, nothing written."""
        try:
            self.db.execute(f"ALTER TABLE {quote(table)} RENAME TO {quote(to)}")
        except sqlite3.Error as exc:
            self.db.execute("ROLLBACK")
            self.db.close()
            raise UserError(f"cannot rename table {_name_before_escaping(source)} of {self.path} (source table "
                            f"{source.qualified_name}) to {target_table_name(source.schema, source.name)}, the name "
                            f"this version gives it: {sqlite_error(exc)}; move that table aside, or build the "
                            f"replica anew (another path)") from None
        self.db.execute(f"UPDATE {_FORMS} SET table_name = ? WHERE table_name = ?", (to, table))

    def _has_name(self, name: str) -> bool:
        """Whether a table, index or view (TEMP ones too) has that name, as SQLite compares names."""
        return self.db.execute("SELECT 1 FROM main.sqlite_master WHERE name = ?1 COLLATE NOCASE UNION ALL "
                               "SELECT 1 FROM temp.sqlite_master WHERE name = ?1 COLLATE NOCASE",
                               (name,)).fetchone() is not None

    def _taken_over(self, source_name: str, table: str) -> NoReturn:
        self.db.execute("ROLLBACK")
        self.db.close()
        raise UserError(f"{self.path} holds source table {source_name} in place of replicator's own table {table} "
                        f"(an older replicator did not keep replicated tables apart from its own): what the replica "
                        f"says of itself cannot be trusted; move it aside and run `replicator consume` again to "
                        f"build the replica anew")

    # state ---------------------------------------------------------------------

    def positions(self, queue: str) -> dict[str, int]:
        self._check_files()
        return dict(self.db.execute(f"SELECT consumer, last_tick FROM {_STATE} WHERE queue = ?", (queue,)))

    def queues(self) -> set[str]:
        self._check_files()
        return {queue for (queue,) in self.db.execute(f"SELECT DISTINCT queue FROM {_STATE}")}

    def set_position(self, queue: str, consumer: str, tick_id: int) -> None:
        self.db.execute(f"INSERT OR REPLACE INTO {_STATE} (queue, consumer, last_tick) VALUES (?, ?, ?)",
                        (queue, consumer, tick_id))

    def forget_positions(self, queue: str) -> None:
        self.db.execute(f"DELETE FROM {_STATE} WHERE queue = ?", (queue,))

    def tables(self) -> dict[str, TargetTable]:
        self._check_files()
        return {name: TargetTable(source_name=name, table_id=table_id, mode=mode,
                                  structure=TableStructure.from_json(structure), copy_snapshot=snapshot)
                for name, table_id, mode, structure, snapshot in self.db.execute(
                    f"SELECT source_name, table_id, mode, structure, copy_snapshot FROM {_TABLES}")}

    def save_table(self, table: TargetTable) -> None:
        self.db.execute(f"INSERT OR REPLACE INTO {_TABLES} VALUES (?, ?, ?, ?, ?)",
                        (table.source_name, table.table_id, table.mode, table.structure.to_json(),
                         table.copy_snapshot))

    # transactions ----------------------------------------------------------------

    def begin(self) -> None:
        self._check_files()
        self.db.execute("BEGIN IMMEDIATE")
        try:
            self.views.begun()
        except BaseException:
            self.rollback()
            raise

    def commit(self) -> None:
        self._check_files()
        self.views.before_commit()
        self.db.execute("COMMIT")
        self._shm_size = max(self._shm_size, _size(f"{self.path}-shm"))   # SQLite grows it with the WAL

    def rollback(self) -> None:
        if not self._stopped and self.db.in_transaction:
            self.db.execute("ROLLBACK")
        self.views.rolled_back()
        self._changed()   # an ALTER rolled back: the tables are in their layouts before it

    def close(self) -> None:
        if not self._stopped:
            self.db.close()
            os.close(self._fd)

    def _check_files(self) -> None:
        """Stops the consumer when the replica's file, its -wal or its -shm is no longer the
        file this connection has open (deleted, replaced: it would go on writing a file
        nobody sees), the file was overwritten in place (its header no longer a replica's:
        SQLite would write the replica's pages into another database), or the -shm was cut
        short (SQLite maps it: a process touching a page past its end is killed by SIGBUS).
        A few stat() calls and a read of 100 bytes, before each batch and commit; a change in
        the middle of a batch is still SQLite's to meet."""
        if self._stopped:
            raise UserError(self._stopped)
        how = file_changed(self.path, self._fd)
        if not how:
            header = os.pread(self._fd, 100, 0)
            if not header.startswith(_HEADER) or _application_id(header) not in self._ids:
                how = "overwritten"
            elif _application_id(header) == APPLICATION_ID:
                self._ids = {APPLICATION_ID}
        if how:
            self._stopped = self._let_go(how)
            raise UserError(self._stopped)
        for suffix, known in self._files.items():
            if known is None:
                continue
            name = f"{self.path}{suffix}"
            how = file_changed(name, known)
            if not how and suffix == "-shm" and (size := _size(name)) < self._shm_size:
                _regrow(name, self._shm_size)
                raise UserError(f"{name} was truncated (from {self._shm_size:,} to {size:,} bytes) while the "
                                f"consumer was writing {self.path}; the consumer stopped before SQLite read it (a "
                                f"process reading a -shm cut short under it dies of SIGBUS): stop what truncates "
                                f"the replica's files, then run the same `replicator consume` again")
            if how:
                how = "replaced by another file" if how == "replaced" else how
                raise UserError(f"{name} was {how} while the consumer was writing {self.path}; the consumer "
                                f"stopped before committing another batch: its readers and this writer no longer "
                                f"share one WAL: stop what removes the replica's files, then run the same "
                                f"`replicator consume` again")

    def _let_go(self, how: str) -> str:
        """Closes the connection to a file that is no longer the replica at its path
        ("deleted", "replaced", "overwritten"), without SQLite writing the WAL into what is
        now there, and removes the -wal and -shm it used, found by their identity: left
        there, SQLite would replay them into the next replica made at the path. Returns why
        the consumer stopped, with the way out."""
        if self.db.in_transaction:
            self.db.execute("ROLLBACK")
        if how != "overwritten" and os.fstat(self._fd).st_nlink:
            # Moved elsewhere, not deleted: what the WAL holds goes into it (as far as no
            # reader holds it back), so that it is whole without the -wal left here.
            how = "moved away" if how == "deleted" else how
            with suppress(sqlite3.Error):
                self.db.execute("PRAGMA wal_checkpoint(PASSIVE)")
        kept_out = _no_checkpoint_on_close(self.db)
        self.db.close()
        os.close(self._fd)
        removed, left = [], []
        for suffix, known in self._files.items():
            name = f"{self.path}{suffix}"
            if known is not None and not file_changed(name, known):
                with suppress(FileNotFoundError):
                    os.unlink(name)
                removed.append(name)
            elif os.path.lexists(name):
                left.append(name)
        done = f"; it removed its {' and '.join(removed)}" if removed else ""
        first = f"move {' and '.join(left)} (not the files it had open) aside, then " if left else ""
        if how in ("deleted", "moved away"):
            back = ", or put the file back and run it again" if how == "moved away" else ""
            return (f"{self.path} was {how} while the consumer was writing it; the consumer stopped before "
                    f"committing another batch{done}: {first}run the same `replicator consume` again to build the "
                    f"replica anew (it copies every table){back}")
        if how == "replaced":
            return (f"{self.path} was replaced by another file while the consumer was writing it; the consumer "
                    f"stopped before committing another batch{done}: {first}run `replicator consume` again to go "
                    f"on with the file now there")
        untouched = "left it as it now is" if kept_out else "could not keep SQLite from checkpointing into it"
        return (f"{self.path} was overwritten in place while the consumer was writing it (its header is no longer a "
                f"replica's); the consumer stopped before committing another batch and {untouched}{done}: {first}run "
                f"`replicator consume` again to go on with the file now there (refused if it is not a replica), or "
                f"give the replica another path")

    # tables ------------------------------------------------------------------------

    @staticmethod
    def table_name(table: TargetTable) -> str:
        return target_table_name(table.structure.schema, table.structure.name)

    def create_table(self, table: TargetTable) -> None:
        """(Re)creates the replica table, empty, and records it."""
        self._check_name_is_free(table)
        s = table.structure
        name = quote(self.table_name(table))
        columns = [f"{quote(c.name)} {self._column_type(s, c)}" for c in s.columns]
        self.views.schema_changing(self.table_name(table))
        self.db.execute(f"DROP TABLE IF EXISTS {name}")
        self.db.execute(f"CREATE TABLE {name} ({', '.join(columns)}, "
                        f"PRIMARY KEY ({', '.join(quote(k) for k in s.key)}))")
        self.db.execute(f"INSERT OR REPLACE INTO {_FORMS} VALUES (?, ?)", (self.table_name(table), FORMS))
        self._changed()
        self.save_table(table)

    def _column_type(self, structure: TableStructure, column: Column) -> str:
        """sqlite_type(), except for a nullable one-column INTEGER key: declared INTEGER it
        would be an alias of the rowid, which stores NULL as a new number; INT has the
        same affinity and stores NULL."""
        declared = sqlite_type(column, key=column.name in structure.key, numeric=self.numeric)
        if declared == "INTEGER" and structure.key == (column.name,) and not column.not_null:
            return "INT"
        return declared

    def _check_name_is_free(self, table: TargetTable) -> None:
        """Two source tables must not become one SQLite table (public."s__t" and s.t,
        or "T" and t: SQLite names are case-insensitive; escaped names never meet another
        table's, see structure.target_table_name), nor a table a view's SQL view."""
        name = self.table_name(table)
        # each table's name from its structure's JSON by SQLite: a copy of N tables checks each against all
        for source_name, schema, other_name in self.db.execute(
                f"SELECT source_name, json_extract(structure, '$.schema'), json_extract(structure, '$.name')"
                f" FROM {_TABLES} WHERE source_name <> ?", (table.source_name,)):
            if ascii_lower(target_table_name(schema, other_name)) == ascii_lower(name):
                raise UserError(f"{source_name} and {table.source_name} would both be table {name!r} of "
                                f"{self.name}: replicate them into separate targets (consume --tables)")
        view = self.db.execute("SELECT name FROM main.sqlite_master WHERE type = 'view' AND name = ? COLLATE NOCASE",
                               (name,)).fetchone()
        if view is not None:
            raise UserError(f"{table.source_name} would be table {name!r} of {self.name}, which has view {view[0]!r} "
                            f"of that name: drop the view (`replicator view drop {view[0]} --target {self.name}`) "
                            f"and run the consumer again, or leave the table out of this target (consume --tables)")

    def drop_table(self, table: TargetTable) -> None:
        self.views.schema_changing(self.table_name(table))
        self.db.execute(f"DROP TABLE IF EXISTS {quote(self.table_name(table))}")
        self.db.execute(f"DELETE FROM {_TABLES} WHERE source_name = ?", (table.source_name,))
        self.db.execute(f"DELETE FROM {_FORMS} WHERE table_name = ?", (self.table_name(table),))
        self._changed()

    def alter_table(self, old: TargetTable, new: TargetTable, changes: list[Change]) -> None:
        """Applies a reconciled schema change in place (see schema.reconcile)."""
        if ascii_lower(self.table_name(new)) != ascii_lower(self.table_name(old)):
            self._check_name_is_free(new)
        name = quote(self.table_name(old))
        self.views.schema_changing(self.table_name(old), tuple(c.name for c in changes if c.action == "drop_column"))
        if self.table_name(new) != self.table_name(old):
            self.views.schema_changing(self.table_name(new))
        for change in changes:
            if change.action == "rename_table":
                name = quote(self.table_name(new))
                self.db.execute(f"ALTER TABLE {quote(self.table_name(old))} RENAME TO {name}")
                self.db.execute(f"UPDATE {_FORMS} SET table_name = ? WHERE table_name = ?",
                                (self.table_name(new), self.table_name(old)))
            elif change.action == "rename_column":
                self.db.execute(f"ALTER TABLE {name} RENAME COLUMN {quote(change.name)} TO {quote(change.new_name)}")
            elif change.action == "drop_column":
                self.db.execute(f"ALTER TABLE {name} DROP COLUMN {quote(change.name)}")
            elif change.action == "add_column":
                assert change.column is not None
                # a table of an earlier version keeps its forms (numeric as TEXT) in new columns too
                legacy = self.db.execute(f"SELECT 1 FROM {_FORMS} WHERE table_name = ?",
                                         (self.table_name(new),)).fetchone() is None
                self.db.execute(f"ALTER TABLE {name} ADD COLUMN {quote(change.name)} "
                                f"{sqlite_type(change.column, numeric='text' if legacy else self.numeric)}")
        if old.source_name != new.source_name:
            self.db.execute(f"DELETE FROM {_TABLES} WHERE source_name = ?", (old.source_name,))
        self.save_table(new)
        self._changed()

    def schema_event(self, table: TargetTable, event: dict[str, Any]) -> None:
        """Nothing to record: the replica's structure is the record."""

    # changes -----------------------------------------------------------------------

    def _statement(self, table: TargetTable, kind: str) -> str:
        cached = self._statements.get((table.source_name, kind))
        if cached:
            return cached
        s = table.structure
        name = quote(self.table_name(table))
        if kind == "upsert":
            stmt = (f"INSERT OR REPLACE INTO {name} ({', '.join(quote(c) for c in s.column_names)}) "
                    f"VALUES ({', '.join('?' for _ in s.columns)})")
        else:
            # IS matches NULL keys too (a --key column may be nullable) and still uses the index.
            stmt = f"DELETE FROM {name} WHERE " + " AND ".join(f"{quote(k)} IS ?" for k in s.key)
        self._statements[(table.source_name, kind)] = stmt
        return stmt

    def _changed(self) -> None:
        """Forgets what was prepared for the tables' old layouts."""
        self._statements.clear()
        self._adapters.clear()

    def _adapted(self, table: TargetTable) -> tuple[RowsDecoder | None, RowsDecoder | None]:
        """What turns the table's decoded rows and keys into the values its SQLite columns
        store (types.value_adapters), following each column's declared type and the table's
        recorded forms; None where values are stored as decoded."""
        cached = self._adapters.get(table.source_name)
        if cached is not None:
            return cached
        name = self.table_name(table)
        declared = {r[1]: r[2] for r in self.db.execute(f"PRAGMA main.table_info({quote(name)})")}
        recorded = self.db.execute(f"SELECT forms FROM {_FORMS} WHERE table_name = ?", (name,)).fetchone()
        s = table.structure
        adapters = value_adapters(s.columns, [declared.get(c.name, "") for c in s.columns],
                                  recorded[0] if recorded else LEGACY_FORMS)
        positions = s.key_positions()
        cached = self._adapters[table.source_name] = (adapter(adapters), adapter([adapters[i] for i in positions]))
        return cached

    def upsert(self, table: TargetTable, op: str, rows: Iterable[Row], old_rows: OldRows = None) -> None:
        self.views.note_write(self.table_name(table))
        adapt = self._adapted(table)[0]
        if adapt is not None:
            rows = adapt(list(rows))
        if op != "R" and not all(c.not_null for c in table.structure.key_columns()):
            # A NULL in a SQLite key never conflicts (INSERT OR REPLACE would add a second
            # row): a key with nullable columns (--key, the automatic key) is replaced by
            # hand, row by row, so that rows of one call with the same key replace each other.
            delete, insert = self._statement(table, "delete"), self._statement(table, "upsert")
            positions = table.structure.key_positions()
            for row in rows:
                self.db.execute(delete, [row[i] for i in positions])
                self.db.execute(insert, row)
            return
        self.db.executemany(self._statement(table, "upsert"), rows)

    def delete(self, table: TargetTable, keys: Iterable[Row], old_rows: OldRows = None) -> None:
        self.views.note_write(self.table_name(table))
        adapt = self._adapted(table)[1]
        if adapt is not None:
            keys = adapt(list(keys))
        self.db.executemany(self._statement(table, "delete"), keys)

    def truncate(self, table: TargetTable) -> None:
        self.views.table_truncated(self.table_name(table))
        self.db.execute(f"DELETE FROM {quote(self.table_name(table))}")

    def copy_from(self, table: TargetTable, snap: Any, progress: Callable[[int], None]) -> None:
        """The consumer copies through upsert()."""
        return None
