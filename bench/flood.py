"""A node's memory under hostile input: unauthenticated frame floods and decompression bombs (issue 20).

Run from the repository root::

    .venv/bin/python bench/flood.py                        # every phase below, on one node
    .venv/bin/python bench/flood.py --phases flood         # only the unauthenticated flood
    .venv/bin/python bench/flood.py --tls                  # SASL_SSL and mutual-TLS gRPC instead of plaintext

One node of a one-node site (``--kafka-sasl scram``, as tests/test_kafka_sasl.py runs it: SASL_PLAINTEXT on an
``--insecure`` node by default, SASL_SSL with ``--tls``) and its user ``admin``. While each phase runs, a thread
samples the node process's ``VmRSS`` every 20 ms from ``/proc/<pid>/status``, and the kernel's own peak,
``VmHWM``, is read at the end of the phase (reset to the current RSS before each phase through
``/proc/<pid>/clear_refs`` where the kernel allows it, so the peak is the phase's own):

* ``flood``: ``--connections`` (20) unauthenticated Kafka connections each send the 4-byte header of a
  ``--frame-mib`` (99) MiB frame and then its bytes, all but the last, until the node closes the socket; the
  connections that the node did not close are held open together until every one has sent its frame, so the
  node holds them all at once, and then closed.
* ``held``: the worst case within the bounds: ``--held-connections`` (100, the default bound per address)
  unauthenticated connections each send all but the last byte of a 512 KiB frame, the most the node takes
  before authentication, and hold it.
* ``bomb``: a georep batch of one record of ``--bomb-mib`` (1024) MiB of zeros, compressed with zstd to about
  33 KB, sent by gRPC ``Produce`` to a topic whose ``max_batch_bytes`` is 8 MiB. It must be refused.
* ``bomb-fetch`` (only when named in ``--phases``): if the bomb was stored, a Kafka consumer fetches it.
* ``kafka-value``: a Kafka ``Produce`` (SASL-authenticated as ``admin``) of a record batch holding one
  ``--value-mb`` (900) MB value of zeros compressed with zstd. It must be refused with MSG_SIZE_TOO_LARGE.
* ``together``: ``flood``, ``bomb`` and ``kafka-value`` at once, each in its own thread: the node holds what
  all three cost at the same time.

It prints each phase's baseline RSS, its peak RSS and the outcome, then the peak over the whole run; issue
20's target is a peak under 500 MB. A node whose RSS passes ``--kill-above-mb`` (3000) is killed with SIGKILL,
so a node without the bounds cannot take the machine down; the phase then reports the kill.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The repository root first, and not this directory: its kafka.py would shadow kafka-python.
sys.path[:] = [str(Path(__file__).resolve().parent.parent)] + [
    p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent
]

import crc32c  # noqa: E402
import zstandard  # noqa: E402

from georep.auth.principal import site_principal  # noqa: E402
from georep.record.batch import HEADER, HEADER_BYTES, LENGTH_PREFIX_BYTES, MAGIC, RECORD_HEAD  # noqa: E402
from georep.record.compression import Compression  # noqa: E402
from georep.security.tls import TlsConfig  # noqa: E402
from georep.server.process import NodeProcess  # noqa: E402

PHASES = ("flood", "held", "bomb", "bomb-fetch", "kafka-value", "together")
DEFAULT_PHASES = "flood,held,bomb,kafka-value,together"
BEFORE_AUTH_BYTES = 512 << 10
TARGET_MB = 500
PASSWORD = "flood-bench-password"
SAMPLE_S = 0.02
CHUNK = b"\0" * (1 << 20)
KAFKA_ZSTD = 4  # a Kafka record batch's attributes: compression codec 4 is zstd
MSG_SIZE_TOO_LARGE = 10


# -- the node's memory -----------------------------------------------------------------------------------------


def status_kb(pid: int, field_name: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


@dataclass
class Phase:
    name: str
    baseline_mb: float = 0.0
    peak_mb: float = 0.0  # the highest VmRSS sampled
    hwm_mb: float | None = None  # VmHWM at the end (the phase's own when clear_refs reset it)
    outcome: str = ""
    killed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def peak(self) -> float:
        return max(self.peak_mb, self.hwm_mb or 0.0)


class Sampler:
    """Samples the node's VmRSS in a thread; kills the node above ``kill_above_mb``."""

    def __init__(self, pid: int, kill_above_mb: int) -> None:
        self.pid = pid
        self.kill_above_kb = kill_above_mb * 1024
        self.peak_kb = 0
        self.killed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = status_kb(self.pid, "VmRSS")
            if rss is None:
                return
            self.peak_kb = max(self.peak_kb, rss)
            if rss > self.kill_above_kb and not self.killed:
                self.killed = True
                os.kill(self.pid, signal.SIGKILL)
                return
            time.sleep(SAMPLE_S)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@contextmanager
