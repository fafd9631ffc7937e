"""Domain errors to gRPC status codes: the only place that knows both.

The core raises plain exceptions (``georep/broker/errors.py`` and the errors
of the packages it builds on). A handler that catches one answers with the
code this table gives and the exception's own message, which says what to
do. The table is searched along the exception's class hierarchy, most
specific class first, so a subclass may have a code of its own.
"""

from __future__ import annotations

import grpc

from cluster.groups import IllegalGeneration, InvalidGroupRequest, NotAssigned, UnknownMember
from cluster.quorum import Fenced, NotContiguous, QuorumError, SegmentSealed
from dedup.producer import InvalidSequence
from georep.auth.acl import InvalidAcl, PermissionDenied, UnknownAcl
from georep.auth.acl_replication import ForgedOrigin
from georep.broker import errors as e
from georep.metadata.store import TopicExists, UnknownTopic
from georep.metadata.topics import InvalidTopic
from georep.raft.store import CommandTooLarge, MetadataUnavailable
from georep.record.batch import CorruptBatch, InvalidBatch
from georep.replication.sink import CorruptChunk
from georep.storage.api import BatchDamaged, DiskFull, OffsetOutOfRange
from georep.storage.chain_log import SegmentElsewhere
from georep.storage.replica_store import CorruptReplicaChunk, ReplicaError, UnknownSegment
from georep.storage.segment import UnrepairableDamage
from offsets.commits import InvalidCommit
from offsets.coordinates import InvalidOrigin
from offsets.vector import InvalidVectorOffset
from topology.ids import InvalidSiteId

Code = grpc.StatusCode

STATUS: dict[type[Exception], grpc.StatusCode] = {
    # what the caller sent is wrong
    e.InvalidRequest: Code.INVALID_ARGUMENT,
    InvalidTopic: Code.INVALID_ARGUMENT,
    InvalidCommit: Code.INVALID_ARGUMENT,
    InvalidVectorOffset: Code.INVALID_ARGUMENT,
    InvalidOrigin: Code.INVALID_ARGUMENT,
    InvalidSiteId: Code.INVALID_ARGUMENT,
    InvalidGroupRequest: Code.INVALID_ARGUMENT,
    InvalidAcl: Code.INVALID_ARGUMENT,
    CommandTooLarge: Code.INVALID_ARGUMENT,  # a metadata command over the Raft port's bound
    InvalidBatch: Code.INVALID_ARGUMENT,  # whole and CRC-valid, but not a batch georep can serve: nothing stored
    # what it names does not exist, or already does
    UnknownTopic: Code.NOT_FOUND,
    e.UnknownPartition: Code.NOT_FOUND,
    e.UnknownGroup: Code.NOT_FOUND,
    e.NoSuchLink: Code.NOT_FOUND,
    e.NotHeld: Code.NOT_FOUND,
    UnknownMember: Code.NOT_FOUND,
    UnknownSegment: Code.NOT_FOUND,
    UnknownAcl: Code.NOT_FOUND,
    TopicExists: Code.ALREADY_EXISTS,
    # bytes that fail their checksum
    e.BatchCrcMismatch: Code.DATA_LOSS,
    CorruptBatch: Code.DATA_LOSS,
    CorruptChunk: Code.DATA_LOSS,
    e.DamagedData: Code.DATA_LOSS,
    CorruptReplicaChunk: Code.DATA_LOSS,
    BatchDamaged: Code.DATA_LOSS,
    UnrepairableDamage: Code.DATA_LOSS,
    # the state of the node or of the producer forbids it
    e.SequenceRejected: Code.FAILED_PRECONDITION,
    e.GeoAcksUnreachable: Code.FAILED_PRECONDITION,
    e.NoTopology: Code.FAILED_PRECONDITION,
    e.SingleNodeSite: Code.FAILED_PRECONDITION,
    IllegalGeneration: Code.ABORTED,
    Fenced: Code.ABORTED,  # a newer leader exists: the sender stops writing
    SegmentSealed: Code.FAILED_PRECONDITION,
    NotContiguous: Code.FAILED_PRECONDITION,  # the leader reopens the stream and sends from the member's end
    QuorumError: Code.FAILED_PRECONDITION,
    e.CommitsBehind: Code.ABORTED,
    NotAssigned: Code.ABORTED,
    DiskFull: Code.RESOURCE_EXHAUSTED,
    OffsetOutOfRange: Code.OUT_OF_RANGE,
    e.GeoAckTimeout: Code.DEADLINE_EXCEEDED,
    e.NodeStopping: Code.UNAVAILABLE,
    MetadataUnavailable: Code.UNAVAILABLE,  # no Raft leader, or a commit unconfirmed: its message says to retry
    e.NotLeader: Code.FAILED_PRECONDITION,
    e.NotCoordinator: Code.FAILED_PRECONDITION,  # with the coordinator's address in the georep-leader trailer
    e.RecoveryFailed: Code.UNAVAILABLE,
    e.SegmentUnreadable: Code.UNAVAILABLE,
    e.NotYetSupported: Code.UNIMPLEMENTED,
    # a pull reached a segment this leader holds no copy of (a fetch reads it from a member instead)
    SegmentElsewhere: Code.UNAVAILABLE,
    e.NotAuthorized: Code.UNAUTHENTICATED,
    PermissionDenied: Code.PERMISSION_DENIED,  # its message names the principal, the operation and the resource
    ForgedOrigin: Code.PERMISSION_DENIED,  # a pulled batch whose origin its source cannot have received
    e.WriteFailed: Code.INTERNAL,
    e.FsyncFailed: Code.INTERNAL,
    ReplicaError: Code.INTERNAL,
}



def status_of(exc: BaseException) -> grpc.StatusCode | None:
    """The status code for a domain error; None for anything else (a bug, answered as INTERNAL)."""
    if isinstance(exc, e.SequenceRejected) and isinstance(exc.decision, InvalidSequence):
        return Code.INVALID_ARGUMENT  # fields no correct client sends: a client bug, not a state to wait out
    for cls in type(exc).__mro__:
        code = STATUS.get(cls) if issubclass(cls, Exception) else None
        if code is not None:
            return code
    return None


DOMAIN_ERRORS: tuple[type[Exception], ...] = tuple(STATUS)
