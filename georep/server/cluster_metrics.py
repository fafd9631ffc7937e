"""A multi-node site's health in ``/metrics``, as this node's copy of the site's metadata has it at scrape time:
what ``georep cluster status`` prints as its summary (docs/cluster.md), and this node's view of the Raft group.

Computed when scraped, from the metadata (never from what a node once claimed): the counts come from
``cluster.status``'s summary, which walks the partitions only when they or the live nodes changed since the last
walk. Series are per node of the site at most (a handful), never per partition or segment, so the count stays
bounded at any partition count. docs/operations.md, "Metrics", lists them; deploy/prometheus/georep-alerts.yml
alerts on them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cluster.status import NodeStatus, Page, cluster_status

if TYPE_CHECKING:
    from georep.server.site_cluster import SiteCluster

SUMMARY = Page(limit=0)  # the counts only: no partition rows


class ClusterCollector(Collector):
    def __init__(self, site: SiteCluster) -> None:
        self.site = site

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        site = self.site
        config = site.member.config
        view = cluster_status(
            site.metadata.state(), site.member.clock_ms(), config.session_timeout_ms, config.replication_factor, SUMMARY
        )
        yield GaugeMetricFamily("georep_cluster_partitions", "Partitions of the site", value=view.partition_count)
        yield GaugeMetricFamily(
            "georep_cluster_leaderless_partitions",
            "Partitions without a live leader: writes to them wait for an election",
            value=view.leaderless,
        )
        yield GaugeMetricFamily(
            "georep_cluster_under_replicated_segments",
            "Segments held fsynced by fewer live nodes than the replication factor (repair is copying them)",
            value=view.under_replicated_count,
        )
        yield from _node_families(view.nodes, site.member.me, site.store.moved.total)
        yield from _raft_families(site)


def _node_families(
    nodes: Iterable[NodeStatus], me: int, moved_here: int
) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    live = GaugeMetricFamily(
        "georep_cluster_node_live", "1 if the node heartbeated within the session timeout", labels=["node"]
    )
    draining = GaugeMetricFamily(
        "georep_cluster_node_draining", "1 while the node is being decommissioned", labels=["node"]
    )
    leads = GaugeMetricFamily("georep_cluster_node_leader_partitions", "Partitions the node leads", labels=["node"])
    segments = GaugeMetricFamily(
        "georep_cluster_node_segments", "Segment copies the metadata puts on the node", labels=["node"]
    )
    moved = CounterMetricFamily(
        "georep_cluster_repair_bytes", "Bytes repair copied to the node from other nodes", labels=["node"]
    )
    for n in nodes:
        label = [str(n.node)]
        live.add_metric(label, int(n.live))
        draining.add_metric(label, int(n.draining))
        leads.add_metric(label, n.leader_of)
        segments.add_metric(label, n.segments)
        moved.add_metric(label, moved_here if n.node == me else n.bytes_moved)
    yield from (live, draining, leads, segments, moved)


def _raft_families(site: SiteCluster) -> Iterator[GaugeMetricFamily]:
    raft = site.metadata.status()
    yield GaugeMetricFamily(
        "georep_raft_is_leader", "1 if this node leads the site's Raft group", value=int(raft.is_leader)
    )
    yield GaugeMetricFamily(
        "georep_raft_has_leader",
        "1 if this node knows a Raft leader it can reach: 0 on every node means no metadata change can commit",
        value=int(raft.leader_address is not None),
    )
    yield GaugeMetricFamily("georep_raft_term", "The Raft term this node is in", value=raft.term)
    yield GaugeMetricFamily(
        "georep_raft_commit_index", "The last Raft log entry this node knows committed", value=raft.commit_index
    )
    yield GaugeMetricFamily(
        "georep_raft_applied_index", "The last Raft log entry applied here", value=raft.applied_index
    )
    yield GaugeMetricFamily(
        "georep_raft_reachable_nodes",
        "Nodes of the Raft group this node reaches, itself included",
        value=raft.reachable_nodes,
    )
    yield GaugeMetricFamily("georep_raft_nodes", "Nodes of the Raft group", value=raft.total_nodes)
