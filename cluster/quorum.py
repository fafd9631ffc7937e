"""The write quorum of one segment, and the fence a member keeps. Pure.

Inside a site (ARCHITECTURE.md, "Inside a site: the segment cluster") a
partition is a chain of segments; each segment has an *ensemble* of
``replication_factor`` nodes, the partition leader among them. The leader
assigns offsets, appends locally and streams each batch to the other members,
which fsync it and ack with the end offset they hold fsynced.

**Leader side: :class:`SegmentQuorum`**, one per open segment.

* Every member has an *end*: the exclusive end offset it reported holding
  fsynced (:meth:`SegmentQuorum.member_acked`); the leader's own fsync is
  reported the same way and counts as one member. Before any report a member's
  end is the segment's ``base_offset``.
* Ends only move forward. A report below a member's end is stale (an ack that
  arrived after a later one, or again after a reconnection) and is ignored: the
  fsync it reported once is still true. A report from a node outside the
  ensemble (:class:`NotAMember`), or outside ``base_offset .. appended end``
  (:class:`AckOutOfRange`: a member cannot hold what the leader never sent), is
  refused: it is a bug or a message meant for another segment, and counting it
  could release an ack the data does not back.
* The *last add confirmed* (:attr:`SegmentQuorum.lac`) is the ``ack_quorum``-th
  largest member end: the highest offset that ``ack_quorum`` members
  (``min_insync_replicas``) hold fsynced. Since every end only grows, so does
  the LAC; it never moves back. ``acks=all`` is released at the LAC, and
  readers, consumers and cross-site pulls see only offsets below it, so nothing
  a recovery could cut is ever acknowledged or seen (I6).
* A member whose stream broke (:meth:`SegmentQuorum.member_failed`) stays in
  the ensemble, and what it reported still counts: its fsyncs happened. It only
  stops counting towards :attr:`SegmentQuorum.can_reach_quorum`, which says
  whether enough members are left to confirm anything new;
  :class:`QuorumLost` tells the leader the moment it is not, so it can act
  (reconnect, or replace members) rather than let ``acks=all`` wait.
* :meth:`SegmentQuorum.lagging` lists the live followers behind the appended
  end: where to resend from once a stream is back.

**Member side: :class:`ReplicaGuard`**, one per partition a node stores. It
keeps the highest leader epoch the member was fenced at or accepted, and the
last sealed segment of the partition's chain. An append is refused if it
carries an older epoch (:class:`Fenced`: its sender is no longer the leader),
targets a sealed segment (:class:`SegmentSealed`), or does not start at the
member's local end (:class:`NotContiguous`: the leader resends from there).
A refused call changes nothing; an append or seal carrying a newer epoch raises
the fence to it. Its whole state is :class:`GuardState`, two integers.

Every error is a :class:`QuorumError` with a message that says what to do;
the gRPC layer maps them to status codes, never this module.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from topology.ids import LeaderEpoch, NodeId, SegmentId


def last_add_confirmed(ends: Iterable[int], ack_quorum: int) -> int:
    """The LAC: the ``ack_quorum``-th largest member end, the highest offset ``ack_quorum`` members hold fsynced."""
    return sorted(ends, reverse=True)[ack_quorum - 1]


# -- errors ------------------------------------------------------------------------------------------


class QuorumError(Exception):
    """Base of the errors of this module; ``str(exc)`` says what to do."""


class InvalidEnsemble(QuorumError):
    """A segment's ensemble, ack quorum or leader that cannot work together."""


class NotAMember(QuorumError):
    """A report about a node that is not in the segment's ensemble."""


class AckOutOfRange(QuorumError):
    """A member reported an end before the segment's base or beyond what the leader appended."""


class AppendWentBack(QuorumError):
    """The leader reported an appended end below one it reported before."""


class Fenced(QuorumError):
    """A request carries a leader epoch older than the one the member is fenced at."""

    def __init__(self, sender_epoch: LeaderEpoch, fenced_epoch: LeaderEpoch) -> None:
        super().__init__(
            f"fenced: leader epoch {sender_epoch} is older than epoch {fenced_epoch}, which this member is fenced "
            f"at; the sender is no longer the partition's leader: it must stop writing, fail its pending acks, "
            "and let producers find the current leader in the site's metadata"
        )
        self.sender_epoch = sender_epoch
        self.fenced_epoch = fenced_epoch


