"""``georep scrub --now``: check every stored batch of one node at once, with a progress bar.

The node's background scrubber does the same work slowly and forever
(``--scrub-bytes-per-s``); this runs one full pass at disk speed, for after a
disk scare or before an audit. Damaged batches are quarantined (served to no
one) and the node repairs them from a peer's copy; the summary says how many
were found and how many are still waiting for a repair.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import grpc

from georep.client.connection import BOOTSTRAP_ENV, CHANNEL_OPTIONS, default_bootstrap, tls_problem
from georep.client.tls_args import TlsArgsError, client_tls
from georep.client.tls_args import add_client_arguments as add_client_tls_arguments
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.security.tls import TlsConfig, client_channel

BAR_WIDTH = 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--now",
        action="store_true",
        required=True,
        help="run a full pass now, in the foreground (the node also scrubs in the background)",
    )
    parser.add_argument(
        "--bootstrap",
        "--bootstrap-server",  # kafka-*.sh spelling
        default=default_bootstrap(),
        metavar="HOST:PORT",
        help=f"the node to scrub (default: ${BOOTSTRAP_ENV}, else 127.0.0.1:7101; now %(default)s)",
    )
    add_client_tls_arguments(parser, data_dir=True)


def bar(progress: pb.ScrubProgress) -> str:
    total = max(progress.total_bytes, 1)
    done = min(progress.checked_bytes, total)
    filled = BAR_WIDTH * done // total
    return (
        f"\r[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {100 * done // total:3d}% "
        f"{done / 1e6:,.1f}/{total / 1e6:,.1f} MB, {progress.found} damaged"
    )


async def scrub(address: str, tls: TlsConfig | None = None) -> pb.ScrubProgress:
    async with client_channel(address, tls, CHANNEL_OPTIONS) as channel:
        last = pb.ScrubProgress()
        async for progress in pbg.NodeStub(channel).Scrub(pb.ScrubRequest()):
            last = progress
            if sys.stderr.isatty():
                print(bar(progress), end="", file=sys.stderr, flush=True)
        if sys.stderr.isatty():
            print(file=sys.stderr)
        return last


def main(args: argparse.Namespace) -> int:
    address = args.bootstrap.split(",")[0]
    try:
        tls = client_tls(args)
        result = asyncio.run(scrub(address, tls))
    except TlsArgsError as exc:
        print(f"georep: error: {exc}", file=sys.stderr)
        return 2
    except grpc.aio.AioRpcError as exc:
        problem = asyncio.run(tls_problem(address, tls)) if exc.code() == grpc.StatusCode.UNAVAILABLE else None
        print(f"georep: error: scrub at {address}: {problem or f'{exc.code().name}: {exc.details()}'}", file=sys.stderr)
        return 1
    rebuilt = (
        f"; {result.indexes_rebuilt} segment index(es) disagreed with their batches and were rebuilt from them"
        if result.indexes_rebuilt
        else ""
    )
    if result.invalid:
        rebuilt += (
            f"; {result.invalid} whole batch(es) hold records no reader accepts, stored before every batch "
            "was validated: the node log names them, and readers skip them (georep consume --skip-corrupt)"
        )
    print(
        f"scrubbed {result.checked_bytes:,} bytes at {address}: {result.found} damaged batch(es) found; "
        f"{result.quarantined} quarantined now{rebuilt}"
        + (" (the node repairs them from peers; see georep_repaired_batches_total)" if result.quarantined else "")
    )
    return 3 if result.quarantined else 0
