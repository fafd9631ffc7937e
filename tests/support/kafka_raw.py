"""Kafka record batches (v2) as a hostile producer builds them, and a raw Produce request to a node's Kafka listener:
what no Kafka client library would send (a lying count, a 900 MB value compressed streaming, an internal topic it
has no metadata for)."""

from __future__ import annotations

import gzip
import socket
import struct
from collections.abc import Iterator

import cramjam
import crc32c
import lz4.frame
import zstandard
from hypothesis import strategies as st
from kafka.protocol import producer as kproducer
from kafka.record.default_records import DefaultRecordBatch
from kafka.record.util import encode_varint

from tests.support.forge import TS, ZEROS_MIB
from tests.support.kafka_nodes import poll_until, read_frame

MESSAGE_TOO_LARGE = 10
INVALID_TOPIC_EXCEPTION = 17
INVALID_RECORD = 87
_HEAD = DefaultRecordBatch.HEADER_STRUCT
_ATTRIBUTES_AT = 21


def varint(value: int) -> bytes:
    out = bytearray()
    encode_varint(value, out.append)
    return bytes(out)


def _bytes_field(data: bytes | None) -> bytes:
    return varint(-1) if data is None else varint(len(data)) + data


def kafka_record(
    value: bytes | None,
    *,
    key: bytes | None = None,
    index: int = 0,
    ts_delta: int = 0,
    headers: list[tuple[bytes, bytes | None]] | None = None,
    header_count: int | None = None,
    length: int | None = None,
) -> bytes:
    """One record of Kafka's v2 layout; ``header_count`` and ``length`` may lie."""
    pairs = headers or []
    body = b"\0" + varint(ts_delta) + varint(index) + _bytes_field(key) + _bytes_field(value)
    body += varint(len(pairs) if header_count is None else header_count)
    body += b"".join(_bytes_field(k) + _bytes_field(v) for k, v in pairs)
    return varint(len(body) if length is None else length) + body


def kafka_batch(
    records: bytes,
    count: int,
    *,
    attributes: int = 0,
    first_ts: int = TS,
    max_ts: int | None = None,
    producer_id: int = -1,
    producer_epoch: int = -1,
    base_sequence: int = -1,
) -> bytes:
    """A v2 batch over ``records`` (compressed if ``attributes`` say so) with a CRC-32C that matches."""
    head = bytearray(
        _HEAD.pack(
            0,
            _HEAD.size - 12 + len(records),
            0,
            2,
            0,
            attributes,
            count - 1,
            first_ts,
            first_ts if max_ts is None else max_ts,
            producer_id,
            producer_epoch,
            base_sequence,
            count,
        )
    )
    crc = crc32c.crc32c(records, crc32c.crc32c(head[_ATTRIBUTES_AT:]))
    struct.pack_into(">I", head, 17, crc)
    return bytes(head) + records


def zstd_value_records(value_bytes: int) -> bytes:
    """The zstd-compressed records of one record holding ``value_bytes`` zeros, compressed streaming (900 MB make
    about 28 KB), in a frame that does not say its size, as Kafka's Java producer writes it."""

    def pieces() -> Iterator[bytes]:
        tail = varint(0)  # no headers
        body_len = 1 + 1 + 1 + 1 + len(varint(value_bytes)) + value_bytes + len(tail)
        yield varint(body_len) + b"\0" + varint(0) + varint(0) + varint(-1) + varint(value_bytes)
        left = value_bytes
        while left:
            n = min(left, len(ZEROS_MIB))
            yield ZEROS_MIB[:n]
            left -= n
        yield tail

    compressor = zstandard.ZstdCompressor(level=1, write_content_size=False).compressobj()
    return b"".join([compressor.compress(p) for p in pieces()] + [compressor.flush()])