class NotContiguous(QuorumError):
    """An append that does not start at the member's local end."""

    def __init__(self, segment_id: SegmentId, offset: int, local_end: int) -> None:
        super().__init__(
            f"append at offset {offset} to segment {segment_id} does not start at this member's local end "
            f"{local_end}: the leader must resend from offset {local_end}"
        )
        self.segment_id = segment_id
        self.offset = offset
        self.local_end = local_end


class SegmentSealed(QuorumError):
    """An append to a segment that is sealed at this member."""

    def __init__(self, segment_id: SegmentId, sealed_through: SegmentId) -> None:
        super().__init__(
            f"segment {segment_id} is sealed at this member (segments up to {sealed_through} are): it takes no "
            "more appends; the current leader writes to a new segment with its own ensemble"
        )
        self.segment_id = segment_id
        self.sealed_through = sealed_through


# -- leader side: one open segment's quorum -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LacAdvanced:
    """The LAC moved up to ``lac`` (exclusive end offset): release ``acks=all`` and serve up to it."""

    lac: int


@dataclass(frozen=True, slots=True)
class QuorumLost:
    """Fewer than ``ack_quorum`` members are live: nothing past the LAC can be confirmed in this segment."""

    segment_id: SegmentId
    live: tuple[NodeId, ...]
    ack_quorum: int
    lac: int

    def message(self) -> str:
        live = ", ".join(str(n) for n in self.live) or "none"
        return (
            f"segment {self.segment_id} has {len(self.live)} live member(s) ({live}) but needs {self.ack_quorum} "
            f"to confirm a write: the LAC stays at {self.lac}, and acks=all waits, until enough members are live "
            "again; reconnect the failed members' streams or replace them with live nodes"
        )


@dataclass(frozen=True, slots=True)
class QuorumRegained:
    """``ack_quorum`` members are live again."""

    segment_id: SegmentId


QuorumEffect = LacAdvanced | QuorumLost | QuorumRegained


@dataclass(frozen=True, slots=True)
class Lagging:
    """A live follower whose fsynced end is behind the appended end: resend from ``end_offset``."""

    node: NodeId
    end_offset: int


def _validate_ensemble(ensemble: tuple[NodeId, ...], ack_quorum: int, leader: NodeId, base_offset: int) -> None:
    if not ensemble:
        raise InvalidEnsemble("a segment's ensemble is empty: it needs at least the leader")
    twice = sorted(n for n, count in Counter(ensemble).items() if count > 1)
    if twice:
        raise InvalidEnsemble(
            f"ensemble {list(ensemble)} names node(s) {twice} more than once: a node holds one copy of a segment, "
            "so each member must be a distinct node"
        )
    if not 1 <= ack_quorum <= len(ensemble):
        raise InvalidEnsemble(
            f"ack quorum {ack_quorum} is not between 1 and the ensemble size {len(ensemble)}: set "
            f"min_insync_replicas to at most replication_factor ({len(ensemble)}) and at least 1"
        )
    if leader not in ensemble:
        raise InvalidEnsemble(
            f"leader {leader} is not in ensemble {list(ensemble)}: the partition leader is always a member of the "
            "open segment's ensemble"
        )
    if base_offset < 0:
        raise InvalidEnsemble(f"base offset {base_offset} is negative")


