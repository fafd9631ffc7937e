"""Site ids and the topology graph: sites, links, topic filters, routing and expected reach. Pure: no I/O.

The public names are importable from here. They load on first use, so that the
many modules that only need ``topology.ids`` do not pay for importing networkx
(about 0.1 s). The ``georep topology show`` command (text summary and
pictures) is a shell: ``georep/cli/topology.py``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from topology.filters import ALL_TOPICS, InvalidTopicFilter, TopicFilter, matches_any
    from topology.ids import InvalidSiteId, SiteId, site_id
    from topology.model import (
        DEFAULT_TOPOLOGY_TOML,
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
    from topology.routing import Candidate, Router

_WHERE = {
    "ALL_TOPICS": "filters",
    "InvalidTopicFilter": "filters",
    "TopicFilter": "filters",
    "matches_any": "filters",
    "InvalidSiteId": "ids",
    "SiteId": "ids",
    "site_id": "ids",
    "DEFAULT_TOPOLOGY_TOML": "model",
    "InvalidTopology": "model",
    "Link": "model",
    "NodeSpec": "model",
    "Site": "model",
    "Topology": "model",
    "UnknownLink": "model",
    "UnknownSite": "model",
    "default_topology": "model",
    "parse_topology": "model",
    "warnings": "model",
    "expected_sites": "reach",
    "Candidate": "routing",
    "Router": "routing",
}

__all__ = [
    "ALL_TOPICS",
    "DEFAULT_TOPOLOGY_TOML",
    "Candidate",
    "InvalidSiteId",
    "InvalidTopicFilter",
    "InvalidTopology",
    "Link",
    "NodeSpec",
    "Router",
    "Site",
    "SiteId",
    "TopicFilter",
    "Topology",
    "UnknownLink",
    "UnknownSite",
    "default_topology",
    "expected_sites",
    "matches_any",
    "parse_topology",
    "site_id",
    "warnings",
]


def __getattr__(name: str) -> object:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'topology' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"topology.{module}"), name)
    globals()[name] = value
    return value
