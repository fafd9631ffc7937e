"""Topics created on first use (issue 25): what one topic costs, and a pattern consumer against a one-topic one.

Two sites a -> b (a's topology table: ``auto_create = ["bench/**"]``), from the repository root::

    .venv/bin/python bench/first_use.py                     # 2,000 topics, 100,000 records
    .venv/bin/python bench/first_use.py --topics 100000 --records 1000000   # the issue's size

It prints, with the reference beside each figure:

* ``first use``: the producer writes ``--records`` records spread round-robin over ``--topics`` new topics of one
  partition (each created by its first record's metadata request), against the same records into
  ``--topics`` topics created beforehand with one ``CreateTopics`` call per 1,000 topics;
* the node's RSS and data dir per topic (from /proc and the disk, after the produce), and the time until site b
  holds every topic and record;
* ``pattern consumer``: records per second read by ``subscribe(pattern="bench/first/**")`` from the earliest
  offset, against one topic holding as many records (``assign``).

Target (issue 25): 100,000 topics in at most 2 GB of RSS per node.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, from a checkout

from georep.client.admin import Admin, NewTopic
from georep.client.consumer import Consumer
from georep.client.producer import Producer
from tests.support.sites import Sites, wait_until

VALUE = b"x" * 100


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def disk_mb(root: Path) -> float:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) / 1e6


async def produce(address: str, names: list[str], records: int) -> float:
    t0 = time.perf_counter()
    async with Producer(address, linger_ms=5) as producer:
        futures = []
        for i in range(records):
            futures.append(producer.send(names[i % len(names)], VALUE))
            if len(futures) >= 20_000:
                await asyncio.gather(*futures)
                futures.clear()
        await asyncio.gather(*futures)
    return time.perf_counter() - t0


async def create_first(address: str, names: list[str]) -> float:
    t0 = time.perf_counter()
    async with Admin(address) as admin:
        for i in range(0, len(names), 1000):
            await admin.create_topics([NewTopic(n, 1) for n in names[i : i + 1000]])
    return time.perf_counter() - t0


async def read_all(consumer: Consumer, records: int) -> float:
    t0 = time.perf_counter()
    got = 0
    while got < records:
        got += len(await consumer.poll(timeout_ms=1000, max_records=5000))
        if time.perf_counter() - t0 > 600:
            raise SystemExit(f"read {got} of {records} records in 600 s")
    return time.perf_counter() - t0


async def consumers(address: str, records: int) -> tuple[float, float]:
    async with Consumer(address, auto_offset_reset="earliest", metadata_max_age_ms=1000) as pattern:
        pattern.subscribe(pattern="bench/first/**")
        pattern_s = await read_all(pattern, records)
    async with Consumer(address) as one:
        one.assign([("bench/one", 0)])
        one.seek_to_beginning()
        one_s = await read_all(one, records)
    return pattern_s, one_s


def held_records(sites: Sites, site: str, prefix: str) -> int:
    from georep.proto import georep_pb2 as pb

    total, token = 0, ""
    while True:
        resp = sites.stub(site).ListTopics(
            pb.ListTopicsRequest(view=pb.TOPIC_VIEW_SUMMARY, page_size=1000, page_token=token), timeout=60
        )
        total += sum(t.records for t in resp.topics if t.name.startswith(prefix))
        token = resp.next_page_token
        if not token:
            return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topics", type=int, default=2000)
    parser.add_argument("--records", type=int, default=100_000)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="georep-bench-first-use-"))
    sites = Sites(root, ["a", "b"], [("a", "b")], site_lines={"a": ['auto_create = ["bench/**"]']})
    sites.start()
    try:
        a = sites.address("a")
        pid = sites.nodes["a"].proc.pid
        rss0, disk0 = rss_mb(pid), disk_mb(root / "a")
        first = [f"bench/first/t{i}" for i in range(args.topics)]
        first_s = asyncio.run(produce(a, first, args.records))
        rss1, disk1 = rss_mb(pid), disk_mb(root / "a")
        t0 = time.perf_counter()
        wait_until("b holds every record", lambda: held_records(sites, "b", "bench/first/") == args.records, 3600, 2)
        reach_s = time.perf_counter() - t0
        made = [f"bench/made/t{i}" for i in range(args.topics)]
        create_s = asyncio.run(create_first(a, made))
        made_s = asyncio.run(produce(a, made, args.records))
        asyncio.run(produce(a, ["bench/one"], args.records))
        pattern_s, one_s = asyncio.run(consumers(a, args.records))
        n, r = args.topics, args.records
        print(f"georep first-use bench: {n:,} topics of 1 partition, {r:,} records of {len(VALUE)} bytes, 2 cores")
        print(f"  first use:      {first_s:7.1f} s, {r / first_s:9,.0f} records/s, {first_s / n * 1000:.2f} ms/topic")
        print(
            f"  created before: {create_s:7.1f} s to create + {made_s:.1f} s to produce ({r / made_s:,.0f} records/s); "
            f"first use / (create + produce) = {first_s / (create_s + made_s):.2f}"
        )
        print(
            f"  node a: RSS {rss0:.0f} -> {rss1:.0f} MB = {(rss1 - rss0) * 1024 / n:.1f} KB/topic "
            f"(100,000 topics: {rss0 + (rss1 - rss0) * 100_000 / n:,.0f} MB) [target <= 2,048 MB]; "
            f"disk {(disk1 - disk0) * 1000 / n:.1f} KB/topic"
        )
        print(f"  site b holds every topic and record {reach_s:.1f} s after the produce")
        print(
            f"  pattern consumer: {r / pattern_s:,.0f} records/s over {n:,} topics; one topic: {r / one_s:,.0f} "
            f"records/s; ratio {one_s / pattern_s:.2f}"
        )
        print(f"  load average {os.getloadavg()[0]:.1f}")
    finally:
        sites.close()


if __name__ == "__main__":
    main()
