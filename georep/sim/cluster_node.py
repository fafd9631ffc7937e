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
from cluster.controller import AskRoll, RepairCopy, short_segments
from cluster.ids import LeaderEpoch, NodeId, SegmentId
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
from cluster.site_state import AddMember, Applied, Command, ReplaceMember, Result, SealSegment, SegmentInfo, SiteState
from dedup.producer import ProducerBatch, ProducerStateTable
from georep.sim.checker import InvariantViolation
from georep.sim.cluster_checks import ClusterChecker
from georep.sim.cluster_model import Batch, ClusterCounts, PartKey, SegCopy, SegKey
from offsets.coordinates import Origin

Action = Callable[..., None]
NOTE_COUNTS = {  # what a lead's Note adds to
    "recovery": "recoveries", "recovery_done": "recoveries_done", "recovery_failed": "recoveries_failed",
    "recovery_superseded": "recoveries_superseded", "recovery_copy": "recovery_copies",
    "placement_wait": "placement_waits", "quorum_lost": "quorum_lost", "resend": "resends",
}  # fmt: skip


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

    def __init__(self, fabric: Fabric, config: NodeConfig, fence_timeout_ms: int, copy_timeout_ms: int,
                 rng_between: Callable[[tuple[int, int]], int]) -> None:  # fmt: skip
        self.fabric = fabric
        self.config = config
        self.fence_timeout_ms = fence_timeout_ms
        self.copy_timeout_ms = copy_timeout_ms
        self.between = rng_between
        self.nodes: dict[NodeId, SimNode] = {}

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
        self.learn(node, view)
        self.run(node, core.tick(view, self.fabric.now_ms, self.leads_metadata(node), self.repair_sizes()))
        self.reconcile(node)

    def metadata_leader(self) -> NodeId | None:
        """The simulated metadata log's leader: the lowest-numbered node whose replica can lead it now."""
        return next((nid for nid in sorted(self.nodes) if self.fabric.can_lead_metadata(self.nodes[nid])), None)

    def leads_metadata(self, node: SimNode) -> bool:
        """Whether ``node`` is the controller now, the one controller rule (``cluster/controller.py``): its replica
        leads the metadata log. A node that wakes from a pause still holding a controller keeps it until its next
        tick says otherwise, and no other node takes over while one that can lead the log still holds one."""
        if self.metadata_leader() != node.id:
            return False
        if node.core is not None and node.core.controller is not None:
            return True
        return not any(n.core is not None and n.core.controller is not None and self.fabric.can_lead_metadata(n)
                       for nid, n in sorted(self.nodes.items()) if nid != node.id)  # fmt: skip

    def reconcile(self, node: SimNode) -> None:
        core = node.core
        if core is not None:
            self.run(node, core.reconcile(self.fabric.view(node), self.fabric.now_ms))

    def step(self, node: SimNode, key: PartKey,
             event: Callable[[PartitionLead, LeadContext], list[LeadEffect]]) -> None:  # fmt: skip
        """Feed ``node``'s lead of ``key`` an event and carry out what it returns."""
        core = node.core
        if core is not None and node.up:
            self.run(node, core.step(self.fabric.view(node), key, self.fabric.now_ms, event))

    def lead(self, node: SimNode, key: PartKey) -> PartitionLead | None:
        return node.core.leads.get(key) if node.core is not None and node.up else None

    def repair_sizes(self) -> Callable[[SegmentInfo], int] | None:
        """What a sealed segment weighs, for repair placement; None: the controller plans no repair here."""
        return None

    def table_now_ms(self) -> int:
        """The clock a leader's producers' table is built with (the clock of the broker that appends)."""
        return self.fabric.now_ms

    # -- guards and disks -----------------------------------------------------------------------------------

    def guard(self, node: SimNode, key: PartKey) -> ReplicaGuard:
        guard = node.guards.get(key)
        if guard is None:
            guard = node.guards[key] = ReplicaGuard(node.guard_disk.get(key))
        return guard

    def persist(self, node: SimNode, key: PartKey) -> None:
        """The guard's state goes to disk before the node answers (``ReplicaGuard``'s docstring)."""
        state = self.guard(node, key).state
        node.guard_disk[key] = state
        self.checker.fence_state(node.id, key, state.fenced_epoch)

    def fsync_soon(self, node: SimNode, then: Callable[[], None] | None = None) -> None:
        if then is not None:
            node.after_fsync.append(then)
        if not node.fsync_due:
            node.fsync_due = True
            self.fabric.at(self.between(node.fsync_ms), node, self.fsync_done, node)

    def fsync_done(self, node: SimNode) -> None:
        node.fsync_due = False
        changed, node.unsynced = sorted(node.unsynced), set()
        callbacks, node.after_fsync = node.after_fsync, []
        for seg in changed:
            copy = node.copies.get(seg)
            if copy is None:
                continue
            copy.fsynced = len(copy.batches)
            self._fsynced(node, seg, copy.fsynced_end)
        for then in callbacks:
            then()
        if node.unsynced:
            self.fsync_soon(node)

    def _fsynced(self, node: SimNode, seg: SegKey, end: int) -> None:
        key = (seg[0], seg[1])
        lead = self.lead(node, key)
        q = lead.quorum if lead is not None else None
        if lead is not None and q is not None and q.segment_id == seg[2]:
            if lead.writing and end <= q.appended_end:
                self.step(node, key, lambda ld, ctx: ld.member_acked(node.id, end))
                self.own_fsync(node, key, end)
            return
        writer = node.writer_of.get(seg)
        if writer is not None and writer[0] != node.id:
            self.fabric.send(node, writer[0], self.member_acked, key, seg[2], node.id, end)

    def learn(self, node: SimNode, view: SiteState) -> None:
        """Committed seals: the guard refuses the sealed segments from now on, and a longer copy is cut."""
        guards = {key: self.guard(node, key).state for key in sorted({(s[0], s[1]) for s in node.copies} |
                                                                     set(node.guard_disk))}  # fmt: skip
        ends = {seg: node.copies[seg].end for seg in sorted(node.copies)}
        for step in membership.seals_to_learn(view, guards, ends):
            if isinstance(step, membership.GuardSeal):
                self.guard(node, step.key).seal(step.epoch, step.through)
                self.persist(node, step.key)
            else:
                self.cut(node, step.segment, step.end)
        for seg in sorted(node.copies):
            info = view.partition(seg[0], seg[1])
            segment = info.segment(seg[2]) if info is not None else None
            if segment is not None and segment.end_offset is not None and node.copies[seg].end > segment.end_offset:
                self.checker.fail("C3", f"prefix: node {node.id} knows {seg[0]}/{seg[1]} segment {seg[2]} is sealed "
                                        f"at {segment.end_offset} but its copy still ends at "
                                        f"{node.copies[seg].end}")  # fmt: skip

    def cut(self, node: SimNode, seg: SegKey, end: int) -> None:
        copy = node.copies[seg]
        i = copy.index_at(end)
        if i < 0:
            self.checker.fail("C3", f"prefix: node {node.id} must cut {seg[0]}/{seg[1]} segment {seg[2]} at {end}, "
                                    "which is not a batch boundary of its copy")  # fmt: skip
            return
        self.counts.tail_cuts += 1
        self.fabric.log(f"node {node.id} cuts {seg} from {copy.end} to {end}")
        del copy.batches[i:]
        copy.fsynced = min(copy.fsynced, i)
        self.checker.touched(seg)

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
            self.fabric.log(f"node {node.id} writes {eff.key} segment {eff.segment_id} at {eff.base_offset} on "
                            f"{list(eff.ensemble)}")  # fmt: skip
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
            self._elect(node, eff)
        elif isinstance(eff, RepairCopy):
            self.repair_copy(node, eff)
        elif isinstance(eff, AskRoll):
            self.ask_roll(node, eff)

    def _elect(self, node: SimNode, eff: ProposeElection) -> None:
        core = node.core
        ctl = core.controller if core is not None else None
        if ctl is None:
            return
        key, expected = (eff.command.topic, eff.command.partition), eff.command.expected_epoch
        self.fabric.propose(node, eff.command, lambda result: ctl.election_done(key, expected))

    # -- a leader: recovery ---------------------------------------------------------------------------------

    def _fence(self, node: SimNode, eff: FenceMember) -> None:
        seg = (eff.key[0], eff.key[1], eff.segment.segment_id)
        self.fabric.send(node, eff.member, self.member_fence, seg, int(eff.segment.base_offset), eff.epoch, node.id,
                         eff.attempt)  # fmt: skip
        key, attempt, member = eff.key, eff.attempt, eff.member
        self.fabric.at(self.fence_timeout_ms, node, self.step, node, key,
                       lambda ld, ctx: ld.unreachable(attempt, member, ctx))  # fmt: skip

    def member_fence(self, member: SimNode, seg: SegKey, base: int, epoch: LeaderEpoch, leader: NodeId,
                     attempt: int) -> None:  # fmt: skip
        key = (seg[0], seg[1])
        refused = membership.judge_fence(self.guard(member, key), epoch)
        if refused is not None:
            their = int(refused.fenced_epoch)
            self.fabric.send(member, leader, self.step_answer, key, lambda ld, ctx: ld.fence_refused(attempt,
                                                                                                  member.id, their,
                                                                                                  ctx))  # fmt: skip
            return
        self.persist(member, key)
        copy = member.copies.get(seg)
        if copy is not None and copy.fsynced < len(copy.batches):
            member.unsynced.add(seg)

        def answer() -> None:  # what it holds durably, after its fsync: an acked batch is there
            end = copy.fsynced_end if copy is not None else base
            self.fabric.send(member, leader, self.step_answer, key, lambda ld, ctx: ld.fenced(attempt, member.id,
                                                                                              end, ctx))  # fmt: skip

        self.fsync_soon(member, answer)

    def step_answer(self, leader: SimNode, key: PartKey,
                    event: Callable[[PartitionLead, LeadContext], list[LeadEffect]]) -> None:  # fmt: skip
        self.step(leader, key, event)

    def _copy(self, node: SimNode, eff: CopyTail) -> None:
        seg = (eff.key[0], eff.key[1], eff.segment.segment_id)
        self.fabric.send(node, eff.copy.source, self.copy_source, seg, int(eff.segment.base_offset), eff, node.id)
        key, attempt, cid, target = eff.key, eff.attempt, eff.copy_id, eff.copy.target
        self.fabric.at(self.copy_timeout_ms, node, self.step, node, key,
                       lambda ld, ctx: ld.copy_failed(attempt, cid, target, "timeout", ctx))  # fmt: skip

    def copy_source(self, source: SimNode, seg: SegKey, base: int, eff: CopyTail, leader: NodeId) -> None:
        copy = source.copies.get(seg)
        c = eff.copy
        if copy is None or copy.fsynced_end < c.end_offset:
            held = copy.fsynced_end if copy is not None else base
            self._copy_answer(source, leader, eff, None, f"source {source.id} holds only up to {held}")
            return
        batches = tuple(copy.read(int(c.start_offset), int(c.end_offset), fsynced_only=True))
        self.fabric.send(source, c.target, self.copy_target, seg, base, batches, eff, leader)

    def copy_target(self, target: SimNode, seg: SegKey, base: int, batches: tuple[Batch, ...], eff: CopyTail,
                    leader: NodeId) -> None:  # fmt: skip
        key = (seg[0], seg[1])
        refused = membership.judge_copy(self.guard(target, key), eff.epoch, seg[2])
        if refused is not None:
            self._copy_answer(target, leader, eff, None, int(refused.fenced_epoch) if refused.why == "fenced"
                              else refused.message)  # fmt: skip
            return
        self.persist(target, key)
        copy = target.copies.get(seg)
        if copy is None:
            copy = self.new_copy(target, seg, base, "recovery copy")
        for b in batches:
            if b.end <= copy.end:
                self.checker.check_held(target.id, seg, b, "recovery")
                continue
            if b.offset != copy.end:
                break
            self.checker.copy_write(target.id, seg, copy, b, "recovery")
            copy.batches.append(b)
        target.unsynced.add(seg)
        end = int(eff.copy.end_offset)
        ok = copy.end >= end
        self.fsync_soon(target, lambda: self._copy_answer(target, leader, eff, end if ok else None,
                                                          None if ok else "gap"))  # fmt: skip

    def _copy_answer(self, node: SimNode, leader: NodeId, eff: CopyTail, end: int | None,
                     why: str | int | None) -> None:  # fmt: skip
        attempt, cid, target = eff.attempt, eff.copy_id, eff.copy.target
        event: Callable[[PartitionLead, LeadContext], list[LeadEffect]]
        if end is not None:
            event = lambda ld, ctx: ld.copied(attempt, cid, target, end, ctx)  # noqa: E731
        elif isinstance(why, int):
            event = lambda ld, ctx: ld.copy_refused(attempt, cid, target, why, ctx)  # noqa: E731
        else:
            event = lambda ld, ctx: ld.copy_failed(attempt, cid, target, str(why), ctx)  # noqa: E731
        self.fabric.send(node, leader, self.step_answer, eff.key, event)

    def _seal(self, node: SimNode, eff: ProposeSeal) -> None:
        cmd = self.seal_command(node, eff)
        if cmd is None:
            return
        key, token = eff.key, eff.token
        self.fabric.propose(node, cmd, lambda result: self.step(node, key,
                                                                lambda ld, ctx: ld.sealed(token, result, ctx)))

    def seal_producers(self, node: SimNode, eff: ProposeSeal, batches: list[ProducerBatch]) -> ProducerSnapshot:
        """The producers' table a seal carries (as ``georep/server/cluster_member.py`` ``seal_producers``): the
        proposer's view's last snapshot, then ``batches`` (the segment's below the end, which it holds)."""
        info = self.fabric.view(node).partition(*eff.key)
        sealed = info.sealed_producers(self.origin) if info is not None else None
        history = producer_snapshot.history_at_open(
            sealed, lambda: self.held_entries(node, eff.key, eff.segment.segment_id))
        return producer_snapshot.fold(history, self.origin, batches, now_ms=self.table_now_ms())

    def producer_table(self, node: SimNode, key: PartKey, segment_id: SegmentId,
                       own: list[ProducerBatch]) -> ProducerStateTable:  # fmt: skip
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
        return ProducerStateTable.rebuild(itertools.chain(history, own), now_ms=self.table_now_ms(),
                                         origin=self.origin)  # fmt: skip

    # -- a leader: opening, streaming -----------------------------------------------------------------------

    def _open(self, node: SimNode, eff: ProposeOpen) -> None:
        self.placing(node, eff)
        cmd, key = eff.command, eff.key
        self.fabric.propose(node, cmd, lambda result: self.step(node, key,
                                                                lambda ld, ctx: ld.opened(cmd, result, ctx)))

    def _stream(self, node: SimNode, eff: StreamTo) -> None:
        """Send ``eff.member`` what the leader's copy holds from ``eff.offset``."""
        lead = self.lead(node, eff.key)
        q = lead.quorum if lead is not None else None
        copy = node.copies.get((eff.key[0], eff.key[1], eff.segment_id))
        if lead is None or q is None or copy is None or q.segment_id != eff.segment_id:
            return
        batches = tuple(copy.read(eff.offset, q.appended_end))
        if batches:
            self.fabric.send(node, eff.member, self.member_append, eff.key, eff.segment_id, q.base_offset, lead.epoch,
                             node.id, node.incarnation, batches)  # fmt: skip

    def member_append(self, member: SimNode, key: PartKey, segment_id: SegmentId, base: int, epoch: LeaderEpoch,
                      sender: NodeId, sender_inc: int, batches: tuple[Batch, ...]) -> None:  # fmt: skip
        """A member gets a leader's batches: its guard judges each; it appends, fsyncs and acks its end."""
        seg = (key[0], key[1], segment_id)
        self.appending(member, key, epoch)
        guard = self.guard(member, key)
        copy = member.copies.get(seg)
        wrote = False
        for batch in batches:
            end = copy.end if copy is not None else base
            verdict = membership.judge_append(guard, epoch, seg, batch.offset, end, member.gaps)
            if isinstance(verdict, membership.Refuse):
                self.counts.fenced_appends += verdict.why == "fenced"
                self.fabric.send(member, sender, self.append_refused, key, segment_id, member.id, verdict.why)
                return
            if isinstance(verdict, membership.Held):  # a resend of what it holds: the same bytes (C3), acked again
                if copy is not None:
                    self.checker.check_held(member.id, seg, batch, "resend")
                    member.writer_of[seg] = (sender, sender_inc)
                    wrote = True
                continue
            if isinstance(verdict, membership.Gap):
                if verdict.report:
                    self.counts.gaps += 1
                    self.fabric.send(member, sender, self.append_gap, key, segment_id, member.id, verdict.end)
                break
            if verdict.persist:
                self.persist(member, key)
            self.checker.accepted(member.id, key, epoch, (sender, sender_inc))
            if copy is None:
                copy = self.new_copy(member, seg, base, "append")
            self.checker.copy_write(member.id, seg, copy, batch, "append")
            copy.batches.append(batch)
            member.writer_of[seg] = (sender, sender_inc)
            wrote = True
        if wrote:
            member.unsynced.add(seg)
            self.fsync_soon(member)

    def append_refused(self, node: SimNode, key: PartKey, segment_id: SegmentId, member: NodeId, why: str) -> None:
        self.step(node, key, lambda ld, ctx: ld.member_refused(segment_id, member, why))

    def append_gap(self, node: SimNode, key: PartKey, segment_id: SegmentId, member: NodeId, end: int) -> None:
        self.step(node, key, lambda ld, ctx: ld.member_gap(segment_id, member, end))

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
        verdict = membership.judge_append(self.guard(node, key), lead.epoch, seg, batch.offset, copy.end, node.gaps)
        if isinstance(verdict, membership.Refuse):
            self.run(node, node.core.step_down(key, verdict.message) if node.core is not None else [])
            return False
        if not isinstance(verdict, membership.Take):
            self.checker.fail("CORE", f"the leader's own guard judged {batch} of {seg} {verdict}")
            return False
        if verdict.persist:
            self.persist(node, key)
        self.checker.accepted(node.id, key, lead.epoch, (node.id, node.incarnation))
        self.checker.writer_append(seg, (node.id, node.incarnation, lead.epoch), batch)
        self.checker.copy_write(node.id, seg, copy, batch, "append")
        copy.batches.append(batch)
        node.unsynced.add(seg)
        self.fsync_soon(node)
        self.step(node, key, lambda ld, ctx: ld.appended(batch.end))
        return True

    # -- repair ---------------------------------------------------------------------------------------------

    def repair_copy(self, node: SimNode, eff: RepairCopy) -> None:
        raise InvariantViolation(f"CORE: a controller without repair planned {eff}")

    def ask_roll(self, node: SimNode, eff: AskRoll) -> None:
        self.counts.rolls_to_widen += eff.widen
        self.fabric.send(node, eff.leader, self.roll_asked, eff.key, eff.segment_id)

    def roll_asked(self, node: SimNode, key: PartKey, segment_id: SegmentId) -> None:
        lead = self.lead(node, key)
        q = lead.quorum if lead is not None else None
        if lead is not None and q is not None and lead.active and q.segment_id == segment_id:
            self.counts.rolls_by_repair += 1
            self.step(node, key, lambda ld, ctx: ld.start_roll(ctx.now_ms))

    def repair_source(self, source: SimNode, seg: SegKey, base: int, end: int, target: NodeId, ctl_node: NodeId,
                      copy_id: int) -> None:  # fmt: skip
        copy = source.copies.get(seg)
        batches = tuple(copy.read(base, end, fsynced_only=True)) if copy is not None else ()
        self.fabric.send(source, target, self.repair_target, seg, base, batches, ctl_node, copy_id)

    def repair_target(self, target: SimNode, seg: SegKey, base: int, batches: tuple[Batch, ...], ctl_node: NodeId,
                      copy_id: int) -> None:  # fmt: skip
        copy = target.copies.get(seg)
        if copy is None:
            copy = self.new_copy(target, seg, base, "repair")
        for b in batches:
            if b.end <= copy.end:
                self.checker.check_held(target.id, seg, b, "repair")
                continue
            if b.offset != copy.end:
                break
            self.checker.copy_write(target.id, seg, copy, b, "repair")
            copy.batches.append(b)
        target.unsynced.add(seg)
        self.fsync_soon(target, lambda: self.fabric.send(target, ctl_node, self.repair_done, copy_id, target.id,
                                                         copy.fsynced_end))  # fmt: skip

    def repair_done(self, node: SimNode, copy_id: int, target: NodeId, end: int) -> None:
        ctl = node.core.controller if node.core is not None else None
        if ctl is None:
            return
        whole, cmd = ctl.repair_answered(copy_id, target, end, self.fabric.view(node))
        if not whole:
            self.repair_gave_up(ctl.repair_failed(copy_id))
            return
        if isinstance(cmd, AddMember | ReplaceMember):
            self.fabric.propose(node, cmd, lambda result: ctl.recorded(copy_id))

    def repair_gave_up(self, effect: object) -> None:
        """A repair copy failed (a short copy, a timeout): it is planned afresh."""

    def report_short(self, node: SimNode, controller: NodeId | None) -> None:
        """Tell the controller which sealed segments this member holds less of than the sealed end."""
        if controller is None:
            return
        ends = {seg: copy.fsynced_end for seg, copy in sorted(node.copies.items())}
        short = short_segments(self.fabric.view(node), node.id, ends)
        self.fabric.send(node, controller, self.short_reported, node.id, frozenset(short))

    def short_reported(self, node: SimNode, member: NodeId, short: frozenset[SegKey]) -> None:
        ctl = node.core.controller if node.core is not None else None
        if ctl is not None:
            ctl.reported_short(member, set(short))

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
