"""A deterministic simulator of one site's segment cluster (STYLE.md §2: FoundationDB's Sim2, TigerBeetle's VOPR).

``ClusterSimulator(seed, shape)`` runs the nodes of one site in one thread, with virtual time and a heap
of ``(due_ms, seq, action)``: it jumps time to the next event. The only randomness is one
``random.Random(seed)``; iteration is over sorted keys only; there is no clock. One seed gives one run,
and :attr:`ClusterResult.trace` (a hash of the metadata log and of every ack) proves it.

**The simulator holds no decision of the protocol.** It is the shell around the pure core
(ARCHITECTURE.md, "Inside a site: the segment cluster"), carrying each effect out over a simulated
network, disk and Raft log:

=============================================  ===========================================================
decision                                       pure code, driven here by
=============================================  ===========================================================
metadata, compare-and-set on epochs, chain     ``SiteState.apply``: every command, in one order (the log)
who leads which partition                      ``plan_leadership``: the controller's tick
lead, recover first, step down, or ask again   ``role_step``: every node, at every view of the metadata
which segment a leader writes next             ``plan_open``: a leader after its recovery or roll
which nodes hold a new segment, how many       ``choose_ensemble`` (via ``plan_open``), over ``node_loads``:
                                               RF nodes, or every live one down to the ack quorum
where a roll seals                             ``roll_seal_at``: a rolling leader, every tick
the LAC, when ``acks=all`` goes                ``SegmentQuorum``: every fsync of every member
fencing, contiguity, sealed segments           ``ReplicaGuard``: every append, fence and copy a member gets
recovering an open segment                     ``SegmentRecovery``: a new leader (Fence, Copy, Seal effects)
what a member cuts after a seal                ``cut_after_seal``: every node, once it learns the seal
what to repair, widen or fill, from/to where   ``plan_repair``: the controller, periodically
=============================================  ===========================================================

What the simulator adds is the shell's plumbing, as a node would do it: a leader appends, streams
each batch to the other members over per-pair FIFO links, resends from a member's end after a gap or
a reconnection, rolls its segment by size (stop appending, seal at the LAC, open the next one), and
dedups a retried batch by its payload id (the producer state a node keeps per segment, as Kafka's
producer snapshots; here the sealed segments' payloads and the open segment's). A node that restarts
and finds itself leader of an epoch granted before its restart asks for a new epoch (a restarted
leader must fence its old self); so does a leader whose recovery was superseded while the metadata
still names it. Members report the sealed segments they hold less of than the sealed end (a member
that was down when its segment was rolled at the LAC, or that missed the recovery), and the controller
passes them to the planner (``SegmentView.short``), which fills them (``FillSegment``). A rolling leader
releases no ack past the LAC it proposed to seal at, even if later acks raise the LAC. While fewer than
RF nodes are live, a leader opens its next segment on those that are, down to the ack quorum (Kafka's
``min_insync_replicas``); once more are, the controller rolls such a segment if it is open and has it
copied to more nodes until it has RF members if it is sealed (``AddMember``).

**The model.** Metadata is one :class:`~cluster.site_state.SiteState`, the Raft log's contract: each
proposal commits after a few ms in one order, unless a majority of the voters (the first nodes) is down
or paused (it waits), or a metadata outage drops it (lost) or stalls it past the proposer's timeout (it
commits anyway: the proposer cannot tell). Nodes act on a view of the metadata that lags the log; the
controller is the lowest-numbered running voter that reaches the metadata. A node's disk holds, per
segment, a list of ``(offset, records, payload)`` batches and an fsynced prefix, and the persisted state
of each :class:`~cluster.quorum.ReplicaGuard`; a kill loses the unfsynced suffix and everything in
memory. Producers send batches (``acks=all``) to the leader they last read from the metadata (a client's
cache, refreshed after an error or a timeout) and retry; a reader reads any member up to the LAC its
leader reports, or up to the sealed end.

**Faults**, drawn from the seed (``cluster_model.shape_config``): node kills and restarts, pauses (a
paused node is silent, then resumes with its stale view: a zombie leader or controller), isolation
from the metadata (a node's proposals are lost and its view freezes while its peers still hear it: a
leader the site has replaced keeps writing), stream cuts (what is in flight on a pair of links is lost,
and the sender notices), partitions between two nodes, metadata outages, and the loss of the metadata
majority. A node joins mid-run in expansion runs.

**The checks** (``cluster_checks.py``, C1 to C6) run after every event. A run has two phases, as in
VOPR: safety (the workload and the faults), then liveness (heal every fault, restart every node, stop
new batches, run until every partition has a leader, every batch is acked, the chain holds every acked
batch once at its offset, no segment is under-replicated, none has fewer than RF members while RF nodes
are live, and an added node holds new segments, or fail after ``liveness_ms``). A failure raises
:class:`ClusterSimulationFailure`, whose message holds the seed and the command that replays it
(``python -m georep.sim --cluster --seed N --shape NAME``).
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import random
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import grpc

import cluster.leadership as leadership
import cluster.placement as placement
import cluster.producer_snapshot as producer_snapshot
import cluster.recovery as recovery
import cluster.repair as repair
import cluster.site_state as site_state
from cluster.producer_snapshot import ProducerEntry, ProducerSnapshot
from cluster.quorum import (
    Fenced,
    GuardState,
    LacAdvanced,
    NotContiguous,
    QuorumEffect,
    QuorumError,
    QuorumLost,
    ReplicaGuard,
    SegmentQuorum,
    SegmentSealed,
)
from cluster.recovery import Copy, Done, Failed, Fence, InvalidRecoveryEvent, Seal, SegmentRecovery, Superseded
from cluster.site_state import (
    AddMember,
    Applied,
    Command,
    CreateTopic,
    ElectLeader,
    NodeHeartbeat,
    OpenSegment,
    PartitionInfo,
    RefusalCode,
    Refused,
    RegisterNode,
    ReplaceMember,
    Result,
    SealSegment,
    SegmentInfo,
    SiteState,
)
from dedup.producer import Append, AppendResult, Duplicate, ProducerStateTable
from georep.broker.errors import NotLeader, SequenceRejected
from georep.client.accumulator import ProducerBatch
from georep.client.delivery import PartitionDelivery
from georep.client.errors import Operation, from_status
from georep.metadata.topics import MAX_BATCH_BYTES_LIMIT, TopicSpec
from georep.record.batch import RecordInput
from georep.server.status import reason_of, status_of
from georep.sim.checker import InvariantViolation
from georep.sim.cluster_checks import ALL_CHECKS, AckedBatch, ClusterChecker
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


# -- the simulated nodes -------------------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class PendingAck:
    """An answer a leader owes: to producer ``producer``'s request ``correlation`` on its connection ``conn``."""

    producer: int
    conn: int
    correlation: int
    batch: Batch


@dataclass(eq=False)
class Leadership:
    """What a node keeps in memory while it leads a partition in one epoch."""

    key: PartKey
    epoch: LeaderEpoch
    phase: str = "new"  # recovering, opening, active, rolling, done
    busy: bool = False  # a proposal is in flight
    retry_at: int = 0
    previous: tuple[NodeId, ...] = ()  # the ensemble of the segment before the next one
    # recovery of the predecessor's open segment
    recovery: SegmentRecovery | None = None
    attempt: int = 0
    answered: set[NodeId] = field(default_factory=set)
    copy_ids: dict[NodeId, int] = field(default_factory=dict)
    recovering: SegmentInfo | None = None
    seal_cmd: SealSegment | None = None
    # the open segment this leader writes
    quorum: SegmentQuorum | None = None
    next_send: dict[NodeId, int] = field(default_factory=dict)
    failed_at: dict[NodeId, int] = field(default_factory=dict)
    pending: list[PendingAck] = field(default_factory=list)
    producers: ProducerStateTable = field(default_factory=ProducerStateTable)  # rebuilt when a segment opens
    roll_since: int | None = None
    next_segment: int = 0  # this leader sealed the segments before it: a view showing one of them open lags
    release_limit: int | None = None  # once a roll's seal is proposed at the LAC, nothing past it is released


@dataclass(eq=False)
class ControllerState:
    """The controller's memory (lost when it crashes or another node takes over)."""

    down_since: dict[NodeId, int] = field(default_factory=dict)
    in_progress: dict[int, tuple[repair.CopySegment | repair.FillSegment, int]] = field(default_factory=dict)
    short: dict[NodeId, set[SegKey]] = field(default_factory=dict)  # what each member last reported short
    electing: dict[PartKey, LeaderEpoch] = field(default_factory=dict)
    next_repair_ms: int = 0
    roll_asked: dict[SegKey, int] = field(default_factory=dict)
    since_ms: int = 0  # when this node became the controller (plan_leadership waits a session from then)


@dataclass(eq=False)
class SimNode:
    id: NodeId
    voter: bool
    base_used_bytes: int
    joined_ms: int
    up: bool = True
    incarnation: int = 1
    paused_until: int = 0
    isolated_until: int = 0  # cut off from the metadata majority: proposals lost, view frozen; peers reachable
    down_since: int | None = None
    boot_index: int = 0  # the log length when this incarnation started
    copies: dict[SegKey, SegCopy] = field(default_factory=dict)  # the disk
    guard_disk: dict[PartKey, GuardState] = field(default_factory=dict)  # the disk
    guards: dict[PartKey, ReplicaGuard] = field(default_factory=dict)
    view: SiteState = field(default_factory=SiteState)
    view_index: int = 0
    view_due: bool = False
    leads: dict[PartKey, Leadership] = field(default_factory=dict)
    done_epoch: dict[PartKey, LeaderEpoch] = field(default_factory=dict)
    reelect_asked: dict[PartKey, LeaderEpoch] = field(default_factory=dict)
    unsynced: set[SegKey] = field(default_factory=set)
    fsync_due: bool = False
    after_fsync: list[Callable[[], None]] = field(default_factory=list)
    writer_of: dict[SegKey, tuple[NodeId, int]] = field(default_factory=dict)
    gap_reported: dict[SegKey, int] = field(default_factory=dict)
    cut_done: set[SegKey] = field(default_factory=set)
    controller: ControllerState | None = None


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
    conn: int = 0  # its connection: a new one after a timeout or an error; answers on an older one are dropped
    conn_due: int = 0  # requests on the connection arrive in order
    next_correlation: int = 0
    in_flight: dict[int, ProducerBatch] = field(default_factory=dict)  # correlation id -> batch
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


