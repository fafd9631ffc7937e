"""Every RPC of a node mapped to what it does to which resource: the one table authorization reads.

:data:`NODE_ACCESS` (``georep.v1.Node``) and :data:`SEGMENTS_ACCESS` (``georep.v1.Segments``) give each method
the request type and a rule from the request to a :class:`~georep.auth.acl.Decision`. No handler checks
anything itself: ``georep/server/rpc.py`` runs the rule before the handler (and on every message of a client
stream), and a denial ends the call with ``PERMISSION_DENIED`` and the decision's message. A method missing
from the table is denied to everyone but super-users (:meth:`Policy.decide`), so a new RPC is closed until it
is given a rule.

The rules:

* topics: ``Produce``/``ProduceStream`` need produce; ``Fetch`` and ``ListOffsets`` consume (``ListOffsets``'s
  Kafka offset ask: the site's own nodes only); ``CreateTopic``
  create_topic (``CreateTopics`` on every topic it names);
* groups: ``GroupHeartbeat`` (join), ``LeaveGroup``, ``FetchCommitted``, ``DescribeGroup`` need read on the
  group, and the heartbeat consume on every subscribed topic; ``CommitOffsets`` needs commit on the group
  and consume on every committed topic (as Kafka's OffsetCommit needs READ on the group and the topic);
* audits: ``ScanDigests`` needs audit on the topic (digests, not records); ``FetchBatch`` too, besides its
  replication rule below: the live audit fetches the few batches whose CRCs differ between sites, by coordinate,
  to name the first differing record;
* the cluster: ``SetLink``, ``DecommissionNode``, ``Scrub``, ``PutAcl``, ``PutUser``, ``ListUsers`` need admin;
* replication: ``Replicate``, ``ReportHeld`` (and ``ListAcls``, unless admin) follow the topology's links,
  ``FetchBatch`` its reach (``georep/auth/acl_replication.py``); a pull and a held report are made only in
  the caller's own name (the claims a report makes are then checked one by one: ``held_claim_refusal``);
* what describes the site without its data (``Health``, ``ListTopics``, ``DescribeTopic``, ``SiteStatus``,
  ``ClusterStatus``, ``ListGroups``) is open to every principal the site's CA certified;
* ``georep.v1.Segments`` is the site's inside: only its own nodes.

Super-users (the site's own nodes, ``client:admin``) may make every call, so their requests are neither parsed
for the check nor screened message by message (:meth:`Authorizer.unrestricted`): the site's own traffic and the
operator's pay only for reading the principal.

The decisions are pure (:class:`~georep.auth.policy.Policy`, which the Kafka gateway asks too); this table
names the RPCs and their protobuf requests, and :class:`Authorizer` is the thin shell that takes the principal
from the call's peer certificate (``georep.security.tls.principal_of``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message

from georep.auth.acl import CLUSTER, Decision, Operation, PermissionDenied, group, is_super_user, topic
from georep.auth.policy import Policy
from georep.auth.principal import Principal
from georep.proto import georep_pb2 as pb

Rule = Callable[[Any, Principal, Policy], Decision]


@dataclass(frozen=True, slots=True)
class Access:
    request: type[Message]
    rule: Rule
    reads_request: bool = True  # False: the rule ignores the request, which then is not parsed to check it
    # A client stream's answer to one refused message, in place of ending the whole stream (a produce stream
    # carries batches of several topics: the others go on, and the client fails only the refused batch).
    refuse: Callable[[Any, str], Message] | None = None
    # A client stream's message that holds several requests (a multi-batch produce): what of it is allowed (None:
    # nothing) and the answer to what is refused (None: nothing), decided part by part, in place of rule and refuse.
    split: Callable[[Any, Principal, Policy], tuple[Message | None, Message | None]] | None = None


def _topic_op(operation: Operation) -> Rule:
    return lambda req, who, policy: policy.acl(who, operation, [topic(req.topic)])


def _group_read(req: Any, who: Principal, policy: Policy) -> Decision:
    return policy.acl(who, Operation.READ, [group(req.group)])


def _heartbeat(req: pb.GroupHeartbeatRequest, who: Principal, policy: Policy) -> Decision:
    decision = policy.acl(who, Operation.READ, [group(req.group)])
    return decision if not decision.allowed else policy.acl(who, Operation.CONSUME, [topic(t) for t in req.topics])


def _commit(req: pb.CommitOffsetsRequest, who: Principal, policy: Policy) -> Decision:
    decision = policy.acl(who, Operation.COMMIT, [group(req.group)])
    if not decision.allowed or not req.commits:
        return decision
    return policy.acl(who, Operation.CONSUME, [topic(c.topic) for c in req.commits])


def _produce(req: pb.ProduceRequest, who: Principal, policy: Policy) -> Decision:
    """Produce on every topic the request writes: its one batch's, or each of its batches' (a multi-batch request)."""
    names = sorted({b.topic for b in req.batches}) if req.batches else [req.topic]
    return policy.acl(who, Operation.PRODUCE, [topic(name) for name in names])


PERMISSION_DENIED_CODE = 7  # grpc.StatusCode.PERMISSION_DENIED, as a produce response's error code carries it


def _refuse_produce(req: pb.ProduceRequest, message: str) -> pb.ProduceResponse:
    error = pb.Error(code=PERMISSION_DENIED_CODE, message=message)
    return pb.ProduceResponse(correlation_id=req.correlation_id, partition=req.partition, error=error)


def _split_produce(
    req: pb.ProduceRequest, who: Principal, policy: Policy
) -> tuple[pb.ProduceRequest | None, pb.ProduceResponse | None]:
    """A produce stream's message, batch by batch: a refused topic fails its own batches, the others go on."""
    if not req.batches:
        decision = policy.acl(who, Operation.PRODUCE, [topic(req.topic)])
        return (req, None) if decision.allowed else (None, _refuse_produce(req, decision.message))
    decisions = {
        name: policy.acl(who, Operation.PRODUCE, [topic(name)]) for name in sorted({b.topic for b in req.batches})
    }
    if all(d.allowed for d in decisions.values()):
        return req, None
    allowed = pb.ProduceRequest(acks=req.acks, geo_sites=req.geo_sites, ack_timeout_ms=req.ack_timeout_ms)
    refused = pb.ProduceResponse()
    for one in req.batches:
        decision = decisions[one.topic]
        if decision.allowed:
            allowed.batches.append(one)
        else:
            error = pb.Error(code=PERMISSION_DENIED_CODE, message=decision.message)
            refused.results.add(correlation_id=one.correlation_id, partition=one.partition, error=error)
    return (allowed if allowed.batches else None), refused


