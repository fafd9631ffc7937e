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
        resp = asyncio.run(set_link(address, args.src, args.action == "heal", token, tls))
    except TlsArgsError as exc:
        print(f"georep: error: {exc}", file=sys.stderr)
        return 2
    except grpc.aio.AioRpcError as exc:
        problem = asyncio.run(tls_problem(address, tls)) if exc.code() == grpc.StatusCode.UNAVAILABLE else None
        print(f"georep: error: site {args.dst} at {address}: {problem or exc.details()}", file=sys.stderr)
        return 1
    print(f"link {resp.src} -> {resp.dst}: {'healed' if resp.enabled else 'cut'} (state {resp.state})")
    return 0
