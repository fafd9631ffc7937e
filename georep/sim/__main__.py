"""``python -m georep.sim``: replay one seed, or run a swarm of seeds and print a summary.

    python -m georep.sim --seed 1234 --topology ring5 [--steps K] [--no-consumers] [--groups] [--verbose]
    python -m georep.sim --seeds 0..999 [--topology NAME] [--steps K] [--no-consumers] [--groups]
    python -m georep.sim --seed 3 --topology ring5 --site-nodes 2 --silence-every-ms 400
    python -m georep.sim --cluster --seed 7 [--shape single3] [--verbose]
    python -m georep.sim --cluster --seeds 0..199 [--shape NAME]
    python -m georep.sim --geo-cluster --seed 7 [--topology triangle] [--steps K] [--verbose]
    python -m georep.sim --geo-cluster --seeds 0..199 [--topology NAME] [--steps K]

Without ``--topology``, a swarm gives seed ``s`` the topology
``TOPOLOGY_NAMES[s % len(TOPOLOGY_NAMES)]``, so it covers all of them. The exit
status is 1 when any run failed; each failure prints its replay command.

``--cluster`` runs the simulator of one site's segment cluster instead
(``georep/sim/cluster.py``); without ``--shape`` seed ``s`` gets the shape
``SHAPES[s % len(SHAPES)]``.

``--geo-cluster`` runs the multi-site simulator with one multi-node site
(``georep/sim/geo_cluster.py``); without ``--topology`` seed ``s`` gets
``GEO_CLUSTER_TOPOLOGIES[s % len(GEO_CLUSTER_TOPOLOGIES)]``, and ``--steps``
defaults to ``GEO_CLUSTER_STEPS``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TypedDict

from georep.sim.cluster import ClusterSimulationFailure, run_cluster_seed, swarm_shape
from georep.sim.cluster_model import SHAPES, ClusterCounts
from georep.sim.faults import FaultCounts
from georep.sim.geo_cluster import GEO_CLUSTER_STEPS, GEO_CLUSTER_TOPOLOGIES, GeoClusterCounts, run_geo_cluster_seed
from georep.sim.simulator import DEFAULT_STEPS, SimulationFailure, run_seed
from georep.sim.topologies import TOPOLOGY_NAMES, UnknownTopologyName


def swarm_topology(seed: int) -> str:
    return TOPOLOGY_NAMES[seed % len(TOPOLOGY_NAMES)]


def _seed_range(text: str) -> range:
    first, sep, last = text.partition("..")
    try:
        if not sep:
            raise ValueError
        a, b = int(first), int(last)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--seeds takes A..B (both included), for example 0..199; got {text!r}"
        ) from None
    if b < a:
        raise argparse.ArgumentTypeError(f"--seeds {text}: the last seed is before the first")
    return range(a, b + 1)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m georep.sim", description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--seed", type=int, help="replay one run")
    which.add_argument("--seeds", type=_seed_range, help="run a swarm of seeds A..B (both included)")
    parser.add_argument("--topology", help=f"one of {', '.join(TOPOLOGY_NAMES)}, or random-N")
    parser.add_argument(
        "--steps",
        type=int,
        help=f"events in the safety phase (default {DEFAULT_STEPS}, {GEO_CLUSTER_STEPS} with --geo-cluster)",
    )
    parser.add_argument(
        "--rebuild-p",
        type=float,
        default=0.0,
        help="chance that a crash also loses the disk (restart empty, new epoch); default 0",
    )
    parser.add_argument(
        "--no-consumers",
        action="store_true",
        help="no standalone consumers or commits (I5): producers and replication alone",
    )
    parser.add_argument(
        "--groups", action="store_true", help="add a consumer group whose members join at several sites (G1-G3)"
    )
    parser.add_argument(
        "--site-nodes", type=int, default=1, help="nodes per site, each answering pulls for the whole site (default 1)"
    )
    parser.add_argument(
        "--silence-every-ms",
        type=int,
        default=0,
        help="with --site-nodes 2 or more: mean virtual ms between two nodes going silent for good (default 0: never)",
    )
    parser.add_argument("--verbose", action="store_true", help="print every event (one run only)")
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="simulate one site's segment cluster (nodes, leaders, recovery, repair) instead",
    )
    parser.add_argument("--shape", choices=SHAPES, help="with --cluster: the run's shape (default: by seed)")
    parser.add_argument(
        "--geo-cluster",
        action="store_true",
        help="the multi-site simulator with one multi-node site (node kills, leader recovery)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.cluster and args.geo_cluster:
        parser.error("--cluster and --geo-cluster are two different simulators: pick one")
    if args.steps is None:
        args.steps = GEO_CLUSTER_STEPS if args.geo_cluster else DEFAULT_STEPS
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.geo_cluster:
        if args.shape:
            parser.error("--shape goes with --cluster")
        try:
            if args.seed is not None:
                return _geo_cluster_one(args.seed, args.topology or "triangle", args.steps, args.verbose)
            return _geo_cluster_swarm(args.seeds, args.topology, args.steps)
        except UnknownTopologyName as e:
            parser.error(str(e))
    if args.cluster:
        if args.seed is not None:
            return _cluster_one(args.seed, args.shape or swarm_shape(args.seed), args.verbose)
        return _cluster_swarm(args.seeds, args.shape)
    if args.shape:
        parser.error("--shape goes with --cluster")
    if args.site_nodes < 1 or args.silence_every_ms < 0:
        parser.error("--site-nodes must be at least 1 and --silence-every-ms at least 0")
    options = RunOptions(
        rebuild_p=args.rebuild_p,
        consumers=not args.no_consumers,
        groups=args.groups,
        site_nodes=args.site_nodes,
        silence_every_ms=args.silence_every_ms,
    )
    try:
        if args.seed is not None:
            return _one(args.seed, args.topology or "triangle", args.steps, args.verbose, options)
        return _swarm(args.seeds, args.topology, args.steps, options)
    except UnknownTopologyName as e:
        parser.error(str(e))
    return 2  # pragma: no cover


class RunOptions(TypedDict):
    """``run_seed``'s options from the command line."""

    rebuild_p: float
    consumers: bool
    groups: bool
    site_nodes: int
    silence_every_ms: int


