"""``georep user add|remove|list``: the Kafka listener's SASL users (docs/security.md, "Users and SCRAM
credentials").

``add NAME`` reads the password from ``--password-file`` or standard input (a prompt on a terminal), derives
the SCRAM credential here (``georep/auth/sasl.py``: a random salt, ``--iterations``, stored and server keys)
and sends only the credential to the node ``--bootstrap`` names: the password never leaves this process. The
credential then reaches every site linked to that one, as ACL entries do. The user's principal is
``client:NAME``: give it ACLs with ``georep acl add client:NAME ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import os
import sys
from pathlib import Path

import grpc

from georep.auth.credentials import user_principal
from georep.auth.sasl import DEFAULT_MECHANISM, MECHANISMS, MIN_ITERATIONS, derive
from georep.cli.admin_token import add_admin_call_arguments, call_metadata, find_token
from georep.client.connection import tls_problem
from georep.client.tls_args import TlsArgsError, client_tls
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.security.tls import client_channel

TIMEOUT_S = 10.0
EXIT_ERROR = 1
EXIT_USAGE = 2
SALT_BYTES = 32
DEFAULT_ITERATIONS = 8192


class UsageError(Exception):
    pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="{add,remove,list}")
    add = actions.add_parser(
        "add",
        help="store (or replace) a user's SCRAM credential; the password is read from "
        "--password-file or standard input",
    )
    add.add_argument("name", help="the user: its principal is client:NAME")
    add.add_argument(
        "--mechanism",
        default=DEFAULT_MECHANISM,
        choices=MECHANISMS,
        help=f"the SCRAM mechanism the client will use (default {DEFAULT_MECHANISM})",
    )
    add.add_argument("--password-file", type=Path, help="read the password from this file (its first line)")
    add.add_argument(
        "--iterations",
        type=int,
        default=DEFAULT_ITERATIONS,
        help=f"PBKDF2 iterations, at least {MIN_ITERATIONS} (default {DEFAULT_ITERATIONS})",
    )
    add_admin_call_arguments(add)
    remove = actions.add_parser("remove", help="delete a user's credential (at every linked site)")
    remove.add_argument("name")
    remove.add_argument("--mechanism", default=DEFAULT_MECHANISM, choices=MECHANISMS)
    add_admin_call_arguments(remove)
    listing = actions.add_parser("list", help="the users with a credential (names and mechanisms, never keys)")
    listing.add_argument("--json", action="store_true", help="one JSON object per credential")
    add_admin_call_arguments(listing)


def read_password(path: Path | None) -> str:
    if path is not None:
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise UsageError(f"cannot read --password-file {path}: {exc.strerror or exc}") from None
        password = lines[0] if lines else ""
    elif sys.stdin.isatty():
        password = getpass.getpass("password: ")
    else:
        password = sys.stdin.readline().rstrip("\r\n")
    if not password:
        raise UsageError("empty password: put it in --password-file or pipe it on standard input")
    return password


def _request(args: argparse.Namespace) -> pb.PutUserRequest:
    try:
        user_principal(args.name)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.action == "remove":
        return pb.PutUserRequest(user=args.name, mechanism=args.mechanism, remove=True)
    if args.iterations < MIN_ITERATIONS:
        raise UsageError(f"--iterations {args.iterations}: use at least {MIN_ITERATIONS}")
    cred = derive(args.mechanism, read_password(args.password_file), os.urandom(SALT_BYTES), args.iterations)
    return pb.PutUserRequest(
        user=args.name,
        mechanism=cred.mechanism,
        salt=cred.salt,
        iterations=cred.iterations,
        stored_key=cred.stored_key,
        server_key=cred.server_key,
    )


async def _call(address: str, args: argparse.Namespace, request: pb.PutUserRequest | None) -> object:
    tls = client_tls(args)
    token = find_token(args.admin_token, args.data_dir)
    async with client_channel(address, tls) as channel:
        stub = pbg.NodeStub(channel)
        if request is None:
            return await stub.ListUsers(pb.ListUsersRequest(), timeout=TIMEOUT_S, metadata=call_metadata(token))
        return await stub.PutUser(request, timeout=TIMEOUT_S, metadata=call_metadata(token))


def main(args: argparse.Namespace) -> int:
    address = args.bootstrap.split(",")[0].strip()
    try:
        request = None if args.action == "list" else _request(args)
        resp = asyncio.run(_call(address, args, request))
    except (UsageError, TlsArgsError) as exc:
        print(f"georep: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except grpc.aio.AioRpcError as exc:
        problem = None
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            problem = asyncio.run(tls_problem(address, client_tls(args)))
        print(f"georep: error: {address}: {problem or exc.details()}", file=sys.stderr)
        return EXIT_ERROR
    if isinstance(resp, pb.ListUsersResponse):
        _print_list(resp, args.json)
    elif isinstance(resp, pb.PutUserResponse):
        verb = "removed" if args.action == "remove" else "stored"
        print(f"{verb}: {args.mechanism} credential of user {args.name} (principal client:{args.name})")
    return 0


def _print_list(resp: pb.ListUsersResponse, as_json: bool) -> None:
    if as_json:
        for u in resp.users:
            print(
                json.dumps(
                    {
                        "user": u.user,
                        "principal": f"client:{u.user}",
                        "mechanism": u.mechanism,
                        "iterations": u.iterations,
                        "stamp_ms": u.stamp_ms,
                        "site": u.site,
                    }
                )
            )
        return
    if not resp.users:
        print("no SASL users: add one with 'georep user add NAME' (the password on standard input)")
        return
    for u in resp.users:
        print(f"{u.user}  {u.mechanism}  iterations={u.iterations}  (client:{u.user}, changed at site {u.site})")
