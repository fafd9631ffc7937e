"""The destination side: apply one replicated chunk to a partition log.

Every batch's framing, CRC and header are checked first, over the whole
chunk, before anything is appended (``georep/record/validate.py``,
``check_header``): a corrupt chunk raises :class:`CorruptChunk` and nothing of
it is stored, so the puller drops the stream and opens it again. Then
``dedup.apply.plan_apply`` decides, per batch, against the log's vector, and
the records of each batch planned for append are validated, decompressed into
at most the topic's ``max_batch_bytes`` (``check_records``): an upstream, even
a lying one, never makes this site store a batch it could not serve. The
planned batches are appended verbatim: ``PartitionLog.append`` writes its own
24-byte local prefix (local offset, local append time) in front of the
CRC-covered bytes, which are passed as a slice of the received buffer and
never copied or re-checksummed. A batch the vector already covers is skipped
without a look at its records.

**An invalid batch** (:class:`InvalidChunk`) is not stored, and neither is
anything after it in the chunk, of its origin or any other: the batches before
it are appended, then the error is raised. It names the origin, the origin
seqs and the reason; the puller ends the stream with it as the link's error
and backs off (``georep/replication/session.py``), so the log shows it once
and the link, down, lets routing take the origin through another upstream.
Its records are not checked against this site's clock: an old batch is
legitimately old, and the clocks of sites differ.

Replicated batches never touch the producer state table: that table is the
origin's dedup of producer retries, and these batches were deduplicated at
their origin already.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from dedup.apply import Covered, Gap, PartialOverlap, plan_apply
from georep.record.batch import (
    HEADER,
    READ_RECORDS_BYTES_MAX,
    REWRITTEN_BYTES,
    BatchHeader,
    CorruptBatch,
    InvalidBatch,
    frame_length,
)
from georep.record.validate import check_header, check_records
from georep.storage.api import PartitionLog
from offsets.coordinates import Origin
from offsets.vector import SEQ_MAX, VectorOffset
from topology.ids import InvalidSiteId, site_id


class CorruptChunk(ValueError):
    """A replicated chunk that is not whole, CRC-valid batches; nothing of it was applied."""


class InvalidChunk(CorruptChunk):
    """A replicated chunk holding a whole, CRC-valid batch that is not valid (``georep/record/validate.py``).
    The batches before it were applied; it and everything after it were not."""


@dataclass(frozen=True, slots=True)
class ApplyOutcome:
    appended_batches: int = 0
    appended_bytes: int = 0
    appended_records: int = 0
    skipped_batches: int = 0  # already held: covered by the vector
    gap: Gap | None = None  # the first gap, if a batch started past the vector
    overlaps: tuple[PartialOverlap, ...] = ()
    lag_ms: int | None = None  # now_ms - max_timestamp of the last appended batch
    blocked_batches: int = 0  # not appended: after a gap or a divergent batch of their origin
    lag_ms_by_origin: Mapping[Origin, int] = field(default_factory=dict)  # per origin, its last appended batch

    @property
    def diverged(self) -> bool:
        return bool(self.overlaps)


def apply_chunk(
    log: PartitionLog, batches: bytes, now_ms: int, limit_bytes: int = READ_RECORDS_BYTES_MAX
) -> ApplyOutcome:
    """Check, deduplicate and append one chunk's batches, each decompressing into at most ``limit_bytes`` (the
    topic's ``max_batch_bytes``). Raises :class:`CorruptChunk`, or :class:`InvalidChunk` after appending the
    batches before the invalid one.

    Storage errors (``DiskFull``, ``OSError``) propagate. The batches appended
    before one are kept: they extend the vector in order, so the log is still
    a prefix per origin, and the next chunk from a reopened stream goes on
    from there.
    """
    if not batches:
        return ApplyOutcome()
    view = memoryview(batches)
    headers, starts, invalid = _checked_headers(view)
    plan = plan_apply(VectorOffset(log.vector()), headers)
    append_indexes = list(plan.append_indexes)
    for n, i in enumerate(append_indexes):
        try:
            check_records(view[starts[i] :], headers[i], limit_bytes)
        except InvalidBatch as exc:
            invalid = _invalid(view[starts[i] :], str(exc))
            del append_indexes[n:]
            break
    outcome = _append(log, view, headers, starts, append_indexes, now_ms)
    if invalid is not None:
        raise invalid
    skipped = sum(1 for d in plan.decisions if isinstance(d, Covered))
    first_gap = next(iter(plan.gaps.values()), None) if plan.gaps else None
    return ApplyOutcome(
        appended_batches=outcome.appended_batches,
        appended_bytes=outcome.appended_bytes,
        appended_records=outcome.appended_records,
        skipped_batches=skipped,
        gap=first_gap,
        overlaps=plan.overlaps,
        lag_ms=outcome.lag_ms,
        blocked_batches=len(headers) - outcome.appended_batches - skipped,
        lag_ms_by_origin=outcome.lag_ms_by_origin,
    )


def _checked_headers(view: memoryview) -> tuple[list[BatchHeader], list[int], InvalidChunk | None]:
    """The headers of the chunk's batches up to the first invalid one, where each starts, and that one's error.

    Raises :class:`CorruptChunk` for a torn or CRC-failed batch anywhere in the chunk: nothing of it is applied."""
    headers: list[BatchHeader] = []
    starts: list[int] = []
    invalid: InvalidChunk | None = None
    pos = 0
    end = len(view)
    while pos < end:
        try:
            size = frame_length(view, pos)
        except CorruptBatch as exc:
            raise CorruptChunk(f"replicated chunk of {end} bytes ends with a partial batch: {exc}") from None
        if pos + size > end:
            raise CorruptChunk(f"replicated chunk of {end} bytes ends with a partial batch after byte {pos}")
        batch = view[pos : pos + size]
        try:
            header = check_header(batch)
            if invalid is None:
                _check_stamped(header)
        except InvalidBatch as exc:
            invalid = invalid or _invalid(batch, str(exc))
        except CorruptBatch as exc:
            raise CorruptChunk(f"replicated chunk holds a corrupt batch at byte {pos}: {exc}") from None
        if invalid is None:
            headers.append(header)
            starts.append(pos)
        pos += size
    return headers, starts, invalid


def _check_stamped(header: BatchHeader) -> None:
    if header.base_origin_seq < 0:
        raise InvalidBatch(
            f"it is unstamped (base_origin_seq {header.base_origin_seq}): a replicated batch "
            "carries its origin's coordinates"
        )
    try:
        site_id(header.origin_site)
    except InvalidSiteId as exc:
        raise InvalidBatch(f"its origin is not a site: {exc}") from None


def _invalid(batch: memoryview, reason: str) -> InvalidChunk:
    """The error for an invalid batch of a chunk, naming its coordinates as its header gives them (the same text
    each time the upstream sends it, so that the puller logs it once)."""
    f = HEADER.unpack_from(batch, 0)
    site = f[6].rstrip(b"\0").decode("ascii", "replace")
    base, last = f[8], f[8] + f[9]
    return InvalidChunk(
        f"replicated batch of origin {site}@{f[7]} origin seqs {base}..{last} is invalid: {reason}. "
        "It was not stored, nor anything after it in the chunk: a valid copy must come from another "
        "upstream, or the upstream must be fixed"
    )


def _append(
    log: PartitionLog, view: memoryview, headers: list[BatchHeader], starts: list[int], indexes: list[int], now_ms: int
) -> ApplyOutcome:
    appended_bytes = 0
    appended_records = 0
    lag_ms: int | None = None
    lags: dict[Origin, int] = {}
    for i in indexes:
        h = headers[i]
        at = starts[i]
        log.append(h, [view[at + REWRITTEN_BYTES : at + h.size_bytes]], now_ms)
        appended_bytes += h.size_bytes
        appended_records += h.records_count
        lag_ms = lags[h.origin] = now_ms - h.max_timestamp
    return ApplyOutcome(
        appended_batches=len(indexes),
        appended_bytes=appended_bytes,
        appended_records=appended_records,
        lag_ms=lag_ms,
        lag_ms_by_origin=lags,
    )


def pull_have(vector: Mapping[Origin, int], own: Origin) -> dict[Origin, int]:
    """The have-vector a site sends upstream: its vector, with its own current origin fully held.

    A site pulls its own site's *older* epochs (it may have been rebuilt from
    empty) but never its current one: every record of that it already has, and
    the ones it appends while the stream is open would otherwise come straight
    back from the upstream as duplicates, one extra copy of all local produce.
    """
    have = dict(vector)
    have[own] = SEQ_MAX
    return have
