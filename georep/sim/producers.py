"""Simulated idempotent producers: the client's own delivery core, resending across crashes.

Each :class:`SimProducer` writes one partition at one site (its region) with
one ack level, ``leader`` or ``geo:N``. It runs the real client's pure
delivery state machine (``georep/client/delivery.py``): batches take
sequences when first sent, at most 5 are in flight, a broken connection (its
site crashed) re-sends every unanswered batch with the same bytes, and an
answer is judged as the client judges it, after the node's domain error went
through the gRPC mapping (``georep/server/status.py``) and back into a client
exception (``georep/client/errors.py``), as on the wire.

The site takes each batch with ``append_as_origin`` and holds its answer in
the ``AckTable`` until the ack level holds.

Checked, besides I1-I4 (``checker.py``):

* **exactly once**: no batch a producer sent is stored twice as a new
  append, however often it was resent, unless the site lost its disk in
  between (then the copy stamped with the old epoch lives on elsewhere, and
  the resend is a new write: georep, like Kafka, cannot tell);
* **I6 at the ack**: when a ``leader`` ack is released for a topic that
  fsyncs per batch, the origin holds the batch fsynced; when a ``geo:N`` ack
  is released, N sites hold it fsynced;
* **I6 after the fact**: every site that held an acknowledged batch fsynced
  when the ack went out still holds it after any number of crashes, unless
  it lost its disk (checked at every crash and at the end);
* **liveness**: after healing, every batch is answered.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from georep.broker.acks import Acks
from georep.client.accumulator import BatchState, ProducerBatch
from georep.client.delivery import PartitionDelivery
from georep.metadata.topics import MAX_BATCH_BYTES_LIMIT
from georep.record.batch import RecordInput
from georep.replication.links import PartitionKey
from georep.sim.checker import InvariantViolation
from offsets.coordinates import Origin
from topology.ids import SiteId

MAX_IN_FLIGHT = 5
RETRY_BACKOFF_MS = 20


@dataclass(slots=True)
class AckedWrite:
    """An acknowledged batch and the sites that held it fsynced at the ack (with their rebuild counts then)."""

    key: PartitionKey
    origin: Origin
    last_seq: int
    holders: dict[SiteId, int]
    acks: str


@dataclass(slots=True)
class SimProducer:
    index: int
    site: SiteId
    key: PartitionKey
    acks: Acks
    delivery: PartitionDelivery
    incarnation: int = -1  # of the site its connection is to; -1: not connected
    next_value: int = 0
    next_correlation: int = 0
    in_flight: dict[int, ProducerBatch] = field(default_factory=dict)  # correlation id -> batch
    uid: dict[int, int] = field(default_factory=dict)  # id(batch) -> this producer's batch number
    next_uid: int = 0
    # batch number -> (site, origin, base seq) of its one stored copy as a new append
    stored: dict[int, tuple[SiteId, Origin, int]] = field(default_factory=dict)
    acked_batches: int = 0
    failed_batches: int = 0  # failed for good (a geo timeout: stored, but the promise was not kept in time)
    resent_batches: int = 0

    @property
    def name(self) -> str:
        return f"producer {self.index} ({self.acks}) of {self.key[0]}[{self.key[1]}] at {self.site}"

    def new_batch(self, records: list[RecordInput], now_ms: int) -> ProducerBatch:
        batch = ProducerBatch(self.key[0], self.key[1], now_ms, MAX_BATCH_BYTES_LIMIT)
        batch.records = records
        batch.futures = [None] * len(records)
        batch.state = BatchState.QUEUED
        self.uid[id(batch)] = self.next_uid
        self.next_uid += 1
        self.delivery.enqueue(batch)
        return batch

    def batch_number(self, batch: ProducerBatch) -> int:
        return self.uid[id(batch)]

    def stored_new(self, batch: ProducerBatch, site: SiteId, origin: Origin, base_seq: int) -> None:
        """The site appended ``batch`` as new (not as a retry of a stored one): it must be the only copy."""
        number = self.batch_number(batch)
        held = self.stored.get(number)
        if held is not None:
            raise InvariantViolation(
                f"exactly once: {self.name} batch #{number} (producer id {batch.producer_id}, sequence "
                f"{batch.base_sequence}) was stored twice as a new write: at {held[1]} seq {held[2]} and at {origin} "
                f"seq {base_seq}; the idempotent producer's resend was not recognized"
            )
        self.stored[number] = (site, origin, base_seq)

    def forget_lost(self, site: SiteId, kept: Mapping[Origin, int], rebuilt: bool) -> None:
        """``site`` crashed: copies it stored and lost (unflushed, or its whole disk) no longer count."""
        for number, (where, origin, base) in list(self.stored.items()):
            if where == site and (rebuilt or base >= kept.get(origin, 0)):
                del self.stored[number]

    def done(self) -> bool:
        return self.delivery.idle
