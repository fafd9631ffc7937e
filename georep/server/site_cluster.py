"""A node of a multi-node site, as its broker sees it: which partitions it leads, and over what. Shell.

The :class:`~georep.server.cluster_member.ClusterMember` decides who leads
what and writes segments (every decision in ``cluster/``); the broker takes
producers' batches, serves readers and releases acks (every decision in
``georep/broker/``). :class:`SiteCluster` joins them, and holds no decision
of its own:

* **A segment opens** (after the leader's recovery, or a roll): the
  partition is attached to the broker over a
  :class:`~georep.storage.chain_log.ChainLog` of the chain the metadata
  lists, whose LAC starts at the open segment's base and whose vector there
  is the sealed end vector of the segment before it.
* **Appends** (produced or replicated) go into the leader's copy through the
  chain log; the writer is told (``SegmentWriter.appended``) and streams
  them to the members. Its LAC comes back to the broker's ``AckTable``
  (``acks=all``, ``geo:N``) and to readers; its own fsync to ``acks=leader``.
* **The segment seals** (a roll, or the leader is deposed): new appends are
  refused with ``NotLeader`` (retriable: the producer retries, at the leader
  its metadata names), acks go on until the seal, and then the partition is
  detached: what was not confirmed fails, and may be cut.
* **Other nodes** answer ``NotLeader`` naming the leader's address, from
  this node's view of the metadata, as Kafka's brokers answer
  ``NOT_LEADER_OR_FOLLOWER``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import ThreadPoolExecutor

import grpc

from cluster.producer_snapshot import history_at_open
from cluster.repair import UnderReplicated
from cluster.site_state import PartitionInfo
from cluster.status import InvalidPageToken, Page, PartitionStatus, cluster_status, page_token, parse_page_token
from dedup.producer import ProducerStateTable
from georep.broker.errors import InvalidRequest, NotLeader, SegmentUnreadable
from georep.client.connection import CHANNEL_OPTIONS
from georep.metadata.kafka_config import SiteSettings
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.raft.store import RaftMetadataStore
from georep.security.tls import TlsConfig, channels, client_channel
from georep.server.broker import Broker
from georep.server.cluster_member import ClusterMember, PartitionLeader
from georep.server.ensemble import SegmentWriter
from georep.server.segment_refs import segment_ref
from georep.server.store_bytes import StoreBytes
from georep.storage.chain_log import ChainLog, ChainSegment, SegmentElsewhere
from georep.storage.replica_store import PartitionKey, ReplicaStore
from offsets.coordinates import Origin
from topology.ids import NodeId, SegmentId

log = logging.getLogger(__name__)

REMOTE_READ_TIMEOUT_S = 10.0
ROUTE_CHECK_S = 0.25  # how often a pull passed on to other nodes checks that their leadership has not moved


def leader_producers(
    store: ReplicaStore, info: PartitionInfo, open_id: SegmentId, origin: Origin, now_ms: int
) -> ProducerStateTable:
    """The idempotent producers' table a leader starts writing open segment ``open_id`` with: the one the chain's last
    seal carries (``cluster/producer_snapshot.py`` has why), then the open segment's own batches. Never only the
    copies this node holds: it may hold none of the segments a producer last wrote to."""
    key = (info.topic, info.partition)
    history = history_at_open(info.sealed_producers(origin), lambda: store.entries_before(key, open_id))
    entries = itertools.chain(history, store.batch_entries(key, open_id))
    return ProducerStateTable.rebuild(entries, now_ms=now_ms, origin=origin)


class _Writing:
    """The broker's handle on one leader's open segment (``InSiteReplication``)."""

    def __init__(self, lead: PartitionLeader, writer: SegmentWriter, chain: ChainLog) -> None:
        self.lead = lead
        self.writer = writer
        self.chain = chain

    def appended(self, end: int) -> None:
        self.lead.note_appended(end)

    def flush(self) -> None:
        self.writer.flush_soon()


class SiteCluster:
    """Attaches the partitions this node leads to its broker; see the module docstring."""

    def __init__(
        self,
        broker: Broker,
        member: ClusterMember,
        metadata: RaftMetadataStore,
        store: ReplicaStore,
        executor: ThreadPoolExecutor,
        tls: TlsConfig | None = None,
    ) -> None:
        self.broker = broker
        self.member = member
        self.metadata = metadata
        self.store = store
        self.executor = executor
        self.tls = tls
        self.channel = channels(tls)
        self._writing: dict[PartitionKey, _Writing] = {}
        self._peers: dict[str, grpc.aio.Channel] = {}  # long-lived channels to the other nodes, by address
        self._background: set[asyncio.Task[None]] = set()
        self._store_bytes = StoreBytes(store.size_bytes, executor)
        member.listener = self
        member.origin = broker.origin
        broker.leader_hint = self.leader_address
        broker.site = SiteSettings(member.config.replication_factor, member.config.ack_quorum)
        broker.unplaceable = self.unplaceable

    # -- the metadata ----------------------------------------------------------------------------------------

    def unplaceable(self, topic: str, index: int) -> str | None:
        """Why this node, leading ``topic``-``index``, can open no segment of it now (``PartitionLead.blocked``)."""
        lead = self.member.core.leads.get((topic, index))
        return None if lead is None else lead.blocked

    def leader_address(self, topic: str, index: int) -> str:
        """The address of the node the metadata names as the leader of ``topic``-``index``, or ""."""
        state = self.metadata.state()
        info = state.partition(topic, index)
        if info is None or info.leader is None:
            return ""
        node = state.node(info.leader)
        return node.address if node is not None else ""

    def leaders(self, topic: str, partitions: int) -> list[pb.PartitionLeader]:
        """Every partition's leader as this node's view has it (``DescribeTopic``: Kafka's Metadata)."""
        state = self.metadata.state()
        out = []
        for index in range(partitions):
            info = state.partition(topic, index)
            node = state.node(info.leader) if info is not None and info.leader is not None else None
            out.append(
                pb.PartitionLeader(
                    partition=index,
                    node_id=node.node if node is not None else 0,
                    address=node.address if node is not None else "",
                    leader_epoch=info.leader_epoch if info is not None else 0,
                )
            )
        return out

    def node_address(self, node: NodeId) -> str:
        info = self.metadata.state().node(node)
        return info.address if info is not None else ""

    async def create_topic(self, name: str, partitions: int, config: dict[str, str]) -> None:
        """Raises what ``Broker.create_topic`` raises (``InvalidConfig`` or ``InvalidReplicationFactor`` among them:
        ``Broker.site``)."""
        await asyncio.get_running_loop().run_in_executor(
            self.executor, self.broker.create_topic, name, partitions, config
        )

    async def cluster_status(self, request: pb.ClusterStatusRequest | None = None) -> pb.ClusterStatusResponse:
        """``ClusterStatus``: ``cluster.status.cluster_status`` of this node's view of the metadata, now, with its
        own store's bytes (the only disk it can read) and its view of the Raft group; the page of partitions the
        request asks for (all of them if it sets no limit). Raises ``InvalidPageToken``."""
        page = _status_page(request or pb.ClusterStatusRequest())
        config = self.member.config
        view = cluster_status(
            self.metadata.state(), self.member.clock_ms(), config.session_timeout_ms, config.replication_factor, page
        )
        store_bytes = await self._store_bytes.read()  # the last measured: the store's threads may be busy
        moved = {n.node: n.bytes_moved for n in view.nodes} | {self.member.me: self.store.moved.total}
        raft = self.metadata.status()
        identity = self.broker.identity
        return pb.ClusterStatusResponse(
            site=identity.site,
            epoch=identity.epoch,
            node_id=self.member.me,
            replication_factor=config.replication_factor,
            session_timeout_ms=config.session_timeout_ms,
            raft=pb.RaftGroupStatus(
                self_address=raft.self_address,
                leader_address=raft.leader_address or "",
                is_leader=raft.is_leader,
                reachable_nodes=raft.reachable_nodes,
                total_nodes=raft.total_nodes,
                applied_index=raft.applied_index,
                commit_index=raft.commit_index,
            ),
            nodes=[
                pb.ClusterNodeStatus(
                    node_id=n.node,
                    address=n.address,
                    live=n.live,
                    last_heartbeat_age_ms=n.heartbeat_age_ms,
                    free_bytes=n.free_bytes,
                    load=n.load,
                    draining=n.draining,
                    segments=n.segments,
                    open_segments=n.open_segments,
                    leader_of=n.leader_of,
                    store_bytes=store_bytes if n.node == self.member.me else None,
                    bytes_moved=moved[n.node],
                )
                for n in view.nodes
            ],
            partitions=_partition_rows(view.partitions),
            under_replicated=_under_replicated_rows(view.under_replicated),
            bytes_moved=sum(moved.values()),
            partition_count=view.partition_count,
            leaderless_partitions=view.leaderless,
            under_replicated_count=view.under_replicated_count,
            next_page_token=page_token(view.next_after) if view.next_after is not None else "",
        )

    # -- LeaderListener --------------------------------------------------------------------------------------

    def segment_opened(self, lead: PartitionLeader) -> None:
        writer = lead.writer
        state = self.metadata.state()
        info = state.partition(*lead.key)
        spec = state.topic(lead.key[0])
        if writer is None or info is None or spec is None:
            return
        open_id = writer.segment.segment_id
        chain = [
            ChainSegment(s.segment_id, s.base_offset, s.end_offset, s.end_vector, s.ensemble)
            for s in info.segments
            if s.segment_id <= open_id
        ]
        if not chain or chain[-1].segment_id != open_id or chain[-1].end_offset is not None:
            log.error(
                "node %d: the view of %s-%d does not show segment %d open; not serving it",
                self.member.me,
                *lead.key,
                open_id,
            )
            return
        lac_vector = info.sealed_vector_before(open_id)
        chain_log = ChainLog(lead.key, self.store, chain, lead.epoch, lac_vector)
        writing = _Writing(lead, writer, chain_log)
        self._writing[lead.key] = writing
        key = lead.key
        writer.on_lac = lambda lac: self._lac(key, writing, lac)
        writer.on_own_flush = lambda flushed, error: self._own_flush(key, writing, flushed, error)
        producers = leader_producers(self.store, info, open_id, self.broker.origin, self.broker.clock_ms())
        self.broker.attach(spec, key[1], chain_log, writing, chain[-1].base_offset, lac_vector, producers)

    def sealing(self, lead: PartitionLeader) -> None:
        writing = self._writing.get(lead.key)
        p = self.broker.partitions.get(lead.key)
        if writing is not None and writing.lead is lead and p is not None and p.in_site is writing:
            p.sealing = True

    def segment_closed(self, lead: PartitionLeader, reason: str) -> None:
        writing = self._writing.get(lead.key)
        if writing is None or writing.lead is not lead:
            return
        del self._writing[lead.key]
        p = self.broker.partitions.get(lead.key)
        if p is not None and p.in_site is writing:
            self.broker.detach(lead.key, NotLeader(*lead.key, reason, self.leader_address(*lead.key)))

    def _lac(self, key: PartitionKey, writing: _Writing, lac: int) -> None:
        if self._writing.get(key) is writing and writing.chain.advance_lac(lac):
            self.broker.quorum_advanced(key, writing.chain.flushed_offset, writing.chain.lac_vector())

    def _own_flush(self, key: PartitionKey, writing: _Writing, flushed: int | None, error: str) -> None:
        if self._writing.get(key) is writing:
            self.broker.own_flush_done(key, flushed, error)

    # -- the other nodes of the site -------------------------------------------------------------------------

    def _peer(self, address: str) -> pbg.NodeAsyncStub:
        channel = self._peers.get(address)
        if channel is None:
            # A pull's messages hold whole batches (up to the largest max_batch_bytes): the client's size limits.
            channel = self._peers[address] = client_channel(address, self.tls, CHANNEL_OPTIONS)
        return pbg.NodeStub(channel)

    async def pull_from(self, address: str, request: pb.ReplicateRequest) -> AsyncIterator[pb.ReplicateResponse]:
        """A destination's pull of the partitions the node at ``address`` leads (``forwarded``), passed on by this
        node. Ends with :class:`SegmentUnreadable` (UNAVAILABLE: the destination reopens) when that node stops."""
        call = self._peer(address).Replicate(request)
        try:
            async for response in call:
                yield response
            # That node ended its part (a partition it served moved): end the whole pull, to be routed afresh.
        except grpc.aio.AioRpcError as exc:
            raise SegmentUnreadable(
                f"the pull of {len(request.wants)} partition(s) led by the node at {address} "
                f"ended ({exc.code().name}: {exc.details()}); pull again"
            ) from None
        finally:
            call.cancel()

    async def until_routes_change(
        self, routes: dict[PartitionKey, str], local: set[PartitionKey], check_s: float = ROUTE_CHECK_S
    ) -> AsyncIterator[pb.ReplicateResponse]:
        """Yields nothing; returns once a partition of a pull this node passes on is led elsewhere than ``routes``
        says (or by this node, though it is not in ``local``): the pull ends cleanly, and the destination opens it
        again at once, routed afresh. Leaderless partitions are left out of a pull until they have a leader."""
        while True:
            await asyncio.sleep(check_s)
            for key, address in routes.items():
                if key in self.broker.partitions and key not in local:
                    return
                if key not in self.broker.partitions and self.leader_address(*key) != address:
                    return
        yield pb.ReplicateResponse()  # pragma: no cover - makes this an async generator

    def tell_peers(self, report: pb.ReportHeldRequest) -> None:
        """Pass what another site holds on to every other node of this site, in the background. Every registered
        node, not only those this view shows live: a node that just restarted has a stale view, and a report it
        failed to pass on is lost until the partition changes again (reports carry what changed)."""
        for node in self.metadata.state().nodes().values():
            if node.node != self.member.me:
                task = asyncio.create_task(self._tell(node.address, report))
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    async def _tell(self, address: str, report: pb.ReportHeldRequest) -> None:
        try:
            await self._peer(address).ReportHeld(report, timeout=REMOTE_READ_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.debug("passing a held report on to %s failed: %s", address, exc.details())

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for channel in self._peers.values():
            await channel.close(grace=None)
        self._peers.clear()

    # -- reads of segments held elsewhere --------------------------------------------------------------------

    async def read_elsewhere(self, chain: ChainLog, missing: SegmentElsewhere, max_bytes: int) -> None:
        """Read ``missing``'s range from a member of its segment into ``chain``'s cache (``ChainLog.cache_remote``).
        Raises :class:`SegmentUnreadable` if no member answers."""
        segment = missing.segment
        why: list[str] = []
        for node in segment.ensemble:
            if node == self.member.me:
                continue
            address = self.node_address(node)
            if not address:
                continue
            request = pb.ReadSegmentRequest(
                segment=segment_ref(self.store, chain.key, segment.segment_id),
                offset=missing.offset,
                end_offset=segment.end_offset or 0,
                max_bytes=max_bytes,
            )
            try:
                async with self.channel(address) as channel:
                    call = pbg.SegmentsStub(channel).ReadSegment(request, timeout=REMOTE_READ_TIMEOUT_S)
                    async for response in call:
                        chain.cache_remote(segment.segment_id, missing.offset, response.batches)
                        return
            except grpc.aio.AioRpcError as exc:
                why.append(f"node {node} ({address}): {exc.code().name} {exc.details()}")
        raise SegmentUnreadable(
            f"{missing}, and none of them could be read ({'; '.join(why) or 'no address is known'})"
            "; bring one of them back, or wait for the site to repair the segment"
        )


def _status_page(request: pb.ClusterStatusRequest) -> Page:
    """The page of partitions a ``ClusterStatus`` request asks for; ``InvalidRequest`` names what is wrong."""
    limit = request.partitions_limit if request.HasField("partitions_limit") else None
    if limit is not None and limit < 0:
        raise InvalidRequest(f"partitions_limit {limit}: use 0 (no partitions, the summary) or more")
    try:
        after = parse_page_token(request.page_token) if request.page_token else None
    except InvalidPageToken as e:
        raise InvalidRequest(str(e)) from None
    return Page(limit, after, request.topic or None)


def _partition_rows(partitions: Iterable[PartitionStatus]) -> list[pb.ClusterPartitionStatus]:
    return [
        pb.ClusterPartitionStatus(
            topic=p.topic,
            partition=p.partition,
            leader=p.leader or 0,
            leader_live=p.leader_live,
            leader_epoch=p.leader_epoch,
            segments=p.segments,
            open_segment_id=p.open_segment,
            open_ensemble=list(p.open_ensemble),
        )
        for p in partitions
    ]


def _under_replicated_rows(rows: Iterable[UnderReplicated]) -> list[pb.UnderReplicatedSegment]:
    return [
        pb.UnderReplicatedSegment(
            topic=u.topic,
            partition=u.partition,
            segment_id=u.segment_id,
            sealed=u.sealed,
            ensemble=list(u.ensemble),
            dead=list(u.dead),
            draining=list(u.draining),
            live_members=u.live_count,
            wanted_members=u.wanted,
            message=u.message(),
        )
        for u in rows
    ]
