"""Repair and decommission on a multi-node site: what the planner asks for, carried out. Shell.

Every decision is pure and shared with the cluster simulator
(``georep/sim/cluster.py``), which drives the same planner the same way:

==============================================  ==========================================================
decision                                        pure code
==============================================  ==========================================================
which sealed segments to copy, from/to where    ``cluster.repair.plan_repair`` (``CopySegment``,
                                                ``FillSegment``), with the concurrency bound
which open segments to roll                     ``plan_repair`` (``RollSegment``)
which leaderships leave a draining node, to     ``cluster.repair.plan_leader_moves``
whom
how far a decommission has got                  ``cluster.repair.drain_status``
==============================================  ==========================================================

:class:`RepairController` runs on the Raft leader (``ClusterMember``'s
controller starts a pass every ``repair_interval_ms``, one at a time, never
inside the tick, so that a slow member cannot delay this node's heartbeat).
A pass:

1. **Learns which members hold each sealed segment whole**, as the simulator's
   members report it: it asks every live node for its copies
   (``ListSegments``: each copy's fsynced end and size; this node reads its
   own store). A member whose fsynced end is below the sealed end, or that
   has no copy, is *short* (``SegmentView.short``): never a source, and
   filled. A live node that does not answer counts as short for every
   segment it is a member of, which is the safe side: it is not read from,
   and a fill of a copy that turns out whole copies nothing. The segment's
   size is the largest copy reported (0 if none), which the planner needs to
   choose a target with room.
2. **Runs the planner** on this node's view of the metadata, with
   ``down_since`` (when this controller first saw each node dead: a new
   controller starts the repair delay again, as the simulator's does) and
   the copies in flight or backing off.
3. **Carries out each effect.** A copy (or fill) is done by its target:
   ``CopySegment`` tells it to read the sealed range from the source with
   ``ReadSegment`` from the end it holds, append every batch to its
   ``ReplicaStore`` only after checking its CRC, fsync, and answer only then
   (:func:`copy_in`). The controller then proposes ``ReplaceMember`` or
   ``AddMember`` (not for a fill: the target is a member already). A roll is
   asked of the partition's leader (``RollSegment``); none is asked when the
   leader is dead (the election does it) or is the member being rolled away
   from (``plan_leader_moves`` moves a draining leader first, which rolls by
   recovery). A leadership move is an ``ElectLeader``.

**Bounds and retries.** At most ``max_concurrent_copies`` copies run at once
(the planner counts the ones in flight). A copy that fails stays counted as
in progress for a backoff (``retry_ms``, doubled per consecutive failure of
the same repair, at most :data:`BACKOFF_MAX_MS`), so the planner does not
plan it again at once; then it is dropped and planned afresh, maybe from
another source or to another target. A copy the metadata refuses to record
(another repair completed the segment first) is dropped at once: the next
pass plans from the new state.

**Logged once.** A copy, fill, roll or leadership move is logged when it
starts, with what and why (who is dead for how long, or draining, or what is
short), and again when it ends or fails; what the planner reports every pass
(a segment waiting for the repair delay, one that cannot be repaired now and
why, a copy waiting for a slot) is logged when it first appears and again
only if it goes away and comes back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import grpc

from cluster import leadership
from cluster.placement import NodeLoad
from cluster.quorum import QuorumError
from cluster.repair import (
    AwaitingRepairDelay,
    CopyDeferred,
    CopySegment,
    DrainStatus,
    FillSegment,
    LeadershipStuck,
    LeaderView,
    MoveLeadership,
    RollSegment,
    SegmentKey,
    SegmentView,
    drain_status,
    plan_leader_moves,
    plan_repair,
)
from cluster.site_state import AddMember, Applied, Command, ElectLeader, Refused, ReplaceMember, SetDraining, SiteState
from georep.broker.errors import BrokerError, InvalidRequest, NodeStopping, SegmentUnreadable
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.proto.convert import vector_to_proto
from georep.raft.store import MetadataUnavailable
from georep.security.tls import TlsConfig, client_channel
from georep.storage.replica_store import HeldCopy, PartitionKey, ReplicaError, ReplicaStore
from offsets.coordinates import LocalOffset, Origin, OriginSeq
from offsets.vector import VectorOffset
from topology.ids import LeaderEpoch, NodeId, SegmentId

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    from georep.server.cluster_member import ClusterMember

log = logging.getLogger(__name__)

LIST_TIMEOUT_S = 2.0  # a member's ListSegments: a pass waits for it at most this long
ROLL_TIMEOUT_S = 5.0
COPY_TIMEOUT_S_MIN = 60.0  # a copy's call: this, plus the segment's size at COPY_BYTES_PER_S_MIN
COPY_BYTES_PER_S_MIN = 4 << 20
READ_MAX_BYTES = 1 << 20  # per ReadSegment response of a copy
BACKOFF_MAX_MS = 10_000
ROLL_ASK_EVERY_MS = 2_000  # a roll asked of a leader is asked again after this, if the segment is still open
PROPOSE_ATTEMPTS = 5


class CopyFailed(SegmentUnreadable):
    """A repair copy could not read the sealed segment whole from its source (UNAVAILABLE: the controller retries,
    maybe from another member). The batches it did append were whole and checked, and stay."""


class NodeNotInSite(InvalidRequest):
    """A decommission of a node id the site's metadata does not list."""


