"""A deterministic multi-site simulator (STYLE.md §2: FoundationDB's Sim2, TigerBeetle's VOPR).

``Simulator(seed, topology_name)`` runs N whole sites in one thread, with
virtual time and a heap of ``(due_ms, seq, kind, args)`` events: it jumps
time to the next event. The only randomness is one ``random.Random(seed)``:
it draws the topology (``random-N``), the fault intensities, each site's
epoch, clock skew and fsync time, each topic's flush policy, the workload and
every fault. Iteration is over sorted keys only. So one seed always gives one
run, and :attr:`SimResult.trace` (a hash of every event and the final
vectors) proves it.

**The simulator holds no protocol decision of its own.** Each site drives
the objects a node drives (``site.py`` builds them as a node starts), and
the simulator only moves their effects through virtual time and a faulty
network. This module holds the run (the clock, the heap, the two phases, the
checks after every event) and a site's own work: appends, acks, fsyncs and
ticks. Its parts, each a module, drive the rest: the producers
(``producers.py``), the network between sites (``network.py``), replication
over the links (``replication.py``), held reports (``held_reports.py``), the
fault schedule (``fault_schedule.py``), the consumers (``consumers.py``) and
the consumer group (``groups.py``):

==========================  =========================================  ====================================
decision                    pure module                                driven by
==========================  =========================================  ====================================
origin append, idempotence  ``georep/broker/append.py``                producers (``producers.py``), commits
when an ack goes, fsyncs    ``georep/broker/acks.py``                  every append; fsyncs take ``fsync_ms``
what a fetch hands out      ``georep/broker/fetch.py``                 consumers and group members
commit fold and stamps      ``georep/broker/commits.py``               every site, after every event
pulling over a link         ``georep/replication/session.py``          ``replication.py``: messages, ticks
upstream node, partitions   ``georep/replication/upstream.py``         every session (silent nodes)
what a source sends         ``georep/replication/source.py``           pumps (``replication.py``)
apply and dedup             ``georep/replication/sink.py``, ``dedup``  every chunk
routing, stalls             ``georep/replication/links.py``            every session
held reports (geo acks)     ``offsets/held.py``                        ``held_reports.py``
producer retries            ``georep/client/delivery.py``              producers
group membership            ``cluster/groups.py``                      group members (``groups.py``)
==========================  =========================================  ====================================

Messages between sites (stream opens, chunks, heartbeats, held reports and
their answers) cross the network (``network.py``), where faults drop,
duplicate, delay and reorder them and cut links lose them. Clients talk to
their own site over a connection that only a crash breaks.

Checked after every event (``checker.py``, ``producers.py``,
``consumers.py``, ``groups.py``, ``held_reports.py``): I1-I3 at every site;
I5 for every consumer session; exactly-once storage of producer resends; I6
at every ack release and at every crash; the group invariants; every honest
held claim taken. After healing: I4 convergence, every producer batch
answered, every consumer caught up, every commit table the fold of the
commits that reach it, and every acknowledged write still where it was
acknowledged.

Faults (``faults.py``, struck by ``fault_schedule.py``) are site- and
link-level: drop, duplicate, delay and reorder messages, cut and heal links,
crash a site (it loses what it had not fsynced, and every volatile structure)
and restart it, skew a site's clock (timestamps, append times, HLC stamps and
session timeouts). Off by default, a crash can also lose the disk
(``rebuild_p``): the site restarts empty with a new epoch. Also off by
default, sites have several nodes that each answer pulls for the whole site
(``SimConfig.site_nodes``), and a node goes silent for good now and then
(``Faults.silence_every_ms``: frozen, or cut off behind a half-open
connection; its site keeps at least one answering node): what was opened or
reported at it gets no answer, and the pullers must move to another node of
the site.

A run has two phases, as in VOPR. Safety: ``steps`` events with the workload
and faults on. Liveness: every fault is healed, crashed sites restart,
producers stop taking new records, consumers stop hopping, and the run goes
on until every liveness condition holds, or fails after ``liveness_ms`` of
virtual time.

A failure raises :class:`SimulationFailure`, whose message holds the seed, the
topology and the command that replays the run.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import heapq
import itertools
import random
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from georep.broker.acks import Acks, Effect, Fail, HeldChanged, Release, StartFlush
from georep.broker.append import Produced, append_as_origin
from georep.broker.commits import CommitLog
from georep.record.batch import parse_header
from georep.replication.links import PartitionKey
from georep.replication.session import PullConfig
from georep.sim.checker import InvariantChecker, InvariantViolation
from georep.sim.consumers import ConsumerWorkload
from georep.sim.fault_schedule import FaultSchedule
from georep.sim.faults import FaultCounts, Faults
from georep.sim.groups import GroupWorkload
from georep.sim.held_reports import HeldReports
from georep.sim.network import ChunkMessage, HeldAnswer, HeldReport, Network, OpenMessage
from georep.sim.producers import AckedWrite, ProducerWorkload, SimProducer
from georep.sim.replication import Replication
from georep.sim.site import SimSite
from georep.sim.topologies import DEFAULT_TOPICS, build_topology
from georep.storage.memory_log import MemoryLog
from offsets.commits import OFFSETS_PARTITIONS, OFFSETS_TOPIC, Commit
from offsets.coordinates import Origin
from offsets.vector import VectorOffset
from topology.filters import is_internal
from topology.ids import SiteId
from topology.model import Topology

START_MS = 1_700_000_000_000  # virtual time starts at a realistic Unix time, so skewed clocks stay positive
DEFAULT_STEPS = 3_000


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Timings of the simulated sites (virtual ms) and run bounds."""

    steps: int = DEFAULT_STEPS  # events in the safety phase
    produce_ms: tuple[int, int] = (20, 200)  # gap between two batches of one producer
    records_per_batch: tuple[int, int] = (1, 4)
    flush_ms: tuple[int, int] = (10, 100)  # the periodic flush of topics with a flush interval
    fsync_ms: tuple[int, int] = (1, 12)  # how long one fsync takes at a site
    heartbeat_ms: int = 100
    idle_timeout_ms: int = 350  # dst gives up on a stream after this long without a message
    backoff_ms: tuple[int, int] = (20, 200)  # dst waits this long (doubling) before reopening a failed stream
    tick_ms: int = 100
    stall_ms: int = 600
    pump_ms: int = 2  # a source with more to send sends again after this long
    chunk_bytes: int = 2_048
    report_timeout_ms: int = 400  # a held report with no answer by then is sent again
    geo_p: float = 0.3  # a producer asks for acks=geo:N
    geo_timeout_ms: int = 3_000
    liveness_ms: int = 60_000  # virtual time the liveness phase may take to converge
    settle_check_ms: int = 50
    max_events: int = 2_000_000
    consumers: tuple[int, int] = (2, 3)  # consumers per run; the first is an exactly-once one. (0, 0): none
    consume_ms: tuple[int, int] = (10, 80)  # gap between two fetches of one consumer
    fetch_bytes: int = 1_024
    commit_every: tuple[int, int] = (1, 6)  # deliveries between commits of an ordinary consumer
    hop_ms: tuple[int, int] = (100, 1_500)  # gap between two hops of one consumer to another site
    group_members: tuple[int, int] = (0, 0)  # members of the one consumer group; (0, 0): no group
    session_timeout_ms: int = 1_000
    heartbeat_interval_ms: int = 150  # group members' heartbeats
    site_nodes: int = 1  # nodes per site, each answering pulls and held reports for the whole site


