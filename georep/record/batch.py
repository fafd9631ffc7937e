"""The record batch: georep's unit of storage, replication and fetch.

The same bytes are the wire format (Produce, Fetch, replication) and the
on-disk format (segment files, which the Spark audit reads directly). All
integers are big-endian and signed unless marked ``u``.

Batch layout, format version 1::

    offset size field              meaning
    ------ ---- ------------------ ---------------------------------------------
         0    8 base_offset        local offset of the first record at THIS site
         8    4 batch_length       bytes that follow this field (total - 12)
        12    8 append_time_ms     wall clock when THIS site appended the batch
        20   4u crc                CRC-32C of bytes [24, 12 + batch_length)
    ---- everything below is covered by the CRC and is identical at every site ----
        24    1 magic              format version, 1
        25    2 attributes         bits 0-2: compression (0 none, 1 zstd, 2 lz4,
                                   3 gzip, 4 snappy; 5-7 unassigned: refused);
                                   bits 3-15: reserved, 0
        27   32 origin_site        origin site id, ASCII, NUL-padded; all NUL
                                   until the origin stamps the batch
        59   4u origin_epoch       origin site's epoch
        63    8 base_origin_seq    origin seq of the first record (-1 unstamped)
        71    4 last_offset_delta  records_count - 1
        75    8 first_timestamp    producer timestamp of the first record (ms)
        83    8 max_timestamp      largest producer timestamp in the batch (ms)
        91    8 producer_id        idempotent producer id, -1 for none
        99    2 producer_epoch     -1 for none
       101    4 base_sequence      producer's sequence of the first record, -1 none
       105    4 records_count
       109    - records            records_count records, compressed as a whole
                                   when attributes say so

Record layout (inside the records section, after decompression)::

    length            4  bytes that follow this field
    attributes        1  reserved, 0
    timestamp_delta   8  timestamp - first_timestamp (ms)
    offset_delta      4  index in the batch: local offset = base_offset + delta,
                         origin seq = base_origin_seq + delta
    key_length        4  -1 for a null key
    key               -
    value_length      4  -1 for a null value
    value             -
    header_count      4
    headers           -  header_count times:
                           key_length 4, key (UTF-8), value_length 4 (-1 null), value

Why this shape:

* The first 24 bytes are what a replica rewrites: the local offset and the
  local append time. They sit outside the CRC, so a replica copies a batch
  verbatim, rewrites 24 bytes, and never recomputes the CRC (ARCHITECTURE.md,
  "Verbatim records"). The append time is local for the same reason Kafka's
  LogAppendTime is: replication delay is append time minus producer timestamp.
* The origin is fixed-size so the header is one ``struct`` unpack. The broker
  walks a batch's records once, to validate it before storing it
  (``georep/record/validate.py``), at its origin and at each apply; fetch and
  replication serve stored batches by their headers alone.
* Record fields are fixed-width rather than Kafka's varints: in CPython one
  ``struct.pack`` per record is several times faster than varint loops, and
  the space cost (~20 bytes a record) is small next to typical values.
* A batch has no gaps: offset deltas and origin-seq deltas are the same
  ``0..records_count-1``, so a batch maps a contiguous local-offset range onto
  a contiguous origin-seq range.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import crc32c

from georep.metadata.topics import MAX_BATCH_BYTES_LIMIT
from georep.record.compression import (
    COMPRESSION_MASK,
    Compression,
    DecompressedTooLarge,
    DecompressionError,
    compress,
    decompress,
)
from offsets.coordinates import LocalOffset, Origin, OriginSeq
from topology.ids import SiteId

MAGIC = 1

HEADER = struct.Struct(">qiqIbh32sIqiqqqhii")
HEADER_BYTES = HEADER.size  # 109
LENGTH_PREFIX_BYTES = 12  # base_offset + batch_length: enough to frame a batch
REWRITTEN_BYTES = 24  # base_offset, batch_length, append_time_ms, crc
CRC_START = 24
ORIGIN_START = 27
ORIGIN_STRUCT = struct.Struct(">32sIq")  # origin_site, origin_epoch, base_origin_seq
PREFIX = struct.Struct(">qiqI")  # the 24 bytes outside the CRC
_FRAME = struct.Struct(">qi")
_OFFSET_AND_TIME = struct.Struct(">q")

RECORD_HEAD = struct.Struct(">ibqii")  # length, attributes, ts delta, offset delta, key_length
_I32 = struct.Struct(">i")
_HEAD_BYTES = RECORD_HEAD.size  # length, attributes, timestamp delta, offset delta, key length: 21
_RECORD_MIN_BYTES = _HEAD_BYTES + 8  # + value length and header count: an empty record, its length field included

NO_PRODUCER_ID = -1
UNSTAMPED_SEQ = -1

# What a reader decompresses of one batch at most, when it does not know the batch's topic: the largest
# max_batch_bytes a topic may have. No site stores a batch whose records decompress past its topic's
# max_batch_bytes (georep/record/validate.py), so a larger one is refused as invalid, not decompressed.
READ_RECORDS_BYTES_MAX = MAX_BATCH_BYTES_LIMIT


class CorruptBatch(ValueError):
    """Bytes that do not form a valid batch: short, bad length, bad CRC or bad magic (damaged bytes)."""


class InvalidBatch(CorruptBatch):
    """A whole batch, its CRC valid, whose content breaks the format: records that are not there or overrun it,
    an unknown codec, a bad count, offset delta, length or timestamp. Not damage but a producer's (or a lying
    upstream's) doing, so it has its own type; it is a :class:`CorruptBatch` for every reader that only needs to
    know that a batch cannot be read. The message names what is wrong and where."""


class RecordsTooLarge(InvalidBatch):
    """The records section decompresses past the limit it was read or validated with."""

    def __init__(self, message: str, limit_bytes: int) -> None:
        super().__init__(message)
        self.limit_bytes = limit_bytes


class BatchHeader(NamedTuple):
    """The parsed fixed header of one batch.

    A NamedTuple rather than a frozen dataclass, as ``Origin`` is: every read, apply, fetch and check
    parses headers, and a frozen dataclass of 16 fields takes several times longer to build.
    """

    base_offset: LocalOffset
    batch_length: int
    append_time_ms: int
    crc: int
    magic: int
    attributes: int
    origin_site: SiteId
    origin_epoch: int
    base_origin_seq: OriginSeq
    last_offset_delta: int
    first_timestamp: int
    max_timestamp: int
    producer_id: int
    producer_epoch: int
    base_sequence: int
    records_count: int

    @property
    def size_bytes(self) -> int:
        return LENGTH_PREFIX_BYTES + self.batch_length

    @property
    def origin(self) -> Origin:
        # Origin's fields without NamedTuple's __new__ (a Python function): reads, applies, fetches and checks
        # ask every header for its origin.
        return tuple.__new__(Origin, (self.origin_site, self.origin_epoch))

    @property
    def last_offset(self) -> LocalOffset:
        return LocalOffset(self.base_offset + self.last_offset_delta)

    @property
    def next_offset(self) -> LocalOffset:
        return LocalOffset(self.base_offset + self.last_offset_delta + 1)

    @property
    def last_origin_seq(self) -> OriginSeq:
        return OriginSeq(self.base_origin_seq + self.last_offset_delta)

    @property
    def next_origin_seq(self) -> OriginSeq:
        return OriginSeq(self.base_origin_seq + self.last_offset_delta + 1)

    @property
    def last_sequence(self) -> int:
        return self.base_sequence + self.last_offset_delta

    @property
    def compression(self) -> int:
        return self.attributes & COMPRESSION_MASK

    @property
    def stamped(self) -> bool:
        return self.base_origin_seq >= 0


def frame_length(buf: bytes | bytearray | memoryview, pos: int = 0) -> int:
    """Total size of the batch starting at ``pos``, from its 12-byte prefix alone.

    Raises :class:`CorruptBatch` if fewer than 12 bytes remain or the length is
    impossible; callers use this to find torn tails.
    """
    if len(buf) - pos < LENGTH_PREFIX_BYTES:
        raise CorruptBatch(f"truncated batch prefix at byte {pos}")
    batch_length: int = _FRAME.unpack_from(buf, pos)[1]
    if batch_length < HEADER_BYTES - LENGTH_PREFIX_BYTES:
        raise CorruptBatch(f"impossible batch_length {batch_length} at byte {pos}")
    return LENGTH_PREFIX_BYTES + batch_length


def parse_header(buf: bytes | bytearray | memoryview, pos: int = 0) -> BatchHeader:
    """Parse the fixed header at ``pos``. Checks framing and magic, not the CRC."""
    if len(buf) - pos < HEADER_BYTES:
        raise CorruptBatch(f"truncated batch header at byte {pos}: {len(buf) - pos} bytes left")
    f = HEADER.unpack_from(buf, pos)
    if f[1] < HEADER_BYTES - LENGTH_PREFIX_BYTES:
        raise CorruptBatch(f"impossible batch_length {f[1]} at byte {pos}")
    if f[4] != MAGIC:
        raise CorruptBatch(f"unsupported batch format version {f[4]} at byte {pos} (this build reads {MAGIC})")
    if f[15] < 1 or f[9] != f[15] - 1:
        raise CorruptBatch(f"batch at byte {pos} has records_count {f[15]} and last_offset_delta {f[9]}")
    site = f[6].rstrip(b"\0").decode("ascii", "replace")
    return BatchHeader(
        LocalOffset(f[0]),
        f[1],
        f[2],
        f[3],
        f[4],
        f[5],
        SiteId(site),
        f[7],
        OriginSeq(f[8]),
        f[9],
        f[10],
        f[11],
        f[12],
        f[13],
        f[14],
        f[15],
    )


def compute_crc(batch: bytes | bytearray | memoryview) -> int:
    return int(crc32c.crc32c(memoryview(batch)[CRC_START:]))


def check_batch(batch: bytes | bytearray | memoryview, pos: int = 0) -> BatchHeader:
    """Parse and fully validate (length and CRC) the batch starting at ``pos``."""
    header = parse_header(batch, pos)
    end = pos + header.size_bytes
    if end > len(batch):
        raise CorruptBatch(f"batch at byte {pos} claims {header.size_bytes} bytes, only {len(batch) - pos} present")
    actual = crc32c.crc32c(memoryview(batch)[pos + CRC_START : end])
    if actual != header.crc:
        raise CorruptBatch(f"CRC mismatch in batch at byte {pos}: stored {header.crc:#010x}, computed {actual:#010x}")
    return header


def iter_headers(buf: bytes | bytearray | memoryview, *, verify: bool = False) -> list[BatchHeader]:
    """Headers of the whole batches in ``buf``, in order; a partial last batch is left out."""
    return list(headers_in(buf, verify=verify))


def headers_in(buf: bytes | bytearray | memoryview, *, verify: bool = False) -> Iterator[BatchHeader]:
    """:func:`iter_headers`, each header parsed only when asked for: for a reader that may stop early."""
    pos = 0
    n = len(buf)
    while n - pos >= HEADER_BYTES:
        header = check_batch(buf, pos) if verify else parse_header(buf, pos)
        size = header.size_bytes
        if pos + size > n:
            return
        yield header
        pos += size


def stamp_origin(batch: bytes | memoryview, origin: Origin, base_origin_seq: int) -> tuple[bytes, int]:
    """Give a producer's batch its origin coordinates, as the origin site does.

    Returns the new 109-byte header (prefix fields copied from the input, CRC
    recomputed) and the CRC. The records section is not copied: callers write ``header`` followed by
    ``batch[HEADER_BYTES:]``. The producer's CRC must have been checked first.
    """
    view = memoryview(batch)
    head = bytearray(view[:HEADER_BYTES])
    ORIGIN_STRUCT.pack_into(head, ORIGIN_START, origin.site.encode("ascii"), origin.epoch, base_origin_seq)
    crc = crc32c.crc32c(head[CRC_START:])
    crc = crc32c.crc32c(view[HEADER_BYTES:], crc)
    struct.pack_into(">I", head, 20, crc)
    return bytes(head), crc


def local_prefix(base_offset: int, batch_length: int, append_time_ms: int, crc: int) -> bytes:
    """The 24 bytes a site writes in front of a batch's CRC-covered body."""
    return PREFIX.pack(base_offset, batch_length, append_time_ms, crc)


