"""``ScanDigests`` on a running one-node site: one digest per stored batch, its errors, damage, and the node's pace.

The multi-node site's side (any member answers; all_replicas) is in tests/test_scan_digests_cluster.py; the ACL
(``audit``) in tests/test_acl_e2e.py.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from georep.client.audit import scan_digests
from georep.client.errors import InvalidRequest, OffsetOutOfRange, UnknownTopic
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.record.batch import iter_headers
from georep.server.process import NodeProcess
from tests.support.cli import georep
from tests.support.node_api import batch, expect_error, fetch_all, log_end, stub_for

NODE_ARGS = ["--segment-bytes-max", "4096", "--scrub-bytes-per-s", "0"]
BATCHES = {"t": 20, "damaged": 12}  # about 5 batches a segment


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NodeProcess, grpc.Channel, pbg.NodeStub]]:
    node = NodeProcess(site="a", data_dir=tmp_path_factory.mktemp("digests") / "a", extra_args=NODE_ARGS).start()
    channel, stub = stub_for(node)
    try:
        for topic, count in BATCHES.items():
            stub.CreateTopic(pb.CreateTopicRequest(name=topic, partitions=2))
            for _ in range(count):
                stub.Produce(pb.ProduceRequest(topic=topic, partition=0, batch=batch(3, value_bytes=200)))
        yield node, channel, stub
    finally:
        channel.close()
        node.kill9()


def segment_files(node: NodeProcess, topic: str) -> list[Path]:
    return sorted((node.data_dir / "logs" / f"{topic}-0").glob("*.log"))


def test_one_digest_per_stored_batch_with_its_crc_in_messages_of_max_digests(node) -> None:  # type: ignore[no-untyped-def]
    _node, channel, stub = node
    end = log_end(stub, "t", 0)
    stored = list(iter_headers(fetch_all(stub, "t", 0, end)))
    responses = list(stub.ScanDigests(pb.ScanDigestsRequest(topic="t", partition=0, max_digests=7)))
    assert [len(r.digests) for r in responses] == [7, 7, 6]
    assert {r.end_offset for r in responses} == {end}
    digests = [d for r in responses for d in r.digests]
    assert [(d.base_offset, d.crc, d.size_bytes, d.base_seq, d.records) for d in digests] == [
        (h.base_offset, h.crc, h.size_bytes, h.base_origin_seq, h.records_count) for h in stored
    ]
    assert {(d.status, d.node, d.origin_site, d.log_start_offset) for d in digests} == {("ok", "", "a", 0)}
    assert len({d.segment for d in digests}) > 3  # read across segments (named by their base offsets)
    metrics = urllib.request.urlopen(f"http://{_node.metrics_address}/metrics", timeout=10).read().decode()
    assert "georep_audit_digests_total" in metrics and "georep_audit_paced_seconds_total" in metrics
    counted = next(line for line in metrics.splitlines() if line.startswith("georep_audit_digests_total"))
    assert float(counted.split()[1]) >= BATCHES["t"]
    middle = list(scan_digests(channel, "t", 0, 10, 20))  # the client call: batches holding offsets 10..19
    holding = [h.base_offset for h in stored if h.next_offset > 10 and h.base_offset < 20]
    assert [d.base_offset for d in middle] == holding


def test_an_empty_range_and_an_empty_partition_answer_one_message_with_the_end(node) -> None:  # type: ignore[no-untyped-def]
    _node, _channel, stub = node
    empty = list(stub.ScanDigests(pb.ScanDigestsRequest(topic="t", partition=1)))
    assert [(len(r.digests), r.end_offset) for r in empty] == [(0, 0)]
    at_end = list(stub.ScanDigests(pb.ScanDigestsRequest(topic="t", partition=0, from_offset=log_end(stub, "t", 0))))
    assert [len(r.digests) for r in at_end] == [0]


def test_bad_requests_get_a_status_that_says_what_to_ask_for(node) -> None:  # type: ignore[no-untyped-def]
    _node, channel, stub = node
    end = log_end(stub, "t", 0)

    def scan(fields: dict[str, object]) -> None:
        list(stub.ScanDigests(pb.ScanDigestsRequest(**fields)))  # type: ignore[arg-type]

    def refused(code: grpc.StatusCode, **fields: object) -> str:
        return expect_error(code, scan, fields)

    assert "georep topic list" in refused(grpc.StatusCode.NOT_FOUND, topic="nope", partition=0)
    assert "partitions 0..1" in refused(grpc.StatusCode.NOT_FOUND, topic="t", partition=2)
    assert "partitions 0..1" in refused(grpc.StatusCode.NOT_FOUND, topic="t", partition=-1)
    assert "ask from 0" in refused(grpc.StatusCode.INVALID_ARGUMENT, topic="t", from_offset=-1)
    inverted = refused(grpc.StatusCode.INVALID_ARGUMENT, topic="t", from_offset=5, to_offset=4)
    assert "from_offset <= to_offset" in inverted
    past = refused(grpc.StatusCode.OUT_OF_RANGE, topic="t", to_offset=end + 1)
    assert f"[0, {end}]" in past and "leave to_offset unset" in past
    refused(grpc.StatusCode.OUT_OF_RANGE, topic="t", from_offset=end + 1)
    refused(grpc.StatusCode.INVALID_ARGUMENT, topic="t", max_digests=-1)
    with pytest.raises(UnknownTopic, match="georep topic list"):
        list(scan_digests(channel, "nope", 0))
    with pytest.raises(OffsetOutOfRange):
        list(scan_digests(channel, "t", 0, 0, end + 5))
    with pytest.raises(InvalidRequest):
        list(scan_digests(channel, "t", 0, -3))


def test_a_corrupt_batch_in_a_sealed_segment_is_reported_as_corrupt_not_raised(node) -> None:  # type: ignore[no-untyped-def]
    node_, _channel, stub = node
    first = segment_files(node_, "damaged")[0]
    assert len(segment_files(node_, "damaged")) > 1  # so the first is sealed
    victim = iter_headers(first.read_bytes())[0]
    at = victim.size_bytes - 2  # a byte of the first batch's last record: covered by its CRC
    with open(first, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x55]))
    digests = [d for r in stub.ScanDigests(pb.ScanDigestsRequest(topic="damaged", partition=0)) for d in r.digests]
    assert [(d.base_offset, d.status) for d in digests if d.status != "ok"] == [(0, "corrupt")]
    assert "crc" in digests[0].error.lower() and digests[0].position == 0
    assert len(digests) == BATCHES["damaged"]  # the batches after it are digested too


@pytest.fixture(scope="module")
def paced_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[pbg.NodeStub]:
    args = ["--audit-digest-rate", "2"]
    node = NodeProcess(site="a", data_dir=tmp_path_factory.mktemp("paced") / "a", extra_args=args).start()
    channel, stub = stub_for(node)
    try:
        stub.CreateTopic(pb.CreateTopicRequest(name="t", partitions=1))
        for _ in range(12):
            stub.Produce(pb.ProduceRequest(topic="t", partition=0, batch=batch(1)))
        yield stub
    finally:
        channel.close()
        node.kill9()


def test_audit_digest_rate_paces_a_scan_to_fewer_digests_than_it_asked_for(paced_node) -> None:  # type: ignore[no-untyped-def]
    """At 2 batches a second (a burst of 2), a scan of 12 cannot be done within 1.5 s: at most 2 + 3 arrive."""
    got = 0
    with pytest.raises(grpc.RpcError) as info:
        for response in paced_node.ScanDigests(pb.ScanDigestsRequest(topic="t", max_digests=1), timeout=1.5):
            got += len(response.digests)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 1 <= got <= 5
    # Paced, not cut short: given the time, the same scan brings every batch, once and in offset order.
    whole = [
        d.base_offset
        for response in paced_node.ScanDigests(pb.ScanDigestsRequest(topic="t", max_digests=1), timeout=60)
        for d in response.digests
    ]
    assert whole == sorted(set(whole)) and len(whole) == 12, whole


def test_a_negative_audit_digest_rate_is_a_usage_error_that_says_what_to_pass(tmp_path: Path) -> None:
    args = ["node", "--site", "a", "--data-dir", str(tmp_path / "n"), "--insecure", "--listen", "127.0.0.1:0"]
    refused = georep(*args, "--audit-digest-rate", "-5")
    assert refused.returncode == 2
    assert b"--audit-digest-rate -5 must be 0 (unbounded) or more" in refused.stderr
