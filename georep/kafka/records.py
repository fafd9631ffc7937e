"""Kafka record batches (v2, magic 2) to georep batches and back. Pure: bytes in, bytes out.

The two layouts carry the same things (``georep/record/batch.py``): producer id, epoch and base
sequence, a first and a max timestamp, records with key, value, headers and timestamp. They differ in
encoding (Kafka's records are varint-framed, georep's are fixed-width) and in what georep adds: the origin
and origin seq, stamped by the site that first accepts the batch. So a batch is converted at the gateway,
once each way, with kafka-python's maintained codec (``kafka.record``: its batch header struct, its varint
encoder and decoder, its reader for compressed batches), copying each record's bytes once:

* **Produce** (:func:`kafka_to_georep`). An uncompressed batch is walked in place (its CRC checked over a
  view of the request) and each record's key and value, as views, go straight into georep's encoder: the
  record bytes are copied once, into the georep batch. A compressed one (gzip, lz4, zstd; snappy only with
  python-snappy) goes through kafka-python's reader, which decompresses it. The producer's id, epoch and
  base sequence are kept, so georep's producer table (``dedup/producer.py``) deduplicates the idempotent
  producer's retries with Kafka's own rules.
* **Fetch** (:func:`georep_to_kafka`). Each stored batch is walked in place and becomes, in one pass,
  one Kafka batch (uncompressed) with the same base
  offset (a Kafka offset is the site's local offset) and the records' offset deltas, CreateTime
  timestamps, and two more headers per record: ``georep.origin`` (``site@epoch``) and
  ``georep.origin_seq`` (decimal), the record's coordinate, the same at every site.
  Records a ``skip`` vector covers are left out (a consumer that resumed at another site from a
  committed vector: see ``georep/kafka/offsets.py``); Kafka clients accept offset gaps, as after
  compaction. A batch left with no record becomes an empty batch (records count 0) that still spans its
  offsets, as compaction leaves them, so the consumer's position moves past it.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import cast

import crc32c
from kafka.record.default_records import DefaultRecordBatch
from kafka.record.util import decode_varint, encode_varint, size_of_varint

from georep.record.batch import (
    HEADER_BYTES,
    RECORD_HEAD,
    CorruptBatch,
    RecordInput,
    encode_batch,
    headers_in,
    parse_header,
)
from georep.record.compression import decompress
from offsets.coordinates import Origin

ORIGIN_HEADER = "georep.origin"
ORIGIN_SEQ_HEADER = "georep.origin_seq"
MAGIC_V2 = 2
_BATCH_HEAD_MIN = 61  # a v2 batch header
_LENGTH = struct.Struct(">qi")
# Offsets inside a v2 batch header (Kafka's DefaultRecordBatch): the CRC covers from the attributes on.
_CRC_AT = 17
_ATTRIBUTES_AT = 21
_KAFKA_HEAD = DefaultRecordBatch.HEADER_STRUCT
_I32 = struct.Struct(">i")
_ORIGIN_KEY = ORIGIN_HEADER.encode()
_ORIGIN_SEQ_KEY = ORIGIN_SEQ_HEADER.encode()
_CODEC_MASK = 0x07
_TRANSACTIONAL = 0x10
_CONTROL = 0x20
_CODEC_NAMES = {1: "gzip", 2: "snappy", 3: "lz4", 4: "zstd"}


class RecordsError(ValueError):
    """A produce request's records that the gateway cannot take; ``code`` is the Kafka error code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


CORRUPT_MESSAGE = 2
UNSUPPORTED_FOR_MESSAGE_FORMAT = 43
UNSUPPORTED_COMPRESSION_TYPE = 76
INVALID_RECORD = 87


def kafka_to_georep(data: bytes | memoryview) -> bytes:
    """One Kafka v2 record batch (a Produce request's records of one partition) as one unstamped georep batch.

    Raises :class:`RecordsError`: not exactly one v2 batch, a bad CRC, a transactional or control batch
    (transactions are not supported), or a compression codec this process cannot decode."""
    buf = memoryview(data)
    if len(buf) < _BATCH_HEAD_MIN:
        raise RecordsError(CORRUPT_MESSAGE, f"records of {len(buf)} bytes hold no whole record batch")
    _base, length = _LENGTH.unpack_from(buf, 0)
    if 12 + length != len(buf):
        raise RecordsError(INVALID_RECORD, "a produce request must hold exactly one record batch per partition")
    if buf[16] != MAGIC_V2:
        raise RecordsError(UNSUPPORTED_FOR_MESSAGE_FORMAT,
                           f"record batch magic {buf[16]}: only v2 batches (Kafka 0.11+) are taken")  # fmt: skip
    head = DefaultRecordBatch.HEADER_STRUCT.unpack_from(buf, 0)
    attributes, first_ts, producer_id, producer_epoch, base_sequence, count = (head[5], head[7], head[9], head[10],
                                                                               head[11], head[12])  # fmt: skip
    if crc32c.crc32c(buf[_ATTRIBUTES_AT:]) != head[4]:
        raise RecordsError(CORRUPT_MESSAGE, "record batch CRC mismatch")
    if attributes & (_TRANSACTIONAL | _CONTROL):
        raise RecordsError(INVALID_RECORD, "transactional producers are not supported by georep's Kafka gateway")
    if not attributes & _CODEC_MASK:
        records = _records_in_place(buf, count, first_ts)
    else:
        records = _decompressed_records(bytes(buf))
    if not records:
        raise RecordsError(INVALID_RECORD, "a record batch with no records")
    return encode_batch(records, producer_id=producer_id, producer_epoch=producer_epoch, base_sequence=base_sequence)


