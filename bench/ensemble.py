"""In-site segment replication at acks=all: a partition leader writing to its ensemble, next to raw gRPC, in one run.

Run from the repository root::

    .venv/bin/python bench/ensemble.py            # full run: ~200 MB of 64 KiB batches, best of 3
    .venv/bin/python bench/ensemble.py --quick    # smoke run, under 30 s

Inside a multi-node site the partition leader writes each open segment to the
other members of its ensemble over ``georep.v1.Segments/AppendSegment``
(``georep/server/ensemble.py``, ``georep/server/segments.py``). What is
measured (bench/README.md explains how to read it):

* ``segment writer``: a ``SegmentWriter`` in this process (the leader, with its
  own ``ReplicaStore`` in the temporary directory), ensemble (1, 2, 3), ack
  quorum 2; members 2 and 3 are ``georep node`` processes. Batches with their
  local prefixes are built before the clock; the clock runs from the first
  ``append`` until ``confirmed(end)`` resolves (two of the three hold every
  batch fsynced), and on until both members hold everything.
* ``raw gRPC``: the same bytes, in requests of the same size, streamed to two
  minimal grpc.aio bidi servers in two other processes at once, each request
  answered with a tiny message once received (no disk), with as many requests
  unanswered per stream as the writer allows. The ceiling for Python gRPC
  streaming on this machine.

Everything runs on 127.0.0.1 with ephemeral ports under one temporary
directory, removed on exit, Ctrl-C or SIGTERM.

The file is not called ``cluster.py``: Python puts ``bench/`` first on
``sys.path`` when it runs a bench script, and a ``bench/cluster.py`` would hide
the ``cluster`` package that georep imports, from every bench script.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

# bench/ is on sys.path when this file runs as a script: reuse produce.py's result and process helpers.
from produce import (
    RECORD_OVERHEAD_BYTES,
    RECORD_VALUE_BYTES,
    BenchError,
    Result,
    free_port,
    progress,
    records_per_batch,
    serve_until_signalled,
    settle_page_cache,
    size_label,
    stop_process,
    wait_for_port,
)

from cluster.lead import PartitionLead
from cluster.quorum import SegmentQuorum
from georep.proto import georep_pb2 as pb
from georep.record.batch import (
    HEADER_BYTES,
    LENGTH_PREFIX_BYTES,
    REWRITTEN_BYTES,
    RecordInput,
    check_batch,
    encode_batch,
    local_prefix,
    stamp_origin,
)
from georep.security.tls import client_channel
from georep.server.ensemble import IN_FLIGHT, REQUEST_MAX_BYTES, SegmentToWrite, SegmentWriter, solo_writer
from georep.server.process import NodeProcess
from georep.storage.api import ReadResult
from georep.storage.replica_store import PartitionKey, ReplicaStore
from offsets.coordinates import LocalOffset, Origin, OriginSeq
from topology.ids import LeaderEpoch, NodeId, SegmentId, SiteId

RECORD_BYTES = RECORD_VALUE_BYTES + RECORD_OVERHEAD_BYTES  # one encoded 1 KiB record
DEFAULT_MB = 200.0
QUICK_MB = 8.0
DEFAULT_BATCH_BYTES = 65536
LEADER = NodeId(1)
MEMBERS = (NodeId(2), NodeId(3))
ENSEMBLE = (LEADER, *MEMBERS)
ACK_QUORUM = 2
EPOCH = LeaderEpoch(1)
SEGMENT_ID = SegmentId(1)
BASE_OFFSET = 1000  # a segment after an earlier one: offsets and origin seqs go on from there
ORIGIN = Origin(SiteId("a"), 1)
START_SEQ = 1000
EXECUTOR_THREADS = 4  # as a node's segment executor (georep/node/serve.py)
RUN_TIMEOUT_S = 300.0
POLL_S = 0.001  # member ends, polled only after confirmed() resolved
RAW_METHOD = "/bench.Members/Append"


def clock_ms() -> int:
    return int(time.time() * 1000)


# -- workload ---------------------------------------------------------------------------------------------------


@dataclass
class Workload:
    """What the leader appends, built before any clock runs."""

    warmup: bytes  # one batch at BASE_OFFSET, appended untimed: both streams are open and answering after it
    batches: list[bytes]  # the timed batches, from the warm-up's end, local prefixes set
    requests: list[bytes]  # the same bytes as serialized SegmentAppendRequests, whole batches up to 1 MiB each
    records: int  # in the timed batches
    end_offset: int  # the segment's end once every batch is appended

    @property
    def batch_bytes(self) -> int:
        return sum(len(b) for b in self.batches)


def build_workload(records: int, batch_bytes: int) -> Workload:
    """1 KiB records in batches of about ``batch_bytes``, stamped by origin ``a`` and given the local prefixes a
    leader gives them at this segment's offsets, as ``ReplicaStore.append`` takes them."""
    per_batch = records_per_batch(batch_bytes)
    now = clock_ms()
    value = os.urandom(RECORD_VALUE_BYTES)
    encoded: dict[int, bytes] = {}  # records in the batch -> the producer's batch (unstamped)
    offset, seq = BASE_OFFSET, START_SEQ

    def next_batch(count: int) -> bytes:
        nonlocal offset, seq
        raw = encoded.get(count)
        if raw is None:
            raw = encoded[count] = encode_batch([RecordInput(None, value, (), now)] * count)
        head, crc = stamp_origin(raw, ORIGIN, seq)
        batch = (
            local_prefix(offset, len(raw) - LENGTH_PREFIX_BYTES, now, crc) + head[REWRITTEN_BYTES:] + raw[HEADER_BYTES:]
        )
        header = check_batch(batch)  # framing and CRC, as the stores will check them
        if header.base_offset != offset or header.base_origin_seq != seq or header.records_count != count:
            raise BenchError(f"batch built at offset {offset}, seq {seq} reads back as {header}")
        offset += count
        seq += count
        return batch

    warmup = next_batch(1)
    batches = []
    left = records
    while left > 0:
        n = min(per_batch, left)
        batches.append(next_batch(n))
        left -= n
    return Workload(warmup, batches, pack_requests(batches), records, offset)


