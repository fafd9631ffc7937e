"""What a node does about the partitions it leads (cluster/leadership.py), one rule per test.

The cluster simulator drives the same functions under crashes, pauses and lost proposals
(tests/test_sim_cluster.py); these pin each rule with one small state.
"""

from __future__ import annotations

from cluster.leadership import (
    Adopt,
    AskEpoch,
    Blocked,
    Lead,
    ProposeOpen,
    StepDown,
    Wait,
    node_loads,
    open_loads,
    plan_open,
    role_step,
    roll_seal_at,
)
from cluster.site_state import (
    Applied,
    CreateTopic,
    ElectLeader,
    NodeHeartbeat,
    OpenSegment,
    PartitionInfo,
    RegisterNode,
    SealSegment,
    SiteState,
)
from georep.metadata.topics import TopicSpec
from offsets.coordinates import LocalOffset
from offsets.vector import VectorOffset
from topology.ids import LeaderEpoch, NodeId, SegmentId

N1, N2, N3, N4 = (NodeId(n) for n in (1, 2, 3, 4))
E0, E1, E2 = LeaderEpoch(0), LeaderEpoch(1), LeaderEpoch(2)
SESSION_MS = 10_000


def site(now_ms: int = 100_000, live: tuple[NodeId, ...] = (N1, N2, N3, N4)) -> SiteState:
    state = SiteState()
    for node in (N1, N2, N3, N4):
        assert isinstance(state.apply(RegisterNode(node, f"10.0.0.{node}:9092")), Applied)
        beat = now_ms if node in live else now_ms - 2 * SESSION_MS
        assert isinstance(state.apply(NodeHeartbeat(node, beat, (1 << 40) * node, 0)), Applied)
    assert isinstance(state.apply(CreateTopic(TopicSpec("t", 1))), Applied)
    return state


def part(state: SiteState) -> PartitionInfo:
    info = state.partition("t", 0)
    assert info is not None
    return info


def apply(state: SiteState, *commands: object) -> SiteState:
    for command in commands:
        assert isinstance(state.apply(command), Applied), command  # type: ignore[arg-type]
    return state


def test_a_node_named_in_a_fresh_epoch_leads_and_recovers_an_open_segment_first() -> None:
    state = apply(site(), ElectLeader("t", 0, N1, E0))
    assert role_step(part(state), N1, None, E0, True) == Lead(E1, None)  # nothing open: it opens
    assert role_step(part(state), N2, None, E0, True) is None  # not named: nothing to do
    apply(state, OpenSegment("t", 0, E1, LocalOffset(0), (N1, N2, N3)), ElectLeader("t", 0, N2, E1))
    step = role_step(part(state), N2, None, E0, True)
    assert isinstance(step, Lead) and step.epoch == E2 and step.recover is not None
    assert step.recover.segment_id == SegmentId(0)  # the predecessor's open segment


def test_a_leader_named_no_more_steps_down() -> None:
    state = apply(site(), ElectLeader("t", 0, N1, E0), ElectLeader("t", 0, N2, E1))
    step = role_step(part(state), N1, E1, E0, True)
    assert isinstance(step, StepDown) and "node 2" in step.reason
    assert role_step(part(state), N2, E2, E0, True) is None  # leading the current epoch: keep on


def test_an_epoch_it_cannot_write_in_is_asked_again() -> None:
    state = apply(site(), ElectLeader("t", 0, N1, E0))
    ask = AskEpoch(ElectLeader("t", 0, N1, E1))
    assert role_step(part(state), N1, None, E0, False) == ask  # granted to an earlier incarnation
    assert role_step(part(state), N1, None, E1, True) == ask  # it gave that epoch up
    apply(state, OpenSegment("t", 0, E1, LocalOffset(0), (N1, N2, N3)))
    assert role_step(part(state), N1, None, E0, True) == ask  # its own open segment, written by another life


def test_plan_open_places_the_next_segment_after_the_sealed_one() -> None:
    state = apply(site(), ElectLeader("t", 0, N1, E0))
    loads = node_loads(state, 100_000, SESSION_MS)
    step = plan_open(part(state), N1, E1, None, (), loads, 3)
    assert isinstance(step, ProposeOpen) and step.command.base_offset == 0 and step.command.ensemble[0] == N1
    first = step.command.ensemble
    apply(state, step.command)
    assert plan_open(part(state), N1, E1, None, (), loads, 3) == Adopt(SegmentId(0), LocalOffset(0), first)
    apply(state, SealSegment("t", 0, E1, SegmentId(0), LocalOffset(40), VectorOffset()))
    nxt = plan_open(part(state), N1, E1, SegmentId(0), (), node_loads(state, 100_000, SESSION_MS), 3)
    assert isinstance(nxt, ProposeOpen) and nxt.command.base_offset == 40
    assert set(nxt.command.ensemble) != set(first)  # never only the previous ensemble: a 4th node takes part