def _records_in_place(buf: memoryview, count: int, first_ts: int) -> list[RecordInput]:
    """The records of an uncompressed batch, keys and values as views of the request's bytes: georep's encoder
    copies them once, into the georep batch. The walk uses kafka-python's varint decoder and Kafka's record
    layout (length, attributes, timestamp delta, offset delta, key, value, headers); georep's batch has no
    offset gaps, so the offset deltas must be 0, 1, 2 ..., as every producer writes them."""
    out: list[RecordInput] = []
    pos = _BATCH_HEAD_MIN
    try:
        for index in range(count):
            length, pos = decode_varint(buf, pos)
            end = pos + length
            _attributes, pos = decode_varint(buf, pos)
            ts_delta, pos = decode_varint(buf, pos)
            offset_delta, pos = decode_varint(buf, pos)
            if offset_delta != index:
                raise RecordsError(INVALID_RECORD, f"record {index} has offset delta {offset_delta}: a produced "
                                   "batch's offset deltas run 0, 1, 2 ...")  # fmt: skip
            key_len, pos = decode_varint(buf, pos)
            key = buf[pos : pos + key_len] if key_len >= 0 else None
            pos += max(key_len, 0)
            value_len, pos = decode_varint(buf, pos)
            value = buf[pos : pos + value_len] if value_len >= 0 else None
            pos += max(value_len, 0)
            header_count, pos = decode_varint(buf, pos)
            headers: list[tuple[str, bytes | None]] = []
            for _h in range(header_count):
                hk_len, pos = decode_varint(buf, pos)
                hk = bytes(buf[pos : pos + hk_len]).decode()
                pos += hk_len
                hv_len, pos = decode_varint(buf, pos)
                headers.append((hk, bytes(buf[pos : pos + hv_len]) if hv_len >= 0 else None))
                pos += max(hv_len, 0)
            if pos != end or end > len(buf) or header_count < 0 or key_len < -1 or value_len < -1:
                raise RecordsError(CORRUPT_MESSAGE, f"record {index} of the batch has inconsistent lengths")
            # encode_batch takes a key's and a value's length and joins them: a view serves as well as bytes.
            out.append(RecordInput(cast(bytes | None, key), cast(bytes | None, value), headers, first_ts + ts_delta))
    except (IndexError, UnicodeDecodeError) as exc:
        raise RecordsError(CORRUPT_MESSAGE, f"record batch truncated or corrupt: {exc}") from None
    if pos != len(buf):
        raise RecordsError(CORRUPT_MESSAGE, f"{len(buf) - pos} bytes after the batch's last record")
    return out


def _decompressed_records(buf: bytes) -> list[RecordInput]:
    """The records of a compressed batch, through kafka-python's reader (it decompresses)."""
    batch = DefaultRecordBatch(buf)
    try:
        records = [RecordInput(r.key, r.value, r.headers, r.timestamp) for r in batch]
    except Exception as exc:  # kafka-python raises several types for a codec it lacks or corrupt data
        codec = _CODEC_NAMES.get(batch.compression_type, str(batch.compression_type))
        raise RecordsError(UNSUPPORTED_COMPRESSION_TYPE, f"cannot read the {codec} records: {exc}") from None
    return records


def georep_to_kafka(chunk: bytes, from_offset: int = 0, skip: Mapping[Origin, int] | None = None,
                    skip_below: int = -1) -> bytes:  # fmt: skip
    """Whole georep batches (as a log read returns them) as Kafka v2 batches, concatenated.

    ``skip``: leave out the records this vector covers, in batches that start below ``skip_below`` (from
    there on the vector covers nothing). Batches ending before ``from_offset`` are left out whole; a batch
    that holds it is sent whole, as Kafka does (the client drops the records before its position)."""
    out = bytearray()
    view = memoryview(chunk)
    pos = 0
    for header in headers_in(chunk):
        size = header.size_bytes
        if header.next_offset > from_offset:
            covers = skip if skip is not None and header.base_offset < skip_below else None
            if covers is not None and header.last_origin_seq < covers.get(header.origin, 0):
                out += empty_batch(header.base_offset, header.last_offset_delta, header.max_timestamp)
            else:
                out += _convert(view[pos : pos + size], covers)
        pos += size
    return bytes(out)


