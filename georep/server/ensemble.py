"""The leader's side of one open segment: its own copy, and a stream to every other member. Shell.

Inside a multi-node site the partition leader writes the open segment to every member of its ensemble
(``cluster/quorum.py``, docs/design.md, "Multi-node sites"). Every decision of that is the partition lead's
(:class:`cluster.lead.PartitionLead`: the LAC, the release limit, the resend rule, what a refusal ends), which both
cluster simulators drive too. A :class:`SegmentWriter` carries out its effects for one segment, and feeds it what
happens (``feed``: the node steps the lead with the event and carries out what it returns):

* **Its own copy** is the leader's :class:`~georep.storage.replica_store.ReplicaStore` copy of the segment.
  :meth:`SegmentWriter.append` appends there (batches with the leader's local prefixes) and feeds the lead
  ``appended``; a coalescing fsync feeds ``member_acked`` for this node, as one member among the others.
* **One stream per other member** (``AppendSegment``). It opens with the segment and the member answers what it
  holds (``member_reconnected`` after a break, ``member_acked``); it sends the leader's copy from where the lead
  says (:class:`~cluster.lead.StreamTo`: the resend rule), reading the copy, so a member that reconnects,
  restarts or fell behind is caught up from the same bytes, and nothing is buffered per member. At most
  ``IN_FLIGHT`` requests are unanswered; what is appended meanwhile goes into the next request, so members fsync
  once per request, not per batch. A broken stream feeds ``member_failed``; it is opened again when the lead says
  (:class:`~cluster.lead.Reconnect`), after a backoff, and through the peer's
  :class:`~georep.server.member_gates.MemberGate`: while the member is unreachable, one writer of the node at a
  time probes it for all of them (no probe while the site's metadata shows it dead), and the others open their
  streams once one answers.
* **Releases** (:class:`~cluster.lead.Release`): :meth:`SegmentWriter.confirmed` resolves once the lead released
  an offset (``acks=all``).
* **A member fenced by a newer leader** (``ABORTED``) feeds ``member_refused``, and ends the writer: every waiter
  fails with :class:`~georep.broker.errors.NotLeader`, and nothing more is sent.

:func:`solo_writer` runs one writer with a lead of its own, for a caller without a node (tests).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import grpc

from cluster.lead import LeadConfig, LeadContext, LeadEffect, Note, PartitionLead, Reconnect, Release, StreamTo
from cluster.quorum import QuorumError
from cluster.site_state import PartitionInfo, SegmentInfo
from georep.broker.errors import NotLeader
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.proto.convert import vector_to_proto
from georep.security.tls import TlsConfig, channels
from georep.server.member_gates import Admission, MemberGate, MemberGates
from georep.server.peer_channels import ChannelUse, segments_stub
from georep.server.segment_refs import segment_ref
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

LeadEvent = Callable[[PartitionLead, LeadContext], list[LeadEffect]]
Feed = Callable[[LeadEvent], None]


class StreamBroken(Exception):
    """A member's stream ended or answered what it cannot (the writer opens it again)."""


@dataclass(frozen=True, slots=True)
class SegmentToWrite:
    """What the site's metadata says of the segment being written."""

    key: PartitionKey
    segment_id: SegmentId
    base_offset: int
    start_vector: Mapping[Origin, OriginSeq]  # the end vector of the segment before it
    ensemble: tuple[NodeId, ...]
    ack_quorum: int  # the segment's own (OpenSegment.ack_quorum), else the site's
    epoch: LeaderEpoch