def measured(node: NodeProcess, name: str, kill_above_mb: int, phases: list[Phase]) -> Iterator[Phase]:
    phase = Phase(name)
    pid = node.pid
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM back to the current RSS: this phase's own peak
        reset = True
    except OSError:
        reset = False
    phase.baseline_mb = (status_kb(pid, "VmRSS") or 0) / 1024
    sampler = Sampler(pid, kill_above_mb)
    with sampler:
        try:
            yield phase
        except OSError as exc:
            if not sampler.killed:
                raise
            phase.outcome = f"(the client saw {exc.__class__.__name__})"
        hwm = status_kb(pid, "VmHWM")
    phase.peak_mb = sampler.peak_kb / 1024
    phase.hwm_mb = hwm / 1024 if hwm is not None and reset else None
    if sampler.killed:
        phase.killed = True
        phase.outcome = f"node killed: its RSS passed {kill_above_mb} MB " + phase.outcome
    phases.append(phase)
    print(f"{name:<12} baseline {phase.baseline_mb:7.1f} MB  peak {phase.peak:7.1f} MB  {phase.outcome}", flush=True)


# -- Kafka, raw ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    kafka: str  # HOST:PORT
    ssl_context: ssl.SSLContext | None

    def connect(self, timeout_s: float = 60.0) -> socket.socket:
        host, port = self.kafka.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        if self.ssl_context is None:
            return sock
        return self.ssl_context.wrap_socket(sock, server_hostname=host)


