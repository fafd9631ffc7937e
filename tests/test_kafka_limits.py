"""Limits before authentication on the node's listeners (issue 20, item 6): the Kafka port refuses a frame over
512 KiB before SASL authentication as soon as its size is read, closes connections idle past
``--connections-max-idle-ms`` (a half-sent frame is no activity), refuses connections over its bounds at accept,
and stops quietly; the gRPC port has the same connection bounds, and the metrics port serves a few connections at
once. The pure decisions: test_kafka_connections.py."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from kafka.protocol.consumer import FetchRequest
from kafka.protocol.metadata import ApiVersionsRequest

from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.server.process import NodeProcess
from tests.support.kafka_nodes import KAFKA_ARGS, kafka_address, poll_until, read_frame
from tests.support.sites import wait_until

BEFORE_AUTH = 512 << 10
FLOOD_FRAME_BYTES = 99 << 20
# What the kernel may take from a sender beyond what the node read before it closed: the node socket's receive
# buffer before autotuning grows it (autotuning follows what the application reads) and this side's send buffer.
SOCKET_SLACK_BYTES = 4 << 20
CHUNK = b"\0" * (64 << 10)


def georep_ok(*args: str, stdin: str | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "georep.cli", *args], capture_output=True, text=True, timeout=60, input=stdin
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def connect(address: str, source: str = "127.0.0.1") -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10, source_address=(source, 0))
    return sock


def api_versions(sock: socket.socket, correlation_id: int = 1) -> None:
    """One ApiVersions round trip: the connection is served."""
    request = ApiVersionsRequest[0]()
    request.with_header(correlation_id=correlation_id, client_id="raw")
    sock.sendall(request.encode(header=True, framed=True))
    assert int.from_bytes(read_frame(sock)[:4], "big") == correlation_id


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the node closed ``sock`` (anything it still sends first, a GOAWAY, is read and dropped)."""
    sock.settimeout(0.1)
    try:
        while True:
            if not sock.recv(1 << 16):
                return True
    except TimeoutError:
        return False
    except OSError:  # reset
        return True


def node_log(node: NodeProcess) -> str:
    return (node.data_dir / "node.log").read_text(errors="replace")


@pytest.fixture
def sasl_node(start_node: Any) -> Iterator[NodeProcess]:
    """An --insecure node whose Kafka port takes SASL_PLAINTEXT, and its user alice."""
    node: NodeProcess = start_node(extra_args=[*KAFKA_ARGS, "--kafka-sasl", "scram"])
    admin = ["--bootstrap", node.address, "--insecure"]
    georep_ok("user", "add", "alice", *admin, stdin="alice-secret\n")
    georep_ok("topic", "create", "t", "--partitions", "1", *admin)
    georep_ok("acl", "add", "client:alice", "produce,consume", "topic:t", *admin)
    georep_ok("acl", "add", "client:alice", "read", "group:g", *admin)
    yield node


def flood(
    address: str, stop: threading.Event, rounds: list[int], worst: list[int], failures: list[str], index: int
) -> None:
    """Unauthenticated connections, again and again, each the header of a 99 MiB frame and then its bytes until
    the node closes the socket; ``worst[index]``: the most bytes of one frame the node let this thread send."""
    cap = BEFORE_AUTH + SOCKET_SLACK_BYTES
    while not stop.is_set():
        sock = connect(address)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        sent = 0
        try:
            sock.sendall(FLOOD_FRAME_BYTES.to_bytes(4, "big"))
            while sent <= cap:
                sock.sendall(CHUNK)
                sent += len(CHUNK)
            failures.append(f"a connection still open after {sent} bytes of an unauthenticated frame")
            return
        except TimeoutError:
            failures.append(f"the node neither read nor closed a connection after {sent} bytes")
            return
        except OSError:
            pass  # closed by the node
        finally:
            sock.close()
        worst[index] = max(worst[index], sent)
        rounds[index] += 1


@pytest.mark.slow
def test_unauthenticated_frames_are_cut_at_512_kib_while_an_authenticated_client_works(
    sasl_node: NodeProcess, tmp_path: Path
) -> None:
    confluent_kafka = pytest.importorskip("confluent_kafka")
    bootstrap = kafka_address(sasl_node)
    alice = {
        "bootstrap.servers": bootstrap,
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanisms": "SCRAM-SHA-512",
        "sasl.username": "alice",
        "sasl.password": "alice-secret",
    }
    stop = threading.Event()
    rounds, worst, failures = [0] * 20, [0] * 20, []  # type: ignore[var-annotated]
    threads = [
        threading.Thread(target=flood, args=(bootstrap, stop, rounds, worst, failures, i), daemon=True)
        for i in range(20)
    ]
    for t in threads:
        t.start()
    try:
        wait_until("every flooding connection was closed once", lambda: all(rounds) or failures, timeout_s=60)
        assert not failures, failures[:3]
        producer = confluent_kafka.Producer({**alice, "acks": "all"})
        for i in range(10):
            producer.produce("t", value=b"v%d" % i)
        assert producer.flush(30) == 0
        consumer = confluent_kafka.Consumer({**alice, "group.id": "g", "auto.offset.reset": "earliest"})
        consumer.subscribe(["t"])
        got: list[bytes] = []

        def step() -> None:
            m = consumer.poll(0.2)
            if m is not None and m.error() is None:
                got.append(m.value())

        poll_until("alice read her 10 records", step, lambda: len(got) == 10 or bool(failures))
        consumer.close()
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not failures, failures[:3]
    assert all(rounds) and max(worst) <= BEFORE_AUTH + SOCKET_SLACK_BYTES
    assert f"a frame of {FLOOD_FRAME_BYTES} bytes before SASL authentication (at most {BEFORE_AUTH}" in node_log(
        sasl_node
    )


