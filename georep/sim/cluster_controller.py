"""The controller's shell on a simulated node: elections, repair copies and fills, rolls asked of leaders.

What a node's controller decides is :class:`~cluster.controller.Controller`'s, inside its
:class:`~cluster.node.NodeCore`; this carries its effects out for both cluster simulators, as
``georep/server/cluster_member.py`` does on a node. **One controller rule** (issue 21): the controller is the
node whose replica leads the site's metadata log (:meth:`SimControllers.leads_metadata`), the simulated Raft
leader: the lowest-numbered node that can lead the log now (the fabric says which can: a running voter that
reaches a majority). A simulator whose controller repairs (``georep/sim/cluster.py``) says what a segment weighs
and carries out the copies (a subclass); without it the controller plans none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from cluster.controller import AskRoll, RepairCopy
from cluster.node import ProposeElection
from cluster.site_state import AddMember, ReplaceMember, SegmentInfo
from georep.sim.checker import InvariantViolation
from georep.sim.cluster_model import SegKey
from topology.ids import NodeId

if TYPE_CHECKING:
    from georep.sim.cluster_node import SimNode, SimNodes


class SimControllers:
    """The controller's shell on every node of one simulated site (see the module docstring)."""

    def __init__(self, shells: SimNodes) -> None:
        self.shells = shells
        self.fabric = shells.fabric

    def metadata_leader(self) -> NodeId | None:
        """The simulated metadata log's leader: the lowest-numbered node whose replica can lead it now."""
        nodes = self.shells.nodes
        return next((nid for nid in sorted(nodes) if self.fabric.can_lead_metadata(nodes[nid])), None)

    def leads_metadata(self, node: SimNode) -> bool:
        """Whether ``node`` is the controller now, the one controller rule (``cluster/controller.py``): its replica
        leads the metadata log. A node that wakes from a pause still holding a controller keeps it until its next
        tick says otherwise, and no other node takes over while one that can lead the log still holds one."""
        if self.metadata_leader() != node.id:
            return False
        if node.core is not None and node.core.controller is not None:
            return True
        return not any(
            n.core is not None and n.core.controller is not None and self.fabric.can_lead_metadata(n)
            for nid, n in sorted(self.shells.nodes.items())
            if nid != node.id
        )

    def elect(self, node: SimNode, eff: ProposeElection) -> None:
        core = node.core
        ctl = core.controller if core is not None else None
        if ctl is None:
            return
        command = eff.command
        self.fabric.propose(node, command, lambda result: ctl.proposal_done(command))

    def repair_sizes(self) -> Callable[[SegmentInfo], int] | None:
        """What a sealed segment weighs, for repair placement; None: the controller plans no repair here."""
        return None

    def repair_copy(self, node: SimNode, eff: RepairCopy) -> None:
        raise InvariantViolation(f"CORE: a controller without repair planned {eff}")

    def ask_roll(self, node: SimNode, eff: AskRoll) -> None:
        self.fabric.counts.rolls_to_widen += eff.widen
        self.fabric.send(node, eff.leader, self.shells.roll_asked, eff.key, eff.segment_id)

    def repair_done(self, node: SimNode, copy_id: int, target: NodeId, end: int) -> None:
        ctl = node.core.controller if node.core is not None else None
        if ctl is None:
            return
        whole, cmd = ctl.repair_answered(copy_id, target, end, self.fabric.view(node))
        if not whole:
            self.repair_gave_up(ctl.repair_failed(copy_id))
            return
        if isinstance(cmd, AddMember | ReplaceMember):
            self.fabric.propose(node, cmd, lambda result: ctl.recorded(copy_id))

    def repair_gave_up(self, effect: object) -> None:
        """A repair copy failed (a short copy, a timeout): it is planned afresh."""

    def short_reported(self, node: SimNode, member: NodeId, short: frozenset[SegKey]) -> None:
        ctl = node.core.controller if node.core is not None else None
        if ctl is not None:
            ctl.reported_short(member, set(short))
