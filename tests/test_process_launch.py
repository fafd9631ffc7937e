"""A node forked from the tests' preloaded server (tests/support/forkserver.py) behaves as one started by Popen:
it serves, stops and resumes on SIGSTOP/SIGCONT, reports -9 when killed, exits 0 on SIGTERM, logs to its file, and
runs with the environment and working directory of the moment it is launched."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import grpc
import pytest

from georep.proto import georep_pb2 as pb
from georep.server import process
from georep.server.process import NodeProcess
from tests.support import forkserver
from tests.support.node_api import stub_for


def test_a_forked_node_serves_pauses_dies_and_stops_as_a_popen_one_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(process, "launcher", forkserver.fork_launcher)
    node = NodeProcess(site="a", data_dir=tmp_path / "a")
    try:
        node.start()
        assert isinstance(node.proc, forkserver.ForkedNode)
        channel, stub = stub_for(node)
        stub.CreateTopic(pb.CreateTopicRequest(name="orders", partitions=1), timeout=10)
        node.proc.send_signal(signal.SIGSTOP)
        with pytest.raises(grpc.RpcError) as stopped:
            stub.ListTopics(pb.ListTopicsRequest(), timeout=0.5)
        assert stopped.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert node.proc.poll() is None  # stopped, not exited
        node.proc.send_signal(signal.SIGCONT)
        assert "orders" in [t.name for t in stub.ListTopics(pb.ListTopicsRequest(), timeout=10).topics]
        channel.close()

        # A variable set and a directory entered after the fork server started reach the fork: the client command
        # finds the node through GEOREP_BOOTSTRAP alone, and writes its listing to its log.
        monkeypatch.setenv("GEOREP_BOOTSTRAP", node.address)
        monkeypatch.chdir(tmp_path)
        lister = process.launcher([sys.executable, "-m", "georep.cli", "topic", "list"], tmp_path / "list.log")
        assert isinstance(lister, forkserver.ForkedNode)
        assert lister.wait(30) == 0, (tmp_path / "list.log").read_text()
        assert "orders" in [line.split()[0] for line in (tmp_path / "list.log").read_text().splitlines() if line]

        node.kill9()
        assert node.proc.returncode == -signal.SIGKILL
        node.listen = node.metrics_listen = "127.0.0.1:0"  # its port may be another's by now
        node.start()  # again, from the same data dir
        assert node.stop() == 0
        assert "stopped cleanly" in (tmp_path / "a" / "node.log").read_text()
        assert f"serving on {node.address}" in (tmp_path / "a" / "node.log").read_text()
    finally:
        node.kill9()


def test_a_variable_read_when_grpc_or_python_loads_sends_the_node_to_popen() -> None:
    server = forkserver.read_at_load({"PATH": "/bin", "GRPC_VERBOSITY": "ERROR"})
    assert forkserver.read_at_load({"PATH": "/usr/bin", "GEOREP_BOOTSTRAP": "x:1"}) == server  # read when used
    assert forkserver.read_at_load({"GRPC_VERBOSITY": "DEBUG"}) != server  # gRPC read it when the server loaded it
    assert forkserver.read_at_load({"PYTHONHASHSEED": "1"}) != server
