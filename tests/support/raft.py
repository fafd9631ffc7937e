"""What the tests that run real Raft stores (pysyncobj) on 127.0.0.1 share."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from cluster.site_state import Applied, RegisterNode
from georep.metadata.topics import TopicSpec
from georep.raft.store import RaftMetadataStore, RaftTiming
from tests.support.ports import free_ports
from topology.ids import NodeId

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


WAIT_S = 10.0


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting until {what}")
        time.sleep(0.02)


class Site:
    """Three metadata nodes of one site, started and stopped by index (0, 1, 2)."""

    def __init__(self, tmp_path: Path, size: int = 3, password: bytes | None = None, timing: RaftTiming = FAST) -> None:
        self.tmp_path = tmp_path
        self.addresses = [f"127.0.0.1:{port}" for port in free_ports(size)]
        self.stores: dict[int, RaftMetadataStore] = {}
        self.password = password  # the site's Raft secret; None: a plaintext port
        self.timing = timing

    def start(self, *indexes: int) -> None:
        for i in indexes or range(len(self.addresses)):
            assert i not in self.stores, f"node {i} is already running"
            self.stores[i] = RaftMetadataStore(
                self.addresses[i], self.addresses, self.tmp_path / f"node{i}", self.timing, password=self.password
            )

    def stop(self, i: int, snapshot: bool = True) -> None:
        self.stores.pop(i).close(snapshot=snapshot)

    def close(self) -> None:
        for i in sorted(self.stores):
            self.stop(i)

    def __getitem__(self, i: int) -> RaftMetadataStore:
        return self.stores[i]

    def running(self) -> list[RaftMetadataStore]:
        return [self.stores[i] for i in sorted(self.stores)]

    def leader(self) -> int:
        """Wait until the running nodes agree on one leader among them; its index."""
        found: list[int] = []

        def agreed() -> bool:
            leaders = [i for i, store in self.stores.items() if store.is_leader]
            addresses = {store.leader_address for store in self.stores.values()}
            if len(leaders) == 1 and addresses == {self.addresses[leaders[0]]}:
                found[:] = leaders
                return True
            return False

        wait_until(agreed, f"nodes {sorted(self.stores)} agree on one Raft leader")
        return found[0]

    def converged(self, expected: dict[str, object] | None = None) -> dict[str, object]:
        """Wait until every running node holds the same state (``expected`` if given); that state."""
        snapshots: list[dict[str, object]] = []

        def same() -> bool:
            snapshots[:] = [store.state().snapshot() for store in self.running()]
            return all(s == snapshots[0] for s in snapshots) and (expected is None or snapshots[0] == expected)

        wait_until(same, f"nodes {sorted(self.stores)} hold the same state")
        return snapshots[0]


def ok(result: object) -> Applied:
    assert isinstance(result, Applied), result
    return result


def populate(store: RaftMetadataStore, topic: str = "t") -> None:
    for node in (1, 2, 3):
        ok(store.propose(RegisterNode(NodeId(node), f"127.0.0.1:{9000 + node}")))
    store.create_topic(TopicSpec(topic, 2))