def pack_requests(batches: Sequence[bytes]) -> list[bytes]:
    """Whole batches, as many as fit in the writer's REQUEST_MAX_BYTES (at least one), per request: what
    ``SegmentWriter`` sends when it is behind the appended end, as a ``ReplicaStore.read`` returns it."""
    out: list[bytes] = []
    chunk: list[bytes] = []
    size = 0
    for b in batches:
        if chunk and size + len(b) > REQUEST_MAX_BYTES:
            out.append(pb.SegmentAppendRequest(batches=b"".join(chunk)).SerializeToString())
            chunk, size = [], 0
        chunk.append(b)
        size += len(b)
    if chunk:
        out.append(pb.SegmentAppendRequest(batches=b"".join(chunk)).SerializeToString())
    return out


# -- 1. the segment writer ----------------------------------------------------------------------------------------


class CountingStore(ReplicaStore):
    """The leader's copy. Every ``read`` is one ``AppendSegment`` request to a member, and every ``flush`` one
    fsync of the leader's copy: counting them shows how the writer batched the stream."""

    def __init__(self, data_dir: Path, now_ms: int) -> None:
        super().__init__(data_dir, now_ms)
        self._count_lock = threading.Lock()  # the writer calls the store from executor threads
        self.reads = 0
        self.read_bytes = 0
        self.flushes = 0

    def read(
        self,
        key: PartitionKey,
        segment_id: SegmentId,
        offset: LocalOffset,
        max_bytes: int,
        end_offset: int | None = None,
    ) -> ReadResult:
        result = super().read(key, segment_id, offset, max_bytes, end_offset)
        with self._count_lock:
            self.reads += 1
            self.read_bytes += len(result.data)
        return result

    def flush(self, key: PartitionKey, segment_id: SegmentId) -> LocalOffset:
        flushed = super().flush(key, segment_id)
        with self._count_lock:
            self.flushes += 1
        return flushed


@dataclass
class WriterRun:
    append_s: float  # first append -> last append returned (the leader's own copy holds everything)
    confirmed_s: float  # first append -> confirmed(end) resolved: the ack quorum holds everything fsynced
    both_s: float  # first append -> both members hold everything fsynced
    requests: int  # AppendSegment requests, both member streams together
    request_bytes: int
    leader_fsyncs: int


def quorum(lead: PartitionLead) -> SegmentQuorum:
    """The writer's quorum, as its lead counts it (``cluster/lead.py``)."""
    assert lead.quorum is not None
    return lead.quorum


async def members_hold(writer: SegmentWriter, lead: PartitionLead, end: int) -> None:
    while any(quorum(lead).member_end(n) < end for n in MEMBERS):
        if writer.deposed is not None:
            raise BenchError(f"the writer stopped: {writer.deposed}")
        await asyncio.sleep(POLL_S)


