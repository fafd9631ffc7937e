"""Kafka clients against a multi-node site (issue 13: every node serves the Kafka protocol): Metadata names each
partition's georep leader, clients bootstrapped at one node follow the leaders, and a leader killed mid-produce
loses and duplicates nothing acknowledged. Unit tests of the view's decisions (georep/kafka/cluster.py) first."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.site_state import NodeInfo, PartitionInfo, SegmentInfo, SiteState
from georep.kafka import errors as k
from georep.kafka.cluster import LEADER_NOT_AVAILABLE, NO_LEADER, ClusterView, KafkaBroker, OneNode
from offsets.commits import OFFSETS_TOPIC, offsets_partition
from tests.support.cluster_site import ClusterSite, site_toml, status, wait_for
from tests.support.kafka_nodes import poll_until
from topology.ids import NodeId, SegmentId

KAFKA = {1: "10.0.0.1:9092", 2: "10.0.0.2:9092", 3: "10.0.0.3:9092"}


def view(partitions: list[PartitionInfo], live: set[int], me: int = 1) -> ClusterView:
    return ClusterView(me, frozenset(live), KAFKA, {(p.topic, p.partition): p for p in partitions})


def opened(*ensemble: int) -> tuple[SegmentInfo, ...]:
    return (SegmentInfo(SegmentId(1), 0, tuple(NodeId(n) for n in ensemble), 1),)  # type: ignore[arg-type]


def part(
    index: int, leader: int | None, epoch: int = 3, ensemble: tuple[int, ...] = (2, 3, 1), topic: str = "t"
) -> PartitionInfo:
    return PartitionInfo(
        topic,
        index,
        None if leader is None else NodeId(leader),
        epoch,  # type: ignore[arg-type]
        opened(*ensemble),
    )


def test_metadata_names_georep_leaders_epochs_and_ensembles() -> None:
    v = view([part(0, 2), part(1, 3, epoch=7, ensemble=(3, 1))], live={1, 2, 3})
    assert v.brokers() == [
        KafkaBroker(1, "10.0.0.1", 9092),
        KafkaBroker(2, "10.0.0.2", 9092),
        KafkaBroker(3, "10.0.0.3", 9092),
    ]
    r0, r1 = v.route("t", 0), v.route("t", 1)
    assert (r0.error, r0.leader, r0.leader_epoch, r0.replicas, r0.isr) == (0, 2, 3, (2, 3, 1), (2, 3, 1))
    assert (r1.error, r1.leader, r1.leader_epoch, r1.replicas) == (0, 3, 7, (3, 1))


def test_a_dead_or_missing_leader_is_leader_not_available_and_dead_nodes_are_not_brokers() -> None:
    v = view([part(0, 2), part(1, None), part(2, 3)], live={1, 3})
    assert [b.node_id for b in v.brokers()] == [1, 3]
    dead = v.route("t", 0)
    assert (dead.error, dead.leader, dead.isr) == (LEADER_NOT_AVAILABLE, NO_LEADER, (3, 1))
    assert v.route("t", 1).error == LEADER_NOT_AVAILABLE
    assert v.route("t", 9).error == LEADER_NOT_AVAILABLE  # not in this node's view yet
    assert v.route("t", 2).leader == 3


def test_a_request_to_a_node_that_does_not_serve_the_partition() -> None:
    v = view([part(0, 2), part(1, None), part(2, 1)], live={1, 2, 3}, me=1)
    assert v.not_served("t", 0) == k.NOT_LEADER_OR_FOLLOWER  # the client's metadata is stale: it asks again
    assert v.not_served("t", 1) == LEADER_NOT_AVAILABLE  # no leader: it waits
    assert v.not_served("t", 2) == LEADER_NOT_AVAILABLE  # named here, not serving yet (opening its segment)


def test_a_groups_coordinator_is_the_live_leader_of_its_offsets_partition() -> None:
    """As georep's own group calls find it: FindCoordinator names the leader of ``offsets_partition(group)``."""
    index = offsets_partition("g")
    led = part(index, 3, topic=OFFSETS_TOPIC)
    assert view([led], live={1, 2, 3}).coordinator("g") == KafkaBroker(3, "10.0.0.3", 9092)
    assert view([led], live={1, 2}).coordinator("g") is None, "a dead leader: COORDINATOR_NOT_AVAILABLE, retried"
    assert view([part(index, None, topic=OFFSETS_TOPIC)], live={1, 2, 3}).coordinator("g") is None
    assert view([], live={1, 2, 3}).coordinator("g") is None, "the internal topic is not in the view yet"


