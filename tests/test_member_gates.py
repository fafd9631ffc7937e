"""One reconnect backoff per peer for every segment writer of a node (georep/server/member_gates.py), and what it
must not change: a member counts for a write only once its own stream says it holds it (georep/server/ensemble.py).

The gate's own rules run on asyncio alone; the last test runs writers of many segments against a member that is
unreachable, then dead in the metadata, then back, over real gRPC and real stores in this process.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import grpc
import pytest

from cluster.lead import PartitionLead
from georep.server import member_gates
from georep.server.ensemble import SegmentToWrite, SegmentWriter, solo_writer
from georep.server.member_gates import BACKOFF_MIN_S, Admission, MemberGate, MemberGates
from georep.server.peer_channels import PeerChannels
from georep.server.segments import SegmentService
from georep.storage.api import LogConfig
from georep.storage.replica_store import ReplicaStore, UnknownSegment
from georep.storage.segment_log import SegmentLog
from offsets.coordinates import OriginSeq
from tests.support.channels import add_port
from tests.support.ports import free_port
from tests.support.segments import A, Writer, read_all
from topology.ids import LeaderEpoch, NodeId, SegmentId

WAIT_S = 30.0
DOWN = NodeId(3)


async def until(what: str, check: Callable[[], bool]) -> None:
    async with asyncio.timeout(WAIT_S):
        while not check():
            await asyncio.sleep(0.01)
    assert check(), what


def admitting(gate: MemberGate, count: int) -> list[asyncio.Task[Admission]]:
    return [asyncio.create_task(gate.admit()) for _ in range(count)]


def probes(tasks: list[asyncio.Task[Admission]]) -> list[asyncio.Task[Admission]]:
    return [t for t in tasks if t.done() and not t.cancelled() and t.result() is Admission.PROBE]


def test_one_writer_probes_a_down_peer_and_its_answer_lets_every_writer_in() -> None:
    async def run() -> None:
        gate = MemberGate()
        assert await gate.admit() is Admission.OPEN  # up: nobody waits
        gate.failed(probe=False)  # the streams open when the peer died fail together...
        gate.failed(probe=False)
        assert gate.backoff_s == BACKOFF_MIN_S  # ...and count once
        tasks = admitting(gate, 6)
        await until("a probe", lambda: len(probes(tasks)) == 1)
        await asyncio.sleep(4 * BACKOFF_MIN_S)  # a second probe would be due by now
        assert len(probes(tasks)) == 1 and sum(t.done() for t in tasks) == 1
        gate.answered()
        results = await asyncio.gather(*tasks)
        assert results.count(Admission.PROBE) == 1 and results.count(Admission.OPEN) == 5
        assert not gate.down and await gate.admit() is Admission.OPEN

    asyncio.run(run())


def test_a_failed_probe_doubles_the_backoff_and_a_closed_probe_passes_it_on() -> None:
    async def run() -> None:
        gate = MemberGate()
        gate.failed(probe=False)
        tasks = admitting(gate, 3)
        await until("a probe", lambda: len(probes(tasks)) == 1)
        gate.failed(probe=True)
        assert gate.backoff_s == 2 * BACKOFF_MIN_S and gate.down
        await until("a second probe", lambda: len(probes(tasks)) == 2)
        gate.abandoned()  # its writer closed before any answer: the last waiter probes, without a new backoff
        await until("a third probe", lambda: len(probes(tasks)) == 3)
        assert gate.backoff_s == 2 * BACKOFF_MIN_S and gate.probes == 3
        gate.answered()

    asyncio.run(run())


def test_a_writer_cancelled_as_it_is_chosen_to_probe_hands_the_probe_on() -> None:
    async def run() -> None:
        gate = MemberGate(clock_s=lambda: 0.0)  # the backoff never runs out by the clock...
        gate.failed(probe=False)
        first, second = admitting(gate, 2)
        await asyncio.sleep(0)
        gate.retry_at_s = 0.0  # ...until now
        gate._next_probe()
        first.cancel()  # chosen, but cancelled before it ran
        assert await second is Admission.PROBE

    asyncio.run(run())


def test_a_probe_that_neither_answers_nor_fails_lets_another_writer_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """One stream stuck in its connect, or behind the member's disk queue, must not hold every writer to the peer."""
    monkeypatch.setattr(member_gates, "PROBE_OVERDUE_S", 0.05)

    async def run() -> None:
        gate = MemberGate()
        gate.failed(probe=False)
        tasks = admitting(gate, 3)
        await until("a probe", lambda: len(probes(tasks)) == 1)
        await until("a second probe once the first is overdue", lambda: len(probes(tasks)) == 2)
        gate.answered()
        assert (await tasks[2]) is Admission.OPEN

    asyncio.run(run())


def test_no_probe_while_the_metadata_shows_the_peer_dead_and_one_at_once_when_it_is_live() -> None:
    async def run() -> None:
        now = [0.0]
        gates = MemberGates(clock_s=lambda: now[0])
        gate = gates[DOWN]
        gate.failed(probe=False)
        gates.set_dead([DOWN])
        tasks = admitting(gate, 4)
        now[0] = 100.0  # the backoff ran out long ago
        gate._next_probe()
        for _ in range(20):
            await asyncio.sleep(0)
        assert not any(t.done() for t in tasks) and gate.waiting == 4
        gates.set_dead([])  # a heartbeat came back: probe now, whatever the backoff says
        await until("a probe", lambda: len(probes(tasks)) == 1)
        gate.answered()
        await asyncio.gather(*tasks)

    asyncio.run(run())


