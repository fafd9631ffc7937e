"""Summarise a py-spy raw profile: each function's inclusive and own share of the samples.

Run from the repository root::

    .venv/bin/py-spy record -p PID -d 15 -r 50 -f raw --nonblocking -o out.txt
    .venv/bin/python bench/pyspy_top.py out.txt [--top 20]

Benches record with :func:`recording` (``--py-spy DIR`` of bench/produce_wide.py and bench/scale.py) and print
the summary with :func:`print_top`.

The event loop's and the thread pool's own frames (``asyncio``, ``threading``, ``concurrent.futures``, the
interpreter's start-up) are in nearly every stack and say nothing: they are left out of the inclusive list.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path

PY_SPY = str(Path(sys.executable).parent / "py-spy")
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


@contextlib.contextmanager
def recording(outs: Mapping[Path, int]) -> Iterator[None]:
    """py-spy records each process (``{raw file: pid}``, 50 samples/s, without pausing it) while the block runs."""
    recorders = [
        subprocess.Popen(
            [PY_SPY, "record", "-p", str(pid), "-r", "50", "-f", "raw", "--nonblocking", "-o", str(out)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for out, pid in outs.items()
    ]
    try:
        yield
    finally:
        for recorder in recorders:
            recorder.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for recorder in recorders:
            try:
                recorder.wait(timeout=60)
            except subprocess.TimeoutExpired:
                recorder.kill()
                recorder.wait()


def print_top(raw: Path, title: str, indent: str = "    ", n: int = 15) -> None:
    if not raw.exists():
        print(f"{indent}{title}: no profile ({raw} not written)")
        return
    samples, rows = top_functions(raw, n)
    print(f"{indent}{title}: {samples} samples; inclusive%  own%  function")
    for inclusive, own, fn in rows:
        print(f"{indent}{inclusive:6.1f} {own:5.1f}  {fn}")


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
