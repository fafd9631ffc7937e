"""Topic delete on a three-node site of real ``georep node`` processes (issue 23): ``georep topic delete`` at one
node deletes the topic at every node (through the site's Raft state), each node removes its segment copies, a
node that was down during the delete removes its own when it comes back, and the topic created again starts
empty, with no record of the deleted incarnation readable."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.record.batch import RecordInput, encode_batch
from tests.support.channels import open_channel
from tests.support.cli import georep, ok
from tests.support.cluster_site import TOPIC, ClusterSite, beside, produce, read_partition, wait_for
from tests.support.ports import free_ports

confluent_kafka = pytest.importorskip("confluent_kafka")

from confluent_kafka.admin import AdminClient  # noqa: E402

pytestmark = pytest.mark.slow  # three node processes


def copies(site: ClusterSite, node: int) -> list[str]:
    """The directories of ``TOPIC``'s segment copies in ``node``'s data dir (any incarnation)."""
    replicas = site.nodes[node].data_dir / "replicas"
    return sorted(d.name for d in replicas.iterdir() if d.name.startswith(TOPIC)) if replicas.is_dir() else []


def refused_as_deleted(site: ClusterSite, node: int) -> bool:
    """``node`` answers a fetch and a produce of the topic NOT_FOUND, naming the delete."""
    fetch = pb.FetchRequest(topic=TOPIC, partition=0, offset=0, max_bytes=1 << 20, max_wait_ms=0)
    batch = encode_batch([RecordInput(None, b"late", (), 1_700_000_000_000)])
    produce = pb.ProduceRequest(topic=TOPIC, partition=0, batch=batch, acks=pb.ACKS_ALL)
    with open_channel(site.address(node)) as channel:
        stub = pbg.NodeStub(channel)
        for call in (lambda: next(iter(stub.Fetch(fetch, timeout=10))), lambda: stub.Produce(produce, timeout=10)):
            try:
                call()
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.NOT_FOUND, (exc.code(), exc.details())
                assert "was deleted" in (exc.details() or ""), exc.details()
                continue
            return False
    return True


def test_a_delete_on_a_three_node_site_removes_every_copy_and_a_re_created_topic_holds_no_old_record(
    tmp_path: Path,
) -> None:
    site = ClusterSite(tmp_path, 3, extra_args=["--session-timeout-ms", "1500"], kafka=True)
    try:
        site.start()
        ok(georep("topic", "create", TOPIC, "--partitions", "1", "--bootstrap", site.address(2)))
        leader = site.wait_leader(TOPIC)
        assert produce(site, 20, "old") == 20  # acks=all: every node holds a copy (replication factor 3)
        down = next(n for n in (1, 2, 3) if n != leader)
        wait_for("every node holds a copy", lambda: all(copies(site, n) == [f"{TOPIC}-0"] for n in (1, 2, 3)))
        site.nodes[down].kill9()
        assert produce(site, 5, "old-late") == 5  # the two survivors: a quorum
        # The delete, at a node that does not lead the partition: through the Raft leader, as an alter goes.
        at = next(n for n in (1, 2, 3) if n not in (leader, down))
        out = ok(georep("topic", "delete", TOPIC, "--bootstrap", site.address(at)))
        assert f"deleted topic '{TOPIC}' (incarnation 0)" in out
        up = [n for n in (1, 2, 3) if n != down]
        for n in up:
            wait_for(f"node {n} refuses reads of the deleted topic", lambda n=n: refused_as_deleted(site, n))
            wait_for(f"node {n} removed its copies", lambda n=n: copies(site, n) == [])
        assert copies(site, down) == [f"{TOPIC}-0"]  # it was down: its copy is still there
        site.nodes[down].start(60)
        wait_for("the node that was down removed its copies", lambda: copies(site, down) == [])
        assert refused_as_deleted(site, down)
        # Created again: incarnation 1, in directories of its own, from offset 0, holding only the new records.
        ok(georep("topic", "create", TOPIC, "--partitions", "1", "--bootstrap", site.address(down)))
        new_leader = site.wait_leader(TOPIC)
        assert produce(site, 7, "new") == 7
        records = read_partition(site.address(new_leader), TOPIC, 0)
        values = [v.rstrip(b".") for _, _, v in records]
        assert values == [f"new-{i}".encode() for i in range(7)], values[:5]
        for n in (1, 2, 3):
            assert all(name == f"{TOPIC}@1-0" for name in copies(site, n)), copies(site, n)
        # Kafka's DeleteTopics at any node deletes it the same way (incarnation 1 now).
        admin = AdminClient({"bootstrap.servers": site.kafka_address(at)})
        admin.delete_topics([TOPIC])[TOPIC].result(30)
        for n in (1, 2, 3):
            wait_for(f"node {n} refuses reads of the deleted topic again", lambda n=n: refused_as_deleted(site, n))
            wait_for(f"node {n} removed its copies again", lambda n=n: copies(site, n) == [])
        assert TOPIC not in admin.list_topics(timeout=10).topics
    finally:
        site.close()


def produce_at(address: str, tag: str, count: int) -> None:
    """``count`` records ``tag-i``, acked by the one-node site at ``address``."""
    with open_channel(address) as channel:
        stub = pbg.NodeStub(channel)
        for i in range(count):
            batch = encode_batch([RecordInput(None, f"{tag}-{i}".encode(), (), 1_700_000_000_000)])
            stub.Produce(pb.ProduceRequest(topic=TOPIC, partition=0, batch=batch, acks=pb.ACKS_ALL), timeout=15)


def deleted_at(address: str) -> bool:
    """``georep topic delete`` at ``address``: True once made; False while its delete gate waits for the linked
    sites to announce that they check incarnations."""
    result = georep("topic", "delete", TOPIC, "--bootstrap", address)
    if result.returncode != 0:
        assert "incarnation" in result.stderr.decode(), result.stderr.decode()
        return False
    return True


def test_a_delete_at_a_one_node_site_reaches_a_three_node_site_through_a_link(tmp_path: Path) -> None:
    """Site a (one node) links to site b (three nodes). A topic written at a reaches every node of b; deleted at a,
    it is deleted at b by the topic sync (the tombstone proposed through b's Raft state), every node of b removes
    its copies, and the topic created again at a holds at b only what was written after."""
    a_port = free_ports(1)[0]
    more = f'[sites.a]\nnodes = ["127.0.0.1:{a_port}"]\n[[links]]\nsrc = "a"\ndst = "b"\n'
    site_b = ClusterSite(tmp_path, 3, site="b", extra_args=["--session-timeout-ms", "1500"], more_toml=more)
    a = beside(site_b, "a", tmp_path / "a", a_port)
    try:
        site_b.start()
        a.start()
        ok(georep("topic", "create", TOPIC, "--partitions", "1", "--bootstrap", a.address))
        produce_at(a.address, "old", 10)
        wait_for("every node of b holds a copy", lambda: all(copies(site_b, n) == [f"{TOPIC}-0"] for n in (1, 2, 3)))
        wait_for(
            "b holds the old records",
            lambda: len(read_partition(site_b.address(site_b.wait_leader(TOPIC)), TOPIC, 0)) == 10,
        )
        wait_for("the delete at a is made", lambda: deleted_at(a.address))
        for n in (1, 2, 3):
            wait_for(f"b's node {n} refuses reads of the deleted topic", lambda n=n: refused_as_deleted(site_b, n))
            wait_for(f"b's node {n} removed its copies", lambda n=n: copies(site_b, n) == [])
        ok(georep("topic", "create", TOPIC, "--partitions", "1", "--bootstrap", a.address))
        produce_at(a.address, "new", 4)
        want = [f"new-{i}".encode() for i in range(4)]

        def b_holds_only_the_new_records() -> bool:
            leader = site_b.leader(TOPIC)
            if leader is None:
                return False
            values = [v for _, _, v in read_partition(site_b.address(leader), TOPIC, 0)]
            assert all(v.startswith(b"new-") for v in values), values
            return values == want

        wait_for("b holds the re-created topic's records, and only them", b_holds_only_the_new_records)
    finally:
        a.stop()
        site_b.close()
