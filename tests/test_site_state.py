"""The site's metadata state machine (cluster/site_state.py): unit tests and Hypothesis properties."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from cluster.site_state import (
    AddMember,
    Applied,
    Command,
    CreateTopic,
    ElectLeader,
    InvalidCommand,
    InvalidSnapshot,
    NodeHeartbeat,
    OpenSegment,
    PartitionInfo,
    ReadBarrier,
    RefusalCode,
    Refused,
    RegisterNode,
    RemoveNode,
    ReplaceMember,
    Result,
    SealSegment,
    SegmentState,
    SetDraining,
    SiteState,
    command_from_dict,
    next_leader_expiry_ms,
    partitions_without_leader,
    plan_leadership,
)
from georep.metadata.topics import InvalidTopic, TopicSpec
from offsets.coordinates import LocalOffset, Origin
from offsets.vector import VectorOffset
from tests.support.examples import examples
from tests.support.site_state import applied, refused
from topology.ids import InvalidNodeId, LeaderEpoch, NodeId, SegmentId

N1, N2, N3, N4, N5 = (NodeId(n) for n in (1, 2, 3, 4, 5))
E0, E1, E2 = LeaderEpoch(0), LeaderEpoch(1), LeaderEpoch(2)
S0, S1 = SegmentId(0), SegmentId(1)
SESSION_MS = 10_000
T = TypeVar("T")


def vec(text: str) -> VectorOffset:
    return VectorOffset.parse(text)


def site(nodes: tuple[NodeId, ...] = (N1, N2, N3, N4), now_ms: int = 1_000, topic: str = "t") -> SiteState:
    """Nodes registered and heartbeating at ``now_ms``, topic ``topic`` with 2 partitions."""
    state = SiteState()
    for node in nodes:
        applied(state, RegisterNode(node, f"10.0.0.{node}:9092"))
        applied(state, NodeHeartbeat(node, now_ms, 1 << 40, 0))
    applied(state, CreateTopic(TopicSpec(topic, 2)))
    return state


def led(state: SiteState, leader: NodeId = N1, ensemble: tuple[NodeId, ...] = (N1, N2, N3)) -> SiteState:
    """t/0 led by ``leader`` at epoch 1 with segment 0 open on ``ensemble``."""
    applied(state, ElectLeader("t", 0, leader, E0))
    applied(state, OpenSegment("t", 0, E1, LocalOffset(0), ensemble))
    return state


def part(state: SiteState, topic: str = "t", partition: int = 0) -> PartitionInfo:
    info = state.partition(topic, partition)
    assert info is not None
    return info


# -- commands: construction and the log format ----------------------------------------------------------

ONE_OF_EACH: list[Command] = [
    RegisterNode(N1, "10.0.0.1:9092"),
    NodeHeartbeat(N2, 123_456, 1 << 40, 3),
    SetDraining(N3, True),
    RemoveNode(N4),
    CreateTopic(TopicSpec("orders/eu", 3, {"retention_ms": 60_000})),
    ElectLeader("t", 1, N2, LeaderEpoch(7)),
    OpenSegment("t", 1, LeaderEpoch(8), LocalOffset(100), (N2, N1, N3)),
    SealSegment("t", 1, LeaderEpoch(8), SegmentId(4), LocalOffset(150), vec("a@1:40,b@2:10")),
    ReplaceMember("t", 1, SegmentId(4), N3, N4),
    AddMember("t", 1, SegmentId(4), N5, 3),
    ReadBarrier(),
]


@pytest.mark.parametrize("command", ONE_OF_EACH, ids=lambda c: c.KIND)
def test_every_command_round_trips_through_json(command: Command) -> None:
    raw = command.to_dict()
    assert raw["v"] == 1 and raw["kind"] == command.KIND
    assert command_from_dict(json.loads(json.dumps(raw))) == command


def test_the_log_format_is_plain_json_with_a_version_and_kind() -> None:
    seal = SealSegment("t", 0, E2, S1, LocalOffset(50), vec("a@1:40,b@2:10"))
    assert seal.to_dict() == {
        "v": 1,
        "kind": "seal_segment",
        "topic": "t",
        "partition": 0,
        "epoch": 2,
        "segment_id": 1,
        "end_offset": 50,
        "end_vector": {"a@1": 40, "b@2": 10},
    }


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"v": 2, "kind": "read_barrier"}, "format version 2"),
        ({"v": 1, "kind": "make_coffee"}, "unknown command kind 'make_coffee'"),
        ({"v": 1}, "unknown command kind None"),
        ([1, 2], "must be an object"),
        ({"v": 1, "kind": "register_node", "node": "1", "address": "h:1"}, "'node' must be an integer"),
        ({"v": 1, "kind": "register_node", "node": True, "address": "h:1"}, "'node' must be an integer"),
        ({"v": 1, "kind": "register_node", "node": 0, "address": "h:1"}, "invalid node id 0"),
        ({"v": 1, "kind": "set_draining", "node": 1, "draining": "yes"}, "'draining' must be true or false"),
        (
            {
                "v": 1,
                "kind": "open_segment",
                "topic": "t",
                "partition": 0,
                "epoch": 1,
                "base_offset": 0,
                "ensemble": [],
            },
            "at least one node",
        ),
        (
            {
                "v": 1,
                "kind": "seal_segment",
                "topic": "t",
                "partition": 0,
                "epoch": 1,
                "segment_id": 0,
                "end_offset": 5,
                "end_vector": {"not-an-origin": 5},
            },
            "invalid origin",
        ),
        ({"v": 1, "kind": "create_topic", "name": "a b", "partitions": 1, "config": {}}, "invalid topic name"),
        (
            {"v": 1, "kind": "add_member", "topic": "t", "partition": 0, "segment_id": 0, "node": 4},
            "'replication_factor' must be an integer",
        ),
    ],
)
def test_undecodable_commands_are_refused_with_the_reason(raw: Any, match: str) -> None:
    with pytest.raises(InvalidCommand, match=match):
        command_from_dict(raw)


def test_commands_that_make_no_sense_cannot_be_built() -> None:
    with pytest.raises(InvalidCommand, match="names a node twice"):
        OpenSegment("t", 0, E1, LocalOffset(0), (N1, N2, N1))
    with pytest.raises(InvalidCommand, match="at least one node"):
        OpenSegment("t", 0, E1, LocalOffset(0), ())
    with pytest.raises(InvalidCommand, match="base_offset is -1"):
        OpenSegment("t", 0, E1, LocalOffset(-1), (N1,))
    with pytest.raises(InvalidCommand, match="by itself"):
        ReplaceMember("t", 0, S0, N1, N1)
    with pytest.raises(InvalidCommand, match="replication_factor is 1"):
        AddMember("t", 0, S0, N4, 1)
    with pytest.raises(InvalidCommand, match="segment_id is -1"):
        AddMember("t", 0, SegmentId(-1), N4, 3)
    with pytest.raises(InvalidCommand, match="use host:port"):
        RegisterNode(N1, "no-port")
    with pytest.raises(InvalidCommand, match="free_bytes is -5"):
        NodeHeartbeat(N1, 0, -5, 0)
    with pytest.raises(InvalidNodeId):
        ElectLeader("t", 0, NodeId(0), E0)
    with pytest.raises(InvalidTopic):
        CreateTopic(TopicSpec("t", 0))
    with pytest.raises(InvalidTopic, match="unknown topic config"):
        CreateTopic(TopicSpec("t", 1, {"colour": 3}))


def test_apply_never_raises_even_for_a_non_command() -> None:
    result = SiteState().apply("not a command")  # type: ignore[arg-type]
    assert isinstance(result, Refused) and result.code is RefusalCode.INVALID_COMMAND


# -- nodes ------------------------------------------------------------------------------------------------


def test_register_heartbeat_and_liveness() -> None:
    state = SiteState()
    applied(state, RegisterNode(N1, "10.0.0.1:9092"))
    assert applied(state, RegisterNode(N1, "10.0.0.1:9092")).changed is False
    refused(state, RegisterNode(N2, "10.0.0.1:9092"), RefusalCode.ADDRESS_IN_USE)
    refused(state, NodeHeartbeat(N2, 5, 1, 0), RefusalCode.UNKNOWN_NODE)
    info = state.node(N1)
    assert info is not None and info.last_heartbeat_ms is None and not info.is_live(0, SESSION_MS)

    applied(state, NodeHeartbeat(N1, 1_000, 500, 2))
    assert applied(state, NodeHeartbeat(N1, 900, 1, 1)).changed is False, "a delayed heartbeat is ignored"
    info = state.node(N1)
    assert info is not None and (info.last_heartbeat_ms, info.free_bytes, info.load) == (1_000, 500, 2)
    assert [n.node for n in state.live_nodes(1_000 + SESSION_MS - 1, SESSION_MS)] == [N1]
    assert state.live_nodes(1_000 + SESSION_MS, SESSION_MS) == [], "expired exactly at the session timeout"

    applied(state, RegisterNode(N1, "10.0.0.9:9092"))  # moved host: keeps what it reported
    info = state.node(N1)
    assert info is not None and info.address == "10.0.0.9:9092" and info.free_bytes == 500


def test_draining_and_removing_a_node() -> None:
    state = led(site())
    applied(state, SetDraining(N4, True))
    assert applied(state, SetDraining(N4, True)).changed is False
    info = state.node(N4)
    assert info is not None and info.draining
    refused(state, SetDraining(N5, True), RefusalCode.UNKNOWN_NODE)

    assert "leads t/0" in refused(state, RemoveNode(N1), RefusalCode.NODE_IN_USE).reason
    assert "holds t/0 segment 0" in refused(state, RemoveNode(N2), RefusalCode.NODE_IN_USE).reason
    applied(state, RemoveNode(N4))
    assert state.node(N4) is None
    assert applied(state, RemoveNode(N4)).changed is False
    refused(state, ElectLeader("t", 1, N4, E0), RefusalCode.UNKNOWN_NODE)


# -- topics -------------------------------------------------------------------------------------------------


def test_create_topic_refuses_an_existing_one_as_a_value() -> None:
    state = site()
    result = refused(state, CreateTopic(TopicSpec("t", 5)), RefusalCode.TOPIC_EXISTS)
    assert "georep topic describe t" in result.reason
    assert state.topics() == {"t": TopicSpec("t", 2)}
    assert [(p.topic, p.partition, p.leader, p.leader_epoch, p.segments) for p in state.partitions()] == [
        ("t", 0, None, 0, ()),
        ("t", 1, None, 0, ()),
    ]
    refused(state, ElectLeader("nope", 0, N1, E0), RefusalCode.UNKNOWN_TOPIC)
    assert "partitions 0..1, not 2" in refused(state, ElectLeader("t", 2, N1, E0), RefusalCode.UNKNOWN_PARTITION).reason


# -- leader epochs ---------------------------------------------------------------------------------------


def test_elect_leader_is_a_compare_and_set_on_the_epoch() -> None:
    state = site()
    # two controllers plan from the same state: the first wins, the second is refused and changes nothing
    assert applied(state, ElectLeader("t", 0, N1, E0)).leader_epoch == E1
    result = refused(state, ElectLeader("t", 0, N2, E0), RefusalCode.STALE_EPOCH)
    assert "the epoch is 1 (leader node 1)" in result.reason
    assert (part(state).leader, part(state).leader_epoch) == (N1, E1)
    # a future epoch is refused as well: only the current one may be changed
    refused(state, ElectLeader("t", 0, N2, LeaderEpoch(5)), RefusalCode.STALE_EPOCH)
    # re-electing the same node still bumps the epoch (it fences its previous incarnation)
    assert applied(state, ElectLeader("t", 0, N1, E1)).leader_epoch == E2
    assert part(state, "t", 1).leader_epoch == E0, "partitions have their own epochs"


def test_while_a_segment_is_open_the_leader_comes_from_its_ensemble() -> None:
    state = led(site(), N1, (N1, N2, N3))
    assert (
        "not in the ensemble [1, 2, 3]"
        in refused(state, ElectLeader("t", 0, N4, E1), RefusalCode.NOT_IN_ENSEMBLE).reason
    )
    applied(state, ElectLeader("t", 0, N3, E1))
    # once sealed, any node may lead: there is nothing to recover
    applied(state, SealSegment("t", 0, E2, S0, LocalOffset(10), vec("a@1:10")))
    applied(state, ElectLeader("t", 0, N4, E2))


# -- the segment chain -----------------------------------------------------------------------------------


def test_open_segment_rules() -> None:
    state = site()
    refused(state, OpenSegment("t", 0, E0, LocalOffset(0), (N1,)), RefusalCode.STALE_EPOCH)  # no leader yet
    applied(state, ElectLeader("t", 0, N1, E0))
    refused(state, OpenSegment("t", 0, E0, LocalOffset(0), (N1,)), RefusalCode.STALE_EPOCH)
    assert (
        "must start at offset 0"
        in refused(state, OpenSegment("t", 0, E1, LocalOffset(5), (N1, N2)), RefusalCode.BASE_OFFSET_MISMATCH).reason
    )
    assert (
        "must start with its leader, node 1"
        in refused(state, OpenSegment("t", 0, E1, LocalOffset(0), (N2, N1)), RefusalCode.INVALID_ENSEMBLE).reason
    )
    refused(state, OpenSegment("t", 0, E1, LocalOffset(0), (N1, N5)), RefusalCode.UNKNOWN_NODE)

    opened = applied(state, OpenSegment("t", 0, E1, LocalOffset(0), (N1, N2, N3)))
    assert opened.segment_id == S0
    retry = applied(state, OpenSegment("t", 0, E1, LocalOffset(0), (N1, N2, N3)))
    assert (retry.changed, retry.segment_id) == (False, S0), "a retried open is a no-op"
    assert (
        "segment 0 of t/0 is still open"
        in refused(state, OpenSegment("t", 0, E1, LocalOffset(0), (N1, N4)), RefusalCode.SEGMENT_OPEN).reason
    )

    applied(state, SealSegment("t", 0, E1, S0, LocalOffset(42), vec("a@1:42")))
    refused(state, OpenSegment("t", 0, E1, LocalOffset(41), (N1, N4)), RefusalCode.BASE_OFFSET_MISMATCH)
    assert applied(state, OpenSegment("t", 0, E1, LocalOffset(42), (N1, N4))).segment_id == S1
    segments = part(state).segments
    assert [(s.segment_id, s.base_offset, s.ensemble, s.state, s.end_offset) for s in segments] == [
        (S0, 0, (N1, N2, N3), SegmentState.SEALED, 42),
        (S1, 42, (N1, N4), SegmentState.OPEN, None),
    ]
    assert part(state).open_segment == segments[1] and part(state).next_base_offset is None


def test_seal_segment_rules() -> None:
    state = led(site(), N1, (N1, N2, N3))
    applied(state, ElectLeader("t", 0, N2, E1))  # N1 is deposed; N2 recovers and seals N1's segment
    stale = refused(state, SealSegment("t", 0, E1, S0, LocalOffset(7), vec("a@1:7")), RefusalCode.STALE_EPOCH)
    assert "stop acting as leader of epoch 1" in stale.reason
    refused(state, SealSegment("t", 0, E2, SegmentId(3), LocalOffset(7), vec("a@1:7")), RefusalCode.UNKNOWN_SEGMENT)

    applied(state, SealSegment("t", 0, E2, S0, LocalOffset(5), vec("a@1:3,b@2:2")))
    again = applied(state, SealSegment("t", 0, E2, S0, LocalOffset(5), vec("b@2:2,a@1:3")))
    assert again.changed is False, "sealing again at the same end is a no-op"
    assert (
        "never changes"
        in refused(
            state, SealSegment("t", 0, E2, S0, LocalOffset(6), vec("a@1:4,b@2:2")), RefusalCode.END_MISMATCH
        ).reason
    )
    refused(state, SealSegment("t", 0, E2, S0, LocalOffset(5), vec("a@1:5")), RefusalCode.END_MISMATCH)

    applied(state, OpenSegment("t", 0, E2, LocalOffset(5), (N2, N3)))
    refused(state, SealSegment("t", 0, E2, S1, LocalOffset(4), vec("a@1:3,b@2:2")), RefusalCode.END_BEFORE_BASE)
    refused(state, SealSegment("t", 0, E2, S1, LocalOffset(9), vec("a@1:9")), RefusalCode.VECTOR_WENT_BACK)
    applied(state, SealSegment("t", 0, E2, S1, LocalOffset(5), vec("a@1:3,b@2:2")))  # an empty segment
    sealed = part(state).segments[1]
    assert (sealed.state, sealed.end_offset, sealed.end_vector) == (SegmentState.SEALED, 5, vec("a@1:3,b@2:2"))


def test_replace_member_repairs_sealed_segments_only() -> None:
    state = led(site(), N1, (N1, N2, N3))
    refused(state, ReplaceMember("t", 0, S0, N2, N4), RefusalCode.NOT_SEALED)
    applied(state, SealSegment("t", 0, E1, S0, LocalOffset(10), vec("a@1:10")))
    refused(state, ReplaceMember("t", 0, S1, N2, N4), RefusalCode.UNKNOWN_SEGMENT)
    refused(state, ReplaceMember("t", 0, S0, N2, N3), RefusalCode.INVALID_ENSEMBLE)
    refused(state, ReplaceMember("t", 0, S0, N2, N5), RefusalCode.UNKNOWN_NODE)

    applied(state, ReplaceMember("t", 0, S0, N2, N4))
    assert part(state).segments[0].ensemble == (N1, N4, N3), "the new member takes the old one's place"
    assert applied(state, ReplaceMember("t", 0, S0, N2, N4)).changed is False, "a retried repair is a no-op"
    # a second repair planned from the old state (N2 -> another node) lost the race
    assert (
        "another repair replaced it"
        in refused(state, ReplaceMember("t", 0, S0, N2, N5), RefusalCode.NOT_A_MEMBER).reason
    )


def test_add_member_widens_a_short_sealed_segment_up_to_the_replication_factor() -> None:
    state = led(site(), N1, (N1, N2))  # opened on two nodes, the ack quorum, while the others were down
    refused(state, AddMember("t", 0, S0, N3, 3), RefusalCode.NOT_SEALED)  # an open segment is rolled instead
    applied(state, SealSegment("t", 0, E1, S0, LocalOffset(10), vec("a@1:10")))
    refused(state, AddMember("t", 0, S1, N3, 3), RefusalCode.UNKNOWN_SEGMENT)
    refused(state, AddMember("t", 0, S0, N5, 3), RefusalCode.UNKNOWN_NODE)

    applied(state, AddMember("t", 0, S0, N3, 3))
    assert part(state).segments[0].ensemble == (N1, N2, N3), "the new member comes last; the opener stays first"
    assert applied(state, AddMember("t", 0, S0, N3, 3)).changed is False, "a retried repair is a no-op"
    # a second addition planned from the old state (to another node) would push it past the replication factor
    full = refused(state, AddMember("t", 0, S0, N4, 3), RefusalCode.ENSEMBLE_FULL)
    assert "already has 3 members" in full.reason and "node 4's copy is not needed" in full.reason
    assert part(state).segments[0].sealed and part(state).segments[0].end_offset == 10


# -- snapshot ------------------------------------------------------------------------------------------------


def test_snapshot_is_plain_json_and_restores() -> None:
    state = led(site(), N1, (N1, N2, N3))
    applied(state, SealSegment("t", 0, E1, S0, LocalOffset(10), vec("a@1:10")))
    applied(state, SetDraining(N4, True))
    raw = json.loads(json.dumps(state.snapshot()))
    assert raw["partitions"][0]["segments"][0] == {
        "segment_id": 0,
        "base_offset": 0,
        "ensemble": [1, 2, 3],
        "opened_epoch": 1,
        "state": "sealed",
        "end_offset": 10,
        "end_vector": {"a@1": 10},
    }
    restored = SiteState.restore(raw)
    assert restored == state and restored.snapshot() == state.snapshot()
    assert restored.copy() == state

    with pytest.raises(InvalidSnapshot, match="version 9"):
        SiteState.restore({**raw, "version": 9})
    with pytest.raises(InvalidSnapshot, match="t/1 is missing"):
        SiteState.restore({**raw, "partitions": raw["partitions"][:1]})
    with pytest.raises(InvalidSnapshot, match="'leader_epoch' must be an integer"):
        SiteState.restore({**raw, "partitions": [{**raw["partitions"][0], "leader_epoch": "1"}, raw["partitions"][1]]})


def test_copy_is_independent() -> None:
    state = site()
    twin = state.copy()
    applied(state, ElectLeader("t", 0, N1, E0))
    assert part(twin).leader is None and part(state).leader == N1


# -- the leadership controller ---------------------------------------------------------------------------


def test_plan_leadership_picks_a_live_member_of_the_open_ensemble() -> None:
    state = led(site(), N1, (N1, N2, N3))
    now_ms = 20_000
    applied(state, NodeHeartbeat(N2, 15_000, 1, 0))
    applied(state, NodeHeartbeat(N3, 16_000, 1, 0))  # the most recent: preferred
    applied(state, NodeHeartbeat(N4, 19_000, 1, 0))  # more recent still, but not in the ensemble
    plan = plan_leadership(state, now_ms, SESSION_MS)
    # t/0: N1 expired -> N3; t/1: no segment -> any live node, the most recent heartbeat (N4)
    assert plan == [ElectLeader("t", 0, N3, E1), ElectLeader("t", 1, N4, E0)]
    assert [(p.topic, p.partition) for p in partitions_without_leader(state, now_ms, SESSION_MS)] == [
        ("t", 0),
        ("t", 1),
    ]

    applied(state, SetDraining(N3, True))  # a draining member is the last resort
    assert plan_leadership(state, now_ms, SESSION_MS)[0] == ElectLeader("t", 0, N2, E1)

    for command in plan_leadership(state, now_ms, SESSION_MS):
        applied(state, command)
    assert plan_leadership(state, now_ms, SESSION_MS) == [], "nothing left to do once applied"


def test_plan_leadership_leaves_a_partition_offline_rather_than_elect_an_outsider() -> None:
    state = led(site(), N1, (N1, N2))
    applied(state, NodeHeartbeat(N3, 20_000, 1, 0))
    applied(state, NodeHeartbeat(N4, 20_000, 1, 0))
    plan = plan_leadership(state, 20_000, SESSION_MS)
    assert [(c.topic, c.partition) for c in plan] == [("t", 1)], "t/0's members N1 and N2 are both dead"
    applied(state, NodeHeartbeat(N1, 20_000, 1, 0))
    # t/0's leader is live again; t/1 goes to a node that leads nothing yet
    assert plan_leadership(state, 20_000, SESSION_MS) == [ElectLeader("t", 1, N3, E0)]


def test_plan_leadership_spreads_leaders_and_spares_the_controller() -> None:
    """Each election goes to the live candidate leading the fewest partitions (those planned before it count),
    and between equals not to the controller: its death also stops the metadata, so a partition it led would
    wait for a Raft election and a settling controller before it got a new leader."""
    state = site((N1, N2, N3), topic="u")
    applied(state, CreateTopic(TopicSpec("t", 4)))
    for node, at in ((N1, 1_300), (N2, 1_200), (N3, 1_100)):  # N1 heartbeated last: it used to get everything
        applied(state, NodeHeartbeat(node, at, 1, 0))
    plan = plan_leadership(state, 1_400, SESSION_MS, controller=N1)
    by_node = {n: [(c.topic, c.partition) for c in plan if c.node == n] for n in (N1, N2, N3)}
    assert sorted(len(v) for v in by_node.values()) == [2, 2, 2], by_node
    assert plan[0].node == N2 and plan[1].node == N3, "the controller only once the others lead as many"
    for command in plan:
        applied(state, command)

    # N2 dies: its partitions go to the member of their open segment that leads fewer, not the controller
    for topic, index in by_node[N2]:
        applied(state, OpenSegment(topic, index, E1, LocalOffset(0), (N2, N1, N3)))
    applied(state, NodeHeartbeat(N1, 1_400 + SESSION_MS, 1, 0))
    applied(state, NodeHeartbeat(N3, 1_400 + SESSION_MS, 1, 0))
    replan = plan_leadership(state, 1_400 + SESSION_MS, SESSION_MS, controller=N1)
    assert [(c.topic, c.partition) for c in replan] == by_node[N2]
    assert [c.node for c in replan] == [N3, N1], "N3 first (it leads no more than N1, and is not the controller)"


def test_the_controller_looks_again_when_the_first_leaders_session_expires() -> None:
    state = led(site(), N2, (N2, N1, N3))  # t/0 led by N2, which heartbeated at 1_000; t/1 has no leader
    applied(state, NodeHeartbeat(N1, 5_000, 1, 0))
    applied(state, NodeHeartbeat(N3, 5_000, 1, 0))
    assert next_leader_expiry_ms(state, 5_000, SESSION_MS) == 1_000 + SESSION_MS
    assert [c.partition for c in plan_leadership(state, 1_000 + SESSION_MS - 1, SESSION_MS)] == [1], "t/0 is led"
    assert [c.partition for c in plan_leadership(state, 1_000 + SESSION_MS, SESSION_MS)] == [0, 1], "expired"
    assert next_leader_expiry_ms(state, 1_000 + SESSION_MS, SESSION_MS) is None, "no session expires later"


def test_plan_leadership_with_no_live_node_plans_nothing() -> None:
    assert plan_leadership(site(), 1_000 + SESSION_MS, SESSION_MS) == []


# -- properties -------------------------------------------------------------------------------------------

TOPICS = ("t", "u")
NODES = (N1, N2, N3, N4, N5)
ORIGINS = ("a@1", "b@2", "c@3")


class Draw:
    """Draws from small integer ranges only: building a composite strategy per step is far slower to validate."""

    def __init__(self, data: st.DataObject) -> None:
        self._data = data

    def number(self, low: int, high: int) -> int:
        return low if low == high else self._data.draw(st.integers(low, high))

    def pick(self, options: Sequence[T]) -> T:
        return options[self.number(0, len(options) - 1)]

    def often(self, plausible: T, anything: Callable[[], T]) -> T:
        """``plausible`` two times in three, else ``anything()``."""
        return plausible if self.number(0, 2) else anything()

    def node(self) -> NodeId:
        return self.pick(NODES)

    def nodes(self, size_max: int) -> list[NodeId]:
        out: list[NodeId] = []
        for _ in range(self.number(0, size_max)):
            node = self.node()
            if node not in out:
                out.append(node)
        return out


def _vector_near(draw: Draw, base: VectorOffset) -> VectorOffset:
    if draw.number(0, 2):
        out = base
        for _ in range(draw.number(0, 3)):
            origin = Origin.parse(draw.pick(ORIGINS))
            out = out.advanced(origin, out.get(origin) + draw.number(0, 5))
        return out
    return vec(",".join(f"{name}:{draw.number(0, 30)}" for name in ORIGINS[: draw.number(0, 3)]))


def draw_command(draw: Draw, state: SiteState) -> Command:
    """A command for ``state``: mostly plausible (registered nodes, current epochs, the partition's natural next
    step), some not, so that both the accepted paths and the refusals are exercised."""
    partitions = state.partitions()
    registered = sorted(state.nodes())

    def node() -> NodeId:
        return draw.often(draw.pick(registered), draw.node) if registered else draw.node()

    if not partitions or registered == [] or draw.number(0, 3) == 0:
        kind = draw.number(0, 6)
        if kind == 0:
            new_node = draw.node()
            return RegisterNode(new_node, f"10.0.0.{draw.often(new_node, draw.node)}:9092")
        if kind == 1:
            return NodeHeartbeat(node(), draw.number(0, 40_000), draw.number(0, 1 << 40), draw.number(0, 9))
        if kind == 2:
            return SetDraining(node(), bool(draw.number(0, 1)))
        if kind == 3:
            return RemoveNode(node())
        if kind == 4:
            return CreateTopic(TopicSpec(draw.pick(TOPICS), draw.number(1, 2)))
        if kind == 5:
            return ReadBarrier()
        return ElectLeader(draw.pick(TOPICS), draw.number(0, 2), node(), LeaderEpoch(draw.number(0, 3)))

    info = draw.often(partitions[0], lambda: draw.pick(partitions))  # deeper chains on one partition
    where = (info.topic, info.partition)
    epoch = LeaderEpoch(draw.often(int(info.leader_epoch), lambda: draw.number(0, info.leader_epoch + 2)))
    open_segment = info.open_segment
    # the partition's natural next step: elect a leader, open a segment, seal it (or change leaders), repair
    if info.leader is None:
        natural = 0
    elif open_segment is None:
        natural = 1
    else:
        natural = draw.pick((0, 2, 2))
    action = draw.often(natural, lambda: draw.number(0, 3))
    if action == 0:
        members = open_segment.ensemble if open_segment is not None else registered
        return ElectLeader(*where, draw.often(draw.pick(members), draw.node), epoch)
    if action == 1:
        base = info.next_base_offset
        if base is None:
            base_offset = LocalOffset(draw.number(0, 40))
        else:
            base_offset = LocalOffset(draw.often(int(base), lambda: draw.number(0, 40)))
        others = [node() for _ in range(draw.number(0, 3))]
        if info.leader is not None and draw.number(0, 3):
            ensemble = tuple(dict.fromkeys([info.leader, *others]))[:3]
        else:
            ensemble = tuple(dict.fromkeys(others)) or (node(),)
        return OpenSegment(*where, epoch, base_offset, ensemble)
    if not info.segments:
        return ElectLeader(*where, node(), epoch)
    last = draw.often(info.segments[-1], lambda: draw.pick(info.segments))
    segment_id = SegmentId(draw.often(int(last.segment_id), lambda: draw.number(0, last.segment_id + 1)))
    if action == 2:
        end_offset = LocalOffset(draw.number(last.base_offset, last.base_offset + 20))
        end_vector = _vector_near(draw, info.sealed_vector_before(last.segment_id))
        return SealSegment(*where, epoch, segment_id, end_offset, end_vector)
    sealed = [s for s in info.segments if s.sealed] or [last]
    target = draw.pick(sealed)
    new = node()
    if draw.number(0, 2) == 0:
        return AddMember(*where, target.segment_id, new, draw.often(3, lambda: draw.number(2, 4)))
    old = draw.often(draw.pick(target.ensemble), draw.node)
    return ReplaceMember(*where, target.segment_id, old, new) if new != old else ReadBarrier()


def run(data: st.DataObject, steps_max: int = 40) -> tuple[list[Command], list[Result], list[dict[str, Any]]]:
    """Apply a drawn sequence to a fresh state, checking the invariants after every step."""
    state = SiteState()
    commands: list[Command] = []
    results: list[Result] = []
    snapshots: list[dict[str, Any]] = [state.snapshot()]
    leader_of_epoch: dict[tuple[str, int, int], NodeId] = {}
    for _ in range(data.draw(st.integers(0, steps_max))):
        before = state.copy()
        command = draw_command(Draw(data), state)
        result = state.apply(command)
        note(f"{command} -> {result}")
        commands.append(command)
        results.append(result)
        snapshots.append(state.snapshot())
        check_step(before, command, result, state)
        check_invariants(state, leader_of_epoch)
    return commands, results, snapshots


def check_step(before: SiteState, command: Command, result: Result, after: SiteState) -> None:
    if isinstance(result, Refused) or not result.changed:
        assert after == before, f"{command} -> {result} changed the state"
    if isinstance(command, ElectLeader):
        old = before.partition(command.topic, command.partition)
        new = after.partition(command.topic, command.partition)
        if isinstance(result, Applied):
            assert old is not None and new is not None
            assert command.expected_epoch == old.leader_epoch, "a leader was elected against a stale epoch"
            assert (new.leader, new.leader_epoch) == (command.node, old.leader_epoch + 1)
            assert result.leader_epoch == new.leader_epoch
        elif old is not None and command.expected_epoch != old.leader_epoch:
            assert result.code is RefusalCode.STALE_EPOCH
    if isinstance(command, OpenSegment | SealSegment) and isinstance(result, Applied) and result.changed:
        old = before.partition(command.topic, command.partition)
        assert old is not None and command.epoch == old.leader_epoch, "a segment changed under a stale epoch"
    if isinstance(command, AddMember) and isinstance(result, Applied) and result.changed:
        old = before.partition(command.topic, command.partition)
        new = after.partition(command.topic, command.partition)
        assert old is not None and new is not None
        was, now = old.segment(command.segment_id), new.segment(command.segment_id)
        assert was is not None and now is not None and was.sealed, "only a sealed segment gets a member"
        assert now.ensemble == (*was.ensemble, command.node) and len(now.ensemble) <= command.replication_factor


def check_invariants(state: SiteState, leader_of_epoch: dict[tuple[str, int, int], NodeId]) -> None:
    for info in state.partitions():
        where = (info.topic, info.partition)
        # epochs only increase, and one epoch has one leader
        previous = [e for (t, p, e) in leader_of_epoch if (t, p) == where]
        assert info.leader_epoch >= max(previous, default=0)
        if info.leader is not None:
            key = (*where, info.leader_epoch)
            assert leader_of_epoch.setdefault(key, info.leader) == info.leader, f"two leaders for epoch {key}"
            assert state.node(info.leader) is not None
        else:
            assert info.leader_epoch == 0
        # the chain is contiguous, ids go 0, 1, 2, ..., and at most the last segment is open
        expected_base = 0
        end_vector = VectorOffset()
        for index, segment in enumerate(info.segments):
            assert segment.segment_id == index
            assert segment.base_offset == expected_base, f"{where} segment {index} does not start at the sealed end"
            assert segment.opened_epoch <= info.leader_epoch
            assert len(set(segment.ensemble)) == len(segment.ensemble) >= 1
            if segment.sealed:
                assert segment.end_offset is not None and segment.end_vector is not None
                assert segment.end_offset >= segment.base_offset
                assert end_vector <= segment.end_vector, "origin seqs went back"
                expected_base, end_vector = segment.end_offset, segment.end_vector
            else:
                assert index == len(info.segments) - 1, f"{where}: segment {index} is open but not the last"
                assert segment.end_offset is None and segment.end_vector is None
                assert info.leader in segment.ensemble, "the leader of an open segment is one of its members"
        for segment in info.segments:
            for member in segment.ensemble:
                assert state.node(member) is not None, "a segment member was removed"


PROPERTY = settings(max_examples=examples(100), deadline=None)


@PROPERTY
@given(st.data())
def test_replaying_the_log_gives_the_same_state_and_results(data: st.DataObject) -> None:
    commands, results, snapshots = run(data)
    # what the other nodes do: decode each entry from the log and apply it to their own state
    log = [json.loads(json.dumps(c.to_dict())) for c in commands]
    replica = SiteState()
    assert [replica.apply(command_from_dict(entry)) for entry in log] == results
    assert replica.snapshot() == snapshots[-1]

    # a node that restarts from a dump taken midway, then replays the rest, ends in the same state
    cut = data.draw(st.integers(0, len(commands)), label="dump at")
    restored = SiteState.restore(json.loads(json.dumps(snapshots[cut])))
    assert restored.snapshot() == snapshots[cut]
    for entry in log[cut:]:
        restored.apply(command_from_dict(entry))
    assert restored.snapshot() == snapshots[-1]


@PROPERTY
@given(st.data(), st.integers(0, 40_000), st.sampled_from([1_000, 10_000, 30_000]))
def test_plan_leadership_only_elects_live_ensemble_members(data: st.DataObject, now_ms: int, session_ms: int) -> None:
    _, _, snapshots = run(data)
    state = SiteState.restore(snapshots[-1])
    plan = plan_leadership(state, now_ms, session_ms)
    assert plan == plan_leadership(state.copy(), now_ms, session_ms), "deterministic"
    live = {info.node for info in state.live_nodes(now_ms, session_ms)}
    planned = [(c.topic, c.partition) for c in plan]
    assert len(planned) == len(set(planned)), "one election per partition"
    for info in state.partitions():
        where = (info.topic, info.partition)
        open_segment = info.open_segment
        pool = live & set(open_segment.ensemble) if open_segment is not None else live
        needs_leader = info.leader is None or info.leader not in live
        assert (where in planned) == (needs_leader and bool(pool)), f"{where}: planned iff leaderless with a candidate"
    for command in plan:
        info = part(state, command.topic, command.partition)
        assert command.node in live
        assert command.expected_epoch == info.leader_epoch
        if info.open_segment is not None:
            assert command.node in info.open_segment.ensemble
        assert isinstance(state.apply(command), Applied)
    assert plan_leadership(state, now_ms, session_ms) == [], "every planned election applied"
