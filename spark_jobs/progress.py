"""What the audit says while it runs.

Two sources feed it:

* **Steps** the audit reports itself through a :class:`Progress`: the cut of each site, the digests read per
  site, the batches fetched where CRCs differ (the live audit), in words.
* **A status line** that a driver thread (:func:`watch`) recomposes every moment: Spark's stages and their tasks
  done of total (Spark's ``StatusTracker``), and per site the batches or digests read and the MB they took,
  which the executors' readers send to the driver as they go (:class:`Reporter`, small UDP datagrams to a
  :class:`Listener` on the driver's address: a Python data source's readers are built from string options by a
  planning process, so an accumulator the driver made cannot reach them).

On a terminal (:class:`TerminalProgress`) the status is one line redrawn in place, with the steps printed above
it; elsewhere (:class:`PlainProgress`: a log, CI, a pipe) the steps are plain lines and the status a plain line
every ``PLAIN_EVERY_S`` seconds while it changes. ``--quiet`` shows neither (:class:`SilentProgress`).

The counters are a display, not an account: a datagram lost, or a task that Spark runs twice, changes what they
show, never what the audit finds. An executor that cannot reach the driver by UDP leaves them at zero.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any, Protocol

OPTION = "progress"  # the data source option that carries the driver's listener, "host:port"
REPORT_EVERY_S = 0.5  # an executor's reader sends its counts at most this often (and at the end of its partition)
REDRAW_EVERY_S = 0.25  # the terminal line
PLAIN_EVERY_S = 10.0  # a plain status line, while something changed
DATAGRAM_BYTES_MAX = 1024
SITES_MAX = 1_000  # sites counted; a datagram naming one more is dropped


class Progress(Protocol):
    def site_cut(self, site: str, partitions: int, offsets: int, took_ms: int) -> None:
        """``site`` answered the cut: its partitions, and the offsets the audit will read of them."""

    def digests_read(self, site: str, digests: int, digest_bytes: int, stored_bytes: int) -> None:
        """Every digest of ``site`` was read: how many, their bytes on the wire, and the bytes they stand for."""

    def batches_fetched(self, site: str, batches: int, batch_bytes: int) -> None:
        """Batches of ``site`` fetched whole (their CRCs differ from another site's), to name the first record."""

    def step(self, text: str) -> None:
        """Any other step, in words."""

    def status(self, line: str) -> None:
        """The status line of the moment (stages, tasks, per site counts), from :func:`watch`'s thread."""


def _mb(n: int) -> str:
    return f"{n / 1e6:,.2f} MB"


class PlainProgress:
    """One line per step through ``out``, and the status line every ``every_s`` seconds while it changes."""

    def __init__(self, out: Callable[[str], None], every_s: float = PLAIN_EVERY_S) -> None:
        self.out = out
        self.every_s = every_s
        self._last_status = ""
        self._last_at = float("-inf")

    def site_cut(self, site: str, partitions: int, offsets: int, took_ms: int) -> None:
        self.step(f"cut: site {site}: {partitions:,} partition(s), {offsets:,} offset(s) to audit ({took_ms} ms)")

    def digests_read(self, site: str, digests: int, digest_bytes: int, stored_bytes: int) -> None:
        share = f" ({100 * digest_bytes / stored_bytes:.3f}% of them)" if stored_bytes else ""
        self.step(
            f"digests: site {site}: {digests:,} batch digest(s), {_mb(digest_bytes)} moved for "
            f"{_mb(stored_bytes)} stored{share}"
        )

    def batches_fetched(self, site: str, batches: int, batch_bytes: int) -> None:
        self.step(f"fetched: site {site}: {batches:,} batch(es) whose CRCs differ, {_mb(batch_bytes)}")

    def step(self, text: str) -> None:
        self.out(text)

    def status(self, line: str) -> None:
        now = time.monotonic()
        if line != self._last_status and now - self._last_at >= self.every_s:
            self._last_status, self._last_at = line, now
            self.out(f"progress: {line}")


class TerminalProgress(PlainProgress):
    """The steps as lines, and below them the status line, redrawn in place on ``stream`` (a terminal)."""

    def __init__(self, stream: IO[str]) -> None:
        super().__init__(self._line)
        self.stream = stream
        self._status = ""
        self._lock = threading.Lock()

    def _width(self) -> int:
        return max(20, shutil.get_terminal_size((100, 24)).columns - 1)

    def _line(self, text: str) -> None:
        with self._lock:
            self.stream.write(f"\r\x1b[K{text}\n")
            if self._status:
                self.stream.write(self._status[: self._width()])
            self.stream.flush()

    def status(self, line: str) -> None:
        with self._lock:
            self._status = line
            self.stream.write(f"\r\x1b[K{line[: self._width()]}")
            self.stream.flush()

    def clear(self) -> None:
        with self._lock:
            self._status = ""
            self.stream.write("\r\x1b[K")
            self.stream.flush()


class SilentProgress:
    def site_cut(self, site: str, partitions: int, offsets: int, took_ms: int) -> None:
        pass

    def digests_read(self, site: str, digests: int, digest_bytes: int, stored_bytes: int) -> None:
        pass

    def batches_fetched(self, site: str, batches: int, batch_bytes: int) -> None:
        pass

    def step(self, text: str) -> None:
        pass

    def status(self, line: str) -> None:
        pass


def progress_for(
    quiet: bool, out: Callable[[str], None] = print, terminal: bool | None = None, stream: IO[str] | None = None
) -> Progress:
    """The display for a run: nothing with ``quiet``; on a terminal (``stream``, default stdout) the redrawn
    status line; else plain lines through ``out`` (also when the caller collects the lines: an ``out`` other
    than ``print``)."""
    if quiet:
        return SilentProgress()
    stream = stream or sys.stdout
    if (stream.isatty() and out is print) if terminal is None else terminal:
        return TerminalProgress(stream)
    return PlainProgress(out)


# ---- per-site counts: the executors' readers -> the driver ----


@dataclass
class SiteCount:
    items: int = 0  # digests (live) or batches (files) read
    wire_bytes: int = 0  # bytes that crossed the network for them (live: the digests)
    stored_bytes: int = 0  # bytes the sites store for them


class Listener:
    """A UDP socket on the driver that sums the counts executors send, per site, on a thread of its own."""

    def __init__(self, host: str, bind: str | None = None) -> None:
        """Bound where the driver's own RPC binds (``bind``, else ``host``), and reached at ``host``: the address
        the executors already reach the driver at (``spark.driver.host``)."""
        self.counts: dict[str, SiteCount] = {}
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((socket.gethostbyname(bind or host), 0))
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, name="georep-progress", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                data = self._sock.recv(DATAGRAM_BYTES_MAX)
            except OSError:
                return  # closed
            self.take(data)

    def take(self, data: bytes) -> None:
        """Add one datagram's counts; anything else on the port is dropped."""
        try:
            msg = json.loads(data)
            site, items, wire, stored = str(msg["s"]), int(msg["n"]), int(msg["w"]), int(msg["b"])
        except (ValueError, KeyError, TypeError):
            return
        with self._lock:
            if site not in self.counts and len(self.counts) >= SITES_MAX:
                return  # a stray sender's made-up sites do not grow the table
            c = self.counts.setdefault(site, SiteCount())
            c.items, c.wire_bytes, c.stored_bytes = c.items + items, c.wire_bytes + wire, c.stored_bytes + stored

    def snapshot(self) -> dict[str, SiteCount]:
        with self._lock:
            return {s: SiteCount(c.items, c.wire_bytes, c.stored_bytes) for s, c in sorted(self.counts.items())}

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(timeout=2)


class Reporter:
    """On an executor: the counts of one reader, sent to the driver's :class:`Listener` now and then. Sending never
    fails the read: with no listener (``address`` None) or an unreachable one, the counts are dropped."""

    def __init__(self, address: str | None, every_s: float = REPORT_EVERY_S) -> None:
        self.every_s = every_s
        self._pending: dict[str, SiteCount] = {}
        self._sent_at = time.monotonic()
        self._to: tuple[str, int] | None = None
        self._sock: socket.socket | None = None
        if address:
            host, _, port = address.rpartition(":")
            self._to = (host, int(port))
            self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

    def add(self, site: str, items: int, wire_bytes: int, stored_bytes: int) -> None:
        c = self._pending.setdefault(site, SiteCount())
        c.items, c.wire_bytes, c.stored_bytes = (
            c.items + items,
            c.wire_bytes + wire_bytes,
            c.stored_bytes + stored_bytes,
        )
        if time.monotonic() - self._sent_at >= self.every_s:
            self.flush()

    def flush(self) -> None:
        self._sent_at = time.monotonic()
        pending, self._pending = self._pending, {}
        if self._sock is None or self._to is None:
            return
        for site, c in pending.items():
            data = json.dumps({"s": site, "n": c.items, "w": c.wire_bytes, "b": c.stored_bytes}).encode()
            with contextlib.suppress(OSError):
                self._sock.sendto(data, self._to)

    def close(self) -> None:
        self.flush()
        if self._sock is not None:
            self._sock.close()


def reported(batches: Iterator[Any], options: Mapping[str, str], site: str) -> Iterator[Any]:
    """``batches`` (``pyarrow.RecordBatch`` es of one site) passed through, counted for the driver's display: rows,
    and the sums of their ``digest_bytes`` (wire) and ``size_bytes`` (stored) columns where they have them."""
    import pyarrow.compute as pc

    reporter = Reporter(options.get(OPTION))
    try:
        for batch in batches:
            names = batch.schema.names
            wire = pc.sum(batch.column("digest_bytes")).as_py() if "digest_bytes" in names else 0
            stored = pc.sum(batch.column("size_bytes")).as_py() if "size_bytes" in names else 0
            reporter.add(site, batch.num_rows, wire or 0, stored or 0)
            yield batch
    finally:
        reporter.close()


# ---- the status line: Spark's stages, and the counts ----


@dataclass(frozen=True)
class Stage:
    stage_id: int
    name: str
    done: int
    total: int
    running: int


def active_stages(sc: Any) -> list[Stage]:
    """The stages running now, from Spark's StatusTracker (the driver's view of every executor's tasks)."""
    tracker = sc.statusTracker()
    out = []
    for stage_id in sorted(tracker.getActiveStageIds()):
        info = tracker.getStageInfo(stage_id)
        if info is not None:
            out.append(Stage(stage_id, info.name, info.numCompletedTasks, info.numTasks, info.numActiveTasks))
    return out


def status_line(elapsed_s: float, stages: list[Stage], stages_done: int, counts: Mapping[str, SiteCount]) -> str:
    """``12 s | stage 4: 3/8 tasks (2 running) | 5 stages done | a 1,200 digests 0.05 MB of 3.40 MB | ...``"""
    parts = [f"{elapsed_s:.0f} s"]
    parts += [f"stage {s.stage_id}: {s.done}/{s.total} tasks ({s.running} running)" for s in stages]
    parts.append(f"{stages_done} stage(s) done")
    for site, c in counts.items():
        if c.wire_bytes:
            parts.append(f"{site} {c.items:,} digests {_mb(c.wire_bytes)} of {_mb(c.stored_bytes)}")
        else:
            parts.append(f"{site} {c.items:,} batches {_mb(c.stored_bytes)}")
    return " | ".join(parts)


class Watcher:
    """The driver thread that recomposes the status line every ``every_s`` seconds and hands it to ``progress``."""

    def __init__(self, sc: Any, progress: Progress, listener: Listener | None, every_s: float) -> None:
        self.sc, self.progress, self.listener, self.every_s = sc, progress, listener, every_s
        self.started = time.monotonic()
        self.seen: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="georep-status", daemon=True)

    def line(self) -> str:
        stages = active_stages(self.sc)
        running = {s.stage_id for s in stages}
        self.seen |= running
        counts = self.listener.snapshot() if self.listener else {}
        return status_line(time.monotonic() - self.started, stages, len(self.seen - running), counts)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.progress.status(self.line())
            except Exception:  # the session stopping under us: the display ends, the audit does not
                return

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


