"""A topic created on first use: a produce to a topic the site lacks, whose name one of the site's ``auto_create``
patterns matches (``topology/autocreate.py``), creates it first, then appends.

One object per node, asked by every front end before it appends (``Produce``, ``ProduceStream``, Kafka's Metadata
and Produce): the decision (does the topic exist, which pattern, is one create already running) is made here once.
What each front end brings is its own ACL answer: whether the caller may ``create_topic`` on the name, as its
``CreateTopic`` would ask (a produce ACL alone creates nothing).

The create is the one ``CreateTopics`` makes (``create``): a one-node site's table or a multi-node site's Raft
commands, after the first catalog sync with every upstream (``first_sync.py``), so it replicates like any create,
and two sites that create the same name at once agree by the catalog's conflict rule. Concurrent produces of one new
name wait for the one create (a name that another call made meanwhile counts as made), and the names asked for
while a create runs go together in the next.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from georep.auth.acl import PermissionDenied
from georep.metadata.store import TopicExists
from topology.autocreate import AutoCreateRule, rule_for

log = logging.getLogger(__name__)

# CreateTopics: each request (name, partitions, config) created or refused on its own, in their order
Create = Callable[[list[tuple[str, int, dict[str, str]]]], Awaitable[Sequence[object]]]
BATCH_MAX = 1_000  # topics per create
Refusal = Callable[[str], str | None]  # the front end's ACL: None if the caller may create the topic, else why not


class AutoCreate:
    """The node's topics created on first use (see the module doc); ``rules`` empty: none ever is."""

    def __init__(self, rules: tuple[AutoCreateRule, ...], exists: Callable[[str], bool], create: Create) -> None:
        self.rules = rules
        self.exists = exists
        self.create = create
        self.created = 0  # topics this node created on first use
        self._running: dict[str, asyncio.Future[None]] = {}
        self._queue: list[tuple[str, AutoCreateRule]] = []
        self._creator: asyncio.Task[None] | None = None

    def wanted(self, topic: str) -> AutoCreateRule | None:
        """The rule that would create ``topic`` now: None when it exists, no pattern matches, or it is internal."""
        if not self.rules or self.exists(topic):
            return None
        return rule_for(self.rules, topic)

    async def ensure(self, topic: str, refusal: Refusal) -> None:
        """Create ``topic`` if it is missing and a pattern matches; else do nothing (the append that follows says
        ``UnknownTopic``). Raises ``PermissionDenied`` (the caller may not create it) and what ``CreateTopic``
        raises (``InvalidTopic``, ``DiskFull``, ``CatalogNotSynced``, ...)."""
        rule = self.wanted(topic)
        if rule is None:
            return
        why = refusal(topic)
        if why is not None:
            raise PermissionDenied(
                f"topic {topic!r} does not exist and matches auto_create pattern {rule.pattern}, but {why}; "
                f"create it first (georep topic create {topic}) or grant create_topic on it"
            )
        running = self._running.get(topic)
        if running is None:
            running = self._running[topic] = asyncio.get_running_loop().create_future()
            self._queue.append((topic, rule))
            if self._creator is None or self._creator.done():
                self._creator = asyncio.ensure_future(self._create_queued())
        await asyncio.shield(running)

    async def _create_queued(self) -> None:
        """Create what is queued, as one ``CreateTopics`` each time (group commit: the names asked for while one
        create runs go together in the next): a one-node site rewrites its topic table once per create, so one
        create per name cost O(topics) each."""
        while self._queue:
            batch, self._queue = self._queue[:BATCH_MAX], self._queue[BATCH_MAX:]
            try:
                outcomes = await self.create([(t, r.partitions, dict(r.config)) for t, r in batch])
            except Exception as exc:  # the whole call failed (the first catalog sync did not come): each says so
                outcomes = [exc] * len(batch)
            for (topic, rule), outcome in zip(batch, outcomes, strict=True):
                running = self._running.pop(topic)
                if isinstance(outcome, Exception) and not isinstance(outcome, TopicExists):
                    running.set_exception(outcome)
                    continue
                running.set_result(None)  # a TopicExists: made meanwhile (a topic sync), what the produce wanted
                if not isinstance(outcome, Exception):
                    self.created += 1
                    log.info("created topic %s on first use (auto_create %s)", topic, rule.describe())
