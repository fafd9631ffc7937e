"""The producer's accumulator at many partitions (issue 22): the sender's linger step looks at the batches that
are due, not at every open batch, and still closes every batch that is due (lingered or full), oldest first.

Before, each wake of the sender walked every open batch twice (close_lingered, next_linger_deadline_ms); at
10,000 partitions written in turn there are ~10,000 open batches and the sender wakes for every answer.
"""

from __future__ import annotations

from typing import Any

import pytest

import georep.client.accumulator as accumulator_module
from georep.client.accumulator import ProducerBatch, RecordAccumulator, record_size
from georep.record.batch import RecordInput

SIZE = record_size(None, b"x" * 100, ())
LIMIT = 1 << 20
PARTITIONS = 10_000


def rec() -> RecordInput:
    return RecordInput(None, b"x" * 100, (), 0)


class Looked(ProducerBatch):
    """A batch that counts how often its age is read."""

    reads = 0

    @property
    def created_ms(self) -> float:
        Looked.reads += 1
        return self._created

    @created_ms.setter
    def created_ms(self, value: float) -> None:
        self._created = value


@pytest.fixture
def looked(monkeypatch: pytest.MonkeyPatch) -> type[Looked]:
    monkeypatch.setattr(accumulator_module, "ProducerBatch", Looked)
    Looked.reads = 0
    return Looked


def test_closing_lingered_batches_looks_at_the_due_ones_only(looked: type[Looked]) -> None:
    acc = RecordAccumulator(batch_size=16_384, linger_ms=5)
    for p in range(PARTITIONS):  # one record each, opened 1 ms apart
        acc.append("t", p, rec(), None, SIZE, now_ms=p, max_batch_bytes=LIMIT)
    looked.reads = 0
    due = acc.close_lingered(now_ms=7)
    assert [b.partition for b in due] == [0, 1, 2]
    assert acc.next_linger_deadline_ms() == 3 + 5
    assert looked.reads <= 10, f"{looked.reads} batches looked at to close 3 (main: every open batch, twice)"


def test_a_batch_reopened_for_a_partition_lingers_from_its_own_start() -> None:
    acc = RecordAccumulator(batch_size=109 + 2 * SIZE, linger_ms=5)
    for _ in range(2):
        acc.append("t", 0, rec(), None, SIZE, now_ms=0, max_batch_bytes=LIMIT)
    acc.append("t", 1, rec(), None, SIZE, now_ms=50, max_batch_bytes=LIMIT)
    acc.append("t", 0, rec(), None, SIZE, now_ms=100, max_batch_bytes=LIMIT)  # 0's full batch closes: a new one
    assert [len(b.records) for b in acc.take_closed()] == [2]
    assert [b.partition for b in acc.close_lingered(now_ms=56)] == [1]  # 1's is due though 0's newer one is not
    assert acc.next_linger_deadline_ms() == 105
    assert [b.partition for b in acc.close_lingered(now_ms=105)] == [0]


def test_a_full_batch_behind_lingering_ones_is_closed_at_once() -> None:
    acc = RecordAccumulator(batch_size=109 + 2 * SIZE, linger_ms=5)
    acc.append("t", 1, rec(), None, SIZE, now_ms=0, max_batch_bytes=LIMIT)  # lingering until 5
    for _ in range(2):
        acc.append("t", 0, rec(), None, SIZE, now_ms=1, max_batch_bytes=LIMIT)  # full at 1
    closed: list[Any] = acc.close_lingered(now_ms=2)
    assert [(b.partition, len(b.records)) for b in closed] == [(0, 2)]
    assert [b.partition for b in acc.close_lingered(now_ms=5)] == [1]


def test_a_limit_closes_the_oldest_lingered_batches_and_keeps_the_rest_open() -> None:
    acc = RecordAccumulator(batch_size=109 + 2 * SIZE, linger_ms=5)
    for p in range(4):
        acc.append("t", p, rec(), None, SIZE, now_ms=p, max_batch_bytes=LIMIT)
    for _ in range(2):
        acc.append("t", 9, rec(), None, SIZE, now_ms=4, max_batch_bytes=LIMIT)  # full
    assert acc.close_lingered(now_ms=20, limit=0) == [acc.take_closed()[0]]  # the full one closes whatever
    assert acc.held_for_room  # due batches left open: the sender waits for an answer, not a deadline
    assert [b.partition for b in acc.close_lingered(now_ms=20, limit=2)] == [0, 1]
    assert acc.held_for_room
    assert acc.append("t", 2, rec(), None, SIZE, now_ms=21, max_batch_bytes=LIMIT) is None  # still open: it grows
    assert [(b.partition, len(b.records)) for b in acc.close_lingered(now_ms=21)] == [(2, 2), (3, 1)]
    assert not acc.held_for_room
    acc.append("t", 4, rec(), None, SIZE, now_ms=22, max_batch_bytes=LIMIT)
    assert acc.close_lingered(now_ms=23, limit=0) == [] and not acc.held_for_room  # not due yet: not held
