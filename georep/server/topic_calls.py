"""The calls that change a topic (``georep topic alter``, ``georep topic add-partitions``, ``georep topic
delete``): ``AlterTopic``, ``AddPartitions`` and ``DeleteTopic``, carried out by
:class:`~georep.server.topic_changes.TopicChanges` (a one-node site's)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from georep.broker.errors import InternalTopic, InvalidRequest, TopicDeleteRefused
from georep.metadata.kafka_config import alter_changes
from georep.metadata.store import UnknownTopic
from georep.metadata.topic_entry import TopicEntry, add_partitions
from georep.proto import georep_pb2 as pb
from georep.server.rpc import Context, parse
from georep.server.topic_changes import TopicChanges
from topology.filters import is_internal


class TopicCalls:
    """``AlterTopic`` and ``AddPartitions``; ``describe`` answers with the topic as it is then."""

    def __init__(self, changes: TopicChanges, describe: Callable[[str], pb.TopicDescription]) -> None:
        self.changes = changes
        self.describe = describe
        # Why a delete is unsafe now (a linked peer that does not check incarnations), or None: set by the node.
        self.delete_refused: Callable[[], str | None] = lambda: None
        # Waits until this data dir may create topics, or raises ``CatalogNotSynced`` (georep/server/first_sync.py):
        # set by the node when the site has upstreams. Every user create of either front end awaits it first.
        self.before_create: Callable[[], Awaitable[None]] = _creates_at_once

    async def delete_topic(self, data: bytes, context: Context) -> pb.DeleteTopicResponse:
        """Delete a topic's live incarnation here and, through the topic sync, at every site it reaches."""
        req = parse(pb.DeleteTopicRequest, data)
        return pb.DeleteTopicResponse(incarnation=await self.delete(req.name, req.validate_only))

    async def delete(self, name: str, validate_only: bool = False) -> int:
        """What ``DeleteTopic`` and Kafka's DeleteTopics do; the incarnation deleted. Raises ``UnknownTopic``,
        ``InternalTopic``, ``TopicDeleteRefused``."""
        if is_internal(name):
            raise InternalTopic(f"topic {name!r} is georep's own: it cannot be deleted")
        incarnation = self._held(name).incarnation
        refused = self.delete_refused()
        if refused is not None:
            raise TopicDeleteRefused(refused)
        if not validate_only:
            await self.changes.delete(name)
        return incarnation

    async def alter_topic(self, data: bytes, context: Context) -> pb.TopicDescription:
        """Set or reset config keys (Kafka's names or georep's); ``validate_only`` checks and changes nothing."""
        req = parse(pb.AlterTopicRequest, data)
        changes = alter_changes(dict(req.set), list(req.reset))
        if not changes:
            raise InvalidRequest(f"alter of topic {req.name!r} changes nothing: give --config k=v or --delete-config k")
        if req.validate_only:
            self.changes.altered(req.name, changes)  # what the change would refuse
        else:
            await self.changes.alter(req.name, changes)
        return self.describe(req.name)

    async def add_partitions(self, data: bytes, context: Context) -> pb.TopicDescription:
        """Grow a topic to ``partitions``: more than it has (the count only grows)."""
        req = parse(pb.AddPartitionsRequest, data)
        if req.validate_only:
            add_partitions(self._held(req.name), req.name, req.partitions)
        else:
            await self.changes.add_partitions(req.name, req.partitions)
        return self.describe(req.name)

    def _held(self, name: str) -> TopicEntry:  # (for validate_only: the checks the change makes)
        entry = self.changes.held(name)
        if entry is None or entry.deleted:
            raise UnknownTopic(name)
        return entry


async def _creates_at_once() -> None:
    """A site with no upstream has no catalog to hear of a delete from."""
