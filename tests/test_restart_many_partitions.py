"""A node with many partitions and a small open-file bound: kill -9, restart, every acknowledged record served."""

from __future__ import annotations

import os

import pytest

from georep.proto import georep_pb2 as pb
from georep.record.batch import iter_headers
from tests.support.node_api import batch, fetch_all, log_end, stub_for

PARTITIONS = 600
MAX_OPEN_FILES = 150
SLACK = 150  # sockets, the Raft-free node's own files, the interpreter's; far below 3 per partition


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.slow
def test_every_acknowledged_record_is_served_after_kill9_with_many_partitions(start_node) -> None:  # type: ignore[no-untyped-def]
    node = start_node(extra_args=["--max-open-files", str(MAX_OPEN_FILES)])
    channel, stub = stub_for(node)
    stub.CreateTopic(pb.CreateTopicRequest(name="big", partitions=PARTITIONS), timeout=120)
    acked: dict[int, int] = {}
    for round_ in range(2):
        for p in range(PARTITIONS):
            if round_ and p % 3:
                continue  # a second batch on a third of them: some partitions end above others
            resp = stub.Produce(pb.ProduceRequest(topic="big", partition=p, batch=batch(2 + p % 3)), timeout=30)
            acked[p] = resp.base_offset + 2 + p % 3
    assert open_fds(node.pid) <= MAX_OPEN_FILES + SLACK
    channel.close()
    node.kill9()
    node.start(timeout_s=120)
    channel, stub = stub_for(node)
    for p in range(PARTITIONS):
        assert log_end(stub, "big", p) == acked[p]
        data = fetch_all(stub, "big", p, acked[p])
        assert sum(h.records_count for h in iter_headers(data, verify=True)) == acked[p]
    assert open_fds(node.pid) <= MAX_OPEN_FILES + SLACK, "reading every partition after the restart"
    channel.close()
