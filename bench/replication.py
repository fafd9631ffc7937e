"""Replication between georep sites: link throughput, bytes on the wire, and end-to-end latency, in one run.

Run from the repository root::

    .venv/bin/python bench/replication.py            # full run, a few minutes
    .venv/bin/python bench/replication.py --quick    # smoke run, under 30 s
    .venv/bin/python bench/replication.py --only latency --json latency.json
    .venv/bin/python bench/replication.py --only rtt        # the 200 ms RTT row next to the no-delay row

Every site is a ``georep node`` process on 127.0.0.1 (ephemeral ports written
into topology files), started the way ``georep up`` starts them
(``georep.cli.up.site_processes``), with its data under one temporary directory
that is removed on exit, Ctrl-C or SIGTERM. What is measured (bench/README.md
explains how to read it):

* ``throughput``: topology a -> b. The batches are produced into a first; then
  b starts, pulls them over its one inbound link, and the clock runs until b's
  vector equals a's. Next to it, raw gRPC server streaming of the same bytes in
  messages of the same size between two processes: the ceiling for any Python
  gRPC stream on this machine.
* ``rtt``: the same a -> b catch-up, but b reaches a through the fault proxy
  (``python -m georep.faultproxy`` in its own process, driven with
  toxiproxy-python; a real Toxiproxy when ``TOXIPROXY_URL`` is set): a row with
  no delay, and a row with a latency toxic of half the RTT each way (200 ms RTT
  by default), run alternately, and their ratio: what a long fat pipe keeps.
* ``wire``: five sites, every ordered pair linked (multi-master). Each site
  takes the same amount of produce at once; after every vector is equal, the
  batch bytes each node sent downstream, per byte produced, per other site.
* ``latency``: topology a -> b -> c. A ``Producer`` at a sends timestamped
  1 KiB records at a steady rate; a ``Consumer`` at c notes when each arrives.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

# bench/ is on sys.path when this file runs as a script: reuse produce.py's workload and process helpers.
from produce import (
    DEFAULT_WINDOW_BYTES,
    RECORD_OVERHEAD_BYTES,
    RECORD_VALUE_BYTES,
    BenchError,
    build_requests,
    progress,
    serve_until_signalled,
    settle_page_cache,
    size_label,
    stop_process,
    stream_produce,
    wait_for_port,
)
from toxiproxy import Toxiproxy

from georep.cli.up import site_processes
from georep.client.connection import CHANNEL_OPTIONS
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.security.tls import client_channel
from georep.server.process import NODE_INFO
from georep.server.replicator import STREAM_MAX_BYTES
from topology.model import parse_topology

RECORD_BYTES = RECORD_VALUE_BYTES + RECORD_OVERHEAD_BYTES  # one encoded 1 KiB record
RAW_METHOD = "/bench.Source/Pull"
POLL_S = 0.02  # SiteStatus polling while the clock runs
THROUGHPUT_FLUSH_MS = 100
WIRE_SITES = ("a", "b", "c", "d", "e")
WIRE_BATCH_BYTES = 65536
LATENCY_RATE_MB_S = 5.0
LATENCY_LINGER_MS = 2
LATENCY_BATCH_BYTES = 65536
LATENCY_WARMUP_S = 1.5
LATENCY_TARGET_P99_MS = 100.0
THROUGHPUT_TARGET = 0.5
RTT_TARGET = 0.7  # issue 12: the 200 ms RTT row at least 70% of the no-delay row
WIRE_TARGET = 1.2
CONVERGE_TIMEOUT_S = 300.0


# -- topology files and processes ----------------------------------------------------


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: all bound at once, read, then closed."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def topology_toml(
    sites: Sequence[str], ports: Sequence[int], links: Sequence[tuple[str, str]], topics: Sequence[str] | None = None
) -> str:
    lines = []
    for site, port in zip(sites, ports, strict=True):
        lines += [f"[sites.{site}]", f'nodes = ["127.0.0.1:{port}"]', ""]
    for src, dst in links:
        lines += ["[[links]]", f'src = "{src}"', f'dst = "{dst}"']
        if topics is not None:
            lines.append("topics = [" + ", ".join(f'"{t}"' for t in topics) + "]")
        lines.append("")
    text = "\n".join(lines)
    parse_topology(text)  # a bad file fails here, not in a node's log
    return text


class Cluster:
    """The sites of one topology file, each a ``georep node`` under ``data_dir/<site>``."""

    def __init__(
        self, stack: contextlib.ExitStack, root: Path, name: str, text: str, extra_args: list[str] | None = None
    ) -> None:
        self.stack = stack
        self.root = root
        self.data_dir = root / name
        self.data_dir.mkdir(parents=True)
        self.topology_file = root / f"{name}.toml"
        self.topology_file.write_text(text)
        topology = parse_topology(text)
        self.extra_args = extra_args or []
        self.procs = {p.site: p for p in site_processes(topology, self.topology_file, self.data_dir, self.extra_args)}
        for p in self.procs.values():
            p.log_path = root / f"{name}-{p.site}.log"

    def start(self, sites: Sequence[str]) -> None:
        procs = [self.procs[s] for s in sites]
        for p in procs:
            self.stack.callback(p.stop)
        with ThreadPoolExecutor(len(procs)) as pool:  # nodes import and open their logs in parallel
            list(pool.map(lambda p: p.start(), procs))

    def address(self, site: str) -> str:
        return self.procs[site].address

    def metrics_address(self, site: str) -> str:
        info = json.loads((self.data_dir / site / NODE_INFO).read_text())
        return str(info["metrics"])


# -- RPC and metrics helpers ------------------------------------------------------------


def channel(address: str) -> grpc.aio.Channel:
    return client_channel(address, None, CHANNEL_OPTIONS)


async def create_topic(stub: pbg.NodeStub, name: str, config: dict[str, str]) -> None:
    await stub.CreateTopic(pb.CreateTopicRequest(name=name, partitions=1, config=config), timeout=30)


Vector = dict[tuple[str, int], int]  # (site, epoch) -> next origin seq


def vector_of(msg: pb.VectorOffset) -> Vector:
    return {(e.site, e.epoch): e.next_seq for e in msg.entries if e.next_seq > 0}


async def site_vector(stub: pbg.NodeStub, topic: str) -> tuple[Vector, pb.SiteStatusResponse]:
    status = await stub.SiteStatus(pb.SiteStatusRequest(partitions=True, topic=topic), timeout=10)
    for p in status.partitions:
        if p.topic == topic and p.partition == 0:
            return vector_of(p.vector), status
    return {}, status


async def wait_for_topic(stub: pbg.NodeStub, topic: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await stub.DescribeTopic(pb.DescribeTopicRequest(name=topic), timeout=5)
            return
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND or time.monotonic() > deadline:
                raise BenchError(
                    f"topic {topic} did not reach the site within {timeout_s:g}s: {exc.details()}"
                ) from None
        await asyncio.sleep(0.1)


def scrape(metrics_address: str) -> dict[str, float]:
    """``/metrics`` as {sample name with labels: value}."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def metric_sum(samples: dict[str, float], name: str, label_part: str = "") -> float:
    """Sum of the samples of ``name`` (any labels), optionally only those whose labels contain ``label_part``."""
    total = 0.0
    for key, value in samples.items():
        base, _, labels = key.partition("{")
        if base == name and label_part in labels:
            total += value
    return total


