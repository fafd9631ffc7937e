"""The fetch cursor: where a consumer's read starts, and what each read hands out. Sans I/O.

A :class:`FetchCursor` reads one partition over the ``PartitionLog`` port.
The node's ``Fetch`` handler drives it (and waits for fsyncs itself); the
simulator's consumers drive it over ``MemoryLog``.

**Start.** One of:

* :class:`AtOffset`: a local offset, as in Kafka. Outside
  ``[log_start_offset, log_end_offset]`` the first read raises
  ``OffsetOutOfRange``, which names the valid range.
* :class:`Earliest` / :class:`Latest`: the log start, or the end of what readers
  may see (``flushed_offset``: Kafka's high watermark). Not the log end: a
  tail past it may yet be lost (an origin's crash before its fsync) or cut (a
  multi-node site's recovery seals at the LAC), and a read started past the
  end that then stands would skip the records written there next.
* :class:`FromVector`: a vector offset, the same position at every site. The
  read starts at the smallest local offset that holds a record the vector
  does not cover (``start_offset_for_vector``: found per origin in the origin
  index). With a *hint* (the local offset a committing consumer had reached,
  and the ``site@epoch`` where it committed), a consumer that resumes at that
  very site and epoch starts at the hint instead, clamped into the log: it had
  read everything below it in this same log.

**Reads.** :meth:`FetchCursor.read` returns whole batches from the position,
and only batches below the log's ``flushed_offset``. An origin that crashes
loses what it had not fsynced and stamps those origin seqs again with other
records; a consumer that had read the lost ones would hold a vector covering
records it never saw (the simulator found this). With a vector start, batches
the vector covers whole are dropped here, for the rest of the cursor's life;
a batch covered in part is handed out whole and the client drops the covered
records. Batch boundaries are the origin's, the same at every site, so the
filter runs per batch, never per record.

A read may hand out nothing while the cursor still moved (a stretch of
covered batches): :attr:`FetchCursor.readable` says whether to read again now
or to wait for the next fsync.

**Both front ends.** georep's ``Fetch`` keeps a cursor per stream; the Kafka
gateway makes one per partition of each Fetch request, at the request's
offset. Listed offsets (earliest, latest, by time) are :func:`listed_offset`'s
for both.

**Resuming a vector at a Kafka offset** (:func:`resume_at`). A Kafka client
resumes at one offset, not a vector: OffsetFetch answers the exact local offset
of the first record the vector does not cover (:func:`first_uncovered`), inside
its batch (Kafka clients drop the records before the offset they asked for
from a fetched batch). Every record below that offset is covered. Past it the
log may still hold covered records, interleaved with uncovered ones (each
origin's records arrive in another order at each site), and covered records
not held yet may still arrive: :attr:`Resume.covered_after` says so, and only
then does the gateway filter that client's fetches. When it is false, a plain
"seek to the offset and read" reader, with no filter at all, reads exactly the
records the vector does not cover.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from georep.broker.errors import NotHeld
from georep.record.batch import decode_records, iter_headers, parse_header
from georep.storage.api import PartitionLog, start_offset_for_vector
from offsets.coordinates import LocalOffset, Origin, OriginSeq
from offsets.log_prefix import vector_below
from offsets.vector import VectorOffset


@dataclass(frozen=True, slots=True)
class AtOffset:
    offset: int


@dataclass(frozen=True, slots=True)
class Earliest:
    pass


@dataclass(frozen=True, slots=True)
class Latest:
    pass


@dataclass(frozen=True, slots=True)
class FromVector:
    vector: VectorOffset
    hint_origin: Origin | None = None  # where the hint was taken: it holds only in that log
    hint_offset: int = -1


FetchStart = AtOffset | Earliest | Latest | FromVector


def start_position(log: PartitionLog, start: FetchStart, own: Origin, exact: bool = False) -> LocalOffset:
    """The local offset a fetch from ``start`` begins at, in ``log`` of the site whose origin is ``own``: for a
    vector, the batch holding its first uncovered record, or with ``exact`` that record's own offset."""
    if isinstance(start, AtOffset):
        return LocalOffset(start.offset)
    if isinstance(start, Earliest):
        return log.log_start_offset
    if isinstance(start, Latest):
        return log.flushed_offset
    if start.hint_origin == own and start.hint_offset >= 0:
        return LocalOffset(min(max(start.hint_offset, log.log_start_offset), log.log_end_offset))
    vector = start.vector.to_dict()
    return first_uncovered(log, vector) if exact else start_offset_for_vector(log, vector)


