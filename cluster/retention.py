"""Retention on a multi-node site: which sealed segments to drop. Pure.

On a one-node site, ``SegmentLog.enforce_retention`` deletes whole sealed segments with Kafka's rules: the
oldest segment goes once its newest record is older than ``retention_ms``, or while the partition is larger than
``retention_bytes``; the segment being written is never deleted. On a multi-node site a partition is a chain of
segments, each on its own ensemble (``cluster/site_state.py``), so retention is a change of the metadata, as
Pulsar trims a managed ledger's ledgers and BookKeeper then garbage-collects them on the bookies: the controller
proposes :class:`~cluster.site_state.TrimChain` for the prefix this planner picks, the chain's start (the log
start offset) moves forward, and every node deletes its copies of the segments no chain names any more.

The rules, per partition, from the oldest segment on, stopping at the first that stays:

* never the chain's last segment (the open one, or the last sealed one while none is open: the next segment
  opens at its end), so the chain is never empty and stays contiguous;
* a segment goes when its newest record (``max_timestamp_ms``, recorded at its seal) is older than
  ``now_ms - retention_ms``; one sealed without a batch (empty) goes by time too, as it holds nothing;
* or while the sealed segments' bytes (``size_bytes``, recorded at the seal) exceed ``retention_bytes``. The
  open segment's bytes are not in the metadata, so the partition's size is that of its sealed segments: a site
  keeps at most one open segment more than a one-node site would;
* a segment whose size or timestamp the metadata does not know (sealed by an older version) stops the trim by
  that rule: nothing is dropped on a guess.

``-1`` (the default) turns a rule off. Deterministic: partitions in topic then partition order, no clock but
``now_ms``.
"""

from __future__ import annotations

from collections.abc import Mapping

from cluster.site_state import PartitionInfo, SegmentInfo, SiteState, TrimChain
from topology.ids import SegmentId

NO_LIMIT = -1


def _expired(segment: SegmentInfo, now_ms: int, retention_ms: int) -> bool:
    if retention_ms < 0 or not segment.sealed:
        return False
    if segment.max_timestamp_ms is None:
        # No batch below its end (an empty segment, known by its size) holds nothing to keep.
        return segment.size_bytes == 0
    return segment.max_timestamp_ms < now_ms - retention_ms


def first_kept(info: PartitionInfo, now_ms: int, retention_ms: int, retention_bytes: int) -> SegmentId | None:
    """The segment the partition's chain should start at, if retention drops any before it; else None."""
    segments = info.segments
    if len(segments) < 2:
        return None
    size = 0
    sizes_known = True
    for segment in segments:
        if segment.sealed and segment.size_bytes is not None:
            size += segment.size_bytes
        elif segment.sealed:
            sizes_known = False
    dropped = 0
    for segment in segments[:-1]:  # never the last one
        expired = _expired(segment, now_ms, retention_ms)
        oversize = retention_bytes >= 0 and sizes_known and segment.size_bytes is not None and size > retention_bytes
        if not (expired or oversize):
            break
        size -= segment.size_bytes or 0
        dropped += 1
    return segments[dropped].segment_id if dropped else None


def plan_retention(state: SiteState, now_ms: int, defaults: Mapping[str, int] | None = None) -> list[TrimChain]:
    """The trims to propose now: one per partition whose chain has a prefix past its topic's retention.

    ``defaults`` are the site's topic defaults (a topic's config holds its overrides only); without them, or
    without the key, a rule is off. Each command names the segment to keep first, so proposing it twice, or
    after another controller's trim, changes nothing.
    """
    plan: list[TrimChain] = []
    topics = state.topics()
    for info in state.partitions():
        spec = topics.get(info.topic)
        if spec is None:
            continue
        config = {**(defaults or {}), **spec.config}
        retention_ms = config.get("retention_ms", NO_LIMIT)
        retention_bytes = config.get("retention_bytes", NO_LIMIT)
        if retention_ms < 0 and retention_bytes < 0:
            continue
        first = first_kept(info, now_ms, retention_ms, retention_bytes)
        if first is not None:
            plan.append(TrimChain(info.topic, info.partition, first))
    return plan
