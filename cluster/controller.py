"""The controller of a multi-node site: elections and the repair passes' bookkeeping. Pure.

**One controller rule** (issue 21: the node and the two cluster simulators picked it three ways). The
controller is the node whose replica leads the site's metadata log (Raft), from the moment it does: the shell
says so at each tick (``NodeCore.tick(..., leads_metadata=...)``), and a node that stops leading drops its
controller, whose memory is volatile, as a new controller starts afresh. Its elections are
:func:`~cluster.site_state.plan_leadership` with the time it became the controller (``since_ms``: live nodes
look dead until they heartbeat through it) and a settling time of three ticks, one proposal per partition and
expected epoch in flight at a time; the partitions of a dead leader move together, in one
:class:`~cluster.site_state.FailOver` per dead node (``cluster/failover.py``), one in flight per node and heartbeat,
and only while the controller's own heartbeats commit within half a session (a log that commits late makes every
node look dead: :meth:`Controller._log_is_fresh`).

**Repair.** :meth:`Controller.repair_plan` runs :func:`~cluster.repair.plan_repair` every ``repair_every_ms``
over the controller's view, with ``down_since`` as this controller first saw each node dead (a new controller
starts the repair delay again), the members that reported holding less of a sealed segment than its end
(``SegmentView.short``), and the copies in flight; it numbers each copy or fill it hands out, and throttles the
rolls it asks of a leader (one per segment per ``roll_ask_ms``). :meth:`Controller.repair_answered` says what a
finished copy changes in the metadata (``AddMember`` or ``ReplaceMember``; nothing for a fill, or for a copy
short of the sealed end, which is planned again).

**Leaders first, rolls after** (issue 22). A roll is background work: the open segment it seals still takes
writes on the members it has left. After a node's kill every open segment that had it as a member is rolled, at
10,000 partitions thousands of seals and opens asked of the survivors while they recover the dead node's
partitions (33,334 ``RollSegment`` calls from one controller in 40 s; the recoveries' fences, behind them, timed
out). So the controller asks no roll while some partition's leader has not yet opened a segment of its own
epoch (:func:`awaiting_leader`: its recovery, or its first open, is under way), for at most ``roll_hold_ms`` (a
recovery that cannot finish, say with two members of three dead, holds nothing for good); it never asks such a
leader to roll (its recovery seals the segment and opens the next anyway: the request could only be refused, and
was asked again every ``roll_ask_ms``); and it asks at most ``rolls_per_pass`` rolls per pass.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from cluster import repair
from cluster.placement import NodeLoad
from cluster.site_state import (
    AddMember,
    ElectLeader,
    FailOver,
    PartitionInfo,
    ReplaceMember,
    SegmentInfo,
    SiteState,
    plan_leadership,
)
from cluster.topic_settings import replication_factor_of
from topology.ids import LeaderEpoch, NodeId, SegmentId

PartitionKey = tuple[str, int]
SegmentKey = tuple[str, int, SegmentId]
SETTLE_TICKS = 2  # a new controller waits this many ticks from its election for heartbeats before it elects


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    session_timeout_ms: int
    tick_ms: int
    replication_factor: int
    repair_every_ms: int = 1_000
    repair_delay_ms: int = 30_000
    max_concurrent_copies: int = 2
    roll_ask_ms: int = 500
    roll_hold_ms: int = 30_000  # rolls wait at most this long for the leaders' recoveries (module docstring)
    rolls_per_pass: int = 256


@dataclass(frozen=True, slots=True)
class RepairCopy:
    """Copy (or fill) ``effect.segment_id`` from ``effect.source`` to ``effect.target``, up to ``end``; answer
    :meth:`Controller.repair_answered` (or :meth:`Controller.repair_failed`) with ``copy_id``."""

    copy_id: int
    effect: repair.CopySegment | repair.FillSegment
    base_offset: int
    end: int | None  # the sealed end (the planner copies sealed segments only: a shell refuses None)


@dataclass(frozen=True, slots=True)
class AskRoll:
    """Ask ``leader`` to roll ``segment_id`` of ``key`` (``widen``: so that the next segment has RF members)."""

    key: PartitionKey
    segment_id: SegmentId
    leader: NodeId
    widen: bool


@dataclass(slots=True)
class Controller:
    """See the module docstring. Volatile: a node that stops being the controller drops it."""

    me: NodeId
    since_ms: int
    config: ControllerConfig
    electing: dict[PartitionKey, LeaderEpoch] = field(default_factory=dict)
    failing: dict[NodeId, int | None] = field(default_factory=dict)  # FailOver in flight: dead node -> its heartbeat
    down_since: dict[NodeId, int] = field(default_factory=dict)
    in_progress: dict[int, tuple[repair.CopySegment | repair.FillSegment, int]] = field(default_factory=dict)
    short: dict[NodeId, set[SegmentKey]] = field(default_factory=dict)  # what each member last reported short
    roll_asked: dict[SegmentKey, int] = field(default_factory=dict)
    next_repair_ms: int = 0
    rolls_held_since: int | None = None  # since when rolls wait for leaders' recoveries (_rolls_held)
    # What the last repair pass reported besides its effects (unrepairable, waiting for the repair delay, deferred):
    # a shell logs it.
    reports: tuple[repair.Unrepairable | repair.AwaitingRepairDelay | repair.CopyDeferred, ...] = ()
    _ids: int = 0
    _quiet: tuple[int, frozenset[NodeId]] | None = None  # (version, live nodes) of the last empty plan, once settled

    def __post_init__(self) -> None:
        self.next_repair_ms = self.since_ms + self.config.repair_every_ms

    # -- elections ---------------------------------------------------------------------------------------

    def elections(self, view: SiteState, now_ms: int) -> list[ElectLeader | FailOver]:
        """The elections to propose now (each answered by :meth:`election_done`).

        A partition with no leader yet gets an :class:`ElectLeader` of the node ``plan_leadership`` chose. The
        partitions of a dead leader get one :class:`FailOver` per dead node (``cluster/failover.py``): every replica
        plans their new leaders as it applies it, so they all move in one log entry, whatever their number.

        Planned afresh only when something it depends on changed since a plan came out empty: the partitions
        (``view.version``), which nodes are live, or the settling time after the controller took over. An idle site
        plans nothing per tick (the plan walks every partition: 10,000 of them, 5 times a second)."""
        session = self.config.session_timeout_ms
        settled = now_ms - self.since_ms >= session
        quiet = (view.version, frozenset(n.node for n in view.live_nodes(now_ms, session)))
        if settled and quiet == self._quiet:
            return []
        out: list[ElectLeader | FailOver] = []
        dead: set[NodeId] = set()
        for elect in plan_leadership(
            view,
            now_ms,
            self.config.session_timeout_ms,
            self.since_ms,
            settle_ms=SETTLE_TICKS * self.config.tick_ms,
            controller=self.me,
        ):
            info = view.partition(elect.topic, elect.partition)
            if info is not None and info.leader is not None:
                dead.add(info.leader)
                continue
            key = (elect.topic, elect.partition)
            if self.electing.get(key) != elect.expected_epoch:
                self.electing[key] = elect.expected_epoch
                out.append(elect)
        held = bool(dead) and not self._log_is_fresh(view, now_ms)  # plan again at the next tick, not when quiet
        for node in sorted(dead) if not held else ():
            node_info = view.node(node)
            heartbeat = node_info.last_heartbeat_ms if node_info is not None else None
            if node in self.failing and self.failing[node] == heartbeat:
                continue
            self.failing[node] = heartbeat
            out.append(FailOver(node, heartbeat, now_ms, session, avoid=self.me))
        self._quiet = quiet if settled and not out and not held and not self.electing and not self.failing else None
        return out

    def _log_is_fresh(self, view: SiteState, now_ms: int) -> bool:
        """Whether the controller's own last heartbeat in ``view`` is younger than half a session: its heartbeats
        go through the same log as every node's, so while its own commit late (a loaded machine: seconds), the
        others' silence says nothing of them, and moving their partitions would only add work. A dead node is
        condemned as soon as the log moves again; a controller cut off from the log is replaced by Raft."""
        own = view.node(self.me)
        heartbeat = own.last_heartbeat_ms if own is not None else None
        return heartbeat is not None and now_ms - heartbeat < self.config.session_timeout_ms // 2

    def election_done(self, key: PartitionKey, expected: LeaderEpoch) -> None:
        if self.electing.get(key) == expected:
            del self.electing[key]

    def proposal_done(self, command: ElectLeader | FailOver) -> None:
        """The metadata answered (or gave up on) an election :meth:`elections` returned: it may be planned again."""
        if isinstance(command, FailOver):
            if self.failing.get(command.node, -1) == command.last_heartbeat_ms:
                del self.failing[command.node]
        else:
            self.election_done((command.topic, command.partition), command.expected_epoch)

    # -- repair ------------------------------------------------------------------------------------------

    def reported_short(self, member: NodeId, segments: set[SegmentKey]) -> None:
        """``member`` holds less than the sealed end of ``segments`` (its report of every sealed segment)."""
        self.short[member] = segments

    def repair_plan(
        self, view: SiteState, now_ms: int, size_of: Callable[[SegmentInfo], int], loads: Callable[[], list[NodeLoad]]
    ) -> tuple[list[RepairCopy], list[AskRoll]]:
        """The copies, fills and rolls to start now, once every ``repair_every_ms``; none in between."""
        if now_ms < self.next_repair_ms:
            return [], []
        self.next_repair_ms = now_ms + self.config.repair_every_ms
        nodes = loads()
        for n in nodes:
            if n.alive:
                self.down_since.pop(n.node, None)
            else:
                self.down_since.setdefault(n.node, now_ms)
        segments = [
            repair.SegmentView(
                info.topic,
                info.partition,
                s.segment_id,
                s.ensemble,
                s.sealed,
                size_of(s),
                tuple(m for m in s.ensemble if (info.topic, info.partition, s.segment_id) in self.short.get(m, ())),
                replication_factor_of(view.topic(info.topic), self.config.replication_factor),
            )
            for info in view.partitions()
            for s in info.segments
        ]
        running = [self.in_progress[cid][0] for cid in sorted(self.in_progress)]
        plan = repair.plan_repair(
            segments,
            nodes,
            down_since_ms=dict(sorted(self.down_since.items())),
            now_ms=now_ms,
            repair_delay_ms=self.config.repair_delay_ms,
            in_progress=running,
            max_concurrent_copies=self.config.max_concurrent_copies,
            replication_factor=self.config.replication_factor,
        )
        self.reports = (*plan.unrepairable, *plan.waiting, *plan.deferred)
        copies = []
        planned: list[repair.CopySegment | repair.FillSegment] = [*plan.copies, *plan.fills]
        for effect in planned:
            info = view.partition(effect.topic, effect.partition)
            segment = info.segment(effect.segment_id) if info is not None else None
            if segment is None:
                continue
            self._ids += 1
            self.in_progress[self._ids] = (effect, now_ms)
            end = int(segment.end_offset) if segment.end_offset is not None else None
            copies.append(RepairCopy(self._ids, effect, int(segment.base_offset), end))
        return copies, self._rolls(view, plan.rolls, now_ms)

    def _rolls_held(self, view: SiteState, now_ms: int) -> bool:
        """Whether rolls wait, now, for the leaders' recoveries (the module docstring)."""
        if not view.derived("awaiting_leaders", lambda v: any(awaiting_leader(i) for i in v.partitions())):
            self.rolls_held_since = None
            return False
        if self.rolls_held_since is None:
            self.rolls_held_since = now_ms
        return now_ms - self.rolls_held_since < self.config.roll_hold_ms

    def _rolls(self, view: SiteState, rolls: tuple[repair.RollSegment, ...], now_ms: int) -> list[AskRoll]:
        if not rolls or self._rolls_held(view, now_ms):
            return []
        out: list[AskRoll] = []
        for r in rolls:
            if len(out) >= self.config.rolls_per_pass:
                break
            seg = (r.topic, r.partition, r.segment_id)
            info = view.partition(r.topic, r.partition)
            leader = info.leader if info is not None else None
            asked = self.roll_asked.get(seg)
            if leader is None or leader == r.dead or (asked is not None and asked + self.config.roll_ask_ms > now_ms):
                continue
            if info is not None and awaiting_leader(info):  # its recovery rolls it
                continue
            self.roll_asked[seg] = now_ms
            out.append(AskRoll((r.topic, r.partition), r.segment_id, leader, widen=r.dead is None))
        return out

    def repair_failed(self, copy_id: int) -> repair.CopySegment | repair.FillSegment | None:
        """The copy ``copy_id`` failed or timed out: it is planned afresh at a later pass."""
        entry = self.in_progress.pop(copy_id, None)
        return entry[0] if entry is not None else None

    def repair_answered(
        self, copy_id: int, target: NodeId, end: int, view: SiteState
    ) -> tuple[bool, AddMember | ReplaceMember | None]:
        """The target of copy ``copy_id`` holds it up to ``end`` fsynced: (whether the copy is whole, the command
        that records it). A copy short of the sealed end fails; a fill changes no metadata."""
        entry = self.in_progress.get(copy_id)
        if entry is None:
            return False, None
        effect = entry[0]
        seg = (effect.topic, effect.partition, effect.segment_id)
        info = view.partition(effect.topic, effect.partition)
        segment = info.segment(effect.segment_id) if info is not None else None
        if segment is None or segment.end_offset is None or end < segment.end_offset:
            del self.in_progress[copy_id]
            return False, None
        if target in self.short:
            self.short[target].discard(seg)
        if isinstance(effect, repair.FillSegment):
            del self.in_progress[copy_id]
            return True, None
        if effect.replaces is None:
            rf = replication_factor_of(view.topic(effect.topic), self.config.replication_factor)
            return True, AddMember(effect.topic, effect.partition, effect.segment_id, effect.target, rf)
        return True, ReplaceMember(effect.topic, effect.partition, effect.segment_id, effect.replaces, effect.target)

    def recorded(self, copy_id: int) -> None:
        """The metadata answered the command that records copy ``copy_id`` (or gave up on it)."""
        self.in_progress.pop(copy_id, None)


