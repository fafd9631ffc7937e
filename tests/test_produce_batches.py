"""Issue 22, round-robin produce at 10,000 partitions: requests that carry many batches, as Kafka's ProduceRequest
carries many partitions, and a bound on requests in flight per node.

The node's side runs in process (a real ``Broker`` and ``NodeService`` behind a grpc.aio server on 127.0.0.1):
each batch of a request is appended in order and answered on its own, with its own error; a request above the
node's bounds, or malformed, ends the stream with a message that says which bound. The producer's side runs
against a fake stream that records what is written: every ready batch bound for one node goes in one message,
within the request bounds, at most ``max_in_flight_requests`` unanswered, each partition's sequences in order.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from georep.auth.acl import acl_entry
from georep.auth.policy import Policy
from georep.auth.principal import parse_principal
from georep.client.errors import InvalidRequest
from georep.client.producer import Producer
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.proto.reasons import PRODUCE_BATCHES_MAX_METADATA, PRODUCE_BYTES_MAX_METADATA
from georep.record.batch import parse_header
from georep.security.acl_rpc import NODE_ACCESS, Authorizer
from georep.server.broker import Broker
from georep.server.metrics import NodeMetrics
from georep.server.rpc import parse
from georep.server.service import NodeService
from georep.storage.metadata_file import load_or_create_identity
from tests.support.node_api import batch

PARTITIONS = 4


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    b = Broker(tmp_path, load_or_create_identity(tmp_path, "a", 1))
    b.create_topic("t", PARTITIONS, {})
    yield b
    b.close()


@asynccontextmanager
async def node(broker: Broker, **bounds: int) -> AsyncIterator[grpc.aio.Channel]:
    service = NodeService(broker, NodeMetrics(broker))
    for name, value in bounds.items():
        setattr(service, name, value)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((service.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        await server.stop(None)


def multi(*batches: tuple[int, str, int, bytes]) -> pb.ProduceRequest:
    return pb.ProduceRequest(
        batches=[pb.ProduceBatch(correlation_id=c, topic=t, partition=p, batch=b) for c, t, p, b in batches]
    )


async def answers(call: Any, count: int) -> dict[int, pb.ProduceResponse]:
    """The next ``count`` batch answers of a ProduceStream, packed or not, by correlation id."""
    out: dict[int, pb.ProduceResponse] = {}
    async with asyncio.timeout(10):
        while len(out) < count:
            response = await call.read()
            assert response is not grpc.aio.EOF, f"the stream ended after {len(out)} of {count} answers"
            for one in response.results or [response]:
                out[one.correlation_id] = one
    return out


def damaged(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0xFF])  # the last record's value: the CRC no longer matches


# -- the node ---------------------------------------------------------------------------------------------------------


def test_each_batch_of_a_request_is_appended_in_order_and_answered_on_its_own(broker: Broker) -> None:
    async def main() -> None:
        async with node(broker) as channel:
            call = pbg.NodeStub(channel).ProduceStream()
            await call.write(
                multi(
                    (1, "t", 0, batch(2)),
                    (2, "t", 99, batch(1)),  # no such partition
                    (3, "t", 1, damaged(batch(3))),
                    (4, "t", 0, batch(3)),
                    (5, "nope", 0, batch(1)),  # no such topic
                    (6, "t", 1, batch(1)),
                )
            )
            got = await answers(call, 6)
            await call.done_writing()
            metadata = dict(await call.initial_metadata())  # the node says it takes many, and how many
            assert int(metadata[PRODUCE_BATCHES_MAX_METADATA]) >= 1000
            assert int(metadata[PRODUCE_BYTES_MAX_METADATA]) >= 1 << 20
            assert [c for c, r in sorted(got.items()) if not r.HasField("error")] == [1, 4, 6]
            assert (got[1].base_offset, got[4].base_offset, got[6].base_offset) == (0, 2, 0)
            assert (got[1].base_origin_seq, got[4].base_origin_seq) == (0, 2)
            assert "partition 99" in got[2].error.message
            assert "crc" in got[3].error.message.lower()
            assert "nope" in got[5].error.message
            assert got[2].partition == 99 and got[3].partition == 1

    asyncio.run(main())
    assert broker.partition("t", 0).log.log_end_offset == 5
    assert broker.partition("t", 1).log.log_end_offset == 1  # the damaged batch was not stored


def test_a_client_that_sends_one_batch_a_message_gets_one_answer_a_message(broker: Broker) -> None:
    async def main() -> None:
        async with node(broker) as channel:
            call = pbg.NodeStub(channel).ProduceStream()
            for c in range(1, 6):
                await call.write(pb.ProduceRequest(correlation_id=c, topic="t", partition=c % 2, batch=batch(1)))
            seen = []
            async with asyncio.timeout(10):
                while len(seen) < 5:
                    response = await call.read()
                    assert not response.results  # an old client does not know packed answers
                    seen.append(response.correlation_id)
            await call.done_writing()
            assert sorted(seen) == [1, 2, 3, 4, 5]

    asyncio.run(main())


def refused(broker: Broker, request: pb.ProduceRequest | bytes, **bounds: int) -> str:
    """The stream's end for ``request`` (INVALID_ARGUMENT expected); nothing of it may be stored."""

    async def main() -> str:
        async with node(broker, **bounds) as channel:
            call = channel.stream_stream(
                "/georep.v1.Node/ProduceStream",
                request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
                response_deserializer=pb.ProduceResponse.FromString,
            )()
            await call.write(request)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async with asyncio.timeout(10):
                    while await call.read() is not grpc.aio.EOF:
                        pass
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
            return str(info.value.details())

    details = asyncio.run(main())
    assert all(broker.partition("t", i).log.log_end_offset == 0 for i in range(PARTITIONS))
    return details