def _fetch_batch(req: pb.FetchBatchRequest, who: Principal, policy: Policy) -> Decision:
    """A peer's repair (the topology's reach), or an auditor's drill into a batch whose CRC differs (audit on the
    topic): the refusal names the audit operation, the one a person is given with ``georep acl add``."""
    repair = policy.repair(who, req.topic, req.origin_site)
    return repair if repair.allowed else policy.acl(who, Operation.AUDIT, [topic(req.topic)])


def _open_access(request: type[Message]) -> Access:
    return Access(request, _open, reads_request=False)


def _admin_access(request: type[Message]) -> Access:
    return Access(request, _admin, reads_request=False)


def _open(req: Any, who: Principal, policy: Policy) -> Decision:
    return policy.open(who)


def _admin(req: Any, who: Principal, policy: Policy) -> Decision:
    return policy.acl(who, Operation.ADMIN, [CLUSTER])


def _list_offsets(req: pb.ListOffsetsRequest, who: Principal, policy: Policy) -> Decision:
    """consume on the topic; a Kafka offset ask (a group coordinator's, issue 23) only from the site's own nodes
    (super-users): it sets another client's fetch filter."""
    if req.WhichOneof("spec") == "kafka" and not is_super_user(who, policy.own_site, policy.super_users):
        return Decision(
            False,
            who,
            Operation.CONSUME,
            topic(req.topic),
            f"a Kafka offset ask comes only from a node of site {policy.own_site} (a group's coordinator)",
        )
    return policy.acl(who, Operation.CONSUME, [topic(req.topic)])


def _replicate(req: pb.ReplicateRequest, who: Principal, policy: Policy) -> Decision:
    decision = policy.pull(who, [w.topic for w in req.wants])
    if decision.allowed and who.site != policy.own_site and req.dst_site and req.dst_site != who.site:
        return Decision(
            False,
            who,
            Operation.REPLICATE,
            CLUSTER,
            f"the pull names site {req.dst_site} as its destination, but the caller's certificate is "
            f"site {who.site}'s: a site pulls only for itself",
        )
    return decision


