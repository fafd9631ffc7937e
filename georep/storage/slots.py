"""What a segment's bytes hold: whole batches, damage, and what the damage held. Pure.

Recovery at startup and the scrubber (``georep/storage/segment_log.py``) ask :func:`plan_segment` the same
question about one segment's ``.log``: walking it from byte 0 at its base offset, which slots are batches that
can be served as they are, which are damage, and what each damaged slot held. The answer is a
:class:`SegmentPlan`; the shell carries it out (rewrites the indexes, quarantines the lost slots, mends
prefixes, cuts a torn tail) and never decides anything itself.

The rules, from ARCHITECTURE.md's trust rules:

1. **A CRC-valid batch is the truth.** A stamped batch whose CRC-32C matches, at the position the walk has
   reached and with the local offset the walk expects, is a :class:`Good` slot, whatever the origin index says
   about that slot. The index entry is rebuilt from the batch's own header: the index is a cache, and a
   damaged index never makes a good batch look damaged (issue 20, item 2: repair wrote a peer's batch over a
   good one because the index said another seq).
2. **Damage is named by the origin index, and only where the index agrees with the data around it.** At a slot
   whose bytes fail (torn, CRC, framing, no bytes at all), the ``.oindex`` entry written at append time says
   which batch was there. It is believed only if it starts exactly at the walk's byte position and local
   offset, stays inside the segment's offsets, and continues its origin's sequence (I1/I3: a site holds each
   origin as a gap-free prefix, in order, so the seq that must come next for an origin is known from the
   batches before). The slot is then :class:`Lost`: quarantined with those coordinates and repaired by
   coordinate from a peer. The next slot must again be a good batch or believed evidence, or the segment's end.
3. **Damage only in the 24 bytes outside the CRC is mended locally.** When a believed entry's CRC (index
   format 2) matches the CRC-32C of the slot's covered bytes, the records are intact and only the local
   prefix (base offset, length, append time, CRC field) was hit: the slot is :class:`Good` with the prefix to
   write back. Likewise a CRC-valid batch whose only fault is its local base offset, when its seq continues its
   origin; and one whose append time differs from an index entry that matches it in every other field (the
   entry holds the time's second copy precisely because the CRC does not cover it).
4. **Never cut below the durable end.** ``durable_end`` is the local offset below which every batch was
   fsynced (the recovery point, for the active segment at startup; a sealed segment's end otherwise). Damage at
   or above it in the last segment is a torn write of a crash: the rest of the file is cut
   (:attr:`SegmentPlan.cut`), as Kafka's recovery does. Below it, damage is never cut: either the index names it
   (rule 2) or the plan is refused (:attr:`SegmentPlan.refused`), and the node says which file and what to do.
   Cutting there would throw away CRC-valid batches after the damage, and for the site's own origin would let
   it issue the lost seqs again with other records (I1).

Why the coordinates of a :class:`Lost` slot are right when the plan is not refused: every slot is checked
against two independent facts: its offsets tile the segment's offset range with the good batches (which the
CRC vouches for), and its seq range continues its origin exactly where the batches before it left off. A
damaged entry would have to be damaged into another entry that satisfies both, which a bit flip, a torn write
or a zeroed page does not produce; and a repair checks the peer's copy against the slot's length and CRC again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from georep.record.batch import HEADER_BYTES, LENGTH_PREFIX_BYTES, BatchHeader, local_prefix
from georep.storage.index_format import OriginEntry, entry_for

OriginKey = tuple[bytes, int]  # (NUL-padded origin site, epoch), as index entries hold it


class SegmentBytes(Protocol):
    """A read-only view of one segment's ``.log`` (the shell's file; plain bytes in unit tests)."""

    @property
    def size(self) -> int: ...

    def batch_at(self, position: int) -> BatchHeader | str:
        """The stamped, CRC-valid batch starting at ``position``, or why there is none."""
        ...

    def crc_of(self, position: int, size_bytes: int) -> int | None:
        """CRC-32C of the covered bytes of a ``size_bytes`` batch at ``position``; None if they are not all there."""
        ...


@dataclass(frozen=True, slots=True)
class Good:
    """A batch served as it is. ``prefix``: the 24 local bytes to write back, when only they were damaged."""

    entry: OriginEntry
    prefix: bytes | None = None


@dataclass(frozen=True, slots=True)
class Lost:
    """A damaged slot whose coordinates the origin index names: quarantined until a peer's copy fills it."""

    entry: OriginEntry
    reason: str


