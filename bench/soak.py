"""Soak: the default 3-site topology under load for a bounded time, with a failure every minute.

    python bench/soak.py --minutes 10

Starts one node per site of a triangle (a, b, c, every link both ways) on
free local ports, then runs one ``georep drill`` round per minute: producers
at every site (``acks=leader`` and ``acks=geo:2``), a consumer group that
commits with ``geo:2`` and fails over, and an event on a different site each
round, alternating ``kill -9`` (then a restart) and ``isolate`` (every link
of the site cut, then healed). Every 10 s it samples each node's resident
memory and open file descriptors (``/proc/PID``; a killed node's successor is
found through its ``node.json``).

It prints, per minute, each node's RSS and open fds, and at the end:

* records lost for good (acked, then held by no site once the victim is back):
  must be 0;
* duplicates relative to commits (delivered again after a failover although a
  commit acked before the event covered them): must be 0;
* records never delivered to the group: must be 0;
* RSS growth of each node process over its life after its warm-up (its
  first sample ``--warmup-minutes`` after it started, against its last; a
  node restarted after a kill is a new process and is compared with itself
  only): must stay under 10% for every process that lived at least two
  minutes past its warm-up;
* rounds that could not finish (no consumer read at the failover site within
  the drill's limit): must be none. Such a round is reported with the drill's
  own lines and the consumers' state, and the soak goes on.

Exit 1 if any of these fails. Nothing here is timed against a threshold: the
machines are shared, so only counts and ratios are judged.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from georep.cli import drill as drill_cli
from georep.cli.up import site_processes
from georep.server.process import NODE_INFO, NodeProcess
from topology.model import parse_topology

SITES = ["a", "b", "c"]
SAMPLE_S = 10.0
RSS_GROWTH_MAX = 0.10


def triangle_toml() -> str:
    """Sites a, b, c on free local ports, every link both ways."""
    socks = [socket.socket() for _ in SITES]
    for sock in socks:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in socks]
    for sock in socks:
        sock.close()
    lines = [f'[sites.{s}]\nnodes = ["127.0.0.1:{port}"]\n' for s, port in zip(SITES, ports, strict=True)]
    lines += [f'[[links]]\nsrc = "{x}"\ndst = "{y}"\n' for x in SITES for y in SITES if x != y]
    return "\n".join(lines)


def node_pid(data_dir: Path, site: str) -> int | None:
    try:
        return int(json.loads((data_dir / site / NODE_INFO).read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def rss_and_fds(pid: int) -> tuple[float, int] | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        rss_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
        return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration, ValueError):
        return None


class Sampler(threading.Thread):
    def __init__(self, data_dir: Path) -> None:
        super().__init__(daemon=True)
        self.data_dir = data_dir
        self.samples: list[tuple[float, dict[str, tuple[float, int, int]]]] = []
        self.stop = threading.Event()
        self.started = time.monotonic()

    def run(self) -> None:
        while not self.stop.is_set():
            row = {}
            for site in SITES:
                pid = node_pid(self.data_dir, site)
                got = rss_and_fds(pid) if pid else None
                if got is not None and pid is not None:
                    row[site] = (*got, pid)
            self.samples.append((time.monotonic() - self.started, row))
            self.stop.wait(SAMPLE_S)


def drill_args(topology: Path, data_dir: Path, victim: str, mode: str, rate: float) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    drill_cli.add_arguments(parser)
    return parser.parse_args(
        [
            "--topology",
            str(topology),
            "--data-dir",
            str(data_dir),
            "--site",
            victim,
            "--failover-to",
            SITES[(SITES.index(victim) + 1) % len(SITES)],
            "--mode",
            mode,
            "--rate",
            str(rate),
            "--partitions",
            "2",
            "--warmup",
            "8",
            "--after",
            "8",
            "--commit-acks",
            "geo:2",
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to run (default 10)")
    parser.add_argument("--warmup-minutes", type=float, default=2.0, help="RSS growth is measured after this")
    parser.add_argument("--rate", type=float, default=100.0, help="records/s per producer (default 100)")
    parser.add_argument("--report", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="georep-soak-"))
    topology_file = root / "topology.toml"
    topology_file.write_text(triangle_toml())
    topology = parse_topology(topology_file.read_text())
    procs: list[NodeProcess] = site_processes(topology, topology_file, root, [])
    for proc in procs:
        proc.log_path = root / f"{proc.site}.log"
        proc.start()
    sampler = Sampler(root)
    sampler.start()
    rounds: list[dict[str, Any]] = []
    failed: list[str] = []
    deadline = time.monotonic() + args.minutes * 60
    try:
        i = 0
        while time.monotonic() < deadline:
            started = time.monotonic()
            victim, mode = SITES[i % len(SITES)], ("kill", "isolate")[i % 2]
            lines: list[str] = []
            try:
                doc = asyncio.run(
                    drill_cli.drill(drill_args(topology_file, root, victim, mode, args.rate), out=lines.append)
                )
            except drill_cli.DrillError as exc:
                # A round that cannot finish is a broken promise (no failover within the drill's limit), not a
                # reason to stop: record it, show what the drill saw, and go on with the next round.
                failed.append(f"minute {i + 1} ({mode} {victim}): {exc}")
                print(f"minute {i + 1}: {mode} {victim}: FAILED: {exc}", flush=True)
                print("".join(f"    {line}\n" for line in lines), end="", flush=True)
            else:
                rounds.append(doc)
                print(
                    f"minute {i + 1}: {mode} {victim}: {doc['records_acked']} acked, lost for good "
                    f"{sum(f['lost_after_rejoin'] for f in doc['acks'].values())}, duplicates vs commits "
                    f"{doc['duplicates_vs_commit']}, never delivered {doc['never_delivered']}, "
                    f"RTO {doc['rto_ms']} ms",
                    flush=True,
                )
            i += 1
            time.sleep(max(0.0, min(60.0 - (time.monotonic() - started), deadline - time.monotonic())))
    finally:
        sampler.stop.set()
        sampler.join()
        for site in SITES:
            pid = node_pid(root, site)
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        for proc in procs:
            proc.stop()
    return summarise(rounds, failed, sampler.samples, args)


def summarise(
    rounds: list[dict[str, Any]],
    failed: list[str],
    samples: list[tuple[float, dict[str, tuple[float, int, int]]]],
    args: argparse.Namespace,
) -> int:
    print(f"\n{'MINUTE':>6} " + " ".join(f"{s + ' RSS MB':>10} {s + ' FDS':>6}" for s in SITES))
    for minute in range(int(args.minutes) + 1):
        row = next((r for t, r in samples if t >= minute * 60), None)
        if row is None:
            break
        cells = [f"{row[s][0]:>10.1f} {row[s][1]:>6}" if s in row else f"{'-':>10} {'-':>6}" for s in SITES]
        print(f"{minute:>6} " + " ".join(cells))
    warmup_s = args.warmup_minutes * 60
    growth: dict[str, float] = {}  # per site: the largest growth of any of its processes
    for s in SITES:
        by_pid: dict[int, list[tuple[float, float]]] = {}
        for t, r in samples:
            if s in r:
                by_pid.setdefault(r[s][2], []).append((t, r[s][0]))
        for series in by_pid.values():
            warm = [(t, rss) for t, rss in series if t >= series[0][0] + warmup_s]
            if len(warm) >= 2 and warm[-1][0] - warm[0][0] >= 120:
                g = (warm[-1][1] - warm[0][1]) / warm[0][1]
                growth[s] = max(growth.get(s, g), g)
    lost = sum(f["lost_after_rejoin"] for d in rounds for f in d["acks"].values())
    dups = sum(d["duplicates_vs_commit"] for d in rounds)
    never = sum(d["never_delivered"] for d in rounds)
    acked = sum(d["records_acked"] for d in rounds)
    print(f"\n{len(rounds)} rounds, {acked} records acked; {len(failed)} round(s) could not finish")
    for line in failed:
        print(f"  {line}")
    print(f"records lost for good: {lost}")
    print(f"duplicates relative to commits: {dups}")
    print(f"never delivered: {never}")
    print(
        "RSS growth of each node process after its warm-up (the largest per site): "
        + (", ".join(f"{s} {100 * g:+.1f}%" for s, g in growth.items()) or "no process lived long enough")
    )
    if args.report:
        report = {"rounds": rounds, "failed": failed, "samples": samples, "rss_growth": growth}
        args.report.write_text(json.dumps(report, indent=1))
    ok = not failed and not lost and not dups and not never and all(g < RSS_GROWTH_MAX for g in growth.values())
    print("soak: " + ("every promise kept" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
