"""The fault proxy: each toxic's transform of a chunk stream (pure, with ``now_ms``), then the proxy serving the
Toxiproxy API to the unmodified toxiproxy-python client, relaying real TCP connections through its toxics."""

from __future__ import annotations

import random
import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from itertools import pairwise

import pytest
from toxiproxy import Toxiproxy
from toxiproxy.exceptions import InvalidToxic, NotFound, ProxyExists

from georep.faultproxy.toxics import End, Piece, Pipeline, Slicer, ToxicError, ToxicSpec
from tests.support.toxiproxy import create_proxy, toxiproxy_server


def spec(
    kind: str, stream: str = "downstream", toxicity: float = 1.0, name: str | None = None, **attributes: int
) -> ToxicSpec:
    body: dict[str, object] = {"type": kind, "stream": stream, "toxicity": toxicity, "attributes": attributes}
    if name:
        body["name"] = name
    return ToxicSpec.parse(body)


def pipeline(*specs: ToxicSpec, now_ms: float = 0.0, seed: int = 1) -> tuple[Pipeline, End | None]:
    p = Pipeline(random.Random(seed))
    return p, p.update(list(specs), now_ms)


# -- the toxics, pure -------------------------------------------------------------------------


def test_latency_delays_every_chunk_by_latency_plus_or_minus_jitter() -> None:
    p, _ = pipeline(spec("latency", latency=100, jitter=40))
    delays = []
    for i in range(100):
        [piece], end = p.feed(b"x", now_ms=i * 200.0)  # far apart: no chunk waits for the one ahead
        assert end is None
        delays.append(piece.at_ms - i * 200.0)
    assert all(60 <= d < 140 for d in delays)
    assert min(delays) < 70 and max(delays) > 130  # the jitter shows


def test_jitter_never_reorders_the_byte_stream() -> None:
    p, _ = pipeline(spec("latency", latency=100, jitter=40))
    out = []
    for i in range(200):
        out += p.feed(b"%d," % i, now_ms=float(i))[0]  # a chunk every ms: jitter alone would reorder them
    assert b"".join(x.data for x in out) == b"".join(b"%d," % i for i in range(200))
    times = [x.at_ms for x in out]
    assert times == sorted(times)
    assert all(t - i >= 60 for i, t in enumerate(times))


def test_latency_is_a_delay_line_not_a_queue() -> None:
    p, _ = pipeline(spec("latency", latency=100))
    times = [p.feed(b"x" * 65536, now_ms=float(i))[0][0].at_ms for i in range(100)]
    assert times == [100.0 + i for i in range(100)]  # 100 chunks in flight at once: a long fat pipe


def test_bandwidth_drains_at_its_rate_and_slices_big_chunks() -> None:
    p, _ = pipeline(spec("bandwidth", rate=10))  # 10 KB/s: 10 bytes per ms
    [a], _ = p.feed(b"a" * 500, now_ms=0.0)
    [b], _ = p.feed(b"b" * 500, now_ms=10.0)  # queued behind a
    assert (a.at_ms, b.at_ms) == (50.0, 100.0)
    pieces, _ = p.feed(b"c" * 2500, now_ms=1000.0)  # 250 ms of data: slices of 100 ms
    assert [len(x.data) for x in pieces] == [1000, 1000, 500]
    assert [x.at_ms for x in pieces] == [1100.0, 1200.0, 1250.0]


def test_slicer_cuts_chunks_in_order_around_the_average_size() -> None:
    p, _ = pipeline(spec("slicer", average_size=100, size_variation=20, delay=500))
    data = bytes(range(256)) * 40
    pieces, _ = p.feed(data, now_ms=5.0)
    assert b"".join(x.data for x in pieces) == data
    assert len(pieces) > 40
    assert all(0 < len(x.data) <= 140 for x in pieces)
    assert [x.at_ms for x in pieces] == [5.0 + i * 0.5 for i in range(len(pieces))]


def test_slicer_cuts_are_strictly_increasing_even_with_a_large_variation() -> None:
    s = Slicer(3, 50, 0, random.Random(7))
    cuts = s.cuts(0, 1000)
    assert cuts[0] == 0 and cuts[-1] == 1000 and all(a < b for a, b in pairwise(cuts))


def test_timeout_drops_data_and_closes_after_its_timeout_or_when_removed() -> None:
    p, end = pipeline(spec("timeout", timeout=300), now_ms=1000.0)
    assert end == End(1300.0, reset=False)
    assert p.feed(b"lost", 1001.0) == ([], None)
    p, end = pipeline(spec("timeout", timeout=0), now_ms=1000.0)
    assert end is None and p.feed(b"lost", 1001.0) == ([], None)
    assert p.update([], 2000.0) == End(2000.0, reset=False)  # removed: the held connection closes
    assert p.feed(b"x", 2001.0) == ([Piece(2001.0, b"x")], None)


