"""``georep node``: the command line of one storage node (``georep/node/serve.py`` serves)."""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from georep.auth.acl import DEFAULT_SUPER_USERS
from georep.auth.principal import InvalidPrincipal, Principal, parse_principal
from georep.broker.acks import AckKind, Acks
from georep.cli.log_args import add_log_arguments, configure_logging
from georep.cli.topology_arg import load_topology
from georep.client.tls_args import TlsArgsError, node_tls
from georep.client.tls_args import add_node_arguments as add_node_tls_arguments
from georep.kafka.connections import (
    IDLE_MS_DEFAULT,
    MAX_CONNECTIONS_DEFAULT,
    MAX_CONNECTIONS_PER_IP_DEFAULT,
    ListenerLimits,
)
from georep.metadata.store import DataDirMismatch
from georep.metadata.topics import InvalidTopic, parse_topic_config
from georep.node.serve import SCRUB_BYTES_PER_S_DEFAULT, SCRUB_INTERVAL_MS_DEFAULT, InSiteOptions, UsageError, serve
from georep.raft.store import RaftTiming
from georep.replication.links import DEFAULT_STALL_MS
from georep.security.raft_secret import FLAG as RAFT_SECRET_FLAG
from georep.security.raft_secret import RaftSecretError, read_secret, secret_file_name
from georep.security.tls import ServerLimits, TlsError
from georep.server.broker import DEFAULT_TOPIC_CONFIG
from georep.server.cluster_member import ClusterConfig
from georep.server.digest_pacing import AUDIT_DIGEST_RATE_DEFAULT
from georep.server.shutdown import EXIT_FORCED, SHUTDOWN_TIMEOUT_MS_DEFAULT
from georep.storage.api import StorageError
from georep.storage.dirlock import DataDirLocked, DataDirUnusable
from georep.storage.handle_cache import DEFAULT_MAX_OPEN_FILES, InvalidMaxOpenFiles, set_max_open_files
from georep.storage.private import restrict_umask
from georep.storage.replica_store import ReplicaError
from topology.file import TopologyFileError
from topology.ids import InvalidSiteId
from topology.model import InvalidTopology, Topology, UnknownSite

if TYPE_CHECKING:
    from georep.kafka.server import KafkaOptions

log = logging.getLogger("georep.node")

IDLE_MS_MIN = 100


