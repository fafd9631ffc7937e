"""The origin append: how a site takes a producer's batch into a partition log. Sans I/O.

:func:`append_as_origin` is the whole decision and the one write, over the
``PartitionLog`` port and the partition's ``ProducerStateTable``. The node's
broker calls it for every produced batch (and for the commit records of
consumer groups); the simulator calls it for its producers and consumers, on
``MemoryLog``. In order:

1. **Shape.** The batch is at most ``max_batch_bytes``, is exactly one batch
   (its header's length is the request's length), its CRC-32C matches, and it
   is unstamped: producers never choose coordinates.
2. **Producer.** The idempotent producer's table classifies it
   (``dedup/producer.py``): a retry of one of the producer's last 5 batches is
   answered with the original result and stores nothing; an out-of-order or
   fenced batch is refused; a new one goes on.
3. **Stamp.** The origin (this site's ``site@epoch``) and the next origin seq
   of that origin in this log go into the header, and the CRC is recomputed
   over the header and continued over the records, which are not copied.
4. **Append**, then record the batch in the producer table. A failed append
   (``DiskFull``, ``OSError``) leaves nothing in the log and nothing in the
   table, so a retry of the same batch is a new append, not a duplicate.

Why the next seq comes from the log's vector: the log holds the origin's own
records as a gap-free prefix (I1), so its vector's entry for this origin is
exactly the next seq, across restarts and whatever the local offsets. A crash
that loses unflushed batches also loses their seqs, which are then stamped
again with other records; that is safe only because no reader and no other
site is ever served an unflushed batch (``georep/broker/fetch.py``,
``georep/replication/source.py``).

Errors are the plain exceptions of ``georep/broker/errors.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from dedup.producer import Append, AppendResult, Duplicate, ProducerStateTable
from georep.broker.errors import BatchCrcMismatch, BatchTooLarge, MalformedBatch, SequenceRejected
from georep.record.batch import HEADER_BYTES, REWRITTEN_BYTES, CorruptBatch, compute_crc, parse_header, stamp_origin
from georep.storage.api import PartitionLog
from offsets.coordinates import LocalOffset, Origin


@dataclass(frozen=True, slots=True)
class Produced:
    """What a produce answers: the batch's coordinates, and whether it was a retry of a stored batch."""

    result: AppendResult
    origin: Origin
    duplicate: bool
    records: int

    @property
    def end_offset(self) -> LocalOffset:
        """The local offset after the batch: an ack that needs the batch fsynced waits for this."""
        return LocalOffset(self.result.base_offset + self.records)


def check_batch_shape(batch: bytes | memoryview, topic: str, max_batch_bytes: int) -> None:
    """Raise unless ``batch`` is one whole, CRC-valid, unstamped batch within ``max_batch_bytes``."""
    if len(batch) > max_batch_bytes:
        raise BatchTooLarge(len(batch), max_batch_bytes, topic)
    try:
        header = parse_header(batch)
    except CorruptBatch as exc:
        raise MalformedBatch(f"malformed batch: {exc}") from None
    if header.size_bytes != len(batch):
        raise MalformedBatch(
            f"malformed batch: its header says {header.size_bytes} bytes but the request holds {len(batch)}; "
            "send exactly one batch per request"
        )
    if compute_crc(batch) != header.crc:
        raise BatchCrcMismatch()
    if header.stamped:
        raise MalformedBatch(
            f"batch already carries origin {header.origin} seq {header.base_origin_seq}: producers send "
            "unstamped batches and the receiving site stamps them"
        )


def append_as_origin(
    log: PartitionLog,
    producers: ProducerStateTable,
    origin: Origin,
    batch: bytes | memoryview,
    *,
    topic: str,
    max_batch_bytes: int,
    now_ms: int,
) -> Produced:
    """Validate, deduplicate, stamp and append one producer batch; see the module docstring."""
    check_batch_shape(batch, topic, max_batch_bytes)
    header = parse_header(batch)
    records = header.records_count
    decision = producers.check(header.producer_id, header.producer_epoch, header.base_sequence,
                               header.last_sequence, now_ms)  # fmt: skip
    if isinstance(decision, Duplicate):
        return Produced(decision.result, origin, True, records)
    if not isinstance(decision, Append):
        raise SequenceRejected(decision)
    head, _crc = stamp_origin(batch, origin, log.vector().get(origin, 0))
    stamped = parse_header(head)
    stored = log.append(stamped, (memoryview(head)[REWRITTEN_BYTES:], memoryview(batch)[HEADER_BYTES:]), now_ms)
    result = AppendResult(stored.base_offset, stored.base_origin_seq, stored.last_origin_seq, stored.append_time_ms)
    producers.record(header.producer_id, header.producer_epoch, header.base_sequence, header.last_sequence,
                     result, now_ms)  # fmt: skip
    return Produced(result, origin, False, records)
