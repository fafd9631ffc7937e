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

:class:`ProducerWorkload` drives them: it draws each producer's ack level,
writes a batch every ``produce_ms``, carries the requests and answers over
the client's connection, and keeps the acknowledged writes for the checks.
The simulator keeps the names a subclass overrides (``_on_produce_answer``,
``_resolve``, ``_check_ack_promise``) and calls this module through them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from georep.broker.acks import AckKind, Acks
from georep.broker.append import Produced
from georep.broker.errors import BrokerError
from georep.client.accumulator import BatchState, ProducerBatch
from georep.client.delivery import PartitionDelivery
from georep.client.errors import Operation, from_status
from georep.metadata.topics import MAX_BATCH_BYTES_LIMIT
from georep.record.batch import RecordInput, encode_batch
from georep.replication.links import PartitionKey
from georep.server.status import wire_status
from georep.sim.checker import InvariantViolation
from georep.sim.site import SimSite
from offsets.coordinates import Origin
from topology.ids import SiteId
from topology.reach import expected_sites

if TYPE_CHECKING:
    from georep.sim.simulator import Simulator

MAX_IN_FLIGHT = 5
RETRY_BACKOFF_MS = 20
CLIENT_MS = 1  # one way between a client and its site
PRODUCER_ID_BITS = 62


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


