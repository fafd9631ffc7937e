"""The one factory for every gRPC channel and server port: client, in-site, cross-site and admin (issue 12).

Every ``grpc.aio``/``grpc`` channel and every listening port in georep is made here, by
:func:`client_channel` / :func:`client_channel_sync` and :func:`add_port`. With a :class:`TlsConfig` both ends
use mutual TLS: a server demands a client certificate signed by its CA, a client checks the server's certificate
against its CA (and the address's host, or ``server_name``). ``None`` is plaintext, the explicit ``--insecure``.

Rotation without restart: a server's credentials are gRPC's dynamic SSL credentials, whose fetcher runs before
each new handshake and reloads the three files when one was replaced or its mtime or size changed (a pair whose
key does not match its certificate, as while one file is being replaced, is skipped until it does). Connections
already up keep the certificate they were made with. A client reads the files again for each new channel.

Every channel and server bounds the messages it accepts to :data:`MESSAGE_BYTES_MAX`. A server also bounds its
connections (:class:`ServerLimits`: how many, how long one may sit idle or in its handshake, streams per connection,
header bytes), through gRPC core's channel arguments.

:func:`principal_of` gives a call's peer principal from its certificate (``georep.auth.principal``).
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import ssl
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import grpc

from georep.auth.principal import CLIENT, Principal, client_principal, principal_file_name, principal_of_names
from georep.broker.errors import NotAuthorized
from georep.metadata.topics import MAX_BATCH_BYTES_LIMIT

if TYPE_CHECKING:  # cryptography is imported where a certificate is read: a plaintext process never pays for it
    from cryptography import x509

log = logging.getLogger("georep.tls")

# One bound for every message, both ways, on every channel and server: above the largest batch a topic may allow
# (a produce request, or a fetch response that holds at least one whole batch), plus room for the envelope.
MESSAGE_BYTES_MAX = MAX_BATCH_BYTES_LIMIT + (1 << 20)
MESSAGE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", MESSAGE_BYTES_MAX),
    ("grpc.max_send_message_length", MESSAGE_BYTES_MAX),
)
_MESSAGE_KEYS = frozenset(k for k, _ in MESSAGE_OPTIONS)

CA_FILE = "ca.crt"
CA_KEY_FILE = "ca.key"
CERT_SUFFIX = ".crt"
KEY_SUFFIX = ".key"
ADMIN = client_principal("admin")

Options = Sequence[tuple[str, Any]]


class TlsError(Exception):
    """TLS files that cannot be used; the message names the file and what to pass instead."""


class UnnamedPeer(NotAuthorized):
    """A peer whose certificate, though signed by the CA, names no georep principal."""


@dataclass(frozen=True)
class TlsConfig:
    """The PEM files of one end of a mutual-TLS connection: the CA that signs the other ends, this end's
    certificate and its key. ``server_name``: the name a client checks the server's certificate for, in place of
    the host of the address it dials (a certificate made for ``georep.internal`` reached at an IP address)."""

    ca: Path
    cert: Path
    key: Path
    server_name: str | None = None

    @classmethod
    def from_dir(cls, directory: Path, principal: Principal = ADMIN, server_name: str | None = None) -> TlsConfig:
        """The files ``georep certs init`` wrote for ``principal``: DIR/ca.crt, DIR/<kind>-<name>.crt/.key."""
        stem = principal_file_name(principal)
        return cls(
            directory / CA_FILE, directory / f"{stem}{CERT_SUFFIX}", directory / f"{stem}{KEY_SUFFIX}", server_name
        )

    def read(self) -> tuple[bytes, bytes, bytes]:
        """The CA, certificate and key as PEM bytes."""
        return _read(self.ca, "CA certificate"), _read(self.cert, "certificate"), _read(self.key, "key")

    def check(self) -> None:
        """Raise :class:`TlsError` now if the files cannot be read or the key does not match the certificate."""
        ca, cert, key = self.read()
        _check_pair(cert, key, self.cert, self.key)
        try:
            from cryptography import x509

            x509.load_pem_x509_certificates(ca)
        except ValueError as exc:
            raise TlsError(f"{self.ca} holds no PEM certificate ({exc}); pass the CA's certificate") from None

    def _stamp(self) -> tuple[tuple[int, int, int], ...]:
        return tuple(_stat(p) for p in (self.ca, self.cert, self.key))


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise TlsError(
            f"cannot read the TLS {what} {path}: {exc.strerror or exc}; pass --tls-dir DIR (made by "
            "'georep certs init') or --tls-ca/--tls-cert/--tls-key, or --insecure for plaintext"
        ) from None


def _stat(path: Path) -> tuple[int, int, int]:
    """What changes when a file is rewritten or replaced: its inode (a rename over it), mtime and size."""
    try:
        st = path.stat()
    except OSError:
        return (-1, -1, -1)
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _check_pair(cert_pem: bytes, key_pem: bytes, cert_path: Path, key_path: Path) -> x509.Certificate:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        raise TlsError(f"{cert_path} holds no PEM certificate ({exc})") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise TlsError(f"{key_path} holds no unencrypted PEM private key ({exc})") from None
    if key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ) != cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo):
        raise TlsError(f"the key {key_path} does not belong to the certificate {cert_path}; pass the matching pair")
    return cert


def _options(options: Options, tls: TlsConfig | None) -> list[tuple[str, Any]]:
    out = [(k, v) for k, v in options if k not in _MESSAGE_KEYS]
    out.extend(MESSAGE_OPTIONS)
    if tls is not None and tls.server_name:
        out.append(("grpc.ssl_target_name_override", tls.server_name))
    return out


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """The bounds of a gRPC port besides its messages' (``georep node --grpc-max-connections`` and companions;
    docs/security.md, "Listener limits"). Each is a gRPC core channel argument, checked to exist in grpcio 1.85."""

    max_connections: int = 1000  # grpc.max_allowed_incoming_connections: one more is closed at accept
    idle_ms: int = 600_000  # grpc.max_connection_idle_ms: no call in flight for this long, GOAWAY (clients reconnect)
    handshake_timeout_ms: int = 20_000  # grpc.server_handshake_timeout_ms: TLS handshake and HTTP/2 preface (120 s)
    # grpc.max_concurrent_streams: 0 keeps gRPC's (no bound). georep's own clients open a stream per partition they
    # read, and a leader one per open segment per member, so a bound must exceed those.
    max_concurrent_streams: int = 0

    def options(self) -> list[tuple[str, int]]:
        out = [
            ("grpc.max_allowed_incoming_connections", self.max_connections),
            ("grpc.max_connection_idle_ms", self.idle_ms),
            ("grpc.server_handshake_timeout_ms", self.handshake_timeout_ms),
            # gRPC's defaults, pinned: header bytes of a call (soft: some calls above refused; hard: all of them)
            ("grpc.max_metadata_size", METADATA_BYTES_SOFT),
            ("grpc.absolute_max_metadata_size", METADATA_BYTES_MAX),
        ]
        if self.max_concurrent_streams:
            out.append(("grpc.max_concurrent_streams", self.max_concurrent_streams))
        return out


METADATA_BYTES_SOFT = 8 << 10
METADATA_BYTES_MAX = 16 << 10


def server_options(options: Options = (), limits: ServerLimits | None = None) -> list[tuple[str, Any]]:
    """Options for ``grpc.aio.server``/``grpc.server``: the caller's, with the message bound and the connection
    bounds of ``limits`` (the defaults if None)."""
    out = _options(options, None)
    limit_options = (limits or ServerLimits()).options()
    keys = {k for k, _ in limit_options}
    return [(k, v) for k, v in out if k not in keys] + limit_options


# --- clients -----------------------------------------------------------------------------------------------------


_client_lock = threading.Lock()
_client_cache: dict[TlsConfig, tuple[tuple[tuple[int, int, int], ...], grpc.ChannelCredentials]] = {}


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """Credentials from the files as they are now (read again when one changed since the last channel)."""
    stamp = tls._stamp()
    with _client_lock:
        cached = _client_cache.get(tls)
        if cached is not None and cached[0] == stamp:
            return cached[1]
    ca, cert, key = tls.read()
    _check_pair(cert, key, tls.cert, tls.key)
    creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    with _client_lock:
        _client_cache[tls] = (stamp, creds)
    return creds


def client_channel(address: str, tls: TlsConfig | None, options: Options = ()) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to ``address``: mutual TLS with ``tls``, plaintext with ``None``."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=_options(options, None))
    return grpc.aio.secure_channel(address, channel_credentials(tls), options=_options(options, tls))


ChannelFactory = Callable[[str], grpc.aio.Channel]


def channels(tls: TlsConfig | None, options: Options = ()) -> ChannelFactory:
    """``address -> channel`` with these settings: what the node's in-site code opens its short calls with."""
    return functools.partial(client_channel, tls=tls, options=options)


