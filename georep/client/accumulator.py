"""Producer batches and the record accumulator (no I/O, no clock: time comes in as ``now_ms``).

``send`` appends a record to the open batch of its partition. A batch closes
when the next record would take it past ``batch_size`` bytes, or when it has
been open for ``linger_ms``, or on flush. Closed batches wait in ``closed``,
in closing order, until the sender takes them.
"""

from __future__ import annotations

import enum
from typing import Any

from georep.record.batch import HEADER_BYTES, RecordInput

# Fixed bytes of one encoded record besides key, value and headers
# (length, attributes, timestamp delta, offset delta, key/value lengths, header count).
RECORD_OVERHEAD_BYTES = 29


def record_size(key: bytes | None, value: bytes | None, headers: Any) -> int:
    """Encoded size of one record, uncompressed; headers estimated from their lengths."""
    size = RECORD_OVERHEAD_BYTES
    if key is not None:
        size += len(key)
    if value is not None:
        size += len(value)
    if headers:
        for hk, hv in headers:
            size += 8 + len(hk) + (len(hv) if hv is not None else 0)
    return size


class BatchState(enum.Enum):
    OPEN = "open"  # accepting records
    QUEUED = "queued"  # closed, waiting to be sent (or re-sent)
    IN_FLIGHT = "in_flight"  # written to the stream, no answer yet
    RETRY = "retry"  # a retriable error or a broken stream: re-send with the same bytes
    OUT_OF_ORDER = "out_of_order"  # the node saw a sequence gap
    DONE = "done"  # acknowledged
    FAILED = "failed"  # failed for good; its futures carry the error


class ProducerBatch:
    """Records for one partition, their futures, and their delivery state."""

    __slots__ = (
        "topic",
        "partition",
        "records",
        "futures",
        "size_bytes",
        "capacity",
        "created_ms",
        "state",
        "producer_id",
        "base_sequence",
        "data",
        "correlation_id",
        "sent",
        "sent_ms",
        "error",
        "done",
        "request",
    )

    def __init__(self, topic: str, partition: int, created_ms: float, capacity: int) -> None:
        self.topic = topic
        self.partition = partition
        self.records: list[RecordInput] = []
        self.futures: list[Any] = []
        self.size_bytes = HEADER_BYTES
        self.capacity = capacity  # batch_size, or the topic's max_batch_bytes if smaller
        self.created_ms = created_ms
        self.state = BatchState.OPEN
        self.producer_id = -1
        self.base_sequence: int | None = None  # assigned when first sent
        self.data: bytes | None = None  # the encoded batch; resends reuse these bytes
        self.correlation_id = 0
        self.sent = False  # written at least once with the current sequence: the node may hold it
        self.sent_ms = 0.0
        self.error: Exception | None = None
        self.done: Any = None  # set by the shell: completes when the batch is acked or failed
        self.request: Any = None  # set by the shell: the request (stream message) it was last written in

    def __repr__(self) -> str:
        return (
            f"ProducerBatch({self.topic}/{self.partition}, {len(self.records)} records, "
            f"{self.state.value}, pid={self.producer_id}, seq={self.base_sequence})"
        )


class RecordAccumulator:
    """Open batches per (topic, partition), and the closed ones in closing order.

    ``open`` keeps its batches in the order they were opened (a closed batch's key is removed, so a new batch
    goes to the end), which is the order of their linger deadlines: closing the lingered ones and finding the
    next deadline look only at the oldest, not at every open batch. At 10,000 partitions written in turn the
    sender wakes for every answer, and walking 10,000 open batches each time dominated the producer.
    A batch that fills up is kept apart (``full``) until the sender takes it."""

    def __init__(self, batch_size: int, linger_ms: float) -> None:
        self.batch_size = batch_size
        self.linger_ms = linger_ms
        self.open: dict[tuple[str, int], ProducerBatch] = {}
        self.closed: list[ProducerBatch] = []
        self.full: list[ProducerBatch] = []  # open batches that reached their capacity
        self.held_for_room = False  # the last close_lingered left a due batch open because of its limit

    def append(
        self,
        topic: str,
        partition: int,
        record: RecordInput,
        future: Any,
        size: int,
        now_ms: float,
        *,
        max_batch_bytes: int,
    ) -> ProducerBatch | None:
        """Add a record. Returns the batch just opened for it, if a new one was opened.

        A batch that this record would overflow is closed first (into ``closed``).
        A batch holds at most ``batch_size`` bytes, or the topic's
        ``max_batch_bytes`` if smaller; the caller refuses a record that alone
        would pass ``max_batch_bytes``.
        """
        key = (topic, partition)
        batch = self.open.get(key)
        opened = None
        if batch is None or (batch.size_bytes + size > batch.capacity and batch.records):
            if batch is not None:
                del self.open[key]  # the new batch goes to the end: ``open`` stays in opening order
                batch.state = BatchState.QUEUED
                self.closed.append(batch)
            capacity = min(self.batch_size, max_batch_bytes)
            batch = opened = self.open[key] = ProducerBatch(topic, partition, now_ms, capacity)
        batch.records.append(record)
        batch.futures.append(future)
        batch.size_bytes += size
        if batch.size_bytes >= batch.capacity:
            self.full.append(batch)
        return opened

    def close(self, batch: ProducerBatch) -> None:
        """Close one open batch now (the sticky partitioner does, before it would overflow)."""
        del self.open[(batch.topic, batch.partition)]
        batch.state = BatchState.QUEUED
        self.closed.append(batch)

    def close_lingered(self, now_ms: float, force: bool = False, limit: int | None = None) -> list[ProducerBatch]:
        """Close open batches older than ``linger_ms`` (all of them with ``force``) and full ones, oldest first.

        ``limit``: close at most that many lingered batches (full ones close whatever it says), the oldest; the
        others stay open and keep taking records, as Kafka's accumulator keeps a lingered batch open until its
        node has room for it (the producer's ``linger_room``); ``held_for_room`` then says so, and the sender
        waits for an answer rather than for a deadline that has passed."""
        linger = self.linger_ms
        due: list[ProducerBatch] = []
        self.held_for_room = False
        for batch in self.open.values():  # in opening order: the first one still lingering ends the walk
            if not force and now_ms - batch.created_ms < linger:
                break
            if limit is not None and len(due) >= limit:
                self.held_for_room = True
                break
            due.append(batch)
        full, self.full = self.full, []
        if full:
            taken = {id(b) for b in due}
            due.extend(b for b in full if b.state is BatchState.OPEN and id(b) not in taken)
            due.sort(key=lambda b: b.created_ms)
        for batch in due:
            del self.open[(batch.topic, batch.partition)]
            batch.state = BatchState.QUEUED
            self.closed.append(batch)
        return due

    def next_linger_deadline_ms(self) -> float | None:
        for batch in self.open.values():  # the oldest: opening order is deadline order
            return batch.created_ms + self.linger_ms
        return None

    def take_closed(self) -> list[ProducerBatch]:
        closed, self.closed = self.closed, []
        return closed
