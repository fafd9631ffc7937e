"""The join barrier of Kafka's eager rebalance protocol, which the gateway keeps on top of georep's groups.

georep's coordinator (``cluster/groups.py``) assigns on the server and hands a member its partitions at its next
heartbeat, as KIP-848 does: a partition moves to its new owner at once, and its previous owner learns of the
rebalance only at its own next heartbeat. georep's client gives a partition up at that heartbeat too, so the two
overlap for up to a heartbeat interval. A Kafka client of the eager protocol (``range``, ``roundrobin``, the eager
``sticky``) relies on the opposite: it revokes all its partitions before it sends JoinGroup, and the broker answers
no JoinGroup of a generation before every member of the previous one has rejoined (or left, or been dropped after
the rebalance timeout). Without that barrier, a new owner could read a partition from the group's commit and
commit further while the previous owner still delivered the records it had fetched, below that commit: records a
successful commit covered, delivered again.

So a JoinGroup answers only once every Kafka member the coordinator lists has joined at the group's current
generation; this module decides who is still awaited.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

REJOIN_POLL_S = 0.05  # how often a waiting JoinGroup looks at the group again (local state: cheap)


def laggards(joined: Mapping[str, int], live: Iterable[str], generation: int) -> list[str]:
    """The Kafka members (``joined``: member id -> the generation its last JoinGroup got) that the coordinator
    still lists (``live``) and that have not joined at ``generation``: until they have, they may still own
    partitions of an older assignment. A listed member the gateway does not know (one of georep's own clients)
    revokes at its heartbeat and is not awaited."""
    return sorted(m for m in live if m in joined and joined[m] != generation)
