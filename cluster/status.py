"""What ``georep cluster status`` shows of a multi-node site, from one node's view of its metadata. Pure.

:func:`cluster_status` reads a :class:`~cluster.site_state.SiteState` at
``now_ms`` (the answering node's clock) and returns, per node, per partition
and per under-replicated segment, what an operator looks at first: which
nodes are live, what each holds and leads, who leads each partition, and
which segments have fewer live copies than they should.

**What a node holds.** The metadata says which segments each node is an
ensemble member of, not how many bytes they are (segments change per roll,
never per write, and their sizes would change per write). So a node's
figures here are *counts*: segment copies (every segment whose ensemble
includes it, open or sealed) and the open ones among them (the streams being
written to it). Bytes come from each node's own disk, which only that node
can read; the shell adds them (``SiteCluster.cluster_status``: the
answering node's ``ReplicaStore``).

**Bytes moved** are each node's own count of the bytes repair copies wrote
to it from other nodes (copies off dead or draining members, fills,
widenings), which it keeps on its disk and reports with every heartbeat
(``NodeInfo.bytes_moved``); the site's total is their sum. A node that joins
takes new segments with none moved: its count stays 0.

**Under-replicated** is ``cluster.repair.under_replicated``, the same rule
the repair planner acts on: a segment with a dead or draining member, or
with fewer members than ``replication_factor`` (a segment opened on fewer
live nodes, down to the ack quorum, stays short until repair widens it).

**Liveness** is ``NodeInfo.is_live``: a heartbeat less than
``session_timeout_ms`` before ``now_ms``. It is this node's view: a node cut
off from the Raft majority sees every heartbeat stop and reports everyone
else dead, which is why the shell reports the Raft status beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.leadership import node_loads
from cluster.placement import NodeLoad
from cluster.repair import SegmentView, UnderReplicated, under_replicated
from cluster.site_state import PartitionInfo, SiteState
from cluster.topic_settings import own_replication_factor
from topology.ids import LeaderEpoch, NodeId, SegmentId


@dataclass(frozen=True, slots=True)
class NodeStatus:
    """One node of the site, as the metadata has it at ``now_ms``."""

    node: NodeId
    address: str
    live: bool
    heartbeat_age_ms: int | None  # now_ms minus its last heartbeat (its clock: skew shows here); None: none yet
    free_bytes: int
    load: int  # as it last reported
    draining: bool
    segments: int  # segment copies the metadata puts on it: every segment whose ensemble includes it
    open_segments: int  # of which open: the streams being written to it
    leader_of: int  # partitions it leads
    bytes_moved: int  # bytes repair copies wrote to it from other nodes, as of its last heartbeat


@dataclass(frozen=True, slots=True)
class PartitionStatus:
    """One partition: its leader and its chain of segments."""

    topic: str
    partition: int
    leader: NodeId | None
    leader_live: bool
    leader_epoch: LeaderEpoch
    segments: int
    open_segment: SegmentId | None
    open_ensemble: tuple[NodeId, ...]  # () while no segment is open


@dataclass(frozen=True, slots=True)
class ClusterStatus:
    """The site's nodes (by id), partitions (by topic and partition) and under-replicated segments (by key): every
    one, or a page of them (:class:`Page`) with the counts over all and where the next page starts."""

    nodes: tuple[NodeStatus, ...]
    partitions: tuple[PartitionStatus, ...]
    under_replicated: tuple[UnderReplicated, ...]
    partition_count: int = 0
    leaderless: int = 0  # partitions without a live leader
    under_replicated_count: int = 0
    next_after: tuple[str, int] | None = None  # the last partition listed, when more follow

    @property
    def bytes_moved(self) -> int:
        """The site's total of bytes moved between nodes: every node's count, a dead node's last report included."""
        return sum(n.bytes_moved for n in self.nodes)