class RecordInput(NamedTuple):
    """One record as a producer hands it to :func:`encode_batch`."""

    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes | None]]
    timestamp_ms: int


class Record(NamedTuple):
    """One decoded record with its coordinates."""

    offset: LocalOffset
    origin: Origin
    origin_seq: OriginSeq
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]


def _encode_records(records: Sequence[RecordInput], first_timestamp: int) -> bytes:
    parts: list[bytes] = []
    append = parts.append
    pack_head = RECORD_HEAD.pack
    pack_i32 = _I32.pack
    for delta, (key, value, headers, ts) in enumerate(records):
        klen = -1 if key is None else len(key)
        vlen = -1 if value is None else len(value)
        body = 25 + max(klen, 0) + max(vlen, 0)  # fields after length, empty headers
        if headers:
            hparts = [pack_i32(len(headers))]
            for hk, hv in headers:
                hkb = hk.encode()
                hparts.append(pack_i32(len(hkb)))
                hparts.append(hkb)
                if hv is None:
                    hparts.append(pack_i32(-1))
                else:
                    hparts.append(pack_i32(len(hv)))
                    hparts.append(hv)
            hblob = b"".join(hparts)
            body += len(hblob) - 4
        else:
            hblob = b"\0\0\0\0"
        append(pack_head(body, 0, ts - first_timestamp, delta, klen))
        if key:
            append(key)
        append(pack_i32(vlen))
        if value:
            append(value)
        append(hblob)
    return b"".join(parts)


