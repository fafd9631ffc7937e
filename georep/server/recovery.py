"""A new leader's recovery of a partition's open segment: the lead's fences, copies and seals, over the node's store
and the members' gRPC. Shell.

Every decision is the partition lead's (:class:`cluster.lead.PartitionLead`, which drives
:class:`cluster.recovery.SegmentRecovery`: fence whom, which end, copy what from where, when to seal; its docstring
has the proof), the same object both cluster simulators drive. This module carries out the effects of its
``recovering`` phase and turns each outcome into the lead's event:

* :class:`~cluster.lead.FenceMember` (:func:`fence_member`): this node's own copy through its
  :class:`~georep.storage.replica_store.ReplicaStore`, the others with ``FenceSegments``. A member without a copy
  of the segment holds nothing of it: it answers the segment's base. A member fenced by a newer epoch
  (``ABORTED``, its epoch in the trailing metadata) is ``fence_refused``; one that cannot be reached is
  ``unreachable``.
* :class:`~cluster.lead.CopyTail` (:func:`copy_tail`): the source's bytes from ``ReadSegment`` (or the local
  store), appended to the target from the end the target reports (an earlier copy may have got partway; by (P)
  those bytes are the same), fsynced.
* :class:`~cluster.lead.SegmentSealed` (:func:`tell_sealed`): every member is told the seal (``SealSegment``) and
  cuts a longer copy. A member that misses it keeps its tail until it learns the seal from its view
  (``cluster.member.seals_to_learn``); its tail was never acked nor read, and reads stop at the sealed end.

The seal itself (:class:`~cluster.lead.ProposeSeal`) is proposed by the node (``cluster_member.py``).
:func:`recover_segment` runs one recovery alone, for a caller without a node (tests): a lead in ``recovering``
driven by the same executors, its seal through the caller's callback.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import grpc

from cluster.lead import (
    CopyTail,
    FenceMember,
    LeadConfig,
    LeadContext,
    LeadEffect,
    Note,
    PartitionLead,
    ProposeSeal,
    SegmentSealed,
    StepDown,
)
from cluster.quorum import Fenced
from cluster.site_state import Applied, PartitionInfo, RefusalCode, Refused, SegmentInfo
from georep.broker.errors import BrokerError, NotLeader, RecoveryFailed
from georep.proto import georep_pb2 as pb
from georep.proto.convert import vector_to_proto
from georep.security.tls import TlsConfig, channels
from georep.server.fence_waves import FenceWaves
from georep.server.peer_channels import ChannelUse, segments_stub
from georep.server.rpc import FENCED_EPOCH_METADATA
from georep.server.segment_refs import incarnation_sent, segment_ref
from georep.storage.replica_store import PartitionKey, ReplicaError, ReplicaStore
from offsets.coordinates import LocalOffset, Origin, OriginSeq
from offsets.vector import VectorOffset
from topology.ids import LeaderEpoch, NodeId, SegmentId

log = logging.getLogger(__name__)

T = TypeVar("T")
CALL_TIMEOUT_S = 10.0
READ_MAX_BYTES = 1 << 20
RETRY_MS = 500

LeadEvent = Callable[[PartitionLead, LeadContext], list[LeadEffect]]


@dataclass(frozen=True, slots=True)
class Members:
    """How this node reaches the members of a segment: its own store, the others over gRPC."""

    store: ReplicaStore
    me: NodeId
    addresses: Mapping[NodeId, str]
    executor: ThreadPoolExecutor
    clock_ms: Callable[[], int]
    channel: ChannelUse
    fences: FenceWaves  # this node's fences in flight to each peer, bounded (fence_waves.py)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)


def _their_epoch(exc: grpc.aio.AioRpcError, epoch: LeaderEpoch) -> int | None:
    """The epoch a member that answered ABORTED is fenced at (one past ``epoch`` if it did not say); None if the
    call failed otherwise."""
    if exc.code() != grpc.StatusCode.ABORTED:
        return None
    told = dict(exc.trailing_metadata() or ()).get(FENCED_EPOCH_METADATA)
    return int(told) if isinstance(told, str) and told.isdigit() else epoch + 1


# -- fence ---------------------------------------------------------------------------------------------------------


async def fence_member(m: Members, eff: FenceMember) -> LeadEvent:
    """Fence ``eff.member``'s copy; the lead's event for the answer."""
    key, s, node, attempt = eff.key, eff.segment, eff.member, eff.attempt
    base = int(s.base_offset)
    try:
        if node == m.me:
            ends = await m.run(m.store.fence, key, eff.epoch)
            end = int(ends.get(s.segment_id, base))
        else:
            address = m.addresses[node]
            request = pb.FenceSegmentsRequest(
                topic=key[0], partition=key[1], leader_epoch=eff.epoch, incarnation=incarnation_sent(m.store, key[0])
            )

            async def call() -> pb.FenceSegmentsResponse:
                async with m.channel(address) as channel:
                    answer: pb.FenceSegmentsResponse = await segments_stub(channel).FenceSegments(
                        request, timeout=CALL_TIMEOUT_S
                    )
                    return answer

            answer = await m.fences.send(address, call)
            end = next((e.end_offset for e in answer.ends if e.segment_id == s.segment_id), base)
    except Fenced as exc:
        their = int(exc.fenced_epoch)
        return lambda lead, ctx: lead.fence_refused(attempt, node, their, ctx)
    except grpc.aio.AioRpcError as exc:
        log.warning("recovery of %s-%d: fencing member %d failed: %s: %s", *key, node, exc.code().name, exc.details())
        refused = _their_epoch(exc, eff.epoch)
        if refused is not None:
            return lambda lead, ctx: lead.fence_refused(attempt, node, refused, ctx)
        return lambda lead, ctx: lead.unreachable(attempt, node, ctx)
    except (OSError, ReplicaError, KeyError) as exc:
        log.error("recovery of %s-%d: member %d cannot be fenced: %s", *key, node, exc)
        return lambda lead, ctx: lead.unreachable(attempt, node, ctx)
    log.info(
        "recovery of %s-%d: member %d fenced at epoch %d, holds segment %d up to %d",
        *key,
        node,
        eff.epoch,
        s.segment_id,
        end,
    )
    return lambda lead, ctx: lead.fenced(attempt, node, end, ctx)


# -- copy ----------------------------------------------------------------------------------------------------------


class _CopyShort(Exception):
    """A copy that ended before the end it was asked for."""


async def copy_tail(m: Members, eff: CopyTail, start_vector: Mapping[Origin, OriginSeq]) -> LeadEvent:
    """Make ``eff.copy.target`` hold the segment up to the copy's end from its source; the lead's event."""
    c, attempt, cid = eff.copy, eff.attempt, eff.copy_id
    try:
        if c.target == m.me:
            await _copy_here(m, eff, start_vector)
        else:
            await _copy_there(m, eff, start_vector)
    except Fenced as exc:
        their = int(exc.fenced_epoch)
        return lambda lead, ctx: lead.copy_refused(attempt, cid, c.target, their, ctx)
    except grpc.aio.AioRpcError as exc:
        refused = _their_epoch(exc, eff.epoch)
        if refused is not None:
            return lambda lead, ctx: lead.copy_refused(attempt, cid, c.target, refused, ctx)
        why = f"{exc.code().name}: {exc.details()}"
        return lambda lead, ctx: lead.copy_failed(attempt, cid, c.target, why, ctx)
    except (OSError, BrokerError, ReplicaError, KeyError, _CopyShort) as exc:
        why = str(exc)
        return lambda lead, ctx: lead.copy_failed(attempt, cid, c.target, why, ctx)
    log.info(
        "recovery of %s-%d: copied segment %d [%d, %d) from member %d to member %d",
        *eff.key,
        eff.segment.segment_id,
        c.start_offset,
        c.end_offset,
        c.source,
        c.target,
    )
    end = int(c.end_offset)
    return lambda lead, ctx: lead.copied(attempt, cid, c.target, end, ctx)


async def _read(m: Members, eff: CopyTail, node: NodeId, start: int, end: int) -> AsyncIterator[bytes]:
    key, sid = eff.key, eff.segment.segment_id
    if node == m.me:
        offset = LocalOffset(start)
        while offset < end:
            result = await m.run(m.store.read, key, sid, offset, READ_MAX_BYTES, end)
            if not result.data:
                return
            yield result.data
            offset = result.next_offset
        return
    ref = segment_ref(m.store, key, sid)
    async with m.channel(m.addresses[node]) as channel:
        async for r in segments_stub(channel).ReadSegment(
            pb.ReadSegmentRequest(segment=ref, offset=start, end_offset=end, max_bytes=READ_MAX_BYTES),
            timeout=CALL_TIMEOUT_S,
        ):
            yield r.batches


async def _copy_here(m: Members, eff: CopyTail, start_vector: Mapping[Origin, OriginSeq]) -> None:
    key, s, c = eff.key, eff.segment, eff.copy
    await m.run(
        m.store.open_segment, key, eff.epoch, s.segment_id, int(s.base_offset), dict(start_vector), m.clock_ms()
    )
    held = await m.run(m.store.end_offset, key, s.segment_id)
    async for chunk in _read(m, eff, c.source, held, c.end_offset):
        await m.run(m.store.append, key, eff.epoch, s.segment_id, chunk)
    flushed = await m.run(m.store.flush, key, s.segment_id)
    if flushed < c.end_offset:
        raise _CopyShort(f"member {c.source} sent up to {flushed}, short of {c.end_offset}")


async def _copy_there(m: Members, eff: CopyTail, start_vector: Mapping[Origin, OriginSeq]) -> None:
    key, s, c = eff.key, eff.segment, eff.copy
    ref = segment_ref(m.store, key, s.segment_id)
    outbox: asyncio.Queue[pb.SegmentAppendRequest | None] = asyncio.Queue()
    outbox.put_nowait(
        pb.SegmentAppendRequest(
            open=pb.SegmentOpen(
                segment=ref,
                leader_epoch=eff.epoch,
                base_offset=int(s.base_offset),
                start_vector=vector_to_proto(VectorOffset(start_vector)),
            )
        )
    )

    async def requests() -> AsyncIterator[pb.SegmentAppendRequest]:
        while (request := await outbox.get()) is not None:
            yield request

    async with m.channel(m.addresses[c.target]) as channel:
        call = segments_stub(channel).AppendSegment(requests(), timeout=CALL_TIMEOUT_S * 6)
        answers: AsyncIterator[pb.SegmentAck] = aiter(call)
        first = await anext(answers, None)
        if first is None:
            raise _CopyShort(f"member {c.target} ended the copy before answering")
        async for chunk in _read(m, eff, c.source, first.end_offset, c.end_offset):
            outbox.put_nowait(pb.SegmentAppendRequest(batches=chunk))
        outbox.put_nowait(None)
        flushed = first.flushed_offset
        async for ack in answers:
            flushed = ack.flushed_offset
        if flushed < c.end_offset:
            raise _CopyShort(f"member {c.target} holds {flushed} fsynced after the copy, short of {c.end_offset}")


# -- seal ----------------------------------------------------------------------------------------------------------


async def tell_sealed(m: Members, eff: SegmentSealed) -> None:
    """The seal of ``eff.segment_id`` at ``eff.end`` is committed: every member records it and cuts a longer copy.
    Best effort: a member that misses it keeps its tail, which was never acked nor read (reads stop at the sealed
    end), until it learns the seal from its view."""
    key, sid, end = eff.key, eff.segment_id, eff.end
    ref = segment_ref(m.store, key, sid)

    async def tell(node: NodeId) -> None:
        try:
            if node == m.me:
                await m.run(m.store.seal, key, eff.epoch, sid, end, m.clock_ms())
                return
            async with m.channel(m.addresses[node]) as ch:
                await segments_stub(ch).SealSegment(
                    pb.SealSegmentRequest(segment=ref, leader_epoch=eff.epoch, end_offset=end), timeout=CALL_TIMEOUT_S
                )
        except (grpc.aio.AioRpcError, OSError, BrokerError, ReplicaError, Fenced, KeyError) as exc:
            log.warning(
                "segment %d of %s-%d is sealed at %d, but member %d was not told: %s", sid, *key, end, node, exc
            )

    await asyncio.gather(*(tell(n) for n in eff.ensemble))


# -- one recovery alone ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SegmentToRecover:
    """The open segment as the metadata that named this node leader describes it."""

    key: PartitionKey
    segment_id: SegmentId
    base_offset: int
    start_vector: Mapping[Origin, OriginSeq]
    ensemble: tuple[NodeId, ...]
    ack_quorum: int  # the segment's own (OpenSegment.ack_quorum), else the site's
    epoch: LeaderEpoch  # the new leader's


Seal_ = Callable[[SegmentId, LocalOffset], Awaitable[str | None]]


async def recover_segment(
    store: ReplicaStore,
    segment: SegmentToRecover,
    me: NodeId,
    addresses: Mapping[NodeId, str],
    seal: Seal_,
    executor: ThreadPoolExecutor,
    clock_ms: Callable[[], int],
    tls: TlsConfig | None = None,
    fences: FenceWaves | None = None,
) -> LocalOffset:
    """Recover ``segment`` as its new leader ``me`` (one attempt); returns the sealed end, where the next segment
    starts. ``seal`` commits the seal: None once committed, else why it was refused. Raises
    :class:`RecoveryFailed` (try again later) and :class:`NotLeader` (a newer leader fenced a member). Recoveries
    run together share ``fences``, as a node's do."""
    m = Members(store, me, addresses, executor, clock_ms, channels(tls), fences or FenceWaves())
    s = segment
    opened = SegmentInfo(
        s.segment_id, LocalOffset(s.base_offset), s.ensemble, LeaderEpoch(max(s.epoch - 1, 0)), ack_quorum=s.ack_quorum
    )
    info = PartitionInfo(s.key[0], s.key[1], me, s.epoch, (opened,))
    lead = PartitionLead(me, s.key, s.epoch, LeadConfig(len(s.ensemble), s.ack_quorum, RETRY_MS, 0), opened)
    answers: asyncio.Queue[LeadEvent] = asyncio.Queue()
    tasks: set[asyncio.Task[None]] = set()

    def context() -> LeadContext:
        return LeadContext(clock_ms(), info, list)

    def spawn(work: Awaitable[LeadEvent]) -> None:
        async def run() -> None:
            try:
                event = await work
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug or an unforeseen error: fail this recovery (retried), never hang it
                log.exception("recovery of %s-%d: an effect failed", *s.key)
                why = f"{s.key[0]}-{s.key[1]}: {type(exc).__name__}: {exc}"

                def failed(lead: PartitionLead, ctx: LeadContext) -> list[LeadEffect]:
                    raise RecoveryFailed(why)

                event = failed
            answers.put_nowait(event)

        task = asyncio.create_task(run())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def sealed(eff: ProposeSeal) -> LeadEvent:
        refused = await seal(eff.segment.segment_id, LocalOffset(eff.end))
        result = Applied() if refused is None else Refused(RefusalCode.STALE_EPOCH, refused)  # the code is not read
        return lambda lead, ctx: lead.sealed(eff.token, result, ctx)

    try:
        effects = lead.start(context())
        while True:
            for eff in effects:
                if isinstance(eff, FenceMember):
                    spawn(fence_member(m, eff))
                elif isinstance(eff, CopyTail):
                    spawn(copy_tail(m, eff, s.start_vector))
                elif isinstance(eff, ProposeSeal):
                    spawn(sealed(eff))
                elif isinstance(eff, SegmentSealed):
                    await tell_sealed(m, eff)
                    return LocalOffset(eff.end)
                elif isinstance(eff, StepDown):
                    raise NotLeader(*s.key, eff.reason)
                elif isinstance(eff, Note) and eff.what == "recovery_failed":
                    raise RecoveryFailed(f"{s.key[0]}-{s.key[1]}: {eff.message}")
            event = await answers.get()
            effects = event(lead, context())
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
