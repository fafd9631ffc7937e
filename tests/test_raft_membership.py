"""A node joins a running site's Raft group (georep/raft/store.py ``join_running_group``): the rule that decides
whether it must, and real pysyncobj stores on 127.0.0.1, in one process.

Every wait polls with a deadline, and each test closes every store it started.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.site_state import CreateTopic
from georep.metadata.topics import TopicSpec
from georep.raft.store import (
    GroupView,
    JoinFailed,
    JoinStep,
    NoRaftLeader,
    RaftMetadataStore,
    RaftStartError,
    RaftTiming,
    ask_group,
    join_running_group,
    join_step,
)
from tests.support.ports import free_ports
from tests.support.raft import FAST, Site, ok, populate, wait_until

A, B, C, D = "10.0.0.1:9093", "10.0.0.2:9093", "10.0.0.3:9093", "10.0.0.4:9093"


def view(by: str, leader: str | None, *members: str) -> GroupView:
    return GroupView(by, leader, frozenset(members))


# -- the rule -------------------------------------------------------------------------------------------------


def test_a_node_that_ran_before_starts_on_its_own_membership() -> None:
    assert join_step(D, True, [view(A, A, A, B, C)]) is JoinStep.START


def test_a_fresh_node_starts_when_no_member_answers_or_one_counts_it() -> None:
    assert join_step(D, False, []) is JoinStep.START  # the site is forming: every node from the same topology
    assert join_step(D, False, [view(A, None, A, B, C, D)]) is JoinStep.START
    # one member already applied the addition (it was committed), another has not heard of it yet
    assert join_step(D, False, [view(A, A, A, B, C), view(B, A, A, B, C, D)]) is JoinStep.START


def test_a_fresh_node_the_running_group_does_not_count_joins_once_a_leader_is_known() -> None:
    assert join_step(D, False, [view(A, B, A, B, C)]) is JoinStep.JOIN
    assert join_step(D, False, [view(A, None, A, B, C), view(B, B, A, B, C)]) is JoinStep.JOIN
    assert join_step(D, False, [view(A, None, A, B, C)]) is JoinStep.WAIT  # electing: ask again


# -- real stores ----------------------------------------------------------------------------------------------


@pytest.fixture
def grown(tmp_path: Path) -> Iterator[Site]:
    s = Site(tmp_path, size=4)
    yield s
    s.close()


def start_fourth(site: Site, partners: list[str], timing: RaftTiming = FAST) -> RaftMetadataStore:
    store = RaftMetadataStore(site.addresses[3], partners, site.tmp_path / "node3", timing)
    site.stores[3] = store
    return store


def test_a_node_joins_a_running_group_catches_up_and_the_membership_survives_restarts(grown: Site) -> None:
    site = grown
    old = site.addresses[:3]
    for i in range(3):  # the three started from a topology that did not list the fourth
        site.stores[i] = RaftMetadataStore(old[i], old, site.tmp_path / f"node{i}", FAST)
    site.leader()
    populate(site[0])
    assert ask_group(site.addresses[3]) is None  # nothing listens there yet

    next_one = f"127.0.0.1:{free_ports(1)[0]}"  # in the new node's topology too, but not started nor added yet
    partners = join_running_group(site.addresses[3], [*old, next_one], site.tmp_path / "node3", timeout_s=20)
    assert sorted(partners) == sorted(old)  # the running group's members: the next one does not count yet
    fourth = start_fourth(site, partners)
    wait_until(lambda: "t" in fourth.topics(), "the new node caught up with the log")
    four = sorted(site.addresses)
    wait_until(lambda: all(s.members() == four for s in site.running()), "every node counts four members")
    assert fourth.status().total_nodes == 4
    ok(fourth.propose(CreateTopic(TopicSpec("from-the-new-node", 1))))
    site.converged()

    # an old node restarted with the old list of three keeps the membership of four (its dump and journal)
    site.stop(0)
    site.stores[0] = RaftMetadataStore(old[0], old, site.tmp_path / "node0", FAST)
    wait_until(lambda: site[0].members() == four, "the restarted node counts four members")
    # and the four need three for a majority: with two of them down, no write commits
    site.stop(1, snapshot=False)
    site.converged()
    ok(site[0].propose(CreateTopic(TopicSpec("three-of-four", 1))))
    site.stop(2)
    with pytest.raises(NoRaftLeader, match="2 of 4 metadata nodes reachable"):
        site[0].propose(CreateTopic(TopicSpec("two-of-four", 1)), timeout_s=2.0)

    # a node that crashed (no dump at stop: node 1 never wrote one) replays the change from its journal
    assert not (site.tmp_path / "node1" / "raft" / "site-state.json").exists()
    site.stores[1] = RaftMetadataStore(old[1], old, site.tmp_path / "node1", FAST)
    wait_until(lambda: site[1].members() == four, "the node restarted from its journal counts four members")

    # the new node, restarted, starts on its own state without asking anyone (it ran before)
    site.stop(3)
    started = time.monotonic()
    assert join_running_group(site.addresses[3], old, site.tmp_path / "node3", timeout_s=20) == sorted(old)
    assert time.monotonic() - started < 20
    start_fourth(site, old)
    wait_until(lambda: site[3].members() == four, "the restarted new node counts four members")


def test_a_node_started_without_being_added_never_forms_a_majority_nor_disturbs_the_group(grown: Site) -> None:
    site = grown
    old = site.addresses[:3]
    for i in range(3):
        site.stores[i] = RaftMetadataStore(old[i], old, site.tmp_path / f"node{i}", FAST)
    leader = site.leader()
    populate(site[0])
    outsider = start_fourth(site, site.addresses)  # it lists all four, but the three never added it
    with pytest.raises(NoRaftLeader):
        outsider.propose(CreateTopic(TopicSpec("outsider", 1)), timeout_s=1.5)
    assert outsider.leader_address is None and not outsider.is_leader
    assert "t" not in outsider.topics()
    assert all(site[i].members() == sorted(old) for i in range(3))
    assert site.addresses[leader] == site[0].leader_address  # the group kept its leader
    ok(site[0].propose(CreateTopic(TopicSpec("still-writable", 1))))


def test_a_new_node_with_an_address_not_of_this_host_is_refused_before_it_becomes_a_member(grown: Site) -> None:
    site = grown
    old = site.addresses[:3]
    for i in range(3):
        site.stores[i] = RaftMetadataStore(old[i], old, site.tmp_path / f"node{i}", FAST)
    site.leader()
    mistyped = f"192.0.2.1:{free_ports(1)[0]}"  # TEST-NET-1: never an address of this host
    with pytest.raises(RaftStartError, match="must be an address of this host"):
        join_running_group(mistyped, old, site.tmp_path / "node3", timeout_s=5)
    assert all(site[i].members() == sorted(old) for i in range(3))


def test_a_new_node_gives_up_with_what_to_do_when_the_group_has_no_leader(grown: Site) -> None:
    site = grown
    old = site.addresses[:3]
    site.stores[0] = RaftMetadataStore(old[0], old, site.tmp_path / "node0", FAST)  # one of three: no leader
    with pytest.raises(JoinFailed, match=r"know of no Raft leader.*majority of the running nodes is up"):
        join_running_group(site.addresses[3], old, site.tmp_path / "node3", timeout_s=1.0, ask_timeout_s=0.5)


def test_a_raft_address_not_of_this_host_is_refused_at_start_saying_so(tmp_path: Path) -> None:
    mistyped = f"192.0.2.1:{free_ports(1)[0]}"
    with pytest.raises(RaftStartError, match=f"cannot listen on Raft address {mistyped}: .*must be an address of this"):
        RaftMetadataStore(mistyped, [mistyped, "127.0.0.1:1"], tmp_path, FAST)
