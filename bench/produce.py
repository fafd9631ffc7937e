"""Produce throughput of one georep node, next to raw gRPC and NATS JetStream on this machine.

Run from the repository root::

    .venv/bin/python bench/produce.py            # full run, a few minutes
    .venv/bin/python bench/produce.py --quick    # smoke run, seconds

Every number comes from this one run on this machine, because absolute MB/s on a
shared machine mean little: compare the ratios. What is measured (bench/README.md
explains how to read it):

* ``georep client``: ``georep.client.Producer`` sending 1 KiB records and awaiting
  every future (encode, accumulate, gRPC, the node, acks).
* ``georep stream``: batches encoded before the clock starts (with idempotent
  producer fields) pushed through the ``ProduceStream`` RPC with a window of
  requests in flight. This isolates the node.
* ``raw gRPC``: the same request bytes streamed to a grpc.aio server in another
  process whose client-streaming handler only counts them. The ceiling for any
  Python gRPC service on this machine.
* ``durable ceiling``: the same raw gRPC sink, but its handler also appends each
  request to a file and a task fsyncs that file every 100 ms, as the node does
  (``--flush-interval-ms 100``, acks after the write). The ceiling for a Python
  gRPC service that keeps what it takes: the honest bound for ``georep stream``.
* ``encode``: ``encode_batch`` records/s on one core, and ``Producer.send``
  records/s into the accumulator when the client allows measuring it alone.
* ``nats js``: NATS JetStream (file storage) with pipelined async publishes of
  the same 1 KiB payloads, when ``nats-server`` is installed.
* ``... mTLS``: the same stream and client runs against a second node that
  serves mutual TLS (a development CA made for the run), alternating with the
  plaintext runs; the summary gives what TLS costs against plaintext (issue 12's
  target: at most 25% of produce throughput).

The node runs with ``--flush-interval-ms 100`` (fsync every 100 ms, acks after
the write, like Kafka's defaults) and produce uses acks=leader.
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
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from georep.auth.principal import site_principal
from georep.client.connection import CHANNEL_OPTIONS
from georep.node.serve import KEEPALIVE_MIN_INTERVAL_MS
from georep.proto import georep_pb2 as pb
from georep.record.batch import HEADER_BYTES, RecordInput, encode_batch
from georep.security import dev_ca
from georep.security.tls import TlsConfig, add_port, client_channel
from georep.server.process import NodeProcess

RECORD_VALUE_BYTES = 1024
RECORD_OVERHEAD_BYTES = 29  # fixed fields of one encoded record (batch.py, "Record layout")
DEFAULT_RECORDS = 300_000  # ~300 MiB per measurement: a few seconds at the rates seen on a laptop core
QUICK_RECORDS = 4_000
DEFAULT_WINDOW_BYTES = 16 << 20  # bytes of requests in flight on one stream
CLIENT_LINGER_MS = 5
NATS_WINDOW_MESSAGES = 4096  # JetStream async publishes awaiting their ack
RAW_METHOD = "/bench.Sink/Push"
DURABLE_METHOD = "/bench.Sink/PushDurable"
DURABLE_FSYNC_INTERVAL_S = 0.1  # the node's --flush-interval-ms 100
PRODUCE_STREAM_METHOD = "/georep.v1.Node/ProduceStream"
NODE_FLUSH_INTERVAL_MS = 100
# Node and raw server accept the same message sizes as the georep client sends.
RAW_SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", 256 << 20),
    ("grpc.max_send_message_length", 256 << 20),
    # The same client channel pings every 10 s: answer it as a node does, not with GOAWAY "too_many_pings" in the
    # middle of a long run.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MIN_INTERVAL_MS),
]


class BenchError(RuntimeError):
    """A measurement could not run; the message says why."""


@dataclass
class Result:
    name: str  # what was measured, e.g. "georep stream"
    batch_bytes: int  # target batch size; 0 when batches do not apply
    partitions: int
    records: int
    payload_bytes: int  # batch bytes (georep, raw) or message payload bytes (NATS)
    seconds: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def best_s(self) -> float:
        return min(self.seconds)

    @property
    def mb_s(self) -> float:
        return self.payload_bytes / self.best_s / 1e6

    @property
    def records_s(self) -> float:
        return self.records / self.best_s

    def runs_mb_s(self) -> list[float]:
        return [self.payload_bytes / s / 1e6 for s in self.seconds]

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(best_s=self.best_s, mb_s=self.mb_s, records_s=self.records_s, runs_mb_s=self.runs_mb_s())
        return out


# -- workload -------------------------------------------------------------------


def records_per_batch(batch_bytes: int) -> int:
    return max(1, (batch_bytes - HEADER_BYTES) // (RECORD_VALUE_BYTES + RECORD_OVERHEAD_BYTES))


def record_inputs(count: int, value: bytes) -> list[RecordInput]:
    now = int(time.time() * 1000)
    return [RecordInput(None, value, (), now) for _ in range(count)]


@dataclass
class Requests:
    """Serialized ``ProduceRequest`` messages and the batch bytes they carry."""

    messages: list[bytes]
    records: int
    batch_bytes: int


def build_requests(topic: str, partitions: int, records: int, batch_bytes: int, value: bytes, seed: int) -> Requests:
    """Batches of about ``batch_bytes``, round-robin over partitions, as an idempotent producer makes them."""
    per_batch = records_per_batch(batch_bytes)
    full = record_inputs(per_batch, value)
    producer_id = (seed * 7919 + os.getpid()) & ((1 << 62) - 1)
    sequences = [0] * partitions
    messages: list[bytes] = []
    total_batch_bytes = 0
    left = records
    i = 0
    while left > 0:
        n = min(per_batch, left)
        p = i % partitions
        batch = encode_batch(full[:n], producer_id=producer_id, producer_epoch=0, base_sequence=sequences[p])
        sequences[p] += n
        total_batch_bytes += len(batch)
        req = pb.ProduceRequest(correlation_id=i, topic=topic, partition=p, batch=batch, acks=pb.ACKS_LEADER)
        messages.append(req.SerializeToString())
        left -= n
        i += 1
    return Requests(messages, records, total_batch_bytes)


# -- processes ------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"{what} exited with {proc.returncode} before listening on 127.0.0.1:{port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.05)
    raise BenchError(f"{what} did not listen on 127.0.0.1:{port} within {timeout_s:g}s")


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def start_raw_server(stack: contextlib.ExitStack, log_dir: Path) -> str:
    """The reference sink, in its own process like the node."""
    port = free_port()
    log = open(log_dir / "raw-grpc.log", "wb")  # noqa: SIM115 - closed by the exit stack
    stack.callback(log.close)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--serve-raw", str(port), "--raw-dir", str(log_dir)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    stack.callback(stop_process, proc)
    wait_for_port(port, proc, "raw gRPC server")
    return f"127.0.0.1:{port}"


def start_node(stack: contextlib.ExitStack, root: Path, tls: TlsConfig | None = None) -> NodeProcess:
    node = NodeProcess(
        "bench",
        root / ("node-tls" if tls else "node"),
        tls=tls,
        extra_args=["--flush-interval-ms", str(NODE_FLUSH_INTERVAL_MS)],
    )
    stack.callback(node.stop)
    return node.start()


def make_certs(root: Path) -> tuple[TlsConfig, TlsConfig]:
    """A development CA for the run: the mTLS node's certificate (site:bench) and the client's (client:admin)."""
    certs = root / "certs"
    dev_ca.init(certs, dev_ca.plan(["bench"], {}, []))
    return TlsConfig.from_dir(certs, site_principal("bench")), TlsConfig.from_dir(certs)


def start_nats(stack: contextlib.ExitStack, root: Path) -> str | None:
    exe = shutil.which("nats-server")
    if exe is None:
        return None
    port = free_port()
    store = root / "nats"
    store.mkdir()
    log = open(root / "nats.log", "wb")  # noqa: SIM115 - closed by the exit stack
    stack.callback(log.close)
    cmd = [exe, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(store)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    stack.callback(stop_process, proc)
    wait_for_port(port, proc, "nats-server")
    return f"nats://127.0.0.1:{port}"


# -- raw gRPC reference server (runs in a child process) ------------------------


async def serve_raw(port: int, directory: Path) -> None:
    async def push(requests: Any, context: grpc.aio.ServicerContext) -> bytes:
        total = 0
        async for message in requests:
            total += len(message)
        return total.to_bytes(8, "big")

    calls = iter(range(1 << 30))
    closing: set[asyncio.Task[None]] = set()

    async def push_durable(requests: Any, context: grpc.aio.ServicerContext) -> bytes:
        """Append every request to a file (one write each, like the node's append of a batch) while a task
        fsyncs it every 100 ms in a thread; answers after the last write, as the node acks acks=leader."""
        path = directory / f"durable-{next(calls)}.log"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        fsyncer = asyncio.create_task(fsync_every(fd, DURABLE_FSYNC_INTERVAL_S))
        total = 0
        try:
            async for message in requests:
                os.write(fd, message)
                total += len(message)
        finally:
            fsyncer.cancel()
            # The node answers acks=leader after the write, not after a last fsync: so does the sink. The last
            # fsync, the close and the unlink run after the answer, untimed.
            closing.add(asyncio.create_task(close_durable(fd, path)))
            closing.difference_update({t for t in closing if t.done()})
        return total.to_bytes(8, "big")

    handler = grpc.method_handlers_generic_handler(
        "bench.Sink",
        {
            "Push": grpc.stream_unary_rpc_method_handler(push, None, None),
            "PushDurable": grpc.stream_unary_rpc_method_handler(push_durable, None, None),
        },
    )
    await serve_until_signalled(handler, port)


async def close_durable(fd: int, path: Path) -> None:
    await asyncio.to_thread(os.fsync, fd)
    os.close(fd)
    await asyncio.to_thread(path.unlink)


async def fsync_every(fd: int, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        await asyncio.to_thread(os.fsync, fd)


async def serve_until_signalled(handler: grpc.GenericRpcHandler, port: int) -> None:
    """Serve a raw reference handler on 127.0.0.1:port until SIGTERM or SIGINT."""
    server = grpc.aio.server(options=RAW_SERVER_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    if add_port(server, f"127.0.0.1:{port}", None) == 0:
        raise BenchError(f"raw gRPC server cannot listen on 127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1)


# -- measurements -----------------------------------------------------------------


async def raw_push(channel: grpc.aio.Channel, messages: Sequence[bytes], method: str = RAW_METHOD) -> float:
    push = channel.stream_unary(method, request_serializer=None, response_deserializer=None)
    start = time.perf_counter()
    call = push()
    for message in messages:
        await call.write(message)
    await call.done_writing()
    received = int.from_bytes(await call, "big")
    elapsed = time.perf_counter() - start
    expected = sum(len(m) for m in messages)
    if received != expected:
        raise BenchError(f"raw gRPC server counted {received} bytes, {expected} were sent")
    return elapsed


async def stream_produce(channel: grpc.aio.Channel, messages: Sequence[bytes], window: int) -> float:
    """Push serialized requests through ProduceStream with at most ``window`` unanswered."""
    produce = channel.stream_stream(
        PRODUCE_STREAM_METHOD, request_serializer=None, response_deserializer=pb.ProduceResponse.FromString
    )
    slots = asyncio.Semaphore(window)
    start = time.perf_counter()
    call = produce()

    async def read_answers() -> None:
        answered = 0
        async for response in call:
            if response.HasField("error"):
                raise BenchError(f"ProduceStream answered {response.error.code}: {response.error.message}")
            answered += 1
            slots.release()
        if answered != len(messages):
            raise BenchError(f"ProduceStream answered {answered} of {len(messages)} requests")

    reader = asyncio.create_task(read_answers())
    try:
        for message in messages:
            await slots.acquire()
            if reader.done():
                break
            await call.write(message)
        await call.done_writing()
        await reader
    finally:
        reader.cancel()
    return time.perf_counter() - start


async def create_topic(channel: grpc.aio.Channel, name: str, partitions: int) -> None:
    create = channel.unary_unary(
        "/georep.v1.Node/CreateTopic",
        request_serializer=pb.CreateTopicRequest.SerializeToString,
        response_deserializer=pb.TopicDescription.FromString,
    )
    await create(pb.CreateTopicRequest(name=name, partitions=partitions), timeout=30)


async def client_produce(
    address: str, topic: str, records: int, batch_bytes: int, value: bytes, tls: TlsConfig | None = None
) -> float:
    """``georep.client.Producer``: send every record, then wait until every one is acknowledged."""
    from georep.client import Producer  # imported late: the rest of the bench runs without the client

    producer = Producer(address, acks="leader", batch_size=batch_bytes, linger_ms=CLIENT_LINGER_MS, tls=tls)
    await producer.start()
    try:
        await producer.send(topic, value)  # topic metadata and the stream, before the clock
        futures = []
        start = time.perf_counter()
        for _ in range(records):
            futures.append(producer.send(topic, value))
            if producer.buffered_bytes > producer.buffer_memory:
                await producer.wait_for_buffer()
        await producer.flush()
        elapsed = time.perf_counter() - start
        await asyncio.gather(*futures)  # raises the first delivery error, if any
        return elapsed
    finally:
        await producer.close()


async def client_send_only(address: str, topic: str, records: int, batch_bytes: int, value: bytes) -> float:
    """``Producer.send`` alone: the loop never yields while timed, so no I/O runs in between."""
    from georep.client import Producer

    producer = Producer(
        address, acks="leader", batch_size=batch_bytes, linger_ms=CLIENT_LINGER_MS, buffer_memory=1 << 40
    )
    await producer.start()
    try:
        await producer.send(topic, value)
        send = producer.send
        start = time.perf_counter()
        for _ in range(records):
            send(topic, value)
        elapsed = time.perf_counter() - start
        await producer.flush()  # untimed; delivers what was buffered
        return elapsed
    finally:
        await producer.close()


def measure_encode(records: int, batch_bytes: int, value: bytes) -> float:
    per_batch = records_per_batch(batch_bytes)
    batches = [record_inputs(per_batch, value) for _ in range(max(1, records // per_batch))]
    start = time.perf_counter()
    for i, batch in enumerate(batches):
        encode_batch(batch, producer_id=1, producer_epoch=0, base_sequence=i * per_batch)
    return time.perf_counter() - start


async def nats_publish(url: str, stream: str, records: int, value: bytes) -> float:
    import nats
    from nats.js.api import StorageType

    nc = await nats.connect(url)
    try:
        js = nc.jetstream(publish_async_max_pending=NATS_WINDOW_MESSAGES)
        subject = f"{stream}.events"
        await js.add_stream(name=stream, subjects=[subject], storage=StorageType.FILE)
        futures = []
        start = time.perf_counter()
        for _ in range(records):
            futures.append(await js.publish_async(subject, value))
        await asyncio.gather(*futures)
        elapsed = time.perf_counter() - start
        info = await js.stream_info(stream)
        if info.state.messages != records:
            raise BenchError(f"NATS stream {stream} holds {info.state.messages} messages, {records} were published")
        await js.delete_stream(stream)
        return elapsed
    finally:
        await nc.close()


# -- the run ----------------------------------------------------------------------


@dataclass
class Config:
    records: int
    batch_sizes: list[int]
    partitions: list[int]
    repeats: int
    window_bytes: int
    skip_client: bool


def settle_page_cache() -> None:
    """Write back dirty pages left by earlier runs before the next one starts.

    Page-cache writes on these VMs slow down several-fold while GBs of dirty
    pages wait for writeback (the kernel throttles writers). Without this, a run
    pays for the one before it, and the raw sink, which writes nothing, never does.
    """
    os.sync()


async def repeat(result: Result, repeats: int, run: Callable[[int], Awaitable[float]]) -> Result:
    for i in range(repeats):
        settle_page_cache()
        result.seconds.append(await run(i))
    return result


def progress(text: str) -> None:
    print(f"  .. {text}", file=sys.stderr, flush=True)


@dataclass
class Bench:
    """The channels and settings one run of every measurement shares; each method measures one family of rows."""

    cfg: Config
    node_address: str
    node: grpc.aio.Channel
    raw: grpc.aio.Channel
    tls_address: str | None
    client_tls: TlsConfig | None
    tls: grpc.aio.Channel | None
    value: bytes = field(default_factory=lambda: os.urandom(RECORD_VALUE_BYTES))
    run_id: str = field(default_factory=lambda: os.urandom(4).hex())  # topics never collide with an earlier run
    topics: Iterator[int] = field(default_factory=lambda: iter(range(1 << 30)))

    def next_topic(self, kind: str, batch_bytes: int, partitions: int) -> str:
        return f"bench-{self.run_id}-{kind}-{batch_bytes}-{partitions}p-{next(self.topics)}"

    async def stream_rows(self, batch_bytes: int, partitions: int) -> list[Result]:
        """The node's produce stream, the raw sink and the durable ceiling on the same request bytes (and the
        node over mutual TLS), their runs alternating."""
        cfg = self.cfg
        window = max(2, cfg.window_bytes // batch_bytes)
        stream = Result("georep stream", batch_bytes, partitions, cfg.records, 0, note=f"window {window}")
        raw = Result("raw gRPC", batch_bytes, partitions, cfg.records, 0, note="client-streaming sink")
        interval = f"raw gRPC + append, fsync every {DURABLE_FSYNC_INTERVAL_S * 1000:.0f} ms"
        durable = Result("durable ceiling", batch_bytes, partitions, cfg.records, 0, note=interval)
        stream_tls = Result(
            "georep stream mTLS", batch_bytes, partitions, cfg.records, 0, note=f"window {window}, mutual TLS"
        )
        for i in range(cfg.repeats):
            topic = self.next_topic("stream", batch_bytes, partitions)
            await create_topic(self.node, topic, partitions)
            reqs = build_requests(topic, partitions, cfg.records, batch_bytes, self.value, seed=i)
            stream.payload_bytes = raw.payload_bytes = durable.payload_bytes = reqs.batch_bytes
            progress(f"georep stream {size_label(batch_bytes)} x{partitions}p run {i + 1}")
            settle_page_cache()
            stream.seconds.append(await stream_produce(self.node, reqs.messages, window))
            progress(f"raw gRPC {size_label(batch_bytes)} run {i + 1}")
            raw.seconds.append(await raw_push(self.raw, reqs.messages))
            progress(f"durable ceiling {size_label(batch_bytes)} run {i + 1}")
            settle_page_cache()
            durable.seconds.append(await raw_push(self.raw, reqs.messages, DURABLE_METHOD))
            del reqs
            if self.tls is not None:
                topic = self.next_topic("stream-tls", batch_bytes, partitions)
                await create_topic(self.tls, topic, partitions)
                reqs = build_requests(topic, partitions, cfg.records, batch_bytes, self.value, seed=i)
                stream_tls.payload_bytes = reqs.batch_bytes
                progress(f"georep stream mTLS {size_label(batch_bytes)} x{partitions}p run {i + 1}")
                settle_page_cache()
                stream_tls.seconds.append(await stream_produce(self.tls, reqs.messages, window))
                del reqs
        return [stream, *([stream_tls] if self.tls is not None else []), raw, durable]

    async def client_rows(self, batch_bytes: int, partitions: int) -> list[Result]:
        """georep's Producer (and over mutual TLS right after each run); none when the client is missing."""
        cfg = self.cfg
        payload = cfg.records * (RECORD_VALUE_BYTES + RECORD_OVERHEAD_BYTES)
        note = f"Producer, linger {CLIENT_LINGER_MS} ms"
        client = Result("georep client", batch_bytes, partitions, cfg.records, payload, note=note)
        tls_row = Result(
            "georep client mTLS", batch_bytes, partitions, cfg.records, payload, note=f"{note}, mutual TLS"
        )

        async def run_client(i: int) -> float:
            topic = self.next_topic("client", batch_bytes, partitions)
            await create_topic(self.node, topic, partitions)
            progress(f"georep client {size_label(batch_bytes)} x{partitions}p run {i + 1}")
            elapsed = await client_produce(self.node_address, topic, cfg.records, batch_bytes, self.value)
            if self.tls is not None and self.tls_address is not None:  # the mTLS run right after
                topic = self.next_topic("client-tls", batch_bytes, partitions)
                await create_topic(self.tls, topic, partitions)
                progress(f"georep client mTLS {size_label(batch_bytes)} x{partitions}p run {i + 1}")
                settle_page_cache()
                tls_row.seconds.append(
                    await client_produce(self.tls_address, topic, cfg.records, batch_bytes, self.value, self.client_tls)
                )
            return elapsed

        try:
            rows = [await repeat(client, cfg.repeats, run_client)]
        except ImportError as exc:
            progress(f"georep.client.Producer is not available ({exc}); skipping the client runs")
            cfg.skip_client = True
            return []
        return rows + ([tls_row] if tls_row.seconds else [])

    async def one_core_rows(self, batch_bytes: int) -> list[Result]:
        """encode_batch, and Producer.send accumulating only: what one core does with no I/O."""
        cfg = self.cfg
        encode = Result("encode_batch", batch_bytes, 1, 0, 0, note="1 core, no I/O")
        for i in range(cfg.repeats):
            progress(f"encode_batch {size_label(batch_bytes)} run {i + 1}")
            encode.records = records_per_batch(batch_bytes) * max(1, cfg.records // records_per_batch(batch_bytes))
            encode.payload_bytes = encode.records * (RECORD_VALUE_BYTES + RECORD_OVERHEAD_BYTES)
            encode.seconds.append(measure_encode(cfg.records, batch_bytes, self.value))
        if cfg.skip_client:
            return [encode]
        payload = cfg.records * (RECORD_VALUE_BYTES + RECORD_OVERHEAD_BYTES)
        send_only = Result(
            "Producer.send", batch_bytes, 1, cfg.records, payload, note="1 core, accumulate only, no I/O"
        )

        async def run_send(i: int) -> float:
            topic = self.next_topic("send", batch_bytes, 1)
            await create_topic(self.node, topic, 1)
            progress(f"Producer.send {size_label(batch_bytes)} run {i + 1}")
            return await client_send_only(self.node_address, topic, cfg.records, batch_bytes, self.value)

        return [encode, await repeat(send_only, cfg.repeats, run_send)]

    async def nats_row(self, nats_url: str) -> Result:
        cfg = self.cfg
        note = f"publish_async, {NATS_WINDOW_MESSAGES} pending, file storage"
        nats_result = Result("nats js", 0, 1, cfg.records, cfg.records * RECORD_VALUE_BYTES, note=note)

        async def run_nats(i: int) -> float:
            progress(f"nats js run {i + 1}")
            return await nats_publish(nats_url, f"BENCH{i}", cfg.records, self.value)

        return await repeat(nats_result, cfg.repeats, run_nats)


async def run_all(
    cfg: Config,
    node_address: str,
    raw_address: str,
    nats_url: str | None,
    tls_address: str | None = None,
    client_tls: TlsConfig | None = None,
) -> list[Result]:
    """Every measurement; with ``tls_address`` (a node serving mutual TLS) and ``client_tls``, an mTLS row
    beside each georep stream and client row, its runs alternating with the plaintext ones."""
    node = client_channel(node_address, None, CHANNEL_OPTIONS)
    raw = client_channel(raw_address, None, CHANNEL_OPTIONS)
    tls = client_channel(tls_address, client_tls, CHANNEL_OPTIONS) if tls_address else None
    bench = Bench(cfg, node_address, node, raw, tls_address, client_tls, tls)
    results: list[Result] = []
    try:
        for channel in (node, raw, *([tls] if tls is not None else [])):
            await asyncio.wait_for(channel.channel_ready(), 30)
        for batch_bytes in cfg.batch_sizes:
            for partitions in cfg.partitions:
                results += await bench.stream_rows(batch_bytes, partitions)
                if not cfg.skip_client:
                    results += await bench.client_rows(batch_bytes, partitions)
            results += await bench.one_core_rows(batch_bytes)
        if nats_url is not None:
            results.append(await bench.nats_row(nats_url))
    finally:
        for channel in (node, raw, *([tls] if tls is not None else [])):
            await channel.close()
    return results


# -- output -----------------------------------------------------------------------


def size_label(n: int) -> str:
    if n == 0:
        return "-"
    if n % (1 << 20) == 0:
        return f"{n >> 20} MiB"
    if n % (1 << 10) == 0:
        return f"{n >> 10} KiB"
    return f"{n} B"


def find(results: list[Result], name: str, batch_bytes: int, partitions: int) -> Result | None:
    for r in results:
        if r.name == name and r.batch_bytes == batch_bytes and r.partitions == partitions:
            return r
    return None


def ratio_text(num: Result | None, den: Result | None, per_record: bool = False) -> str:
    if num is None or den is None:
        return ""
    value = num.records_s / den.records_s if per_record else num.mb_s / den.mb_s
    return f"{value * 100:.0f}%"


def table(results: list[Result], nats_missing: str | None) -> Iterator[str]:
    nats = next((r for r in results if r.name == "nats js"), None)
    head = (
        f"{'measurement':<18} {'batch':>8} {'parts':>5} {'MB/s':>8} {'records/s':>10}  {'vs raw':>6} "
        f"{'vs dur.':>7} {'vs nats':>7}  {'runs MB/s':<18} note"
    )
    yield head
    yield "-" * len(head)
    for r in results:
        vs_raw = vs_durable = vs_nats = ""
        if r.name.startswith("georep"):
            vs_raw = ratio_text(r, find(results, "raw gRPC", r.batch_bytes, r.partitions))
            vs_durable = ratio_text(r, find(results, "durable ceiling", r.batch_bytes, r.partitions))
            vs_nats = ratio_text(r, nats, per_record=True)
        runs = " ".join(f"{x:.0f}" for x in r.runs_mb_s())
        yield (
            f"{r.name:<18} {size_label(r.batch_bytes):>8} {r.partitions:>5} {r.mb_s:>8.1f} {r.records_s:>10,.0f}  "
            f"{vs_raw:>6} {vs_durable:>7} {vs_nats:>7}  {runs:<18} {r.note}"
        )
    if nats_missing:
        yield f"nats js: {nats_missing}"


def summary(results: list[Result]) -> Iterator[str]:
    for r in results:
        if r.name.endswith(" mTLS"):
            plain = find(results, r.name.removesuffix(" mTLS"), r.batch_bytes, r.partitions)
            if plain is not None:
                ratio = r.mb_s / plain.mb_s
                verdict = "meets" if ratio >= 0.75 else "ABOVE"
                yield (
                    f"{r.name} {size_label(r.batch_bytes)} x{r.partitions}p: {ratio * 100:.1f}% of plaintext, "
                    f"TLS costs {max(0.0, 1 - ratio) * 100:.1f}% ({verdict} the at-most-25% target)"
                )
            continue
        if r.name in ("georep stream", "georep client"):
            raw = find(results, "raw gRPC", r.batch_bytes, r.partitions)
            if raw is not None:
                ratio = r.mb_s / raw.mb_s
                verdict = "meets" if ratio >= 0.5 else "BELOW"
                yield (
                    f"{r.name} {size_label(r.batch_bytes)} x{r.partitions}p: {ratio * 100:.1f}% of raw gRPC "
                    f"({verdict} the 50% target)"
                )
            durable = find(results, "durable ceiling", r.batch_bytes, r.partitions)
            if durable is not None:
                yield (
                    f"{r.name} {size_label(r.batch_bytes)} x{r.partitions}p: {r.mb_s / durable.mb_s * 100:.1f}% of "
                    "the durable ceiling (raw gRPC + append + fsync every 100 ms)"
                )
        if r.name in ("encode_batch", "Producer.send"):
            verdict = "meets" if r.records_s >= 300_000 else "BELOW"
            yield f"{r.name} {size_label(r.batch_bytes)}: {r.records_s:,.0f} records/s ({verdict} the 300k target)"


# -- main -------------------------------------------------------------------------


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of byte counts") from None
    if not sizes or min(sizes) <= HEADER_BYTES + RECORD_VALUE_BYTES + RECORD_OVERHEAD_BYTES:
        raise argparse.ArgumentTypeError(f"sizes must each hold at least one 1 KiB record: {text!r}")
    return sizes


def parse_partitions(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of partition counts") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"partition counts must be >= 1: {text!r}")
    return counts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--records",
        type=int,
        default=None,
        help=f"1 KiB records per measurement (default {DEFAULT_RECORDS}, --quick {QUICK_RECORDS})",
    )
    parser.add_argument(
        "--batch-sizes",
        type=parse_sizes,
        default=[65536, 1048576],
        help="comma-separated batch sizes in bytes (default 65536,1048576)",
    )
    parser.add_argument(
        "--partitions",
        type=parse_partitions,
        default=[1],
        help="comma-separated partition counts, e.g. 1,4 (default 1)",
    )
    parser.add_argument("--repeats", type=int, default=None, help="runs per measurement, best kept (default 3)")
    parser.add_argument(
        "--window-bytes",
        type=int,
        default=DEFAULT_WINDOW_BYTES,
        help="request bytes in flight on ProduceStream (default 16 MiB)",
    )
    parser.add_argument("--no-client", action="store_true", help="skip the georep.client.Producer runs")
    parser.add_argument("--no-nats", action="store_true", help="skip NATS JetStream even if installed")
    parser.add_argument("--no-tls", action="store_true", help="skip the mutual-TLS node and its rows")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run: few records, one run each")
    parser.add_argument("--serve-raw", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--raw-dir", type=Path, default=Path(tempfile.gettempdir()), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.records is None:
        args.records = QUICK_RECORDS if args.quick else DEFAULT_RECORDS
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.records < 1 or args.repeats < 1:
        parser.error("--records and --repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the finally blocks stop every child process.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.serve_raw is not None:
        asyncio.run(serve_raw(args.serve_raw, args.raw_dir))
        return 0
    cfg = Config(args.records, args.batch_sizes, args.partitions, args.repeats, args.window_bytes, args.no_client)
    cores = os.cpu_count() or 1
    print(
        f"georep produce benchmark: {cores} cores ({platform.machine()}), Python {platform.python_version()}, "
        f"grpcio {grpc.__version__}"
    )
    print("This machine is shared and noisy: absolute MB/s vary run to run; only the ratios are meaningful.")
    print(
        f"{cfg.records} records of {RECORD_VALUE_BYTES} B per measurement, best of {cfg.repeats}; "
        f"node fsyncs every {NODE_FLUSH_INTERVAL_MS} ms, acks=leader."
    )
    if cores < 4:
        print(f"Note: with {cores} cores the client, the server and the kernel compete for CPU.")
    nats_missing: str | None = None
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        root = Path(tempfile.mkdtemp(prefix="georep-bench-"))
        stack.callback(shutil.rmtree, root, ignore_errors=True)
        node = start_node(stack, root)
        tls_address, client_tls = None, None
        if not args.no_tls:
            node_tls, client_tls = make_certs(root)
            tls_address = start_node(stack, root, node_tls).address
        raw_address = start_raw_server(stack, root)
        nats_url = None
        if args.no_nats:
            nats_missing = "skipped (--no-nats)"
        else:
            nats_url = start_nats(stack, root)
            if nats_url is None:
                nats_missing = (
                    "nats-server is not on PATH; install it (Debian: apt-get install -y nats-server) "
                    "to compare with NATS JetStream"
                )
        results = asyncio.run(run_all(cfg, node.address, raw_address, nats_url, tls_address, client_tls))
    print()
    for line in table(results, nats_missing):
        print(line)
    print()
    for line in summary(results):
        print(line)
    print(f"(total {time.monotonic() - started:.0f}s)")
    if args.json:
        doc = {
            "cores": cores,
            "machine": platform.machine(),
            "python": platform.python_version(),
            "grpcio": grpc.__version__,
            "records": cfg.records,
            "repeats": cfg.repeats,
            "flush_interval_ms": NODE_FLUSH_INTERVAL_MS,
            "nats": nats_missing or "measured",
            "results": [r.as_json() for r in results],
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
