"""The node's replication shell: one puller per inbound link, around the pure ``LinkManager``.

For each link ``src -> me`` of the topology, a :class:`Puller` runs two tasks:

* **topics**: every ``TOPIC_SYNC_S`` it lists ``src``'s topics and creates
  here the ones the link's filters carry, with the same partition count and
  configuration. A topic that exists here with another partition count is a
  *conflict*: it is not replicated over this link, and is reported in
  ``SiteStatus.conflicts`` and ``georep_topic_conflicts``. Nothing is merged.
* **stream**: it opens ``Replicate`` with the wants ``LinkManager.wants(src)``
  gives (plus this site's have-vectors), applies each chunk with
  ``Broker.append_replica``, and feeds ``LinkManager``: ``link_up`` on the
  first message, ``upstream_vector`` from every chunk, ``local_vector`` after
  each apply, ``link_down`` on an error. It reopens the stream when the wants
  change (checked every ``WANTS_CHECK_S``), on a gap or a divergent batch (the
  stream is out of step with this site's vector), and after an error, with
  exponential backoff from ``BACKOFF_MIN_S`` to ``BACKOFF_MAX_S``.

:class:`Replicator` owns the ``LinkManager``, the pullers, the per-link
counters and the ``tick`` task, and answers ``SiteStatus``. Every ``LinkManager``
call happens on the event loop thread, so it needs no lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from cluster.topics import TOPIC_CONFIG_KEYS
from georep.client.connection import CHANNEL_OPTIONS
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.proto.convert import vector_from_proto, vector_to_proto
from georep.replication.links import LinkManager, LinkState, PartitionKey
from georep.replication.sink import pull_have
from georep.server.broker import Broker, BrokerError
from offsets.coordinates import Origin
from offsets.vector import InvalidVectorOffset, VectorOffset
from topology.ids import SiteId
from topology.model import Topology
from topology.reach import expected_sites

log = logging.getLogger(__name__)

TOPIC_SYNC_S = 1.0
WANTS_CHECK_S = 0.2
TICK_S = 0.2
BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 2.0
STREAM_MAX_BYTES = 1 << 20
HEARTBEAT_MS = 500
RPC_TIMEOUT_S = 5.0
# A stream that delivers nothing, not even a heartbeat, for this long is dead
# (a peer that vanished without closing its TCP connection).
STREAM_IDLE_S = 10 * HEARTBEAT_MS / 1000

Wants = dict[PartitionKey, tuple[SiteId, ...]]


class Reopen(Exception):
    """The stream is out of step with this site's vector: open it again, at once."""


@dataclass
class LinkStats:
    applied_batches: int = 0
    applied_bytes: int = 0
    applied_records: int = 0
    skipped_batches: int = 0
    gaps: int = 0
    reopens: int = 0
    last_error: str = ""


class LinkDisabled(Exception):
    """An operator cut the link (``SetLink``): end the stream until it is healed."""


DISABLED = "cut by an operator (georep link cut); heal it with georep link heal"


