"""Domain errors to gRPC status codes and reasons: the only place that knows both.

The core raises plain exceptions (``georep/broker/errors.py`` and the errors
of the packages it builds on). A handler that catches one answers with the
code this table gives, the exception's own message, which says what to do,
and the reason (``georep/proto/reasons.py``) a client program reads to tell
apart the errors that share a code. The table is searched along the
exception's class hierarchy, most specific class first, so a subclass may
have a code of its own. ``georep/client/errors.py`` holds the table back.
"""

from __future__ import annotations

import grpc

from cluster.groups import IllegalGeneration, InvalidGroupRequest, NotAssigned, UnknownMember
from cluster.quorum import Fenced, NotContiguous, QuorumError, SegmentSealed
from dedup.producer import InvalidSequence, ProducerFenced
from georep.auth.acl import InvalidAcl, PermissionDenied, UnknownAcl
from georep.auth.acl_replication import ForgedOrigin
from georep.broker import errors as e
from georep.metadata.store import TopicExists, UnknownTopic
from georep.metadata.topics import InvalidTopic
from georep.proto.reasons import Reason
from georep.raft.store import CommandTooLarge, MetadataUnavailable
from georep.record.batch import CorruptBatch, InvalidBatch
from georep.replication.sink import CorruptChunk
from georep.storage.api import BatchDamaged, DiskFull, OffsetOutOfRange
from georep.storage.chain_log import SegmentElsewhere
from georep.storage.replica_store import CorruptReplicaChunk, IncarnationMismatch, ReplicaError, UnknownSegment
from georep.storage.segment import UnrepairableDamage
from offsets.commits import InvalidCommit
from offsets.coordinates import InvalidOrigin
from offsets.vector import InvalidVectorOffset
from topology.ids import InvalidSiteId

Code = grpc.StatusCode
R = Reason

