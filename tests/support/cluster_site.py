"""A multi-node site of real ``georep node`` processes on 127.0.0.1, for the tests that kill its nodes."""

from __future__ import annotations

import time
from pathlib import Path

import grpc

from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.record.batch import decode_records, iter_headers
from georep.server.process import NodeProcess
from tests.support.sites import free_ports


def site_toml(site: str, grpc_ports: list[int], raft_ports: list[int]) -> str:
    nodes = ", ".join(f'{{ id = {i + 1}, address = "127.0.0.1:{g}", raft = "127.0.0.1:{r}" }}'
                      for i, (g, r) in enumerate(zip(grpc_ports, raft_ports, strict=True)))  # fmt: skip
    return f"[sites.{site}]\nnodes = [{nodes}]\n"


class ClusterSite:
    """``count`` nodes of site ``site``, each ``georep node --node-id N`` with its own data dir under ``root``.

    ``more_toml`` adds to the topology file (other sites, links); those sites are the caller's to start."""

    def __init__(self, root: Path, count: int = 3, site: str = "a", extra_args: list[str] | None = None,
                 more_toml: str = "") -> None:  # fmt: skip
        ports = free_ports(2 * count)
        self.site = site
        self.grpc_ports, self.raft_ports = ports[:count], ports[count:]
        self.topology = root / "topology.toml"
        self.topology.write_text(site_toml(site, self.grpc_ports, self.raft_ports) + more_toml)
        self.nodes = {
            i + 1: NodeProcess(site, root / site / str(i + 1), listen=f"127.0.0.1:{self.grpc_ports[i]}",
                               extra_args=["--node-id", str(i + 1), "--topology", str(self.topology),
                                           "--scrub-bytes-per-s", "0", *(extra_args or [])])  # fmt: skip
            for i in range(count)
        }

    def start(self, timeout_s: float = 60.0) -> None:
        for node in self.nodes.values():
            node.launch()
        for node in self.nodes.values():
            node.wait_ready(timeout_s)

    def address(self, node: int) -> str:
        return f"127.0.0.1:{self.grpc_ports[node - 1]}"

    def live(self) -> list[int]:
        return [n for n, p in self.nodes.items() if p.alive()]

    def describe(self, topic: str) -> pb.TopicDescription | None:
        """The topic as the first live node that answers describes it."""
        for n in self.live():
            with grpc.insecure_channel(self.address(n)) as channel:
                try:
                    return pbg.NodeStub(channel).DescribeTopic(pb.DescribeTopicRequest(name=topic), timeout=5)
                except grpc.RpcError:
                    continue
        return None

    def leader(self, topic: str, partition: int = 0) -> int | None:
        """The node that leads ``topic``-``partition`` and serves it (its DescribeTopic lists the partition)."""
        for n in self.live():
            with grpc.insecure_channel(self.address(n)) as channel:
                try:
                    d = pbg.NodeStub(channel).DescribeTopic(pb.DescribeTopicRequest(name=topic), timeout=5)
                except grpc.RpcError:
                    continue
            if any(s.partition == partition for s in d.partition_states):
                return n
        return None

    def wait_leader(self, topic: str, partition: int = 0, timeout_s: float = 60.0, not_node: int | None = None) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            n = self.leader(topic, partition)
            if n is not None and n != not_node:
                return n
            time.sleep(0.05)
        raise AssertionError(f"no node serves {topic}-{partition} after {timeout_s} s")

    def close(self) -> None:
        for node in self.nodes.values():
            node.stop()


def read_partition(address: str, topic: str, partition: int) -> list[tuple[str, int, bytes]]:
    """Every record of a partition at the node at ``address`` (a multi-node site: its leader, followed if it
    moves meanwhile: local offsets are the site's), in log order, as (origin, origin seq, value)."""
    out: list[tuple[str, int, bytes]] = []
    offset, moves = 0, 0
    for _ in range(100_000):
        request = pb.FetchRequest(topic=topic, partition=partition, offset=offset, max_bytes=1 << 20,
                                  max_wait_ms=200)  # fmt: skip
        with grpc.insecure_channel(address) as channel:
            try:
                response = next(iter(pbg.NodeStub(channel).Fetch(request, timeout=10)))
            except grpc.RpcError as exc:
                hint = dict(exc.trailing_metadata() or ()).get("georep-leader")  # type: ignore[attr-defined]
                if exc.code() != grpc.StatusCode.FAILED_PRECONDITION or moves >= 50:  # type: ignore[attr-defined]
                    raise
                moves += 1
                address = str(hint) if hint else address
                time.sleep(0.1)
                continue
        if not response.batches:
            return out
        at = 0
        for h in iter_headers(response.batches):
            for rec in decode_records(response.batches[at : at + h.size_bytes], h):
                out.append((str(h.origin), rec.origin_seq, bytes(rec.value or b"")))
            at += h.size_bytes
        offset = response.next_offset
    raise AssertionError(f"{topic}-{partition} at {address} did not end")