class Puller:
    """The inbound link ``src -> site``: topic sync and the ``Replicate`` stream."""

    def __init__(self, replicator: Replicator, src: SiteId, address: str) -> None:
        self.r = replicator
        self.src = src
        self.address = address
        self.stats = LinkStats()
        self._channel: grpc.aio.Channel | None = None
        self._stub: pbg.NodeStub | None = None
        self._topics_synced = asyncio.Event()
        # The upstream's topics and partition counts, from the last ListTopics:
        # a want for a topic it does not have (yet) would fail the whole stream.
        self.remote_topics: dict[str, int] = {}
        self.enabled = asyncio.Event()
        self.enabled.set()
        # Reports of what this site (and the sites it heard from) hold, to src (acks=geo:N).
        self.held_changed = asyncio.Event()
        self.held_sent_version = 0

    @property
    def stub(self) -> pbg.NodeStub:
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
            self._stub = pbg.NodeStub(self._channel)
        return self._stub

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close(grace=None)

    # -- topics ---------------------------------------------------------------

    async def topics_loop(self) -> None:
        while True:
            await self.enabled.wait()
            try:
                resp = await self.stub.ListTopics(pb.ListTopicsRequest(), timeout=RPC_TIMEOUT_S)
                self.sync_topics(resp)
                self._topics_synced.set()
            except grpc.aio.AioRpcError as exc:
                log.debug("listing topics at %s (%s) failed: %s", self.src, self.address, exc.details())
            await asyncio.sleep(TOPIC_SYNC_S)

    def sync_topics(self, resp: pb.ListTopicsResponse) -> None:
        r = self.r
        link = r.topology.link(self.src, r.site)
        self.remote_topics = {t.name: t.partitions for t in resp.topics}
        for t in resp.topics:
            if not link.carries(t.name):
                continue
            local = r.broker.metadata.topics().get(t.name)
            if local is None:
                config = {k: v for k, v in t.config.items() if k in TOPIC_CONFIG_KEYS}
                try:
                    r.broker.create_topic(t.name, t.partitions, config)
                    log.info("created topic %r (%d partitions) replicated from site %s", t.name, t.partitions,
                             self.src)  # fmt: skip
                except BrokerError as exc:
                    if exc.code != grpc.StatusCode.ALREADY_EXISTS:
                        r.conflicts[(t.name, self.src)] = (
                            f"topic {t.name!r} of site {self.src} cannot be created at site {r.site}: {exc.message}"
                        )
                        continue
                local = r.broker.metadata.topics().get(t.name)
                if local is None:
                    continue
            if local.partitions != t.partitions:
                message = (
                    f"topic {t.name!r} has {local.partitions} partitions at site {r.site} but {t.partitions} at "
                    f"site {self.src}: it is not replicated over the link {self.src} -> {r.site}. Partition counts "
                    "must match at every site; recreate the topic under a new name with one partition count"
                )
                if r.conflicts.get((t.name, self.src)) != message:
                    log.warning("%s", message)
                r.conflicts[(t.name, self.src)] = message
            else:
                r.conflicts.pop((t.name, self.src), None)

    # -- held reports -----------------------------------------------------------

    async def report_loop(self) -> None:
        """Tell src what this site, and every site it heard from, holds fsynced.

        One report at a time; what changes meanwhile goes in the next one, so a
        burst of fsyncs costs one report per round trip."""
        held = self.r.broker.held
        while True:
            await self.held_changed.wait()
            self.held_changed.clear()
            await self.enabled.wait()
            version = held.version
            entries = [
                pb.HeldEntry(site=site, topic=topic, partition=index, vector=vector_to_proto(vector))
                for (site, topic, index), vector in held.changed_since(self.held_sent_version)
                if site != self.src
            ]  # fmt: skip
            if not entries:
                self.held_sent_version = version
                continue
            try:
                await self.stub.ReportHeld(pb.ReportHeldRequest(reporter=self.r.site, entries=entries),
                                           timeout=RPC_TIMEOUT_S)  # fmt: skip
                self.held_sent_version = version
            except grpc.aio.AioRpcError as exc:
                log.debug("reporting held vectors to %s failed: %s", self.src, exc.details())
                await asyncio.sleep(BACKOFF_MAX_S)
                self.held_changed.set()

    # -- stream ---------------------------------------------------------------

    def wants(self) -> Wants:
        conflicted = {topic for (topic, src) in self.r.conflicts if src == self.src}
        remote = self.remote_topics
        return {
            k: v for k, v in self.r.links.wants(self.src).items()
            if k[0] not in conflicted and k[1] < remote.get(k[0], 0)
        }  # fmt: skip

    async def stream_loop(self) -> None:
        backoff = BACKOFF_MIN_S
        with contextlib.suppress(TimeoutError):
            # The first stream should already carry the upstream's topics.
            await asyncio.wait_for(self._topics_synced.wait(), TOPIC_SYNC_S * 2)
        while True:
            if not self.enabled.is_set():
                self.stats.last_error = DISABLED
                self.r.links.link_down(self.src, self.r.now_ms(), DISABLED)
                log.warning("link %s -> %s %s", self.src, self.r.site, DISABLED)
                await self.enabled.wait()
                log.info("link %s -> %s healed by an operator", self.src, self.r.site)
            try:
                await self.stream_once()
                backoff = BACKOFF_MIN_S
            except LinkDisabled:
                continue
            except Reopen as exc:
                self.stats.reopens += 1
                log.info("reopening the stream from %s: %s", self.src, exc)
                backoff = BACKOFF_MIN_S
            except (grpc.aio.AioRpcError, BrokerError, TimeoutError) as exc:
                if isinstance(exc, grpc.aio.AioRpcError):
                    error = f"{exc.code().name}: {exc.details()}"
                elif isinstance(exc, BrokerError):
                    error = f"{exc.code.name}: {exc.message}"
                else:
                    error = f"no message from {self.src} for {STREAM_IDLE_S:g}s"
                if self.r.links.links[self.src].state is not LinkState.DOWN:
                    log.warning("link %s -> %s down: %s", self.src, self.r.site, error)
                self.stats.last_error = error
                self.r.links.link_down(self.src, self.r.now_ms(), error)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def stream_once(self) -> None:
        """One ``Replicate`` stream; returns when the wants change, raises ``Reopen`` or an RPC error."""
        wants = self.wants()
        request = pb.ReplicateRequest(dst_site=self.r.site, max_bytes=STREAM_MAX_BYTES, max_wait_ms=HEARTBEAT_MS)
        for (topic, index), sites in sorted(wants.items()):
            have = pull_have(self.r.broker.partition(topic, index).log.vector(), self.r.broker.origin)
            request.wants.append(
                pb.PullWant(topic=topic, partition=index, have=vector_to_proto(VectorOffset(have)),
                            origin_sites=list(sites))  # fmt: skip
            )
        call = self.stub.Replicate(request)
        reader = asyncio.create_task(self._read(call))
        try:
            while not reader.done():
                await asyncio.wait([reader], timeout=WANTS_CHECK_S)
                if not self.enabled.is_set():
                    raise LinkDisabled()
                if not reader.done() and self.wants() != wants:
                    log.info("wants from %s changed: reopening the stream", self.src)
                    return
            reader.result()
        finally:
            call.cancel()
            if not reader.done():
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                    await reader

    async def _read(self, call: grpc.aio.UnaryStreamCall) -> None:  # type: ignore[type-arg]
        r = self.r
        first = True
        while True:
            resp = await asyncio.wait_for(call.read(), STREAM_IDLE_S)
            if resp is grpc.aio.EOF:
                raise Reopen(f"site {self.src} ended the stream")
            assert isinstance(resp, pb.ReplicateResponse)
            now = r.now_ms()
            if first:
                # src may have restarted and forgotten what we hold: report everything again.
                self.held_sent_version = 0
                self.held_changed.set()
                r.links.link_up(self.src, now)
                self.stats.last_error = ""
                log.info("link %s -> %s streaming", self.src, r.site)
                first = False
            for chunk in resp.chunks:
                await self._apply(chunk, now)

    async def _apply(self, chunk: pb.ReplicaChunk, now: int) -> None:
        r = self.r
        key = (chunk.topic, chunk.partition)
        try:
            src_vector = vector_from_proto(chunk.src_vector).to_dict()
        except InvalidVectorOffset as exc:
            raise BrokerError(grpc.StatusCode.INVALID_ARGUMENT, f"site {self.src} sent a bad vector: {exc}") from None
        r.links.upstream_vector(self.src, key, src_vector)
        if not chunk.batches:
            return
        outcome = await r.broker.append_replica(chunk.topic, chunk.partition, chunk.batches)
        st = self.stats
        st.applied_batches += outcome.appended_batches
        st.applied_bytes += outcome.appended_bytes
        st.applied_records += outcome.appended_records
        st.skipped_batches += outcome.skipped_batches
        for origin, lag_ms in outcome.lag_ms_by_origin.items():
            r.lag_ms[(chunk.topic, chunk.partition, origin)] = lag_ms
        r.links.local_vector(key, r.broker.partition(chunk.topic, chunk.partition).log.vector())
        if outcome.gap is not None:
            st.gaps += 1
            raise Reopen(outcome.gap.message())
        if outcome.overlaps:
            st.last_error = outcome.overlaps[0].message()
            log.error("%s", st.last_error)
            raise Reopen(st.last_error)


