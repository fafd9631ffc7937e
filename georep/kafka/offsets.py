"""Kafka offsets and georep's vector offsets at the gateway. Pure: a ``PartitionLog`` port, no I/O of its own.

A Kafka offset is the site's local offset, which means nothing at another site. georep commits a vector
offset instead, which means the same records everywhere (I5). So:

* **OffsetCommit** of offset ``L`` at this site stores :func:`vector_at` ``(log, L)``: for each origin, the
  next origin seq after the records below ``L`` here. Exact, also for ``L`` inside a batch (a batch maps a
  contiguous offset range onto a contiguous origin-seq range). ``L`` itself goes along as the commit's hint.
* **OffsetFetch** answers ``fetch.resume_at``: the hint if the commit was made at this very site and epoch
  (the same log); otherwise the exact offset of the first record the vector does not cover, inside its batch
  (the client drops the records of a fetched batch below the offset it asked for). Past that offset this site
  may hold records the vector covers, interleaved with ones it does not (the origins' records arrived here in
  another order), and records it covers may still arrive. Only then (``Resume.covered_after``) does the
  answer register a :class:`FetchFilter` for that client and partition, and the gateway's Fetch leaves the
  covered records out (``georep/kafka/records.py``): the consumer sees offset gaps, as after compaction, and
  reads exactly the records the commit does not cover, once. Without interleaving, a reader that seeks to
  the answer with no filter at all (another client, a lag tool's number) reads exactly those records too.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from georep.broker.fetch import vector_at
from offsets.vector import VectorOffset

__all__ = ["FetchFilters", "vector_at"]

FILTERS_MAX = 10_000  # (client, partition) filters kept; the oldest go first


@dataclass(frozen=True, slots=True)
class FetchFilter:
    start: int  # the local offset OffsetFetch answered
    vector: VectorOffset  # the committed vector: its records are left out of fetches from ``start`` on


FilterKey = tuple[str, str, int]  # (client, topic, partition)


class FetchFilters:
    """Which vector to leave out of which client's fetches of a partition."""

    def __init__(self, limit: int = FILTERS_MAX) -> None:
        self._filters: OrderedDict[FilterKey, FetchFilter] = OrderedDict()
        self._limit = limit

    def set(self, key: FilterKey, start: int, vector: VectorOffset) -> None:
        self._filters.pop(key, None)
        self._filters[key] = FetchFilter(start, vector)
        while len(self._filters) > self._limit:
            self._filters.popitem(last=False)

    def clear(self, key: FilterKey) -> None:
        self._filters.pop(key, None)

    def for_fetch(self, key: FilterKey, offset: int) -> VectorOffset | None:
        """The vector to leave out of a fetch at ``offset``; a fetch below the filter's start (the consumer
        seeked back) ends the filter."""
        f = self._filters.get(key)
        if f is None:
            return None
        if offset < f.start:
            del self._filters[key]
            return None
        return f.vector
