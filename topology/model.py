"""The topology: sites, their nodes, and the directed links between them. Pure.

A topology file is TOML::

    [sites.a]
    nodes = ["127.0.0.1:7101"]          # HOST:PORT of each storage node of the site

    [sites.b]                           # a multi-node site: one table per node
    nodes = [
      { id = 1, address = "127.0.0.1:7201", raft = "127.0.0.1:7211", kafka = "127.0.0.1:9201" },
      { id = 2, address = "127.0.0.1:7202", raft = "127.0.0.1:7212", kafka = "127.0.0.1:9202" },
    ]

    [[links]]                           # a directed link src -> dst, pulled by dst
    src = "a"
    dst = "b"
    topics = ["orders/**", "+/audit"]   # optional; default ["**"], every topic
    cost = 1                            # optional; default 1
    rate_limit_bytes_per_s = 12500000   # optional; default none: at most this many bytes a second over the link

A site's table may also list ``auto_create`` patterns: topics created on first
use (``topology/autocreate.py``).

A site lists its nodes either as ``"HOST:PORT"`` strings (the gRPC address of
each node; node ids are 1, 2, 3, ... by position, and no node has a Raft
address) or as tables: ``id`` (1 to ``NODE_ID_MAX``, unique within the site),
``address`` (gRPC ``HOST:PORT``) and ``raft`` (the ``HOST:PORT`` of the node's
Raft metadata replica; optional for a one-node site, required on every node of a
site with more than one) and ``kafka`` (optional: the ``HOST:PORT`` the node serves
Kafka clients at, and what the site's Kafka Metadata names it by, as Kafka's
``advertised.listeners``; on a site of several nodes, every node or none). One
site's list cannot mix the two forms. Every gRPC, Raft and Kafka address of the
topology is different from every other.

``cost`` is a positive integer. Routing prefers the path with the smallest sum
of link costs (with every cost 1, the fewest hops), so an operator can make an
expensive WAN link a last resort by giving it a higher cost. Topic filter
syntax is in ``topology/filters.py``. ``rate_limit_bytes_per_s`` (from
``RATE_LIMIT_MIN`` up) caps what the link moves, as Kafka's replication quotas
do: the upstream paces what it sends to ``dst`` (``georep/replication/pacing.py``).

Every error names where it is ("link #3 (a -> b): ...", where #3 is the third
``[[links]]`` table) and what to do. Unknown keys are rejected, so a typo such
as ``topic =`` does not silently replicate everything. Cycles are legal.
:func:`warnings` reports what is legal but probably a mistake, such as a site
that no link reaches.

Parsing takes the file's text; reading the file is the caller's job.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from topology.autocreate import AutoCreateRule, InvalidAutoCreate, parse_rules
from topology.filters import ALL_TOPICS, InvalidTopicFilter, TopicFilter, is_internal, matches_any
from topology.ids import NODE_ID_MAX, InvalidNodeId, InvalidSiteId, NodeId, SiteId, node_id, site_id

COST_MAX = 1_000_000
RATE_LIMIT_MIN = 65_536  # bytes a second: below it a link could not carry one batch of the default maximum in 16 s
LINK_MODES = ("all", "interest")


@functools.lru_cache(maxsize=4096)
def _matches_any(filters: tuple[TopicFilter, ...], topic: str) -> bool:
    """``matches_any``, remembered: routing asks it for every link on every route it computes."""
    return matches_any(filters, topic)


_HOSTNAME_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_PORT = re.compile(r"[0-9]{1,5}")

_TOP_KEYS = ("links", "sites")
_SITE_KEYS = ("nodes", "auto_create", "interest_linger_ms")
_NODE_KEYS = ("address", "id", "kafka", "raft")
_LINK_KEYS = ("cost", "dst", "mode", "rate_limit_bytes_per_s", "src", "topics")


class InvalidTopology(ValueError):
    """A topology that cannot be used; the message says where and what to do."""


class UnknownSite(ValueError):
    """A site id that the topology does not define."""


class UnknownLink(ValueError):
    """A (src, dst) pair that is not a link of the topology."""


def validate_node_address(address: str, what: str = "node address") -> str:
    """Check ``HOST:PORT``: a host name, an IPv4 address or a bracketed IPv6 address, and a port 1-65535.

    ``what`` names the address in the messages ("node address", "Raft address").
    """
    example = "for example '127.0.0.1:7101', 'node1.example.com:7101' or '[::1]:7101'"
    if not isinstance(address, str):
        raise InvalidTopology(f"{what} {address!r} must be a string 'HOST:PORT', {example}")
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise InvalidTopology(f"{what} {address!r} must be HOST:PORT, {example}")
    if not _PORT.fullmatch(port) or not 1 <= int(port) <= 65535:
        raise InvalidTopology(f"{what} {address!r} has the port {port!r}: use 1 to 65535")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise InvalidTopology(f"{what} {address!r}: {host} is not an IPv6 address") from None
        return address
    if ":" in host:
        raise InvalidTopology(f"{what} {address!r}: put an IPv6 host in brackets, for example '[::1]:7101'")
    if re.fullmatch(r"[0-9.]+", host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise InvalidTopology(f"{what} {address!r}: {host} is not an IPv4 address") from None
        return address
    labels = host.split(".")
    if len(host) > 253 or not all(_HOSTNAME_LABEL.fullmatch(label) for label in labels):
        raise InvalidTopology(
            f"{what} {address!r}: {host!r} is not a host name (letters, digits and '-' in dot-separated labels)"
        )
    return address


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """One node of a site: its id in the site's segment cluster, its gRPC address, its Raft address and the
    address it serves Kafka clients at (docs/kafka.md)."""

    id: NodeId
    address: str
    raft: str | None = None
    kafka: str | None = None

    def as_toml(self) -> str:
        """The node as a TOML inline table, as a topology file writes it."""
        raft = f', raft = "{self.raft}"' if self.raft is not None else ""
        kafka = f', kafka = "{self.kafka}"' if self.kafka is not None else ""
        return f'{{ id = {self.id}, address = "{self.address}"{raft}{kafka} }}'


def _table_form_example(site: str, addresses: list[str]) -> str:
    """A site's nodes in the table form, for the messages that ask for it: the first two, ids by position."""
    shown = [NodeSpec(NodeId(n), a, "HOST:PORT").as_toml() for n, a in enumerate(addresses[:2], start=1)]
    return f"[sites.{site}] nodes = [{', '.join(shown)}{', ...' if len(addresses) > 2 else ''}]"


