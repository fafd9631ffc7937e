"""A site's ACLs from each site it pulls from (shell): the ``ListAcls`` call, then ``acl_sync.merge``.

The replicator's topic sync calls :func:`pull_acls` with every listing of an upstream's topics: ACL records go
over every link whatever its filters, and the newest record of each entry wins (``georep/auth/acl_sync.py``),
so an add or remove at one site reaches every site linked to it, directly or through others.
"""

from __future__ import annotations

import asyncio
import logging

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


async def pull_acls(
    stub: pbg.NodeAsyncStub, metadata: MetadataStore, in_site: bool, src: str, timeout_s: float
) -> list[AclRecord]:
    """Keep every record of ``src``'s that is newer than this site's; the ones kept. A failed call or write is
    logged and left to the next round (the records are still there then)."""
    try:
        resp = await stub.ListAcls(pb.ListAclsRequest(with_removed=True, with_credentials=True), timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        log.debug("listing the ACLs of site %s failed: %s", src, exc.details())
        return []
    received = []
    for msg in resp.records:
        try:
            received.append(record_from_pb(msg))
        except InvalidAcl as exc:
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
            return []
        log.info(
            "%s %s from site %s: %s",
            "credential" if is_credential(record.entry) else "ACL",
            "added" if record.present else "removed",
            src,
            record.entry,
        )
    return kept
