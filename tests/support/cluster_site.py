"""A multi-node site of real ``georep node`` processes on 127.0.0.1, for the tests that kill its nodes."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc

from georep.auth.principal import node_principal
from georep.cli.up import stop_all
from georep.client.consumer import Consumer
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.record.batch import RecordInput, decode_records, encode_batch, iter_headers
from georep.security.tls import TlsConfig
from georep.server.process import NodeProcess
from georep.server.rpc import LEADER_METADATA
from tests.support.channels import open_channel
from tests.support.ports import free_ports


def site_toml(site: str, grpc_ports: list[int], raft_ports: list[int], kafka_ports: list[int] | None = None) -> str:
    kafka = [f', kafka = "127.0.0.1:{k}"' for k in kafka_ports] if kafka_ports else [""] * len(grpc_ports)
    nodes = ", ".join(
        f'{{ id = {i + 1}, address = "127.0.0.1:{g}", raft = "127.0.0.1:{r}"{kafka[i]} }}'
        for i, (g, r) in enumerate(zip(grpc_ports, raft_ports, strict=True))
    )
    return f"[sites.{site}]\nnodes = [{nodes}]\n"


class ClusterSite:
    """``count`` nodes of site ``site``, each ``georep node --node-id N`` with its own data dir under ``root``.

    ``more_toml`` adds to the topology file (other sites, links); those sites are the caller's to start.
    ``raft_secret``: the site's Raft secret file (``georep certs init``), which a node with TLS needs.
    ``kafka``: every node serves Kafka clients too, at ``kafka_address(node)`` (the topology's ``kafka``)."""

    def __init__(
        self,
        root: Path,
        count: int = 3,
        site: str = "a",
        extra_args: list[str] | None = None,
        more_toml: str = "",
        raft_secret: Path | None = None,
        kafka: bool = False,
    ) -> None:
        ports = free_ports((3 if kafka else 2) * count)
        self.site = site
        self.grpc_ports, self.raft_ports = ports[:count], ports[count : 2 * count]
        self.kafka_ports = ports[2 * count :]
        self.topology = root / "topology.toml"
        self.topology.write_text(site_toml(site, self.grpc_ports, self.raft_ports, self.kafka_ports) + more_toml)
        secret = [] if raft_secret is None else ["--raft-secret-file", str(raft_secret)]
        self.nodes = {
            i + 1: NodeProcess(
                site,
                root / site / str(i + 1),
                listen=f"127.0.0.1:{self.grpc_ports[i]}",
                extra_args=[
                    "--node-id",
                    str(i + 1),
                    "--topology",
                    str(self.topology),
                    "--scrub-bytes-per-s",
                    "0",
                    *secret,
                    *(extra_args or []),
                    *(["--kafka-listen", self.kafka_address(i + 1)] if kafka else []),
                ],
            )
            for i in range(count)
        }

    def start(self, timeout_s: float = 60.0) -> None:
        for node in self.nodes.values():
            node.launch()
        for node in self.nodes.values():
            node.wait_ready(timeout_s)

    def address(self, node: int) -> str:
        return f"127.0.0.1:{self.grpc_ports[node - 1]}"

    def kafka_address(self, node: int) -> str:
        return f"127.0.0.1:{self.kafka_ports[node - 1]}"

    def live(self) -> list[int]:
        return [n for n, p in self.nodes.items() if p.alive()]

    def descriptions(self, topic: str) -> Iterator[tuple[int, pb.TopicDescription]]:
        """Each live node that answers, with the topic as it describes it."""
        for n in self.live():
            with open_channel(self.address(n)) as channel:
                try:
                    d = pbg.NodeStub(channel).DescribeTopic(pb.DescribeTopicRequest(name=topic), timeout=5)
                except grpc.RpcError:
                    continue
            yield n, d

    def describe(self, topic: str) -> pb.TopicDescription | None:
        """The topic as the first live node that answers describes it."""
        return next((d for _, d in self.descriptions(topic)), None)

    def leader(self, topic: str, partition: int = 0) -> int | None:
        """The node that leads ``topic``-``partition`` and serves it (its DescribeTopic lists the partition)."""
        serving = (n for n, d in self.descriptions(topic) if any(s.partition == partition for s in d.partition_states))
        return next(serving, None)

    def wait_leader(self, topic: str, partition: int = 0, timeout_s: float = 60.0, not_node: int | None = None) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            n = self.leader(topic, partition)
            if n is not None and n != not_node:
                return n
            time.sleep(0.05)
        raise AssertionError(f"no node serves {topic}-{partition} after {timeout_s} s")

    def close(self) -> None:
        """Every node stopped, together (``georep up``'s ``stop_all``): one at a time, each waits for the calls its
        running peers hold."""
        stop_all(list(self.nodes.values()))

    def use_tls(self, certs: Path) -> None:
        """Each node serves mutual TLS with its own ``node:<site>/<n>`` certificate from ``certs`` (made by ``georep
        certs init``); pass the site's Raft secret to the constructor."""
        for n, node in self.nodes.items():
            node.tls = TlsConfig.from_dir(certs, node_principal(self.site, n))

    @contextlib.contextmanager
    def running(self) -> Iterator[ClusterSite]:
        """Started, and stopped at the end all at once (each node shuts down while the others do)."""
        try:
            self.start()
            yield self
        finally:
            self.close()


def beside(site: ClusterSite, name: str, data_dir: Path, port: int) -> NodeProcess:
    """A one-node site ``name`` (not started) on ``port``, reading ``site``'s topology, which must list it (the
    ``more_toml`` of the ClusterSite); no background scrubber, so the tests' files change only as they say."""
    return NodeProcess(
        name,
        data_dir,
        listen=f"127.0.0.1:{port}",
        extra_args=["--topology", str(site.topology), "--scrub-bytes-per-s", "0"],
    )


def read_partition(address: str, topic: str, partition: int) -> list[tuple[str, int, bytes]]:
    """Every record of a partition at the node at ``address`` (a multi-node site: its leader, followed if it
    moves meanwhile: local offsets are the site's), in log order, as (origin, origin seq, value)."""
    out: list[tuple[str, int, bytes]] = []
    offset, moves = 0, 0
    for _ in range(100_000):
        request = pb.FetchRequest(topic=topic, partition=partition, offset=offset, max_bytes=1 << 20, max_wait_ms=200)
        with open_channel(address) as channel:
            try:
                response = next(iter(pbg.NodeStub(channel).Fetch(request, timeout=10)))
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.FAILED_PRECONDITION or moves >= 50:
                    raise
                moves += 1
                address = leader_hint(exc) or address
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


TOPIC = "orders"


PRODUCER_ID = 4242


def leader_hint(exc: grpc.RpcError) -> str:
    for item in exc.trailing_metadata() or ():
        if item.key == LEADER_METADATA:
            return str(item.value)
    return ""


class Writer:
    """An idempotent producer of one partition that follows the leader, one batch at a time, at acks=all."""

    def __init__(self, site: ClusterSite) -> None:
        self.site = site
        self.address = site.address(1)
        self.acked: list[tuple[int, bytes]] = []  # (origin seq, value) of every acknowledged record
        self.origin = ""
        self.retries = 0

    def send(self, seq: int, deadline_s: float = 60.0) -> None:
        values = [f"v{seq}-{i}".encode() for i in range(5)]
        batch = encode_batch(
            [RecordInput(None, v, (), 1_700_000_000_000 + seq) for v in values],
            producer_id=PRODUCER_ID,
            producer_epoch=0,
            base_sequence=seq * 5,
        )
        request = pb.ProduceRequest(topic=TOPIC, partition=0, batch=batch, acks=pb.ACKS_ALL, ack_timeout_ms=10_000)
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            try:
                with open_channel(self.address) as channel:
                    r = pbg.NodeStub(channel).Produce(request, timeout=15)
            except grpc.RpcError as exc:
                self.retries += 1
                hint = leader_hint(exc) if exc.code() == grpc.StatusCode.FAILED_PRECONDITION else ""
                if hint:
                    self.address = hint
                else:
                    live = self.site.live()  # a dead node, or one that knows no leader yet: ask the next one
                    self.address = self.site.address(live[self.retries % len(live)])
                    time.sleep(0.05)
                continue
            self.origin = f"{r.origin_site}@{r.origin_epoch}"
            self.acked += [(r.base_origin_seq + i, v) for i, v in enumerate(values)]
            return
        raise AssertionError(f"batch {seq} was not acknowledged within {deadline_s} s (last address {self.address})")


WAIT_S = 90.0


def produce(site: ClusterSite, count: int, tag: str, deadline_s: float = 60.0) -> int:
    """``count`` batches of ~1 KiB at acks=all, each retried at the leader (NOT_LEADER's hint) or at the next live
    node until acknowledged; returns how many were acknowledged."""
    acked = 0
    address = site.address(site.live()[0])
    for i in range(count):
        request = pb.ProduceRequest(
            topic=TOPIC, partition=0, batch=_batch(f"{tag}-{i}"), acks=pb.ACKS_ALL, ack_timeout_ms=10_000
        )
        deadline = time.monotonic() + deadline_s
        while True:
            try:
                with open_channel(address) as channel:
                    pbg.NodeStub(channel).Produce(request, timeout=15)
                acked += 1
                break
            except grpc.RpcError as exc:
                if time.monotonic() > deadline:
                    raise AssertionError(f"batch {tag}-{i} not acknowledged: {exc.code()} {exc.details()}") from None
                hint = leader_hint(exc)
                live = site.live()
                address = hint or site.address(live[(i + acked + 1) % len(live)])
                time.sleep(0.05)
    return acked


def _batch(value: str) -> bytes:
    from georep.record.batch import RecordInput, encode_batch

    return encode_batch([RecordInput(None, value.encode().ljust(1000, b"."), (), 1_700_000_000_000)])


def status(site: ClusterSite) -> pb.ClusterStatusResponse:
    for n in site.live():
        try:
            with open_channel(site.address(n)) as channel:
                return pbg.NodeStub(channel).ClusterStatus(pb.ClusterStatusRequest(), timeout=5)
        except grpc.RpcError:
            continue
    raise AssertionError("no node answers ClusterStatus")


def wait_for(what: str, check: Callable[[], object], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (grpc.RpcError, AssertionError) as exc:
            last = exc
        if last is True:
            return
        time.sleep(0.3)
    raise AssertionError(f"{what} within {timeout_s} s; last: {last}")


async def consume_all(
    bootstrap: str, prefer: str, count: int, topic: str = TOPIC, partition: int = 0
) -> tuple[list[tuple[str, int, bytes]], int]:
    """``count`` records of ``topic``-``partition`` read by a consumer with read_from="follower" (fewer if they do
    not come within a minute), and how many of its fetch responses a follower served."""
    out: list[tuple[str, int, bytes]] = []
    async with Consumer(bootstrap, read_from="follower", prefer=prefer, auto_offset_reset="earliest") as consumer:
        consumer.assign([(topic, partition)])
        consumer.seek_to_beginning()
        for _ in range(600):
            for r in await consumer.poll(timeout_ms=100):
                out.append((str(r.origin), r.origin_seq, r.value or b""))
            if len(out) >= count:
                break
        return out, consumer.follower_reads
