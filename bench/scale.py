"""georep at many partitions: what a 3-site cycle costs idle and busy at 100, 1,000 and 10,000 partitions.

Run from the repository root::

    .venv/bin/python bench/scale.py                       # 100, 1,000, 10,000 partitions; about 20 minutes
    .venv/bin/python bench/scale.py --quick               # 100 and 400 partitions, small produce: a smoke run

Each size runs twice: as one topic, and as ``--topics`` topics of equal width (a
100-partition size as 100 one-partition topics). Each run starts its own
3-site cycle ``a -> b -> c -> a`` plus the reverse links, one node per site,
with mutual TLS as ``georep up`` runs it, under a temporary directory, and kills
it at the end. What is measured, per run (bench/README.md shows a table):

* ``create``: the topic(s) created at site a, until every site lists them all.
* ``idle``: each node's CPU over ``--idle-s`` seconds with no traffic (from
  /proc/PID/stat), as a share of one core; the worst node is printed.
* ``rss`` and ``fds``: the largest node's resident memory and open files, idle.
* ``scrape``: one GET of site a's /metrics, the best of three.
* ``produce``: ``--records`` records of 100 bytes sent keyless with
  ``georep.client.Producer`` (acks=leader) to site a: the sticky partitioner
  spreads the batches over every partition, as Kafka's default partitioner
  does. The rate, its ratio to the first size's rate, and how many partitions
  got records. With ``--keyed`` every record has its own key, so every
  partition gets records, and the batches shrink as the partitions grow: at
  10,000 partitions a 5 ms linger holds about one record per batch, so that
  measures the per-batch cost (as it would for Kafka), not what idle
  partitions cost.
* ``converge``: from the produce's end until every site's vectors hold every
  record (SiteStatus).
* ``restart``: node b gets ``kill -9`` and is started again; the time until it
  answers Health and serves a fetch.

Targets from issue 22 are printed beside each figure with PASS or MISS.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
from replication import free_ports

from georep.cli.up import ensure_certs, site_processes
from georep.client.admin import Admin
from georep.client.producer import Producer
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.security.tls import TlsConfig, client_channel
from georep.server.process import NODE_INFO, NodeProcess
from topology.model import Topology, parse_topology

SITES = ("a", "b", "c")
LINKS = (("a", "b"), ("b", "c"), ("c", "a"), ("b", "a"), ("c", "b"), ("a", "c"))
VALUE = b"x" * 100
TARGETS = {  # issue 22, at 10,000 partitions
    "idle_cpu": 0.02,
    "rss_mb": 1024,
    "fds": 2000,
    "produce_ratio": 0.70,
    "converge_ratio": 2.0,
    "restart_s": 10.0,
}


class BenchError(Exception):
    pass


@dataclass
class Run:
    partitions: int
    topics: int
    create_s: float | None = None
    idle_cpu: float | None = None
    rss_mb: float | None = None
    fds: int | None = None
    scrape_s: float | None = None
    produce_rps: float | None = None
    produce_s: float | None = None
    partitions_written: int | None = None
    converge_s: float | None = None
    restart_s: float | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.partitions} x1" if self.topics == 1 else f"{self.partitions} as {self.topics} topics"


def topology_text(ports: Sequence[int]) -> str:
    lines = []
    for site, port in zip(SITES, ports, strict=True):
        lines += [f"[sites.{site}]", f'nodes = ["127.0.0.1:{port}"]', ""]
    for src, dst in LINKS:
        lines += ["[[links]]", f'src = "{src}"', f'dst = "{dst}"', ""]
    return "\n".join(lines)


class Topo:
    """Three single-node sites with mutual TLS, as ``georep up`` starts them."""

    def __init__(self, root: Path) -> None:
        text = topology_text(free_ports(len(SITES)))
        self.topology: Topology = parse_topology(text)
        self.file = root / "topology.toml"
        self.file.write_text(text)
        certs = ensure_certs(self.topology, root)
        self.tls = TlsConfig.from_dir(certs)
        self.procs = {p.site: p for p in site_processes(self.topology, self.file, root, [], certs)}

    def start(self) -> None:
        for p in self.procs.values():
            p.launch()
        for p in self.procs.values():
            p.wait_ready(120)

    def stop(self) -> None:
        for p in self.procs.values():
            with contextlib.suppress(Exception):
                p.kill9()

    def address(self, site: str) -> str:
        return self.procs[site].address

    def stub(self, site: str) -> tuple[grpc.aio.Channel, pbg.NodeStub]:
        channel = client_channel(self.address(site), self.tls)
        return channel, pbg.NodeStub(channel)

    def metrics_address(self, site: str) -> str:
        return str(json.loads((self.procs[site].data_dir / NODE_INFO).read_text())["metrics"])


# -- measurements ---------------------------------------------------------------------------------------------


async def until(what: str, check: Callable[[], object], timeout_s: float, every_s: float = 0.2) -> float:
    """Seconds until ``check()`` (a coroutine function) is true; BenchError after ``timeout_s``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if await check():  # type: ignore[misc]
            return time.monotonic() - start
        await asyncio.sleep(every_s)
    raise BenchError(f"{what}: not within {timeout_s:g} s")


