"""Issue 20's hostile producer, with real node processes, the CLI and Kafka clients: poison batches (item 3),
decompression bombs (item 4), a record stamped -2^63 (item 7, the origin's half) and a Kafka write to an internal
topic (item 12) are refused where they enter; a poison batch that a site stored before validation existed is
reported, skipped when asked and served past, and a lying upstream cannot make another site store it."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from georep.client.errors import InvalidRequest
from georep.client.producer import Producer
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.record.batch import REWRITTEN_BYTES, RecordInput, encode_batch, parse_header
from georep.server.process import NodeProcess
from georep.storage.api import LogConfig
from georep.storage.segment_log import SegmentLog
from offsets.coordinates import Origin
from tests.support.cli import georep, ok
from tests.support.forge import forge, record, zstd_bomb
from tests.support.kafka_nodes import KAFKA_ARGS, kafka_address
from tests.support.kafka_raw import (
    INVALID_RECORD,
    INVALID_TOPIC_EXCEPTION,
    MESSAGE_TOO_LARGE,
    kafka_batch,
    kafka_python_read,
    kafka_record,
    produce_raw,
    zstd_value_records,
)
from tests.support.node_api import stub_for
from tests.support.sites import Sites, wait_until
from topology.ids import SiteId

I64_MIN = -(2**63)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def produce_grpc(stub: pbg.NodeStub, batch: bytes, topic: str = "t") -> grpc.RpcError | pb.ProduceResponse:
    try:
        return stub.Produce(pb.ProduceRequest(topic=topic, partition=0, batch=batch), timeout=30)
    except grpc.RpcError as exc:
        return exc


def refusal(result: grpc.RpcError | pb.ProduceResponse) -> str:
    assert isinstance(result, grpc.RpcError), f"stored: {result}"
    assert result.code() is grpc.StatusCode.INVALID_ARGUMENT, (result.code(), result.details())
    return str(result.details())


def consume(address: str, *extra: str) -> tuple[int, list[bytes], str]:
    result = georep("consume", "t", "--from-beginning", "--timeout", "3", "--bootstrap", address, *extra, timeout=60)
    return result.returncode, result.stdout.splitlines(), result.stderr.decode()


def peak_rss_kib(node: NodeProcess) -> int:
    for line in Path(f"/proc/{node.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc/<pid>/status")


def metric(node: NodeProcess, name: str) -> float:
    text = urllib.request.urlopen(f"http://{node.metrics_address}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def log_end(stub: pbg.NodeStub, topic: str = "t") -> int:
    desc = stub.DescribeTopic(pb.DescribeTopicRequest(name=topic), timeout=5)
    return int(desc.partition_states[0].log_end_offset)


def origin_of(sites: Sites, site: str) -> Origin:
    (text,) = [o for o in sites.vectors(site, "t")[0] if o.startswith(f"{site}@")]
    return Origin(SiteId(site), int(text.split("@")[1]))


POISONS = {  # issue 20, item 3: each with a valid CRC
    "garbage records": (forge(b"\x13\x37" * 64, 1), "has length"),
    "codec id 7": (forge(record(b"poison"), 1, attributes=7), "unknown compression codec id 7"),
    "records_count 2^31-1": (forge(record(b"poison"), 2**31 - 1), "records_count 2147483647 cannot fit"),
}


@pytest.mark.slow
def test_poison_batches_are_refused_at_the_origin_and_every_site_reads_on(make_sites: Callable[..., Sites]) -> None:
    """Item 3: the poison batches never enter the log, so both sites keep serving every good record."""
    sites = make_sites(["x", "y"], [("x", "y"), ("y", "x")])
    sites.start()
    x = ("--bootstrap", sites.address("x"))
    ok(georep("topic", "create", "t", "--partitions", "1", *x))
    ok(georep("produce", "t", *x, stdin=b"good-1\n"))
    for name, (batch, reason) in POISONS.items():
        details = refusal(produce_grpc(sites.stub("x"), batch))
        assert "invalid batch for topic 't'" in details and reason in details and "Nothing was stored" in details, name
    ok(georep("produce", "t", *x, stdin=b"good-2\n"))
    assert log_end(sites.stub("x")) == 2  # not 2147483650
    wait_until(
        "y holds both good records",
        lambda: sites.vectors("y", "t") == sites.vectors("x", "t") and sum(sites.vectors("y", "t")[0].values()) == 2,
    )
    for site in ("x", "y"):
        for extra in ((), ("--skip-corrupt",)):
            code, lines, err = consume(sites.address(site), *extra)
            assert (code, lines) == (0, [b"good-1", b"good-2"]), err


def append_offline(node: NodeProcess, batches: list[bytes]) -> None:
    """Write stamped batches into the stopped node's log of t-0 as a build without validation stored them."""
    log = SegmentLog.open(node.data_dir / "logs" / "t-0", LogConfig(), now_ms=0)
    try:
        for batch in batches:
            log.append(parse_header(batch), [memoryview(batch)[REWRITTEN_BYTES:]], now_ms())
        log.flush()
    finally:
        log.close()