def client_channel_sync(address: str, tls: TlsConfig | None, options: Options = ()) -> grpc.Channel:
    """The blocking ``grpc.Channel`` twin of :func:`client_channel`."""
    if tls is None:
        return grpc.insecure_channel(address, options=_options(options, None))
    return grpc.secure_channel(address, channel_credentials(tls), options=_options(options, tls))


def handshake_problem(address: str, tls: TlsConfig | None, timeout_s: float) -> str | None:
    """Why a TLS handshake with ``address`` fails, in words that say what to pass; ``None`` if TLS is not the
    problem. Blocking (run it in an executor); called only after a call failed on a connection the node took.

    gRPC shows every handshake failure as "Socket closed". With TLS 1.3 a server refuses a client certificate
    after the client's side of the handshake completed, so this shakes hands with Python's ``ssl`` and then
    sends the HTTP/2 preface: a server that closes the connection instead of answering refused the certificate.
    """
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    hint = (
        "pass --tls-dir DIR (from 'georep certs init', or DATA_DIR/certs of 'georep up') or --tls-ca, "
        "--tls-cert and --tls-key"
    )
    try:
        raw = socket.create_connection((host, int(port)), timeout=timeout_s)
    except OSError:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.set_alpn_protocols(["h2"])
    if tls is None:
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    else:
        try:
            context.load_verify_locations(cafile=str(tls.ca))
            context.load_cert_chain(str(tls.cert), str(tls.key))
        except (OSError, ssl.SSLError) as exc:
            raw.close()
            return f"the TLS files cannot be used ({exc}): {hint}"
    with raw:
        try:
            with context.wrap_socket(raw, server_hostname=(tls.server_name if tls else None) or host) as conn:
                if tls is None:
                    return f"the node at {address} requires TLS with a client certificate: {hint}"
                conn.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                if conn.recv(9):
                    return None
        except ssl.SSLCertVerificationError as exc:
            return (
                f"the node at {address} presented a certificate this client does not trust "
                f"({exc.verify_message}): is {tls.ca if tls else 'the CA'} the CA that signed the nodes' "
                "certificates? (a certificate made for another host name needs --tls-server-name)"
            )
        except ssl.SSLError as exc:
            if tls is None:
                return None  # a plaintext node: TLS is not what failed
            if "WRONG_VERSION_NUMBER" in str(exc) or "RECORD_LAYER" in str(exc):
                return f"the node at {address} does not speak TLS (started with --insecure?): pass --insecure"
        except OSError:
            pass
    if tls is None:
        return None
    return (
        f"the node at {address} refused this client's certificate {tls.cert} (it needs a certificate signed "
        f"by the CA the node trusts, naming a georep principal): {hint}"
    )


