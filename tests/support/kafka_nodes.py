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


def group_reads(bootstrap: str, topic: str, group: str, n: int, wait_s: float, idle_s: float) -> list[str]:
    """What a confluent-kafka consumer of ``group`` reads of ``topic`` from its committed positions: ``n`` records
    (within ``wait_s``), or for ``n`` 0 what comes within ``idle_s``; committed as it goes, closed after."""
    import confluent_kafka  # the callers skip without it

    consumer = confluent_kafka.Consumer(
        {"bootstrap.servers": bootstrap, "group.id": group, "auto.offset.reset": "earliest"}
    )
    consumer.subscribe([topic])
    got: list[str] = []
    deadline = time.monotonic() + (wait_s if n else idle_s)
    try:
        while time.monotonic() < deadline and (n == 0 or len(got) < n):
            m = consumer.poll(0.5)
            if m is not None and m.error() is None:
                got.append((m.value() or b"").decode())
        consumer.commit(asynchronous=False) if got else None
    finally:
        consumer.close()
    return got