def parse_address(text: str, flag: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise UsageError(f"{flag} {text!r} is not HOST:PORT (for example 127.0.0.1:7101; port 0 picks a free port)")
    return host, int(port)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--site", required=True, help="site id, e.g. us-east")
    parser.add_argument(
        "--listen",
        default=None,
        help="gRPC address HOST:PORT (port 0: any free port; default 127.0.0.1:7101, or the node's address in the "
        "topology for a node of a multi-node site)",
    )
    add_log_arguments(parser)
    _add_cluster_arguments(parser)
    _add_storage_arguments(parser)
    _add_kafka_arguments(parser)
    add_listener_arguments(parser)
    parser.add_argument("--retention-check-ms", type=int, default=60_000, help="how often retention runs")
    parser.add_argument(
        "--shutdown-timeout-ms",
        type=int,
        default=SHUTDOWN_TIMEOUT_MS_DEFAULT,
        help="a stop (SIGTERM, Ctrl-C) that takes longer is forced: the node logs what had not finished and exits "
        f"with code {EXIT_FORCED}; so does a second SIGTERM or Ctrl-C (default {SHUTDOWN_TIMEOUT_MS_DEFAULT})",
    )
    parser.add_argument(
        "--topology",
        default=None,
        help="topology TOML file: sites, their nodes and the links this site pulls over; 'default' for the "
        "embedded 3-site topology (a, b, c on 127.0.0.1:7101/7201/7301). Without it the node runs "
        "standalone, with no links",
    )
    parser.add_argument(
        "--stall-ms",
        type=int,
        default=None,
        help=f"move an origin to another upstream after its preferred one stays behind this long "
        f"(default {DEFAULT_STALL_MS})",
    )
    parser.add_argument(
        "--admin-token-file",
        type=Path,
        default=None,
        help="file holding the admin token that admin calls (georep link cut/heal, drills) must present; "
        "without it only callers on this host may make them",
    )
    add_node_tls_arguments(parser)
    parser.add_argument(
        RAFT_SECRET_FLAG,
        type=Path,
        default=None,
        metavar="FILE",
        help="a node of a multi-node site: the site's Raft secret (raft-<site>.secret of 'georep certs init'), the "
        "same file on every node; it seals the Raft metadata port. Required with TLS; --insecure runs Raft plaintext",
    )
    parser.add_argument(
        "--super-user",
        action="append",
        type=_principal,
        default=None,
        metavar="PRINCIPAL",
        help="a principal allowed everything without ACL entries, besides the site's own nodes; repeat for "
        "several (default: client:admin; naming any replaces it)",
    )
    for key, value in DEFAULT_TOPIC_CONFIG.items():
        parser.add_argument(
            f"--{key.replace('_', '-')}", type=int, default=value, help=f"default topic {key} (default {value})"
        )


def _add_storage_arguments(parser: argparse.ArgumentParser) -> None:
    """The data directory, its scrubber and open files, and the metrics about it."""
    parser.add_argument("--data-dir", required=True, type=Path, help="where this node keeps its logs")
    parser.add_argument("--metrics-listen", default="127.0.0.1:0", help="/metrics address HOST:PORT")
    parser.add_argument(
        "--metrics-partition-detail",
        action="store_true",
        help="/metrics has series per partition (georep_partition_*), not only per topic (georep_topic_*): a "
        "series per partition and origin is too many for Prometheus at thousands of partitions",
    )
    parser.add_argument(
        "--audit-digest-rate",
        type=int,
        default=AUDIT_DIGEST_RATE_DEFAULT,
        help="how many stored batches per second this node digests for live audits (ScanDigests), shared by every "
        f"audit scan it serves, so that an audit does not starve produce (0: unbounded; default "
        f"{AUDIT_DIGEST_RATE_DEFAULT})",
    )
    parser.add_argument(
        "--scrub-bytes-per-s",
        type=int,
        default=SCRUB_BYTES_PER_S_DEFAULT,
        help="how fast the background scrubber re-checks stored batches, in bytes per second; damaged ones are "
        f"quarantined and repaired from a peer (0: off; default {SCRUB_BYTES_PER_S_DEFAULT})",
    )
    parser.add_argument(
        "--scrub-interval-ms",
        type=int,
        default=SCRUB_INTERVAL_MS_DEFAULT,
        help="the background scrubber checks every partition once per this long, a few at a time spread evenly "
        "over it, so damage nobody reads is found within about this long (longer only when the node holds more "
        f"than --scrub-bytes-per-s can read in it; default {SCRUB_INTERVAL_MS_DEFAULT}: an hour)",
    )
    parser.add_argument(
        "--max-open-files",
        type=int,
        default=DEFAULT_MAX_OPEN_FILES,
        help="how many segment files the node keeps open at most (one per segment used, its .log; index files "
        "open only while they are written or read); the "
        "least recently used segments close, fsynced first, and open again on their next use "
        f"(default {DEFAULT_MAX_OPEN_FILES}; keep it well below 'ulimit -n')",
    )


def _add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """A node of a multi-node site: its id, and the site's replication settings (docs/cluster.md)."""
    repair_delay_ms = ClusterConfig().repair_delay_ms
    parser.add_argument(
        "--node-id",
        type=int,
        default=None,
        help="this node's id in its site, for a site that lists several nodes in --topology (docs/cluster.md)",
    )
    parser.add_argument(
        "--replication-factor",
        type=int,
        default=None,
        help="multi-node sites: the nodes each new segment is written to (default: 3, or the site's node count if "
        "smaller)",
    )
    parser.add_argument(
        "--session-timeout-ms",
        type=int,
        default=None,
        help="multi-node sites: a node that has not heartbeated for this long is dead, and the partitions it led "
        "get new leaders (default 6000; it must exceed the clock skew between the site's nodes)",
    )
    parser.add_argument(
        "--min-insync-replicas",
        type=int,
        default=None,
        help="multi-node sites: the nodes that must hold a batch fsynced before acks=all (default: 2, or the "
        "replication factor if smaller)",
    )
    parser.add_argument(
        "--repair-delay-ms",
        type=int,
        default=None,
        help="multi-node sites: how long a dead node may stay down before the site copies its sealed segments to "
        f"other nodes (it may only be rebooting; BookKeeper's autorecovery waits likewise). Segments opened on fewer "
        f"nodes than the replication factor, and draining nodes' segments, are copied at once (default "
        f"{repair_delay_ms})",
    )


def _add_kafka_arguments(parser: argparse.ArgumentParser) -> None:
    """The Kafka wire protocol (docs/kafka.md)."""
    parser.add_argument(
        "--kafka-listen",
        default=None,
        metavar="HOST:PORT",
        help="also serve the Kafka wire protocol here, for unmodified Kafka clients (docs/kafka.md); off by default",
    )
    parser.add_argument(
        "--kafka-commit-acks",
        default=None,
        metavar="ACKS",
        help="ack level of the commits Kafka clients make: leader, all, or geo:N to wait until N sites hold each "
        "commit, so a group that fails over to another site resumes exactly at its last commit (default leader; "
        "all on a node of a multi-node site, --node-id)",
    )
    parser.add_argument(
        "--kafka-sasl",
        default=None,
        choices=["scram"],
        help="Kafka clients authenticate with SASL SCRAM-SHA-256/512 as client:<user> ('georep user add'): "
        "SASL_SSL on a TLS node, SASL_PLAINTEXT with --insecure (docs/kafka.md); off by default (mutual TLS)",
    )


def add_listener_arguments(parser: argparse.ArgumentParser) -> None:
    """The connection bounds of the node's gRPC and Kafka ports (docs/security.md, "Listener limits")."""
    grpc = ServerLimits()
    parser.add_argument(
        "--connections-max-idle-ms",
        type=int,
        default=IDLE_MS_DEFAULT,
        metavar="MS",
        help="close a connection of the gRPC or Kafka port that has had no request for this long (Kafka's "
        f"connections.max.idle.ms; a half-sent request does not count; clients reconnect; default {IDLE_MS_DEFAULT})",
    )
    parser.add_argument(
        "--grpc-max-connections",
        type=int,
        default=grpc.max_connections,
        metavar="N",
        help=f"connections the gRPC port takes at once; one more is closed at accept (default {grpc.max_connections})",
    )
    parser.add_argument(
        "--grpc-max-concurrent-streams",
        type=int,
        default=0,
        metavar="N",
        help="calls in flight on one gRPC connection; more wait in the client (default 0: no bound; georep's clients "
        "open a stream per partition they read)",
    )
    parser.add_argument(
        "--kafka-max-connections",
        type=int,
        default=None,
        metavar="N",
        help="connections the Kafka port takes at once; one more is closed at accept (Kafka's max.connections; "
        f"default {MAX_CONNECTIONS_DEFAULT})",
    )
    parser.add_argument(
        "--kafka-max-connections-per-ip",
        type=int,
        default=None,
        metavar="N",
        help="connections the Kafka port takes from one address (Kafka's max.connections.per.ip; 0: no bound; "
        f"default {MAX_CONNECTIONS_PER_IP_DEFAULT})",
    )


def main(args: argparse.Namespace) -> int:
    restrict_umask()  # what the node and its libraries (pysyncobj's journal) create: the owner's only
    configure_logging(args)
    try:
        metrics_listen = parse_address(args.metrics_listen, "--metrics-listen")
        defaults = topic_defaults(args)
        topology = None if args.topology is None else site_topology(args.topology, args.site)
        refuse_inapplicable(args, topology)
        in_site = None if topology is None else in_site_options(topology, args)
        if args.listen is not None:
            listen = parse_address(args.listen, "--listen")
        elif in_site is not None and topology is not None:
            listen = parse_address(topology.site(args.site).member(in_site.node_id).address, "the topology's address")
        else:
            listen = ("127.0.0.1", 7101)
        if args.shutdown_timeout_ms < 1:
            raise UsageError(f"--shutdown-timeout-ms {args.shutdown_timeout_ms} must be at least 1")
        if args.scrub_bytes_per_s < 0:
            raise UsageError(f"--scrub-bytes-per-s {args.scrub_bytes_per_s} must be 0 (off) or more")
        if args.audit_digest_rate < 0:
            raise UsageError(f"--audit-digest-rate {args.audit_digest_rate} must be 0 (unbounded) or more")
        if args.scrub_interval_ms < 1:
            raise UsageError(f"--scrub-interval-ms {args.scrub_interval_ms} must be at least 1")
        try:
            set_max_open_files(args.max_open_files)
        except InvalidMaxOpenFiles as exc:
            raise UsageError(str(exc)) from None
        stall_ms = DEFAULT_STALL_MS if args.stall_ms is None else args.stall_ms
        if stall_ms < 1:
            raise UsageError(f"--stall-ms {stall_ms} must be at least 1")
        admin_token = None if args.admin_token_file is None else read_admin_token(args.admin_token_file)
        try:
            tls = node_tls(args)
            if tls is not None:
                tls.check()
        except (TlsArgsError, TlsError) as exc:
            raise UsageError(str(exc)) from None
        if in_site is not None:
            in_site = replace(in_site, raft_secret=raft_secret(args.raft_secret_file, args.site, tls is not None))
        return asyncio.run(
            serve(
                args.site,
                listen,
                metrics_listen,
                args.data_dir,
                defaults,
                args.retention_check_ms,
                topology,
                stall_ms,
                admin_token,
                args.scrub_bytes_per_s,
                in_site,
                tls,
                kafka=kafka_options(args),
                super_users=tuple(args.super_user) if args.super_user else DEFAULT_SUPER_USERS,
                grpc_limits=grpc_limits(args),
                shutdown_timeout_ms=args.shutdown_timeout_ms,
                metrics_partition_detail=args.metrics_partition_detail,
                scrub_interval_ms=args.scrub_interval_ms,
                audit_digest_rate=args.audit_digest_rate,
            )
        )
    except (
        UsageError,
        DataDirMismatch,
        DataDirLocked,
        DataDirUnusable,
        InvalidSiteId,
        StorageError,
        ReplicaError,
    ) as exc:
        log.error("%s", exc)
        return 2


SESSION_TIMEOUT_MS_DEFAULT = 6_000
# Flags that only a node of a multi-node site uses: its segments are written to several nodes, under Raft.
MULTI_NODE_FLAGS = (
    "node_id",
    "replication_factor",
    "min_insync_replicas",
    "session_timeout_ms",
    "repair_delay_ms",
    "raft_secret_file",
)


def refuse_inapplicable(args: argparse.Namespace, topology: Topology | None) -> None:
    """Refuse a flag that cannot apply in the configuration the others give, saying why and what to do: a flag
    silently ignored lets an operator believe a node runs as it does not (``--node-id 2`` without a topology ran a
    one-node site)."""
    multi_node = topology is not None and len(topology.site(args.site).nodes) > 1
    for name in MULTI_NODE_FLAGS:
        value = getattr(args, name)
        if value is None or multi_node or (name == "node_id" and topology is not None):
            continue  # a one-node site's own id is checked with the topology (in_site_options)
        flag = f"--{name.replace('_', '-')}"
        if topology is None:
            why = "this node runs without --topology, so it is the only node of its site"
            fix = "pass --topology with a file that lists the site's nodes, or drop the flag"
        else:
            why = f"the topology lists one node for site {args.site!r}"
            fix = "list the site's nodes in the topology (docs/cluster.md), or drop the flag"
        raise UsageError(f"{flag} {value}: only a node of a multi-node site uses it, and {why}: {fix}")
    if args.stall_ms is not None and topology is None:
        raise UsageError(
            f"--stall-ms {args.stall_ms}: it times the failover between upstreams, and this node runs "
            "without --topology, so it pulls over no link: pass --topology, or drop the flag"
        )
    if args.kafka_listen is None:
        for name in ("kafka_commit_acks", "kafka_sasl", "kafka_max_connections", "kafka_max_connections_per_ip"):
            if getattr(args, name) is not None:
                raise UsageError(
                    f"--{name.replace('_', '-')} {getattr(args, name)}: it sets up the Kafka listener, "
                    "and the node has none: add --kafka-listen HOST:PORT, or drop the flag"
                )
    insecure = getattr(args, "insecure", False)
    if args.super_user and insecure:
        raise UsageError(
            "--super-user: a node started with --insecure authorizes no call, so no principal is "
            "checked: drop --super-user, or serve TLS to have principals and ACLs"
        )
    if args.admin_token_file is not None and not insecure:
        raise UsageError(
            f"--admin-token-file {args.admin_token_file}: a TLS node authorizes admin calls by the "
            "caller's principal (client:admin, or an admin ACL entry), never by a token: drop the flag "
            "(the token is for --insecure nodes)"
        )


def _principal(text: str) -> Principal:
    try:
        return parse_principal(text)
    except InvalidPrincipal as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def grpc_limits(args: argparse.Namespace) -> ServerLimits:
    """``--grpc-max-connections``, ``--grpc-max-concurrent-streams`` and ``--connections-max-idle-ms``."""
    if args.grpc_max_connections < 1:
        raise UsageError(f"--grpc-max-connections {args.grpc_max_connections}: use at least 1")
    if args.grpc_max_concurrent_streams < 0:
        raise UsageError(f"--grpc-max-concurrent-streams {args.grpc_max_concurrent_streams}: use 0 (no bound) or more")
    return ServerLimits(
        max_connections=args.grpc_max_connections,
        idle_ms=idle_ms(args),
        max_concurrent_streams=args.grpc_max_concurrent_streams,
    )


def idle_ms(args: argparse.Namespace) -> int:
    if args.connections_max_idle_ms < IDLE_MS_MIN:
        raise UsageError(f"--connections-max-idle-ms {args.connections_max_idle_ms}: use at least {IDLE_MS_MIN}")
    return int(args.connections_max_idle_ms)


def kafka_options(args: argparse.Namespace) -> KafkaOptions | None:
    """``--kafka-listen`` and the ``--kafka-*`` flags; None without a Kafka listener."""
    if args.kafka_listen is None:
        return None
    # A node of a multi-node site commits at its ack quorum by default (Kafka's offsets.commit.required.acks=-1):
    # a commit the coordinator alone held would be lost with its node, and the group would read it again.
    text = args.kafka_commit_acks or ("all" if getattr(args, "node_id", None) is not None else "leader")
    if text in ("leader", "all"):
        acks = Acks(AckKind(text))
    elif text.startswith("geo:") and text[4:].isdigit() and int(text[4:]) >= 1:
        acks = Acks.geo(int(text[4:]))
    else:
        raise UsageError(f"--kafka-commit-acks {text!r}: use leader, all or geo:N with N at least 1")
    from georep.kafka.server import KafkaOptions  # only with a Kafka listener: kafka-python is slow to import

    sasl = args.kafka_sasl == "scram"
    if sasl and getattr(args, "insecure", False):
        log.warning(
            "warning: --kafka-sasl with --insecure: SASL_PLAINTEXT; SCRAM keeps the password off the wire, "
            "but the records and the session are plaintext that anyone on the network path can read or "
            "take over: use TLS (SASL_SSL) outside tests"
        )
    return KafkaOptions(parse_address(args.kafka_listen, "--kafka-listen"), acks, sasl=sasl, limits=kafka_limits(args))


def kafka_limits(args: argparse.Namespace) -> ListenerLimits:
    """``--kafka-max-connections``, ``--kafka-max-connections-per-ip`` and ``--connections-max-idle-ms``."""
    most = MAX_CONNECTIONS_DEFAULT if args.kafka_max_connections is None else args.kafka_max_connections
    per_ip = (
        MAX_CONNECTIONS_PER_IP_DEFAULT
        if args.kafka_max_connections_per_ip is None
        else args.kafka_max_connections_per_ip
    )
    if most < 1:
        raise UsageError(f"--kafka-max-connections {most}: use at least 1")
    if per_ip < 0:
        raise UsageError(f"--kafka-max-connections-per-ip {per_ip}: use 0 (no bound) or more")
    return ListenerLimits(max_connections=most, max_connections_per_ip=per_ip, idle_ms=idle_ms(args))


def topic_defaults(args: argparse.Namespace) -> dict[str, int]:
    """The default topic config from the flags, with the same bounds as a topic's own config."""
    try:
        return parse_topic_config({key: str(getattr(args, key)) for key in DEFAULT_TOPIC_CONFIG})
    except InvalidTopic as exc:
        flag = str(exc).split("topic config ", 1)[-1].split("=", 1)[0].replace("_", "-")
        raise UsageError(f"--{flag}: {exc}") from None


def raft_secret(path: Path | None, site: str, tls: bool) -> bytes | None:
    """The Raft secret of a node of a multi-node site: read from ``path`` once; required with TLS."""
    if path is None:
        if tls:
            raise UsageError(
                f"site {site!r} has several nodes and this node runs TLS, so its Raft metadata port must be sealed "
                f"too: pass {RAFT_SECRET_FLAG} {secret_file_name(site)} (every node of the site the same file; "
                f"'georep certs init --dir DIR --nodes {site}=N' makes it next to the certificates), or --insecure "
                "to run plaintext"
            )
        return None
    try:
        return read_secret(path)
    except RaftSecretError as exc:
        raise UsageError(str(exc)) from None


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


def in_site_options(topology: Topology, args: argparse.Namespace) -> InSiteOptions | None:
    """A node of a multi-node site: its id, its Raft peers and the site's quorums; None for a one-node site."""
    site = topology.site(args.site)
    if len(site.nodes) == 1:
        if args.node_id not in (None, site.members[0].id):
            raise UsageError(f"--node-id {args.node_id}: site {args.site!r} has one node, id {site.members[0].id}")
        return None
    try:
        rafts = site.raft_addresses()
    except InvalidTopology as exc:
        raise UsageError(str(exc)) from None
    ids = ", ".join(str(m.id) for m in site.members)
    if args.node_id is None:
        raise UsageError(
            f"site {args.site!r} has {len(site.nodes)} nodes (ids {ids}): say which one this is with --node-id"
        )
    try:
        me = site.member(args.node_id)
    except InvalidTopology as exc:
        raise UsageError(str(exc)) from None
    rf = args.replication_factor if args.replication_factor is not None else min(3, len(site.nodes))
    if not 1 <= rf <= len(site.nodes):
        raise UsageError(
            f"--replication-factor {rf}: site {args.site!r} has {len(site.nodes)} nodes; use 1 to {len(site.nodes)}"
        )
    aq = args.min_insync_replicas if args.min_insync_replicas is not None else min(2, rf)
    if not 1 <= aq <= rf:
        raise UsageError(f"--min-insync-replicas {aq}: use 1 to the replication factor ({rf})")
    session_timeout_ms = SESSION_TIMEOUT_MS_DEFAULT if args.session_timeout_ms is None else args.session_timeout_ms
    if session_timeout_ms < 200:
        raise UsageError(f"--session-timeout-ms {session_timeout_ms}: use at least 200")
    repair_delay_ms = ClusterConfig().repair_delay_ms if args.repair_delay_ms is None else args.repair_delay_ms
    if repair_delay_ms < 0:
        raise UsageError(f"--repair-delay-ms {repair_delay_ms}: use 0 (copy at once) or more")
    assert me.raft is not None  # the topology requires it on every node of a multi-node site
    tick_ms = min(500, session_timeout_ms // 5)  # a few heartbeats per session, and as quick to react
    config = ClusterConfig(
        replication_factor=rf,
        ack_quorum=aq,
        session_timeout_ms=session_timeout_ms,
        tick_ms=tick_ms,
        retry_ms=tick_ms,
        segment_bytes=args.segment_bytes_max,
        repair_delay_ms=repair_delay_ms,
        retention_interval_ms=args.retention_check_ms,
        topic_defaults=topic_defaults(args),
    )
    return InSiteOptions(me.id, me.raft, tuple(rafts.values()), config, RaftTiming.for_session(session_timeout_ms))