@dataclass(frozen=True, slots=True)
class Site:
    """A site and its nodes, in the order the topology lists them.

    ``nodes`` are the nodes' gRPC addresses; ``members`` are the same nodes with
    their ids and Raft addresses. Built from ``nodes`` alone (the string form),
    the members get ids 1, 2, 3, ... by position and no Raft address; use
    :meth:`with_members` to give them. Validated by :class:`Topology`.
    """

    id: SiteId
    nodes: tuple[str, ...]
    members: tuple[NodeSpec, ...] = ()
    auto_create: tuple[AutoCreateRule, ...] = ()  # topology/autocreate.py: topics created on first use
    # how long the site goes on pulling a topic over its interest links once nobody wants it (topology/interest.py)
    interest_linger_ms: int = 30_000

    def __post_init__(self) -> None:
        if not self.members:
            by_position = tuple(NodeSpec(NodeId(n), a) for n, a in enumerate(self.nodes, start=1))
            object.__setattr__(self, "members", by_position)

    @classmethod
    def with_members(cls, sid: SiteId, members: tuple[NodeSpec, ...]) -> Site:
        return cls(sid, tuple(m.address for m in members), members)

    def member(self, nid: int) -> NodeSpec:
        for m in self.members:
            if m.id == nid:
                return m
        known = ", ".join(str(m.id) for m in self.members)
        raise InvalidTopology(
            f"site {self.id!r} has no node {nid}; its node ids are {known}: use one of them, "
            f"or add the node to [sites.{self.id}] nodes"
        )

    def kafka_addresses(self) -> dict[NodeId, str]:
        """Each node's Kafka address by node id (docs/kafka.md); empty if the site names none."""
        return {m.id: m.kafka for m in self.members if m.kafka is not None}

    def raft_addresses(self) -> dict[NodeId, str]:
        """Each node's Raft address by node id, in the listed order.

        Empty for a one-node site that names no Raft address (it needs no Raft
        peers). Raises :class:`InvalidTopology` if a node of a multi-node site
        has none, which is the case for every site listed with strings.
        """
        if len(self.members) == 1 and self.members[0].raft is None:
            return {}
        found: dict[NodeId, str] = {}
        for m in self.members:
            if m.raft is None:
                raise InvalidTopology(
                    f"site {self.id!r}, node {m.id} ({m.address}) has no Raft address, and a site with "
                    f"{len(self.members)} nodes needs one on every node: list the nodes as tables with "
                    f'raft = "HOST:PORT", for example {_table_form_example(self.id, list(self.nodes))}'
                )
            found[m.id] = m.raft
        return found


