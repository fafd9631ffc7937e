"""Who may replicate from this site, which topics, which origins a pulled batch may claim, and which claims of a
held report count. Pure.

The replication RPCs are authorized by the topology, not by ACL entries (``georep/auth/acl.py``): the
links are already the operator's statement of which site pulls what from which.

**Pulling** (:func:`pull_decision`, the ``Replicate`` RPC and the calls a puller makes alongside it:
``ReportHeld``, ``ListAcls`` for the ACL sync). A caller ``site:d`` or ``node:d/N`` may pull from site ``s``
only if the topology has a link ``s -> d``, and only the topics that link carries (its filters, and the
internal topics every link carries). The site's own nodes pull from each other (a node passes on the
partitions another node leads), so they may pull everything. A client never replicates.

**Held reports** (:func:`held_claim_refusal`, ``ReportHeld``): a site that pulls from this one may tell it what
it and the sites downstream of it hold, for ``acks=geo:N``; each claim counts only about a site that this site's
records of the topic reach through the reporter (the function's docstring has the rule and why it is exact).

**Repairs** (:func:`repair_decision`, ``FetchBatch``): a site asks any site of the topology for a copy of a
batch it holds damaged. ``s`` gives a batch of topic ``T`` from origin ``O`` to site ``d`` only if ``d`` is one
of the sites ``O``'s records of ``T`` reach (``topology/reach.py``): ``d`` then holds, or will hold, that very
batch anyway, so nothing is disclosed that the topology does not already send it.

**Origins of a pulled batch** (:func:`origin_may_arrive`). Site ``d`` pulls from ``s`` over the link ``s -> d``
a batch of topic ``T`` whose header claims origin site ``O``. ``d`` accepts it only if ``O == s``, or ``s`` is
among the sites ``O``'s records of ``T`` reach over links carrying ``T`` (``expected_sites(O, T)``).

*Why this is exactly the set an honest ``s`` can send.* By induction on the batches a site holds: a batch of
``T`` with origin ``O`` is at ``s`` either because ``s`` stamped it (a produce at ``s``: ``O == s``; producers
cannot stamp, ``georep/broker/append.py`` refuses a stamped batch), or because ``s`` pulled it over some link
``u -> s`` carrying ``T`` from a ``u`` that held it and passed this same check, so ``u == O`` or ``u`` is
reached from ``O`` over links carrying ``T``; either way ``s`` is reached from ``O`` over links carrying ``T``.
So a batch outside the rule did not come through the topology: a forged origin (a site stamping another's
name), or a misconfigured peer. Refusing it keeps a compromised or mistaken site from injecting records in
another site's name, where they would count toward the victim's vector offsets and be deduplicated against
its real records.

The rule uses the current topology: after a link is removed, records that came over it before are refused
downstream of the sites that hold them (they stay where they are), and a pull waits at them: per origin a log is
a prefix, so nothing after them in that partition can be applied until the topology allows their origin again.
Safety over liveness, as everywhere in replication; the link's last error says which origin and why. ``d``'s
own origin comes back only over a cycle, which the rule allows (``d`` reaches ``s``), and the sink then skips it
as held.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from georep.auth.acl import CLUSTER, Decision, Operation, PermissionDenied, Resource, topic
from georep.auth.principal import Principal
from georep.broker.errors import BrokerError
from georep.record.batch import CorruptBatch, iter_headers
from offsets.coordinates import Origin
from topology.model import Topology, UnknownLink, UnknownSite
from topology.reach import expected_sites


def _denied(principal: Principal, resource: Resource, why: str) -> Decision:
    return Decision(False, principal, Operation.REPLICATE, resource, why)


def pull_decision(topology: Topology | None, me: str, principal: Principal, topics: Iterable[str]) -> Decision:
    """Whether ``principal`` may pull ``topics`` (the wanted topics; none for a call without topics) from ``me``."""
    caller = principal.site
    if caller is None:
        return _denied(principal, CLUSTER, f"only sites replicate; a client cannot pull from site {me}")
    if caller == me:
        return Decision(True, principal, Operation.REPLICATE, CLUSTER, f"a node of site {me}")
    if topology is None:
        return _denied(principal, CLUSTER, f"site {me} runs without a topology, so no site may pull from it")
    try:
        link = topology.link(me, caller)
    except UnknownLink:
        why = f"the topology has no link {me} -> {caller}, so site {caller} may not pull from site {me}"
        return _denied(principal, CLUSTER, f"{why}; add the link to the topology if it should")
    for name in sorted(set(topics)):
        if not link.carries(name):
            filters = ", ".join(str(f) for f in link.topics)
            why = f"the link {link.describe()} carries only {filters}"
            return _denied(principal, topic(name), f"{why}; widen its topics in the topology if it should carry it")
    return Decision(True, principal, Operation.REPLICATE, CLUSTER, f"the link {link.describe()}")


def repair_decision(
    topology: Topology | None, me: str, principal: Principal, topic_name: str, origin_site: str
) -> Decision:
    """Whether ``principal`` may fetch a copy of ``origin_site``'s batch of ``topic_name`` from ``me``."""
    caller = principal.site
    resource = topic(topic_name)
    if caller is None:
        return _denied(principal, resource, "only sites repair from other sites; read the topic with a consumer")
    if caller == me:
        return Decision(True, principal, Operation.REPLICATE, resource, f"a node of site {me}")
    if topology is None:
        return _denied(principal, resource, f"site {me} runs without a topology")
    try:
        reach = expected_sites(topology, origin_site, topic_name)
    except UnknownSite:
        return _denied(principal, resource, f"origin site {origin_site!r} is not in the topology")
    if caller not in reach:
        why = f"records of {topic_name!r} from site {origin_site} do not reach site {caller} under the topology's links"
        return _denied(principal, resource, f"{why}, so it gets no copy of them")
    return Decision(True, principal, Operation.REPLICATE, resource, f"site {caller} holds {origin_site}'s records")


