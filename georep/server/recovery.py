"""A new leader's recovery of a partition's open segment, over the node's store and the members' gRPC. Shell.

Every decision is :class:`cluster.recovery.SegmentRecovery`'s (fence whom,
which end, copy what from where, when to seal; its docstring has the
proof). :func:`recover_segment` carries its effects out and feeds the
answers back, all of them concurrently:

* ``Fence``: this node's own copy through its
  :class:`~georep.storage.replica_store.ReplicaStore`, the others with
  ``FenceSegments``. A member without a copy of the segment holds nothing of
  it: it answers the segment's base. A member fenced by a newer epoch
  (``ABORTED``, its epoch in the trailing metadata) is ``fence_refused``; one
  that cannot be reached is ``unreachable``.
* ``Copy``: the source's bytes from ``ReadSegment`` (or the local store),
  appended to the target from the end the target reports (an earlier copy
  may have got partway; by (P) those bytes are the same), fsynced.
* ``Seal``: the caller's ``seal`` (one conditional command in the site's
  metadata), which answers None when committed or the reason it was refused.
* ``Done``: every member is told the seal (``SealSegment``) and cuts a longer
  copy. A member that misses it keeps its tail until it is told again; its
  tail was never acked nor read, and reads stop at the sealed end.

``Failed`` raises :class:`RecoveryFailed` and ``Superseded`` raises
:class:`~georep.broker.errors.NotLeader`; both say what to do.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import grpc

from cluster.quorum import Fenced
from cluster.recovery import Copy, Done, Effect, Failed, Fence, Seal, SegmentRecovery, Superseded
from georep.broker.errors import BrokerError, NotLeader, RecoveryFailed
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.proto.convert import vector_to_proto
from georep.security.tls import ChannelFactory, TlsConfig, channels
from georep.server.rpc import FENCED_EPOCH_METADATA
from georep.storage.replica_store import PartitionKey, ReplicaError, ReplicaStore
from offsets.coordinates import LocalOffset, Origin, OriginSeq
from offsets.vector import VectorOffset
from topology.ids import LeaderEpoch, NodeId, SegmentId

log = logging.getLogger(__name__)

T = TypeVar("T")
CALL_TIMEOUT_S = 10.0
READ_MAX_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class SegmentToRecover:
    """The open segment as the metadata that named this node leader describes it."""

    key: PartitionKey
    segment_id: SegmentId
    base_offset: int
    start_vector: Mapping[Origin, OriginSeq]
    ensemble: tuple[NodeId, ...]
    ack_quorum: int
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
) -> LocalOffset:
    """Recover ``segment`` as its new leader ``me``; returns the sealed end, where the next segment starts."""
    return await _Recovery(store, segment, me, addresses, seal, executor, clock_ms, channels(tls)).run()


class _Recovery:
    def __init__(self, store: ReplicaStore, segment: SegmentToRecover, me: NodeId, addresses: Mapping[NodeId, str],
                 seal: Seal_, executor: ThreadPoolExecutor, clock_ms: Callable[[], int],
                 channel: ChannelFactory) -> None:  # fmt: skip
        self.store = store
        self.s = segment
        self.me = me
        self.addresses = addresses
        self.seal = seal
        self.executor = executor
        self.clock_ms = clock_ms
        self.channel = channel
        self.rec = SegmentRecovery(segment.segment_id, segment.base_offset, segment.ensemble, segment.ack_quorum,
                                   segment.epoch, me)  # fmt: skip
        self.answers: asyncio.Queue[Callable[[], list[Effect]]] = asyncio.Queue()
        self.tasks: set[asyncio.Task[None]] = set()
        self.ref = pb.SegmentRef(topic=segment.key[0], partition=segment.key[1], segment_id=segment.segment_id)

    async def _run_local(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def run(self) -> LocalOffset:
        try:
            done = self._perform(self.rec.start())
            while done is None:
                answer = await self.answers.get()
                done = self._perform(answer())
        finally:
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
        await self._tell_members(done.end_offset)
        return done.end_offset

    def _perform(self, effects: list[Effect]) -> Done | None:
        for effect in effects:
            if isinstance(effect, Fence):
                self._spawn(self._fence(effect.node))
            elif isinstance(effect, Copy):
                self._spawn(self._copy(effect))
            elif isinstance(effect, Seal):
                self._spawn(self._seal(effect))
            elif isinstance(effect, Done):
                return effect
            elif isinstance(effect, Failed):
                raise RecoveryFailed(f"{self.s.key[0]}-{self.s.key[1]}: {effect.reason}")
            elif isinstance(effect, Superseded):
                raise NotLeader(*self.s.key, effect.reason)
        return None

    def _spawn(self, work: Awaitable[Callable[[], list[Effect]]]) -> None:
        async def run() -> None:
            try:
                answer = await work
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug or an unforeseen error: fail this recovery (retried), never hang it
                log.exception("recovery of %s-%d: an effect failed", *self.s.key)
                answer = functools.partial(_fail, f"{self.s.key[0]}-{self.s.key[1]}: {type(exc).__name__}: {exc}")
            self.answers.put_nowait(answer)

        task = asyncio.create_task(run())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _refused(self, node: NodeId, exc: grpc.aio.AioRpcError) -> Callable[[], list[Effect]] | None:
        """The answer to a member's ABORTED: fenced by a newer epoch."""
        if exc.code() != grpc.StatusCode.ABORTED:
            return None
        epoch = dict(exc.trailing_metadata() or ()).get(FENCED_EPOCH_METADATA)
        their = int(epoch) if isinstance(epoch, str) and epoch.isdigit() else self.s.epoch + 1
        return lambda: self.rec.fence_refused(node, their)

    # -- fence ---------------------------------------------------------------------------------------------

    async def _fence(self, node: NodeId) -> Callable[[], list[Effect]]:
        s = self.s
        try:
            if node == self.me:
                ends = await self._run_local(self.store.fence, s.key, s.epoch)
                end = ends.get(s.segment_id, s.base_offset)
            else:
                async with self.channel(self.addresses[node]) as channel:
                    answer = await pbg.SegmentsStub(channel).FenceSegments(
                        pb.FenceSegmentsRequest(topic=s.key[0], partition=s.key[1], leader_epoch=s.epoch),
                        timeout=CALL_TIMEOUT_S)  # fmt: skip
                end = next((e.end_offset for e in answer.ends if e.segment_id == s.segment_id), s.base_offset)
        except Fenced as exc:
            their = exc.fenced_epoch
            return lambda: self.rec.fence_refused(node, their)
        except grpc.aio.AioRpcError as exc:
            log.warning("recovery of %s-%d: fencing member %d failed: %s: %s", *s.key, node, exc.code().name,
                        exc.details())  # fmt: skip
            return self._refused(node, exc) or (lambda: self.rec.unreachable(node))
        except (OSError, ReplicaError) as exc:
            log.error("recovery of %s-%d: this node's own copy cannot be fenced: %s", *s.key, exc)
            return lambda: self.rec.unreachable(node)
        log.info("recovery of %s-%d: member %d fenced at epoch %d, holds segment %d up to %d", *s.key, node, s.epoch,
                 s.segment_id, end)  # fmt: skip
        return lambda: self.rec.fenced(node, end)

    # -- copy ----------------------------------------------------------------------------------------------

    async def _read(self, node: NodeId, start: int, end: int) -> AsyncIterator[bytes]:
        s = self.s
        if node == self.me:
            offset = LocalOffset(start)
            while offset < end:
                result = await self._run_local(self.store.read, s.key, s.segment_id, offset, READ_MAX_BYTES, end)
                if not result.data:
                    return
                yield result.data
                offset = result.next_offset
            return
        async with self.channel(self.addresses[node]) as channel:
            async for r in pbg.SegmentsStub(channel).ReadSegment(
                    pb.ReadSegmentRequest(segment=self.ref, offset=start, end_offset=end, max_bytes=READ_MAX_BYTES),
                    timeout=CALL_TIMEOUT_S):  # fmt: skip
                yield r.batches

    async def _copy(self, c: Copy) -> Callable[[], list[Effect]]:
        s = self.s
        try:
            if c.target == self.me:
                await self._copy_here(c)
            else:
                await self._copy_there(c)
        except Fenced as exc:
            their = exc.fenced_epoch
            return lambda: self.rec.fence_refused(c.target, their)
        except grpc.aio.AioRpcError as exc:
            refused = self._refused(c.target, exc)
            if refused is not None:
                return refused
            why = f"{exc.code().name}: {exc.details()}"
            return lambda: self.rec.copy_failed(c.target, why)
        except (OSError, BrokerError, ReplicaError, _CopyShort) as exc:
            why = str(exc)
            return lambda: self.rec.copy_failed(c.target, why)
        log.info("recovery of %s-%d: copied segment %d [%d, %d) from member %d to member %d", *s.key, s.segment_id,
                 c.start_offset, c.end_offset, c.source, c.target)  # fmt: skip
        return lambda: self.rec.copied(c.target, c.end_offset)

    async def _copy_here(self, c: Copy) -> None:
        s, store = self.s, self.store
        await self._run_local(store.open_segment, s.key, s.epoch, s.segment_id, s.base_offset, dict(s.start_vector),
                              self.clock_ms())  # fmt: skip
        held = await self._run_local(store.end_offset, s.key, s.segment_id)
        async for chunk in self._read(c.source, held, c.end_offset):
            await self._run_local(store.append, s.key, s.epoch, s.segment_id, chunk)
        flushed = await self._run_local(store.flush, s.key, s.segment_id)
        if flushed < c.end_offset:
            raise _CopyShort(f"member {c.source} sent up to {flushed}, short of {c.end_offset}")

    async def _copy_there(self, c: Copy) -> None:
        s = self.s
        outbox: asyncio.Queue[pb.SegmentAppendRequest | None] = asyncio.Queue()
        outbox.put_nowait(pb.SegmentAppendRequest(open=pb.SegmentOpen(
            segment=self.ref, leader_epoch=s.epoch, base_offset=s.base_offset,
            start_vector=vector_to_proto(VectorOffset(s.start_vector)),
        )))  # fmt: skip

        async def requests() -> AsyncIterator[pb.SegmentAppendRequest]:
            while (request := await outbox.get()) is not None:
                yield request

        async with self.channel(self.addresses[c.target]) as channel:
            call = pbg.SegmentsStub(channel).AppendSegment(requests(), timeout=CALL_TIMEOUT_S * 6)
            answers: AsyncIterator[pb.SegmentAck] = aiter(call)
            first = await anext(answers, None)
            if first is None:
                raise _CopyShort(f"member {c.target} ended the copy before answering")
            async for chunk in self._read(c.source, first.end_offset, c.end_offset):
                outbox.put_nowait(pb.SegmentAppendRequest(batches=chunk))
            outbox.put_nowait(None)
            flushed = first.flushed_offset
            async for ack in answers:
                flushed = ack.flushed_offset
            if flushed < c.end_offset:
                raise _CopyShort(f"member {c.target} holds {flushed} fsynced after the copy, short of {c.end_offset}")

    # -- seal and cut --------------------------------------------------------------------------------------

    async def _seal(self, effect: Seal) -> Callable[[], list[Effect]]:
        refused = await self.seal(effect.segment_id, effect.end_offset)
        if refused is None:
            return lambda: self.rec.seal_committed(effect.end_offset)
        return lambda: self.rec.seal_refused(refused)

    async def _tell_members(self, end: LocalOffset) -> None:
        s = self.s
        await tell_sealed(self.store, s.key, s.segment_id, s.epoch, end, s.ensemble, self.me, self.addresses,
                          self.executor, self.clock_ms, self.channel)  # fmt: skip


