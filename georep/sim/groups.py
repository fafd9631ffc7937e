"""A simulated consumer group whose members join at several sites, and the group invariants.

Members of one group (``GROUP``) subscribe to one topic. Each member
heartbeats the ``GroupCoordinator`` of the site it is connected to
(``cluster/groups.py``, one per site, volatile: a crash empties it), reads
the partitions that site assigns it with the node's ``FetchCursor``, each
from the commit that site's table holds, and commits its vectors with its
member id and generation through the site's ``CommitLog``. Members hop to
other sites (leaving, or just going silent until their session expires) and
rejoin after their site crashes. Groups are per site in georep: members at two
sites are two groups sharing one set of commits, latest stamp wins.

Checked:

* **G1, one owner per partition at a site.** After every heartbeat and every
  expiry, a site's live members hold disjoint assignments that cover every
  partition of the topic.
* **G2, fencing.** A commit is taken only from a member that holds the
  partition at the site's current generation; the others are refused
  (counted, so a run shows the path is taken).
* **G3, no loss.** A commit never covers a record that no member of the group
  delivered: per partition and origin, the group's deliveries form a prefix
  ``0 .. n-1`` (a member starts at a commit, which by induction is within
  that prefix), and every committed vector lies within it. A member that
  started beyond the prefix, or a commit that claims more, would make the
  group skip records for good.
* **Every session** keeps the per-session checks of I5 (``consumers.py``).
* **Liveness**: after healing, the members that went silent have been
  expired everywhere, so at each site every partition is owned by a member
  that is there; and each member has read everything its site holds of the
  partitions it owns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cluster.groups import GroupError, IllegalGeneration, NotAssigned, UnknownMember
from georep.broker.commits import CommitEntry
from georep.replication.links import PartitionKey
from georep.sim.checker import InvariantViolation
from georep.sim.consumers import Session, commit_at, read_records, start_cursor
from georep.sim.site import SimSite
from offsets.coordinates import Origin
from offsets.vector import VectorOffset
from topology.ids import SiteId

if TYPE_CHECKING:
    from georep.sim.simulator import Simulator

GROUP = "sim-group"


@dataclass(slots=True)
class SimMember:
    index: int
    name: str  # its client id
    site: SiteId
    incarnation: int
    commit_every: int
    member_id: str = ""
    generation: int = -1
    sessions: dict[PartitionKey, Session] = field(default_factory=dict)
    last_stamp: int = 0
    since_commit: int = 0

    def leave_site(self) -> None:
        self.member_id = ""
        self.generation = -1
        self.sessions = {}
        self.since_commit = 0


class GroupWorkload:
    def __init__(self, sim: Simulator, count: int) -> None:
        self.sim = sim
        self.members: list[SimMember] = []
        self.topic = ""
        if not count:
            return
        self.topic = max(sorted({k[0] for k in sim.data_keys}), key=lambda t: sim.topics[t])
        self.partitions = sim.topics[self.topic]
        self.assignor = sim.rng.choice(("range", "sticky"))
        for i in range(count):
            site = sim.rng.choice(sorted(sim.sites))
            every = sim.rng.randint(*sim.config.commit_every)
            self.members.append(SimMember(i, f"m{i}", site, sim.sites[site].incarnation, every))
        # per partition and origin, the seqs 0 .. n-1 some member of the group delivered (G3)
        self.prefix: dict[PartitionKey, dict[Origin, int]] = {}

    def handlers(self) -> dict[str, Callable[..., None]]:
        return {"member_heartbeat": self._on_heartbeat, "member_consume": self._on_consume, "member_hop": self._on_hop}

    def start(self) -> None:
        sim = self.sim
        for m in self.members:
            sim._after(sim.rng.randint(0, sim.config.heartbeat_interval_ms), "member_heartbeat", m.index)
            sim._after(sim.rng.randint(*sim.config.consume_ms), "member_consume", m.index)
            sim._after(sim.rng.randint(*sim.config.hop_ms), "member_hop", m.index)

    # -- membership -----------------------------------------------------------------------

    def _on_heartbeat(self, mi: int) -> None:
        sim = self.sim
        m = self.members[mi]
        sim._after(sim.config.heartbeat_interval_ms, "member_heartbeat", mi)
        site = sim.alive(m.site, m.incarnation)
        if site is None:
            self._move(m, forced=True)  # its site crashed: the connection broke
            return
        self._heartbeat(m, site)

    def _heartbeat(self, m: SimMember, site: SimSite) -> None:
        sim = self.sim
        now = sim.local_ms(site)
        try:
            hb = site.coordinator.heartbeat(
                GROUP, m.member_id, [self.topic], sim.config.session_timeout_ms, self.assignor, now, m.name
            )
        except UnknownMember:
            m.leave_site()  # its session expired: fenced; join again
            sim.counts.members_fenced += 1
            hb = site.coordinator.heartbeat(
                GROUP, "", [self.topic], sim.config.session_timeout_ms, self.assignor, now, m.name
            )
        sim.counts.group_heartbeats += 1
        m.member_id = hb.member_id
        if hb.generation != m.generation:
            m.generation = hb.generation
            owned = set(hb.assignment)
            for key in sorted(set(m.sessions) - owned):
                del m.sessions[key]  # revoked
            for key in sorted(owned - set(m.sessions)):
                commit = site.commits.table.get(GROUP, key[0], key[1])
                start = commit.vector if commit is not None else VectorOffset()
                session = Session(site.id, site.incarnation, start, "assigned", -1)
                session.cursor = start_cursor(site, key, commit)
                m.sessions[key] = session
        self._check_assignment(site)

    def _check_assignment(self, site: SimSite) -> None:
        """G1: the site's live members hold disjoint assignments covering every partition."""
        group = site.coordinator.groups.get(GROUP)
        if group is None or not group.members:
            return
        owner: dict[tuple[str, int], str] = {}
        for member_id, member in sorted(group.members.items()):
            for tp in member.assignment:
                if tp in owner:
                    raise InvariantViolation(
                        f"G1: at site {site.id}, {tp[0]}[{tp[1]}] is assigned to both {owner[tp]} and {member_id} "
                        f"in generation {group.generation}"
                    )
                owner[tp] = member_id
        missing = [p for p in range(self.partitions) if (self.topic, p) not in owner]
        if missing:
            raise InvariantViolation(
                f"G1: at site {site.id}, generation {group.generation} of {GROUP} leaves {self.topic} partitions "
                f"{missing} unassigned with {len(group.members)} member(s)"
            )

    def tick(self, site: SimSite) -> None:
        """The site's coordinator expires members whose session timed out."""
        if not self.members:
            return
        if site.coordinator.expire(self.sim.local_ms(site)):
            self.sim.counts.members_expired += 1
            self._check_assignment(site)

    def _on_hop(self, mi: int) -> None:
        sim = self.sim
        if sim.phase != "safety":
            return
        sim._after(sim.rng.randint(*sim.config.hop_ms), "member_hop", mi)
        self._move(self.members[mi], forced=False)

    def _move(self, m: SimMember, forced: bool) -> None:
        """To another live site; a planned move leaves the old site's group half of the time."""
        sim = self.sim
        live = [s for s, site in sorted(sim.sites.items()) if site.up]
        others = [s for s in live if s != m.site] or live
        if not others:
            return
        old = sim.alive(m.site, m.incarnation)
        if old is not None and m.member_id and not forced and sim.rng.random() < 0.5:
            try:
                old.coordinator.leave(GROUP, m.member_id)
                self._check_assignment(old)
            except UnknownMember:
                pass
        target = sim.rng.choice(others)
        sim._log(f"member {m.name} moves {m.site} -> {target}")
        m.leave_site()
        m.site = target
        m.incarnation = sim.sites[target].incarnation
        sim.counts.member_moves += 1
        self._heartbeat(m, sim.sites[target])

    def site_crashed(self, site: SimSite) -> None:
        """The site's coordinator is gone; its members notice at their next heartbeat."""

    # -- reading and committing --------------------------------------------------------------

    def _on_consume(self, mi: int) -> None:
        sim = self.sim
        m = self.members[mi]
        sim._after(sim.rng.randint(*sim.config.consume_ms), "member_consume", mi)
        site = sim.alive(m.site, m.incarnation)
        if site is None:
            return
        for key, session in sorted(m.sessions.items()):
            records = read_records(sim, session, key)
            for origin, seq in records or ():
                session.deliver(m.name, origin, seq)
                self._delivered(m, key, origin, seq)
            m.since_commit += len(records or ())
        if m.sessions and m.since_commit >= m.commit_every:
            self._commit(m, site)

    def _delivered(self, m: SimMember, key: PartitionKey, origin: Origin, seq: int) -> None:
        """G3: a record beyond the group's delivered prefix means the group skipped records."""
        prefix = self.prefix.setdefault(key, {})
        n = prefix.get(origin, 0)
        if seq > n:
            raise InvariantViolation(
                f"G3 no loss: member {m.name} of {GROUP} delivered {origin} seq {seq} of {key[0]}[{key[1]}], but the "
                f"group never delivered seqs {n}..{seq - 1}: it started past records no member read"
            )
        prefix[origin] = max(n, seq + 1)
        self.sim.counts.group_deliveries += 1

    def _commit(self, m: SimMember, site: SimSite) -> None:
        sim = self.sim
        keys = sorted(m.sessions)
        try:
            site.coordinator.check_commit(GROUP, m.member_id, m.generation, keys)
        except (UnknownMember, IllegalGeneration, NotAssigned) as exc:
            sim.counts.commits_fenced += 1  # G2: the coordinator refused a member that no longer owns them
            sim._log(f"commit of member {m.name} refused: {exc}")
            return
        except GroupError as exc:
            raise InvariantViolation(f"member {m.name}: unexpected refusal of its commit: {exc}") from exc
        entries = []
        for key in keys:
            session = m.sessions[key]
            vector = session.vector()
            held = VectorOffset(self.prefix.get(key, {}))
            if not vector <= held:
                raise InvariantViolation(
                    f"G3 no loss: member {m.name} commits {vector.to_text()} for {key[0]}[{key[1]}], beyond what the "
                    f"group delivered ({held.to_text()})"
                )
            cursor = session.cursor
            assert cursor is not None
            entries.append(CommitEntry(key[0], key[1], vector, cursor.position))
        commit = commit_at(sim, site, GROUP, entries, m.last_stamp, lambda error: None, m.member_id, m.generation)
        m.last_stamp = commit.hlc
        m.since_commit = 0

    # -- after healing ------------------------------------------------------------------------

    def problems(self) -> list[str]:
        sim = self.sim
        out: list[str] = []
        here: dict[SiteId, set[str]] = {sid: set() for sid in sim.sites}
        for m in self.members:
            if sim.alive(m.site, m.incarnation) is not None and m.member_id:
                here[m.site].add(m.member_id)
        for sid, site in sorted(sim.sites.items()):
            group = site.coordinator.groups.get(GROUP) if site.up else None
            stale = sorted(set(group.members) - here[sid]) if group is not None else []
            if stale:
                out.append(f"site {sid} still counts {len(stale)} member(s) of {GROUP} that left: {stale[0]}")
        for m in self.members:
            live = sim.alive(m.site, m.incarnation)
            if live is None or not m.member_id:
                out.append(f"member {m.name} is not connected")
                continue
            group = live.coordinator.groups.get(GROUP)
            if group is None or m.member_id not in group.members or group.generation != m.generation:
                out.append(f"member {m.name} has not settled in {GROUP} at {live.id}")
                continue
            for key, session in sorted(m.sessions.items()):
                held = VectorOffset(live.logs[key].vector())
                if not held <= session.vector():
                    out.append(f"member {m.name} at {live.id} has not read all of {key[0]}[{key[1]}]")
        return out
