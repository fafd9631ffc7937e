"""Which sites a site-kill drill uses, for both drills (``georep drill`` and ``georep drill --client kafka``)."""

from __future__ import annotations

from topology.ids import SiteId
from topology.model import Topology, UnknownSite


class DrillSitesError(ValueError):
    """Sites a drill cannot use; the message says what to pass."""


def drill_sites(topology: Topology, site: str | None, failover_to: str | None) -> tuple[SiteId, SiteId]:
    """The site to kill (``--site``, else the first) and the one its clients move to (``--failover-to``, else the
    next one)."""
    names = list(topology.site_ids())
    if len(names) < 2:
        raise DrillSitesError("a drill needs a topology of at least 2 sites")
    victim = site or names[0]
    target = failover_to or next(n for n in names if n != victim)
    try:
        topology.site(victim)
        topology.site(target)
    except UnknownSite as exc:
        raise DrillSitesError(str(exc)) from None
    if victim == target:
        raise DrillSitesError("--failover-to must be another site than --site")
    return SiteId(victim), SiteId(target)
