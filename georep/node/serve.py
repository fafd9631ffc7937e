"""``georep node``: one storage node of one site, as a process.

Wires the broker, the gRPC service and ``/metrics``, runs the background
fsync and retention loops, and shuts down cleanly on SIGTERM or Ctrl-C
(stop accepting calls, fsync every log, write recovery points).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from cluster.site_state import InitSite, Refused
from georep import __version__
from georep.auth.acl import DEFAULT_SUPER_USERS
from georep.auth.acl_sync import AclCache
from georep.auth.policy import Policy
from georep.auth.principal import Principal
from georep.metadata.store import SiteIdentity
from georep.metadata.topics import InvalidTopic, parse_topic_config
from georep.node.gc_pauses import GcPauses
from georep.raft.store import MetadataUnavailable, RaftMetadataStore, RaftStartError, RaftTiming, join_running_group
from georep.replication.links import DEFAULT_STALL_MS
from georep.security.tls import MESSAGE_BYTES_MAX, ServerLimits, TlsConfig, TlsError, add_port, server_options
from georep.server import retention_run
from georep.server.broker import Broker
from georep.server.cluster_member import ClusterConfig, ClusterMember
from georep.server.delete_gate import DeleteGate, health_ask
from georep.server.digest_pacing import AUDIT_DIGEST_RATE_DEFAULT
from georep.server.metrics import NodeMetrics
from georep.server.process import NODE_INFO
from georep.server.rpc import authorization
from georep.server.scrubber import BackgroundScrub
from georep.server.segments import SegmentService
from georep.server.service import FETCH_MAX_BYTES_CAP, SCRUB_STEP_BYTES, NodeService
from georep.server.shutdown import SHUTDOWN_TIMEOUT_MS_DEFAULT, STEP_TIMEOUT_S, Shutdown
from georep.server.site_cluster import SiteCluster
from georep.server.topic_removal import TopicRemoval
from georep.storage.dirlock import DataDirLock
from georep.storage.metadata_file import load_or_create_identity, write_json_atomic
from georep.storage.private import tighten
from georep.storage.replica_store import ReplicaStore
from topology.ids import NodeId, site_id
from topology.model import Topology

if TYPE_CHECKING:  # kafka-python costs a node without a Kafka listener a tenth of a second of CPU at start
    from georep.kafka.server import KafkaOptions, KafkaServer
    from georep.server.replicator import Replicator

log = logging.getLogger("georep.node")

SHUTDOWN_GRACE_S = 5.0
# Tests only (tests/test_shutdown.py): the stop finds an fsync thread that never returns, as on a disk that hangs.
STUCK_FSYNC_ENV = "GEOREP_TEST_STUCK_FSYNC_AT_STOP"
KEEPALIVE_MIN_INTERVAL_MS = 1_000
GROUP_TICK_S = 0.2
SCRUB_BYTES_PER_S_DEFAULT = 8 << 20
SCRUB_INTERVAL_MS_DEFAULT = 3_600_000  # one pass over every partition per hour, spread evenly over it


class UsageError(Exception):
    """A flag or setting the node cannot run with; the message says which and what to do."""


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
    scrub_bytes_per_s: int = SCRUB_BYTES_PER_S_DEFAULT,
    in_site: InSiteOptions | None = None,
    tls: TlsConfig | None = None,
    kafka: KafkaOptions | None = None,
    super_users: tuple[Principal, ...] = DEFAULT_SUPER_USERS,
    grpc_limits: ServerLimits | None = None,
    shutdown_timeout_ms: int = SHUTDOWN_TIMEOUT_MS_DEFAULT,
    metrics_partition_detail: bool = False,
    scrub_interval_ms: int = SCRUB_INTERVAL_MS_DEFAULT,
    audit_digest_rate: int = AUDIT_DIGEST_RATE_DEFAULT,
) -> int:
    """Serve until SIGTERM or SIGINT; raises ``UsageError``, ``DataDirLocked`` or ``DataDirUnusable``.

    The stop is bounded (``georep/server/shutdown.py``): a second SIGTERM or SIGINT, or ``shutdown_timeout_ms``,
    ends the process with ``EXIT_FORCED`` and a log line naming what had not finished.

    ``in_site``: this node is one of several of its site (docs/cluster.md): the site's metadata is a Raft group of
    its nodes, and the node serves the partitions it leads. ``tls``: its port takes only mutual-TLS clients with a
    certificate signed by the CA, and it calls the other nodes and sites with its own certificate; ``None`` is
    plaintext (``--insecure``), where no call is authorized (docs/security.md). ``super_users``: the principals a
    TLS node allows everything besides its own site's nodes (``georep node --super-user``). ``grpc_limits``: the
    gRPC port's connection bounds (``--grpc-max-connections``...; None: the defaults). ``metrics_partition_detail``:
    /metrics has a series per partition (``--metrics-partition-detail``), not only per topic.
    ``scrub_interval_ms``: the background scrubber checks every partition once per that long
    (``--scrub-interval-ms``), at ``scrub_bytes_per_s``. ``audit_digest_rate``: the batches per second all of the
    node's digest scans (the live audit's ``ScanDigests``) share, 0 unbounded (``--audit-digest-rate``).
    """
    if topology is not None:
        check_auto_create(topology, site)  # before anything starts
        check_interest_links(topology, site)
    lock = DataDirLock.acquire(data_dir, f"{listen[0]}:{listen[1]}")  # before anything in the directory is read
    try:
        tightened = tighten(data_dir)
        if tightened:
            log.warning("%s", tightened.describe(data_dir))
        return await _serve_locked(
            site,
            listen,
            metrics_listen,
            data_dir,
            defaults,
            retention_check_ms,
            topology,
            stall_ms,
            admin_token,
            scrub_bytes_per_s,
            lock,
            in_site,
            tls,
            kafka,
            super_users,
            grpc_limits,
            shutdown_timeout_ms,
            metrics_partition_detail,
            scrub_interval_ms,
            audit_digest_rate,
        )
    finally:
        lock.release()


@dataclass(frozen=True, slots=True)
class InSiteOptions:
    """What a node of a multi-node site needs besides a one-node site's settings."""

    node_id: NodeId
    raft_address: str  # this node's Raft replica
    raft_peers: tuple[str, ...]  # every node's Raft address (this one's may be among them)
    config: ClusterConfig
    raft_timing: RaftTiming | None = None
    raft_secret: bytes | None = None  # seals the Raft port (georep.security.raft_secret); None: plaintext


