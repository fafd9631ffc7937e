"""A retention run and the recovery-point checkpoint at many partitions, against serialising the checkpoint whole.

    .venv/bin/python bench/checkpoint.py --partitions 5000,100000

For each size: one broker with that many one-partition topics, one batch written to each; the time of a retention
run's visits (what ``georep/server/retention_run.py`` paces in turns of 20 ms), of a checkpoint save after every
point moved and after none moved, and, as the reference, of ``dumps_checked`` on the same document (the whole
document serialised, as every save did before). docs/design.md, "The first record at 100,000 topics".
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path

from georep.record.batch import RecordInput, encode_batch
from georep.server import retention_run
from georep.server.broker import Broker
from georep.storage.checked_json import dumps_checked, loads_checked
from georep.storage.metadata_file import load_or_create_identity


def measure(root: Path, partitions: int) -> dict[str, float]:
    broker = Broker(root, load_or_create_identity(root, "a", 1))
    checkpoint = broker.checkpoint
    assert checkpoint is not None
    try:
        batch = encode_batch([RecordInput(b"k", b"v" * 100, (), int(time.time() * 1000))])

        async def write() -> None:
            for i in range(partitions):
                broker.create_topic(f"t{i}", 1, {})
            await asyncio.gather(*(broker.produce(f"t{i}", 0, batch) for i in range(partitions)))

        asyncio.run(write())
        out: dict[str, float] = {}
        t = time.perf_counter()
        run = retention_run.RetentionRun()
        for _ in retention_run.visits(broker, run):
            pass
        out["visits_s"] = time.perf_counter() - t
        assert run.visited == partitions
        t = time.perf_counter()
        checkpoint.save()
        out["save_moved_s"] = time.perf_counter() - t
        t = time.perf_counter()
        checkpoint.save(force=True)
        out["save_same_s"] = time.perf_counter() - t
        doc = loads_checked(checkpoint.path.read_bytes())
        t = time.perf_counter()
        dumps_checked(doc)
        out["whole_s"] = time.perf_counter() - t
        return out
    finally:
        broker.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--partitions", default="5000,100000", help="sizes, comma-separated")
    args = parser.parse_args()
    print(
        "| partitions | run's visits s | us a visit | save, every point moved s | save, none moved s | "
        "dumps_checked whole s (before) | before / moved |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for size in (int(s) for s in args.partitions.split(",")):
        root = Path(tempfile.mkdtemp(prefix="georep-bench-checkpoint-"))
        try:
            m = measure(root, size)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print(
            f"| {size:,} | {m['visits_s']:.2f} | {1e6 * m['visits_s'] / size:.0f} | {m['save_moved_s']:.2f} | "
            f"{m['save_same_s']:.2f} | {m['whole_s']:.2f} | {m['whole_s'] / m['save_moved_s']:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
