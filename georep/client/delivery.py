"""Idempotent delivery for one partition: sequences, the in-flight window, retries.

No I/O: the producer's sender loop feeds it answers and asks it what to send.
Kafka's idempotent producer semantics:

* Each batch carries ``(producer_id, producer_epoch=0, base_sequence)``;
  ``base_sequence`` counts records per partition from 0 and wraps at 2**31.
* The node keeps the last 5 batches per producer and partition, so at most
  ``max_in_flight`` (<= 5) batches are unanswered at any time, and a retry
  re-sends every unanswered batch, in the original order, with the same bytes.
  The node answers a retry of a stored batch with the original result.

A *round* starts when a batch of the partition gets an error or the stream
breaks: the partition stops sending until every batch of the round is
answered, then :meth:`resolve` decides, in sequence order:

* a retriable error (or a broken stream): re-send the same bytes;
* an out-of-order answer after an earlier problem in the round: that batch
  was refused only because of the gap the earlier one left; re-send it;
* an out-of-order answer with nothing wrong before it: the node lost part of
  the sequence (for example an unflushed tail after a crash); fail it;
* a batch that failed for good was not stored, so everything after it would
  leave a gap: the partition moves to a fresh producer id from sequence 0 and
  the later batches get new sequences (and new bytes). Batches before it keep
  their bytes, because the node may hold them.
"""

from __future__ import annotations

from collections import deque

from georep.client.accumulator import BatchState, ProducerBatch
from georep.client.errors import GeoAckTimeout, GeorepError, OutOfOrderSequence

SEQUENCE_MODULUS = 2**31


