"""Full validation of one batch before a site stores it. Pure: bytes in, a verdict out.

A site never stores a batch it could not serve (ARCHITECTURE.md, trust rules). The origin append
(``georep/broker/append.py``), the apply of a replicated chunk (``georep/replication/sink.py``) and, through
the origin append, the Kafka gateway's produce all call :func:`validate_batch`, which checks, in order:

1. **Framing**: the header's ``batch_length`` is the buffer's length; the magic is this build's.
2. **CRC-32C** over everything from the magic on. These two raise :class:`CorruptBatch`: damaged bytes.
3. **Header**: ``records_count`` at least 1 and ``last_offset_delta`` one less; a known codec (attributes
   bits 0-2 in 0..4: none, zstd, lz4, gzip, snappy) and the reserved attribute bits 0; no negative timestamp.
4. **Records section**, decompressed into at most ``limit_bytes`` (a topic's ``max_batch_bytes``) by
   ``georep/record/compression.py``, streaming and bounded, so a bomb costs about ``limit_bytes`` of memory.
5. **Records**, walked once: exactly ``records_count`` of them and no byte after the last; each record's
   length inside the section, its attributes 0, its offset delta its index (0..n-1), its key, value and
   header lengths inside the record (-1 for null), its header count what the record can hold, its header keys
   UTF-8; its timestamp (``first_timestamp`` + delta) between 0 and ``max_timestamp``, the first record's
   delta 0, and ``max_timestamp`` the largest record timestamp.
6. **Clock** (the origin only, given a :class:`TimestampWindow`): Kafka's ``message.timestamp.before.max.ms``
   and ``message.timestamp.after.max.ms`` against ``now_ms``, as the topic settings
   ``message_timestamp_before_max_ms`` (default -1: no limit) and ``message_timestamp_after_max_ms`` (default
   one hour), Kafka 4.0's defaults. A replicated batch is never checked against the local clock: an old
   batch is legitimately old, and the clocks of sites differ.

Steps 3 to 6 raise :class:`InvalidBatch` (:class:`RecordsTooLarge` past the limit, :class:`TimestampOutOfRange`
against the clock), whose message names what is wrong and where.

Record timestamps need not be monotone within a batch (Kafka's producers and georep's let a caller set them),
so a delta may be negative; the first record's is 0, as ``encode_batch`` writes it and the layout says.

**Cost.** This is the only place where the broker walks records, once per batch at the origin and once at
each apply. The walk is one ``struct`` unpack of the record head plus two 4-byte unpacks per record, with no
object per record; the checks are folded into one condition per field group, and the slow path
(:func:`_explain`) works out the message only when a record is bad. ``docs/design.md`` gives what it costs.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import crc32c

from georep.record.batch import (
    CRC_START,
    HEADER_BYTES,
    LENGTH_PREFIX_BYTES,
    MAGIC,
    BatchHeader,
    CorruptBatch,
    InvalidBatch,
    RecordsTooLarge,
    decompress_records,
    parse_header,
    walk_records,
)
from georep.record.compression import CODEC_NAMES, COMPRESSION_MASK

__all__ = [
    "CorruptBatch",
    "CrcMismatch",
    "InvalidBatch",
    "RecordsTooLarge",
    "TimestampOutOfRange",
    "TimestampWindow",
    "ValidBatch",
    "check_clock",
    "check_header",
    "check_records",
    "validate_batch",
    "walk_records",
]

_FRAME = struct.Struct(">qi")
_MAGIC_AT = 24
_RESERVED_ATTRIBUTES = 0xFFFF & ~COMPRESSION_MASK
NO_LIMIT = -1


class CrcMismatch(CorruptBatch):
    """The batch's CRC-32C does not match its bytes."""


class TimestampOutOfRange(InvalidBatch):
    """A record timestamp too far from the origin's clock for its topic's ``message_timestamp_*_max_ms``."""


class TimestampWindow(NamedTuple):
    """The origin's clock and a topic's limits on how far record timestamps may be from it (-1: no limit)."""

    now_ms: int
    before_max_ms: int = NO_LIMIT  # Kafka's message.timestamp.before.max.ms (default: unlimited)
    after_max_ms: int = 3_600_000  # Kafka's message.timestamp.after.max.ms (default: one hour)


