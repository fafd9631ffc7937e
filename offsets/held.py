"""What each site is known to hold durably: the basis of geo-synchronous acks.

Every site keeps a :class:`HeldTable`: for each ``(site, topic, partition)``
it has heard of, the vector that site holds fsynced. Its own entries come from
its fsyncs. A site reports its table to each upstream it pulls from
(``ReportHeld``), so knowledge flows against the replication links, from the
sites that receive records back to the sites they came from: an origin learns
of every site its records reach, however many hops away.

Entries only grow (a vector merges by pointwise max), and a version counter
lets a reporter send only the entries that grew since its last report. An
``acks=geo:N`` ack waits until :meth:`HeldTable.sites_holding` counts N sites.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from offsets.coordinates import Origin
from offsets.vector import VectorOffset

HeldKey = tuple[str, str, int]  # (site, topic, partition)


@dataclass
class HeldTable:
    entries: dict[HeldKey, VectorOffset] = field(default_factory=dict)
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
        self.versions[key] = self.version
        self.sites.add(site)
        return True

    def changed_since(self, version: int) -> Iterator[tuple[HeldKey, VectorOffset]]:
        for key in sorted(k for k, v in self.versions.items() if v > version):
            yield key, self.entries[key]

    def sites_holding(self, topic: str, partition: int, origin: Origin, seq: int) -> list[str]:
        """Sites known to hold the record ``(origin, seq)`` of ``topic/partition`` fsynced, sorted."""
        held = self.entries
        return sorted(
            site for site in self.sites
            if (vector := held.get((site, topic, partition))) is not None and vector.covers(origin, seq)
        )  # fmt: skip


class HeldReporter:
    """What one site reports to one upstream it pulls from (``ReportHeld``). Pure.

    One report at a time: :meth:`next_report` hands out the entries that grew
    since the last report the upstream acknowledged, leaving out the
    upstream's own entries (it knows its own holdings better); what changes
    while a report is in flight goes in the next one, so a burst of fsyncs
    costs one report per round trip. :meth:`failed` makes the same entries go
    again; :meth:`reset` (the upstream reconnected, and may have restarted and
    forgotten) makes everything go again. The node's replicator and the
    simulator drive it alike.
    """

    __slots__ = ("upstream", "_acked", "_in_flight")

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self._acked = 0  # the table version the upstream has acknowledged
        self._in_flight: int | None = None

    def next_report(self, table: HeldTable) -> list[tuple[HeldKey, VectorOffset]] | None:
        """The entries to send now, or None (nothing new, or a report is in flight)."""
        if self._in_flight is not None:
            return None
        version = table.version
        entries = [(key, vector) for key, vector in table.changed_since(self._acked) if key[0] != self.upstream]
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
