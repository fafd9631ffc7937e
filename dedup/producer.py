"""The idempotent producer's state table, per partition at the origin site (Kafka semantics).

A producer that wants exactly-once appends stamps each batch with
``producer_id`` (chosen by the client, -1 for a non-idempotent producer),
``producer_epoch`` and ``base_sequence``. Sequences count records per
(producer, partition) and wrap at 2**31, as in Kafka: after 2**31 - 1 comes 0.
A batch covers the sequences ``base_sequence .. last_sequence`` where
``last_sequence = base_sequence + last_offset_delta`` (callers may pass it
unwrapped; it is taken modulo 2**31).

For every producer the table keeps its current epoch and the last
``window_batches`` batches it appended, with the result each one got.
:meth:`ProducerStateTable.check` classifies an incoming batch without changing
anything; after the batch is appended the caller reports it with
:meth:`ProducerStateTable.record`. The caller must run check, append and record
for one partition one batch at a time, as Kafka does under the partition lock;
otherwise two copies of one batch could both be checked as new.

Rules, in order (Kafka's ``ProducerStateManager``):

1. ``producer_id == -1``: not idempotent, always append.
2. Unknown producer (never seen, or expired): append, whatever the sequence.
3. Epoch lower than the producer's current epoch: fenced (a newer instance of
   the producer took over).
4. Epoch higher: the new epoch must start at sequence 0.
5. Same epoch: a batch whose (base, last) equals one of the last
   ``window_batches`` appended batches is a duplicate and gets the original
   result back; otherwise its base must be the latest last sequence + 1.

State for producers idle longer than ``expiration_ms`` is dropped by
:meth:`ProducerStateTable.expire`, so memory stays bounded. After a restart the
table is rebuilt from the log's batch index with :meth:`ProducerStateTable.rebuild`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from offsets.coordinates import LocalOffset, Origin, OriginSeq

SEQUENCE_MODULUS = 2**31  # Kafka: sequences are non-negative int32 and wrap to 0
NO_PRODUCER_ID = -1
DEFAULT_WINDOW_BATCHES = 5
DEFAULT_EXPIRATION_MS = 7 * 24 * 3600 * 1000


def next_sequence(last_sequence: int) -> int:
    """The sequence that follows ``last_sequence``, wrapping at 2**31."""
    return (last_sequence + 1) % SEQUENCE_MODULUS


@dataclass(frozen=True, slots=True)
class AppendResult:
    """What the original append of a batch answered; a retry gets exactly this back."""

    base_offset: LocalOffset
    base_origin_seq: OriginSeq
    last_origin_seq: OriginSeq
    append_time_ms: int


@dataclass(frozen=True, slots=True)
class Append:
    """A new batch: append it, then :meth:`ProducerStateTable.record` it."""

    def message(self) -> str:
        return "new batch: append it"


@dataclass(frozen=True, slots=True)
class Duplicate:
    """A retry of a batch already appended: answer with ``result`` and store nothing."""

    result: AppendResult
    producer_id: int
    producer_epoch: int
    base_sequence: int
    last_sequence: int

    def message(self) -> str:
        return (
            f"producer {self.producer_id} epoch {self.producer_epoch} resent sequences "
            f"{self.base_sequence}..{self.last_sequence}, which were already appended at offset "
            f"{self.result.base_offset} (origin seqs {self.result.base_origin_seq}..{self.result.last_origin_seq}): "
            "answering with the original result; nothing was stored twice"
        )


@dataclass(frozen=True, slots=True)
class OutOfOrderSequence:
    """The batch does not continue the producer's sequence, and is not a recent retry."""

    expected: int
    got: int
    producer_id: int
    producer_epoch: int
    new_epoch: bool = False  # the batch opened a new epoch, which must start at 0

    def message(self) -> str:
        who = f"producer {self.producer_id} epoch {self.producer_epoch}"
        if self.new_epoch:
            return (
                f"{who} is a new epoch but its first batch has sequence {self.got}, expected 0: "
                "a producer that bumps its epoch must restart its sequence at 0"
            )
        if (self.got - self.expected) % SEQUENCE_MODULUS < SEQUENCE_MODULUS // 2:
            return (
                f"{who} sent sequence {self.got}, expected {self.expected}: a batch was lost in flight; "
                f"the producer must resend from {self.expected} or restart"
            )
        return (
            f"{who} sent sequence {self.got}, expected {self.expected}: the batch repeats sequences already "
            "appended, but is not one of the recent batches kept for deduplication (too old a retry, or it "
            "overlaps an appended batch); it was not stored again. The producer must not resend it; restart "
            "the producer to continue"
        )


