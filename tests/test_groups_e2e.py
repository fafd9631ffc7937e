"""Consumer groups, committed vectors and geo acks on real multi-site processes (I5, I6)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import pytest

from georep.client.consumer import Consumer, ConsumerRecord
from georep.client.errors import GeoAckTimeout, GroupRebalanced, MemberFenced
from georep.client.producer import Producer
from georep.proto import georep_pb2 as pb
from offsets.vector import VectorOffset
from tests.support.sites import TRIANGLE, Sites, converged, produce, wait_until

TOPIC = "t"


def setup_triangle(make_sites: Callable[..., Sites], partitions: int = 2) -> Sites:
    sites = make_sites(["a", "b", "c"], TRIANGLE)
    sites.start()
    sites.stub("a").CreateTopic(pb.CreateTopicRequest(name=TOPIC, partitions=partitions))
    for s in ("b", "c"):
        wait_until(f"the topic reaches {s}", lambda s=s: sites.vectors(s, TOPIC) != {}, 15)
    return sites


async def consume_until(consumer: Consumer, seen: list[ConsumerRecord], n: int, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while len(seen) < n:
        assert time.monotonic() < deadline, f"consumed {len(seen)} of {n} records"
        seen.extend(await consumer.poll(timeout_ms=200))


def coordinates(records: list[ConsumerRecord]) -> list[tuple[int, str, int]]:
    return [(r.partition, str(r.origin), r.origin_seq) for r in records]


def test_consumer_fails_over_to_another_site_with_no_duplicate_and_no_gap(make_sites: Callable[..., Sites]) -> None:
    """kill -9 the consumer's site: it moves to the next bootstrap site and resumes from its in-memory vector."""
    sites = setup_triangle(make_sites)

    async def run() -> None:
        expected = await produce(sites.address("b"), TOPIC, "b", 300)
        expected |= await produce(sites.address("a"), TOPIC, "a", 300)
        wait_until("sites converge", lambda: converged(sites, ["a", "b", "c"], TOPIC, 600), 20)
        seen: list[ConsumerRecord] = []
        bootstrap = f"{sites.address('a')},{sites.address('c')}"
        consumer = Consumer(
            bootstrap,
            group_id="g",
            auto_offset_reset="earliest",
            max_bytes=4096,
            enable_auto_commit=False,
            client_id="c0",
        )
        async with consumer:
            consumer.subscribe([TOPIC])
            await consume_until(consumer, seen, 200)
            await consumer.commit()
            sites.nodes["a"].kill9()
            expected |= await produce(sites.address("c"), TOPIC, "c", 200)
            await consume_until(consumer, seen, 800)
            assert consumer._connection.origin.startswith("c@")
            extra = await consumer.poll(timeout_ms=500)
            seen.extend(extra)
        coords = coordinates(seen)
        assert len(coords) == len(set(coords)), "a record was delivered twice"
        assert {(r.key, r.value) for r in seen} == expected, "a record was never delivered"
        per_origin: dict[tuple[int, str], list[int]] = {}
        for p, origin, seq in coords:
            per_origin.setdefault((p, origin), []).append(seq)
        for key, seqs in per_origin.items():
            assert seqs == list(range(len(seqs))), f"{key} delivered out of order or with a gap"

    asyncio.run(run())


def test_a_restarted_consumer_resumes_at_the_committed_vector_at_any_site(make_sites: Callable[..., Sites]) -> None:
    sites = setup_triangle(make_sites, partitions=1)

    async def run() -> None:
        await produce(sites.address("a"), TOPIC, "a", 100)
        await produce(sites.address("b"), TOPIC, "b", 100)
        wait_until("sites converge", lambda: converged(sites, ["a", "b", "c"], TOPIC, 200), 20)
        first: list[ConsumerRecord] = []
        async with Consumer(
            sites.address("a"),
            group_id="g",
            auto_offset_reset="earliest",
            max_bytes=2048,
            enable_auto_commit=False,
            commit_acks="geo:2",
        ) as consumer:
            consumer.subscribe([TOPIC])
            await consume_until(consumer, first, 60)
            await consumer.commit()
            committed_vector = consumer.vector((TOPIC, 0))
        # A new process at site c: the group's commit (geo:2) is there, or arrives before the read.
        rest: list[ConsumerRecord] = []
        async with Consumer(
            sites.address("c"), group_id="g", auto_offset_reset="earliest", enable_auto_commit=False
        ) as consumer:
            consumer.subscribe([TOPIC])
            committed = await consumer.committed([(TOPIC, 0)])
            assert committed[(TOPIC, 0)].vector == committed_vector
            assert committed[(TOPIC, 0)].committed_by.startswith("a@")
            await consume_until(consumer, rest, 200 - len(first))
        assert not set(coordinates(first)) & set(coordinates(rest)), "duplicates relative to the commit"
        assert len(coordinates(first)) + len(coordinates(rest)) == 200

    asyncio.run(run())


