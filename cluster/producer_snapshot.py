"""What a multi-node site's idempotent producers had appended, carried from one partition leader to the next. Pure.

A one-node site rebuilds its producer table (``dedup/producer.py``) from its
log's batch index at start. A partition of a multi-node site is a chain of
segments, each on its own ensemble, and a node that becomes leader may hold
no copy of the segments a producer last wrote to: its own copies would give it
an older sequence (every next batch of that producer refused with
``OutOfOrderSequence``) or none (a retry of a batch stored in a segment it does
not hold appended a second time). So each seal carries the table, as Kafka
keeps a producer-state snapshot per log segment, but in the site's metadata,
where every later leader reads it:

* :func:`fold` is the table at a seal: the previous seal's snapshot
  (:func:`history_at_open`), then the site's own batches of the segment below its sealed end, in log order, reduced
  to what :meth:`~dedup.producer.ProducerStateTable.rebuild` keeps (each
  producer's current epoch and its last ``window`` batches), without the
  producers idle for ``expiration_ms`` at the seal, and bounded
  (:data:`SNAPSHOT_ENTRIES_MAX`) so the seal stays one metadata command.
* :func:`history_at_open` is what a leader rebuilds its table from when it
  starts writing a segment: the snapshot the chain's last seal carries. A chain
  whose last seal carries none (sealed by a node from before snapshots) falls
  back to the copies the node holds, as before.

**Why a new leader knows every producer's last sequences before it accepts a
write.** Let ``T(x)`` be the table :meth:`ProducerStateTable.rebuild` makes of
the chain's batches below offset ``x``. Claim: the snapshot ``S_k`` carried by
the seal of segment ``k`` at end ``e_k`` rebuilds to ``T(e_k)`` (up to the
bound and expiration, below). By induction on ``k``: ``S_-1`` is empty, and
``T(0)`` is empty. The seal of ``k`` is proposed by a node that holds segment
``k`` from its base to ``e_k`` (a rolling leader wrote it; a recovering leader
holds the recovered end before it may propose the seal: ``cluster/recovery.py``,
rule (S)) and whose view shows ``k`` open, so its view's partition snapshot is
``S_(k-1)`` (Raft orders the seal of ``k - 1`` before the open of ``k``, and a
partition's snapshot changes only at a seal). :func:`fold` replays ``S_(k-1)``
then the batches ``[base_k, e_k)`` in log order, and a replay keeps, per
producer, only its last epoch and the last ``window`` batches of it: so what it
keeps of ``S_(k-1)`` followed by ``[base_k, e_k)`` is what it keeps of the whole
chain below ``e_k``, that is ``T(e_k)``. A seal commits at most once per
segment and never changes (``SiteState``), so ``S_k`` is final. A leader that
opens segment ``k + 1`` at ``e_k`` does so from a view holding the seal of
``k``, and rebuilds its table from ``S_k`` before its first append: it has
``T(e_k)``, exactly the table of the leader that wrote ``[base_k, e_k)``, cut at
the seal. Batches past a seal were never acknowledged (they are cut), so a
producer resends them, and the new leader takes them as new (their sequences
follow ``T(e_k)``'s) or, if the producer resends a batch below ``e_k``, answers
it as the ``Duplicate`` it is.

What the claim leaves out, on purpose: a producer's ``last_append_ms`` becomes
the newest append time among its kept batches (it only decides expiration);
producers idle for ``expiration_ms`` at the seal are dropped, as a running
leader's table drops them; and past :data:`SNAPSHOT_ENTRIES_MAX` entries the
least recently active producers' older batches go first, then the least
recently active producers themselves (``left_out`` counts them): such a
producer's next batch is taken whatever its sequence, as Kafka takes a producer
whose state expired.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dedup.producer import DEFAULT_EXPIRATION_MS, DEFAULT_WINDOW_BATCHES, NO_PRODUCER_ID, ProducerBatch
from offsets.coordinates import LocalOffset, Origin, OriginSeq

SNAPSHOT_FORMAT = 1
# The most batch entries a seal carries: each encodes as 7 integers, so a seal stays far below the largest
# metadata command (georep/raft/frames.py COMMAND_BYTES_MAX; tests/test_producer_snapshot.py checks the worst case).
SNAPSHOT_ENTRIES_MAX = 2000


class InvalidSnapshot(ValueError):
    """A producer snapshot that cannot be decoded; the message says which field."""


@dataclass(frozen=True, slots=True)
class ProducerEntry:
    """One batch an idempotent producer appended, as the producer table keeps it (a ``ProducerBatch``)."""

    origin: Origin
    producer_id: int
    producer_epoch: int
    base_sequence: int
    last_offset_delta: int
    base_offset: LocalOffset
    base_origin_seq: OriginSeq
    append_time_ms: int

    def encode(self) -> list[int]:
        return [
            self.producer_id,
            self.producer_epoch,
            self.base_sequence,
            self.last_offset_delta,
            int(self.base_offset),
            int(self.base_origin_seq),
            self.append_time_ms,
        ]


@dataclass(frozen=True, slots=True)
class ProducerSnapshot:
    """The producer table of a partition's chain at a seal: each producer's last batches, in log order."""

    origin: Origin
    entries: tuple[ProducerEntry, ...] = ()
    left_out: int = field(default=0, compare=False)  # producers the bound left out of this fold (not encoded)

    def encode(self) -> dict[str, Any]:
        return {"v": SNAPSHOT_FORMAT, "origin": str(self.origin), "entries": [e.encode() for e in self.entries]}

    @classmethod
    def decode(cls, raw: Mapping[str, Any]) -> ProducerSnapshot:
        """:meth:`encode`'s form back; raises :class:`InvalidSnapshot`."""
        if raw.get("v") != SNAPSHOT_FORMAT:
            raise InvalidSnapshot(
                f"producer snapshot format {raw.get('v')!r} is not {SNAPSHOT_FORMAT}: run the same "
                "georep version on every node of the site"
            )
        text = raw.get("origin")
        rows = raw.get("entries")
        if not isinstance(text, str) or not isinstance(rows, list):
            raise InvalidSnapshot("a producer snapshot needs an origin (text) and entries (a list)")
        origin = Origin.parse(text)
        entries = []
        for row in rows:
            if not isinstance(row, list) or len(row) != 7 or not all(type(v) is int for v in row):
                raise InvalidSnapshot(f"producer snapshot entry {row!r} is not 7 integers")
            pid, epoch, base_seq, delta, base_offset, base_origin_seq, append_ms = row
            entries.append(
                ProducerEntry(
                    origin, pid, epoch, base_seq, delta, LocalOffset(base_offset), OriginSeq(base_origin_seq), append_ms
                )
            )
        return cls(origin, tuple(entries))