@dataclass(frozen=True, slots=True)
class Link:
    """A directed replication link: ``dst`` pulls from ``src`` the topics that ``topics`` match."""

    src: SiteId
    dst: SiteId
    topics: tuple[TopicFilter, ...] = ALL_TOPICS
    cost: int = 1
    # "all": every topic the filters match; "interest": only those some site at or behind dst wants now
    # (topology/interest.py)
    mode: str = "all"
    # at most this many bytes a second from src to dst (None: no limit); the upstream paces its streams to it
    rate_limit_bytes_per_s: int | None = None
    # Whether a filter matches every topic: asked per topic (carries), so worked out once.
    carries_everything: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "carries_everything", any(f.matches_everything for f in self.topics))

    @property
    def key(self) -> tuple[SiteId, SiteId]:
        return (self.src, self.dst)

    def carries(self, topic: str) -> bool:
        """Whether records of ``topic`` travel over this link. Internal topics
        (committed consumer positions) travel over every link, whatever its filters. A link that carries
        everything (the default) answers without matching: the remembered answers hold a few thousand topics, and a
        site of 100,000 asks for each at every change of its interests."""
        return is_internal(topic) or self.carries_everything or _matches_any(self.topics, topic)

    def describe(self) -> str:
        return f"{self.src} -> {self.dst}"


@dataclass(frozen=True, slots=True)
class Topology:
    """Validated on construction, so every ``Topology`` is usable, however it was built.

    ``links`` keeps the order given (the file's order), which is what "link #N" counts.
    """

    sites: tuple[Site, ...]
    links: tuple[Link, ...]

    def __post_init__(self) -> None:
        _validate(self.sites, self.links)

    def site_ids(self) -> tuple[SiteId, ...]:
        return tuple(sorted(s.id for s in self.sites))

    def site(self, sid: str) -> Site:
        for s in self.sites:
            if s.id == sid:
                return s
        raise UnknownSite(f"unknown site {sid!r}; known sites: {', '.join(self.site_ids())}")

    def link(self, src: str, dst: str) -> Link:
        for link in self.links:
            if link.src == src and link.dst == dst:
                return link
        raise UnknownLink(f"there is no link {src} -> {dst} in the topology")

    def links_sorted(self) -> tuple[Link, ...]:
        return tuple(sorted(self.links, key=lambda link: link.key))


