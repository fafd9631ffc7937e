"""Vector offsets: ``{origin: next origin seq}`` for one partition.

A vector offset is a consumer position that means the same thing at every
site (ARCHITECTURE.md, I5): it covers, for each origin, the origin seqs
``0 .. next - 1``. An origin that is absent is at 0, so ``{a@1: 0}`` and ``{}``
are the same vector; zero entries are dropped on construction so that equality
and hashing follow meaning, not spelling.

Vectors are immutable values: every update returns a new vector. They form a
join semi-lattice under pointwise max (:meth:`VectorOffset.merge`), ordered by
:meth:`VectorOffset.dominated_by` (also ``<=``), which is a partial order: two
vectors that each lead on a different origin are incomparable.

The text form, used by the CLI's ``--vector``, is ``a@1:10,b@3:0``.
Protobuf conversions live in ``georep/proto/convert.py``: the pure core does
not import protobuf.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping
from typing import final

from offsets.coordinates import EPOCH_MAX, Origin, OriginSeq
from topology.ids import SiteId

SEQ_MAX = 2**63 - 1  # origin seqs travel as int64 in protobuf and in batch headers

TEXT_FORMAT_HELP = (
    "expected comma-separated 'site@epoch:next_seq' entries, for example 'a@1:10,b@3:0' "
    "(an empty string is the empty vector)"
)
_ENTRY = re.compile(r"([a-z][a-z0-9-]{0,31})@([0-9]+):([0-9]+)", re.ASCII)


class InvalidVectorOffset(ValueError):
    """Text or values that do not form a vector offset; the message says the expected format."""


class Coverage(enum.StrEnum):
    """How much of one batch's origin-seq range a vector covers."""

    NONE = "none"
    PARTIAL = "partial"
    ALL = "all"


