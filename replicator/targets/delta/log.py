"""A Delta table's transaction log: its state at a version, and new commits.

The state of a table is the replay of its log (``_delta_log/``): the newest
checkpoint (Parquet) its listing holds, then the commits after it (JSON, one
action per line). ``_last_checkpoint`` is only a hint the protocol lets a
writer leave out: the listing says which checkpoints exist, and a multi-part
one counts only whole.
What replicator needs of it: the live files (add actions, with their deletion
vectors), the schema and configuration (metaData), the protocol, and the
application transactions (txn: the last version each writer committed, which
makes a retried batch a no-op).

A commit is the next version's JSON file, written only if absent
(Storage.put_if_absent): of two writers of one version, one wins and the other
gets CommitConflict, re-reads the log and tries again. Checkpoints are written
by delta-rs (the deltalake package): every CHECKPOINT_EVERY commits, and one at
the oldest version log cleanup keeps (replicator.targets.delta.maintenance).
"""

from __future__ import annotations

import copy
import json
import re
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.parquet as pq

from replicator.errors import UserError, first_line
from replicator.targets.delta.actions import (
    Action,
    Add,
    MalformedLog,
    Metadata,
    Protocol,
    Remove,
    checked_action,
    configuration_of,
    parse_commit,
)
from replicator.targets.delta.storage import Entry, NotDurable, Storage

LOG_DIR = "_delta_log"
CHECKPOINT_EVERY = 20
ENGINE = "replicator"
COMMIT = re.compile(r"(\d{20})\.json")
_CHECKPOINT = re.compile(r"(\d{20})\.checkpoint(?:\.(\d{10})\.(\d{10}))?\.parquet")
_ABSOLUTE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:|/")   # a URI's scheme, or an absolute path


class CommitConflict(Exception):
    """Another writer committed the version this commit was for."""


