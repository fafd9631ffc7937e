"""The in-memory origin index: for each origin, where its retained batches are.

Two compact ``array('q')`` per origin, in log order: each batch's next origin
seq (last seq + 1) and its local base offset. Per-origin order (invariant I3)
makes the next seqs increasing, so a lookup is one bisect. Keeping the *next*
seq rather than the base seq answers "the first batch holding a seq >= s"
without assuming an origin's batches are contiguous in this log.

Memory: 16 bytes per batch, about 256 KiB per GiB of 64 KiB batches.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right

from offsets.coordinates import LocalOffset, Origin, OriginSeq


class _OriginBatches:
    __slots__ = ("base_offsets", "next_seqs")

    def __init__(self) -> None:
        self.next_seqs: array[int] = array("q")
        self.base_offsets: array[int] = array("q")


class OriginIndex:
    def __init__(self) -> None:
        self._by_origin: dict[Origin, _OriginBatches] = {}

    def add(self, origin: Origin, next_seq: int, base_offset: int) -> None:
        """Record a batch appended at the log end."""
        batches = self._by_origin.get(origin)
        if batches is None:
            batches = self._by_origin[origin] = _OriginBatches()
        batches.next_seqs.append(next_seq)
        batches.base_offsets.append(base_offset)

    def first_batch_from(self, origin: Origin, seq: OriginSeq) -> LocalOffset | None:
        """Base offset of the first retained batch of ``origin`` that holds a seq >= ``seq``."""
        batches = self._by_origin.get(origin)
        if batches is None:
            return None
        i = bisect_right(batches.next_seqs, seq)
        if i == len(batches.next_seqs):
            return None
        return LocalOffset(batches.base_offsets[i])

    def trim(self, log_start_offset: int) -> None:
        """Forget batches below ``log_start_offset`` (retention deleted their segments)."""
        for batches in self._by_origin.values():
            k = bisect_left(batches.base_offsets, log_start_offset)
            if k:
                del batches.next_seqs[:k]
                del batches.base_offsets[:k]

    def batch_count(self, origin: Origin) -> int:
        batches = self._by_origin.get(origin)
        return 0 if batches is None else len(batches.base_offsets)
