"""A node whose disk fills up turns writes away, keeps serving reads, and recovers."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.record.batch import iter_headers
from georep.server.process import NodeProcess
from tests.support.channels import open_channel
from tests.support.disks import small_tmpfs
from tests.support.node_api import batch, fetch_all, log_end
from tests.support.sites import Sites, check_invariants, converged, produce, read_site, wait_until

DISK_BYTES = 3 << 20


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path, f"size={DISK_BYTES}") as mount:
        yield mount


def test_full_disk_turns_writes_away_keeps_reads_and_recovers(small_disk: Path, tmp_path: Path) -> None:
    ballast = small_disk / "ballast"
    ballast.write_bytes(b"\0" * (1 << 20))
    node = NodeProcess(site="a", data_dir=small_disk / "node", log_path=tmp_path / "node.log").start()
    try:
        channel = open_channel(node.address)
        stub = pbg.NodeStub(channel)
        stub.CreateTopic(pb.CreateTopicRequest(name="t", partitions=1))
        acked = []
        refusal = None
        for seq in range(0, 10_000, 16):
            try:
                resp = stub.Produce(pb.ProduceRequest(topic="t", batch=batch(16, pid=7, seq=seq, value_bytes=4000)))
                acked.append(resp.base_offset)
            except grpc.RpcError as exc:
                refusal = exc
                break
        assert refusal is not None, "the disk never filled up"
        assert refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "free disk space" in str(refusal.details())
        assert stub.Health(pb.HealthRequest()).disk_full

        # Reads still work and hold exactly the acked batches, none half-written.
        end = log_end(stub, "t", 0)
        assert end == 16 * len(acked)
        data = fetch_all(stub, "t", 0, end)
        assert [h.base_offset for h in iter_headers(data, verify=True)] == acked
        (segment,) = sorted((small_disk / "node" / "logs" / "t-0").glob("*.log"))
        assert segment.stat().st_size == len(data)

        # Free space: the producer's retry of the refused batch now succeeds.
        ballast.unlink()
        seq = 16 * len(acked)
        resp = stub.Produce(pb.ProduceRequest(topic="t", batch=batch(16, pid=7, seq=seq, value_bytes=4000)))
        assert resp.base_offset == end and not resp.duplicate
        assert not stub.Health(pb.HealthRequest()).disk_full
        channel.close()
    finally:
        node.kill9()


def test_a_full_disk_during_replica_apply_stops_the_link_loses_nothing_and_catches_up(
    small_disk: Path, make_sites: Callable[..., Sites]
) -> None:
    sites = make_sites(["a", "b"], [("a", "b")])
    b = sites.nodes["b"]
    b.data_dir, b.log_path = small_disk / "b", small_disk.parent / "b.log"
    (small_disk / "ballast").write_bytes(b"\0" * (1 << 20))
    sites.start()
    sites.stub("a").CreateTopic(pb.CreateTopicRequest(name="t", partitions=1), timeout=5)
    sent = asyncio.run(produce(sites.address("a"), "t", "big", 700, value_bytes=4000))  # ~2.8 MB: more than fits
    wait_until("b's disk fills up", lambda: sites.stub("b").Health(pb.HealthRequest(), timeout=5).disk_full, 60)
    assert b.alive()
    # the link shows why it is not streaming, and keeps showing it while it backs off
    wait_until(
        "b's link reports the full disk",
        lambda: any("DiskFull" in link.last_error for link in sites.status("b").links),
        10,
    )
    # what b holds is whole: a prefix of a's records, each once, in order
    check_prefix(sites, "b", "t")
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    wait_until("b catches up", lambda: converged(sites, ["a", "b"], "t", 700), 60)
    check_invariants(sites, ["a", "b"], "t", sent)
    assert not sites.stub("b").Health(pb.HealthRequest(), timeout=5).disk_full


def check_prefix(sites: Sites, site: str, topic: str) -> None:
    held = read_site(sites, site, topic)
    for records in held.values():
        seqs = [r[1] for r in records]
        assert seqs == list(range(len(seqs))), "b must hold a gap-free prefix of a's records"