def _validate(sites: tuple[Site, ...], links: tuple[Link, ...]) -> None:
    if not sites:
        raise InvalidTopology("the topology has no sites: add at least one [sites.<id>] table with nodes = [...]")
    owner: dict[str, _AddressUse] = {}
    ids: set[str] = set()
    for s in sites:
        where = f"site {s.id!r}"
        try:
            site_id(s.id)
        except InvalidSiteId as e:
            raise InvalidTopology(f"[sites.{s.id}]: {e}") from None
        if s.id in ids:
            raise InvalidTopology(f"{where} is defined twice")
        ids.add(s.id)
        if not s.nodes:
            raise InvalidTopology(f'{where} has no nodes: list at least one, for example nodes = ["127.0.0.1:7101"]')
        _validate_members(s)
        for m in s.members:
            try:
                validate_node_address(m.address)
            except InvalidTopology as e:
                raise InvalidTopology(f"{where}: {e}") from None
            if m.raft is not None:
                try:
                    validate_node_address(m.raft, "Raft address")
                except InvalidTopology as e:
                    raise InvalidTopology(f"{where}, node {m.id} ({m.address}): {e}") from None
            if m.kafka is not None:
                try:
                    validate_node_address(m.kafka, "Kafka address")
                except InvalidTopology as e:
                    raise InvalidTopology(f"{where}, node {m.id} ({m.address}): {e}") from None
            uses = [_AddressUse(s.id, m.id, "gRPC", m.address)]
            if m.raft is not None:
                uses.append(_AddressUse(s.id, m.id, "Raft", m.raft))
            if m.kafka is not None:
                uses.append(_AddressUse(s.id, m.id, "Kafka", m.kafka))
            for use in uses:
                if use.address in owner:
                    raise InvalidTopology(_address_clash(owner[use.address], use))
                owner[use.address] = use
    known = ", ".join(sorted(ids))
    first: dict[tuple[str, str], int] = {}
    for number, link in enumerate(links, start=1):
        where = f"link #{number} ({link.src} -> {link.dst})"
        for end in (link.src, link.dst):
            if end not in ids:
                raise InvalidTopology(f"{where}: unknown site {end!r}; known sites: {known}")
        if link.src == link.dst:
            raise InvalidTopology(f"{where}: a link from a site to itself is not allowed; remove it")
        if link.key in first:
            raise InvalidTopology(
                f"{where}: duplicate of link #{first[link.key]}; keep one link and put all its topic filters in it"
            )
        first[link.key] = number
        if not link.topics:
            raise InvalidTopology(
                f"{where}: topics is empty, so the link would carry nothing; "
                "omit 'topics' to carry every topic, or remove the link"
            )
        if isinstance(link.cost, bool) or not isinstance(link.cost, int) or not 1 <= link.cost <= COST_MAX:
            raise InvalidTopology(f"{where}: cost {link.cost!r} must be an integer from 1 to {COST_MAX}")


@dataclass(frozen=True, slots=True)
class _AddressUse:
    site: SiteId
    node: NodeId
    kind: str  # "gRPC", "Raft" or "Kafka"
    address: str

    def describe(self) -> str:
        return f"the {self.kind} address of site {self.site!r}, node {self.node}"


def _address_clash(first: _AddressUse, second: _AddressUse) -> str:
    if first.kind == second.kind == "gRPC":  # the message the string form has always given
        whom = "twice" if first.site == second.site else f"by sites {first.site!r} and {second.site!r}"
        return f"node address {second.address} is listed {whom}; each node needs its own address"
    if first.site == second.site and first.node == second.node:
        return (
            f"site {second.site!r}, node {second.node}: its {second.kind} address {second.address} is its "
            f"{first.kind} address; the {second.kind} port is separate: give {second.kind.lower()} a port of its own"
        )
    return (
        f"site {second.site!r}, node {second.node}: {second.kind} address {second.address} is already "
        f"{first.describe()}; every gRPC, Raft and Kafka address in the topology must be different: use another port"
    )


