"""Full validation of a batch before it is stored (georep/record/validate.py): golden hostile batches, each refused
with a message that names what is wrong, decompression bombs refused without allocating them, and properties:
everything a producer encodes is valid, and whatever the validator accepts, every reader reads."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dedup.producer import ProducerStateTable
from georep.broker import errors
from georep.broker.append import append_as_origin
from georep.kafka import errors as k
from georep.kafka.records import convert_fetched
from georep.record.batch import (
    HEADER_BYTES,
    CorruptBatch,
    InvalidBatch,
    RecordInput,
    RecordsTooLarge,
    decode_records,
    encode_batch,
    stamp_origin,
)
from georep.record.compression import Compression, compress
from georep.record.validate import CrcMismatch, TimestampOutOfRange, TimestampWindow, validate_batch
from georep.replication.sink import CorruptChunk, InvalidChunk, apply_chunk
from georep.server.status import Code, status_of
from georep.storage.memory_log import MemoryLog
from offsets.coordinates import Origin
from tests.support.examples import examples
from tests.support.forge import TS, forge, hostile_batches, record
from topology.ids import SiteId

LIMIT = 8 << 20
I64_MIN = -(2**63)
ORIGIN = Origin(SiteId("x"), 1)


def refused(batch: bytes, match: str, limit: int = LIMIT, window: TimestampWindow | None = None) -> InvalidBatch:
    with pytest.raises(InvalidBatch, match=match) as info:
        validate_batch(batch, limit, window)
    return info.value


def test_a_producers_batch_is_valid_and_says_its_size() -> None:
    records = [RecordInput(b"k", b"v" * 100, [("h", b"x")], TS + i) for i in range(10)]
    for codec in Compression:
        valid = validate_batch(encode_batch(records, compression=codec), LIMIT)
        assert valid.header.records_count == 10 and valid.min_timestamp == TS
        assert valid.records_bytes == len(encode_batch(records)) - HEADER_BYTES


def test_garbage_records_under_a_valid_crc() -> None:
    refused(forge(b"\x13\x37" * 40, 1), r"record 0 \(byte 0 of the records section\) has length")


def test_codec_id_7_and_reserved_attribute_bits() -> None:
    good = record(b"v")
    refused(forge(good, 1, attributes=7), "unknown compression codec id 7")
    refused(forge(good, 1, attributes=0x40), "reserved bits set")


def test_records_count_2_pow_31_minus_1() -> None:
    refused(forge(record(b"v"), 2**31 - 1), "records_count 2147483647 cannot fit")
    two = record(b"v" * 40) + record(b"w" * 40, index=1)
    refused(forge(two, 3), "records_count says more records follow")
    refused(forge(record(b"v") + record(b"w", index=1), 1), "bytes follow the last of the 1 records")
    refused(forge(record(b"v"), 2, last_delta=0), "records_count 2 and last_offset_delta 0")


def test_offset_deltas_run_0_to_n_minus_1() -> None:
    refused(forge(record(b"v", index=1), 1), "has offset_delta 1")
    refused(forge(record(b"v") + record(b"w"), 2), r"record 1 \(byte \d+ of the records section\) has offset_delta 0")


def test_lengths_overrunning_the_record_or_the_section() -> None:
    refused(forge(record(b"v", length=10_000), 1), "has length 10000")
    refused(forge(record(b"v", length=3), 1), "has length 3")
    refused(forge(record(b"v", key=b"k")[:21] + struct.pack(">i", 500) + b"\0" * 12, 1), "outside|add up")
    bad_value = bytearray(record(b"value"))
    struct.pack_into(">i", bad_value, 21, 4000)  # the value length
    refused(forge(bytes(bad_value), 1), "value_length 4000")
    struct.pack_into(">i", bad_value, 21, -7)
    refused(forge(bytes(bad_value), 1), "value_length -7")
    refused(forge(record(b"v", attributes=1), 1), "attributes 1")


def test_header_counts() -> None:
    refused(forge(record(b"v", headers=struct.pack(">i", -1)), 1), "header_count -1")
    refused(forge(record(b"v", headers=struct.pack(">i", 2**31 - 1)), 1), "header_count 2147483647")
    one = struct.pack(">ii", 1, 1) + b"k" + struct.pack(">i", -1)  # one header: key "k", null value
    assert validate_batch(forge(record(b"v", headers=one), 1), LIMIT)
    refused(forge(record(b"v", headers=struct.pack(">i", 2) + one[4:]), 1), "header_count 2")
    not_utf8 = struct.pack(">ii", 1, 1) + b"\xff" + struct.pack(">i", -1)
    refused(forge(record(b"v", headers=not_utf8), 1), "key is not UTF-8")
    long_key = struct.pack(">ii", 1, 50) + b"k" + struct.pack(">i", -1)
    refused(forge(record(b"v", headers=long_key), 1), "key_length 50")


def test_negative_timestamps_and_the_first_of_int64() -> None:
    refused(forge(record(b"v"), 1, first_ts=-1, max_ts=-1), "negative timestamp")
    refused(forge(record(b"v"), 1, first_ts=I64_MIN, max_ts=I64_MIN), f"first_timestamp {I64_MIN}")
    # a delta that takes a record below zero, or past max_timestamp, or a max_timestamp no record has
    refused(forge(record(b"v") + record(b"w", index=1, ts_delta=-TS - 1), 2), "timestamp -1 is outside")
    refused(forge(record(b"v") + record(b"w", index=1, ts_delta=9), 2, max_ts=TS + 5), "outside 0..max_timestamp")
    refused(forge(record(b"v"), 1, max_ts=TS + 5), "max_timestamp is 1700000000005 but the largest record timestamp")
    refused(forge(record(b"v", ts_delta=1), 1, max_ts=TS + 1), "first record's timestamp_delta is 1")
    # an earlier record after a later one is fine (Kafka producers and georep's let callers set timestamps)
    later_then_earlier = forge(record(b"v") + record(b"w", index=1, ts_delta=-3), 2)
    assert validate_batch(later_then_earlier, LIMIT).min_timestamp == TS - 3


def test_the_origin_checks_timestamps_against_its_clock_as_kafka_does() -> None:
    batch = encode_batch([RecordInput(None, b"v", (), TS), RecordInput(None, b"w", (), TS + 10)])
    assert validate_batch(batch, LIMIT, TimestampWindow(TS, -1, 3_600_000))
    err = refused(batch, "3600011 ms after this site's clock", window=TimestampWindow(TS - 3_600_001, -1, 3_600_000))
    assert isinstance(err, TimestampOutOfRange) and "message_timestamp_after_max_ms=3600000" in str(err)
    err = refused(batch, "before this site's clock", window=TimestampWindow(TS + 100, 99, -1))
    assert "message_timestamp_before_max_ms=99" in str(err) and "-1: no limit" in str(err)
    assert validate_batch(batch, LIMIT, TimestampWindow(TS + 10**12, -1, -1))  # -1: no limit either way


def test_framing_magic_and_crc_are_damage_not_invalid_content() -> None:
    batch = encode_batch([RecordInput(None, b"v", (), TS)])
    n = len(batch)
    for bad, match in [(batch + b"\0", f"holds {n + 1}"), (batch[:-1], f"holds {n - 1}"), (batch[:50], "shorter")]:
        with pytest.raises(CorruptBatch, match=match) as info:
            validate_batch(bad, LIMIT)
        assert not isinstance(info.value, InvalidBatch)
    flipped = bytearray(batch)
    flipped[-1] ^= 1
    with pytest.raises(CrcMismatch):
        validate_batch(bytes(flipped), LIMIT)
    with pytest.raises(CorruptBatch, match="format version 2"):
        validate_batch(forge(record(b"v"), 1, magic=2), LIMIT)


def test_compressed_records_that_do_not_decompress() -> None:
    section = record(b"v" * 100)
    refused(forge(section, 1, attributes=1), "do not decompress as zstd")
    refused(forge(section, 1, attributes=2), "do not decompress as lz4")
    refused(forge(compress(Compression.ZSTD, section)[:-4], 1, attributes=1), "do not decompress as zstd")
    refused(forge(compress(Compression.LZ4, section)[:-4], 1, attributes=2), "lz4 frame is truncated")
    refused(forge(compress(Compression.LZ4, section) + b"!", 1, attributes=2), "1 bytes after their lz4 frame")
    refused(forge(compress(Compression.ZSTD, section) + b"!", 1, attributes=1), "do not decompress as zstd")
    # a valid frame whose records are garbage is as invalid as uncompressed garbage
    refused(forge(compress(Compression.ZSTD, b"\x13" * 99), 1, attributes=1), "has length")


def test_the_records_section_is_bounded_by_the_limit() -> None:
    section = record(b"v" * 1000)
    for codec in Compression:
        batch = forge(compress(codec, section), 1, attributes=int(codec))
        assert validate_batch(batch, len(section)).records_bytes == len(section)
        err = refused(batch, "limit of 1000", limit=1000)
        assert isinstance(err, RecordsTooLarge) and err.limit_bytes == 1000


@pytest.mark.parametrize(
    "codec, bomb, compressed_max",
    [
        ("zstd", "zstd_bomb(1 << 30)", 40_000),  # 1 GiB in ~32 KB, the frame silent about its size
        ("zstd", "zstd_bomb(1 << 30, declare_size=True)", 40_000),
        ("lz4", "lz4_bomb(256 << 20)", 1_200_000),  # lz4 compresses zeros ~250:1
        ("gzip", "gzip_bomb(256 << 20)", 1_200_000),  # deflate at level 1: ~1000:1 (issue 23)
        ("snappy", "snappy_bomb((1 << 32) - 1)", 60_000),  # a preamble declaring 4 GiB over 1 MiB (issue 23)
    ],
)
def test_a_decompression_bomb_is_refused_without_allocating_it(codec: str, bomb: str, compressed_max: int) -> None:
    """In a fresh process, so its peak memory is the validation's: at most a few times the 8 MiB limit."""
    script = textwrap.dedent(f"""
        import json, resource
        from tests.support.forge import forge, gzip_bomb, lz4_bomb, snappy_bomb, zstd_bomb
        from georep.record.validate import RecordsTooLarge, validate_batch
        section = {bomb}
        batch = forge(section, 1, attributes={int(Compression[codec.upper()])})
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            validate_batch(batch, {LIMIT})
            verdict = "accepted"
        except RecordsTooLarge as exc:
            verdict = str(exc)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps([len(section), verdict, before, after]))
    """)
    # From the checkout, which tests.support is imported from (the tests themselves run from an empty directory).
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        check=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
    )
    size, verdict, before_kib, after_kib = json.loads(out.stdout)
    assert size < compressed_max, size
    assert f"the {codec} records section" in verdict and f"limit of {LIMIT}" in verdict, verdict
    assert after_kib - before_kib < 4 * LIMIT // 1024, (before_kib, after_kib)


