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
        25    2 attributes         bits 0-2: compression (0 none, 1 zstd, 2 lz4);
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
  parses only this header; it never walks records on its hot path.
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

from georep.record.compression import COMPRESSION_MASK, Compression, compress, decompress
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
_RECORD_MIN_BYTES = RECORD_HEAD.size + 8  # + value_length + header_count

NO_PRODUCER_ID = -1
UNSTAMPED_SEQ = -1


class CorruptBatch(ValueError):
    """Bytes that do not form a valid batch: short, bad length, bad CRC or bad magic."""


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
        LocalOffset(f[0]), f[1], f[2], f[3], f[4], f[5], SiteId(site), f[7], OriginSeq(f[8]),
        f[9], f[10], f[11], f[12], f[13], f[14], f[15],
    )  # fmt: skip


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
        0, HEADER_BYTES - LENGTH_PREFIX_BYTES + len(body), 0, 0, MAGIC, int(compression),
        site, epoch, base_origin_seq, count - 1, first_ts, max_ts,
        producer_id, producer_epoch, base_sequence, count,
    )  # fmt: skip
    crc = crc32c.crc32c(head[CRC_START:])
    crc = crc32c.crc32c(body, crc)
    return head[:20] + struct.pack(">I", crc) + head[24:] + body


def decode_records(batch: bytes | memoryview, header: BatchHeader | None = None) -> list[Record]:
    """Decode every record of one (already CRC-checked) batch."""
    if header is None:
        header = parse_header(batch)
    view = memoryview(batch)
    body = decompress(header.compression, view[HEADER_BYTES : header.size_bytes])
    origin = header.origin
    base_offset = header.base_offset
    base_seq = header.base_origin_seq
    first_ts = header.first_timestamp
    unpack_head = RECORD_HEAD.unpack_from
    unpack_i32 = _I32.unpack_from
    out: list[Record] = []
    pos = 0
    end = len(body)
    b = bytes(body)
    try:
        for index in range(header.records_count):
            length, _attrs, ts_delta, delta, klen = unpack_head(b, pos)
            rec_end = pos + 4 + length
            if length < _RECORD_MIN_BYTES - 4 or rec_end > end:
                raise CorruptBatch(f"record at byte {pos} of batch at offset {base_offset} overruns the batch")
            if delta != index:
                raise CorruptBatch(f"record {index} of batch at offset {base_offset} has offset_delta {delta}")
            p = pos + RECORD_HEAD.size
            if klen >= 0:
                key: bytes | None = b[p : p + klen]
                p += klen
            elif klen == -1:
                key = None
            else:
                raise CorruptBatch(f"record at byte {pos} of batch at offset {base_offset} has key_length {klen}")
            (vlen,) = unpack_i32(b, p)
            p += 4
            if vlen >= 0:
                value: bytes | None = b[p : p + vlen]
                p += vlen
            elif vlen == -1:
                value = None
            else:
                raise CorruptBatch(f"record at byte {pos} of batch at offset {base_offset} has value_length {vlen}")
            (hcount,) = unpack_i32(b, p)
            p += 4
            headers: tuple[tuple[str, bytes | None], ...] = ()
            # Each header takes at least 8 bytes; the bound also keeps a corrupt count from looping for long.
            if hcount < 0 or hcount * 8 > rec_end - p:
                raise CorruptBatch(f"record at byte {pos} of batch at offset {base_offset} has header_count {hcount}")
            if hcount:
                hs = []
                for _h in range(hcount):
                    (hkl,) = unpack_i32(b, p)
                    if hkl < 0:
                        raise CorruptBatch(f"header of record at byte {pos} has key_length {hkl}")
                    hk = b[p + 4 : p + 4 + hkl].decode()
                    p += 4 + hkl
                    (hvl,) = unpack_i32(b, p)
                    p += 4
                    if hvl < -1:
                        raise CorruptBatch(f"header of record at byte {pos} has value_length {hvl}")
                    hv = None if hvl < 0 else b[p : p + hvl]
                    p += max(hvl, 0)
                    hs.append((hk, hv))
                headers = tuple(hs)
            if p != rec_end:
                raise CorruptBatch(f"record at byte {pos} of batch at offset {base_offset} has inconsistent lengths")
            out.append(
                Record(
                    LocalOffset(base_offset + delta), origin, OriginSeq(base_seq + delta),
                    first_ts + ts_delta, key, value, headers,
                )  # fmt: skip
            )
            pos = rec_end
    except struct.error as exc:
        raise CorruptBatch(f"batch at offset {base_offset} has a truncated record: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise CorruptBatch(f"batch at offset {base_offset} has a header key that is not UTF-8: {exc}") from exc
    if pos != end:
        raise CorruptBatch(f"batch at offset {base_offset} has {end - pos} bytes after its last record")
    return out
