"""A Kafka consumer group on a 3-node site (issue 23): FindCoordinator names the leader of the group's
``__georep_offsets`` partition; commits of partitions other nodes lead get their exact vectors from those
leaders; the group rebalances and commits through a ``kill -9`` of its coordinator node and then of a partition
leader node, and nothing a successful commit covered is delivered again."""

from __future__ import annotations

import multiprocessing
import struct
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from tests.support.cluster_site import ClusterSite, status, wait_for
from tests.support.kafka_nodes import poll_until
from tests.test_kafka_cluster import request, string

confluent_kafka = pytest.importorskip("confluent_kafka")
pytestmark = pytest.mark.slow

TOPIC = "orders"
PARTITIONS = 3
COUNT = 300
GROUP = "billing"


@pytest.fixture
def site(tmp_path: Path) -> Iterator[ClusterSite]:
    # Kafka commits at the ack quorum: the default of a node of a multi-node site
    s = ClusterSite(tmp_path, 3, extra_args=["--session-timeout-ms", "1500"], kafka=True)
    s.start()
    # Leaders spread over the nodes live when a topic is created: under load a node may serve before its first
    # heartbeat commits, and a topic created then would be led by the others only.
    wait_for("every node live in the site's metadata", lambda: sum(n.live for n in status(s).nodes) == 3)
    yield s
    s.close()


def coordinator(site: ClusterSite, group: str = GROUP) -> int:
    """The node FindCoordinator names for ``group``, asked of every live node until one answers."""
    found: list[int] = []

    def ask() -> None:
        for n in site.live():
            answer = request(site.kafka_address(n), 10, 0, string(group))
            code, node = struct.unpack_from(">hi", answer)
            if code == 0:
                found.append(node)
                return
        time.sleep(0.2)

    poll_until("a node names the group's coordinator", ask, lambda: bool(found), timeout_s=60)
    return found[-1]


class Group:
    """Two members of one group, committing synchronously after each poll; every delivery checked against the
    highest offset a successful commit covered when it was delivered."""

    def __init__(self, bootstrap: str) -> None:
        config = {
            "bootstrap.servers": bootstrap,
            "group.id": GROUP,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "session.timeout.ms": 6000,
            "heartbeat.interval.ms": 300,
        }
        self.members = [confluent_kafka.Consumer({**config, "client.id": f"m{i}"}) for i in range(2)]
        for m in self.members:
            m.subscribe([TOPIC])
        self.got: set[tuple[int, bytes]] = set()
        self.committed = dict.fromkeys(range(PARTITIONS), 0)  # per partition: what successful commits covered
        self.again: list[str] = []

    def step(self) -> None:
        for i, m in enumerate(self.members):
            msgs = [x for x in m.consume(num_messages=10, timeout=0.2) if x.error() is None]
            for x in msgs:
                if x.offset() < self.committed[x.partition()]:
                    below = f"{x.partition()}@{x.offset()} below the commit {self.committed[x.partition()]}"
                    self.again.append(f"m{i}: {below}")
                self.got.add((x.partition(), x.value()))
            if not msgs:
                continue
            try:
                done = m.commit(asynchronous=False)
            except confluent_kafka.KafkaException:
                continue  # a coordinator going away: the next commit covers these too
            for tp in done or []:
                if tp.error is None and tp.offset >= 0:
                    self.committed[tp.partition] = max(self.committed[tp.partition], tp.offset)

    def close(self) -> None:
        for m in self.members:
            m.close()


class Repaired:
    """Whether the site lists no under-replicated segment (asked at most twice a second)."""

    def __init__(self, site: ClusterSite) -> None:
        self.site = site
        self.asked = 0.0

    def __call__(self) -> bool:
        if time.monotonic() - self.asked < 0.5:
            return False
        self.asked = time.monotonic()
        try:
            return not status(self.site).under_replicated
        except AssertionError:  # no node answers yet
            return False


def produce(bootstrap: str) -> set[tuple[int, bytes]]:
    p = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all"})
    sent = set()
    for i in range(COUNT):
        p.produce(TOPIC, value=b"v-%d" % i, partition=i % PARTITIONS)
        sent.add((i % PARTITIONS, b"v-%d" % i))
    assert p.flush(60) == 0
    return sent


