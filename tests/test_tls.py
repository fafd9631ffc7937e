"""Mutual TLS with real processes (issue 12): who gets in, what a refused client is told, two TLS sites
replicating, and a rotated server certificate taken without a restart."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509

from georep.auth.principal import client_principal, site_principal
from georep.client import Admin, Consumer, Producer
from georep.client.errors import TlsRefused
from georep.security import dev_ca
from georep.security.tls import TlsConfig
from georep.server.process import NodeProcess
from offsets.commits import OFFSETS_TOPIC
from tests.support.cli import georep
from tests.support.sites import Sites, check_invariants, converged, produce, wait_until

SITE_A = site_principal("a")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The node's CA (site:a, client:admin, client:alice) and another CA with its own client:alice."""
    root = tmp_path_factory.mktemp("pki")
    dev_ca.init(root / "certs", dev_ca.plan(["a"], {}, ["alice"]))
    dev_ca.init(root / "other", dev_ca.plan([], {}, ["alice"]))
    return root / "certs", root / "other"


@pytest.fixture(scope="module")
def node(pki: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    certs, _ = pki
    proc = NodeProcess(
        site="a", data_dir=tmp_path_factory.mktemp("node") / "a", tls=TlsConfig.from_dir(certs, SITE_A)
    ).start()
    yield proc
    proc.stop()


async def _topics(address: str, tls: TlsConfig | None) -> list[str]:
    async with Admin(address, tls=tls, connect_timeout_ms=3_000) as admin:
        return [t.name for t in await admin.list_topics()]


def test_a_client_with_a_ca_signed_certificate_produces_and_consumes(node: NodeProcess, pki: tuple[Path, Path]) -> None:
    tls = TlsConfig.from_dir(pki[0])  # client:admin

    async def roundtrip() -> list[bytes | None]:
        async with Admin(node.address, tls=tls) as admin:
            await admin.create_topic("secure", 1)
        async with Producer(node.address, tls=tls) as producer:
            await producer.send("secure", b"over mTLS")
        async with Consumer(node.address, tls=tls, auto_offset_reset="earliest") as consumer:
            consumer.assign([("secure", 0)])
            return [r.value for r in await consumer.poll(timeout_ms=5_000)]

    assert asyncio.run(roundtrip()) == [b"over mTLS"]


def test_clients_without_a_trusted_certificate_are_refused_with_what_to_pass(
    node: NodeProcess, pki: tuple[Path, Path], tmp_path: Path
) -> None:
    certs, other = pki
    with pytest.raises(TlsRefused) as no_cert:
        asyncio.run(_topics(node.address, None))
    assert "requires TLS with a client certificate" in no_cert.value.message
    assert "--tls-dir" in no_cert.value.message
    foreign = TlsConfig(certs / "ca.crt", other / "client-alice.crt", other / "client-alice.key")
    with pytest.raises(TlsRefused) as wrong_ca:
        asyncio.run(_topics(node.address, foreign))
    assert "refused this client's certificate" in wrong_ca.value.message
    with pytest.raises(TlsRefused) as untrusted:
        asyncio.run(_topics(node.address, TlsConfig.from_dir(other, client_principal("alice"))))
    assert "does not trust" in untrusted.value.message  # the client refuses a node signed by a CA it does not know

    # the command line says the same, and works with the directory 'georep certs init' wrote
    env = {"GEOREP_TLS_DIR": ""}
    refused = subprocess.run(
        [sys.executable, "-m", "georep.cli", "topic", "list", "--bootstrap", node.address],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=_env(env),
    )
    assert refused.returncode == 1 and "--tls-dir" in refused.stderr and "Traceback" not in refused.stderr
    listed = georep("topic", "list", "--bootstrap", node.address, "--tls-dir", str(certs), env=env)
    assert listed.returncode == 0, listed.stderr.decode()


def _env(extra: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **extra}


def _server_serial(address: str, certs: Path) -> int:
    host, _, port = address.rpartition(":")
    context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    context.load_cert_chain(str(certs / "client-admin.crt"), str(certs / "client-admin.key"))
    with (
        socket.create_connection((host, int(port)), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname=host) as conn,
    ):
        der = conn.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def test_a_rotated_server_certificate_is_served_without_a_restart(node: NodeProcess, pki: tuple[Path, Path]) -> None:
    certs = pki[0]
    before = _server_serial(node.address, certs)
    pid = node.pid
    dev_ca.init(certs, dev_ca.plan(["a"], {}, []), renew=[SITE_A])
    renewed = x509.load_pem_x509_certificate((certs / "site-a.crt").read_bytes()).serial_number
    assert renewed != before
    assert _server_serial(node.address, certs) == renewed  # the next handshake presents the new certificate
    assert node.pid == pid and node.alive()
    assert OFFSETS_TOPIC in asyncio.run(_topics(node.address, TlsConfig.from_dir(certs)))  # calls go on over it


def test_two_tls_sites_replicate(tmp_path: Path) -> None:
    sites = Sites(tmp_path, ["a", "b"], [("a", "b"), ("b", "a")], tls_dir=tmp_path / "certs")
    try:
        sites.start()
        tls = sites.tls

        async def write() -> set[tuple[bytes, bytes]]:
            async with Admin(sites.address("a"), tls=tls) as admin:
                await admin.create_topic("t", 2)
            wait_until("b has the topic", lambda: sites.vectors("b", "t") != {})
            return await produce(sites.address("a"), "t", "a", 200, tls=tls) | await produce(
                sites.address("b"), "t", "b", 200, tls=tls
            )

        sent = asyncio.run(write())
        wait_until("a and b converge over mutual TLS", lambda: converged(sites, ["a", "b"], "t", len(sent)))
        check_invariants(sites, ["a", "b"], "t", sent)
    finally:
        sites.close()


def test_a_node_needs_tls_files_or_an_explicit_insecure(tmp_path: Path) -> None:
    neither = georep("node", "--site", "a", "--data-dir", str(tmp_path / "n"), "--listen", "127.0.0.1:0")
    assert neither.returncode == 2
    assert b"--tls-ca, --tls-cert and --tls-key" in neither.stderr and b"--insecure" in neither.stderr
    plain = NodeProcess(site="a", data_dir=tmp_path / "plain").start()  # NodeProcess passes --insecure
    try:
        assert "serving plaintext, without TLS and without ACLs" in (plain.data_dir / "node.log").read_text()
        certs = tmp_path / "certs"
        dev_ca.init(certs, dev_ca.plan([], {}, []))
        with pytest.raises(TlsRefused) as refused:
            asyncio.run(_topics(plain.address, TlsConfig.from_dir(certs)))
        assert "does not speak TLS" in refused.value.message and "--insecure" in refused.value.message
    finally:
        plain.stop()
