"""Expected reach: which sites should end up holding an origin's records of a topic. Pure.

A record of topic T written at site O should reach every site to which a chain
of links carrying T leads from O (O included). This is the set that invariant I4
(convergence) and the Spark audit check each site against.
"""

from __future__ import annotations

from collections.abc import Iterable

from topology.ids import SiteId
from topology.model import Topology


def expected_sites(
    topology: Topology,
    origin_site: str,
    topic: str,
    live_links: Iterable[tuple[str, str]] | None = None,
    through_interest: bool = True,
) -> frozenset[SiteId]:
    """Sites that ``origin_site``'s records of ``topic`` reach over links whose filters carry ``topic``.

    ``live_links``: the (src, dst) pairs to use; None means every link of the topology.
    Pairs that are not links of the topology are ignored. ``through_interest``: False leaves out the links in
    mode "interest" (``topology/interest.py``), which carry a topic only while someone behind them reads it: the
    sites every record must reach (the audit's expectation, ``acks=geo:N``'s count), rather than those it may.
    """
    origin = topology.site(origin_site).id  # raises UnknownSite
    live = None if live_links is None else frozenset(live_links)
    out_of: dict[SiteId, list[SiteId]] = {}
    for link in topology.links_sorted():
        if (live is None or link.key in live) and link.carries(topic) and (through_interest or link.mode == "all"):
            out_of.setdefault(link.src, []).append(link.dst)
    seen = {origin}
    todo = [origin]
    while todo:
        for nxt in out_of.get(todo.pop(), []):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return frozenset(seen)