class MetadataNotConfirmed(NodeStopping):
    """The site's metadata did not confirm a change in time (no Raft majority, or a leader change): retry. Mapped,
    like ``NodeStopping``, to UNAVAILABLE."""


@dataclass(frozen=True, slots=True)
class SealedRange:
    """A sealed segment as the metadata describes it: what a copy must hold once done."""

    key: PartitionKey
    segment_id: SegmentId
    base_offset: int
    start_vector: Mapping[Origin, OriginSeq]  # the end vector of the segment before it
    end_offset: int  # the sealed end


# -- the target's side ------------------------------------------------------------------------------------------


async def copy_in(store: ReplicaStore, segment: SealedRange, source: str, executor: ThreadPoolExecutor,
                  now_ms: int, tls: TlsConfig | None = None,
                  timeout_s: float = COPY_TIMEOUT_S_MIN) -> tuple[LocalOffset, int]:  # fmt: skip
    """Copy sealed ``segment`` into this node's store from the member at ``source`` (``ReadSegment``), from the end
    this node holds; fsync. Returns the fsynced end and the bytes read. Each chunk's CRCs are checked before it is
    appended (``ReplicaStore.append_sealed_copy``). Raises :class:`CopyFailed` when the source cannot be read or
    holds less than the sealed end, and the store's errors (``CorruptReplicaChunk``: a batch failed its CRC)."""
    loop = asyncio.get_running_loop()
    key, sid, end = segment.key, segment.segment_id, segment.end_offset
    held = await loop.run_in_executor(executor, store.open_sealed_copy, key, sid, segment.base_offset,
                                      dict(segment.start_vector), now_ms)  # fmt: skip
    copied = 0
    if held < end:
        request = pb.ReadSegmentRequest(segment=pb.SegmentRef(topic=key[0], partition=key[1], segment_id=sid),
                                        offset=held, end_offset=end, max_bytes=READ_MAX_BYTES)  # fmt: skip
        try:
            async with client_channel(source, tls) as ch:
                async for response in pbg.SegmentsStub(ch).ReadSegment(request, timeout=timeout_s):
                    await loop.run_in_executor(executor, store.append_sealed_copy, key, sid, end, response.batches)
                    copied += len(response.batches)
        except grpc.aio.AioRpcError as exc:
            raise CopyFailed(f"copying segment {sid} of {key[0]}-{key[1]} from {source}: {exc.code().name}: "
                             f"{exc.details()}") from None  # fmt: skip
    flushed = await loop.run_in_executor(executor, store.flush, key, sid)
    if flushed < end:
        raise CopyFailed(f"copying segment {sid} of {key[0]}-{key[1]} from {source}: it sent up to offset {flushed}, "
                         f"short of the sealed end {end}: it holds less than the seal; copy from another member")
    return flushed, copied


def copy_timeout_s(size_bytes: int) -> float:
    return COPY_TIMEOUT_S_MIN + size_bytes / COPY_BYTES_PER_S_MIN


# -- what the planner is given ------------------------------------------------------------------------------------


