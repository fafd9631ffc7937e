"""Batches as a hostile producer or a lying upstream builds them: any header fields and records section, with a
valid CRC-32C, and decompression bombs that are never held whole in memory."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator

import cramjam
import crc32c
import lz4.frame
import zstandard
from hypothesis import strategies as st

from georep.record.batch import CRC_START, HEADER, HEADER_BYTES, LENGTH_PREFIX_BYTES, MAGIC, RECORD_HEAD
from georep.record.compression import Compression, compress

TS = 1_700_000_000_000
ZEROS_MIB = bytes(1 << 20)


def forge(
    records: bytes,
    count: int,
    *,
    attributes: int = 0,
    first_ts: int = TS,
    max_ts: int | None = None,
    site: bytes = b"",
    epoch: int = 0,
    seq: int = -1,
    producer_id: int = -1,
    producer_epoch: int = -1,
    base_sequence: int = -1,
    last_delta: int | None = None,
    magic: int = MAGIC,
) -> bytes:
    """A batch with these fields over ``records`` (the records section as sent: compressed if ``attributes``
    say so) and a CRC-32C that matches."""
    head = bytearray(
        HEADER.pack(
            0,
            HEADER_BYTES - LENGTH_PREFIX_BYTES + len(records),
            0,
            0,
            magic,
            attributes,
            site,
            epoch,
            seq,
            count - 1 if last_delta is None else last_delta,
            first_ts,
            first_ts if max_ts is None else max_ts,
            producer_id,
            producer_epoch,
            base_sequence,
            count,
        )
    )
    crc = crc32c.crc32c(records, crc32c.crc32c(head[CRC_START:]))
    struct.pack_into(">I", head, 20, crc)
    return bytes(head) + records


def record(
    value: bytes | None,
    *,
    index: int = 0,
    ts_delta: int = 0,
    key: bytes | None = None,
    headers: bytes = b"\0\0\0\0",
    attributes: int = 0,
    length: int | None = None,
) -> bytes:
    """One record of georep's layout; ``headers`` is the raw header count and headers."""
    body = (b"" if key is None else key) + struct.pack(">i", -1 if value is None else len(value))
    body += (value or b"") + headers
    size = RECORD_HEAD.size - 4 + len(body) if length is None else length
    return RECORD_HEAD.pack(size, attributes, ts_delta, index, -1 if key is None else len(key)) + body


def _value_record_stream(value_bytes: int) -> Iterator[bytes]:
    """One record whose value is ``value_bytes`` zeros, in pieces of at most 1 MiB."""
    yield RECORD_HEAD.pack(RECORD_HEAD.size - 4 + 4 + value_bytes + 4, 0, 0, 0, -1) + struct.pack(">i", value_bytes)
    left = value_bytes
    while left:
        n = min(left, len(ZEROS_MIB))
        yield ZEROS_MIB[:n]
        left -= n
    yield b"\0\0\0\0"


def zstd_bomb(value_bytes: int, declare_size: bool = False) -> bytes:
    """The compressed records section of one record holding ``value_bytes`` zeros, compressed streaming (1 GiB
    makes about 32 KB); without ``declare_size`` the frame does not say its content size, as Kafka's Java
    producer writes it."""
    total = RECORD_HEAD.size + 4 + value_bytes + 4
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=declare_size)
    compressor = cctx.compressobj(size=total if declare_size else -1)
    out = [compressor.compress(piece) for piece in _value_record_stream(value_bytes)]
    out.append(compressor.flush())
    return b"".join(out)


def lz4_bomb(value_bytes: int) -> bytes:
    """As :func:`zstd_bomb`, as one lz4 frame (lz4 compresses zeros about 250:1)."""
    compressor = lz4.frame.LZ4FrameCompressor()
    out = [compressor.begin()]
    out += [compressor.compress(piece) for piece in _value_record_stream(value_bytes)]
    out.append(compressor.flush())
    return b"".join(out)


