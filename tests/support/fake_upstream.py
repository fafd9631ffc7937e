"""A fake upstream site's gRPC service: the calls a downstream's puller makes of it, each answered by the fake."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import grpc

from georep.proto import georep_pb2 as pb


class FakeUpstream(Protocol):
    def list_topics(self, request: bytes, context: Any) -> pb.ListTopicsResponse: ...
    def list_acls(self, request: bytes, context: Any) -> pb.ListAclsResponse: ...
    def report_held(self, request: bytes, context: Any) -> pb.ReportHeldResponse: ...
    def replicate(self, request: bytes, context: Any) -> Iterator[pb.ReplicateResponse]: ...


def upstream_handler(site: FakeUpstream) -> grpc.GenericRpcHandler:
    def serialize(message: Any) -> bytes:
        return message.SerializeToString()  # type: ignore[no-any-return]

    def unary(fn: Any) -> grpc.RpcMethodHandler[Any, Any]:
        return grpc.unary_unary_rpc_method_handler(fn, None, serialize)

    return grpc.method_handlers_generic_handler(
        "georep.v1.Node",
        {
            "ListTopics": unary(site.list_topics),
            "ListAcls": unary(site.list_acls),
            "ReportHeld": unary(site.report_held),
            "Replicate": grpc.unary_stream_rpc_method_handler(site.replicate, None, serialize),
        },
    )