def awaiting_leader(info: PartitionInfo) -> bool:
    """Whether ``info``'s leader has yet to open a segment of its own epoch: no segment of the chain was opened in
    the leader's epoch, so its recovery of the open segment (or its first open) is under way. A roll seals in the
    leader's own epoch, so a leader between its roll's seal and its next open is not waited for."""
    if info.leader is None:
        return False
    return not info.segments or info.segments[-1].opened_epoch < info.leader_epoch


def controller_step(
    controller: Controller | None,
    me: NodeId,
    leads_metadata: bool,
    now_ms: int,
    config: ControllerConfig,
    elected_ms: int | None = None,
) -> Controller | None:
    """The one controller rule: this node's controller now, given whether its replica leads the metadata log.

    A new controller's settling counts from ``elected_ms``, when its replica won the Raft election, if the shell
    knows it: the tick that first sees the leadership may come late (its heartbeat waited for the election while
    the other nodes' went through), and counting from the tick would delay every election by that much."""
    if not leads_metadata:
        return None
    return (
        controller if controller is not None else Controller(me, now_ms if elected_ms is None else elected_ms, config)
    )


def short_segments(view: SiteState, me: NodeId, fsynced_end: Mapping[SegmentKey, int]) -> set[SegmentKey]:
    """The sealed segments ``me`` is a member of and holds less of than the sealed end (what it reports)."""
    out = set()
    for info in view.partitions():
        for s in info.segments:
            if not s.sealed or me not in s.ensemble or s.end_offset is None:
                continue
            seg = (info.topic, info.partition, s.segment_id)
            if fsynced_end.get(seg, int(s.base_offset)) < s.end_offset:
                out.add(seg)
    return out
