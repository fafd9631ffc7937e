"""A deterministic simulator of one site's segment cluster (STYLE.md §2: FoundationDB's Sim2, TigerBeetle's VOPR).

``ClusterSimulator(seed, shape)`` runs the nodes of one site in one thread, with virtual time and a heap
of ``(due_ms, seq, action)``: it jumps time to the next event. The only randomness is one
``random.Random(seed)``; iteration is over sorted keys only; there is no clock. One seed gives one run,
and :attr:`ClusterResult.trace` (a hash of the metadata log and of every ack) proves it.

**The simulator holds no decision of the protocol**, and no node plumbing of its own (issue 21). Every node
is a :class:`~cluster.node.NodeCore`, the object a real node runs (``georep/server/cluster_member.py``), and
its effects are carried out by the node shells both cluster simulators share (``georep/sim/cluster_node.py``)
over a simulated network, disk and Raft log:

=============================================  ===========================================================
decision                                       pure code (driven through ``NodeCore``)
=============================================  ===========================================================
metadata, compare-and-set on epochs, chain     ``SiteState.apply``: every command, in one order (the log)
who leads which partition                      ``Controller.elections`` (``plan_leadership``): the node whose
                                               replica leads the metadata log
lead, recover first, step down, or ask again   ``NodeCore.reconcile`` (``role_step``): every view
recover, open, write, roll; the resend rule    ``PartitionLead`` (``SegmentRecovery``, ``plan_open``,
                                               ``SegmentQuorum``, ``roll_seal_at``)
fencing, contiguity, sealed segments, cuts     ``cluster.member`` (``ReplicaGuard``, ``cut_after_seal``)
what to repair, widen or fill, from/to where   ``Controller.repair_plan`` (``plan_repair``)
the producers' table across leaders            ``cluster.producer_snapshot`` (seals carry it)
=============================================  ===========================================================

What this module adds is the world around the nodes: a producer per partition running the client's idempotent
delivery core (``georep/client/delivery.py``) at ``acks=all``, readers, the Raft log, the network, and faults.
A node that restarts starts a new ``NodeCore`` whose view holds every committed epoch, so an epoch granted
before it asks for a new one (a restarted leader must fence its old self). Members report the sealed segments
they hold less of than the sealed end, and the controller passes them to the planner (``SegmentView.short``).

**The model.** Metadata is one :class:`~cluster.site_state.SiteState`, the Raft log's contract: each
proposal commits after a few ms in one order, unless a majority of the voters (the first nodes) is down
or paused (it waits), or a metadata outage drops it (lost) or stalls it past the proposer's timeout (it
commits anyway: the proposer cannot tell). Nodes act on a view of the metadata that lags the log; the
metadata log's leader (the controller) is the lowest-numbered running voter that reaches the metadata. A
node's disk holds, per segment, a list of ``(offset, records, payload)`` batches and an fsynced prefix, and
the persisted state of each :class:`~cluster.quorum.ReplicaGuard`; a kill loses the unfsynced suffix and
everything in memory. Producers send batches to the leader they last read from the metadata (a client's
cache, refreshed after an error or a timeout) over one ordered connection and resend as the client does; a
reader reads any member up to the LAC its leader reports, or up to the sealed end.

**Faults**, drawn from the seed (``cluster_model.shape_config``): node kills and restarts, a leader killed
between its roll's seal and its next open (so the next leader may hold none of the sealed segment), pauses
(a paused node is silent, then resumes with its stale view: a zombie leader or controller), isolation from
the metadata (a node's proposals are lost and its view freezes while its peers still hear it: a leader the
site has replaced keeps writing), stream cuts (what is in flight on a pair of links is lost, and the sender
notices), partitions between two nodes, metadata outages, and the loss of the metadata majority. A node
joins mid-run in expansion runs.

**The checks** (``cluster_checks.py``, C1 to C6) run after every event, and the producers' own: no send
fails to the application (no spurious ``OutOfOrderSequence``) and no batch is stored twice. A run has two
phases, as in VOPR: safety (the workload and the faults), then liveness (heal every fault, restart every
node, stop new batches, run until every partition has a leader, every batch is acked, the chain holds every
acked batch once at its offset, no segment is under-replicated, none has fewer than RF members while RF nodes
are live, and an added node holds new segments, or fail after ``liveness_ms``). A failure raises
:class:`ClusterSimulationFailure`, whose message holds the seed and the command that replays it
(``python -m georep.sim --cluster --seed N --shape NAME``).
"""

from __future__ import annotations

import hashlib
import heapq
import random
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from cluster import leadership
from cluster.controller import RepairCopy
from cluster.lead import Adopted, PartitionLead, ProposeOpen, ProposeSeal, Release, SegmentSealed, StepDown
from cluster.node import NodeConfig
from cluster.placement import NodeLoad
from cluster.producer_snapshot import ProducerEntry
from cluster.repair import CopySegment, FillSegment
from cluster.site_state import (
    AddMember,
    Applied,
    Command,
    CreateTopic,
    ElectLeader,
    FailOver,
    MergeTopicEntry,
    NodeHeartbeat,
    OpenSegment,
    PartitionInfo,
    RegisterNode,
    ReplaceMember,
    Result,
    SealSegment,
    SegmentInfo,
    SiteState,
)
from dedup.producer import Append, AppendResult, Duplicate, OutOfOrderSequence, ProducerBatch, ProducerStateTable
from georep.broker.errors import NotLeader, SequenceRejected
from georep.client.accumulator import ProducerBatch as ClientBatch
from georep.client.delivery import PartitionDelivery
from georep.client.errors import Operation, from_status
from georep.metadata.topic_entry import alter
from georep.metadata.topics import MAX_BATCH_BYTES_LIMIT, TopicSpec
from georep.record.batch import RecordInput
from georep.server.status import reason_of, status_of
from georep.sim.checker import InvariantViolation
from georep.sim.cluster_checks import ALL_CHECKS, AckedBatch, ClusterChecker
from georep.sim.cluster_controller import SimControllers
from georep.sim.cluster_model import (
    GIB,
    SHAPES,
    START_MS,
    Batch,
    ClusterConfig,
    ClusterCounts,
    PartKey,
    SegCopy,
    SegKey,
    shape_config,
)
from georep.sim.cluster_node import SimNode, SimNodes
from offsets.coordinates import LocalOffset, Origin, OriginSeq
from offsets.vector import VectorOffset
from topology.ids import LeaderEpoch, NodeId, SegmentId, SiteId

ORIGIN = Origin(SiteId("a"), 1)  # the site's origin: in this model a record's origin seq is its local offset
PAYLOADS_PER_PRODUCER = 1_000_000
LIVENESS_CHECK_MS = 200
PROPOSAL_GIVE_UP_MS = 3_000  # a proposal that could not commit for this long is dropped (lost)
READ_BATCHES_MAX = 8
Action = Callable[..., None]


class ClusterSimulationFailure(AssertionError):
    """A run broke an invariant or did not converge. The message says how to replay it."""

    def __init__(self, message: str, seed: int, shape: str, replay: str) -> None:
        self.seed = seed
        self.shape = shape
        self.replay = replay
        super().__init__(f"{message}\n  seed={seed} shape={shape}\n  replay: {replay}")


def replay_command(seed: int, shape: str) -> str:
    return f"python -m georep.sim --cluster --seed {seed} --shape {shape}"


def swarm_shape(seed: int) -> str:
    return SHAPES[seed % len(SHAPES)]


@dataclass(frozen=True, slots=True)
class ClusterResult:
    seed: int
    shape: str
    config: str
    events: int
    virtual_ms: int
    liveness_ms: int
    trace: str
    counts: ClusterCounts


# -- the simulated world ------------------------------------------------------------------------------------------