def test_readers_bound_decompression_too() -> None:
    stored = encode_batch(
        [RecordInput(None, b"v" * 5000, (), TS)], compression=Compression.ZSTD, origin=ORIGIN, base_origin_seq=0
    )
    with pytest.raises(RecordsTooLarge):
        decode_records(stored, limit_bytes=1000)
    assert len(decode_records(stored)) == 1


# --- properties ------------------------------------------------------------------

timestamps = st.integers(min_value=0, max_value=4_102_444_800_000)
optional_bytes = st.none() | st.binary(max_size=30)
records_strategy = st.lists(
    st.builds(
        RecordInput,
        key=optional_bytes,
        value=optional_bytes,
        headers=st.lists(st.tuples(st.text(max_size=6), optional_bytes), max_size=3),
        timestamp_ms=timestamps,
    ),
    min_size=1,
    max_size=10,
)
FAST = settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(records=records_strategy, codec=st.sampled_from(Compression))
def test_everything_a_producer_encodes_is_valid(records: list[RecordInput], codec: Compression) -> None:
    batch = encode_batch(records, compression=codec)
    valid = validate_batch(batch, LIMIT)
    assert valid.min_timestamp == min(r.timestamp_ms for r in records)
    assert valid.records_bytes == len(encode_batch(records)) - HEADER_BYTES


