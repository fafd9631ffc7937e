"""``ScanDigests`` and ``ScanSegmentDigests``: the live audit's read path on a node (docs/audit.md). Shell.

One digest per stored batch of a partition in ``[from_offset, to_offset)``: its coordinates, CRC, length and
status, none of its records (:mod:`georep.storage.digests`). ``to_offset`` unset is the end readable when the
scan starts (a one-node site's fsynced end; a multi-node site's LAC, or what this node can tell of it), and a
range past that end is refused, never read.

* **A one-node site** digests its partition log.
* **A multi-node site**: any member answers, from the partition's chain in its view of the metadata. Each
  segment's digests come from this node's copy when it holds the range whole, else from a member that does
  (``ScanSegmentDigests`` on that member, which digests its copy where it lives: only digests cross the
  network). With ``all_replicas``, every member of each segment's ensemble digests its own copy, ``node``
  naming it, so the audit compares replicas; a member that cannot answer fails the scan (UNAVAILABLE) rather
  than leave its copy out unseen.

Every scan on a node takes its digests from the node's :class:`~georep.server.digest_pacing.DigestPacer`, after
they are read and before they are sent; a member's digests are paced by the member that read them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING

import grpc

from georep.broker.errors import InvalidRequest, SegmentUnreadable, UnknownPartition
from georep.metadata.store import UnknownTopic
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.server.digest_pacing import DigestPacer
from georep.server.rpc import Context, parse
from georep.server.segment_refs import segment_ref
from georep.storage.api import OffsetOutOfRange, StorageError
from georep.storage.chain_log import ChainLog, ChainSegment, FollowerLog
from georep.storage.digests import DigestCursor, Found
from georep.storage.segment_log import LogClosed, SegmentLog
from topology.ids import NodeId, SegmentId

if TYPE_CHECKING:
    from cluster.site_state import SegmentInfo
    from georep.server.broker import Broker
    from georep.server.site_cluster import SiteCluster

log = logging.getLogger(__name__)

MAX_DIGESTS_DEFAULT = 1_000
MAX_DIGESTS_CAP = 10_000  # ~100 bytes each: a message stays far below gRPC's 4 MiB
STEP_DIGESTS = 256  # batches read per step in a thread, and at most STEP_BYTES of them (as a scrub step)
STEP_BYTES = 4 << 20
LEADER_ASK_TIMEOUT_S = 5.0
REMOTE_TIMEOUT_S = 3600.0  # a member's digests of one segment, paced: the stream's whole life
LIST_TOPICS_HINT = "list the topics with 'georep topic list' and their partitions with 'georep topic describe NAME'"


class AuditTopicUnknown(UnknownTopic):
    """``ScanDigests`` of a topic this site does not hold."""

    def __init__(self, name: str) -> None:
        Exception.__init__(self, f"topic {name!r} does not exist at this site: {LIST_TOPICS_HINT}")


class ScanOutOfRange(OffsetOutOfRange):
    """A digest range past what the node can read now (OUT_OF_RANGE)."""

    def __init__(self, message: str, offset: int, log_start: int, log_end: int) -> None:
        StorageError.__init__(self, message)
        self.offset, self.log_start, self.log_end = offset, log_start, log_end


def max_digests_of(value: int) -> int:
    if value < 0:
        raise InvalidRequest(f"max_digests {value} is negative: ask for 1..{MAX_DIGESTS_CAP} (0: the default)")
    return min(value or MAX_DIGESTS_DEFAULT, MAX_DIGESTS_CAP)


def check_range(topic: str, partition: int, from_offset: int, to_offset: int | None) -> None:
    if from_offset < 0:
        raise InvalidRequest(f"from_offset {from_offset} is negative: ask from 0 (or the partition's log start)")
    if to_offset is not None and to_offset < from_offset:
        raise InvalidRequest(
            f"to_offset {to_offset} is below from_offset {from_offset} for {topic}-{partition}: ask for "
            "from_offset <= to_offset, or leave to_offset unset for the partition's end"
        )


def scan_end(topic: str, partition: int, req: pb.ScanDigestsRequest, start: int, readable: int, where: str) -> int:
    """The exclusive end of the scan: ``to_offset``, or ``readable`` when unset; OUT_OF_RANGE past ``readable``."""
    to = req.to_offset if req.HasField("to_offset") else readable
    for name, value in (("from_offset", req.from_offset), ("to_offset", to)):
        if value > readable:
            raise ScanOutOfRange(
                f"{name} {value} of {topic}-{partition} is past its end {readable} ({where}): ask for offsets "
                f"in [{start}, {readable}], or leave to_offset unset to read to the end",
                value,
                start,
                readable,
            )
    return to


def digest_pb(found: Found, node: str, segment: int | None, log_start: int) -> pb.BatchDigest:
    """``found`` as the file audit's batch row (``spark_jobs/scan.py``'s BATCH_SCHEMA, without ``file``)."""
    s = found.scanned
    d = pb.BatchDigest(
        node=node,
        segment=found.segment_base if segment is None else segment,
        position=s.position,
        status=s.status,
        error=s.error or "",
        log_start_offset=log_start,
        base_offset=s.base_offset,
        size_bytes=s.size_bytes,
    )
    h = s.header
    if h is not None:
        d.origin_site, d.origin_epoch, d.append_time_ms = h.origin_site, h.origin_epoch, h.append_time_ms
        d.base_seq, d.last_seq, d.records, d.crc = h.base_origin_seq, h.last_origin_seq, h.records_count, h.crc
        d.first_timestamp_ms, d.max_timestamp_ms = h.first_timestamp, h.max_timestamp
    return d


async def digests_of(
    cursor: DigestCursor,
    executor: Executor | None,
    pacer: DigestPacer,
    max_digests: int,
    to_pb: Callable[[Found], pb.BatchDigest],
) -> AsyncIterator[list[pb.BatchDigest]]:
    """The cursor's digests in lists of ``max_digests`` (the last one shorter), read in a thread a step at a time,
    each step paced before it is passed on. Closes the cursor."""
    loop = asyncio.get_running_loop()
    pending: list[pb.BatchDigest] = []
    try:
        while not cursor.done:
            try:
                step = await loop.run_in_executor(executor, cursor.take, min(STEP_DIGESTS, max_digests), STEP_BYTES)
            except LogClosed:
                raise SegmentUnreadable(
                    f"{cursor.log.directory} was closed during the scan (its topic deleted, or the copy replaced at "
                    "a seal): retry the scan from the last digest received"
                ) from None
            await pacer.take(len(step))
            pending += (to_pb(f) for f in step)
            while len(pending) >= max_digests:
                yield pending[:max_digests]
                pending = pending[max_digests:]
        if pending:
            yield pending
    finally:
        await loop.run_in_executor(executor, cursor.close)


class DigestCalls:
    """The node's digest scans: ``ScanDigests`` (Node service) and ``ScanSegmentDigests`` (Segments service)."""

    def __init__(self, broker: Broker, pacer: DigestPacer, site_cluster: SiteCluster | None = None) -> None:
        self.broker = broker
        self.pacer = pacer
        self.site_cluster = site_cluster

    def _check_partition(self, req: pb.ScanDigestsRequest) -> None:
        try:
            spec = self.broker.topic(req.topic)
        except UnknownTopic:
            raise AuditTopicUnknown(req.topic) from None
        if not 0 <= req.partition < spec.partitions:
            raise UnknownPartition(req.topic, req.partition, spec.partitions)

    async def scan_digests(self, data: bytes, context: Context) -> AsyncIterator[pb.ScanDigestsResponse]:
        req = parse(pb.ScanDigestsRequest, data)
        max_digests = max_digests_of(req.max_digests)
        check_range(req.topic, req.partition, req.from_offset, req.to_offset if req.HasField("to_offset") else None)
        self._check_partition(req)
        if self.site_cluster is not None:
            async for response in ClusterScan(self, req, max_digests).responses():
                yield response
            return
        plog = self.broker.partition(req.topic, req.partition).log
        assert isinstance(plog, SegmentLog)
        start = int(plog.log_start_offset)
        end = scan_end(req.topic, req.partition, req, start, int(plog.flushed_offset), "its fsynced end")
        cursor = DigestCursor(plog, req.from_offset, end)
        sent = False
        async for digests in digests_of(
            cursor, self.broker.executor, self.pacer, max_digests, lambda f: digest_pb(f, "", None, start)
        ):
            sent = True
            yield pb.ScanDigestsResponse(digests=digests, end_offset=end)
        if not sent:
            yield pb.ScanDigestsResponse(end_offset=end)

    async def scan_segment_digests(
        self, data: bytes, context: Context, executor: Executor
    ) -> AsyncIterator[pb.ScanDigestsResponse]:
        """A member's digests of its own copy of one segment (the Segments service's ``ScanSegmentDigests``)."""
        assert self.site_cluster is not None
        req = parse(pb.ScanSegmentDigestsRequest, data)
        ref = req.segment
        if not ref.topic or ref.partition < 0 or ref.segment_id < 0:
            raise InvalidRequest("name the segment: a topic, a partition >= 0 and a segment id >= 0")
        if req.from_offset < 0 or req.to_offset < req.from_offset:
            raise InvalidRequest(f"[{req.from_offset}, {req.to_offset}) is not a range of offsets >= 0")
        store = self.site_cluster.store
        key = (ref.topic, ref.partition)
        await asyncio.get_running_loop().run_in_executor(executor, store.check_incarnation, key, ref.incarnation)
        copy = store.copy(key, SegmentId(ref.segment_id))
        to = req.to_offset
        if req.short_copy_ok:
            to = req.from_offset if copy is None else max(req.from_offset, min(to, int(copy.log_end_offset)))
        elif copy is None or copy.log_end_offset < to:
            held = "none" if copy is None else f"one that ends at {copy.log_end_offset}"
            raise SegmentUnreadable(
                f"node {self.site_cluster.member.me} holds {held} of segment {ref.segment_id} of "
                f"{ref.topic}-{ref.partition}, not [{req.from_offset}, {to}): ask another member"
            )
        me, sid, start = str(self.site_cluster.member.me), ref.segment_id, req.log_start_offset
        if copy is None or to <= req.from_offset:
            yield pb.ScanDigestsResponse(end_offset=to)
            return
        cursor = DigestCursor(copy, req.from_offset, to)
        async for digests in digests_of(
            cursor, executor, self.pacer, max_digests_of(req.max_digests), lambda f: digest_pb(f, me, sid, start)
        ):
            yield pb.ScanDigestsResponse(digests=digests, end_offset=to)


