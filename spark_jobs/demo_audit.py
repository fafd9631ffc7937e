"""The end of ``make demo``: audit the demo's sites with Spark, catch an injected divergence, plot delays."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

from georep.record.batch import parse_header
from spark_jobs import inject
from spark_jobs.audit import run_audit
from spark_jobs.delays import run_delays, summary_lines
from spark_jobs.layout import list_segments, site_dirs_from_topology
from spark_jobs.session import spark_session
from topology.model import Topology

VICTIM = "b"


def run_demo_audit(data_root: Path, topology: Topology, report_dir: Path, out: Callable[[str], None] = print) -> bool:
    """Audit the sites under ``data_root``; then a copy of one with a flipped byte; then the delays.

    True when the sites audit clean and the audit names the injected divergence exactly.
    """
    shutil.rmtree(report_dir, ignore_errors=True)
    dirs = site_dirs_from_topology(topology, data_root)
    spark = spark_session(app_name="georep-demo-audit")
    try:
        out(f"\n8. audit every site's segment files with Spark ({spark.sparkContext.master}), no server involved")
        # Both audits judge as of the same moment, so the second differs from the first by the flipped byte
        # alone: a record still in flight in the first (the demo stopped the sites mid-replication) would
        # otherwise count as missing in the second, only because the clock moved on.
        as_of_ms = _now_ms() - 60_000
        clean = run_audit(spark, topology, dirs, list_segments(dirs), report_dir / "clean", as_of_ms)
        for line in clean.summary:
            out("   " + line)

        out(f"\n9. flip one value byte in a copy of site {VICTIM}'s log (batch CRC recomputed) and audit again")
        copy = report_dir / f"{VICTIM}-copy"
        shutil.copytree(dirs[VICTIM], copy)
        part, origin, seq = _target(VICTIM, copy)
        inject.flip_value_byte(part, origin, seq)
        out(f"   flipped a byte of {part.name} {origin}:{seq} in {copy}; storage-level checks still pass")
        tampered = {**dirs, VICTIM: copy}
        caught = run_audit(spark, topology, tampered, list_segments(tampered), report_dir / "tampered", as_of_ms)
        for line in caught.summary:
            out("   " + line)
        named = [
            (i["kind"], i["site"], i["origin"], i["first_seq"])
            for i in caught.report["issues"]
            if i["kind"] != "in_flight"
        ]  # not a divergence: the clean audit allows it too
        found = ("mismatch", VICTIM, origin, seq) in named
        out(
            f"   the audit {'names' if found else 'DID NOT name'} the divergence: mismatch at site {VICTIM}, "
            f"coordinate {origin}:{seq}"
        )

        out("\n10. replication delay per path, origin and site (append time at the site - at the origin)")
        doc = run_delays(spark, topology, list_segments(dirs), report_dir / "delays")
        for line in summary_lines(doc, report_dir / "delays"):
            out("   " + line)
    finally:
        spark.stop()
    ok = clean.clean and found and len(named) == 1
    out(f"\naudit {'passed' if ok else 'FAILED'}: reports under {report_dir}/")
    return ok


def _target(site: str, site_dir: Path) -> tuple[Path, str, int]:
    """A partition of ``site_dir`` and a coordinate in it of another site's origin, mid-batch."""
    for part in sorted((site_dir / "logs").iterdir()):
        for _appended, batch in inject.read_partition(part):
            h = parse_header(batch)
            if h.origin_site != site and h.records_count > 1:
                return part, str(h.origin), h.base_origin_seq + 1
    raise inject.NothingToInject(f"{site_dir} holds no batch of another origin with two records")


def _now_ms() -> int:
    return int(time.time() * 1000)