class CommitUnknown(UserError):
    """A commit's call failed and whether its version landed is not known (it could not be read
    back, or may not be on disk): nothing it refers to may be deleted; reading the log again
    later tells. reason: the storage's error, in one line."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


# Spark writes timestamps as INT96 by default: read as nanoseconds they overflow past 2262
# (timestamptz 'infinity' is 9999-12-31), as microseconds they are the tables' type
INT96_UNIT = "us"


def read_parquet(data: bytes, columns: list[str] | None = None) -> pa.Table:
    """A whole Parquet file's rows, read on this thread: pyarrow's thread pools reading
    (use_threads, pre_buffer) abort a short-lived process at its exit now and then
    ("terminate called without an active exception")."""
    return pq.read_table(pa.BufferReader(data), columns=columns, use_threads=False, pre_buffer=False,
                         coerce_int96_timestamp_unit=INT96_UNIT)


def parquet_file(source: Any) -> pq.ParquetFile:
    """A data file opened for reading its parts (another writer's INT96 timestamps in microseconds)."""
    return pq.ParquetFile(source, coerce_int96_timestamp_unit=INT96_UNIT)


def commit_path(table: str, version: int) -> str:
    return f"{table}/{LOG_DIR}/{version:020d}.json"


@dataclass
class Snapshot:
    """A table's state at a version (-1: no table yet)."""
    table: str                                        # its directory, relative to the warehouse
    version: int = -1
    protocol: Protocol | None = None
    metadata: Metadata | None = None
    files: dict[str, Add] = field(default_factory=dict)             # path → add action
    txns: dict[str, int] = field(default_factory=dict)              # appId → version
    commits_since_checkpoint: int = 0
    # the remove actions of the files and deletion vectors no longer in the table (by file_key),
    # kept only when load() is asked to (VACUUM: a consumer's snapshot would grow with them)
    tombstones: dict[tuple[str, str | None], Remove] | None = None

    @property
    def exists(self) -> bool:
        return self.version >= 0

    @property
    def schema(self) -> dict[str, Any]:
        if self.metadata is None:
            raise ValueError(f"{self.table}/{LOG_DIR} has no metaData")
        schema: dict[str, Any] = json.loads(self.metadata["schemaString"])
        return schema

    @property
    def configuration(self) -> dict[str, str]:
        return configuration_of(self.metadata)

    def apply(self, actions: Iterable[Action]) -> None:
        """One commit's actions (removes before adds: a commit may remove a file and add it
        again with a new deletion vector)."""
        actions = list(actions)
        for action in actions:
            if "remove" in action:
                self.files.pop(action["remove"]["path"], None)
                if self.tombstones is not None:
                    self.tombstones[file_key(action["remove"])] = action["remove"]
        for action in actions:
            if "add" in action:
                self.files[action["add"]["path"]] = action["add"]
                if self.tombstones is not None:
                    self.tombstones.pop(file_key(action["add"]), None)
            elif "txn" in action:
                self.txns[action["txn"]["appId"]] = action["txn"]["version"]
            elif "metaData" in action:
                self.metadata = action["metaData"]
            elif "protocol" in action:
                self.protocol = action["protocol"]


def file_key(action: Add | Remove) -> tuple[str, str | None]:
    """What an add or remove action names: a data file with its deletion vector (a file whose
    vector grows is removed and added again: the remove keeps the old vector's file in use
    for the versions before)."""
    vector = action.get("deletionVector")
    return action["path"], None if not vector else f"{vector['pathOrInlineDv']}@{vector.get('offset')}"


def load(storage: Storage, table: str, *, tombstones: bool = False) -> Snapshot:
    """The table's latest state (a Snapshot of version -1 when it has no log); with its
    tombstones (the remove actions its checkpoint and later commits hold) if asked."""
    snapshot = Snapshot(table, tombstones={} if tombstones else None)
    log_dir = f"{table}/{LOG_DIR}"
    names = log_names(storage, table)
    versions = sorted(int(m[1]) for name in names if (m := COMMIT.fullmatch(name)))
    start = 0
    whole = checkpoints(names)
    if whole:
        last = max(whole)
        read_checkpoint(storage, snapshot, whole[last])
        start = last + 1
        snapshot.version = last
    for version in versions:
        if version < start:
            continue
        if version != snapshot.version + 1:
            raise ValueError(f"{log_dir} lacks version {snapshot.version + 1} (it has {version}): the table's log "
                             f"is incomplete")
        snapshot.apply(read_commit(storage, table, version))
        snapshot.version = version
        snapshot.commits_since_checkpoint += 1
    return snapshot


def relative_file(storage: Storage, table: str, path: str) -> str | None:
    """The file a path of the table's log names (an add's or a remove's, a deletion vector's),
    relative to the table's directory: decoded (paths in the log are URIs, percent-encoded), an
    absolute one stripped of the table's own URI (as the storage may be named); None when it
    names a file outside the table."""
    name = unquote(path)
    if "\0" in name:   # no file name holds a NUL
        return None
    if _ABSOLUTE.match(path):
        prefixes = [f"{root}/{table}/" for root in storage.roots]
        name = next((name[len(prefix):] for prefix in prefixes if name.startswith(prefix)), "")
    if any(part in ("", ".", "..") for part in name.split("/")):   # '' too: none, or a '/' it starts with
        return None
    return name


def table_file(storage: Storage, table: str, path: str) -> str:
    """The storage path of the file a path of the table's log names (relative_file); a UserError
    when it is outside the table."""
    name = relative_file(storage, table, path)
    if name is None:
        raise UserError(f"{storage.url}/{table}: the log names the file {path!r}, which is outside the table: "
                        f"replicator reads only the table's own files; run OPTIMIZE on the table to rewrite it")
    return f"{table}/{name}"


def metadata_at(storage: Storage, table: str, version: int) -> Metadata:
    """The table's metaData action as of `version`: the last one in the commits up to it, or
    in a checkpoint at or before it. ValueError when the log no longer holds it."""
    for at in range(version, -1, -1):
        try:
            actions = read_commit(storage, table, at)
        except FileNotFoundError:
            found = Snapshot(table)
            parts = checkpoints(log_names(storage, table)).get(at)
            if parts is None:
                raise ValueError(f"{table}/{LOG_DIR} no longer holds version {at}") from None
            read_checkpoint(storage, found, parts)
            if found.metadata is None:
                break
            return found.metadata
        for action in actions[::-1]:
            if "metaData" in action:
                return action["metaData"]
    raise ValueError(f"{table}/{LOG_DIR} has no metadata up to version {version}")


def refresh(storage: Storage, snapshot: Snapshot) -> list[list[Action]]:
    """Brings a snapshot to the latest version; returns the actions of each commit read."""
    commits: list[list[Action]] = []
    while True:
        try:
            actions = read_commit(storage, snapshot.table, snapshot.version + 1)
        except FileNotFoundError:
            return commits
        snapshot.apply(actions)
        snapshot.version += 1
        snapshot.commits_since_checkpoint += 1
        commits.append(actions)


def read_commit(storage: Storage, table: str, version: int) -> list[Action]:
    """The actions of a version's commit (FileNotFoundError: none); MalformedLog, a UserError,
    when one is not a Delta action replicator can read."""
    path = commit_path(table, version)
    return parse_commit(storage.read(path), f"{storage.url}/{path}")


def log_entries(storage: Storage, table: str) -> dict[str, Entry]:
    """The files directly in the table's log directory, by name."""
    log_dir = f"{table}/{LOG_DIR}/"
    return {name: entry for entry in storage.list(log_dir) if "/" not in (name := entry.path[len(log_dir):])}


def log_names(storage: Storage, table: str) -> list[str]:
    """The names of the files directly in the table's log directory."""
    return list(log_entries(storage, table))


def checkpoints(names: Iterable[str]) -> dict[int, list[str]]:
    """Version → the files of its whole checkpoint, of the log's file names: a single file,
    or every part of a multi-part one (a writer killed while writing one leaves it partial).
    Other kinds (V2 checkpoints, named by a UUID) are not replicator's to read."""
    single: set[int] = set()
    parts: dict[tuple[int, int], set[int]] = {}
    for name in names:
        match = _CHECKPOINT.fullmatch(name)
        if match and match[2] is None:
            single.add(int(match[1]))
        elif match:
            parts.setdefault((int(match[1]), int(match[3])), set()).add(int(match[2]))
    found = {version: [f"{version:020d}.checkpoint.parquet"] for version in single}
    for (version, count), present in parts.items():
        if version not in found and present == set(range(1, count + 1)):
            found[version] = [f"{version:020d}.checkpoint.{i:010d}.{count:010d}.parquet" for i in range(1, count + 1)]
    return found


def write_checkpoint(storage: Storage, table: str, version: int | None = None) -> None:
    """Writes a checkpoint of the table at `version` (None: the latest) with delta-rs, which
    leaves _last_checkpoint at the newest one."""
    from deltalake import DeltaTable

    root, options = storage.delta_rs()
    DeltaTable(f"{root}/{table}", version=version, storage_options=options).create_checkpoint()


def read_checkpoint(storage: Storage, snapshot: Snapshot, names: list[str]) -> None:
    """Applies a checkpoint (its files, as checkpoints() gives them) to an empty snapshot."""
    for name in names:
        with storage.open_read(f"{snapshot.table}/{LOG_DIR}/{name}") as f:
            rows = read_parquet(f.read()).to_pylist()
        where = f"{storage.url}/{snapshot.table}/{LOG_DIR}/{name}"
        for number, row in enumerate(rows, 1):
            action = checked_action(_checkpoint_action(row), f"{where} row {number}")
            if "add" in action:
                snapshot.files[action["add"]["path"]] = action["add"]
            elif "remove" in action and snapshot.tombstones is not None:
                snapshot.tombstones[file_key(action["remove"])] = action["remove"]
            elif "txn" in action:
                snapshot.txns[action["txn"]["appId"]] = action["txn"]["version"]
            elif "metaData" in action:
                snapshot.metadata = action["metaData"]
            elif "protocol" in action:
                snapshot.protocol = action["protocol"]


def _checkpoint_action(row: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's row as the JSON action it stands for: its one action that is set (a
    checkpoint's row has a column for each kind), its structs as JSON objects."""
    kind = next((kind for kind in ("add", "remove", "txn", "metaData", "protocol") if row.get(kind)), None)
    if kind == "add":
        return {kind: _checkpoint_add(row[kind])}
    if kind == "protocol":
        return {kind: {k: v for k, v in row[kind].items() if v is not None}}
    return {kind: _maps_as_dicts(row[kind])} if kind is not None else {}


def _maps_as_dicts(value: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's struct as the JSON action it stands for: pyarrow reads a Parquet map as
    a list of (key, value) pairs, and absent fields as None."""
    out = {}
    for key, item in value.items():
        if item is None:
            continue
        if isinstance(item, list) and all(isinstance(p, tuple) and len(p) == 2 for p in item):
            item = dict(item)
        elif isinstance(item, dict):
            item = _maps_as_dicts(item)
        out[key] = item
    return out


def _checkpoint_add(add: dict[str, Any]) -> dict[str, Any]:
    action = _maps_as_dicts({k: v for k, v in add.items() if k not in ("stats_parsed", "partitionValues_parsed")})
    action.setdefault("partitionValues", {})
    return action


def json_text(value: Any) -> str:
    """JSON as the log holds it (a commit's lines, an add's stats): characters as they are (UTF-8),
    never \\u escapes. delta-rs' JSON reader (arrow-json) decodes the surrogate pair escape of a
    character in an even plane (2, 4, ... 16) as the character 0x10000 below it (the pair's bits
    ORed with 0x10000, not added): an escaped string bound would skip files holding values above it."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def commit(storage: Storage, snapshot: Snapshot, actions: Sequence[Action], *, operation: str,
           parameters: dict[str, Any] | None = None) -> int:
    """Writes actions as the snapshot's next version and applies them to it; CommitConflict
    when another writer took that version (the snapshot is left as it was)."""
    txn_id = str(uuid.uuid4())
    info: Action = {"commitInfo": {
        "timestamp": now_ms(), "operation": operation, "operationParameters": parameters or {},
        "readVersion": snapshot.version, "isolationLevel": "Serializable", "isBlindAppend": False,
        "engineInfo": ENGINE, "txnId": txn_id}}
    if snapshot.version < 0:
        info["commitInfo"].pop("readVersion")
    body = "\n".join(json_text(action) for action in [info, *actions]) + "\n"
    version = snapshot.version + 1
    path = commit_path(snapshot.table, version)
    if not _put(storage, path, body.encode(), txn_id):
        raise CommitConflict(f"version {version} of {snapshot.table} was committed by another writer")
    snapshot.apply(copy.deepcopy(list(actions)))
    snapshot.version = version
    snapshot.commits_since_checkpoint += 1
    return version


def _put(storage: Storage, path: str, body: bytes, txn_id: str) -> bool:
    """Writes the commit at path if absent: whether the commit there is this one. A call that
    fails may have written it all the same (an object store's answer lost after its retries):
    the version read back tells. Absent or unreadable, or written but perhaps not on disk (the
    directory's fsync failed: what reads back is the page cache), the outcome is not known:
    CommitUnknown (the caller must not delete what the commit refers to)."""
    try:
        if storage.put_if_absent(path, body):
            return True
    except NotDurable as error:
        reason = first_line(error)
        raise CommitUnknown(f"{storage.url}/{path}: the commit was written but may not be on disk ({reason}): "
                            f"run again: the table's log tells whether it holds it", reason) from error
    except Exception as error:
        try:
            holder = _txn_id_at(storage, path)
        except Exception:
            holder = None
        if holder is None:
            reason = first_line(error)
            raise CommitUnknown(f"{storage.url}/{path}: the commit failed and whether it landed is not known "
                                f"({reason}): run again: the table's log tells", reason) from error
        return holder == txn_id
    # an object store's conditional PUT whose answer was lost is retried by the client, and the
    # retry finds the first attempt's object
    return _txn_id_at(storage, path) == txn_id


def _txn_id_at(storage: Storage, path: str) -> str | None:
    """The txnId of the commit at path ('' for none, or another writer's unreadable commit);
    None when there is no commit there."""
    try:
        first = parse_commit(storage.read(path), path)[:1]
    except FileNotFoundError:
        return None
    except MalformedLog:
        return ""
    return str(first[0].get("commitInfo", {}).get("txnId") or "") if first else ""


def now_ms() -> int:
    return int(time.time() * 1000)
