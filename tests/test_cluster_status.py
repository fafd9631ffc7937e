"""``georep cluster status``: what one node's view of a multi-node site's metadata says, through the CLI.

The pure view (``cluster/status.py``) is checked on a hand-built ``SiteState``; the command itself on a real
three-node site of ``georep node`` processes, before and after one of them is killed with ``kill -9``, and on a
one-node site and an address where nothing listens.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.site_state import (
    Applied,
    Command,
    CreateTopic,
    ElectLeader,
    NodeHeartbeat,
    OpenSegment,
    RegisterNode,
    SealSegment,
    SetDraining,
    SiteState,
)
from cluster.status import cluster_status
from georep.cli.cluster import render, size_text, status_json
from georep.metadata.topics import TopicSpec
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.server.process import NodeProcess
from offsets.coordinates import LocalOffset
from offsets.vector import VectorOffset
from tests.support.channels import open_channel
from tests.support.cli import georep
from tests.support.cluster_site import ClusterSite
from topology.ids import LeaderEpoch, NodeId, SegmentId

N1, N2, N3, N4 = (NodeId(n) for n in (1, 2, 3, 4))
SESSION_MS = 2_000
TOPIC = "orders"


def apply(state: SiteState, *commands: Command) -> None:
    for command in commands:
        result = state.apply(command)
        assert isinstance(result, Applied), result


def four_nodes() -> SiteState:
    """Nodes 1-4; 3 stopped heartbeating at 1000, 4 never did. ``t``/0 led by 1 has a sealed segment on 1,2,3 and
    an open one on 1,2 (opened while 3 was down); ``t``/1 led by 2 has an open one on 2,1,3; ``t``/2 has no leader."""
    state = SiteState()
    apply(state, *(RegisterNode(n, f"10.0.0.{n}:9092") for n in (N1, N2, N3, N4)))
    apply(
        state,
        NodeHeartbeat(N3, 1_000, 30 << 30, 1),
        NodeHeartbeat(N1, 9_500, 50 << 30, 2),
        NodeHeartbeat(N2, 9_800, 40 << 30, 2),
        CreateTopic(TopicSpec("t", 3)),
    )
    apply(
        state,
        ElectLeader("t", 0, N1, LeaderEpoch(0)),
        OpenSegment("t", 0, LeaderEpoch(1), LocalOffset(0), (N1, N2, N3)),
        SealSegment("t", 0, LeaderEpoch(1), SegmentId(0), LocalOffset(10), VectorOffset.parse("a@1:10")),
        OpenSegment("t", 0, LeaderEpoch(1), LocalOffset(10), (N1, N2)),
    )
    apply(
        state,
        ElectLeader("t", 1, N2, LeaderEpoch(0)),
        OpenSegment("t", 1, LeaderEpoch(1), LocalOffset(0), (N2, N1, N3)),
    )
    return state


def test_the_view_counts_segment_copies_and_leaderships_per_node() -> None:
    view = cluster_status(four_nodes(), now_ms=10_000, session_timeout_ms=SESSION_MS, replication_factor=3)
    by_id = {n.node: n for n in view.nodes}
    assert [n.node for n in view.nodes] == [N1, N2, N3, N4]
    assert [by_id[n].live for n in (N1, N2, N3, N4)] == [True, True, False, False]
    assert by_id[N1].heartbeat_age_ms == 500 and by_id[N3].heartbeat_age_ms == 9_000
    assert by_id[N4].heartbeat_age_ms is None, "a node that never heartbeated has no age"
    assert (by_id[N1].segments, by_id[N1].open_segments, by_id[N1].leader_of) == (3, 2, 1)
    assert (by_id[N3].segments, by_id[N3].open_segments, by_id[N3].leader_of) == (2, 1, 0)
    assert (by_id[N4].segments, by_id[N4].leader_of) == (0, 0)
    assert by_id[N1].free_bytes == 50 << 30
    assert view.bytes_moved == 0 and all(n.bytes_moved == 0 for n in view.nodes), "no repair copied anything"


def test_bytes_moved_are_each_nodes_last_report_and_the_site_total_keeps_a_dead_nodes() -> None:
    state = four_nodes()
    apply(state, NodeHeartbeat(N2, 9_900, 40 << 30, 2, bytes_moved=5_000), NodeHeartbeat(N3, 1_100, 30 << 30, 1, 700))
    view = cluster_status(state, now_ms=10_000, session_timeout_ms=SESSION_MS, replication_factor=3)
    assert [(n.node, n.live, n.bytes_moved) for n in view.nodes] == [
        (N1, True, 0),
        (N2, True, 5_000),
        (N3, False, 700),
        (N4, False, 0),
    ]
    assert view.bytes_moved == 5_700, "node 3 is dead, but what was copied to it was moved all the same"
    restored = SiteState.restore(json.loads(json.dumps(state.snapshot())))
    assert restored.node(N2) is not None and restored.node(N2).bytes_moved == 5_000, "a Raft snapshot keeps it"


def test_the_view_names_every_partitions_leader_and_open_ensemble() -> None:
    view = cluster_status(four_nodes(), now_ms=10_000, session_timeout_ms=SESSION_MS, replication_factor=3)
    rows = [
        (p.topic, p.partition, p.leader, p.leader_live, p.leader_epoch, p.segments, p.open_segment, p.open_ensemble)
        for p in view.partitions
    ]
    assert rows == [
        ("t", 0, N1, True, 1, 2, 1, (N1, N2)),
        ("t", 1, N2, True, 1, 1, 0, (N2, N1, N3)),
        ("t", 2, None, False, 0, 0, None, ()),
    ]


def test_segments_with_a_dead_member_or_short_of_the_replication_factor_are_under_replicated() -> None:
    view = cluster_status(four_nodes(), now_ms=10_000, session_timeout_ms=SESSION_MS, replication_factor=3)
    found = [
        (u.topic, u.partition, u.segment_id, u.sealed, u.dead, u.live_count, u.wanted) for u in view.under_replicated
    ]
    assert found == [
        ("t", 0, 0, True, (N3,), 2, 3),  # node 3 died
        ("t", 0, 1, False, (), 2, 3),  # opened on two nodes while 3 was down
        ("t", 1, 0, False, (N3,), 2, 3),
    ]


def test_while_every_member_heartbeats_nothing_is_under_replicated_and_draining_counts() -> None:
    state = four_nodes()
    apply(state, NodeHeartbeat(N3, 9_900, 30 << 30, 1))
    view = cluster_status(state, now_ms=10_000, session_timeout_ms=SESSION_MS, replication_factor=2)
    assert view.under_replicated == (), "every segment has its members live and at least replication_factor"
    apply(state, SetDraining(N2, True))
    view = cluster_status(state, now_ms=10_000, session_timeout_ms=SESSION_MS, replication_factor=2)
    assert [(u.partition, u.segment_id, u.draining) for u in view.under_replicated] == [
        (0, 0, (N2,)),
        (0, 1, (N2,)),
        (1, 0, (N2,)),
    ]


def response() -> pb.ClusterStatusResponse:
    return pb.ClusterStatusResponse(
        site="a",
        epoch=7,
        node_id=1,
        replication_factor=3,
        session_timeout_ms=1500,
        raft=pb.RaftGroupStatus(
            self_address="127.0.0.1:9101",
            leader_address="127.0.0.1:9102",
            is_leader=False,
            reachable_nodes=2,
            total_nodes=3,
        ),
        nodes=[
            pb.ClusterNodeStatus(
                node_id=1, address="127.0.0.1:7101", live=True, last_heartbeat_age_ms=200, segments=1, store_bytes=4096
            ),
            pb.ClusterNodeStatus(
                node_id=2, address="127.0.0.1:7102", live=True, last_heartbeat_age_ms=300, segments=1, bytes_moved=100
            ),
            pb.ClusterNodeStatus(
                node_id=3,
                address="127.0.0.1:7103",
                live=False,
                last_heartbeat_age_ms=9000,
                segments=1,
                bytes_moved=2048,
            ),
        ],
        partitions=[
            pb.ClusterPartitionStatus(
                topic="t",
                partition=0,
                leader=3,
                leader_live=False,
                leader_epoch=1,
                segments=1,
                open_segment_id=0,
                open_ensemble=[3, 1, 2],
            )
        ],
        under_replicated=[
            pb.UnderReplicatedSegment(
                topic="t",
                partition=0,
                segment_id=0,
                ensemble=[3, 1, 2],
                dead=[3],
                live_members=2,
                wanted_members=3,
                message="m",
            )
        ],
    )


def test_the_summary_counts_as_the_full_status_does_as_nodes_die_drain_and_come_back() -> None:
    """The summary (a page of 0, what a failover poll asks every 50 ms) keeps its walk per version of the state:
    its counts must still follow every heartbeat that makes a node dead or live, and every draining flag."""
    from cluster.status import Page

    state = four_nodes()

    def same(now_ms: int) -> None:
        full = cluster_status(state, now_ms, SESSION_MS, 3)
        summary = cluster_status(state, now_ms, SESSION_MS, 3, Page(limit=0))
        assert summary.nodes == full.nodes
        assert (summary.partition_count, summary.leaderless, summary.under_replicated_count) == (
            full.partition_count,
            full.leaderless,
            full.under_replicated_count,
        )

    same(10_000)
    same(10_000)  # from the cache
    same(12_000)  # node 1's session ran out: t/0 has no live leader now, and more segments lack a member
    apply(
        state,
        NodeHeartbeat(N3, 11_900, 30 << 30, 1),
        NodeHeartbeat(N1, 11_950, 50 << 30, 2),
        NodeHeartbeat(N2, 11_950, 40 << 30, 2),
    )
    same(12_000)  # all three are back: only the short segment is under-replicated
    apply(state, SetDraining(N2, True))
    same(12_000)
    apply(state, ElectLeader("t", 2, N3, LeaderEpoch(0)))
    same(12_000)


def test_bytes_and_raft_roles_come_from_each_nodes_own_answer() -> None:
    own_2 = pb.ClusterStatusResponse(
        node_id=2,
        raft=pb.RaftGroupStatus(self_address="127.0.0.1:9102", is_leader=True),
        nodes=[pb.ClusterNodeStatus(node_id=2, store_bytes=8192, bytes_moved=300)],
    )
    doc = status_json(response(), {2: own_2})
    assert [(n["node"], n["store_bytes"], n["raft_role"], n["bytes_moved"]) for n in doc["nodes"]] == [
        (1, 4096, "follower", 0),
        (2, 8192, "leader", 300),
        (3, None, None, 2048),
    ], "bytes moved: a node's own count when it answered, else its last heartbeat's (a dead node's too)"
    assert doc["bytes_moved"] == 2348
    assert doc["raft"]["leader_node"] == 2 and doc["raft"]["leader_address"] == "127.0.0.1:9102"
    assert doc["partitions"][0]["open_segment"] == {"segment_id": 0, "ensemble": [3, 1, 2]}
    assert status_json(response(), {})["raft"]["leader_node"] is None, "no node said it leads: unknown, not guessed"


def test_the_table_marks_dead_nodes_and_leaders_and_lists_under_replicated_segments() -> None:
    text = render(response(), {})
    node_3 = next(line for line in text.splitlines() if line.startswith("3 "))
    assert node_3.split()[:3] == ["3", "127.0.0.1:7103", "dead"]
    assert node_3.split()[-2:] == ["-", "2.0KiB"], "a node not asked has no bytes stored; its bytes moved are known"
    assert "bytes moved between nodes by repairs: 2.1 KiB (2148 B)" in text
    assert "3(dead)" in text
    assert "no Raft leader known" not in text
    leaderless = response()
    leaderless.raft.leader_address = ""
    assert "no Raft leader known to node 1" in render(leaderless, {})
    assert "under-replicated segments: 1" in text
    assert size_text(4096) == "4.0 KiB" and size_text(512) == "512 B" and size_text(None) == "-"


# --- real processes ------------------------------------------------------------------


def status(bootstrap: str) -> dict[str, Any]:
    result = georep("cluster", "status", "--json", "--partitions", "--all", "--bootstrap", bootstrap)
    assert result.returncode == 0, result.stderr.decode()
    doc: dict[str, Any] = json.loads(result.stdout)
    return doc


def wait_status(
    bootstrap: str, ok: Callable[[dict[str, Any]], bool], what: str, timeout_s: float = 60.0
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    doc: dict[str, Any] = {}
    while time.monotonic() < deadline:
        doc = status(bootstrap)
        if ok(doc):
            return doc
        time.sleep(0.2)
    raise AssertionError(f"not {what} within {timeout_s} s; last status: {json.dumps(doc, indent=1)}")


def scrape(site: ClusterSite, node: int) -> dict[str, float]:
    """A node's /metrics: each sample as ``name{label="v",...}`` (labels sorted) -> value."""
    with urllib.request.urlopen(f"http://{site.nodes[node].metrics_address}/metrics", timeout=5) as response:
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def check_cluster_metrics(site: ClusterSite, doc: dict[str, Any]) -> None:
    """Every node's /metrics says of the site what ``georep cluster status`` said (issue 26): one Raft leader."""
    scraped = {n: scrape(site, n) for n in (1, 2, 3)}
    for metrics in scraped.values():
        assert metrics["georep_cluster_partitions"] == len(doc["partitions"])
        assert metrics["georep_cluster_under_replicated_segments"] == len(doc["under_replicated"])
        assert metrics["georep_cluster_leaderless_partitions"] == 0
        for row in doc["nodes"]:
            assert metrics[f'georep_cluster_node_live{{node="{row["node"]}"}}'] == int(row["live"])
            assert metrics[f'georep_cluster_node_leader_partitions{{node="{row["node"]}"}}'] == row["leader_of"]
        assert (metrics["georep_raft_has_leader"], metrics["georep_raft_nodes"]) == (1, 3)
        assert metrics["georep_raft_commit_index"] >= metrics["georep_raft_applied_index"] > 0
    assert sum(m["georep_raft_is_leader"] for m in scraped.values()) == 1


