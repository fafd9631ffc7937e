"""Issue 20, item 8: forged ``ReportHeld`` claims never release an ``acks=geo:N`` produce (real nodes, mutual TLS).

Sites a, b and c with certificates from ``georep certs init``; links a <-> b and c -> b, so a's records reach b
only, and nothing of a's reaches c. With b down, whoever holds b's certificate tells a that c, ``zz`` (no such
site) and b itself hold a's records: a refuses the first two by the topology, and counts the third only up to
what has left a (nothing). A produce at ``acks=geo:2`` then times out, as it does when no second site holds the
record. Once the real b runs and pulls, the same produce is acknowledged.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from georep.auth.principal import parse_principal
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.record.batch import RecordInput, encode_batch
from georep.security.tls import TlsConfig
from georep.server.process import NodeProcess
from tests.support.channels import open_channel
from tests.support.ports import free_ports
from tests.support.sites import catalog_synced, topology_toml, wait_until

pytestmark = pytest.mark.slow

TOPIC = "orders"
SEQ_FAR = 1_000_000  # a claim that covers every record the test produces


@dataclass
class Net:
    certs: Path
    nodes: dict[str, NodeProcess]

    def stub(self, site: str, principal: str) -> pbg.NodeStub:
        tls = TlsConfig.from_dir(self.certs, parse_principal(principal))
        return pbg.NodeStub(open_channel(self.nodes[site].address, tls))


@pytest.fixture
def net(tmp_path: Path) -> Iterator[Net]:
    certs = tmp_path / "certs"
    made = subprocess.run(
        [sys.executable, "-m", "georep.cli", "certs", "init", "--dir", str(certs), "--sites", "a,b,c"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    ports = dict(zip("abc", free_ports(3), strict=True))
    topology = tmp_path / "topology.toml"
    topology.write_text(topology_toml(ports, [("a", "b"), ("b", "a"), ("c", "b")]))
    nodes = {
        s: NodeProcess(
            site=s,
            data_dir=tmp_path / s,
            listen=f"127.0.0.1:{ports[s]}",
            tls=TlsConfig.from_dir(certs, parse_principal(f"site:{s}")),
            extra_args=["--topology", str(topology), "--stall-ms", "1000"],
        )
        for s in "abc"
    }
    try:
        for s in "acb":
            nodes[s].start()
        # a creates topics once it has synced with its upstream b; b then goes down, a's records never left a.
        wait_until("a synced with b", lambda: catalog_synced(nodes["a"].data_dir) == ["b"])
        nodes["b"].stop()
        yield Net(certs, nodes)
    finally:
        for node in nodes.values():
            node.stop()


def _produce_geo2(stub: pbg.NodeStub, value: bytes, timeout_ms: int) -> pb.ProduceResponse:
    batch = encode_batch([RecordInput(b"k", value, (), int(time.time() * 1000))])
    request = pb.ProduceRequest(
        topic=TOPIC, partition=0, batch=batch, acks=pb.ACKS_GEO, geo_sites=2, ack_timeout_ms=timeout_ms
    )
    resp: pb.ProduceResponse = stub.Produce(request, timeout=timeout_ms / 1000 + 30)
    return resp


def _claim(site: str, epoch: int) -> pb.HeldEntry:
    vector = pb.VectorOffset(entries=[pb.OriginSeq(site="a", epoch=epoch, next_seq=SEQ_FAR)])
    return pb.HeldEntry(site=site, topic=TOPIC, partition=0, vector=vector)


def test_forged_held_claims_never_release_a_geo_ack(net: Net) -> None:
    admin = net.stub("a", "client:admin")
    admin.CreateTopic(pb.CreateTopicRequest(name=TOPIC, partitions=1), timeout=10)
    epoch = admin.Health(pb.HealthRequest(), timeout=10).epoch
    as_b = net.stub("a", "site:b")  # b's certificate, b's node down

    with pytest.raises(grpc.RpcError) as refused:
        as_b.ReportHeld(
            pb.ReportHeldRequest(reporter="b", entries=[_claim("c", epoch), _claim("zz", epoch)]), timeout=10
        )
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value
    details = refused.value.details() or ""
    assert "site a refused 2 claim(s) of site b's held report" in details, details
    assert "that site c holds orders/0: no chain of links carrying topic 'orders' leads from site b" in details
    assert "that site zz holds orders/0: site 'zz' is not in the topology" in details
    # what b says of itself is b's to say, but it counts only up to what has left a: nothing yet
    as_b.ReportHeld(pb.ReportHeldRequest(reporter="b", entries=[_claim("b", epoch)]), timeout=10)
    with pytest.raises(grpc.RpcError) as posing:
        as_b.ReportHeld(pb.ReportHeldRequest(reporter="c", entries=[_claim("c", epoch)]), timeout=10)
    assert posing.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "reports only in its own name" in (posing.value.details() or "")

    with pytest.raises(grpc.RpcError) as timed_out:
        _produce_geo2(admin, b"no second site holds this", 2_000)
    assert timed_out.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, timed_out.value
    assert "geo:2" in (timed_out.value.details() or ""), timed_out.value.details()
    logged = (net.nodes["a"].data_dir / "node.log").read_text()
    assert "site a refused 2 claim(s) of site b's held report" in logged

    # the honest topology: b runs, pulls and reports, and geo:2 is acknowledged
    net.nodes["b"].start()

    def acked() -> bool:
        try:
            return _produce_geo2(admin, b"b holds this", 5_000).base_offset >= 0
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc
            return False

    wait_until("b pulls and reports, and a acknowledges at geo:2", acked, 60)
