"""Summarise a py-spy raw profile: each function's inclusive and own share of the samples.

Run from the repository root::

    .venv/bin/py-spy record -p PID -d 15 -r 50 -f raw --nonblocking -o out.txt
    .venv/bin/python bench/pyspy_top.py out.txt [--top 20]

The event loop's and the thread pool's own frames (``asyncio``, ``threading``, ``concurrent.futures``, the
interpreter's start-up) are in nearly every stack and say nothing: they are left out of the inclusive list.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

FRAME = re.compile(r"^(.*) \((?:.*/)?([^/:]+)(?::\d+)?\)$")  # "fn (path/file.py:12)" -> "fn (file.py)"
PLUMBING = re.compile(
    r"\((threading|thread|base_events|events|runners|selectors|<frozen runpy>|__main__|main|node|tasks)\.?p?y?\)$"
)


def frame_name(frame: str) -> str:
    return FRAME.sub(r"\1 (\2)", frame)


def top_functions(raw: Path, n: int = 15) -> tuple[int, list[tuple[float, float, str]]]:
    """(samples, [(inclusive %, own %, function)]) of a py-spy raw (collapsed stacks) file, inclusive first."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not count_text.isdigit() or not stack:
            continue
        count = int(count_text)
        frames = [frame_name(f) for f in stack.split(";")]
        total += count
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    rows = [(f, c) for f, c in inclusive.most_common() if not PLUMBING.search(f)][:n]
    return total, [(100 * c / max(total, 1), 100 * own[f] / max(total, 1), f) for f, c in rows]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("raw", type=Path)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    total, rows = top_functions(args.raw, args.top)
    print(f"{total} samples; inclusive%  own%  function")
    for inc, mine, fn in rows:
        print(f"{inc:6.1f} {mine:5.1f}  {fn}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
