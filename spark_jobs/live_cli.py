"""``georep audit --live [--since REPORT_DIR]``: the command around :mod:`spark_jobs.live_audit`.

The same exit codes as the file audit: 0 clean, 1 divergence, 2 usage error or an audit that could not run.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from typing import Any

from georep.client.tls_args import TlsArgsError, client_tls
from georep.security.tls import TlsError
from spark_jobs.audit import DEFAULT_DATA_ROOT, EXIT_USAGE, IN_FLIGHT_WINDOW_MS, parse_as_of, run_in_session
from spark_jobs.cut import Cut, take_cut
from spark_jobs.layout import AuditInputError, load_topology_for_audit
from spark_jobs.live_audit import Since, load_since, run_live_audit
from spark_jobs.progress import progress_for
from topology.model import Topology

ERROR_MARK = "AuditInputError: "


def _check_flags(args: argparse.Namespace) -> None:
    if not args.live:
        raise AuditInputError("--since goes with --live: pass --live --since REPORT_DIR")
    if args.site or args.data_root is not None:
        raise AuditInputError(
            "--live reads the running sites of the topology over the network: drop --data-root/--site (they "
            "name segment files, which the file audit reads without --live)"
        )
    if args.max_slice_offsets < 1:
        raise AuditInputError(f"--max-slice-offsets {args.max_slice_offsets}: give a positive number of offsets")


def prepare(args: argparse.Namespace) -> tuple[Topology, Any, Since | None, Cut, int]:
    """Flags checked, the previous report read, and the cut taken. Raises AuditInputError or TlsArgsError."""
    _check_flags(args)
    topology = load_topology_for_audit(args.topology)
    tls = client_tls(args, DEFAULT_DATA_ROOT)
    if tls is not None:
        try:
            tls.check()
        except TlsError as exc:
            raise AuditInputError(str(exc)) from None
    since = load_since(args.since) if args.since is not None else None
    patterns = tuple(t.strip() for t in args.topics.split(",") if t.strip())
    cut = asyncio.run(take_cut(topology, tls, patterns))
    if not any(s.partitions for s in cut.sites.values()):
        which = f" of topics {', '.join(patterns)}" if patterns else ""
        raise AuditInputError(f"the sites hold no partition{which}: check --topics and the topology")
    as_of_ms = (
        parse_as_of(args.as_of, int(time.time() * 1000))
        if args.as_of is not None
        else cut.taken_at_ms - IN_FLIGHT_WINDOW_MS
    )
    return topology, tls, since, cut, as_of_ms


def error_text(exc: BaseException) -> str:
    """The message of an AuditInputError raised on an executor, out of Spark's wrapping; else the first line."""
    text = str(exc)
    if ERROR_MARK in text:
        return text[text.rindex(ERROR_MARK) + len(ERROR_MARK) :].splitlines()[0]
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__


def live_main(args: argparse.Namespace, out: Callable[[str], None] = print, spark: Any = None) -> int:
    progress = progress_for(args.quiet, out)
    try:
        topology, tls, since, cut, as_of_ms = prepare(args)
    except (AuditInputError, TlsArgsError) as exc:
        print(f"georep: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return run_in_session(
        args,
        out,
        spark,
        progress,
        lambda session: run_live_audit(
            session,
            topology,
            cut,
            tls,
            args.report,
            as_of_ms,
            since,
            progress,
            args.max_slice_offsets,
            replica_check=not getattr(args, "no_replica_check", False),
        ),
        "the live audit",
        error_text,
    )
