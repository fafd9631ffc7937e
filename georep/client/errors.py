"""The client's exceptions: one per error a user can see, each saying what to do, and the one table from what a
node answers to them.

A node's refusal is a gRPC status code plus a reason (``georep/proto/reasons.py``: the ``georep-reason`` trailing
metadata of a failed call, or ``Error.reason`` of a ``ProduceStream`` answer), and for some reasons a leader's
address or the offset after a damaged batch. :func:`from_status` turns them into an exception through
:data:`BY_REASON` (and :data:`BY_CODE` for the statuses gRPC makes itself, which carry no reason), then keeps only
what the :class:`Operation` can meet (:data:`SURFACES`): a produce never raises a consumer group's error, whatever a
node answers. ``retriable`` says which the client retries by itself (Kafka's ``RetriableException``): the producer
resends the batch, after asking the site who leads when a leader refused it (``NotLeader``: also a leader a newer
one fenced or sealed, Kafka's ``FENCED_LEADER_EPOCH``), and consumers and group members fetch or call again.
``tests/test_error_table.py`` walks every domain error of a node through both tables, for every operation.
"""

from __future__ import annotations

import enum
from typing import Any

import grpc

from georep.proto import georep_pb2
from georep.proto.reasons import LEADER_METADATA, NEXT_OFFSET_METADATA, REASON_METADATA, Reason

_CODES: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


class Operation(enum.Enum):
    """What the client was doing: the errors an application can meet depend on it."""

    PRODUCE = "produce"  # Produce, ProduceStream, and the producer's DescribeTopic
    FETCH = "fetch"  # a consumer's Fetch and DescribeTopic
    GROUP = "group"  # a group member's or a group command's calls: heartbeats, commits, committed positions
    ADMIN = "admin"  # topics, offsets, links, ACLs, health and status


class GeorepError(Exception):
    """Base class of every error the georep client raises."""

    retriable = False

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class UnknownTopic(GeorepError):
    """The topic does not exist on the node (create it with ``georep topic create``)."""


class TopicExists(GeorepError):
    """``create_topic`` for a name that is already taken."""


class InvalidRequest(GeorepError):
    """The node rejected a request as malformed: bad name, partition count or arguments."""


class BatchTooLarge(InvalidRequest):
    """A batch is larger than the node's ``max_batch_bytes``."""


class RecordTooLarge(BatchTooLarge):
    """One record alone is larger than its topic's ``max_batch_bytes``: refused before it is sent."""


class CorruptData(GeorepError):
    """A batch failed its CRC-32C check (on the node, or in the client after a fetch)."""


class DamagedData(CorruptData):
    """The node holds these records damaged and quarantined until a peer's copy repairs them.

    ``next_offset`` is where readable data goes on at that node. The consumer
    keeps retrying (the repair may come); ``skip_corrupt=True`` skips instead.
    """

    def __init__(self, message: str, code: grpc.StatusCode | None = None, next_offset: int = -1) -> None:
        super().__init__(message, code)
        self.next_offset = next_offset


class InvalidData(CorruptData):
    """A fetched batch whose CRC is valid but whose records are not (a site stored it without validating it,
    before georep validated batches). ``next_offset`` is where the log goes on after it; ``skip_corrupt=True``
    skips it."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None, next_offset: int = -1) -> None:
        super().__init__(message, code)
        self.next_offset = next_offset


class DiskFull(GeorepError):
    """The node's disk is full; nothing of the batch was written."""


class OffsetOutOfRange(GeorepError):
    """A fetch offset lies outside ``[log_start_offset, log_end_offset]``."""


class OutOfOrderSequence(GeorepError):
    """The node saw a gap in this producer's sequence: records may have been lost."""


class ProducerFenced(GeorepError):
    """A newer producer epoch with the same id exists; this producer must stop."""


class NodeUnavailable(GeorepError):
    """No node could be reached, or the connection broke."""

    retriable = True


class NotLeader(GeorepError):
    """The node does not lead the partition (a multi-node site): ``leader`` is the address to use, if known. The
    client follows it and retries; the idempotent producer makes the retry safe."""

    retriable = True

    def __init__(self, message: str, code: grpc.StatusCode | None = None, leader: str = "") -> None:
        super().__init__(message, code)
        self.leader = leader


class NotSupported(GeorepError):
    """The site does not run this feature (yet); the message says what to use instead."""


class DeliveryTimeout(GeorepError):
    """A batch was not acknowledged within ``delivery_timeout_ms``; it may or may not be stored."""


