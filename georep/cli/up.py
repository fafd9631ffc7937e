"""``georep up``: run every node of a topology as a process on this machine.

It stays in the foreground. Ctrl-C or SIGTERM stops every node cleanly. Each
site's data lives under ``DATA_DIR/<site>/`` (a site of several nodes: one
``DATA_DIR/<site>/<node id>/`` per node), and each node writes its process id
and addresses to ``node.json`` there, which is how ``georep drill`` and the
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

from georep.auth.principal import node_principal, site_principal
from georep.cli.admin_token import ensure_token
from georep.cli.topology_arg import load_topology
from georep.client.tls_args import INSECURE_WARNING, certs_dir
from georep.security import dev_ca
from georep.security.raft_secret import secret_file_name
from georep.security.tls import TlsConfig, TlsError
from georep.server.process import NODE_INFO, NodeProcess, NodeStartError
from georep.storage.private import restrict_umask
from topology.file import DEFAULT, TopologyFileError
from topology.model import InvalidTopology, Topology, warnings

DEFAULT_DATA_DIR = Path(".georep")
POLL_S = 0.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--topology", type=Path, help="topology TOML file (default: sites a, b, c in a cycle)")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="DATA_DIR/<site>/ per site")
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="run the nodes plaintext, without TLS or ACLs (default: mutual TLS with the "
        "certificates in DATA_DIR/certs, made by 'georep certs init' if missing)",
    )
    parser.add_argument(
        "node_args",
        nargs=argparse.REMAINDER,
        help="after '--': extra 'georep node' flags for every node, e.g. -- --flush-interval-ms 100",
    )


def ensure_certs(topology: Topology, data_dir: Path) -> Path:
    """``DATA_DIR/certs``: a development CA and a certificate for every node of the topology and for
    ``client:admin`` (the commands' default), and a Raft secret per multi-node site, made where missing (``georep
    certs init``)."""
    directory = certs_dir(data_dir).resolve()  # absolute: node.json's restart command runs from anywhere
    dev_ca.init(directory, dev_ca.topology_plan(topology))
    return directory


def node_tls(directory: Path | None, site: str, node: int | None) -> TlsConfig | None:
    """A node's files in ``directory``: ``site:<s>`` for a one-node site, ``node:<s>/<n>`` for a node of several."""
    if directory is None:
        return None
    return TlsConfig.from_dir(directory, site_principal(site) if node is None else node_principal(site, node))


def site_processes(
    topology: Topology, topology_file: Path | None, data_dir: Path, extra_args: list[str], certs: Path | None = None
) -> list[NodeProcess]:
    """A node process per node of every site, as ``georep up`` starts them (not yet started); with mutual TLS
    from the certificates in ``certs`` (see :func:`ensure_certs`), plaintext without."""
    procs = []
    for sid in topology.site_ids():
        site = topology.site(sid)
        args = [*extra_args, "--topology", str(topology_file.resolve()) if topology_file else DEFAULT]
        if certs is None:  # a TLS node authorizes admin calls by principal, and refuses the flag
            args += ["--admin-token-file", str(ensure_token(data_dir).resolve())]
        fixed = topology_file is None
        commit_acks = kafka_args(len(topology.site_ids()), extra_args)
        if len(site.nodes) == 1:
            member = site.members[0]
            listen = (
                ["--kafka-listen", member.kafka]
                if member.kafka and "--kafka-listen" not in extra_args
                else kafka_listen(site.nodes[0], extra_args, fixed)
            )
            procs.append(
                NodeProcess(
                    site=sid,
                    data_dir=data_dir / sid,
                    listen=site.nodes[0],
                    extra_args=[*args, *listen, *commit_acks],
                    tls=node_tls(certs, sid, None),
                )
            )
            continue
        try:
            site.raft_addresses()
        except InvalidTopology as exc:
            raise TopologyFileError(str(exc)) from None
        # with TLS, the site's Raft port is sealed with its secret too (docs/security.md)
        secret = [] if certs is None else ["--raft-secret-file", str(certs / secret_file_name(sid))]
        for member in site.members:
            # Each node serves Kafka clients at its topology address, which the others name in Metadata
            listen = ["--kafka-listen", member.kafka] if member.kafka and "--kafka-listen" not in extra_args else []
            kafka = [*listen, *commit_acks] if listen or "--kafka-listen" in extra_args else []
            procs.append(
                NodeProcess(
                    site=sid,
                    data_dir=data_dir / sid / str(member.id),
                    listen=member.address,
                    extra_args=[*args, *secret, "--node-id", str(member.id), *kafka],
                    node_id=member.id,
                    tls=node_tls(certs, sid, member.id),
                )
            )
    return procs


