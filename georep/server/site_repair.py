"""Repair and decommission on a multi-node site: what the controller asks for, carried out. Shell.

Every decision is pure and shared with the cluster simulators, which drive the same controller the same way:

decision                                        pure code
which sealed segments to copy, from/to where;   the node core's controller (``cluster/controller.py``,
which open segments to roll; whom a dead        ``Controller.repair_plan`` over ``cluster.repair.plan_repair``:
member is down since; which copies are in       ``RepairCopy``, ``AskRoll``); ``repair_answered`` says what
flight; how often a roll is asked               a finished copy records
which leaderships leave a draining node, to     ``cluster.repair.plan_leader_moves``
whom
how far a decommission has got                  ``cluster.repair.drain_status``

:class:`RepairController` runs on the Raft leader, over the node core's controller (``ClusterMember``'s tick
starts a pass when the controller's is due, one at a time, never inside the tick, so that a slow member cannot
delay this node's heartbeat). A pass:

1. **Learns which members hold each sealed segment whole**, as the simulators' members report it: it asks every
   live node for its copies (``ListSegments``: each copy's fsynced end and size; this node reads its own store)
   and tells the controller what each one holds short of the sealed end (``Controller.reported_short``:
   never a source, and filled). A live node that does not answer reports every sealed segment it is a member
   of, which is the safe side: it is not read from, and a fill of a copy that turns out whole copies nothing. A
   dead node reports nothing (it is replaced, not filled). A segment's size is the largest copy reported (0 if
   none), which the planner needs to choose a target with room.
2. **Runs the controller's plan** (``Controller.repair_plan``) on this node's view of the metadata.
3. **Carries out each effect.** A copy (or fill) is done by its target: ``CopySegment`` tells it to read the
   sealed range from the source with ``ReadSegment`` from the end it holds, append every batch to its
   ``ReplicaStore`` only after checking its CRC, fsync, and answer only then (:func:`copy_in`). The
   controller's ``repair_answered`` then gives ``ReplaceMember`` or ``AddMember`` to propose (nothing for a
   fill: the target is a member already). A roll is asked of the partition's leader (``RollSegment``). A
   leadership move is an ``ElectLeader``.

**Bounds and retries.** At most ``max_concurrent_copies`` copies run at once
(the planner counts the ones in flight). A copy that fails stays counted as
in progress for a backoff (``retry_ms``, doubled per consecutive failure of
the same repair, at most :data:`BACKOFF_MAX_MS`: this shell's timer), so the
planner does not plan it again at once; then the controller drops it
(``repair_failed``) and it is planned afresh, maybe from
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import grpc

from cluster.controller import AskRoll, Controller, RepairCopy
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
    SegmentKey,
    SegmentView,
    drain_status,
    plan_leader_moves,
)
from cluster.site_state import (
    AddMember,
    Applied,
    Command,
    ElectLeader,
    Refused,
    ReplaceMember,
    SegmentInfo,
    SetDraining,
    SiteState,
)
from georep.broker.errors import BrokerError, InvalidRequest, NodeStopping, SegmentUnreadable
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.proto.convert import vector_to_proto
from georep.raft.store import MetadataUnavailable
from georep.security.tls import TlsConfig, client_channel
from georep.server.segment_refs import segment_ref
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


async def copy_in(
    store: ReplicaStore,
    segment: SealedRange,
    source: str,
    executor: ThreadPoolExecutor,
    now_ms: int,
    tls: TlsConfig | None = None,
    timeout_s: float = COPY_TIMEOUT_S_MIN,
) -> tuple[LocalOffset, int]:
    """Copy sealed ``segment`` into this node's store from the member at ``source`` (``ReadSegment``), from the end
    this node holds; fsync. Returns the fsynced end and the bytes read. Each chunk's CRCs are checked before it is
    appended (``ReplicaStore.append_sealed_copy``). Raises :class:`CopyFailed` when the source cannot be read or
    holds less than the sealed end, and the store's errors (``CorruptReplicaChunk``: a batch failed its CRC)."""
    loop = asyncio.get_running_loop()
    key, sid, end = segment.key, segment.segment_id, segment.end_offset
    held = await loop.run_in_executor(
        executor, store.open_sealed_copy, key, sid, segment.base_offset, dict(segment.start_vector), now_ms
    )
    copied = 0
    if held < end:
        request = pb.ReadSegmentRequest(
            segment=segment_ref(store, key, sid),
            offset=held,
            end_offset=end,
            max_bytes=READ_MAX_BYTES,
        )
        try:
            async with client_channel(source, tls) as ch:
                async for response in pbg.SegmentsStub(ch).ReadSegment(request, timeout=timeout_s):
                    await loop.run_in_executor(executor, store.append_sealed_copy, key, sid, end, response.batches)
                    copied += len(response.batches)
        except grpc.aio.AioRpcError as exc:
            raise CopyFailed(
                f"copying segment {sid} of {key[0]}-{key[1]} from {source}: {exc.code().name}: {exc.details()}"
            ) from None
    flushed = await loop.run_in_executor(executor, store.flush, key, sid)
    if flushed < end:
        raise CopyFailed(
            f"copying segment {sid} of {key[0]}-{key[1]} from {source}: it sent up to offset {flushed}, "
            f"short of the sealed end {end}: it holds less than the seal; copy from another member"
        )
    return flushed, copied


