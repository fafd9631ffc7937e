"""grpc.aio handlers for the ``georep.v1.Node`` service (the parsing and error mapping: ``georep/server/rpc.py``)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING

import grpc

from georep import __version__
from georep.auth.acl_replication import ClaimRefused, HeldClaimCheck
from georep.broker.errors import (
    CatalogNotSynced,
    DamagedData,
    InvalidRequest,
    NoSuchLink,
    NotLeader,
    NoTopology,
    SingleNodeSite,
)
from georep.broker.fetch import (
    AtOffset,
    Earliest,
    FetchCursor,
    FetchStart,
    FromVector,
    Latest,
    batch_by_coordinate,
    listed_offset,
)
from georep.metadata.catalog import TopicCatalog
from georep.metadata.store import UnknownTopic
from georep.metadata.topic_entry_codec import spec_of
from georep.metadata.topics import TopicSpec
from georep.proto import georep_pb2 as pb
from georep.proto.convert import acks_from_proto, damaged_to_proto, vector_from_proto, vector_to_proto
from georep.proto.topic_entry import entry_to_pb
from georep.replication import wire
from georep.replication.pacing import Pacer, share
from georep.replication.source import Chunk, ReplicaSource, Serve
from georep.server import site_status
from georep.server.acl_calls import AclCalls
from georep.server.admin_gate import AdminGate
from georep.server.auto_create import AutoCreate
from georep.server.broker import Broker, Partition
from georep.server.digest_calls import DigestCalls
from georep.server.digest_pacing import AUDIT_DIGEST_RATE_DEFAULT, DigestPacer
from georep.server.group_calls import GroupCalls
from georep.server.groups import GroupService
from georep.server.incarnation_guard import servable_wants
from georep.server.interest_report import interest_entries
from georep.server.metrics import NodeMetrics
from georep.server.produce_stream import REQUEST_BATCHES_MAX, REQUEST_BYTES_MAX, ProduceStreamCall
from georep.server.produce_stream import answer as produce_answer
from georep.server.rpc import Context, merge_streams, parse, service, status, stream_stream, unary, unary_stream
from georep.server.status import DOMAIN_ERRORS, reason_of
from georep.server.topic_calls import TopicCalls
from georep.server.topic_changes import TopicChanges
from georep.server.topic_creation import TopicRequest, create_topics
from georep.storage.api import BatchDamaged, PartitionLog
from georep.storage.chain_log import ChainLog, ChainSegment, FollowerLog, SegmentElsewhere
from offsets.coordinates import InvalidOrigin, Origin
from offsets.held import HeldEntry, ServedGate
from offsets.log_prefix import vector_below
from offsets.vector import InvalidVectorOffset, VectorOffset
from topology.filters import InvalidTopicFilter, TopicFilter
from topology.ids import InvalidNodeId, InvalidSiteId, SiteId, node_id, site_id
from topology.model import UnknownLink, UnknownSite

if TYPE_CHECKING:
    from georep.server.replicator import Replicator
    from georep.server.site_cluster import SiteCluster

log = logging.getLogger(__name__)

SERVICE = "georep.v1.Node"
FETCH_MAX_BYTES_CAP = 16 << 20
SCRUB_STEP_BYTES = 4 << 20
SCRUB_PROGRESS_S = 0.5
FETCH_MAX_WAIT_MS_CAP = 30_000
# A fetch stream with nothing new answers (empty) after max_wait_ms, as Kafka's fetch does, then twice as late each
# time it is still idle, up to this: an idle stream wakes the node a few times a minute, not twice a second, so a
# consumer of 10,000 quiet partitions (a wildcard subscription) costs the node next to nothing (issue 25's bench:
# 538 records/s over 10,000 topics, every stream answering empty twice a second).
FETCH_IDLE_ANSWER_MAX_S = 16.0
REPLICATE_MAX_BYTES_DEFAULT = 1 << 20
REPLICATE_MAX_WAIT_MS_DEFAULT = 500
FOLLOWER_POLL_S = 0.1  # a follower's fetch looks at the metadata's chain (rolls, seals) this often while it waits
REFUSALS_LOGGED_EVERY_S = 60.0
REFUSALS_LOGGED_MAX = 1024
# ListTopics' largest page: a full description carries every partition's vector, a definition a few fields.
LIST_PAGE_MAX_FULL = 1_000
LIST_PAGE_MAX = 10_000


def _error(exc: Exception) -> pb.Error:
    hint = exc.leader_hint if isinstance(exc, NotLeader) else ""
    return pb.Error(code=status(exc).value[0], message=str(exc), leader_hint=hint, reason=reason_of(exc))


def _vector_from_pb(msg: pb.VectorOffset) -> VectorOffset:
    try:
        return vector_from_proto(msg)
    except InvalidVectorOffset as exc:
        raise InvalidRequest(f"malformed vector offset: {exc}") from None


def _topic_exists(broker: Broker, name: str) -> bool:
    try:
        broker.topic(name)
    except UnknownTopic:
        return False
    return True


def read_topics(service: NodeService) -> set[str]:
    """The topics read at a node now: its consumer groups' subscriptions (georep's and the Kafka listener's) and
    its open fetches; what its site asks its interest links for (``interest_links.py``)."""
    groups = service.groups.coordinator.groups.values()
    members = {t for g in groups for m in g.members.values() for t in m.topics}
    return members | set(service.fetching) | service.kafka_read_topics()


def reads_moved(service: NodeService) -> tuple[int, int]:
    """Moves whenever a group member joins or names other topics, or a topic gets its first open fetch: the
    interest links then take :func:`read_topics` at their next tick, not up to ``LOCAL_S`` later."""
    return service.groups.subscriptions_changed, service.fetching_changed


def _pattern_of(req: pb.ListTopicsRequest) -> TopicFilter | None:
    """``ListTopics``' ``pattern``, checked (None: every topic)."""
    if not req.pattern:
        return None
    try:
        return TopicFilter(req.pattern)
    except InvalidTopicFilter as exc:
        raise InvalidRequest(f"ListTopics pattern: {exc}") from None


