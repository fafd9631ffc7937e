"""One partition led by one node in one epoch: recover, open, write, roll. Pure.

:class:`PartitionLead` is the leader's side of the segment cluster as one state machine, in the style of
etcd raft's ``RawNode``: the shell (``georep/server/cluster_member.py`` on a node, ``georep/sim/cluster_node.py``
in both cluster simulators) feeds it events (its own view of the metadata, answers of the members it fenced or
had copy a tail, the result of each metadata proposal, member acks, broken and restored streams, appends, ticks)
and carries out the effects it returns, in order. It never reads a clock (``now_ms`` comes in), sends nothing
and proposes nothing itself. Every rule it applies has its own pure home, which it only drives:

============================================  ==============================================================
decision                                      pure code driven here
============================================  ==============================================================
recovering the predecessor's open segment     :class:`~cluster.recovery.SegmentRecovery` (fence, copy, seal)
which segment to write next, on whom          :func:`~cluster.leadership.plan_open` (placement over the loads)
the LAC, when ``acks=all`` goes                :class:`~cluster.quorum.SegmentQuorum`
where a roll seals                            :func:`~cluster.leadership.roll_seal_at`
============================================  ==============================================================

What it adds are the rules that were each shell's own before (issue 21), one copy of each:

* **Phases.** ``recovering`` (the predecessor's open segment, one :class:`SegmentRecovery` per attempt; a
  failed attempt starts again after ``retry_ms``), ``opening`` (``plan_open``; a lost proposal is planned again
  after ``retry_ms``; a stale epoch ends the lead), ``active`` (appends, streams, acks), ``rolling`` (no more
  appends; the seal at the LAC, proposed again until it commits or is refused), and ``done``.
* **The resend rule.** Each member is sent the leader's copy in offset order from ``next_send``: the end the
  member last reported (its answer when its stream opens, a gap it reports, or its last ack when the stream
  comes back after a break), so a member that restarted or missed part of a stream is caught up from the same
  bytes (:meth:`member_reconnected`, :meth:`member_gap`).
* **The release limit.** Once a roll chose its seal, nothing past it is released, whatever later acks do to
  the LAC (those batches are cut by the seal; their producers send them again).
* **Answers that come too late** (an older attempt's fence, a copy that timed out, a seal or open result
  after the lead moved on) are ignored, by attempt and token.

Effects carry the partition key, so a shell that leads several partitions routes them without state.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cluster import leadership
from cluster.placement import NodeLoad
from cluster.quorum import LacAdvanced, QuorumEffect, QuorumLost, SegmentQuorum
from cluster.recovery import Copy, Done, Failed, Fence, Seal, SegmentRecovery, Superseded
from cluster.recovery import Effect as RecoveryEffect
from cluster.site_state import Applied, OpenSegment, PartitionInfo, RefusalCode, Refused, Result, SegmentInfo
from topology.ids import LeaderEpoch, NodeId, SegmentId

PartitionKey = tuple[str, int]


@dataclass(frozen=True, slots=True)
class LeadConfig:
    replication_factor: int
    ack_quorum: int  # the topic's min_insync_replicas now: what the next segment opens with
    retry_ms: int  # a failed recovery, a lost proposal, a placement that found too few nodes: again after this
    roll_wait_ms: int  # a rolling leader waits this long for the LAC to reach what it appended
    reconnect_ms: int = 0  # a broken member stream is tried again after this (the shell says when it is back)
    # The site's configured quorum, for a segment opened before segments recorded theirs (None: ack_quorum)
    site_ack_quorum: int | None = None

    def quorum_of(self, segment_ack_quorum: int | None) -> int:
        """The quorum a segment's writes are acked under: its own, recorded when it opened (a topic's quorum may
        have changed since: its recovery must use the one its writes were acked under), else the site's."""
        if segment_ack_quorum is not None:
            return segment_ack_quorum
        return self.ack_quorum if self.site_ack_quorum is None else self.site_ack_quorum