@final
class VectorOffset:
    """An immutable ``{origin: next origin seq}``; absent origins are at 0."""

    __slots__ = ("_hash", "_next")

    _next: dict[Origin, OriginSeq]
    _hash: int | None

    def __init__(self, entries: Mapping[Origin, int] | Iterable[tuple[Origin, int]] = ()) -> None:
        pairs = entries.items() if isinstance(entries, Mapping) else entries
        out: dict[Origin, OriginSeq] = {}
        for origin, seq in pairs:
            if not isinstance(origin, Origin):
                raise TypeError(f"vector offset keys must be Origin, got {origin!r}")
            if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= SEQ_MAX:
                raise InvalidVectorOffset(
                    f"invalid next origin seq {seq!r} for {origin}: must be an integer in [0, {SEQ_MAX}]"
                )
            if origin in out:
                raise InvalidVectorOffset(f"origin {origin} appears twice in a vector offset")
            if seq:
                out[origin] = OriginSeq(seq)
        self._next = out
        self._hash = None

    @classmethod
    def _trusted(cls, entries: dict[Origin, OriginSeq]) -> VectorOffset:
        vector = cls.__new__(cls)
        vector._next = entries
        vector._hash = None
        return vector

    # --- reading ---------------------------------------------------------------

    def get(self, origin: Origin) -> OriginSeq:
        """The next origin seq of ``origin`` not yet covered (0 if absent)."""
        return self._next.get(origin, OriginSeq(0))

    def items(self) -> list[tuple[Origin, OriginSeq]]:
        """Non-zero entries, sorted by origin, so iteration is deterministic."""
        return sorted(self._next.items())

    def origins(self) -> list[Origin]:
        """Origins with a non-zero entry, sorted."""
        return sorted(self._next)

    def to_dict(self) -> dict[Origin, OriginSeq]:
        """A mutable copy of the non-zero entries (same shape as ``PartitionLog.vector()``)."""
        return dict(self._next)

    def __len__(self) -> int:
        return len(self._next)

    def __bool__(self) -> bool:
        return bool(self._next)

    def covers(self, origin: Origin, seq: int) -> bool:
        """Whether the record ``(origin, seq)`` is already covered (``seq < next``)."""
        return seq < self._next.get(origin, 0)

    def covers_batch(self, origin: Origin, base_seq: int, last_seq: int) -> Coverage:
        """How much of the origin-seq range ``[base_seq, last_seq]`` of one batch is covered."""
        if last_seq < base_seq:
            raise ValueError(f"empty batch range [{base_seq}, {last_seq}]")
        next_seq = self._next.get(origin, 0)
        if next_seq > last_seq:
            return Coverage.ALL
        if next_seq <= base_seq:
            return Coverage.NONE
        return Coverage.PARTIAL

    def dominated_by(self, other: VectorOffset) -> bool:
        """Whether ``other`` covers everything this vector covers (pointwise ``<=``)."""
        other_next = other._next
        for origin, seq in self._next.items():  # noqa: SIM110 - half the time of all(); held tables ask a lot
            if seq > other_next.get(origin, 0):
                return False
        return True

    def __le__(self, other: object) -> bool:
        if not isinstance(other, VectorOffset):
            return NotImplemented
        return self.dominated_by(other)

    def __ge__(self, other: object) -> bool:
        if not isinstance(other, VectorOffset):
            return NotImplemented
        return other.dominated_by(self)

    # --- updating (new vectors) ---------------------------------------------

    def advanced(self, origin: Origin, next_seq: int) -> VectorOffset:
        """This vector with ``origin`` at ``max(current, next_seq)``; it never moves backwards."""
        if isinstance(next_seq, bool) or not isinstance(next_seq, int) or not 0 <= next_seq <= SEQ_MAX:
            raise InvalidVectorOffset(
                f"invalid next origin seq {next_seq!r} for {origin}: must be an integer in [0, {SEQ_MAX}]"
            )
        if not isinstance(origin, Origin):
            raise TypeError(f"vector offset keys must be Origin, got {origin!r}")
        if next_seq <= self._next.get(origin, 0):
            return self
        entries = dict(self._next)
        entries[origin] = OriginSeq(next_seq)
        return VectorOffset._trusted(entries)

    def merge(self, other: VectorOffset) -> VectorOffset:
        """Pointwise max: covers exactly what either vector covers."""
        if other.dominated_by(self):
            return self
        entries = dict(self._next)
        for origin, seq in other._next.items():
            if seq > entries.get(origin, 0):
                entries[origin] = seq
        return VectorOffset._trusted(entries)

    # --- value semantics -----------------------------------------------------

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, VectorOffset):
            return NotImplemented
        return self._next == other._next

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self._next.items()))
        return self._hash

    def __repr__(self) -> str:
        return f"VectorOffset.parse({self.to_text()!r})"

    # --- text form -------------------------------------------------------------

    def to_text(self) -> str:
        """``a@1:10,b@3:7``, sorted by origin; zero entries are left out."""
        return ",".join(f"{origin}:{seq}" for origin, seq in self.items())

    @classmethod
    def parse(cls, text: str) -> VectorOffset:
        """Parse the text form; raises :class:`InvalidVectorOffset` saying what the format is."""
        entries: dict[Origin, OriginSeq] = {}
        if not text.strip():
            return cls()
        for raw in text.split(","):
            part = raw.strip()
            match = _ENTRY.fullmatch(part)
            if match is None:
                raise InvalidVectorOffset(
                    f"invalid vector offset {text!r}: entry {part!r} is malformed; {TEXT_FORMAT_HELP}"
                )
            site, epoch_text, seq_text = match.groups()
            epoch = int(epoch_text)
            seq = int(seq_text)
            if epoch > EPOCH_MAX:
                raise InvalidVectorOffset(f"invalid vector offset {text!r}: epoch in {part!r} exceeds {EPOCH_MAX}")
            if seq > SEQ_MAX:
                raise InvalidVectorOffset(f"invalid vector offset {text!r}: next seq in {part!r} exceeds {SEQ_MAX}")
            origin = Origin(SiteId(site), epoch)
            if origin in entries:
                raise InvalidVectorOffset(f"invalid vector offset {text!r}: origin {origin} appears twice")
            entries[origin] = OriginSeq(seq)
        # Every entry was checked above; only the zero entries are left to drop (commit records parse a lot).
        return cls._trusted({origin: seq for origin, seq in entries.items() if seq})
