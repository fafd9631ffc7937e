"""Deleting a topic on a multi-node site: the Raft state's half (cluster/site_state.py, ``MergeTopicEntry``).

A tombstone of the live incarnation removes the topic's partitions and chains and keeps the tombstone; a re-create
is the next incarnation, whose partitions start empty; commands about the deleted partitions are refused, never
applied to the next incarnation's; snapshots and log replay agree, including for a member that was down.
"""

from __future__ import annotations

import json

from cluster.site_state import (
    Command,
    CreateTopic,
    ElectLeader,
    MergeTopicEntry,
    NodeHeartbeat,
    OpenSegment,
    RefusalCode,
    RegisterNode,
    SealSegment,
    SiteState,
    TrimChain,
    command_from_dict,
)
from georep.metadata.topic_entry import create, delete, incarnation_deleted
from georep.metadata.topics import TopicSpec
from offsets.commits import OFFSETS_TOPIC
from offsets.coordinates import LocalOffset
from offsets.vector import VectorOffset
from tests.support.site_state import applied, refused
from topology.ids import LeaderEpoch, NodeId, SegmentId

N1, N2, N3 = NodeId(1), NodeId(2), NodeId(3)
ENSEMBLE = (N1, N2, N3)


def _log_through_writes() -> list[Command]:
    """Three nodes, topic ``t`` (2 partitions) led and written: t/0 has a sealed segment 0 and an open segment 1."""
    log: list[Command] = []
    for node in ENSEMBLE:
        log += [RegisterNode(node, f"10.0.0.{node}:9092"), NodeHeartbeat(node, 1_000, 1 << 40, 0)]
    log += [
        CreateTopic(TopicSpec("t", 2)),
        ElectLeader("t", 0, N1, LeaderEpoch(0)),
        OpenSegment("t", 0, LeaderEpoch(1), LocalOffset(0), ENSEMBLE),
        SealSegment("t", 0, LeaderEpoch(1), SegmentId(0), LocalOffset(500), VectorOffset.parse("a@1:500")),
        ElectLeader("t", 0, N2, LeaderEpoch(1)),
        OpenSegment("t", 0, LeaderEpoch(2), LocalOffset(500), (N2, N1, N3)),
        ElectLeader("t", 1, N3, LeaderEpoch(0)),
    ]
    return log


def _replayed(log: list[Command], state: SiteState | None = None) -> SiteState:
    state = state or SiteState()
    for command in log:
        state.apply(command_from_dict(json.loads(json.dumps(command.to_dict()))))  # the log's own form
    return state


def _tombstone(state: SiteState, name: str = "t") -> MergeTopicEntry:
    return MergeTopicEntry(delete(state.entries()[name], name, 5_000, "a"))


def test_a_tombstone_removes_the_topics_partitions_and_keeps_the_tombstone() -> None:
    state = _replayed(_log_through_writes())
    tombstone = _tombstone(state)
    applied(state, tombstone)
    assert state.topic("t") is None and state.topics() == {}
    assert state.partition("t", 0) is None and state.partition("t", 1) is None and state.partitions() == []
    held = state.entries()["t"]
    assert held.deleted and held.incarnation == 0
    assert not applied(state, tombstone).changed  # the same tombstone again (a sync's): nothing


def test_commands_about_the_deleted_partitions_are_refused_naming_the_delete() -> None:
    state = _replayed(_log_through_writes())
    applied(state, _tombstone(state))
    for command in (
        OpenSegment("t", 1, LeaderEpoch(1), LocalOffset(0), (N3, N1, N2)),
        SealSegment("t", 0, LeaderEpoch(2), SegmentId(1), LocalOffset(700), VectorOffset.parse("a@1:700")),
        ElectLeader("t", 0, N3, LeaderEpoch(2)),
        TrimChain("t", 0, SegmentId(1)),
    ):
        result = refused(state, command, RefusalCode.UNKNOWN_TOPIC)
        assert "was deleted" in result.reason, result.reason


