"""Committed positions at one site: new commits in, the fold of every commit record out. Sans I/O.

A commit is a record of the internal topic ``__georep_offsets``
(``offsets/commits.py`` holds its format and the latest-wins table). A site
appends its own commits as their origin, like any produced batch, and receives
the other sites' commits by replication. :class:`CommitLog` is what a site
keeps of them:

* **The fold.** :meth:`CommitLog.catch_up` reads every internal partition
  from where it stopped last time to the log end (``PartitionLog`` port) and
  folds each commit record into the :class:`~offsets.commits.CommitTable`,
  whatever its origin, and the site's hybrid logical clock observes its stamp.
  A read that finds the cursor behind the log start (retention) goes on from
  the log start. The node runs it before every read of the table and before
  every commit; the simulator after every event.
* **New commits.** :meth:`CommitLog.stamp` gives the next stamp, after both
  everything this site issued or folded and the consumer's previous stamp
  (``after_hlc``), so a consumer's commits are ordered at every site whatever
  the clocks. :func:`commit_batch` encodes a call's commits as one batch.
  Stamps more than :data:`AFTER_HLC_AHEAD_MS_MAX` ahead of this site's clock are
  refused: taking one in would push the clock forward by as much.

The table is derived state: a node that restarts, and a simulated site that
crashes, build a fresh ``CommitLog`` and fold what their logs kept.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from georep.record.batch import CorruptBatch, RecordInput, check_batch, decode_records, encode_batch
from georep.storage.api import BatchDamaged, OffsetOutOfRange, PartitionLog
from offsets.commits import METADATA_MAX_CHARS, OFFSETS_TOPIC, Commit, CommitTable, InvalidCommit, validate_group
from offsets.coordinates import LocalOffset, Origin
from offsets.hlc import HlcStamp, HybridClock, unpack
from offsets.vector import VectorOffset
from topology.filters import is_internal

AFTER_HLC_AHEAD_MS_MAX = 3600 * 1000
READ_BYTES = 1 << 20
READS_MAX = 1 << 20  # per partition and catch-up: a bound, never reached by a log that ends


@dataclass(frozen=True, slots=True)
class Folded:
    """One commit record folded in: whether it won, and the winner it met."""

    commit: Commit
    won: bool
    before: Commit | None


@dataclass(slots=True)
class FoldReport:
    folded: list[Folded] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # records or batches that could not be read


@dataclass(frozen=True, slots=True)
class CommitEntry:
    """One partition's part of a commit request."""

    topic: str
    partition: int
    vector: VectorOffset
    hint_offset: int = -1
    metadata: str = ""
    deleted: bool = False  # a tombstone (offsets/commits.py): the position is deleted


def check_commit_request(group: str, entries: Sequence[CommitEntry]) -> str:
    """Raise ``InvalidCommit`` for a request no correct consumer sends; returns the validated group."""
    group = validate_group(group)
    if not entries:
        raise InvalidCommit("a commit needs at least one partition")
    seen: set[tuple[str, int]] = set()
    for c in entries:
        if is_internal(c.topic):
            raise InvalidCommit(f"cannot commit offsets of internal topic {c.topic!r}")
        if (c.topic, c.partition) in seen:
            raise InvalidCommit(f"{c.topic}/{c.partition} appears twice in one commit: list it once")
        seen.add((c.topic, c.partition))
        if len(c.metadata) > METADATA_MAX_CHARS:
            raise InvalidCommit(f"commit metadata is {len(c.metadata)} characters; the limit is {METADATA_MAX_CHARS}")
    return group


def commit_batch(commits: Iterable[Commit], now_ms: int) -> bytes:
    """One call's commits as one batch of the internal topic (they share a partition: one per group)."""
    return encode_batch([RecordInput(c.key(), c.value(), (), now_ms) for c in commits])


