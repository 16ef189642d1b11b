"""Keeping a Delta warehouse fast to read and small on disk: OPTIMIZE and VACUUM.

OPTIMIZE rewrites, per table, what makes reads slow: the small files batches
append (one per batch that changed the table) and the files whose deletion
vectors mark rows (Spark reads those markedly slower). Their live rows are
written into large files, committed with ``dataChange: false`` (readers of
changes skip it: no row changed). It costs what it rewrites, not the table. The
consumer runs it on a table after a commit leaves it with SMALL_FILES_DUE small
files or a file past PURGE_RATIO deleted, and while idle (a batch that changed
nothing) rewrites one file with deletions of a quiet table at a time (purge_next);
``replicator delta optimize`` runs it on demand, also while a consumer writes:
the second of the two to commit re-reads the log (the consumer then rebuilds its
index; an OPTIMIZE whose files changed meanwhile gives up and says so).

VACUUM deletes, as Delta's VACUUM does, the files no current version names once
they were removed longer ago than the retention (a table's
``delta.deletedFileRetentionDuration``, 7 days by default: readers time-travelling
within it still find theirs), and cleans the log (clean_log, which the consumer
also runs after each checkpoint it writes): log entries go once their versions
are older than the log retention (``delta.logRetentionDuration``, set to 7 days
on replicator's tables, Delta's 30 days where unset), and only below a checkpoint
at or before the oldest version kept: every version within the retention stays
readable, as delta-rs' cleanup_metadata and Spark's log cleanup keep them; so
do temporary files a killed writer left in the log once STALE_TEMP_SECONDS old.
A file's remove time is its remove action's deletionTimestamp (now when it has
none), and its own modification time must be past the retention too: the
timestamp is optional and another writer's clock. The log's paths are compared
with the listing as Delta's VACUUM compares them, relative to the table: decoded,
an absolute one (``file:///…``, ``s3://…``, a ``p`` deletion vector's) stripped of
the table's own URI; one outside the table stops vacuum before anything is deleted.
A shorter retention than a table's is refused unless forced (Delta's
``retentionDurationCheck``), and one under MIN_RETENTION always, a table's own
property's too. It deletes only files of the names replicator and Delta writers give
data files and deletion vectors (and replicator's own temporary files), never
another tool's: a file the log removed where the log named it, and a file no log
names (a crashed writer's, or one a copy or batch is writing and has not committed
yet) only directly in a table's directory and once older than the table's retention
and ORPHAN_SECONDS, whatever the retention asked: a short retention never takes a
file a running copy will commit, and no subdirectory of another tool's is walked
into.

The views' tables (replicator.targets.delta.view_table) are kept the same way:
the consumer optimizes them after its refreshes; both commands cover them. A
consumer given --vacuum-every runs vacuum itself between batches
(DeltaTarget.tend), as the command does without options, and vacuums a table as
it checkpoints its log (Tombstones: the checkpoint leaves out the removes past
the retention).
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pyroaring import BitMap

from replicator.errors import UserError, first_line
from replicator.source import format_duration
from replicator.targets.delta import deletion_vectors as dv
from replicator.targets.delta import log as delta_log
from replicator.targets.delta import schema as delta_schema
from replicator.targets.delta.actions import Action, Add, Remove, parse_commit, records
from replicator.targets.delta.state import DIRECTORY as STATE_DIRECTORY
from replicator.targets.delta.state import WarehouseState
from replicator.targets.delta.storage import Entry, Storage, recorded_directory
from replicator.targets.delta.table import COMPRESSION, FILE_ROWS, ROW_GROUP, CountingWriter, ReplicaTable, file_stats
from replicator.targets.delta.view_table import VIEWS_DIR, ViewTable, view_directories

log = logging.getLogger("replicator")

SMALL_FILE_BYTES = 32 << 20    # a file smaller than this, and of under half FILE_ROWS rows, is folded with the others
SMALL_FILES_DUE = 8            # small files of a table before the consumer folds them (cheap: they are small)
PURGE_RATIO = 0.2              # share of a file's rows deleted before it is rewritten after a commit
IDLE_PURGE_QUIET = 300.0       # seconds a table stays unchanged before an idle consumer purges its deletion vectors
RETENTION_SECONDS = 7 * 24 * 3600   # delta.deletedFileRetentionDuration's default
RETENTION = "delta.deletedFileRetentionDuration"
MIN_RETENTION = 1.0                 # seconds: shorter, a retention would take the files of the commit just made
ORPHAN_SECONDS = RETENTION_SECONDS  # a file no log names is kept at least this long: a copy may still commit it
LOG_RETENTION_SECONDS = 30 * 24 * 3600   # delta.logRetentionDuration's default (replicator's tables set 7 days)
STALE_TEMP_SECONDS = 3600   # a temporary file in a log older than this is a killed writer's
# data files and deletion vectors as Delta writers name them, and the temporary files storage.open_write
# writes them through (a crashed writer's): other names are another tool's
_DATA_FILE = re.compile(r"part-[^/]*\.parquet|deletion_vector_[0-9a-f-]{36}\.bin"
                        r"|\.(?:part-[^/]*\.parquet|deletion_vector_[0-9a-f-]{36}\.bin)\.[0-9a-f]{32}\.tmp")
# the subdirectory of a view's table a full refresh writes its files into (views.py _full)
_FULL_REFRESH = re.compile(r"full-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}/[^/]+")
_INTERVAL_PART = re.compile(r"\s*(\d+)\s*(nanosecond|microsecond|millisecond|second|minute|hour|day|week)s?",
                            re.IGNORECASE)
_INTERVAL_SECONDS = {"nanosecond": 1e-9, "microsecond": 1e-6, "millisecond": 1e-3, "second": 1, "minute": 60,
                     "hour": 3600, "day": 86400, "week": 7 * 86400}
_LOG_FILE = re.compile(r"(\d{20})\.(?:json|checkpoint(?:\.\d{10}\.\d{10})?\.parquet|crc)")
# a commit or checkpoint on its way (storage.put_if_absent/open_write's, delta-rs' staged commits)
_LOG_TEMP = re.compile(r"\.[^/]+\.tmp|_commit_[0-9a-f-]{36}\.json\.tmp")


@dataclass
class Move:
    """Where a rewritten file's live rows went: its rows `kept` (in order) are the rows of the
    new file from `offset` on."""
    old_path: str
    kept: np.ndarray
    total: int            # rows of the old file
    new_file: int         # the new file's number among those written, then its path
    offset: int
    new_path: str = ""


@dataclass
class Optimized:
    table: str
    files: int            # files rewritten
    rows: int             # live rows written
    written: int          # files written
    seconds: float
    committed: bool       # False: the files changed meanwhile (run again)
    moves: list[Move] = field(default_factory=list)   # where the rows went (committed only)


def due(table: ReplicaTable) -> bool:
    """Whether the consumer should OPTIMIZE the table after its last commit."""
    small = sum(1 for add in table.snapshot.files.values() if _small(add))
    return small >= SMALL_FILES_DUE or any(_purge(add) for add in table.snapshot.files.values())


def _small(add: Add) -> bool:
    """A file worth folding with others: a batch's, not a copy's or a rewrite's (files of FILE_ROWS
    rows of narrow columns are under SMALL_FILE_BYTES, and folding them would rewrite the table)."""
    return add.get("size", 0) < SMALL_FILE_BYTES and (records(add) or 0) < FILE_ROWS // 2


def _purge(add: Add) -> bool:
    vector = add.get("deletionVector")
    if not vector:
        return False
    rows = records(add) or 0
    return rows > 0 and vector["cardinality"] / rows >= PURGE_RATIO


def optimize_table(table: ReplicaTable, *, everything: bool = False) -> Optimized | None:
    """Rewrites the table's small files and its files past PURGE_RATIO deleted (everything:
    every file with deletions too) into large files. None when nothing needs it."""
    table.check_writable()
    files = table.snapshot.files
    small = [p for p, add in files.items() if _small(add)]
    chosen = set(small) if len(small) >= 2 else set()
    chosen |= {p for p, add in files.items() if _purge(add) or (everything and add.get("deletionVector"))}
    if not chosen:
        return None
    result = _rewrite(table.storage, table.snapshot, chosen,
                      delta_schema.arrow_schema(table.structure(), table.snapshot.schema), table.deletion_vector,
                      table.taken_in)
    _moved(table, result)
    return result


def _writable(table: ReplicaTable) -> bool:
    try:
        table.check_writable()
    except UserError:
        return False
    return True


def purge_next(tables: list[ReplicaTable]) -> Optimized | None:
    """While the consumer is idle (a batch that changed no table): the one file of these tables
    (those quiet for IDLE_PURGE_QUIET: a table changed a row at a time would otherwise have a file
    rewritten per change) whose deletion vector marks the largest share of its rows is rewritten
    without them (with its table's small files). Spark reads a file with a deletion vector
    markedly slower than one without, however few rows it marks (docs/benchmarks.md): a file at a
    time, between batches, brings reads back to a scan without delaying a batch by more than one
    file's rewrite."""
    best: tuple[float, ReplicaTable, str] | None = None
    for table in tables:
        if table.meta is None or not _writable(table):
            continue
        for path, add in table.snapshot.files.items():
            vector = add.get("deletionVector")
            share = vector["cardinality"] / max(records(add) or 0, 1) if vector else 0.0
            if share > (best[0] if best else 0):
                best = (share, table, path)
    if best is None:
        return None
    _, table, path = best
    small = {p for p, add in table.snapshot.files.items() if _small(add)}
    result = _rewrite(table.storage, table.snapshot, small | {path},
                      delta_schema.arrow_schema(table.structure(), table.snapshot.schema), table.deletion_vector,
                      table.taken_in)
    _moved(table, result)
    return result


def _moved(table: ReplicaTable, result: Optimized) -> None:
    """The consumer's key index follows the rows the rewrite moved (built again, it would cost a
    read of every key: seconds at 10M rows, every few batches). An index another writer's commit
    made stale was dropped when the rewrite read that commit (ReplicaTable.taken_in)."""
    if not result.committed:
        return
    if table.index is not None:
        table.index.move([(m.old_path, m.kept, m.total, m.new_path, m.offset) for m in result.moves])
    table.release_unused()


def compact_state(state: WarehouseState) -> int | None:
    """Folds _replicator's files (one per batch that changed tables) once SMALL_FILES_DUE, its
    rows past the time-travel window dropped (WarehouseState.compact): rows dropped."""
    return state.compact(log_retention(state.snapshot), SMALL_FILES_DUE)


def _rewrite(storage: Storage, snapshot: delta_log.Snapshot, chosen: set[str], target: pa.Schema,
             deletion_vector: Callable[[Add], BitMap | None],
             taken_in: Callable[[list[list[Action]]], None]) -> Optimized:
    """Writes the live rows of the chosen files into large files, and commits the swap. taken_in
    is given the other writers' commits read into the snapshot meanwhile (it may refuse them)."""
    started = time.monotonic()
    originals = {path: snapshot.files[path] for path in sorted(chosen)}
    written: list[Add] = []
    pending: list[pa.Table] = []
    pending_rows = rows = 0

    def flush() -> None:
        nonlocal pending, pending_rows
        if not pending:
            return
        data = pa.concat_tables(pending)
        pending, pending_rows = [], 0
        path = f"part-00000-{uuid.uuid4()}-c000.{COMPRESSION}.parquet"
        with storage.open_write(f"{snapshot.table}/{path}") as out:
            counter = CountingWriter(out)
            pq.write_table(data, counter, compression=COMPRESSION, row_group_size=ROW_GROUP)
        written.append({"path": path, "partitionValues": {}, "size": counter.size,
                        "modificationTime": delta_log.now_ms(), "dataChange": False,
                        "stats": delta_log.json_text(file_stats(data))})

    moves: list[Move] = []
    try:
        for path, add in originals.items():
            live, kept, total = _live_rows(storage, snapshot.table, path, deletion_vector(add), target)
            if pending_rows and pending_rows + live.num_rows > FILE_ROWS:
                flush()   # files of about FILE_ROWS rows: a file's rows stay in one new file (Move)
            moves.append(Move(path, kept, total, len(written), pending_rows))   # new file: by number, until written
            rows += live.num_rows
            pending.append(live)
            pending_rows += live.num_rows
        flush()
    except BaseException:
        for add in written:
            storage.delete(f"{snapshot.table}/{add['path']}")
        raise
    now = delta_log.now_ms()
    actions: list[Action] = []
    for add in originals.values():
        remove: Remove = {"path": add["path"], "deletionTimestamp": now, "dataChange": False,
                          "extendedFileMetadata": True, "partitionValues": {}, "size": add.get("size")}
        if add.get("deletionVector"):
            remove["deletionVector"] = add["deletionVector"]
        actions.append({"remove": remove})
    actions += [{"add": add} for add in written]
    # an error of the commit leaves the files: its version may have landed and refer to them (VACUUM's job)
    committed = _commit(storage, snapshot, originals, actions, taken_in)
    if not committed:   # lost to other writers: no version refers to them
        for add in written:
            storage.delete(f"{snapshot.table}/{add['path']}")
    for move in moves:
        move.new_path = written[move.new_file]["path"]
    return Optimized(snapshot.table, len(originals), rows, len(written), time.monotonic() - started, committed,
                     moves if committed else [])


def _commit(storage: Storage, snapshot: delta_log.Snapshot, originals: dict[str, Add],
            actions: list[Action], taken_in: Callable[[list[list[Action]]], None]) -> bool:
    """Commits the rewrite, over commits of other writers that left its files as they were (Delta's
    rule: a file removed or given a deletion vector meanwhile is a conflict)."""
    for _ in range(5):
        try:
            delta_log.commit(storage, snapshot, actions, operation="OPTIMIZE",
                             parameters={"predicate": "[]", "zOrderBy": "[]"})
            return True
        except delta_log.CommitConflict:
            taken_in(delta_log.refresh(storage, snapshot))
            if any(snapshot.files.get(path) != add for path, add in originals.items()):
                return False
    return False


def _live_rows(storage: Storage, directory: str, path: str, deleted: BitMap | None,
               target: pa.Schema) -> tuple[pa.Table, np.ndarray, int]:
    """A file's rows less those its deletion vector marks, in the table's current schema (columns
    added since it was written are NULL, dropped ones left out); and which rows of the file they
    are, and how many it has."""
    with storage.open_read(delta_log.table_file(storage, directory, path)) as f:
        data = delta_log.read_parquet(f.read())
    total = data.num_rows
    # cast before filtering: another writer's file may hold types Arrow filters not (delta-rs' string_view)
    columns = [data.column(f.name).cast(f.type) if f.name in data.column_names else pa.nulls(total, f.type)
               for f in target]
    rows = pa.Table.from_arrays(columns, schema=target)
    kept = np.arange(total, dtype=np.int64)
    if deleted:
        keep = np.ones(total, dtype=bool)
        keep[np.fromiter(deleted, dtype=np.int64, count=len(deleted))] = False
        rows = rows.filter(pa.array(keep))
        kept = kept[keep]
    return rows, kept, total


def optimize(storage: Storage, tables: list[str] | None = None, *, everything: bool = False) -> list[Optimized]:
    """OPTIMIZE of the warehouse's tables (tables: source names; None: all, and the views')."""
    state = WarehouseState(storage)
    if not state.exists:
        raise UserError(f"{storage.url} is not a replicator Delta warehouse (no {STATE_DIRECTORY} table)")
    directories = state.directories()
    unknown = sorted(set(tables or ()) - set(directories.values()))
    if unknown:
        raise UserError(f"no table {', '.join(unknown)} in {storage.url} (it has "
                        f"{', '.join(sorted(directories.values())) or 'none'})")
    done = []
    for directory, name in sorted(directories.items()):
        if tables and name not in tables:
            continue
        result = optimize_table(ReplicaTable(storage, directory), everything=everything)
        if result is not None:
            result.table = name
            done.append(result)
    for directory in [] if tables else view_directories(storage):
        view = ViewTable(storage, directory)
        if view.entry is not None and (result := optimize_table(view.table, everything=everything)) is not None:
            result.table = f"view {view.entry['name']}"
            done.append(result)
    return done


@dataclass
class Vacuumed:
    table: str
    files: int
    bytes: int


def vacuum(storage: Storage, *, retention: float | None = None, force: bool = False,
           dry_run: bool = False) -> list[Vacuumed]:
    """VACUUM of every table, a dropped one's too (its rows' files: its log stays), of the views'
    and of _replicator (see the module docstring). retention: seconds, None for each table's own;
    force: a retention shorter than a table's is taken."""
    if retention is not None and not retention >= MIN_RETENTION:
        raise UserError(f"--retain {_shown(retention)} would delete the files readers and writers use: the smallest "
                        f"accepted is {_shown(MIN_RETENTION)} (with --force)")
    state = WarehouseState(storage)
    if not state.exists:
        raise UserError(f"{storage.url} is not a replicator Delta warehouse (no {STATE_DIRECTORY} table)")
    recorded = [recorded_directory(storage.url, directory, "nothing vacuumed")
                for directory in sorted(state.every_directory())]
    snapshots = [delta_log.load(storage, directory, tombstones=True)
                 for directory in [*recorded, *view_directories(storage), STATE_DIRECTORY]]
    kept = {snapshot.table: table_retention(snapshot) for snapshot in snapshots}
    if retention is None:
        for snapshot in snapshots:
            if kept[snapshot.table] < MIN_RETENTION:
                floor = _shown(MIN_RETENTION)
                raise UserError(f"{snapshot.table}: {RETENTION} is {snapshot.configuration[RETENTION]!r}, under the "
                                f"{floor} vacuum keeps at least (readers and writers would lose the files they use): "
                                f"set it to {floor} or more, or give --retain {floor} or more")
    elif not force:
        short = sorted((seconds, table) for table, seconds in kept.items() if retention < seconds)
        if short:
            seconds, table = short[-1]
            raise UserError(f"--retain {_shown(retention)} is shorter than {table}'s retention ({_shown(seconds)}, "
                            f"{RETENTION}): time travel within it and a concurrent reader would lose files; give "
                            f"--retain {_shown(seconds)} or more, or --force")
    now = time.time()
    references = [_references(storage, snapshot, now) for snapshot in snapshots]   # before anything is deleted
    needed = state.kept_versions(log_retention(state.snapshot))
    done = []
    for snapshot, (in_use, removed) in zip(snapshots, references, strict=True):
        deleted, size = _vacuum_table(storage, snapshot, in_use, removed, now,
                                      kept[snapshot.table] if retention is None else retention,
                                      kept[snapshot.table], dry_run)
        deleted += clean_log(storage, snapshot, keep=needed.get(snapshot.table), dry_run=dry_run)
        if deleted:
            done.append(Vacuumed(snapshot.table, deleted, size))
    return done


@dataclass
class Tombstones:
    """A table's files in use and removed, as its log names them before the consumer checkpoints
    it (a consumer given --vacuum-every): delta-rs' checkpoint leaves out the removes older than
    the table's retention, and vacuum would then find their files named by no log and keep them
    ORPHAN_SECONDS (7 days) whatever the retention. Read before the checkpoint, vacuum() after it
    deletes them, as `vacuum` does with the table's own retention."""
    storage: Storage
    snapshot: delta_log.Snapshot
    in_use: set[str]
    removed: dict[str, float]

    @classmethod
    def read(cls, storage: Storage, table: str) -> Tombstones:
        snapshot = delta_log.load(storage, table, tombstones=True)
        return cls(storage, snapshot, *_references(storage, snapshot, time.time()))

    def vacuum(self) -> tuple[int, int]:
        """Files and bytes deleted; nothing is listed unless a remove is past the retention, and
        nothing deleted under MIN_RETENTION (the scheduled vacuum says why)."""
        retention, now = table_retention(self.snapshot), time.time()
        if retention < MIN_RETENTION or all(now - when < retention for when in self.removed.values()):
            return 0, 0
        return _vacuum_table(self.storage, self.snapshot, self.in_use, self.removed, now, retention, retention,
                             dry_run=False)


def _shown(seconds: float) -> str:
    return format_duration(timedelta(seconds=seconds))


def _vacuum_table(storage: Storage, snapshot: delta_log.Snapshot, in_use: set[str], removed: dict[str, float],
                  now: float, retention: float, table_retention: float, dry_run: bool) -> tuple[int, int]:
    """Deletes the table's files the log removed once both their remove and their writing are
    longer than `retention` ago, and those it never named once older than its own retention and
    ORPHAN_SECONDS, where replicator writes them: directly in its directory, and in a view's
    full refresh's subdirectory (a refresh whose commit's outcome was unknown leaves its files
    there). Files and bytes deleted. in_use, removed: as _references gives them."""
    orphan_before = now - max(table_retention, ORPHAN_SECONDS)
    view = snapshot.table.startswith(f"{VIEWS_DIR}/")
    deleted = size = 0
    for entry in storage.list(snapshot.table):
        name = entry.path[len(snapshot.table) + 1:]
        if name in in_use or not _DATA_FILE.fullmatch(name.rsplit("/", 1)[-1]):
            continue
        when = removed.get(name)
        if when is not None:   # where the log put it (a view's full refresh: a subdirectory of its own)
            # the remove's timestamp is another writer's clock, and optional: the file's own time guards it too
            if now - when < retention or now - entry.modified < retention:
                continue
        elif entry.modified > orphan_before or ("/" in name and not (view and _FULL_REFRESH.fullmatch(name))):
            continue   # no other subdirectory is replicator's layout
        if not dry_run:
            storage.delete(entry.path)
        deleted += 1
        size += entry.size
    return deleted, size


def _references(storage: Storage, snapshot: delta_log.Snapshot, now: float) -> tuple[set[str], dict[str, float]]:
    """The files the table's current version uses, and those its removes name with when the last
    of them was made (seconds; a remove without deletionTimestamp: now), as paths relative to
    the table's directory."""
    assert snapshot.tombstones is not None
    in_use = {name for add in snapshot.files.values() for name in _named(storage, snapshot.table, add)}
    removed: dict[str, float] = {}
    for remove in snapshot.tombstones.values():
        stamp = remove.get("deletionTimestamp")
        when = now if stamp is None else int(stamp) / 1000
        for name in _named(storage, snapshot.table, remove):
            removed[name] = max(removed.get(name, when), when)
    return in_use, removed


def _named(storage: Storage, table: str, action: Add | Remove) -> list[str]:
    """The files an add or remove action names, its data file and its deletion vector's (unless
    inline), relative to the table's directory as Delta's VACUUM makes them: decoded (paths in
    the log are URIs), an absolute one stripped of the table's own URI. A path outside the
    table is a UserError: its files could not be told in use."""
    names = [_relative(storage, table, action["path"])]
    vector = action.get("deletionVector")
    if vector and vector["storageType"] == "u":
        file = dv.descriptor_file(vector)
        if file:
            names.append(_relative(storage, table, file))
    elif vector and vector["storageType"] == "p":
        names.append(_relative(storage, table, vector["pathOrInlineDv"]))
    return names


def _relative(storage: Storage, table: str, path: str) -> str:
    """path, from the table's log, relative to the table's directory and decoded."""
    name = delta_log.relative_file(storage, table, path)
    if name is None:
        raise UserError(f"{storage.url}/{table}: the log names the file {path!r}, which is outside the table: "
                        f"vacuum cannot tell which of the table's files are in use; nothing vacuumed")
    return name


def table_retention(snapshot: delta_log.Snapshot) -> float:
    """The table's delta.deletedFileRetentionDuration in seconds, RETENTION_SECONDS when unset."""
    return _interval(snapshot, RETENTION, RETENTION_SECONDS)


def log_retention(snapshot: delta_log.Snapshot) -> float:
    """The table's delta.logRetentionDuration in seconds, LOG_RETENTION_SECONDS when unset."""
    return _interval(snapshot, delta_schema.LOG_RETENTION, LOG_RETENTION_SECONDS)


def _interval(snapshot: delta_log.Snapshot, key: str, default: float) -> float:
    """A table property that is an interval ('interval 7 days', Spark's interval syntax) in
    seconds, default when unset."""
    value = snapshot.configuration.get(key)
    if value is None:
        return float(default)
    text = value.strip()
    if text.lower().startswith("interval"):
        text = text[len("interval"):]
    parts = list(_INTERVAL_PART.finditer(text))
    if not parts or "".join(m.group(0) for m in parts).strip() != text.strip():
        raise UserError(f"{snapshot.table}: {key} is {value!r}, not an interval Delta reads (e.g. "
                        f"'interval 7 days'): correct the table's property")
    return sum(int(m[1]) * _INTERVAL_SECONDS[m[2].lower()] for m in parts)


def _in_commit_timestamps_from(snapshot: delta_log.Snapshot) -> int | None:
    """The version from which the table's commits carry in-commit timestamps (None: they don't)."""
    enabled = snapshot.configuration.get("delta.enableInCommitTimestamps", "false").lower() == "true"
    if not enabled or "inCommitTimestamp" not in delta_schema.writer_features(snapshot.protocol):
        return None
    return int(snapshot.configuration.get("delta.inCommitTimestampEnablementVersion", 0))


def _in_commit_timestamp(storage: Storage, entry: Entry) -> float:
    """A commit's inCommitTimestamp in seconds (its commitInfo, the first action); the file's
    modification time if it has none."""
    first = parse_commit(storage.read(entry.path).split(b"\n", 1)[0], f"{storage.url}/{entry.path}")
    stamp = first[0].get("commitInfo", {}).get("inCommitTimestamp") if first else None
    return int(stamp) / 1000 if isinstance(stamp, int) else entry.modified


def clean_log(storage: Storage, snapshot: delta_log.Snapshot, *, retention: float | None = None,
              keep: int | None = None, dry_run: bool = False) -> int:
    """Deletes the log entries of versions older than the log retention (seconds; None: the
    table's), keeping a checkpoint for the oldest version kept (written if the log has none at
    or before it), and temporary files killed writers left; returns the files deleted.

    The oldest version kept is the one current at the retention's start (the last of the
    versions from the log's first on that are all older), or `keep` if older (the version
    _replicator records for the ticks within the window: WarehouseState.kept_versions). A
    version's time is its in-commit timestamp where the table has them (another writer enabled
    the feature), else its commit file's modification time, as Delta's cleanup takes them."""
    now = time.time()
    cutoff = now - (log_retention(snapshot) if retention is None else retention)
    entries = delta_log.log_entries(storage, snapshot.table)
    doomed = [entry for name, entry in entries.items()
              if _LOG_TEMP.fullmatch(name) and now - entry.modified >= STALE_TEMP_SECONDS]
    oldest = None
    stamped_from = _in_commit_timestamps_from(snapshot)
    for name, entry in sorted(entries.items()):
        match = delta_log.COMMIT.fullmatch(name)
        if match:
            version = int(match[1])
            stamped = stamped_from is not None and version >= stamped_from
            if (_in_commit_timestamp(storage, entry) if stamped else entry.modified) > cutoff:
                break
            oldest = version
    if oldest is not None and keep is not None:
        oldest = min(oldest, keep)
    if oldest is not None:
        held = [v for v in delta_log.checkpoints(entries) if v <= oldest]
        if not held and not dry_run and any(int(m[1]) < oldest for name in entries
                                            if (m := delta_log.COMMIT.fullmatch(name))):
            try:
                delta_log.write_checkpoint(storage, snapshot.table, oldest)
                held = [oldest]
            except Exception as exc:   # without it the entries stay: nothing lost
                log.warning("%s: no checkpoint written at version %s, its log is kept whole: %s", snapshot.table,
                            oldest, first_line(exc))
        if held:
            base = max(held)
            doomed += [entry for name, entry in sorted(entries.items())
                       if (m := _LOG_FILE.fullmatch(name)) and int(m[1]) < base]
    for entry in doomed:   # in version order: a reader listing meanwhile finds the log whole from some version
        if not dry_run:
            storage.delete(entry.path)
    return len(doomed)
