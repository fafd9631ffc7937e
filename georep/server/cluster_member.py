"""A node's part in its site's cluster: heartbeats, the controller, and leading partitions. Shell.

Every decision is the node core's (:class:`cluster.node.NodeCore`), the one both cluster simulators drive
(``georep/sim/cluster_node.py``); this module carries out its effects over the Raft store, the node's
:class:`~georep.storage.replica_store.ReplicaStore` and gRPC, and feeds it their outcomes:

the core's                                    carried out here by
``reconcile`` (lead, recover first, step      :meth:`ClusterMember.reconcile`: ``Leading`` makes a
down, ask again: ``role_step``)               :class:`PartitionLeader`, ``StepDown`` closes it,
                                              ``ProposeEpoch`` is proposed
a lead's recovery (``FenceMember``,           ``georep/server/recovery.py`` (``fence_member``, ``copy_tail``,
``CopyTail``, ``SegmentSealed``)              ``tell_sealed``); the seal's summary and producers' table here
``ProposeSeal``, ``ProposeOpen``              proposed through Raft; the result goes back to the lead
``Adopted``, ``StreamTo``, ``Release``,       a :class:`~georep.server.ensemble.SegmentWriter` (own copy,
``Reconnect``                                 fsync, member streams); the broker attaches the partition
``Sealing``, a roll's ``SegmentSealed``       no more appends; the writer stops; the broker detaches
the controller (``ProposeElection``)          proposed in order on the Raft leader's tick
seals to learn (``cluster.member``)           ``_learn_seals``: the guards and cut tails in the store
the controller's repair (``repair_plan``:     the Raft leader's ``RepairController`` (``site_repair.py``):
``RepairCopy``, ``AskRoll``)                  ``CopySegment`` and ``RollSegment`` calls, records proposed
which sealed segments retention drops         ``plan_retention``: the Raft leader's tick, every
                                              ``retention_interval_ms``; each node deletes its copies once it
                                              sees the trim (``_apply_trims``)

:class:`ClusterMember` reports its heartbeat (free bytes and load) every ``tick_ms`` in a task of its own, straight
to the Raft store (not behind the group commit, nor behind the tick: a live node's late heartbeat had it taken for
dead), and ticks every ``tick_ms``: it ticks the core
(every lead's due retries and reconnections; on the Raft leader the controller's elections, and a repair pass
every ``repair_interval_ms`` in the background once it has led the Raft log for a session), learns the seals
its view shows, and reconciles its roles with its view of the metadata.

**This incarnation's epochs.** The core must know whether the current epoch was granted after this process
started (an earlier incarnation may have written under an older grant). At start the member waits until its
view holds everything committed (``read_barrier``) and gives the core each partition's epoch: an epoch at or
below that was granted before it.

Metadata calls block (pysyncobj), so they run in the executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from cluster import leadership
from cluster import member as membership
from cluster.controller import AskRoll, Controller, RepairCopy
from cluster.lead import (
    Adopted,
    CopyTail,
    FenceMember,
    LeadEffect,
    Note,
    ProposeOpen,
    ProposeSeal,
    Sealing,
    SegmentSealed,
    StepDown,
)
from cluster.node import Leading, NodeConfig, NodeCore, NodeEffect, ProposeElection, ProposeEpoch
from cluster.producer_snapshot import ProducerSnapshot, fold, history_at_open
from cluster.quorum import QuorumError
from cluster.repair import DrainStatus
from cluster.retention import plan_retention
from cluster.site_state import (
    Applied,
    Command,
    CommandBatch,
    ElectLeader,
    FailOver,
    NodeHeartbeat,
    PartitionInfo,
    Refused,
    RegisterNode,
    Result,
    SealSegment,
    SiteState,
    batches,
    next_leader_expiry_ms,
)
from georep.broker.errors import NotLeader
from georep.raft.frames import COMMAND_BYTES_MAX
from georep.raft.store import MetadataUnavailable, command_bytes
from georep.security.tls import TlsConfig
from georep.server.ensemble import LeadEvent, SegmentToWrite, SegmentWriter
from georep.server.fence_waves import FenceWaves
from georep.server.heartbeat_thread import HeartbeatThread
from georep.server.member_gates import MemberGates
from georep.server.peer_channels import PeerChannels
from georep.server.recovery import Members, copy_tail, fence_member, tell_sealed
from georep.server.site_repair import RepairController, decommission
from georep.storage.replica_store import PartitionKey, ReplicaError, ReplicaStore, SealSummary
from offsets.coordinates import LocalOffset, Origin
from offsets.vector import VectorOffset
from topology.ids import LeaderEpoch, NodeId, SegmentId

log = logging.getLogger(__name__)

T = TypeVar("T")

# A batch of commands is at most half the largest command the store proposes: the sizes are each command's alone,
# and a batch's own framing is estimated (cluster.site_state.batches).
BATCH_BYTES_MAX = COMMAND_BYTES_MAX // 2


def _command_size(command: Command) -> int:
    return command_bytes(command.to_dict())


def _packed_count(command: Command) -> int:
    return len(command.commands) if isinstance(command, CommandBatch) else 1


class RegistrationRefused(Exception):
    """The site's metadata refused this node's id or address; the message says what to change."""


class LeaderListener(Protocol):
    """What the node's broker is told of the partitions this member leads (``georep/server/site_cluster.py``)."""

    def segment_opened(self, lead: PartitionLeader) -> None:
        """``lead`` has an open segment to append to (after its recovery, or a roll)."""

    def sealing(self, lead: PartitionLeader) -> None:
        """``lead`` is sealing its open segment: take no more appends; acks go on as the LAC moves."""

    def segment_closed(self, lead: PartitionLeader, reason: str) -> None:
        """``lead``'s segment is sealed, or ``lead`` stopped: what was not confirmed will not be."""


