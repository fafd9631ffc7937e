"""What a principal may do: the decisions every front end asks (the gRPC port's RPC table,
``georep/security/acl_rpc.py``, and the Kafka gateway's), from the site's ACL entries, its super-users and its
topology. Pure: the entries and the topology come in as functions the caller reads its state through, at each
call, so an ``acl add`` or a new topology takes effect at the next call."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from georep.auth.acl import CLUSTER, DEFAULT_SUPER_USERS, AclEntry, Decision, Operation, Resource, authorize
from georep.auth.acl_replication import pull_decision, repair_decision
from georep.auth.principal import Principal
from topology.model import Topology

MEMO_MAX = 4096


class Policy:
    """What decisions depend on: the site, its super-users, its ACL entries and its topology (read at each call,
    so an ``acl add`` or a new topology takes effect at the next call)."""

    def __init__(
        self,
        own_site: str,
        entries: Callable[[], Iterable[AclEntry]],
        topology: Callable[[], Topology | None] = lambda: None,
        super_users: Iterable[Principal] = DEFAULT_SUPER_USERS,
    ) -> None:
        self.own_site = own_site
        self.entries = entries
        self.topology = topology
        self.super_users = tuple(super_users)
        # Decisions of the current entries (a produce stream asks the same one per batch); emptied when the
        # entries change (AclCache hands out a new list then) or the memo is full.
        self._memo: dict[tuple[Principal, Operation, Resource], Decision] = {}
        self._memo_of: object = None

    def _decide(
        self, entries: list[AclEntry], principal: Principal, operation: Operation, resource: Resource
    ) -> Decision:
        if entries is not self._memo_of or len(self._memo) >= MEMO_MAX:
            self._memo = {}
            self._memo_of = entries
        key = (principal, operation, resource)
        decision = self._memo.get(key)
        if decision is None:
            decision = self._memo[key] = authorize(
                entries, principal, operation, resource, self.own_site, self.super_users
            )
        return decision

    def acl(self, principal: Principal, operation: Operation, resources: Iterable[Resource]) -> Decision:
        """Allowed if allowed on every resource; else the first refusal (by resource)."""
        entries = self.entries()
        if not isinstance(entries, list):
            entries = list(entries)
        decision: Decision | None = None
        for resource in sorted(set(resources)):
            decision = self._decide(entries, principal, operation, resource)
            if not decision.allowed:
                return decision
        if decision is None:  # no resource named: the operation itself, on the cluster
            return self._decide(entries, principal, operation, CLUSTER)
        return decision

    def open(self, principal: Principal) -> Decision:
        return Decision(True, principal, Operation.READ, CLUSTER, "site metadata, open to every certified principal")

    def in_site(self, principal: Principal) -> Decision:
        if principal.site == self.own_site:
            return Decision(True, principal, Operation.ADMIN, CLUSTER, f"a node of site {self.own_site}")
        return Decision(
            False,
            principal,
            Operation.ADMIN,
            CLUSTER,
            f"the segment service is for the nodes of site {self.own_site} only",
        )

    def pull(self, principal: Principal, topics: Iterable[str]) -> Decision:
        return pull_decision(self.topology(), self.own_site, principal, topics)

    def admin_or_pull(self, principal: Principal) -> Decision:
        admin = self.acl(principal, Operation.ADMIN, [CLUSTER])
        return admin if admin.allowed else self.pull(principal, ())

    def repair(self, principal: Principal, topic_name: str, origin_site: str) -> Decision:
        return repair_decision(self.topology(), self.own_site, principal, topic_name, origin_site)