def topic_names(run: Run) -> list[str]:
    return ["wide"] if run.topics == 1 else [f"t{i:05d}" for i in range(run.topics)]


async def create(topo: Topo, run: Run) -> None:
    names, width = topic_names(run), run.partitions // run.topics
    start = time.monotonic()
    async with Admin(topo.address("a"), tls=topo.tls) as admin:
        many = getattr(admin, "create_topics", None)
        if many is not None and len(names) > 1:
            await many([(name, width) for name in names])
        else:
            for name in names:
                await admin.create_topic(name, width)

    async def everywhere() -> bool:
        for site in SITES:
            status = await site_status(topo, site)
            if status is None or len({(p.topic, p.partition) for p in status.partitions if p.topic in names}) < (
                run.partitions
            ):
                return False
        return True

    await until("every site has every partition", everywhere, 600, every_s=0.5)
    run.create_s = time.monotonic() - start


async def site_status(topo: Topo, site: str) -> pb.SiteStatusResponse | None:
    channel, stub = topo.stub(site)
    try:
        return await stub.SiteStatus(pb.SiteStatusRequest(), timeout=30)
    except grpc.aio.AioRpcError:
        return None
    finally:
        await channel.close()


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def idle(topo: Topo, run: Run, window_s: float) -> None:
    await asyncio.sleep(min(5.0, window_s))  # the links settle after the create
    pids = [p.pid for p in topo.procs.values()]
    before, start = [cpu_s(pid) for pid in pids], time.monotonic()
    await asyncio.sleep(window_s)
    elapsed = time.monotonic() - start
    run.idle_cpu = max((cpu_s(pid) - b) / elapsed for pid, b in zip(pids, before, strict=True))
    run.rss_mb = max(rss_mb(pid) for pid in pids)
    run.fds = max(len(os.listdir(f"/proc/{pid}/fd")) for pid in pids)


def scrape(topo: Topo, run: Run) -> None:
    url, best = f"http://{topo.metrics_address('a')}/metrics", float("inf")
    for _ in range(3):
        start = time.monotonic()
        urllib.request.urlopen(url, timeout=60).read()
        best = min(best, time.monotonic() - start)
    run.scrape_s = best


async def produce(topo: Topo, run: Run, records: int, keyed: bool) -> None:
    names = topic_names(run)
    start = time.monotonic()
    async with Producer(topo.address("a"), tls=topo.tls, linger_ms=5) as producer:
        for i in range(records):
            producer.send(names[i % len(names)], VALUE, key=b"%d" % i if keyed else None)
            if i % 5_000 == 0:
                await producer.wait_for_buffer()
        await producer.flush()
    run.produce_s = time.monotonic() - start
    run.produce_rps = records / run.produce_s


