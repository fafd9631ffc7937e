"""Hybrid logical clocks: the order of committed offsets across sites.

A commit is stamped with an HLC timestamp (Kulkarni et al., "Logical Physical
Clocks", 2014): the wall clock in milliseconds plus a logical counter that
breaks ties and keeps the stamp moving forward when the wall clock stalls or
steps back. Every site's clock also takes in the stamps it receives (replicated
commits, and the stamp of a consumer's previous commit), so a commit that
causally follows another always carries a larger stamp, whatever the skew
between the sites' wall clocks.

A stamp packs into one int64: ``wall_ms << 16 | logical``. Ties between two
sites' equal stamps are broken by site name where stamps are compared
(``offsets/commits.py``).
"""

from __future__ import annotations

from typing import NewType

HlcStamp = NewType("HlcStamp", int)

LOGICAL_BITS = 16
LOGICAL_MAX = (1 << LOGICAL_BITS) - 1
STAMP_MAX = 2**63 - 1


def pack(wall_ms: int, logical: int) -> HlcStamp:
    if not 0 <= logical <= LOGICAL_MAX:
        raise ValueError(f"HLC logical counter {logical} outside 0..{LOGICAL_MAX}")
    if wall_ms < 0 or (wall_ms << LOGICAL_BITS | logical) > STAMP_MAX:
        raise ValueError(f"HLC wall time {wall_ms} ms outside the int64 range")
    return HlcStamp(wall_ms << LOGICAL_BITS | logical)


def unpack(stamp: int) -> tuple[int, int]:
    """``(wall_ms, logical)``."""
    return stamp >> LOGICAL_BITS, stamp & LOGICAL_MAX


class HybridClock:
    """One site's clock. Pure: the caller passes the wall time in."""

    __slots__ = ("_last",)

    def __init__(self, last: int = 0) -> None:
        self._last = HlcStamp(last)

    @property
    def last(self) -> HlcStamp:
        return self._last

    def now(self, wall_ms: int, after: int = 0) -> HlcStamp:
        """A stamp larger than every stamp issued or observed so far, and than ``after``."""
        floor = max(self._last, after)
        floor_wall, floor_logical = unpack(floor)
        if wall_ms > floor_wall:
            stamp = pack(wall_ms, 0)
        elif floor_logical < LOGICAL_MAX:
            stamp = pack(floor_wall, floor_logical + 1)
        else:  # 65536 stamps in one millisecond: borrow the next millisecond
            stamp = pack(floor_wall + 1, 0)
        self._last = stamp
        return stamp

    def observe(self, stamp: int) -> None:
        """Take in a stamp issued elsewhere, so later local stamps order after it."""
        if stamp > self._last:
            self._last = HlcStamp(stamp)
