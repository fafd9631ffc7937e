"""``georep audit --live`` at a multi-node site: every member's copy of the audited range is digested
(``ScanDigests`` with ``all_replicas``) and compared as the file audit compares a site's segment copies
(spark_jobs/replicas.py), while the site's log for the checks between sites stays the digests its leader serves.

Site ``a`` of three nodes (replication factor 3: every node holds every segment) and a one-node site ``b``,
linked both ways. Clean first; then, in two followers' copies of a sealed segment (not the copy the site serves),
one value byte is flipped with the batch CRC recomputed (a copy that parts from its peers) and one byte is
damaged under the CRC (another batch). The audit runs in this process on the shared Spark session, through the
command's own parser and entry point.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.record.batch import RecordInput, encode_batch
from spark_jobs import inject
from spark_jobs.audit import EXIT_CLEAN, EXIT_DIVERGENCE, cli_parser, main
from spark_jobs.layout import partition_segments
from spark_jobs.scan import scan_segment
from tests.support.channels import open_channel
from tests.support.cluster_site import TOPIC, WAIT_S, ClusterSite, beside, leader_hint, wait_for
from tests.support.ports import free_ports

BATCHES = 12  # of 3 records, ~700 bytes: several 4 KiB segments


def _links(b_port: int) -> str:
    return (
        f'[sites.b]\nnodes = ["127.0.0.1:{b_port}"]\n[[links]]\nsrc = "a"\ndst = "b"\n[[links]]\nsrc = "b"\ndst = "a"\n'
    )


def _vector(address: str) -> dict[str, int]:
    with open_channel(address) as channel:
        try:
            d = pbg.NodeStub(channel).DescribeTopic(pb.DescribeTopicRequest(name=TOPIC), timeout=5)
        except grpc.RpcError:  # not there yet: asked again
            return {}
    return {f"{e.site}@{e.epoch}": e.next_seq for s in d.partition_states for e in s.vector.entries}


def _write(site: ClusterSite, leader: int) -> None:
    """BATCHES batches of three records at acks=all, each retried at the leader its refusal names (a segment being
    sealed) until acknowledged."""
    address = site.address(leader)
    for i in range(BATCHES):
        records = [RecordInput(b"k%d" % j, b"v%d-%d" % (i, j) * 40, (), 1_700_000_000_000) for j in (1, 2, 3)]
        request = pb.ProduceRequest(topic=TOPIC, partition=0, batch=encode_batch(records), acks=pb.ACKS_ALL)
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                with open_channel(address) as channel:
                    pbg.NodeStub(channel).Produce(request, timeout=15)
                break
            except grpc.RpcError as exc:
                if time.monotonic() > deadline:
                    raise AssertionError(f"batch {i} not acknowledged: {exc.code()} {exc.details()}") from None
                address = leader_hint(exc) or address
                time.sleep(0.05)


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ClusterSite, Path]]:
    root = tmp_path_factory.mktemp("live-replicas")
    b_port = free_ports(1)[0]
    args = ["--segment-bytes-max", "4096", "--replication-factor", "3", "--repair-delay-ms", "600000"]
    args += ["--session-timeout-ms", "60000"]  # no leader change on a loaded machine: the test knows the serving copy
    site = ClusterSite(root, 3, extra_args=args, more_toml=_links(b_port))
    b = beside(site, "b", root / "b", b_port)
    try:
        b.start()
        with site.running():
            with open_channel(site.address(1)) as channel:
                pbg.NodeStub(channel).CreateTopic(pb.CreateTopicRequest(name=TOPIC, partitions=1), timeout=30)
            _write(site, site.wait_leader(TOPIC))
            wait_for("b holds every batch of a", lambda: _holds_all(_vector(b.address)))
            wait_for("every node's copies hold every batch", lambda: _copies_complete(site))
            yield site, site.topology
    finally:
        b.stop()


def _holds_all(vector: dict[str, int]) -> bool:
    """Every record written at ``a`` (its one origin), as a site's vector tells."""
    return [(o.partition("@")[0], n) for o, n in vector.items()] == [("a", BATCHES * 3)]


def _copies(site: ClusterSite, node: int) -> dict[int, int]:
    """Segment id -> whole batches in ``node``'s copy of it, read from its files."""
    part_dir = site.nodes[node].data_dir / "replicas" / f"{TOPIC}-0"
    return {
        int(d.name): sum(1 for f in partition_segments("a", TOPIC, 0, d) for b in scan_segment(f) if b.status == "ok")
        for d in sorted(part_dir.iterdir())
        if d.name.isdigit()
    }