_current: Listener | None = None


def reader_options() -> dict[str, str]:
    """The option that tells a data source's readers where to send their counts (none when nothing watches)."""
    return {OPTION: _current.address} if _current is not None else {}


@contextlib.contextmanager
def watch(spark: Any, progress: Progress) -> Iterator[None]:
    """While the block runs, the status line of ``spark``'s jobs goes to ``progress``, with the per-site counts
    of the readers whose options carry :func:`reader_options` (nothing at all for a :class:`SilentProgress`)."""
    global _current
    if isinstance(progress, SilentProgress):
        yield
        return
    sc = spark.sparkContext
    conf = sc.getConf()
    listener = Listener(conf.get("spark.driver.host", "127.0.0.1"), conf.get("spark.driver.bindAddress", None))
    terminal = isinstance(progress, TerminalProgress)
    watcher = Watcher(sc, progress, listener, REDRAW_EVERY_S if terminal else 1.0)
    _current = listener
    watcher.start()
    try:
        yield
    finally:
        _current = None
        watcher.stop()
        listener.close()
        if isinstance(progress, TerminalProgress):
            progress.clear()
        elif isinstance(progress, PlainProgress):  # the last counts, whatever the plain lines' pace left out
            with contextlib.suppress(Exception):
                progress.step(f"progress: done: {watcher.line()}")