class GeoAckTimeout(GeorepError):
    """``acks=geo:N`` was not reached in time. The write is stored at the site
    that took it and replicates later; only the promise that N sites hold it
    now could not be kept."""


class GroupRebalanced(GeorepError):
    """A commit made under an old generation, or for a partition no longer
    assigned to this member: the group rebalanced."""


class CommitsBehind(GeorepError):
    """The site has not caught up with the group's commits that a live upstream holds: ask again shortly.
    A group member does so by itself at its next heartbeat."""

    retriable = True


class UnknownGroup(GeorepError):
    """A group the site has neither members nor commits of."""


class UnknownLink(GeorepError):
    """A link the node's topology does not have (``georep link``): check the link's source and destination."""


class UnknownAcl(GeorepError):
    """An ACL entry to remove that the site does not hold: ``georep acl list`` shows the entries."""


class GeoAcksUnreachable(InvalidRequest):
    """``acks=geo:N`` with more sites than the topic's records can reach from the site written to."""


class MemberFenced(GeorepError):
    """The group no longer knows this member (its session expired): it must rejoin."""


class TlsRefused(GeorepError):
    """The TLS handshake with a node failed: no client certificate where the node wants one, a certificate the
    node does not trust (or the client does not trust the node's), or TLS against a plaintext node."""


class PermissionDenied(GeorepError):
    """A call the node refused: an admin call without its admin token (a plaintext node), or a call the
    certificate's principal is not allowed to make (a TLS node's ACLs, docs/security.md); the message names the
    principal, the operation and the resource, and the 'georep acl add' that would allow it."""


class ProducerClosed(GeorepError):
    """``send`` on a producer that is closing or closed."""


class ServerError(GeorepError):
    """A status the client has no specific meaning for (INTERNAL, UNKNOWN, ...)."""


# What a node's reason means to a client. Every reason a node sends has a row (tests/test_error_table.py).
BY_REASON: dict[Reason, type[GeorepError]] = {
    Reason.INVALID_REQUEST: InvalidRequest,
    Reason.BATCH_TOO_LARGE: BatchTooLarge,
    Reason.UNKNOWN_TOPIC: UnknownTopic,
    Reason.UNKNOWN_GROUP: UnknownGroup,
    Reason.UNKNOWN_MEMBER: MemberFenced,
    Reason.UNKNOWN_LINK: UnknownLink,
    Reason.UNKNOWN_ACL: UnknownAcl,
    Reason.NOT_HELD: ServerError,  # FetchBatch, between sites
    Reason.TOPIC_EXISTS: TopicExists,
    Reason.CORRUPT: CorruptData,
    Reason.DAMAGED: DamagedData,
    Reason.OUT_OF_ORDER_SEQUENCE: OutOfOrderSequence,
    Reason.PRODUCER_FENCED: ProducerFenced,
    Reason.GEO_ACKS_UNREACHABLE: GeoAcksUnreachable,
    Reason.GEO_ACK_TIMEOUT: GeoAckTimeout,
    Reason.GROUP_REBALANCED: GroupRebalanced,
    Reason.COMMITS_BEHIND: CommitsBehind,
    Reason.NOT_LEADER: NotLeader,
    Reason.STALE_LEADER: NotLeader,  # a newer leader fenced or sealed the node's segment: ask who leads, resend
    Reason.UNAVAILABLE: NodeUnavailable,
    Reason.DISK_FULL: DiskFull,
    Reason.OFFSET_OUT_OF_RANGE: OffsetOutOfRange,
    Reason.NOT_SUPPORTED: NotSupported,
    Reason.NOT_A_CLUSTER: NotSupported,
    Reason.PERMISSION_DENIED: PermissionDenied,
    Reason.INTERNAL: ServerError,
    Reason.SEGMENT_REFUSED: ServerError,  # the Segments service, between the nodes of a site
}

# Statuses gRPC makes itself (a connection lost, a deadline, a message over the size limit, a method the node does
# not have, a refused certificate): no handler ran, so no reason came with them.
BY_CODE: dict[grpc.StatusCode, type[GeorepError]] = {
    grpc.StatusCode.UNAVAILABLE: NodeUnavailable,
    grpc.StatusCode.CANCELLED: NodeUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: NodeUnavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: BatchTooLarge,
    grpc.StatusCode.UNIMPLEMENTED: NotSupported,
    grpc.StatusCode.UNAUTHENTICATED: PermissionDenied,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}

