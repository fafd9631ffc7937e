"""The cyclic garbage collector's pauses on a node: measured, and kept short when the node holds many topics.

CPython's full collection (generation 2) walks every object the collector tracks, with the event loop stopped. A
node of 100,000 topics tracks millions of objects, and a full collection then took about a second
(``bench/first_use.py --topics 100000``: a new subscription's first record came after 2.2 to 2.4 s instead of 1.1
to 1.4 s when one fell inside it; docs/design.md, "A new subscription at 100,000 topics").

**Policy.** Once the node serves, and after each full collection, the objects that survived it are frozen
(``gc.freeze``: moved to the permanent generation, which no collection walks). A full collection then walks what
was allocated since the last one, not the topics' long-lived objects. Reference counting still frees every
object that is no longer referenced, frozen or not; what freezing delays is only the reclaiming of *cycles* among
frozen objects that became garbage after they were frozen (a deleted topic's objects, for instance). So every
:data:`UNFREEZE_S` the node unfreezes everything, and the next full collection walks it all once: one long pause
an hour rather than one at every collection.

**Measured.** ``georep_gc_pauses_total`` and ``georep_gc_pause_seconds_total`` per generation, the longest pause
(``georep_gc_pause_max_seconds``) and the objects frozen (``georep_gc_frozen_objects``); a pause over
:data:`WARN_S` is logged (docs/operations.md, "Garbage collection pauses").
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

UNFREEZE_S = 3600.0  # how often cycles among frozen objects get a chance to be reclaimed
WARN_S = 0.2  # a pause at least this long is logged
CHECK_S = 1.0  # how soon after a full collection its survivors are frozen


class GcPauses(Collector):
    """One per node process: :meth:`install` hooks ``gc.callbacks``; :meth:`run` freezes (a task of the node)."""

    def __init__(self, freeze: bool = True) -> None:
        self.freeze = freeze
        self.counts = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = 0.0
        self._started: float | None = None
        self._full_done = False  # a full collection ended since the last freeze

    def install(self) -> None:
        gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        pause, generation = time.perf_counter() - self._started, int(info["generation"])
        self._started = None
        self.counts[generation] += 1
        self.seconds[generation] += pause
        self.longest = max(self.longest, pause)
        if generation == 2:
            self._full_done = True
        if pause >= WARN_S:  # logging allocates, but only after the collection: no collection runs inside it
            log.warning(
                "garbage collection of generation %d stopped the node for %.0f ms (%d objects frozen out of it)",
                generation,
                pause * 1000,
                gc.get_freeze_count(),
            )

    async def run(self) -> None:
        """Freeze once the node serves and after each full collection; unfreeze every UNFREEZE_S."""
        if not self.freeze:
            return
        gc.freeze()
        unfreeze_at = time.monotonic() + UNFREEZE_S
        while True:
            await asyncio.sleep(CHECK_S)
            if time.monotonic() >= unfreeze_at:
                gc.unfreeze()  # the next full collection walks everything once: cycles among old objects go
                unfreeze_at = time.monotonic() + UNFREEZE_S
                self._full_done = False
            elif self._full_done:
                self._full_done = False
                gc.freeze()

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        pauses = CounterMetricFamily(
            "georep_gc_pauses", "Cyclic garbage collections, by generation", labels=["generation"]
        )
        seconds = CounterMetricFamily(
            "georep_gc_pause_seconds", "Time the node stood still in cyclic garbage collection", labels=["generation"]
        )
        for generation in range(3):
            pauses.add_metric([str(generation)], self.counts[generation])
            seconds.add_metric([str(generation)], self.seconds[generation])
        yield pauses
        yield seconds
        yield GaugeMetricFamily("georep_gc_pause_max_seconds", "The longest garbage collection pause", self.longest)
        yield GaugeMetricFamily(
            "georep_gc_frozen_objects", "Objects frozen out of garbage collection", gc.get_freeze_count()
        )
