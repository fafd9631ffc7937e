"""The node's side of interest-based links (``topology/interest.py``, the pure table): what this site reads, the
adverts it sends each upstream of an interest link (``ReportInterest``) and takes from each downstream, and the
links' wants that follow them.

* **This site's own interests** are the topics its readers read now: every topic of a consumer group member's
  subscription (georep's and Kafka's groups) and of an open ``Fetch`` (``local``, set by the service), taken again
  every :data:`LOCAL_S`, and within :data:`WATCH_S` when a group member joins or names other topics or a topic
  gets its first fetch (``local_moved``, which :meth:`InterestLinks.watch_loop` watches). A pattern consumer
  resolves its pattern against the site's catalog, which the topic sync keeps whole whatever the links' modes, so
  its topics are named here once it reads them.
* **Adverts** go to each upstream of an interest link when this site's table changes, and again every
  :data:`RENEW_S` as a lease of :data:`LEASE_MS` (an upstream that hears nothing for that long drops the advert:
  a site that went away stops being served after the lease and the linger).
* **Wants.** A change of the table asks the links' wants again for the topics the changed filters match
  (``LinkManager.interests_changed``), and each pull session of an interest link ticks at once: it reopens with
  the partitions it now wants, a new topic from this site's position in it (nothing held: the upstream's earliest
  retained record), so a new reader misses nothing still retained.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from georep.proto import georep_pb2 as pb
from topology.interest import Entry, Interests

if TYPE_CHECKING:
    from georep.server.replicator import Replicator

log = logging.getLogger(__name__)

LOCAL_S = 1.0  # how often this site's own interests are taken again
WATCH_S = 0.02  # how often watch_loop looks whether a reader came (two integers compared)
RENEW_S = 5.0  # an advert is sent again at least this often
LEASE_MS = 20_000  # and counts this long at the upstream unless renewed
RPC_TIMEOUT_S = 5.0
ENTRIES_MAX = 10_000  # entries one advert may carry (ReportInterest refuses more)


class InterestLinks:
    """One per node with a topology; ``upstreams``: the sources of this site's interest links."""

    def __init__(self, replicator: Replicator) -> None:
        self.r = replicator
        topology, site = replicator.topology, replicator.site
        self.table = Interests(topology, site, topology.site(site).interest_linger_ms)
        self.upstreams = sorted(li.src for li in topology.links if li.dst == site and li.mode == "interest")
        self.local: Callable[[], set[str]] = set  # the topics read here now (the service sets it)
        self.local_moved: Callable[[], object] = lambda: None  # changes when a reader may have come (the service's)
        self._local_seen: object = None
        self._changed = asyncio.Event()
        self._next_local = 0.0
        if self.upstreams:
            replicator.links.interest = lambda topic: self.table.wants(topic, replicator.now_ms())

    def tick(self, now_s: float) -> None:
        """This site's readers again (every LOCAL_S), and leases and lingers that ran out."""
        now_ms = self.r.now_ms()
        changed = False
        moved = self.local_moved()
        if now_s >= self._next_local or moved != self._local_seen:
            self._next_local, self._local_seen = now_s + LOCAL_S, moved
            changed = self.table.set_local(sorted(self.local()), now_ms)
        if self.table.tick(now_ms) or changed:
            self._on_change()

    async def watch_loop(self) -> None:
        """Take this site's readers within WATCH_S of a group member joining or a topic's first fetch, not at the
        replicator's next tick (0.2 s): the first hop of a new subscription's first record."""
        while True:
            await asyncio.sleep(WATCH_S)
            if self.local_moved() != self._local_seen:
                self.tick(time.monotonic())

    def receive(self, reporter: str, entries: list[Entry], lease_ms: int) -> None:
        if self.table.receive(reporter, entries, self.r.now_ms(), lease_ms):
            self._on_change()

    def _on_change(self) -> None:
        """The links' wants anew for the topics the changed filters match, pulled at once; adverts sent."""
        self.r.links.interests_changed(self.table.take_changed())
        for src in self.upstreams:
            self.r.pullers[src].tick_soon()
        self._changed.set()

    def describe(self, src: str) -> list[str]:
        """What this site tells ``src`` it wants, and for whom (``georep status``)."""
        return sorted(
            f"{text} for site {site} (via {','.join(path)})" for text, site, path in self.table.advert_for(src)
        )

    async def report_loop(self) -> None:
        """Send every upstream its advert when it changed, and renew it every RENEW_S."""
        sent: dict[str, frozenset[Entry]] = {}
        renew_at = 0.0
        loop = asyncio.get_running_loop()
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, renew_at - loop.time())):
                    await self._changed.wait()
            self._changed.clear()
            renew = loop.time() >= renew_at
            if renew:
                renew_at = loop.time() + RENEW_S
            for src in self.upstreams:
                advert = self.table.advert_for(src)
                if (renew or sent.get(src) != advert) and await self._send(src, advert):
                    sent[src] = advert

    async def _send(self, src: str, advert: frozenset[Entry]) -> bool:
        puller = self.r.pullers[src]  # type: ignore[index]
        if not puller.enabled.is_set():
            return False
        request = pb.ReportInterestRequest(reporter=self.r.site, lease_ms=LEASE_MS)
        for text, site, path in sorted(advert)[:ENTRIES_MAX]:
            request.entries.append(pb.InterestEntry(filter=text, site=site, path=list(path)))
        try:
            await puller.stub.ReportInterest(request, timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.info("telling site %s what this site reads failed: %s", src, exc.details())
            return False
        return True
