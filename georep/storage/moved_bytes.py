"""How many bytes repair copies have written to this node from other nodes: a counter kept on its disk. Shell.

Issue 11's promise is that a node added to a site takes new segments with
zero bytes moved; this counter is what shows it. It counts every byte a
repair copy (``site_repair.copy_in``: a copy off a dead or draining member, a
fill of a member that holds less than the sealed end, a widening of a segment
opened on fewer nodes than the replication factor) appended to this node's
``ReplicaStore`` after reading it from another member. Nothing else moves
segment bytes between nodes on their own: a leader streaming its open
segment to its ensemble is the write itself, and a new leader's recovery
copies at most the tail a member missed of the segment it inherits (not
counted: it is part of the write that member was sent).

**What it survives.** It is the node's own count, so it lives in the node's
data dir (``bytes_moved.json``, replaced durably, like ``guard.json``): a
restart or a ``kill -9`` keeps it. A node killed between appending a chunk
and recording it misses that chunk's bytes; none is counted twice, since a
copy resumes from the end its copy holds. Each heartbeat reports it to the site's
metadata (``NodeHeartbeat.bytes_moved``), so every node's
``georep cluster status`` shows each node's count and the site's total, a
dead node's included (its last report). A node whose data dir is wiped
starts again at 0, as its copies do.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from georep.storage.durable_file import replace_file

MOVED_FILE = "bytes_moved.json"
MOVED_FORMAT = 1


class MovedBytesCorrupt(Exception):
    """``bytes_moved.json`` cannot be read; the message says what to do."""


class MovedBytes:
    """A durable, thread-safe counter of bytes copied to this node by repairs."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / MOVED_FILE
        self._lock = threading.Lock()
        self._total = self._load(self.path)

    @staticmethod
    def _load(path: Path) -> int:
        try:
            raw = json.loads(path.read_bytes())
        except FileNotFoundError:
            return 0
        except (OSError, ValueError) as exc:
            raise MovedBytesCorrupt(
                f"{path} cannot be read ({exc}); it holds only the count of bytes repairs "
                "copied to this node: delete it to count from 0 again"
            ) from None
        fmt, total = (raw.get("format"), raw.get("bytes_moved")) if isinstance(raw, dict) else (None, None)
        if fmt != MOVED_FORMAT or isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise MovedBytesCorrupt(
                f"{path} is not a format-{MOVED_FORMAT} count of bytes moved ({raw!r}); delete it to count from 0 again"
            )
        return total

    @property
    def total(self) -> int:
        with self._lock:
            return self._total

    def add(self, size_bytes: int) -> int:
        """Count ``size_bytes`` more, durably; returns the new total."""
        if size_bytes < 0:
            raise ValueError(f"bytes moved cannot decrease (got {size_bytes})")
        with self._lock:
            if size_bytes:
                total = self._total + size_bytes
                replace_file(self.path, json.dumps({"format": MOVED_FORMAT, "bytes_moved": total}).encode())
                self._total = total
            return self._total
