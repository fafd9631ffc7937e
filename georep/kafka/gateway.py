"""The Kafka gateway's request handlers: Kafka requests in, Kafka responses out, over the node's broker and
group service (no socket here: ``georep/kafka/server.py`` is the TCP shell).

Every decision stays where it lives for georep's own protocol: the origin append, producer dedup and the
ack table (``Broker.append``, ``ack_waiter``), the fetch cursor's durable rule (only offsets below the
flushed offset, Kafka's high watermark), the group coordinator and the replicated commit log
(``GroupService``). This module maps Kafka's requests onto them; docs/kafka.md lists each API and what
differs from Kafka.

**Order.** :meth:`KafkaGateway.dispatch` does a request's synchronous part at once (a produce's appends)
and returns what is left to await, so a connection's pipelined produce requests are appended in the
order they arrived, as the idempotent producer's sequence check requires, and their acks are awaited
together; the server sends the responses in request order.

**Groups.** Kafka's classic protocol has the group leader compute the assignment; georep's coordinator
computes it on the server (``cluster/groups.py``, the range assignor). So every member is told it is a
follower (JoinGroup names no member as leader) and each one's SyncGroup answer is its assignment from the
coordinator, encoded as Kafka's ``ConsumerProtocolAssignment``. A join or a leave bumps the generation at
once; a member at an older generation learns of it from its next Heartbeat (``REBALANCE_IN_PROGRESS``) and
rejoins, and its commits at the older generation are refused (``ILLEGAL_GENERATION``).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from kafka.protocol import admin as kadmin
from kafka.protocol import consumer as kconsumer
from kafka.protocol import metadata as kmetadata
from kafka.protocol import producer as kproducer

from cluster.quorum import Fenced, SegmentSealed
from georep.auth.acl import Operation, PermissionDenied, Resource, ResourceKind
from georep.auth.acl import group as acl_group
from georep.auth.acl import topic as acl_topic
from georep.auth.policy import Policy
from georep.auth.principal import Principal
from georep.broker import fetch
from georep.broker.acks import LEADER, AckKind, Acks
from georep.broker.errors import CatalogNotSynced, NotLeader
from georep.kafka import errors as k
from georep.kafka import group_admin
from georep.kafka.cluster import NO_COORDINATOR, OneNode, SiteView, ViewOf
from georep.kafka.leader_epochs import end_of_epoch
from georep.kafka.leader_offsets import AskLeader as AskLeader
from georep.kafka.leader_offsets import LeaderOffsets, LeaderUnreachable
from georep.kafka.leader_offsets import LeaderRefused as LeaderRefused
from georep.kafka.offsets import FetchFilters
from georep.kafka.protocol import Request, api_versions_body
from georep.kafka.records import InvalidStored, RecordsError, convert_fetched, kafka_to_georep
from georep.kafka.rejoin import REJOIN_POLL_S, laggards
from georep.metadata.kafka_config import (
    BY_NAME,
    SET,
    Described,
    SiteSettings,
    alter_changes,
    broker_configs,
    describe,
    kafka_alter,
    to_georep,
)
from georep.metadata.store import UnknownTopic
from georep.metadata.topic_entry import add_partitions
from georep.metadata.topics import InvalidTopic, parse_topic_config
from georep.proto import georep_pb2 as pb
from georep.proto.convert import vector_to_proto
from georep.server.auto_create import AutoCreate
from georep.server.broker import DEFAULT_TOPIC_CONFIG, Broker, Partition, partition_to_write
from georep.server.groups import GroupService
from georep.server.topic_calls import TopicCalls
from georep.server.topic_changes import TopicChanges, TopicChangesUnsupported
from georep.storage.api import OffsetOutOfRange
from offsets.commits import OFFSETS_TOPIC, offsets_partition
from topology.filters import is_internal

log = logging.getLogger(__name__)

EAGER_PROTOCOLS = ("range", "roundrobin", "sticky")  # assignment strategies a client may name; georep assigns
COMMITTED_WAIT_MS = 5_000  # OffsetFetch waits this long for the commits live upstreams hold
FETCH_MAX_BYTES_CAP = 64 << 20
NO_FILTER_END = 1 << 62
INVALID_REPORTED_MAX = 10_000
LATEST = -1
EARLIEST = -2
TOPIC_RESOURCE, BROKER_RESOURCE, BROKER_LOGGER_RESOURCE = 2, 4, 8  # Kafka's ConfigResource types
BROKERS_ENDPOINT = 1  # DescribeCluster v1+: brokers (2, controllers: Kafka's KRaft quorum, which georep has not)
MISMATCHED_ENDPOINT_TYPE = 114
ALTER_CONFIGS, CREATE_PARTITIONS = 33, 37
ASSIGNMENTS_REFUSED = "georep places a topic's partitions itself: leave the replica assignments out"


@dataclass
class KafkaMember:
    client_id: str
    client_host: str
    topics: tuple[str, ...]
    session_timeout_ms: int
    metadata: bytes
    joined: int = -1  # the generation its last JoinGroup answered (``rejoin.laggards``)


@dataclass
class KafkaGroup:
    protocol: str = ""
    members: dict[str, KafkaMember] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Client:
    """Who sent a request: the peer's host, and with TLS the principal its certificate names."""

    host: str
    principal: Principal | None = None


