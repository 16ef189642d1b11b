"""A view's result: a Delta table of the warehouse, with the view's record in it.

View NAME is the Delta table ``URI/_views/<name>`` (the name in lower case),
written by replicator's own writer (replicator.targets.delta.table: deletion
vectors, column mapping) and keyed by the view's keys: a refresh upserts the
rows it recomputed and deletes the keys that are gone, as a batch does to a
table. Any Delta reader reads it as it is. Its columns are the query's, plus,
for a key the query does not select (a row view's base keys, a GROUP BY
expression left out of the select list), a column ``_replicator_k...``.

The view's record is the table's own configuration (``replicator.table``: the
definition, the plan, the version of each table it reflects, its tick, its
state and its last refreshes), so it commits with the rows; each refresh's
record is also its commit's operationParameters (DESCRIBE HISTORY shows it).
A dropped view's table loses its record and its rows (its log stays, for
time travel, until VACUUM); a view created again under its name is a new
version of the same table.
"""

from __future__ import annotations

from typing import Any

from replicator.structure import Column, TableStructure
from replicator.targets.delta import log as delta_log
from replicator.targets.delta.actions import records
from replicator.targets.delta.schema import DELTA_TYPED
from replicator.targets.delta.storage import Storage
from replicator.targets.delta.table import ReplicaTable

VIEWS_DIR = "_views"
VIEW = "view"   # the key of the view's record in the table's record


def view_directory(name: str) -> str:
    return f"{VIEWS_DIR}/{name.lower()}"


def view_directories(storage: Storage) -> list[str]:
    """The directories under _views that hold a Delta table (dropped views' too)."""
    found = set()
    for entry in storage.list(VIEWS_DIR):
        parts = entry.path.split("/")
        if len(parts) == 4 and parts[0] == VIEWS_DIR and parts[2] == delta_log.LOG_DIR:
            found.add(f"{parts[0]}/{parts[1]}")
    return sorted(found)


def view_structure(name: str, columns: list[tuple[str, str]], key: list[str]) -> TableStructure:
    """A view table's structure: its columns (name, Delta type) and key columns."""
    return TableStructure(schema=VIEWS_DIR, name=name, key=tuple(key), columns=tuple(
        Column(name=n, type=t, base_type=DELTA_TYPED, category="X", not_null=False, attnum=i + 1)
        for i, (n, t) in enumerate(columns)))


class ViewTable:
    """A view's Delta table and record."""

    def __init__(self, storage: Storage, directory: str, *, portable: bool = False) -> None:
        """portable: the kind of the table when this creates it (the warehouse's)."""
        self.table = ReplicaTable(storage, directory, portable=portable)

    @property
    def directory(self) -> str:
        return self.table.directory

    @property
    def entry(self) -> dict[str, Any] | None:
        """The view's record (None: no view here, or a dropped one)."""
        meta = self.table.meta
        entry: dict[str, Any] | None = meta.get(VIEW) if meta else None
        return entry

    def meta(self, entry: dict[str, Any], structure: TableStructure) -> dict[str, Any]:
        """The table's record holding the view's."""
        return {"structure": structure.to_json(), VIEW: entry,
                "description": f"replicator view {entry['name']}: {entry['sql']}"}

    def reload(self) -> bool:
        """Reads the commits other writers made since (`view` commands, the consumer);
        True when there were any."""
        if delta_log.refresh(self.table.storage, self.table.snapshot):
            self.table.index = None
            return True
        return False

    def rows(self) -> int:
        """The rows the view holds: its files' rows less their deleted ones."""
        total = 0
        for add in self.table.snapshot.files.values():
            vector = add.get("deletionVector")
            total += (records(add) or 0) - (vector["cardinality"] if vector else 0)
        return total