@pytest.mark.slow
def test_a_stored_poison_batch_is_reported_skipped_served_past_and_not_replicated(
    make_sites: Callable[..., Sites],
) -> None:
    """Item 3's readers: x holds good-1, the records_count 2^31-1 poison and good-2, stored as a site without
    validation would have. georep consume prints good-1 then says what to do; --skip-corrupt skips the poison
    and goes on; a Kafka client reads past it; y, pulling from x (a lying upstream), refuses it at apply and
    stores nothing of x after it."""
    sites = make_sites(["x", "y"], [("x", "y")], extra_args=KAFKA_ARGS)
    sites.start("x")
    x_node = sites.nodes["x"]
    ok(georep("topic", "create", "t", "--partitions", "1", "--bootstrap", sites.address("x")))
    ok(georep("produce", "t", "--bootstrap", sites.address("x"), stdin=b"good-1\n"))
    origin = origin_of(sites, "x")
    x_node.stop()
    poison = forge(record(b"poison"), 2**31 - 1, site=origin.site.encode(), epoch=origin.epoch, seq=1)
    good = encode_batch([RecordInput(None, b"good-2", (), now_ms())], origin=origin, base_origin_seq=2**31)
    append_offline(x_node, [poison, good])
    x_node.start()
    sites.start("y")

    code, lines, err = consume(sites.address("x"))
    assert code == 1 and lines == [b"good-1"], (code, lines, err)
    assert "invalid batch at t/0 offsets 1..2147483647" in err and "records_count 2147483647" in err
    assert "--skip-corrupt" in err
    code, lines, err = consume(sites.address("x"), "--skip-corrupt")
    assert (code, lines) == (0, [b"good-1", b"good-2"]), err
    assert "skipped invalid records of t/0, offsets 1..2147483647" in err and "skipped 1 invalid batch(es)" in err

    assert kafka_python_read(kafka_address(x_node), "t") == [b"good-1", b"good-2"]
    assert (
        "offsets 1..2147483647 is invalid and was served to Kafka clients as an empty batch"
        in (x_node.data_dir / "node.log").read_text()
    )

    def refused_at_y() -> bool:
        links = sites.status("y").links
        return bool(links) and "InvalidChunk" in links[0].last_error

    wait_until("y's link from x shows the refusal", refused_at_y)
    error = sites.status("y").links[0].last_error
    said = f"t-0: replicated batch of origin {origin} origin seqs 1..2147483647 is invalid"
    assert said in error and "records_count 2147483647 cannot fit" in error, error
    assert sites.vectors("y", "t") == {0: {str(origin): 1}}  # good-1 only: nothing of x after the poison
    sent = metric(x_node, "georep_replication_sent_bytes")
    wait_until(
        "x sent the poison to y three more times",
        lambda: metric(x_node, "georep_replication_sent_bytes") >= sent + 3 * len(poison),
    )
    y_log = (sites.nodes["y"].data_dir / "node.log").read_text()
    assert y_log.count(f"link x -> y down: InvalidChunk: {said}") == 1  # once, however often the pull is retried
    code, lines, err = consume(sites.address("y"))
    assert (code, lines) == (0, [b"good-1"]), err