class SimulationFailure(AssertionError):
    """A run broke an invariant or did not converge. The message says how to replay it."""

    def __init__(self, message: str, seed: int, topology: str, replay: str) -> None:
        self.seed = seed
        self.topology = topology
        self.replay = replay
        super().__init__(f"{message}\n  seed={seed} topology={topology}\n  replay: {replay}")


def replay_command(
    seed: int,
    topology: str,
    steps: int = DEFAULT_STEPS,
    rebuild_p: float = 0.0,
    consumers: bool = True,
    groups: bool = False,
    site_nodes: int = 1,
    silence_every_ms: int = 0,
) -> str:
    extra = "" if steps == DEFAULT_STEPS else f" --steps {steps}"
    extra += f" --rebuild-p {rebuild_p}" if rebuild_p else ""
    extra += f" --site-nodes {site_nodes}" if site_nodes != 1 else ""
    extra += f" --silence-every-ms {silence_every_ms}" if silence_every_ms else ""
    extra += "" if consumers else " --no-consumers"
    extra += " --groups" if groups else ""
    return f"python -m georep.sim --seed {seed} --topology {topology}{extra}"


@dataclass(frozen=True, slots=True)
class SimResult:
    seed: int
    topology: str
    events: int
    virtual_ms: int
    trace: str  # sha256 of the event log and the final vectors
    counts: FaultCounts
    vectors: dict[str, dict[PartitionKey, dict[str, int]]]  # site -> partition -> {origin text: next seq}
    batches_checked: int
    liveness_ms: int  # virtual time from healing every fault to convergence


