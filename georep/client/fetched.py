"""What one fetch response holds, decoded in the client: CRC-checked batches, their records, and the records
below the requested position or covered by the start vector dropped (a node sends whole batches). Pure.

Decoding decompresses a batch into at most ``READ_RECORDS_BYTES_MAX`` (the largest ``max_batch_bytes`` a topic
may have) and checks its records as a site does before it stores them (``georep/record/batch.py``). A batch that
fails ends what is decoded of the response: the records before it are returned with it (:class:`BadBatch`), so
the fetcher hands them out first and then reports or skips it.
"""

from __future__ import annotations

from typing import NamedTuple

from georep.record.batch import CorruptBatch, InvalidBatch, check_batch, decode_records
from offsets.coordinates import LocalOffset, Origin, OriginSeq
from offsets.vector import Coverage, VectorOffset


class ConsumerRecord(NamedTuple):
    topic: str
    partition: int
    offset: LocalOffset  # local offset at the node read from
    origin: Origin
    origin_seq: OriginSeq
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]


class BadBatch(NamedTuple):
    """A batch of a fetch response that does not decode: the records before it are good."""

    base_offset: int
    next_offset: int  # -1 when its header cannot be trusted (a CRC failure)
    error: CorruptBatch


class Decoded(NamedTuple):
    records: list[ConsumerRecord]
    bad: BadBatch | None


def decode_response(
    topic: str, partition: int, buf: bytes, min_offset: int, vector: VectorOffset | None
) -> list[ConsumerRecord]:
    """:func:`decode_fetched`'s records; raises the first bad batch's error instead of returning it."""
    decoded = decode_fetched(topic, partition, buf, min_offset, vector)
    if decoded.bad is not None:
        raise decoded.bad.error
    return decoded.records


def decode_fetched(topic: str, partition: int, buf: bytes, min_offset: int, vector: VectorOffset | None) -> Decoded:
    """CRC-check and decode the batches of one fetch response, dropping records below ``min_offset`` and
    records ``vector`` covers; stops at the first batch that does not decode, returning the records before it."""
    out: list[ConsumerRecord] = []
    view = memoryview(buf)
    pos = 0
    end = len(buf)
    make = ConsumerRecord._make
    prefix = (topic, partition)
    while pos < end:
        try:
            header = check_batch(view, pos)
        except CorruptBatch as exc:
            return Decoded(out, BadBatch(-1, -1, exc))
        size = header.size_bytes
        if header.next_offset <= min_offset:
            pos += size
            continue
        skip_seq = -1
        if vector:
            coverage = vector.covers_batch(header.origin, header.base_origin_seq, header.last_origin_seq)
            if coverage is Coverage.ALL:
                pos += size
                continue
            if coverage is Coverage.PARTIAL:
                skip_seq = vector.get(header.origin)
        try:
            records = decode_records(view[pos : pos + size], header)
        except InvalidBatch as exc:
            return Decoded(out, BadBatch(header.base_offset, header.next_offset, exc))
        if header.base_offset < min_offset or skip_seq >= 0:
            records = [r for r in records if r.offset >= min_offset and r.origin_seq >= skip_seq]
        out.extend(make(prefix + r) for r in records)
        pos += size
    return Decoded(out, None)
