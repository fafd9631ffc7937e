"""``georep certs init``: a development CA and a certificate per site, node and client (docs/security.md).

    georep certs init --dir certs --sites a,b,c --nodes c=3 --clients alice bob

writes ``certs/ca.crt`` (give it to every node and client), ``certs/ca.key`` (keep it; it signs more
certificates later) and, per principal, ``<kind>-<name>.crt`` and ``.key``: ``site-a``, ``node-c-1`` ..
``node-c-3``, ``client-admin``, ``client-alice``, ``client-bob``, and for each site of several nodes its Raft
secret ``raft-c.secret`` (``georep node --raft-secret-file``; kept once made). Keys and secrets have mode
0600. Certificates that exist are kept; ``--renew`` issues new ones (nodes reload them without a restart).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from georep.auth.principal import InvalidPrincipal, Principal, parse_principal, principal_file_name
from georep.cli.topology_arg import load_topology
from georep.security import dev_ca
from georep.security.raft_secret import secret_file_name
from georep.security.tls import CA_FILE, TlsError
from georep.storage.private import restrict_umask
from topology.file import TopologyFileError
from topology.ids import InvalidSiteId, site_id


def _sites(text: str) -> list[str]:
    try:
        return [site_id(s.strip()) for s in text.split(",") if s.strip()]
    except InvalidSiteId as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _node_count(text: str) -> tuple[str, int]:
    site, eq, count = text.partition("=")
    if not eq or not count.isdigit() or int(count) < 1:
        raise argparse.ArgumentTypeError(f"invalid --nodes {text!r}: use SITE=COUNT, e.g. a=3")
    return site, int(count)


def _principal(text: str) -> Principal:
    try:
        return parse_principal(text)
    except InvalidPrincipal as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    init = actions.add_parser("init", help="make a development CA and certificates (what exists is kept)")
    init.add_argument("--dir", type=Path, required=True, help="directory for ca.crt, ca.key and the certificates")
    init.add_argument(
        "--sites", type=_sites, default=[], metavar="A,B,C", help="sites: one certificate site:<s> per one-node site"
    )
    init.add_argument(
        "--nodes",
        type=_node_count,
        nargs="*",
        default=[],
        metavar="SITE=COUNT",
        help="sites of several nodes: node:<s>/1 .. node:<s>/COUNT instead of site:<s>",
    )
    init.add_argument("--topology", type=Path, help="take the sites, nodes and host names from a topology file")
    init.add_argument(
        "--clients",
        nargs="*",
        default=[],
        metavar="NAME",
        help="client certificates client:<name> (client:admin is always made)",
    )
    init.add_argument(
        "--hosts",
        default="",
        metavar="H1,H2",
        help="more names (DNS or IP) for node certificates besides localhost, 127.0.0.1 and ::1",
    )
    init.add_argument("--days", type=int, default=dev_ca.LEAF_DAYS, help="validity of new certificates")
    init.add_argument(
        "--renew",
        type=_principal,
        nargs="*",
        default=[],
        metavar="PRINCIPAL",
        help="issue new keys and certificates for these principals, e.g. site:a client:alice",
    )


def main(args: argparse.Namespace) -> int:
    restrict_umask()  # keys, certificates and secrets: the owner's only (georep/storage/private.py)
    sites: list[str] = list(args.sites)
    nodes = dict(args.nodes)
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    if args.topology is not None:
        try:
            topology = load_topology(args.topology)
        except TopologyFileError as exc:
            print(f"georep: error: {exc}", file=sys.stderr)
            return 2
        from_topology = dev_ca.topology_plan(topology)
        hosts.extend(from_topology.hosts)
        sites.extend(str(s) for s in topology.site_ids() if s not in sites)
        nodes.update({s: len(topology.site(s).nodes) for s in topology.site_ids() if s not in nodes})
    unknown = sorted(set(nodes) - set(sites))
    if unknown:
        print(
            f"georep: error: --nodes names {', '.join(unknown)}, not in --sites; add them to --sites", file=sys.stderr
        )
        return 2
    plan = dev_ca.plan(sites, nodes, args.clients, hosts)
    try:
        written = dev_ca.init(args.dir, plan, renew=args.renew, days=args.days)
    except (TlsError, OSError) as exc:
        print(f"georep: error: {exc}", file=sys.stderr)
        return 1
    kept = [p for p in plan.principals if p not in written]
    for p in written:
        print(f"wrote {args.dir / principal_file_name(p)}.crt/.key  {p}")
    if kept:
        print(f"kept {len(kept)} existing certificate(s): {', '.join(map(str, kept))}")
    for site in plan.raft_sites:
        print(
            f"Raft secret of site {site}: {args.dir / secret_file_name(site)} (give it to every node of the site: "
            "--raft-secret-file)"
        )
    print(f"CA: {args.dir / CA_FILE} (give it to every node and client; keep ca.key private)")
    return 0