def test_a_request_over_the_batch_count_bound_is_refused_whole(broker: Broker) -> None:
    request = multi(*((i, "t", i % PARTITIONS, batch(1)) for i in range(1, 1002)))
    assert "1001 entries; at most 1000" in refused(broker, request)
    request = multi(*((i, "t", 0, batch(1)) for i in range(1, 12)))
    assert "11 batches; this node takes at most 10" in refused(broker, request, produce_batches_max=10)


def test_a_request_over_the_byte_bound_is_refused_whole(broker: Broker) -> None:
    request = multi((1, "t", 0, batch(1, value_bytes=600)), (2, "t", 1, batch(1, value_bytes=600)))
    details = refused(broker, request, produce_bytes_max=1000)
    assert "bytes of batches; this node takes at most 1000 in one request" in details


def test_garbage_is_refused_with_what_to_do(broker: Broker) -> None:
    both = multi((1, "t", 0, batch(1)))
    both.topic, both.batch = "t", batch(1)
    assert "not both" in refused(broker, both)
    assert "malformed ProduceRequest" in refused(broker, b"\x42" + b"\xff" * 40)
    # a batch entry whose own bytes are garbage is that batch's error, not the stream's: see the first test


# -- authorization ---------------------------------------------------------------------------------------------------


def test_a_refused_topic_fails_its_own_batches_only() -> None:
    policy = Policy("a", lambda: [acl_entry("client:alice", "produce", "topic:orders")], lambda: None)
    authorizer = Authorizer(policy, lambda _ctx: None)
    alice = parse_principal("client:alice")
    request = multi((1, "orders", 0, b"x"), (2, "secret", 0, b"y"), (3, "orders", 1, b"z"))
    allowed, refusal = authorizer.screen(NODE_ACCESS, "ProduceStream", alice, request.SerializeToString(), parse)
    assert isinstance(allowed, pb.ProduceRequest) and isinstance(refusal, pb.ProduceResponse)
    assert [b.correlation_id for b in allowed.batches] == [1, 3]
    assert [(r.correlation_id, r.error.code) for r in refusal.results] == [
        (2, grpc.StatusCode.PERMISSION_DENIED.value[0])
    ]
    assert "secret" in refusal.results[0].error.message
    only_secret = multi((4, "secret", 0, b"y"))
    allowed, refusal = authorizer.screen(NODE_ACCESS, "ProduceStream", alice, only_secret.SerializeToString(), parse)
    assert allowed is None and refusal is not None and [r.correlation_id for r in refusal.results] == [4]
    # the rule alone, as a unary call or any other reader of the table decides, looks at every batch's topic
    assert not NODE_ACCESS["ProduceStream"].rule(request, alice, policy).allowed