class ClusterSimulator:
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
        self.nodes: dict[NodeId, SimNode] = {}
        self.links: dict[tuple[NodeId, NodeId], Link] = {}
        self.meta = SiteState()
        self.log: list[Command] = []
        self.elect_index: dict[tuple[PartKey, LeaderEpoch], int] = {}
        self.last_hb_sent: dict[NodeId, int | None] = {}
        # Checker bookkeeping, never read by a decision: which payloads the sealed segments hold (exactly once).
        self.sealed_payloads: dict[PartKey, dict[int, int]] = {k: {} for k in self.keys}
        self.meta_outage_until = 0
        self.phase = "safety"
        self.added: NodeId | None = None
        self.expansion_placed = False
        self._heap: list[tuple[int, int, int, int, Action, tuple[object, ...]]] = []
        self._seq = 0
        self._pid = 0
        self._ids = 0
        self._events = 0
        self._trace = hashlib.sha256()
        self._liveness_start = START_MS
        self.checker = ClusterChecker(rf=self.cfg.rf, aq=self.cfg.aq, single_loss=self.cfg.single_loss,
                                      session_timeout_ms=self.cfg.session_timeout_ms, copies_of=self._copies_of,
                                      counts=self.counts, enabled=checks)  # fmt: skip
        for i in range(1, self.cfg.nodes + 1):
            self._new_node(NodeId(i), voter=True, used=self.rng.randint(60, 120) * GIB)
        self.producers = [
            SimProducer(i, key, PartitionDelivery(key[0], key[1], i + 1, self.cfg.max_in_flight),
                        (i + 1) * PAYLOADS_PER_PRODUCER) for i, key in enumerate(self.keys)
        ]  # fmt: skip
        self._producer_ids = len(self.producers) + 1
        for n in sorted(self.nodes):
            self._commit(RegisterNode(NodeId(n), f"10.0.0.{n}:9092"))
            self._commit(NodeHeartbeat(NodeId(n), self.now_ms, self._free_bytes(self.nodes[n]), 0))
            self.last_hb_sent[NodeId(n)] = self.now_ms
        for name, partitions in self.cfg.topics:
            self._commit(CreateTopic(TopicSpec(name, partitions)))

    # -- plumbing ---------------------------------------------------------------------------------------------

    def _copies_of(self, node: NodeId) -> dict[SegKey, SegCopy]:
        n = self.nodes.get(node)
        return n.copies if n is not None else {}

    def _new_node(self, nid: NodeId, *, voter: bool, used: int) -> SimNode:
        node = SimNode(nid, voter, used, self.now_ms)
        for other in sorted(self.nodes):
            self.links[(nid, other)] = Link()
            self.links[(other, nid)] = Link()
        self.nodes[nid] = node
        self.last_hb_sent.setdefault(nid, None)
        return node

    def _at(self, delay_ms: int, node: SimNode | None, fn: Action, *args: object) -> None:
        """Run ``fn(*args)`` after ``delay_ms``; on ``node``, only if this incarnation is still up then."""
        self._seq += 1
        nid, inc = (node.id, node.incarnation) if node is not None else (0, 0)
        heapq.heappush(self._heap, (self.now_ms + max(0, delay_ms), self._seq, nid, inc, fn, args))

    def _between(self, bounds: tuple[int, int]) -> int:
        return self.rng.randint(bounds[0], bounds[1])

    def _interval(self, mean_ms: int) -> int:
        return self.rng.randint(mean_ms // 2, mean_ms * 3 // 2)

    def _log(self, line: str) -> None:
        if self.verbose:
            self._print(f"{self.now_ms - START_MS} {line}")

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

    def _send(self, src: SimNode, dst: NodeId, fn: Action, *args: object) -> None:
        """A message from ``src`` to ``dst`` over their FIFO link (to itself: at once)."""
        target = self.nodes[dst]
        if dst == src.id:
            self._at(0, target, fn, target, *args)
            return
        link = self.links[(src.id, dst)]
        if link.down_until > self.now_ms or not target.up:  # no connection: the sender notices, as TCP would
            self.counts.dropped_messages += 1
            self._at(self.cfg.detect_ms, src, self._stream_broken, src, dst)
            return
        due = max(self.now_ms + self._between(self.cfg.latency_ms), link.last_due)
        link.last_due = due
        self._at(due - self.now_ms, target, self._deliver, link, link.gen, fn, (target, *args))

    def _deliver(self, link: Link, gen: int, fn: Action, args: tuple[object, ...]) -> None:
        if link.gen != gen or link.down_until > self.now_ms:
            self.counts.dropped_messages += 1
            return
        fn(*args)

    def _to_node(self, dst: NodeId, fn: Action, *args: object) -> None:
        """A client's request to node ``dst`` (lost if the node is down when it arrives)."""
        target = self.nodes[dst]
        self._at(self._between(self.cfg.latency_ms), target, fn, target, *args)

    def _to_client(self, fn: Action, *args: object) -> None:
        self._at(self._between(self.cfg.latency_ms), None, fn, *args)

    def _guard(self, node: SimNode, key: PartKey) -> ReplicaGuard:
        guard = node.guards.get(key)
        if guard is None:
            guard = node.guards[key] = ReplicaGuard(node.guard_disk.get(key))
        return guard

    def _persist(self, node: SimNode, key: PartKey) -> None:
        """The guard's state goes to disk before the node answers (ReplicaGuard's docstring)."""
        state = self._guard(node, key).state
        node.guard_disk[key] = state
        self.checker.fence_state(node.id, key, state.fenced_epoch)

    def _core_error(self, where: str, e: Exception) -> None:
        raise InvariantViolation(f"CORE: the pure core refused an event the shell sent ({where}): "
                                 f"{type(e).__name__}: {e}")

    # -- metadata: the Raft log -------------------------------------------------------------------------------

    def _majority(self) -> bool:
        voters = [n for n in self.nodes.values() if n.voter]
        live = [n for n in voters if self._running(n) and n.isolated_until <= self.now_ms]
        return 2 * len(live) > len(voters)

    def _running(self, node: SimNode) -> bool:
        return node.up and node.paused_until <= self.now_ms

    def _propose(self, node: SimNode, cmd: Command, then: Callable[[Result | None], None] | None = None) -> None:
        self._pid += 1
        prop = Proposal(self._pid, cmd, node.id, node.incarnation, then, self.now_ms)
        delay = self._between(self.cfg.raft_ms)
        if node.isolated_until > self.now_ms:  # it cannot reach the Raft majority: the proposal goes nowhere
            self.counts.proposals_lost += 1
            self._at(self.cfg.proposal_timeout_ms, node, self._proposal_timeout, node, prop)
            return
        if self.meta_outage_until > self.now_ms:
            if self.rng.random() < 0.5:  # the Raft leader changed before the entry was replicated: dropped
                self._at(self.cfg.proposal_timeout_ms, node, self._proposal_timeout, node, prop)
                return
            delay += self.meta_outage_until - self.now_ms + self.rng.randint(0, 40)  # stalled
        self._at(delay, None, self._raft_commit, prop)
        self._at(self.cfg.proposal_timeout_ms, node, self._proposal_timeout, node, prop)

    def _proposal_timeout(self, node: SimNode, prop: Proposal) -> None:
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
            self._at(self.rng.randint(20, 60), None, self._raft_commit, prop)
            return
        result = self._commit(prop.cmd)
        if prop.resolved:
            self.counts.proposals_late += 1
            return
        prop.resolved = True
        node = self.nodes[prop.node]
        if prop.then is not None and node.up and node.incarnation == prop.incarnation:
            self._at(1, node, prop.then, result)

    def _commit(self, cmd: Command) -> Result:
        """Apply one command to the log's state machine, in log order, and check C2/C5 on the result."""
        topic = getattr(cmd, "topic", None)
        partition = getattr(cmd, "partition", None)
        before: PartitionInfo | None = None
        if isinstance(topic, str) and isinstance(partition, int):
            before = self.meta.partition(topic, partition)
        result = self.meta.apply(cmd)
        self.log.append(cmd)
        if not isinstance(cmd, NodeHeartbeat):
            self._trace.update(f"{len(self.log)} {cmd.to_dict()} {type(result).__name__}".encode())
            self._log(f"commit {cmd} -> {result}")
        self.checker.committed(cmd, result, before, self.meta, self.now_ms)
        if isinstance(cmd, ElectLeader):
            if isinstance(result, Applied):
                self.counts.elections += 1
                assert result.leader_epoch is not None
                self.elect_index[((cmd.topic, cmd.partition), result.leader_epoch)] = len(self.log)
            else:
                self.counts.elections_refused += 1
        elif isinstance(cmd, OpenSegment) and isinstance(result, Applied) and result.changed:
            assert result.segment_id is not None
            self.counts.opens += 1
            if len(cmd.ensemble) < self.cfg.rf:
                self.counts.opens_short += 1
            self.checker.segment_opened((cmd.topic, cmd.partition, result.segment_id), self.now_ms)
        elif isinstance(cmd, SealSegment) and isinstance(result, Applied) and result.changed:
            self.counts.seals += 1
            table = self.sealed_payloads[(cmd.topic, cmd.partition)]
            for b in self.checker.streams.get((cmd.topic, cmd.partition, cmd.segment_id), []):
                if b.end <= cmd.end_offset:
                    table[b.payload] = b.offset
        elif isinstance(cmd, ReplaceMember) and isinstance(result, Applied) and result.changed:
            self.counts.members_replaced += 1
            self.checker.touched((cmd.topic, cmd.partition, cmd.segment_id))
        elif isinstance(cmd, AddMember) and isinstance(result, Applied) and result.changed:
            self.counts.members_added += 1
            self.checker.touched((cmd.topic, cmd.partition, cmd.segment_id))
        if not isinstance(cmd, NodeHeartbeat):
            for nid in sorted(self.nodes):
                node = self.nodes[nid]
                if node.up and not node.view_due:
                    node.view_due = True
                    self._at(self._between(self.cfg.view_lag_ms), node, self._refresh_view, node)
        return result

    # -- a node's view of the metadata --------------------------------------------------------------------

    def _refresh_view(self, node: SimNode) -> None:
        node.view_due = False
        if node.isolated_until > self.now_ms:
            return  # it cannot read the log: it acts on what it last knew
        node.view = self.meta.copy()
        node.view_index = len(self.log)
        self._learn_seals(node)
        self._reconcile(node)

    def _learn_seals(self, node: SimNode) -> None:
        """Members learn committed seals: the guard refuses the segment from now on, and a longer copy is cut."""
        view = node.view
        for info in view.partitions():
            key = (info.topic, info.partition)
            last_sealed = next((s for s in reversed(info.segments) if s.sealed), None)
            if last_sealed is None:
                continue
            guard = self._guard(node, key)
            through = guard.state.sealed_through
            if through is None or through < last_sealed.segment_id:
                guard.seal(LeaderEpoch(max(info.leader_epoch, guard.fenced_epoch)), last_sealed.segment_id)
                self._persist(node, key)
        for seg in sorted(node.copies):
            if seg in node.cut_done:
                continue
            pinfo = view.partition(seg[0], seg[1])
            segment = pinfo.segment(seg[2]) if pinfo is not None else None
            if segment is None or not segment.sealed:
                continue
            assert segment.end_offset is not None
            node.cut_done.add(seg)
            copy = node.copies[seg]
            cut = recovery.cut_after_seal(copy.end, int(segment.end_offset))
            if cut is not None:
                self._cut(node, seg, copy, int(cut))
            if copy.end > segment.end_offset:
                self.checker.fail("C3", f"prefix: node {node.id} knows {seg[0]}/{seg[1]} segment {seg[2]} is sealed "
                                        f"at {segment.end_offset} but its copy still ends at {copy.end}")  # fmt: skip

    def _cut(self, node: SimNode, seg: SegKey, copy: SegCopy, end: int) -> None:
        i = copy.index_at(end)
        if i < 0:
            self.checker.fail("C3", f"prefix: node {node.id} must cut {seg[0]}/{seg[1]} segment {seg[2]} at {end}, "
                                    "which is not a batch boundary of its copy")  # fmt: skip
            return
        self.counts.tail_cuts += 1
        self._log(f"node {node.id} cuts {seg} from {copy.end} to {end}")
        del copy.batches[i:]
        copy.fsynced = min(copy.fsynced, i)
        self.checker.touched(seg)

    def _reconcile(self, node: SimNode) -> None:
        """Start or stop leading each partition as the node's view says (``role_step``)."""
        for info in node.view.partitions():
            key = (info.topic, info.partition)
            while True:
                lead = node.leads.get(key)
                fresh = self.elect_index.get((key, info.leader_epoch), 0) > node.boot_index
                step = leadership.role_step(info, node.id, lead.epoch if lead is not None else None,
                                            node.done_epoch.get(key, LeaderEpoch(0)), fresh)  # fmt: skip
                if isinstance(step, leadership.StepDown) and lead is not None:
                    self._step_down(node, lead, "deposed")
                    continue  # it may be named again, in a newer epoch
                break
            if isinstance(step, leadership.AskEpoch):
                epoch = info.leader_epoch
                if node.reelect_asked.get(key) != epoch:
                    node.reelect_asked[key] = epoch
                    self.counts.reelections += 1
                    self._propose(node, step.command, self._reelect_done(node, key, epoch))
            elif isinstance(step, leadership.Lead):
                lead = node.leads[key] = Leadership(key, step.epoch)
                self._log(f"node {node.id} leads {key} in epoch {step.epoch}")
                if step.recover is not None:
                    lead.phase = "recovering"
                    self._start_recovery(node, lead)
                else:
                    lead.phase = "opening"
                    lead.previous = info.segments[-1].ensemble if info.segments else ()
                    self._try_open(node, lead)

    def _reelect_done(self, node: SimNode, key: PartKey, epoch: LeaderEpoch) -> Callable[[Result | None], None]:
        def done(result: Result | None) -> None:
            if result is None and node.reelect_asked.get(key) == epoch:
                del node.reelect_asked[key]  # lost: ask again at the next look at the view

        return done

    def _step_down(self, node: SimNode, lead: Leadership, why: str) -> None:
        self.counts.step_downs += 1
        self._log(f"node {node.id} steps down from {lead.key} epoch {lead.epoch}: {why}")
        lead.phase = "done"
        self._refuse_pending(node, lead, f"node {node.id} no longer leads epoch {lead.epoch}")
        node.leads.pop(lead.key, None)
        node.done_epoch[lead.key] = max(node.done_epoch.get(lead.key, LeaderEpoch(0)), lead.epoch)

    # -- node lifecycle: ticks, heartbeats, the controller --------------------------------------------------

    def _free_bytes(self, node: SimNode) -> int:
        held = sum(c.end - c.base for c in node.copies.values())
        return max(0, self.cfg.capacity_bytes - node.base_used_bytes - held * self.cfg.record_bytes)

    def _node_loads(self, node: SimNode) -> list[placement.NodeLoad]:
        return leadership.node_loads(node.view, self.now_ms, self.cfg.session_timeout_ms)

    def _tick(self, node: SimNode) -> None:
        if node.controller is not None:
            self._controller_duties(node, node.controller)  # with the view it has: stale after a pause
        self._report_short(node)
        load = leadership.open_loads(node.view).get(node.id, 0)
        self.last_hb_sent[node.id] = self.now_ms
        self._propose(node, NodeHeartbeat(node.id, self.now_ms, self._free_bytes(node), load))
        self._refresh_view(node)
        desired = self._desired_controller()
        if node.controller is not None and desired != node.id:
            node.controller = None
        elif node.controller is None and desired == node.id and not self._other_controller(node):
            node.controller = ControllerState(next_repair_ms=self.now_ms + self.cfg.repair_every_ms,
                                              since_ms=self.now_ms)  # fmt: skip
            self._log(f"node {node.id} is the controller")
        for key in sorted(node.leads):
            lead = node.leads.get(key)
            if lead is not None:
                self._maintain(node, lead)
        self._at(self.cfg.tick_ms, node, self._tick, node)

    def _report_short(self, node: SimNode) -> None:
        """Tell the controller which sealed segments this member holds less of than the sealed end."""
        short: list[SegKey] = []
        for info in node.view.partitions():
            for seg_info in info.segments:
                if not seg_info.sealed or node.id not in seg_info.ensemble:
                    continue
                assert seg_info.end_offset is not None
                seg = (info.topic, info.partition, seg_info.segment_id)
                copy = node.copies.get(seg)
                if (copy.fsynced_end if copy is not None else seg_info.base_offset) < seg_info.end_offset:
                    short.append(seg)
        controller = self._desired_controller()
        if controller is not None:
            self._send(node, controller, self._on_short_report, node.id, tuple(short))

    def _on_short_report(self, node: SimNode, member: NodeId, short: tuple[SegKey, ...]) -> None:
        if node.controller is not None:
            node.controller.short[member] = set(short)

    def _desired_controller(self) -> NodeId | None:
        for nid in sorted(self.nodes):
            n = self.nodes[nid]
            if n.voter and self._running(n) and n.isolated_until <= self.now_ms:
                return nid
        return None

    def _other_controller(self, node: SimNode) -> bool:
        return any(n.controller is not None and self._running(n) and n.isolated_until <= self.now_ms
                   for nid, n in sorted(self.nodes.items()) if nid != node.id)  # fmt: skip

    def _controller_duties(self, node: SimNode, ctl: ControllerState) -> None:
        plan = site_state.plan_leadership(node.view, self.now_ms, self.cfg.session_timeout_ms, ctl.since_ms,
                                          settle_ms=2 * self.cfg.tick_ms, controller=node.id)  # fmt: skip
        for elect in plan:
            key = (elect.topic, elect.partition)
            if ctl.electing.get(key) == elect.expected_epoch:
                continue
            ctl.electing[key] = elect.expected_epoch
            self._propose(node, elect, self._elect_done(ctl, key, elect.expected_epoch))
        if self.now_ms >= ctl.next_repair_ms:
            ctl.next_repair_ms = self.now_ms + self.cfg.repair_every_ms
            self._repair_pass(node, ctl)

    def _elect_done(self, ctl: ControllerState, key: PartKey,
                    expected: LeaderEpoch) -> Callable[[Result | None], None]:  # fmt: skip
        def done(result: Result | None) -> None:
            if ctl.electing.get(key) == expected:
                del ctl.electing[key]

        return done

    # -- repair ----------------------------------------------------------------------------------------------

    def _repair_pass(self, node: SimNode, ctl: ControllerState) -> None:
        loads = self._node_loads(node)
        for n in loads:
            if n.alive:
                ctl.down_since.pop(n.node, None)
            else:
                ctl.down_since.setdefault(n.node, self.now_ms)
        segments = [
            repair.SegmentView(info.topic, info.partition, s.segment_id, s.ensemble, s.sealed,
                               (int(s.end_offset) - int(s.base_offset)) * self.cfg.record_bytes
                               if s.end_offset is not None else 0,
                               tuple(m for m in s.ensemble
                                     if (info.topic, info.partition, s.segment_id) in ctl.short.get(m, ())))
            for info in node.view.partitions() for s in info.segments
        ]  # fmt: skip
        running = [ctl.in_progress[cid][0] for cid in sorted(ctl.in_progress)]
        plan = repair.plan_repair(segments, loads, down_since_ms=dict(sorted(ctl.down_since.items())),
                                  now_ms=self.now_ms, repair_delay_ms=self.cfg.repair_delay_ms, in_progress=running,
                                  max_concurrent_copies=self.cfg.max_concurrent_copies,
                                  replication_factor=self.cfg.rf)  # fmt: skip
        for c in plan.copies:
            seg = (c.topic, c.partition, c.segment_id)
            self.checker.repair_planned(seg, c.source, c.target, node.view, adds=c.replaces is None)
            self.checker.placed(f"repair of {seg} (source, target)", (c.source, c.target), self.last_hb_sent,
                                self.now_ms)  # fmt: skip
            self._ids += 1
            cid = self._ids
            ctl.in_progress[cid] = (c, self.now_ms)
            self.counts.repair_copies += 1
            info = node.view.partition(c.topic, c.partition)
            segment = info.segment(c.segment_id) if info is not None else None
            assert segment is not None and segment.end_offset is not None
            self._log(f"controller {node.id}: {c.message()}")
            self._send(node, c.source, self._on_repair_req, seg, int(segment.base_offset), int(segment.end_offset),
                       c.target, node.id, cid)  # fmt: skip
            self._at(self.cfg.copy_timeout_ms * 4, node, self._repair_timeout, node, ctl, cid)
        for f in plan.fills:
            seg = (f.topic, f.partition, f.segment_id)
            self.checker.repair_planned(seg, f.source, f.target, node.view, fill=True)
            self.checker.placed(f"fill of {seg} (source, target)", (f.source, f.target), self.last_hb_sent,
                                self.now_ms)  # fmt: skip
            self._ids += 1
            cid = self._ids
            ctl.in_progress[cid] = (f, self.now_ms)
            self.counts.fills += 1
            info = node.view.partition(f.topic, f.partition)
            segment = info.segment(f.segment_id) if info is not None else None
            assert segment is not None and segment.end_offset is not None
            self._log(f"controller {node.id}: {f.message()}")
            self._send(node, f.source, self._on_repair_req, seg, int(segment.base_offset), int(segment.end_offset),
                       f.target, node.id, cid)  # fmt: skip
            self._at(self.cfg.copy_timeout_ms * 4, node, self._repair_timeout, node, ctl, cid)
        for r in plan.rolls:
            seg = (r.topic, r.partition, r.segment_id)
            info = node.view.partition(r.topic, r.partition)
            leader = info.leader if info is not None else None
            if leader is None or leader == r.dead or ctl.roll_asked.get(seg, -10**9) + 500 > self.now_ms:
                continue
            ctl.roll_asked[seg] = self.now_ms
            if r.dead is None:
                self.counts.rolls_to_widen += 1
            self._send(node, leader, self._on_roll_req, (r.topic, r.partition), r.segment_id)

    def _repair_timeout(self, node: SimNode, ctl: ControllerState, cid: int) -> None:
        entry = ctl.in_progress.pop(cid, None)
        if entry is not None:
            self._repair_failed(entry[0])

    def _repair_failed(self, c: repair.CopySegment | repair.FillSegment) -> None:
        if isinstance(c, repair.FillSegment):
            self.counts.fills_failed += 1
        else:
            self.counts.repair_copies_failed += 1

    def _on_repair_req(self, source: SimNode, seg: SegKey, base: int, end: int, target: NodeId, ctl_node: NodeId,
                       cid: int) -> None:  # fmt: skip
        copy = source.copies.get(seg)
        batches = copy.read(base, end, fsynced_only=True) if copy is not None else []
        self._send(source, target, self._on_repair_data, seg, base, tuple(batches), ctl_node, cid)

    def _on_repair_data(self, target: SimNode, seg: SegKey, base: int, batches: tuple[Batch, ...], ctl_node: NodeId,
                        cid: int) -> None:  # fmt: skip
        copy = target.copies.get(seg)
        if copy is None:
            copy = target.copies[seg] = SegCopy(base, via_repair=True)
        for b in batches:
            if b.end <= copy.end:
                self.checker.check_held(target.id, seg, b, "repair")
                continue
            if b.offset != copy.end:
                break
            self.checker.copy_write(target.id, seg, copy, b, "repair")
            copy.batches.append(b)
        target.unsynced.add(seg)
        self._fsync_soon(target, lambda: self._send(target, ctl_node, self._on_repair_done, seg, cid, target.id,
                                                    copy.fsynced_end))  # fmt: skip

    def _on_repair_done(self, node: SimNode, seg: SegKey, cid: int, target: NodeId, end: int) -> None:
        ctl = node.controller
        entry = ctl.in_progress.get(cid) if ctl is not None else None
        if ctl is None or entry is None:
            return
        c = entry[0]
        if target in ctl.short and end >= self._sealed_end(seg):
            ctl.short[target].discard(seg)
        info = self.meta.partition(seg[0], seg[1])
        segment = info.segment(seg[2]) if info is not None else None
        if segment is None or segment.end_offset is None or end < segment.end_offset:
            # The copy does not hold the whole sealed segment (its check fails): plan it again.
            del ctl.in_progress[cid]
            self._repair_failed(c)
            return
        if isinstance(c, repair.FillSegment):  # the member holds it all now; nothing changes in the metadata
            del ctl.in_progress[cid]
            return
        cmd: Command
        if c.replaces is None:
            cmd = AddMember(c.topic, c.partition, c.segment_id, c.target, self.cfg.rf)
        else:
            cmd = ReplaceMember(c.topic, c.partition, c.segment_id, c.replaces, c.target)
        self._propose(node, cmd, lambda result: ctl.in_progress.pop(cid, None) and None)

    def _sealed_end(self, seg: SegKey) -> int:
        info = self.meta.partition(seg[0], seg[1])
        segment = info.segment(seg[2]) if info is not None else None
        return int(segment.end_offset) if segment is not None and segment.end_offset is not None else 1 << 62

    def _on_roll_req(self, node: SimNode, key: PartKey, segment_id: SegmentId) -> None:
        lead = node.leads.get(key)
        q = lead.quorum if lead is not None else None
        if lead is not None and q is not None and lead.phase == "active" and q.segment_id == segment_id:
            self.counts.rolls_by_repair += 1
            self._start_roll(lead)

    # -- leaders: recovery -----------------------------------------------------------------------------------

    def _start_recovery(self, node: SimNode, lead: Leadership) -> None:
        info = node.view.partition(*lead.key)
        segment = info.open_segment if info is not None else None
        if segment is None:
            sealed = info.segments[-1] if info is not None and info.segments else None
            lead.phase = "opening"
            lead.previous = sealed.ensemble if sealed is not None else ()
            self._try_open(node, lead)
            return
        lead.attempt += 1
        lead.answered = set()
        lead.copy_ids = {}
        lead.recovering = segment
        lead.seal_cmd = None
        self.counts.recoveries += 1
        try:
            rec = SegmentRecovery(segment.segment_id, int(segment.base_offset), segment.ensemble, self.cfg.aq,
                                  lead.epoch, node.id)  # fmt: skip
            lead.recovery = rec
            effects = rec.start()
        except (InvalidRecoveryEvent, recovery.InvalidRecovery) as e:
            self._core_error("SegmentRecovery.start", e)
            return
        self._recovery_effects(node, lead, effects)

    def _recovery_effects(self, node: SimNode, lead: Leadership, effects: list[recovery.Effect]) -> None:
        seg_info = lead.recovering
        assert seg_info is not None
        seg = (lead.key[0], lead.key[1], seg_info.segment_id)
        for eff in effects:
            if isinstance(eff, Fence):
                self._send(node, eff.node, self._on_fence, seg, int(seg_info.base_offset), eff.epoch, node.id,
                           lead.attempt)  # fmt: skip
                self._at(self.cfg.fence_timeout_ms, node, self._fence_timeout, node, lead, lead.attempt, eff.node)
            elif isinstance(eff, Copy):
                self._ids += 1
                lead.copy_ids[eff.target] = self._ids
                self.counts.recovery_copies += 1
                self._send(node, eff.source, self._on_copy_req, seg, int(seg_info.base_offset), eff.target,
                           int(eff.start_offset), int(eff.end_offset), lead.epoch, node.id, lead.attempt,
                           self._ids)  # fmt: skip
                self._at(self.cfg.copy_timeout_ms, node, self._copy_timeout, node, lead, lead.attempt, eff.target,
                         self._ids)  # fmt: skip
            elif isinstance(eff, Seal):
                producers = self._seal_producers(node, lead.key, seg_info, int(eff.end_offset))
                lead.seal_cmd = SealSegment(lead.key[0], lead.key[1], lead.epoch, eff.segment_id, eff.end_offset,
                                            _vector(int(eff.end_offset)), producers=producers)  # fmt: skip
                self._propose_recovery_seal(node, lead, lead.attempt)
            elif isinstance(eff, Done):
                self.counts.recoveries_done += 1
                acked = self.checker.acked_end(seg)
                if eff.end_offset > acked:
                    self.counts.recovered_tails += 1
                lead.recovery = None
                lead.phase = "opening"
                lead.next_segment = seg_info.segment_id + 1
                lead.previous = seg_info.ensemble
                self._try_open(node, lead)
            elif isinstance(eff, Failed):
                self.counts.recoveries_failed += 1
                self._log(f"node {node.id} recovery of {seg} failed: {eff.reason}")
                lead.recovery = None
                lead.retry_at = self.now_ms + self.cfg.retry_ms
            elif isinstance(eff, Superseded):
                self.counts.recoveries_superseded += 1
                self._step_down(node, lead, f"recovery superseded: {eff.reason}")
                return

    def _rec(self, lead: Leadership, attempt: int) -> SegmentRecovery | None:
        if lead.phase != "recovering" or lead.attempt != attempt:
            return None
        return lead.recovery

    def _feed(self, node: SimNode, lead: Leadership, where: str, call: Callable[[], list[recovery.Effect]]) -> None:
        try:
            effects = call()
        except InvalidRecoveryEvent as e:
            self._core_error(where, e)
            return
        self._recovery_effects(node, lead, effects)

    def _on_fence(self, member: SimNode, seg: SegKey, base: int, epoch: LeaderEpoch, leader: NodeId,
                  attempt: int) -> None:  # fmt: skip
        key = (seg[0], seg[1])
        guard = self._guard(member, key)
        try:
            guard.fence(epoch)
        except Fenced as e:
            self._send(member, leader, self._on_fence_answer, key, attempt, member.id, None, int(e.fenced_epoch))
            return
        self._persist(member, key)
        copy = member.copies.get(seg)
        if copy is not None and copy.fsynced < len(copy.batches):
            member.unsynced.add(seg)
        self._fsync_soon(member, lambda: self._send(member, leader, self._on_fence_answer, key, attempt, member.id,
                                                    copy.fsynced_end if copy is not None else base, None))  # fmt: skip

    def _on_fence_answer(self, node: SimNode, key: PartKey, attempt: int, member: NodeId, end: int | None,
                         their: int | None) -> None:  # fmt: skip
        lead = node.leads.get(key)
        rec = self._rec(lead, attempt) if lead is not None else None
        if lead is None or rec is None:
            return
        if their is not None:
            self._feed(node, lead, "fence_refused", lambda: rec.fence_refused(member, their))
        elif end is not None:
            lead.answered.add(member)
            self._feed(node, lead, "fenced", lambda: rec.fenced(member, end))

    def _fence_timeout(self, node: SimNode, lead: Leadership, attempt: int, member: NodeId) -> None:
        rec = self._rec(lead, attempt)
        if rec is not None and member not in lead.answered and node.leads.get(lead.key) is lead:
            self._feed(node, lead, "unreachable", lambda: rec.unreachable(member))

    def _on_copy_req(self, source: SimNode, seg: SegKey, base: int, target: NodeId, start: int, end: int,
                     epoch: LeaderEpoch, leader: NodeId, attempt: int, cid: int) -> None:  # fmt: skip
        copy = source.copies.get(seg)
        if copy is None or copy.fsynced_end < end:
            held = copy.fsynced_end if copy is not None else base
            self._send(source, leader, self._on_copy_answer, (seg[0], seg[1]), attempt, cid, target, None,
                       f"source {source.id} holds only up to {held}")  # fmt: skip
            return
        batches = tuple(copy.read(start, end, fsynced_only=True))
        self._send(source, target, self._on_copy_data, seg, base, batches, end, epoch, leader, attempt, cid)

    def _on_copy_data(self, target: SimNode, seg: SegKey, base: int, batches: tuple[Batch, ...], end: int,
                      epoch: LeaderEpoch, leader: NodeId, attempt: int, cid: int) -> None:  # fmt: skip
        key = (seg[0], seg[1])
        guard = self._guard(target, key)
        try:
            guard.fence(epoch)  # a copy is accepted only from an epoch at least the member's own
        except Fenced as e:
            self._send(target, leader, self._on_copy_answer, key, attempt, cid, target.id, None, int(e.fenced_epoch))
            return
        self._persist(target, key)
        sealed = guard.state.sealed_through
        if sealed is not None and seg[2] <= sealed:
            self._send(target, leader, self._on_copy_answer, key, attempt, cid, target.id, None,
                       "the member knows the segment is sealed")  # fmt: skip
            return
        copy = target.copies.get(seg)
        if copy is None:
            copy = target.copies[seg] = SegCopy(base)
            self._check_expansion(target, seg, "recovery copy")
        for b in batches:
            if b.end <= copy.end:
                self.checker.check_held(target.id, seg, b, "recovery")
                continue
            if b.offset != copy.end:
                break
            self.checker.copy_write(target.id, seg, copy, b, "recovery")
            copy.batches.append(b)
        target.unsynced.add(seg)
        ok = copy.end >= end
        self._fsync_soon(target, lambda: self._send(target, leader, self._on_copy_answer, key, attempt, cid, target.id,
                                                    end if ok else None, None if ok else "gap"))  # fmt: skip

    def _on_copy_answer(self, node: SimNode, key: PartKey, attempt: int, cid: int, target: NodeId, end: int | None,
                        why: str | int | None) -> None:  # fmt: skip
        lead = node.leads.get(key)
        rec = self._rec(lead, attempt) if lead is not None else None
        if lead is None or rec is None or lead.copy_ids.get(target) != cid:
            return
        del lead.copy_ids[target]
        if end is not None:
            self._feed(node, lead, "copied", lambda: rec.copied(target, end))
        elif isinstance(why, int):
            self._feed(node, lead, "fence_refused (copy)", lambda: rec.fence_refused(target, why))
        else:
            self._feed(node, lead, "copy_failed", lambda: rec.copy_failed(target, str(why)))

    def _copy_timeout(self, node: SimNode, lead: Leadership, attempt: int, target: NodeId, cid: int) -> None:
        rec = self._rec(lead, attempt)
        if rec is not None and lead.copy_ids.get(target) == cid and node.leads.get(lead.key) is lead:
            del lead.copy_ids[target]
            self._feed(node, lead, "copy_failed (timeout)", lambda: rec.copy_failed(target, "timeout"))

    def _propose_recovery_seal(self, node: SimNode, lead: Leadership, attempt: int) -> None:
        cmd = lead.seal_cmd
        if cmd is None or self._rec(lead, attempt) is None or node.leads.get(lead.key) is not lead:
            return
        self._propose(node, cmd, lambda result: self._recovery_sealed(node, lead, attempt, result))

    def _recovery_sealed(self, node: SimNode, lead: Leadership, attempt: int, result: Result | None) -> None:
        rec = self._rec(lead, attempt)
        if rec is None or node.leads.get(lead.key) is not lead or lead.seal_cmd is None:
            return
        if result is None:  # lost or unknown: the same seal again (sealing again at the same end is a no-op)
            self._at(self.cfg.retry_ms, node, self._propose_recovery_seal, node, lead, attempt)
        elif isinstance(result, Applied):
            end = int(lead.seal_cmd.end_offset)
            self._feed(node, lead, "seal_committed", lambda: rec.seal_committed(end))
        else:
            self._feed(node, lead, "seal_refused", lambda: rec.seal_refused(result.reason))

    # -- leaders: opening, appending, rolling ------------------------------------------------------------------

    def _try_open(self, node: SimNode, lead: Leadership) -> None:
        if lead.busy or node.leads.get(lead.key) is not lead:
            return
        info = node.view.partition(*lead.key)
        if info is None:
            return
        loads = self._node_loads(node)
        sealed_through = SegmentId(lead.next_segment - 1) if lead.next_segment > 0 else None
        step = leadership.plan_open(info, node.id, lead.epoch, sealed_through, lead.previous, loads, self.cfg.rf,
                                    min_ensemble=self.cfg.aq)  # fmt: skip
        if isinstance(step, leadership.Adopt):
            self._adopt(node, lead, step.segment_id, int(step.base_offset), step.ensemble)
        elif isinstance(step, leadership.Blocked):
            self.counts.placement_waits += 1
            self._log(f"node {node.id}: {step.reason}")
            lead.retry_at = self.now_ms + self.cfg.retry_ms
        elif isinstance(step, leadership.ProposeOpen):
            cmd = step.command
            what = f"placement of {lead.key[0]}/{lead.key[1]} at offset {cmd.base_offset}"
            self.checker.placed(what, cmd.ensemble, self.last_hb_sent, self.now_ms)
            self.checker.placed_size(what, cmd.ensemble, sum(1 for n in loads if n.alive and not n.draining))
            self._check_expansion_placement(loads, cmd.ensemble, lead.key)
            lead.busy = True
            self._propose(node, cmd, lambda result: self._opened(node, lead, cmd, result))

    def _opened(self, node: SimNode, lead: Leadership, cmd: OpenSegment, result: Result | None) -> None:
        lead.busy = False
        if node.leads.get(lead.key) is not lead or lead.phase != "opening":
            return
        if isinstance(result, Applied):
            assert result.segment_id is not None
            self._adopt(node, lead, result.segment_id, int(cmd.base_offset), cmd.ensemble)
        elif isinstance(result, Refused) and result.code is RefusalCode.STALE_EPOCH:
            self._step_down(node, lead, result.reason)
        else:  # lost, or the state moved (a late commit of an earlier try): look again at the next tick
            lead.retry_at = self.now_ms + self.cfg.retry_ms

    def _adopt(self, node: SimNode, lead: Leadership, segment_id: SegmentId, base: int,
               ensemble: tuple[NodeId, ...]) -> None:  # fmt: skip
        if lead.phase != "opening":
            return
        try:
            lead.quorum = SegmentQuorum(segment_id, base, ensemble, self.cfg.aq, lead.epoch, node.id)
        except QuorumError as e:
            self._core_error("SegmentQuorum()", e)
            return
        lead.phase = "active"
        lead.next_send = dict.fromkeys(ensemble, base)
        lead.failed_at = {}
        lead.producers = self._producer_table(node, lead.key, segment_id)
        lead.roll_since = None
        lead.release_limit = None
        self._log(f"node {node.id} writes {lead.key} segment {segment_id} at {base} on {list(ensemble)}")

    def _maintain(self, node: SimNode, lead: Leadership) -> None:
        if lead.phase == "recovering":
            if lead.recovery is None and self.now_ms >= lead.retry_at:
                self._start_recovery(node, lead)
        elif lead.phase == "opening":
            if not lead.busy and self.now_ms >= lead.retry_at:
                self._try_open(node, lead)
        elif lead.phase in ("active", "rolling"):
            q = lead.quorum
            assert q is not None
            for m in sorted(lead.failed_at):
                self._reconnect(node, lead, q, m)
            if lead.phase == "rolling" and not lead.busy:
                self._roll_seal(node, lead, q)

    def _reconnect(self, node: SimNode, lead: Leadership, q: SegmentQuorum, member: NodeId) -> None:
        if self.now_ms - lead.failed_at[member] < self.cfg.reconnect_ms:
            return
        target = self.nodes[member]
        if not target.up or self.links[(node.id, member)].down_until > self.now_ms:
            return
        if self.links[(member, node.id)].down_until > self.now_ms:
            return
        del lead.failed_at[member]
        self._quorum_effects(node, lead, self._q(lambda: q.member_reconnected(member), "member_reconnected"))
        lead.next_send[member] = q.appended_end
        for lag in q.lagging():
            if lag.node == member:
                lead.next_send[member] = lag.end_offset
                self.counts.resends += 1
        self._pump(node, lead, q, member)

    def _q(self, call: Callable[[], list[QuorumEffect]], where: str) -> list[QuorumEffect]:
        try:
            return call()
        except QuorumError as e:
            self._core_error(f"SegmentQuorum.{where}", e)
            return []

    def _quorum_effects(self, node: SimNode, lead: Leadership, effects: list[QuorumEffect]) -> None:
        for eff in effects:
            if isinstance(eff, LacAdvanced):
                self._release_ready(node, lead)
            elif isinstance(eff, QuorumLost):
                self.counts.quorum_lost += 1
                self._log(f"node {node.id} {lead.key}: {eff.message()}")

    def _limit(self, lead: Leadership) -> int:
        q = lead.quorum
        assert q is not None
        return q.lac if lead.release_limit is None else min(q.lac, lead.release_limit)

    def _release_ready(self, node: SimNode, lead: Leadership) -> None:
        limit = self._limit(lead)
        ready = [p for p in lead.pending if p.batch.end <= limit]
        if not ready:
            return
        lead.pending = [p for p in lead.pending if p.batch.end > limit]
        q = lead.quorum
        assert q is not None
        for p in ready:
            self._release(node, lead, q.segment_id, p)

    def _release(self, node: SimNode, lead: Leadership, segment_id: SegmentId, p: PendingAck) -> None:
        ack = AckedBatch(lead.key, segment_id, p.batch, self.now_ms, node.id, lead.epoch)
        self._trace.update(f"ack {lead.key} {segment_id} {p.batch}".encode())
        q = lead.quorum
        if q is not None and q.segment_id == segment_id and len(q.ensemble) < self.cfg.rf:
            self.counts.acked_short += 1
        self.checker.released(ack, self.meta, self.now_ms)
        self._to_client(self._on_produce_reply, p.producer, p.conn, p.correlation, None)

    def _refuse_pending(self, node: SimNode, lead: Leadership, why: str) -> None:
        """What the leader had not confirmed fails with ``NotLeader``: the producer sends it again."""
        for p in lead.pending:
            self._to_client(self._on_produce_reply, p.producer, p.conn, p.correlation,
                            NotLeader(*lead.key, why))  # fmt: skip
        lead.pending = []

    def _on_produce(self, node: SimNode, key: PartKey, producer: int, conn: int, correlation: int,
                    batch: Batch) -> None:  # fmt: skip
        """A produce request; ``batch`` as the producer sent it (its offset is the leader's to give)."""
        lead = node.leads.get(key)
        q = lead.quorum if lead is not None else None
        if lead is None or q is None or lead.phase != "active":
            self._to_client(self._on_produce_reply, producer, conn, correlation,
                            NotLeader(*key, f"node {node.id} has no open segment of it"))  # fmt: skip
            return
        last = batch.sequence + batch.records - 1
        decision = lead.producers.check(batch.producer, 0, batch.sequence, last, self.now_ms)
        if isinstance(decision, Duplicate):
            self._answer_duplicate(node, lead, q, PendingAck(producer, conn, correlation, batch), decision)
            return
        if not isinstance(decision, Append):
            self.counts.out_of_order += 1
            self._log(f"node {node.id} {key}: {decision.message()}")
            self._to_client(self._on_produce_reply, producer, conn, correlation, SequenceRejected(decision))
            return
        stored = batch._replace(offset=q.appended_end, append_ms=self.now_ms)
        held = self.sealed_payloads[key].get(batch.payload)
        if held is not None:
            self.checker.fail("C1", f"exactly once: node {node.id} stores producer {producer}'s batch {batch.payload} "
                                    f"(sequence {batch.sequence}) again at offset {stored.offset}, though the chain "
                                    f"holds it at {held}: its producer table did not know the resend")  # fmt: skip
            return
        if not self._append_as_leader(node, lead, q, stored):
            self._to_client(self._on_produce_reply, producer, conn, correlation,
                            NotLeader(*key, f"node {node.id} was fenced"))  # fmt: skip
            return
        lead.producers.record(batch.producer, 0, batch.sequence, last,
                              AppendResult(LocalOffset(stored.offset), OriginSeq(stored.offset),
                                           OriginSeq(stored.end - 1), stored.append_ms), self.now_ms)  # fmt: skip
        lead.pending.append(PendingAck(producer, conn, correlation, stored))
        if q.appended_end - q.base_offset >= self.cfg.roll_records:
            self.counts.rolls_by_size += 1
            self._start_roll(lead)

    def _answer_duplicate(self, node: SimNode, lead: Leadership, q: SegmentQuorum, p: PendingAck,
                          decision: Duplicate) -> None:  # fmt: skip
        """A resend of a batch the partition holds: the original answer, once the original is confirmed."""
        self.counts.dedup_hits += 1
        offset = int(decision.result.base_offset)
        seg, held = self._batch_at(lead.key, q, offset)
        if held is None or held.payload != p.batch.payload:
            self.checker.fail("C1", f"exactly once: the leader's producer table answered producer {p.producer}'s "
                                    f"resent batch {p.batch.payload} with offset {offset}, where the chain holds "
                                    f"{held}")  # fmt: skip
            return
        p = PendingAck(p.producer, p.conn, p.correlation, held)
        if seg == q.segment_id:
            lead.pending.append(p)
            self._release_ready(node, lead)
        else:
            self._release(node, lead, seg, p)

    def _batch_at(self, key: PartKey, q: SegmentQuorum, offset: int) -> tuple[SegmentId, Batch | None]:
        """The segment holding ``offset`` and its writer's batch there (the ground truth of the checker)."""
        info = self.meta.partition(*key)
        segment_id = q.segment_id
        if offset < q.base_offset and info is not None:
            segment_id = next((s.segment_id for s in info.segments
                               if s.end_offset is not None and s.base_offset <= offset < s.end_offset), segment_id)
        stream = self.checker.streams.get((key[0], key[1], segment_id), [])
        return segment_id, next((b for b in stream if b.offset == offset), None)

    def _append_as_leader(self, node: SimNode, lead: Leadership, q: SegmentQuorum, batch: Batch) -> bool:
        """Append ``batch`` to the leader's copy and stream it; False if its guard refuses (it steps down)."""
        key = lead.key
        seg = (key[0], key[1], q.segment_id)
        copy = node.copies.get(seg)
        if copy is None:
            copy = node.copies[seg] = SegCopy(q.base_offset)
            self._check_expansion(node, seg, "append")
        guard = self._guard(node, key)
        try:
            guard.check_append(lead.epoch, q.segment_id, batch.offset, copy.end)
        except (Fenced, SegmentSealed) as e:
            self._step_down(node, lead, str(e))
            return False
        except NotContiguous as e:
            self._core_error("ReplicaGuard.check_append at the leader", e)
            return False
        self._persist(node, key)
        self.checker.accepted(node.id, key, lead.epoch, (node.id, node.incarnation))
        self.checker.writer_append(seg, (node.id, node.incarnation, lead.epoch), batch)
        self.checker.copy_write(node.id, seg, copy, batch, "append")
        copy.batches.append(batch)
        node.unsynced.add(seg)
        try:
            q.appended(batch.end)
        except QuorumError as e:
            self._core_error("SegmentQuorum.appended", e)
        self._fsync_soon(node)
        for m in q.ensemble:
            if m != node.id and m not in lead.failed_at:
                self._pump(node, lead, q, m)
        return True

    # -- the producers' state across leaders -----------------------------------------------------------------

    def _held_entries(self, node: SimNode, key: PartKey, before: SegmentId) -> list[ProducerEntry]:
        """The producers' batches in this node's copies of ``key``'s segments before ``before``."""
        return [_entry(b) for seg in sorted(node.copies) if seg[:2] == key and seg[2] < before
                for b in node.copies[seg].batches]  # fmt: skip

    def _producer_table(self, node: SimNode, key: PartKey, segment_id: SegmentId) -> ProducerStateTable:
        """The table a leader starts writing ``segment_id`` with, as the node builds it
        (``georep/server/site_cluster.py`` ``leader_producers``)."""
        info = node.view.partition(*key)
        sealed = info.sealed_producers(ORIGIN) if info is not None else None
        last = next((s for s in reversed(info.segments) if s.sealed), None) if info is not None else None
        if last is not None and last.end_offset is not None and last.end_offset > last.base_offset:
            copy = node.copies.get((key[0], key[1], last.segment_id))
            if copy is None or copy.end < int(last.end_offset or 0):
                self.counts.leaders_missing_history += 1
        history = producer_snapshot.history_at_open(sealed, lambda: self._held_entries(node, key, segment_id))
        copy = node.copies.get((key[0], key[1], segment_id))
        own = [_entry(b) for b in copy.batches] if copy is not None else []
        return ProducerStateTable.rebuild(itertools.chain(history, own), now_ms=self.now_ms, origin=ORIGIN)

    def _seal_producers(self, node: SimNode, key: PartKey, segment: SegmentInfo, end: int) -> ProducerSnapshot:
        """The table a seal of ``segment`` at ``end`` carries, from the proposer's view and copy (as
        ``georep/server/cluster_member.py`` ``seal_producers``): it holds the segment up to ``end``."""
        info = node.view.partition(*key)
        seg = (key[0], key[1], segment.segment_id)
        copy = node.copies.get(seg)
        base = int(segment.base_offset)
        if end > base and (copy is None or copy.end < end):
            self._core_error("seal", ValueError(f"node {node.id} proposes to seal {seg} at {end} but holds it only "
                                                f"up to {copy.end if copy else base}"))  # fmt: skip
        batches = [_entry(b) for b in copy.read(base, end)] if copy is not None else []
        sealed = info.sealed_producers(ORIGIN) if info is not None else None
        history = producer_snapshot.history_at_open(sealed, lambda: self._held_entries(node, key, segment.segment_id))
        return producer_snapshot.fold(history, ORIGIN, batches, now_ms=self.now_ms)

    def _pump(self, node: SimNode, lead: Leadership, q: SegmentQuorum, member: NodeId) -> None:
        """Stream to ``member`` what it has not been sent yet in this stream."""
        seg = (lead.key[0], lead.key[1], q.segment_id)
        copy = node.copies.get(seg)
        start = lead.next_send.get(member, q.base_offset)
        if copy is None or start >= q.appended_end:
            return
        for b in copy.read(start, q.appended_end):
            self._send(node, member, self._on_append, lead.key, q.segment_id, q.base_offset, lead.epoch, node.id,
                       node.incarnation, b)  # fmt: skip
        lead.next_send[member] = q.appended_end

    def _on_append(self, member: SimNode, key: PartKey, segment_id: SegmentId, base: int, epoch: LeaderEpoch,
                   sender: NodeId, sender_inc: int, batch: Batch) -> None:  # fmt: skip
        seg = (key[0], key[1], segment_id)
        info = self.meta.partition(*key)
        if info is not None and epoch < info.leader_epoch:
            self.counts.zombie_appends += 1
        guard = self._guard(member, key)
        copy = member.copies.get(seg)
        end = copy.end if copy is not None else base
        try:
            guard.check_append(epoch, segment_id, batch.offset, end)
        except Fenced as e:
            self.counts.fenced_appends += 1
            self._send(member, sender, self._on_append_refused, key, segment_id, member.id, "fenced",
                       int(e.fenced_epoch))  # fmt: skip
            return
        except SegmentSealed:
            self._send(member, sender, self._on_append_refused, key, segment_id, member.id, "sealed", 0)
            return
        except NotContiguous:
            if batch.offset < end:  # a resend of what it holds: the same bytes (C3), ack its end again
                if copy is not None:
                    self.checker.check_held(member.id, seg, batch, "resend")
                    member.writer_of[seg] = (sender, sender_inc)
                    member.unsynced.add(seg)
                    self._fsync_soon(member)
            elif member.gap_reported.get(seg) != end:
                member.gap_reported[seg] = end
                self.counts.gaps += 1
                self._send(member, sender, self._on_append_refused, key, segment_id, member.id, "gap", end)
            return
        self._persist(member, key)
        self.checker.accepted(member.id, key, epoch, (sender, sender_inc))
        if copy is None:
            copy = member.copies[seg] = SegCopy(base)
            self._check_expansion(member, seg, "append")
        self.checker.copy_write(member.id, seg, copy, batch, "append")
        copy.batches.append(batch)
        member.writer_of[seg] = (sender, sender_inc)
        member.unsynced.add(seg)
        self._fsync_soon(member)

    def _on_append_refused(self, node: SimNode, key: PartKey, segment_id: SegmentId, member: NodeId, why: str,
                           value: int) -> None:  # fmt: skip
        lead = node.leads.get(key)
        q = lead.quorum if lead is not None else None
        if lead is None or q is None or q.segment_id != segment_id:
            return
        if why == "gap":
            if value < lead.next_send.get(member, q.base_offset) and member not in lead.failed_at:
                lead.next_send[member] = value
                self.counts.resends += 1
                self._pump(node, lead, q, member)
            return
        self._step_down(node, lead, f"node {member} refused an append: {why} {value}")

    def _on_ack(self, node: SimNode, key: PartKey, segment_id: SegmentId, member: NodeId, end: int) -> None:
        lead = node.leads.get(key)
        q = lead.quorum if lead is not None else None
        if lead is None or q is None or q.segment_id != segment_id or lead.phase not in ("active", "rolling"):
            return
        self._quorum_effects(node, lead, self._q(lambda: q.member_acked(member, end), "member_acked"))

    def _fsync_soon(self, node: SimNode, then: Callable[[], None] | None = None) -> None:
        if then is not None:
            node.after_fsync.append(then)
        if not node.fsync_due:
            node.fsync_due = True
            self._at(self._between(self.cfg.fsync_ms), node, self._on_fsync, node)

    def _on_fsync(self, node: SimNode) -> None:
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

    def _fsynced(self, node: SimNode, seg: SegKey, end: int) -> None:
        key = (seg[0], seg[1])
        lead = node.leads.get(key)
        q = lead.quorum if lead is not None else None
        if lead is not None and q is not None and q.segment_id == seg[2]:
            if lead.phase in ("active", "rolling") and end <= q.appended_end:
                self._quorum_effects(node, lead, self._q(lambda: q.member_acked(node.id, end), "member_acked"))
            return
        writer = node.writer_of.get(seg)
        if writer is not None and writer[0] != node.id:
            self._send(node, writer[0], self._on_ack, key, seg[2], node.id, end)

    def _stream_broken(self, node: SimNode, member: NodeId) -> None:
        for key in sorted(node.leads):
            lead = node.leads[key]
            q = lead.quorum
            if q is None or lead.phase not in ("active", "rolling") or member not in q.ensemble:
                continue
            if member == node.id or member in lead.failed_at:
                continue
            lead.failed_at[member] = self.now_ms
            self._quorum_effects(node, lead, self._q(partial(q.member_failed, member), "member_failed"))

    def _start_roll(self, lead: Leadership) -> None:
        if lead.phase == "active":
            lead.phase = "rolling"
            lead.roll_since = self.now_ms
            lead.seal_cmd = None

    def _roll_seal(self, node: SimNode, lead: Leadership, q: SegmentQuorum) -> None:
        """Seal at the LAC once everything appended is confirmed, or once waiting longer is pointless."""
        if lead.seal_cmd is None:
            assert lead.roll_since is not None
            end = leadership.roll_seal_at(q.lac, q.appended_end, lead.roll_since, self.now_ms, self.cfg.roll_wait_ms)
            if end is None:
                return
            lead.release_limit = end
            info = node.view.partition(*lead.key)
            segment = info.segment(q.segment_id) if info is not None else None
            if segment is None:
                return  # the view lags behind the open this leader adopted: seal at the next tick
            lead.seal_cmd = SealSegment(lead.key[0], lead.key[1], lead.epoch, q.segment_id, LocalOffset(end),
                                        _vector(end), producers=self._seal_producers(node, lead.key, segment, end))
        cmd = lead.seal_cmd
        lead.busy = True
        self._propose(node, cmd, lambda result: self._rolled(node, lead, cmd, result))

    def _rolled(self, node: SimNode, lead: Leadership, cmd: SealSegment, result: Result | None) -> None:
        lead.busy = False
        if node.leads.get(lead.key) is not lead or lead.phase != "rolling":
            return
        if result is None:
            return  # the same seal again at the next tick
        if isinstance(result, Refused):
            self._step_down(node, lead, f"roll refused: {result.reason}")
            return
        q = lead.quorum
        assert q is not None
        self._refuse_pending(node, lead, f"segment {q.segment_id} was sealed before it was confirmed")  # resent
        lead.previous = q.ensemble
        lead.next_segment = q.segment_id + 1
        lead.quorum = None
        lead.seal_cmd = None
        lead.phase = "opening"
        if self.phase == "safety" and self._down_count() < self.cfg.max_down \
                and self.rng.random() < self.cfg.roll_kill_p:  # fmt: skip
            # Killed between the seal and the next open: the controller may name a node that holds none of the
            # segment just sealed, and it must still know every producer's last sequences.
            self.counts.roll_kills += 1
            self._kill(node)
            self._at(self._between(self.cfg.down_ms), None, self._restart, node.id)
            return
        self._try_open(node, lead)

    # -- expansion ---------------------------------------------------------------------------------------------

    def _check_expansion(self, node: SimNode, seg: SegKey, how: str) -> None:
        if node.id != self.added:
            return
        opened = self.checker.opened_ms.get(seg, self.now_ms)
        if opened < node.joined_ms:
            self.checker.fail("C6", f"expansion: node {node.id} (joined at t+{node.joined_ms - START_MS}ms) got "
                                    f"{seg[0]}/{seg[1]} segment {seg[2]}, opened before it joined, by {how}: only "
                                    "repair may move old data to a new node")  # fmt: skip

    def _check_expansion_placement(self, loads: list[placement.NodeLoad], ensemble: tuple[NodeId, ...],
                                   key: PartKey) -> None:  # fmt: skip
        added = self.added
        if added is None or self.expansion_placed:
            return
        eligible = any(n.node == added and n.alive and not n.draining for n in loads)
        if not eligible:
            return
        if added in ensemble:
            self.expansion_placed = True
            return
        self.checker.fail("C6", f"expansion: the first segment placed after node {added} became eligible "
                                f"({key[0]}/{key[1]}, ensemble {list(ensemble)}) does not include it: a new node "
                                "must take new segments at the next roll")  # fmt: skip

    # -- producers and readers ---------------------------------------------------------------------------

    def _produce(self, index: int) -> None:
        if self.phase != "safety":
            return
        p = self.producers[index]
        delivery = p.delivery
        if p.next_payload == (index + 1) * PAYLOADS_PER_PRODUCER and not self._serving(p.key):
            # The application starts once the partition is served. A new producer's first batch refused by a leader
            # still opening while its second is taken once open would be stored with a gap: the producer table takes
            # an unknown producer's batch whatever its sequence (dedup/producer.py, rule 2, as Kafka does).
            self._at(self._between(self.cfg.produce_ms), None, self._produce, index)
            return
        if len(delivery.queue) + len(delivery.in_flight) < self.cfg.max_in_flight:
            batch = ProducerBatch(p.key[0], p.key[1], self.now_ms, MAX_BATCH_BYTES_LIMIT)
            batch.records = [RecordInput(None, b"", (), 0)] * self._between(self.cfg.records_per_batch)
            p.payloads[id(batch)] = p.next_payload
            p.next_payload += 1
            delivery.enqueue(batch)
            self.counts.produced += 1
            self._send_batches(p)
        self._at(self._between(self.cfg.produce_ms), None, self._produce, index)

    def _serving(self, key: PartKey) -> bool:
        info = self.meta.partition(*key)
        leader = self.nodes[info.leader] if info is not None and info.leader is not None else None
        lead = leader.leads.get(key) if leader is not None and leader.up else None
        return lead is not None and lead.phase == "active"

    def _send_batches(self, p: SimProducer) -> None:
        """What the producer's delivery lets go now, in order, over its connection to the leader."""
        delivery = p.delivery
        if delivery.not_before_ms > self.now_ms:
            return
        if p.leader is None:
            info = self.meta.partition(*p.key)  # the client's metadata fetch
            p.leader = info.leader if info is not None else None
            if p.leader is None:  # no leader yet: ask again in a moment, sending nothing meanwhile
                if not delivery.idle:
                    self._at(self._between(self.cfg.backoff_ms), None, self._send_batches, p)
                return
        target = self.nodes[p.leader]
        for batch in delivery.take_sendable():
            assert batch.base_sequence is not None
            p.next_correlation += 1
            correlation = p.next_correlation
            p.in_flight[correlation] = batch
            wire = Batch(-1, len(batch.records), p.payloads[id(batch)], batch.producer_id, batch.base_sequence)
            due = max(self.now_ms + self._between(self.cfg.latency_ms), p.conn_due)
            p.conn_due = due
            self._at(due - self.now_ms, target, self._on_produce, target, p.key, p.index, p.conn, correlation, wire)
            self._at(self.cfg.request_timeout_ms, None, self._produce_timeout, p.index, p.conn, correlation)

    def _produce_timeout(self, index: int, conn: int, correlation: int) -> None:
        """No answer in time: the client drops the connection; every unanswered batch is sent again."""
        p = self.producers[index]
        if p.conn == conn and correlation in p.in_flight:
            self.counts.retries += 1
            self._new_connection(p)
            p.delivery.on_stream_broken()
            self._resolve(p)
            self._send_batches(p)

    def _new_connection(self, p: SimProducer) -> None:
        p.conn += 1
        p.in_flight.clear()
        p.leader = None

    def _on_produce_reply(self, index: int, conn: int, correlation: int, error: Exception | None) -> None:
        """An answer, judged as the client judges it: the node's error through the gRPC mapping and back."""
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
            self.counts.retries += 1
            client_error = from_status(Operation.PRODUCE, status_of(error) or grpc.StatusCode.INTERNAL, str(error),
                                       reason_of(error))
            if isinstance(error, NotLeader):
                p.leader = None  # ask the metadata again
            if delivery.on_error(batch, client_error, self.now_ms, self._between(self.cfg.backoff_ms)):
                self._failed_to_application(p, batch, client_error)
            if delivery.not_before_ms > self.now_ms:
                self._at(int(delivery.not_before_ms - self.now_ms), None, self._send_batches, p)
        self._resolve(p)
        self._send_batches(p)

    def _resolve(self, p: SimProducer) -> None:
        if p.delivery.round_complete():
            for failed in p.delivery.resolve(self._producer_ids):
                self._failed_to_application(p, failed, failed.error)
            if p.delivery.producer_id == self._producer_ids:
                self._producer_ids += 1

    def _failed_to_application(self, p: SimProducer, batch: ProducerBatch, error: Exception | None) -> None:
        """An acks=all send to a site that keeps its promises never fails to the application: a leader change is
        retried, and the new leader knows every producer's last sequences (``cluster/producer_snapshot.py``)."""
        raise InvariantViolation(f"producer {p.index} of {p.key[0]}/{p.key[1]}: batch {p.payloads[id(batch)]} "
                                 f"(producer id {batch.producer_id}, sequence {batch.base_sequence}) failed to the "
                                 f"application: {type(error).__name__}: {error}")  # fmt: skip

    def _read(self) -> None:
        if self.phase == "safety":
            self._at(self._between(self.cfg.read_ms), None, self._read)
        key = self.keys[self.rng.randrange(len(self.keys))]
        info = self.meta.partition(*key)
        if info is None or not info.segments:
            return
        s = info.segments[-1] if self.rng.random() < 0.6 else self.rng.choice(info.segments)
        if s.sealed:
            assert s.end_offset is not None
            member = s.ensemble[self.rng.randrange(len(s.ensemble))]
            self._to_node(member, self._on_read, key, s.segment_id, int(s.end_offset), self.rng.random())
        elif info.leader is not None:
            self._to_node(info.leader, self._on_lac_query, key, s.segment_id)

    def _on_lac_query(self, node: SimNode, key: PartKey, segment_id: SegmentId) -> None:
        lead = node.leads.get(key)
        q = lead.quorum if lead is not None else None
        if lead is not None and q is not None and q.segment_id == segment_id:
            self._to_client(self._on_lac, key, segment_id, self._limit(lead))

    def _on_lac(self, key: PartKey, segment_id: SegmentId, lac: int) -> None:
        info = self.meta.partition(*key)
        s = info.segment(segment_id) if info is not None else None
        if s is not None:
            member = s.ensemble[self.rng.randrange(len(s.ensemble))]
            self._to_node(member, self._on_read, key, segment_id, lac, self.rng.random())

    def _on_read(self, node: SimNode, key: PartKey, segment_id: SegmentId, bound: int, where: float) -> None:
        seg = (key[0], key[1], segment_id)
        copy = node.copies.get(seg)
        if copy is None:
            return
        upto = min(bound, copy.end)
        batches = copy.read(copy.base, upto)
        if not batches:
            return
        self.counts.reads += 1
        first = int(where * len(batches))
        for b in batches[first : first + READ_BATCHES_MAX]:
            self.checker.read(key, seg, node.id, b, bound, self.meta, self.now_ms)

    # -- faults --------------------------------------------------------------------------------------------

    def _down_count(self) -> int:
        return sum(1 for n in self.nodes.values() if not self._running(n) or n.isolated_until > self.now_ms)

    def _pick_up_node(self) -> SimNode | None:
        if self._down_count() >= self.cfg.max_down:
            return None
        candidates = [self.nodes[n] for n in sorted(self.nodes)
                      if self._running(self.nodes[n]) and self.nodes[n].isolated_until <= self.now_ms]  # fmt: skip
        return self.rng.choice(candidates) if candidates else None

    def _fault_kill(self) -> None:
        if self.phase != "safety":
            return
        self._at(self._interval(self.cfg.kill_every_ms), None, self._fault_kill)
        node = self._pick_up_node()
        if node is not None:
            self._kill(node)
            self._at(self._between(self.cfg.down_ms), None, self._restart, node.id)

    def _kill(self, node: SimNode) -> None:
        self.counts.kills += 1
        self._log(f"kill node {node.id}")
        node.up = False
        node.down_since = self.now_ms
        for seg in sorted(node.copies):
            copy = node.copies[seg]
            self.counts.lost_batches += len(copy.batches) - copy.fsynced
            del copy.batches[copy.fsynced :]
        node.guards = {}
        node.view = SiteState()
        node.view_due = False
        node.leads = {}
        node.done_epoch = {}
        node.reelect_asked = {}
        node.unsynced = set()
        node.fsync_due = False
        node.after_fsync = []
        node.writer_of = {}
        node.gap_reported = {}
        node.cut_done = set()
        node.controller = None
        self.checker.crashed(node.id, self.now_ms, node.copies)
        self._break_links(node.id, None)

    def _break_links(self, a: NodeId, b: NodeId | None) -> None:
        """Bump the links between ``a`` and ``b`` (every other node if None); the other ends notice."""
        for other in sorted(self.nodes):
            if other == a or (b is not None and other != b):
                continue
            self.links[(a, other)].gen += 1
            self.links[(other, a)].gen += 1
            for x, y in ((a, other), (other, a)):
                nx = self.nodes[x]
                if nx.up:
                    self._at(self.cfg.detect_ms, nx, self._stream_broken, nx, y)

    def _restart(self, nid: NodeId) -> None:
        node = self.nodes[nid]
        if node.up:
            return
        self.counts.restarts += 1
        self._log(f"restart node {nid}")
        node.up = True
        node.down_since = None
        node.incarnation += 1
        node.boot_index = len(self.log)
        node.view = self.meta.copy()
        node.view_index = len(self.log)
        if self.meta.node(nid) is None:  # an added node killed before its registration committed
            self._register(node)
        self._at(self.rng.randint(1, self.cfg.tick_ms), node, self._tick, node)

    def _fault_pause(self) -> None:
        if self.phase != "safety":
            return
        self._at(self._interval(self.cfg.pause_every_ms), None, self._fault_pause)
        node = self._pick_up_node()
        if node is not None:
            self.counts.pauses += 1
            node.paused_until = self.now_ms + self._between(self.cfg.pause_ms)
            self._log(f"pause node {node.id} until t+{node.paused_until - START_MS}")

    def _fault_isolate(self) -> None:
        if self.phase != "safety":
            return
        self._at(self._interval(self.cfg.isolate_every_ms), None, self._fault_isolate)
        node = self._pick_up_node()
        if node is not None:
            self.counts.isolations += 1
            node.isolated_until = self.now_ms + self._between(self.cfg.isolate_ms)
            self._log(f"isolate node {node.id} from the metadata until t+{node.isolated_until - START_MS}")

    def _pair(self) -> tuple[NodeId, NodeId] | None:
        ids = sorted(self.nodes)
        if len(ids) < 2:
            return None
        a, b = self.rng.sample(ids, 2)
        return NodeId(a), NodeId(b)

    def _fault_cut(self) -> None:
        if self.phase != "safety":
            return
        self._at(self._interval(self.cfg.cut_every_ms), None, self._fault_cut)
        pair = self._pair()
        if pair is not None:
            self.counts.stream_cuts += 1
            self._break_links(pair[0], pair[1])

    def _fault_partition(self) -> None:
        if self.phase != "safety":
            return
        self._at(self._interval(self.cfg.partition_every_ms), None, self._fault_partition)
        pair = self._pair()
        if pair is not None:
            self.counts.partitions += 1
            until = self.now_ms + self._between(self.cfg.partition_ms)
            self.links[pair].down_until = until
            self.links[(pair[1], pair[0])].down_until = until
            self._break_links(pair[0], pair[1])

    def _fault_meta(self) -> None:
        if self.phase != "safety":
            return
        self._at(self._interval(self.cfg.meta_outage_every_ms), None, self._fault_meta)
        self.counts.meta_outages += 1
        self.meta_outage_until = max(self.meta_outage_until, self.now_ms + self._between(self.cfg.meta_outage_ms))

    def _add_node(self) -> None:
        nid = NodeId(max(self.nodes) + 1)
        node = self._new_node(nid, voter=False, used=0)
        self.added = nid
        self.counts.nodes_added += 1
        self._log(f"node {nid} joins")
        node.view = self.meta.copy()
        node.boot_index = len(self.log)
        self._register(node)
        self._at(self.rng.randint(20, self.cfg.tick_ms), node, self._tick, node)

    def _register(self, node: SimNode) -> None:
        def done(result: Result | None) -> None:
            if result is None:  # lost in a metadata outage: register again
                self._at(self.cfg.retry_ms, node, self._register, node)

        self._propose(node, RegisterNode(node.id, f"10.0.0.{node.id}:9092"), done)

    # -- running -------------------------------------------------------------------------------------------

    def _start(self) -> None:
        cfg = self.cfg
        for nid in sorted(self.nodes):
            node = self.nodes[nid]
            node.view = self.meta.copy()
            self._at(self.rng.randint(1, cfg.tick_ms), node, self._tick, node)
        for p in self.producers:
            self._at(self.rng.randint(50, 300), None, self._produce, p.index)
        self._at(self._between(cfg.read_ms), None, self._read)
        self._at(self._interval(cfg.kill_every_ms), None, self._fault_kill)
        self._at(self._interval(cfg.pause_every_ms), None, self._fault_pause)
        self._at(self._interval(cfg.cut_every_ms), None, self._fault_cut)
        self._at(self._interval(cfg.partition_every_ms), None, self._fault_partition)
        self._at(self._interval(cfg.isolate_every_ms), None, self._fault_isolate)
        if cfg.meta_outage_every_ms:
            self._at(self._interval(cfg.meta_outage_every_ms), None, self._fault_meta)
        if cfg.add_node:
            self._at(self.rng.randint(cfg.safety_ms // 5, cfg.safety_ms // 2), None, self._add_node)

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
            raise self._failure(f"unexpected error at t+{self.now_ms - START_MS}ms event {self._events}: "
                                f"{type(e).__name__}: {e}\n{text}") from e  # fmt: skip
        self._trace.update(repr(sorted(self.counts.as_dict().items())).encode())
        return ClusterResult(self.seed, self.shape, self.cfg.describe(), self._events, self.now_ms - START_MS,
                             self.now_ms - self._liveness_start, self._trace.hexdigest(), self.counts)  # fmt: skip

    def _failure(self, message: str) -> ClusterSimulationFailure:
        return ClusterSimulationFailure(f"{message}\n  {self.cfg.describe()}", self.seed, self.shape,
                                        replay_command(self.seed, self.shape))  # fmt: skip

    def _run_liveness(self) -> None:
        self.phase = "liveness"
        self._liveness_start = self.now_ms
        self._log("liveness: heal every fault, restart every node, stop new batches")
        self.meta_outage_until = 0
        for link in self.links.values():
            link.down_until = 0
        for nid in sorted(self.nodes):
            self.nodes[nid].isolated_until = 0
        for nid in sorted(self.nodes):
            if not self.nodes[nid].up:
                self._restart(nid)
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
        for p in self.producers:
            if not p.delivery.idle:
                problems.append(f"producer of {p.key[0]}/{p.key[1]} still waits for {p.delivery!r}")
        for key in self.keys:
            problems.extend(self._partition_problems(key))
        if self.added is not None:
            node = self.nodes[self.added]
            newer = [
                s for info in self.meta.partitions() for s in info.segments
                if self.added in s.ensemble and self.checker.opened_ms.get((info.topic, info.partition, s.segment_id),
                                                                           0) >= node.joined_ms
            ]  # fmt: skip
            if not newer:
                problems.append(f"expansion: node {self.added} holds no segment opened after it joined")
        return problems

    def _partition_problems(self, key: PartKey) -> list[str]:
        where = f"{key[0]}/{key[1]}"
        info = self.meta.partition(*key)
        assert info is not None
        if info.leader is None:
            return [f"{where} has no leader"]
        leader = self.nodes[info.leader]
        lead = leader.leads.get(key) if leader.up else None
        open_segment = info.open_segment
        q = lead.quorum if lead is not None else None
        if lead is None or q is None or lead.phase != "active" or open_segment is None:
            return [f"{where}: leader node {info.leader} (epoch {info.leader_epoch}) is not writing an open segment"]
        problems: list[str] = []
        content: list[Batch] = []
        live = len(self.meta.live_nodes(self.now_ms, self.cfg.session_timeout_ms))
        for s in info.segments:
            seg = (key[0], key[1], s.segment_id)
            end = int(s.end_offset) if s.end_offset is not None else q.lac
            if not s.sealed and q.segment_id != s.segment_id:
                problems.append(f"{where} segment {s.segment_id} is open but its leader writes another")
                continue
            full = [m for m in s.ensemble if self._fsynced_end(m, seg, int(s.base_offset)) >= end]
            if not full:
                problems.append(f"{where} segment {s.segment_id}: no member holds it up to {end}")
                continue
            if len(full) < len(s.ensemble):
                short = [m for m in s.ensemble if m not in full]
                problems.append(f"{where} segment {s.segment_id} ({'sealed' if s.sealed else 'open'}, end {end}) is "
                                f"under-replicated: members {short} do not hold it fsynced")  # fmt: skip
            if not s.sealed and q.lac < q.appended_end:
                problems.append(f"{where} segment {s.segment_id}: LAC {q.lac} is behind the appended end "
                                f"{q.appended_end}")  # fmt: skip
            if len(s.ensemble) < self.cfg.rf <= live:
                problems.append(f"{where} segment {s.segment_id} ({'sealed' if s.sealed else 'open'}) has "
                                f"{len(s.ensemble)} members {list(s.ensemble)}, below replication_factor "
                                f"{self.cfg.rf}, while {live} nodes are live: "
                                f"{'repair did not widen it' if s.sealed else 'it was not rolled'}")  # fmt: skip
            copy = self.nodes[full[0]].copies.get(seg)
            if copy is not None:
                content.extend(copy.read(copy.base, end, fsynced_only=True))
        if problems:
            return problems
        at: dict[int, Batch] = {}
        payloads: dict[int, int] = {}
        expected = 0
        for b in content:
            if b.offset != expected:
                problems.append(f"{where}: the chain has {b} after offset {expected}")
            expected = b.end
            at[b.offset] = b
            if b.payload in payloads:
                problems.append(f"{where}: batch {b.payload} is in the chain twice (offsets {payloads[b.payload]} "
                                f"and {b.offset})")  # fmt: skip
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


def _vector(end: int) -> VectorOffset:
    return VectorOffset({ORIGIN: end})


def _entry(b: Batch) -> ProducerEntry:
    """A batch as a leader's producer table keeps it (its origin seq is its offset in this model)."""
    return ProducerEntry(ORIGIN, b.producer, 0, b.sequence, b.records - 1, LocalOffset(b.offset), OriginSeq(b.offset),
                         b.append_ms)  # fmt: skip


def run_cluster_seed(seed: int, shape: str | None = None, *, checks: frozenset[str] = ALL_CHECKS,
                     verbose: bool = False) -> ClusterResult:  # fmt: skip
    """One run, as ``python -m georep.sim --cluster --seed SEED --shape SHAPE`` does it (shape: by seed)."""
    return ClusterSimulator(seed, shape or swarm_shape(seed), checks=checks, verbose=verbose).run()
