"""Segment placement: each rule with concrete clusters, then properties.

What an operator relies on: every new segment gets ``replication_factor``
distinct nodes that can take it, the partition's leader among them (with a
floor, such as the ack quorum: every node that can, while fewer can, and
never fewer than the floor); a node that has just joined takes new segments
at the next roll without any data being moved; nodes that are dead,
draining or full are never chosen; segments spread over the nodes instead of
piling on a few; and when placement cannot be done, the error says which
nodes are missing and what to do.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.placement import (
    FREE_BUCKET_BYTES_MIN,
    InvalidPlacementRequest,
    LeaderNotEligible,
    NodeLoad,
    NotEnoughNodes,
    choose_ensemble,
    partition_salt,
    rank,
    tiebreak,
)
from tests.support.examples import examples
from topology.ids import NodeId

GiB = 1 << 30
MiB = 1 << 20


def node(n: int, free_gib: float = 100, load: int = 0, *, alive: bool = True, draining: bool = False) -> NodeLoad:
    return NodeLoad(NodeId(n), int(free_gib * GiB), load, alive, draining)


def healthy(*ids: int, free_gib: float = 100) -> list[NodeLoad]:
    return [node(i, free_gib) for i in ids]


def ids(*ns: int) -> tuple[NodeId, ...]:
    return tuple(NodeId(n) for n in ns)


# --- the rules one by one ----------------------------------------------------------


def test_leader_comes_first_and_the_ensemble_has_size_distinct_nodes() -> None:
    ensemble = choose_ensemble(healthy(1, 2, 3, 4, 5), 3, leader=NodeId(4))
    assert ensemble[0] == 4
    assert len(ensemble) == len(set(ensemble)) == 3


def test_without_a_leader_all_members_come_from_the_preference() -> None:
    nodes = [node(1, 10), node(2, 100), node(3, 100, load=1), node(4, 100)]
    assert choose_ensemble(nodes, 2, leader=None, salt=7) in {ids(2, 4), ids(4, 2)}


def test_size_one_with_a_leader_is_just_the_leader() -> None:
    assert choose_ensemble(healthy(1, 2, 3), 1, leader=NodeId(2)) == ids(2)


def test_the_node_with_much_more_free_space_is_preferred() -> None:
    nodes = [node(1), node(2), node(3, free_gib=1000), node(4)]
    assert choose_ensemble(nodes, 2, leader=NodeId(1)) == ids(1, 3)


def test_a_much_fuller_node_is_avoided() -> None:
    nodes = [node(1), node(2, free_gib=10), node(3), node(4)]
    assert all(NodeId(2) not in choose_ensemble(nodes, 3, leader=NodeId(1), salt=s) for s in range(20))


def test_among_similar_free_space_the_least_loaded_nodes_are_chosen() -> None:
    nodes = [node(1, load=5), node(2, load=3), node(3, load=0), node(4, load=1), node(5, load=2)]
    assert choose_ensemble(nodes, 3, leader=NodeId(1)) == ids(1, 3, 4)


def test_free_space_jitter_does_not_reshuffle_the_ensemble() -> None:
    loads = {1: 0, 2: 3, 3: 1, 4: 0, 5: 2}
    # Exactly equal free space: the load decides.
    exact = [NodeLoad(NodeId(n), 500 * GiB, load, True, False) for n, load in loads.items()]
    assert choose_ensemble(exact, 3, leader=NodeId(1), salt=3) == ids(1, 4, 3)
    # A few MiB either way, as writes land between two rolls: same ensemble. Node 5 has the most free space by
    # 50 MiB, which an exact comparison would put first.
    for jitter_mib in ([0, -7, 3, -40, 50], [12, 0, -1, 9, -3], [-50, 30, 0, 1, 2]):
        nodes = [
            NodeLoad(NodeId(n), 500 * GiB + j * MiB, load, True, False)
            for (n, load), j in zip(loads.items(), jitter_mib, strict=True)
        ]
        assert choose_ensemble(nodes, 3, leader=NodeId(1), salt=3) == ids(1, 4, 3)


def test_free_space_is_compared_from_the_emptiest_node_not_on_a_grid_from_zero() -> None:
    # 800 GiB largest: buckets are 100 GiB wide, counted down from 800 GiB, so 799 and 790 GiB share node 1's
    # bucket and the load decides. On a grid from zero, node 1 would sit alone in the top bucket (800 // 100 = 8,
    # 799 // 100 = 7) and draw every new segment.
    nodes = [node(1, 800, load=2), node(2, 799, load=0), node(3, 790, load=1)]
    assert tuple(n.node for n in rank(nodes, salt=0)) == ids(2, 3, 1)
    # A node a full bucket behind the emptiest one does rank after it, whatever its load.
    nodes = [node(1, 800, load=2), node(2, 699.9, load=0)]
    assert tuple(n.node for n in rank(nodes, salt=0)) == ids(1, 2)


def test_small_disks_are_compared_in_steps_of_at_least_one_gib() -> None:
    nodes = [NodeLoad(NodeId(1), 3 * GiB, 4, True, False), NodeLoad(NodeId(2), 3 * GiB - 500 * MiB, 0, True, False)]
    assert GiB == FREE_BUCKET_BYTES_MIN
    assert tuple(n.node for n in rank(nodes, salt=0)) == ids(2, 1)


def test_an_overloaded_node_ranks_after_the_others_even_with_the_most_free_space() -> None:
    # Node 5 has just joined with a big empty disk, and is already in many open segments.
    nodes = [node(1, load=2), node(2, load=2), node(3, load=2), node(4, load=2), node(5, free_gib=1000, load=10)]
    assert NodeId(5) not in choose_ensemble(nodes, 3, leader=NodeId(1))
    not_yet = [*nodes[:4], node(5, free_gib=1000, load=3)]
    assert NodeId(5) in choose_ensemble(not_yet, 3, leader=NodeId(1))


def test_ties_are_broken_by_a_salted_hash_so_partitions_spread() -> None:
    nodes = healthy(1, 2, 3, 4, 5, 6)
    picks = {choose_ensemble(nodes, 2, leader=None, salt=partition_salt("orders", p)) for p in range(50)}
    assert len(picks) > 10
    assert {m for pick in picks for m in pick} == set(ids(1, 2, 3, 4, 5, 6))


def test_the_tie_break_hash_is_pinned() -> None:
    # Golden values: changing the hash would move every partition's future segments after an upgrade.
    assert tiebreak(0, NodeId(1)) == 3763746035
    assert tiebreak(12345, NodeId(7)) == 1525974089
    assert partition_salt("orders", 3) == 3359572644
    nodes = healthy(1, 2, 3, 4, 5, 6)
    assert choose_ensemble(nodes, 3, leader=None, salt=partition_salt("orders", 0)) == ids(6, 5, 3)
    assert choose_ensemble(nodes, 3, leader=None, salt=partition_salt("orders", 1)) == ids(5, 1, 6)


def test_not_only_the_previous_ensemble() -> None:
    # Node 4 ranks last (more load), but 1, 2, 3 held the previous segment: one member must come from outside.
    nodes = [node(1), node(2), node(3), node(4, load=1)]
    ensemble = choose_ensemble(nodes, 3, leader=NodeId(1), previous=ids(1, 2, 3))
    assert ensemble[0] == 1
    assert NodeId(4) in ensemble
    assert len(set(ensemble) & {NodeId(2), NodeId(3)}) == 1


def test_a_node_that_just_joined_takes_new_segments_at_the_next_roll() -> None:
    # Three nodes, replication factor 3: every partition's segments are on 1, 2, 3. Node 4 joins, with a disk no
    # emptier than the others and the highest load of all; each partition's next roll puts a segment on it.
    nodes = [node(1, load=4), node(2, load=4), node(3, load=4), node(4, free_gib=90, load=5)]
    for partition in range(12):
        leader = NodeId(1 + partition % 3)
        ensemble = choose_ensemble(
            nodes, 3, leader=leader, previous=ids(1, 2, 3), salt=partition_salt("orders", partition)
        )
        assert ensemble[0] == leader
        assert NodeId(4) in ensemble


def test_dead_draining_excluded_and_full_nodes_are_never_chosen() -> None:
    nodes = [
        node(1),
        node(2, free_gib=1000, alive=False),
        node(3, free_gib=1000, draining=True),
        node(4, free_gib=1000),
        node(5, free_gib=0.5),
        node(6, free_gib=50),
        node(7, free_gib=60),
    ]
    ensemble = choose_ensemble(nodes, 3, leader=NodeId(1), exclude=[NodeId(4)], min_free_bytes=GiB)
    assert ensemble == ids(1, 7, 6)


# --- fewer eligible nodes than the size, down to min_size ---------------------------------


def test_with_min_size_every_eligible_node_is_taken_when_fewer_than_size() -> None:
    # Three nodes, replication factor 3, ack quorum 2: node 3 is down, the segment opens on the two that are up.
    nodes = [node(1), node(2), node(3, alive=False)]
    assert choose_ensemble(nodes, 3, leader=NodeId(2), min_size=2) == ids(2, 1)
    # Between min_size and size: five wanted, at least two, four eligible: all four, leader first.
    nodes = [node(1), node(2), node(3, draining=True), node(4), node(5, load=1)]
    ensemble = choose_ensemble(nodes, 5, leader=NodeId(4), min_size=2)
    assert ensemble[0] == 4 and set(ensemble) == set(ids(1, 2, 4, 5)) and len(ensemble) == 4
    # min_size == size is the whole-ensemble rule.
    with pytest.raises(NotEnoughNodes, match="need 5 eligible node"):
        choose_ensemble(nodes, 5, leader=NodeId(4), min_size=5)


def test_with_min_size_an_ensemble_is_never_short_while_more_nodes_are_eligible() -> None:
    nodes = healthy(1, 2, 3, 4)
    for salt in range(20):
        ensemble = choose_ensemble(nodes, 3, leader=NodeId(1), min_size=2, previous=ids(1, 2, 3), salt=salt)
        assert len(ensemble) == 3 and NodeId(4) in ensemble  # the previous-ensemble rule still applies
    # With every eligible node taken there is no outsider to swap in: the previous ensemble, short, it is.
    assert set(
        choose_ensemble([*healthy(1, 2), node(3, alive=False)], 3, leader=NodeId(1), min_size=2, previous=ids(1, 2, 3))
    ) == set(ids(1, 2))


def test_below_min_size_not_enough_nodes_names_the_floor_and_what_to_do() -> None:
    nodes = [node(1), node(2, alive=False), node(3, alive=False)]
    with pytest.raises(NotEnoughNodes) as caught:
        choose_ensemble(nodes, 3, leader=NodeId(1), min_size=2)
    err = caught.value
    assert (err.needed, err.wanted, err.eligible, err.dead) == (2, 3, ids(1), ids(2, 3))
    message = str(err)
    assert "need at least 2 eligible node(s) (an ensemble of 2 to 3), have 1 (node 1)" in message
    assert "node 2, node 3 dead" in message and "lower min_insync_replicas" in message


@pytest.mark.parametrize("min_size", [0, 4])
def test_a_min_size_outside_one_to_size_is_refused(min_size: int) -> None:
    with pytest.raises(InvalidPlacementRequest, match=f"min_size {min_size} is not between 1 and"):
        choose_ensemble(healthy(1, 2, 3), 3, leader=None, min_size=min_size)


# --- errors ------------------------------------------------------------------------


def test_not_enough_nodes_says_how_many_and_why_the_others_are_out() -> None:
    nodes = [node(1), node(2), node(3, alive=False), node(4, draining=True), node(5, free_gib=0.1)]
    with pytest.raises(NotEnoughNodes) as caught:
        choose_ensemble(nodes, 4, leader=NodeId(1), min_free_bytes=GiB)
    err = caught.value
    assert (err.needed, err.eligible, err.dead, err.draining, err.full) == (4, ids(1, 2), ids(3), ids(4), ids(5))
    message = str(err)
    assert "need 4 eligible node(s), have 2 (node 1, node 2)" in message
    assert "node 3 dead" in message
    assert "node 4 draining" in message
    assert "node 5 below" in message
    assert "Add nodes" in message
    assert "replication_factor" in message


def test_not_enough_nodes_without_a_leader() -> None:
    with pytest.raises(NotEnoughNodes, match=r"need 3 eligible node.s., have 2"):
        choose_ensemble([node(1), node(2), node(3, alive=False)], 3, leader=None)


@pytest.mark.parametrize("size", [0, -1])
def test_size_below_one_is_refused(size: int) -> None:
    with pytest.raises(InvalidPlacementRequest, match="at least one node"):
        choose_ensemble(healthy(1, 2, 3), size, leader=None)


def test_duplicate_node_ids_are_refused() -> None:
    with pytest.raises(InvalidPlacementRequest, match="node 2 appears twice"):
        choose_ensemble([node(1), node(2), node(2, free_gib=5)], 2, leader=None)


def test_negative_figures_are_refused() -> None:
    with pytest.raises(InvalidPlacementRequest, match=">= 0"):
        choose_ensemble([node(1), NodeLoad(NodeId(2), -1, 0, True, False)], 1, leader=None)
    with pytest.raises(InvalidPlacementRequest, match=">= 0"):
        choose_ensemble([node(1), node(2, load=-1)], 1, leader=None)
    with pytest.raises(InvalidPlacementRequest, match="min_free_bytes"):
        choose_ensemble([node(1)], 1, leader=None, min_free_bytes=-1)


def test_an_unknown_or_excluded_leader_is_refused() -> None:
    with pytest.raises(InvalidPlacementRequest, match="leader node 9 is not in the node table"):
        choose_ensemble(healthy(1, 2, 3), 2, leader=NodeId(9))
    with pytest.raises(InvalidPlacementRequest, match="leader node 1 is excluded"):
        choose_ensemble(healthy(1, 2, 3), 2, leader=NodeId(1), exclude=[NodeId(1)])


@pytest.mark.parametrize(
    ("leader", "why"),
    [(node(1, alive=False), "dead"), (node(1, draining=True), "draining"), (node(1, free_gib=0.1), "short of space")],
)
def test_a_leader_that_cannot_hold_the_segment_is_refused(leader: NodeLoad, why: str) -> None:
    with pytest.raises(LeaderNotEligible, match=f"leader node 1 is {why}.*move the partition's leadership"):
        choose_ensemble([leader, node(2), node(3)], 2, leader=NodeId(1), min_free_bytes=GiB)


# --- properties --------------------------------------------------------------------

# No deadline: the machine is shared, and one slow example is not a bug.
PROPERTY = settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.too_slow])

free_bytes = st.one_of(st.integers(0, 4 * GiB), st.integers(0, 4 << 40))


@st.composite
def cluster_of(draw: st.DrawFn, min_nodes: int = 1, max_nodes: int = 10) -> list[NodeLoad]:
    node_ids = draw(st.lists(st.integers(1, 60), min_size=min_nodes, max_size=max_nodes, unique=True))
    return [
        NodeLoad(
            NodeId(n),
            draw(free_bytes),
            draw(st.integers(0, 30)),
            draw(st.integers(0, 4).map(bool)),  # mostly alive
            draw(st.integers(0, 5).map(lambda x: x == 0)),  # mostly not draining
        )
        for n in node_ids
    ]


def eligible(nodes: Sequence[NodeLoad], exclude: Sequence[NodeId] = ()) -> set[NodeId]:
    return {n.node for n in nodes if n.alive and not n.draining and n.node not in exclude}


@st.composite
def requests(draw: st.DrawFn) -> tuple[list[NodeLoad], int, NodeId | None, list[NodeId], list[NodeId], int]:
    nodes = draw(cluster_of())
    all_ids = [n.node for n in nodes]
    size = draw(st.integers(1, 6))
    can_lead = sorted(eligible(nodes))
    leader = draw(st.none() | st.sampled_from(can_lead)) if can_lead else None
    previous = draw(st.lists(st.sampled_from(all_ids), unique=True, max_size=6))
    exclude = [n for n in draw(st.lists(st.sampled_from(all_ids), unique=True, max_size=3)) if n != leader]
    salt = draw(st.integers(0, 2**32 - 1))
    return nodes, size, leader, previous, exclude, salt


@PROPERTY
@given(requests())
def test_property_size_distinct_eligible_nodes_leader_first(
    request: tuple[list[NodeLoad], int, NodeId | None, list[NodeId], list[NodeId], int],
) -> None:
    nodes, size, leader, previous, exclude, salt = request
    can = eligible(nodes, exclude)
    try:
        ensemble = choose_ensemble(nodes, size, leader=leader, previous=previous, exclude=exclude, salt=salt)
    except NotEnoughNodes as err:
        assert len(can) < size
        assert err.needed == size
        assert set(err.eligible) == can
        return
    assert len(ensemble) == len(set(ensemble)) == size
    assert set(ensemble) <= can
    if leader is not None:
        assert ensemble[0] == leader


@PROPERTY
@given(requests(), st.integers(1, 6))
def test_property_with_min_size_as_many_eligible_nodes_as_there_are_up_to_size(
    request: tuple[list[NodeLoad], int, NodeId | None, list[NodeId], list[NodeId], int], floor: int
) -> None:
    nodes, size, leader, previous, exclude, salt = request
    floor = min(floor, size)
    can = eligible(nodes, exclude)
    try:
        ensemble = choose_ensemble(
            nodes, size, leader=leader, previous=previous, exclude=exclude, salt=salt, min_size=floor
        )
    except NotEnoughNodes as err:
        assert len(can) < floor
        assert (err.needed, err.wanted, set(err.eligible)) == (floor, size, can)
        return
    assert len(ensemble) == len(set(ensemble)) == min(size, len(can)) >= floor
    assert set(ensemble) <= can
    if leader is not None:
        assert ensemble[0] == leader
    if len(can) >= size:  # enough nodes: the same ensemble as without a floor
        assert ensemble == choose_ensemble(nodes, size, leader=leader, previous=previous, exclude=exclude, salt=salt)


@PROPERTY
@given(requests())
def test_property_some_member_besides_the_leader_is_new_when_a_new_one_is_eligible(
    request: tuple[list[NodeLoad], int, NodeId | None, list[NodeId], list[NodeId], int],
) -> None:
    nodes, size, leader, previous, exclude, salt = request
    others = eligible(nodes, exclude) - {leader} - set(previous)
    try:
        ensemble = choose_ensemble(nodes, size, leader=leader, previous=previous, exclude=exclude, salt=salt)
    except NotEnoughNodes:
        return
    members = ensemble[1:] if leader is not None else ensemble
    if others and members:
        assert set(members) - set(previous)


@PROPERTY
@given(cluster_of(min_nodes=1, max_nodes=6).map(lambda ns: [n for n in ns if n.alive and not n.draining]), st.data())
def test_property_a_fresh_node_is_chosen_at_the_next_roll(nodes: list[NodeLoad], data: st.DataObject) -> None:
    """The only eligible node outside the previous ensemble is chosen, however full or loaded it is."""
    if not nodes:
        return
    fresh = NodeLoad(NodeId(61), data.draw(free_bytes), data.draw(st.integers(0, 30)), True, False)
    previous = [n.node for n in nodes]
    leader = data.draw(st.none() | st.sampled_from(previous))
    size = data.draw(st.integers(2 if leader is not None else 1, len(nodes) + 1))
    ensemble = choose_ensemble([*nodes, fresh], size, leader=leader, previous=previous, salt=data.draw(st.integers()))
    assert fresh.node in ensemble


@PROPERTY
@given(cluster_of(min_nodes=2, max_nodes=10), st.data())
def test_property_a_fresh_empty_node_is_chosen_even_among_other_new_nodes(
    nodes: list[NodeLoad], data: st.DataObject
) -> None:
    """A joined node with the emptiest disk (a bucket ahead) is chosen whoever else is eligible."""
    can = sorted(eligible(nodes))
    if not can:
        return
    leader = data.draw(st.sampled_from(can))
    size = data.draw(st.integers(2, len(can) + 1))
    most = max(n.free_bytes for n in nodes)
    fresh = NodeLoad(NodeId(61), 2 * most + GiB, 0, True, False)
    previous = data.draw(st.lists(st.sampled_from(can), unique=True, max_size=size))
    ensemble = choose_ensemble([*nodes, fresh], size, leader=leader, previous=previous, salt=data.draw(st.integers()))
    assert fresh.node in ensemble


@PROPERTY
@given(requests(), st.randoms(use_true_random=False))
def test_property_deterministic_whatever_the_input_order(
    request: tuple[list[NodeLoad], int, NodeId | None, list[NodeId], list[NodeId], int], rnd: random.Random
) -> None:
    nodes, size, leader, previous, exclude, salt = request
    shuffled = list(nodes)
    rnd.shuffle(shuffled)
    try:
        first = choose_ensemble(nodes, size, leader=leader, previous=previous, exclude=exclude, salt=salt)
    except NotEnoughNodes as err:
        with pytest.raises(NotEnoughNodes) as again:
            choose_ensemble(shuffled, size, leader=leader, previous=previous, exclude=set(exclude), salt=salt)
        assert str(again.value) == str(err)
        return
    assert choose_ensemble(shuffled, size, leader=leader, previous=previous, exclude=set(exclude), salt=salt) == first


def roll_in_turn(node_count: int, rf: int, partitions_per_node: int, rounds: int) -> collections.Counter[NodeId]:
    """Roll every partition in turn, ``rounds`` times; count the segments each node was given.

    Leaders are spread round robin, as the metadata's leader balancing does. A roll seals the previous segment (its
    members lose one open segment and one GiB of free space) and opens the next on ``choose_ensemble``'s pick.
    """
    free = {NodeId(n): 1000 * GiB for n in range(1, node_count + 1)}
    load = dict.fromkeys(free, 0)
    ensembles: dict[int, tuple[NodeId, ...]] = {}
    held: collections.Counter[NodeId] = collections.Counter(dict.fromkeys(free, 0))
    for _ in range(rounds):
        for partition in range(partitions_per_node * node_count):
            previous = ensembles.get(partition, ())
            for m in previous:
                load[m] -= 1
                free[m] -= GiB
            nodes = [NodeLoad(n, free[n], load[n], True, False) for n in sorted(free)]
            ensemble = choose_ensemble(
                nodes,
                rf,
                leader=NodeId(1 + partition % node_count),
                previous=previous,
                salt=partition_salt("orders", partition),
            )
            for m in ensemble:
                load[m] += 1
                held[m] += 1
            ensembles[partition] = ensemble
    return held


@PROPERTY
@given(
    st.integers(2, 9).flatmap(lambda n: st.tuples(st.just(n), st.integers(2, min(n, 4)))),
    st.integers(1, 3),
    st.integers(3, 10),
)
def test_property_segments_spread_over_all_nodes(node_rf: tuple[int, int], per_node: int, rounds: int) -> None:
    node_count, rf = node_rf
    held = roll_in_turn(node_count, rf, per_node, rounds)
    mean = sum(held.values()) / node_count
    assert max(held.values()) - min(held.values()) <= mean / 4 + 2, held


@pytest.mark.parametrize("node_count", [2, 3, 5, 8, 12])
def test_partitions_placed_from_one_snapshot_spread(node_count: int) -> None:
    """A topic created with many partitions at once: every node gets within 25% of its share."""
    nodes = healthy(*range(1, node_count + 1))
    partitions = 100 * node_count
    for rf in range(1, node_count):
        held = collections.Counter(
            m
            for p in range(partitions)
            for m in choose_ensemble(nodes, rf, leader=None, salt=partition_salt("orders", p))
        )
        share = partitions * rf / node_count
        assert set(held) == {n.node for n in nodes}
        assert 0.75 * share <= min(held.values()) <= max(held.values()) <= 1.25 * share, (rf, held)
