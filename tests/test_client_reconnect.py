"""A channel closed under a call by another task's reconnect is a NodeUnavailable, never the caller's cancellation.

A consumer's fetchers, its group heartbeat and the application's own calls
(commit, poll) share one channel. When a fetcher sees the node go, it replaces
the channel, and grpc.aio cancels every call still in flight on the old one. A
soak found an application's consume loop ended by that cancellation, as if the
application had cancelled it, after a site was killed: the group then held its
partitions with no one reading them.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from georep.client.connection import Connection
from georep.client.errors import NodeUnavailable
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from tests.support.channels import add_port


class SlowDescribe(pbg.NodeServicer):
    """Answers Health at once (so the client connects) and holds DescribeTopic."""

    async def Health(self, request: pb.HealthRequest, context: object) -> pb.HealthResponse:  # type: ignore[override]
        return pb.HealthResponse(status="serving", site="a", epoch=1)

    async def DescribeTopic(
        self,
        request: pb.DescribeTopicRequest,  # type: ignore[override]
        context: object,
    ) -> pb.TopicDescription:
        await asyncio.sleep(30)
        return pb.TopicDescription(name=request.name)


async def _with_server(body):  # type: ignore[no-untyped-def]
    server = grpc.aio.server()
    pbg.add_NodeServicer_to_server(SlowDescribe(), server)
    port = add_port(server, "127.0.0.1:0")
    await server.start()
    connection = Connection(f"127.0.0.1:{port}")
    try:
        await connection.connect()
        await body(connection)
    finally:
        await connection.close()
        await server.stop(grace=None)


def test_a_call_cut_by_another_tasks_reconnect_is_node_unavailable() -> None:
    async def body(connection: Connection) -> None:
        generation = connection.generation
        call = asyncio.create_task(
            connection.unary(connection.stub.DescribeTopic(pb.DescribeTopicRequest(name="t"), timeout=20))
        )
        await asyncio.sleep(0.3)
        await connection.reconnect(generation)  # what a fetcher does when its node went away
        with pytest.raises(NodeUnavailable, match="replaced while a call was in flight"):
            await asyncio.wait_for(call, 5)
        assert connection.generation == generation + 1

    asyncio.run(_with_server(body))


def test_cancelling_the_callers_own_task_still_cancels_it() -> None:
    async def body(connection: Connection) -> None:
        call = asyncio.create_task(
            connection.unary(connection.stub.DescribeTopic(pb.DescribeTopicRequest(name="t"), timeout=20))
        )
        await asyncio.sleep(0.3)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    asyncio.run(_with_server(body))
