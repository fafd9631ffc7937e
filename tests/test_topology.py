"""Topology files, topic filters, routing, expected reach and drawing (issue 3).

What a user relies on: a bad topology file is refused with a message that says
where the mistake is; a record of a topic reaches exactly the sites that the
links and their filters say; each site pulls an origin's records from the next
hop on the cheapest live path, with no routing loops, and reroutes when a link
goes down and back when it comes up.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import topology
from georep.cli.topology import STATE_COLOURS, LinkStatus, draw, main, summary_text
from tests.support.examples import examples
from topology import ids
from topology.filters import InvalidTopicFilter, TopicFilter, matches_any
from topology.ids import NODE_ID_MAX, InvalidSiteId, NodeId, SiteId, site_id
from topology.model import (
    InvalidTopology,
    Link,
    NodeSpec,
    Site,
    Topology,
    UnknownLink,
    UnknownSite,
    default_topology,
    parse_topology,
    warnings,
)
from topology.reach import expected_sites
from topology.routing import Router

PROPERTY = settings(max_examples=examples(150), deadline=None)

ISSUE_EXAMPLE = """\
[sites.a]
nodes = ["127.0.0.1:7101"]
[sites.b]
nodes = ["127.0.0.1:7201"]
[[links]]
src = "a"
dst = "b"
topics = ["**"]      # optional; default is everything
"""

SITES_AB = """\
[sites.a]
nodes = ["127.0.0.1:7101"]
[sites.b]
nodes = ["127.0.0.1:7201"]
"""


def S(text: str) -> SiteId:  # reads like a constructor
    return SiteId(text)


def make(
    links: Sequence[tuple[str, str] | tuple[str, str, int]],
    *,
    topics: dict[tuple[str, str], tuple[str, ...]] | None = None,
) -> Topology:
    """A topology from (src, dst[, cost]) tuples, with every site they mention."""
    ids = sorted({end for link in links for end in (link[0], link[1])})
    site_list = tuple(Site(S(s), (f"127.0.0.1:{7000 + 100 * i + 1}",)) for i, s in enumerate(ids))
    built = []
    for link in links:
        src, dst = link[0], link[1]
        cost = link[2] if len(link) == 3 else 1
        filters = tuple(TopicFilter(t) for t in (topics or {}).get((src, dst), ("**",)))
        built.append(Link(S(src), S(dst), filters, cost))
    return Topology(site_list, tuple(built))


# ---------------------------------------------------------------- parsing and validation


def test_the_issue_example_parses() -> None:
    t = parse_topology(ISSUE_EXAMPLE)
    assert t.site_ids() == ("a", "b")
    assert t.site("a").nodes == ("127.0.0.1:7101",)
    assert t.links == (Link(S("a"), S("b"), (TopicFilter("**"),), 1),)
    assert warnings(t) == [
        "site 'a' is not reached by any link: records written at other sites never get there "
        "(add a [[links]] table with dst = 'a')",
        "site 'b' has no outgoing link: records written at 'b' never leave it (add a [[links]] table with src = 'b')",
    ]


def test_topics_and_cost_are_optional_and_default_to_everything_and_1() -> None:
    t = parse_topology(
        SITES_AB + '[[links]]\nsrc = "a"\ndst = "b"\n[[links]]\nsrc = "b"\ndst = "a"\ncost = 7\n'
        'topics = ["orders/**", "+/audit"]\n'
    )
    ab, ba = t.link("a", "b"), t.link("b", "a")
    assert ab.topics == (TopicFilter("**"),) and ab.cost == 1 and ab.carries("anything/at/all")
    assert ba.cost == 7 and [str(f) for f in ba.topics] == ["orders/**", "+/audit"]
    assert ba.carries("orders") and ba.carries("x/audit") and not ba.carries("x/y/audit")


def test_default_topology_is_three_sites_in_a_cycle_plus_reverse_edges() -> None:
    t = default_topology()
    assert t.site_ids() == ("a", "b", "c")
    assert [t.site(s).nodes for s in "abc"] == [("127.0.0.1:7101",), ("127.0.0.1:7201",), ("127.0.0.1:7301",)]
    assert sorted(link.key for link in t.links) == sorted(
        [("a", "b"), ("b", "c"), ("c", "a"), ("b", "a"), ("c", "b"), ("a", "c")]
    )
    assert all(link.carries_everything and link.cost == 1 for link in t.links)
    assert warnings(t) == []


LINK = '[[links]]\nsrc = "{src}"\ndst = "{dst}"\n'


def links_text(*pairs: str, extra: str = "") -> str:
    return "".join(LINK.format(src=p[0], dst=p[1]) for p in pairs) + extra


def node_table(n: int, *, nid: int | None = None, address: str | None = None, raft: str | None = None) -> str:
    """Node n of site b in the table form: gRPC port 720n, Raft port 721n unless told otherwise."""
    return NodeSpec(
        NodeId(n if nid is None else nid), address or f"127.0.0.1:{7200 + n}", raft or f"127.0.0.1:{7210 + n}"
    ).as_toml()


BAD_FILES = {
    "unknown site in a link": (
        SITES_AB + links_text("ab", "bz"),
        "link #2 (b -> z): unknown site 'z'; known sites: a, b",
    ),
    "unknown src": (SITES_AB + links_text("qa"), "link #1 (q -> a): unknown site 'q'; known sites: a, b"),
    "self-link": (SITES_AB + links_text("ab", "aa"), "link #2 (a -> a): a link from a site to itself is not allowed"),
    "duplicate link": (
        SITES_AB + links_text("ab", "ba", "ab"),
        "link #3 (a -> b): duplicate of link #1; keep one link and put all its topic filters in it",
    ),
    "missing dst": (SITES_AB + '[[links]]\nsrc = "a"\n', "link #1: missing 'dst'"),
    "site id that is not a string": (
        SITES_AB + '[[links]]\nsrc = "a"\ndst = 2\n',
        "link #1: 'dst' must be a site id string, got 2",
    ),
    "unknown key in a link (typo for topics)": (
        SITES_AB + links_text("ab", extra='topic = ["orders/**"]\n'),
        "link #1 (a -> b): unknown key 'topic'; allowed keys are cost, dst, mode, rate_limit_bytes_per_s, src, topics",
    ),
    "unknown key in a site": (
        '[sites.a]\nnodes = ["127.0.0.1:7101"]\nnode = ["127.0.0.1:7102"]\n',
        "[sites.a]: unknown key 'node'; allowed keys are nodes",
    ),
    "unknown top-level key": (
        SITES_AB + '[[link]]\nsrc = "a"\ndst = "b"\n',
        "top level: unknown key 'link'; allowed keys are links, sites",
    ),
    "missing nodes": ("[sites.a]\n", "[sites.a]: missing 'nodes', for example nodes = [\"127.0.0.1:7101\"]"),
    "site with no nodes": ("[sites.a]\nnodes = []\n", "site 'a' has no nodes: list at least one"),
    "nodes not a list": (
        '[sites.a]\nnodes = "127.0.0.1:7101"\n',
        '[sites.a]: nodes must be a list of strings "HOST:PORT" or of tables '
        '{ id = 1, address = "HOST:PORT", raft = "HOST:PORT" }, got \'127.0.0.1:7101\'',
    ),
    "a node that is neither a string nor a table": (
        "[sites.a]\nnodes = [7101]\n",
        '[sites.a]: nodes must be a list of strings "HOST:PORT" or of tables',
    ),
    "nodes mixing strings and tables": (
        '[sites.b]\nnodes = ["127.0.0.1:7201", ' + node_table(2) + "]\n",
        "[sites.b]: nodes mixes strings and tables; write every node as a table, for example [sites.b] nodes = "
        '[{ id = 1, address = "127.0.0.1:7201", raft = "HOST:PORT" }, '
        '{ id = 2, address = "127.0.0.1:7202", raft = "HOST:PORT" }]',
    ),
    "unknown key in a node table": (
        "[sites.b]\nnodes = [" + node_table(1) + ', { id = 2, address = "127.0.0.1:7202", raft_address = "x" }]\n',
        "[sites.b], node #2: unknown key 'raft_address'; allowed keys are address, id, kafka, raft",
    ),
    "node table without an id": (
        '[sites.b]\nnodes = [{ address = "127.0.0.1:7201" }]\n',
        '[sites.b], node #1: missing \'id\'; write the node as { id = 1, address = "HOST:PORT", raft = "HOST:PORT" }',
    ),
    "node table without an address": (
        "[sites.b]\nnodes = [" + node_table(1) + ', { id = 2, raft = "127.0.0.1:7212" }]\n',
        "[sites.b], node #2: missing 'address'; write the node as "
        '{ id = 2, address = "HOST:PORT", raft = "HOST:PORT" }',
    ),
    "node id that is not an integer": (
        '[sites.b]\nnodes = [{ id = "1", address = "127.0.0.1:7201" }]\n',
        "[sites.b], node #1: id '1' must be an integer from 1 to 4095, for example id = 1",
    ),
    "node id that is a boolean": (
        '[sites.b]\nnodes = [{ id = true, address = "127.0.0.1:7201" }]\n',
        "[sites.b], node #1: id True must be an integer from 1 to 4095",
    ),
    "node id 0": (
        '[sites.b]\nnodes = [{ id = 0, address = "127.0.0.1:7201" }]\n',
        "site 'b', node #1: id 0 is out of range: use 1 to 4095, for example id = 1",
    ),
    "node id above NODE_ID_MAX": (
        "[sites.b]\nnodes = [" + node_table(1) + ", " + node_table(2, nid=4096) + "]\n",
        "site 'b', node #2: id 4096 is out of range: use 1 to 4095, for example id = 2",
    ),
    "the same node id twice in a site": (
        "[sites.b]\nnodes = [" + node_table(1) + ", " + node_table(2) + ", " + node_table(3, nid=1) + "]\n",
        "site 'b': node id 1 is listed twice (nodes #1 and #3); give each node of the site its own id, "
        "for example id = 3",
    ),
    "a multi-node site whose node has no raft": (
        "[sites.b]\nnodes = [" + node_table(1) + ', { id = 2, address = "127.0.0.1:7202" }]\n',
        "[sites.b], node #2 (id 2): missing 'raft': a site with 2 nodes needs every node's Raft address, "
        'on a port that no gRPC address uses; write { id = 2, address = "127.0.0.1:7202", raft = "HOST:PORT" }',
    ),
    "raft that is not a string": (
        '[sites.b]\nnodes = [{ id = 1, address = "127.0.0.1:7201", raft = 7211 }]\n',
        '[sites.b], node #1: raft 7211 must be a string, raft = "HOST:PORT"',
    ),
    "raft address without a port": (
        '[sites.b]\nnodes = [{ id = 1, address = "127.0.0.1:7201", raft = "127.0.0.1" }]\n',
        "site 'b', node 1 (127.0.0.1:7201): Raft address '127.0.0.1' must be HOST:PORT, for example",
    ),
    "a node's raft address equal to its gRPC address": (
        '[sites.b]\nnodes = [{ id = 1, address = "127.0.0.1:7201", raft = "127.0.0.1:7201" }]\n',
        "site 'b', node 1: its Raft address 127.0.0.1:7201 is its gRPC address; the Raft port is separate: "
        "give raft a port of its own",
    ),
    "a raft address used by two nodes of a site": (
        "[sites.b]\nnodes = [" + node_table(1) + ", " + node_table(2, raft="127.0.0.1:7211") + "]\n",
        "site 'b', node 2: Raft address 127.0.0.1:7211 is already the Raft address of site 'b', node 1; "
        "every gRPC, Raft and Kafka address in the topology must be different: use another port",
    ),
    "a raft address equal to another site's gRPC address": (
        '[sites.a]\nnodes = ["127.0.0.1:7211"]\n[sites.b]\nnodes = [' + node_table(1) + ", " + node_table(2) + "]\n",
        "site 'b', node 1: Raft address 127.0.0.1:7211 is already the gRPC address of site 'a', node 1; "
        "every gRPC, Raft and Kafka address in the topology must be different: use another port",
    ),
    "a gRPC address equal to another site's raft address": (
        "[sites.b]\nnodes = [" + node_table(1) + ']\n[sites.c]\nnodes = ["127.0.0.1:7211"]\n',
        "site 'c', node 1: gRPC address 127.0.0.1:7211 is already the Raft address of site 'b', node 1; "
        "every gRPC, Raft and Kafka address in the topology must be different: use another port",
    ),
    "a Kafka address on some nodes of a multi-node site only": (
        "[sites.b]\nnodes = ["
        + NodeSpec(NodeId(1), "127.0.0.1:7201", "127.0.0.1:7211", "127.0.0.1:9201").as_toml()
        + ", "
        + node_table(2)
        + "]\n",
        "site 'b', node 2 (127.0.0.1:7202) has no Kafka address but other nodes of the site have; give every node "
        'kafka = "HOST:PORT"',
    ),
    "a Kafka address equal to a Raft address": (
        "[sites.b]\nnodes = ["
        + NodeSpec(NodeId(1), "127.0.0.1:7201", "127.0.0.1:7211", "127.0.0.1:7211").as_toml()
        + "]\n",
        "site 'b', node 1: its Kafka address 127.0.0.1:7211 is its Raft address; the Kafka port is separate: "
        "give kafka a port of its own",
    ),
    "a Kafka address that is not HOST:PORT": (
        "[sites.b]\nnodes = [" + NodeSpec(NodeId(1), "127.0.0.1:7201", "127.0.0.1:7211", "nowhere").as_toml() + "]\n",
        "site 'b', node 1 (127.0.0.1:7201): ",
    ),
    "the same gRPC address twice in a table-form site": (
        "[sites.b]\nnodes = [" + node_table(1) + ", " + node_table(2, address="127.0.0.1:7201") + "]\n",
        "node address 127.0.0.1:7201 is listed twice; each node needs its own address",
    ),
    "bad site id (uppercase)": ('[sites.EU]\nnodes = ["127.0.0.1:7101"]\n', "[sites.EU]: invalid site id 'EU'"),
    "bad site id (digit first)": ('[sites.1a]\nnodes = ["127.0.0.1:7101"]\n', "[sites.1a]: invalid site id '1a'"),
    "node address without a port": (
        '[sites.a]\nnodes = ["127.0.0.1"]\n',
        "site 'a': node address '127.0.0.1' must be HOST:PORT",
    ),
    "node address with port 0": (
        '[sites.a]\nnodes = ["127.0.0.1:0"]\n',
        "site 'a': node address '127.0.0.1:0' has the port '0': use 1 to 65535",
    ),
    "node address with a port too large": (
        '[sites.a]\nnodes = ["127.0.0.1:70000"]\n',
        "has the port '70000': use 1 to 65535",
    ),
    "node address with a bad IPv4 host": (
        '[sites.a]\nnodes = ["300.1.2.3:7101"]\n',
        "site 'a': node address '300.1.2.3:7101': 300.1.2.3 is not an IPv4 address",
    ),
    "node address with an unbracketed IPv6 host": (
        '[sites.a]\nnodes = ["::1:7101"]\n',
        "put an IPv6 host in brackets, for example '[::1]:7101'",
    ),
    "node address with a bad host name": ('[sites.a]\nnodes = ["my_host:7101"]\n', "'my_host' is not a host name"),
    "the same node address in two sites": (
        '[sites.a]\nnodes = ["127.0.0.1:7101"]\n[sites.b]\nnodes = ["127.0.0.1:7101"]\n',
        "node address 127.0.0.1:7101 is listed by sites 'a' and 'b'",
    ),
    "no sites": ("", "the topology has no sites"),
    "links not an array of tables": ('links = "a -> b"\n' + SITES_AB, "'links' must be an array of tables"),
    "not TOML": ("sites: a, b\nlinks: a -> b\n", "not valid TOML: "),
    "cost 0": (
        SITES_AB + links_text("ab", extra="cost = 0\n"),
        "link #1 (a -> b): cost 0 must be an integer from 1 to 1000000",
    ),
    "cost not an integer": (
        SITES_AB + links_text("ab", extra="cost = 1.5\n"),
        "link #1 (a -> b): cost 1.5 must be an integer",
    ),
    "cost a boolean": (
        SITES_AB + links_text("ab", extra="cost = true\n"),
        "link #1 (a -> b): cost True must be an integer",
    ),
    "empty topics list": (
        SITES_AB + links_text("ab", extra="topics = []\n"),
        "link #1 (a -> b): topics is empty, so the link would carry nothing",
    ),
    "topics not a list": (
        SITES_AB + links_text("ab", extra='topics = "orders/**"\n'),
        "link #1 (a -> b): topics must be a list of strings",
    ),
    "filter with an empty level": (
        SITES_AB + links_text("ab", extra='topics = ["orders//eu"]\n'),
        "link #1 (a -> b): invalid topic filter 'orders//eu': it has an empty level",
    ),
    "filter with a trailing slash": (
        SITES_AB + links_text("ab", extra='topics = ["orders/"]\n'),
        "invalid topic filter 'orders/': it has an empty level",
    ),
    "filter with '*'": (
        SITES_AB + links_text("ab", extra='topics = ["orders/*"]\n'),
        "invalid topic filter 'orders/*': it uses '*', which is not a wildcard here: use '+' for exactly one "
        "level or '**' for any number",
    ),
    "filter with '*' inside a level": (
        SITES_AB + links_text("ab", extra='topics = ["ord*"]\n'),
        "invalid topic filter 'ord*': it has the level 'ord*': a wildcard must be a whole level",
    ),
    "filter with '+' inside a level": (
        SITES_AB + links_text("ab", extra='topics = ["orders/eu+"]\n'),
        "it has the level 'eu+': a wildcard must be a whole level",
    ),
    "filter with MQTT '#'": (
        SITES_AB + links_text("ab", extra='topics = ["orders/#"]\n'),
        "it uses '#', which is not a wildcard here",
    ),
    "filter with a bad character": (
        SITES_AB + links_text("ab", extra='topics = ["orders/eu west"]\n'),
        "it has the level 'eu west': a literal level may hold only letters, digits, '.', '_' or '-'",
    ),
    "empty filter": (
        SITES_AB + links_text("ab", extra='topics = [""]\n'),
        "link #1 (a -> b): topic filter is empty: use '**' for every topic",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_a_bad_file_is_refused_with_a_clear_message(name: str) -> None:
    text, message = BAD_FILES[name]
    with pytest.raises(InvalidTopology) as caught:
        parse_topology(text)
    assert message in str(caught.value)


def test_a_programmatic_topology_is_validated_too() -> None:
    a, b = Site(S("a"), ("127.0.0.1:7101",)), Site(S("b"), ("127.0.0.1:7201",))
    with pytest.raises(InvalidTopology, match=r"link #1 \(a -> c\): unknown site 'c'; known sites: a, b"):
        Topology((a, b), (Link(S("a"), S("c")),))
    with pytest.raises(InvalidTopology, match="site 'a' is defined twice"):
        Topology((a, a), ())
    with pytest.raises(InvalidTopology, match="cost -1 must be an integer from 1"):
        Topology((a, b), (Link(S("a"), S("b"), cost=-1),))


def test_valid_node_addresses() -> None:
    t = parse_topology(
        '[sites.a]\nnodes = ["localhost:1", "node-1.dc.example.com:65535", "[::1]:7101", "10.0.0.5:7101"]\n'
    )
    assert len(t.site("a").nodes) == 4
    assert warnings(t) == []  # a single site needs no links


TWO_FORMS = """\
[sites.a]
nodes = ["127.0.0.1:7101"]
[sites.b]
nodes = [
  { id = 1, address = "127.0.0.1:7201", raft = "127.0.0.1:7211" },
  { id = 2, address = "127.0.0.1:7202", raft = "127.0.0.1:7212" },
]
"""


def test_a_site_names_its_nodes_with_ids_and_raft_addresses_next_to_a_site_listed_with_strings() -> None:
    t = parse_topology(TWO_FORMS)
    a, b = t.site("a"), t.site("b")
    assert a.nodes == ("127.0.0.1:7101",) and a.members == (NodeSpec(NodeId(1), "127.0.0.1:7101", None),)
    assert b.nodes == ("127.0.0.1:7201", "127.0.0.1:7202")  # what every caller of .nodes already reads
    assert b.members == (
        NodeSpec(NodeId(1), "127.0.0.1:7201", "127.0.0.1:7211"),
        NodeSpec(NodeId(2), "127.0.0.1:7202", "127.0.0.1:7212"),
    )
    assert b.member(NodeId(2)).raft == "127.0.0.1:7212"
    assert b.raft_addresses() == {1: "127.0.0.1:7211", 2: "127.0.0.1:7212"}
    assert a.raft_addresses() == {}  # one node: no Raft peers to name


def test_ids_follow_the_table_not_the_position() -> None:
    t = parse_topology("[sites.b]\nnodes = [" + node_table(1, nid=7) + ", " + node_table(2, nid=3) + "]\n")
    b = t.site("b")
    assert [m.id for m in b.members] == [7, 3]
    assert b.member(NodeId(3)).address == "127.0.0.1:7202"
    assert list(b.raft_addresses().items()) == [(7, "127.0.0.1:7211"), (3, "127.0.0.1:7212")]


def test_every_node_of_a_site_names_its_kafka_address() -> None:
    nodes = [
        NodeSpec(NodeId(n), f"127.0.0.1:{7200 + n}", f"127.0.0.1:{7210 + n}", f"127.0.0.1:{9200 + n}") for n in (1, 2)
    ]
    site = parse_topology("[sites.b]\nnodes = [" + ", ".join(n.as_toml() for n in nodes) + "]\n").site("b")
    assert site.kafka_addresses() == {1: "127.0.0.1:9201", 2: "127.0.0.1:9202"}
    assert parse_topology("[sites.b]\nnodes = [" + node_table(1) + "]\n").site("b").kafka_addresses() == {}


def test_a_one_node_site_in_the_table_form_may_leave_out_raft() -> None:
    t = parse_topology('[sites.a]\nnodes = [{ id = 5, address = "127.0.0.1:7101" }]\n')
    assert t.site("a").members == (NodeSpec(NodeId(5), "127.0.0.1:7101", None),)
    assert t.site("a").raft_addresses() == {}
    t = parse_topology('[sites.a]\nnodes = [{ id = 1, address = "127.0.0.1:7101", raft = "127.0.0.1:7111" }]\n')
    assert t.site("a").raft_addresses() == {1: "127.0.0.1:7111"}


def test_strings_give_ids_by_position_and_no_raft_address() -> None:
    t = parse_topology('[sites.a]\nnodes = ["127.0.0.1:7101", "127.0.0.1:7102", "127.0.0.1:7103"]\n')
    a = t.site("a")
    assert [(m.id, m.address, m.raft) for m in a.members] == [
        (1, "127.0.0.1:7101", None),
        (2, "127.0.0.1:7102", None),
        (3, "127.0.0.1:7103", None),
    ]
    assert a.member(NodeId(3)).address == "127.0.0.1:7103"
    with pytest.raises(InvalidTopology) as caught:
        a.raft_addresses()
    assert str(caught.value) == (
        "site 'a', node 1 (127.0.0.1:7101) has no Raft address, and a site with 3 nodes needs one on every node: "
        'list the nodes as tables with raft = "HOST:PORT", for example [sites.a] nodes = '
        '[{ id = 1, address = "127.0.0.1:7101", raft = "HOST:PORT" }, '
        '{ id = 2, address = "127.0.0.1:7102", raft = "HOST:PORT" }, ...]'
    )


def test_an_unknown_node_id_says_which_ids_the_site_has() -> None:
    b = parse_topology(TWO_FORMS).site("b")
    with pytest.raises(
        InvalidTopology,
        match=r"site 'b' has no node 3; its node ids are 1, 2: use one of them, "
        r"or add the node to \[sites.b\] nodes",
    ):
        b.member(NodeId(3))


def test_a_site_built_in_code_is_checked_like_a_file() -> None:
    built = Site(S("a"), ("127.0.0.1:7101", "127.0.0.1:7102"))
    assert built == Site.with_members(
        S("a"), (NodeSpec(NodeId(1), "127.0.0.1:7101"), NodeSpec(NodeId(2), "127.0.0.1:7102"))
    )
    with pytest.raises(InvalidTopology, match="site 'a', node #1: id 0 is out of range: use 1 to 4095"):
        Topology((Site.with_members(S("a"), (NodeSpec(NodeId(0), "127.0.0.1:7101"),)),), ())
    partial = Site.with_members(
        S("a"), (NodeSpec(NodeId(1), "127.0.0.1:7101", "127.0.0.1:7111"), NodeSpec(NodeId(2), "127.0.0.1:7102"))
    )
    with pytest.raises(
        InvalidTopology,
        match=r"site 'a', node 2 \(127.0.0.1:7102\) has no Raft address but other "
        r"nodes of the site have; a site with more than one node needs "
        r'raft = "HOST:PORT" on every node',
    ):
        Topology((partial,), ())
    with pytest.raises(InvalidTopology, match=r"are not the members' addresses .*Site.with_members"):
        Topology((Site(S("a"), ("127.0.0.1:7101",), (NodeSpec(NodeId(1), "127.0.0.1:7999"),)),), ())


HOSTS = ("127.0.0.1", "10.0.0.5", "[::1]", "node-1.dc.example.com")


@st.composite
def table_sites(draw: st.DrawFn) -> tuple[NodeSpec, ...]:
    """A valid table-form site: unique ids, and a port of its own for every gRPC and Raft address."""
    count = draw(st.integers(1, 5))
    ids = draw(st.lists(st.integers(1, NODE_ID_MAX), min_size=count, max_size=count, unique=True))
    ports = draw(st.lists(st.integers(1, 65535), min_size=2 * count, max_size=2 * count, unique=True))
    with_raft = count > 1 or draw(st.booleans())
    return tuple(
        NodeSpec(
            NodeId(ids[i]),
            f"{draw(st.sampled_from(HOSTS))}:{ports[i]}",
            f"{draw(st.sampled_from(HOSTS))}:{ports[count + i]}" if with_raft else None,
        )
        for i in range(count)
    )


@PROPERTY
@given(table_sites(), st.integers(1, 5))
def test_any_valid_table_form_site_round_trips(members: tuple[NodeSpec, ...], string_nodes: int) -> None:
    text = "[sites.b]\nnodes = [\n" + "".join(f"  {m.as_toml()},\n" for m in members) + "]\n"
    strings = [f"127.0.0.2:{port}" for port in range(1, string_nodes + 1)]  # 127.0.0.2: no clash with b's hosts
    text += "[sites.a]\nnodes = [" + ", ".join(f'"{a}"' for a in strings) + "]\n"
    t = parse_topology(text)
    b = t.site("b")
    assert b.members == members
    assert b.nodes == tuple(m.address for m in members)
    assert all(b.member(m.id) == m for m in members)
    if members[0].raft is not None:
        assert b.raft_addresses() == {m.id: m.raft for m in members}
    a = t.site("a")
    assert a.members == tuple(NodeSpec(NodeId(n), address) for n, address in enumerate(strings, start=1))


def test_cycles_are_legal() -> None:
    t = parse_topology(SITES_AB + '[sites.c]\nnodes = ["127.0.0.1:7301"]\n' + links_text("ab", "bc", "ca"))
    assert warnings(t) == []


def test_warnings_for_a_site_no_link_reaches_and_one_that_reaches_nobody() -> None:
    t = make([("a", "b"), ("b", "a"), ("a", "c"), ("d", "a")])
    assert warnings(t) == [
        "site 'd' is not reached by any link: records written at other sites never get there "
        "(add a [[links]] table with dst = 'd')",
        "site 'c' has no outgoing link: records written at 'c' never leave it (add a [[links]] table with src = 'c')",
    ]


def test_warning_for_a_site_that_some_origins_cannot_reach() -> None:
    # c reaches a and b, but nothing leads from a or b to c... except via d, which only c feeds.
    t = make([("a", "b"), ("b", "a"), ("c", "a"), ("c", "d"), ("d", "c")])
    assert warnings(t) == [
        "site 'c' cannot receive records written at 'a', 'b': no chain of links leads there",
        "site 'd' cannot receive records written at 'a', 'b': no chain of links leads there",
    ]


def test_unknown_site_and_link_lookups_say_what_exists() -> None:
    t = default_topology()
    with pytest.raises(UnknownSite, match="unknown site 'z'; known sites: a, b, c"):
        t.site("z")
    with pytest.raises(UnknownLink, match="there is no link a -> z"):
        t.link("a", "z")


def test_package_exports_resolve() -> None:
    assert sorted(topology.__all__) == sorted(topology._WHERE)
    for name in topology.__all__:
        assert getattr(topology, name) is not None
    with pytest.raises(AttributeError):
        topology.no_such_name  # noqa: B018


# ---------------------------------------------------------------- topic filters

FILTER_TABLE = [
    # filter, topic, matches
    ("**", "orders", True),
    ("**", "orders/eu/paris", True),
    ("orders", "orders", True),
    ("orders", "Orders", False),
    ("orders", "orders/eu", False),
    ("orders/eu", "orders", False),
    ("+", "orders", True),
    ("+", "orders/eu", False),
    ("orders/+", "orders/eu", True),
    ("orders/+", "orders", False),  # '+' is exactly one level, never zero
    ("orders/+", "orders/eu/paris", False),
    ("orders/+/paris", "orders/eu/paris", True),
    ("orders/+/paris", "orders/eu/lyon", False),
    ("+/+", "a/b", True),
    ("+/+", "a", False),
    ("orders/**", "orders", True),  # '**' matches zero levels, like MQTT's 'orders/#'
    ("orders/**", "orders/eu", True),
    ("orders/**", "orders/eu/paris", True),
    ("orders/**", "orders2", False),
    ("orders/**", "billing/orders", False),
    ("a/**/z", "a/z", True),
    ("a/**/z", "a/b/z", True),
    ("a/**/z", "a/b/c/d/z", True),
    ("a/**/z", "a/b/c", False),
    ("a/**/z", "a/z/b", False),
    ("a/**/z", "z/a/z", False),
    ("**/audit", "audit", True),
    ("**/audit", "x/y/audit", True),
    ("**/audit", "x/audit/y", False),
    ("**/+", "a", True),
    ("**/+", "a/b/c", True),
    ("a/**/**/b", "a/b", True),
    ("a/**/+/**/c", "a/c", False),
    ("a/**/+/**/c", "a/x/c", True),
    ("a/**/+/**/c", "a/x/y/z/c", True),
    ("orders.v2/eu-west_1", "orders.v2/eu-west_1", True),
]


@pytest.mark.parametrize(("pattern", "topic", "expected"), FILTER_TABLE)
def test_filter_semantics(pattern: str, topic: str, expected: bool) -> None:
    assert TopicFilter(pattern).matches(topic) is expected


def test_a_link_matches_if_any_of_its_filters_does() -> None:
    filters = (TopicFilter("orders/**"), TopicFilter("+/audit"))
    assert matches_any(filters, "orders/eu")
    assert matches_any(filters, "billing/audit")
    assert not matches_any(filters, "billing/eu")
    assert not matches_any((), "orders")


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "/",
        "/orders",
        "orders/",
        "a//b",
        "*",
        "a/*",
        "a*",
        "***",
        "a/**b",
        "#",
        "a/#",
        "a+",
        "+a",
        "a/./b",
        "a/../b",
        "a b",
        "ü",
    ],
)
def test_invalid_filters_are_rejected(bad: str) -> None:
    with pytest.raises(InvalidTopicFilter, match="topic filter"):
        TopicFilter(bad)


def test_filter_length_limit() -> None:
    TopicFilter("a" * 249)
    with pytest.raises(InvalidTopicFilter, match="the limit is 249"):
        TopicFilter("a" * 250)


# "ab" starts with "a": a literal prefix that is not a level ("a/**" matches "a", not "ab/c": TopicFilter.prefix).
levels = st.sampled_from(["a", "b", "c", "ab"])
filter_levels = st.sampled_from(["a", "b", "ab", "+", "**"])


def reference_match(pattern: list[str], topic: list[str]) -> bool:
    """The obvious recursive definition, exponential but fine for short inputs."""
    if not pattern:
        return not topic
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(reference_match(rest, topic[i:]) for i in range(len(topic) + 1))
    return bool(topic) and head in ("+", topic[0]) and reference_match(rest, topic[1:])


@PROPERTY
@given(st.lists(filter_levels, min_size=1, max_size=6), st.lists(levels, min_size=1, max_size=6))
def test_matching_agrees_with_the_recursive_definition(pattern: list[str], topic: list[str]) -> None:
    assert TopicFilter("/".join(pattern)).matches("/".join(topic)) == reference_match(pattern, topic)


# ---------------------------------------------------------------- routing

T = "orders/eu"


def test_ring_routes_around_the_ring() -> None:
    r = Router(make([("a", "b"), ("b", "c"), ("c", "d"), ("d", "a")]))
    assert r.preferred_upstream("c", "a", T) == "b"
    assert r.preferred_upstream("b", "a", T) == "a"
    assert r.preferred_upstream("a", "b", T) == "d"
    assert r.upstream_candidates("a", "b", T) == ["d"]
    assert [(c.upstream, c.cost) for c in r.candidates("a", "b", T)] == [("d", 3)]


def test_full_mesh_prefers_the_direct_link() -> None:
    ids = "abcde"
    r = Router(make([(x, y) for x in ids for y in ids if x != y]))
    for dst in ids:
        for origin in ids:
            if dst != origin:
                assert r.preferred_upstream(dst, origin, T) == origin
                # Failover: every other site, each two hops away, by id.
                assert r.upstream_candidates(dst, origin, T) == [origin] + [s for s in ids if s not in (dst, origin)]


def test_line() -> None:
    r = Router(make([("a", "b"), ("b", "c"), ("c", "d")]))
    assert r.preferred_upstream("d", "a", T) == "c"
    assert r.preferred_upstream("c", "a", T) == "b"
    assert r.preferred_upstream("a", "d", T) is None  # links only go one way
    assert r.upstream_candidates("a", "d", T) == []


def test_star_goes_through_the_hub() -> None:
    spokes = "bcde"
    r = Router(make([(x, y) for s in spokes for x, y in (("h", s), (s, "h"))]))
    assert r.preferred_upstream("c", "b", T) == "h"
    assert r.preferred_upstream("h", "b", T) == "b"
    assert r.preferred_upstream("b", "h", T) == "h"


def test_default_triangle_pulls_directly_and_fails_over_via_the_third_site() -> None:
    r = Router(default_topology())
    assert r.preferred_upstream("b", "a", T) == "a"
    assert r.upstream_candidates("b", "a", T) == ["a", "c"]
    assert r.preferred_upstream("a", "a", T) is None  # the origin pulls its own records from nobody
    assert r.upstream_candidates("a", "a", T) == []


def test_costs_change_the_preferred_upstream() -> None:
    cheap = Router(make([("a", "b", 5), ("a", "c", 1), ("c", "b", 1), ("b", "a"), ("b", "c"), ("c", "a")]))
    assert cheap.preferred_upstream("b", "a", T) == "c"  # 1 + 1 < 5
    assert cheap.upstream_candidates("b", "a", T) == ["c", "a"]
    even = Router(make([("a", "b", 2), ("a", "c", 1), ("c", "b", 1)]))
    assert even.preferred_upstream("b", "a", T) == "a"  # tie at 2: lowest id


def test_ties_go_to_the_lowest_site_id() -> None:
    r = Router(make([("a", "c"), ("a", "b"), ("c", "d"), ("b", "d")]))
    assert r.preferred_upstream("d", "a", T) == "b"
    assert r.upstream_candidates("d", "a", T) == ["b", "c"]


def test_link_down_reroutes_and_link_back_restores() -> None:
    r = Router(default_topology())
    r.set_link_up("a", "b", False)
    assert not r.is_link_up("a", "b")
    assert r.preferred_upstream("b", "a", T) == "c"
    assert r.upstream_candidates("b", "a", T) == ["c"]
    assert ("a", "b") not in r.live_links()
    r.set_link_up("a", "c", False)
    assert r.preferred_upstream("b", "a", T) is None
    assert r.preferred_upstream("c", "a", T) is None
    r.set_link_up("a", "b", True)
    assert r.preferred_upstream("b", "a", T) == "a"
    assert r.preferred_upstream("c", "a", T) == "b"
    r.set_link_up("a", "c", True)
    r.set_link_up("a", "c", True)  # idempotent
    assert r.preferred_upstream("c", "a", T) == "a"
    assert r.live_links() == frozenset(link.key for link in default_topology().links)


def test_an_upstream_that_could_only_get_the_records_from_dst_is_not_a_candidate() -> None:
    # c is b's in-neighbour, but c only gets a's records from b.
    r = Router(make([("a", "b"), ("b", "c"), ("c", "b")]))
    assert r.upstream_candidates("b", "a", T) == ["a"]
    r.set_link_up("a", "b", False)
    assert r.preferred_upstream("b", "a", T) is None


def test_topic_filters_give_different_upstreams_per_topic() -> None:
    t = make(
        [("a", "b"), ("a", "c"), ("c", "b"), ("b", "a"), ("c", "a"), ("b", "c")],
        topics={("a", "b"): ("orders/**",), ("c", "b"): ("orders/**", "metrics/+")},
    )
    r = Router(t)
    assert r.preferred_upstream("b", "a", "orders/eu") == "a"
    assert r.preferred_upstream("b", "a", "orders") == "a"
    assert r.preferred_upstream("b", "a", "metrics/cpu") == "c"  # a -> b does not carry it
    assert r.preferred_upstream("b", "a", "logs/x") is None  # no link into b carries it
    assert r.preferred_upstream("c", "a", "logs/x") == "a"
    r.set_link_up("a", "c", False)
    assert r.preferred_upstream("b", "a", "metrics/cpu") is None
    assert r.preferred_upstream("c", "a", "orders/eu") == "b"
    assert r.preferred_upstream("c", "a", "metrics/cpu") is None


def test_router_errors_name_the_problem() -> None:
    r = Router(default_topology())
    with pytest.raises(UnknownLink, match="there is no link a -> z"):
        r.set_link_up("a", "z", False)
    with pytest.raises(UnknownSite, match="unknown site 'z'"):
        r.preferred_upstream("z", "a", T)
    with pytest.raises(UnknownSite, match="unknown site 'z'"):
        r.preferred_upstream("a", "z", T)


# ---------------------------------------------------------------- expected reach


def test_expected_sites_follow_filters_and_live_links() -> None:
    t = make([("a", "b"), ("b", "c"), ("a", "d")], topics={("b", "c"): ("orders/**",), ("a", "d"): ("+/audit",)})
    assert expected_sites(t, "a", "orders/eu") == {"a", "b", "c"}
    assert expected_sites(t, "a", "billing/audit") == {"a", "b", "d"}
    assert expected_sites(t, "a", "billing") == {"a", "b"}
    assert expected_sites(t, "c", "orders/eu") == {"c"}
    live = [("a", "b"), ("a", "d")]
    assert expected_sites(t, "a", "orders/eu", live_links=live) == {"a", "b"}
    assert expected_sites(t, "a", "orders/eu", live_links=[]) == {"a"}
    with pytest.raises(UnknownSite):
        expected_sites(t, "z", "orders")


# ---------------------------------------------------------------- property: no routing loops, cheapest paths

TOPICS = ["orders/eu", "orders", "metrics/cpu", "logs"]
FILTER_SETS = [("**",), ("**",), ("orders/**",), ("+/cpu", "logs"), ("orders/+",), ("logs",)]


@st.composite
def graphs(draw: st.DrawFn, filtered: bool) -> tuple[Topology, frozenset[tuple[str, str]]]:
    n = draw(st.integers(2, 7))
    ids = [chr(ord("a") + i) for i in range(n)]
    pairs = [(x, y) for x in ids for y in ids if x != y]
    ring = {(ids[i], ids[(i + 1) % n]) for i in range(n)}  # strongly connected before anything goes down
    extra = draw(st.sets(st.sampled_from(pairs), max_size=len(pairs)))
    links = []
    for src, dst in sorted(ring | extra):
        cost = draw(st.integers(1, 5))
        topics = draw(st.sampled_from(FILTER_SETS)) if filtered else ("**",)
        links.append(Link(S(src), S(dst), tuple(TopicFilter(f) for f in topics), cost))
    down = draw(st.sets(st.sampled_from(sorted(ring | extra)))) if filtered else set()
    t = Topology(tuple(Site(S(s), (f"127.0.0.1:{7101 + 100 * i}",)) for i, s in enumerate(ids)), tuple(links))
    return t, frozenset(link.key for link in links if link.key not in down)


def check_routes(t: Topology, live: frozenset[tuple[str, str]], topic: str) -> None:
    router = Router(t)
    for link in t.links:
        if link.key not in live:
            router.set_link_up(link.src, link.dst, False)
    reference = nx.DiGraph()
    reference.add_nodes_from(t.site_ids())
    for link in t.links:
        if link.key in live and link.carries(topic):
            reference.add_edge(link.src, link.dst, weight=link.cost)
    n = len(t.sites)
    for origin in t.site_ids():
        reach = expected_sites(t, origin, topic, live_links=live)
        assert reach == frozenset(nx.descendants(reference, origin)) | {origin}
        for dst in t.site_ids():
            if dst == origin:
                continue
            first = router.preferred_upstream(dst, origin, topic)
            assert (first is None) == (dst not in reach)
            if first is None:
                assert router.upstream_candidates(dst, origin, topic) == []
                continue
            cur, cost, steps = S(dst), 0, 0
            while cur != origin:
                up = router.preferred_upstream(cur, origin, topic)
                assert up is not None, f"{cur} lost the route to {origin}"
                link = t.link(up, cur)
                assert link.key in live and link.carries(topic)
                cost += link.cost
                cur, steps = up, steps + 1
                assert steps < n, "routing loop"
            assert cost == nx.shortest_path_length(reference, origin, dst, weight="weight")
            found = router.candidates(dst, origin, topic)
            assert found[0].cost == cost
            assert [c.upstream for c in found] == sorted(
                (c.upstream for c in found), key=lambda u: (next(c.cost for c in found if c.upstream == u), u)
            )


@PROPERTY
@given(graphs(filtered=False), st.sampled_from(TOPICS))
def test_preferred_upstreams_follow_cheapest_paths_without_loops(
    case: tuple[Topology, frozenset[tuple[str, str]]], topic: str
) -> None:
    t, live = case
    check_routes(t, live, topic)


@PROPERTY
@given(graphs(filtered=True), st.sampled_from(TOPICS))
def test_with_links_down_and_filters_a_route_exists_exactly_when_reach_says_so(
    case: tuple[Topology, frozenset[tuple[str, str]]], topic: str
) -> None:
    t, live = case
    check_routes(t, live, topic)


# ---------------------------------------------------------------- summary and drawing

STATES = {
    ("a", "b"): LinkStatus("down"),
    ("b", "c"): LinkStatus("streaming", lag_records=120, lag_ms=350),
    ("c", "a"): LinkStatus("stalled", lag_records=9000),
    ("b", "a"): LinkStatus("streaming", lag_records=0, lag_ms=2),
}


def words(text: str) -> list[list[str]]:
    return [line.split() for line in text.splitlines()]


def test_summary_lists_sites_links_routes_and_warnings() -> None:
    text = summary_text(default_topology(), STATES)
    rows = words(text)
    assert text.startswith("topology: 3 sites, 6 links\n")
    assert ["a", "127.0.0.1:7101"] in rows
    assert ["a", "->", "b", "1", "down", "-", "**"] in rows
    assert ["b", "->", "c", "1", "streaming", "120", "rec", "/", "350", "ms", "**"] in rows
    assert ["c", "->", "a", "1", "stalled", "9000", "rec", "**"] in rows
    assert ["c", "->", "b", "1", "unknown", "-", "**"] in rows
    assert "routes (every topic): the upstream each site pulls each origin's records from" in text
    # a -> b is down, so b pulls a's records via c; everything else is direct.
    assert rows[-4:] == [
        ["site", "\\", "origin", "a", "b", "c"],
        ["a", "-", "b", "c"],
        ["b", "c", "-", "c"],
        ["c", "a", "b", "-"],
    ]
    assert "warnings" not in text
    assert summary_text(default_topology(), STATES) == text  # deterministic


def test_summary_with_filters_needs_a_topic_for_routes() -> None:
    t = make([("a", "b"), ("b", "a"), ("c", "a")], topics={("a", "b"): ("orders/**",)})
    text = summary_text(t)
    assert "routes differ per topic" in text
    assert ["a", "->", "b", "1", "unknown", "-", "orders/**"] in words(text)
    assert "warnings:\n  - site 'c' is not reached by any link" in text
    logs = words(summary_text(t, topic="logs"))
    assert ["b", "unreachable", "-", "unreachable"] in logs
    orders = words(summary_text(t, topic="orders"))
    assert ["b", "a", "-", "a"] in orders
    assert ["c", "unreachable", "unreachable", "-"] in orders


def test_each_state_a_node_reports_has_a_colour_of_its_own_and_streaming_is_green() -> None:
    """A healthy link was drawn orange, labelled "other (e.g. stalled)": the picture knew a state "up" that no node
    reports, and not "streaming"."""
    from georep.server.metrics import LINK_STATES

    assert set(STATE_COLOURS) == {*LINK_STATES, "unknown"}
    assert STATE_COLOURS["streaming"] == "#2e7d32" and STATE_COLOURS["down"] == "#c62828"
    assert len(set(STATE_COLOURS.values())) == len(STATE_COLOURS)


def test_draw_writes_png_and_svg(tmp_path: Path) -> None:
    t = make(
        [("a", "b"), ("b", "c"), ("c", "a"), ("b", "a"), ("c", "b", 3), ("a", "c")], topics={("a", "c"): ("orders/**",)}
    )
    png, svg = tmp_path / "t.png", tmp_path / "t.svg"
    draw(t, png, STATES)
    draw(t, svg, STATES)
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and png.stat().st_size > 5000
    text = svg.read_text()
    assert "<svg" in text
    with pytest.raises(ValueError, match=r"use a file name ending in \.png or \.svg"):
        draw(t, tmp_path / "t.jpg")
    one = tmp_path / "one.png"
    draw(Topology((Site(S("a"), ("127.0.0.1:7101",)),), ()), one)
    assert one.read_bytes().startswith(b"\x89PNG")


def test_main_prints_the_summary_and_writes_the_picture(tmp_path: Path) -> None:
    path = tmp_path / "topo.toml"
    path.write_text(ISSUE_EXAMPLE)
    out, err = io.StringIO(), io.StringIO()
    picture = tmp_path / "topo.svg"
    assert main([str(path), "-o", str(picture)], out=out, err=err) == 0
    assert "topology: 2 sites, 1 link" in out.getvalue()
    assert "site 'a' is not reached by any link" in out.getvalue()
    assert f"wrote {picture}" in out.getvalue()
    assert "<svg" in picture.read_text()

    default_picture = tmp_path / "default.png"
    assert main(["-o", str(default_picture)], out=io.StringIO(), err=err) == 0
    assert default_picture.read_bytes().startswith(b"\x89PNG")

    path.write_text(SITES_AB + links_text("ab", "bz"))
    assert main([str(path), "-o", str(picture)], out=out, err=err) == 2
    assert f"error: {path}: link #2 (b -> z): unknown site 'z'; known sites: a, b" in err.getvalue()
    assert main([str(tmp_path / "missing.toml"), "-o", str(picture)], out=out, err=err) == 2
    assert "cannot read" in err.getvalue()
    assert main(["-o", str(tmp_path / "x.gif")], out=out, err=err) == 2
    assert main(["--topic", "bad topic", "-o", str(picture)], out=out, err=err) == 2
    assert "--topic: invalid topic name" in err.getvalue()


def test_site_ids_found_valid_are_remembered_within_a_bound_and_invalid_ones_are_still_refused() -> None:
    for i in range(ids._VALID_MAX + 10):  # a peer naming ever new sites cannot grow the memo without bound
        assert site_id(f"s{i}") == f"s{i}"
    assert len(ids._VALID) <= ids._VALID_MAX
    assert site_id("s1") == "s1"
    for bad in ("", "Us-east", "1a", "a" * 33, "a_b"):
        with pytest.raises(InvalidSiteId):
            site_id(bad)


def test_a_link_that_carries_everything_answers_without_matching_a_filter(monkeypatch: pytest.MonkeyPatch) -> None:
    """A site of 100,000 topics asks each link whether it carries each topic at every change of its interests;
    the remembered answers hold a few thousand, so a default link answered by matching "**" again each time."""
    import topology.model as model

    links = model.parse_topology(
        '[sites.a]\nnodes = ["127.0.0.1:1"]\n[sites.b]\nnodes = ["127.0.0.1:2"]\n'
        '[[links]]\nsrc = "a"\ndst = "b"\n[[links]]\nsrc = "b"\ndst = "a"\ntopics = ["orders/**"]\n'
    ).links

    def no_matching(filters: object, topic: str) -> bool:
        raise AssertionError(f"matched {topic!r} against {filters!r}")

    everything = next(li for li in links if li.src == "a")
    monkeypatch.setattr(model, "_matches_any", no_matching)
    assert everything.carries("metrics/cpu") and everything.carries("orders/eu/1")
    monkeypatch.undo()
    filtered = next(li for li in links if li.src == "b")
    assert filtered.carries("orders/eu/1") and not filtered.carries("metrics/cpu")
