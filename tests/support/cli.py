"""The ``georep`` command run as a user runs it: a subprocess of this interpreter."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from georep.server.process import NODE_INFO


def georep(
    *args: str, stdin: bytes = b"", env: dict[str, str] | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "georep.cli", *args],
        input=stdin,
        capture_output=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def ok(result: subprocess.CompletedProcess[bytes]) -> str:
    assert result.returncode == 0, result.stderr.decode()
    return result.stdout.decode()


def wait_for_node_files(process: subprocess.Popen[str], node_dirs: list[Path], timeout_s: float) -> None:
    """Until every one of ``node_dirs`` holds its node.json (each node serves), with ``process`` still running."""
    deadline = time.monotonic() + timeout_s
    while not all((d / NODE_INFO).exists() for d in node_dirs):
        assert process.poll() is None, process.communicate()[1][-4000:]
        assert time.monotonic() < deadline, f"not every node served within {timeout_s} s: {node_dirs}"
        time.sleep(0.1)


def start_up(topology: Path, data: Path, node_dirs: list[Path], timeout_s: float = 60) -> subprocess.Popen[str]:
    """``georep up`` in the background, once every node of ``node_dirs`` serves."""
    up = subprocess.Popen(
        [sys.executable, "-m", "georep.cli", "up", "--topology", str(topology), "--data-dir", str(data)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_node_files(up, node_dirs, timeout_s)
    return up


def serve_once(argv: list[str], data: Path, **popen: Any) -> str:
    """Run the node ``argv`` (its data dir ``data``) until it serves, stop it with SIGTERM; its stderr. It must
    exit 0."""
    node = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **popen)
    try:
        wait_for_node_files(node, [data], 60)
        assert json.loads((data / NODE_INFO).read_text())["pid"] == node.pid
    finally:
        node.send_signal(signal.SIGTERM)
        err: str = node.communicate(timeout=60)[1]
    assert node.returncode == 0, err[-4000:]
    return err