def _convert(batch: memoryview, skip: Mapping[Origin, int] | None) -> bytearray:
    """One stored georep batch as one Kafka v2 batch, written in one pass: each record's key, value and headers
    are copied once, from the stored batch (a view of the log read) into the Kafka batch. Kafka's record layout
    with kafka-python's varint encoder and batch header struct; the CRC-32C over the result."""
    h = parse_header(batch)
    body = memoryview(decompress(h.compression, batch[HEADER_BYTES : h.size_bytes]))
    covered = -1 if skip is None else skip.get(h.origin, 0)  # records with origin_seq < covered are left out
    # The two coordinate headers: all but the seq's digits are the same for every record of the batch.
    coordinate = bytearray()
    for part in (_ORIGIN_KEY, str(h.origin).encode(), _ORIGIN_SEQ_KEY):
        _write_bytes(coordinate, memoryview(part))
    out = bytearray(_KAFKA_HEAD.size)
    write_byte = out.append
    unpack_head = RECORD_HEAD.unpack_from  # length, attributes, timestamp delta, offset delta, key length
    unpack_i32 = _I32.unpack_from
    pos = 0
    kept = 0
    max_ts = h.first_timestamp
    base_seq = h.base_origin_seq
    for index in range(h.records_count):
        length, _attributes, ts_delta, delta, key_len = unpack_head(body, pos)
        if delta != index:
            raise CorruptBatch(f"record {index} of the batch at offset {h.base_offset} has offset delta {delta}")
        rec_end = pos + 4 + length
        if base_seq + index < covered:
            pos = rec_end
            continue
        p = pos + RECORD_HEAD.size
        key = body[p : p + key_len] if key_len >= 0 else None
        p += max(key_len, 0)
        (value_len,) = unpack_i32(body, p)
        p += 4
        value = body[p : p + value_len] if value_len >= 0 else None
        p += max(value_len, 0)
        (header_count,) = unpack_i32(body, p)
        p += 4
        headers = bytearray()  # the record's own headers, re-framed; usually none
        for _h in range(header_count):
            (hk_len,) = unpack_i32(body, p)
            _write_bytes(headers, body[p + 4 : p + 4 + hk_len])
            p += 4 + hk_len
            (hv_len,) = unpack_i32(body, p)
            p += 4
            _write_bytes(headers, body[p : p + hv_len] if hv_len >= 0 else None)
            p += max(hv_len, 0)
        pos = rec_end
        kept += 1
        if ts_delta > 0:
            max_ts = max(max_ts, h.first_timestamp + ts_delta)
        seq_text = b"%d" % (base_seq + index)
        size = (1 + size_of_varint(ts_delta) + size_of_varint(delta) + _bytes_size(key) + _bytes_size(value)
                + size_of_varint(header_count + 2) + len(headers) + len(coordinate) + 1 + len(seq_text))  # fmt: skip
        encode_varint(size, write_byte)
        write_byte(0)  # attributes
        encode_varint(ts_delta, write_byte)
        encode_varint(delta, write_byte)
        _write_bytes(out, key)
        _write_bytes(out, value)
        encode_varint(header_count + 2, write_byte)
        out += headers
        out += coordinate
        write_byte(len(seq_text) << 1)  # its length as a varint: at most 20 digits, one byte
        out += seq_text
    if not kept:
        return empty_batch(h.base_offset, h.last_offset_delta, h.max_timestamp)
    return _sealed(out, h.base_offset, h.last_offset_delta, h.first_timestamp, max_ts, kept)


def _sealed(out: bytearray, base_offset: int, last_delta: int, first_ts: int, max_ts: int, count: int) -> bytearray:
    """``out`` (a header's room, then ``count`` records) with its v2 batch header written and its CRC-32C: no
    producer id (fetched records carry none), no attributes (uncompressed, CreateTime)."""
    _KAFKA_HEAD.pack_into(out, 0, base_offset, len(out) - 12, 0, MAGIC_V2, 0, 0, last_delta, first_ts, max_ts,
                          -1, -1, -1, count)  # fmt: skip
    struct.pack_into(">I", out, _CRC_AT, crc32c.crc32c(memoryview(out)[_ATTRIBUTES_AT:]))
    return out


def _bytes_size(data: memoryview | None) -> int:
    return 1 if data is None else size_of_varint(len(data)) + len(data)


def _write_bytes(out: bytearray, data: memoryview | None) -> None:
    if data is None:
        encode_varint(-1, out.append)
        return
    encode_varint(len(data), out.append)
    out += data


def empty_batch(base_offset: int, last_delta: int, timestamp_ms: int) -> bytearray:
    """A v2 batch with no records spanning ``base_offset .. base_offset + last_delta``: what compaction leaves
    of a batch whose records all went; consumers move their position past it."""
    return _sealed(bytearray(_KAFKA_HEAD.size), base_offset, last_delta, timestamp_ms, timestamp_ms, 0)
