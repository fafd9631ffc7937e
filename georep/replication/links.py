"""The inbound links of one site: their states, routing per origin, and stall detection.

Pure: events and ``now_ms`` in, decisions out. The node's pullers and the
simulator feed it the same events:

* ``link_up(src)`` when a ``Replicate`` stream to ``src`` delivers its first
  message, ``link_down(src)`` when the stream or the connection fails;
* ``upstream_vector(src, partition, vector)`` from every chunk ``src`` sends
  (heartbeats included), ``local_vector(partition, vector)`` whenever this
  site's vector of a partition moves (an apply, a flush of its own appends);
* ``tick(now_ms)`` now and then, to detect stalls.

Cost. Both feeds are per partition that moved, and ``tick`` looks only at the
partitions of which some live upstream holds more than this site (kept by
``_judge`` at each feed): an idle site's tick costs O(links), not
O(partitions). A partition with no upstream ahead cannot make any upstream
"behind" (the rule below needs an upstream with more), so leaving it out
changes no decision. A stall is lifted once its upstream holds, of every
partition, what this site holds of the origin site: the partitions it is short
of are found with one walk when the stall begins, then kept at each feed (the
same two feeds, and ``link_down``, which forgets the link's vectors and walks
again), so a lasting stall costs nothing per tick either.

and ask it ``wants(src)``: for each partition the link carries, the origin
sites ``src`` must send. A puller reopens its stream when that answer changes.

Routing. For each (topic, origin site), the preferred upstream is the next
hop on the cheapest live path from the origin (``Router``). The links this
site does not terminate are assumed up: a site only sees its own inbound
links fail. An upstream that stays behind for an origin while another one has
more of it, for ``stall_ms``, is *stalled* for that origin site and skipped:
behind at the same partition for the whole time, while it reported no more
of that origin site's records on any partition (a link under load, behind
somewhere at every tick but delivering, is slow, not stalled). It is taken back once it has
caught up with this site.

After the routed next hops, every other live inbound link that carries the
topic is a last-resort candidate (see ``_candidates``).

A site also pulls its own origin site's records. A site rebuilt from empty
has a new epoch, and its records of older epochs come back from any upstream
that carries the topic, cheapest link first.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from offsets.coordinates import Origin
from topology.filters import TopicFilter
from topology.ids import SiteId
from topology.model import Topology
from topology.routing import Router

PartitionKey = tuple[str, int]
BehindEntry = tuple[SiteId, SiteId, PartitionKey]  # (upstream, origin site, partition)
DEFAULT_STALL_MS = 2_000


class LinkState(enum.StrEnum):
    CONNECTING = "connecting"
    STREAMING = "streaming"
    DOWN = "down"


@dataclass
class InboundLink:
    src: SiteId
    state: LinkState = LinkState.CONNECTING
    since_ms: int = 0
    last_error: str = ""
    vectors: dict[PartitionKey, dict[Origin, int]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Stall:
    src: SiteId
    origin_site: SiteId
    since_ms: int


class LinkManager:
    def __init__(self, topology: Topology, site: str, stall_ms: int = DEFAULT_STALL_MS) -> None:
        self.topology = topology
        self.site = topology.site(site).id
        self.stall_ms = stall_ms
        self.router = Router(topology)
        self.links: dict[SiteId, InboundLink] = {
            link.src: InboundLink(link.src) for link in topology.links_sorted() if link.dst == self.site
        }
        # The inbound links cheapest first: the order of the last-resort candidates.
        self._by_cost = sorted(
            (link for link in topology.links_sorted() if link.dst == self.site), key=lambda lk: (lk.cost, lk.src)
        )
        self.partitions: dict[str, int] = {}
        self.local: dict[PartitionKey, dict[Origin, int]] = {}
        # The partitions of which some live upstream holds more than this site: the only ones tick looks at.
        self._behind_keys: set[PartitionKey] = set()
        # (src, origin site, partition) -> since when src has been seen behind another upstream there, and what
        # src held of the origin site there then: progress starts the clock again (_mark_stalls)
        self._behind_since: dict[BehindEntry, tuple[int, int]] = {}
        self.stalled: dict[tuple[SiteId, SiteId], Stall] = {}
        # (src, origin site) whose src reported more of that origin site, on any partition, since the last tick
        self._moved: set[tuple[SiteId, SiteId]] = set()
        # Per stall, the partitions whose stalled upstream holds less of the origin site than this site (_short_of).
        self._short: dict[tuple[SiteId, SiteId], set[PartitionKey]] = {}
        # wants() depends only on the link states, the stalls and the topics; routing is costly
        # enough to dominate a simulated run, so answers are kept until one of those changes.
        self._wants: dict[SiteId, dict[PartitionKey, tuple[SiteId, ...]]] = {}
        # Topics created or grown since the answers were kept: the next wants() adds only them to the answers kept,
        # so a site learning 100,000 topics a batch at a time routes each topic once, not every topic at every batch
        # (issue 25). A topic never shrinks, so its partitions kept stay right.
        self._topics_changed: set[str] = set()
        # The failover order depends only on the link states (tick asks for it per partition and origin).
        self._failover: dict[tuple[str, SiteId], tuple[SiteId, ...]] = {}
        # Links in mode "interest" carry a topic only while this predicate holds (topology/interest.py; the node
        # sets it, and calls interests_changed when its answers may have); None: they carry what their filters do.
        self.interest: Callable[[str], bool] | None = None

    def _forget_wants(self) -> None:
        self._wants.clear()
        self._topics_changed.clear()

    def interests_changed(self, filters: Iterable[str] | None = None) -> None:
        """What this site wants over its interest links may have changed: for the topics ``filters`` match (None:
        any topic), wants() answers anew. A subscription to 1,000 of 100,000 topics routes those 1,000 again."""
        if filters is None:
            self._forget_wants()
        elif self._wants:
            self._topics_changed |= self._matching(filters)

    def _matching(self, filters: Iterable[str]) -> set[str]:
        """The topics known here that any of ``filters`` matches: a name is looked up, a wildcard filter walks the
        topics (it narrows by its literal prefix first)."""
        out: set[str] = set()
        for text in filters:
            f = TopicFilter(text)
            if f.prefix == text:  # no wildcard: a name
                if text in self.partitions:
                    out.add(text)
            else:
                out.update(name for name in self.partitions if f.matches(name))
        return out

    # -- events ---------------------------------------------------------------

    def link_up(self, src: str, now_ms: int) -> None:
        link = self.links[SiteId(src)]
        if link.state is not LinkState.STREAMING:
            link.state, link.since_ms = LinkState.STREAMING, now_ms  # its last error stays until progress
            self.router.set_link_up(src, self.site, True)
            self._forget_wants()
            self._failover.clear()
            for key in list(link.vectors):  # a down link's vectors did not count: now they do
                self._judge(key)

    def link_down(self, src: str, now_ms: int, error: str = "") -> None:
        link = self.links[SiteId(src)]
        if link.state is not LinkState.DOWN:
            link.state, link.since_ms = LinkState.DOWN, now_ms
            self.router.set_link_up(src, self.site, False)
            self._forget_wants()
            self._failover.clear()
        link.last_error = error or link.last_error
        keys = list(link.vectors)
        link.vectors.clear()  # what it held then is no promise of what it holds when it is back
        for key in keys:
            self._judge(key)
        for pair in self._short:
            if pair[0] == link.src:
                self._short[pair] = self._walk_short(pair)

    def topic(self, name: str, partitions: int) -> None:
        """A topic exists at this site with ``partitions`` partitions."""
        if self.partitions.get(name) != partitions:
            self.partitions[name] = partitions
            if self._wants:
                self._topics_changed.add(name)

    def upstream_vector(self, src: str, key: PartitionKey, vector: Mapping[Origin, int]) -> None:
        link = self.links[SiteId(src)]
        before = link.vectors.get(key, {})
        for origin, seq in vector.items():
            if seq > before.get(origin, 0):
                self._moved.add((link.src, origin.site))
        link.vectors[key] = dict(vector)
        self._judge(key)
        self._recheck_short(key)

    def local_vector(self, key: PartitionKey, vector: Mapping[Origin, int]) -> None:
        """This site's vector of ``key`` moved (an apply, an append, a cut): tell it for every change, since
        ``tick`` looks only at the partitions these events say some upstream is ahead of."""
        self.local[key] = dict(vector)
        self._judge(key)
        self._recheck_short(key)

    def tick(self, now_ms: int) -> None:
        """Mark stalls, and lift the ones whose upstream has caught up."""
        behind: dict[BehindEntry, int] = {}
        for key in sorted(self._behind_keys):  # the others have no upstream ahead: nothing to judge
            self._behind_at(key, behind)
        self._mark_stalls(behind, now_ms)
        pairs = {(src, origin_site) for src, origin_site, _key in behind}
        for pair in sorted(self.stalled):
            if pair not in pairs and not self._short.get(pair):
                del self.stalled[pair]
                self._short.pop(pair, None)
                self._forget_wants()

    def _behind_at(self, key: PartitionKey, behind: dict[BehindEntry, int]) -> None:
        """Add to ``behind`` each (upstream, origin site, ``key``) whose upstream is behind at ``key``, with what
        it holds of that origin site there (its progress)."""
        mine = self.local.get(key, {})
        best = self._best_vector(key)
        for origin in sorted(best):
            if best[origin] <= mine.get(origin, 0):
                continue  # no upstream has more than this site
            # Walk the failover order: stalled candidates that are still behind stay stalled, and the
            # first unstalled one (the one in use) is behind too, it stalls in turn. Checking only the
            # first candidate left an origin on a fallback that was behind as well, for good, while a
            # later candidate had more.
            for candidate in self._candidates(key[0], origin.site):
                theirs = self.links[candidate].vectors.get(key, {})
                if theirs.get(origin, 0) > mine.get(origin, 0):
                    break
                progress = sum(seq for o, seq in theirs.items() if o.site == origin.site)
                behind[(candidate, origin.site, key)] = progress
                if (candidate, origin.site) not in self.stalled:
                    break

    def _mark_stalls(self, behind: dict[BehindEntry, int], now_ms: int) -> None:
        """Stall an upstream for an origin site once one partition stayed behind for ``stall_ms`` while that
        upstream moved nothing of the origin site: not that partition, and not any other. Under a produce over
        many partitions some partition is behind at every tick, and for longer than ``stall_ms`` when the
        upstream's source is busy; an upstream that delivers is slow, not stalled. A partition it holds back for
        good while others flow still moves once writes stop (I4 is about then)."""
        moved, self._moved = self._moved, set()
        for entry, progress in sorted(behind.items()):
            seen = self._behind_since.get(entry)
            if seen is None or seen[1] != progress or (entry[0], entry[1]) in moved:
                seen = self._behind_since[entry] = (now_ms, progress)
            pair = (entry[0], entry[1])
            if now_ms - seen[0] >= self.stall_ms and pair not in self.stalled:
                self.stalled[pair] = Stall(pair[0], pair[1], now_ms)
                self._short[pair] = self._walk_short(pair)
                self._forget_wants()
        for entry in sorted(set(self._behind_since) - behind.keys()):
            del self._behind_since[entry]

    # -- decisions ------------------------------------------------------------

    def wants(self, src: str) -> dict[PartitionKey, tuple[SiteId, ...]]:
        """For each partition the link ``src -> site`` carries, the origin sites to pull over it.

        Partitions with no origin sites stay in the answer: their heartbeats
        tell this site what ``src`` holds, which stall detection needs. The
        answer is shared until the routing changes: read it, do not change it.
        """
        s = SiteId(src)
        if self._topics_changed:
            self._add_changed_topics()
        known = self._wants.get(s)
        if known is not None:
            return known
        out: dict[PartitionKey, tuple[SiteId, ...]] = {}
        for topic in sorted(self.partitions):
            self._want_topic(s, topic, out)
        self._wants[s] = out
        return out

    def _want_topic(self, s: SiteId, topic: str, out: dict[PartitionKey, tuple[SiteId, ...]]) -> None:
        """Add to ``out`` the partitions of ``topic`` the link ``s -> site`` carries, with their origins over it."""
        link = self.topology.link(s, self.site)
        if not link.carries(topic) or (
            link.mode == "interest" and self.interest is not None and not self.interest(topic)
        ):
            return
        origins = tuple(o for o in self.topology.site_ids() if self._route(topic, o) == s)
        for p in range(self.partitions[topic]):
            out[(topic, p)] = origins

    def _add_changed_topics(self) -> None:
        """The answers kept, with the topics created, grown or wanted otherwise since answered again: the others'
        routes did not change. An answer that changed is a new dict (a caller compares them by identity); one
        that did not stays the same object, so a link the change does not touch compares nothing."""
        changed, self._topics_changed = sorted(self._topics_changed), set()
        for s, known in list(self._wants.items()):
            fresh: dict[PartitionKey, tuple[SiteId, ...]] = {}
            for topic in changed:
                self._want_topic(s, topic, fresh)
            old = [(t, p) for t in changed for p in range(self.partitions[t]) if (t, p) in known]
            if len(old) == len(fresh) and all(fresh.get(key) == known[key] for key in old):
                continue
            out = dict(known)
            for key in old:
                del out[key]
            out.update(fresh)
            self._wants[s] = out

    def upstream_for(self, topic: str, origin_site: str) -> SiteId | None:
        return self._route(topic, SiteId(origin_site))

    def lag_records(self, key: PartitionKey) -> dict[Origin, int]:
        mine = self.local.get(key, {})
        best = self._best_vector(key)
        return {o: max(0, best[o] - mine.get(o, 0)) for o in sorted(best)}

    # -- internals ------------------------------------------------------------

    def _candidates(self, topic: str, origin_site: SiteId) -> tuple[SiteId, ...]:
        """The failover order: routed next hops first, then every other live inbound link.

        The router leaves out upstreams that reach the origin only through this
        site. Normally they have nothing to give, but after this site and the
        origin are both rebuilt from empty, they may hold the only copy of the
        origin's old epochs. Stall detection reaches them when the routed
        candidates have nothing.
        """
        known = self._failover.get((topic, origin_site))
        if known is not None:
            return known
        direct = [
            link.src for link in self._by_cost if link.carries(topic) and self.router.is_link_up(link.src, self.site)
        ]
        if origin_site == self.site:
            order = tuple(direct)
        else:
            routed = self.router.upstream_candidates(self.site, origin_site, topic)
            order = tuple(routed + [src for src in direct if src not in routed])
        self._failover[(topic, origin_site)] = order
        return order

    def _route(self, topic: str, origin_site: SiteId, skip_stalled: bool = True) -> SiteId | None:
        candidates = self._candidates(topic, origin_site)
        usable = [c for c in candidates if not (skip_stalled and (c, origin_site) in self.stalled)]
        if usable:
            return usable[0]
        return candidates[0] if candidates else None  # every candidate stalled: keep the best

    def _judge(self, key: PartitionKey) -> None:
        """Keep ``_behind_keys`` in step with one partition's vectors (O(links x origins))."""
        mine = self.local.get(key, {})
        if any(seq > mine.get(origin, 0) for origin, seq in self._best_vector(key).items()):
            self._behind_keys.add(key)
        else:
            self._behind_keys.discard(key)

    def _best_vector(self, key: PartitionKey) -> dict[Origin, int]:
        best: dict[Origin, int] = {}
        for link in self.links.values():
            if link.state is LinkState.DOWN:
                continue
            for origin, seq in link.vectors.get(key, {}).items():
                if seq > best.get(origin, 0):
                    best[origin] = seq
        return best

    def _short_of(self, pair: tuple[SiteId, SiteId], key: PartitionKey) -> bool:
        """Whether ``pair``'s upstream holds less of ``key`` than this site, for an origin of ``pair``'s site."""
        src, origin_site = pair
        theirs = self.links[src].vectors.get(key, {})
        return any(o.site == origin_site and theirs.get(o, 0) < seq for o, seq in self.local.get(key, {}).items())

    def _walk_short(self, pair: tuple[SiteId, SiteId]) -> set[PartitionKey]:
        """Every partition ``pair``'s upstream is short of: one walk of what this site holds (a stall begins, or
        its link forgot its vectors)."""
        return {key for key in self.local if self._short_of(pair, key)}

    def _recheck_short(self, key: PartitionKey) -> None:
        """One partition's vectors moved: keep each stall's short set in step (O(stalls))."""
        for pair, short in self._short.items():
            if self._short_of(pair, key):
                short.add(key)
            else:
                short.discard(key)
