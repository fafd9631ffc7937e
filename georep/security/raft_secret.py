"""The per-site Raft secret: what seals a multi-node site's Raft metadata traffic (docs/security.md, "Raft").

The gRPC channels use mutual TLS; pysyncobj's Raft port (``raft = "host:port"`` of each node) cannot. What it has
is a password (``SyncObjConf(password=...)``, pysyncobj 0.3.17): the key is PBKDF2-HMAC-SHA256 of the password (a
fixed salt, 100,000 iterations) and every message, both ways, is a Fernet token (AES-128-CBC, HMAC-SHA256), checked
before it is unpickled. A connection starts with an exchange of random 32-byte keys (sealed too), which every later
message on it must carry, and token timestamps must not go backwards, so a message recorded on one connection is
refused on another. A message that fails the check closes the connection: nothing of it is read, no command or
membership change of it is applied. Without the password the port unpickles whatever it is sent, so it is never
left plaintext on a TLS node.

The secret is one per site: ``raft-<site>.secret`` in the directory of ``georep certs init``, 32 random bytes in
URL-safe base64 (44 characters), mode 0600. Every node of the site reads the same file (``georep node
--raft-secret-file``). Since the salt is fixed, the secret must be random, never a word: :func:`read_secret`
refuses fewer than :data:`MIN_CHARS` characters.
"""

from __future__ import annotations

import base64
import os
import stat
from pathlib import Path

from georep.security.tls import write_secret

MIN_CHARS = 32  # a generated secret has 44; 32 base64 characters carry 192 bits
FLAG = "--raft-secret-file"


class RaftSecretError(Exception):
    """A Raft secret file that cannot be used; the message says what to do."""


def secret_file_name(site: str) -> str:
    return f"raft-{site}.secret"


def new_secret() -> bytes:
    return base64.urlsafe_b64encode(os.urandom(32))


def ensure_secret(directory: Path, site: str) -> bool:
    """Write ``directory/raft-<site>.secret`` if it is missing (an existing one is kept: every node of the site
    must have the same). Returns whether it was written now."""
    path = directory / secret_file_name(site)
    if path.exists():
        return False
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_secret(path, new_secret() + b"\n")
    return True


def read_secret(path: Path) -> bytes:
    """The secret in ``path``, stripped of surrounding white space. Raises :class:`RaftSecretError` if the file is
    missing, unreadable, empty, too short or readable by other users."""
    make = "make one with 'georep certs init --dir DIR --nodes SITE=N ...' and give every node of the site the same"
    try:
        data = path.read_bytes().strip()
        mode = path.stat().st_mode
    except OSError as exc:
        raise RaftSecretError(f"{FLAG} {path}: {exc.strerror or exc}; {make}") from None
    if not data:
        raise RaftSecretError(f"{FLAG} {path} is empty; {make}")
    if len(data) < MIN_CHARS:
        raise RaftSecretError(
            f"{FLAG} {path} holds {len(data)} characters; a Raft secret needs at least {MIN_CHARS} random ones; {make}"
        )
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise RaftSecretError(
            f"{FLAG} {path} is readable by other users (mode {stat.S_IMODE(mode):o}): 'chmod 600 {path}'"
        )
    return data