@pytest.mark.slow
def test_idle_and_half_sent_connections_are_closed_after_the_idle_time(start_node: Any) -> None:
    node: NodeProcess = start_node(extra_args=[*KAFKA_ARGS, "--connections-max-idle-ms", "2500"])
    address = kafka_address(node)
    quiet = connect(address)
    half_sent = connect(address)
    half_sent.sendall((100).to_bytes(4, "big") + b"x" * 10)  # a frame of 100 bytes, 10 of them sent
    served_then_quiet = connect(address)
    api_versions(served_then_quiet)
    chatty = connect(address)
    grpc_quiet = connect(node.address)  # the gRPC port: HTTP/2 preface and settings, then no call
    grpc_quiet.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000"))
    socks = {"quiet": quiet, "half-sent": half_sent, "served, then quiet": served_then_quiet, "gRPC": grpc_quiet}
    closed: set[str] = set()
    calls = 0

    def idle_ones_closed() -> bool:
        nonlocal calls
        calls += 1
        api_versions(chatty, calls)  # a request every 100 ms: never idle
        closed.update(name for name, sock in socks.items() if name not in closed and closed_by_peer(sock))
        return len(closed) == len(socks)

    wait_until("the idle connections were closed", idle_ones_closed, timeout_s=30)
    api_versions(chatty, 10_000)  # still served
    assert "no request for 2500 ms (--connections-max-idle-ms)" in node_log(node)
    for sock in (*socks.values(), chatty):
        sock.close()


def test_connections_over_the_bounds_are_closed_at_accept(start_node: Any) -> None:
    node: NodeProcess = start_node(
        extra_args=[
            *KAFKA_ARGS,
            "--kafka-max-connections",
            "3",
            "--kafka-max-connections-per-ip",
            "2",
            "--grpc-max-connections",
            "2",
        ]
    )
    address = kafka_address(node)
    first, second = connect(address), connect(address)
    api_versions(first)
    api_versions(second)
    third_same_host = connect(address)
    assert closed_by_peer(third_same_host)
    other_host = connect(address, source="127.0.0.2")
    api_versions(other_host)
    over_the_listener = connect(address, source="127.0.0.3")
    assert closed_by_peer(over_the_listener)
    first.close()  # its slot comes back once the node saw it close

    def served_again() -> bool:
        sock = connect(address)
        try:
            api_versions(sock)
            return True
        except (AssertionError, OSError):
            return False
        finally:
            sock.close()

    wait_until("a new connection is served once one closed", served_again)
    log = node_log(node)
    assert "refused the connection from 127.0.0.1:" in log and "(--kafka-max-connections-per-ip)" in log
    assert "3 connections are open, the most this listener takes (--kafka-max-connections)" in log

    channels = [grpc.insecure_channel(node.address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(3)]
    try:
        for ch in channels[:2]:
            assert pbg.NodeStub(ch).Health(pb.HealthRequest(), timeout=10).site == "a"
        with pytest.raises(grpc.RpcError) as refused:
            pbg.NodeStub(channels[2]).Health(pb.HealthRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        for ch in channels:
            ch.close()
    for sock in (second, third_same_host, other_host, over_the_listener):
        sock.close()


def test_sigterm_with_kafka_clients_connected_logs_no_traceback(start_node: Any) -> None:
    node: NodeProcess = start_node(extra_args=KAFKA_ARGS)
    georep_ok("topic", "create", "t", "--partitions", "1", "--bootstrap", node.address, "--insecure")
    address = kafka_address(node)
    served = connect(address)
    api_versions(served)
    half_sent = connect(address)
    half_sent.sendall((100).to_bytes(4, "big") + b"x" * 10)
    fetching = connect(address)  # a fetch waiting for records that never come
    topic = FetchRequest.FetchTopic
    fetch = FetchRequest[4](
        replica_id=-1,
        max_wait_ms=60_000,
        min_bytes=1,
        max_bytes=1 << 20,
        isolation_level=0,
        topics=[
            topic(
                topic="t", partitions=[topic.FetchPartition(partition=0, fetch_offset=0, partition_max_bytes=1 << 20)]
            )
        ],
    )
    fetch.with_header(correlation_id=7, client_id="raw")
    fetching.sendall(fetch.encode(header=True, framed=True))
    api_versions(served, 2)  # a round trip after the fetch was sent: the node has almost surely read it by now
    code = node.stop()  # SIGTERM; SIGKILL after 20 s
    log = node_log(node)
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    assert code == 0 and "stopped cleanly" in log, f"exit {code}: {log[-2000:]}"
    for sock in (served, half_sent, fetching):
        assert closed_by_peer(sock)
        sock.close()


def test_the_metrics_listener_serves_a_few_connections_at_once(node: NodeProcess) -> None:
    import urllib.request

    from georep.server.http_bounds import CONNECTIONS_MAX

    stalled = [connect(node.metrics_address) for _ in range(CONNECTIONS_MAX)]
    for sock in stalled:
        sock.sendall(b"GET /metr")  # a request line that never ends holds its thread
    one_more = connect(node.metrics_address)
    assert closed_by_peer(one_more)
    for sock in (*stalled, one_more):
        sock.close()

    def scraped() -> bool:
        try:
            with urllib.request.urlopen(f"http://{node.metrics_address}/metrics", timeout=5) as resp:
                return b"georep_" in resp.read()
        except OSError:
            return False

    wait_until("the metrics are served again", scraped)
