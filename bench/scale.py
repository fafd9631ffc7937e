"""Scale: what a 3-site cycle costs at 100, 1,000 and 10,000 partitions, and a 3-node site's re-election (issue 22).

Run from the repository root::

    .venv/bin/python bench/scale.py                                  # full run: 100, 1,000, 10,000 partitions
    .venv/bin/python bench/scale.py --sizes 100,1000 --records 100000 --idle-s 10
    .venv/bin/python bench/scale.py --quick                          # smoke run: tiny sizes, a few seconds each

Each size starts three single-node sites ``a -> b -> c -> a`` (mutual TLS with a development CA, as
``georep up`` makes them) on free ports of 127.0.0.1 under one temporary directory, twice: once with the size's
partitions as one topic, once as ``--topics`` topics (the partitions split evenly; at 100 partitions, 100 topics
of 1). For each it measures, in this order (after the create, the order of ``--steps``, which may also name a
step twice: ``--steps idle,produce,idle`` measures idle CPU over empty partitions and again over written ones;
the row keeps the last):

* ``create``: the topic(s) created at site ``a`` until every site describes every partition of them;
* ``settle``: from then until the last pull stream a link opened, once none opened for 3 s (bounded: 120 s): each
  link's topic sync learning that its upstream holds the topics too reopens its stream once, by design
  (``tests.support.sites.settled``, which tests/test_scale_e2e.py waits for too); the idle window starts after.
  The progress line gives each node's CPU seconds from the create to the end of the settle;
* ``idle CPU``: process CPU seconds (``/proc/PID/stat`` utime+stime) of each node over ``--idle-s`` with no
  traffic, as a share of one core; ``RSS`` and open ``fds`` at the end of the window (the worst node). Each
  window's line gives every node's share, the load average and the streams opened during it (0 when settled);
  ``--py-spy DIR`` records every node over it (and over each produce until converged) and prints their top
  functions (bench/pyspy_top.py);
* ``scrape``: one HTTP GET of each node's ``/metrics`` (the slowest);
* ``produce``: ``--records`` records of ``--value-bytes`` written at site ``a`` with ``georep.client.Producer``
  (acks=leader), record ``i`` to partition ``i mod P`` of topic ``i mod T``, until every one is acknowledged;
  the rate against the 100-partition row of the same shape;
* ``converge``: from the last ack until every site's vectors (``DescribeTopic``) hold every record;
* ``keyless``: the same produce and convergence again, with records without key or partition (record ``i`` to
  topic ``i mod T``): the producer's sticky partitioner fills a batch per partition before moving on, as
  Kafka's default does. It spreads the records over the partitions batch by batch, not record by record, so
  the row also counts the partitions it wrote (``touched``): records of 100 bytes fill the producer's 64 KiB
  batches about 500 at a time, so 1M records reach about 2,000 of one topic's 10,000 partitions (100,000
  reached 198 in a run). Round-robin is the
  issue's "spread over all partitions"; keyless is how a Kafka application without keys writes
  (``--partitioners`` picks either or both);
* ``restart``: ``kill -9`` of site ``b``'s node, started again, until ``Health`` answers and a ``Fetch`` of
  a written partition returns data.

``--cluster-partitions`` then runs one site of three nodes (bench/site_cluster.py's ``Site``), creates one topic
of that many partitions, waits for the site to settle (bench/site_scale.py's ``settle``: every open segment on
three nodes, then every node under 15% of a core; at most 300 s, and the time it took is printed beside the
figure), kills the node leading the most partitions with ``kill -9``, and times until ``ClusterStatus`` shows a
live leader for every partition again.

Each figure is printed next to the issue's target with PASS or MISS. A step that fails (a node that does not
answer, a bounded wait that runs out) is reported on its row and the run goes on. Every node is killed and the
temporary directory removed at the end, on an error, on Ctrl-C and on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, from a checkout

from produce import BenchError, progress
from pyspy_top import print_top, recording

from georep.client import Producer
from georep.client.admin import CREATE_TOPICS_PER_CALL
from georep.proto import georep_pb2 as pb
from tests.support.sites import Sites, settled, streams_opened

SITES = ["a", "b", "c"]
CYCLE = [("a", "b"), ("b", "c"), ("c", "a")]
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
CREATE_TIMEOUT_S = 600.0
SETTLE_QUIET_S = 3.0  # the create has settled once no link opened a stream for this long (as tests/test_scale_e2e.py)
SETTLE_TIMEOUT_S = 120.0
LINKS_TIMEOUT_S = 120.0
CONVERGE_TIMEOUT_S = 600.0
RESTART_TIMEOUT_S = 120.0
REELECT_TIMEOUT_S = 120.0
CLUSTER_SETTLE_TIMEOUT_S = 300.0  # the 3-node site's wait for the create's aftermath before the kill
CLUSTER_TIMEOUT_S = 900.0
DELIVERY_TIMEOUT_MS = 300_000
RPC_TIMEOUT_S = 10.0
POLL_S = 0.1

# The issue's targets at 10,000 partitions.
IDLE_CPU_MAX = 0.02
RSS_MAX = 1 << 30
FDS_MAX = 2_000
PRODUCE_MIN_RATIO = 0.70
CONVERGE_MAX_RATIO = 2.0
RESTART_MAX_S = 10.0
REELECT_MAX_S = 5.0


@dataclass
class Row:
    partitions: int
    topics: int
    create_s: float = math.nan
    settle_s: float = math.nan  # from "every site describes every partition" until the last stream opened
    idle_cpu: float = math.nan  # the busiest node, share of one core
    rss_bytes: float = math.nan  # the largest node
    fds: float = math.nan  # the node with most
    scrape_s: float = math.nan  # the slowest node
    produce_s: float = math.nan
    rate: float = math.nan  # records/s
    vs_100: float = math.nan
    converge_s: float = math.nan
    keyless_produce_s: float = math.nan
    keyless_rate: float = math.nan
    keyless_vs_100: float = math.nan
    keyless_converge_s: float = math.nan
    keyless_touched: float = math.nan  # partitions the keyless produce wrote to
    restart_s: float = math.nan
    errors: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.partitions:,} p x {self.topics:,} t"


@dataclass
class Config:
    sizes: list[int]
    topics: int
    records: int
    value_bytes: int
    idle_s: float
    cluster_partitions: int
    partitioners: list[str]
    steps: list[str]
    out: Path
    json_out: Path | None
    py_spy: Path | None = None


def deadline_loop(timeout_s: float) -> Iterator[None]:
    """Yields until ``timeout_s`` has passed, sleeping ``POLL_S`` between turns."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        yield
        time.sleep(POLL_S)


