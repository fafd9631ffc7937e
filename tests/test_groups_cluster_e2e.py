"""A consumer group on a three-node site (RF 3, min-insync 2) of real ``georep node`` processes: its coordinator,
the leader of the group's ``__georep_offsets`` partition, is killed with ``kill -9`` while two members consume and
commit at ``acks=all``, and half the records are written after the kill. The members find the new coordinator,
rejoin, and the group goes on from its commits: every record is delivered, and none that a commit covered is
delivered again."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from georep.cli.group import _ask
from georep.client.consumer import Consumer, TopicPartition
from georep.client.errors import GeorepError
from georep.client.producer import Producer
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from offsets.commits import OFFSETS_TOPIC, offsets_partition
from offsets.vector import VectorOffset
from tests.support.channels import open_channel
from tests.support.cluster_site import ClusterSite

TOPIC = "orders"
GROUP = "billing"
PARTITIONS = 4
RECORDS = 400


class GroupRun:
    """Two members that poll and commit what they polled; every delivery is checked against the commits that
    had succeeded when it came."""

    def __init__(self) -> None:
        self.delivered: dict[bytes, int] = {}
        self.committed: dict[TopicPartition, VectorOffset] = {}
        self.violations: list[str] = []

    async def member(self, consumer: Consumer, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                records = await consumer.poll(timeout_ms=200, max_records=20)
            except GeorepError:
                await asyncio.sleep(0.1)  # a node went away under the poll: the consumer reconnects
                continue
            for r in records:
                value = bytes(r.value or b"")
                covered = self.committed.get((r.topic, r.partition), VectorOffset())
                if value in self.delivered and r.origin_seq < covered.get(r.origin):
                    self.violations.append(f"{value!r} delivered again though a commit covered it")
                self.delivered[value] = self.delivered.get(value, 0) + 1
            if not records:
                continue
            offsets = {tp: consumer.vector(tp) for tp in consumer.assignment()}
            membership = consumer._group
            assert membership is not None
            generation = (membership.member_id, membership.generation)
            try:
                await consumer.commit(offsets)
            except GeorepError:
                continue  # a rebalance or the coordinator's death: what was not committed may come again
            if (membership.member_id, membership.generation) != generation:
                # A rebalance during the call: the commit retried with only the partitions still assigned, so
                # which of these it covered is not known here. Counting none only makes the check weaker.
                continue
            for tp, vector in offsets.items():
                self.committed[tp] = self.committed.get(tp, VectorOffset()).merge(vector)

    async def until(self, count: int, timeout_s: float, committed: bool = False) -> None:
        deadline = time.monotonic() + timeout_s
        while (len(self.delivered) < count or (committed and not self.committed)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


@pytest.mark.slow
def test_a_group_resumes_from_its_commits_after_its_coordinator_is_killed(tmp_path: Path) -> None:
    site = ClusterSite(tmp_path, 3, extra_args=["--session-timeout-ms", "1500"])
    try:
        site.start()
        with open_channel(site.address(1)) as channel:
            pbg.NodeStub(channel).CreateTopic(pb.CreateTopicRequest(name=TOPIC, partitions=PARTITIONS), timeout=30)
            # The site has no internal topic until its first group call, which creates it (as Kafka does); the
            # call itself finds no coordinator yet, or this node is it.
            try:
                pbg.NodeStub(channel).FetchCommitted(pb.FetchCommittedRequest(group=GROUP), timeout=30)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc  # type: ignore[attr-defined]
        for partition in range(PARTITIONS):
            site.wait_leader(TOPIC, partition)
        coordinator = site.wait_leader(OFFSETS_TOPIC, offsets_partition(GROUP))
        others = [n for n in site.nodes if n != coordinator]
        run = GroupRun()
        survivor = asyncio.run(_drive(site, coordinator, others, run))
        assert not run.violations, run.violations[:3]
        missing = [f"r{i}".encode() for i in range(RECORDS) if f"r{i}".encode() not in run.delivered]
        assert not missing, f"{len(missing)} records never delivered, e.g. {missing[:3]}"
        assert survivor != coordinator
    finally:
        site.close()


async def _drive(site: ClusterSite, coordinator: int, others: list[int], run: GroupRun) -> int:
    everyone = ",".join(site.address(n) for n in [*others, coordinator])

    async def produce(first: int, last: int) -> None:  # half before the kill, half after it
        async with Producer(everyone, acks="all", linger_ms=2, delivery_timeout_ms=60_000) as producer:
            await asyncio.gather(
                *(producer.send(TOPIC, f"r{i}".encode(), key=f"k{i}".encode()) for i in range(first, last))
            )

    await produce(0, RECORDS // 2)
    options = {
        "group_id": GROUP,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "commit_acks": "all",
        "session_timeout_ms": 3000,
        "max_wait_ms": 200,
    }
    # One member is connected to the coordinator itself (it loses its connection too), the other to another node
    # (it follows the NOT_LEADER hint to the coordinator).
    first = Consumer(",".join(site.address(n) for n in [coordinator, *others]), client_id="m1", **options)
    second = Consumer(everyone, client_id="m2", **options)
    stop = asyncio.Event()
    async with first, second:
        first.subscribe([TOPIC])
        second.subscribe([TOPIC])
        tasks = [asyncio.create_task(run.member(c, stop)) for c in (first, second)]
        await run.until(RECORDS // 4, 30, committed=True)
        before = dict(run.committed)
        assert before, "nothing was committed before the kill: the test proves nothing"
        site.nodes[coordinator].kill9()
        await produce(RECORDS // 2, RECORDS)
        loop = asyncio.get_running_loop()
        survivor = await loop.run_in_executor(
            None, lambda: site.wait_leader(OFFSETS_TOPIC, offsets_partition(GROUP), not_node=coordinator)
        )
        await run.until(RECORDS, 60)
        stop.set()
        await asyncio.gather(*tasks)
        # The commits made before the kill survived it: the new coordinator holds them, or later ones.
        after = await second.committed(sorted(before))
        for tp, vector in before.items():
            assert tp in after and vector.dominated_by(after[tp].vector), f"{tp}: commit {vector} lost"
        # `georep group list` asks every leader of the internal topic and finds the group.
        _site, listed = await _ask(site.address(others[0]), "list", "")
        assert isinstance(listed, pb.ListGroupsResponse)
        assert GROUP in [g.group for g in listed.groups]
        # `georep group describe` reaches the coordinator from any node, and each partition's lag from its leader.
        # (The members may have read everything before their heartbeats found the new coordinator: wait for both.)
        deadline = time.monotonic() + 30
        while True:
            _site, described = await _ask(site.address(others[0]), "describe", GROUP)
            assert isinstance(described, pb.GroupDescription)
            if len(described.members) == 2 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        assert sorted(m.client_id for m in described.members) == ["m1", "m2"], "the members did not rejoin"
        assert sorted((c.topic, c.partition) for c in described.offsets) == [(TOPIC, p) for p in range(PARTITIONS)]
        assert all(c.lag_records >= 0 for c in described.offsets), described.offsets
    return survivor