def test_group_rebalances_when_a_member_dies_and_fences_it(make_sites: Callable[..., Sites]) -> None:
    sites = setup_triangle(make_sites, partitions=4)

    async def run() -> None:
        await produce(sites.address("a"), TOPIC, "a", 400)
        one = Consumer(
            sites.address("a"),
            group_id="g",
            auto_offset_reset="earliest",
            enable_auto_commit=False,
            session_timeout_ms=1500,
            client_id="m1",
        )
        two = Consumer(
            sites.address("a"),
            group_id="g",
            auto_offset_reset="earliest",
            enable_auto_commit=False,
            session_timeout_ms=1500,
            client_id="m2",
        )
        await one.start()
        await two.start()
        one.subscribe([TOPIC])
        two.subscribe([TOPIC])
        await one.poll(timeout_ms=100)
        await two.poll(timeout_ms=100)
        deadline = time.monotonic() + 10
        while len(one.assignment()) != 2 or len(two.assignment()) != 2:
            assert time.monotonic() < deadline, (one.assignment(), two.assignment())
            await one.poll(timeout_ms=100)
            await two.poll(timeout_ms=100)
        assert set(one.assignment()) | set(two.assignment()) == {(TOPIC, p) for p in range(4)}
        # m2 "dies": its heartbeats stop (its process would be gone) and its session expires.
        assert two._group is not None and two._group._task is not None
        two._group._task.cancel()
        deadline = time.monotonic() + 10
        while len(one.assignment()) != 4:
            assert time.monotonic() < deadline, "the survivor never got the dead member's partitions"
            await one.poll(timeout_ms=100)
        # The dead member is fenced: its commit is refused.
        with pytest.raises((MemberFenced, GroupRebalanced)):
            await two._group.commit({(TOPIC, 0): VectorOffset()}, {}, member=True)
        await one.close()
        two._closed = True
        await two._connection.close()

    asyncio.run(run())


def test_geo2_ack_survives_the_origin_killed_right_after_the_ack(make_sites: Callable[..., Sites]) -> None:
    sites = setup_triangle(make_sites, partitions=1)

    async def run() -> list[tuple[str, int]]:
        acked: list[tuple[str, int]] = []
        async with Producer(sites.address("a"), acks="geo:2", linger_ms=1) as producer:
            for i in range(50):
                meta = await producer.send(TOPIC, f"v{i}".encode())
                acked.append((str(meta.origin), meta.origin_seq))
        sites.nodes["a"].kill9()
        return acked

    acked = asyncio.run(run())
    held = set()
    for s in ("b", "c"):
        for entry in (
            sites.stub(s)
            .DescribeTopic(pb.DescribeTopicRequest(name=TOPIC), timeout=5)
            .partition_states[0]
            .vector.entries
        ):
            held.add((s, f"{entry.site}@{entry.epoch}", entry.next_seq))
    # Every acked record is at b or c right now, with a dead: nothing waits for a to come back.
    for origin, seq in acked:
        assert any(o == origin and seq < n for _, o, n in held), f"acked {origin}:{seq} is at no surviving site"


def test_geo_ack_timeout_is_a_clear_error_and_the_write_stays(make_sites: Callable[..., Sites]) -> None:
    sites = setup_triangle(make_sites, partitions=1)
    # Cut every link out of a: nobody else can get a's records.
    for dst in ("b", "c"):
        sites.stub(dst).SetLink(pb.SetLinkRequest(src="a", enabled=False), timeout=5)

    async def run() -> None:
        async with Producer(sites.address("a"), acks="geo:2", linger_ms=1, request_timeout_ms=1500) as producer:
            with pytest.raises(GeoAckTimeout, match="acks=geo:2 not reached"):
                await producer.send(TOPIC, b"stays")

    asyncio.run(run())
    assert sum(sites.vectors("a", TOPIC)[0].values()) == 1, "the write must stay at the origin"
    for dst in ("b", "c"):
        sites.stub(dst).SetLink(pb.SetLinkRequest(src="a", enabled=True), timeout=5)
    wait_until("it replicates once the links heal", lambda: converged(sites, ["a", "b", "c"], TOPIC, 1), 20)


def test_geo_acks_beyond_the_topology_and_bad_commits_are_refused(make_sites: Callable[..., Sites]) -> None:
    sites = setup_triangle(make_sites, partitions=1)
    stub = sites.stub("a")
    with pytest.raises(grpc.RpcError) as err:
        stub.CommitOffsets(
            pb.CommitOffsetsRequest(
                group="g",
                member_id="",
                generation=-1,
                acks=pb.ACKS_GEO,
                geo_sites=4,
                commits=[pb.PartitionCommit(topic=TOPIC)],
            )
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "reach only 3 site" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.CommitOffsets(
            pb.CommitOffsetsRequest(
                group="g", member_id="ghost", generation=3, commits=[pb.PartitionCommit(topic=TOPIC)]
            )
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "is not in group" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.CommitOffsets(
            pb.CommitOffsetsRequest(group="g", generation=-1, commits=[pb.PartitionCommit(topic="nope")])
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        stub.CreateTopic(pb.CreateTopicRequest(name="__georep_x", partitions=1))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "reserved" in err.value.details()
