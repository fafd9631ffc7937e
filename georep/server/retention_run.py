"""A node's retention run, paced: it visits the partitions its schedule names (``georep/broker/retention_schedule.py``)
a turn at a time, giving the event loop back between turns, and writes the recovery-point checkpoint off it.

Why. A run visits every partition written since the last one. After a first use that wrote 100,000 one-partition
topics, that is 100,000 visits of 34 us (each writes its index entries out and moves its recovery point; 3.4 s on a
quiet machine, ``bench/checkpoint.py``), then a checkpoint of 100,000 entries serialised whole (2.7 s): several
seconds in one piece on the event loop, more under a first use's load, every ``--retention-check-ms`` while the
topics are written. Nothing else on the node ran meanwhile, so a downstream's pull stream heard nothing for its
5 s and timed out ("no message from a for 5000 ms"), and a new subscription waited 18 s for its first
record. Paced, a run takes the same work in turns of :data:`TURN_S`, each followed by a rest as long: every other
task runs between two turns, and retention, which is background work, takes at most half of the node's loop (and
of a core), as Kafka throttles its log cleaner. With 20 ms turns and no rest, the 100,000-topic benchmark's new
subscriptions still missed their 2 s when one came during a run, each step of their streams waiting behind a turn.

What a run does is unchanged: the same partitions are visited, each visit whole (its log's lock held), against
the same ``now``. A partition written during the run is marked written again and visited at the next one; one
deleted or detached meanwhile is skipped, as before; a run cut short (the node stopping) gives the partitions it
did not visit back to the schedule.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from georep.broker.retention_schedule import earliest
from georep.storage.api import StorageError
from georep.storage.recovery_checkpoint import RecoveryCheckpoint

if TYPE_CHECKING:
    from georep.server.broker import Broker

log = logging.getLogger(__name__)

TURN_S = 0.005  # the longest a run keeps the event loop before giving it back, and how long it then rests
VISITS_LOGGED = 1_000  # a run that visits this many partitions says so in the node's log, with how long it took


@dataclass
class RetentionRun:
    """What one retention run did."""

    deleted: int = 0  # sealed segments deleted
    visited: int = 0  # partitions visited: those written since the last run and those whose data fell due


def visits(broker: Broker, run: RetentionRun) -> Generator[None, None, None]:
    """Retention, producer expiry and the recovery point's move in each partition the schedule names now; yields
    after each visit. Closed early, it gives the partitions not visited back to the schedule."""
    now = broker.clock_ms()
    due = broker.retention.due(now)
    done = 0
    try:
        for key in due:
            done += 1
            p = broker.partitions.get(key)
            if p is None:
                continue  # deleted, or no longer led
            run.visited += 1
            try:
                run.deleted += p.log.enforce_retention(now)
            except (OSError, StorageError) as exc:  # the other partitions go on; this one is tried again next run
                log.error("retention of %s-%d failed: %s; it is tried again at the next run", *key, exc)
                broker.retention.written(key)
                continue
            broker.retention.visited(key, earliest(p.log.retention_due_ms, p.expire_producers(now)))
            yield
    finally:
        for key in due[done:]:
            broker.retention.written(key)


def enforce(broker: Broker) -> RetentionRun:
    """One run in one piece, then the checkpoint of the points that moved (tests, and a node without a loop)."""
    run = RetentionRun()
    for _ in visits(broker, run):
        pass
    if broker.checkpoint is not None:
        save_checkpoint(broker.checkpoint)
    return run


async def paced(broker: Broker, run: RetentionRun, turn_s: float = TURN_S) -> None:
    """One run in turns of ``turn_s``, each followed by a rest as long, counted in ``run``; then the checkpoint
    written in a thread."""
    turn_ends = time.monotonic() + turn_s
    with contextlib.closing(visits(broker, run)) as steps:  # cancelled: the partitions not visited go back at once
        for _ in steps:
            if time.monotonic() >= turn_ends:
                await asyncio.sleep(turn_s)
                turn_ends = time.monotonic() + turn_s
    if broker.checkpoint is not None:
        await asyncio.to_thread(save_checkpoint, broker.checkpoint)


def save_checkpoint(checkpoint: RecoveryCheckpoint) -> None:
    """Write the recovery-point checkpoint if a point moved; a disk that refuses it is logged, not fatal."""
    try:
        checkpoint.save()
    except OSError as exc:  # the last one written stays true: the next start validates more
        log.warning("cannot write %s (%s): the next start validates more of each partition", checkpoint.path, exc)