def gzip_bomb(value_bytes: int) -> bytes:
    """As :func:`zstd_bomb`, as one gzip member (deflate compresses zeros about 1000:1)."""
    compressor = zlib.compressobj(1, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    out = [compressor.compress(piece) for piece in _value_record_stream(value_bytes)]
    out.append(compressor.flush())
    return b"".join(out)


def snappy_bomb(declared_bytes: int) -> bytes:
    """A raw snappy block whose preamble declares ``declared_bytes`` and that holds 1 MiB of zeros: what a
    decoder that trusts the preamble would allocate whole."""
    block = bytes(cramjam.snappy.compress_raw(ZEROS_MIB))
    preamble = bytearray()
    while declared_bytes >= 0x80:
        preamble.append(declared_bytes & 0x7F | 0x80)
        declared_bytes >>= 7
    preamble.append(declared_bytes)
    return bytes(preamble) + block[3:]  # 1 MiB's own preamble is 3 bytes


# -- a hostile producer, for Hypothesis ----------------------------------------------------------------------------


def raw_headers(pairs: list[tuple[bytes, bytes | None]], count: int | None = None) -> bytes:
    """A record's header count and headers, raw (``count`` may lie)."""
    out = [struct.pack(">i", len(pairs) if count is None else count)]
    for key, value in pairs:
        out.append(struct.pack(">i", len(key)) + key + struct.pack(">i", -1 if value is None else len(value)))
        out.append(value or b"")
    return b"".join(out)


def hostile_batches() -> st.SearchStrategy[tuple[bytes, str]]:
    """Unstamped batches with valid CRCs, mostly well formed with one thing wrong, or nothing wrong: arbitrary
    codec ids, counts, offset and timestamp deltas, lengths, header counts and keys, timestamps (the -2^63 of
    issue 20, item 7, too) and garbage spliced into the records section. Each comes with a label for failure
    messages."""
    return _hostile()


@st.composite
def _hostile(draw: st.DrawFn) -> tuple[bytes, str]:
    n = draw(st.integers(1, 4))
    rarely = st.sampled_from([False] * 30 + [True])  # uniform: Hypothesis draws small integers most often
    pieces = []
    deltas = [0, *draw(st.lists(st.integers(-3, 3), min_size=n - 1, max_size=n - 1))]
    for i in range(n):
        pairs = draw(
            st.lists(
                st.tuples(st.sampled_from([b"h"] * 8 + [b"", b"\xc3\xa9", b"\xff"]), st.none() | st.binary(max_size=4)),
                max_size=2,
            )
        )
        lie = draw(st.sampled_from([None] * 40 + [-1, 3, 2**31 - 1]))
        index = draw(st.integers(-1, n + 1)) if draw(rarely) else i
        length = draw(st.integers(-5, 200)) if draw(rarely) else None
        key = draw(st.none() | st.binary(max_size=4))
        value = draw(st.none() | st.binary(max_size=30))
        pieces.append(
            record(
                value,
                key=key,
                index=index,
                ts_delta=deltas[i],
                headers=raw_headers(pairs, lie),
                length=length,
                attributes=int(draw(rarely)),
            )
        )
    section = b"".join(pieces)
    if draw(rarely):
        at = draw(st.integers(0, len(section)))
        section = section[:at] + draw(st.binary(min_size=1, max_size=8)) + section[at:]
    codec = draw(st.sampled_from([0] * 6 + [1, 1, 2, 2, 3, 7, 0x18]))
    if codec in (1, 2) and not draw(rarely):
        section = compress(Compression(codec), section)
    count = n + draw(st.sampled_from([0] * 10 + [1, -1, -n, 2**31 - 1 - n]))
    first_ts = draw(st.sampled_from([TS] * 16 + [0, -1, -(2**63) + 10]))
    max_ts = first_ts + max(deltas) + draw(st.sampled_from([0] * 8 + [1, -1]))
    label = f"{n} records, codec {codec}, count {count}, first_ts {first_ts}, max_ts {max_ts}"
    return forge(section, count, attributes=codec, first_ts=first_ts, max_ts=max_ts), label
