"""What the schema change topic says of each table a publisher has published: its names in
order, every topic it has had, whether it is dropped now. A follower with --tables reads it
at start to follow tables rather than names: a table renamed before its first run is read from
each of its topics, one renamed since stays followed under its new name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Message

from replicator.structure import TableStructure
from replicator.targets.kafka.envelope import decode_schema_change
from replicator.targets.kafka.settings import KafkaSettings
from replicator.targets.kafka.state import bad_record, committed_consumer, data, located, read_to_end, where

_FIELDS: dict[str, type | tuple[type, ...]] = {"call": str, "table_id": int, "name": str, "mode": str, "structure": str,
                                               "topic": str, "old_name": str, "event": (dict, type(None))}
_REQUIRED = {"call", "table_id", "name", "mode", "structure"}


def schema_change_of(message: Message) -> dict[str, Any]:
    """The target call a record of the schema change topic holds (decode_schema_change), checked: a record
    that holds none is a located UserError."""
    try:
        change = decode_schema_change(data(message.value()))
        if not isinstance(change, dict):
            raise TypeError("not an object")
        missing = sorted(_REQUIRED - change.keys())
        if missing:
            raise KeyError(", ".join(missing))
        wrong = sorted(name for name, kind in _FIELDS.items() if name in change and not isinstance(change[name], kind))
        if wrong or type(change["table_id"]) is not int:
            raise TypeError(f"{', '.join(wrong or ['table_id'])} of the wrong type")
        TableStructure.from_json(change["structure"]).key_positions()   # its key among its columns
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise bad_record(message, f"is no schema change ({type(exc).__name__}: {exc})") from None
    return change


@dataclass
class TableHistory:
    names: dict[int, list[str]] = field(default_factory=dict)    # table id → its names, the current one last
    topics: dict[int, set[str]] = field(default_factory=dict)    # table id → every topic it has had
    dropped: set[int] = field(default_factory=set)               # dropped, not created again since
    first: dict[int, int] = field(default_factory=dict)          # table id → the offset of its first record
    end: int = 0                                                 # the offset after the last record read

    @classmethod
    def read(cls, settings: KafkaSettings, topic: str, skip: frozenset[str] = frozenset()) -> TableHistory:
        """The history the committed records of the schema change topic tell, to their end now (but the
        records `skip` names: TOPIC:PARTITION:OFFSET)."""
        history = cls()
        consumer = committed_consumer(settings)
        try:
            for message in read_to_end(consumer, topic, 0, "the schema changes", settings.brokers):
                offset = where(message)[2]
                if located(message) in skip:
                    continue
                history.note(schema_change_of(message), offset)
                history.end = offset + 1
        finally:
            consumer.close()
        return history

    def note(self, change: dict[str, Any], offset: int) -> None:
        """A schema change record (decode_schema_change), at that offset."""
        table_id, name = change["table_id"], change["name"]
        names = self.names.setdefault(table_id, [])
        if not names or names[-1] != name:
            names.append(name)
        if "topic" in change:   # an "event" record names none
            self.topics.setdefault(table_id, set()).add(change["topic"])
        self.first.setdefault(table_id, offset)
        if change["call"] == "drop":
            self.dropped.add(table_id)
        elif change["call"] == "create":
            self.dropped.discard(table_id)

    def current(self, table_id: int) -> str | None:
        """The table's name now; None once dropped."""
        return None if table_id in self.dropped else self.names[table_id][-1]