# Each domain error's status code, and the reason a client reads to tell apart the errors of one code
# (georep/proto/reasons.py; georep/client/errors.py maps both back). Searched along the class hierarchy.
STATUS: dict[type[Exception], tuple[grpc.StatusCode, Reason]] = {
    # what the caller sent is wrong
    e.InvalidRequest: (Code.INVALID_ARGUMENT, R.INVALID_REQUEST),
    e.BatchTooLarge: (Code.INVALID_ARGUMENT, R.BATCH_TOO_LARGE),  # its message names the limit
    InvalidTopic: (Code.INVALID_ARGUMENT, R.INVALID_REQUEST),
    InvalidCommit: (Code.INVALID_ARGUMENT, R.INVALID_REQUEST),
    InvalidVectorOffset: (Code.INVALID_ARGUMENT, R.INVALID_REQUEST),
    InvalidOrigin: (Code.INVALID_ARGUMENT, R.INVALID_REQUEST),
    InvalidSiteId: (Code.INVALID_ARGUMENT, R.INVALID_REQUEST),
    InvalidGroupRequest: (Code.INVALID_ARGUMENT, R.INVALID_REQUEST),
    InvalidAcl: (Code.INVALID_ARGUMENT, R.INVALID_REQUEST),
    CommandTooLarge: (Code.INVALID_ARGUMENT, R.INVALID_REQUEST),  # a metadata command over the Raft port's bound
    InvalidBatch: (Code.INVALID_ARGUMENT, R.INVALID_REQUEST),  # whole and CRC-valid, not a batch georep can serve
    # what it names does not exist, or already does
    UnknownTopic: (Code.NOT_FOUND, R.UNKNOWN_TOPIC),
    e.UnknownPartition: (Code.NOT_FOUND, R.UNKNOWN_TOPIC),
    e.UnknownGroup: (Code.NOT_FOUND, R.UNKNOWN_GROUP),
    e.NoSuchLink: (Code.NOT_FOUND, R.UNKNOWN_LINK),
    e.NotHeld: (Code.NOT_FOUND, R.NOT_HELD),
    UnknownMember: (Code.NOT_FOUND, R.UNKNOWN_MEMBER),
    UnknownSegment: (Code.NOT_FOUND, R.SEGMENT_REFUSED),
    UnknownAcl: (Code.NOT_FOUND, R.UNKNOWN_ACL),
    TopicExists: (Code.ALREADY_EXISTS, R.TOPIC_EXISTS),
    # bytes that fail their checksum
    e.BatchCrcMismatch: (Code.DATA_LOSS, R.CORRUPT),
    CorruptBatch: (Code.DATA_LOSS, R.CORRUPT),
    CorruptChunk: (Code.DATA_LOSS, R.CORRUPT),
    e.DamagedData: (Code.DATA_LOSS, R.DAMAGED),  # with where readable data goes on (rpc.py's trailers)
    CorruptReplicaChunk: (Code.DATA_LOSS, R.SEGMENT_REFUSED),
    BatchDamaged: (Code.DATA_LOSS, R.DAMAGED),
    UnrepairableDamage: (Code.DATA_LOSS, R.CORRUPT),
    # the state of the node or of the producer forbids it
    e.SequenceRejected: (Code.FAILED_PRECONDITION, R.OUT_OF_ORDER_SEQUENCE),  # or fenced: see status_of
    e.GeoAcksUnreachable: (Code.FAILED_PRECONDITION, R.GEO_ACKS_UNREACHABLE),
    e.NotEnoughReplicas: (Code.UNAVAILABLE, R.UNAVAILABLE),  # retried, as Kafka's producers retry it
    e.NoTopology: (Code.FAILED_PRECONDITION, R.NOT_A_CLUSTER),
    e.SingleNodeSite: (Code.FAILED_PRECONDITION, R.NOT_A_CLUSTER),
    e.TopicDeleteRefused: (Code.FAILED_PRECONDITION, R.NOT_SUPPORTED),
    IllegalGeneration: (Code.ABORTED, R.GROUP_REBALANCED),
    NotAssigned: (Code.ABORTED, R.GROUP_REBALANCED),
    e.CommitsBehind: (Code.ABORTED, R.COMMITS_BEHIND),
    e.GroupNotEmpty: (Code.FAILED_PRECONDITION, R.INVALID_REQUEST),  # the message says: stop the consumers first
    # A newer leader fenced this node's copy, or sealed its segment: to a member's leader (the Segments service)
    # the code says stop writing; to a producer the reason says ask who leads now and send there (Kafka's
    # FENCED_LEADER_EPOCH, which its producer retries).
    Fenced: (Code.ABORTED, R.STALE_LEADER),
    SegmentSealed: (Code.FAILED_PRECONDITION, R.STALE_LEADER),
    NotContiguous: (Code.FAILED_PRECONDITION, R.SEGMENT_REFUSED),  # the leader resends from the member's end
    IncarnationMismatch: (Code.FAILED_PRECONDITION, R.SEGMENT_REFUSED),  # the caller's view of a topic is not ours
    QuorumError: (Code.FAILED_PRECONDITION, R.SEGMENT_REFUSED),
    e.NotLeader: (Code.FAILED_PRECONDITION, R.NOT_LEADER),  # with the leader's address in the georep-leader trailer
    e.NotCoordinator: (Code.FAILED_PRECONDITION, R.NOT_LEADER),  # with the coordinator's address likewise
    DiskFull: (Code.RESOURCE_EXHAUSTED, R.DISK_FULL),
    OffsetOutOfRange: (Code.OUT_OF_RANGE, R.OFFSET_OUT_OF_RANGE),
    e.GeoAckTimeout: (Code.DEADLINE_EXCEEDED, R.GEO_ACK_TIMEOUT),
    e.NodeStopping: (Code.UNAVAILABLE, R.UNAVAILABLE),
    MetadataUnavailable: (Code.UNAVAILABLE, R.UNAVAILABLE),  # no Raft leader, or a commit unconfirmed: retry
    e.RecoveryFailed: (Code.UNAVAILABLE, R.UNAVAILABLE),
    e.CatalogNotSynced: (Code.UNAVAILABLE, R.UNAVAILABLE),  # retry once the upstream it names is reachable
    e.SegmentUnreadable: (Code.UNAVAILABLE, R.UNAVAILABLE),
    # a pull reached a segment this leader holds no copy of (a fetch reads it from a member instead)
    SegmentElsewhere: (Code.UNAVAILABLE, R.UNAVAILABLE),
    e.NotYetSupported: (Code.UNIMPLEMENTED, R.NOT_SUPPORTED),
    e.NotAuthorized: (Code.UNAUTHENTICATED, R.PERMISSION_DENIED),
    PermissionDenied: (Code.PERMISSION_DENIED, R.PERMISSION_DENIED),  # names the principal, operation, resource
    ForgedOrigin: (Code.PERMISSION_DENIED, R.PERMISSION_DENIED),  # a pulled batch its source cannot have received
    e.WriteFailed: (Code.INTERNAL, R.INTERNAL),
    e.FsyncFailed: (Code.INTERNAL, R.INTERNAL),
    ReplicaError: (Code.INTERNAL, R.SEGMENT_REFUSED),
}


def wire_status(exc: BaseException) -> tuple[grpc.StatusCode, Reason] | None:
    """The status code and reason for a domain error; None for anything else (a bug, answered as INTERNAL)."""
    if isinstance(exc, e.SequenceRejected):
        if isinstance(exc.decision, InvalidSequence):
            return Code.INVALID_ARGUMENT, R.INVALID_REQUEST  # fields no correct client sends: not a state to wait out
        if isinstance(exc.decision, ProducerFenced):
            return Code.FAILED_PRECONDITION, R.PRODUCER_FENCED
    for cls in type(exc).__mro__:
        found = STATUS.get(cls) if issubclass(cls, Exception) else None
        if found is not None:
            return found
    return None


def status_of(exc: BaseException) -> grpc.StatusCode | None:
    """The status code for a domain error; None for anything else (a bug, answered as INTERNAL)."""
    found = wire_status(exc)
    return None if found is None else found[0]


def reason_of(exc: BaseException) -> Reason:
    """The reason a client reads for a domain error (``INTERNAL`` for a bug)."""
    found = wire_status(exc)
    return R.INTERNAL if found is None else found[1]


DOMAIN_ERRORS: tuple[type[Exception], ...] = tuple(STATUS)
