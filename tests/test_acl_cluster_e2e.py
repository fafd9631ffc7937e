"""ACLs on a multi-node site over mutual TLS: an entry added at one node is a Raft command every node applies, and
the nodes' own calls to each other (segment appends, forwarded calls) pass as the site's super-users."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from georep.auth.principal import parse_principal
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.record.batch import RecordInput, encode_batch
from georep.security.tls import TlsConfig
from tests.support.channels import open_channel
from tests.support.cluster_site import ClusterSite
from tests.support.sites import wait_until


def georep(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "georep.cli", *args], input=stdin, capture_output=True, text=True, timeout=90
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ClusterSite, Path]]:
    root = tmp_path_factory.mktemp("acl-cluster")
    certs = root / "certs"
    made = georep("certs", "init", "--dir", str(certs), "--sites", "a", "--nodes", "a=3", "--clients", "alice", "bob")
    assert made.returncode == 0, made.stderr
    cluster = ClusterSite(
        root,
        count=3,
        extra_args=["--replication-factor", "3", "--min-insync-replicas", "2"],
        raft_secret=certs / "raft-a.secret",
    )
    cluster.use_tls(certs)
    with cluster.running():
        yield cluster, certs


def test_an_entry_added_at_one_node_holds_at_every_node_and_replicated_writes_pass(
    site: tuple[ClusterSite, Path],
) -> None:
    cluster, certs = site
    admin = TlsConfig.from_dir(certs)
    with open_channel(cluster.address(1), admin) as channel:
        pbg.NodeStub(channel).CreateTopic(pb.CreateTopicRequest(name="orders", partitions=1), timeout=30)
    added = georep(
        "acl",
        "add",
        "client:alice",
        "produce",
        "topic:orders",
        "--bootstrap",
        cluster.address(2),
        "--tls-dir",
        str(certs),
    )
    assert added.returncode == 0, added.stderr

    def listed_at_every_node() -> bool:
        return all(
            "client:alice produce topic:orders"
            in georep("acl", "list", "--bootstrap", cluster.address(n), "--tls-dir", str(certs)).stdout
            for n in (1, 2, 3)
        )

    wait_until("every node lists the entry", listed_at_every_node, 30)
    bootstrap = ",".join(cluster.address(n) for n in (1, 2, 3))
    as_alice = ("--bootstrap", bootstrap, "--tls-dir", str(certs), "--principal", "client:alice")
    sent = georep("produce", "orders", "--acks", "all", *as_alice, stdin="one\ntwo\n")
    assert sent.returncode == 0, sent.stderr  # acks=all: the leader's appends to its ensemble went through
    as_bob = ("--bootstrap", bootstrap, "--tls-dir", str(certs), "--principal", "client:bob")
    refused = georep("produce", "orders", *as_bob, stdin="three\n")
    assert refused.returncode != 0 and "client:bob may not produce topic:orders" in refused.stderr, refused.stderr
    ends = []
    for n in (1, 2, 3):  # the leader describes the partition it serves
        with open_channel(cluster.address(n), admin) as channel:
            ends += [
                s.log_end_offset
                for s in pbg.NodeStub(channel)
                .DescribeTopic(pb.DescribeTopicRequest(name="orders"), timeout=10)
                .partition_states
            ]
    assert ends == [2]  # alice's two records, none of bob's


def test_an_auditor_reads_every_replicas_digests_through_any_node(site: tuple[ClusterSite, Path]) -> None:
    """ScanDigests with all_replicas over mutual TLS: the auditor needs ``audit``; the node it asks digests the
    other members' copies through their Segments service, as the site's own node (issue 24)."""
    cluster, certs = site
    admin, bob = TlsConfig.from_dir(certs), TlsConfig.from_dir(certs, parse_principal("client:bob"))
    scan = pb.ScanDigestsRequest(topic="audited", partition=0, all_replicas=True)
    with open_channel(cluster.address(1), admin) as channel:
        stub = pbg.NodeStub(channel)
        stub.CreateTopic(pb.CreateTopicRequest(name="audited", partitions=1), timeout=30)
    produced = []

    def produce_at_the_leader() -> bool:
        try:
            with open_channel(cluster.address(1), admin) as channel:
                described = pbg.NodeStub(channel).DescribeTopic(pb.DescribeTopicRequest(name="audited"), timeout=10)
            if not described.leaders or not described.leaders[0].address:
                return False
            with open_channel(described.leaders[0].address, admin) as channel:
                while len(produced) < 3:
                    batch = encode_batch([RecordInput(None, b"audited", (), 1_700_000_000_000)])
                    request = pb.ProduceRequest(topic="audited", partition=0, batch=batch, acks=pb.ACKS_ALL)
                    answer = pbg.NodeStub(channel).Produce(request, timeout=30)
                    if answer.HasField("error"):
                        return False
                    produced.append(answer)
        except grpc.RpcError:
            return False  # no leader yet, or it moved: ask again
        return True

    wait_until("three batches produced at the leader", produce_at_the_leader, 60)
    with open_channel(cluster.address(2), bob) as channel, pytest.raises(grpc.RpcError) as info:
        list(pbg.NodeStub(channel).ScanDigests(scan, timeout=30))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "georep acl add client:bob audit topic:audited" in (info.value.details() or "")
    with open_channel(cluster.address(1), admin) as channel:
        put = pb.PutAclRequest(principal="client:bob", operation="audit", resource="topic:audited")
        pbg.NodeStub(channel).PutAcl(put, timeout=30)

    def digests_at(node: int) -> list[pb.BatchDigest]:
        with open_channel(cluster.address(node), bob) as channel:
            return [d for r in pbg.NodeStub(channel).ScanDigests(scan, timeout=30) for d in r.digests]

    wait_until("bob may audit at every node", lambda: all(len(digests_at(n)) == 9 for n in (1, 2, 3)), 30)
    for n in (1, 2, 3):  # three batches, a copy of each on each of the three members
        digests = digests_at(n)
        assert sorted(d.node for d in digests) == sorted(["1", "2", "3"] * 3)
        assert {d.status for d in digests} == {"ok"} and len({d.crc for d in digests}) == 3