def produce_raw(address: str, topic: str, partition: int, records: bytes, acks: int = 1) -> tuple[int, str]:
    """One Produce request (v8) of ``records`` on a fresh connection: the partition's error code and message."""
    r = kproducer.ProduceRequest
    req = r(
        version=8,
        transactional_id=None,
        acks=acks,
        timeout_ms=10_000,
        topic_data=[
            r.TopicProduceData(
                name=topic, partition_data=[r.TopicProduceData.PartitionProduceData(index=partition, records=records)]
            )
        ],
    )
    req.with_header(correlation_id=1, client_id="hostile")
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(req.encode(header=True, framed=True))
        resp = kproducer.ProduceResponse.decode(read_frame(sock), version=8, header=True)
    part = resp.responses[0].partition_responses[0]
    return int(part.error_code), str(part.error_message or "")


def hostile_kafka_batches() -> st.SearchStrategy[tuple[bytes, str]]:
    """Kafka v2 batches with valid CRCs, mostly well formed with one thing wrong, or nothing wrong: codecs (gzip,
    snappy, lz4, zstd and ids past them), counts, offset and timestamp deltas, lengths, header counts and keys,
    timestamps, and garbage spliced into the records."""
    return _hostile_kafka()


@st.composite
def _hostile_kafka(draw: st.DrawFn) -> tuple[bytes, str]:
    rarely = st.sampled_from([False] * 30 + [True])
    n = draw(st.integers(1, 4))
    deltas = [0, *draw(st.lists(st.integers(-3, 3), min_size=n - 1, max_size=n - 1))]
    pieces = []
    for i in range(n):
        headers = draw(
            st.lists(
                st.tuples(st.sampled_from([b"h"] * 8 + [b"", b"\xc3\xa9", b"\xff"]), st.none() | st.binary(max_size=4)),
                max_size=2,
            )
        )
        pieces.append(
            kafka_record(
                draw(st.none() | st.binary(max_size=30)),
                key=draw(st.none() | st.binary(max_size=4)),
                index=draw(st.integers(-1, n + 1)) if draw(rarely) else i,
                ts_delta=deltas[i],
                headers=headers,
                header_count=draw(st.sampled_from([-1, 3, 2**31 - 1])) if draw(rarely) else None,
                length=draw(st.integers(-5, 200)) if draw(rarely) else None,
            )
        )
    section = b"".join(pieces)
    if draw(rarely):
        at = draw(st.integers(0, len(section)))
        section = section[:at] + draw(st.binary(min_size=1, max_size=8)) + section[at:]
    codec = draw(st.sampled_from([0] * 6 + [1, 2, 3, 3, 4, 4, 5, 7]))
    if not draw(rarely):
        if codec == 1:
            section = gzip.compress(section)
        elif codec == 2:  # raw, as librdkafka sends it
            section = bytes(cramjam.snappy.compress_raw(section))
        elif codec == 3:
            section = lz4.frame.compress(section)
        elif codec == 4:
            section = zstandard.ZstdCompressor().compress(section)
    count = n + draw(st.sampled_from([0] * 10 + [1, -1, -n, 2**31 - 1 - n]))
    first_ts = draw(st.sampled_from([TS] * 16 + [0, -1, -(2**63) + 10]))
    max_ts = first_ts + max(deltas) + draw(st.sampled_from([0] * 8 + [1, -1]))
    label = f"{n} records, codec {codec}, count {count}, first_ts {first_ts}"
    return kafka_batch(section, count, attributes=codec, first_ts=first_ts, max_ts=max_ts), label


def kafka_python_read(address: str, topic: str, partition: int = 0, timeout_s: float = 60) -> list[bytes | None]:
    """Every record value of ``topic``-``partition`` from the start to the high watermark, read with kafka-python;
    fails the test if the client does not get there (stuck at a batch)."""
    from kafka import KafkaConsumer, TopicPartition

    tp = TopicPartition(topic, partition)
    consumer = KafkaConsumer(bootstrap_servers=address, enable_auto_commit=False, auto_offset_reset="earliest")
    try:
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        end = consumer.end_offsets([tp])[tp]
        got: list[bytes | None] = []
        poll_until(
            f"kafka-python read {topic}-{partition} to offset {end}",
            lambda: got.extend(m.value for ms in consumer.poll(200).values() for m in ms),
            lambda: consumer.position(tp) >= end,
            timeout_s,
        )
        return got
    finally:
        consumer.close()
