"""The ViewStore protocol: what every target that keeps incremental views offers the `view` commands."""

from __future__ import annotations

import builtins
import re
from typing import Any, Protocol

from replicator.errors import UserError
from replicator.structure import RESERVED_PREFIXES

POLICIES = ("auto", "incremental", "full")


class ViewStore(Protocol):
    """A target's incremental views (SQLite: targets/sqlite/views/, Delta: targets/delta/views.py)."""

    def create(self, name: str, sql: str, policy: str = "auto") -> dict[str, Any]:
        """Defines view NAME by its query, fills it, and returns its info."""
        ...
    def drop(self, name: str) -> None: ...
    def refresh_now(self, name: str, *, full: bool = False) -> tuple[dict[str, Any], bool]:
        """Brings the view up to date now; returns its info and whether it was recomputed in full."""
        ...
    def info(self, name: str) -> dict[str, Any]: ...
    def list(self) -> builtins.list[dict[str, Any]]: ...   # (in the class, `list` is this method)
    def refreshes(self, name: str, limit: int = 20) -> builtins.list[dict[str, Any]]:
        """The view's latest refreshes, newest first."""
        ...
    def explain(self, sql: str, policy: str = "auto") -> dict[str, Any]:
        """How a view of this query would be kept current, without creating it."""
        ...


def check_name(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,62}", name or ""):
        raise UserError(f"invalid view name {name!r}: use letters, digits and _ (not starting with a digit)")
    if name.lower().startswith(RESERVED_PREFIXES):
        raise UserError(f"invalid view name {name!r}: names starting with _replicator or sqlite_ are reserved")
    return name


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise UserError(f"invalid policy {policy!r}: use {', '.join(POLICIES)}")
    return policy
