"""``--log-level`` and ``--log-format`` of the long-running commands (``georep node``; ``georep up`` hands them to
its nodes after ``--``): lines for people to read, or one JSON object a line for a log pipeline (journald's JSON
readers, Loki, Elasticsearch), as Kafka's and Pulsar's log4j layouts offer."""

from __future__ import annotations

import argparse
import json
import logging
from datetime import UTC, datetime

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def add_log_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", choices=LEVELS, default="info", help="the least severe level logged (info)")
    parser.add_argument(
        "--log-format",
        choices=FORMATS,
        default="text",
        help="text lines (default), or json: one object a line with ts (UTC), level, logger, msg and, for an "
        "exception, exc",
    )


class JsonFormatter(logging.Formatter):
    """One JSON object a line; a message's own newlines stay inside its string."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
        doc = {
            "ts": stamp.replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False)


def configure_logging(args: argparse.Namespace) -> None:
    """The root logger as ``--log-level`` and ``--log-format`` say, to stderr."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if args.log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler], force=True)
