"""Compression codecs for the records section of a batch.

The codec id lives in bits 0-2 of a batch's ``attributes``: 0 none, 1 zstd, 2 lz4, 3 gzip, 4 snappy (georep's
own ids, not Kafka's; ``georep/kafka/records.py`` maps them). Every codec comes from a maintained library
that is a dependency (``zstandard``, ``lz4``, the standard library's ``zlib`` for gzip, ``cramjam`` for
snappy), so every codec is always there. A build that predates a codec id refuses a batch naming it, as any
unknown id, with ``InvalidBatch`` (``georep/record/validate.py``, step 3): it never stores what it cannot read.
Producers compress; every reader decompresses through :func:`decompress`,
which is bounded: a batch that claims, or turns out, to decompress past
``limit_bytes`` is refused having cost at most about ``limit_bytes`` of
memory, never what the bomb would have grown to. The broker decompresses
only to validate a batch before it stores it (``georep/record/validate.py``).

How each codec is bounded (zstandard 0.25, lz4 4.4.5, zlib, cramjam 2.14):

* **zstd.** A frame that declares its content size is refused at once if the
  size is past the limit, and otherwise decompressed into a buffer of exactly
  that size (libzstd fails a frame that writes more than it declared). A frame
  without a declared size is decompressed into a buffer of ``limit_bytes``;
  when it does not fit, a stream reader reads at most ``limit_bytes + 1``
  bytes of it to tell a bomb (too large) from a damaged frame. One frame only:
  data after it is refused, as both georep's and Kafka's producers write one.
* **lz4.** A frame that declares its content size past the limit is refused
  at once. Otherwise an ``LZ4FrameDecompressor`` with ``max_length`` one past
  the declared size, or past the limit when none is declared: the output stops
  there, and a frame that is not over by then is too large (or lied).
* **gzip.** One gzip member through ``zlib.decompressobj`` with ``max_length`` one past the limit: the
  output stops there. zlib checks the member's CRC-32 and its length trailer, so a member that lies about
  its size or is damaged is refused; data after the member is refused.
* **snappy.** georep stores raw snappy: one block whose varint preamble declares its decompressed size. A
  preamble past the limit is refused at once; otherwise the block is decompressed into a buffer of exactly
  that size, which the decoder never writes past (a block that does not fill it exactly, or would overfill
  it, is refused). Kafka's producers send either raw snappy (librdkafka, so confluent-kafka) or the xerial
  "snappy-java" framing (the Java client, kafka-python, aiokafka): a 16-byte header, then blocks each
  prefixed by its big-endian 4-byte length. :func:`decompress_kafka_snappy` reads both: it first walks the
  blocks' preambles and refuses a total past the limit before it allocates anything, then decompresses each
  block into its slice of one buffer.
"""

from __future__ import annotations

import enum
import struct
import threading
import zlib

import cramjam
import lz4.frame
import zstandard


class Compression(enum.IntEnum):
    NONE = 0
    ZSTD = 1
    LZ4 = 2
    GZIP = 3
    SNAPPY = 4

    @classmethod
    def parse(cls, text: str) -> Compression:
        try:
            return cls[text.upper()]
        except KeyError:
            names = ", ".join(c.name.lower() for c in cls)
            raise ValueError(f"unknown compression {text!r}: choose one of {names}") from None


COMPRESSION_MASK = 0x07
CODEC_NAMES = {int(c): c.name.lower() for c in Compression}

_zstd_c = zstandard.ZstdCompressor(level=3)
# A zstd context must not be used by two threads at once, and the node decompresses in its event loop (produce)
# and in its replica writer thread (apply): one decompressor per thread, built once (building one costs ~10 us).
_local = threading.local()


class DecompressionError(ValueError):
    """The records section does not decompress with the codec its batch names."""


class DecompressedTooLarge(DecompressionError):
    """The records section decompresses (or says it does) past the limit it was read with."""

    def __init__(self, codec: str, limit_bytes: int, size: int | None = None) -> None:
        if size is None:
            text = f"the {codec} records section decompresses to more than the limit of {limit_bytes} bytes"
        else:
            text = f"the {codec} records section holds {size} bytes, more than the limit of {limit_bytes}"
        super().__init__(text)
        self.limit_bytes = limit_bytes