@dataclass(eq=False)
class ClusterSimNode(SimNode):
    """A node as this simulator sees it: besides its disk and core, its place in the Raft group and its faults."""

    voter: bool = True
    base_used_bytes: int = 0
    joined_ms: int = START_MS
    paused_until: int = 0
    isolated_until: int = 0  # cut off from the metadata majority: proposals lost, view frozen; peers reachable
    down_since: int | None = None
    view: SiteState = field(default_factory=SiteState)
    view_due: bool = False


@dataclass(eq=False, slots=True)
class PendingAck:
    """An answer a leader owes: to producer ``producer``'s request ``correlation`` on its connection ``conn``."""

    producer: int
    conn: int
    correlation: int
    batch: Batch


@dataclass(eq=False)
class LeaderData:
    """What a leader keeps beside its ``PartitionLead`` for one open segment: the producers' table, the answers
    it owes."""

    segment_id: SegmentId
    producers: ProducerStateTable
    pending: list[PendingAck] = field(default_factory=list)


@dataclass(eq=False, slots=True)
class Link:
    down_until: int = 0
    gen: int = 0  # bumped by every cut: what was in flight before it is lost
    last_due: int = 0  # FIFO


@dataclass(eq=False)
class SimProducer:
    """An idempotent producer of one partition at ``acks=all``: the client's own delivery core
    (``georep/client/delivery.py``: sequences, at most ``max_in_flight`` batches, rounds of resends), over one
    FIFO connection to the leader it last read from the metadata."""

    index: int
    key: PartKey
    delivery: PartitionDelivery
    next_payload: int
    leader: NodeId | None = None  # the leader as the producer last read it from the metadata (a client's cache)
    conn: int = 0  # its connection: a new one after a timeout; answers on an older one are dropped
    conn_due: int = 0  # requests on the connection arrive in order
    next_correlation: int = 0
    in_flight: dict[int, ClientBatch] = field(default_factory=dict)  # correlation id -> batch
    payloads: dict[int, int] = field(default_factory=dict)  # id(batch) -> its payload (the batch's name)


@dataclass(eq=False, slots=True)
class Proposal:
    pid: int
    cmd: Command
    node: NodeId
    incarnation: int
    then: Callable[[Result | None], None] | None
    sent_ms: int
    resolved: bool = False


def _vector(end: int) -> VectorOffset:
    return VectorOffset({ORIGIN: end})


def _entry(b: Batch) -> ProducerEntry:
    """A batch as a leader's producer table keeps it (its origin seq is its offset in this model)."""
    return ProducerEntry(
        ORIGIN, b.producer, 0, b.sequence, b.records - 1, LocalOffset(b.offset), OriginSeq(b.offset), b.append_ms
    )


