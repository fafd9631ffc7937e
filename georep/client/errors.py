"""The client's exceptions: one per error a user can see, each saying what to do.

They are built from a gRPC status (unary calls and broken streams) or from a
``ProduceResponse.error`` (per-batch errors inside ``ProduceStream``), which
carries the same status code as a number.
"""

from __future__ import annotations

from typing import Any

import grpc

from georep.proto import georep_pb2

_CODES: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}
LEADER_METADATA = "georep-leader"  # trailing metadata of a NOT_LEADER answer: the leader's address (server/rpc.py)


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


def _looks_fenced(message: str) -> bool:
    """The node's ``ProducerFenced`` (another instance took over the producer id), not an out-of-order sequence,
    whose message names the producer and its epoch too."""
    text = message.lower()
    return "took over" in text or "fenced" in text


def _looks_too_large(message: str) -> bool:
    text = message.lower()
    return "max_batch_bytes" in text or "too large" in text or "exceeds" in text and "bytes" in text


def from_status(code: grpc.StatusCode, message: str, address: str = "", leader: str = "") -> GeorepError:
    """The exception for a gRPC status code and its details message (``leader``: a NOT_LEADER's hint)."""
    where = f" at {address}" if address else ""
    if code is grpc.StatusCode.NOT_FOUND and "is not in group" in message:
        return MemberFenced(message, code)
    if code is grpc.StatusCode.NOT_FOUND:
        return UnknownTopic(message or f"unknown topic{where}: create it with 'georep topic create'", code)
    if code is grpc.StatusCode.ALREADY_EXISTS:
        return TopicExists(message, code)
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        if _looks_too_large(message):
            return BatchTooLarge(message, code)
        return InvalidRequest(message, code)
    if code is grpc.StatusCode.DATA_LOSS:
        return CorruptData(message, code)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        if "larger than max" in message:  # gRPC's own message-size limit, before any handler ran
            return BatchTooLarge(f"the request is above the node{where}'s message size limit ({message}); nothing "
                                 "was stored: send smaller batches", code)  # fmt: skip
        return DiskFull(message, code)
    if code is grpc.StatusCode.OUT_OF_RANGE:
        return OffsetOutOfRange(message, code)
    if code is grpc.StatusCode.FAILED_PRECONDITION:
        if "does not lead" in message:
            return NotLeader(message, code, leader)
        if _looks_fenced(message):
            return ProducerFenced(message, code)
        return OutOfOrderSequence(message, code)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        detail = f" ({message})" if message else ""
        return NodeUnavailable(f"lost connection to georep node{where}{detail}: is it running? check --bootstrap", code)
    if code is grpc.StatusCode.DEADLINE_EXCEEDED and message.startswith("acks=geo"):
        return GeoAckTimeout(message, code)
    if code is grpc.StatusCode.ABORTED and "has not caught up" in message:
        return CommitsBehind(message, code)
    if code is grpc.StatusCode.ABORTED:
        return GroupRebalanced(message, code)
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return PermissionDenied(message, code)
    if code is grpc.StatusCode.UNIMPLEMENTED:
        return NotSupported(message or f"georep node{where} does not support this call", code)
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        error = NodeUnavailable(f"georep node{where} did not answer in time ({message}); retry later", code)
        return error
    return ServerError(f"georep node{where} failed with {code.name}: {message}", code)


def from_rpc_error(exc: grpc.RpcError, address: str = "") -> GeorepError:
    """The exception for a failed gRPC call (``grpc.aio.AioRpcError`` included)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    trailers: Any = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    leader = next((str(m[1]) for m in trailers or () if m[0] == LEADER_METADATA), "")
    return from_status(code or grpc.StatusCode.UNKNOWN, details or "", address, leader)


def code_of(number: int) -> grpc.StatusCode:
    return _CODES.get(number, grpc.StatusCode.UNKNOWN)


def from_produce_error(error: georep_pb2.Error, address: str = "") -> GeorepError:
    """The exception for a per-batch ``ProduceResponse.error``."""
    return from_status(code_of(error.code), error.message, address, error.leader_hint)