@dataclass(frozen=True, slots=True)
class LeadContext:
    """What a lead's event is judged against: the shell's clock and its node's view of the partition and nodes."""

    now_ms: int
    info: PartitionInfo | None
    loads: Callable[[], Sequence[NodeLoad]]  # placement's view of every node (leadership.node_loads)


# -- effects ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FenceMember:
    """Fence ``member``'s copy of ``segment`` at ``epoch``; answer :meth:`PartitionLead.fenced` (its fsynced end),
    :meth:`~PartitionLead.fence_refused` or, after the shell's timeout, :meth:`~PartitionLead.unreachable`."""

    key: PartitionKey
    segment: SegmentInfo
    member: NodeId
    epoch: LeaderEpoch
    attempt: int


@dataclass(frozen=True, slots=True)
class CopyTail:
    """Make ``copy.target`` hold ``segment`` up to ``copy.end_offset`` from ``copy.source``'s bytes; answer
    :meth:`PartitionLead.copied`, :meth:`~PartitionLead.copy_failed` or :meth:`~PartitionLead.copy_refused`."""

    key: PartitionKey
    segment: SegmentInfo
    copy: Copy
    epoch: LeaderEpoch
    attempt: int
    copy_id: int


@dataclass(frozen=True, slots=True)
class ProposeSeal:
    """Propose sealing ``segment`` at ``end`` (a ``SealSegment`` with the shell's summary of its copy below
    ``end``: end vector, size, producers' table); answer :meth:`PartitionLead.sealed` with ``token``."""

    key: PartitionKey
    epoch: LeaderEpoch
    segment: SegmentInfo
    end: int
    token: int
    roll: bool  # a roll's seal (at the LAC), else a recovery's


@dataclass(frozen=True, slots=True)
class ProposeOpen:
    """Propose ``command``; answer :meth:`PartitionLead.opened`."""

    key: PartitionKey
    command: OpenSegment


@dataclass(frozen=True, slots=True)
class Adopted:
    """Write segment ``segment_id`` from ``base_offset`` on ``ensemble``: the shell opens its own copy, builds the
    producers' table the segment starts with, and takes appends."""

    key: PartitionKey
    epoch: LeaderEpoch
    segment_id: SegmentId
    base_offset: int
    ensemble: tuple[NodeId, ...]
    ack_quorum: int  # the segment's own


@dataclass(frozen=True, slots=True)
class StreamTo:
    """Send ``member`` the leader's copy of ``segment_id`` from ``offset`` to its appended end (the resend rule)."""

    key: PartitionKey
    segment_id: SegmentId
    member: NodeId
    offset: int


@dataclass(frozen=True, slots=True)
class Release:
    """Acks of ``segment_id`` up to ``end`` may go (the LAC, capped at a roll's seal)."""

    key: PartitionKey
    segment_id: SegmentId
    end: int


@dataclass(frozen=True, slots=True)
class Sealing:
    """A roll began: take no more appends to ``segment_id``; acks go on up to the seal."""

    key: PartitionKey
    segment_id: SegmentId


@dataclass(frozen=True, slots=True)
class SegmentSealed:
    """The seal of ``segment_id`` at ``end`` committed (this lead's roll or recovery): fail what waits past ``end``
    (never confirmed: its producer sends it again) and tell the ``ensemble`` (they cut longer copies)."""

    key: PartitionKey
    epoch: LeaderEpoch
    segment_id: SegmentId
    ensemble: tuple[NodeId, ...]
    end: int
    roll: bool


@dataclass(frozen=True, slots=True)
class Reconnect:
    """``member``'s stream broke ``reconnect_ms`` ago: once it can be reached again,
    :meth:`PartitionLead.member_reconnected`."""

    key: PartitionKey
    member: NodeId


@dataclass(frozen=True, slots=True)
class Note:
    """Something a shell counts or logs: ``what`` names it (``recovery``, ``recovery_done``, ...)."""

    key: PartitionKey
    what: str
    message: str = ""