def test_plan_open_waits_for_a_lagging_view_and_for_recovery() -> None:
    state = apply(site(), ElectLeader("t", 0, N1, E0), OpenSegment("t", 0, E1, LocalOffset(0), (N1, N2, N3)))
    lagging = part(state)  # still shows segment 0 open, which this leader has sealed
    assert isinstance(plan_open(lagging, N1, E1, SegmentId(0), (), [], 3), Wait)
    apply(state, ElectLeader("t", 0, N2, E1))
    step = plan_open(part(state), N2, E2, None, (), node_loads(state, 100_000, SESSION_MS), 3)
    assert isinstance(step, Wait) and "recover it" in step.reason
    assert isinstance(plan_open(part(state), N1, E1, None, (), [], 3), Wait)  # deposed


def test_plan_open_is_blocked_without_enough_live_nodes() -> None:
    state = apply(site(live=(N1, N2)), ElectLeader("t", 0, N1, E0))
    step = plan_open(part(state), N1, E1, None, (), node_loads(state, 100_000, SESSION_MS), 3)
    assert isinstance(step, Blocked) and "cannot place" in step.reason


def test_plan_open_with_the_ack_quorum_opens_on_the_live_nodes_down_to_it() -> None:
    # RF 3, ack quorum 2. Exactly the ack quorum live: the segment opens on those two, the leader first.
    state = apply(site(live=(N1, N2)), ElectLeader("t", 0, N1, E0))
    step = plan_open(part(state), N1, E1, None, (), node_loads(state, 100_000, SESSION_MS), 3, min_ensemble=2)
    assert step == ProposeOpen(OpenSegment("t", 0, E1, LocalOffset(0), (N1, N2)))
    # Between the ack quorum and RF: RF 4 wanted, three live, all three.
    state = apply(site(live=(N1, N2, N3)), ElectLeader("t", 0, N1, E0))
    step = plan_open(part(state), N1, E1, None, (), node_loads(state, 100_000, SESSION_MS), 4, min_ensemble=2)
    assert isinstance(step, ProposeOpen) and step.command.ensemble[0] == N1
    assert sorted(step.command.ensemble) == [N1, N2, N3]
    # RF live nodes or more: RF of them, as without the floor.
    state = apply(site(), ElectLeader("t", 0, N1, E0))
    loads = node_loads(state, 100_000, SESSION_MS)
    whole = plan_open(part(state), N1, E1, None, (), loads, 3)
    assert isinstance(whole, ProposeOpen) and len(whole.command.ensemble) == 3
    assert plan_open(part(state), N1, E1, None, (), loads, 3, min_ensemble=2) == whole


def test_plan_open_below_the_ack_quorum_is_blocked_and_says_why() -> None:
    state = apply(site(live=(N1,)), ElectLeader("t", 0, N1, E0))
    step = plan_open(part(state), N1, E1, None, (), node_loads(state, 100_000, SESSION_MS), 3, min_ensemble=2)
    assert isinstance(step, Blocked)
    assert "cannot place the next segment of t/0, and it takes no writes until it can" in step.reason
    assert "need at least 2 eligible node(s) (an ensemble of 2 to 3), have 1 (node 1)" in step.reason
    assert "node 2, node 3, node 4 dead" in step.reason
    # Without the floor (existing callers), two live nodes are not enough for RF 3.
    state = apply(site(live=(N1, N2)), ElectLeader("t", 0, N1, E0))
    step = plan_open(part(state), N1, E1, None, (), node_loads(state, 100_000, SESSION_MS), 3)
    assert isinstance(step, Blocked) and "need 3 eligible node(s)" in step.reason


def test_node_loads_count_the_open_segments_each_node_is_written_in() -> None:
    state = apply(
        site(live=(N1, N2, N3)), ElectLeader("t", 0, N1, E0), OpenSegment("t", 0, E1, LocalOffset(0), (N1, N2, N3))
    )
    assert open_loads(state) == {N1: 1, N2: 1, N3: 1}
    loads = {n.node: n for n in node_loads(state, 100_000, SESSION_MS)}
    assert loads[N2].load == 1 and loads[N4].load == 0 and not loads[N4].alive and loads[N2].alive


def test_a_roll_seals_at_the_lac_once_everything_is_confirmed_or_the_wait_is_over() -> None:
    assert roll_seal_at(lac=90, appended_end=100, rolling_since_ms=0, now_ms=499, roll_wait_ms=500) is None
    assert roll_seal_at(lac=100, appended_end=100, rolling_since_ms=0, now_ms=1, roll_wait_ms=500) == 100
    assert roll_seal_at(lac=90, appended_end=100, rolling_since_ms=0, now_ms=500, roll_wait_ms=500) == 90
