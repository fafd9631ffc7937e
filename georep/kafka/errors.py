"""Domain errors to Kafka error codes: the Kafka gateway's counterpart of ``georep/server/status.py``.

Searched along the exception's class hierarchy, most specific class first. An error not in the table is
``UNKNOWN_SERVER_ERROR`` (-1), and the gateway logs it.
"""

from __future__ import annotations

from cluster.groups import IllegalGeneration, InvalidGroupRequest, NotAssigned, UnknownMember
from cluster.quorum import Fenced, SegmentSealed
from dedup.producer import InvalidSequence, OutOfOrderSequence, ProducerFenced
from georep.broker import errors as e
from georep.metadata.store import TopicExists, UnknownTopic
from georep.metadata.topics import InvalidTopic
from georep.record.batch import CorruptBatch, InvalidBatch, RecordsTooLarge
from georep.storage.api import DiskFull, OffsetOutOfRange
from offsets.commits import InvalidCommit

UNKNOWN_SERVER_ERROR = -1
OFFSET_OUT_OF_RANGE = 1
CORRUPT_MESSAGE = 2
UNKNOWN_TOPIC_OR_PARTITION = 3
MESSAGE_TOO_LARGE = 10
NOT_LEADER_OR_FOLLOWER = 6
REQUEST_TIMED_OUT = 7
COORDINATOR_LOAD_IN_PROGRESS = 14
COORDINATOR_NOT_AVAILABLE = 15
NOT_COORDINATOR = 16
INVALID_TOPIC_EXCEPTION = 17
NOT_ENOUGH_REPLICAS = 19
ILLEGAL_GENERATION = 22
INCONSISTENT_GROUP_PROTOCOL = 23
INVALID_GROUP_ID = 24
UNKNOWN_MEMBER_ID = 25
INVALID_SESSION_TIMEOUT = 26
REBALANCE_IN_PROGRESS = 27
UNSUPPORTED_VERSION = 35
TOPIC_ALREADY_EXISTS = 36
INVALID_PARTITIONS = 37
INVALID_REPLICATION_FACTOR = 38
INVALID_CONFIG = 40
INVALID_REQUEST = 42
OUT_OF_ORDER_SEQUENCE_NUMBER = 45
INVALID_PRODUCER_EPOCH = 47
KAFKA_STORAGE_ERROR = 56
NON_EMPTY_GROUP = 68
GROUP_ID_NOT_FOUND = 69
GROUP_SUBSCRIBED_TO_TOPIC = 86
TOPIC_DELETION_DISABLED = 73
TOPIC_AUTHORIZATION_FAILED = 29
GROUP_AUTHORIZATION_FAILED = 30
CLUSTER_AUTHORIZATION_FAILED = 31
INVALID_RECORD = 87
INVALID_TIMESTAMP = 32

CODES: dict[type[Exception], int] = {
    UnknownTopic: UNKNOWN_TOPIC_OR_PARTITION,
    e.UnknownPartition: UNKNOWN_TOPIC_OR_PARTITION,
    TopicExists: TOPIC_ALREADY_EXISTS,
    InvalidTopic: INVALID_TOPIC_EXCEPTION,
    e.BatchTooLarge: MESSAGE_TOO_LARGE,  # e.DecompressedTooLarge too: Kafka's answer to a batch over its limit
    e.TimestampRefused: INVALID_TIMESTAMP,
    e.InvalidRecords: INVALID_RECORD,
    e.MalformedBatch: CORRUPT_MESSAGE,
    e.BatchCrcMismatch: CORRUPT_MESSAGE,
    e.InternalTopic: INVALID_TOPIC_EXCEPTION,  # Kafka's answer to a client's write to an internal topic
    RecordsTooLarge: MESSAGE_TOO_LARGE,
    InvalidBatch: INVALID_RECORD,
    CorruptBatch: CORRUPT_MESSAGE,
    e.InvalidRequest: INVALID_REQUEST,
    e.NotCoordinator: NOT_COORDINATOR,
    e.NotLeader: NOT_LEADER_OR_FOLLOWER,
    # A leader a newer one fenced, or whose segment it sealed: Kafka producers refresh their metadata and resend.
    Fenced: NOT_LEADER_OR_FOLLOWER,
    SegmentSealed: NOT_LEADER_OR_FOLLOWER,
    e.GeoAckTimeout: REQUEST_TIMED_OUT,
    e.GeoAcksUnreachable: NOT_ENOUGH_REPLICAS,
    e.NotEnoughReplicas: NOT_ENOUGH_REPLICAS,
    e.CommitsBehind: COORDINATOR_LOAD_IN_PROGRESS,
    e.UnknownGroup: GROUP_ID_NOT_FOUND,
    e.GroupNotEmpty: NON_EMPTY_GROUP,
    e.NodeStopping: NOT_LEADER_OR_FOLLOWER,
    DiskFull: KAFKA_STORAGE_ERROR,
    e.WriteFailed: KAFKA_STORAGE_ERROR,
    e.FsyncFailed: KAFKA_STORAGE_ERROR,
    OffsetOutOfRange: OFFSET_OUT_OF_RANGE,
    UnknownMember: UNKNOWN_MEMBER_ID,
    IllegalGeneration: ILLEGAL_GENERATION,
    NotAssigned: ILLEGAL_GENERATION,  # Kafka's coordinator refuses a former owner's commit so after a rebalance
    InvalidGroupRequest: INVALID_REQUEST,
    InvalidCommit: INVALID_REQUEST,
}

SEQUENCE_CODES: dict[type[object], int] = {
    OutOfOrderSequence: OUT_OF_ORDER_SEQUENCE_NUMBER,
    ProducerFenced: INVALID_PRODUCER_EPOCH,
    InvalidSequence: OUT_OF_ORDER_SEQUENCE_NUMBER,
}


def error_code(exc: BaseException) -> int:
    code = getattr(exc, "kafka_code", None)  # the gateway's own refusals (gateway.Denied) carry theirs
    if isinstance(code, int):
        return code
    if isinstance(exc, e.SequenceRejected):
        return SEQUENCE_CODES.get(type(exc.decision), OUT_OF_ORDER_SEQUENCE_NUMBER)
    for cls in type(exc).__mro__:
        code = CODES.get(cls)
        if code is not None:
            return code
    return UNKNOWN_SERVER_ERROR