def _copies_complete(site: ClusterSite) -> bool:
    """Each node holds a copy of every segment, all as long (a follower may lag the LAC a moment after the acks)."""
    copies = [_copies(site, n) for n in site.nodes]
    return sum(copies[0].values()) == BATCHES and all(c == copies[0] for c in copies)


def _serving(site: ClusterSite, report: dict[str, Any]) -> int:
    """The node of site a whose digests the audit's cut read (the partition's leader)."""
    address = report["cut"]["sites"]["a"]["topics"][TOPIC]["0"][2]
    return next(n for n in site.nodes if site.address(n) == address)


def _audit(spark: Any, topology: Path, report: Path, *more: str) -> tuple[int, dict[str, Any], list[str]]:
    args = cli_parser().parse_args(
        ["--live", "--insecure", "--topology", str(topology), "--report", str(report), *more]
    )
    lines: list[str] = []
    code = main(args, out=lines.append, spark=spark)
    return code, json.loads((report / "report.json").read_text()), lines


@pytest.mark.slow  # four node processes, then two live audits of six Spark jobs or more each
def test_the_live_audit_names_the_one_replica_that_parts_from_its_peers(
    sites: tuple[ClusterSite, Path], spark: Any, tmp_path: Path
) -> None:
    site, topology = sites
    code, clean, _lines = _audit(spark, topology, tmp_path / "clean")
    assert code == EXIT_CLEAN and clean["counts"] == {}, clean["counts"]
    read = clean["read"]
    served = read["per_site"]["a"]["digests"]
    assert served >= BATCHES and read["per_site"]["b"]["digests"] == served
    assert read["per_site"]["a"]["replica_digests"] == 3 * served  # every batch, from each of its three copies
    assert "replica_digests" not in read["per_site"]["b"] and read["replica_digests"] == 3 * served
    assert clean["sites"]["a"]["nodes"] == ["1", "2", "3"] and clean["sites"]["b"]["nodes"] == []

    # the node that served the site's digests (the cut's), and the two others, whose copies are damaged
    serving = _serving(site, clean)
    parted, damaged = sorted(n for n in site.nodes if n != serving)
    segment_dirs = sorted((site.nodes[parted].data_dir / "replicas" / f"{TOPIC}-0").iterdir())
    assert len(segment_dirs) >= 2, "no sealed segment"
    segment = int(segment_dirs[0].name)  # the first: sealed, later ones after it
    (copy,) = partition_segments("a", TOPIC, 0, segment_dirs[0])
    origin, seq, _position = inject.flip_value_byte_in_place(copy, "a")
    (other,) = partition_segments(
        "a", TOPIC, 0, site.nodes[damaged].data_dir / "replicas" / f"{TOPIC}-0" / segment_dirs[0].name
    )
    second = list(scan_segment(other))[1]  # not the batch that parted: the copies agree there
    inject.corrupt_byte(other.path, second.position + second.size_bytes - 2)  # under the CRC: storage damage

    code, doc, lines = _audit(spark, topology, tmp_path / "parted")
    assert _serving(site, doc) == serving, "the partition's leader changed: the site serves another copy"
    assert code == EXIT_DIVERGENCE
    assert {k: v["issues"] for k, v in doc["counts"].items()} == {"replica_divergence": 1, "corrupt": 1}, doc["counts"]
    (replica,) = [i for i in doc["issues"] if i["kind"] == "replica_divergence"]
    assert (replica["site"], replica["node"], replica["reference_node"], replica["segment"]) == (
        "a",
        str(parted),
        str(serving),
        segment,
    )
    assert (replica["topic"], replica["partition"], replica["origin"]) == (TOPIC, 0, origin)
    assert replica["first_seq"] <= seq <= replica["last_seq"]
    (corrupt,) = [i for i in doc["issues"] if i["kind"] == "corrupt"]
    assert (corrupt["site"], corrupt["node"], corrupt["segment"]) == ("a", str(damaged), segment)
    assert any(f"a node {parted} vs node {serving}: segment {segment}" in line for line in lines), lines

    # the copy the site serves is whole: without the replica check, the sites agree
    code, served_only, _lines = _audit(spark, topology, tmp_path / "served", "--no-replica-check")
    assert _serving(site, served_only) == serving, "the partition's leader changed: the site serves another copy"
    assert code == EXIT_CLEAN and served_only["counts"] == {} and served_only["replica_check"] is False
    assert "replica_digests" not in served_only["read"] and served_only["sites"]["a"]["nodes"] == []
