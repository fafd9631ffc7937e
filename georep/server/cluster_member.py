"""A node's part in its site's cluster: heartbeats, the controller, and leading partitions. Shell.

Every decision is pure and shared with the cluster simulator
(``georep/sim/cluster.py``):

==========================================  ==============================================
decision                                    pure code, driven here by
==========================================  ==============================================
who leads which partition                   ``plan_leadership``: the Raft leader's tick
lead, recover first, step down, ask again   ``role_step``: every tick, on this node's view
recovering the predecessor's open segment   ``SegmentRecovery`` (``recover_segment``)
which segment to write next, on whom        ``plan_open`` over ``node_loads``
the LAC                                     ``SegmentQuorum`` (``SegmentWriter``)
where a roll seals                          ``roll_seal_at``
what to copy, fill or roll; which           ``plan_repair``, ``plan_leader_moves``: the
leaderships leave a draining node           Raft leader's ``RepairController`` (``site_repair.py``)
which sealed segments retention drops       ``plan_retention``: the Raft leader's tick, every
                                            ``retention_interval_ms``; each node deletes its
                                            copies once it sees the trim (``_apply_trims``)
==========================================  ==============================================

:class:`ClusterMember` ticks every ``tick_ms``: it reports its heartbeat
(free bytes and load), lets the Raft leader run the controller (elections,
and a repair pass every ``repair_interval_ms`` in the background, once it
has led the Raft log for a session, as for elections), cuts its copies of
sealed segments that are longer than their committed seal (a seal it was
not told of: it was down, or cut off), and reconciles its role in every
partition with its view of the metadata. A
:class:`PartitionLeader` is one partition led in one epoch: it recovers the
open segment it inherited, opens the next one, writes it through a
:class:`~georep.server.ensemble.SegmentWriter`, and rolls it by size.

**This incarnation's epochs.** ``role_step`` must know whether the current
epoch was granted after this process started (an earlier incarnation may
have written under an older grant). At start the member waits until its
view holds everything committed (``read_barrier``) and records each
partition's epoch: an epoch at or below that was granted before it.

Metadata calls block (pysyncobj), so they run in the executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from cluster import leadership
from cluster import member as membership
from cluster.controller import Controller
from cluster.ids import LeaderEpoch, NodeId, SegmentId
from cluster.node import NodeConfig, NodeCore, ProposeElection
from cluster.producer_snapshot import ProducerSnapshot, fold, history_at_open
from cluster.quorum import QuorumError
from cluster.repair import DrainStatus
from cluster.retention import plan_retention
from cluster.site_state import (
    Applied,
    Command,
    ElectLeader,
    NodeHeartbeat,
    PartitionInfo,
    RefusalCode,
    Refused,
    RegisterNode,
    Result,
    SealSegment,
    SegmentInfo,
    SiteState,
    next_leader_expiry_ms,
)
from georep.broker.errors import NotLeader, RecoveryFailed
from georep.raft.store import MetadataUnavailable
from georep.security.tls import TlsConfig, channels
from georep.server.ensemble import SegmentToWrite, SegmentWriter
from georep.server.recovery import SegmentToRecover, recover_segment, tell_sealed
from georep.server.site_repair import RepairController, decommission
from georep.storage.replica_store import PartitionKey, ReplicaError, ReplicaStore, SealSummary
from offsets.coordinates import LocalOffset, Origin
from offsets.vector import VectorOffset

log = logging.getLogger(__name__)

T = TypeVar("T")


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
    return NodeConfig(config.replication_factor, config.ack_quorum, config.session_timeout_ms, config.tick_ms,
                      config.retry_ms, config.roll_wait_ms, repair_every_ms=config.repair_interval_ms,
                      repair_delay_ms=config.repair_delay_ms,
                      max_concurrent_copies=config.max_concurrent_copies)  # fmt: skip


class ClusterMember:
    """One node of a multi-node site; see the module docstring."""

    def __init__(self, me: NodeId, address: str, metadata: Metadata, store: ReplicaStore, executor: ThreadPoolExecutor,
                 clock_ms: Callable[[], int], free_bytes: Callable[[], int], config: ClusterConfig | None = None,
                 tls: TlsConfig | None = None) -> None:  # fmt: skip
        self.me = me
        self.address = address
        self.metadata = metadata
        self.store = store
        self.executor = executor
        self.clock_ms = clock_ms
        self.free_bytes = free_bytes
        self.config = config or ClusterConfig()
        self.tls = tls
        self.channel = channels(tls)
        self.leaders: dict[PartitionKey, PartitionLeader] = {}
        self.listener: LeaderListener = _NoListener()
        self.origin: Origin | None = None  # the site's (its broker's): seals fold its own producers' batches
        self._given_up: dict[PartitionKey, LeaderEpoch] = {}
        self._epochs_at_start: dict[PartitionKey, LeaderEpoch] = {}
        self._asked: dict[PartitionKey, LeaderEpoch] = {}  # re-elections of itself in flight
        # The node's decisions (cluster/node.py): the controller's, as the cluster simulators take them.
        self.core = NodeCore(me, node_config(self.config), {})
        self._retention_due_ms: int | None = None  # the controller's next retention plan
        self.repair: RepairController | None = None  # while this node is the Raft leader
        self._task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()

    def spawn(self, work: Coroutine[object, object, None]) -> None:
        """Run ``work`` in the background, keeping a reference until it ends."""
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def run_blocking(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def propose(self, command: Command) -> Result | None:
        """Commit ``command``; None if the metadata could not confirm it (it may still apply: read the view)."""
        try:
            return await self.run_blocking(self.metadata.propose, command)
        except MetadataUnavailable as exc:
            log.warning("node %d: %s not confirmed: %s", self.me, command.KIND, exc)
            return None

    def addresses(self) -> dict[NodeId, str]:
        return {n: info.address for n, info in self.metadata.state().nodes().items()}

    # -- life ------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Register, learn which epochs were granted before this start, and tick from now on."""
        result = await self.propose(RegisterNode(self.me, self.address))
        if isinstance(result, Refused):
            raise RegistrationRefused(f"node {self.me} cannot register at {self.address}: {result.reason}")
        await self.run_blocking(self.metadata.read_barrier)
        self._epochs_at_start = {(i.topic, i.partition): i.leader_epoch for i in self.metadata.state().partitions()}
        await self._heartbeat()
        self._task = asyncio.create_task(self._ticks())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*(lead.close() for lead in list(self.leaders.values())), return_exceptions=True)
        self.leaders.clear()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

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
                    await self.tick()
                    continue
                if expiry is not None and self.clock_ms() >= expiry:
                    await self._controller()
                self.reconcile()
            except Exception:  # a bug in one tick must not end the member: log it and tick again
                log.exception("node %d: cluster tick failed", self.me)

    def _next_expiry_ms(self) -> int | None:
        if self.core.controller is None:
            return None
        return next_leader_expiry_ms(self.metadata.state(), self.clock_ms(), self.config.session_timeout_ms)

    async def tick(self) -> None:
        await self._heartbeat()
        await self._controller()
        await self._learn_seals()
        await self._apply_trims()
        self.reconcile()

    async def _heartbeat(self) -> None:
        load = leadership.open_loads(self.metadata.state()).get(self.me, 0)
        free = await self.run_blocking(self.free_bytes)
        await self.propose(NodeHeartbeat(self.me, self.clock_ms(), free, load, self.store.moved.total))

    async def _controller(self) -> None:
        """The controller's duties while this node's Raft replica leads the metadata log (``NodeCore.tick``, one
        controller rule): the elections it proposes, then repair and retention."""
        effects = self.core.tick(self.metadata.state(), self.clock_ms(), self.metadata.is_leader)
        ctl = self.core.controller
        if ctl is None:
            self._retention_due_ms = None
            self.repair = None  # the next controller starts afresh; copies under way finish and are recorded
            return
        for eff in effects:
            if isinstance(eff, ProposeElection):
                await self._elect(ctl, eff.command)
        # Like elections, repair waits until every live node has heartbeated through this Raft leader: before,
        # live nodes look dead, and their open segments would be rolled for nothing.
        if self.clock_ms() - ctl.since_ms < self.config.session_timeout_ms:
            return
        if self.repair is None:
            self.repair = RepairController(self)
        self.repair.due()
        await self._retention()

    async def _elect(self, ctl: Controller, elect: ElectLeader) -> None:
        result = await self.propose(elect)
        ctl.election_done((elect.topic, elect.partition), elect.expected_epoch)
        if isinstance(result, Applied):
            log.info("controller: node %d leads %s-%d in epoch %s", elect.node, elect.topic, elect.partition,
                     result.leader_epoch)  # fmt: skip

    async def _retention(self) -> None:
        """Every ``retention_interval_ms``, propose the trims ``plan_retention`` picks (the Raft leader's duty)."""
        now = self.clock_ms()
        if self._retention_due_ms is not None and now < self._retention_due_ms:
            return
        self._retention_due_ms = now + self.config.retention_interval_ms
        for trim in plan_retention(self.metadata.state(), now, self.config.topic_defaults):
            result = await self.propose(trim)
            if isinstance(result, Applied) and result.changed:
                log.info("controller: retention drops %s-%d's segments before %d", trim.topic, trim.partition,
                         trim.first_segment)  # fmt: skip

    async def _apply_trims(self) -> None:
        """Follow every committed trim (``TrimChain``): reads below a chain's new start are out of range, and this
        node's copies of the segments before it are deleted. A node that was down when a trim committed deletes
        them here at its first tick, from its view of the metadata."""
        state = self.metadata.state()
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

    # -- repair and decommission -------------------------------------------------------------------------------

    async def _learn_seals(self) -> None:
        """Carry out what ``cluster.member.seals_to_learn`` says of the seals this node's view shows: record them in
        the guards, and cut every copy longer than its committed seal (a member that was down or cut off when the
        seal was told keeps its tail until it learns the seal here)."""
        state = self.metadata.state()
        held = await self.run_blocking(self.store.held)
        ends = {(h.key[0], h.key[1], h.segment_id): int(h.end_offset) for h in held}
        for step in membership.seals_to_learn(state, self.store.guard_states(), ends):
            try:
                if isinstance(step, membership.GuardSeal):
                    await self.run_blocking(self.store.learn_seal, step.key, step.epoch, step.through)
                    continue
                topic, partition, segment_id = step.segment
                log.info("node %d: %s-%d segment %d was sealed at %d; cutting this copy's tail from %d", self.me,
                         topic, partition, segment_id, step.end, ends[step.segment])  # fmt: skip
                await self.run_blocking(self.store.seal, (topic, partition), step.epoch, segment_id, step.end,
                                        self.clock_ms())  # fmt: skip
            except (OSError, ReplicaError, QuorumError) as exc:  # the next tick tries again; roles go on meanwhile
                log.error("node %d: learning the seal %s failed: %s", self.me, step, exc)

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
        """Start or stop leading each partition as this node's view says (``role_step``)."""
        for info in self.metadata.state().partitions():
            key = (info.topic, info.partition)
            while True:
                lead = self.leaders.get(key)
                fresh = info.leader_epoch > self._epochs_at_start.get(key, LeaderEpoch(0))
                step = leadership.role_step(info, self.me, lead.epoch if lead is not None else None,
                                            self._given_up.get(key, LeaderEpoch(0)), fresh)  # fmt: skip
                if isinstance(step, leadership.StepDown) and lead is not None:
                    self.step_down(lead, step.reason)
                    continue
                break
            if isinstance(step, leadership.AskEpoch) and self._asked.get(key) != info.leader_epoch:
                self._asked[key] = info.leader_epoch
                self.spawn(self._ask(key, step.command))
            elif isinstance(step, leadership.Lead):
                lead = self.leaders[key] = PartitionLeader(self, key, step.epoch, step.recover)
                log.info("node %d leads %s-%d in epoch %d", self.me, *key, step.epoch)
                lead.start()

    async def _ask(self, key: PartitionKey, command: ElectLeader) -> None:
        result = await self.propose(command)
        if result is None:
            self._asked.pop(key, None)  # not confirmed: ask again at the next look

    def step_down(self, lead: PartitionLeader, reason: str) -> None:
        log.info("node %d steps down from %s-%d epoch %d: %s", self.me, *lead.key, lead.epoch, reason)
        if self.leaders.get(lead.key) is lead:
            del self.leaders[lead.key]
        self._given_up[lead.key] = max(self._given_up.get(lead.key, LeaderEpoch(0)), lead.epoch)
        self.spawn(lead.close())


