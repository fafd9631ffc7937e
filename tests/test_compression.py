"""Every codec end to end in process (issue 23, "Compression"): georep's codecs (none, zstd, lz4, gzip, snappy)
round-trip and stay bounded; a Kafka batch in each of Kafka's codecs (gzip, snappy raw and xerial, lz4, zstd)
becomes one georep batch stored in the same codec; and hostile input in every codec (a bomb, a truncated frame,
a frame whose declared size lies, garbage that decompresses to records that do not parse) is refused with an
error that names it, before anything is stored. The Kafka clients' side is tests/test_kafka_compression.py."""

from __future__ import annotations

import gzip
import struct
import tracemalloc
from collections.abc import Callable

import cramjam
import lz4.frame
import pytest
import zstandard

from georep.kafka.records import RecordsError, convert_fetched, kafka_to_georep
from georep.record.batch import (
    HEADER_BYTES,
    InvalidBatch,
    RecordInput,
    RecordsTooLarge,
    decode_records,
    encode_batch,
    parse_header,
    stamp_origin,
)
from georep.record.compression import (
    XERIAL_MAGIC,
    Compression,
    DecompressedTooLarge,
    DecompressionError,
    compress,
    decompress,
    decompress_kafka_snappy,
)
from georep.record.validate import validate_batch
from offsets.coordinates import Origin
from tests.support.forge import TS, ZEROS_MIB, forge, record
from tests.support.kafka_raw import kafka_batch, kafka_record
from topology.ids import SiteId

