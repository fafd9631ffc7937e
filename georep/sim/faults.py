"""Fault settings of one simulator run, and the counts of faults that actually happened.

Faults are site- and link-level, as in FoundationDB's fault workloads
(``RandomClogging``, ``Attrition``): messages on a link are dropped,
duplicated, delayed with jitter or held back (reordered); a link is cut and
later healed; a site crashes (losing what it had not flushed) and restarts;
a site's clock is skewed. Every decision is drawn from the run's seeded
``random.Random``.

:meth:`Faults.swarm` draws the intensities from the seed too, so a swarm of
seeds covers quiet runs and stormy ones (swarm testing: no single fault
mix is best at finding every bug).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields


@dataclass(frozen=True, slots=True)
class Faults:
    drop_p: float = 0.02  # each message (request, chunk, heartbeat) is lost
    dup_p: float = 0.02  # each message is delivered twice
    reorder_p: float = 0.03  # each message is held back by up to reorder_ms, so later ones overtake it
    reorder_ms: int = 150
    latency_ms: tuple[int, int] = (1, 15)  # per-link base one-way latency, drawn once per link
    jitter_ms: int = 4  # per-message extra delay, uniform in [0, jitter_ms]
    cut_every_ms: int = 500  # mean time between link cuts; 0: never
    cut_ms: tuple[int, int] = (50, 1_200)
    crash_every_ms: int = 900  # mean time between site crashes; 0: never
    down_ms: tuple[int, int] = (30, 800)
    skew_ms: int = 5_000  # each site's clock is off by up to this, either way
    # A crash that also loses the disk: the site restarts empty, with a new epoch (ARCHITECTURE.md, origin).
    # Off unless asked for (python -m georep.sim --rebuild-p P), and not drawn by swarm(), so that turning
    # it on does not change what any seed does otherwise.
    rebuild_p: float = 0.0
    # A node of a site with several (SimConfig.site_nodes) goes silent for good: frozen, or cut off behind a
    # half-open connection. Mean time between two; 0: never. Off unless asked for, and not drawn by swarm().
    silence_every_ms: int = 0

    @classmethod
    def none(cls) -> Faults:
        return cls(
            drop_p=0.0,
            dup_p=0.0,
            reorder_p=0.0,
            latency_ms=(1, 1),
            jitter_ms=0,
            cut_every_ms=0,
            crash_every_ms=0,
            skew_ms=0,
        )

    @classmethod
    def swarm(cls, rng: random.Random) -> Faults:
        """Every fault enabled, each with an intensity drawn from ``rng``."""
        return cls(
            drop_p=rng.choice((0.005, 0.02, 0.08)),
            dup_p=rng.choice((0.005, 0.02, 0.08)),
            reorder_p=rng.choice((0.01, 0.05, 0.15)),
            reorder_ms=rng.choice((30, 150, 400)),
            latency_ms=(1, rng.choice((5, 15, 40))),
            jitter_ms=rng.choice((0, 4, 20)),
            cut_every_ms=rng.choice((150, 500, 1_500)),
            cut_ms=(20, rng.choice((300, 1_200, 3_000))),
            crash_every_ms=rng.choice((250, 900, 2_500)),
            down_ms=(10, rng.choice((200, 800, 2_000))),
            skew_ms=rng.choice((0, 500, 30_000)),
        )

    def describe(self) -> str:
        return " ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))


@dataclass(slots=True)
class FaultCounts:
    """What happened in one run; tests use these to prove the faults are really on."""

    drops: int = 0  # random drops
    cut_drops: int = 0  # lost because the link was cut or an end was down
    dups: int = 0
    reorders: int = 0
    cuts: int = 0
    heals: int = 0
    crashes: int = 0
    restarts: int = 0
    lost_batches: int = 0  # unflushed batches that crashes threw away
    rebuilds: int = 0  # crashes that lost the disk as well
    silenced: int = 0  # nodes that went silent for good
    silent_drops: int = 0  # stream opens and held reports a silent node left unanswered
    timeouts: int = 0  # streams dst gave up on (no message for idle_timeout_ms)
    gap_reopens: int = 0
    tail_reopens: int = 0  # two heartbeats promised data that never came: lost on the way
    wants_reopens: int = 0
    produced_batches: int = 0
    applied_batches: int = 0
    chunks: int = 0
    heartbeats: int = 0
    deliveries: int = 0  # records the simulated consumers delivered
    commits: int = 0  # consumer commits appended to the internal topic
    commits_acked: int = 0  # flushed at the committing site
    commits_lost: int = 0  # lost in a crash before that
    commits_out_of_order: int = 0  # folded at a site after a newer commit of the same consumer
    consumer_hops: int = 0
    consumer_hops_during_cuts: int = 0  # while some link was cut
    consumer_hops_forced: int = 0  # its site had crashed
    consumer_restarts: int = 0  # sessions started from a site's committed vector
    held_reports: int = 0  # ReportHeld messages sent (acks=geo:N)
    geo_timeouts: int = 0  # produces whose acks=geo:N did not come in time
    group_heartbeats: int = 0
    group_deliveries: int = 0
    member_moves: int = 0
    members_expired: int = 0  # expiries that removed members at some site
    members_fenced: int = 0  # heartbeats of members their site had expired
    commits_fenced: int = 0  # commits a coordinator refused (stale generation, unknown member, not assigned)

    def add(self, other: FaultCounts) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