class SegmentQuorum:
    """The LAC of one open segment, at its leader; see the module docstring for the rules."""

    __slots__ = (
        "segment_id",
        "base_offset",
        "ensemble",
        "ack_quorum",
        "epoch",
        "leader",
        "_ends",
        "_failed",
        "_appended_end",
        "_lac",
    )

    def __init__(
        self,
        segment_id: SegmentId,
        base_offset: int,
        ensemble: tuple[NodeId, ...],
        ack_quorum: int,
        epoch: LeaderEpoch,
        leader: NodeId,
    ) -> None:
        _validate_ensemble(ensemble, ack_quorum, leader, base_offset)
        self.segment_id = segment_id
        self.base_offset = base_offset
        self.ensemble = ensemble
        self.ack_quorum = ack_quorum
        self.epoch = epoch
        self.leader = leader
        self._ends: dict[NodeId, int] = dict.fromkeys(ensemble, base_offset)
        self._failed: set[NodeId] = set()
        self._appended_end = base_offset
        self._lac = base_offset

    # -- queries --------------------------------------------------------------

    @property
    def lac(self) -> int:
        """The last add confirmed: exclusive end offset that ``ack_quorum`` members hold fsynced."""
        return self._lac

    @property
    def appended_end(self) -> int:
        """The exclusive end offset the leader has appended up to."""
        return self._appended_end

    @property
    def can_reach_quorum(self) -> bool:
        """Whether enough members are live to confirm more (the leader counts if it is not failed)."""
        return len(self.ensemble) - len(self._failed) >= self.ack_quorum

    def member_end(self, node: NodeId) -> int:
        """The exclusive end offset ``node`` reported holding fsynced (``base_offset`` before any report)."""
        self._check_member(node, "member_end")
        return self._ends[node]

    def failed_members(self) -> tuple[NodeId, ...]:
        return tuple(sorted(self._failed))

    def lagging(self) -> list[Lagging]:
        """Live followers behind the appended end, in node order: resend to each from its ``end_offset``.

        A follower may hold more than it has acked (written, not yet fsynced); it then answers the resend with
        :class:`NotContiguous` naming its own end, and the leader resends from there. Failed members are left out:
        there is no stream to resend on until :meth:`member_reconnected`.
        """
        return [
            Lagging(node, self._ends[node])
            for node in sorted(self.ensemble)
            if node != self.leader and node not in self._failed and self._ends[node] < self._appended_end
        ]

    # -- events ---------------------------------------------------------------

    def appended(self, end_offset: int) -> None:
        """The leader appended this segment up to ``end_offset`` (exclusive). Raises :class:`AppendWentBack`."""
        if end_offset < self._appended_end:
            raise AppendWentBack(
                f"segment {self.segment_id}: appended end {end_offset} is below {self._appended_end}, reported "
                "before; a leader never truncates an open segment (a leader change seals it instead)"
            )
        self._appended_end = end_offset

    def member_acked(self, node: NodeId, end_offset: int) -> list[QuorumEffect]:
        """``node`` holds this segment fsynced up to ``end_offset`` (exclusive); the leader's own fsync too.

        Returns ``[LacAdvanced(lac)]`` if the LAC moved, else ``[]``. A stale report (below what ``node`` reported
        before) changes nothing. Raises :class:`NotAMember` or :class:`AckOutOfRange`.
        """
        self._check_member(node, "ack")
        if not self.base_offset <= end_offset <= self._appended_end:
            raise AckOutOfRange(
                f"segment {self.segment_id}: node {node} reported holding up to offset {end_offset}, but the "
                f"segment starts at {self.base_offset} and the leader appended up to {self._appended_end}; a "
                "member can only hold what the leader sent it. The report is ignored: check that it is meant for "
                f"this segment and leader epoch {self.epoch}"
            )
        if end_offset <= self._ends[node]:
            return []
        self._ends[node] = end_offset
        lac = last_add_confirmed(self._ends.values(), self.ack_quorum)
        if lac <= self._lac:
            return []
        self._lac = lac
        return [LacAdvanced(lac)]

    def member_failed(self, node: NodeId) -> list[QuorumEffect]:
        """``node``'s stream broke. Returns ``[QuorumLost(...)]`` when this leaves fewer than ``ack_quorum``."""
        self._check_member(node, "member_failed")
        could = self.can_reach_quorum
        self._failed.add(node)
        if could and not self.can_reach_quorum:
            live = tuple(n for n in sorted(self.ensemble) if n not in self._failed)
            return [QuorumLost(self.segment_id, live, self.ack_quorum, self._lac)]
        return []

    def member_reconnected(self, node: NodeId) -> list[QuorumEffect]:
        """``node``'s stream is back (resend from :meth:`lagging`). Returns ``[QuorumRegained]`` if that restores it."""
        self._check_member(node, "member_reconnected")
        could = self.can_reach_quorum
        self._failed.discard(node)
        if not could and self.can_reach_quorum:
            return [QuorumRegained(self.segment_id)]
        return []

    def _check_member(self, node: NodeId, what: str) -> None:
        if node not in self._ends:
            raise NotAMember(
                f"{what} for node {node}, which is not in the ensemble {list(self.ensemble)} of segment "
                f"{self.segment_id}: the report is for another segment or a stale ensemble; ignore it"
            )


