"""Walk a segment file batch by batch, framing and CRC-checking each: what the audit calls a batch's status.

The one definition of ``ok`` / ``corrupt`` / ``torn_tail`` that both audits use: the file audit reads segment
files directly (``spark_jobs/scan.py``), and a node digests its own segments for the live audit
(``georep/storage/digests.py``, the ``ScanDigests`` RPC). Both call :func:`scan_batches`, so a batch the one calls
corrupt the other does too.

Damage is data, never an exception. A batch that cannot be framed, fails its CRC, or breaks offset continuity is
yielded with ``status`` set and ``error`` saying why, at its byte ``position``:

* ``torn_tail``: the damage ends the log's newest segment (``last``) and lies at or above its recovery point:
  what a write in progress, or a crash before an fsync, leaves behind. Not a divergence.
* ``corrupt``: anything else, e.g. damage in a sealed segment, below the recovery point, or followed by more
  batches.

Only the 109-byte header of a batch is decoded; its records are read only because the CRC covers them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from dataclasses import dataclass
from typing import Protocol

from georep.record.batch import LENGTH_PREFIX_BYTES, BatchHeader, CorruptBatch, check_batch, frame_length, parse_header

OK = "ok"
CORRUPT = "corrupt"
TORN_TAIL = "torn_tail"
STATUSES = (OK, CORRUPT, TORN_TAIL)


class Readable(Protocol):
    """What the walk reads through: a file object, or a node's positional reader (``georep/storage/digests.py``)."""

    def seek(self, position: int, /) -> int: ...

    def read(self, n: int, /) -> bytes: ...


@dataclass(frozen=True, slots=True)
class Scanned:
    """One batch of a segment as found: a valid ``header`` and its bytes, or damage (``status``, ``error``)."""

    position: int
    base_offset: int  # the header's, or for damage the offset continuity expected there
    size_bytes: int
    status: str
    error: str | None = None
    header: BatchHeader | None = None
    data: bytes = b""  # the whole batch, for a valid one (empty when the caller asked not to keep it)
    # The offset after the batch when it is known (a valid batch, or damage whose header still frames and parses);
    # None where the walk cannot tell (it ends there).
    next_offset: int | None = None


@dataclass(frozen=True, slots=True)
class ScanBounds:
    """Where a walk over one segment file starts and stops.

    ``position`` must be a batch boundary holding ``base_offset`` (0 and the file's base offset, or a sparse-index
    entry); ``size_bytes`` is the file's size when the scan was planned: nothing at or past it is read.
    ``stop_offset``: stop before a batch whose (expected) base offset is at or past it; None reads to the size.
    """

    base_offset: int
    size_bytes: int
    last: bool  # the log's newest segment: the one a live node appends to
    recovery_point: int  # every batch below this local offset was fsynced and validated
    position: int = 0
    stop_offset: int | None = None


def scan_batches(f: Readable, bounds: ScanBounds, *, keep_data: bool = True) -> Generator[Scanned, None, None]:
    """Every batch of ``f`` within ``bounds``, valid or damaged, read batch by batch from ``bounds.position``.

    ``f`` is positioned by this function (``seek``). A short read (a file truncated meanwhile) is a torn batch.
    ``keep_data``: keep each valid batch's bytes in ``Scanned.data`` (a digest needs only the header).
    """
    end = bounds.size_bytes
    pos = bounds.position
    expected = bounds.base_offset
    f.seek(pos)
    while pos < end and (bounds.stop_offset is None or expected < bounds.stop_offset):
        total: int | None = None
        data = b""
        try:
            prefix = f.read(min(LENGTH_PREFIX_BYTES, end - pos))
            total = frame_length(prefix)
            data = prefix + f.read(min(total, end - pos) - len(prefix))
            header = check_batch(data)
            if header.base_offset != expected:
                raise CorruptBatch(f"batch at byte {pos} has base_offset {header.base_offset}, expected {expected}")
            yield Scanned(
                pos, expected, total, OK, header=header, data=data if keep_data else b"", next_offset=header.next_offset
            )
            expected = header.next_offset
            pos += total
            continue
        except CorruptBatch as exc:
            error = str(exc).replace("at byte 0", f"at byte {pos}")
        complete = total is not None and pos + total <= end
        torn = bounds.last and expected >= bounds.recovery_point and (not complete or pos + (total or 0) == end)
        following: int | None = None
        if complete:
            with contextlib.suppress(CorruptBatch):  # skip a frameable batch, so one bad batch hides no others
                following = expected + parse_header(data).records_count
        yield Scanned(pos, expected, total or end - pos, TORN_TAIL if torn else CORRUPT, error, next_offset=following)
        if not complete or total is None:
            return
        if following is not None:
            expected = following
        pos += total
