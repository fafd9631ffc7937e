"""What retention and the background scrubber cost an idle node with N written partitions (issue 22).

Run from the repository root: ``.venv/bin/python bench/housekeeping_idle.py --partitions 10000``. In one process:
a ``Broker`` on a temporary directory with one topic of N partitions, one batch produced to each (fsynced), then,
with no traffic:

* ``retention run``: process CPU of ``Broker.enforce_retention`` as the node runs it every ``--retention-check-ms``,
  and how many partitions it visited; the first run visits every partition (each one's first visit, which
  learns its due time), the next ones only the written and the due;
* ``scrub, every partition``: process CPU of checking every partition once (``BackgroundScrub.check``), what the
  scrubber's pass cost at least once a minute before issue 22's third session, and now costs once per
  ``--scrub-interval-ms``;
* each as a share of one core at its period (60 s for retention; for the scrubber, the old minute and the new
  default interval).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, from a checkout

from georep.node.serve import SCRUB_BYTES_PER_S_DEFAULT, SCRUB_INTERVAL_MS_DEFAULT
from georep.server.broker import Broker
from georep.server.scrubber import BackgroundScrub
from georep.server.service import SCRUB_STEP_BYTES
from georep.storage.metadata_file import load_or_create_identity
from tests.support.node_api import batch

RETENTION_CHECK_S = 60.0
OLD_SCRUB_PASS_S = 60.0


async def no_sleep(_seconds: float) -> None:
    return None


async def measure(data_dir: Path, partitions: int, runs: int) -> None:
    broker = Broker(data_dir, load_or_create_identity(data_dir, "a", 1))
    try:
        start = time.perf_counter()
        broker.create_topic("t", partitions, {})
        for i in range(partitions):
            await broker.produce("t", i, batch(2, value_bytes=100))
        print(f"{partitions:,} partitions created and written in {time.perf_counter() - start:.1f} s")
        for run in range(runs):
            cpu = time.process_time()
            visited = broker.enforce_retention().visited
            took = time.process_time() - cpu
            print(
                f"retention run {run + 1}: {visited:,} partitions visited, {took * 1000:.1f} ms CPU, "
                f"{100 * took / RETENTION_CHECK_S:.3f}% of a core every {RETENTION_CHECK_S:.0f} s"
            )
        # The rate's sleeps are not CPU: left out, so the pass takes no longer than its work.
        scrub = BackgroundScrub(
            broker, SCRUB_BYTES_PER_S_DEFAULT, SCRUB_STEP_BYTES, SCRUB_INTERVAL_MS_DEFAULT, 0, sleep=no_sleep
        )
        cpu = time.process_time()
        for key in sorted(broker.partitions):
            await scrub.check(key)
        took = time.process_time() - cpu
        per_interval_s = SCRUB_INTERVAL_MS_DEFAULT / 1000
        print(
            f"scrub, every partition once: {took:.2f} s CPU ({took / partitions * 1e6:.0f} us a partition): "
            f"{100 * took / OLD_SCRUB_PASS_S:.2f}% of a core once a minute (before), "
            f"{100 * took / per_interval_s:.3f}% once per {per_interval_s:.0f} s (--scrub-interval-ms default)"
        )
    finally:
        broker.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--partitions", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=3, help="retention runs to time")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="georep-housekeeping-") as tmp:
        asyncio.run(measure(Path(tmp), args.partitions, args.runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
