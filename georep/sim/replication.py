"""The replication driver: every link's pull session at its destination and ``Replicate`` stream at its source.

At the destination, each inbound link has a ``PullSession`` (``site.py``
builds it as a node does). Its effects are carried out here: a stream open
goes on the network to the upstream node the session chose, a chunk is
applied with ``apply_chunk`` (and may release acks), and a link event is
counted, or ends the run when it says the bytes diverged (I1). At the source,
an opened stream is a ``ReplicaSource`` that is pumped as the node's handler
loops: send what there is, then wait for a wake-up, a newly fsynced batch
or, with more to send, another turn after other work has run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from georep.replication.links import PartitionKey
from georep.replication.session import ApplyChunks, LinkEvent, OpenStream
from georep.replication.session import Effect as PullEffect
from georep.replication.sink import apply_chunk
from georep.replication.source import ReplicaSource
from georep.sim.checker import InvariantViolation
from georep.sim.network import ChunkMessage, OpenMessage
from georep.sim.site import OutStream, SimSite
from topology.ids import SiteId

if TYPE_CHECKING:
    from georep.sim.simulator import Simulator

PUMP_ROUNDS_MAX = 4  # steps of one source in one event, before others get a turn


class Replication:
    """The pull sessions and sources of every link of one run."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim

    def handlers(self) -> dict[str, Callable[..., None]]:
        return {"pump": self._on_pump}

    def start_site(self, site: SimSite) -> None:
        """``site`` has just started: each of its pull sessions opens its stream."""
        for src in site.inbound:
            self.perform_pull(site, src, site.sessions[src].start(self.sim.now_ms))

    def tick(self, site: SimSite) -> None:
        now = self.sim.now_ms
        moved, site.moved = site.moved, set()
        for key in sorted(moved):  # as a node's tick: only the partitions whose log changed
            site.links.local_vector(key, site.logs[key].vector())
        site.links.tick(now)
        for src in site.inbound:
            self.perform_pull(site, src, site.sessions[src].tick(now))

    def flushed(self, site: SimSite, key: PartitionKey) -> None:
        """``site`` fsynced batches of ``key``: its sources may send them now."""
        for dst, out in sorted(site.out_streams.items()):
            if key in out.source.wanted:
                out.source.flushed(key)
                self.pump_soon(site, dst, 0)

    # -- the source side ------------------------------------------------------------------

    def on_open(self, msg: OpenMessage) -> None:
        sim = self.sim
        site = sim.sites[msg.src]
        if not site.up:
            sim.counts.cut_drops += 1
            return
        if msg.node in sim.silent_nodes:
            sim.counts.silent_drops += 1
            return
        source = ReplicaSource(site.logs, msg.wants, heartbeat_ms=sim.config.heartbeat_ms)
        site.out_streams[msg.dst] = OutStream(msg.stream_id, source, msg.node)
        self.pump_soon(site, msg.dst, 0)

    def pump_soon(self, site: SimSite, dst: SiteId, delay_ms: int) -> None:
        out = site.out_streams[dst]
        due = self.sim.now_ms + delay_ms
        if 0 <= out.pump_due_ms <= due:
            return  # a pump at least as early is already scheduled
        out.pump_due_ms = due
        self.sim._after(delay_ms, "pump", site.id, site.incarnation, dst, out.stream_id, due)

    def _on_pump(self, sid: SiteId, incarnation: int, dst: SiteId, stream_id: int, due: int) -> None:
        sim = self.sim
        site = sim.alive(sid, incarnation)
        out = None if site is None else site.out_streams.get(dst)
        if site is None or out is None or out.stream_id != stream_id or out.pump_due_ms != due:
            return
        out.pump_due_ms = -1
        for _round in range(PUMP_ROUNDS_MAX):  # as the node's handler loops: send what there is, then wait
            step = out.source.step(sim.now_ms, sim.config.chunk_bytes)
            if step.chunks or step.heartbeat:  # a heartbeat may carry no chunk (nothing changed): it still goes
                sim.counts.chunks += 0 if step.heartbeat else 1
                sim.counts.heartbeats += step.heartbeat
                message = ChunkMessage(sid, dst, stream_id, tuple(step.chunks), step.heartbeat)
                if not sim.network.send((sid, dst), dst, message):
                    del site.out_streams[dst]  # the connection broke: the stream ends at the source too
                    return
            if not step.again:
                self.pump_soon(site, dst, step.wake_ms - sim.now_ms)
                return
        self.pump_soon(site, dst, sim.config.pump_ms)  # more to send: after other work has run

    # -- the destination side -------------------------------------------------------------

    def on_chunks(self, msg: ChunkMessage) -> None:
        sim = self.sim
        site = sim.sites[msg.dst]
        if not site.up:
            sim.counts.cut_drops += 1
            return
        session = site.sessions[msg.src]
        self.perform_pull(site, msg.src, session.on_message(msg.stream_id, msg.chunks, msg.heartbeat, sim.now_ms))

    def perform_pull(self, site: SimSite, src: SiteId, effects: list[PullEffect]) -> None:
        """Carry out a pull session's effects: opens go on the wire, chunks are applied, events counted."""
        sim = self.sim
        session = site.sessions[src]
        queue = deque(effects)
        while queue:
            effect = queue.popleft()
            if isinstance(effect, OpenStream):
                message = OpenMessage(src, site.id, effect.stream_id, effect.wants, effect.address)
                sim.network.send((src, site.id), src, message)
            elif isinstance(effect, ApplyChunks):
                # As the node's writer thread: the message's chunks in one go, then their outcomes in order.
                outcomes = []
                for chunk in effect.chunks:
                    log = site.logs[chunk.key]
                    outcome = apply_chunk(log, chunk.batches, sim.local_ms(site))
                    sim.counts.applied_batches += outcome.appended_batches
                    if outcome.appended_batches:
                        sim._changed(site.id, chunk.key)
                        sim.perform_acks(site, site.acks.replicated(chunk.key, log.log_end_offset))
                    outcomes.append(outcome)
                for chunk, outcome in zip(effect.chunks, outcomes, strict=True):
                    queue.extend(session.on_applied(effect.stream_id, chunk.key, outcome, sim.now_ms))
            else:
                self._link_event(site, src, effect)

    def _link_event(self, site: SimSite, src: SiteId, event: LinkEvent) -> None:
        sim = self.sim
        sim._log(f"{site.id} <- {src}: {event.kind}: {event.text}")
        if event.kind == "diverged":
            raise InvariantViolation(f"I1 bytes: {src} sent {site.id} batches that straddle its vector: {event.text}")
        if event.kind == "up":
            sim.held_reports.link_up(site, src)
        elif event.kind == "timeout":
            sim.counts.timeouts += 1
        elif event.kind == "gap":
            sim.counts.gap_reopens += 1
        elif event.kind == "tail":
            sim.counts.tail_reopens += 1
        elif event.kind == "wants":
            sim.counts.wants_reopens += 1
