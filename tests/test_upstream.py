"""dst's choices about one upstream site (``georep/replication/upstream.py``): which node to pull from, and which
partitions to ask it for, as the node's replicator and the simulator drive them through ``PullSession``."""

from __future__ import annotations

import itertools

import pytest

from georep.replication.links import LinkManager
from georep.replication.session import OpenStream, PullConfig, PullSession
from georep.replication.upstream import UpstreamNodes, pullable
from offsets.coordinates import Origin
from topology.filters import ALL_TOPICS
from topology.ids import SiteId
from topology.model import Link, Site, Topology

A, B = SiteId("a"), SiteId("b")
NODES = ("127.0.0.1:7101", "127.0.0.1:7102", "127.0.0.1:7103")
CONFIG = PullConfig(idle_timeout_ms=1_000, backoff_min_ms=100, backoff_max_ms=400)


def test_a_failed_stream_moves_to_the_next_node_and_around() -> None:
    nodes = UpstreamNodes(NODES)
    assert nodes.current == NODES[0]
    assert nodes.stream_failed("down") and nodes.current == NODES[1]
    assert nodes.stream_failed("timeout") and nodes.current == NODES[2]  # silence is a failure too
    assert nodes.stream_failed("down") and nodes.current == NODES[0]
    for kind in ("up", "ended", "gap", "tail", "wants", "diverged", "disabled"):
        assert not nodes.stream_failed(kind) and nodes.current == NODES[0], kind
    assert nodes.moves == 3
    lone = UpstreamNodes(NODES[:1])
    assert not lone.stream_failed("down") and lone.current == NODES[0]
    with pytest.raises(ValueError, match="at least one node"):
        UpstreamNodes(())


def session(nodes: UpstreamNodes) -> PullSession:
    topology = Topology((Site(A, NODES), Site(B, ("127.0.0.1:7201",))), (Link(A, B, ALL_TOPICS, 1),))
    links = LinkManager(topology, B, stall_ms=600)
    links.topic("t", 1)
    return PullSession(A, links, Origin(B, 1), lambda key: {}, itertools.count(1), CONFIG, nodes=nodes)


def opened(effects: list[object]) -> OpenStream:
    streams = [e for e in effects if isinstance(e, OpenStream)]
    assert len(streams) == 1, effects
    return streams[0]


def test_the_session_opens_each_stream_at_the_node_its_failures_lead_to() -> None:
    nodes = UpstreamNodes(NODES)
    s = session(nodes)
    first = opened(s.start(0))
    assert first.address == NODES[0]
    s.tick(1_000)  # silent for the idle timeout: a frozen node, or one behind a half-open connection
    second = opened(s.tick(1_100))  # after the backoff
    assert second.address == NODES[1]
    s.on_stream_ended(second.stream_id, 1_200, "UNAVAILABLE: connection refused")
    assert opened(s.tick(1_400)).address == NODES[2]
    # An operator's cut is not the node's failure.
    s.set_enabled(False, 1_500)
    assert opened(s.set_enabled(True, 1_600)).address == NODES[2]


def test_a_stream_that_ends_cleanly_stays_at_its_node() -> None:
    s = session(UpstreamNodes(NODES))
    first = opened(s.start(0))
    assert opened(s.on_stream_ended(first.stream_id, 5)).address == NODES[0]


def test_a_session_without_nodes_leaves_the_address_to_its_shell() -> None:
    s = PullSession(A, session(UpstreamNodes(NODES)).links, Origin(B, 1), lambda key: {}, itertools.count(1), CONFIG)
    assert opened(s.start(0)).address == ""


def test_only_partitions_the_upstream_has_out_of_conflict_and_served_here_are_pulled() -> None:
    remote = {"t": 2, "u": 1}
    served = {("t", 0), ("t", 1), ("u", 0), ("v", 0)}
    assert pullable(("t", 1), A, remote, {}, served)
    assert not pullable(("t", 2), A, remote, {}, served | {("t", 2)}), "a partition the upstream does not have"
    assert not pullable(("v", 0), A, remote, {}, served), "a topic the upstream has not listed (yet)"
    assert not pullable(("u", 0), A, remote, {("u", A): "u has 2 partitions at a"}, served), "in conflict"
    assert pullable(("u", 0), A, remote, {("u", B): "in conflict with another upstream"}, served)
    assert not pullable(("t", 0), A, remote, {}, served - {("t", 0)}), "another node of this site leads it"
