"""A real node with its recovery points in one checkpoint file: kill -9 after writes the checkpoint does not yet
hold, then a clean stop; every acknowledged record is served after each restart."""

from __future__ import annotations

from pathlib import Path

import pytest

from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.record.batch import iter_headers
from georep.storage.checked_json import loads_checked
from georep.storage.recovery_checkpoint import FILE_NAME as CHECKPOINT
from georep.storage.recovery_point import FILE_NAME as PARTITION_FILE
from tests.support.node_api import batch, fetch_all, log_end, stub_for
from tests.support.sites import wait_until

PARTITIONS = 60


def produce_round(stub: pbg.NodeStub, acked: dict[int, int], every: int, records: int) -> None:
    for p in range(0, PARTITIONS, every):
        resp = stub.Produce(pb.ProduceRequest(topic="t", partition=p, batch=batch(records)), timeout=30)
        acked[p] = resp.base_offset + records


def checkpointed(logs: Path) -> dict[str, int]:
    """Each partition's recovery point in the node's checkpoint file (nothing while there is none)."""
    try:
        doc = loads_checked((logs / CHECKPOINT).read_bytes())
    except FileNotFoundError:
        return {}
    return {name: entry["recovery_point"] for name, entry in doc["partitions"].items()}


def assert_served(stub: pbg.NodeStub, acked: dict[int, int]) -> None:
    """Every acknowledged record, by offset; and the last batch of each partition by vector (its origin seq), which
    a restart after kill -9 finds through index entries rebuilt from the log (they were in memory)."""
    for p in range(PARTITIONS):
        assert log_end(stub, "t", p) == acked.get(p, 0), p
        data = fetch_all(stub, "t", p, acked.get(p, 0))
        headers = list(iter_headers(data, verify=True))
        assert sum(h.records_count for h in headers) == acked.get(p, 0), p
        if headers:
            last = headers[-1]
            seen = pb.OriginSeq(site=last.origin_site, epoch=last.origin_epoch, next_seq=last.base_origin_seq)
            request = pb.FetchRequest(topic="t", partition=p, vector=pb.VectorOffset(entries=[seen]), max_wait_ms=100)
            stream = stub.Fetch(request)
            first = iter_headers(next(iter(stream)).batches, verify=True)[0]
            stream.cancel()
            assert (first.base_offset, first.base_origin_seq) == (last.base_offset, last.base_origin_seq), p


@pytest.mark.slow
def test_every_acknowledged_record_survives_kill9_after_the_checkpoint_and_a_clean_stop(start_node) -> None:  # type: ignore[no-untyped-def]
    node = start_node(extra_args=["--retention-check-ms", "200"])
    logs = node.data_dir / "logs"
    channel, stub = stub_for(node)
    stub.CreateTopic(pb.CreateTopicRequest(name="t", partitions=PARTITIONS), timeout=60)
    acked: dict[int, int] = {}
    produce_round(stub, acked, every=1, records=2)
    wait_until(  # the retention run wrote the checkpoint with every partition's first batch
        "the checkpoint holds the first round",
        lambda: all(checkpointed(logs).get(f"t-{p}") == acked[p] for p in range(PARTITIONS)),
    )
    produce_round(stub, acked, every=3, records=3)  # acknowledged, and maybe not yet in the checkpoint
    channel.close()
    node.kill9()
    node.start(timeout_s=120)
    channel, stub = stub_for(node)
    assert_served(stub, acked)
    produce_round(stub, acked, every=7, records=1)
    channel.close()
    assert node.stop(timeout_s=60) == 0
    assert all(checkpointed(logs)[f"t-{p}"] == acked[p] for p in range(PARTITIONS))  # one file says it all
    assert not list(logs.glob(f"*/{PARTITION_FILE}"))
    node.start(timeout_s=120)
    channel, stub = stub_for(node)
    assert_served(stub, acked)
    channel.close()
