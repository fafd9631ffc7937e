"""The network between simulated sites: the messages that cross it, and the faults it does them.

Messages between sites (stream opens, chunks and heartbeats, held reports and
their answers) go on the wire of one link. There the run's faults drop,
duplicate, delay (each link has its own latency, drawn once, plus jitter) and
reorder them, and a cut link or a down site loses them, on the way out or on
arrival. On arrival, :class:`Network` hands each message to the part of the
simulator that takes it: stream opens and chunks to the replication driver
(``replication.py``), held reports and their answers to ``held_reports.py``.
Clients talk to their own site over a connection that only a crash breaks, so
they do not cross it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from georep.replication.links import PartitionKey
from georep.replication.source import Chunk
from georep.sim.faults import Faults
from offsets.coordinates import Origin
from offsets.vector import VectorOffset
from topology.ids import SiteId

if TYPE_CHECKING:
    from georep.sim.simulator import Simulator

HEALED = Faults.none()  # the network of the liveness phase


@dataclass(frozen=True, slots=True)
class OpenMessage:
    """dst -> src: open a ``Replicate`` stream with these wants."""

    src: SiteId
    dst: SiteId
    stream_id: int
    wants: Mapping[PartitionKey, tuple[dict[Origin, int], tuple[str, ...]]]
    node: str  # the node of src it goes to

    def describe(self) -> str:
        return f"open {self.src}->{self.dst} #{self.stream_id} at {self.node}"


@dataclass(frozen=True, slots=True)
class ChunkMessage:
    """src -> dst: one ``ReplicateResponse`` (data, or a heartbeat)."""

    src: SiteId
    dst: SiteId
    stream_id: int
    chunks: tuple[Chunk, ...]
    heartbeat: bool

    def describe(self) -> str:
        size = sum(len(c.batches) for c in self.chunks)
        kind = "heartbeat" if self.heartbeat else f"chunk {size}B"
        return f"{kind} {self.src}->{self.dst} #{self.stream_id}"


@dataclass(frozen=True, slots=True)
class HeldReport:
    """reporter -> upstream (``ReportHeld``): what the reporter knows sites hold fsynced."""

    reporter: SiteId
    upstream: SiteId
    report_id: int
    entries: tuple[tuple[str, str, int, VectorOffset], ...]
    node: str  # the node of the upstream it goes to: the one the reporter pulls from

    def describe(self) -> str:
        return f"report {self.reporter}->{self.upstream} #{self.report_id} ({len(self.entries)})"


@dataclass(frozen=True, slots=True)
class HeldAnswer:
    """upstream -> reporter: the report was taken in."""

    reporter: SiteId
    upstream: SiteId
    report_id: int
    incarnation: int  # the reporter's, when it sent the report

    def describe(self) -> str:
        return f"report-ok {self.upstream}->{self.reporter} #{self.report_id}"


Message = OpenMessage | ChunkMessage | HeldReport | HeldAnswer


class Network:
    """The links between the sites of one run; ``sim.cut`` says which are cut (``fault_schedule.py``)."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self.latency_ms = {link.key: sim.rng.randint(*sim.faults.latency_ms) for link in sim.topology.links_sorted()}

    def handlers(self) -> dict[str, Callable[..., None]]:
        return {"deliver": self._on_deliver}

    def send(self, link: tuple[SiteId, SiteId], to: SiteId, message: Message) -> bool:
        """Put ``message`` on the wire of ``link`` towards ``to``; False when the connection is broken."""
        sim = self.sim
        if link in sim.cut or not sim.sites[to].up:
            sim.counts.cut_drops += 1
            return False
        faults = sim.faults if sim.phase == "safety" else HEALED
        if faults.drop_p and sim.rng.random() < faults.drop_p:
            sim.counts.drops += 1
            return True
        copies = 1
        if faults.dup_p and sim.rng.random() < faults.dup_p:
            copies = 2
            sim.counts.dups += 1
        for _copy in range(copies):
            delay = self.latency_ms[link] + (sim.rng.randint(0, faults.jitter_ms) if faults.jitter_ms else 0)
            if faults.reorder_p and sim.rng.random() < faults.reorder_p:
                delay += sim.rng.randint(1, faults.reorder_ms)
                sim.counts.reorders += 1
            sim._after(delay, "deliver", link, message)
        return True

    def _on_deliver(self, link: tuple[SiteId, SiteId], message: Message) -> None:
        sim = self.sim
        if link in sim.cut:
            sim.counts.cut_drops += 1
            return
        if isinstance(message, OpenMessage):
            sim.replication.on_open(message)
        elif isinstance(message, ChunkMessage):
            sim.replication.on_chunks(message)
        elif isinstance(message, HeldReport):
            sim.held_reports.on_report(message)
        else:
            sim.held_reports.on_answer(message)
