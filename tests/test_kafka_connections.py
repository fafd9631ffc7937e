"""The Kafka listener's pure bounds (issue 20, item 6): the connection table (connections per listener and per
address, idle connections found by one sweep), the log throttle, and a frame bound read per frame before the frame
is kept. The node's side: test_kafka_limits.py."""

from __future__ import annotations

import pytest

from georep.kafka.connections import ConnectionTable, ListenerLimits, LogThrottle, Refused
from georep.kafka.protocol import FrameReader, FrameTooLarge


def admit(table: ConnectionTable, host: str, now_ms: int = 0) -> int:
    conn = table.admit(host, now_ms)
    assert isinstance(conn, int), conn
    return conn


def test_the_table_admits_up_to_its_bounds_and_releases_slots() -> None:
    table = ConnectionTable(ListenerLimits(max_connections=3, max_connections_per_ip=2, idle_ms=1000))
    a1, a2 = admit(table, "10.0.0.1"), admit(table, "10.0.0.1")
    assert a1 != a2
    refused = table.admit("10.0.0.1", 0)
    assert isinstance(refused, Refused) and "--kafka-max-connections-per-ip" in refused.reason
    admit(table, "10.0.0.2")
    full = table.admit("10.0.0.3", 0)
    assert (
        isinstance(full, Refused)
        and "3 connections are open" in full.reason
        and "--kafka-max-connections" in full.reason
    )
    table.release(a1)
    table.release(a1)  # twice: nothing more
    admit(table, "10.0.0.1")
    assert len(table) == 3


def test_idle_connections_are_reported_once_oldest_first_and_never_while_answering() -> None:
    table = ConnectionTable(ListenerLimits(idle_ms=1000, max_connections_per_ip=0))
    quiet, half_sent, busy, chatty = (admit(table, "h") for _ in range(4))
    table.request(busy, 100)  # in flight until answered
    for now in range(0, 2000, 200):
        table.request(chatty, now)
        table.answered(chatty, now)
    assert table.idle(999) == []
    assert table.idle(2000) == [quiet, half_sent]  # the half-sent frame's bytes are no activity: never touched
    assert table.idle(2500) == []  # reported once: the listener is closing them
    table.answered(busy, 2600)
    assert table.idle(2799) == [] and table.idle(2800) == [chatty]  # its last request was at 1800
    assert table.idle(3599) == [] and table.idle(3600) == [busy]


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError):
        ListenerLimits(max_connections=0)
    with pytest.raises(ValueError):
        ListenerLimits(frame_bytes_before_auth=2 << 20, frame_bytes_max=1 << 20)
    assert ListenerLimits(idle_ms=600_000).sweep_interval_ms() == 5_000
    assert ListenerLimits(idle_ms=100).sweep_interval_ms() == 50


def test_the_log_throttle_counts_what_it_leaves_out() -> None:
    throttle = LogThrottle(interval_ms=1000)
    assert throttle.allow(0) == 0
    assert [throttle.allow(t) for t in (1, 500, 999)] == [None, None, None]
    assert throttle.allow(1000) == 3 and throttle.allow(1001) is None


def test_the_frame_bound_is_read_per_frame_before_the_frame_is_kept() -> None:
    reader = FrameReader(max_frame_bytes=10)
    reader.feed(b"\x00\x00\x00\x03ab")
    assert reader.next_frame() is None
    reader.feed(b"c\x00\x00\x00\x0bd")  # a frame of 11 follows: refused only when it is next
    assert reader.next_frame() == b"abc"
    with pytest.raises(FrameTooLarge) as refused:
        reader.next_frame()
    assert (refused.value.size, refused.value.limit) == (11, 10)
    raised = FrameReader(max_frame_bytes=4)
    raised.feed(b"\x00\x00\x00\x01x\x00\x00\x00\x06abcdef")
    assert raised.next_frame() == b"x"
    raised.max_frame_bytes = 6  # authenticated between the two frames
    assert raised.next_frame() == b"abcdef" and raised.next_frame() is None
    with pytest.raises(FrameTooLarge):  # a size header is refused when it arrives, before its frame is kept
        FrameReader(max_frame_bytes=1 << 19).feed(b"\x7f\xff\xff\xff")