def encode_batch(
    records: Sequence[RecordInput],
    *,
    producer_id: int = NO_PRODUCER_ID,
    producer_epoch: int = -1,
    base_sequence: int = -1,
    compression: Compression = Compression.NONE,
    origin: Origin | None = None,
    base_origin_seq: int = UNSTAMPED_SEQ,
) -> bytes:
    """Encode a batch as a producer does: origin unstamped unless given."""
    if not records:
        raise ValueError("a batch needs at least one record")
    first_ts = records[0].timestamp_ms
    max_ts = max(r.timestamp_ms for r in records)
    body = compress(compression, _encode_records(records, first_ts))
    site = origin.site.encode("ascii") if origin else b""
    epoch = origin.epoch if origin else 0
    count = len(records)
    head = HEADER.pack(
        0,
        HEADER_BYTES - LENGTH_PREFIX_BYTES + len(body),
        0,
        0,
        MAGIC,
        int(compression),
        site,
        epoch,
        base_origin_seq,
        count - 1,
        first_ts,
        max_ts,
        producer_id,
        producer_epoch,
        base_sequence,
        count,
    )
    crc = crc32c.crc32c(head[CRC_START:])
    crc = crc32c.crc32c(body, crc)
    return head[:20] + struct.pack(">I", crc) + head[24:] + body


