"""What one node of an idle three-node site spends per tick on the site's metadata, at N partitions (issue 22).

Run from the repository root: ``.venv/bin/python bench/metadata_idle.py 10000``. In one process, no Raft: a
``SiteState`` of one topic of N partitions, each led (by nodes 1, 2, 3 in turn) with an open segment on all three;
then ticks of 0.5 s in which only the three nodes' heartbeats commit. Per tick, what node 1 does as the Raft leader
(``ClusterMember``): per committed heartbeat, its roles (``NodeCore.reconcile``) and the next leader expiry; per
tick, the load it reports (``open_loads``) and the core's tick (the controller's plan and every lead's tick). It prints
the process CPU per tick, as a share of one core.
"""

import argparse
import time

from cluster.leadership import open_loads
from cluster.node import NodeConfig, NodeCore
from cluster.site_state import (
    CreateTopic,
    ElectLeader,
    NodeHeartbeat,
    OpenSegment,
    RegisterNode,
    SiteState,
    next_leader_expiry_ms,
)
from georep.metadata.topics import TopicSpec
from offsets.coordinates import LocalOffset
from topology.ids import LeaderEpoch, NodeId

_parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
_parser.add_argument("partitions", type=int, nargs="?", default=10_000, help="partitions of the one topic")
N = _parser.parse_args().partitions
S = 3000
st = SiteState()
for n in (1, 2, 3):
    st.apply(RegisterNode(NodeId(n), f"127.0.0.1:{9000 + n}"))
    st.apply(NodeHeartbeat(NodeId(n), 0, 1 << 40, 0))
st.apply(CreateTopic(TopicSpec("big", N)))
for p in range(N):
    lead = NodeId(1 + p % 3)
    st.apply(ElectLeader("big", p, lead, LeaderEpoch(0)))
    st.apply(
        OpenSegment("big", p, LeaderEpoch(1), LocalOffset(0), (lead, NodeId(1 + (p + 1) % 3), NodeId(1 + (p + 2) % 3)))
    )
core = NodeCore(NodeId(1), NodeConfig(3, 2, S, 500, 500, 1000), {})
now = 0


def tick():
    global now
    now += 500
    for n in (1, 2, 3):
        st.apply(NodeHeartbeat(NodeId(n), now, 1 << 40, 0))
        view = st.copy()
        core.reconcile(view, now)  # on each metadata change
        next_leader_expiry_ms(view, now, S)
    view = st.copy()
    open_loads(view)  # the heartbeat's load
    core.tick(view, now, True, elected_ms=-10 * S)
    core.reconcile(view, now)


for _ in range(3):
    tick()
t = time.process_time()
for _ in range(40):
    tick()
cpu = (time.process_time() - t) / 40
print(
    f"{N} partitions: {1000 * cpu:.2f} ms CPU per 0.5 s tick = {100 * cpu / 0.5:.1f}% of a core "
    "(the Raft leader's node: plan, roles, expiry, loads, its leads' ticks)"
)