async def _site_identity(metadata: RaftMetadataStore, site: str, executor: ThreadPoolExecutor) -> SiteIdentity:
    """The site's origin, agreed in its Raft metadata (``InitSite``): waits until a majority of its nodes answers."""
    loop = asyncio.get_running_loop()
    waited = False
    while True:
        try:
            result = await loop.run_in_executor(executor, metadata.propose, InitSite(site, int(time.time())))
        except MetadataUnavailable as exc:
            if not waited:
                log.warning(
                    "waiting for a majority of site %s's nodes to agree on its metadata: %s. If they run, "
                    "check that every node has the same --raft-secret-file (a node with another is refused)",
                    site,
                    exc,
                )
            waited = True
            continue
        if isinstance(result, Refused):
            raise UsageError(result.reason)
        found = metadata.state().site()
        if found is not None:
            return SiteIdentity(site_id(found[0]), found[1])


@dataclass(slots=True)
class _Node:
    """A node's services, wired (``_wire``) but not yet serving; ``close`` fsyncs and closes what holds files."""

    identity: SiteIdentity
    metadata: RaftMetadataStore | None
    segment_executor: ThreadPoolExecutor
    broker: Broker
    metrics: NodeMetrics
    replicator: Replicator | None
    replicas: ReplicaStore
    member: ClusterMember | None
    site_cluster: SiteCluster | None
    service: NodeService
    segments: SegmentService
    delete_gate: DeleteGate | None = None  # a site with links deletes a topic only once every linked site checks

    def close(self) -> None:
        self.replicas.close()
        self.broker.close()
        if self.metadata is not None:
            self.metadata.close()


