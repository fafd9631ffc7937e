"""A deterministic multi-site simulator (STYLE.md §2: FoundationDB's Sim2, TigerBeetle's VOPR).

``Simulator(seed, topology_name)`` runs N whole sites in one thread, with
virtual time and a heap of ``(due_ms, seq, kind, args)`` events: it jumps
time to the next event. The only randomness is one ``random.Random(seed)``:
it draws the topology (``random-N``), the fault intensities, each site's
epoch and clock skew, the workload and every fault. Iteration is over sorted
keys only. So one seed always gives one run, and :attr:`SimResult.trace`
(a hash of every event and the final vectors) proves it.

Each site drives the same core objects as a node does:

* one ``MemoryLog`` per partition; crashes call ``MemoryLog.crash()``, which
  drops what was not flushed; a timer flushes every ``flush_ms``;
* producers that append as the origin does: ``encode_batch``, then
  ``stamp_origin`` with the partition's next seq of this site's origin, then
  ``log.append``;
* a ``LinkManager`` fed with ``link_up``, ``link_down``, ``upstream_vector``,
  ``local_vector`` and ``tick``;
* per inbound link ``src -> dst``, a simulated ``Replicate`` stream: dst
  sends its wants (``LinkManager.wants(src)`` plus its have-vectors) to src;
  src builds a ``ReplicaSource`` and sends its chunks back, and heartbeats
  when idle; dst applies each chunk with ``apply_chunk``. dst reopens the
  stream when its wants change, on a gap, or after ``timeout_ms`` without a
  message (that is how it notices a cut link or a crashed upstream).

Consumers and committed positions (I5), unless ``SimConfig.consumers`` is
``(0, 0)`` (``--no-consumers``, the runs as they were before issue 4):

* each site folds the records of the internal topic ``__georep_offsets``
  (``OFFSETS_PARTITIONS`` partitions, replicated like any topic by the same
  streams, so commits are dropped, duplicated, reordered, delayed and lost in
  crashes like data) into its own ``CommitTable``, after every event, with its
  own ``HybridClock`` fed by its skewed clock and the stamps it folds;
* a few consumers per run (``consumers.py``), the first of them exactly-once,
  each read one data partition through one site: from a vector offset, in
  local-offset order, flushed batches only, filtered by the client's
  ``decode_response``. They commit their vector every few deliveries at their
  site (stamped ``clock.now(wall, after=last stamp)``, one batch appended as
  that site's origin); a commit is acknowledged when that site flushes it;
* at random times, during cuts and right after crashes too, a consumer hops
  to another live site and resumes from its in-memory vector (failover) or
  from the vector that site's table holds (restart).

Checked: every session delivers, per origin, exactly the seqs after its start
vector, in order (no duplicate, no gap); after healing each consumer has read
everything its site holds; a site's committed position never moves back,
except in a crash, and then not below what it returned at its last flush (so
not below the last commit acknowledged there); after healing every site's
table is the fold of every commit that can reach it; the exactly-once consumer
counts every record once over all its sites; and no consumer ever delivered a
record that a crash of its origin lost.

Topic metadata is static here: every site knows every topic, with the same
partition count, from the start. Replicating topic definitions is not
simulated.

Faults (``faults.py``) are site- and link-level: drop, duplicate, delay and
reorder messages, cut and heal links, crash a site (it keeps its epoch: it lost
only unflushed batches, which no source ever serves) and restart it, skew a
site's clock (producer timestamps and append times only). Off by default, a
crash can also lose the disk (``rebuild_p``, ``--rebuild-p``): the site
restarts empty with a new epoch, and its old epoch lives on only where it was
copied.

A run has two phases, as in VOPR. Safety: ``steps`` events with producers and
faults on; I1-I3 and the I5 checks are made after every event. Liveness: every
fault is healed, crashed sites restart, producers stop, consumers stop hopping,
and the run goes on until I4 holds (every site that ``expected_sites`` names
holds all of each origin's records, and no other site holds any) and the
consumers have caught up, or fails after ``liveness_ms`` of virtual time.

A failure raises :class:`SimulationFailure`, whose message holds the seed, the
topology and the command that replays the run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import random
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from georep.client.consumer import decode_response
from georep.record.batch import (
    HEADER_BYTES,
    RecordInput,
    decode_records,
    encode_batch,
    iter_headers,
    parse_header,
    stamp_origin,
)
from georep.replication.links import LinkManager
from georep.replication.sink import apply_chunk, pull_have
from georep.replication.source import Chunk, ReplicaSource
from georep.sim.checker import READ_BYTES_MAX, SCAN_ROUNDS_MAX, InvariantChecker, InvariantViolation
from georep.sim.consumers import Session, SimConsumer
from georep.sim.faults import FaultCounts, Faults
from georep.sim.topologies import DEFAULT_TOPICS, build_topology
from georep.storage.api import start_offset_for_vector
from georep.storage.memory_log import MemoryLog
from offsets.commits import OFFSETS_PARTITIONS, OFFSETS_TOPIC, Commit, CommitTable, offsets_partition
from offsets.coordinates import Origin
from offsets.hlc import HybridClock
from offsets.vector import VectorOffset
from topology.filters import is_internal
from topology.ids import SiteId
from topology.model import Topology
from topology.reach import expected_sites

PartitionKey = tuple[str, int]
START_MS = 1_700_000_000_000  # virtual time starts at a realistic Unix time, so skewed clocks stay positive
DEFAULT_STEPS = 3_000


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Timings of the simulated sites (virtual ms) and run bounds."""

    steps: int = DEFAULT_STEPS  # events in the safety phase
    produce_ms: tuple[int, int] = (20, 200)  # gap between two batches of one producer
    records_per_batch: tuple[int, int] = (1, 4)
    flush_ms: tuple[int, int] = (10, 100)  # each site's flush interval is drawn from this
    heartbeat_ms: int = 100
    timeout_ms: int = 350  # dst gives up on a stream after this long without a message
    tick_ms: int = 100
    stall_ms: int = 600
    pump_ms: int = 2  # a source with more to send sends again after this long
    chunk_bytes: int = 2_048
    liveness_ms: int = 60_000  # virtual time the liveness phase may take to converge
    settle_check_ms: int = 50
    max_events: int = 2_000_000
    consumers: tuple[int, int] = (2, 3)  # consumers per run; the first is an exactly-once one. (0, 0): none
    consume_ms: tuple[int, int] = (10, 80)  # gap between two fetches of one consumer
    fetch_bytes: int = 1_024
    commit_every: tuple[int, int] = (1, 6)  # deliveries between commits of an ordinary consumer
    hop_ms: tuple[int, int] = (100, 1_500)  # gap between two hops of one consumer to another site
    # Consumers read only flushed batches, as replication sources do. True models a broker that serves
    # the unflushed tail, to show what the I5 checks catch then (a crash re-issues consumed coordinates).
    consumer_reads_unflushed: bool = False