def _readers_agree(batch: bytes, count: int) -> None:
    """A batch the validator took: georep's decoder and the Kafka fetch conversion read all of it."""
    head, _crc = stamp_origin(batch, ORIGIN, 0)
    stored = head + batch[HEADER_BYTES:]
    assert len(decode_records(stored)) == count
    converted = convert_fetched(stored)
    assert converted.invalid == () and converted.data


@settings(max_examples=examples(1000), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile=hostile_batches())
def test_hostile_batches_are_refused_or_readable(hostile: tuple[bytes, str]) -> None:
    """Arbitrary records sections and header fields under a valid CRC: the validator raises only its own errors,
    and whatever it accepts every reader reads whole."""
    batch, _label = hostile
    try:
        valid = validate_batch(batch, LIMIT)
    except InvalidBatch as exc:
        event(f"refused: {str(exc).split(':')[0].split(' (')[0][:40]}")
        return
    event("accepted")
    _readers_agree(batch, valid.header.records_count)


@FAST
@given(records=records_strategy, codec=st.sampled_from(Compression), data=st.data())
def test_a_mutated_record_section_is_refused_or_readable(
    records: list[RecordInput], codec: Compression, data: st.DataObject
) -> None:
    batch = bytearray(encode_batch(records))
    at = data.draw(st.integers(HEADER_BYTES, len(batch) - 1), label="at")
    batch[at] = data.draw(st.integers(0, 255).filter(lambda b: b != batch[at]), label="byte")
    section = compress(codec, bytes(batch[HEADER_BYTES:]))
    forged = forge(
        section,
        len(records),
        attributes=int(codec),
        first_ts=records[0].timestamp_ms,
        max_ts=max(r.timestamp_ms for r in records),
    )
    try:
        validate_batch(forged, LIMIT)
    except InvalidBatch:
        return
    _readers_agree(forged, len(records))


