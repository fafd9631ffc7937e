"""``ReportInterest`` checked: an advert that could not have come from its reporter over a link of this site is
refused whole, with what is wrong (``InvalidRequest``), before anything of it counts."""

from __future__ import annotations

from georep.broker.errors import InvalidRequest
from georep.proto import georep_pb2 as pb
from georep.server.interest_links import ENTRIES_MAX
from topology.filters import InvalidTopicFilter, TopicFilter
from topology.interest import Entry
from topology.model import Topology

LEASE_MS_MIN, LEASE_MS_MAX = 1_000, 600_000


def interest_entries(topology: Topology, site: str, req: pb.ReportInterestRequest) -> list[Entry]:
    """The report's entries, once the reporter pulls from ``site`` over an interest link and every entry is one
    the topology allows: a valid filter, a path of known sites without repeats that starts at the interested site,
    ends at the reporter and follows links (each site of it pulls from the next, against the data)."""
    reporter = req.reporter
    if not any(li.src == site and li.dst == reporter and li.mode == "interest" for li in topology.links):
        raise InvalidRequest(f'no link {site} -> {reporter or "(no reporter)"} in mode "interest" in the topology')
    if not LEASE_MS_MIN <= req.lease_ms <= LEASE_MS_MAX:
        raise InvalidRequest(f"lease_ms {req.lease_ms} is outside {LEASE_MS_MIN}..{LEASE_MS_MAX}")
    if len(req.entries) > ENTRIES_MAX:
        raise InvalidRequest(f"{len(req.entries)} interests in one report; at most {ENTRIES_MAX}")
    sites = set(topology.site_ids())
    links = {(li.src, li.dst) for li in topology.links}
    out: list[Entry] = []
    for e in req.entries:
        path = tuple(e.path)
        try:
            TopicFilter(e.filter)
        except InvalidTopicFilter as exc:
            raise InvalidRequest(f"interest of site {e.site}: {exc}") from None
        bad = (
            not path
            or path[0] != e.site
            or path[-1] != reporter
            or len(set(path)) != len(path)
            or not set(path) <= sites
            or any((path[i + 1], path[i]) not in links for i in range(len(path) - 1))
        )
        if bad:
            raise InvalidRequest(
                f"interest {e.filter!r} of site {e.site!r} has the path {list(path)}: a path names known sites once "
                f"each, from the interested site to the reporter {reporter}, each pulling from the next"
            )
        out.append((e.filter, e.site, path))  # type: ignore[arg-type]
    return out
