"""What a node does about each partition it leads, or is named to lead. Pure.

The site's metadata (``cluster/site_state.py``) names one leader per
partition and epoch; the controller proposes the elections
(``plan_leadership``). Everything a node then decides about leading is here,
so that the node's shell and the cluster simulator (``georep/sim/cluster.py``)
drive the same rules:

* :func:`role_step`: from the node's view of the metadata, whether it starts
  leading (and whether it must recover its predecessor's open segment first),
  steps down, or must ask for a new epoch before it may lead;
* :func:`plan_open`: once nothing is open (or the open segment is its own),
  which segment to write: adopt its own open segment, wait for the view to
  catch up, or propose the next segment on an ensemble from
  :func:`~cluster.placement.choose_ensemble`: ``replication_factor`` live
  nodes, or as many as are eligible down to the ack quorum;
* :func:`roll_seal_at`: when a leader rolling its segment seals it, and at
  which end;
* :func:`node_loads`: what placement knows of every node, derived from the
  metadata alone, so every node computes the same ensembles.

**Why a node asks for a new epoch instead of leading the one it was given.**
Leading an epoch means being the only writer of that epoch: members refuse
any older one, and the recovery proofs (``cluster/recovery.py``) count on it.
A node may hold an epoch it cannot write in:

* it was granted before this incarnation of the node started: the previous
  incarnation may have written under it (batches on members that this one
  never saw), so this one must fence its old self with a newer epoch;
* it gave the epoch up (it stepped down, say after a refused roll): its
  state for the epoch is gone;
* the open segment was opened in that very epoch: only the incarnation that
  opened it knows what it sent, and it is not this one (a running leader
  keeps its role and never asks).

In each case :class:`AskEpoch` re-elects the node itself, a compare-and-set
on the current epoch: if anything changed meanwhile, it is refused and the
next view decides again.

**Why the leader recovers before it opens.** An open segment of an older
epoch may hold acknowledged batches on some members only; the new leader
must seal it at an end at or above every ack (``SegmentRecovery``) before a
new segment may start at that end. With nothing open, there is nothing to
recover: it opens the next segment at the sealed end.

**Why a segment may open on fewer than ``replication_factor`` nodes, but not
on fewer than the ack quorum** (``min_ensemble``, Kafka's behaviour: a
partition takes writes while ``min_insync_replicas`` replicas are in sync,
where a BookKeeper ledger needs its whole ensemble). Let E be the ensemble
the metadata records for the segment and AQ the ack quorum, with
AQ <= E <= RF:

* *Every acknowledged write is still on AQ fsynced members.* The LAC is the
  AQ-th largest fsynced end among the E members (``cluster/quorum.py``),
  which is defined for any E >= AQ; ``acks=all`` is released at the LAC. So
  what ``acks=all`` promises (AQ copies, surviving AQ - 1 member losses)
  does not depend on E.
* *Recovery still finds every acknowledged write.* It fences and reads
  E - AQ + 1 members of the segment's own ensemble, and any E - AQ + 1 of E
  members include one of any AQ of them (pigeonhole), whatever E is. The
  new leader comes from that ensemble, as before. (Repair changes the
  ensembles of sealed segments only, so the ensemble recovery reads is the
  one the writer streamed to.)
* *Below AQ nothing could be confirmed*: the LAC needs AQ members, so a
  segment on fewer would take writes and never acknowledge one, and its
  producers would retry into it for nothing. :class:`Blocked` says so.
* *What a short segment lacks is margin, not a promise*: it survives
  E - AQ member losses without its writes stopping (RF - AQ on a whole
  ensemble), and holds E copies rather than RF. Repair restores both
  (``cluster/repair.py``): a sealed segment below RF is copied to more live
  nodes until it has RF members, and an open one is rolled, so that the
  next segment opens on RF nodes, as soon as a node outside its ensemble is
  eligible. Placement never opens short while more nodes are eligible.

**Why a roll seals at the LAC.** A leader rolls by sealing its own open
segment: it stops appending, waits until everything it appended is
confirmed (the LAC reaches the appended end) or until ``roll_wait_ms`` has
passed (a member is slow or gone), and seals at the LAC: every batch below
it is held by ``min_insync_replicas`` members, and no batch at or above it
was acknowledged. From then on the leader releases no ack past that end,
even if late member acks raise the LAC: those batches are cut by the seal
and their producers retry them in the next segment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cluster import placement
from cluster.site_state import ElectLeader, OpenSegment, PartitionInfo, SegmentInfo, SiteState
from offsets.coordinates import LocalOffset
from topology.ids import LeaderEpoch, NodeId, SegmentId

# -- role ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Lead:
    """Start leading the partition in ``epoch``; first recover ``recover`` (the predecessor's open segment)."""

    epoch: LeaderEpoch
    recover: SegmentInfo | None


@dataclass(frozen=True, slots=True)
class StepDown:
    """Stop leading: fail what waits on this leader, and write nothing more."""

    reason: str


@dataclass(frozen=True, slots=True)
class AskEpoch:
    """Propose ``command`` (this node re-elected, on the current epoch) before leading."""

    command: ElectLeader


RoleStep = Lead | StepDown | AskEpoch


def role_step(
    info: PartitionInfo,
    me: NodeId,
    leading: LeaderEpoch | None,
    done_epoch: LeaderEpoch,
    granted_to_this_incarnation: bool,
) -> RoleStep | None:
    """What node ``me`` does about partition ``info`` as its view shows it; None: nothing.

    ``leading`` is the epoch it leads in now (None if it does not), ``done_epoch`` the newest epoch it gave up
    for this partition (0 if none), and ``granted_to_this_incarnation`` whether the election that gave the
    current epoch committed after this incarnation of the node started. See the module docstring.
    """
    if leading is not None:
        if info.leader != me or info.leader_epoch != leading:
            return StepDown(f"the metadata names node {info.leader} leader in epoch {info.leader_epoch}")
        return None
    if info.leader != me:
        return None
    epoch = info.leader_epoch
    open_segment = info.open_segment
    own_open = open_segment is not None and open_segment.opened_epoch == epoch
    if done_epoch >= epoch or not granted_to_this_incarnation or own_open:
        return AskEpoch(ElectLeader(info.topic, info.partition, me, epoch))
    return Lead(epoch, open_segment)


# -- opening the next segment ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Adopt:
    """Write segment ``segment_id``, open at ``base_offset`` on ``ensemble`` (this leader opened it), acked by its
    ``ack_quorum`` (None: opened before segments recorded it, the site's)."""

    segment_id: SegmentId
    base_offset: LocalOffset
    ensemble: tuple[NodeId, ...]
    ack_quorum: int | None = None


@dataclass(frozen=True, slots=True)
class ProposeOpen:
    """Propose ``command``; on ``Applied`` adopt the segment it names."""

    command: OpenSegment


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing to do until the view changes: ``reason`` says why."""

    reason: str


@dataclass(frozen=True, slots=True)
class Blocked:
    """No ensemble can be placed now (fewer eligible nodes than the smallest ensemble): try again later; ``reason``
    says why. The partition takes no writes meanwhile."""

    reason: str


OpenStep = Adopt | ProposeOpen | Wait | Blocked


def plan_open(
    info: PartitionInfo,
    me: NodeId,
    epoch: LeaderEpoch,
    sealed_through: SegmentId | None,
    previous: Sequence[NodeId],
    loads: Sequence[placement.NodeLoad],
    replication_factor: int,
    *,
    min_ensemble: int | None = None,
    ack_quorum: int | None = None,
) -> OpenStep:
    """What the leader of ``epoch`` does to have a segment to write.

    ``sealed_through`` is the last segment this leader sealed itself (its roll or its recovery), so a view that
    still shows that segment open is only behind; ``previous`` is the ensemble of the segment before the next one
    (the sealed one, if the view has no segments yet).

    The next segment opens on ``replication_factor`` nodes, or on every eligible node while fewer are eligible,
    as long as they are at least ``min_ensemble``: pass the ack quorum (``min_insync_replicas``), which is the
    least that can confirm a write (see the module docstring). Below it, :class:`Blocked`. ``None`` keeps the
    whole-ensemble rule: ``replication_factor`` nodes or :class:`Blocked`. ``ack_quorum``: the topic's
    ``min_insync_replicas`` now, which the new segment records (its recovery needs it, ``cluster/recovery.py``).
    """
    if info.leader != me or info.leader_epoch != epoch:
        return Wait(f"the view names node {info.leader} in epoch {info.leader_epoch}")
    open_segment = info.open_segment
    if open_segment is not None and sealed_through is not None and open_segment.segment_id <= sealed_through:
        return Wait(f"the view still shows segment {open_segment.segment_id} open, which this leader sealed")
    if open_segment is not None:
        if open_segment.opened_epoch == epoch:
            return Adopt(
                open_segment.segment_id, open_segment.base_offset, open_segment.ensemble, open_segment.ack_quorum
            )
        return Wait(f"segment {open_segment.segment_id} is open from epoch {open_segment.opened_epoch}: recover it")
    base = info.next_base_offset
    assert base is not None  # no open segment: the chain ends sealed, or is empty
    before = info.segments[-1].ensemble if info.segments else tuple(previous)
    try:
        ensemble = placement.choose_ensemble(
            loads,
            replication_factor,
            leader=me,
            previous=before,
            salt=placement.partition_salt(info.topic, info.partition),
            min_size=min_ensemble,
        )
    except placement.PlacementError as exc:
        return Blocked(
            f"cannot place the next segment of {info.topic}/{info.partition}, and it takes no writes "
            f"until it can: {exc}"
        )
    return ProposeOpen(OpenSegment(info.topic, info.partition, epoch, LocalOffset(base), ensemble, ack_quorum))


# -- rolling ----------------------------------------------------------------------------------------------------


def roll_seal_at(lac: int, appended_end: int, rolling_since_ms: int, now_ms: int, roll_wait_ms: int) -> int | None:
    """Where a rolling leader seals its segment now (the LAC), or None to wait for more acks.

    It waits until every appended batch is confirmed, but not longer than ``roll_wait_ms``: a member that is
    slow or gone would hold the roll up, and a seal at the LAC loses nothing that was acknowledged.
    """
    if lac < appended_end and now_ms - rolling_since_ms < roll_wait_ms:
        return None
    return lac


# -- what placement knows ----------------------------------------------------------------------------------------


def open_loads(state: SiteState) -> dict[NodeId, int]:
    """Per node, the open segments whose ensemble it is in: the streams being written to it (computed once per
    version of the state: a node reports it at every heartbeat)."""
    return dict(state.derived("open_loads", _open_loads))


def _open_loads(state: SiteState) -> dict[NodeId, int]:
    load: dict[NodeId, int] = {}
    for info in state.partitions():
        open_segment = info.open_segment
        if open_segment is not None:
            for member in open_segment.ensemble:
                load[member] = load.get(member, 0) + 1
    return load


def node_loads(state: SiteState, now_ms: int, session_timeout_ms: int) -> list[placement.NodeLoad]:
    """Every node as placement sees it, from the metadata alone (so every node places alike)."""
    load = open_loads(state)
    return [
        placement.NodeLoad(n, info.free_bytes, load.get(n, 0), info.is_live(now_ms, session_timeout_ms), info.draining)
        for n, info in state.nodes().items()
    ]
