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
offset, and resumes a committed vector (OffsetFetch) at the position a cursor
from that vector would take. Offsets by time follow :func:`offset_for_time`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from georep.broker.errors import NotHeld
from georep.record.batch import iter_headers, parse_header
from georep.storage.api import PartitionLog, start_offset_for_vector
from offsets.coordinates import LocalOffset, Origin, OriginSeq
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


def start_position(log: PartitionLog, start: FetchStart, own: Origin) -> LocalOffset:
    """The local offset a fetch from ``start`` begins at, in ``log`` of the site whose origin is ``own``."""
    if isinstance(start, AtOffset):
        return LocalOffset(start.offset)
    if isinstance(start, Earliest):
        return log.log_start_offset
    if isinstance(start, Latest):
        return log.flushed_offset
    if start.hint_origin == own and start.hint_offset >= 0:
        return LocalOffset(min(max(start.hint_offset, log.log_start_offset), log.log_end_offset))
    return start_offset_for_vector(log, start.vector.to_dict())


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
    """Where a read of the records at or after ``timestamp_ms`` starts: the first batch whose max timestamp is at or
    after it, among the batches a reader may be handed (below the flushed offset); None when no such batch is
    durable yet. Both front ends answer offsets by time with it (georep's ``ListOffsets``, Kafka's), each saying
    None its own way. A batch past the flushed offset is not answered: a crash or a recovery may still cut it,
    and a consumer told to start there would skip what is written in its place."""
    found = log.offset_for_timestamp(timestamp_ms)
    if found is None or found >= log.flushed_offset:
        return None
    return found


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
