"""A Toxiproxy API server for tests, driven with the unmodified ``toxiproxy-python`` client.

With ``TOXIPROXY_URL`` set (``http://HOST:PORT``), the tests use that real
Toxiproxy server; otherwise they start georep's own fault proxy
(``georep.faultproxy``) in a thread. Either way, the client's class-level API
address points at it, and every proxy a test creates is destroyed at the end.
The upstreams the proxies relay to must be reachable from the server: with a
real Toxiproxy in a container, run it with the host's network.
"""

from __future__ import annotations

import contextlib
import os
import urllib.parse
from collections.abc import Iterator

from toxiproxy import Toxiproxy
from toxiproxy.proxy import Proxy

from georep.faultproxy import ThreadedFaultProxy
from tests.support.ports import free_port
from tests.support.sites import Sites, topology_toml

URL_ENV = "TOXIPROXY_URL"


@contextlib.contextmanager
def toxiproxy_server() -> Iterator[Toxiproxy]:
    url = os.environ.get(URL_ENV)
    server = None
    if url:
        parsed = urllib.parse.urlsplit(url if "//" in url else f"http://{url}")
        host, port = parsed.hostname or "127.0.0.1", parsed.port or 8474
    else:
        server = ThreadedFaultProxy().start()
        host, _, p = server.api_address.rpartition(":")
        port = int(p)
    client = Toxiproxy()
    client.update_api_consumer(host, port)
    before = set(client.proxies()) if url else set()
    try:
        yield client
    finally:
        with contextlib.suppress(Exception):
            for name, proxy in client.proxies().items():
                if name not in before:
                    proxy.destroy()
        if server is not None:
            server.stop()


def create_proxy(client: Toxiproxy, name: str, upstream: str) -> Proxy:
    """A proxy to ``upstream`` on a free port of 127.0.0.1; its ``listen`` is the address to connect to."""
    proxy = client.create(upstream=upstream, name=name, listen=f"127.0.0.1:{free_port()}")
    return proxy


def proxy_sites(client: Toxiproxy, sites: Sites, prefix: str) -> dict[str, Proxy]:
    """Put a proxy in front of every site of ``sites`` (not started yet) and name the proxies, not the nodes, in
    its topology file: every replication link, held report and repair fetch between sites crosses a proxy, while
    each node listens on its own port (``sites.address``) for clients that connect directly."""
    proxies = {s: create_proxy(client, f"{prefix}-{s}", sites.address(s)) for s in sites.nodes}
    ports = {s: int(p.listen.rpartition(":")[2]) for s, p in proxies.items()}
    sites.topology.write_text(topology_toml(ports, sites.links))
    return proxies