async def wait_durable(metrics_address: str, topic: str, timeout_s: float = 30.0) -> None:
    """Until the origin has fsynced every record of ``topic``: replication serves durable batches only."""
    deadline = time.monotonic() + timeout_s
    while metric_sum(scrape(metrics_address), "georep_partition_unflushed_records", f'topic="{topic}"') > 0:
        if time.monotonic() > deadline:
            raise BenchError(f"{topic} still has unflushed records after {timeout_s:g}s")
        await asyncio.sleep(0.05)


# -- 1. throughput across one link ------------------------------------------------------


@dataclass
class Throughput:
    batch_bytes: int
    payload_bytes: int  # batch bytes b had to copy
    records: int
    message_bytes: int  # raw reference: bytes per streamed message
    georep_s: list[float] = field(default_factory=list)  # b ready -> b's vector equals a's
    streaming_s: list[float] = field(default_factory=list)  # first applied bytes seen -> equal
    streaming_bytes: list[int] = field(default_factory=list)  # bytes applied within streaming_s
    startup_s: list[float] = field(default_factory=list)  # b ready -> first applied bytes seen
    raw_s: list[float] = field(default_factory=list)

    @property
    def georep_mb_s(self) -> float:
        return self.payload_bytes / min(self.georep_s) / 1e6

    @property
    def streaming_mb_s(self) -> float:
        """NaN when b caught up before a poll could see it half way (tiny --quick sizes)."""
        rates = [b / s for b, s in zip(self.streaming_bytes, self.streaming_s, strict=True) if b > 0 and s > 0]
        return max(rates) / 1e6 if rates else float("nan")

    @property
    def raw_mb_s(self) -> float:
        return self.payload_bytes / min(self.raw_s) / 1e6

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            georep_mb_s=self.georep_mb_s,
            streaming_mb_s=self.streaming_mb_s,
            raw_mb_s=self.raw_mb_s,
            ratio=self.georep_mb_s / self.raw_mb_s,
            streaming_ratio=self.streaming_mb_s / self.raw_mb_s,
        )
        return out


async def serve_raw(port: int) -> None:
    """The reference: a server stream of prebuilt messages; the request says their size and the total."""
    payloads: dict[int, bytes] = {}

    async def pull(request: bytes, context: grpc.aio.ServicerContext) -> Any:
        message_bytes = int.from_bytes(request[:8], "big")
        total = int.from_bytes(request[8:16], "big")
        payload = payloads.setdefault(message_bytes, os.urandom(message_bytes))
        left = total
        while left > 0:
            n = min(left, message_bytes)
            yield payload if n == message_bytes else payload[:n]
            left -= n

    handler = grpc.method_handlers_generic_handler(
        "bench.Source", {"Pull": grpc.unary_stream_rpc_method_handler(pull, None, None)}
    )
    await serve_until_signalled(handler, port)


def start_raw_server(stack: contextlib.ExitStack, root: Path) -> str:
    [port] = free_ports(1)
    log = open(root / "raw-grpc.log", "wb")  # noqa: SIM115 - closed by the exit stack
    stack.callback(log.close)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--serve-raw", str(port)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    stack.callback(stop_process, proc)
    wait_for_port(port, proc, "raw gRPC server")
    return f"127.0.0.1:{port}"


