"""The Raft metadata store (georep/raft/store.py): real pysyncobj nodes on 127.0.0.1, three in one process.

Each SyncObj runs its own tick thread. Every wait polls with a deadline, and the fixture closes every store it
started, so a failing test neither hangs nor leaks a thread or a socket.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.site_state import (
    Applied,
    CreateTopic,
    ElectLeader,
    OpenSegment,
    RefusalCode,
    Refused,
    RegisterNode,
    SealSegment,
    SiteState,
)
from georep.metadata.store import MetadataStore, TopicExists, UnknownTopic
from georep.metadata.topics import TopicSpec
from georep.raft.store import NoRaftLeader, RaftMetadataStore, RaftStartError, RaftTiming
from offsets.coordinates import LocalOffset
from offsets.vector import VectorOffset
from tests.support.raft import FAST, WAIT_S, Site, ok, populate
from topology.ids import LeaderEpoch, NodeId, SegmentId


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    s = Site(tmp_path)
    yield s
    s.close()  # the finalizer: every SyncObj the test started is destroyed, whatever happened


def test_writes_through_any_node_are_applied_everywhere(site: Site) -> None:
    site.start()
    store: MetadataStore = site[1]  # the port the broker uses
    # every write is proposed through a different node; the leader may be any of them
    for i, node in enumerate((1, 2, 3)):
        ok(site[i].propose(RegisterNode(NodeId(node), f"127.0.0.1:{9000 + node}")))
    store.create_topic(TopicSpec("t", 2, {"retention_ms": 60_000}))
    assert site[1].topics() == {"t": TopicSpec("t", 2, {"retention_ms": 60_000})}, "the proposer reads its write"
    with pytest.raises(TopicExists):
        site[2].create_topic(TopicSpec("t", 3))
    with pytest.raises(UnknownTopic):
        site[0].get("nope")

    assert ok(site[2].propose(ElectLeader("t", 0, NodeId(1), LeaderEpoch(0)))).leader_epoch == 1
    stale = site[0].propose(ElectLeader("t", 0, NodeId(2), LeaderEpoch(0)))
    assert isinstance(stale, Refused) and stale.code is RefusalCode.STALE_EPOCH, "a refusal is a value"
    ensemble = (NodeId(1), NodeId(2), NodeId(3))
    assert ok(site[0].propose(OpenSegment("t", 0, LeaderEpoch(1), LocalOffset(0), ensemble))).segment_id == 0
    seal = SealSegment("t", 0, LeaderEpoch(1), SegmentId(0), LocalOffset(10), VectorOffset.parse("a@1:10"))
    ok(site[1].propose(seal))
    assert ok(site[2].propose(seal)).changed is False, "a retried seal is a no-op"
    ok(site[2].propose(OpenSegment("t", 0, LeaderEpoch(1), LocalOffset(10), (NodeId(1), NodeId(3)))))

    # two controllers on two nodes race for t/1 from the same epoch: Raft orders them, exactly one wins
    results: dict[int, object] = {}

    def elect(i: int) -> None:
        try:
            results[i] = site[i].propose(ElectLeader("t", 1, NodeId(i + 1), LeaderEpoch(0)))
        except Exception as e:  # reported by the assertion below, not lost in the thread
            results[i] = e

    racers = [threading.Thread(target=elect, args=(i,)) for i in (0, 1)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(WAIT_S)
    assert sorted(type(r).__name__ for r in results.values()) == ["Applied", "Refused"], results
    winner = next(i for i, r in results.items() if isinstance(r, Applied))
    info = site[1 - winner].state().partition("t", 1)  # the loser's node applied the winner's command first
    assert info is not None and (info.leader, info.leader_epoch) == (winner + 1, 1)

    state = site.converged()
    assert [t["name"] for t in state["topics"]] == ["t"]  # type: ignore[attr-defined]
    info = site[0].state().partition("t", 0)
    assert info is not None and [s.base_offset for s in info.segments] == [0, 10]
    site[0].read_barrier()
    status = site[0].status()
    assert (status.total_nodes, status.reachable_nodes, status.leader_address is not None) == (3, 3, True)


def test_a_new_leader_is_elected_and_writes_go_on_with_two_of_three(site: Site) -> None:
    site.start()
    populate(site[0])
    before = site.converged()
    old = site.leader()
    site.stop(old, snapshot=False)  # as a crash would
    new = site.leader()
    assert new != old
    for i in sorted(site.stores):
        ok(site[i].propose(CreateTopic(TopicSpec(f"after-{i}", 1)), timeout_s=5.0))
    after = site.converged()
    assert len(after["topics"]) == len(before["topics"]) + 2  # type: ignore[arg-type]
    assert site[new].status().reachable_nodes == 2


def test_a_node_restarts_from_its_dump_alone_and_from_its_journal(site: Site) -> None:
    site.start()
    populate(site[0], "before")
    first = site.converged()
    site.stop(2)  # a clean stop dumps the applied state
    # If node 2 led, a write sent before the others noticed would end as CommitUnconfirmed (its outcome is
    # unknown: the leader changed under it, which another test covers); this one is about the dump.
    site.leader()
    missed = [f"while-2-was-down-{n}" for n in range(3)]
    for name in missed:
        site[0].create_topic(TopicSpec(name, 1))
    site.stop(0)  # their dumps compact their logs past what node 2 holds
    site.stop(1)

    # alone (no majority, so no leader), node 2 serves what it had from its dump, at once
    site.start(2)
    assert site[2].state().snapshot() == first
    assert site[2].status().leader_address is None

    # with the others back, it catches up: the leader's log no longer goes back far enough, so it sends its dump
    site.start(0, 1)
    second = site.converged()
    assert set(missed) <= set(site[2].topics())
    received = json.loads((site.tmp_path / "node2" / "raft" / "site-state.json").read_text())
    assert {t["name"] for t in received["state"]["topics"]} >= set(missed), "node 2 installed the leader's dump"

    # every node crashes (no dump at stop): the journals alone bring the whole state back
    ok(site[1].propose(CreateTopic(TopicSpec("last", 1))))
    third = site.converged()
    assert third != second
    for i in (0, 1, 2):
        site.stop(i, snapshot=False)
    site.start()
    assert site.converged(third) == third


@pytest.mark.parametrize("survivor_role", ["follower", "leader"])
def test_a_write_without_a_majority_fails_in_time_with_a_clear_error(site: Site, survivor_role: str) -> None:
    site.start()
    populate(site[0])
    state = site.converged()
    leader = site.leader()
    survivor = leader if survivor_role == "leader" else (leader + 1) % 3
    for i in (0, 1, 2):
        if i != survivor:
            site.stop(i, snapshot=False)
    store = site[survivor]

    started = time.monotonic()
    with pytest.raises(NoRaftLeader) as raised:
        store.propose(CreateTopic(TopicSpec("lost", 1)), timeout_s=1.0)
    took_s = time.monotonic() - started
    # It waited for its timeout, and it does not hang (a bound far above it: no timing is judged here).
    assert took_s >= 1.0, f"the write gave up after {took_s:.2f} s, before its 1 s timeout"
    assert took_s < 30, f"the write hung for {took_s:.2f} s past its 1 s timeout"
    message = str(raised.value)
    assert message.startswith("no Raft leader: 1 of 3 metadata nodes reachable; a majority (2) is needed"), message
    unreachable = sorted(site.addresses[i] for i in (0, 1, 2) if i != survivor)
    assert re.search(re.escape(", ".join(unreachable)), message), message
    assert (raised.value.reachable, raised.value.total) == (1, 3)
    # reads stay local and keep working
    assert store.state().snapshot() == state
    with pytest.raises(NoRaftLeader):
        store.read_barrier(timeout_s=0.2)


def test_a_raft_port_in_use_is_refused_at_start(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(RaftStartError, match=f"cannot listen on Raft address {address}"):
            RaftMetadataStore(address, [address, "127.0.0.1:1"], tmp_path, FAST)


def test_an_unreadable_dump_is_refused_at_start_with_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "raft").mkdir()
    (tmp_path / "raft" / "site-state.json").write_text('{"format": "something else"}')
    with pytest.raises(RaftStartError, match=r"move .*raft away and start it again"):
        RaftMetadataStore("127.0.0.1:1", [], tmp_path, FAST)


def test_timings_pysyncobj_would_assert_on_are_refused_with_the_rule() -> None:
    with pytest.raises(ValueError, match="election_timeout_min_s must exceed 3 \\* heartbeat_interval_s"):
        RaftTiming(election_timeout_min_s=0.2, heartbeat_interval_s=0.1)
    with pytest.raises(ValueError, match="connection_timeout_s must be at least election_timeout_max_s"):
        RaftTiming(connection_timeout_s=1.0)


def test_bad_addresses_are_refused(tmp_path: Path) -> None:
    with pytest.raises(RaftStartError, match="use host:port"):
        RaftMetadataStore("127.0.0.1", [], tmp_path, FAST)
    with pytest.raises(RaftStartError, match="use host:port"):
        RaftMetadataStore("127.0.0.1:1", ["127.0.0.1:99999"], tmp_path, FAST)


def test_reads_share_one_copy_until_a_command_changes_the_state(site: Site, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failover's leads each read the state many times a second: at 10,000 partitions a copy of the tables per
    read was a third of a survivor's CPU. Reads share one copy while nothing changes, and the read after a command
    shows it (a copy cached past a change would not)."""
    site.start()
    populate(site[0])
    copies: list[int] = []
    real = SiteState.copy
    monkeypatch.setattr(SiteState, "copy", lambda self: (copies.append(1), real(self))[1])
    before = site[0].state()
    for _ in range(100):
        assert site[0].state().topic("fresh") is None
    assert len(copies) <= 1, f"{len(copies)} copies of an unchanged state"
    ok(site[0].propose(CreateTopic(TopicSpec("fresh", 1))))
    assert site[0].state().topic("fresh") is not None, "the read after a command shows it"
    assert before.topic("fresh") is None, "a copy already handed out does not change under its reader"
