from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Acks(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACKS_LEADER: _ClassVar[Acks]
    ACKS_ALL: _ClassVar[Acks]
    ACKS_GEO: _ClassVar[Acks]

class StartPosition(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    START_EARLIEST: _ClassVar[StartPosition]
    START_LATEST: _ClassVar[StartPosition]
ACKS_LEADER: Acks
ACKS_ALL: Acks
ACKS_GEO: Acks
START_EARLIEST: StartPosition
START_LATEST: StartPosition

class Error(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class OriginSeq(_message.Message):
    __slots__ = ("site", "epoch", "next_seq")
    SITE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    site: str
    epoch: int
    next_seq: int
    def __init__(self, site: _Optional[str] = ..., epoch: _Optional[int] = ..., next_seq: _Optional[int] = ...) -> None: ...

class VectorOffset(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[OriginSeq]
    def __init__(self, entries: _Optional[_Iterable[_Union[OriginSeq, _Mapping]]] = ...) -> None: ...

class CreateTopicRequest(_message.Message):
    __slots__ = ("name", "partitions", "config")
    class ConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    name: str
    partitions: int
    config: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., partitions: _Optional[int] = ..., config: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ListTopicsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTopicsResponse(_message.Message):
    __slots__ = ("topics",)
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    topics: _containers.RepeatedCompositeFieldContainer[TopicDescription]
    def __init__(self, topics: _Optional[_Iterable[_Union[TopicDescription, _Mapping]]] = ...) -> None: ...

class DescribeTopicRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class PartitionState(_message.Message):
    __slots__ = ("partition", "log_start_offset", "log_end_offset", "size_bytes", "segments", "vector")
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    LOG_START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LOG_END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    VECTOR_FIELD_NUMBER: _ClassVar[int]
    partition: int
    log_start_offset: int
    log_end_offset: int
    size_bytes: int
    segments: int
    vector: VectorOffset
    def __init__(self, partition: _Optional[int] = ..., log_start_offset: _Optional[int] = ..., log_end_offset: _Optional[int] = ..., size_bytes: _Optional[int] = ..., segments: _Optional[int] = ..., vector: _Optional[_Union[VectorOffset, _Mapping]] = ...) -> None: ...

class TopicDescription(_message.Message):
    __slots__ = ("name", "partitions", "config", "partition_states")
    class ConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    PARTITION_STATES_FIELD_NUMBER: _ClassVar[int]
    name: str
    partitions: int
    config: _containers.ScalarMap[str, str]
    partition_states: _containers.RepeatedCompositeFieldContainer[PartitionState]
    def __init__(self, name: _Optional[str] = ..., partitions: _Optional[int] = ..., config: _Optional[_Mapping[str, str]] = ..., partition_states: _Optional[_Iterable[_Union[PartitionState, _Mapping]]] = ...) -> None: ...

class ProduceRequest(_message.Message):
    __slots__ = ("correlation_id", "topic", "partition", "batch", "acks", "geo_sites", "ack_timeout_ms")
    CORRELATION_ID_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    ACKS_FIELD_NUMBER: _ClassVar[int]
    GEO_SITES_FIELD_NUMBER: _ClassVar[int]
    ACK_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    correlation_id: int
    topic: str
    partition: int
    batch: bytes
    acks: Acks
    geo_sites: int
    ack_timeout_ms: int
    def __init__(self, correlation_id: _Optional[int] = ..., topic: _Optional[str] = ..., partition: _Optional[int] = ..., batch: _Optional[bytes] = ..., acks: _Optional[_Union[Acks, str]] = ..., geo_sites: _Optional[int] = ..., ack_timeout_ms: _Optional[int] = ...) -> None: ...

class ProduceResponse(_message.Message):
    __slots__ = ("correlation_id", "partition", "base_offset", "origin_site", "origin_epoch", "base_origin_seq", "last_origin_seq", "append_time_ms", "duplicate", "error")
    CORRELATION_ID_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    BASE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_SITE_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    BASE_ORIGIN_SEQ_FIELD_NUMBER: _ClassVar[int]
    LAST_ORIGIN_SEQ_FIELD_NUMBER: _ClassVar[int]
    APPEND_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    correlation_id: int
    partition: int
    base_offset: int
    origin_site: str
    origin_epoch: int
    base_origin_seq: int
    last_origin_seq: int
    append_time_ms: int
    duplicate: bool
    error: Error
    def __init__(self, correlation_id: _Optional[int] = ..., partition: _Optional[int] = ..., base_offset: _Optional[int] = ..., origin_site: _Optional[str] = ..., origin_epoch: _Optional[int] = ..., base_origin_seq: _Optional[int] = ..., last_origin_seq: _Optional[int] = ..., append_time_ms: _Optional[int] = ..., duplicate: _Optional[bool] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("topic", "partition", "offset", "vector", "position", "max_bytes", "max_wait_ms", "hint_origin", "hint_offset")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    VECTOR_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    HINT_ORIGIN_FIELD_NUMBER: _ClassVar[int]
    HINT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    offset: int
    vector: VectorOffset
    position: StartPosition
    max_bytes: int
    max_wait_ms: int
    hint_origin: str
    hint_offset: int
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., offset: _Optional[int] = ..., vector: _Optional[_Union[VectorOffset, _Mapping]] = ..., position: _Optional[_Union[StartPosition, str]] = ..., max_bytes: _Optional[int] = ..., max_wait_ms: _Optional[int] = ..., hint_origin: _Optional[str] = ..., hint_offset: _Optional[int] = ...) -> None: ...

class FetchResponse(_message.Message):
    __slots__ = ("batches", "high_watermark", "log_start_offset", "next_offset")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    HIGH_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    LOG_START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NEXT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    batches: bytes
    high_watermark: int
    log_start_offset: int
    next_offset: int
    def __init__(self, batches: _Optional[bytes] = ..., high_watermark: _Optional[int] = ..., log_start_offset: _Optional[int] = ..., next_offset: _Optional[int] = ...) -> None: ...

class ListOffsetsRequest(_message.Message):
    __slots__ = ("topic", "partition", "position", "timestamp_ms")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    position: StartPosition
    timestamp_ms: int
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., position: _Optional[_Union[StartPosition, str]] = ..., timestamp_ms: _Optional[int] = ...) -> None: ...

class PartitionOffset(_message.Message):
    __slots__ = ("partition", "offset", "timestamp_ms")
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    partition: int
    offset: int
    timestamp_ms: int
    def __init__(self, partition: _Optional[int] = ..., offset: _Optional[int] = ..., timestamp_ms: _Optional[int] = ...) -> None: ...

class ListOffsetsResponse(_message.Message):
    __slots__ = ("offsets",)
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    offsets: _containers.RepeatedCompositeFieldContainer[PartitionOffset]
    def __init__(self, offsets: _Optional[_Iterable[_Union[PartitionOffset, _Mapping]]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("status", "site", "epoch", "version", "uptime_ms", "disk_full")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_MS_FIELD_NUMBER: _ClassVar[int]
    DISK_FULL_FIELD_NUMBER: _ClassVar[int]
    status: str
    site: str
    epoch: int
    version: str
    uptime_ms: int
    disk_full: bool
    def __init__(self, status: _Optional[str] = ..., site: _Optional[str] = ..., epoch: _Optional[int] = ..., version: _Optional[str] = ..., uptime_ms: _Optional[int] = ..., disk_full: _Optional[bool] = ...) -> None: ...

class PullWant(_message.Message):
    __slots__ = ("topic", "partition", "have", "origin_sites")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    HAVE_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_SITES_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    have: VectorOffset
    origin_sites: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., have: _Optional[_Union[VectorOffset, _Mapping]] = ..., origin_sites: _Optional[_Iterable[str]] = ...) -> None: ...

class ReplicateRequest(_message.Message):
    __slots__ = ("dst_site", "wants", "max_bytes", "max_wait_ms")
    DST_SITE_FIELD_NUMBER: _ClassVar[int]
    WANTS_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    dst_site: str
    wants: _containers.RepeatedCompositeFieldContainer[PullWant]
    max_bytes: int
    max_wait_ms: int
    def __init__(self, dst_site: _Optional[str] = ..., wants: _Optional[_Iterable[_Union[PullWant, _Mapping]]] = ..., max_bytes: _Optional[int] = ..., max_wait_ms: _Optional[int] = ...) -> None: ...

class ReplicaChunk(_message.Message):
    __slots__ = ("topic", "partition", "batches", "src_vector", "src_log_end_offset")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    SRC_VECTOR_FIELD_NUMBER: _ClassVar[int]
    SRC_LOG_END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    batches: bytes
    src_vector: VectorOffset
    src_log_end_offset: int
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., batches: _Optional[bytes] = ..., src_vector: _Optional[_Union[VectorOffset, _Mapping]] = ..., src_log_end_offset: _Optional[int] = ...) -> None: ...

class ReplicateResponse(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[ReplicaChunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[ReplicaChunk, _Mapping]]] = ...) -> None: ...

class SiteStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OriginLag(_message.Message):
    __slots__ = ("origin", "upstream", "lag_records", "lag_ms", "lag_bytes")
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_FIELD_NUMBER: _ClassVar[int]
    LAG_RECORDS_FIELD_NUMBER: _ClassVar[int]
    LAG_MS_FIELD_NUMBER: _ClassVar[int]
    LAG_BYTES_FIELD_NUMBER: _ClassVar[int]
    origin: str
    upstream: str
    lag_records: int
    lag_ms: int
    lag_bytes: int
    def __init__(self, origin: _Optional[str] = ..., upstream: _Optional[str] = ..., lag_records: _Optional[int] = ..., lag_ms: _Optional[int] = ..., lag_bytes: _Optional[int] = ...) -> None: ...

class PartitionStatus(_message.Message):
    __slots__ = ("topic", "partition", "vector", "log_end_offset", "lags")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    VECTOR_FIELD_NUMBER: _ClassVar[int]
    LOG_END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LAGS_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    vector: VectorOffset
    log_end_offset: int
    lags: _containers.RepeatedCompositeFieldContainer[OriginLag]
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., vector: _Optional[_Union[VectorOffset, _Mapping]] = ..., log_end_offset: _Optional[int] = ..., lags: _Optional[_Iterable[_Union[OriginLag, _Mapping]]] = ...) -> None: ...

class LinkStatus(_message.Message):
    __slots__ = ("src", "dst", "state", "applied_batches", "applied_bytes", "skipped_batches", "last_error")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    APPLIED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    APPLIED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    src: str
    dst: str
    state: str
    applied_batches: int
    applied_bytes: int
    skipped_batches: int
    last_error: str
    def __init__(self, src: _Optional[str] = ..., dst: _Optional[str] = ..., state: _Optional[str] = ..., applied_batches: _Optional[int] = ..., applied_bytes: _Optional[int] = ..., skipped_batches: _Optional[int] = ..., last_error: _Optional[str] = ...) -> None: ...

class TopicConflict(_message.Message):
    __slots__ = ("topic", "message")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    topic: str
    message: str
    def __init__(self, topic: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class SiteStatusResponse(_message.Message):
    __slots__ = ("site", "epoch", "partitions", "links", "conflicts")
    SITE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    CONFLICTS_FIELD_NUMBER: _ClassVar[int]
    site: str
    epoch: int
    partitions: _containers.RepeatedCompositeFieldContainer[PartitionStatus]
    links: _containers.RepeatedCompositeFieldContainer[LinkStatus]
    conflicts: _containers.RepeatedCompositeFieldContainer[TopicConflict]
    def __init__(self, site: _Optional[str] = ..., epoch: _Optional[int] = ..., partitions: _Optional[_Iterable[_Union[PartitionStatus, _Mapping]]] = ..., links: _Optional[_Iterable[_Union[LinkStatus, _Mapping]]] = ..., conflicts: _Optional[_Iterable[_Union[TopicConflict, _Mapping]]] = ...) -> None: ...

class SetLinkRequest(_message.Message):
    __slots__ = ("src", "enabled")
    SRC_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    src: str
    enabled: bool
    def __init__(self, src: _Optional[str] = ..., enabled: _Optional[bool] = ...) -> None: ...

class SetLinkResponse(_message.Message):
    __slots__ = ("src", "dst", "enabled", "state")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    src: str
    dst: str
    enabled: bool
    state: str
    def __init__(self, src: _Optional[str] = ..., dst: _Optional[str] = ..., enabled: _Optional[bool] = ..., state: _Optional[str] = ...) -> None: ...

class HeldEntry(_message.Message):
    __slots__ = ("site", "topic", "partition", "vector")
    SITE_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    VECTOR_FIELD_NUMBER: _ClassVar[int]
    site: str
    topic: str
    partition: int
    vector: VectorOffset
    def __init__(self, site: _Optional[str] = ..., topic: _Optional[str] = ..., partition: _Optional[int] = ..., vector: _Optional[_Union[VectorOffset, _Mapping]] = ...) -> None: ...

class ReportHeldRequest(_message.Message):
    __slots__ = ("reporter", "entries")
    REPORTER_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    reporter: str
    entries: _containers.RepeatedCompositeFieldContainer[HeldEntry]
    def __init__(self, reporter: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[HeldEntry, _Mapping]]] = ...) -> None: ...

class ReportHeldResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TopicPartitions(_message.Message):
    __slots__ = ("topic", "partitions")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partitions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, topic: _Optional[str] = ..., partitions: _Optional[_Iterable[int]] = ...) -> None: ...

class GroupHeartbeatRequest(_message.Message):
    __slots__ = ("group", "member_id", "topics", "session_timeout_ms", "assignor", "client_id")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    SESSION_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    ASSIGNOR_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    group: str
    member_id: str
    topics: _containers.RepeatedScalarFieldContainer[str]
    session_timeout_ms: int
    assignor: str
    client_id: str
    def __init__(self, group: _Optional[str] = ..., member_id: _Optional[str] = ..., topics: _Optional[_Iterable[str]] = ..., session_timeout_ms: _Optional[int] = ..., assignor: _Optional[str] = ..., client_id: _Optional[str] = ...) -> None: ...

class GroupHeartbeatResponse(_message.Message):
    __slots__ = ("member_id", "generation", "assignment", "heartbeat_interval_ms")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    generation: int
    assignment: _containers.RepeatedCompositeFieldContainer[TopicPartitions]
    heartbeat_interval_ms: int
    def __init__(self, member_id: _Optional[str] = ..., generation: _Optional[int] = ..., assignment: _Optional[_Iterable[_Union[TopicPartitions, _Mapping]]] = ..., heartbeat_interval_ms: _Optional[int] = ...) -> None: ...