def test_a_peer_whose_streams_answer_is_not_held_back_by_the_metadata() -> None:
    async def run() -> None:
        gates = MemberGates()
        gates.set_dead([DOWN])  # a stale view: its streams never failed
        assert await gates[DOWN].admit() is Admission.OPEN

    asyncio.run(run())


# -- writers of many segments behind one gate ----------------------------------------------------------------

SEGMENTS = 12
SEG = SegmentId(1)
BASE = 0
LEADER = NodeId(1)
LIVE = NodeId(2)


def stored_batches(tmp_path: Path, count: int) -> list[bytes]:
    log = SegmentLog.create_at(tmp_path / "scratch", LogConfig(), BASE, {A: OriginSeq(0)}, 0)
    w = Writer(log, next_seq={A: 0})
    for _ in range(count):
        w.append(A, 2, value_bytes=100)
    batches = read_all(log)
    log.close()
    return batches


async def serve_member(store: ReplicaStore, executor: ThreadPoolExecutor, address: str) -> grpc.aio.Server:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((SegmentService(store, executor, lambda: 0).handler(),))
    assert add_port(server, address)
    await server.start()
    return server


class CountingChannels:
    """The node's shared channels (``PeerChannels``), counting the streams opened to each address."""

    def __init__(self) -> None:
        self.inner = PeerChannels(None)
        self.opened: Counter[str] = Counter()

    def __call__(self, address: str) -> AbstractAsyncContextManager[grpc.aio.Channel]:
        self.opened[address] += 1
        return self.inner(address)


@asynccontextmanager
async def member_servers() -> AsyncIterator[list[grpc.aio.Server]]:
    servers: list[grpc.aio.Server] = []
    try:
        yield servers
    finally:
        for server in servers:
            await server.stop(None)


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[dict[NodeId, ReplicaStore]]:
    made = {n: ReplicaStore(tmp_path / f"node-{n}", now_ms=0) for n in (LEADER, LIVE, DOWN)}
    yield made
    for store in made.values():
        store.close()


def test_writers_of_many_segments_wait_for_one_probe_and_count_a_member_only_once_it_holds_the_write(
    tmp_path: Path, stores: dict[NodeId, ReplicaStore]
) -> None:
    """Ack quorum 3 of 3, so every write needs the member that is down. While it is down, the writers open no
    stream to it but one probe at a time, none while the metadata shows it dead; once it is back, each write is
    released only when that member's own copy holds it fsynced."""
    batch = stored_batches(tmp_path, 1)[0]
    addresses = {LIVE: f"127.0.0.1:{free_port()}", DOWN: f"127.0.0.1:{free_port()}"}
    channel = CountingChannels()
    gates = MemberGates()
    held_at_release: dict[int, int] = {}

    def down_copy_end(partition: int) -> int:
        try:
            return int(stores[DOWN].flushed_offset(("orders", partition), SEG))
        except UnknownSegment:
            return -1

    async def run() -> None:
        with ThreadPoolExecutor(4) as executor:
            async with member_servers() as servers:
                servers.append(await serve_member(stores[LIVE], executor, addresses[LIVE]))
                writers: list[tuple[SegmentWriter, PartitionLead]] = []
                for p in range(SEGMENTS):
                    segment = SegmentToWrite(
                        ("orders", p), SEG, BASE, {A: OriginSeq(0)}, (LEADER, LIVE, DOWN), 3, LeaderEpoch(1)
                    )
                    writers.append(
                        solo_writer(
                            stores[LEADER], segment, LEADER, addresses, executor, lambda: 0, None, channel, gates
                        )
                    )
                for writer, _ in writers:
                    await writer.start()
                ends = [await writer.append(batch) for writer, _ in writers]
                released = []
                for p, ((writer, _), end) in enumerate(zip(writers, ends, strict=True)):
                    fut = writer.confirmed(end)
                    fut.add_done_callback(lambda f, p=p: held_at_release.setdefault(p, down_copy_end(p)))
                    released.append(fut)
                await until(
                    "the live member holds every write",
                    lambda: all(
                        lead.quorum is not None and lead.quorum.member_end(LIVE) == end
                        for (_, lead), end in zip(writers, ends, strict=True)
                    ),
                )
                gates.set_dead([DOWN])
                gate = gates[DOWN]
                await until("every writer waits at the gate", lambda: gate.waiting == SEGMENTS and not gate.probing)
                opened = channel.opened[addresses[DOWN]]
                assert opened <= SEGMENTS + gate.probes  # the first wave, then one probe at a time
                assert not any(f.done() for f in released)  # two of three members hold the writes: not a quorum

                servers.append(await serve_member(stores[DOWN], executor, addresses[DOWN]))
                gates.set_dead([])
                async with asyncio.timeout(WAIT_S):
                    await asyncio.gather(*released)
                assert held_at_release == dict.fromkeys(range(SEGMENTS), ends[0])
                for writer, _ in writers:
                    await writer.close()

    asyncio.run(run())