class ClusterNodes(SimNodes):
    """The site's nodes (``georep/sim/cluster_node.py``), and what a partition means here: producers' batches
    appended by their leader, acks owed to them, readers, repair copies."""

    origin = ORIGIN

    def __init__(self, sim: ClusterSimulator) -> None:
        cfg = sim.cfg
        config = NodeConfig(
            cfg.rf,
            cfg.aq,
            cfg.session_timeout_ms,
            cfg.tick_ms,
            cfg.retry_ms,
            cfg.roll_wait_ms,
            cfg.reconnect_ms,
            cfg.repair_every_ms,
            cfg.repair_delay_ms,
            cfg.max_concurrent_copies,
        )
        super().__init__(
            sim,
            config,
            cfg.fence_timeout_ms,
            cfg.copy_timeout_ms,
            sim.between,
            lambda shells: ClusterControllers(shells, sim),
        )
        self.sim = sim
        self.leaders: dict[tuple[NodeId, PartKey], LeaderData] = {}

    def kill(self, node: SimNode) -> int:
        for k in [k for k in self.leaders if k[0] == node.id]:
            del self.leaders[k]
        return super().kill(node)

    # -- the hooks ----------------------------------------------------------------------------------------

    def held_entries(self, node: SimNode, key: PartKey, before: SegmentId) -> list[ProducerBatch]:
        return [
            _entry(b)
            for seg in sorted(node.copies)
            if seg[:2] == key and seg[2] < before
            for b in node.copies[seg].batches
        ]

    def seal_command(self, node: SimNode, eff: ProposeSeal) -> SealSegment | None:
        seg = (eff.key[0], eff.key[1], eff.segment.segment_id)
        copy = node.copies.get(seg)
        base = int(eff.segment.base_offset)
        if eff.end > base and (copy is None or copy.end < eff.end):
            self.checker.fail(
                "CORE",
                f"node {node.id} proposes to seal {seg} at {eff.end} but holds it only up to "
                f"{copy.end if copy else base}",
            )
            return None
        batches: list[ProducerBatch] = [_entry(b) for b in copy.read(base, eff.end)] if copy is not None else []
        return SealSegment(
            eff.key[0],
            eff.key[1],
            eff.epoch,
            eff.segment.segment_id,
            LocalOffset(eff.end),
            _vector(eff.end),
            producers=self.seal_producers(node, eff, batches),
        )

    def adopted(self, node: SimNode, eff: Adopted) -> None:
        seg = (eff.key[0], eff.key[1], eff.segment_id)
        copy = node.copies.get(seg)
        own: list[ProducerBatch] = [_entry(b) for b in copy.batches] if copy is not None else []
        table = self.producer_table(node, eff.key, eff.segment_id, own)
        self.leaders[(node.id, eff.key)] = LeaderData(eff.segment_id, table)

    def released(self, node: SimNode, eff: Release) -> None:
        data = self.leaders.get((node.id, eff.key))
        if data is None or data.segment_id != eff.segment_id:
            return
        ready = [p for p in data.pending if p.batch.end <= eff.end]
        data.pending = [p for p in data.pending if p.batch.end > eff.end]
        for p in ready:
            self._release(node, eff.key, eff.segment_id, p)

    def _release(self, node: SimNode, key: PartKey, segment_id: SegmentId, p: PendingAck) -> None:
        lead = self.lead(node, key)
        assert lead is not None
        ack = AckedBatch(key, segment_id, p.batch, self.sim.now_ms, node.id, lead.epoch)
        self.sim.trace(f"ack {key} {segment_id} {p.batch}")
        q = lead.quorum
        if q is not None and q.segment_id == segment_id and len(q.ensemble) < self.sim.cfg.rf:
            self.counts.acked_short += 1
        self.checker.released(ack, self.sim.meta, self.sim.now_ms)
        self.sim.producers.reply(p.producer, p.conn, p.correlation, None)

    def _refuse(self, node: SimNode, key: PartKey, why: str, past: int = -1) -> None:
        """What the leader owes past ``past`` fails with ``NotLeader``: the producer sends it again."""
        data = self.leaders.get((node.id, key))
        if data is None:
            return
        refused = [p for p in data.pending if p.batch.end > past]
        data.pending = [p for p in data.pending if p.batch.end <= past]
        for p in refused:
            self.sim.producers.reply(p.producer, p.conn, p.correlation, NotLeader(*key, why))

    def segment_sealed(self, node: SimNode, eff: SegmentSealed) -> None:
        if not eff.roll:
            return
        self._refuse(node, eff.key, f"segment {eff.segment_id} was sealed before it was confirmed")
        self.leaders.pop((node.id, eff.key), None)
        self.sim.faults.roll_sealed(node)

    def stepped_down(self, node: SimNode, eff: StepDown) -> None:
        self._refuse(node, eff.key, f"node {node.id} no longer leads epoch {eff.epoch}")
        self.leaders.pop((node.id, eff.key), None)

    def placing(self, node: SimNode, eff: ProposeOpen) -> None:
        cmd, sim = eff.command, self.sim
        assert isinstance(node, ClusterSimNode)
        loads = sim.loads(node)
        what = f"placement of {eff.key[0]}/{eff.key[1]} at offset {cmd.base_offset}"
        self.checker.placed(what, cmd.ensemble, sim.last_hb_sent, sim.now_ms)
        eligible = sum(1 for n in loads if n.alive and not n.draining)
        self.checker.placed_size(what, cmd.ensemble, eligible, cmd.ack_quorum)
        sim.faults.check_expansion_placement(loads, cmd.ensemble, eff.key)

    def appending(self, member: SimNode, key: PartKey, epoch: LeaderEpoch) -> None:
        info = self.sim.meta.partition(*key)
        if info is not None and epoch < info.leader_epoch:
            self.counts.zombie_appends += 1

    def new_copy(self, node: SimNode, seg: SegKey, base: int, how: str) -> SegCopy:
        if how != "repair":
            self.sim.faults.check_expansion(node, seg, how)
        return super().new_copy(node, seg, base, how)

    # -- producers' requests ------------------------------------------------------------------------------

    def produce(self, node: SimNode, key: PartKey, producer: int, conn: int, correlation: int, batch: Batch) -> None:
        """A produce request; ``batch`` as the producer sent it (its offset is the leader's to give)."""
        lead = self.lead(node, key)
        q = lead.quorum if lead is not None else None
        data = self.leaders.get((node.id, key))
        if lead is None or q is None or data is None or not lead.active:
            self.sim.producers.reply(
                producer, conn, correlation, NotLeader(*key, f"node {node.id} has no open segment of it")
            )
            return
        last = batch.sequence + batch.records - 1
        decision = data.producers.check(batch.producer, 0, batch.sequence, last, self.sim.now_ms)
        pending = PendingAck(producer, conn, correlation, batch)
        if isinstance(decision, Duplicate):
            self._duplicate(node, lead, data, pending, decision)
            return
        if not isinstance(decision, Append):
            self.counts.out_of_order += 1
            self.sim.log(f"node {node.id} {key}: {decision.message()}")
            if isinstance(decision, OutOfOrderSequence):
                self._check_out_of_order(node, q.segment_id, key, decision)
            self.sim.producers.reply(producer, conn, correlation, SequenceRejected(decision))
            return
        stored = batch._replace(offset=q.appended_end, append_ms=self.sim.now_ms)
        held = self.sim.sealed_payloads[key].get(batch.payload)
        info = self.sim.meta.partition(*key)
        still_open = info is not None and info.open_segment is not None and info.open_segment.segment_id == q.segment_id
        if held is not None and still_open:  # a zombie's append past a committed seal is cut: not a second copy
            self.checker.fail(
                "C1",
                f"exactly once: node {node.id} stores producer {producer}'s batch {batch.payload} "
                f"(sequence {batch.sequence}) again at offset {stored.offset}, though the chain "
                f"holds it at {held}: its producer table did not know the resend",
            )
            return
        if not self.append_as_leader(node, lead, stored):
            self.sim.producers.reply(producer, conn, correlation, NotLeader(*key, f"node {node.id} was fenced"))
            return
        data.producers.record(
            batch.producer,
            0,
            batch.sequence,
            last,
            AppendResult(
                LocalOffset(stored.offset), OriginSeq(stored.offset), OriginSeq(stored.end - 1), stored.append_ms
            ),
            self.sim.now_ms,
        )
        data.pending.append(PendingAck(producer, conn, correlation, stored))
        if q.appended_end - q.base_offset >= self.sim.cfg.roll_records and lead.active:
            self.counts.rolls_by_size += 1
            self.step(node, key, lambda ld, ctx: ld.start_roll(ctx.now_ms))

    def _check_out_of_order(self, node: SimNode, open_id: SegmentId, key: PartKey, refused: OutOfOrderSequence) -> None:
        """An ``OutOfOrderSequence`` is spurious if the partition holds the producer's batches up to another sequence
        than the leader's table expects: the table missed the producer's last sequences (what a new leader without
        the seal's snapshot did). The partition as this leader knows it: its view's sealed segments up to their
        ends (the writers' streams), then its own copy of the segment it writes."""
        assert isinstance(node, ClusterSimNode)
        info = node.view.partition(*key)
        batches: list[Batch] = []
        for s in info.segments if info is not None else ():
            if s.sealed and s.end_offset is not None and s.segment_id < open_id:
                seg = (key[0], key[1], s.segment_id)
                batches += [b for b in self.checker.streams.get(seg, []) if b.end <= s.end_offset]
        copy = node.copies.get((key[0], key[1], open_id))
        batches += copy.batches if copy is not None else []
        held = [b.sequence + b.records for b in batches if b.producer == refused.producer_id]
        if held and not refused.new_epoch and held[-1] != refused.expected:
            raise InvariantViolation(
                f"spurious OutOfOrderSequence: node {node.id} refused producer "
                f"{refused.producer_id}'s sequence {refused.got} of {key[0]}/{key[1]} expecting "
                f"{refused.expected}, but the partition holds its batches up to sequence "
                f"{held[-1]}: the leader's producer table did not know its last sequences"
            )

    def _duplicate(
        self, node: SimNode, lead: PartitionLead, data: LeaderData, p: PendingAck, decision: Duplicate
    ) -> None:
        """A resend of a batch the partition holds: the original answer, once the original is confirmed."""
        self.counts.dedup_hits += 1
        q = lead.quorum
        assert q is not None
        offset = int(decision.result.base_offset)
        seg, held = self.sim.batch_at(lead.key, q.segment_id, q.base_offset, offset)
        if held is None or held.payload != p.batch.payload:
            self.checker.fail(
                "C1",
                f"exactly once: the leader's producer table answered producer {p.producer}'s "
                f"resent batch {p.batch.payload} with offset {offset}, where the chain holds "
                f"{held}",
            )
            return
        p = PendingAck(p.producer, p.conn, p.correlation, held)
        if seg != q.segment_id:
            self._release(node, lead.key, seg, p)
            return
        data.pending.append(p)
        if held.end <= lead.release_limit():
            self.released(node, Release(lead.key, q.segment_id, lead.release_limit()))

    def lac_query(self, node: SimNode, key: PartKey, segment_id: SegmentId) -> None:
        lead = self.lead(node, key)
        q = lead.quorum if lead is not None else None
        if lead is not None and q is not None and q.segment_id == segment_id:
            self.sim.at(
                self.sim.between(self.sim.cfg.latency_ms),
                None,
                self.sim.producers.lac_known,
                key,
                segment_id,
                lead.release_limit(),
            )

    def read(self, node: SimNode, key: PartKey, segment_id: SegmentId, bound: int, where: float) -> None:
        seg = (key[0], key[1], segment_id)
        copy = node.copies.get(seg)
        if copy is None:
            return
        batches = copy.read(copy.base, min(bound, copy.end))
        if not batches:
            return
        self.counts.reads += 1
        first = int(where * len(batches))
        for b in batches[first : first + READ_BATCHES_MAX]:
            self.checker.read(key, seg, node.id, b, bound, self.sim.meta, self.sim.now_ms)