def _validate_members(s: Site) -> None:
    where = f"site {s.id!r}"
    if tuple(m.address for m in s.members) != s.nodes:
        raise InvalidTopology(
            f"{where}: nodes {list(s.nodes)} are not the members' addresses "
            f"{[m.address for m in s.members]}; build the site with Site.with_members(...)"
        )
    position_of: dict[int, int] = {}
    for position, m in enumerate(s.members, start=1):
        if isinstance(m.id, bool) or not isinstance(m.id, int):
            raise InvalidTopology(
                f"{where}, node #{position}: id {m.id!r} must be an integer from 1 to {NODE_ID_MAX}, "
                f"for example id = {position}"
            )
        try:
            node_id(m.id)
        except InvalidNodeId:
            raise InvalidTopology(
                f"{where}, node #{position}: id {m.id} is out of range: use 1 to {NODE_ID_MAX}, "
                f"for example id = {position}"
            ) from None
        if m.id in position_of:
            free = min(set(range(1, len(s.members) + 2)) - {other.id for other in s.members})
            raise InvalidTopology(
                f"{where}: node id {m.id} is listed twice (nodes #{position_of[m.id]} and #{position}); "
                f"give each node of the site its own id, for example id = {free}"
            )
        position_of[m.id] = position
    if len(s.members) > 1 and any(m.raft is not None for m in s.members):
        for m in s.members:
            if m.raft is None:
                raise InvalidTopology(
                    f"{where}, node {m.id} ({m.address}) has no Raft address but other nodes of the site have; "
                    f'a site with more than one node needs raft = "HOST:PORT" on every node'
                )
    if len(s.members) > 1 and any(m.kafka is not None for m in s.members):
        for m in s.members:
            if m.kafka is None:
                raise InvalidTopology(
                    f"{where}, node {m.id} ({m.address}) has no Kafka address but other nodes of the site have; "
                    f'give every node kafka = "HOST:PORT" (a Kafka client is sent to whichever node leads a '
                    f"partition), or none"
                )


def _unknown_keys(table: Mapping[str, object], allowed: tuple[str, ...], where: str) -> None:
    extra = sorted(k for k in table if k not in allowed)
    if extra:
        raise InvalidTopology(f"{where}: unknown key {extra[0]!r}; allowed keys are {', '.join(allowed)}")


