"""The hostile producer fuzzer of issue 20: Hypothesis builds batches with valid CRCs and arbitrary record sections,
codec ids, counts, timestamps and header fields, and sends them through gRPC and through the Kafka port of x, one of
two linked sites. Each is either refused with a clear error, or stored and then readable at both sites, by georep's
consumer and by a Kafka client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings

from georep.proto import georep_pb2 as pb
from georep.record.batch import parse_header
from tests.support.cli import georep, ok
from tests.support.examples import examples
from tests.support.forge import hostile_batches
from tests.support.kafka_nodes import KAFKA_ARGS, kafka_address
from tests.support.kafka_raw import hostile_kafka_batches, kafka_python_read, produce_raw
from tests.support.sites import Sites, converged, wait_until

pytestmark = pytest.mark.slow

# What a Kafka produce of a hostile batch may be refused with: each comes with a message saying why.
KAFKA_REFUSALS = {
    2: "CORRUPT_MESSAGE",
    10: "MESSAGE_TOO_LARGE",
    32: "INVALID_TIMESTAMP",
    76: "UNSUPPORTED_COMPRESSION_TYPE",
    87: "INVALID_RECORD",
}
EXAMPLES = examples(200)


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sites]:
    s = Sites(tmp_path_factory.mktemp("hostile"), ["x", "y"], [("x", "y"), ("y", "x")], extra_args=KAFKA_ARGS)
    try:
        s.start()
        ok(georep("topic", "create", "t", "--partitions", "1", "--bootstrap", s.address("x")))
        yield s
    finally:
        s.close()


def json_records(address: str) -> list[tuple[object, ...]]:
    """Every record of t-0 at ``address`` through ``georep consume``: (origin, origin seq, key, value, timestamp)."""
    result = georep("consume", "t", "--from-beginning", "--timeout", "3", "--json", "--bootstrap", address, timeout=120)
    assert result.returncode == 0, result.stderr.decode()
    assert "skipped" not in result.stderr.decode()
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    return [(r["origin"], r["origin_seq"], r["key"], r["value"], r["timestamp"]) for r in rows]


def test_every_hostile_batch_is_refused_clearly_or_readable_everywhere(sites: Sites) -> None:
    stub = sites.stub("x")
    kafka_x = kafka_address(sites.nodes["x"])
    stored = {"records": 0}

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(hostile=hostile_batches(), hostile_kafka=hostile_kafka_batches())
    def send(hostile: tuple[bytes, str], hostile_kafka: tuple[bytes, str]) -> None:
        batch, label = hostile
        try:
            stub.Produce(pb.ProduceRequest(topic="t", partition=0, batch=batch), timeout=30)
            stored["records"] += parse_header(batch).records_count
            event("gRPC: stored")
        except grpc.RpcError as exc:
            assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT and exc.details(), (label, exc.code(), exc.details())
            event("gRPC: refused")
        batch, label = hostile_kafka
        code, message = produce_raw(kafka_x, "t", 0, batch)
        if code == 0:
            stored["records"] += int.from_bytes(batch[57:61], "big", signed=True)
            event("Kafka: stored")
        else:
            assert code in KAFKA_REFUSALS and message, (label, code, message)
            event(f"Kafka: refused, {KAFKA_REFUSALS[code]}")

    send()
    assert stored["records"] > 0, "no hostile batch was valid: the strategies test only refusals"
    wait_until("y holds everything x stored", lambda: converged(sites, ["x", "y"], "t", stored["records"]), 60)
    at_x, at_y = json_records(sites.address("x")), json_records(sites.address("y"))
    assert len(at_x) == stored["records"] and at_x == at_y
    for site in ("x", "y"):
        node = sites.nodes[site]
        assert len(kafka_python_read(kafka_address(node), "t")) == stored["records"]
        log = Path(node.data_dir / "node.log").read_text()
        assert "served to Kafka clients as an empty batch" not in log and "InvalidChunk" not in log