def read_frame(sock: socket.socket) -> bytes:
    def exactly(n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("the node closed the connection")
            out += chunk
        return bytes(out)

    return exactly(int.from_bytes(exactly(4), "big"))


def framed(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


def authenticate(sock: socket.socket, user: str, password: str) -> None:
    """SaslHandshake v0 and SCRAM-SHA-512 as bare frames (RFC 5802's client side)."""
    import base64
    import hashlib
    import hmac

    from kafka.protocol.sasl import SaslHandshakeRequest

    handshake = SaslHandshakeRequest[0](mechanism="SCRAM-SHA-512")
    handshake.with_header(correlation_id=1, client_id="flood-bench")
    sock.sendall(handshake.encode(header=True, framed=True))
    if read_frame(sock)[4:6] != b"\0\0":
        raise RuntimeError("the node refused the SASL handshake")
    first_bare = f"n={user},r=benchnonce"
    sock.sendall(framed(f"n,,{first_bare}".encode()))
    server_first = read_frame(sock).decode()
    fields = dict(part.split("=", 1) for part in server_first.split(","))
    salted = hashlib.pbkdf2_hmac("sha512", password.encode(), base64.b64decode(fields["s"]), int(fields["i"]))
    client_key = hmac.new(salted, b"Client Key", "sha512").digest()
    without_proof = f"c=biws,r={fields['r']}"
    auth = f"{first_bare},{server_first},{without_proof}".encode()
    signature = hmac.new(hashlib.sha512(client_key).digest(), auth, "sha512").digest()
    proof = base64.b64encode(bytes(a ^ b for a, b in zip(client_key, signature, strict=True))).decode()
    sock.sendall(framed(f"{without_proof},p={proof}".encode()))
    if not read_frame(sock).startswith(b"v="):
        raise RuntimeError("SCRAM authentication failed")


# -- the phases ------------------------------------------------------------------------------------------------


def flood(target: Target, connections: int, frame_bytes: int) -> str:
    """Every connection sends a frame header and then the frame's bytes but the last; those the node leaves open
    hold their bytes until all have sent theirs."""
    sent = [0] * connections
    cut = [False] * connections
    socks: list[socket.socket | None] = [None] * connections
    done = threading.Barrier(connections + 1)

    def one(i: int) -> None:
        try:
            sock = target.connect()
            socks[i] = sock
            sock.sendall(frame_bytes.to_bytes(4, "big"))
            left = frame_bytes - 1
            while left > 0:
                n = min(left, len(CHUNK))
                sock.sendall(CHUNK[:n])
                sent[i] += n
                left -= n
        except OSError:
            cut[i] = True
        finally:
            done.wait()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(connections)]
    for t in threads:
        t.start()
    done.wait()  # every connection has sent its frame or was closed: the node holds what it kept
    time.sleep(0.5)  # one more look at the node while it holds it
    for i, sock in enumerate(socks):
        if sock is not None:
            cut[i] = cut[i] or closed_by_peer(sock)  # a small frame may fit in the socket buffers before the close
            sock.close()
    for t in threads:
        t.join()
    closed = sum(cut)
    return (
        f"{closed}/{connections} connections closed by the node; the most one sent before its close: "
        f"{max((s for s, c in zip(sent, cut, strict=True) if c), default=0) / 2**20:.2f} MiB; "
        f"the connections left open held {sum(s for s, c in zip(sent, cut, strict=True) if not c) / 2**20:.0f} "
        "MiB"
    )


def closed_by_peer(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return not sock.recv(1)
    except (BlockingIOError, ssl.SSLWantReadError):
        return False
    except OSError:
        return True


def zstd_of_zeros(prefix: bytes, zeros: int, suffix: bytes) -> bytes:
    """``prefix + zeros * b"\\0" + suffix`` compressed with zstd (the content size in the frame), without ever
    holding the zeros."""
    compressor = zstandard.ZstdCompressor(level=3).compressobj(size=len(prefix) + zeros + len(suffix))
    out = [compressor.compress(prefix)]
    left = zeros
    while left > 0:
        n = min(left, len(CHUNK))
        out.append(compressor.compress(CHUNK[:n]))
        left -= n
    out.append(compressor.compress(suffix))
    out.append(compressor.flush())
    return b"".join(out)


def georep_bomb(value_bytes: int) -> bytes:
    """A producer's georep batch of one record of ``value_bytes`` zeros, the records section zstd-compressed."""
    record_head = RECORD_HEAD.pack(25 + value_bytes, 0, 0, 0, -1) + struct.pack(">i", value_bytes)
    body = zstd_of_zeros(record_head, value_bytes, b"\0\0\0\0")  # no headers
    now_ms = int(time.time() * 1000)
    head = bytearray(
        HEADER.pack(
            0,
            HEADER_BYTES - LENGTH_PREFIX_BYTES + len(body),
            0,
            0,
            MAGIC,
            int(Compression.ZSTD),
            b"",
            0,
            -1,
            0,
            now_ms,
            now_ms,
            -1,
            -1,
            -1,
            1,
        )
    )
    struct.pack_into(">I", head, 20, crc32c.crc32c(body, crc32c.crc32c(bytes(head[24:]))))
    return bytes(head) + body


def kafka_bomb(value_bytes: int) -> bytes:
    """A Kafka record batch v2 of one record of ``value_bytes`` zeros, zstd-compressed."""
    from kafka.record.util import encode_varint

    def varint(n: int) -> bytes:
        out = bytearray()
        encode_varint(n, out.append)
        return bytes(out)

    fields = b"\0" + varint(0) + varint(0) + varint(-1) + varint(value_bytes)  # attributes, ts, offset, no key
    record_prefix = varint(len(fields) + value_bytes + 1) + fields
    body = zstd_of_zeros(record_prefix, value_bytes, varint(0))  # no headers
    now_ms = int(time.time() * 1000)
    after_crc = struct.pack(">hiqqqhii", KAFKA_ZSTD, 0, now_ms, now_ms, -1, -1, -1, 1) + body
    crc = crc32c.crc32c(after_crc)
    return struct.pack(">qiibI", 0, 4 + 1 + 4 + len(after_crc), 0, 2, crc) + after_crc


def grpc_produce(node: NodeProcess, tls: TlsConfig | None, topic: str, batch: bytes) -> str:
    import grpc

    from georep.proto import georep_pb2 as pb
    from georep.proto import georep_pb2_grpc as pbg
    from georep.security.tls import client_channel_sync

    channel = client_channel_sync(node.address, tls)
    sent = f"a batch of {len(batch)} bytes"
    try:
        resp = pbg.NodeStub(channel).Produce(pb.ProduceRequest(topic=topic, partition=0, batch=batch), timeout=300)
        return f"{sent}: STORED ({str(resp).strip().replace(chr(10), ', ')})"
    except grpc.RpcError as exc:
        return f"{sent}: refused: {exc.code().name}: {exc.details()}"
    finally:
        channel.close()


def kafka_produce(target: Target, topic: str, batch: bytes) -> str:
    from kafka.protocol.producer import ProduceRequest, ProduceResponse

    data = ProduceRequest.TopicProduceData
    request = ProduceRequest[8](
        transactional_id=None,
        acks=1,
        timeout_ms=30_000,
        topic_data=[data(name=topic, partition_data=[data.PartitionProduceData(index=0, records=batch)])],
    )
    request.with_header(correlation_id=9, client_id="flood-bench")
    with target.connect(timeout_s=300) as sock:
        authenticate(sock, "admin", PASSWORD)
        sock.sendall(request.encode(header=True, framed=True))
        response = ProduceResponse[8].decode(read_frame(sock)[4:])
    part = response.responses[0].partition_responses[0]
    name = "MSG_SIZE_TOO_LARGE" if part.error_code == MSG_SIZE_TOO_LARGE else f"error code {part.error_code}"
    sent = f"a record batch of {len(batch)} bytes"
    if part.error_code == 0:
        return f"{sent}: STORED at offset {part.base_offset}"
    return f"{sent}: refused: {name}: {part.error_message}"


def fetch_bomb(target: Target, topic: str, ssl_ca: Path | None) -> str:
    from confluent_kafka import Consumer, TopicPartition

    config: dict[str, Any] = {
        "bootstrap.servers": target.kafka,
        "group.id": "flood-bench",
        "security.protocol": "SASL_SSL" if ssl_ca else "SASL_PLAINTEXT",
        "sasl.mechanisms": "SCRAM-SHA-512",
        "sasl.username": "admin",
        "sasl.password": PASSWORD,
        "fetch.max.bytes": 64 << 20,
        "receive.message.max.bytes": 100 << 20,
    }
    if ssl_ca:
        config["ssl.ca.location"] = str(ssl_ca)
    consumer = Consumer(config)
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            m = consumer.poll(1.0)
            if m is None:
                continue
            if m.error() is not None:
                return f"the consumer got {m.error()}"
            return f"the consumer read a record of {len(m.value() or b'')} bytes"
        return "nothing read in 120 s"
    finally:
        consumer.close()


# -- the run ---------------------------------------------------------------------------------------------------


def georep(*args: str, stdin: str | None = None) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "georep.cli", *args], capture_output=True, text=True, timeout=120, input=stdin
    )
    if done.returncode != 0:
        raise RuntimeError(f"georep {' '.join(args)} failed: {done.stderr.strip()}")