def wait(what: str, cond: Callable[[], bool], timeout_s: float) -> None:
    for _ in deadline_loop(timeout_s):
        with contextlib.suppress(grpc.RpcError, OSError):
            if cond():
                return
    raise BenchError(f"timed out after {timeout_s:g}s waiting until {what}")


# -- /proc ---------------------------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14, 15 of proc(5))


def rss_bytes(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# -- one size ------------------------------------------------------------------------------------------------------


def topic_names(topics: int) -> list[str]:
    return ["big"] if topics == 1 else [f"t{i:05d}" for i in range(topics)]


def every_site_has(sites: Sites, names: list[str], per_topic: int) -> bool:
    for s in SITES:
        listed = {t.name: t.partitions for t in sites.stub(s).ListTopics(pb.ListTopicsRequest(), timeout=60).topics}
        if any(listed.get(n) != per_topic for n in names):
            return False
    return True


def links_up(sites: Sites) -> bool:
    return all(link.state == "streaming" for s in SITES for link in sites.status(s).links)


def held_total(sites: Sites, site: str, names: list[str]) -> int:
    """Records ``site`` holds in the topics ``names``. The summary view: polled every ``POLL_S`` at every site
    while a produce converges, DescribeTopic's vector of every partition was a fifth of the origin's CPU at 2,000
    partitions, the bench's own load on what it measures."""
    listed = sites.stub(site).ListTopics(pb.ListTopicsRequest(view=pb.TOPIC_VIEW_SUMMARY), timeout=30)
    wanted = set(names)
    return sum(t.records for t in listed.topics if t.name in wanted)


def written(sites: Sites, names: list[str]) -> dict[tuple[str, int], int]:
    """Records held at site a per (topic, partition)."""
    return {(n, p): sum(v.values()) for n in names for p, v in sites.vectors("a", n).items()}


async def produce(
    sites: Sites, names: list[str], per_topic: int, records: int, value: bytes, keyless: bool = False
) -> float:
    """Every record acknowledged; the seconds from the first send. ``keyless``: no partition given (sticky)."""
    async with Producer(
        sites.address("a"), acks="leader", linger_ms=5, tls=sites.tls, delivery_timeout_ms=DELIVERY_TIMEOUT_MS
    ) as producer:
        start = time.perf_counter()
        futures = []
        for i in range(records):
            partition = None if keyless else (i // len(names)) % per_topic
            futures.append(producer.send(names[i % len(names)], value, partition=partition))
            if producer.buffered_bytes > producer.buffer_memory:
                await producer.wait_for_buffer()  # back-pressure, as bench/produce.py: 1M records exceed the buffer
            elif i % 1000 == 999:
                await asyncio.sleep(0)
        await producer.flush()
        await asyncio.gather(*futures)
        return time.perf_counter() - start


def scrape_s(metrics_address: str) -> float:
    start = time.perf_counter()
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=30) as resp:
        resp.read()
    return time.perf_counter() - start


def restart_s(sites: Sites, topic: str) -> float:
    """kill -9 of site b's node, then until it answers Health and a Fetch of partition 0 returns data."""
    node = sites.nodes["b"]
    node.kill9()
    sites.channels.pop("b").close()
    start = time.perf_counter()
    node.launch().wait_ready(RESTART_TIMEOUT_S)

    def serves() -> bool:
        sites.stub("b").Health(pb.HealthRequest(), timeout=RPC_TIMEOUT_S)
        stream = sites.stub("b").Fetch(pb.FetchRequest(topic=topic, partition=0, offset=0, max_wait_ms=100))
        for resp in stream:
            stream.cancel()
            return bool(resp.batches)
        return False

    wait("site b's node answers Health and a Fetch after kill -9", serves, RESTART_TIMEOUT_S)
    return time.perf_counter() - start


def step(row: Row, what: str, fn: Callable[[], None]) -> bool:
    """Runs one measurement; a failure is written on the row and the size goes on with its next step."""
    try:
        fn()
    except (BenchError, AssertionError, grpc.RpcError, OSError, RuntimeError, ValueError) as exc:
        text = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)  # type: ignore[attr-defined]
        row.errors.append(f"{what}: {(text or type(exc).__name__).splitlines()[0][:200]}")
        progress(f"  {row.label}: {what} FAILED: {row.errors[-1]}")
        return False
    return True


