"""The multi-site simulator with a multi-node site: a segment cluster inside a geo topology (issue 11).

``GeoClusterSimulator(seed, topology)`` is :class:`~georep.sim.simulator.Simulator` (the same sites, links,
producers, consumers, faults, one event heap and one ``random.Random(seed)``) where one site, drawn from the
seed, is a segment cluster of ``nodes`` nodes (RF ``rf``, ``min_insync_replicas`` ``aq``) instead of one node.
Every check of the geo simulator runs after every event (I1-I3, I5 per consumer session, I6 at every ack and
after every recovery, I4 after healing), and so do the cluster checks of ``cluster_checks.py`` that apply to
a site inside a geo topology (C1 durability of every ``acks=all`` write, C2 chain, C3 prefix, C5 one writer
per epoch; and C4's rule that no seal falls below the LAC, since the site served and acked up to it), with
``single_loss``: nodes are killed one at a time, so C1 must hold with no excuse.

**The composition.** The multi-node site is still one ``SimSite``: its broker state (``AckTable``,
producer tables, ``CommitLog``, ``PullSession`` per inbound link, ``ReplicaSource`` per outbound stream) is
what the nodes leading its partitions run, built by the same ``SimSite.boot`` and driven by the same
simulator code. Its partition logs are the chain the leaders serve, as ``ChainLog`` presents it to a node's
broker: a ``MemoryLog`` whose content is the writers' streams, segment after segment, and whose
``flushed_offset``/``flushed_vector`` are the LAC and the vector there (``ChainLog``'s rule), so the fetch
cursor and the replication source serve only what the ack quorum holds. The ack table opens every partition
``replicated_in_site`` and is fed ``quorum_advanced`` at each LAC and ``flush_done`` at each of the
leader's own fsyncs, as ``server/site_cluster.py`` and ``server/broker.py`` do.

Under it, the nodes run the pure cluster core, as ``georep/sim/cluster.py`` does:

=============================================  ===========================================================
decision                                       pure code, driven here by
=============================================  ===========================================================
metadata: nodes, topics, leaders, chains       ``SiteState.apply``, every command after a Raft latency
who leads which partition                      ``plan_leadership``: the controller (lowest live node), every tick
lead, recover first, or ask for a new epoch    ``role_step``: every live node, every tick
which segment a leader writes next, where      ``plan_open`` (placement over ``node_loads``), down to the ack quorum
where a roll seals                             ``roll_seal_at``: a leader whose open segment holds ``roll_records``
the LAC, when ``acks=all`` goes                ``SegmentQuorum`` (every member's fsync), then ``AckTable``
fencing, contiguity, sealed segments           ``ReplicaGuard``: every append, fence and copy a member gets
recovering an open segment                     ``SegmentRecovery`` (Fence, Copy, Seal effects)
what a member cuts after a seal                ``cut_after_seal``
=============================================  ===========================================================

Each node keeps its copies (``cluster_model.SegCopy``: batches and an fsynced prefix) and its persisted guard
states; a batch is named by an id (``Batch.payload``) and its bytes are the chain's at its offset (every copy
is a prefix of its segment's writer stream, which C3 checks). The leader appends to the chain, to its own copy
and streams the batch to every other member over a per-pair FIFO link; members check it with their guard,
append, fsync after their own disk's fsync time and ack their fsynced end; a member that was down is resent
from its end when it is back. A node kill (``kill_every_ms``, one node down at a time, back after ``down_ms``)
loses the unfsynced part of its copies, and its messages not yet delivered (its streams' buffers), so a
survivor may miss the last batches the others acked. A kill of a node that leads partitions is the loss of
that broker: the site's volatile state goes (its clients' connections, streams, pending acks, as in a site
crash), and it comes back once every partition has a leader again: the controller elects one from the open
segment's ensemble after the session timeout (or the restarted node asks for a new epoch), which fences the
members, takes the end E - AQ + 1 of them hold, copies it to the others, seals it in the metadata, cuts longer
copies and the chain, and opens the next segment. Then the geo checks of a crash run against the recovered
chain (no other site holds a coordinate the recovery cut, no consumer delivered one, every acknowledged write
is still held), and the site serves again.

A leader rolls its open segment once it holds ``roll_records`` records: it stops taking writes, seals at the
LAC (``roll_seal_at``; nothing past the proposed seal becomes durable, whatever acks come later), and opens
the next segment on the live nodes, which widens a segment opened short. Every committed seal, a roll's or
a recovery's, is learned from the metadata: members cut longer copies, and the chain ends there.

**What it leaves out** (the cluster simulator covers them on one site): Raft faults (lost, late, stalled
proposals, no majority), pauses and metadata isolation (zombie leaders), stream cuts and partitions between
nodes, repair and expansion. A roll or a leader change restarts every broker of the site (its clients
reconnect and retry), where a node re-attaches only that partition. The whole-site crash fault spares the
multi-node site (its nodes fail one at a time); the network between sites is as faulty as in the geo
simulator.

Replay: ``python -m georep.sim --geo-cluster --seed N --topology NAME --steps S``.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields

import cluster.leadership as leadership
import cluster.producer_snapshot as producer_snapshot
import cluster.recovery as recovery
import cluster.site_state as site_state
from cluster.producer_snapshot import ProducerSnapshot
from cluster.quorum import (
    Fenced,
    GuardState,
    LacAdvanced,
    NotContiguous,
    QuorumError,
    ReplicaGuard,
    SegmentQuorum,
    SegmentSealed,
)
from cluster.recovery import Copy, Done, Failed, Fence, SegmentRecovery, Superseded
from cluster.site_state import (
    Applied,
    Command,
    CreateTopic,
    ElectLeader,
    NodeHeartbeat,
    OpenSegment,
    RegisterNode,
    Result,
    SealSegment,
    SegmentInfo,
    SiteState,
)
from dedup.producer import ProducerStateTable
from georep.broker.acks import AckKind, Acks, Effect, StartFlush
from georep.broker.append import Produced
from georep.broker.errors import GeoAckTimeout
from georep.metadata.topics import TopicSpec
from georep.record.batch import iter_headers
from georep.replication.links import PartitionKey
from georep.sim.checker import InvariantViolation
from georep.sim.cluster_checks import AckedBatch, ClusterChecker
from georep.sim.cluster_model import Batch, ClusterCounts, SegCopy, SegKey
from georep.sim.producers import AckedWrite, SimProducer
from georep.sim.simulator import START_MS, SimConfig, SimResult, SimulationFailure, Simulator
from georep.sim.site import SimSite
from georep.storage.api import BatchEntry
from georep.storage.memory_log import MemoryLog
from offsets.coordinates import LocalOffset, Origin, OriginSeq
from offsets.log_prefix import vector_below
from offsets.vector import VectorOffset
from topology.ids import LeaderEpoch, NodeId, SegmentId, SiteId

GEO_CLUSTER_TOPOLOGIES = ("triangle", "ring4-split", "mesh4-audit")  # each has a cycle
GEO_CLUSTER_STEPS = 700
READ_ALL = 1 << 30


@dataclass(frozen=True, slots=True)
class GeoClusterConfig:
    """The multi-node site's shape and timings (virtual ms)."""

    nodes: int = 3
    rf: int = 3
    aq: int = 2
    tick_ms: int = 50  # heartbeats, the controller's plan, every node's role_step
    session_timeout_ms: int = 250
    raft_ms: tuple[int, int] = (2, 8)  # a metadata command commits this long after it is proposed
    latency_ms: tuple[int, int] = (1, 4)  # between two nodes of the site
    fsync_ms: tuple[int, int] = (1, 15)  # each node's fsync time, drawn once per run
    kill_every_ms: int = 250
    down_ms: tuple[int, int] = (50, 400)
    fence_timeout_ms: int = 120
    copy_timeout_ms: int = 200
    retry_ms: int = 100
    roll_records: int = 12  # a leader rolls its open segment once it holds this many records
    roll_wait_ms: int = 60  # a rolling leader waits this long for the LAC to reach what it appended
    roll_kill_p: float = 0.5  # the chance that a leader is killed right after its roll's seal commits