async def _serve_locked(
    site: str,
    listen: tuple[str, int],
    metrics_listen: tuple[str, int],
    data_dir: Path,
    defaults: dict[str, int],
    retention_check_ms: int,
    topology: Topology | None,
    stall_ms: int,
    admin_token: str | None,
    scrub_bytes_per_s: int,
    lock: DataDirLock,
    in_site: InSiteOptions | None,
    tls: TlsConfig | None,
    kafka: KafkaOptions | None = None,
    super_users: tuple[Principal, ...] = DEFAULT_SUPER_USERS,
    grpc_limits: ServerLimits | None = None,
    shutdown_timeout_ms: int = SHUTDOWN_TIMEOUT_MS_DEFAULT,
    metrics_partition_detail: bool = False,
    scrub_interval_ms: int = SCRUB_INTERVAL_MS_DEFAULT,
    audit_digest_rate: int = AUDIT_DIGEST_RATE_DEFAULT,
) -> int:
    # The Raft metadata and the segment threads of a multi-node site; this node's copies of the segments whose
    # ensembles it is a member of (docs/cluster.md).
    segment_executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="segments")
    metadata, identity = await _site_metadata(site, data_dir, in_site, segment_executor)
    node = _wire(
        site,
        listen,
        data_dir,
        defaults,
        topology,
        stall_ms,
        admin_token,
        in_site,
        tls,
        identity,
        metadata,
        segment_executor,
        audit_digest_rate,
    )
    server = _grpc_server(node, topology, tls, super_users, grpc_limits)
    port = await _start_grpc(server, f"{listen[0]}:{listen[1]}", tls, node)
    kafka_server, kafka_address = await _start_kafka(kafka, site, topology, in_site, tls, super_users, server, node)
    if node.member is not None:
        await node.member.start()
    node.metrics.partition_detail = metrics_partition_detail
    metrics_address = node.metrics.serve(*metrics_listen)
    info = {
        "pid": os.getpid(),
        "site": identity.site,
        "epoch": identity.epoch,
        "version": __version__,
        "listen": f"{listen[0]}:{port}",
        "metrics": metrics_address,
        "kafka": kafka_address,
        # how to start this node again the same way (georep drill restarts a killed site)
        "command": [sys.executable, "-m", "georep.cli", *sys.argv[1:]],
        "cwd": os.getcwd(),
    }
    # A stop asked for once node.json says the node serves is a clean stop: the handlers come first.
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    _warn_insecure(tls, in_site, str(info["listen"]))
    log.info(
        "site %s (origin %s) serving on %s, metrics on %s",
        identity.site,
        node.broker.origin,
        info["listen"],
        metrics_address,
    )
    lock.describe(str(info["listen"]))
    write_json_atomic(data_dir / NODE_INFO, info)  # last: whoever waits for it finds the warnings logged
    housekeeping = _start_housekeeping(node, scrub_bytes_per_s, scrub_interval_ms, retention_check_ms)
    await stop.wait()
    await _shut_down(node, server, kafka_server, housekeeping, shutdown_timeout_ms, data_dir / NODE_INFO)
    log.info("stopped cleanly")
    return 0


async def _site_metadata(
    site: str, data_dir: Path, in_site: InSiteOptions | None, segment_executor: ThreadPoolExecutor
) -> tuple[RaftMetadataStore | None, SiteIdentity]:
    """A multi-node site's Raft metadata (None for a one-node site) and the site's identity."""
    if in_site is None:
        return None, load_or_create_identity(data_dir, site, int(time.time()))
    try:
        # A node new to a running site is added to its Raft group first (docs/cluster.md, "Expansion"); the
        # store itself must be built in this thread (pysyncobj's tick thread stops with the thread that built it)
        partners = await asyncio.get_running_loop().run_in_executor(
            segment_executor,
            functools.partial(
                join_running_group, in_site.raft_address, in_site.raft_peers, data_dir, password=in_site.raft_secret
            ),
        )
        metadata = RaftMetadataStore(in_site.raft_address, partners, data_dir, in_site.raft_timing, in_site.raft_secret)
    except RaftStartError as exc:
        segment_executor.shutdown()
        raise UsageError(str(exc)) from None
    return metadata, await _site_identity(metadata, site, segment_executor)