class SimulationFailure(AssertionError):
    """A run broke an invariant or did not converge. The message says how to replay it."""

    def __init__(
        self, message: str, seed: int, topology: str, steps: int, rebuild_p: float = 0.0, consumers: bool = True
    ) -> None:
        self.seed = seed
        self.topology = topology
        self.steps = steps
        self.replay = replay_command(seed, topology, steps, rebuild_p, consumers)
        super().__init__(f"{message}\n  seed={seed} topology={topology} steps={steps}\n  replay: {self.replay}")


def replay_command(
    seed: int, topology: str, steps: int = DEFAULT_STEPS, rebuild_p: float = 0.0, consumers: bool = True
) -> str:
    extra = "" if steps == DEFAULT_STEPS else f" --steps {steps}"
    extra += f" --rebuild-p {rebuild_p}" if rebuild_p else ""
    extra += "" if consumers else " --no-consumers"
    return f"python -m georep.sim --seed {seed} --topology {topology}{extra}"


@dataclass(frozen=True, slots=True)
class OpenStream:
    """dst -> src: open a ``Replicate`` stream with these wants."""

    src: SiteId
    dst: SiteId
    stream_id: int
    wants: Mapping[PartitionKey, tuple[dict[Origin, int], tuple[str, ...]]]

    def describe(self) -> str:
        return f"open {self.src}->{self.dst} #{self.stream_id}"


@dataclass(frozen=True, slots=True)
class ChunkMessage:
    """src -> dst: chunks of one stream (data, or a heartbeat with one empty chunk per partition)."""

    src: SiteId
    dst: SiteId
    stream_id: int
    chunks: tuple[Chunk, ...]
    heartbeat: bool

    def describe(self) -> str:
        size = sum(len(c.batches) for c in self.chunks)
        kind = "heartbeat" if self.heartbeat else f"chunk {size}B"
        return f"{kind} {self.src}->{self.dst} #{self.stream_id}"


Message = OpenStream | ChunkMessage


@dataclass(slots=True)
class InStream:
    """At dst: the stream pulling from one upstream."""

    stream_id: int
    wants: dict[PartitionKey, tuple[SiteId, ...]]
    last_message_ms: int
    delivered: bool = False  # has any message of this stream arrived
    # Set by a heartbeat that showed src holding more of a wanted origin than dst; cleared by data.
    # If the next heartbeat finds dst still short of it, the data was lost on the way (see _check_tail).
    promised: dict[PartitionKey, dict[Origin, int]] | None = None


@dataclass(slots=True)
class OutStream:
    """At src: the stream serving one downstream."""

    stream_id: int
    source: ReplicaSource
    last_send_ms: int
    pump_pending: bool = False


