"""Topics created on first use (issue 25): sites whose topology lists ``auto_create`` patterns.

A producer's first metadata request (georep's and a Kafka client's) and a raw ``Produce`` create a missing topic
that a pattern matches, with the pattern's partitions and config; the topic replicates like any create. A name no
pattern matches is refused with what to do; a principal that may produce but not ``create_topic`` creates nothing;
two sites that each create one name while the other is down end with one definition, every record at both, and the
conflict of their configs shown; a 3-node site creates through its Raft metadata.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from georep.auth.principal import parse_principal
from georep.client.errors import PermissionDenied, UnknownTopic
from georep.client.producer import Producer
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.record.batch import RecordInput, encode_batch
from georep.security.tls import TlsConfig
from georep.server.process import NodeStartError
from tests.support.channels import open_channel
from tests.support.cluster_site import ClusterSite
from tests.support.kafka_nodes import KAFKA_ARGS, kafka_address
from tests.support.sites import Sites, catalog_synced, wait_until

AUTO_CREATE = [
    'auto_create = ["metrics/**", { pattern = "orders/**", partitions = 2, config = { retention_ms = "86400000" } }]'
]


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sites]:
    root = tmp_path_factory.mktemp("auto-create")
    net = Sites(
        root,
        ["a", "b"],
        [("a", "b"), ("b", "a")],
        tls_dir=root / "certs",
        site_lines={"a": AUTO_CREATE, "b": AUTO_CREATE},
        clients=("alice",),
    )
    try:
        net.start()
        yield net
    finally:
        net.close()


def _tls(sites: Sites, principal: str) -> TlsConfig:
    return TlsConfig.from_dir(sites.topology.parent / "certs", parse_principal(principal))


def _stub(sites: Sites, site: str, principal: str) -> pbg.NodeStub:
    return pbg.NodeStub(open_channel(sites.address(site), _tls(sites, principal)))


def _describe(sites: Sites, site: str, topic: str) -> pb.TopicDescription | None:
    try:
        out: pb.TopicDescription = sites.stub(site).DescribeTopic(pb.DescribeTopicRequest(name=topic), timeout=5)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.NOT_FOUND, exc
        return None
    return out


def _records(sites: Sites, site: str, topic: str) -> int:
    desc = _describe(sites, site, topic)
    return 0 if desc is None else sum(p.log_end_offset - p.log_start_offset for p in desc.partition_states)


def _produce(stub: pbg.NodeStub, topic: str, value: bytes) -> pb.ProduceResponse:
    batch = encode_batch([RecordInput(b"k", value, (), int(time.time() * 1000))])
    resp: pb.ProduceResponse = stub.Produce(
        pb.ProduceRequest(topic=topic, partition=0, batch=batch, acks=pb.ACKS_LEADER), timeout=15
    )
    return resp


async def _send(sites: Sites, site: str, topic: str, n: int, principal: str = "client:admin", **kw: object) -> None:
    async with Producer(sites.address(site), tls=_tls(sites, principal), linger_ms=1, **kw) as producer:  # type: ignore[arg-type]
        await asyncio.gather(*(producer.send(topic, b"v%d" % i, key=b"k%d" % i) for i in range(n)))


def test_a_producers_first_request_creates_the_topic_by_its_pattern_and_it_reaches_the_other_site(
    sites: Sites,
) -> None:
    assert _describe(sites, "a", "orders/eu/user123") is None
    asyncio.run(_send(sites, "a", "orders/eu/user123", 10))
    desc = _describe(sites, "a", "orders/eu/user123")
    assert desc is not None and desc.partitions == 2, desc
    assert desc.config["retention_ms"] == "86400000", dict(desc.config)  # the pattern's config
    assert _records(sites, "a", "orders/eu/user123") == 10
    wait_until("b holds the topic and its records", lambda: _records(sites, "b", "orders/eu/user123") == 10)
    asyncio.run(_send(sites, "a", "metrics/cpu", 1))  # a string pattern: one partition, the node's defaults
    metrics = _describe(sites, "a", "metrics/cpu")
    assert metrics is not None and metrics.partitions == 1


def test_new_topics_waiting_for_a_metadata_slot_survive_a_channel_replaced_meanwhile(
    sites: Sites, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A producer asks for at most METADATA_IN_FLIGHT partition counts at once. A request that waited for its slot
    while the channel was replaced (a timeout elsewhere reconnects) takes the new channel: once it took its stub
    before the wait, its call hit the closed channel, the task died and its records' futures never resolved (seen
    at 10,000 topics in bench/first_use.py)."""
    import georep.client.producer as producer_module

    monkeypatch.setattr(producer_module, "METADATA_IN_FLIGHT", 1)

    async def go() -> None:
        async with Producer(sites.address("a"), tls=_tls(sites, "client:admin")) as producer:
            futures = [producer.send(f"orders/slot/t{i}", b"v") for i in range(12)]
            for _ in range(5):  # every metadata task has its stub, or waits for a slot
                await asyncio.sleep(0)
            await producer._connection.reconnect(producer._connection.generation)
            await asyncio.wait_for(asyncio.gather(*futures), timeout=60)

    asyncio.run(go())
    assert all(_records(sites, "a", f"orders/slot/t{i}") == 1 for i in range(12))