def run(args: argparse.Namespace, tmp: Path) -> list[Phase]:
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        raise SystemExit(f"--phases: unknown {', '.join(unknown)}; choose from {', '.join(PHASES)}")
    certs = tmp / "certs"
    tls = None
    admin = ["--insecure"]
    if args.tls:
        georep("certs", "init", "--dir", str(certs), "--sites", "a")
        tls = TlsConfig.from_dir(certs, site_principal("a"))
        admin = ["--tls-dir", str(certs)]
    node = NodeProcess(
        site="a", data_dir=tmp / "a", tls=tls, extra_args=["--kafka-listen", "127.0.0.1:0", "--kafka-sasl", "scram"]
    )
    node.start()
    results: list[Phase] = []
    try:
        admin = ["--bootstrap", node.address, *admin]
        georep("user", "add", "admin", *admin, stdin=PASSWORD + "\n")
        georep("topic", "create", "bomb", "--partitions", "1", "--config", f"max_batch_bytes={8 << 20}", *admin)
        georep("topic", "create", "kv", "--partitions", "1", *admin)
        ssl_context = None
        if args.tls:
            ssl_context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
        target = Target(node.kafka_address, ssl_context)
        admin_tls = TlsConfig.from_dir(certs) if args.tls else None
        steps: dict[str, Callable[[], str]] = {
            "flood": lambda: flood(target, args.connections, args.frame_mib << 20),
            "held": lambda: flood(target, args.held_connections, BEFORE_AUTH_BYTES),
            "bomb": lambda: grpc_produce(node, admin_tls, "bomb", georep_bomb(args.bomb_mib << 20)),
            "bomb-fetch": lambda: fetch_bomb(target, "bomb", certs / "ca.crt" if args.tls else None),
            "kafka-value": lambda: kafka_produce(target, "kv", kafka_bomb(args.value_mb * 1_000_000)),
        }
        steps["together"] = lambda: together([steps["flood"], steps["bomb"], steps["kafka-value"]])
        for name in phases:
            if not node.alive():
                print(f"{name:<12} skipped: the node is not running", flush=True)
                continue
            with measured(node, name, args.kill_above_mb, results) as phase:
                phase.outcome = steps[name]()
    finally:
        if node.alive():
            node.stop()
    return results


