"""What each site is known to hold durably: the basis of geo-synchronous acks.

Every site keeps a :class:`HeldTable`: for each ``(site, topic, partition)``
it has heard of, the vector that site holds fsynced. Its own entries come from
its fsyncs. A site reports its table to each upstream it pulls from
(``ReportHeld``), so knowledge flows against the replication links, from the
sites that receive records back to the sites they came from: an origin learns
of every site its records reach, however many hops away.

Entries only grow (a vector merges by pointwise max), and a version counter
lets a reporter send only the entries that grew since its last report. The
entries are kept in the order they last grew, so finding them costs what
changed, not the table's size (sites x partitions). An
``acks=geo:N`` ack waits until :meth:`HeldTable.sites_holding` counts N sites.

A report is a claim, and claims are checked before they count
(ARCHITECTURE.md, "Claims are checked"): the receiving site takes only the
claims the topology lets the reporter make
(``georep.auth.acl_replication.held_claim_refusal``: about a site its
records reach through the reporter), and :class:`ServedGate` holds what they
say of the receiving site's own records to the ones that have left it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from offsets.coordinates import Origin
from offsets.vector import VectorOffset

HeldKey = tuple[str, str, int]  # (site, topic, partition)
HeldEntry = tuple[str, str, int, VectorOffset]  # (site, topic, partition, what the site holds)


@dataclass
class HeldTable:
    entries: dict[HeldKey, VectorOffset] = field(default_factory=dict)
    # The version at which each entry last grew, in that order (an entry that grows moves to the end).
    versions: dict[HeldKey, int] = field(default_factory=dict)
    version: int = 0
    sites: set[str] = field(default_factory=set)  # every site with an entry

    def update(self, site: str, topic: str, partition: int, vector: VectorOffset) -> bool:
        """Merge what ``site`` holds; True if the table learned something."""
        key = (site, topic, partition)
        current = self.entries.get(key)
        if current is not None and vector.dominated_by(current):
            return False
        self.version += 1
        self.entries[key] = vector if current is None else current.merge(vector)
        self.versions.pop(key, None)
        self.versions[key] = self.version
        self.sites.add(site)
        return True

    def changed_since(self, version: int) -> Iterator[tuple[HeldKey, VectorOffset]]:
        """The entries that grew after ``version``, sorted: read from the newest back, so O(what changed)."""
        changed: list[HeldKey] = []
        for key, v in reversed(self.versions.items()):
            if not v > version:
                break
            changed.append(key)
        for key in sorted(changed):
            yield key, self.entries[key]

    def sites_holding(self, topic: str, partition: int, origin: Origin, seq: int) -> list[str]:
        """Sites known to hold the record ``(origin, seq)`` of ``topic/partition`` fsynced, sorted."""
        held = self.entries
        return sorted(
            site
            for site in self.sites
            if (vector := held.get((site, topic, partition))) is not None and vector.covers(origin, seq)
        )


class HeldReporter:
    """What one site reports to one upstream it pulls from (``ReportHeld``). Pure.

    One report at a time: :meth:`next_report` hands out the entries that grew
    since the last report the upstream acknowledged, leaving out the
    upstream's own entries (it knows its own holdings better); what changes
    while a report is in flight goes in the next one, so a burst of fsyncs
    costs one report per round trip. :meth:`failed` makes the same entries go
    again; :meth:`reset` (the upstream reconnected, and may have restarted and
    forgotten) makes everything go again. ``accepts`` leaves out the entries
    the upstream would refuse (``held_claim_refusal`` with the upstream as
    ``me``): a claim about a site the upstream's records of that topic do not
    reach through this one. The node's replicator and the simulator drive it
    alike.
    """

    __slots__ = ("_acked", "_in_flight", "accepts", "upstream")

    def __init__(self, upstream: str, accepts: Callable[[HeldKey], bool] = lambda key: True) -> None:
        self.upstream = upstream
        self.accepts = accepts
        self._acked = 0  # the table version the upstream has acknowledged
        self._in_flight: int | None = None

    def next_report(self, table: HeldTable) -> list[tuple[HeldKey, VectorOffset]] | None:
        """The entries to send now, or None (nothing new, or a report is in flight).

        Entries that hold nothing are left out: an empty vector covers no record, so no ack counts it, yet every
        partition opens with one at every site (a create of 10,000 partitions in a 3-site cycle sent each upstream
        reports of 20,000 of them)."""
        if self._in_flight is not None:
            return None
        version = table.version
        entries = [
            (key, vector)
            for key, vector in table.changed_since(self._acked)
            if key[0] != self.upstream and self.accepts(key) and vector
        ]
        if not entries:
            self._acked = version
            return None
        self._in_flight = version
        return entries

    def acked(self) -> None:
        if self._in_flight is not None:
            self._acked = max(self._acked, self._in_flight)
        self._in_flight = None

    def failed(self) -> None:
        self._in_flight = None

    def reset(self) -> None:
        self._acked = 0
        self._in_flight = None

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None


class ServedGate:
    """Claims about this site's own records, held to the records that have left it. Pure.

    A site other than this one holds a record of this site's origin only if the record left it: a
    ``Replicate`` stream sent it. So a claim that a site holds this origin's records up to seq ``n`` counts only
    up to what has left, whatever the reporter may speak for: an ``acks=geo:N`` is never released for a record
    that no other site has been sent. What has left partition ``k``, as far as this node can tell, is its
    *bound*: the highest next seq of this origin that one of this node's streams sent (:meth:`sent`), and at
    least the next seq its log held when this node opened ``k`` (:meth:`opened`): those records may have left
    in an earlier life of the node, or under another node's leadership, and no one here can tell. Only the
    partition's leader releases geo acks and serves its streams, so the bound of the records it takes while it
    leads is exact.

    A claim is counted up to the bound (its other origins as they are), and the rest of it is kept, one per
    ``(site, topic, partition)``, merged: when the bound rises (a send; the partition opened here after a
    leadership change), the kept claims count up to the new bound. So a true report that came before the
    records were known to have left (a report passed on to a node that leads the partition only later) is not
    lost.
    """

    def __init__(self, origin: Origin) -> None:
        self.origin = origin
        self._bound: dict[tuple[str, int], int] = {}
        # Per partition (every send looks up its own: O(claims kept for it), not all of them), per reporting site.
        self._kept: dict[tuple[str, int], dict[HeldKey, VectorOffset]] = {}

    def bound(self, topic: str, partition: int) -> int:
        return self._bound.get((topic, partition), 0)

    def admit(self, entries: Iterable[HeldEntry]) -> list[HeldEntry]:
        """The entries to count now (each held to its partition's bound); the rest of each is kept."""
        out: list[HeldEntry] = []
        for site, topic, partition, vector in entries:
            bound = self.bound(topic, partition)
            if vector.get(self.origin) > bound:
                key = (site, topic, partition)
                kept_here = self._kept.setdefault((topic, partition), {})
                kept = kept_here.get(key)
                kept_here[key] = vector if kept is None else kept.merge(vector)
                vector = _held_to(vector, self.origin, bound)
            out.append((site, topic, partition, vector))
        return out

    def opened(self, topic: str, partition: int, next_seq: int) -> list[HeldEntry]:
        """This node opened the partition holding this origin's records below ``next_seq``; what now counts."""
        return self._raise(topic, partition, next_seq)

    def sent(self, topic: str, partition: int, next_seq: int) -> list[HeldEntry]:
        """A stream of this node sent this origin's records below ``next_seq``; what now counts."""
        return self._raise(topic, partition, next_seq)

    def _raise(self, topic: str, partition: int, next_seq: int) -> list[HeldEntry]:
        if next_seq <= self.bound(topic, partition):
            return []
        self._bound[(topic, partition)] = next_seq
        kept_here = self._kept.get((topic, partition))
        if not kept_here:
            return []
        out: list[HeldEntry] = []
        for key in sorted(kept_here):
            vector = kept_here[key]
            if vector.get(self.origin) <= next_seq:
                del kept_here[key]
            out.append((*key, _held_to(vector, self.origin, next_seq)))
        if not kept_here:
            del self._kept[(topic, partition)]
        return out


def _held_to(vector: VectorOffset, origin: Origin, next_seq: int) -> VectorOffset:
    """``vector`` with ``origin`` at most ``next_seq``."""
    if vector.get(origin) <= next_seq:
        return vector
    entries: dict[Origin, int] = dict(vector.to_dict())
    entries[origin] = next_seq
    return VectorOffset(entries)
