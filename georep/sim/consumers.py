"""Simulated consumers with committed vector offsets, and the per-consumer checks of I5.

A :class:`SimConsumer` reads one data partition through one site at a time,
with the node's ``FetchCursor`` (``georep/broker/fetch.py``) and the client's
``decode_response``, and commits through the site's ``CommitLog``, origin
append and ack table, as a node's ``CommitOffsets`` does.
Each stretch of reading at one site is a :class:`Session` that starts from a
vector offset: the consumer's in-memory vector (a client failing over) or the
committed vector the new site's ``CommitTable`` returns (a restart). The
simulator (``simulator.py``) drives the reads, commits and hops; this module
holds the consumer's state, checks every delivery against it, and
(:class:`ConsumerWorkload`) drives the reads, commits and hops:

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

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from georep.broker.acks import Acks
from georep.broker.commits import CommitEntry, commit_batch
from georep.broker.fetch import Earliest, FetchCursor, FromVector
from georep.client.consumer import decode_response
from georep.replication.links import PartitionKey
from georep.sim.checker import InvariantViolation
from georep.sim.site import SimSite
from offsets.commits import OFFSETS_TOPIC, Commit, CommitTable, offsets_partition
from offsets.coordinates import Origin
from offsets.vector import VectorOffset
from topology.ids import SiteId
from topology.reach import expected_sites

if TYPE_CHECKING:
    from georep.sim.simulator import Simulator

READ_BYTES_MAX = 1 << 24
READS_MAX = 1 << 20


@dataclass(slots=True)
class Session:
    """One stretch of reading at one site, from one start vector."""

    site: SiteId
    incarnation: int  # of the site when the session began: a crash of the site ends the session
    start: VectorOffset
    how: str  # "start", "failover" (in-memory vector) or "restart" (committed vector)
    resumed_from: int  # index of the commit it resumed from, -1 for none
    cursor: FetchCursor | None = None  # None until the session is ready
    next_seq: dict[Origin, int] = field(default_factory=dict)  # per origin, the next seq to deliver

    @property
    def ready(self) -> bool:
        return self.cursor is not None

    def vector(self) -> VectorOffset:
        """What the consumer has consumed: the start vector plus this session's deliveries."""
        return self.start.merge(VectorOffset(self.next_seq)) if self.next_seq else self.start

    def deliver(self, who: str, origin: Origin, seq: int) -> None:
        expected = self.next_seq.get(origin, int(self.start.get(origin)))
        if seq == expected and not self.start.covers(origin, seq):
            self.next_seq[origin] = seq + 1
            return
        # What is wrong, in words (only now: every record passes through here).
        since = f"commit #{self.resumed_from} " if self.resumed_from >= 0 else ""
        where = f"{who} at site {self.site} (after a {self.how} from {since}{self.start.to_text() or 'the start'})"
        if self.start.covers(origin, seq):
            raise InvariantViolation(
                f"I5 duplicate: {where} delivered {origin} seq {seq}, which the vector it resumed from covers"
            )
        kind = "gap" if seq > expected else "duplicate / order"
        raise InvariantViolation(f"I5 {kind}: {where} delivered {origin} seq {seq}, expected seq {expected} next")


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


def commit_at(
    sim: Simulator,
    site: SimSite,
    group: str,
    entries: list[CommitEntry],
    after_hlc: int,
    then: Callable[[Exception | None], None],
    member_id: str = "",
    generation: int = -1,
) -> Commit:
    """Commit at ``site`` as its ``CommitOffsets`` does: stamp, one batch of the internal topic appended as
    this site's origin, ack at ``leader`` (fsynced). Returns the commit (of the first entry)."""
    now = sim.local_ms(site)
    stamp = site.commits.stamp(now, after_hlc, site.id)
    commits = site.commits.new_commits(
        group, entries, stamp, site.origin, member_id=member_id, generation=generation, now_ms=now
    )
    key = (OFFSETS_TOPIC, offsets_partition(group))
    produced = sim.append(site, key, commit_batch(commits, now))
    site.commits.record(commits)
    sim.counts.commits += 1
    sim.wait_ack(site, key, produced, Acks(), then)
    return commits[0]


def start_cursor(site: SimSite, key: PartitionKey, commit: Commit | None) -> FetchCursor:
    """A restart's cursor: from the committed vector, with its hint where it was taken (as a node's Fetch)."""
    if commit is None:
        return FetchCursor(site.logs[key], Earliest(), site.origin)
    start = FromVector(commit.vector, commit.committed_by, commit.hint_offset)
    return FetchCursor(site.logs[key], start, site.origin)