class PartitionDelivery:
    """The delivery state of one partition."""

    def __init__(self, topic: str, partition: int, producer_id: int, max_in_flight: int) -> None:
        self.topic = topic
        self.partition = partition
        self.producer_id = producer_id
        self.max_in_flight = max_in_flight
        self.next_sequence = 0
        self.queue: deque[ProducerBatch] = deque()  # to send, in order
        self.in_flight: list[ProducerBatch] = []  # sent in this round, in send order
        self.blocked = False  # a round is open: send nothing until it resolves
        self.not_before_ms = 0.0  # retry backoff after a retriable error, set by the shell

    def __repr__(self) -> str:
        return (
            f"PartitionDelivery({self.topic}/{self.partition}, queued={len(self.queue)}, "
            f"in_flight={len(self.in_flight)}, blocked={self.blocked})"
        )

    @property
    def idle(self) -> bool:
        return not self.queue and not self.in_flight

    def unanswered(self) -> int:
        return sum(1 for b in self.in_flight if b.state is BatchState.IN_FLIGHT)

    def enqueue(self, batch: ProducerBatch) -> None:
        batch.state = BatchState.QUEUED
        self.queue.append(batch)

    def take_sendable(self, limit: int | None = None) -> list[ProducerBatch]:
        """Batches to write now (at most ``limit``), in order. New ones get the next sequence; ``data`` None means
        encode."""
        out: list[ProducerBatch] = []
        if self.blocked:
            return out
        self._retire()
        while self.queue and len(self.in_flight) < self.max_in_flight and (limit is None or len(out) < limit):
            batch = self.queue.popleft()
            if batch.base_sequence is None:
                batch.producer_id = self.producer_id
                batch.base_sequence = self.next_sequence
                batch.data = None
                self.next_sequence = (self.next_sequence + len(batch.records)) % SEQUENCE_MODULUS
            batch.state = BatchState.IN_FLIGHT
            batch.sent = True
            self.in_flight.append(batch)
            out.append(batch)
        return out

    def _retire(self) -> None:
        while self.in_flight and self.in_flight[0].state in (BatchState.DONE, BatchState.FAILED):
            self.in_flight.pop(0)

    def on_success(self, batch: ProducerBatch) -> None:
        batch.state = BatchState.DONE
        if not self.blocked:
            self._retire()

    def on_error(self, batch: ProducerBatch, error: GeorepError, now_ms: float, retry_backoff_ms: float) -> bool:
        """The node answered ``batch`` with ``error``; True if it failed for good (the shell fails its futures).

        A retriable error re-sends it after ``retry_backoff_ms``; an out-of-order
        answer is judged when the round resolves; anything else fails it. A
        ``GeoAckTimeout`` fails it too, but the node stored it: for the sequence
        it counts as acknowledged, so the batches after it keep their sequences
        and bytes (re-sequencing them would store them twice if they were stored).
        """
        if isinstance(error, GeoAckTimeout):
            self.on_success(batch)
            return True
        if error.retriable:
            self.on_retriable(batch)
            self.not_before_ms = now_ms + retry_backoff_ms
            return False
        if isinstance(error, OutOfOrderSequence):
            self.on_out_of_order(batch, error)
            return False
        self.on_failed(batch, error)
        return True

    def on_retriable(self, batch: ProducerBatch) -> None:
        batch.state = BatchState.RETRY
        self.blocked = True

    def on_out_of_order(self, batch: ProducerBatch, error: Exception) -> None:
        batch.state = BatchState.OUT_OF_ORDER
        batch.error = error
        self.blocked = True

    def on_failed(self, batch: ProducerBatch, error: Exception) -> None:
        """A non-retriable error: the node did not store the batch. The shell fails its futures."""
        batch.state = BatchState.FAILED
        batch.error = error
        self.blocked = True

    def on_stream_broken(self) -> None:
        """Every unanswered batch may or may not be stored: re-send them all."""
        for batch in self.in_flight:
            if batch.state is BatchState.IN_FLIGHT:
                batch.state = BatchState.RETRY
        if self.in_flight:
            self.blocked = True

    def round_complete(self) -> bool:
        return self.blocked and self.unanswered() == 0

    def resolve(self, fresh_producer_id: int) -> list[ProducerBatch]:
        """Close the round: requeue what to re-send, in order. Returns batches that now failed for good."""
        assert self.round_complete(), "resolve() with answers outstanding"
        resend: list[ProducerBatch] = []
        failed: list[ProducerBatch] = []
        reset_at: int | None = None
        problem = False
        for batch in self.in_flight:
            state = batch.state
            if state is BatchState.DONE:
                continue
            if state is BatchState.FAILED:
                problem = True
                if reset_at is None:
                    reset_at = len(resend)
                continue
            if state is BatchState.OUT_OF_ORDER and not problem:
                batch.state = BatchState.FAILED
                failed.append(batch)
                problem = True
                if reset_at is None:
                    reset_at = len(resend)
                continue
            problem = True
            batch.error = None
            resend.append(batch)
        self.in_flight = []
        if reset_at is not None:
            self._reset(fresh_producer_id, resend[reset_at:])
        for batch in reversed(resend):
            batch.state = BatchState.QUEUED
            self.queue.appendleft(batch)
        self.blocked = False
        return failed

    def _reset(self, fresh_producer_id: int, unstored: list[ProducerBatch]) -> None:
        self.producer_id = fresh_producer_id
        self.next_sequence = 0
        for batch in unstored:
            batch.base_sequence = None
            batch.data = None
            batch.sent = False

    def expire(self, now_ms: float, delivery_timeout_ms: float, fresh_producer_id: int) -> list[ProducerBatch]:
        """Take out queued batches older than the delivery timeout; returns them (the shell fails them).

        Only while nothing is in flight. A batch that was sent may be stored: when
        the oldest such batch expires, every sent batch of the partition expires
        with it (their fate is unknown alike) and the partition moves to a fresh
        producer id, so later batches do not depend on them.
        """
        if self.in_flight or not self.queue:
            return []
        expired: list[ProducerBatch] = []
        sent = [b for b in self.queue if b.sent]
        if sent and now_ms - sent[0].created_ms >= delivery_timeout_ms:
            expired.extend(sent)
            self.queue = deque(b for b in self.queue if not b.sent)
            self._reset(fresh_producer_id, list(self.queue))
        keep: deque[ProducerBatch] = deque()
        for batch in self.queue:
            if now_ms - batch.created_ms >= delivery_timeout_ms:
                expired.append(batch)
            else:
                keep.append(batch)
        self.queue = keep
        for batch in expired:
            batch.state = BatchState.FAILED
        return expired
