"""Pre-vote: a Raft node asks whether it could win before it raises its term (Raft thesis, §9.6). Pure.

pysyncobj 0.3.17 runs for leader as soon as a follower's election timer runs out: it raises its term, and every
node that hears the request adopts that term, the leader included, which steps down. A node whose timer ran out
because the *leader* died is right to. One whose timer ran out because it did not hear a living leader is not: a
node starved of CPU by its partitions' work (its tick thread shares the GIL with thousands of segment opens), a
one-way network fault. At 10,000 partitions on two loaded cores, such nodes deposed a healthy leader again and again
(the term reached 124 in ten minutes), and each time every metadata write in flight failed, the controller's
failovers with them, and the partitions' work that followed starved the nodes further.

So a node whose timer runs out first sends ``pre_vote`` (the term it would run in, and its log's last position) to
the others, and changes nothing. Each answers whether it would grant that vote (:func:`grants_pre_vote`), and
changes nothing either. It would not if it leads, or heard its leader within ``sticky_s`` (the leader is alive for
it), or if the candidate's term or log is behind its own. Only with a majority of grants, its own included
(:class:`PreVoteRound`), does the node run the real election. A leader that a majority still hears therefore keeps
its term; a dead leader is replaced one round trip later than before, without an fsync (nothing changes state).

``sticky_s`` is the election timeout's minimum less one heartbeat period: a follower of a healthy leader hears it
every heartbeat period; when the leader dies, its followers' timers run out from ``min`` after its last append, by
when the others have not heard it for about as long, so the first pre-vote after a death is granted.

Safety does not depend on any of this: pre-vote only decides whether a node asks for real votes, and Raft's own
rules decide who wins. A leadership transfer (``timeout_now``) skips it: the leader asked for that election.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True, order=True)
class LogPosition:
    """The term and index of a log's last entry: the later term, then the longer log, is the more up to date."""

    term: int
    index: int


def grants_pre_vote(
    my_term: int,
    mine: LogPosition,
    proposed_term: int,
    candidate: LogPosition,
    *,
    i_lead: bool,
    heard_leader_ago_s: float | None,
    sticky_s: float,
) -> bool:
    """Whether a node in ``my_term`` with log ``mine`` would vote for a candidate that would run in
    ``proposed_term`` with log ``candidate``, now. ``heard_leader_ago_s``: since its last append from a leader (None:
    it never had one)."""
    if i_lead or (heard_leader_ago_s is not None and heard_leader_ago_s < sticky_s):
        return False
    return proposed_term > my_term and candidate >= mine


@dataclass(slots=True)
class PreVoteRound:
    """One node's round of pre-votes for ``proposed_term`` among ``voters`` voting members, itself included."""

    proposed_term: int
    voters: int
    granted: set[str] = field(default_factory=set)

    @property
    def won(self) -> bool:
        return 1 + len(self.granted) > self.voters / 2

    def answer(self, voter: str, term: int, granted: bool) -> bool:
        """Count ``voter``'s answer for ``term``; whether the round is won now."""
        if granted and term == self.proposed_term:
            self.granted.add(voter)
        return self.won
