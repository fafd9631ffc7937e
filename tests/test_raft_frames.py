"""The Raft port's frame bounds (georep/raft/frames.py) and one guarded connection (georep/raft/transport.py).

The bound after authentication must hold every message a member sends (else the group would cut its own
connections); it is checked against the largest messages pysyncobj builds under georep's configuration, sealed the
way pysyncobj seals them. The connection is driven over a socketpair with pysyncobj's poller.
"""

from __future__ import annotations

import os
import socket
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pysyncobj.pickle as syncobj_pickle
import pytest
from pysyncobj.encryptor import getEncryptor
from pysyncobj.poller import createPoller
from pysyncobj.tcp_connection import CONNECTION_STATE

from cluster.site_state import PutAcl
from georep.metadata.store import AclRecord
from georep.raft.frames import (
    APPEND_BATCH_BYTES,
    COMMAND_BYTES_MAX,
    DUMP_CHUNK_BYTES,
    FRAME_BYTES_BEFORE_AUTH,
    FrameBounds,
    frame_length_fault,
)
from georep.raft.store import CommandTooLarge, RaftMetadataStore
from georep.raft.transport import GuardedConnection
from georep.security.raft_secret import new_secret
from tests.support.ports import free_ports
from tests.support.raft import FAST

SECRET = new_secret()
BIG_INDEX = 2**62  # indexes and terms as large as they get, for the longest pickles


def sealed_frame(message: Any, rand_key: bytes | None = None) -> bytes:
    """What pysyncobj's TcpConnection.send writes for ``message`` on a port with ``SECRET``."""
    if rand_key is not None:
        message = (rand_key, message)
    token = getEncryptor(SECRET).encrypt_at_time(zlib.compress(syncobj_pickle.dumps(message), 3), 1)
    return struct.pack("i", len(token)) + token


def append(entries: list[tuple[bytes, int, int]]) -> dict[str, Any]:
    return {
        "type": "append_entries",
        "term": BIG_INDEX,
        "commit_index": BIG_INDEX,
        "entries": entries,
        "prevLogIdx": BIG_INDEX,
        "prevLogTerm": BIG_INDEX,
    }


