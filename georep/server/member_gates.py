"""When a node's segment writers may open a stream to a peer again: one reconnect backoff per peer, not per segment.
Shell (asyncio).

A leader keeps one ``AppendSegment`` stream per open segment and member (``georep/server/ensemble.py``). When a
node dies, every open segment that had it as a member breaks its stream to it and tries again: at 10,000
partitions 4,500 to 5,200 failed stream opens a second across the survivors, a third of a survivor's samples in
gRPC's ``StreamStreamCall.__init__`` (docs/design.md, "Metadata at scale", fifth session). A :class:`MemberGate`
holds them all behind one probe:

* **Up** (the start, and after any stream to the peer answered): every writer opens its stream at once.
* **Down** (a stream to the peer failed ``UNAVAILABLE``): writers wait. One of them at a time, the *probe*, opens
  its stream, once the peer's backoff ran out; the backoff doubles with each failed probe, from
  :data:`BACKOFF_MIN_S` to :data:`BACKOFF_MAX_S`. The first stream that answers sets the peer up again and lets
  every waiting writer open its own.
* **Dead in the site's metadata** (:meth:`MemberGates.set_dead`: its session ran out) while down: no probe at all,
  until the metadata shows the peer live again, which lets the next probe go at once. A peer whose streams answer is
  never held back by the metadata (a stale view must not cut a working stream).

The gate decides only *when* a writer opens its stream. A writer still counts a member's acks only from its own
stream's answers (``cluster/lead.py``): letting it through says nothing about what the member holds.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections import deque
from collections.abc import Callable, Iterable

from topology.ids import NodeId

BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 2.0
# A probe neither answered nor failed for this long (a member whose disk queue holds its answer, a stream stuck in a
# connect): another waiter probes too, so that one stuck stream does not hold every writer to the peer.
PROBE_OVERDUE_S = 5.0


class Admission(enum.Enum):
    """How a writer was let through :meth:`MemberGate.admit`."""

    OPEN = "open"  # the peer is up: open the stream
    PROBE = "probe"  # the peer is down and this writer tries it for everyone: report how it went (exactly once)


class MemberGate:
    """One peer's reconnect state, shared by every segment writer of the node (see the module docstring)."""

    def __init__(self, clock_s: Callable[[], float] = time.monotonic) -> None:
        self._clock_s = clock_s
        self.down = False
        self.dead = False  # the site's metadata shows the peer's session run out
        self.backoff_s = BACKOFF_MIN_S
        self.retry_at_s = 0.0
        self.probing = False
        self.probes = 0  # streams opened as probes (what a test or an operator can count)
        self._waiters: deque[asyncio.Future[Admission]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._overdue: asyncio.TimerHandle | None = None

    async def admit(self) -> Admission:
        """Wait until this writer may open its stream to the peer. A ``PROBE`` must be followed by exactly one of
        :meth:`answered`, :meth:`failed` or :meth:`abandoned`."""
        if not self.down:
            return Admission.OPEN
        fut: asyncio.Future[Admission] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._next_probe()
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.result() is Admission.PROBE:
                self.abandoned()  # chosen as the probe as the writer closed: another waiter probes instead
            raise

    def answered(self) -> None:
        """A stream to the peer answered: it is up, and every waiting writer opens its stream."""
        self.down = False
        self.probing = False
        self.backoff_s = BACKOFF_MIN_S
        self._cancel_timer()
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(Admission.OPEN)

    def failed(self, probe: bool) -> None:
        """A stream to the peer failed as unreachable. Only a failed probe doubles the backoff: the streams that
        were open when the peer died all fail at once, and count once."""
        if probe:
            self.probing = False
            self.backoff_s = min(self.backoff_s * 2, BACKOFF_MAX_S)
        if probe or not self.down:
            self.down = True
            self.retry_at_s = self._clock_s() + self.backoff_s
        self._next_probe()

    def abandoned(self) -> None:
        """The probe ended without an answer either way (its writer closed): the next waiter may probe."""
        self.probing = False
        self._next_probe()

    def set_dead(self, dead: bool) -> None:
        if dead == self.dead:
            return
        self.dead = dead
        if not dead:  # live again in the metadata: probe now
            self.retry_at_s = self._clock_s()
        self._next_probe()

    def _next_probe(self) -> None:
        """Let one waiter probe if the backoff ran out; else wake up when it does."""
        self._cancel_timer()
        if not self.down or self.probing or self.dead:
            return
        while self._waiters and self._waiters[0].done():
            self._waiters.popleft()
        if not self._waiters:
            return
        wait_s = self.retry_at_s - self._clock_s()
        if wait_s > 0:
            self._timer = asyncio.get_running_loop().call_later(wait_s, self._next_probe)
            return
        self.probing = True
        self.probes += 1
        self._waiters.popleft().set_result(Admission.PROBE)
        self._overdue = asyncio.get_running_loop().call_later(PROBE_OVERDUE_S, self._probe_overdue, self.probes)

    def _probe_overdue(self, probe: int) -> None:
        if self.probing and self.probes == probe:
            self.abandoned()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._overdue is not None and not self.probing:
            self._overdue.cancel()
            self._overdue = None

    @property
    def waiting(self) -> int:
        return sum(1 for f in self._waiters if not f.done())


class MemberGates:
    """Every peer's :class:`MemberGate`, for one node (``ClusterMember.gates``)."""

    def __init__(self, clock_s: Callable[[], float] = time.monotonic) -> None:
        self._clock_s = clock_s
        self._gates: dict[NodeId, MemberGate] = {}

    def __getitem__(self, node: NodeId) -> MemberGate:
        gate = self._gates.get(node)
        if gate is None:
            gate = self._gates[node] = MemberGate(self._clock_s)
        return gate

    def set_dead(self, dead: Iterable[NodeId]) -> None:
        """The nodes the site's metadata shows dead now (every other known peer is live)."""
        dead = set(dead)
        for node in sorted(dead | set(self._gates)):
            self[node].set_dead(node in dead)