async def writer_run(
    root: Path, addresses: dict[NodeId, str], work: Workload, run: int, executor: ThreadPoolExecutor
) -> WriterRun:
    key = (f"bench-{os.urandom(3).hex()}-{run}", 0)  # a fresh partition at the members every run
    leader_dir = root / f"leader-{run}"
    store = CountingStore(leader_dir, clock_ms())
    segment = SegmentToWrite(key, SEGMENT_ID, BASE_OFFSET, {ORIGIN: OriginSeq(START_SEQ)}, ENSEMBLE, ACK_QUORUM, EPOCH)
    writer, lead = solo_writer(store, segment, LEADER, addresses, executor, clock_ms)
    try:
        async with asyncio.timeout(RUN_TIMEOUT_S):
            await writer.start()
            warm = await writer.append(work.warmup)
            await writer.confirmed(warm)
            await members_hold(writer, lead, warm)  # both streams are open, answered, and past their first request
            reads, read_bytes, flushes = store.reads, store.read_bytes, store.flushes
            end = warm
            start = time.perf_counter()
            for batch in work.batches:
                end = await writer.append(batch)
            appended = time.perf_counter()
            await writer.confirmed(end)
            confirmed = time.perf_counter()
            await members_hold(writer, lead, end)
            both = time.perf_counter()
    except TimeoutError:
        failed = ", ".join(str(n) for n in quorum(lead).failed_members()) or "none"
        raise BenchError(
            f"the segment writer did not finish within {RUN_TIMEOUT_S:g}s: LAC {writer.lac}, appended "
            f"end {quorum(lead).appended_end}, member ends "
            f"{ {n: quorum(lead).member_end(n) for n in MEMBERS} }, failed members: {failed}; rerun "
            "with --keep and read the node logs"
        ) from None
    finally:
        await writer.close()
        store.close()
        shutil.rmtree(leader_dir, ignore_errors=True)  # free the disk for the next run
    if end != work.end_offset:
        raise BenchError(f"the leader's copy ends at {end}, the workload at {work.end_offset}")
    return WriterRun(
        appended - start,
        confirmed - start,
        both - start,
        store.reads - reads,
        store.read_bytes - read_bytes,
        store.flushes - flushes,
    )


def start_members(stack: contextlib.ExitStack, root: Path) -> dict[NodeId, str]:
    nodes = {n: NodeProcess(site="a", data_dir=root / f"node-{n}", log_path=root / f"node-{n}.log") for n in MEMBERS}
    for node in nodes.values():
        stack.callback(node.stop)
    with ThreadPoolExecutor(len(nodes)) as pool:  # both import and start in parallel
        list(pool.map(lambda node: node.start(), nodes.values()))
    return {n: node.address for n, node in nodes.items()}


# -- 2. the raw gRPC reference -------------------------------------------------------------------------------------


async def serve_raw(port: int) -> None:
    """The reference member: a bidi stream that answers every request with 8 bytes once it has it. No disk."""

    async def append(requests: Any, context: grpc.aio.ServicerContext[bytes, bytes]) -> Any:
        async for message in requests:
            yield len(message).to_bytes(8, "big")

    handler = grpc.method_handlers_generic_handler(
        "bench.Members", {"Append": grpc.stream_stream_rpc_method_handler(append, None, None)}
    )
    await serve_until_signalled(handler, port)


def start_raw_servers(stack: contextlib.ExitStack, root: Path, count: int) -> list[str]:
    addresses = []
    for i in range(count):
        port = free_port()
        log = open(root / f"raw-grpc-{i}.log", "wb")  # noqa: SIM115 - closed by the exit stack
        stack.callback(log.close)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--serve-raw", str(port)]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        stack.callback(stop_process, proc)
        addresses.append((port, proc))
    for port, proc in addresses:
        wait_for_port(port, proc, "raw gRPC server")
    return [f"127.0.0.1:{port}" for port, _ in addresses]


async def raw_pump(call: Any, requests: Sequence[bytes], window: int) -> None:
    """Write ``requests`` with at most ``window`` unanswered, until every answer is back."""
    slots = asyncio.Semaphore(window)

    async def answers() -> None:
        for _ in requests:
            if await call.read() is grpc.aio.EOF:
                raise BenchError("a raw gRPC server ended its stream before answering every request")
            slots.release()

    reader = asyncio.create_task(answers())
    try:
        for message in requests:
            await slots.acquire()
            if reader.done():
                break
            await call.write(message)
        await call.done_writing()
        await reader
    finally:
        reader.cancel()


