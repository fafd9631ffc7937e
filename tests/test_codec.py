"""The batch codec: golden vectors, round trips, CRC scope and corruption handling.

Golden values were computed once and checked by hand against the layout in
``georep/record/batch.py``. If one changes, the on-disk and wire format
changed: every site, segment file and Spark audit reader is affected.
"""

from __future__ import annotations

import contextlib
import struct

import crc32c
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from georep.record.batch import (
    CRC_START,
    HEADER,
    HEADER_BYTES,
    LENGTH_PREFIX_BYTES,
    REWRITTEN_BYTES,
    CorruptBatch,
    RecordInput,
    check_batch,
    decode_records,
    encode_batch,
    frame_length,
    iter_headers,
    local_prefix,
    parse_header,
    stamp_origin,
)
from georep.record.compression import Compression, DecompressionError
from offsets.coordinates import EPOCH_MAX, Origin
from tests.support.examples import examples
from topology.ids import SiteId

TS = 1_700_000_000_000
ORIGIN = Origin(SiteId("us-east"), 1_700_000_000)

SMALL = [RecordInput(b"k", b"v", [], TS)]
SMALL_HEX = (
    "0000000000000000"  # base_offset
    "00000080"  # batch_length 128
    "0000000000000000"  # append_time_ms
    "39b08bc4"  # crc
    "01"  # magic
    "0000"  # attributes: no compression
    + "00"
    * 32  # origin_site: unstamped
    + "00000000"  # origin_epoch
    "ffffffffffffffff"  # base_origin_seq -1
    "00000000"  # last_offset_delta
    "0000018bcfe56800"  # first_timestamp
    "0000018bcfe56800"  # max_timestamp
    "ffffffffffffffff"  # producer_id -1
    "ffff"  # producer_epoch -1
    "ffffffff"  # base_sequence -1
    "00000001"  # records_count
    "0000001b"  # record length 27
    "00"  # record attributes
    "0000000000000000"  # timestamp_delta
    "00000000"  # offset_delta
    "00000001"
    "6b"  # key b"k"
    "00000001"
    "76"  # value b"v"
    "00000000"  # header_count
)

RICH = [
    RecordInput(b"key-0", b"value-0", [], TS),
    RecordInput(None, b"v1", [("h1", b"x"), ("h2", None)], TS + 5),
    RecordInput(b"k2", None, [("trace-id", b"")], TS - 3),  # timestamps need not be monotone
    RecordInput(b"", b"", [], TS + 1),
    RecordInput(None, None, [("\u00e9t\u00e9", b"\x00\xff")], TS),
]
RICH_PRODUCER = {"producer_id": 123_456_789, "producer_epoch": 3, "base_sequence": 42}
RICH_LENGTH = 322  # 109 header + records of 41, 52, 47, 29 and 44 bytes
RICH_CRC = 0xC166534F
RICH_STAMPED_CRC = 0x6A926286
RICH_STAMPED_SEQ = 1000


def test_crc32c_check_value() -> None:
    # The CRC-32C (Castagnoli) check value: proves the polynomial, not just the library.
    assert crc32c.crc32c(b"123456789") == 0xE3069283


def test_small_batch_bytes_are_pinned() -> None:
    batch = encode_batch(SMALL)
    assert batch.hex() == SMALL_HEX
    assert len(batch) == 140 == HEADER_BYTES + 31
    assert check_batch(batch).crc == 0x39B08BC4


def test_rich_batch_length_and_crc_are_pinned() -> None:
    batch = encode_batch(RICH, **RICH_PRODUCER)
    header = check_batch(batch)
    assert len(batch) == RICH_LENGTH == header.size_bytes
    assert header.crc == RICH_CRC
    assert (header.producer_id, header.producer_epoch, header.base_sequence) == (123_456_789, 3, 42)
    assert header.last_sequence == 46
    assert (header.first_timestamp, header.max_timestamp) == (TS, TS + 5)
    assert (header.records_count, header.last_offset_delta) == (5, 4)
    assert not header.stamped


