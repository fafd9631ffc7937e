"""Long runs of issue 20's damage campaign: ``bench/damage.py --seeds 500``.

Three georep sites on 127.0.0.1 in a triangle; each seed produces records at one site, damages one file of one
stopped site (a segment, an index, the quarantine list, the recovery point, topics.json, site.json or node.json:
bytes flipped, truncated, a page zeroed, or deleted), restarts it, scrubs it and waits until every site holds
every record exactly once with nothing quarantined, or checks that the site refused to start with a message
naming the file and saying what to do (tests/support/damage.py). The first failing seed stops the run and is
printed with its damage; ``--first N`` replays from seed N.

Prints one line per seed and a summary: seeds passed, refusals, damage kinds, and seconds per seed.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, from a checkout

from tests.support.damage import Campaign


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=50, help="how many seeds to run (default 50)")
    parser.add_argument("--first", type=int, default=0, help="the first seed (default 0)")
    parser.add_argument(
        "--restart-every",
        type=int,
        default=100,
        help="start three fresh sites after this many seeds, so logs stay small (default 100)",
    )
    args = parser.parse_args()
    kinds: collections.Counter[str] = collections.Counter()
    refusals = 0
    started = time.monotonic()
    seeds = list(range(args.first, args.first + args.seeds))
    for batch_start in range(0, len(seeds), args.restart_every):
        with tempfile.TemporaryDirectory(prefix="georep-damage-") as root:
            campaign = Campaign(Path(root)).start()
            try:
                for seed in seeds[batch_start : batch_start + args.restart_every]:
                    before = campaign.refusals
                    try:
                        damage = campaign.run_seed(seed)
                    except AssertionError as exc:
                        print(f"FAILED {exc}", flush=True)
                        return 1
                    refused = campaign.refusals > before
                    refusals += refused
                    kinds[damage.kind] += 1
                    print(
                        f"seed {seed}: ok after {damage}{' (refused to start, then restored)' if refused else ''}",
                        flush=True,
                    )
            finally:
                campaign.close()
    elapsed = time.monotonic() - started
    print(
        f"{args.seeds} seeds passed ({refusals} refused to start with a message naming the file), "
        f"{dict(sorted(kinds.items()))}, {elapsed / args.seeds:.1f} s per seed"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
