"""A topic created on first use: a produce to a topic the site lacks, whose name one of the site's ``auto_create``
patterns matches (``topology/autocreate.py``), creates it first, then appends.

One object per node, asked by every front end before it appends (``Produce``, ``ProduceStream``, Kafka's Metadata
and Produce): the decision (does the topic exist, which pattern, is one create already running) is made here once.
What each front end brings is its own ACL answer: whether the caller may ``create_topic`` on the name, as its
``CreateTopic`` would ask (a produce ACL alone creates nothing).

The create is the one ``CreateTopic`` makes (``create``): a one-node site's table or a multi-node site's Raft
command, after the first catalog sync with every upstream (``first_sync.py``), so it replicates like any create, and
two sites that create the same name at once agree by the catalog's conflict rule. Concurrent produces of one new name
wait for the one create (a create of a name that another call made meanwhile counts as made).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from georep.auth.acl import PermissionDenied
from georep.metadata.store import TopicExists
from topology.autocreate import AutoCreateRule, rule_for

log = logging.getLogger(__name__)

Create = Callable[[str, int, dict[str, str]], Awaitable[object]]
Refusal = Callable[[str], str | None]  # the front end's ACL: None if the caller may create the topic, else why not


class AutoCreate:
    """The node's topics created on first use (see the module doc); ``rules`` empty: none ever is."""

    def __init__(self, rules: tuple[AutoCreateRule, ...], exists: Callable[[str], bool], create: Create) -> None:
        self.rules = rules
        self.exists = exists
        self.create = create
        self.created = 0  # topics this node created on first use
        self._running: dict[str, asyncio.Future[None]] = {}

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
            running = asyncio.ensure_future(self._create(topic, rule))
            self._running[topic] = running
            running.add_done_callback(lambda _f: self._running.pop(topic, None))
        await asyncio.shield(running)

    async def _create(self, topic: str, rule: AutoCreateRule) -> None:
        try:
            await self.create(topic, rule.partitions, dict(rule.config))
        except TopicExists:
            return  # made meanwhile (another node of the site, a topic sync): what the produce wanted
        self.created += 1
        log.info("created topic %s on first use (auto_create %s)", topic, rule.describe())
