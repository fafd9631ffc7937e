"""Every repeated field of every request is bounded; a request over a bound is refused whole, naming the field."""

from __future__ import annotations

import grpc
import pytest

from georep.broker.errors import InvalidRequest
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.proto.bounds import REPEATED_DEFAULT_MAX, REPEATED_MAX, check_bounds
from tests.support.node_api import expect_error


def entries(n: int) -> pb.VectorOffset:
    return pb.VectorOffset(entries=[pb.OriginSeq(site="a", epoch=e, next_seq=1) for e in range(n)])


def test_every_named_bound_is_a_real_repeated_field() -> None:
    for name in REPEATED_MAX:
        message, field = name.split(".")
        descriptor = pb.DESCRIPTOR.message_types_by_name[message]
        assert descriptor.fields_by_name[field].is_repeated, name


def test_bounds_hold_at_any_depth_and_name_the_field() -> None:
    limit = REPEATED_MAX["VectorOffset.entries"]
    check_bounds(pb.FetchRequest(topic="t", vector=entries(limit)))
    with pytest.raises(InvalidRequest, match=f"VectorOffset.entries has {limit + 1} entries; at most {limit}"):
        check_bounds(pb.FetchRequest(topic="t", vector=entries(limit + 1)))
    nested = pb.ReplicateRequest(wants=[pb.PullWant(topic="t"), pb.PullWant(topic="t", have=entries(limit + 1))])
    with pytest.raises(InvalidRequest, match=r"VectorOffset\.entries"):
        check_bounds(nested)
    # a field the table does not name still has the default bound
    status = pb.GroupDescription(members=[pb.GroupMember() for _ in range(REPEATED_DEFAULT_MAX + 1)])
    with pytest.raises(InvalidRequest, match=r"GroupDescription\.members"):
        check_bounds(status)
    check_bounds(pb.ProduceRequest(topic="t", batch=b"x"))  # nothing repeated: nothing to walk


def test_a_node_refuses_a_request_over_a_bound_and_stays_up(api: pbg.NodeStub) -> None:
    limit = REPEATED_MAX["VectorOffset.entries"]
    stream = api.Fetch(pb.FetchRequest(topic="t", partition=0, vector=entries(limit + 1), max_wait_ms=10))
    details = expect_error(grpc.StatusCode.INVALID_ARGUMENT, lambda: next(iter(stream)))
    assert "VectorOffset.entries" in details and "split the request" in details
    assert api.Health(pb.HealthRequest(), timeout=5).site == "a"
