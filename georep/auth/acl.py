"""Access control lists: which principal may do what to which topic, group or the cluster. Pure.

**What an entry says.** An :class:`AclEntry` *allows* one operation on the resources a pattern matches to the
principals a pattern matches, for example ``client:alice produce topic:orders/**``. There are no deny entries:

* **Default deny.** A call is allowed only if a super-user makes it (below) or some entry matches its principal,
  its operation and its resource. With no entry at all, only super-users can do anything.
* **Order does not matter.** A set of allow entries is a union, so the decision is a monotone function of the set:
  adding an entry can only allow more, removing one only allow less, and two sites that hold the same set decide
  the same whatever order the entries arrived in (they replicate, see :mod:`georep.auth.acl_sync`). Kafka's deny
  entries need a precedence rule (deny wins); without them there is nothing to order, so nothing to get wrong.

**Principal patterns.** ``kind:name`` where ``name`` is an exact principal name (``client:alice``,
``node:a/2``), or uses the project's filter levels over the ``/``-separated name: ``client:**`` is every client,
``node:a/+`` every node of site ``a``, ``site:**`` every site. A literal level matches the same level exactly, ``+``
one level, ``**`` any number (zero included), as in ``topology/filters.py``. ``*`` alone is not accepted: write
``client:**`` (the kind is never a wildcard, so an entry meant for clients can never let in a site).

**Resources.** ``topic:<filter>``, ``group:<filter>`` (the ``+``/``**`` syntax of ``topology/filters.py``, applied to
group names as to topic names) or ``cluster``. Each operation goes with one kind of resource
(:data:`RESOURCE_OF`): produce, consume, create_topic, alter_topic, delete_topic and audit with topics; commit and
read with groups; replicate and admin with the cluster. An entry that pairs an operation with the wrong kind cannot
be built (:class:`InvalidAcl`), so it never silently matches nothing.

**Super-users** (:func:`is_super_user`) need no entry: the site's own nodes (``site:<own site>``,
``node:<own site>/N``: they run the site, and a site that could lock out its own nodes could not replicate or
recover), and the configured super-users (``client:admin`` unless ``georep node --super-user`` says otherwise).

**replicate is granted by the topology, not by entries.** Which sites may pull from this one, and which topics,
is what the topology's links say (:mod:`georep.auth.acl_replication`); an entry granting ``replicate`` would be
a second, conflicting source of truth, so :class:`AclEntry` refuses it with a pointer to the topology.

**Decisions carry their message.** :func:`authorize` returns a :class:`Decision` whose message names the principal,
the operation and the resource and, when refused, the ``georep acl add`` command that would allow it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from georep.auth.principal import KINDS, NODE, SITE, InvalidPrincipal, Principal, parse_principal
from topology.filters import ANY_LEVELS, ONE_LEVEL, InvalidTopicFilter, TopicFilter, match_levels


class InvalidAcl(ValueError):
    """An ACL entry that cannot be built; the message says which part and the accepted forms."""


class Operation(enum.StrEnum):
    PRODUCE = "produce"
    CONSUME = "consume"
    CREATE_TOPIC = "create_topic"
    ALTER_TOPIC = "alter_topic"
    DELETE_TOPIC = "delete_topic"
    COMMIT = "commit"
    READ = "read"
    REPLICATE = "replicate"
    ADMIN = "admin"
    AUDIT = "audit"  # read a topic's batch digests (ScanDigests), not its records: what an auditor needs


class ResourceKind(enum.StrEnum):
    TOPIC = "topic"
    GROUP = "group"
    CLUSTER = "cluster"


RESOURCE_OF: dict[Operation, ResourceKind] = {
    Operation.PRODUCE: ResourceKind.TOPIC,
    Operation.CONSUME: ResourceKind.TOPIC,
    Operation.CREATE_TOPIC: ResourceKind.TOPIC,
    Operation.ALTER_TOPIC: ResourceKind.TOPIC,
    Operation.DELETE_TOPIC: ResourceKind.TOPIC,
    Operation.AUDIT: ResourceKind.TOPIC,
    Operation.COMMIT: ResourceKind.GROUP,
    Operation.READ: ResourceKind.GROUP,
    Operation.REPLICATE: ResourceKind.CLUSTER,
    Operation.ADMIN: ResourceKind.CLUSTER,
}

_OPERATIONS = ", ".join(op.value for op in Operation if op is not Operation.REPLICATE)
_RESOURCE_FORMS = "'topic:<filter>' (e.g. topic:orders/**), 'group:<filter>' (e.g. group:billing) or 'cluster'"
_PRINCIPAL_FORMS = "an exact principal (client:alice, site:b, node:a/2) or a pattern (client:**, node:a/+)"
DEFAULT_SUPER_USERS: tuple[Principal, ...] = (Principal("client", "admin"),)


def parse_operation(text: str) -> Operation:
    try:
        return Operation(text.strip().lower())
    except ValueError:
        raise InvalidAcl(f"unknown operation {text!r}: use one of {_OPERATIONS}") from None


# -- resources -------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, order=True)
class Resource:
    """One thing a call touches: a topic or a group by name, or the cluster (the site) itself."""

    kind: ResourceKind
    name: str = ""

    def __str__(self) -> str:
        return "cluster" if self.kind is ResourceKind.CLUSTER else f"{self.kind}:{self.name}"


CLUSTER = Resource(ResourceKind.CLUSTER)


def topic(name: str) -> Resource:
    return Resource(ResourceKind.TOPIC, name)


def group(name: str) -> Resource:
    return Resource(ResourceKind.GROUP, name)


@dataclass(frozen=True, slots=True, order=True)
class ResourcePattern:
    """``topic:<filter>``, ``group:<filter>`` or ``cluster``."""

    kind: ResourceKind
    filter: str = ""  # the filter text; "" for the cluster
    _compiled: TopicFilter | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind is ResourceKind.CLUSTER:
            if self.filter:
                raise InvalidAcl(f"the cluster resource takes no name (got {self.filter!r}): write 'cluster'")
            return
        try:
            object.__setattr__(self, "_compiled", TopicFilter(self.filter))
        except InvalidTopicFilter as exc:
            raise InvalidAcl(f"invalid {self.kind} pattern: {exc}") from None

    def __str__(self) -> str:
        return "cluster" if self.kind is ResourceKind.CLUSTER else f"{self.kind}:{self.filter}"

    def matches(self, resource: Resource) -> bool:
        if resource.kind is not self.kind:
            return False
        if self._compiled is None:
            return True
        return self._compiled.matches(resource.name)


def parse_resource_pattern(text: str) -> ResourcePattern:
    text = text.strip()
    if text == "cluster":
        return ResourcePattern(ResourceKind.CLUSTER)
    kind, colon, rest = text.partition(":")
    if not colon or kind not in (ResourceKind.TOPIC, ResourceKind.GROUP):
        raise InvalidAcl(f"invalid resource {text!r}: use {_RESOURCE_FORMS}")
    return ResourcePattern(ResourceKind(kind), rest)


# -- principals ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, order=True)
class PrincipalPattern:
    """An exact principal, or ``kind:`` with ``+``/``**`` levels over the name (``client:**``, ``node:a/+``)."""

    kind: str
    name: str
    _levels: tuple[str, ...] | None = field(default=None, init=False, repr=False, compare=False)  # None: exact

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidAcl(
                f"invalid principal pattern {self.kind}:{self.name}: the kind must be one of "
                f"{', '.join(KINDS)}; use {_PRINCIPAL_FORMS}"
            )
        levels = self.name.split("/")
        if ONE_LEVEL in levels or ANY_LEVELS in levels:
            for level in levels:
                if level == "" or (level not in (ONE_LEVEL, ANY_LEVELS) and ("+" in level or "*" in level)):
                    raise InvalidAcl(
                        f"invalid principal pattern {self}: a wildcard must be a whole level "
                        f"('+' or '**') and no level may be empty; use {_PRINCIPAL_FORMS}"
                    )
            object.__setattr__(self, "_levels", tuple(levels))
            return
        try:
            parse_principal(str(self))
        except InvalidPrincipal as exc:
            raise InvalidAcl(f"{exc}; or a pattern such as client:** or node:a/+") from None

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}"

    @property
    def exact(self) -> bool:
        return self._levels is None

    def matches(self, principal: Principal) -> bool:
        if principal.kind != self.kind:
            return False
        if self._levels is None:
            return principal.name == self.name
        return match_levels(self._levels, principal.name.split("/"))


def parse_principal_pattern(text: str) -> PrincipalPattern:
    text = text.strip()
    if text in ("*", "**"):
        raise InvalidAcl(f"invalid principal pattern {text!r}: name the kind, for example client:** (every client)")
    kind, colon, name = text.partition(":")
    if not colon:
        raise InvalidAcl(f"invalid principal pattern {text!r}: use {_PRINCIPAL_FORMS}")
    return PrincipalPattern(kind, name)


# -- entries and decisions -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, order=True)
class AclEntry:
    """Allow ``operation`` on what ``resource`` matches to whom ``principal`` matches."""

    principal: PrincipalPattern
    operation: Operation
    resource: ResourcePattern

    def __post_init__(self) -> None:
        if self.operation is Operation.REPLICATE:
            raise InvalidAcl(
                "replicate is not granted by ACL entries: a site may pull from this one when the "
                "topology has a link from this site to it, and only the topics that link's filters "
                "carry; add or widen the link in the topology instead"
            )
        want = RESOURCE_OF[self.operation]
        if self.resource.kind is not want:
            example = {
                ResourceKind.TOPIC: "topic:orders/**",
                ResourceKind.GROUP: "group:billing",
                ResourceKind.CLUSTER: "cluster",
            }[want]
            raise InvalidAcl(
                f"operation {self.operation} applies to a {want}, not to {self.resource}: for "
                f"example '{self.principal} {self.operation} {example}'"
            )

    def __str__(self) -> str:
        return f"{self.principal} {self.operation} {self.resource}"

    def allows(self, principal: Principal, operation: Operation, resource: Resource) -> bool:
        return self.operation is operation and self.principal.matches(principal) and self.resource.matches(resource)

    def key(self) -> str:
        """The entry as one canonical string: how it is stored and replicated (``principal operation resource``)."""
        return str(self)


def acl_entry(principal: str, operation: str, resource: str) -> AclEntry:
    """An entry from its three texts; raises :class:`InvalidAcl` with the accepted forms."""
    return AclEntry(parse_principal_pattern(principal), parse_operation(operation), parse_resource_pattern(resource))


def parse_acl_entry(key: str) -> AclEntry:
    """The inverse of :meth:`AclEntry.key`."""
    parts = key.split(" ")
    if len(parts) != 3:
        raise InvalidAcl(f"invalid ACL entry {key!r}: expected 'principal operation resource'")
    return acl_entry(*parts)


def is_super_user(principal: Principal, own_site: str, super_users: Iterable[Principal] = DEFAULT_SUPER_USERS) -> bool:
    """The site's own nodes and the configured super-users (see the module docstring)."""
    if principal.kind in (SITE, NODE) and principal.site == own_site:
        return True
    return principal in super_users


@dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    principal: Principal
    operation: Operation
    resource: Resource
    because: str  # the entry or the rule that allowed it, or why nothing did

    @property
    def message(self) -> str:
        if self.allowed:
            return f"{self.principal} may {self.operation} {self.resource} ({self.because})"
        return f"{self.principal} may not {self.operation} {self.resource}: {self.because}"


def authorize(
    entries: Iterable[AclEntry],
    principal: Principal,
    operation: Operation,
    resource: Resource,
    own_site: str,
    super_users: Iterable[Principal] = DEFAULT_SUPER_USERS,
) -> Decision:
    """Whether ``principal`` may do ``operation`` on ``resource`` here (see the module docstring)."""
    if is_super_user(principal, own_site, super_users):
        return Decision(True, principal, operation, resource, "super-user")
    for entry in entries:
        if entry.allows(principal, operation, resource):
            return Decision(True, principal, operation, resource, f"ACL {entry}")
    return Decision(False, principal, operation, resource, _advice(principal, operation, resource))


def _advice(principal: Principal, operation: Operation, resource: Resource) -> str:
    if operation is Operation.REPLICATE:
        return (
            "only a site that the topology links as pulling from this site may replicate, and only the topics "
            "that link carries; add a link to the topology"
        )
    return (
        f"no ACL entry allows it (access is denied by default); an admin can allow it with "
        f"'georep acl add {principal} {operation} {resource}'"
    )


class UnknownAcl(Exception):
    """A remove of an entry the site does not hold."""

    def __init__(self, entry: AclEntry) -> None:
        super().__init__(
            f"no ACL entry '{entry}' to remove: list the entries with 'georep acl list' and remove one "
            "of those exactly as listed"
        )


class PermissionDenied(Exception):
    """A call its principal may not make. ``str(exc)`` names the principal, the operation and the resource, and says
    what would allow it (mapped to ``PERMISSION_DENIED`` by ``georep/server/status.py``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)

    @classmethod
    def of(cls, decision: Decision) -> PermissionDenied:
        return cls(decision.message)
