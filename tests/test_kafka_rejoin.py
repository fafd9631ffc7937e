"""Kafka's eager rebalance at the gateway (``georep/kafka/rejoin.py``): a JoinGroup answers only once every member
of the previous generation has rejoined, so no partition has two owners. Before the barrier, a second member got
a partition at once while the first still fetched it: the second read from the group's commit and committed
further, and the first then delivered records that commit covered (the fresh-clone CI's failure of
``test_kafka_groups_cluster.py``: ten records of partition 2 below a successful commit at 10)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kafka.protocol import consumer as kconsumer

from georep.kafka import errors as k
from georep.kafka.gateway import Client, KafkaGateway
from georep.kafka.protocol import Request
from georep.kafka.rejoin import laggards
from georep.server.broker import Broker
from georep.server.groups import GroupService

TOPIC = "r"
GROUP = "g"
PEER = Client("127.0.0.1")
SUBSCRIPTION = bytes(kconsumer.ConsumerProtocolSubscription(version=0, topics=[TOPIC]).encode())


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[KafkaGateway]:
    from georep.storage.metadata_file import load_or_create_identity

    b = Broker(tmp_path, load_or_create_identity(tmp_path, "a", 1))
    b.create_topic(TOPIC, 2, {})

    async def create_topic(name: str, partitions: int, config: dict[str, str]) -> None:
        b.create_topic(name, partitions, config)

    yield KafkaGateway(b, GroupService(b), "127.0.0.1", 9092, create_topic)
    b.close()


async def join(g: KafkaGateway, member_id: str, client: str, rebalance_timeout_ms: int = 30_000) -> Any:
    body = SimpleNamespace(
        group_id=GROUP,
        member_id=member_id,
        protocol_type="consumer",
        protocols=[SimpleNamespace(name="range", metadata=SUBSCRIPTION)],
        session_timeout_ms=6_000,
        rebalance_timeout_ms=rebalance_timeout_ms,
    )
    answer = await g._join_group(Request(11, 5, 1, client, body), PEER)
    assert answer.error_code == 0
    return answer


async def sync(g: KafkaGateway, joined: Any, client: str) -> set[int]:
    body = SimpleNamespace(group_id=GROUP, member_id=joined.member_id, generation_id=joined.generation_id)
    answer = await g._sync_group(Request(14, 3, 1, client, body), PEER)
    assert answer.error_code == 0
    decoded = kconsumer.ConsumerProtocolAssignment.decode(answer.assignment)
    return {p for tp in decoded.assigned_partitions for p in tp.partitions}


async def heartbeat(g: KafkaGateway, joined: Any, client: str) -> int:
    body = SimpleNamespace(group_id=GROUP, member_id=joined.member_id, generation_id=joined.generation_id)
    return int((await g._heartbeat(Request(12, 3, 1, client, body), PEER)).error_code)


async def join_and_sync(g: KafkaGateway, client: str, rebalance_timeout_ms: int = 30_000) -> tuple[Any, set[int]]:
    joined = await join(g, "", client, rebalance_timeout_ms)
    return joined, await sync(g, joined, client)


async def turns(n: int = 200) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_a_joining_member_gets_no_partition_before_the_previous_owner_has_rejoined(gateway: KafkaGateway) -> None:
    async def scenario() -> None:
        m0, owned = await join_and_sync(gateway, "m0")
        assert owned == {0, 1}
        second = asyncio.create_task(join_and_sync(gateway, "m1"))
        await turns()
        assert not second.done(), (
            f"m1 was answered (partitions {second.result()[1]}) while m0, not rejoined, still owned {owned}"
        )
        assert await heartbeat(gateway, m0, "m0") == k.REBALANCE_IN_PROGRESS
        again = await join(gateway, m0.member_id, "m0")  # an eager client revoked everything before this
        m1, got = await second
        assert again.generation_id == m1.generation_id
        mine = await sync(gateway, again, "m0")
        assert mine | got == {0, 1} and not mine & got

    asyncio.run(scenario())


def test_a_member_that_does_not_rejoin_within_the_rebalance_timeout_is_dropped(gateway: KafkaGateway) -> None:
    async def scenario() -> None:
        m0, _ = await join_and_sync(gateway, "m0")
        _, got = await join_and_sync(gateway, "m1", rebalance_timeout_ms=300)  # m0 never heartbeats again
        assert got == {0, 1}
        assert await heartbeat(gateway, m0, "m0") == k.UNKNOWN_MEMBER_ID

    asyncio.run(scenario())


def test_only_members_of_an_older_generation_that_the_coordinator_lists_are_awaited() -> None:
    assert laggards({"a": 3, "b": 2, "c": 2}, ["a", "b", "native"], 3) == ["b"]
