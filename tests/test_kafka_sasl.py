"""SASL/SCRAM on the Kafka listener (issue 13 over issue 12): the SCRAM state machine against RFC 7677's test
vector, the credential derivation and records (stored, replicated and applied as ACL records are), and one
TLS node whose SASL_SSL listener lets confluent-kafka (SCRAM-SHA-512) and kafka-python (SCRAM-SHA-256) users
in as client:<user> under the site's ACLs."""

from __future__ import annotations

import base64
import hashlib
import hmac
import socket
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from kafka.protocol.metadata import MetadataRequest
from kafka.protocol.sasl import SaslHandshakeRequest

from cluster.site_state import PutAcl, SiteState, command_from_dict
from georep.auth import credentials
from georep.auth.acl_sync import effective, merge
from georep.auth.credentials import CredentialLookup
from georep.auth.principal import site_principal
from georep.auth.sasl import MIN_ITERATIONS, ScramCredential, ScramFailed, ScramServer, derive
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.security.acl_pull import record_from_pb
from georep.security.tls import TlsConfig
from georep.server.process import NodeProcess
from georep.storage.metadata_file import FileMetadataStore
from tests.support.kafka_nodes import KAFKA_ARGS, kafka_address, poll_until, read_frame

confluent_kafka = pytest.importorskip("confluent_kafka")

RFC_SALT = base64.b64decode("W22ZaJ0SNY7soEsUEjb6gQ==")
RFC_CLIENT_FIRST = b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO"
RFC_SERVER_NONCE = "%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0"
RFC_CLIENT_FINAL = (
    b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ="
)


def rfc_server(password: str = "pencil") -> ScramServer:
    cred = derive("SCRAM-SHA-256", password, RFC_SALT, 4096)
    return ScramServer("SCRAM-SHA-256", {"user": cred}.get, RFC_SERVER_NONCE)


def test_rfc7677_sha256_exchange() -> None:
    server = rfc_server()
    first = server.step(RFC_CLIENT_FIRST)
    assert first == b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"
    assert server.step(RFC_CLIENT_FINAL) == b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="
    assert server.done and server.user == "user"


def test_wrong_password_and_unknown_user_fail_alike() -> None:
    server = rfc_server("not-pencil")
    server.step(RFC_CLIENT_FIRST)
    with pytest.raises(ScramFailed, match="invalid credentials") as wrong:
        server.step(RFC_CLIENT_FINAL)
    assert not server.done
    with pytest.raises(ScramFailed, match="invalid credentials") as unknown:
        rfc_server().step(b"n,,n=bob,r=abc")
    assert str(wrong.value) == str(unknown.value)
    with pytest.raises(ScramFailed):  # a failed exchange stays failed
        server.step(RFC_CLIENT_FINAL)


def test_tampered_nonce_and_channel_binding_refused() -> None:
    server = rfc_server()
    server.step(RFC_CLIENT_FIRST)
    with pytest.raises(ScramFailed, match="nonce"):
        server.step(RFC_CLIENT_FINAL.replace(b"k0,p", b"k1,p"))
    with pytest.raises(ScramFailed, match="channel binding"):
        rfc_server().step(b"p=tls-unique,,n=user,r=abc")
    server = rfc_server()
    server.step(RFC_CLIENT_FIRST)
    with pytest.raises(ScramFailed, match="channel binding"):
        server.step(RFC_CLIENT_FINAL.replace(b"c=biws", b"c=eSws"))


def test_credential_derivation_and_stored_form() -> None:
    cred = derive("SCRAM-SHA-512", "secret", b"salt" * 4, MIN_ITERATIONS)
    assert len(cred.stored_key) == 64 and len(cred.server_key) == 64
    assert ScramCredential.decode("SCRAM-SHA-512", cred.encode()) == cred
    assert "secret" not in cred.encode()
    assert derive("SCRAM-SHA-512", "other", b"salt" * 4, MIN_ITERATIONS).stored_key != cred.stored_key
    with pytest.raises(ValueError, match="below the minimum"):
        derive("SCRAM-SHA-256", "secret", b"salt", 1000)
    with pytest.raises(ValueError, match="SCRAM-SHA-256, SCRAM-SHA-512"):
        derive("SCRAM-SHA-1", "secret", b"salt", 4096)