def _report_held(req: pb.ReportHeldRequest, who: Principal, policy: Policy) -> Decision:
    """A site reports in its own name, and only a node of this site passes a report on: what the report claims
    is then checked claim by claim against the topology (``held_claim_refusal``, in the handler)."""
    decision = policy.pull(who, ())
    if not decision.allowed or who.site == policy.own_site:
        return decision
    if req.forwarded:
        return Decision(
            False,
            who,
            Operation.REPLICATE,
            CLUSTER,
            f"only a node of site {policy.own_site} passes a held report on to the others",
        )
    if req.reporter != who.site:
        return Decision(
            False,
            who,
            Operation.REPLICATE,
            CLUSTER,
            f"the held report names site {req.reporter or '(none)'} as its reporter, but the caller's "
            f"certificate is site {who.site}'s: a site reports only in its own name",
        )
    return decision


def _report_interest(req: pb.ReportInterestRequest, who: Principal, policy: Policy) -> Decision:
    """A site reports what it reads in its own name only (its entries are checked against the topology in the
    handler)."""
    decision = policy.pull(who, ())
    if decision.allowed and who.site != req.reporter:
        return Decision(
            False,
            who,
            Operation.REPLICATE,
            CLUSTER,
            f"the interest report names site {req.reporter or '(none)'} as its reporter, but the caller's "
            f"certificate is site {who.site}'s: a site reports only in its own name",
        )
    return decision


NODE_ACCESS: Mapping[str, Access] = {
    "CreateTopic": Access(
        pb.CreateTopicRequest, lambda req, who, policy: policy.acl(who, Operation.CREATE_TOPIC, [topic(req.name)])
    ),
    "CreateTopics": Access(
        pb.CreateTopicsRequest,
        lambda req, who, policy: policy.acl(who, Operation.CREATE_TOPIC, [topic(t.name) for t in req.topics]),
    ),
    "AlterTopic": Access(
        pb.AlterTopicRequest, lambda req, who, policy: policy.acl(who, Operation.ALTER_TOPIC, [topic(req.name)])
    ),
    "AddPartitions": Access(
        pb.AddPartitionsRequest, lambda req, who, policy: policy.acl(who, Operation.ALTER_TOPIC, [topic(req.name)])
    ),
    "DeleteTopic": Access(
        pb.DeleteTopicRequest, lambda req, who, policy: policy.acl(who, Operation.DELETE_TOPIC, [topic(req.name)])
    ),
    "ListTopics": _open_access(pb.ListTopicsRequest),
    "DescribeTopic": _open_access(pb.DescribeTopicRequest),
    "Produce": Access(pb.ProduceRequest, _produce),
    "ProduceStream": Access(pb.ProduceRequest, _produce, refuse=_refuse_produce, split=_split_produce),
    "Fetch": Access(pb.FetchRequest, _topic_op(Operation.CONSUME)),
    "ListOffsets": Access(pb.ListOffsetsRequest, _list_offsets),
    "Health": _open_access(pb.HealthRequest),
    "SiteStatus": _open_access(pb.SiteStatusRequest),
    "ClusterStatus": _open_access(pb.ClusterStatusRequest),
    "ListGroups": _open_access(pb.ListGroupsRequest),
    "SetLink": _admin_access(pb.SetLinkRequest),
    "DecommissionNode": _admin_access(pb.DecommissionNodeRequest),
    "Scrub": _admin_access(pb.ScrubRequest),
    "PutAcl": _admin_access(pb.PutAclRequest),
    "PutUser": _admin_access(pb.PutUserRequest),
    "ListUsers": _admin_access(pb.ListUsersRequest),
    "ListAcls": Access(pb.ListAclsRequest, lambda req, who, policy: policy.admin_or_pull(who), False),
    "Replicate": Access(pb.ReplicateRequest, _replicate),
    "ReportHeld": Access(pb.ReportHeldRequest, _report_held),
    "ReportInterest": Access(pb.ReportInterestRequest, _report_interest),
    "FetchBatch": Access(pb.FetchBatchRequest, _fetch_batch),
    "ScanDigests": Access(pb.ScanDigestsRequest, _topic_op(Operation.AUDIT)),
    "GroupHeartbeat": Access(pb.GroupHeartbeatRequest, _heartbeat),
    "LeaveGroup": Access(pb.LeaveGroupRequest, _group_read),
    "CommitOffsets": Access(pb.CommitOffsetsRequest, _commit),
    "FetchCommitted": Access(pb.FetchCommittedRequest, _group_read),
    "DescribeGroup": Access(pb.DescribeGroupRequest, _group_read),
}


