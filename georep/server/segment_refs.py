"""The topic incarnation on the Segments service's calls (docs/design.md, "Topic changes across sites"). Shell.

A topic deleted and created again reuses its partitions' keys and segment ids from 0. A member whose copies of the
deleted incarnation are still there (its removal pass has not run yet), or whose view of the site's metadata is
behind or ahead of the caller's, must not take one incarnation's call for the other's: a leader's open of segment 0
would find the deleted incarnation's copy and keep it (opening an existing copy again changes nothing), and a
repair's copy of a deleted segment would land among the new incarnation's. So every call names the incarnation its
caller's view holds live (``SegmentRef.incarnation``, ``FenceSegmentsRequest.incarnation``), and the member refuses
a call unless its own view holds the same (``ReplicaStore.check_incarnation``): the caller retries once the views
agree, or stops, as a deleted incarnation's leader and repairs do. A node from before sends and reads 0, right for
every topic never deleted.
"""

from __future__ import annotations

from georep.proto import georep_pb2 as pb
from georep.storage.replica_store import PartitionKey, ReplicaStore

DELETED = -1  # what a caller whose view holds the topic deleted sends: no member's view holds it live


def incarnation_sent(store: ReplicaStore, topic: str) -> int:
    """The incarnation of ``topic`` this node's view holds live, as a call carries it."""
    held = store.incarnation_of(topic)
    return DELETED if held is None else held


def segment_ref(store: ReplicaStore, key: PartitionKey, segment_id: int) -> pb.SegmentRef:
    """A reference to ``segment_id`` of ``key``, of the incarnation this node's view holds live."""
    return pb.SegmentRef(
        topic=key[0], partition=key[1], segment_id=segment_id, incarnation=incarnation_sent(store, key[0])
    )
