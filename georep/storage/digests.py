"""A node's batch digests of one partition log, for the live audit (the ``ScanDigests`` RPC, docs/audit.md). Shell.

A digest is what the file audit's scan makes of a stored batch (``spark_jobs/scan.py``'s ``BATCH_SCHEMA`` row,
without its file): its coordinates, CRC, length and status, judged by the same walk
(:func:`georep.storage.batch_scan.scan_batches`), so the node and the file audit agree on ok, corrupt and
torn_tail. It is read where the data lives and only the digest leaves the node.

:class:`DigestCursor` walks one :class:`~georep.storage.segment_log.SegmentLog` (a one-node site's partition, or a
node's copy of one segment of a multi-node site) over ``[from_offset, end_offset)``, a few digests per
:meth:`DigestCursor.take`, so a handler runs each step in a thread and paces between them. It holds one
descriptor at a time (opened through the process's handle cache, then ``dup``-ed, so eviction never closes it
under the walk), and reads with ``pread`` only: the log's own descriptor position is never moved.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from dataclasses import dataclass

from georep.storage.batch_scan import ScanBounds, Scanned, scan_batches
from georep.storage.segment_log import SegmentLog, scan_fd, scan_plan

READ_BUFFER_BYTES = 1 << 20


class PositionalReader:
    """``read``/``seek`` over ``pread`` on a descriptor, through a buffer of ``READ_BUFFER_BYTES``."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._pos = 0
        self._buf = b""
        self._at = 0

    def seek(self, position: int) -> int:
        self._pos = position
        return position

    def read(self, n: int) -> bytes:
        start = self._pos - self._at
        if not (start >= 0 and start + n <= len(self._buf)):
            self._buf = os.pread(self.fd, max(n, READ_BUFFER_BYTES), self._pos)
            self._at, start = self._pos, 0
        out = self._buf[start : start + n]
        self._pos += len(out)
        return out


@dataclass(frozen=True, slots=True)
class Found:
    """One batch as digested: the segment file it is in (its base offset) and what the walk found."""

    segment_base: int
    scanned: Scanned


class DigestCursor:
    """The batches of ``log`` that hold offsets in ``[from_offset, end_offset)``, in log order (see module doc)."""

    def __init__(self, log: SegmentLog, from_offset: int, end_offset: int) -> None:
        self.log = log
        self.from_offset = from_offset
        self.plan = scan_plan(log, from_offset, end_offset) if from_offset < end_offset else []
        self.done = not self.plan
        self._walk = self._batches()

    def _batches(self) -> Generator[Found, None, None]:
        for segment_base, bounds in self.plan:
            yield from self._segment(segment_base, bounds)

    def _segment(self, segment_base: int, bounds: ScanBounds) -> Generator[Found, None, None]:
        fd = scan_fd(self.log, segment_base)
        if fd is None:
            return  # retention deleted it since the plan: read as empty, as the file audit does
        try:
            for s in scan_batches(PositionalReader(fd), bounds, keep_data=False):
                if s.next_offset is not None and s.next_offset <= self.from_offset:
                    continue  # before the range: walked from the sparse-index entry at or below it
                yield Found(segment_base, s)
        finally:
            os.close(fd)

    def take(self, n: int, max_bytes: int = 1 << 62) -> list[Found]:
        """Up to ``n`` more, and no more once ``max_bytes`` of batches were read (fewer only at the end, which sets
        ``done``). Blocking I/O: call it in a thread."""
        out: list[Found] = []
        read = 0
        for found in self._walk:
            out.append(found)
            read += found.scanned.size_bytes
            if len(out) >= n or read >= max_bytes:
                return out
        self.done = True
        return out

    def close(self) -> None:
        self._walk.close()
