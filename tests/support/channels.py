"""The tests' channels and ports, through the one factory (``georep.security.tls``): plaintext unless a test
passes a :class:`TlsConfig`, as the nodes the tests start run ``--insecure`` unless told otherwise."""

from __future__ import annotations

from typing import Any

import grpc

from georep.security import tls as factory
from georep.security.tls import Options, TlsConfig


def open_channel(address: str, tls: TlsConfig | None = None, options: Options = ()) -> grpc.Channel:
    """A blocking channel (``with open_channel(a) as ch:`` works as with grpc's own plaintext channel)."""
    return factory.client_channel_sync(address, tls, options)


def aio_channel(address: str, tls: TlsConfig | None = None, options: Options = ()) -> grpc.aio.Channel:
    return factory.client_channel(address, tls, options)


def add_port(server: Any, address: str, tls: TlsConfig | None = None) -> int:
    """Listen on ``address`` (plaintext by default); the port, or 0."""
    return factory.add_port(server, address, tls)
