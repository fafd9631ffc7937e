"""Routing: for each destination, origin and topic, which upstream to pull from. Pure.

dst pulls the records of origin O and topic T from one preferred upstream: the
neighbour ``u`` with a live link ``u -> dst`` that carries T, such that ``u`` is
the last hop before dst on the cheapest path from O to dst over live links
that carry T (path cost: the sum of link costs). Ties go to the lowest site id.

Why this is loop-free: let d(x) be the cheapest cost from O to x. The preferred
upstream ``u`` of dst has d(u) + cost(u, dst) = d(dst), and every cost is at
least 1, so d strictly decreases at each hop, and following preferred upstreams
from dst ends at O (the only site with d = 0) after fewer than n hops.

The other candidates, the failover order when the preferred upstream is down
or stalled, are the live, T-carrying in-neighbours ``u`` of dst that can get
O's records without going through dst, ordered by the cheapest such cost
d'(u) + cost(u, dst), then by id. An in-neighbour that could only get the
records from dst itself would have nothing to give, so it is left out.

Routes depend on a topic only through the set of links that carry it, so
results are cached per such set and per set of live links: by each router, and
in one bounded cache shared by every router of the process (a simulation runs
thousands of routers over the same few graphs while its links flap).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from topology.ids import SiteId
from topology.model import Topology

ROUTES_CACHED = 16_384  # (graph, origin, destination) triples kept by the shared cache

_Key = tuple[SiteId, SiteId]


@dataclass(frozen=True, slots=True)
class Candidate:
    """One upstream choice: pull from ``upstream``; the whole path from the origin costs ``cost``."""

    upstream: SiteId
    cost: int


class Router:
    """Routes over a topology whose links go down and come back (:meth:`set_link_up`)."""

    def __init__(self, topology: Topology) -> None:
        self._topology = topology
        self._links = topology.links_sorted()
        self._down: set[_Key] = set()
        # topic -> whether each link carries it (filters never change; link states do)
        self._carrying: dict[str, tuple[bool, ...]] = {}
        self._routes: dict[tuple[tuple[bool, ...], SiteId, SiteId], tuple[Candidate, ...]] = {}

    @property
    def topology(self) -> Topology:
        return self._topology

    def set_link_up(self, src: str, dst: str, up: bool) -> None:
        """Mark the link ``src -> dst`` up or down. Routes change from the next query on."""
        self._topology.link(src, dst)  # raises UnknownLink
        key = (SiteId(src), SiteId(dst))
        was_up = key not in self._down
        if up == was_up:
            return
        if up:
            self._down.discard(key)
        else:
            self._down.add(key)
        # The cache keys already exclude down links, so entries stay correct; they just stop being hit.
        # Clear them anyway so flapping links cannot grow the cache without bound.
        self._routes.clear()

    def is_link_up(self, src: str, dst: str) -> bool:
        link = self._topology.link(src, dst)
        return link.key not in self._down

    def live_links(self) -> frozenset[_Key]:
        return frozenset(link.key for link in self._links if link.key not in self._down)

    def preferred_upstream(self, dst: str, origin_site: str, topic: str) -> SiteId | None:
        """The site dst should pull ``origin_site``'s records of ``topic`` from.

        None when dst is the origin, or when no live chain of links carrying the topic leads from
        the origin to dst.
        """
        found = self.candidates(dst, origin_site, topic)
        return found[0].upstream if found else None

    def upstream_candidates(self, dst: str, origin_site: str, topic: str) -> list[SiteId]:
        """Every usable upstream, best first (by path cost, then id): the failover order."""
        return [c.upstream for c in self.candidates(dst, origin_site, topic)]

    def candidates(self, dst: str, origin_site: str, topic: str) -> tuple[Candidate, ...]:
        """Like :meth:`upstream_candidates`, with each candidate's path cost."""
        d = self._topology.site(dst).id
        o = self._topology.site(origin_site).id
        if d == o:
            return ()
        carrying = self._carrying.get(topic)
        if carrying is None:
            carrying = self._carrying[topic] = tuple(link.carries(topic) for link in self._links)
        down = self._down
        mask = tuple(carries and link.key not in down for link, carries in zip(self._links, carrying, strict=True))
        cached = self._routes.get((mask, o, d))
        if cached is None:
            cached = self._compute(mask, o, d)
            self._routes[(mask, o, d)] = cached
        return cached

    def _compute(self, mask: tuple[bool, ...], origin: SiteId, dst: SiteId) -> tuple[Candidate, ...]:
        edges = tuple((link.src, link.dst, link.cost) for link, usable in zip(self._links, mask, strict=True) if usable)
        return _candidates(tuple(self._topology.site_ids()), edges, origin, dst)


@functools.lru_cache(maxsize=ROUTES_CACHED)
def _candidates(
    sites: tuple[SiteId, ...], edges: tuple[tuple[SiteId, SiteId, int], ...], origin: SiteId, dst: SiteId
) -> tuple[Candidate, ...]:
    """dst's candidates for origin's records over the graph of ``edges`` (src, dst, cost); see the docstring."""
    import networkx as nx  # here, not at the top: every CLI command imports this module, few route

    graph = nx.DiGraph()
    graph.add_nodes_from(sites)
    graph.add_weighted_edges_from(edges, weight="cost")
    in_neighbours = sorted(graph.predecessors(dst))
    if not in_neighbours:
        return ()
    # Paths that do not pass through dst: an upstream that only gets the records from dst has nothing to give.
    without_dst = nx.restricted_view(graph, [dst], [])
    cost_from_origin: dict[SiteId, int] = nx.single_source_dijkstra_path_length(without_dst, origin, weight="cost")
    found = [
        Candidate(u, cost_from_origin[u] + int(graph.edges[u, dst]["cost"]))
        for u in in_neighbours
        if u in cost_from_origin
    ]
    found.sort(key=lambda c: (c.cost, c.upstream))
    return tuple(found)