_ANY = (InvalidRequest, NotLeader, NodeUnavailable, NotSupported, PermissionDenied, ServerError)
# What each operation can meet; any other answer is a node's bug to this client and surfaces as a ServerError.
SURFACES: dict[Operation, frozenset[type[GeorepError]]] = {
    Operation.PRODUCE: frozenset(
        {
            *_ANY,
            BatchTooLarge,
            GeoAcksUnreachable,
            UnknownTopic,
            CorruptData,
            OutOfOrderSequence,
            ProducerFenced,
            GeoAckTimeout,
            DiskFull,
        }
    ),
    Operation.FETCH: frozenset({*_ANY, UnknownTopic, CorruptData, DamagedData, OffsetOutOfRange}),
    Operation.GROUP: frozenset(
        {
            *_ANY,
            UnknownTopic,
            UnknownGroup,
            MemberFenced,
            GroupRebalanced,
            CommitsBehind,
            GeoAcksUnreachable,
            GeoAckTimeout,
            DiskFull,
        }
    ),
    Operation.ADMIN: frozenset({*_ANY, UnknownTopic, UnknownGroup, UnknownLink, UnknownAcl, TopicExists, DiskFull}),
}


def error_class(operation: Operation, code: grpc.StatusCode, reason: str) -> type[GeorepError]:
    """The exception class an application doing ``operation`` sees for a node's answer ``code`` and ``reason``."""
    try:
        cls = BY_REASON[Reason(reason)]
    except ValueError:  # no reason (gRPC's own status), or one this client does not know: by the code alone
        cls = BY_CODE.get(code, ServerError)
    return cls if cls in SURFACES[operation] else ServerError


def from_status(
    operation: Operation,
    code: grpc.StatusCode,
    message: str,
    reason: str = "",
    address: str = "",
    leader: str = "",
    next_offset: int = -1,
) -> GeorepError:
    """The exception for a node's answer: its status ``code``, details ``message`` and ``reason``, and what its
    trailers add (``leader``: a NOT_LEADER's hint; ``next_offset``: where readable data goes on after damage)."""
    where = f" at {address}" if address else ""
    cls = error_class(operation, code, reason)
    if cls is NotLeader:
        return NotLeader(message, code, leader)
    if cls is DamagedData:
        return DamagedData(message, code, next_offset)
    if cls is NodeUnavailable and not reason:  # gRPC's own: the node did not answer (a node's refusal says why)
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return NodeUnavailable(f"georep node{where} did not answer in time ({message}); retry later", code)
        detail = f" ({message})" if message else ""
        return NodeUnavailable(f"lost connection to georep node{where}{detail}: is it running? check --bootstrap", code)
    if cls is BatchTooLarge and code is grpc.StatusCode.RESOURCE_EXHAUSTED and not reason:
        return BatchTooLarge(
            f"the request is above the node{where}'s message size limit ({message}); nothing "
            "was stored: send smaller batches",
            code,
        )
    if cls is UnknownTopic and not message:
        return UnknownTopic(f"unknown topic{where}: create it with 'georep topic create'", code)
    if cls is NotSupported and not message:
        return NotSupported(f"georep node{where} does not support this call", code)
    if cls is ServerError:
        because = f" ({reason})" if reason else ""
        return ServerError(f"georep node{where} failed a {operation.value} with {code.name}{because}: {message}", code)
    return cls(message, code)


def _trailer(trailers: Any, key: str) -> str:
    return next((str(m[1]) for m in trailers or () if m[0] == key), "")


def from_rpc_error(exc: grpc.RpcError, address: str = "", *, operation: Operation) -> GeorepError:
    """The exception for a failed gRPC call (``grpc.aio.AioRpcError`` included) made for ``operation``."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    trailers: Any = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    try:
        next_offset = int(_trailer(trailers, NEXT_OFFSET_METADATA) or -1)
    except ValueError:
        next_offset = -1
    return from_status(
        operation,
        code or grpc.StatusCode.UNKNOWN,
        details or "",
        _trailer(trailers, REASON_METADATA),
        address,
        _trailer(trailers, LEADER_METADATA),
        next_offset,
    )


def code_of(number: int) -> grpc.StatusCode:
    return _CODES.get(number, grpc.StatusCode.UNKNOWN)


def from_produce_error(error: georep_pb2.Error, address: str = "") -> GeorepError:
    """The exception for a per-batch ``ProduceResponse.error``."""
    return from_status(Operation.PRODUCE, code_of(error.code), error.message, error.reason, address, error.leader_hint)
