"""The leader's side of one open segment: its own copy, and a stream to every other member. Shell.

Inside a multi-node site the partition leader writes the open segment to
every member of its ensemble (``cluster/quorum.py``, docs/design.md,
"Multi-node sites"). A :class:`SegmentWriter` does that for one segment:

* **Its own copy** is the leader's :class:`~georep.storage.replica_store.ReplicaStore`
  copy of the segment. :meth:`SegmentWriter.append` appends there (batches
  with the leader's local prefixes), and a coalescing fsync reports the
  leader's own end to the quorum, as one member among the others.
* **One stream per other member** (``AppendSegment``). It opens with the
  segment and the member answers what it holds; the stream sends from that
  end whatever the leader's copy holds beyond it, reading the copy, so a
  member that reconnects, restarts or fell behind is caught up from the same
  bytes, and nothing is buffered per member. At most ``in_flight`` requests
  are unanswered; what is appended meanwhile goes into the next request, so
  members fsync once per request, not per batch.
* **The quorum decides** (:class:`~cluster.quorum.SegmentQuorum`): every
  member's fsynced end goes in, the LAC comes out, and
  :meth:`SegmentWriter.confirmed` resolves once the LAC reaches an offset.
  A broken stream is :meth:`~cluster.quorum.SegmentQuorum.member_failed`
  until it is back; it is retried with a backoff.
* **A member fenced by a newer leader** (``ABORTED``) ends the writer: this
  node is no longer the leader. Every waiter fails with
  :class:`~georep.broker.errors.NotLeader`, and nothing more is sent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import grpc

from cluster.quorum import LacAdvanced, QuorumEffect, QuorumError, QuorumLost, QuorumRegained, SegmentQuorum
from georep.broker.errors import NotLeader
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.proto.convert import vector_to_proto
from georep.security.tls import TlsConfig, channels
from georep.storage.replica_store import PartitionKey, ReplicaStore
from offsets.coordinates import LocalOffset, Origin, OriginSeq
from offsets.vector import VectorOffset
from topology.ids import LeaderEpoch, NodeId, SegmentId

log = logging.getLogger(__name__)

T = TypeVar("T")
REQUEST_MAX_BYTES = 1 << 20
IN_FLIGHT = 2
BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 2.0


class StreamBroken(Exception):
    """A member's stream ended or answered what it cannot (the writer retries it)."""


@dataclass(frozen=True, slots=True)
class SegmentToWrite:
    """What the site's metadata says of the segment being written."""

    key: PartitionKey
    segment_id: SegmentId
    base_offset: int
    start_vector: Mapping[Origin, OriginSeq]  # the end vector of the segment before it
    ensemble: tuple[NodeId, ...]
    ack_quorum: int
    epoch: LeaderEpoch


