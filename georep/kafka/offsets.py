"""Kafka offsets and georep's vector offsets at the gateway. Pure: a ``PartitionLog`` port, no I/O of its own.

A Kafka offset is the site's local offset, which means nothing at another site. georep commits a vector
offset instead, which means the same records everywhere (I5). So:

* **OffsetCommit** of offset ``L`` at this site stores :func:`vector_at` ``(log, L)``: for each origin, the
  next origin seq after the records below ``L`` here. Exact, also for ``L`` inside a batch (a batch maps a
  contiguous offset range onto a contiguous origin-seq range). ``L`` itself goes along as the commit's hint.
* **OffsetFetch** answers the hint if the commit was made at this very site and epoch (the same log);
  otherwise ``start_offset_for_vector``: the first local offset holding a record the vector does not cover.
  Past that offset this site may hold records the vector covers, interleaved with ones it does not (the
  origins' records arrived here in another order), and records it covers may still arrive. So the answer
  registers a :class:`FetchFilter` for that client and partition, and the gateway's Fetch leaves the covered
  records out (``georep/kafka/records.py``). The consumer sees offset gaps, as after compaction, and reads
  exactly the records the commit does not cover, once.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from georep.storage.api import PartitionLog
from offsets.log_prefix import vector_below
from offsets.vector import VectorOffset

FILTERS_MAX = 10_000  # (client, partition) filters kept; the oldest go first


def vector_at(log: PartitionLog, offset: int) -> VectorOffset:
    """The vector of everything below local ``offset`` in ``log``: what a consumer at ``offset`` has read.

    ``offset`` must lie in ``[log start, log end]`` (``OffsetOutOfRange`` otherwise: below the log start the
    records are gone, and so is the exact vector). The answer is the vector at the base of the segment holding
    ``offset`` (:meth:`PartitionLog.segment_at`: every batch below it, those retention or a chain trim deleted
    included) advanced past that segment's batches below ``offset`` by ``offsets/log_prefix.py``, the one fold
    every vector-at-an-offset question uses. Cost: one segment's batch entries, not the whole log's, per commit.
    """
    segment = log.segment_at(offset)
    return vector_below(segment.start_vector, segment.entries, offset)


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