def _string_list(value: object, where: str, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidTopology(f"{where}: {what} must be a list of strings, got {value!r}")
    return list(value)


def _parse_site(key: str, table: object) -> Site:
    site = _parse_site_nodes(key, table)
    assert isinstance(table, dict)  # _parse_site_nodes refused anything else
    linger = table.get("interest_linger_ms", site.interest_linger_ms)
    if isinstance(linger, bool) or not isinstance(linger, int) or not 0 <= linger <= 86_400_000:
        raise InvalidTopology(f"[sites.{key}]: interest_linger_ms must be a whole number of ms from 0 to 86400000")
    try:
        rules = parse_rules(table["auto_create"], f"[sites.{key}]") if "auto_create" in table else ()
    except InvalidAutoCreate as exc:
        raise InvalidTopology(str(exc)) from None
    return dataclasses.replace(site, auto_create=rules, interest_linger_ms=linger)


def _parse_site_nodes(key: str, table: object) -> Site:
    where = f"[sites.{key}]"
    if not isinstance(table, dict):
        raise InvalidTopology(f"{where} must be a table with nodes = [...], got {table!r}")
    _unknown_keys(table, _SITE_KEYS, where)
    try:
        sid = site_id(key)
    except InvalidSiteId as e:
        raise InvalidTopology(f"{where}: {e}") from None
    if "nodes" not in table:
        raise InvalidTopology(f"{where}: missing 'nodes', for example nodes = [\"127.0.0.1:7101\"]")
    raw = table["nodes"]
    forms = {type(v) for v in raw} if isinstance(raw, list) else set()
    if not isinstance(raw, list) or not forms <= {str, dict}:
        raise InvalidTopology(
            f'{where}: nodes must be a list of strings "HOST:PORT" or of tables '
            f'{{ id = 1, address = "HOST:PORT", raft = "HOST:PORT" }}, got {raw!r}'
        )
    if forms == {str, dict}:
        raise InvalidTopology(
            f"{where}: nodes mixes strings and tables; write every node as a table, "
            f"for example {_table_form_example(key, [_address_of(v) for v in raw])}"
        )
    if forms != {dict}:
        return Site(sid, tuple(raw))
    members = tuple(_parse_node(where, position, node) for position, node in enumerate(raw, start=1))
    if len(members) > 1:
        for position, m in enumerate(members, start=1):
            if m.raft is None:
                with_raft = NodeSpec(m.id, m.address, "HOST:PORT").as_toml()
                raise InvalidTopology(
                    f"{where}, node #{position} (id {m.id}): missing 'raft': a site with {len(members)} nodes "
                    f"needs every node's Raft address, on a port that no gRPC address uses; write {with_raft}"
                )
    return Site.with_members(sid, members)


def _address_of(node: object) -> str:
    address = node.get("address") if isinstance(node, dict) else node
    return address if isinstance(address, str) else "HOST:PORT"


def _parse_node(site_where: str, position: int, table: dict[str, object]) -> NodeSpec:
    where = f"{site_where}, node #{position}"
    _unknown_keys(table, _NODE_KEYS, where)
    example = f'{{ id = {position}, address = "HOST:PORT", raft = "HOST:PORT" }}'
    for key in ("id", "address"):
        if key not in table:
            raise InvalidTopology(f"{where}: missing {key!r}; write the node as {example}")
    nid = table["id"]
    if isinstance(nid, bool) or not isinstance(nid, int):
        raise InvalidTopology(
            f"{where}: id {nid!r} must be an integer from 1 to {NODE_ID_MAX}, for example id = {position}"
        )
    address, raft, kafka = table["address"], table.get("raft"), table.get("kafka")
    for key, value in (("address", address), ("raft", raft), ("kafka", kafka)):
        if value is not None and not isinstance(value, str):
            raise InvalidTopology(f'{where}: {key} {value!r} must be a string, {key} = "HOST:PORT"')
    assert isinstance(address, str) and (raft is None or isinstance(raft, str))  # checked just above
    assert kafka is None or isinstance(kafka, str)
    # The id's range and the addresses' form are checked in Topology, so a Site built in code gets them too.
    return NodeSpec(NodeId(nid), address, raft, kafka)


def _parse_link(number: int, table: object) -> Link:
    where = f"link #{number}"
    if not isinstance(table, dict):
        raise InvalidTopology(f"{where} must be a table with src and dst, got {table!r}")
    ends: list[str] = []
    for end in ("src", "dst"):
        value = table.get(end)
        if value is None:
            raise InvalidTopology(f"{where}: missing {end!r} (a site id)")
        if not isinstance(value, str):
            raise InvalidTopology(f"{where}: {end!r} must be a site id string, got {value!r}")
        ends.append(value)
    where = f"link #{number} ({ends[0]} -> {ends[1]})"
    _unknown_keys(table, _LINK_KEYS, where)
    topics = ALL_TOPICS
    if "topics" in table:
        try:
            topics = tuple(TopicFilter(t) for t in _string_list(table["topics"], where, "topics"))
        except InvalidTopicFilter as e:
            raise InvalidTopology(f"{where}: {e}") from None
    cost = table.get("cost", 1)
    if isinstance(cost, bool) or not isinstance(cost, int):
        raise InvalidTopology(f"{where}: cost {cost!r} must be an integer from 1 to {COST_MAX}")
    mode = table.get("mode", "all")
    if mode not in LINK_MODES:
        raise InvalidTopology(
            f'{where}: mode {mode!r} is not one of {", ".join(LINK_MODES)}: "all" carries every topic the filters '
            'match (a DR site), "interest" only those a site at or behind dst reads'
        )
    rate = table.get("rate_limit_bytes_per_s")
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, int) or rate < RATE_LIMIT_MIN):
        raise InvalidTopology(
            f"{where}: rate_limit_bytes_per_s {rate!r} must be an integer of at least {RATE_LIMIT_MIN} (bytes a "
            "second); omit it for no limit"
        )
    # Ids are checked against the sites in Topology; unknown ones are reported there with the known ids.
    return Link(SiteId(ends[0]), SiteId(ends[1]), topics, cost, mode, rate)


