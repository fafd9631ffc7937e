"""Compression codecs for the records section of a batch.

The codec id lives in bits 0-2 of a batch's ``attributes``. Both codecs come
from maintained wheels (``zstandard`` and ``lz4``), so both are always there.
The broker never calls this module: it stores and serves compressed bytes as
they are. Only producers (compress) and consumers (decompress) do.
"""

from __future__ import annotations

import enum

import lz4.frame
import zstandard


class Compression(enum.IntEnum):
    NONE = 0
    ZSTD = 1
    LZ4 = 2

    @classmethod
    def parse(cls, text: str) -> Compression:
        try:
            return cls[text.upper()]
        except KeyError:
            names = ", ".join(c.name.lower() for c in cls)
            raise ValueError(f"unknown compression {text!r}: choose one of {names}") from None


COMPRESSION_MASK = 0x07

_zstd_c = zstandard.ZstdCompressor(level=3)
_zstd_d = zstandard.ZstdDecompressor()


class DecompressionError(ValueError):
    """The records section does not decompress with the codec its batch names."""


def compress(codec: Compression, data: bytes) -> bytes:
    if codec is Compression.NONE:
        return data
    if codec is Compression.ZSTD:
        return _zstd_c.compress(data)
    return bytes(lz4.frame.compress(data))


def decompress(codec: int, data: bytes | memoryview) -> bytes | memoryview:
    try:
        if codec == Compression.NONE:
            return data
        if codec == Compression.ZSTD:
            return _zstd_d.decompress(data)
        if codec == Compression.LZ4:
            return bytes(lz4.frame.decompress(data))
    except (zstandard.ZstdError, RuntimeError) as exc:
        raise DecompressionError(f"records do not decompress as {Compression(codec).name}: {exc}") from exc
    raise DecompressionError(f"unknown compression codec id {codec} in batch attributes")
