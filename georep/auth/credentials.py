"""Users' SCRAM credentials as replicated records (pure): the Kafka listener's SASL users (``georep user``).

A credential is a record of the site's ACL table (:class:`~georep.metadata.store.AclRecord`) keyed
``credential <mechanism> <user>`` whose ``data`` is the credential's stored form
(:meth:`georep.auth.sasl.ScramCredential.encode`: salt, iterations, stored key, server key; never the
password). Keeping it in that table reuses everything ACLs have: last-writer-wins with tombstones
(``georep/auth/acl_sync.py`` says why it converges), the metadata store of one-node sites and the Raft
``PutAcl`` command of multi-node ones, and the ACL sync over every link (``ListAcls`` with
``with_credentials``). A user's principal is ``client:<user>``: the ACLs of that principal apply to it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from georep.auth.acl_sync import stamp_above
from georep.auth.principal import InvalidPrincipal, Principal, parse_principal
from georep.auth.sasl import ScramCredential, hash_name
from georep.metadata.store import AclRecord

PREFIX = "credential "


class InvalidUser(ValueError):
    """A user name or credential that cannot be stored; the message says the accepted form."""


def user_principal(user: str) -> Principal:
    """``client:<user>``; raises :class:`InvalidUser` for a name a principal cannot carry."""
    try:
        return parse_principal(f"client:{user}")
    except InvalidPrincipal as exc:
        raise InvalidUser(f"invalid user name {user!r}: {exc}") from None


def key(mechanism: str, user: str) -> str:
    hash_name(mechanism)
    user_principal(user)
    return f"{PREFIX}{mechanism} {user}"


def is_credential(entry: str) -> bool:
    return entry.startswith(PREFIX)


def parse_key(entry: str) -> tuple[str, str]:
    """(mechanism, user) of a credential key; raises :class:`InvalidUser` (ValueError)."""
    parts = entry.removeprefix(PREFIX).split(" ")
    if not is_credential(entry) or len(parts) != 2:
        raise InvalidUser(f"invalid credential key {entry!r}: expected 'credential <mechanism> <user>'")
    try:
        key(parts[0], parts[1])
    except ValueError as exc:
        raise InvalidUser(f"invalid credential key {entry!r}: {exc}") from None
    return parts[0], parts[1]


def check_record(record: AclRecord) -> None:
    """Raises ``ValueError`` for a credential record this node cannot read (a newer version's, or damaged)."""
    mechanism, _user = parse_key(record.entry)
    if record.present:
        ScramCredential.decode(mechanism, record.data)


def put(credential: ScramCredential, user: str, held: AclRecord | None, now_ms: int, site: str) -> AclRecord:
    """The record ``georep user add`` makes at ``site``: stamped above the one held."""
    return AclRecord(key(credential.mechanism, user), True, stamp_above(held, now_ms), site, credential.encode())


def remove(mechanism: str, user: str, held: AclRecord | None, now_ms: int, site: str) -> AclRecord:
    """The tombstone ``georep user remove`` makes at ``site``."""
    return AclRecord(key(mechanism, user), False, stamp_above(held, now_ms), site)


@dataclass(frozen=True, slots=True)
class UserInfo:
    user: str
    mechanism: str
    iterations: int
    record: AclRecord


def users(table: Mapping[str, AclRecord]) -> list[UserInfo]:
    """The credentials in force, by user then mechanism (the unreadable ones left out)."""
    out = []
    for entry in sorted(table):
        record = table[entry]
        if not (record.present and is_credential(entry)):
            continue
        try:
            mechanism, user = parse_key(entry)
            out.append(UserInfo(user, mechanism, ScramCredential.decode(mechanism, record.data).iterations, record))
        except ValueError:
            continue
    return sorted(out, key=lambda u: (u.user, u.mechanism))


class CredentialLookup:
    """``(mechanism) -> (user) -> credential`` over a store's table, read at each call (a new user or a removed
    one takes effect at the next authentication)."""

    def __init__(self, table: Callable[[], Mapping[str, AclRecord]]) -> None:
        self._table = table

    def __call__(self, mechanism: str, user: str) -> ScramCredential | None:
        try:
            record = self._table().get(key(mechanism, user))
            if record is None or not record.present:
                return None
            return ScramCredential.decode(mechanism, record.data)
        except ValueError:
            return None