def worst_messages() -> Iterator[tuple[str, dict[str, Any]]]:
    """The largest messages of each kind a member sends (georep.raft.frames' docstring), with bytes that pickle to
    two bytes each and do not compress."""
    rand = os.urandom
    yield "a batch of no-ops", append([(b"\x00", BIG_INDEX + i, BIG_INDEX) for i in range(APPEND_BATCH_BYTES)])
    small = [(bytes(b | 0x80 for b in rand(100)), BIG_INDEX + i, BIG_INDEX) for i in range(APPEND_BATCH_BYTES // 100)]
    last = (bytes(b | 0x80 for b in rand(COMMAND_BYTES_MAX)), BIG_INDEX, BIG_INDEX)
    yield "a batch closed by the largest command", append([*small, last])
    yield "a piece of the dump", {**append([]), "serialized": (rand(DUMP_CHUNK_BYTES), True, False)}
    yield "a forwarded command", {"type": "apply_command", "command": rand(COMMAND_BYTES_MAX), "request_id": 2**62}


@pytest.mark.parametrize(("what", "message"), list(worst_messages()), ids=lambda v: v if isinstance(v, str) else "")
def test_the_largest_message_of_each_kind_fits_the_bound_after_authentication(
    what: str, message: dict[str, Any]
) -> None:
    bounds = FrameBounds.for_port(sealed=True)
    frame = sealed_frame(message, rand_key=os.urandom(32))
    assert len(frame) - 4 <= bounds.after_auth, f"{what}: {len(frame) - 4} bytes"
    assert len(syncobj_pickle.dumps(message)) <= bounds.payload
    assert bounds.after_auth < 4 << 20  # a member's frames stay a few MiB, far from 2 GiB


def test_a_handshake_fits_the_bound_before_authentication() -> None:
    assert len(sealed_frame(os.urandom(32))) - 4 <= FRAME_BYTES_BEFORE_AUTH


def test_a_header_over_the_bound_or_negative_is_refused() -> None:
    assert frame_length_fault(100, 100) is None
    assert frame_length_fault(101, 100) == "a frame of 101 bytes, over the 100 this connection accepts"
    assert frame_length_fault(-1, 100) == "a frame header announcing -1 bytes"


class Pair:
    """A GuardedConnection on one end of a socketpair, the test on the other."""

    def __init__(self) -> None:
        self.poller = createPoller("poll")
        ours, self.peer = socket.socketpair()
        ours.setblocking(False)
        self.messages: list[Any] = []
        self.refused: list[str] = []
        self.conn = GuardedConnection(
            self.poller, FrameBounds.for_port(sealed=True), lambda _conn, why: self.refused.append(why), sock=ours
        )
        self.conn.encryptor = getEncryptor(SECRET)
        self.conn.setOnMessageReceivedCallback(self.messages.append)

    def feed(self, data: bytes) -> None:
        self.peer.sendall(data)
        for _ in range(10):
            self.poller.poll(0.01)

    def closed(self) -> bool:
        return self.conn.state == CONNECTION_STATE.DISCONNECTED


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.conn.disconnect()
    p.peer.close()


def test_a_sealed_key_then_a_member_sized_frame_pass(pair: Pair) -> None:
    key = os.urandom(32)
    pair.feed(sealed_frame(key))
    assert pair.messages == [key] and not pair.closed()
    pair.conn.recvRandKey = our_key = os.urandom(32)  # what pysyncobj's handshake does next
    entries = [(os.urandom(200), i, 1) for i in range(APPEND_BATCH_BYTES // 200)]
    pair.feed(sealed_frame(append(entries), rand_key=our_key))
    assert pair.messages[-1] == append(entries) and not pair.closed()


def test_a_frame_over_the_bound_before_authentication_closes_at_its_header(pair: Pair) -> None:
    pair.feed(struct.pack("i", FRAME_BYTES_BEFORE_AUTH + 1) + b"x" * 1000)
    assert pair.closed() and pair.messages == []
    assert pair.refused == [
        f"a frame of {FRAME_BYTES_BEFORE_AUTH + 1} bytes, over the {FRAME_BYTES_BEFORE_AUTH} this connection accepts"
    ]


def test_a_frame_not_sealed_with_the_secret_closes(pair: Pair) -> None:
    token = getEncryptor(new_secret()).encrypt_at_time(zlib.compress(syncobj_pickle.dumps(["status"]), 3), 1)
    pair.feed(struct.pack("i", len(token)) + token)
    assert pair.closed() and pair.messages == []


def test_a_message_that_decompresses_past_the_largest_one_closes(pair: Pair) -> None:
    pair.feed(sealed_frame(os.urandom(32)))  # authenticated: member-sized frames from now on
    bomb = zlib.compress(b"\x00" * (FrameBounds.for_port(sealed=True).payload + 1), 9)
    token = getEncryptor(SECRET).encrypt_at_time(bomb, 2)
    pair.feed(struct.pack("i", len(token)) + token)
    assert pair.closed() and pair.refused and "decompresses past" in pair.refused[0]


def test_a_command_over_the_bound_is_refused_before_it_is_proposed(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_ports(1)[0]}"
    with RaftMetadataStore(address, [], tmp_path, FAST) as store:
        record = AclRecord("client:x write topic:" + "t" * COMMAND_BYTES_MAX, True, 1, "a")
        with pytest.raises(CommandTooLarge, match=f"over the {COMMAND_BYTES_MAX} bytes a metadata command may take"):
            store.propose(PutAcl(record))


def test_a_reconnect_without_a_disconnect_closes_the_previous_socket() -> None:
    """A connect replaced the socket of a connect still in progress, leaving it to the garbage collector (a
    ResourceWarning in a later, unrelated test); the previous socket must be closed at once."""
    poller = createPoller("poll")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    conn = GuardedConnection(poller, FrameBounds.for_port(sealed=False), lambda _conn, _why: None, trusted=True)
    try:
        assert conn.connect("127.0.0.1", port)
        first = conn._socket
        assert first is not None
        assert conn.connect("127.0.0.1", port)
        assert first.fileno() == -1, "the first connect's socket is still open"
    finally:
        conn.disconnect()
        listener.close()