# --- where the validator is used: the origin append, the apply, the error tables ----------------------------------


def test_the_origin_append_refuses_each_kind_with_its_own_error_and_stores_nothing() -> None:
    good = encode_batch([RecordInput(None, b"v", (), TS)])
    bomb = forge(compress(Compression.ZSTD, record(b"\0" * 5000)), 1, attributes=1)
    flipped = bytearray(good)
    flipped[-1] ^= 1
    cases = [
        (
            forge(record(b"v"), 1, attributes=7),
            errors.InvalidRecords,
            "unknown compression codec id 7",
            Code.INVALID_ARGUMENT,
            k.INVALID_RECORD,
        ),
        (
            bomb,
            errors.DecompressedTooLarge,
            "decompress to more than max_batch_bytes=4096",
            Code.INVALID_ARGUMENT,
            k.MESSAGE_TOO_LARGE,
        ),
        (
            encode_batch([RecordInput(None, b"v", (), TS + 3_600_001)]),
            errors.TimestampRefused,
            "message_timestamp_after_max_ms=3600000",
            Code.INVALID_ARGUMENT,
            k.INVALID_TIMESTAMP,
        ),
        (bytes(flipped), errors.BatchCrcMismatch, "CRC", Code.DATA_LOSS, k.CORRUPT_MESSAGE),
        (good + good, errors.MalformedBatch, "one batch per request", Code.INVALID_ARGUMENT, k.CORRUPT_MESSAGE),
    ]
    for batch, error, message, status, kafka_code in cases:
        log = MemoryLog()
        with pytest.raises(error, match=message) as info:
            append_as_origin(
                log,
                ProducerStateTable(),
                ORIGIN,
                batch,
                topic="t",
                max_batch_bytes=4096,
                now_ms=TS,
                window=TimestampWindow(TS),
            )
        assert log.log_end_offset == 0
        assert (status_of(info.value), k.error_code(info.value)) == (status, kafka_code), error


def stamped(seq: int, value: bytes = b"v", origin: Origin = ORIGIN) -> bytes:
    return encode_batch([RecordInput(None, value, (), TS)], origin=origin, base_origin_seq=seq)


def test_apply_stores_what_came_before_an_invalid_batch_and_nothing_from_it_on() -> None:
    other = Origin(SiteId("z"), 2)
    poison = forge(record(b"v", index=3), 1, site=b"x", epoch=1, seq=1)
    log = MemoryLog()
    with pytest.raises(InvalidChunk, match=r"origin x@1 origin seqs 1\.\.1 is invalid: record 0 .* offset_delta 3"):
        apply_chunk(
            log,
            stamped(0) + stamped(0, origin=other) + poison + stamped(2) + stamped(1, origin=other),
            now_ms=TS,
            limit_bytes=LIMIT,
        )
    assert log.vector() == {ORIGIN: 1, other: 1}
    # a batch the vector covers is skipped unread; one past the topic's limit is refused like any invalid one
    big = encode_batch(
        [RecordInput(None, b"w" * 5000, (), TS)], compression=Compression.LZ4, origin=ORIGIN, base_origin_seq=1
    )
    with pytest.raises(InvalidChunk, match=r"lz4 records section holds \d+ bytes, more than the limit of 4096"):
        apply_chunk(log, stamped(0) + big, now_ms=TS, limit_bytes=4096)
    unstamped = encode_batch([RecordInput(None, b"v", (), TS)])
    with pytest.raises(InvalidChunk, match="it is unstamped"):
        apply_chunk(log, unstamped, now_ms=TS)
    with pytest.raises(InvalidChunk, match="its origin is not a site"):
        apply_chunk(log, forge(record(b"v"), 1, site=b"X!", epoch=1, seq=1), now_ms=TS)
    assert log.vector() == {ORIGIN: 1, other: 1}
    # a CRC failure anywhere refuses the whole chunk, as before
    flipped = bytearray(stamped(2))
    flipped[-1] ^= 1
    with pytest.raises(CorruptChunk, match="CRC") as info:
        apply_chunk(log, stamped(1) + bytes(flipped), now_ms=TS)
    assert not isinstance(info.value, InvalidChunk) and log.vector() == {ORIGIN: 1, other: 1}
