"""A Raft node that stops hearing its leader while the rest of the group is healthy (a node starved of CPU by its
partitions' work, a one-way network fault) must not depose that leader: it asks first (pre-vote,
georep/raft/prevote.py), and runs only if a majority has lost the leader too.

Before pre-vote, at 10,000 partitions on a loaded machine, the site's Raft term reached 124 in ten minutes: every
starved node's election raised the term, the healthy leader stepped down, and every metadata write in flight failed.
The rule is tested on its own; the scenario on three real pysyncobj nodes in one process (tests/support/raft.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from georep.raft.prevote import LogPosition, PreVoteRound, grants_pre_vote
from tests.support.raft import FAST, Site, populate, wait_until

AT_5_3 = LogPosition(term=5, index=3)


def test_a_pre_vote_is_granted_only_by_a_node_that_lost_its_leader_too() -> None:
    lost = {"i_lead": False, "heard_leader_ago_s": 1.0, "sticky_s": 0.3}
    assert grants_pre_vote(5, AT_5_3, proposed_term=6, candidate=AT_5_3, **lost)
    # a leader, and a follower that heard its leader lately, keep it
    assert not grants_pre_vote(5, AT_5_3, 6, AT_5_3, i_lead=True, heard_leader_ago_s=None, sticky_s=0.3)
    assert not grants_pre_vote(5, AT_5_3, 6, AT_5_3, i_lead=False, heard_leader_ago_s=0.1, sticky_s=0.3)
    # a candidate behind in term or log would lose the real vote: it does not get to raise the term
    assert not grants_pre_vote(6, AT_5_3, 6, AT_5_3, **lost)
    assert not grants_pre_vote(5, AT_5_3, 6, LogPosition(5, 2), **lost)
    assert not grants_pre_vote(5, AT_5_3, 6, LogPosition(4, 9), **lost)
    assert grants_pre_vote(5, AT_5_3, 6, LogPosition(6, 1), **lost)
    # a node that never heard a leader (a site forming) grants
    assert grants_pre_vote(
        0, LogPosition(0, 0), 1, LogPosition(0, 0), i_lead=False, heard_leader_ago_s=None, sticky_s=1
    )


def test_a_pre_vote_round_is_won_by_a_majority_of_grants_for_its_own_term() -> None:
    round_ = PreVoteRound(proposed_term=7, voters=3)
    assert not round_.won
    assert not round_.answer("b", term=6, granted=True), "an answer to an older round does not count"
    assert not round_.answer("b", term=7, granted=False)
    assert round_.answer("c", term=7, granted=True) and round_.won
    alone = PreVoteRound(proposed_term=1, voters=1)
    assert alone.won, "a group of one needs nobody's grant"
    twice = PreVoteRound(proposed_term=2, voters=5)
    twice.answer("b", 2, True)
    assert not twice.answer("b", 2, True), "one grant per node"


def _deafen(site: Site, i: int) -> None:
    """Node ``i`` no longer receives its leader's appends (heartbeats included); it still sends and hears the rest."""
    transport: Any = site[i]._replica._SyncObj__transport
    deliver = transport._onMessageReceivedCallback

    def deaf(node: Any, message: Any) -> None:
        if isinstance(message, dict) and message.get("type") == "append_entries":
            return
        deliver(node, message)

    transport._onMessageReceivedCallback = deaf
    site.deafened[i] = deliver  # type: ignore[attr-defined]


def _count_vote_requests(site: Site, sender: int) -> list[object]:
    """Every vote request the other nodes receive from node ``sender``, from now on."""
    asked: list[object] = []
    address = site.addresses[sender]
    for i in site.stores:
        if i == sender:
            continue
        transport: Any = site[i]._replica._SyncObj__transport
        deliver = transport._onMessageReceivedCallback

        def counting(node: Any, message: Any, deliver: Any = deliver) -> None:
            if isinstance(message, dict) and message.get("type") == "request_vote" and address in str(node):
                asked.append(message)
            deliver(node, message)

        transport._onMessageReceivedCallback = counting
    return asked


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    s = Site(tmp_path, timing=FAST)
    s.deafened = {}  # type: ignore[attr-defined]
    yield s
    for i, deliver in s.deafened.items():  # type: ignore[attr-defined]
        s[i]._replica._SyncObj__transport._onMessageReceivedCallback = deliver
    s.close()


def test_a_node_deaf_to_its_leader_does_not_depose_it(site: Site) -> None:
    site.start()
    populate(site[0])
    site.converged()
    leader = site.leader()
    term = site[leader].status().term
    deaf = next(i for i in sorted(site.stores) if i != leader)
    votes_asked_by_deaf = _count_vote_requests(site, deaf)
    _deafen(site, deaf)
    # The scenario, not a wait: the deaf node's election timer runs out several times over.
    time.sleep(5 * FAST.election_timeout_max_s)
    # Under a heavy load the healthy pair may elect again on its own; what the deaf node may never do is ask
    # for votes (the step that, without a pre-vote, raises the term and deposes the leader).
    assert not votes_asked_by_deaf, "the deaf node asked for votes: it would depose a healthy leader"
    if site.leader() == leader:
        assert site[leader].status().term == term, "the deaf node raised the term of a healthy quorum"
    populate(site[leader], topic="after")  # the metadata takes writes throughout
    site[deaf]._replica._SyncObj__transport._onMessageReceivedCallback = site.deafened.pop(deaf)  # type: ignore[attr-defined]
    wait_until(lambda: site[deaf].leader_address == site.addresses[leader], f"node {deaf} follows the leader again")
    site.converged()


def test_the_survivors_still_elect_when_the_leader_dies(site: Site) -> None:
    site.start()
    populate(site[0])
    site.converged()
    leader = site.leader()
    term = site[leader].status().term
    site.stop(leader, snapshot=False)
    new = site.leader()
    assert site[new].status().term == term + 1, "pre-vote cost the survivors a second election"
    populate(site[new], topic="after")