class ClusterControllers(SimControllers):
    """The controller's shell here: it repairs (copies and fills planned over the segments' sizes) under checks."""

    def __init__(self, shells: SimNodes, sim: ClusterSimulator) -> None:
        super().__init__(shells)
        self.sim = sim
        self.checker = sim.checker
        self.counts = sim.counts

    def repair_sizes(self) -> Callable[[SegmentInfo], int]:
        return self._size_of

    def _size_of(self, segment: SegmentInfo) -> int:
        if segment.end_offset is None:
            return 0
        return (int(segment.end_offset) - int(segment.base_offset)) * self.sim.cfg.record_bytes

    def repair_copy(self, node: SimNode, eff: RepairCopy) -> None:
        c = eff.effect
        seg = (c.topic, c.partition, c.segment_id)
        fill = isinstance(c, FillSegment)
        assert isinstance(node, ClusterSimNode)
        self.checker.repair_planned(
            seg, c.source, c.target, node.view, fill=fill, adds=isinstance(c, CopySegment) and c.replaces is None
        )
        self.checker.placed(
            f"{'fill' if fill else 'repair'} of {seg} (source, target)",
            (c.source, c.target),
            self.sim.last_hb_sent,
            self.sim.now_ms,
        )
        if fill:
            self.counts.fills += 1
        else:
            self.counts.repair_copies += 1
        self.sim.log(f"controller {node.id}: {c.message()}")
        if eff.end is None:
            self.checker.fail("C6", f"repair: {seg} was handed out with no sealed end")
            return
        self.fabric.send(
            node,
            c.source,
            self.shells.members.repair_source,
            seg,
            eff.base_offset,
            eff.end,
            c.target,
            node.id,
            eff.copy_id,
        )
        self.sim.at(self.sim.cfg.copy_timeout_ms * 4, node, self._repair_timeout, node, eff.copy_id)

    def _repair_timeout(self, node: SimNode, copy_id: int) -> None:
        ctl = node.core.controller if node.core is not None else None
        if ctl is not None:
            self.repair_gave_up(ctl.repair_failed(copy_id))

    def repair_gave_up(self, effect: object) -> None:
        if isinstance(effect, FillSegment):
            self.counts.fills_failed += 1
        elif effect is not None:
            self.counts.repair_copies_failed += 1


class ClusterProducers:
    """One idempotent producer per partition at ``acks=all``, and the readers. A producer's answers are judged as
    the client judges them: the node's error through the gRPC mapping and back into a client exception."""

    def __init__(self, sim: ClusterSimulator) -> None:
        self.sim = sim
        cfg = sim.cfg
        self.producers = [
            SimProducer(
                i, key, PartitionDelivery(key[0], key[1], i + 1, cfg.max_in_flight), (i + 1) * PAYLOADS_PER_PRODUCER
            )
            for i, key in enumerate(sim.keys)
        ]
        self._ids = len(self.producers) + 1

    def start(self) -> None:
        for p in self.producers:
            self.sim.at(self.sim.rng.randint(50, 300), None, self.produce, p.index)
        self.sim.at(self.sim.between(self.sim.cfg.read_ms), None, self.read)

    def produce(self, index: int) -> None:
        sim = self.sim
        if sim.phase != "safety":
            return
        p = self.producers[index]
        delivery = p.delivery
        if p.next_payload == (index + 1) * PAYLOADS_PER_PRODUCER and not sim.serving(p.key):
            # The application starts once the partition is served. A new producer's first batch refused by a leader
            # still opening while its second is taken once open would be stored with a gap: the producer table takes
            # an unknown producer's batch whatever its sequence (dedup/producer.py, rule 2, as Kafka does).
            sim.at(sim.between(sim.cfg.produce_ms), None, self.produce, index)
            return
        if len(delivery.queue) + len(delivery.in_flight) < sim.cfg.max_in_flight:
            batch = ClientBatch(p.key[0], p.key[1], sim.now_ms, MAX_BATCH_BYTES_LIMIT)
            batch.records = [RecordInput(None, b"", (), 0)] * sim.between(sim.cfg.records_per_batch)
            p.payloads[id(batch)] = p.next_payload
            p.next_payload += 1
            delivery.enqueue(batch)
            sim.counts.produced += 1
            self.send(p)
        sim.at(sim.between(sim.cfg.produce_ms), None, self.produce, index)

    def send(self, p: SimProducer) -> None:
        """What the producer's delivery lets go now, in order, over its connection to the leader."""
        sim = self.sim
        delivery = p.delivery
        if delivery.not_before_ms > sim.now_ms:
            return
        if p.leader is None:
            info = sim.meta.partition(*p.key)  # the client's metadata fetch
            p.leader = info.leader if info is not None else None
            if p.leader is None:  # no leader yet: ask again in a moment, sending nothing meanwhile
                if not delivery.idle:
                    sim.at(sim.between(sim.cfg.backoff_ms), None, self.send, p)
                return
        target = sim.nodes[p.leader]
        for batch in delivery.take_sendable():
            assert batch.base_sequence is not None
            p.next_correlation += 1
            correlation = p.next_correlation
            p.in_flight[correlation] = batch
            wire = Batch(-1, len(batch.records), p.payloads[id(batch)], batch.producer_id, batch.base_sequence)
            due = max(sim.now_ms + sim.between(sim.cfg.latency_ms), p.conn_due)
            p.conn_due = due
            sim.at(due - sim.now_ms, target, sim.shells.produce, target, p.key, p.index, p.conn, correlation, wire)
            sim.at(sim.cfg.request_timeout_ms, None, self.timeout, p.index, p.conn, correlation)

    def timeout(self, index: int, conn: int, correlation: int) -> None:
        """No answer in time: the client drops the connection; every unanswered batch is sent again."""
        p = self.producers[index]
        if p.conn == conn and correlation in p.in_flight:
            self.sim.counts.retries += 1
            p.conn += 1
            p.in_flight.clear()
            p.leader = None
            p.delivery.on_stream_broken()
            self._resolve(p)
            self.send(p)

    def reply(self, index: int, conn: int, correlation: int, error: Exception | None) -> None:
        """A node answers a produce request, after the network's latency."""
        self.sim.at(self.sim.between(self.sim.cfg.latency_ms), None, self._answer, index, conn, correlation, error)

    def _answer(self, index: int, conn: int, correlation: int, error: Exception | None) -> None:
        sim = self.sim
        p = self.producers[index]
        if p.conn != conn:
            return  # the connection it came on was dropped: the batch was already sent again
        batch = p.in_flight.pop(correlation, None)
        if batch is None:
            return
        delivery = p.delivery
        if error is None:
            delivery.on_success(batch)
        else:
            sim.counts.retries += 1
            client_error = from_status(
                Operation.PRODUCE, status_of(error) or grpc.StatusCode.INTERNAL, str(error), reason_of(error)
            )
            if isinstance(error, NotLeader):
                p.leader = None  # ask the metadata again
            if delivery.on_error(batch, client_error, sim.now_ms, sim.between(sim.cfg.backoff_ms)):
                self._failed(p, batch, client_error)
            if delivery.not_before_ms > sim.now_ms:
                sim.at(int(delivery.not_before_ms - sim.now_ms), None, self.send, p)
        self._resolve(p)
        self.send(p)

    def _resolve(self, p: SimProducer) -> None:
        if p.delivery.round_complete():
            for failed in p.delivery.resolve(self._ids):
                self._failed(p, failed, failed.error)
            if p.delivery.producer_id == self._ids:
                self._ids += 1

    def _failed(self, p: SimProducer, batch: ClientBatch, error: Exception | None) -> None:
        """An acks=all send to a site that keeps its promises never fails to the application: a leader change is
        retried, and the new leader knows every producer's last sequences (``cluster/producer_snapshot.py``)."""
        raise InvariantViolation(
            f"producer {p.index} of {p.key[0]}/{p.key[1]}: batch {p.payloads[id(batch)]} "
            f"(producer id {batch.producer_id}, sequence {batch.base_sequence}) failed to the "
            f"application: {type(error).__name__}: {error}"
        )

    # -- readers ---------------------------------------------------------------------------------------------

    def read(self) -> None:
        sim = self.sim
        if sim.phase == "safety":
            sim.at(sim.between(sim.cfg.read_ms), None, self.read)
        key = sim.keys[sim.rng.randrange(len(sim.keys))]
        info = sim.meta.partition(*key)
        if info is None or not info.segments:
            return
        s = info.segments[-1] if sim.rng.random() < 0.6 else sim.rng.choice(info.segments)
        if s.sealed:
            assert s.end_offset is not None
            member = s.ensemble[sim.rng.randrange(len(s.ensemble))]
            sim.to_node(member, sim.shells.read, key, s.segment_id, int(s.end_offset), sim.rng.random())
        elif info.leader is not None:
            sim.to_node(info.leader, sim.shells.lac_query, key, s.segment_id)

    def lac_known(self, key: PartKey, segment_id: SegmentId, lac: int) -> None:
        sim = self.sim
        info = sim.meta.partition(*key)
        s = info.segment(segment_id) if info is not None else None
        if s is not None:
            member = s.ensemble[sim.rng.randrange(len(s.ensemble))]
            sim.to_node(member, sim.shells.read, key, segment_id, lac, sim.rng.random())


