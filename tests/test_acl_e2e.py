"""Principals and ACLs on real nodes over mutual TLS (docs/security.md, "Principals and ACLs").

Sites a and b are real ``georep node`` processes with certificates from ``georep certs init``; links a -> b,
b -> a and c -> b. Site c is played by a small gRPC server in this test holding site c's real certificate: a
site that forges the origin of what it serves. Site z has a certificate from the same CA but no link.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from georep.auth.principal import parse_principal
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.record.batch import RecordInput, encode_batch
from georep.security.tls import TlsConfig
from georep.server.process import NodeProcess
from offsets.coordinates import Origin
from tests.support.channels import add_port, open_channel
from tests.support.fake_upstream import upstream_handler
from tests.support.ports import free_ports
from tests.support.sites import origin_batch, wait_until

FORGED = "forged"


def georep(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "georep.cli", *args], capture_output=True, text=True, timeout=60)


class FakeSiteC:
    """Site c's side of the link c -> b, with c's certificate: it serves topic ``forged``, whose stream holds a
    batch of c's own (which b takes) and then a batch claiming origin ``a`` (which c cannot have: no link leads
    from a to c)."""

    def __init__(self, a_origin: Origin) -> None:
        self.a_origin = a_origin

    def list_topics(self, request: bytes, context: Any) -> pb.ListTopicsResponse:
        return pb.ListTopicsResponse(topics=[pb.TopicDescription(name=FORGED, partitions=1)])

    def list_acls(self, request: bytes, context: Any) -> pb.ListAclsResponse:
        return pb.ListAclsResponse()

    def report_held(self, request: bytes, context: Any) -> pb.ReportHeldResponse:
        return pb.ReportHeldResponse()

    def replicate(self, request: bytes, context: Any) -> Iterator[pb.ReplicateResponse]:
        own = origin_batch(Origin("c", 1), 0)  # type: ignore[arg-type]
        forged = origin_batch(self.a_origin, 0, tag=b"forged-")
        vector = pb.VectorOffset(entries=[pb.OriginSeq(site="c", epoch=1, next_seq=2)])
        yield pb.ReplicateResponse()
        for batches in (own, forged):
            yield pb.ReplicateResponse(
                chunks=[
                    pb.ReplicaChunk(topic=FORGED, partition=0, batches=batches, src_vector=vector, src_log_end_offset=2)
                ]
            )
        deadline = time.monotonic() + 10
        while context.is_active() and time.monotonic() < deadline:
            time.sleep(0.1)


@dataclass
class Net:
    certs: Path
    nodes: dict[str, NodeProcess]
    ports: dict[str, int]

    def tls(self, principal: str) -> TlsConfig:
        return TlsConfig.from_dir(self.certs, parse_principal(principal))

    def stub(self, site: str, principal: str) -> pbg.NodeStub:
        return pbg.NodeStub(open_channel(self.nodes[site].address, self.tls(principal)))

    def acl(self, site: str, *args: str) -> subprocess.CompletedProcess[str]:
        return georep("acl", *args, "--bootstrap", self.nodes[site].address, "--tls-dir", str(self.certs))


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Net]:
    root = tmp_path_factory.mktemp("acl")
    certs = root / "certs"
    made = georep("certs", "init", "--dir", str(certs), "--sites", "a,b,c,z", "--clients", "alice", "auditor")
    assert made.returncode == 0, made.stderr
    ports = dict(zip("abc", free_ports(3), strict=True))
    topology = root / "topology.toml"
    lines = [f'[sites.{s}]\nnodes = ["127.0.0.1:{p}"]\n' for s, p in ports.items()]
    lines += [f'[[links]]\nsrc = "{s}"\ndst = "{d}"\n' for s, d in (("a", "b"), ("b", "a"), ("c", "b"))]
    topology.write_text("\n".join(lines))
    nodes = {
        s: NodeProcess(
            site=s,
            data_dir=root / s,
            listen=f"127.0.0.1:{ports[s]}",
            tls=TlsConfig.from_dir(certs, parse_principal(f"site:{s}")),
            extra_args=["--topology", str(topology), "--stall-ms", "1000"],
        )
        for s in "ab"
    }
    fake: grpc.Server | None = None
    try:
        for node in nodes.values():
            node.start()
        net = Net(certs, nodes, ports)
        a_epoch = net.stub("a", "client:admin").Health(pb.HealthRequest(), timeout=10).epoch
        net.stub("a", "client:admin").CreateTopic(pb.CreateTopicRequest(name="orders/eu", partitions=1), timeout=10)
        fake = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        fake.add_generic_rpc_handlers((upstream_handler(FakeSiteC(Origin("a", a_epoch))),))  # type: ignore[arg-type]
        assert add_port(fake, f"127.0.0.1:{ports['c']}", net.tls("site:c")) == ports["c"]
        fake.start()
        yield net
    finally:
        if fake is not None:
            fake.stop(0)
        for node in nodes.values():
            node.stop()


def _produce(stub: pbg.NodeStub, topic: str, value: bytes) -> pb.ProduceResponse:
    batch = encode_batch([RecordInput(b"k", value, (), int(time.time() * 1000))])
    resp: pb.ProduceResponse = stub.Produce(
        pb.ProduceRequest(topic=topic, partition=0, batch=batch, acks=pb.ACKS_LEADER), timeout=10
    )
    return resp


def _denied(call: Any, *parts: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value
    details = info.value.details() or ""
    for part in parts:
        assert part in details, details


def test_a_client_needs_an_acl_and_one_added_at_a_works_at_b_too(net: Net) -> None:
    admin = net.stub("a", "client:admin")
    alice_a, alice_b = net.stub("a", "client:alice"), net.stub("b", "client:alice")
    _denied(
        lambda: _produce(alice_a, "orders/eu", b"no"),
        "client:alice",
        "produce",
        "topic:orders/eu",
        "georep acl add client:alice produce topic:orders/eu",
    )
    fetch = pb.FetchRequest(topic="orders/eu", partition=0, max_wait_ms=10)
    _denied(lambda: next(iter(alice_a.Fetch(fetch, timeout=10))), "client:alice", "consume", "topic:orders/eu")
    # as the user sees it: the georep commands with alice's certificate
    as_alice = ("--bootstrap", net.nodes["a"].address, "--tls-dir", str(net.certs), "--principal", "client:alice")
    produced = subprocess.run(
        [sys.executable, "-m", "georep.cli", "produce", "orders/eu", *as_alice],
        input="hello\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert produced.returncode != 0
    assert "client:alice may not produce topic:orders/eu" in produced.stderr, produced.stderr
    consumed = georep("consume", "orders/eu", "--from-beginning", "--max", "1", "--timeout", "5", *as_alice)
    assert consumed.returncode != 0
    assert "client:alice may not consume topic:orders/eu" in consumed.stderr, consumed.stderr

    added = net.acl("a", "add", "client:alice", "produce,consume", "topic:orders/**")
    assert added.returncode == 0, added.stderr
    assert "added: client:alice produce topic:orders/**" in added.stdout
    assert _produce(alice_a, "orders/eu", b"yes").base_offset == 0
    assert next(iter(alice_a.Fetch(fetch, timeout=10))).high_watermark >= 1
    _denied(lambda: _produce(alice_a, "payments", b"no"), "topic:payments")  # only what the entry names
    # a produce stream answers a refused batch and goes on with the others
    admin.CreateTopic(pb.CreateTopicRequest(name="payments", partitions=1), timeout=10)
    batch = encode_batch([RecordInput(b"k", b"v", (), int(time.time() * 1000))])
    mixed = [
        pb.ProduceRequest(topic=t, partition=0, batch=batch, correlation_id=i)
        for i, t in enumerate(["orders/eu", "payments", "orders/eu"])
    ]
    answers = {r.correlation_id: r for r in alice_a.ProduceStream(iter(mixed), timeout=10)}
    assert sorted(answers) == [0, 1, 2]
    assert not answers[0].HasField("error") and not answers[2].HasField("error")
    assert answers[1].error.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
    assert "client:alice may not produce topic:payments" in answers[1].error.message

    def produces_at_b() -> bool:
        try:
            return _produce(alice_b, "orders/eu", b"at b").base_offset >= 0
        except grpc.RpcError as exc:
            assert exc.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND), exc
            return False

    wait_until("site b takes site a's ACL entry", produces_at_b, 30)
    listed = net.acl("b", "list")
    assert "client:alice consume topic:orders/**" in listed.stdout, listed.stdout

    removed = net.acl("b", "remove", "client:alice", "produce", "topic:orders/**")
    assert removed.returncode == 0, removed.stderr

    def refused_at_a() -> bool:
        try:
            _produce(alice_a, "orders/eu", b"after remove")
            return False
        except grpc.RpcError as exc:
            return exc.code() == grpc.StatusCode.PERMISSION_DENIED

    wait_until("the remove at b reaches a", refused_at_a, 30)
    assert net.acl("a", "add", "client:alice", "write", "topic:x").returncode == 2  # a typo is a usage error


def test_a_consumer_may_not_commit_for_a_group_it_may_not_read(net: Net) -> None:
    assert net.acl("a", "add", "client:alice", "consume", "topic:orders/**").returncode == 0
    alice = net.stub("a", "client:alice")
    commit = pb.CommitOffsetsRequest(
        group="billing",
        generation=-1,
        commits=[pb.PartitionCommit(topic="orders/eu", partition=0, vector=pb.VectorOffset(), hint_offset=-1)],
    )
    _denied(
        lambda: alice.CommitOffsets(commit, timeout=10),
        "client:alice",
        "commit",
        "group:billing",
        "georep acl add client:alice commit group:billing",
    )
    _denied(
        lambda: alice.FetchCommitted(pb.FetchCommittedRequest(group="billing"), timeout=10), "read", "group:billing"
    )
    as_alice = ("--bootstrap", net.nodes["a"].address, "--tls-dir", str(net.certs), "--principal", "client:alice")
    joined = georep("consume", "orders/eu", "--group", "billing", "--max", "1", "--timeout", "5", *as_alice)
    assert joined.returncode != 0
    assert "client:alice may not read group:billing" in joined.stderr, joined.stderr


def test_reading_digests_needs_audit_and_audit_is_not_consume(net: Net) -> None:
    """The live audit's ScanDigests (issue 24) needs ``audit`` on the topic; a consumer may not, and an auditor
    without ``consume`` reads digests but no records."""
    scan = pb.ScanDigestsRequest(topic="orders/eu", partition=0)
    auditor, alice = net.stub("a", "client:auditor"), net.stub("a", "client:alice")
    assert net.acl("a", "add", "client:alice", "consume", "topic:orders/**").returncode == 0
    for who, stub in (("client:auditor", auditor), ("client:alice", alice)):
        _denied(
            lambda stub=stub: list(stub.ScanDigests(scan, timeout=10)),
            who,
            "audit",
            "topic:orders/eu",
            f"georep acl add {who} audit topic:orders/eu",
        )
    added = net.acl("a", "add", "client:auditor", "audit", "topic:orders/**")
    assert added.returncode == 0, added.stderr
    _produce(net.stub("a", "client:admin"), "orders/eu", b"audited")
    digests = [d for r in auditor.ScanDigests(scan, timeout=10) for d in r.digests]
    assert digests and {d.status for d in digests} == {"ok"}
    assert {d.records for d in digests} == {1}  # what _produce wrote: one record a batch
    fetch = pb.FetchRequest(topic="orders/eu", partition=0, max_wait_ms=10)
    _denied(lambda: next(iter(auditor.Fetch(fetch, timeout=10))), "client:auditor", "consume", "topic:orders/eu")


def test_a_site_without_a_link_may_not_pull(net: Net) -> None:
    pull = pb.ReplicateRequest(dst_site="z", wants=[pb.PullWant(topic="orders/eu", partition=0)])
    _denied(
        lambda: next(iter(net.stub("a", "site:z").Replicate(pull, timeout=10))), "site:z", "replicate", "no link a -> z"
    )
    # a linked site pulls only for itself
    lying = pb.ReplicateRequest(dst_site="z", wants=[pb.PullWant(topic="orders/eu", partition=0)])
    _denied(lambda: next(iter(net.stub("a", "site:b").Replicate(lying, timeout=10))), "site:b", "site b")
    # and a client never pulls
    _denied(lambda: net.stub("a", "client:alice").ReportHeld(pb.ReportHeldRequest(), timeout=10), "client:alice")


def test_a_batch_with_a_forged_origin_is_refused(net: Net) -> None:
    admin = net.stub("b", "client:admin")

    def link_error() -> str:
        links = admin.SiteStatus(pb.SiteStatusRequest(), timeout=10).links
        return next((lk.last_error for lk in links if lk.src == "c"), "")

    wait_until("b refuses c's forged batch", lambda: "forged origin" in link_error(), 30)
    assert "claiming origin a@" in link_error()
    (state,) = admin.DescribeTopic(pb.DescribeTopicRequest(name=FORGED), timeout=10).partition_states
    assert state.log_end_offset == 2  # c's own two records, none of the forged batch
    assert {e.site for e in state.vector.entries} == {"c"}
    # and a client cannot stamp an origin at all
    assert net.acl("a", "add", "client:alice", "produce", "topic:orders/**").returncode == 0
    forged = origin_batch(Origin("b", 1), 0)  # type: ignore[arg-type]
    with pytest.raises(grpc.RpcError) as info:
        net.stub("a", "client:alice").Produce(
            pb.ProduceRequest(topic="orders/eu", partition=0, batch=forged), timeout=10
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stamp" in (info.value.details() or "")
