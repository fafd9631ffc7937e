"""The node's shells carry out the pure node's judgments (issue 21): the member's store applies
``cluster.member``'s rules (a resent batch it holds is acked again, a gap names the end to resend from), and a
node records the seals its view shows in its guards, as both cluster simulators do."""

from __future__ import annotations

import ast
import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cluster.quorum import NotContiguous, SegmentSealed
from cluster.site_state import (
    Applied,
    Command,
    CreateTopic,
    ElectLeader,
    NodeHeartbeat,
    OpenSegment,
    RegisterNode,
    Result,
    SealSegment,
    SiteState,
)
from georep.metadata.topics import TopicSpec
from georep.server.cluster_member import ClusterConfig, ClusterMember
from georep.storage.replica_store import ReplicaStore
from offsets.coordinates import LocalOffset
from offsets.vector import VectorOffset
from tests.support.segments import A, B, Writer, open_log, read_all
from tests.support.site_state import applied
from topology.ids import LeaderEpoch, NodeId, SegmentId

KEY = ("t", 0)
SEG = SegmentId(0)
E1, E2 = LeaderEpoch(1), LeaderEpoch(2)
N1, N2, N3, N4 = (NodeId(n) for n in (1, 2, 3, 4))


def leader_batches(tmp_path: Path, count: int) -> list[bytes]:
    log = open_log(tmp_path / "leader")
    w = Writer(log)
    for i in range(count):
        w.append((A, B)[i % 2], 1 + i % 3)
    batches = read_all(log)
    log.close()
    return batches


def test_a_member_acks_a_batch_it_holds_again_and_names_where_a_gap_starts(tmp_path: Path) -> None:
    batches = leader_batches(tmp_path, 3)
    store = ReplicaStore(tmp_path / "node", now_ms=0)
    try:
        store.open_segment(KEY, E1, SEG, 0, {}, now_ms=0)
        store.append(KEY, E1, SEG, batches[0] + batches[1])
        end = store.end_offset(KEY, SEG)
        # The leader resends from the end it last knew (a reconnection): what the member holds is not stored twice
        # and the stream goes on, where the member used to break it.
        assert store.append(KEY, E1, SEG, batches[1] + batches[2]) > end
        assert read_all_copy(store) == b"".join(batches)
        with pytest.raises(NotContiguous) as gap:
            store.append(KEY, E1, SEG, leader_batches(tmp_path / "other", 5)[4])
        assert gap.value.local_end == store.end_offset(KEY, SEG)
    finally:
        store.close()


def read_all_copy(store: ReplicaStore) -> bytes:
    return bytes(store.read(KEY, SEG, LocalOffset(0), 1 << 24).data)


class ViewOnly:
    """A site's metadata that shows one view and confirms every proposal (heartbeats) without applying it."""

    def __init__(self, state: SiteState) -> None:
        self._state = state

    def state(self) -> SiteState:
        return self._state

    def propose(self, command: Command, timeout_s: float | None = None) -> Result:
        return Applied()

    def read_barrier(self, timeout_s: float | None = None) -> None:
        pass

    def watch(self, callback: Callable[[], None]) -> None:
        pass

    @property
    def is_leader(self) -> bool:
        return False

    @property
    def led_for_s(self) -> float | None:
        return None


def sealed_chain() -> SiteState:
    """``t``/0 led by node 1 in epoch 1: segment 0 on nodes 1-3 sealed at 10, segment 1 open."""
    state = SiteState()
    for node in (N1, N2, N3, N4):
        applied(state, RegisterNode(node, f"10.0.0.{node}:9092"))
        applied(state, NodeHeartbeat(node, 1_000, 1 << 40, 0))
    applied(state, CreateTopic(TopicSpec("t", 1)))
    applied(state, ElectLeader("t", 0, N1, LeaderEpoch(0)))
    applied(state, OpenSegment("t", 0, E1, LocalOffset(0), (N1, N2, N3)))
    applied(state, SealSegment("t", 0, E1, SEG, LocalOffset(10), VectorOffset({A: 10})))
    applied(state, OpenSegment("t", 0, E1, LocalOffset(10), (N1, N2, N3)))
    return state


def test_a_node_records_the_seals_its_view_shows_even_of_segments_it_holds_no_copy_of(tmp_path: Path) -> None:
    store = ReplicaStore(tmp_path / "node", now_ms=0)
    executor = ThreadPoolExecutor(2)
    member = ClusterMember(
        N4,
        "10.0.0.4:9092",
        ViewOnly(sealed_chain()),
        store,
        executor,
        lambda: 2_000,
        lambda: 1 << 40,
        ClusterConfig(session_timeout_ms=60_000),
    )
    try:
        asyncio.run(member.tick())
        # A deposed leader (epoch 1, cut off when segment 0 was sealed) tries to have this node copy segment 0: the
        # node knows it is sealed, from its view alone.
        with pytest.raises(SegmentSealed):
            store.open_segment(KEY, E1, SEG, 0, {}, now_ms=0)
        store.close()
        reopened = ReplicaStore(tmp_path / "node", now_ms=0)  # the guard is on disk
        with pytest.raises(SegmentSealed):
            reopened.open_segment(KEY, E2, SEG, 0, {}, now_ms=0)
        reopened.close()
    finally:
        executor.shutdown(wait=True)


# The rules a multi-node site's node decides by; their one home is cluster/node.py and what it drives
# (cluster/lead.py, cluster/member.py, cluster/controller.py). A shell that names one keeps its own copy of it.
RULES = {
    "role_step",
    "plan_open",
    "roll_seal_at",
    "plan_leadership",
    "SegmentRecovery",
    "SegmentQuorum",
    "cut_after_seal",
    "check_append",
    "node_loads",
    "plan_repair",
}
SHELLS = (
    "georep/server/cluster_member.py",
    "georep/server/ensemble.py",
    "georep/server/recovery.py",
    "georep/storage/replica_store.py",
    "georep/server/site_repair.py",
)


def names_used(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            out.update(alias.name for alias in node.names)
    return out


@pytest.mark.parametrize("shell", SHELLS)
def test_the_nodes_shells_name_no_rule_of_the_node_core(shell: str) -> None:
    root = Path(__file__).resolve().parent.parent
    assert names_used(root / shell) & RULES == set(), f"{shell} decides what cluster/node.py decides"
