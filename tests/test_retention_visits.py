"""A retention run visits the partitions written since the last run and those whose data fell due, not every
partition (georep/broker/retention_schedule.py), and still deletes, expires and checkpoints what it did when it
visited them all.

The visit-everything run (every partition at every ``--retention-check-ms``) fails the ``visited`` counts below;
a schedule that forgot a partition's due time, or a write, fails the deletions, the expiry or the checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dedup.producer import DEFAULT_EXPIRATION_MS
from georep.broker.retention_schedule import Key, RetentionSchedule
from georep.record.batch import RecordInput, encode_batch
from georep.server import retention_run
from georep.server.broker import Broker
from georep.server.retention_run import RetentionRun
from georep.storage.checked_json import loads_checked
from georep.storage.metadata_file import load_or_create_identity
from georep.storage.recovery_checkpoint import FILE_NAME
from georep.storage.segment_log import SegmentLog
from tests.support.examples import examples

T0 = 1_700_000_000_000
PARTITIONS = 40
RETENTION_MS = 60_000
# Two of these batches fill a segment of 1,024 bytes: each write of two rolls one.
CONFIG = {"retention_ms": str(RETENTION_MS), "segment_bytes_max": "1024"}


def stamped(timestamp_ms: int, *, pid: int = -1, seq: int = -1) -> bytes:
    records = [RecordInput(b"k%d" % i, b"v" * 150, (), timestamp_ms) for i in range(2)]
    return encode_batch(records, producer_id=pid, producer_epoch=0 if pid >= 0 else -1, base_sequence=seq)


class Clock:
    def __init__(self) -> None:
        self.now_ms = T0

    def __call__(self) -> int:
        return self.now_ms


def broker_on(data_dir: Path, clock: Clock) -> Broker:
    return Broker(data_dir, load_or_create_identity(data_dir, "a", 1), clock_ms=clock)


async def write(broker: Broker, topic: str, index: int, batches: list[bytes]) -> None:
    """Produce and wait for the acks: each batch fsynced, as a producer's would be."""
    for b in batches:
        await broker.produce(topic, index, b)


def recovery_point(data_dir: Path, name: str) -> int:
    doc = loads_checked((data_dir / "logs" / FILE_NAME).read_bytes())
    entry = doc["partitions"][name]  # type: ignore[index]
    return int(entry["recovery_point"])


def test_idle_partitions_cost_a_retention_run_nothing_and_written_ones_still_expire_on_time(tmp_path: Path) -> None:
    clock = Clock()
    broker = broker_on(tmp_path, clock)

    async def scenario() -> None:
        broker.create_topic("t", PARTITIONS, CONFIG)
        assert broker.enforce_retention().visited == 0  # new and empty: nothing can expire until written
        for index in (3, 7):
            await write(broker, "t", index, [stamped(T0)] * 5)  # two sealed segments and an active one
        run = broker.enforce_retention()
        assert (run.visited, run.deleted) == (2, 0)
        assert recovery_point(tmp_path, "t-3") == broker.partition("t", 3).log.flushed_offset > 0
        assert broker.retention.next_due_ms() == T0 + RETENTION_MS + 1
        clock.now_ms = T0 + RETENTION_MS  # the newest record is exactly retention_ms old: it stays
        assert broker.enforce_retention().visited == 0
        clock.now_ms += 1
        run = broker.enforce_retention()
        assert (run.visited, run.deleted) == (2, 4)
        assert [broker.partition("t", i).log.segment_count for i in (3, 7)] == [1, 1]
        assert broker.enforce_retention().visited == 0  # only the active segment is left: nothing falls due
        await write(broker, "t", 3, [stamped(clock.now_ms)])
        assert broker.enforce_retention().visited == 1

    try:
        asyncio.run(scenario())
    finally:
        broker.close()


def test_an_idle_producer_still_expires_and_nothing_else_is_visited_for_it(tmp_path: Path) -> None:
    clock = Clock()
    broker = broker_on(tmp_path, clock)

    async def scenario() -> None:
        broker.create_topic("p", PARTITIONS, {})
        broker.enforce_retention()
        await write(broker, "p", 5, [stamped(T0, pid=42, seq=0)])
        assert broker.enforce_retention().visited == 1
        assert 42 in broker.partition("p", 5).producers
        clock.now_ms = T0 + DEFAULT_EXPIRATION_MS  # idle exactly as long as the expiry: kept
        assert broker.enforce_retention().visited == 0
        clock.now_ms += 1
        assert broker.enforce_retention().visited == 1
        assert 42 not in broker.partition("p", 5).producers
        assert broker.enforce_retention().visited == 0

    try:
        asyncio.run(scenario())
    finally:
        broker.close()


def test_after_a_restart_the_first_run_visits_the_partitions_that_hold_data_and_deletes_what_fell_due(
    tmp_path: Path,
) -> None:
    """A node opens its partitions with nothing scheduled: each one holding data is visited at the first run (what
    fell due while the node was down is deleted then); an empty one waits for its first write, as a new one does."""
    clock = Clock()
    broker = broker_on(tmp_path, clock)
    try:
        broker.create_topic("t", PARTITIONS, CONFIG)
        for index in (3, 7):
            asyncio.run(write(broker, "t", index, [stamped(T0)] * 5))  # two sealed segments and an active one
    finally:
        broker.close()
    clock.now_ms = T0 + RETENTION_MS + 1
    broker = broker_on(tmp_path, clock)
    try:
        run = broker.enforce_retention()
        assert (run.visited, run.deleted) == (2, 4)
        assert broker.enforce_retention().visited == 0
    finally:
        broker.close()


