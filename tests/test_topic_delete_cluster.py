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
from tests.support.channels import open_channel
from tests.support.cli import georep, ok
from tests.support.cluster_site import TOPIC, ClusterSite, produce, read_partition, wait_for

pytestmark = pytest.mark.slow  # three node processes


def copies(site: ClusterSite, node: int) -> list[str]:
    """The directories of ``TOPIC``'s segment copies in ``node``'s data dir (any incarnation)."""
    replicas = site.nodes[node].data_dir / "replicas"
    return sorted(d.name for d in replicas.iterdir() if d.name.startswith(TOPIC)) if replicas.is_dir() else []


def refused_as_deleted(site: ClusterSite, node: int) -> bool:
    """``node`` answers a fetch of the topic NOT_FOUND, naming the delete."""
    request = pb.FetchRequest(topic=TOPIC, partition=0, offset=0, max_bytes=1 << 20, max_wait_ms=0)
    with open_channel(site.address(node)) as channel:
        try:
            next(iter(pbg.NodeStub(channel).Fetch(request, timeout=10)))
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.NOT_FOUND, (exc.code(), exc.details())
            assert "was deleted" in (exc.details() or ""), exc.details()
            return True
    return False


def test_a_delete_on_a_three_node_site_removes_every_copy_and_a_re_created_topic_holds_no_old_record(
    tmp_path: Path,
) -> None:
    site = ClusterSite(tmp_path, 3, extra_args=["--session-timeout-ms", "1500"])
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
    finally:
        site.close()