@dataclass(frozen=True, slots=True)
class ProducerFenced:
    """A newer epoch of this producer id has appended: this instance is a zombie."""

    current_epoch: int
    got: int
    producer_id: int

    def message(self) -> str:
        return (
            f"producer {self.producer_id} sent epoch {self.got}, but epoch {self.current_epoch} has already "
            "written to this partition: another instance with the same producer id took over. Stop this "
            "instance; if it should own the id, restart it so it gets a new epoch"
        )


@dataclass(frozen=True, slots=True)
class InvalidSequence:
    """Producer fields that no correct client sends (negative sequence or epoch, bad producer id)."""

    reason: str
    producer_id: int
    producer_epoch: int
    base_sequence: int
    last_sequence: int

    def message(self) -> str:
        return (
            f"producer {self.producer_id} epoch {self.producer_epoch} sent sequences "
            f"{self.base_sequence}..{self.last_sequence}: {self.reason}; this is a client bug, the batch was not stored"
        )


Decision = Append | Duplicate | OutOfOrderSequence | ProducerFenced | InvalidSequence

_APPEND = Append()


class ProducerBatch(Protocol):
    """One appended batch as the log's batch index reports it (``georep.storage.api.BatchEntry`` fits)."""

    @property
    def origin(self) -> Origin: ...

    @property
    def producer_id(self) -> int: ...

    @property
    def producer_epoch(self) -> int: ...

    @property
    def base_sequence(self) -> int: ...

    @property
    def last_offset_delta(self) -> int: ...

    @property
    def base_offset(self) -> LocalOffset: ...

    @property
    def base_origin_seq(self) -> OriginSeq: ...

    @property
    def append_time_ms(self) -> int: ...


@dataclass(frozen=True, slots=True)
class _CachedBatch:
    base_sequence: int
    last_sequence: int
    result: AppendResult


class _ProducerState:
    __slots__ = ("batches", "epoch", "last_append_ms")

    def __init__(self, epoch: int, window_batches: int, now_ms: int) -> None:
        self.epoch = epoch
        self.batches: deque[_CachedBatch] = deque(maxlen=window_batches)
        self.last_append_ms = now_ms