@dataclass
class SizeRun:
    """One size's three sites and the row its steps fill in; each method is one step."""

    sites: Sites
    row: Row
    cfg: Config
    names: list[str]
    per_topic: int
    cpu_before: list[float] = field(default_factory=list)
    idles: Iterator[int] = field(default_factory=lambda: iter(range(1, 1 << 30)))

    def create(self) -> None:
        sites, names = self.sites, self.names
        self.cpu_before = [cpu_seconds(sites.nodes[s].pid) for s in SITES]
        start = time.perf_counter()
        for i in range(0, len(names), CREATE_TOPICS_PER_CALL):  # as `georep topic create t1 t2 ...` batches them
            request = pb.CreateTopicsRequest(
                topics=[
                    pb.CreateTopicRequest(name=n, partitions=self.per_topic)
                    for n in names[i : i + CREATE_TOPICS_PER_CALL]
                ]
            )
            for result in sites.stub("a").CreateTopics(request, timeout=300).results:
                if result.HasField("error"):
                    raise BenchError(f"create {result.name}: {result.error.message}")
        wait("every site has every topic", lambda: every_site_has(sites, names, self.per_topic), CREATE_TIMEOUT_S)
        self.row.create_s = time.perf_counter() - start

    def settle(self) -> None:
        # What legitimately follows: each link's topic sync learns that its upstream holds the topics too, which
        # reopens its stream; the idle window starts after that. Bounded, and reported: it must stay short.
        row, sites = self.row, self.sites
        _, row.settle_s = settled(sites, SETTLE_QUIET_S, SETTLE_TIMEOUT_S, poll_s=0.5)
        spent = [cpu_seconds(sites.nodes[s].pid) - b for s, b in zip(SITES, self.cpu_before, strict=True)]
        each = " / ".join(f"{s} {x:.1f} s" for s, x in zip(SITES, spent, strict=True))
        progress(f"  {row.label}: create {row.create_s:.1f} s, settle {row.settle_s:.1f} s; node CPU {each}")

    def idle(self) -> None:
        sites, row, cfg = self.sites, self.row, self.cfg
        pids = [sites.nodes[s].pid for s in SITES]
        window = f"{row.partitions}x{row.topics}-idle{next(self.idles)}"
        spied = {} if cfg.py_spy is None else {cfg.py_spy / f"{window}-{s}.txt": sites.nodes[s].pid for s in SITES}
        opened = sum(streams_opened(sites).values())
        with recording(spied):  # nothing recorded without --py-spy
            before = [cpu_seconds(p) for p in pids]
            start = time.monotonic()
            time.sleep(cfg.idle_s)
            took = time.monotonic() - start
            shares = [(cpu_seconds(p) - b) / took for p, b in zip(pids, before, strict=True)]
        row.idle_cpu = max(shares)
        row.rss_bytes = max(rss_bytes(p) for p in pids)
        row.fds = max(open_fds(p) for p in pids)
        reopened = sum(streams_opened(sites).values()) - opened
        each = " / ".join(f"{s} {100 * x:.1f}%" for s, x in zip(SITES, shares, strict=True))
        progress(f"  {row.label}: {window}: {each} (load {os.getloadavg()[0]:.1f}); {reopened} streams opened")
        for out, pid in spied.items():
            print_top(out, f"{out.stem} (pid {pid})")

    def scrape(self) -> None:
        self.row.scrape_s = max(scrape_s(self.sites.nodes[s].metrics_address) for s in SITES)

    def produce(self, keyless: bool) -> None:
        sites, names, row, cfg = self.sites, self.names, self.row, self.cfg
        before = {s: held_total(sites, s, names) for s in SITES}
        partitions_before = written(sites, names) if keyless else {}
        value = b"v" * cfg.value_bytes
        pids = [sites.nodes[s].pid for s in SITES]
        window = f"{row.partitions}x{row.topics}-{'keyless' if keyless else 'round-robin'}"
        spied = (
            {}
            if cfg.py_spy is None
            else {cfg.py_spy / f"{window}-{s}.txt": p for s, p in zip(SITES, pids, strict=True)}
        )
        with recording(spied):  # nothing recorded without --py-spy
            cpu_before = [cpu_seconds(p) for p in pids]
            took = asyncio.run(produce(sites, names, self.per_topic, cfg.records, value, keyless))
            start = time.perf_counter()
            wait(
                "every site holds every record",
                lambda: all(held_total(sites, s, names) >= before[s] + cfg.records for s in SITES),
                CONVERGE_TIMEOUT_S,
            )
            converge_s = time.perf_counter() - start
            spent = [cpu_seconds(p) - b for p, b in zip(pids, cpu_before, strict=True)]
        # Node CPU from the first send to convergence, per record: what the wall rate hides on a shared machine.
        each = " / ".join(f"{s} {1e6 * x / cfg.records:.1f}" for s, x in zip(SITES, spent, strict=True))
        progress(
            f"  {row.label}: {window}: {cfg.records / took:,.0f} rec/s, converged {converge_s:.1f} s after; node CPU"
            f" us/record {each}, all {1e6 * sum(spent) / cfg.records:.1f} (load {os.getloadavg()[0]:.1f})"
        )
        for out, pid in spied.items():
            print_top(out, f"{out.stem} (pid {pid})")
        if keyless:
            row.keyless_produce_s, row.keyless_rate, row.keyless_converge_s = took, cfg.records / took, converge_s
            after = written(sites, names)
            row.keyless_touched = sum(after[k] > partitions_before.get(k, 0) for k in after)
        else:
            row.produce_s, row.rate, row.converge_s = took, cfg.records / took, converge_s

    def restart(self) -> None:
        self.row.restart_s = restart_s(self.sites, self.names[0])


