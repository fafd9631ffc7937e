"""Bounds for the node's HTTP listener (``/metrics``, a ``ThreadingMixIn`` server: one thread per connection).

Without them a client that opens connections and never finishes a request holds a thread each, for ever. With
them at most ``most`` connections are served at once (one more is closed at accept) and each socket operation
gives up after ``timeout_s``, so a stalled request ends and its thread with it. A request's own size is already
bounded by ``http.server`` (a request line and each header line of 64 KiB, 100 headers).
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
from typing import Any

log = logging.getLogger("georep.metrics")

CONNECTIONS_MAX = 8  # Prometheus scrapes one at a time; a few more for people with curl
TIMEOUT_S = 10.0


def bound_connections(
    server: socketserver.BaseServer, most: int = CONNECTIONS_MAX, timeout_s: float = TIMEOUT_S
) -> None:
    """Bound a running threading server's connections (it looks both methods up per request)."""
    assert isinstance(server, socketserver.ThreadingMixIn), "a server with a thread per connection"
    slots = threading.BoundedSemaphore(most)
    start_thread = server.process_request
    serve_one = server.process_request_thread

    def process_request(request: socket.socket, client_address: Any) -> None:
        if not slots.acquire(blocking=False):
            log.warning(
                "metrics: refused the connection from %s: %d connections are being served, the most the "
                "metrics listener takes",
                client_address,
                most,
            )
            server.shutdown_request(request)
            return
        request.settimeout(timeout_s)
        try:
            start_thread(request, client_address)
        except BaseException:
            slots.release()
            raise

    def process_request_thread(request: socket.socket, client_address: Any) -> None:
        try:
            serve_one(request, client_address)
        finally:
            slots.release()

    setattr(server, "process_request", process_request)  # noqa: B010 (mypy: methods cannot be assigned)
    setattr(server, "process_request_thread", process_request_thread)  # noqa: B010