def origin_may_arrive(topology: Topology, src: str, dst: str, topic_name: str, origin_site: str) -> bool:
    """Whether ``dst`` accepts, from ``src`` over the link ``src -> dst``, a batch of ``topic_name`` claiming
    ``origin_site`` (see the module docstring for the rule and its proof)."""
    if origin_site == src:
        return True
    try:
        return src in expected_sites(topology, origin_site, topic_name)
    except UnknownSite:
        return False


class ForgedOrigin(BrokerError):
    """A pulled batch claims an origin its source cannot have received under the topology; nothing of its chunk
    is applied (the pull ends with this message and is opened again, so the link shows it until fixed)."""

    def __init__(self, src: str, dst: str, topic_name: str, origin: str) -> None:
        super().__init__(
            f"site {src} sent site {dst} a batch of topic {topic_name!r} claiming origin {origin}, but records of "
            f"that topic from site {origin.partition('@')[0]} cannot reach site {src} under the topology's links: "
            f"refused as a forged origin. Check site {src}'s topology file and its certificates"
        )


class OriginCheck:
    """:func:`origin_may_arrive` for the chunks ``dst`` pulls, remembered per (source, topic, origin site): the
    topology is the node's for its life, and the chunks of one partition repeat the same few origins."""

    def __init__(self, topology: Topology, dst: str) -> None:
        self.topology = topology
        self.dst = dst
        self._seen: dict[tuple[str, str, str], bool] = {}

    def may_arrive(self, src: str, topic_name: str, origin_site: str) -> bool:
        key = (src, topic_name, origin_site)
        allowed = self._seen.get(key)
        if allowed is None:
            if len(self._seen) >= CLAIM_CHECKS_KEPT:  # topics are many and made at will: keep the memo bounded
                self._seen.clear()
            allowed = self._seen[key] = origin_may_arrive(self.topology, src, self.dst, topic_name, origin_site)
        return allowed

    def plausible(self, src: str, topic_name: str, vector: Mapping[Origin, int]) -> dict[Origin, int]:
        """``src``'s vector of a partition of ``topic_name`` (a chunk's or a heartbeat's ``src_vector``) without
        the origins it cannot have received: its word about them would steer routing and stall detection
        (``georep/replication/links.py``) toward records it cannot give."""
        return {o: n for o, n in vector.items() if self.may_arrive(src, topic_name, o.site)}

    def check(self, src: str, topic_name: str, batches: bytes) -> None:
        """Raise :class:`ForgedOrigin` if a batch of the chunk claims an origin ``src`` cannot have sent; a chunk
        that does not parse is left to the sink, which refuses it as corrupt."""
        try:
            headers = iter_headers(batches)
        except CorruptBatch:
            return
        for header in headers:
            origin = header.origin
            if not self.may_arrive(src, topic_name, origin.site):
                raise ForgedOrigin(src, self.dst, topic_name, str(origin))


# -- claims about what other sites hold ----------------------------------------------------------------------------