def walk_records(body: bytes | memoryview, count: int, first_timestamp: int, max_timestamp: int) -> int:
    """Check the ``count`` records of a decompressed records section (step 5); returns the smallest timestamp
    delta. Raises :class:`InvalidBatch` naming the record and the byte where it goes wrong."""
    end = len(body)
    if count > end // _RECORD_MIN_BYTES:
        raise InvalidBatch(
            f"records_count {count} cannot fit in a records section of {end} bytes (a record takes "
            f"at least {_RECORD_MIN_BYTES})"
        )
    unpack_head = RECORD_HEAD.unpack_from
    unpack_i32 = _I32.unpack_from
    low = -first_timestamp  # every record timestamp in [0, max_timestamp]
    high = max_timestamp - first_timestamp
    top = min_delta = 0
    pos = 0
    try:
        for index in range(count):
            length, attributes, ts_delta, offset_delta, key_length = unpack_head(body, pos)
            rec_end = pos + 4 + length
            p = pos + _HEAD_BYTES + (key_length if key_length > 0 else 0)
            if (
                length < _RECORD_MIN_BYTES - 4
                or rec_end > end
                or attributes
                or offset_delta != index
                or not low <= ts_delta <= high
                or key_length < -1
                or p + 8 > rec_end
            ):
                raise _explain(body, pos, index, low, high)
            if ts_delta > top:
                top = ts_delta
            elif ts_delta < min_delta:
                min_delta = ts_delta
            (value_length,) = unpack_i32(body, p)
            p += 4 + (value_length if value_length > 0 else 0)
            if value_length < -1 or p + 4 > rec_end:
                raise _explain(body, pos, index, low, high)
            (header_count,) = unpack_i32(body, p)
            p += 4
            if header_count:
                p = _walk_headers(body, p, rec_end, header_count, pos, index)
            if p != rec_end:
                raise _explain(body, pos, index, low, high)
            pos = rec_end
    except struct.error:  # only past the section's end, which the bounds above keep it from reaching
        raise _explain(body, pos, index, low, high) from None
    if pos != end:
        raise InvalidBatch(
            f"{end - pos} bytes follow the last of the {count} records (at byte {pos} of the records section)"
        )
    if count and _first_delta(body) != 0:
        raise InvalidBatch(
            f"the first record's timestamp_delta is {_first_delta(body)}: first_timestamp must be "
            "the first record's timestamp"
        )
    if top != high:
        raise InvalidBatch(
            f"max_timestamp is {max_timestamp} but the largest record timestamp is {first_timestamp + top}"
        )
    return min_delta