class ClusterFaults:
    """The faults of a run, drawn from the seed, and the node lifecycle they drive (kills, restarts, joins)."""

    def __init__(self, sim: ClusterSimulator) -> None:
        self.sim = sim
        self.added: NodeId | None = None
        self.expansion_placed = False

    def start(self) -> None:
        sim, cfg = self.sim, self.sim.cfg
        sim.at(sim.interval(cfg.kill_every_ms), None, self.kill_some)
        sim.at(sim.interval(cfg.pause_every_ms), None, self.pause_some)
        sim.at(sim.interval(cfg.cut_every_ms), None, self.cut_some)
        sim.at(sim.interval(cfg.partition_every_ms), None, self.partition_some)
        sim.at(sim.interval(cfg.isolate_every_ms), None, self.isolate_some)
        if cfg.meta_outage_every_ms:
            sim.at(sim.interval(cfg.meta_outage_every_ms), None, self.meta_outage)
        if cfg.add_node:
            sim.at(sim.rng.randint(cfg.safety_ms // 5, cfg.safety_ms // 2), None, self.add_node)
        for at_ms, topic, aq in cfg.quorum_alters:
            sim.at(at_ms, None, self.alter_quorum, topic, aq)

    def alter_quorum(self, topic: str, aq: int | None) -> None:
        """An operator alters the topic's min_insync_replicas (None: back to the site's), as ``georep topic alter``
        commits it: its leaders roll their open segments, and each segment keeps the quorum it opened with."""
        sim = self.sim
        entry = alter(sim.meta.entries().get(topic), topic, {"min_insync_replicas": aq}, sim.now_ms, ORIGIN.site)
        sim._commit(MergeTopicEntry(entry))

    def down_count(self) -> int:
        sim = self.sim
        return sum(1 for n in sim.nodes.values() if not sim.running(n) or n.isolated_until > sim.now_ms)

    def _pick_up_node(self) -> ClusterSimNode | None:
        sim = self.sim
        if self.down_count() >= sim.cfg.max_down:
            return None
        candidates = [
            sim.nodes[n]
            for n in sorted(sim.nodes)
            if sim.running(sim.nodes[n]) and sim.nodes[n].isolated_until <= sim.now_ms
        ]
        return sim.rng.choice(candidates) if candidates else None

    def kill_some(self) -> None:
        sim = self.sim
        if sim.phase != "safety":
            return
        sim.at(sim.interval(sim.cfg.kill_every_ms), None, self.kill_some)
        node = self._pick_up_node()
        if node is not None:
            self.kill(node)

    def roll_sealed(self, node: SimNode) -> None:
        """A roll's seal committed and its leader has not opened the next segment yet: maybe kill it now, so that
        the controller may name a node that holds none of the sealed segment."""
        sim = self.sim
        if sim.phase == "safety" and self.down_count() < sim.cfg.max_down and sim.rng.random() < sim.cfg.roll_kill_p:
            sim.counts.roll_kills += 1
            assert isinstance(node, ClusterSimNode)
            self.kill(node)

    def kill(self, node: ClusterSimNode) -> None:
        sim = self.sim
        sim.counts.kills += 1
        sim.log(f"kill node {node.id}")
        node.down_since = sim.now_ms
        sim.counts.lost_batches += sim.shells.kill(node)
        node.view = SiteState()
        node.view_due = False
        self.break_links(node.id, None)
        sim.at(sim.between(sim.cfg.down_ms), None, self.restart, node.id)

    def break_links(self, a: NodeId, b: NodeId | None) -> None:
        """Bump the links between ``a`` and ``b`` (every other node if None); the other ends notice."""
        sim = self.sim
        for other in sorted(sim.nodes):
            if other == a or (b is not None and other != b):
                continue
            sim.links[(a, other)].gen += 1
            sim.links[(other, a)].gen += 1
            for x, y in ((a, other), (other, a)):
                nx = sim.nodes[x]
                if nx.up:
                    sim.at(sim.cfg.detect_ms, nx, sim.shells.stream_broken, nx, y)

    def restart(self, nid: NodeId) -> None:
        sim = self.sim
        node = sim.nodes[nid]
        if node.up:
            return
        sim.counts.restarts += 1
        sim.log(f"restart node {nid}")
        node.up = True
        node.down_since = None
        node.view = sim.meta.copy()
        sim.shells.boot(node)
        if sim.meta.node(nid) is None:  # an added node killed before its registration committed
            self.register(node)
        sim.at(sim.rng.randint(1, sim.cfg.tick_ms), node, sim.tick, node)

    def pause_some(self) -> None:
        sim = self.sim
        if sim.phase != "safety":
            return
        sim.at(sim.interval(sim.cfg.pause_every_ms), None, self.pause_some)
        node = self._pick_up_node()
        if node is not None:
            sim.counts.pauses += 1
            node.paused_until = sim.now_ms + sim.between(sim.cfg.pause_ms)
            sim.log(f"pause node {node.id} until t+{node.paused_until - START_MS}")

    def isolate_some(self) -> None:
        sim = self.sim
        if sim.phase != "safety":
            return
        sim.at(sim.interval(sim.cfg.isolate_every_ms), None, self.isolate_some)
        node = self._pick_up_node()
        if node is not None:
            sim.counts.isolations += 1
            node.isolated_until = sim.now_ms + sim.between(sim.cfg.isolate_ms)
            sim.log(f"isolate node {node.id} from the metadata until t+{node.isolated_until - START_MS}")

    def _pair(self) -> tuple[NodeId, NodeId] | None:
        ids = sorted(self.sim.nodes)
        if len(ids) < 2:
            return None
        a, b = self.sim.rng.sample(ids, 2)
        return NodeId(a), NodeId(b)

    def cut_some(self) -> None:
        sim = self.sim
        if sim.phase != "safety":
            return
        sim.at(sim.interval(sim.cfg.cut_every_ms), None, self.cut_some)
        pair = self._pair()
        if pair is not None:
            sim.counts.stream_cuts += 1
            self.break_links(pair[0], pair[1])

    def partition_some(self) -> None:
        sim = self.sim
        if sim.phase != "safety":
            return
        sim.at(sim.interval(sim.cfg.partition_every_ms), None, self.partition_some)
        pair = self._pair()
        if pair is not None:
            sim.counts.partitions += 1
            until = sim.now_ms + sim.between(sim.cfg.partition_ms)
            sim.links[pair].down_until = until
            sim.links[(pair[1], pair[0])].down_until = until
            self.break_links(pair[0], pair[1])

    def meta_outage(self) -> None:
        sim = self.sim
        if sim.phase != "safety":
            return
        sim.at(sim.interval(sim.cfg.meta_outage_every_ms), None, self.meta_outage)
        sim.counts.meta_outages += 1
        sim.meta_outage_until = max(sim.meta_outage_until, sim.now_ms + sim.between(sim.cfg.meta_outage_ms))

    def add_node(self) -> None:
        sim = self.sim
        nid = NodeId(max(sim.nodes) + 1)
        node = sim.new_node(nid, voter=False, used=0)
        self.added = nid
        sim.counts.nodes_added += 1
        sim.log(f"node {nid} joins")
        node.view = sim.meta.copy()
        sim.shells.boot(node)
        self.register(node)
        sim.at(sim.rng.randint(20, sim.cfg.tick_ms), node, sim.tick, node)

    def register(self, node: ClusterSimNode) -> None:
        def done(result: Result | None) -> None:
            if result is None:  # lost in a metadata outage: register again
                self.sim.at(self.sim.cfg.retry_ms, node, self.register, node)

        self.sim.propose(node, RegisterNode(node.id, f"10.0.0.{node.id}:9092"), done)

    # -- expansion -----------------------------------------------------------------------------------------

    def check_expansion(self, node: SimNode, seg: SegKey, how: str) -> None:
        if node.id != self.added:
            return
        sim = self.sim
        assert isinstance(node, ClusterSimNode)
        opened = sim.checker.opened_ms.get(seg, sim.now_ms)
        if opened < node.joined_ms:
            sim.checker.fail(
                "C6",
                f"expansion: node {node.id} (joined at t+{node.joined_ms - START_MS}ms) got "
                f"{seg[0]}/{seg[1]} segment {seg[2]}, opened before it joined, by {how}: only "
                "repair may move old data to a new node",
            )

    def check_expansion_placement(self, loads: list[NodeLoad], ensemble: tuple[NodeId, ...], key: PartKey) -> None:
        added = self.added
        if added is None or self.expansion_placed:
            return
        eligible = any(n.node == added and n.alive and not n.draining for n in loads)
        if not eligible:
            return
        if added in ensemble:
            self.expansion_placed = True
            return
        self.sim.checker.fail(
            "C6",
            f"expansion: the first segment placed after node {added} became eligible "
            f"({key[0]}/{key[1]}, ensemble {list(ensemble)}) does not include it: a new node "
            "must take new segments at the next roll",
        )


class ClusterSimulator:
    """See the module docstring: the world around the nodes (time, network, Raft log), and the run."""

    def __init__(
        self,
        seed: int,
        shape: str = "single3",
        *,
        config: ClusterConfig | None = None,
        checks: frozenset[str] = ALL_CHECKS,
        verbose: bool = False,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.seed = seed
        self.shape = shape
        self.rng = random.Random(seed)
        self.cfg = config or shape_config(shape, self.rng)
        self.verbose = verbose
        self._print = log or (lambda line: print(line, file=sys.stderr))
        self.now_ms = START_MS
        self.counts = ClusterCounts()
        self.keys = self.cfg.partition_keys()
        self.nodes: dict[NodeId, ClusterSimNode] = {}
        self.links: dict[tuple[NodeId, NodeId], Link] = {}
        self.meta = SiteState()
        self.log_entries: list[Command] = []
        self.last_hb_sent: dict[NodeId, int | None] = {}
        # Checker bookkeeping, never read by a decision: which payloads the sealed segments hold (exactly once).
        self.sealed_payloads: dict[PartKey, dict[int, int]] = {k: {} for k in self.keys}
        self.meta_outage_until = 0
        self.phase = "safety"
        self._heap: list[tuple[int, int, int, int, Action, tuple[object, ...]]] = []
        self._seq = 0
        self._pid = 0
        self._events = 0
        self._trace = hashlib.sha256()
        self._liveness_start = START_MS
        self.checker = ClusterChecker(
            rf=self.cfg.rf,
            aq=self.cfg.aq,
            single_loss=self.cfg.single_loss,
            session_timeout_ms=self.cfg.session_timeout_ms,
            copies_of=self._copies_of,
            counts=self.counts,
            enabled=checks,
        )
        self.shells = ClusterNodes(self)
        for i in range(1, self.cfg.nodes + 1):
            self.new_node(NodeId(i), voter=True, used=self.rng.randint(60, 120) * GIB)
        self.producers = ClusterProducers(self)
        self.faults = ClusterFaults(self)
        for n in sorted(self.nodes):
            self._commit(RegisterNode(NodeId(n), f"10.0.0.{n}:9092"))
            self._commit(NodeHeartbeat(NodeId(n), self.now_ms, self._free_bytes(self.nodes[n]), 0))
            self.last_hb_sent[NodeId(n)] = self.now_ms
        for name, partitions in self.cfg.topics:
            self._commit(CreateTopic(TopicSpec(name, partitions)))

    @property
    def added(self) -> NodeId | None:
        return self.faults.added

    @property
    def expansion_placed(self) -> bool:
        return self.faults.expansion_placed

    # -- the fabric: what the nodes' shells use ------------------------------------------------------------

    def at(self, delay_ms: int, node: SimNode | None, fn: Action, *args: object) -> None:
        """Run ``fn(*args)`` after ``delay_ms``; on ``node``, only if this incarnation is still up then."""
        self._seq += 1
        nid, inc = (node.id, node.incarnation) if node is not None else (0, 0)
        heapq.heappush(self._heap, (self.now_ms + max(0, delay_ms), self._seq, nid, inc, fn, args))

    def send(self, src: SimNode, dst: NodeId, fn: Action, *args: object) -> None:
        """A message from ``src`` to ``dst`` over their FIFO link (to itself: at once)."""
        target = self.nodes[dst]
        if dst == src.id:
            self.at(0, target, fn, target, *args)
            return
        link = self.links[(src.id, dst)]
        if link.down_until > self.now_ms or not target.up:  # no connection: the sender notices, as TCP would
            self.counts.dropped_messages += 1
            self.at(self.cfg.detect_ms, src, self.shells.stream_broken, src, dst)
            return
        due = max(self.now_ms + self.between(self.cfg.latency_ms), link.last_due)
        link.last_due = due
        self.at(due - self.now_ms, target, self._deliver, link, link.gen, fn, (target, *args))

    def _deliver(self, link: Link, gen: int, fn: Action, args: tuple[object, ...]) -> None:
        if link.gen != gen or link.down_until > self.now_ms:
            self.counts.dropped_messages += 1
            return
        fn(*args)

    def view(self, node: SimNode) -> SiteState:
        assert isinstance(node, ClusterSimNode)
        return node.view

    def reachable(self, src: SimNode, dst: NodeId) -> bool:
        target = self.nodes[dst]
        return (
            target.up
            and self.links[(src.id, dst)].down_until <= self.now_ms
            and self.links[(dst, src.id)].down_until <= self.now_ms
        )

    def can_lead_metadata(self, node: SimNode) -> bool:
        """A running voter that reaches the metadata majority (``SimNodes.leads_metadata`` picks the controller)."""
        assert isinstance(node, ClusterSimNode)
        return node.voter and self.running(node) and node.isolated_until <= self.now_ms

    def log(self, line: str) -> None:
        if self.verbose:
            self._print(f"{self.now_ms - START_MS} {line}")

    def to_node(self, dst: NodeId, fn: Action, *args: object) -> None:
        """A client's request to node ``dst`` (lost if the node is down when it arrives)."""
        target = self.nodes[dst]
        self.at(self.between(self.cfg.latency_ms), target, fn, target, *args)

    def between(self, bounds: tuple[int, int]) -> int:
        return self.rng.randint(bounds[0], bounds[1])

    def interval(self, mean_ms: int) -> int:
        return self.rng.randint(mean_ms // 2, mean_ms * 3 // 2)

    def trace(self, text: str) -> None:
        self._trace.update(text.encode())

    # -- the nodes ---------------------------------------------------------------------------------------------

    def _copies_of(self, node: NodeId) -> dict[SegKey, SegCopy]:
        n = self.nodes.get(node)
        return n.copies if n is not None else {}

    def new_node(self, nid: NodeId, *, voter: bool, used: int) -> ClusterSimNode:
        node = ClusterSimNode(nid, self.cfg.fsync_ms, voter=voter, base_used_bytes=used, joined_ms=self.now_ms)
        for other in sorted(self.nodes):
            self.links[(nid, other)] = Link()
            self.links[(other, nid)] = Link()
        self.nodes[nid] = node
        self.shells.nodes[nid] = node
        self.last_hb_sent.setdefault(nid, None)
        return node

    def _free_bytes(self, node: ClusterSimNode) -> int:
        held = sum(c.end - c.base for c in node.copies.values())
        return max(0, self.cfg.capacity_bytes - node.base_used_bytes - held * self.cfg.record_bytes)

    def loads(self, node: ClusterSimNode) -> list[NodeLoad]:
        return leadership.node_loads(node.view, self.now_ms, self.cfg.session_timeout_ms)

    def running(self, node: ClusterSimNode) -> bool:
        return node.up and node.paused_until <= self.now_ms

    def tick(self, node: ClusterSimNode) -> None:
        self.shells.members.report_short(node, self.shells.controllers.metadata_leader())
        load = leadership.open_loads(node.view).get(node.id, 0)
        self.last_hb_sent[node.id] = self.now_ms
        self.propose(node, NodeHeartbeat(node.id, self.now_ms, self._free_bytes(node), load))
        self._refresh_view(node)
        self.shells.tick(node)
        self.at(self.cfg.tick_ms, node, self.tick, node)

    def serving(self, key: PartKey) -> bool:
        """Whether the partition's leader (as the metadata names it) writes an open segment."""
        info = self.meta.partition(*key)
        leader = self.nodes[info.leader] if info is not None and info.leader is not None else None
        lead = self.shells.lead(leader, key) if leader is not None else None
        return lead is not None and lead.active

    def batch_at(self, key: PartKey, open_id: SegmentId, base: int, offset: int) -> tuple[SegmentId, Batch | None]:
        """The segment holding ``offset`` and its writer's batch there (the ground truth of the checker)."""
        info = self.meta.partition(*key)
        segment_id = open_id
        if offset < base and info is not None:
            segment_id = next(
                (
                    s.segment_id
                    for s in info.segments
                    if s.end_offset is not None and s.base_offset <= offset < s.end_offset
                ),
                open_id,
            )
        stream = self.checker.streams.get((key[0], key[1], segment_id), [])
        return segment_id, next((b for b in stream if b.offset == offset), None)

    # -- metadata: the Raft log -------------------------------------------------------------------------------

    def _majority(self) -> bool:
        voters = [n for n in self.nodes.values() if n.voter]
        live = [n for n in voters if self.running(n) and n.isolated_until <= self.now_ms]
        return 2 * len(live) > len(voters)

    def propose(self, node: SimNode, cmd: Command, then: Callable[[Result | None], None] | None = None) -> None:
        assert isinstance(node, ClusterSimNode)
        self._pid += 1
        prop = Proposal(self._pid, cmd, node.id, node.incarnation, then, self.now_ms)
        delay = self.between(self.cfg.raft_ms)
        if node.isolated_until > self.now_ms:  # it cannot reach the Raft majority: the proposal goes nowhere
            self.counts.proposals_lost += 1
            self.at(self.cfg.proposal_timeout_ms, node, self._proposal_timeout, prop)
            return
        if self.meta_outage_until > self.now_ms:
            if self.rng.random() < 0.5:  # the Raft leader changed before the entry was replicated: dropped
                self.at(self.cfg.proposal_timeout_ms, node, self._proposal_timeout, prop)
                return
            delay += self.meta_outage_until - self.now_ms + self.rng.randint(0, 40)  # stalled
        self.at(delay, None, self._raft_commit, prop)
        self.at(self.cfg.proposal_timeout_ms, node, self._proposal_timeout, prop)

    def _proposal_timeout(self, prop: Proposal) -> None:
        if prop.resolved:
            return
        prop.resolved = True
        if prop.then is not None:
            prop.then(None)

    def _raft_commit(self, prop: Proposal) -> None:
        if not self._majority() or self.meta_outage_until > self.now_ms:
            if self.now_ms - prop.sent_ms > PROPOSAL_GIVE_UP_MS:
                self.counts.proposals_lost += 1
                return
            if not self._majority():
                self.counts.no_majority += 1
            self.at(self.rng.randint(20, 60), None, self._raft_commit, prop)
            return
        result = self._commit(prop.cmd)
        if prop.resolved:
            self.counts.proposals_late += 1
            return
        prop.resolved = True
        node = self.nodes[prop.node]
        if prop.then is not None and node.up and node.incarnation == prop.incarnation:
            self.at(1, node, prop.then, result)

    def _commit(self, cmd: Command) -> Result:
        """Apply one command to the log's state machine, in log order, and check C2/C5 on the result."""
        topic = getattr(cmd, "topic", None)
        partition = getattr(cmd, "partition", None)
        before: PartitionInfo | None = None
        if isinstance(topic, str) and isinstance(partition, int):
            before = self.meta.partition(topic, partition)
        result = self.meta.apply(cmd)
        self.log_entries.append(cmd)
        if not isinstance(cmd, NodeHeartbeat):
            self.trace(f"{len(self.log_entries)} {cmd.to_dict()} {type(result).__name__}")
            self.log(f"commit {cmd} -> {result}")
        self.checker.committed(cmd, result, before, self.meta, self.now_ms)
        self._count(cmd, result)
        if not isinstance(cmd, NodeHeartbeat):
            for nid in sorted(self.nodes):
                node = self.nodes[nid]
                if node.up and not node.view_due:
                    node.view_due = True
                    self.at(self.between(self.cfg.view_lag_ms), node, self._refresh_view, node)
        return result

    def _count(self, cmd: Command, result: Result) -> None:
        changed = isinstance(result, Applied) and result.changed
        if isinstance(cmd, ElectLeader):
            if isinstance(result, Applied):
                self.counts.elections += 1
            else:
                self.counts.elections_refused += 1
        elif isinstance(cmd, FailOver):
            if isinstance(result, Applied):
                self.counts.elections += result.moved
                self.counts.failovers += 1
            else:
                self.counts.elections_refused += 1
        elif isinstance(cmd, OpenSegment) and changed:
            assert isinstance(result, Applied) and result.segment_id is not None
            self.counts.opens += 1
            if len(cmd.ensemble) < self.cfg.rf:
                self.counts.opens_short += 1
            self.checker.segment_opened((cmd.topic, cmd.partition, result.segment_id), self.now_ms)
        elif isinstance(cmd, SealSegment) and changed:
            self.counts.seals += 1
            table = self.sealed_payloads[(cmd.topic, cmd.partition)]
            for b in self.checker.streams.get((cmd.topic, cmd.partition, cmd.segment_id), []):
                if b.end <= cmd.end_offset:
                    table[b.payload] = b.offset
        elif isinstance(cmd, ReplaceMember | AddMember) and changed:
            if isinstance(cmd, ReplaceMember):
                self.counts.members_replaced += 1
            else:
                self.counts.members_added += 1
            self.checker.touched((cmd.topic, cmd.partition, cmd.segment_id))

    def _refresh_view(self, node: ClusterSimNode) -> None:
        node.view_due = False
        if node.isolated_until > self.now_ms:
            return  # it cannot read the log: it acts on what it last knew
        node.view = self.meta.copy()
        self.shells.members.learn(node, node.view)
        self.shells.reconcile(node)

    # -- running -------------------------------------------------------------------------------------------

    def _step(self) -> bool:
        if not self._heap:
            return False
        if self._events >= self.cfg.max_events:
            raise InvariantViolation(f"liveness: the run did not finish within {self.cfg.max_events} events")
        due, _seq, nid, inc, fn, args = heapq.heappop(self._heap)
        self.now_ms = due
        if nid:
            node = self.nodes[NodeId(nid)]
            if not node.up or node.incarnation != inc:
                return True
            if node.paused_until > due:
                self._seq += 1
                heapq.heappush(self._heap, (node.paused_until, self._seq, nid, inc, fn, args))
                return True
        self._events += 1
        fn(*args)
        self.checker.after_event(self.meta, self.now_ms)
        return True

    def _start(self) -> None:
        cfg = self.cfg
        for nid in sorted(self.nodes):
            node = self.nodes[nid]
            node.view = self.meta.copy()
            self.shells.boot(node)
            self.at(self.rng.randint(1, cfg.tick_ms), node, self.tick, node)
        self.producers.start()
        self.faults.start()

    def run(self) -> ClusterResult:
        """Safety phase, then liveness phase. Raises :class:`ClusterSimulationFailure`."""
        try:
            self._start()
            end = START_MS + self.cfg.safety_ms
            for _ in range(self.cfg.max_events):
                if not self._heap or self._heap[0][0] > end:
                    break
                self._step()
            self._run_liveness()
        except InvariantViolation as e:
            raise self._failure(f"invariant violated at t+{self.now_ms - START_MS}ms event {self._events}: {e}") from e
        except Exception as e:  # a crash of the shell or the core is a failure of the run, with its replay
            text = "".join(traceback.format_exception(e)[-6:])
            raise self._failure(
                f"unexpected error at t+{self.now_ms - START_MS}ms event {self._events}: "
                f"{type(e).__name__}: {e}\n{text}"
            ) from e
        self.trace(repr(sorted(self.counts.as_dict().items())))
        return ClusterResult(
            self.seed,
            self.shape,
            self.cfg.describe(),
            self._events,
            self.now_ms - START_MS,
            self.now_ms - self._liveness_start,
            self._trace.hexdigest(),
            self.counts,
        )

    def _failure(self, message: str) -> ClusterSimulationFailure:
        return ClusterSimulationFailure(
            f"{message}\n  {self.cfg.describe()}", self.seed, self.shape, replay_command(self.seed, self.shape)
        )

    def _run_liveness(self) -> None:
        self.phase = "liveness"
        self._liveness_start = self.now_ms
        self.log("liveness: heal every fault, restart every node, stop new batches")
        self.meta_outage_until = 0
        for link in self.links.values():
            link.down_until = 0
        for nid in sorted(self.nodes):
            self.nodes[nid].isolated_until = 0
        for nid in sorted(self.nodes):
            if not self.nodes[nid].up:
                self.faults.restart(nid)
        deadline = self.now_ms + self.cfg.liveness_ms
        next_check = self.now_ms
        problems: list[str] = ["not checked"]
        for _ in range(self.cfg.max_events):
            if self.now_ms >= next_check:
                problems = self.liveness_problems()
                if not problems:
                    return
                next_check = self.now_ms + LIVENESS_CHECK_MS
            if self.now_ms > deadline or not self._step():
                break
        problems = self.liveness_problems()
        if problems:
            shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
            raise InvariantViolation(f"liveness after healing: {shown}")

    def _fsynced_end(self, node: NodeId, seg: SegKey, base: int) -> int:
        copy = self.nodes[node].copies.get(seg)
        return copy.fsynced_end if copy is not None else base

    def liveness_problems(self) -> list[str]:
        problems: list[str] = []
        for nid in sorted(self.nodes):
            n = self.nodes[nid]
            if not n.up or n.paused_until > self.now_ms:
                problems.append(f"node {nid} is not running yet")
        for p in self.producers.producers:
            if not p.delivery.idle:
                problems.append(f"producer of {p.key[0]}/{p.key[1]} still waits for {p.delivery!r}")
        for key in self.keys:
            problems.extend(self._partition_problems(key))
        if self.added is not None:
            node = self.nodes[self.added]
            newer = [
                s
                for info in self.meta.partitions()
                for s in info.segments
                if self.added in s.ensemble
                and self.checker.opened_ms.get((info.topic, info.partition, s.segment_id), 0) >= node.joined_ms
            ]
            if not newer:
                problems.append(f"expansion: node {self.added} holds no segment opened after it joined")
        return problems

    def _partition_problems(self, key: PartKey) -> list[str]:
        where = f"{key[0]}/{key[1]}"
        info = self.meta.partition(*key)
        assert info is not None
        if info.leader is None:
            return [f"{where} has no leader"]
        lead = self.shells.lead(self.nodes[info.leader], key)
        q = lead.quorum if lead is not None else None
        if lead is None or q is None or not lead.active or info.open_segment is None:
            return [f"{where}: leader node {info.leader} (epoch {info.leader_epoch}) is not writing an open segment"]
        problems = self._segment_problems(where, info, q.segment_id, q.lac, q.appended_end)
        if problems:
            return problems
        return self._chain_problems(where, key, info, q.lac)

    def _segment_problems(
        self, where: str, info: PartitionInfo, open_id: SegmentId, lac: int, appended_end: int
    ) -> list[str]:
        problems: list[str] = []
        live = len(self.meta.live_nodes(self.now_ms, self.cfg.session_timeout_ms))
        for s in info.segments:
            seg = (info.topic, info.partition, s.segment_id)
            end = int(s.end_offset) if s.end_offset is not None else lac
            if not s.sealed and open_id != s.segment_id:
                problems.append(f"{where} segment {s.segment_id} is open but its leader writes another")
                continue
            full = [m for m in s.ensemble if self._fsynced_end(m, seg, int(s.base_offset)) >= end]
            if not full:
                problems.append(f"{where} segment {s.segment_id}: no member holds it up to {end}")
                continue
            if len(full) < len(s.ensemble):
                short = [m for m in s.ensemble if m not in full]
                problems.append(
                    f"{where} segment {s.segment_id} ({'sealed' if s.sealed else 'open'}, end {end}) is "
                    f"under-replicated: members {short} do not hold it fsynced"
                )
            if not s.sealed and lac < appended_end:
                problems.append(f"{where} segment {s.segment_id}: LAC {lac} is behind the appended end {appended_end}")
            if len(s.ensemble) < self.cfg.rf <= live:
                problems.append(
                    f"{where} segment {s.segment_id} ({'sealed' if s.sealed else 'open'}) has "
                    f"{len(s.ensemble)} members {list(s.ensemble)}, below replication_factor "
                    f"{self.cfg.rf}, while {live} nodes are live: "
                    f"{'repair did not widen it' if s.sealed else 'it was not rolled'}"
                )
        return problems

    def _chain_problems(self, where: str, key: PartKey, info: PartitionInfo, lac: int) -> list[str]:
        content: list[Batch] = []
        for s in info.segments:
            seg = (info.topic, info.partition, s.segment_id)
            end = int(s.end_offset) if s.end_offset is not None else lac
            full = [m for m in s.ensemble if self._fsynced_end(m, seg, int(s.base_offset)) >= end]
            copy = self.nodes[full[0]].copies.get(seg)
            if copy is not None:
                content.extend(copy.read(copy.base, end, fsynced_only=True))
        problems: list[str] = []
        at: dict[int, Batch] = {}
        payloads: dict[int, int] = {}
        expected = 0
        for b in content:
            if b.offset != expected:
                problems.append(f"{where}: the chain has {b} after offset {expected}")
            expected = b.end
            at[b.offset] = b
            if b.payload in payloads:
                problems.append(
                    f"{where}: batch {b.payload} is in the chain twice (offsets {payloads[b.payload]} and {b.offset})"
                )
            payloads[b.payload] = b.offset
        acked = self.checker.acked.get(key, {})
        for payload in sorted(acked):
            a = acked[payload]
            if at.get(a.batch.offset) != a.batch:
                problems.append(f"{where}: acked {a.batch} (segment {a.segment_id}) is not in the chain at its offset")
        seen = self.checker.seen.get(key, {})
        for offset in sorted(seen):
            if at.get(offset) != seen[offset][1] and offset < expected:
                problems.append(f"{where}: a reader read {seen[offset][1]}, which the chain does not hold")
        return problems


def run_cluster_seed(
    seed: int, shape: str | None = None, *, checks: frozenset[str] = ALL_CHECKS, verbose: bool = False
) -> ClusterResult:
    """One run, as ``python -m georep.sim --cluster --seed SEED --shape SHAPE`` does it (shape: by seed)."""
    return ClusterSimulator(seed, shape or swarm_shape(seed), checks=checks, verbose=verbose).run()