class LeaveGroupRequest(_message.Message):
    __slots__ = ("group", "member_id")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    group: str
    member_id: str
    def __init__(self, group: _Optional[str] = ..., member_id: _Optional[str] = ...) -> None: ...

class LeaveGroupResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PartitionCommit(_message.Message):
    __slots__ = ("topic", "partition", "vector", "hint_offset", "metadata")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    VECTOR_FIELD_NUMBER: _ClassVar[int]
    HINT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    vector: VectorOffset
    hint_offset: int
    metadata: str
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., vector: _Optional[_Union[VectorOffset, _Mapping]] = ..., hint_offset: _Optional[int] = ..., metadata: _Optional[str] = ...) -> None: ...

class CommitOffsetsRequest(_message.Message):
    __slots__ = ("group", "member_id", "generation", "commits", "acks", "geo_sites", "ack_timeout_ms", "after_hlc")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    COMMITS_FIELD_NUMBER: _ClassVar[int]
    ACKS_FIELD_NUMBER: _ClassVar[int]
    GEO_SITES_FIELD_NUMBER: _ClassVar[int]
    ACK_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    AFTER_HLC_FIELD_NUMBER: _ClassVar[int]
    group: str
    member_id: str
    generation: int
    commits: _containers.RepeatedCompositeFieldContainer[PartitionCommit]
    acks: Acks
    geo_sites: int
    ack_timeout_ms: int
    after_hlc: int
    def __init__(self, group: _Optional[str] = ..., member_id: _Optional[str] = ..., generation: _Optional[int] = ..., commits: _Optional[_Iterable[_Union[PartitionCommit, _Mapping]]] = ..., acks: _Optional[_Union[Acks, str]] = ..., geo_sites: _Optional[int] = ..., ack_timeout_ms: _Optional[int] = ..., after_hlc: _Optional[int] = ...) -> None: ...