# -- member side: the fence --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GuardState:
    """All a :class:`ReplicaGuard` holds: what the shell persists (``dataclasses.asdict`` gives plain ints)."""

    fenced_epoch: LeaderEpoch = LeaderEpoch(0)
    sealed_through: SegmentId | None = None  # the last sealed segment of the chain; those before it are sealed too


class ReplicaGuard:
    """What a member checks before it appends a batch of one partition; see the module docstring.

    **Persist before answering.** The fence is only worth something if it survives a restart: the shell writes
    :attr:`state` durably (fsync) before it answers a :meth:`fence` or :meth:`seal`, and before it acks an append
    for which :meth:`check_append` returned True (the epoch rose). Otherwise a member that restarts could accept
    the deposed leader again and ack a write the new leader's recovery has already cut.

    Segments are sealed in chain order (only the last segment of a partition is ever open), so one number,
    :attr:`GuardState.sealed_through`, says which segments are sealed.
    """

    __slots__ = ("_state",)

    def __init__(self, state: GuardState | None = None) -> None:
        self._state = state or GuardState()

    @property
    def state(self) -> GuardState:
        return self._state

    @property
    def fenced_epoch(self) -> LeaderEpoch:
        return self._state.fenced_epoch

    def _check_epoch(self, epoch: LeaderEpoch) -> None:
        if epoch < self._state.fenced_epoch:
            raise Fenced(epoch, self._state.fenced_epoch)

    def _check_open(self, segment_id: SegmentId) -> None:
        sealed = self._state.sealed_through
        if sealed is not None and segment_id <= sealed:
            raise SegmentSealed(segment_id, sealed)

    def check_append(self, epoch: LeaderEpoch, segment_id: SegmentId, offset: int, local_end: int) -> bool:
        """May the batch sent by the leader of ``epoch`` at ``offset`` of ``segment_id`` be appended after
        ``local_end`` (this member's exclusive end)? Raises :class:`Fenced`, :class:`SegmentSealed` or
        :class:`NotContiguous`, in that order, and then changes nothing.

        Returns True if ``epoch`` is newer than the fence: the fence is raised to it, and the shell must persist
        :attr:`state` before acking the batch. False otherwise.
        """
        self._check_epoch(epoch)
        self._check_open(segment_id)
        if offset != local_end:
            raise NotContiguous(segment_id, offset, local_end)
        if epoch > self._state.fenced_epoch:
            self._state = GuardState(epoch, self._state.sealed_through)
            return True
        return False

    def fence(self, epoch: LeaderEpoch) -> None:
        """A new leader fences this member at ``epoch``: later appends of an older epoch are refused.

        The same epoch again is a no-op (a retried fence). An older one raises :class:`Fenced`: the fence never goes
        back. The shell persists :attr:`state` before it answers.
        """
        self._check_epoch(epoch)
        if epoch > self._state.fenced_epoch:
            self._state = GuardState(epoch, self._state.sealed_through)

    def seal(self, epoch: LeaderEpoch, segment_id: SegmentId) -> None:
        """The leader of ``epoch`` sealed ``segment_id`` (and so every segment before it): no more appends to them.

        Raises :class:`Fenced` for an older epoch; a newer one raises the fence too. Sealing a segment at or before
        the last sealed one is a no-op. The shell persists :attr:`state` before it answers.
        """
        self._check_epoch(epoch)
        sealed = self._state.sealed_through
        through = segment_id if sealed is None else SegmentId(max(sealed, segment_id))
        self._state = GuardState(LeaderEpoch(max(epoch, self._state.fenced_epoch)), through)