class ValidBatch(NamedTuple):
    header: BatchHeader
    records_bytes: int  # the records section, decompressed
    min_timestamp: int  # the smallest record timestamp


def validate_batch(batch: bytes | memoryview, limit_bytes: int, window: TimestampWindow | None = None) -> ValidBatch:
    """Validate one whole batch as the module docstring says; ``limit_bytes`` bounds its decompressed records.

    Raises :class:`CorruptBatch` (framing, magic, CRC) or :class:`InvalidBatch` (all the rest)."""
    header = check_header(batch)
    valid = check_records(batch, header, limit_bytes)
    if window is not None:
        check_clock(valid.min_timestamp, header.max_timestamp, window)
    return valid


def check_records(batch: bytes | memoryview, header: BatchHeader, limit_bytes: int) -> ValidBatch:
    """Steps 4 and 5 of the module docstring, for a batch whose header :func:`check_header` passed."""
    body = decompress_records(header, memoryview(batch)[HEADER_BYTES : header.size_bytes], limit_bytes)
    min_delta = walk_records(body, header.records_count, header.first_timestamp, header.max_timestamp)
    return ValidBatch(header, len(body), header.first_timestamp + min_delta)


def check_header(batch: bytes | memoryview) -> BatchHeader:
    """Steps 1 to 3 of the module docstring: framing, magic and CRC (:class:`CorruptBatch`), then the header's
    own fields (:class:`InvalidBatch`)."""
    size = len(batch)
    if size < HEADER_BYTES:
        raise CorruptBatch(f"a batch of {size} bytes is shorter than the {HEADER_BYTES}-byte batch header")
    batch_length = _FRAME.unpack_from(batch, 0)[1]
    if LENGTH_PREFIX_BYTES + batch_length != size:
        raise CorruptBatch(f"its header says {LENGTH_PREFIX_BYTES + batch_length} bytes but it holds {size}")
    if batch[_MAGIC_AT] != MAGIC:
        raise CorruptBatch(f"unsupported batch format version {batch[_MAGIC_AT]} (this build reads {MAGIC})")
    crc = int.from_bytes(batch[20:24], "big")
    actual = crc32c.crc32c(memoryview(batch)[CRC_START:])
    if actual != crc:
        raise CrcMismatch(f"CRC mismatch: the header says {crc:#010x}, the bytes give {actual:#010x}")
    try:
        header = parse_header(batch)
    except CorruptBatch as exc:  # the CRC is valid, so what parse_header still refuses is content
        raise InvalidBatch(str(exc)) from None
    attributes = header.attributes & 0xFFFF
    if header.compression not in CODEC_NAMES:
        known = ", ".join(f"{i} {n}" for i, n in sorted(CODEC_NAMES.items()))
        raise InvalidBatch(
            f"unknown compression codec id {header.compression} in the batch attributes "
            f"{attributes:#06x} (known: {known})"
        )
    if attributes & _RESERVED_ATTRIBUTES:
        raise InvalidBatch(f"reserved bits set in the batch attributes {attributes:#06x}: bits 3-15 must be 0")
    if header.first_timestamp < 0 or header.max_timestamp < 0:
        raise InvalidBatch(
            f"negative timestamp in the batch header: first_timestamp {header.first_timestamp}, "
            f"max_timestamp {header.max_timestamp}"
        )
    return header


def check_clock(min_timestamp: int, max_timestamp: int, window: TimestampWindow) -> None:
    """Step 6: Kafka's before/after checks on the smallest and largest record timestamps."""
    now_ms, before, after = window
    if before >= 0 and now_ms - min_timestamp > before:
        raise TimestampOutOfRange(
            f"a record's timestamp {min_timestamp} is {now_ms - min_timestamp} ms before this site's clock "
            f"({now_ms}), more than the topic's message_timestamp_before_max_ms={before}: send a newer timestamp "
            "or create the topic with a larger message_timestamp_before_max_ms (-1: no limit)"
        )
    if after >= 0 and max_timestamp - now_ms > after:
        raise TimestampOutOfRange(
            f"a record's timestamp {max_timestamp} is {max_timestamp - now_ms} ms after this site's clock "
            f"({now_ms}), more than the topic's message_timestamp_after_max_ms={after}: check the producer's "
            "clock, or create the topic with a larger message_timestamp_after_max_ms (-1: no limit)"
        )
