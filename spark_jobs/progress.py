"""What the live audit says while it runs: the hook a richer display plugs into.

The audit calls a :class:`Progress` at each step: the cut of each site, the digests read per site, the batches
fetched where CRCs differ. :class:`PlainProgress` prints one plain line each (what a log or CI wants, and what
``georep audit --live`` uses when stdout is not a terminal); :func:`progress_for` picks the display, and is the
one place a terminal display (stages, tasks, MB per site) is to be chosen.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Protocol


class Progress(Protocol):
    def site_cut(self, site: str, partitions: int, offsets: int, took_ms: int) -> None:
        """``site`` answered the cut: its partitions, and the offsets the audit will read of them."""

    def digests_read(self, site: str, digests: int, digest_bytes: int, stored_bytes: int) -> None:
        """Every digest of ``site`` was read: how many, their bytes on the wire, and the bytes they stand for."""

    def batches_fetched(self, site: str, batches: int, batch_bytes: int) -> None:
        """Batches of ``site`` fetched whole (their CRCs differ from another site's), to name the first record."""

    def step(self, text: str) -> None:
        """Any other step, in words."""


def _mb(n: int) -> str:
    return f"{n / 1e6:,.2f} MB"


class PlainProgress:
    """One line per event, through ``out``."""

    def __init__(self, out: Callable[[str], None]) -> None:
        self.out = out

    def site_cut(self, site: str, partitions: int, offsets: int, took_ms: int) -> None:
        self.out(f"cut: site {site}: {partitions:,} partition(s), {offsets:,} offset(s) to audit ({took_ms} ms)")

    def digests_read(self, site: str, digests: int, digest_bytes: int, stored_bytes: int) -> None:
        share = f" ({100 * digest_bytes / stored_bytes:.3f}% of them)" if stored_bytes else ""
        self.out(
            f"digests: site {site}: {digests:,} batch digest(s), {_mb(digest_bytes)} moved for "
            f"{_mb(stored_bytes)} stored{share}"
        )

    def batches_fetched(self, site: str, batches: int, batch_bytes: int) -> None:
        self.out(f"fetched: site {site}: {batches:,} batch(es) whose CRCs differ, {_mb(batch_bytes)}")

    def step(self, text: str) -> None:
        self.out(text)


class SilentProgress:
    def site_cut(self, site: str, partitions: int, offsets: int, took_ms: int) -> None:
        pass

    def digests_read(self, site: str, digests: int, digest_bytes: int, stored_bytes: int) -> None:
        pass

    def batches_fetched(self, site: str, batches: int, batch_bytes: int) -> None:
        pass

    def step(self, text: str) -> None:
        pass


def progress_for(quiet: bool, out: Callable[[str], None] = print, terminal: bool | None = None) -> Progress:
    """The display for a run: nothing with ``quiet``, else plain lines (also on a terminal, until a richer
    display takes that case)."""
    if quiet:
        return SilentProgress()
    _ = sys.stdout.isatty() if terminal is None else terminal
    return PlainProgress(out)