def test_rich_batch_stamped_and_rewritten_is_pinned() -> None:
    batch = encode_batch(RICH, **RICH_PRODUCER)
    head, crc = stamp_origin(batch, ORIGIN, RICH_STAMPED_SEQ)
    assert crc == RICH_STAMPED_CRC
    body = head[REWRITTEN_BYTES:] + batch[HEADER_BYTES:]
    stored = local_prefix(77, len(batch) - LENGTH_PREFIX_BYTES, TS + 9, crc) + body
    assert len(stored) == RICH_LENGTH
    header = check_batch(stored)
    assert header.origin == ORIGIN and header.stamped
    assert (header.base_offset, header.append_time_ms, header.base_origin_seq) == (77, TS + 9, 1000)
    records = decode_records(stored, header)
    assert [r.offset for r in records] == [77, 78, 79, 80, 81]
    assert [r.origin_seq for r in records] == [1000, 1001, 1002, 1003, 1004]
    assert {r.origin for r in records} == {ORIGIN}
    assert [(r.key, r.value, list(r.headers), r.timestamp_ms) for r in records] == [
        (b"key-0", b"value-0", [], TS),
        (None, b"v1", [("h1", b"x"), ("h2", None)], TS + 5),
        (b"k2", None, [("trace-id", b"")], TS - 3),
        (b"", b"", [], TS + 1),
        (None, None, [("\u00e9t\u00e9", b"\x00\xff")], TS),
    ]


def test_encode_with_origin_equals_stamping() -> None:
    """A batch encoded already stamped has the same CRC-covered bytes as one stamped later."""
    batch = encode_batch(RICH, **RICH_PRODUCER)
    head, crc = stamp_origin(batch, ORIGIN, RICH_STAMPED_SEQ)
    direct = encode_batch(RICH, **RICH_PRODUCER, origin=ORIGIN, base_origin_seq=RICH_STAMPED_SEQ)
    assert direct[CRC_START:] == head[CRC_START:] + batch[HEADER_BYTES:]
    assert check_batch(direct).crc == crc


def test_iter_headers_leaves_out_a_torn_tail() -> None:
    one = encode_batch(SMALL)
    two = encode_batch(RICH, **RICH_PRODUCER)
    log = one + two + two[:50]
    assert [h.size_bytes for h in iter_headers(log, verify=True)] == [len(one), len(two)]
    assert frame_length(log, len(one)) == len(two)
    with pytest.raises(CorruptBatch):
        frame_length(log, len(one) + len(two) + 40)


def test_empty_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one record"):
        encode_batch([])


# --- properties ------------------------------------------------------------------

timestamps = st.integers(min_value=0, max_value=4_102_444_800_000)  # 1970 .. 2100
optional_bytes = st.none() | st.binary(max_size=40)
headers = st.lists(st.tuples(st.text(max_size=8), optional_bytes), max_size=3)
records_strategy = st.lists(
    st.builds(RecordInput, key=optional_bytes, value=optional_bytes, headers=headers, timestamp_ms=timestamps),
    min_size=1,
    max_size=12,
)
origins = st.builds(
    Origin, site=st.from_regex(r"[a-z][a-z0-9-]{0,31}", fullmatch=True).map(SiteId), epoch=st.integers(0, EPOCH_MAX)
)
producers = st.one_of(
    st.just({"producer_id": -1, "producer_epoch": -1, "base_sequence": -1}),
    st.fixed_dictionaries(
        {
            "producer_id": st.integers(0, 2**62),
            "producer_epoch": st.integers(0, 2**15 - 1),
            "base_sequence": st.integers(0, 2**31 - 1),
        }
    ),
)
FAST = settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _stored(batch: bytes, origin: Origin, base_origin_seq: int, base_offset: int, append_time_ms: int) -> bytes:
    """What a site's log holds after the origin stamps the batch and a site writes its prefix."""
    head, crc = stamp_origin(batch, origin, base_origin_seq)
    return (
        local_prefix(base_offset, len(batch) - LENGTH_PREFIX_BYTES, append_time_ms, crc)
        + head[REWRITTEN_BYTES:]
        + batch[HEADER_BYTES:]
    )


