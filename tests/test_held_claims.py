"""Claims about what other sites hold (``ReportHeld``): which the topology lets a reporter make, and how far what they
say of the receiving site's own records counts (docs/security.md, "Claims about other sites")."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from georep.auth.acl_replication import ClaimRefused, HeldClaimCheck, held_claim_refusal
from georep.auth.policy import Policy
from georep.auth.principal import parse_principal
from georep.proto import georep_pb2 as pb
from georep.security.acl_rpc import NODE_ACCESS, decide
from offsets.coordinates import Origin
from offsets.held import HeldReporter, HeldTable, ServedGate
from offsets.vector import VectorOffset
from tests.support.examples import examples
from topology.filters import TopicFilter
from topology.model import Link, Site, Topology
from topology.reach import expected_sites

SITES = "abcd"
A = Origin("a", 1)  # type: ignore[arg-type]
B = Origin("b", 1)  # type: ignore[arg-type]


def _topology(links: list[tuple[str, str, str]]) -> Topology:
    sites = tuple(Site(s, (f"127.0.0.1:{7000 + i}",)) for i, s in enumerate(SITES))  # type: ignore[arg-type]
    return Topology(sites, tuple(Link(s, d, (TopicFilter(f),)) for s, d, f in links))  # type: ignore[arg-type]


def test_a_reporter_speaks_only_for_the_sites_the_records_reach_through_it() -> None:
    """Item 8's topology: a <-> b, c -> b. b may say what b holds, never what c (which nothing of a's reaches) or
    zz (not in the topology) holds; and only of the topics a sends it."""
    topo = _topology([("a", "b", "orders/**"), ("b", "a", "**"), ("c", "b", "**"), ("b", "d", "orders/**")])
    assert held_claim_refusal(topo, "a", "b", "b", "orders/eu") is None
    assert held_claim_refusal(topo, "a", "b", "d", "orders/eu") is None  # a -> b -> d carries orders
    assert held_claim_refusal(topo, "a", "b", "b", "__georep_offsets") is None  # every link carries it
    assert "no chain of links carrying topic 'orders/eu' leads from site b to site c" in (
        held_claim_refusal(topo, "a", "b", "c", "orders/eu") or ""
    )
    assert "site 'zz' is not in the topology" in (held_claim_refusal(topo, "a", "b", "zz", "orders/eu") or "")
    assert "does not carry topic 'payments'" in (held_claim_refusal(topo, "a", "b", "b", "payments") or "")
    assert "no link a -> c" in (held_claim_refusal(topo, "a", "c", "c", "orders/eu") or "")
    assert "its own fsyncs" in (held_claim_refusal(topo, "a", "b", "a", "orders/eu") or "")
    assert "without a topology" in (held_claim_refusal(None, "a", "b", "b", "orders/eu") or "")
    check = HeldClaimCheck(topo, "a")
    assert check.refusal("b", "c", "orders/eu") == held_claim_refusal(topo, "a", "b", "c", "orders/eu")
    assert check.refusal("b", "d", "orders/eu") is None


def test_the_refusal_names_each_refused_claim_and_what_to_do() -> None:
    refused = [("c", "t", 0, "why c"), ("zz", "t", 0, "why zz"), ("zz", "t", 1, "why 1"), ("zz", "t", 2, "why 2")]
    text = str(ClaimRefused("a", "b", refused))
    assert "site a refused 4 claim(s) of site b's held report" in text
    assert "that site c holds t/0: why c" in text and "that site zz holds t/0: why zz" in text
    assert "(and 1 more)" in text and "same topology file" in text


link_sets = st.lists(
    st.tuples(st.sampled_from(SITES), st.sampled_from(SITES), st.sampled_from(["**", "x", "y"])), max_size=9
).map(lambda ls: list({(s, d): (s, d, f) for s, d, f in ls if s != d}.values()))


@settings(max_examples=examples(150), deadline=None)
@given(link_sets, st.sampled_from(["x", "y"]), st.sampled_from(SITES))
def test_honest_reports_reach_the_origin_and_no_accepted_claim_is_about_a_site_its_records_miss(
    links: list[tuple[str, str, str]], name: str, origin: str
) -> None:
    """The docstring of ``held_claim_refusal``, checked against the topology. Every site the origin's records
    reach holds them and reports to every site it pulls from, relaying what it accepted (leaving out what that
    upstream would refuse, as ``HeldReporter`` does); at the fixpoint:

    * completeness: the origin has accepted a claim about every site its records of the topic reach;
    * soundness: every claim any site accepted is about a site that the accepting site's records reach;
    * and a claim about a site outside the topology, or one the records miss, is refused whoever makes it.
    """
    topo = _topology(links)
    holders = expected_sites(topo, origin, name)
    known: dict[str, set[str]] = {s: ({s} if s in holders else set()) for s in SITES}
    for _ in range(len(SITES) + 1):
        for src, dst, _f in links:  # dst reports to src, whatever the link carries
            for site in sorted(known[dst]):
                if site != src and held_claim_refusal(topo, src, dst, site, name) is None:
                    known[src].add(site)
    assert known[origin] == set(holders), (known, holders)
    for me in SITES:
        reach = expected_sites(topo, me, name)
        assert known[me] <= reach, (me, known[me], reach)
        for reporter in [*SITES, "zz"]:
            assert held_claim_refusal(topo, me, reporter, "zz", name) is not None
            for site in SITES:
                if held_claim_refusal(topo, me, reporter, site, name) is None:
                    assert site in reach and site != me


def test_a_reporter_leaves_out_what_its_upstream_would_refuse() -> None:
    topo = _topology([("a", "b", "x"), ("b", "a", "**"), ("c", "b", "**")])
    table = HeldTable()
    table.update("b", "x", 0, VectorOffset({A: 3}))
    table.update("b", "y", 0, VectorOffset({A: 3}))  # a does not send y to b
    table.update("c", "x", 0, VectorOffset({A: 3}))  # b heard it, but a's records never reach c
    claims = HeldClaimCheck(topo, "a")
    reporter = HeldReporter("a", lambda key: claims.refusal("b", key[0], key[1]) is None)
    assert reporter.next_report(table) == [(("b", "x", 0), VectorOffset({A: 3}))]


def test_what_a_claim_says_of_this_sites_records_counts_only_up_to_what_has_left() -> None:
    gate = ServedGate(A)
    claim = VectorOffset({A: 10, B: 4})
    # nothing of a's has left: the claim counts for b's records only, and is kept
    assert gate.admit([("b", "t", 0, claim)]) == [("b", "t", 0, VectorOffset({B: 4}))]
    assert gate.sent("t", 1, 50) == []  # another partition
    assert gate.sent("t", 0, 6) == [("b", "t", 0, VectorOffset({A: 6, B: 4}))]
    assert gate.sent("t", 0, 5) == []  # the bound never goes down
    assert gate.opened("t", 0, 12) == [("b", "t", 0, claim)]  # all of it now: nothing kept
    assert gate.sent("t", 0, 20) == []
    assert gate.admit([("c", "t", 0, VectorOffset({A: 15}))]) == [("c", "t", 0, VectorOffset({A: 15}))]
    # records the log held when this node opened the partition may have left before: they count
    assert gate.opened("u", 0, 7) == []
    assert gate.admit([("b", "u", 0, VectorOffset({A: 9}))]) == [("b", "u", 0, VectorOffset({A: 7}))]


def test_a_site_reports_only_in_its_own_name_and_only_the_sites_nodes_pass_reports_on() -> None:
    topo = _topology([("a", "b", "**"), ("b", "a", "**")])
    policy = Policy("a", lambda: [], lambda: topo)
    site_b, node_a2 = parse_principal("site:b"), parse_principal("node:a/2")
    own = pb.ReportHeldRequest(reporter="b")
    assert decide(NODE_ACCESS, "ReportHeld", own, site_b, policy).allowed
    posing = decide(NODE_ACCESS, "ReportHeld", pb.ReportHeldRequest(reporter="c"), site_b, policy)
    assert not posing.allowed and "reports only in its own name" in posing.message
    passed = decide(NODE_ACCESS, "ReportHeld", pb.ReportHeldRequest(reporter="b", forwarded=True), site_b, policy)
    assert not passed.allowed and "only a node of site a passes" in passed.message
    assert decide(
        NODE_ACCESS, "ReportHeld", pb.ReportHeldRequest(reporter="b", forwarded=True), node_a2, policy
    ).allowed
    assert not decide(NODE_ACCESS, "ReportHeld", own, parse_principal("client:alice"), policy).allowed
