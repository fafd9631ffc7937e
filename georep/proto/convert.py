"""Domain values to and from their protobuf messages: vector offsets, topic-partition
lists and ack levels (shell side: the core never imports protobuf)."""

from __future__ import annotations

from collections.abc import Iterable

from georep.broker.acks import AckKind, Acks
from georep.proto import georep_pb2
from georep.storage.api import DamagedBatch
from offsets.coordinates import Origin
from offsets.vector import InvalidVectorOffset, VectorOffset
from topology.ids import InvalidSiteId, site_id


def vector_to_proto(vector: VectorOffset) -> georep_pb2.VectorOffset:
    """Entries sorted by origin, zero entries left out."""
    return georep_pb2.VectorOffset(
        entries=[georep_pb2.OriginSeq(site=o.site, epoch=o.epoch, next_seq=seq) for o, seq in vector.items()]
    )


def vector_from_proto(message: georep_pb2.VectorOffset) -> VectorOffset:
    """Raises :class:`InvalidVectorOffset` (a ValueError) for a bad site, a negative seq or a repeated origin."""
    entries = []
    for entry in message.entries:
        try:
            origin = Origin(site_id(entry.site), entry.epoch)
        except InvalidSiteId as exc:
            raise InvalidVectorOffset(f"invalid vector offset entry: {exc}") from exc
        entries.append((origin, entry.next_seq))
    return VectorOffset(entries)


def topic_partitions_to_proto(tps: Iterable[tuple[str, int]]) -> list[georep_pb2.TopicPartitions]:
    """``[(topic, partition), ...]`` grouped by topic, both sorted."""
    by_topic: dict[str, list[int]] = {}
    for topic, partition in tps:
        by_topic.setdefault(topic, []).append(partition)
    return [georep_pb2.TopicPartitions(topic=t, partitions=sorted(ps)) for t, ps in sorted(by_topic.items())]


_ACK_KINDS: dict[int, AckKind] = {
    georep_pb2.ACKS_LEADER: AckKind.LEADER,
    georep_pb2.ACKS_ALL: AckKind.ALL,
    georep_pb2.ACKS_GEO: AckKind.GEO,
}


def acks_from_proto(acks: int, geo_sites: int) -> Acks:
    """The ``Acks`` enum and ``geo_sites`` of a request as an ack level (an unknown enum value is ``leader``)."""
    kind = _ACK_KINDS.get(acks, AckKind.LEADER)
    return Acks(kind, geo_sites) if kind is AckKind.GEO else Acks(kind)


def damaged_to_proto(damaged: Iterable[DamagedBatch]) -> list[georep_pb2.DamagedRange]:
    return [
        georep_pb2.DamagedRange(
            origin=str(d.origin),
            base_origin_seq=d.base_origin_seq,
            last_origin_seq=d.last_origin_seq,
            base_offset=d.base_offset,
            next_offset=d.next_offset,
            reason=d.reason,
        )
        for d in damaged
    ]