def vector_at(log: PartitionLog, offset: int) -> VectorOffset:
    """The vector of everything below local ``offset`` in ``log``: what a reader stopped at ``offset`` has read.

    ``offset`` must lie in ``[log start, log end]`` (``OffsetOutOfRange`` otherwise: below the log start the
    records are gone, and so is the exact vector). The answer is the vector at the base of the segment holding
    ``offset`` (:meth:`PartitionLog.segment_at`: every batch below it, those retention or a chain trim deleted
    included) advanced past that segment's batches below ``offset`` by ``offsets/log_prefix.py``, the one fold
    every vector-at-an-offset question uses. Cost: one segment's batch entries, not the whole log's.
    """
    segment = log.segment_at(offset)
    return vector_below(segment.start_vector, segment.entries, offset)


def first_uncovered(log: PartitionLog, vector: Mapping[Origin, int]) -> LocalOffset:
    """The local offset of the first record ``vector`` does not cover (the log end if none), exact inside its
    batch: per origin, the batch holding its first uncovered seq (``start_offset_for_vector``'s lookup in the
    origin index), then that seq's offset in the batch (a batch maps a contiguous offset range onto a
    contiguous origin-seq range). One batch read per origin the vector leaves records of."""
    start = int(log.log_end_offset)
    for origin, next_seq in sorted(log.vector().items()):
        want = vector.get(origin, 0)
        if want >= next_seq:
            continue
        at = log.offset_for_origin_seq(origin, OriginSeq(want))
        if at is not None and at < start:
            start = min(start, _offset_of_seq(log, int(at), origin, want))
    return LocalOffset(max(start, log.log_start_offset))


def _offset_of_seq(log: PartitionLog, at: int, origin: Origin, seq: int) -> int:
    """The offset of ``origin``'s ``seq`` in the batch at ``at`` (its base if retention took ``seq``, or if the
    batch cannot be read: starting early is safe, the filter then drops what the vector covers)."""
    try:
        data = log.read(LocalOffset(at), 1).data
    except Exception:  # a quarantined batch: the reader will meet it there anyway
        return at
    header = parse_header(data) if data else None
    if header is None or header.origin != origin or header.base_offset != at:
        return at
    return at + min(max(0, seq - header.base_origin_seq), header.last_offset_delta)


@dataclass(frozen=True, slots=True)
class Resume:
    """Where a Kafka reader resumes a committed vector at this site."""

    offset: LocalOffset  # exact: every record below it is covered, and the record at it is not
    covered_after: bool  # covered records lie past ``offset`` here, or may still arrive: filter the reader


def resume_at(log: PartitionLog, start: FromVector, own: Origin) -> Resume:
    """Where a reader of ``log`` resumes ``start`` at one local offset (see the module docstring): the commit's
    hint in the log it was taken in (:func:`start_position`), else :func:`first_uncovered`; and whether the
    vector covers records past that offset, now or once they arrive (then the vector exceeds the vector of
    what lies below the offset)."""
    offset = start_position(log, start, own, exact=True)
    try:
        below = vector_at(log, offset)
    except Exception:  # a segment held on another node (a chain's old copy): not known here, so filter
        return Resume(offset, True)
    return Resume(offset, not start.vector <= below)


def listed_offset(log: PartitionLog, query: Earliest | Latest | int) -> LocalOffset | None:
    """ListOffsets for both front ends: the log start, the high watermark (``flushed_offset``: where a read from
    latest starts), or for a timestamp :func:`offset_for_time` (None: no durable batch is that late; georep
    answers -1, Kafka the high watermark, where such records will go)."""
    if isinstance(query, Earliest):
        return log.log_start_offset
    if isinstance(query, Latest):
        return log.flushed_offset
    return offset_for_time(log, query)


