"""A Kafka group fails over from a one-node site a to a 3-node site b (issue 23, done-when): at b, ``committed()``
is the offset of the first record a's commit does not cover, and the same client assigned there reads exactly the
records the commit does not cover, although b holds the two origins' records in another order than a (the filter
sits on the node that leads the partition, not on the group's coordinator)."""

from __future__ import annotations

from pathlib import Path

import pytest

from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.server.process import NodeProcess
from tests.support.channels import open_channel
from tests.support.cluster_site import ClusterSite, status, wait_for
from tests.support.kafka_nodes import poll_until
from tests.support.ports import free_ports

confluent_kafka = pytest.importorskip("confluent_kafka")
pytestmark = pytest.mark.slow

TOPIC = "orders"
PARTITIONS = 3
AT_A, AT_B = 300, 50  # records per partition produced at each site
COMMIT = 320  # at a: every record of a, and 20 of b's
Coordinate = tuple[str, int]


def produce(bootstrap: str, count: int, tag: bytes) -> None:
    p = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 300})
    for i in range(PARTITIONS * count):
        p.produce(TOPIC, value=tag + b"%d" % i, partition=i % PARTITIONS)
    assert p.flush(30) == 0


def watermarks(bootstrap: str) -> list[int]:
    c = confluent_kafka.Consumer({"bootstrap.servers": bootstrap, "group.id": "look"})
    try:
        return [c.get_watermark_offsets(confluent_kafka.TopicPartition(TOPIC, i), timeout=10)[1] for i in range(3)]
    except confluent_kafka.KafkaException:
        return []
    finally:
        c.close()


def coordinates(msg: object) -> Coordinate:
    headers = dict(msg.headers() or [])  # type: ignore[attr-defined]
    return headers["georep.origin"].decode(), int(headers["georep.origin_seq"])


def read(consumer: object, want: int) -> dict[int, list[tuple[int, Coordinate]]]:
    """(offset, coordinate) per partition, until ``want`` records, then a few more polls (which must add none)."""
    got: dict[int, list[tuple[int, Coordinate]]] = {i: [] for i in range(PARTITIONS)}

    def step() -> None:
        msg = consumer.poll(0.3)  # type: ignore[attr-defined]
        if msg is not None and msg.error() is None:
            got[msg.partition()].append((msg.offset(), coordinates(msg)))

    poll_until(f"{want} records are read", step, lambda: sum(map(len, got.values())) >= want, timeout_s=60)
    for _ in range(5):
        step()
    return got


def test_committed_at_a_three_node_site_is_exact_after_a_failover_from_a_one_node_site(tmp_path: Path) -> None:
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient, NewTopic

    a_port, a_kafka = free_ports(2)
    links = '[[links]]\nsrc = "a"\ndst = "b"\n[[links]]\nsrc = "b"\ndst = "a"\n'
    extra = ["--session-timeout-ms", "1500", "--kafka-commit-acks", "all"]
    b = ClusterSite(
        tmp_path,
        3,
        site="b",
        extra_args=extra,
        kafka=True,
        more_toml=f'[sites.a]\nnodes = ["127.0.0.1:{a_port}"]\n' + links,
    )
    a = NodeProcess(
        "a",
        tmp_path / "a",
        listen=f"127.0.0.1:{a_port}",
        extra_args=[
            *("--topology", str(b.topology), "--scrub-bytes-per-s", "0"),
            *("--kafka-listen", f"127.0.0.1:{a_kafka}", "--kafka-commit-acks", "geo:2"),
        ],
    )
    a.launch()
    b.start()
    a.wait_ready(60)
    # b's leaders spread over the nodes live when the topic reaches it: wait until all three are (under load a node
    # may serve before its first heartbeat commits).
    wait_for("every node of b live in its metadata", lambda: sum(n.live for n in status(b).nodes) == 3)
    at_a, at_b = f"127.0.0.1:{a_kafka}", ",".join(b.kafka_address(n) for n in (1, 2, 3))
    try:
        admin = AdminClient({"bootstrap.servers": at_a})  # kept until the result: its handle serves the future
        admin.create_topics([NewTopic(TOPIC, PARTITIONS, 1)])[TOPIC].result(15)
        for i in range(PARTITIONS):
            b.wait_leader(TOPIC, i)
        # b's records reach a only after a's own: the two sites hold them in other orders.
        with open_channel(a.address or f"127.0.0.1:{a_port}") as channel:
            pbg.NodeStub(channel).SetLink(pb.SetLinkRequest(src="b", enabled=False), timeout=5)
            produce(at_b, AT_B, b"b-")
            produce(at_a, AT_A, b"a-")
            poll_until("b holds a's records", lambda: None, lambda: watermarks(at_b) == [AT_A + AT_B] * PARTITIONS)
            pbg.NodeStub(channel).SetLink(pb.SetLinkRequest(src="b", enabled=True), timeout=5)
        poll_until("a holds b's records", lambda: None, lambda: watermarks(at_a) == [AT_A + AT_B] * PARTITIONS)

        group = {"group.id": "billing", "enable.auto.commit": False, "auto.offset.reset": "earliest"}
        committer = confluent_kafka.Consumer({"bootstrap.servers": at_a, "client.id": "billing-1", **group})
        committer.commit(offsets=[TopicPartition(TOPIC, i, COMMIT) for i in range(PARTITIONS)], asynchronous=False)
        committer.close()  # geo:2: b holds the commit

        snap = {"group.id": "snapshot", "enable.auto.commit": False}
        everything = {}
        for name, bootstrap in (("a", at_a), ("b", at_b)):
            c = confluent_kafka.Consumer({"bootstrap.servers": bootstrap, **snap})
            c.assign([TopicPartition(TOPIC, i, 0) for i in range(PARTITIONS)])
            everything[name] = read(c, PARTITIONS * (AT_A + AT_B))
            c.close()
        covered = {i: {coord for offset, coord in everything["a"][i] if offset < COMMIT} for i in range(PARTITIONS)}
        expected = {
            i: min(offset for offset, coord in everything["b"][i] if coord not in covered[i]) for i in range(PARTITIONS)
        }
        assert all(e < AT_B for e in expected.values()), "b's own records come first at b: a's commit skips some"

        resumer = confluent_kafka.Consumer({"bootstrap.servers": at_b, "client.id": "billing-1", **group})
        answered = resumer.committed([TopicPartition(TOPIC, i) for i in range(PARTITIONS)], timeout=30)
        assert {tp.partition: tp.offset for tp in answered} == expected
        resumer.assign(answered)
        got = read(resumer, sum(AT_A + AT_B - len(covered[i]) for i in range(PARTITIONS)))
        resumer.close()
        for i in range(PARTITIONS):
            assert [coord for _, coord in got[i]] == [c for _, c in everything["b"][i] if c not in covered[i]]
    finally:
        a.kill9()
        b.close()