def _one(seed: int, topology: str, steps: int, verbose: bool, options: RunOptions) -> int:
    started = time.perf_counter()
    try:
        result = run_seed(seed, topology, steps=steps, verbose=verbose, **options)
    except SimulationFailure as e:
        print(f"FAIL {e}", file=sys.stderr)
        return 1
    took = time.perf_counter() - started
    counts = " ".join(f"{k}={v}" for k, v in result.counts.as_dict().items() if v)
    print(
        f"ok seed={seed} topology={topology} events={result.events} virtual_ms={result.virtual_ms} "
        f"batches_checked={result.batches_checked} wall={took:.2f}s trace={result.trace[:16]}"
    )
    print(f"  {counts}")
    return 0


def _swarm(seeds: range, topology: str | None, steps: int, options: RunOptions) -> int:
    started = time.perf_counter()
    total = FaultCounts()
    failures: list[SimulationFailure] = []
    events = 0
    for seed in seeds:
        name = topology or swarm_topology(seed)
        try:
            result = run_seed(seed, name, steps=steps, **options)
        except SimulationFailure as e:
            failures.append(e)
            print(f"FAIL seed={seed} topology={name}: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
            continue
        total.add(result.counts)
        events += result.events
    return _summary("runs", len(seeds), failures, events, total.as_dict(), started)


def _cluster_one(seed: int, shape: str, verbose: bool) -> int:
    started = time.perf_counter()
    try:
        result = run_cluster_seed(seed, shape, verbose=verbose)
    except ClusterSimulationFailure as e:
        print(f"FAIL {e}", file=sys.stderr)
        return 1
    took = time.perf_counter() - started
    counts = " ".join(f"{k}={v}" for k, v in result.counts.as_dict().items() if v)
    print(
        f"ok seed={seed} shape={shape} events={result.events} virtual_ms={result.virtual_ms} "
        f"liveness_ms={result.liveness_ms} wall={took:.2f}s trace={result.trace[:16]}"
    )
    print(f"  {result.config}")
    print(f"  {counts}")
    return 0


def _cluster_swarm(seeds: range, shape: str | None) -> int:
    started = time.perf_counter()
    total = ClusterCounts()
    failures: list[ClusterSimulationFailure] = []
    events = 0
    for seed in seeds:
        name = shape or swarm_shape(seed)
        try:
            result = run_cluster_seed(seed, name)
        except ClusterSimulationFailure as e:
            failures.append(e)
            print(f"FAIL seed={seed} shape={name}: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
            continue
        total.add(result.counts)
        events += result.events
    return _summary("cluster runs", len(seeds), failures, events, total.as_dict(), started)


def _geo_cluster_one(seed: int, topology: str, steps: int, verbose: bool) -> int:
    started = time.perf_counter()
    try:
        result, cluster, geo = run_geo_cluster_seed(seed, topology, steps=steps, verbose=verbose)
    except SimulationFailure as e:
        print(f"FAIL {e}", file=sys.stderr)
        return 1
    took = time.perf_counter() - started
    print(
        f"ok seed={seed} topology={topology} events={result.events} virtual_ms={result.virtual_ms} "
        f"batches_checked={result.batches_checked} wall={took:.2f}s trace={result.trace[:16]}"
    )
    for counts in (result.counts.as_dict(), cluster.as_dict(), geo.as_dict()):
        print("  " + " ".join(f"{k}={v}" for k, v in counts.items() if v))
    return 0


def _geo_cluster_swarm(seeds: range, topology: str | None, steps: int) -> int:
    started = time.perf_counter()
    total, cluster, geo = FaultCounts(), ClusterCounts(), GeoClusterCounts()
    failures: list[SimulationFailure] = []
    events = 0
    for seed in seeds:
        name = topology or GEO_CLUSTER_TOPOLOGIES[seed % len(GEO_CLUSTER_TOPOLOGIES)]
        try:
            result, c, g = run_geo_cluster_seed(seed, name, steps=steps)
        except SimulationFailure as e:
            failures.append(e)
            print(f"FAIL seed={seed} topology={name}: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
            continue
        total.add(result.counts)
        cluster.add(c)
        geo.add(g)
        events += result.events
    counts = {**total.as_dict(), **{f"site_{k}": v for k, v in cluster.as_dict().items()}, **geo.as_dict()}
    return _summary("geo-cluster runs", len(seeds), failures, events, counts, started)


def _summary(
    what: str,
    runs: int,
    failures: Sequence[SimulationFailure | ClusterSimulationFailure],
    events: int,
    counts: Mapping[str, int],
    started: float,
) -> int:
    """The closing lines of a swarm: runs, failures, fault counts, and a replay command per failure."""
    took = time.perf_counter() - started
    print(f"{runs} {what}, {len(failures)} failed, {events} events, {took:.1f}s ({took / max(1, runs):.3f}s a run)")
    print("  " + " ".join(f"{k}={v}" for k, v in counts.items()))
    for failure in failures:
        print(f"  replay: {failure.replay}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
