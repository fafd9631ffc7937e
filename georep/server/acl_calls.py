"""The admin calls of ACLs and SASL users (``georep acl``, ``georep user``): records of the site's metadata,
stamped above the one held (``georep/auth/acl_sync.py``, ``georep/auth/credentials.py``)."""

from __future__ import annotations

import asyncio
import logging
import secrets

from georep.auth.acl import UnknownAcl, acl_entry
from georep.auth.acl_sync import change, is_acl
from georep.broker.errors import InvalidRequest
from georep.metadata.acl_token import AclChanges
from georep.metadata.store import AclRecord
from georep.proto import georep_pb2 as pb
from georep.server.admin_gate import AdminGate
from georep.server.broker import Broker
from georep.server.rpc import Context, parse

log = logging.getLogger(__name__)


class AclCalls:
    """``PutAcl``, ``ListAcls``, ``PutUser``, ``ListUsers``; the changes are admin calls (``AdminGate``)."""

    def __init__(self, broker: Broker, admin: AdminGate) -> None:
        self.broker = broker
        self.admin = admin
        self.changes = AclChanges(secrets.token_hex(8))  # the ACL sync's token (georep/metadata/acl_token.py)

    async def put_acl(self, data: bytes, context: Context) -> pb.PutAclResponse:
        """``georep acl add|remove``: an ACL record stamped above the one held (georep/auth/acl_sync.py)."""
        req = parse(pb.PutAclRequest, data)
        self.admin.check(context, "PutAcl")
        entry = acl_entry(req.principal, req.operation, req.resource)
        held = self.broker.metadata.acls().get(entry.key())
        present = not req.remove
        if held is not None and held.present == present:
            return pb.PutAclResponse(record=_acl_to_pb(held), changed=False)
        if held is None and not present:
            raise UnknownAcl(entry)
        record = change(entry, present, held, self.broker.clock_ms(), self.broker.identity.site)
        if self.broker.in_site:  # a Raft command: not on the event loop
            await asyncio.get_running_loop().run_in_executor(None, self.broker.metadata.put_acl, record)
        else:
            self.broker.metadata.put_acl(record)
        log.info("ACL %s %s", "added:" if present else "removed:", entry)
        return pb.PutAclResponse(record=_acl_to_pb(record), changed=True)

    async def list_acls(self, data: bytes, context: Context) -> pb.ListAclsResponse:
        """Every record (of those asked for); or, to an ACL sync whose ``changed_since`` still holds, none."""
        req = parse(pb.ListAclsRequest, data)
        table = self.broker.metadata.acls()  # once: the token answered is this table's
        self.changes.refresh(table)
        if req.changed_since and self.changes.unchanged_since(req.changed_since):
            return pb.ListAclsResponse(acl_token=self.changes.token, unchanged=True)
        return pb.ListAclsResponse(
            records=[
                _acl_to_pb(table[k])
                for k in sorted(table)
                if (req.with_removed or table[k].present) and (req.with_credentials or is_acl(k))
            ],
            acl_token=self.changes.token,
        )

    async def put_user(self, data: bytes, context: Context) -> pb.PutUserResponse:
        """``georep user add|remove``: a credential record (or its tombstone) stamped above the one held."""
        from georep.auth import credentials
        from georep.auth.sasl import ScramCredential

        req = parse(pb.PutUserRequest, data)
        self.admin.check(context, "PutUser")
        try:
            held = self.broker.metadata.acls().get(credentials.key(req.mechanism, req.user))
            now, site = self.broker.clock_ms(), self.broker.identity.site
            if req.remove:
                if held is None or not held.present:
                    raise InvalidRequest(
                        f"user {req.user!r} has no {req.mechanism} credential: list the users with 'georep user list'"
                    )
                record = credentials.remove(req.mechanism, req.user, held, now, site)
            else:
                credential = ScramCredential(req.mechanism, req.salt, req.iterations, req.stored_key, req.server_key)
                record = credentials.put(credential, req.user, held, now, site)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        if self.broker.in_site:  # a Raft command: not on the event loop
            await asyncio.get_running_loop().run_in_executor(None, self.broker.metadata.put_acl, record)
        else:
            self.broker.metadata.put_acl(record)
        log.info("user %s %s (%s)", req.user, "removed" if req.remove else "stored", req.mechanism)
        out = _acl_to_pb(record)
        out.data = ""
        return pb.PutUserResponse(record=out, changed=True)

    async def list_users(self, data: bytes, context: Context) -> pb.ListUsersResponse:
        from georep.auth import credentials

        parse(pb.ListUsersRequest, data)
        self.admin.check(context, "ListUsers")
        return pb.ListUsersResponse(
            users=[
                pb.UserInfo(
                    user=u.user,
                    mechanism=u.mechanism,
                    iterations=u.iterations,
                    stamp_ms=u.record.stamp_ms,
                    site=u.record.site,
                )
                for u in credentials.users(self.broker.metadata.acls())
            ]
        )


def _acl_to_pb(record: AclRecord) -> pb.AclRecord:
    return pb.AclRecord(
        entry=record.entry, present=record.present, stamp_ms=record.stamp_ms, site=record.site, data=record.data
    )