def fold(
    history: Iterable[ProducerBatch],
    origin: Origin,
    batches: Iterable[ProducerBatch],
    *,
    now_ms: int,
    window: int = DEFAULT_WINDOW_BATCHES,
    expiration_ms: int = DEFAULT_EXPIRATION_MS,
    max_entries: int = SNAPSHOT_ENTRIES_MAX,
) -> ProducerSnapshot:
    """The snapshot at a seal: ``history`` (the chain's at the segment's base: :func:`history_at_open` of the
    proposer's view), then ``batches`` (the segment's, below its sealed end, in log order); only ``origin``'s own
    batches count. See the module docstring."""
    kept: dict[int, tuple[int, deque[ProducerEntry]]] = {}  # producer id -> (epoch, its last batches)

    def take(entry: ProducerEntry) -> None:
        state = kept.get(entry.producer_id)
        if state is None or state[0] != entry.producer_epoch:
            state = kept[entry.producer_id] = (entry.producer_epoch, deque(maxlen=window))
        state[1].append(entry)

    for b in itertools.chain(history, batches):
        if b.producer_id != NO_PRODUCER_ID and b.origin == origin:
            take(
                ProducerEntry(
                    origin,
                    b.producer_id,
                    b.producer_epoch,
                    b.base_sequence,
                    b.last_offset_delta,
                    b.base_offset,
                    b.base_origin_seq,
                    b.append_time_ms,
                )
            )
    live = [
        list(state[1]) for state in kept.values() if now_ms - max(e.append_time_ms for e in state[1]) <= expiration_ms
    ]
    entries, left_out = _bounded(live, max_entries)
    return ProducerSnapshot(origin, tuple(sorted(entries, key=lambda e: (e.base_offset, e.producer_id))), left_out)


def _bounded(producers: list[list[ProducerEntry]], max_entries: int) -> tuple[list[ProducerEntry], int]:
    """At most ``max_entries`` of the producers' entries: every producer's newest first (the most recently active
    producers first), then their older ones, newest first. Returns them and how many producers were left out."""
    total = sum(len(p) for p in producers)
    if total <= max_entries:
        return [e for p in producers for e in p], 0
    recent = sorted(producers, key=lambda p: (p[-1].base_offset, p[-1].producer_id), reverse=True)
    chosen = [p[-1] for p in recent[:max_entries]]
    older = sorted((e for p in recent[:max_entries] for e in p[:-1]), key=lambda e: e.base_offset, reverse=True)
    chosen += older[: max_entries - len(chosen)]
    return chosen, max(0, len(producers) - max_entries)


def history_at_open(
    sealed: ProducerSnapshot | None, held: Callable[[], Iterable[ProducerBatch]]
) -> Iterable[ProducerBatch]:
    """What a leader rebuilds its producer table from when it starts writing a segment (before the segment's own
    batches): the snapshot of the chain's last seal; ``held`` (the batches of the sealed segments this node holds
    copies of) only for a chain whose last seal carries no snapshot."""
    if sealed is None:
        return held()
    return sealed.entries
