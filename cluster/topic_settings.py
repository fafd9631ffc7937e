"""A topic's own settings on a multi-node site (issue 23): its replication factor and its ack quorum
(``min_insync_replicas``), where it has them. Pure."""

from __future__ import annotations

from georep.metadata.topics import TopicSpec

REPLICATION_FACTOR = "replication_factor"  # the topic config keys
MIN_INSYNC_REPLICAS = "min_insync_replicas"


def replication_factor_of(spec: TopicSpec | None, site_replication_factor: int) -> int:
    """The nodes each new segment of the topic opens on: its ``replication_factor``, else the site's. A site with
    fewer eligible nodes opens on what it has (``leadership.plan_open``), and repair reports the shortfall."""
    if spec is None:
        return site_replication_factor
    return spec.config.get(REPLICATION_FACTOR, site_replication_factor)


def own_replication_factor(spec: TopicSpec | None) -> int | None:
    """The topic's own replication factor, or None (the site's applies)."""
    return None if spec is None else spec.config.get(REPLICATION_FACTOR)


def ack_quorum_of(spec: TopicSpec | None, site_ack_quorum: int) -> int:
    """The members that must hold a batch fsynced before ``acks=all`` is answered, in each new segment of the
    topic: its ``min_insync_replicas``, else the site's (``--min-insync-replicas``). Each segment records the one it
    opened with (``OpenSegment.ack_quorum``): its recovery needs that one, whatever the topic says later."""
    if spec is None:
        return site_ack_quorum
    return spec.config.get(MIN_INSYNC_REPLICAS, site_ack_quorum)
