"""Which partitions a retention run visits: those that changed, and those whose data falls due. Pure.

Every ``--retention-check-ms`` the node runs retention: it deletes the sealed segments retention says, moves each
partition's recovery point up to what was fsynced, and forgets idempotent producers idle past their expiry. It
used to visit every partition for that, so a node with 10,000 idle partitions paid for 10,000 visits a run. A
visit can only change something in two cases:

* the partition was written (or fsynced, or opened) since its last visit: its size grew, a segment may have
  rolled, its recovery point may move, a producer appended;
* time reached the moment its oldest sealed segment's newest record leaves ``retention_ms``, or its longest idle
  producer passes its expiry. Both moments are known at its last visit, and only a write changes them.

So the schedule keeps the first as a set and the second as one heap of due times for the whole node (the issue's
"one timer structure per node"), and a run visits their union. A partition nobody writes and whose data cannot
expire costs nothing per run. A run at ``now_ms`` visits a superset of the partitions where the visit-everything
run would change anything, so retention deletes exactly what it deleted before, at the same runs.
"""

from __future__ import annotations

import heapq

Key = tuple[str, int]

_COMPACT_SLACK = 64  # stale heap entries tolerated beyond twice the live ones before the heap is rebuilt


class RetentionSchedule:
    """The partitions the next retention run visits: a set of written ones and a heap of due times."""

    def __init__(self) -> None:
        self._written: set[Key] = set()
        self._due: dict[Key, int] = {}  # the live due time of each scheduled partition
        self._heap: list[tuple[int, Key]] = []  # may hold stale entries: those not in ``_due`` any more

    def written(self, key: Key) -> None:
        """``key`` was opened, written or fsynced: the next run visits it, whatever its due time."""
        self._written.add(key)

    def due(self, now_ms: int) -> list[Key]:
        """The partitions this run visits (sorted). Each leaves the schedule until :meth:`visited` puts it back, or
        a write does."""
        keys = self._written
        self._written = set()
        while self._heap and self._heap[0][0] <= now_ms:
            due_ms, key = heapq.heappop(self._heap)
            if self._due.get(key) == due_ms:
                del self._due[key]
                keys.add(key)
        return sorted(keys)

    def visited(self, key: Key, next_due_ms: int | None) -> None:
        """A visit of ``key`` is done: time alone makes it worth another at ``next_due_ms`` (None: only a write)."""
        if next_due_ms is None:
            self._due.pop(key, None)
            return
        if self._due.get(key) == next_due_ms:
            return
        self._due[key] = next_due_ms
        heapq.heappush(self._heap, (next_due_ms, key))
        if len(self._heap) > 2 * len(self._due) + _COMPACT_SLACK:
            self._heap = [(d, k) for k, d in self._due.items()]
            heapq.heapify(self._heap)

    def next_due_ms(self) -> int | None:
        """The earliest due time of a partition nobody wrote (None: none has one)."""
        while self._heap and self._due.get(self._heap[0][1]) != self._heap[0][0]:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    def scheduled(self) -> int:
        """How many partitions wait for a due time (the heap's live entries)."""
        return len(self._due)


def earliest(*due_ms: int | None) -> int | None:
    """The earliest of some due times, None ones left out (None: none)."""
    known = [d for d in due_ms if d is not None]
    return min(known) if known else None
