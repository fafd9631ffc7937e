"""The end of ``make demo``: audit the running sites live, catch a byte flipped at one of them, plot delays."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from georep.security.tls import TlsConfig
from georep.server.process import NodeProcess
from spark_jobs import inject
from spark_jobs.cut import take_cut
from spark_jobs.delays import run_delays, summary_lines
from spark_jobs.layout import SegmentFile, list_segments, site_dirs_from_topology
from spark_jobs.live_audit import run_live_audit
from spark_jobs.progress import PlainProgress
from spark_jobs.session import spark_session
from topology.model import Topology

VICTIM = "b"
TOPIC = "demo/orders"


def run_demo_audit(
    data_root: Path,
    topology: Topology,
    report_dir: Path,
    nodes: Mapping[str, NodeProcess],
    tls: TlsConfig | None,
    out: Callable[[str], None] = print,
) -> bool:
    """Audit the running sites of ``nodes``; flip a byte at one of them and audit again; then the delays.

    True when the sites audit clean and the audit names the flipped byte exactly."""
    shutil.rmtree(report_dir, ignore_errors=True)
    spark = spark_session(app_name="georep-demo-audit")
    progress = PlainProgress(lambda line: out("   " + line))
    try:
        out(
            f"\n8. audit the running sites live with Spark ({spark.sparkContext.master}): a cut of every site's "
            "vectors, then batch digests over mutual TLS, no segment file read"
        )
        # Both audits judge as of the same moment, so the second differs from the first by the flipped byte
        # alone: a record still in flight in the first would otherwise count as missing in the second, only
        # because the clock moved on.
        as_of_ms = _now_ms() - 60_000
        cut = asyncio.run(take_cut(topology, tls))
        clean = run_live_audit(spark, topology, cut, tls, report_dir / "clean", as_of_ms, progress=progress)
        for line in clean.summary:
            out("   " + line)

        out(f"\n9. stop site {VICTIM}, flip one value byte in its log (batch CRC recomputed), restart it, audit again")
        victim = nodes[VICTIM]
        victim.stop()
        segment = _segment(VICTIM, site_dirs_from_topology(topology, data_root)[VICTIM])
        origin, seq, position = inject.flip_value_byte_in_place(segment, "a")
        victim.start()
        out(f"   flipped a byte of {origin}:{seq} at byte {position} of {segment.path}; storage checks still pass")
        cut = asyncio.run(take_cut(topology, tls))
        caught = run_live_audit(spark, topology, cut, tls, report_dir / "tampered", as_of_ms, progress=progress)
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
            f"coordinate {origin}:{seq}, after fetching {caught.report['read']['fetched_batches']} batch(es)"
        )

        out("\n10. replication delay per path, origin and site (append time at the site - at the origin)")
        dirs = site_dirs_from_topology(topology, data_root)
        doc = run_delays(spark, topology, list_segments(dirs), report_dir / "delays")
        for line in summary_lines(doc, report_dir / "delays"):
            out("   " + line)
    finally:
        spark.stop()
    ok = clean.clean and found and len(named) == 1
    out(f"\naudit {'passed' if ok else 'FAILED'}: reports under {report_dir}/")
    return ok


def _segment(site: str, site_dir: Path) -> SegmentFile:
    """The first segment of the demo topic's partition 0 at ``site``."""
    segments = [s for s in list_segments({site: site_dir}, (TOPIC,)) if s.partition == 0]
    if not segments:
        raise inject.NothingToInject(f"{site_dir} holds no segment of {TOPIC}")
    return segments[0]


def _now_ms() -> int:
    return int(time.time() * 1000)
