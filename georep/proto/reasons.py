"""Why a node refused a call, in words a client program reads: the wire's error vocabulary beside georep.proto.

A gRPC status code is too coarse for a client to act on (``FAILED_PRECONDITION`` is a producer's sequence gap, a
fenced producer, a node that does not lead the partition, or an ack level the topology cannot reach; ``ABORTED`` is
a group's new generation, or a partition leader a newer one fenced). So every refusal also carries its
:class:`Reason`: in the ``georep-reason`` trailing metadata of a failed call, and in ``Error.reason`` of a
``ProduceStream`` answer. ``georep/server/status.py`` gives each domain error its code and reason;
``georep/client/errors.py`` turns (code, reason) back into the exception an application sees. A status with no
reason comes from gRPC itself (a connection lost, a deadline, a message over the size limit), never from a handler.
"""

from __future__ import annotations

import enum

REASON_METADATA = "georep-reason"  # trailing metadata of every refusal a handler makes: a Reason
LEADER_METADATA = "georep-leader"  # of a NOT_LEADER refusal: the leader's address, if known
NEXT_OFFSET_METADATA = "georep-next-offset"  # of a DATA_LOSS fetch: where readable data goes on after the damage
FENCED_EPOCH_METADATA = "georep-fenced-epoch"  # of an ABORTED segment call: the epoch the member is fenced at
# Initial metadata of a ProduceStream whose node takes multi-batch requests: the most batches, and batch bytes, in one
PRODUCE_BATCHES_MAX_METADATA = "georep-produce-batches-max"
PRODUCE_BYTES_MAX_METADATA = "georep-produce-bytes-max"


class Reason(enum.StrEnum):
    # what the caller sent is wrong
    INVALID_REQUEST = "invalid-request"
    BATCH_TOO_LARGE = "batch-too-large"
    # what it names does not exist, or already does
    UNKNOWN_TOPIC = "unknown-topic"
    UNKNOWN_GROUP = "unknown-group"
    UNKNOWN_MEMBER = "unknown-member"
    UNKNOWN_LINK = "unknown-link"
    UNKNOWN_ACL = "unknown-acl"
    NOT_HELD = "not-held"  # FetchBatch: a batch this site does not hold durably
    TOPIC_EXISTS = "topic-exists"
    # bytes that fail their checks
    CORRUPT = "corrupt"
    DAMAGED = "damaged"  # quarantined at the node: NEXT_OFFSET_METADATA says where readable data goes on
    # the idempotent producer
    OUT_OF_ORDER_SEQUENCE = "out-of-order-sequence"
    PRODUCER_FENCED = "producer-fenced"
    # ack levels
    GEO_ACKS_UNREACHABLE = "geo-acks-unreachable"
    GEO_ACK_TIMEOUT = "geo-ack-timeout"
    # groups
    GROUP_REBALANCED = "group-rebalanced"  # an old generation, or a partition no longer assigned to the member
    COMMITS_BEHIND = "commits-behind"
    # who leads: the caller asks the site again and retries
    NOT_LEADER = "not-leader"  # LEADER_METADATA names the leader if the node knows it
    STALE_LEADER = "stale-leader"  # a newer leader fenced this node's segment, or sealed it: it no longer leads
    # the node, the site or the disk
    UNAVAILABLE = "unavailable"  # stopping, no Raft leader, a recovery that cannot finish yet, a segment elsewhere
    DISK_FULL = "disk-full"
    OFFSET_OUT_OF_RANGE = "offset-out-of-range"
    NOT_SUPPORTED = "not-supported"
    NOT_A_CLUSTER = "not-a-cluster"  # a call about a multi-node site's cluster, or its links, at a lone node
    PERMISSION_DENIED = "permission-denied"
    INTERNAL = "internal"  # a write or an fsync that failed, a replica store's refusal: the node's log says more
    # calls between the nodes of a site (segments), which no client makes
    SEGMENT_REFUSED = "segment-refused"
