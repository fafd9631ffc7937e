"""A real ``georep node`` process, driven over raw gRPC: bad input, idempotence, metrics."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from georep.client.errors import BatchTooLarge, Operation, from_status
from georep.metadata.topics import MAX_BATCH_BYTES_LIMIT
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.record.batch import check_batch, decode_records, iter_headers
from georep.server.process import NODE_INFO, NodeProcess
from tests.support.channels import open_channel
from tests.support.node_api import batch, expect_error, fetch_all, log_end, stub_for


def test_produce_assigns_coordinates_and_fetch_returns_verbatim_batches(api: pbg.NodeStub, node: NodeProcess) -> None:
    first = api.Produce(pb.ProduceRequest(topic="t", partition=0, batch=batch(3)))
    second = api.Produce(pb.ProduceRequest(topic="t", partition=0, batch=batch(2)))
    assert (first.base_offset, first.base_origin_seq, first.last_origin_seq) == (0, 0, 2)
    assert (second.base_offset, second.base_origin_seq, second.last_origin_seq) == (3, 3, 4)
    health = api.Health(pb.HealthRequest())
    assert (first.origin_site, first.origin_epoch) == ("a", health.epoch)
    data = fetch_all(api, "t", 0, 5)
    headers = iter_headers(data, verify=True)
    assert [h.base_offset for h in headers] == [0, 3]
    records = [
        r
        for h, pos in zip(headers, [0, headers[0].size_bytes], strict=True)
        for r in decode_records(data[pos : pos + h.size_bytes])
    ]
    assert [(r.offset, r.origin_seq, r.key) for r in records] == [
        (0, 0, b"k0"),
        (1, 1, b"k1"),
        (2, 2, b"k2"),
        (3, 3, b"k0"),
        (4, 4, b"k1"),
    ]
    assert {str(r.origin) for r in records} == {f"a@{health.epoch}"}


def test_unknown_topic_and_partition(api: pbg.NodeStub) -> None:
    msg = expect_error(grpc.StatusCode.NOT_FOUND, api.Produce, pb.ProduceRequest(topic="nope", batch=batch()))
    assert "georep topic create nope" in msg
    expect_error(grpc.StatusCode.NOT_FOUND, api.DescribeTopic, pb.DescribeTopicRequest(name="nope"))
    msg = expect_error(grpc.StatusCode.NOT_FOUND, api.Produce, pb.ProduceRequest(topic="t", partition=2, batch=batch()))
    assert "0..1" in msg
    stream = api.Fetch(pb.FetchRequest(topic="nope", partition=0, offset=0))
    expect_error(grpc.StatusCode.NOT_FOUND, lambda: next(stream))


@pytest.mark.parametrize(
    ("name", "partitions", "fragment"),
    [
        ("bad name", 1, "invalid topic name"),
        ("a//b", 1, "invalid topic name"),
        ("", 1, "empty"),
        ("x" * 300, 1, "limit"),
        ("ok", 0, "partition count"),
        ("ok", 100_000, "partition count"),
    ],
)
def test_invalid_topics_are_refused_and_leave_nothing(
    api: pbg.NodeStub, name: str, partitions: int, fragment: str
) -> None:
    msg = expect_error(
        grpc.StatusCode.INVALID_ARGUMENT, api.CreateTopic, pb.CreateTopicRequest(name=name, partitions=partitions)
    )
    assert fragment in msg
    assert [t.name for t in api.ListTopics(pb.ListTopicsRequest()).topics] == ["__georep_offsets", "t"]


def test_unknown_config_key_is_refused(api: pbg.NodeStub) -> None:
    msg = expect_error(
        grpc.StatusCode.INVALID_ARGUMENT,
        api.CreateTopic,
        pb.CreateTopicRequest(name="c", partitions=1, config={"retention.ms": "5"}),
    )
    assert "retention_ms" in msg  # names the keys that do exist


def test_existing_topic(api: pbg.NodeStub) -> None:
    expect_error(grpc.StatusCode.ALREADY_EXISTS, api.CreateTopic, pb.CreateTopicRequest(name="t", partitions=2))


def test_oversized_batch_is_refused_and_nothing_is_stored(start_node) -> None:  # type: ignore[no-untyped-def]
    node = start_node(extra_args=["--max-batch-bytes", "65536"])
    channel, stub = stub_for(node)
    stub.CreateTopic(pb.CreateTopicRequest(name="t", partitions=1))
    msg = expect_error(
        grpc.StatusCode.INVALID_ARGUMENT, stub.Produce, pb.ProduceRequest(topic="t", batch=batch(100, value_bytes=1024))
    )
    assert "max_batch_bytes=65536" in msg
    assert log_end(stub, "t", 0) == 0
    channel.close()


def test_a_message_over_the_grpc_limit_is_refused_and_the_node_stays_up(api: pbg.NodeStub) -> None:
    huge = pb.ProduceRequest(topic="t", partition=0, batch=bytes(MAX_BATCH_BYTES_LIMIT + (2 << 20)))
    details = expect_error(grpc.StatusCode.RESOURCE_EXHAUSTED, api.Produce, huge)
    # the client's meaning for it: too large, never "node unavailable"
    error = from_status(Operation.PRODUCE, grpc.StatusCode.RESOURCE_EXHAUSTED, details)  # gRPC's own: no reason
    assert isinstance(error, BatchTooLarge) and "send smaller batches" in str(error)
    api.Produce(pb.ProduceRequest(topic="t", partition=0, batch=batch()))
    assert log_end(api, "t", 0) == 3


def test_topic_and_node_limits_above_the_maximum_are_refused(api: pbg.NodeStub, tmp_path: Path) -> None:
    config = {"max_batch_bytes": str(MAX_BATCH_BYTES_LIMIT + 1)}
    details = expect_error(
        grpc.StatusCode.INVALID_ARGUMENT,
        api.CreateTopic,
        pb.CreateTopicRequest(name="big", partitions=1, config=config),
    )
    assert f"above the maximum {MAX_BATCH_BYTES_LIMIT}" in details
    flags = NodeProcess(site="a", data_dir=tmp_path / "n", extra_args=["--max-batch-bytes", str(1 << 30)])
    proc = subprocess.run(flags.command(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--max-batch-bytes" in proc.stderr and "above the maximum" in proc.stderr


def test_corrupt_crc_is_refused_and_nothing_is_stored(api: pbg.NodeStub) -> None:
    good = bytearray(batch(3))
    good[-20] ^= 0xFF  # inside a record value
    msg = expect_error(grpc.StatusCode.DATA_LOSS, api.Produce, pb.ProduceRequest(topic="t", batch=bytes(good)))
    assert "CRC" in msg
    assert log_end(api, "t", 0) == 0


def test_malformed_requests(api: pbg.NodeStub, node: NodeProcess) -> None:
    channel = open_channel(node.address)
    raw = channel.unary_unary("/georep.v1.Node/Produce")
    msg = expect_error(grpc.StatusCode.INVALID_ARGUMENT, raw, b"\xff\xff\xff\xff")
    assert "malformed ProduceRequest" in msg
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, api.Produce, pb.ProduceRequest(topic="t", batch=b"short"))
    two = batch(1) + batch(1)
    msg = expect_error(grpc.StatusCode.INVALID_ARGUMENT, api.Produce, pb.ProduceRequest(topic="t", batch=two))
    assert "one batch per request" in msg
    stamped = bytes(check_batch_and_stamp(batch(1)))
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, api.Produce, pb.ProduceRequest(topic="t", batch=stamped))
    assert log_end(api, "t", 0) == 0
    channel.close()


def check_batch_and_stamp(data: bytes) -> bytes:
    from georep.record.batch import HEADER_BYTES, stamp_origin
    from offsets.coordinates import Origin
    from topology.ids import SiteId

    head, _ = stamp_origin(data, Origin(SiteId("zz"), 1), 0)
    out = head + data[HEADER_BYTES:]
    check_batch(out)
    return out


def test_fetch_out_of_range_names_the_valid_range(api: pbg.NodeStub) -> None:
    api.Produce(pb.ProduceRequest(topic="t", partition=0, batch=batch(3)))
    stream = api.Fetch(pb.FetchRequest(topic="t", partition=0, offset=50))
    msg = expect_error(grpc.StatusCode.OUT_OF_RANGE, lambda: next(stream))
    assert "[0, 3]" in msg


def test_an_idle_fetch_answers_after_max_wait_then_less_and_less_often(api: pbg.NodeStub) -> None:
    """An idle stream answers (empty) after max_wait_ms, as Kafka's fetch does, then twice as late each time: a
    consumer of 10,000 quiet partitions must not wake its node 20,000 times a second. 50 ms answered every time is
    about 40 answers in 2 s; doubled, at most 6 (fewer on a loaded machine, never more). Then a record comes at
    once, and the next idle answer is after max_wait again."""
    api.CreateTopic(pb.CreateTopicRequest(name="idle", partitions=1))
    stream = api.Fetch(pb.FetchRequest(topic="idle", partition=0, offset=0, max_wait_ms=50), timeout=60)
    start = time.monotonic()
    empties = 0
    for response in stream:
        assert response.batches == b""
        empties += 1
        if time.monotonic() - start > 2.0:
            break
    assert 1 <= empties <= 6, empties
    api.Produce(pb.ProduceRequest(topic="idle", partition=0, batch=batch(1)))
    assert next(stream).batches != b""
    stream.cancel()


def test_geo_acks_without_links_are_refused(api: pbg.NodeStub) -> None:
    msg = expect_error(
        grpc.StatusCode.FAILED_PRECONDITION,
        api.Produce,
        pb.ProduceRequest(topic="t", batch=batch(), acks=pb.ACKS_GEO, geo_sites=2),
    )
    assert "acks=geo:2" in msg
    assert log_end(api, "t", 0) == 0


def test_retried_batch_is_stored_once_even_across_kill9(api: pbg.NodeStub, node: NodeProcess) -> None:
    b0 = batch(3, pid=42, seq=0)
    b1 = batch(2, pid=42, seq=3)
    first = api.Produce(pb.ProduceRequest(topic="t", batch=b0))
    again = api.Produce(pb.ProduceRequest(topic="t", batch=b0))
    assert again.duplicate and (again.base_offset, again.base_origin_seq) == (first.base_offset, 0)
    api.Produce(pb.ProduceRequest(topic="t", batch=b1))
    gap = batch(1, pid=42, seq=9)
    msg = expect_error(grpc.StatusCode.FAILED_PRECONDITION, api.Produce, pb.ProduceRequest(topic="t", batch=gap))
    assert "expected 5" in msg
    node.kill9()
    node.start()
    channel, stub = stub_for(node)
    retry = stub.Produce(pb.ProduceRequest(topic="t", batch=b1))
    assert retry.duplicate and retry.base_offset == 3
    assert log_end(stub, "t", 0) == 5
    channel.close()


def test_metrics_endpoint(api: pbg.NodeStub, node: NodeProcess) -> None:
    api.Produce(pb.ProduceRequest(topic="t", partition=1, batch=batch(4)))
    text = urllib.request.urlopen(f"http://{node.metrics_address}/metrics", timeout=10).read().decode()
    assert 'georep_produced_records_total{topic="t"} 4.0' in text
    assert 'georep_topic_log_end_offset{topic="t"} 4.0' in text  # summed per topic (issue 22)
    assert "georep_partition_log_end_offset" not in text  # per partition only with --metrics-partition-detail
    # Garbage collection pauses, and the objects frozen out of them once the node serves (georep/node/gc_pauses.py)
    assert 'georep_gc_pause_seconds_total{generation="2"}' in text
    frozen = re.search(r"^georep_gc_frozen_objects (\S+)$", text, re.MULTILINE)
    assert frozen is not None and float(frozen.group(1)) > 10_000


def test_sigterm_shuts_down_cleanly(api: pbg.NodeStub, node: NodeProcess) -> None:
    api.Produce(pb.ProduceRequest(topic="t", batch=batch(3)))
    assert node.stop() == 0
    assert not (node.data_dir / "node.json").exists()
    node.start()
    channel, stub = stub_for(node)
    assert log_end(stub, "t", 0) == 3
    channel.close()


def test_second_node_on_the_same_port_fails_clearly(node: NodeProcess, tmp_path: Path) -> None:
    other = NodeProcess(site="a", data_dir=tmp_path / "other", listen=node.address)
    proc = subprocess.run(other.command(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "cannot listen on" in proc.stderr


def test_a_second_node_on_the_same_data_dir_is_refused_naming_the_holder(
    api: pbg.NodeStub, node: NodeProcess, start_node
) -> None:  # type: ignore[no-untyped-def]
    second = NodeProcess(site="a", data_dir=node.data_dir)
    proc = subprocess.run(second.command(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"in use by another georep node (pid {node.pid}, serving on {node.address})" in proc.stderr
    assert "--data-dir" in proc.stderr
    # the holder never noticed: it still serves, and node.json still names it
    api.Produce(pb.ProduceRequest(topic="t", partition=0, batch=batch()))
    assert log_end(api, "t", 0) == 3
    assert json.loads((node.data_dir / NODE_INFO).read_text())["pid"] == node.pid
    # the kernel drops the lock with its holder, kill -9 included: the lock file left behind blocks nothing
    node.kill9()
    assert (node.data_dir / ".lock").exists()
    restarted = start_node(data_dir=node.data_dir)
    _, stub = stub_for(restarted)
    assert log_end(stub, "t", 0) == 3


def test_data_dir_of_another_site_is_refused(node: NodeProcess) -> None:
    node.stop()
    other = NodeProcess(site="b", data_dir=node.data_dir)
    proc = subprocess.run(other.command(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "belongs to site 'a'" in proc.stderr


def test_an_unreadable_segment_fence_is_refused_at_start_with_what_to_do(node: NodeProcess) -> None:
    node.stop()
    guard = node.data_dir / "replicas" / "t-0" / "guard.json"
    guard.parent.mkdir(parents=True)
    guard.write_text("{not json")
    proc = subprocess.run(node.command(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "cannot know which leaders it fenced" in proc.stderr and "Traceback" not in proc.stderr
    guard.unlink()
    node.start()  # without the file: the node holds no copy of t-0 and starts


@pytest.mark.slow
def test_idle_client_keepalive_pings_are_accepted(api: pbg.NodeStub, node: NodeProcess) -> None:
    """Clients ping idle connections; the node must not answer with GOAWAY too_many_pings."""
    import time

    options = [
        ("grpc.keepalive_time_ms", 1_500),
        ("grpc.keepalive_timeout_ms", 2_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    with open_channel(node.address, options=options) as channel:
        pbg.NodeStub(channel).Health(pb.HealthRequest())
        time.sleep(8)  # 5 pings; gRPC's default server policy sends GOAWAY at the third
        assert channel._channel.check_connectivity_state(False) == 2  # READY: the connection survived


def test_a_node_without_topology_runs_standalone(api: pbg.NodeStub) -> None:
    """No --topology: no links, so it never pulls from whatever runs on the default ports."""
    status = api.SiteStatus(pb.SiteStatusRequest(partitions=True))
    assert status.site == "a" and list(status.links) == []
    assert [p.topic for p in status.partitions if not p.topic.startswith("__")] == ["t", "t"]


def test_a_read_only_data_dir_is_refused_at_start_with_what_to_do(node: NodeProcess, tmp_path: Path) -> None:
    node.stop()
    data = str(node.data_dir)
    mounted = subprocess.run(["mount", "--bind", data, data], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.fail(f"this test bind-mounts the data dir read-only and needs root: {mounted.stderr.strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", data], check=True)
        proc = subprocess.run(node.command(), capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert "is not usable" in proc.stderr and "Read-only file system" in proc.stderr
        assert "Traceback" not in proc.stderr
    finally:
        subprocess.run(["umount", "-l", data], check=False)
    node.start()  # writable again: it starts as before
