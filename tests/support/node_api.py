"""Raw gRPC calls on one node: the batches, fetches and error checks the node API tests share."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.record.batch import RecordInput, encode_batch
from georep.server.process import NodeProcess
from tests.support.channels import open_channel


def stub_for(node: NodeProcess) -> tuple[grpc.Channel, pbg.NodeStub]:
    channel = open_channel(node.address)
    return channel, pbg.NodeStub(channel)


def batch(n: int = 3, *, pid: int = -1, seq: int = -1, value_bytes: int = 10) -> bytes:
    records = [RecordInput(b"k%d" % i, bytes([65 + i % 26]) * value_bytes, (), 1_000 + i) for i in range(n)]
    return encode_batch(records, producer_id=pid, producer_epoch=0 if pid >= 0 else -1, base_sequence=seq)


def fetch_all(stub: pbg.NodeStub, topic: str, partition: int, end: int) -> bytes:
    """Every batch from the start of the partition up to local offset ``end``."""
    out = b""
    if end == 0:
        return out
    stream = stub.Fetch(pb.FetchRequest(topic=topic, partition=partition, offset=0, max_wait_ms=100))
    for resp in stream:
        out += resp.batches
        if resp.next_offset >= end:
            stream.cancel()
            break
    return out


def log_end(stub: pbg.NodeStub, topic: str, partition: int) -> int:
    resp = stub.ListOffsets(pb.ListOffsetsRequest(topic=topic, partition=partition, position=pb.START_LATEST))
    return resp.offsets[0].offset


def expect_error(code: grpc.StatusCode, call: Callable[..., object], *args: object) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call(*args)
    assert info.value.code() == code, info.value.details()
    return str(info.value.details())