def together(steps: list[Callable[[], str]]) -> str:
    """Run ``steps`` at the same time; their outcomes, in order."""
    with ThreadPoolExecutor(len(steps)) as pool:
        return "; ".join(pool.map(lambda step: step(), steps))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--phases",
        default=DEFAULT_PHASES,
        help=f"comma-separated, in order, from {', '.join(PHASES)} (default {DEFAULT_PHASES})",
    )
    parser.add_argument("--connections", type=int, default=20, help="unauthenticated connections (default 20)")
    parser.add_argument("--frame-mib", type=int, default=99, help="the frame each one sends (default 99 MiB)")
    parser.add_argument(
        "--held-connections",
        type=int,
        default=100,
        help="connections of the held phase (default 100, the bound per address)",
    )
    parser.add_argument("--bomb-mib", type=int, default=1024, help="the bomb's record, uncompressed (default 1 GiB)")
    parser.add_argument("--value-mb", type=int, default=900, help="the Kafka value, uncompressed (default 900 MB)")
    parser.add_argument(
        "--kill-above-mb", type=int, default=3000, help="SIGKILL the node if its RSS passes this (default 3000)"
    )
    parser.add_argument("--tls", action="store_true", help="a TLS node: SASL_SSL, mutual-TLS gRPC")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="georep-bench-flood-") as tmp:
        results = run(args, Path(tmp))
    if not results:
        return 1
    overall = max(p.peak for p in results)
    verdict = "under" if overall < TARGET_MB and not any(p.killed for p in results) else "NOT under"
    print(f"\npeak RSS over the run: {overall:.1f} MB ({verdict} the {TARGET_MB} MB target)")
    stored = [p.name for p in results if "STORED" in p.outcome and p.name != "bomb-fetch"]
    if stored:
        print(f"stored, where issue 20 wants a refusal: {', '.join(stored)}")
    if args.json is not None:
        args.json.write_text(
            json.dumps({"phases": [vars(p) | {"peak": p.peak} for p in results], "peak_mb": overall}, indent=2) + "\n"
        )
    return 0 if verdict == "under" and not stored else 1


if __name__ == "__main__":
    sys.exit(main())
