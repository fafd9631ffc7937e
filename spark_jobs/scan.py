"""Read one segment file into Arrow record batches: the work of one input partition.

Two shapes, one row per batch or one row per record (``BATCH_SCHEMA`` and
``RECORD_SCHEMA``). Every batch is framed and CRC-checked with the codec of
:mod:`georep.record.batch`; records are decoded with its ``decode_records``.

Damage is data, never an exception. A batch that cannot be framed, fails its
CRC, does not decode, or breaks offset continuity becomes one row with
``status`` set and ``error`` saying why, at its ``file`` and byte ``position``:

* ``torn_tail``: the damage ends the partition's newest segment (at a
  multi-node site, a node's copy of a segment: each is a log of its own) and
  lies at or above its recovery point. That is what a write in progress, or a crash
  before an fsync, leaves behind; ``SegmentLog.open`` truncates it and a live
  node has not acknowledged it as durable. Not a divergence.
* ``corrupt``: anything else, e.g. damage in a sealed segment, below the
  recovery point, or followed by more batches.

Only bytes below the size listed before the job started are read
(:class:`spark_jobs.layout.SegmentFile`), so a segment that a live node is
appending to is read as the prefix it had then.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable, Generator, Iterator

import crc32c
import pyarrow as pa

from georep.record.batch import BatchHeader, CorruptBatch, Record, decode_records
from georep.storage.batch_scan import CORRUPT, OK, TORN_TAIL, ScanBounds, Scanned, scan_batches
from spark_jobs.layout import SegmentFile

__all__ = ["CORRUPT", "OK", "TORN_TAIL", "Scanned", "read_batches", "read_records", "scan_segment"]

RECORDS_PER_ARROW_BATCH = 65_536

# The first N_CONSTANT columns are the segment file's, the same on every row of it.
_COMMON = [
    ("site", pa.string()),
    ("topic", pa.string()),
    ("partition", pa.int32()),
    ("node", pa.string()),
    ("segment", pa.int64()),
    ("file", pa.string()),
    ("position", pa.int64()),
    ("status", pa.string()),
    ("error", pa.string()),
    ("origin", pa.string()),
    ("origin_site", pa.string()),
    ("origin_epoch", pa.int64()),
    ("append_time_ms", pa.int64()),
    ("log_start_offset", pa.int64()),
]
BATCH_SCHEMA = pa.schema(
    [
        *_COMMON,
        ("base_offset", pa.int64()),
        ("base_seq", pa.int64()),
        ("last_seq", pa.int64()),
        ("records", pa.int32()),
        ("size_bytes", pa.int32()),
        ("crc", pa.int64()),
        ("first_timestamp_ms", pa.int64()),
        ("max_timestamp_ms", pa.int64()),
    ]
)
RECORD_SCHEMA = pa.schema(
    [
        *_COMMON,
        ("offset", pa.int64()),
        ("origin_seq", pa.int64()),
        ("timestamp_ms", pa.int64()),
        ("key_hash", pa.int64()),
        ("value_hash", pa.int64()),
        ("record_hash", pa.int64()),
    ]
)

N_CONSTANT = 6

_TS_AND_LEN = struct.Struct(">qi")
_LEN = struct.Struct(">i")


READ_BUFFER_BYTES = 1 << 20


def scan_segment(segment: SegmentFile) -> Generator[Scanned, None, None]:
    """Every batch of the segment below its listed size, valid or damaged, read batch by batch
    (:func:`georep.storage.batch_scan.scan_batches`: the node's digests judge batches the same way).

    Plain buffered reads, not mmap: a node may truncate a torn tail while we
    read, and a mapped page past the new end would kill the worker (SIGBUS);
    a short read is just a torn batch. A segment that retention deleted since
    the listing reads as empty.
    """
    try:
        f = open(segment.path, "rb", buffering=READ_BUFFER_BYTES)  # noqa: SIM115 - closed in finally
    except FileNotFoundError:
        return
    try:
        yield from scan_batches(
            f, ScanBounds(segment.base_offset, segment.size_bytes, segment.last, segment.recovery_point)
        )
    finally:
        f.close()


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


def _constants(segment: SegmentFile, n: int) -> list[pa.Array]:
    return [
        pa.repeat(segment.site, n),
        pa.repeat(segment.topic, n),
        pa.repeat(pa.scalar(segment.partition, pa.int32()), n),
        pa.repeat(pa.scalar(segment.node, pa.string()), n),
        pa.repeat(pa.scalar(segment.segment_id, pa.int64()), n),
        pa.repeat(segment.path, n),
    ]


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
    found = [dataclasses.replace(s, data=b"") for s in scan_segment(segment)]
    if not found:
        return
    headers = [s.header for s in found]

    def per_batch(get: Callable[[BatchHeader], int]) -> list[int | None]:
        return [None if h is None else get(h) for h in headers]

    columns: list[pa.Array | list[object] | list[int | None]] = [
        *_constants(segment, len(found)),
        [s.position for s in found],
        [s.status for s in found],
        [s.error for s in found],
        *_origin_columns(headers),
        per_batch(lambda h: h.append_time_ms),
        pa.repeat(pa.scalar(segment.log_start_offset), len(found)),
        [s.base_offset for s in found],
        per_batch(lambda h: h.base_origin_seq),
        per_batch(lambda h: h.last_origin_seq),
        per_batch(lambda h: h.records_count),
        [s.size_bytes for s in found],
        per_batch(lambda h: h.crc),
        per_batch(lambda h: h.first_timestamp),
        per_batch(lambda h: h.max_timestamp),
    ]
    yield pa.RecordBatch.from_arrays(
        [pa.array(c, type=f.type) for c, f in zip(columns, BATCH_SCHEMA, strict=True)], schema=BATCH_SCHEMA
    )


class _RecordColumns:
    """Columns of ``RECORD_SCHEMA`` being filled, flushed every ``RECORDS_PER_ARROW_BATCH`` rows."""

    def __init__(self, segment: SegmentFile) -> None:
        self.segment = segment
        self.rows: list[list[object]] = [[] for _ in range(len(RECORD_SCHEMA) - N_CONSTANT)]

    def __len__(self) -> int:
        return len(self.rows[0])

    def add_damage(self, s: Scanned) -> None:
        for column, value in zip(
            self.rows,
            (
                s.position,
                s.status,
                s.error,
                None,
                None,
                None,
                None,
                self.segment.log_start_offset,
                s.base_offset,
                None,
                None,
                None,
                None,
                None,
            ),
            strict=True,
        ):
            column.append(value)

    def add_batch(self, s: Scanned) -> None:
        h = s.header
        assert h is not None
        records = decode_records(s.data, h)
        n = len(records)
        origin = f"{h.origin_site}@{h.origin_epoch}"
        (position, status, error, origin_col, site, epoch, append, start, offset, seq, ts, khash, vhash, rhash) = (
            self.rows
        )
        for column, value in (
            (position, s.position),
            (status, OK),
            (error, None),
            (origin_col, origin),
            (site, h.origin_site),
            (epoch, h.origin_epoch),
            (append, h.append_time_ms),
            (start, self.segment.log_start_offset),
        ):
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
            pa.array(c, type=f.type) for c, f in zip(self.rows, list(RECORD_SCHEMA)[N_CONSTANT:], strict=True)
        ]
        self.rows = [[] for _ in self.rows]
        return pa.RecordBatch.from_arrays(arrays, schema=RECORD_SCHEMA)


def read_records(segment: SegmentFile, positions: frozenset[int] | None = None) -> Iterator[pa.RecordBatch]:
    """One row per record of the segment, and one per damaged batch (``RECORD_SCHEMA``).

    ``positions``: decode only the batches at these byte positions (every batch is still CRC-checked).
    """
    columns = _RecordColumns(segment)
    scan = scan_segment(segment)
    try:
        for s in scan:
            if positions is not None and s.position not in positions:
                continue
            if s.header is None:
                columns.add_damage(s)
            else:
                try:
                    columns.add_batch(s)
                except CorruptBatch as exc:  # a valid CRC over records that do not decode
                    columns.add_damage(Scanned(s.position, s.base_offset, s.size_bytes, CORRUPT, str(exc)))
            if len(columns) >= RECORDS_PER_ARROW_BATCH:
                yield columns.flush()
        if len(columns):
            yield columns.flush()
    finally:
        scan.close()