def segment_views(state: SiteState, held: Mapping[NodeId, Mapping[SegmentKey, HeldCopy]],
                  loads: Mapping[NodeId, NodeLoad]) -> list[SegmentView]:  # fmt: skip
    """Every segment of the metadata as the planner takes it: ``short`` from what the live members reported
    (``held``; a live member absent from it did not answer, and counts as short), the size from the largest copy
    reported."""
    views: list[SegmentView] = []
    for info in state.partitions():
        for s in info.segments:
            key: SegmentKey = (info.topic, info.partition, s.segment_id)
            copies = [h[key] for h in held.values() if key in h]
            short: tuple[NodeId, ...] = ()
            if s.sealed and s.end_offset is not None:
                end = s.end_offset
                short = tuple(m for m in s.ensemble
                              if m in loads and loads[m].alive
                              and (key not in held.get(m, {}) or held[m][key].flushed_offset < end))  # fmt: skip
            views.append(SegmentView(info.topic, info.partition, s.segment_id, s.ensemble, s.sealed,
                                     max((c.size_bytes for c in copies), default=0), short))  # fmt: skip
    return views


def leader_views(state: SiteState) -> list[LeaderView]:
    out = []
    for info in state.partitions():
        open_segment = info.open_segment
        out.append(LeaderView(info.topic, info.partition, info.leader, info.leader_epoch,
                              open_segment.ensemble if open_segment is not None else None))  # fmt: skip
    return out


def drain_status_of(state: SiteState, node: NodeId) -> DrainStatus:
    info = state.node(node)
    segments = [SegmentView(p.topic, p.partition, s.segment_id, s.ensemble, s.sealed, 0)
                for p in state.partitions() for s in p.segments]  # fmt: skip
    return drain_status(node, info is not None and info.draining, segments, leader_views(state))


# -- the controller's side ----------------------------------------------------------------------------------------


class _Reported(Protocol):
    def message(self) -> str: ...


@dataclass(slots=True)
class _InFlight:
    effect: CopySegment | FillSegment
    retry_at_ms: int | None = None  # set once it failed: it counts as in progress until then (backoff)


def _flight_key(e: CopySegment | FillSegment) -> tuple[SegmentKey, str, NodeId | None, NodeId]:
    if isinstance(e, FillSegment):
        return (e.key, "fill", None, e.target)
    return (e.key, "copy", e.replaces, e.target)


def _retry_key(e: CopySegment | FillSegment) -> tuple[SegmentKey, str, NodeId | None]:
    """What a retry of ``e`` would be planned as: the same member replaced (or filled), whatever the target."""
    if isinstance(e, FillSegment):
        return (e.key, "fill", e.target)
    return (e.key, "copy", e.replaces)


