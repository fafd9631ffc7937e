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

**The nodes are the node's own core** (issue 21). Each node of the site is a :class:`~cluster.node.NodeCore`,
the object a real node runs, carried out by the node shells both cluster simulators share
(``georep/sim/cluster_node.py``); this module keeps no node plumbing of its own, only what a partition means
to a site inside a geo topology (:class:`GeoNodes`' hooks) and the world around the nodes (:class:`GeoFabric`):

=============================================  ===========================================================
decision                                       pure code, driven through ``NodeCore``
=============================================  ===========================================================
metadata: nodes, topics, leaders, chains       ``SiteState.apply``, every command after a Raft latency
who leads which partition                      ``Controller.elections`` (``plan_leadership``): the node whose
                                               replica leads the metadata log (``SimNodes.leads_metadata``,
                                               the same rule as ``georep/sim/cluster.py``)
lead, recover first, step down, or ask again   ``NodeCore.reconcile`` (``role_step``): every tick
recover, open, write, roll; the resend rule    ``PartitionLead`` (``SegmentRecovery``, ``plan_open``,
                                               ``SegmentQuorum``, ``roll_seal_at``)
fencing, contiguity, sealed segments, cuts     ``cluster.member`` (``ReplicaGuard``, ``cut_after_seal``)
the producers' table across leaders            ``cluster.producer_snapshot`` (seals carry it)
=============================================  ===========================================================

Each node keeps its copies (``cluster_model.SegCopy``: batches and an fsynced prefix) and its persisted guard
states; a batch is named by an id (``Batch.payload``) and its bytes are the chain's at its offset (every copy
is a prefix of its segment's writer stream, which C3 checks). What the site's broker appends to the chain goes
to the leader's copy (``SimNodes.append_as_leader``) and from there to the members over per-pair FIFO links;
a member that was down is sent again what the lead's resend rule says once it is back. A node kill
(``kill_every_ms``, one node down at a time, back after ``down_ms``) loses the unfsynced part of its copies,
and its messages not yet delivered (its streams' buffers), so a survivor may miss the last batches the others
acked. A kill of a node that leads partitions is the loss of that broker: the site's volatile state goes (its
clients' connections, streams, pending acks, as in a site crash), and it comes back once every partition has a
leader writing an open segment again: the controller elects one after the session timeout (or the restarted
node asks for a new epoch), which fences the members, takes the end E - AQ + 1 of them hold, copies it to the
others, seals it in the metadata, cuts longer copies and the chain, and opens the next segment. Then the geo
checks of a crash run against the recovered chain (no other site holds a coordinate the recovery cut, no
consumer delivered one, every acknowledged write is still held), and the site serves again.

A leader rolls its open segment once it holds ``roll_records`` records: it stops taking writes, seals at the
LAC (``roll_seal_at``; nothing past the proposed seal becomes durable, whatever acks come later), and opens
the next segment on the live nodes, which widens a segment opened short. With ``roll_kill_p`` the leader is
killed right after its roll's seal commits, before it opens the next segment, so the controller may name a
node that holds none of the sealed segment: it must take every idempotent producer's last sequences from the
seal, else a producer's resend is stored twice or its next batch is refused (both fail the run). Every
committed seal, a roll's or a recovery's, is learned from the metadata: members cut longer copies, and the
chain ends there.

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
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

import cluster.leadership as leadership
from cluster.lead import Adopted, PartitionLead, ProposeSeal, Release, Sealing, SegmentSealed, StepDown
from cluster.node import NodeConfig
from cluster.site_state import (
    Applied,
    Command,
    CreateTopic,
    ElectLeader,
    FailOver,
    NodeHeartbeat,
    OpenSegment,
    RegisterNode,
    Result,
    SealSegment,
    SiteState,
)
from dedup.producer import OutOfOrderSequence, ProducerBatch
from georep.broker.acks import AckKind, Acks, Effect, StartFlush
from georep.broker.append import Produced
from georep.broker.errors import GeoAckTimeout, SequenceRejected
from georep.metadata.topics import TopicSpec
from georep.record.batch import iter_headers
from georep.replication.links import PartitionKey
from georep.sim.checker import InvariantViolation
from georep.sim.cluster_checks import AckedBatch, ClusterChecker
from georep.sim.cluster_model import Batch, ClusterCounts
from georep.sim.cluster_node import Action, SimNode, SimNodes
from georep.sim.producers import AckedWrite, SimProducer
from georep.sim.simulator import START_MS, SimConfig, SimResult, SimulationFailure, Simulator
from georep.sim.site import SimSite
from georep.storage.memory_log import MemoryLog
from offsets.coordinates import LocalOffset, Origin, OriginSeq
from offsets.log_prefix import vector_below
from offsets.vector import VectorOffset
from topology.ids import NodeId, SegmentId, SiteId

GEO_CLUSTER_TOPOLOGIES = ("triangle", "ring4-split", "mesh4-audit")  # each has a cycle
GEO_CLUSTER_STEPS = 700
READ_ALL = 1 << 30
FREE_BYTES = 100 << 30


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
    roll_kill_p: float = 0.8  # the chance that a leader is killed right after its roll's seal commits

    def node(self) -> NodeConfig:
        return NodeConfig(self.rf, self.aq, self.session_timeout_ms, self.tick_ms, self.retry_ms, self.roll_wait_ms)


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


class GeoFabric:
    """The multi-node site's world, as its nodes' shells see it (``cluster_node.Fabric``): the simulator's clock
    and event heap, a FIFO network between nodes that loses what a killed node had not sent yet, and the metadata
    log, which commits every proposal after a Raft latency; the metadata log's leader is any running node (every
    node is a voter, and nothing here cuts a node off from the majority)."""

    def __init__(self, sim: GeoClusterSimulator) -> None:
        self.sim = sim
        self._fifo: dict[tuple[NodeId, NodeId], int] = {}

    @property
    def now_ms(self) -> int:
        return self.sim.now_ms

    @property
    def counts(self) -> ClusterCounts:
        return self.sim.ccounts

    @property
    def checker(self) -> ClusterChecker:
        return self.sim.cchecker

    def at(self, delay_ms: int, node: SimNode | None, fn: Action, *args: object) -> None:
        if node is None:
            self.sim.later(delay_ms, fn, *args)
        else:
            self.sim.later(delay_ms, self._on_node, node, node.incarnation, fn, args)

    def _on_node(self, node: SimNode, incarnation: int, fn: Action, args: tuple[object, ...]) -> None:
        if node.up and node.incarnation == incarnation:
            fn(*args)

    def send(self, src: SimNode, dst: NodeId, fn: Action, *args: object) -> None:
        """A message between two nodes: FIFO per pair, lost if either restarts meanwhile. To a node that is down
        the sender notices at once that its stream broke, as TCP would."""
        target = self.sim.shells.node(dst)
        if dst == src.id:
            self.at(0, target, fn, target, *args)
            return
        if not target.up:
            self.counts.dropped_messages += 1
            self.at(0, src, self.sim.shells.stream_broken, src, dst)
            return
        due = max(self.now_ms + self.sim.between(self.sim.gc.latency_ms), self._fifo.get((src.id, dst), 0))
        self._fifo[(src.id, dst)] = due
        self.sim.later(
            due - self.now_ms, self._deliver, src, src.incarnation, target, target.incarnation, fn, (target, *args)
        )

    def _deliver(
        self, src: SimNode, src_incarnation: int, dst: SimNode, incarnation: int, fn: Action, args: tuple[object, ...]
    ) -> None:
        """A kill loses what its node had not sent yet (its streams' buffers), and what was on its way to it."""
        if src.incarnation != src_incarnation:
            self.counts.dropped_messages += 1
        elif dst.up and dst.incarnation == incarnation:
            fn(*args)

    def propose(self, node: SimNode, cmd: Command, then: Callable[[Result | None], None] | None = None) -> None:
        self.sim.later(self.sim.between(self.sim.gc.raft_ms), self._commit, node, node.incarnation, cmd, then)

    def _commit(
        self, node: SimNode, incarnation: int, cmd: Command, then: Callable[[Result | None], None] | None
    ) -> None:
        """The command commits whatever became of its proposer; only the incarnation that proposed it hears."""
        result = self.sim.commit(cmd)
        if then is not None and node.up and node.incarnation == incarnation:
            then(result)

    def view(self, node: SimNode) -> SiteState:
        return self.sim.meta

    def reachable(self, src: SimNode, dst: NodeId) -> bool:
        return self.sim.shells.node(dst).up

    def can_lead_metadata(self, node: SimNode) -> bool:
        return node.up

    def log(self, line: str) -> None:
        self.sim._log(line)


class GeoNodes(SimNodes):
    """The site's nodes (``georep/sim/cluster_node.py``), and what a partition means to a site in a geo topology:
    the chain its broker appends to goes to the leader's copy; a release is the chain's durable end, fed to the
    ack table; a roll or a step-down stops the site's brokers; a roll's seal may be followed by the leader's kill.
    """

    def __init__(self, sim: GeoClusterSimulator, origin: Origin) -> None:
        gc = sim.gc
        super().__init__(GeoFabric(sim), gc.node(), gc.fence_timeout_ms, gc.copy_timeout_ms, sim.between)
        self.sim = sim
        self.origin = origin
        self._roll_due: set[tuple[NodeId, PartitionKey, SegmentId]] = set()

    def serving(self, key: PartitionKey) -> tuple[SimNode, PartitionLead] | None:
        """The node the metadata names leader of ``key`` and its lead, if it leads in the named epoch."""
        info = self.sim.meta.partition(*key)
        if info is None or info.leader is None:
            return None
        node = self.node(info.leader)
        lead = self.lead(node, key)
        return (node, lead) if lead is not None and lead.epoch == info.leader_epoch else None

    def _serves(self, node: SimNode, key: PartitionKey, segment_id: SegmentId) -> PartitionLead | None:
        serving = self.serving(key)
        if serving is None or serving[0] is not node:
            return None
        q = serving[1].quorum
        return serving[1] if q is not None and q.segment_id == segment_id else None

    def table_now_ms(self) -> int:
        return self.sim.local_ms(self.sim.sites[self.sim.sid()])

    # -- the chain into the leader's copy --------------------------------------------------------------

    def take_appends(self, key: PartitionKey) -> None:
        """What the broker appended to the chain goes into the leader's copy and out to the members."""
        serving = self.serving(key)
        q = serving[1].quorum if serving is not None else None
        if serving is None or q is None or not serving[1].writing:
            return
        node, lead = serving
        log = self.sim.sites[self.sim.sid()].logs[key]
        copy = node.copies.get((key[0], key[1], q.segment_id))
        start = copy.end if copy is not None else q.base_offset
        if log.log_end_offset <= start:
            return
        for h in iter_headers(log.read(LocalOffset(start), READ_ALL).data):
            b = Batch(int(h.base_offset), h.last_offset_delta + 1, self.sim.next_payload())
            if not self.append_as_leader(node, lead, b):
                return
        due = (node.id, key, q.segment_id)
        if q.appended_end - q.base_offset >= self.sim.gc.roll_records and due not in self._roll_due:
            self._roll_due.add(due)
            self.fabric.at(0, node, self._start_roll, node, key, q.segment_id)  # not in the middle of an append

    def _start_roll(self, node: SimNode, key: PartitionKey, segment_id: SegmentId) -> None:
        """Roll by size while the site serves: no more writes, seal at the LAC, open the next segment."""
        self._roll_due.discard((node.id, key, segment_id))
        lead = self._serves(node, key, segment_id)
        if lead is None or not lead.active or not self.sim.sites[self.sim.sid()].up:
            return
        self.counts.rolls_by_size += 1
        self.step(node, key, lambda ld, ctx: ld.start_roll(ctx.now_ms))

    # -- the hooks --------------------------------------------------------------------------------------

    def held_entries(self, node: SimNode, key: PartitionKey, before: SegmentId) -> list[ProducerBatch]:
        """The chain's batches that ``node``'s copies of ``key``'s segments before ``before`` hold (each copy is a
        prefix of its segment's stream: C3)."""
        info = self.sim.meta.partition(*key)
        chain = self.sim.sites[self.sim.sid()].logs[key].batch_entries()
        out: list[ProducerBatch] = []
        for seg in sorted(node.copies):
            segment = info.segment(seg[2]) if info is not None and seg[:2] == key and seg[2] < before else None
            if segment is None:
                continue
            copy = node.copies[seg]
            end = min(copy.end, int(segment.end_offset)) if segment.end_offset is not None else copy.end
            out += [e for e in chain if copy.base <= e.base_offset < end]
        return out

    def seal_command(self, node: SimNode, eff: ProposeSeal) -> SealSegment | None:
        """The seal with the chain's vector and producers' table at the end (the chain holds the writer's bytes
        there, which every copy is a prefix of)."""
        base = int(eff.segment.base_offset)
        chain = self.sim.sites[self.sim.sid()].logs[eff.key].batch_entries()
        batches: list[ProducerBatch] = [e for e in chain if base <= e.base_offset < eff.end]
        return SealSegment(
            eff.key[0],
            eff.key[1],
            eff.epoch,
            eff.segment.segment_id,
            LocalOffset(eff.end),
            self.sim.vector_at(eff.key, eff.end),
            producers=self.seal_producers(node, eff, batches),
        )

    def adopted(self, node: SimNode, eff: Adopted) -> None:
        log = self.sim.sites[self.sim.sid()].logs[eff.key]
        self.sim.fail_unless(
            log.log_end_offset == eff.base_offset,
            "C2",
            f"{eff.key} segment {eff.segment_id} opens at {eff.base_offset} but the chain ends at {log.log_end_offset}",
        )
        self.sim.maybe_serve()

    def released(self, node: SimNode, eff: Release) -> None:
        if self._serves(node, eff.key, eff.segment_id) is not None:
            self.sim.lac_advanced(eff.key, eff.end)

    def own_fsync(self, node: SimNode, key: PartitionKey, end: int) -> None:
        site = self.sim.sites[self.sim.sid()]
        serving = self.serving(key)
        if site.up and serving is not None and serving[0] is node:
            self.sim.perform_acks(site, site.acks.flush_done(key, end, VectorOffset()))

    def sealing(self, node: SimNode, eff: Sealing) -> None:
        self.sim.site_down(f"{eff.key[0]}/{eff.key[1]} rolls its segment {eff.segment_id}")

    def segment_sealed(self, node: SimNode, eff: SegmentSealed) -> None:
        """A roll's seal committed and its leader has not opened the next segment yet: maybe kill it now, so that
        the controller may name a node that holds none of the sealed segment."""
        sim = self.sim
        if (
            eff.roll
            and sim.phase == "safety"
            and all(n.up for n in self.nodes.values())
            and sim.rng.random() < sim.gc.roll_kill_p
        ):
            self.counts.roll_kills += 1
            sim.kill(node)

    def stepped_down(self, node: SimNode, eff: StepDown) -> None:
        self.sim.site_down(f"node {node.id} stepped down from {eff.key[0]}/{eff.key[1]}: {eff.reason}")


class GeoClusterSimulator(Simulator):
    """See the module docstring."""

    def __init__(
        self,
        seed: int,
        topology: str = "triangle",
        *,
        config: SimConfig | None = None,
        cluster: GeoClusterConfig | None = None,
        verbose: bool = False,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.gc = cluster or GeoClusterConfig()
        self.cluster_site: SiteId | None = None  # set below; _boot needs to know before
        super().__init__(seed, topology, config=config, verbose=verbose, log=log)
        gc = self.gc
        self.cluster_site = sid = self.rng.choice(sorted(self.sites))
        self.ccounts = ClusterCounts()
        self.gcounts = GeoClusterCounts()
        self.meta = SiteState()
        self.shells = GeoNodes(self, self.sites[sid].origin)
        for i in range(1, gc.nodes + 1):
            fsync_ms = self.between(gc.fsync_ms)  # each node's disk: different speeds open windows for recovery
            self.shells.nodes[NodeId(i)] = SimNode(NodeId(i), (fsync_ms, fsync_ms))
        self.cchecker = ClusterChecker(
            rf=gc.rf,
            aq=gc.aq,
            single_loss=True,
            session_timeout_ms=gc.session_timeout_ms,
            copies_of=lambda n: self.shells.node(n).copies,
            counts=self.ccounts,
        )
        self._calls: dict[int, Callable[[], None]] = {}
        self._call_ids = itertools.count(1)
        self._payloads = itertools.count(1)
        self._handlers["gc"] = self._on_gc
        now = self.now_ms
        for nid in sorted(self.shells.nodes):
            self.meta.apply(RegisterNode(nid, f"127.0.0.1:{7000 + nid}"))
            self.meta.apply(NodeHeartbeat(nid, now, FREE_BYTES, 0))
        for topic, partitions in self.topics.items():
            self.meta.apply(CreateTopic(TopicSpec(topic, partitions)))
        site = self.sites[sid]
        site.up = False  # it serves once every partition has a leader with an open segment
        self._boot(site)
        for producer in self.producers:  # a multi-node site's producers ask for the quorum (or more)
            if producer.site == sid and producer.acks.kind is AckKind.LEADER:
                producer.acks = Acks(AckKind.ALL)

    @property
    def nodes(self) -> dict[NodeId, SimNode]:
        return self.shells.nodes

    # -- plumbing ------------------------------------------------------------------------------------------

    def _boot(self, site: SimSite) -> None:
        super()._boot(site)
        if site.id != self.cluster_site:
            return
        for key in self.keys:  # serving again: each partition's producers as its leader builds them
            serving = self.shells.serving(key)
            q = serving[1].quorum if serving is not None else None
            if serving is not None and q is not None:
                own: list[ProducerBatch] = [e for e in site.logs[key].batch_entries() if e.base_offset >= q.base_offset]
                site.producers[key] = self.shells.producer_table(serving[0], key, q.segment_id, own)
        for key, log in sorted(site.logs.items()):  # as Broker.attach does for a ChainLog: the LAC is durable
            lac, vector = int(log.flushed_offset), VectorOffset(log.flushed_vector())
            site.acks.open_partition(
                key, self.fsync_per_batch[key[0]], lac, vector, replicated_in_site=True, lac=lac, lac_vector=vector
            )

    def later(self, delay_ms: int, fn: Callable[..., None], *args: object) -> None:
        """Run ``fn(*args)`` after ``delay_ms`` on the simulator's heap (an event named ``gc``)."""
        cid = next(self._call_ids)
        self._calls[cid] = lambda: fn(*args)
        self._after(delay_ms, "gc", cid)

    def _on_gc(self, cid: int) -> None:
        self._calls.pop(cid)()

    def between(self, bounds: tuple[int, int]) -> int:
        return self.rng.randint(*bounds)

    def next_payload(self) -> int:
        return next(self._payloads)

    def sid(self) -> SiteId:
        assert self.cluster_site is not None
        return self.cluster_site

    def _step(self) -> bool:
        stepped = super()._step()
        self.cchecker.after_event(self.meta, self.now_ms)
        return stepped

    def fail_unless(self, ok: bool, check: str, message: str) -> None:
        if not ok:
            raise InvariantViolation(f"{check} {message}")

    # -- the metadata log --------------------------------------------------------------------------------

    def commit(self, cmd: Command) -> Result:
        """Apply one command in log order, check C2/C5 on the result, and cut the chain at a committed seal."""
        topic, partition = getattr(cmd, "topic", None), getattr(cmd, "partition", None)
        before = None
        if isinstance(topic, str) and isinstance(partition, int):
            before = self.meta.partition(topic, partition)
        result = self.meta.apply(cmd)
        if isinstance(cmd, NodeHeartbeat):  # every tick of every node: no chain or epoch changes
            return result
        if self.verbose:
            self._log(f"commit {cmd} -> {result}")
        self.cchecker.committed(cmd, result, before, self.meta, self.now_ms)
        changed = isinstance(result, Applied) and result.changed
        if isinstance(cmd, ElectLeader):
            if isinstance(result, Applied):
                self.ccounts.elections += 1
            else:
                self.ccounts.elections_refused += 1
        elif isinstance(cmd, FailOver):
            if isinstance(result, Applied):
                self.ccounts.elections += result.moved
                self.ccounts.failovers += 1
            else:
                self.ccounts.elections_refused += 1
        elif isinstance(cmd, OpenSegment) and changed:
            assert isinstance(result, Applied) and result.segment_id is not None
            self.ccounts.opens += 1
            self.ccounts.opens_short += len(cmd.ensemble) < self.gc.rf
            self.cchecker.segment_opened((cmd.topic, cmd.partition, result.segment_id), self.now_ms)
        elif isinstance(cmd, SealSegment) and changed:
            self.ccounts.seals += 1
            # Every node learns the seal from the metadata (and the chain ends there), whoever proposed it.
            self._chain_sealed((cmd.topic, cmd.partition), cmd.segment_id, int(cmd.end_offset))
        return result

    def _chain_sealed(self, key: PartitionKey, segment_id: SegmentId, end: int) -> None:
        """The seal committed: members learn it and cut longer copies, and the chain ends at ``end``."""
        for nid in sorted(self.nodes):
            if self.nodes[nid].up:
                self.shells.members.learn(self.nodes[nid], self.meta)
        site = self.sites[self.sid()]
        log = site.logs[key]
        if log.log_end_offset > end:
            before = len(log.batch_entries())
            log.flush_to(end)
            log.crash()  # nothing past the seal stays in the chain: the next segment starts at ``end``
            self.ccounts.lost_batches += before - len(log.batch_entries())
            self._changed(site.id, key)
        if log.flushed_offset < end:
            log.flush_to(end)  # AQ members hold the sealed segment: the recovery copied it to them
        self.fail_unless(
            log.flushed_offset == end,
            "C4",
            f"visibility: {key[0]}/{key[1]} segment {segment_id} is sealed at {end}, below its LAC "
            f"{log.flushed_offset}: the recovery cut what the site acked and served",
        )
        self._note_durable(key)
        if site.up:  # the chain's durable end moved: its streams look at it again
            for dst, out in sorted(site.out_streams.items()):
                if key in out.source.wanted:
                    out.source.flushed(key)
                    self._pump_soon(site, dst, 0)

    def vector_at(self, key: PartitionKey, end: int) -> VectorOffset:
        """The chain's vector at ``end``: the sealed end vector the metadata records."""
        log = self.sites[self.sid()].logs[key]
        return vector_below({}, iter_headers(log.read(log.log_start_offset, READ_ALL).data), end)

    # -- the nodes: ticks, kills, restarts ---------------------------------------------------------------

    def _start(self) -> None:
        super()._start()
        for nid in sorted(self.nodes):
            node = self.nodes[nid]
            self.shells.boot(node)
            self.shells.fabric.at(self.rng.randint(1, self.gc.tick_ms), node, self._tick, node)
        self.later(self.rng.randint(self.gc.tick_ms, self.gc.kill_every_ms), self._fault_kill)  # early: runs are short

    def _tick(self, node: SimNode) -> None:
        """A node's heartbeat, then its core's tick (the controller's duties if it leads the metadata, its leads'
        retries and rolls, and the roles its view gives it)."""
        self.commit(NodeHeartbeat(node.id, self.now_ms, FREE_BYTES, leadership.open_loads(self.meta).get(node.id, 0)))
        self.shells.tick(node)
        self.shells.fabric.at(self.gc.tick_ms, node, self._tick, node)

    def _fault_kill(self) -> None:
        if self.phase != "safety":
            return
        if all(n.up for n in self.nodes.values()):  # one node down at a time
            self.kill(self.nodes[self.rng.choice(sorted(self.nodes))])
        self.later(self.rng.randint(self.gc.tick_ms, self.gc.kill_every_ms), self._fault_kill)  # early: runs are short

    def kill(self, node: SimNode) -> None:
        """A kill: the node loses what it had not fsynced and everything in memory; if it led partitions, the
        site's brokers stop until every partition has a leader again. Back after ``down_ms``."""
        self.ccounts.kills += 1
        led = sorted(node.core.leads) if node.core is not None else []
        lost = self.shells.kill(node)
        self.ccounts.lost_batches += lost
        self._log(f"kill node {node.id} of {self.sid()}: lost {lost} unfsynced batches; it led {led}")
        if led:
            self.gcounts.leader_kills += 1
            self.site_down(f"node {node.id}, leader of {len(led)} partition(s), was killed")
        for nid in sorted(self.nodes):  # their streams to it break
            if self.nodes[nid].up:
                self.shells.stream_broken(self.nodes[nid], node.id)
        self.later(self.between(self.gc.down_ms), self._restart_node, node, node.incarnation)

    def _restart_node(self, node: SimNode, incarnation: int) -> None:
        if node.up or node.incarnation != incarnation:
            return
        node.up = True
        self.ccounts.restarts += 1
        self._log(f"restart node {node.id} of {self.sid()}")
        self.shells.boot(node)
        self.shells.members.learn(node, self.meta)
        self.shells.fabric.at(self.rng.randint(1, self.gc.tick_ms), node, self._tick, node)

    # -- the chain: appends, the LAC ------------------------------------------------------------------------

    def _changed(self, sid: SiteId, *keys: PartitionKey) -> None:
        super()._changed(sid, *keys)
        if sid == self.cluster_site and self.sites[sid].up:
            for key in keys:
                self.shells.take_appends(key)

    def lac_advanced(self, key: PartitionKey, lac: int) -> None:
        """The LAC (capped at a roll's seal) is the chain's durable end (``ChainLog.advance_lac``), fed to the ack
        table."""
        site = self.sites[self.sid()]
        log = site.logs[key]
        log.flush_to(lac)
        flushed = self._note_durable(key)
        if not site.up:
            return
        self.perform_acks(site, site.acks.quorum_advanced(key, int(log.flushed_offset), VectorOffset(flushed)))
        self.consumers.flushed(site, key)
        for dst, out in sorted(site.out_streams.items()):
            if key in out.source.wanted:
                out.source.flushed(key)
                self._pump_soon(site, dst, 0)

    def _note_durable(self, key: PartitionKey) -> dict[Origin, OriginSeq]:
        """What the chain holds durably (at the LAC, or sealed) counts as held by the site for I6."""
        sid = self.sid()
        flushed = self.sites[sid].logs[key].flushed_vector()
        ever = self.ever_flushed[(sid, key)]
        for origin, n in flushed.items():
            if n > ever.get(origin, 0):
                ever[origin] = n
        return flushed

    def perform_acks(self, site: SimSite, effects: list[Effect]) -> None:
        """At the multi-node site a flush is the leader's own fsync, which every append to its copy asks for."""
        if site.id == self.cluster_site:
            effects = [e for e in effects if not isinstance(e, StartFlush)]
        super().perform_acks(site, effects)

    def _on_fsync_done(self, sid: SiteId, incarnation: int, key: PartitionKey, end: int) -> None:
        if sid != self.cluster_site:
            super()._on_fsync_done(sid, incarnation, key, end)

    # -- the site serves, or stops ------------------------------------------------------------------------

    def maybe_serve(self) -> None:
        """The site serves again once every partition has a leader writing an open segment."""
        site = self.sites[self.sid()]
        if site.up or not all((s := self.shells.serving(key)) is not None and s[1].active for key in self.keys):
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
            self.maybe_serve()  # the multi-node site serves again once its partitions have leaders
        else:
            super()._restart(sid)

    def site_down(self, why: str) -> None:
        site = self.sites[self.sid()]
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

    # -- the producers' checks ----------------------------------------------------------------------------

    def append(self, site: SimSite, key: PartitionKey, batch: bytes) -> Produced:
        try:
            return super().append(site, key, batch)
        except SequenceRejected as e:
            if site.id == self.cluster_site and isinstance(e.decision, OutOfOrderSequence):
                self.ccounts.out_of_order += 1
                self._check_out_of_order(site, key, e.decision)
            raise

    def _check_out_of_order(self, site: SimSite, key: PartitionKey, refused: OutOfOrderSequence) -> None:
        """An ``OutOfOrderSequence`` is spurious if the chain holds the producer's batches up to another sequence
        than the site's producer table expects: the leader's table missed the producer's last sequences (what a new
        leader without the seal's snapshot did)."""
        held = [
            e.base_sequence + e.last_offset_delta + 1
            for e in site.logs[key].batch_entries()
            if e.origin == site.origin and e.producer_id == refused.producer_id
        ]
        if held and not refused.new_epoch and held[-1] != refused.expected:
            raise InvariantViolation(
                f"spurious OutOfOrderSequence: {site.id} refused producer {refused.producer_id}'s "
                f"sequence {refused.got} of {key[0]}/{key[1]} expecting {refused.expected}, but "
                f"the chain holds its batches up to sequence {held[-1]}: the leader's producer "
                "table did not know its last sequences"
            )

    def _resolve(self, producer: SimProducer) -> None:
        failed = producer.failed_batches
        super()._resolve(producer)
        if producer.site == self.cluster_site and producer.failed_batches > failed:
            raise InvariantViolation(
                f"{producer.name}: {producer.failed_batches - failed} batch(es) failed to the "
                "application at the multi-node site when the producer's round of resends "
                "resolved (OutOfOrderSequence with nothing wrong before it: the leader's "
                "producer table did not know the producer's last sequences)"
            )

    def _on_produce_answer(
        self, pi: int, incarnation: int, correlation: int, produced: Produced | None, error: Exception | None
    ) -> None:
        producer = self.producers[pi]
        failed = producer.failed_batches
        super()._on_produce_answer(pi, incarnation, correlation, produced, error)
        if (
            producer.site == self.cluster_site
            and producer.failed_batches > failed
            and not isinstance(error, GeoAckTimeout)
        ):
            raise InvariantViolation(
                f"{producer.name}: a batch failed to the application at the multi-node site: "
                f"{type(error).__name__}: {error}"
            )

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
            holders = {
                sid: s.rebuilds
                for sid, s in sorted(self.sites.items())
                if s.logs[key].flushed_vector().get(origin, 0) > seq
            }
            self.acked.append(AckedWrite(key, origin, seq, holders, str(producer.acks)))
        offset = int(produced.result.base_offset)
        info = self.meta.partition(*key)
        assert info is not None
        segment = next(
            (s for s in info.segments if s.base_offset <= offset and (s.end_offset is None or offset < s.end_offset)),
            None,
        )
        serving = self.shells.serving(key)
        stream = self.cchecker.streams.get((key[0], key[1], segment.segment_id), []) if segment else []
        i = bisect.bisect_left(stream, offset, key=lambda b: b.offset)
        if segment is None or serving is None or i >= len(stream) or stream[i].offset != offset:
            raise InvariantViolation(
                f"C1 {producer.name} was acked at offset {offset} of {key[0]}/{key[1]}, "
                "which no segment's writer stream holds"
            )
        self.gcounts.acks_all_released += 1
        self.ccounts.acked_short += len(segment.ensemble) < self.gc.rf  # writes went on with a node down
        self.gcounts.geo_acks_released += producer.acks.kind is AckKind.GEO
        self.cchecker.released(
            AckedBatch(key, segment.segment_id, stream[i], self.now_ms, serving[0].id, serving[1].epoch),
            self.meta,
            self.now_ms,
        )

    def _failure(self, message: str) -> SimulationFailure:
        steps = "" if self.config.steps == GEO_CLUSTER_STEPS else f" --steps {self.config.steps}"
        replay = f"python -m georep.sim --geo-cluster --seed {self.seed} --topology {self.topology_name}{steps}"
        return SimulationFailure(
            f"{message}\n  multi-node site: {self.sid()} ({self.gc.nodes} nodes, RF "
            f"{self.gc.rf}, min_insync_replicas {self.gc.aq})",
            self.seed,
            self.topology_name,
            replay,
        )

    # -- liveness --------------------------------------------------------------------------------------------

    def _run_liveness(self) -> None:
        for nid in sorted(self.nodes):
            node = self.nodes[nid]
            if not node.up:
                self._restart_node(node, node.incarnation)
        super()._run_liveness()

    def _in_site_problems(self) -> list[str]:
        """After healing, the site serves and every member of every open segment holds all its leader appended."""
        if not self.sites[self.sid()].up:
            return [f"the multi-node site {self.sid()} does not serve: partitions without an active leader"]
        out = []
        for key in self.keys:
            serving = self.shells.serving(key)
            q = serving[1].quorum if serving is not None else None
            if q is None:
                out.append(f"{key[0]}/{key[1]} has no leader writing an open segment")
                continue
            behind = [n for n in q.ensemble if q.member_end(n) < q.appended_end]
            if behind:
                out.append(
                    f"{key[0]}/{key[1]} segment {q.segment_id}: nodes {behind} do not hold up to "
                    f"{q.appended_end} fsynced (LAC {q.lac})"
                )
        return out

    def _live(self, logs: Mapping[str, Mapping[PartitionKey, MemoryLog]]) -> bool:
        return not self._in_site_problems() and super()._live(logs)

    def _liveness_problems(self, logs: Mapping[str, Mapping[PartitionKey, MemoryLog]]) -> list[str]:
        return self._in_site_problems() or super()._liveness_problems(logs)


def run_geo_cluster_seed(
    seed: int, topology: str = "triangle", *, steps: int = GEO_CLUSTER_STEPS, verbose: bool = False
) -> tuple[SimResult, ClusterCounts, GeoClusterCounts]:
    """One run, as ``python -m georep.sim --geo-cluster --seed SEED --topology NAME --steps STEPS`` does it."""
    sim = GeoClusterSimulator(seed, topology, config=SimConfig(steps=steps), verbose=verbose)
    result = sim.run()
    return result, sim.ccounts, sim.gcounts


__all__ = [
    "GEO_CLUSTER_STEPS",
    "GEO_CLUSTER_TOPOLOGIES",
    "GeoClusterConfig",
    "GeoClusterCounts",
    "GeoClusterSimulator",
    "START_MS",
    "run_geo_cluster_seed",
]
