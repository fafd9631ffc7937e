"""Dedup at apply: which replicated batches a destination site appends. Pure.

A destination site pulls whole batches from an upstream and must keep, for
every origin, a contiguous prefix of that origin's sequence (ARCHITECTURE.md,
I1-I3). :func:`plan_apply` takes the site's vector and the headers of one pull
response, in the order the upstream sent them, and decides for each batch,
without I/O and without looking at a single record:

* ``last < next``: :class:`Covered`. The site already holds the whole batch, or
  an earlier batch of this response already brings it: a duplicate from a
  cycle in the topology, a resend, or a second upstream. It is skipped. This is
  what ARCHITECTURE.md calls *trimming*: it happens at batch granularity, and a
  batch is either appended whole or not at all.
* ``base == next``: :class:`Append`; ``next`` moves to ``last + 1``.
* ``base < next <= last``: :class:`PartialOverlap`. Not appended; the origin is
  blocked for the rest of the response (see below for why this means
  divergence).
* ``base > next``: :class:`Gap`. Not appended, and nothing later of that origin
  in this response is appended either (:class:`BlockedByGap`): a site never
  appends past a gap. Other origins go on independently.
* A header whose seq range is not a stamped, non-empty range: :class:`Malformed`;
  it blocks its origin like a partial overlap.

``next`` is a running value per origin: it starts at ``have.get(origin)`` and
advances as batches are planned for append, so one response may carry several
consecutive batches of one origin. A batch that the running ``next`` covers is
:class:`Covered` even after its origin is blocked, because skipping it loses
nothing; only the batches the site still needs are reported as blocked.

Why a partial overlap cannot happen between correct sites: the origin cuts
its sequence into batches once, when it accepts each write, and every site
copies those batches verbatim (the CRC covers the origin header and records,
and ARCHITECTURE.md forbids re-batching). A site's vector only ever advances
by whole batches, so for every origin it sits on a boundary of the origin's
own batching, and every batch it receives starts and ends on such a boundary.
A boundary ``next`` therefore lies either at or before a batch's base, or
after its last seq, never strictly inside. A batch that straddles ``next``
means the upstream's boundaries differ from ours: its batches are not the
origin's (divergence, or a bug somewhere that re-batched or restamped them).
Cutting the batch to its uncovered part would need new bytes and a new CRC,
and would append records whose identity we cannot vouch for; so it is never
appended, and the caller surfaces it as divergence.

The caller (the replication shell) appends the batches at
:attr:`ApplyPlan.append_indexes`, in that order, and its vector becomes
:attr:`ApplyPlan.vector` once they are durable. :func:`plan_apply` only
reads; running it twice on the same input gives the same plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from offsets.coordinates import Origin, OriginSeq
from offsets.vector import SEQ_MAX, VectorOffset


class BatchSpan(Protocol):
    """What apply needs of a batch header (``georep.record.batch.BatchHeader`` fits)."""

    @property
    def origin(self) -> Origin: ...

    @property
    def base_origin_seq(self) -> OriginSeq: ...

    @property
    def last_origin_seq(self) -> OriginSeq: ...


def _range(base: int, last: int) -> str:
    return f"origin seqs {base}..{last}"


@dataclass(frozen=True, slots=True)
class Append:
    """The batch extends the vector contiguously: append it."""

    origin: Origin
    base_origin_seq: OriginSeq
    last_origin_seq: OriginSeq

    def message(self) -> str:
        return (
            f"{self.origin} {_range(self.base_origin_seq, self.last_origin_seq)} extend the vector: "
            f"appended; next {self.origin} seq is {self.last_origin_seq + 1}"
        )


@dataclass(frozen=True, slots=True)
class Covered:
    """Every record of the batch is already held (or planned earlier in this response): skipped."""

    origin: Origin
    base_origin_seq: OriginSeq
    last_origin_seq: OriginSeq
    next_origin_seq: OriginSeq  # the running next when the batch was seen

    def message(self) -> str:
        return (
            f"{self.origin} {_range(self.base_origin_seq, self.last_origin_seq)} are already held "
            f"(vector is at {self.next_origin_seq}): duplicate skipped, nothing stored twice"
        )


@dataclass(frozen=True, slots=True)
class Gap:
    """The batch starts after the vector: appending it would leave a hole."""

    origin: Origin
    expected: OriginSeq
    got: OriginSeq
    last_origin_seq: OriginSeq

    def message(self) -> str:
        return (
            f"{self.origin} {_range(self.got, self.last_origin_seq)} start after a gap: expected seq "
            f"{self.expected}, got {self.got}. Not appended, nor anything later of {self.origin} in this "
            f"response; the missing seqs {self.expected}..{self.got - 1} must come first (from this or "
            "another upstream)"
        )


@dataclass(frozen=True, slots=True)
class PartialOverlap:
    """The batch straddles the vector: its boundaries are not the origin's. Divergence; never appended."""

    origin: Origin
    base_origin_seq: OriginSeq
    last_origin_seq: OriginSeq
    next_origin_seq: OriginSeq

    def message(self) -> str:
        return (
            f"divergence: {self.origin} {_range(self.base_origin_seq, self.last_origin_seq)} straddle this "
            f"site's vector ({self.next_origin_seq}); the origin's batches never do, so the upstream holds "
            f"batches the origin did not cut. Not appended; {self.origin} is blocked for the rest of this "
            "response. Run the consistency audit on both sites"
        )


