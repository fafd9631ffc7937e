"""The live audit's client call: a partition's batch digests from a node (``ScanDigests``, docs/audit.md).

Synchronous on purpose: Spark executors (``spark_jobs/``) call it from plain Python threads. Over mutual TLS
the caller's principal needs the ``audit`` operation on the topic (``georep acl add ... --operation audit``);
reading digests is not reading records, so ``consume`` is neither needed nor enough.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from georep.client.errors import Operation, from_rpc_error
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg


def scan_digests(
    channel: grpc.Channel,
    topic: str,
    partition: int,
    from_offset: int = 0,
    to_offset: int | None = None,
    all_replicas: bool = False,
    *,
    max_digests: int = 0,
    timeout_s: float | None = None,
) -> Iterator[pb.BatchDigest]:
    """One digest per stored batch of ``topic``-``partition`` holding an offset in ``[from_offset, to_offset)``
    (``to_offset`` None: up to the partition's readable end when the scan starts), in log order; with
    ``all_replicas`` (a multi-node site), one per copy of each batch, ``node`` naming its holder.

    Raises :class:`georep.client.errors.GeorepError` subclasses: ``UnknownTopic`` (NOT_FOUND),
    ``OffsetOutOfRange``, ``InvalidRequest``, ``PermissionDenied``, ``NodeUnavailable``...
    """
    request = pb.ScanDigestsRequest(
        topic=topic, partition=partition, from_offset=from_offset, all_replicas=all_replicas, max_digests=max_digests
    )
    if to_offset is not None:
        request.to_offset = to_offset
    stream = pbg.NodeStub(channel).ScanDigests(request, timeout=timeout_s)
    try:
        for response in stream:
            yield from response.digests
    except grpc.RpcError as exc:
        raise from_rpc_error(exc, operation=Operation.FETCH) from None
    finally:
        stream.cancel()