class CommitOffsetsResponse(_message.Message):
    __slots__ = ("hlc", "committed_by")
    HLC_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_BY_FIELD_NUMBER: _ClassVar[int]
    hlc: int
    committed_by: str
    def __init__(self, hlc: _Optional[int] = ..., committed_by: _Optional[str] = ...) -> None: ...

class FetchCommittedRequest(_message.Message):
    __slots__ = ("group", "partitions", "wait_caught_up_ms")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    WAIT_CAUGHT_UP_MS_FIELD_NUMBER: _ClassVar[int]
    group: str
    partitions: _containers.RepeatedCompositeFieldContainer[TopicPartitions]
    wait_caught_up_ms: int
    def __init__(self, group: _Optional[str] = ..., partitions: _Optional[_Iterable[_Union[TopicPartitions, _Mapping]]] = ..., wait_caught_up_ms: _Optional[int] = ...) -> None: ...

class CommittedOffset(_message.Message):
    __slots__ = ("topic", "partition", "vector", "hlc", "committed_by", "hint_offset", "member_id", "generation", "committed_at_ms", "metadata", "lag_records")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    VECTOR_FIELD_NUMBER: _ClassVar[int]
    HLC_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_BY_FIELD_NUMBER: _ClassVar[int]
    HINT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    LAG_RECORDS_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    vector: VectorOffset
    hlc: int
    committed_by: str
    hint_offset: int
    member_id: str
    generation: int
    committed_at_ms: int
    metadata: str
    lag_records: int
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., vector: _Optional[_Union[VectorOffset, _Mapping]] = ..., hlc: _Optional[int] = ..., committed_by: _Optional[str] = ..., hint_offset: _Optional[int] = ..., member_id: _Optional[str] = ..., generation: _Optional[int] = ..., committed_at_ms: _Optional[int] = ..., metadata: _Optional[str] = ..., lag_records: _Optional[int] = ...) -> None: ...

