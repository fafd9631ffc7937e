"""``georep link cut|heal SRC DST``: cut or heal one replication link, at its destination."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import grpc

from georep.cli.admin_token import TOKEN_ENV, call_metadata, find_token
from georep.cli.topology_arg import load_topology
from georep.client.connection import tls_problem
from georep.client.tls_args import TlsArgsError, client_tls
from georep.client.tls_args import add_client_arguments as add_client_tls_arguments
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.security.tls import TlsConfig, client_channel
from topology.file import TopologyFileError
from topology.model import UnknownLink, UnknownSite

TIMEOUT_S = 5.0
HEAL_WAIT_S = 15.0  # how long ``heal`` waits for the link to stream again before it says the state it is in


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["cut", "heal"])
    parser.add_argument("src", help="the link's source site")
    parser.add_argument("dst", help="the link's destination site, which pulls over it")
    parser.add_argument("--topology", type=Path, help="topology TOML file (default: sites a, b, c)")
    parser.add_argument(
        "--data-dir", type=Path, default=Path(".georep"), help="where 'georep up' keeps admin.token (default .georep)"
    )
    parser.add_argument(
        "--admin-token", help=f"the nodes' admin token (default: ${TOKEN_ENV}, else DATA_DIR/admin.token)"
    )
    add_client_tls_arguments(parser)


async def set_link(
    address: str, src: str, enabled: bool, token: str | None = None, tls: TlsConfig | None = None
) -> pb.SetLinkResponse:
    async with client_channel(address, tls) as channel:
        return await pbg.NodeStub(channel).SetLink(
            pb.SetLinkRequest(src=src, enabled=enabled), timeout=TIMEOUT_S, metadata=call_metadata(token)
        )


async def heal(
    address: str, src: str, token: str | None, tls: TlsConfig | None, wait_s: float = HEAL_WAIT_S
) -> tuple[pb.SetLinkResponse, pb.LinkStatus | None]:
    """Heal the link into the site at ``address`` from ``src``, then wait up to ``wait_s`` for it to stream: the
    response, and the link as the site last reported it (None: it did not list it)."""
    response = await set_link(address, src, True, token, tls)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    async with client_channel(address, tls) as channel:
        stub = pbg.NodeStub(channel)
        while True:
            status = await stub.SiteStatus(pb.SiteStatusRequest(), timeout=TIMEOUT_S, metadata=call_metadata(token))
            link = next((lk for lk in status.links if lk.src == src), None)
            if link is None or link.state == "streaming" or loop.time() >= deadline:
                return response, link
            await asyncio.sleep(0.2)


def _healed_text(response: pb.SetLinkResponse, link: pb.LinkStatus | None) -> str:
    name = f"link {response.src} -> {response.dst}"
    if link is None:
        return f"{name}: healed (state {response.state})"
    if link.state == "streaming":
        return f"{name}: healed, streaming"
    error = f": {link.last_error}" if link.last_error else ""
    return f"{name}: healed, but still {link.state} after {HEAL_WAIT_S:.0f} s{error} (georep status shows it)"


def main(args: argparse.Namespace) -> int:
    try:
        topology = load_topology(args.topology)
        topology.link(args.src, args.dst)
    except (TopologyFileError, UnknownLink, UnknownSite) as exc:
        print(f"georep: error: {exc}", file=sys.stderr)
        return 2
    address = topology.site(args.dst).nodes[0]
    try:
        token = find_token(args.admin_token, args.data_dir)
        tls = client_tls(args)
        if args.action == "heal":
            healed, link = asyncio.run(heal(address, args.src, token, tls))
        else:
            cut = asyncio.run(set_link(address, args.src, False, token, tls))
    except TlsArgsError as exc:
        print(f"georep: error: {exc}", file=sys.stderr)
        return 2
    except grpc.aio.AioRpcError as exc:
        problem = asyncio.run(tls_problem(address, tls)) if exc.code() == grpc.StatusCode.UNAVAILABLE else None
        print(f"georep: error: site {args.dst} at {address}: {problem or exc.details()}", file=sys.stderr)
        return 1
    print(
        _healed_text(healed, link) if args.action == "heal" else f"link {cut.src} -> {cut.dst}: cut (state {cut.state})"
    )
    return 0
