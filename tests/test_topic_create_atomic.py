"""Issue 20, item 10: a topic create is atomic on disk. A ``kill -9`` or a full disk midway through the create of a
topic with many partitions leaves no orphan partition directory once the node runs again, and the create can be
made again (docs/operations.md, "The data dir")."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.server.process import NodeProcess
from tests.support.channels import open_channel
from tests.support.disks import small_tmpfs
from tests.support.ports import free_ports
from tests.support.sites import wait_until

pytestmark = pytest.mark.slow

BIG = 5_000  # partitions: about 2 ms each here, so the kill lands well inside the create


def partition_dirs(data: Path, topic: str) -> list[str]:
    logs = data / "logs"
    return sorted(p.name for p in logs.glob(f"{topic}-*")) if logs.is_dir() else []


def stub_of(node: NodeProcess) -> pbg.NodeStub:
    return pbg.NodeStub(open_channel(node.address))


def test_a_kill_during_a_create_leaves_no_orphan_directory(tmp_path: Path) -> None:
    data = tmp_path / "a"
    node = NodeProcess(site="a", data_dir=data, listen=f"127.0.0.1:{free_ports(1)[0]}", extra_args=["--insecure"])
    node.start()
    try:
        stub = stub_of(node)
        stub.CreateTopic(pb.CreateTopicRequest(name="small", partitions=2), timeout=30)
        errors: list[grpc.RpcError] = []

        def create() -> None:
            try:
                stub.CreateTopic(pb.CreateTopicRequest(name="big", partitions=BIG), timeout=120)
            except grpc.RpcError as exc:
                errors.append(exc)

        creating = threading.Thread(target=create, daemon=True)
        creating.start()
        wait_until("the create is under way", lambda: len(partition_dirs(data, "big")) >= 100, 60)
        node.kill9()
        creating.join(30)
        made = len(partition_dirs(data, "big"))
        assert 0 < made < BIG, f"the kill did not land midway: {made} of {BIG} directories"
        assert errors and errors[0].code() == grpc.StatusCode.UNAVAILABLE  # the client never heard it was created

        node.start()
        assert partition_dirs(data, "big") == [], "orphan partition directories after the restart"
        assert not list((data / "creating").iterdir())
        assert partition_dirs(data, "small") == ["small-0", "small-1"]  # other topics untouched
        assert "the create of topic 'big' did not finish" in (data / "node.log").read_text()
        assert f"removed its {made} partition directories" in (data / "node.log").read_text()
        stub = stub_of(node)
        assert "big" not in {t.name for t in stub.ListTopics(pb.ListTopicsRequest(), timeout=10).topics}
        stub.CreateTopic(pb.CreateTopicRequest(name="big", partitions=40), timeout=60)  # made again, from nothing
        assert len(partition_dirs(data, "big")) == 40
    finally:
        node.stop()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs with few inodes: a create of many partitions (a directory and a few files each) fills it midway."""
    with small_tmpfs(tmp_path, "size=16m,nr_inodes=600") as mount:
        yield mount


def test_a_disk_that_fills_during_a_create_leaves_no_orphan_directory(small_disk: Path, tmp_path: Path) -> None:
    data = small_disk / "a"
    node = NodeProcess(
        site="a",
        data_dir=data,
        listen=f"127.0.0.1:{free_ports(1)[0]}",
        extra_args=["--insecure"],
        log_path=tmp_path / "node.log",
    )
    node.start()
    try:
        stub = stub_of(node)
        with pytest.raises(grpc.RpcError) as full:
            stub.CreateTopic(pb.CreateTopicRequest(name="big", partitions=500), timeout=60)
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, full.value
        assert "free disk space, then create it again" in (full.value.details() or "")
        assert partition_dirs(data, "big") == []
        assert not list((data / "creating").iterdir())
        assert "big" not in {t.name for t in stub.ListTopics(pb.ListTopicsRequest(), timeout=10).topics}
        stub.CreateTopic(pb.CreateTopicRequest(name="small", partitions=3), timeout=30)  # the space came back

        node.stop()
        node.start()
        assert partition_dirs(data, "big") == []
        remount = subprocess.run(
            ["mount", "-o", "remount,nr_inodes=100000", str(small_disk)], capture_output=True, text=True
        )
        assert remount.returncode == 0, remount.stderr
        stub = stub_of(node)
        stub.CreateTopic(pb.CreateTopicRequest(name="big", partitions=500), timeout=60)  # the retry makes it whole
        assert len(partition_dirs(data, "big")) == 500
    finally:
        node.stop()


def test_a_disk_that_fills_during_a_create_of_many_topics_keeps_the_whole_ones(
    small_disk: Path, tmp_path: Path
) -> None:
    """Issue 22: CreateTopics writes the topic table once for many topics. The disk fills midway: the topics made
    before are whole and answered created, the others are refused with DiskFull, and none leaves a directory."""
    data = small_disk / "a"
    node = NodeProcess(site="a", data_dir=data, listen=f"127.0.0.1:{free_ports(1)[0]}", extra_args=["--insecure"])
    node.start()
    try:
        stub = stub_of(node)
        asked = [pb.CreateTopicRequest(name=f"t{i:03d}", partitions=20) for i in range(40)]
        answer = stub.CreateTopics(pb.CreateTopicsRequest(topics=asked), timeout=60)
        created = [r.name for r in answer.results if not r.HasField("error")]
        refused = [r for r in answer.results if r.HasField("error")]
        assert created and refused, "the disk did not fill midway"
        assert created == [t.name for t in asked[: len(created)]]
        assert all(r.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] for r in refused)
        listed = {t.name for t in stub.ListTopics(pb.ListTopicsRequest(), timeout=10).topics}
        for r in refused:
            assert partition_dirs(data, r.name) == [] and r.name not in listed
        for name in created:
            assert len(partition_dirs(data, name)) == 20 and name in listed
        assert not list((data / "creating").iterdir())
        node.stop()
        node.start()  # the table holds exactly the topics answered created
        stub = stub_of(node)
        listed = {t.name for t in stub.ListTopics(pb.ListTopicsRequest(), timeout=10).topics}
        assert {n for n in listed if n.startswith("t")} == set(created)
    finally:
        node.stop()
