"""A node as a member of segment ensembles: what it does with an append, a fence, a copy and a seal. Pure.

The member's fence is :class:`~cluster.quorum.ReplicaGuard` (leader epochs, sealed segments, contiguity);
these functions are the rules around it that every shell applied its own way before issue 21: the node's store
(``georep/storage/replica_store.py``) and both cluster simulators (``georep/sim/cluster_members.py``) call them.

* :func:`judge_append`: an append the guard refuses only because the member already holds it (a leader resends
  from the end it last knew, after a reconnection) is **held**: the member acks its end again and stores
  nothing; one past the member's end is a **gap**, reported to the leader once per end
  (:class:`GapReports`), which resends from there (``cluster/lead.py``, the resend rule).
* :func:`judge_copy`: a recovery's copy is taken only from an epoch at least the member's own fence (it is
  raised to it), and never into a segment the member knows is sealed (a copy of an older, aborted recovery may
  still be on its way).
* :func:`seals_to_learn`: what a member does once its view of the metadata shows seals: its guard refuses the
  partition's sealed segments from then on, and a copy longer than its committed seal is cut to it
  (``cluster.recovery.cut_after_seal``), so a member that was down when the seal was told ends with the
  same bytes as the others.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from cluster import recovery
from cluster.quorum import Fenced, GuardState, NotContiguous, ReplicaGuard, SegmentSealed
from cluster.site_state import SiteState
from topology.ids import LeaderEpoch, SegmentId

PartitionKey = tuple[str, int]
SegmentKey = tuple[str, int, SegmentId]


@dataclass(frozen=True, slots=True)
class Take:
    """Append it at the member's end; ``persist``: the guard's state changed and must be on disk first."""

    persist: bool


@dataclass(frozen=True, slots=True)
class Held:
    """The member holds it already: store nothing, ack its end again."""


@dataclass(frozen=True, slots=True)
class Gap:
    """It starts past the member's end ``end``; ``report``: tell the leader (once per end) to resend from there."""

    end: int
    report: bool


@dataclass(frozen=True, slots=True)
class Refuse:
    """The guard refuses the sender: ``fenced`` (at ``fenced_epoch``: a newer leader fenced this member) or
    ``sealed`` (the segment is sealed here)."""

    why: str
    fenced_epoch: LeaderEpoch
    message: str


AppendVerdict = Take | Held | Gap | Refuse


class GapReports:
    """The ends a member reported gaps at, per segment: one report per end, not one per batch past it."""

    def __init__(self) -> None:
        self._reported: dict[SegmentKey, int] = {}

    def first(self, segment: SegmentKey, end: int) -> bool:
        if self._reported.get(segment) == end:
            return False
        self._reported[segment] = end
        return True


def judge_append(
    guard: ReplicaGuard, epoch: LeaderEpoch, segment: SegmentKey, offset: int, local_end: int, gaps: GapReports
) -> AppendVerdict:
    """What a member does with a leader's batch at ``offset`` of ``segment``, holding it up to ``local_end``."""
    try:
        return Take(guard.check_append(epoch, segment[2], offset, local_end))
    except Fenced as e:
        return Refuse("fenced", e.fenced_epoch, str(e))
    except SegmentSealed as e:
        return Refuse("sealed", guard.fenced_epoch, str(e))
    except NotContiguous:
        if offset < local_end:
            return Held()
        return Gap(local_end, gaps.first(segment, local_end))


def judge_fence(guard: ReplicaGuard, epoch: LeaderEpoch) -> Refuse | None:
    """A new leader of ``epoch`` fences this member: refused if a newer epoch fenced it already; else the fence is
    raised (the shell persists the guard, fsyncs what it holds, and answers its fsynced end)."""
    try:
        guard.fence(epoch)
    except Fenced as e:
        return Refuse("fenced", e.fenced_epoch, str(e))
    return None


def judge_copy(guard: ReplicaGuard, epoch: LeaderEpoch, segment_id: SegmentId) -> Refuse | None:
    """Whether a recovery's copy of ``segment_id`` from the leader of ``epoch`` may be appended here; the fence is
    raised to ``epoch`` when it is (the shell persists the guard before it answers)."""
    refused = judge_fence(guard, epoch)
    if refused is not None:
        return refused
    sealed = guard.state.sealed_through
    if sealed is not None and segment_id <= sealed:
        return Refuse("sealed", guard.fenced_epoch, "the member knows the segment is sealed")
    return None


@dataclass(frozen=True, slots=True)
class GuardSeal:
    """Record in ``key``'s guard that segments up to ``through`` are sealed (no leader may append to them)."""

    key: PartitionKey
    epoch: LeaderEpoch
    through: SegmentId


@dataclass(frozen=True, slots=True)
class CutCopy:
    """Cut this member's copy of ``segment`` back to its committed seal ``end``."""

    segment: SegmentKey
    epoch: LeaderEpoch
    end: int


def seals_to_learn(
    view: SiteState, guards: Mapping[PartitionKey, GuardState], ends: Mapping[SegmentKey, int]
) -> list[GuardSeal | CutCopy]:
    """What a member does about the seals its ``view`` shows, given its guards' states and its copies' ends."""
    out: list[GuardSeal | CutCopy] = []
    for info in view.partitions():
        key = (info.topic, info.partition)
        last = next((s for s in reversed(info.segments) if s.sealed), None)
        if last is None:
            continue
        state = guards.get(key, GuardState())
        epoch = LeaderEpoch(max(info.leader_epoch, state.fenced_epoch, 1))
        if state.sealed_through is None or state.sealed_through < last.segment_id:
            out.append(GuardSeal(key, epoch, last.segment_id))
        for s in info.segments:
            end = ends.get((key[0], key[1], s.segment_id))
            if end is None or s.end_offset is None:
                continue
            cut = recovery.cut_after_seal(end, int(s.end_offset))
            if cut is not None:
                out.append(CutCopy((key[0], key[1], s.segment_id), epoch, int(cut)))
    return out