LIMIT = 1 << 20
ORIGIN = Origin(SiteId("a"), 1)
CORRUPT_MESSAGE, MESSAGE_TOO_LARGE, INVALID_RECORD = 2, 10, 87
KAFKA_IDS = {"gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}
KAFKA_TO_GEOREP = {
    "gzip": Compression.GZIP,
    "snappy": Compression.SNAPPY,
    "lz4": Compression.LZ4,
    "zstd": Compression.ZSTD,
}


def xerial(data: bytes, block_bytes: int = 32 << 10) -> bytes:
    """What snappy-java (Kafka's Java client), kafka-python and aiokafka send: the xerial header, then blocks
    each prefixed by its length."""
    out = [XERIAL_MAGIC, struct.pack(">ii", 1, 1)]
    for at in range(0, len(data), block_bytes):
        block = bytes(cramjam.snappy.compress_raw(data[at : at + block_bytes]))
        out += [struct.pack(">i", len(block)), block]
    return b"".join(out)


KAFKA_COMPRESS: dict[str, Callable[[bytes], bytes]] = {
    "gzip": gzip.compress,
    "snappy": lambda data: bytes(cramjam.snappy.compress_raw(data)),  # librdkafka's (confluent-kafka)
    "xerial": xerial,
    "lz4": lambda data: bytes(lz4.frame.compress(data)),
    "zstd": zstandard.ZstdCompressor().compress,
}


def kafka_records(n: int) -> bytes:
    return b"".join(
        kafka_record(b'{"event": "click", "page": "/home"}' * 10, key=b"k%d" % i, index=i) for i in range(n)
    )


def kafka_compressed(codec: str, section: bytes, count: int) -> bytes:
    return kafka_batch(KAFKA_COMPRESS[codec](section), count, attributes=KAFKA_IDS[codec.replace("xerial", "snappy")])


def lie_about_size(codec: Compression, section: bytes) -> bytes:
    """``section`` compressed with a frame whose declared decompressed size is not the truth."""
    frame = bytearray(compress(codec, section))
    if codec is Compression.GZIP:  # the ISIZE trailer
        struct.pack_into("<I", frame, len(frame) - 4, len(section) + 1)
    elif codec is Compression.SNAPPY:  # the preamble: one varint byte for these sizes
        assert len(section) < 128
        frame[0] = len(section) - 1
    elif codec is Compression.ZSTD:
        frame = bytearray(zstandard.ZstdCompressor(write_content_size=True).compress(section))
        assert frame[4] >> 6 == 0 and frame[4] & 0x20  # a one-byte frame content size right after the descriptor
        frame[5] = len(section) - 1
    else:  # lz4: the content size sits under the descriptor's checksum, which the lie breaks too
        frame = bytearray(lz4.frame.compress(section, store_size=True))
        struct.pack_into("<q", frame, 6, len(section) - 1)
    return bytes(frame)


# -- georep's own codecs -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", list(Compression))
def test_every_codec_round_trips_compressed_through_validation_and_readers(codec: Compression) -> None:
    records = [RecordInput(b"k%d" % i, b"compressible value " * 20, [("h", b"x")], TS + i) for i in range(50)]
    batch = encode_batch(records, compression=codec)
    plain = encode_batch(records)
    header = parse_header(batch)
    assert header.compression == codec
    if codec is not Compression.NONE:
        assert len(batch) < len(plain) // 4, (codec, len(batch), len(plain))
    assert validate_batch(batch, LIMIT).records_bytes == len(plain) - HEADER_BYTES
    head, _crc = stamp_origin(batch, ORIGIN, 0)
    stored = head + batch[HEADER_BYTES:]
    assert [r.value for r in decode_records(stored)] == [r.value for r in records]
    fetched = convert_fetched(stored)
    assert fetched.invalid == () and b"compressible value " * 20 in fetched.data  # Kafka fetch: uncompressed


@pytest.mark.parametrize("codec", [c for c in Compression if c is not Compression.NONE])
def test_hostile_records_in_every_codec_are_refused_by_name(codec: Compression) -> None:
    name = codec.name.lower()
    section = record(b"v" * 40)
    bomb = compress(codec, ZEROS_MIB * 4)
    with pytest.raises(RecordsTooLarge, match=f"the {name} records section .*limit of {LIMIT}"):
        validate_batch(forge(bomb, 1, attributes=int(codec)), LIMIT)
    with pytest.raises(InvalidBatch, match=f"do not decompress as {name}"):
        validate_batch(forge(compress(codec, section)[:-3], 1, attributes=int(codec)), LIMIT)
    with pytest.raises(InvalidBatch, match=f"do not decompress as {name}"):
        validate_batch(forge(lie_about_size(codec, section), 1, attributes=int(codec)), LIMIT)
    with pytest.raises(InvalidBatch, match=r"record 0 \(byte 0 of the records section\) has length"):
        validate_batch(forge(compress(codec, b"\x13" * 99), 1, attributes=int(codec)), LIMIT)


def test_an_unknown_codec_id_is_refused_as_an_older_build_refuses_a_newer_codec() -> None:
    for codec_id in (5, 6, 7):
        with pytest.raises(InvalidBatch, match=f"unknown compression codec id {codec_id}"):
            validate_batch(forge(record(b"v"), 1, attributes=codec_id), LIMIT)
        with pytest.raises(DecompressionError, match=f"unknown compression codec id {codec_id}"):
            decompress(codec_id, b"x", LIMIT)


def test_a_snappy_bomb_is_refused_before_it_allocates() -> None:
    """The preamble (raw) or the blocks' preambles (xerial) say the size; past the limit nothing is allocated."""
    liar = bytes([0x80, 0x80, 0x80, 0x80, 0x0F]) + b"\x00" * 16  # declares 4 GiB - 1 in 21 bytes
    honest = bytes(cramjam.snappy.compress_raw(ZEROS_MIB * 8))
    blocks = xerial(ZEROS_MIB * 8, block_bytes=1 << 20)  # every block within the limit, the sum 8 times past it
    tracemalloc.start()
    try:
        for frame, decoder in ((liar, decompress), (honest, decompress), (blocks, None)):
            with pytest.raises(DecompressedTooLarge, match=f"snappy records section holds .* limit of {LIMIT}"):
                if decoder is None:
                    decompress_kafka_snappy(frame, LIMIT)
                else:
                    decoder(Compression.SNAPPY, frame, LIMIT)
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < LIMIT // 4, peak


def test_a_gzip_bomb_is_refused_having_cost_about_the_limit() -> None:
    bomb = gzip.compress(ZEROS_MIB * 64)
    assert len(bomb) < 100_000
    tracemalloc.start()
    try:
        with pytest.raises(DecompressedTooLarge, match=f"gzip records section decompresses to more than .*{LIMIT}"):
            decompress(Compression.GZIP, bomb, LIMIT)
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * LIMIT, peak


# -- Kafka's codecs at the gateway ---------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["gzip", "snappy", "xerial", "lz4", "zstd"])
def test_a_kafka_compressed_batch_becomes_one_georep_batch_in_the_same_codec(codec: str) -> None:
    section = kafka_records(40)
    batch = kafka_to_georep(kafka_compressed(codec, section, 40), LIMIT)
    header = parse_header(batch)
    assert header.compression == KAFKA_TO_GEOREP[codec.replace("xerial", "snappy")]
    assert header.records_count == 40
    assert len(batch) < len(section) // 4, (len(batch), len(section))
    valid = validate_batch(batch, LIMIT)  # what the origin append checks again before it stores the batch
    assert valid.header.records_count == 40
    head, _crc = stamp_origin(batch, ORIGIN, 0)
    values = [r.value for r in decode_records(head + batch[HEADER_BYTES:])]
    assert values == [b'{"event": "click", "page": "/home"}' * 10] * 40


@pytest.mark.parametrize("codec", ["gzip", "snappy", "xerial", "lz4", "zstd"])
def test_hostile_kafka_batches_in_every_codec_are_refused_with_kafka_error_codes(codec: str) -> None:
    name = codec.replace("xerial", "snappy")

    def refused(section: bytes, code: int, match: str, count: int = 1) -> None:
        raw = kafka_batch(section, count, attributes=KAFKA_IDS[name])
        with pytest.raises(RecordsError, match=match) as info:
            kafka_to_georep(raw, LIMIT)
        assert info.value.code == code, info.value

    compressor = KAFKA_COMPRESS[codec]
    good = kafka_record(b"v" * 40)
    refused(compressor(ZEROS_MIB * 4), MESSAGE_TOO_LARGE, f"{name} records decompress to more than .*{LIMIT}")
    refused(compressor(good)[:-3], CORRUPT_MESSAGE, f"cannot read the {name} records")
    refused(_kafka_lie(codec, good), CORRUPT_MESSAGE, f"cannot read the {name} records")
    refused(compressor(b"\x13" * 99), INVALID_RECORD, "record 0|records count|inconsistent|truncated")


def _kafka_lie(codec: str, section: bytes) -> bytes:
    if codec == "xerial":  # a block length past the frame's end
        frame = bytearray(xerial(section))
        struct.pack_into(">i", frame, 16, len(frame))
        return bytes(frame)
    return lie_about_size(KAFKA_TO_GEOREP[codec], section)


def test_a_kafka_codec_id_past_zstd_is_refused_as_unsupported() -> None:
    with pytest.raises(RecordsError, match="compression 5 is not supported") as info:
        kafka_to_georep(kafka_batch(kafka_record(b"v"), 1, attributes=5), LIMIT)
    assert info.value.code == 76


@pytest.mark.parametrize("library", ["aiokafka", "kafka-python"])
@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd"])
def test_the_batches_kafka_python_and_aiokafka_build_are_stored_in_their_codec(library: str, codec: str) -> None:
    """The clients' own batch builders, in process: aiokafka's snappy is the xerial framing."""
    if library == "aiokafka":
        from aiokafka.record.default_records import DefaultRecordBatchBuilder as Builder
    else:  # kafka-python's snappy needs python-snappy, a dev dependency
        from kafka.record.default_records import DefaultRecordBatchBuilder as Builder
    builder = Builder(2, KAFKA_IDS[codec], False, -1, -1, -1, 1 << 20)
    for i in range(20):
        builder.append(i, TS + i, b"k", b"the same value, again and again " * 8, [])
    raw = bytes(builder.build())
    if library == "aiokafka" and codec == "snappy":
        assert raw[61 : 61 + len(XERIAL_MAGIC)] == XERIAL_MAGIC
    batch = kafka_to_georep(raw, LIMIT)
    assert parse_header(batch).compression == KAFKA_TO_GEOREP[codec]
    head, _crc = stamp_origin(batch, ORIGIN, 0)
    assert [r.value for r in decode_records(head + batch[HEADER_BYTES:])] == [
        b"the same value, again and again " * 8
    ] * 20
