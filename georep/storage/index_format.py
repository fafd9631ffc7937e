"""The entries of a segment's ``.index`` and ``.oindex`` files. Pure: structs and their decoding, no I/O.

The file layouts are documented in :mod:`georep.storage.segment_log`. Both the shell that reads and writes the
files (``segment.py``) and the pure planner that decides what a damaged segment holds (``slots.py``) use these.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from georep.record.batch import BatchHeader
from georep.storage.api import BytesLike

FILE_HEADER = struct.Struct(">4sB3x")  # magic, version, reserved
INDEX_MAGIC = b"GRSI"
ORIGIN_INDEX_MAGIC = b"GROI"
INDEX_FORMAT_VERSION = 1
# Version 2 added the batch's CRC-32C (so a repair can check a peer's copy against it, and a batch whose only
# damage is in its 24 rewritten bytes can be recognised and mended). A version-1 file is rebuilt from the log.
ORIGIN_INDEX_FORMAT_VERSION = 2
INDEX_ENTRY = struct.Struct(">II")  # relative_offset, position
ORIGIN_ENTRY = struct.Struct(">32sIqiqIIqqhiqI2x")
ORIGIN_ENTRY_BYTES = ORIGIN_ENTRY.size  # 100
U32_MAX = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class OriginEntry:
    """One decoded ``.oindex`` entry: what was appended where."""

    origin_site: bytes  # NUL-padded
    origin_epoch: int
    base_origin_seq: int
    last_offset_delta: int
    base_offset: int
    position: int
    size_bytes: int
    max_timestamp: int
    producer_id: int
    producer_epoch: int
    base_sequence: int
    append_time_ms: int
    crc: int

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.last_offset_delta + 1

    @property
    def next_origin_seq(self) -> int:
        return self.base_origin_seq + self.last_offset_delta + 1

    @property
    def end_position(self) -> int:
        return self.position + self.size_bytes

    @property
    def origin_key(self) -> tuple[bytes, int]:
        return (self.origin_site, self.origin_epoch)

    def pack(self) -> bytes:
        return ORIGIN_ENTRY.pack(
            self.origin_site,
            self.origin_epoch,
            self.base_origin_seq,
            self.last_offset_delta,
            self.base_offset,
            self.position,
            self.size_bytes,
            self.max_timestamp,
            self.producer_id,
            self.producer_epoch,
            self.base_sequence,
            self.append_time_ms,
            self.crc,
        )


def entry_for(header: BatchHeader, base_offset: int, position: int, append_time_ms: int) -> OriginEntry:
    """The ``.oindex`` entry of ``header`` stored at ``base_offset`` and byte ``position``.

    Raises ``UnicodeEncodeError`` or ``struct.error`` for a header no entry can hold (a non-ASCII origin).
    """
    site = header.origin_site.encode("ascii")
    if len(site) > 32:
        raise struct.error(f"origin site {header.origin_site!r} is longer than 32 bytes")
    return OriginEntry(
        site.ljust(32, b"\0"),
        header.origin_epoch,
        header.base_origin_seq,
        header.last_offset_delta,
        base_offset,
        position,
        header.size_bytes,
        header.max_timestamp,
        header.producer_id,
        header.producer_epoch,
        header.base_sequence,
        append_time_ms,
        header.crc,
    )


def pack_origin_entry(header: BatchHeader, base_offset: int, position: int, append_time_ms: int) -> bytes:
    return entry_for(header, base_offset, position, append_time_ms).pack()


def iter_origin_entries(entries: BytesLike) -> Iterator[OriginEntry]:
    for fields in ORIGIN_ENTRY.iter_unpack(entries):
        yield OriginEntry(*fields)


def pack_entries(entries: Iterable[OriginEntry]) -> bytes:
    return b"".join(e.pack() for e in entries)


def sparse_index(entries: Iterable[OriginEntry], segment_base: int, index_interval_bytes: int) -> bytes:
    """The ``.index`` entries for a segment's batches: a pure function of the batches and the interval.

    A batch gets an entry when at least ``index_interval_bytes`` of log were written since the last entry's batch
    began (counted from position 0 when there is none yet), as the append path does.
    """
    out = bytearray()
    since = 0
    for e in entries:
        if since >= index_interval_bytes:
            out += INDEX_ENTRY.pack(e.base_offset - segment_base, e.position)
            since = 0
        since += e.size_bytes
    return bytes(out)


def file_bytes(magic: bytes, version: int, entries: BytesLike) -> bytes:
    return FILE_HEADER.pack(magic, version) + bytes(entries)


def entries_of_file(data: bytes, magic: bytes, version: int, entry_bytes: int) -> bytes | None:
    """The entries of an index file's bytes, or ``None`` if they are foreign, of another version or torn."""
    if len(data) < FILE_HEADER.size or (len(data) - FILE_HEADER.size) % entry_bytes:
        return None
    file_magic, file_version = FILE_HEADER.unpack_from(data)
    if file_magic != magic or file_version != version:
        return None
    return data[FILE_HEADER.size :]
