"""A node deletes a topic only once every site it links to has announced, in ``Health``, that it checks topic
incarnations (issue 23; ``georep/server/delete_gate.py``): an older site would serve the deleted records into a
re-created topic."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from georep.proto import georep_pb2 as pb
from georep.server.delete_gate import DeleteGate, linked_sites
from georep.server.process import NodeProcess
from tests.support.channels import add_port
from tests.support.node_api import expect_error, stub_for
from tests.support.ports import free_ports
from tests.support.sites import topology_toml, wait_until
from topology.file import parse_topology_file
from topology.model import Topology


def topology(ports: dict[str, int], links: list[tuple[str, str]]) -> Topology:
    return parse_topology_file("topology.toml", topology_toml(ports, links).encode())


def test_a_delete_waits_until_every_linked_site_has_announced_and_remembers_them(tmp_path: Path) -> None:
    topo = topology({"a": 1, "b": 2, "c": 3, "d": 4}, [("a", "b"), ("b", "a"), ("b", "c")])
    assert linked_sites(topo, "b") == ["a", "c"]  # d is not linked to b: it does not count
    answers: dict[str, bool | None] = {"127.0.0.1:1": True, "127.0.0.1:3": False}

    async def ask(address: str) -> bool | None:
        return answers.get(address)

    async def scenario() -> None:
        gate = DeleteGate(topo, "b", tmp_path, ask)
        await gate.ask_missing()
        refusal = gate.refusal()
        assert refusal is not None and "site(s) c " in refusal and "upgrade" in refusal
        answers["127.0.0.1:3"] = True  # c upgraded
        await gate.ask_missing()
        assert gate.refusal() is None
        answers.clear()  # every site down: what they announced still counts, across a restart
        again = DeleteGate(topo, "b", tmp_path, ask)
        assert again.refusal() is None

    asyncio.run(scenario())


def test_a_linked_site_that_starts_after_this_one_is_heard_of_within_seconds(tmp_path: Path) -> None:
    topo = topology({"a": 1, "b": 2}, [("a", "b")])
    asked: list[str] = []

    async def ask(address: str) -> bool | None:
        asked.append(address)
        return len(asked) > 1  # a is not up at b's start, then it is

    async def scenario() -> None:
        gate = DeleteGate(topo, "b", tmp_path, ask)
        task = asyncio.create_task(gate.run())
        try:
            async with asyncio.timeout(20):
                while gate.refusal() is not None:
                    await asyncio.sleep(0.05)
        finally:
            task.cancel()

    asyncio.run(scenario())


class OldSiteC:
    """Site c, linked to b; its Health says whether it checks incarnations (``announce``)."""

    def __init__(self) -> None:
        self.announce = threading.Event()

    def health(self, request: bytes, context: Any) -> pb.HealthResponse:
        return pb.HealthResponse(status="SERVING", site="c", epoch=1, checks_incarnations=self.announce.is_set())

    def list_topics(self, request: bytes, context: Any) -> pb.ListTopicsResponse:
        return pb.ListTopicsResponse()  # no topics (b syncs with c before it creates one)

    def handler(self) -> grpc.GenericRpcHandler:
        serialize = pb.HealthResponse.SerializeToString
        health: grpc.RpcMethodHandler[Any, Any] = grpc.unary_unary_rpc_method_handler(self.health, None, serialize)
        topics: grpc.RpcMethodHandler[Any, Any] = grpc.unary_unary_rpc_method_handler(
            self.list_topics, None, pb.ListTopicsResponse.SerializeToString
        )
        return grpc.method_handlers_generic_handler("georep.v1.Node", {"Health": health, "ListTopics": topics})


@pytest.fixture
def site_b_and_old_c(tmp_path: Path) -> Iterator[tuple[NodeProcess, OldSiteC]]:
    port_b, port_c = free_ports(2)
    path = tmp_path / "topology.toml"
    path.write_text(topology_toml({"b": port_b, "c": port_c}, [("b", "c"), ("c", "b")]))
    c = OldSiteC()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((c.handler(),))
    assert add_port(server, f"127.0.0.1:{port_c}") == port_c
    server.start()
    b = NodeProcess(
        site="b", data_dir=tmp_path / "b", listen=f"127.0.0.1:{port_b}", extra_args=["--topology", str(path)]
    )
    try:
        b.start()
        yield b, c
    finally:
        b.stop()
        server.stop(0)


@pytest.mark.slow
def test_a_node_refuses_delete_topic_while_a_linked_site_does_not_check_incarnations(
    site_b_and_old_c: tuple[NodeProcess, OldSiteC],
) -> None:
    b, c = site_b_and_old_c
    channel, stub = stub_for(b)
    try:
        stub.CreateTopic(pb.CreateTopicRequest(name="orders", partitions=1), timeout=10)
        why = expect_error(grpc.StatusCode.FAILED_PRECONDITION, stub.DeleteTopic, pb.DeleteTopicRequest(name="orders"))
        assert "site(s) c " in why and "incarnations" in why
        assert "orders" in [t.name for t in stub.ListTopics(pb.ListTopicsRequest(), timeout=10).topics]
        c.announce.set()  # c upgraded: the refusal asked it again, so a retry goes through
        wait_until("b deletes orders", lambda: _deleted(stub, "orders"))
        assert "orders" not in [t.name for t in stub.ListTopics(pb.ListTopicsRequest(), timeout=10).topics]
    finally:
        channel.close()


def _deleted(stub: Any, name: str) -> bool:
    try:
        stub.DeleteTopic(pb.DeleteTopicRequest(name=name), timeout=10)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
            raise
        return False
    return True
