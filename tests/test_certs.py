"""``georep certs init``: the development CA, what each certificate names, modes, and what a rerun keeps."""

from __future__ import annotations

import stat
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from georep.auth.principal import Principal, parse_principal
from georep.security import dev_ca
from georep.security.tls import TlsConfig, channel_credentials, principal_of_certificate
from tests.support.cli import georep, ok


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_init_makes_a_certificate_per_principal_signed_by_the_ca(tmp_path: Path) -> None:
    d = tmp_path / "certs"
    ok(georep("certs", "init", "--dir", str(d), "--sites", "a,b,c", "--nodes", "c=2", "--clients", "alice"))
    ca = _cert(d / "ca.crt")
    expected = {
        "site-a": "site:a",
        "site-b": "site:b",
        "node-c-1": "node:c/1",
        "node-c-2": "node:c/2",
        "client-admin": "client:admin",
        "client-alice": "client:alice",
    }
    assert sorted(p.stem for p in d.glob("*.crt")) == sorted([*expected, "ca"])
    for stem, principal in expected.items():
        cert = _cert(d / f"{stem}.crt")
        assert principal_of_certificate(cert) == parse_principal(principal)
        cert.verify_directly_issued_by(ca)
        TlsConfig(d / "ca.crt", d / f"{stem}.crt", d / f"{stem}.key").check()  # the key matches
        assert stat.S_IMODE((d / f"{stem}.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((d / "ca.key").stat().st_mode) == 0o600
    assert not (d / "site-c.crt").exists()  # a multi-node site's nodes speak for it, each with its own cert


def test_node_certificates_name_the_hosts_clients_dial_and_client_certificates_do_not(tmp_path: Path) -> None:
    written = dev_ca.init(tmp_path, dev_ca.plan(["a"], {}, ["bob"], ["db1.example.com", "10.0.0.7"]))
    assert written == [Principal("site", "a"), Principal("client", "admin"), Principal("client", "bob")]
    san = _cert(tmp_path / "site-a.crt").extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.DNSName)) == {"localhost", "db1.example.com"}
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "::1", "10.0.0.7"}
    client_san = _cert(tmp_path / "client-bob.crt").extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert client_san.value.get_values_for_type(x509.DNSName) == []


def test_a_rerun_keeps_what_exists_adds_what_is_new_and_renews_on_request(tmp_path: Path) -> None:
    dev_ca.init(tmp_path, dev_ca.plan(["a"], {}, []))
    ca_before, a_before = (tmp_path / "ca.crt").read_bytes(), (tmp_path / "site-a.crt").read_bytes()
    written = dev_ca.init(tmp_path, dev_ca.plan(["a", "b"], {}, []), renew=[parse_principal("client:admin")])
    assert written == [Principal("site", "b"), Principal("client", "admin")]
    assert (tmp_path / "ca.crt").read_bytes() == ca_before and (tmp_path / "site-a.crt").read_bytes() == a_before
    _cert(tmp_path / "site-b.crt").verify_directly_issued_by(_cert(tmp_path / "ca.crt"))  # the same CA


def test_the_common_name_alone_names_the_principal_of_a_certificate_from_another_pki(tmp_path: Path) -> None:
    dev_ca.init(tmp_path, dev_ca.plan([], {}, []))
    ca_cert, ca_key = dev_ca._load_ca(tmp_path)
    cert, _ = dev_ca.issue(Principal("client", "carol"), ca_cert, ca_key)
    assert principal_of_certificate(cert) == Principal("client", "carol")
    # what a bring-your-own PKI might issue: a host-name CN and no georep URI
    builder = x509.CertificateBuilder().subject_name(x509.Name.from_rfc4514_string("CN=db1.example.com"))
    other = (
        builder.issuer_name(ca_cert.subject)
        .public_key(ec.generate_private_key(ec.SECP256R1()).public_key())
        .serial_number(1)
        .not_valid_before(cert.not_valid_before_utc)
        .not_valid_after(cert.not_valid_after_utc)
        .sign(ca_key, dev_ca.hashes.SHA256())
    )
    assert principal_of_certificate(other) is None


def test_bad_arguments_are_refused_with_what_to_pass(tmp_path: Path) -> None:
    result = georep("certs", "init", "--dir", str(tmp_path), "--sites", "a", "--nodes", "b=3")
    assert result.returncode == 2 and b"add them to --sites" in result.stderr
    result = georep("certs", "init", "--dir", str(tmp_path), "--renew", "alice")
    assert result.returncode == 2 and b"client:<name>" in result.stderr


def test_client_credentials_follow_the_files(tmp_path: Path) -> None:
    """A client reads the files again for a new channel once they changed (a renewed certificate), not before."""
    dev_ca.init(tmp_path, dev_ca.plan([], {}, []))
    tls = TlsConfig.from_dir(tmp_path)
    first = channel_credentials(tls)
    assert channel_credentials(tls) is first
    dev_ca.init(tmp_path, dev_ca.plan([], {}, []), renew=[parse_principal("client:admin")])
    assert channel_credentials(tls) is not first