class FetchCursor:
    """One consumer's read of one partition at one site."""

    __slots__ = ("log", "position", "vector")

    def __init__(self, log: PartitionLog, start: FetchStart, own: Origin) -> None:
        self.log = log
        self.position = start_position(log, start, own)
        self.vector: Mapping[Origin, int] | None = start.vector.to_dict() if isinstance(start, FromVector) else None

    @property
    def readable(self) -> bool:
        """Whether durable batches lie at or after the position (else wait for the next fsync)."""
        return self.position < self.log.flushed_offset

    def read(self, max_bytes: int) -> bytes:
        """Whole durable batches from the position (at least one if any), covered ones dropped; advances.

        Raises ``OffsetOutOfRange`` when the position is outside the log.
        """
        log = self.log
        flushed = log.flushed_offset
        res = log.read(self.position, max_bytes)
        data, position = durable_part(res.data, res.next_offset, flushed)
        self.position = position
        if self.vector is not None and data:
            data = drop_covered(data, self.vector)
        return data

    def check_in_range(self) -> None:
        """Raise ``OffsetOutOfRange`` (with the valid range) if the position is outside the log: past its end, or
        below its start (retention deleted what it named, even where nothing durable lies after it yet)."""
        log = self.log
        if self.position > log.log_end_offset or self.position < log.log_start_offset:
            log.read(self.position, 0)


def offset_for_time(log: PartitionLog, timestamp_ms: int) -> LocalOffset | None:
    """Where a read of the records at or after ``timestamp_ms`` starts: in the first batch whose max timestamp is at
    or after it, the first record stamped at or after it (Kafka's answer: its clients drop a fetched batch's
    records below the offset they asked for), among the batches a reader may be handed (below the flushed
    offset); None when no such batch is durable yet. Both front ends answer offsets by time with it (georep's
    ``ListOffsets``, Kafka's), each saying None its own way. A batch past the flushed offset is not answered: a
    crash or a recovery may still cut it, and a consumer told to start there would skip what is written in its
    place."""
    found = log.offset_for_timestamp(timestamp_ms)
    if found is None or found >= log.flushed_offset:
        return None
    try:
        data = log.read(found, 1).data
        records = decode_records(data[: parse_header(data).size_bytes]) if data else []
    except Exception:  # a quarantined or invalid batch: its base, which reads no less (readers meet it anyway)
        return found
    return next((r.offset for r in records if r.timestamp_ms >= timestamp_ms), found)


def durable_part(chunk: bytes, next_offset: LocalOffset, flushed: int) -> tuple[bytes, LocalOffset]:
    """The batches of ``chunk`` below the flushed offset, and where reading goes on."""
    if next_offset <= flushed:
        return chunk, next_offset
    end = 0
    for h in iter_headers(chunk):
        if h.base_offset >= flushed:
            return chunk[:end], LocalOffset(h.base_offset)
        end += h.size_bytes
    return chunk, next_offset


def drop_covered(chunk: bytes, vector: Mapping[Origin, int]) -> bytes:
    """Drop whole batches the vector covers; batches covered in part stay (the client trims)."""
    keep: list[memoryview] = []
    view = memoryview(chunk)
    pos = 0
    for h in iter_headers(chunk):
        if h.last_origin_seq >= vector.get(h.origin, 0):
            keep.append(view[pos : pos + h.size_bytes])
        pos += h.size_bytes
    if len(keep) == 1 and len(keep[0]) == len(chunk):
        return chunk
    return b"".join(keep)


def batch_by_coordinate(log: PartitionLog, origin: Origin, seq: int) -> bytes:
    """The whole durable batch of ``origin`` that holds ``seq``, as stored here (a peer's repair asks for it).

    Raises ``NotHeld`` if this log has no durable batch holding it, and
    ``BatchDamaged`` if its own copy is quarantined.
    """
    at = log.offset_for_origin_seq(origin, OriginSeq(seq))
    if at is None or at >= log.flushed_offset:
        raise NotHeld(f"origin {origin} seq {seq} is not held durably here")
    data = log.read(at, 1).data
    header = parse_header(data) if data else None
    if header is None or header.origin != origin or not header.base_origin_seq <= seq <= header.last_origin_seq:
        raise NotHeld(f"origin {origin} seq {seq} is not held here (retention may have removed it)")
    return data[: header.size_bytes]
