"""A node-kill storm on a three-node site: idempotent producers at acks=all while partition leaders die, again
and again.

Run from the repository root::

    .venv/bin/python bench/storm.py                    # 5 seeds x 40 s of kills, about 5 minutes
    .venv/bin/python bench/storm.py --pause            # the same with SIGSTOP pauses of 1-3 s instead of kills
    .venv/bin/python bench/storm.py --seeds 1 --seconds 10   # a smoke run

Each seed starts its own site ``a`` of three ``georep node --node-id N`` processes (replication factor 3,
min-insync 2, ``--session-timeout-ms`` 500 by default, small segments so that rolls happen all along:
``--segment-bytes``), creates a topic of ``--partitions`` partitions, and runs ``--producers``
``georep.client.Producer`` instances (idempotent, ``acks=all``), each sending ``--rate`` records a second,
every record's value unique. Meanwhile, for ``--seconds``:

* **kills** (the default): the leader of a partition drawn from the seed gets ``SIGKILL``; it is restarted at
  once, and as soon as it serves again (it wrote ``node.json``), the leader of the next drawn partition is
  killed. A kill often lands in a roll (the leader sealed its segment and had not opened the next), which is
  how the storm found issue 21's bug: the node the controller named next held none of the sealed segment and
  refused every producer's next batch with ``OutOfOrderSequence``.
* **pauses** (``--pause``): the leader gets ``SIGSTOP`` for 1 to 3 s (drawn from the seed), then ``SIGCONT``:
  a frozen leader that wakes up deposed, whose answers (``Fenced``, a stale epoch) the producer must retry.

Then every node runs again, the producers flush (each send is answered: acknowledged or failed), and every
partition is read back from its leader. Per seed and in total, the bench prints the sends, the acks, the sends
failed to the application by error (class name and the first message), and the records lost (acknowledged,
not read back) and duplicated (read back more than once). Nothing failed, lost or duplicated is the target
(docs/design.md, "Producer state across leader changes"); the bench exits 1 otherwise. ``--json FILE``
writes the figures.

Every node is stopped and the temporary directory removed on exit, on an error, on Ctrl-C and on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

# bench/ is on sys.path when this file runs as a script: reuse the helpers of the other benches.
from produce import BenchError, progress
from site_cluster import MIN_INSYNC_REPLICAS, NODES, REPLICATION_FACTOR, Site

from georep.client import Producer
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.record.batch import decode_records, iter_headers
from georep.security.tls import client_channel

TOPIC = "storm"
DEFAULT_SEEDS = 5
DEFAULT_SECONDS = 40.0
DEFAULT_PRODUCERS = 3
DEFAULT_PARTITIONS = 3
DEFAULT_RATE = 200  # records a second, per producer
DEFAULT_SESSION_TIMEOUT_MS = 500
DEFAULT_SEGMENT_BYTES = 64 << 10  # a roll every second or so at the default rate: kills land in rolls
RECORD_BYTES = 100
OUTSTANDING_MAX = 5_000  # per producer: it stops sending above, so a long outage does not pile records up
DELIVERY_TIMEOUT_MS = 120_000
FLUSH_TIMEOUT_S = 150.0
SERVE_TIMEOUT_S = 60.0
PAUSE_S = (1.0, 3.0)
READ_BYTES = 1 << 20
RPC_TIMEOUT_S = 10.0
POLL_S = 0.05


@dataclass
class SeedResult:
    seed: int
    mode: str
    events: int = 0  # kills or pauses
    sent: int = 0
    acked: int = 0
    failed: dict[str, int] = field(default_factory=dict)  # error class -> sends failed to the application
    failure_examples: dict[str, str] = field(default_factory=dict)  # error class -> its first message
    read: int = 0
    lost: int = 0  # acknowledged, not read back
    duplicated: int = 0  # read back more than once (the extra copies)
    seconds: float = 0.0
    error: str = ""

    @property
    def clean(self) -> bool:
        return not self.failed and not self.lost and not self.duplicated and not self.error


class Load:
    """``count`` idempotent producers at acks=all, each sending ``rate`` unique records a second to the topic."""

    def __init__(self, bootstrap: list[str], count: int, rate: float, partitions: int, rng: random.Random) -> None:
        self.producers = [
            Producer(bootstrap, acks="all", delivery_timeout_ms=DELIVERY_TIMEOUT_MS) for _ in range(count)
        ]
        self.rate = rate
        self.partitions = partitions
        self.rng = rng
        self.sent = 0
        self.acked: set[bytes] = set()
        self.failed: Counter[str] = Counter()
        self.examples: dict[str, str] = {}
        self.outstanding = [0] * count
        self.pending: set[asyncio.Future[Any]] = set()
        self.stop = asyncio.Event()

    async def start(self) -> None:
        for p in self.producers:
            await p.start()

    def _done(self, index: int, value: bytes, fut: asyncio.Future[Any]) -> None:
        self.outstanding[index] -= 1
        self.pending.discard(fut)
        if fut.cancelled():
            self.failed["cancelled"] += 1
        elif (exc := fut.exception()) is not None:
            name = type(exc).__name__
            self.failed[name] += 1
            self.examples.setdefault(name, str(exc)[:300])
        else:
            self.acked.add(value)

    async def run(self, index: int) -> None:
        loop = asyncio.get_running_loop()
        interval = 1.0 / self.rate
        next_at = loop.time()
        n = 0
        while not self.stop.is_set():
            if self.outstanding[index] < OUTSTANDING_MAX:
                value = f"p{index}-{n:09d}-".encode().ljust(RECORD_BYTES, b".")
                n += 1
                fut = self.producers[index].send(TOPIC, value, partition=self.rng.randrange(self.partitions))
                self.sent += 1
                self.outstanding[index] += 1
                self.pending.add(fut)
                fut.add_done_callback(lambda f, i=index, v=value: self._done(i, v, f))
            next_at = max(next_at + interval, loop.time())  # no burst to catch up after a stall
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), max(0.0, next_at - loop.time()))

    async def finish(self) -> None:
        """Every send answered (acknowledged or failed), then the producers closed."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(FLUSH_TIMEOUT_S):
                await asyncio.gather(*(p.flush() for p in self.producers), return_exceptions=True)
                await asyncio.gather(*list(self.pending), return_exceptions=True)
        for fut in list(self.pending):
            fut.cancel()
        await asyncio.gather(*(p.close(timeout_s=10) for p in self.producers), return_exceptions=True)


