"""The actions of a Delta table's log, as the Delta protocol (PROTOCOL.md) names their fields, and
the check that turns an entry read from storage into one.

A log is written by other engines too (Spark, delta-rs...): what is read from it is checked at the
parse boundary (parse_commit, checked_action) for the fields replicator relies on, and a malformed
entry refused in one line, rather than failing later, far from it. Fields replicator does not read
are left as they come (a writer may add its own).
"""

from __future__ import annotations

import json
from typing import Any, NotRequired, TypedDict, cast

from replicator.errors import UserError


class DeletionVector(TypedDict):
    """A deletion vector's descriptor (an add's or a remove's ``deletionVector``)."""
    storageType: str              # 'u': a file named by a UUID, 'p': a path, 'i': inline
    pathOrInlineDv: str
    offset: NotRequired[int | None]   # in its file (absent for an inline one)
    sizeInBytes: int
    cardinality: int              # the rows it marks deleted


class Add(TypedDict):
    path: str                     # a URI relative to the table's directory (or absolute)
    partitionValues: dict[str, str | None]
    size: int
    modificationTime: int
    dataChange: bool
    stats: NotRequired[str | None]    # a Stats, as JSON
    tags: NotRequired[dict[str, str] | None]
    deletionVector: NotRequired[DeletionVector | None]


class Remove(TypedDict):
    path: str
    dataChange: bool
    deletionTimestamp: NotRequired[int | None]
    extendedFileMetadata: NotRequired[bool]
    partitionValues: NotRequired[dict[str, str | None]]
    size: NotRequired[int | None]
    stats: NotRequired[str | None]
    tags: NotRequired[dict[str, str] | None]
    deletionVector: NotRequired[DeletionVector | None]


class Format(TypedDict):
    provider: str
    options: NotRequired[dict[str, str]]


class Metadata(TypedDict):
    id: str
    name: NotRequired[str | None]
    description: NotRequired[str | None]
    format: Format
    schemaString: str             # the table's schema, as JSON
    partitionColumns: list[str]
    createdTime: NotRequired[int | None]
    configuration: dict[str, str]


class Protocol(TypedDict):
    minReaderVersion: int
    minWriterVersion: int
    readerFeatures: NotRequired[list[str]]
    writerFeatures: NotRequired[list[str]]


class Txn(TypedDict):
    """An application transaction: the last version (for replicator, tick) appId committed."""
    appId: str
    version: int
    lastUpdated: NotRequired[int]


class CommitInfo(TypedDict, total=False):
    """Free-form provenance (the protocol fixes only inCommitTimestamp); these are what replicator
    writes and reads."""
    timestamp: int
    inCommitTimestamp: int
    operation: str
    operationParameters: dict[str, Any]
    readVersion: int
    isolationLevel: str
    isBlindAppend: bool
    engineInfo: str
    txnId: str


class DomainMetadata(TypedDict):
    domain: str
    configuration: str
    removed: bool


class Action(TypedDict, total=False):
    """One line of a commit: one of these keys (a kind replicator does not read, such as cdc or
    checkpointMetadata, is kept as it comes)."""
    add: Add
    remove: Remove
    metaData: Metadata
    protocol: Protocol
    txn: Txn
    commitInfo: CommitInfo
    domainMetadata: DomainMetadata


class Stats(TypedDict):
    """A data file's statistics (an add's ``stats``, parsed)."""
    numRecords: int
    minValues: NotRequired[dict[str, Any]]
    maxValues: NotRequired[dict[str, Any]]
    nullCount: NotRequired[dict[str, Any]]
    tightBounds: NotRequired[bool]


# The fields replicator relies on, by action: the types a value may have, and whether it is required
# (an optional one may be null too). bool is not an int here: JSON's true is not a size.
_Field = tuple[tuple[type, ...], bool]
_NULL = type(None)


def _required(kind: type) -> _Field:
    return (kind,), True