def read_records(sim: Simulator, session: Session, key: PartitionKey) -> list[tuple[Origin, int]] | None:
    """One fetch of ``session``: (origin, seq) of each record handed out; None when nothing is durable yet."""
    cursor = session.cursor
    assert cursor is not None
    if not cursor.readable:
        return None
    before = cursor.position
    data = cursor.read(sim.config.fetch_bytes)
    records = decode_response(key[0], key[1], data, before, session.start)
    return [(r.origin, int(r.origin_seq)) for r in records]


class ConsumerWorkload:
    """The standalone consumers of a run (each its own group), and the I5 checks that need every site."""

    def __init__(self, sim: Simulator, count: int) -> None:
        self.sim = sim
        self.consumers: list[SimConsumer] = []
        for i in range(count):
            key = sim.rng.choice(sim.data_keys)
            site = sim.rng.choice(sorted(sim.sites))
            every = 1 if i == 0 else sim.rng.randint(*sim.config.commit_every)
            session = Session(site, 0, VectorOffset(), "start", -1)
            self.consumers.append(SimConsumer(i, f"g{i}", key, i == 0, every, session))
        self.offsets_keys = sorted({(OFFSETS_TOPIC, offsets_partition(c.group)) for c in self.consumers})

    def __bool__(self) -> bool:
        return bool(self.consumers)

    def handlers(self) -> dict[str, Callable[..., None]]:
        return {"consume": self._on_consume, "hop": self._on_hop}

    def start(self) -> None:
        sim = self.sim
        for c in self.consumers:
            site = sim.sites[c.session.site]
            c.session.cursor = FetchCursor(site.logs[c.key], Earliest(), site.origin)
            sim._after(sim.rng.randint(*sim.config.consume_ms), "consume", c.index)
            sim._after(sim.rng.randint(*sim.config.hop_ms), "hop", c.index)

    def trace(self) -> str:
        return " ".join(
            f"{c.group} {c.session.vector().to_text()} {c.delivered} {len(c.commits)}" for c in self.consumers
        )

    # -- events -------------------------------------------------------------------------

    def _on_consume(self, ci: int) -> None:
        sim = self.sim
        c = self.consumers[ci]
        sim._after(sim.rng.randint(*sim.config.consume_ms), "consume", ci)
        site = sim.sites[c.session.site]
        if not site.up or site.incarnation != c.session.incarnation:
            if c.exactly_once and c.pending:
                return  # its commit's outcome is not known yet (a multi-node site's recovery decides it)
            self._hop(c, forced=True)  # its site crashed: the connection broke
            return
        if c.exactly_once and c.pending:
            return  # the open transaction waits for its commit's ack
        if c.hop_wanted:
            self._hop(c, forced=False)
            return
        if not c.session.ready and not self._ready(c, site):
            return
        records = read_records(sim, c.session, c.key)
        if not records:
            return
        for origin, seq in records:
            c.deliver(origin, seq)
        sim.counts.deliveries += len(records)
        sim._trace.update(f"deliver {ci} {len(records)}".encode())
        if c.since_commit >= c.commit_every:
            self._commit(c, site)

    def _commit(self, c: SimConsumer, site: SimSite) -> None:
        """Commit the consumer's vector at its site (``commit_at``); acknowledged once the site fsynced it."""
        sim = self.sim
        cursor = c.session.cursor
        assert cursor is not None
        entry = CommitEntry(c.key[0], c.key[1], c.session.vector(), cursor.position)
        holder: list[int] = []

        def acked(error: Exception | None) -> None:
            if error is None and holder:
                c.pending = [p for p in c.pending if p != (holder[0], site.id)]
                c.ack(holder[0], site.id)
                sim.counts.commits_acked += 1

        commit = commit_at(sim, site, c.group, [entry], c.last_stamp, acked)
        holder.append(c.add_commit(commit, site.id))

    def _on_hop(self, ci: int) -> None:
        sim = self.sim
        if sim.phase != "safety":
            return
        c = self.consumers[ci]
        sim._after(sim.rng.randint(*sim.config.hop_ms), "hop", ci)
        if c.exactly_once and c.pending:
            c.hop_wanted = True  # once the open transaction is resolved
        else:
            self._hop(c, forced=False)

    def _hop(self, c: SimConsumer, forced: bool) -> None:
        """Move ``c`` to another live site: a client failover (in-memory vector) or a restart (committed vector).

        An exactly-once consumer always restarts, and only at a site its last acknowledged commit can reach.
        """
        sim = self.sim
        c.hop_wanted = False
        here = c.session.site
        candidates = [s for s, site in sorted(sim.sites.items()) if site.up]
        if c.exactly_once and c.acked >= 0:
            reach = expected_sites(sim.topology, c.commits[c.acked].committed_by.site, OFFSETS_TOPIC)
            candidates = [s for s in candidates if s in reach]
        others = [s for s in candidates if s != here]
        if others:
            candidates = others
        elif not forced or not candidates:
            return
        target = sim.rng.choice(candidates)
        how = "restart" if c.exactly_once or sim.rng.random() < 0.5 else "failover"
        start = c.session.vector() if how == "failover" else VectorOffset()
        site = sim.sites[target]
        c.session = Session(target, site.incarnation, start, how, -1)
        sim.counts.consumer_hops += 1
        sim.counts.consumer_hops_during_cuts += bool(sim.cut)
        sim.counts.consumer_hops_forced += forced
        sim._log(f"{c.name} hops {here} -> {target} ({how})")
        if how == "failover":
            c.session.cursor = FetchCursor(site.logs[c.key], FromVector(start), site.origin)
        else:
            self._ready(c, site)

    def _ready(self, c: SimConsumer, site: SimSite) -> bool:
        """Start a restart session from the commit ``site``'s table holds; False while an exactly-once
        consumer waits for the site to receive its last acknowledged commit."""
        commit = site.commits.table.get(c.group, c.key[0], c.key[1])
        index = c.index_of(commit)
        if c.exactly_once and c.counting and index < c.acked:
            return False
        if c.exactly_once and c.counting and index != c.acked:
            raise InvariantViolation(
                f"{c.name}: site {site.id} returns commit #{index}, but the last one acknowledged is #{c.acked}"
            )
        session = c.session
        session.start = commit.vector if commit is not None else VectorOffset()
        session.resumed_from = index
        session.cursor = start_cursor(site, c.key, commit)
        self.sim.counts.consumer_restarts += 1
        return True

    # -- the commit tables ------------------------------------------------------------------

    def fold(self, site: SimSite) -> None:
        """``site`` folds the commit records it received (``CommitLog.catch_up``); no position goes back."""
        if self.consumers:
            self._fold(site)

    def _fold(self, site: SimSite) -> None:
        logs = {key[1]: site.logs[key] for key in self.offsets_keys}
        report = site.commits.catch_up(logs)
        if report.problems:
            raise InvariantViolation(f"site {site.id} cannot read its commits: {report.problems[0]}")
        for folded in report.folded:
            if not folded.won and folded.before is not None and folded.commit.order < folded.before.order:
                self.sim.counts.commits_out_of_order += 1  # an older commit arrived after a newer one
        if not report.folded and len(site.winners) == len(self.consumers):
            return
        for c in self.consumers:
            index = c.index_of(site.commits.table.get(c.group, c.key[0], c.key[1]))
            before = site.winners.get(c.index, -1)
            if index < before:
                raise InvariantViolation(
                    f"I5 commit order: site {site.id} returned commit #{before} of {c.name} and now returns the "
                    f"older #{index}, with no crash in between"
                )
            site.winners[c.index] = index

    def flushed(self, site: SimSite, key: PartitionKey) -> None:
        """An fsync of ``key`` ended at ``site``: if it made all of a consumer's internal partition durable,
        what the table returns for that consumer now survives a crash."""
        log = site.logs[key]
        if key not in self.offsets_keys or log.flushed_offset != log.log_end_offset:
            return
        for c in self.consumers:
            if (OFFSETS_TOPIC, offsets_partition(c.group)) == key:
                site.durable_winners[c.index] = site.winners.get(c.index, -1)

    def site_crashed(self, site: SimSite, rebuild: bool, *, read_back: bool = False) -> None:
        """``site`` crashed: its unflushed commits are lost, and its table is folded again from what it kept.

        ``read_back`` (a multi-node site that lost a partition leader, ``geo_cluster.py``): a commit still
        pending there may have survived, so its outcome is what the site's table returns after the recovery.

        The claim checked: for each consumer, the commit the site returns may move back, but never below the
        one it returned when the consumer's internal partition was last all fsynced, which is at least the
        last commit acknowledged at this site. And no consumer may have delivered a record of this origin that
        the crash lost: the origin will stamp that coordinate again with another record, which the consumer's
        vector already covers.
        """
        if not self.consumers:
            return
        sim = self.sim
        unresolved: dict[int, int] = {}  # read_back: consumer -> its last commit pending at the site
        for c in self.consumers:
            for index, at in c.pending:
                if at != site.id:
                    continue
                if read_back:
                    unresolved[c.index] = max(unresolved.get(c.index, -1), index)
                else:
                    c.lose()
                    sim.counts.commits_lost += 1
            c.pending = [p for p in c.pending if p[1] != site.id]
            kept = site.logs[c.key].vector().get(site.origin, 0)
            delivered = c.highest.get(site.origin, -1)
            if not rebuild and delivered >= kept:
                raise InvariantViolation(
                    f"I5 lost record: {c.name} delivered {site.origin} seq {delivered}, but the crash of {site.id} "
                    f"kept only seqs below {kept}: the origin will stamp that seq again with another record"
                )
        site.commits = type(site.commits)(site.commits.decode)  # what the restarted site folds from its logs
        before = dict(site.winners)
        site.winners = {}
        self._fold(site)
        for ci, pending in sorted(unresolved.items()):
            # A multi-node site that lost a partition leader may keep a commit it never acknowledged (its ack
            # quorum held it, or the recovery kept the tail), so the client reads its position back: the
            # commit took effect if the site's table returns it, and was lost otherwise.
            c = self.consumers[ci]
            if site.winners[ci] >= pending:
                c.ack(pending, site.id)
                sim.counts.commits_acked += 1
            else:
                c.lose()
                sim.counts.commits_lost += 1
        for c in self.consumers:
            index = site.winners[c.index]
            floor = site.durable_winners.get(c.index, -1)
            acked_here = c.acked_at.get(site.id, -1)
            sim._log(f"{c.name}: {site.id} returned commit #{before.get(c.index, -1)}, after the crash #{index}")
            if rebuild:  # a commit acknowledged at one site does not survive that site's disk (I6)
                site.durable_winners[c.index] = index
                c.acked_at.pop(site.id, None)
                c.counting = False  # its last acknowledged commit may be gone with the disk
            elif index < floor or index < acked_here:
                raise InvariantViolation(
                    f"I5 commit durability: after its crash, site {site.id} returns commit #{index} of {c.name}; "
                    f"at its last flush it returned #{floor}, and #{acked_here} was acknowledged there"
                )
            if c.session.site == site.id:
                sim._after(sim.rng.randint(0, 20), "hop", c.index)  # move right after the crash

    # -- after healing ------------------------------------------------------------------------

    def problems(self, final: bool = False) -> list[str]:
        """What the consumers still miss after healing: caught up with their site, commits resolved;
        and, ``final``ly, every site's table equal to the fold of the commits that can reach it."""
        sim = self.sim
        problems: list[str] = []
        for c in self.consumers:
            site = sim.sites[c.session.site]
            if c.pending or not c.session.ready or not site.up:
                problems.append(f"{c.name} at {site.id}: commits pending or session not started")
                continue
            held = VectorOffset(site.logs[c.key].vector())
            if not held <= c.session.vector():
                problems.append(
                    f"{c.name} at {site.id} consumed {c.session.vector().to_text()}, the site holds {held.to_text()}"
                )
        if problems or not final:
            return problems
        expected = self._expected_winners()
        for sid, site in sorted(sim.sites.items()):
            for c in self.consumers:
                want = expected[sid].get(c.group, c.key[0], c.key[1])
                got = site.commits.table.get(c.group, c.key[0], c.key[1])
                if want != got:
                    problems.append(
                        f"site {sid} returns commit #{c.index_of(got)} of {c.name}; the commits that reach it "
                        f"make #{c.index_of(want)} the winner"
                    )
        return problems

    def _expected_winners(self) -> dict[SiteId, CommitTable]:
        """Per site, the fold of every commit held at any site whose links carrying the internal topic
        lead to it (so, once I4 holds, exactly the commits it must have)."""
        sim = self.sim
        held: dict[SiteId, list[Commit]] = {}
        for sid, site in sim.sites.items():
            fresh = type(site.commits)(site.commits.decode)
            report = fresh.catch_up({key[1]: site.logs[key] for key in self.offsets_keys})
            held[sid] = [f.commit for f in report.folded]
        out: dict[SiteId, CommitTable] = {sid: CommitTable() for sid in sim.sites}
        for src in sorted(held):
            for dst in sorted(expected_sites(sim.topology, src, OFFSETS_TOPIC)):
                for commit in held[src]:
                    out[dst].apply(commit)
        return out

    def check_done(self) -> None:
        problems = self.problems(final=True)
        if problems:
            shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
            raise InvariantViolation(f"I5 after healing: {shown}")
        for c in self.consumers:
            if c.exactly_once and c.counting and VectorOffset(c.counted) != c.session.vector():
                raise InvariantViolation(
                    f"I5 exactly once: {c.name} counted {VectorOffset(c.counted).to_text()} but consumed "
                    f"{c.session.vector().to_text()}"
                )