def _vector_to_pb(vector: Mapping[Origin, int]) -> pb.VectorOffset:
    return vector_to_proto(VectorOffset(vector))


class NodeService:
    def __init__(
        self,
        broker: Broker,
        metrics: NodeMetrics,
        replicator: Replicator | None = None,
        admin_token: str | None = None,
        site_cluster: SiteCluster | None = None,
        authorizes: bool = False,
        audit_digest_rate: int = AUDIT_DIGEST_RATE_DEFAULT,
    ) -> None:
        """``audit_digest_rate``: the batches per second all of this node's digest scans share (0: unbounded)."""
        self.broker = broker
        self.site_cluster = site_cluster
        self.metrics = metrics
        self.replicator = replicator
        self.groups = GroupService(broker, site_cluster=site_cluster)
        if replicator is not None:
            self.groups.upstream_vectors = replicator.upstream_vectors
        self.admin = AdminGate(admin_token, authorizes)
        self.acls = AclCalls(broker, self.admin)
        changes = replicator.topic_changes if replicator is not None else TopicChanges(broker)
        self.topic_calls = TopicCalls(changes, self._describe)
        if replicator is not None:
            self.topic_calls.before_create = replicator.first_syncs.wait
        self.group_calls = GroupCalls(self.groups)
        # Topics created on first use: the site's auto_create patterns (set from the topology by the node), and
        # whether a call's principal may create a topic (set from the ACLs on a TLS node; a plaintext one may)
        self.auto_create = AutoCreate((), functools.partial(_topic_exists, broker), self._create_topics)
        self.create_refusal: Callable[[Context, str], str | None] = lambda _context, _name: None
        self.digests = DigestCalls(broker, DigestPacer(audit_digest_rate), site_cluster)
        self.digests.pacer.on_step = metrics.digested
        self.started = time.monotonic()
        # What one multi-batch produce request may carry; announced to producers in the stream's initial metadata
        self.produce_batches_max = REQUEST_BATCHES_MAX
        self.produce_bytes_max = REQUEST_BYTES_MAX
        self._stopping: asyncio.Future[None] | None = None
        # ReportHeld's claims: which the topology allows (acl_replication.held_claim_refusal), and how far what they
        # say of this site's own records counts (offsets.held.ServedGate: up to what has left this node).
        self.claims = HeldClaimCheck(replicator.topology if replicator is not None else None, broker.identity.site)
        self.served = ServedGate(broker.origin)
        self._refusals_logged: dict[str, tuple[str, float]] = {}
        # The node's Kafka gateway, for a group coordinator on another node of the site (ListOffsets ``kafka``)
        self.kafka_offsets: Callable[[str, int, pb.KafkaOffsetAsk], pb.PartitionOffset] | None = None
        # ListTopics' view of the topic table; its own id, so a token of another node or process is not taken
        self.catalog = TopicCatalog(secrets.token_hex(8))
        self._catalog_saw: int | None = None  # the metadata's topics_version the catalog last took
        self.fetching: collections.Counter[str] = collections.Counter()  # open Fetch calls per topic
        self.fetching_changed = 0  # one more whenever a topic gets its first open Fetch
        self.kafka_read_topics: Callable[[], set[str]] = set  # the Kafka listener's groups' topics (serve.py)
        if replicator is not None:
            replicator.interest_links.local = functools.partial(read_topics, self)
            replicator.interest_links.local_moved = functools.partial(reads_moved, self)
        broker.on_open = self._partition_opened
        for p in list(broker.partitions.values()):
            self._partition_opened(p)

    def _stopping_future(self) -> asyncio.Future[None]:
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_future()
        return self._stopping

    def stop_streams(self) -> None:
        """End the long-lived ``Replicate`` streams, so a clean shutdown does not wait out its grace period."""
        stopping = self._stopping_future()
        if not stopping.done():
            stopping.set_result(None)

    # -- admin ----------------------------------------------------------------

    def _describe(self, name: str) -> pb.TopicDescription:
        spec = self.broker.topic(name)
        out = self._definition(spec)
        for i in range(spec.partitions):
            p = self.broker.partitions.get((name, i))
            if p is None:
                continue  # a partition another node of a multi-node site leads
            plog = p.log
            out.partition_states.append(
                pb.PartitionState(
                    partition=i,
                    log_start_offset=plog.log_start_offset,
                    log_end_offset=plog.log_end_offset,
                    size_bytes=plog.size_bytes,
                    segments=plog.segment_count,
                    vector=_vector_to_pb(plog.vector()),
                    damaged=damaged_to_proto(plog.damaged_batches()),
                )
            )
        if self.site_cluster is not None:
            out.leaders.extend(self.site_cluster.leaders(name, spec.partitions))
        return out

    def _definition(self, spec: TopicSpec) -> pb.TopicDescription:
        config = {k: str(v) for k, v in spec.effective(self.broker.defaults).items()}
        return pb.TopicDescription(name=spec.name, partitions=spec.partitions, config=config)

    def _summary(self, spec: TopicSpec) -> pb.TopicDescription:
        """The definition, and the records and bytes of the partitions served here: no vector, no state."""
        out = self._definition(spec)
        records = size_bytes = 0
        for i in range(spec.partitions):
            p = self.broker.partitions.get((spec.name, i))
            if p is not None:
                records += p.log.log_end_offset - p.log.log_start_offset
                size_bytes += p.log.size_bytes
        out.records, out.size_bytes = records, size_bytes
        return out

    def _listed(self, spec: TopicSpec, view: pb.TopicView.ValueType) -> pb.TopicDescription:
        if view == pb.TOPIC_VIEW_DEFINITION:
            return self._definition(spec)
        if view == pb.TOPIC_VIEW_SUMMARY:
            return self._summary(spec)
        return self._describe(spec.name)

    async def create_topic(self, data: bytes, context: Context) -> pb.TopicDescription:
        req = parse(pb.CreateTopicRequest, data)  # an internal topic's name is refused by Broker.create_topic
        (outcome,) = await self._create_topics([(req.name, req.partitions, dict(req.config))])
        if isinstance(outcome, Exception):
            raise outcome
        return self._describe(req.name)

    async def _create_topics(self, requests: list[TopicRequest]) -> list[TopicSpec | Exception]:
        """Each topic created or refused on its own, in order: ``CreateTopic``, and topics created on first use
        (``auto_create``)."""
        await self.topic_calls.before_create()
        executor = self.site_cluster.executor if self.site_cluster is not None else None
        return await create_topics(self.broker, requests, executor=executor)

    async def create_topics(self, data: bytes, context: Context) -> pb.CreateTopicsResponse:
        """Each topic created or refused on its own (Kafka's CreateTopics); a bug still fails the whole call."""
        req = parse(pb.CreateTopicsRequest, data)
        requests = [(t.name, t.partitions, dict(t.config)) for t in req.topics]
        try:
            outcomes = await self._create_topics(requests)
        except CatalogNotSynced as exc:  # every topic's own answer
            outcomes = [exc] * len(requests)
        out = pb.CreateTopicsResponse()
        for (name, _partitions, _config), outcome in zip(requests, outcomes, strict=True):
            if isinstance(outcome, TopicSpec):
                out.results.append(pb.CreateTopicResult(name=name, partitions=outcome.partitions))
            elif isinstance(outcome, DOMAIN_ERRORS):
                out.results.append(pb.CreateTopicResult(name=name, error=_error(outcome)))
            else:
                raise outcome
        return out

    async def list_topics(self, data: bytes, context: Context) -> pb.ListTopicsResponse:
        """By name a page at a time, or (``changed_since``, topic sync) what the catalog learnt after a token:
        nothing when nothing changed (``georep/metadata/catalog.py``)."""
        req = parse(pb.ListTopicsRequest, data)
        if req.view not in pb.TopicView.values():
            raise InvalidRequest(f"unknown topic view {req.view}: use one of {sorted(pb.TopicView.values())}")
        if req.page_size < 0:
            raise InvalidRequest(f"page_size {req.page_size} is negative: ask for 0 (every topic) or a page size")
        cap = LIST_PAGE_MAX_FULL if req.view == pb.TOPIC_VIEW_FULL else LIST_PAGE_MAX
        size = min(req.page_size, cap) if req.page_size else 0
        catalog = self.catalog
        version = self.broker.metadata.topics_version()  # before the table: a change in between shows next call
        if version != self._catalog_saw:  # an unchanged table is not copied and compared on every sync
            catalog.refresh(self.broker.metadata.entries())
            self._catalog_saw = version
        out = pb.ListTopicsResponse(total_size=len(catalog))
        pattern = _pattern_of(req)
        if req.HasField("changed_since"):
            changes = catalog.changes_since(req.changed_since, size, None if pattern is None else pattern.matches)
            out.catalog_token, out.restarted = changes.token, changes.restarted
            out.next_page_token = changes.token if changes.more else ""
            for entry in changes.topics:  # with each entry, which the syncing site merges
                listed = (
                    pb.TopicDescription(name=entry.name) if entry.deleted else self._listed(spec_of(entry), req.view)
                )
                listed.entry.CopyFrom(entry_to_pb(entry))
                out.topics.append(listed)
        else:
            entries, out.next_page_token = catalog.page_by_name(req.page_token, size, pattern.prefix if pattern else "")
            wanted = entries if pattern is None else [e for e in entries if pattern.matches(e.name)]
            out.topics.extend(self._listed(spec_of(entry), req.view) for entry in wanted)
        return out

    async def describe_topic(self, data: bytes, context: Context) -> pb.TopicDescription:
        req = parse(pb.DescribeTopicRequest, data)
        if req.allow_auto_create:  # a producer's metadata request (Kafka's allow_auto_topic_creation)
            await self.auto_create.ensure(req.name, functools.partial(self.create_refusal, context))
        return self._describe(req.name)

    async def health(self, data: bytes, context: Context) -> pb.HealthResponse:
        parse(pb.HealthRequest, data)
        return pb.HealthResponse(
            status="SERVING",
            site=self.broker.identity.site,
            epoch=self.broker.identity.epoch,
            version=__version__,
            uptime_ms=int((time.monotonic() - self.started) * 1000),
            disk_full=self.broker.disk_full,
            checks_incarnations=True,  # georep/server/incarnation_guard.py: a linked site may delete topics
        )

    async def list_offsets(self, data: bytes, context: Context) -> pb.ListOffsetsResponse:
        req = parse(pb.ListOffsetsRequest, data)
        if req.WhichOneof("spec") == "kafka":
            if self.kafka_offsets is None:
                raise InvalidRequest("this node serves no Kafka listener: a Kafka offset ask goes to one that does")
            return pb.ListOffsetsResponse(offsets=[self.kafka_offsets(req.topic, req.partition, req.kafka)])
        spec = self.broker.topic(req.topic)
        indexes = range(spec.partitions) if req.partition == -1 else [req.partition]
        out = []
        for i in indexes:
            plog = self.broker.partition(req.topic, i).log
            by_time = req.WhichOneof("spec") == "timestamp_ms"
            # the rule Kafka's ListOffsets follows too (broker/fetch.py); latest is the high watermark
            query = req.timestamp_ms if by_time else Latest() if req.position == pb.START_LATEST else Earliest()
            at = listed_offset(plog, query)
            out.append(
                pb.PartitionOffset(
                    partition=i,
                    offset=-1 if at is None else at,
                    timestamp_ms=req.timestamp_ms if by_time else -1,
                    vector=_vector_below(plog, plog.flushed_offset if at is None else at),
                )
            )
        return pb.ListOffsetsResponse(offsets=out)

    # -- produce --------------------------------------------------------------

    async def produce(self, data: bytes, context: Context) -> pb.ProduceResponse:
        req = parse(pb.ProduceRequest, data)
        if req.batches:
            raise InvalidRequest("a multi-batch produce request goes over ProduceStream; Produce takes one batch")
        try:
            await self.auto_create.ensure(req.topic, functools.partial(self.create_refusal, context))
            produced = await self.broker.produce(
                req.topic, req.partition, req.batch, acks_from_proto(req.acks, req.geo_sites), req.ack_timeout_ms
            )
        except DOMAIN_ERRORS as exc:
            self.metrics.produce_error(status(exc))
            raise
        return produce_answer(req.correlation_id, req.partition, produced)

    def _produce_error(self, exc: Exception) -> pb.Error:
        self.metrics.produce_error(status(exc))
        return _error(exc)

    def produce_stream(
        self,
        requests: AsyncIterator[bytes | pb.ProduceRequest],
        context: Context,  # parsed when screened (rpc.py)
    ) -> AsyncIterator[pb.ProduceResponse]:
        call = ProduceStreamCall(
            self.broker, self._produce_error, batches_max=self.produce_batches_max, bytes_max=self.produce_bytes_max
        )
        call.auto_create = self.auto_create
        call.create_refusal = functools.partial(self.create_refusal, context)
        return call.serve(requests, context)

    # -- fetch ----------------------------------------------------------------

    async def fetch(self, data: bytes, context: Context) -> AsyncIterator[pb.FetchResponse]:
        req = parse(pb.FetchRequest, data)
        self.fetching[req.topic] += 1  # a topic read here: an interest of this site (interest_links.py)
        self.fetching_changed += self.fetching[req.topic] == 1
        try:
            async for response in self._fetch(req):
                yield response
        finally:
            self.fetching[req.topic] -= 1
            if not self.fetching[req.topic]:
                del self.fetching[req.topic]

    async def _fetch(self, req: pb.FetchRequest) -> AsyncIterator[pb.FetchResponse]:
        max_bytes = min(req.max_bytes or (1 << 20), FETCH_MAX_BYTES_CAP)
        max_wait_s = min(req.max_wait_ms or 500, FETCH_MAX_WAIT_MS_CAP) / 1000
        try:
            p = self.broker.partition(req.topic, req.partition)
        except NotLeader as not_leader:
            if req.read_from != pb.READ_FROM_REPLICA or self.site_cluster is None:
                raise
            async for response in self._fetch_as_follower(req, not_leader, max_bytes, max_wait_s):
                yield response
            return
        cursor = FetchCursor(p.log, _fetch_start(req), self.broker.origin)
        idle_s = max_wait_s
        while True:
            if self.broker.partitions.get(p.key) is not p:
                # A multi-node site's leader rolled its segment (a new chain log), or leads no more (NotLeader).
                p = self.broker.partition(req.topic, req.partition)
                cursor.log = p.log
            if cursor.readable:
                try:
                    chunk = cursor.read(max_bytes)
                except BatchDamaged as exc:
                    raise DamagedData(req.topic, req.partition, self.broker.identity.site, exc.damaged) from None
                except SegmentElsewhere as missing:
                    assert self.site_cluster is not None and isinstance(p.log, ChainLog)
                    await self.site_cluster.read_elsewhere(p.log, missing, max_bytes)
                    continue
                if not chunk:
                    await asyncio.sleep(0)  # a long covered stretch must not starve other streams
                    continue
                self.metrics.fetched(len(chunk))
                yield self._fetch_response(p, chunk, cursor.position)
                continue
            cursor.check_in_range()
            flushed_next = p.durable()  # appends become readable when an fsync covers them
            try:
                await asyncio.wait_for(asyncio.shield(flushed_next), idle_s)
                idle_s = max_wait_s
            except TimeoutError:
                yield self._fetch_response(p, b"", cursor.position)
                idle_s = min(2 * idle_s, max(max_wait_s, FETCH_IDLE_ANSWER_MAX_S))

    def _follower_log(self, key: tuple[str, int], not_leader: NotLeader) -> FollowerLog:
        """This node's follower view of ``key`` from its metadata now; ``not_leader`` if it has no chain yet."""
        assert self.site_cluster is not None
        info = self.site_cluster.metadata.state().partition(*key)
        if info is None or not info.segments:
            raise not_leader
        chain = [
            ChainSegment(s.segment_id, s.base_offset, s.end_offset, s.end_vector, s.ensemble) for s in info.segments
        ]
        return FollowerLog(key, self.site_cluster.store, chain, self.site_cluster.member.me, info.start_vector)

    async def _fetch_as_follower(
        self, req: pb.FetchRequest, not_leader: NotLeader, max_bytes: int, max_wait_s: float
    ) -> AsyncIterator[pb.FetchResponse]:
        """A fetch of a partition this node does not lead (``READ_FROM_REPLICA``): served below
        ``cluster.follower_reads.follower_bound`` over a :class:`FollowerLog`, rebuilt whenever the metadata's
        chain changes; a reader that reaches what this node cannot serve (it is not in the open segment's
        ensemble, or asks past what this node can tell exists) gets ``NotLeader`` with the leader's address. The
        stream ends (the client reopens it, and is then served as by a leader) once this node leads the
        partition."""
        assert self.site_cluster is not None
        key = (req.topic, req.partition)
        view = self._follower_log(key, not_leader)
        cursor = FetchCursor(view, _fetch_start(req), self.broker.origin)
        store = self.site_cluster.store
        waited_s = 0.0
        while True:
            if key in self.broker.partitions:
                return  # led here now
            fresh = self._follower_log(key, not_leader)
            if fresh.chain != view.chain:
                view = cursor.log = fresh
            bound = view.bound()
            if cursor.position < bound.end:
                try:
                    chunk = cursor.read(max_bytes)
                except BatchDamaged as exc:
                    raise DamagedData(req.topic, req.partition, self.broker.identity.site, exc.damaged) from None
                except SegmentElsewhere as missing:
                    await self.site_cluster.read_elsewhere(view, missing, max_bytes)
                    continue
                if not chunk:
                    await asyncio.sleep(0)
                    continue
                waited_s = 0.0
                self.metrics.fetched(len(chunk))
                yield self._follower_response(view, chunk, cursor.position, bound.end)
                continue
            if not bound.grows or cursor.position > view.known_end():
                hint = self.broker.leader_hint(*key)
                raise NotLeader(
                    req.topic,
                    req.partition,
                    f"this node serves it only below offset {bound.end} "
                    f"({bound.why}), and the fetch is at {cursor.position}: read from the leader",
                    hint,
                )
            # Woken by the leader's next LAC announcement; a roll or a seal shows in the metadata, looked at again
            # every FOLLOWER_POLL_S.
            step_s = min(FOLLOWER_POLL_S, max(max_wait_s - waited_s, 0.0))
            changed = store.lacs.changed(key)
            try:
                await asyncio.wait_for(changed, step_s)
            except TimeoutError:
                waited_s += step_s
                if waited_s >= max_wait_s:
                    waited_s = 0.0
                    yield self._follower_response(view, b"", cursor.position, bound.end)

    @staticmethod
    def _follower_response(view: FollowerLog, chunk: bytes, position: int, bound: int) -> pb.FetchResponse:
        return pb.FetchResponse(
            batches=chunk,
            high_watermark=bound,
            log_start_offset=view.log_start_offset,
            next_offset=position,
            follower_read=True,
        )

    def _fetch_response(self, p: Partition, chunk: bytes, position: int) -> pb.FetchResponse:
        return pb.FetchResponse(
            batches=chunk,
            high_watermark=p.log.flushed_offset,
            log_start_offset=p.log.log_start_offset,
            next_offset=position,
        )

    # -- damage -------------------------------------------------------------------

    async def fetch_batch(self, data: bytes, context: Context) -> pb.FetchBatchResponse:
        req = parse(pb.FetchBatchRequest, data)
        p = self.broker.partition(req.topic, req.partition)
        try:
            origin = Origin(site_id(req.origin_site), req.origin_epoch)
        except InvalidSiteId as exc:
            raise InvalidRequest(f"malformed FetchBatchRequest: {exc}") from None
        return pb.FetchBatchResponse(batch=batch_by_coordinate(p.log, origin, req.origin_seq))

    async def scrub(self, data: bytes, context: Context) -> AsyncIterator[pb.ScrubProgress]:
        """Check every partition's stored batches now, streaming progress about every SCRUB_PROGRESS_S."""
        parse(pb.ScrubRequest, data)
        keys = sorted(self.broker.partitions)
        total = sum(self.broker.partition(*k).log.size_bytes for k in keys)
        checked = found = rebuilt = invalid = 0
        last = time.monotonic()
        for key in keys:
            plog = self.broker.partition(*key).log
            offset = int(plog.log_start_offset)
            while offset < plog.flushed_offset:
                step = await self.broker.scrub(key, offset, SCRUB_STEP_BYTES)
                offset = step.next_offset
                found += len(step.found)
                rebuilt += step.indexes_rebuilt
                invalid += len(step.invalid)
                for text in step.invalid:
                    log.error("scrub: %s/%d %s", *key, text)
                checked += step.checked_bytes
                if time.monotonic() - last >= SCRUB_PROGRESS_S:
                    last = time.monotonic()
                    yield self._scrub_progress(min(checked, total), total, found, rebuilt, invalid, False)
        yield self._scrub_progress(total, total, found, rebuilt, invalid, True)

    def _scrub_progress(
        self, checked: int, total: int, found: int, rebuilt: int, invalid: int, done: bool
    ) -> pb.ScrubProgress:
        quarantined = sum(len(b) for b in self.broker.damaged().values())
        return pb.ScrubProgress(
            checked_bytes=checked,
            total_bytes=total,
            found=found,
            quarantined=quarantined,
            done=done,
            indexes_rebuilt=rebuilt,
            invalid=invalid,
        )

    # -- replication ------------------------------------------------------------

    async def replicate(self, data: bytes, context: Context) -> AsyncIterator[pb.ReplicateResponse]:
        """Serve one inbound pull (docs/design.md, "Replication"): a heartbeat first, then
        batches the dst lacks as they become durable, and a heartbeat every ``max_wait_ms`` when idle.

        On a multi-node site, the partitions this node leads are served here and the others are pulled from their
        leaders (``forwarded``) and passed on, so a destination pulls the whole site over one stream. A partition
        whose leader moves ends the stream: the destination reopens it, and the new routes serve it."""
        req = parse(pb.ReplicateRequest, data)
        if req.dst_site:
            try:
                site_id(req.dst_site)
            except InvalidSiteId as exc:
                raise InvalidRequest(f"malformed ReplicateRequest: {exc}") from None
        wants: dict[tuple[str, int], tuple[dict[Origin, int], tuple[str, ...]]] = {}
        for want in req.wants:
            key = (want.topic, want.partition)
            if key in wants:
                raise InvalidRequest(
                    f"malformed ReplicateRequest: {want.topic}-{want.partition} is wanted twice; list it once"
                )
            try:
                have = vector_from_proto(want.have).to_dict()
            except InvalidVectorOffset as exc:
                raise InvalidRequest(f"malformed have-vector for {want.topic}-{want.partition}: {exc}") from None
            wants[key] = (dict(have), tuple(want.origin_sites))
        elsewhere: dict[str, list[pb.PullWant]] = {}
        partitions: dict[tuple[str, int], Partition] = {}
        routes: dict[tuple[str, int], str] = {}  # where each partition another node leads is pulled from
        served, incarnations = servable_wants(self.broker.metadata, req.wants, req.dst_site)
        for want in served:
            key = (want.topic, want.partition)
            try:
                partitions[key] = self.broker.partition(*key)
            except NotLeader as exc:
                if self.site_cluster is None:
                    raise
                routes[key] = exc.leader_hint
                # Forwarded here by a node whose view is ahead or behind, or leaderless for a moment: left out
                # of this stream, which the node that passed it on ends as soon as its route changes.
                if exc.leader_hint and not req.forwarded:
                    elsewhere.setdefault(exc.leader_hint, []).append(want)
        max_bytes = min(req.max_bytes or REPLICATE_MAX_BYTES_DEFAULT, FETCH_MAX_BYTES_CAP)
        max_wait_ms = min(req.max_wait_ms or REPLICATE_MAX_WAIT_MS_DEFAULT, FETCH_MAX_WAIT_MS_CAP)
        # A forwarded pull is paced by the node that passes it on, with the rest of its stream.
        rate = None if req.forwarded else link_rate(self.replicator, self.broker.identity.site, req.dst_site)
        if rate is not None:
            max_bytes = min(max_bytes, int(rate))  # a message at most a second of the limit
        local = {k: wants[k] for k in partitions}
        served_here = self._serve_replicas(partitions, local, max_bytes, max_wait_ms, incarnations, req.accept_zstd)
        stream = served_here
        if routes:
            assert self.site_cluster is not None
            stream = with_forwarded(self.site_cluster, req, served_here, elsewhere, routes, set(partitions))
        loop = asyncio.get_running_loop()
        pacer = None if rate is None else Pacer.start(rate, loop.time())
        async for response in stream:
            yield response
            if pacer is not None:
                await asyncio.sleep(pacer.charge(response.ByteSize(), loop.time()))

    async def _serve_replicas(
        self,
        partitions: dict[tuple[str, int], Partition],
        wants: dict[tuple[str, int], tuple[dict[Origin, int], tuple[str, ...]]],
        max_bytes: int,
        max_wait_ms: int,
        incarnations: Mapping[str, int],
        zstd: bool,
    ) -> AsyncIterator[pb.ReplicateResponse]:
        """The pulls of the partitions this node serves; ends (cleanly: the destination opens it again at once, and
        it is routed afresh) when this node stops serving one of them, or its segment changes."""
        source = ReplicaSource({k: p.log for k, p in partitions.items()}, wants, heartbeat_ms=max_wait_ms)
        clock = self.broker.clock_ms
        stopping = self._stopping_future()
        loop = asyncio.get_running_loop()
        woken: asyncio.Future[None] = loop.create_future()
        moved: set[tuple[str, int]] = set()  # partitions whose durable state moved since the last look

        def flushed(key: tuple[str, int]) -> None:
            nonlocal woken
            source.flushed(key)
            moved.add(key)
            if not woken.done():
                woken.set_result(None)

        for p in partitions.values():
            p.durable_watchers.add(flushed)
        try:
            while not stopping.done():
                # A partition stops being served here only through Broker.detach, which notifies its watchers.
                if moved:
                    if any(self.broker.partitions.get(key) is not partitions[key] for key in moved):
                        return
                    moved.clear()
                step, elsewhere = self._replica_step(source, partitions, clock(), max_bytes)
                if step.chunks or step.heartbeat:  # a heartbeat may carry nothing: nothing changed, nothing due
                    if not step.heartbeat:
                        self.metrics.replicated_out(sum(len(c.batches) for c in step.chunks))
                        origin = self.broker.origin
                        for c in step.chunks:  # before they leave: a report of them may come back at once
                            self._count_held(self.served.sent(*c.key, source.handed_out(c.key, origin)))
                    response = self._replicate_response(step.chunks, incarnations, zstd)
                    if not step.heartbeat:
                        self.metrics.replicated_wire(sum(len(c.batches) + len(c.batches_zstd) for c in response.chunks))
                    yield response
                if elsewhere:
                    assert self.site_cluster is not None
                    for chain, first in elsewhere:
                        await self.site_cluster.read_elsewhere(chain, first, max_bytes)
                    continue
                if step.again:
                    await asyncio.sleep(0)  # let other streams run between two reads
                    continue
                # Batches are served once durable, so wake on a flush (the watchers), not on an append.
                if woken.done():
                    woken = loop.create_future()
                    if moved or source.active():
                        continue
                timeout = max(0.0, (step.wake_ms - clock()) / 1000)
                await asyncio.wait([stopping, woken], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for p in partitions.values():
                p.durable_watchers.discard(flushed)

    @staticmethod
    def _replica_step(
        source: ReplicaSource, partitions: dict[tuple[str, int], Partition], now_ms: int, max_bytes: int
    ) -> tuple[Serve, list[tuple[ChainLog, SegmentElsewhere]]]:
        """One step of ``source``. A multi-node site: a cursor that reaches a sealed segment this node holds no copy
        of stops there (keeping what it gathered), and the range is read from a member before the next step, as a
        fetch does. Only the chains of the partitions the step may read are prepared."""
        chains = [log for k in source.active() if isinstance(log := partitions[k].log, ChainLog)]
        with contextlib.ExitStack() as deferring:
            missing = [(c, deferring.enter_context(c.deferring_elsewhere())) for c in chains]
            serve = source.step(now_ms, max_bytes)
        return serve, [(c, m[0]) for c, m in missing if m]

    @staticmethod
    def _replicate_response(chunks: list[Chunk], incarnations: Mapping[str, int], zstd: bool) -> pb.ReplicateResponse:
        """The message of ``chunks``; with ``zstd`` (the destination accepts it), each chunk's batches compressed for
        the trip where that makes them smaller (``georep/replication/wire.py``)."""
        out = pb.ReplicateResponse()
        for c in chunks:
            batches, batches_zstd = wire.pack(c.batches) if zstd else (c.batches, b"")
            out.chunks.append(
                pb.ReplicaChunk(
                    topic=c.key[0],
                    partition=c.key[1],
                    batches=batches,
                    batches_zstd=batches_zstd,
                    src_vector=_vector_to_pb(c.src_vector),
                    src_log_end_offset=c.src_log_end,
                    incarnation=incarnations.get(c.key[0], 0),
                )
            )
        return out

    async def set_link(self, data: bytes, context: Context) -> pb.SetLinkResponse:
        req = parse(pb.SetLinkRequest, data)
        self.admin.check(context, "SetLink")
        site = self.broker.identity.site
        if self.replicator is None:
            raise NoTopology(f"site {site} runs without a topology, so it has no links")
        try:
            state = self.replicator.set_link(req.src, req.enabled)
        except KeyError:
            inbound = ", ".join(sorted(self.replicator.pullers)) or "none"
            raise NoSuchLink(
                f"no link {req.src} -> {site} in the topology; links into {site} come from: {inbound}"
            ) from None
        return pb.SetLinkResponse(src=req.src, dst=site, enabled=req.enabled, state=state)

    async def site_status(self, data: bytes, context: Context) -> pb.SiteStatusResponse:
        """A summary per topic and link; per-partition rows only when asked, by topic and by page
        (``georep/server/site_status.py``)."""
        req = parse(pb.SiteStatusRequest, data)
        if req.page_size < 0:
            raise InvalidRequest(f"page_size {req.page_size} must be 0 (every row) or more")
        return site_status.answer(self.broker, self.replicator, req)

    async def report_interest(self, data: bytes, context: Context) -> pb.ReportInterestResponse:
        """A downstream site's interests over an interest link from this site (``interest_links.py``), each
        entry checked against the topology first: a report that could not come from the reporter is refused."""
        req = parse(pb.ReportInterestRequest, data)
        if self.replicator is None:
            raise NoTopology(f"site {self.broker.identity.site} runs without a topology, so it has no links")
        entries = interest_entries(self.replicator.topology, self.broker.identity.site, req)
        self.replicator.interest_links.receive(req.reporter, entries, req.lease_ms)
        return pb.ReportInterestResponse()

    async def report_held(self, data: bytes, context: Context) -> pb.ReportHeldResponse:
        """What the sites downstream hold (``offsets/held.py``): each claim counts only if the topology lets the
        reporter make it (the others are refused, named in the ``PERMISSION_DENIED`` that answers the report, and
        logged), and only up to what has left this node (``ServedGate``)."""
        req = parse(pb.ReportHeldRequest, data)
        try:
            reporter = site_id(req.reporter)
        except InvalidSiteId as exc:
            raise InvalidRequest(f"malformed ReportHeldRequest: the reporter: {exc}") from None
        entries = []
        kept = []
        refused: list[tuple[str, str, int, str]] = []
        for e in req.entries:
            try:
                site_id(e.site)
                vector = vector_from_proto(e.vector)
            except (InvalidSiteId, InvalidVectorOffset) as exc:
                raise InvalidRequest(f"malformed ReportHeldRequest: {exc}") from None
            why = self.claims.refusal(reporter, e.site, e.topic)
            if why is not None:
                refused.append((e.site, e.topic, e.partition, why))
                continue
            entries.append((e.site, e.topic, e.partition, vector))
            kept.append(e)
        self._count_held(self.served.admit(entries))
        if self.site_cluster is not None and not req.forwarded and kept:
            # Whichever node of this site leads a partition (now or after a failover) releases its geo acks.
            forwarded = pb.ReportHeldRequest(reporter=reporter, entries=kept, forwarded=True)
            self.site_cluster.tell_peers(forwarded)
        if refused:
            error = ClaimRefused(self.broker.identity.site, reporter, refused)
            self._log_refused(reporter, str(error))
            raise error
        return pb.ReportHeldResponse()

    def _count_held(self, entries: list[HeldEntry]) -> None:
        if entries:
            self.broker.report_held(entries)

    def _partition_opened(self, p: Partition) -> None:
        """Records of this site that the log held when this node opened it may have left before (``ServedGate``)."""
        self._count_held(self.served.opened(p.topic, p.index, p.log.vector().get(self.broker.origin, 0)))
        if self.replicator is not None:
            self.replicator.partition_opened(p)

    def _log_refused(self, reporter: str, message: str) -> None:
        """A warning per reporter when what it gets refused changes, and once a minute while it lasts: the reporter
        sends refused claims again with every report."""
        now = time.monotonic()
        last = self._refusals_logged.get(reporter)
        if last is not None and last[0] == message and now - last[1] < REFUSALS_LOGGED_EVERY_S:
            return
        if len(self._refusals_logged) >= REFUSALS_LOGGED_MAX:
            self._refusals_logged.clear()
        self._refusals_logged[reporter] = (message, now)
        log.warning("%s", message)

    async def cluster_status(self, data: bytes, context: Context) -> pb.ClusterStatusResponse:
        request = parse(pb.ClusterStatusRequest, data)
        if self.site_cluster is None:
            site = self.broker.identity.site
            raise SingleNodeSite(
                f"site {site} has one node, so it has no segment cluster (ensembles, partition "
                "leaders, Raft) to show: 'georep cluster status' is for sites whose nodes run with "
                "--node-id; use 'georep health' and 'georep topic describe' here"
            )
        return await self.site_cluster.cluster_status(request)

    async def decommission_node(self, data: bytes, context: Context) -> pb.DecommissionNodeResponse:
        req = parse(pb.DecommissionNodeRequest, data)
        self.admin.check(context, "DecommissionNode")
        if self.site_cluster is None:
            site = self.broker.identity.site
            raise SingleNodeSite(
                f"site {site} has one node: there is no other node to move its segments to, so it "
                "cannot be decommissioned (stop it, or add nodes with --node-id first)"
            )
        try:
            node = node_id(req.node_id)
        except InvalidNodeId as exc:
            raise InvalidRequest(str(exc)) from None
        drain = await self.site_cluster.member.decommission(node, not req.cancel)
        return pb.DecommissionNodeResponse(
            node_id=drain.node,
            draining=drain.draining,
            sealed_segments=drain.sealed_segments,
            open_segments=drain.open_segments,
            leader_of=drain.leader_of,
            drained=drain.drained,
            message=drain.message(),
        )

    # -- wiring ---------------------------------------------------------------

    def handler(self) -> grpc.GenericRpcHandler:
        return service(
            SERVICE,
            {
                "CreateTopic": unary(self.create_topic),
                "CreateTopics": unary(self.create_topics),
                "AlterTopic": unary(self.topic_calls.alter_topic),
                "AddPartitions": unary(self.topic_calls.add_partitions),
                "DeleteTopic": unary(self.topic_calls.delete_topic),
                "ListTopics": unary(self.list_topics),
                "DescribeTopic": unary(self.describe_topic),
                "Produce": unary(self.produce),
                "ReportInterest": unary(self.report_interest),
                "ListOffsets": unary(self.list_offsets),
                "Health": unary(self.health),
                "SiteStatus": unary(self.site_status),
                "SetLink": unary(self.set_link),
                "ReportHeld": unary(self.report_held),
                "FetchBatch": unary(self.fetch_batch),
                "Scrub": unary_stream(self.scrub),
                "ScanDigests": unary_stream(self.digests.scan_digests),
                "GroupHeartbeat": unary(self.group_calls.group_heartbeat),
                "LeaveGroup": unary(self.group_calls.leave_group),
                "CommitOffsets": unary(self.group_calls.commit_offsets),
                "FetchCommitted": unary(self.group_calls.fetch_committed),
                "ListGroups": unary(self.group_calls.list_groups),
                "DescribeGroup": unary(self.group_calls.describe_group),
                "ClusterStatus": unary(self.cluster_status),
                "DecommissionNode": unary(self.decommission_node),
                "PutAcl": unary(self.acls.put_acl),
                "ListAcls": unary(self.acls.list_acls),
                "PutUser": unary(self.acls.put_user),
                "ListUsers": unary(self.acls.list_users),
                "Replicate": unary_stream(self.replicate),
                "ProduceStream": stream_stream(self.produce_stream),
                "Fetch": unary_stream(self.fetch),
            },
        )


def _fetch_start(req: pb.FetchRequest) -> FetchStart:
    which = req.WhichOneof("start")
    if which == "offset":
        return AtOffset(req.offset)
    if which == "vector":
        hint_origin = None
        if req.hint_origin:
            try:
                hint_origin = Origin.parse(req.hint_origin)
            except (InvalidOrigin, InvalidSiteId):
                hint_origin = None  # a hint is only a shortcut: without it the vector alone says where
        return FromVector(_vector_from_pb(req.vector), hint_origin, req.hint_offset)
    return Latest() if req.position == pb.START_LATEST else Earliest()


def _vector_below(plog: PartitionLog, offset: int) -> pb.VectorOffset:
    """The vector of every record below ``offset``: a position there that means the same at every site."""
    segment = plog.segment_at(offset)
    return vector_to_proto(vector_below(segment.start_vector, segment.entries, offset))


def link_rate(replicator: Replicator | None, site: str, dst_site: str) -> float | None:
    """This node's share of the limit of the link ``site -> dst_site``, if the topology sets one: each node of the
    destination site pulls over a stream of its own (``georep/replication/pacing.py``)."""
    if replicator is None or not dst_site:
        return None
    topology = replicator.topology
    try:
        link = topology.link(site, dst_site)
    except (UnknownLink, UnknownSite):
        return None
    return share(link.rate_limit_bytes_per_s, len(topology.site(SiteId(dst_site)).members))


def with_forwarded(
    site_cluster: SiteCluster,
    req: pb.ReplicateRequest,
    served_here: AsyncIterator[pb.ReplicateResponse],
    elsewhere: dict[str, list[pb.PullWant]],
    routes: dict[tuple[str, int], str],
    here: set[tuple[str, int]],
) -> AsyncIterator[pb.ReplicateResponse]:
    """A multi-node site: what this node serves, merged with the pulls of the partitions other nodes lead."""
    sources = [served_here]
    for address, forwarded in sorted(elsewhere.items()):
        sub = pb.ReplicateRequest(
            dst_site=req.dst_site,
            wants=forwarded,
            max_bytes=req.max_bytes,
            max_wait_ms=req.max_wait_ms,
            forwarded=True,
            accept_zstd=req.accept_zstd,
        )
        sources.append(site_cluster.pull_from(address, sub))
    # Ends the pull (cleanly) when a partition left out or passed on moves: even here, where one was forwarded
    # a moment before this node attached it (a roll, a new leadership).
    sources.append(site_cluster.until_routes_change(routes, here))
    return merge_streams(sources)
