"""A fake upstream site's gRPC service: the calls a downstream's puller makes of it, each answered by the fake."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any, Protocol

import grpc

from georep.auth.principal import parse_principal
from georep.metadata.store import SiteIdentity
from georep.proto import georep_pb2 as pb
from georep.security import dev_ca
from georep.security.tls import TlsConfig
from georep.server.broker import Broker
from georep.server.replicator import Replicator
from tests.support.channels import add_port
from tests.support.ports import free_ports
from tests.support.sites import topology_toml
from topology.file import parse_topology_file
from topology.ids import SiteId
from topology.model import Topology


class FakeUpstream(Protocol):
    def list_topics(self, request: bytes, context: Any) -> pb.ListTopicsResponse: ...
    def list_acls(self, request: bytes, context: Any) -> pb.ListAclsResponse: ...
    def report_held(self, request: bytes, context: Any) -> pb.ReportHeldResponse: ...
    def replicate(self, request: bytes, context: Any) -> Iterator[pb.ReplicateResponse]: ...


def upstream_handler(site: FakeUpstream) -> grpc.GenericRpcHandler:
    def serialize(message: Any) -> bytes:
        return message.SerializeToString()  # type: ignore[no-any-return]

    def unary(fn: Any) -> grpc.RpcMethodHandler[Any, Any]:
        return grpc.unary_unary_rpc_method_handler(fn, None, serialize)

    return grpc.method_handlers_generic_handler(
        "georep.v1.Node",
        {
            "ListTopics": unary(site.list_topics),
            "ListAcls": unary(site.list_acls),
            "ReportHeld": unary(site.report_held),
            "Replicate": grpc.unary_stream_rpc_method_handler(site.replicate, None, serialize),
        },
    )


def serve_as_site_a(fake: FakeUpstream, root: Path) -> tuple[grpc.Server, Topology, Path]:
    """``fake`` served as site a over mutual TLS with a's own certificate (an authenticated peer, linked to b);
    the topology ``a -> b`` and the certificates' directory. Stop the server when done."""
    port_a, port_b = free_ports(2)
    certs = root / "certs"
    dev_ca.init(certs, dev_ca.plan(["a", "b"], {}, []))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((upstream_handler(fake),))
    assert add_port(server, f"127.0.0.1:{port_a}", TlsConfig.from_dir(certs, parse_principal("site:a"))) == port_a
    server.start()
    topology = parse_topology_file("topology.toml", topology_toml({"a": port_a, "b": port_b}, [("a", "b")]).encode())
    return server, topology, certs


def replicator_of_b(root: Path, topology: Topology, certs: Path) -> Replicator:
    """Site b's replicator in this process (not started), pulling from the fake over mutual TLS."""
    tls_b = TlsConfig.from_dir(certs, parse_principal("site:b"))
    return Replicator(Broker(root / "b", SiteIdentity(SiteId("b"), 1)), topology, "b", stall_ms=1000, tls=tls_b)