class CommitLog:
    """A site's commit table, its clock, and how far it has folded each internal partition.

    ``decode`` turns a commit record's value into a :class:`Commit` (``Commit.decode``). The simulator runs
    every site in one process and passes one that remembers what it decoded, so that a record is decoded
    once, not once at every site it reaches and again after every crash.
    """

    def __init__(self, decode: Callable[[bytes], Commit] = Commit.decode) -> None:
        self.table = CommitTable()
        self.clock = HybridClock()
        self.cursors: dict[int, int] = {}
        self.decode = decode

    def catch_up(self, logs: Mapping[int, PartitionLog]) -> FoldReport:
        """Fold every commit record in ``logs`` (internal partition -> log) not folded yet."""
        report = FoldReport()
        for index in sorted(logs):
            log = logs[index]
            at = max(self.cursors.get(index, 0), log.log_start_offset)
            for _read in range(READS_MAX):
                end = log.log_end_offset
                if at >= end:
                    break
                try:
                    res = log.read(LocalOffset(at), READ_BYTES)
                except OffsetOutOfRange:
                    at = log.log_start_offset
                    continue
                except BatchDamaged as exc:
                    # Stop here until a peer's copy repairs it: folding past it would lose its commits for
                    # good (this site's own new commits still go into the table as they are made).
                    report.problems.append(f"{OFFSETS_TOPIC}-{index}: {exc}; folding waits for the repair")
                    break
                self._fold(res.data, index, report)
                if res.next_offset <= at:
                    break
                at = self.cursors[index] = res.next_offset
            self.cursors[index] = at
        return report

    def reset(self, index: int, partition_of: Callable[[str], int]) -> None:
        """Forget what was folded of internal partition ``index`` (its groups' commits and its cursor), so the
        next :meth:`catch_up` folds it again from its start. A read of ``index`` may raise out of ``catch_up``
        (a multi-node site's segment held by other nodes): the cursor is kept per read, so it goes on from there.
        The clock keeps its stamps: a clock never goes back."""
        self.cursors.pop(index, None)
        for key in [k for k in self.table.latest if partition_of(k[0]) == index]:
            del self.table.latest[key]

    def _fold(self, data: bytes, index: int, report: FoldReport) -> None:
        view = memoryview(data)
        pos = 0
        while pos < len(data):
            try:
                header = check_batch(view, pos)
            except CorruptBatch as exc:
                report.problems.append(f"unreadable batch in {OFFSETS_TOPIC}-{index}: {exc}; commits in it are skipped")
                return
            for record in decode_records(view[pos : pos + header.size_bytes], header):
                if record.value is None:
                    continue
                try:
                    commit = self.decode(record.value)
                except InvalidCommit as exc:
                    report.problems.append(f"skipping a record of {OFFSETS_TOPIC}-{index} at {record.offset}: {exc}")
                    continue
                self.clock.observe(commit.hlc)
                before = self.table.get(commit.group, commit.topic, commit.partition)
                report.folded.append(Folded(commit, self.table.apply(commit), before))
            pos += header.size_bytes

    def stamp(self, now_ms: int, after_hlc: int, site: str) -> HlcStamp:
        """The stamp of a new commit at this site; refuses an ``after_hlc`` far ahead of ``now_ms``."""
        if after_hlc and unpack(after_hlc)[0] > now_ms + AFTER_HLC_AHEAD_MS_MAX:
            raise InvalidCommit(
                f"after_hlc {after_hlc} is more than {AFTER_HLC_AHEAD_MS_MAX // 60_000} minutes ahead of site "
                f"{site}'s clock: check the clocks of the sites this consumer used"
            )
        return self.clock.now(now_ms, after_hlc)

    def new_commits(
        self,
        group: str,
        entries: Sequence[CommitEntry],
        stamp: HlcStamp,
        origin: Origin,
        *,
        member_id: str = "",
        generation: int = -1,
        now_ms: int,
        incarnations: Mapping[str, int] | None = None,
    ) -> list[Commit]:
        """``incarnations``: the live incarnation of each topic committed (absent: 0)."""
        return [
            Commit(
                group=group,
                topic=c.topic,
                partition=c.partition,
                vector=c.vector,
                hlc=stamp,
                committed_by=origin,
                hint_offset=c.hint_offset if c.hint_offset >= 0 else -1,
                member_id=member_id,
                generation=generation,
                committed_at_ms=now_ms,
                metadata=c.metadata,
                incarnation=(incarnations or {}).get(c.topic, 0),
                deleted=c.deleted,
            )
            for c in entries
        ]

    def record(self, commits: Iterable[Commit]) -> None:
        """Commits this site just appended: the table holds them before the fold reaches them."""
        for c in commits:
            self.table.apply(c)


def lacks(local: Mapping[Origin, int], others: Iterable[Mapping[Origin, int]]) -> bool:
    """Whether any of ``others`` holds a record ``local`` lacks: a site that answers a commit read now could hand
    out an older commit than a peer already has (``FetchCommitted`` waits, then refuses with ``CommitsBehind``)."""
    return any(seq > local.get(origin, 0) for other in others for origin, seq in other.items())
