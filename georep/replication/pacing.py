"""A link's bandwidth limit (``rate_limit_bytes_per_s`` in the topology) as a token bucket that the upstream
charges for each message it sends to the link's destination, as Kafka's replication quotas throttle a follower's
fetches.

The bucket holds at most one second of the rate (its burst). A message is sent, then paid for: the tokens may go
below zero, and the stream waits until they are back to zero before its next message. So a stream sends at most
``burst + rate * t`` bytes plus one message in any ``t`` seconds, and a message larger than the burst still goes
(a limit below the size of a message would otherwise stop the link for good). A destination site of several nodes
pulls over one stream per node: each is held to its share (``share``). Pure: the caller passes the time and
does the waiting.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Pacer:
    rate: float  # bytes a second
    tokens: float
    at: float  # when ``tokens`` was last worked out, in the caller's seconds

    @classmethod
    def start(cls, rate: float, now: float) -> Pacer:
        return cls(rate, rate, now)

    def charge(self, size: int, now: float) -> float:
        """Pay for ``size`` bytes sent at ``now``: how many seconds to wait before the next message."""
        self.tokens = min(self.rate, self.tokens + max(0.0, now - self.at) * self.rate) - size
        self.at = now
        return max(0.0, -self.tokens / self.rate)


def share(rate_limit: int | None, streams: int) -> float | None:
    """Each of ``streams`` pull streams' share of a link's limit (None: no limit)."""
    return None if rate_limit is None else rate_limit / max(1, streams)