def parse_topology(text: str) -> Topology:
    """Parse and validate a TOML topology file's text. Raises :class:`InvalidTopology`."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise InvalidTopology(f"not valid TOML: {e}") from None
    _unknown_keys(doc, _TOP_KEYS, "top level")
    raw_sites = doc.get("sites")
    if raw_sites is None:
        raise InvalidTopology("the topology has no sites: add at least one [sites.<id>] table with nodes = [...]")
    if not isinstance(raw_sites, dict):
        raise InvalidTopology("'sites' must be a table of [sites.<id>] tables")
    raw_links = doc.get("links", [])
    if not isinstance(raw_links, list):
        raise InvalidTopology("'links' must be an array of tables: write each link as a [[links]] table")
    sites = tuple(_parse_site(key, raw_sites[key]) for key in raw_sites)
    links = tuple(_parse_link(number, table) for number, table in enumerate(raw_links, start=1))
    return Topology(sites, links)


DEFAULT_PORTS: dict[str, int] = {"a": 7101, "b": 7201, "c": 7301}

DEFAULT_TOPOLOGY_TOML = """\
# The embedded default: three sites on 127.0.0.1, a cycle a -> b -> c -> a plus the reverse edges.
[sites.a]
nodes = ["127.0.0.1:7101"]

[sites.b]
nodes = ["127.0.0.1:7201"]

[sites.c]
nodes = ["127.0.0.1:7301"]

[[links]]
src = "a"
dst = "b"

[[links]]
src = "b"
dst = "c"

[[links]]
src = "c"
dst = "a"

[[links]]
src = "b"
dst = "a"

[[links]]
src = "c"
dst = "b"

[[links]]
src = "a"
dst = "c"
"""


def default_topology() -> Topology:
    """Sites a, b, c on 127.0.0.1:7101/7201/7301; links a->b->c->a and the reverse edges, every topic, cost 1."""
    return parse_topology(DEFAULT_TOPOLOGY_TOML)


def _reachable(adjacent: Mapping[str, Iterable[str]], start: str) -> set[str]:
    seen = {start}
    todo = [start]
    while todo:
        for nxt in adjacent.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def warnings(topology: Topology) -> list[str]:
    """What is legal but probably a mistake, one message per problem, in a stable order.

    Topic filters are ignored here: a site that a filtered link reaches counts as reached.
    """
    ids = topology.site_ids()
    if len(ids) < 2:
        return []
    out_of: dict[str, list[str]] = {s: [] for s in ids}
    into: dict[str, list[str]] = {s: [] for s in ids}
    for link in topology.links_sorted():
        out_of[link.src].append(link.dst)
        into[link.dst].append(link.src)
    found: list[str] = []
    for s in ids:
        if not into[s]:
            found.append(
                f"site {s!r} is not reached by any link: records written at other sites never get there "
                f"(add a [[links]] table with dst = {s!r})"
            )
    for s in ids:
        if not out_of[s]:
            found.append(
                f"site {s!r} has no outgoing link: records written at {s!r} never leave it "
                f"(add a [[links]] table with src = {s!r})"
            )
    reaches = {s: _reachable(out_of, s) for s in ids}
    for dst in ids:
        if not into[dst]:
            continue
        cut_off = [origin for origin in ids if out_of[origin] and origin != dst and dst not in reaches[origin]]
        if cut_off:
            names = ", ".join(repr(o) for o in cut_off)
            found.append(f"site {dst!r} cannot receive records written at {names}: no chain of links leads there")
    return found
