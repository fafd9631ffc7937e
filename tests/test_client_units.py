"""Pure pieces of the client, without a server: partitioner, accumulator, delivery, decoding, errors."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from georep.client.accumulator import BatchState, RecordAccumulator, record_size
from georep.client.connection import parse_bootstrap
from georep.client.consumer import decode_response
from georep.client.delivery import SEQUENCE_MODULUS, PartitionDelivery
from georep.client.errors import (
    BatchTooLarge,
    InvalidRequest,
    NodeUnavailable,
    Operation,
    OutOfOrderSequence,
    ProducerFenced,
    UnknownTopic,
    from_produce_error,
    from_status,
)
from georep.client.partitioner import StickyPartitioner, key_partition
from georep.client.producer import Producer, parse_acks
from georep.proto import georep_pb2
from georep.record.batch import RecordInput, encode_batch, local_prefix, parse_header, stamp_origin
from offsets.coordinates import Origin
from offsets.vector import VectorOffset
from topology.ids import SiteId

LIMIT = 8 << 20  # a topic's max_batch_bytes


def rec(value: bytes, key: bytes | None = None) -> RecordInput:
    return RecordInput(key, value, (), 1000)


# --- partitioner -----------------------------------------------------------------


def test_key_partition_is_crc32c_mod_partitions() -> None:
    # crc32c(b"123456789") is the CRC-32C check value 0xE3069283.
    assert key_partition(b"123456789", 1 << 32) == 0xE3069283
    assert key_partition(b"123456789", 7) == 0xE3069283 % 7
    assert key_partition(b"", 5) == 0


def test_key_partition_is_stable_and_spreads() -> None:
    keys = [f"user-{i}".encode() for i in range(1000)]
    first = [key_partition(k, 8) for k in keys]
    assert first == [key_partition(k, 8) for k in keys]
    counts = [first.count(p) for p in range(8)]
    assert min(counts) > 80, counts


def test_sticky_partitioner_moves_round_robin_when_its_batch_closes() -> None:
    sticky = StickyPartitioner(start=1)
    assert sticky.partition("t", 3) == 1
    sticky.on_batch_closed("t", 0, 3)  # not the sticky one: no move
    assert sticky.partition("t", 3) == 1
    sticky.on_batch_closed("t", 1, 3)
    assert sticky.partition("t", 3) == 2
    sticky.on_batch_closed("t", 2, 3)
    assert sticky.partition("t", 3) == 0


# --- accumulator -----------------------------------------------------------------


def test_accumulator_closes_a_batch_when_the_next_record_would_overflow() -> None:
    size = record_size(None, b"x" * 100, ())
    acc = RecordAccumulator(batch_size=109 + 3 * size, linger_ms=5)
    opened = [acc.append("t", 0, rec(b"x" * 100), object(), size, now_ms=0, max_batch_bytes=LIMIT) for _ in range(7)]
    assert [o is not None for o in opened] == [True, False, False, True, False, False, True]
    closed = acc.take_closed()
    assert [len(b.records) for b in closed] == [3, 3]
    assert all(b.state is BatchState.QUEUED for b in closed)
    assert len(acc.open[("t", 0)].records) == 1


def test_accumulator_oversized_record_gets_its_own_batch() -> None:
    acc = RecordAccumulator(batch_size=200, linger_ms=5)
    acc.append("t", 0, rec(b"a"), None, 30, 0, max_batch_bytes=LIMIT)
    acc.append("t", 0, rec(b"b" * 1000), None, 1030, 0, max_batch_bytes=LIMIT)
    acc.append("t", 0, rec(b"c"), None, 30, 0, max_batch_bytes=LIMIT)
    assert [len(b.records) for b in acc.take_closed()] == [1, 1]


def test_accumulator_keeps_batches_within_the_topics_max_batch_bytes_when_it_is_below_batch_size() -> None:
    acc = RecordAccumulator(batch_size=1 << 20, linger_ms=5)
    size = record_size(None, b"x" * 100, ())
    for _ in range(5):
        acc.append("t", 0, rec(b"x" * 100), None, size, 0, max_batch_bytes=109 + 2 * size)
    assert [len(b.records) for b in acc.take_closed()] == [2, 2]
    assert [b.partition for b in acc.close_lingered(0)] == []  # one record open: room for another
    acc.append("t", 0, rec(b"x" * 100), None, size, 0, max_batch_bytes=109 + 2 * size)
    assert [len(b.records) for b in acc.close_lingered(0)] == [2]  # full: closed without waiting for linger


def test_accumulator_linger() -> None:
    acc = RecordAccumulator(batch_size=1 << 20, linger_ms=5)
    acc.append("t", 0, rec(b"a"), None, 30, now_ms=100, max_batch_bytes=LIMIT)
    acc.append("t", 1, rec(b"b"), None, 30, now_ms=102, max_batch_bytes=LIMIT)
    assert acc.next_linger_deadline_ms() == 105
    assert acc.close_lingered(104) == []
    assert [b.partition for b in acc.close_lingered(105)] == [0]
    assert acc.next_linger_deadline_ms() == 107
    assert [b.partition for b in acc.close_lingered(105, force=True)] == [1]
    assert acc.next_linger_deadline_ms() is None
    assert [b.partition for b in acc.take_closed()] == [0, 1]


def test_record_size_matches_the_encoding() -> None:
    records = [RecordInput(b"key", b"value" * 10, (("h", b"v"), ("n", None)), 5), RecordInput(None, None, (), 5)]
    body = len(encode_batch(records)) - 109
    assert body == sum(record_size(r.key, r.value, r.headers) for r in records)


# --- delivery (idempotent sequencing and retries) --------------------------------


def batches(n: int, records: int = 2) -> list:
    acc = RecordAccumulator(batch_size=109 + records * 1000, linger_ms=0)
    for i in range(n * records):
        acc.append("t", 0, rec(b"%d" % i), None, 1000, 0, max_batch_bytes=LIMIT)
    acc.close_lingered(0, force=True)
    return acc.take_closed()


def test_delivery_assigns_sequences_and_limits_in_flight() -> None:
    d = PartitionDelivery("t", 0, producer_id=7, max_in_flight=5)
    for b in batches(7, records=1):
        d.enqueue(b)
    sent = d.take_sendable()
    assert [b.base_sequence for b in sent] == [0, 1, 2, 3, 4]
    assert d.take_sendable() == []
    d.on_success(sent[0])
    more = d.take_sendable()
    assert [b.base_sequence for b in more] == [5]


def test_delivery_sequence_wraps_at_2_31() -> None:
    d = PartitionDelivery("t", 0, 7, 5)
    d.next_sequence = SEQUENCE_MODULUS - 1
    for b in batches(2):
        d.enqueue(b)
    assert [b.base_sequence for b in d.take_sendable()] == [SEQUENCE_MODULUS - 1, 1]


def test_broken_stream_resends_unanswered_batches_in_order_with_same_bytes() -> None:
    d = PartitionDelivery("t", 0, 7, 5)
    for b in batches(4):
        d.enqueue(b)
    sent = d.take_sendable()
    for b in sent:
        b.data = b"bytes-%d" % b.base_sequence
    d.on_success(sent[0])
    d.on_stream_broken()
    assert d.round_complete()
    assert d.resolve(fresh_producer_id=99) == []
    again = d.take_sendable()
    assert again == sent[1:]
    assert [(b.producer_id, b.base_sequence, b.data) for b in again] == [
        (7, 2, b"bytes-2"),
        (7, 4, b"bytes-4"),
        (7, 6, b"bytes-6"),
    ]


def test_out_of_order_after_a_retriable_error_is_resent() -> None:
    d = PartitionDelivery("t", 0, 7, 5)
    for b in batches(3):
        d.enqueue(b)
    a, b, c = d.take_sendable()
    d.on_out_of_order(b, OutOfOrderSequence("gap"))  # answers may arrive out of order
    assert not d.round_complete()
    d.on_retriable(a)
    d.on_out_of_order(c, OutOfOrderSequence("gap"))
    assert d.resolve(99) == []
    assert [(x.producer_id, x.base_sequence) for x in d.take_sendable()] == [(7, 0), (7, 2), (7, 4)]


def test_permanent_failure_moves_later_batches_to_a_fresh_producer_id() -> None:
    d = PartitionDelivery("t", 0, 7, 5)
    for b in batches(4):
        d.enqueue(b)
    a, b, c, e = d.take_sendable()
    for x in (a, b, c, e):
        x.data = b"old"
    d.on_success(a)
    d.on_failed(b, BatchTooLarge("too big"))
    d.on_out_of_order(c, OutOfOrderSequence("gap"))
    d.on_out_of_order(e, OutOfOrderSequence("gap"))
    assert d.resolve(99) == []
    again = d.take_sendable()
    assert again == [c, e]
    assert [(x.producer_id, x.base_sequence, x.data) for x in again] == [(99, 0, None), (99, 2, None)]
    assert d.next_sequence == 4


def test_out_of_order_with_nothing_wrong_before_fails_that_batch() -> None:
    d = PartitionDelivery("t", 0, 7, 5)
    for b in batches(2):
        d.enqueue(b)
    a, b = d.take_sendable()
    d.on_out_of_order(a, OutOfOrderSequence("node lost data"))
    d.on_out_of_order(b, OutOfOrderSequence("gap"))
    assert d.resolve(99) == [a]
    assert d.take_sendable() == [b]
    assert (b.producer_id, b.base_sequence) == (99, 0)


def test_expiry_of_sent_batches_takes_all_of_them_and_resets_the_producer_id() -> None:
    d = PartitionDelivery("t", 0, 7, 2)
    bs = batches(3)
    for b in bs:
        d.enqueue(b)
    d.take_sendable()
    d.on_stream_broken()
    d.resolve(98)
    assert d.expire(now_ms=100, delivery_timeout_ms=1000, fresh_producer_id=99) == []
    bs[2].created_ms = 500
    expired = d.expire(now_ms=1000, delivery_timeout_ms=1000, fresh_producer_id=99)
    assert expired == bs[:2]
    assert d.take_sendable() == [bs[2]]
    assert (bs[2].producer_id, bs[2].base_sequence) == (99, 0)


# --- decoding fetch responses ------------------------------------------------------


def stored(records: list[RecordInput], base_offset: int, origin: Origin, base_seq: int) -> bytes:
    """A batch as a node serves it: origin stamped, local prefix written."""
    batch = encode_batch(records)
    head, crc = stamp_origin(batch, origin, base_seq)
    header = parse_header(head + batch[109:])
    return local_prefix(base_offset, header.batch_length, 0, crc) + head[24:] + batch[109:]


def test_decode_drops_records_below_position_and_covered_by_vector() -> None:
    a, b = Origin(SiteId("a"), 1), Origin(SiteId("b"), 2)
    buf = stored([rec(b"a0"), rec(b"a1"), rec(b"a2")], 10, a, 0) + stored([rec(b"b0"), rec(b"b1")], 13, b, 5)
    values = [r.value for r in decode_response("t", 0, buf, -1, None)]
    assert values == [b"a0", b"a1", b"a2", b"b0", b"b1"]
    assert [r.value for r in decode_response("t", 0, buf, 11, None)] == [b"a1", b"a2", b"b0", b"b1"]
    vector = VectorOffset({a: 2, b: 7})
    got = decode_response("t", 0, buf, -1, vector)
    assert [(r.value, r.offset, r.origin, r.origin_seq) for r in got] == [(b"a2", 12, a, 2)]


def test_decode_rejects_a_corrupt_batch() -> None:
    buf = bytearray(stored([rec(b"hello")], 0, Origin(SiteId("a"), 1), 0))
    buf[-1] ^= 0xFF
    with pytest.raises(ValueError, match="CRC"):
        decode_response("t", 0, bytes(buf), -1, None)


# --- errors, acks, bootstrap --------------------------------------------------------


def test_status_codes_map_to_exceptions() -> None:
    produce, code = Operation.PRODUCE, grpc.StatusCode
    assert isinstance(from_status(produce, code.NOT_FOUND, "unknown topic 'x'", "unknown-topic"), UnknownTopic)
    assert isinstance(from_status(produce, code.INVALID_ARGUMENT, "bad name", "invalid-request"), InvalidRequest)
    too_big = from_status(
        produce, code.INVALID_ARGUMENT, "batch of 9 bytes exceeds max_batch_bytes=8", "batch-too-large"
    )
    assert isinstance(too_big, BatchTooLarge)
    fenced = from_status(produce, code.FAILED_PRECONDITION, "producer 1 is fenced", "producer-fenced")
    assert isinstance(fenced, ProducerFenced)
    gap = from_status(produce, code.FAILED_PRECONDITION, "expected sequence 5", "out-of-order-sequence")
    assert isinstance(gap, OutOfOrderSequence)
    unavailable = from_status(produce, code.UNAVAILABLE, "", address="h:1")  # gRPC's own: no reason
    assert isinstance(unavailable, NodeUnavailable) and unavailable.retriable
    error = georep_pb2.Error(code=code.NOT_FOUND.value[0], message="unknown topic 'x'", reason="unknown-topic")
    assert isinstance(from_produce_error(error), UnknownTopic)


def test_parse_acks() -> None:
    assert parse_acks("leader") == (georep_pb2.ACKS_LEADER, 0)
    assert parse_acks("all") == (georep_pb2.ACKS_ALL, 0)
    assert parse_acks("geo:2") == (georep_pb2.ACKS_GEO, 2)
    with pytest.raises(InvalidRequest, match="geo:N"):
        parse_acks("geo:0")


def test_parse_bootstrap() -> None:
    assert parse_bootstrap("h1:1, h2:2") == ["h1:1", "h2:2"]
    with pytest.raises(InvalidRequest, match="HOST:PORT"):
        parse_bootstrap("nohost")
    with pytest.raises(InvalidRequest, match="empty"):
        parse_bootstrap(" , ")


# --- producer sender vs a stream that breaks during a write ---------------------------


class StallingStream:
    """A ``ProduceStream`` call that behaves as grpc.aio does when its writes stall.

    With ``stall`` every ``write`` blocks (HTTP/2 flow control) until ``cancel()``,
    and then raises ``asyncio.CancelledError``: that is what grpc.aio's ``write``
    raises when the call is cancelled locally while the write is pending.
    Without ``stall`` every write is answered at once with a success.
    """

    def __init__(self, stall: bool) -> None:
        self.stall = stall
        self.writing = asyncio.Event()
        self.responses: asyncio.Queue[Any] = asyncio.Queue()
        self.cancelled = asyncio.Event()
        self.written = 0  # records answered

    async def write(self, request: georep_pb2.ProduceRequest) -> None:
        if self.cancelled.is_set():
            raise asyncio.InvalidStateError("RPC already finished")
        if self.stall:
            self.writing.set()
            await self.cancelled.wait()
            raise asyncio.CancelledError()
        count = parse_header(request.batch).records_count
        self.responses.put_nowait(
            georep_pb2.ProduceResponse(
                correlation_id=request.correlation_id,
                partition=request.partition,
                base_offset=self.written,
                origin_site="a",
                origin_epoch=1,
                base_origin_seq=self.written,
                last_origin_seq=self.written + count - 1,
            )
        )
        self.written += count

    async def initial_metadata(self) -> Any:
        return ()  # a node that takes one batch a message

    async def read(self) -> Any:
        return await self.responses.get()

    def cancel(self) -> bool:
        self.cancelled.set()
        return True


def test_stream_broken_by_the_reader_during_a_write_does_not_kill_the_sender() -> None:
    # grpc.aio raises CancelledError out of a pending write() when the call is
    # cancelled locally (_close_stream() cancels it). With grpc the reader only
    # sees the end of a call that is already done, so that cancel is a no-op
    # today; the fake cancels anyway, to pin the sender's handling: a broken
    # stream to resend on, not a reason to die quietly and leave flush() and
    # every future waiting forever.
    async def main() -> None:
        streams = [StallingStream(stall=True), StallingStream(stall=False)]
        opened: list[StallingStream] = []

        class Stub:
            def ProduceStream(self) -> StallingStream:  # the gRPC method name
                opened.append(streams[len(opened)])
                return opened[-1]

        async def connect(*_: object) -> Stub:
            return Stub()

        producer = Producer("127.0.0.1:1", batch_size=1024, linger_ms=1, retry_backoff_ms=1)
        producer._connection.connect = connect  # type: ignore[method-assign]
        producer._connection.reconnect = connect  # type: ignore[method-assign]
        await producer.start()
        producer._partition_counts["t"] = 1
        futures = [producer.send("t", b"v" * 100) for _ in range(20)]
        flush = asyncio.ensure_future(producer.flush())
        async with asyncio.timeout(5):
            await streams[0].writing.wait()
        streams[0].responses.put_nowait(grpc.aio.EOF)  # the node ends the stream
        try:
            async with asyncio.timeout(5):
                await flush
            results = await asyncio.gather(*futures)
            assert [r.offset for r in results] == list(range(20))  # resent in order, each record once
            assert len(opened) == 2
            assert not producer._sender.done()  # type: ignore[union-attr]
        finally:
            await producer.close(timeout_s=1)

    asyncio.run(main())


def test_an_out_of_order_sequence_is_not_taken_for_a_fenced_producer() -> None:
    """Both messages name the producer and its epoch; only a fenced producer must stop. An out-of-order answer
    after a batch lost in flight (a segment cut at a roll) is resent with the round. The node's reason tells them
    apart, not the message."""
    from dedup.producer import OutOfOrderSequence as Gap
    from dedup.producer import ProducerFenced as Zombie
    from georep.broker.errors import SequenceRejected
    from georep.client.errors import OutOfOrderSequence, ProducerFenced
    from georep.server.status import wire_status

    def seen(decision: Gap | Zombie) -> object:
        code, reason = wire_status(SequenceRejected(decision)) or (grpc.StatusCode.INTERNAL, "")
        return from_status(Operation.PRODUCE, code, decision.message(), reason)

    assert isinstance(seen(Gap(expected=12_703, got=12_706, producer_id=7, producer_epoch=0)), OutOfOrderSequence)
    assert isinstance(seen(Zombie(current_epoch=3, got=2, producer_id=7)), ProducerFenced)