def _wire(
    site: str,
    listen: tuple[str, int],
    data_dir: Path,
    defaults: dict[str, int],
    topology: Topology | None,
    stall_ms: int,
    admin_token: str | None,
    in_site: InSiteOptions | None,
    tls: TlsConfig | None,
    identity: SiteIdentity,
    metadata: RaftMetadataStore | None,
    segment_executor: ThreadPoolExecutor,
    audit_digest_rate: int = AUDIT_DIGEST_RATE_DEFAULT,
) -> _Node:
    """The broker and the services over it: the replicator, the segment member of a multi-node site, the gRPC
    services."""
    from georep.server.replicator import Replicator

    broker = Broker(data_dir, identity, defaults, metadata=metadata)
    metrics = NodeMetrics(broker)
    replicator = Replicator(broker, topology, site, stall_ms, tls=tls) if topology is not None else None
    if replicator is not None:
        metrics.attach(replicator)
    replicas = ReplicaStore(data_dir, broker.clock_ms())
    site_cluster: SiteCluster | None = None
    member: ClusterMember | None = None
    if in_site is not None and metadata is not None:
        address = f"{listen[0]}:{listen[1]}"
        member = ClusterMember(
            in_site.node_id,
            address,
            metadata,
            replicas,
            segment_executor,
            broker.clock_ms,
            lambda: shutil.disk_usage(data_dir).free,
            in_site.config,
            tls,
        )
        member.forget_topic = metrics.forget_topic
        site_cluster = SiteCluster(broker, member, metadata, replicas, segment_executor, tls)
        metrics.attach_cluster(site_cluster)
    service = NodeService(
        broker,
        metrics,
        replicator,
        admin_token,
        site_cluster,
        authorizes=tls is not None,
        audit_digest_rate=audit_digest_rate,
    )
    # Delete's data path: the topic changes the replicator's sync and the node's calls share remove its partitions.
    service.topic_calls.changes.on_deleted = TopicRemoval(broker, metrics.forget_topic, metrics.delete_records)
    segments = SegmentService(replicas, segment_executor, broker.clock_ms, member, tls)  # member: repair's rolls
    segments.digests = service.digests
    if topology is not None:
        service.auto_create.rules = topology.site(site).auto_create  # checked at the start (check_auto_create)
    gate = DeleteGate(topology, site, data_dir, health_ask(tls)) if topology is not None else None
    if gate is not None:
        service.topic_calls.delete_refused = gate.refusal
    return _Node(
        identity,
        metadata,
        segment_executor,
        broker,
        metrics,
        replicator,
        replicas,
        member,
        site_cluster,
        service,
        segments,
        gate,
    )


def check_interest_links(topology: Topology, site: str) -> None:
    """Links in mode "interest" join one-node sites only, for now: a multi-node site's readers are spread over its
    nodes, and no node sums them yet."""
    for li in topology.links:
        several = [s for s in (li.src, li.dst) if len(topology.site(s).nodes) > 1]
        if li.mode == "interest" and site in (li.src, li.dst) and several:
            raise UsageError(
                f'--topology: link {li.describe()} is in mode "interest", but site {several[0]} has several '
                'nodes: interest links join one-node sites only for now; use mode = "all" (the default) for it'
            )


def check_auto_create(topology: Topology, site: str) -> None:
    """The site's ``auto_create`` patterns' configs, checked as ``CreateTopic`` checks one: a typo fails the node's
    start, not every produce that would create a topic."""
    for rule in topology.site(site).auto_create:
        try:
            parse_topic_config(dict(rule.config))
        except InvalidTopic as exc:
            raise UsageError(f"--topology: [sites.{site}] auto_create pattern {rule.pattern}: {exc}") from None


def _grpc_server(
    node: _Node,
    topology: Topology | None,
    tls: TlsConfig | None,
    super_users: tuple[Principal, ...],
    grpc_limits: ServerLimits | None,
) -> grpc.aio.Server:
    # server_options bounds every message (tls.MESSAGE_BYTES_MAX, above every topic's max_batch_bytes and the
    # fetch cap: an oversized batch reaches the broker, which names the limit).
    assert FETCH_MAX_BYTES_CAP < MESSAGE_BYTES_MAX
    # A TLS node checks every call's principal against its ACLs and topology first (georep/server/rpc.py); a
    # plaintext one (--insecure) authorizes nothing.
    interceptors = (
        [authorization(node.identity.site, node.broker.metadata, topology, super_users)] if tls is not None else []
    )
    for interceptor in interceptors:  # a topic created on first use asks the caller's create_topic ACL
        node.service.create_refusal = interceptor.authorizer.create_refusal
    server = grpc.aio.server(
        interceptors=interceptors,
        options=server_options(
            [
                ("grpc.so_reuseport", 0),  # a second node on the same port must fail, not share it
                # Clients ping every 10 s, even between calls, to notice a dead node
                # under a long-poll fetch. gRPC servers by default answer pings more
                # often than every 5 min with GOAWAY "too_many_pings".
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MIN_INTERVAL_MS),
            ],
            grpc_limits,
        ),
    )
    server.add_generic_rpc_handlers((node.service.handler(), node.segments.handler()))
    return server


