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
from georep.raft.store import _RAFT_LEADER
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


def _record_pre_votes(site: Site, deaf: int) -> list[tuple[Any, ...]]:
    """From now on, in causal order: every pre-vote grant any node sends, with what the granter knew as it sent it
    (``("grant", sender, to, term, leading, heard_leader_ago_s)``: the sender's own thread, so exactly what its
    answer was decided on), and every vote request node ``deaf`` sends (``("vote", receiver, term)``, as received:
    after the grants that let it run)."""
    events: list[tuple[Any, ...]] = []
    for i in site.stores:
        store: Any = site[i]
        transport: Any = store._replica._SyncObj__transport
        send, deliver = transport.send, transport._onMessageReceivedCallback

        def sending(node: Any, message: Any, i: int = i, store: Any = store, send: Any = send) -> Any:
            if isinstance(message, dict) and message.get("type") == "pre_vote_response" and message["granted"]:
                replica = store._replica
                leading = replica._SyncObj__raftState == _RAFT_LEADER
                events.append(("grant", i, str(node), message["term"], leading, replica._leader_heard_ago_s()))
            return send(node, message)

        def receiving(node: Any, message: Any, i: int = i, deliver: Any = deliver) -> None:
            voting = isinstance(message, dict) and message.get("type") == "request_vote"
            if voting and site.addresses[deaf] in str(node):
                events.append(("vote", i, message["term"]))
            deliver(node, message)

        transport.send = sending
        transport._onMessageReceivedCallback = receiving
    return events


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
    conf: Any = site[leader]._replica.conf
    sticky_s = conf.raftMinTimeout - conf.appendEntriesPeriod  # the store's rule (prevote.py)
    deaf = next(i for i in sorted(site.stores) if i != leader)
    events = _record_pre_votes(site, deaf)
    _deafen(site, deaf)
    # The scenario, not a wait: the deaf node's election timer runs out several times over.
    time.sleep(5 * FAST.election_timeout_max_s)
    seen = list(events)
    # What pre-vote promises, whatever the load: a node grants only when it leads nothing and has itself not heard
    # the leader for sticky_s (under a heavy load the healthy follower may miss its heartbeats too, and rightly
    # grant), and the deaf node asks for real votes in a term only once such a grant made a majority for it.
    grants = [e for e in seen if e[0] == "grant"]
    for _, granter, _to, grant_term, leading, heard_ago_s in grants:
        assert not leading, f"node {granter}, leading, granted a pre-vote for term {grant_term}"
        assert heard_ago_s is None or heard_ago_s >= sticky_s, (
            f"node {granter} granted a pre-vote for term {grant_term} {heard_ago_s:.3f}s after hearing its leader"
        )
    for at, event in enumerate(seen):
        if event[0] == "vote":
            granted_before = [g for g in seen[:at] if g[0] == "grant" and g[3] == event[2]]
            granted_before = [g for g in granted_before if site.addresses[deaf] in g[2]]
            assert granted_before, f"the deaf node asked for votes in term {event[2]} with no pre-vote granted"
    if not grants:  # nobody but the deaf node lost the leader: nothing may have moved
        assert site.leader() == leader and site[leader].status().term == term, "a healthy quorum's term was raised"
    populate(site[site.leader()], topic="after")  # the metadata takes writes throughout
    site[deaf]._replica._SyncObj__transport._onMessageReceivedCallback = site.deafened.pop(deaf)  # type: ignore[attr-defined]
    wait_until(
        lambda: site[deaf].leader_address == site.addresses[site.leader()], f"node {deaf} follows a leader again"
    )
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


def test_a_tick_held_up_past_the_election_deadline_still_asks_first(site: Site) -> None:
    """pysyncobj reads its election deadline again after its journal's one-second timer: a tick held up there past
    the deadline (a journal fsync on a busy disk, the GIL of a loaded node) once ran for leader with no pre-vote at
    all (found by the scenario above, under a load average of 30)."""
    site.start()
    populate(site[0])
    site.converged()
    leader = site.leader()
    deaf = next(i for i in sorted(site.stores) if i != leader)
    journal: Any = site[deaf]._replica._SyncObj__raftLog
    timer = journal.onOneSecondTimer

    def held_up() -> None:
        time.sleep(FAST.election_timeout_max_s + 0.1)  # longer than any election timeout
        timer()

    journal.onOneSecondTimer = held_up
    events = _record_pre_votes(site, deaf)
    _deafen(site, deaf)
    time.sleep(5 * FAST.election_timeout_max_s)  # the scenario: several held-up ticks
    journal.onOneSecondTimer = timer
    seen = list(events)
    for at, event in enumerate(seen):
        if event[0] == "vote":
            granted = [g for g in seen[:at] if g[0] == "grant" and g[3] == event[2] and site.addresses[deaf] in g[2]]
            assert granted, f"the deaf node asked for votes in term {event[2]} with no pre-vote granted"
