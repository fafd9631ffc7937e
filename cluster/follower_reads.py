"""What a node that does not lead a partition may serve of it: the follower-read rule. Pure.

Kafka's KIP-392 lets a consumer fetch from a follower replica (its nearest,
``client.rack``), which serves up to the high watermark the leader last told
it; Pulsar and BookKeeper readers read a ledger from any bookie of its
ensemble up to the last add confirmed (LAC) the writer piggybacked on its
adds. A multi-node site's partition is a chain of segments, each on its own
ensemble (ARCHITECTURE.md, "Inside a site"), and the same idea applies per
segment:

* **A sealed segment** is final: the metadata records its sealed end, which
  recovery chose at or above every acknowledged batch, and members cut any
  longer copy to it. Every byte below the sealed end is the same on every
  copy (each is a prefix of its one writer's stream), so any node may serve
  it up to the sealed end, reading its own copy, or a member's when its own
  is missing or short (a node outside the ensemble reads it from a member,
  as the leader does). Never past the sealed end: a copy may still hold a
  tail the seal cut.
* **The open segment** is served by a member only up to the LAC the leader
  last announced to it (``SegmentAppendRequest.lac``), and only as far as
  its own copy goes. Below an announced LAC every batch is on
  ``min_insync_replicas`` members fsynced, so a new leader's recovery keeps
  it (it takes the highest end of any ``E - AQ + 1`` fenced members) and the
  segment is later sealed at or above it: nothing a follower served can be
  cut (I-rules: readers see nothing a recovery could cut). An announcement
  is bound to one segment id, so one of an earlier segment never counts for
  the next one; one of a deposed leader still holds (what it confirmed, the
  recovery keeps).
* **A node outside the open segment's ensemble** learns no LAC: it serves
  the sealed segments and then tells the consumer to go to the leader.

:func:`follower_bound` is that rule over one node's view: the partition's
chain as its metadata has it (which may lag: a segment it still thinks open
is held to its LAC, which is below the seal; one it does not know of yet is
not served), the end of its own copy of the open segment, and the LAC
announced for that segment. The shells only carry it out: the member's
handler records announcements, and the follower's fetch serves below the
bound (``georep/server/follower_fetch.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from topology.ids import NodeId, SegmentId


@dataclass(frozen=True, slots=True)
class SegmentBounds:
    """One segment of the chain, from the node's view of the metadata."""

    segment_id: SegmentId
    base_offset: int
    end_offset: int | None  # the sealed end (exclusive); None while open
    ensemble: tuple[NodeId, ...]


@dataclass(frozen=True, slots=True)
class FollowerBound:
    """What a node may serve of a partition it does not lead.

    ``end``: every offset below it may be served (sealed segments up to their sealed end, the open segment up to
    its announced LAC and this node's copy). ``grows``: whether this node can come to serve more (it is a member
    of the open segment, or no segment is open yet); if not, a reader that reached ``end`` goes to the leader.
    """

    end: int
    grows: bool
    why: str  # what limits ``end``, for messages

    def serves(self, offset: int) -> bool:
        return offset < self.end


def follower_bound(
    chain: Sequence[SegmentBounds], me: NodeId, open_copy_end: int | None, announced_lac: int | None
) -> FollowerBound:
    """The bound of what node ``me`` may serve of a partition whose chain is ``chain`` (oldest first).

    ``open_copy_end``: the end of ``me``'s copy of the open segment (None: it holds none). ``announced_lac``: the
    highest LAC the leader announced to ``me`` for that very segment (None: none since this node started).
    Raises ``ValueError`` for a chain that is not contiguous or has an open segment before its end.
    """
    _check_chain(chain)
    if not chain:
        return FollowerBound(0, True, "the partition has no segment yet")
    last = chain[-1]
    if last.end_offset is not None:
        # Between a seal and the next open (or this node has not seen the next segment yet): all of it is final.
        return FollowerBound(
            last.end_offset,
            True,
            f"segment {last.segment_id} is sealed there, and no later segment is known to this node yet",
        )
    base = last.base_offset
    if me not in last.ensemble or open_copy_end is None:
        return FollowerBound(
            base,
            False,
            f"the open segment {last.segment_id} is on nodes {list(last.ensemble)}, "
            "not on this node, which learns no LAC of it",
        )
    if announced_lac is None or announced_lac <= base:
        return FollowerBound(
            base,
            True,
            f"no LAC of the open segment {last.segment_id} above its base has been announced to this node yet",
        )
    if open_copy_end < announced_lac:
        return FollowerBound(
            max(base, open_copy_end),
            True,
            f"this node's copy of the open segment {last.segment_id} ends there, below the LAC {announced_lac}",
        )
    return FollowerBound(announced_lac, True, f"the LAC of the open segment {last.segment_id} the leader announced")


def _check_chain(chain: Sequence[SegmentBounds]) -> None:
    for before, after in zip(chain, chain[1:], strict=False):
        if before.end_offset is None:
            raise ValueError(f"segment {before.segment_id} is open but segment {after.segment_id} follows it")
        if after.base_offset != before.end_offset or after.segment_id <= before.segment_id:
            raise ValueError(
                f"segment {after.segment_id} (base {after.base_offset}) does not follow segment "
                f"{before.segment_id} (sealed at {before.end_offset})"
            )