class Replicator:
    """Every inbound link of this node's site, the ``LinkManager`` that routes them, and their status."""

    def __init__(
        self,
        broker: Broker,
        topology: Topology,
        site: str,
        stall_ms: int,
        clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
    ) -> None:
        self.broker = broker
        self.topology = topology
        self.site = topology.site(site).id
        self.links = LinkManager(topology, site, stall_ms)
        self.now_ms = clock_ms
        self.conflicts: dict[tuple[str, SiteId], str] = {}
        # (topic, partition, origin) -> replication delay of the last batch applied
        self.lag_ms: dict[tuple[str, int, Origin], int] = {}
        self.pullers = {
            link.src: Puller(self, link.src, topology.site(link.src).nodes[0])
            for link in topology.links_sorted()
            if link.dst == self.site
        }
        self._tasks: list[asyncio.Task[None]] = []
        for name, spec in sorted(broker.metadata.topics().items()):
            self.links.topic(name, spec.partitions)
        broker.on_topic = self.links.topic
        broker.on_held = self._held_changed
        broker.geo_reach = lambda topic: len(expected_sites(topology, self.site, topic))

    def _held_changed(self) -> None:
        for puller in self.pullers.values():
            puller.held_changed.set()

    def set_link(self, src: str, enabled: bool) -> str:
        """Cut or heal the inbound link ``src -> site``; returns its state. Raises KeyError if there is none."""
        puller = self.pullers[SiteId(src)]
        if enabled:
            puller.enabled.set()
        else:
            puller.enabled.clear()
            self.links.link_down(puller.src, self.now_ms(), DISABLED)
        return self.link_state(puller.src)

    def start(self) -> None:
        for puller in self.pullers.values():
            self._tasks.append(asyncio.create_task(puller.topics_loop()))
            self._tasks.append(asyncio.create_task(puller.stream_loop()))
            self._tasks.append(asyncio.create_task(puller.report_loop()))
        self._tasks.append(asyncio.create_task(self._tick_loop()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for puller in self.pullers.values():
            await puller.close()

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            for key, p in sorted(self.broker.partitions.items()):
                self.links.local_vector(key, p.log.vector())
            self.links.tick(self.now_ms())

    def behind_upstreams(self, key: PartitionKey) -> bool:
        """Whether a streaming upstream holds records of ``key`` that this site lacks."""
        local = self.broker.partition(*key).log.vector()
        for link in self.links.links.values():
            if link.state is LinkState.STREAMING:
                upstream = link.vectors.get(key, {})
                if any(seq > local.get(origin, 0) for origin, seq in upstream.items()):
                    return True
        return False

    # -- status ---------------------------------------------------------------

    def link_state(self, src: SiteId) -> str:
        state = self.links.links[src].state
        if state is LinkState.STREAMING and any(s == src for (s, _o) in self.links.stalled):
            return "stalled"
        return str(state)

    def bytes_per_record(self, topic: str, index: int) -> float:
        """Mean stored bytes per record of a partition: turns a lag in records into an estimate in bytes."""
        plog = self.broker.partition(topic, index).log
        records = plog.log_end_offset - plog.log_start_offset
        return plog.size_bytes / records if records > 0 else 0.0

    def status(self) -> pb.SiteStatusResponse:
        identity = self.broker.identity
        out = pb.SiteStatusResponse(site=identity.site, epoch=identity.epoch)
        for (topic, index), p in sorted(self.broker.partitions.items()):
            vector = p.log.vector()
            ps = pb.PartitionStatus(topic=topic, partition=index, vector=vector_to_proto(VectorOffset(vector)),
                                    log_end_offset=p.log.log_end_offset)  # fmt: skip
            lag = self.links.lag_records((topic, index))
            per_record = self.bytes_per_record(topic, index)
            for origin in sorted(set(vector) | set(lag)):
                upstream = "" if origin == self.broker.origin else self.links.upstream_for(topic, origin.site) or ""
                ps.lags.append(
                    pb.OriginLag(origin=str(origin), upstream=upstream, lag_records=lag.get(origin, 0),
                                 lag_ms=self.lag_ms.get((topic, index, origin), 0),
                                 lag_bytes=round(lag.get(origin, 0) * per_record))  # fmt: skip
                )
            out.partitions.append(ps)
        for src, puller in sorted(self.pullers.items()):
            st = puller.stats
            out.links.append(
                pb.LinkStatus(
                    src=src, dst=self.site, state=self.link_state(src), applied_batches=st.applied_batches,
                    applied_bytes=st.applied_bytes, skipped_batches=st.skipped_batches,
                    last_error=st.last_error or self.links.links[src].last_error,
                )  # fmt: skip
            )
        for (topic, _src), message in sorted(self.conflicts.items()):
            out.conflicts.append(pb.TopicConflict(topic=topic, message=message))
        return out
