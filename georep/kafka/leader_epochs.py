"""Kafka's OffsetForLeaderEpoch (API key 23), answered from georep's leader epochs. Pure.

A Kafka consumer (KIP-320; librdkafka, the Java client) remembers, with its position, the leader epoch of the
last batch it read (a batch's ``partitionLeaderEpoch``) or of the ListOffsets answer it started from. After
a leader change it asks the new leader for that epoch's end offset: an end below its position means the log
was truncated under it, and it resets.

**What georep states.** Metadata and ListOffsets name a partition's leader with georep's leader epoch (the
site's Raft metadata on a multi-node site; 0 on a one-node site, whose only node leads everything), and
every batch the gateway serves says ``partitionLeaderEpoch`` 0 (``georep/kafka/records.py``).

**One epoch range per partition.** georep's epochs do not cut its log into ranges a client could tell
apart, and they need not: a Kafka follower truncates to its leader's log, but georep never takes back what a
reader was served. A fetch serves only below ``flushed_offset``: a one-node site's fsynced records, which
survive its crash (I6), and a multi-node site's LAC, at which a new leader's recovery seals the segment, so
every record served stays in the log at every later epoch (I1: each site holds a prefix per origin, and
I3: in its order, so local offsets once served keep their records). So every epoch from 0 to the leader's
current one ends where the log's readable part ends now: the answer for a requested epoch ``e`` in
``0..current`` is ``(e, flushed_offset)``, which is at or past any position a client reached by reading,
and a client never detects a truncation that did not happen. Reporting the requested epoch itself (not
0) keeps the client's check (the answer's epoch against the one it asked for) quiet for a position taken
from ListOffsets at a later epoch.

As Kafka does:

* ``current_leader_epoch`` (v2+, -1 for none) above the leader's epoch: ``UNKNOWN_LEADER_EPOCH`` (the
  answering node has not seen that election yet: the client retries); below it: ``FENCED_LEADER_EPOCH``
  (the client's metadata is stale: it refreshes);
* a requested epoch above the leader's, or negative: no error, epoch and end offset -1 (undefined).
"""

from __future__ import annotations

from dataclasses import dataclass

FENCED_LEADER_EPOCH = 74
UNKNOWN_LEADER_EPOCH = 75
UNDEFINED = -1
NO_CURRENT_EPOCH = -1  # a request that does not fence (v0-v1, or a client without an epoch)


@dataclass(frozen=True, slots=True)
class EpochEnd:
    """One partition's answer: Kafka's error code, the epoch and its end offset."""

    error: int
    leader_epoch: int
    end_offset: int


def end_of_epoch(requested: int, current: int, leader_epoch: int, readable_end: int) -> EpochEnd:
    """The answer for ``requested`` from a client whose metadata says ``current``, at a leader of
    ``leader_epoch`` whose log is readable below ``readable_end`` (see the module docstring)."""
    if current != NO_CURRENT_EPOCH and current > leader_epoch:
        return EpochEnd(UNKNOWN_LEADER_EPOCH, UNDEFINED, UNDEFINED)
    if current != NO_CURRENT_EPOCH and current < leader_epoch:
        return EpochEnd(FENCED_LEADER_EPOCH, UNDEFINED, UNDEFINED)
    if not 0 <= requested <= leader_epoch:
        return EpochEnd(0, UNDEFINED, UNDEFINED)
    return EpochEnd(0, requested, readable_end)
