"""What every georep command prints: tables, one-line errors, exit codes."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from georep.client.admin import TopicInfo

PROG = "georep"
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(map(str, header))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return "\n".join(lines)


def err(text: str) -> None:
    print(f"{PROG}: {text}", file=sys.stderr, flush=True)


def topic_json(topic: TopicInfo, *, summary: bool = False) -> dict[str, Any]:
    """A topic as ``topic describe --json`` prints it, with its partitions' states; ``summary``: as ``topic list
    --json`` does, with the records and bytes of the node's partitions instead (a listing fetches no state)."""
    out: dict[str, Any] = {"name": topic.name, "partitions": topic.partitions, "config": topic.config}
    if summary:
        out["records"], out["size_bytes"] = topic.records, topic.size_bytes
        return out
    out["partition_states"] = [
        {
            "partition": p.partition,
            "log_start_offset": p.log_start_offset,
            "log_end_offset": p.log_end_offset,
            "size_bytes": p.size_bytes,
            "segments": p.segments,
            "vector": p.vector.to_text(),
            "damaged": list(p.damaged),
        }
        for p in topic.partition_states
    ]
    return out
