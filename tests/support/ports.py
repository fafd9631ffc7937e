"""Ports for the servers a test starts when their addresses must be known before they start (a topology file,
a Raft group, a proxy's listen address).

A port the kernel hands out for ``bind(("127.0.0.1", 0))`` lies in its ephemeral range, the range it also draws
every outgoing connection's local port from. Released and bound again a moment later by the server, such a port
can meanwhile be taken by any connection on the machine (another test's client, a node's pull), and the server
fails to start. So the ports here come from below the ephemeral range, which the kernel never hands out on its
own, split between the pytest-xdist workers so that two workers never pick the same one. Each worker walks its
share in order from a random start, so a port is used again only after the whole share, and checks that each
port can be bound before returning it.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

SPAN = 12_000  # ports below the ephemeral range shared by the workers
PORT_MIN = 1024  # privileged below

_cursor: int | None = None


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _share() -> range:
    high = _ephemeral_low()
    low = max(PORT_MIN, high - SPAN)
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0) % workers
    width = (high - low) // workers
    return range(low + worker * width, low + (worker + 1) * width)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int) -> list[int]:
    """``count`` different ports of 127.0.0.1 that nothing holds now and no other worker will pick."""
    global _cursor
    share = _share()
    if _cursor is None:
        _cursor = random.randrange(len(share))
    found: list[int] = []
    for _ in range(len(share)):
        port = share[_cursor % len(share)]
        _cursor += 1
        if _bindable(port):
            found.append(port)
            if len(found) == count:
                return found
    raise RuntimeError(f"fewer than {count} free ports in {share.start}-{share.stop - 1}: is something holding them?")


def free_port() -> int:
    return free_ports(1)[0]