# -- the producer ----------------------------------------------------------------------------------------------------


class RecordingStream:
    """A ``ProduceStream`` call of a node that takes ``batches_max`` batches a request: it records every message
    written, and answers them (packed) when ``answer`` says so."""

    def __init__(self, batches_max: int, answer: Callable[[], bool] = lambda: True) -> None:
        self.batches_max = batches_max
        self.answer = answer
        self.written: list[pb.ProduceRequest] = []
        self.unanswered: list[pb.ProduceRequest] = []
        self.most_unanswered = 0
        self.responses: asyncio.Queue[Any] = asyncio.Queue()
        self.offsets: dict[int, int] = {}

    async def initial_metadata(self) -> Any:
        if self.batches_max == 1:
            return ()  # a node from before multi-batch requests says nothing
        return ((PRODUCE_BATCHES_MAX_METADATA, str(self.batches_max)), (PRODUCE_BYTES_MAX_METADATA, str(1 << 20)))

    async def write(self, request: pb.ProduceRequest) -> None:
        self.written.append(request)
        self.unanswered.append(request)
        self.most_unanswered = max(self.most_unanswered, len(self.unanswered))
        if self.answer():
            self.release()

    def release(self) -> None:
        for request in self.unanswered:
            one = list(request.batches) or [
                pb.ProduceBatch(
                    correlation_id=request.correlation_id,
                    topic=request.topic,
                    partition=request.partition,
                    batch=request.batch,
                )
            ]
            results = []
            for b in one:
                count = parse_header(b.batch).records_count
                base = self.offsets.get(b.partition, 0)
                self.offsets[b.partition] = base + count
                results.append(
                    pb.ProduceResponse(
                        correlation_id=b.correlation_id,
                        partition=b.partition,
                        base_offset=base,
                        origin_site="a",
                        origin_epoch=1,
                        base_origin_seq=base,
                        last_origin_seq=base + count - 1,
                    )
                )
            self.responses.put_nowait(pb.ProduceResponse(results=results) if request.batches else results[0])
        self.unanswered = []

    async def read(self) -> Any:
        return await self.responses.get()

    def cancel(self) -> bool:
        return True


async def producer_on(stream: RecordingStream, **config: Any) -> Producer:
    class Stub:
        def ProduceStream(self) -> RecordingStream:  # the gRPC method name
            return stream

    async def connect(*_: object) -> Stub:
        return Stub()

    producer = Producer("127.0.0.1:1", linger_ms=1, **config)
    producer._connection.connect = connect  # type: ignore[method-assign]
    await producer.start()
    producer._partition_counts["t"] = 50
    return producer


def sent_batches(stream: RecordingStream) -> list[pb.ProduceBatch]:
    out = []
    for request in stream.written:
        assert not request.batches or not request.topic  # one form or the other, never both
        out += list(request.batches) or [
            pb.ProduceBatch(
                correlation_id=request.correlation_id,
                topic=request.topic,
                partition=request.partition,
                batch=request.batch,
            )
        ]
    return out


def assert_sequences_in_order(stream: RecordingStream) -> None:
    """Each partition's batches went out in sequence order, with no gap and no repeat."""
    next_seq: dict[int, int] = {}
    for b in sent_batches(stream):
        header = parse_header(b.batch)
        assert header.base_sequence == next_seq.get(b.partition, 0), b.partition
        next_seq[b.partition] = header.base_sequence + header.records_count


