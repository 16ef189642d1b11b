"""What the schema change topic says of each table a publisher has published: its names in
order, every topic it has had, whether it is dropped now. A follower with --tables reads it
at start to follow tables rather than names: a table renamed before its first run is read from
each of its topics, one renamed since stays followed under its new name."""

from __future__ import annotations

from dataclasses import dataclass, field

from replicator.targets.kafka.envelope import decode_schema_change
from replicator.targets.kafka.settings import KafkaSettings
from replicator.targets.kafka.state import committed_consumer, data, read_to_end, where


@dataclass
class TableHistory:
    names: dict[int, list[str]] = field(default_factory=dict)    # table id → its names, the current one last
    topics: dict[int, set[str]] = field(default_factory=dict)    # table id → every topic it has had
    dropped: set[int] = field(default_factory=set)               # dropped, not created again since
    first: dict[int, int] = field(default_factory=dict)          # table id → the offset of its first record
    end: int = 0                                                 # the offset after the last record read

    @classmethod
    def read(cls, settings: KafkaSettings, topic: str) -> TableHistory:
        """The history the committed records of the schema change topic tell, to their end now."""
        history = cls()
        consumer = committed_consumer(settings)
        try:
            for message in read_to_end(consumer, topic, 0, "the schema changes", settings.brokers):
                offset = where(message)[2]
                history.note(decode_schema_change(data(message.value())), offset)
                history.end = offset + 1
        finally:
            consumer.close()
        return history

    def note(self, change: dict[str, object], offset: int) -> None:
        table_id = change["table_id"]
        name = change["name"]
        assert isinstance(table_id, int) and isinstance(name, str)
        names = self.names.setdefault(table_id, [])
        if not names or names[-1] != name:
            names.append(name)
        if isinstance(topic := change.get("topic"), str):   # an "event" record names none
            self.topics.setdefault(table_id, set()).add(topic)
        self.first.setdefault(table_id, offset)
        if change["call"] == "drop":
            self.dropped.add(table_id)
        elif change["call"] == "create":
            self.dropped.discard(table_id)

    def current(self, table_id: int) -> str | None:
        """The table's name now; None once dropped."""
        return None if table_id in self.dropped else self.names[table_id][-1]
