"""``georep node``: one storage node of one site, as a process.

Wires the broker, the gRPC service and ``/metrics``, runs the background
fsync and retention loops, and shuts down cleanly on SIGTERM or Ctrl-C
(stop accepting calls, fsync every log, write recovery points).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path

import grpc

from cluster.metadata import DataDirMismatch, load_or_create_identity, write_json_atomic
from georep import __version__
from georep.server.broker import DEFAULT_TOPIC_CONFIG, Broker
from georep.server.metrics import NodeMetrics
from georep.server.process import NODE_INFO
from georep.server.service import FETCH_MAX_BYTES_CAP, NodeService
from georep.topology_file import TopologyFileError, load_topology
from topology.ids import InvalidSiteId
from topology.links import DEFAULT_STALL_MS
from topology.model import Topology, UnknownSite

log = logging.getLogger("georep.node")

SHUTDOWN_GRACE_S = 5.0
MESSAGE_SLACK_BYTES = 1 << 20
KEEPALIVE_MIN_INTERVAL_MS = 1_000
GROUP_TICK_S = 0.2


class UsageError(Exception):
    pass


def parse_address(text: str, flag: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise UsageError(f"{flag} {text!r} is not HOST:PORT (for example 127.0.0.1:7101; port 0 picks a free port)")
    return host, int(port)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--site", required=True, help="site id, e.g. us-east")
    parser.add_argument("--listen", default="127.0.0.1:7101", help="gRPC address HOST:PORT (port 0: any free port)")
    parser.add_argument("--data-dir", required=True, type=Path, help="where this node keeps its logs")
    parser.add_argument("--metrics-listen", default="127.0.0.1:0", help="/metrics address HOST:PORT")
    parser.add_argument("--retention-check-ms", type=int, default=60_000, help="how often retention runs")
    parser.add_argument(
        "--topology", default=None,
        help="topology TOML file: sites, their nodes and the links this site pulls over; 'default' for the "
        "embedded 3-site topology (a, b, c on 127.0.0.1:7101/7201/7301). Without it the node runs "
        "standalone, with no links",
    )  # fmt: skip
    parser.add_argument(
        "--stall-ms", type=int, default=DEFAULT_STALL_MS,
        help=f"move an origin to another upstream after its preferred one stays behind this long "
        f"(default {DEFAULT_STALL_MS})",
    )  # fmt: skip
    parser.add_argument(
        "--admin-token-file", type=Path, default=None,
        help="file holding the admin token that admin calls (georep link cut/heal, drills) must present; "
        "without it only callers on this host may make them",
    )  # fmt: skip
    for key, value in DEFAULT_TOPIC_CONFIG.items():
        parser.add_argument(
            f"--{key.replace('_', '-')}", type=int, default=value, help=f"default topic {key} (default {value})"
        )


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        listen = parse_address(args.listen, "--listen")
        metrics_listen = parse_address(args.metrics_listen, "--metrics-listen")
        defaults = {key: getattr(args, key) for key in DEFAULT_TOPIC_CONFIG}
        topology = None if args.topology is None else site_topology(args.topology, args.site)
        if args.stall_ms < 1:
            raise UsageError(f"--stall-ms {args.stall_ms} must be at least 1")
        admin_token = None if args.admin_token_file is None else read_admin_token(args.admin_token_file)
        return asyncio.run(
            serve(args.site, listen, metrics_listen, args.data_dir, defaults, args.retention_check_ms,
                  topology, args.stall_ms, admin_token)  # fmt: skip
        )
    except (UsageError, DataDirMismatch, InvalidSiteId) as exc:
        log.error("%s", exc)
        return 2


def read_admin_token(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise UsageError(f"--admin-token-file {path}: {exc.strerror or exc}") from None
    if len(token) < 16 or not token.isprintable():
        raise UsageError(f"--admin-token-file {path}: the token must be at least 16 printable characters")
    return token


def site_topology(spec: str, site: str) -> Topology:
    """The topology ``spec`` names; ``site`` must be one of its sites."""
    try:
        topology = load_topology(spec)
    except TopologyFileError as exc:
        raise UsageError(f"--topology: {exc}") from None
    try:
        topology.site(site)
    except UnknownSite:
        raise UsageError(
            f"site {site!r} is not in topology {spec} (sites: {', '.join(topology.site_ids())}): "
            "pass --site with one of them, or --topology with a file that defines this site"
        ) from None
    return topology


async def serve(
    site: str,
    listen: tuple[str, int],
    metrics_listen: tuple[str, int],
    data_dir: Path,
    defaults: dict[str, int],
    retention_check_ms: int,
    topology: Topology | None = None,
    stall_ms: int = DEFAULT_STALL_MS,
    admin_token: str | None = None,
) -> int:
    from georep.replication.puller import Replicator

    data_dir.mkdir(parents=True, exist_ok=True)
    identity = load_or_create_identity(data_dir, site, int(time.time()))
    broker = Broker(data_dir, identity, defaults)
    metrics = NodeMetrics(broker)
    replicator = Replicator(broker, topology, site, stall_ms) if topology is not None else None
    if replicator is not None:
        metrics.attach(replicator)
    service = NodeService(broker, metrics, replicator, admin_token)
    max_message = max(defaults["max_batch_bytes"], FETCH_MAX_BYTES_CAP) + MESSAGE_SLACK_BYTES
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", max_message),
            ("grpc.max_send_message_length", max_message),
            ("grpc.so_reuseport", 0),  # a second node on the same port must fail, not share it
            # Clients ping every 10 s, even between calls, to notice a dead node
            # under a long-poll fetch. gRPC servers by default answer pings more
            # often than every 5 min with GOAWAY "too_many_pings".
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MIN_INTERVAL_MS),
        ]
    )
    server.add_generic_rpc_handlers((service.handler(),))
    address = f"{listen[0]}:{listen[1]}"
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:
        broker.close()
        raise UsageError(f"cannot listen on {address}: {exc}; is another process using the port?") from None
    if port == 0:
        broker.close()
        raise UsageError(f"cannot listen on {address}: the port is in use or the address is not local")
    await server.start()
    metrics_address = metrics.serve(*metrics_listen)
    info = {
        "pid": os.getpid(), "site": identity.site, "epoch": identity.epoch, "version": __version__,
        "listen": f"{listen[0]}:{port}", "metrics": metrics_address,
        # how to start this node again the same way (georep drill restarts a killed site)
        "command": [sys.executable, "-m", "georep.cli", *sys.argv[1:]], "cwd": os.getcwd(),
    }  # fmt: skip
    write_json_atomic(data_dir / NODE_INFO, info)
    log.info("site %s (origin %s) serving on %s, metrics on %s", identity.site, broker.origin, info["listen"],
             metrics_address)  # fmt: skip

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    housekeeping = [
        asyncio.create_task(_flush_loop(broker)),
        asyncio.create_task(_retention_loop(broker, retention_check_ms / 1000)),
        asyncio.create_task(_group_loop(service)),
    ]
    if replicator is not None:
        replicator.start()
        log.info("pulling from %s", ", ".join(f"{p.src} ({p.address})" for p in replicator.pullers.values())
                 or "no site: no link leads here")  # fmt: skip
    await stop.wait()
    log.info("shutting down")
    if replicator is not None:
        await replicator.stop()
    service.stop_streams()
    for task in housekeeping:
        task.cancel()
    await server.stop(SHUTDOWN_GRACE_S)
    broker.close()
    (data_dir / NODE_INFO).unlink(missing_ok=True)
    log.info("stopped cleanly")
    return 0


async def _flush_loop(broker: Broker) -> None:
    """fsync partitions whose topics flush on an interval rather than per batch."""
    while True:
        intervals = [p.config["flush_interval_ms"] for p in broker.partitions.values()]
        due = [i for i in intervals if i > 0]
        await asyncio.sleep(min(due, default=1000) / 1000)
        await broker.flush_due(int(time.monotonic() * 1000))


async def _group_loop(service: NodeService) -> None:
    """Expire consumer group members whose session timed out."""
    while True:
        await asyncio.sleep(GROUP_TICK_S)
        service.groups.expire()


async def _retention_loop(broker: Broker, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        deleted = broker.enforce_retention()
        if deleted:
            log.info("retention deleted %d segments", deleted)