def test_the_producer_packs_the_batches_for_one_node_into_few_requests() -> None:
    async def main() -> RecordingStream:
        stream = RecordingStream(batches_max=1000)
        producer = await producer_on(stream)
        try:
            futures = [producer.send("t", b"v", partition=i % 50) for i in range(500)]
            async with asyncio.timeout(10):
                await producer.flush()
            offsets = [f.result().offset for f in futures]
            assert offsets == [i // 50 for i in range(500)]  # every record once, in order, per partition
        finally:
            await producer.close(timeout_s=1)
        return stream

    stream = asyncio.run(main())
    batches = sent_batches(stream)
    assert len(stream.written) < len(batches) / 4, (len(stream.written), len(batches))
    assert all(len(r.batches) <= 1000 for r in stream.written)
    assert_sequences_in_order(stream)


def sent_through(stream: RecordingStream, records: int, value: bytes, **config: Any) -> RecordingStream:
    """``records`` records of ``value`` sent in turn to the 50 partitions of ``t`` and flushed, through ``stream``."""

    async def main() -> None:
        producer = await producer_on(stream, **config)
        try:
            for i in range(records):
                producer.send("t", value, partition=i % 50)
            async with asyncio.timeout(10):
                await producer.flush()
        finally:
            await producer.close(timeout_s=1)

    asyncio.run(main())
    return stream


def test_packing_keeps_within_the_request_bounds() -> None:
    # the node's bound (7) is below the producer's own
    stream = sent_through(RecordingStream(batches_max=7), 300, b"v" * 100, max_request_bytes=2_000)
    assert len(sent_batches(stream)) >= 50
    assert all(len(r.batches) <= 7 for r in stream.written)
    sizes = [sum(len(b.batch) for b in r.batches) for r in stream.written]
    assert all(size <= 2_000 or len(r.batches) == 1 for size, r in zip(sizes, stream.written, strict=True))
    assert max(len(r.batches) for r in stream.written) > 1
    assert_sequences_in_order(stream)


def test_a_node_that_takes_one_batch_a_message_gets_one_batch_a_message() -> None:
    stream = sent_through(RecordingStream(batches_max=1), 100, b"v")
    assert stream.written and all(not r.batches and r.topic == "t" for r in stream.written)


def test_requests_in_flight_per_node_are_bounded() -> None:
    held = True

    async def main() -> RecordingStream:
        nonlocal held
        stream = RecordingStream(batches_max=3, answer=lambda: not held)
        producer = await producer_on(stream, max_in_flight_requests=2)
        try:
            futures = [producer.send("t", b"v", partition=i % 50) for i in range(200)]
            flush = asyncio.ensure_future(producer.flush())
            for _ in range(50):  # let the sender write all it may
                await asyncio.sleep(0.01)
            assert len(stream.written) == 2 and stream.most_unanswered == 2
            held = False
            stream.release()
            async with asyncio.timeout(10):
                await flush
            assert all(f.done() and not f.exception() for f in futures)
        finally:
            await producer.close(timeout_s=1)
        return stream

    stream = asyncio.run(main())
    assert stream.most_unanswered <= 2
    assert len(stream.written) > 2
    assert_sequences_in_order(stream)


def test_a_lingered_batch_keeps_taking_records_while_the_node_has_no_room() -> None:
    """Kafka's accumulator: a lingered batch stays open until its node has room in flight, so under load a batch
    holds what arrived meanwhile, not one record per linger (issue 22: at 10,000 partitions written in turn each
    batch held one record, and each costs the node, its replicas and the sender the same whatever it holds)."""
    held = True

    async def main() -> tuple[RecordingStream, list[asyncio.Future[Any]]]:
        nonlocal held
        stream = RecordingStream(batches_max=3, answer=lambda: not held)
        producer = await producer_on(stream, max_in_flight_requests=1)
        futures: list[asyncio.Future[Any]] = [producer.send("t", b"v", partition=0)]
        try:
            async with asyncio.timeout(10):  # the stream is open, its bounds known, its one request unanswered
                while not (stream.written and producer._routes[""].batches_max == 3):
                    await asyncio.sleep(0.01)
            for _round in range(5):  # one record to each partition per round, each round past the 1 ms linger
                futures += [producer.send("t", b"v", partition=p) for p in range(50)]
                for _ in range(5):
                    await asyncio.sleep(0.01)
            assert len(stream.written) == 1  # one request in flight, unanswered: no room for more
            held = False
            stream.release()
            async with asyncio.timeout(10):
                await producer.flush()
        finally:
            await producer.close(timeout_s=1)
        return stream, futures

    stream, futures = asyncio.run(main())
    assert all(f.done() and not f.exception() for f in futures)
    batches = sent_batches(stream)
    # After the first request's one batch, every partition's batch stayed open and took all 5 rounds (closed at
    # each linger, they were 5 one-record batches per partition: 251 in all).
    assert len(batches) == 1 + 50, len(batches)
    assert [parse_header(b.batch).records_count for b in batches[1:]] == [5] * 50
    assert_sequences_in_order(stream)


def test_a_batch_that_falls_due_while_the_sender_works_is_still_sent() -> None:
    """The race behind a CI hang (test_geo2_ack_survives_the_origin_killed_right_after_the_ack, 300 s): the sender
    closed what was due at the top of its loop, then, at the bottom, took a linger deadline that had passed in the
    meantime for one kept open for want of room, and waited for an answer that nothing was going to send. A
    preempted sender (here: 3 ms inside each pass, past the 1 ms linger) must still send each record awaited in
    turn."""

    async def main() -> None:
        producer = await producer_on(RecordingStream(batches_max=1000))
        check = producer._check_request_timeouts

        def preempted(now_ms: float) -> float | None:
            time.sleep(0.003)
            return check(now_ms)

        producer._check_request_timeouts = preempted  # type: ignore[method-assign]
        try:
            async with asyncio.timeout(10):
                for _ in range(20):
                    await producer.send("t", b"v", partition=0)
        finally:
            await producer.close(timeout_s=1)

    asyncio.run(main())


def test_request_bounds_must_be_positive() -> None:
    for name in ("max_in_flight_requests", "max_request_bytes", "max_request_batches"):
        with pytest.raises(InvalidRequest, match=name):
            Producer("127.0.0.1:1", **{name: 0})


def test_a_stream_broken_with_requests_packed_and_waiting_resends_everything_in_order() -> None:
    async def main() -> tuple[RecordingStream, RecordingStream]:
        first = RecordingStream(batches_max=4, answer=lambda: False)
        second = RecordingStream(batches_max=4)
        streams = iter([first, second])

        class Stub:
            def ProduceStream(self) -> RecordingStream:  # the gRPC method name
                return next(streams)

        async def connect(*_: object) -> Stub:
            return Stub()

        producer = Producer("127.0.0.1:1", linger_ms=1, max_in_flight_requests=2, retry_backoff_ms=1)
        producer._connection.connect = connect  # type: ignore[method-assign]
        producer._connection.reconnect = connect  # type: ignore[method-assign]
        await producer.start()
        producer._partition_counts["t"] = 50
        try:
            futures = [producer.send("t", b"v", partition=i % 50) for i in range(300)]
            flush = asyncio.ensure_future(producer.flush())
            async with asyncio.timeout(10):
                while len(first.written) < 2:  # two requests in flight, the rest taken and waiting, or queued
                    await asyncio.sleep(0.01)
            first.responses.put_nowait(grpc.aio.EOF)  # the node ends the stream: nothing was answered
            async with asyncio.timeout(10):
                await flush
            assert [f.result().offset for f in futures] == [i // 50 for i in range(300)]
        finally:
            await producer.close(timeout_s=1)
        return first, second

    first, second = asyncio.run(main())
    assert len(first.written) == 2
    assert_sequences_in_order(second)  # each partition from its first sequence, with no gap and no repeat
    assert len(sent_batches(second)) >= 50
