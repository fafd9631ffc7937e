"""What one node of an idle three-node site spends per tick on the partitions it leads (issue 22).

Run from the repository root: ``.venv/bin/python bench/lead_tick_idle.py 10000``. In one process, no Raft, no
disk: a ``SiteState`` of one topic of N partitions and a ``NodeCore`` (node 1) leading every third of them, each
lead active with its segment on nodes 1, 2, 3 and every member connected (an idle site once every partition is
written to: ``bench/metadata_idle.py``'s node leads nothing, so it does not see this). Then ``NodeCore.tick`` every
0.5 s of simulated time; it prints the process CPU per tick, as a share of one core.
"""

import argparse
import time

from cluster.lead import PartitionLead, Phase
from cluster.node import NodeConfig, NodeCore
from cluster.quorum import SegmentQuorum
from cluster.site_state import CreateTopic, NodeHeartbeat, RegisterNode, SiteState
from georep.metadata.topics import TopicSpec
from topology.ids import LeaderEpoch, NodeId, SegmentId

TICK_MS = 500
TICKS = 40

_parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
_parser.add_argument("partitions", type=int, nargs="?", default=10_000, help="partitions of the one topic")
N = _parser.parse_args().partitions
NODES = (NodeId(1), NodeId(2), NodeId(3))
state = SiteState()
for n in NODES:
    state.apply(RegisterNode(n, f"127.0.0.1:{9000 + n}"))
    state.apply(NodeHeartbeat(n, 0, 1 << 40, 0))
state.apply(CreateTopic(TopicSpec("big", N)))
core = NodeCore(NodeId(1), NodeConfig(3, 2, 3_000, TICK_MS, TICK_MS, 1_000), {})
for p in range(0, N, 3):
    lead = PartitionLead(NodeId(1), ("big", p), LeaderEpoch(1), core.config.lead(), None)
    lead.phase = Phase.ACTIVE
    lead.quorum = SegmentQuorum(SegmentId(0), 0, NODES, 2, LeaderEpoch(1), NodeId(1))
    core.leads[("big", p)] = lead
view = state.copy()
started = time.process_time()
for i in range(TICKS):
    core.tick(view, 1_000 + i * TICK_MS, False)
cpu = (time.process_time() - started) / TICKS
print(
    f"{N} partitions, {len(core.leads)} leads on this node: NodeCore.tick {1000 * cpu:.2f} ms CPU per "
    f"{TICK_MS} ms tick = {100 * cpu / (TICK_MS / 1000):.2f}% of a core"
)
