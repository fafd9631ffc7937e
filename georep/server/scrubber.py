"""The background scrubber: checks the partitions ``ScrubSchedule`` hands out, at ``--scrub-bytes-per-s``.

Damage no reader has reached yet is quarantined, and repaired from a peer, before anyone needs it. Which
partitions, and when, is the pure schedule's (``georep/broker/scrub_schedule.py``): one pass per
``--scrub-interval-ms``, spread evenly, so an idle node with 10,000 partitions checks a few of them every second
rather than all of them in a burst every minute. This shell reads the batches (in the broker's fsync threads) and
keeps to the rate by sleeping after each step as long as its bytes take at that rate.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from georep.broker.scrub_schedule import Key, ScrubSchedule
from georep.server.broker import Broker
from georep.storage.api import StorageError

log = logging.getLogger(__name__)


class BackgroundScrub:
    """The scrubber of one node: ``tick`` checks what is due and says when to come back."""

    def __init__(
        self,
        broker: Broker,
        bytes_per_s: int,
        step_bytes: int,
        interval_ms: int,
        now_ms: int,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.broker = broker
        self.bytes_per_s = bytes_per_s
        self.step_bytes = max(1, min(bytes_per_s, step_bytes))
        self.schedule = ScrubSchedule(interval_ms, now_ms)
        self._sleep = sleep
        self._keys: list[Key] = []
        self._keys_version = -1  # the broker's partitions_version the sorted keys were taken at
        self.checked_partitions = 0  # partitions checked since start

    def _sorted_keys(self) -> list[Key]:
        """The broker's partitions in key order, sorted again only when it gained or lost one."""
        if self._keys_version != self.broker.partitions_version:
            self._keys = sorted(self.broker.partitions)
            self._keys_version = self.broker.partitions_version
        return self._keys

    async def tick(self, now_ms: int) -> int:
        """Check the partitions due at ``now_ms`` (monotonic); returns when the next ones are due."""
        for key in self.schedule.take(self._sorted_keys(), now_ms):
            await self.check(key)
        return self.schedule.next_due_ms(self._sorted_keys())

    async def check(self, key: Key) -> None:
        """Check every durable batch of ``key``, ``step_bytes`` at a time, at ``bytes_per_s``."""
        self.checked_partitions += 1
        p = self.broker.partitions.get(key)
        offset = 0 if p is None else int(p.log.log_start_offset)
        while p is not None and self.broker.partitions.get(key) is p and offset < p.log.flushed_offset:
            try:
                step = await self.broker.scrub(key, offset, self.step_bytes)
            except StorageError as exc:  # damage nothing names: reported, and the other partitions go on
                log.error("scrubber: %s/%d: %s", *key, exc)
                return
            offset = step.next_offset
            if step.found:
                log.error("scrubber: %d damaged batch(es) in %s/%d quarantined", len(step.found), *key)
            for text in step.invalid:
                log.error(
                    "scrubber: %s/%d %s; readers skip it (georep consume --skip-corrupt; Kafka clients pass over it)",
                    *key,
                    text,
                )
            await self._sleep(step.checked_bytes / self.bytes_per_s)
