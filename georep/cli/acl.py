"""``georep acl add|remove|list``: a site's ACL entries (docs/security.md, "Principals and ACLs").

``add PRINCIPAL OPERATION[,OPERATION...] RESOURCE`` allows each operation on the resource pattern to the
principal pattern, at the node ``--bootstrap`` names; the entry then reaches every site linked to it.
``remove`` takes the same three arguments and stops allowing them. Entries are checked here first
(``georep/auth/acl.py``), so a typo is an error that shows the accepted forms before anything is sent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import grpc

from georep.auth.acl import InvalidAcl, Operation, acl_entry
from georep.cli.admin_token import add_admin_call_arguments, call_metadata, find_token
from georep.client.connection import tls_problem
from georep.client.tls_args import TlsArgsError, client_tls
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.security.tls import TlsConfig, client_channel

TIMEOUT_S = 10.0
EXIT_ERROR = 1
EXIT_USAGE = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="{add,remove,list}")
    ops = ", ".join(op.value for op in Operation if op is not Operation.REPLICATE)
    helps = (
        ("add", "allow operations on a resource to a principal"),
        ("remove", "stop allowing them (the entries as 'georep acl list' shows them)"),
    )
    for name, help_text in helps:
        action = actions.add_parser(name, help=help_text)
        action.add_argument(
            "who", metavar="PRINCIPAL", help="client:alice, site:b, node:a/2, or a pattern: client:**, node:a/+"
        )
        action.add_argument("operations", help=f"one or more, comma-separated: {ops}")
        action.add_argument(
            "resource", help="topic:<filter> (topic:orders/**), group:<filter> (group:billing) or cluster"
        )
        add_admin_call_arguments(action)
    listing = actions.add_parser("list", help="the entries in force at the site")
    listing.add_argument("--json", action="store_true", help="one JSON object per entry")
    listing.add_argument("--with-removed", action="store_true", help="also the removed entries' records")
    add_admin_call_arguments(listing)


async def _put(
    address: str, tls: TlsConfig | None, token: str | None, requests: list[pb.PutAclRequest]
) -> list[pb.PutAclResponse]:
    async with client_channel(address, tls) as channel:
        stub = pbg.NodeStub(channel)
        return [await stub.PutAcl(r, timeout=TIMEOUT_S, metadata=call_metadata(token)) for r in requests]


async def _list(address: str, tls: TlsConfig | None, with_removed: bool) -> pb.ListAclsResponse:
    async with client_channel(address, tls) as channel:
        return await pbg.NodeStub(channel).ListAcls(pb.ListAclsRequest(with_removed=with_removed), timeout=TIMEOUT_S)


def main(args: argparse.Namespace) -> int:
    address = args.bootstrap.split(",")[0].strip()
    try:
        tls = client_tls(args)
        if args.action == "list":
            listed = asyncio.run(_list(address, tls, args.with_removed))
            _print_list(listed, args.json)
            return 0
        requests = []
        for operation in args.operations.split(","):
            entry = acl_entry(args.who, operation, args.resource)  # checked before anything is sent
            requests.append(
                pb.PutAclRequest(
                    principal=str(entry.principal),
                    operation=str(entry.operation),
                    resource=str(entry.resource),
                    remove=args.action == "remove",
                )
            )
        token = find_token(args.admin_token, args.data_dir)
        for resp in asyncio.run(_put(address, tls, token, requests)):
            verb = "added" if resp.record.present else "removed"
            print(f"{verb}: {resp.record.entry}" if resp.changed else f"already {verb}: {resp.record.entry}")
        return 0
    except (InvalidAcl, TlsArgsError) as exc:
        print(f"georep: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except grpc.aio.AioRpcError as exc:
        problem = asyncio.run(tls_problem(address, tls)) if exc.code() == grpc.StatusCode.UNAVAILABLE else None
        print(f"georep: error: {address}: {problem or exc.details()}", file=sys.stderr)
        return EXIT_ERROR


def _print_list(resp: pb.ListAclsResponse, as_json: bool) -> None:
    if as_json:
        for r in resp.records:
            principal, operation, resource = r.entry.split(" ")
            print(
                json.dumps(
                    {
                        "principal": principal,
                        "operation": operation,
                        "resource": resource,
                        "present": r.present,
                        "stamp_ms": r.stamp_ms,
                        "site": r.site,
                    }
                )
            )
        return
    if not resp.records:
        print(
            "no ACL entries: only super-users (the site's nodes, client:admin) may do anything; add entries "
            "with 'georep acl add PRINCIPAL OPERATION RESOURCE'"
        )
        return
    for r in resp.records:
        print(r.entry if r.present else f"{r.entry}  (removed)")
