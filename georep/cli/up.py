"""``georep up``: run every node of a topology as a process on this machine.

It stays in the foreground. Ctrl-C or SIGTERM stops every node cleanly. Each
site's data lives under ``DATA_DIR/<site>/``, and each node writes its process
id and addresses to ``node.json`` there, which is how ``georep drill`` and the
tests find them. A node that dies (a drill's ``kill -9``, say) is reported and
left down: restarting sites is the operator's or the drill's decision.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

from georep.cli.admin_token import ensure_token
from georep.cli.topology_file import DEFAULT, TopologyFileError, load_topology
from georep.server.process import NODE_INFO, NodeProcess, NodeStartError
from topology.model import Topology, warnings

DEFAULT_DATA_DIR = Path(".georep")
POLL_S = 0.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--topology", type=Path, help="topology TOML file (default: sites a, b, c in a cycle)")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="DATA_DIR/<site>/ per site")
    parser.add_argument("node_args", nargs=argparse.REMAINDER,
                        help="after '--': extra 'georep node' flags for every node, e.g. -- --flush-interval-ms 100")


def site_processes(topology: Topology, topology_file: Path | None, data_dir: Path,
                   extra_args: list[str]) -> list[NodeProcess]:  # fmt: skip
    """One node process per site, as ``georep up`` starts them (not yet started)."""
    procs = []
    for sid in topology.site_ids():
        site = topology.site(sid)
        if len(site.nodes) != 1:
            raise TopologyFileError(
                f"site {sid} lists {len(site.nodes)} nodes; this version runs one node per site: list one address"
            )
        args = [*extra_args, "--topology", str(topology_file.resolve()) if topology_file else DEFAULT,
                "--admin-token-file", str(ensure_token(data_dir).resolve())]
        procs.append(NodeProcess(site=sid, data_dir=data_dir / sid, listen=site.nodes[0], extra_args=args))
    return procs


def stop_restarted(started: list[NodeProcess]) -> None:
    """SIGTERM nodes that something else (a drill) restarted in place of the ones 'up' started, so none outlives
    'up'. Only sites this 'up' started and whose process has ended: never another 'up's nodes."""
    for proc in started:
        if proc.alive():
            continue
        try:
            pid = int(json.loads((proc.data_dir / NODE_INFO).read_text())["pid"])
        except (OSError, ValueError, KeyError):
            continue
        if pid == proc.pid:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
            print(f"stopped site {proc.site}'s restarted node (pid {pid})", flush=True)


def main(args: argparse.Namespace) -> int:
    extra = [a for a in args.node_args if a != "--"]
    try:
        topology = load_topology(args.topology)
        procs = site_processes(topology, args.topology, args.data_dir, extra)
    except TopologyFileError as exc:
        print(f"georep: error: {exc}", file=sys.stderr)
        return 2
    for warning in warnings(topology):
        print(f"georep: warning: {warning}", file=sys.stderr)

    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    started: list[NodeProcess] = []
    try:
        for proc in procs:
            if stopping:
                break
            try:
                started.append(proc.start())
            except NodeStartError as exc:
                print(f"georep: error: {exc}", file=sys.stderr)
                return 1
        print(f"{'SITE':<8} {'ADDRESS':<22} {'METRICS':<22} {'PID':>8}  DATA")
        for proc in started:
            print(f"{proc.site:<8} {proc.address:<22} {proc.metrics_address:<22} {proc.pid:>8}  {proc.data_dir}")
        print("all sites up; Ctrl-C stops them", flush=True)
        reported: set[str] = set()
        while not stopping:
            time.sleep(POLL_S)
            for proc in started:
                if not proc.alive() and proc.site not in reported and proc.proc is not None:
                    code = proc.proc.returncode
                    print(f"georep: site {proc.site} (pid {proc.pid}) exited with {code}", file=sys.stderr, flush=True)
                    reported.add(proc.site)
        return 0
    finally:
        for proc in started:
            proc.stop()
        stop_restarted(started)
        if started:
            print("all sites stopped", flush=True)
