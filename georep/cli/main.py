"""The ``georep`` command.

Client commands (``topic``, ``produce``, ``consume``, ``offsets``, ``health``)
take ``--bootstrap HOST:PORT[,HOST:PORT]`` (default: ``$GEOREP_BOOTSTRAP``,
else 127.0.0.1:7101). ``node`` and ``demo`` belong to the server and demo
modules; they are imported only when used.

Every georep error is one line, ``georep: error: <what to do>``, exit code 1.
Ctrl-C exits with 130, and a closed stdout (``| head``) ends quietly.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from georep import __version__
from georep.cli.output import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_USAGE, PROG, err
from georep.cli.records import cmd_consume, cmd_offsets, cmd_produce
from georep.cli.topics import (
    cmd_health,
    cmd_topic_add_partitions,
    cmd_topic_alter,
    cmd_topic_create,
    cmd_topic_delete,
    cmd_topic_describe,
    cmd_topic_list,
)
from georep.client.admin import LIST_PAGE_SIZE
from georep.client.connection import BOOTSTRAP_ENV, default_bootstrap
from georep.client.errors import GeorepError
from georep.client.tls_args import add_client_arguments as add_client_tls_arguments
from georep.record.compression import CODEC_NAMES
from offsets.commits import OFFSETS_TOPIC

# Subcommands owned by other modules: name -> (module, help).
DELEGATED = {
    "node": ("georep.cli.node", "run one storage node of a site"),
    "demo": ("georep.cli.demo", "start a local multi-site demo"),
    "up": ("georep.cli.up", "run every node of a topology on this machine, in the foreground"),
    "status": ("georep.cli.status", "every site's vectors, links, routes and lag"),
    "link": ("georep.cli.link", "cut or heal one replication link"),
    "scrub": ("georep.cli.scrub", "scrub --now: check every stored batch of a node, quarantine and repair damage"),
    "topology": ("georep.cli.topology", "topology show [FILE]: summary and picture of a topology"),
    "group": ("georep.cli.group", "list and describe consumer groups: members, assignments, commits, lag"),
    "cluster": ("georep.cli.cluster", "cluster status: a multi-node site's nodes, segments, leaders and Raft group"),
    "acl": ("georep.cli.acl", "acl add|remove|list: which principal may do what to which topic or group"),
    "user": ("georep.cli.user", "user add|remove|list: Kafka SASL users and their SCRAM credentials"),
    "certs": ("georep.cli.certs", "certs init: a development CA and certificates for sites, nodes and clients"),
    "drill": ("georep.cli.drill", "run a DR drill against a running topology and report RPO, RTO and duplicates"),
    "audit": (
        "spark_jobs.audit",
        "Spark audit: do all sites hold the same data? (reads segment files); audit history REPORT_DIR: its runs",
    ),
    "delays": ("spark_jobs.delays", "Spark analytics: replication delay per path, origin and site, with plots"),
}


# --- the parser ----------------------------------------------------------------------


def _add_bootstrap(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--bootstrap",
        "--bootstrap-server",  # kafka-*.sh spelling
        default=default_bootstrap(),
        metavar="HOST:PORT[,HOST:PORT]",
        help=f"node(s) to connect to (default: ${BOOTSTRAP_ENV}, else 127.0.0.1:7101; now %(default)s)",
    )
    add_client_tls_arguments(parser, data_dir=True)


def _add_topic(parser: argparse.ArgumentParser, dest: str = "topic") -> None:
    """The topic as the positional argument, or as ``--topic`` (Kafka's tools spell it so)."""
    parser.add_argument(dest, nargs="?", help="the topic (or --topic)")
    parser.add_argument("--topic", dest="topic_option", action="append", default=[], help=argparse.SUPPRESS)


def _topics_given(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fold ``--topic`` into the positional topic argument, refusing none, or two different ones."""
    flags: list[str] = getattr(args, "topic_option", [])
    if isinstance(getattr(args, "name", None), list):  # topic create: names from both
        args.name = [*args.name, *flags]
        if not args.name:
            parser.error("give at least one topic name: georep topic create NAME [NAME ...] (or --topic NAME)")
        return
    named = ("describe", "alter", "add-partitions", "delete")
    dest = "name" if getattr(args, "topic_command", None) in named else "topic"
    given = {x for x in (getattr(args, dest), *flags) if x is not None}
    if len(given) > 1:
        parser.error(f"two topics given ({', '.join(sorted(given))}): give one, as TOPIC or --topic TOPIC")
    if not given:
        parser.error("give the topic, as TOPIC or --topic TOPIC")
    setattr(args, dest, given.pop())


def _nonnegative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Geo-replicated append-only event logs.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    _add_topic_commands(commands)
    _add_produce(commands)
    _add_consume(commands)
    _add_offsets_and_health(commands)
    for name, (_, help_text) in DELEGATED.items():
        commands.add_parser(name, help=help_text, add_help=False)
    return parser


def _add_topic_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``topic create``, ``topic list`` and ``topic describe``."""
    topic = commands.add_parser("topic", help="create, list and describe topics")
    topic_commands = topic.add_subparsers(dest="topic_command", metavar="ACTION", required=True)
    create = topic_commands.add_parser("create", help="create topics (one call for them all)")
    create.add_argument("name", nargs="*", help="one or more topic names, each created with --partitions")
    create.add_argument(
        "--topic", dest="topic_option", action="append", default=[], help="a topic name (Kafka's spelling)"
    )
    create.add_argument(
        "--partitions", type=int, required=True, help="number of partitions ('georep topic add-partitions' grows it)"
    )
    create.add_argument(
        "--replication-factor",
        type=int,
        metavar="N",
        help="on a multi-node site, copies of each segment (default: the site's --replication-factor)",
    )
    create.add_argument(
        "--config",
        nargs="*",
        action="extend",
        default=[],
        metavar="KEY=VALUE",
        help="topic config overrides, with georep's keys or Kafka's names (retention.ms=3600000; docs/kafka.md, "
        "'Config names'); repeat the flag or list several",
    )
    create.set_defaults(run=cmd_topic_create)
    listing = topic_commands.add_parser("list", help="list topics")
    listing.add_argument(
        "--internal",
        action="store_true",
        help=f"also list georep's internal topics ({OFFSETS_TOPIC}: committed offsets)",
    )
    listing.add_argument("--limit", type=int, metavar="N", help="list at most N topics, and say how to go on")
    listing.add_argument("--page-token", default="", metavar="TOKEN", help="go on where a --limit listing stopped")
    listing.add_argument(
        "--page-size", type=int, default=LIST_PAGE_SIZE, metavar="N", help="topics per call to the node"
    )
    listing.set_defaults(run=cmd_topic_list)
    describe = topic_commands.add_parser("describe", help="partitions, offsets, vectors and config of a topic")
    _add_topic(describe, "name")
    describe.set_defaults(run=cmd_topic_describe)
    for sub in (create, listing, describe, *_add_topic_change_commands(topic_commands)):
        _add_bootstrap(sub)
        sub.add_argument("--json", action="store_true", help="machine-readable output")


def _add_topic_change_commands(
    topic_commands: argparse._SubParsersAction[argparse.ArgumentParser],
) -> list[argparse.ArgumentParser]:
    """``topic alter``, ``topic add-partitions`` and ``topic delete``: changes that replicate to every site the
    topic's links reach."""
    alter = topic_commands.add_parser("alter", help="change a topic's config at every site (last writer wins)")
    _add_topic(alter, "name")
    alter.add_argument(
        "--config",
        nargs="*",
        action="extend",
        default=[],
        metavar="KEY=VALUE",
        help="set these, with georep's keys or Kafka's names (retention.ms=3600000); repeat or list several",
    )
    alter.add_argument(
        "--delete-config",
        nargs="*",
        action="extend",
        default=[],
        metavar="KEY",
        help="reset these to the node's default (Kafka's kafka-configs --delete-config)",
    )
    alter.set_defaults(run=cmd_topic_alter)
    grow = topic_commands.add_parser("add-partitions", help="grow a topic to more partitions (the count only grows)")
    _add_topic(grow, "name")
    grow.add_argument("--partitions", type=int, required=True, help="the new total: more than the topic has")
    grow.set_defaults(run=cmd_topic_add_partitions)
    drop = topic_commands.add_parser(
        "delete", help="delete a topic at every site its links reach (created again, it starts empty)"
    )
    _add_topic(drop, "name")
    drop.set_defaults(run=cmd_topic_delete)
    for sub in (alter, grow, drop):
        sub.add_argument("--validate-only", action="store_true", help="check the change, make none")
    return [alter, grow, drop]


def _add_produce(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``produce``: one record per stdin line."""
    produce = commands.add_parser("produce", help="send one record per stdin line")
    _add_topic(produce)
    produce.add_argument(
        "--key-separator",
        metavar="SEP",
        help="split each line at the first SEP into key and value (no SEP in a line: no key)",
    )
    produce.add_argument("--acks", default="leader", help="leader, all or geo:N (default leader)")
    produce.add_argument("--partition", type=_nonnegative, help="send every record to this partition")
    produce.add_argument("--batch-size", type=int, default=65536, help="batch size in bytes (default 65536)")
    produce.add_argument("--linger-ms", type=_positive_float, default=5, help="batch linger time (default 5)")
    produce.add_argument(
        "--compression",
        default="none",
        choices=tuple(CODEC_NAMES.values()),
        help="codec of each batch, stored and replicated compressed (default none)",
    )
    produce.add_argument(
        "--request-timeout-ms",
        type=_positive,
        default=30_000,
        metavar="MS",
        help="how long a batch may wait for its acks, geo:N included (default 30000)",
    )
    produce.set_defaults(run=cmd_produce)
    _add_bootstrap(produce)


def _add_consume(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``consume``: one record per line, from an offset, a vector or a group's commit."""
    consume = commands.add_parser("consume", help="print records, one per line")
    _add_topic(consume)
    consume.add_argument("--from-beginning", action="store_true", help="start at the earliest offset (default: end)")
    consume.add_argument("--max", "--max-messages", type=_nonnegative, help="exit after N records")
    consume.add_argument(
        "--timeout", type=_positive_float, metavar="S", help="exit after S seconds without a new record"
    )
    consume.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per record: key, value, partition, offset, origin, origin_seq, timestamp",
    )
    consume.add_argument("--partition", type=_nonnegative, help="read only this partition")
    consume.add_argument(
        "--skip-corrupt",
        action="store_true",
        help="skip records the node holds damaged (quarantined until repaired) and report them, "
        "instead of stopping with an error",
    )
    consume.add_argument("--offset", type=_nonnegative, help="start at this local offset (needs --partition)")
    consume.add_argument(
        "--vector", metavar="TEXT", help="start after what this vector offset covers, e.g. 'a@1:10,b@3:0'"
    )
    consume.add_argument(
        "--group",
        metavar="G",
        help="read as a member of consumer group G: continue at its committed vector, commit "
        "every 5 s and on exit (--from-beginning: start at the earliest offset where G has "
        "no commit)",
    )
    consume.add_argument(
        "--commit-acks", metavar="ACKS", help="ack level of the group's commits: leader or geo:N (default leader)"
    )
    consume.add_argument(
        "--read-from",
        choices=("leader", "follower"),
        default="leader",
        help="a multi-node site: fetch each partition at its leader (default), or at the "
        "--prefer node (default: the first --bootstrap node that answers), which serves it "
        "as a follower up to what its leader confirmed; where it cannot, the leader "
        "does",
    )
    consume.add_argument(
        "--prefer",
        metavar="HOST:PORT",
        help="with --read-from follower: the node to read from (e.g. the one in your rack)",
    )
    consume.set_defaults(run=cmd_consume)
    _add_bootstrap(consume)


def _add_offsets_and_health(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``offsets`` and ``health``."""
    offsets = commands.add_parser("offsets", help="earliest, latest or by-time offsets per partition")
    _add_topic(offsets)
    offsets.add_argument("--time", default="latest", help="earliest, latest or a timestamp in ms (default latest)")
    offsets.add_argument("--partition", type=_nonnegative)
    offsets.add_argument("--json", action="store_true")
    offsets.set_defaults(run=cmd_offsets)
    _add_bootstrap(offsets)

    health = commands.add_parser("health", help="is the node serving?")
    health.add_argument("--json", action="store_true")
    health.set_defaults(run=cmd_health)
    _add_bootstrap(health)


def _run_delegated(name: str, argv: list[str]) -> int:
    module_name, help_text = DELEGATED[name]
    import importlib

    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        err(f"error: 'georep {name}' is not available in this build ({exc})")
        return EXIT_ERROR
    if name == "topology":
        if not argv or argv[0] != "show":
            err("error: usage: georep topology show [FILE] [--output PICTURE] [--topic TOPIC]")
            return EXIT_USAGE
        from georep.cli.status import live_link_states

        return int(module.main(argv[1:], live=live_link_states))
    if name == "audit" and argv[:1] == ["history"]:  # the audit's only positional word: no flag is spelled so
        from spark_jobs.history_cli import cli as history_cli

        return history_cli(argv[1:])
    parser = argparse.ArgumentParser(prog=f"{PROG} {name}", description=help_text)
    module.add_arguments(parser)
    code: int = module.main(parser.parse_args(argv))
    return code


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The command line of every command but the delegated ones, with Kafka's spellings folded in."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if hasattr(args, "topic_option"):
        _topics_given(parser, args)
    return args


def _quiet_stdout() -> None:
    # Python flushes stdout at exit and would raise again into the closed pipe.
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        if args_list and args_list[0] in DELEGATED:
            return _run_delegated(args_list[0], args_list[1:])
        args = parse_args(args_list)
        run: Callable[[argparse.Namespace], Any] = args.run
        return int(asyncio.run(run(args)))
    except GeorepError as exc:
        err(f"error: {exc.message}")
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _quiet_stdout()
        return 0