def run_size(root: Path, partitions: int, topics: int, cfg: Config) -> Row:
    row = Row(partitions, topics)
    names = topic_names(topics)
    sites = Sites(root, SITES, CYCLE, tls_dir=root / "tls")
    run = SizeRun(sites, row, cfg, names, max(1, partitions // topics))
    progress(f"{row.label}: starting sites a, b, c in {root.name}/")
    try:
        if not step(row, "start", lambda: sites.start()) or not step(row, "create", run.create):
            return row
        step(row, "settle", run.settle)
        step(row, "links", lambda: wait("every link streams", lambda: links_up(sites), LINKS_TIMEOUT_S))
        measures: dict[str, Callable[[], None]] = {"idle": run.idle, "scrape": run.scrape, "restart": run.restart}
        for what in cfg.steps:  # in the order given: `--steps produce,idle` measures idle over written partitions
            if what != "produce":
                step(row, what, measures[what])
                continue
            for partitioner in cfg.partitioners:
                step(row, f"produce ({partitioner})", lambda keyless=partitioner == "keyless": run.produce(keyless))
    finally:
        sites.close()
    return row


# -- the 3-node site -----------------------------------------------------------------------------------------------


async def reelection(root: Path, partitions: int) -> tuple[float, str]:
    """kill -9 of the node leading most partitions, until ClusterStatus shows a live leader for every one."""
    from site_cluster import Site
    from site_scale import settle

    site = Site(root, ["--replication-factor", "3", "--min-insync-replicas", "2", "--scrub-bytes-per-s", "0"])
    try:
        site.start()
        await site.create_topic("big", partitions)
        # the kill meets a settled site (site_scale.settle), not one still opening the create's segments
        whole, settled, settle_s = await settle(site, partitions, 3, CLUSTER_SETTLE_TIMEOUT_S)
        how = "settled" if settled else "NOT settled (timeout)" if whole else "NOT whole (timeout)"
        status = await site.status()
        counts: dict[int, int] = {}
        for p in status.partitions:
            counts[p.leader] = counts.get(p.leader, 0) + 1
        victim = max(counts, key=lambda n: counts[n])
        survivors = [n for n in site.nodes if n != victim]
        site.nodes[victim].kill9()
        start = time.perf_counter()
        end = time.monotonic() + REELECT_TIMEOUT_S
        last = "no answer"
        while time.monotonic() < end:
            with contextlib.suppress(BenchError):
                status = await site.status(survivors)
                mine = [p for p in status.partitions if p.topic == "big"]
                leaderless = [p.partition for p in mine if not p.leader_live or p.leader == victim]
                if len(mine) == partitions and not leaderless:
                    return time.perf_counter() - start, (
                        f"node {victim} led {counts[victim]:,} partitions; the site {how} {settle_s:.1f} s after the"
                        " create"
                    )
                last = f"{len(leaderless):,} partitions without a live leader"
            await asyncio.sleep(POLL_S)
        raise BenchError(f"not every partition has a live leader {REELECT_TIMEOUT_S:g}s after the kill: {last}")
    finally:
        site.close()


# -- report --------------------------------------------------------------------------------------------------------


def verdict(ok: bool | None) -> str:
    return "" if ok is None else ("PASS" if ok else "MISS")


def fmt(x: float, spec: str) -> str:
    return "-" if math.isnan(x) else format(x, spec)


def judge(row: Row) -> dict[str, bool | None]:
    def known(x: float, ok: bool) -> bool | None:
        return None if math.isnan(x) else ok

    return {
        "idle": known(row.idle_cpu, row.idle_cpu <= IDLE_CPU_MAX),
        "rss": known(row.rss_bytes, row.rss_bytes <= RSS_MAX),
        "fds": known(row.fds, row.fds <= FDS_MAX),
        "produce": known(row.vs_100, row.vs_100 >= PRODUCE_MIN_RATIO),
        "converge": known(row.converge_s, row.converge_s <= CONVERGE_MAX_RATIO * row.produce_s),
        "keyless": known(row.keyless_vs_100, row.keyless_vs_100 >= PRODUCE_MIN_RATIO),
        "keyless converge": known(
            row.keyless_converge_s, row.keyless_converge_s <= CONVERGE_MAX_RATIO * row.keyless_produce_s
        ),
        "restart": known(row.restart_s, row.restart_s <= RESTART_MAX_S),
    }


def table(rows: list[Row]) -> Iterator[str]:
    head = (
        f"{'size':>20} {'create s':>9} {'settle s':>9} {'idle cpu':>14} {'RSS MB':>12} {'fds':>11} {'scrape s':>9} "
        f"{'produce rec/s':>14} {'vs 100p':>13} {'converge s':>16} "
        f"{'keyless rec/s':>14} {'vs 100p':>13} {'converge s':>16} {'touched':>8} {'restart s':>14}"
    )
    yield head
    yield "-" * len(head)
    yield (
        f"{'target':>20} {'':>9} {'':>9} {'<= 2%':>14} {'<= 1024':>12} {'<= 2000':>11} {'':>9} {'':>14} {'>= 70%':>13} "
        f"{'<= 2x produce':>16} {'':>14} {'>= 70%':>13} {'<= 2x produce':>16} {'':>8} {'<= 10':>14}"
    )
    for r in rows:
        v = judge(r)
        yield (
            f"{r.label:>20} {fmt(r.create_s, '.1f'):>9} {fmt(r.settle_s, '.1f'):>9} "
            f"{fmt(100 * r.idle_cpu, '.1f') + '% ' + verdict(v['idle']):>14} "
            f"{fmt(r.rss_bytes / 2**20, '.0f') + ' ' + verdict(v['rss']):>12} "
            f"{fmt(r.fds, '.0f') + ' ' + verdict(v['fds']):>11} {fmt(r.scrape_s, '.3f'):>9} "
            f"{fmt(r.rate, ',.0f'):>14} {fmt(100 * r.vs_100, '.0f') + '% ' + verdict(v['produce']):>13} "
            f"{fmt(r.converge_s, '.1f') + ' ' + verdict(v['converge']):>16} "
            f"{fmt(r.keyless_rate, ',.0f'):>14} "
            f"{fmt(100 * r.keyless_vs_100, '.0f') + '% ' + verdict(v['keyless']):>13} "
            f"{fmt(r.keyless_converge_s, '.1f') + ' ' + verdict(v['keyless converge']):>16} "
            f"{fmt(r.keyless_touched, '.0f'):>8} "
            f"{fmt(r.restart_s, '.1f') + ' ' + verdict(v['restart']):>14}"
        )
        for e in r.errors:
            yield f"{'':>20} failed: {e}"


def plot(rows: list[Row], reelect_s: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: list[tuple[str, Callable[[Row], float], float | None]] = [
        ("idle CPU, % of one core", lambda r: 100 * r.idle_cpu, 100 * IDLE_CPU_MAX),
        ("RSS, MB", lambda r: r.rss_bytes / 2**20, RSS_MAX / 2**20),
        ("open fds", lambda r: r.fds, FDS_MAX),
        ("produce, records/s (round-robin)", lambda r: r.rate, None),
        ("converge after produce, s", lambda r: r.converge_s, None),
        ("restart after kill -9, s", lambda r: r.restart_s, RESTART_MAX_S),
        ("topic create, s", lambda r: r.create_s, None),
        ("metrics scrape, s", lambda r: r.scrape_s, 1.0),
    ]
    fig, axes = plt.subplots(3, 3, figsize=(15, 12))
    for ax, (title, get, target) in zip(axes.flat, panels, strict=False):
        for shape, marker in (("1 topic", "o"), ("many topics", "s")):
            pts = [(r.partitions, get(r)) for r in rows if (r.topics == 1) == (shape == "1 topic")]
            pts = [(x, y) for x, y in pts if not math.isnan(y)]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker=marker, label=shape)
        if target is not None:
            ax.axhline(target, color="red", linestyle="--", label="target")
        ax.set_xscale("log")
        ax.set_title(title)
        ax.set_xlabel("partitions")
        ax.legend(fontsize=8)
    last = axes.flat[len(panels)]
    last.axis("off")
    text = f"3-node site re-election: {fmt(reelect_s, '.2f')} s (target <= {REELECT_MAX_S:g} s)"
    last.text(0.0, 0.5, text, fontsize=11)
    fig.suptitle(f"georep scale, 3-site cycle, mTLS, {os.cpu_count()} cores")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def shapes(sizes: list[int], topics: int) -> list[tuple[int, int]]:
    out = []
    for p in sizes:
        out.append((p, 1))
        many = p if p <= topics else topics  # 100 partitions: 100 topics of 1
        if many > 1:
            out.append((p, many))
    return out


def with_ratios(rows: list[Row], cfg: Config) -> None:
    base = {r.topics == 1: r.rate for r in rows if r.partitions == min(cfg.sizes)}
    keyless_base = {r.topics == 1: r.keyless_rate for r in rows if r.partitions == min(cfg.sizes)}
    for r in rows:
        ref = base.get(r.topics == 1, math.nan)
        r.vs_100 = r.rate / ref if ref else math.nan
        ref = keyless_base.get(r.topics == 1, math.nan)
        r.keyless_vs_100 = r.keyless_rate / ref if ref else math.nan


def cluster_step(root: Path, partitions: int) -> tuple[float, str]:
    """The 3-node site's re-election, bounded as a whole: a site that cannot settle is a finding, not a hang."""
    progress(f"3-node site: {partitions:,} partitions, kill -9 of a leader")
    try:
        return asyncio.run(asyncio.wait_for(reelection(root, partitions), CLUSTER_TIMEOUT_S))
    except TimeoutError:
        return math.nan, f"failed: no answer within {CLUSTER_TIMEOUT_S:g} s (create, leaders, kill, re-election)"
    except (BenchError, grpc.RpcError, OSError, RuntimeError) as exc:
        return math.nan, f"failed: {str(exc).splitlines()[0][:200]}"


def run(cfg: Config) -> int:
    rows: list[Row] = []
    reelect_s, reelect_note = math.nan, "not run"
    with tempfile.TemporaryDirectory(prefix="georep-scale-") as tmp:
        for i, (partitions, topics) in enumerate(shapes(cfg.sizes, cfg.topics)):
            rows.append(run_size(Path(tmp) / f"s{i}", partitions, topics, cfg))
        with_ratios(rows, cfg)
        print(f"\ngeorep scale: 3-site cycle a->b->c->a, mTLS, {os.cpu_count()} cores, {cfg.records:,} records")
        for line in table(rows):  # before the 3-node site, so that its run cannot cost the rows
            print(line, flush=True)
        if cfg.cluster_partitions:
            reelect_s, reelect_note = cluster_step(Path(tmp) / "cluster", cfg.cluster_partitions)
    ok = None if math.isnan(reelect_s) else reelect_s <= REELECT_MAX_S
    print(
        f"\n3-node site, {cfg.cluster_partitions:,} partitions: re-election {fmt(reelect_s, '.2f')} s "
        f"(target <= {REELECT_MAX_S:g} s) {verdict(ok)}; {reelect_note}"
    )
    plot(rows, reelect_s, cfg.out)
    print(f"plot: {cfg.out}")
    if cfg.json_out:
        cfg.json_out.write_text(json.dumps({"rows": [asdict(r) for r in rows], "reelect_s": reelect_s}, indent=2))
    return 0


def parse_args(argv: list[str] | None) -> Config:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--sizes", default="100,1000,10000", help="partition counts, comma-separated")
    parser.add_argument("--topics", type=int, default=1000, help="topics of the many-topics shape of each size")
    parser.add_argument("--records", type=int, default=1_000_000, help="records per produce")
    parser.add_argument("--value-bytes", type=int, default=100)
    parser.add_argument("--idle-s", type=float, default=20.0, help="the idle CPU window, seconds")
    parser.add_argument(
        "--cluster-partitions", type=int, default=10_000, help="partitions of the 3-node site (0: skip it)"
    )
    parser.add_argument(
        "--partitioners",
        default="round-robin,keyless",
        help="the produces to run: round-robin (record i to partition i mod P), keyless (sticky), or both",
    )
    parser.add_argument(
        "--steps",
        default="idle,scrape,produce,restart",
        help="what to measure after the create, in this order (comma-separated)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/scale.png"), help="the PNG")
    parser.add_argument("--json", type=Path, default=None, dest="json_out", help="also write the figures here")
    parser.add_argument(
        "--py-spy",
        type=Path,
        metavar="DIR",
        help="record each node with py-spy during each idle window and each produce (until converged) into DIR",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 10 and 20 partitions, small produce")
    args = parser.parse_args(argv)
    sizes = [int(s.replace("_", "")) for s in args.sizes.split(",") if s.strip()]
    if args.quick:
        sizes, args.topics, args.records, args.idle_s, args.cluster_partitions = [10, 20], 10, 2_000, 2.0, 10
    if not sizes or min(sizes) < 1:
        parser.error("--sizes: give at least one partition count, each at least 1")
    partitioners = [x.strip() for x in args.partitioners.split(",") if x.strip()]
    if not partitioners or set(partitioners) - {"round-robin", "keyless"}:
        parser.error("--partitioners: round-robin, keyless, or both (comma-separated)")
    steps = [x.strip() for x in args.steps.split(",") if x.strip()]
    if set(steps) - {"idle", "scrape", "produce", "restart"}:
        parser.error("--steps: any of idle, scrape, produce, restart (comma-separated)")
    return Config(
        sizes,
        args.topics,
        args.records,
        args.value_bytes,
        args.idle_s,
        args.cluster_partitions,
        partitioners,
        steps,
        args.out,
        args.json_out,
        args.py_spy,
    )


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    if cfg.py_spy is not None:
        cfg.py_spy.mkdir(parents=True, exist_ok=True)

    def on_sigterm(_sig: int, _frame: object) -> None:
        raise KeyboardInterrupt  # the finally blocks kill every node and remove the directory

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return run(cfg)
    except KeyboardInterrupt:
        print("interrupted: every node stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
