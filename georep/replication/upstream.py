"""dst's choices about one upstream site: which of its nodes to pull from, and which partitions to ask it for. Pure.

**Which node.** Every node of a site answers a pull for the whole site (a node of a multi-node site passes on the
partitions other nodes lead), so dst pulls from one node at a time and moves to the next when its stream fails:
when the call ends with an error, and also when it goes silent for the idle timeout. A node that is frozen
(SIGSTOP, a stuck disk) or cut off behind a half-open connection never ends the call: only the silence shows it,
and a puller that moved on errors alone would wait on it forever. The simulator's silent nodes catch that rule
(``tests/test_sim.py``). :class:`UpstreamNodes` is the choice; :class:`~georep.replication.session.PullSession`
tells it of each failed stream and opens the next one at its :attr:`~UpstreamNodes.current` node.

**Which partitions.** A stream asks only for partitions that the upstream has (its last topic listing: a want
for one it lacks would fail the whole stream), whose topic is not in conflict over this link (a different
partition count at the two sites: nothing is merged), and that this node serves (a node of a multi-node site pulls
only the partitions it leads; its wants change, and the stream reopens, as leadership moves): :func:`pullable`.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence

from topology.ids import SiteId

PartitionKey = tuple[str, int]
FAILURES = ("down", "timeout")  # the kinds of a failed stream: ended with an error, or silent for the idle timeout


class UpstreamNodes:
    """The nodes of one upstream site, in the topology's order, and the one dst pulls from now."""

    __slots__ = ("_index", "addresses", "moves")

    def __init__(self, addresses: Sequence[str]) -> None:
        if not addresses:
            raise ValueError("an upstream site needs at least one node address")
        self.addresses = tuple(addresses)
        self.moves = 0  # how often a failure moved the pull to another node
        self._index = 0

    @property
    def current(self) -> str:
        return self.addresses[self._index]

    def stream_failed(self, kind: str) -> bool:
        """The stream at :attr:`current` failed (``kind``: one of :data:`FAILURES`); True if the next stream goes
        to another node."""
        if kind not in FAILURES or len(self.addresses) < 2:
            return False
        self._index = (self._index + 1) % len(self.addresses)
        self.moves += 1
        return True


def pullable(
    key: PartitionKey,
    src: SiteId,
    upstream_partitions: Mapping[str, int],
    conflicts: Container[tuple[str, SiteId]],
    served: Container[PartitionKey],
) -> bool:
    """Whether a stream from ``src`` may ask for partition ``key``: ``src`` has it (``upstream_partitions``: its
    topics' partition counts, as it last listed them), the topic is not in conflict with ``src``, and this node
    serves the partition."""
    topic, index = key
    return index < upstream_partitions.get(topic, 0) and (topic, src) not in conflicts and key in served
