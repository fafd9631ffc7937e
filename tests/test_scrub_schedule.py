"""The background scrubber checks every partition once per ``--scrub-interval-ms``, a few at a time spread evenly
over it (georep/broker/scrub_schedule.py, georep/server/scrubber.py), and still finds damage in a partition
nobody reads within that interval.

The scrubber that walked every partition in one burst at least once a minute fails the per-tick counts below.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from georep.broker.scrub_schedule import Key, ScrubSchedule
from georep.server.broker import Broker
from georep.server.scrubber import BackgroundScrub
from georep.storage.metadata_file import load_or_create_identity
from tests.support.examples import examples
from tests.support.node_api import batch

PARTITIONS = 30
INTERVAL_MS = 60_000
VICTIM = 17


async def no_sleep(_seconds: float) -> None:
    return None


def flip_last_value_byte(log_file: Path) -> None:
    """Damage the last record's value in place, as a failing disk would: the batch's CRC no longer holds."""
    with log_file.open("r+b") as f:
        f.seek(-3, 2)
        byte = f.read(1)
        f.seek(-3, 2)
        f.write(bytes([byte[0] ^ 0x40]))


def test_a_cold_partitions_damage_is_found_within_one_interval_a_partition_or_so_at_a_time(tmp_path: Path) -> None:
    broker = Broker(tmp_path, load_or_create_identity(tmp_path, "a", 1))

    async def scenario() -> None:
        broker.create_topic("t", PARTITIONS, {})
        for i in range(PARTITIONS):
            await broker.produce("t", i, batch(2, value_bytes=50))
        (log_file,) = (tmp_path / "logs" / f"t-{VICTIM}").glob("*.log")
        flip_last_value_byte(log_file)
        scrub = BackgroundScrub(broker, 8 << 20, 4 << 20, INTERVAL_MS, now_ms=0, sleep=no_sleep)
        now_ms, per_tick, found_at = 0, [], None
        while now_ms <= INTERVAL_MS:
            before = scrub.checked_partitions
            due_ms = await scrub.tick(now_ms)
            per_tick.append(scrub.checked_partitions - before)
            if found_at is None and broker.partition("t", VICTIM).log.damaged_batches():
                found_at = now_ms
            assert due_ms > now_ms
            now_ms = due_ms
        assert found_at is not None and found_at <= INTERVAL_MS
        assert sum(per_tick) == PARTITIONS  # each partition once in the interval
        assert max(per_tick) == 1  # 30 partitions over 60 s: one every 2 s, never a burst
        assert scrub.schedule.passes == 1

    try:
        asyncio.run(scenario())
    finally:
        broker.close()


def test_a_second_pass_starts_one_interval_after_the_first() -> None:
    keys = [("t", i) for i in range(4)]
    schedule = ScrubSchedule(1_000, now_ms=0)
    assert schedule.take(keys, 0) == []
    assert schedule.next_due_ms(keys) == 1
    assert schedule.take(keys, 1) == [("t", 0)]
    assert schedule.next_due_ms(keys) == 251
    assert schedule.take(keys, 999) == keys[1:]  # late: what was due meanwhile, at once
    assert schedule.next_due_ms(keys) == 1_000
    assert schedule.take(keys, 999) == []
    assert schedule.take(keys, 1_000) == []  # the second pass starts: nothing due at its first instant
    assert schedule.take(keys, 1_001) == [("t", 0)]
    assert schedule.passes == 1


def test_a_partition_created_during_a_pass_is_taken_when_the_cursor_reaches_it_or_in_the_next_pass() -> None:
    schedule = ScrubSchedule(1_000, now_ms=0)
    keys = [("b", 0), ("d", 0)]
    assert schedule.take(keys, 500) == [("b", 0)]
    keys = [("a", 0), ("b", 0), ("c", 0), ("d", 0)]  # ("a", 0) lies behind the cursor, ("c", 0) ahead
    assert schedule.take(keys, 1_000) == [("c", 0), ("d", 0)]
    assert schedule.take(keys, 1_000) == []  # the next pass starts
    assert schedule.take(keys, 2_000) == keys


STEPS = st.lists(st.integers(1, 400), min_size=1, max_size=60)


@settings(max_examples=examples(200), deadline=None)
@given(count=st.integers(0, 50), steps=STEPS)
def test_every_partition_is_taken_once_per_pass_and_a_tick_takes_what_its_time_allows(
    count: int, steps: list[int]
) -> None:
    interval_ms = 1_000
    keys: list[Key] = [("t", i) for i in range(count)]
    schedule = ScrubSchedule(interval_ms, now_ms=0)
    taken: list[Key] = []
    now_ms = 0
    for step in steps:
        due_ms = schedule.next_due_ms(keys)
        now_ms += step
        got = schedule.take(keys, now_ms)
        assert now_ms >= due_ms or not got  # nothing before the time it named
        assert len(got) <= count * step // interval_ms + 1  # what the time since the last take allows, rounded up
        taken += got
    passes = schedule.passes
    assert taken[: passes * count] == keys * passes  # each pass: every key once, in order