def test_a_group_commits_and_rebalances_through_the_kill_of_its_coordinator_and_of_a_leader(
    site: ClusterSite,
) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    bootstrap = ",".join(site.kafka_address(n) for n in (1, 2, 3))
    admin = AdminClient({"bootstrap.servers": bootstrap})  # kept until the result: its handle serves the future
    admin.create_topics([NewTopic(TOPIC, PARTITIONS, 3)])[TOPIC].result(15)
    for i in range(PARTITIONS):
        site.wait_leader(TOPIC, i)
    sent = produce(bootstrap)
    chosen = coordinator(site)
    led_elsewhere = [i for i in range(PARTITIONS) if site.leader(TOPIC, i) != chosen]
    assert led_elsewhere, "the coordinator commits partitions other nodes lead: their vectors come from there"
    group = Group(bootstrap)
    try:
        poll_until("a third is read and committed", group.step, lambda: sum(group.committed.values()) >= COUNT // 3)
        site.nodes[chosen].kill9()
        poll_until("two thirds are read and committed", group.step, lambda: len(group.got) >= 2 * COUNT // 3)
        site.nodes[chosen].launch()  # back, so that the site keeps its Raft majority through the next kill
        site.nodes[chosen].wait_ready(60)
        # Segments opened while it was down have the two other nodes only: a kill of one of them would leave
        # fewer than min_insync_replicas, so the site first repairs them onto the node that came back.
        poll_until("every segment is fully replicated again", group.step, Repaired(site), timeout_s=90)
        now = coordinator(site)
        victim = next(n for n in (site.leader(TOPIC, i) for i in range(PARTITIONS)) if n is not None and n != now)
        site.nodes[victim].kill9()
        poll_until("every record is read", group.step, lambda: group.got >= sent, timeout_s=120)
    finally:
        group.close()
    assert group.got == sent
    assert group.again == [], "records a successful commit covered were delivered again"


def kafka_python_resumes(bootstrap: str, group: str, want: int) -> tuple[int, list[int]]:
    """A kafka-python member of ``group``: (records it reads until ``want`` (0: until it polls nothing for a while
    once it has partitions), the group's committed offsets after it commits).

    In a process of its own: kafka-python leaves the socket of a connect a killed node refused (laddr 0.0.0.0) to
    the garbage collector, past its consumer's close, and the warning then fails whichever later test collects it.
    The process takes its sockets along when it ends."""
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn) as pool:
        return pool.submit(_kafka_python_member, bootstrap, group, want).result(timeout=120)


def _kafka_python_member(bootstrap: str, group: str, want: int) -> tuple[int, list[int]]:
    from kafka import KafkaConsumer, TopicPartition
    from kafka.errors import KafkaConnectionError

    c = KafkaConsumer(
        TOPIC,
        bootstrap_servers=bootstrap,
        group_id=group,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        session_timeout_ms=6000,
        heartbeat_interval_ms=300,
    )
    got = 0
    empty = 0
    deadline = time.monotonic() + 60
    try:
        quiet = 10 if want == 0 else 100  # empty polls that end the read
        while (got < want or want == 0 or not c.assignment()) and empty < quiet and time.monotonic() < deadline:
            try:
                batch = c.poll(200)
            except KafkaConnectionError:  # kafka-python raises a refused connection to a dead coordinator: again
                continue
            got += sum(len(msgs) for msgs in batch.values())
            empty = 0 if batch or not c.assignment() else empty + 1
        assert c.assignment(), "the member got no partitions within 60 s"
        c.commit()
        return got, [c.committed(TopicPartition(TOPIC, i)) or 0 for i in range(PARTITIONS)]
    finally:
        c.close()


def aiokafka_reads(bootstrap: str, group: str, want: int) -> int:
    import asyncio

    import aiokafka

    async def run() -> int:
        c = aiokafka.AIOKafkaConsumer(
            TOPIC, bootstrap_servers=bootstrap, group_id=group, auto_offset_reset="earliest", enable_auto_commit=False
        )
        await c.start()
        got = 0
        try:
            async with asyncio.timeout(60):
                while got < want:
                    got += sum(len(m) for m in (await c.getmany(timeout_ms=500)).values())
            await c.commit()
            return got
        finally:
            await c.stop()

    return asyncio.run(run())


def test_kafka_python_and_aiokafka_groups_commit_on_a_three_node_site_and_resume_after_a_coordinator_kill(
    site: ClusterSite,
) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    bootstrap = ",".join(site.kafka_address(n) for n in (1, 2, 3))
    admin = AdminClient({"bootstrap.servers": bootstrap})  # kept until the result: its handle serves the future
    admin.create_topics([NewTopic(TOPIC, PARTITIONS, 3)])[TOPIC].result(15)
    for i in range(PARTITIONS):
        site.wait_leader(TOPIC, i)
    produce(bootstrap)
    ends = [COUNT // PARTITIONS] * PARTITIONS
    assert kafka_python_resumes(bootstrap, "kp", COUNT) == (COUNT, ends)
    assert aiokafka_reads(bootstrap, "ak", COUNT) == COUNT
    killed = coordinator(site, "kp")
    site.nodes[killed].kill9()  # the commit survives on the others (acks=all)
    poll_until("another node coordinates kp", lambda: time.sleep(0.2), lambda: coordinator(site, "kp") != killed)
    assert kafka_python_resumes(bootstrap, "kp", 0) == (0, ends), "a member of kp read committed records again"