class ClusterScan:
    """One ``ScanDigests`` at a node of a multi-node site, over the partition's chain in its view (module doc)."""

    def __init__(self, calls: DigestCalls, req: pb.ScanDigestsRequest, max_digests: int) -> None:
        assert calls.site_cluster is not None
        self.calls = calls
        self.cluster = calls.site_cluster
        self.req = req
        self.key = (req.topic, req.partition)
        self.max_digests = max_digests

    async def _chain(self) -> tuple[tuple[SegmentInfo, ...], int]:
        """The partition's chain in this node's view, and the end readable now (none yet: empty): the LAC at its
        leader; at another node, what it can serve itself (``FollowerLog``) or, further, the LAC its leader names."""
        info = self.cluster.metadata.state().partition(*self.key)
        if info is None or not info.segments:
            return (), 0
        led = self.cluster.broker.partitions.get(self.key)
        if led is not None and isinstance(led.log, ChainLog):
            return info.segments, int(led.log.flushed_offset)
        chain = [
            ChainSegment(s.segment_id, s.base_offset, s.end_offset, s.end_vector, s.ensemble) for s in info.segments
        ]
        view = FollowerLog(self.key, self.cluster.store, chain, self.cluster.member.me, info.start_vector)
        return info.segments, max(int(view.flushed_offset), await self._leader_end())

    async def _leader_end(self) -> int:
        """The partition's high watermark (its LAC) at its leader; 0 when no leader answers (this node's own bound
        then stands)."""
        address = self.cluster.leader_address(*self.key)
        if not address:
            return 0
        request = pb.ListOffsetsRequest(topic=self.key[0], partition=self.key[1], position=pb.START_LATEST)
        try:
            async with self.cluster.channel(address) as channel:
                answer = await pbg.NodeStub(channel).ListOffsets(request, timeout=LEADER_ASK_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.info("ScanDigests of %s-%d: its leader at %s did not answer (%s)", *self.key, address, exc.code().name)
            return 0
        return max((o.offset for o in answer.offsets), default=0)

    async def responses(self) -> AsyncIterator[pb.ScanDigestsResponse]:
        req = self.req
        segments, readable = await self._chain()
        start = int(segments[0].base_offset) if segments else 0
        where = "the partition's last add confirmed"
        end = scan_end(req.topic, req.partition, req, start, readable, where)
        first = max(req.from_offset, start)
        sent = False
        for segment in segments:
            lo = max(first, int(segment.base_offset))
            hi = min(end, int(segment.end_offset) if segment.end_offset is not None else end)
            if lo >= hi:
                continue
            async for digests in self._segment(segment, lo, hi, start):
                sent = True
                yield pb.ScanDigestsResponse(digests=digests, end_offset=end)
        if not sent:
            yield pb.ScanDigestsResponse(end_offset=end)

    def _holds(self, segment: SegmentInfo, hi: int) -> SegmentLog | None:
        copy = self.cluster.store.copy(self.key, segment.segment_id)
        return copy if copy is not None and copy.log_end_offset >= hi else None

    async def _segment(self, segment: SegmentInfo, lo: int, hi: int, start: int) -> AsyncIterator[list[pb.BatchDigest]]:
        me = self.cluster.member.me
        members = sorted(segment.ensemble)
        if not self.req.all_replicas:
            mine = self._holds(segment, hi)
            members = [me] if mine is not None else [n for n in members if n != me]
        failures: list[str] = []
        for node in members:
            yielded = False
            try:
                async for digests in self._copy(node, segment, lo, hi, start):
                    yielded = True
                    yield digests
            except (grpc.aio.AioRpcError, SegmentUnreadable) as exc:
                why = f"{exc.code().name} {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                failures.append(f"node {node}: {why}")
                if self.req.all_replicas or yielded:
                    break  # another copy now would send some of this one's digests twice
                continue
            if not self.req.all_replicas:
                return
        if failures or not members:
            raise SegmentUnreadable(
                f"segment {segment.segment_id} of {self.key[0]}-{self.key[1]} ([{lo}, {hi})) could not be digested "
                f"({'; '.join(failures) or 'no member holds it'}); retry once its members answer"
                + (", or scan without all_replicas" if self.req.all_replicas else "")
            )

    async def _copy(
        self, node: NodeId, segment: SegmentInfo, lo: int, hi: int, start: int
    ) -> AsyncIterator[list[pb.BatchDigest]]:
        """``node``'s copy's digests of ``[lo, hi)``: read here for this node, asked of the member for another."""
        sid = int(segment.segment_id)
        if node == self.cluster.member.me:
            copy = self.cluster.store.copy(self.key, segment.segment_id)
            if copy is not None and self.req.all_replicas:
                hi = max(lo, min(hi, int(copy.log_end_offset)))  # a member may lag the LAC (see ScanSegmentDigests)
            elif copy is None or copy.log_end_offset < hi:
                raise SegmentUnreadable(f"this node's copy of segment {sid} does not reach offset {hi}")
            if copy is None:
                return
            me = str(node)
            async for digests in digests_of(
                DigestCursor(copy, lo, hi),
                self.cluster.executor,
                self.calls.pacer,
                self.max_digests,
                lambda f: digest_pb(f, me, sid, start),
            ):
                yield digests
            return
        address = self.cluster.node_address(node)
        if not address:
            raise SegmentUnreadable(f"no address is known for node {node}")
        request = pb.ScanSegmentDigestsRequest(
            segment=segment_ref(self.cluster.store, self.key, sid),
            from_offset=lo,
            to_offset=hi,
            max_digests=self.max_digests,
            log_start_offset=start,
            short_copy_ok=self.req.all_replicas,
        )
        async with self.cluster.channel(address) as channel:
            async for response in pbg.SegmentsStub(channel).ScanSegmentDigests(request, timeout=REMOTE_TIMEOUT_S):
                yield list(response.digests)
