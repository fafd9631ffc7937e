"""Raft elections of a site's metadata (georep/raft/elections.py, store.py, transport.py): the leader's successor takes
over in one election, and a node that restarts rejoins without one.

A site's controller runs on its Raft leader, so while the group elects, no dead partition leader is replaced:
``bench/site_cluster.py --victim raft-leader`` measures what an election costs a failover. The pure rule is tested
on its own; the others run three real pysyncobj nodes on 127.0.0.1 in one process (tests/support/raft.py).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from georep.raft.elections import JITTER_SLOTS, election_timeout_s, first_election_timeout_s
from georep.raft.store import RaftTiming
from tests.support.raft import Site, populate, wait_until

# A wide window, so that the followers' turns stay apart on a loaded machine (a turn is 0.45 s here).
ELECTIONS = RaftTiming(
    election_timeout_min_s=0.3,
    election_timeout_max_s=1.2,
    heartbeat_interval_s=0.05,
    connection_timeout_s=1.2,
    reconnect_interval_s=0.2,
    leader_step_down_s=1.0,
)
# The leader tries to reach a node that is down every 3 s, so a restarted node waits seconds to hear from it.
SLOW_RECONNECT = RaftTiming(
    election_timeout_min_s=0.3,
    election_timeout_max_s=1.2,
    heartbeat_interval_s=0.05,
    connection_timeout_s=3.0,
    reconnect_interval_s=3.0,
    leader_step_down_s=1.0,
)

MEMBERS = ["10.0.0.1:9093", "10.0.0.2:9093", "10.0.0.3:9093", "10.0.0.4:9093", "10.0.0.5:9093"]


@pytest.mark.parametrize("draw", [0.0, 0.5, 0.999])
@pytest.mark.parametrize("leader", MEMBERS)
def test_followers_run_in_turn_after_the_leader_its_successor_first(leader: str, draw: float) -> None:
    at = MEMBERS.index(leader)
    turns = MEMBERS[at + 1 :] + MEMBERS[:at]  # the ring after the leader
    timeouts = [election_timeout_s(me, leader, MEMBERS, 0.4, 1.2, draw) for me in turns]
    slot = (1.2 - 0.4) / len(turns)
    assert timeouts == sorted(timeouts), "the successor runs first, then the next one in the ring"
    assert all(0.4 <= t < 1.2 for t in timeouts)
    worst_gap = min(b - a for a, b in itertools.pairwise(timeouts))
    assert worst_gap >= slot * (1 - JITTER_SLOTS) - 1e-9, "a vote has most of a turn before the next follower runs"


def test_a_follower_that_knows_no_leader_draws_from_the_whole_window() -> None:
    draws = [election_timeout_s(MEMBERS[0], None, MEMBERS, 0.4, 1.2, d / 10) for d in range(10)]
    assert draws[0] == 0.4 and 1.1 < draws[-1] < 1.2 and draws == sorted(draws)
    # the leader itself, once deposed, draws alike
    assert election_timeout_s(MEMBERS[0], MEMBERS[0], MEMBERS, 0.4, 1.2, 0.5) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="draw must be in"):
        election_timeout_s(MEMBERS[0], None, MEMBERS, 0.4, 1.2, 1.0)


def test_only_a_node_that_ran_before_waits_longer_before_its_first_election() -> None:
    assert first_election_timeout_s(0.5, rejoining=False, reconnect_interval_s=1.0) == 0.5
    assert first_election_timeout_s(0.5, rejoining=True, reconnect_interval_s=1.0) == 2.5


@pytest.fixture
def elections_site(tmp_path: Path) -> Iterator[Site]:
    s = Site(tmp_path, timing=ELECTIONS)
    yield s
    s.close()


@pytest.fixture
def slow_reconnect_site(tmp_path: Path) -> Iterator[Site]:
    s = Site(tmp_path, timing=SLOW_RECONNECT)
    yield s
    s.close()


def successor(site: Site, leader: int) -> int:
    ring = sorted(range(len(site.addresses)), key=lambda i: site.addresses[i])
    return ring[(ring.index(leader) + 1) % len(ring)]


def test_the_successor_of_a_crashed_leader_takes_over_in_one_election(elections_site: Site) -> None:
    site = elections_site
    site.start()
    populate(site[0])
    site.converged()
    for _ in range(2):
        leader = site.leader()
        term = site[leader].status().term
        # The scenario, not a wait: the followers exchange nothing while the leader lives, for longer than a
        # connection's timeout. pysyncobj then dropped the first vote request of the election, and both ran.
        time.sleep(ELECTIONS.connection_timeout_s * 1.5)
        site.stop(leader, snapshot=False)  # as a crash would
        new = site.leader()
        assert site[new].status().term == term + 1, (
            f"the survivors went from term {term} to {site[new].status().term}: a split vote cost another election"
        )
        assert new == successor(site, leader), "the node after the leader's address ran first, and won"
        site.start(leader)  # back for the next round: it follows the new leader
        wait_until(
            lambda new=new, leader=leader: site[leader].leader_address == site.addresses[new],
            f"node {leader} follows node {new}",
        )


def test_a_node_that_restarts_rejoins_without_an_election(slow_reconnect_site: Site) -> None:
    site = slow_reconnect_site
    site.start()
    populate(site[0])
    site.converged()
    leader = site.leader()
    # The leader must be the one to reach the restarted node (the node with the larger address connects): restart a
    # follower whose address sorts lower, or, if the leader's is the lowest, the leader itself once another leads.
    lower = [i for i in site.stores if i != leader and site.addresses[i] < site.addresses[leader]]
    if lower:
        victim = lower[0]
        site.stop(victim, snapshot=False)
    else:
        victim = leader
        site.stop(victim, snapshot=False)
        leader = site.leader()
    term = site[leader].status().term
    site.start(victim)
    wait_until(
        lambda: site[victim].leader_address == site.addresses[leader],
        f"restarted node {victim} follows node {leader}",
        timeout_s=15.0,
    )
    site.converged()
    assert site.leader() == leader
    assert site[leader].status().term == term, "the restarted node ran for leader and the group elected again"
