"""Repair planning: each rule with concrete segments, then properties.

What an operator relies on: after a node dies (for longer than the repair
delay) or is drained, every sealed segment it held is copied from a live
member to another node, never from a dead one and never onto a node that
already holds it; an open segment is rolled rather than copied; a node that
merely reboots costs no copy; repair never runs more copies at once than
allowed, nor the same copy twice; what cannot be repaired is reported with
what to do; and once the copies are applied, no sealed segment is left
under-replicated. A segment that opened on fewer nodes than the replication
factor (while fewer were live) is copied to more nodes, at once, until it
has that many; an open one is rolled once a node can join the next one.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.placement import InvalidPlacementRequest, NodeLoad
from cluster.repair import (
    AwaitingRepairDelay,
    CopyDeferred,
    CopySegment,
    InvalidRepairInput,
    NoRepairTarget,
    RepairPlan,
    RollSegment,
    SegmentUnavailable,
    SegmentView,
    UnderReplicated,
    after_copy,
    drained,
    plan_repair,
    under_replicated,
)
from tests.support.examples import examples
from topology.ids import NodeId, SegmentId

GiB = 1 << 30
DELAY_MS = 60_000
NOW_MS = 1_000_000


def node(n: int, free_gib: float = 100, load: int = 0, *, alive: bool = True, draining: bool = False) -> NodeLoad:
    return NodeLoad(NodeId(n), int(free_gib * GiB), load, alive, draining)


def seg(
    *ensemble: int, partition: int = 0, segment_id: int = 0, sealed: bool = True, size_gib: float = 1, topic: str = "t"
) -> SegmentView:
    return SegmentView(
        topic, partition, SegmentId(segment_id), tuple(NodeId(n) for n in ensemble), sealed, int(size_gib * GiB)
    )


def cluster(count: int, *, dead: Sequence[int] = (), draining: Sequence[int] = ()) -> list[NodeLoad]:
    return [node(n, alive=n not in dead, draining=n in draining) for n in range(1, count + 1)]


def plan(
    segments: Sequence[SegmentView],
    nodes: Sequence[NodeLoad],
    *,
    dead_for_ms: int = DELAY_MS,
    in_progress: Sequence[CopySegment] = (),
    cap: int = 10,
    rf: int | None = None,
) -> RepairPlan:
    """Plan with every dead node dead for ``dead_for_ms``."""
    down = {n.node: NOW_MS - dead_for_ms for n in nodes if not n.alive}
    return plan_repair(
        segments,
        nodes,
        down_since_ms=down,
        now_ms=NOW_MS,
        repair_delay_ms=DELAY_MS,
        in_progress=in_progress,
        max_concurrent_copies=cap,
        replication_factor=rf,
    )


def copy(src: int, dst: int, replaces: int | None, partition: int = 0, segment_id: int = 0) -> CopySegment:
    gone = None if replaces is None else NodeId(replaces)
    return CopySegment("t", partition, SegmentId(segment_id), NodeId(src), NodeId(dst), gone)


# --- the rules one by one ----------------------------------------------------------


def test_a_healthy_site_needs_no_repair() -> None:
    p = plan([seg(1, 2, 3), seg(2, 3, 4, sealed=False, partition=1)], cluster(4))
    assert p == RepairPlan((), (), (), (), ())
    assert p.next_due_ms is None


def test_a_node_dead_for_less_than_the_delay_is_waited_for() -> None:
    p = plan([seg(1, 2, 3)], cluster(4, dead=[1]), dead_for_ms=DELAY_MS - 1)
    assert p.copies == ()
    assert p.waiting == (AwaitingRepairDelay("t", 0, SegmentId(0), NodeId(1), NOW_MS + 1),)
    assert p.next_due_ms == NOW_MS + 1
    assert "unless the node comes back" in p.waiting[0].message()


def test_a_node_dead_for_the_delay_is_replaced_by_a_copy_from_a_live_member() -> None:
    nodes = [node(1, alive=False), node(2, load=3), node(3, load=1), node(4), node(5)]
    p = plan([seg(1, 2, 3)], nodes, dead_for_ms=DELAY_MS)
    assert len(p.copies) == 1
    (c,) = p.copies
    assert (c.source, c.replaces) == (3, 1)  # the less loaded live member
    assert c.target in {4, 5}
    assert (p.waiting, p.deferred, p.unrepairable, p.rolls) == ((), (), (), ())
    assert c.message() == f"copy t/0 segment 0 from node 3 to node {c.target}, replacing node 1"


def test_a_draining_member_is_copied_at_once_from_a_non_draining_member() -> None:
    nodes = [node(1, draining=True), node(2, load=5), node(3, load=9), node(4)]
    (c,) = plan([seg(1, 2, 3)], nodes).copies
    assert c == copy(2, 4, 1)


def test_a_draining_member_that_is_the_last_alive_one_is_the_source() -> None:
    nodes = [node(1, draining=True), node(2, alive=False), node(3), node(4)]
    p = plan([seg(1, 2)], nodes, dead_for_ms=0)
    assert p.copies == (copy(1, p.copies[0].target, 1),)
    assert p.copies[0].target in {3, 4}
    assert p.waiting == (AwaitingRepairDelay("t", 0, SegmentId(0), NodeId(2), NOW_MS + DELAY_MS),)


def test_a_dead_draining_node_is_replaced_without_waiting() -> None:
    nodes = [node(1, alive=False, draining=True), node(2), node(3), node(4)]
    (c,) = plan([seg(1, 2, 3)], nodes, dead_for_ms=0).copies
    assert c == copy(2, 4, 1)


def test_an_open_segment_is_rolled_at_once_not_copied() -> None:
    p = plan([seg(1, 2, 3, sealed=False, segment_id=4)], cluster(5, dead=[2]), dead_for_ms=0)
    assert (p.copies, p.waiting) == ((), ())
    assert p.rolls == (RollSegment("t", 0, SegmentId(4), NodeId(2)),)
    assert "seals it and opens the next segment" in p.rolls[0].message()


def test_an_open_segment_with_a_draining_member_is_rolled() -> None:
    p = plan([seg(1, 2, 3, sealed=False)], cluster(5, draining=[3]))
    assert p.rolls == (RollSegment("t", 0, SegmentId(0), NodeId(3)),)


def test_one_roll_per_open_segment_naming_a_dead_member_first() -> None:
    p = plan([seg(1, 2, 3, 4, sealed=False)], cluster(5, dead=[4, 3], draining=[1]))
    assert p.rolls == (RollSegment("t", 0, SegmentId(0), NodeId(3)),)


@pytest.mark.parametrize("sealed", [True, False])
def test_a_segment_with_no_alive_member_is_reported_unavailable(sealed: bool) -> None:
    p = plan([seg(1, 2, sealed=sealed)], cluster(4, dead=[1, 2]))
    assert (p.copies, p.rolls) == ((), ())
    assert p.unrepairable == (SegmentUnavailable("t", 0, SegmentId(0), (NodeId(1), NodeId(2))),)
    message = p.unrepairable[0].message()
    assert "unavailable" in message and "nodes 1, 2" in message and "do not wipe" in message


def test_no_target_left_is_reported_with_what_to_do() -> None:
    p = plan([seg(1, 2, 3)], cluster(4, dead=[1, 4]))
    assert p.copies == ()
    (blocked,) = p.unrepairable
    assert isinstance(blocked, NoRepairTarget)
    assert blocked.replaces == 1
    message = blocked.message()
    assert message.startswith("t/0 segment 0 cannot replace node 1: need 1 eligible node(s), have 0")
    assert "node 4 dead" in message and "Add nodes" in message


def test_the_target_must_have_room_for_the_segment() -> None:
    # Node 4 would be preferred (least loaded), but holds 1 GiB too little for the segment.
    nodes = [node(1, alive=False), node(2), node(3), node(4, free_gib=59), node(5, free_gib=61, load=3)]
    assert plan([seg(1, 2, 3, size_gib=60)], nodes).copies[0].target == 5
    assert plan([seg(1, 2, 3, size_gib=58)], nodes).copies[0].target == 4
    (blocked,) = plan([seg(1, 2, 3, size_gib=62)], nodes).unrepairable
    assert isinstance(blocked, NoRepairTarget)
    assert f"node 4, node 5 below {62 * GiB} free bytes" in blocked.message()


def test_a_copy_in_progress_is_not_planned_again_and_counts_against_the_cap() -> None:
    segments = [seg(1, 2, 3), seg(1, 2, 3, partition=1)]
    running = [copy(2, 4, 1)]
    p = plan(segments, cluster(5, dead=[1]), in_progress=running, cap=2)
    assert [(c.partition, c.replaces) for c in p.copies] == [(1, 1)]
    p = plan(segments, cluster(5, dead=[1]), in_progress=running, cap=1)
    assert p.copies == ()
    assert p.deferred == (CopyDeferred("t", 1, SegmentId(0), NodeId(1)),)
    assert "raise max_concurrent_copies" in p.deferred[0].message()


def test_two_replacements_of_one_segment_never_share_a_target() -> None:
    # Node 4 is the best target, but a copy of this segment is already going there.
    nodes = [node(1, alive=False), node(2, alive=False), node(3), node(4, free_gib=1000), node(5), node(6)]
    p = plan([seg(1, 2, 3)], nodes, in_progress=[copy(3, 4, 1)])
    (c,) = p.copies
    assert c.replaces == 2 and c.target in {5, 6}


def test_the_cap_goes_to_the_segments_closest_to_losing_data_first() -> None:
    # Partition 1 keeps two live members, partition 2 only one: partition 2 goes first.
    segments = [seg(1, 2, 3, partition=0), seg(1, 2, 4, partition=1), seg(4, 5, 6, partition=2)]
    p = plan(segments, cluster(9, dead=[4, 5]), cap=2)
    assert {(c.partition, c.replaces) for c in p.copies} == {(2, 4), (2, 5)}
    assert p.deferred == (CopyDeferred("t", 1, SegmentId(0), NodeId(4)),)
    p = plan([seg(1, 2, 3, partition=0), seg(4, 5, 6, partition=1)], cluster(9, dead=[1, 4, 5]), cap=1)
    assert [(c.partition, c.replaces) for c in p.copies] == [(1, 4)]
    assert {(d.partition, d.replaces) for d in p.deferred} == {(0, 1), (1, 5)}


def test_a_cap_of_zero_pauses_copies_but_not_rolls() -> None:
    p = plan([seg(1, 2, 3), seg(1, 2, 3, partition=1, sealed=False)], cluster(5, dead=[1]), cap=0)
    assert p.copies == ()
    assert len(p.deferred) == 1 and len(p.rolls) == 1


def test_the_copies_of_one_pass_spread_over_targets_and_sources() -> None:
    # Empty segments, so that only the load tells the targets apart: each planned copy adds one to its target's.
    segments = [seg(1, 2, 3, partition=p, size_gib=0) for p in range(12)]
    p = plan(segments, cluster(6, dead=[1]), cap=12)
    targets = [int(c.target) for c in p.copies]
    sources = [int(c.source) for c in p.copies]
    assert sorted(targets.count(n) for n in (4, 5, 6)) == [4, 4, 4]
    assert sorted(sources.count(n) for n in (2, 3)) == [6, 6]


def test_the_copies_of_one_pass_take_the_space_they_use_into_account() -> None:
    # Node 4 is preferred (less load), but after the first 6 GiB copy it has 4 GiB left: the second goes to node 5.
    nodes = [node(1, alive=False), node(2), node(3), node(4, free_gib=10), node(5, free_gib=10, load=5)]
    p = plan([seg(1, 2, 3, partition=0, size_gib=6), seg(1, 2, 3, partition=1, size_gib=6)], nodes)
    assert [(c.partition, c.target) for c in p.copies] == [(0, 4), (1, 5)]


# --- segments opened on fewer nodes than the replication factor ------------------------


def test_a_short_sealed_segment_is_copied_to_another_node_at_once() -> None:
    # RF 3: segment 0 opened on nodes 1 and 2 while node 3 was down. Node 3 is back: copy, no repair delay.
    nodes = [node(1, load=2), node(2), node(3)]
    p = plan([seg(1, 2)], nodes, rf=3)
    assert p == RepairPlan((copy(2, 3, None),), (), (), (), ())
    assert p.copies[0].message() == (
        "copy t/0 segment 0 from node 2 to node 3, adding a member (it has fewer than replication_factor)"
    )
    assert after_copy(seg(1, 2), p.copies[0]) == seg(1, 2, 3)  # the opener stays first
    assert plan([seg(1, 2, 3)], nodes, rf=3) == RepairPlan((), (), (), (), ())  # nothing left to do
    assert plan([seg(1, 2)], nodes) == RepairPlan((), (), (), (), ())  # no replication_factor: nothing is short


def test_a_short_sealed_segment_with_no_node_to_take_it_says_so() -> None:
    p = plan([seg(1, 2)], cluster(3, dead=[3]), rf=3, dead_for_ms=0)
    assert (p.copies, p.waiting) == ((), ())
    (blocked,) = p.unrepairable
    assert isinstance(blocked, NoRepairTarget) and blocked.replaces is None
    assert blocked.message().startswith("t/0 segment 0 cannot get another member: need 1 eligible node(s), have 0")
    assert "node 3 dead" in blocked.message()


def test_each_missing_member_is_one_copy_to_its_own_target_less_those_under_way() -> None:
    # RF 5 on six nodes: segment on 1, 2, 3 lacks two members.
    p = plan([seg(1, 2, 3)], cluster(6), rf=5)
    assert [c.replaces for c in p.copies] == [None, None]
    assert len({c.target for c in p.copies}) == 2 and {c.target for c in p.copies} <= {4, 5, 6}
    assert len({c.source for c in p.copies}) == 2  # read from two members, not twice from one
    p = plan([seg(1, 2, 3)], cluster(6), rf=5, in_progress=[copy(1, 4, None)])
    (c,) = p.copies
    assert c.replaces is None and c.target in {5, 6}
    assert plan([seg(1, 2, 3)], cluster(6), rf=5, in_progress=[copy(1, 4, None), copy(2, 5, None)]).copies == ()


def test_a_short_segment_with_a_dead_member_gets_a_replacement_and_an_addition() -> None:
    p = plan([seg(1, 2)], cluster(4, dead=[2]), rf=3)
    assert sorted((c.replaces or 0, c.source) for c in p.copies) == [(0, 1), (2, 1)]
    assert {c.target for c in p.copies} == {3, 4}
    p = plan([seg(1, 2)], cluster(4, dead=[2]), rf=3, cap=1)  # replacing the lost member goes first
    assert [c.replaces for c in p.copies] == [2]
    assert p.deferred == (CopyDeferred("t", 0, SegmentId(0), None),)
    assert "waits for a copy slot to add a member" in p.deferred[0].message()


def test_a_short_open_segment_is_rolled_once_another_node_can_join_and_not_before() -> None:
    assert plan([seg(1, 2, sealed=False)], cluster(3, dead=[3]), rf=3).rolls == ()
    p = plan([seg(1, 2, sealed=False, segment_id=4)], cluster(3), rf=3)
    assert (p.copies, p.rolls) == ((), (RollSegment("t", 0, SegmentId(4), None),))
    assert "fewer members than replication_factor" in p.rolls[0].message()
    # a draining node is no node to join
    assert plan([seg(1, 2, sealed=False)], cluster(3, draining=[3]), rf=3).rolls == ()


def test_under_replicated_lists_open_and_sealed_segments_in_order() -> None:
    segments = [seg(2, 3, 4, partition=1), seg(1, 2, 3, sealed=False), seg(3, 4, 5, partition=2)]
    nodes = cluster(5, dead=[1], draining=[2])
    found = under_replicated(segments, nodes)
    assert found == (
        UnderReplicated("t", 0, SegmentId(0), False, (NodeId(1), NodeId(2), NodeId(3)), (NodeId(1),), (NodeId(2),)),
        UnderReplicated("t", 1, SegmentId(0), True, (NodeId(2), NodeId(3), NodeId(4)), (), (NodeId(2),)),
    )
    assert found[0].live_count == 1
    assert found[0].message() == "t/0 segment 0 (open) has 1 of 3 members live (dead: node 1; draining: node 2)"


def test_under_replicated_with_a_replication_factor_lists_short_segments() -> None:
    segments = [seg(1, 2), seg(1, 2, 3, partition=1), seg(1, 3, partition=2, sealed=False)]
    found = under_replicated(segments, cluster(3, dead=[3]), replication_factor=3)
    assert [(u.partition, u.live_count, u.wanted) for u in found] == [(0, 2, 3), (1, 2, 3), (2, 1, 3)]
    assert found[0].message() == "t/0 segment 0 (sealed) has 2 of 3 members live (1 short of replication_factor)"
    assert found[2].message() == (
        "t/2 segment 0 (open) has 1 of 3 members live (dead: node 3; 1 short of replication_factor)"
    )
    assert [u.partition for u in under_replicated(segments, cluster(3, dead=[3]))] == [1, 2]


def test_drained_once_no_segment_lists_the_node() -> None:
    segments = [seg(1, 2, 3), seg(2, 3, 4, partition=1)]
    assert not drained(NodeId(4), segments)
    assert drained(NodeId(5), segments)
    nodes = cluster(5, draining=[4])
    (c,) = plan(segments, nodes).copies
    assert c.replaces == 4
    assert drained(NodeId(4), [segments[0], after_copy(segments[1], c)])


def test_after_copy_puts_the_target_in_the_replaced_members_place() -> None:
    assert after_copy(seg(1, 2, 3), copy(2, 5, 1)) == seg(5, 2, 3)
    assert after_copy(seg(1, 2, 3), copy(1, 5, 2)) == seg(1, 5, 3)  # ensemble[0] stays the node that opened it
    with pytest.raises(InvalidRepairInput, match="does not apply"):
        after_copy(seg(1, 2, 3), copy(2, 3, 1))
    with pytest.raises(InvalidRepairInput, match="does not apply"):
        after_copy(seg(1, 2, 3, partition=1), copy(2, 5, 1))


# --- errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("segments", "match"),
    [
        ([seg(1, 2, 9)], "lists node 9, not in the node table"),
        ([seg(1, 2), seg(2, 3)], "appears twice"),
        ([seg(1, 2, 1)], "lists a node twice"),
        ([seg()], "empty ensemble"),
        ([seg(1, size_gib=-1)], "size_bytes"),
    ],
)
def test_an_inconsistent_snapshot_is_refused(segments: list[SegmentView], match: str) -> None:
    with pytest.raises(InvalidRepairInput, match=match):
        plan(segments, cluster(3))
    with pytest.raises(InvalidRepairInput, match=match):
        under_replicated(segments, cluster(3))


def test_a_dead_node_without_down_since_is_refused() -> None:
    with pytest.raises(InvalidRepairInput, match="node 2: dead but no down_since_ms"):
        plan_repair(
            [seg(1, 2)], cluster(3, dead=[2]), down_since_ms={}, now_ms=0, repair_delay_ms=0, max_concurrent_copies=1
        )


def test_bad_settings_and_node_tables_are_refused() -> None:
    with pytest.raises(InvalidRepairInput, match="repair_delay_ms"):
        plan_repair([], [], down_since_ms={}, now_ms=0, repair_delay_ms=-1, max_concurrent_copies=1)
    with pytest.raises(InvalidRepairInput, match="max_concurrent_copies"):
        plan_repair([], [], down_since_ms={}, now_ms=0, repair_delay_ms=0, max_concurrent_copies=-1)
    with pytest.raises(InvalidPlacementRequest, match="appears twice"):
        plan([seg(1)], [node(1), node(1)])
    with pytest.raises(InvalidRepairInput, match="replication_factor=0"):
        plan([seg(1)], cluster(2), rf=0)
    with pytest.raises(InvalidRepairInput, match="replication_factor=0"):
        under_replicated([seg(1)], cluster(2), replication_factor=0)


# --- properties --------------------------------------------------------------------

# No deadline: the machine is shared, and one slow example is not a bug.
PROPERTY = settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def sites(draw: st.DrawFn) -> Site:
    """A site: nodes (some dead, some draining), segments on them (some below the replication factor, if one is
    given), copies under way (replacements and additions), a cap."""
    count = draw(st.integers(1, 8))
    nodes = [
        NodeLoad(
            NodeId(n),
            draw(st.integers(0, 100 * GiB)),
            draw(st.integers(0, 10)),
            draw(st.integers(0, 3).map(bool)),
            draw(st.integers(0, 5).map(lambda x: x == 0)),
        )
        for n in range(1, count + 1)
    ]
    ids = [n.node for n in nodes]
    down = {n.node: NOW_MS - draw(st.integers(0, 2 * DELAY_MS)) for n in nodes if not n.alive}
    keys = draw(
        st.lists(st.tuples(st.sampled_from("ab"), st.integers(0, 2), st.integers(0, 4)), unique=True, max_size=12)
    )
    segments = [
        SegmentView(
            topic,
            partition,
            SegmentId(segment_id),
            tuple(draw(st.lists(st.sampled_from(ids), min_size=1, max_size=min(3, count), unique=True))),
            draw(st.integers(0, 3).map(bool)),
            draw(st.integers(0, 5 * GiB)),
        )
        for topic, partition, segment_id in keys
    ]
    rf = draw(st.none() | st.integers(1, 4))
    running: list[CopySegment] = []
    for s in segments:
        outside = [n for n in ids if n not in s.ensemble]
        if s.sealed and outside and draw(st.integers(0, 4)) == 0:
            short = rf is not None and len(s.ensemble) < rf
            replaces = draw(st.sampled_from([*s.ensemble, None] if short else s.ensemble))
            running.append(
                CopySegment(
                    s.topic,
                    s.partition,
                    s.segment_id,
                    draw(st.sampled_from(s.ensemble)),
                    draw(st.sampled_from(outside)),
                    replaces,
                )
            )
    cap = draw(st.integers(0, 6))
    return segments, nodes, down, running, cap, rf


Site = tuple[list[SegmentView], list[NodeLoad], dict[NodeId, int], list[CopySegment], int, int | None]


def plan_site(site: Site, rnd: random.Random | None = None) -> RepairPlan:
    segments, nodes, down, running, cap, rf = site
    if rnd is not None:
        segments, nodes, running = list(segments), list(nodes), list(running)
        rnd.shuffle(segments)
        rnd.shuffle(nodes)
        rnd.shuffle(running)
    return plan_repair(
        segments,
        nodes,
        down_since_ms=down,
        now_ms=NOW_MS,
        repair_delay_ms=DELAY_MS,
        in_progress=running,
        max_concurrent_copies=cap,
        replication_factor=rf,
    )


def _short(s: SegmentView, rf: int | None) -> int:
    return 0 if rf is None else max(0, rf - len(s.ensemble))


def _additions(copies: Sequence[CopySegment]) -> collections.Counter[tuple[str, int, SegmentId]]:
    return collections.Counter(c.key for c in copies if c.replaces is None)


@PROPERTY
@given(sites(), st.randoms(use_true_random=False))
def test_property_same_input_same_plan_whatever_the_order(site: Site, rnd: random.Random) -> None:
    first = plan_site(site)
    assert plan_site(site) == first
    assert plan_site(site, rnd) == first


@PROPERTY
@given(sites())
def test_property_copies_are_safe(site: Site) -> None:
    """Never from a dead node, never to a member, a dead or draining node, or one without room; within the cap;
    never an ensemble past the replication factor; a roll of a healthy open segment only if a node can join."""
    segments, nodes, down, running, cap, rf = site
    by_id = {n.node: n for n in nodes}
    by_key = {s.key: s for s in segments}
    p = plan_site(site)
    assert len(p.copies) <= max(0, cap - len(running))
    planned = [(c.key, c.replaces) for c in p.copies if c.replaces is not None]
    assert len(planned) == len(set(planned))
    assert not set(planned) & {(c.key, c.replaces) for c in running}
    planned_targets = [(c.key, c.target) for c in p.copies]
    assert len(planned_targets) == len(set(planned_targets))
    added, adding = _additions(p.copies), _additions(running)
    for c in p.copies:
        s = by_key[c.key]
        assert s.sealed
        assert by_id[c.source].alive and c.source in s.ensemble
        assert c.target not in s.ensemble
        assert by_id[c.target].alive and not by_id[c.target].draining
        assert by_id[c.target].free_bytes >= s.size_bytes
        assert c.target not in {r.target for r in running if r.key == c.key}
        if c.replaces is None:
            assert rf is not None and len(s.ensemble) + added[c.key] + adding[c.key] <= rf
            continue
        gone = by_id[c.replaces]
        assert c.replaces in s.ensemble
        assert gone.draining or (not gone.alive and NOW_MS - down[c.replaces] >= DELAY_MS)
    for r in p.rolls:
        s = by_key[(r.topic, r.partition, r.segment_id)]
        assert not s.sealed
        if r.dead is None:
            assert _short(s, rf) and all(by_id[m].alive and not by_id[m].draining for m in s.ensemble)
            assert any(n.alive and not n.draining and n.node not in s.ensemble for n in nodes)
        else:
            assert not by_id[r.dead].alive or by_id[r.dead].draining


@PROPERTY
@given(sites())
def test_property_every_lost_member_is_accounted_for(site: Site) -> None:
    """Each dead or draining member of a segment, and each member a sealed one lacks to have the replication
    factor, shows up in the plan, once: nothing is dropped silently."""
    segments, nodes, _down, running, _cap, rf = site
    by_id = {n.node: n for n in nodes}
    p = plan_site(site)
    unavailable = {(u.topic, u.partition, u.segment_id) for u in p.unrepairable if isinstance(u, SegmentUnavailable)}
    rolled = [(r.topic, r.partition, r.segment_id) for r in p.rolls]
    assert len(rolled) == len(set(rolled))
    handled = collections.Counter(
        [
            *((c.key, c.replaces) for c in p.copies),
            *(((d.topic, d.partition, d.segment_id), d.replaces) for d in p.deferred),
            *(((w.topic, w.partition, w.segment_id), w.dead) for w in p.waiting),
            *(
                ((u.topic, u.partition, u.segment_id), u.replaces)
                for u in p.unrepairable
                if isinstance(u, NoRepairTarget)
            ),
        ]
    )
    assert all(n == 1 for (_, replaces), n in handled.items() if replaces is not None)
    busy = {(c.key, c.replaces) for c in running if c.replaces is not None}
    adding = _additions(running)
    expected: collections.Counter[tuple[tuple[str, int, SegmentId], NodeId | None]] = collections.Counter()
    for s in segments:
        lost = [m for m in s.ensemble if not by_id[m].alive or by_id[m].draining]
        joinable = any(n.alive and not n.draining and n.node not in s.ensemble for n in nodes)
        if all(not by_id[m].alive for m in s.ensemble):
            assert s.key in unavailable and s.key not in rolled
        elif not lost:
            assert s.key not in unavailable
            assert (s.key in rolled) == (not s.sealed and bool(_short(s, rf)) and joinable)
        elif not s.sealed:
            assert s.key in rolled
        if s.sealed and any(by_id[m].alive for m in s.ensemble):
            expected.update({(s.key, m): 1 for m in lost if (s.key, m) not in busy})
            expected[(s.key, None)] += max(0, _short(s, rf) - adding[s.key])
    assert +handled == +expected


@st.composite
def repairable_sites(draw: st.DrawFn) -> tuple[list[SegmentView], list[NodeLoad], int | None]:
    """Enough alive, non-draining nodes with room; every segment has an alive member; every dead node is due.
    With a replication factor, some segments have fewer members (they opened on fewer live nodes)."""
    rf = draw(st.integers(1, 4))
    healthy = draw(st.integers(rf, 8))
    lost = draw(st.lists(st.sampled_from(["dead", "draining", "dead+draining"]), max_size=4))
    nodes = [node(n, free_gib=draw(st.integers(40, 100)), load=draw(st.integers(0, 5))) for n in range(1, healthy + 1)]
    nodes += [
        node(healthy + 1 + i, alive=state == "draining", draining=state != "dead") for i, state in enumerate(lost)
    ]
    ids = [n.node for n in nodes]
    alive = {n.node for n in nodes if n.alive}
    given_rf = draw(st.booleans())
    segments = []
    for i in range(draw(st.integers(0, 20))):
        size = draw(st.integers(1, rf)) if given_rf else rf
        ensemble = draw(st.lists(st.sampled_from(ids), min_size=size, max_size=size, unique=True))
        if not alive & set(ensemble):
            continue
        segments.append(seg(*ensemble, partition=i % 4, segment_id=i, size_gib=draw(st.integers(0, 2))))
    return segments, nodes, rf if given_rf else None


@PROPERTY
@given(repairable_sites(), st.integers(1, 5))
def test_property_applying_the_plans_leaves_no_sealed_segment_under_replicated(
    site: tuple[list[SegmentView], list[NodeLoad], int | None], cap: int
) -> None:
    segments, nodes, rf = site
    by_key = {s.key: s for s in segments}
    down = {n.node: NOW_MS - DELAY_MS for n in nodes if not n.alive}
    lost = {n.node for n in nodes if not n.alive or n.draining}

    def left() -> int:
        return sum(1 for s in by_key.values() for m in s.ensemble if m in lost) + sum(
            _short(s, rf) for s in by_key.values()
        )

    needed = left()
    # Pass after pass, apply every planned copy. Each pass but the last uses every slot, so the loop ends within
    # ceil(needed / cap) + 1 passes.
    for passes in range(1, needed + 2):  # noqa: B007 (read after the loop)
        p = plan_repair(
            list(by_key.values()),
            nodes,
            down_since_ms=down,
            now_ms=NOW_MS,
            repair_delay_ms=DELAY_MS,
            max_concurrent_copies=cap,
            replication_factor=rf,
        )
        assert (p.unrepairable, p.waiting, p.rolls) == ((), (), ())
        if not p.copies:
            break
        assert len(p.copies) == min(cap, left())
        for c in p.copies:
            by_key[c.key] = after_copy(by_key[c.key], c)
    else:
        pytest.fail(f"repair did not converge in {needed + 1} passes")
    assert passes == 1 + -(-needed // cap)
    assert under_replicated(by_key.values(), nodes, replication_factor=rf) == ()
    assert all(drained(n, by_key.values()) for n in lost)
    assert rf is None or all(len(s.ensemble) == rf for s in by_key.values())