def test_a_one_node_site_is_one_broker_leading_everything() -> None:
    one = OneNode("127.0.0.1", 9101)
    assert one.brokers() == [KafkaBroker(0, "127.0.0.1", 9101)]
    assert one.route("t", 5).leader == 0
    assert one.coordinator("g") == KafkaBroker(0, "127.0.0.1", 9101)


def test_the_view_of_a_site_state_takes_live_nodes_from_heartbeats() -> None:
    state = SiteState()
    state._nodes = {
        NodeId(1): NodeInfo(NodeId(1), "a:1", 10_000),
        NodeId(2): NodeInfo(NodeId(2), "a:2", 1_000),
        NodeId(3): NodeInfo(NodeId(3), "a:3", None),
    }
    state._partitions = {("t", 0): part(0, 2)}
    v = ClusterView.of(state, 3, KAFKA, now_ms=10_500, session_timeout_ms=6_000)
    assert v.live == frozenset({1, 3})  # node 2's last heartbeat is too old; this node (3) is live
    assert v.route("t", 0).error == LEADER_NOT_AVAILABLE


def test_up_gives_every_node_of_a_multi_node_site_its_kafka_listener(tmp_path: Path) -> None:
    from georep.cli.up import kafka_warnings, site_processes
    from topology.model import parse_topology

    toml = site_toml("a", [7201, 7202, 7203], [7211, 7212, 7213], [9201, 9202, 9203])
    path = tmp_path / "t.toml"
    path.write_text(toml)
    procs = site_processes(parse_topology(toml), path, tmp_path, [], None)
    listens = [p.extra_args[p.extra_args.index("--kafka-listen") + 1] for p in procs]
    assert listens == ["127.0.0.1:9201", "127.0.0.1:9202", "127.0.0.1:9203"]
    bare = parse_topology(site_toml("a", [7201, 7202], [7211, 7212]))
    assert all("--kafka-listen" not in p.extra_args for p in site_processes(bare, path, tmp_path, [], None))
    assert kafka_warnings(bare) and not kafka_warnings(parse_topology(toml))


# -- real clients against a 3-node site ---------------------------------------------------------------------------

confluent_kafka = pytest.importorskip("confluent_kafka")

TOPIC = "spread"
PARTITIONS = 6
COUNT = 300


@pytest.fixture
def site(tmp_path: Path) -> Iterator[ClusterSite]:
    s = ClusterSite(tmp_path, 3, extra_args=["--session-timeout-ms", "1500"], kafka=True)
    s.start()
    # Leaders spread over the nodes live when a topic is created: under load a node may serve before its first
    # heartbeat commits, and a topic created then would be led by the others only.
    wait_for("every node live in the site's metadata", lambda: sum(n.live for n in status(s).nodes) == 3)
    yield s
    s.close()


def leaders(bootstrap: str) -> dict[int, int]:
    md = confluent_kafka.admin.AdminClient({"bootstrap.servers": bootstrap}).list_topics(TOPIC, timeout=10)
    return {i: p.leader for i, p in md.topics[TOPIC].partitions.items()}


def read_all(bootstrap: str, partitions: int, want: int) -> dict[int, list[bytes]]:
    c = confluent_kafka.Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "reader",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )
    c.assign([confluent_kafka.TopicPartition(TOPIC, i, confluent_kafka.OFFSET_BEGINNING) for i in range(partitions)])
    got: dict[int, list[bytes]] = {i: [] for i in range(partitions)}

    def step() -> None:
        m = c.poll(0.5)
        if m is not None and m.error() is None:
            got[m.partition()].append(m.value())

    try:
        poll_until(f"{want} records are read back", step, lambda: sum(map(len, got.values())) >= want)
        for _ in range(4):  # and nothing more (a duplicate) arrives
            step()
    finally:
        c.close()
    return got


