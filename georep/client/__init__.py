"""The georep client: asyncio ``Producer``, ``Consumer`` and ``Admin``, plus blocking wrappers.

Quick start::

    async with Producer("127.0.0.1:7101") as producer:
        metadata = await producer.send("events", b"hello", key=b"user-1")

    async with Consumer("127.0.0.1:7101", auto_offset_reset="earliest") as consumer:
        consumer.subscribe(["events"])
        async for record in consumer:
            print(record.offset, record.origin, record.value)
"""

from georep.client.admin import (
    Admin,
    Health,
    NewTopic,
    PartitionInfo,
    PartitionOffset,
    TopicCreated,
    TopicInfo,
    TopicPage,
)
from georep.client.connection import DEFAULT_BOOTSTRAP, default_bootstrap, parse_bootstrap
from georep.client.consumer import Consumer, ConsumerRecord, TopicPartition
from georep.client.errors import (
    BatchTooLarge,
    CorruptData,
    DamagedData,
    DeliveryTimeout,
    DiskFull,
    GeorepError,
    InvalidRequest,
    NodeUnavailable,
    OffsetOutOfRange,
    OutOfOrderSequence,
    ProducerClosed,
    ProducerFenced,
    RecordTooLarge,
    ServerError,
    TopicExists,
    UnknownTopic,
)
from georep.client.partitioner import key_partition
from georep.client.producer import Producer, RecordMetadata
from georep.client.sync import SyncAdmin, SyncConsumer, SyncProducer
from offsets.coordinates import Origin
from offsets.vector import VectorOffset

__all__ = [
    "DEFAULT_BOOTSTRAP",
    "Admin",
    "BatchTooLarge",
    "RecordTooLarge",
    "Consumer",
    "ConsumerRecord",
    "CorruptData",
    "DamagedData",
    "DeliveryTimeout",
    "DiskFull",
    "GeorepError",
    "Health",
    "NewTopic",
    "InvalidRequest",
    "NodeUnavailable",
    "OffsetOutOfRange",
    "Origin",
    "OutOfOrderSequence",
    "PartitionInfo",
    "PartitionOffset",
    "TopicCreated",
    "TopicPage",
    "Producer",
    "ProducerClosed",
    "ProducerFenced",
    "RecordMetadata",
    "ServerError",
    "SyncAdmin",
    "SyncConsumer",
    "SyncProducer",
    "TopicExists",
    "TopicInfo",
    "TopicPartition",
    "UnknownTopic",
    "VectorOffset",
    "default_bootstrap",
    "key_partition",
    "parse_bootstrap",
]
