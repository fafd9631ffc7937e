"""LinkManager: which origins each inbound link carries, failover on link loss and on stalls."""

from __future__ import annotations

from georep.replication.links import LinkManager, LinkState
from offsets.coordinates import Origin
from tests.support.topologies import DIAMOND_TOML
from topology.ids import SiteId
from topology.model import default_topology, parse_topology

D = Origin(SiteId("d"), 1)

# The diamond, and a filtered link back from a to d: a cycle that carries only audit topics.
DIAMOND = (
    DIAMOND_TOML
    + """[[links]]
src = "a"
dst = "d"
topics = ["audit/**"]
"""
)


def test_default_triangle_pulls_each_origin_from_itself_and_fails_over() -> None:
    m = LinkManager(default_topology(), "a")
    m.topic("t", 2)
    for src in ("b", "c"):
        m.link_up(src, 0)
    assert m.wants("b") == {("t", 0): ("a", "b"), ("t", 1): ("a", "b")}  # own old epochs: cheapest, then lowest id
    assert m.wants("c") == {("t", 0): ("c",), ("t", 1): ("c",)}
    m.link_down("c", 10, "connection refused")
    assert m.links[SiteId("c")].state is LinkState.DOWN
    assert m.wants("b")[("t", 0)] == ("a", "b", "c")  # around the lost link
    m.link_up("c", 20)
    assert m.wants("c")[("t", 0)] == ("c",)  # and back once it recovers


def test_filters_decide_which_partitions_a_link_carries() -> None:
    m = LinkManager(parse_topology(DIAMOND), "d")
    m.topic("orders", 1)
    m.topic("audit/x", 1)
    assert set(m.wants("a")) == {("audit/x", 0)}


def test_a_stalled_upstream_loses_the_origin_to_one_that_has_more_then_gets_it_back() -> None:
    m = LinkManager(parse_topology(DIAMOND), "a", stall_ms=1_000)
    m.topic("t", 1)
    m.link_up("b", 0)
    m.link_up("c", 0)
    assert m.upstream_for("t", "d") == "b"  # tie on cost: lowest id
    m.local_vector(("t", 0), {})
    m.upstream_vector("b", ("t", 0), {})  # b is behind: its own link from d is broken
    m.upstream_vector("c", ("t", 0), {D: 10})
    m.tick(0)
    assert m.upstream_for("t", "d") == "b"  # not yet: a stall needs stall_ms
    m.tick(999)
    assert m.upstream_for("t", "d") == "b"
    m.tick(1_000)
    assert m.upstream_for("t", "d") == "c"
    assert m.wants("c")[("t", 0)] == ("c", "d")
    assert m.lag_records(("t", 0)) == {D: 10}
    m.local_vector(("t", 0), {D: 10})  # c delivered
    m.tick(1_500)
    assert m.upstream_for("t", "d") == "c"  # b still has nothing
    m.upstream_vector("b", ("t", 0), {D: 10})  # b caught up
    m.tick(1_600)
    assert m.upstream_for("t", "d") == "b"


def test_a_down_link_forgets_what_it_reported() -> None:
    m = LinkManager(parse_topology(DIAMOND), "a")
    m.topic("t", 1)
    m.link_up("b", 0)
    m.upstream_vector("b", ("t", 0), {D: 5})
    assert m.lag_records(("t", 0)) == {D: 5}
    m.link_down("b", 1)
    assert m.lag_records(("t", 0)) == {}
