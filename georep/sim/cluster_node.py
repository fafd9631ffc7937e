"""The nodes of a simulated multi-node site: each one's disk, and the shell around its :class:`~cluster.node.NodeCore`.

Both cluster simulators (``georep/sim/cluster.py``: one site, every fault; ``georep/sim/geo_cluster.py``: a
multi-node site inside a geo topology) run their nodes here, so that neither keeps a copy of the node's
plumbing (issue 21). What a node decides is :class:`~cluster.node.NodeCore`'s (and the pure modules it
drives: ``cluster/lead.py``, ``cluster/member.py``, ``cluster/controller.py``, ``cluster/producer_snapshot.py``);
:class:`SimNodes` carries its effects out over the simulator's network, disks and metadata, as
``georep/server/cluster_member.py`` does over gRPC and files, and feeds the answers back:

* **the disk** of a node (:class:`SimNode`): per segment a :class:`~georep.sim.cluster_model.SegCopy` (its
  batches and fsynced prefix) and per partition the persisted :class:`~cluster.quorum.GuardState`, written
  before any answer that depends on it; a kill keeps exactly the fsynced part;
* **a member's calls**: appends from a leader (``cluster.member.judge_append``), fences, recovery copies
  (``judge_copy``), repair copies, and the seals it learns from its view (``seals_to_learn``);
* **a leader's effects**: fences and copies with their timeouts, seals and opens proposed to the metadata,
  streams to members from where the resend rule says, releases, rolls;
* **the controller's**: elections, repair copies and fills, rolls asked of leaders.

A simulator provides the network, the clock and the metadata (:class:`Fabric`) and what a leader's partition
means to it (the hooks of :class:`SimNodes`: where appends come from, what a release, a seal or a step-down
does to its producers or its broker state). Checks run where the data changes (``ClusterChecker``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import cluster.producer_snapshot as producer_snapshot
from cluster import member as membership
from cluster.controller import AskRoll, RepairCopy
from cluster.lead import (
    Adopted,
    CopyTail,
    FenceMember,
    LeadContext,
    LeadEffect,
    Note,
    PartitionLead,
    ProposeOpen,
    ProposeSeal,
    Reconnect,
    Release,
    Sealing,
    SegmentSealed,
    StepDown,
    StreamTo,
)
from cluster.node import Leading, NodeConfig, NodeCore, NodeEffect, ProposeElection, ProposeEpoch
from cluster.producer_snapshot import ProducerSnapshot
from cluster.quorum import GuardState, ReplicaGuard
from cluster.site_state import Applied, Command, Result, SealSegment, SiteState
from dedup.producer import ProducerBatch, ProducerStateTable
from georep.sim.cluster_checks import ClusterChecker
from georep.sim.cluster_controller import SimControllers
from georep.sim.cluster_members import SimMembers
from georep.sim.cluster_model import Batch, ClusterCounts, PartKey, SegCopy, SegKey
from offsets.coordinates import Origin
from topology.ids import LeaderEpoch, NodeId, SegmentId

Action = Callable[..., None]
NOTE_COUNTS = {  # what a lead's Note adds to
    "recovery": "recoveries",
    "recovery_done": "recoveries_done",
    "recovery_failed": "recoveries_failed",
    "recovery_superseded": "recoveries_superseded",
    "recovery_copy": "recovery_copies",
    "placement_wait": "placement_waits",
    "quorum_lost": "quorum_lost",
    "quorum_changed": "quorum_rolls",
    "resend": "resends",
}


class Fabric(Protocol):
    """What a simulator gives its nodes: time, the network, the metadata."""

    @property
    def now_ms(self) -> int: ...

    @property
    def counts(self) -> ClusterCounts: ...

    @property
    def checker(self) -> ClusterChecker: ...

    def at(self, delay_ms: int, node: SimNode | None, fn: Action, *args: object) -> None:
        """Run ``fn(*args)`` after ``delay_ms``; on ``node``, only if this incarnation is still up then."""

    def send(self, src: SimNode, dst: NodeId, fn: Action, *args: object) -> None:
        """A message from ``src`` to ``dst``: ``fn(dst's SimNode, *args)`` once delivered (or lost)."""

    def propose(self, node: SimNode, cmd: Command, then: Callable[[Result | None], None] | None = None) -> None:
        """Propose ``cmd`` to the metadata; ``then(result)``, or ``then(None)`` if it was lost or not confirmed."""

    def view(self, node: SimNode) -> SiteState:
        """``node``'s view of the metadata."""

    def reachable(self, src: SimNode, dst: NodeId) -> bool:
        """Whether ``src`` can open a stream to ``dst`` now."""

    def can_lead_metadata(self, node: SimNode) -> bool:
        """Whether ``node``'s replica could lead the metadata log now: a running voter that reaches a majority."""

    def log(self, line: str) -> None: ...


@dataclass(eq=False)
class SimNode:
    """One node: its disk (copies, persisted guards) and, while it runs, its core and volatile state."""

    id: NodeId
    fsync_ms: tuple[int, int]  # how long its disk takes to fsync
    up: bool = True
    incarnation: int = 1
    copies: dict[SegKey, SegCopy] = field(default_factory=dict)  # the disk
    guard_disk: dict[PartKey, GuardState] = field(default_factory=dict)  # the disk
    core: NodeCore | None = None
    guards: dict[PartKey, ReplicaGuard] = field(default_factory=dict)
    unsynced: set[SegKey] = field(default_factory=set)
    fsync_due: bool = False
    after_fsync: list[Callable[[], None]] = field(default_factory=list)
    writer_of: dict[SegKey, tuple[NodeId, int]] = field(default_factory=dict)
    gaps: membership.GapReports = field(default_factory=membership.GapReports)

    def crash(self) -> int:
        """A kill: the unfsynced part of every copy and everything in memory are lost; returns the batches lost."""
        lost = 0
        for seg in sorted(self.copies):
            copy = self.copies[seg]
            lost += len(copy.batches) - copy.fsynced
            del copy.batches[copy.fsynced :]
        self.up = False
        self.incarnation += 1
        self.core = None
        self.guards = {}
        self.unsynced = set()
        self.fsync_due = False
        self.after_fsync = []
        self.writer_of = {}
        self.gaps = membership.GapReports()
        return lost


class SimNodes:
    """The nodes of one simulated site and their shells; subclasses say what a partition means to their site."""

    origin: Origin  # the site's: whose producers the tables keep

    def __init__(
        self,
        fabric: Fabric,
        config: NodeConfig,
        fence_timeout_ms: int,
        copy_timeout_ms: int,
        rng_between: Callable[[tuple[int, int]], int],
        controllers: Callable[[SimNodes], SimControllers] = SimControllers,
    ) -> None:
        self.fabric = fabric
        self.config = config
        self.fence_timeout_ms = fence_timeout_ms
        self.copy_timeout_ms = copy_timeout_ms
        self.between = rng_between
        self.nodes: dict[NodeId, SimNode] = {}
        self.members = SimMembers(self)
        self.controllers = controllers(self)

    @property
    def counts(self) -> ClusterCounts:
        return self.fabric.counts

    @property
    def checker(self) -> ClusterChecker:
        return self.fabric.checker

    def node(self, nid: NodeId) -> SimNode:
        return self.nodes[nid]

    # -- life -----------------------------------------------------------------------------------------------

    def boot(self, node: SimNode) -> None:
        """``node`` starts (or restarts): a core that knows which epochs were granted before it (its view now)."""
        view = self.fabric.view(node)
        epochs = {(i.topic, i.partition): i.leader_epoch for i in view.partitions()}
        node.core = NodeCore(node.id, self.config, epochs)

    def kill(self, node: SimNode) -> int:
        lost = node.crash()
        self.checker.crashed(node.id, self.fabric.now_ms, node.copies)
        return lost

    def tick(self, node: SimNode) -> None:
        """Learn the view's seals, then the core's tick: the controller if this node leads the metadata, and every
        lead's due retries, roll seals and reconnections."""
        core = node.core
        assert core is not None
        view = self.fabric.view(node)
        self.members.learn(node, view)
        self.run(
            node,
            core.tick(view, self.fabric.now_ms, self.controllers.leads_metadata(node), self.controllers.repair_sizes()),
        )
        self.reconcile(node)

    def reconcile(self, node: SimNode) -> None:
        core = node.core
        if core is not None:
            self.run(node, core.reconcile(self.fabric.view(node), self.fabric.now_ms))

    def step(
        self, node: SimNode, key: PartKey, event: Callable[[PartitionLead, LeadContext], list[LeadEffect]]
    ) -> None:
        """Feed ``node``'s lead of ``key`` an event and carry out what it returns."""
        core = node.core
        if core is not None and node.up:
            self.run(node, core.step(self.fabric.view(node), key, self.fabric.now_ms, event))

    def lead(self, node: SimNode, key: PartKey) -> PartitionLead | None:
        return node.core.leads.get(key) if node.core is not None and node.up else None

    def table_now_ms(self) -> int:
        """The clock a leader's producers' table is built with (the clock of the broker that appends)."""
        return self.fabric.now_ms

    # -- guards and disks -----------------------------------------------------------------------------------

    def new_copy(self, node: SimNode, seg: SegKey, base: int, how: str) -> SegCopy:
        copy = node.copies[seg] = SegCopy(base, via_repair=how == "repair")
        return copy

    # -- effects --------------------------------------------------------------------------------------------

    def run(self, node: SimNode, effects: Iterable[NodeEffect]) -> None:
        """Carry out ``node``'s core's effects, in order (a kill on the way drops the rest)."""
        for eff in effects:
            if not node.up or node.core is None:
                return
            if isinstance(eff, StreamTo):
                self._stream(node, eff)
            elif isinstance(eff, Release):
                self.released(node, eff)
            elif isinstance(eff, FenceMember):
                self._fence(node, eff)
            elif isinstance(eff, CopyTail):
                self._copy(node, eff)
            elif isinstance(eff, ProposeSeal):
                self._seal(node, eff)
            elif isinstance(eff, ProposeOpen):
                self._open(node, eff)
            else:
                self._run_other(node, eff)

    def _run_other(self, node: SimNode, eff: NodeEffect) -> None:
        if isinstance(eff, Adopted):
            self.fabric.log(
                f"node {node.id} writes {eff.key} segment {eff.segment_id} at {eff.base_offset} on {list(eff.ensemble)}"
            )
            self.adopted(node, eff)
        elif isinstance(eff, Reconnect):
            if self.fabric.reachable(node, eff.member):
                self.step(node, eff.key, lambda ld, ctx: ld.member_reconnected(eff.member))
        elif isinstance(eff, Sealing):
            self.sealing(node, eff)
        elif isinstance(eff, SegmentSealed):
            if not eff.roll and eff.end > self.checker.acked_end((eff.key[0], eff.key[1], eff.segment_id)):
                self.counts.recovered_tails += 1
            self.segment_sealed(node, eff)
        elif isinstance(eff, StepDown):
            self.counts.step_downs += 1
            self.fabric.log(f"node {node.id} steps down from {eff.key} epoch {eff.epoch}: {eff.reason}")
            self.stepped_down(node, eff)
        elif isinstance(eff, Note):
            name = NOTE_COUNTS.get(eff.what)
            if name is not None:
                setattr(self.counts, name, getattr(self.counts, name) + 1)
            if eff.message:
                self.fabric.log(f"node {node.id} {eff.key}: {eff.message}")
        elif isinstance(eff, Leading):
            self.fabric.log(f"node {node.id} leads {eff.key} in epoch {eff.epoch}")
        elif isinstance(eff, ProposeEpoch):
            self.counts.reelections += 1
            key, epoch, core = eff.key, eff.command.expected_epoch, node.core
            assert core is not None
            self.fabric.propose(node, eff.command, lambda result: core.epoch_asked(key, epoch, result))
        elif isinstance(eff, ProposeElection):
            self.controllers.elect(node, eff)
        elif isinstance(eff, RepairCopy):
            self.controllers.repair_copy(node, eff)
        elif isinstance(eff, AskRoll):
            self.controllers.ask_roll(node, eff)

    # -- a leader: recovery ---------------------------------------------------------------------------------

    def _fence(self, node: SimNode, eff: FenceMember) -> None:
        seg = (eff.key[0], eff.key[1], eff.segment.segment_id)
        self.fabric.send(
            node,
            eff.member,
            self.members.member_fence,
            seg,
            int(eff.segment.base_offset),
            eff.epoch,
            node.id,
            eff.attempt,
        )
        key, attempt, member = eff.key, eff.attempt, eff.member
        self.fabric.at(
            self.fence_timeout_ms, node, self.step, node, key, lambda ld, ctx: ld.unreachable(attempt, member, ctx)
        )

    def step_answer(
        self, leader: SimNode, key: PartKey, event: Callable[[PartitionLead, LeadContext], list[LeadEffect]]
    ) -> None:
        self.step(leader, key, event)

    def _copy(self, node: SimNode, eff: CopyTail) -> None:
        seg = (eff.key[0], eff.key[1], eff.segment.segment_id)
        self.fabric.send(
            node, eff.copy.source, self.members.copy_source, seg, int(eff.segment.base_offset), eff, node.id
        )
        key, attempt, cid, target = eff.key, eff.attempt, eff.copy_id, eff.copy.target
        self.fabric.at(
            self.copy_timeout_ms,
            node,
            self.step,
            node,
            key,
            lambda ld, ctx: ld.copy_failed(attempt, cid, target, "timeout", ctx),
        )

    def _seal(self, node: SimNode, eff: ProposeSeal) -> None:
        cmd = self.seal_command(node, eff)
        if cmd is None:
            return
        key, token = eff.key, eff.token
        self.fabric.propose(
            node, cmd, lambda result: self.step(node, key, lambda ld, ctx: ld.sealed(token, result, ctx))
        )

    def seal_producers(self, node: SimNode, eff: ProposeSeal, batches: list[ProducerBatch]) -> ProducerSnapshot:
        """The producers' table a seal carries (as ``georep/server/cluster_member.py`` ``seal_producers``): the
        proposer's view's last snapshot, then ``batches`` (the segment's below the end, which it holds)."""
        info = self.fabric.view(node).partition(*eff.key)
        sealed = info.sealed_producers(self.origin) if info is not None else None
        history = producer_snapshot.history_at_open(
            sealed, lambda: self.held_entries(node, eff.key, eff.segment.segment_id)
        )
        return producer_snapshot.fold(history, self.origin, batches, now_ms=self.table_now_ms())

    def producer_table(
        self, node: SimNode, key: PartKey, segment_id: SegmentId, own: list[ProducerBatch]
    ) -> ProducerStateTable:
        """The table a leader starts writing ``segment_id`` with, as the node builds it
        (``georep/server/site_cluster.py`` ``leader_producers``); ``own``: the segment's batches so far."""
        info = self.fabric.view(node).partition(*key)
        sealed = info.sealed_producers(self.origin) if info is not None else None
        last = next((s for s in reversed(info.segments) if s.sealed), None) if info is not None else None
        if last is not None and last.end_offset is not None and last.end_offset > last.base_offset:
            copy = node.copies.get((key[0], key[1], last.segment_id))
            if copy is None or copy.end < last.end_offset:
                self.counts.leaders_missing_history += 1
        history = producer_snapshot.history_at_open(sealed, lambda: self.held_entries(node, key, segment_id))
        return ProducerStateTable.rebuild(itertools.chain(history, own), now_ms=self.table_now_ms(), origin=self.origin)

    # -- a leader: opening, streaming -----------------------------------------------------------------------

    def _open(self, node: SimNode, eff: ProposeOpen) -> None:
        self.placing(node, eff)
        cmd, key = eff.command, eff.key
        self.fabric.propose(node, cmd, lambda result: self.step(node, key, lambda ld, ctx: ld.opened(cmd, result, ctx)))

    def _stream(self, node: SimNode, eff: StreamTo) -> None:
        """Send ``eff.member`` what the leader's copy holds from ``eff.offset``."""
        lead = self.lead(node, eff.key)
        q = lead.quorum if lead is not None else None
        copy = node.copies.get((eff.key[0], eff.key[1], eff.segment_id))
        if lead is None or q is None or copy is None or q.segment_id != eff.segment_id:
            return
        batches = tuple(copy.read(eff.offset, q.appended_end))
        if batches:
            self.fabric.send(
                node,
                eff.member,
                self.members.member_append,
                eff.key,
                eff.segment_id,
                q.base_offset,
                lead.epoch,
                node.id,
                node.incarnation,
                batches,
            )

    def member_acked(self, node: SimNode, key: PartKey, segment_id: SegmentId, member: NodeId, end: int) -> None:
        lead = self.lead(node, key)
        q = lead.quorum if lead is not None else None
        if lead is not None and q is not None and q.segment_id == segment_id and lead.writing:
            self.step(node, key, lambda ld, ctx: ld.member_acked(member, end))

    def stream_broken(self, node: SimNode, member: NodeId) -> None:
        """``node`` noticed that its streams to ``member`` broke."""
        core = node.core
        if core is None or member == node.id:
            return
        now = self.fabric.now_ms
        for key in sorted(core.leads):
            self.step(node, key, lambda ld, ctx: ld.member_failed(member, now))

    def append_as_leader(self, node: SimNode, lead: PartitionLead, batch: Batch) -> bool:
        """Append ``batch`` to the leader's copy and stream it; False if its own guard refuses (it steps down)."""
        q = lead.quorum
        assert q is not None
        key = lead.key
        seg = (key[0], key[1], q.segment_id)
        copy = node.copies.get(seg)
        if copy is None:
            copy = self.new_copy(node, seg, q.base_offset, "append")
        guard = self.members.guard(node, key)
        verdict = membership.judge_append(guard, lead.epoch, seg, batch.offset, copy.end, node.gaps)
        if isinstance(verdict, membership.Refuse):
            self.run(node, node.core.step_down(key, verdict.message) if node.core is not None else [])
            return False
        if not isinstance(verdict, membership.Take):
            self.checker.fail("CORE", f"the leader's own guard judged {batch} of {seg} {verdict}")
            return False
        if verdict.persist:
            self.members.persist(node, key)
        self.checker.accepted(node.id, key, lead.epoch, (node.id, node.incarnation))
        self.checker.writer_append(seg, (node.id, node.incarnation, lead.epoch), batch)
        self.checker.copy_write(node.id, seg, copy, batch, "append")
        copy.batches.append(batch)
        node.unsynced.add(seg)
        self.members.fsync_soon(node)
        self.step(node, key, lambda ld, ctx: ld.appended(batch.end))
        return True

    # -- repair ---------------------------------------------------------------------------------------------

    def roll_asked(self, node: SimNode, key: PartKey, segment_id: SegmentId) -> None:
        lead = self.lead(node, key)
        q = lead.quorum if lead is not None else None
        if lead is not None and q is not None and lead.active and q.segment_id == segment_id:
            self.counts.rolls_by_repair += 1
            self.step(node, key, lambda ld, ctx: ld.start_roll(ctx.now_ms))

    # -- what a partition means to the simulator: the hooks --------------------------------------------------

    def held_entries(self, node: SimNode, key: PartKey, before: SegmentId) -> list[ProducerBatch]:
        """The producers' batches in ``node``'s copies of ``key``'s segments before ``before``."""
        raise NotImplementedError

    def seal_command(self, node: SimNode, eff: ProposeSeal) -> SealSegment | None:
        """The ``SealSegment`` of ``eff``, with the summary of the node's copy below the end."""
        raise NotImplementedError

    def adopted(self, node: SimNode, eff: Adopted) -> None:
        """The lead writes a segment now."""

    def released(self, node: SimNode, eff: Release) -> None:
        """Acks up to ``eff.end`` may go."""

    def sealing(self, node: SimNode, eff: Sealing) -> None:
        """A roll began: no more appends."""

    def segment_sealed(self, node: SimNode, eff: SegmentSealed) -> None:
        """A seal this node proposed committed."""

    def stepped_down(self, node: SimNode, eff: StepDown) -> None:
        """The lead ended: what waits on it fails."""

    def own_fsync(self, node: SimNode, key: PartKey, end: int) -> None:
        """The leader fsynced its own copy up to ``end`` (one member's share of the LAC)."""

    def placing(self, node: SimNode, eff: ProposeOpen) -> None:
        """A new segment's ensemble is about to be proposed (the checks of placement)."""

    def appending(self, member: SimNode, key: PartKey, epoch: LeaderEpoch) -> None:
        """A member gets an append under ``epoch`` (before its guard judges it)."""


def applied(result: Result | None) -> bool:
    return isinstance(result, Applied)
