"""Principals: who a peer certificate says is calling (issue 12).

Three kinds, written ``kind:name``:

- ``site:a``: the node of a one-node site ``a``, speaking for the whole site (replication pulls, geo acks);
- ``node:a/2``: node 2 of a multi-node site ``a``; it speaks for site ``a`` as well;
- ``client:alice``: a producer, consumer or operator.

A certificate carries its principal as a SAN URI ``georep:<principal>`` (checked first), else as its CN, which must
then parse as a principal. Pure: no certificate or gRPC code here (that is ``georep.security.tls``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from topology.ids import InvalidSiteId, NodeId, SiteId, site_id

SITE = "site"
NODE = "node"
CLIENT = "client"
KINDS = (SITE, NODE, CLIENT)

SAN_URI_SCHEME = "georep"  # a certificate's SAN URI is georep:<principal>, e.g. georep:site:a
CLIENT_NAME_MAX_CHARS = 64
_CLIENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
_FORMS = "'site:<site>' (e.g. site:a), 'node:<site>/<n>' (e.g. node:a/2) or 'client:<name>' (e.g. client:alice)"


class InvalidPrincipal(ValueError):
    """A text is not one of the three principal forms; the message shows them."""


@dataclass(frozen=True, order=True)
class Principal:
    kind: str
    name: str  # "a" for site:a, "a/2" for node:a/2, "alice" for client:alice

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}"

    @property
    def site(self) -> SiteId | None:
        """The site a ``site:`` or ``node:`` principal speaks for; ``None`` for a client."""
        if self.kind == SITE:
            return SiteId(self.name)
        if self.kind == NODE:
            return SiteId(self.name.partition("/")[0])
        return None

    @property
    def node(self) -> NodeId | None:
        """The node number of a ``node:`` principal."""
        return NodeId(int(self.name.partition("/")[2])) if self.kind == NODE else None

    @property
    def uri(self) -> str:
        """The SAN URI that names this principal in a certificate."""
        return f"{SAN_URI_SCHEME}:{self}"


def site_principal(site: str) -> Principal:
    return parse_principal(f"{SITE}:{site}")


def node_principal(site: str, node: int) -> Principal:
    return parse_principal(f"{NODE}:{site}/{node}")


def client_principal(name: str) -> Principal:
    return parse_principal(f"{CLIENT}:{name}")


def parse_principal(text: str) -> Principal:
    """``site:a``, ``node:a/2`` or ``client:alice`` as a :class:`Principal`; else :class:`InvalidPrincipal`."""
    kind, colon, name = text.partition(":")
    if not colon or kind not in KINDS:
        raise InvalidPrincipal(f"invalid principal {text!r}: use {_FORMS}")
    try:
        if kind == SITE:
            site_id(name)
        elif kind == NODE:
            site, slash, number = name.partition("/")
            site_id(site)
            if not slash or not number.isdigit() or number.startswith("0") or not number.isascii():
                raise InvalidPrincipal(f"invalid principal {text!r}: a node number is 1, 2, 3, ...; use {_FORMS}")
        elif not _CLIENT_NAME.fullmatch(name):
            raise InvalidPrincipal(
                f"invalid principal {text!r}: a client name has 1-{CLIENT_NAME_MAX_CHARS} letters, digits or "
                f"'.', '_', '@', '-' (a letter or digit first); use {_FORMS}"
            )
    except InvalidSiteId as exc:
        raise InvalidPrincipal(f"invalid principal {text!r}: {exc}; use {_FORMS}") from exc
    return Principal(kind, name)


def principal_from_uri(uri: str) -> Principal | None:
    """The principal of a SAN URI ``georep:<principal>``; ``None`` for a URI of another scheme."""
    scheme, colon, rest = uri.partition(":")
    if not colon or scheme != SAN_URI_SCHEME:
        return None
    return parse_principal(rest)


def principal_of_names(uris: list[str], common_name: str | None) -> Principal | None:
    """A certificate's principal: its first ``georep:`` SAN URI, else its CN parsed as a principal.

    ``None`` when neither names one (a CN that is not a principal, e.g. a host name, names nobody).
    """
    for uri in uris:
        found = principal_from_uri(uri)
        if found is not None:
            return found
    if common_name is None:
        return None
    try:
        return parse_principal(common_name)
    except InvalidPrincipal:
        return None


def principal_file_name(principal: Principal) -> str:
    """The file stem of a principal's certificate in a ``georep certs init`` directory.

    ``site-a``, ``node-a-2``, ``client-alice``: no ':' or '/', so it is a plain file name on every system.
    """
    return f"{principal.kind}-{principal.name.replace('/', '-')}"