@FAST
@given(
    records=records_strategy,
    compression=st.sampled_from(Compression),
    producer=producers,
    origin=origins,
    base_origin_seq=st.integers(0, 2**62),
    base_offset=st.integers(0, 2**62),
    append_time_ms=timestamps,
)
def test_round_trip(
    records: list[RecordInput],
    compression: Compression,
    producer: dict[str, int],
    origin: Origin,
    base_origin_seq: int,
    base_offset: int,
    append_time_ms: int,
) -> None:
    batch = encode_batch(records, compression=compression, **producer)
    produced = check_batch(batch)
    assert produced.compression == compression and not produced.stamped

    stored = _stored(batch, origin, base_origin_seq, base_offset, append_time_ms)
    header = check_batch(stored)
    assert header.origin == origin
    assert (header.base_offset, header.append_time_ms, header.base_origin_seq) == (
        base_offset,
        append_time_ms,
        base_origin_seq,
    )
    assert (header.producer_id, header.producer_epoch, header.base_sequence) == (
        producer["producer_id"],
        producer["producer_epoch"],
        producer["base_sequence"],
    )
    assert header.records_count == len(records)
    assert header.first_timestamp == records[0].timestamp_ms
    assert header.max_timestamp == max(r.timestamp_ms for r in records)
    assert header.next_origin_seq == base_origin_seq + len(records)

    decoded = decode_records(stored, header)
    assert [(r.key, r.value, list(r.headers), r.timestamp_ms) for r in decoded] == [
        (r.key, r.value, list(r.headers), r.timestamp_ms) for r in records
    ]
    assert [r.offset for r in decoded] == [base_offset + i for i in range(len(records))]
    assert [r.origin_seq for r in decoded] == [base_origin_seq + i for i in range(len(records))]
    assert all(r.origin == origin for r in decoded)


@FAST
@given(
    records=records_strategy,
    compression=st.sampled_from(Compression),
    prefixes=st.lists(st.tuples(st.integers(0, 2**63 - 1), st.integers(-(2**63), 2**63 - 1)), min_size=2, max_size=4),
)
def test_rewriting_the_local_prefix_never_changes_the_crc(
    records: list[RecordInput], compression: Compression, prefixes: list[tuple[int, int]]
) -> None:
    batch = encode_batch(records, compression=compression, origin=ORIGIN, base_origin_seq=5)
    crc = check_batch(batch).crc
    for base_offset, append_time_ms in prefixes:
        rewritten = local_prefix(base_offset, len(batch) - LENGTH_PREFIX_BYTES, append_time_ms, crc) + batch[24:]
        header = check_batch(rewritten)
        assert header.crc == crc == crc32c.crc32c(rewritten[CRC_START:])
        assert (header.base_offset, header.append_time_ms) == (base_offset, append_time_ms)


@FAST
@given(records=records_strategy, compression=st.sampled_from(Compression), data=st.data())
def test_any_single_byte_change_after_the_prefix_is_detected(
    records: list[RecordInput], compression: Compression, data: st.DataObject
) -> None:
    batch = _stored(encode_batch(records, compression=compression), ORIGIN, 0, 10, TS)
    position = data.draw(st.integers(CRC_START, len(batch) - 1), label="position")
    flip = data.draw(st.integers(1, 255), label="xor")
    damaged = bytearray(batch)
    damaged[position] ^= flip
    with pytest.raises(CorruptBatch):
        check_batch(bytes(damaged))


@FAST
@given(records=records_strategy, compression=st.sampled_from(Compression), data=st.data())
def test_truncated_batches_raise_corrupt_batch(
    records: list[RecordInput], compression: Compression, data: st.DataObject
) -> None:
    batch = _stored(encode_batch(records, compression=compression), ORIGIN, 0, 10, TS)
    cut = data.draw(st.integers(0, len(batch) - 1), label="cut")
    truncated = batch[:cut]
    with pytest.raises(CorruptBatch):
        check_batch(truncated)
    with pytest.raises((CorruptBatch, DecompressionError)):
        decode_records(truncated)
    assert iter_headers(truncated) == []


def _only_codec_errors(buf: bytes) -> None:
    """Parsing untrusted bytes may fail only with the codec's own errors."""
    for parse in (parse_header, check_batch, decode_records):
        with contextlib.suppress(CorruptBatch, DecompressionError):
            parse(buf)


