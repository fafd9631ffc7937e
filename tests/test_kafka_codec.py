"""The Kafka gateway's pure parts: framing, request decoding, error answers, record batch conversion both
ways, and the vector of a local offset (issue 13). Golden bytes are Kafka's documented layouts."""

from __future__ import annotations

import struct

import pytest
from kafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder

from georep.kafka.offsets import FetchFilters, vector_at
from georep.kafka.protocol import (
    FrameReader,
    FrameTooLarge,
    Request,
    Unsupported,
    decode_request,
    error_response,
    failure_response,
)
from georep.kafka.records import RecordsError, empty_batch, georep_to_kafka, kafka_to_georep
from georep.record.batch import HEADER_BYTES, REWRITTEN_BYTES, decode_records, parse_header, stamp_origin
from georep.storage.memory_log import MemoryLog
from offsets.coordinates import Origin
from offsets.vector import VectorOffset

A = Origin("a", 1)
B = Origin("b", 1)


def kafka_batch(n: int, producer: tuple[int, int, int] = (-1, -1, -1), first_ts: int = 1_000) -> bytes:
    builder = DefaultRecordBatchBuilder(2, 0, False, *producer, 1 << 20)
    for i in range(n):
        builder.append(i, first_ts + i, b"k%d" % i, b"v%d" % i, [("h", b"x")] if i == 0 else [])
    return bytes(builder.build())


def stored(kafka: bytes, origin: Origin, base_seq: int, base_offset: int) -> bytes:
    """A produced batch as a site stores it: stamped, at ``base_offset``."""
    batch = kafka_to_georep(kafka)
    head, _crc = stamp_origin(batch, origin, base_seq)
    out = bytearray(head + batch[HEADER_BYTES:])
    struct.pack_into(">q", out, 0, base_offset)
    return bytes(out)


def frames(reader: FrameReader, data: bytes) -> list[bytes]:
    reader.feed(data)
    out = []
    while (frame := reader.next_frame()) is not None:
        out.append(frame)
    return out


def test_frames_split_across_reads_and_bounded() -> None:
    reader = FrameReader(max_frame_bytes=10)
    assert frames(reader, b"\x00\x00\x00\x03ab") == []
    assert frames(reader, b"c\x00\x00\x00\x01d\x00") == [b"abc", b"d"]
    with pytest.raises(FrameTooLarge):
        frames(reader, b"\x00\x00\x0b")


def test_metadata_request_decodes_from_its_golden_bytes() -> None:
    # Metadata v9 (flexible): api key 3, version 9, correlation 7, client "x", tagged fields; topics null,
    # allow_auto_topic_creation false, include_cluster_ and include_topic_authorized_operations false, tagged fields.
    frame = b"\x00\x03\x00\x09\x00\x00\x00\x07\x00\x01x\x00" + b"\x00\x00\x00\x00\x00"
    req = decode_request(frame)
    assert isinstance(req, Request)
    assert (req.api_key, req.version, req.correlation_id, req.client_id) == (3, 9, 7, "x")
    assert req.body.topics is None and req.body.allow_auto_topic_creation is False


def test_unsupported_version_of_api_versions_gets_the_v0_answer_with_the_ranges() -> None:
    req = decode_request(struct.pack(">hhih", 18, 9, 5, 1) + b"x")
    assert isinstance(req, Unsupported)
    resp = error_response(req)
    size, correlation, code, _count = struct.unpack_from(">iihi", resp)
    assert (size, correlation, code) == (len(resp) - 4, 5, 35)
    first = struct.unpack_from(">hhh", resp, 14)
    assert first == (0, 3, 9)  # Produce v3..v9


def test_unknown_api_key_gets_a_header_and_an_error_code() -> None:
    req = decode_request(struct.pack(">hhih", 999, 0, 11, 1) + b"x")
    assert isinstance(req, Unsupported)
    assert error_response(req) == b"\x00\x00\x00\x06\x00\x00\x00\x0b\x00\x23"


def test_a_failed_handler_is_answered_with_unknown_server_error() -> None:
    # Heartbeat v0: size, correlation id, error_code -1.
    assert failure_response(12, 0, 3) == b"\x00\x00\x00\x06\x00\x00\x00\x03\xff\xff"


