"""Kafka record batches (v2, magic 2) to georep batches and back. Pure: bytes in, bytes out.

The two layouts carry the same things (``georep/record/batch.py``): producer id, epoch and base
sequence, a first and a max timestamp, records with key, value, headers and timestamp. They differ in
encoding (Kafka's records are varint-framed, georep's are fixed-width) and in what georep adds: the origin
and origin seq, stamped by the site that first accepts the batch. So a batch is converted at the gateway,
once each way, with kafka-python's maintained codec (``kafka.record``: its batch header struct, its varint
encoder and decoder, its reader for compressed batches), copying each record's bytes once:

* **Produce** (:func:`kafka_to_georep`). The batch is validated before it is converted: exactly one v2
  batch, its CRC, no transactional or control batch, a codec this process reads, and its records walked
  once, each with its length, offset delta (0, 1, 2 ...), key, value and headers inside the batch, with no
  byte left over. An uncompressed batch is walked in place (its CRC checked over a view of the request)
  and each record's key and value, as views, go straight into georep's encoder: the record bytes are copied
  once, into the georep batch. A compressed one (gzip, snappy raw or xerial, lz4, zstd) is decompressed first,
  bounded by the topic's ``max_batch_bytes`` (``georep/record/compression.py``): a bomb is refused with
  ``MESSAGE_TOO_LARGE`` having cost about that much memory, never what it would have grown to. Its converted
  records are compressed again with the same codec (georep's id for it): one compressed Kafka batch is stored
  as one compressed georep batch. The records cannot stay in Kafka's compressed bytes, as georep's record
  layout is not Kafka's (docs/design.md, "Every codec, stored compressed"). The producer's id, epoch
  and base sequence are kept, so georep's producer table (``dedup/producer.py``) deduplicates the
  idempotent producer's retries with Kafka's own rules. The georep batch then goes through the origin
  append, whose validation (``georep/record/validate.py``) checks it once more, timestamps included.
* **Fetch** (:func:`georep_to_kafka`). Each stored batch is walked in place and becomes, in one pass,
  one Kafka batch, uncompressed whatever the stored codec (decompressed at most ``READ_RECORDS_BYTES_MAX``;
  docs/kafka.md, "Compression", says why), with the same base
  offset (a Kafka offset is the site's local offset) and the records' offset deltas, CreateTime
  timestamps, and two more headers per record: ``georep.origin`` (``site@epoch``) and
  ``georep.origin_seq`` (decimal), the record's coordinate, the same at every site.
  Records a ``skip`` vector covers are left out (a consumer that resumed at another site from a
  committed vector: see ``georep/kafka/offsets.py``); Kafka clients accept offset gaps, as after
  compaction. A batch left with no record becomes an empty batch (records count 0) that still spans its
  offsets, as compaction leaves them, so the consumer's position moves past it.
* **An invalid stored batch** (stored before validation existed, or by a build without it) is decompressed
  at most ``READ_RECORDS_BYTES_MAX`` and never crashes a fetch: the batches before it are served, and it
  becomes an empty batch spanning its offsets, so Kafka consumers move past it as past compacted records,
  and :func:`georep_to_kafka` reports it for the gateway to log (docs/kafka.md says why).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import NamedTuple, cast

import crc32c
from kafka.record.default_records import DefaultRecordBatch
from kafka.record.util import decode_varint, encode_varint, size_of_varint

from georep.record.batch import (
    HEADER_BYTES,
    READ_RECORDS_BYTES_MAX,
    RECORD_HEAD,
    BatchHeader,
    CorruptBatch,
    InvalidBatch,
    RecordInput,
    decompress_records,
    encode_batch,
    headers_in,
    walk_records,
)
from georep.record.compression import (
    Compression,
    DecompressedTooLarge,
    DecompressionError,
    decompress,
    decompress_kafka_snappy,
)
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
MESSAGE_TOO_LARGE = 10
UNSUPPORTED_FOR_MESSAGE_FORMAT = 43
UNSUPPORTED_COMPRESSION_TYPE = 76
INVALID_RECORD = 87
_GZIP, _SNAPPY, _LZ4, _ZSTD = 1, 2, 3, 4
# Kafka's codec ids and georep's differ: a Kafka batch is stored in its producer's codec, under georep's id.
_STORED_AS = {_GZIP: Compression.GZIP, _SNAPPY: Compression.SNAPPY, _LZ4: Compression.LZ4, _ZSTD: Compression.ZSTD}
_RECORD_MIN_BYTES = 7  # length, attributes, timestamp delta, offset delta, key, value, header count: a byte each


def kafka_to_georep(data: bytes | memoryview, limit_bytes: int = READ_RECORDS_BYTES_MAX) -> bytes:
    """One Kafka v2 record batch (a Produce request's records of one partition) as one unstamped georep batch;
    its records decompress into at most ``limit_bytes`` (the topic's ``max_batch_bytes``).

    Raises :class:`RecordsError`: not exactly one v2 batch, a bad CRC, a transactional or control batch
    (transactions are not supported), a compression codec this process cannot decode, records that decompress
    past the limit, or records that are not what the batch says."""
    buf = memoryview(data)
    if len(buf) < _BATCH_HEAD_MIN:
        raise RecordsError(CORRUPT_MESSAGE, f"records of {len(buf)} bytes hold no whole record batch")
    _base, length = _LENGTH.unpack_from(buf, 0)
    if 12 + length != len(buf):
        raise RecordsError(INVALID_RECORD, "a produce request must hold exactly one record batch per partition")
    if buf[16] != MAGIC_V2:
        raise RecordsError(
            UNSUPPORTED_FOR_MESSAGE_FORMAT, f"record batch magic {buf[16]}: only v2 batches (Kafka 0.11+) are taken"
        )
    head = DefaultRecordBatch.HEADER_STRUCT.unpack_from(buf, 0)
    attributes, first_ts, producer_id, producer_epoch, base_sequence, count = (
        head[5],
        head[7],
        head[9],
        head[10],
        head[11],
        head[12],
    )
    if crc32c.crc32c(buf[_ATTRIBUTES_AT:]) != head[4]:
        raise RecordsError(CORRUPT_MESSAGE, "record batch CRC mismatch")
    if attributes & (_TRANSACTIONAL | _CONTROL):
        raise RecordsError(INVALID_RECORD, "transactional producers are not supported by georep's Kafka gateway")
    if count < 1:
        raise RecordsError(INVALID_RECORD, f"a record batch with records count {count}: it needs at least one")
    codec = attributes & _CODEC_MASK
    body = buf[_BATCH_HEAD_MIN:] if not codec else memoryview(_decompressed(codec, buf[_BATCH_HEAD_MIN:], limit_bytes))
    if len(body) > limit_bytes:
        raise RecordsError(
            MESSAGE_TOO_LARGE,
            f"the batch's records hold {len(body)} bytes, more than the topic's max_batch_bytes={limit_bytes}",
        )
    records = _records_in_place(body, count, first_ts)
    return encode_batch(
        records,
        producer_id=producer_id,
        producer_epoch=producer_epoch,
        base_sequence=base_sequence,
        compression=_STORED_AS.get(codec, Compression.NONE),
    )


def _decompressed(codec: int, data: memoryview, limit_bytes: int) -> bytes | memoryview:
    """A compressed batch's records section, at most ``limit_bytes``, bounded (``georep/record/compression.py``)."""
    name = _CODEC_NAMES.get(codec, str(codec))
    if codec not in _STORED_AS:
        raise RecordsError(
            UNSUPPORTED_COMPRESSION_TYPE,
            f"compression {name} is not supported by georep's Kafka gateway: use gzip, snappy, lz4, zstd or none",
        )
    try:
        if codec == _SNAPPY:  # Kafka's snappy is raw (librdkafka) or the xerial framing (Java, kafka-python, aiokafka)
            return decompress_kafka_snappy(data, limit_bytes)
        return decompress(_STORED_AS[codec], data, limit_bytes)
    except DecompressedTooLarge:
        raise RecordsError(
            MESSAGE_TOO_LARGE,
            f"the batch's {name} records decompress to more than the topic's "
            f"max_batch_bytes={limit_bytes}: send smaller batches or raise the topic's "
            "max_batch_bytes",
        ) from None
    except DecompressionError as exc:
        raise RecordsError(CORRUPT_MESSAGE, f"cannot read the {name} records: {exc}") from None


def _records_in_place(buf: memoryview, count: int, first_ts: int) -> list[RecordInput]:
    """The ``count`` records of a records section (a view of the request, or the decompressed section), keys
    and values as views of it: georep's encoder copies them once, into the georep batch. The walk uses
    kafka-python's varint decoder and Kafka's record layout (length, attributes, timestamp delta, offset delta,
    key, value, headers); georep's batch has no offset gaps, so the offset deltas must be 0, 1, 2 ..., as every
    producer writes them. Each record's fields stay inside the record, and no byte is left after the last."""
    if count > len(buf) // _RECORD_MIN_BYTES:
        raise RecordsError(INVALID_RECORD, f"records count {count} cannot fit in {len(buf)} bytes of records")
    out: list[RecordInput] = []
    pos = 0
    try:
        for index in range(count):
            length, pos = decode_varint(buf, pos)
            end = pos + length
            _attributes, pos = decode_varint(buf, pos)
            ts_delta, pos = decode_varint(buf, pos)
            offset_delta, pos = decode_varint(buf, pos)
            if offset_delta != index:
                raise RecordsError(
                    INVALID_RECORD,
                    f"record {index} has offset delta {offset_delta}: a produced batch's offset deltas run 0, 1, 2 ...",
                )
            key_len, pos = decode_varint(buf, pos)
            key = buf[pos : pos + key_len] if key_len >= 0 else None
            pos += max(key_len, 0)
            value_len, pos = decode_varint(buf, pos)
            value = buf[pos : pos + value_len] if value_len >= 0 else None
            pos += max(value_len, 0)
            header_count, pos = decode_varint(buf, pos)
            if (
                end > len(buf)
                or key_len < -1
                or value_len < -1
                or pos > end
                or not 0 <= header_count <= (end - pos) // 2
            ):  # a header takes at least 2 bytes
                raise RecordsError(INVALID_RECORD, f"record {index} of the batch has inconsistent lengths")
            headers: list[tuple[str, bytes | None]] = []
            for _h in range(header_count):
                hk_len, pos = decode_varint(buf, pos)
                if not 0 <= hk_len <= end - pos:
                    raise RecordsError(INVALID_RECORD, f"record {index} has a header key length {hk_len}")
                hk = str(buf[pos : pos + hk_len], "utf-8")
                pos += hk_len
                hv_len, pos = decode_varint(buf, pos)
                if not -1 <= hv_len <= end - pos:
                    raise RecordsError(INVALID_RECORD, f"record {index} has a header value length {hv_len}")
                headers.append((hk, bytes(buf[pos : pos + hv_len]) if hv_len >= 0 else None))
                pos += max(hv_len, 0)
            if pos != end:
                raise RecordsError(INVALID_RECORD, f"record {index} of the batch has inconsistent lengths")
            # encode_batch takes a key's and a value's length and joins them: a view serves as well as bytes.
            out.append(RecordInput(cast(bytes | None, key), cast(bytes | None, value), headers, first_ts + ts_delta))
    except (IndexError, UnicodeDecodeError) as exc:
        raise RecordsError(INVALID_RECORD, f"record batch truncated or corrupt: {exc}") from None
    if pos != len(buf):
        raise RecordsError(INVALID_RECORD, f"{len(buf) - pos} bytes after the batch's last record")
    return out


class InvalidStored(NamedTuple):
    """A stored batch a fetch could not convert: served as an empty batch over its offsets."""

    base_offset: int
    next_offset: int
    reason: str


class Converted(NamedTuple):
    data: bytes  # Kafka v2 batches, concatenated
    invalid: tuple[InvalidStored, ...]  # the stored batches served empty


def georep_to_kafka(
    chunk: bytes, from_offset: int = 0, skip: Mapping[Origin, int] | None = None, skip_below: int = -1
) -> bytes:
    """:func:`convert_fetched`'s Kafka batches."""
    return convert_fetched(chunk, from_offset, skip, skip_below).data


def convert_fetched(
    chunk: bytes, from_offset: int = 0, skip: Mapping[Origin, int] | None = None, skip_below: int = -1
) -> Converted:
    """Whole georep batches (as a log read returns them) as Kafka v2 batches, concatenated.

    ``skip``: leave out the records this vector covers, in batches that start below ``skip_below`` (from
    there on the vector covers nothing). Batches ending before ``from_offset`` are left out whole; a batch
    that holds it is sent whole, as Kafka does (the client drops the records before its position). A stored
    batch whose records are invalid (see the module docstring) is sent as an empty batch over its offsets,
    and named in :attr:`Converted.invalid`."""
    out = bytearray()
    invalid: list[InvalidStored] = []
    view = memoryview(chunk)
    pos = 0
    try:
        for header in headers_in(chunk):
            size = header.size_bytes
            if header.next_offset > from_offset:
                covers = skip if skip is not None and header.base_offset < skip_below else None
                if covers is not None and header.last_origin_seq < covers.get(header.origin, 0):
                    out += empty_batch(header.base_offset, header.last_offset_delta, header.max_timestamp)
                else:
                    try:
                        out += _convert(view[pos : pos + size], header, covers)
                    except InvalidBatch as exc:
                        invalid.append(InvalidStored(header.base_offset, header.next_offset, str(exc)))
                        out += empty_batch(header.base_offset, header.last_offset_delta, max(header.max_timestamp, 0))
            pos += size
    except CorruptBatch as exc:  # a header no site would have stored: serve what came before it
        invalid.append(InvalidStored(-1, -1, f"unreadable batch header at byte {pos} of the read: {exc}"))
    return Converted(bytes(out), tuple(invalid))


def _convert(batch: memoryview, h: BatchHeader, skip: Mapping[Origin, int] | None) -> bytearray:
    """One stored georep batch as one Kafka v2 batch, written in one pass: each record's key, value and headers
    are copied once, from the stored batch (a view of the log read) into the Kafka batch. Kafka's record layout
    with kafka-python's varint encoder and batch header struct; the CRC-32C over the result. The records are
    checked first (``walk_records``); raises :class:`InvalidBatch`."""
    body = memoryview(decompress_records(h, batch[HEADER_BYTES : h.size_bytes], READ_RECORDS_BYTES_MAX))
    walk_records(body, h.records_count, h.first_timestamp, h.max_timestamp)
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
        size = (
            1
            + size_of_varint(ts_delta)
            + size_of_varint(delta)
            + _bytes_size(key)
            + _bytes_size(value)
            + size_of_varint(header_count + 2)
            + len(headers)
            + len(coordinate)
            + 1
            + len(seq_text)
        )
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
    _KAFKA_HEAD.pack_into(
        out, 0, base_offset, len(out) - 12, 0, MAGIC_V2, 0, 0, last_delta, first_ts, max_ts, -1, -1, -1, count
    )
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
