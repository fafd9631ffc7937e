"""A topic is deleted only once every site this one links to checks incarnations (docs/design.md, "Topic changes
across sites", "The data path checks the incarnation").

A node from before incarnations neither sends nor checks them: it would take a deleted incarnation's records from
another such node, and serve them as incarnation 0. So a node refuses ``DeleteTopic`` while any site it links to
(either way) has not announced, in its ``Health`` answer, that it checks incarnations
(``HealthResponse.checks_incarnations``). An announcement is remembered in the data dir (``delete_gate.json``):
a site that announced and is down later still counts, since a site down during a delete is a case the design
covers (it learns the tombstone when it returns, and its old records are refused by the chunk check).

The sites that have not announced yet are asked at start, then after 1 s, 2 s, 4 s ... up to every
``ASK_INTERVAL_S`` until all have (linked sites started just after this one are heard of within seconds), and again
at once when a delete is refused, so a retry after an upgrade succeeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.security.tls import TlsConfig, client_channel
from georep.storage.metadata_file import write_json_atomic
from topology.model import Topology

log = logging.getLogger(__name__)

GATE_FILE = "delete_gate.json"
ASK_INTERVAL_S = 30.0
ASK_FIRST_INTERVAL_S = 1.0
ASK_TIMEOUT_S = 2.0

# Asks one node (address) whether it checks incarnations: True, False (an older node), or None (no answer).
HealthAsk = Callable[[str], Awaitable[bool | None]]


def linked_sites(topology: Topology, site: str) -> list[str]:
    """The sites with a link to or from ``site``."""
    linked = {link.src for link in topology.links_sorted() if link.dst == site}
    linked |= {link.dst for link in topology.links_sorted() if link.src == site}
    return sorted(str(s) for s in linked if s != site)


def health_ask(tls: TlsConfig | None) -> HealthAsk:
    """Ask over gRPC (the node's own certificate with TLS; ``Health`` is open to every authenticated peer)."""

    async def ask(address: str) -> bool | None:
        async with client_channel(address, tls) as channel:
            try:
                answer = await pbg.NodeStub(channel).Health(pb.HealthRequest(), timeout=ASK_TIMEOUT_S)
            except grpc.aio.AioRpcError:
                return None
            return bool(answer.checks_incarnations)

    return ask


class DeleteGate:
    """Which linked sites announced that they check incarnations; see the module docstring."""

    def __init__(self, topology: Topology, site: str, data_dir: Path, ask: HealthAsk) -> None:
        self.topology = topology
        self.linked = linked_sites(topology, site)
        self.path = data_dir / GATE_FILE
        self.ask = ask
        self.announced: set[str] = set()
        if self.path.exists():
            self.announced = set(json.loads(self.path.read_text()).get("checks_incarnations", []))
        self._asking: asyncio.Task[None] | None = None

    def missing(self) -> list[str]:
        return [s for s in self.linked if s not in self.announced]

    def refusal(self) -> str | None:
        """Why a delete must wait, or None; a refusal starts asking the missing sites again at once."""
        missing = self.missing()
        if not missing:
            return None
        self.ask_soon()
        return (
            f"linked site(s) {', '.join(missing)} have not announced that they check topic incarnations: upgrade "
            "every linked site first (docs/operations.md, 'Deletes and older sites'), then "
            "retry; an older site could serve the deleted records into a re-created topic"
        )

    async def ask_missing(self) -> None:
        """Ask each node of every missing site; remember (durably) the sites that announce."""
        newly = []
        for sid in self.missing():
            for address in self.topology.site(sid).nodes:
                if await self.ask(address):
                    newly.append(sid)
                    break
        if newly:
            self.announced |= set(newly)
            write_json_atomic(self.path, {"checks_incarnations": sorted(self.announced)})
            log.info(
                "sites %s check topic incarnations (a topic delete waits for: %s)", newly, self.missing() or "none"
            )

    def ask_soon(self) -> None:
        if self._asking is None or self._asking.done():
            with contextlib.suppress(RuntimeError):  # no running loop (a test's direct call): nothing to start
                self._asking = asyncio.get_running_loop().create_task(self.ask_missing())

    async def run(self) -> None:
        """Ask the missing sites, backing off to every ``ASK_INTERVAL_S``, until every linked site has announced."""
        interval_s = ASK_FIRST_INTERVAL_S
        while self.missing():
            try:
                await self.ask_missing()
            except OSError as exc:  # the gate's file: the delete stays refused, and says so when asked
                log.warning("could not record the sites that check topic incarnations: %s", exc)
            await asyncio.sleep(interval_s)
            interval_s = min(interval_s * 2, ASK_INTERVAL_S)
