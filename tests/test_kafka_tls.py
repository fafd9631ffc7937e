"""The Kafka listener of a TLS node (issue 13 over issue 12): mutual TLS with the node's own certificates, the
principal from the client certificate, and the site's ACLs for every request: client:admin (a super-user)
produces and consumes, client:bob (no ACL entry) is refused with Kafka's authorization error codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from georep.auth.principal import site_principal
from georep.security.tls import TlsConfig
from georep.server.process import NodeProcess
from tests.support.kafka_nodes import KAFKA_ARGS, kafka_address, poll_until

confluent_kafka = pytest.importorskip("confluent_kafka")


def ssl_config(certs: Path, name: str) -> dict[str, str]:
    return {
        "security.protocol": "SSL",
        "ssl.ca.location": str(certs / "ca.crt"),
        "ssl.certificate.location": str(certs / f"client-{name}.crt"),
        "ssl.key.location": str(certs / f"client-{name}.key"),
    }


def test_tls_listener_authenticates_and_authorizes(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    subprocess.run(
        [sys.executable, "-m", "georep.cli", "certs", "init", "--dir", str(certs), "--sites", "a", "--clients", "bob"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    node = NodeProcess(
        site="a", data_dir=tmp_path / "a", extra_args=KAFKA_ARGS, tls=TlsConfig.from_dir(certs, site_principal("a"))
    )
    node.start()
    try:
        bootstrap = kafka_address(node)
        admin_cfg = {"bootstrap.servers": bootstrap, **ssl_config(certs, "admin")}
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient(admin_cfg)
        admin.create_topics([NewTopic("secure", 1, 1)])["secure"].result(15)
        p = confluent_kafka.Producer({**admin_cfg, "enable.idempotence": True, "acks": "all"})
        p.produce("secure", value=b"hello")
        assert p.flush(30) == 0
        c = confluent_kafka.Consumer({**admin_cfg, "group.id": "sg", "auto.offset.reset": "earliest"})
        c.subscribe(["secure"])
        got: list[bytes] = []

        def step() -> None:
            m = c.poll(0.2)
            if m is not None and m.error() is None:
                got.append(m.value())

        poll_until("client:admin read its record over TLS", step, lambda: got == [b"hello"])
        c.close()
        # client:bob has a certificate from the CA but no ACL entry: every topic request is refused.
        errors: list[object] = []
        bob = confluent_kafka.Producer(
            {"bootstrap.servers": bootstrap, **ssl_config(certs, "bob"), "message.timeout.ms": 10_000}
        )
        bob.produce("secure", value=b"no", on_delivery=lambda err, msg: errors.append(err))
        bob.flush(30)
        assert len(errors) == 1 and errors[0] is not None
        assert errors[0].code() == confluent_kafka.KafkaError.TOPIC_AUTHORIZATION_FAILED  # type: ignore[attr-defined]
        # A client without a certificate does not get through the handshake.
        plain = AdminClient(
            {
                "bootstrap.servers": bootstrap,
                "security.protocol": "SSL",
                "ssl.ca.location": str(certs / "ca.crt"),
                "socket.timeout.ms": 3000,
            }
        )
        with pytest.raises(confluent_kafka.KafkaException):
            plain.list_topics(timeout=5)
    finally:
        node.kill9()
