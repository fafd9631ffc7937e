"""When the background scrubber checks each partition: one pass over all of them per interval, spread evenly. Pure.

The scrubber re-reads stored batches that no reader reached, so that damage is found (and repaired from a peer)
before anyone needs those bytes (HDFS's block scanner, Ceph's scrub). It used to start a pass over every partition
at least once a minute: at 10,000 partitions that is 10,000 visits a minute (a segment's files opened, its
origin index read, a thread hop), most of an idle node's CPU, although nothing had changed.

Now a pass takes ``interval_ms``: the partitions, in key order, are spread evenly over it, so the scrubber takes
a slice of about ``count * elapsed / interval_ms`` of them at a time, and each partition is visited once per
interval (as HDFS scans each block once per ``dfs.datanode.scan.period.hours``). When the pass ends, the next
starts ``interval_ms`` after the last one started. The cursor is a key, not a position, so partitions created or
deleted during a pass shift nothing: a new one is taken when the cursor reaches it, or in the next pass.

The bound a user relies on: damage in a partition nobody reads is found within about one interval of being made
(later only when the scrubber's bytes per second cannot read the node's data within one interval: then a pass
takes as long as reading it all at that rate).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

Key = tuple[str, int]


class ScrubSchedule:
    """Which partitions the scrubber checks next: the slice of the pass that is due at ``now_ms``."""

    def __init__(self, interval_ms: int, now_ms: int) -> None:
        if interval_ms < 1:
            raise ValueError(f"interval_ms must be at least 1, got {interval_ms}")
        self.interval_ms = interval_ms
        self._pass_started_ms = now_ms
        self._cursor: Key | None = None  # the last key taken in this pass (None: none yet)
        self._done = False  # this pass took its last key
        self.passes = 0  # passes completed

    def take(self, keys: Sequence[Key], now_ms: int) -> list[Key]:
        """The partitions to check now: those of ``keys`` (sorted) the pass should have reached by ``now_ms`` and
        has not taken yet. The next pass starts ``interval_ms`` after this one started, or when it ends if later
        (the scrubber's bytes per second can make a pass longer)."""
        if self._done:
            if now_ms < self._pass_started_ms + self.interval_ms:
                return []
            self._pass_started_ms, self._cursor, self._done = now_ms, None, False
        start = self._position(keys)
        elapsed = max(0, min(now_ms - self._pass_started_ms, self.interval_ms))
        reached = -(-len(keys) * elapsed // self.interval_ms)  # ceil: every key once the interval is over
        taken = list(keys[start:reached])
        if taken:
            self._cursor = taken[-1]
        if max(start, reached) >= len(keys):
            self._done = True
            self.passes += 1
        return taken

    def next_due_ms(self, keys: Sequence[Key]) -> int:
        """When :meth:`take` next hands out a partition of ``keys`` (sorted), or starts the next pass: the scrubber
        sleeps until then."""
        if self._done or not keys:
            return self._pass_started_ms + self.interval_ms
        return self._pass_started_ms + self._position(keys) * self.interval_ms // len(keys) + 1

    def _position(self, keys: Sequence[Key]) -> int:
        """How many of ``keys`` this pass has taken (those up to the cursor)."""
        return 0 if self._cursor is None else bisect.bisect_right(keys, self._cursor)