def test_reset_peer_resets_after_the_first_chunk_plus_its_timeout() -> None:
    p, end = pipeline(spec("reset_peer", timeout=50))
    assert end is None
    assert p.feed(b"first", 10.0) == ([], End(60.0, reset=True))
    assert p.feed(b"second", 20.0) == ([], None)


def test_limit_data_closes_once_its_bytes_have_passed() -> None:
    p, _ = pipeline(spec("limit_data", bytes=5))
    assert p.feed(b"abc", 1.0) == ([Piece(1.0, b"abc")], None)
    assert p.feed(b"defgh", 2.0) == ([Piece(2.0, b"de")], End(2.0, reset=False))


def test_toxicity_is_drawn_once_per_connection() -> None:
    hit = 0
    for seed in range(400):
        p, _ = pipeline(spec("reset_peer", toxicity=0.25), seed=seed)
        pieces, end = p.feed(b"x", 0.0)
        assert (end is None) == (pieces == [Piece(0.0, b"x")])
        if end is not None:
            hit += 1
            assert p.feed(b"y", 1.0) == ([], None)  # the same connection stays poisoned
    assert 60 < hit < 140  # about a quarter of 400


def test_changing_one_toxic_keeps_the_others_state() -> None:
    lat = spec("latency", latency=100)
    p, _ = pipeline(lat)
    [first], _ = p.feed(b"a", 0.0)
    p.update([lat, spec("slicer", average_size=1)], 1.0)
    pieces, _ = p.feed(b"bc", -50.0)  # read "earlier" can still not overtake what is in flight
    assert first.at_ms == 100.0 and [x.at_ms for x in pieces] == [100.0, 100.0]
    assert p.update([], 2.0) is None  # removing latency and slicer closes nothing


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"type": "lag"}, "invalid toxic type"),
        ({"type": "latency", "stream": "sideways"}, "invalid stream"),
        ({"type": "latency", "toxicity": 2}, "invalid toxicity"),
        ({"type": "latency", "attributes": {"rate": 1}}, "no attribute 'rate'"),
        ({"type": "bandwidth", "attributes": {"rate": -1}}, "non-negative integer"),
    ],
)
def test_a_bad_toxic_is_refused_with_what_to_send(body: dict[str, object], says: str) -> None:
    with pytest.raises(ToxicError, match=says):
        ToxicSpec.parse(body)


def test_a_toxic_defaults_like_toxiproxy() -> None:
    t = ToxicSpec.parse({"type": "latency", "attributes": {"latency": 5}})
    assert t.as_json() == {
        "name": "latency_downstream",
        "type": "latency",
        "stream": "downstream",
        "toxicity": 1.0,
        "attributes": {"latency": 5, "jitter": 0},
    }


# -- the proxy over real sockets, through toxiproxy-python ---------------------------------------