class Simulator:
    """One run: the sites, the clock and the heap of events, composed with the parts that drive them.

    The parts are the producers (``producers.py``), the network (``network.py``), replication over the links
    (``replication.py``), held reports (``held_reports.py``), the fault schedule (``fault_schedule.py``), the
    consumers (``consumers.py``) and the consumer group (``groups.py``). The methods kept here are the run's
    loop and the site's own work (appends, acks, fsyncs, ticks), and the names a subclass
    (``geo_cluster.py``) overrides or calls; the parts call those through the simulator, so an override holds
    wherever they are called from.
    """

    def __init__(
        self,
        seed: int,
        topology: str = "triangle",
        *,
        topics: Mapping[str, int] | None = None,
        faults: Faults | None = None,
        config: SimConfig | None = None,
        verbose: bool = False,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.seed = seed
        self.topology_name = topology
        self.rng = random.Random(seed)
        self.config = config or SimConfig()
        self.topology: Topology = build_topology(topology, self.rng)
        self.faults = faults if faults is not None else Faults.swarm(self.rng)
        cfg = self.config
        consumer_count = self.rng.randint(*cfg.consumers) if cfg.consumers[1] else 0
        member_count = self.rng.randint(*cfg.group_members) if cfg.group_members[1] else 0
        self.topics = dict(sorted((topics or DEFAULT_TOPICS).items()))
        if consumer_count or member_count:
            self.topics = dict(sorted({**self.topics, OFFSETS_TOPIC: OFFSETS_PARTITIONS}.items()))
        self.keys = tuple((t, p) for t, n in self.topics.items() for p in range(n))
        self.data_keys = tuple(key for key in self.keys if not is_internal(key[0]))
        # Each data topic fsyncs per batch (acks wait for the fsync) or on an interval (acks=leader promise
        # only the write, as with Kafka's defaults); the internal topic fsyncs per batch, as at a node.
        self.fsync_per_batch = {t: is_internal(t) or self.rng.random() < 0.5 for t in self.topics}
        self.verbose = verbose
        self._print = log or (lambda line: print(line, file=sys.stderr))
        self._init_run_loop()
        self.network = Network(self)
        self.pull = PullConfig(cfg.idle_timeout_ms, cfg.backoff_ms[0], cfg.backoff_ms[1])
        self.sites: dict[SiteId, SimSite] = {}
        self.pull_nodes = {
            sid: tuple(f"{sid}/{n}" for n in range(1, max(1, cfg.site_nodes) + 1)) for sid in self.topology.site_ids()
        }
        self.silent_nodes: set[str] = set()  # nodes that answer nothing, for good (Faults.silence_every_ms)
        self.origins: list[Origin] = []  # every origin ever, old epochs of rebuilt sites included
        self._make_sites()
        self.producer_workload = ProducerWorkload(self)
        self.producers = self.producer_workload.producers
        self.acked: list[AckedWrite] = []
        # (site, partition) -> {origin: next seq} of everything the site ever held fsynced, across disk losses
        self.ever_flushed: dict[tuple[SiteId, PartitionKey], dict[Origin, int]] = {
            (sid, key): {} for sid in self.sites for key in self.keys
        }
        self.consumers = ConsumerWorkload(self, consumer_count)
        self.groups = GroupWorkload(self, member_count)
        self.replication = Replication(self)
        self.held_reports = HeldReports(self)
        self.fault_schedule = FaultSchedule(self)
        self._handlers: dict[str, Callable[..., None]] = {
            "produce_answer": self._on_produce_answer,
            "flush": self._on_flush,
            "fsync_done": self._on_fsync_done,
            "tick": self._on_tick,
            "fault_crash": self._on_fault_crash,
            **self.producer_workload.handlers(),
            **self.network.handlers(),
            **self.replication.handlers(),
            **self.fault_schedule.handlers(),
            **self.consumers.handlers(),
            **self.groups.handlers(),
        }

    def _init_run_loop(self) -> None:
        """The clock, the event heap, the counters and the checker, before anything is scheduled."""
        self.now_ms = START_MS
        self.counts = FaultCounts()
        self.checker = InvariantChecker()
        self._heap: list[tuple[int, int, str, tuple[object, ...]]] = []
        self._seq = 0
        self._stream_ids = itertools.count(1)
        # the logs that an append or a crash changed during the current event, per site
        self._dirty: dict[SiteId, set[PartitionKey]] = {}
        self._tokens = itertools.count(1)
        self._events = 0
        self._trace = hashlib.sha256()
        self.phase = "safety"
        self._started = False
        self._safety_steps = 0
        self._liveness_start_ms = START_MS
        self.kinds: dict[str, int] = {}
        self.cut: dict[tuple[SiteId, SiteId], int] = {}  # link -> heal due

    def _make_sites(self) -> None:
        cfg = self.config
        decode_commit = functools.cache(Commit.decode)  # every site folds the same commit records (CommitLog)
        for sid in self.topology.site_ids():
            skew = self.rng.randint(-self.faults.skew_ms, self.faults.skew_ms) if self.faults.skew_ms else 0
            origin = Origin(sid, self.rng.randint(1, 1_000_000))
            inbound = tuple(link.src for link in self.topology.links_sorted() if link.dst == sid)
            self.origins.append(origin)
            site = SimSite(
                sid,
                origin,
                skew,
                self.rng.randint(*cfg.flush_ms),
                self.rng.randint(*cfg.fsync_ms),
                inbound,
                {key: MemoryLog() for key in self.keys},
                commits=CommitLog(decode_commit),
            )
            self.sites[sid] = site
            self._boot(site)

    def _boot(self, site: SimSite) -> None:
        site.boot(
            self.topology,
            self.topics,
            self.fsync_per_batch,
            self.config.stall_ms,
            self.pull,
            self._stream_ids,
            self.local_ms(site),
            self._new_member_id,
            self.pull_nodes,
        )

    def _new_member_id(self, client_id: str) -> str:
        return f"{client_id or 'consumer'}-{self.rng.getrandbits(48):012x}"

    # -- running ------------------------------------------------------------------

    def advance(self, steps: int) -> None:
        """Run up to ``steps`` more events of the safety phase (starting the run if needed).

        For tests that inspect or tamper with the sites part way; :meth:`run` finishes the run.
        """
        try:
            self._run_safety(steps)
        except InvariantViolation as e:
            raise self._failure(f"invariant violated at t+{self.now_ms - START_MS}ms event {self._events}: {e}") from e

    def mark_changed(self, sid: SiteId) -> None:
        """For tests that change a site's logs behind the simulator's back: check them after the next event."""
        self._changed(sid, *self.keys)

    def run(self) -> SimResult:
        """Safety phase (what is left of it), then liveness phase. Raises :class:`SimulationFailure`."""
        try:
            self._run_safety(self.config.steps - self._safety_steps)
            self._run_liveness()
            self.checker.rescan_all({s: site.logs for s, site in self.sites.items()})
            self.consumers.check_done()
            self._check_acked_writes()
        except InvariantViolation as e:
            raise self._failure(f"invariant violated at t+{self.now_ms - START_MS}ms event {self._events}: {e}") from e
        vectors = {
            str(s): {key: {str(o): int(n) for o, n in sorted(site.logs[key].vector().items())} for key in self.keys}
            for s, site in self.sites.items()
        }
        self._trace.update(repr(sorted(vectors.items())).encode())
        self._trace.update(self.consumers.trace().encode())
        return SimResult(
            self.seed,
            self.topology_name,
            self._events,
            self.now_ms - START_MS,
            self._trace.hexdigest(),
            self.counts,
            vectors,
            self.checker.batches_checked,
            self.now_ms - self._liveness_start_ms,
        )

    def _failure(self, message: str) -> SimulationFailure:
        cfg = self.config
        replay = replay_command(
            self.seed,
            self.topology_name,
            cfg.steps,
            self.faults.rebuild_p,
            bool(cfg.consumers[1]),
            bool(cfg.group_members[1]),
            cfg.site_nodes,
            self.faults.silence_every_ms,
        )
        return SimulationFailure(message, self.seed, self.topology_name, replay)

    def _start(self) -> None:
        for site in self.sites.values():
            self._start_site(site)
        self.producer_workload.start()
        self.consumers.start()
        self.groups.start()
        self.fault_schedule.start()

    def _start_site(self, site: SimSite) -> None:
        """Timers, streams and client connections of a site that has just started (or restarted)."""
        inc = site.incarnation
        self._after(site.flush_ms, "flush", site.id, inc)
        self._after(self.rng.randint(1, self.config.tick_ms), "tick", site.id, inc)
        self.replication.start_site(site)
        self.producer_workload.connect(site)

    def _run_safety(self, steps: int) -> None:
        if not self._started:
            self._started = True
            self._start()
        for _step in range(max(0, steps)):
            self._safety_steps += 1
            if not self._step():
                break

    def _run_liveness(self) -> None:
        self.phase = "liveness"
        self._liveness_start_ms = self.now_ms
        self._log("liveness: heal every fault, restart every site, stop new records")
        for key in sorted(self.cut):
            self.fault_schedule.heal(key)
        for sid, site in self.sites.items():
            if not site.up:
                self._restart(sid)
        deadline = self.now_ms + self.config.liveness_ms
        next_check = self.now_ms
        logs = {str(s): site.logs for s, site in self.sites.items()}
        for _step in range(self.config.max_events):
            if self.now_ms >= next_check:
                if self._live(logs):
                    return
                next_check = self.now_ms + self.config.settle_check_ms
            if self.now_ms > deadline or not self._step():
                break
        problems = self._liveness_problems(logs)
        if problems:
            shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
            raise InvariantViolation(f"liveness after healing: {shown}")

    def _live(self, logs: Mapping[str, Mapping[PartitionKey, MemoryLog]]) -> bool:
        """Whether every liveness condition holds: :meth:`_liveness_problems` is empty (found out without
        listing every record still missing)."""
        if next(self.checker.iter_convergence_problems(self.topology, self.origins, logs, self.keys), None):
            return False
        return all(p.done() for p in self.producers) and not self.consumers.problems() and not self.groups.problems()

    def _liveness_problems(self, logs: Mapping[str, Mapping[PartitionKey, MemoryLog]]) -> list[str]:
        problems = self.checker.convergence_problems(self.topology, self.origins, logs, self.keys)
        if problems:
            return [f"I4 convergence: {p}" for p in problems]
        return self.producer_workload.problems() or self.consumers.problems() or self.groups.problems()

    def _step(self) -> bool:
        if not self._heap:
            return False
        if self._events >= self.config.max_events:
            raise self._failure(f"the run did not finish within {self.config.max_events} events")
        due, _seq, kind, args = heapq.heappop(self._heap)
        self.now_ms = due
        self._events += 1
        label = f"{due - START_MS} {kind} {' '.join(map(_arg_text, args))}"
        self._trace.update(label.encode())
        if self.verbose:
            self._print(label)
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        self._handlers[kind](*args)
        if self._dirty:
            dirty, self._dirty = self._dirty, {}
            for sid in sorted(dirty):  # only logs that an append or a crash changed need a look
                site = self.sites[sid]
                self.checker.check_site(sid, {key: site.logs[key] for key in dirty[sid]})
                self.consumers.fold(site)
        return True

    def _changed(self, sid: SiteId, *keys: PartitionKey) -> None:
        self._dirty.setdefault(sid, set()).update(keys)
        self.sites[sid].moved.update(keys)

    def _after(self, delay_ms: int, kind: str, *args: object) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (self.now_ms + max(0, delay_ms), self._seq, kind, args))

    def _interval(self, mean_ms: int) -> int:
        return self.rng.randint(mean_ms // 2, mean_ms * 3 // 2)

    def _log(self, line: str) -> None:
        if self.verbose:
            self._print(f"{self.now_ms - START_MS} {line}")

    def local_ms(self, site: SimSite) -> int:
        """``site``'s wall clock: virtual time plus its skew."""
        return self.now_ms + site.skew_ms

    def alive(self, sid: SiteId, incarnation: int) -> SimSite | None:
        site = self.sites[sid]
        return site if site.up and site.incarnation == incarnation else None

    # -- the site: the origin append, its ack, fsyncs and ticks ---------------------------

    def append(self, site: SimSite, key: PartitionKey, batch: bytes) -> Produced:
        """``append_as_origin`` at ``site``; registers what it stamped with the checker (I1 bytes)."""
        log = site.logs[key]
        produced = append_as_origin(
            log,
            site.producers[key],
            site.origin,
            batch,
            topic=key[0],
            max_batch_bytes=1 << 30,
            now_ms=self.local_ms(site),
        )
        self._changed(site.id, key)
        if not produced.duplicate:
            self.checker.register(key, parse_header(log.read(produced.result.base_offset, 1).data))
        return produced

    def wait_ack(
        self,
        site: SimSite,
        key: PartitionKey,
        produced: Produced,
        acks: Acks,
        then: Callable[[Exception | None], None],
        timeout_ms: int = 0,
    ) -> None:
        """Hold ``then`` until ``site``'s ack table releases (None) or fails (the error) the batch."""
        token = next(self._tokens)
        site.waiters[token] = then
        r = produced.result
        self.perform_acks(
            site,
            site.acks.wait(
                token,
                key,
                produced.end_offset,
                produced.origin,
                r.last_origin_seq,
                acks,
                self.local_ms(site),
                timeout_ms,
            ),
        )

    def perform_acks(self, site: SimSite, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, StartFlush):
                end = site.logs[effect.key].log_end_offset
                self._after(site.fsync_ms, "fsync_done", site.id, site.incarnation, effect.key, end)
            elif isinstance(effect, Release | Fail):
                then = site.waiters.pop(effect.token, None)
                if then is not None:
                    then(effect.error if isinstance(effect, Fail) else None)
            elif isinstance(effect, HeldChanged):
                self.held_reports.held_changed(site)

    def _on_fsync_done(self, sid: SiteId, incarnation: int, key: PartitionKey, end: int) -> None:
        site = self.alive(sid, incarnation)
        if site is None:
            return  # the fsync died with the process
        log = site.logs[key]
        log.flush_to(end)
        flushed = log.flushed_vector()
        ever = self.ever_flushed[(sid, key)]
        for origin, n in flushed.items():
            if n > ever.get(origin, 0):
                ever[origin] = n
        self.perform_acks(site, site.acks.flush_done(key, log.flushed_offset, VectorOffset(flushed)))
        self.consumers.flushed(site, key)
        self.replication.flushed(site, key)

    def _on_flush(self, sid: SiteId, incarnation: int) -> None:
        """The periodic flush of topics with a flush interval."""
        site = self.alive(sid, incarnation)
        if site is None:
            return
        for key in self.keys:
            if not self.fsync_per_batch[key[0]]:
                self.perform_acks(site, site.acks.flush(key, site.logs[key].log_end_offset))
        self._after(site.flush_ms, "flush", sid, incarnation)

    def _on_tick(self, sid: SiteId, incarnation: int) -> None:
        site = self.alive(sid, incarnation)
        if site is None:
            return
        self.replication.tick(site)
        self.perform_acks(site, site.acks.tick(self.local_ms(site)))
        self.held_reports.tick(site)
        self.groups.tick(site)
        self._after(self.config.tick_ms, "tick", sid, incarnation)

    # -- what the parts do, under the names a subclass overrides or calls --------------------

    def _on_produce_answer(
        self, pi: int, incarnation: int, correlation: int, produced: Produced | None, error: Exception | None
    ) -> None:
        self.producer_workload.answered(pi, incarnation, correlation, error)

    def _resolve(self, producer: SimProducer) -> None:
        self.producer_workload.resolve(producer)

    def _producers_lose_connection(self, site: SimSite) -> None:
        self.producer_workload.lose_connection(site)

    def _check_ack_promise(self, producer: SimProducer, site: SimSite, produced: Produced) -> None:
        self.producer_workload.check_ack_promise(producer, site, produced)

    def _check_acked_writes(self, crashed: SimSite | None = None) -> None:
        self.producer_workload.check_acked_writes(crashed)

    def _pump_soon(self, site: SimSite, dst: SiteId, delay_ms: int) -> None:
        self.replication.pump_soon(site, dst, delay_ms)

    def _on_fault_crash(self) -> None:
        self.fault_schedule.crash_any()

    def _crash(self, site: SimSite, rebuild: bool = False) -> None:
        self.fault_schedule.crash(site, rebuild)

    def _disconnect(self, site: SimSite) -> None:
        self.fault_schedule.disconnect(site)

    def _restart(self, sid: SiteId) -> None:
        site = self.sites[sid]
        site.up = True
        self.counts.restarts += 1
        self._log(f"restart {sid}")
        self._boot(site)
        self._start_site(site)


def _arg_text(arg: object) -> str:
    if type(arg) is int or type(arg) is str:  # most arguments: ids, incarnations, indexes (not bools or enums)
        return str(arg)
    if isinstance(arg, tuple):  # partition keys and links
        return "/".join(map(str, arg))
    if isinstance(arg, OpenMessage | ChunkMessage | HeldReport | HeldAnswer):
        return arg.describe()
    if isinstance(arg, Produced):
        return f"{arg.origin}:{arg.result.base_origin_seq}"
    return str(arg)


def run_seed(
    seed: int,
    topology: str = "triangle",
    *,
    steps: int = DEFAULT_STEPS,
    faults: Faults | None = None,
    rebuild_p: float = 0.0,
    consumers: bool = True,
    groups: bool = False,
    verbose: bool = False,
    site_nodes: int = 1,
    silence_every_ms: int = 0,
) -> SimResult:
    """One run, as ``python -m georep.sim --seed SEED --topology NAME --steps STEPS`` does it.

    ``rebuild_p`` > 0 turns some crashes into disk losses (see ``Faults.rebuild_p``). ``consumers=False``
    (``--no-consumers``) runs no consumers; ``groups`` (``--groups``) adds a consumer group whose members
    join at several sites. ``site_nodes`` (``--site-nodes``) gives every site that many nodes answering pulls, and
    ``silence_every_ms`` (``--silence-every-ms``) silences one of them for good that often.
    """
    config = SimConfig(
        steps=steps,
        consumers=(2, 3) if consumers else (0, 0),
        group_members=(2, 3) if groups else (0, 0),
        site_nodes=site_nodes,
    )
    sim = Simulator(seed, topology, faults=faults, config=config, verbose=verbose)
    if rebuild_p:
        sim.faults = dataclasses.replace(sim.faults, rebuild_p=rebuild_p)
    if silence_every_ms:
        sim.faults = dataclasses.replace(sim.faults, silence_every_ms=silence_every_ms)
    return sim.run()
