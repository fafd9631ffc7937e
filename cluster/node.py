"""One node of a multi-node site as one state machine, in the style of etcd raft's ``RawNode``. Pure.

A node of a multi-node site leads some partitions, is a member of many segments' ensembles, and may be the
site's controller. :class:`NodeCore` is all of its decisions; its shells carry out the effects: the node
(``georep/server/cluster_member.py`` over gRPC, the Raft store and its ``ReplicaStore``) and both cluster
simulators (``georep/sim/cluster_node.py``, driven by ``georep/sim/cluster.py`` and
``georep/sim/geo_cluster.py``). No shell keeps a copy of a rule (issue 21):

=================================================  ===========================================================
decision                                           home
=================================================  ===========================================================
start, stop or ask again to lead each partition    :meth:`NodeCore.reconcile` (``leadership.role_step``), with
                                                   this incarnation's epochs (below)
recover, open, write, roll one partition; the      :class:`~cluster.lead.PartitionLead` (``SegmentRecovery``,
resend rule; the release limit                     ``plan_open``, ``SegmentQuorum``, ``roll_seal_at``)
a member's append, fence, copy; the seals it       :mod:`cluster.member` (``ReplicaGuard``, ``cut_after_seal``)
learns
elections, repair passes, rolls asked of leaders   :class:`~cluster.controller.Controller` (``plan_leadership``,
                                                   ``plan_repair``): one controller rule
the producers' table a segment starts with and     :mod:`cluster.producer_snapshot`
each seal carries
=================================================  ===========================================================

**Events in**: a tick (``now_ms``, the node's view, whether its replica leads the metadata), a new view
(:meth:`NodeCore.reconcile`), and each answer for a partition it leads (:meth:`NodeCore.step` with the lead's
event: fence and copy answers, proposal results, member acks, broken and restored streams, appends).
**Effects out**: the lead's (:data:`~cluster.lead.LeadEffect`: fence, copy, propose a seal or an open, stream
to a member, release acks, ...), :class:`ProposeEpoch` (a re-election of itself), :class:`ProposeElection`
(the controller's), and the controller's repair copies and rolls.

**This incarnation's epochs.** ``role_step`` must know whether the current epoch was granted after this
incarnation of the node started: an earlier one may have written under an older grant. The shell builds the
core with every partition's epoch as its view holds them once it holds everything committed at start (a read
barrier): an epoch at or below that was granted before, and the node asks for a new one before it leads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from cluster import leadership
from cluster.controller import AskRoll, Controller, ControllerConfig, RepairCopy, controller_step
from cluster.lead import LeadConfig, LeadContext, LeadEffect, PartitionLead, Phase
from cluster.site_state import ElectLeader, FailOver, Result, SiteState
from cluster.topic_settings import ack_quorum_of, replication_factor_of
from georep.metadata.topics import TopicSpec
from topology.ids import LeaderEpoch, NodeId

PartitionKey = tuple[str, int]


@dataclass(frozen=True, slots=True)
class NodeConfig:
    replication_factor: int
    ack_quorum: int
    session_timeout_ms: int
    tick_ms: int
    retry_ms: int
    roll_wait_ms: int
    reconnect_ms: int = 0
    repair_every_ms: int = 1_000
    repair_delay_ms: int = 30_000
    max_concurrent_copies: int = 2

    def lead(self, spec: TopicSpec | None = None) -> LeadConfig:
        """A lead of a partition of ``spec``: its new segments open on the topic's replication factor (the
        site's by default) with the topic's ack quorum (likewise), never on fewer nodes than that quorum, which
        each segment needs to ack."""
        aq = ack_quorum_of(spec, self.ack_quorum)
        rf = max(replication_factor_of(spec, self.replication_factor), aq)
        return LeadConfig(rf, aq, self.retry_ms, self.roll_wait_ms, self.reconnect_ms, site_ack_quorum=self.ack_quorum)

    def controller(self) -> ControllerConfig:
        return ControllerConfig(
            self.session_timeout_ms,
            self.tick_ms,
            self.replication_factor,
            self.repair_every_ms,
            self.repair_delay_ms,
            self.max_concurrent_copies,
        )


@dataclass(frozen=True, slots=True)
class ProposeEpoch:
    """Propose ``command`` (this node re-elected on the current epoch) before it may lead; answer
    :meth:`NodeCore.epoch_asked`."""

    key: PartitionKey
    command: ElectLeader


@dataclass(frozen=True, slots=True)
class ProposeElection:
    """The controller proposes ``command`` (an election, or a dead node's failover); answer
    :meth:`Controller.proposal_done`."""

    command: ElectLeader | FailOver


@dataclass(frozen=True, slots=True)
class Leading:
    """This node starts leading ``key`` in ``epoch`` (the lead's own effects follow)."""

    key: PartitionKey
    epoch: LeaderEpoch


NodeEffect = LeadEffect | ProposeEpoch | ProposeElection | Leading | RepairCopy | AskRoll


class NodeCore:
    """See the module docstring."""

    def __init__(self, me: NodeId, config: NodeConfig, epochs_at_start: Mapping[PartitionKey, LeaderEpoch]) -> None:
        self.me = me
        self.config = config
        self.epochs_at_start = dict(epochs_at_start)
        self.leads: dict[PartitionKey, PartitionLead] = {}
        self.given_up: dict[PartitionKey, LeaderEpoch] = {}  # the newest epoch it gave up, per partition
        self.asked: dict[PartitionKey, LeaderEpoch] = {}  # its re-elections in flight
        self.controller: Controller | None = None
        # The view version the roles were last reconciled with, while nothing of this core's changed since: None
        # when a lead ended or an ask was lost (``_ended``, ``epoch_asked``), or the epochs at start were set.
        self.reconciled: int | None = None
        self._specs: dict[str, TopicSpec | None] = {}  # the topic specs its leads were last tuned to (``_retune``)

    def context(self, view: SiteState, key: PartitionKey, now_ms: int) -> LeadContext:
        return LeadContext(
            now_ms, view.partition(*key), lambda: leadership.node_loads(view, now_ms, self.config.session_timeout_ms)
        )

    # -- roles -------------------------------------------------------------------------------------------

    def reconcile(self, view: SiteState, now_ms: int) -> list[NodeEffect]:
        """Start or stop leading each partition as ``view`` says (``role_step``): nothing to do, and no walk over
        every partition, if neither the view's partitions (its version) nor this core's leads changed since."""
        if view.version == self.reconciled:
            return []
        out: list[NodeEffect] = []
        for info in view.partitions():
            key = (info.topic, info.partition)
            while True:
                lead = self.leads.get(key)
                fresh = info.leader_epoch > self.epochs_at_start.get(key, LeaderEpoch(0))
                step = leadership.role_step(
                    info,
                    self.me,
                    lead.epoch if lead is not None else None,
                    self.given_up.get(key, LeaderEpoch(0)),
                    fresh,
                )
                if isinstance(step, leadership.StepDown) and lead is not None:
                    out += self._ended(lead, lead.close(step.reason))
                    continue  # it may be named again, in a newer epoch
                break
            if isinstance(step, leadership.AskEpoch) and self.asked.get(key) != info.leader_epoch:
                self.asked[key] = info.leader_epoch
                out.append(ProposeEpoch(key, step.command))
            elif isinstance(step, leadership.Lead):
                lead = self.leads[key] = PartitionLead(
                    self.me, key, step.epoch, self.config.lead(view.topic(key[0])), step.recover
                )
                out.append(Leading(key, step.epoch))
                out += self._ended(lead, lead.start(self.context(view, key, now_ms)))
        out += self._retune(view, now_ms)
        self.reconciled = view.version
        return out

    def _retune(self, view: SiteState, now_ms: int) -> list[NodeEffect]:
        """Each lead takes its topic's settings as ``view`` has them now (an alter: ``PartitionLead.retune``). Only
        the leads of topics whose spec changed since the last look are compared (a spec is replaced, never changed
        in place), so that a view change at 10,000 partitions costs no walk of every lead's config."""
        specs = {name: view.topic(name) for name in {key[0] for key in self.leads}}
        changed = {
            name: spec for name, spec in specs.items() if name not in self._specs or self._specs[name] is not spec
        }
        self._specs = specs
        out: list[NodeEffect] = []
        configs = {name: self.config.lead(spec) for name, spec in changed.items()}
        for key in sorted(k for k in self.leads if k[0] in configs):
            lead = self.leads[key]
            if configs[key[0]] != lead.config:
                out += self._ended(lead, lead.retune(configs[key[0]], now_ms))
        return out

    def epoch_asked(self, key: PartitionKey, epoch: LeaderEpoch, result: Result | None) -> None:
        """The answer to :class:`ProposeEpoch`: lost or not confirmed, it is asked again at the next look."""
        if result is None and self.asked.get(key) == epoch:
            del self.asked[key]
            self.reconciled = None

    def step(
        self,
        view: SiteState,
        key: PartitionKey,
        now_ms: int,
        event: Callable[[PartitionLead, LeadContext], list[LeadEffect]],
    ) -> list[NodeEffect]:
        """Feed ``key``'s lead one event (nothing if this node does not lead it)."""
        lead = self.leads.get(key)
        if lead is None:
            return []
        return self._ended(lead, event(lead, self.context(view, key, now_ms)))

    def step_down(self, key: PartitionKey, reason: str) -> list[NodeEffect]:
        lead = self.leads.get(key)
        return self._ended(lead, lead.close(reason)) if lead is not None else []

    def _ended(self, lead: PartitionLead, effects: list[LeadEffect]) -> list[NodeEffect]:
        """Forget a lead that ended (its ``StepDown`` is among ``effects``), and that it gave its epoch up."""
        if lead.phase is Phase.DONE and self.leads.get(lead.key) is lead:
            del self.leads[lead.key]
            self.given_up[lead.key] = max(self.given_up.get(lead.key, LeaderEpoch(0)), lead.epoch)
            self.reconciled = None
        return list(effects)

    # -- ticks -------------------------------------------------------------------------------------------

    def tick(
        self,
        view: SiteState,
        now_ms: int,
        leads_metadata: bool,
        size_of: Callable[..., int] | None = None,
        elected_ms: int | None = None,
    ) -> list[NodeEffect]:
        """The controller's duties if this node's replica leads the metadata log (with the view it has: stale
        after a pause; ``elected_ms``: when it won the election, if known), then every lead's due retries, roll
        seals and reconnections."""
        out: list[NodeEffect] = []
        self.controller = controller_step(
            self.controller, self.me, leads_metadata, now_ms, self.config.controller(), elected_ms
        )
        ctl = self.controller
        if ctl is not None:
            out += [ProposeElection(e) for e in ctl.elections(view, now_ms)]
            if size_of is not None:
                loads = self.context(view, ("", 0), now_ms).loads
                copies, rolls = ctl.repair_plan(view, now_ms, size_of, lambda: list(loads()))
                out += [*copies, *rolls]
        for key in sorted(key for key, lead in self.leads.items() if not lead.tick_idle):
            out += self.step(view, key, now_ms, lambda lead, ctx: lead.tick(ctx))
        return out

    def stop(self, reason: str) -> list[NodeEffect]:
        """The node stops: every lead ends."""
        out: list[NodeEffect] = []
        for key in sorted(self.leads):
            out += self.step_down(key, reason)
        return out