def test_a_re_create_is_the_next_incarnation_and_starts_empty() -> None:
    state = _replayed(_log_through_writes())
    applied(state, _tombstone(state))
    applied(state, CreateTopic(TopicSpec("t", 3)))  # at this site: the state makes it incarnation 1
    spec = state.topic("t")
    assert spec is not None and spec.incarnation == 1 and spec.partitions == 3
    assert state.entries()["t"].incarnation == 1 and not state.entries()["t"].deleted
    for partition in range(3):
        info = state.partition("t", partition)
        assert info is not None and info.leader is None and info.segments == () and info.next_base_offset == 0
    # The deleted partition's leader of epoch 2 opens on the new partition 0: refused, never applied to it.
    refused(state, OpenSegment("t", 0, LeaderEpoch(2), LocalOffset(0), (N2, N1, N3)), RefusalCode.STALE_EPOCH)
    epoch = state.partition("t", 0).leader_epoch  # type: ignore[union-attr]
    assert epoch >= 2  # above every epoch the deleted incarnation reached
    applied(state, ElectLeader("t", 0, N1, epoch))
    opened = applied(state, OpenSegment("t", 0, LeaderEpoch(epoch + 1), LocalOffset(0), ENSEMBLE))
    assert opened.segment_id == 0  # segment ids from 0, offsets from 0


def test_a_re_create_received_by_topic_sync_takes_over_the_live_incarnation() -> None:
    """A site that hears of incarnation 1 before the tombstone of 0 (design: "Re-creation") drops 0 and makes 1."""
    state = _replayed(_log_through_writes())
    tombstone = delete(state.entries()["t"], "t", 5_000, "a")
    recreated = create("t", 1, {}, tombstone, 6_000, "a")
    applied(state, MergeTopicEntry(recreated))
    spec = state.topic("t")
    assert spec is not None and (spec.incarnation, spec.partitions) == (1, 1)
    assert state.partition("t", 1) is None
    assert state.partition("t", 0).segments == ()  # type: ignore[union-attr]
    assert not applied(state, MergeTopicEntry(tombstone)).changed  # the older tombstone, late: nothing


def test_the_group_offsets_topic_cannot_be_deleted() -> None:
    state = _replayed(_log_through_writes())
    applied(state, CreateTopic(TopicSpec(OFFSETS_TOPIC, 4)))
    result = refused(state, _tombstone(state, OFFSETS_TOPIC), RefusalCode.INVALID_TOPIC)
    assert "cannot be deleted" in result.reason
    assert state.partition(OFFSETS_TOPIC, 3) is not None


def test_snapshot_and_replay_give_the_same_state_and_a_member_that_was_down_learns_the_delete() -> None:
    """Node 3 was down from before the delete: it restores the snapshot it had and replays the log from there;
    another restores a snapshot taken after the re-create. All three hold the same state, and node 3's view says
    its copies of incarnation 0 go while any of incarnation 1 stay."""
    before = _log_through_writes()
    up = _replayed(before)
    down_snapshot = json.loads(json.dumps(up.snapshot()))
    after: list[Command] = [_tombstone(up), CreateTopic(TopicSpec("t", 2)), ElectLeader("t", 0, N1, LeaderEpoch(2))]
    _replayed(after, up)
    rejoined = _replayed(after, SiteState.restore(down_snapshot))
    installed = SiteState.restore(json.loads(json.dumps(up.snapshot())))
    assert rejoined == up and installed == up
    assert installed.partition("t", 0) == up.partition("t", 0)
    assert rejoined.snapshot()["epoch_floors"] == {"t": 2}
    entry = rejoined.entries()["t"]
    assert incarnation_deleted(entry, 0) and not incarnation_deleted(entry, 1)
    assert not incarnation_deleted(rejoined.entries().get("never-heard-of"), 0)
    # An earlier snapshot (before any delete) has no floors, and reads back equal: older snapshots still compare.
    assert "epoch_floors" not in down_snapshot and SiteState.restore(down_snapshot).snapshot() == down_snapshot
