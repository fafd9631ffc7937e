"""A dead node's partitions move in one command (cluster/failover.py, ``FailOver`` in cluster/site_state.py).

Properties over random sites: no partition goes to the dead node or to any node that is not live; every partition
of the dead node that has a live in-sync replica (a live member of its open segment, or any live node when nothing
is open) gets a leader; no acknowledged record is lost (the new leader's recovery, reading any E - AQ + 1 members
with itself among them, finds an end at or above the LAC); nothing else changes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.controller import Controller, ControllerConfig
from cluster.failover import plan_failover
from cluster.quorum import last_add_confirmed
from cluster.recovery import recovered_end
from cluster.site_state import (
    Applied,
    CreateTopic,
    ElectLeader,
    FailOver,
    NodeHeartbeat,
    OpenSegment,
    RefusalCode,
    Refused,
    RegisterNode,
    SetDraining,
    SiteState,
    command_from_dict,
)
from georep.metadata.topics import TopicSpec
from offsets.coordinates import LocalOffset
from topology.ids import LeaderEpoch, NodeId

SESSION_MS = 6_000
NOW_MS = 1_000_000
NODES = tuple(NodeId(n) for n in range(1, 6))
AQ = 2


@dataclass(frozen=True)
class PartitionSpec:
    leader: NodeId
    ensemble: tuple[NodeId, ...] | None  # the open segment's, leader first; None: nothing open
    ends: tuple[int, ...]  # each member's fsynced end of the open segment


@st.composite
def partition_specs(draw: st.DrawFn) -> PartitionSpec:
    leader = draw(st.sampled_from(NODES))
    if not draw(st.booleans()):
        return PartitionSpec(leader, None, ())
    others = draw(st.lists(st.sampled_from([n for n in NODES if n != leader]), min_size=1, max_size=3, unique=True))
    ensemble = (leader, *others)
    ends = tuple(draw(st.integers(0, 50)) for _ in ensemble)
    return PartitionSpec(leader, ensemble, ends)


@dataclass(frozen=True)
class Site:
    state: SiteState
    specs: tuple[PartitionSpec, ...]
    live: frozenset[NodeId]
    dead: NodeId


@st.composite
def sites(draw: st.DrawFn) -> Site:
    specs = tuple(draw(st.lists(partition_specs(), min_size=1, max_size=30)))
    dead = draw(st.sampled_from(NODES))
    live = frozenset(draw(st.lists(st.sampled_from([n for n in NODES if n != dead]), unique=True)))
    draining = draw(st.lists(st.sampled_from(NODES), unique=True, max_size=2))
    state = SiteState()
    for n in NODES:
        ok(state.apply(RegisterNode(n, f"10.0.0.{n}:9092")))
        beat = NOW_MS - (0 if n in live else 2 * SESSION_MS) - n  # distinct heartbeats
        ok(state.apply(NodeHeartbeat(n, beat, 1 << 40, 0)))
    for n in draining:
        ok(state.apply(SetDraining(n, True)))
    ok(state.apply(CreateTopic(TopicSpec("t", len(specs)))))
    for p, spec in enumerate(specs):
        ok(state.apply(ElectLeader("t", p, spec.leader, LeaderEpoch(0))))
        if spec.ensemble is not None:
            ok(state.apply(OpenSegment("t", p, LeaderEpoch(1), LocalOffset(0), spec.ensemble)))
    return Site(state, specs, live, dead)


def ok(result: object) -> None:
    assert isinstance(result, Applied), result


def fail_over(site: Site, avoid: NodeId | None = None) -> tuple[SiteState, object]:
    after = site.state.copy()
    dead = after.node(site.dead)
    assert dead is not None
    result = after.apply(FailOver(site.dead, dead.last_heartbeat_ms, NOW_MS, SESSION_MS, avoid))
    return after, result


@settings(max_examples=300, deadline=None)
@given(sites())
def test_no_partition_goes_to_a_dead_node_and_every_one_with_a_live_in_sync_replica_gets_a_leader(site: Site) -> None:
    after, result = fail_over(site)
    assert isinstance(result, Applied)
    moved = 0
    for p, spec in enumerate(site.specs):
        before_info, info = site.state.partition("t", p), after.partition("t", p)
        assert before_info is not None and info is not None
        if spec.leader != site.dead:
            assert info == before_info  # nothing else changes
            continue
        candidates = set(spec.ensemble) & site.live if spec.ensemble is not None else set(site.live)
        if not candidates:
            assert info == before_info  # waits for a member to come back
            continue
        moved += 1
        assert info.leader in candidates and info.leader != site.dead
        assert info.leader_epoch == before_info.leader_epoch + 1
    assert result.moved == moved


@settings(max_examples=300, deadline=None)
@given(sites())
def test_no_acknowledged_record_is_lost(site: Site) -> None:
    """Whatever E - AQ + 1 members the new leader's recovery reads (itself among them), it seals at or above the
    LAC, the end below which every ``acks=all`` was released."""
    after, _ = fail_over(site)
    for p, spec in enumerate(site.specs):
        info = after.partition("t", p)
        assert info is not None
        if spec.ensemble is None or spec.leader != site.dead or info.leader == site.dead:
            continue
        if len(spec.ensemble) < AQ:
            continue
        ends = dict(zip(spec.ensemble, spec.ends, strict=True))
        lac = last_add_confirmed(ends.values(), AQ)
        assert info.leader in ends  # an in-sync replica, holding a prefix of the segment
        readable = len(spec.ensemble) - AQ + 1
        others = [m for m in spec.ensemble if m != info.leader]
        for read in itertools.combinations(others, readable - 1):
            assert recovered_end([ends[info.leader], *(ends[m] for m in read)]) >= lac


@settings(max_examples=100, deadline=None)
@given(sites())
def test_every_replica_plans_the_same_leaders(site: Site) -> None:
    """Planned at apply: the command, decoded from the log, gives the same state on any copy of the state."""
    a, _ = fail_over(site, avoid=NodeId(1))
    dead = site.state.node(site.dead)
    assert dead is not None
    command = command_from_dict(FailOver(site.dead, dead.last_heartbeat_ms, NOW_MS, SESSION_MS, NodeId(1)).to_dict())
    b = site.state.copy()
    b.apply(command)
    assert a == b


def last_node_dead_leading_all(nodes: int, partitions: int) -> SiteState:
    """Nodes 1..``nodes``, the last silent for two sessions and leading every partition of topic ``t``."""
    state = SiteState()
    dead = NODES[nodes - 1]
    for n in NODES[:nodes]:
        ok(state.apply(RegisterNode(n, f"10.0.0.{n}:9092")))
        ok(state.apply(NodeHeartbeat(n, NOW_MS - (2 * SESSION_MS if n == dead else 0), 1 << 40, 0)))
    ok(state.apply(CreateTopic(TopicSpec("t", partitions))))
    for p in range(partitions):
        ok(state.apply(ElectLeader("t", p, dead, LeaderEpoch(0))))
    return state


def test_a_node_that_heartbeated_since_the_plan_keeps_its_partitions() -> None:
    """The compare-and-set on the heartbeat: a late FailOver never moves the partitions of a node that came back."""
    state = last_node_dead_leading_all(nodes=3, partitions=4)
    seen = NOW_MS - 2 * SESSION_MS
    ok(state.apply(NodeHeartbeat(NodeId(3), NOW_MS, 1 << 40, 0)))  # it comes back
    before = state.copy()
    result = state.apply(FailOver(NodeId(3), seen, NOW_MS, SESSION_MS))
    assert isinstance(result, Refused) and result.code is RefusalCode.NODE_NOT_DEAD
    assert [i.leader for i in state.partitions()] == [i.leader for i in before.partitions()] == [3, 3, 3, 3]


def test_the_dead_nodes_partitions_spread_over_the_survivors_away_from_the_controller() -> None:
    state = last_node_dead_leading_all(nodes=4, partitions=9)
    plan = plan_failover(state, NodeId(4), NOW_MS, SESSION_MS, avoid=NodeId(1))
    counts = {n: list(plan.values()).count(n) for n in (1, 2, 3)}
    assert counts == {1: 3, 2: 3, 3: 3}  # spread evenly; the controller (1) takes its share last
    assert plan[("t", 0)] != 1


def test_a_controller_whose_own_heartbeats_commit_late_condemns_nobody() -> None:
    """Under load the metadata commits every node's heartbeat late, the controller's own included: the silence of
    the others then says nothing of them. At 5,000 partitions on two loaded cores a controller that judged by the
    clock alone moved every live node's partitions, one after the other, each move more work for the starved nodes.
    A node is condemned only while the controller's own last heartbeat is fresher than half a session."""
    config = ControllerConfig(session_timeout_ms=SESSION_MS, tick_ms=100, replication_factor=3)
    state = last_node_dead_leading_all(nodes=3, partitions=4)  # node 3 silent for two sessions
    ctl = Controller(NodeId(1), since_ms=NOW_MS - 10 * SESSION_MS, config=config)
    assert any(isinstance(c, FailOver) for c in ctl.elections(state, NOW_MS)), "a dead node's partitions move"
    late = NOW_MS + SESSION_MS * 6 // 10  # nothing committed since: the controller's own heartbeat is as old
    ctl = Controller(NodeId(1), since_ms=NOW_MS - 10 * SESSION_MS, config=config)
    assert not any(isinstance(c, FailOver) for c in ctl.elections(state, late)), "condemned through a stalled log"
    ok(state.apply(NodeHeartbeat(NodeId(1), late - SESSION_MS // 10, 1 << 40, 0)))  # the log moves again
    assert any(isinstance(c, FailOver) for c in ctl.elections(state, late))
