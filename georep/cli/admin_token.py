"""The admin token that admin calls (``SetLink``: link cut/heal, drills) present.

``georep up`` creates ``DATA_DIR/admin.token`` (mode 0600) and starts every
node with ``--admin-token-file`` pointing at it. Commands find the token in,
by priority: ``--admin-token``, ``$GEOREP_ADMIN_TOKEN``, then
``DATA_DIR/admin.token``. Against a remote deployment, give it explicitly.
"""

from __future__ import annotations

import argparse
import os
import secrets
from pathlib import Path

from georep.client.connection import BOOTSTRAP_ENV, default_bootstrap
from georep.client.tls_args import add_client_arguments as add_client_tls_arguments

TOKEN_FILE = "admin.token"
TOKEN_ENV = "GEOREP_ADMIN_TOKEN"


def ensure_token(data_dir: Path) -> Path:
    """``DATA_DIR/admin.token``, created with a fresh random token if missing."""
    path = data_dir / TOKEN_FILE
    if not path.exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    return path


def find_token(explicit: str | None, data_dir: Path | None) -> str | None:
    if explicit:
        return explicit
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    if data_dir is not None:
        path = data_dir / TOKEN_FILE
        if path.exists():
            return path.read_text().strip()
    return None


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return () if not token else (("authorization", f"Bearer {token}"),)


def add_admin_call_arguments(parser: argparse.ArgumentParser) -> None:
    """Where an admin command calls (``--bootstrap``) and as whom: a TLS node checks the principal of the TLS
    flags, a plaintext node the admin token."""
    parser.add_argument(
        "--bootstrap",
        "--bootstrap-server",  # kafka-*.sh spelling
        default=default_bootstrap(),
        metavar="HOST:PORT",
        help=f"a node of the site (default: ${BOOTSTRAP_ENV}, else 127.0.0.1:7101)",
    )
    parser.add_argument(
        "--admin-token",
        help=f"a plaintext node's admin token (default: ${TOKEN_ENV}, else DATA_DIR/admin.token); "
        "a TLS node checks the principal instead (client:admin by default)",
    )
    add_client_tls_arguments(parser, data_dir=True)
