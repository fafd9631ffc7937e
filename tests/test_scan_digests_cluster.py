"""``ScanDigests`` at a multi-node site (georep/server/digest_calls.py): any member answers, each segment once from
one readable copy, or with all_replicas every member's copy, so a damaged replica shows against its peers.

Three ``georep node`` processes, replication factor 2: each segment lives on two of the three nodes, so every node
lacks some segments and digests them through ``ScanSegmentDigests`` on a member that holds them (only digests
cross between the nodes).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import grpc
import pytest

from georep.client.audit import scan_digests
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from tests.support.channels import open_channel
from tests.support.cluster_site import TOPIC, ClusterSite, produce, status

BATCHES = 16  # ~1 KiB each: several 4 KiB segments


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterSite]:
    root = tmp_path_factory.mktemp("digests-cluster")
    args = ["--segment-bytes-max", "4096", "--replication-factor", "2", "--repair-delay-ms", "600000"]
    site = ClusterSite(root, 3, extra_args=args)
    with site.running():
        with open_channel(site.address(1)) as channel:
            pbg.NodeStub(channel).CreateTopic(pb.CreateTopicRequest(name=TOPIC, partitions=2), timeout=30)
        site.wait_leader(TOPIC)
        assert produce(site, BATCHES, "audit") == BATCHES
        yield site


def scan(site: ClusterSite, node: int, all_replicas: bool = False) -> list[pb.BatchDigest]:
    with open_channel(site.address(node)) as channel:
        return list(scan_digests(channel, TOPIC, 0, all_replicas=all_replicas, max_digests=5, timeout_s=60))


def copy_file(site: ClusterSite, node: int, digest: pb.BatchDigest) -> Path:
    segment_dir = site.nodes[node].data_dir / "replicas" / f"{TOPIC}-0" / f"{digest.segment:010d}"
    (log,) = sorted(segment_dir.glob("*.log"))
    return log


@pytest.mark.slow
def test_every_member_answers_and_all_replicas_shows_the_one_damaged_copy(site: ClusterSite) -> None:
    leader = site.wait_leader(TOPIC)
    once = {n: scan(site, n) for n in (1, 2, 3)}
    for n, digests in once.items():  # each batch once, from some copy, in log order
        assert len(digests) == BATCHES, n
        assert all(a.base_offset + a.records == b.base_offset for a, b in pairwise(digests))
        assert {d.status for d in digests} == {"ok"}
        assert [(d.base_offset, d.crc) for d in digests] == [(d.base_offset, d.crc) for d in once[leader]]
    # a node lacking a segment had it digested by a member that holds it
    assert any(d.node != str(n) for n, digests in once.items() for d in digests)
    every = scan(site, leader, all_replicas=True)
    assert len(every) == 2 * BATCHES  # replication factor 2: two copies of each batch
    assert Counter((d.base_offset, d.crc) for d in every) == Counter({(d.base_offset, d.crc): 2 for d in once[1]})

    sealed = min(d.segment for d in every)  # the first segment: sealed, with later ones after it
    victim = next(d for d in every if d.segment == sealed and d.base_offset > 0)
    holders = sorted(int(d.node) for d in every if d.base_offset == victim.base_offset)
    damaged, healthy = holders
    path = copy_file(site, damaged, victim)
    at = victim.position + victim.size_bytes - 2  # a byte of the batch's last record: under its CRC
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x5A]))

    asked = next(n for n in (1, 2, 3) if n not in holders) if len(holders) < 3 else leader
    after = scan(site, asked, all_replicas=True)
    copies = {d.node: d for d in after if d.base_offset == victim.base_offset}
    assert copies[str(damaged)].status == "corrupt" and "crc" in copies[str(damaged)].error.lower()
    assert copies[str(healthy)].status == "ok" and copies[str(healthy)].crc == victim.crc
    assert [d for d in after if d.status != "ok"] == [copies[str(damaged)]]
    assert {d.segment for d in after} == {d.segment for d in every}


@pytest.mark.slow
def test_a_node_outside_the_open_segments_ensemble_digests_it_up_to_the_leaders_lac(site: ClusterSite) -> None:
    """Its own follower bound stops at the open segment's base; the LAC is its leader's to say."""
    for extra in range(4):  # until the open segment holds a batch (a roll may have just emptied it)
        row = next(p for p in status(site).partitions if p.topic == TOPIC and p.partition == 0)
        held = [d for d in scan(site, site.wait_leader(TOPIC)) if d.segment == row.open_segment_id]
        if held and len(set(row.open_ensemble)) == 2:  # not a view from the middle of a roll or a recovery
            break
        assert produce(site, 1, f"open-{extra}") == 1
    assert held and len(set(row.open_ensemble)) == 2, f"no open segment on two nodes holding a batch: {row}"
    (outsider,) = {1, 2, 3} - set(row.open_ensemble)
    seen = [d for d in scan(site, outsider) if d.segment == row.open_segment_id]
    assert [(d.base_offset, d.crc) for d in seen] == [(d.base_offset, d.crc) for d in held]
    assert {d.node for d in seen} <= {str(n) for n in row.open_ensemble}


@pytest.mark.slow
def test_a_member_refuses_a_range_past_what_it_can_read_and_unknown_segments(site: ClusterSite) -> None:
    end = max(d.base_offset + d.records for d in scan(site, 1))
    with open_channel(site.address(2)) as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(pbg.NodeStub(channel).ScanDigests(pb.ScanDigestsRequest(topic=TOPIC, to_offset=end + 100), timeout=30))
        assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE
        assert "leave to_offset unset" in (info.value.details() or "")
        ref = pb.SegmentRef(topic=TOPIC, partition=0, segment_id=999)
        request = pb.ScanSegmentDigestsRequest(segment=ref, from_offset=0, to_offset=1)
        with pytest.raises(grpc.RpcError) as info:
            list(pbg.SegmentsStub(channel).ScanSegmentDigests(request, timeout=30))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "ask another member" in (info.value.details() or "")
        request.short_copy_ok = True  # all_replicas asks so: a member without the copy has nothing to digest
        answers = list(pbg.SegmentsStub(channel).ScanSegmentDigests(request, timeout=30))
        assert [(len(a.digests), a.end_offset) for a in answers] == [(0, 0)]
        empty = list(pbg.NodeStub(channel).ScanDigests(pb.ScanDigestsRequest(topic=TOPIC, partition=1), timeout=30))
        assert [(len(a.digests), a.end_offset) for a in empty] == [(0, 0)]
