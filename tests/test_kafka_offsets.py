"""The vector a Kafka OffsetCommit stores (georep/kafka/offsets.py ``vector_at``), against the full history.

Issue 13 forbids duplicates after a group fails over: the vector of a committed local offset must cover every
record below it, also the ones retention (or a chain trim) deleted here but another site still holds. So the
reference is computed from every batch ever appended, trimmed ones included; ``vector_at`` sees only the log.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from georep.broker import fetch
from georep.kafka.offsets import vector_at
from georep.storage.api import OffsetOutOfRange, start_offset_for_vector
from georep.storage.chain_log import SegmentElsewhere
from georep.storage.memory_log import MemoryLog
from georep.storage.replica_store import ReplicaStore
from offsets.coordinates import Origin, OriginSeq
from offsets.vector import VectorOffset
from tests.support.chains import KEY, chain_of
from tests.support.examples import examples
from tests.support.segments import A, B, C, Writer, make_batch, open_log
from topology.ids import SegmentId, SiteId

RETENTION_MS = 1_000_000
History = list[tuple[Origin, int, int, int]]  # (origin, base seq, base offset, records) of every batch appended


def reference(history: History, offset: int) -> VectorOffset:
    """The naive vector below ``offset``: every batch that ever lay below it, clipped at ``offset``."""
    next_seq: dict[Origin, int] = {}
    for origin, seq, base, count in history:
        if base < offset:
            next_seq[origin] = max(next_seq.get(origin, 0), seq + min(count, offset - base))
    return VectorOffset({o: OriginSeq(s) for o, s in next_seq.items()})


Step = tuple[str, int, int]
steps = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(0, 2), st.integers(1, 4)),
        st.tuples(st.just("trim"), st.integers(0, 40), st.just(0)),
        st.tuples(st.just("reopen"), st.just(0), st.just(0)),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=examples(60), deadline=None)
@given(steps)
def test_vector_at_matches_the_full_history_across_retention_and_reopen(ops: list[Step]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "t-0"
        log = open_log(directory, segment_bytes_max=500, retention_ms=RETENTION_MS)
        writer = Writer(log)
        try:
            for op, a, b in ops:
                if op == "append":
                    writer.append((A, B, C)[a], b)
                elif op == "trim":
                    # Writer stamps batch i with max timestamp 1000 + i + records - 1: this deletes the sealed
                    # segments whose batches all come before batch ``a``.
                    log.enforce_retention(1_000 + a + RETENTION_MS)
                else:
                    log.close()
                    log = writer.log = open_log(directory, segment_bytes_max=500, retention_ms=RETENTION_MS)
            history = [
                (s.header.origin, s.header.base_origin_seq, s.header.base_offset, s.header.last_offset_delta + 1)
                for s in writer.stored
            ]
            start, end = log.log_start_offset, log.log_end_offset
            for offset in range(start, end + 1):
                assert vector_at(log, offset) == reference(history, offset), offset
            boundaries = [base for _, _, base, _ in history if base >= start] + [end]
            for offset in boundaries:
                assert start_offset_for_vector(log, vector_at(log, offset).to_dict()) == offset
            if start:
                with pytest.raises(OffsetOutOfRange):
                    vector_at(log, start - 1)
        finally:
            log.close()


def test_the_vector_below_the_log_start_keeps_an_origin_whose_batches_were_all_deleted(tmp_path: Path) -> None:
    log = open_log(tmp_path / "t-0", segment_bytes_max=500, retention_ms=RETENTION_MS)
    try:
        w = Writer(log)
        for _ in range(4):
            last_b = w.append(B, 3).header.base_offset  # only B, in segments retention deletes
        while log.segment_at(log.log_end_offset).base_offset <= last_b:
            w.append(A, 2)  # until the active segment holds A's batches only
        assert log.enforce_retention(1 << 40) >= 1
        assert not any(e.origin == B for e in log.batch_entries())
        start = log.log_start_offset
        assert log.segment_at(start).start_vector[B] == 12
        assert vector_at(log, start).get(B) == 12, "B's deleted records were read: a failover must not repeat them"
    finally:
        log.close()


def test_memory_log_is_one_segment_from_offset_zero() -> None:
    log = MemoryLog()
    for origin, seq in ((A, 0), (B, 0), (A, 2)):
        b = make_batch(origin, seq, [b"1", b"2"])
        log.append(b.header, b.body, 10)
    assert vector_at(log, 3) == VectorOffset({A: OriginSeq(2), B: OriginSeq(1)})
    assert vector_at(log, 6) == VectorOffset({A: OriginSeq(4), B: OriginSeq(2)})
    with pytest.raises(OffsetOutOfRange):
        vector_at(log, 7)


def test_a_chain_answers_from_each_segment_copy_and_its_start_after_a_trim(tmp_path: Path) -> None:
    store = ReplicaStore(tmp_path / "leader", now_ms=0)
    try:
        log, _ = chain_of(store, held_first=True)
        for origin, seq in ((A, 2), (B, 0)):
            b = make_batch(origin, seq, [b"1", b"2", b"3"])
            log.append(b.header, b.body, 10)
        assert [vector_at(log, o).to_dict() for o in (1, 2, 4, 8)] == [{A: 1}, {A: 2}, {A: 4}, {A: 5, B: 3}]
        store.trim(KEY, SegmentId(1))  # segment 0 (A's seqs 0..1) is gone: its records still count
        assert log.log_start_offset == 2
        assert vector_at(log, 2).to_dict() == {A: 2}
        with pytest.raises(OffsetOutOfRange):
            vector_at(log, 1)
    finally:
        store.close()


def test_a_chain_segment_held_elsewhere_answers_only_at_its_base(tmp_path: Path) -> None:
    store = ReplicaStore(tmp_path / "leader", now_ms=0)
    try:
        log, _ = chain_of(store, held_first=False)
        assert vector_at(log, 2).to_dict() == {A: 2}  # the open segment's copy starts at the sealed end vector
        with pytest.raises(SegmentElsewhere):
            vector_at(log, 1)  # never a guess: a wrong vector means duplicates or losses after failover
    finally:
        store.close()


# -- resuming a committed vector at one Kafka offset (issue 23: ``fetch.resume_at``) -------------------------------


def interleaved(layout: list[tuple[Origin, int]]) -> tuple[MemoryLog, list[tuple[Origin, int]]]:
    """A log of batches of ``(origin, records)`` in log order, and each offset's coordinate."""
    log = MemoryLog()
    at: list[tuple[Origin, int]] = []
    next_seq: dict[Origin, int] = {}
    for origin, count in layout:
        seq = next_seq.get(origin, 0)
        b = make_batch(origin, seq, [b"r%d" % i for i in range(count)])
        log.append(b.header, b.body, 10)
        at += [(origin, seq + i) for i in range(count)]
        next_seq[origin] = seq + count
    log.flush()
    return log, at