def compress(codec: Compression, data: bytes) -> bytes:
    if codec is Compression.NONE:
        return data
    if codec is Compression.ZSTD:
        return _zstd_c.compress(data)
    if codec is Compression.GZIP:
        # Level 6 is zlib's and Kafka's default; mtime 0 so the same records compress to the same bytes.
        return _gzip_compress(data)
    if codec is Compression.SNAPPY:
        return bytes(cramjam.snappy.compress_raw(data))
    return bytes(lz4.frame.compress(data))


def _gzip_compress(data: bytes) -> bytes:
    cctx = zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    return cctx.compress(data) + cctx.flush()


def decompress(codec: int, data: bytes | memoryview, limit_bytes: int) -> bytes | memoryview:
    """The records section ``data`` of a batch with compression ``codec``, at most ``limit_bytes`` long.

    Raises :class:`DecompressedTooLarge` past the limit and :class:`DecompressionError` for data the codec
    cannot read or an unknown codec id."""
    if codec == Compression.NONE:
        if len(data) > limit_bytes:
            raise DecompressedTooLarge("uncompressed", limit_bytes, len(data))
        return data
    if codec == Compression.ZSTD:
        return decompress_zstd(data, limit_bytes)
    if codec == Compression.LZ4:
        return decompress_lz4(data, limit_bytes)
    if codec == Compression.GZIP:
        return decompress_gzip(data, limit_bytes)
    if codec == Compression.SNAPPY:
        return decompress_snappy(data, limit_bytes)
    raise DecompressionError(
        f"unknown compression codec id {codec} in batch attributes (known: "
        f"{', '.join(f'{i} {n}' for i, n in sorted(CODEC_NAMES.items()))})"
    )


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx: zstandard.ZstdDecompressor | None = getattr(_local, "zstd", None)
    if dctx is None:
        dctx = _local.zstd = zstandard.ZstdDecompressor()
    return dctx