async def leader_of(site: Site, partition: int) -> int | None:
    """The node that leads ``partition`` and serves it (its own DescribeTopic lists it)."""
    for n in site.live():
        with contextlib.suppress(grpc.aio.AioRpcError):
            async with client_channel(site.addresses[n], None) as ch:
                d = await pbg.NodeStub(ch).DescribeTopic(pb.DescribeTopicRequest(name=TOPIC), timeout=RPC_TIMEOUT_S)
            if any(s.partition == partition for s in d.partition_states):
                return n
    return None


async def wait_leader(site: Site, partition: int) -> int:
    deadline = time.monotonic() + SERVE_TIMEOUT_S
    while time.monotonic() < deadline:
        node = await leader_of(site, partition)
        if node is not None:
            return node
        await asyncio.sleep(POLL_S)
    raise BenchError(f"no node serves {TOPIC}-{partition} {SERVE_TIMEOUT_S:g}s after the last event")


async def storm(site: Site, args: argparse.Namespace, rng: random.Random, until: float) -> int:
    """Kill (or pause) a drawn partition's leader, again as soon as the site is whole again, until ``until``."""
    events = 0
    while time.monotonic() < until:
        partition = rng.randrange(args.partitions)
        victim = await wait_leader(site, partition)
        node = site.nodes[victim]
        assert node.proc is not None
        events += 1
        if args.pause:
            pause_s = rng.uniform(*PAUSE_S)
            progress(f"  SIGSTOP node {victim} (leader of {TOPIC}-{partition}) for {pause_s:.1f}s")
            os.kill(node.proc.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(pause_s)
            finally:
                os.kill(node.proc.pid, signal.SIGCONT)
            continue
        progress(f"  SIGKILL node {victim} (leader of {TOPIC}-{partition})")
        node.proc.kill()
        await asyncio.to_thread(node.proc.wait)
        await site.restart(victim)  # returns once it serves: the next kill follows at once
    return events


async def read_back(site: Site, partitions: int) -> Counter[bytes]:
    """Every record of the topic, from each partition's leader (followed if it moves), counted by value."""
    seen: Counter[bytes] = Counter()
    for partition in range(partitions):
        offset = 0
        address = site.addresses[await wait_leader(site, partition)]
        for _ in range(1_000_000):
            request = pb.FetchRequest(
                topic=TOPIC, partition=partition, offset=offset, max_bytes=READ_BYTES, max_wait_ms=0
            )
            try:
                async with client_channel(address, None) as ch:
                    response = await anext(aiter(pbg.NodeStub(ch).Fetch(request, timeout=RPC_TIMEOUT_S)))
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE):
                    raise
                address = site.addresses[await wait_leader(site, partition)]
                continue
            if not response.batches:
                break
            at = 0
            for h in iter_headers(response.batches):
                for record in decode_records(response.batches[at : at + h.size_bytes], h):
                    seen[bytes(record.value or b"")] += 1
                at += h.size_bytes
            offset = response.next_offset
    return seen