class _NoListener:
    def segment_opened(self, lead: PartitionLeader) -> None:
        pass

    def sealing(self, lead: PartitionLeader) -> None:
        pass

    def segment_closed(self, lead: PartitionLeader, reason: str) -> None:
        pass


class Metadata(Protocol):
    """What the member needs of the site's metadata (``georep/raft/store.py``'s ``RaftMetadataStore``)."""

    def state(self) -> SiteState: ...
    def propose(self, command: Command, timeout_s: float | None = None) -> Result: ...
    def read_barrier(self, timeout_s: float | None = None) -> None: ...
    def watch(self, callback: Callable[[], None]) -> None: ...
    @property
    def is_leader(self) -> bool: ...
    @property
    def led_for_s(self) -> float | None: ...


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    replication_factor: int = 3  # the ensemble of each segment (write quorum)
    ack_quorum: int = 2  # min_insync_replicas: members that hold a batch fsynced before acks=all
    session_timeout_ms: int = 6_000  # a node that has not heartbeated for this long is dead
    tick_ms: int = 500
    segment_bytes: int = 64 << 20  # a leader rolls its segment past this size
    roll_wait_ms: int = 2_000  # a roll waits this long for every appended batch to be confirmed
    retry_ms: int = 500
    repair_delay_ms: int = 30_000  # a dead member's sealed segments are copied elsewhere after this (it may reboot)
    max_concurrent_copies: int = 2  # repair copies running at once, site-wide
    repair_interval_ms: int = 1_000  # the Raft leader plans repair this often
    retention_interval_ms: int = 60_000  # the Raft leader plans retention this often (georep node --retention-check-ms)
    # The node's topic defaults (georep node --retention-ms ...): a topic's config in the metadata holds its overrides.
    topic_defaults: Mapping[str, int] = field(default_factory=dict)


def node_config(config: ClusterConfig) -> NodeConfig:
    """The node core's settings from the node's."""
    return NodeConfig(
        config.replication_factor,
        config.ack_quorum,
        config.session_timeout_ms,
        config.tick_ms,
        config.retry_ms,
        config.roll_wait_ms,
        repair_every_ms=config.repair_interval_ms,
        repair_delay_ms=config.repair_delay_ms,
        max_concurrent_copies=config.max_concurrent_copies,
    )


