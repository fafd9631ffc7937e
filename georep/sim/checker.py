"""Invariant checks I1-I4 (ARCHITECTURE.md) over the simulated sites' partition logs.

I1-I3 are checked after every event, incrementally: each site's log only
grows between crashes, so the checker keeps, per (site, partition), the local
offset it has checked up to and the next origin seq it expects of each
origin, and reads only the batches appended since. One rule covers three
invariants: in log order, each batch of an origin must start exactly at the
next seq of that origin. A batch that starts later leaves a hole (I1 prefix),
one that starts earlier repeats a coordinate (I2) or goes backwards (I3).

Byte identity (I1): every batch an origin stamps is registered here
(``register``) with its seq range and CRC-32C, and each site's copy must
carry the same range and CRC, and that CRC must match its bytes. The registry
is global, like the Spark audit's view of every site at once.

When a site crashes it loses its unflushed batches, including ones it stamped
as origin; it then re-issues those seqs with other records under the same
epoch. That is only safe because nobody was ever served an unflushed batch,
and :meth:`InvariantChecker.on_crash` checks exactly that before forgetting
the lost coordinates.

I4 (convergence) is :meth:`InvariantChecker.check_convergence`, run by the
simulator after its liveness phase.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from georep.record.batch import BatchHeader, CorruptBatch, iter_headers
from georep.storage.api import PartitionLog
from offsets.coordinates import Origin
from topology.ids import SiteId
from topology.model import Topology
from topology.reach import expected_sites

PartitionKey = tuple[str, int]
READ_BYTES_MAX = 1 << 24
SCAN_ROUNDS_MAX = 1 << 20


class InvariantViolation(AssertionError):
    """A site's data breaks one of I1-I4; the message names the invariant, site, partition and coordinate."""


@dataclass(slots=True)
class _Checked:
    offset: int = 0
    next_seq: dict[Origin, int] = field(default_factory=dict)


def _where(site: str, key: PartitionKey) -> str:
    return f"site {site} {key[0]}[{key[1]}]"