async def raw_run(channels: Sequence[grpc.aio.Channel], requests: Sequence[bytes]) -> float:
    """Both streams opened and answering before the clock, as the writer's are after its warm-up batch."""
    calls: list[Any] = []
    for ch in channels:
        append: Any = ch.stream_stream(RAW_METHOD, request_serializer=None, response_deserializer=None)
        calls.append(append())
    for call in calls:
        await call.write(b"open")
        if await call.read() is grpc.aio.EOF:
            raise BenchError("a raw gRPC server ended its stream at once")
    start = time.perf_counter()
    await asyncio.gather(*(raw_pump(call, requests, IN_FLIGHT) for call in calls))
    elapsed = time.perf_counter() - start
    for call in calls:
        if await call.code() != grpc.StatusCode.OK:
            raise BenchError(f"a raw gRPC stream ended with {await call.code()}: {await call.details()}")
    return elapsed


# -- the run ------------------------------------------------------------------------------------------------------


@dataclass
class Config:
    records: int
    batch_bytes: int
    repeats: int


@dataclass
class Results:
    writer: Result
    both: Result
    raw: Result
    runs: list[WriterRun] = field(default_factory=list)
    batches: int = 0
    requests: int = 0  # raw: requests per stream


async def run_all(cfg: Config, root: Path, addresses: dict[NodeId, str], raw_addresses: list[str]) -> Results:
    progress(f"building {cfg.records:,} records in {size_label(cfg.batch_bytes)} batches")
    work = build_workload(cfg.records, cfg.batch_bytes)
    payload = work.batch_bytes
    res = Results(
        Result(
            "segment writer",
            cfg.batch_bytes,
            1,
            work.records,
            payload,
            note=f"confirmed(end): {ACK_QUORUM} of {len(ENSEMBLE)} hold it fsynced (acks=all)",
        ),
        Result("both members", cfg.batch_bytes, 1, work.records, payload, note="both members hold it fsynced (3 of 3)"),
        Result(
            "raw gRPC",
            cfg.batch_bytes,
            1,
            work.records,
            payload,
            note=f"2 bidi streams, {IN_FLIGHT} unanswered each, no disk",
        ),
        batches=len(work.batches),
        requests=len(work.requests),
    )
    channels = [client_channel(a, None) for a in raw_addresses]  # the writer's channels have no options either
    try:
        for ch in channels:
            await asyncio.wait_for(ch.channel_ready(), 30)
        with ThreadPoolExecutor(EXECUTOR_THREADS, thread_name_prefix="segments") as executor:
            for i in range(cfg.repeats):
                settle_page_cache()
                progress(f"segment writer run {i + 1}")
                run = await writer_run(root, addresses, work, i, executor)
                res.runs.append(run)
                res.writer.seconds.append(run.confirmed_s)
                res.both.seconds.append(run.both_s)
                settle_page_cache()
                progress(f"raw gRPC run {i + 1}")
                res.raw.seconds.append(await raw_run(channels, work.requests))
    finally:
        for ch in channels:
            await ch.close()
    return res


def table(res: Results) -> Iterator[str]:
    head = f"{'row':<15} {'MB/s':>8} {'records/s':>10} {'vs raw':>7}  {'runs MB/s':<18} note"
    yield head
    yield "-" * len(head)
    for r in (res.writer, res.both, res.raw):
        runs = " ".join(f"{x:.0f}" for x in r.runs_mb_s())
        yield (
            f"{r.name:<15} {r.mb_s:>8.1f} {r.records_s:>10,.0f} {r.mb_s / res.raw.mb_s * 100:>6.0f}%  "
            f"{runs:<18} {r.note}"
        )


