"""Every domain error a node raises, through both tables: the node's (``georep/server/status.py``: class -> status
code and reason) and the client's (``georep/client/errors.py``: code and reason -> the exception an application
sees), for each operation a client makes, and whether the client retries it by itself.

The expectations are written out here, one row per domain error, so a change to either table shows up as a
changed row: an application's ``except`` clauses depend on them."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from cluster.groups import IllegalGeneration, InvalidGroupRequest, NotAssigned, UnknownMember
from cluster.quorum import Fenced, NotContiguous, QuorumError, SegmentSealed
from dedup.producer import InvalidSequence
from dedup.producer import OutOfOrderSequence as Gap
from dedup.producer import ProducerFenced as Zombie
from georep.auth.acl import InvalidAcl, PermissionDenied, UnknownAcl
from georep.auth.acl_replication import ForgedOrigin
from georep.broker import errors as e
from georep.client import errors as c
from georep.client.accumulator import ProducerBatch
from georep.client.delivery import PartitionDelivery
from georep.client.errors import Operation
from georep.metadata.store import TopicExists, UnknownTopic
from georep.metadata.topics import InvalidTopic
from georep.proto import georep_pb2 as pb
from georep.proto.reasons import LEADER_METADATA, NEXT_OFFSET_METADATA, REASON_METADATA, Reason
from georep.raft.store import CommandTooLarge, MetadataUnavailable
from georep.record.batch import CorruptBatch, InvalidBatch
from georep.replication.sink import CorruptChunk
from georep.server import rpc
from georep.server.status import STATUS, wire_status
from georep.storage.api import BatchDamaged, DiskFull, OffsetOutOfRange
from georep.storage.chain_log import SegmentElsewhere
from georep.storage.replica_store import CorruptReplicaChunk, IncarnationMismatch, ReplicaError, UnknownSegment
from georep.storage.segment import UnrepairableDamage
from offsets.commits import InvalidCommit
from offsets.coordinates import InvalidOrigin
from offsets.vector import InvalidVectorOffset
from topology.ids import InvalidSiteId

P, F, G, A = Operation.PRODUCE, Operation.FETCH, Operation.GROUP, Operation.ADMIN
OPS = (P, F, G, A)
SE = c.ServerError  # a node's answer the operation never meets: surfaced as the node's failure, never retried


def same(cls: type[c.GeorepError]) -> tuple[type[c.GeorepError], ...]:
    return (cls, cls, cls, cls)


# domain error -> what a producer, a consumer's fetch, a group member and an admin call see
EXPECTED: dict[type[Exception], tuple[type[c.GeorepError], ...]] = {
    e.InvalidRequest: same(c.InvalidRequest),
    e.BatchTooLarge: (c.BatchTooLarge, SE, SE, SE),
    InvalidTopic: same(c.InvalidRequest),
    InvalidCommit: same(c.InvalidRequest),
    InvalidVectorOffset: same(c.InvalidRequest),
    InvalidOrigin: same(c.InvalidRequest),
    InvalidSiteId: same(c.InvalidRequest),
    InvalidGroupRequest: same(c.InvalidRequest),
    InvalidAcl: same(c.InvalidRequest),
    CommandTooLarge: same(c.InvalidRequest),
    InvalidBatch: same(c.InvalidRequest),
    UnknownTopic: same(c.UnknownTopic),
    e.UnknownPartition: same(c.UnknownTopic),
    e.UnknownGroup: (SE, SE, c.UnknownGroup, c.UnknownGroup),
    e.NoSuchLink: (SE, SE, SE, c.UnknownLink),
    e.NotHeld: same(SE),
    UnknownMember: (SE, SE, c.MemberFenced, SE),
    UnknownSegment: same(SE),
    UnknownAcl: (SE, SE, SE, c.UnknownAcl),
    TopicExists: (SE, SE, SE, c.TopicExists),
    e.BatchCrcMismatch: (c.CorruptData, c.CorruptData, SE, SE),
    CorruptBatch: (c.CorruptData, c.CorruptData, SE, SE),
    CorruptChunk: (c.CorruptData, c.CorruptData, SE, SE),
    e.DamagedData: (SE, c.DamagedData, SE, SE),
    CorruptReplicaChunk: same(SE),
    BatchDamaged: (SE, c.DamagedData, SE, SE),
    UnrepairableDamage: (c.CorruptData, c.CorruptData, SE, SE),
    e.SequenceRejected: (c.OutOfOrderSequence, SE, SE, SE),
    e.GeoAcksUnreachable: (c.GeoAcksUnreachable, SE, c.GeoAcksUnreachable, SE),
    e.NoTopology: same(c.NotSupported),
    e.SingleNodeSite: same(c.NotSupported),
    e.TopicDeleteRefused: same(c.NotSupported),
    e.GroupNotEmpty: same(c.InvalidRequest),  # the message says: stop the group's consumers first
    IllegalGeneration: (SE, SE, c.GroupRebalanced, SE),
    NotAssigned: (SE, SE, c.GroupRebalanced, SE),
    e.CommitsBehind: (SE, SE, c.CommitsBehind, SE),
    Fenced: same(c.NotLeader),  # a leader that a newer one fenced: ask who leads, send there
    SegmentSealed: same(c.NotLeader),
    NotContiguous: same(SE),
    IncarnationMismatch: same(SE),  # a member's answer to a leader or repair whose view of a topic is not its own
    QuorumError: same(SE),
    e.NotLeader: same(c.NotLeader),
    e.NotCoordinator: same(c.NotLeader),
    DiskFull: (c.DiskFull, SE, c.DiskFull, c.DiskFull),
    OffsetOutOfRange: (SE, c.OffsetOutOfRange, SE, SE),
    e.GeoAckTimeout: (c.GeoAckTimeout, SE, c.GeoAckTimeout, SE),
    e.NodeStopping: same(c.NodeUnavailable),
    e.NotEnoughReplicas: same(c.NodeUnavailable),  # fewer live nodes than the topic's min_insync_replicas: retried
    MetadataUnavailable: same(c.NodeUnavailable),
    e.RecoveryFailed: same(c.NodeUnavailable),
    e.CatalogNotSynced: same(c.NodeUnavailable),
    e.SegmentUnreadable: same(c.NodeUnavailable),
    SegmentElsewhere: same(c.NodeUnavailable),
    e.NotYetSupported: same(c.NotSupported),
    e.NotAuthorized: same(c.PermissionDenied),
    PermissionDenied: same(c.PermissionDenied),
    ForgedOrigin: same(c.PermissionDenied),
    e.WriteFailed: same(SE),
    e.FsyncFailed: same(SE),
    ReplicaError: same(SE),
}
RETRIED = {c.NotLeader, c.NodeUnavailable, c.CommitsBehind}  # the client asks again by itself
GROUP_ERRORS = {c.GroupRebalanced, c.MemberFenced, c.CommitsBehind, c.UnknownGroup}


def instance(cls: type[Exception]) -> Exception:
    """An instance of ``cls`` with a message (the tables look only at the class, and a rejected sequence's
    decision)."""
    exc = cls.__new__(cls)
    Exception.__init__(exc, f"a {cls.__name__}")
    if isinstance(exc, e.SequenceRejected):
        exc.decision = Gap(expected=5, got=7, producer_id=1, producer_epoch=0)
    if isinstance(exc, e.DamagedData):
        exc.next_offset = 42
    if isinstance(exc, e.NotLeader):
        exc.leader_hint = "127.0.0.1:7102"
    if isinstance(exc, Fenced):
        exc.fenced_epoch = 3
    return exc


class FailedCall(grpc.RpcError):
    """What grpc.aio raises for a call a handler ended with ``rpc.abort``."""

    def __init__(self, code: grpc.StatusCode, details: str, trailers: tuple[tuple[str, str], ...]) -> None:
        self._code, self._details, self._trailers = code, details, trailers

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Any:
        return self._trailers


def seen(exc: Exception, operation: Operation) -> c.GeorepError:
    """What a client doing ``operation`` sees of a node's ``exc``, through the node's own trailers."""
    return c.from_rpc_error(FailedCall(rpc.status(exc), str(exc), rpc._trailers(exc)), "h:1", operation=operation)


def test_every_domain_error_has_one_row_and_every_reason_one_meaning() -> None:
    assert set(EXPECTED) == set(STATUS)
    assert set(c.BY_REASON) == set(Reason)


@pytest.mark.parametrize("cls", list(EXPECTED), ids=lambda cls: cls.__name__)
def test_a_domain_error_reaches_each_operation_as_its_row_says(cls: type[Exception]) -> None:
    exc = instance(cls)
    for operation, expected in zip(OPS, EXPECTED[cls], strict=True):
        error = seen(exc, operation)
        assert type(error) is expected, f"{cls.__name__} seen by a {operation.value}: {type(error).__name__}"
        assert error.retriable == (expected in RETRIED), f"{cls.__name__} seen by a {operation.value}"
        assert type(error) in c.SURFACES[operation]
        if expected is not SE:
            assert error.message == str(exc), "the node's message, which says what to do, reaches the application"


def test_a_produce_never_surfaces_a_consumer_groups_error() -> None:
    for cls in EXPECTED:
        for reason in Reason:
            for code in grpc.StatusCode:
                assert type(c.from_status(P, code, "", str(reason))) not in GROUP_ERRORS, (cls, reason, code)


@pytest.mark.parametrize("cls", list(EXPECTED), ids=lambda cls: cls.__name__)
def test_the_producer_resends_what_is_retriable_and_fails_only_the_rest(cls: type[Exception]) -> None:
    """The producer's own delivery state machine: a retriable answer (a stale leader's included) resends the batch
    with the same bytes; an out-of-order answer waits for its round; anything else fails the batch."""
    code, reason = wire_status(instance(cls)) or (grpc.StatusCode.INTERNAL, "")
    error = c.from_produce_error(pb.Error(code=code.value[0], message="m", reason=reason))
    delivery = PartitionDelivery("t", 0, 1, 5)
    delivery.enqueue(ProducerBatch("t", 0, 0.0, 1 << 10))
    (batch,) = delivery.take_sendable()
    failed = delivery.on_error(batch, error, 0.0, 100)
    assert failed == (not error.retriable and not isinstance(error, c.OutOfOrderSequence)), cls.__name__
    if error.retriable:
        assert delivery.resolve(2) == [] and delivery.take_sendable() == [batch], "resent, same sequence"
        assert batch.base_sequence == 0


def test_the_decision_inside_a_refused_sequence_decides_the_error() -> None:
    fenced = e.SequenceRejected(Zombie(current_epoch=3, got=2, producer_id=7))
    invalid = e.SequenceRejected(InvalidSequence("bad", 7, -1, 0, 1))
    assert type(seen(fenced, P)) is c.ProducerFenced
    assert type(seen(invalid, P)) is c.InvalidRequest
    assert type(seen(e.SequenceRejected(Gap(5, 7, 1, 0)), P)) is c.OutOfOrderSequence


def test_trailers_carry_the_leader_and_where_readable_data_goes_on() -> None:
    not_leader = seen(e.NotLeader("t", 0, "moved", leader_hint="127.0.0.1:7102"), P)
    assert isinstance(not_leader, c.NotLeader) and not_leader.leader == "127.0.0.1:7102"
    damaged = seen(instance(e.DamagedData), F)
    assert isinstance(damaged, c.DamagedData) and damaged.next_offset == 42
    trailers = dict(rpc._trailers(instance(Fenced)))
    assert trailers[REASON_METADATA] == Reason.STALE_LEADER and "georep-fenced-epoch" in trailers
    assert LEADER_METADATA not in trailers and NEXT_OFFSET_METADATA not in trailers


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (grpc.StatusCode.UNAVAILABLE, c.NodeUnavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, c.NodeUnavailable),
        (grpc.StatusCode.CANCELLED, c.NodeUnavailable),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, c.BatchTooLarge),  # the message size limit, before any handler
        (grpc.StatusCode.ABORTED, c.ServerError),  # never a group's error without the node saying so
        (grpc.StatusCode.INTERNAL, c.ServerError),
    ],
)
def test_a_status_grpc_made_itself_has_no_reason_and_is_read_by_its_code(
    code: grpc.StatusCode, expected: type[c.GeorepError]
) -> None:
    error = c.from_rpc_error(FailedCall(code, "details", ()), "h:1", operation=P)
    assert type(error) is expected


def test_the_kafka_front_end_answers_a_stale_leader_as_kafka_producers_retry() -> None:
    from georep.kafka import errors as k

    for cls in (Fenced, SegmentSealed, e.NotLeader):
        assert k.error_code(instance(cls)) == k.NOT_LEADER_OR_FOLLOWER, cls.__name__
