"""The member side of a simulated node: its disk, and what it does with a leader's appends, fences and copies.

Both cluster simulators' nodes (``georep/sim/cluster_node.py``) are members of segment ensembles; this is what
``georep/storage/replica_store.py`` and the member half of ``georep/server/cluster_member.py`` do on a node, over
the simulator's network and disks, with every decision in :mod:`cluster.member` (and the guard it wraps,
:class:`~cluster.quorum.ReplicaGuard`):

* **the disk**: a guard's state goes to disk before any answer that depends on it; fsyncs take the node's disk
  time, and each fsynced end is acked to the segment's writer (or fed to the node's own lead);
* **a leader's appends** (``judge_append``: take, already held, a gap to report, or refused), **fences**
  (``judge_fence``: answered with the fsynced end, after an fsync), **recovery copies** (``judge_copy``) and
  **repair copies** (from a source's fsynced part);
* **the seals it learns** from its view (``seals_to_learn``: the guard refuses sealed segments, a longer copy is
  cut), and the sealed segments it holds less of than the sealed end, reported to the controller.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from cluster import member as membership
from cluster.controller import short_segments
from cluster.lead import CopyTail, LeadContext, LeadEffect, PartitionLead
from cluster.quorum import ReplicaGuard
from cluster.site_state import SiteState
from georep.sim.cluster_checks import ClusterChecker
from georep.sim.cluster_model import Batch, ClusterCounts, PartKey, SegCopy, SegKey
from topology.ids import LeaderEpoch, NodeId, SegmentId

if TYPE_CHECKING:
    from georep.sim.cluster_node import SimNode, SimNodes


class SimMembers:
    """The member side of every node of one simulated site (see the module docstring)."""

    def __init__(self, shells: SimNodes) -> None:
        self.shells = shells
        self.fabric = shells.fabric

    @property
    def counts(self) -> ClusterCounts:
        return self.fabric.counts

    @property
    def checker(self) -> ClusterChecker:
        return self.fabric.checker

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
            self.fabric.at(self.shells.between(node.fsync_ms), node, self.fsync_done, node)

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
        lead = self.shells.lead(node, key)
        q = lead.quorum if lead is not None else None
        if lead is not None and q is not None and q.segment_id == seg[2]:
            if lead.writing and end <= q.appended_end:
                self.shells.step(node, key, lambda ld, ctx: ld.member_acked(node.id, end))
                self.shells.own_fsync(node, key, end)
            return
        writer = node.writer_of.get(seg)
        if writer is not None and writer[0] != node.id:
            self.fabric.send(node, writer[0], self.shells.member_acked, key, seg[2], node.id, end)

    def learn(self, node: SimNode, view: SiteState) -> None:
        """Committed seals: the guard refuses the sealed segments from now on, and a longer copy is cut."""
        guards = {
            key: self.guard(node, key).state
            for key in sorted({(s[0], s[1]) for s in node.copies} | set(node.guard_disk))
        }
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
                self.checker.fail(
                    "C3",
                    f"prefix: node {node.id} knows {seg[0]}/{seg[1]} segment {seg[2]} is sealed "
                    f"at {segment.end_offset} but its copy still ends at "
                    f"{node.copies[seg].end}",
                )

    def cut(self, node: SimNode, seg: SegKey, end: int) -> None:
        copy = node.copies[seg]
        i = copy.index_at(end)
        if i < 0:
            self.checker.fail(
                "C3",
                f"prefix: node {node.id} must cut {seg[0]}/{seg[1]} segment {seg[2]} at {end}, "
                "which is not a batch boundary of its copy",
            )
            return
        self.counts.tail_cuts += 1
        self.fabric.log(f"node {node.id} cuts {seg} from {copy.end} to {end}")
        del copy.batches[i:]
        copy.fsynced = min(copy.fsynced, i)
        self.checker.touched(seg)

    def member_fence(
        self, member: SimNode, seg: SegKey, base: int, epoch: LeaderEpoch, leader: NodeId, attempt: int
    ) -> None:
        key = (seg[0], seg[1])
        refused = membership.judge_fence(self.guard(member, key), epoch)
        if refused is not None:
            their = int(refused.fenced_epoch)
            self.fabric.send(
                member,
                leader,
                self.shells.step_answer,
                key,
                lambda ld, ctx: ld.fence_refused(attempt, member.id, their, ctx),
            )
            return
        self.persist(member, key)
        copy = member.copies.get(seg)
        if copy is not None and copy.fsynced < len(copy.batches):
            member.unsynced.add(seg)

        def answer() -> None:  # what it holds durably, after its fsync: an acked batch is there
            end = copy.fsynced_end if copy is not None else base
            self.fabric.send(
                member, leader, self.shells.step_answer, key, lambda ld, ctx: ld.fenced(attempt, member.id, end, ctx)
            )

        self.fsync_soon(member, answer)

    def copy_source(self, source: SimNode, seg: SegKey, base: int, eff: CopyTail, leader: NodeId) -> None:
        copy = source.copies.get(seg)
        c = eff.copy
        if copy is None or copy.fsynced_end < c.end_offset:
            held = copy.fsynced_end if copy is not None else base
            self._copy_answer(source, leader, eff, None, f"source {source.id} holds only up to {held}")
            return
        batches = tuple(copy.read(int(c.start_offset), int(c.end_offset), fsynced_only=True))
        self.fabric.send(source, c.target, self.copy_target, seg, base, batches, eff, leader)

    def copy_target(
        self, target: SimNode, seg: SegKey, base: int, batches: tuple[Batch, ...], eff: CopyTail, leader: NodeId
    ) -> None:
        key = (seg[0], seg[1])
        refused = membership.judge_copy(self.guard(target, key), eff.epoch, seg[2])
        if refused is not None:
            self._copy_answer(
                target, leader, eff, None, int(refused.fenced_epoch) if refused.why == "fenced" else refused.message
            )
            return
        self.persist(target, key)
        copy = self._write_copy(target, seg, base, batches, "recovery")
        end = int(eff.copy.end_offset)
        ok = copy.end >= end
        self.fsync_soon(
            target, lambda: self._copy_answer(target, leader, eff, end if ok else None, None if ok else "gap")
        )

    def _copy_answer(
        self, node: SimNode, leader: NodeId, eff: CopyTail, end: int | None, why: str | int | None
    ) -> None:
        attempt, cid, target = eff.attempt, eff.copy_id, eff.copy.target
        event: Callable[[PartitionLead, LeadContext], list[LeadEffect]]
        if end is not None:
            event = lambda ld, ctx: ld.copied(attempt, cid, target, end, ctx)  # noqa: E731
        elif isinstance(why, int):
            event = lambda ld, ctx: ld.copy_refused(attempt, cid, target, why, ctx)  # noqa: E731
        else:
            event = lambda ld, ctx: ld.copy_failed(attempt, cid, target, str(why), ctx)  # noqa: E731
        self.fabric.send(node, leader, self.shells.step_answer, eff.key, event)

    def member_append(
        self,
        member: SimNode,
        key: PartKey,
        segment_id: SegmentId,
        base: int,
        epoch: LeaderEpoch,
        sender: NodeId,
        sender_inc: int,
        batches: tuple[Batch, ...],
    ) -> None:
        """A member gets a leader's batches: its guard judges each; it appends, fsyncs and acks its end."""
        seg = (key[0], key[1], segment_id)
        self.shells.appending(member, key, epoch)
        guard = self.guard(member, key)
        copy = member.copies.get(seg)
        wrote = False
        for batch in batches:
            end = copy.end if copy is not None else base
            verdict = membership.judge_append(guard, epoch, seg, batch.offset, end, member.gaps)
            if isinstance(verdict, membership.Refuse):
                self.counts.fenced_appends += verdict.why == "fenced"
                self.fabric.send(
                    member,
                    sender,
                    self.shells.step_answer,
                    key,
                    lambda ld, ctx, why=verdict.why: ld.member_refused(segment_id, member.id, why),
                )
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
                    self.fabric.send(
                        member,
                        sender,
                        self.shells.step_answer,
                        key,
                        lambda ld, ctx, end=verdict.end: ld.member_gap(segment_id, member.id, end),
                    )
                break
            if verdict.persist:
                self.persist(member, key)
            self.checker.accepted(member.id, key, epoch, (sender, sender_inc))
            if copy is None:
                copy = self.shells.new_copy(member, seg, base, "append")
            self.checker.copy_write(member.id, seg, copy, batch, "append")
            copy.batches.append(batch)
            member.writer_of[seg] = (sender, sender_inc)
            wrote = True
        if wrote:
            member.unsynced.add(seg)
            self.fsync_soon(member)

    def repair_source(
        self, source: SimNode, seg: SegKey, base: int, end: int, target: NodeId, ctl_node: NodeId, copy_id: int
    ) -> None:
        copy = source.copies.get(seg)
        batches = tuple(copy.read(base, end, fsynced_only=True)) if copy is not None else ()
        self.fabric.send(source, target, self.repair_target, seg, base, batches, ctl_node, copy_id)

    def _write_copy(self, target: SimNode, seg: SegKey, base: int, batches: tuple[Batch, ...], why: str) -> SegCopy:
        """A recovery's or a repair's copy into ``target``'s segment: what it holds already is checked, the rest
        appended while contiguous; fsynced later."""
        copy = target.copies.get(seg)
        if copy is None:
            copy = self.shells.new_copy(target, seg, base, "recovery copy" if why == "recovery" else why)
        for b in batches:
            if b.end <= copy.end:
                self.checker.check_held(target.id, seg, b, why)
                continue
            if b.offset != copy.end:
                break
            self.checker.copy_write(target.id, seg, copy, b, why)
            copy.batches.append(b)
        target.unsynced.add(seg)
        return copy

    def repair_target(
        self, target: SimNode, seg: SegKey, base: int, batches: tuple[Batch, ...], ctl_node: NodeId, copy_id: int
    ) -> None:
        copy = self._write_copy(target, seg, base, batches, "repair")
        done = self.shells.controllers.repair_done
        self.fsync_soon(target, lambda: self.fabric.send(target, ctl_node, done, copy_id, target.id, copy.fsynced_end))

    def report_short(self, node: SimNode, controller: NodeId | None) -> None:
        """Tell the controller which sealed segments this member holds less of than the sealed end."""
        if controller is None:
            return
        ends = {seg: copy.fsynced_end for seg, copy in sorted(node.copies.items())}
        short = short_segments(self.fabric.view(node), node.id, ends)
        self.fabric.send(node, controller, self.shells.controllers.short_reported, node.id, frozenset(short))
