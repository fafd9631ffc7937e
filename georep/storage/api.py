"""The ``PartitionLog`` port: what the broker and the replication core need from storage.

Two implementations: ``georep.storage.segment_log.SegmentLog`` (segment files on
disk) and ``georep.storage.memory_log.MemoryLog`` (the simulator's). Both hold
whole batches only and never look inside records.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from georep.record.batch import BatchHeader, CorruptBatch, check_batch
from offsets.coordinates import LocalOffset, Origin, OriginSeq

BytesLike = bytes | bytearray | memoryview


class StorageError(Exception):
    """Base class of storage errors a user can cause or must act on."""


class OffsetOutOfRange(StorageError):
    def __init__(self, offset: int, log_start: int, log_end: int) -> None:
        super().__init__(
            f"offset {offset} is outside the log [{log_start}, {log_end}]: seek to a valid "
            "offset, or to the beginning or end"
        )
        self.offset = offset
        self.log_start = log_start
        self.log_end = log_end


class DiskFull(StorageError):
    """A write hit ENOSPC (or EDQUOT). Nothing was half-written; reads still work."""


# Whose quarantine list is not empty: a SegmentLog's directory, a MemoryLog itself. Kept where each log's list
# changes: while it is empty (no damage anywhere, the usual case) a node's repair loop walks no partition, however
# many are served or being created (Broker.damaged).
quarantined: set[object] = set()


@dataclass(frozen=True, slots=True)
class DamagedBatch:
    """A stored batch whose bytes fail their check (CRC, framing, offset): quarantined until repaired.

    Its coordinates come from the origin index (written at append time), never
    from the damaged bytes. ``repair`` puts a peer's copy of the same batch in
    place; the local offsets never change.
    """

    base_offset: int
    next_offset: int
    origin: Origin
    base_origin_seq: int
    last_origin_seq: int
    segment: str  # the .log file
    position: int  # byte position in it
    size_bytes: int
    reason: str
    crc: int = -1  # the batch's CRC-32C as its origin index entry recorded it; -1 when unknown (an older list)

    def describe(self) -> str:
        return (
            f"offsets {self.base_offset}..{self.next_offset - 1} (origin {self.origin} seqs "
            f"{self.base_origin_seq}..{self.last_origin_seq}, {self.segment} byte {self.position})"
        )


class BatchDamaged(StorageError):
    """A read reached a quarantined batch. Nothing of it is served until it is repaired."""

    def __init__(self, damaged: DamagedBatch) -> None:
        super().__init__(f"{damaged.describe()} are damaged ({damaged.reason}) and quarantined until repaired")
        self.damaged = damaged


@dataclass(frozen=True, slots=True)
class ScrubStep:
    next_offset: int  # where the next step goes on (the log end once done)
    checked_bytes: int
    found: list[DamagedBatch]  # newly quarantined
    indexes_rebuilt: int = 0  # segments whose index files disagreed with their CRC-valid batches and were rebuilt
    # Newly found whole, CRC-valid batches whose records no reader accepts (stored before every batch was
    # validated): "offsets A..B: why". Not damage, since every site holds the same bytes; readers skip them.
    invalid: list[str] = field(default_factory=list)


class RepairRefused(StorageError):
    """A copy offered to repair a quarantined batch is not the same batch."""


def copy_for_repair(damaged: DamagedBatch, batch: bytes) -> BatchHeader:
    """The header of ``batch`` if it is the batch ``damaged`` held (origin, seqs, length and, where the slot
    recorded it, CRC), whole and CRC-valid; otherwise :class:`RepairRefused`, saying what was offered."""
    try:
        header = check_batch(batch)
    except CorruptBatch as exc:
        raise RepairRefused(f"the copy offered for {damaged.describe()} is itself damaged: {exc}") from None
    offered = (
        header.origin,
        header.base_origin_seq,
        header.last_origin_seq,
        header.size_bytes,
        header.last_offset_delta,
        header.crc if damaged.crc >= 0 else -1,
    )
    quarantined = (
        damaged.origin,
        damaged.base_origin_seq,
        damaged.last_origin_seq,
        damaged.size_bytes,
        damaged.next_offset - damaged.base_offset - 1,
        damaged.crc,
    )
    if offered != quarantined or len(batch) != header.size_bytes:
        raise RepairRefused(
            f"the copy offered for {damaged.describe()} is another batch: origin {header.origin} seqs "
            f"{header.base_origin_seq}..{header.last_origin_seq}, {header.size_bytes} bytes, CRC {header.crc:#010x}"
        )
    return header


@dataclass(frozen=True, slots=True)
class LogConfig:
    """Per-partition storage settings. Names end in their unit (STYLE.md §3)."""

    segment_bytes_max: int = 1 << 30
    segment_ms: int = 7 * 24 * 3600 * 1000
    retention_ms: int = -1  # -1: keep forever
    retention_bytes: int = -1  # -1: no size limit
    flush_interval_ms: int = 0  # 0: fsync before every ack; N: every N ms
    index_interval_bytes: int = 4096


@dataclass(frozen=True, slots=True)
class ReadResult:
    data: bytes  # whole batches, concatenated, in log order
    next_offset: LocalOffset  # where the following read continues


@dataclass(slots=True)
class BatchEntry:
    """One batch as the origin index records it (enough to rebuild producer state)."""

    origin: Origin
    base_origin_seq: OriginSeq
    last_offset_delta: int
    base_offset: LocalOffset
    max_timestamp: int
    producer_id: int
    producer_epoch: int
    base_sequence: int
    append_time_ms: int = field(default=-1)


@dataclass(frozen=True, slots=True)
class SegmentBatches:
    """One retained segment of a log, as :meth:`PartitionLog.segment_at` answers it."""

    base_offset: LocalOffset
    # The log's vector at ``base_offset``: {origin: next seq} over every batch below it, the ones retention (or a
    # chain trim) deleted included. For the first retained segment: the vector below the log start.
    start_vector: dict[Origin, OriginSeq]
    entries: list[BatchEntry]  # the segment's batches, in log order


class PartitionLog(Protocol):
    @property
    def damage_found_total(self) -> int:
        """Batches quarantined since the log was opened."""
        ...

    @property
    def repaired_total(self) -> int:
        """Quarantined batches repaired since the log was opened."""
        ...

    @property
    def log_start_offset(self) -> LocalOffset: ...

    @property
    def log_end_offset(self) -> LocalOffset:
        """The local offset the next appended record gets."""
        ...

    @property
    def size_bytes(self) -> int: ...

    @property
    def segment_count(self) -> int: ...

    def vector(self) -> dict[Origin, OriginSeq]:
        """{origin: next origin seq} over everything appended (a copy)."""
        ...

    def flushed_vector(self) -> dict[Origin, OriginSeq]:
        """{origin: next origin seq} over the batches below ``flushed_offset``: what survives a crash."""
        ...

    def append(self, header: BatchHeader, body: Sequence[BytesLike], append_time_ms: int) -> BatchHeader:
        """Append one batch at the log end.

        ``header`` is the batch's parsed, CRC-valid header (origin stamped).
        ``body`` holds the CRC-covered bytes ``[24, size)`` in one or more
        buffers; the log writes its own 24-byte prefix (local offset and append
        time) in front. Returns the header as stored. On ``DiskFull`` or any
        OSError nothing of the batch remains in the log.
        """
        ...

    def damaged_batches(self) -> list[DamagedBatch]:
        """The quarantined batches, in offset order (they survive restarts)."""
        ...

    def repair(self, base_offset: int, batch: bytes) -> DamagedBatch:
        """Put ``batch`` (a peer's copy, stamped) in place of the quarantined batch at ``base_offset``.

        Raises ``RepairRefused`` unless it is the same batch: same origin, seqs
        and size, and a CRC that matches. Returns what was repaired.
        """
        ...

    def scrub(self, offset: int, max_bytes: int) -> ScrubStep:
        """Check about ``max_bytes`` of durable batches from ``offset``; quarantine the damaged ones."""
        ...

    def read(self, offset: LocalOffset, max_bytes: int) -> ReadResult:
        """Whole batches from the one containing ``offset``; at least one batch if any.

        Raises ``OffsetOutOfRange`` outside ``[log_start_offset, log_end_offset]``.
        """
        ...

    def offset_for_origin_seq(self, origin: Origin, seq: OriginSeq) -> LocalOffset | None:
        """Base offset of the first retained batch of ``origin`` holding a seq >= ``seq``."""
        ...

    def offset_for_timestamp(self, timestamp_ms: int) -> LocalOffset | None:
        """Base offset of the first batch whose max timestamp is >= ``timestamp_ms``."""
        ...

    def batch_entries(self) -> list[BatchEntry]:
        """Every retained batch, in log order, from the index (no log reads)."""
        ...

    def segment_at(self, offset: int) -> SegmentBatches:
        """The retained segment holding ``offset`` (the one starting there at a segment boundary, the last at the
        log end), with the log's vector at its base. Raises ``OffsetOutOfRange`` outside ``[log_start_offset,
        log_end_offset]``."""
        ...

    def flush(self) -> LocalOffset:
        """fsync everything appended so far; returns the flushed log end. Blocking."""
        ...

    @property
    def flushed_offset(self) -> LocalOffset: ...

    def enforce_retention(self, now_ms: int) -> int:
        """Delete sealed segments past retention; returns how many were deleted."""
        ...

    @property
    def retention_due_ms(self) -> int | None:
        """The first ``now_ms`` at which ``enforce_retention`` deletes by time alone, as of its last run (None: not
        before the log is written again; or no run yet)."""
        ...

    def close(self) -> None: ...


def start_offset_for_vector(log: PartitionLog, vector: Mapping[Origin, int]) -> LocalOffset:
    """The smallest local offset holding a record ``vector`` does not cover (the log end if none).

    Every batch before it is covered whole, so a reader that starts here and drops what the
    vector covers reads exactly the records the vector does not cover (I5). Used by the broker's
    vector fetch and by the simulator's consumers.
    """
    start = log.log_end_offset
    for origin, next_seq in sorted(log.vector().items()):
        if vector.get(origin, 0) >= next_seq:
            continue
        at = log.offset_for_origin_seq(origin, OriginSeq(vector.get(origin, 0)))
        if at is not None:
            start = min(start, at)
    return LocalOffset(max(start, log.log_start_offset))