def _optional(kind: type) -> _Field:
    return (kind, _NULL), False


_VECTOR = {"storageType": _required(str), "pathOrInlineDv": _required(str), "offset": _optional(int),
           "cardinality": _required(int)}
_FIELDS: dict[str, dict[str, _Field]] = {
    "add": {"path": _required(str), "size": _required(int), "dataChange": _required(bool),
            "stats": _optional(str), "deletionVector": _optional(dict)},
    "remove": {"path": _required(str), "dataChange": _required(bool), "size": _optional(int),
               "deletionTimestamp": _optional(int), "deletionVector": _optional(dict),
               "tags": _optional(dict)},   # a portable rewrite's (rewrite.told_rewrite reads them)
    "metaData": {"id": _required(str), "schemaString": _required(str), "configuration": _optional(dict),
                 "createdTime": _optional(int)},
    "protocol": {"minReaderVersion": _required(int), "minWriterVersion": _required(int),
                 "readerFeatures": _optional(list), "writerFeatures": _optional(list)},
    "txn": {"appId": _required(str), "version": _required(int)},
    "commitInfo": {},
}
_JSON_TYPES = {str: "a string", int: "an integer", bool: "a boolean", dict: "an object", list: "an array",
               _NULL: "null"}


class MalformedLog(UserError):
    """An entry of a table's log that is not a Delta action as the protocol defines it."""


def parse_commit(data: bytes, where: str) -> list[Action]:
    """A commit file's actions, one a line, each checked (checked_action); where: the file, for
    the refusal."""
    actions = []
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as error:
            raise MalformedLog(_refusal(f"{where} line {number}", f"it is not JSON ({error})")) from None
        actions.append(checked_action(value, f"{where} line {number}"))
    return actions


def checked_action(value: object, where: str) -> Action:
    """value as an Action, when the fields replicator relies on are there with their types; else
    MalformedLog, naming where it is (a commit's line, a checkpoint)."""
    if not isinstance(value, dict):
        raise MalformedLog(_refusal(where, f"it is {_json_type(value)}, not an object"))
    for kind, fields in _FIELDS.items():
        if kind in value:
            _check(value[kind], fields, kind, where)
            vector = value[kind].get("deletionVector")
            if vector is not None:
                _check(vector, _VECTOR, f"{kind}.deletionVector", where)
    return cast(Action, value)   # checked above, field by field


def configuration_of(metadata: Metadata | None) -> dict[str, str]:
    """A metaData's configuration ({} for none: another writer may leave it null)."""
    return (metadata.get("configuration") or {}) if metadata is not None else {}


def records(add: Add | Remove) -> int | None:
    """The rows of a file as its stats count them (None: no stats, or no numRecords)."""
    text = add.get("stats")
    if not text:
        return None
    stats = json.loads(text)
    count = stats.get("numRecords") if isinstance(stats, dict) else None
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def _check(value: object, fields: dict[str, _Field], name: str, where: str) -> None:
    if not isinstance(value, dict):
        raise MalformedLog(_refusal(where, f"its {name} is {_json_type(value)}, not an object"))
    for field, (types, required) in fields.items():
        if field not in value:
            if required:
                raise MalformedLog(_refusal(where, f"its {name} has no {field}"))
            continue
        item = value[field]
        if not isinstance(item, types) or (isinstance(item, bool) and bool not in types):
            wanted = " or ".join(_JSON_TYPES[t] for t in types)
            raise MalformedLog(_refusal(where, f"its {name}.{field} is {_json_type(item)}, not {wanted}"))


def _json_type(value: object) -> str:
    return next((name for kind, name in reversed(_JSON_TYPES.items()) if isinstance(value, kind)),
                type(value).__name__)


def _refusal(where: str, why: str) -> str:
    return (f"{where} is not a Delta log entry replicator can read: {why}; repair the table's log with the "
            f"writer that made it, or restore the file")
