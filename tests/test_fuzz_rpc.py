"""Every RPC of a real node, fed malformed, truncated, lying and oversized requests (Hypothesis).

Each must be answered with a clear status (never UNKNOWN or INTERNAL, which mean a handler raised something
unplanned), the node must stay up, and its logs must stay recoverable and whole afterwards. The budget here is
short; ``bench/fuzz.py`` runs the same with a longer one.
"""

from __future__ import annotations

import os

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from georep.proto import georep_pb2 as pb
from georep.server.process import NodeProcess
from tests.support.examples import examples
from tests.support.node_api import batch, log_end, stub_for

SERVICE = pb.DESCRIPTOR.services_by_name["Node"]
METHODS = sorted(m.name for m in SERVICE.methods)
BAD_CODES = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
KEPT = "kept-out-of-the-fuzz"  # no name the fuzz draws (text of at most 40 characters, derandomized) is this
EXAMPLES = examples(int(os.environ.get("GEOREP_FUZZ_EXAMPLES", "300")))

_SCALARS = {
    FieldDescriptor.TYPE_STRING: st.one_of(st.text(max_size=40), st.sampled_from(["t", "", "a", "__georep_offsets"])),
    FieldDescriptor.TYPE_BYTES: st.one_of(st.binary(max_size=300), st.just(batch(2))),
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_INT32: st.one_of(st.integers(-(2**31), 2**31 - 1), st.integers(-2, 3)),
    FieldDescriptor.TYPE_INT64: st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(-2, 100)),
    FieldDescriptor.TYPE_UINT32: st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 3)),
    FieldDescriptor.TYPE_UINT64: st.integers(0, 2**64 - 1),
    FieldDescriptor.TYPE_ENUM: st.integers(-1, 5),
}


def fill(message: Message, draw: st.DrawFn, depth: int = 0) -> Message:
    """Random values in random fields of ``message`` (nested messages too, a few levels deep)."""
    for field in message.DESCRIPTOR.fields:
        if draw(st.booleans()):
            continue
        if field.message_type is not None:
            if field.message_type.GetOptions().map_entry:
                target = getattr(message, field.name)
                for _ in range(draw(st.integers(0, 3))):
                    target[draw(st.text(max_size=20))] = draw(st.text(max_size=20))
            elif depth < 3:
                if field.is_repeated:
                    for _ in range(draw(st.integers(0, 3))):
                        fill(getattr(message, field.name).add(), draw, depth + 1)
                else:
                    fill(getattr(message, field.name), draw, depth + 1)
            continue
        strategy = _SCALARS.get(field.type)
        if strategy is None:
            continue
        if field.is_repeated:
            getattr(message, field.name).extend(draw(st.lists(strategy, max_size=3)))
        else:
            setattr(message, field.name, draw(strategy))
    return message


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, bytes]:
    name = draw(st.sampled_from(METHODS))
    method = SERVICE.methods_by_name[name]
    data = fill(pb.DESCRIPTOR.message_types_by_name[method.input_type.name]._concrete_class(), draw)
    raw = data.SerializeToString()
    how = draw(st.sampled_from(["valid", "truncated", "garbage", "appended", "flipped"]))
    if how == "truncated" and raw:
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    elif how == "garbage":
        raw = draw(st.binary(max_size=500))
    elif how == "appended":
        raw += draw(st.binary(min_size=1, max_size=50))
    elif how == "flipped" and raw:
        i = draw(st.integers(0, len(raw) - 1))
        raw = raw[:i] + bytes([raw[i] ^ draw(st.integers(1, 255))]) + raw[i + 1 :]
    return name, raw


def call(channel: grpc.Channel, name: str, raw: bytes) -> grpc.StatusCode:
    method = SERVICE.methods_by_name[name]
    path = f"/{SERVICE.full_name}/{name}"
    identity = lambda b: b  # noqa: E731 - raw bytes both ways
    try:
        if method.client_streaming:
            stream = channel.stream_stream(path, request_serializer=identity, response_deserializer=identity)
            for _ in stream(iter([raw]), timeout=2):
                break
        elif method.server_streaming:
            stream = channel.unary_stream(path, request_serializer=identity, response_deserializer=identity)
            for _ in stream(raw, timeout=2):
                break
        else:
            channel.unary_unary(path, request_serializer=identity, response_deserializer=identity)(raw, timeout=5)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def fuzzed_node(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    node = NodeProcess(site="a", data_dir=tmp_path_factory.mktemp("fuzz") / "a").start()
    channel, stub = stub_for(node)
    stub.CreateTopic(pb.CreateTopicRequest(name="t", partitions=2))  # the fuzz's topic: it may alter or delete it
    stub.CreateTopic(pb.CreateTopicRequest(name=KEPT, partitions=1))
    stub.Produce(pb.ProduceRequest(topic=KEPT, partition=0, batch=batch(2)))
    yield node, channel, stub
    channel.close()
    node.kill9()


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(requests())
def test_every_rpc_answers_bad_input_with_a_clear_status(fuzzed_node, request) -> None:  # type: ignore[no-untyped-def]
    _node, channel, _stub = fuzzed_node
    name, raw = request
    code = call(channel, name, raw)
    assert code not in BAD_CODES, f"{name} answered {code.name} to {raw[:80]!r}"


def test_after_the_fuzzing_the_node_is_up_and_its_logs_recover_whole(fuzzed_node) -> None:  # type: ignore[no-untyped-def]
    """Checked on a topic the fuzz never names: a valid DeleteTopic of ``t`` is one of its requests."""
    node, _channel, stub = fuzzed_node
    assert stub.Health(pb.HealthRequest(), timeout=5).site == "a"
    assert log_end(stub, KEPT, 0) == 2
    stub.Produce(pb.ProduceRequest(topic=KEPT, partition=0, batch=batch(3)))
    assert log_end(stub, KEPT, 0) == 5
    log = (node.data_dir / "node.log").read_text()
    assert "Traceback" not in log and "Exception calling application" not in log
    node.kill9()
    node.start()  # recovery after kill -9 finds every log whole
    _channel, again = stub_for(node)
    assert log_end(again, KEPT, 0) == 5
