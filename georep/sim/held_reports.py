"""Held reports between simulated sites (``ReportHeld``, for ``acks=geo:N``).

Each site tells the upstream of every inbound link what it knows sites hold
fsynced, with that link's ``HeldReporter`` (``offsets/held.py``, built by
``site.py``): at most one report in flight per upstream, sent to the node the
site pulls from, and sent again when it had no answer within
``report_timeout_ms`` (the node's RPC timeout) or the link came up again (the
upstream may have restarted and forgotten). The upstream feeds a report to its
ack table, which may release ``geo:N`` acks, and answers it.

Checked here: the upstream's node would take every claim an honest reporter
makes (``HeldClaimCheck``); the reporter leaves out what it would refuse.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from georep.auth.acl_replication import HeldClaimCheck
from georep.sim.checker import InvariantViolation
from georep.sim.network import HeldAnswer, HeldReport
from georep.sim.site import SimSite
from topology.ids import SiteId

if TYPE_CHECKING:
    from georep.sim.simulator import Simulator


class HeldReports:
    """Every site's reports to its upstreams, and the upstreams' answers."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self._claims: dict[SiteId, HeldClaimCheck] = {}  # per upstream: the claims its node would take

    def report(self, site: SimSite, upstream: SiteId) -> None:
        """Send ``upstream`` what ``site`` knows sites hold, if it has news and no report in flight."""
        sim = self.sim
        if not site.up:
            return
        entries = site.reporters[upstream].next_report(site.acks.held)
        if entries is None:
            return
        sim._seq += 1
        report_id = site.report_ids[upstream] = sim._seq
        flat = tuple((s, t, p, v) for (s, t, p), v in entries)
        sim.counts.held_reports += 1
        site.report_sent_ms[upstream] = sim.now_ms
        node = site.upstreams[upstream].current  # the node's reports go where its pulls go
        sim.network.send((upstream, site.id), upstream, HeldReport(site.id, upstream, report_id, flat, node))

    def held_changed(self, site: SimSite) -> None:
        """``site``'s ack table learnt that sites hold more: tell every upstream."""
        for upstream in site.inbound:
            self.report(site, upstream)

    def link_up(self, site: SimSite, src: SiteId) -> None:
        """The link from ``src`` is up again; ``src`` may have restarted and forgotten: report everything again."""
        site.reporters[src].reset()
        self.report(site, src)

    def tick(self, site: SimSite) -> None:
        """A report with no answer for ``report_timeout_ms`` failed (the node's RPC timeout): send news again."""
        sim = self.sim
        for upstream, sent in sorted(site.report_sent_ms.items()):
            if upstream in site.report_ids and sim.now_ms - sent >= sim.config.report_timeout_ms:
                del site.report_ids[upstream]
                site.reporters[upstream].failed()
        self.held_changed(site)

    def on_report(self, msg: HeldReport) -> None:
        sim = self.sim
        upstream = sim.sites[msg.upstream]
        if not upstream.up:
            return
        if msg.node in sim.silent_nodes:
            sim.counts.silent_drops += 1
            return
        for site, topic, _partition, _vector in msg.entries:  # the node refuses these (ClaimRefused)
            claims = self._claims.get(msg.upstream)
            if claims is None:
                claims = self._claims[msg.upstream] = HeldClaimCheck(sim.topology, msg.upstream)
            why = claims.refusal(msg.reporter, site, topic)
            if why is not None:
                raise InvariantViolation(
                    f"site {msg.upstream} would refuse {msg.reporter}'s honest claim that site "
                    f"{site} holds {topic}: {why}"
                )
        sim.perform_acks(upstream, upstream.acks.held_reported(msg.entries))
        reporter = sim.sites[msg.reporter]
        answer = HeldAnswer(msg.reporter, msg.upstream, msg.report_id, reporter.incarnation)
        sim.network.send((msg.upstream, msg.reporter), msg.reporter, answer)

    def on_answer(self, msg: HeldAnswer) -> None:
        site = self.sim.alive(msg.reporter, msg.incarnation)
        if site is None or site.report_ids.get(msg.upstream) != msg.report_id:
            return
        del site.report_ids[msg.upstream]
        site.reporters[msg.upstream].acked()
        self.report(site, msg.upstream)
