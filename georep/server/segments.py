"""grpc.aio handlers for the ``georep.v1.Segments`` service: a node as a member of segment ensembles. Shell.

Inside a multi-node site the partition leader writes each open segment to
every member of its ensemble (``cluster/quorum.py``); this is the member's
end of that, over the node's :class:`~georep.storage.replica_store.ReplicaStore`.
Whether a call is allowed (leader epochs, sealed segments, contiguity) is the
store's :class:`~cluster.quorum.ReplicaGuard`'s decision; these handlers parse,
run the store's calls off the event loop, and answer.

``AppendSegment`` is a bidirectional stream per segment and member. The first
request opens the segment and is answered at once with the member's ends, so
the leader knows where to send from (a member that restarted, or missed part
of a stream, holds less than the leader sent). Each later request is appended
and fsynced, then answered with the ends: the leader counts the fsynced end
towards the LAC. A member takes one stream's requests in order, one fsync
each; the leader keeps few requests in flight and puts everything appended
meanwhile into the next one, so a burst costs an fsync per request, not per
batch (``georep/server/ensemble.py``).

Repair (``georep/server/site_repair.py``) adds three calls, all made by the
Raft leader's controller: ``ListSegments`` (which copies this node holds,
how far fsynced, how big), ``CopySegment`` (this node copies a sealed
segment from a member that holds it whole, checks every batch's CRC, fsyncs,
and answers only then: ``site_repair.copy_in``), and ``RollSegment`` (this
node, if it leads the partition, rolls the open segment).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

import grpc
from google.protobuf.message import Message

from georep.broker.errors import InvalidRequest
from georep.proto import georep_pb2 as pb
from georep.proto.convert import vector_from_proto
from georep.security.tls import TlsConfig
from georep.server.rpc import Context, parse, service, stream_stream, unary, unary_stream
from georep.server.site_repair import SealedRange, copy_in, copy_timeout_s
from georep.storage.replica_store import PartitionKey, ReplicaStore
from offsets.coordinates import LocalOffset
from offsets.vector import InvalidVectorOffset
from topology.ids import LeaderEpoch, SegmentId

if TYPE_CHECKING:
    from georep.server.cluster_member import ClusterMember
    from georep.server.digest_calls import DigestCalls

SERVICE = "georep.v1.Segments"
READ_MAX_BYTES_DEFAULT = 1 << 20
READ_MAX_BYTES_CAP = 16 << 20
T = TypeVar("T")


def _segment(ref: pb.SegmentRef) -> tuple[PartitionKey, SegmentId]:
    if not ref.topic or ref.partition < 0 or ref.segment_id < 0:
        raise InvalidRequest(
            f"malformed segment reference {ref.topic!r}/{ref.partition}/{ref.segment_id}: name "
            "the topic, a partition >= 0 and a segment id >= 0"
        )
    return (ref.topic, ref.partition), SegmentId(ref.segment_id)


def _epoch(value: int) -> LeaderEpoch:
    if value < 1:
        raise InvalidRequest(f"leader epoch {value} is not positive: every leader has an epoch of 1 or more")
    return LeaderEpoch(value)


class SegmentService:
    """The member side of segment replication; every call runs the store in ``executor``."""

    def __init__(
        self,
        store: ReplicaStore,
        executor: ThreadPoolExecutor,
        clock_ms: Callable[[], int],
        member: ClusterMember | None = None,
        tls: TlsConfig | None = None,
    ) -> None:
        self.store = store
        self.executor = executor
        self.clock_ms = clock_ms
        self.member = member  # the node's cluster member, which rolls the segments it leads
        self.tls = tls
        self.digests: DigestCalls | None = None  # the node's digest scans (ScanSegmentDigests), once wired

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def _ack(self, key: PartitionKey, segment_id: SegmentId, flushed: int) -> pb.SegmentAck:
        return pb.SegmentAck(end_offset=self.store.end_offset(key, segment_id), flushed_offset=flushed)

    async def append_segment(self, requests: AsyncIterator[bytes], context: Context) -> AsyncIterator[Message]:
        first = await anext(aiter(requests), None)
        if first is None:
            return
        req = parse(pb.SegmentAppendRequest, first)
        if not req.HasField("open"):
            raise InvalidRequest("the first SegmentAppendRequest of a stream must open the segment (set 'open')")
        key, segment_id = _segment(req.open.segment)
        epoch = _epoch(req.open.leader_epoch)
        await self._run(self.store.check_incarnation, key, req.open.segment.incarnation)
        try:
            start_vector = vector_from_proto(req.open.start_vector).to_dict()
        except InvalidVectorOffset as exc:
            raise InvalidRequest(f"malformed start vector: {exc}") from None
        if req.open.base_offset < 0:
            raise InvalidRequest(f"base offset {req.open.base_offset} is negative")
        store = self.store
        await self._run(store.open_segment, key, epoch, segment_id, req.open.base_offset, start_vector, self.clock_ms())
        flushed = await self._run(store.flush, key, segment_id)
        yield self._ack(key, segment_id, flushed)
        async for data in requests:
            req = parse(pb.SegmentAppendRequest, data)
            if req.HasField("open"):
                raise InvalidRequest("'open' is set on a request after the first: open one segment per stream")
            if req.batches:
                await self._run(store.append, key, epoch, segment_id, req.batches)
                flushed = await self._run(store.flush, key, segment_id)
            else:  # a LAC alone: nothing to fsync
                flushed = await self._run(store.flushed_offset, key, segment_id)
            # Not from a leader fenced since (a deleted incarnation's, whose copies a later one replaced here).
            if req.lac and store.guard_state(key).fenced_epoch <= epoch:
                store.lacs.announce(key, segment_id, req.lac)
            yield self._ack(key, segment_id, flushed)

    async def fence_segments(self, data: bytes, context: Context) -> pb.FenceSegmentsResponse:
        req = parse(pb.FenceSegmentsRequest, data)
        if not req.topic or req.partition < 0:
            raise InvalidRequest("name the topic and a partition >= 0 to fence")
        await self._run(self.store.check_incarnation, (req.topic, req.partition), req.incarnation)
        ends = await self._run(self.store.fence, (req.topic, req.partition), _epoch(req.leader_epoch))
        return pb.FenceSegmentsResponse(ends=[pb.SegmentEnd(segment_id=s, end_offset=e) for s, e in ends.items()])

    async def seal_segment(self, data: bytes, context: Context) -> pb.SealSegmentResponse:
        req = parse(pb.SealSegmentRequest, data)
        key, segment_id = _segment(req.segment)
        await self._run(self.store.check_incarnation, key, req.segment.incarnation)
        end = await self._run(
            self.store.seal, key, _epoch(req.leader_epoch), segment_id, req.end_offset, self.clock_ms()
        )
        return pb.SealSegmentResponse(end_offset=end)

    async def read_segment(self, data: bytes, context: Context) -> AsyncIterator[Message]:
        req = parse(pb.ReadSegmentRequest, data)
        key, segment_id = _segment(req.segment)
        await self._run(self.store.check_incarnation, key, req.segment.incarnation)
        max_bytes = min(req.max_bytes or READ_MAX_BYTES_DEFAULT, READ_MAX_BYTES_CAP)
        store = self.store
        end = req.end_offset or store.end_offset(key, segment_id)
        offset = LocalOffset(req.offset)
        while offset < end:
            result = await self._run(store.read, key, segment_id, offset, max_bytes, end)
            if not result.data:
                return
            yield pb.ReadSegmentResponse(batches=result.data)
            offset = result.next_offset

    # -- repair ----------------------------------------------------------------------------------------------

    async def list_segments(self, data: bytes, context: Context) -> pb.ListSegmentsResponse:
        parse(pb.ListSegmentsRequest, data)
        held = await self._run(self.store.held)
        return pb.ListSegmentsResponse(
            segments=[
                pb.HeldSegment(
                    segment=pb.SegmentRef(topic=h.key[0], partition=h.key[1], segment_id=h.segment_id),
                    end_offset=h.end_offset,
                    flushed_offset=h.flushed_offset,
                    size_bytes=h.size_bytes,
                )
                for h in held
            ]
        )

    async def copy_segment(self, data: bytes, context: Context) -> pb.CopySegmentResponse:
        req = parse(pb.CopySegmentRequest, data)
        key, segment_id = _segment(req.segment)
        await self._run(self.store.check_incarnation, key, req.segment.incarnation)
        if req.base_offset < 0 or req.end_offset < req.base_offset:
            raise InvalidRequest(
                f"segment {segment_id} of {key[0]}-{key[1]}: base offset {req.base_offset} and "
                f"sealed end {req.end_offset} do not make a range"
            )
        if not req.source_address:
            raise InvalidRequest("name the member to copy from (source_address: HOST:PORT)")
        try:
            start_vector = vector_from_proto(req.start_vector).to_dict()
        except InvalidVectorOffset as exc:
            raise InvalidRequest(f"malformed start vector: {exc}") from None
        segment = SealedRange(key, segment_id, req.base_offset, start_vector, req.end_offset)
        remaining = context.time_remaining()
        timeout = remaining if remaining is not None else copy_timeout_s(0)
        flushed, copied = await copy_in(
            self.store, segment, req.source_address, self.executor, self.clock_ms(), self.tls, timeout
        )
        return pb.CopySegmentResponse(flushed_offset=flushed, copied_bytes=copied)

    async def roll_segment(self, data: bytes, context: Context) -> pb.RollSegmentResponse:
        req = parse(pb.RollSegmentRequest, data)
        key, segment_id = _segment(req.segment)
        if self.member is None:
            return pb.RollSegmentResponse(rolling=False, reason="this node runs no cluster member: it leads nothing")
        reason = self.member.roll(key, segment_id)
        return pb.RollSegmentResponse(rolling=reason is None, reason=reason or "")

    async def scan_segment_digests(self, data: bytes, context: Context) -> AsyncIterator[Message]:
        """This node's copy of one segment, digested here (``georep/server/digest_calls.py``)."""
        if self.digests is None or self.digests.site_cluster is None:
            raise InvalidRequest("this node serves no digests of segment copies: it is not a member of a site cluster")
        async for response in self.digests.scan_segment_digests(data, context, self.executor):
            yield response

    def handler(self) -> grpc.GenericRpcHandler:
        return service(
            SERVICE,
            {
                "AppendSegment": stream_stream(self.append_segment),
                "FenceSegments": unary(self.fence_segments),
                "SealSegment": unary(self.seal_segment),
                "ReadSegment": unary_stream(self.read_segment),
                "ListSegments": unary(self.list_segments),
                "CopySegment": unary(self.copy_segment),
                "RollSegment": unary(self.roll_segment),
                "ScanSegmentDigests": unary_stream(self.scan_segment_digests),
            },
        )
