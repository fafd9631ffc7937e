"""Appends that repeat what a follower holds, and answers that would send its leader back. Pure.

pysyncobj 0.3.17 keeps two habits that Raft (§5.3) does not have, and that messages held until an fsync
(``georep.raft.transport``) make frequent, since the leader then sends several appends before the first answer:

* A follower deletes every entry after an append's ``prevLogIdx`` before it adds the append's entries, even entries
  equal to the append's, and even entries after them: an append that arrives after later ones (a leader that sent
  the same entries again) cuts entries the follower already answered for, which the leader may have counted in a
  commit. They come back at once, but the journal's truncation is durable and the re-added entries are not, until
  the next fdatasync; and pysyncobj logs "truncating already-applied log entries".
* A leader sets a follower's next index to the one in each successful answer, so the answer to an early append
  sends it back below appends already on their way, which it then sends again (hence the first habit).

:func:`trim_append` drops from an append the entries the follower holds (same index and term), so that only entries
from the first conflict on are deleted, as Raft does, and drops an append whose entries it all holds when the log goes
on after them (a late append: the answers to the later ones say more). :func:`next_index_after_answer` keeps a
leader's next index where its appends already went.

A third habit is a bug: a leader sends an entry of at least ``appendEntriesBatchSizeBytes`` in pieces of its pickle
(``transmission``: ``start``, ``process``..., ``finish``), but labels a piece ``finish`` as soon as it reaches the
length of the entry's *command*, which is shorter than its pickle by a few dozen bytes. An entry whose command ends
that close below a multiple of the piece size is labelled ``finish`` one piece early: every follower unpickles a
truncated entry, fails (``pickle data was truncated``, in its tick thread) and refuses it, at every resend, so the
log stops there until the Raft leadership moves. The command batches of group commit
(``cluster.site_state.batches``) are sized towards a bound, so that happened under load (a topic of 2,000
partitions being created: twice in three minutes). :class:`TransmissionPieces` relabels such an early ``finish``
as ``process``.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from typing import Any

Entry = tuple[bytes, int, int]  # (command, index, term), as pysyncobj keeps them


def trim_append(
    message: Mapping[str, Any], entry_at: Callable[[int], Entry | None], last_index: int
) -> Mapping[str, Any] | None:
    """The message a follower should process instead of ``message`` (itself if it is not such an append); None to
    drop it. ``entry_at(index)`` is the follower's entry at ``index`` (None if it has none there), ``last_index``
    the index of its last entry."""
    if message.get("type") != "append_entries" or "prevLogIdx" not in message or "transmission" in message:
        return message
    entries = message.get("entries") or []
    previous = entry_at(message["prevLogIdx"])
    if not entries or previous is None or previous[2] != message["prevLogTerm"]:
        return message  # nothing to keep, or pysyncobj's answer (send earlier entries) is the right one
    held = 0
    for _, index, term in entries:
        mine = entry_at(index)
        if mine is None or mine[2] != term:
            break
        held += 1
    if held == 0:
        return message
    if held == len(entries) and last_index > entries[-1][1]:
        return None
    _, index, term = entries[held - 1]
    return {**message, "prevLogIdx": index, "prevLogTerm": term, "entries": list(entries[held:])}


def next_index_after_answer(answer: Mapping[str, Any], before: int | None, after: int | None) -> int | None:
    """A follower's next index once the leader processed ``answer`` (it went from ``before`` to ``after``): a
    successful answer never moves it back (a failed one, ``reset``, does: the follower lacks entries)."""
    if answer.get("type") != "next_node_idx" or answer.get("reset") or not answer.get("success"):
        return after
    if before is None or after is None:
        return after
    return max(before, after)


class TransmissionPieces:
    """One follower's view of the pieces of a split entry from its leader (see the module docstring)."""

    def __init__(self) -> None:
        self._received = bytearray()

    def relabel(self, message: Mapping[str, Any]) -> Mapping[str, Any]:
        """``message``, with a ``finish`` that does not complete the entry's pickle relabelled ``process``."""
        kind = message.get("transmission") if message.get("type") == "append_entries" else None
        data = message.get("data")
        if kind is None or not isinstance(data, bytes):
            return message
        if kind == "start":
            self._received = bytearray(data)
            return message
        self._received += data
        if kind != "finish":
            return message
        try:
            pickle.loads(self._received)  # noqa: S301  # the leader's entry, from an authenticated member
        except (EOFError, pickle.UnpicklingError):
            return {**message, "transmission": "process"}
        self._received = bytearray()
        return message
