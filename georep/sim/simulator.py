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
this module only moves their effects through virtual time and a faulty
network:

==========================  =========================================  ====================================
decision                    pure module                                driven here by
==========================  =========================================  ====================================
origin append, idempotence  ``georep/broker/append.py``                producers (``producers.py``), commits
when an ack goes, fsyncs    ``georep/broker/acks.py``                  every append; fsyncs take ``fsync_ms``
what a fetch hands out      ``georep/broker/fetch.py``                 consumers and group members
commit fold and stamps      ``georep/broker/commits.py``               every site, after every event
pulling over a link         ``georep/replication/session.py``          messages, applies, ticks
upstream node, partitions   ``georep/replication/upstream.py``         every session (silent nodes)
what a source sends         ``georep/replication/source.py``           pumps
apply and dedup             ``georep/replication/sink.py``, ``dedup``  every chunk
routing, stalls             ``georep/replication/links.py``            every session
held reports (geo acks)     ``offsets/held.py``                        reports over the links
producer retries            ``georep/client/delivery.py``              producers
group membership            ``cluster/groups.py``                      group members (``groups.py``)
==========================  =========================================  ====================================

Messages between sites (stream opens, chunks, heartbeats, held reports and
their answers) cross the network, where faults drop, duplicate, delay and
reorder them and cut links lose them. Clients talk to their own site over a
connection that only a crash breaks.

Checked after every event (``checker.py``, ``producers.py``,
``consumers.py``, ``groups.py``): I1-I3 at every site; I5 for every consumer
session; exactly-once storage of producer resends; I6 at every ack release
and at every crash; the group invariants. After healing: I4 convergence,
every producer batch answered, every consumer caught up, every commit table
the fold of the commits that reach it, and every acknowledged write still
where it was acknowledged.

Faults (``faults.py``) are site- and link-level: drop, duplicate, delay and
reorder messages, cut and heal links, crash a site (it loses what it had not
fsynced, and every volatile structure) and restart it, skew a site's clock
(timestamps, append times, HLC stamps and session timeouts). Off by default,
a crash can also lose the disk (``rebuild_p``): the site restarts empty with
a new epoch. Also off by default, sites have several nodes that each answer
pulls for the whole site (``SimConfig.site_nodes``), and a node goes silent
for good now and then (``Faults.silence_every_ms``: frozen, or cut off behind
a half-open connection; its site keeps at least one answering node): what
was opened or reported at it gets no answer, and the pullers must move to
another node of the site.

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
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import grpc

from georep.auth.acl_replication import HeldClaimCheck
from georep.broker.acks import AckKind, Acks, Effect, Fail, HeldChanged, Release, StartFlush
from georep.broker.append import Produced, append_as_origin
from georep.broker.commits import CommitLog
from georep.broker.errors import BrokerError
from georep.client.delivery import PartitionDelivery
from georep.client.errors import Operation, from_status
from georep.record.batch import RecordInput, encode_batch, parse_header
from georep.replication.links import PartitionKey
from georep.replication.session import ApplyChunk, LinkEvent, OpenStream, PullConfig
from georep.replication.session import Effect as PullEffect
from georep.replication.sink import apply_chunk
from georep.replication.source import Chunk, ReplicaSource
from georep.server.status import wire_status
from georep.sim.checker import InvariantChecker, InvariantViolation
from georep.sim.consumers import ConsumerWorkload
from georep.sim.faults import FaultCounts, Faults
from georep.sim.groups import GroupWorkload
from georep.sim.producers import MAX_IN_FLIGHT, RETRY_BACKOFF_MS, AckedWrite, SimProducer
from georep.sim.site import OutStream, SimSite
from georep.sim.topologies import DEFAULT_TOPICS, build_topology
from georep.storage.memory_log import MemoryLog
from offsets.commits import OFFSETS_PARTITIONS, OFFSETS_TOPIC, Commit
from offsets.coordinates import Origin
from offsets.vector import VectorOffset
from topology.filters import is_internal
from topology.ids import SiteId
from topology.model import Topology
from topology.reach import expected_sites

