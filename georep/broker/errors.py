"""The broker's domain errors: plain exceptions, each saying what to do. No gRPC here.

The pure core raises these (and the errors of the modules it builds on:
``georep.metadata.store.UnknownTopic``, ``georep.storage.api.DiskFull``, ...).
Only the gRPC layer (``georep/server/status.py``) maps them to status codes,
so the simulator and the unit tests see the same exceptions the node does.
"""

from __future__ import annotations

from dedup.producer import InvalidSequence, OutOfOrderSequence, ProducerFenced
from georep.storage.api import DamagedBatch


class BrokerError(Exception):
    """Base of the errors a request causes or a caller must act on. ``str(exc)`` says what to do."""


class InvalidRequest(BrokerError):
    """A request with fields no correct client sends; nothing was stored."""


class UnknownPartition(BrokerError):
    def __init__(self, topic: str, partition: int, partitions: int) -> None:
        super().__init__(f"topic {topic!r} has partitions 0..{partitions - 1}; partition {partition} does not exist")


class InternalTopic(InvalidRequest):
    """A name reserved for georep's own topics, used where only user topics may be."""


class BatchTooLarge(InvalidRequest):
    def __init__(self, size: int, limit: int, topic: str) -> None:
        super().__init__(
            f"batch of {size} bytes exceeds max_batch_bytes={limit} for topic {topic!r}: "
            "lower the producer's batch_size or raise the topic's max_batch_bytes"
        )


class MalformedBatch(InvalidRequest):
    """A produced batch that is not one whole, unstamped batch."""


class InvalidRecords(MalformedBatch):
    """A produced batch, whole and CRC-valid, whose records break the batch format
    (``georep/record/validate.py``): an unknown codec, a bad count, offset delta, length, header count or
    timestamp. Nothing was stored."""


class DecompressedTooLarge(BatchTooLarge, InvalidRecords):
    """A produced batch whose records decompress (or say they do) past its topic's ``max_batch_bytes``."""

    def __init__(self, limit: int, topic: str) -> None:
        InvalidRequest.__init__(
            self,
            f"the batch's records decompress to more than max_batch_bytes={limit} of topic {topic!r}; "
            "nothing was stored: lower the producer's batch_size or raise the topic's max_batch_bytes",
        )


class TimestampRefused(InvalidRecords):
    """A record timestamp out of the topic's ``message_timestamp_before_max_ms`` / ``..._after_max_ms``
    around the origin's clock (Kafka's ``message.timestamp.before.max.ms`` / ``after.max.ms``)."""


class BatchCrcMismatch(BrokerError):
    def __init__(self) -> None:
        super().__init__("batch CRC-32C mismatch: the batch was corrupted in transit or by the producer; resend it")


class SequenceRejected(BrokerError):
    """The idempotent producer's table refused the batch (``dedup/producer.py``); nothing was stored."""

    def __init__(self, decision: OutOfOrderSequence | ProducerFenced | InvalidSequence) -> None:
        super().__init__(decision.message())
        self.decision = decision


class WriteFailed(BrokerError):
    """The log could not take the write (an I/O error other than a full disk); nothing was half-written."""


class FsyncFailed(BrokerError):
    """The fsync an ack waited for failed: the batch was written but not acknowledged."""


class NodeStopping(BrokerError):
    """The node is shutting down; the caller should retry, at this node once it is back or at another."""


class InvalidAcks(InvalidRequest):
    """An ack level that does not exist (``acks=geo:0``, for example)."""


class GeoAcksUnreachable(BrokerError):
    """``acks=geo:N`` with more sites than the topic's records can reach from here."""


class NotEnoughReplicas(BrokerError):
    """A multi-node site's partition cannot take writes: fewer nodes are live than its topic's
    ``min_insync_replicas``, so no segment can be opened that would acknowledge them (Kafka's NOT_ENOUGH_REPLICAS,
    which producers retry). The message names the nodes and what to do: bring one back, or lower the quorum."""


class GeoAckTimeout(BrokerError):
    """``acks=geo:N`` was not reached in time. The write stays and replicates later."""


class UnknownGroup(BrokerError):
    """A group this site has neither members nor commits of."""


