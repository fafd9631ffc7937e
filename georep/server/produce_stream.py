"""One ``ProduceStream`` call: batches appended in stream order, each answered on its own as its ack completes.

A request carries one batch (fields 1-4 of ``ProduceRequest``) or many (``batches``), as Kafka's ProduceRequest
carries many partitions. With records sent to partitions in turn, a batch holds about one record at 10,000
partitions, so what a stream message costs (its gRPC read, its parse, its answer) was paid per record; packed,
it is paid once per request. Each batch of a request is still taken alone: appended in order, answered with its
own result or its own error (an unknown partition, a damaged batch), so the producer's per-partition sequences
and the node's idempotence are what they were with one batch per message.

The node says it takes multi-batch requests, and their bounds, in the stream's initial metadata
(``georep/proto/reasons.py``'s ``PRODUCE_*_METADATA``), so a producer packs only for a node that unpacks.
A request above the bounds ends the stream with ``INVALID_ARGUMENT`` and says which bound, as a malformed
message does: no correct producer sends one. Answers to a client that sent a multi-batch request go packed too
(``ProduceResponse.results``), as many as are ready, up to :data:`RESULTS_MAX` per message.

Per batch: one append and, when the ack must wait for an fsync, one callback on the shared fsync future. No
task or queue per batch: at 64 KiB batches that machinery cost more than the append itself.
"""

from __future__ import annotations

import asyncio
import collections
import functools
from collections.abc import AsyncIterator, Callable

from georep.broker.acks import Acks
from georep.broker.append import Produced
from georep.broker.errors import InvalidRequest, WriteFailed
from georep.proto import georep_pb2 as pb
from georep.proto.bounds import REPEATED_MAX
from georep.proto.convert import acks_from_proto
from georep.proto.reasons import PRODUCE_BATCHES_MAX_METADATA, PRODUCE_BYTES_MAX_METADATA
from georep.server.auto_create import AutoCreate, Refusal
from georep.server.broker import Broker
from georep.server.rpc import Context, parse
from georep.server.status import DOMAIN_ERRORS

# Unacked batches per stream before reading pauses. Each holds a few hundred bytes (its coordinates and waiter,
# not its data), and a producer's max_in_flight_requests bounds what it sends: 5 requests of 1,000 batches fit.
PENDING_MAX = 8 * 1024
REQUEST_BATCHES_MAX = REPEATED_MAX["ProduceRequest.batches"]  # batches in one request (parse refuses more)
REQUEST_BYTES_MAX = 64 << 20  # batch bytes in one multi-batch request, as much as one batch may hold
RESULTS_MAX = 1_000  # answers in one packed ProduceResponse


def check_request(req: pb.ProduceRequest, batches_max: int, bytes_max: int) -> None:
    """Refuse a multi-batch request above the node's bounds, or one that also sets the single-batch fields."""
    if req.topic or req.batch or req.correlation_id:
        raise InvalidRequest(
            "a ProduceRequest carries one batch in its topic/partition/batch fields or many in 'batches', not both: "
            "put every batch in 'batches'"
        )
    if len(req.batches) > batches_max:
        raise InvalidRequest(
            f"the produce request carries {len(req.batches)} batches; this node takes at most {batches_max} in one "
            "request: split it (a georep producer packs within the bound the node announces)"
        )
    size = sum(len(b.batch) for b in req.batches)
    if size > bytes_max:
        raise InvalidRequest(
            f"the produce request carries {size} bytes of batches; this node takes at most {bytes_max} in one "
            "request: split it (a georep producer packs within the bound the node announces)"
        )