class Denied(Exception):
    """The principal may not do what the request asks (the ACLs of docs/security.md); ``code`` is Kafka's."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.kafka_code = code


Pending = Awaitable[Any]  # what is left of a request: resolves to the response object, or None (no response)


async def _offset_for_leader_epoch(g: KafkaGateway, req: Request, peer: Client) -> Any:
    """OffsetForLeaderEpoch (a function: the class is at its bound of methods): each partition's end of the epoch
    asked for (``georep/kafka/leader_epochs.py``); the leader's epoch is the one Metadata names, its readable end
    the high watermark that Fetch reports."""
    r = kconsumer.OffsetForLeaderEpochResponse
    rt, rp = r.OffsetForLeaderTopicResult, r.OffsetForLeaderTopicResult.EpochEndOffset
    out = []
    for t in req.body.topics:
        parts = []
        for lp in t.partitions:
            try:
                g._allow(peer, Operation.CONSUME, [acl_topic(t.topic)])
                plog = g.broker.partition(t.topic, lp.partition).log
                leader_epoch = g._view([(t.topic, lp.partition)]).route(t.topic, lp.partition).leader_epoch
                end = end_of_epoch(lp.leader_epoch, lp.current_leader_epoch, leader_epoch, plog.flushed_offset)
                parts.append(
                    rp(
                        partition=lp.partition,
                        error_code=end.error,
                        leader_epoch=end.leader_epoch,
                        end_offset=end.end_offset,
                    )
                )
            except Exception as exc:
                code = g._code(exc, t.topic, lp.partition)
                parts.append(rp(partition=lp.partition, error_code=code, leader_epoch=-1, end_offset=-1))
        out.append(rt(topic=t.topic, partitions=parts))
    return r(topics=out)


class KafkaGateway(LeaderOffsets):
    def __init__(
        self,
        broker: Broker,
        groups: GroupService,
        host: str,
        port: int,
        create_topic: Callable[[str, int, dict[str, str]], Awaitable[None]],
        commit_acks: Acks = LEADER,
        policy: Policy | None = None,
    ) -> None:
        self.broker = broker
        self.groups = groups
        self.host = host
        self.port = port
        self.create_topic = create_topic
        self.commit_acks = commit_acks
        self.policy = policy  # TLS: every request is checked against the site's ACLs; plaintext: none is
        self.filters = FetchFilters()
        self.kgroups: dict[str, KafkaGroup] = {}
        # A node of a multi-node site: its view of the site's leaders and Kafka addresses (georep/kafka/cluster.py)
        self.view_of: ViewOf | None = None
        # The site's replication factor and min.insync.replicas (a multi-node site's node flags): what a topic's
        # Kafka configs may state, and what DescribeConfigs reports
        self.site = SiteSettings()
        # ... and how it asks the leader of a partition it does not lead (a group's coordinator: commits, resumes)
        self.ask_leader: AskLeader | None = None
        self._invalid_reported: set[tuple[str, int, int]] = set()  # stored invalid batches already logged
        self.topic_changes: TopicChanges | None = None  # alters and growths of a one-node site's topics
        self.topic_calls: TopicCalls | None = None  # deletes (DeleteTopics), as georep's DeleteTopic makes them
        self.auto_create: AutoCreate | None = None  # topics created on first use: the node's, shared with georep's

    def _view(self, keys: list[tuple[str, int]] | None = None) -> SiteView:
        return OneNode(self.host, self.port) if self.view_of is None else self.view_of(keys)

    def dispatch(self, req: Request, peer: Client) -> Pending:
        if req.api_key == 0:
            return self._produce(req.body, peer)
        handler = self._handlers.get(req.api_key)
        assert handler is not None, req.api_key  # protocol.SUPPORTED and this table list the same keys
        return handler(self, req, peer)

    def _allow(self, peer: Client, operation: Operation, resources: list[Resource]) -> None:
        """With TLS (``policy``): raise :class:`Denied` unless the client certificate's principal may do
        ``operation`` on every resource (the same ACLs and rules as georep's own RPCs, ``acl_rpc.py``)."""
        if self.policy is None:
            return
        kind = resources[0].kind if resources else ResourceKind.CLUSTER
        code = {ResourceKind.TOPIC: k.TOPIC_AUTHORIZATION_FAILED, ResourceKind.GROUP: k.GROUP_AUTHORIZATION_FAILED}.get(
            kind, k.CLUSTER_AUTHORIZATION_FAILED
        )
        if peer.principal is None:
            raise Denied(code, "the client certificate names no georep principal")
        decision = self.policy.acl(peer.principal, operation, resources)
        if not decision.allowed:
            raise Denied(code, decision.message)

    # -- metadata and topics ------------------------------------------------------------------------------

    async def _api_versions(self, req: Request, peer: Client) -> Any:
        return api_versions_body(req.version)

    def _topic_names(self) -> list[str]:
        return sorted(n for n in self.broker.metadata.topics() if not is_internal(n))

    async def _metadata(self, req: Request, peer: Client) -> Any:
        r = kmetadata.MetadataResponse
        body = req.body
        wanted = (
            None if body.topics is None or (req.version == 0 and not body.topics) else [t.name for t in body.topics]
        )
        topics = []
        refused = await self._create_on_first_use(wanted, peer) if wanted and body.allow_auto_topic_creation else {}
        known = self.broker.metadata.topics()
        view = self._view()
        for name in self._topic_names() if wanted is None else wanted:
            spec = known.get(name)
            if name in refused:
                topics.append(r.MetadataResponseTopic(error_code=refused[name], name=name))
                continue
            if spec is None or is_internal(name):
                topics.append(r.MetadataResponseTopic(error_code=k.UNKNOWN_TOPIC_OR_PARTITION, name=name))
                continue
            parts = []
            for i in range(spec.partitions):
                route = view.route(name, i)
                parts.append(
                    r.MetadataResponseTopic.MetadataResponsePartition(
                        error_code=route.error,
                        partition_index=i,
                        leader_id=route.leader,
                        leader_epoch=route.leader_epoch,
                        replica_nodes=list(route.replicas),
                        isr_nodes=list(route.isr),
                    )
                )
            topics.append(r.MetadataResponseTopic(name=name, partitions=parts))
        brokers = [r.MetadataResponseBroker(node_id=b.node_id, host=b.host, port=b.port) for b in view.brokers()]
        return r(
            brokers=brokers, cluster_id=f"georep-{self.broker.identity.site}", controller_id=view.me, topics=topics
        )

    async def _create_on_first_use(self, names: list[str], peer: Client) -> dict[str, int]:
        """The missing ``names`` that the site's ``auto_create`` patterns match, created (Kafka's
        ``auto.create.topics.enable``, asked by a Metadata request's ``allow_auto_topic_creation``); the Kafka code of
        each one that could not be, by name."""
        refused: dict[str, int] = {}
        if self.auto_create is None:
            return refused

        def refusal(name: str) -> str | None:
            try:
                self._allow(peer, Operation.CREATE_TOPIC, [acl_topic(name)])
            except Denied as denied:
                return str(denied)
            return None

        outcomes = await asyncio.gather(*(self.auto_create.ensure(n, refusal) for n in names), return_exceptions=True)
        for name, exc in zip(names, outcomes, strict=True):  # created together (AutoCreate's group commit)
            if isinstance(exc, Exception):
                code = k.TOPIC_AUTHORIZATION_FAILED if isinstance(exc, PermissionDenied) else self._code(exc)
                log.info("kafka gateway: topic %s not created on first use: %s", name, exc)
                refused[name] = code
        return refused

    async def _create_topics(self, req: Request, peer: Client) -> Any:
        """Kafka's config names become georep's keys (``georep/metadata/kafka_config.py``); a config georep cannot
        take fails its topic with ``INVALID_CONFIG``, validate_only included."""
        r = kadmin.CreateTopicsResponse
        out = []
        unsynced = await self._creates_refused() if not req.body.validate_only else None
        for t in req.body.topics:
            partitions = t.num_partitions if t.num_partitions > 0 else 1
            try:
                self._allow(peer, Operation.CREATE_TOPIC, [acl_topic(t.name)])
                raw = {c.name: c.value for c in t.configs if c.value is not None}
                # The topic's own (issue 23); -1: the site's. Only a multi-node site's clients ask for it: a one-node
                # site's see one broker, so ask for 1, which must not become the topic's at the sites it reaches.
                # Checked with the configs, so min.insync.replicas is held to the factor asked for.
                if t.replication_factor > 0 and self.view_of is not None:
                    raw["replication_factor"] = str(t.replication_factor)
                config = to_georep(raw, self.site)
                if req.body.validate_only:
                    self.broker.check_new_topic(t.name, partitions, config)
                elif unsynced is not None:
                    raise unsynced
                else:
                    await self.create_topic(t.name, partitions, config)
                described = self._described(parse_topic_config(config))
                out.append(
                    r.CreatableTopicResult(
                        name=t.name,
                        num_partitions=partitions,
                        replication_factor=int(config.get("replication_factor", self.site.replication_factor)),
                        configs=[
                            r.CreatableTopicResult.CreatableTopicConfigs(
                                name=d.name, value=d.value, read_only=True, config_source=d.source, is_sensitive=False
                            )
                            for d in described
                        ],
                    )
                )
            except Exception as exc:
                out.append(r.CreatableTopicResult(name=t.name, error_code=self._code(exc), error_message=str(exc)))
        return r(topics=out)

    async def _creates_refused(self) -> CatalogNotSynced | None:
        """Why this data dir may not create topics yet (one wait for the whole request), or None."""
        if self.topic_calls is None:
            return None
        try:
            await self.topic_calls.before_create()
        except CatalogNotSynced as exc:
            return exc
        return None

    def _described(self, overrides: dict[str, int]) -> list[Described]:
        return describe(overrides, self.broker.defaults, DEFAULT_TOPIC_CONFIG, self.site)

    async def _topic_changes(self, req: Request, peer: Client) -> Any:
        """AlterConfigs, IncrementalAlterConfigs and CreatePartitions of topics: each resource changed or refused on
        its own, as :class:`~georep.server.topic_changes.TopicChanges` makes the change at this site and the topic
        sync carries it to every site the topic reaches. A broker's configs are its flags: refused, saying so."""
        b = req.body
        validate_only = bool(b.validate_only)
        if req.api_key == CREATE_PARTITIONS:
            r = kadmin.CreatePartitionsResponse
            return r(results=[await self._grow(t, validate_only, peer) for t in b.topics])
        ra = kadmin.AlterConfigsResponse if req.api_key == ALTER_CONFIGS else kadmin.IncrementalAlterConfigsResponse
        out = []
        for res in b.resources:
            code, why = 0, None
            if res.resource_type != TOPIC_RESOURCE:
                code = k.INVALID_REQUEST
                why = "a georep node's settings are its command-line flags (georep node --help): restart it with them"
            else:
                try:
                    await self._alter(res, req.api_key == ALTER_CONFIGS, validate_only, peer)
                except Exception as exc:
                    code, why = self._code(exc), str(exc)
            out.append(
                ra.AlterConfigsResourceResponse(
                    error_code=code, error_message=why, resource_type=res.resource_type, resource_name=res.resource_name
                )
            )
        return ra(responses=out)

    def _changes(self, name: str, peer: Client) -> TopicChanges:
        self._allow(peer, Operation.ALTER_TOPIC, [acl_topic(name)])
        if is_internal(name):
            raise UnknownTopic(name)
        self.broker.topic(name)  # UnknownTopic
        if self.topic_changes is None:
            raise TopicChangesUnsupported("this node cannot change topics")
        return self.topic_changes

    async def _alter(self, res: Any, replace_all: bool, validate_only: bool, peer: Client) -> None:
        name = res.resource_name
        changes = self._changes(name, peer)
        configs = [(c.name, getattr(c, "config_operation", SET), c.value) for c in res.configs]
        sets, resets = kafka_alter(configs, self.broker.topic(name).config, replace_all)
        wanted = alter_changes(sets, resets)
        if not wanted:
            return
        if validate_only:
            changes.altered(name, wanted)
        else:
            await changes.alter(name, wanted)

    async def _grow(self, t: Any, validate_only: bool, peer: Client) -> Any:
        r = kadmin.CreatePartitionsResponse.CreatePartitionsTopicResult
        try:
            changes = self._changes(t.name, peer)
            if t.assignments:
                return r(name=t.name, error_code=k.INVALID_REQUEST, error_message=ASSIGNMENTS_REFUSED)
            if validate_only:
                add_partitions(changes.held(t.name), t.name, t.count)
            else:
                await changes.add_partitions(t.name, t.count)
        except InvalidTopic as exc:
            return r(name=t.name, error_code=k.INVALID_PARTITIONS, error_message=str(exc))
        except Exception as exc:
            return r(name=t.name, error_code=self._code(exc), error_message=str(exc))
        return r(name=t.name, error_code=0, error_message=None)

    async def _describe_configs(self, req: Request, peer: Client) -> Any:
        """Topics: every Kafka name georep takes, with the topic's value and its source; brokers (this node's id,
        or "" for the cluster's defaults): the node's defaults under Kafka's broker names. Open to every principal,
        as Metadata and georep's own DescribeTopic are."""
        b = req.body
        docs = req.version >= 3 and bool(b.include_documentation)
        results = [self._config_result(res, bool(b.include_synonyms), docs) for res in b.resources]
        return kadmin.DescribeConfigsResponse(results=results)

    def _config_result(self, res: Any, synonyms: bool, docs: bool) -> Any:
        r = kadmin.DescribeConfigsResponse.DescribeConfigsResult
        kind, name = res.resource_type, res.resource_name

        def refuse(code: int, message: str) -> Any:
            return r(error_code=code, error_message=message, resource_type=kind, resource_name=name, configs=[])

        described: list[Described] = []
        if kind == TOPIC_RESOURCE:
            try:
                if is_internal(name):
                    raise UnknownTopic(name)
                described = self._described(self.broker.topic(name).config)
            except UnknownTopic:
                return refuse(k.UNKNOWN_TOPIC_OR_PARTITION, f"topic {name!r} does not exist at this site")
        elif kind == BROKER_RESOURCE:
            me = self._view([]).me
            if name not in ("", str(me)):
                return refuse(k.INVALID_REQUEST, f"this is broker {me}: ask broker {name} for its own configs")
            described = broker_configs(self.broker.defaults, DEFAULT_TOPIC_CONFIG, self.site)
        elif kind != BROKER_LOGGER_RESOURCE:  # a broker's loggers: none to describe
            return refuse(k.INVALID_REQUEST, f"georep describes the configs of topics and brokers, not of type {kind}")
        wanted = None if res.configuration_keys is None else set(res.configuration_keys)
        configs = [_config_entry(d, synonyms, docs) for d in described if wanted is None or d.name in wanted]
        return r(error_code=0, error_message=None, resource_type=kind, resource_name=name, configs=configs)

    async def _describe_cluster(self, req: Request, peer: Client) -> Any:
        """The brokers and controller Metadata names (``georep/kafka/cluster.py``), and Metadata's cluster id."""
        r = kadmin.DescribeClusterResponse
        cluster_id = f"georep-{self.broker.identity.site}"
        if req.version >= 1 and req.body.endpoint_type != BROKERS_ENDPOINT:
            message = "georep has no separate controllers: every node is a broker (ask for endpoint type 1)"
            return r(error_code=MISMATCHED_ENDPOINT_TYPE, error_message=message, cluster_id=cluster_id, brokers=[])
        view = self._view([])
        brokers = [
            r.DescribeClusterBroker(broker_id=n.node_id, host=n.host, port=n.port, rack=None, is_fenced=False)
            for n in view.brokers()
        ]
        return r(error_code=0, error_message=None, cluster_id=cluster_id, controller_id=view.me, brokers=brokers)

    async def _describe_log_dirs(self, req: Request, peer: Client) -> Any:
        """One log dir, the node's: the size of each partition of the asked topics (null: all) it serves."""
        r = kadmin.DescribeLogDirsResponse
        lr = r.DescribeLogDirsResult
        lt = lr.DescribeLogDirsTopic
        wanted = None if req.body.topics is None else {t.topic: set(t.partitions) for t in req.body.topics}
        by_topic: dict[str, list[Any]] = {}
        for (topic, index), p in sorted(self.broker.partitions.items()):
            if is_internal(topic) or (wanted is not None and index not in wanted.get(topic, ())):
                continue
            by_topic.setdefault(topic, []).append(
                lt.DescribeLogDirsPartition(
                    partition_index=index, partition_size=p.log.size_bytes, offset_lag=0, is_future_key=False
                )
            )
        logs_dir = self.broker.logs_dir.resolve()
        usage = shutil.disk_usage(logs_dir)
        result = lr(
            error_code=0,
            log_dir=str(logs_dir),
            topics=[lt(name=t, partitions=ps) for t, ps in by_topic.items()],
            total_bytes=usage.total,
            usable_bytes=usage.free,
        )
        return r(error_code=0, results=[result])

    async def _delete_topics(self, req: Request, peer: Client) -> Any:
        """Each topic deleted or refused on its own, as georep's ``DeleteTopic`` does (the tombstone replicates to
        every site the topic reaches). A topic named only by its id (v6) is refused: georep keeps no topic ids."""
        r = kadmin.DeleteTopicsResponse
        names = list(req.body.topic_names or []) + [t.name for t in (req.body.topics or []) if t.name]
        out = []
        for name in names:
            code, why = 0, None
            try:
                self._allow(peer, Operation.DELETE_TOPIC, [acl_topic(name)])
                if self.topic_calls is None:
                    raise TopicChangesUnsupported("this node cannot delete topics")
                await self.topic_calls.delete(name)
            except Exception as exc:
                code, why = self._code(exc), str(exc)
            out.append(r.DeletableTopicResult(name=name, error_code=code, error_message=why))
        for t in req.body.topics or []:
            if not t.name:
                why = "georep keeps no topic ids: name the topic"
                out.append(r.DeletableTopicResult(name=None, error_code=k.INVALID_REQUEST, error_message=why))
        return r(responses=out)

    # -- produce ----------------------------------------------------------------------------------------------

    def _produce(self, body: Any, peer: Client) -> Pending:
        """Appends now, in arrival order; the returned awaitable waits for the acks."""
        acks = Acks(AckKind.ALL) if body.acks == -1 else LEADER
        results: list[tuple[str, int, Any]] = []  # (topic, partition, (produced, waiter) or error code)
        for t in body.topic_data:
            for pd in t.partition_data:
                try:
                    if body.transactional_id is not None:
                        raise RecordsError(k.INVALID_RECORD, "transactions are not supported")
                    self._allow(peer, Operation.PRODUCE, [acl_topic(t.name)])
                    limit = partition_to_write(self.broker, t.name, pd.index).config["max_batch_bytes"]
                    batch = kafka_to_georep(pd.records or b"", limit)
                    p, produced = self.broker.append(t.name, pd.index, batch, acks)
                    waiter = self.broker.ack_waiter(p, produced, acks, body.timeout_ms) if body.acks != 0 else None
                    results.append((t.name, pd.index, (p, produced, waiter)))
                except RecordsError as exc:
                    results.append((t.name, pd.index, (exc.code, str(exc))))
                except Exception as exc:
                    results.append((t.name, pd.index, (self._code(exc, t.name, pd.index), str(exc))))
        return self._produce_answer(results, body.acks == 0)

    async def _produce_answer(self, results: list[tuple[str, int, Any]], no_response: bool) -> Any:
        r = kproducer.ProduceResponse
        by_topic: dict[str, list[Any]] = {}
        for topic, index, outcome in results:
            if len(outcome) == 2:
                code, message = outcome
                part = r.TopicProduceResponse.PartitionProduceResponse(
                    index=index, error_code=code, base_offset=-1, error_message=message
                )
            else:
                p, produced, waiter = outcome
                code = 0
                if waiter is not None:
                    try:
                        await waiter
                    except Exception as exc:
                        code = self._code(exc, topic, index)
                part = r.TopicProduceResponse.PartitionProduceResponse(
                    index=index,
                    error_code=code,
                    base_offset=produced.result.base_offset,
                    log_append_time_ms=-1,
                    log_start_offset=p.log.log_start_offset,
                )
            by_topic.setdefault(topic, []).append(part)
        if no_response:
            return None
        return r(responses=[r.TopicProduceResponse(name=t, partition_responses=ps) for t, ps in by_topic.items()])

    async def _init_producer_id(self, req: Request, peer: Client) -> Any:
        r = kproducer.InitProducerIdResponse
        body = req.body
        if body.transactional_id is not None:
            return r(error_code=k.INVALID_REQUEST, producer_id=-1, producer_epoch=-1)
        if body.producer_id >= 0 and 0 <= body.producer_epoch < 32766:  # KIP-360: bump the epoch of a known id
            return r(producer_id=body.producer_id, producer_epoch=body.producer_epoch + 1)
        # A random id: unique with overwhelming odds across every gateway and restart, with no state to keep.
        return r(producer_id=secrets.randbits(47) + 1, producer_epoch=0)

    # -- fetch ------------------------------------------------------------------------------------------------

    async def _fetch(self, req: Request, peer: Client) -> Any:
        body = req.body
        client = f"{req.client_id}@{peer.host}"
        deadline = asyncio.get_running_loop().time() + max(0, body.max_wait_ms) / 1000
        budget = min(body.max_bytes if req.version >= 3 else FETCH_MAX_BYTES_CAP, FETCH_MAX_BYTES_CAP)
        while True:
            responses, size, waits = self._fetch_once(body, client, budget, peer)
            remaining = deadline - asyncio.get_running_loop().time()
            if size >= max(1, body.min_bytes) or remaining <= 0 or not waits:
                r = kconsumer.FetchResponse
                return r(responses=responses, session_id=0)
            done, _pending = await asyncio.wait(waits, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                remaining = 0

    def _fetch_once(
        self, body: Any, client: str, budget: int, peer: Client
    ) -> tuple[list[Any], int, list[asyncio.Future[None]]]:
        r = kconsumer.FetchResponse
        topics = []
        size = 0
        waits: list[asyncio.Future[None]] = []
        for t in body.topics:
            parts = []
            for fp in t.partitions:
                pd = r.FetchableTopicResponse.PartitionData
                try:
                    self._allow(peer, Operation.CONSUME, [acl_topic(t.topic)])
                    p = self.broker.partition(t.topic, fp.partition)
                except Exception as exc:
                    parts.append(
                        pd(
                            partition_index=fp.partition,
                            error_code=self._code(exc, t.topic, fp.partition),
                            high_watermark=-1,
                        )
                    )
                    continue
                plog = p.log
                flushed = plog.flushed_offset
                records = b""
                code = 0
                try:
                    records = self._read(p, t.topic, fp, client, budget - size, waits)
                    size += len(records)
                except OffsetOutOfRange:
                    code = k.OFFSET_OUT_OF_RANGE
                except Exception as exc:
                    code = self._code(exc, t.topic, fp.partition)
                parts.append(
                    pd(
                        partition_index=fp.partition,
                        error_code=code,
                        high_watermark=flushed,
                        last_stable_offset=flushed,
                        log_start_offset=plog.log_start_offset,
                        aborted_transactions=None,
                        preferred_read_replica=-1,
                        records=records,
                    )
                )
            topics.append(r.FetchableTopicResponse(topic=t.topic, partitions=parts))
        return topics, size, waits

    def _read(
        self, p: Partition, topic: str, fp: Any, client: str, budget: int, waits: list[asyncio.Future[None]]
    ) -> bytes:
        """One partition of a Fetch: the durable batches at its offset as Kafka records (what the client's resumed
        commit covers left out), or a wait for the next fsync. The fetch cursor decides the range and what is
        durable, as for georep's own Fetch; raises ``OffsetOutOfRange`` outside the log."""
        cursor = fetch.FetchCursor(p.log, fetch.AtOffset(fp.fetch_offset), self.broker.origin)
        cursor.check_in_range()
        if not cursor.readable or budget <= 0:
            waits.append(p.durable())
            return b""
        chunk = cursor.read(min(fp.partition_max_bytes, budget))
        skip = self.filters.for_fetch((client, topic, fp.partition), fp.fetch_offset)
        converted = convert_fetched(chunk, fp.fetch_offset, skip.to_dict() if skip else None, NO_FILTER_END)
        self._report_invalid(topic, fp.partition, converted.invalid)
        return converted.data

    def _report_invalid(self, topic: str, partition: int, invalid: tuple[InvalidStored, ...]) -> None:
        """Log each stored batch a fetch served empty because its records are invalid, once per batch (clients
        fetch it again and again until they are past it); the set is bounded."""
        for bad in invalid:
            key = (topic, partition, bad.base_offset)
            if key in self._invalid_reported:
                continue
            if len(self._invalid_reported) >= INVALID_REPORTED_MAX:
                self._invalid_reported.clear()
            self._invalid_reported.add(key)
            log.error(
                "%s-%d: the stored batch at offsets %d..%d is invalid and was served to Kafka clients as an "
                "empty batch, which they move past: %s. It was stored before georep validated batches; "
                "'georep consume' reports it too, and another site may hold a valid copy",
                topic,
                partition,
                bad.base_offset,
                bad.next_offset - 1,
                bad.reason,
            )

    async def _list_offsets(self, req: Request, peer: Client) -> Any:
        r = kconsumer.ListOffsetsResponse
        out = []
        for t in req.body.topics:
            parts = []
            for lp in t.partitions:
                rp = r.ListOffsetsTopicResponse.ListOffsetsPartitionResponse
                try:
                    self._allow(peer, Operation.CONSUME, [acl_topic(t.name)])
                    plog = self.broker.partition(t.name, lp.partition_index).log
                    query: fetch.Earliest | fetch.Latest | int = (
                        fetch.Earliest()
                        if lp.timestamp == EARLIEST
                        else lp.timestamp
                        if lp.timestamp >= 0
                        else fetch.Latest()  # LATEST, and the max-timestamp query (-3), which gets the end
                    )
                    found = fetch.listed_offset(plog, query)
                    # none durable that late yet: the high watermark, where the next ones go
                    offset = plog.flushed_offset if found is None else found
                    epoch = self._view([(t.name, lp.partition_index)]).route(t.name, lp.partition_index).leader_epoch
                    parts.append(
                        rp(partition_index=lp.partition_index, timestamp=-1, offset=offset, leader_epoch=epoch)
                    )
                except Exception as exc:
                    parts.append(
                        rp(
                            partition_index=lp.partition_index,
                            offset=-1,
                            error_code=self._code(exc, t.name, lp.partition_index),
                        )
                    )
            out.append(r.ListOffsetsTopicResponse(name=t.name, partitions=parts))
        return r(topics=out)

    # -- groups -----------------------------------------------------------------------------------------------

    async def _find_coordinator(self, req: Request, peer: Client) -> Any:
        r = kmetadata.FindCoordinatorResponse
        group = req.body.key
        try:
            await self.groups.ensure_offsets_topic(group)
        except Exception as exc:
            return r(error_code=self._code(exc), error_message=str(exc), node_id=-1, host="", port=-1)
        found = self._view([(OFFSETS_TOPIC, offsets_partition(group))]).coordinator(group)
        if found is None:
            return r(error_code=k.COORDINATOR_NOT_AVAILABLE, error_message=NO_COORDINATOR, node_id=-1, host="", port=-1)
        return r(node_id=found.node_id, host=found.host, port=found.port)

    async def _join_group(self, req: Request, peer: Client) -> Any:
        r = kconsumer.JoinGroupResponse
        b = req.body

        def refuse(code: int) -> Any:
            return r(error_code=code, generation_id=-1, protocol_name="", leader="", member_id=b.member_id or "")

        names = [p.name for p in b.protocols]
        chosen = next((n for n in names if n in EAGER_PROTOCOLS), None)
        if b.protocol_type != "consumer" or chosen is None:
            log.info(
                "group %r: join refused, protocol type %r with strategies %s (georep assigns on the server; "
                "use range or roundrobin)",
                b.group_id,
                b.protocol_type,
                names,
            )
            return refuse(k.INCONSISTENT_GROUP_PROTOCOL)
        metadata = bytes(next(p.metadata for p in b.protocols if p.name == chosen))
        try:
            topics = tuple(kconsumer.ConsumerProtocolSubscription.decode(metadata).topics)
            self._allow(peer, Operation.READ, [acl_group(b.group_id)])
            self._allow(peer, Operation.CONSUME, [acl_topic(t) for t in topics])
            hb = await self.groups.heartbeat(
                pb.GroupHeartbeatRequest(
                    group=b.group_id,
                    member_id=b.member_id,
                    topics=topics,
                    session_timeout_ms=b.session_timeout_ms,
                    assignor="range",
                    client_id=req.client_id,
                )
            )
        except Exception as exc:
            return refuse(self._code(exc))
        g = self.kgroups.setdefault(b.group_id, KafkaGroup())
        g.protocol = chosen
        member = KafkaMember(req.client_id, peer.host, topics, b.session_timeout_ms, metadata, hb.generation)
        g.members[hb.member_id] = member
        live = self.groups.coordinator.groups.get(b.group_id)
        for gone in [m for m in g.members if live is None or m not in live.members]:  # expired or left
            del g.members[gone]
        rebalance_timeout_ms = getattr(b, "rebalance_timeout_ms", -1)  # v1 on; v0: the session timeout
        try:
            timeout_ms = rebalance_timeout_ms if rebalance_timeout_ms > 0 else b.session_timeout_ms
            hb = await self._rejoined(b.group_id, hb, member, timeout_ms)
        except Exception as exc:
            return refuse(self._code(exc))
        return r(
            generation_id=hb.generation,
            protocol_type="consumer",
            protocol_name=chosen,
            leader="",
            member_id=hb.member_id,
            members=[],
        )

    async def _rejoined(
        self, group: str, hb: pb.GroupHeartbeatResponse, member: KafkaMember, timeout_ms: int
    ) -> pb.GroupHeartbeatResponse:
        """Wait until every Kafka member of ``group`` has joined at its current generation (``rejoin.py``: the eager
        protocol's join barrier), heartbeating ``member`` meanwhile; the heartbeat answer at that generation. A
        member not rejoined within ``timeout_ms`` (the rebalance timeout) is dropped from the group, as Kafka's
        coordinator drops it: a live client hears UNKNOWN_MEMBER_ID at its next call, after revoking."""
        deadline = time.monotonic() + timeout_ms / 1000
        beat_at = time.monotonic() + hb.heartbeat_interval_ms / 1000
        request = pb.GroupHeartbeatRequest(
            group=group,
            member_id=hb.member_id,
            topics=member.topics,
            session_timeout_ms=member.session_timeout_ms,
            assignor="range",
            client_id=member.client_id,
        )
        while True:
            live = self.groups.coordinator.groups.get(group)
            if live is None or hb.member_id not in live.members:
                return hb  # expired, or the coordinator moved: its next call hears UNKNOWN_MEMBER_ID
            if live.generation != hb.generation or time.monotonic() >= beat_at:
                hb = await self.groups.heartbeat(request)  # still inside its JoinGroup: it has revoked everything
                member.joined = hb.generation
                beat_at = time.monotonic() + hb.heartbeat_interval_ms / 1000
                continue
            kafka = self.kgroups.get(group, KafkaGroup()).members
            waiting = laggards({m: k.joined for m, k in kafka.items()}, live.members, hb.generation)
            if not waiting:
                return hb
            if time.monotonic() >= deadline:
                for m in waiting:
                    log.info("group %r: member %s did not rejoin within the rebalance timeout; dropped", group, m)
                    await self.groups.leave(pb.LeaveGroupRequest(group=group, member_id=m))
                    kafka.pop(m, None)
                continue
            await asyncio.sleep(REJOIN_POLL_S)

    async def _beat(self, group: str, member_id: str, peer: Client) -> tuple[int, Any]:
        """Heartbeat ``member_id`` at the coordinator: (error code, georep heartbeat answer)."""
        member = self.kgroups.get(group, KafkaGroup()).members.get(member_id)
        if member is None:
            return k.UNKNOWN_MEMBER_ID, None
        try:
            self._allow(peer, Operation.READ, [acl_group(group)])
            hb = await self.groups.heartbeat(
                pb.GroupHeartbeatRequest(
                    group=group,
                    member_id=member_id,
                    topics=member.topics,
                    session_timeout_ms=member.session_timeout_ms,
                    assignor="range",
                    client_id=member.client_id,
                )
            )
        except Exception as exc:
            return self._code(exc), None
        return 0, hb

    async def _sync_group(self, req: Request, peer: Client) -> Any:
        r = kconsumer.SyncGroupResponse
        b = req.body
        code, hb = await self._beat(b.group_id, b.member_id, peer)
        if code:
            return r(error_code=code, assignment=b"")
        if hb.generation != b.generation_id:
            return r(error_code=k.REBALANCE_IN_PROGRESS, assignment=b"")
        a = kconsumer.ConsumerProtocolAssignment
        assignment = a(
            version=0,
            assigned_partitions=[
                a.TopicPartition(topic=tp.topic, partitions=list(tp.partitions)) for tp in hb.assignment
            ],
        )
        g = self.kgroups[b.group_id]
        return r(protocol_type="consumer", protocol_name=g.protocol, assignment=bytes(assignment.encode()))

    async def _heartbeat(self, req: Request, peer: Client) -> Any:
        r = kconsumer.HeartbeatResponse
        b = req.body
        code, hb = await self._beat(b.group_id, b.member_id, peer)
        if not code and hb.generation != b.generation_id:
            code = k.REBALANCE_IN_PROGRESS
        return r(error_code=code)

    async def _leave_group(self, req: Request, peer: Client) -> Any:
        r = kconsumer.LeaveGroupResponse
        b = req.body
        ids = [b.member_id] if req.version < 3 else [m.member_id for m in b.members]
        results = []
        for member_id in ids:
            code = 0
            try:
                self._allow(peer, Operation.READ, [acl_group(b.group_id)])
                await self.groups.leave(pb.LeaveGroupRequest(group=b.group_id, member_id=member_id))
            except Exception as exc:
                code = self._code(exc)
            self.kgroups.get(b.group_id, KafkaGroup()).members.pop(member_id, None)
            results.append(r.MemberResponse(member_id=member_id, error_code=code))
        first = results[0].error_code if results else 0
        return r(error_code=first if req.version < 3 else 0, members=results)

    async def _offset_commit(self, req: Request, peer: Client) -> Any:
        r = kconsumer.OffsetCommitResponse
        b = req.body
        client = f"{req.client_id}@{peer.host}"
        commits = []
        problems: dict[tuple[str, int], int] = {}
        for t in b.topics:
            for pc in t.partitions:
                try:
                    offset, vector = await self._commit_vector(client, t.name, pc.partition_index, pc.committed_offset)
                    commits.append(
                        pb.PartitionCommit(
                            topic=t.name,
                            partition=pc.partition_index,
                            vector=vector_to_proto(vector),
                            hint_offset=offset,
                            metadata=pc.committed_metadata or "",
                        )
                    )
                except Exception as exc:
                    problems[(t.name, pc.partition_index)] = self._code(exc)
        code = 0
        try:
            self._allow(peer, Operation.COMMIT, [acl_group(b.group_id)])
        except Denied as exc:
            code, commits = exc.kafka_code, []
        if commits:
            member_id = b.member_id or ""
            generation = b.generation_id_or_member_epoch if member_id else -1
            after = max((c.hlc for c in self.groups.table.of_group(b.group_id)), default=0)
            acks = self.commit_acks
            try:
                await self.groups.commit(
                    pb.CommitOffsetsRequest(
                        group=b.group_id,
                        member_id=member_id,
                        generation=generation,
                        commits=commits,
                        acks=pb.ACKS_GEO
                        if acks.kind is AckKind.GEO
                        else pb.ACKS_ALL
                        if acks.kind is AckKind.ALL
                        else pb.ACKS_LEADER,
                        geo_sites=acks.sites if acks.kind is AckKind.GEO else 0,
                        after_hlc=after,
                    )
                )
            except Exception as exc:
                code = self._code(exc)
        return r(
            topics=[
                r.OffsetCommitResponseTopic(
                    name=t.name,
                    partitions=[
                        r.OffsetCommitResponseTopic.OffsetCommitResponsePartition(
                            partition_index=pc.partition_index,
                            error_code=problems.get((t.name, pc.partition_index), code),
                        )
                        for pc in t.partitions
                    ],
                )
                for t in b.topics
            ]
        )

    async def _offset_fetch(self, req: Request, peer: Client) -> Any:
        r = kconsumer.OffsetFetchResponse
        b = req.body
        client = f"{req.client_id}@{peer.host}"
        rt, rp = r.OffsetFetchResponseTopic, r.OffsetFetchResponseTopic.OffsetFetchResponsePartition
        try:
            self._allow(peer, Operation.READ, [acl_group(b.group_id)])
            answer = await self.groups.fetch_committed(
                pb.FetchCommittedRequest(group=b.group_id, wait_caught_up_ms=COMMITTED_WAIT_MS)
            )
        except Exception as exc:
            return r(error_code=self._code(exc), topics=[])
        committed = {(c.topic, c.partition): c for c in answer.offsets}
        wanted = (
            [(t.name, list(t.partition_indexes)) for t in b.topics]
            if b.topics is not None
            else [(t, sorted(p for (tt, p) in committed if tt == t)) for t in sorted({t for t, _ in committed})]
        )
        out = []
        for topic, partitions in wanted:
            parts = []
            for index in partitions:
                c = committed.get((topic, index))
                if c is None:
                    parts.append(rp(partition_index=index, committed_offset=-1, metadata="", committed_leader_epoch=-1))
                    continue
                try:
                    offset = await self._resume_offset(client, c)
                    parts.append(
                        rp(
                            partition_index=index,
                            committed_offset=offset,
                            metadata=c.metadata,
                            committed_leader_epoch=-1,
                        )
                    )
                except LeaderUnreachable as exc:
                    # The whole answer (v2 on), so the client asks again: a partition's error could make it fall back
                    # to auto.offset.reset, and read again what the group committed.
                    if req.version < 2:
                        parts.append(rp(partition_index=index, committed_offset=-1, error_code=exc.kafka_code))
                        continue
                    log.info("group %r: OffsetFetch answered %s: %s", b.group_id, k.COORDINATOR_LOAD_IN_PROGRESS, exc)
                    return r(error_code=k.COORDINATOR_LOAD_IN_PROGRESS, topics=[])
                except Exception as exc:
                    parts.append(rp(partition_index=index, committed_offset=-1, error_code=self._code(exc)))
            out.append(rt(name=topic, partitions=parts))
        return r(topics=out)

    async def _list_groups(self, req: Request, peer: Client) -> Any:
        r = kadmin.ListGroupsResponse
        answer = await self.groups.list_groups()
        return r(
            groups=[
                r.ListedGroup(
                    group_id=g.group, protocol_type="consumer", group_state="Stable" if g.members else "Empty"
                )
                for g in answer.groups
            ]
        )

    async def _describe_groups(self, req: Request, peer: Client) -> Any:
        r = kadmin.DescribeGroupsResponse
        dg, dm = r.DescribedGroup, r.DescribedGroup.DescribedGroupMember
        a = kconsumer.ConsumerProtocolAssignment
        out = []
        await self.groups.sync()
        for name in req.body.groups:
            try:
                self._allow(peer, Operation.READ, [acl_group(name)])
            except Denied as exc:
                out.append(
                    dg(
                        group_id=name,
                        error_code=exc.kafka_code,
                        group_state="",
                        protocol_type="",
                        protocol_data="",
                        members=[],
                    )
                )
                continue
            g = self.groups.coordinator.groups.get(name)
            kg = self.kgroups.get(name, KafkaGroup())
            if g is None or not g.members:
                state = "Empty" if any(True for _ in self.groups.table.of_group(name)) else "Dead"
                out.append(dg(group_id=name, group_state=state, protocol_type="consumer", protocol_data="", members=[]))
                continue
            members = []
            for member_id, m in sorted(g.members.items()):
                km = kg.members.get(member_id)
                by_topic: dict[str, list[int]] = {}
                for topic, index in m.assignment:
                    by_topic.setdefault(topic, []).append(index)
                assignment = a(
                    version=0,
                    assigned_partitions=[
                        a.TopicPartition(topic=t, partitions=ps) for t, ps in sorted(by_topic.items())
                    ],
                )
                members.append(
                    dm(
                        member_id=member_id,
                        client_id=m.client_id,
                        client_host=km.client_host if km else "",
                        member_metadata=km.metadata if km else b"",
                        member_assignment=bytes(assignment.encode()),
                    )
                )
            out.append(
                dg(
                    group_id=name,
                    group_state="Stable",
                    protocol_type="consumer",
                    protocol_data=kg.protocol,
                    members=members,
                )
            )
        return r(groups=out)

    # -- errors -------------------------------------------------------------------------------------------------

    def _code(self, exc: BaseException, topic: str | None = None, index: int = 0) -> int:
        """Kafka's code for ``exc``; for a partition this node does not serve (or no longer leads: a newer leader
        fenced or sealed its segment), the view's (``NOT_LEADER_OR_FOLLOWER``, or ``LEADER_NOT_AVAILABLE`` when the
        site has no leader for it)."""
        if isinstance(exc, NotLeader | Fenced | SegmentSealed) and topic is not None:
            return self._view([(topic, index)]).not_served(topic, index)
        code = k.error_code(exc)
        if code == k.UNKNOWN_SERVER_ERROR:
            log.warning("kafka gateway: unexpected %s: %s", type(exc).__name__, exc)
        return code

    _handlers: dict[int, Callable[[KafkaGateway, Request, Client], Pending]] = {
        1: _fetch,
        2: _list_offsets,
        3: _metadata,
        8: _offset_commit,
        9: _offset_fetch,
        10: _find_coordinator,
        11: _join_group,
        12: _heartbeat,
        13: _leave_group,
        14: _sync_group,
        15: _describe_groups,
        16: _list_groups,
        18: _api_versions,
        19: _create_topics,
        20: _delete_topics,
        22: _init_producer_id,
        23: _offset_for_leader_epoch,
        32: _describe_configs,
        33: _topic_changes,
        35: _describe_log_dirs,
        37: _topic_changes,
        42: group_admin.delete_groups,
        44: _topic_changes,
        47: group_admin.offset_delete,
        60: _describe_cluster,
    }


def _config_entry(d: Described, synonyms: bool, docs: bool) -> Any:
    e = kadmin.DescribeConfigsResponse.DescribeConfigsResult.DescribeConfigsResourceResult
    return e(
        name=d.name,
        value=d.value,
        read_only=d.name not in BY_NAME or BY_NAME[d.name].key is None,  # a topic's mapped configs can be altered
        config_source=d.source,
        is_sensitive=False,
        synonyms=[e.DescribeConfigsSynonym(name=n, value=v, source=src) for n, v, src in d.synonyms]
        if synonyms
        else [],
        config_type=d.config_type,
        documentation=d.documentation if docs else None,
    )
