"""An in-memory ``PartitionLog`` for the deterministic simulator and unit tests.

It keeps whole batches as bytes, exactly as the segment log would store them,
and models durability: ``crash()`` drops everything appended since the last
``flush()``, which is what a site loses when its process dies before an fsync.
``corrupt()`` damages a stored batch as bit rot would; reads then treat it as
the segment log does (quarantined, never served) until ``repair``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from georep.record.batch import REWRITTEN_BYTES, BatchHeader, local_prefix
from georep.storage.api import (
    BatchDamaged,
    BatchEntry,
    BytesLike,
    DamagedBatch,
    LogConfig,
    OffsetOutOfRange,
    ReadResult,
    RepairRefused,
    ScrubStep,
    SegmentBatches,
    copy_for_repair,
    quarantined,
)
from offsets.coordinates import LocalOffset, Origin, OriginSeq


class MemoryLog:
    def __init__(self, config: LogConfig | None = None) -> None:
        self.config = config or LogConfig()
        self._batches: list[bytes] = []
        self._headers: list[BatchHeader] = []
        self._base_offsets: list[int] = []
        self._start = LocalOffset(0)
        self._end = LocalOffset(0)
        self._flushed_count = 0
        self._flushed_offset = self._start  # next_offset of the last flushed batch: sources ask for it all the time
        self._vector: dict[Origin, OriginSeq] = {}
        self._flushed_vector: dict[Origin, OriginSeq] = {}
        self._damaged: dict[int, DamagedBatch] = {}
        self.damage_found_total = 0
        self.repaired_total = 0
        self.retention_due_ms: int | None = None  # its one segment is never deleted

    @property
    def log_start_offset(self) -> LocalOffset:
        return self._start

    @property
    def log_end_offset(self) -> LocalOffset:
        return self._end

    @property
    def size_bytes(self) -> int:
        return sum(len(b) for b in self._batches)

    @property
    def segment_count(self) -> int:
        return 1

    def vector(self) -> dict[Origin, OriginSeq]:
        return dict(self._vector)

    def flushed_vector(self) -> dict[Origin, OriginSeq]:
        return dict(self._flushed_vector)

    def append(self, header: BatchHeader, body: Sequence[BytesLike], append_time_ms: int) -> BatchHeader:
        stored = header._replace(base_offset=self._end, append_time_ms=append_time_ms)
        prefix = local_prefix(self._end, header.batch_length, append_time_ms, header.crc)
        data = b"".join([prefix, *body])
        self._batches.append(data)
        self._headers.append(stored)
        self._base_offsets.append(self._end)
        self._end = stored.next_offset
        origin = stored.origin
        self._vector[origin] = OriginSeq(max(self._vector.get(origin, 0), stored.next_origin_seq))
        return stored

    def _index_of(self, offset: int) -> int:
        return bisect.bisect_right(self._base_offsets, offset) - 1

    def read(self, offset: LocalOffset, max_bytes: int) -> ReadResult:
        if not self._start <= offset <= self._end:
            raise OffsetOutOfRange(offset, self._start, self._end)
        if offset == self._end:
            return ReadResult(b"", offset)
        batches, bases, damaged = self._batches, self._base_offsets, self._damaged
        first = self._index_of(offset)
        if bases[first] in damaged:
            raise BatchDamaged(damaged[bases[first]])
        i = first
        size = 0
        while i < len(batches) and (i == first or size + len(batches[i]) <= max_bytes) and bases[i] not in damaged:
            size += len(batches[i])
            i += 1
        return ReadResult(b"".join(batches[first:i]), self._headers[i - 1].next_offset)

    def corrupt(self, offset: int, reason: str = "bit rot") -> DamagedBatch:
        """Damage the stored batch holding ``offset`` (one flipped byte) and quarantine it."""
        i = self._index_of(offset)
        h = self._headers[i]
        data = bytearray(self._batches[i])
        data[-1] ^= 0xFF
        self._batches[i] = bytes(data)
        damaged = DamagedBatch(
            h.base_offset,
            h.next_offset,
            h.origin,
            h.base_origin_seq,
            h.last_origin_seq,
            "memory",
            0,
            h.size_bytes,
            reason,
            h.crc,
        )
        self._damaged[h.base_offset] = damaged
        quarantined.add(self)
        self.damage_found_total += 1
        return damaged

    def scrub(self, offset: int, max_bytes: int) -> ScrubStep:
        """Nothing rots unnoticed in memory: ``corrupt`` quarantines at once."""
        checked = sum(len(b) for b, base in zip(self._batches, self._base_offsets, strict=True) if base >= offset)
        return ScrubStep(int(self._end), checked, [])

    def damaged_batches(self) -> list[DamagedBatch]:
        return [self._damaged[b] for b in sorted(self._damaged)]

    def repair(self, base_offset: int, batch: bytes) -> DamagedBatch:
        damaged = self._damaged.get(base_offset)
        if damaged is None:
            raise RepairRefused(f"no quarantined batch at offset {base_offset}")
        h = copy_for_repair(damaged, batch)
        i = self._index_of(base_offset)
        stored = self._headers[i]
        prefix = local_prefix(base_offset, h.batch_length, stored.append_time_ms, h.crc)
        self._batches[i] = prefix + bytes(memoryview(batch)[REWRITTEN_BYTES:])
        del self._damaged[base_offset]
        if not self._damaged:
            quarantined.discard(self)
        self.repaired_total += 1
        return damaged

    def offset_for_origin_seq(self, origin: Origin, seq: OriginSeq) -> LocalOffset | None:
        site, epoch = origin
        for h in self._headers:  # every stream a source opens asks, per partition and origin: no Origin per batch
            if h.origin_site == site and h.origin_epoch == epoch and h.last_origin_seq >= seq:
                return h.base_offset
        return None

    def offset_for_timestamp(self, timestamp_ms: int) -> LocalOffset | None:
        for h in self._headers:
            if h.max_timestamp >= timestamp_ms:
                return h.base_offset
        return None

    def batch_entries(self) -> list[BatchEntry]:
        return [
            BatchEntry(
                h.origin,
                h.base_origin_seq,
                h.last_offset_delta,
                h.base_offset,
                h.max_timestamp,
                h.producer_id,
                h.producer_epoch,
                h.base_sequence,
                h.append_time_ms,
            )
            for h in self._headers
        ]

    def segment_at(self, offset: int) -> SegmentBatches:
        # One segment from offset 0, never trimmed: nothing lies below it.
        if not self._start <= offset <= self._end:
            raise OffsetOutOfRange(offset, self._start, self._end)
        return SegmentBatches(self._start, {}, self.batch_entries())

    def flush(self) -> LocalOffset:
        return self.flush_to(self._end)

    def flush_to(self, offset: int) -> LocalOffset:
        """Make the batches below ``offset`` durable: an fsync that began when the log ended there
        (the simulator's fsyncs take time, and appends go on meanwhile)."""
        count = bisect.bisect_left(self._base_offsets, offset)
        vector = self._flushed_vector
        for h in self._headers[self._flushed_count : count]:
            origin, next_seq = h.origin, h.next_origin_seq
            if next_seq > vector.get(origin, 0):
                vector[origin] = next_seq
        if count > self._flushed_count:
            self._flushed_count = count
            self._flushed_offset = self._headers[count - 1].next_offset
        return self._flushed_offset

    @property
    def flushed_offset(self) -> LocalOffset:
        return self._flushed_offset

    def crash(self) -> None:
        """Lose every batch appended since the last flush, as a killed process would."""
        del self._batches[self._flushed_count :]
        del self._headers[self._flushed_count :]
        del self._base_offsets[self._flushed_count :]
        self._end = self.flushed_offset
        self._vector = dict(self._flushed_vector)

    def enforce_retention(self, now_ms: int) -> int:
        # One segment, never deleted: like the active segment of the segment log.
        return 0

    def close(self) -> None:
        self.flush()