def _in_site(req: Any, who: Principal, policy: Policy) -> Decision:
    return policy.in_site(who)


SEGMENTS_ACCESS: Mapping[str, Access] = {
    name: Access(request, _in_site, reads_request=False)
    for name, request in (
        ("AppendSegment", pb.SegmentAppendRequest),
        ("FenceSegments", pb.FenceSegmentsRequest),
        ("SealSegment", pb.SealSegmentRequest),
        ("ReadSegment", pb.ReadSegmentRequest),
        ("ListSegments", pb.ListSegmentsRequest),
        ("CopySegment", pb.CopySegmentRequest),
        ("RollSegment", pb.RollSegmentRequest),
        ("ScanSegmentDigests", pb.ScanSegmentDigestsRequest),
    )
}


def decide(
    table: Mapping[str, Access], method: str, request: Message, principal: Principal, policy: Policy
) -> Decision:
    """The decision for one call (a method not in the table: super-users only)."""
    access = table.get(method)
    if access is None:
        return policy.acl(principal, Operation.ADMIN, [CLUSTER])
    return access.rule(request, principal, policy)


NO_PRINCIPAL = (
    "the peer certificate names no georep principal (a SAN URI georep:<principal> or a CN such as "
    "client:alice): issue it with 'georep certs init' or put the principal in its SAN"
)


class Authorizer:
    """The shell around the table: the principal from the call, the decision, a :class:`PermissionDenied`.

    Only a node that serves TLS has one (a plaintext node authorizes nothing: ``--insecure``). So here a call
    without a principal came over TLS with a certificate that names none, and is refused.
    """

    def __init__(self, policy: Policy, principal_of: Callable[[Any], Principal | None]) -> None:
        self.policy = policy
        self.principal_of = principal_of

    def principal(self, method: str, context: Any) -> Principal:
        principal = self.principal_of(context)
        if principal is None:
            raise PermissionDenied(f"{method} refused: {NO_PRINCIPAL}")
        return principal

    def unrestricted(self, principal: Principal) -> bool:
        """A super-user: every call is allowed whatever its request, so none is parsed or screened."""
        return is_super_user(principal, self.policy.own_site, self.policy.super_users)

    def create_refusal(self, context: Any, name: str) -> str | None:
        """None if the call's principal may create topic ``name`` (as ``CreateTopic`` asks), else why not: a
        produce that would create its topic on first use asks it (``georep/server/auto_create.py``)."""
        principal = self.principal("CreateTopic", context)
        if self.unrestricted(principal):
            return None
        decision = self.policy.acl(principal, Operation.CREATE_TOPIC, [topic(name)])
        return None if decision.allowed else decision.message

    def check(
        self,
        table: Mapping[str, Access],
        method: str,
        principal: Principal,
        data: bytes,
        parse: Callable[[type[Message], bytes], Message],
    ) -> Message | None:
        """Raise :class:`PermissionDenied` unless ``principal`` may make this call with this request (``data``); the
        request, if the rule had to parse it (so that the handler does not parse it again), else None."""
        access = table.get(method)
        parsed = None if access is None or not access.reads_request else parse(access.request, data)
        decision = decide(table, method, pb.HealthRequest() if parsed is None else parsed, principal, self.policy)
        if not decision.allowed:
            raise PermissionDenied.of(decision)
        return parsed

    def screen(
        self,
        table: Mapping[str, Access],
        method: str,
        principal: Principal,
        data: bytes,
        parse: Callable[[type[Message], bytes], Message],
    ) -> tuple[Message | None, Message | None]:
        """One message of a client stream, parsed: what of it the handler gets (None: nothing), and the refusal to
        answer the rest with (None: nothing refused). A refused message of a method without a refusal
        (:attr:`Access.refuse`) raises :class:`PermissionDenied`, which ends the stream."""
        access = table[method]
        request = parse(access.request, data)
        if access.split is not None:
            return access.split(request, principal, self.policy)
        decision = decide(table, method, request, principal, self.policy)
        if decision.allowed:
            return request, None
        if access.refuse is None:
            raise PermissionDenied.of(decision)
        return None, access.refuse(request, decision.message)

    @staticmethod
    def per_message(table: Mapping[str, Access], method: str) -> bool:
        """Whether each message of a client stream must be checked (its rule reads the request)."""
        access = table.get(method)
        return access is not None and access.reads_request