def held(status: pb.SiteStatusResponse, names: set[str]) -> tuple[int, int]:
    """(records held of the bench's topics, partitions holding some)."""
    totals = [sum(e.next_seq for e in p.vector.entries) for p in status.partitions if p.topic in names]
    return sum(totals), sum(1 for t in totals if t)


async def converge(topo: Topo, run: Run, records: int) -> None:
    names = set(topic_names(run))

    async def everywhere() -> bool:
        for site in SITES:
            status = await site_status(topo, site)
            if status is None or held(status, names)[0] < records:
                return False
        return True

    run.converge_s = await until("every site holds every record", everywhere, 900, every_s=0.2)
    status = await site_status(topo, "a")
    run.partitions_written = held(status, names)[1] if status is not None else None


async def restart(topo: Topo, run: Run) -> None:
    node: NodeProcess = topo.procs["b"]
    topic = topic_names(run)[0]
    node.kill9()
    start = time.monotonic()
    node.launch()
    node.wait_ready(300)

    async def serving() -> bool:
        channel, stub = topo.stub("b")
        try:
            await stub.Health(pb.HealthRequest(), timeout=5)
            async for _ in stub.Fetch(pb.FetchRequest(topic=topic, partition=0, offset=0, max_wait_ms=0), timeout=5):
                return True
            return True
        except grpc.aio.AioRpcError:
            return False
        finally:
            await channel.close()

    await until("node b serves after kill -9", serving, 300, every_s=0.05)
    run.restart_s = time.monotonic() - start


async def measure(run: Run, args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="georep-scale-") as tmp:
        topo = Topo(Path(tmp))
        try:
            topo.start()
            steps: list[tuple[str, Callable[[], object]]] = [
                ("create", lambda: create(topo, run)),
                ("idle", lambda: idle(topo, run, args.idle_s)),
                ("scrape", lambda: asyncio.to_thread(scrape, topo, run)),
                ("produce", lambda: produce(topo, run, args.records, args.keyed)),
                ("converge", lambda: converge(topo, run, args.records)),
                ("restart", lambda: restart(topo, run)),
            ]
            for name, step in steps:
                print(f"  {run.label}: {name}...", file=sys.stderr, flush=True)
                try:
                    await step()  # type: ignore[misc]
                except Exception as exc:  # a failed step is reported; the run goes on with what it can measure
                    run.errors.append(f"{name}: {type(exc).__name__}: {exc}")
                    if name in ("create", "produce"):
                        break
        finally:
            topo.stop()


# -- report -----------------------------------------------------------------------------------------------


def verdict(value: float | None, target: float, higher_is_better: bool = False) -> str:
    if value is None:
        return "  -- "
    ok = value >= target if higher_is_better else value <= target
    return "PASS" if ok else "MISS"


def rows(runs: list[Run]) -> Iterator[str]:
    base = runs[0].produce_rps if runs and runs[0].produce_rps else None
    yield (
        f"{'partitions':<22}{'create s':>9}{'idle cpu':>15}{'rss MB':>13}{'fds':>12}{'scrape s':>9}"
        f"{'produce rec/s':>15}{'ratio':>12}{'written':>9}{'converge s':>17}{'restart s':>15}"
    )
    for r in runs:
        ratio = r.produce_rps / base if base and r.produce_rps else None
        conv = r.converge_s / r.produce_s if r.converge_s is not None and r.produce_s else None
        yield (
            f"{r.label:<22}{fmt(r.create_s, 9, 1)}{fmt(r.idle_cpu and r.idle_cpu * 100, 9, 1)}% "
            f"{verdict(r.idle_cpu, TARGETS['idle_cpu'])}{fmt(r.rss_mb, 8, 0)} {verdict(r.rss_mb, TARGETS['rss_mb'])}"
            f"{fmt(r.fds, 7, 0)} {verdict(r.fds, TARGETS['fds'])}{fmt(r.scrape_s, 9, 2)}{fmt(r.produce_rps, 15, 0)}"
            f"{fmt(ratio, 7, 2)} {verdict(ratio, TARGETS['produce_ratio'], True)}{fmt(r.partitions_written, 9, 0)}"
            f"{fmt(r.converge_s, 7, 1)} ({fmt(conv, 3, 1)}x) {verdict(conv, TARGETS['converge_ratio'])}"
            f"{fmt(r.restart_s, 10, 1)} {verdict(r.restart_s, TARGETS['restart_s'])}"
        )
        for error in r.errors:
            yield f"    {r.label}: {error}"


