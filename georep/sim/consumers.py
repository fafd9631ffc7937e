"""Simulated consumers with committed vector offsets, and the per-consumer checks of I5.

A :class:`SimConsumer` reads one data partition through one site at a time.
Each stretch of reading at one site is a :class:`Session` that starts from a
vector offset: the consumer's in-memory vector (a client failing over) or the
committed vector the new site's ``CommitTable`` returns (a restart). The
simulator (``simulator.py``) drives the reads, commits and hops; this module
holds the consumer's state and checks every delivery against it:

* no duplicate relative to the start: a session never delivers a record its
  start vector covers;
* no gap and per-origin order: per origin, a session delivers the seqs
  ``start[o], start[o] + 1, ...`` in this order;
* completeness (checked by the simulator after healing): the last session has
  delivered everything its site holds.

An *exactly-once* consumer processes each fetch as a transaction: it commits
its vector after every delivery and waits for the commit's ack (the committing
site flushed it). Only then do the delivered records count; a commit lost in a
crash rolls them back. It restarts from the commit at every hop, once the new
site's table holds its last acknowledged commit. Across all its sessions, its
counted records must form, per origin, one run ``0, 1, 2, ...``: nothing twice,
nothing skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from georep.sim.checker import InvariantViolation
from offsets.commits import Commit
from offsets.coordinates import Origin
from offsets.vector import VectorOffset
from topology.ids import SiteId

PartitionKey = tuple[str, int]


@dataclass(slots=True)
class Session:
    """One stretch of reading at one site, from one start vector."""

    site: SiteId
    incarnation: int  # of the site when the session began: a crash of the site ends the session
    start: VectorOffset
    how: str  # "start", "failover" (in-memory vector) or "restart" (committed vector)
    resumed_from: int  # index of the commit it resumed from, -1 for none
    position: int = -1  # next local offset to read at the site; -1 until the session is ready
    next_seq: dict[Origin, int] = field(default_factory=dict)  # per origin, the next seq to deliver

    @property
    def ready(self) -> bool:
        return self.position >= 0

    def vector(self) -> VectorOffset:
        """What the consumer has consumed: the start vector plus this session's deliveries."""
        return self.start.merge(VectorOffset(self.next_seq)) if self.next_seq else self.start

    def deliver(self, who: str, origin: Origin, seq: int) -> None:
        since = f"commit #{self.resumed_from} " if self.resumed_from >= 0 else ""
        where = f"{who} at site {self.site} (after a {self.how} from {since}{self.start.to_text() or 'the start'})"
        if self.start.covers(origin, seq):
            raise InvariantViolation(
                f"I5 duplicate: {where} delivered {origin} seq {seq}, which the vector it resumed from covers"
            )
        expected = self.next_seq.get(origin, int(self.start.get(origin)))
        if seq != expected:
            kind = "gap" if seq > expected else "duplicate / order"
            raise InvariantViolation(
                f"I5 {kind}: {where} delivered {origin} seq {seq}, expected seq {expected} next"
            )
        self.next_seq[origin] = seq + 1


@dataclass(slots=True)
class SimConsumer:
    index: int
    group: str
    key: PartitionKey
    exactly_once: bool
    commit_every: int  # deliveries between two commits (1 for an exactly-once consumer)
    session: Session
    commits: list[Commit] = field(default_factory=list)  # every commit it made, in order
    stamp_index: dict[int, int] = field(default_factory=dict)  # HLC stamp -> index in commits
    last_stamp: int = 0
    # (commit index, committing site) of the commits that site has not flushed yet
    pending: list[tuple[int, SiteId]] = field(default_factory=list)
    acked: int = -1  # index of the last acknowledged commit
    acked_at: dict[SiteId, int] = field(default_factory=dict)  # per committing site, the last acked index
    since_commit: int = 0
    hop_wanted: bool = False  # an exactly-once consumer hops only once its commit is resolved
    # Exactly-once counting holds across crashes, not disk losses: an ack from one site does not
    # survive that site's disk (I6; it would take a geo ack). A rebuild turns the counting off.
    counting: bool = True
    delivered: int = 0
    highest: dict[Origin, int] = field(default_factory=dict)  # per origin, the highest seq ever delivered
    # exactly-once only: records delivered in the open transaction, and per origin the next seq counted
    staged: list[tuple[Origin, int]] = field(default_factory=list)
    counted: dict[Origin, int] = field(default_factory=dict)
    counted_total: int = 0

    @property
    def name(self) -> str:
        kind = "exactly-once consumer" if self.exactly_once else "consumer"
        return f"{kind} {self.group} of {self.key[0]}[{self.key[1]}]"

    def deliver(self, origin: Origin, seq: int) -> None:
        self.session.deliver(self.name, origin, seq)
        self.highest[origin] = max(self.highest.get(origin, -1), seq)
        self.delivered += 1
        self.since_commit += 1
        if self.exactly_once:
            self.staged.append((origin, seq))

    def add_commit(self, commit: Commit, site: SiteId) -> int:
        index = len(self.commits)
        self.commits.append(commit)
        self.stamp_index[commit.hlc] = index
        self.last_stamp = commit.hlc
        self.pending.append((index, site))
        self.since_commit = 0
        return index

    def index_of(self, commit: Commit | None) -> int:
        """Index of one of this consumer's commits in :attr:`commits`; -1 for None."""
        if commit is None:
            return -1
        index = self.stamp_index.get(commit.hlc)
        if index is None or self.commits[index] != commit:
            raise InvariantViolation(f"{self.name}: a site's table holds a commit it never made: {commit}")
        return index

    def ack(self, index: int, site: SiteId) -> None:
        self.acked = max(self.acked, index)
        self.acked_at[site] = max(self.acked_at.get(site, -1), index)
        if self.exactly_once:
            self._count()

    def _count(self) -> None:
        """The transaction committed: its records count, and must continue the counted run."""
        if not self.counting:
            self.staged.clear()
            return
        for origin, seq in self.staged:
            expected = self.counted.get(origin, 0)
            if seq != expected:
                what = "twice" if seq < expected else f"after seq {expected - 1}, skipping seqs {expected}..{seq - 1}"
                raise InvariantViolation(
                    f"I5 exactly once: {self.name} processed {origin} seq {seq} {what} (over all its sites)"
                )
            self.counted[origin] = seq + 1
            self.counted_total += 1
        self.staged.clear()

    def lose(self) -> None:
        """A crash lost a commit before it was flushed: its transaction rolls back."""
        if self.exactly_once:
            self.staged.clear()