def live_nodes(doc: dict[str, Any]) -> list[int]:
    return [n["node"] for n in doc["nodes"] if n["live"]]


def ready(doc: dict[str, Any]) -> bool:
    """Every partition has a live leader and an open segment."""
    return len(doc["partitions"]) == 2 and all(p["leader_live"] and p["open_segment"] for p in doc["partitions"])


@pytest.mark.slow
def test_cluster_status_of_a_three_node_site_before_and_after_a_kill(tmp_path: Path) -> None:
    site = ClusterSite(tmp_path, 3, extra_args=["--session-timeout-ms", "1500"])
    try:
        site.start()
        everyone = ",".join(site.address(n) for n in (1, 2, 3))
        # Segments open on the nodes that are live then: wait for all three, or one may open short.
        wait_status(everyone, lambda d: live_nodes(d) == [1, 2, 3], "3 live nodes")
        with open_channel(site.address(2)) as channel:
            pbg.NodeStub(channel).CreateTopic(pb.CreateTopicRequest(name=TOPIC, partitions=2), timeout=30)
        site.wait_leader(TOPIC, 0)
        site.wait_leader(TOPIC, 1)
        doc = wait_status(everyone, ready, "a live leader and an open segment for both partitions")

        assert doc["site"] == "a" and doc["replication_factor"] == 3
        assert live_nodes(doc) == [1, 2, 3]
        assert [(p["topic"], p["partition"]) for p in doc["partitions"]] == [(TOPIC, 0), (TOPIC, 1)]
        for p in doc["partitions"]:
            assert p["leader"] in (1, 2, 3) and p["leader_epoch"] >= 1
            assert p["segments"] >= 1
            assert sorted(p["open_segment"]["ensemble"]) == [1, 2, 3], "RF=3 on three nodes: each holds a copy"
            assert p["open_segment"]["ensemble"][0] == p["leader"], "the leader opened the segment"
        segments = sum(p["segments"] for p in doc["partitions"])
        assert [n["segments"] for n in doc["nodes"]] == [segments] * 3, "every segment of an RF=3 site of 3 nodes"
        assert sum(n["leader_of"] for n in doc["nodes"]) == 2
        assert doc["under_replicated"] == []
        assert doc["raft"]["leader_node"] in (1, 2, 3), "some node says it leads the Raft group"
        assert all(isinstance(n["store_bytes"], int) for n in doc["nodes"]), "every live node reports its bytes"
        text = georep("cluster", "status", "--bootstrap", everyone)
        assert text.returncode == 0, text.stderr.decode()
        assert "under-replicated segments: none" in text.stdout.decode()
        check_cluster_metrics(site, doc)

        victim = doc["partitions"][0]["leader"]
        held = next(n["segments"] for n in doc["nodes"] if n["node"] == victim)
        site.nodes[victim].kill9()
        others = [n for n in (1, 2, 3) if n != victim]
        survivors = ",".join(site.address(n) for n in others)
        # If the victim led the Raft group, no heartbeat commits until the others elect a new leader, and for a
        # moment every node shows dead (the status says so, with the Raft leader unknown): wait for the end of it.
        doc = wait_status(survivors, lambda d: live_nodes(d) == others, f"node {victim} shown dead, the others live")
        row = next(n for n in doc["nodes"] if n["node"] == victim)
        assert row["store_bytes"] is None and row["raft_role"] is None, "a dead node is not asked"
        assert row["last_heartbeat_age_ms"] >= 1500
        on_victim = {
            (u["topic"], u["partition"], u["segment_id"]) for u in doc["under_replicated"] if victim in u["ensemble"]
        }
        assert len(on_victim) == row["segments"] == held, "every segment it holds is under-replicated"
        assert all(u["dead"] == [victim] for u in doc["under_replicated"] if victim in u["ensemble"])

        # The partition it led gets a new leader, which recovers and seals the old segment (still open, on the
        # victim too, until then) and opens the next one on the two nodes left: a segment short of the replication
        # factor, under-replicated too until repair widens it.
        def moved(d: dict[str, Any]) -> bool:
            p = d["partitions"][0]
            opened = p["open_segment"] is not None and victim not in p["open_segment"]["ensemble"]
            return p["leader"] != victim and p["leader_live"] and opened

        doc = wait_status(
            survivors, moved, f"{TOPIC}/0 led by a live node, with a segment opened without node {victim}"
        )
        p = doc["partitions"][0]
        assert p["leader"] in others and p["segments"] >= 2
        assert sorted(p["open_segment"]["ensemble"]) == others
        short = next(
            u
            for u in doc["under_replicated"]
            if (u["partition"], u["segment_id"]) == (0, p["open_segment"]["segment_id"])
        )
        assert (short["sealed"], short["dead"], short["live_members"], short["wanted_members"]) == (False, [], 2, 3)
        assert any(u["partition"] == 0 and u["sealed"] and u["dead"] == [victim] for u in doc["under_replicated"])
        metrics = scrape(site, others[0])
        assert metrics[f'georep_cluster_node_live{{node="{victim}"}}'] == 0
        assert metrics["georep_cluster_under_replicated_segments"] > 0
        assert metrics["georep_raft_reachable_nodes"] == 2
    finally:
        site.close()


def test_a_one_node_site_says_it_has_one_node(tmp_path: Path) -> None:
    node = NodeProcess(site="a", data_dir=tmp_path / "a").start()
    try:
        result = georep("cluster", "status", "--bootstrap", node.address)
    finally:
        node.kill9()
    assert result.returncode == 2
    lines = result.stderr.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith("georep: error: ") and "has one node" in lines[0], lines


def test_an_address_where_nothing_listens_is_a_one_line_error() -> None:
    result = georep("cluster", "status", "--bootstrap", "127.0.0.1:1")
    assert result.returncode == 2
    lines = result.stderr.decode().splitlines()
    assert len(lines) == 1 and "cannot reach georep node at 127.0.0.1:1" in lines[0], lines