def fmt(value: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width},.{digits}f}"


def plot(runs: list[Run], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("idle CPU per node (% of a core)", lambda r: r.idle_cpu and r.idle_cpu * 100, TARGETS["idle_cpu"] * 100),
        ("RSS per node (MB)", lambda r: r.rss_mb, TARGETS["rss_mb"]),
        ("open fds per node", lambda r: r.fds, TARGETS["fds"]),
        ("produce (records/s)", lambda r: r.produce_rps, None),
        ("converge after the produce (s)", lambda r: r.converge_s, None),
        ("restart after kill -9 (s)", lambda r: r.restart_s, TARGETS["restart_s"]),
        ("topic create, to every site (s)", lambda r: r.create_s, None),
        ("metrics scrape (s)", lambda r: r.scrape_s, 1.0),
    ]
    fig, axes = plt.subplots(2, 4, figsize=(18, 8))
    for ax, (title, get, target) in zip(axes.flat, panels, strict=True):
        for topics_one, marker in ((True, "o-"), (False, "s--")):
            chosen = [r for r in runs if (r.topics == 1) == topics_one and get(r) is not None]
            ax.plot(
                [r.partitions for r in chosen],
                [get(r) for r in chosen],
                marker,
                label="1 topic" if topics_one else "many topics",
            )
        if target is not None:
            ax.axhline(target, color="red", linewidth=0.8, linestyle=":", label="target")
        ax.set_xscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("partitions")
        ax.legend(fontsize=7)
    fig.suptitle("georep, 3-site cycle, one node per site (bench/scale.py)")
    fig.tight_layout()
    fig.savefig(out, dpi=90)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100,1000,10000", help="partition counts, comma-separated")
    parser.add_argument("--topics", type=int, default=1000, help="the many-topics layout: this many topics per size")
    parser.add_argument("--records", type=int, default=1_000_000, help="records produced per run")
    parser.add_argument("--idle-s", type=float, default=20.0, help="idle CPU window per run")
    parser.add_argument(
        "--keyed",
        action="store_true",
        help="produce keyed records (every partition gets some; batches shrink as partitions grow), not keyless",
    )
    parser.add_argument("--one-topic-only", action="store_true", help="skip the many-topics layout")
    parser.add_argument("--out", type=Path, default=Path("bench/scale.png"), help="the plot")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--quick", action="store_true", help="smoke run: 100 and 400 partitions, 20k records")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.records, args.idle_s, args.topics = "100,400", 20_000, 5.0, 50
    args.sizes = [int(s) for s in str(args.sizes).split(",")]
    return args


def runs_for(args: argparse.Namespace) -> list[Run]:
    out = []
    for size in args.sizes:
        out.append(Run(size, 1))
        if not args.one_topic_only:
            out.append(Run(size, min(args.topics, size)))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = runs_for(args)
    for run in runs:
        asyncio.run(measure(run, args))
        print("\n".join(rows([r for r in runs if r.idle_cpu is not None or r.errors])), flush=True)
    print()
    print("\n".join(rows(runs)))
    plot(runs, args.out)
    print(f"plot: {args.out}")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in runs], indent=1))
    return 0 if all(not r.errors for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