def seal_producers(store: ReplicaStore, info: PartitionInfo, segment_id: SegmentId, base: int, end: int, origin: Origin,
                   now_ms: int) -> ProducerSnapshot:  # fmt: skip
    """The producers' table a seal of ``segment_id`` at ``end`` carries, from this node's view ``info`` (which shows
    the segment open) and its index of the segment, which it holds up to ``end`` (a roll's writer, or a recovery's
    leader: ``cluster/recovery.py``, rule (S)). Blocking: it reads the store's index."""
    key = (info.topic, info.partition)
    history = history_at_open(info.sealed_producers(origin), lambda: store.entries_before(key, segment_id))
    batches = store.batch_entries(key, segment_id, end) if end > base else []
    return fold(history, origin, batches, now_ms=now_ms)


class PartitionLeader:
    """One partition led by this node in one epoch: recover, open, write, roll."""

    def __init__(self, member: ClusterMember, key: PartitionKey, epoch: LeaderEpoch,
                 recover: SegmentInfo | None) -> None:  # fmt: skip
        self.member = member
        self.key = key
        self.epoch = epoch
        self._recover = recover
        self.writer: SegmentWriter | None = None
        self._segment: SegmentToWrite | None = None
        self._sealed_through: SegmentId | None = None
        self._previous: tuple[NodeId, ...] = ()
        self._writable = asyncio.Event()  # set while a segment is open for appends
        self._rolling = False
        self._release_limit: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        self._closed = True
        self._writable.set()  # appends waiting for a segment wake up and find this leader closed
        if self.writer is not None:
            self.member.listener.segment_closed(self, f"node {self.member.me} no longer leads epoch {self.epoch}")
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.writer is not None:
            await self.writer.close()

    def _info(self) -> PartitionInfo | None:
        return self.member.metadata.state().partition(*self.key)

    async def _run(self) -> None:
        try:
            if self._recover is not None:
                await self._recover_segment(self._recover)
            await self._open_next()
        except NotLeader as exc:
            self.member.step_down(self, str(exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a failure of this leadership (its disk, a bug): give the partition up
            log.exception("node %d: leading %s-%d failed", self.member.me, *self.key)
            self.member.step_down(self, f"{type(exc).__name__}: {exc}")

    # -- recovery --------------------------------------------------------------------------------------------

    async def _recover_segment(self, segment: SegmentInfo) -> None:
        m, info = self.member, self._info()
        start_vector = info.sealed_vector_before(segment.segment_id).to_dict() if info is not None else {}
        target = SegmentToRecover(self.key, segment.segment_id, segment.base_offset, start_vector, segment.ensemble,
                                  m.config.ack_quorum, self.epoch)  # fmt: skip

        async def seal(segment_id: SegmentId, end: LocalOffset) -> str | None:
            if end == segment.base_offset:
                # Empty: its end vector is its start. This node may hold no copy of it at all (its writer died
                # before its stream reached this member), and reading one failed the recovery for good.
                summary = SealSummary(VectorOffset(start_vector), 0, None)
            else:
                summary = await m.run_blocking(m.store.seal_summary, self.key, segment_id, start_vector, end)
            producers = await m.run_blocking(self._producers_at, segment_id, segment.base_offset, end)
            return await self._seal(SealSegment(self.key[0], self.key[1], self.epoch, segment_id, end,
                                                summary.end_vector, summary.size_bytes,
                                                summary.max_timestamp_ms, producers))  # fmt: skip

        while True:
            try:
                await recover_segment(m.store, target, m.me, m.addresses(), seal, m.executor, m.clock_ms, m.tls)
                break
            except RecoveryFailed as exc:
                log.warning("%s; retrying in %d ms", exc, m.config.retry_ms)
                await asyncio.sleep(m.config.retry_ms / 1000)
        self._sealed_through = segment.segment_id
        self._previous = segment.ensemble

    def _producers_at(self, segment_id: SegmentId, base: int, end: int) -> ProducerSnapshot | None:
        """The producers' table the seal carries; None (the next leader falls back to its copies) only without a
        broker, whose origin says which producers are the site's own."""
        m, info = self.member, self._info()
        if info is None:
            raise NotLeader(*self.key, "the topic is gone")
        if m.origin is None:
            return None
        return seal_producers(m.store, info, segment_id, base, end, m.origin, m.clock_ms())

    async def _seal(self, command: SealSegment) -> str | None:
        """Commit a seal (retried while the metadata cannot confirm it: sealing again at the same end is a no-op);
        None once committed, or the reason it was refused."""
        while True:
            result = await self.member.propose(command)
            if isinstance(result, Applied):
                return None
            if isinstance(result, Refused):
                return result.reason
            if self._closed:
                return "this leader stopped"
            await asyncio.sleep(self.member.config.retry_ms / 1000)

    # -- opening and writing ---------------------------------------------------------------------------------

    async def _open_next(self) -> None:
        m = self.member
        blocked: str | None = None
        while not self._closed:
            info = self._info()
            if info is None:
                raise NotLeader(*self.key, "the topic is gone")
            loads = leadership.node_loads(m.metadata.state(), m.clock_ms(), m.config.session_timeout_ms)
            step = leadership.plan_open(info, m.me, self.epoch, self._sealed_through, self._previous, loads,
                                        m.config.replication_factor, min_ensemble=m.config.ack_quorum)  # fmt: skip
            if isinstance(step, leadership.Adopt):
                await self._write(step, info)
                return
            if isinstance(step, leadership.ProposeOpen):
                result = await m.propose(step.command)
                if isinstance(result, Refused) and result.code is RefusalCode.STALE_EPOCH:
                    raise NotLeader(*self.key, result.reason)
                continue  # applied: the next view shows it open (Adopt); otherwise look again
            if isinstance(step, leadership.Blocked) and step.reason != blocked:
                log.warning("node %d: %s", m.me, step.reason)  # once per reason: it is retried every retry_ms
            blocked = step.reason if isinstance(step, leadership.Blocked) else None
            await asyncio.sleep(m.config.retry_ms / 1000 if isinstance(step, leadership.Blocked) else 0.02)

    async def _write(self, open_: leadership.Adopt, info: PartitionInfo) -> None:
        m = self.member
        start_vector = info.sealed_vector_before(open_.segment_id).to_dict()
        self._segment = SegmentToWrite(self.key, open_.segment_id, open_.base_offset, start_vector, open_.ensemble,
                                       m.config.ack_quorum, self.epoch)  # fmt: skip
        self.writer = SegmentWriter(m.store, self._segment, m.me, m.addresses(), m.executor, m.clock_ms, m.tls)
        await self.writer.start()
        self._release_limit = None
        self._rolling = False
        self._writable.set()
        m.listener.segment_opened(self)
        log.info("node %d writes %s-%d segment %d from offset %d on %s", m.me, *self.key, open_.segment_id,
                 open_.base_offset, list(open_.ensemble))  # fmt: skip

    async def append(self, batches: bytes) -> tuple[SegmentId, int]:
        """Append whole batches (local prefixes set from the segment's end) to the open segment; returns the
        segment and the appended end. Waits while the segment rolls. Raises ``NotLeader`` once deposed."""
        while True:
            if self._closed:
                raise NotLeader(*self.key, f"this node no longer leads epoch {self.epoch}")
            await self._writable.wait()
            writer, segment = self.writer, self._segment
            if writer is None or segment is None or self._rolling:
                continue
            end = await writer.append(batches)
            self._roll_if_full()
            return segment.segment_id, end

    def note_appended(self, end: int) -> None:
        """The broker appended to the open segment's copy itself (``ChainLog``), up to ``end``."""
        writer = self.writer
        if writer is None or self._closed:
            raise NotLeader(*self.key, f"node {self.member.me} no longer writes epoch {self.epoch}")
        writer.appended(end)
        self._roll_if_full()

    def _roll_if_full(self) -> None:
        if not self._rolling and self._copy_bytes() >= self.member.config.segment_bytes:
            self.member.spawn(self._roll())

    def end_offset(self) -> int:
        """Where the next batch goes: the open segment's appended end."""
        if self.writer is None:
            raise NotLeader(*self.key, "no segment is open yet")
        return self.writer.quorum.appended_end

    async def confirmed(self, end_offset: int) -> None:
        """``acks=all``: returns once ``min_insync_replicas`` members hold ``[.., end_offset)`` fsynced, and never
        past the end a roll seals at (what lies past it is cut, and its producer sends it again)."""
        writer = self.writer
        if writer is None:
            raise NotLeader(*self.key, "no segment is open")
        await writer.confirmed(end_offset)
        if self._release_limit is not None and end_offset > self._release_limit:
            raise NotLeader(*self.key, "the segment was rolled before this batch was confirmed: send it again")

    def _copy_bytes(self) -> int:
        segment = self._segment
        if segment is None:
            return 0
        return self.member.store.size_of(self.key, segment.segment_id)

    # -- rolling ---------------------------------------------------------------------------------------------

    def roll_now(self, segment_id: SegmentId) -> str | None:
        """Roll open ``segment_id`` now (the controller asks: a member is dead or draining, or it is short and a node
        can join the next one). None if it rolls (or already does), else why not."""
        segment = self._segment
        if self._closed:
            return f"node {self.member.me} no longer leads epoch {self.epoch}"
        if segment is None or segment.segment_id != segment_id:
            return f"segment {segment_id} is not the open segment this leader writes"
        if not self._rolling and self._writable.is_set():
            self.member.spawn(self._roll())
        return None

    async def _roll(self) -> None:
        if self._rolling or self.writer is None or self._segment is None:
            return
        m, writer, segment = self.member, self.writer, self._segment
        self._rolling = True
        self._writable.clear()
        m.listener.sealing(self)
        since = m.clock_ms()
        while (end := leadership.roll_seal_at(writer.lac, writer.quorum.appended_end, since, m.clock_ms(),
                                              m.config.roll_wait_ms)) is None:  # fmt: skip
            await asyncio.sleep(0.01)
        self._release_limit = end
        summary = await m.run_blocking(m.store.seal_summary, self.key, segment.segment_id, segment.start_vector, end)
        producers = await m.run_blocking(self._producers_at, segment.segment_id, segment.base_offset, end)
        refused = await self._seal(SealSegment(self.key[0], self.key[1], self.epoch, segment.segment_id,
                                               LocalOffset(end), summary.end_vector, summary.size_bytes,
                                               summary.max_timestamp_ms, producers))  # fmt: skip
        if refused is not None:
            m.step_down(self, f"roll refused: {refused}")
            return
        await writer.close()
        m.listener.segment_closed(self, f"segment {segment.segment_id} was sealed at offset {end}")
        await tell_sealed(m.store, self.key, segment.segment_id, self.epoch, LocalOffset(end), segment.ensemble, m.me,
                          m.addresses(), m.executor, m.clock_ms, m.channel)  # fmt: skip
        log.info("node %d rolled %s-%d segment %d at %d", m.me, *self.key, segment.segment_id, end)
        self._sealed_through = segment.segment_id
        self._previous = segment.ensemble
        self.writer = self._segment = None
        await self._open_next()