KAFKA_PORT_OFFSET = 2000  # a node at HOST:7101 serves Kafka clients at HOST:9101 (docs/kafka.md)


def kafka_listen(address: str, extra_args: list[str], fixed: bool) -> list[str]:
    """``--kafka-listen`` for a node at ``address``: with ``fixed`` (the embedded default topology) its port plus
    :data:`KAFKA_PORT_OFFSET`, otherwise any free port (named in its node.json, and by 'georep up' and
    'georep status'); none if the flags given after ``--`` set one."""
    if "--kafka-listen" in extra_args:
        return []
    host, _, port = address.rpartition(":")
    return ["--kafka-listen", f"{host}:{int(port) + KAFKA_PORT_OFFSET if fixed and int(port) else 0}"]


def kafka_warnings(topology: Topology) -> list[str]:
    """Multi-node sites whose nodes name no Kafka address: 'georep up' starts no Kafka listener on them."""
    return [
        f'site {sid}\'s nodes have no kafka = "HOST:PORT" in the topology, so they serve no Kafka clients; add '
        f"one to every node of the site (docs/kafka.md)"
        for sid in topology.site_ids()
        if len(topology.site(sid).members) > 1 and not topology.site(sid).kafka_addresses()
    ]


def kafka_args(sites: int, extra_args: list[str]) -> list[str]:
    """Kafka clients' commits wait until two sites hold them (``georep drill --client kafka`` checks the
    failover that buys), unless the flags after ``--`` say otherwise or there is one site."""
    if "--kafka-commit-acks" in extra_args or sites < 2:
        return []
    return ["--kafka-commit-acks", "geo:2"]


def stop_all(launched: list[NodeProcess]) -> None:
    """SIGTERM to every node first, then wait for each: the nodes stop together. One at a time, each waited for
    the streams and calls its running peers still held (three sites of three nodes took 31 s to stop, 0.4 s now)."""
    for proc in launched:
        if proc.alive() and proc.proc is not None:
            proc.proc.terminate()
    for proc in launched:
        proc.stop()


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
    restrict_umask()  # the data dirs, certificates, token and logs it makes: the owner's only
    extra = [a for a in args.node_args if a != "--"]
    try:
        topology = load_topology(args.topology)
        certs = None if args.insecure else ensure_certs(topology, args.data_dir)
        procs = site_processes(topology, args.topology, args.data_dir, extra, certs)
    except TopologyFileError as exc:
        print(f"georep: error: {exc}", file=sys.stderr)
        return 2
    except (TlsError, OSError) as exc:
        print(f"georep: error: cannot make the certificates in {certs_dir(args.data_dir)}: {exc}", file=sys.stderr)
        return 1
    if certs is None:
        print(f"georep: {INSECURE_WARNING}", file=sys.stderr)
    else:
        print(f"mutual TLS: certificates in {certs}/ (commands find them there with --data-dir {args.data_dir})")
    for warning in [*warnings(topology), *kafka_warnings(topology)]:
        print(f"georep: warning: {warning}", file=sys.stderr)

    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    launched: list[NodeProcess] = []
    started: list[NodeProcess] = []  # those that served: only their data dirs are this 'up's
    try:
        # Every process first: a node of a multi-node site serves only once a majority of its site's nodes runs.
        for proc in procs:
            if stopping:
                break
            launched.append(proc.launch())
        print(f"starting {len(launched)} node(s); each is listed once it serves", flush=True)
        print(f"{'SITE':<8} {'NODE':>4} {'ADDRESS':<22} {'KAFKA':<22} {'METRICS':<22} {'PID':>8}  DATA", flush=True)
        for proc in launched:
            try:
                started.append(proc.wait_ready())
            except NodeStartError as exc:
                print(f"georep: error: {exc}", file=sys.stderr)
                return 1
            print(
                f"{proc.site:<8} {proc.node_id or 1:>4} {proc.address:<22} {proc.kafka_address or '-':<22} "
                f"{proc.metrics_address:<22} {proc.pid:>8}  {proc.data_dir}",
                flush=True,
            )
        print("all sites up; Ctrl-C stops them", flush=True)
        reported: set[Path] = set()
        while not stopping:
            time.sleep(POLL_S)
            for proc in started:
                if not proc.alive() and proc.data_dir not in reported and proc.proc is not None:
                    code = proc.proc.returncode
                    which = f"site {proc.site}" + (f" node {proc.node_id}" if proc.node_id else "")
                    print(f"georep: {which} (pid {proc.pid}) exited with {code}", file=sys.stderr, flush=True)
                    reported.add(proc.data_dir)
        return 0
    finally:
        stop_all(launched)
        stop_restarted(started)
        if started:
            print("all sites stopped", flush=True)