class ProduceStreamCall:
    """The node's side of one ``ProduceStream`` call (see the module doc)."""

    def __init__(
        self,
        broker: Broker,
        on_error: Callable[[Exception], pb.Error],
        *,
        batches_max: int = REQUEST_BATCHES_MAX,
        bytes_max: int = REQUEST_BYTES_MAX,
    ) -> None:
        self.broker = broker
        self.on_error = on_error  # counts the error in the metrics and gives its Error message
        self.batches_max = batches_max
        self.bytes_max = bytes_max
        self.ready: collections.deque[pb.ProduceResponse] = collections.deque()
        self.wake = asyncio.Event()
        self.room = asyncio.Event()
        self.room.set()
        self.waiting = 0
        self.packed = False  # the client sent a multi-batch request, so it reads packed answers
        self.done = False
        self.failure: BaseException | None = None
        # Topics created on first use (auto_create.py), with the caller's create_topic ACL: set by the service
        self.auto_create: AutoCreate | None = None
        self.create_refusal: Refusal = lambda _topic: None

    async def serve(
        self, requests: AsyncIterator[bytes | pb.ProduceRequest], context: Context
    ) -> AsyncIterator[pb.ProduceResponse]:
        await context.send_initial_metadata(
            ((PRODUCE_BATCHES_MAX_METADATA, str(self.batches_max)), (PRODUCE_BYTES_MAX_METADATA, str(self.bytes_max)))
        )
        reader = asyncio.create_task(self._read_all(requests))
        try:
            while True:
                while self.ready:
                    yield self._next_answer()
                if self.failure is not None:
                    raise self.failure
                if self.done and not self.waiting:
                    return
                self.wake.clear()
                await self.wake.wait()
        finally:
            reader.cancel()

    def _next_answer(self) -> pb.ProduceResponse:
        ready = self.ready
        if not self.packed or len(ready) == 1:
            return ready.popleft()
        out = pb.ProduceResponse()
        results = out.results
        for _ in range(min(len(ready), RESULTS_MAX)):
            results.append(ready.popleft())
        return out

    async def _read_all(self, requests: AsyncIterator[bytes | pb.ProduceRequest]) -> None:
        try:
            async for raw in requests:
                req = parse(pb.ProduceRequest, raw)
                acks = acks_from_proto(req.acks, req.geo_sites)
                if req.batches:
                    check_request(req, self.batches_max, self.bytes_max)
                    self.packed = True
                    for one in req.batches:
                        if await self._created(one.correlation_id, one.topic, one.partition):
                            self._take(
                                one.correlation_id, one.topic, one.partition, one.batch, acks, req.ack_timeout_ms
                            )
                elif await self._created(req.correlation_id, req.topic, req.partition):
                    self._take(req.correlation_id, req.topic, req.partition, req.batch, acks, req.ack_timeout_ms)
                if self.waiting >= PENDING_MAX:
                    self.room.clear()
                    await self.room.wait()
        except BaseException as exc:  # forwarded to the response stream
            self.failure = exc
        self.done = True
        self.wake.set()

    async def _created(self, correlation_id: int, topic: str, partition: int) -> bool:
        """False, with the batch answered, if its topic is missing and creating it on first use failed; the
        batches after it wait for the create, so stream order stays append order."""
        if self.auto_create is None or self.auto_create.wanted(topic) is None:  # the usual case: no await
            return True
        try:
            await self.auto_create.ensure(topic, self.create_refusal)
        except DOMAIN_ERRORS as exc:
            self._fail(correlation_id, partition, exc)
            return False
        return True

    def _take(self, correlation_id: int, topic: str, partition: int, batch: bytes, acks: Acks, timeout_ms: int) -> None:
        try:
            # Appended here, synchronously: stream order is append order.
            p, produced = self.broker.append(topic, partition, batch, acks)
        except DOMAIN_ERRORS as exc:
            self._fail(correlation_id, partition, exc)
            return
        waiter = self.broker.ack_waiter(p, produced, acks, timeout_ms)
        if waiter is None:
            self._send(answer(correlation_id, partition, produced))
            return
        self.waiting += 1
        waiter.add_done_callback(
            functools.partial(self._durable, correlation_id=correlation_id, partition=partition, produced=produced)
        )

    def _send(self, resp: pb.ProduceResponse) -> None:
        self.ready.append(resp)
        self.wake.set()

    def _fail(self, correlation_id: int, partition: int, exc: Exception) -> None:
        self._send(pb.ProduceResponse(correlation_id=correlation_id, partition=partition, error=self.on_error(exc)))

    def _durable(self, fut: asyncio.Future[None], correlation_id: int, partition: int, produced: Produced) -> None:
        self.waiting -= 1
        self.room.set()
        exc = asyncio.CancelledError("cancelled") if fut.cancelled() else fut.exception()
        if exc is None:
            self._send(answer(correlation_id, partition, produced))
        elif isinstance(exc, DOMAIN_ERRORS):
            self._fail(correlation_id, partition, exc)
        else:
            self._fail(correlation_id, partition, WriteFailed(f"the batch was written but not acked: {exc}"))


def answer(correlation_id: int, partition: int, produced: Produced) -> pb.ProduceResponse:
    """A stored batch's answer: where it went, under which coordinates."""
    r = produced.result
    return pb.ProduceResponse(
        correlation_id=correlation_id,
        partition=partition,
        base_offset=r.base_offset,
        origin_site=produced.origin.site,
        origin_epoch=produced.origin.epoch,
        base_origin_seq=r.base_origin_seq,
        last_origin_seq=r.last_origin_seq,
        append_time_ms=r.append_time_ms,
        duplicate=produced.duplicate,
    )
