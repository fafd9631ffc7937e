"""Batches built the way the broker builds them, and a writer that appends them to a ``SegmentLog``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from georep.record.batch import (
    HEADER_BYTES,
    REWRITTEN_BYTES,
    BatchHeader,
    RecordInput,
    encode_batch,
    iter_headers,
    parse_header,
    stamp_origin,
)
from georep.storage.api import LogConfig
from georep.storage.handle_cache import HANDLES, set_max_open_files
from georep.storage.segment_log import SegmentLog
from offsets.coordinates import Origin
from topology.ids import SiteId

A = Origin(SiteId("a"), 1)
B = Origin(SiteId("us-east-2"), 1_700_000_000)
C = Origin(SiteId("c"), 3)


# -- building batches the way the broker does ----------------------------------------------------


@dataclass(frozen=True)
class Batch:
    """A producer's batch after the origin stamped it: what the broker hands to ``append``."""

    header: BatchHeader
    body: tuple[memoryview, ...]  # the CRC-covered bytes [24, size), not copied
    values: tuple[bytes, ...]

    @property
    def covered(self) -> bytes:
        return b"".join(bytes(b) for b in self.body)


def make_batch(
    origin: Origin,
    seq: int,
    values: Sequence[bytes],
    *,
    timestamp_ms: int = 1_000,
    producer_id: int = -1,
    producer_epoch: int = -1,
    base_sequence: int = -1,
) -> Batch:
    """Encode as a producer, then stamp and parse the 109-byte header as the origin's broker does."""
    records = [RecordInput(None, v, (), timestamp_ms + i) for i, v in enumerate(values)]
    raw = encode_batch(records, producer_id=producer_id, producer_epoch=producer_epoch, base_sequence=base_sequence)
    head, _crc = stamp_origin(raw, origin, seq)
    header = parse_header(head)
    return Batch(header, (memoryview(head)[REWRITTEN_BYTES:], memoryview(raw)[HEADER_BYTES:]), tuple(values))


@dataclass
class Stored:
    header: BatchHeader  # as returned by append
    batch: Batch


@dataclass
class Writer:
    """Appends batches with per-origin seqs, remembering what went in."""

    log: SegmentLog
    next_seq: dict[Origin, int] = field(default_factory=dict)
    stored: list[Stored] = field(default_factory=list)
    clock_ms: int = 10_000

    def append(
        self,
        origin: Origin = A,
        count: int = 1,
        *,
        value_bytes: int = 40,
        timestamp_ms: int | None = None,
        append_time_ms: int | None = None,
    ) -> Stored:
        seq = self.next_seq.get(origin, 0)
        values = [f"{origin}/{seq + i}/".encode().ljust(value_bytes, b"x") for i in range(count)]
        batch = make_batch(
            origin, seq, values, timestamp_ms=1_000 + len(self.stored) if timestamp_ms is None else timestamp_ms
        )
        self.clock_ms = self.clock_ms + 1 if append_time_ms is None else append_time_ms
        header = self.log.append(batch.header, batch.body, self.clock_ms)
        self.next_seq[origin] = seq + count
        out = Stored(header, batch)
        self.stored.append(out)
        return out

    def containing(self, offset: int) -> Stored:
        return next(s for s in self.stored if s.header.base_offset <= offset <= s.header.last_offset)


def open_log(directory: Path, **config: int) -> SegmentLog:
    return SegmentLog.open(directory, LogConfig(**config), now_ms=0)


def log_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.log"))


def read_all(log: SegmentLog, max_bytes: int = 1 << 20) -> list[bytes]:
    """Every batch from the log start, following next_offset."""
    out: list[bytes] = []
    offset = log.log_start_offset
    while offset < log.log_end_offset:
        result = log.read(offset, max_bytes)
        pos = 0
        for h in iter_headers(result.data, verify=True):
            out.append(result.data[pos : pos + h.size_bytes])
            pos += h.size_bytes
        assert pos == len(result.data)
        offset = result.next_offset
    return out


@contextlib.contextmanager
def max_open_files(cap: int) -> Iterator[None]:
    """The process's open-file cache bounded to ``cap`` files, and its bound given back after."""
    before = HANDLES.max_open_files
    set_max_open_files(cap)
    try:
        yield
    finally:
        set_max_open_files(before)