@dataclass(slots=True)
class SimSite:
    id: SiteId
    origin: Origin
    skew_ms: int
    flush_ms: int
    logs: dict[PartitionKey, MemoryLog]
    links: LinkManager
    inbound: tuple[SiteId, ...]  # srcs of the links into this site
    up: bool = True
    incarnation: int = 0  # bumped by each crash: timers of an older incarnation do nothing
    in_streams: dict[SiteId, InStream] = field(default_factory=dict)
    out_streams: dict[SiteId, OutStream] = field(default_factory=dict)
    # LinkManager.wants() depends only on the inbound link states and the stalls; routing is costly
    # enough to dominate a run, so answers are kept per such state (and dropped with the LinkManager).
    wants_memo: dict[tuple[object, ...], dict[SiteId, dict[PartitionKey, tuple[SiteId, ...]]]] = field(
        default_factory=dict
    )
    # Committed consumer positions, as a node keeps them: the commits of the internal topic's logs,
    # folded up to local offset ``folded[partition]``, and the site's HLC (fed by its skewed clock).
    # Neither is durable: a crash re-folds the logs it kept, with a fresh clock.
    commits: CommitTable = field(default_factory=CommitTable)
    clock: HybridClock = field(default_factory=HybridClock)
    folded: dict[int, int] = field(default_factory=dict)
    # Per consumer: the index of the commit its table returned last, and at the last flush.
    winners: dict[int, int] = field(default_factory=dict)
    durable_winners: dict[int, int] = field(default_factory=dict)

    def wants(self, src: SiteId) -> dict[PartitionKey, tuple[SiteId, ...]]:
        state = (tuple(link.state for _s, link in sorted(self.links.links.items())), tuple(sorted(self.links.stalled)))
        memo = self.wants_memo.setdefault(state, {})
        found = memo.get(src)
        if found is None:
            found = memo[src] = self.links.wants(src)
        return found


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
        self.faults = faults if faults is not None else Faults.swarm(self.rng)
        # Drawn only when consumers are on, so that a run without them is the run it was before they existed.
        consumer_count = self.rng.randint(*self.config.consumers) if self.config.consumers[1] else 0
        self.topics = dict(sorted((topics or DEFAULT_TOPICS).items()))
        if consumer_count:
            self.topics = dict(sorted({**self.topics, OFFSETS_TOPIC: OFFSETS_PARTITIONS}.items()))
        self.data_keys = tuple(key for key in self.keys_of(self.topics) if not is_internal(key[0]))
        self.keys = self.keys_of(self.topics)
        self.verbose = verbose
        self._print = log or (lambda line: print(line, file=sys.stderr))
        self.now_ms = START_MS
        self.counts = FaultCounts()
        self.checker = InvariantChecker()
        self._heap: list[tuple[int, int, str, tuple[object, ...]]] = []
        self._seq = 0
        self._next_stream_id = 0
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
        self.sites: dict[SiteId, SimSite] = {}
        self.origins: list[Origin] = []  # every origin ever, old epochs of rebuilt sites included
        for sid in self.topology.site_ids():
            skew = self.rng.randint(-self.faults.skew_ms, self.faults.skew_ms) if self.faults.skew_ms else 0
            origin = Origin(sid, self.rng.randint(1, 1_000_000))
            inbound = tuple(link.src for link in self.topology.links_sorted() if link.dst == sid)
            self.origins.append(origin)
            self.sites[sid] = SimSite(
                sid, origin, skew, self.rng.randint(*self.config.flush_ms),
                {key: MemoryLog() for key in self.keys}, self._new_link_manager(sid), inbound,
            )  # fmt: skip
        self.consumers: list[SimConsumer] = []
        for i in range(consumer_count):
            key = self.rng.choice(self.data_keys)
            site = self.rng.choice(sorted(self.sites))
            every = 1 if i == 0 else self.rng.randint(*self.config.commit_every)
            session = Session(site, 0, VectorOffset(), "start", -1, position=0)
            self.consumers.append(SimConsumer(i, f"g{i}", key, i == 0, every, session))
        self.offsets_keys = sorted({(OFFSETS_TOPIC, offsets_partition(c.group)) for c in self.consumers})

    @staticmethod
    def keys_of(topics: Mapping[str, int]) -> tuple[PartitionKey, ...]:
        return tuple((t, p) for t, n in topics.items() for p in range(n))

    # -- running ------------------------------------------------------------------

    def advance(self, steps: int) -> None:
        """Run up to ``steps`` more events of the safety phase (starting the run if needed).

        For tests that inspect or tamper with the sites part way; :meth:`run` finishes the run.
        """
        try:
            self._run_safety(steps)
        except InvariantViolation as e:
            raise self._failure(f"invariant violated at t+{self.now_ms - START_MS}ms event {self._events}: {e}") from e

    def run(self) -> SimResult:
        """Safety phase (what is left of it), then liveness phase. Raises :class:`SimulationFailure`."""
        try:
            self._run_safety(self.config.steps - self._safety_steps)
            self._run_liveness()
            self.checker.rescan_all({s: site.logs for s, site in self.sites.items()})
            self._check_consumers_done()
        except InvariantViolation as e:
            raise self._failure(f"invariant violated at t+{self.now_ms - START_MS}ms event {self._events}: {e}") from e
        vectors = {
            str(s): {key: {str(o): int(n) for o, n in sorted(site.logs[key].vector().items())} for key in self.keys}
            for s, site in self.sites.items()
        }
        self._trace.update(repr(sorted(vectors.items())).encode())
        for c in self.consumers:
            self._trace.update(f"{c.group} {c.session.vector().to_text()} {c.delivered} {len(c.commits)}".encode())
        return SimResult(self.seed, self.topology_name, self._events, self.now_ms - START_MS,
                         self._trace.hexdigest(), self.counts, vectors, self.checker.batches_checked,
                         self.now_ms - self._liveness_start_ms)  # fmt: skip

    def _failure(self, message: str) -> SimulationFailure:
        return SimulationFailure(message, self.seed, self.topology_name, self.config.steps, self.faults.rebuild_p,
                                 bool(self.config.consumers[1]))  # fmt: skip

    def _start(self) -> None:
        for sid, site in self.sites.items():
            self._start_site(site)
            for key in self.data_keys:
                self._after(self.rng.randint(0, self.config.produce_ms[1]), "produce", sid, site.incarnation, key)
        for c in self.consumers:
            self._after(self.rng.randint(*self.config.consume_ms), "consume", c.index)
            self._after(self.rng.randint(*self.config.hop_ms), "hop", c.index)
        if self.faults.cut_every_ms:
            self._after(self._interval(self.faults.cut_every_ms), "fault_cut")
        if self.faults.crash_every_ms:
            self._after(self._interval(self.faults.crash_every_ms), "fault_crash")

    def _start_site(self, site: SimSite) -> None:
        """Timers and streams of a site that has just started (or restarted)."""
        inc = site.incarnation
        self._after(site.flush_ms, "flush", site.id, inc)
        self._after(self.rng.randint(1, self.config.tick_ms), "tick", site.id, inc)
        for src in site.inbound:
            self._reopen(site, src)

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
        self._log("liveness: heal every fault, restart every site, stop producers")
        for key in sorted(self.cut):
            self._heal(key)
        for sid, site in self.sites.items():
            if not site.up:
                self._restart(sid, site.incarnation)
        deadline = self.now_ms + self.config.liveness_ms
        next_check = self.now_ms
        logs = {str(s): site.logs for s, site in self.sites.items()}
        origins = self.origins
        for _step in range(self.config.max_events):
            if self.now_ms >= next_check:
                if not self.checker.convergence_problems(self.topology, origins, logs, self.keys) and not (
                    self._consumer_problems()
                ):
                    return
                next_check = self.now_ms + self.config.settle_check_ms
            if self.now_ms > deadline or not self._step():
                break
        self.checker.check_convergence(self.topology, origins, logs, self.keys)

    def _step(self) -> bool:
        if not self._heap:
            return False
        if self._events >= self.config.max_events:
            raise self._failure(f"the run did not finish within {self.config.max_events} events")
        due, _seq, kind, args = heapq.heappop(self._heap)
        self.now_ms = due
        self._events += 1
        label = f"{due - START_MS} {kind} {' '.join(self._arg_text(a) for a in args)}"
        self._trace.update(label.encode())
        if self.verbose:
            self._print(label)
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        getattr(self, "_on_" + kind)(*args)
        for sid, site in self.sites.items():
            self.checker.check_site(sid, site.logs)
            if self.consumers:
                self._fold_commits(site)
        return True

    @staticmethod
    def _arg_text(arg: object) -> str:
        if isinstance(arg, OpenStream | ChunkMessage):
            return arg.describe()
        if isinstance(arg, tuple):
            return "/".join(str(x) for x in arg)
        return str(arg)

    def _after(self, delay_ms: int, kind: str, *args: object) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (self.now_ms + max(0, delay_ms), self._seq, kind, args))

    def _interval(self, mean_ms: int) -> int:
        return self.rng.randint(mean_ms // 2, mean_ms * 3 // 2)

    def _log(self, line: str) -> None:
        if self.verbose:
            self._print(f"{self.now_ms - START_MS} {line}")

    def _local_ms(self, site: SimSite) -> int:
        return self.now_ms + site.skew_ms

    def _new_link_manager(self, sid: SiteId) -> LinkManager:
        manager = LinkManager(self.topology, sid, stall_ms=self.config.stall_ms)
        for topic, partitions in self.topics.items():
            manager.topic(topic, partitions)
        return manager

    def _alive(self, sid: SiteId, incarnation: int) -> SimSite | None:
        site = self.sites[sid]
        return site if site.up and site.incarnation == incarnation else None

    # -- workload ---------------------------------------------------------------

    def _on_produce(self, sid: SiteId, incarnation: int, key: PartitionKey) -> None:
        site = self._alive(sid, incarnation)
        if site is None or self.phase != "safety":
            return
        ts = self._local_ms(site)
        records = [
            RecordInput(f"k{self.rng.randrange(100)}".encode(), self.rng.randbytes(self.rng.randint(0, 40)), (), ts)
            for _ in range(self.rng.randint(*self.config.records_per_batch))
        ]
        self._append_as_origin(site, key, records)
        self.counts.produced_batches += 1
        self._after(self.rng.randint(*self.config.produce_ms), "produce", sid, incarnation, key)

    def _append_as_origin(self, site: SimSite, key: PartitionKey, records: list[RecordInput]) -> None:
        """Append one batch as the origin does: encode, stamp this site's origin and next seq, append."""
        log = site.logs[key]
        batch = encode_batch(records)
        head, _crc = stamp_origin(batch, site.origin, log.vector().get(site.origin, 0))
        header = parse_header(head)
        self.checker.register(key, header)
        log.append(header, [head[24:], batch[HEADER_BYTES:]], self._local_ms(site))
        site.links.local_vector(key, log.vector())

    def _on_flush(self, sid: SiteId, incarnation: int) -> None:
        site = self._alive(sid, incarnation)
        if site is None:
            return
        grew = False
        for key in self.keys:
            log = site.logs[key]
            if log.flushed_offset != log.log_end_offset:
                log.flush()
                grew = True
        if grew:  # newly durable batches: the sources may send them now
            for dst in sorted(site.out_streams):
                self._pump_soon(site, dst, 0)
        for c in self.consumers:  # every commit appended here is durable now: ack it
            for index, at in c.pending:
                if at == sid:
                    c.ack(index, sid)
                    self.counts.commits_acked += 1
            c.pending = [p for p in c.pending if p[1] != sid]
            site.durable_winners[c.index] = site.winners.get(c.index, -1)
        self._after(site.flush_ms, "flush", sid, incarnation)

    def _on_tick(self, sid: SiteId, incarnation: int) -> None:
        site = self._alive(sid, incarnation)
        if site is None:
            return
        site.links.tick(self.now_ms)
        self._refresh_wants(site)
        self._after(self.config.tick_ms, "tick", sid, incarnation)

    # -- network ------------------------------------------------------------------

    def _send(self, link: tuple[SiteId, SiteId], to: SiteId, message: Message) -> bool:
        """Put ``message`` on the wire of ``link`` towards ``to``; False when the connection is broken."""
        if link in self.cut or not self.sites[to].up:
            self.counts.cut_drops += 1
            return False
        faults = self.faults if self.phase == "safety" else Faults.none()
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
        if isinstance(message, OpenStream):
            self._on_open(message)
        else:
            self._on_chunks(message)

    # -- source side ----------------------------------------------------------------

    def _on_open(self, msg: OpenStream) -> None:
        site = self.sites[msg.src]
        if not site.up:
            self.counts.cut_drops += 1
            return
        source = ReplicaSource(site.logs, msg.wants)
        site.out_streams[msg.dst] = OutStream(msg.stream_id, source, self.now_ms)
        self._pump_soon(site, msg.dst, 0)
        self._after(self.config.heartbeat_ms, "heartbeat", msg.src, site.incarnation, msg.dst, msg.stream_id)

    def _out_stream(self, sid: SiteId, incarnation: int, dst: SiteId, stream_id: int) -> OutStream | None:
        site = self._alive(sid, incarnation)
        if site is None:
            return None
        out = site.out_streams.get(dst)
        return out if out is not None and out.stream_id == stream_id else None

    def _pump_soon(self, site: SimSite, dst: SiteId, delay_ms: int) -> None:
        out = site.out_streams[dst]
        if not out.pump_pending:
            out.pump_pending = True
            self._after(delay_ms, "pump", site.id, site.incarnation, dst, out.stream_id)

    def _on_pump(self, sid: SiteId, incarnation: int, dst: SiteId, stream_id: int) -> None:
        out = self._out_stream(sid, incarnation, dst, stream_id)
        if out is None:
            return
        out.pump_pending = False
        site = self.sites[sid]
        for chunk in out.source.next_chunks(self.config.chunk_bytes):
            self.counts.chunks += 1
            if not self._send((sid, dst), dst, ChunkMessage(sid, dst, stream_id, (chunk,), False)):
                del site.out_streams[dst]  # the connection broke: the stream ends at the source too
                return
            out.last_send_ms = self.now_ms
        if out.source.has_more():
            self._pump_soon(site, dst, self.config.pump_ms)

    def _on_heartbeat(self, sid: SiteId, incarnation: int, dst: SiteId, stream_id: int) -> None:
        out = self._out_stream(sid, incarnation, dst, stream_id)
        if out is None:
            return
        due = out.last_send_ms + self.config.heartbeat_ms
        if self.now_ms >= due:
            self.counts.heartbeats += 1
            message = ChunkMessage(sid, dst, stream_id, tuple(out.source.heartbeat()), True)
            if not self._send((sid, dst), dst, message):
                del self.sites[sid].out_streams[dst]
                return
            out.last_send_ms = self.now_ms
            due = self.now_ms + self.config.heartbeat_ms
        self._after(due - self.now_ms, "heartbeat", sid, incarnation, dst, stream_id)

    # -- destination side -------------------------------------------------------------

    def _reopen(self, site: SimSite, src: SiteId) -> None:
        """Open (again) the stream pulling from ``src``, with this site's current wants and vectors."""
        self._next_stream_id += 1
        stream_id = self._next_stream_id
        origins = site.wants(src)
        wants: dict[PartitionKey, tuple[dict[Origin, int], tuple[str, ...]]] = {
            key: (pull_have(site.logs[key].vector(), site.origin), tuple(str(o) for o in sites))
            for key, sites in origins.items()
        }
        site.in_streams[src] = InStream(stream_id, origins, self.now_ms)
        self._send((src, site.id), src, OpenStream(src, site.id, stream_id, wants))
        self._after(self.config.timeout_ms, "watchdog", site.id, site.incarnation, src, stream_id)

    def _on_watchdog(self, sid: SiteId, incarnation: int, src: SiteId, stream_id: int) -> None:
        site = self._alive(sid, incarnation)
        if site is None:
            return
        stream = site.in_streams.get(src)
        if stream is None or stream.stream_id != stream_id:
            return
        due = stream.last_message_ms + self.config.timeout_ms
        if self.now_ms < due:
            self._after(due - self.now_ms, "watchdog", sid, incarnation, src, stream_id)
            return
        self.counts.timeouts += 1
        site.links.link_down(src, self.now_ms, f"no message for {self.config.timeout_ms} ms")
        self._reopen(site, src)
        self._refresh_wants(site)

    def _refresh_wants(self, site: SimSite) -> None:
        """Reopen every inbound stream whose wants changed (a link went up or down, a stall began or ended)."""
        for src in site.inbound:
            stream = site.in_streams.get(src)
            if stream is not None and site.wants(src) != stream.wants:
                self.counts.wants_reopens += 1
                self._reopen(site, src)

    def _on_chunks(self, msg: ChunkMessage) -> None:
        site = self.sites[msg.dst]
        if not site.up:
            self.counts.cut_drops += 1
            return
        stream = site.in_streams.get(msg.src)
        if stream is None or stream.stream_id != msg.stream_id:
            return  # a message of a stream dst has given up on
        stream.last_message_ms = self.now_ms
        links = site.links
        first = not stream.delivered
        stream.delivered = True
        if first:
            links.link_up(msg.src, self.now_ms)
        gap = False
        for chunk in msg.chunks:
            links.upstream_vector(msg.src, chunk.key, chunk.src_vector)
            if not chunk.batches:
                continue
            log = site.logs[chunk.key]
            outcome = apply_chunk(log, chunk.batches, self._local_ms(site))
            self.counts.applied_batches += outcome.appended_batches
            links.local_vector(chunk.key, log.vector())
            if outcome.overlaps:
                raise InvariantViolation(
                    f"I1 bytes: {msg.src} sent {msg.dst} batches that straddle its vector: "
                    + "; ".join(o.message() for o in outcome.overlaps)
                )
            if outcome.gap is not None:
                gap = True
                self._log(f"gap at {msg.dst} from {msg.src}: {outcome.gap.message()}")
        lost = self._check_tail(site, stream, msg)
        if gap or lost:
            self.counts.gap_reopens += 1
            self._reopen(site, msg.src)
        if first or gap or lost:
            self._refresh_wants(site)

    def _check_tail(self, site: SimSite, stream: InStream, msg: ChunkMessage) -> bool:
        """Whether the stream lost its last data: a gap shows only when a later batch arrives.

        A source sends a heartbeat only after ``heartbeat_ms`` with nothing to send, and its vector counts
        unflushed batches too. So one heartbeat showing more than dst holds proves nothing, but two in a
        row, with no data between them, while dst is still short of what the first one showed, mean that
        the batches were sent and lost.
        """
        if not msg.heartbeat:
            stream.promised = None
            return False
        if stream.promised is not None:
            for key in sorted(stream.promised):
                held = site.logs[key].vector()
                if any(held.get(o, 0) < seq for o, seq in stream.promised[key].items()):
                    self._log(f"tail lost at {msg.dst} from {msg.src} in {key}")
                    return True
        promised: dict[PartitionKey, dict[Origin, int]] = {}
        for chunk in msg.chunks:
            wanted = stream.wants.get(chunk.key, ())
            held = site.logs[chunk.key].vector()
            ahead = {o: n for o, n in chunk.src_vector.items() if o.site in wanted and n > held.get(o, 0)}
            if ahead:
                promised[chunk.key] = ahead
        stream.promised = promised or None
        return False

    # -- consumers (I5) -------------------------------------------------------------------

    def _on_consume(self, ci: int) -> None:
        c = self.consumers[ci]
        self._after(self.rng.randint(*self.config.consume_ms), "consume", ci)
        site = self.sites[c.session.site]
        if not site.up or site.incarnation != c.session.incarnation:
            self._hop(c, forced=True)  # its site crashed: the connection broke
            return
        if c.exactly_once and c.pending:
            return  # the open transaction waits for its commit's ack
        if c.hop_wanted:
            self._hop(c, forced=False)
            return
        if not c.session.ready and not self._ready(c, site):
            return
        log = site.logs[c.key]
        limit = log.log_end_offset if self.config.consumer_reads_unflushed else log.flushed_offset
        session = c.session
        if session.position >= limit:
            return
        data = log.read(session.position, self.config.fetch_bytes).data  # type: ignore[arg-type]
        size = 0
        next_position = session.position
        for h in iter_headers(data):
            if h.next_offset > limit:
                break
            size += h.size_bytes
            next_position = int(h.next_offset)
        if not size:
            return
        records = decode_response(c.key[0], c.key[1], data[:size], session.position, session.start)
        for r in records:
            c.deliver(r.origin, int(r.origin_seq))
        session.position = next_position
        self.counts.deliveries += len(records)
        self._trace.update(f"deliver {ci} {len(records)} {next_position}".encode())
        if records and c.since_commit >= c.commit_every:
            self._commit(c, site)

    def _commit(self, c: SimConsumer, site: SimSite) -> None:
        """Commit the consumer's vector at its site: one record of the internal topic, this site as origin."""
        now = self._local_ms(site)
        commit = Commit(
            c.group, c.key[0], c.key[1], c.session.vector(), site.clock.now(now, after=c.last_stamp), site.origin,
            hint_offset=c.session.position, committed_at_ms=now,
        )  # fmt: skip
        key = (OFFSETS_TOPIC, offsets_partition(c.group))
        self._append_as_origin(site, key, [RecordInput(commit.key(), commit.value(), (), now)])
        c.add_commit(commit, site.id)
        self.counts.commits += 1

    def _on_hop(self, ci: int) -> None:
        if self.phase != "safety":
            return
        c = self.consumers[ci]
        self._after(self.rng.randint(*self.config.hop_ms), "hop", ci)
        if c.exactly_once and c.pending:
            c.hop_wanted = True  # once the open transaction is resolved
        else:
            self._hop(c, forced=False)

    def _hop(self, c: SimConsumer, forced: bool) -> None:
        """Move ``c`` to another live site: a client failover (in-memory vector) or a restart (committed vector).

        An exactly-once consumer always restarts, and only at a site its last acknowledged commit can reach.
        """
        c.hop_wanted = False
        here = c.session.site
        candidates = [s for s, site in sorted(self.sites.items()) if site.up]
        if c.exactly_once and c.acked >= 0:
            reach = expected_sites(self.topology, c.commits[c.acked].committed_by.site, OFFSETS_TOPIC)
            candidates = [s for s in candidates if s in reach]
        others = [s for s in candidates if s != here]
        if others:
            candidates = others
        elif not forced or not candidates:
            return
        target = self.rng.choice(candidates)
        how = "restart" if c.exactly_once or self.rng.random() < 0.5 else "failover"
        start = c.session.vector() if how == "failover" else VectorOffset()
        c.session = Session(target, self.sites[target].incarnation, start, how, -1)
        self.counts.consumer_hops += 1
        self.counts.consumer_hops_during_cuts += bool(self.cut)
        self.counts.consumer_hops_forced += forced
        self._log(f"{c.name} hops {here} -> {target} ({how})")
        site = self.sites[target]
        if how == "failover":
            c.session.position = int(start_offset_for_vector(site.logs[c.key], start.to_dict()))
        else:
            self._ready(c, site)

    def _ready(self, c: SimConsumer, site: SimSite) -> bool:
        """Start a restart session from the commit ``site``'s table holds; False while an exactly-once
        consumer waits for the site to receive its last acknowledged commit."""
        commit = site.commits.get(c.group, c.key[0], c.key[1])
        index = c.index_of(commit)
        if c.exactly_once and c.counting and index < c.acked:
            return False
        if c.exactly_once and c.counting and index != c.acked:
            raise InvariantViolation(
                f"{c.name}: site {site.id} returns commit #{index}, but the last one acknowledged is #{c.acked}"
            )
        session = c.session
        session.start = commit.vector if commit is not None else VectorOffset()
        session.resumed_from = index
        log = site.logs[c.key]
        if commit is not None and commit.committed_by == site.origin and 0 <= commit.hint_offset <= log.log_end_offset:
            session.position = commit.hint_offset  # committed here, in this epoch: resume where it was
        else:
            session.position = int(start_offset_for_vector(log, session.start.to_dict()))
        self.counts.consumer_restarts += 1
        return True

    def _fold_commits(self, site: SimSite) -> None:
        """Fold the commit records ``site`` received since the last fold; check no position went back."""
        grew = False
        for key in self.offsets_keys:
            log = site.logs[key]
            offset = site.folded.get(key[1], 0)
            grew = grew or offset < log.log_end_offset
            for _round in range(SCAN_ROUNDS_MAX):
                if offset >= log.log_end_offset:
                    break
                result = log.read(offset, READ_BYTES_MAX)  # type: ignore[arg-type]
                for commit in _commits_in(result.data):
                    self._fold(site, commit)
                offset = int(result.next_offset)
            site.folded[key[1]] = offset
        if not grew and len(site.winners) == len(self.consumers):
            return
        for c in self.consumers:
            index = c.index_of(site.commits.get(c.group, c.key[0], c.key[1]))
            before = site.winners.get(c.index, -1)
            if index < before:
                raise InvariantViolation(
                    f"I5 commit order: site {site.id} returned commit #{before} of {c.name} and now returns the "
                    f"older #{index}, with no crash in between"
                )
            site.winners[c.index] = index

    def _fold(self, site: SimSite, commit: Commit) -> None:
        current = site.commits.get(commit.group, commit.topic, commit.partition)
        if not site.commits.apply(commit) and current is not None and commit.order < current.order:
            self.counts.commits_out_of_order += 1  # an older commit arrived after a newer one
        site.clock.observe(commit.hlc)

    def _consumers_after_crash(self, site: SimSite, rebuild: bool) -> None:
        """``site`` crashed: its unflushed commits are lost, and its table is folded again from what it kept.

        The claim checked: for each consumer, the commit the site returns may move back, but never below
        the one it returned at its last flush (everything folded by then was flushed), which is at least
        the last commit acknowledged at this site. And no consumer may have delivered a record of this
        origin that the crash lost: the origin will stamp that coordinate again with another record,
        which the consumer's vector already covers.
        """
        for c in self.consumers:
            for _index, at in c.pending:
                if at == site.id:
                    c.lose()
                    self.counts.commits_lost += 1
            c.pending = [p for p in c.pending if p[1] != site.id]
            kept = site.logs[c.key].vector().get(site.origin, 0)
            delivered = c.highest.get(site.origin, -1)
            if not rebuild and delivered >= kept:
                raise InvariantViolation(
                    f"I5 lost record: {c.name} delivered {site.origin} seq {delivered}, but the crash of {site.id} "
                    f"kept only seqs below {kept}: the origin will stamp that seq again with another record"
                )
        site.commits = CommitTable()
        site.clock = HybridClock()
        site.folded = {}
        before = dict(site.winners)
        site.winners = {}
        self._fold_commits(site)
        for c in self.consumers:
            index = site.winners[c.index]
            floor = site.durable_winners.get(c.index, -1)
            acked_here = c.acked_at.get(site.id, -1)
            self._log(f"{c.name}: {site.id} returned commit #{before.get(c.index, -1)}, after the crash #{index}")
            if rebuild:  # a commit acknowledged at one site does not survive that site's disk (I6)
                site.durable_winners[c.index] = index
                c.acked_at.pop(site.id, None)
                c.counting = False  # its last acknowledged commit may be gone with the disk
            elif index < floor or index < acked_here:
                raise InvariantViolation(
                    f"I5 commit durability: after its crash, site {site.id} returns commit #{index} of {c.name}; "
                    f"at its last flush it returned #{floor}, and #{acked_here} was acknowledged there"
                )
            if c.session.site == site.id:
                self._after(self.rng.randint(0, 20), "hop", c.index)  # move right after the crash

    def _expected_winners(self) -> dict[SiteId, CommitTable]:
        """Per site, the fold of every commit held at any site whose links carrying the internal topic
        lead to it (so, once I4 holds, exactly the commits it must have)."""
        held: dict[SiteId, list[Commit]] = {}
        for sid, site in self.sites.items():
            held[sid] = []
            for key in self.offsets_keys:
                log = site.logs[key]
                offset = log.log_start_offset
                for _round in range(SCAN_ROUNDS_MAX):
                    if offset >= log.log_end_offset:
                        break
                    result = log.read(offset, READ_BYTES_MAX)
                    held[sid].extend(_commits_in(result.data))
                    offset = result.next_offset
        out: dict[SiteId, CommitTable] = {sid: CommitTable() for sid in self.sites}
        for src in sorted(held):
            for dst in sorted(expected_sites(self.topology, src, OFFSETS_TOPIC)):
                for commit in held[src]:
                    out[dst].apply(commit)
        return out

    def _consumer_problems(self, final: bool = False) -> list[str]:
        """What the consumers still miss after healing: caught up with their site, commits resolved;
        and, ``final``ly, every site's table equal to the fold of the commits that can reach it (check 3).
        (Tables are folded after every event, so once I4 holds they hold their final winners.)"""
        problems: list[str] = []
        for c in self.consumers:
            site = self.sites[c.session.site]
            if c.pending or not c.session.ready or not site.up:
                problems.append(f"{c.name} at {site.id}: commits pending or session not started")
                continue
            held = VectorOffset(site.logs[c.key].vector())
            if not held <= c.session.vector():
                problems.append(
                    f"{c.name} at {site.id} consumed {c.session.vector().to_text()}, the site holds {held.to_text()}"
                )
        if problems or not final:
            return problems
        expected = self._expected_winners()
        for sid, site in sorted(self.sites.items()):
            for c in self.consumers:
                want = expected[sid].get(c.group, c.key[0], c.key[1])
                got = site.commits.get(c.group, c.key[0], c.key[1])
                if want != got:
                    problems.append(
                        f"site {sid} returns commit #{c.index_of(got)} of {c.name}; the commits that reach it "
                        f"make #{c.index_of(want)} the winner"
                    )
        return problems

    def _check_consumers_done(self) -> None:
        problems = self._consumer_problems(final=True)
        if problems:
            shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
            raise InvariantViolation(f"I5 after healing: {shown}")
        for c in self.consumers:
            if c.exactly_once and c.counting and VectorOffset(c.counted) != c.session.vector():
                raise InvariantViolation(
                    f"I5 exactly once: {c.name} counted {VectorOffset(c.counted).to_text()} but consumed "
                    f"{c.session.vector().to_text()}"
                )

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
        if rebuild:
            self.counts.rebuilds += 1
            site.origin = Origin(site.id, site.origin.epoch + self.rng.randint(1, 1_000))
            self.origins.append(site.origin)
        what = f"batches, rebuilt empty as {site.origin}" if rebuild else "unflushed batches"
        self._log(f"crash {site.id}: lost {lost} {what}")
        site.up = False
        site.incarnation += 1
        site.in_streams.clear()
        site.out_streams.clear()
        for other in self.sites.values():
            other.out_streams.pop(site.id, None)  # the connections to the crashed site break
        site.links = self._new_link_manager(site.id)
        site.wants_memo.clear()
        if rebuild:  # the old epoch is never stamped again, so no coordinate is re-issued
            self.checker.rescan(site.id, site.logs)
        else:
            self.checker.on_crash(site.id, site.origin, {str(s): x.logs for s, x in self.sites.items()})
        if self.consumers:
            self._consumers_after_crash(site, rebuild)

    def _on_restart(self, sid: SiteId, incarnation: int) -> None:
        site = self.sites[sid]
        if site.up or site.incarnation != incarnation:
            return
        self._restart(sid, incarnation)

    def _restart(self, sid: SiteId, incarnation: int) -> None:
        site = self.sites[sid]
        site.up = True
        self.counts.restarts += 1
        self._log(f"restart {sid}")
        for key in self.keys:
            site.links.local_vector(key, site.logs[key].vector())
        self._start_site(site)
        if self.phase == "safety":
            for key in self.data_keys:
                self._after(self.rng.randint(0, self.config.produce_ms[1]), "produce", sid, site.incarnation, key)


def _commits_in(data: bytes) -> Iterator[Commit]:
    """The commits in the records of the internal topic's batches ``data``."""
    pos = 0
    for h in iter_headers(data):
        for r in decode_records(data[pos : pos + h.size_bytes], h):
            yield Commit.decode(r.value or b"")
        pos += h.size_bytes


def run_seed(
    seed: int,
    topology: str = "triangle",
    *,
    steps: int = DEFAULT_STEPS,
    faults: Faults | None = None,
    rebuild_p: float = 0.0,
    consumers: bool = True,
    verbose: bool = False,
) -> SimResult:
    """One run, as ``python -m georep.sim --seed SEED --topology NAME --steps STEPS`` does it.

    ``rebuild_p`` > 0 turns some crashes into disk losses (see ``Faults.rebuild_p``). ``consumers=False``
    (``--no-consumers``) runs replication alone, exactly as before consumers were simulated.
    """
    config = SimConfig(steps=steps) if consumers else SimConfig(steps=steps, consumers=(0, 0))
    sim = Simulator(seed, topology, faults=faults, config=config, verbose=verbose)
    if rebuild_p:
        sim.faults = dataclasses.replace(sim.faults, rebuild_p=rebuild_p)
    return sim.run()