class ClusterMember:
    """One node of a multi-node site; see the module docstring."""

    def __init__(
        self,
        me: NodeId,
        address: str,
        metadata: Metadata,
        store: ReplicaStore,
        executor: ThreadPoolExecutor,
        clock_ms: Callable[[], int],
        free_bytes: Callable[[], int],
        config: ClusterConfig | None = None,
        tls: TlsConfig | None = None,
    ) -> None:
        self.me = me
        self.address = address
        self.metadata = metadata
        self.store = store
        self.executor = executor
        # Metadata calls (proposals, read barriers, the heartbeat's free bytes) have threads of their own: in the
        # executor they queued behind the disk work of thousands of segment opens, and a node whose heartbeat
        # waited longer than a session was taken for dead (its partitions moved, more disk work, more waiting).
        self.metadata_executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="metadata")
        self.clock_ms = clock_ms
        self.free_bytes = free_bytes
        self.config = config or ClusterConfig()
        self.tls = tls
        self.channel = PeerChannels(tls)  # one channel per peer for every fence, copy and stream (peer_channels.py)
        self.fences = FenceWaves()  # a recovery's fences to each peer, in bounded waves (fence_waves.py)
        self.gates = MemberGates()  # the segment streams' reconnect backoff per peer (member_gates.py)
        self.leaders: dict[PartitionKey, PartitionLeader] = {}
        self.listener: LeaderListener = _NoListener()
        self.origin: Origin | None = None  # the site's (its broker's): seals fold its own producers' batches
        # Every decision of the node (cluster/node.py), as the cluster simulators take them; its epochs at start
        # are set once the view holds everything committed (start).
        self.core = NodeCore(me, node_config(self.config), {})
        self._retention_due_ms: int | None = None  # the controller's next retention plan
        self.repair: RepairController | None = None  # while this node is the Raft leader
        self._task: asyncio.Task[None] | None = None
        self._beats: HeartbeatThread | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._queued: list[tuple[Command, asyncio.Future[Result | None]]] = []  # waiting for the proposal in flight
        # The metadata versions whose seals and trims this node has followed whole (the per-tick passes over every
        # partition run again only after a change)
        self._seals_seen: int | None = None
        self._leads_saw: int | None = None  # the view version every lead last looked at between ticks
        self._trims_seen: int | None = None
        self._proposer: asyncio.Task[None] | None = None
        self._passes: asyncio.Task[None] | None = None  # the seal and trim passes (_follow_store)
        # The deletes (names, incarnations) whose copies this node removed: a pass walks its copies only when they
        # change, not at every version of the view (at 10,000 partitions, a walk of replicas/ each time)
        self._deletes_seen: tuple[tuple[str, int, bool], ...] | None = None
        self.forget_topic: Callable[[str], None] = lambda topic: None  # a deleted topic's metrics series (serve.py)
        store.incarnation_of = self._incarnation_of

    def spawn(self, work: Coroutine[object, object, None]) -> None:
        """Run ``work`` in the background, keeping a reference until it ends."""
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def run_blocking(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def run_metadata(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` in the metadata's own threads (see ``__init__``)."""
        return await asyncio.get_running_loop().run_in_executor(self.metadata_executor, fn, *args)

    async def propose(self, command: Command) -> Result | None:
        """Commit ``command``; None if the metadata could not confirm it (it may still apply: read the view).

        Group commit: the commands proposed while earlier ones are in flight wait, and go together, packed into as
        few :class:`~cluster.site_state.CommandBatch` entries of at most :data:`BATCH_BYTES_MAX` as they fit. A
        controller's elections after a node's death and the recoveries of the leads they make take a few dozen
        commits, not one each (10,000 of them took minutes)."""
        done: asyncio.Future[Result | None] = asyncio.get_running_loop().create_future()
        self._queued.append((command, done))
        if self._proposer is None or self._proposer.done():
            self._proposer = asyncio.create_task(self._propose_queued())
        return await asyncio.shield(done)

    async def _propose_queued(self) -> None:
        while self._queued:
            queued, self._queued = self._queued, []
            packed = batches([c for c, _ in queued], _command_size, BATCH_BYTES_MAX)
            try:
                outcomes = await asyncio.gather(*(self._propose_packed(c) for c in packed), return_exceptions=True)
            except asyncio.CancelledError:  # the member stops: the callers hear "not confirmed"
                for _, done in queued:
                    if not done.done():
                        done.set_result(None)
                raise
            first = 0
            for command, outcome in zip(packed, outcomes, strict=True):
                count = _packed_count(command)
                for k, (_, done) in enumerate(queued[first : first + count]):
                    if done.done():
                        continue
                    if isinstance(outcome, BaseException):  # CommandTooLarge: a lone command, its caller's error
                        done.set_exception(outcome)
                    else:
                        done.set_result(outcome[k])
                first += count

    async def _propose_packed(self, command: Command) -> list[Result | None]:
        """What each command packed in ``command`` gave (None for all if the batch was not confirmed)."""
        count = _packed_count(command)
        try:
            result = await self.run_metadata(self.metadata.propose, command)
        except MetadataUnavailable as exc:
            what = f"a batch of {count} commands" if count > 1 else command.KIND
            log.warning("node %d: %s not confirmed: %s", self.me, what, exc)
            return [None] * count
        if count == 1:
            return [result]
        if isinstance(result, Applied) and len(result.results) == count:
            return list(result.results)
        return [result] * count  # the batch as a whole was refused (a node that cannot decode it): so is each

    def addresses(self) -> dict[NodeId, str]:
        return {n: info.address for n, info in self.metadata.state().nodes().items()}

    # -- life ------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Register, learn which epochs were granted before this start, and tick from now on."""
        result = await self.propose(RegisterNode(self.me, self.address))
        if isinstance(result, Refused):
            raise RegistrationRefused(f"node {self.me} cannot register at {self.address}: {result.reason}")
        await self.run_metadata(self.metadata.read_barrier)
        # Before the first heartbeat (no lead picks this node for a new segment until then): the copies of topics
        # deleted while it was down go, so none is ever taken for a later incarnation's.
        await self._remove_deleted()
        self.core.epochs_at_start = {(i.topic, i.partition): i.leader_epoch for i in self.metadata.state().partitions()}
        self.core.reconciled = None
        await self.run_metadata(self._heartbeat)
        self._task = asyncio.create_task(self._ticks())
        self._beats = HeartbeatThread(self._heartbeat, self.config.tick_ms / 1000, f"heartbeats-{self.me}")
        self._beats.start()

    async def stop(self) -> None:
        if self._beats is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._beats.stop)
        for task in (self._task, self._passes):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self.core.stop(f"node {self.me} stops")  # every lead ends; their shells close here
        await asyncio.gather(*(lead.close() for lead in list(self.leaders.values())), return_exceptions=True)
        self.leaders.clear()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._proposer is not None:
            self._proposer.cancel()
            await asyncio.gather(self._proposer, return_exceptions=True)
        for _, done in self._queued:  # nobody proposes them now: their callers hear "not confirmed"
            if not done.done():
                done.set_result(None)
        self._queued.clear()
        self.metadata_executor.shutdown(wait=False, cancel_futures=True)
        await self.channel.close()

    async def _ticks(self) -> None:
        """A tick every ``tick_ms``; between ticks, a look at the roles as soon as the metadata changes (a new
        leader starts its recovery at once, not up to a tick later), and the controller's look as soon as a
        partition leader's session expires."""
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()

        def on_change() -> None:  # in pysyncobj's thread
            with contextlib.suppress(RuntimeError):  # the loop is closed: the node is stopping
                loop.call_soon_threadsafe(changed.set)

        self.metadata.watch(on_change)
        tick_s = self.config.tick_ms / 1000
        next_tick = loop.time() + tick_s
        while True:
            expiry = self._next_expiry_ms() if self.metadata.is_leader else None
            wait_s = next_tick - loop.time()
            if expiry is not None:
                wait_s = min(wait_s, (expiry - self.clock_ms() + 1) / 1000)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, wait_s)):
                    await changed.wait()
            changed.clear()
            try:
                if loop.time() >= next_tick:
                    next_tick = loop.time() + tick_s
                    self._follow_liveness()
                    await self._controller()
                    self._follow_store()
                    self.reconcile()
                    continue
                if expiry is not None and self.clock_ms() >= expiry:
                    await self._controller()
                self.reconcile()
            except Exception:  # a bug in one tick must not end the member: log it and tick again
                log.exception("node %d: cluster tick failed", self.me)

    def _follow_liveness(self) -> None:
        """Tell the streams' gates which peers the metadata shows dead: no segment writer probes a dead node (after
        a kill, thousands of streams a second tried it), and they try again once its heartbeats come back."""
        now_ms = self.clock_ms()
        timeout_ms = self.config.session_timeout_ms
        nodes = self.metadata.state().nodes()
        self.gates.set_dead(n for n, info in nodes.items() if n != self.me and not info.is_live(now_ms, timeout_ms))

    def _next_expiry_ms(self) -> int | None:
        if self.core.controller is None:
            return None
        return next_leader_expiry_ms(self.metadata.state(), self.clock_ms(), self.config.session_timeout_ms)

    async def tick(self) -> None:
        """The controller's duties, seals, trims and roles (the heartbeats have a task of their own)."""
        await self._controller()
        await self._store_passes()
        self.reconcile()

    def _follow_store(self) -> None:
        """Start the seal and trim passes unless they still run. They wait for the store's threads, which a burst of
        segment opens (a topic of 10,000 partitions, a failover) queues for tens of seconds: in the tick, the
        controller waited behind them, and a dead node's partitions kept their dead leader meanwhile."""
        if self._passes is None or self._passes.done():
            self._passes = asyncio.create_task(self._store_passes())

    async def _store_passes(self) -> None:
        try:
            await self._remove_deleted()
            await self._learn_seals()
            await self._apply_trims()
        except Exception:  # a bug in one pass must not end the next ones
            log.exception("node %d: following the store's seals and trims failed", self.me)

    def _heartbeat(self) -> None:
        """Propose this node's heartbeat and wait for its commit: blocking, in the heartbeat thread
        (heartbeat_thread.py) so that the event loop's bursts do not delay it. In the tick, a heartbeat also waited
        for the tick before it: at 2,000 partitions that held a live node's heartbeats longer than its session."""
        load = leadership.open_loads(self.metadata.state()).get(self.me, 0)
        beat = NodeHeartbeat(self.me, self.clock_ms(), self.free_bytes(), load, self.store.moved.total)
        # Not through the group commit (propose): queued behind a burst of seals and opens (each batch one commit,
        # seconds under load), the heartbeat came late and the node was taken for dead.
        try:
            self.metadata.propose(beat)
        except MetadataUnavailable as exc:
            log.warning("node %d: heartbeat not confirmed: %s", self.me, exc)

    async def _controller(self) -> None:
        """The core's tick: every lead's due retries, and the controller's duties while this node's Raft replica
        leads the metadata log (one controller rule): the elections it proposes, then repair and retention."""
        now_ms = self.clock_ms()
        led_for_s = self.metadata.led_for_s
        elected_ms = None if led_for_s is None else now_ms - int(1000 * led_for_s)
        effects = self.core.tick(self.metadata.state(), now_ms, self.metadata.is_leader, elected_ms=elected_ms)
        self.run(effects)  # the leads' due retries, roll checks and reconnections
        ctl = self.core.controller
        if ctl is None:
            self._retention_due_ms = None
            self.repair = None  # the next controller starts afresh; copies under way finish and are recorded
            return
        # proposed together (one commit for a tick's elections, ``propose``), answered each on its own
        await asyncio.gather(*(self._elect(ctl, eff.command) for eff in effects if isinstance(eff, ProposeElection)))
        # Like elections, repair waits until every live node has heartbeated through this Raft leader: before,
        # live nodes look dead, and their open segments would be rolled for nothing.
        if self.clock_ms() - ctl.since_ms < self.config.session_timeout_ms:
            return
        if self.repair is None or self.repair.ctl is not ctl:
            self.repair = RepairController(self, ctl)
        self.repair.due()
        await self._retention()

    async def _elect(self, ctl: Controller, elect: ElectLeader | FailOver) -> None:
        result: Result | None
        if isinstance(elect, FailOver):
            # Straight to the store, like a heartbeat: behind the group commit it waited for batches of seals and
            # rolls in flight (seconds under load) while every partition of the dead node had no leader.
            try:
                result = await self.run_metadata(self.metadata.propose, elect)
            except MetadataUnavailable as exc:
                log.warning("node %d: the failover of node %d not confirmed: %s", self.me, elect.node, exc)
                result = None
        else:
            result = await self.propose(elect)
        ctl.proposal_done(elect)
        if isinstance(result, Applied) and isinstance(elect, FailOver):
            log.info("controller: node %d's %d partitions moved to new leaders", elect.node, result.moved)
        elif isinstance(result, Applied) and isinstance(elect, ElectLeader):
            log.info(
                "controller: node %d leads %s-%d in epoch %s",
                elect.node,
                elect.topic,
                elect.partition,
                result.leader_epoch,
            )
        elif isinstance(result, Refused) and isinstance(elect, FailOver):
            log.info("controller: failover of node %d refused: %s", elect.node, result.reason)

    async def _retention(self) -> None:
        """Every ``retention_interval_ms``, propose the trims ``plan_retention`` picks (the Raft leader's duty)."""
        now = self.clock_ms()
        if self._retention_due_ms is not None and now < self._retention_due_ms:
            return
        self._retention_due_ms = now + self.config.retention_interval_ms
        for trim in plan_retention(self.metadata.state(), now, self.config.topic_defaults):
            result = await self.propose(trim)
            if isinstance(result, Applied) and result.changed:
                log.info(
                    "controller: retention drops %s-%d's segments before %d",
                    trim.topic,
                    trim.partition,
                    trim.first_segment,
                )

    async def _apply_trims(self) -> None:
        """Follow every committed trim (``TrimChain``): reads below a chain's new start are out of range, and this
        node's copies of the segments before it are deleted. A node that was down when a trim committed deletes
        them here at its first tick, from its view of the metadata."""
        state = self.metadata.state()
        if state.version == self._trims_seen:  # no command since the last whole pass: no trim to follow
            return
        whole = True
        for info in state.partitions():
            if not info.segments or info.segments[0].segment_id == 0:
                continue
            key = (info.topic, info.partition)
            first = info.segments[0].segment_id
            held = self.store.segment_ids(key)
            if self.store.trimmed_before(key) >= first and not (held and held[0] < first):
                continue
            try:
                await self.run_blocking(self.store.trim, key, first)
            except OSError as exc:  # the next tick tries again
                log.error("node %d: deleting %s-%d's copies before segment %d failed: %s", self.me, *key, first, exc)
                whole = False
        if whole:
            self._trims_seen = state.version

    def _incarnation_of(self, topic: str) -> int | None:
        """The live incarnation of ``topic`` in this node's view (the store names its copies by it); None: deleted.
        A topic the view does not know yet is incarnation 0 (a view a little behind the leader's create)."""
        entry = self.metadata.state().entries().get(topic)
        return None if entry is not None and entry.deleted else (0 if entry is None else entry.incarnation)

    async def _remove_deleted(self) -> None:
        """Remove this node's copies of every topic incarnation the view holds deleted (docs/design.md, "Topic
        changes across sites"): at the first pass after a delete, and at start for a node that was down during
        it, whether its view learned the delete by log replay or by a snapshot."""
        entries = self.metadata.state().entries()
        deletes = tuple((n, e.incarnation, e.deleted) for n, e in entries.items() if e.deleted or e.incarnation)
        if deletes == self._deletes_seen:
            return
        try:
            removed = await self.run_blocking(self.store.remove_deleted, entries)
        except OSError as exc:  # the next pass tries again
            log.error("node %d: removing the copies of deleted topics failed: %s", self.me, exc)
            return
        if removed:
            log.warning("node %d: removed its copies of deleted topic incarnations: %s", self.me, ", ".join(removed))
        for name in _newly_deleted(self._deletes_seen or (), deletes):
            self.forget_topic(name)
        self._deletes_seen = deletes

    def _step_down_deleted(self, view: SiteState) -> list[NodeEffect]:
        """Every lead of a partition the view no longer holds (its topic was deleted) ends: waiting acks fail with
        the delete named, and the writer stops."""
        effects: list[NodeEffect] = []
        for key in sorted(self.core.leads):
            if view.partition(*key) is None:
                entry = view.entries().get(key[0])
                site = "" if entry is None else f" at site {entry.stamp.site}"
                effects += self.core.step_down(key, f"topic {key[0]!r} was deleted{site}")
        return effects

    # -- repair and decommission -------------------------------------------------------------------------------

    async def _learn_seals(self) -> None:
        """Carry out what ``cluster.member.seals_to_learn`` says of the seals this node's view shows: record them in
        the guards, and cut every copy longer than its committed seal (a member that was down or cut off when the
        seal was told keeps its tail until it learns the seal here)."""
        state = self.metadata.state()
        # Per change of the metadata, not per tick: a seal is a command (a new version), and once a guard holds a
        # seal the store refuses what would write past it, so no copy outgrows a seal between two versions.
        if state.version == self._seals_seen:
            return
        whole = True
        held = await self.run_blocking(self.store.held)
        ends = {(h.key[0], h.key[1], h.segment_id): int(h.end_offset) for h in held}
        for step in membership.seals_to_learn(state, self.store.guard_states(), ends):
            try:
                if isinstance(step, membership.GuardSeal):
                    await self.run_blocking(self.store.learn_seal, step.key, step.epoch, step.through)
                    continue
                topic, partition, segment_id = step.segment
                log.info(
                    "node %d: %s-%d segment %d was sealed at %d; cutting this copy's tail from %d",
                    self.me,
                    topic,
                    partition,
                    segment_id,
                    step.end,
                    ends[step.segment],
                )
                await self.run_blocking(
                    self.store.seal, (topic, partition), step.epoch, segment_id, step.end, self.clock_ms()
                )
            except (OSError, ReplicaError, QuorumError) as exc:  # the next tick tries again; roles go on meanwhile
                log.error("node %d: learning the seal %s failed: %s", self.me, step, exc)
                whole = False
        if whole:
            self._seals_seen = state.version

    def roll(self, key: PartitionKey, segment_id: SegmentId) -> str | None:
        """The controller asks this node to roll ``segment_id`` of ``key`` (repair's ``RollSegment``): None if it
        rolls (or already does), else why not."""
        lead = self.leaders.get(key)
        if lead is None:
            return f"node {self.me} does not lead {key[0]}-{key[1]}"
        return lead.roll_now(segment_id)

    async def decommission(self, node: NodeId, draining: bool) -> DrainStatus:
        """``DecommissionNode``: set ``node`` draining (or not) through the metadata; how far its drain has got."""
        return await decommission(self, node, draining)

    # -- roles ---------------------------------------------------------------------------------------------

    def reconcile(self) -> None:
        """Start or stop leading each partition as this node's view says (``NodeCore.reconcile``), then let every
        lead look at the view again (a lead waiting for its open or seal to show goes on at once, not a tick
        later)."""
        view, now = self.metadata.state(), self.clock_ms()
        effects = self._step_down_deleted(view) if view.version != self._leads_saw else []
        effects += self.core.reconcile(view, now)
        # Only a view with something new (a version not seen yet) can let a lead go on before its tick; heartbeats
        # (most changes) bring nothing: the leads' due retries wait for the tick, as they would anyway.
        if view.version != self._leads_saw or effects:
            self._leads_saw = view.version
            for key in sorted(self.core.leads):
                effects += self.core.step(view, key, now, lambda lead, ctx: lead.tick(ctx))
        self.run(effects)

    def step(self, key: PartitionKey, epoch: LeaderEpoch, event: LeadEvent) -> None:
        """Feed this node's lead of ``key`` in ``epoch`` an event, and carry out what it returns (nothing once that
        lead ended: a late answer never reaches a newer lead)."""
        lead = self.core.leads.get(key)
        if lead is None or lead.epoch != epoch:
            return
        self.run(self.core.step(self.metadata.state(), key, self.clock_ms(), event))

    def give_up(self, key: PartitionKey, epoch: LeaderEpoch, reason: str) -> None:
        """This node's lead of ``key`` in ``epoch`` failed in its shell (a disk, a bug): it steps down."""
        lead = self.core.leads.get(key)
        if lead is not None and lead.epoch == epoch:
            self.run(self.core.step_down(key, reason))

    def run(self, effects: list[NodeEffect]) -> None:
        """Carry out the core's effects, in order."""
        for eff in effects:
            if isinstance(eff, Leading):
                self.leaders[eff.key] = PartitionLeader(self, eff.key, eff.epoch)
                log.info("node %d leads %s-%d in epoch %d", self.me, *eff.key, eff.epoch)
            elif isinstance(eff, StepDown):
                log.info("node %d steps down from %s-%d epoch %d: %s", self.me, *eff.key, eff.epoch, eff.reason)
                lead = self.leaders.get(eff.key)
                if lead is not None and lead.epoch == eff.epoch:
                    del self.leaders[eff.key]
                    self.spawn(lead.close(eff.reason))
            elif isinstance(eff, ProposeEpoch):
                self.spawn(self._ask(eff))
            elif isinstance(eff, ProposeElection):
                pass  # the controller proposes its elections in order (_controller)
            elif isinstance(eff, RepairCopy | AskRoll):
                # The core's tick plans no repair here (no size_of): the RepairController runs the same controller's
                # repair_plan after its inventory of the members' copies.
                log.error("node %d: the core's tick planned repair: %s", self.me, eff)
            else:
                lead = self.leaders.get(eff.key)
                if lead is not None:
                    lead.perform(eff)

    async def _ask(self, eff: ProposeEpoch) -> None:
        result = await self.propose(eff.command)
        self.core.epoch_asked(eff.key, eff.command.expected_epoch, result)  # not confirmed: asked again


def _newly_deleted(before: tuple[tuple[str, int, bool], ...], now: tuple[tuple[str, int, bool], ...]) -> list[str]:
    """The names of ``now``'s deletes (name, incarnation, deleted) that ``before`` had not seen: a tombstone not
    held before, or a live incarnation above the one after the last tombstone seen (a delete and a re-create
    between two looks). A re-create after a delete seen is not one: its series count from there."""
    seen = {name: (incarnation, deleted) for name, incarnation, deleted in before}
    out = []
    for name, incarnation, deleted in now:
        old = seen.get(name)
        after = None if old is None else old[0] + int(old[1])  # the first incarnation not yet deleted
        if (deleted and old != (incarnation, deleted)) or (not deleted and (after is None or incarnation > after)):
            out.append(name)
    return out


def seal_producers(
    store: ReplicaStore, info: PartitionInfo, segment_id: SegmentId, base: int, end: int, origin: Origin, now_ms: int
) -> ProducerSnapshot:
    """The producers' table a seal of ``segment_id`` at ``end`` carries, from this node's view ``info`` (which shows
    the segment open) and its index of the segment, which it holds up to ``end`` (a roll's writer, or a recovery's
    leader: ``cluster/recovery.py``, rule (S)). Blocking: it reads the store's index."""
    key = (info.topic, info.partition)
    history = history_at_open(info.sealed_producers(origin), lambda: store.entries_before(key, segment_id))
    batches = store.batch_entries(key, segment_id, end) if end > base else []
    return fold(history, origin, batches, now_ms=now_ms)


class PartitionLeader:
    """One partition led by this node in one epoch: the shell of its :class:`~cluster.lead.PartitionLead`, which
    decides everything (recover, open, write, roll). This carries out its effects (recovery's fences and copies,
    proposals, the segment's writer, the broker's attach and detach) and feeds it their outcomes."""

    def __init__(self, member: ClusterMember, key: PartitionKey, epoch: LeaderEpoch) -> None:
        self.member = member
        self.key = key
        self.epoch = epoch
        self.writer: SegmentWriter | None = None
        self._writable = asyncio.Event()  # set while a segment is open for appends
        self._rolling = False
        self._closed = False
        self._blocked: str | None = None  # the last placement wait logged (once per reason)
        self._tasks: set[asyncio.Task[None]] = set()

    def _step(self, event: LeadEvent) -> None:
        if not self._closed:
            self.member.step(self.key, self.epoch, event)

    def _step_writing(self, segment_id: SegmentId, event: LeadEvent) -> None:
        """An event of the writer of ``segment_id``: dropped once the lead writes another segment (a stopping
        writer's late acks are of the old segment, whose ends say nothing of the new one)."""
        lead = self.member.core.leads.get(self.key)
        quorum = lead.quorum if lead is not None and lead.epoch == self.epoch else None
        if quorum is not None and quorum.segment_id == segment_id:
            self._step(event)

    def _spawn(self, work: Coroutine[object, object, None]) -> None:
        """Run an effect in the background; a failure of it (its disk, a bug) ends this leadership."""

        async def run() -> None:
            try:
                await work
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("node %d: leading %s-%d failed", self.member.me, *self.key)
                self.member.give_up(self.key, self.epoch, f"{type(exc).__name__}: {exc}")

        task = asyncio.create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _members(self) -> Members:
        m = self.member
        return Members(m.store, m.me, m.addresses(), m.executor, m.clock_ms, m.channel, m.fences)

    def _info(self) -> PartitionInfo | None:
        return self.member.metadata.state().partition(*self.key)

    async def close(self, reason: str = "") -> None:
        self._closed = True
        self._writable.set()  # appends waiting for a segment wake up and find this leader closed
        writer, self.writer = self.writer, None
        why = f"node {self.member.me} no longer leads epoch {self.epoch}" + (f": {reason}" if reason else "")
        if writer is not None:
            self.member.listener.segment_closed(self, why)
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if writer is not None:
            await writer.close(why)

    # -- the lead's effects ------------------------------------------------------------------------------------

    def perform(self, eff: LeadEffect) -> None:
        if self._closed:
            return
        if isinstance(eff, FenceMember):
            self._spawn(self._answer(fence_member(self._members(), eff)))
        elif isinstance(eff, CopyTail):
            info = self._info()
            start = info.sealed_vector_before(eff.segment.segment_id).to_dict() if info is not None else {}
            self._spawn(self._answer(copy_tail(self._members(), eff, start)))
        elif isinstance(eff, ProposeSeal):
            self._spawn(self._seal(eff))
        elif isinstance(eff, ProposeOpen):
            self._spawn(self._open(eff))
        elif isinstance(eff, Adopted):
            self._spawn(self._write(eff))
        elif isinstance(eff, Sealing):
            self._rolling = True
            self._writable.clear()
            self.member.listener.sealing(self)
            self._spawn(self._roll_checks())
        elif isinstance(eff, SegmentSealed):
            self._sealed(eff)
        elif isinstance(eff, Note):
            self._note(eff)
        elif self.writer is not None:  # StreamTo, Release, Reconnect: the open segment's
            self.writer.perform(eff)

    def _note(self, eff: Note) -> None:
        if eff.what == "placement_wait":
            if eff.message != self._blocked:
                log.warning("node %d: %s", self.member.me, eff.message)  # once per reason: retried every retry_ms
            self._blocked = eff.message
        elif eff.what in ("recovery_failed", "recovery_superseded", "quorum_lost"):
            log.warning("node %d %s-%d: %s: %s", self.member.me, *self.key, eff.what, eff.message)
        else:
            log.info("node %d %s-%d: %s %s", self.member.me, *self.key, eff.what, eff.message)

    async def _answer(self, work: Awaitable[LeadEvent]) -> None:
        self._step(await work)

    async def _open(self, eff: ProposeOpen) -> None:
        result = await self.member.propose(eff.command)
        self._step(lambda lead, ctx: lead.opened(eff.command, result, ctx))

    async def _seal(self, eff: ProposeSeal) -> None:
        """Propose the seal with this node's summary of its copy below the end (a lost result is proposed again)."""
        m = self.member
        info = self._info()
        if info is None:
            raise NotLeader(*self.key, "the topic is gone")
        s, end = eff.segment, eff.end
        start_vector = info.sealed_vector_before(s.segment_id).to_dict()
        if end == s.base_offset:
            # Empty: its end vector is its start. This node may hold no copy of it at all (its writer died before
            # its stream reached this member), and reading one failed the recovery for good.
            summary = SealSummary(VectorOffset(start_vector), 0, None)
        else:
            summary = await m.run_blocking(m.store.seal_summary, self.key, s.segment_id, start_vector, end)
        producers = await m.run_blocking(self._producers_at, info, s.segment_id, int(s.base_offset), end)
        command = SealSegment(
            self.key[0],
            self.key[1],
            self.epoch,
            s.segment_id,
            LocalOffset(end),
            summary.end_vector,
            summary.size_bytes,
            summary.max_timestamp_ms,
            producers,
        )
        result = await m.propose(command)
        self._step(lambda lead, ctx: lead.sealed(eff.token, result, ctx))

    def _producers_at(self, info: PartitionInfo, segment_id: SegmentId, base: int, end: int) -> ProducerSnapshot | None:
        """The producers' table the seal carries; None (the next leader falls back to its copies) only without a
        broker, whose origin says which producers are the site's own."""
        m = self.member
        if m.origin is None:
            return None
        return seal_producers(m.store, info, segment_id, base, end, m.origin, m.clock_ms())

    def _sealed(self, eff: SegmentSealed) -> None:
        """A seal this lead proposed committed: the writer of a rolled segment stops (what waits past the seal fails:
        its producer sends it again) and the broker detaches; every member is told."""
        m = self.member
        writer = self.writer
        if eff.roll and writer is not None and writer.segment.segment_id == eff.segment_id:
            self.writer = None
            self._rolling = False
            m.listener.segment_closed(self, f"segment {eff.segment_id} was sealed at offset {eff.end}")
            log.info("node %d rolled %s-%d segment %d at %d", m.me, *self.key, eff.segment_id, eff.end)
            self._spawn(writer.close("the segment was rolled before this batch was confirmed: send it again"))
        self._spawn(tell_sealed(self._members(), eff))

    # -- writing -------------------------------------------------------------------------------------------------

    async def _write(self, eff: Adopted) -> None:
        m = self.member
        info = self._info()
        if info is None:
            raise NotLeader(*self.key, "the topic is gone")
        start_vector = info.sealed_vector_before(eff.segment_id).to_dict()
        segment = SegmentToWrite(
            self.key, eff.segment_id, eff.base_offset, start_vector, eff.ensemble, eff.ack_quorum, self.epoch
        )
        sid = eff.segment_id
        writer = self.writer = SegmentWriter(
            m.store,
            segment,
            m.me,
            m.addresses(),
            m.executor,
            m.clock_ms,
            lambda event: self._step_writing(sid, event),
            m.tls,
            m.channel,
            m.gates,
        )
        await writer.start()
        while not self._shows_open(eff.segment_id):  # the broker serves the chain its view lists
            await asyncio.sleep(0.02)
        if self._closed or self.writer is not writer:
            return
        self._rolling = False
        self._writable.set()
        m.listener.segment_opened(self)
        log.info(
            "node %d writes %s-%d segment %d from offset %d on %s",
            m.me,
            *self.key,
            eff.segment_id,
            eff.base_offset,
            list(eff.ensemble),
        )

    def _shows_open(self, segment_id: SegmentId) -> bool:
        info = self._info()
        segment = info.open_segment if info is not None else None
        return self._closed or (segment is not None and segment.segment_id >= segment_id)

    async def append(self, batches: bytes) -> tuple[SegmentId, int]:
        """Append whole batches (local prefixes set from the segment's end) to the open segment; returns the
        segment and the appended end. Waits while the segment rolls. Raises ``NotLeader`` once deposed."""
        while True:
            if self._closed:
                raise NotLeader(*self.key, f"this node no longer leads epoch {self.epoch}")
            await self._writable.wait()
            writer = self.writer
            if writer is None or self._rolling or not self._writable.is_set():
                await asyncio.sleep(0)
                continue
            end = await writer.append(batches)
            self._roll_if_full()
            return writer.segment.segment_id, end

    def note_appended(self, end: int) -> None:
        """The broker appended to the open segment's copy itself (``ChainLog``), up to ``end``."""
        writer = self.writer
        if writer is None or self._closed:
            raise NotLeader(*self.key, f"node {self.member.me} no longer writes epoch {self.epoch}")
        writer.appended(end)
        self._roll_if_full()

    def _roll_if_full(self) -> None:
        writer = self.writer
        if writer is None or self._rolling:
            return
        if self.member.store.size_of(self.key, writer.segment.segment_id) >= self.member.config.segment_bytes:
            self._step(lambda lead, ctx: lead.start_roll(ctx.now_ms))

    def end_offset(self) -> int:
        """Where the next batch goes: the open segment's appended end."""
        if self.writer is None:
            raise NotLeader(*self.key, "no segment is open yet")
        return self.writer.appended_end

    async def confirmed(self, end_offset: int) -> None:
        """``acks=all``: returns once the lead releases ``[.., end_offset)`` (``min_insync_replicas`` members hold
        it fsynced, and never past the end a roll seals at: what lies past it is cut, and its producer sends it
        again)."""
        writer = self.writer
        if writer is None:
            raise NotLeader(*self.key, "no segment is open")
        await writer.confirmed(end_offset)

    # -- rolling ---------------------------------------------------------------------------------------------

    def roll_now(self, segment_id: SegmentId) -> str | None:
        """Roll open ``segment_id`` now (the controller asks: a member is dead or draining, or it is short and a node
        can join the next one). None if it rolls (or already does), else why not."""
        writer = self.writer
        if self._closed:
            return f"node {self.member.me} no longer leads epoch {self.epoch}"
        if writer is None or writer.segment.segment_id != segment_id:
            return f"segment {segment_id} is not the open segment this leader writes"
        self._step(lambda lead, ctx: lead.start_roll(ctx.now_ms))
        return None

    async def _roll_checks(self) -> None:
        """While the segment rolls, let the lead look for its seal often (the LAC moves between ticks)."""
        while self._rolling and not self._closed:
            self._step(lambda lead, ctx: lead.roll_check(ctx))
            lead = self.member.core.leads.get(self.key)
            waiting = lead is not None and lead.seal_end is None
            await asyncio.sleep(0.01 if waiting else self.member.config.retry_ms / 1000)