# -- credential records: stored, replicated, in Raft commands ----------------------------------------------


def test_credential_records_merge_like_acls_and_stay_out_of_the_acl_entries(tmp_path: Path) -> None:
    cred = derive("SCRAM-SHA-512", "pw", b"s" * 16, MIN_ITERATIONS)
    added = credentials.put(cred, "alice", None, 10, "a")
    assert added.entry == "credential SCRAM-SHA-512 alice" and "pw" not in added.data
    store = FileMetadataStore(tmp_path / "topics.json")
    assert merge(store.acls(), [added]) == [added] and store.put_acl(added)
    assert effective(store.acls()) == []  # a credential is no ACL entry
    assert CredentialLookup(FileMetadataStore(tmp_path / "topics.json").acls)("SCRAM-SHA-512", "alice") == cred
    lookup = CredentialLookup(store.acls)
    assert lookup("SCRAM-SHA-512", "alice") == cred and lookup("SCRAM-SHA-256", "alice") is None
    removed = credentials.remove("SCRAM-SHA-512", "alice", added, 5, "b")  # a slow clock still stamps above
    assert removed.stamp_ms == 11 and merge(store.acls(), [added, removed]) == [removed]
    assert store.put_acl(removed) and lookup("SCRAM-SHA-512", "alice") is None
    state = SiteState()  # a multi-node site: the same record as a Raft command
    assert state.apply(PutAcl(added)).changed  # type: ignore[union-attr]
    assert command_from_dict(PutAcl(added).to_dict()) == PutAcl(added)
    assert SiteState.restore(state.snapshot()).acls() == {added.entry: added}
    with pytest.raises(ValueError, match="invalid user name"):
        credentials.key("SCRAM-SHA-512", "no spaces")


# -- one TLS node with a SASL_SSL Kafka listener ----------------------------------------------------------


def georep(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "georep.cli", *args], capture_output=True, text=True, timeout=60, input=stdin
    )


def sasl_config(certs: Path, bootstrap: str, user: str, password: str) -> dict[str, Any]:
    return {
        "bootstrap.servers": bootstrap,
        "security.protocol": "SASL_SSL",
        "ssl.ca.location": str(certs / "ca.crt"),
        "sasl.mechanisms": "SCRAM-SHA-512",
        "sasl.username": user,
        "sasl.password": password,
    }