@settings(max_examples=examples(300), deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_raise_only_codec_errors(buf: bytes) -> None:
    _only_codec_errors(buf)


@settings(max_examples=examples(300), deadline=None)
@given(records_count=st.integers(1, 2**31 - 1), compression=st.integers(0, 2**15 - 1), body=st.binary(max_size=200))
def test_valid_header_with_random_records_raises_only_codec_errors(
    records_count: int, compression: int, body: bytes
) -> None:
    """A well-framed header in front of garbage: the record decoder must not crash or hang."""
    head = HEADER.pack(
        0,
        HEADER_BYTES - LENGTH_PREFIX_BYTES + len(body),
        0,
        0,
        1,
        compression,
        b"a",
        1,
        0,
        records_count - 1,
        TS,
        TS,
        -1,
        -1,
        -1,
        records_count,
    )
    _only_codec_errors(head + body)


@settings(max_examples=examples(300), deadline=None)
@given(records=records_strategy, data=st.data())
def test_damaged_records_raise_only_codec_errors(records: list[RecordInput], data: st.DataObject) -> None:
    """Bytes damaged inside the records section (as a bad producer could send them) fail cleanly."""
    batch = bytearray(encode_batch(records))
    if len(batch) == HEADER_BYTES:
        return
    for _ in range(data.draw(st.integers(1, 4), label="damages")):
        position = data.draw(st.integers(HEADER_BYTES, len(batch) - 1), label="position")
        batch[position] = data.draw(st.integers(0, 255), label="byte")
    _only_codec_errors(bytes(batch))


@pytest.mark.parametrize(
    "field_bytes",
    [
        struct.pack(">i", -2),  # key_length below -1
        struct.pack(">i", 2**31 - 1),  # key_length past the record
    ],
)
def test_bad_key_length_is_corrupt(field_bytes: bytes) -> None:
    batch = bytearray(encode_batch(SMALL))
    key_length_at = HEADER_BYTES + 4 + 1 + 8 + 4
    batch[key_length_at : key_length_at + 4] = field_bytes
    with pytest.raises(CorruptBatch):
        decode_records(bytes(batch))


def test_header_with_invalid_utf8_key_is_corrupt() -> None:
    batch = bytearray(encode_batch([RecordInput(b"k", b"v", [("ab", None)], TS)]))
    at = batch.index(b"ab")
    batch[at : at + 2] = b"\xff\xfe"
    with pytest.raises(CorruptBatch):
        decode_records(bytes(batch))


def test_negative_header_count_and_lengths_are_corrupt() -> None:
    batch = bytearray(encode_batch([RecordInput(b"k", b"v", [("ab", b"cd")], TS)]))
    at = batch.index(b"ab") - 4  # header key length
    for field_at, value in ((at - 4, -1), (at, -8), (at + 6, -2)):  # count, key length, value length
        damaged = bytearray(batch)
        damaged[field_at : field_at + 4] = struct.pack(">i", value)
        with pytest.raises(CorruptBatch):
            decode_records(bytes(damaged))


def test_bad_magic_says_which_version() -> None:
    batch = bytearray(encode_batch(SMALL))
    batch[24] = 9
    with pytest.raises(CorruptBatch, match="format version 9"):
        parse_header(bytes(batch))


def test_huge_header_count_with_backward_lengths_fails_fast() -> None:
    """A header key length of -8 after a null-valued header once made the header loop stand still."""
    batch = bytearray(encode_batch([RecordInput(b"k", b"v", [("ab", None), ("cd", None)], TS)]))
    first = batch.index(b"ab") - 4
    second = batch.index(b"cd") - 4
    batch[first - 4 : first] = struct.pack(">i", 2**31 - 1)  # header_count
    batch[second : second + 4] = struct.pack(">i", -8)  # steps back onto the first header's value_length -1
    with pytest.raises(CorruptBatch):
        decode_records(bytes(batch))


def test_repeated_offset_delta_is_corrupt() -> None:
    """Two records claiming one offset would give two records one coordinate (I2)."""
    batch = bytearray(encode_batch([RecordInput(b"a", b"1", [], TS), RecordInput(b"b", b"2", [], TS)]))
    second = HEADER_BYTES + 4 + 27  # the first record: length field, then 27 bytes
    delta_at = second + 4 + 1 + 8
    assert batch[delta_at : delta_at + 4] == struct.pack(">i", 1)
    batch[delta_at : delta_at + 4] = struct.pack(">i", 0)
    with pytest.raises(CorruptBatch, match="offset_delta"):
        decode_records(bytes(batch))
