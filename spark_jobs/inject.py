"""Inject divergence into a stopped site's partition log: what the audit must catch.

Each function rewrites one partition directory through the storage layer
(:class:`georep.storage.segment_log.SegmentLog`), so offsets, indexes and
CRCs stay valid and the storage layer's own checks see nothing wrong: only a
comparison with the other sites can. For the audit's tests and the demo; never
point it at a site that is running.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from georep.record.batch import BatchHeader, RecordInput, decode_records, encode_batch, parse_header
from georep.record.compression import Compression
from georep.storage.api import LogConfig
from georep.storage.recovery_point import read_recovery_point
from georep.storage.replica_store import REPLICA_LOG_CONFIG, REPLICAS_DIR
from georep.storage.segment_log import SegmentLog
from spark_jobs.layout import SegmentFile, partition_segments
from spark_jobs.scan import scan_segment

Stored = tuple[int, bytes]  # (append_time_ms, whole batch)


class NothingToInject(ValueError):
    """The partition holds no batch with the wanted coordinate."""


def read_partition(part_dir: Path) -> list[Stored]:
    """Every valid batch of a partition directory (or of one node's copy of a segment), in log order."""
    out: list[Stored] = []
    for segment in partition_segments("x", "", 0, part_dir):
        out.extend(_batches(segment))
    return out


def _batches(segment: SegmentFile) -> list[Stored]:
    return [(s.header.append_time_ms, s.data) for s in scan_segment(segment) if s.header is not None]


def rewrite_partition(part_dir: Path, edit: Callable[[list[Stored]], list[Stored]]) -> None:
    """Replace the partition's log with ``edit`` of its batches, appended afresh from its first offset.

    A node's copy of a segment (``<node>/replicas/<topic>-<p>/<segment id>/``) keeps its base offset and start
    vector, and its append times, so that it stays byte for byte what the other copies hold, except for the edit.
    """
    batches = edit(read_partition(part_dir))
    fresh = part_dir.with_name(part_dir.name + ".rewrite")
    shutil.rmtree(fresh, ignore_errors=True)
    files = partition_segments("x", "", 0, part_dir)
    if part_dir.parent.parent.name == REPLICAS_DIR and files:
        point = read_recovery_point(part_dir)
        base = files[0].base_offset
        vector = point.vector if point is not None and point.vector_offset == base else {}
        log = SegmentLog.create_at(fresh, REPLICA_LOG_CONFIG, base, vector, 0)
    else:
        log = SegmentLog.open(fresh, LogConfig(), 0)
    for append_time_ms, batch in batches:
        log.append(parse_header(batch), [memoryview(batch)[24:]], append_time_ms)
    log.close()
    shutil.rmtree(part_dir)
    fresh.rename(part_dir)


def _index_of(batches: list[Stored], origin: str, seq: int) -> int:
    for i, (_t, batch) in enumerate(batches):
        h = parse_header(batch)
        if str(h.origin) == origin and h.base_origin_seq <= seq <= h.last_origin_seq:
            return i
    raise NothingToInject(f"no batch of origin {origin} holds seq {seq}")


def _reencode(header: BatchHeader, records: list[RecordInput]) -> bytes:
    return encode_batch(
        records,
        producer_id=header.producer_id,
        producer_epoch=header.producer_epoch,
        base_sequence=header.base_sequence,
        compression=Compression(header.compression),
        origin=header.origin,
        base_origin_seq=header.base_origin_seq,
    )


def flip_value_byte(part_dir: Path, origin: str, seq: int) -> None:
    """Flip one bit of the value of record (origin, seq); the batch CRC is recomputed, so it still checks."""

    def edit(batches: list[Stored]) -> list[Stored]:
        i = _index_of(batches, origin, seq)
        appended, batch = batches[i]
        header = parse_header(batch)
        records = [RecordInput(r.key, r.value, r.headers, r.timestamp_ms) for r in decode_records(batch, header)]
        target = records[seq - header.base_origin_seq]
        value = bytearray(target.value or b"\0")
        value[0] ^= 0x01
        records[seq - header.base_origin_seq] = target._replace(value=bytes(value))
        return [*batches[:i], (appended, _reencode(header, records)), *batches[i + 1 :]]

    rewrite_partition(part_dir, edit)


def flip_value_byte_in_place(segment: SegmentFile, origin_site: str) -> tuple[str, int, int]:
    """Flip one bit of a value in the segment file itself, in the first batch of ``origin_site`` with two records
    or more (its second record), re-encoding the batch to the same length with its CRC recomputed: the segment,
    sealed or not, keeps every offset and index entry, and only a comparison with another site can tell.

    Returns (origin, seq, byte position of the batch). For a stopped node's files."""
    for s in scan_segment(segment):
        h = s.header
        if h is None or h.origin_site != origin_site or h.records_count < 2:
            continue
        records = [RecordInput(r.key, r.value, r.headers, r.timestamp_ms) for r in decode_records(s.data, h)]
        value = bytearray(records[1].value or b"\0")
        value[0] ^= 0x01
        records[1] = records[1]._replace(value=bytes(value))
        edited = s.data[:20] + _reencode(h, records)[20:]  # the local offset and append time kept; the new CRC
        if len(edited) != len(s.data):
            continue  # a compressed batch whose size changed: try the next
        with open(segment.path, "r+b") as f:
            f.seek(s.position)
            f.write(edited)
        return str(h.origin), h.base_origin_seq + 1, s.position
    raise NothingToInject(f"{segment.path} holds no batch of origin site {origin_site} with two records")


def delete_batch(part_dir: Path, origin: str, seq: int) -> None:
    """Remove the batch holding (origin, seq)."""
    rewrite_partition(part_dir, lambda b: (lambda i: [*b[:i], *b[i + 1 :]])(_index_of(b, origin, seq)))


def duplicate_batch(part_dir: Path, origin: str, seq: int) -> None:
    """Append a second copy of the batch holding (origin, seq) at the end of the log."""
    rewrite_partition(part_dir, lambda b: [*b, b[_index_of(b, origin, seq)]])


def swap_batches(part_dir: Path, origin: str, seq: int) -> None:
    """Swap the batch holding (origin, seq) with that origin's next batch in the log."""

    def edit(batches: list[Stored]) -> list[Stored]:
        i = _index_of(batches, origin, seq)
        j = _index_of(batches, origin, parse_header(batches[i][1]).next_origin_seq)
        out = list(batches)
        out[i], out[j] = out[j], out[i]
        return out

    rewrite_partition(part_dir, edit)


def corrupt_byte(segment_path: Path, position: int) -> None:
    """Flip one byte in place, CRC left as it was: storage-level damage."""
    with open(segment_path, "r+b") as f:
        f.seek(position)
        byte = f.read(1)
        f.seek(position)
        f.write(bytes([byte[0] ^ 0xFF]))


__all__ = [
    "NothingToInject",
    "corrupt_byte",
    "delete_batch",
    "duplicate_batch",
    "flip_value_byte",
    "flip_value_byte_in_place",
    "read_partition",
    "rewrite_partition",
    "swap_batches",
]
