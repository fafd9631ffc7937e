"""A node's Kafka listener, for the Kafka gateway tests (tests/test_kafka_*.py)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from typing import Any

from georep.server.process import NODE_INFO, NodeProcess

KAFKA_ARGS = ["--kafka-listen", "127.0.0.1:0"]


def kafka_address(node: NodeProcess) -> str:
    """The Kafka listener's HOST:PORT, from the node's ``node.json``."""
    address = json.loads((node.data_dir / NODE_INFO).read_text()).get("kafka", "")
    assert address, f"node of site {node.site} serves no Kafka listener (start it with {KAFKA_ARGS})"
    return str(address)


def read_frame(sock: socket.socket) -> bytes:
    """One Kafka response frame from ``sock`` (a plain or TLS socket), without its 4-byte size."""

    def exactly(n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = sock.recv(n - len(out))
            assert chunk, "the gateway closed the connection"
            out += chunk
        return out

    return exactly(int.from_bytes(exactly(4), "big"))


def poll_until(what: str, step: Callable[[], Any], done: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Call ``step`` (a client's poll) until ``done``; bounded."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting until {what}")
        step()


def values(n: int, tag: str) -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(n)]
