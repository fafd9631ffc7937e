"""The TLS flags of ``georep node`` and of the client commands, and the files they default to.

A node takes ``--tls-ca/--tls-cert/--tls-key [--tls-server-name]`` or an explicit ``--insecure``; neither is an
error that says which to pass. A client command takes ``--tls-dir DIR`` (``DIR/ca.crt`` and the certificate of
``--principal``, by default ``client:admin``: the files ``georep certs init`` writes) or the three files, or
``--insecure``. Given none, it uses ``$GEOREP_TLS_DIR``, else the certificates ``georep up`` made under its data
dir (``DATA_DIR/certs``), else plaintext (a node that wants TLS then says so: ``georep.client.connection``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from georep.auth.principal import InvalidPrincipal, Principal, parse_principal
from georep.client.errors import GeorepError
from georep.security.tls import ADMIN, CA_FILE, TlsConfig

TLS_DIR_ENV = "GEOREP_TLS_DIR"
CERTS_DIR = "certs"  # DATA_DIR/certs: where 'georep up' keeps the CA and every certificate
DEFAULT_DATA_DIR = Path(".georep")
INSECURE_WARNING = "warning: --insecure: plaintext, no TLS; anyone on the network path can read and forge the calls"


class TlsArgsError(GeorepError):
    """TLS flags that do not go together; the message says what to pass."""


def certs_dir(data_dir: Path) -> Path:
    return data_dir / CERTS_DIR


def add_node_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("TLS (one of: the three files, or --insecure)")
    group.add_argument("--tls-ca", type=Path, help="PEM file of the CA that signs every node's and client's cert")
    group.add_argument("--tls-cert", type=Path, help="PEM file of this node's certificate (site:<s> or node:<s>/<n>)")
    group.add_argument("--tls-key", type=Path, help="PEM file of this node's private key")
    group.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help="the name the other nodes' certificates are checked for, in place of the host of their addresses",
    )
    group.add_argument(
        "--insecure", action="store_true", help="plaintext: no TLS and no ACLs (development only; prints a warning)"
    )


def node_tls(args: argparse.Namespace) -> TlsConfig | None:
    """The node's TLS settings; ``None`` for ``--insecure``. Raises :class:`TlsArgsError`."""
    files = {"--tls-ca": args.tls_ca, "--tls-cert": args.tls_cert, "--tls-key": args.tls_key}
    given = [flag for flag, value in files.items() if value is not None]
    if args.insecure:
        if given:
            raise TlsArgsError(f"--insecure and {', '.join(given)} contradict each other: pass one or the other")
        return None
    if len(given) < len(files):
        missing = ", ".join(flag for flag in files if flag not in given)
        if not given:
            raise TlsArgsError(
                "a node needs TLS settings: pass --tls-ca, --tls-cert and --tls-key (make them with 'georep certs "
                "init --dir DIR --sites ...'), or --insecure to serve plaintext without TLS or ACLs"
            )
        raise TlsArgsError(f"missing {missing}: TLS needs the CA, the certificate and the key")
    return TlsConfig(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)


def _principal(text: str) -> Principal:
    try:
        return parse_principal(text)
    except InvalidPrincipal as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_client_arguments(parser: argparse.ArgumentParser, data_dir: bool = False) -> None:
    """The client TLS flags; ``data_dir``: also ``--data-dir`` (commands that have none of their own)."""
    group = parser.add_argument_group("TLS (default: $GEOREP_TLS_DIR, else the certificates of 'georep up')")
    group.add_argument(
        "--tls-dir",
        type=Path,
        metavar="DIR",
        help="directory of 'georep certs init': its ca.crt and the certificate of --principal",
    )
    group.add_argument(
        "--principal",
        type=_principal,
        default=ADMIN,
        help=f"with --tls-dir: whose certificate to present (default {ADMIN})",
    )
    group.add_argument("--tls-ca", type=Path, help="PEM file of the CA that signed the nodes' certificates")
    group.add_argument("--tls-cert", type=Path, help="PEM file of this client's certificate")
    group.add_argument("--tls-key", type=Path, help="PEM file of this client's private key")
    group.add_argument("--tls-server-name", metavar="NAME", help="check the node's certificate for NAME")
    group.add_argument("--insecure", action="store_true", help="plaintext, for a node started with --insecure")
    if data_dir:
        group.add_argument(
            "--data-dir",
            type=Path,
            default=DEFAULT_DATA_DIR,
            help="the data dir of 'georep up', whose certs/ are the default (default .georep)",
        )


def client_tls(args: argparse.Namespace, data_dir: Path | None = None) -> TlsConfig | None:
    """The client's TLS settings from its flags (see the module docstring); raises :class:`TlsArgsError`."""
    files = {"--tls-ca": args.tls_ca, "--tls-cert": args.tls_cert, "--tls-key": args.tls_key}
    given = [flag for flag, value in files.items() if value is not None]
    if args.insecure:
        if given or args.tls_dir is not None:
            raise TlsArgsError("--insecure and the TLS flags contradict each other: pass one or the other")
        print(f"georep: {INSECURE_WARNING}", file=sys.stderr)
        return None
    if given:
        if args.tls_dir is not None:
            raise TlsArgsError(f"--tls-dir and {', '.join(given)} contradict each other: pass one or the other")
        if len(given) < len(files):
            missing = ", ".join(flag for flag in files if flag not in given)
            raise TlsArgsError(f"missing {missing}: TLS needs the CA, the certificate and the key (or --tls-dir)")
        return TlsConfig(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    directory = args.tls_dir
    if directory is None and os.environ.get(TLS_DIR_ENV):
        directory = Path(os.environ[TLS_DIR_ENV])
    if directory is None:
        found = certs_dir(data_dir if data_dir is not None else getattr(args, "data_dir", DEFAULT_DATA_DIR))
        if not (found / CA_FILE).exists():
            return None
        directory = found
    tls = TlsConfig.from_dir(directory, args.principal, args.tls_server_name)
    if not tls.cert.exists():
        raise TlsArgsError(
            f"{directory} has no certificate for {args.principal} ({tls.cert.name}): pass "
            "--principal with one it has, or make it with 'georep certs init --dir "
            f"{directory} --clients NAME'"
        )
    return tls


def default_client_tls(data_dir: Path = DEFAULT_DATA_DIR) -> TlsConfig | None:
    """The client TLS settings with no flags: ``$GEOREP_TLS_DIR``, else ``DATA_DIR/certs``, else plaintext."""
    args = argparse.Namespace(
        tls_ca=None, tls_cert=None, tls_key=None, tls_dir=None, tls_server_name=None, insecure=False, principal=ADMIN
    )
    return client_tls(args, data_dir)