@dataclass(frozen=True, slots=True)
class Page:
    """Which partitions to list: those of ``topic`` (None: every topic's) after ``after`` (topic, partition),
    at most ``limit`` (None: all of them); under-replicated segments at most ``limit`` too."""

    limit: int | None = None
    after: tuple[str, int] | None = None
    topic: str | None = None


class InvalidPageToken(ValueError):
    """A page token that no answer gave."""


def segment_views(state: SiteState, info: PartitionInfo) -> list[SegmentView]:
    """The partition's segments as repair's status reads them: held to its topic's own replication factor, and
    sized 0 (the metadata holds no sizes; ``under_replicated`` does not read them)."""
    replication_factor = own_replication_factor(state.topic(info.topic))
    return [
        SegmentView(
            info.topic,
            info.partition,
            s.segment_id,
            s.ensemble,
            s.sealed,
            size_bytes=0,
            replication_factor=replication_factor,
        )
        for s in info.segments
    ]


def page_token(after: tuple[str, int]) -> str:
    """The token a client passes back to get the partitions after ``after``."""
    return f"{after[1]}:{after[0]}"


def parse_page_token(token: str) -> tuple[str, int]:
    partition, sep, topic = token.partition(":")
    if not sep or not topic or not partition.isdigit():
        raise InvalidPageToken(
            f"page token {token!r} is not one a cluster status answer gave: start again without a page token"
        )
    return topic, int(partition)


def cluster_status(
    state: SiteState, now_ms: int, session_timeout_ms: int, replication_factor: int, page: Page | None = None
) -> ClusterStatus:
    """The status of every node, partition and under-replicated segment of ``state`` at ``now_ms``; with ``page``,
    the counts over all of them and the partitions and segments of that page only."""
    page = page or Page()
    if page.limit == 0 and page.topic is None and page.after is None:
        return _summary(state, now_ms, session_timeout_ms, replication_factor)
    loads = {n.node: n for n in node_loads(state, now_ms, session_timeout_ms)}
    segments: dict[NodeId, int] = {}
    open_segments: dict[NodeId, int] = {}
    leader_of: dict[NodeId, int] = {}
    views: list[SegmentView] = []
    partitions: list[PartitionStatus] = []
    leaderless = 0
    count = 0
    for info in state.partitions():
        if info.leader is not None:
            leader_of[info.leader] = leader_of.get(info.leader, 0) + 1
        for segment in info.segments:
            for member in segment.ensemble:
                segments[member] = segments.get(member, 0) + 1
                if not segment.sealed:
                    open_segments[member] = open_segments.get(member, 0) + 1
                if member not in loads:
                    # Not in the node table (RemoveNode refuses a member, so no correct log gets here): shown as
                    # dead rather than failing the whole status.
                    loads[member] = NodeLoad(member, 0, 0, alive=False, draining=False)
        if page.topic is not None and info.topic != page.topic:
            continue  # the nodes' counts are the site's; the partitions and segments listed, the topic's
        views += segment_views(state, info)
        open_segment = info.open_segment
        leader = loads.get(info.leader) if info.leader is not None else None
        leaderless += not (leader is not None and leader.alive)
        count += 1
        if (page.after is not None and (info.topic, info.partition) <= page.after) or (
            page.limit is not None and len(partitions) > page.limit
        ):
            continue  # not on the page (one past it is kept: it says that more follow)
        partitions.append(
            PartitionStatus(
                info.topic,
                info.partition,
                info.leader,
                leader is not None and leader.alive,
                info.leader_epoch,
                len(info.segments),
                open_segment.segment_id if open_segment is not None else None,
                open_segment.ensemble if open_segment is not None else (),
            )
        )
    statuses = _node_statuses(state, now_ms, session_timeout_ms, segments, open_segments, leader_of)
    lacking = under_replicated(views, loads.values(), replication_factor=replication_factor)
    more = page.limit is not None and len(partitions) > page.limit
    listed = partitions[: page.limit] if page.limit is not None else partitions
    return ClusterStatus(
        statuses,
        tuple(listed),
        lacking if page.limit is None else lacking[: page.limit],
        partition_count=count,
        leaderless=leaderless,
        under_replicated_count=len(lacking),
        next_after=(listed[-1].topic, listed[-1].partition) if more and listed else None,
    )


