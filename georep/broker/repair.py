"""Repairing quarantined batches from peers: whom to ask for which batch, and when. Sans I/O.

A batch that fails its check at a site is quarantined by the storage layer
(``georep/storage/segment_log.py``): served to no one, its coordinate known
from the origin index. Every other site holds the same batch byte for byte
under the same CRC (ARCHITECTURE.md: batches are copied verbatim), so any
peer that holds it durably can give it back; the storage layer checks the
copy and writes it in place, at the same local offsets.

:class:`RepairQueue` decides the asking. Peers are tried in the order given
(the sites this one pulls from first: they hold what it holds), one at a
time; when every peer has been asked without success, the batch waits
``retry_min_ms``, doubling up to ``retry_max_ms``, and the round starts
again: a peer may get the batch later, or come back. The node's replicator
drives it with ``FetchBatch`` calls; a unit test drives it by hand.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from georep.storage.api import DamagedBatch

PartitionKey = tuple[str, int]
RETRY_MIN_MS = 1_000
RETRY_MAX_MS = 60_000


@dataclass(frozen=True, slots=True)
class Ask:
    """Ask ``peer`` for the batch, then report :meth:`RepairQueue.repaired` or :meth:`RepairQueue.failed`."""

    key: PartitionKey
    damaged: DamagedBatch
    peer: str


@dataclass(slots=True)
class _Pending:
    next_peer: int = 0
    not_before_ms: int = 0
    backoff_ms: int = RETRY_MIN_MS
    asking: bool = False
    last_error: str = ""


class RepairQueue:
    """Every quarantined batch of one site and where its repair stands."""

    def __init__(
        self, peers: Sequence[str], retry_min_ms: int = RETRY_MIN_MS, retry_max_ms: int = RETRY_MAX_MS
    ) -> None:
        self.peers = list(peers)
        self.retry_min_ms = retry_min_ms
        self.retry_max_ms = retry_max_ms
        self._pending: dict[tuple[PartitionKey, int], _Pending] = {}

    def due(self, damaged: Mapping[PartitionKey, Sequence[DamagedBatch]], now_ms: int) -> list[Ask]:
        """The asks to make now, given what is quarantined now (repairs done elsewhere drop out)."""
        current = {(key, d.base_offset): d for key, batches in damaged.items() for d in batches}
        for gone in set(self._pending) - set(current):
            del self._pending[gone]
        if not self.peers:
            return []
        out: list[Ask] = []
        for (key, base), d in sorted(current.items()):
            state = self._pending.setdefault((key, base), _Pending(backoff_ms=self.retry_min_ms))
            if state.asking or now_ms < state.not_before_ms:
                continue
            state.asking = True
            out.append(Ask(key, d, self.peers[state.next_peer]))
        return out

    def failed(self, ask: Ask, error: str, now_ms: int) -> None:
        """``ask.peer`` could not give a good copy: the next peer; after a whole round, wait."""
        state = self._pending.get((ask.key, ask.damaged.base_offset))
        if state is None:
            return
        state.asking = False
        state.last_error = f"{ask.peer}: {error}"
        state.next_peer = (state.next_peer + 1) % len(self.peers)
        if state.next_peer == 0:
            state.not_before_ms = now_ms + state.backoff_ms
            state.backoff_ms = min(state.backoff_ms * 2, self.retry_max_ms)

    def repaired(self, ask: Ask) -> None:
        self._pending.pop((ask.key, ask.damaged.base_offset), None)

    def last_error(self, key: PartitionKey, base_offset: int) -> str:
        state = self._pending.get((key, base_offset))
        return state.last_error if state is not None else ""
