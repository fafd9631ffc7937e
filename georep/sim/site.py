"""One simulated site: its logs (``MemoryLog``), and the same pure objects a node builds at startup.

What survives a crash is the logs' flushed part (``MemoryLog.crash``).
Everything else is rebuilt by :meth:`SimSite.boot`, as a node rebuilds it
when it starts: the ``LinkManager``, a ``PullSession`` (with the choice of the
upstream's node to pull from, ``UpstreamNodes``, and of the partitions to ask
for, ``pullable``) and a ``HeldReporter`` per inbound link, the ``AckTable`` (opened with each log's flushed offset and
vector), the idempotent producers' ``ProducerStateTable`` (from each log's
batch index), the ``CommitLog`` (refolded from the internal topic's logs) and
an empty ``GroupCoordinator``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from cluster.groups import GroupCoordinator
from dedup.producer import ProducerStateTable
from georep.auth.acl_replication import HeldClaimCheck
from georep.broker.acks import AckTable
from georep.broker.commits import CommitLog
from georep.replication.links import LinkManager, PartitionKey
from georep.replication.session import PullConfig, PullSession
from georep.replication.source import ReplicaSource
from georep.replication.upstream import UpstreamNodes, pullable
from georep.storage.memory_log import MemoryLog
from offsets.coordinates import Origin
from offsets.held import HeldReporter
from offsets.vector import VectorOffset
from topology.filters import is_internal
from topology.ids import SiteId
from topology.model import Topology


@dataclass(slots=True)
class OutStream:
    """At src: the stream serving one downstream."""

    stream_id: int
    source: ReplicaSource
    node: str  # the node of this site that dst opened it at
    pump_due_ms: int = -1  # when the next pump is scheduled; -1 for none


@dataclass(slots=True)
class SimSite:
    id: SiteId
    origin: Origin
    skew_ms: int
    flush_ms: int  # the periodic flush of topics with a flush interval
    fsync_ms: int  # how long one fsync takes
    inbound: tuple[SiteId, ...]  # srcs of the links into this site
    logs: dict[PartitionKey, MemoryLog]
    up: bool = True
    incarnation: int = 0  # bumped by each crash: timers and connections of an older one do nothing
    rebuilds: int = 0  # crashes that also lost the disk
    # -- rebuilt by boot() ------------------------------------------------------------
    links: LinkManager = field(init=False)
    sessions: dict[SiteId, PullSession] = field(default_factory=dict)
    upstreams: dict[SiteId, UpstreamNodes] = field(default_factory=dict)  # per inbound link: the node pulled from
    reporters: dict[SiteId, HeldReporter] = field(default_factory=dict)
    report_ids: dict[SiteId, int] = field(default_factory=dict)  # upstream -> id of the report in flight
    report_sent_ms: dict[SiteId, int] = field(default_factory=dict)  # upstream -> when it was sent
    out_streams: dict[SiteId, OutStream] = field(default_factory=dict)
    acks: AckTable = field(init=False)
    producers: dict[PartitionKey, ProducerStateTable] = field(default_factory=dict)
    commits: CommitLog = field(default_factory=CommitLog)
    coordinator: GroupCoordinator = field(init=False)
    # What to do when the ack table releases or fails a token: called with None or the error.
    waiters: dict[object, Callable[[Exception | None], None]] = field(default_factory=dict)
    # I5 bookkeeping of the simulated consumers: per consumer, the index of the commit this site's
    # table returned last, and at the last flush of the consumer's internal partition.
    winners: dict[int, int] = field(default_factory=dict)
    durable_winners: dict[int, int] = field(default_factory=dict)
    # Partitions whose log changed since the last tick: the tick feeds only their vectors to the links, as a node's.
    moved: set[PartitionKey] = field(default_factory=set)

    def boot(
        self,
        topology: Topology,
        topics: Mapping[str, int],
        fsync_per_batch: Mapping[str, bool],
        stall_ms: int,
        pull: PullConfig,
        stream_ids: itertools.count[int],
        now_ms: int,
        new_member_id: Callable[[str], str],
        nodes: Mapping[SiteId, tuple[str, ...]],
    ) -> None:
        """Build everything a node builds at startup from what its logs hold; ``nodes``: every site's nodes."""
        links = self.links = LinkManager(topology, self.id, stall_ms)
        for topic, partitions in topics.items():
            links.topic(topic, partitions)
        for key, log in self.logs.items():
            links.local_vector(key, log.vector())
        logs = self.logs
        self.upstreams = {src: UpstreamNodes(nodes[src]) for src in self.inbound}
        # Every simulated site has every topic from the start and no conflict: every partition is pullable.
        self.sessions = {
            src: PullSession(
                src,
                links,
                self.origin,
                lambda key: logs[key].vector(),
                stream_ids,
                pull,
                usable=_pullable_from(src, topics, logs),
                nodes=self.upstreams[src],
            )
            for src in self.inbound
        }
        self.reporters = {src: _reporter(topology, src, self.id) for src in self.inbound}
        self.report_ids = {}
        self.report_sent_ms = {}
        self.out_streams = {}
        self.acks = AckTable(self.id, self.origin)
        for key, log in sorted(logs.items()):
            flushed = VectorOffset(log.flushed_vector())
            self.acks.open_partition(key, fsync_per_batch[key[0]], log.flushed_offset, flushed)
        self.producers = {
            key: ProducerStateTable.rebuild(log.batch_entries(), now_ms=now_ms, origin=self.origin)
            for key, log in logs.items()
        }
        self.commits = CommitLog(self.commits.decode)
        counts = {t: n for t, n in topics.items() if not is_internal(t)}
        self.coordinator = GroupCoordinator(lambda topic: counts.get(topic, 0), new_member_id)
        self.waiters = {}


def _pullable_from(
    src: SiteId, topics: Mapping[str, int], logs: Mapping[PartitionKey, MemoryLog]
) -> Callable[[PartitionKey], bool]:
    return lambda key: pullable(key, src, topics, (), logs)


def _reporter(topology: Topology, upstream: SiteId, me: SiteId) -> HeldReporter:
    """The node's reporter: only the claims ``upstream`` takes (``held_claim_refusal``)."""
    claims = HeldClaimCheck(topology, upstream)
    return HeldReporter(upstream, lambda key: claims.refusal(me, key[0], key[1]) is None)
