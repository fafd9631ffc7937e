"""Read one segment file into Arrow record batches: the work of one input partition.

Two shapes, one row per batch or one row per record (``BATCH_SCHEMA`` and
``RECORD_SCHEMA``). Every batch is framed and CRC-checked with the codec of
:mod:`georep.record.batch`; records are decoded with its ``decode_records``.

Damage is data, never an exception. A batch that cannot be framed, fails its
CRC, does not decode, or breaks offset continuity becomes one row with
``status`` set and ``error`` saying why, at its ``file`` and byte ``position``:

* ``torn_tail``: the damage ends the partition's newest segment and lies at or
  above its recovery point. That is what a write in progress, or a crash
  before an fsync, leaves behind; ``SegmentLog.open`` truncates it and a live
  node has not acknowledged it as durable. Not a divergence.
* ``corrupt``: anything else, e.g. damage in a sealed segment, below the
  recovery point, or followed by more batches.

Only bytes below the size listed before the job started are read
(:class:`spark_jobs.layout.SegmentFile`), so a segment that a live node is
appending to is read as the prefix it had then.
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import crc32c
import pyarrow as pa

from georep.record.batch import (
    BatchHeader,
    CorruptBatch,
    Record,
    check_batch,
    decode_records,
    frame_length,
    parse_header,
)
from spark_jobs.layout import SegmentFile

OK = "ok"
CORRUPT = "corrupt"
TORN_TAIL = "torn_tail"
RECORDS_PER_ARROW_BATCH = 65_536

_COMMON = [
    ("site", pa.string()), ("topic", pa.string()), ("partition", pa.int32()),
    ("file", pa.string()), ("position", pa.int64()), ("status", pa.string()), ("error", pa.string()),
    ("origin", pa.string()), ("origin_site", pa.string()), ("origin_epoch", pa.int64()),
    ("append_time_ms", pa.int64()), ("log_start_offset", pa.int64()),
]  # fmt: skip
BATCH_SCHEMA = pa.schema([
    *_COMMON,
    ("base_offset", pa.int64()), ("base_seq", pa.int64()), ("last_seq", pa.int64()), ("records", pa.int32()),
    ("size_bytes", pa.int32()), ("crc", pa.int64()), ("first_timestamp_ms", pa.int64()),
    ("max_timestamp_ms", pa.int64()),
])  # fmt: skip
RECORD_SCHEMA = pa.schema([
    *_COMMON,
    ("offset", pa.int64()), ("origin_seq", pa.int64()), ("timestamp_ms", pa.int64()),
    ("key_hash", pa.int64()), ("value_hash", pa.int64()), ("record_hash", pa.int64()),
])  # fmt: skip

_TS_AND_LEN = struct.Struct(">qi")
_LEN = struct.Struct(">i")


@dataclass(frozen=True, slots=True)
class Scanned:
    """One batch of a segment as found: a valid ``header``, or damage (``status``, ``error``)."""

    position: int
    base_offset: int  # the header's, or for damage the offset continuity expected there
    size_bytes: int
    status: str
    error: str | None = None
    header: BatchHeader | None = None


def scan_segment(segment: SegmentFile, buf: bytes | mmap.mmap) -> Iterator[Scanned]:
    """Every batch of ``buf`` (the segment's bytes, at most its listed size), valid or damaged."""
    end = min(len(buf), segment.size_bytes)
    view = memoryview(buf)[:end]
    pos = 0
    expected = segment.base_offset
    try:
        while pos < end:
            total: int | None = None
            try:
                total = frame_length(view, pos)
                header = check_batch(view, pos)
                if header.base_offset != expected:
                    raise CorruptBatch(f"batch at byte {pos} has base_offset {header.base_offset}, expected {expected}")
                yield Scanned(pos, expected, total, OK, header=header)
                expected = header.next_offset
                pos += total
                continue
            except CorruptBatch as exc:
                error = str(exc)
            complete = total is not None and pos + total <= end
            torn = segment.last and expected >= segment.recovery_point and (not complete or pos + (total or 0) == end)
            yield Scanned(pos, expected, total or end - pos, TORN_TAIL if torn else CORRUPT, error)
            if not complete or total is None:
                return
            with contextlib.suppress(CorruptBatch):  # skip a frameable batch, so one bad batch hides no others
                expected += parse_header(view, pos).records_count
            pos += total
    finally:
        view.release()


def record_hash(record: Record) -> int:
    """CRC-32C over what I1 says is identical everywhere: timestamp, key, value and headers."""
    key, value = record.key, record.value
    h = crc32c.crc32c(_TS_AND_LEN.pack(record.timestamp_ms, -1 if key is None else len(key)))
    if key:
        h = crc32c.crc32c(key, h)
    h = crc32c.crc32c(_LEN.pack(-1 if value is None else len(value)), h)
    if value:
        h = crc32c.crc32c(value, h)
    for hk, hv in record.headers:
        raw = hk.encode()
        h = crc32c.crc32c(_LEN.pack(len(raw)) + raw + _LEN.pack(-1 if hv is None else len(hv)), h)
        if hv:
            h = crc32c.crc32c(hv, h)
    return int(h)


def _hash_or_none(data: bytes | None) -> int | None:
    return None if data is None else int(crc32c.crc32c(data))


def _open(segment: SegmentFile) -> mmap.mmap | bytes:
    with open(segment.path, "rb") as f:
        try:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            return b""


def _constants(segment: SegmentFile, n: int) -> list[pa.Array]:
    return [
        pa.repeat(segment.site, n), pa.repeat(segment.topic, n), pa.repeat(pa.scalar(segment.partition, pa.int32()), n),
        pa.repeat(segment.path, n),
    ]  # fmt: skip


def _origin_columns(headers: list[BatchHeader | None]) -> list[list[object]]:
    origin: list[object] = []
    site: list[object] = []
    epoch: list[object] = []
    for h in headers:
        if h is None:
            origin.append(None)
            site.append(None)
            epoch.append(None)
        else:
            origin.append(f"{h.origin_site}@{h.origin_epoch}")
            site.append(h.origin_site)
            epoch.append(h.origin_epoch)
    return [origin, site, epoch]


def read_batches(segment: SegmentFile) -> Iterator[pa.RecordBatch]:
    """One row per batch of the segment (``BATCH_SCHEMA``)."""
    buf = _open(segment)
    try:
        found = list(scan_segment(segment, buf))
    finally:
        if isinstance(buf, mmap.mmap):
            buf.close()
    if not found:
        return
    headers = [s.header for s in found]

    def per_batch(get: Callable[[BatchHeader], int]) -> list[int | None]:
        return [None if h is None else get(h) for h in headers]

    columns: list[pa.Array | list[object] | list[int | None]] = [
        *_constants(segment, len(found)),
        [s.position for s in found], [s.status for s in found], [s.error for s in found],
        *_origin_columns(headers),
        per_batch(lambda h: h.append_time_ms), pa.repeat(pa.scalar(segment.log_start_offset), len(found)),
        [s.base_offset for s in found], per_batch(lambda h: h.base_origin_seq), per_batch(lambda h: h.last_origin_seq),
        per_batch(lambda h: h.records_count), [s.size_bytes for s in found], per_batch(lambda h: h.crc),
        per_batch(lambda h: h.first_timestamp), per_batch(lambda h: h.max_timestamp),
    ]  # fmt: skip
    yield pa.RecordBatch.from_arrays([pa.array(c, type=f.type) for c, f in zip(columns, BATCH_SCHEMA, strict=True)],
                                     schema=BATCH_SCHEMA)  # fmt: skip


class _RecordColumns:
    """Columns of ``RECORD_SCHEMA`` being filled, flushed every ``RECORDS_PER_ARROW_BATCH`` rows."""

    def __init__(self, segment: SegmentFile) -> None:
        self.segment = segment
        self.rows: list[list[object]] = [[] for _ in range(len(RECORD_SCHEMA) - 4)]

    def __len__(self) -> int:
        return len(self.rows[0])

    def add_damage(self, s: Scanned) -> None:
        for column, value in zip(self.rows, (s.position, s.status, s.error, None, None, None, None,
                                             self.segment.log_start_offset, s.base_offset, None, None, None, None,
                                             None), strict=True):  # fmt: skip
            column.append(value)

    def add_batch(self, s: Scanned, buf: memoryview) -> None:
        h = s.header
        assert h is not None
        records = decode_records(buf[s.position : s.position + s.size_bytes], h)
        n = len(records)
        origin = f"{h.origin_site}@{h.origin_epoch}"
        (position, status, error, origin_col, site, epoch, append, start, offset, seq, ts, khash, vhash,
         rhash) = self.rows  # fmt: skip
        for column, value in ((position, s.position), (status, OK), (error, None), (origin_col, origin),
                              (site, h.origin_site), (epoch, h.origin_epoch), (append, h.append_time_ms),
                              (start, self.segment.log_start_offset)):  # fmt: skip
            column.extend([value] * n)
        for r in records:
            offset.append(r.offset)
            seq.append(r.origin_seq)
            ts.append(r.timestamp_ms)
            khash.append(_hash_or_none(r.key))
            vhash.append(_hash_or_none(r.value))
            rhash.append(record_hash(r))

    def flush(self) -> pa.RecordBatch:
        n = len(self)
        arrays = _constants(self.segment, n) + [
            pa.array(c, type=f.type) for c, f in zip(self.rows, list(RECORD_SCHEMA)[4:], strict=True)
        ]
        self.rows = [[] for _ in self.rows]
        return pa.RecordBatch.from_arrays(arrays, schema=RECORD_SCHEMA)


def read_records(segment: SegmentFile, positions: frozenset[int] | None = None) -> Iterator[pa.RecordBatch]:
    """One row per record of the segment, and one per damaged batch (``RECORD_SCHEMA``).

    ``positions``: decode only the batches at these byte positions (every batch is still CRC-checked).
    """
    buf = _open(segment)
    view = memoryview(buf)
    columns = _RecordColumns(segment)
    scan = scan_segment(segment, buf)
    try:
        for s in scan:
            if positions is not None and s.position not in positions:
                continue
            if s.header is None:
                columns.add_damage(s)
            else:
                try:
                    columns.add_batch(s, view)
                except CorruptBatch as exc:  # a valid CRC over records that do not decode
                    columns.add_damage(Scanned(s.position, s.base_offset, s.size_bytes, CORRUPT, str(exc)))
            if len(columns) >= RECORDS_PER_ARROW_BATCH:
                yield columns.flush()
        if len(columns):
            yield columns.flush()
    finally:
        scan.close()
        view.release()
        if isinstance(buf, mmap.mmap):
            buf.close()
