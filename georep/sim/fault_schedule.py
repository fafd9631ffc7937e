"""When the faults of a run strike, and what a crash does to a site (the settings are ``faults.py``'s).

In the safety phase, three timers draw the next fault from the seed, each
after an interval around its mean: a link is cut (and healed after
``cut_ms``), a site crashes (and restarts after ``down_ms``), a node goes
silent for good. A crash loses what the site had not fsynced, or with
``rebuild_p`` its whole disk (it restarts empty, with a new epoch), and every
volatile structure: its connections break, its producers resend, and the
checks of a crash run (I1-I3 against what is left, I6 for every acknowledged
write, the consumers' and the group's). The liveness phase heals every cut
and restarts every site (``Simulator._run_liveness``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from georep.sim.site import SimSite
from georep.storage.memory_log import MemoryLog
from offsets.coordinates import Origin
from topology.ids import SiteId

if TYPE_CHECKING:
    from georep.sim.simulator import Simulator


class FaultSchedule:
    """The cuts, crashes and silences of one run."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim

    def handlers(self) -> dict[str, Callable[..., None]]:
        return {
            "fault_cut": self._on_fault_cut,
            "heal": self._on_heal,
            "fault_silence": self._on_fault_silence,
            "restart": self._on_restart,
        }

    def start(self) -> None:
        sim, faults = self.sim, self.sim.faults
        if faults.cut_every_ms:
            sim._after(sim._interval(faults.cut_every_ms), "fault_cut")
        if faults.crash_every_ms:
            sim._after(sim._interval(faults.crash_every_ms), "fault_crash")
        if faults.silence_every_ms:
            sim._after(sim._interval(faults.silence_every_ms), "fault_silence")

    # -- links --------------------------------------------------------------------------

    def _on_fault_cut(self) -> None:
        sim = self.sim
        if sim.phase != "safety":
            return
        links = [link.key for link in sim.topology.links_sorted() if link.key not in sim.cut]
        if links:
            key = sim.rng.choice(links)
            heal_ms = sim.rng.randint(*sim.faults.cut_ms)
            sim.cut[key] = sim.now_ms + heal_ms
            sim.counts.cuts += 1
            sim._log(f"cut {key[0]}->{key[1]} for {heal_ms} ms")
            sim._after(heal_ms, "heal", key)
        sim._after(sim._interval(sim.faults.cut_every_ms), "fault_cut")

    def _on_heal(self, key: tuple[SiteId, SiteId]) -> None:
        if key in self.sim.cut and self.sim.cut[key] <= self.sim.now_ms:
            self.heal(key)

    def heal(self, key: tuple[SiteId, SiteId]) -> None:
        del self.sim.cut[key]
        self.sim.counts.heals += 1
        self.sim._log(f"heal {key[0]}->{key[1]}")

    # -- nodes --------------------------------------------------------------------------

    def _on_fault_silence(self) -> None:
        """A node goes silent for good: it answers no pull and no report from now on (the site's other nodes do).
        Streams it was serving stop, as a frozen process's would; nothing tells their pullers so."""
        sim = self.sim
        if sim.phase != "safety":
            return
        candidates = [
            (sid, node)
            for sid in sorted(sim.sites)
            for node in sim.pull_nodes[sid]
            if node not in sim.silent_nodes and sum(n not in sim.silent_nodes for n in sim.pull_nodes[sid]) >= 2
        ]
        if candidates:
            sid, node = sim.rng.choice(candidates)
            sim.silent_nodes.add(node)
            sim.counts.silenced += 1
            sim._log(f"node {node} goes silent")
            site = sim.sites[sid]
            for dst in sorted(d for d, out in site.out_streams.items() if out.node == node):
                del site.out_streams[dst]
        sim._after(sim._interval(sim.faults.silence_every_ms), "fault_silence")

    # -- sites --------------------------------------------------------------------------

    def crash_any(self) -> None:
        """A site that is up crashes, and restarts after ``down_ms``; the next crash is scheduled."""
        sim = self.sim
        if sim.phase != "safety":
            return
        candidates = [sid for sid, site in sim.sites.items() if site.up]
        if candidates:
            sid = sim.rng.choice(candidates)
            rebuild = bool(sim.faults.rebuild_p) and sim.rng.random() < sim.faults.rebuild_p
            sim._crash(sim.sites[sid], rebuild)
            sim._after(sim.rng.randint(*sim.faults.down_ms), "restart", sid, sim.sites[sid].incarnation)
        sim._after(sim._interval(sim.faults.crash_every_ms), "fault_crash")

    def disconnect(self, site: SimSite) -> None:
        """The site stops serving: its timers and connections of this incarnation do nothing from now on, and the
        connections to it break."""
        site.up = False
        site.incarnation += 1
        site.out_streams.clear()
        site.waiters.clear()
        for other in self.sim.sites.values():
            other.out_streams.pop(site.id, None)

    def crash(self, site: SimSite, rebuild: bool) -> None:
        sim = self.sim
        lost = 0
        for key in sim.keys:
            log = site.logs[key]
            before = len(log.batch_entries())
            if rebuild:
                site.logs[key] = MemoryLog()
            else:
                log.crash()
            lost += before - len(site.logs[key].batch_entries())
        sim.counts.crashes += 1
        sim.counts.lost_batches += lost
        sim._changed(site.id, *sim.keys)
        if rebuild:
            sim.counts.rebuilds += 1
            site.rebuilds += 1
            site.origin = Origin(site.id, site.origin.epoch + sim.rng.randint(1, 1_000))
            sim.origins.append(site.origin)
        what = f"batches, rebuilt empty as {site.origin}" if rebuild else "unflushed batches"
        sim._log(f"crash {site.id}: lost {lost} {what}")
        sim._disconnect(site)
        if rebuild:  # the old epoch is never stamped again, so no coordinate is re-issued
            sim.checker.rescan(site.id, site.logs)
        else:
            sim.checker.on_crash(site.id, site.origin, {str(s): x.logs for s, x in sim.sites.items()})
        sim.producer_workload.forget_lost(site, rebuild)
        sim._producers_lose_connection(site)
        sim._check_acked_writes(crashed=site)
        sim.consumers.site_crashed(site, rebuild)
        sim.groups.site_crashed(site)

    def _on_restart(self, sid: SiteId, incarnation: int) -> None:
        site = self.sim.sites[sid]
        if site.up or site.incarnation != incarnation:
            return
        self.sim._restart(sid)