def copy_timeout_s(size_bytes: int) -> float:
    return COPY_TIMEOUT_S_MIN + size_bytes / COPY_BYTES_PER_S_MIN


# -- what the controller is told ----------------------------------------------------------------------------------


def short_reports(
    state: SiteState, held: Mapping[NodeId, Mapping[SegmentKey, HeldCopy]], live: Sequence[NodeId]
) -> dict[NodeId, set[SegmentKey]]:
    """What each live node reports short (``Controller.reported_short``): the sealed segments it is a member of and
    holds less of than the sealed end, by what it listed (``held``); a live node absent from ``held`` did not answer,
    and reports every sealed segment it is a member of (the safe side: it is not read from, and a fill of a copy
    that turns out whole copies nothing)."""
    out: dict[NodeId, set[SegmentKey]] = {n: set() for n in live}
    for info in state.partitions():
        for s in info.segments:
            if not s.sealed or s.end_offset is None:
                continue
            key: SegmentKey = (info.topic, info.partition, s.segment_id)
            for m in s.ensemble:
                if m in out and (m not in held or key not in held[m] or held[m][key].flushed_offset < s.end_offset):
                    out[m].add(key)
    return out


def leader_views(state: SiteState) -> list[LeaderView]:
    out = []
    for info in state.partitions():
        open_segment = info.open_segment
        out.append(
            LeaderView(
                info.topic,
                info.partition,
                info.leader,
                info.leader_epoch,
                open_segment.ensemble if open_segment is not None else None,
            )
        )
    return out


def drain_status_of(state: SiteState, node: NodeId) -> DrainStatus:
    info = state.node(node)
    segments = [
        SegmentView(p.topic, p.partition, s.segment_id, s.ensemble, s.sealed, 0)
        for p in state.partitions()
        for s in p.segments
    ]
    return drain_status(node, info is not None and info.draining, segments, leader_views(state))


# -- the controller's side ----------------------------------------------------------------------------------------


class _Reported(Protocol):
    def message(self) -> str: ...


def _retry_key(e: CopySegment | FillSegment) -> tuple[SegmentKey, str, NodeId | None]:
    """What a retry of ``e`` would be planned as: the same member replaced (or filled), whatever the target."""
    if isinstance(e, FillSegment):
        return (e.key, "fill", e.target)
    return (e.key, "copy", e.replaces)


