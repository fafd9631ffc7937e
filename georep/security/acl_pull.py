"""A site's ACLs from each site it pulls from (shell): the ``ListAcls`` call, then ``acl_sync.merge``.

The replicator's topic sync calls :func:`pull_acls` with every listing of an upstream's topics: ACL records go
over every link whatever its filters, and the newest record of each entry wins (``georep/auth/acl_sync.py``),
so an add or remove at one site reaches every site linked to it, directly or through others. Each round hands
back the upstream's ACL token of the round before (``georep/metadata/acl_token.py``), and an upstream whose table
has not changed answers no records: an idle link does not list and merge the whole table every round.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from georep.auth.acl import InvalidAcl, parse_acl_entry
from georep.auth.acl_sync import merge
from georep.auth.credentials import check_record, is_credential
from georep.metadata.store import AclRecord, MetadataStore
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.raft.store import CommandRefused, MetadataUnavailable

log = logging.getLogger(__name__)


def record_from_pb(msg: pb.AclRecord) -> AclRecord:
    """Raises :class:`InvalidAcl` for an entry this node cannot read (a newer version's): an ACL entry, or a
    user's SCRAM credential (``georep/auth/credentials.py``)."""
    record = AclRecord(msg.entry, msg.present, msg.stamp_ms, msg.site, msg.data)
    if is_credential(msg.entry):
        try:
            check_record(record)
        except ValueError as exc:
            raise InvalidAcl(str(exc)) from None
    else:
        parse_acl_entry(msg.entry)
    return record


@dataclass(frozen=True, slots=True)
class AclPull:
    """One round of the ACL sync: the records kept, and the token to ask ``changed_since`` next round."""

    kept: list[AclRecord]
    token: str  # "": list every record next round (a write failed, or src answers no token)


async def pull_acls(
    stub: pbg.NodeAsyncStub, metadata: MetadataStore, in_site: bool, src: str, timeout_s: float, since: str = ""
) -> AclPull:
    """Keep every record of ``src``'s that is newer than this site's, unless ``src``'s table is unchanged since
    ``since`` (the token of the round that kept all of it). A failed call is logged and the next round asks from
    ``since`` again; a failed write, from the start (the records are still there then)."""
    request = pb.ListAclsRequest(with_removed=True, with_credentials=True, changed_since=since)
    try:
        resp = await stub.ListAcls(request, timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        log.debug("listing the ACLs of site %s failed: %s", src, exc.details())
        return AclPull([], since)
    if resp.unchanged:
        return AclPull([], resp.acl_token)
    received = []
    for msg in resp.records:
        try:
            received.append(record_from_pb(msg))
        except InvalidAcl as exc:  # a newer version's entry: this node keeps skipping it until it is upgraded
            log.warning("ACL record from site %s skipped: %s", src, exc)
    kept = merge(metadata.acls(), received)
    for record in kept:
        try:
            if in_site:  # a Raft command: not on the event loop
                await asyncio.get_running_loop().run_in_executor(None, metadata.put_acl, record)
            else:
                metadata.put_acl(record)
        except (MetadataUnavailable, CommandRefused, OSError) as exc:
            log.warning("ACL record from site %s not kept yet (%s): %s", src, record.entry, exc)
            return AclPull([], "")
        log.info(
            "%s %s from site %s: %s",
            "credential" if is_credential(record.entry) else "ACL",
            "added" if record.present else "removed",
            src,
            record.entry,
        )
    return AclPull(kept, resp.acl_token)
