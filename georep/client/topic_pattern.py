"""A pattern subscription's topics (``Consumer.subscribe(pattern="orders/eu/**")``): every topic of the connected
site that the pattern matches, existing and future, as Kafka's pattern subscription reads.

The consumer resolves the pattern itself, as Kafka's classic consumer resolves its regex against Metadata, and a
group member joins with the topics it matched (``GroupHeartbeat``'s subscription), so a new matching topic makes
the group rebalance over it at the member's next heartbeat. Each refresh asks the node's topic catalog for what
changed since the last one (``ListTopics`` ``changed_since``, as the sites' topic sync does, with the
``pattern``, so that the node sends only the matching topics): one small answer when nothing changed, whatever the
number of topics. A token of another node or site (the consumer moved) lists the catalog again from its start.
Patterns are ``topology/filters.py``'s (``+`` one level, ``**`` any number); internal topics never match.
"""

from __future__ import annotations

import logging
import time

from georep.client.connection import Connection
from georep.client.errors import NodeUnavailable, Operation, from_rpc_error
from georep.proto import georep_pb2
from topology.filters import TopicFilter, is_internal

PAGE = 10_000  # topics per answer (the node's cap for the definition view)
RETRY_S = 1.0  # a refresh the node did not answer is tried again this soon
log = logging.getLogger(__name__)


class PatternTopics:
    """The topics ``pattern`` matches at the connected site, with their partition counts; refreshed at most every
    ``refresh_s`` (:meth:`due`)."""

    def __init__(self, pattern: TopicFilter, refresh_s: float) -> None:
        self.pattern = pattern
        self.refresh_s = refresh_s
        self.topics: dict[str, int] = {}
        self._token = ""  # the catalog token of the last refresh ("": list from the first topic)
        self._next = 0.0  # time.monotonic() of the next refresh

    def due(self) -> bool:
        return time.monotonic() >= self._next

    async def refresh(self, connection: Connection, timeout_s: float) -> bool:
        """Ask what changed since the last refresh; True if the matched topics or their partition counts did."""
        import grpc

        listed: list[georep_pb2.TopicDescription] = []
        restarted = False
        token = self._token
        while True:
            request = georep_pb2.ListTopicsRequest(
                view=georep_pb2.TOPIC_VIEW_DEFINITION, changed_since=token, page_size=PAGE, pattern=self.pattern.text
            )
            try:
                try:
                    resp = await connection.unary(connection.stub.ListTopics(request, timeout=timeout_s))
                except grpc.RpcError as exc:
                    raise from_rpc_error(exc, connection.address, operation=Operation.FETCH) from None
            except NodeUnavailable as error:
                # The node is away or busy (or another call replaced the channel): the topics stay as they were,
                # and the next poll asks again.
                log.info("pattern %s: listing the topics failed (%s); asking again", self.pattern, error.message)
                self._next = time.monotonic() + min(self.refresh_s, RETRY_S)
                return False
            restarted = restarted or resp.restarted
            listed.extend(resp.topics)
            token = resp.catalog_token
            if not resp.next_page_token:
                break
        topics = {} if restarted else dict(self.topics)
        for t in listed:
            if is_internal(t.name) or not self.pattern.matches(t.name):
                continue
            if t.entry.deleted:
                topics.pop(t.name, None)
            else:
                topics[t.name] = t.partitions
        changed = topics != self.topics
        self.topics, self._token, self._next = topics, token, time.monotonic() + self.refresh_s
        return changed