class GroupNotEmpty(BrokerError):
    """A delete of a group's positions while the group has active members (Kafka's NON_EMPTY_GROUP)."""


class CommitsBehind(BrokerError):
    """A live upstream holds commits this site lacks: answering now could hand out a stale position.

    A consumer starting from a stale commit would read again what the group had
    committed (a duplicate relative to the commit, I5), so the site says so and
    the consumer asks again, as Kafka's consumers do on COORDINATOR_LOAD_IN_PROGRESS.
    """


class NotAuthorized(BrokerError):
    """An admin call without the right credentials."""


class NoSuchLink(BrokerError):
    """A link the topology does not have (or a node that runs without a topology)."""


class NoTopology(BrokerError):
    """A call that needs links, at a node that runs standalone."""


class DamagedData(BrokerError):
    """A read reached a batch quarantined as damaged at this site (``georep/storage``): nothing of it is served."""

    def __init__(self, topic: str, partition: int, site: str, damaged: DamagedBatch) -> None:
        super().__init__(
            f"topic {topic!r} partition {partition}: {damaged.describe()} are damaged at site {site} "
            f"({damaged.reason}) and quarantined until a peer's copy repairs them. Read them at another site, "
            "wait for the repair, or skip them (georep consume --skip-corrupt, Consumer(skip_corrupt=True))"
        )
        self.next_offset = damaged.next_offset


class NotHeld(BrokerError):
    """A batch asked for by its coordinate that this site does not hold durably (``FetchBatch``)."""


class NotLeader(BrokerError):
    """This node does not lead the partition (any more): the client asks the site's metadata for the leader."""

    def __init__(self, topic: str, partition: int, why: str, leader_hint: str = "") -> None:
        hint = f"; the leader is {leader_hint}" if leader_hint else "; refresh the partition's leader and retry"
        super().__init__(f"this node does not lead {topic}-{partition}: {why}{hint}")
        self.leader_hint = leader_hint


class NotCoordinator(NotLeader):
    """A group call reached a node of a multi-node site that does not coordinate the group: the coordinator is the
    leader of the group's ``__georep_offsets`` partition (Kafka's NOT_COORDINATOR). Mapped like ``NotLeader``, with
    the coordinator's address as the hint, so clients follow it as they follow a partition's leader."""

    def __init__(self, group: str, topic: str, partition: int, leader_hint: str = "", why: str = "") -> None:
        where = (
            f"; its coordinator is {leader_hint}"
            if leader_hint
            else (f"; find its coordinator with DescribeTopic {topic} (the leader of partition {partition}) and retry")
        )
        because = f" ({why})" if why else ""
        BrokerError.__init__(
            self,
            f"this node does not lead {topic}-{partition}, so it does not coordinate group {group!r}{because}{where}",
        )
        self.leader_hint = leader_hint


class NotYetSupported(BrokerError):
    """A feature this kind of site does not run yet; the message says which and what to use meanwhile."""


class TopicDeleteRefused(BrokerError):
    """A topic delete this node cannot make safely now (a linked peer that does not check incarnations would
    serve the deleted records into a re-created topic); the message says what to do."""

    kafka_code = 73  # Kafka's TOPIC_DELETION_DISABLED, with the message


class CatalogNotSynced(BrokerError):
    """A create at a data dir that has not yet listed the topic catalog of each of its upstreams once: it could make
    a topic a delete elsewhere removed (docs/design.md, "A create at a site that has not heard of a delete").
    Retriable: the message names the upstream to make reachable."""

    # Kafka's REQUEST_TIMED_OUT, retriable: what Kafka's CreateTopics answers when the create did not complete
    # within its timeout, as here, where the node waited for the sync before answering.
    kafka_code = 7


class SegmentUnreadable(BrokerError):
    """A read reached a segment this node holds no copy of, and none of the nodes that hold it answered."""


class RecoveryFailed(BrokerError):
    """A new leader cannot recover the partition's open segment safely now; the message says which members to
    bring back. The partition takes no writes until it can."""


class SingleNodeSite(BrokerError):
    """A call about a multi-node site's segment cluster (``georep cluster status``), at a node that is its site's
    only node: there are no ensembles, no partition leaders and no Raft group to show."""