def details(res: Results) -> Iterator[str]:
    yield "segment writer, per run (both member streams together; the leader's fsyncs of its own copy):"
    for i, run in enumerate(res.runs):
        mean = run.request_bytes / run.requests if run.requests else 0.0
        yield (
            f"  run {i + 1}: appends done after {run.append_s:.2f}s, confirmed after {run.confirmed_s:.2f}s, "
            f"both members after {run.both_s:.2f}s; {run.requests} AppendSegment requests of "
            f"{mean / 1024:,.0f} KiB on average ({res.batches} batches appended); "
            f"{run.leader_fsyncs} leader fsyncs"
        )
    yield (
        f"raw gRPC: {res.requests} requests of up to {size_label(REQUEST_MAX_BYTES)} per stream, "
        "the fewest the writer can send"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_MB:g} MB, one run: a smoke run under 30 s")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--records", type=int, help="1 KiB records per run")
    size.add_argument("--mb", type=float, help=f"MB of records per run (default {DEFAULT_MB:g}, --quick {QUICK_MB:g})")
    parser.add_argument(
        "--batch-bytes",
        type=int,
        default=DEFAULT_BATCH_BYTES,
        help=f"bytes per batch, as a producer fills them (default {DEFAULT_BATCH_BYTES})",
    )
    parser.add_argument("--repeats", type=int, help="runs of each row, best kept (default 3, --quick 1)")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (node logs) on exit")
    parser.add_argument("--serve-raw", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.records is None:
        mb = args.mb if args.mb is not None else (QUICK_MB if args.quick else DEFAULT_MB)
        args.records = int(mb * 1e6 / RECORD_BYTES)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.records < 1 or args.repeats < 1:
        parser.error("--records (or --mb) and --repeats must be positive")
    if args.batch_bytes < HEADER_BYTES + RECORD_BYTES:
        parser.error(f"--batch-bytes must hold at least one 1 KiB record: {HEADER_BYTES + RECORD_BYTES} or more")
    if args.batch_bytes > REQUEST_MAX_BYTES:
        parser.error(f"--batch-bytes above {REQUEST_MAX_BYTES} would not fit in one AppendSegment request")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the exit stack stops every child process and removes the directory.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.serve_raw is not None:
        asyncio.run(serve_raw(args.serve_raw))
        return 0
    logging.basicConfig(level=logging.WARNING, format="  !! %(name)s: %(message)s")  # a stream that breaks says so
    cfg = Config(args.records, args.batch_bytes, args.repeats)
    cores = os.cpu_count() or 1
    print(
        f"georep in-site segment replication benchmark: {cores} cores ({platform.machine()}), "
        f"Python {platform.python_version()}, grpcio {grpc.__version__}"
    )
    print("This machine is shared and noisy: absolute MB/s vary run to run; only the ratios are meaningful.")
    print(
        f"Ensemble {tuple(int(n) for n in ENSEMBLE)}, ack quorum {ACK_QUORUM}: the leader is this process, members "
        f"2 and 3 are georep node processes; every AppendSegment request is fsynced by the member before its "
        f"answer, and the leader fsyncs its own copy."
    )
    print(
        f"{cfg.records:,} records of {RECORD_VALUE_BYTES} B per run in {size_label(cfg.batch_bytes)} batches, "
        f"best of {cfg.repeats}."
    )
    if cores < 4:
        print(f"Note: with {cores} cores the leader, both members and the kernel compete for CPU.")
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        root = Path(tempfile.mkdtemp(prefix="georep-bench-ensemble-"))
        if args.keep:
            print(f"keeping {root} (node logs: {root}/*.log)")
        else:
            stack.callback(shutil.rmtree, root, ignore_errors=True)
        progress("starting members 2 and 3 and two raw gRPC servers")
        addresses = start_members(stack, root)
        raw_addresses = start_raw_servers(stack, root, len(MEMBERS))
        res = asyncio.run(run_all(cfg, root, addresses, raw_addresses))
    print()
    for line in table(res):
        print(line)
    print()
    for line in details(res):
        print(line)
    print()
    print(
        f"segment writer at acks=all: {res.writer.mb_s / res.raw.mb_s * 100:.1f}% of raw gRPC; both members "
        f"hold everything at {res.both.mb_s / res.raw.mb_s * 100:.1f}% of raw gRPC"
    )
    print(f"(total {time.monotonic() - started:.0f}s)")
    if args.json:
        doc = {
            "cores": cores,
            "machine": platform.machine(),
            "python": platform.python_version(),
            "grpcio": grpc.__version__,
            "records": cfg.records,
            "batch_bytes": cfg.batch_bytes,
            "repeats": cfg.repeats,
            "ensemble": [int(n) for n in ENSEMBLE],
            "ack_quorum": ACK_QUORUM,
            "in_flight": IN_FLIGHT,
            "request_max_bytes": REQUEST_MAX_BYTES,
            "batches": res.batches,
            "raw_requests_per_stream": res.requests,
            "results": [r.as_json() for r in (res.writer, res.both, res.raw)],
            "writer_runs": [asdict(run) for run in res.runs],
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