def resume(log: MemoryLog, vector: dict[Origin, int]) -> fetch.Resume:
    return fetch.resume_at(log, fetch.FromVector(VectorOffset(vector)), Origin(SiteId("elsewhere"), 1))


def test_a_resume_is_exact_inside_a_batch_and_filters_only_when_covered_records_follow() -> None:
    log, _ = interleaved([(A, 4), (B, 2), (A, 2)])  # A0..3 at 0..3, B0..1 at 4..5, A4..5 at 6..7
    assert start_offset_for_vector(log, {A: 2}) == 0, "the batch holding the first uncovered record"
    assert resume(log, {A: 2}) == fetch.Resume(2, False), "A2 is at offset 2; nothing covered lies past it"
    assert resume(log, {A: 2, B: 2}) == fetch.Resume(2, True), "B0..1 at 4..5 are covered: a reader must skip them"
    assert resume(log, {A: 6, B: 1}) == fetch.Resume(5, True), "B1 at 5 is the first; A4..5 at 6..7 are covered"
    assert resume(log, {A: 9}) == fetch.Resume(4, True), "A6..8 are covered and not here yet: they may arrive"
    assert resume(log, {A: 6, B: 2}) == fetch.Resume(8, False), "all read: the log end"


layouts = st.lists(st.tuples(st.sampled_from([A, B, C]), st.integers(1, 4)), min_size=1, max_size=12)


@settings(max_examples=examples(200), deadline=None)
@given(layouts, st.dictionaries(st.sampled_from([A, B, C]), st.integers(0, 12)))
def test_a_resume_is_the_first_uncovered_record_and_filters_exactly_when_a_reader_would_need_it(
    layout: list[tuple[Origin, int]], vector: dict[Origin, int]
) -> None:
    """Against the naive reading of every offset's coordinate: the answer is the first uncovered record's offset,
    and the filter is asked for exactly when a reader seeking there with no filter would read a covered record
    (one held past the answer, or one not held yet)."""
    log, at = interleaved(layout)
    got = resume(log, vector)
    uncovered = [i for i, (o, s) in enumerate(at) if s >= vector.get(o, 0)]
    assert got.offset == (uncovered[0] if uncovered else len(at))
    held = {o: sum(1 for oo, _ in at if oo == o) for o in (A, B, C)}
    covered_past = any(s < vector.get(o, 0) for o, s in at[got.offset :])
    still_to_come = any(vector.get(o, 0) > held[o] for o in (A, B, C))
    assert got.covered_after == (covered_past or still_to_come)