def decompress_zstd(data: bytes | memoryview, limit_bytes: int) -> bytes:
    """One zstd frame, bounded as the module docstring says."""
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise DecompressionError(f"records do not decompress as zstd: {exc}") from None
    if declared > limit_bytes:
        raise DecompressedTooLarge("zstd", limit_bytes, declared)
    try:
        # With a declared size the buffer is exactly that size; without one, max_output_size bounds it.
        return _decompressor().decompress(data, max_output_size=limit_bytes, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        if declared < 0 and _zstd_exceeds(data, limit_bytes):
            raise DecompressedTooLarge("zstd", limit_bytes) from None
        raise DecompressionError(f"records do not decompress as zstd: {exc}") from None


def _zstd_exceeds(data: bytes | memoryview, limit_bytes: int) -> bool:
    """Whether a frame that did not fit in ``limit_bytes`` is too large rather than damaged (read once more, at
    most ``limit_bytes + 1`` bytes: libzstd reports both the same way)."""
    try:
        with _decompressor().stream_reader(data) as reader:
            return len(reader.read(limit_bytes + 1)) > limit_bytes
    except zstandard.ZstdError:
        return False


def decompress_lz4(data: bytes | memoryview, limit_bytes: int) -> bytes:
    """One lz4 frame, bounded as the module docstring says."""
    try:
        declared = int(lz4.frame.get_frame_info(data)["content_size"])  # 0: not declared
    except RuntimeError as exc:
        raise DecompressionError(f"records do not decompress as lz4: {exc}") from None
    if declared > limit_bytes:
        raise DecompressedTooLarge("lz4", limit_bytes, declared)
    # A buffer no larger than needed: lz4 pays for the room max_length asks (0.45 ms for 64 MiB, 0.11 for 1 MiB).
    room = declared or limit_bytes
    dctx = lz4.frame.LZ4FrameDecompressor()
    try:
        out = dctx.decompress(data, max_length=room + 1)
    except RuntimeError as exc:
        raise DecompressionError(f"records do not decompress as lz4: {exc}") from None
    if len(out) > room:
        if declared:
            raise DecompressionError(
                f"records do not decompress as lz4: the frame holds more than the {declared} bytes it declares"
            )
        raise DecompressedTooLarge("lz4", limit_bytes)
    if not dctx.eof:
        raise DecompressionError("records do not decompress as lz4: the lz4 frame is truncated")
    if dctx.unused_data:
        raise DecompressionError(f"records hold {len(dctx.unused_data)} bytes after their lz4 frame")
    return bytes(out)


def decompress_gzip(data: bytes | memoryview, limit_bytes: int) -> bytes:
    """One gzip member, its output stopped at ``limit_bytes + 1`` (zlib's ``max_length``)."""
    dctx = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        out = dctx.decompress(data, limit_bytes + 1)
    except zlib.error as exc:
        raise DecompressionError(f"records do not decompress as gzip: {exc}") from None
    if len(out) > limit_bytes:
        raise DecompressedTooLarge("gzip", limit_bytes)
    if not dctx.eof:
        raise DecompressionError("records do not decompress as gzip: the gzip stream is truncated")
    if dctx.unused_data:
        raise DecompressionError(f"records hold {len(dctx.unused_data)} bytes after their gzip stream")
    return out


def _snappy_size(block: bytes | memoryview) -> int:
    """The decompressed size a raw snappy block declares in its preamble."""
    try:
        return int(cramjam.snappy.decompress_raw_len(block))
    except cramjam.DecompressionError as exc:
        raise DecompressionError(f"records do not decompress as snappy: {exc}") from None


def _snappy_into(block: bytes | memoryview, out: memoryview) -> None:
    """Decompress a raw snappy block into ``out``, exactly its declared size (the decoder never writes past
    it, and refuses a block that does not fill it)."""
    try:
        cramjam.snappy.decompress_raw_into(block, out)
    except cramjam.DecompressionError as exc:
        raise DecompressionError(f"records do not decompress as snappy: {exc}") from None


def decompress_snappy(data: bytes | memoryview, limit_bytes: int) -> memoryview:
    """One raw snappy block, bounded by its preamble as the module docstring says."""
    declared = _snappy_size(data)
    if declared > limit_bytes:
        raise DecompressedTooLarge("snappy", limit_bytes, declared)
    out = memoryview(bytearray(declared))
    _snappy_into(data, out)
    return out


XERIAL_MAGIC = b"\x82SNAPPY\x00"
_XERIAL_HEADER_BYTES = 16  # the magic, then a version and a minimum compatible version, 4 bytes each
_BLOCK_LENGTH = struct.Struct(">i")


def decompress_kafka_snappy(data: bytes | memoryview, limit_bytes: int) -> bytes | memoryview:
    """A Kafka batch's snappy records: the xerial "snappy-java" framing, or one raw block (librdkafka's), at
    most ``limit_bytes`` in all, refused before anything past the limit is allocated."""
    view = memoryview(data)
    if bytes(view[: len(XERIAL_MAGIC)]) != XERIAL_MAGIC:
        return decompress_snappy(view, limit_bytes)
    blocks = _xerial_blocks(view)
    sizes = [_snappy_size(block) for block in blocks]
    total = sum(sizes)
    if total > limit_bytes:
        raise DecompressedTooLarge("snappy", limit_bytes, total)
    out = memoryview(bytearray(total))
    at = 0
    for block, size in zip(blocks, sizes, strict=True):
        _snappy_into(block, out[at : at + size])
        at += size
    return out


def _xerial_blocks(view: memoryview) -> list[memoryview]:
    """The raw snappy blocks of a xerial frame; each block's length must stay inside the frame."""
    if len(view) < _XERIAL_HEADER_BYTES:
        raise DecompressionError("records do not decompress as snappy: the xerial header is truncated")
    blocks: list[memoryview] = []
    pos = _XERIAL_HEADER_BYTES
    while pos < len(view):
        if len(view) - pos < _BLOCK_LENGTH.size:
            raise DecompressionError(
                f"records do not decompress as snappy: a xerial block length at byte {pos} is truncated"
            )
        (length,) = _BLOCK_LENGTH.unpack_from(view, pos)
        pos += _BLOCK_LENGTH.size
        if not 0 < length <= len(view) - pos:
            raise DecompressionError(
                f"records do not decompress as snappy: the xerial block at byte {pos - 4} says {length} bytes, "
                f"{len(view) - pos} are left"
            )
        blocks.append(view[pos : pos + length])
        pos += length
    if not blocks:
        raise DecompressionError("records do not decompress as snappy: the xerial frame holds no block")
    return blocks
