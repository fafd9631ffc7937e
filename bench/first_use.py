"""Dynamic topics (issue 25) on a chain a -> b -> c of interest links: topics created on first use at a, a wildcard
subscription at c, and what crosses each link.

From the repository root::

    .venv/bin/python bench/first_use.py                                     # 2,000 topics, 100,000 records
    .venv/bin/python bench/first_use.py --topics 100000 --records 1000000   # the issue's size

Each topic is ``bench/g<i mod 100>/t<i>``, one partition, created by its first record's metadata request at a
(``auto_create = ["bench/**"]``). The bench prints:

* ``first use``: ``--records`` records of 100 bytes spread round-robin over ``--topics`` new topics, against the
  same records into as many topics created beforehand (``CreateTopics``, 1,000 per call) on a lone site;
* a's RSS and data dir per topic (after the produce), and the RSS 100,000 topics would take at that rate;
* ``subscribe``: a consumer group at c subscribes to ``bench/g7/**`` (1% of the topics); the time from the
  subscription to its first record, and to the last of that 1%; then ``--subscriptions`` - 1 more new groups, one
  after the other, over ``bench/g8/**`` and on, and the spread of their first records;
* the bytes each link moved (its ``applied_bytes``), against the bytes produced;
* on a lone site: a pattern consumer reading every record of the ``--topics`` topics, against a one-topic consumer
  reading as many.

Targets (issue 25): bytes moved to c <= 2% of those produced; a new subscription's first record within 2 s;
100,000 topics in at most 2 GB of RSS per node.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, from a checkout

from pyspy_top import print_top, recording

from georep.client.admin import Admin, NewTopic
from georep.client.consumer import Consumer
from georep.client.producer import Producer
from georep.proto import georep_pb2 as pb
from tests.support.sites import Sites

VALUE = b"x" * 100
GROUPS = 100  # topics bench/g0/... to bench/g99/...: a pattern on one group is 1% of them
CHAIN = {("a", "b"): ['mode = "interest"'], ("b", "c"): ['mode = "interest"']}


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


async def created_first(address: str, names: list[str], records: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    async with Admin(address) as admin:
        for i in range(0, len(names), 1000):
            await admin.create_topics([NewTopic(n, 1) for n in names[i : i + 1000]])
    return time.perf_counter() - t0, await produce(address, names, records)


async def read(consumer: Consumer, records: int, limit_s: float = 600) -> tuple[float, float]:
    """Seconds to the first record and to the last of ``records``."""
    t0 = time.perf_counter()
    first, got = 0.0, 0
    while got < records:
        batch = await consumer.poll(timeout_ms=200, max_records=5000)
        if batch and not got:
            first = time.perf_counter() - t0
        got += len(batch)
        if time.perf_counter() - t0 > limit_s:
            raise SystemExit(f"read {got} of {records} records in {limit_s:.0f} s")
    return first, time.perf_counter() - t0


async def subscribe_at_c(address: str, group: int, records: int) -> tuple[float, float]:
    """A new consumer group at c over ``bench/g<group>/**``: seconds to its first record and to its last."""
    async with Consumer(address, group_id=f"bench{group}", auto_offset_reset="earliest", metadata_max_age_ms=500) as c:
        c.subscribe(pattern=f"bench/g{group}/**")
        return await read(c, records)


async def one_topic(address: str, records: int) -> float:
    async with Consumer(address) as c:
        c.assign([("bench/one", 0)])
        c.seek_to_beginning()
        return (await read(c, records))[1]


def applied(sites: Sites, site: str) -> int:
    status = sites.stub(site).SiteStatus(pb.SiteStatusRequest(), timeout=120)  # the links; no partition rows
    return sum(link.applied_bytes for link in status.links)


def batch_bytes(data_dir: Path) -> int:
    """The bytes of the batches a site's producers wrote to its bench topics: its segment files (.log)."""
    return sum(p.stat().st_size for p in (data_dir / "logs").glob("bench*/*.log"))