class SegmentWriter:
    """Writes one open segment to its ensemble; see the module docstring."""

    def __init__(
        self,
        store: ReplicaStore,
        segment: SegmentToWrite,
        me: NodeId,
        addresses: Mapping[NodeId, str],
        executor: ThreadPoolExecutor,
        clock_ms: Callable[[], int],
        tls: TlsConfig | None = None,
    ) -> None:
        self.store = store
        self.segment = segment
        self.me = me
        self.quorum = SegmentQuorum(segment.segment_id, segment.base_offset, segment.ensemble, segment.ack_quorum,
                                    segment.epoch, me)  # fmt: skip
        missing = [n for n in segment.ensemble if n != me and n not in addresses]
        if missing:
            raise ValueError(f"no address for ensemble member(s) {missing}: list every node of the site")
        self.addresses = dict(addresses)
        self.executor = executor
        self.clock_ms = clock_ms
        self._channel = channels(tls)
        self._appended = asyncio.Event()  # set when the appended end moves: member streams wake up
        self._append_lock = asyncio.Lock()  # appends reach the copy, and the quorum, in the order they were made
        self._backoff: dict[NodeId, float] = {}
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._flushing: asyncio.Task[None] | None = None
        self._flush_again = False
        self._deposed: NotLeader | None = None
        self._closed = False
        # Called with each new LAC: the broker releases acks=all and serves readers up to it.
        self.on_lac: Callable[[int], None] = lambda lac: None
        # Called with the end each fsync of the leader's own copy reached (or None and why it failed): acks=leader.
        self.on_own_flush: Callable[[int | None, str], None] = lambda flushed, error: None

    @property
    def lac(self) -> int:
        return self.quorum.lac

    @property
    def deposed(self) -> NotLeader | None:
        """Why this writer stopped, if a newer leader fenced it."""
        return self._deposed

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # -- the leader's calls ----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the leader's own copy and a stream to every other member."""
        s = self.segment
        await self._run(self.store.open_segment, s.key, s.epoch, s.segment_id, s.base_offset, dict(s.start_vector),
                        self.clock_ms())  # fmt: skip
        self._tasks = [asyncio.create_task(self._member(node)) for node in s.ensemble if node != self.me]

    async def append(self, batches: bytes) -> int:
        """Append whole batches (local prefixes set: base offsets from the segment's end) to the leader's copy.
        Returns the new appended end; :meth:`confirmed` says when the ack quorum holds it."""
        s = self.segment
        async with self._append_lock:
            self._check_writable()
            end = await self._run(self.store.append, s.key, s.epoch, s.segment_id, batches)
            self.quorum.appended(end)
        self._appended.set()
        self._start_flush()
        return end

    def appended(self, end: int) -> None:
        """The broker appended to the leader's copy itself (``ChainLog.append``), up to ``end``: stream it to the
        members and fsync it. Ends reported out of order (a replicated apply finishing after a produce) are fine:
        only a larger end moves anything."""
        self._check_writable()
        if end <= self.quorum.appended_end:
            return
        self.quorum.appended(end)
        self._appended.set()
        self._start_flush()

    def confirmed(self, end_offset: int) -> asyncio.Future[None]:
        """Resolves once the LAC reaches ``end_offset``: ``acks=all`` for a batch ending there may go.
        Fails with :class:`NotLeader` if a newer leader fences this one first."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._deposed is not None:
            fut.set_exception(self._deposed)
        elif self.quorum.lac >= end_offset:
            fut.set_result(None)
        else:
            self._waiters.append((end_offset, fut))
        return fut

    async def close(self) -> None:
        """Stop every stream (the segment rolls, or the node stops); pending waiters fail."""
        self._closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._flushing is not None:
            await asyncio.gather(self._flushing, return_exceptions=True)
        self._fail_waiters(NotLeader(*self.segment.key, f"segment {self.segment.segment_id}'s writer stopped"))

    # -- the quorum's effects --------------------------------------------------------------------------------

    def _perform(self, effects: list[QuorumEffect]) -> None:
        for effect in effects:
            if isinstance(effect, LacAdvanced):
                self.on_lac(effect.lac)
                self._appended.set()  # member streams announce it (follower reads)
                keep = []
                for end, fut in self._waiters:
                    if end <= effect.lac:
                        if not fut.done():
                            fut.set_result(None)
                    else:
                        keep.append((end, fut))
                self._waiters = keep
            elif isinstance(effect, QuorumLost):
                log.warning("%s", effect.message())
            elif isinstance(effect, QuorumRegained):
                log.info("segment %d has an ack quorum of live members again", effect.segment_id)

    def _fail_waiters(self, error: Exception) -> None:
        for _, fut in self._waiters:
            if not fut.done():
                fut.set_exception(error)
        self._waiters = []

    def _check_writable(self) -> None:
        if self._deposed is not None:
            raise self._deposed
        if self._closed:
            raise NotLeader(*self.segment.key, f"segment {self.segment.segment_id}'s writer stopped")

    def _depose(self, node: NodeId, details: str) -> None:
        if self._deposed is None:
            self._deposed = NotLeader(*self.segment.key, f"member {node} is fenced by a newer leader ({details})")
            log.warning("%s", self._deposed)
            self._fail_waiters(self._deposed)
            for task in self._tasks:
                if task is not asyncio.current_task():
                    task.cancel()

    # -- the leader's own fsync ------------------------------------------------------------------------------

    def flush_soon(self) -> None:
        """fsync the leader's copy now (or right after the running fsync); ``on_own_flush`` reports it."""
        self._start_flush()

    def _start_flush(self) -> None:
        if self._flushing is not None:
            self._flush_again = True  # one more after the running one: it may have missed this append
            return
        self._flushing = asyncio.create_task(self._flush())

    async def _flush(self) -> None:
        s = self.segment
        try:
            while True:
                self._flush_again = False
                flushed = await self._run(self.store.flush, s.key, s.segment_id)
                self._perform(self.quorum.member_acked(self.me, flushed))
                self.on_own_flush(flushed, "")
                if not self._flush_again:
                    return
        except OSError as exc:  # the leader's own disk: its copy no longer counts until the segment rolls
            log.error("fsync of segment %d of %s-%d failed: %s", s.segment_id, *s.key, exc)
            self._perform(self.quorum.member_failed(self.me))
            self.on_own_flush(None, str(exc))
        finally:
            self._flushing = None

    # -- one member's stream ---------------------------------------------------------------------------------

    async def _member(self, node: NodeId) -> None:
        while not self._closed and self._deposed is None:
            try:
                async with self._channel(self.addresses[node]) as channel:
                    await self._stream(node, pbg.SegmentsStub(channel))
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.ABORTED:
                    self._depose(node, exc.details() or "fenced")
                    return
                self._broken(node, f"{exc.code().name}: {exc.details()}")
            except (StreamBroken, QuorumError) as exc:
                self._broken(node, str(exc))
            self._perform(self.quorum.member_failed(node))
            backoff = self._backoff.get(node, BACKOFF_MIN_S)
            self._backoff[node] = min(backoff * 2, BACKOFF_MAX_S)
            await asyncio.sleep(backoff)

    def _broken(self, node: NodeId, why: str) -> None:
        s = self.segment
        log.warning("segment %d of %s-%d: stream to member %d (%s) broke: %s; retrying", s.segment_id, *s.key, node,
                    self.addresses[node], why)  # fmt: skip

    async def _stream(self, node: NodeId, stub: pbg.SegmentsAsyncStub) -> None:
        """One stream to ``node``, until it breaks (raises) or the writer closes (cancelled)."""
        s = self.segment
        outbox: asyncio.Queue[pb.SegmentAppendRequest] = asyncio.Queue()
        ref = pb.SegmentRef(topic=s.key[0], partition=s.key[1], segment_id=s.segment_id)
        outbox.put_nowait(pb.SegmentAppendRequest(open=pb.SegmentOpen(
            segment=ref, leader_epoch=s.epoch, base_offset=s.base_offset,
            start_vector=vector_to_proto(VectorOffset(s.start_vector)),
        )))  # fmt: skip

        async def requests() -> AsyncIterator[pb.SegmentAppendRequest]:
            while True:
                yield await outbox.get()

        call = stub.AppendSegment(requests())
        try:
            answers: AsyncIterator[pb.SegmentAck] = aiter(call)
            first = await anext(answers, None)
            if first is None:
                raise StreamBroken("the member ended the stream before answering")
            if first.end_offset > self.quorum.appended_end:
                # A copy of a segment this writer opened can only hold what it sent: this is a bug, or another
                # writer of the same epoch. Never count it.
                raise StreamBroken(f"the member holds up to offset {first.end_offset}, past this leader's end "
                                   f"{self.quorum.appended_end}")  # fmt: skip
            self._perform(self.quorum.member_reconnected(node))
            self._perform(self.quorum.member_acked(node, first.flushed_offset))
            self._backoff.pop(node, None)  # it answered: the next failure starts the backoff over
            in_flight = asyncio.Semaphore(IN_FLIGHT)
            sender = asyncio.create_task(self._send(outbox, LocalOffset(first.end_offset), in_flight))
            receiver = asyncio.create_task(self._receive(node, answers, in_flight))
            try:
                done, _ = await asyncio.wait((sender, receiver), return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()  # raises what ended it
                raise StreamBroken("the member ended the stream")
            finally:
                sender.cancel()
                receiver.cancel()
                await asyncio.gather(sender, receiver, return_exceptions=True)
        finally:
            call.cancel()

    async def _receive(self, node: NodeId, answers: AsyncIterator[pb.SegmentAck],
                       in_flight: asyncio.Semaphore) -> None:  # fmt: skip
        async for ack in answers:
            in_flight.release()
            self._perform(self.quorum.member_acked(node, ack.flushed_offset))

    async def _send(self, outbox: asyncio.Queue[pb.SegmentAppendRequest], offset: LocalOffset,
                    in_flight: asyncio.Semaphore) -> None:  # fmt: skip
        """Send the leader's copy from ``offset`` on, as it grows: at most ``IN_FLIGHT`` requests unanswered.

        Every request carries the LAC, and the LAC goes alone when it moved while nothing was left to send, so a
        member's follower reads reach the end the leader serves once writes pause (BookKeeper's explicit LAC)."""
        s = self.segment
        announced = 0
        while True:
            while offset >= self.quorum.appended_end and self.quorum.lac <= announced:
                self._appended.clear()
                await self._appended.wait()
            await in_flight.acquire()
            lac = self.quorum.lac
            if offset < self.quorum.appended_end:
                result = await self._run(self.store.read, s.key, s.segment_id, offset, REQUEST_MAX_BYTES)
                outbox.put_nowait(pb.SegmentAppendRequest(batches=result.data, lac=lac))
                offset = result.next_offset
            else:
                outbox.put_nowait(pb.SegmentAppendRequest(lac=lac))
            announced = lac
