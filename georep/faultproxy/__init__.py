"""A small fault-injection proxy that serves the Toxiproxy HTTP API (the subset ``toxiproxy-python`` uses).

``toxics.py`` is the pure part: how each toxic transforms a direction's chunk
stream given ``now_ms``. ``proxy.py`` is the asyncio shell: the TCP relays and
the HTTP API. ``runner.py`` runs it in a thread for tests and benchmarks, and
``python -m georep.faultproxy --listen 127.0.0.1:8474`` runs it as a process.
docs/faults.md says how to use it, and how to use a real Toxiproxy instead.
"""

from georep.faultproxy.proxy import FaultProxy
from georep.faultproxy.runner import ThreadedFaultProxy

__all__ = ["FaultProxy", "ThreadedFaultProxy"]
