"""Built-in simulator topologies, by name.

Every name builds a :class:`topology.model.Topology` (validated like a
topology file). ``random-N`` draws a strongly connected digraph with cycles
from the simulator's seeded ``random.Random``, so the same seed gives the same
graph. The ``*-audit`` and ``*-split`` shapes put topic filters on some links,
so that invariant I4 is checked against ``expected_sites`` with filters, and
that some sites must *not* receive some topics.

The simulator's topics are ``orders/eu`` (2 partitions) and ``audit/x``
(1 partition) unless a caller passes others.
"""

from __future__ import annotations

import random
import re

from topology.filters import ALL_TOPICS, TopicFilter
from topology.ids import SiteId
from topology.model import Link, Site, Topology

DEFAULT_TOPICS: dict[str, int] = {"orders/eu": 2, "audit/x": 1}
AUDIT_ONLY = (TopicFilter("audit/**"),)
ORDERS_ONLY = (TopicFilter("orders/**"),)
RANDOM_SITES_MAX = 12
_RANDOM = re.compile(r"random-([0-9]+)")

# Static names; "random-N" (2 <= N <= 12) is accepted as well.
TOPOLOGY_NAMES: tuple[str, ...] = (
    "triangle",
    "ring5",
    "mesh5",
    "line4",
    "star5",
    "random-4",
    "random-6",
    "mesh4-audit",
    "diamond-audit",
    "ring4-split",
)


class UnknownTopologyName(ValueError):
    """A name that is not a built-in simulator topology."""


def _sites(names: list[str]) -> tuple[Site, ...]:
    return tuple(Site(SiteId(n), (f"127.0.0.1:{7101 + 100 * i}",)) for i, n in enumerate(names))


def _link(src: str, dst: str, topics: tuple[TopicFilter, ...] = ALL_TOPICS, cost: int = 1) -> Link:
    return Link(SiteId(src), SiteId(dst), topics, cost)


def _both_ways(pairs: list[tuple[str, str]]) -> list[Link]:
    return [_link(s, d) for s, d in pairs] + [_link(d, s) for s, d in pairs]


def _letters(n: int) -> list[str]:
    return [chr(ord("a") + i) for i in range(n)]


def _random(n: int, rng: random.Random) -> Topology:
    """A Hamiltonian cycle (carrying every topic, so the graph is strongly connected for every topic),
    plus random extra links with random costs, some of them filtered to ``audit/**``."""
    names = [f"s{i}" for i in range(n)]
    order = names[:]
    rng.shuffle(order)
    links: dict[tuple[str, str], Link] = {}
    for i, src in enumerate(order):
        dst = order[(i + 1) % n]
        links[(src, dst)] = _link(src, dst, cost=rng.randint(1, 3))
    for src in names:
        for dst in names:
            if src == dst or (src, dst) in links or rng.random() >= 0.3:
                continue
            topics = AUDIT_ONLY if rng.random() < 0.25 else ALL_TOPICS
            links[(src, dst)] = _link(src, dst, topics, rng.randint(1, 3))
    return Topology(_sites(names), tuple(links[k] for k in sorted(links)))


def build_topology(name: str, rng: random.Random) -> Topology:
    """The topology called ``name``; ``rng`` is used only by ``random-N``."""
    if name == "triangle":
        return Topology(_sites(["a", "b", "c"]), tuple(_both_ways([("a", "b"), ("b", "c"), ("c", "a")])))
    if name == "ring5":
        s = _letters(5)
        return Topology(_sites(s), tuple(_link(s[i], s[(i + 1) % 5]) for i in range(5)))
    if name == "mesh5":
        s = _letters(5)
        return Topology(_sites(s), tuple(_link(x, y) for x in s for y in s if x != y))
    if name == "line4":
        s = _letters(4)
        return Topology(_sites(s), tuple(_both_ways([(s[i], s[i + 1]) for i in range(3)])))
    if name == "star5":
        hub, *spokes = _letters(5)
        return Topology(_sites([hub, *spokes]), tuple(_both_ways([(hub, x) for x in spokes])))
    if name == "mesh4-audit":
        # Full mesh, but a -> d and b -> d carry only audit/**: orders reach d through c alone.
        s = _letters(4)
        meshed = [
            _link(x, y, AUDIT_ONLY if (x, y) in (("a", "d"), ("b", "d")) else ALL_TOPICS)
            for x in s
            for y in s
            if x != y
        ]
        return Topology(_sites(s), tuple(meshed))
    if name == "diamond-audit":
        # d feeds b and c, which feed a; a -> d carries only audit/**, so orders written at a, b or c
        # never reach d, and orders written at a reach no one.
        links = (_link("d", "b"), _link("d", "c"), _link("b", "a"), _link("c", "a"), _link("a", "d", AUDIT_ONLY))
        return Topology(_sites(["a", "b", "c", "d"]), links)
    if name == "ring4-split":
        # A one-way ring where b -> c carries only orders/** and d -> a only audit/**, plus a
        # costly shortcut c -> a carrying everything.
        links = (
            _link("a", "b"),
            _link("b", "c", ORDERS_ONLY),
            _link("c", "d"),
            _link("d", "a", AUDIT_ONLY),
            _link("c", "a", cost=3),
        )
        return Topology(_sites(_letters(4)), links)
    match = _RANDOM.fullmatch(name)
    if match:
        n = int(match.group(1))
        if not 2 <= n <= RANDOM_SITES_MAX:
            raise UnknownTopologyName(f"random-N takes 2 <= N <= {RANDOM_SITES_MAX}, got {name!r}")
        return _random(n, rng)
    known = ", ".join(TOPOLOGY_NAMES)
    raise UnknownTopologyName(f"unknown simulator topology {name!r}; choose one of {known}, or random-N")