@dataclass(slots=True)
class Node:
    id: NodeId
    fsync_ms: int  # this node's disk: members that fsync at different speeds open windows for recovery
    up: bool = True
    incarnation: int = 0
    copies: dict[SegKey, SegCopy] = field(default_factory=dict)
    guards: dict[PartitionKey, GuardState] = field(default_factory=dict)  # persisted before every answer
    unsynced: set[SegKey] = field(default_factory=set)
    fsyncing: bool = False
    done_epoch: dict[PartitionKey, LeaderEpoch] = field(default_factory=dict)


@dataclass(slots=True)
class Lead:
    """One node's leadership of one partition in one epoch (volatile: a kill ends it)."""

    key: PartitionKey
    node: NodeId
    incarnation: int
    epoch: LeaderEpoch
    phase: str = "recovering"  # recovering, opening, active
    recovering: SegmentInfo | None = None
    recovery: SegmentRecovery | None = None
    attempt: int = 0
    answered: set[NodeId] = field(default_factory=set)
    copying: dict[NodeId, int] = field(default_factory=dict)
    sealed_through: SegmentId | None = None
    previous: tuple[NodeId, ...] = ()
    quorum: SegmentQuorum | None = None
    sent: dict[NodeId, int] = field(default_factory=dict)  # per member: the end of what was streamed to it
    busy: bool = False
    retry_at: int = 0
    roll_due: bool = False
    roll_since: int = 0
    seal_at: int | None = None  # a rolling leader's proposed seal: nothing past it becomes durable


