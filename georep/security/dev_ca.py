"""A development certificate authority: what ``georep certs init`` and ``georep up`` write (issue 12).

One directory holds the CA (``ca.crt``, ``ca.key``) and a certificate and key per principal, named by
:func:`georep.auth.principal.principal_file_name`: ``site-a.crt``, ``node-a-2.crt``, ``client-alice.crt``.
Each certificate names its principal twice, as a SAN URI ``georep:<principal>`` and as its CN. A node's
certificate (``site:`` or ``node:``) also carries the names clients dial it by: ``localhost``, 127.0.0.1, ::1 and
any ``hosts`` given (the hosts of the topology's addresses), and serves both as a server and as a client (nodes
call each other). Keys are ECDSA P-256 (fast handshakes, small certificates), written with mode 0600.

Only what is missing is made, so running it again with more sites or clients adds them under the same CA;
``renew`` issues fresh keys and certificates for the given principals (rotation: nodes reload them without a
restart). A site of several nodes also gets its Raft secret, ``raft-<site>.secret`` (georep.security.raft_secret),
made once and then kept. Production deployments bring their own PKI instead (docs/security.md).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from georep.auth.principal import (
    CLIENT,
    Principal,
    client_principal,
    node_principal,
    principal_file_name,
    site_principal,
)
from georep.security.raft_secret import ensure_secret
from georep.security.tls import ADMIN, CA_FILE, CA_KEY_FILE, CERT_SUFFIX, KEY_SUFFIX, TlsError, write_secret
from topology.model import Topology

CA_DAYS = 3650
LEAF_DAYS = 825
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
CA_NAME = "georep development CA"


@dataclass(frozen=True)
class Plan:
    """The principals a directory should hold certificates for, and the extra host names of node certificates."""

    principals: tuple[Principal, ...]
    hosts: tuple[str, ...] = field(default=())
    raft_sites: tuple[str, ...] = field(default=())  # multi-node sites: each gets a Raft secret


def plan(sites: Iterable[str], nodes: Mapping[str, int], clients: Iterable[str], hosts: Iterable[str] = ()) -> Plan:
    """``site:<s>`` for a one-node site, ``node:<s>/<n>`` for each node of a site of ``nodes[s]`` > 1 nodes,
    ``client:<c>`` for each client, and always ``client:admin`` (what georep's commands use by default); and a Raft
    secret for each site of several nodes."""
    out: list[Principal] = []
    raft_sites: list[str] = []
    for site in sites:
        count = nodes.get(site, 1)
        out.extend([site_principal(site)] if count <= 1 else [node_principal(site, n) for n in range(1, count + 1)])
        raft_sites.extend([site] if count > 1 else [])
    out.extend(client_principal(c) for c in [ADMIN.name, *clients])
    return Plan(tuple(dict.fromkeys(out)), tuple(dict.fromkeys(hosts)), tuple(dict.fromkeys(raft_sites)))


def topology_plan(topology: Topology, clients: Iterable[str] = ()) -> Plan:
    """The plan for every node of a topology, its node certificates valid for the hosts of its addresses."""
    sites = list(topology.site_ids())
    nodes = {str(s): len(topology.site(s).nodes) for s in sites}
    hosts = [address.rpartition(":")[0].strip("[]") for s in sites for address in topology.site(s).nodes]
    return plan(sites, nodes, clients, hosts)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    os.chmod(tmp, 0o600)  # in the 0700 directory anyway; a data dir's files are all 0600 (georep/storage/private.py)
    os.replace(tmp, path)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    write_secret(
        path,
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path, key_path = directory / CA_FILE, directory / CA_KEY_FILE
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise TlsError(
            f"cannot load the CA in {directory} ({exc}); remove {cert_path} and {key_path} to make "
            "a new CA (and new certificates for everyone)"
        ) from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise TlsError(f"{key_path} is not an EC key made by 'georep certs init'; bring your own PKI's tools instead")
    return cert, key


def _make_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_key(directory / CA_KEY_FILE, key)  # the key first: a ca.crt without its key is never left behind
    _write_cert(directory / CA_FILE, cert)
    return cert, key


def _host_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def issue(
    principal: Principal,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    hosts: Iterable[str] = (),
    days: int = LEAF_DAYS,
    key: ec.EllipticCurvePrivateKey | None = None,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A certificate for ``principal`` signed by the CA (and its new key, unless ``key`` is given)."""
    key = key or ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(principal.uri)]
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if principal.kind != CLIENT:
        names.extend(_host_name(h) for h in dict.fromkeys([*LOOPBACK_HOSTS, *hosts]) if h)
        usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, str(principal))]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def write_leaf(directory: Path, principal: Principal, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
    """Write a principal's key then its certificate, each replaced whole."""
    stem = principal_file_name(principal)
    _write_key(directory / f"{stem}{KEY_SUFFIX}", key)
    _write_cert(directory / f"{stem}{CERT_SUFFIX}", cert)


def init(directory: Path, wanted: Plan, renew: Iterable[Principal] = (), days: int = LEAF_DAYS) -> list[Principal]:
    """Make the CA if missing, a certificate for each planned principal that has none (or is in ``renew``), and
    a Raft secret ``raft-<site>.secret`` for each planned multi-node site that has none (kept otherwise: every node
    of the site must have the same; see :mod:`georep.security.raft_secret`).

    Returns the principals whose certificates were written now.
    """
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    if (directory / CA_FILE).exists() or (directory / CA_KEY_FILE).exists():
        ca_cert, ca_key = _load_ca(directory)
    else:
        ca_cert, ca_key = _make_ca(directory)
    renewing = set(renew)
    written = []
    for principal in [*wanted.principals, *sorted(renewing - set(wanted.principals))]:
        stem = principal_file_name(principal)
        have = (directory / f"{stem}{CERT_SUFFIX}").exists() and (directory / f"{stem}{KEY_SUFFIX}").exists()
        if have and principal not in renewing:
            continue
        cert, key = issue(principal, ca_cert, ca_key, wanted.hosts, days)
        write_leaf(directory, principal, cert, key)
        written.append(principal)
    for site in wanted.raft_sites:
        ensure_secret(directory, site)
    return written