def test_a_logs_retention_due_time_is_the_first_run_that_deletes(tmp_path: Path) -> None:
    """SegmentLog.retention_due_ms: a run before it deletes nothing, a run at it deletes (what the schedule trusts)."""
    clock = Clock()
    broker = broker_on(tmp_path, clock)

    async def scenario() -> None:
        broker.create_topic("t", 1, CONFIG)
        await write(broker, "t", 0, [stamped(T0 + 5_000), stamped(T0 + 9_000), stamped(T0 + 2_000)] * 2)

    try:
        asyncio.run(scenario())
        log = broker.partition("t", 0).log
        assert isinstance(log, SegmentLog)
        assert log.enforce_retention(T0) == 0
        due = log.retention_due_ms
        assert due == T0 + 9_000 + RETENTION_MS + 1  # the oldest segment's newest record, not its last one
        assert log.enforce_retention(due - 1) == 0
        assert log.retention_due_ms == due
        assert log.enforce_retention(due) >= 1
    finally:
        broker.close()


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("written"), st.integers(0, 5)),
        st.tuples(st.just("visited"), st.integers(0, 5), st.none() | st.integers(0, 50)),
        st.tuples(st.just("due"), st.integers(0, 10)),
    ),
    max_size=80,
)


@settings(max_examples=examples(200), deadline=None)
@given(OPS)
def test_the_schedule_hands_out_exactly_the_written_and_the_due(ops: list[tuple[object, ...]]) -> None:
    """Against a naive model: a dict of due times and a set of written keys, scanned whole at every run."""
    schedule = RetentionSchedule()
    due: dict[Key, int] = {}
    written: set[Key] = set()
    now = 0
    for op in ops:
        if op[0] == "written":
            key = ("t", int(str(op[1])))
            schedule.written(key)
            written.add(key)
        elif op[0] == "visited":
            key, at = ("t", int(str(op[1]))), op[2]
            schedule.visited(key, None if at is None else now + int(str(at)))
            if at is None:
                due.pop(key, None)
            else:
                due[key] = now + int(str(at))
        else:
            now += int(str(op[1]))
            expected = sorted(written | {k for k, d in due.items() if d <= now})
            assert schedule.due(now) == expected
            written.clear()
            due = {k: d for k, d in due.items() if d > now}
        assert schedule.scheduled() == len(due)
        assert schedule.next_due_ms() == (min(due.values()) if due else None)


def test_a_paced_run_gives_the_event_loop_back_between_turns_and_one_cut_short_loses_no_partition(
    tmp_path: Path,
) -> None:
    """The node's loop runs retention in turns (``retention_run.paced``): another task runs between two visits, so
    a run over 100,000 written partitions no longer stops the node for seconds (a downstream's stream timed out).
    A run cut short (the node stopping) gives the partitions it did not visit back: the next run visits them.

    Planted: without the turn's ``await``, the watcher never sees a run part-done; without the ``finally``, the
    next run visits nothing."""
    clock = Clock()
    broker = broker_on(tmp_path, clock)

    async def scenario() -> None:
        broker.create_topic("t", PARTITIONS, {})
        broker.enforce_retention()
        for index in range(PARTITIONS):
            await write(broker, "t", index, [stamped(T0)])
        run, seen = RetentionRun(), []
        task = asyncio.create_task(retention_run.paced(broker, run, turn_s=0.0))
        while not task.done() and run.visited < PARTITIONS:
            seen.append(run.visited)
            await asyncio.sleep(0)
        await task
        assert run.visited == PARTITIONS
        assert len({v for v in seen if 0 < v < PARTITIONS}) >= PARTITIONS // 2, seen

        for index in range(PARTITIONS):
            await write(broker, "t", index, [stamped(T0)])
        run = RetentionRun()
        task = asyncio.create_task(retention_run.paced(broker, run, turn_s=0.0))
        while run.visited < 5:
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert broker.enforce_retention().visited == PARTITIONS - run.visited

    try:
        asyncio.run(scenario())
    finally:
        broker.close()


def test_each_turn_of_a_paced_run_is_followed_by_a_rest_as_long(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention is background work: after each turn it rests as long as the turn, so it takes at most half of the
    node's loop while a first use's new subscriptions need it. Planted: ``asyncio.sleep(0)`` between turns (no
    rest) fails here."""
    clock = Clock()
    broker = broker_on(tmp_path, clock)
    rests: list[float] = []
    real_sleep = asyncio.sleep

    async def recorded(delay: float) -> None:
        rests.append(delay)
        await real_sleep(0)

    async def scenario() -> None:
        broker.create_topic("t", PARTITIONS, {})
        broker.enforce_retention()
        for index in range(PARTITIONS):
            await write(broker, "t", index, [stamped(T0)])
        monkeypatch.setattr(retention_run.asyncio, "sleep", recorded)
        run = RetentionRun()
        await retention_run.paced(broker, run, turn_s=1e-9)
        assert run.visited == PARTITIONS

    try:
        asyncio.run(scenario())
    finally:
        broker.close()
    assert rests and set(rests) == {1e-9}