@dataclass(slots=True)
class GeoClusterCounts:
    """What happened at the multi-node site, beyond the in-site counts (``ClusterCounts``)."""

    leader_kills: int = 0  # kills of a node leading partitions: the site's brokers restarted from the chain
    acks_all_released: int = 0
    geo_acks_released: int = 0  # acks=geo:N released at the multi-node site
    served_again: int = 0  # the site served again after a leader's kill (or at its start)

    def add(self, other: GeoClusterCounts) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class GeoClusterSimulator(Simulator):
    """See the module docstring."""

    def __init__(self, seed: int, topology: str = "triangle", *, config: SimConfig | None = None,
                 cluster: GeoClusterConfig | None = None, verbose: bool = False,
                 log: Callable[[str], None] | None = None) -> None:  # fmt: skip
        self.gc = cluster or GeoClusterConfig()
        self.cluster_site: SiteId | None = None  # set below; _boot needs to know before
        super().__init__(seed, topology, config=config, verbose=verbose, log=log)
        gc = self.gc
        self.cluster_site = sid = self.rng.choice(sorted(self.sites))
        self.ccounts = ClusterCounts()
        self.gcounts = GeoClusterCounts()
        self.nodes = {NodeId(i): Node(NodeId(i), self._between(gc.fsync_ms)) for i in range(1, gc.nodes + 1)}
        self.meta = SiteState()
        self.cchecker = ClusterChecker(rf=gc.rf, aq=gc.aq, single_loss=True, session_timeout_ms=gc.session_timeout_ms,
                                       copies_of=lambda n: self.nodes[n].copies, counts=self.ccounts)  # fmt: skip
        self.leads: dict[PartitionKey, Lead] = {}
        self.granted: dict[tuple[PartitionKey, LeaderEpoch], tuple[NodeId, int]] = {}
        self.electing: set[tuple[PartitionKey, LeaderEpoch]] = set()
        self._calls: dict[int, Callable[[], None]] = {}
        self._call_ids = itertools.count(1)
        self._payloads = itertools.count(1)
        self._fifo: dict[tuple[NodeId, NodeId], int] = {}
        self._handlers["gc"] = self._on_gc
        now = self.now_ms
        for nid in sorted(self.nodes):
            self.meta.apply(RegisterNode(nid, f"127.0.0.1:{7000 + nid}"))
            self.meta.apply(NodeHeartbeat(nid, now, 100 << 30, 0))
        for topic, partitions in self.topics.items():
            self.meta.apply(CreateTopic(TopicSpec(topic, partitions)))
        site = self.sites[sid]
        site.up = False  # it serves once every partition has a leader with an open segment
        self._boot(site)
        for producer in self.producers:  # a multi-node site's producers ask for the quorum (or more)
            if producer.site == sid and producer.acks.kind is AckKind.LEADER:
                producer.acks = Acks(AckKind.ALL)

    # -- plumbing ------------------------------------------------------------------------------------------

    def _boot(self, site: SimSite) -> None:
        super()._boot(site)
        if site.id != self.cluster_site:
            return
        if self.leads:  # serving again: each partition's producers as its leader builds them
            for key in self.keys:
                site.producers[key] = self._producer_table(self.leads[key])
        for key, log in sorted(site.logs.items()):  # as Broker.attach does for a ChainLog: the LAC is durable
            lac, vector = int(log.flushed_offset), VectorOffset(log.flushed_vector())
            site.acks.open_partition(key, self.fsync_per_batch[key[0]], lac, vector, replicated_in_site=True,
                                     lac=lac, lac_vector=vector)  # fmt: skip

    def _at(self, delay_ms: int, fn: Callable[..., None], *args: object) -> None:
        cid = next(self._call_ids)
        self._calls[cid] = lambda: fn(*args)
        self._after(delay_ms, "gc", cid)

    def _on_gc(self, cid: int) -> None:
        self._calls.pop(cid)()

    def _between(self, bounds: tuple[int, int]) -> int:
        return self.rng.randint(*bounds)

    def _nsend(self, src: NodeId, dst: NodeId, fn: Callable[..., None], *args: object) -> None:
        """A message between two nodes: FIFO per pair, lost if ``dst`` is down or restarted meanwhile."""
        due = max(self.now_ms + self._between(self.gc.latency_ms), self._fifo.get((src, dst), 0))
        self._fifo[(src, dst)] = due
        self._at(due - self.now_ms, self._deliver_node, src, self.nodes[src].incarnation, dst,
                 self.nodes[dst].incarnation, fn, args)  # fmt: skip

    def _deliver_node(self, src: NodeId, src_incarnation: int, dst: NodeId, incarnation: int,
                      fn: Callable[..., None], args: tuple[object, ...]) -> None:  # fmt: skip
        """A kill loses what its node had not sent yet (its streams' buffers), and what was on its way to it."""
        sender, node = self.nodes[src], self.nodes[dst]
        if sender.incarnation != src_incarnation:
            self.ccounts.dropped_messages += 1
        elif node.up and node.incarnation == incarnation:
            fn(*args)

    def _step(self) -> bool:
        stepped = super()._step()
        self.cchecker.after_event(self.meta, self.now_ms)
        return stepped

    def _propose(self, cmd: Command, then: Callable[[Result], None] | None = None) -> None:
        self._at(self._between(self.gc.raft_ms), self._commit, cmd, then)

    def _commit(self, cmd: Command, then: Callable[[Result], None] | None) -> None:
        topic, partition = getattr(cmd, "topic", None), getattr(cmd, "partition", None)
        before = None
        if isinstance(topic, str) and isinstance(partition, int):
            before = self.meta.partition(topic, partition)
        result = self.meta.apply(cmd)
        if isinstance(cmd, NodeHeartbeat):  # every tick of every node: no chain or epoch changes
            return
        if self.verbose:
            self._log(f"commit {cmd} -> {result}")
        self.cchecker.committed(cmd, result, before, self.meta, self.now_ms)
        if isinstance(cmd, ElectLeader):
            self.electing.discard(((cmd.topic, cmd.partition), cmd.expected_epoch))
            if isinstance(result, Applied):
                assert result.leader_epoch is not None
                self.ccounts.elections += 1
                self.granted[((cmd.topic, cmd.partition), result.leader_epoch)] = (
                    cmd.node, self.nodes[cmd.node].incarnation)
            else:
                self.ccounts.elections_refused += 1
        elif isinstance(cmd, OpenSegment) and isinstance(result, Applied) and result.changed:
            assert result.segment_id is not None
            self.ccounts.opens += 1
            self.ccounts.opens_short += len(cmd.ensemble) < self.gc.rf
            self.cchecker.segment_opened((cmd.topic, cmd.partition, result.segment_id), self.now_ms)
        elif isinstance(cmd, SealSegment) and isinstance(result, Applied) and result.changed:
            self.ccounts.seals += 1
            # Every node learns the seal from the metadata (and the chain ends there), whoever proposed it.
            self._chain_sealed((cmd.topic, cmd.partition), (cmd.topic, cmd.partition, cmd.segment_id),
                               int(cmd.end_offset))  # fmt: skip
        if then is not None:
            then(result)

    def _guard(self, node: Node, key: PartitionKey) -> ReplicaGuard:
        return ReplicaGuard(node.guards.get(key))

    def _persist(self, node: Node, key: PartitionKey, guard: ReplicaGuard) -> None:
        node.guards[key] = guard.state
        self.cchecker.fence_state(node.id, key, guard.fenced_epoch)

    # -- starting, ticks, the controller -------------------------------------------------------------------

    def _start(self) -> None:
        super()._start()
        for nid in sorted(self.nodes):
            self._at(self.rng.randint(1, self.gc.tick_ms), self._tick, nid, 0)
        self._at(self.rng.randint(self.gc.tick_ms, self.gc.kill_every_ms), self._fault_kill)  # early: runs are short

    def _tick(self, nid: NodeId, incarnation: int) -> None:
        node = self.nodes[nid]
        if not node.up or node.incarnation != incarnation:
            return
        now = self.now_ms
        self._commit(NodeHeartbeat(nid, now, 100 << 30, leadership.open_loads(self.meta).get(nid, 0)), None)
        if nid == min(n for n in sorted(self.nodes) if self.nodes[n].up):  # the controller
            for elect in site_state.plan_leadership(self.meta, now, self.gc.session_timeout_ms, None):
                tag = ((elect.topic, elect.partition), elect.expected_epoch)
                if tag not in self.electing:
                    self.electing.add(tag)
                    self._propose(elect)
        for info in self.meta.partitions():
            key = (info.topic, info.partition)
            lead = self.leads.get(key)
            leading = lead.epoch if lead is not None and lead.node == nid else None
            granted = self.granted.get((key, info.leader_epoch)) == (nid, node.incarnation)
            step = leadership.role_step(info, nid, leading, node.done_epoch.get(key, LeaderEpoch(0)), granted)
            if isinstance(step, leadership.Lead):
                self._begin(node, key, step.epoch, step.recover, info.segments)
            elif isinstance(step, leadership.AskEpoch):
                tag = (key, step.command.expected_epoch)
                if tag not in self.electing:
                    self.electing.add(tag)
                    self.ccounts.reelections += 1
                    self._propose(step.command)
            elif isinstance(step, leadership.StepDown) and lead is not None:
                self._step_down(lead, step.reason)
            elif lead is not None and lead.node == nid and lead.phase in ("recovering", "opening") \
                    and lead.retry_at <= now and not lead.busy and lead.recovery is None:  # fmt: skip
                self._resume(lead)
        self._at(self.gc.tick_ms, self._tick, nid, incarnation)

    def _step_down(self, lead: Lead, why: str) -> None:
        self._log(f"node {lead.node} steps down from {lead.key} epoch {lead.epoch}: {why}")
        self.ccounts.step_downs += 1
        node = self.nodes[lead.node]
        node.done_epoch[lead.key] = max(node.done_epoch.get(lead.key, LeaderEpoch(0)), lead.epoch)
        if self.leads.get(lead.key) is lead:
            del self.leads[lead.key]
        self._site_down(f"node {lead.node} stepped down from {lead.key[0]}/{lead.key[1]}")

    # -- becoming leader: recovery, then the next segment ---------------------------------------------------

    def _begin(self, node: Node, key: PartitionKey, epoch: LeaderEpoch, recover: SegmentInfo | None,
               segments: tuple[SegmentInfo, ...]) -> None:  # fmt: skip
        old = self.leads.get(key)
        if old is not None:
            self._step_down(old, f"node {node.id} leads epoch {epoch}")
        lead = self.leads[key] = Lead(key, node.id, node.incarnation, epoch)
        if self.verbose:
            self._log(f"node {node.id} leads {key} in epoch {epoch}")
        lead.previous = segments[-1].ensemble if segments else ()
        if recover is None:
            lead.phase = "opening"
            self._try_open(lead)
        else:
            lead.recovering = recover
            self._start_recovery(lead)

    def _resume(self, lead: Lead) -> None:
        if lead.phase == "recovering":
            self._start_recovery(lead)
        else:
            self._try_open(lead)

    def _current(self, lead: Lead) -> bool:
        node = self.nodes[lead.node]
        return self.leads.get(lead.key) is lead and node.up and node.incarnation == lead.incarnation

    def _start_recovery(self, lead: Lead) -> None:
        seg = lead.recovering
        assert seg is not None
        lead.attempt += 1
        lead.answered = set()
        lead.copying = {}
        self.ccounts.recoveries += 1
        rec = lead.recovery = SegmentRecovery(seg.segment_id, int(seg.base_offset), seg.ensemble, self.gc.aq,
                                              lead.epoch, lead.node)  # fmt: skip
        self._recovery_effects(lead, rec.start())

    def _rec(self, lead: Lead, attempt: int) -> SegmentRecovery | None:
        if not self._current(lead) or lead.phase != "recovering" or lead.attempt != attempt:
            return None
        return lead.recovery

    def _recovery_effects(self, lead: Lead, effects: list[recovery.Effect]) -> None:
        seg_info = lead.recovering
        assert seg_info is not None
        seg = (lead.key[0], lead.key[1], seg_info.segment_id)
        for eff in effects:
            if isinstance(eff, Fence):
                self._nsend(lead.node, eff.node, self._on_fence, lead, lead.attempt, seg, int(seg_info.base_offset),
                           eff.node)  # fmt: skip
                self._at(self.gc.fence_timeout_ms, self._fence_timeout, lead, lead.attempt, eff.node)
            elif isinstance(eff, Copy):
                cid = next(self._call_ids)
                lead.copying[eff.target] = cid
                self.ccounts.recovery_copies += 1
                self._nsend(lead.node, eff.source, self._on_copy_req, lead, lead.attempt, seg,
                            int(seg_info.base_offset), eff, cid)  # fmt: skip
                self._at(self.gc.copy_timeout_ms, self._copy_timeout, lead, lead.attempt, eff.target, cid)
            elif isinstance(eff, recovery.Seal):
                end = int(eff.end_offset)
                cmd = SealSegment(lead.key[0], lead.key[1], lead.epoch, eff.segment_id, LocalOffset(end),
                                  self._vector_at(lead.key, end),
                                  producers=self._seal_producers(lead, seg_info, end))  # fmt: skip
                self._propose(cmd, functools.partial(self._sealed, lead, lead.attempt, end))
            elif isinstance(eff, Done):
                self.ccounts.recoveries_done += 1
                if eff.end_offset > self.cchecker.acked_end(seg):
                    self.ccounts.recovered_tails += 1
                lead.recovery = None
                lead.phase = "opening"
                lead.sealed_through = seg_info.segment_id
                lead.previous = seg_info.ensemble
                self._try_open(lead)
            elif isinstance(eff, Failed):
                self.ccounts.recoveries_failed += 1
                self._log(f"node {lead.node} recovery of {seg} failed: {eff.reason}")
                lead.recovery = None
                lead.retry_at = self.now_ms + self.gc.retry_ms
            elif isinstance(eff, Superseded):
                self.ccounts.recoveries_superseded += 1
                self._step_down(lead, f"recovery superseded: {eff.reason}")
                return

    def _feed(self, lead: Lead, attempt: int, call: Callable[[SegmentRecovery], list[recovery.Effect]]) -> None:
        rec = self._rec(lead, attempt)
        if rec is not None:
            self._recovery_effects(lead, call(rec))

    def _on_fence(self, lead: Lead, attempt: int, seg: SegKey, base: int, member: NodeId) -> None:
        node = self.nodes[member]
        key = (seg[0], seg[1])
        guard = self._guard(node, key)
        try:
            guard.fence(lead.epoch)
        except Fenced as e:
            their = int(e.fenced_epoch)
            self._nsend(member, lead.node, self._feed_answer, lead, attempt, member,
                       lambda r: r.fence_refused(member, their))  # fmt: skip
            return
        self._persist(node, key, guard)
        copy = node.copies.get(seg)
        end = copy.fsynced_end if copy is not None else base  # what it holds durably: an acked batch is there
        self._nsend(member, lead.node, self._feed_answer, lead, attempt, member, lambda r: r.fenced(member, end))

    def _feed_answer(self, lead: Lead, attempt: int, member: NodeId,
                     call: Callable[[SegmentRecovery], list[recovery.Effect]]) -> None:  # fmt: skip
        if self._rec(lead, attempt) is not None:
            lead.answered.add(member)
            self._feed(lead, attempt, call)

    def _fence_timeout(self, lead: Lead, attempt: int, member: NodeId) -> None:
        if self._rec(lead, attempt) is not None and member not in lead.answered:
            self._feed(lead, attempt, lambda r: r.unreachable(member))

    def _on_copy_req(self, lead: Lead, attempt: int, seg: SegKey, base: int, eff: Copy, cid: int) -> None:
        source = self.nodes[eff.source]
        copy = source.copies.get(seg)
        if copy is None or copy.fsynced_end < eff.end_offset:
            self._nsend(eff.source, lead.node, self._copy_answer, lead, attempt, eff.target, cid, None)
            return
        batches = tuple(copy.read(int(eff.start_offset), int(eff.end_offset), fsynced_only=True))
        self._nsend(eff.source, eff.target, self._on_copy_data, lead, attempt, seg, base, batches, eff, cid)

    def _on_copy_data(self, lead: Lead, attempt: int, seg: SegKey, base: int, batches: tuple[Batch, ...], eff: Copy,
                      cid: int) -> None:  # fmt: skip
        node = self.nodes[eff.target]
        key = (seg[0], seg[1])
        guard = self._guard(node, key)
        try:
            guard.fence(lead.epoch)
        except Fenced:
            self._nsend(eff.target, lead.node, self._copy_answer, lead, attempt, eff.target, cid, None)
            return
        self._persist(node, key, guard)
        copy = node.copies.setdefault(seg, SegCopy(base))
        for b in batches:
            if b.end <= copy.end:
                self.cchecker.check_held(node.id, seg, b, "recovery")
            elif b.offset == copy.end:
                self.cchecker.copy_write(node.id, seg, copy, b, "recovery")
                copy.batches.append(b)
        copy.fsynced = len(copy.batches)  # a copy is fsynced before it is answered
        ok = copy.end >= eff.end_offset
        self._nsend(eff.target, lead.node, self._copy_answer, lead, attempt, eff.target, cid,
                   int(eff.end_offset) if ok else None)  # fmt: skip

    def _copy_answer(self, lead: Lead, attempt: int, target: NodeId, cid: int, end: int | None) -> None:
        if self._rec(lead, attempt) is None or lead.copying.get(target) != cid:
            return
        del lead.copying[target]
        if end is not None:
            self._feed(lead, attempt, lambda r: r.copied(target, end))
        else:
            self._feed(lead, attempt, lambda r: r.copy_failed(target, "the source or the target could not copy"))

    def _copy_timeout(self, lead: Lead, attempt: int, target: NodeId, cid: int) -> None:
        if self._rec(lead, attempt) is not None and lead.copying.get(target) == cid:
            del lead.copying[target]
            self._feed(lead, attempt, lambda r: r.copy_failed(target, "timeout"))

    def _sealed(self, lead: Lead, attempt: int, end: int, result: Result) -> None:
        if isinstance(result, Applied):
            self._feed(lead, attempt, lambda r: r.seal_committed(end))
        else:
            self._feed(lead, attempt, lambda r: r.seal_refused(getattr(result, "reason", str(result))))

    def _vector_at(self, key: PartitionKey, end: int) -> VectorOffset:
        """The chain's vector at ``end``: the sealed end vector the metadata records."""
        log = self.sites[self._sid()].logs[key]
        return vector_below({}, iter_headers(log.read(log.log_start_offset, READ_ALL).data), end)

    # -- the producers' state across leaders -----------------------------------------------------------------

    def _held_entries(self, nid: NodeId, key: PartitionKey, before: SegmentId) -> list[BatchEntry]:
        """The chain's batches that node ``nid``'s copies of ``key``'s segments before ``before`` hold (each copy
        is a prefix of its segment's stream: C3)."""
        info = self.meta.partition(*key)
        chain = self.sites[self._sid()].logs[key].batch_entries()
        out: list[BatchEntry] = []
        for seg in sorted(self.nodes[nid].copies):
            segment = info.segment(seg[2]) if info is not None and seg[:2] == key and seg[2] < before else None
            if segment is None:
                continue
            copy = self.nodes[nid].copies[seg]
            end = min(copy.end, int(segment.end_offset)) if segment.end_offset is not None else copy.end
            out += [e for e in chain if copy.base <= e.base_offset < end]
        return out

    def _producer_table(self, lead: Lead) -> ProducerStateTable:
        """The table ``lead`` starts its open segment with, as the node builds it (``georep/server/site_cluster.py``
        ``leader_producers``): its chain's last seal's snapshot, then the open segment's batches."""
        site = self.sites[self._sid()]
        info = self.meta.partition(*lead.key)
        q = lead.quorum
        assert info is not None and q is not None
        last = next((s for s in reversed(info.segments) if s.sealed), None)
        if last is not None and last.end_offset is not None and last.end_offset > last.base_offset:
            copy = self.nodes[lead.node].copies.get((lead.key[0], lead.key[1], last.segment_id))
            if copy is None or copy.end < int(last.end_offset or 0):
                self.ccounts.leaders_missing_history += 1
        history = producer_snapshot.history_at_open(info.sealed_producers(site.origin),
                                                    lambda: self._held_entries(lead.node, lead.key, q.segment_id))
        own = [e for e in site.logs[lead.key].batch_entries() if e.base_offset >= q.base_offset]
        return ProducerStateTable.rebuild(itertools.chain(history, own), now_ms=self.local_ms(site), origin=site.origin)

    def _seal_producers(self, lead: Lead, segment: SegmentInfo, end: int) -> ProducerSnapshot:
        """The table a seal of ``segment`` at ``end`` carries (``georep/server/cluster_member.py``
        ``seal_producers``): its leader holds the segment up to ``end``, the chain's bytes there."""
        site = self.sites[self._sid()]
        info = self.meta.partition(*lead.key)
        assert info is not None
        base = int(segment.base_offset)
        batches = [e for e in site.logs[lead.key].batch_entries() if base <= e.base_offset < end]
        history = producer_snapshot.history_at_open(
            info.sealed_producers(site.origin), lambda: self._held_entries(lead.node, lead.key, segment.segment_id))
        return producer_snapshot.fold(history, site.origin, batches, now_ms=self.local_ms(site))

    def _resolve(self, producer: SimProducer) -> None:
        failed = producer.failed_batches
        super()._resolve(producer)
        if producer.site == self.cluster_site and producer.failed_batches > failed:
            raise InvariantViolation(f"{producer.name}: {producer.failed_batches - failed} batch(es) failed to the "
                                     "application at the multi-node site when the producer's round of resends "
                                     "resolved (OutOfOrderSequence with nothing wrong before it: the leader's "
                                     "producer table did not know the producer's last sequences)")  # fmt: skip

    def _on_produce_answer(self, pi: int, incarnation: int, correlation: int, produced: Produced | None,
                           error: Exception | None) -> None:  # fmt: skip
        producer = self.producers[pi]
        failed = producer.failed_batches
        super()._on_produce_answer(pi, incarnation, correlation, produced, error)
        if producer.site == self.cluster_site and producer.failed_batches > failed \
                and not isinstance(error, GeoAckTimeout):  # fmt: skip
            raise InvariantViolation(f"{producer.name}: a batch failed to the application at the multi-node site: "
                                     f"{type(error).__name__}: {error}")

    def _chain_sealed(self, key: PartitionKey, seg: SegKey, end: int) -> None:
        """The seal committed: members learn it and cut longer copies, and the chain ends at ``end``."""
        for nid in sorted(self.nodes):
            if self.nodes[nid].up:
                self._learn_seals(self.nodes[nid])
        site = self.sites[self._sid()]
        log = site.logs[key]
        if log.log_end_offset > end:
            before = len(log.batch_entries())
            log.flush_to(end)
            log.crash()  # nothing past the seal stays in the chain: the next segment starts at ``end``
            self.ccounts.lost_batches += before - len(log.batch_entries())
            self._changed(site.id, key)
        if log.flushed_offset < end:
            log.flush_to(end)  # AQ members hold the sealed segment: the recovery copied it to them
        self.fail_unless(log.flushed_offset == end, "C4",
                         f"visibility: {key[0]}/{key[1]} segment {seg[2]} is sealed at {end}, below its LAC "
                         f"{log.flushed_offset}: the recovery cut what the site acked and served")  # fmt: skip
        self._note_durable(key)

    def fail_unless(self, ok: bool, check: str, message: str) -> None:
        if not ok:
            raise InvariantViolation(f"{check} {message}")

    def _learn_seals(self, node: Node) -> None:
        for info in self.meta.partitions():
            key = (info.topic, info.partition)
            last = next((s for s in reversed(info.segments) if s.sealed), None)
            if last is None:
                continue
            guard = self._guard(node, key)
            through = guard.state.sealed_through
            if through is None or through < last.segment_id:
                guard.seal(LeaderEpoch(max(info.leader_epoch, guard.fenced_epoch)), last.segment_id)
                self._persist(node, key, guard)
            for s in info.segments:
                seg = (info.topic, info.partition, s.segment_id)
                copy = node.copies.get(seg)
                if copy is None or not s.sealed:
                    continue
                assert s.end_offset is not None
                cut = recovery.cut_after_seal(copy.end, int(s.end_offset))
                if cut is not None:
                    i = copy.index_at(int(cut))
                    self.fail_unless(i >= 0, "C3", f"node {node.id} must cut {seg} at {cut}, not a batch boundary")
                    self.ccounts.tail_cuts += 1
                    del copy.batches[i:]
                    copy.fsynced = min(copy.fsynced, i)
                    self.cchecker.touched(seg)

    def _try_open(self, lead: Lead) -> None:
        if lead.busy or not self._current(lead):
            return
        info = self.meta.partition(*lead.key)
        assert info is not None
        loads = leadership.node_loads(self.meta, self.now_ms, self.gc.session_timeout_ms)
        step = leadership.plan_open(info, lead.node, lead.epoch, lead.sealed_through, lead.previous, loads,
                                    self.gc.rf, min_ensemble=self.gc.aq)  # fmt: skip
        if isinstance(step, leadership.Adopt):
            self._adopt(lead, step.segment_id, int(step.base_offset), step.ensemble)
        elif isinstance(step, leadership.ProposeOpen):
            cmd = step.command
            lead.busy = True
            self._propose(cmd, lambda result: self._opened(lead, cmd, result))
        else:
            self.ccounts.placement_waits += isinstance(step, leadership.Blocked)
            lead.retry_at = self.now_ms + self.gc.retry_ms

    def _opened(self, lead: Lead, cmd: OpenSegment, result: Result) -> None:
        lead.busy = False
        if not self._current(lead) or lead.phase != "opening":
            return
        if isinstance(result, Applied) and result.segment_id is not None:
            self._adopt(lead, result.segment_id, int(cmd.base_offset), cmd.ensemble)
        else:
            lead.retry_at = self.now_ms + self.gc.retry_ms

    def _adopt(self, lead: Lead, segment_id: SegmentId, base: int, ensemble: tuple[NodeId, ...]) -> None:
        if lead.phase != "opening":
            return
        log = self.sites[self._sid()].logs[lead.key]
        self.fail_unless(log.log_end_offset == base, "C2",
                         f"{lead.key} segment {segment_id} opens at {base} but the chain ends at "
                         f"{log.log_end_offset}")  # fmt: skip
        q = lead.quorum = SegmentQuorum(segment_id, base, ensemble, self.gc.aq, lead.epoch, lead.node)
        lead.phase = "active"
        lead.sent = dict.fromkeys(ensemble, base)
        seg = (lead.key[0], lead.key[1], segment_id)
        self.nodes[lead.node].copies.setdefault(seg, SegCopy(base))
        for member in ensemble:
            if not self.nodes[member].up:
                q.member_failed(member)
        if self.verbose:
            self._log(f"node {lead.node} writes {lead.key} segment {segment_id} at {base} on {list(ensemble)}")
        self._maybe_serve()

    # -- the site serves, or stops ------------------------------------------------------------------------

    def _sid(self) -> SiteId:
        assert self.cluster_site is not None
        return self.cluster_site

    def _all_active(self) -> bool:
        return all((lead := self.leads.get(key)) is not None and lead.phase == "active" and self._current(lead)
                   for key in self.keys)  # fmt: skip

    def _maybe_serve(self) -> None:
        site = self.sites[self._sid()]
        if site.up or not self._all_active():
            return
        # What a crash's checks hold the site to, against the chain the recoveries left.
        self.gcounts.served_again += 1
        self._changed(site.id, *self.keys)
        self.checker.on_crash(site.id, site.origin, {str(s): x.logs for s, x in self.sites.items()})
        for producer in self.producers:
            producer.forget_lost(site.id, site.logs[producer.key].vector(), False)
        self._check_acked_writes(crashed=site)
        self.consumers.site_crashed(site, False, read_back=True)
        self.groups.site_crashed(site)
        super()._restart(site.id)

    def _restart(self, sid: SiteId) -> None:
        if sid == self.cluster_site:
            self._maybe_serve()  # the multi-node site serves again once its partitions have leaders
        else:
            super()._restart(sid)

    def _site_down(self, why: str) -> None:
        site = self.sites[self._sid()]
        if not site.up:
            return
        self._log(f"{site.id} stops serving: {why}")
        self._disconnect(site)
        self._producers_lose_connection(site)

    def _on_fault_crash(self) -> None:
        """Whole-site crashes spare the multi-node site: its nodes fail one at a time (``_fault_kill``)."""
        if self.phase != "safety":
            return
        candidates = [sid for sid, site in self.sites.items() if site.up and sid != self.cluster_site]
        if candidates:
            sid = self.rng.choice(candidates)
            rebuild = bool(self.faults.rebuild_p) and self.rng.random() < self.faults.rebuild_p
            self._crash(self.sites[sid], rebuild)
            self._after(self.rng.randint(*self.faults.down_ms), "restart", sid, self.sites[sid].incarnation)
        self._after(self._interval(self.faults.crash_every_ms), "fault_crash")

    # -- node kills ----------------------------------------------------------------------------------------

    def _fault_kill(self) -> None:
        if self.phase != "safety":
            return
        if all(n.up for n in self.nodes.values()):  # one node down at a time
            nid = self.rng.choice(sorted(self.nodes))
            self._kill(self.nodes[nid])
            self._at(self._between(self.gc.down_ms), self._restart_node, nid, self.nodes[nid].incarnation)
        self._at(self.rng.randint(self.gc.tick_ms, self.gc.kill_every_ms), self._fault_kill)  # early: runs are short

    def _kill(self, node: Node) -> None:
        self.ccounts.kills += 1
        node.up = False
        node.incarnation += 1
        node.fsyncing = False
        node.unsynced.clear()
        lost = 0
        for copy in node.copies.values():
            lost += len(copy.batches) - copy.fsynced
            del copy.batches[copy.fsynced:]
        self.ccounts.lost_batches += lost
        self.cchecker.crashed(node.id, self.now_ms, node.copies)
        led = sorted(key for key, lead in self.leads.items() if lead.node == node.id)
        self._log(f"kill node {node.id} of {self._sid()}: lost {lost} unfsynced batches; it led {led}")
        for key in led:
            del self.leads[key]
        if led:
            self.gcounts.leader_kills += 1
            self._site_down(f"node {node.id}, leader of {len(led)} partition(s), was killed")
        for _key, lead in sorted(self.leads.items()):
            if lead.quorum is not None and node.id in lead.quorum.ensemble:
                lead.quorum.member_failed(node.id)

    def _restart_node(self, nid: NodeId, incarnation: int) -> None:
        node = self.nodes[nid]
        if node.up or node.incarnation != incarnation:
            return
        node.up = True
        self.ccounts.restarts += 1
        self._log(f"restart node {nid} of {self._sid()}")
        self._learn_seals(node)
        for _key, lead in sorted(self.leads.items()):
            q = lead.quorum
            if q is not None and nid in q.ensemble and nid != lead.node:
                q.member_reconnected(nid)
                copy = node.copies.get((lead.key[0], lead.key[1], q.segment_id))
                lead.sent[nid] = copy.end if copy is not None else q.base_offset  # the stream's open says its end
                self._stream(lead)
        self._at(self.rng.randint(1, self.gc.tick_ms), self._tick, nid, node.incarnation)

    # -- writing: the leader's appends, members, fsyncs, the LAC --------------------------------------------

    def _changed(self, sid: SiteId, *keys: PartitionKey) -> None:
        super()._changed(sid, *keys)
        if sid != self.cluster_site or not self.sites[sid].up:
            return
        for key in keys:
            lead = self.leads.get(key)
            if lead is not None and lead.quorum is not None:
                self._take_appends(lead)

    def _take_appends(self, lead: Lead) -> None:
        """What the broker appended to the chain goes into the leader's copy and out to the members."""
        q = lead.quorum
        assert q is not None
        log = self.sites[self._sid()].logs[lead.key]
        seg = (lead.key[0], lead.key[1], q.segment_id)
        copy = self.nodes[lead.node].copies[seg]
        if log.log_end_offset <= copy.end:
            return
        writer = (lead.node, lead.incarnation, lead.epoch)
        for h in iter_headers(log.read(LocalOffset(copy.end), READ_ALL).data):
            b = Batch(int(h.base_offset), h.last_offset_delta + 1, next(self._payloads))
            self.cchecker.writer_append(seg, writer, b)
            self.cchecker.copy_write(lead.node, seg, copy, b, "append")
            copy.batches.append(b)
        q.appended(copy.end)
        lead.sent[lead.node] = copy.end
        self.nodes[lead.node].unsynced.add(seg)
        self._stream(lead)
        if copy.end - copy.base >= self.gc.roll_records and not lead.roll_due:
            lead.roll_due = True
            self._at(0, self._start_roll, lead)  # an event of its own: not in the middle of an append

    # -- rolling by size -----------------------------------------------------------------------------------

    def _start_roll(self, lead: Lead) -> None:
        """Stop taking writes (the partition's ChainLog ends with its open segment), seal at the LAC, open the
        next segment; the site's brokers restart over the new chain, as after a leader change."""
        lead.roll_due = False
        if not self._current(lead) or lead.phase != "active" or not self.sites[self._sid()].up:
            return
        q = lead.quorum
        assert q is not None
        self.ccounts.rolls_by_size += 1
        lead.phase = "rolling"
        lead.roll_since = self.now_ms
        self._site_down(f"{lead.key[0]}/{lead.key[1]} rolls its segment {q.segment_id}")
        self._roll_step(lead)

    def _roll_step(self, lead: Lead) -> None:
        q = lead.quorum
        if not self._current(lead) or lead.phase != "rolling" or q is None or lead.busy:
            return
        at = leadership.roll_seal_at(q.lac, q.appended_end, lead.roll_since, self.now_ms, self.gc.roll_wait_ms)
        if at is None:
            self._at(self.gc.latency_ms[1], self._roll_step, lead)
            return
        lead.seal_at = at
        lead.busy = True
        info = self.meta.partition(*lead.key)
        segment = info.segment(q.segment_id) if info is not None else None
        assert segment is not None
        cmd = SealSegment(lead.key[0], lead.key[1], lead.epoch, q.segment_id, LocalOffset(at),
                          self._vector_at(lead.key, at), producers=self._seal_producers(lead, segment, at))  # fmt: skip
        self._propose(cmd, functools.partial(self._rolled, lead, q))

    def _rolled(self, lead: Lead, q: SegmentQuorum, result: Result) -> None:
        lead.busy = False
        if not self._current(lead) or lead.phase != "rolling" or lead.quorum is not q:
            return
        if not isinstance(result, Applied):
            self._step_down(lead, f"its roll's seal was refused: {result}")
            return
        lead.phase = "opening"
        lead.sealed_through = q.segment_id
        lead.previous = q.ensemble
        lead.quorum = None
        lead.seal_at = None
        if self.phase == "safety" and all(n.up for n in self.nodes.values()) \
                and self.rng.random() < self.gc.roll_kill_p:  # fmt: skip
            # Killed between the seal and the next open: the controller may name a node that holds none of the
            # segment just sealed, and it must still know every producer's last sequences.
            self.ccounts.roll_kills += 1
            node = self.nodes[lead.node]
            self._kill(node)
            self._at(self._between(self.gc.down_ms), self._restart_node, node.id, node.incarnation)
            return
        self._try_open(lead)

    def _stream(self, lead: Lead) -> None:
        q = lead.quorum
        assert q is not None
        seg = (lead.key[0], lead.key[1], q.segment_id)
        copy = self.nodes[lead.node].copies[seg]
        for member in q.ensemble:
            if member == lead.node or not self.nodes[member].up or lead.sent[member] >= copy.end:
                continue
            batches = tuple(copy.read(lead.sent[member], copy.end))
            lead.sent[member] = copy.end
            self._nsend(lead.node, member, self._on_append, lead, member, seg, q.base_offset, batches)

    def _on_append(self, lead: Lead, nid: NodeId, seg: SegKey, base: int, batches: tuple[Batch, ...]) -> None:
        """A member gets streamed batches: its guard checks each, it appends, then fsyncs and acks."""
        node = self.nodes[nid]
        key = (seg[0], seg[1])
        guard = self._guard(node, key)
        copy = node.copies.get(seg)
        wrote = False
        for b in batches:
            end = copy.end if copy is not None else base
            if b.end <= end:
                continue  # sent again after a reconnection: it has it
            try:
                raised = guard.check_append(lead.epoch, seg[2], b.offset, end)
            except Fenced:
                self.ccounts.fenced_appends += 1
                return
            except SegmentSealed:
                return
            except NotContiguous:
                self.ccounts.gaps += 1
                self._nsend(nid, lead.node, self._on_gap, lead, seg, nid, end)
                break
            if raised:
                self._persist(node, key, guard)
            self.cchecker.accepted(nid, key, lead.epoch, (lead.node, lead.incarnation))
            if copy is None:
                copy = node.copies[seg] = SegCopy(base)
            self.cchecker.copy_write(nid, seg, copy, b, "append")
            copy.batches.append(b)
            wrote = True
        if wrote:
            node.unsynced.add(seg)
            self._fsync_soon(node)

    def _on_gap(self, lead: Lead, seg: SegKey, member: NodeId, end: int) -> None:
        q = lead.quorum
        if not self._current(lead) or q is None or q.segment_id != seg[2]:
            return
        self.ccounts.resends += 1
        lead.sent[member] = end
        self._stream(lead)

    def _fsync_soon(self, node: Node) -> None:
        if not node.fsyncing:
            node.fsyncing = True
            self._at(node.fsync_ms, self._fsync_done, node.id, node.incarnation,
                     {seg: len(node.copies[seg].batches) for seg in sorted(node.unsynced)})  # fmt: skip
            node.unsynced = set()

    def _fsync_done(self, nid: NodeId, incarnation: int, counts: dict[SegKey, int]) -> None:
        node = self.nodes[nid]
        if not node.up or node.incarnation != incarnation:
            return
        node.fsyncing = False
        for seg, n in sorted(counts.items()):
            copy = node.copies.get(seg)
            if copy is None:
                continue
            copy.fsynced = max(copy.fsynced, min(n, len(copy.batches)))
            lead = self.leads.get((seg[0], seg[1]))
            if lead is None or lead.quorum is None or lead.quorum.segment_id != seg[2]:
                continue
            end = copy.fsynced_end
            if lead.node == nid:
                self._on_member_ack(lead, seg, nid, end)
                site = self.sites[self._sid()]
                if site.up and self._current(lead):
                    self.perform_acks(site, site.acks.flush_done(lead.key, end, VectorOffset()))
            else:
                self._nsend(nid, lead.node, self._on_member_ack, lead, seg, nid, end)
        if node.unsynced:
            self._fsync_soon(node)

    def _on_member_ack(self, lead: Lead, seg: SegKey, member: NodeId, end: int) -> None:
        q = lead.quorum
        if not self._current(lead) or q is None or q.segment_id != seg[2]:
            return
        try:
            effects = q.member_acked(member, end)
        except QuorumError as e:
            raise InvariantViolation(f"C1 the quorum refused node {member}'s ack of {seg} at {end}: {e}") from e
        for eff in effects:
            if isinstance(eff, LacAdvanced):
                self._lac_advanced(lead, eff.lac)

    def _lac_advanced(self, lead: Lead, lac: int) -> None:
        """The LAC is the chain's durable end (``ChainLog.advance_lac``), fed to the ack table."""
        if lead.seal_at is not None:
            lac = min(lac, lead.seal_at)  # a rolling leader's chain ends at its seal, whatever acks come later
        site = self.sites[self._sid()]
        log = site.logs[lead.key]
        log.flush_to(lac)
        flushed = self._note_durable(lead.key)
        if not site.up:
            return
        self.perform_acks(site, site.acks.quorum_advanced(lead.key, int(log.flushed_offset), VectorOffset(flushed)))
        self.consumers.flushed(site, lead.key)
        for dst, out in sorted(site.out_streams.items()):
            if lead.key in out.source.wanted:
                self._pump_soon(site, dst, 0)

    def _note_durable(self, key: PartitionKey) -> dict[Origin, OriginSeq]:
        """What the chain holds durably (at the LAC, or sealed) counts as held by the site for I6."""
        sid = self._sid()
        flushed = self.sites[sid].logs[key].flushed_vector()
        ever = self.ever_flushed[(sid, key)]
        for origin, n in flushed.items():
            if n > ever.get(origin, 0):
                ever[origin] = n
        return flushed

    def perform_acks(self, site: SimSite, effects: list[Effect]) -> None:
        if site.id != self.cluster_site:
            super().perform_acks(site, effects)
            return
        rest: list[Effect] = []
        for effect in effects:
            if isinstance(effect, StartFlush):  # the leader fsyncs its own copy: one member's share of the LAC
                lead = self.leads.get(effect.key)
                if lead is not None and lead.quorum is not None:
                    self._take_appends(lead)
                    node = self.nodes[lead.node]
                    node.unsynced.add((lead.key[0], lead.key[1], lead.quorum.segment_id))
                    self._fsync_soon(node)
            else:
                rest.append(effect)
        super().perform_acks(site, rest)

    def _on_fsync_done(self, sid: SiteId, incarnation: int, key: PartitionKey, end: int) -> None:
        if sid != self.cluster_site:
            super()._on_fsync_done(sid, incarnation, key, end)

    # -- I6 and C1 at the ack --------------------------------------------------------------------------------

    def _check_ack_promise(self, producer: SimProducer, site: SimSite, produced: Produced) -> None:
        super()._check_ack_promise(producer, site, produced)
        if site.id != self.cluster_site:
            return
        key = producer.key
        if producer.acks.kind is AckKind.ALL and not self.fsync_per_batch[key[0]]:
            # acks=all holds at the LAC whatever the topic's fsync policy (the base records only fsynced acks):
            # the write must stay in the chain across every recovery.
            origin, seq = produced.origin, int(produced.result.last_origin_seq)
            holders = {sid: s.rebuilds for sid, s in sorted(self.sites.items())
                       if s.logs[key].flushed_vector().get(origin, 0) > seq}  # fmt: skip
            self.acked.append(AckedWrite(key, origin, seq, holders, str(producer.acks)))
        offset = int(produced.result.base_offset)
        info = self.meta.partition(*key)
        assert info is not None
        segment = next((s for s in info.segments if s.base_offset <= offset
                        and (s.end_offset is None or offset < s.end_offset)), None)  # fmt: skip
        lead = self.leads.get(key)
        stream = self.cchecker.streams.get((key[0], key[1], segment.segment_id), []) if segment else []
        i = bisect.bisect_left(stream, offset, key=lambda b: b.offset)
        if segment is None or lead is None or i >= len(stream) or stream[i].offset != offset:
            raise InvariantViolation(f"C1 {producer.name} was acked at offset {offset} of {key[0]}/{key[1]}, "
                                     "which no segment's writer stream holds")  # fmt: skip
        self.gcounts.acks_all_released += 1
        self.ccounts.acked_short += len(segment.ensemble) < self.gc.rf  # writes went on with a node down
        self.gcounts.geo_acks_released += producer.acks.kind is AckKind.GEO
        self.cchecker.released(AckedBatch(key, segment.segment_id, stream[i], self.now_ms, lead.node, lead.epoch),
                               self.meta, self.now_ms)  # fmt: skip

    def _failure(self, message: str) -> SimulationFailure:
        steps = "" if self.config.steps == GEO_CLUSTER_STEPS else f" --steps {self.config.steps}"
        replay = f"python -m georep.sim --geo-cluster --seed {self.seed} --topology {self.topology_name}{steps}"
        return SimulationFailure(f"{message}\n  multi-node site: {self._sid()} ({self.gc.nodes} nodes, RF "
                                 f"{self.gc.rf}, min_insync_replicas {self.gc.aq})", self.seed, self.topology_name,
                                 replay)  # fmt: skip

    # -- liveness --------------------------------------------------------------------------------------------

    def _run_liveness(self) -> None:
        for nid in sorted(self.nodes):
            node = self.nodes[nid]
            if not node.up:
                self._restart_node(nid, node.incarnation)
        super()._run_liveness()

    def _in_site_problems(self) -> list[str]:
        """After healing, the site serves and every member of every open segment holds all its leader appended."""
        if not self.sites[self._sid()].up:
            return [f"the multi-node site {self._sid()} does not serve: partitions without an active leader"]
        out = []
        for key in self.keys:
            q = self.leads[key].quorum
            assert q is not None
            behind = [n for n in q.ensemble if q.member_end(n) < q.appended_end]
            if behind:
                out.append(f"{key[0]}/{key[1]} segment {q.segment_id}: nodes {behind} do not hold up to "
                           f"{q.appended_end} fsynced (LAC {q.lac})")  # fmt: skip
        return out

    def _live(self, logs: Mapping[str, Mapping[PartitionKey, MemoryLog]]) -> bool:
        return not self._in_site_problems() and super()._live(logs)

    def _liveness_problems(self, logs: Mapping[str, Mapping[PartitionKey, MemoryLog]]) -> list[str]:
        return self._in_site_problems() or super()._liveness_problems(logs)


def run_geo_cluster_seed(seed: int, topology: str = "triangle", *, steps: int = GEO_CLUSTER_STEPS,
                         verbose: bool = False) -> tuple[SimResult, ClusterCounts, GeoClusterCounts]:  # fmt: skip
    """One run, as ``python -m georep.sim --geo-cluster --seed SEED --topology NAME --steps STEPS`` does it."""
    sim = GeoClusterSimulator(seed, topology, config=SimConfig(steps=steps), verbose=verbose)
    result = sim.run()
    return result, sim.ccounts, sim.gcounts


__all__ = ["GEO_CLUSTER_STEPS", "GEO_CLUSTER_TOPOLOGIES", "GeoClusterConfig", "GeoClusterCounts",
           "GeoClusterSimulator", "START_MS", "run_geo_cluster_seed"]  # fmt: skip
