"""The records a delete removed that this site took after the delete was made: the race of a delete at one site
with produces at another (docs/design.md, "Topic changes across sites", the case "A delete racing a produce at
another site"), counted as ``georep_topic_delete_records_total``.

"Taken after ``t``" is read from each stored batch's ``append_time_ms``: the wall clock of THIS site when it
appended the batch (``georep/record/batch.py``). It is the one time in a batch that says when the site took it,
set by the broker, never by a client (the producer timestamps are the client's and may be anything), and it is
kept in the origin index, so counting reads no log bytes. ``t`` is the tombstone's stamp, the deleting site's
clock; the two clocks differ by their skew, so a record taken within the skew of ``t`` may be counted on the
wrong side. The count covers every batch taken after ``t``, whatever its origin: records another site sent here
after ``t`` are lost with the topic too.

The walk is bounded: segments are visited from the last one back, and stop at the first whose first batch was
taken at or before ``t``, since the segments below it were filled before it (the append times of a log follow
its offsets, but for a clock stepped back, which at worst leaves out some records from the count).
"""

from __future__ import annotations

from collections.abc import Sequence

from georep.storage.api import BatchEntry, PartitionLog


def taken_after(entries: Sequence[BatchEntry], t_ms: int) -> int:
    """Records of ``entries`` appended here after ``t_ms``."""
    return sum(e.last_offset_delta + 1 for e in entries if e.append_time_ms > t_ms)


def log_records_taken_after(log: PartitionLog, t_ms: int) -> int:
    """Records of ``log`` appended here after ``t_ms``, reading only the segments that can hold one (module doc).
    Call it where nothing appends to ``log`` meanwhile (a one-node site: its replica writer thread)."""
    total = 0
    offset: int = log.log_end_offset
    while True:
        segment = log.segment_at(offset)
        total += taken_after(segment.entries, t_ms)
        if segment.base_offset <= log.log_start_offset:
            return total
        if segment.entries and segment.entries[0].append_time_ms <= t_ms:
            return total
        offset = segment.base_offset - 1