def test_a_raw_produce_and_a_produce_stream_create_their_topic_too(sites: Sites) -> None:
    resp = _produce(sites.stub("a"), "orders/raw", b"one")
    assert not resp.HasField("error") and resp.base_offset == 0, resp
    desc = _describe(sites, "a", "orders/raw")
    assert desc is not None and desc.partitions == 2
    batch = encode_batch([RecordInput(b"k", b"v", (), int(time.time() * 1000))])
    requests = [
        pb.ProduceRequest(correlation_id=i, topic=t, partition=0, batch=batch, acks=pb.ACKS_LEADER)
        for i, t in enumerate(["orders/stream", "misc/stream", "orders/stream"])
    ]
    answers = {r.correlation_id: r for r in sites.stub("a").ProduceStream(iter(requests), timeout=15)}
    assert [answers[i].HasField("error") for i in range(3)] == [False, True, False], answers
    assert "does not exist" in answers[1].error.message
    assert (answers[0].base_offset, answers[2].base_offset) == (0, 1)  # the create did not reorder the stream
    assert _records(sites, "a", "orders/stream") == 2


def test_a_producer_that_does_not_allow_it_and_a_name_no_pattern_matches_create_nothing(sites: Sites) -> None:
    with pytest.raises(UnknownTopic, match="georep topic create"):
        asyncio.run(_send(sites, "a", "misc/x", 1))
    assert _describe(sites, "a", "misc/x") is None
    with pytest.raises(UnknownTopic):
        asyncio.run(_send(sites, "a", "orders/not-asked", 1, allow_auto_create_topics=False))
    assert _describe(sites, "a", "orders/not-asked") is None
    with pytest.raises(grpc.RpcError) as info:
        _produce(sites.stub("a"), "misc/raw", b"x")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "does not exist" in str(info.value.details())
    assert _describe(sites, "a", "__georep_made_up") is None


def test_the_produce_acl_alone_creates_nothing_and_create_topic_is_asked_for(sites: Sites) -> None:
    admin = sites.stub("a")
    admin.PutAcl(pb.PutAclRequest(principal="client:alice", operation="produce", resource="topic:orders/**"))
    alice = _stub(sites, "a", "client:alice")
    with pytest.raises(grpc.RpcError) as info:
        _produce(alice, "orders/alice", b"x")
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value
    for part in ("auto_create pattern orders/**", "create_topic", "client:alice", "georep topic create orders/alice"):
        assert part in str(info.value.details()), info.value.details()
    with pytest.raises(PermissionDenied, match="create_topic"):
        asyncio.run(_send(sites, "a", "orders/alice", 1, principal="client:alice"))
    assert _describe(sites, "a", "orders/alice") is None
    admin.PutAcl(pb.PutAclRequest(principal="client:alice", operation="create_topic", resource="topic:orders/**"))
    asyncio.run(_send(sites, "a", "orders/alice", 3, principal="client:alice"))
    assert _records(sites, "a", "orders/alice") == 3