def _first_delta(body: bytes | memoryview) -> int:
    return int(RECORD_HEAD.unpack_from(body, 0)[2])


def _walk_headers(body: bytes | memoryview, p: int, rec_end: int, count: int, pos: int, index: int) -> int:
    """The ``count`` headers of the record at ``pos``, from ``p``; returns where they end."""
    where = f"record {index} (byte {pos} of the records section)"
    if count < 0 or count * 8 > rec_end - p:  # a header takes at least 8 bytes
        raise InvalidBatch(f"{where} has header_count {count}, more than its {rec_end - p} bytes left can hold")
    unpack_i32 = _I32.unpack_from
    for h in range(count):
        if p + 8 > rec_end:
            raise InvalidBatch(f"{where}: header {h} overruns the record")
        (key_length,) = unpack_i32(body, p)
        p += 4
        if not 0 <= key_length <= rec_end - p - 4:
            raise InvalidBatch(f"{where}: header {h} has key_length {key_length}, outside the record")
        try:
            str(body[p : p + key_length], "utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidBatch(f"{where}: header {h}'s key is not UTF-8 ({exc.reason} at byte {exc.start})") from None
        p += key_length
        (value_length,) = unpack_i32(body, p)
        p += 4
        if value_length < -1 or p + max(value_length, 0) > rec_end:
            raise InvalidBatch(f"{where}: header {h} has value_length {value_length}, outside the record")
        p += max(value_length, 0)
    return p


def _explain(body: bytes | memoryview, pos: int, index: int, low: int, high: int) -> InvalidBatch:
    """What is wrong with record ``index`` at byte ``pos``: the slow path of :func:`walk_records`."""
    end = len(body)
    where = f"record {index} (byte {pos} of the records section)"
    if end - pos < _RECORD_MIN_BYTES:
        return InvalidBatch(
            f"{where}: only {end - pos} bytes of the records section are left, fewer than a record "
            "takes; records_count says more records follow"
        )
    length, attributes, ts_delta, offset_delta, key_length = RECORD_HEAD.unpack_from(body, pos)
    rec_end = pos + 4 + length
    if length < _RECORD_MIN_BYTES - 4 or rec_end > end:
        return InvalidBatch(f"{where} has length {length}: outside the {end - pos - 4} bytes left")
    if attributes:
        return InvalidBatch(f"{where} has attributes {attributes}: record attributes are reserved and must be 0")
    if offset_delta != index:
        return InvalidBatch(f"{where} has offset_delta {offset_delta}: a batch's offset deltas run 0..n-1")
    if not low <= ts_delta <= high:
        return InvalidBatch(
            f"{where} has timestamp_delta {ts_delta}: its timestamp {ts_delta - low} is outside "
            f"0..max_timestamp ({high - low})"
        )
    p = pos + _HEAD_BYTES + max(key_length, 0)
    if key_length < -1 or p + 8 > rec_end:
        return InvalidBatch(f"{where} has key_length {key_length}, outside the record")
    (value_length,) = _I32.unpack_from(body, p)
    p += 4 + max(value_length, 0)
    if value_length < -1 or p + 4 > rec_end:
        return InvalidBatch(f"{where} has value_length {value_length}, outside the record")
    return InvalidBatch(f"{where}: its key, value and headers do not add up to its length {length}")


def decompress_records(header: BatchHeader, body: bytes | memoryview, limit_bytes: int) -> bytes | memoryview:
    """The records section of a batch, decompressed, at most ``limit_bytes``; raises :class:`InvalidBatch`."""
    try:
        return decompress(header.compression, body, limit_bytes)
    except DecompressedTooLarge as exc:
        raise RecordsTooLarge(str(exc), exc.limit_bytes) from None
    except DecompressionError as exc:
        raise InvalidBatch(str(exc)) from None


def decode_records(
    batch: bytes | memoryview, header: BatchHeader | None = None, limit_bytes: int = READ_RECORDS_BYTES_MAX
) -> list[Record]:
    """Decode every record of one (already CRC-checked) batch, decompressing at most ``limit_bytes``.

    The records are checked first (:func:`walk_records`, the same checks a site makes before it stores a
    batch), so a batch that a site stored without them is refused whole with :class:`InvalidBatch`
    (:class:`RecordsTooLarge` past the limit), never decoded in part or wrongly."""
    if header is None:
        header = parse_header(batch)
    view = memoryview(batch)
    body = decompress_records(header, view[HEADER_BYTES : header.size_bytes], limit_bytes)
    try:
        walk_records(body, header.records_count, header.first_timestamp, header.max_timestamp)
    except InvalidBatch as exc:
        raise InvalidBatch(
            f"batch at offset {header.base_offset} ({header.origin} origin seqs "
            f"{header.base_origin_seq}..{header.last_origin_seq}): {exc}"
        ) from None
    origin = header.origin
    base_offset = header.base_offset
    base_seq = header.base_origin_seq
    first_ts = header.first_timestamp
    unpack_head = RECORD_HEAD.unpack_from
    unpack_i32 = _I32.unpack_from
    out: list[Record] = []
    append = out.append
    pos = 0
    b = bytes(body)
    for _index in range(header.records_count):  # walk_records checked every length below
        length, _attrs, ts_delta, delta, klen = unpack_head(b, pos)
        p = pos + _HEAD_BYTES
        key = b[p : p + klen] if klen >= 0 else None
        p += max(klen, 0)
        (vlen,) = unpack_i32(b, p)
        p += 4
        value = b[p : p + vlen] if vlen >= 0 else None
        p += max(vlen, 0)
        (hcount,) = unpack_i32(b, p)
        p += 4
        headers: tuple[tuple[str, bytes | None], ...] = ()
        if hcount:
            hs = []
            for _h in range(hcount):
                (hkl,) = unpack_i32(b, p)
                hk = b[p + 4 : p + 4 + hkl].decode()
                p += 4 + hkl
                (hvl,) = unpack_i32(b, p)
                p += 4
                hs.append((hk, None if hvl < 0 else b[p : p + hvl]))
                p += max(hvl, 0)
            headers = tuple(hs)
        append(
            Record(
                LocalOffset(base_offset + delta),
                origin,
                OriginSeq(base_seq + delta),
                first_ts + ts_delta,
                key,
                value,
                headers,
            )
        )
        pos += 4 + length
    return out
