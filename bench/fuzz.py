"""A longer fuzzing budget for every RPC of a live node than ``make test`` spends.

    python bench/fuzz.py --examples 5000

Runs ``tests/test_fuzz_rpc.py`` (Hypothesis: malformed, truncated, flipped,
garbage and appended requests to every method of the Node service; each must
get a clear status, never UNKNOWN or INTERNAL; afterwards the node is up and
its logs recover whole after ``kill -9``) with ``--examples`` examples
instead of the suite's 300.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=5000, help="Hypothesis examples (default 5000)")
    args = parser.parse_args()
    env = {**os.environ, "GEOREP_FUZZ_EXAMPLES": str(args.examples)}
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--timeout",
        "0",
        "tests/test_fuzz_rpc.py",
    ]
    return subprocess.run(command, cwd=ROOT, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
