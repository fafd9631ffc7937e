"""The idempotent producer state table: each rule, then a model-based state machine.

What a user relies on: a retried batch is never stored twice and always gets
its original answer; a gap in the sequence is always rejected; a zombie
producer is fenced; and all of this survives a restart (rebuild from the log).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dedup.producer import (
    SEQUENCE_MODULUS,
    Append,
    AppendResult,
    Decision,
    Duplicate,
    InvalidSequence,
    OutOfOrderSequence,
    ProducerFenced,
    ProducerStateTable,
)
from offsets.coordinates import LocalOffset, Origin, OriginSeq
from tests.support.examples import examples
from topology.ids import SiteId

ORIGIN = Origin(SiteId("a"), 1)
OTHER = Origin(SiteId("b"), 7)
PID = 123


def result(base_offset: int, base_origin_seq: int = 0, count: int = 1, append_time_ms: int = 0) -> AppendResult:
    return AppendResult(
        LocalOffset(base_offset), OriginSeq(base_origin_seq), OriginSeq(base_origin_seq + count - 1), append_time_ms
    )


def appended(table: ProducerStateTable, epoch: int, base: int, last: int, offset: int, now_ms: int = 0) -> AppendResult:
    assert table.check(PID, epoch, base, last, now_ms) == Append()
    res = result(offset, offset, last - base + 1, now_ms)
    table.record(PID, epoch, base, last, res, now_ms)
    return res


# --- the rules one by one ----------------------------------------------------------


def test_non_idempotent_producer_is_always_appended() -> None:
    table = ProducerStateTable()
    for _ in range(3):
        assert table.check(-1, -1, -1, -1, 0) == Append()
        table.record(-1, -1, -1, -1, result(0), 0)
    assert len(table) == 0


def test_unknown_producer_may_start_at_any_sequence() -> None:
    table = ProducerStateTable()
    assert table.check(PID, 0, 57, 60, 0) == Append()
    assert table.check(PID, 4, 0, 0, 0) == Append()


def test_next_batch_must_continue_the_sequence() -> None:
    table = ProducerStateTable()
    appended(table, 0, 0, 9, 0)
    assert table.check(PID, 0, 10, 12, 0) == Append()
    gap = table.check(PID, 0, 11, 12, 0)
    assert gap == OutOfOrderSequence(expected=10, got=11, producer_id=PID, producer_epoch=0)
    assert isinstance(gap, OutOfOrderSequence)
    assert "expected 10" in gap.message() and "resend from 10" in gap.message() and "lost" in gap.message()


def test_retry_gets_the_original_result() -> None:
    table = ProducerStateTable()
    first = appended(table, 0, 0, 9, 100, now_ms=5)
    appended(table, 0, 10, 19, 110, now_ms=6)
    decision = table.check(PID, 0, 0, 9, 99)
    assert decision == Duplicate(first, PID, 0, 0, 9)
    assert isinstance(decision, Duplicate)
    assert decision.result.append_time_ms == 5  # the original answer, not a new one
    assert "nothing was stored twice" in decision.message()


def test_only_the_last_window_batches_are_deduplicated() -> None:
    table = ProducerStateTable(window_batches=3)
    for i in range(5):
        appended(table, 0, 10 * i, 10 * i + 9, 10 * i)
    assert isinstance(table.check(PID, 0, 20, 29, 0), Duplicate)
    too_old = table.check(PID, 0, 10, 19, 0)
    assert too_old == OutOfOrderSequence(expected=50, got=10, producer_id=PID, producer_epoch=0)
    assert isinstance(too_old, OutOfOrderSequence)
    assert "not stored again" in too_old.message()


def test_a_batch_overlapping_an_appended_one_is_not_a_duplicate() -> None:
    table = ProducerStateTable()
    appended(table, 0, 0, 9, 0)
    assert table.check(PID, 0, 0, 5, 0) == OutOfOrderSequence(10, 0, PID, 0)
    assert table.check(PID, 0, 5, 12, 0) == OutOfOrderSequence(10, 5, PID, 0)


def test_lower_epoch_is_fenced() -> None:
    table = ProducerStateTable()
    appended(table, 2, 0, 0, 0)
    decision = table.check(PID, 1, 1, 1, 0)
    assert decision == ProducerFenced(current_epoch=2, got=1, producer_id=PID)
    assert isinstance(decision, ProducerFenced)
    assert "epoch 2" in decision.message() and "took over" in decision.message()
    # A retry of an old-epoch batch that matches nothing is fenced too, not a duplicate.
    assert isinstance(table.check(PID, 1, 0, 0, 0), ProducerFenced)


def test_higher_epoch_must_start_at_zero() -> None:
    table = ProducerStateTable()
    appended(table, 0, 0, 9, 0)
    bad = table.check(PID, 1, 10, 10, 0)
    assert bad == OutOfOrderSequence(0, 10, PID, 1, new_epoch=True)
    assert isinstance(bad, OutOfOrderSequence) and "must restart its sequence at 0" in bad.message()
    appended(table, 1, 0, 4, 10)
    assert table.current_epoch(PID) == 1
    # The old epoch's batches are no longer duplicates: that epoch is fenced now.
    assert isinstance(table.check(PID, 0, 0, 9, 0), ProducerFenced)


def test_sequences_wrap_at_two_to_the_31() -> None:
    table = ProducerStateTable()
    top = SEQUENCE_MODULUS - 1
    appended(table, 0, top - 4, top, 0)
    assert table.check(PID, 0, 0, 3, 0) == Append()
    assert table.check(PID, 0, SEQUENCE_MODULUS, SEQUENCE_MODULUS, 0) == InvalidSequence(
        f"base sequence {SEQUENCE_MODULUS} is outside [0, {top}]", PID, 0, SEQUENCE_MODULUS, SEQUENCE_MODULUS
    )
    # A batch that spans the wrap, given as base + last_offset_delta (unwrapped).
    wrapping = appended(table, 0, 0, 0, 5)
    del wrapping
    table2 = ProducerStateTable()
    appended(table2, 0, top - 1, top + 2, 0)  # sequences top-1, top, 0, 1
    assert table2.last_sequence(PID) == 1
    assert table2.check(PID, 0, 2, 2, 0) == Append()
    assert isinstance(table2.check(PID, 0, top - 1, top + 2, 0), Duplicate)
    assert isinstance(table2.check(PID, 0, top - 1, 1, 0), Duplicate)  # the same batch, last given wrapped


def test_a_gap_across_the_wrap_is_reported_as_lost() -> None:
    table = ProducerStateTable()
    appended(table, 0, SEQUENCE_MODULUS - 2, SEQUENCE_MODULUS - 1, 0)
    gap = table.check(PID, 0, 3, 3, 0)
    assert isinstance(gap, OutOfOrderSequence) and gap.expected == 0 and "lost in flight" in gap.message()


@pytest.mark.parametrize(
    ("producer_id", "epoch", "base", "last", "words"),
    [
        (-2, 0, 0, 0, "producer id -2"),
        (PID, -1, 0, 0, "epoch -1"),
        (PID, 0, -1, 0, "base sequence -1"),
        (PID, 0, 5, -1, "last sequence -1"),
        (PID, 0, 0, SEQUENCE_MODULUS, "spans"),
    ],
)
def test_invalid_producer_fields(producer_id: int, epoch: int, base: int, last: int, words: str) -> None:
    table = ProducerStateTable()
    decision = table.check(producer_id, epoch, base, last, 0)
    assert isinstance(decision, InvalidSequence)
    assert words in decision.message() and "client bug" in decision.message()
    with pytest.raises(ValueError):
        table.record(producer_id, epoch, base, last, result(0), 0)


def test_expire_drops_only_idle_producers() -> None:
    table = ProducerStateTable(expiration_ms=1000)
    table.record(1, 0, 0, 0, result(0), now_ms=0)
    table.record(2, 0, 0, 0, result(1), now_ms=600)
    assert table.expire(1000) == 0  # idle exactly expiration_ms is kept
    assert table.expire(1001) == 1
    assert [p for p in (1, 2) if p in table] == [2]  # only the idle producer 1 expired
    # An expired producer is unknown again: any sequence is accepted.
    assert table.check(1, 0, 77, 77, 1001) == Append()


def test_decision_messages_name_the_producer() -> None:
    text = OutOfOrderSequence(expected=50, got=57, producer_id=123, producer_epoch=0).message()
    assert text == (
        "producer 123 epoch 0 sent sequence 57, expected 50: a batch was lost in flight; "
        "the producer must resend from 50 or restart"
    )
    assert Append().message()


@dataclass
class Entry:
    """A stand-in for ``georep.storage.api.BatchEntry``."""

    origin: Origin
    producer_id: int
    producer_epoch: int
    base_sequence: int
    last_offset_delta: int
    base_offset: LocalOffset
    base_origin_seq: OriginSeq
    append_time_ms: int


def test_rebuild_restores_duplicates_and_expected_sequence() -> None:
    entries = [
        Entry(ORIGIN, PID, 0, 0, 9, LocalOffset(0), OriginSeq(0), 10),
        Entry(OTHER, 999, 0, 0, 0, LocalOffset(10), OriginSeq(0), 11),  # replicated from another origin
        Entry(ORIGIN, -1, -1, -1, 4, LocalOffset(11), OriginSeq(10), 12),
        Entry(ORIGIN, PID, 0, 10, 4, LocalOffset(16), OriginSeq(15), 13),
    ]
    table = ProducerStateTable.rebuild(entries, origin=ORIGIN)
    assert table.check(PID, 0, 10, 14, 50) == Duplicate(result(16, 15, 5, 13), PID, 0, 10, 14)
    assert table.check(PID, 0, 0, 9, 50) == Duplicate(result(0, 0, 10, 10), PID, 0, 0, 9)
    assert table.check(PID, 0, 16, 16, 50) == OutOfOrderSequence(15, 16, PID, 0)
    assert 999 not in table and len(table) == 1
    assert 999 in ProducerStateTable.rebuild(entries)
    assert len(ProducerStateTable.rebuild(entries, now_ms=10**12)) == 0


def test_rebuild_accepts_storage_batch_entries() -> None:
    from georep.storage.api import BatchEntry

    entry = BatchEntry(ORIGIN, OriginSeq(0), 0, LocalOffset(0), 5, PID, 0, 0, append_time_ms=5)
    assert ProducerStateTable.rebuild([entry]).last_sequence(PID) == 0


# --- model-based state machine --------------------------------------------------------

WINDOW = 3
EXPIRATION_MS = 1000


@dataclass
class Sent:
    """A batch as a producer client sent it once."""

    producer_id: int
    epoch: int
    base: int
    last: int  # unwrapped: base + last_offset_delta


@dataclass
class Stored:
    sent: Sent
    result: AppendResult
    generation: int  # bumps when the table forgets the producer (expiry)


@dataclass
class Client:
    epoch: int
    next_seq: int
    sent: list[Sent] = field(default_factory=list)


class ReferenceModel:
    """Naive: keeps every batch each producer appended since the table last forgot it."""

    def __init__(self) -> None:
        self.known: dict[int, list[Stored]] = {}

    def decide(self, s: Sent) -> Decision:
        if s.producer_id == -1:
            return Append()
        history = self.known.get(s.producer_id)
        if not history:
            return Append()
        current = history[-1].sent.epoch
        if s.epoch < current:
            return ProducerFenced(current, s.epoch, s.producer_id)
        if s.epoch > current:
            return Append() if s.base == 0 else OutOfOrderSequence(0, s.base, s.producer_id, s.epoch, new_epoch=True)
        run: list[Stored] = []
        for stored in reversed(history):
            if stored.sent.epoch != current:
                break
            run.append(stored)
        last = s.last % SEQUENCE_MODULUS
        for stored in run[:WINDOW]:
            if (stored.sent.base, stored.sent.last % SEQUENCE_MODULUS) == (s.base, last):
                return Duplicate(stored.result, s.producer_id, s.epoch, s.base, last)
        expected = (history[-1].sent.last + 1) % SEQUENCE_MODULUS
        if s.base != expected:
            return OutOfOrderSequence(expected, s.base, s.producer_id, s.epoch)
        return Append()


class ProducerStateMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.table = ProducerStateTable(window_batches=WINDOW, expiration_ms=EXPIRATION_MS)
        self.model = ReferenceModel()
        self.clients: dict[int, Client] = {}
        self.log: list[Stored] = []  # every batch appended, in log order
        self.generation: dict[int, int] = {}
        self.now_ms = 0

    # -- helpers --

    def submit(self, s: Sent) -> Decision:
        decision = self.table.check(s.producer_id, s.epoch, s.base, s.last, self.now_ms)
        assert decision == self.model.decide(s), (decision, s)
        assert decision.message()
        if isinstance(decision, Append):
            count = s.last - s.base + 1
            offset = sum(x.result.last_origin_seq - x.result.base_origin_seq + 1 for x in self.log)
            res = result(offset, offset, count, self.now_ms)
            self.table.record(s.producer_id, s.epoch, s.base, s.last, res, self.now_ms)
            stored = Stored(s, res, self.generation.get(s.producer_id, 0))
            self.log.append(stored)
            if s.producer_id != -1:
                self.model.known.setdefault(s.producer_id, []).append(stored)
        return decision

    # -- rules --

    @rule(producer_id=st.sampled_from([-1, 1, 2, 3]), start=st.sampled_from([0, 5, SEQUENCE_MODULUS - 4]))
    def new_client(self, producer_id: int, start: int) -> None:
        if producer_id not in self.clients:
            self.clients[producer_id] = Client(epoch=0, next_seq=start)

    @precondition(lambda self: self.clients)
    @rule(data=st.data(), count=st.integers(1, 4))
    def send_next(self, data: st.DataObject, count: int) -> None:
        pid = data.draw(st.sampled_from(sorted(self.clients)), label="producer")
        client = self.clients[pid]
        if pid == -1:
            s = Sent(-1, -1, -1, -1 + count - 1)
        else:
            s = Sent(pid, client.epoch, client.next_seq, client.next_seq + count - 1)
        client.sent.append(s)
        decision = self.submit(s)
        if isinstance(decision, Append) and pid != -1:
            client.next_seq = (s.last + 1) % SEQUENCE_MODULUS

    @precondition(lambda self: any(c.sent for c in self.clients.values()))
    @rule(data=st.data())
    def retry(self, data: st.DataObject) -> None:
        """Resend any batch a client sent before: recent, old, duplicated, reordered or from an old epoch."""
        pid = data.draw(st.sampled_from(sorted(p for p, c in self.clients.items() if c.sent)), label="producer")
        client = self.clients[pid]
        s = data.draw(st.sampled_from(client.sent), label="batch")
        originals = [
            x
            for x in self.model.known.get(pid, [])
            if (x.sent.epoch, x.sent.base, x.sent.last) == (s.epoch, s.base, s.last)
        ]
        # The batches of the current epoch's latest run: an expired producer id may come back with an
        # older epoch, and the batches of that epoch from before the expiry are not recent any more.
        run: list[Stored] = []
        for stored in reversed(self.model.known.get(pid, [])):
            if run and stored.sent.epoch != run[0].sent.epoch:
                break
            run.append(stored)
        recent = run[:WINDOW]
        decision = self.submit(s)
        if pid == -1:
            return
        # The property: a retry of a recent batch of the current epoch gets its original answer back.
        if originals and originals[-1] in recent and s.epoch == recent[0].sent.epoch:
            assert isinstance(decision, Duplicate)
            assert decision.result == originals[-1].result

    @precondition(lambda self: self.model.known)
    @rule(data=st.data(), skip=st.integers(1, 5), count=st.integers(1, 3))
    def send_after_gap(self, data: st.DataObject, skip: int, count: int) -> None:
        """A batch that skips sequences, in the producer's current epoch: it must never be appended."""
        pid = data.draw(st.sampled_from(sorted(self.model.known)), label="producer")
        latest = self.model.known[pid][-1].sent
        expected = (latest.last + 1) % SEQUENCE_MODULUS
        base = (expected + skip) % SEQUENCE_MODULUS
        decision = self.submit(Sent(pid, latest.epoch, base, base + count - 1))
        if not isinstance(decision, Duplicate):  # only possible when a replayed log repeats a range
            assert decision == OutOfOrderSequence(expected, base, pid, latest.epoch)

    @precondition(lambda self: any(p != -1 for p in self.clients))
    @rule(data=st.data())
    def bump_epoch(self, data: st.DataObject) -> None:
        pid = data.draw(st.sampled_from(sorted(p for p in self.clients if p != -1)))
        client = self.clients[pid]
        client.epoch += 1
        client.next_seq = 0

    @precondition(lambda self: any(p != -1 for p in self.clients))
    @rule(data=st.data(), epoch=st.integers(0, 4), base=st.integers(0, 12), count=st.integers(1, 3))
    def send_arbitrary(self, data: st.DataObject, epoch: int, base: int, count: int) -> None:
        pid = data.draw(st.sampled_from(sorted(p for p in self.clients if p != -1)))
        self.submit(Sent(pid, epoch, base, base + count - 1))

    @rule(ms=st.sampled_from([1, 10, 400, EXPIRATION_MS + 1]), expire=st.booleans())
    def advance_time(self, ms: int, expire: bool) -> None:
        self.now_ms += ms
        if expire:
            self.expire()

    def expire(self) -> None:
        dropped = self.table.expire(self.now_ms)
        forgotten = [
            pid
            for pid, history in sorted(self.model.known.items())
            if history and self.now_ms - max(x.result.append_time_ms for x in history) > EXPIRATION_MS
        ]
        for pid in forgotten:
            del self.model.known[pid]
            self.generation[pid] = self.generation.get(pid, 0) + 1
        assert dropped == len(forgotten)

    @rule()
    def restart(self) -> None:
        """Rebuild from the log, as a node does at startup; the model rebuilds from the full log too."""
        entries = [_entry(x) for x in self.log]
        self.table = ProducerStateTable.rebuild(entries, window_batches=WINDOW, expiration_ms=EXPIRATION_MS)
        known: dict[int, list[Stored]] = {}
        for x in self.log:
            if x.sent.producer_id != -1:
                known.setdefault(x.sent.producer_id, []).append(x)
        self.model.known = known
        self.expire()

    # -- invariants --

    @invariant()
    def retried_batches_are_never_stored_twice(self) -> None:
        seen: set[tuple[int, int, int, int, int]] = set()
        for x in self.log:
            if x.sent.producer_id == -1:
                continue
            key = (x.sent.producer_id, x.generation, x.sent.epoch, x.sent.base, x.sent.last % SEQUENCE_MODULUS)
            assert key not in seen, f"batch {x.sent} stored twice"
            seen.add(key)

    @invariant()
    def table_is_bounded(self) -> None:
        assert len(self.table) == len(self.model.known)


def _entry(x: Stored) -> Entry:
    return Entry(
        ORIGIN,
        x.sent.producer_id,
        x.sent.epoch,
        x.sent.base,
        x.sent.last - x.sent.base,
        x.result.base_offset,
        x.result.base_origin_seq,
        x.result.append_time_ms,
    )


ProducerStateMachine.TestCase.settings = settings(max_examples=examples(300), stateful_step_count=50, deadline=None)
TestProducerState = ProducerStateMachine.TestCase