class RepairController:
    """The Raft leader's repair: one pass at a time; see the module docstring."""

    def __init__(self, member: ClusterMember) -> None:
        self.m = member
        self.down_since: dict[NodeId, int] = {}
        self.in_flight: dict[tuple[SegmentKey, str, NodeId | None, NodeId], _InFlight] = {}
        self.failures: dict[tuple[SegmentKey, str, NodeId | None], int] = {}
        self.roll_asked: dict[SegmentKey, int] = {}
        self.reported: set[str] = set()  # what the last pass reported (logged when it first appeared)
        self.next_pass_ms = 0
        self.passing = False

    # -- passes -------------------------------------------------------------------------------------------------

    def due(self) -> None:
        """Called on every tick of the Raft leader: start a pass if one is due and none runs."""
        now = self.m.clock_ms()
        if self.passing or now < self.next_pass_ms:
            return
        self.passing = True
        self.next_pass_ms = now + self.m.config.repair_interval_ms
        self.m.spawn(self._pass())

    async def _pass(self) -> None:
        try:
            await self.run_pass()
        except Exception:  # a bug in one pass must not end repair: log it, and the next pass plans again
            log.exception("node %d: repair pass failed", self.m.me)
        finally:
            self.passing = False

    async def run_pass(self) -> None:
        m, cfg = self.m, self.m.config
        state = m.metadata.state()
        now = m.clock_ms()
        loads = {n.node: n for n in leadership.node_loads(state, now, cfg.session_timeout_ms)}
        for n in loads.values():
            if n.alive:
                self.down_since.pop(n.node, None)
            else:
                self.down_since.setdefault(n.node, now)
        held = await self._inventory(state, loads)
        state = m.metadata.state()  # the inventory took a while: plan on the newest view
        now = m.clock_ms()
        loads = {n.node: n for n in leadership.node_loads(state, now, cfg.session_timeout_ms)}
        for down in [n for n in self.down_since if n not in loads]:
            del self.down_since[down]  # removed from the site
        for n in loads.values():
            if not n.alive:
                self.down_since.setdefault(n.node, now)
        for k, f in list(self.in_flight.items()):
            if f.retry_at_ms is not None and f.retry_at_ms <= now:
                del self.in_flight[k]
        stuck = await self._move_leaders(state, loads)
        views = segment_views(state, held, loads)
        sizes = {v.key: v.size_bytes for v in views}
        plan = plan_repair(views, list(loads.values()),
                           down_since_ms=dict(sorted(self.down_since.items())), now_ms=now,
                           repair_delay_ms=cfg.repair_delay_ms,
                           in_progress=[f.effect for f in self.in_flight.values()],
                           max_concurrent_copies=cfg.max_concurrent_copies,
                           replication_factor=cfg.replication_factor)  # fmt: skip
        self._report([*stuck, *plan.unrepairable, *plan.waiting, *plan.deferred], now)
        effects: list[CopySegment | FillSegment] = [*plan.copies, *plan.fills]
        for effect in effects:
            segment = self._sealed_range(state, effect.key)
            if segment is None:
                continue
            self.in_flight[_flight_key(effect)] = _InFlight(effect)
            log.info("repair: %s%s", effect.message(), self._why(effect, held, now))
            m.spawn(self._copy(effect, segment, sizes.get(effect.key, 0), state))
        for roll in plan.rolls:
            self._ask_roll(state, loads, roll, now)

    def _report(self, items: list[_Reported], now: int) -> None:
        """Log what the planner reports when it first appears (again only after it went away)."""
        seen = set()
        for item in items:
            key = item.message()
            seen.add(key)
            if key in self.reported:
                continue
            if isinstance(item, AwaitingRepairDelay):  # its message has the due time on this node's clock
                log.info("repair: %s-%d segment %d lost node %d; it is copied elsewhere in %d ms unless the node "
                         "comes back first (--repair-delay-ms)", item.topic, item.partition, item.segment_id,
                         item.dead, item.due_ms - now)  # fmt: skip
            elif isinstance(item, CopyDeferred):
                log.info("repair: %s", key)
            else:
                log.warning("repair: %s", key)
        self.reported = seen

    def _why(self, effect: CopySegment | FillSegment, held: Mapping[NodeId, object], now: int) -> str:
        """What the effect's own message does not say of why it runs."""
        if isinstance(effect, FillSegment):
            if effect.target not in held:
                return (f"; node {effect.target} did not list its copies, so it counts as short (a whole copy "
                        "copies nothing)")  # fmt: skip
            return ""
        if effect.replaces is None:
            return ""
        since = self.down_since.get(effect.replaces)
        if since is not None:
            return (f": node {effect.replaces} has been dead for {now - since} ms, past the repair delay of "
                    f"{self.m.config.repair_delay_ms} ms")  # fmt: skip
        return f": node {effect.replaces} is draining"

    @staticmethod
    def _sealed_range(state: SiteState, key: SegmentKey) -> SealedRange | None:
        info = state.partition(key[0], key[1])
        s = info.segment(key[2]) if info is not None else None
        if info is None or s is None or s.end_offset is None:
            return None
        return SealedRange((key[0], key[1]), s.segment_id, s.base_offset,
                           info.sealed_vector_before(s.segment_id).to_dict(), s.end_offset)  # fmt: skip

    # -- which members hold what ---------------------------------------------------------------------------------

    async def _inventory(self, state: SiteState,
                         loads: Mapping[NodeId, NodeLoad]) -> dict[NodeId, dict[SegmentKey, HeldCopy]]:  # fmt: skip
        """Every live node's copies (this node's from its store); a node that does not answer is left out."""
        nodes = [n for n in sorted(loads) if loads[n].alive]
        answers = await asyncio.gather(*(self._held_by(state, n) for n in nodes))
        return {n: a for n, a in zip(nodes, answers, strict=True) if a is not None}

    async def _held_by(self, state: SiteState, node: NodeId) -> dict[SegmentKey, HeldCopy] | None:
        m = self.m
        if node == m.me:
            copies = await m.run_blocking(m.store.held)
        else:
            info = state.node(node)
            if info is None:
                return None
            try:
                async with m.channel(info.address) as channel:
                    answer = await pbg.SegmentsStub(channel).ListSegments(pb.ListSegmentsRequest(),
                                                                         timeout=LIST_TIMEOUT_S)  # fmt: skip
            except grpc.aio.AioRpcError as exc:
                log.debug("repair: node %d did not list its segments: %s", node, exc.code().name)
                return None
            copies = [HeldCopy((h.segment.topic, h.segment.partition), SegmentId(h.segment.segment_id),
                               LocalOffset(h.end_offset), LocalOffset(h.flushed_offset), h.size_bytes)
                      for h in answer.segments]  # fmt: skip
        return {(c.key[0], c.key[1], c.segment_id): c for c in copies}

    # -- copies ----------------------------------------------------------------------------------------------------

    async def _copy(self, effect: CopySegment | FillSegment, segment: SealedRange, size_bytes: int,
                    state: SiteState) -> None:  # fmt: skip
        m = self.m
        flight = self.in_flight.get(_flight_key(effect))
        try:
            flushed, copied = await self._copy_on_target(effect, segment, size_bytes, state)
            if isinstance(effect, FillSegment):
                log.info("repair: node %d now holds %s-%d segment %d whole (%d bytes copied from node %d)",
                         effect.target, *segment.key, segment.segment_id, copied, effect.source)  # fmt: skip
            else:
                command: Command = (
                    AddMember(effect.topic, effect.partition, effect.segment_id, effect.target,
                              m.config.replication_factor)
                    if effect.replaces is None
                    else ReplaceMember(effect.topic, effect.partition, effect.segment_id, effect.replaces,
                                       effect.target)
                )  # fmt: skip
                result = await self._propose(command)
                if isinstance(result, Refused):
                    log.warning("repair: node %d holds %s-%d segment %d (fsynced to %d), but the metadata refused to "
                                "record it: %s", effect.target, *segment.key, segment.segment_id, flushed,
                                result.reason)  # fmt: skip
                else:
                    then = "joins its ensemble" if effect.replaces is None else f"replaces node {effect.replaces}"
                    log.info("repair: node %d holds %s-%d segment %d whole (%d bytes copied from node %d) and %s",
                             effect.target, *segment.key, segment.segment_id, copied, effect.source,
                             then)  # fmt: skip
            self.failures.pop(_retry_key(effect), None)
            if self.in_flight.get(_flight_key(effect)) is flight:
                del self.in_flight[_flight_key(effect)]
        except (grpc.aio.AioRpcError, BrokerError, ReplicaError, QuorumError, OSError, MetadataUnavailable) as exc:
            why = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            failures = self.failures[_retry_key(effect)] = self.failures.get(_retry_key(effect), 0) + 1
            backoff = min(m.config.retry_ms * 2 ** (failures - 1), BACKOFF_MAX_MS)
            if flight is not None:
                flight.retry_at_ms = m.clock_ms() + backoff
            log.warning("repair: %s failed (%s); planned again in %d ms", effect.message(), why, backoff)

    async def _copy_on_target(self, effect: CopySegment | FillSegment, segment: SealedRange, size_bytes: int,
                              state: SiteState) -> tuple[int, int]:  # fmt: skip
        m = self.m
        source = state.node(effect.source)
        target = state.node(effect.target)
        if source is None or target is None:
            raise CopyFailed(f"node {effect.source if source is None else effect.target} left the site")
        timeout = copy_timeout_s(size_bytes)
        if effect.target == m.me:
            return await copy_in(m.store, segment, source.address, m.executor, m.clock_ms(), m.tls, timeout)
        request = pb.CopySegmentRequest(
            segment=pb.SegmentRef(topic=segment.key[0], partition=segment.key[1], segment_id=segment.segment_id),
            base_offset=segment.base_offset, start_vector=vector_to_proto(VectorOffset(segment.start_vector)),
            end_offset=segment.end_offset, source_address=source.address, source_node=effect.source,
        )  # fmt: skip
        async with m.channel(target.address) as channel:
            answer = await pbg.SegmentsStub(channel).CopySegment(request, timeout=timeout)
        if answer.flushed_offset < segment.end_offset:
            raise CopyFailed(f"node {effect.target} answered the copy holding {answer.flushed_offset}, short of the "
                             f"sealed end {segment.end_offset}")  # fmt: skip
        return answer.flushed_offset, answer.copied_bytes

    async def _propose(self, command: Command) -> Applied | Refused:
        """Commit ``command`` (ReplaceMember, AddMember and ElectLeader are each a no-op, or refused, once
        applied, so a retry after an unconfirmed commit is safe)."""
        for _ in range(PROPOSE_ATTEMPTS - 1):
            result = await self.m.propose(command)
            if result is not None:
                return result
            await asyncio.sleep(self.m.config.retry_ms / 1000)
        return await self.m.run_blocking(self.m.metadata.propose, command)

    # -- rolls and leaderships ----------------------------------------------------------------------------------

    def _ask_roll(self, state: SiteState, loads: Mapping[NodeId, NodeLoad], roll: RollSegment, now: int) -> None:
        info = state.partition(roll.topic, roll.partition)
        leader = info.leader if info is not None else None
        if leader is None or leader not in loads or not loads[leader].alive or leader == roll.dead:
            return  # the election (or the move off a draining leader) rolls it by recovery
        key: SegmentKey = (roll.topic, roll.partition, roll.segment_id)
        asked = self.roll_asked.get(key)
        if asked is not None and now - asked < ROLL_ASK_EVERY_MS:
            return
        if asked is None:
            log.info("repair: %s", roll.message())
        self.roll_asked = {k: t for k, t in self.roll_asked.items() if now - t < 60_000}
        self.roll_asked[key] = now
        self.m.spawn(self._roll(leader, roll))

    async def _roll(self, leader: NodeId, roll: RollSegment) -> None:
        m = self.m
        if leader == m.me:
            reason = m.roll((roll.topic, roll.partition), roll.segment_id)
        else:
            info = m.metadata.state().node(leader)
            if info is None:
                return
            ref = pb.SegmentRef(topic=roll.topic, partition=roll.partition, segment_id=roll.segment_id)
            try:
                async with m.channel(info.address) as channel:
                    answer = await pbg.SegmentsStub(channel).RollSegment(pb.RollSegmentRequest(segment=ref),
                                                                         timeout=ROLL_TIMEOUT_S)  # fmt: skip
            except grpc.aio.AioRpcError as exc:
                reason = f"{exc.code().name}: {exc.details()}"
            else:
                reason = None if answer.rolling else answer.reason
        if reason is not None:
            log.info("repair: node %d did not roll %s/%d segment %d: %s; asked again later", leader, roll.topic,
                     roll.partition, roll.segment_id, reason)  # fmt: skip

    async def _move_leaders(self, state: SiteState, loads: Mapping[NodeId, NodeLoad]) -> list[_Reported]:
        """Propose the moves off draining leaders; returns the leaderships that cannot move now."""
        stuck: list[_Reported] = []
        for move in plan_leader_moves(leader_views(state), list(loads.values())):
            if isinstance(move, LeadershipStuck):
                stuck.append(move)
                continue
            assert isinstance(move, MoveLeadership)
            log.info("decommission: %s", move.message())
            result = await self.m.propose(ElectLeader(move.topic, move.partition, move.to,
                                                      LeaderEpoch(move.expected_epoch)))  # fmt: skip
            if isinstance(result, Refused):
                log.info("decommission: the move of %s/%d was refused (%s); planned again", move.topic,
                         move.partition, result.reason)  # fmt: skip
        return stuck


# -- decommission ------------------------------------------------------------------------------------------------


async def decommission(member: ClusterMember, node: NodeId, draining: bool) -> DrainStatus:
    """Set ``node`` draining (or not) through the site's metadata; answer how far its drain has got."""
    state = member.metadata.state()
    if state.node(node) is None:
        known = ", ".join(str(n) for n in sorted(state.nodes())) or "none"
        raise NodeNotInSite(f"node {node} is not a node of this site (its nodes: {known}); give one of their ids")
    try:
        result = await member.run_blocking(member.metadata.propose, SetDraining(node, draining))
    except MetadataUnavailable as exc:
        raise MetadataNotConfirmed(f"the site's metadata did not confirm that node {node} is draining: {exc}; "
                                   "retry (the same call again changes nothing once it applied)") from None  # fmt: skip
    if isinstance(result, Refused):
        raise NodeNotInSite(result.reason)
    if draining:
        log.info("decommission: node %d is draining: it takes no new segment, and repair moves what it holds", node)
    else:
        log.info("decommission: node %d no longer drains: it takes new segments again", node)
    return drain_status_of(member.metadata.state(), node)
