"""The capture of a batch's changes to the views' base tables: TEMP triggers copy the old and
new rows of each change into a TEMP delta table of the table's columns (and declared types: the
same affinities) and a sign, and the tables the transaction wrote are noted.

INSERT OR REPLACE does not report the row it replaces: a BEFORE INSERT trigger reads it by key
instead of `recursive_triggers`, with which SQLite's REPLACE fires a real delete per replaced row
(measured about 1.5x the apply cost)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable

from replicator.targets.sqlite.views import names
from replicator.targets.sqlite.views.names import SIGN_COLUMN
from replicator.targets.sqlite.views.sql import quote
from replicator.targets.sqlite.views.temp import ensure_temp
from replicator.views.analysis import Analysis

_TRIGGERS = ("_b", "_i", "_d", "_u")   # BEFORE INSERT (the row replaced), AFTER INSERT, DELETE, UPDATE


class Capture:
    """The capture triggers installed on the target's connection, and the tables its transaction
    under way wrote."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self.armed: set[str] = set()     # tables whose capture triggers are installed (lower case)
        self.written: set[str] = set()   # tables written in this transaction (lower case)

    def arm(self, tables: Iterable[str]) -> None:
        """Installs the capture triggers of these tables, and removes those of any other."""
        needed = {t.lower(): t for t in tables}
        for low in list(self.armed - set(needed)):
            self.disarm(low)
        for low, table in needed.items():
            if low in self.armed:
                continue
            self.ensure_delta(table)
            delta = quote(names.delta_table(table))
            info = self.db.execute(f"PRAGMA main.table_info({quote(table)})").fetchall()
            columns = [r[1] for r in info]
            key = [r[1] for r in sorted((r for r in info if r[5]), key=lambda r: r[5])]
            new = ", ".join(f"NEW.{quote(c)}" for c in columns) + ", 1"
            old = ", ".join(f"OLD.{quote(c)}" for c in columns) + ", -1"
            trigger = names.capture_trigger(low)
            target = f"main.{quote(table)}"
            # INSERT OR REPLACE deletes the row it replaces without firing DELETE triggers
            # (unless recursive_triggers, which makes REPLACE much slower): the row about
            # to be replaced is read by key before the insert instead.
            # `=`, not IS: a NULL in a key never conflicts, so nothing is replaced then.
            match = " AND ".join(f"{quote(k)} = NEW.{quote(k)}" for k in key)
            self.db.execute(f"CREATE TEMP TRIGGER IF NOT EXISTS {quote(trigger + '_b')} BEFORE INSERT ON {target}"
                            f" BEGIN INSERT INTO {delta} SELECT {', '.join(quote(c) for c in columns)}, -1"
                            f" FROM {target} WHERE {match}; END")
            self.db.execute(f"CREATE TEMP TRIGGER IF NOT EXISTS {quote(trigger + '_i')} AFTER INSERT ON {target}"
                            f" BEGIN INSERT INTO {delta} VALUES ({new}); END")
            self.db.execute(f"CREATE TEMP TRIGGER IF NOT EXISTS {quote(trigger + '_d')} AFTER DELETE ON {target}"
                            f" BEGIN INSERT INTO {delta} VALUES ({old}); END")
            self.db.execute(f"CREATE TEMP TRIGGER IF NOT EXISTS {quote(trigger + '_u')} AFTER UPDATE ON {target}"
                            f" BEGIN INSERT INTO {delta} VALUES ({old}); INSERT INTO {delta} VALUES ({new}); END")
            self.armed.add(low)

    def disarm(self, low: str) -> None:
        """Removes the capture triggers of a table (lower case name)."""
        trigger = names.capture_trigger(low)
        for suffix in _TRIGGERS:
            self.db.execute(f"DROP TRIGGER IF EXISTS temp.{quote(trigger + suffix)}")
        self.armed.discard(low)

    def ensure_delta(self, table: str) -> None:
        """TEMP table of the base table's columns and declared types (same affinities)."""
        columns = [(r[1], r[2] or "") for r in self.db.execute(f"PRAGMA main.table_info({quote(table)})")]
        # its triggers go first: none may be left writing into a table that is not there
        ensure_temp(self.db, names.delta_table(table), [*columns, (SIGN_COLUMN, "INTEGER")],
                    before=lambda: self.disarm(table.lower()))

    def wrote(self, table: str) -> None:
        self.written.add(table.lower())

    def bypass(self, table: str) -> None:
        """The table is about to be written without capture (a TRUNCATE, a schema change): its
        triggers go, and it counts as written; its views cannot be refreshed from its delta."""
        low = table.lower()
        self.disarm(low)
        self.written.add(low)

    def changed(self, a: Analysis) -> set[int]:
        """The occurrences of a view's query whose tables the transaction wrote."""
        return {i for i, o in enumerate(a.occurrences) if o.table.name.lower() in self.written}

    def captured(self, table: str) -> bool:
        """Whether the table's changes are in its delta (its triggers are installed)."""
        return table.lower() in self.armed

    def empty_deltas(self) -> None:
        """Once the views are refreshed: the next transaction's deltas start empty."""
        for table in self.armed:
            self.db.execute(f"DELETE FROM temp.{quote(names.delta_table(table))}")

    def forget_writes(self) -> None:
        self.written.clear()

    def rolled_back(self) -> None:
        """The TEMP objects are back as they were before the transaction: no trigger is known
        to be installed (the next transaction installs them again)."""
        self.armed.clear()
        self.written.clear()
