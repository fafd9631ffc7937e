"""Vector offsets to and from their protobuf message (shell side: the core never imports protobuf)."""

from __future__ import annotations

from georep.proto import georep_pb2
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