class FetchCommittedResponse(_message.Message):
    __slots__ = ("offsets",)
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    offsets: _containers.RepeatedCompositeFieldContainer[CommittedOffset]
    def __init__(self, offsets: _Optional[_Iterable[_Union[CommittedOffset, _Mapping]]] = ...) -> None: ...

class ListGroupsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GroupSummary(_message.Message):
    __slots__ = ("group", "members", "generation", "assignor", "committed_partitions", "lag_records")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ASSIGNOR_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    LAG_RECORDS_FIELD_NUMBER: _ClassVar[int]
    group: str
    members: int
    generation: int
    assignor: str
    committed_partitions: int
    lag_records: int
    def __init__(self, group: _Optional[str] = ..., members: _Optional[int] = ..., generation: _Optional[int] = ..., assignor: _Optional[str] = ..., committed_partitions: _Optional[int] = ..., lag_records: _Optional[int] = ...) -> None: ...

class ListGroupsResponse(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[GroupSummary]
    def __init__(self, groups: _Optional[_Iterable[_Union[GroupSummary, _Mapping]]] = ...) -> None: ...

class DescribeGroupRequest(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: str
    def __init__(self, group: _Optional[str] = ...) -> None: ...

class GroupMember(_message.Message):
    __slots__ = ("member_id", "client_id", "assignment", "last_heartbeat_age_ms")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_MS_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    client_id: str
    assignment: _containers.RepeatedCompositeFieldContainer[TopicPartitions]
    last_heartbeat_age_ms: int
    def __init__(self, member_id: _Optional[str] = ..., client_id: _Optional[str] = ..., assignment: _Optional[_Iterable[_Union[TopicPartitions, _Mapping]]] = ..., last_heartbeat_age_ms: _Optional[int] = ...) -> None: ...

class GroupDescription(_message.Message):
    __slots__ = ("group", "generation", "assignor", "members", "offsets")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ASSIGNOR_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    group: str
    generation: int
    assignor: str
    members: _containers.RepeatedCompositeFieldContainer[GroupMember]
    offsets: _containers.RepeatedCompositeFieldContainer[CommittedOffset]
    def __init__(self, group: _Optional[str] = ..., generation: _Optional[int] = ..., assignor: _Optional[str] = ..., members: _Optional[_Iterable[_Union[GroupMember, _Mapping]]] = ..., offsets: _Optional[_Iterable[_Union[CommittedOffset, _Mapping]]] = ...) -> None: ...
