"""Limits on a multi-node site's Raft port before authentication (issue 20, item 5).

A process without the site's Raft secret can neither make a node buffer a huge frame nor hold its connections open,
and meanwhile the group keeps its leader and keeps committing. Three real pysyncobj stores on 127.0.0.1 in this
process, their ports sealed with a secret; the attacker is a plain socket that knows only the frame format.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.site_state import Applied, CreateTopic
from georep.metadata.topics import TopicSpec
from georep.security.raft_secret import new_secret
from tests.support.raft import Site, ok, wait_until

HUGE_FRAME = struct.pack("<i", 2**31 - 1)  # pysyncobj's frame header: a native int, the length that follows
ATTACK_BYTES = 24 << 20  # streamed after the header, per connection; the node must close long before
# What the node may take before it closes: its frame bound before authentication plus the socket buffers of both
# ends (the attacker's send buffer is kept small). Today's pysyncobj takes all of ATTACK_BYTES.
CLOSED_WITHIN_BYTES = 2 << 20
ROUNDS_MAX = 5_000  # attack connections, one after the other, until the group has committed COMMITS commands
COMMITS = 20
FLOOD_PER_PORT = 80  # idle connections opened to each node's Raft port
PENDING_MAX = 32  # what a node may keep of them: idle connections that never authenticated


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    s = Site(tmp_path, password=new_secret())
    yield s
    s.close()


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssPeak:
    """The highest resident size of this process (the three nodes) while it runs, sampled every 10 ms."""

    def __init__(self) -> None:
        self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(5)


def connect(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)  # so that what was sent is what the node took
    sock.settimeout(5.0)
    sock.connect((host, int(port)))
    return sock


def stream_huge_frame(address: str, chunk: bytes) -> tuple[int, str]:
    """Announce a frame of 2^31-1 bytes and stream random bytes until the node closes the connection or
    ATTACK_BYTES are sent. Returns the bytes sent and how it ended: ``closed`` (by the node), ``stalled`` (the node
    stopped reading without closing), or ``accepted`` (it took everything)."""
    sent = 0
    with connect(address) as sock:
        try:
            sock.sendall(HUGE_FRAME)
            while sent < ATTACK_BYTES:
                sent += sock.send(chunk)
        except (BrokenPipeError, ConnectionResetError):
            return sent, "closed"
        except TimeoutError:
            return sent, "stalled"
    return sent, "accepted"


def test_a_huge_frame_without_the_secret_is_refused_at_its_header_while_the_group_commits(site: Site) -> None:
    site.start()
    leader = site.leader()
    proposer = site[(leader + 1) % 3]
    ok(proposer.propose(CreateTopic(TopicSpec("before", 1))))
    baseline = rss_bytes()
    rounds: list[tuple[int, str]] = []
    results: list[object] = []
    done = threading.Event()

    def attack() -> None:  # at the leader: a stalled leader costs the whole group its commits
        chunk = os.urandom(1 << 16)
        while not done.is_set() and len(rounds) < ROUNDS_MAX:
            rounds.append(stream_huge_frame(site.addresses[leader], chunk))
            if rounds[-1][1] != "closed":
                break  # today's code: no point in sending more, the test fails on it

    with RssPeak() as rss:
        attacker = threading.Thread(target=attack, daemon=True)
        attacker.start()
        for n in range(COMMITS):  # through a follower, so that every commit needs the leader
            if rounds and rounds[-1][1] != "closed":
                break
            try:
                results.append(proposer.propose(CreateTopic(TopicSpec(f"during-{n}", 1))))
            except Exception as e:  # reported below with the rounds, not lost
                results.append(e)
        done.set()
        attacker.join(30)
    assert not attacker.is_alive(), "the attacker is still sending"

    worst = max(sent for sent, _ in rounds)
    assert all(outcome == "closed" for _, outcome in rounds) and worst <= CLOSED_WITHIN_BYTES, (
        f"the node did not close a connection that announced a 2 GiB frame within {CLOSED_WITHIN_BYTES} bytes: "
        f"rounds (bytes sent, outcome): {rounds[:5]}"
    )
    failed = [r for r in results if not isinstance(r, Applied)]
    assert len(results) == COMMITS and not failed, f"commits during the attack: {results}"
    assert site.leader() == leader, "the group lost its leader to the attack"
    grown = rss.peak - baseline
    assert grown < ATTACK_BYTES // 2, f"the process grew by {grown >> 20} MiB during the attack"
    assert len(site.converged()["topics"]) == 1 + COMMITS  # type: ignore[arg-type]


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


@pytest.mark.slow
def test_idle_connections_without_the_secret_are_capped_and_timed_out_while_members_reconnect(site: Site) -> None:
    site.start()
    leader = site.leader()
    follower = (leader + 1) % 3
    flood = [connect(address) for address in site.addresses for _ in range(FLOOD_PER_PORT)]
    try:
        for sock in flood[::2]:
            sock.sendall(HUGE_FRAME[:2])  # half a frame header: a slow client rather than a silent one
        for sock in flood:
            sock.setblocking(False)

        def open_count() -> int:
            return sum(not closed_by_peer(sock) for sock in flood)

        wait_until(
            lambda: open_count() <= 3 * PENDING_MAX,
            f"each node keeps at most {PENDING_MAX} of the {FLOOD_PER_PORT} connections it got",
        )
        # a member that restarts during the flood reconnects, catches up and counts again
        site.stop(follower, snapshot=False)
        ok(site[leader].propose(CreateTopic(TopicSpec("while-one-is-down", 1))))
        site.start(follower)
        ok(site[follower].propose(CreateTopic(TopicSpec("after-its-restart", 1))))
        assert len(site.converged()["topics"]) == 2  # type: ignore[arg-type]
        assert site.leader() == leader
        wait_until(
            lambda: open_count() == 0,
            "the nodes close every connection that did not authenticate in time",
            timeout_s=30,
        )
    finally:
        for sock in flood:
            sock.close()
    ok(site[follower].propose(CreateTopic(TopicSpec("after-the-flood", 1))))