@dataclass(frozen=True, slots=True)
class StepDown:
    """This lead is over: fail everything that waits on it."""

    key: PartitionKey
    epoch: LeaderEpoch
    reason: str


LeadEffect = (
    FenceMember
    | CopyTail
    | ProposeSeal
    | ProposeOpen
    | Adopted
    | StreamTo
    | Release
    | Sealing
    | SegmentSealed
    | Reconnect
    | Note
    | StepDown
)


class Phase(enum.StrEnum):
    RECOVERING = "recovering"
    OPENING = "opening"
    ACTIVE = "active"
    ROLLING = "rolling"
    DONE = "done"


@dataclass(slots=True)
class _Recovery:
    """One attempt at recovering the predecessor's open segment."""

    segment: SegmentInfo
    machine: SegmentRecovery
    attempt: int
    answered: set[NodeId] = field(default_factory=set)
    copies: dict[NodeId, int] = field(default_factory=dict)  # target -> the copy id in flight
    seal_end: int | None = None  # the seal asked for, proposed again while its result is lost
    seal_due_ms: int | None = None


class PartitionLead:
    """See the module docstring."""

    def __init__(
        self, me: NodeId, key: PartitionKey, epoch: LeaderEpoch, config: LeadConfig, recover: SegmentInfo | None
    ) -> None:
        self.me = me
        self.key = key
        self.epoch = epoch
        self.config = config
        self.phase = Phase.RECOVERING if recover is not None else Phase.OPENING
        self.busy = False  # a proposal of this lead is in flight
        self.retry_at = 0
        self.sealed_through: SegmentId | None = None  # the last segment this lead sealed (its roll or recovery)
        self.previous: tuple[NodeId, ...] = ()  # the ensemble of the segment before the next one
        self.recovery: _Recovery | None = None
        self._attempts = 0
        self._ids = 0
        self.quorum: SegmentQuorum | None = None
        self.next_send: dict[NodeId, int] = {}
        self.failed_at: dict[NodeId, int] = {}
        self.roll_since: int | None = None
        self.seal_end: int | None = None  # a roll's chosen seal: the release limit
        self._token = 0
        # Why no segment can be opened now (placement found fewer live nodes than the quorum), or None: the shell
        # answers writes with it (NOT_ENOUGH_REPLICAS) rather than have producers wait for a segment
        self.blocked: str | None = None

    # -- reading -----------------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """Taking appends."""
        return self.phase is Phase.ACTIVE and self.quorum is not None

    @property
    def writing(self) -> bool:
        """Writing a segment (active or rolling): acks and streams go on."""
        return self.phase in (Phase.ACTIVE, Phase.ROLLING) and self.quorum is not None

    def release_limit(self) -> int:
        """What may be acknowledged: the LAC, never past a roll's chosen seal."""
        q = self.quorum
        assert q is not None
        return q.lac if self.seal_end is None else min(q.lac, self.seal_end)

    # -- starting, ticks ---------------------------------------------------------------------------------

    def start(self, ctx: LeadContext) -> list[LeadEffect]:
        """The lead begins: recover the predecessor's open segment first, or open the next one."""
        info = ctx.info
        if info is not None and info.segments:
            self.previous = info.segments[-1].ensemble
        if self.phase is Phase.RECOVERING:
            return self._begin_recovery(ctx)
        return self.try_open(ctx)

    @property
    def tick_idle(self) -> bool:
        """Whether :meth:`tick` has nothing to do, whatever the time: an active lead with every member of its
        segment connected (no retry, no roll, no reconnect is due). ``NodeCore.tick`` skips these, so an idle node
        leading thousands of partitions does not build a context and tick each of them every tick."""
        return self.phase is Phase.ACTIVE and not self.failed_at

    def tick(self, ctx: LeadContext) -> list[LeadEffect]:
        """Retries that are due, a roll's seal, members to reconnect (nothing at all while :attr:`tick_idle`)."""
        if self.phase is Phase.RECOVERING:
            rec = self.recovery
            if rec is None and ctx.now_ms >= self.retry_at:
                return self._begin_recovery(ctx)
            if (
                rec is not None
                and rec.seal_end is not None
                and rec.seal_due_ms is not None
                and ctx.now_ms >= rec.seal_due_ms
            ):
                return self._propose_recovery_seal(rec)
            return []
        if self.phase is Phase.OPENING:
            return self.try_open(ctx) if not self.busy and ctx.now_ms >= self.retry_at else []
        if not self.writing:
            return []
        out: list[LeadEffect] = [
            Reconnect(self.key, m)
            for m in sorted(self.failed_at)
            if ctx.now_ms - self.failed_at[m] >= self.config.reconnect_ms
        ]
        if self.phase is Phase.ROLLING:
            out += self.roll_check(ctx)
        return out

    def close(self, reason: str) -> list[LeadEffect]:
        """The lead ends (the metadata names another leader or epoch, a member refused it, its node stops)."""
        if self.phase is Phase.DONE:
            return []
        self.phase = Phase.DONE
        self.recovery = None
        return [StepDown(self.key, self.epoch, reason)]

    # -- recovery ----------------------------------------------------------------------------------------

    def _begin_recovery(self, ctx: LeadContext) -> list[LeadEffect]:
        info = ctx.info
        segment = info.open_segment if info is not None else None
        if segment is None:  # sealed meanwhile (by this lead's earlier attempt, or another): open the next
            self.phase = Phase.OPENING
            if info is not None and info.segments:
                self.previous = info.segments[-1].ensemble
            return self.try_open(ctx)
        self._attempts += 1
        aq = self.config.quorum_of(segment.ack_quorum)  # the quorum its writes were acked under, not the topic's now
        machine = SegmentRecovery(
            segment.segment_id, int(segment.base_offset), segment.ensemble, aq, self.epoch, self.me
        )
        self.recovery = _Recovery(segment, machine, self._attempts)
        return [Note(self.key, "recovery"), *self._recovered(self.recovery, machine.start(), ctx)]

    def _current(self, attempt: int) -> _Recovery | None:
        rec = self.recovery
        if self.phase is not Phase.RECOVERING or rec is None or rec.attempt != attempt:
            return None
        return rec

    def fenced(self, attempt: int, member: NodeId, end: int, ctx: LeadContext) -> list[LeadEffect]:
        rec = self._current(attempt)
        if rec is None:
            return []
        rec.answered.add(member)
        return self._recovered(rec, rec.machine.fenced(member, end), ctx)

    def fence_refused(self, attempt: int, member: NodeId, their_epoch: int, ctx: LeadContext) -> list[LeadEffect]:
        rec = self._current(attempt)
        if rec is None:
            return []
        rec.answered.add(member)
        return self._recovered(rec, rec.machine.fence_refused(member, their_epoch), ctx)

    def unreachable(self, attempt: int, member: NodeId, ctx: LeadContext) -> list[LeadEffect]:
        """The fence of ``member`` got no answer in time (it is ignored once the member answered)."""
        rec = self._current(attempt)
        if rec is None or member in rec.answered:
            return []
        return self._recovered(rec, rec.machine.unreachable(member), ctx)

    def _copy(self, attempt: int, copy_id: int, target: NodeId) -> _Recovery | None:
        rec = self._current(attempt)
        if rec is None or rec.copies.get(target) != copy_id:
            return None
        del rec.copies[target]
        return rec

    def copied(self, attempt: int, copy_id: int, target: NodeId, end: int, ctx: LeadContext) -> list[LeadEffect]:
        rec = self._copy(attempt, copy_id, target)
        return self._recovered(rec, rec.machine.copied(target, end), ctx) if rec is not None else []

    def copy_failed(self, attempt: int, copy_id: int, target: NodeId, why: str, ctx: LeadContext) -> list[LeadEffect]:
        rec = self._copy(attempt, copy_id, target)
        return self._recovered(rec, rec.machine.copy_failed(target, why), ctx) if rec is not None else []

    def copy_refused(
        self, attempt: int, copy_id: int, target: NodeId, their_epoch: int, ctx: LeadContext
    ) -> list[LeadEffect]:
        """The copy's target is fenced by a newer epoch."""
        rec = self._copy(attempt, copy_id, target)
        return self._recovered(rec, rec.machine.fence_refused(target, their_epoch), ctx) if rec is not None else []

    def _propose_recovery_seal(self, rec: _Recovery) -> list[LeadEffect]:
        assert rec.seal_end is not None
        rec.seal_due_ms = None
        self._token += 1
        return [ProposeSeal(self.key, self.epoch, rec.segment, rec.seal_end, self._token, roll=False)]

    def _recovered(self, rec: _Recovery, effects: list[RecoveryEffect], ctx: LeadContext) -> list[LeadEffect]:
        """Carry ``rec``'s effects on: what the members must do, the seal to propose, and how it ended."""
        out: list[LeadEffect] = []
        segment = rec.segment
        for eff in effects:
            if isinstance(eff, Fence):
                out.append(FenceMember(self.key, segment, eff.node, eff.epoch, rec.attempt))
            elif isinstance(eff, Copy):
                self._ids += 1
                rec.copies[eff.target] = self._ids
                out += [
                    Note(self.key, "recovery_copy"),
                    CopyTail(self.key, segment, eff, self.epoch, rec.attempt, self._ids),
                ]
            elif isinstance(eff, Seal):
                rec.seal_end = int(eff.end_offset)
                out += self._propose_recovery_seal(rec)
            elif isinstance(eff, Done):
                self.recovery = None
                self.phase = Phase.OPENING
                self.sealed_through = segment.segment_id
                self.previous = segment.ensemble
                out += [
                    Note(self.key, "recovery_done"),
                    SegmentSealed(
                        self.key, self.epoch, segment.segment_id, segment.ensemble, int(eff.end_offset), roll=False
                    ),
                    *self.try_open(ctx),
                ]
            elif isinstance(eff, Failed):
                self.recovery = None
                self.retry_at = ctx.now_ms + self.config.retry_ms
                out.append(Note(self.key, "recovery_failed", eff.reason))
            elif isinstance(eff, Superseded):
                out += [
                    Note(self.key, "recovery_superseded", eff.reason),
                    *self.close(f"recovery superseded: {eff.reason}"),
                ]
                break
        return out

    def sealed(self, token: int, result: Result | None, ctx: LeadContext) -> list[LeadEffect]:
        """The result of the seal proposed with ``token`` (None: lost or not confirmed; it is proposed again)."""
        if token != self._token:
            return []
        if self.phase is Phase.ROLLING:
            return self._rolled(result, ctx)
        rec = self.recovery
        if self.phase is not Phase.RECOVERING or rec is None or rec.seal_end is None:
            return []
        if result is None:  # the same seal again: sealing again at the same end is a no-op
            rec.seal_due_ms = ctx.now_ms + self.config.retry_ms
            return []
        if isinstance(result, Applied):
            return self._recovered(rec, rec.machine.seal_committed(rec.seal_end), ctx)
        return self._recovered(rec, rec.machine.seal_refused(result.reason), ctx)

    # -- opening -----------------------------------------------------------------------------------------

    def try_open(self, ctx: LeadContext) -> list[LeadEffect]:
        """Adopt this lead's open segment, or propose the next one (``plan_open``)."""
        if self.phase is not Phase.OPENING or self.busy or ctx.info is None:
            return []
        step = leadership.plan_open(
            ctx.info,
            self.me,
            self.epoch,
            self.sealed_through,
            self.previous,
            ctx.loads(),
            self.config.replication_factor,
            min_ensemble=self.config.ack_quorum,
            ack_quorum=self.config.ack_quorum,
        )
        if isinstance(step, leadership.Adopt):
            return self._adopt(step.segment_id, int(step.base_offset), step.ensemble, step.ack_quorum)
        if isinstance(step, leadership.Blocked):
            self.retry_at = ctx.now_ms + self.config.retry_ms
            self.blocked = step.reason
            return [Note(self.key, "placement_wait", step.reason)]
        if isinstance(step, leadership.ProposeOpen):
            self.busy = True
            return [ProposeOpen(self.key, step.command)]
        return []  # Wait: the view catches up

    def opened(self, command: OpenSegment, result: Result | None, ctx: LeadContext) -> list[LeadEffect]:
        self.busy = False
        if self.phase is not Phase.OPENING:
            return []
        if isinstance(result, Applied) and result.segment_id is not None:
            return self._adopt(result.segment_id, int(command.base_offset), command.ensemble, command.ack_quorum)
        if isinstance(result, Refused) and result.code is RefusalCode.STALE_EPOCH:
            return self.close(result.reason)
        self.retry_at = ctx.now_ms + self.config.retry_ms  # lost, or the state moved: look again
        return []

    def _adopt(
        self, segment_id: SegmentId, base: int, ensemble: tuple[NodeId, ...], ack_quorum: int | None
    ) -> list[LeadEffect]:
        aq = self.config.quorum_of(ack_quorum)
        self.quorum = SegmentQuorum(segment_id, base, ensemble, aq, self.epoch, self.me)
        self.blocked = None
        self.phase = Phase.ACTIVE
        self.next_send = dict.fromkeys(ensemble, base)
        self.failed_at = {}
        self.roll_since = None
        self.seal_end = None
        return [Adopted(self.key, self.epoch, segment_id, base, ensemble, aq)]

    # -- writing -----------------------------------------------------------------------------------------

    def appended(self, end: int) -> list[LeadEffect]:
        """The leader's copy holds up to ``end``: stream it to every member whose stream is up."""
        q = self.quorum
        if not self.writing or q is None or end <= q.appended_end:
            return []
        q.appended(end)
        return [e for m in q.ensemble if m != self.me and m not in self.failed_at for e in self._stream(m)]

    def _stream(self, member: NodeId) -> list[LeadEffect]:
        q = self.quorum
        assert q is not None
        start = self.next_send.get(member, q.base_offset)
        if start >= q.appended_end:
            return []
        self.next_send[member] = q.appended_end
        return [StreamTo(self.key, q.segment_id, member, start)]

    def member_acked(self, member: NodeId, end: int) -> list[LeadEffect]:
        """``member`` (this node too: its own fsync) holds the open segment up to ``end`` fsynced."""
        q = self.quorum
        if not self.writing or q is None:
            return []
        return self._quorum(q.member_acked(member, end))

    def member_failed(self, member: NodeId, now_ms: int) -> list[LeadEffect]:
        q = self.quorum
        if not self.writing or q is None or member not in q.ensemble or member == self.me or member in self.failed_at:
            return []
        self.failed_at[member] = now_ms
        return self._quorum(q.member_failed(member))

    def member_reconnected(self, member: NodeId, end: int | None = None) -> list[LeadEffect]:
        """``member``'s stream is back; ``end`` is what it answered it holds (None: not known, so its last ack).
        The resend rule: send from there."""
        q = self.quorum
        if not self.writing or q is None or member not in self.failed_at:
            return []
        del self.failed_at[member]
        out = self._quorum(q.member_reconnected(member))
        self.next_send[member] = q.member_end(member) if end is None else max(end, q.base_offset)
        if self.next_send[member] < q.appended_end:
            out.append(Note(self.key, "resend"))
        return out + self._stream(member)

    def member_gap(self, segment_id: SegmentId, member: NodeId, end: int) -> list[LeadEffect]:
        """``member`` holds ``segment_id`` up to ``end`` only, and got a batch past it: resend from ``end``."""
        q = self.quorum
        if not self.writing or q is None or q.segment_id != segment_id or member in self.failed_at:
            return []
        if end >= self.next_send.get(member, q.base_offset):
            return []
        self.next_send[member] = end
        return [Note(self.key, "resend"), *self._stream(member)]

    def member_refused(self, segment_id: SegmentId, member: NodeId, why: str) -> list[LeadEffect]:
        """``member`` refused this lead's append (fenced by a newer epoch, or the segment is sealed there)."""
        q = self.quorum
        if not self.writing or q is None or q.segment_id != segment_id:
            return []
        return self.close(f"node {member} refused an append: {why}")

    def _quorum(self, effects: list[QuorumEffect]) -> list[LeadEffect]:
        q = self.quorum
        assert q is not None
        out: list[LeadEffect] = []
        for eff in effects:
            if isinstance(eff, LacAdvanced):
                out.append(Release(self.key, q.segment_id, self.release_limit()))
            elif isinstance(eff, QuorumLost):
                out.append(Note(self.key, "quorum_lost", eff.message()))
        return out

    # -- rolling -----------------------------------------------------------------------------------------

    def retune(self, config: LeadConfig, now_ms: int) -> list[LeadEffect]:
        """The topic's settings changed (an alter here, or one a topic sync brought): the next segment opens with
        ``config``; an open segment acked under another quorum is rolled now, so that the topic's new
        ``min_insync_replicas`` applies from the next write, as Kafka users expect, while each segment keeps the
        quorum its writes were acked under (its recovery needs it)."""
        self.config = config
        q = self.quorum
        if self.phase is not Phase.ACTIVE or q is None or q.ack_quorum == config.ack_quorum:
            return []
        reason = f"min_insync_replicas is now {config.ack_quorum}, segment {q.segment_id} acks with {q.ack_quorum}"
        return [Note(self.key, "quorum_changed", reason), *self.start_roll(now_ms)]

    def start_roll(self, now_ms: int) -> list[LeadEffect]:
        """Roll the open segment (by size, or the controller asks): no more appends; seal at the LAC."""
        q = self.quorum
        if self.phase is not Phase.ACTIVE or q is None:
            return []
        self.phase = Phase.ROLLING
        self.roll_since = now_ms
        self.seal_end = None
        return [Sealing(self.key, q.segment_id)]

    def roll_check(self, ctx: LeadContext) -> list[LeadEffect]:
        """Seal at the LAC once everything appended is confirmed, or once waiting longer is pointless."""
        q = self.quorum
        if self.phase is not Phase.ROLLING or q is None or self.busy:
            return []
        if self.seal_end is None:
            assert self.roll_since is not None
            end = leadership.roll_seal_at(q.lac, q.appended_end, self.roll_since, ctx.now_ms, self.config.roll_wait_ms)
            if end is None:
                return []
            self.seal_end = end
        segment = ctx.info.segment(q.segment_id) if ctx.info is not None else None
        if segment is None:
            return []  # the view has not caught up with the open this lead adopted: at the next look
        self.busy = True
        self._token += 1
        return [ProposeSeal(self.key, self.epoch, segment, self.seal_end, self._token, roll=True)]

    def _rolled(self, result: Result | None, ctx: LeadContext) -> list[LeadEffect]:
        self.busy = False
        q = self.quorum
        assert q is not None and self.seal_end is not None
        if result is None:
            return []  # the same seal again at the next check
        if isinstance(result, Refused):
            return self.close(f"roll refused: {result.reason}")
        end = self.seal_end
        self.phase = Phase.OPENING
        self.previous = q.ensemble
        self.sealed_through = q.segment_id
        self.quorum = None
        self.seal_end = None
        return [SegmentSealed(self.key, self.epoch, q.segment_id, q.ensemble, end, roll=True), *self.try_open(ctx)]
