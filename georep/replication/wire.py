"""Replication's compression on the wire: a chunk's batches zstd-compressed for the trip, when the destination
accepts it (``ReplicateRequest.accept_zstd``) and it makes them smaller.

Why. A site stores batches as they were produced, and every batch a Kafka client produced without compression is
stored uncompressed, so it crossed a WAN link uncompressed. Compressing a chunk (several batches at once) for the
trip saves most of those bytes: JSON-like records shrink several times. A chunk that does not shrink by a tenth
(batches compressed by their producer) goes as stored.

Safety. The destination decompresses before it checks or stores anything, bounded by the largest message it
takes (the node's ``MESSAGE_BYTES_MAX``): a frame that declares more, or writes more, is refused, not inflated
(``georep/record/compression.py``), and ends the stream like any corrupt chunk. What it stores is the
decompressed bytes, which are byte for byte what the source holds: compression changes no offset, no coordinate
and no CRC, and every check of a chunk (framing, CRCs, the batch's contents, its origin) runs on them as before.
"""

from __future__ import annotations

from georep.record.compression import Compression, DecompressionError, compress, decompress_zstd
from georep.replication.sink import CorruptChunk

WIRE_MIN_BYTES = 1024  # smaller chunks go as stored: the frame's overhead would eat what it saves
WIRE_MIN_SAVING = 0.1  # a chunk is sent compressed only if that saves at least a tenth of its bytes


def pack(batches: bytes) -> tuple[bytes, bytes]:
    """``(batches, batches_zstd)`` for a chunk: one of them empty."""
    if len(batches) < WIRE_MIN_BYTES:
        return batches, b""
    packed = compress(Compression.ZSTD, batches)
    if len(packed) > len(batches) * (1 - WIRE_MIN_SAVING):
        return batches, b""
    return b"", packed


def unpack(batches: bytes, batches_zstd: bytes, limit_bytes: int) -> bytes:
    """A chunk's batches as the source stores them; ``CorruptChunk`` if its compressed form is not one zstd frame of
    at most ``limit_bytes``, or if it has both forms."""
    if not batches_zstd:
        return batches
    if batches:
        raise CorruptChunk("a chunk that carries its batches both as stored and compressed (a source sends one)")
    try:
        return decompress_zstd(batches_zstd, limit_bytes)
    except DecompressionError as exc:
        raise CorruptChunk(f"a compressed chunk that does not decompress: {exc}") from None
