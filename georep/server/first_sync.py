"""A data dir creates topics only once it has listed the topic catalog of each of its upstreams whole, once
(docs/design.md, "Topic changes across sites", the case "A create at a site that has not heard of a delete").

A site that has never synced (new in the topology, or started on an empty data dir) would make incarnation 0 of a
name whose tombstone of 0 is held elsewhere, and lose what it takes when the tombstone arrives. So a user's create
(georep's ``CreateTopic`` and ``CreateTopics``, Kafka's CreateTopics) first waits, up to :data:`CREATE_WAIT_S`, for
one whole topic sync with each upstream, then fails with :class:`CatalogNotSynced` (``UNAVAILABLE``; Kafka's
``REQUEST_TIMED_OUT``), naming the upstream. A short wait rather than an immediate refusal: Kafka's create is
synchronous, and a site started just now syncs within its first round (a second), so a create made right after
the start succeeds. The creates a topic sync makes, and georep's own topics, are not held back.

Each upstream synced is kept in ``catalog_synced.json``, so a restart, or a later partition from the upstream,
does not hold creates back again. A data dir from before this file (one that already held topics) counts as
synced with every upstream: it ran with its links already. A site with no upstream creates at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterable
from pathlib import Path

from georep.broker.errors import CatalogNotSynced
from georep.storage.metadata_file import write_json_atomic

log = logging.getLogger(__name__)

SYNC_FILE = "catalog_synced.json"
CREATE_WAIT_S = 10.0


class FirstSyncs:
    """Which upstreams this data dir has synced its topic catalog with once; see the module docstring."""

    def __init__(self, data_dir: Path, upstreams: Iterable[str]) -> None:
        self.path = data_dir / SYNC_FILE
        self.upstreams = sorted(upstreams)
        if self.path.exists():
            self.synced = set(json.loads(self.path.read_text()).get("synced", []))
        else:
            used_before = (data_dir / "topics.json").exists()
            self.synced = set(self.upstreams) if used_before else set()
            self._write()
        self._changed = asyncio.Event()

    def missing(self) -> list[str]:
        return [s for s in self.upstreams if s not in self.synced]

    def record(self, upstream: str) -> None:
        """A topic sync with ``upstream`` listed its catalog to the end and merged it here (on the event loop)."""
        if upstream in self.synced:
            return
        self.synced.add(upstream)
        self._write()
        log.info("topic catalog synced with upstream %s for the first time", upstream)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait(self, timeout_s: float | None = None) -> None:
        """Return once every upstream is synced; raise :class:`CatalogNotSynced` after ``timeout_s`` (default
        :data:`CREATE_WAIT_S`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (CREATE_WAIT_S if timeout_s is None else timeout_s)
        while missing := self.missing():
            left = deadline - loop.time()
            if left <= 0:
                names = ", ".join(missing)
                raise CatalogNotSynced(
                    f"topic catalog not yet synced with upstream {names}: this site creates topics only once it has "
                    f"listed each upstream's topics (a topic deleted there must not come back by a create here); "
                    f"retry once site {missing[0]} is reachable"
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    def _write(self) -> None:
        write_json_atomic(self.path, {"synced": sorted(self.synced)})