async def raw_pull(ch: grpc.aio.Channel, message_bytes: int, total: int) -> float:
    pull = ch.unary_stream(RAW_METHOD, request_serializer=None, response_deserializer=None)
    start = time.perf_counter()
    received = 0
    async for message in pull(message_bytes.to_bytes(8, "big") + total.to_bytes(8, "big")):
        received += len(message)
    elapsed = time.perf_counter() - start
    if received != total:
        raise BenchError(f"raw gRPC stream delivered {received} bytes, {total} were expected")
    return elapsed


async def pull_once(cluster: Cluster, topic: str, want: Vector, timeout_s: float) -> tuple[float, float, int, float]:
    """Start b, time until its vector equals ``want``. Returns (total s, streaming s, streaming bytes, startup s)."""
    b = cluster.procs["b"]
    shutil.rmtree(b.data_dir, ignore_errors=True)  # a fresh site: everything crosses the link
    cluster.start(["b"])
    # The node writes node.json just before its pullers start; NodeProcess notices it up to 20 ms later.
    start = (b.data_dir / NODE_INFO).stat().st_mtime_ns / 1e9
    first: tuple[float, int] | None = None
    ch = channel(b.address)
    try:
        stub = pbg.NodeStub(ch)
        while True:
            vector, status = await site_vector(stub, topic)
            now = time.time()
            applied = sum(link.applied_bytes for link in status.links)
            if first is None and applied > 0:
                first = (now, applied)
            if vector == want:
                break
            if now - start > timeout_s:
                raise BenchError(f"b did not catch up with a within {timeout_s:g}s: b has {vector}, a has {want}")
            await asyncio.sleep(POLL_S)
        end = time.time()
        total_applied = sum(link.applied_bytes for link in status.links)
    finally:
        await ch.close()
        b.stop()
    assert first is not None
    return end - start, end - first[0], total_applied - first[1], first[0] - start