class RepairController:
    """The Raft leader's repair: the controller's plan (``Controller.repair_plan``), carried out one pass at a time;
    see the module docstring."""

    def __init__(self, member: ClusterMember, controller: Controller) -> None:
        self.m = member
        self.ctl = controller
        self.failures: dict[tuple[SegmentKey, str, NodeId | None], int] = {}
        self.reported: set[str] = set()  # what the last pass reported (logged when it first appeared)
        self.passing = False

    # -- passes -------------------------------------------------------------------------------------------------

    def due(self) -> None:
        """Called on every tick of the Raft leader: start a pass if the controller's is due and none runs."""
        if self.passing or self.m.clock_ms() < self.ctl.next_repair_ms:
            return
        self.passing = True
        self.m.spawn(self._pass())

    async def _pass(self) -> None:
        try:
            await self.run_pass()
        except Exception:  # a bug in one pass must not end repair: log it, and the next pass plans again
            log.exception("node %d: repair pass failed", self.m.me)
        finally:
            self.passing = False

    def _loads(self, state: SiteState, now: int) -> dict[NodeId, NodeLoad]:
        return {n.node: n for n in self.m.core.context(state, ("", 0), now).loads()}

    async def run_pass(self) -> None:
        m = self.m
        state = m.metadata.state()
        loads = self._loads(state, m.clock_ms())
        held = await self._inventory(state, loads)
        state = m.metadata.state()  # the inventory took a while: plan on the newest view
        now = m.clock_ms()
        loads = self._loads(state, now)
        live = [n for n in sorted(loads) if loads[n].alive]
        for node, short in short_reports(state, held, live).items():
            self.ctl.reported_short(node, short)
        for node in loads:
            if node not in live:
                self.ctl.reported_short(node, set())  # a dead node reports nothing: it is replaced, not filled
        stuck = await self._move_leaders(state, loads)
        sizes = {
            id(s): max(
                (
                    h[(i.topic, i.partition, s.segment_id)].size_bytes
                    for h in held.values()
                    if (i.topic, i.partition, s.segment_id) in h
                ),
                default=0,
            )
            for i in state.partitions()
            for s in i.segments
        }
        copies, rolls = self.ctl.repair_plan(state, now, lambda s: sizes.get(id(s), 0), lambda: list(loads.values()))
        self._report([*stuck, *self.ctl.reports], now)
        for copy in copies:
            segment = self._sealed_range(state, copy.effect.key)
            if segment is None:
                self.ctl.repair_failed(copy.copy_id)
                continue
            log.info("repair: %s%s", copy.effect.message(), self._why(copy.effect, held, now))
            m.spawn(self._copy(copy, segment, sizes.get(id(self._segment(state, copy.effect.key)), 0), state))
        for roll in rolls:
            m.spawn(self._roll(roll))

    def _report(self, items: list[_Reported], now: int) -> None:
        """Log what the planner reports when it first appears (again only after it went away)."""
        seen = set()
        for item in items:
            key = item.message()
            seen.add(key)
            if key in self.reported:
                continue
            if isinstance(item, AwaitingRepairDelay):  # its message has the due time on this node's clock
                log.info(
                    "repair: %s-%d segment %d lost node %d; it is copied elsewhere in %d ms unless the node "
                    "comes back first (--repair-delay-ms)",
                    item.topic,
                    item.partition,
                    item.segment_id,
                    item.dead,
                    item.due_ms - now,
                )
            elif isinstance(item, CopyDeferred):
                log.info("repair: %s", key)
            else:
                log.warning("repair: %s", key)
        self.reported = seen

    def _why(self, effect: CopySegment | FillSegment, held: Mapping[NodeId, object], now: int) -> str:
        """What the effect's own message does not say of why it runs."""
        if isinstance(effect, FillSegment):
            if effect.target not in held:
                return (
                    f"; node {effect.target} did not list its copies, so it counts as short (a whole copy "
                    "copies nothing)"
                )
            return ""
        if effect.replaces is None:
            return ""
        since = self.ctl.down_since.get(effect.replaces)
        if since is not None:
            return (
                f": node {effect.replaces} has been dead for {now - since} ms, past the repair delay of "
                f"{self.m.config.repair_delay_ms} ms"
            )
        return f": node {effect.replaces} is draining"

    @staticmethod
    def _segment(state: SiteState, key: SegmentKey) -> SegmentInfo | None:
        info = state.partition(key[0], key[1])
        return info.segment(key[2]) if info is not None else None

    @staticmethod
    def _sealed_range(state: SiteState, key: SegmentKey) -> SealedRange | None:
        info = state.partition(key[0], key[1])
        s = info.segment(key[2]) if info is not None else None
        if info is None or s is None or s.end_offset is None:
            return None
        return SealedRange(
            (key[0], key[1]),
            s.segment_id,
            s.base_offset,
            info.sealed_vector_before(s.segment_id).to_dict(),
            s.end_offset,
        )

    # -- which members hold what ---------------------------------------------------------------------------------

    async def _inventory(
        self, state: SiteState, loads: Mapping[NodeId, NodeLoad]
    ) -> dict[NodeId, dict[SegmentKey, HeldCopy]]:
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
                    answer = await pbg.SegmentsStub(channel).ListSegments(
                        pb.ListSegmentsRequest(), timeout=LIST_TIMEOUT_S
                    )
            except grpc.aio.AioRpcError as exc:
                log.debug("repair: node %d did not list its segments: %s", node, exc.code().name)
                return None
            copies = [
                HeldCopy(
                    (h.segment.topic, h.segment.partition),
                    SegmentId(h.segment.segment_id),
                    LocalOffset(h.end_offset),
                    LocalOffset(h.flushed_offset),
                    h.size_bytes,
                )
                for h in answer.segments
            ]
        return {(c.key[0], c.key[1], c.segment_id): c for c in copies}

    # -- copies ----------------------------------------------------------------------------------------------------

    async def _copy(self, copy: RepairCopy, segment: SealedRange, size_bytes: int, state: SiteState) -> None:
        m, effect = self.m, copy.effect
        try:
            flushed, copied = await self._copy_on_target(effect, segment, size_bytes, state)
            whole, command = self.ctl.repair_answered(copy.copy_id, effect.target, flushed, m.metadata.state())
            if not whole:
                raise CopyFailed(f"node {effect.target} holds segment {segment.segment_id} up to {flushed} only")
            if command is None:
                log.info(
                    "repair: node %d now holds %s-%d segment %d whole (%d bytes copied from node %d)",
                    effect.target,
                    *segment.key,
                    segment.segment_id,
                    copied,
                    effect.source,
                )
            else:
                await self._record(copy, command, flushed, copied)
            self.failures.pop(_retry_key(effect), None)
        except (grpc.aio.AioRpcError, BrokerError, ReplicaError, QuorumError, OSError, MetadataUnavailable) as exc:
            why = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            failures = self.failures[_retry_key(effect)] = self.failures.get(_retry_key(effect), 0) + 1
            backoff = min(m.config.retry_ms * 2 ** (failures - 1), BACKOFF_MAX_MS)
            log.warning("repair: %s failed (%s); planned again in %d ms", effect.message(), why, backoff)
            # It counts as in progress until then, so that the planner does not plan it again at once.
            await asyncio.sleep(backoff / 1000)
            self.ctl.repair_failed(copy.copy_id)

    async def _record(self, copy: RepairCopy, command: AddMember | ReplaceMember, flushed: int, copied: int) -> None:
        effect = copy.effect
        try:
            result = await self._propose(command)
        finally:
            self.ctl.recorded(copy.copy_id)
        if isinstance(result, Refused):
            log.warning(
                "repair: node %d holds %s-%d segment %d (fsynced to %d), but the metadata refused to record it: %s",
                effect.target,
                effect.topic,
                effect.partition,
                effect.segment_id,
                flushed,
                result.reason,
            )
            return
        then = "joins its ensemble" if isinstance(command, AddMember) else f"replaces node {command.old}"
        log.info(
            "repair: node %d holds %s-%d segment %d whole (%d bytes copied from node %d) and %s",
            effect.target,
            effect.topic,
            effect.partition,
            effect.segment_id,
            copied,
            effect.source,
            then,
        )

    async def _copy_on_target(
        self, effect: CopySegment | FillSegment, segment: SealedRange, size_bytes: int, state: SiteState
    ) -> tuple[int, int]:
        m = self.m
        source = state.node(effect.source)
        target = state.node(effect.target)
        if source is None or target is None:
            raise CopyFailed(f"node {effect.source if source is None else effect.target} left the site")
        timeout = copy_timeout_s(size_bytes)
        if effect.target == m.me:
            return await copy_in(m.store, segment, source.address, m.executor, m.clock_ms(), m.tls, timeout)
        request = pb.CopySegmentRequest(
            segment=segment_ref(m.store, segment.key, segment.segment_id),
            base_offset=segment.base_offset,
            start_vector=vector_to_proto(VectorOffset(segment.start_vector)),
            end_offset=segment.end_offset,
            source_address=source.address,
            source_node=effect.source,
        )
        async with m.channel(target.address) as channel:
            answer = await pbg.SegmentsStub(channel).CopySegment(request, timeout=timeout)
        if answer.flushed_offset < segment.end_offset:
            raise CopyFailed(
                f"node {effect.target} answered the copy holding {answer.flushed_offset}, short of the "
                f"sealed end {segment.end_offset}"
            )
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

    async def _roll(self, roll: AskRoll) -> None:
        """Ask the partition's leader to roll (``RollSegment``; this node's own lead directly)."""
        m = self.m
        what = f"{roll.key[0]}/{roll.key[1]} segment {roll.segment_id}"
        log.info(
            "repair: asking node %d to roll %s%s",
            roll.leader,
            what,
            " so that the next segment has every replica" if roll.widen else "",
        )
        if roll.leader == m.me:
            reason = m.roll(roll.key, roll.segment_id)
        else:
            info = m.metadata.state().node(roll.leader)
            if info is None:
                return
            ref = pb.SegmentRef(topic=roll.key[0], partition=roll.key[1], segment_id=roll.segment_id)
            try:
                async with m.channel(info.address) as channel:
                    answer = await pbg.SegmentsStub(channel).RollSegment(
                        pb.RollSegmentRequest(segment=ref), timeout=ROLL_TIMEOUT_S
                    )
            except grpc.aio.AioRpcError as exc:
                reason = f"{exc.code().name}: {exc.details()}"
            else:
                reason = None if answer.rolling else answer.reason
        if reason is not None:
            log.info("repair: node %d did not roll %s: %s; asked again later", roll.leader, what, reason)

    async def _move_leaders(self, state: SiteState, loads: Mapping[NodeId, NodeLoad]) -> list[_Reported]:
        """Propose the moves off draining leaders; returns the leaderships that cannot move now."""
        stuck: list[_Reported] = []
        for move in plan_leader_moves(leader_views(state), list(loads.values())):
            if isinstance(move, LeadershipStuck):
                stuck.append(move)
                continue
            assert isinstance(move, MoveLeadership)
            log.info("decommission: %s", move.message())
            result = await self.m.propose(
                ElectLeader(move.topic, move.partition, move.to, LeaderEpoch(move.expected_epoch))
            )
            if isinstance(result, Refused):
                log.info(
                    "decommission: the move of %s/%d was refused (%s); planned again",
                    move.topic,
                    move.partition,
                    result.reason,
                )
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
        raise MetadataNotConfirmed(
            f"the site's metadata did not confirm that node {node} is draining: {exc}; "
            "retry (the same call again changes nothing once it applied)"
        ) from None
    if isinstance(result, Refused):
        raise NodeNotInSite(result.reason)
    if draining:
        log.info("decommission: node %d is draining: it takes no new segment, and repair moves what it holds", node)
    else:
        log.info("decommission: node %d no longer drains: it takes new segments again", node)
    return drain_status_of(member.metadata.state(), node)