@pytest.mark.slow  # node processes through several steps: make test runs it, test-quick does not
def test_two_sites_that_create_one_name_apart_agree_on_one_definition_and_show_the_conflict(tmp_path: Path) -> None:
    """Each site creates ``orders/race`` on first use while the other is down (so neither has learnt the other's),
    each by its own pattern's config: once both run, they hold one definition, every record, and the conflict."""
    hour = ['auto_create = [{ pattern = "orders/**", partitions = 2, config = { retention_ms = "3600000" } }]']
    net = Sites(tmp_path, ["a", "b"], [("a", "b"), ("b", "a")], site_lines={"a": AUTO_CREATE, "b": hour})
    try:
        net.start()
        wait_until(
            "each site synced the other's catalog once",
            lambda: all(catalog_synced(net.nodes[s].data_dir) for s in "ab"),
        )
        net.nodes["b"].stop()
        asyncio.run(_send_plain(net, "a", "orders/race", 3))
        net.nodes["a"].stop()
        net.nodes["b"].start()
        asyncio.run(_send_plain(net, "b", "orders/race", 4))
        net.nodes["a"].start()
        wait_until("both sites hold all 7 records", lambda: all(_records(net, s, "orders/race") == 7 for s in "ab"))
        a, b = _describe(net, "a", "orders/race"), _describe(net, "b", "orders/race")
        assert a is not None and b is not None
        assert (a.partitions, dict(a.config)) == (b.partitions, dict(b.config))
        assert a.config["retention_ms"] in ("86400000", "3600000")
        conflicts = [c for s in "ab" for c in net.status(s).config_conflicts if c.topic == "orders/race"]
        assert conflicts and "retention_ms" in conflicts[0].message, conflicts
    finally:
        net.close()


async def _send_plain(sites: Sites, site: str, topic: str, n: int) -> None:
    async with Producer(sites.address(site), linger_ms=1) as producer:
        await asyncio.gather(*(producer.send(topic, b"v%d" % i, key=b"k%d" % i) for i in range(n)))


def test_a_bad_config_in_a_pattern_fails_the_node_at_start_naming_it(tmp_path: Path) -> None:
    bad = ['auto_create = [{ pattern = "orders/**", config = { retention_ms = "soon" } }]']
    net = Sites(tmp_path, ["a"], [], site_lines={"a": bad})
    try:
        with pytest.raises(NodeStartError) as info:  # its message ends with the node's log
            net.start()
        text = str(info.value)
        assert "auto_create pattern orders/**" in text and "retention_ms" in text, text
    finally:
        net.close()


@pytest.mark.slow  # node processes through several steps: make test runs it, test-quick does not
def test_kafka_clients_create_by_pattern_through_metadata_as_kafka_brokers_do(tmp_path: Path) -> None:
    """librdkafka's producer asks Metadata with allow_auto_topic_creation and creates the topic; a kafka-python
    consumer (allow_auto_create_topics off, as Kafka's consumers default to) and a name no pattern matches create
    nothing."""
    confluent_kafka = pytest.importorskip("confluent_kafka")
    kafka = pytest.importorskip("kafka")
    net = Sites(tmp_path, ["a"], [], extra_args=KAFKA_ARGS, site_lines={"a": AUTO_CREATE})
    try:
        net.start()
        bootstrap = kafka_address(net.nodes["a"])
        producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "acks": "all"})
        delivered: list[object] = []
        for i in range(5):
            producer.produce("orders/kafka/u1", value=b"v%d" % i, on_delivery=lambda err, _m: delivered.append(err))
        assert producer.flush(30) == 0 and delivered == [None] * 5, delivered
        desc = _describe(net, "a", "orders/kafka/u1")
        assert desc is not None and desc.partitions == 2 and _records(net, "a", "orders/kafka/u1") == 5
        consumer = kafka.KafkaConsumer(bootstrap_servers=bootstrap, allow_auto_create_topics=False)
        try:
            assert not consumer.partitions_for_topic("orders/kafka/u2")
        finally:
            consumer.close()
        assert _describe(net, "a", "orders/kafka/u2") is None
        metadata = producer.list_topics("misc/kafka", timeout=10)  # asks with allow_auto_topic_creation
        assert metadata.topics["misc/kafka"].error is not None
        assert _describe(net, "a", "misc/kafka") is None
    finally:
        net.close()


@pytest.mark.slow
def test_a_multi_node_site_creates_on_first_use_through_its_raft_metadata(tmp_path: Path) -> None:
    """A 3-node site: the create is the site's Raft command, and the producer reaches each new partition's leader."""
    site = ClusterSite(tmp_path, 3, more_toml=AUTO_CREATE[0] + "\n")
    try:
        site.start()

        async def produce() -> None:
            async with Producer(site.address(1), linger_ms=1) as producer:
                await asyncio.gather(*(producer.send("orders/cluster", b"v%d" % i, key=b"k%d" % i) for i in range(20)))

        asyncio.run(produce())
        for node in (1, 2, 3):
            stub = pbg.NodeStub(open_channel(site.address(node), None))
            desc = stub.DescribeTopic(pb.DescribeTopicRequest(name="orders/cluster"), timeout=10)
            assert desc.partitions == 2 and desc.config["retention_ms"] == "86400000", desc
    finally:
        site.close()