@dataclass(frozen=True, slots=True)
class Malformed:
    """The header has no valid origin seq range (unstamped, empty or beyond the seq limit)."""

    origin: Origin
    base_origin_seq: OriginSeq
    last_origin_seq: OriginSeq
    reason: str

    def message(self) -> str:
        return (
            f"invalid replicated batch from {self.origin} with {_range(self.base_origin_seq, self.last_origin_seq)}: "
            f"{self.reason}. Not appended; {self.origin} is blocked for the rest of this response"
        )


@dataclass(frozen=True, slots=True)
class BlockedByGap:
    """A batch the site still needs, after a gap of its origin earlier in this response."""

    origin: Origin
    base_origin_seq: OriginSeq
    last_origin_seq: OriginSeq
    gap: Gap

    def message(self) -> str:
        return (
            f"{self.origin} {_range(self.base_origin_seq, self.last_origin_seq)} not appended: waiting for "
            f"seqs {self.gap.expected}..{self.gap.got - 1}, missing earlier in this response"
        )


@dataclass(frozen=True, slots=True)
class BlockedByDivergence:
    """A batch the site still needs, after a partial overlap or malformed batch of its origin."""

    origin: Origin
    base_origin_seq: OriginSeq
    last_origin_seq: OriginSeq
    cause: PartialOverlap | Malformed

    def message(self) -> str:
        return (
            f"{self.origin} {_range(self.base_origin_seq, self.last_origin_seq)} not appended: an earlier "
            f"batch of {self.origin} in this response was rejected ({self.cause.message()})"
        )


Decision = Append | Covered | Gap | PartialOverlap | Malformed | BlockedByGap | BlockedByDivergence


@dataclass(frozen=True, slots=True)
class ApplyPlan:
    """What to do with one response's batches.

    ``decisions[i]`` is the decision for ``headers[i]``. ``append_indexes``
    lists the batches to append, in order. ``vector`` is the site's vector
    after those appends. ``gaps`` holds the first gap of each origin that hit
    one; ``overlaps`` and ``malformed`` the batches that mean divergence.
    """

    decisions: tuple[Decision, ...]
    append_indexes: tuple[int, ...]
    vector: VectorOffset
    gaps: Mapping[Origin, Gap]
    overlaps: tuple[PartialOverlap, ...]
    malformed: tuple[Malformed, ...]

    @property
    def diverged(self) -> bool:
        """Whether the response holds batches no correct upstream sends."""
        return bool(self.overlaps or self.malformed)

    def blocked_origins(self) -> list[Origin]:
        """Origins that stopped on a gap or a rejected batch, sorted: the caller should fetch them again."""
        blocked = set(self.gaps)
        blocked.update(d.origin for d in self.overlaps)
        blocked.update(d.origin for d in self.malformed)
        return sorted(blocked)


def _malformed_reason(base: int, last: int) -> str | None:
    if base < 0:
        return "the origin seq is unstamped or negative; only origin-stamped batches replicate"
    if last < base:
        return "the last origin seq is before the base origin seq"
    if last >= SEQ_MAX:
        return f"the last origin seq reaches the limit {SEQ_MAX}"
    return None


def extends(have: VectorOffset, header: BatchSpan) -> bool:
    """Whether ``header``'s batch extends ``have`` contiguously (it would be appended first)."""
    base = header.base_origin_seq
    return base == have.get(header.origin) and _malformed_reason(base, header.last_origin_seq) is None


def plan_apply(have: VectorOffset, headers: Sequence[BatchSpan]) -> ApplyPlan:
    """Decide, batch by batch, which of ``headers`` extend ``have``; see the module docstring for the rules."""
    next_seq: dict[Origin, int] = {}
    blocked: dict[Origin, Gap | PartialOverlap | Malformed] = {}
    decisions: list[Decision] = []
    append_indexes: list[int] = []
    gaps: dict[Origin, Gap] = {}
    overlaps: list[PartialOverlap] = []
    malformed: list[Malformed] = []
    for index, header in enumerate(headers):
        origin = header.origin
        base = header.base_origin_seq
        last = header.last_origin_seq
        nxt = next_seq.get(origin)
        if nxt is None:
            nxt = next_seq[origin] = have.get(origin)
        decision: Decision
        reason = _malformed_reason(base, last)
        if reason is not None:
            decision = Malformed(origin, base, last, reason)
            malformed.append(decision)
            blocked.setdefault(origin, decision)
        elif last < nxt:
            decision = Covered(origin, base, last, OriginSeq(nxt))
        elif origin in blocked:
            cause = blocked[origin]
            decision = (
                BlockedByGap(origin, base, last, cause)
                if isinstance(cause, Gap)
                else BlockedByDivergence(origin, base, last, cause)
            )
        elif base == nxt:
            decision = Append(origin, base, last)
            next_seq[origin] = last + 1
            append_indexes.append(index)
        elif base < nxt:
            decision = PartialOverlap(origin, base, last, OriginSeq(nxt))
            overlaps.append(decision)
            blocked[origin] = decision
        else:
            decision = Gap(origin, OriginSeq(nxt), base, last)
            gaps[origin] = decision
            blocked[origin] = decision
        decisions.append(decision)
    if append_indexes:
        entries = have.to_dict()
        entries.update((origin, OriginSeq(seq)) for origin, seq in next_seq.items())
        vector = VectorOffset(entries)
    else:
        vector = have
    return ApplyPlan(tuple(decisions), tuple(append_indexes), vector, gaps, tuple(overlaps), tuple(malformed))