def test_decompression_bombs_are_refused_by_a_topic_of_8_mib(start_node) -> None:  # type: ignore[no-untyped-def]
    """Item 4: a 32 KB zstd batch holding a 1 GiB record over gRPC, and a 900 MB zstd value through the Kafka
    port, are refused without the node's memory growing toward them."""
    node: NodeProcess = start_node(extra_args=KAFKA_ARGS)
    channel, stub = stub_for(node)
    try:
        stub.CreateTopic(pb.CreateTopicRequest(name="t", partitions=1))
        before = peak_rss_kib(node)
        bomb = forge(zstd_bomb(1 << 30), 1, attributes=1)
        assert len(bomb) < 40_000
        details = refusal(produce_grpc(stub, bomb))
        assert "decompress to more than max_batch_bytes=8388608 of topic 't'" in details, details
        records = zstd_value_records(900_000_000)
        assert len(records) < 40_000
        code, message = produce_raw(kafka_address(node), "t", 0, kafka_batch(records, 1, attributes=4))
        assert code in (MESSAGE_TOO_LARGE, INVALID_RECORD) and "max_batch_bytes" in message, (code, message)
        grown_mib = (peak_rss_kib(node) - before) // 1024
        assert grown_mib < 100, f"the node's peak memory grew by {grown_mib} MiB"
        assert log_end(stub) == 0
    finally:
        channel.close()


def test_a_record_stamped_minus_2_pow_63_is_refused_at_the_origin(start_node) -> None:  # type: ignore[no-untyped-def]
    """Item 7, the origin's half: the record never enters the log, through georep's client or the Kafka port."""
    node: NodeProcess = start_node(extra_args=KAFKA_ARGS)
    ok(georep("topic", "create", "t", "--partitions", "1", "--bootstrap", node.address))

    async def send() -> BaseException | None:
        async with Producer(node.address, linger_ms=0) as producer:
            future = producer.send("t", b"v", partition=0, timestamp_ms=I64_MIN)
            await producer.flush()
            return future.exception()

    error = asyncio.run(send())
    assert isinstance(error, InvalidRequest), error
    assert f"negative timestamp in the batch header: first_timestamp {I64_MIN}" in str(error)
    batch = kafka_batch(kafka_record(b"v"), 1, first_ts=I64_MIN)
    code, message = produce_raw(kafka_address(node), "t", 0, batch)
    assert code == INVALID_RECORD and "negative timestamp" in message, (code, message)
    channel, stub = stub_for(node)
    try:
        assert log_end(stub) == 0
    finally:
        channel.close()


def test_a_kafka_write_to_an_internal_topic_is_refused_by_the_broker(start_node) -> None:  # type: ignore[no-untyped-def]
    """Item 12: a raw Kafka Produce to __georep_offsets (which needs no metadata) meets the broker's rule, as a
    gRPC Produce does; the group coordinator's own commits still go in."""
    node: NodeProcess = start_node(extra_args=KAFKA_ARGS)
    b = ("--bootstrap", node.address)
    ok(georep("topic", "create", "t", "--partitions", "1", *b))
    ok(georep("produce", "t", *b, stdin=b"one\n"))
    ok(georep("consume", "t", "--group", "g", "--from-beginning", "--max", "1", *b))  # creates __georep_offsets
    channel, stub = stub_for(node)
    try:
        commits = sum(
            ps.log_end_offset
            for ps in stub.DescribeTopic(pb.DescribeTopicRequest(name="__georep_offsets"), timeout=5).partition_states
        )
        assert commits >= 1
        forged = kafka_batch(kafka_record(b'{"forged": true}', key=b"g"), 1, first_ts=now_ms())
        for partition in range(
            len(stub.DescribeTopic(pb.DescribeTopicRequest(name="__georep_offsets"), timeout=5).partition_states)
        ):
            code, message = produce_raw(kafka_address(node), "__georep_offsets", partition, forged)
            assert code == INVALID_TOPIC_EXCEPTION and "internal to georep" in message, (code, message)
        georep_batch = encode_batch([RecordInput(b"g", b'{"forged": true}', (), now_ms())])
        assert "internal to georep" in refusal(produce_grpc(stub, georep_batch, "__georep_offsets"))
        ok(georep("produce", "t", *b, stdin=b"two\n"))
        out = ok(georep("consume", "t", "--group", "g", "--max", "1", "--timeout", "10", *b))
        assert out.splitlines() == ["two"]  # the group's first commit held, and its next one went in
        after = sum(
            ps.log_end_offset
            for ps in stub.DescribeTopic(pb.DescribeTopicRequest(name="__georep_offsets"), timeout=5).partition_states
        )
        assert after > commits
    finally:
        channel.close()