@dataclass(frozen=True, slots=True)
class SegmentPlan:
    slots: tuple[Good | Lost, ...]
    end_position: int  # bytes of the .log the slots cover
    next_offset: int  # the local offset after the last slot
    cut: str | None = None  # why the bytes from end_position on are cut (a torn tail, or bytes after the last batch)
    refused: str | None = None  # damage below the durable end that nothing names: the shell refuses the segment

    @property
    def entries(self) -> list[OriginEntry]:
        return [s.entry for s in self.slots]

    @property
    def lost(self) -> list[Lost]:
        return [s for s in self.slots if isinstance(s, Lost)]

    @property
    def mended(self) -> list[Good]:
        return [s for s in self.slots if isinstance(s, Good) and s.prefix is not None]


def plan_segment(
    base_offset: int,
    data: SegmentBytes,
    evidence: Sequence[OriginEntry] | None,
    *,
    next_base: int | None,
    durable_end: int,
    running: Mapping[OriginKey, int],
    trusted: Sequence[OriginEntry] = (),
) -> SegmentPlan:
    """Walk one segment and decide every slot; see the module docstring.

    ``next_base``: the next segment's base offset (a sealed segment must end exactly there), or None for the last.
    ``running``: each origin's next seq after the batches before this segment, where known.
    ``trusted``: the segment's first origin-index entries, taken as good slots without reading their bytes (the
    caller checked they tile the segment from byte 0 and end at or below the durable end: see
    :func:`trusted_prefix`); the walk starts after them.
    """
    walk = _Walk(base_offset, data, {e.position: e for e in evidence or ()}, next_base, dict(running))
    for kept in trusted:
        walk.slots.append(Good(kept))
        walk.running[kept.origin_key] = kept.next_origin_seq
        walk.position, walk.offset = kept.end_position, kept.next_offset
    ends = [data.size, *(e.end_position for e in evidence or ())]
    for _ in range(max(ends) // HEADER_BYTES + 2):  # every step moves at least one header's length
        if next_base is not None and walk.offset >= next_base:
            break
        entry = walk.evidence.get(walk.position)
        if walk.position >= data.size and (entry is None or walk.offset >= durable_end):
            break  # the bytes end here: above the durable end, later entries were appended and lost in a crash
        found = data.batch_at(walk.position) if walk.position < data.size else f"the file ends at byte {data.size}"
        if walk.take_good(found):
            continue
        reason = found if isinstance(found, str) else walk.misplaced(found)
        if walk.offset >= durable_end:
            return walk.plan(cut=f"torn tail at byte {walk.position} (offset {walk.offset}): {reason}")
        if not walk.take_evidence(entry, reason):
            return walk.plan(
                refused=f"byte {walk.position} (offset {walk.offset}): {reason}, and the origin index "
                "names no batch that fits there"
            )
    return walk.finish(durable_end)


def trusted_prefix(
    base_offset: int, size: int, evidence: Sequence[OriginEntry], durable_end: int, running: Mapping[OriginKey, int]
) -> list[OriginEntry]:
    """The longest run of ``evidence`` from byte 0 that a recovery may take without reading the batches: entries
    that tile the segment byte for byte and offset for offset, continue each origin's seqs, lie inside its
    ``size`` bytes and end at or below ``durable_end`` (the recovery point: everything below it was fsynced).

    The same trust as a sealed segment's below the recovery point: what the index cannot show (a flipped byte
    in a batch) the scrubber and every read find later, and quarantine. Nothing here is ever cut.
    """
    seqs = dict(running)
    position, offset = 0, base_offset
    out: list[OriginEntry] = []
    for e in evidence:
        if e.position != position or e.base_offset != offset or e.size_bytes < HEADER_BYTES or e.last_offset_delta < 0:
            break
        if e.next_offset > durable_end or e.end_position > size:
            break
        if seqs.get(e.origin_key, e.base_origin_seq) != e.base_origin_seq:
            break
        seqs[e.origin_key] = e.next_origin_seq
        out.append(e)
        position, offset = e.end_position, e.next_offset
    return out


@dataclass(slots=True)
class _Walk:
    offset: int
    data: SegmentBytes
    evidence: dict[int, OriginEntry]
    next_base: int | None
    running: dict[OriginKey, int]
    position: int = 0
    slots: list[Good | Lost] = field(default_factory=list)

    def take_good(self, found: BatchHeader | str) -> bool:
        if isinstance(found, str) or not self._inside(found.next_offset):
            return False
        if found.base_offset == self.offset:
            entry = entry_for(found, self.offset, self.position, found.append_time_ms)
            indexed = self.evidence.get(self.position)
            only_time = indexed is not None and indexed == replace(entry, append_time_ms=indexed.append_time_ms)
            if indexed is not None and indexed != entry and only_time:
                # The append time is outside the CRC; the index entry, intact in every other field, holds the
                # second copy that exists to catch exactly this (rule 3).
                prefix = local_prefix(self.offset, found.batch_length, indexed.append_time_ms, found.crc)
                self._advance(Good(indexed, prefix))
            else:
                self._advance(Good(entry))
            return True
        entry = entry_for(found, self.offset, self.position, found.append_time_ms)
        if self.running.get(entry.origin_key) != entry.base_origin_seq:
            return False  # a valid batch whose local offset is wrong, and nothing vouches for where it belongs
        prefix = local_prefix(self.offset, found.batch_length, found.append_time_ms, found.crc)
        self._advance(Good(entry, prefix))
        return True

    def take_evidence(self, entry: OriginEntry | None, reason: str) -> bool:
        if entry is None or not self._fits(entry):
            return False
        if self.data.crc_of(self.position, entry.size_bytes) == entry.crc:
            prefix = local_prefix(self.offset, entry.size_bytes - LENGTH_PREFIX_BYTES, entry.append_time_ms, entry.crc)
            self._advance(Good(entry, prefix))
        else:
            self._advance(Lost(entry, reason))
        return True

    def misplaced(self, found: BatchHeader) -> str:
        return (
            f"the batch there has base_offset {found.base_offset} and {found.records_count} record(s); the "
            f"segment expects offset {self.offset}"
            + ("" if self.next_base is None else f" and ends at {self.next_base}")
        )

    def finish(self, durable_end: int) -> SegmentPlan:
        if self.next_base is not None and self.offset != self.next_base and self.position < self.data.size:
            return self.plan(
                refused=f"the segment's batches end at offset {self.offset} (byte {self.position}), "
                f"its next segment starts at {self.next_base}, and the origin index names "
                "nothing in between"
            )
        # A whole segment that ends short of the next one: the offsets between lie in a missing segment, which
        # the caller refuses as such (SegmentPlan.next_offset says where the gap begins).
        if self.next_base is None and self.offset < durable_end:
            return self.plan(
                refused=f"the log ends at offset {self.offset}, below the recovery point {durable_end}, "
                "and the origin index names nothing in between"
            )
        if self.position < self.data.size:
            return self.plan(cut=f"{self.data.size - self.position} byte(s) after the segment's last batch")
        return self.plan()

    def plan(self, cut: str | None = None, refused: str | None = None) -> SegmentPlan:
        return SegmentPlan(tuple(self.slots), self.position, self.offset, cut, refused)

    def _fits(self, entry: OriginEntry) -> bool:
        continues = self.running.get(entry.origin_key, entry.base_origin_seq) == entry.base_origin_seq
        return (
            entry.position == self.position
            and entry.base_offset == self.offset
            and continues
            and entry.size_bytes >= HEADER_BYTES
            and entry.last_offset_delta >= 0
            and entry.base_origin_seq >= 0
            and self._inside(entry.next_offset)
        )

    def _inside(self, next_offset: int) -> bool:
        return self.next_base is None or next_offset <= self.next_base

    def _advance(self, slot: Good | Lost) -> None:
        self.slots.append(slot)
        entry = slot.entry
        self.running[entry.origin_key] = entry.next_origin_seq
        self.position = entry.end_position
        self.offset = entry.next_offset