START_MS = 1_700_000_000_000  # virtual time starts at a realistic Unix time, so skewed clocks stay positive
DEFAULT_STEPS = 3_000
CLIENT_MS = 1  # one way between a client and its site
PUMP_ROUNDS_MAX = 4  # steps of one source in one event, before others get a turn
PRODUCER_ID_BITS = 62
HEALED = Faults.none()  # the network of the liveness phase


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
    seed: int, topology: str, steps: int = DEFAULT_STEPS, rebuild_p: float = 0.0, consumers: bool = True,
    groups: bool = False, site_nodes: int = 1, silence_every_ms: int = 0,
) -> str:  # fmt: skip
    extra = "" if steps == DEFAULT_STEPS else f" --steps {steps}"
    extra += f" --rebuild-p {rebuild_p}" if rebuild_p else ""
    extra += f" --site-nodes {site_nodes}" if site_nodes != 1 else ""
    extra += f" --silence-every-ms {silence_every_ms}" if silence_every_ms else ""
    extra += "" if consumers else " --no-consumers"
    extra += " --groups" if groups else ""
    return f"python -m georep.sim --seed {seed} --topology {topology}{extra}"


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
        self._claims: dict[SiteId, HeldClaimCheck] = {}  # per upstream: the claims its node would take
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
        self.latency_ms = {
            link.key: self.rng.randint(*self.faults.latency_ms) for link in self.topology.links_sorted()
        }
        self.pull = PullConfig(cfg.idle_timeout_ms, cfg.backoff_ms[0], cfg.backoff_ms[1])
        self.sites: dict[SiteId, SimSite] = {}
        self.pull_nodes = {sid: tuple(f"{sid}/{n}" for n in range(1, max(1, cfg.site_nodes) + 1))
                      for sid in self.topology.site_ids()}  # fmt: skip
        self.silent_nodes: set[str] = set()  # nodes that answer nothing, for good (Faults.silence_every_ms)
        self.origins: list[Origin] = []  # every origin ever, old epochs of rebuilt sites included
        self._make_sites()
        self.producers = self._make_producers()
        self.acked: list[AckedWrite] = []
        # (site, partition) -> {origin: next seq} of everything the site ever held fsynced, across disk losses
        self.ever_flushed: dict[tuple[SiteId, PartitionKey], dict[Origin, int]] = {
            (sid, key): {} for sid in self.sites for key in self.keys
        }
        self.consumers = ConsumerWorkload(self, consumer_count)
        self.groups = GroupWorkload(self, member_count)
        self._handlers: dict[str, Callable[..., None]] = {
            "produce": self._on_produce, "produce_request": self._on_produce_request,
            "produce_answer": self._on_produce_answer, "producer_send": self._on_producer_send,
            "flush": self._on_flush, "fsync_done": self._on_fsync_done, "tick": self._on_tick,
            "deliver": self._on_deliver, "pump": self._on_pump,
            "fault_cut": self._on_fault_cut, "heal": self._on_heal, "fault_crash": self._on_fault_crash,
            "restart": self._on_restart, "fault_silence": self._on_fault_silence,
            **self.consumers.handlers(), **self.groups.handlers(),
        }  # fmt: skip

    def _make_sites(self) -> None:
        cfg = self.config
        decode_commit = functools.cache(Commit.decode)  # every site folds the same commit records (CommitLog)
        for sid in self.topology.site_ids():
            skew = self.rng.randint(-self.faults.skew_ms, self.faults.skew_ms) if self.faults.skew_ms else 0
            origin = Origin(sid, self.rng.randint(1, 1_000_000))
            inbound = tuple(link.src for link in self.topology.links_sorted() if link.dst == sid)
            self.origins.append(origin)
            site = SimSite(sid, origin, skew, self.rng.randint(*cfg.flush_ms), self.rng.randint(*cfg.fsync_ms),
                           inbound, {key: MemoryLog() for key in self.keys},
                           commits=CommitLog(decode_commit))  # fmt: skip
            self.sites[sid] = site
            self._boot(site)

    def _make_producers(self) -> list[SimProducer]:
        producers: list[SimProducer] = []
        for sid in sorted(self.sites):
            for key in self.data_keys:
                acks = Acks()
                reach = len(expected_sites(self.topology, sid, key[0]))
                if reach >= 2 and self.rng.random() < self.config.geo_p:
                    acks = Acks.geo(self.rng.randint(2, reach))
                delivery = PartitionDelivery(key[0], key[1], self._producer_id(), MAX_IN_FLIGHT)
                producers.append(SimProducer(len(producers), sid, key, acks, delivery))
        return producers

    def _producer_id(self) -> int:
        return self.rng.getrandbits(PRODUCER_ID_BITS)

    def _boot(self, site: SimSite) -> None:
        site.boot(self.topology, self.topics, self.fsync_per_batch, self.config.stall_ms, self.pull,
                  self._stream_ids, self.local_ms(site), self._new_member_id, self.pull_nodes)  # fmt: skip

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
        return SimResult(self.seed, self.topology_name, self._events, self.now_ms - START_MS,
                         self._trace.hexdigest(), self.counts, vectors, self.checker.batches_checked,
                         self.now_ms - self._liveness_start_ms)  # fmt: skip

    def _failure(self, message: str) -> SimulationFailure:
        cfg = self.config
        replay = replay_command(self.seed, self.topology_name, cfg.steps, self.faults.rebuild_p,
                                bool(cfg.consumers[1]), bool(cfg.group_members[1]), cfg.site_nodes,
                                self.faults.silence_every_ms)  # fmt: skip
        return SimulationFailure(message, self.seed, self.topology_name, replay)

    def _start(self) -> None:
        for site in self.sites.values():
            self._start_site(site)
        for producer in self.producers:
            self._after(self.rng.randint(0, self.config.produce_ms[1]), "produce", producer.index)
        self.consumers.start()
        self.groups.start()
        if self.faults.cut_every_ms:
            self._after(self._interval(self.faults.cut_every_ms), "fault_cut")
        if self.faults.crash_every_ms:
            self._after(self._interval(self.faults.crash_every_ms), "fault_crash")
        if self.faults.silence_every_ms:
            self._after(self._interval(self.faults.silence_every_ms), "fault_silence")

    def _start_site(self, site: SimSite) -> None:
        """Timers, streams and client connections of a site that has just started (or restarted)."""
        inc = site.incarnation
        self._after(site.flush_ms, "flush", site.id, inc)
        self._after(self.rng.randint(1, self.config.tick_ms), "tick", site.id, inc)
        for src in site.inbound:
            self._perform_pull(site, src, site.sessions[src].start(self.now_ms))
        for producer in self.producers:
            if producer.site == site.id:
                producer.incarnation = inc
                self._send_batches(producer)

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
            self._heal(key)
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
        problems = [f"{p.name} still has batches unanswered" for p in self.producers if not p.done()]
        return problems or self.consumers.problems() or self.groups.problems()

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

    # -- the origin append and its ack ----------------------------------------------

    def append(self, site: SimSite, key: PartitionKey, batch: bytes) -> Produced:
        """``append_as_origin`` at ``site``; registers what it stamped with the checker (I1 bytes)."""
        log = site.logs[key]
        produced = append_as_origin(log, site.producers[key], site.origin, batch, topic=key[0],
                                    max_batch_bytes=1 << 30, now_ms=self.local_ms(site))  # fmt: skip
        self._changed(site.id, key)
        if not produced.duplicate:
            self.checker.register(key, parse_header(log.read(produced.result.base_offset, 1).data))
        return produced

    def wait_ack(self, site: SimSite, key: PartitionKey, produced: Produced, acks: Acks,
                 then: Callable[[Exception | None], None], timeout_ms: int = 0) -> None:  # fmt: skip
        """Hold ``then`` until ``site``'s ack table releases (None) or fails (the error) the batch."""
        token = next(self._tokens)
        site.waiters[token] = then
        r = produced.result
        self.perform_acks(site, site.acks.wait(token, key, produced.end_offset, produced.origin, r.last_origin_seq,
                                               acks, self.local_ms(site), timeout_ms))  # fmt: skip

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
                for upstream in site.inbound:
                    self._report(site, upstream)

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
        for dst, out in sorted(site.out_streams.items()):  # newly durable batches: sources may send them now
            if key in out.source.wanted:
                self._pump_soon(site, dst, 0)

    def _on_flush(self, sid: SiteId, incarnation: int) -> None:
        """The periodic flush of topics with a flush interval."""
        site = self.alive(sid, incarnation)
        if site is None:
            return
        for key in self.keys:
            if not self.fsync_per_batch[key[0]]:
                self.perform_acks(site, site.acks.flush(key, site.logs[key].log_end_offset))
        self._after(site.flush_ms, "flush", sid, incarnation)

    # -- producers -------------------------------------------------------------------

    def _on_produce(self, pi: int) -> None:
        if self.phase != "safety":
            return
        producer = self.producers[pi]
        cfg = self.config
        site = self.sites[producer.site]
        ts = self.local_ms(site)
        records = []
        for _ in range(self.rng.randint(*cfg.records_per_batch)):
            value = f"p{pi}-{producer.next_value}".encode() + self.rng.randbytes(self.rng.randint(0, 30))
            producer.next_value += 1
            records.append(RecordInput(f"k{self.rng.randrange(100)}".encode(), value, (), ts))
        producer.new_batch(records, self.now_ms)
        self.counts.produced_batches += 1
        self._send_batches(producer)
        self._after(self.rng.randint(*cfg.produce_ms), "produce", pi)

    def _send_batches(self, producer: SimProducer) -> None:
        """What the producer's delivery lets go now, over its connection to its site."""
        site = self.alive(producer.site, producer.incarnation)
        if site is None:
            return
        delivery = producer.delivery
        if delivery.not_before_ms > self.now_ms:
            return
        for batch in delivery.take_sendable():
            if batch.data is None:
                batch.data = encode_batch(batch.records, producer_id=batch.producer_id, producer_epoch=0,
                                          base_sequence=batch.base_sequence or 0)  # fmt: skip
            elif batch.sent_ms:
                producer.resent_batches += 1
            batch.sent_ms = self.now_ms
            producer.next_correlation += 1
            producer.in_flight[producer.next_correlation] = batch
            self._after(CLIENT_MS, "produce_request", producer.index, producer.incarnation, producer.next_correlation)

    def _on_produce_request(self, pi: int, incarnation: int, correlation: int) -> None:
        producer = self.producers[pi]
        site = self.alive(producer.site, incarnation)
        batch = producer.in_flight.get(correlation)
        if site is None or batch is None or batch.data is None:
            return
        key = producer.key
        try:
            produced = self.append(site, key, batch.data)
        except BrokerError as exc:
            self._after(CLIENT_MS, "produce_answer", pi, incarnation, correlation, None, exc)
            return
        if not produced.duplicate:
            producer.stored_new(batch, site.id, produced.origin, produced.result.base_origin_seq)

        def answer(error: Exception | None) -> None:
            if error is None:
                self._check_ack_promise(producer, site, produced)
            self._after(CLIENT_MS, "produce_answer", pi, incarnation, correlation, produced, error)

        self.wait_ack(site, key, produced, producer.acks, answer, self.config.geo_timeout_ms)

    def _check_ack_promise(self, producer: SimProducer, site: SimSite, produced: Produced) -> None:
        """I6 at the ack: the ack level's promise holds now.

        ``geo:N``: N sites hold the batch fsynced, or held it fsynced and lost their disk since (a disk
        loss is the failure the promise is about: the ack may rest on what a site reported just before).
        ``leader`` on a topic that fsyncs per batch: the origin holds it fsynced.
        """
        key = producer.key
        origin, seq = produced.origin, int(produced.result.last_origin_seq)
        holders = {
            sid: s.rebuilds for sid, s in sorted(self.sites.items())
            if s.logs[key].flushed_vector().get(origin, 0) > seq
        }  # fmt: skip
        held = [sid for sid in sorted(self.sites) if self.ever_flushed[(sid, key)].get(origin, 0) > seq]
        needed = producer.acks.sites if producer.acks.kind is AckKind.GEO else 1
        durable = needed > 1 or self.fsync_per_batch[key[0]]
        if durable and len(held) < needed:
            raise InvariantViolation(
                f"I6: {producer.name} was acked for {origin} seq {seq} in {key[0]}[{key[1]}], but only "
                f"{len(held)} site(s) ({', '.join(held) or 'none'}) hold it fsynced; acks={producer.acks} "
                f"promises {needed}"
            )
        if durable:
            self.acked.append(AckedWrite(key, origin, seq, holders, str(producer.acks)))

    def _on_produce_answer(self, pi: int, incarnation: int, correlation: int, produced: Produced | None,
                           error: Exception | None) -> None:  # fmt: skip
        producer = self.producers[pi]
        if producer.incarnation != incarnation:
            return  # the connection it came on broke: the batch was already requeued
        batch = producer.in_flight.pop(correlation, None)
        if batch is None:
            return
        delivery = producer.delivery
        if error is None:
            delivery.on_success(batch)
            producer.acked_batches += 1
        else:
            code, reason = wire_status(error) or (grpc.StatusCode.INTERNAL, "")
            client_error = from_status(Operation.PRODUCE, code, str(error), reason)
            if delivery.on_error(batch, client_error, self.now_ms, RETRY_BACKOFF_MS):
                producer.failed_batches += 1
                self.counts.geo_timeouts += type(error).__name__ == "GeoAckTimeout"
            if delivery.not_before_ms > self.now_ms:
                self._after(int(delivery.not_before_ms - self.now_ms), "producer_send", pi)
        self._resolve(producer)
        self._send_batches(producer)

    def _on_producer_send(self, pi: int) -> None:
        self._send_batches(self.producers[pi])

    def _resolve(self, producer: SimProducer) -> None:
        delivery = producer.delivery
        if delivery.round_complete():
            for _failed in delivery.resolve(self._producer_id()):
                producer.failed_batches += 1

    def _producers_lose_connection(self, site: SimSite) -> None:
        for producer in self.producers:
            if producer.site == site.id and producer.incarnation >= 0:
                producer.incarnation = -1
                producer.in_flight.clear()
                producer.delivery.on_stream_broken()
                self._resolve(producer)

    def _check_acked_writes(self, crashed: SimSite | None = None) -> None:
        """I6 after the fact: every site that held an acked batch fsynced still holds it, unless it lost its disk."""
        for w in self.acked:
            for sid, rebuilds in w.holders.items():
                site = self.sites[sid]
                if (crashed is not None and site is not crashed) or site.rebuilds != rebuilds:
                    continue
                if site.logs[w.key].vector().get(w.origin, 0) <= w.last_seq:
                    raise InvariantViolation(
                        f"I6: site {sid} held {w.origin} seq {w.last_seq} of {w.key[0]}[{w.key[1]}] fsynced when it "
                        f"was acked (acks={w.acks}) and no longer holds it"
                    )

    # -- ticks ----------------------------------------------------------------------

    def _on_tick(self, sid: SiteId, incarnation: int) -> None:
        site = self.alive(sid, incarnation)
        if site is None:
            return
        now = self.now_ms
        for key, log in site.logs.items():
            site.links.local_vector(key, log.vector())
        site.links.tick(now)
        for src in site.inbound:
            self._perform_pull(site, src, site.sessions[src].tick(now))
        self.perform_acks(site, site.acks.tick(self.local_ms(site)))
        self._report_timeouts(site)
        for upstream in site.inbound:
            self._report(site, upstream)
        self.groups.tick(site)
        self._after(self.config.tick_ms, "tick", sid, incarnation)

    # -- the network ------------------------------------------------------------------

    def _send(self, link: tuple[SiteId, SiteId], to: SiteId, message: Message) -> bool:
        """Put ``message`` on the wire of ``link`` towards ``to``; False when the connection is broken."""
        if link in self.cut or not self.sites[to].up:
            self.counts.cut_drops += 1
            return False
        faults = self.faults if self.phase == "safety" else HEALED
        if faults.drop_p and self.rng.random() < faults.drop_p:
            self.counts.drops += 1
            return True
        copies = 1
        if faults.dup_p and self.rng.random() < faults.dup_p:
            copies = 2
            self.counts.dups += 1
        for _copy in range(copies):
            delay = self.latency_ms[link] + (self.rng.randint(0, faults.jitter_ms) if faults.jitter_ms else 0)
            if faults.reorder_p and self.rng.random() < faults.reorder_p:
                delay += self.rng.randint(1, faults.reorder_ms)
                self.counts.reorders += 1
            self._after(delay, "deliver", link, message)
        return True

    def _on_deliver(self, link: tuple[SiteId, SiteId], message: Message) -> None:
        if link in self.cut:
            self.counts.cut_drops += 1
            return
        if isinstance(message, OpenMessage):
            self._on_open(message)
        elif isinstance(message, ChunkMessage):
            self._on_chunks(message)
        elif isinstance(message, HeldReport):
            self._on_report(message)
        else:
            self._on_report_answer(message)

    # -- replication: the source side ---------------------------------------------------

    def _on_open(self, msg: OpenMessage) -> None:
        site = self.sites[msg.src]
        if not site.up:
            self.counts.cut_drops += 1
            return
        if msg.node in self.silent_nodes:
            self.counts.silent_drops += 1
            return
        source = ReplicaSource(site.logs, msg.wants, heartbeat_ms=self.config.heartbeat_ms)
        site.out_streams[msg.dst] = OutStream(msg.stream_id, source, msg.node)
        self._pump_soon(site, msg.dst, 0)

    def _pump_soon(self, site: SimSite, dst: SiteId, delay_ms: int) -> None:
        out = site.out_streams[dst]
        due = self.now_ms + delay_ms
        if 0 <= out.pump_due_ms <= due:
            return  # a pump at least as early is already scheduled
        out.pump_due_ms = due
        self._after(delay_ms, "pump", site.id, site.incarnation, dst, out.stream_id, due)

    def _on_pump(self, sid: SiteId, incarnation: int, dst: SiteId, stream_id: int, due: int) -> None:
        site = self.alive(sid, incarnation)
        out = None if site is None else site.out_streams.get(dst)
        if site is None or out is None or out.stream_id != stream_id or out.pump_due_ms != due:
            return
        out.pump_due_ms = -1
        for _round in range(PUMP_ROUNDS_MAX):  # as the node's handler loops: send what there is, then wait
            step = out.source.step(self.now_ms, self.config.chunk_bytes)
            if step.chunks:
                self.counts.chunks += 0 if step.heartbeat else 1
                self.counts.heartbeats += step.heartbeat
                message = ChunkMessage(sid, dst, stream_id, tuple(step.chunks), step.heartbeat)
                if not self._send((sid, dst), dst, message):
                    del site.out_streams[dst]  # the connection broke: the stream ends at the source too
                    return
            if not step.again:
                self._pump_soon(site, dst, step.wake_ms - self.now_ms)
                return
        self._pump_soon(site, dst, self.config.pump_ms)  # more to send: after other work has run

    # -- replication: the destination side ------------------------------------------------

    def _on_chunks(self, msg: ChunkMessage) -> None:
        site = self.sites[msg.dst]
        if not site.up:
            self.counts.cut_drops += 1
            return
        session = site.sessions[msg.src]
        self._perform_pull(site, msg.src, session.on_message(msg.stream_id, msg.chunks, msg.heartbeat, self.now_ms))

    def _perform_pull(self, site: SimSite, src: SiteId, effects: list[PullEffect]) -> None:
        """Carry out a pull session's effects: opens go on the wire, chunks are applied, events counted."""
        session = site.sessions[src]
        queue = deque(effects)
        while queue:
            effect = queue.popleft()
            if isinstance(effect, OpenStream):
                message = OpenMessage(src, site.id, effect.stream_id, effect.wants, effect.address)
                self._send((src, site.id), src, message)
            elif isinstance(effect, ApplyChunk):
                log = site.logs[effect.key]
                outcome = apply_chunk(log, effect.batches, self.local_ms(site))
                self.counts.applied_batches += outcome.appended_batches
                if outcome.appended_batches:
                    self._changed(site.id, effect.key)
                    self.perform_acks(site, site.acks.replicated(effect.key, log.log_end_offset))
                queue.extend(session.on_applied(effect.stream_id, effect.key, outcome, self.now_ms))
            else:
                self._link_event(site, src, effect)

    def _link_event(self, site: SimSite, src: SiteId, event: LinkEvent) -> None:
        self._log(f"{site.id} <- {src}: {event.kind}: {event.text}")
        if event.kind == "diverged":
            raise InvariantViolation(f"I1 bytes: {src} sent {site.id} batches that straddle its vector: {event.text}")
        if event.kind == "up":
            site.reporters[src].reset()  # src may have restarted and forgotten: report everything again
            self._report(site, src)
        elif event.kind == "timeout":
            self.counts.timeouts += 1
        elif event.kind == "gap":
            self.counts.gap_reopens += 1
        elif event.kind == "tail":
            self.counts.tail_reopens += 1
        elif event.kind == "wants":
            self.counts.wants_reopens += 1

    # -- held reports (acks=geo:N) ------------------------------------------------------------

    def _report(self, site: SimSite, upstream: SiteId) -> None:
        """Send ``upstream`` what ``site`` knows sites hold, if it has news and no report in flight."""
        if not site.up:
            return
        entries = site.reporters[upstream].next_report(site.acks.held)
        if entries is None:
            return
        self._seq += 1
        report_id = site.report_ids[upstream] = self._seq
        flat = tuple((s, t, p, v) for (s, t, p), v in entries)
        self.counts.held_reports += 1
        site.report_sent_ms[upstream] = self.now_ms
        node = site.upstreams[upstream].current  # the node's reports go where its pulls go
        self._send((upstream, site.id), upstream, HeldReport(site.id, upstream, report_id, flat, node))

    def _on_report(self, msg: HeldReport) -> None:
        upstream = self.sites[msg.upstream]
        if not upstream.up:
            return
        if msg.node in self.silent_nodes:
            self.counts.silent_drops += 1
            return
        for site, topic, _partition, _vector in msg.entries:  # the node refuses these (ClaimRefused)
            claims = self._claims.get(msg.upstream)
            if claims is None:
                claims = self._claims[msg.upstream] = HeldClaimCheck(self.topology, msg.upstream)
            why = claims.refusal(msg.reporter, site, topic)
            if why is not None:
                raise InvariantViolation(f"site {msg.upstream} would refuse {msg.reporter}'s honest claim that site "
                                         f"{site} holds {topic}: {why}")  # fmt: skip
        self.perform_acks(upstream, upstream.acks.held_reported(msg.entries))
        reporter = self.sites[msg.reporter]
        answer = HeldAnswer(msg.reporter, msg.upstream, msg.report_id, reporter.incarnation)
        self._send((msg.upstream, msg.reporter), msg.reporter, answer)

    def _on_report_answer(self, msg: HeldAnswer) -> None:
        site = self.alive(msg.reporter, msg.incarnation)
        if site is None or site.report_ids.get(msg.upstream) != msg.report_id:
            return
        del site.report_ids[msg.upstream]
        site.reporters[msg.upstream].acked()
        self._report(site, msg.upstream)

    def _report_timeouts(self, site: SimSite) -> None:
        """Reports with no answer for ``report_timeout_ms`` failed (the node's RPC timeout): send them again."""
        for upstream, sent in sorted(site.report_sent_ms.items()):
            if upstream in site.report_ids and self.now_ms - sent >= self.config.report_timeout_ms:
                del site.report_ids[upstream]
                site.reporters[upstream].failed()

    # -- faults -------------------------------------------------------------------------

    def _on_fault_cut(self) -> None:
        if self.phase != "safety":
            return
        links = [link.key for link in self.topology.links_sorted() if link.key not in self.cut]
        if links:
            key = self.rng.choice(links)
            heal_ms = self.rng.randint(*self.faults.cut_ms)
            self.cut[key] = self.now_ms + heal_ms
            self.counts.cuts += 1
            self._log(f"cut {key[0]}->{key[1]} for {heal_ms} ms")
            self._after(heal_ms, "heal", key)
        self._after(self._interval(self.faults.cut_every_ms), "fault_cut")

    def _on_heal(self, key: tuple[SiteId, SiteId]) -> None:
        if key in self.cut and self.cut[key] <= self.now_ms:
            self._heal(key)

    def _heal(self, key: tuple[SiteId, SiteId]) -> None:
        del self.cut[key]
        self.counts.heals += 1
        self._log(f"heal {key[0]}->{key[1]}")

    def _on_fault_silence(self) -> None:
        """A node goes silent for good: it answers no pull and no report from now on (the site's other nodes do).
        Streams it was serving stop, as a frozen process's would; nothing tells their pullers so."""
        if self.phase != "safety":
            return
        candidates = [
            (sid, node) for sid in sorted(self.sites) for node in self.pull_nodes[sid]
            if node not in self.silent_nodes and sum(n not in self.silent_nodes for n in self.pull_nodes[sid]) >= 2
        ]  # fmt: skip
        if candidates:
            sid, node = self.rng.choice(candidates)
            self.silent_nodes.add(node)
            self.counts.silenced += 1
            self._log(f"node {node} goes silent")
            site = self.sites[sid]
            for dst in sorted(d for d, out in site.out_streams.items() if out.node == node):
                del site.out_streams[dst]
        self._after(self._interval(self.faults.silence_every_ms), "fault_silence")

    def _disconnect(self, site: SimSite) -> None:
        """The site stops serving: its timers and connections of this incarnation do nothing from now on, and the
        connections to it break."""
        site.up = False
        site.incarnation += 1
        site.out_streams.clear()
        site.waiters.clear()
        for other in self.sites.values():
            other.out_streams.pop(site.id, None)

    def _on_fault_crash(self) -> None:
        if self.phase != "safety":
            return
        candidates = [sid for sid, site in self.sites.items() if site.up]
        if candidates:
            sid = self.rng.choice(candidates)
            rebuild = bool(self.faults.rebuild_p) and self.rng.random() < self.faults.rebuild_p
            self._crash(self.sites[sid], rebuild)
            self._after(self.rng.randint(*self.faults.down_ms), "restart", sid, self.sites[sid].incarnation)
        self._after(self._interval(self.faults.crash_every_ms), "fault_crash")

    def _crash(self, site: SimSite, rebuild: bool = False) -> None:
        lost = 0
        for key in self.keys:
            log = site.logs[key]
            before = len(log.batch_entries())
            if rebuild:
                site.logs[key] = MemoryLog()
            else:
                log.crash()
            lost += before - len(site.logs[key].batch_entries())
        self.counts.crashes += 1
        self.counts.lost_batches += lost
        self._changed(site.id, *self.keys)
        if rebuild:
            self.counts.rebuilds += 1
            site.rebuilds += 1
            site.origin = Origin(site.id, site.origin.epoch + self.rng.randint(1, 1_000))
            self.origins.append(site.origin)
        what = f"batches, rebuilt empty as {site.origin}" if rebuild else "unflushed batches"
        self._log(f"crash {site.id}: lost {lost} {what}")
        self._disconnect(site)
        if rebuild:  # the old epoch is never stamped again, so no coordinate is re-issued
            self.checker.rescan(site.id, site.logs)
        else:
            self.checker.on_crash(site.id, site.origin, {str(s): x.logs for s, x in self.sites.items()})
        for producer in self.producers:
            producer.forget_lost(site.id, site.logs[producer.key].vector(), rebuild)
        self._producers_lose_connection(site)
        self._check_acked_writes(crashed=site)
        self.consumers.site_crashed(site, rebuild)
        self.groups.site_crashed(site)

    def _on_restart(self, sid: SiteId, incarnation: int) -> None:
        site = self.sites[sid]
        if site.up or site.incarnation != incarnation:
            return
        self._restart(sid)

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
    config = SimConfig(steps=steps, consumers=(2, 3) if consumers else (0, 0),
                       group_members=(2, 3) if groups else (0, 0), site_nodes=site_nodes)  # fmt: skip
    sim = Simulator(seed, topology, faults=faults, config=config, verbose=verbose)
    if rebuild_p:
        sim.faults = dataclasses.replace(sim.faults, rebuild_p=rebuild_p)
    if silence_every_ms:
        sim.faults = dataclasses.replace(sim.faults, silence_every_ms=silence_every_ms)
    return sim.run()
