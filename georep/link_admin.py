"""``georep link cut|heal SRC DST``: cut or heal one replication link, at its destination."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import grpc

from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.topology_file import TopologyFileError, load_topology
from topology.model import UnknownLink, UnknownSite

TIMEOUT_S = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["cut", "heal"])
    parser.add_argument("src", help="the link's source site")
    parser.add_argument("dst", help="the link's destination site, which pulls over it")
    parser.add_argument("--topology", type=Path, help="topology TOML file (default: sites a, b, c)")


async def set_link(address: str, src: str, enabled: bool) -> pb.SetLinkResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await pbg.NodeStub(channel).SetLink(pb.SetLinkRequest(src=src, enabled=enabled), timeout=TIMEOUT_S)


def main(args: argparse.Namespace) -> int:
    try:
        topology = load_topology(args.topology)
        topology.link(args.src, args.dst)
    except (TopologyFileError, UnknownLink, UnknownSite) as exc:
        print(f"georep: error: {exc}", file=sys.stderr)
        return 2
    address = topology.site(args.dst).nodes[0]
    try:
        resp = asyncio.run(set_link(address, args.src, args.action == "heal"))
    except grpc.aio.AioRpcError as exc:
        print(f"georep: error: site {args.dst} at {address}: {exc.details()}", file=sys.stderr)
        return 1
    print(f"link {resp.src} -> {resp.dst}: {'healed' if resp.enabled else 'cut'} (state {resp.state})")
    return 0