class ProducerStateTable:
    """Per-partition idempotent producer state. Pure: time comes in as ``now_ms``."""

    def __init__(
        self, window_batches: int = DEFAULT_WINDOW_BATCHES, expiration_ms: int = DEFAULT_EXPIRATION_MS
    ) -> None:
        if window_batches < 1:
            raise ValueError(f"window_batches must be at least 1, got {window_batches}")
        if expiration_ms < 0:
            raise ValueError(f"expiration_ms must not be negative, got {expiration_ms}")
        self.window_batches = window_batches
        self.expiration_ms = expiration_ms
        self._producers: dict[int, _ProducerState] = {}

    # --- queries -----------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._producers)

    def __contains__(self, producer_id: object) -> bool:
        return producer_id in self._producers

    def current_epoch(self, producer_id: int) -> int | None:
        state = self._producers.get(producer_id)
        return None if state is None else state.epoch

    def last_sequence(self, producer_id: int) -> int | None:
        """The last sequence appended by the producer's current epoch, or None if unknown."""
        state = self._producers.get(producer_id)
        return None if state is None else state.batches[-1].last_sequence

    def check(
        self, producer_id: int, producer_epoch: int, base_sequence: int, last_sequence: int, now_ms: int
    ) -> Decision:
        """Classify a batch. Changes nothing; ``now_ms`` is accepted for symmetry and future rules."""
        del now_ms
        if producer_id == NO_PRODUCER_ID:
            return _APPEND
        invalid = _invalid_reason(producer_id, producer_epoch, base_sequence, last_sequence)
        if invalid is not None:
            return InvalidSequence(invalid, producer_id, producer_epoch, base_sequence, last_sequence)
        last_sequence %= SEQUENCE_MODULUS
        state = self._producers.get(producer_id)
        if state is None:
            return _APPEND
        if producer_epoch < state.epoch:
            return ProducerFenced(state.epoch, producer_epoch, producer_id)
        if producer_epoch > state.epoch:
            if base_sequence != 0:
                return OutOfOrderSequence(0, base_sequence, producer_id, producer_epoch, new_epoch=True)
            return _APPEND
        for cached in reversed(state.batches):  # newest first: after a log replay a range can repeat
            if cached.base_sequence == base_sequence and cached.last_sequence == last_sequence:
                return Duplicate(cached.result, producer_id, producer_epoch, base_sequence, last_sequence)
        expected = next_sequence(state.batches[-1].last_sequence)
        if base_sequence != expected:
            return OutOfOrderSequence(expected, base_sequence, producer_id, producer_epoch)
        return _APPEND

    # --- updates -----------------------------------------------------------------

    def record(
        self,
        producer_id: int,
        producer_epoch: int,
        base_sequence: int,
        last_sequence: int,
        result: AppendResult,
        now_ms: int,
    ) -> None:
        """Remember a batch that was appended (after :meth:`check` said :class:`Append`).

        The log is the truth: a different epoch replaces the producer's state,
        and a batch is cached even if it does not continue the previous one
        (which happens only when replaying a log after expiration).
        """
        if producer_id == NO_PRODUCER_ID:
            return
        invalid = _invalid_reason(producer_id, producer_epoch, base_sequence, last_sequence)
        if invalid is not None:
            raise ValueError(f"cannot record producer {producer_id} batch: {invalid}")
        state = self._producers.get(producer_id)
        if state is None or state.epoch != producer_epoch:
            state = _ProducerState(producer_epoch, self.window_batches, now_ms)
            self._producers[producer_id] = state
        state.batches.append(_CachedBatch(base_sequence, last_sequence % SEQUENCE_MODULUS, result))
        state.last_append_ms = max(state.last_append_ms, now_ms)

    def expire(self, now_ms: int) -> int:
        """Drop producers whose last append is more than ``expiration_ms`` before ``now_ms``; returns how many."""
        idle = [pid for pid, s in self._producers.items() if now_ms - s.last_append_ms > self.expiration_ms]
        for pid in idle:
            del self._producers[pid]
        return len(idle)

    def next_expiry_ms(self) -> int | None:
        """The first ``now_ms`` at which :meth:`expire` would drop a producer (None: the table is empty)."""
        if not self._producers:
            return None
        return min(s.last_append_ms for s in self._producers.values()) + self.expiration_ms + 1

    @classmethod
    def rebuild(
        cls,
        entries: Iterable[ProducerBatch],
        *,
        now_ms: int | None = None,
        origin: Origin | None = None,
        window_batches: int = DEFAULT_WINDOW_BATCHES,
        expiration_ms: int = DEFAULT_EXPIRATION_MS,
    ) -> ProducerStateTable:
        """The table after replaying ``entries`` (appended batches, in log order).

        ``origin``: replay only batches this origin accepted (the site's own
        producers), leaving out replicated batches. ``now_ms``: expire
        producers idle at that time once the replay is done.
        """
        table = cls(window_batches, expiration_ms)
        for entry in entries:
            if entry.producer_id == NO_PRODUCER_ID or (origin is not None and entry.origin != origin):
                continue
            result = AppendResult(
                entry.base_offset,
                entry.base_origin_seq,
                OriginSeq(entry.base_origin_seq + entry.last_offset_delta),
                entry.append_time_ms,
            )
            table.record(
                entry.producer_id,
                entry.producer_epoch,
                entry.base_sequence,
                entry.base_sequence + entry.last_offset_delta,
                result,
                entry.append_time_ms,
            )
        if now_ms is not None:
            table.expire(now_ms)
        return table


def _invalid_reason(producer_id: int, producer_epoch: int, base_sequence: int, last_sequence: int) -> str | None:
    if producer_id < 0:
        return f"producer id {producer_id} is invalid: use a non-negative id, or -1 for a non-idempotent producer"
    if producer_epoch < 0:
        return f"producer epoch {producer_epoch} is invalid for an idempotent producer: epochs start at 0"
    if not 0 <= base_sequence < SEQUENCE_MODULUS:
        return f"base sequence {base_sequence} is outside [0, {SEQUENCE_MODULUS - 1}]"
    if not 0 <= last_sequence < 2 * SEQUENCE_MODULUS:
        return f"last sequence {last_sequence} is not base sequence + last offset delta"
    if last_sequence - base_sequence >= SEQUENCE_MODULUS:
        return "the batch spans more than 2**31 sequences"
    return None