async def _start_grpc(server: grpc.aio.Server, address: str, tls: TlsConfig | None, node: _Node) -> int:
    """Listen on ``address`` and start serving; the port. A port the node cannot take closes the node."""
    try:
        port = add_port(server, address, tls)
    except TlsError as exc:
        node.close()
        raise UsageError(str(exc)) from None
    except RuntimeError as exc:
        node.close()
        raise UsageError(f"cannot listen on {address}: {exc}; is another process using the port?") from None
    if port == 0:
        node.close()
        raise UsageError(f"cannot listen on {address}: the port is in use or the address is not local")
    await server.start()
    return port


async def _start_kafka(
    kafka: KafkaOptions | None,
    site: str,
    topology: Topology | None,
    in_site: InSiteOptions | None,
    tls: TlsConfig | None,
    super_users: tuple[Principal, ...],
    server: grpc.aio.Server,
    node: _Node,
) -> tuple[KafkaServer | None, str]:
    """The Kafka listener (docs/kafka.md), if asked for, and the address Kafka clients are told; a listener the node
    cannot start stops the node."""
    # A node of a multi-node site tells Kafka clients which node leads what, by the topology's Kafka addresses
    kafka_nodes = {int(n): a for n, a in topology.site(site).kafka_addresses().items()} if topology else {}
    if kafka is not None and in_site is not None and in_site.node_id not in kafka_nodes:
        await server.stop(0)
        node.close()
        raise UsageError(
            f"--kafka-listen: a node of a multi-node site needs its site's Kafka addresses, which Kafka "
            f'clients are sent to for the partitions each node leads: add kafka = "HOST:PORT" to every '
            f"node of site {site} in the topology file (docs/kafka.md)"
        )
    if kafka is None:
        return None, ""
    from georep.kafka.server import server_ssl_context, start_kafka

    try:
        # The Kafka port takes mutual TLS too (or SASL: SASL_SSL, or SASL_PLAINTEXT on an --insecure node),
        # and checks the same ACLs (docs/kafka.md)
        if tls is not None or kafka.sasl:
            kafka = replace(
                kafka,
                ssl_context=None if tls is None else server_ssl_context(tls, kafka.sasl),
                policy=Policy(node.identity.site, AclCache(node.broker.metadata.acls), lambda: topology, super_users),
            )
        kafka_server, kafka_address = await start_kafka(
            kafka, node.broker, node.service.groups, node.site_cluster, node.service.topic_calls.changes
        )
        kafka_server.gateway.topic_calls = node.service.topic_calls
        kafka_server.gateway.auto_create = node.service.auto_create
        groups = kafka_server.gateway.kgroups  # their topics are read here: interests (interest_links.py)
        node.service.kafka_read_topics = lambda: {
            t for g in groups.values() for m in g.members.values() for t in m.topics
        }
        if node.site_cluster is not None:  # set before any request is read (no await since the listener started)
            from georep.kafka.cluster import cluster_view_of
            from georep.kafka.server import leader_asker

            kafka_server.gateway.view_of = cluster_view_of(node.site_cluster, kafka_nodes)
            kafka_server.gateway.ask_leader = leader_asker(node.site_cluster)
            kafka_address = kafka_nodes[int(node.site_cluster.member.me)]  # what clients are told (node.json)
        node.service.kafka_offsets = kafka_server.gateway.answer_coordinator
    except OSError as exc:
        await server.stop(0)
        node.close()
        raise UsageError(
            f"cannot listen for Kafka clients on {kafka.listen[0]}:{kafka.listen[1]}: "
            f"{exc.strerror or exc}; is another process using the port?"
        ) from None
    return kafka_server, kafka_address


def _warn_insecure(tls: TlsConfig | None, in_site: InSiteOptions | None, listen: str) -> None:
    if tls is None:
        log.warning(
            "--insecure: serving plaintext, without TLS and without ACLs; any process that reaches %s may "
            "produce, consume, commit and replicate (docs/security.md)",
            listen,
        )
    if in_site is not None and in_site.raft_secret is None:
        log.warning(
            "no --raft-secret-file: the Raft port %s is plaintext and unauthenticated; any process that "
            "reaches it may join the site's Raft group, change its metadata or run code in this node "
            "(docs/security.md)",
            in_site.raft_address,
        )