def settle(sites: Sites, site: str, topics: int, limit_s: float = 1800) -> float:
    """Seconds until ``site`` lists every bench topic (the topic sync caught up with the creates)."""
    t0 = time.perf_counter()
    while True:
        listed, token = 0, ""
        while True:
            page = sites.stub(site).ListTopics(
                pb.ListTopicsRequest(page_size=1000, page_token=token, pattern="bench/**"), timeout=120
            )
            listed += len(page.topics)
            token = page.next_page_token
            if not token:
                break
        if listed >= topics:
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > limit_s:
            raise SystemExit(f"{site} lists {listed} of {topics} topics after {limit_s:.0f} s")
        time.sleep(1.0)


def chain_run(root: Path, topics: int, records: int, spy: Path | None, subscriptions: int) -> dict[str, float]:
    lines = {
        "a": ['auto_create = ["bench/**"]'],
        "b": ["interest_linger_ms = 5000"],
        "c": ["interest_linger_ms = 5000"],
    }
    sites = Sites(root, ["a", "b", "c"], [("a", "b"), ("b", "c")], site_lines=lines, link_lines=CHAIN)
    sites.start()
    try:
        pid = sites.nodes["a"].proc.pid  # type: ignore[union-attr]
        rss0, disk0 = rss_mb(pid), disk_mb(root / "a")
        names = [f"bench/g{i % GROUPS}/t{i}" for i in range(topics)]
        spied = {} if spy is None else {spy / f"first-use-{s}.txt": sites.nodes[s].pid for s in "abc"}
        with recording(spied):  # nothing recorded without --py-spy
            first_s = asyncio.run(produce(sites.address("a"), names, records))
        produced_at = time.perf_counter()
        out = {"first_s": first_s, "rss0": rss0, "rss1": rss_mb(pid), "disk_kb": (disk_mb(root / "a") - disk0) * 1e3}
        out["batch_bytes"] = batch_bytes(root / "a")
        out["settle_s"] = settle(sites, "c", topics)
        wanted = sum(1 for i in range(records) if (i % topics) % GROUPS == 7)
        spied = {} if spy is None else {spy / f"subscribe-{s}.txt": sites.nodes[s].pid for s in "abc"}
        with recording(spied):
            out["sub_at_s"] = time.perf_counter() - produced_at
            out["sub_first_s"], out["sub_all_s"] = asyncio.run(subscribe_at_c(sites.address("c"), 7, wanted))
        out["wanted"] = wanted
        out["to_b"], out["to_c"] = applied(sites, "b"), applied(sites, "c")
        for k in range(1, subscriptions):  # more new subscriptions, one after the other: the first record's spread
            group = 7 + k
            wanted_k = sum(1 for i in range(records) if (i % topics) % GROUPS == group)
            out[f"sub_at_s{k}"] = time.perf_counter() - produced_at
            out[f"sub_first_s{k}"] = asyncio.run(subscribe_at_c(sites.address("c"), group, wanted_k))[0]
        return out
    finally:
        sites.close()


async def pattern_reads(address: str, records: int) -> float:
    async with Consumer(address, auto_offset_reset="earliest") as c:
        c.subscribe(pattern="bench/made/**")
        return (await read(c, records))[1]


def lone_run(root: Path, topics: int, records: int) -> dict[str, float]:
    """One site: topics created first, then the same records; a pattern consumer of them all against a one-topic
    consumer of as many records."""
    sites = Sites(root, ["a"], [], site_lines={"a": ['auto_create = ["bench/**"]']})
    sites.start()
    try:
        a = sites.address("a")
        names = [f"bench/made/t{i}" for i in range(topics)]
        create_s, made_s = asyncio.run(created_first(a, names, records))
        pattern_s = asyncio.run(pattern_reads(a, records))
        asyncio.run(produce(a, ["bench/one"], records))
        return {
            "create_s": create_s,
            "made_s": made_s,
            "pattern_s": pattern_s,
            "one_s": asyncio.run(one_topic(a, records)),
        }
    finally:
        sites.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topics", type=int, default=2000)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument(
        "--py-spy", type=Path, metavar="DIR", help="record a, b and c with py-spy during first use and the subscription"
    )
    parser.add_argument(
        "--subscriptions", type=int, default=5, help="new subscriptions at c, one after the other (1%% of topics each)"
    )
    parser.add_argument(
        "--parts",
        default="chain,lone",
        help="chain (first use, subscription at c, bytes moved), lone (created first, pattern consumer), or both",
    )
    parser.add_argument("--keep", action="store_true", help="keep the sites' data dirs and node logs (printed)")
    args = parser.parse_args()
    if args.py_spy is not None:
        args.py_spy.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="georep-bench-first-use-"))
    try:
        run_parts(args, root)
    finally:  # 4 GB at the issue's size: removed unless --keep asks for the nodes' logs
        if args.keep:
            print(f"  kept {root} (the nodes' data dirs and logs)")
        else:
            shutil.rmtree(root, ignore_errors=True)