def request(address: str, api_key: int, version: int, body: bytes) -> bytes:
    """One raw request (header v1, client id "t"); the response after its correlation id."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        frame = struct.pack(">hhih", api_key, version, 1, 1) + b"t" + body
        sock.sendall(struct.pack(">i", len(frame)) + frame)
        data = b""
        while len(data) < 4 or len(data) < 4 + struct.unpack_from(">i", data)[0]:
            chunk = sock.recv(65536)
            assert chunk, "connection closed"
            data += chunk
    return data[8:]


def string(text: str) -> bytes:
    return struct.pack(">h", len(text)) + text.encode()


def list_offsets_code(address: str, partition: int) -> int:
    body = struct.pack(">i", -1) + struct.pack(">i", 1) + string(TOPIC) + struct.pack(">iiq", 1, partition, -1)
    resp = request(address, 2, 1, body)
    at = 4 + 2 + len(TOPIC) + 4 + 4  # topics count, name, partitions count, partition index
    return int(struct.unpack_from(">h", resp, at)[0])


def check_site_settings(admin: object) -> None:
    """A topic's min.insync.replicas defaults to the site's (--min-insync-replicas, 2 of 3 here): described; a
    topic may ask its own, up to its replication factor (issue 23)."""
    from confluent_kafka.admin import ConfigResource, NewTopic

    resource = ConfigResource(ConfigResource.Type.TOPIC, TOPIC)
    configs = admin.describe_configs([resource])[resource].result(15)  # type: ignore[attr-defined]
    assert configs["min.insync.replicas"].value == "2"
    refused = NewTopic("four-insync", 1, 3, config={"min.insync.replicas": "4"})
    with pytest.raises(confluent_kafka.KafkaException) as error:
        admin.create_topics([refused])["four-insync"].result(15)  # type: ignore[attr-defined]
    assert error.value.args[0].code() == k.INVALID_CONFIG and "1 to 3" in error.value.args[0].str()
    one_copy = NewTopic("one-copy", 1, 1)  # a copy fewer than every write needs: refused, not silently raised
    with pytest.raises(confluent_kafka.KafkaException) as error:
        admin.create_topics([one_copy])["one-copy"].result(15)  # type: ignore[attr-defined]
    assert error.value.args[0].code() == k.INVALID_REPLICATION_FACTOR and "at least 2" in error.value.args[0].str()


def test_clients_follow_partition_leaders_across_nodes_and_a_killed_leader(site: ClusterSite) -> None:
    bootstrap = site.kafka_address(1)  # the only address the clients are given
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(TOPIC, PARTITIONS, 3)])[TOPIC].result(15)
    check_site_settings(admin)
    found: dict[int, int] = {}
    poll_until(
        "every partition has a leader",
        lambda: found.update(leaders(bootstrap)),
        lambda: len(found) == PARTITIONS and all(n > 0 for n in found.values()),
    )
    assert len(set(found.values())) > 1, found  # the partitions are led by different nodes
    victim_partition, victim = next((i, n) for i, n in sorted(found.items()) if n != 1)
    other = next(n for n in (1, 2, 3) if n != victim)
    assert site.wait_leader(TOPIC, victim_partition) == victim  # serving it (its segment is open)
    assert list_offsets_code(site.kafka_address(victim), victim_partition) == 0
    assert list_offsets_code(site.kafka_address(other), victim_partition) == k.NOT_LEADER_OR_FOLLOWER

    p = confluent_kafka.Producer(
        {
            "bootstrap.servers": bootstrap,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 5,
            "message.timeout.ms": 60_000,
        }
    )
    acked: dict[int, list[bytes]] = {i: [] for i in range(PARTITIONS)}
    errors: list[object] = []

    def delivered(err: object, msg: object) -> None:
        if err is not None:
            errors.append(err)
        else:
            acked[msg.partition()].append(msg.value())  # type: ignore[attr-defined]

    for i in range(COUNT):
        p.produce(TOPIC, value=b"v-%d" % i, partition=i % PARTITIONS, on_delivery=delivered)
        p.poll(0)
        if i == COUNT // 2:
            site.nodes[victim].kill9()  # the leader of victim_partition, with records in flight to it
    assert p.flush(60) == 0
    assert errors == []
    sent = {i: [b"v-%d" % n for n in range(i, COUNT, PARTITIONS)] for i in range(PARTITIONS)}
    assert acked == sent  # every record acknowledged, each partition in order (the idempotent producer)
    moved = site.wait_leader(TOPIC, victim_partition, not_node=victim)
    assert moved != victim

    got = read_all(bootstrap, PARTITIONS, COUNT)
    assert got == sent  # nothing acknowledged lost, nothing twice, in order