class InvariantChecker:
    def __init__(self) -> None:
        # (partition, origin, base seq) -> (last seq, crc) as the origin stamped it
        self.registry: dict[tuple[PartitionKey, Origin, int], tuple[int, int]] = {}
        self._checked: dict[tuple[str, PartitionKey], _Checked] = {}
        self.batches_checked = 0
        self._reach_of: Topology | None = None
        self._reach: dict[tuple[str, str], frozenset[SiteId]] = {}

    # -- registry -----------------------------------------------------------------

    def register(self, key: PartitionKey, header: BatchHeader) -> None:
        """The origin stamped ``header``'s batch: every copy anywhere must match it."""
        self.registry[(key, header.origin, header.base_origin_seq)] = (header.last_origin_seq, header.crc)

    # -- I1-I3, incremental --------------------------------------------------------

    def check_site(self, site: str, logs: Mapping[PartitionKey, PartitionLog]) -> None:
        for key in sorted(logs):
            log = logs[key]
            state = self._checked.get((site, key))
            if state is None:
                state = self._checked[(site, key)] = _Checked(int(log.log_start_offset))
            end = int(log.log_end_offset)
            if end == state.offset:
                continue
            if end < state.offset:  # truncated (a crash): start over
                state = self._checked[(site, key)] = _Checked(int(log.log_start_offset))
            self._scan(site, key, log, state)

    def rescan(self, site: str, logs: Mapping[PartitionKey, PartitionLog]) -> None:
        """Forget what was checked at ``site`` and check its logs from the start."""
        for key in sorted(logs):
            self._checked.pop((site, key), None)
        self.check_site(site, logs)

    def rescan_all(self, sites_logs: Mapping[str, Mapping[PartitionKey, PartitionLog]]) -> None:
        """Check every site from the start again (the final audit of a run)."""
        for site in sorted(sites_logs):
            self.rescan(site, sites_logs[site])

    def _scan(self, site: str, key: PartitionKey, log: PartitionLog, state: _Checked) -> None:
        end = int(log.log_end_offset)
        for _round in range(SCAN_ROUNDS_MAX):
            if state.offset >= end:
                return
            result = log.read(state.offset, READ_BYTES_MAX)  # type: ignore[arg-type]
            try:
                headers = iter_headers(result.data, verify=True)
            except CorruptBatch as e:
                raise InvariantViolation(
                    f"I1 bytes: {_where(site, key)} holds a corrupt batch at or after offset {state.offset}: {e}"
                ) from None
            if not headers:
                raise InvariantViolation(f"{_where(site, key)}: read at offset {state.offset} returned no batch")
            for h in headers:
                self._check_batch(site, key, h, state)
                state.offset = int(h.next_offset)
        raise InvariantViolation(f"{_where(site, key)}: the log did not end after {SCAN_ROUNDS_MAX} reads")

    def _check_batch(self, site: str, key: PartitionKey, h: BatchHeader, state: _Checked) -> None:
        self.batches_checked += 1
        origin = h.origin
        base, last = int(h.base_origin_seq), int(h.last_origin_seq)
        expected = state.next_seq.get(origin, 0)
        registered = self.registry.get((key, origin, base))
        if base == expected and registered == (last, h.crc):
            state.next_seq[origin] = last + 1
            return
        where = f"{_where(site, key)} at local offset {h.base_offset}"  # only for the message: most batches pass
        if base > expected:
            raise InvariantViolation(
                f"I1 prefix: {where}: {origin} seqs {base}..{last} follow seq {expected - 1}; "
                f"seqs {expected}..{base - 1} are missing"
            )
        if base < expected:
            raise InvariantViolation(
                f"I2 duplicate / I3 order: {where}: {origin} seqs {base}..{last} appear after seqs up to "
                f"{expected - 1} (a coordinate held twice, or out of origin order)"
            )
        if registered is None:
            raise InvariantViolation(
                f"I1 bytes: {where}: {origin} seqs {base}..{last} were never stamped by the origin as one batch"
            )
        raise InvariantViolation(
            f"I1 bytes: {where}: {origin} seq {base} has seqs {base}..{last} crc {h.crc:#010x}, the origin "
            f"stamped seqs {base}..{registered[0]} crc {registered[1]:#010x}"
        )

    # -- crashes ------------------------------------------------------------------

    def on_crash(
        self, site: str, origin: Origin, sites_logs: Mapping[str, Mapping[PartitionKey, PartitionLog]]
    ) -> None:
        """``site`` (origin ``origin``) crashed: its logs are already truncated to what it had flushed.

        The origin seqs it lost will be stamped again with other records. Check that no other site holds
        any of them (that would mean a source served unflushed batches), then forget them.
        """
        logs = sites_logs[site]
        for key in sorted(logs):
            kept = int(logs[key].vector().get(origin, 0))
            for other in sorted(sites_logs):
                if other == site or key not in sites_logs[other]:
                    continue
                held = int(sites_logs[other][key].vector().get(origin, 0))
                if held > kept:
                    raise InvariantViolation(
                        f"I1 prefix: {site} crashed and kept {origin} seqs below {kept} in {key[0]}[{key[1]}], "
                        f"but site {other} holds up to seq {held - 1}: a source served a batch its log had "
                        "not flushed, and the origin will stamp those seqs again with other records"
                    )
            lost = [k for k in self.registry if k[0] == key and k[1] == origin and k[2] >= kept]
            for k in lost:
                del self.registry[k]
        self.rescan(site, logs)

    # -- I4 -------------------------------------------------------------------------

    def convergence_problems(
        self,
        topology: Topology,
        origins: Iterable[Origin],
        sites_logs: Mapping[str, Mapping[PartitionKey, PartitionLog]],
        keys: Iterable[PartitionKey],
    ) -> list[str]:
        """What I4 still misses, one message per (partition, origin, site), in a stable order.

        A record held by a site T should reach every site of ``expected_sites(topology, T, topic)``: so
        each site S must hold, of each origin, as much as the most that any site reaching S holds. For an
        origin's current epoch that is everything the origin holds, at every site its records can reach.
        (Stated from the holders rather than from the origin, so that records of an epoch whose site was
        since rebuilt from empty count too: they live on only where they were copied.) And no site holds
        records of a topic from an origin site whose links carrying that topic do not lead to it.
        """
        return list(self.iter_convergence_problems(topology, origins, sites_logs, keys))

    def iter_convergence_problems(
        self,
        topology: Topology,
        origins: Iterable[Origin],
        sites_logs: Mapping[str, Mapping[PartitionKey, PartitionLog]],
        keys: Iterable[PartitionKey],
    ) -> Iterator[str]:
        """:meth:`convergence_problems` one by one: the liveness phase asks every 50 ms whether there is one."""
        sites = sorted(sites_logs)
        for key in sorted(keys):
            topic = key[0]
            reach = {site: self._expected_sites(topology, site, topic) for site in sites}
            vectors = {site: sites_logs[site][key].vector() for site in sites}
            for origin in sorted(set(origins)):
                held = {site: int(vectors[site].get(origin, 0)) for site in sites}
                for site in sites:
                    if held[site] and SiteId(site) not in reach[origin.site]:
                        yield (
                            f"site {site} holds {held[site]} of {origin}'s records of {topic}[{key[1]}], but no "
                            f"chain of links carrying {topic} leads there from {origin.site}"
                        )
                        continue
                    best, holder = held[site], site
                    for other in sites:
                        if held[other] > best and SiteId(site) in reach[other]:
                            best, holder = held[other], other
                    if held[site] < best:
                        yield (
                            f"site {site} holds {held[site]} of {origin}'s records of {topic}[{key[1]}], expected "
                            f"{best}: site {holder} holds {best} and links carrying {topic} lead from it to {site}"
                        )

    def _expected_sites(self, topology: Topology, site: str, topic: str) -> frozenset[SiteId]:
        """``expected_sites``, remembered for the topology of the last call (a run's never changes)."""
        if topology is not self._reach_of:
            self._reach_of = topology
            self._reach.clear()
        found = self._reach.get((site, topic))
        if found is None:
            found = self._reach[(site, topic)] = expected_sites(topology, site, topic)
        return found

    def check_convergence(
        self,
        topology: Topology,
        origins: Iterable[Origin],
        sites_logs: Mapping[str, Mapping[PartitionKey, PartitionLog]],
        keys: Iterable[PartitionKey],
    ) -> None:
        problems = self.convergence_problems(topology, origins, sites_logs, keys)
        if problems:
            shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
            raise InvariantViolation(f"I4 convergence: {shown}")
