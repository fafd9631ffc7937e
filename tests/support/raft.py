"""What the tests that run real Raft stores (pysyncobj) on 127.0.0.1 share."""

from __future__ import annotations

import socket

from cluster.raft_store import RaftTiming

# Shorter than the defaults so that elections take a fraction of a second, but with room for two busy cores.
FAST = RaftTiming(
    election_timeout_min_s=0.3,
    election_timeout_max_s=0.6,
    heartbeat_interval_s=0.05,
    connection_timeout_s=1.0,
    reconnect_interval_s=0.2,
    leader_step_down_s=1.0,
    write_timeout_s=5.0,
)


def free_ports(count: int) -> list[int]:
    """Ports the kernel picked as free (bound together, so they differ), released for the stores to bind."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
