"""The destination side: apply one replicated chunk to a partition log.

Every batch's CRC is checked first, over the whole chunk, before anything is
appended: a corrupt chunk raises :class:`CorruptChunk` and nothing of it is
stored, so the puller drops the stream and opens it again. Then
``dedup.apply.plan_apply`` decides, per batch, against the log's vector, and
the planned batches are appended verbatim: ``PartitionLog.append`` writes its
own 24-byte local prefix (local offset, local append time) in front of the
CRC-covered bytes, which are passed as a slice of the received buffer and
never copied or re-checksummed.

Replicated batches never touch the producer state table: that table is the
origin's dedup of producer retries, and these batches were deduplicated at
their origin already. Per-record work: none.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from dedup.apply import Covered, Gap, PartialOverlap, plan_apply
from georep.record.batch import REWRITTEN_BYTES, CorruptBatch, iter_headers
from georep.storage.api import PartitionLog
from offsets.coordinates import Origin
from offsets.vector import SEQ_MAX, VectorOffset


class CorruptChunk(ValueError):
    """A replicated chunk that is not whole, CRC-valid batches; nothing of it was applied."""


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


def apply_chunk(log: PartitionLog, batches: bytes, now_ms: int) -> ApplyOutcome:
    """Check, deduplicate and append one chunk's batches. Raises :class:`CorruptChunk`.

    Storage errors (``DiskFull``, ``OSError``) propagate. The batches appended
    before one are kept: they extend the vector in order, so the log is still
    a prefix per origin, and the next chunk from a reopened stream goes on
    from there.
    """
    if not batches:
        return ApplyOutcome()
    try:
        headers = iter_headers(batches, verify=True)
    except CorruptBatch as exc:
        raise CorruptChunk(f"replicated chunk holds a corrupt batch: {exc}") from None
    whole = sum(h.size_bytes for h in headers)
    if whole != len(batches):
        raise CorruptChunk(
            f"replicated chunk of {len(batches)} bytes ends with a partial batch after byte {whole}"
        )
    plan = plan_apply(VectorOffset(log.vector()), headers)
    view = memoryview(batches)
    starts: list[int] = []
    pos = 0
    for h in headers:
        starts.append(pos)
        pos += h.size_bytes
    appended_bytes = 0
    appended_records = 0
    lag_ms: int | None = None
    lags: dict[Origin, int] = {}
    for i in plan.append_indexes:
        h = headers[i]
        at = starts[i]
        log.append(h, [view[at + REWRITTEN_BYTES : at + h.size_bytes]], now_ms)
        appended_bytes += h.size_bytes
        appended_records += h.records_count
        lag_ms = lags[h.origin] = now_ms - h.max_timestamp
    skipped = sum(1 for d in plan.decisions if isinstance(d, Covered))
    first_gap = next(iter(plan.gaps.values()), None) if plan.gaps else None
    appended = len(plan.append_indexes)
    return ApplyOutcome(
        appended_batches=appended, appended_bytes=appended_bytes, appended_records=appended_records,
        skipped_batches=skipped, gap=first_gap, overlaps=plan.overlaps, lag_ms=lag_ms,
        blocked_batches=len(headers) - appended - skipped, lag_ms_by_origin=lags,
    )  # fmt: skip


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