def held_claim_refusal(topology: Topology | None, me: str, reporter: str, site: str, topic_name: str) -> str | None:
    """Why site ``me`` refuses ``reporter``'s claim (``ReportHeld``) that ``site`` holds records of ``topic_name``
    fsynced; None if the claim may count toward ``acks=geo:N``.

    *The rule.* Knowledge of what a site holds flows against the links (``offsets/held.py``): ``site`` reports to
    the sites it pulls from, they pass it on to theirs, and so on back to the origin. So ``reporter`` may speak
    for ``site`` about ``T`` only if:

    1. ``reporter`` pulls ``T`` from ``me``: the topology has a link ``me -> reporter`` that carries ``T``.
       Otherwise nothing of ``me``'s ``T`` goes to ``reporter``, and its word about ``T`` is not about records
       it has been sent;
    2. ``site`` is in the topology, and is not ``me`` (a site's own entry comes from its own fsyncs);
    3. ``site`` is ``reporter``, or ``reporter`` reaches ``site`` over links that carry ``T``
       (``expected_sites(reporter, T)``).

    *Why every true claim passes.* A site ``s != me`` holds a record of ``me``'s ``T`` only if it came over a
    chain of links carrying ``T``: ``me -> x1 -> ... -> xk = s``. Each ``xi`` reports to ``x(i-1)`` (it pulls
    from it), and ``x(i-1)`` passes on what it accepted. At each hop the reporter ``xi`` pulls ``T`` from its
    upstream over a link carrying ``T`` (1), and reaches ``s`` over the rest of the chain (3). So the report of
    ``s`` reaches ``me`` along the chain itself, every hop accepting it (reporters leave out what their upstream
    would refuse: :class:`~offsets.held.HeldReporter`'s ``accepts``).

    *What it keeps out.* A principal that may pull from ``me`` can no longer vouch for a site that ``me``'s
    records of ``T`` cannot reach through it: a site off its ``T`` paths, or one the topology does not know. What
    it says about itself and about the sites downstream of it is all a compromised site can still claim, and
    ``offsets.held.ServedGate`` holds even that to records that have left ``me``.
    """
    if topology is None:
        return f"site {me} runs without a topology: no other site receives its records"
    if site == me:
        return f"what site {me} holds comes from its own fsyncs, never from another site's report"
    try:
        link = topology.link(me, reporter)
    except UnknownLink:
        return f"the topology has no link {me} -> {reporter}, so site {reporter} receives nothing from site {me}"
    if not link.carries(topic_name):
        return f"the link {link.describe()} does not carry topic {topic_name!r}"
    if site == reporter:
        return None
    try:
        reach = expected_sites(topology, reporter, topic_name)
        topology.site(site)
    except UnknownSite:
        return f"site {site!r} is not in the topology"
    if site not in reach:
        return (
            f"no chain of links carrying topic {topic_name!r} leads from site {reporter} to site {site}, so site "
            f"{reporter} cannot know what site {site} holds of it"
        )
    return None


class ClaimRefused(PermissionDenied):
    """A ``ReportHeld`` with claims the topology does not allow: the others of the report were taken in, these count
    toward nothing (``PERMISSION_DENIED``; the reporter sends them again with its next report, so the
    topologies of the two sites disagree until fixed)."""

    def __init__(self, me: str, reporter: str, refused: list[tuple[str, str, int, str]]) -> None:
        shown = "; ".join(f"that site {s} holds {t}/{p}: {why}" for s, t, p, why in refused[:CLAIMS_SHOWN])
        more = f" (and {len(refused) - CLAIMS_SHOWN} more)" if len(refused) > CLAIMS_SHOWN else ""
        super().__init__(
            f"site {me} refused {len(refused)} claim(s) of site {reporter}'s held report, which count toward no "
            f"acks=geo:N: {shown}{more}. If the claims are true, the two sites run different topologies: give them "
            "the same topology file"
        )
        self.refused = refused


CLAIMS_SHOWN = 3
CLAIM_CHECKS_KEPT = 16_384


class HeldClaimCheck:
    """:func:`held_claim_refusal` for the reports ``me`` receives, remembered per (reporter, site, topic): the
    topology is the node's for its life, and reports repeat the same few sites for every partition."""

    def __init__(self, topology: Topology | None, me: str) -> None:
        self.topology = topology
        self.me = me
        self._seen: dict[tuple[str, str, str], str | None] = {}

    def refusal(self, reporter: str, site: str, topic_name: str) -> str | None:
        key = (reporter, site, topic_name)
        if key not in self._seen:
            if len(self._seen) >= CLAIM_CHECKS_KEPT:  # topics are many and made at will: keep the memo bounded
                self._seen.clear()
            self._seen[key] = held_claim_refusal(self.topology, self.me, reporter, site, topic_name)
        return self._seen[key]