def _start_housekeeping(
    node: _Node, scrub_bytes_per_s: int, scrub_interval_ms: int, retention_check_ms: int
) -> list[asyncio.Task[None]]:
    """The background loops (fsync, scrub, retention, groups) and the replicator's pullers."""
    housekeeping = [
        asyncio.create_task(_flush_loop(node.broker)),
        asyncio.create_task(_scrub_loop(node.broker, scrub_bytes_per_s, scrub_interval_ms)),
        asyncio.create_task(_retention_loop(node.broker, retention_check_ms / 1000)),
        asyncio.create_task(_group_loop(node.service)),
    ]
    if node.delete_gate is not None:
        housekeeping.append(asyncio.create_task(node.delete_gate.run()))
    gc_pauses = GcPauses()  # full collections walk what came since the last one, not every topic's objects
    gc_pauses.install()
    node.metrics.registry.register(gc_pauses)
    housekeeping.append(asyncio.create_task(gc_pauses.run()))
    if node.replicator is not None:
        node.replicator.start()
        log.info(
            "pulling from %s",
            ", ".join(f"{p.src} ({p.address})" for p in node.replicator.pullers.values())
            or "no site: no link leads here",
        )
    return housekeeping


async def _shut_down(
    node: _Node,
    server: grpc.aio.Server,
    kafka_server: KafkaServer | None,
    housekeeping: list[asyncio.Task[None]],
    shutdown_timeout_ms: int,
    node_info: Path,
) -> None:
    """Stop taking calls, end what runs, fsync and close every log, within ``shutdown_timeout_ms``; then
    ``node_info`` goes: the node no longer serves."""
    shutdown = Shutdown(shutdown_timeout_ms)
    shutdown.begin(asyncio.get_running_loop())
    log.info("shutting down")
    if os.environ.get(STUCK_FSYNC_ENV):
        node.broker.executor.submit(threading.Event().wait)  # tests: an fsync thread that never returns
    if node.member is not None:
        await shutdown.step("stopping the cluster member", node.member.stop())
    if node.replicator is not None:
        await shutdown.step("stopping the pullers", node.replicator.stop())
    if node.site_cluster is not None:
        await shutdown.step("closing the connections to the site's other nodes", node.site_cluster.close())
    if kafka_server is not None:
        await shutdown.step("stopping the Kafka listener", kafka_server.stop())
    node.service.stop_streams()
    for task in housekeeping:
        task.cancel()
    await shutdown.step("ending the calls in flight", server.stop(SHUTDOWN_GRACE_S), SHUTDOWN_GRACE_S + STEP_TIMEOUT_S)
    shutdown.blocking("waiting for the segment threads")
    node.segment_executor.shutdown(wait=True)
    shutdown.blocking("fsyncing and closing the logs and the Raft metadata")
    node.close()
    node_info.unlink(missing_ok=True)
    shutdown.done()


async def _flush_loop(broker: Broker) -> None:
    """fsync partitions whose topics flush on an interval rather than per batch: one timer, at the earliest
    due partition among those written since their last fsync (idle partitions cost nothing)."""
    while True:
        broker.flush_wanted.clear()
        due = broker.next_flush_due()
        if due is None:
            await broker.flush_wanted.wait()
        else:
            delay_s = max(0.0, due - time.monotonic() * 1000) / 1000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(broker.flush_wanted.wait(), delay_s)
        broker.flush_due(int(time.monotonic() * 1000))


async def _scrub_loop(broker: Broker, bytes_per_s: int, interval_ms: int) -> None:
    """Check every stored batch once per ``interval_ms``, at ``bytes_per_s`` (georep/server/scrubber.py)."""
    if bytes_per_s <= 0:
        return
    scrub = BackgroundScrub(broker, bytes_per_s, SCRUB_STEP_BYTES, interval_ms, _monotonic_ms())
    while True:
        due_ms = await scrub.tick(_monotonic_ms())
        await asyncio.sleep(max(0, due_ms - _monotonic_ms()) / 1000)


def _monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


async def _group_loop(service: NodeService) -> None:
    """Expire consumer group members whose session timed out; on a multi-node site, follow what this node
    coordinates (``GroupService.tick``)."""
    while True:
        await asyncio.sleep(GROUP_TICK_S)
        await service.groups.tick()


async def _retention_loop(broker: Broker, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        run, started = retention_run.RetentionRun(), time.monotonic()
        await retention_run.paced(broker, run)
        if run.deleted or run.visited >= retention_run.VISITS_LOGGED:
            log.info(
                "retention run: %d partition(s) visited, %d segment(s) deleted, in %.1f s",
                run.visited,
                run.deleted,
                time.monotonic() - started,
            )