class Echo(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class EchoHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture
def echo() -> Iterator[str]:
    server = Echo(("127.0.0.1", 0), EchoHandler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def toxiproxy() -> Iterator[Toxiproxy]:
    with toxiproxy_server() as client:
        yield client


def connect(listen: str) -> socket.socket:
    host, _, port = listen.rpartition(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def recv_exactly(s: socket.socket, n: int) -> tuple[bytes, int]:
    """``n`` bytes and how many recv calls they took."""
    out, calls = b"", 0
    while len(out) < n:
        data = s.recv(n - len(out))
        if not data:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += data
        calls += 1
    return out, calls


def test_the_client_manages_proxies_and_toxics(toxiproxy: Toxiproxy, echo: str) -> None:
    proxy = create_proxy(toxiproxy, "echo", echo)
    assert "echo" in toxiproxy.proxies() and toxiproxy.get_proxy("echo").upstream == echo
    with pytest.raises(ProxyExists):
        toxiproxy.create(upstream=echo, name="echo")
    proxy.add_toxic(type="latency", attributes={"latency": 10, "jitter": 5})
    proxy.add_toxic(type="bandwidth", stream="upstream", name="slow", attributes={"rate": 1000}, toxicity=0.5)
    toxics = proxy.toxics()
    assert set(toxics) == {"latency_downstream", "slow"}
    assert (toxics["slow"].stream, toxics["slow"].toxicity, toxics["slow"].attributes) == (
        "upstream",
        0.5,
        {"rate": 1000},
    )
    with pytest.raises(InvalidToxic):
        proxy.add_toxic(type="latency", attributes={"latency": "slow"})
    assert proxy.destroy_toxic("slow") and set(proxy.toxics()) == {"latency_downstream"}
    toxiproxy.reset()
    assert proxy.toxics() == {}
    assert proxy.destroy()
    with pytest.raises(NotFound):
        proxy.destroy()
    assert "echo" not in toxiproxy.proxies()  # (a real Toxiproxy may serve other proxies too)


def test_latency_and_slicer_delay_and_slice_but_keep_every_byte(toxiproxy: Toxiproxy, echo: str) -> None:
    proxy = create_proxy(toxiproxy, "echo", echo)
    proxy.add_toxic(type="latency", stream="upstream", attributes={"latency": 60, "jitter": 20})
    proxy.add_toxic(type="slicer", attributes={"average_size": 64, "size_variation": 16, "delay": 1000})
    data = bytes(random.Random(3).randbytes(8192))
    with connect(proxy.listen) as s:
        start = time.monotonic()
        s.sendall(data)
        got, _calls = recv_exactly(s, len(data))
        elapsed = time.monotonic() - start
    assert got == data
    # Lower bounds only, which load cannot break (a busy reader may take many slices in one recv, so the number of
    # reads proves nothing): at least latency - jitter on the way in, plus about 128 slices of 1 ms on the way out.
    # Without the slicer the trip takes 40-80 ms.
    assert elapsed >= 0.04 + 0.06


def test_bandwidth_keeps_every_byte_in_order(toxiproxy: Toxiproxy, echo: str) -> None:
    proxy = create_proxy(toxiproxy, "echo", echo)
    proxy.add_toxic(type="bandwidth", attributes={"rate": 2000})
    data = bytes(random.Random(4).randbytes(300_000))
    with connect(proxy.listen) as s:
        threading.Thread(target=s.sendall, args=(data,), daemon=True).start()
        got, _ = recv_exactly(s, len(data))
    assert got == data


def test_reset_peer_resets_the_connection_and_removing_it_heals(toxiproxy: Toxiproxy, echo: str) -> None:
    proxy = create_proxy(toxiproxy, "echo", echo)
    proxy.add_toxic(type="reset_peer", stream="upstream", attributes={"timeout": 0})
    with connect(proxy.listen) as s:
        s.sendall(b"hello")
        with pytest.raises(ConnectionResetError):
            s.recv(10)
    proxy.destroy_toxic("reset_peer_upstream")
    with connect(proxy.listen) as s:
        s.sendall(b"hello")
        assert recv_exactly(s, 5)[0] == b"hello"


def test_timeout_holds_a_connection_until_it_is_removed_then_it_closes(toxiproxy: Toxiproxy, echo: str) -> None:
    proxy = create_proxy(toxiproxy, "echo", echo)
    with connect(proxy.listen) as s:
        s.sendall(b"before")
        assert recv_exactly(s, 6)[0] == b"before"
        proxy.add_toxic(type="timeout", attributes={"timeout": 0})
        s.sendall(b"during")
        s.settimeout(0.3)
        with pytest.raises(TimeoutError):
            s.recv(10)  # nothing comes back while the toxic holds the link
        s.settimeout(10)
        proxy.destroy_toxic("timeout_downstream")
        assert s.recv(10) == b""  # the held connection is closed: the client reconnects
    with connect(proxy.listen) as s:
        s.sendall(b"after")
        assert recv_exactly(s, 5)[0] == b"after"


def test_a_timeout_with_a_deadline_closes_the_connection(toxiproxy: Toxiproxy, echo: str) -> None:
    proxy = create_proxy(toxiproxy, "echo", echo)
    proxy.add_toxic(type="timeout", stream="upstream", attributes={"timeout": 100})
    with connect(proxy.listen) as s:
        s.sendall(b"lost")
        assert s.recv(10) == b""


def test_a_disabled_proxy_refuses_connections_until_enabled(toxiproxy: Toxiproxy, echo: str) -> None:
    proxy = create_proxy(toxiproxy, "echo", echo)
    live = connect(proxy.listen)
    with proxy.down():
        assert live.recv(10) == b""  # its connections are closed
        with pytest.raises(ConnectionRefusedError):
            connect(proxy.listen)
        assert toxiproxy.get_proxy("echo").enabled is False
    live.close()
    with connect(proxy.listen) as s:  # listening again, on the same address
        s.sendall(b"back")
        assert recv_exactly(s, 4)[0] == b"back"
