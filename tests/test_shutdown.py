"""Issue 20, item 10: a node's stop is quiet and bounded (georep/server/shutdown.py). Once it logged "shutting
down", a second SIGTERM (or SIGINT), or its timeout, ends it with a log line naming what had not finished; an
ordinary stop stays clean.

The held-up stop is a stuck fsync thread (``GEOREP_TEST_STUCK_FSYNC_AT_STOP``), as on a disk that stops answering:
the node's last step, closing its logs, waits for it forever.
"""

from __future__ import annotations

import signal
import socket
import subprocess
from pathlib import Path

import pytest

from georep.node.serve import STUCK_FSYNC_ENV
from georep.server.process import NodeProcess
from georep.server.shutdown import EXIT_FORCED
from tests.support.ports import free_ports
from tests.support.sites import wait_until

pytestmark = pytest.mark.slow


def _node(tmp_path: Path, *flags: str) -> NodeProcess:
    return NodeProcess(
        site="a", data_dir=tmp_path / "a", listen=f"127.0.0.1:{free_ports(1)[0]}", extra_args=["--insecure", *flags]
    )


def _log(node: NodeProcess) -> str:
    return (node.data_dir / "node.log").read_text()


def _refuses_connections(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except OSError:
        return True
    return False


def _exit_code(node: NodeProcess, timeout_s: float) -> int:
    assert node.proc is not None
    try:
        return node.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        node.kill9()
        raise AssertionError(f"the node did not exit within {timeout_s} s; its log:\n{_log(node)[-2000:]}") from None


def test_an_ordinary_stop_is_clean(tmp_path: Path) -> None:
    node = _node(tmp_path).start()
    assert node.proc is not None
    node.proc.send_signal(signal.SIGTERM)
    assert _exit_code(node, 30) == 0
    logged = _log(node)
    assert "stopped cleanly" in logged and "forced" not in logged and "Traceback" not in logged


def test_a_second_sigterm_forces_a_stop_that_is_held_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STUCK_FSYNC_ENV, "1")
    node = _node(tmp_path).start()
    assert node.proc is not None
    node.proc.send_signal(signal.SIGTERM)
    wait_until("the node is shutting down", lambda: "shutting down" in _log(node), 30)
    # past "ending the calls in flight": held by the fsync thread that never returns
    wait_until("the node stopped serving", lambda: _refuses_connections(node.address), 30)
    assert node.alive(), "the stop was not held up"
    node.proc.send_signal(signal.SIGTERM)
    assert _exit_code(node, 30) == EXIT_FORCED
    logged = _log(node)
    assert "shutdown forced by a second SIGTERM:" in logged
    assert "had not finished; exiting at once with code 3" in logged
    assert "stopped cleanly" not in logged
    # and the next start recovers, as after a crash
    monkeypatch.delenv(STUCK_FSYNC_ENV)
    node.start()
    assert node.stop() == 0


def test_a_stop_that_outlasts_its_timeout_is_forced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STUCK_FSYNC_ENV, "1")
    node = _node(tmp_path, "--shutdown-timeout-ms", "2000").start()
    assert node.proc is not None
    node.proc.send_signal(signal.SIGINT)
    assert _exit_code(node, 60) == EXIT_FORCED
    logged = _log(node)
    assert "shutdown forced by its timeout (2000 ms): fsyncing and closing the logs" in logged
