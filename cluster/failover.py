"""Who takes over every partition a dead node leads: one plan, applied by one metadata command. Pure.

**Why one command.** After a node's death the controller used to propose one ``ElectLeader`` per partition the node
led. Group commit packed them into a few log entries, but at 10,000 partitions that is still several entries, and
each one that commits starts recoveries on the survivors (fences, copies, seals, opens: thousands of them), whose
load starves the Raft thread that must still commit the rest: the Raft leadership moved, the new controller waited
a settling time, and the last partitions got a leader a minute later. So the controller proposes one
:class:`~cluster.site_state.FailOver` per dead node, a few dozen bytes whatever the partition count (the bounded
command size of issue 22), and every replica runs :func:`plan_failover` when it applies it: every partition of the
dead node gets its new leader in the same log entry, before any recovery starts.

**Why the replicas may plan at apply.** The plan reads only the state and the command (the proposer's ``now_ms``
and session timeout, and the node the controller avoids), never a clock: every replica computes the same leaders
from the same log, like any other command. It is a compare-and-set on the dead node's last heartbeat: if it
heartbeated after the controller saw it silent, or is live at the command's ``now_ms``, nothing moves (it is not
dead; plan again).

**The rule, per partition whose leader is the dead node** (in topic, then partition order):

* with an open segment, the candidates are the *live members of that segment's ensemble* other than the dead node
  (the in-sync replicas: only a member holds a prefix of the open segment, see ``plan_leadership``); with none
  live, the partition keeps its dead leader and waits for a member to come back;
* with no open segment (nothing to recover), every live node is a candidate;
* among the candidates: not draining first, then the one that leads the fewest partitions (counting the moves
  planned before it, so the dead node's partitions spread over the survivors), then not ``avoid`` (the controller:
  its node's death would stop the metadata too), then the one that heartbeated last, then the lowest id; the
  partition's epoch goes up by one.

**No acknowledged record is lost** (I6), by the argument of ``cluster/leadership.py`` and ``cluster/recovery.py``:
an acknowledged batch of the open segment lies below the LAC, so it is fsynced on ``ack_quorum`` (AQ) members of
its ensemble E; the new leader is a member, and its recovery fences and reads E - AQ + 1 members (itself among
them), which include one of any AQ, and seals at or above the highest end it reads; sealed segments are untouched.
The epoch bump fences the dead leader should it come back. ``tests/test_failover.py`` checks these properties
against the recovery rule itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from topology.ids import NodeId

if TYPE_CHECKING:
    from cluster.site_state import SiteState

PartitionKey = tuple[str, int]


def failover_blocker(
    state: SiteState, dead: NodeId, last_heartbeat_ms: int | None, now_ms: int, session_ms: int
) -> str:
    """Why ``dead`` may not be failed over now ('' if it may): unknown, heartbeated since the plan, or live."""
    info = state.node(dead)
    if info is None:
        return f"node {dead} is not in the site's metadata"
    if info.last_heartbeat_ms != last_heartbeat_ms:
        return f"node {dead} heartbeated since the controller saw it silent: it is alive, plan again"
    if info.is_live(now_ms, session_ms):
        return f"node {dead} heartbeated less than {session_ms} ms before {now_ms}: it is not dead"
    return ""


def plan_failover(
    state: SiteState, dead: NodeId, now_ms: int, session_ms: int, avoid: NodeId | None = None
) -> dict[PartitionKey, NodeId]:
    """The new leader of every partition ``dead`` leads that has a candidate (see the module docstring); the
    partitions without one are left out. Deterministic: the same state and arguments give the same plan."""
    live = {info.node: info for info in state.live_nodes(now_ms, session_ms) if info.node != dead}
    led: dict[NodeId, int] = {}
    for info in state.partitions():
        if info.leader is not None and info.leader in live:
            led[info.leader] = led.get(info.leader, 0) + 1

    def order(node: NodeId) -> tuple[bool, int, bool, int, int]:
        info = live[node]
        return (info.draining, led.get(node, 0), node == avoid, -(info.last_heartbeat_ms or 0), node)

    everyone = sorted(live)
    plan: dict[PartitionKey, NodeId] = {}
    for info in state.partitions():
        if info.leader != dead:
            continue
        open_segment = info.open_segment
        pool = [m for m in open_segment.ensemble if m in live] if open_segment is not None else everyone
        if pool:
            chosen = min(pool, key=order)
            led[chosen] = led.get(chosen, 0) + 1
            plan[(info.topic, info.partition)] = chosen
    return plan
