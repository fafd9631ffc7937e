"""Follower reads on a three-node site: how soon a follower serves an acknowledged record, and read throughput.

Run from the repository root::

    .venv/bin/python bench/follower_reads.py            # about 40 s
    .venv/bin/python bench/follower_reads.py --quick    # smoke run, about 15 s

One site ``a`` of three ``georep node --node-id N`` processes (replication
factor 3, min-insync 2, the scrubber off; bench/site_cluster.py's ``Site``),
one topic of one partition. What is measured:

* ``visibility``: ``--probes`` times, a ``Fetch`` stream is open at the
  partition's leader and one at a follower (``READ_FROM_REPLICA``), both
  waiting at the log's end; one record is produced at ``acks=all`` and the
  figure is the time from its ack to its arrival on each stream. The leader
  serves up to the LAC, which the ack waited for; the follower serves up to
  the LAC its leader announced to it (docs/cluster.md, "Follower reads"):
  the difference is what a follower read costs in freshness.
* ``throughput``: ``--mb`` MB of records written at ``acks=all``, then read
  from the beginning by a ``Consumer`` with ``read_from="leader"`` and one
  with ``read_from="follower"`` at a follower, alternating, best of
  ``--repeats``; MB/s of record values.

Every node is stopped and the temporary directory removed on exit, on an
error, on Ctrl-C and on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

# bench/ is on sys.path when this file runs as a script: reuse the site of bench/site_cluster.py.
from produce import progress
from site_cluster import MIN_INSYNC_REPLICAS, REPLICATION_FACTOR, Site

from georep.client import Producer
from georep.client.consumer import Consumer
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.security.tls import client_channel

TOPIC = "follow"
RECORD_BYTES = 1024
PROBE_TIMEOUT_S = 10.0


async def first_batch_at(address: str, offset: int, replica: bool) -> float:
    """When (time.monotonic()) a Fetch at ``address`` from ``offset`` first gets a batch."""
    request = pb.FetchRequest(
        topic=TOPIC,
        partition=0,
        offset=offset,
        max_wait_ms=5_000,
        read_from=pb.READ_FROM_REPLICA if replica else pb.READ_FROM_LEADER,
    )
    async with client_channel(address, None) as channel:
        async for response in pbg.NodeStub(channel).Fetch(request, timeout=PROBE_TIMEOUT_S):
            if response.batches:
                return time.monotonic()
    raise RuntimeError(f"the fetch at {address} ended without a batch")


async def visibility(site: Site, leader: int, follower: int, probes: int) -> tuple[list[float], list[float]]:
    """Per probe: ms from the ack to the record at the leader's stream, and at the follower's."""
    at_leader: list[float] = []
    at_follower: list[float] = []
    async with client_channel(site.addresses[leader], None) as channel:
        stub = pbg.NodeStub(channel)
        for i in range(probes):
            latest = pb.ListOffsetsRequest(topic=TOPIC, partition=0, position=pb.START_LATEST)
            end = (await stub.ListOffsets(latest)).offsets[0].offset
            streams = [
                asyncio.create_task(first_batch_at(site.addresses[n], end, n != leader)) for n in (leader, follower)
            ]
            await asyncio.sleep(0.05)  # both streams wait at the end
            async with Producer(site.addresses[leader], acks="all", linger_ms=0) as producer:
                await producer.send(TOPIC, b"p" * RECORD_BYTES, partition=0)
            acked = time.monotonic()
            leader_at, follower_at = await asyncio.gather(*streams)
            at_leader.append(max(0.0, leader_at - acked) * 1000)
            at_follower.append(max(0.0, follower_at - acked) * 1000)
            progress(f"probe {i + 1}/{probes}: leader {at_leader[-1]:.1f} ms, follower {at_follower[-1]:.1f} ms")
    return at_leader, at_follower


async def read_all(site: Site, read_from: str, prefer: int | None, records: int) -> float:
    """MB/s of record values a consumer reads from the beginning."""
    bootstrap = [site.addresses[n] for n in sorted(site.addresses)]
    kwargs = {"prefer": site.addresses[prefer]} if prefer is not None else {}
    got = 0
    started = time.monotonic()
    async with Consumer(bootstrap, read_from=read_from, auto_offset_reset="earliest", **kwargs) as consumer:
        consumer.assign([(TOPIC, 0)])
        consumer.seek_to_beginning()
        while got < records:
            got += len(await consumer.poll(timeout_ms=1000, max_records=10_000))
        served = consumer.follower_reads
    took = time.monotonic() - started
    if read_from == "follower" and served == 0:
        raise RuntimeError("the follower consumer was served by the leader only")
    return records * RECORD_BYTES / took / 1e6


async def run(site: Site, args: argparse.Namespace) -> None:
    async with client_channel(site.addresses[1], None) as channel:
        await pbg.NodeStub(channel).CreateTopic(pb.CreateTopicRequest(name=TOPIC, partitions=1), timeout=30)
    leader = (await site.wait_leaders(TOPIC, 1))[0]
    follower = next(n for n in sorted(site.addresses) if n != leader)
    at_leader, at_follower = await visibility(site, leader, follower, args.probes)
    records = int(args.mb * 1e6 / RECORD_BYTES)
    progress(f"writing {records} records of {RECORD_BYTES} B at acks=all")
    async with Producer(site.addresses[leader], acks="all", linger_ms=5) as producer:
        for start in range(0, records, 1000):
            await asyncio.gather(
                *(producer.send(TOPIC, b"r" * RECORD_BYTES, partition=0) for _ in range(min(1000, records - start)))
            )
    best = {"leader": 0.0, "follower": 0.0}
    for _ in range(args.repeats):
        for mode in ("leader", "follower"):
            mb_s = await read_all(site, mode, follower if mode == "follower" else None, records)
            best[mode] = max(best[mode], mb_s)
            progress(f"read from {mode}: {mb_s:.1f} MB/s")
    print()
    print(
        f"Site a: 3 nodes, replication factor {REPLICATION_FACTOR}, min-insync {MIN_INSYNC_REPLICAS}; "
        f"partition leader node {leader}, follower node {follower}"
    )
    print(f"visibility, ms from an acks=all ack to the record on a waiting Fetch stream ({args.probes} probes):")
    for name, values in (("leader", at_leader), ("follower", at_follower)):
        print(f"  {name:<8}  median {statistics.median(values):6.1f}  worst {max(values):6.1f}")
    print(f"throughput, MB/s of record values read from the beginning ({args.mb:g} MB, best of {args.repeats}):")
    for name, value in best.items():
        print(f"  {name:<8}  {value:6.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probes", type=int, default=20, help="visibility probes (default 20)")
    parser.add_argument("--mb", type=float, default=20.0, help="MB of records to read back (default 20)")
    parser.add_argument("--repeats", type=int, default=2, help="reads per mode, best kept (default 2)")
    parser.add_argument("--quick", action="store_true", help="5 probes, 2 MB, one read per mode")
    args = parser.parse_args(argv)
    if args.quick:
        args.probes, args.mb, args.repeats = 5, 2.0, 1
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with contextlib.ExitStack() as stack:
        root = Path(tempfile.mkdtemp(prefix="georep-bench-follower-reads-"))
        stack.callback(shutil.rmtree, root, ignore_errors=True)
        site = Site(
            root,
            [
                "--replication-factor",
                str(REPLICATION_FACTOR),
                "--min-insync-replicas",
                str(MIN_INSYNC_REPLICAS),
                "--session-timeout-ms",
                "1000",
                "--scrub-bytes-per-s",
                "0",
            ],
        )
        stack.callback(site.close)
        progress("starting nodes 1, 2, 3 of site a")
        site.start()
        asyncio.run(run(site, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