def test_sasl_scram_users_produce_consume_and_are_authorized_as_client_principals(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    georep_ok("certs", "init", "--dir", str(certs), "--sites", "a")
    node = NodeProcess(
        site="a",
        data_dir=tmp_path / "a",
        extra_args=[*KAFKA_ARGS, "--kafka-sasl", "scram"],
        tls=TlsConfig.from_dir(certs, site_principal("a")),
    )
    node.start()
    try:
        admin = add_users_and_acls(tmp_path, node, certs)
        bootstrap = kafka_address(node)
        clients_are_authorized(certs, bootstrap)
        a_wrong_password_is_reported(certs, bootstrap)
        frames_before_authentication_close_the_connection(certs, bootstrap)
        credentials_sync_to_a_linked_site(tmp_path, node, certs, admin)
        georep_ok("user", "remove", "carol", "--mechanism", "SCRAM-SHA-256", *admin)
        assert "carol" not in georep_ok("user", "list", *admin)
    finally:
        node.kill9()


def add_users_and_acls(tmp_path: Path, node: NodeProcess, certs: Path) -> list[str]:
    """alice (SCRAM-SHA-512) may create topics, use topic ``open`` and group ``g``; carol (SCRAM-SHA-256) may
    produce to ``open``. Returns the CLI's admin arguments."""
    admin = ["--bootstrap", node.address, "--tls-dir", str(certs)]
    (tmp_path / "alice.pw").write_text("alice-secret\n")
    georep_ok("user", "add", "alice", "--password-file", str(tmp_path / "alice.pw"), *admin)
    georep_ok("user", "add", "carol", "--mechanism", "SCRAM-SHA-256", *admin, stdin="carol-secret\n")
    listed = georep_ok("user", "list", *admin)
    assert "alice  SCRAM-SHA-512" in listed and "carol  SCRAM-SHA-256" in listed and "secret" not in listed
    assert "credential" not in georep_ok("acl", "list", *admin)  # users are not ACL entries
    georep_ok("acl", "add", "client:alice", "create_topic", "topic:**", *admin)
    georep_ok("acl", "add", "client:alice", "produce,consume", "topic:open", *admin)
    georep_ok("acl", "add", "client:alice", "read", "group:g", *admin)
    georep_ok("acl", "add", "client:carol", "produce", "topic:open", *admin)
    return admin


def clients_are_authorized(certs: Path, bootstrap: str) -> None:
    """confluent-kafka as alice and kafka-python as carol produce and consume as their own principals."""
    alice = sasl_config(certs, bootstrap, "alice", "alice-secret")
    from confluent_kafka.admin import AdminClient, NewTopic

    alice_admin = AdminClient(alice)
    for f in alice_admin.create_topics([NewTopic("open", 1, 1), NewTopic("closed", 1, 1)]).values():
        f.result(15)
    # kafka-python with SCRAM-SHA-256.
    from kafka import KafkaProducer

    carol = KafkaProducer(
        bootstrap_servers=bootstrap,
        security_protocol="SASL_SSL",
        ssl_cafile=str(certs / "ca.crt"),
        sasl_mechanism="SCRAM-SHA-256",
        sasl_plain_username="carol",
        sasl_plain_password="carol-secret",
    )
    carol.send("open", b"from-carol").get(timeout=30)
    carol.close()

    errors: list[Any] = []
    p = confluent_kafka.Producer({**alice, "enable.idempotence": True, "acks": "all", "message.timeout.ms": 15_000})
    p.produce("open", value=b"from-alice", on_delivery=lambda err, msg: errors.append(err))
    p.produce("closed", value=b"refused", on_delivery=lambda err, msg: errors.append(err))
    assert p.flush(30) == 0
    codes = sorted((e.code() if e is not None else 0) for e in errors)
    assert codes == [0, confluent_kafka.KafkaError.TOPIC_AUTHORIZATION_FAILED]  # type: ignore[attr-defined]

    c = confluent_kafka.Consumer(
        {**alice, "group.id": "g", "auto.offset.reset": "earliest", "enable.auto.commit": False}
    )
    c.subscribe(["open"])
    got: list[bytes] = []

    def step() -> None:
        m = c.poll(0.2)
        if m is not None and m.error() is None:
            got.append(m.value())

    poll_until("alice read both records", step, lambda: sorted(got) == [b"from-alice", b"from-carol"])
    c.close()


def a_wrong_password_is_reported(certs: Path, bootstrap: str) -> None:
    """A wrong password: the client reports the server's authentication failure."""
    failures: list[Any] = []
    wrong = confluent_kafka.Producer({**sasl_config(certs, bootstrap, "alice", "wrong"), "error_cb": failures.append})
    poll_until(
        "the client reports the failed authentication",
        lambda: wrong.poll(0.2),
        lambda: bool(failures),
        timeout_s=20,
    )
    assert any(
        e.code() == confluent_kafka.KafkaError._AUTHENTICATION  # type: ignore[attr-defined]
        and "invalid credentials" in e.str()
        for e in failures
    ), failures


def frames_before_authentication_close_the_connection(certs: Path, bootstrap: str) -> None:
    """A request before authentication closes the connection (Kafka's rule)."""
    host, port = bootstrap.rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    with (
        socket.create_connection((host, int(port)), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname=host) as tls,
    ):
        request = MetadataRequest[0](topics=[])
        request.with_header(correlation_id=1, client_id="raw")
        tls.sendall(request.encode(header=True, framed=True))
        assert tls.recv(4) == b""
    # SaslHandshake v0: the SCRAM tokens then go as bare frames, and the requests after are served.
    with (
        socket.create_connection((host, int(port)), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname=host) as tls,
    ):
        handshake = SaslHandshakeRequest[0](mechanism="SCRAM-SHA-512")
        handshake.with_header(correlation_id=2, client_id="raw")
        tls.sendall(handshake.encode(header=True, framed=True))
        assert read_frame(tls)[4:6] == b"\x00\x00"  # correlation id, then error code NONE
        client = ScramClient("alice", "alice-secret")
        tls.sendall(frame(client.first()))
        tls.sendall(frame(client.final(read_frame(tls))))
        assert read_frame(tls).startswith(b"v=")
        tls.sendall(request.encode(header=True, framed=True))
        assert int.from_bytes(read_frame(tls)[:4], "big") == 1  # the Metadata response


def credentials_sync_to_a_linked_site(tmp_path: Path, node: NodeProcess, certs: Path, admin: list[str]) -> None:
    """The credential record as a linked site receives it (the ACL sync's ListAcls and merge), and it
    authenticates alice there with a SCRAM exchange."""
    stub = pbg.NodeStub(grpc.secure_channel(node.address, *admin_channel(certs)))
    listed_pb = stub.ListAcls(pb.ListAclsRequest(with_removed=True, with_credentials=True), timeout=10)
    b_store = FileMetadataStore(tmp_path / "b-topics.json")
    for record in merge(b_store.acls(), [record_from_pb(r) for r in listed_pb.records]):
        b_store.put_acl(record)
    assert scram_exchange(CredentialLookup(b_store.acls), "alice", "alice-secret")
    assert not scram_exchange(CredentialLookup(b_store.acls), "alice", "wrong")


def georep_ok(*args: str, stdin: str | None = None) -> str:
    done = georep(*args, stdin=stdin)
    assert done.returncode == 0, done.stderr
    return done.stdout


def admin_channel(certs: Path) -> tuple[grpc.ChannelCredentials, list[tuple[str, str]]]:
    creds = grpc.ssl_channel_credentials(
        (certs / "ca.crt").read_bytes(),
        (certs / "client-admin.key").read_bytes(),
        (certs / "client-admin.crt").read_bytes(),
    )
    return creds, []


class ScramClient:
    """A client's side of SCRAM-SHA-512 (RFC 5802), to drive the server without a Kafka client."""

    def __init__(self, user: str, password: str) -> None:
        self.first_bare = f"n={user},r=clientnonce"
        self.password = password

    def first(self) -> bytes:
        return f"n,,{self.first_bare}".encode()

    def final(self, server_first_bytes: bytes) -> bytes:
        server_first = server_first_bytes.decode()
        fields = dict(part.split("=", 1) for part in server_first.split(","))
        salted = hashlib.pbkdf2_hmac("sha512", self.password.encode(), base64.b64decode(fields["s"]), int(fields["i"]))
        client_key = hmac.new(salted, b"Client Key", "sha512").digest()
        without_proof = f"c=biws,r={fields['r']}"
        auth = f"{self.first_bare},{server_first},{without_proof}".encode()
        signature = hmac.new(hashlib.sha512(client_key).digest(), auth, "sha512").digest()
        proof = base64.b64encode(bytes(a ^ b for a, b in zip(client_key, signature, strict=True))).decode()
        return f"{without_proof},p={proof}".encode()


def scram_exchange(lookup: CredentialLookup, user: str, password: str) -> bool:
    server = ScramServer("SCRAM-SHA-512", lambda name: lookup("SCRAM-SHA-512", name), "servernonce")
    client = ScramClient(user, password)
    try:
        server.step(client.final(server.step(client.first())))
    except ScramFailed:
        return False
    return server.done


def frame(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data