async def run_seed(seed: int, args: argparse.Namespace, root: Path) -> SeedResult:
    result = SeedResult(seed, "pause" if args.pause else "kill")
    rng = random.Random(seed)
    node_args = [
        "--replication-factor",
        str(REPLICATION_FACTOR),
        "--min-insync-replicas",
        str(MIN_INSYNC_REPLICAS),
        "--session-timeout-ms",
        str(args.session_timeout_ms),
        "--segment-bytes-max",
        str(args.segment_bytes),
        "--scrub-bytes-per-s",
        "0",
    ]
    site = Site(root / f"seed-{seed}", node_args)
    started = time.monotonic()
    try:
        progress(f"seed {seed}: starting nodes {', '.join(map(str, NODES))}")
        await asyncio.to_thread(site.start)
        async with client_channel(site.addresses[NODES[0]], None) as ch:
            await pbg.NodeStub(ch).CreateTopic(
                pb.CreateTopicRequest(name=TOPIC, partitions=args.partitions), timeout=30
            )
        for partition in range(args.partitions):
            await wait_leader(site, partition)
        load = Load(site.bootstrap, args.producers, args.rate, args.partitions, rng)
        await load.start()
        writers = [asyncio.create_task(load.run(i)) for i in range(args.producers)]
        try:
            await asyncio.sleep(1.0)  # the producers find the leaders before the first event
            result.events = await storm(site, args, rng, time.monotonic() + args.seconds)
        finally:
            load.stop.set()
            await asyncio.gather(*writers, return_exceptions=True)
        for n, node in site.nodes.items():  # every node runs again: whatever it holds counts
            if not node.alive():
                await site.restart(n)
        progress(f"seed {seed}: {result.events} {'pauses' if args.pause else 'kills'}; flushing the producers")
        await load.finish()
        progress(f"seed {seed}: reading {TOPIC} back")
        seen = await read_back(site, args.partitions)
        result.sent, result.acked = load.sent, len(load.acked)
        result.failed, result.failure_examples = dict(load.failed), load.examples
        result.read = sum(seen.values())
        result.lost = sum(1 for v in load.acked if v not in seen)
        result.duplicated = sum(n - 1 for n in seen.values() if n > 1)
    except (BenchError, OSError, grpc.aio.AioRpcError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        await asyncio.to_thread(site.close)
        result.seconds = time.monotonic() - started
    return result


def describe(r: SeedResult) -> str:
    failed = ", ".join(f"{k} {v}" for k, v in sorted(r.failed.items())) or "none"
    line = (
        f"seed {r.seed}: {r.events} {'pauses' if r.mode == 'pause' else 'kills'}, {r.sent} sent, {r.acked} acked, "
        f"failed to the application: {failed}; lost {r.lost}, duplicated {r.duplicated}"
    )
    return line + (f"; ERROR {r.error}" if r.error else "")


async def main_async(args: argparse.Namespace) -> int:
    root = Path(tempfile.mkdtemp(prefix="georep-storm-"))
    results: list[SeedResult] = []
    try:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            r = await run_seed(seed, args, root)
            results.append(r)
            print(describe(r), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    failed: Counter[str] = Counter()
    for r in results:
        failed.update(r.failed)
    total = (
        f"total over {len(results)} seeds ({'SIGSTOP 1-3 s' if args.pause else 'SIGKILL'}, "
        f"{args.seconds:g}s each, session {args.session_timeout_ms} ms): "
        f"{sum(r.events for r in results)} events, {sum(r.sent for r in results)} sent, "
        f"{sum(r.acked for r in results)} acked, failed to the application: "
        f"{', '.join(f'{k} {v}' for k, v in sorted(failed.items())) or 'none'}; "
        f"lost {sum(r.lost for r in results)}, duplicated {sum(r.duplicated for r in results)}"
    )
    print(total)
    for r in results:
        for name, text in sorted(r.failure_examples.items()):
            print(f"  seed {r.seed} {name}: {text}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                    "seeds": [asdict(r) for r in results],
                    "total": total,
                },
                indent=2,
            )
            + "\n"
        )
    return 0 if all(r.clean for r in results) else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=DEFAULT_SEEDS, help="runs, each on a fresh site (default 5)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--seconds", type=float, default=DEFAULT_SECONDS, help="of kills or pauses per seed (default 40)")
    p.add_argument("--pause", action="store_true", help="SIGSTOP the leader for 1-3 s, then SIGCONT, instead of kills")
    p.add_argument("--producers", type=int, default=DEFAULT_PRODUCERS)
    p.add_argument("--partitions", type=int, default=DEFAULT_PARTITIONS)
    p.add_argument("--rate", type=float, default=DEFAULT_RATE, help="records a second, per producer (default 200)")
    p.add_argument("--session-timeout-ms", type=int, default=DEFAULT_SESSION_TIMEOUT_MS)
    p.add_argument(
        "--segment-bytes",
        type=int,
        default=DEFAULT_SEGMENT_BYTES,
        help="a leader rolls its segment past this size (default 64 KiB: rolls all along)",
    )
    p.add_argument("--json", type=Path, help="write the figures to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    loop = asyncio.new_event_loop()
    task = loop.create_task(main_async(args))
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        return loop.run_until_complete(task)
    except asyncio.CancelledError:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        loop.close()


if __name__ == "__main__":
    sys.exit(main())
