"""Interest-based links: which topics a site pulls over a link of ``mode = "interest"``. Pure.

A link ``src -> dst`` in interest mode carries a topic only while ``dst``, or a site downstream of it, wants the
topic: a subscription or a consumer group there reads it (the site's *local* interests), or a link out of ``dst``
in mode ``"all"`` carries it (whoever pulls everything from ``dst`` wants it). Interests travel against the data,
as routes do: each site tells each upstream what it and the sites behind it want (an *advert*), and pulls a topic
over an interest link while any interest it holds matches it, or matched it less than ``linger_ms`` ago.

**An interest is an entry** ``(filter, site, path)``: ``site`` (the beneficiary) wants the topics ``filter``
matches (a topic name is a filter of literal levels), and ``path`` lists the sites the entry passed through,
``site`` first. A site's own interests have the path ``(site,)``; an ``"all"`` link out of it to ``E`` gives
``(filter, E, (E, site))`` for each of the link's filters. A site advertises to an upstream ``U`` the
shortest-path entry of each ``(filter, site)`` whose path does not hold ``U``, with itself appended; an advert
replaces the previous one from the same sender, and an upstream drops a sender's advert when its link goes down.

**Why stale interest dies, cycles included.** An entry a site holds was in its sender's current advert, which is
a function of the sender's current state; so every held entry has a chain of current adverts behind it back to
the site that wants it, along its path. A path never holds a site twice (a site drops entries whose path holds
it), so paths are at most as long as the site count. When the interested site withdraws, the entries of path
length 1 are gone at once; an entry of length k was derived from one of length k - 1, so after k rounds of adverts
none is left: no loop of sites can keep an interest alive that nobody has. Split horizon alone (not telling a
site what it told you) does not stop three sites in a cycle from feeding each other a withdrawn entry for ever;
the path does. Conversely, a wanted topic's entries reach every upstream over live links in as many rounds as the
path is long, so after the adverts settle a site wants a topic exactly when the least fixed point of the rule in
the first paragraph says so (``tests/test_interest.py`` checks it on random graphs while sites subscribe,
unsubscribe and links fail).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from topology.filters import TopicFilter, is_internal
from topology.ids import SiteId
from topology.model import Topology

DEFAULT_LINGER_MS = 30_000  # a site's interest_linger_ms unless its table says

Entry = tuple[str, SiteId, tuple[SiteId, ...]]  # (filter text, the interested site, the path, that site first)
Source = str  # "" for this site's own interests, else the downstream site whose advert it was


@dataclass
class _Match:
    """The filters of a set of entries, by kind: exact names in a set, wildcard filters in a list."""

    names: set[str] = field(default_factory=set)
    filters: list[TopicFilter] = field(default_factory=list)

    @classmethod
    def of(cls, texts: Iterable[str]) -> _Match:
        out = cls()
        for text in set(texts):
            f = TopicFilter(text)
            if any(level in ("+", "**") for level in f.levels):
                out.filters.append(f)
            else:
                out.names.add(text)
        return out

    def __call__(self, topic: str) -> bool:
        return topic in self.names or any(f.matches(topic) for f in self.filters)

    def matching(self, topic: str) -> list[str]:
        """The filters that match ``topic``, as texts."""
        return ([topic] if topic in self.names else []) + [f.text for f in self.filters if f.matches(topic)]


class Interests:
    """One site's interest table: its own interests, its downstreams' adverts, what it pulls and advertises."""

    def __init__(self, topology: Topology, site: str, linger_ms: int = DEFAULT_LINGER_MS) -> None:
        self.topology = topology
        self.site = SiteId(site)
        self.linger_ms = linger_ms
        self.held: dict[Source, frozenset[Entry]] = {"": frozenset()}
        for link in topology.links:  # whoever pulls everything from this site wants what the link carries
            if link.src == self.site and link.mode == "all":
                extra = {(f.text, link.dst, (link.dst, self.site)) for f in link.topics}
                self.held[""] = self.held[""] | extra
        self._static = self.held[""]
        self._lost: dict[tuple[Source, str], int] = {}  # (source, filter) -> when it stopped being held
        self._leases: dict[str, int] = {}  # downstream -> when its advert lapses (receive's lease_ms)
        self._matchers: dict[Source, _Match] = {}
        # The filters whose holding changed since take_changed(): what wants() answers changed only for the topics
        # they match (a site of 100,000 topics asks again about those, not about every topic).
        self._changed: set[str] = set()
        self._lost_by_source: dict[Source, _Match] | None = None  # _lost's filters parsed (_lost_matchers)

    # -- events ---------------------------------------------------------------------------------------------

    def set_local(self, filters: Iterable[str], now_ms: int) -> bool:
        """This site's own interests now (topic names and filters); True if they changed."""
        entries = self._static | {(f, self.site, (self.site,)) for f in filters}
        return self._replace("", entries, now_ms)

    def receive(self, downstream: str, advert: Iterable[Entry], now_ms: int, lease_ms: int | None = None) -> bool:
        """The advert ``downstream`` sent over its interest link from this site; True if what it holds changed.
        ``lease_ms``: it lapses (as :meth:`drop`) unless another comes within that long."""
        kept = frozenset(e for e in advert if self.site not in e[2] and not is_internal(e[0]))
        if lease_ms is not None:
            self._leases[downstream] = now_ms + lease_ms
        return self._replace(downstream, kept, now_ms)

    def drop(self, downstream: str, now_ms: int) -> bool:
        """``downstream``'s link went down: its advert no longer counts (it lingers as any lost interest)."""
        if downstream not in self.held:
            return False
        self._replace(downstream, frozenset(), now_ms)
        del self.held[downstream]
        return True

    def tick(self, now_ms: int) -> bool:
        """Drop the adverts whose lease ran out, forget interests lost ``linger_ms`` ago; True if anything changed
        (what this site pulls, or advertises, may shrink)."""
        lapsed = [d for d, until in self._leases.items() if until <= now_ms]
        for downstream in lapsed:
            del self._leases[downstream]
            self.drop(downstream, now_ms)
        expired = [k for k, at in self._lost.items() if now_ms - at >= self.linger_ms]
        for k in expired:
            del self._lost[k]
        if expired:
            self._lost_by_source = None
        self._changed.update(text for _source, text in expired)
        return bool(expired or lapsed)

    def take_changed(self) -> set[str]:
        """The filters held, lost or forgotten since the last call: :meth:`wants` changed for no topic that none
        of them matches (more than changed, never less: a filter another source still holds is in it too)."""
        changed, self._changed = self._changed, set()
        return changed

    # -- decisions ------------------------------------------------------------------------------------------

    def wants(self, topic: str, now_ms: int) -> bool:
        """Whether this site pulls ``topic`` over its interest links now (internal topics: always)."""
        return is_internal(topic) or bool(self.why(topic, now_ms, first=True))

    def why(self, topic: str, now_ms: int, first: bool = False) -> list[str]:
        """Who wants ``topic`` here, one line each (``georep status``): "site c (orders/**)", lingering ones too."""
        out: list[str] = []
        for source, entries in self.held.items():
            if source and not self._carries_to(source, topic):
                continue
            if self._matcher(source)(topic):
                if first:  # wants(): whether, not who
                    return [source]
                texts = set(self._matcher(source).matching(topic))
                out += sorted({f"site {e[1]} ({e[0]})" for e in entries if e[0] in texts})
        for source, lost in self._lost_matchers().items():
            if source and not self._carries_to(source, topic):
                continue
            for text in lost.matching(topic):
                at = self._lost[(source, text)]
                if now_ms - at < self.linger_ms:
                    out.append(f"{text}, lingering until {at + self.linger_ms} ms")
                    if first:
                        return out
        return out

    def advert_for(self, upstream: str) -> frozenset[Entry]:
        """What this site tells ``upstream``: per (filter, site), the shortest path without ``upstream``, extended
        by this site."""
        best: dict[tuple[str, SiteId], tuple[SiteId, ...]] = {}
        for entries in self.held.values():
            for text, site, path in entries:
                if upstream in path:
                    continue
                known = best.get((text, site))
                if known is None or (len(path), path) < (len(known), known):
                    best[(text, site)] = path
        return frozenset(
            (text, site, path if path[-1] == self.site else (*path, self.site)) for (text, site), path in best.items()
        )

    # -- internals ------------------------------------------------------------------------------------------

    def _replace(self, source: Source, entries: frozenset[Entry], now_ms: int) -> bool:
        before = self.held.get(source, frozenset())
        if entries == before:
            return False
        still, was = {e[0] for e in entries}, {e[0] for e in before}
        for text in was - still:
            self._lost[(source, text)] = now_ms
        for text in still:
            self._lost.pop((source, text), None)
        self._changed |= still ^ was
        self._lost_by_source = None
        self.held[source] = entries
        self._matchers.pop(source, None)
        return True

    def _lost_matchers(self) -> dict[Source, _Match]:
        """The lost filters by source, parsed once per change of them: a site whose 1,000 lingering filters were
        parsed again for each topic asked about took seconds to answer a subscription (issue 25)."""
        if self._lost_by_source is None:
            texts: dict[Source, list[str]] = {}
            for source, text in self._lost:
                texts.setdefault(source, []).append(text)
            self._lost_by_source = {source: _Match.of(t) for source, t in sorted(texts.items())}
        return self._lost_by_source

    def _matcher(self, source: Source) -> _Match:
        m = self._matchers.get(source)
        if m is None:
            m = self._matchers[source] = _Match.of(e[0] for e in self.held.get(source, frozenset()))
        return m

    def _carries_to(self, downstream: str, topic: str) -> bool:
        link = next((li for li in self.topology.links if li.src == self.site and li.dst == downstream), None)
        return link is not None and link.carries(topic)
