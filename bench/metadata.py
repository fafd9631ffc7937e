"""A multi-node site's metadata: commands per second through a three-node Raft group, and the latency of one
command, with the journal fdatasynced (group commit) next to pysyncobj's journal that is never synced, in one run.

Run from the repository root::

    .venv/bin/python bench/metadata.py            # full run: 3,000 commands by 24 writers, 300 one by one, best of 3
    .venv/bin/python bench/metadata.py --quick    # smoke run, a few seconds

Each run starts a fresh group of three ``RaftMetadataStore``s (``georep/raft/store.py``) in this process, on
127.0.0.1 with the default Raft timing and a Raft secret, their data under one temporary directory (``--dir``: on
the disk to measure; a tmpfs would make every fsync free). Two kinds of group, alternating run by run so that both
see the same moments of a shared machine:

* ``before``: ``journal_sync=False``, pysyncobj's own journal (written through mmap, never fsynced), messages sent at
  once: what georep did before issue 20, which survives a crash of the process but not of the machine.
* ``after``: the fsynced journal (``georep/raft/journal.py``): no message leaves a node before the entries it
  counts on are fdatasynced, one fdatasync per pass of the node's poller or tick (``georep/raft/transport.py``).

What is measured in each run:

* ``throughput``: ``--writers`` threads propose ``--commands`` ``NodeHeartbeat`` commands in all (the command every
  node of a site sends most), each writer through one of the three nodes in turn and waiting for each of its
  commands to be committed and applied at that node before the next; the clock stops when every node has applied
  every command. Commands per second.
* ``latency``: one writer proposes ``--latency-commands`` commands one after the other through a follower (its
  command goes to the leader, which replicates it to a majority before the follower applies it). The median and
  the 99th percentile, in milliseconds.
* ``fdatasync per command``: the journals' fdatasync calls (all three nodes) during the throughput part, divided by
  its commands: below 3 means commands shared an fdatasync (group commit).

Every figure is the median of ``--repeats`` runs (all of them listed below it): on a shared machine a single
run moves by tens of percent.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

# bench/ is on sys.path when this file runs as a script
from produce import free_port, progress

from cluster.site_state import Applied, NodeHeartbeat, Refused, RegisterNode
from georep.raft.store import RaftMetadataStore
from georep.security.raft_secret import new_secret
from topology.ids import NodeId

NODES = 3
WAIT_S = 60.0
MODES = ("before", "after")


@dataclass
class Run:
    commands_per_s: float
    latencies_ms: list[float]
    fdatasyncs_per_command: float

    @property
    def p50_ms(self) -> float:
        return statistics.median(self.latencies_ms)

    @property
    def p99_ms(self) -> float:
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


@dataclass
class Mode:
    name: str
    runs: list[Run] = field(default_factory=list)

    def throughput(self) -> float:
        return statistics.median(r.commands_per_s for r in self.runs)

    def p50_ms(self) -> float:
        return statistics.median(r.p50_ms for r in self.runs)

    def p99_ms(self) -> float:
        return statistics.median(r.p99_ms for r in self.runs)

    def fdatasyncs_per_command(self) -> float:
        return statistics.median(r.fdatasyncs_per_command for r in self.runs)


class FdatasyncCounter:
    """Counts os.fdatasync calls while enabled (the journal calls it through the os module)."""

    def __init__(self) -> None:
        self.calls = 0
        self.counting = False
        self._real: Callable[[int], None] = os.fdatasync
        self._lock = threading.Lock()

    def __enter__(self) -> FdatasyncCounter:
        def fdatasync(fd: int) -> None:
            self._real(fd)
            if self.counting:
                with self._lock:
                    self.calls += 1

        os.fdatasync = fdatasync
        return self

    def __exit__(self, *exc_info: object) -> None:
        os.fdatasync = self._real


@contextlib.contextmanager
def group(root: Path, journal_sync: bool) -> Iterator[list[RaftMetadataStore]]:
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(NODES)]
    secret = new_secret()
    stores: list[RaftMetadataStore] = []
    try:
        for i, address in enumerate(addresses):
            stores.append(
                RaftMetadataStore(address, addresses, root / f"node{i}", password=secret, journal_sync=journal_sync)
            )
        yield stores
    finally:
        for store in stores:
            store.close(snapshot=False)


def wait_for(what: str, predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {WAIT_S:g} s")
        time.sleep(0.01)


def committed(result: object) -> None:
    if not isinstance(result, Applied | Refused):
        raise RuntimeError(f"a command gave {result!r}")


def throughput(
    stores: list[RaftMetadataStore], commands: int, writers: int, counter: FdatasyncCounter
) -> tuple[float, float]:
    per_writer = commands // writers
    errors: list[BaseException] = []
    start = threading.Barrier(writers + 1)

    def write(w: int) -> None:
        store = stores[w % NODES]
        node = NodeId(w % NODES + 1)
        start.wait()
        try:
            for n in range(per_writer):
                committed(store.propose(NodeHeartbeat(node, 1_000_000 + w * per_writer + n, 1 << 40, n)))
        except BaseException as e:  # reported after the run
            errors.append(e)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    counter.calls = 0
    counter.counting = True
    start.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} writers failed: {errors[0]!r}")
    target = max(s.status().commit_index for s in stores)
    wait_for("node applying every command", lambda: all(s.status().applied_index >= target for s in stores))
    elapsed = time.perf_counter() - began
    counter.counting = False
    done = per_writer * writers
    return done / elapsed, counter.calls / done


def latency(stores: list[RaftMetadataStore], commands: int) -> list[float]:
    follower = next(s for s in stores if not s.is_leader)
    out = []
    for n in range(commands):
        began = time.perf_counter()
        committed(follower.propose(NodeHeartbeat(NodeId(1), 10_000_000 + n, 1 << 40, 0)))
        out.append((time.perf_counter() - began) * 1000)
    return out


def one_run(root: Path, journal_sync: bool, args: argparse.Namespace, counter: FdatasyncCounter) -> Run:
    with group(root, journal_sync) as stores:
        wait_for(
            "Raft leader",
            lambda: sum(s.is_leader for s in stores) == 1 and all(s.leader_address is not None for s in stores),
        )
        for i in range(NODES):  # the nodes the heartbeats are about, and a warm-up of every path
            committed(stores[i].propose(RegisterNode(NodeId(i + 1), f"127.0.0.1:{9000 + i}")))
        rate, syncs = throughput(stores, args.commands, args.writers, counter)
        return Run(rate, latency(stores, args.latency_commands), syncs)


def report(modes: dict[str, Mode], args: argparse.Namespace, where: Path) -> Iterator[str]:
    before, after = modes["before"], modes["after"]
    yield (
        f"metadata commands through a {NODES}-node Raft group in one process; {os.cpu_count()} cores; "
        f"Python {platform.python_version()}; data under {where}"
    )
    yield (
        f"throughput: {args.commands} NodeHeartbeat commands by {args.writers} writers; latency: "
        f"{args.latency_commands} commands one by one through a follower; {args.repeats} runs each"
    )
    yield ""
    yield f"{'median of runs':28}{'before (no fsync)':>20}{'after (fdatasync)':>20}{'after/before':>14}"
    rows = [
        ("throughput, commands/s", Mode.throughput, ".0f"),
        ("latency p50, ms", Mode.p50_ms, ".2f"),
        ("latency p99, ms", Mode.p99_ms, ".2f"),
    ]
    for label, figure, spec in rows:
        b, a = figure(before), figure(after)
        yield f"{label:28}{b:>20{spec}}{a:>20{spec}}{a / b:>13.0%}"
    yield f"{'fdatasync per command':28}{before.fdatasyncs_per_command():>20.2f}{after.fdatasyncs_per_command():>20.2f}"
    yield ""
    for mode in (before, after):
        runs = ", ".join(f"{r.commands_per_s:.0f}" for r in mode.runs)
        lat = ", ".join(f"{r.p50_ms:.2f}/{r.p99_ms:.2f}" for r in mode.runs)
        yield f"{mode.name:7} runs: commands/s {runs}; latency p50/p99 ms {lat}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--commands", type=int, default=3000, help="commands in the throughput part (default 3000)")
    parser.add_argument("--writers", type=int, default=24, help="concurrent writers (default 24)")
    parser.add_argument("--latency-commands", type=int, default=300, help="commands one by one (default 300)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each kind of group (default 3)")
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where the groups' data go (default: a temporary "
        "directory in the system's; it must be on the disk to measure, not a tmpfs)",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: 300 commands, 30 one by one, one run each")
    args = parser.parse_args(argv)
    if args.quick:
        args.commands, args.latency_commands, args.repeats = 300, 30, 1
    if min(args.commands, args.writers, args.latency_commands, args.repeats) < 1 or args.commands < args.writers:
        parser.error("every count must be positive, and --commands at least --writers")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    modes = {name: Mode(name) for name in MODES}
    with tempfile.TemporaryDirectory(prefix="georep-bench-metadata-", dir=args.dir) as tmp, FdatasyncCounter() as c:
        root = Path(tmp)
        for repeat in range(args.repeats):
            for name in MODES:
                progress(f"run {repeat + 1}/{args.repeats}: {name}")
                modes[name].runs.append(one_run(root / f"{name}-{repeat}", name == "after", args, c))
        for line in report(modes, args, root.parent):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
