"""A topic's own settings on a multi-node site (issue 23): its replication factor, where it has one. Pure."""

from __future__ import annotations

from georep.metadata.topics import TopicSpec

REPLICATION_FACTOR = "replication_factor"  # the topic config key


def replication_factor_of(spec: TopicSpec | None, site_replication_factor: int) -> int:
    """The nodes each new segment of the topic opens on: its ``replication_factor``, else the site's. A site with
    fewer eligible nodes opens on what it has (``leadership.plan_open``), and repair reports the shortfall."""
    if spec is None:
        return site_replication_factor
    return spec.config.get(REPLICATION_FACTOR, site_replication_factor)


def own_replication_factor(spec: TopicSpec | None) -> int | None:
    """The topic's own replication factor, or None (the site's applies)."""
    return None if spec is None else spec.config.get(REPLICATION_FACTOR)
