"""The origin append: how a site takes a producer's batch into a partition log. Sans I/O.

:func:`append_as_origin` is the whole decision and the one write, over the
``PartitionLog`` port and the partition's ``ProducerStateTable``. The node's
broker calls it for every produced batch (and for the commit records of
consumer groups); the simulator calls it for its producers and consumers, on
``MemoryLog``. In order:

1. **Validation.** The batch is at most ``max_batch_bytes``, is exactly one
   batch (its header's length is the request's length), its CRC-32C matches,
   its records are what its header says, decompressed into at most
   ``max_batch_bytes``, and their timestamps are within the topic's limits
   around ``now_ms`` (``georep/record/validate.py`` lists every check). And it
   is unstamped: producers never choose coordinates. A site never stores what
   it could not serve.
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
from georep.broker.errors import (
    BatchCrcMismatch,
    BatchTooLarge,
    DecompressedTooLarge,
    InvalidRecords,
    MalformedBatch,
    SequenceRejected,
    TimestampRefused,
)
from georep.record.batch import HEADER_BYTES, REWRITTEN_BYTES, BatchHeader, CorruptBatch, parse_header, stamp_origin
from georep.record.validate import (
    CrcMismatch,
    InvalidBatch,
    RecordsTooLarge,
    TimestampOutOfRange,
    TimestampWindow,
    validate_batch,
)
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


def check_batch_shape(
    batch: bytes | memoryview, topic: str, max_batch_bytes: int, window: TimestampWindow | None = None
) -> BatchHeader:
    """The header of ``batch`` if it is one whole, valid, unstamped batch within ``max_batch_bytes`` (see the
    module docstring); raises otherwise. ``window``: the topic's limits on record timestamps around this site's
    clock."""
    if len(batch) > max_batch_bytes:
        raise BatchTooLarge(len(batch), max_batch_bytes, topic)
    try:
        header = validate_batch(batch, max_batch_bytes, window).header
    except RecordsTooLarge:
        raise DecompressedTooLarge(max_batch_bytes, topic) from None
    except TimestampOutOfRange as exc:
        raise TimestampRefused(f"batch refused by topic {topic!r}: {exc}") from None
    except InvalidBatch as exc:
        raise InvalidRecords(
            f"invalid batch for topic {topic!r}: {exc}. Nothing was stored: the producer "
            "encoded a batch georep cannot serve; fix or replace that producer"
        ) from None
    except CrcMismatch:
        raise BatchCrcMismatch() from None
    except CorruptBatch as exc:
        raise MalformedBatch(f"malformed batch: {exc}; send exactly one batch per request") from None
    if header.stamped:
        raise MalformedBatch(
            f"batch already carries origin {header.origin} seq {header.base_origin_seq}: producers send "
            "unstamped batches and the receiving site stamps them"
        )
    return header


def append_as_origin(
    log: PartitionLog,
    producers: ProducerStateTable,
    origin: Origin,
    batch: bytes | memoryview,
    *,
    topic: str,
    max_batch_bytes: int,
    now_ms: int,
    window: TimestampWindow | None = None,
) -> Produced:
    """Validate, deduplicate, stamp and append one producer batch; see the module docstring. ``window`` holds
    ``now_ms`` too, with the topic's timestamp limits (the simulator, whose clocks skew freely, gives none)."""
    header = check_batch_shape(batch, topic, max_batch_bytes, window)
    records = header.records_count
    decision = producers.check(
        header.producer_id, header.producer_epoch, header.base_sequence, header.last_sequence, now_ms
    )
    if isinstance(decision, Duplicate):
        return Produced(decision.result, origin, True, records)
    if not isinstance(decision, Append):
        raise SequenceRejected(decision)
    head, _crc = stamp_origin(batch, origin, log.vector().get(origin, 0))
    stamped = parse_header(head)
    stored = log.append(stamped, (memoryview(head)[REWRITTEN_BYTES:], memoryview(batch)[HEADER_BYTES:]), now_ms)
    result = AppendResult(stored.base_offset, stored.base_origin_seq, stored.last_origin_seq, stored.append_time_ms)
    producers.record(
        header.producer_id, header.producer_epoch, header.base_sequence, header.last_sequence, result, now_ms
    )
    return Produced(result, origin, False, records)
