"""The node's replication shell: one puller per inbound link, around the pure core.

For each link ``src -> me`` of the topology, a :class:`Puller` runs three tasks:

* **stream**: it drives a :class:`~georep.replication.session.PullSession`
  (every decision: when to open, reopen or give up on a ``Replicate``
  stream, with what wants and have-vectors, what to do with each chunk, lost
  tails, stalls) with grpc.aio: it opens the calls the session asks for,
  reads their messages into a small queue (so HTTP/2 flow control still
  pushes back), applies each message's chunks with ``Broker.append_replica``
  in one writer-thread hop, and feeds the outcomes back;
* **topics**: every ``TOPIC_SYNC_S`` it lists ``src``'s topics and carries
  out ``plan_topic_sync``: creates here the ones the link carries, reports
  conflicts (``SiteStatus.conflicts``, ``georep_topic_conflicts``); and it
  keeps ``src``'s newer ACL records (``georep/security/acl_pull.py``);
* **held reports**: it sends ``src`` what this site, and every site it heard
  from, holds fsynced (``offsets.held.HeldReporter``), for ``acks=geo:N``.

And one **repair** task for the site: every ``REPAIR_TICK_S`` it asks the
``RepairQueue`` (``georep/broker/repair.py``) which quarantined batch to ask
which peer for, fetches it with ``FetchBatch`` and hands it to the storage
layer, which checks it and writes it in place.

:class:`Replicator` owns the ``LinkManager``, the pullers and the ``tick``
task, and answers ``SiteStatus``. Every core call happens on the event loop
thread, so nothing needs a lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence

import grpc

from georep.auth.acl_replication import HeldClaimCheck, OriginCheck
from georep.broker.errors import BrokerError
from georep.broker.repair import Ask, RepairQueue
from georep.client.connection import CHANNEL_OPTIONS
from georep.metadata.store import TopicExists
from georep.metadata.topic_entry import TopicEntry, merge
from georep.metadata.topics import TOPIC_CONFIG_KEYS, InvalidTopic, TopicSpec
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.proto.convert import vector_from_proto, vector_to_proto
from georep.proto.topic_entry import entry_from_pb
from georep.replication import wire
from georep.replication.links import LinkManager, LinkState, PartitionKey
from georep.replication.session import DISABLED, ApplyChunks, Effect, LinkEvent, OpenStream, PullConfig, PullSession
from georep.replication.session import PullStats as LinkStats
from georep.replication.sink import CorruptChunk
from georep.replication.source import Chunk
from georep.replication.topics import RemoteTopic, plan_topic_sync
from georep.replication.upstream import UpstreamNodes, pullable
from georep.security.acl_pull import pull_acls
from georep.security.tls import MESSAGE_BYTES_MAX, TlsConfig, client_channel
from georep.server.broker import Broker, Partition, ReplicaApply
from georep.server.first_sync import FirstSyncs
from georep.server.incarnation_guard import ChunkGuard
from georep.server.interest_links import InterestLinks
from georep.server.topic_changes import TopicChanges
from georep.server.topic_creation import create_topics
from georep.storage import segment_log
from georep.storage.api import DamagedBatch, DiskFull, RepairRefused
from offsets.coordinates import Origin
from offsets.held import HeldReporter
from offsets.vector import InvalidVectorOffset, VectorOffset
from topology.ids import SiteId
from topology.model import Topology
from topology.reach import expected_sites

log = logging.getLogger(__name__)

TOPIC_SYNC_S = 1.0
SYNC_PAGE_TOPICS = 1_000  # topic definitions per ListTopics answer in a topic sync
SYNC_PAGES_MAX = 1_000
TICK_S = 0.2
BACKOFF_MIN_MS = 100
BACKOFF_MAX_MS = 2_000
STREAM_MAX_BYTES = 1 << 20
HEARTBEAT_MS = 500
RPC_TIMEOUT_S = 5.0
# A stream that delivers nothing, not even a heartbeat, for this long is dead
# (a peer that vanished without closing its TCP connection).
STREAM_IDLE_MS = 10 * HEARTBEAT_MS
REPAIR_TICK_S = 0.5
LAG_MS_MAX = 1 << 53  # a lag a float (Prometheus) holds exactly: about 285,000 years
INBOX_MESSAGES = 2  # read ahead of the applies by this many messages, no more: back-pressure
# Long fat pipes. src pushes a Replicate stream as fast as dst's HTTP/2 window lets it: at most one window per round
# trip. gRPC's BDP probing starts every connection at a 64 KiB window and grows it over many round trips, so a
# fresh link at 200 ms RTT spent seconds of a catch-up below its bandwidth (bench/replication.py --only rtt). The
# pull channel instead announces a fixed window of LINK_WINDOW_BYTES from the first byte: enough for
# LINK_WINDOW_BYTES / RTT (160 MB/s at 200 ms, more than a node applies). It is also what dst may hold unread per
# link when its applies fall behind (the inbox above stops reading; gRPC buffers up to the window). Only this
# channel: clients' fetch streams keep BDP probing and small windows.
LINK_WINDOW_BYTES = 64 << 20
PULL_CHANNEL_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", LINK_WINDOW_BYTES),
]
_END = "end"


def _buried(held: TopicEntry | None, received: TopicEntry | None) -> bool:
    """Whether ``received``, a live entry of a name this site does not hold live, is of an incarnation this site
    holds deleted: then it is no create (a peer that has not applied the delete yet would resurrect the topic as
    the next incarnation here); the tombstone reaches that peer instead. A peer from before entries sends none:
    incarnation 0."""
    if held is None or not held.deleted:
        return False
    return received is None or merge(held, received).entry == held


class Puller:
    """The inbound link ``src -> site``: its pull session, topic sync and held reports."""

    def __init__(self, replicator: Replicator, src: SiteId, addresses: tuple[str, ...]) -> None:
        self.r = replicator
        self.src = src
        # Every node of src: a node of a multi-node site serves the whole site (it passes on the pulls of the
        # partitions other nodes lead), so the session moves its streams to the next node when one fails
        # (georep/replication/upstream.py); the topic listings and held reports follow it there.
        self.nodes = UpstreamNodes(addresses)
        self.address = self.nodes.current
        broker = replicator.broker
        self.session = PullSession(
            src,
            replicator.links,
            broker.origin,
            lambda key: broker.partition(*key).log.vector(),
            itertools.count(1),
            PullConfig(STREAM_IDLE_MS, BACKOFF_MIN_MS, BACKOFF_MAX_MS),
            usable=self._usable,
            nodes=self.nodes,
            usable_basis=self._usable_basis,
        )
        # Only the claims src takes: about sites its records reach through this one (held_claim_refusal).
        claims = HeldClaimCheck(replicator.topology, src)
        self.reporter = HeldReporter(src, lambda key: claims.refusal(replicator.site, key[0], key[1]) is None)
        self._refused_report = ""  # src's last refusal of a report, logged once
        # src may not know what this site holds: before the first stream, and after a stream failed or src ended
        # it (it may have restarted). A stream reopened on purpose (its wants changed, a gap, a lost tail) was
        # live up to then, so src still knows what it was told: its "up" resends nothing.
        self._src_may_forget = True
        self._channel: grpc.aio.Channel | None = None
        self._stub: pbg.NodeAsyncStub | None = None
        self._topics_synced = asyncio.Event()
        # The upstream's topics as learnt from its catalog (topic sync), and their partition counts:
        # a want for a topic it does not have (yet) would fail the whole stream.
        self._remote: dict[str, RemoteTopic] = {}
        self.remote_topics: dict[str, int] = {}
        self._catalog_token = ""  # where the last sync left this puller in src's catalog ("": from the start)
        self._listed_whole = False  # the last listing reached the end of src's catalog (not cut at SYNC_PAGES_MAX)
        self._acl_token = ""  # src's ACL table as this site last kept all of it ("": list it all)
        self._local_planned: int | None = None  # this site's topics_version when the plan was last made
        self.enabled = asyncio.Event()  # mirrors the session's: an operator cut pauses topics and reports too
        self.enabled.set()
        self.held_changed = asyncio.Event()
        # (stream id, message | error text | _END) from the current call's reader, in order
        self._inbox: asyncio.Queue[tuple[int, pb.ReplicateResponse | str]] = asyncio.Queue(INBOX_MESSAGES)
        self._controls: deque[bool] = deque()  # operator cuts and heals, for the stream loop
        self._wake = asyncio.Event()
        self._call: grpc.aio.UnaryStreamCall | None = None  # type: ignore[type-arg]
        self._call_id: int | None = None
        self._reader: asyncio.Task[None] | None = None
        self._last_tick = 0  # when the stream loop last ticked the session
        self.chunks = ChunkGuard(broker.metadata, src)  # each chunk of the incarnation its want asked for

    @property
    def stats(self) -> LinkStats:
        return self.session.stats

    @property
    def stub(self) -> pbg.NodeAsyncStub:
        if self._stub is None:
            self._channel = client_channel(self.address, self.r.tls, PULL_CHANNEL_OPTIONS)
            self._stub = pbg.NodeStub(self._channel)
        return self._stub

    async def close(self) -> None:
        self._end_call()
        if self._channel is not None:
            await self._channel.close(grace=None)

    def _move_to(self, address: str) -> None:
        """Pull from ``address`` from now on (the session moved its streams to another node of src)."""
        log.info(
            "link %s -> %s: pulling from %s's node %s (%s failed)",
            self.src,
            self.r.site,
            self.src,
            address,
            self.address,
        )
        self.address = address
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            # With a grace: the held reports and topic listings in flight on it end by themselves (their own
            # timeout), rather than being cancelled under their tasks, which would end those loops for good.
            task = asyncio.create_task(channel.close(grace=RPC_TIMEOUT_S))
            self.r.background.add(task)
            task.add_done_callback(self.r.background.discard)

    def _usable(self, key: PartitionKey) -> bool:
        # The broker's partitions are the ones this node serves: all of a one-node site's, the ones a node of a
        # multi-node site leads. A topic that a topic sync is still creating waits for the end of its round: it is
        # served a step of about 256 partitions at a time, and each step would change the wants and reopen the
        # stream, asking for every partition, once per step (40 times per link for 10,000 partitions).
        r = self.r
        return (
            pullable(key, self.src, self.remote_topics, r.conflicts, r.broker.partitions) and key[0] not in r.creating
        )

    def _usable_basis(self) -> object:
        """What ``_usable`` answers from, compared by value (O(topics), not O(partitions))."""
        r = self.r
        return (r.broker.partitions_version, tuple(r.conflicts), self.remote_topics, r.created_rounds)

    def tick_soon(self) -> None:
        """What this site wants over the link may have changed (an interest came or went): the stream loop ticks
        the session now rather than at its next TICK_S, so each hop of a new subscription starts pulling at once."""
        self._last_tick = 0
        self._wake.set()

    def set_enabled(self, enabled: bool) -> None:
        """An operator cut or healed the link; the stream loop tells the session."""
        if enabled:
            self.enabled.set()
        else:
            self.enabled.clear()
        self._controls.append(enabled)
        self._wake.set()

    # -- topics ---------------------------------------------------------------

    async def topics_loop(self) -> None:
        while True:
            await self.enabled.wait()
            try:
                await self.sync_topics()
                self._topics_synced.set()
                if self._listed_whole:
                    self.r.first_syncs.record(self.src)
                metadata, in_site = self.r.broker.metadata, self.r.broker.in_site
                pulled = await pull_acls(self.stub, metadata, in_site, self.src, RPC_TIMEOUT_S, self._acl_token)
                self._acl_token = pulled.token
            except grpc.aio.AioRpcError as exc:
                log.debug("listing topics at %s (%s) failed: %s", self.src, self.address, exc.details())
            except Exception:  # a bug must not end topic sync for good, silently: log it, sync again
                log.exception("link %s -> %s: topic sync failed", self.src, self.r.site)
                self._local_planned = None
            await asyncio.sleep(TOPIC_SYNC_S)

    async def sync_topics(self) -> None:
        """One round of topic sync: learn what src's catalog changed (nothing, most rounds), then plan and carry
        out what changed here or there. Raises ``AioRpcError``: the next round asks from where this one got."""
        changed = await self._learn_topics()
        if self.r.broker.metadata.topics_version() != self._local_planned:
            await self._carry_out(list(self._remote.values()))  # this site's changed: any of src's may compare anew
        elif changed:
            await self._carry_out(changed)

    async def _learn_topics(self) -> list[RemoteTopic]:
        """Bring the view of src's topics up to its catalog, a page at a time; the topics learnt. A listing that
        starts over (src restarted, or this puller moved to another of its nodes) replaces the view once whole."""
        learnt: list[RemoteTopic] = []
        fresh: dict[str, RemoteTopic] | None = None
        token = self._catalog_token
        for _ in range(SYNC_PAGES_MAX):
            request = pb.ListTopicsRequest(
                view=pb.TOPIC_VIEW_DEFINITION, page_size=SYNC_PAGE_TOPICS, changed_since=token
            )
            resp = await self.stub.ListTopics(request, timeout=RPC_TIMEOUT_S)
            if resp.restarted or not resp.catalog_token:  # (no token: a node from before catalogs lists all)
                fresh, learnt = {}, []
            if resp.restarted and self._catalog_token:
                # Another process answers (src restarted, or another of its nodes), perhaps between two streams
                # that never failed: it may not know what this site holds.
                self._report_everything()
            page = self._remote_page(resp.topics)
            learnt += page
            token = resp.catalog_token
            if fresh is None:
                self._learnt(page)
                self._catalog_token = token
            else:
                fresh.update((t.name, t) for t in page)
            if not token or not resp.next_page_token:
                self._listed_whole = True
                if fresh is not None:
                    self._remote = {}
                    self._learnt(list(fresh.values()), replace=True)
                    self._catalog_token = token
                return learnt
        self._listed_whole = False
        log.warning("site %s listed over %d pages of topics: the rest next round", self.src, SYNC_PAGES_MAX)
        return learnt if fresh is None else []

    def _remote_page(self, listed: Sequence[pb.TopicDescription]) -> list[RemoteTopic]:
        """src's listed topics with their entries; one whose entry a create here would refuse is left out (and
        reported), not the whole page."""
        page = []
        for t in listed:
            try:
                entry = entry_from_pb(t, TOPIC_CONFIG_KEYS)
            except InvalidTopic as exc:
                self.r.conflicts[(t.name, self.src)] = f"topic {t.name!r} of site {self.src} is not taken: {exc}"
                continue
            # A topic is created from the entry's own overrides (its stored form); from an old peer, from src's
            # effective config, as before entries.
            config = {k: str(v) for k, v in entry.config().items()} if t.HasField("entry") else dict(t.config)
            page.append(RemoteTopic(t.name, entry.partitions, config, entry))
        return page

    def _learnt(self, topics: list[RemoteTopic], replace: bool = False) -> None:
        if not topics and not replace:
            # Most rounds learn nothing: remote_topics stays the same object, so the stream's wants basis
            # (_usable_basis, compared every tick) matches by identity, not by a walk over every topic.
            return
        for t in topics:
            self._remote[t.name] = t
        # A want for a topic src does not have would fail the whole stream: only what it listed.
        self.remote_topics = {name: t.partitions for name, t in self._remote.items()}

    async def _carry_out(self, remote: list[RemoteTopic]) -> None:
        """Create here what ``remote`` holds that the link carries and this site lacks; report and clear
        conflicts. A create that fails is planned again next round."""
        r = self.r
        version = r.broker.metadata.topics_version()  # before the table: a change in between shows next round
        local_specs = r.broker.metadata.topics()
        local = {name: spec.partitions for name, spec in local_specs.items()}
        plan = plan_topic_sync(r.topology.link(self.src, r.site), remote, local, merges=True)
        held = r.broker.metadata.entries()
        plan = dataclasses.replace(plan, create=[t for t in plan.create if not _buried(held.get(t.name), t.entry)])
        names = Counter(t.name for t in plan.create)
        r.creating += names
        r.broker.received_entries.update((t.name, t.entry) for t in plan.create if t.entry is not None)
        try:
            outcomes = await create_topics(
                r.broker, [(t.name, t.partitions, dict(t.config)) for t in plan.create], internal=True
            )
        finally:
            r.creating -= names  # (a Counter keeps no name at zero)
            r.created_rounds += 1 if names else 0
            for t in plan.create:
                r.broker.received_entries.pop(t.name, None)
        await self._merge_entries(remote)
        for t, outcome in zip(plan.create, outcomes, strict=True):
            if isinstance(outcome, TopicSpec):
                log.info("created topic %r (%d partitions) replicated from site %s", t.name, t.partitions, self.src)
                continue
            if isinstance(outcome, (InvalidTopic, DiskFull, BrokerError)):
                r.conflicts[(t.name, self.src)] = (
                    f"topic {t.name!r} of site {self.src} cannot be created at site {r.site}: {outcome}"
                )
            elif not isinstance(outcome, TopicExists):
                log.warning("topic %r of site %s not created here yet: %s", t.name, self.src, outcome)
        for name, message in plan.conflicts.items():
            if r.conflicts.get((name, self.src)) != message:
                log.warning("%s", message)
            r.conflicts[(name, self.src)] = message
        for name in plan.cleared:
            r.conflicts.pop((name, self.src), None)
        # Planned against local_specs; after creates (ours, and whatever else came meanwhile, or a create that
        # failed), the next round plans every topic again, against the table then.
        self._local_planned = None if plan.create else version

    async def _merge_entries(self, remote: list[RemoteTopic]) -> None:
        """Merge src's entries of the topics the link carries into this site's: alters, growths and deletes
        (georep/server/topic_changes.py). Only names held here (a create that failed is tried next round), and
        tombstones; not an entry equal to the one held, which the merge leaves as it is (it is idempotent): a sync
        from the start (a restart) of 100,000 topics merged each again, 1.7 s of a node's event loop, and on a
        multi-node site one Raft command of them all."""
        held = self.r.broker.metadata.entries()
        link = self.r.topology.link(self.src, self.r.site)
        entries = [
            t.entry
            for t in remote
            if t.entry is not None
            and link.carries(t.name)
            and (t.name in held or t.entry.deleted)
            and t.entry != held.get(t.name)
        ]
        if entries:
            await self.r.topic_changes.change(entries)

    # -- held reports -----------------------------------------------------------

    async def report_loop(self) -> None:
        """Tell src what this site, and every site it heard from, holds fsynced (one report at a time)."""
        held = self.r.broker.held
        while True:
            await self.held_changed.wait()
            self.held_changed.clear()
            await self.enabled.wait()
            entries = self.reporter.next_report(held)
            if entries is None:
                continue
            request = pb.ReportHeldRequest(
                reporter=self.r.site,
                entries=[
                    pb.HeldEntry(site=site, topic=topic, partition=index, vector=vector_to_proto(vector))
                    for (site, topic, index), vector in entries
                ],
            )
            try:
                # To one node of src: a node of a multi-node site passes it on to the others (any may lead).
                await self.stub.ReportHeld(request, timeout=RPC_TIMEOUT_S)
                self.reporter.acked()
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.PERMISSION_DENIED and exc.details() != self._refused_report:
                    self._refused_report = exc.details() or ""
                    log.warning("site %s refused this site's held report: %s", self.src, exc.details())
                else:
                    log.debug("reporting held vectors to %s failed: %s", self.src, exc.details())
                self.reporter.failed()
                await asyncio.sleep(BACKOFF_MAX_MS / 1000)
            self.held_changed.set()  # what changed meanwhile goes in the next report

    # -- stream ---------------------------------------------------------------

    async def stream_loop(self) -> None:
        with contextlib.suppress(TimeoutError):
            # The first stream should already carry the upstream's topics.
            # asyncio.timeout, not wait_for: in Python 3.11 wait_for can swallow a cancellation that races with the
            # event, and the stopping node then waits for this loop forever (seen: a stop right after a start).
            async with asyncio.timeout(TOPIC_SYNC_S * 2):
                await self._topics_synced.wait()
        session = self.session
        now = self.r.now_ms
        self._last_tick = now()
        await self._perform(session.start(now()))
        while True:
            try:
                await self._stream_step()
            except Exception as exc:  # a bug must not end the link for good, silently: log it, pull again
                log.exception("link %s -> %s: the pull loop failed", self.src, self.r.site)
                stream_id = session.stream_id
                if stream_id is not None:
                    with contextlib.suppress(Exception):
                        await self._perform(session.on_stream_ended(stream_id, now(), f"{type(exc).__name__}: {exc}"))
                await asyncio.sleep(BACKOFF_MIN_MS / 1000)

    async def _stream_step(self) -> None:
        """One turn of the stream loop: operator controls, the session's tick, then the next message or end."""
        session = self.session
        now = self.r.now_ms
        while self._controls:
            await self._perform(session.set_enabled(self._controls.popleft(), now()))
        if now() - self._last_tick >= TICK_S * 1000:
            self._last_tick = now()
            await self._perform(session.tick(self._last_tick))
        item = await self._next_item(TICK_S)
        if item is None:
            return
        stream_id, what = item
        if isinstance(what, str):
            error = None if what == _END else what
            await self._perform(session.on_stream_ended(stream_id, now(), error))
            return
        try:
            chunks = [self._chunk(c) for c in self.chunks.admit(what.chunks)]
        except InvalidVectorOffset as exc:
            await self._perform(session.on_stream_ended(stream_id, now(), f"site {self.src} sent a bad vector: {exc}"))
            return
        except CorruptChunk as exc:  # a compressed chunk that does not decompress within bounds
            await self._perform(session.on_stream_ended(stream_id, now(), f"site {self.src} sent {exc}"))
            return
        heartbeat = not any(c.batches for c in chunks)
        await self._perform(session.on_message(stream_id, chunks, heartbeat, now()))

    async def _next_item(self, timeout_s: float) -> tuple[int, pb.ReplicateResponse | str] | None:
        get = asyncio.ensure_future(self._inbox.get())
        wake = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait([get, wake], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            wake.cancel()
            self._wake.clear()
            if not get.done():
                get.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await get
        return get.result() if get.done() and not get.cancelled() else None

    def _chunk(self, c: pb.ReplicaChunk) -> Chunk:
        vector: dict[Origin, int] = dict(vector_from_proto(c.src_vector).to_dict())
        if self.r.origins is not None:  # a TLS node: src's word counts only for origins that can reach it
            vector = self.r.origins.plausible(self.src, c.topic, vector)
        return Chunk(
            (c.topic, c.partition),
            wire.unpack(c.batches, c.batches_zstd, MESSAGE_BYTES_MAX),
            vector,
            c.src_log_end_offset,
        )

    async def _perform(self, effects: list[Effect]) -> None:
        session = self.session
        queue = deque(effects)
        while queue:
            effect = queue.popleft()
            if isinstance(effect, OpenStream):
                self._open_call(effect)
            elif isinstance(effect, ApplyChunks):
                queue.extend(await self._apply(effect))
            elif isinstance(effect, LinkEvent):
                self._log(effect)
        if self._call_id != session.stream_id:
            self._end_call()  # the session left the stream (a failure, or an operator cut)

    async def _apply(self, effect: ApplyChunks) -> list[Effect]:
        """A message's chunks, in one writer-thread hop (``Broker.append_replica``); then each outcome, in order,
        to the session, and the stream ended at the first chunk that could not be applied."""
        r = self.r
        chunks: list[tuple[str, int, bytes]] = []
        why = ""
        for chunk in effect.chunks:
            topic, index = chunk.key
            if not self.chunks.still_live(topic):
                why = f"topic {topic!r} changed incarnation (deleted, or re-created) while a chunk of it waited"
                break
            if r.origins is not None:  # a TLS node: a batch claiming an origin src cannot have is refused
                try:
                    r.origins.check(self.src, topic, chunk.batches)
                except (CorruptChunk, BrokerError) as exc:  # ForgedOrigin, or a chunk it cannot frame
                    why = f"{type(exc).__name__}: {exc}"
                    break
            chunks.append((topic, index, chunk.batches))
        applied = await r.broker.append_replica(chunks) if chunks else ReplicaApply([])
        out: list[Effect] = []
        for chunk, outcome in zip(effect.chunks, applied.outcomes, strict=False):
            topic, index = chunk.key
            for origin, lag_ms in outcome.lag_ms_by_origin.items():
                # A producer's timestamp is its claim: bounded so that no stored timestamp breaks status or metrics.
                r.lag_ms[(topic, index, origin)] = min(max(lag_ms, 0), LAG_MS_MAX)
            out += self.session.on_applied(effect.stream_id, chunk.key, outcome, r.now_ms())
        if applied.error is not None:
            why = f"{type(applied.error).__name__}: {applied.error}"
        if why:
            out += self.session.on_stream_ended(effect.stream_id, r.now_ms(), why)
        return out

    def _log(self, event: LinkEvent) -> None:
        if event.kind == "up":
            if self._src_may_forget:
                self._report_everything()
            log.info("%s", event.text)
        elif event.kind in ("down", "timeout", "disabled"):
            self._src_may_forget = True
            log.warning("%s", event.text)
        elif event.kind == "diverged":
            log.error("%s", event.text)
        else:
            self._src_may_forget = self._src_may_forget or event.kind == "ended"
            log.info("%s", event.text)

    def _report_everything(self) -> None:
        """src may have restarted and forgotten what this site holds: the next report carries every entry.

        Not at every stream: at 10,000 written partitions a report of everything is 20,000 entries or more, and a
        link reopens its stream on purpose whenever its wants change (a topic created, a stall)."""
        self._src_may_forget = False
        self.reporter.reset()
        self.held_changed.set()

    def _open_call(self, effect: OpenStream) -> None:
        self._end_call()
        if effect.address and effect.address != self.address:
            self._move_to(effect.address)
        request = pb.ReplicateRequest(
            dst_site=self.r.site, max_bytes=STREAM_MAX_BYTES, max_wait_ms=HEARTBEAT_MS, accept_zstd=True
        )
        for (topic, index), (have, sites) in effect.wants.items():
            request.wants.append(
                pb.PullWant(
                    topic=topic,
                    partition=index,
                    have=vector_to_proto(VectorOffset(have)),
                    origin_sites=list(sites),
                    incarnation=self.chunks.want_incarnation(topic),
                )
            )
        call = self.stub.Replicate(request)
        self._call, self._call_id = call, effect.stream_id
        self._reader = asyncio.create_task(self._read(effect.stream_id, call))

    def _end_call(self) -> None:
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None:
            self._reader.cancel()
        self._call = self._reader = self._call_id = None
        while not self._inbox.empty():  # what the left stream had queued
            self._inbox.get_nowait()

    async def _read(self, stream_id: int, call: grpc.aio.UnaryStreamCall) -> None:  # type: ignore[type-arg]
        try:
            while True:
                resp = await call.read()
                if resp is grpc.aio.EOF:
                    await self._inbox.put((stream_id, _END))
                    return
                assert isinstance(resp, pb.ReplicateResponse)
                await self._inbox.put((stream_id, resp))
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                await self._inbox.put((stream_id, f"{exc.code().name}: {exc.details()}"))


class Replicator:
    """Every inbound link of this node's site, the ``LinkManager`` that routes them, and their status."""

    def __init__(
        self,
        broker: Broker,
        topology: Topology,
        site: str,
        stall_ms: int,
        clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
        tls: TlsConfig | None = None,
    ) -> None:
        self.broker = broker
        self.tls = tls  # the node's own certificate: it pulls as site:<s> (or node:<s>/<n>)
        self.origins = OriginCheck(topology, site) if tls is not None else None
        self.topology = topology
        self.site = topology.site(site).id
        self.links = LinkManager(topology, site, stall_ms)
        self.now_ms = clock_ms
        self.conflicts: dict[tuple[str, SiteId], str] = {}
        self.topic_changes = TopicChanges(broker)  # alters, growths and the syncs' merges of topic entries
        # Topics that topic syncs are creating now (a count per name: two links may carry the same topic): the
        # links pull them once their round has ended (Puller._usable), and each round's end moves the wants' basis.
        self.creating: Counter[str] = Counter()
        self.created_rounds = 0
        # (topic, partition, origin) -> replication delay of the last batch applied
        self.lag_ms: dict[tuple[str, int, Origin], int] = {}
        self.pullers = {
            link.src: Puller(self, link.src, topology.site(link.src).nodes)
            for link in topology.links_sorted()
            if link.dst == self.site
        }
        self.interest_links = InterestLinks(self)  # links in mode "interest": what this site reads, and adverts
        # The upstreams this data dir has synced its topic catalog with once: user creates wait for all of them.
        self.first_syncs = FirstSyncs(broker.data_dir, self.pullers)
        self.background: set[asyncio.Task[None]] = set()
        self._tasks: list[asyncio.Task[None]] = []
        upstreams = sorted(self.pullers)
        others = [s for s in topology.site_ids() if s != self.site and s not in self.pullers]
        self.repairs = RepairQueue([*upstreams, *others])
        self._peer_channels: dict[str, grpc.aio.Channel] = {}
        self._damaged_basis: tuple[int, int] | None = None  # see damaged()
        self._damaged: dict[PartitionKey, list[DamagedBatch]] = {}
        # Partitions whose durable state moved since the last tick (their watchers add them; partition_opened).
        self._moved: set[PartitionKey] = set()
        self._topics_fed: int | None = None  # the metadata's topics_version the links were last fed (tick)
        for name, spec in sorted(broker.metadata.topics().items()):
            self.links.topic(name, spec.partitions)
        broker.on_topic = self.links.topic
        broker.on_held = self._held_changed
        broker.geo_reach = lambda topic: len(expected_sites(topology, self.site, topic, through_interest=False))

    def _held_changed(self) -> None:
        for puller in self.pullers.values():
            puller.held_changed.set()

    def set_link(self, src: str, enabled: bool) -> str:
        """Cut or heal the inbound link ``src -> site``; returns its state. Raises KeyError if there is none."""
        puller = self.pullers[SiteId(src)]
        puller.set_enabled(enabled)
        if not enabled:  # at once, so the answer says "down"; the session confirms it
            self.links.link_down(puller.src, self.now_ms(), DISABLED)
        return self.link_state(puller.src)

    def start(self) -> None:
        for puller in self.pullers.values():
            self._tasks.append(asyncio.create_task(puller.topics_loop()))
            self._tasks.append(asyncio.create_task(puller.stream_loop()))
            self._tasks.append(asyncio.create_task(puller.report_loop()))
        self._tasks.append(asyncio.create_task(self._tick_loop()))
        self._tasks.append(asyncio.create_task(self._repair_loop()))
        if self.interest_links.upstreams:
            self._tasks.append(asyncio.create_task(self.interest_links.report_loop()))
            self._tasks.append(asyncio.create_task(self.interest_links.watch_loop()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for puller in self.pullers.values():
            await puller.close()
        for channel in self._peer_channels.values():
            await channel.close()
        await asyncio.gather(*self.background, return_exceptions=True)

    async def _repair_loop(self) -> None:
        while True:
            await asyncio.sleep(REPAIR_TICK_S)
            asks = self.repairs.due(self.damaged(), self.now_ms())
            if asks:
                await asyncio.gather(*(self._repair(ask) for ask in asks))

    def damaged(self) -> dict[PartitionKey, list[DamagedBatch]]:
        """The quarantined batches of the partitions this node serves, walked for (``Broker.damaged``, O(partitions))
        only after some partition log's quarantine list changed (``segment_log.quarantine_changes``: every change
        is written through one place), or the set of served partitions did. The count is read before the walk, so
        a change during it shows at the next call."""
        basis = (segment_log.quarantine_changes[0], self.broker.partitions_version)
        if basis != self._damaged_basis:
            self._damaged_basis, self._damaged = basis, self.broker.damaged()
        return self._damaged

    async def _repair(self, ask: Ask) -> None:
        (topic, index), d = ask.key, ask.damaged
        request = pb.FetchBatchRequest(
            topic=topic,
            partition=index,
            origin_site=d.origin.site,
            origin_epoch=d.origin.epoch,
            origin_seq=d.base_origin_seq,
        )
        try:
            stub = pbg.NodeStub(self._peer_channel(ask.peer))
            response = await stub.FetchBatch(request, timeout=RPC_TIMEOUT_S)
            await self.broker.repair(topic, index, d.base_offset, response.batch)
        except grpc.RpcError as exc:
            self.repairs.failed(ask, f"{exc.code().name}: {exc.details()}", self.now_ms())
            log.info(
                "repair of %s/%d %s: site %s could not help (%s)", topic, index, d.describe(), ask.peer, exc.details()
            )
        except (RepairRefused, OSError) as exc:
            self.repairs.failed(ask, str(exc), self.now_ms())
            log.warning("repair of %s/%d %s from site %s refused: %s", topic, index, d.describe(), ask.peer, exc)
        else:
            self.repairs.repaired(ask)
            log.warning("repaired %s/%d %s with site %s's copy", topic, index, d.describe(), ask.peer)

    def _peer_channel(self, site: str) -> grpc.aio.Channel:
        channel = self._peer_channels.get(site)
        if channel is None:
            address = self.topology.site(SiteId(site)).nodes[0]
            channel = self._peer_channels[site] = client_channel(address, self.tls, CHANNEL_OPTIONS)
        return channel

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self.tick()

    def tick(self) -> None:
        """Feed the links the vectors of the partitions that moved since the last tick, then tick them (stalls)."""
        if self.broker.in_site:  # topics other nodes of a multi-node site created, through Raft
            version = self.broker.metadata.topics_version()  # before the table: a change in between shows next tick
            if version != self._topics_fed:  # an idle site does not copy and walk every topic 5 times a second
                topics = self.broker.metadata.topics()
                for name, spec in sorted(topics.items()):
                    self.links.topic(name, spec.partitions)
                self.topic_changes.follow(topics)  # a config changed through Raft: the partitions led here take it
                self._topics_fed = version
        moved = sorted(self._moved)
        self._moved.clear()  # in place: the partitions' watchers hold this set's add
        for key in moved:  # only what moved since the last tick: idle partitions cost nothing here
            p = self.broker.partitions.get(key)
            if p is not None:
                self.links.local_vector(key, p.log.vector())
        self.links.tick(self.now_ms())
        self.interest_links.tick(time.monotonic())

    def partition_opened(self, p: Partition) -> None:
        """A partition this node now serves: its vector goes to the links now, and again whenever it moves."""
        p.durable_watchers.add(self._moved.add)
        self._moved.add(p.key)

    async def upstream_vectors(self, key: PartitionKey, timeout_s: float) -> list[Mapping[Origin, int] | None]:
        """What each streaming upstream holds of ``key`` now, asked afresh (a read barrier for FetchCommitted);
        ``None`` for an upstream that did not answer within ``timeout_s``.

        The vectors that chunks and heartbeats carry can be a heartbeat old: a commit a peer acknowledged a
        moment ago may not show in them yet, and a consumer starting from the older commit would read committed
        records again. So an upstream that streams but does not answer (frozen, or starved under load) is not
        counted with what it last sent: the caller cannot know this site is not behind it, and says so.
        """
        streaming = [src for src, link in sorted(self.links.links.items()) if link.state is LinkState.STREAMING]

        async def ask(src: SiteId) -> Mapping[Origin, int] | None:
            try:
                desc = await self.pullers[src].stub.DescribeTopic(
                    pb.DescribeTopicRequest(name=key[0]), timeout=timeout_s
                )
            except grpc.RpcError as exc:
                # An upstream without the topic holds none of its records; any other failure tells nothing.
                return {} if exc.code() is grpc.StatusCode.NOT_FOUND else None
            for ps in desc.partition_states:
                if ps.partition == key[1]:
                    try:
                        return vector_from_proto(ps.vector).to_dict()
                    except InvalidVectorOffset:
                        return None
            return {}  # the upstream has no such partition (yet): it holds nothing of it

        return list(await asyncio.gather(*(ask(src) for src in streaming)))

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
