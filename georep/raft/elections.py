"""When a follower runs for Raft leader: the leader's successor first, the others a slot later each. Pure.

pysyncobj draws every follower's election timeout uniformly in ``[min, max]``, afresh at each message of the
leader. When the leader's process dies, its followers lose it at the same instant, and each runs when its draw runs
out. A vote is not instant: the candidate fsyncs its new term before its request leaves (``georep.raft.journal``),
the voter fsyncs its vote before it answers, and both wait for their tick thread, which shares the GIL with the
node's event loop. On a loaded machine that takes tens of milliseconds, and two draws closer than that split the
vote: each candidate votes for itself, nobody wins, and both draw again from the same window. On a site of three
at a 500 ms session (a window of 150 ms), ``bench/site_cluster.py --victim raft-leader`` saw two to four elections
per kill of the leader, 0.6 to 1 s without a Raft leader, and so without a controller.

So the followers are ranked instead: each orders the group's Raft addresses as a ring and counts its place after
the leader's. The first after it (the successor) runs at ``min`` plus a quarter of a slot at most, the next one a
slot later, and so on, a slot being ``(max - min)`` shared by the followers. The survivors of a leader's death
therefore run one slot apart (75 ms on a site of three at a 500 ms session), more than a vote takes, and the first
election is won by the successor, unless its log lacks an entry the other holds: the other then refuses its vote,
runs a slot later, and wins with the successor's vote. A follower that knows no leader (a node starting, a
candidate after a lost election) ranks itself after the last leader it knew, so a split vote is not drawn again;
one that never knew a leader, or was the leader itself, draws uniformly in ``[min, max]`` as pysyncobj does.

**A node that restarts** waits ``2 * reconnect_interval_s`` more before its first election
(:func:`first_election_timeout_s`). The leader connects to it (or it to the leader) within one reconnect interval,
and its first append then follows; until it arrives the node knows no leader, and running for one would only raise
its term: the leader and the other followers would adopt that term and elect again, a stall of the metadata while
no node fails (``bench/site_cluster.py`` counts such elections: a third of the restarts caused one before). A site
whose every node restarts waits as long for its first leader; a site that forms for the first time does not.

**Safety is not at stake.** A timeout only decides when a follower asks for votes; Raft's rules (one vote per
term, only for a log at least as up to date) decide who wins, so no ranking can elect two leaders in a term or
lose a committed entry. **Nor is stability**: the earliest a follower runs is ``min`` after the leader's last
message, as before, so a leader that keeps sending its heartbeats is never challenged more often than with
pysyncobj's draw.
"""

from __future__ import annotations

from collections.abc import Iterable

JITTER_SLOTS = 0.25  # how much of its slot a follower's draw may take: the rest separates it from the next rank


def election_timeout_s(
    me: str, last_leader: str | None, members: Iterable[str], min_s: float, max_s: float, draw: float
) -> float:
    """How long ``me`` waits without a message from the leader before it runs for leader; see the module docstring.

    ``last_leader``: the Raft address of the leader it follows now, or last followed (None: none yet).
    ``members``: the Raft addresses of the group's voting members (``me`` may be among them or not).
    ``draw``: a number in [0, 1) drawn at random by the caller.
    """
    if not 0.0 <= draw < 1.0:
        raise ValueError(f"draw must be in [0, 1), got {draw!r}")
    ring = sorted({*members, me})
    if last_leader is None or last_leader == me or last_leader not in ring:
        return min_s + draw * (max_s - min_s)
    at = ring.index(last_leader)
    followers = ring[at + 1 :] + ring[:at]
    slot_s = (max_s - min_s) / len(followers)
    return min_s + slot_s * (followers.index(me) + JITTER_SLOTS * draw)


def first_election_timeout_s(timeout_s: float, rejoining: bool, reconnect_interval_s: float) -> float:
    """The first election timeout of a node that just started: ``timeout_s`` (from :func:`election_timeout_s`), plus
    two reconnect intervals if it ran before (``rejoining``: it has Raft state), so that a running leader reaches it
    before it runs; see the module docstring."""
    return timeout_s + (2 * reconnect_interval_s if rejoining else 0.0)