def _node_statuses(
    state: SiteState,
    now_ms: int,
    session_timeout_ms: int,
    segments: dict[NodeId, int],
    open_segments: dict[NodeId, int],
    leader_of: dict[NodeId, int],
) -> tuple[NodeStatus, ...]:
    return tuple(
        NodeStatus(
            n,
            info.address,
            info.is_live(now_ms, session_timeout_ms),
            None if info.last_heartbeat_ms is None else now_ms - info.last_heartbeat_ms,
            info.free_bytes,
            info.load,
            info.draining,
            segments.get(n, 0),
            open_segments.get(n, 0),
            leader_of.get(n, 0),
            info.bytes_moved,
        )
        for n, info in sorted(state.nodes().items())
    )


@dataclass(frozen=True, slots=True)
class _Counts:
    """What the summary needs of every partition, per version of the state (heartbeats aside)."""

    segments: dict[NodeId, int]
    open_segments: dict[NodeId, int]
    leader_of: dict[NodeId, int]
    no_leader: int  # partitions with no leader at all
    partition_count: int
    views: tuple[SegmentView, ...]  # every segment, for under_replicated
    unknown_members: frozenset[NodeId]  # members outside the node table (no correct log has any)


def _count(state: SiteState) -> _Counts:
    segments: dict[NodeId, int] = {}
    open_segments: dict[NodeId, int] = {}
    leader_of: dict[NodeId, int] = {}
    views: list[SegmentView] = []
    no_leader = 0
    known = state.nodes()
    unknown: set[NodeId] = set()
    partitions = state.partitions()
    for info in partitions:
        if info.leader is None:
            no_leader += 1
        else:
            leader_of[info.leader] = leader_of.get(info.leader, 0) + 1
        views += segment_views(state, info)
        for segment in info.segments:
            for member in segment.ensemble:
                segments[member] = segments.get(member, 0) + 1
                if not segment.sealed:
                    open_segments[member] = open_segments.get(member, 0) + 1
                if member not in known:
                    unknown.add(member)
    return _Counts(segments, open_segments, leader_of, no_leader, len(partitions), tuple(views), frozenset(unknown))


def _summary(state: SiteState, now_ms: int, session_timeout_ms: int, replication_factor: int) -> ClusterStatus:
    """The counts and the nodes, without a walk over every partition while the partitions and the live nodes stay
    as they were: ``bench/site_scale.py`` polls this every 50 ms during a failover, and the walk took a tenth of a
    node at 2,000 partitions. The same figures as the full status (``tests/test_cluster_status.py`` compares)."""
    counts = state.derived("status_counts", _count)
    loads = {n.node: n for n in node_loads(state, now_ms, session_timeout_ms)}
    for member in counts.unknown_members:
        loads[member] = NodeLoad(member, 0, 0, alive=False, draining=False)
    dead = sorted(n for n, load in loads.items() if not load.alive)
    draining = sorted(n for n, load in loads.items() if load.alive and load.draining)
    leaderless = counts.no_leader + sum(c for n, c in counts.leader_of.items() if n not in loads or not loads[n].alive)
    lacking = state.derived(
        f"under_replicated {replication_factor} {dead} {draining}",
        lambda _: under_replicated(counts.views, loads.values(), replication_factor=replication_factor),
    )
    return ClusterStatus(
        _node_statuses(state, now_ms, session_timeout_ms, counts.segments, counts.open_segments, counts.leader_of),
        (),
        (),
        partition_count=counts.partition_count,
        leaderless=leaderless,
        under_replicated_count=len(lacking),
    )
