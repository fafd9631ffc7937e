"""Retention on a real three-node site: a topic with ``retention_bytes`` loses its oldest sealed segments through
the metadata, every node deletes its copies of them (one killed meanwhile, once it is back), readers start at the
new log start, and a one-node site pulling the partition over a link goes on through the trims."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from georep.client.consumer import Consumer
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.server.process import NodeProcess
from georep.storage.replica_store import partition_dir_name
from tests.support.channels import open_channel
from tests.support.cluster_site import TOPIC, ClusterSite, Writer, leader_hint, read_partition
from tests.support.ports import free_ports

RETENTION_BYTES = 6_000


def _copies(root: Path, node: int) -> list[int]:
    """The segment ids node ``node`` holds copies of (its replica directories)."""
    directory = root / "a" / str(node) / "replicas" / partition_dir_name((TOPIC, 0))
    if not directory.exists():
        return []
    return sorted(int(d.name) for d in directory.iterdir() if d.is_dir() and d.name.isdigit())


def _earliest(address: str) -> int:
    with open_channel(address) as channel:
        r = pbg.NodeStub(channel).ListOffsets(
            pb.ListOffsetsRequest(topic=TOPIC, partition=0, position=pb.START_EARLIEST), timeout=10
        )
    return int(r.offsets[0].offset)


async def _read_from_earliest(bootstrap: str, expect_last: bytes) -> list[tuple[int, bytes]]:
    out: list[tuple[int, bytes]] = []
    async with Consumer(bootstrap, auto_offset_reset="earliest") as consumer:
        consumer.assign([(TOPIC, 0)])
        deadline = time.monotonic() + 15
        while (not out or out[-1][1] != expect_last) and time.monotonic() < deadline:
            out += [(int(r.offset), bytes(r.value or b"")) for r in await consumer.poll(timeout_ms=300)]
    return out


@pytest.mark.slow
def test_retention_trims_the_chain_and_every_node_deletes_its_copies(tmp_path: Path) -> None:
    b_port = free_ports(1)[0]
    more = f'[sites.b]\nnodes = ["127.0.0.1:{b_port}"]\n[[links]]\nsrc = "a"\ndst = "b"\n'
    site = ClusterSite(
        tmp_path,
        3,
        extra_args=["--session-timeout-ms", "1500", "--segment-bytes-max", "2048", "--retention-check-ms", "200"],
        more_toml=more,
    )
    b = NodeProcess(
        "b",
        tmp_path / "b",
        listen=f"127.0.0.1:{b_port}",
        extra_args=["--topology", str(site.topology), "--scrub-bytes-per-s", "0", "--retention-check-ms", "600000"],
    )
    try:
        site.start()
        b.start()  # pulls a's partition from the start, through the trims
        with open_channel(site.address(1)) as channel:
            pbg.NodeStub(channel).CreateTopic(
                pb.CreateTopicRequest(name=TOPIC, partitions=1, config={"retention_bytes": str(RETENTION_BYTES)}),
                timeout=30,
            )
        site.wait_leader(TOPIC)
        writer = Writer(site)
        for seq in range(20):  # about 280 B a batch: segments of 2 KiB on all three nodes
            writer.send(seq)
        _b_keeps_up(b, writer)
        start = _trims_reach_every_node(tmp_path, site, b, writer)
        _fetch_below_the_log_start_is_out_of_range(site, site.wait_leader(TOPIC))
        _reads_go_on_after_the_trim(site, b, writer, start)
    finally:
        b.stop()
        site.close()


def _b_keeps_up(b: NodeProcess, writer: Writer) -> None:
    """b holds every acknowledged record so far: retention keeps 6 KB, about 20 batches, so b is never left
    behind by more than the trims keep (a site never appends past a gap: one that fell behind a trim would
    wait for good, docs/cluster.md "Retention"). Under load its link may take a while to start."""
    written = [v for _, v in writer.acked]
    deadline = time.monotonic() + 30
    while True:
        try:
            if [v for _, _, v in read_partition(b.address, TOPIC, 0)] == written:
                return
        except grpc.RpcError:
            pass  # the topic has not reached b yet
        assert time.monotonic() < deadline, "site b did not keep up with a's writes"
        time.sleep(0.2)


def _trims_reach_every_node(tmp_path: Path, site: ClusterSite, b: NodeProcess, writer: Writer) -> int:
    """A node that is down while the trims commit deletes its copies when it comes back; no node keeps a copy
    below the first one held. Returns the leader's log start, which moved."""
    down = next(n for n in (1, 2, 3) if n != site.wait_leader(TOPIC))
    assert 0 in _copies(tmp_path, down)
    site.nodes[down].kill9()
    for seq in range(20, 60):
        writer.send(seq)
        if seq % 10 == 9:
            _b_keeps_up(b, writer)
    up = [n for n in (1, 2, 3) if n != down]
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(0 in _copies(tmp_path, n) for n in up):
        time.sleep(0.1)
    assert 0 in _copies(tmp_path, down), "the dead node's copy went"
    site.nodes[down].start(30)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(0 in _copies(tmp_path, n) for n in (1, 2, 3)):
        time.sleep(0.1)
    held = {n: _copies(tmp_path, n) for n in (1, 2, 3)}
    assert all(0 not in ids for ids in held.values()), f"segment 0 still has copies: {held}"
    start = _earliest(site.address(site.wait_leader(TOPIC)))
    assert start > 0, "the log start did not move"
    first_held = min(i for ids in held.values() for i in ids)
    assert first_held > 0
    for n in (1, 2, 3):
        assert not (set(range(first_held)) & set(held[n])), f"node {n} kept a trimmed copy: {held[n]}"
    return start


def _fetch_below_the_log_start_is_out_of_range(site: ClusterSite, leader: int) -> None:
    """A fetch below the log start is out of range (following the leader if it moves meanwhile)."""
    address = site.address(leader)
    for _ in range(20):  # NOT_LEADER names the leader
        with open_channel(address) as channel:
            try:
                next(
                    iter(
                        pbg.NodeStub(channel).Fetch(
                            pb.FetchRequest(topic=TOPIC, partition=0, offset=0, max_bytes=1 << 16), timeout=10
                        )
                    )
                )
                raise AssertionError("a fetch below the log start was served")
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    address = leader_hint(exc) or address
                    time.sleep(0.2)
                    continue
                assert exc.code() == grpc.StatusCode.OUT_OF_RANGE, exc
                break
    else:
        raise AssertionError("no leader answered the fetch below the log start")


def _reads_go_on_after_the_trim(site: ClusterSite, b: NodeProcess, writer: Writer, start: int) -> None:
    """A consumer from earliest reads from the log start to the end; writes and reads go on after the trim, and
    site b, pulling through the trims, holds every record once, in order."""
    last = writer.acked[-1][1]
    read = asyncio.run(_read_from_earliest(site.address(2), last))
    assert read and read[0][0] >= start and read[-1][1] == last, "a consumer from earliest did not read on"
    values = [v for _, v in read]
    written = [v for _, v in writer.acked]
    assert values == written[len(written) - len(values) :], "what is read is not the newest suffix written"
    assert len(values) < len(written)
    for seq in range(60, 65):
        writer.send(seq)
    read = asyncio.run(_read_from_earliest(site.address(3), writer.acked[-1][1]))
    assert read[-1][1] == writer.acked[-1][1]
    written = [v for _, v in writer.acked]
    deadline = time.monotonic() + 15
    while True:
        at_b = [v for _, _, v in read_partition(b.address, TOPIC, 0)]
        if at_b == written or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert at_b == written, "site b, pulling through the trims, does not hold every record once, in order"