async def measure_throughput(stack: contextlib.ExitStack, root: Path, cfg: Config) -> list[Throughput]:
    value = os.urandom(RECORD_VALUE_BYTES)
    run_id = os.urandom(3).hex()
    topics = {bb: f"link-{run_id}-{bb}" for bb in cfg.batch_sizes}
    ports = free_ports(2)
    raw_address = start_raw_server(stack, root)
    # a is started once with a topology that carries every topic; b gets a file per batch size
    # whose link carries only that size's topic, so each b pulls exactly one topic.
    origin = Cluster(stack, root, "link", topology_toml("ab", ports, [("a", "b")]))
    origin.start(["a"])
    results = []
    a_ch = channel(origin.address("a"))
    raw_ch = channel(raw_address)
    try:
        a = pbg.NodeStub(a_ch)
        for bb in cfg.batch_sizes:
            topic = topics[bb]
            await create_topic(a, topic, {"flush_interval_ms": str(THROUGHPUT_FLUSH_MS)})
            records = max(1, cfg.link_bytes // RECORD_BYTES)
            reqs = build_requests(topic, 1, records, bb, value, seed=bb)
            progress(f"throughput: producing {reqs.batch_bytes / 1e6:.0f} MB in {size_label(bb)} batches at a")
            await stream_produce(a_ch, reqs.messages, max(2, DEFAULT_WINDOW_BYTES // bb))
            batch_len = len(pb.ProduceRequest.FromString(reqs.messages[0]).batch)
            payload_bytes = reqs.batch_bytes
            del reqs
            await wait_durable(origin.metrics_address("a"), topic)
            want, _ = await site_vector(a, topic)
            per_message = max(1, STREAM_MAX_BYTES // batch_len) * batch_len
            result = Throughput(bb, payload_bytes, records, per_message)
            pulling = Cluster(stack, root, f"link-{bb}", topology_toml("ab", ports, [("a", "b")], [topic]))
            timeout_s = 60 + result.payload_bytes / 1e6  # at least 1 MB/s
            for i in range(cfg.repeats):
                progress(f"throughput {size_label(bb)} run {i + 1}: b pulls from a")
                settle_page_cache()
                total_s, streaming_s, streaming_bytes, startup_s = await pull_once(pulling, topic, want, timeout_s)
                result.georep_s.append(total_s)
                result.streaming_s.append(streaming_s)
                result.streaming_bytes.append(streaming_bytes)
                result.startup_s.append(startup_s)
                progress(f"throughput {size_label(bb)} run {i + 1}: raw gRPC stream")
                settle_page_cache()
                result.raw_s.append(await raw_pull(raw_ch, per_message, result.payload_bytes))
            results.append(result)
    finally:
        await a_ch.close()
        await raw_ch.close()
    return results


# -- 1b. the same link at a long RTT, through the fault proxy ----------------------------


@dataclass
class LongLink:
    batch_bytes: int
    payload_bytes: int
    rtt_ms: int
    flat: list[tuple[float, float, int, float]] = field(default_factory=list)  # pull_once() per run, no delay
    delayed: list[tuple[float, float, int, float]] = field(default_factory=list)  # pull_once() per run, rtt_ms

    def mb_s(self, runs: list[tuple[float, float, int, float]]) -> float:
        """Best ready->equal rate."""
        return self.payload_bytes / min(r[0] for r in runs) / 1e6

    @staticmethod
    def streaming_mb_s(runs: list[tuple[float, float, int, float]]) -> float:
        rates = [b / s for _t, s, b, _st in runs if b > 0 and s > 0]
        return max(rates) / 1e6 if rates else float("nan")

    @property
    def ratio(self) -> float:
        return self.mb_s(self.delayed) / self.mb_s(self.flat)

    @property
    def streaming_ratio(self) -> float:
        return self.streaming_mb_s(self.delayed) / self.streaming_mb_s(self.flat)

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            flat_mb_s=self.mb_s(self.flat),
            delayed_mb_s=self.mb_s(self.delayed),
            ratio=self.ratio,
            flat_streaming_mb_s=self.streaming_mb_s(self.flat),
            delayed_streaming_mb_s=self.streaming_mb_s(self.delayed),
            streaming_ratio=self.streaming_ratio,
        )
        return out


def start_fault_proxy(stack: contextlib.ExitStack, root: Path) -> Toxiproxy:
    """The Toxiproxy API: a real server at TOXIPROXY_URL, else georep's fault proxy in its own process."""
    client = Toxiproxy()
    url = os.environ.get("TOXIPROXY_URL")
    if url:
        host, _, port = url.split("//", 1)[-1].rstrip("/").rpartition(":")
        client.update_api_consumer(host, int(port))
        return client
    [port] = free_ports(1)
    log = open(root / "faultproxy.log", "wb")  # noqa: SIM115 - closed by the exit stack
    stack.callback(log.close)
    cmd = [sys.executable, "-m", "georep.faultproxy", "--listen", f"127.0.0.1:{port}"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    stack.callback(stop_process, proc)
    wait_for_port(port, proc, "fault proxy")
    client.update_api_consumer("127.0.0.1", port)
    return client


async def measure_rtt(stack: contextlib.ExitStack, root: Path, cfg: Config) -> LongLink:
    bb = cfg.rtt_batch_bytes
    topic = f"rtt-{os.urandom(3).hex()}"
    a_port, b_port, proxy_port = free_ports(3)
    origin = Cluster(stack, root, "rtt", topology_toml("ab", [a_port, b_port], [("a", "b")]))
    origin.start(["a"])
    toxiproxy = start_fault_proxy(stack, root)
    proxy = toxiproxy.create(upstream=origin.address("a"), name=f"bench-{topic}", listen=f"127.0.0.1:{proxy_port}")
    stack.callback(proxy.destroy)
    # b's topology names the proxy as a's node: every byte b pulls crosses it.
    pulling = Cluster(stack, root, "rtt-b", topology_toml("ab", [proxy_port, b_port], [("a", "b")], [topic]))
    a_ch = channel(origin.address("a"))
    try:
        a = pbg.NodeStub(a_ch)
        await create_topic(a, topic, {"flush_interval_ms": str(THROUGHPUT_FLUSH_MS)})
        records = max(1, cfg.link_bytes // RECORD_BYTES)
        reqs = build_requests(topic, 1, records, bb, RECORD_VALUE_BYTES * b"r", seed=bb)
        progress(f"rtt: producing {reqs.batch_bytes / 1e6:.0f} MB in {size_label(bb)} batches at a")
        await stream_produce(a_ch, reqs.messages, max(2, DEFAULT_WINDOW_BYTES // bb))
        result = LongLink(bb, reqs.batch_bytes, cfg.rtt_ms)
        del reqs
        await wait_durable(origin.metrics_address("a"), topic)
        want, _ = await site_vector(a, topic)
    finally:
        await a_ch.close()
    timeout_s = 60 + result.payload_bytes / 1e6
    half = cfg.rtt_ms // 2
    for i in range(cfg.repeats):
        for delayed in (False, True):  # alternately, so both rows see the same machine
            label = f"{cfg.rtt_ms} ms RTT" if delayed else "no delay"
            if delayed:
                for stream in ("upstream", "downstream"):
                    proxy.add_toxic(type="latency", stream=stream, attributes={"latency": half, "jitter": 0})
            progress(f"rtt run {i + 1}: b pulls from a through the proxy, {label}")
            settle_page_cache()
            try:
                run = await pull_once(pulling, topic, want, timeout_s)
            finally:
                toxiproxy.reset()
            (result.delayed if delayed else result.flat).append(run)
    return result


# -- 2. bytes on the wire in a full mesh ---------------------------------------------------


@dataclass
class Wire:
    sites: int
    produced_bytes: float  # sum over sites of georep_produced_bytes_total
    sent_bytes: float  # sum over sites of georep_replication_sent_bytes_total
    applied_bytes: float
    skipped_batches: float
    converge_s: float
    produce_s: float
    flush_interval_ms: int
    sent_by_site: dict[str, float]
    skipped_by_link: dict[str, float]  # "src->dst": batches dst already held, only links with any

    @property
    def ratio(self) -> float:
        return self.sent_bytes / (self.produced_bytes * (self.sites - 1))

    @property
    def applied_ratio(self) -> float:
        return self.applied_bytes / (self.produced_bytes * (self.sites - 1))

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(ratio=self.ratio, applied_ratio=self.applied_ratio)
        return out


async def measure_wire(stack: contextlib.ExitStack, root: Path, cfg: Config) -> Wire:
    sites = WIRE_SITES
    links = [(s, d) for s in sites for d in sites if s != d]
    mesh = Cluster(stack, root, "mesh", topology_toml(sites, free_ports(len(sites)), links))
    progress(f"wire: starting {len(sites)} sites, {len(links)} links")
    mesh.start(sites)
    topic = f"mesh-{os.urandom(3).hex()}"
    value = os.urandom(RECORD_VALUE_BYTES)
    channels = {s: channel(mesh.address(s)) for s in sites}
    try:
        stubs = {s: pbg.NodeStub(ch) for s, ch in channels.items()}
        for s in sites:  # the topic everywhere before any produce (topic sync may have created it first)
            try:
                await create_topic(stubs[s], topic, {})
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.ALREADY_EXISTS:
                    raise
        await asyncio.sleep(2.5)  # every puller lists its upstream's topics (every 1 s) and opens a stream with them
        records = max(1, cfg.wire_bytes // RECORD_BYTES)
        requests = {s: build_requests(topic, 1, records, WIRE_BATCH_BYTES, value, seed=i) for i, s in enumerate(sites)}
        progress(f"wire: producing {requests['a'].batch_bytes / 1e6:.1f} MB at each of {len(sites)} sites at once")
        settle_page_cache()
        start = time.perf_counter()
        window = max(2, DEFAULT_WINDOW_BYTES // WIRE_BATCH_BYTES)
        await asyncio.gather(*(stream_produce(channels[s], requests[s].messages, window) for s in sites))
        produce_s = time.perf_counter() - start
        del requests
        deadline = time.monotonic() + CONVERGE_TIMEOUT_S
        while True:
            vectors = [(await site_vector(stubs[s], topic))[0] for s in sites]
            if (
                all(v == vectors[0] for v in vectors)
                and len(vectors[0]) == len(sites)
                and all(seq == records for seq in vectors[0].values())
            ):
                break
            if time.monotonic() > deadline:
                raise BenchError(f"the mesh did not converge within {CONVERGE_TIMEOUT_S:g}s: {vectors}")
            await asyncio.sleep(0.05)
        converge_s = time.perf_counter() - start
        await asyncio.sleep(1.0)  # a duplicate still on its way would count; let it land
    finally:
        for ch in channels.values():
            await ch.close()
    samples = {s: scrape(mesh.metrics_address(s)) for s in sites}
    sent = {s: metric_sum(m, "georep_replication_sent_bytes_total") for s, m in samples.items()}
    skipped_by_link = {}
    for dst in sites:
        for src in sites:
            n = metric_sum(samples[dst], "georep_replication_skipped_batches_total", f'src="{src}"')
            if n:
                skipped_by_link[f"{src}->{dst}"] = n
    return Wire(
        sites=len(sites),
        produced_bytes=sum(metric_sum(m, "georep_produced_bytes_total", f'topic="{topic}"') for m in samples.values()),
        sent_bytes=sum(sent.values()),
        applied_bytes=sum(metric_sum(m, "georep_replication_applied_bytes_total") for m in samples.values()),
        skipped_batches=sum(metric_sum(m, "georep_replication_skipped_batches_total") for m in samples.values()),
        converge_s=converge_s,
        produce_s=produce_s,
        flush_interval_ms=0,
        sent_by_site=sent,
        skipped_by_link=skipped_by_link,
    )


# -- 3. end-to-end latency over two hops ---------------------------------------------------


@dataclass
class Latency:
    flush_interval_ms: int
    rate_mb_s: float  # achieved during the measured window
    seconds: float
    sent: int
    received: int
    latencies_ms: list[float] = field(repr=False)

    def pct(self, q: float) -> float:
        xs = sorted(self.latencies_ms)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    def as_json(self) -> dict[str, Any]:
        return {
            "flush_interval_ms": self.flush_interval_ms,
            "rate_mb_s": self.rate_mb_s,
            "seconds": self.seconds,
            "sent": self.sent,
            "received": self.received,
            "p50_ms": self.pct(0.5),
            "p99_ms": self.pct(0.99),
            "max_ms": max(self.latencies_ms, default=float("nan")),
            "mean_ms": statistics.fmean(self.latencies_ms) if self.latencies_ms else float("nan"),
        }


async def latency_run(line: Cluster, flush_interval_ms: int, cfg: Config) -> Latency:
    from georep.client import Consumer, Producer

    topic = f"line-{flush_interval_ms}ms-{os.urandom(3).hex()}"
    config = {} if flush_interval_ms == 0 else {"flush_interval_ms": str(flush_interval_ms)}
    a_ch, c_ch = channel(line.address("a")), channel(line.address("c"))
    try:
        await create_topic(pbg.NodeStub(a_ch), topic, config)
        await wait_for_topic(pbg.NodeStub(c_ch), topic)  # a -> b -> c topic sync
    finally:
        await a_ch.close()
        await c_ch.close()
    pad = os.urandom(RECORD_VALUE_BYTES - 8)
    rate_records_s = cfg.latency_rate_mb_s * 1e6 / RECORD_VALUE_BYTES
    latencies: list[float] = []
    measure_from_ns = 0
    received = 0
    done = asyncio.Event()
    expected: int | None = None

    consumer = Consumer(line.address("c"), auto_offset_reset="earliest", max_wait_ms=100)
    await consumer.start()
    consumer.assign([(topic, 0)])
    consumer.seek_to_beginning()
    producer = Producer(line.address("a"), batch_size=LATENCY_BATCH_BYTES, linger_ms=LATENCY_LINGER_MS)
    await producer.start()

    async def consume() -> None:
        nonlocal received
        while True:
            batch = await consumer.poll(timeout_ms=100, max_records=10_000)
            now = time.time_ns()
            for r in batch:
                sent_ns = int.from_bytes(r.value[:8], "big")
                if measure_from_ns and sent_ns >= measure_from_ns:  # warm-up records do not count
                    latencies.append((now - sent_ns) / 1e6)
                    received += 1
            if expected is not None and received >= expected:
                done.set()

    reader = asyncio.create_task(consume())
    try:
        futures = []
        sent = 0
        start = time.perf_counter()
        warm_end = start + LATENCY_WARMUP_S
        end = warm_end + cfg.latency_s
        counted = 0
        count_start = 0.0
        while (now := time.perf_counter()) < end:
            if measure_from_ns == 0 and now >= warm_end:
                measure_from_ns = time.time_ns()
                count_start = now
                counted = 0
                futures = []
            due = int((now - start) * rate_records_s) - sent
            for _ in range(due):
                futures.append(producer.send(topic, time.time_ns().to_bytes(8, "big") + pad))
            sent += due
            counted += due
            if producer.buffered_bytes > producer.buffer_memory:
                await producer.wait_for_buffer()
            await asyncio.sleep(0.002)
        window_s = time.perf_counter() - count_start
        await producer.flush()
        await asyncio.gather(*futures)
        expected = counted
        if received >= expected:
            done.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), 30)
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        await producer.close()
        await consumer.close()
    return Latency(
        flush_interval_ms, counted * RECORD_VALUE_BYTES / window_s / 1e6, window_s, counted, received, latencies
    )


async def measure_latency(stack: contextlib.ExitStack, root: Path, cfg: Config) -> list[Latency]:
    line = Cluster(stack, root, "line", topology_toml("abc", free_ports(3), [("a", "b"), ("b", "c")]))
    progress("latency: starting a -> b -> c")
    line.start("abc")
    out = []
    for flush_ms in cfg.latency_flush_ms:
        progress(f"latency: {cfg.latency_s:g}s at {cfg.latency_rate_mb_s:g} MB/s, topic flush_interval_ms={flush_ms}")
        settle_page_cache()
        out.append(await latency_run(line, flush_ms, cfg))
    return out


# -- the run ---------------------------------------------------------------------------------


@dataclass
class Config:
    only: list[str]
    batch_sizes: list[int]
    link_bytes: int
    repeats: int
    rtt_ms: int
    rtt_batch_bytes: int
    wire_bytes: int
    latency_s: float
    latency_rate_mb_s: float
    latency_flush_ms: list[int]


@dataclass
class Results:
    throughput: list[Throughput] = field(default_factory=list)
    rtt: LongLink | None = None
    wire: Wire | None = None
    latency: list[Latency] = field(default_factory=list)


async def run_all(cfg: Config, root: Path) -> Results:
    res = Results()
    # Each measurement stops its nodes before the next starts, so they never compete for CPU.
    if "throughput" in cfg.only:
        with contextlib.ExitStack() as stack:
            res.throughput = await measure_throughput(stack, root, cfg)
    if "rtt" in cfg.only:
        with contextlib.ExitStack() as stack:
            res.rtt = await measure_rtt(stack, root, cfg)
    if "wire" in cfg.only:
        with contextlib.ExitStack() as stack:
            res.wire = await measure_wire(stack, root, cfg)
    if "latency" in cfg.only:
        with contextlib.ExitStack() as stack:
            res.latency = await measure_latency(stack, root, cfg)
    return res


def report(res: Results, cfg: Config) -> Iterator[str]:
    yield from _throughput_lines(res, cfg)
    yield from _rtt_lines(res)
    yield from _wire_lines(res)
    yield from _latency_lines(res)


def _throughput_lines(res: Results, cfg: Config) -> Iterator[str]:
    if not res.throughput:
        return
    mb = res.throughput[0].payload_bytes / 1e6
    yield (
        f"1. Throughput over one link a -> b: {mb:.0f} MB of 1 KiB records produced at a first "
        f"(topic flush_interval_ms={THROUGHPUT_FLUSH_MS}), then b started; best of {cfg.repeats}."
    )
    yield "   'ready->equal': from b's node being up to b's vector equal to a's (includes topic sync and"
    yield "   stream setup); 'streaming': from the first applied bytes b reports to equal."
    head = (
        f"   {'batch':>7} {'ready->equal':>12} {'streaming':>10} {'raw gRPC':>9} {'vs raw':>7} "
        f"{'stream vs raw':>13}  {'startup s':<14} {'runs MB/s':<16} raw msg"
    )
    yield head
    yield "   " + "-" * (len(head) - 3)
    for t in res.throughput:
        runs = " ".join(f"{t.payload_bytes / s / 1e6:.0f}" for s in t.georep_s)
        startup = " ".join(f"{s:.2f}" for s in t.startup_s)
        msg = size_label(t.message_bytes) if t.message_bytes % 1024 == 0 else f"{t.message_bytes:,} B"
        yield (
            f"   {size_label(t.batch_bytes):>7} {t.georep_mb_s:>9.1f} MB/s {t.streaming_mb_s:>5.1f} MB/s "
            f"{t.raw_mb_s:>6.1f} MB/s {t.georep_mb_s / t.raw_mb_s * 100:>6.0f}% "
            f"{t.streaming_mb_s / t.raw_mb_s * 100:>12.0f}%  {startup:<14} {runs:<16} "
            f"{msg}"
        )
    yield ""


def _rtt_lines(res: Results) -> Iterator[str]:
    if res.rtt is None:
        return
    r = res.rtt
    yield (
        f"1b. The same link through the fault proxy, {r.payload_bytes / 1e6:.0f} MB in "
        f"{size_label(r.batch_bytes)} batches: no delay, and a latency toxic of {r.rtt_ms // 2} ms each way "
        f"({r.rtt_ms} ms RTT); runs alternate; best of {len(r.flat)}."
    )
    head = f"   {'link':>14} {'ready->equal':>12} {'streaming':>10}  {'startup s':<18} runs MB/s"
    yield head
    yield "   " + "-" * (len(head) - 3)
    for name, runs in (("no delay", r.flat), (f"{r.rtt_ms} ms RTT", r.delayed)):
        startup = " ".join(f"{x[3]:.2f}" for x in runs)
        rates = " ".join(f"{r.payload_bytes / x[0] / 1e6:.0f}" for x in runs)
        yield (f"   {name:>14} {r.mb_s(runs):>7.1f} MB/s {r.streaming_mb_s(runs):>5.1f} MB/s  {startup:<18} {rates}")
    yield (
        f"   {r.rtt_ms} ms RTT / no delay: {r.ratio * 100:.0f}% ready->equal, {r.streaming_ratio * 100:.0f}% streaming"
    )
    yield ""


def _wire_lines(res: Results) -> Iterator[str]:
    if res.wire is None:
        return
    w = res.wire
    yield (
        f"2. Bytes on the wire, {w.sites}-site full mesh (every ordered pair linked, node default "
        f"flush_interval_ms={w.flush_interval_ms}): {w.produced_bytes / w.sites / 1e6:.1f} MB produced at "
        f"each site at once, 64 KiB batches."
    )
    yield (
        f"   produced {w.produced_bytes / 1e6:.1f} MB in all; sent downstream {w.sent_bytes / 1e6:.1f} MB; "
        f"applied {w.applied_bytes / 1e6:.1f} MB; skipped batches {w.skipped_batches:.0f}"
    )
    per_site = ", ".join(f"{s} {v / 1e6:.1f}" for s, v in sorted(w.sent_by_site.items()))
    yield f"   sent MB by site: {per_site}"
    if w.skipped_by_link:
        yield "   skipped batches by link: " + ", ".join(f"{k} {v:.0f}" for k, v in w.skipped_by_link.items())
    yield (
        f"   sent / (produced x {w.sites - 1}) = {w.ratio:.3f}   applied / (produced x {w.sites - 1}) = "
        f"{w.applied_ratio:.3f}"
    )
    yield f"   produce took {w.produce_s:.1f}s; every vector equal after {w.converge_s:.1f}s"
    yield ""


def _latency_lines(res: Results) -> Iterator[str]:
    if not res.latency:
        return
    yield (
        f"3. End-to-end latency a -> b -> c: a Producer at a (1 KiB records, linger {LATENCY_LINGER_MS} ms), "
        f"a Consumer at c; produce send() to poll() return, same clock; {LATENCY_WARMUP_S:g}s warm-up "
        "not counted."
    )
    head = (
        f"   {'flush_interval_ms':>17} {'MB/s':>5} {'records':>8} {'received':>8} {'p50 ms':>7} "
        f"{'p99 ms':>7} {'max ms':>7}"
    )
    yield head
    yield "   " + "-" * (len(head) - 3)
    for lat in res.latency:
        j = lat.as_json()
        note = (
            " (node default: fsync per batch)"
            if lat.flush_interval_ms == 0
            else " (fsync every 5 ms)"
            if lat.flush_interval_ms == 5
            else ""
        )
        yield (
            f"   {lat.flush_interval_ms:>17} {lat.rate_mb_s:>5.1f} {lat.sent:>8} {lat.received:>8} "
            f"{j['p50_ms']:>7.1f} {j['p99_ms']:>7.1f} {j['max_ms']:>7.1f}{note}"
        )
    yield ""


def summary(res: Results) -> Iterator[str]:
    for t in res.throughput:
        ratio = t.georep_mb_s / t.raw_mb_s
        verdict = "meets" if ratio >= THROUGHPUT_TARGET else "BELOW"
        yield (
            f"throughput {size_label(t.batch_bytes)}: {ratio * 100:.1f}% of raw gRPC ready->equal, "
            f"{t.streaming_mb_s / t.raw_mb_s * 100:.1f}% streaming ({verdict} the 50% target)"
        )
    if res.rtt is not None:
        r = res.rtt
        verdict = "meets" if r.ratio >= RTT_TARGET else "BELOW"
        yield (
            f"rtt {r.rtt_ms} ms: {r.ratio * 100:.1f}% of the no-delay row ready->equal, "
            f"{r.streaming_ratio * 100:.1f}% streaming ({verdict} the 70% target)"
        )
    if res.wire is not None:
        verdict = "meets" if res.wire.ratio <= WIRE_TARGET else "ABOVE"
        yield f"wire: {res.wire.ratio:.3f} bytes sent per byte produced per other site ({verdict} the 1.2 target)"
    for lat in res.latency:
        p99 = lat.pct(0.99)
        verdict = "meets" if p99 <= LATENCY_TARGET_P99_MS else "ABOVE"
        lost = "" if lat.received == lat.sent else f"; {lat.sent - lat.received} records NOT received"
        yield (
            f"latency flush_interval_ms={lat.flush_interval_ms}: p99 {p99:.1f} ms over two hops "
            f"({verdict} the 100 ms target){lost}"
        )


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of byte counts") from None
    if not sizes or min(sizes) < 2048:
        raise argparse.ArgumentTypeError(f"batch sizes must each hold at least one 1 KiB record: {text!r}")
    return sizes


def parse_only(text: str) -> list[str]:
    parts = [x.strip() for x in text.split(",") if x.strip()]
    bad = [p for p in parts if p not in ("throughput", "rtt", "wire", "latency")]
    if bad or not parts:
        raise argparse.ArgumentTypeError(
            f"--only takes throughput, rtt, wire or latency (comma-separated), not {text!r}"
        )
    return parts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--only",
        type=parse_only,
        default=["throughput", "rtt", "wire", "latency"],
        help="throughput, rtt, wire or latency (comma-separated; default all four)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one run each: a smoke run under 30 s")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument(
        "--batch-sizes",
        type=parse_sizes,
        default=[65536, 1048576],
        help="throughput batch sizes in bytes (default 65536,1048576)",
    )
    parser.add_argument(
        "--link-mb", type=float, help="throughput and rtt: MB produced at a per batch size (default 400)"
    )
    parser.add_argument("--repeats", type=int, help="throughput: runs per batch size, best kept (default 3)")
    parser.add_argument("--rtt-ms", type=int, default=200, help="rtt: the round trip of the delayed row (default 200)")
    parser.add_argument(
        "--rtt-batch-bytes", type=int, default=1048576, help="rtt: batch size in bytes (default 1048576)"
    )
    parser.add_argument("--wire-mb", type=float, help="wire: MB produced at each of the 5 sites (default 20)")
    parser.add_argument("--latency-s", type=float, help="latency: measured seconds per run (default 10)")
    parser.add_argument(
        "--latency-rate",
        type=float,
        default=LATENCY_RATE_MB_S,
        help=f"latency: produce rate in MB/s (default {LATENCY_RATE_MB_S:g})",
    )
    parser.add_argument(
        "--latency-flush-ms",
        type=str,
        default=None,
        help="latency: topic flush_interval_ms values to run, comma-separated (default 0,5; "
        "--quick 0); 0 is the node default, an fsync per batch",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (node logs) on exit")
    parser.add_argument("--serve-raw", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    q = args.quick
    args.link_mb = args.link_mb if args.link_mb is not None else (4 if q else 400)
    args.repeats = args.repeats if args.repeats is not None else (1 if q else 3)
    args.wire_mb = args.wire_mb if args.wire_mb is not None else (1 if q else 20)
    args.latency_s = args.latency_s if args.latency_s is not None else (2 if q else 10)
    flush = args.latency_flush_ms if args.latency_flush_ms is not None else ("0" if q else "0,5")
    try:
        args.latency_flush_ms = [int(x) for x in flush.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--latency-flush-ms {flush!r} is not a comma-separated list of integers")
    if args.repeats < 1 or args.link_mb <= 0 or args.wire_mb <= 0 or args.latency_s <= 0:
        parser.error("--repeats, --link-mb, --wire-mb and --latency-s must be positive")
    if args.rtt_ms < 0 or args.rtt_batch_bytes < 2048:
        parser.error("--rtt-ms must be >= 0 and --rtt-batch-bytes at least 2048 (one 1 KiB record)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the finally blocks and the exit stack stop every child process.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.serve_raw is not None:
        asyncio.run(serve_raw(args.serve_raw))
        return 0
    cfg = Config(
        args.only,
        args.batch_sizes,
        int(args.link_mb * 1e6),
        args.repeats,
        args.rtt_ms,
        args.rtt_batch_bytes,
        int(args.wire_mb * 1e6),
        args.latency_s,
        args.latency_rate,
        args.latency_flush_ms,
    )
    cores = os.cpu_count() or 1
    print(
        f"georep replication benchmark: {cores} cores ({platform.machine()}), Python {platform.python_version()}, "
        f"grpcio {grpc.__version__}"
    )
    print("This machine is shared and noisy: absolute MB/s and ms vary run to run; compare the ratios in one run.")
    if cores < 4:
        print(f"Note: with {cores} cores every site's node, the reference and the bench client compete for CPU.")
    print()
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        root = Path(tempfile.mkdtemp(prefix="georep-bench-repl-"))
        if args.keep:
            print(f"keeping {root} (node logs: {root}/*.log)")
        else:
            stack.callback(shutil.rmtree, root, ignore_errors=True)
        res = asyncio.run(run_all(cfg, root))
    for line in report(res, cfg):
        print(line)
    for line in summary(res):
        print(line)
    print(f"(total {time.monotonic() - started:.0f}s)")
    if args.json:
        doc = {
            "cores": cores,
            "machine": platform.machine(),
            "python": platform.python_version(),
            "grpcio": grpc.__version__,
            "repeats": cfg.repeats,
            "throughput": [t.as_json() for t in res.throughput],
            "rtt": res.rtt.as_json() if res.rtt else None,
            "wire": res.wire.as_json() if res.wire else None,
            "latency": [lat.as_json() for lat in res.latency],
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
