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
from cluster.site_state import SiteState
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
    """The site's nodes (by id), partitions (by topic and partition) and under-replicated segments (by key)."""

    nodes: tuple[NodeStatus, ...]
    partitions: tuple[PartitionStatus, ...]
    under_replicated: tuple[UnderReplicated, ...]

    @property
    def bytes_moved(self) -> int:
        """The site's total of bytes moved between nodes: every node's count, a dead node's last report included."""
        return sum(n.bytes_moved for n in self.nodes)


def cluster_status(state: SiteState, now_ms: int, session_timeout_ms: int, replication_factor: int) -> ClusterStatus:
    """The status of every node, partition and under-replicated segment of ``state`` at ``now_ms``."""
    nodes = state.nodes()
    loads = {n.node: n for n in node_loads(state, now_ms, session_timeout_ms)}
    segments: dict[NodeId, int] = {}
    open_segments: dict[NodeId, int] = {}
    leader_of: dict[NodeId, int] = {}
    views: list[SegmentView] = []
    partitions: list[PartitionStatus] = []
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
            # The metadata holds no sizes; under_replicated does not read them.
            views.append(
                SegmentView(
                    info.topic, info.partition, segment.segment_id, segment.ensemble, segment.sealed, size_bytes=0
                )
            )
        open_segment = info.open_segment
        leader = loads.get(info.leader) if info.leader is not None else None
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
    statuses = tuple(
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
        for n, info in sorted(nodes.items())
    )
    lacking = under_replicated(views, loads.values(), replication_factor=replication_factor)
    return ClusterStatus(statuses, tuple(partitions), lacking)