def test_kafka_batch_to_georep_keeps_records_and_producer_fields() -> None:
    batch = kafka_to_georep(kafka_batch(3, (42, 1, 10)))
    h = parse_header(batch)
    assert (h.producer_id, h.producer_epoch, h.base_sequence, h.records_count) == (42, 1, 10, 3)
    assert not h.stamped
    recs = decode_records(batch)
    assert [(r.key, r.value, r.timestamp_ms, r.headers) for r in recs] == [
        (b"k0", b"v0", 1000, (("h", b"x"),)),
        (b"k1", b"v1", 1001, ()),
        (b"k2", b"v2", 1002, ()),
    ]


def test_kafka_batch_with_null_key_and_value_and_a_compressed_one() -> None:
    builder = DefaultRecordBatchBuilder(2, 0, False, -1, -1, -1, 1 << 20)
    builder.append(0, 5, None, None, [("n", None)])
    builder.append(1, 6, b"", b"", [])
    recs = decode_records(kafka_to_georep(bytes(builder.build())))
    assert [(r.key, r.value, r.headers, r.timestamp_ms) for r in recs] == [
        (None, None, (("n", None),), 5),
        (b"", b"", (), 6),
    ]
    gzip = DefaultRecordBatchBuilder(2, 1, False, 7, 0, 0, 1 << 20)  # codec 1: gzip, through kafka-python's reader
    for i in range(3):
        gzip.append(i, 100 + i, None, b"z" * 100, [])
    batch = kafka_to_georep(bytes(gzip.build()))
    assert parse_header(batch).producer_id == 7
    assert [r.value for r in decode_records(batch)] == [b"z" * 100] * 3


def test_kafka_batch_refusals() -> None:
    good = kafka_batch(1)
    with pytest.raises(RecordsError) as two:
        kafka_to_georep(good + good)
    assert two.value.code == 87
    bad_crc = bytearray(good)
    bad_crc[-1] ^= 1
    with pytest.raises(RecordsError) as crc:
        kafka_to_georep(bytes(bad_crc))
    assert crc.value.code == 2


def test_georep_to_kafka_offsets_and_coordinate_headers() -> None:
    out = georep_to_kafka(stored(kafka_batch(2), A, 5, 40))
    kb = DefaultRecordBatch(out)
    assert kb.validate_crc() and kb.base_offset == 40
    assert [(r.offset, r.key, r.value, r.timestamp, r.headers) for r in kb] == [
        (40, b"k0", b"v0", 1000, [("h", b"x"), ("georep.origin", b"a@1"), ("georep.origin_seq", b"5")]),
        (41, b"k1", b"v1", 1001, [("georep.origin", b"a@1"), ("georep.origin_seq", b"6")]),
    ]


def test_covered_records_are_left_out_and_a_covered_batch_still_spans_its_offsets() -> None:
    chunk = stored(kafka_batch(3), A, 0, 10) + stored(kafka_batch(2), B, 0, 13)
    out = georep_to_kafka(chunk, 0, {A: 2, B: 2}, 1 << 62)
    size = 12 + struct.unpack_from(">i", out, 8)[0]
    first = DefaultRecordBatch(out[:size])
    assert first.validate_crc() and first.last_offset_delta == 2 and [r.offset for r in first] == [12]
    second = DefaultRecordBatch(out[size:])
    assert second.validate_crc()
    assert second.base_offset == 13 and second.records_count == 0 and second.last_offset_delta == 1
    assert empty_batch(13, 1, 1_001) == bytearray(out[size:])


def test_vector_at_a_local_offset_inside_and_between_batches() -> None:
    log = MemoryLog()
    for origin, seq, n in ((A, 0, 3), (B, 0, 2), (A, 3, 2)):
        data = stored(kafka_batch(n), origin, seq, log.log_end_offset)
        log.append(parse_header(data), (memoryview(data)[REWRITTEN_BYTES:],), 0)
    assert vector_at(log, 0) == VectorOffset()
    assert vector_at(log, 2) == VectorOffset({A: 2})
    assert vector_at(log, 5) == VectorOffset({A: 3, B: 2})
    assert vector_at(log, 6) == VectorOffset({A: 4, B: 2})


def test_fetch_filters_end_when_the_consumer_seeks_back() -> None:
    filters = FetchFilters(limit=2)
    key = ("c@h", "t", 0)
    filters.set(key, 10, VectorOffset({A: 3}))
    assert filters.for_fetch(key, 12) == VectorOffset({A: 3})
    assert filters.for_fetch(key, 9) is None
    assert filters.for_fetch(key, 12) is None
