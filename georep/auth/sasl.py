"""SASL/SCRAM for the Kafka listener (RFC 5802, RFC 7677): the server's side of the exchange and the stored
credential it checks against. Pure: messages in, messages out; the server nonce comes from the caller, the
credential from a lookup it passes; no socket, clock or randomness here.

**The credential** (:class:`ScramCredential`, :func:`derive`): salt, iteration count (at least
:data:`MIN_ITERATIONS`, Kafka's minimum), ``StoredKey = H(HMAC(SaltedPassword, "Client Key"))`` and
``ServerKey = HMAC(SaltedPassword, "Server Key")`` with ``SaltedPassword = PBKDF2-HMAC-H(password, salt, i)``.
The password itself is never stored nor sent to the node: ``georep user add`` derives the credential on the
operator's machine. The password's bytes are its UTF-8 encoding, as Kafka's ``ScramFormatter`` takes them
(no SASLprep, so an ASCII password is the same under both).

**The exchange** (:class:`ScramServer`), one client message per :meth:`ScramServer.step`:

1. client-first ``n,,n=<user>,r=<client nonce>`` -> server-first ``r=<client nonce><server nonce>,s=<salt>,
   i=<iterations>``. Channel binding (``p=``) is refused (TLS channel binding is not offered, as Kafka does
   not); an authorization id other than the user is refused.
2. client-final ``c=<base64 gs2 header>,r=<nonce>,p=<proof>`` -> server-final ``v=<server signature>``.
   ``ClientKey = proof XOR HMAC(StoredKey, AuthMessage)``, and the client is who it says only if
   ``H(ClientKey) == StoredKey``. Every comparison of secret-derived bytes is constant-time
   (:func:`hmac.compare_digest`).

Any failure raises :class:`ScramFailed` with a message for the client; an unknown user and a wrong password
get the same one, so the answers do not tell which users exist.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Callable
from dataclasses import dataclass

MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512")
DEFAULT_MECHANISM = "SCRAM-SHA-512"
MIN_ITERATIONS = 4096
_HASH = {"SCRAM-SHA-256": "sha256", "SCRAM-SHA-512": "sha512"}
BAD_CREDENTIALS = "Authentication failed: invalid credentials (unknown user or wrong password) for {mechanism}"


class ScramFailed(Exception):
    """The exchange cannot succeed; the message is for the client (Kafka's SASL_AUTHENTICATION_FAILED)."""


class InvalidMechanism(ValueError):
    def __init__(self, mechanism: str) -> None:
        super().__init__(f"unknown SASL mechanism {mechanism!r}: use one of {', '.join(MECHANISMS)}")


def hash_name(mechanism: str) -> str:
    try:
        return _HASH[mechanism]
    except KeyError:
        raise InvalidMechanism(mechanism) from None


@dataclass(frozen=True, slots=True)
class ScramCredential:
    mechanism: str
    salt: bytes
    iterations: int
    stored_key: bytes
    server_key: bytes

    def __post_init__(self) -> None:
        hash_name(self.mechanism)
        if self.iterations < MIN_ITERATIONS:
            raise ValueError(f"SCRAM iterations {self.iterations} below the minimum {MIN_ITERATIONS}")

    def encode(self) -> str:
        """``i=<iterations>,s=<salt>,k=<stored key>,v=<server key>`` (base64): the stored form."""
        b = _b64
        return f"i={self.iterations},s={b(self.salt)},k={b(self.stored_key)},v={b(self.server_key)}"

    @classmethod
    def decode(cls, mechanism: str, text: str) -> ScramCredential:
        """Raises ``ValueError`` for text :meth:`encode` did not write."""
        try:
            fields = dict(part.split("=", 1) for part in text.split(","))
            return cls(
                mechanism,
                base64.b64decode(fields["s"], validate=True),
                int(fields["i"]),
                base64.b64decode(fields["k"], validate=True),
                base64.b64decode(fields["v"], validate=True),
            )
        except (KeyError, ValueError) as exc:
            raise ValueError(f"invalid SCRAM credential {text!r}: {exc}") from None


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _hmac(h: str, key: bytes, msg: bytes) -> bytes:
    return hmac.new(key, msg, h).digest()


def derive(mechanism: str, password: str, salt: bytes, iterations: int) -> ScramCredential:
    """The stored credential for ``password`` (RFC 5802 section 3)."""
    h = hash_name(mechanism)
    salted = hashlib.pbkdf2_hmac(h, password.encode("utf-8"), salt, iterations)
    client_key = _hmac(h, salted, b"Client Key")
    stored_key = hashlib.new(h, client_key).digest()
    return ScramCredential(mechanism, salt, iterations, stored_key, _hmac(h, salted, b"Server Key"))


def _unescape(name: str) -> str:
    if "=" in name.replace("=2C", "").replace("=3D", ""):
        raise ScramFailed("invalid SCRAM user name: '=' must be escaped as =3D")
    return name.replace("=2C", ",").replace("=3D", "=")


def _attributes(text: str, names: str) -> list[str]:
    """The values of the leading attributes ``names`` (one letter each, in order); raises ScramFailed."""
    parts = text.split(",")
    if len(parts) < len(names):
        raise ScramFailed(f"invalid SCRAM message: expected attributes {', '.join(names)}")
    out = []
    for part, name in zip(parts, names, strict=False):
        if not part.startswith(name + "="):
            raise ScramFailed(f"invalid SCRAM message: expected attribute {name!r}, got {part[:16]!r}")
        out.append(part[2:])
    return out


class ScramServer:
    """One connection's exchange: :meth:`step` each client message; after the second, :attr:`user` is
    authenticated. A step after a failure or after the end raises :class:`ScramFailed`."""

    def __init__(self, mechanism: str, lookup: Callable[[str], ScramCredential | None], server_nonce: str) -> None:
        self.mechanism = mechanism
        self._hash = hash_name(mechanism)
        self._lookup = lookup
        self._server_nonce = server_nonce
        self._state = "first"
        self._credential: ScramCredential | None = None
        self._gs2 = ""
        self._nonce = ""
        self._first_bare = ""
        self._server_first = ""
        self.user = ""

    @property
    def done(self) -> bool:
        return self._state == "done"

    def step(self, message: bytes) -> bytes:
        state, self._state = self._state, "failed"  # any exception leaves it failed
        try:
            text = message.decode("utf-8")
        except UnicodeDecodeError:
            raise ScramFailed("invalid SCRAM message: not UTF-8") from None
        if state == "first":
            out = self._first(text)
            self._state = "final"
        elif state == "final":
            out = self._final(text)
            self._state = "done"
        else:
            raise ScramFailed("the SCRAM exchange is over: no further message expected")
        return out.encode("utf-8")

    def _first(self, text: str) -> str:
        parts = text.split(",", 2)
        if len(parts) != 3 or (parts[0] not in ("n", "y", "p") and not parts[0].startswith("p=")):
            raise ScramFailed("invalid SCRAM client-first message: it starts with a GS2 header such as 'n,,'")
        flag, authzid, bare = parts
        if flag != "n" and flag != "y":
            raise ScramFailed("SCRAM channel binding is not supported: use a mechanism without -PLUS")
        user_attr, nonce = _attributes(bare, "nr")
        user = _unescape(user_attr)
        if authzid and _unescape(authzid.removeprefix("a=")) != user:
            raise ScramFailed("a SCRAM authorization id other than the user name is not supported")
        if not user or not nonce:
            raise ScramFailed("invalid SCRAM client-first message: empty user name or nonce")
        credential = self._lookup(user)
        if credential is None or credential.mechanism != self.mechanism:
            raise ScramFailed(BAD_CREDENTIALS.format(mechanism=self.mechanism))
        self.user, self._credential = user, credential
        self._gs2 = f"{flag},{authzid},"
        self._nonce = nonce + self._server_nonce
        self._first_bare = bare
        self._server_first = f"r={self._nonce},s={_b64(credential.salt)},i={credential.iterations}"
        return self._server_first

    def _final(self, text: str) -> str:
        credential = self._credential
        assert credential is not None
        binding, nonce = _attributes(text, "cr")
        without_proof, sep, proof_b64 = text.rpartition(",p=")
        if not sep:
            raise ScramFailed("invalid SCRAM client-final message: no proof (p=)")
        if not hmac.compare_digest(binding.encode(), _b64(self._gs2.encode()).encode()):
            raise ScramFailed("SCRAM channel binding does not match the client-first message")
        if not hmac.compare_digest(nonce.encode(), self._nonce.encode()):
            raise ScramFailed("SCRAM nonce does not match the server's")
        try:
            proof = base64.b64decode(proof_b64, validate=True)
        except ValueError:
            raise ScramFailed("invalid SCRAM proof: not base64") from None
        auth = f"{self._first_bare},{self._server_first},{without_proof}".encode()
        signature = _hmac(self._hash, credential.stored_key, auth)
        if len(proof) != len(signature):
            raise ScramFailed(BAD_CREDENTIALS.format(mechanism=self.mechanism))
        client_key = bytes(a ^ b for a, b in zip(proof, signature, strict=True))
        if not hmac.compare_digest(hashlib.new(self._hash, client_key).digest(), credential.stored_key):
            raise ScramFailed(BAD_CREDENTIALS.format(mechanism=self.mechanism))
        return "v=" + _b64(_hmac(self._hash, credential.server_key, auth))
