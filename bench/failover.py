"""Failover: repeated DR drills (RTO, RPO, duplicates) and the cost of geo-synchronous commits, in one run.

Run from the repository root::

    .venv/bin/python bench/failover.py                    # 10 drills and 5 s per commit measurement, ~4 min
    .venv/bin/python bench/failover.py --drills 2 --seconds 2
    .venv/bin/python bench/failover.py --drills 0 --json commits.json   # commit throughput only

It starts its own three sites a, b, c (the default topology's links: the cycle
a -> b -> c -> a and the reverse edges) on ephemeral ports, the way
``georep up`` starts them (``georep.cli.up.site_processes``, admin token file
included), under one temporary directory that is removed on exit, Ctrl-C or
SIGTERM. What is measured (bench/README.md explains how to read it):

* ``drills``: ``--drills`` runs of ``georep.cli.drill.drill`` back to back in kill
  mode with restart, the victim taking turns through ``--victims``: per drill
  the RTO, the RPO lost per ack level, duplicates relative to the last commit,
  redeliveries and never-delivered records; then the median and worst RTO and
  whether every drill kept every promise.
* ``commits``: standalone commits of one partition at site a, back to back
  for ``--seconds`` each, at ``acks=leader`` and at ``acks=geo:2``: commits/s
  and p50/p99 latency. Next to them, in the same run, one-record produce
  batches through ``Producer`` awaited one by one at the same two ack levels:
  the reference that makes the ratios meaningful on a noisy machine.

Every node started here, and every node a drill restarted (a detached process
whose pid is in its ``node.json``), is stopped at the end, on an error, on
Ctrl-C and on SIGTERM.
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
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

# bench/ is on sys.path when this file runs as a script: reuse the helpers of the other benches.
from produce import BenchError, progress, settle_page_cache
from replication import free_ports, topology_toml

from georep.cli import drill as drill_mod
from georep.cli.up import site_processes
from georep.client import Consumer, Producer
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.security.tls import client_channel
from georep.server.process import NODE_INFO
from offsets.coordinates import Origin
from offsets.vector import VectorOffset
from topology.model import parse_topology

SITES = ("a", "b", "c")
LINKS = (("a", "b"), ("b", "c"), ("c", "a"), ("b", "a"), ("c", "b"), ("a", "c"))  # as the embedded default
COMMIT_SITE = "a"
COMMIT_WARMUP = 20  # commits (or records) before the clock runs
STOP_TIMEOUT_S = 20.0
HEALTH_TIMEOUT_S = 60.0


# -- the sites ------------------------------------------------------------------------


class Sites:
    """Three ``georep node`` processes under ``root``, and every node a drill restarts there."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data_dir = root / "data"
        self.topology_file = root / "topology.toml"
        self.topology_file.write_text(topology_toml(SITES, free_ports(len(SITES)), LINKS))
        topology = parse_topology(self.topology_file.read_text())
        self.procs = {p.site: p for p in site_processes(topology, self.topology_file, self.data_dir, [])}
        self.addresses = {s: topology.site(s).nodes[0] for s in SITES}

    def start(self) -> None:
        for p in self.procs.values():
            p.start()

    def stop(self) -> None:
        """SIGTERM to every node at once, SIGKILL to those still up after ``STOP_TIMEOUT_S``: our own
        children, the nodes drills restarted (their pids are in ``node.json``), and any node process still
        running with a data dir under ``root`` (restarted, but killed before it wrote ``node.json``)."""
        ours = [p.proc for p in self.procs.values() if p.proc is not None]
        others = sorted((self._restarted_pids() | self._pids_under_root()) - {p.pid for p in ours})
        for proc in ours:
            if proc.poll() is None:
                proc.terminate()
        for pid in others:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in ours:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                progress(f"node pid {proc.pid} ignored SIGTERM for {STOP_TIMEOUT_S:g}s: killed")
        for pid in others:
            while not _gone(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if not _gone(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                progress(f"node pid {pid} ignored SIGTERM for {STOP_TIMEOUT_S:g}s: killed")

    def _restarted_pids(self) -> set[int]:
        out = set()
        for site in SITES:
            with contextlib.suppress(OSError, ValueError, KeyError):
                out.add(int(json.loads((self.data_dir / site / NODE_INFO).read_text())["pid"]))
        return out

    def _pids_under_root(self) -> set[int]:
        prefixes = (str(self.data_dir), str(self.data_dir.resolve()))
        out = set()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
                if "georep.cli" in args and "node" in args and any(a.startswith(prefixes) for a in args):
                    out.add(int(entry.name))
        return out

    async def wait_healthy(self, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        for site, address in self.addresses.items():
            while True:
                try:
                    async with client_channel(address, None) as ch:
                        await pbg.NodeStub(ch).Health(pb.HealthRequest(), timeout=2)
                    break
                except grpc.aio.AioRpcError:
                    if time.monotonic() > deadline:
                        raise BenchError(f"site {site} at {address} does not answer after {timeout_s:g}s") from None
                    await asyncio.sleep(0.1)


def _gone(pid: int) -> bool:
    try:
        # A node a drill restarted is a child of this process (a detached session, but our child): reap it.
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == pid
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


# -- 1. drills ---------------------------------------------------------------------------


@dataclass
class DrillRun:
    number: int
    victim: str
    seconds: float
    report: dict[str, Any] | None = None
    error: str = ""


def drill_args(sites: Sites, cfg: Config, victim: str) -> argparse.Namespace:
    """``georep drill``'s own defaults, with this topology, a short run, and kill-and-restart."""
    parser = argparse.ArgumentParser()
    drill_mod.add_arguments(parser)
    args = parser.parse_args([])
    args.topology = sites.topology_file
    args.data_dir = sites.data_dir
    args.mode = "kill"
    args.no_restart = False
    args.site = victim
    args.failover_to = SITES[(SITES.index(victim) + 1) % len(SITES)]
    args.warmup = cfg.warmup_s
    args.after = cfg.after_s
    args.rate = cfg.rate
    args.report = None
    return args


async def run_drills(sites: Sites, cfg: Config) -> list[DrillRun]:
    runs: list[DrillRun] = []
    for i in range(cfg.drills):
        victim = cfg.victims[i % len(cfg.victims)]
        await sites.wait_healthy()
        settle_page_cache()
        progress(f"drill {i + 1}/{cfg.drills}: kill {victim}")
        start = time.monotonic()
        run = DrillRun(i + 1, victim, 0.0)
        try:
            run.report = await drill_mod.drill(drill_args(sites, cfg, victim), out=lambda s: progress("  " + s))
        except drill_mod.DrillError as exc:
            run.error = str(exc)
            progress(f"drill {i + 1} could not finish: {exc}")
        run.seconds = time.monotonic() - start
        runs.append(run)
        if run.error:
            try:
                await sites.wait_healthy(30)
            except BenchError as exc:
                progress(f"stopping the drills: {exc}")
                break
    return runs


# -- 2. commits next to produce ---------------------------------------------------------------


@dataclass
class Rate:
    what: str  # "commit" or "produce"
    acks: str
    seconds: float
    count: int
    latencies_ms: list[float] = field(repr=False, default_factory=list)
    errors: int = 0

    @property
    def per_s(self) -> float:
        return self.count / self.seconds if self.seconds > 0 else float("nan")

    def pct(self, q: float) -> float:
        xs = sorted(self.latencies_ms)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    def as_json(self) -> dict[str, Any]:
        return {
            "what": self.what,
            "acks": self.acks,
            "seconds": self.seconds,
            "count": self.count,
            "errors": self.errors,
            "per_s": self.per_s,
            "p50_ms": self.pct(0.5),
            "p99_ms": self.pct(0.99),
            "max_ms": max(self.latencies_ms, default=float("nan")),
        }


async def timed(what: str, acks: str, seconds: float, op: Any) -> Rate:
    for _ in range(COMMIT_WARMUP):
        await op()
    rate = Rate(what, acks, 0.0, 0)
    start = time.perf_counter()
    end = start + seconds
    while (t0 := time.perf_counter()) < end:
        try:
            await op()
        except Exception:
            rate.errors += 1
            continue
        rate.latencies_ms.append((time.perf_counter() - t0) * 1000)
        rate.count += 1
    rate.seconds = time.perf_counter() - start
    return rate


async def measure_commits(sites: Sites, seconds: float) -> list[Rate]:
    address = sites.addresses[COMMIT_SITE]
    run_id = os.urandom(3).hex()
    topic = f"commits-{run_id}"
    async with client_channel(address, None) as ch:
        stub = pbg.NodeStub(ch)
        await stub.CreateTopic(pb.CreateTopicRequest(name=topic, partitions=1), timeout=30)
        health = await stub.Health(pb.HealthRequest(), timeout=10)
    origin = Origin.parse(f"{health.site}@{health.epoch}")
    # geo:2 needs the topic at a second site before its first record can be held there.
    for site in SITES:
        async with client_channel(sites.addresses[site], None) as ch:
            deadline = time.monotonic() + 30
            while True:
                try:
                    await pbg.NodeStub(ch).DescribeTopic(pb.DescribeTopicRequest(name=topic), timeout=5)
                    break
                except grpc.aio.AioRpcError:
                    if time.monotonic() > deadline:
                        raise BenchError(f"topic {topic} did not reach site {site} within 30s") from None
                    await asyncio.sleep(0.1)
    value = os.urandom(100)
    out = []
    for acks in ("leader", "geo:2"):
        progress(f"commits: produce acks={acks}, one-record batches awaited one by one, {seconds:g}s")
        settle_page_cache()
        producer = Producer(address, acks=acks, linger_ms=0)
        await producer.start()
        try:
            out.append(await timed("produce", acks, seconds, lambda p=producer: p.send(topic, value, partition=0)))
        finally:
            await producer.close()
        progress(f"commits: commit acks={acks}, one partition per commit, back to back, {seconds:g}s")
        settle_page_cache()
        consumer = Consumer(
            address, group_id=f"bench-{run_id}-{acks.replace(':', '')}", commit_acks=acks, enable_auto_commit=False
        )
        await consumer.start()
        seq = 0

        async def commit(c: Consumer = consumer) -> None:
            nonlocal seq
            seq += 1
            await c.commit({(topic, 0): VectorOffset({origin: seq})})

        try:
            out.append(await timed("commit", acks, seconds, commit))
        finally:
            await consumer.close()
    return out


# -- the run ----------------------------------------------------------------------------------


@dataclass
class Config:
    drills: int
    victims: list[str]
    warmup_s: float
    after_s: float
    rate: float
    seconds: float


@dataclass
class Results:
    drills: list[DrillRun] = field(default_factory=list)
    rates: list[Rate] = field(default_factory=list)


async def run_all(sites: Sites, cfg: Config) -> Results:
    res = Results()
    await sites.wait_healthy()
    if cfg.seconds > 0:  # first, on the fresh sites
        res.rates = await measure_commits(sites, cfg.seconds)
    if cfg.drills > 0:
        res.drills = await run_drills(sites, cfg)
    return res


def rto_figures(res: Results) -> tuple[float, int] | None:
    rtos = [r.report["rto_ms"] for r in res.drills if r.report is not None]
    return (statistics.median(rtos), max(rtos)) if rtos else None


def broken(res: Results) -> list[str]:
    out = []
    for r in res.drills:
        if r.error:
            out.append(f"drill {r.number} (kill {r.victim}) did not finish: {r.error}")
        elif r.report is not None and not r.report["ok"]:
            out += [f"drill {r.number} (kill {r.victim}): {b}" for b in r.report["promises_broken"]]
    return out


def report(res: Results, cfg: Config) -> Iterator[str]:
    if res.drills:
        levels = next((list(r.report["acks"]) for r in res.drills if r.report is not None), [])
        yield (
            f"1. Failover drills: {len(res.drills)} x georep drill --mode kill (restart on), warm-up "
            f"{cfg.warmup_s:g}s, {cfg.after_s:g}s after, {cfg.rate:g} records/s per producer at each site and "
            f"ack level ({', '.join(levels)}), 2 consumers committing every 200 ms at acks=geo:2."
        )
        yield "   RPO lost per ack level: acked records no surviving site held (window: event - oldest such ack)."
        lost_heads = "".join(f" {'lost ' + level:>17}" for level in levels)
        head = (
            f"   {'#':>2} {'kill':>4} {'->':>3} {'RTO ms':>7}{lost_heads} {'lost@rejoin':>11} {'dup/commit':>10} "
            f"{'redelivered':>11} {'never':>5} {'commits':>7} {'failed':>6} {'secs':>5}  promises"
        )
        yield head
        yield "   " + "-" * (len(head) - 3)
        for r in res.drills:
            d = r.report
            if d is None:
                yield f"   {r.number:>2} {r.victim:>4}  did not finish: {r.error}"
                continue
            lost = "".join(
                f" {str(f['rpo_lost']) + ' (' + str(f['rpo_window_ms']) + ' ms)':>17}" for f in d["acks"].values()
            )
            rejoin = sum(f["lost_after_rejoin"] for f in d["acks"].values())
            yield (
                f"   {r.number:>2} {r.victim:>4} {d['failover_to']:>3} {d['rto_ms']:>7}{lost} {rejoin:>11} "
                f"{d['duplicates_vs_commit']:>10} {d['duplicates_total']:>11} {d['never_delivered']:>5} "
                f"{d['commits']:>7} {d['commit_errors']:>6} {r.seconds:>5.1f}  "
                f"{'kept' if d['ok'] else 'BROKEN'}"
            )
        yield ""
    if res.rates:
        yield (
            f"2. Commits at site {COMMIT_SITE}, one partition per commit, awaited one by one, next to one-record "
            f"produce batches awaited one by one ({res.rates[0].seconds:.0f}s each; the offsets topic and the "
            "produce topic both fsync per batch)."
        )
        head = f"   {'what':<8} {'acks':<7} {'ops/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'count':>7} errors"
        yield head
        yield "   " + "-" * (len(head) - 3)
        for rate in res.rates:
            j = rate.as_json()
            yield (
                f"   {rate.what:<8} {rate.acks:<7} {rate.per_s:>7.0f} {j['p50_ms']:>7.2f} {j['p99_ms']:>7.2f} "
                f"{j['max_ms']:>7.2f} {rate.count:>7} {rate.errors}"
            )
        yield ""


def ratios(res: Results) -> dict[str, float]:
    by = {(r.what, r.acks): r.per_s for r in res.rates}
    out = {}
    if ("commit", "leader") in by and ("produce", "leader") in by:
        out["commit_leader_vs_produce_leader"] = by[("commit", "leader")] / by[("produce", "leader")]
    if ("commit", "geo:2") in by and ("commit", "leader") in by:
        out["commit_geo2_vs_commit_leader"] = by[("commit", "geo:2")] / by[("commit", "leader")]
    if ("produce", "geo:2") in by and ("produce", "leader") in by:
        out["produce_geo2_vs_produce_leader"] = by[("produce", "geo:2")] / by[("produce", "leader")]
    if ("commit", "geo:2") in by and ("produce", "geo:2") in by:
        out["commit_geo2_vs_produce_geo2"] = by[("commit", "geo:2")] / by[("produce", "geo:2")]
    return out


def summary(res: Results) -> Iterator[str]:
    if res.drills:
        figures = rto_figures(res)
        if figures is not None:
            yield (
                f"RTO (kill to the first record consumed at the failover site): median {figures[0]:.0f} ms, "
                f"worst {figures[1]} ms over {sum(1 for r in res.drills if r.report)} drills"
            )
        problems = broken(res)
        if problems:
            yield f"PROMISES BROKEN in {len({p.split(':')[0] for p in problems})} of {len(res.drills)} drills:"
            yield from (f"  - {p}" for p in problems)
        else:
            yield f"every drill kept every promise ({len(res.drills)} of {len(res.drills)})"
    labels = {
        "commit_leader_vs_produce_leader": "commit/s at leader / one-record produce/s at leader",
        "commit_geo2_vs_commit_leader": "commit/s at geo:2 / commit/s at leader",
        "produce_geo2_vs_produce_leader": "produce/s at geo:2 / produce/s at leader",
        "commit_geo2_vs_produce_geo2": "commit/s at geo:2 / produce/s at geo:2",
    }
    for key, value in ratios(res).items():
        yield f"{labels[key]}: {value * 100:.0f}%"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drills", type=int, default=10, help="drills back to back (default 10; 0: none)")
    parser.add_argument(
        "--victims", default="a,b,c", help="sites to kill, in turn (default a,b,c); each fails over to the next site"
    )
    parser.add_argument("--warmup", type=float, default=2.0, help="drill seconds before the kill (default 2)")
    parser.add_argument("--after", type=float, default=2.0, help="drill seconds of producing after it (default 2)")
    parser.add_argument(
        "--rate",
        type=float,
        default=100.0,
        help="drill records/s per producer; 6 producers run, 2 per site (default 100)",
    )
    parser.add_argument(
        "--seconds", type=float, default=5.0, help="seconds per commit and produce measurement (default 5; 0: none)"
    )
    parser.add_argument("--json", type=Path, help="also write the results (every drill report whole) to this file")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (node logs) on exit")
    args = parser.parse_args(argv)
    args.victims = [v.strip() for v in args.victims.split(",") if v.strip()]
    bad = [v for v in args.victims if v not in SITES]
    if bad or not args.victims:
        parser.error(f"--victims takes sites among {', '.join(SITES)}, not {', '.join(bad) or 'nothing'}")
    if args.drills < 0 or args.seconds < 0 or args.warmup <= 0 or args.after <= 0 or args.rate <= 0:
        parser.error("--drills and --seconds must be >= 0; --warmup, --after and --rate positive")
    return args


def stop_on_signal(sites: list[Sites], root: Path, keep: bool) -> None:
    """Ctrl-C and SIGTERM stop every node and exit at once.

    Not by unwinding the event loop: the drill's consumers close themselves in
    ``finally`` blocks that await their own tasks under
    ``suppress(asyncio.CancelledError)``, which can swallow the cancellation,
    and the drill would then go on, or a ``wait_for`` run out its timeout.
    """
    stopping = False

    def handler(signum: int, frame: object) -> None:
        nonlocal stopping
        if stopping:
            return
        stopping = True
        print(f"\ninterrupted ({signal.Signals(signum).name}): stopping every node", file=sys.stderr, flush=True)
        for s in sites:
            s.stop()
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
        sys.stdout.flush()
        os._exit(128 + signum)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = Config(args.drills, args.victims, args.warmup, args.after, args.rate, args.seconds)
    cores = os.cpu_count() or 1
    print(
        f"georep failover benchmark: {cores} cores ({platform.machine()}), Python {platform.python_version()}, "
        f"grpcio {grpc.__version__}"
    )
    print("This machine is shared and noisy: absolute ms and ops/s vary run to run; compare the ratios in one run.")
    if cores < 4:
        print(
            f"Note: with {cores} cores the three nodes, the drill's producers and consumers and the bench compete "
            "for CPU, which shows in the RTO and the latencies."
        )
    print()
    started = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="georep-bench-failover-"))
    started_sites: list[Sites] = []
    stop_on_signal(started_sites, root, args.keep)
    sites: Sites | None = None
    try:
        sites = Sites(root)
        started_sites.append(sites)
        progress(f"starting sites {', '.join(SITES)} under {root}")
        sites.start()
        res = asyncio.run(run_all(sites, cfg))
    finally:
        if sites is not None:
            progress("stopping every node, restarted ones included")
            sites.stop()
        if args.keep:
            print(f"kept {root} (node logs: {root}/data/<site>/node.log)")
        else:
            shutil.rmtree(root, ignore_errors=True)
    for line in report(res, cfg):
        print(line)
    for line in summary(res):
        print(line)
    print(f"(total {time.monotonic() - started:.0f}s)")
    if args.json:
        figures = rto_figures(res)
        doc = {
            "cores": cores,
            "machine": platform.machine(),
            "python": platform.python_version(),
            "grpcio": grpc.__version__,
            "config": {
                "drills": cfg.drills,
                "victims": cfg.victims,
                "warmup_s": cfg.warmup_s,
                "after_s": cfg.after_s,
                "rate": cfg.rate,
                "seconds": cfg.seconds,
            },
            "drills": [
                {"number": r.number, "victim": r.victim, "seconds": r.seconds, "error": r.error, "report": r.report}
                for r in res.drills
            ],
            "rto_median_ms": figures[0] if figures else None,
            "rto_worst_ms": figures[1] if figures else None,
            "every_promise_kept": not broken(res) if res.drills else None,
            "rates": [r.as_json() for r in res.rates],
            "ratios": ratios(res),
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