class _Stream:
    """One member's stream: where it sends from next (the lead's word), and its task."""

    def __init__(self, position: int) -> None:
        self.position = position
        self.task: asyncio.Task[None] | None = None
        self.backoff_s = BACKOFF_MIN_S


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
        feed: Feed,
        tls: TlsConfig | None = None,
        channel: ChannelUse | None = None,
        gates: MemberGates | None = None,
    ) -> None:
        self.store = store
        self.segment = segment
        self.me = me
        missing = [n for n in segment.ensemble if n != me and n not in addresses]
        if missing:
            raise ValueError(f"no address for ensemble member(s) {missing}: list every node of the site")
        self.addresses = dict(addresses)
        self.executor = executor
        self.clock_ms = clock_ms
        self.feed = feed
        self._channel = channel or channels(tls)  # the node's channels to its peers, shared (peer_channels.py)
        self._gates = gates or MemberGates()  # the node's reconnect backoff per peer, shared (member_gates.py)
        self.appended_end = segment.base_offset
        self.released = segment.base_offset  # what the lead released: acks=all up to here
        self._wake = asyncio.Event()  # set when there is more to send or announce: member streams wake up
        self._append_lock = asyncio.Lock()  # appends reach the copy, and the lead, in the order they were made
        self._streams = {n: _Stream(segment.base_offset) for n in segment.ensemble if n != me}
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._flushing: asyncio.Task[None] | None = None
        self._flush_again = False
        self._deposed: NotLeader | None = None
        self._closed = False
        # Called with each release: the broker releases acks=all and serves readers up to it.
        self.on_lac: Callable[[int], None] = lambda lac: None
        # Called with the end each fsync of the leader's own copy reached (or None and why it failed): acks=leader.
        self.on_own_flush: Callable[[int | None, str], None] = lambda flushed, error: None

    @property
    def lac(self) -> int:
        """What the lead released (the LAC, capped at a roll's seal)."""
        return self.released

    @property
    def deposed(self) -> NotLeader | None:
        """Why this writer stopped, if a newer leader fenced it."""
        return self._deposed

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def _feed(self, event: LeadEvent) -> None:
        """Tell the lead, unless this writer stopped (its late acks are of a segment the lead no longer writes)."""
        if not self._closed:
            self.feed(event)

    # -- the leader's calls ----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the leader's own copy and a stream to every other member."""
        s = self.segment
        await self._run(
            self.store.open_segment, s.key, s.epoch, s.segment_id, s.base_offset, dict(s.start_vector), self.clock_ms()
        )
        held = int(await self._run(self.store.end_offset, s.key, s.segment_id))
        if held > self.appended_end:  # the lead adopted a segment its copy holds some of: stream it too
            self.appended(held)
        for node in self._streams:
            self.reconnect(node)

    async def append(self, batches: bytes) -> int:
        """Append whole batches (local prefixes set: base offsets from the segment's end) to the leader's copy.
        Returns the new appended end; :meth:`confirmed` says when the lead releases it."""
        s = self.segment
        async with self._append_lock:
            self._check_writable()
            end = await self._run(self.store.append, s.key, s.epoch, s.segment_id, batches)
            self.appended(end)
        return end

    def appended(self, end: int) -> None:
        """The leader's copy holds up to ``end`` (this writer's append, or the broker's own, ``ChainLog.append``):
        the lead streams it to the members, and it is fsynced. Ends reported out of order (a replicated apply
        finishing after a produce) are fine: only a larger end moves anything."""
        self._check_writable()
        if end <= self.appended_end:
            return
        self.appended_end = end
        self._feed(lambda lead, ctx: lead.appended(end))
        self._start_flush()

    def confirmed(self, end_offset: int) -> asyncio.Future[None]:
        """Resolves once the lead released ``end_offset``: ``acks=all`` for a batch ending there may go.
        Fails with :class:`NotLeader` if the writer stops first."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._deposed is not None:
            fut.set_exception(self._deposed)
        elif self.released >= end_offset:
            fut.set_result(None)
        elif self._closed:
            fut.set_exception(NotLeader(*self.segment.key, f"segment {self.segment.segment_id}'s writer stopped"))
        else:
            self._waiters.append((end_offset, fut))
        return fut

    async def close(self, why: str = "") -> None:
        """Stop every stream (the segment rolls, or the node stops); pending waiters fail."""
        self._closed = True
        tasks = [st.task for st in self._streams.values() if st.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._flushing is not None:
            await asyncio.gather(self._flushing, return_exceptions=True)
        self._fail_waiters(NotLeader(*self.segment.key, why or f"segment {self.segment.segment_id}'s writer stopped"))

    # -- the lead's effects ----------------------------------------------------------------------------------

    def perform(self, effect: LeadEffect) -> None:
        """Carry out one of the lead's effects for this segment (the others are the node's)."""
        if isinstance(effect, StreamTo):
            self.stream_to(effect.member, effect.offset)
        elif isinstance(effect, Release):
            self.release(effect.end)
        elif isinstance(effect, Reconnect):
            self.reconnect(effect.member)
        elif isinstance(effect, Note):
            log.info("segment %d of %s-%d: %s %s", self.segment.segment_id, *effect.key, effect.what, effect.message)

    def stream_to(self, member: NodeId, offset: int) -> None:
        """Send ``member`` the copy from ``offset`` (the lead's resend rule); what it sent past that goes again."""
        stream = self._streams.get(member)
        if stream is not None:
            # Never forward: the lead asks from where it last sent, which this stream may not have reached yet.
            stream.position = min(stream.position, offset)
            self._wake.set()

    def release(self, end: int) -> None:
        if end <= self.released:
            return
        self.released = end
        self.on_lac(end)
        self._wake.set()  # member streams announce it (follower reads)
        keep = []
        for waiting, fut in self._waiters:
            if waiting <= end:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((waiting, fut))
        self._waiters = keep

    def reconnect(self, member: NodeId) -> None:
        """Open ``member``'s stream unless it runs."""
        stream = self._streams.get(member)
        if stream is None or self._closed or self._deposed is not None:
            return
        if stream.task is None or stream.task.done():
            stream.task = asyncio.create_task(self._member(member, stream))

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
            for stream in self._streams.values():
                if stream.task is not None and stream.task is not asyncio.current_task():
                    stream.task.cancel()
            sid = self.segment.segment_id
            self._feed(lambda lead, ctx: lead.member_refused(sid, node, details))

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
                flushed = int(await self._run(self.store.flush, s.key, s.segment_id))
                self._feed(_acked(self.me, flushed))
                self.on_own_flush(flushed, "")
                if not self._flush_again:
                    return
        except OSError as exc:  # the leader's own disk: its copy no longer counts until the segment rolls
            log.error("fsync of segment %d of %s-%d failed: %s", s.segment_id, *s.key, exc)
            self.on_own_flush(None, str(exc))
        finally:
            self._flushing = None

    # -- one member's stream ---------------------------------------------------------------------------------

    async def _member(self, node: NodeId, stream: _Stream) -> None:
        gate = self._gates[node]
        probe = await gate.admit() is Admission.PROBE
        answered: list[bool] = []  # set by _stream at the member's first answer (the gate is told there)
        unreachable = False
        try:
            async with self._channel(self.addresses[node]) as channel:
                await self._stream(node, stream, segments_stub(channel), gate, answered)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.ABORTED:
                self._depose(node, exc.details() or "fenced")
                return
            unreachable = exc.code() == grpc.StatusCode.UNAVAILABLE
            self._broken(node, f"{exc.code().name}: {exc.details()}")
        except (StreamBroken, QuorumError) as exc:
            self._broken(node, str(exc))
        finally:
            if unreachable:
                gate.failed(probe and not answered)
            elif probe and not answered:  # closed, or an answer that says nothing of the peer: another may probe
                gate.abandoned()
        if self._closed or self._deposed is not None:
            return
        self._feed(lambda lead, ctx: lead.member_failed(node, ctx.now_ms))
        backoff, stream.backoff_s = stream.backoff_s, min(stream.backoff_s * 2, BACKOFF_MAX_S)
        await asyncio.sleep(backoff)
        stream.task = None
        self._feed(lambda lead, ctx: lead.tick(ctx))  # the lead says when to open it again (Reconnect)

    def _broken(self, node: NodeId, why: str) -> None:
        s = self.segment
        log.warning(
            "segment %d of %s-%d: stream to member %d (%s) broke: %s; retrying",
            s.segment_id,
            *s.key,
            node,
            self.addresses[node],
            why,
        )

    async def _stream(
        self, node: NodeId, stream: _Stream, stub: pbg.SegmentsAsyncStub, gate: MemberGate, answered: list[bool]
    ) -> None:
        """One stream to ``node``, until it breaks (raises) or the writer closes (cancelled). Its first answer tells
        the peer's ``gate`` that the peer is reachable (``answered`` gets True)."""
        s = self.segment
        outbox: asyncio.Queue[pb.SegmentAppendRequest] = asyncio.Queue()
        ref = segment_ref(self.store, s.key, s.segment_id)
        outbox.put_nowait(
            pb.SegmentAppendRequest(
                open=pb.SegmentOpen(
                    segment=ref,
                    leader_epoch=s.epoch,
                    base_offset=s.base_offset,
                    start_vector=vector_to_proto(VectorOffset(s.start_vector)),
                )
            )
        )

        async def requests() -> AsyncIterator[pb.SegmentAppendRequest]:
            while True:
                yield await outbox.get()

        call = stub.AppendSegment(requests())
        try:
            answers: AsyncIterator[pb.SegmentAck] = aiter(call)
            first = await anext(answers, None)
            if first is None:
                raise StreamBroken("the member ended the stream before answering")
            answered.append(True)
            gate.answered()  # the peer is reachable: every writer waiting on it opens its stream
            if first.end_offset > self.appended_end:
                # A copy of a segment this writer opened can only hold what it sent: this is a bug, or another
                # writer of the same epoch. Never count it.
                raise StreamBroken(
                    f"the member holds up to offset {first.end_offset}, past this leader's end {self.appended_end}"
                )
            end, flushed = int(first.end_offset), int(first.flushed_offset)
            self._feed(lambda lead, ctx: lead.member_reconnected(node, end))
            self._feed(lambda lead, ctx: lead.member_acked(node, flushed))
            stream.backoff_s = BACKOFF_MIN_S  # it answered: the next failure starts the backoff over
            in_flight = asyncio.Semaphore(IN_FLIGHT)
            sender = asyncio.create_task(self._send(outbox, stream, in_flight))
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

    async def _receive(self, node: NodeId, answers: AsyncIterator[pb.SegmentAck], in_flight: asyncio.Semaphore) -> None:
        async for ack in answers:
            in_flight.release()
            self._feed(_acked(node, int(ack.flushed_offset)))

    async def _send(
        self, outbox: asyncio.Queue[pb.SegmentAppendRequest], stream: _Stream, in_flight: asyncio.Semaphore
    ) -> None:
        """Send the leader's copy from the stream's position on, as it grows: at most ``IN_FLIGHT`` requests
        unanswered.

        Every request carries the release, and the release goes alone when it moved while nothing was left to send,
        so a member's follower reads reach the end the leader serves once writes pause (BookKeeper's explicit LAC)."""
        s = self.segment
        announced = 0
        while True:
            while stream.position >= self.appended_end and self.released <= announced:
                self._wake.clear()
                await self._wake.wait()
            await in_flight.acquire()
            lac = self.released
            if stream.position < self.appended_end:
                result = await self._run(
                    self.store.read,
                    s.key,
                    s.segment_id,
                    LocalOffset(stream.position),
                    REQUEST_MAX_BYTES,
                    self.appended_end,
                )
                outbox.put_nowait(pb.SegmentAppendRequest(batches=result.data, lac=lac))
                stream.position = max(stream.position, int(result.next_offset))
            else:
                outbox.put_nowait(pb.SegmentAppendRequest(lac=lac))
            announced = lac


def _acked(node: NodeId, end: int) -> LeadEvent:
    return lambda lead, ctx: lead.member_acked(node, end)


def solo_writer(
    store: ReplicaStore,
    segment: SegmentToWrite,
    me: NodeId,
    addresses: Mapping[NodeId, str],
    executor: ThreadPoolExecutor,
    clock_ms: Callable[[], int],
    tls: TlsConfig | None = None,
    channel: ChannelUse | None = None,
    gates: MemberGates | None = None,
) -> tuple[SegmentWriter, PartitionLead]:
    """A writer of ``segment`` with a lead of its own, adopted on it (a caller without a node: tests). Writers that
    stand for one node share its ``gates``."""
    s = segment
    opened = SegmentInfo(s.segment_id, LocalOffset(s.base_offset), s.ensemble, s.epoch, ack_quorum=s.ack_quorum)
    info = PartitionInfo(s.key[0], s.key[1], me, s.epoch, (opened,))
    lead = PartitionLead(me, s.key, s.epoch, LeadConfig(len(s.ensemble), s.ack_quorum, 500, 0), None)
    writer: SegmentWriter | None = None

    def feed(event: LeadEvent) -> None:
        assert writer is not None
        for effect in event(lead, LeadContext(clock_ms(), info, list)):
            writer.perform(effect)

    lead.start(LeadContext(clock_ms(), info, list))
    writer = SegmentWriter(store, segment, me, addresses, executor, clock_ms, feed, tls, channel, gates)
    return writer, lead
