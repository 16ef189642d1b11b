"""The names of what the views keep: in the replica (their catalog, a view's storage, the helper
indexes on base tables, the storage's hidden columns) and in TEMP (a base table's delta and
capture triggers, a view's work tables). Every module takes a name from here, so that all derive
it alike; names made from a table's or a view's name hash it (any length, any characters)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

VIEWS = "_replicator_views"                # the catalog: a view's definition, plan and state
REFRESHES = "_replicator_view_refresh"     # the refresh log
STORAGE_PREFIX = "_replicator_mv_"         # + a view's name: the table of its rows
INDEX_PREFIX = "_replicator_ix_"           # helper indexes on base tables
GEN_COLUMN = "_replicator_gen"     # the refresh that last wrote a storage row
GEN_COLUMN_Q = '"_replicator_gen"'
SIGN_COLUMN = "_replicator_sign"   # delta rows: +1 a new row, -1 an old one
ROW_COLUMN = "_replicator_row"     # storage keyed by its root table's INTEGER PRIMARY KEY: that key


def _hashed(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def helper_index(table: str, columns: Sequence[str]) -> str:
    return INDEX_PREFIX + _hashed(table.lower() + "\0" + "\0".join(c.lower() for c in columns))


def delta_table(table: str) -> str:
    """TEMP: the old and new rows of a base table's changes in the transaction."""
    return f"_replicator_d_{_hashed(table.lower())}"


def changed_keys_table(table: str) -> str:
    """TEMP: the keys of a base table's changed rows (row views)."""
    return f"_replicator_p_{_hashed(table.lower())}"


def capture_trigger(table: str) -> str:
    """TEMP: the prefix of the triggers that write a base table's delta."""
    return f"_replicator_t_{_hashed(table.lower())}"


def keys_table(view: str) -> str:
    """TEMP: a view's affected keys (rowids, for a rooted row view)."""
    return f"_replicator_k_{_hashed(view.lower())}"


def rows_table(view: str) -> str:
    """TEMP: a rooted row view's recomputed rows."""
    return f"_replicator_n_{_hashed(view.lower())}"


def fold_table(view: str) -> str:
    """TEMP: a batch's folded groups of an aggregate view."""
    return f"_replicator_a_{_hashed(view.lower())}"
