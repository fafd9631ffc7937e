"""The controller's repair rolls after a node's kill (cluster/controller.py, "Leaders first, rolls after").

Every open segment that had the dead node as a member is rolled. At 10,000 partitions those were thousands of
``RollSegment`` calls to the survivors while they recovered the dead node's partitions, and the recoveries' fences
waited behind them: the rolls now wait until every moved partition's leader has opened a segment of its own (at most
``roll_hold_ms``), go at most ``rolls_per_pass`` at a time, and a leader whose own recovery rolls is never asked.
"""

from __future__ import annotations

import dataclasses

from cluster import leadership
from cluster.controller import AskRoll, Controller, ControllerConfig, awaiting_leader
from cluster.site_state import (
    Applied,
    CreateTopic,
    ElectLeader,
    FailOver,
    NodeHeartbeat,
    OpenSegment,
    RegisterNode,
    SealSegment,
    SiteState,
)
from georep.metadata.topics import TopicSpec
from offsets.coordinates import LocalOffset
from offsets.vector import VectorOffset
from topology.ids import LeaderEpoch, NodeId, SegmentId

SESSION_MS = 3_000
NOW_MS = 1_000_000
N1, N2, N3 = NodeId(1), NodeId(2), NodeId(3)
CONFIG = ControllerConfig(session_timeout_ms=SESSION_MS, tick_ms=100, replication_factor=3, repair_delay_ms=60_000)
MOVED = range(0, 4)  # led by node 3 until it died
KEPT = range(4, 10)  # led by nodes 1 and 2, node 3 a member of their open segment


def ok(result: object) -> None:
    assert isinstance(result, Applied), result


def site_after_the_kill() -> SiteState:
    """Three nodes, node 3 dead and its partitions just moved by the FailOver: their new leaders have not recovered
    yet (their open segment is still the one node 3 opened, in epoch 1)."""
    state = SiteState()
    for n in (N1, N2, N3):
        ok(state.apply(RegisterNode(n, f"10.0.0.{n}:9092")))
        ok(state.apply(NodeHeartbeat(n, NOW_MS - 10 * SESSION_MS, 1 << 40, 0)))
    ok(state.apply(CreateTopic(TopicSpec("t", len(MOVED) + len(KEPT)))))
    for p in [*MOVED, *KEPT]:
        leader = N3 if p in MOVED else (N1, N2)[p % 2]
        ok(state.apply(ElectLeader("t", p, leader, LeaderEpoch(0))))
        others = tuple(n for n in (N1, N2, N3) if n != leader)
        ok(state.apply(OpenSegment("t", p, LeaderEpoch(1), LocalOffset(0), (leader, *others))))
    for n in (N1, N2):
        ok(state.apply(NodeHeartbeat(n, NOW_MS, 1 << 40, 0)))
    ok(state.apply(FailOver(N3, NOW_MS - 10 * SESSION_MS, NOW_MS, SESSION_MS)))
    return state


def recovered(state: SiteState, p: int) -> None:
    """The new leader of ``p`` seals node 3's segment and opens its own."""
    info = state.partition("t", p)
    assert info is not None and info.leader is not None
    epoch = info.leader_epoch
    ok(state.apply(SealSegment("t", p, epoch, SegmentId(0), LocalOffset(0), VectorOffset({}))))
    ok(state.apply(OpenSegment("t", p, epoch, LocalOffset(0), (info.leader, N1 if info.leader == N2 else N2))))


def rolls(ctl: Controller, state: SiteState, now_ms: int) -> list[int]:
    ctl.next_repair_ms = now_ms
    loads = leadership.node_loads(state, now_ms, SESSION_MS)
    _, asked = ctl.repair_plan(state, now_ms, lambda s: 0, lambda: loads)
    assert all(isinstance(r, AskRoll) for r in asked)
    return sorted(r.key[1] for r in asked)


def test_no_roll_is_asked_while_the_moved_partitions_recover_and_none_of_a_recovering_leader() -> None:
    state = site_after_the_kill()
    assert [awaiting_leader(i) for i in state.partitions()] == [p in MOVED for p in range(10)]
    ctl = Controller(N1, since_ms=NOW_MS - 10 * SESSION_MS, config=CONFIG)
    assert rolls(ctl, state, NOW_MS) == [], "rolls asked of the survivors while they recover node 3's partitions"
    for p in MOVED[:-1]:
        recovered(state, p)
    assert rolls(ctl, state, NOW_MS + 1_000) == [], "one recovery still runs"
    recovered(state, MOVED[-1])
    assert rolls(ctl, state, NOW_MS + 2_000) == list(KEPT)  # node 3 leaves their next segments


def test_rolls_wait_for_recoveries_only_so_long_and_never_for_a_recovering_leader() -> None:
    """A recovery that cannot finish (say its quorum is down too) must not hold repair for good."""
    state = site_after_the_kill()
    ctl = Controller(N1, since_ms=NOW_MS - 10 * SESSION_MS, config=CONFIG)
    assert rolls(ctl, state, NOW_MS) == []
    later = NOW_MS + CONFIG.roll_hold_ms
    for n in (N1, N2):  # the survivors live on
        ok(state.apply(NodeHeartbeat(n, later - 1, 1 << 40, 0)))
    assert rolls(ctl, state, later - 1) == []
    assert rolls(ctl, state, later) == list(KEPT)  # the moved ones roll by their recovery


def test_rolls_go_in_waves() -> None:
    state = site_after_the_kill()
    for p in MOVED:
        recovered(state, p)
    ctl = Controller(N1, since_ms=NOW_MS - 10 * SESSION_MS, config=dataclasses.replace(CONFIG, rolls_per_pass=4))
    first = rolls(ctl, state, NOW_MS)
    assert first == list(KEPT)[:4]
    assert rolls(ctl, state, NOW_MS + 100) == list(KEPT)[4:]  # the others; the first are not asked again so soon
