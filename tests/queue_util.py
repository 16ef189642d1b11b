"""Helpers shared by the queue-engine tests: reading batches back and decoding events.

Events are read the way a consumer reads them (next_batch / batch_events /
finish_batch), never from the event tables directly, so these helpers prove
the consumer's path as well.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any

from replicator.source import Source


@dataclass(frozen=True)
class Event:
    ev_id: int
    txid: int
    type: str
    table: int
    data: Any          # decoded ev_data: list of items (each a list of values), or None
    old: Any = None    # decoded ev_old: the items' old rows (tables with --old-rows), or None

    @property
    def items(self) -> list[list[Any]]:
        return self.data or []


def decode(text: str | None) -> Any:
    """ev_data as JSON, numbers that are not integers as Decimal (exact digits and scale)."""
    return None if text is None else json.loads(text, parse_float=Decimal)


def read_batches(source: Source, queue: str = "q", consumer: str = "c", *, tick: bool = True) -> list[list[Event]]:
    """Optionally ticks the queue, then reads and finishes every batch the
    consumer has pending; returns the events of each batch, in batch order."""
    if tick:
        source.tick(queue, force=True)
    batches: list[list[Event]] = []
    while (batch_id := source.next_batch(queue, consumer)) is not None:
        batches.append([Event(ev_id, txid, ev_type, table, decode(data), decode(old))
                        for ev_id, txid, _time, ev_type, table, data, old in source.batch_events(batch_id)])
        assert source.finish_batch(batch_id)
    return batches


def read_events(source: Source, queue: str = "q", consumer: str = "c") -> list[Event]:
    """Every event committed before now that the consumer has not read, in ev_id order."""
    return [event for batch in read_batches(source, queue, consumer) for event in batch]


CAPTURE_KINDS = ["statement", "row"]   # --capture: the tests parametrized by it expect the same events of both


def by_statement(events: list[Event]) -> list[Event]:
    """The events as a statement capture writes them: the row changes of one transaction,
    table and type merged into their first event, up to the table's next S or T (a row
    capture writes one per row), for tests whose transactions run at most one statement
    of each type on a table between its schema changes."""
    merged: list[Event] = []
    first: dict[tuple[int, int, str], int] = {}
    for e in events:
        key = (e.txid, e.table, e.type)
        if e.type in ("I", "U", "D") and key in first:
            at = merged[first[key]]
            merged[first[key]] = replace(at, data=at.data + e.data, old=None if at.old is None else at.old + e.old)
            continue
        if e.type in ("S", "T"):
            first = {k: i for k, i in first.items() if k[:2] != key[:2]}
        else:
            first[key] = len(merged)
        merged.append(e)
    return merged


def changes(events: list[Event]) -> list[tuple[str, list[list[Any]] | None]]:
    """(type, items) per event; items of an event sorted, as a statement's row order is not defined."""
    return [(e.type, None if e.data is None else sorted(e.data, key=repr)) for e in events]


def apply_events(state: dict[tuple, list[Any]], events: list[Event], key_positions: list[int]) -> None:
    """Replays full-mode events of one table into {key: row}, as a target would."""
    for e in events:
        if e.type == "T":
            state.clear()
        for item in e.items:
            if e.type in ("I", "U"):
                state[tuple(item[p] for p in key_positions)] = item
            elif e.type == "D":
                state.pop(tuple(item), None)