async def tell_sealed(store: ReplicaStore, key: PartitionKey, segment_id: SegmentId, epoch: LeaderEpoch,
                      end: LocalOffset, ensemble: tuple[NodeId, ...], me: NodeId, addresses: Mapping[NodeId, str],
                      executor: ThreadPoolExecutor, clock_ms: Callable[[], int],
                      channel: ChannelFactory) -> None:  # fmt: skip
    """The seal of ``segment_id`` at ``end`` is committed: every member records it and cuts a longer copy. Best
    effort: a member that misses it keeps its tail, which was never acked nor read (reads stop at the sealed end),
    until it is told again."""
    ref = pb.SegmentRef(topic=key[0], partition=key[1], segment_id=segment_id)

    async def tell(node: NodeId) -> None:
        try:
            if node == me:
                await asyncio.get_running_loop().run_in_executor(executor, store.seal, key, epoch, segment_id, end,
                                                                 clock_ms())  # fmt: skip
                return
            async with channel(addresses[node]) as ch:
                await pbg.SegmentsStub(ch).SealSegment(
                    pb.SealSegmentRequest(segment=ref, leader_epoch=epoch, end_offset=end), timeout=CALL_TIMEOUT_S)
        except (grpc.aio.AioRpcError, OSError, BrokerError, ReplicaError, Fenced, KeyError) as exc:
            log.warning("segment %d of %s-%d is sealed at %d, but member %d was not told: %s", segment_id, *key, end,
                        node, exc)  # fmt: skip

    await asyncio.gather(*(tell(n) for n in ensemble))


def _fail(reason: str) -> list[Effect]:
    """The answer of an effect that raised: the recovery fails (``RecoveryFailed``), and its leader tries again."""
    raise RecoveryFailed(reason)


class _CopyShort(Exception):
    """A copy that ended before the end it was asked for."""

