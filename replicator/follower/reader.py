"""Reading a publisher's partitions up to given offsets, committed records only, with memory bounded:
one consumer assigned by hand to every partition a follower needs, each partition's records
buffered until taken, partitions far ahead of the others paused."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from replicator.targets.kafka.state import where

log = logging.getLogger("replicator")

Partition = tuple[str, int]
BUFFERED = 200000         # records held in all, about: a partition holding its share of them is paused
MIN_SHARE = 500           # the least a partition may hold before it is paused
FETCH = 5000              # records asked of the consumer at a time
# librdkafka stops fetching a partition whose queue holds queued.max.messages.kbytes (64 MiB, about 20,000
# records of a table with schemas) and fetches again fetch.queue.backoff.ms later (1 s by default): a follower
# catching up waited most of that second every 20,000 records (4 s of the 12 s of 210,000)
CONSUMER_SETTINGS = {"fetch.queue.backoff.ms": 10}


class PartitionReader:
    def __init__(self, consumer: Consumer, on_outage: Callable[[str], None]) -> None:
        self.consumer = consumer
        self.on_outage = on_outage
        self._buffers: dict[Partition, deque[tuple[int, Message]]] = {}   # (offset, record)
        self._next: dict[Partition, int] = {}      # offset after the last record buffered
        self._end: dict[Partition, int] = {}       # the partition's end when last reached
        self._paused: set[Partition] = set()

    def assign(self, starts: dict[Partition, int]) -> None:
        """Reads these partitions too, each from its offset; already assigned ones go on where they are."""
        new = {tp: offset for tp, offset in starts.items() if tp not in self._buffers}
        if new:
            self.consumer.incremental_assign([TopicPartition(t, p, offset) for (t, p), offset in new.items()])
            for tp, offset in new.items():
                self._buffers[tp] = deque()
                self._next[tp] = offset

    def forget(self, tp: Partition) -> None:
        """Stops reading tp (its topic may be deleted and made anew): assigned again, it starts afresh."""
        if tp in self._buffers:
            self.consumer.incremental_unassign([TopicPartition(*tp)])
            for held in (self._buffers, self._next, self._end):
                held.pop(tp, None)
            self._paused.discard(tp)

    def available(self, tp: Partition, wait: float) -> list[Message]:
        """Every record of tp committed so far (after those taken), waiting up to `wait` seconds for a first."""
        # the end reached last time may have moved on since: read to the end Kafka reports next. Kafka
        # reports an end once, until a record comes past it: when none came, the end known still is
        known = self._end.pop(tp, None)
        self._fetch(wait, until=lambda: self._fetched_to_end(tp), wanted=tp)
        if tp not in self._end and known is not None and known >= self._next[tp]:
            self._end[tp] = known
        return self._take(tp, None)

    def at_end(self, tp: Partition) -> bool:
        """Whether the last read of tp reached its end (every committed record of it taken)."""
        return self._at_end(tp)

    def end(self, tp: Partition) -> int | None:
        """tp's end, when the last read of it reached it (every committed record of it taken); else None."""
        return self._end[tp] if self._at_end(tp) else None

    def records(self, tp: Partition, last: int, stalled: Callable[[float], None] | None = None) -> Iterator[Message]:
        """The records of tp up to offset last, in order, fetched as they are needed; while none comes,
        stalled(seconds without one) is called about each second (it raises to give up)."""
        buffer = self._buffers[tp]
        idle_since: float | None = None
        while True:
            while buffer:
                if buffer[0][0] > last:
                    return
                idle_since = None
                yield buffer.popleft()[1]
            if self._next[tp] > last or (tp in self._end and self._end[tp] > last and self._at_end(tp)):
                return
            # an end reached before `last` is stale: the transaction's end shows in this partition later
            self._end.pop(tp, None)
            reached = self._next[tp]
            self._fetch(1.0, until=lambda: bool(buffer) or self._next[tp] > last or self._at_end(tp), wanted=tp)
            if not buffer and self._next[tp] == reached:
                idle_since = idle_since or time.monotonic()
                if stalled is not None:
                    stalled(time.monotonic() - idle_since)

    def _take(self, tp: Partition, last: int | None) -> list[Message]:
        buffer = self._buffers[tp]
        taken = []
        while buffer and (last is None or buffer[0][0] <= last):
            taken.append(buffer.popleft()[1])
        return taken

    def _fetched_to_end(self, tp: Partition) -> bool:
        """Whether every committed record of tp is buffered or taken (its records may wait in the buffer)."""
        return self._end.get(tp, -1) >= self._next[tp]

    def _at_end(self, tp: Partition) -> bool:
        return self._fetched_to_end(tp) and not self._buffers[tp]

    def _fetch(self, wait: float, until: Callable[[], bool], wanted: Partition | None = None) -> None:
        """Consumes until `until()` or, when nothing comes, for `wait` seconds at most (once)."""
        self._balance(wanted)
        while not until():
            # consume() waits for all FETCH records or the whole timeout: take what is there, else
            # wait for the first to come
            messages = self.consumer.consume(FETCH, 0)
            if not messages:
                first = self.consumer.poll(wait)
                if first is None:
                    return
                messages = [first]
            for message in messages:
                self._route(message)
            self._balance(wanted)

    def _route(self, message: Message) -> None:
        error = message.error()
        if error is None:   # a record (each one read: where() inlined, a record has all three)
            tp: Partition = (message.topic(), message.partition())  # type: ignore[assignment]
            offset: int = message.offset()  # type: ignore[assignment]
            self._buffers[tp].append((offset, message))
            self._next[tp] = offset + 1
            return
        if error.code() != KafkaError._PARTITION_EOF:
            if error.fatal():
                raise KafkaException(error)
            self.on_outage(error.str())
            return
        topic, partition, end = where(message)   # the partition's end
        self._end[(topic, partition)] = end
        self._next[(topic, partition)] = max(self._next[(topic, partition)], end)

    def _balance(self, wanted: Partition | None) -> None:
        """Pauses partitions holding their share of BUFFERED records (the wanted one never), resumes the
        others."""
        share = max(MIN_SHARE, BUFFERED // max(1, len(self._buffers)))
        full = {tp for tp, buffer in self._buffers.items() if len(buffer) >= share and tp != wanted}
        pause, resume = full - self._paused, self._paused - full
        if pause:
            self.consumer.pause([TopicPartition(t, p) for t, p in pause])
        if resume:
            self.consumer.resume([TopicPartition(t, p) for t, p in resume])
        self._paused = full
