"""The vector of a log's prefix: what a reader that stops at a local offset has read. Pure.

Every place that asks "which records lie below local offset L here" asks this one function: a Kafka
OffsetCommit of ``L`` (``georep/kafka/offsets.py``), the end vector a seal records at its end offset
(``georep/storage/replica_store.py``), and the simulator's chain at a seal (``georep/sim/geo_cluster.py``).

It folds batches in log order from the vector below the first of them. Exact: an origin's batches appear at a
site in origin-seq order (I3), so the origin's records below ``L`` are those below the furthest end of its
batches below ``L``; and a batch maps a contiguous offset range onto a contiguous origin-seq range, so a batch
that straddles ``L`` counts up to ``L``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

from offsets.coordinates import Origin, OriginSeq
from offsets.vector import VectorOffset


class BatchSpan(Protocol):
    """Where one batch lies in a log and in its origin's sequence: a batch header, or an origin index entry."""

    @property
    def origin(self) -> Origin: ...

    @property
    def base_offset(self) -> int: ...

    @property
    def base_origin_seq(self) -> int: ...

    @property
    def last_offset_delta(self) -> int: ...


def vector_below(start: Mapping[Origin, int], batches: Iterable[BatchSpan], offset: int) -> VectorOffset:
    """``start`` (the vector below the first of ``batches``) advanced, per origin, past its records that lie below
    local ``offset``; ``batches`` in log order (those at or past ``offset`` are not read)."""
    next_seq: dict[Origin, int] = dict(start)
    for b in batches:
        if b.base_offset >= offset:
            break
        end = b.base_origin_seq + min(b.last_offset_delta + 1, offset - b.base_offset)
        if end > next_seq.get(b.origin, 0):
            next_seq[b.origin] = end
    return VectorOffset({o: OriginSeq(s) for o, s in next_seq.items()})