class ProducerWorkload:
    """The producers of a run, one per site and data partition, and the checks of what they were promised."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self.producers: list[SimProducer] = []
        for sid in sorted(sim.sites):
            for key in sim.data_keys:
                acks = Acks()
                reach = len(expected_sites(sim.topology, sid, key[0]))
                if reach >= 2 and sim.rng.random() < sim.config.geo_p:
                    acks = Acks.geo(sim.rng.randint(2, reach))
                delivery = PartitionDelivery(key[0], key[1], self._producer_id(), MAX_IN_FLIGHT)
                self.producers.append(SimProducer(len(self.producers), sid, key, acks, delivery))

    def _producer_id(self) -> int:
        return self.sim.rng.getrandbits(PRODUCER_ID_BITS)

    def handlers(self) -> dict[str, Callable[..., None]]:
        return {
            "produce": self._on_produce,
            "produce_request": self._on_produce_request,
            "producer_send": self._on_producer_send,
        }

    def start(self) -> None:
        sim = self.sim
        for producer in self.producers:
            sim._after(sim.rng.randint(0, sim.config.produce_ms[1]), "produce", producer.index)

    def problems(self) -> list[str]:
        return [f"{p.name} still has batches unanswered" for p in self.producers if not p.done()]

    # -- the connection to the site ---------------------------------------------------------

    def connect(self, site: SimSite) -> None:
        """``site`` has just started: its producers connect and send what their delivery lets go."""
        for producer in self.producers:
            if producer.site == site.id:
                producer.incarnation = site.incarnation
                self.send_batches(producer)

    def lose_connection(self, site: SimSite) -> None:
        """``site`` stopped serving: its producers' connections broke, and their unanswered batches are requeued."""
        for producer in self.producers:
            if producer.site == site.id and producer.incarnation >= 0:
                producer.incarnation = -1
                producer.in_flight.clear()
                producer.delivery.on_stream_broken()
                self.sim._resolve(producer)

    def forget_lost(self, site: SimSite, rebuilt: bool) -> None:
        """``site`` crashed: the copies it lost no longer count as stored (exactly once)."""
        for producer in self.producers:
            producer.forget_lost(site.id, site.logs[producer.key].vector(), rebuilt)

    # -- events -----------------------------------------------------------------------------

    def _on_produce(self, pi: int) -> None:
        sim = self.sim
        if sim.phase != "safety":
            return
        producer = self.producers[pi]
        cfg = sim.config
        site = sim.sites[producer.site]
        ts = sim.local_ms(site)
        records = []
        for _ in range(sim.rng.randint(*cfg.records_per_batch)):
            value = f"p{pi}-{producer.next_value}".encode() + sim.rng.randbytes(sim.rng.randint(0, 30))
            producer.next_value += 1
            records.append(RecordInput(f"k{sim.rng.randrange(100)}".encode(), value, (), ts))
        producer.new_batch(records, sim.now_ms)
        sim.counts.produced_batches += 1
        self.send_batches(producer)
        sim._after(sim.rng.randint(*cfg.produce_ms), "produce", pi)

    def send_batches(self, producer: SimProducer) -> None:
        """What the producer's delivery lets go now, over its connection to its site."""
        sim = self.sim
        site = sim.alive(producer.site, producer.incarnation)
        if site is None:
            return
        delivery = producer.delivery
        if delivery.not_before_ms > sim.now_ms:
            return
        for batch in delivery.take_sendable():
            if batch.data is None:
                batch.data = encode_batch(
                    batch.records,
                    producer_id=batch.producer_id,
                    producer_epoch=0,
                    base_sequence=batch.base_sequence or 0,
                )
            elif batch.sent_ms:
                producer.resent_batches += 1
            batch.sent_ms = sim.now_ms
            producer.next_correlation += 1
            producer.in_flight[producer.next_correlation] = batch
            sim._after(CLIENT_MS, "produce_request", producer.index, producer.incarnation, producer.next_correlation)

    def _on_produce_request(self, pi: int, incarnation: int, correlation: int) -> None:
        sim = self.sim
        producer = self.producers[pi]
        site = sim.alive(producer.site, incarnation)
        batch = producer.in_flight.get(correlation)
        if site is None or batch is None or batch.data is None:
            return
        key = producer.key
        try:
            produced = sim.append(site, key, batch.data)
        except BrokerError as exc:
            sim._after(CLIENT_MS, "produce_answer", pi, incarnation, correlation, None, exc)
            return
        if not produced.duplicate:
            producer.stored_new(batch, site.id, produced.origin, produced.result.base_origin_seq)

        def answer(error: Exception | None) -> None:
            if error is None:
                sim._check_ack_promise(producer, site, produced)
            sim._after(CLIENT_MS, "produce_answer", pi, incarnation, correlation, produced, error)

        sim.wait_ack(site, key, produced, producer.acks, answer, sim.config.geo_timeout_ms)

    def answered(self, pi: int, incarnation: int, correlation: int, error: Exception | None) -> None:
        """The answer to a request reached the producer (``Simulator._on_produce_answer``)."""
        sim = self.sim
        producer = self.producers[pi]
        if producer.incarnation != incarnation:
            return  # the connection it came on broke: the batch was already requeued
        batch = producer.in_flight.pop(correlation, None)
        if batch is None:
            return
        delivery = producer.delivery
        if error is None:
            delivery.on_success(batch)
            producer.acked_batches += 1
        else:
            code, reason = wire_status(error) or (grpc.StatusCode.INTERNAL, "")
            client_error = from_status(Operation.PRODUCE, code, str(error), reason)
            if delivery.on_error(batch, client_error, sim.now_ms, RETRY_BACKOFF_MS):
                producer.failed_batches += 1
                sim.counts.geo_timeouts += type(error).__name__ == "GeoAckTimeout"
            if delivery.not_before_ms > sim.now_ms:
                sim._after(int(delivery.not_before_ms - sim.now_ms), "producer_send", pi)
        sim._resolve(producer)
        self.send_batches(producer)

    def _on_producer_send(self, pi: int) -> None:
        self.send_batches(self.producers[pi])

    def resolve(self, producer: SimProducer) -> None:
        """Once a round of resends is complete, the delivery resolves it (``Simulator._resolve``)."""
        delivery = producer.delivery
        if delivery.round_complete():
            for _failed in delivery.resolve(self._producer_id()):
                producer.failed_batches += 1

    # -- checks -----------------------------------------------------------------------------

    def check_ack_promise(self, producer: SimProducer, site: SimSite, produced: Produced) -> None:
        """I6 at the ack: the ack level's promise holds now.

        ``geo:N``: N sites hold the batch fsynced, or held it fsynced and lost their disk since (a disk
        loss is the failure the promise is about: the ack may rest on what a site reported just before).
        ``leader`` on a topic that fsyncs per batch: the origin holds it fsynced.
        """
        sim = self.sim
        key = producer.key
        origin, seq = produced.origin, int(produced.result.last_origin_seq)
        holders = {
            sid: s.rebuilds for sid, s in sorted(sim.sites.items()) if s.logs[key].flushed_vector().get(origin, 0) > seq
        }
        held = [sid for sid in sorted(sim.sites) if sim.ever_flushed[(sid, key)].get(origin, 0) > seq]
        needed = producer.acks.sites if producer.acks.kind is AckKind.GEO else 1
        durable = needed > 1 or sim.fsync_per_batch[key[0]]
        if durable and len(held) < needed:
            raise InvariantViolation(
                f"I6: {producer.name} was acked for {origin} seq {seq} in {key[0]}[{key[1]}], but only "
                f"{len(held)} site(s) ({', '.join(held) or 'none'}) hold it fsynced; acks={producer.acks} "
                f"promises {needed}"
            )
        if durable:
            sim.acked.append(AckedWrite(key, origin, seq, holders, str(producer.acks)))

    def check_acked_writes(self, crashed: SimSite | None = None) -> None:
        """I6 after the fact: every site that held an acked batch fsynced still holds it, unless it lost its disk."""
        sim = self.sim
        for w in sim.acked:
            for sid, rebuilds in w.holders.items():
                site = sim.sites[sid]
                if (crashed is not None and site is not crashed) or site.rebuilds != rebuilds:
                    continue
                if site.logs[w.key].vector().get(w.origin, 0) <= w.last_seq:
                    raise InvariantViolation(
                        f"I6: site {sid} held {w.origin} seq {w.last_seq} of {w.key[0]}[{w.key[1]}] fsynced when it "
                        f"was acked (acks={w.acks}) and no longer holds it"
                    )