def run_parts(args: argparse.Namespace, root: Path) -> None:
    n, r = args.topics, args.records
    print(f"georep dynamic-topics bench: {n:,} topics of 1 partition, {r:,} records of {len(VALUE)} bytes, 2 cores")
    if "chain" in args.parts:
        (root / "chain").mkdir()
        chain = chain_run(root / "chain", n, r, args.py_spy, args.subscriptions)
        print_chain(chain, n, r)
        if args.py_spy is not None:
            for part, site in [(part, site) for part in ("first-use", "subscribe") for site in "abc"]:
                print_top(args.py_spy / f"{part}-{site}.txt", f"node {site}, {part}")
    if "lone" in args.parts:
        (root / "lone").mkdir()
        lone = lone_run(root / "lone", n, r)
        made_s = lone["create_s"] + lone["made_s"]
        ratio = f"; first use / created first {chain['first_s'] / made_s:.2f}" if "chain" in args.parts else ""
        print(f"  created first: {lone['create_s']:.1f} s + {lone['made_s']:.1f} s to produce{ratio}")
        print(
            f"  pattern consumer (bench/made/**, {n:,} topics): {r / lone['pattern_s']:,.0f} records/s; one topic: "
            f"{r / lone['one_s']:,.0f} records/s; ratio {lone['one_s'] / lone['pattern_s']:.2f}"
        )
    print(f"  load average {os.getloadavg()[0]:.1f}")


def print_chain(chain: dict[str, float], n: int, r: int) -> None:
    produced = r * len(VALUE)
    per_topic_kb = (chain["rss1"] - chain["rss0"]) * 1024 / n
    print(f"  first use at a: {chain['first_s']:.1f} s ({r / chain['first_s']:,.0f} records/s)")
    print(
        f"  a: RSS {chain['rss0']:.0f} -> {chain['rss1']:.0f} MB, {per_topic_kb:.1f} KB/topic (100,000 topics: "
        f"{chain['rss0'] + per_topic_kb * 100_000 / 1024:,.0f} MB) [target <= 2,048 MB]; disk "
        f"{chain['disk_kb'] / n:.1f} KB/topic"
    )
    print(f"  c lists every topic {chain['settle_s']:.1f} s after the produce (the topic sync of the creates)")
    print(
        f"  subscribe at c to bench/g7/** ({chain['wanted']:,} records): first record after "
        f"{chain['sub_first_s']:.2f} s [target <= 2 s], all after {chain['sub_all_s']:.1f} s"
    )
    runs = [(chain[k.replace("first", "at")], v) for k, v in chain.items() if k.startswith("sub_first_s")]
    firsts = sorted(v for _at, v in runs)
    if len(firsts) > 1:
        print(
            f"  {len(firsts)} new subscriptions at c, one after the other (bench/g7/** on): first record after "
            f"{', '.join(f'{f:.2f}' for f in firsts)} s; median {firsts[len(firsts) // 2]:.2f} s, "
            f"most {firsts[-1]:.2f} s [target <= 2 s]"
        )
        in_order = ", ".join(f"{first:.2f} s ({at:.1f} s after the produce)" for at, first in runs)
        print(f"    in order: {in_order}")
    batches = chain["batch_bytes"]
    print(
        f"  bytes moved a -> b {chain['to_b']:,}, b -> c {chain['to_c']:,}: {100 * chain['to_c'] / batches:.2f}% of "
        f"the {batches:,.0f} bytes of batches produced [target <= 2%] ({100 * chain['to_c'] / produced:.2f}% of "
        f"the {produced:,} bytes of values)"
    )


if __name__ == "__main__":
    main()