# --- servers -----------------------------------------------------------------------------------------------------


class _ServerCertificates:
    """The fetcher of a server's dynamic credentials: a new configuration when the files changed and hold a
    matching pair, else ``None`` (gRPC keeps the one it has). gRPC calls it before each handshake."""

    def __init__(self, tls: TlsConfig) -> None:
        self.tls = tls
        self.stamp = tls._stamp()
        self.reloads = 0
        self._lock = threading.Lock()
        self._skipped: tuple[tuple[int, int, int], ...] | None = None
        self.initial = self._configuration()

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        ca, cert, key = self.tls.read()
        _check_pair(cert, key, self.tls.cert, self.tls.key)
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        stamp = self.tls._stamp()
        with self._lock:
            if stamp == self.stamp or stamp == self._skipped:
                return None
            try:
                config = self._configuration()
            except TlsError as exc:
                self._skipped = stamp
                log.warning("TLS files changed but cannot be used yet (%s); keeping the previous certificate", exc)
                return None
            self.stamp = stamp
            self.reloads += 1
            log.info("TLS certificate reloaded from %s", self.tls.cert)
            return config


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """Mutual-TLS server credentials that reload the files when they change; client certificates required."""
    certificates = _ServerCertificates(tls)
    fetch = cast(Callable[[], grpc.ServerCertificateConfiguration], certificates.fetch)  # None: keep the current
    return grpc.dynamic_ssl_server_credentials(certificates.initial, fetch, require_client_authentication=True)


def add_port(server: grpc.aio.Server | grpc.Server, address: str, tls: TlsConfig | None) -> int:
    """Listen on ``address``: mutual TLS with ``tls``, plaintext with ``None``. The port, or 0 if it is taken."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, server_credentials(tls))


# --- who is calling ----------------------------------------------------------------------------------------------


def principal_of(context: grpc.aio.ServicerContext[Any, Any] | grpc.ServicerContext) -> Principal | None:
    """The principal the peer's certificate names (SAN URI ``georep:<principal>`` first, else the CN).

    ``None`` on a plaintext port. A TLS peer whose certificate names no principal raises :class:`UnnamedPeer`
    (it is never taken for the plaintext case, where everything is allowed).
    """
    auth = context.auth_context()
    if not auth or _first(auth.get("transport_security_type")) != b"ssl":
        return None
    pem = _first(auth.get("x509_pem_cert"))
    found = _principal_of_pem(pem) if pem else None
    if found is None:
        raise UnnamedPeer(
            f"the client certificate of {context.peer()} names no georep principal; give it a SAN URI "
            f"'georep:{CLIENT}:<name>' (or a CN such as '{CLIENT}:<name>'), as 'georep certs init' does"
        )
    return found


def _first(values: Iterable[bytes] | bytes | None) -> bytes:
    if values is None:
        return b""
    if isinstance(values, bytes):
        return values
    return next(iter(values), b"")


@functools.lru_cache(maxsize=1024)
def _principal_of_pem(pem: bytes) -> Principal | None:
    from cryptography import x509

    return principal_of_certificate(x509.load_pem_x509_certificate(pem))


def principal_of_certificate(cert: x509.Certificate) -> Principal | None:
    """A certificate's principal: SAN URI ``georep:<principal>`` first, else the CN; ``None`` if neither."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    try:
        uris = list(
            cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
                x509.UniformResourceIdentifier
            )
        )
    except x509.ExtensionNotFound:
        uris = []
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    cn = cns[0].value if cns else None
    return principal_of_names(uris, cn if isinstance(cn, str) else None)


def write_secret(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` with mode 0600 from the start (never readable by others, even briefly), then
    rename it into place so a reader sees the old or the new file, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
