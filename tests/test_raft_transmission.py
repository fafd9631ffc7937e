"""A follower receives every entry its leader splits into pieces, however long (georep.raft.appends).

pysyncobj 0.3.17's leader labels a piece ``finish`` as soon as it reaches the length of the entry's command, a few
dozen bytes short of its pickle: an entry whose command ends just below a multiple of the piece size arrived
truncated at every follower, at every resend, and the log stopped there.
"""

from __future__ import annotations

from typing import Any

import pytest
from pysyncobj import pickle

from georep.raft.appends import TransmissionPieces
from georep.raft.frames import APPEND_BATCH_BYTES


def leader_pieces(entry: tuple[bytes, int, int], batch: int) -> list[dict[str, Any]]:
    """The messages pysyncobj's leader sends for one entry of at least ``batch`` bytes (syncobj.py, the
    ``transmission`` branch of its append-entries loop), labels and all."""
    pickled = pickle.dumps(entry)
    out = []
    for pos in range(0, len(pickled), batch):
        if pos == 0:
            kind = "start"
        elif pos + batch >= len(entry[0]):  # the command's length, not the pickle's: the bug
            kind = "finish"
        else:
            kind = "process"
        out.append({"type": "append_entries", "transmission": kind, "data": pickled[pos : pos + batch]})
    return out


def follower_receives(messages: list[dict[str, Any]], pieces: TransmissionPieces | None) -> list[Any]:
    """What pysyncobj's follower makes of ``messages`` (syncobj.py: it unpickles what it holds at each ``finish``),
    with each message relabelled by ``pieces`` first (None: as they come)."""
    received = b""
    entries = []
    for message in messages:
        kind = (pieces.relabel(message) if pieces is not None else message)["transmission"]
        received = message["data"] if kind == "start" else received + message["data"]
        if kind == "finish":
            entries.append(pickle.loads(received))
            received = b""
    return entries


SIZES = [k * APPEND_BATCH_BYTES - d for k in (2, 3, 8, 16) for d in (1, 20, 40, 60, 200, 5_000)]


@pytest.mark.parametrize("size", SIZES)
def test_every_split_entry_arrives_whole(size: int) -> None:
    entry = (bytes(range(256)) * (size // 256 + 1))[:size], 42, 7
    pieces = TransmissionPieces()
    for _ in range(2):  # a resend starts afresh
        assert follower_receives(leader_pieces(entry, APPEND_BATCH_BYTES), pieces) == [entry]


def test_without_the_relabelling_an_entry_just_below_a_piece_multiple_arrives_truncated() -> None:
    """The bug itself, so that the test above is known to cover it."""
    entry = b"x" * (2 * APPEND_BATCH_BYTES - 20), 42, 7
    with pytest.raises((EOFError, pickle.pickle.UnpicklingError)):
        follower_receives(leader_pieces(entry, APPEND_BATCH_BYTES), None)
