"""What a Kafka gateway answers about a group's offsets where the partition's log is: here, or on a multi-node site
at the partition's leader, which its group's coordinator asks (georep's ``ListOffsets`` with a ``kafka`` ask).

The leader computes a commit's exact vector and where a commit resumes from its own log, and keeps the client's
fetch filter, since the client's fetches go to it (``georep/kafka/offsets.py`` says what both mean). A node whose
log of the partition ends below the client's offset is behind the partition (a deposed leader not detached yet, or
a coordinator's stale view of who leads): it refuses a commit rather than store its own, lower, end, and answers
this site's own hint as is. :class:`KafkaGateway` (``gateway.py``) takes these methods from
:class:`LeaderOffsets`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from georep.broker import fetch
from georep.broker.errors import NotLeader
from georep.kafka import errors as k
from georep.kafka.cluster import ViewOf
from georep.kafka.offsets import FetchFilters, vector_at
from georep.proto import georep_pb2 as pb
from georep.proto.convert import vector_from_proto, vector_to_proto
from georep.server.broker import Broker
from georep.storage.api import PartitionLog
from offsets.coordinates import InvalidOrigin, Origin
from offsets.vector import VectorOffset

AskLeader = Callable[[str, int, pb.KafkaOffsetAsk], Awaitable[pb.PartitionOffset]]


class LeaderUnreachable(Exception):
    """A group's coordinator could not ask a partition's leader for an offset (a multi-node site): retriable."""

    kafka_code = k.COORDINATOR_LOAD_IN_PROGRESS


class LeaderRefused(Exception):
    """A partition's leader refused a coordinator's ask for a reason the client must hear (an offset below the
    log start): not retried, answered with ``kafka_code``."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.kafka_code = code


class LeaderOffsets:
    """The offset answers of a gateway (see the module docstring); the gateway sets the attributes."""

    broker: Broker
    filters: FetchFilters
    view_of: ViewOf | None  # None: a one-node site
    ask_leader: AskLeader | None  # how a coordinator asks a partition's leader (a multi-node site)

    def resume_offset(self, client: str, c: pb.CommittedOffset) -> int:
        """This node's local offset for a committed vector, exact (``fetch.resume_at``: the commit's hint only in
        the log it was taken in; otherwise the offset of the first record the vector does not cover). A filter
        for the client's fetches only where the vector covers records past that offset (interleaved origins,
        records still to arrive, or a commit that kept covering what a resumed consumer skipped). The filter is
        this node's, the one serving the partition's fetches; raises ``NotLeader`` for a partition it does not
        serve."""
        plog = self.broker.partition(c.topic, c.partition).log
        vector = vector_from_proto(c.vector)
        try:
            hint_origin: Origin | None = Origin.parse(c.committed_by)
        except InvalidOrigin:
            hint_origin = None  # a hint is a shortcut: the vector alone says where
        key = (client, c.topic, c.partition)
        if hint_origin == self.broker.origin and self.view_of is not None and c.hint_offset > plog.log_end_offset:
            # This node's log ends below this site's own commit (a deposed leader not detached yet, a stale view):
            # clamping would resume below what the commit covered. The hint is the site's offset: answered as is.
            # Where the partition really ends below it (a re-created topic), the client's fetch hears
            # OFFSET_OUT_OF_RANGE and applies auto.offset.reset, as Kafka does for a commit past the end.
            self.filters.clear(key)
            return int(c.hint_offset)
        resume = fetch.resume_at(plog, fetch.FromVector(vector, hint_origin, int(c.hint_offset)), self.broker.origin)
        if resume.covered_after:
            self.filters.set(key, resume.offset, vector)
        else:
            self.filters.clear(key)
        return int(resume.offset)

    def commit_vector(self, client: str, topic: str, partition: int, offset: int) -> tuple[int, VectorOffset]:
        """The offset a commit of ``offset`` stores (clamped to the log end on a one-node site; refused past it on a
        multi-node site, :meth:`_not_behind`) and its exact vector, from this node's log of the partition
        (``NotLeader`` if it does not serve it)."""
        plog = self.broker.partition(topic, partition).log
        self._not_behind(topic, partition, plog, offset)
        offset = min(offset, plog.log_end_offset)
        vector = vector_at(plog, offset)
        # A consumer that resumed here from a vector committed elsewhere has also read (skipped) what that vector
        # covers beyond ``offset``: the new commit keeps covering it.
        resumed = self.filters.for_fetch((client, topic, partition), offset)
        return offset, vector if resumed is None else vector.merge(resumed)

    def _not_behind(self, topic: str, partition: int, plog: PartitionLog, offset: int) -> None:
        """``NotLeader`` when this node of a multi-node site ends its log of the partition below ``offset``, which a
        client of this site read up to: its log is behind the partition's (a deposed leader not detached yet, or
        a coordinator's stale view of who leads), and clamping to its end would store a commit lower than the one
        the client is told succeeded: the group would read again what it covered. A one-node site's log is the
        partition: there an offset past the end stops at the end."""
        end = plog.log_end_offset
        if offset > end and self.view_of is not None:
            raise NotLeader(
                topic,
                partition,
                f"offset {offset} is past the end of this node's log of it ({end}): this node is behind the "
                "partition's leader, or no record was written there yet; commit an offset the consumer has read",
            )

    def answer_coordinator(self, topic: str, partition: int, ask: pb.KafkaOffsetAsk) -> pb.PartitionOffset:
        """A group's coordinator on another node of this site asks (georep's ``ListOffsets``, ``kafka``): this node
        leads the partition, so it computes from its log, and keeps the client's filter where its fetches come."""
        if ask.HasField("resume"):
            return pb.PartitionOffset(partition=partition, offset=self.resume_offset(ask.client, ask.resume))
        offset, vector = self.commit_vector(ask.client, topic, partition, ask.commit_offset)
        return pb.PartitionOffset(partition=partition, offset=offset, vector=vector_to_proto(vector))

    async def _at_leader(self, topic: str, partition: int, ask: pb.KafkaOffsetAsk) -> pb.PartitionOffset:
        if self.ask_leader is None:
            raise LeaderUnreachable(f"{topic}-{partition}: this node does not lead it and knows no peer")
        try:
            return await self.ask_leader(topic, partition, ask)
        except LeaderRefused:
            raise
        except Exception as exc:
            raise LeaderUnreachable(f"{topic}-{partition}: its leader did not answer ({exc}); ask again") from exc

    async def _commit_vector(self, client: str, topic: str, partition: int, offset: int) -> tuple[int, VectorOffset]:
        """:meth:`commit_vector` here, or at the partition's leader when this node (the group's coordinator on a
        multi-node site) does not lead it: the vector is computed where the log and the client's filter are."""
        try:
            return self.commit_vector(client, topic, partition, offset)
        except NotLeader:
            if self.view_of is None:
                raise
        answer = await self._at_leader(topic, partition, pb.KafkaOffsetAsk(client=client, commit_offset=offset))
        return int(answer.offset), vector_from_proto(answer.vector)

    async def _resume_offset(self, client: str, c: pb.CommittedOffset) -> int:
        """:meth:`resume_offset` here, or at the partition's leader, which serves the client's fetches and so
        keeps its filter."""
        try:
            return self.resume_offset(client, c)
        except NotLeader:
            if self.view_of is None:
                raise
        answer = await self._at_leader(c.topic, c.partition, pb.KafkaOffsetAsk(client=client, resume=c))
        return int(answer.offset)
