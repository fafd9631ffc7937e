"""The synthetic sites the audit tests read, and what they ask of an audit's result.

Sites are written straight through the storage layer (``spark_jobs.sitegen``), as replication leaves
them, then edited through it (``spark_jobs.inject``), so that storage-level checks pass and only the
cross-site comparison can catch what was changed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spark_jobs.audit import AuditResult, run_audit
from spark_jobs.layout import list_segments
from spark_jobs.sitegen import SiteSpec, write_sites
from topology.model import Topology, default_topology

SITES = ["a", "b", "c"]
SPEC = SiteSpec(topic="orders", partitions=2, records_per_origin=200, batch_records=20, segment_bytes_max=16_000)
NEVER_IN_FLIGHT_MS = 4_000_000_000_000  # an as-of in 2096: every gap is a divergence
ALWAYS_IN_FLIGHT_MS = 0


def synthetic_sites(tmp_path: Path) -> dict[str, Path]:
    """Sites a, b and c, each holding every origin's 200 records of ``SPEC.topic``'s two partitions."""
    return write_sites(tmp_path / "data", SITES, SPEC)


def audit(
    spark: Any,
    dirs: dict[str, Path],
    report: Path,
    as_of_ms: int = NEVER_IN_FLIGHT_MS,
    topology: Topology | None = None,
) -> AuditResult:
    return run_audit(spark, topology or default_topology(), dirs, list_segments(dirs), report, as_of_ms)


def issues(result: AuditResult) -> list[tuple[str, str, str | None, int, str, int, int]]:
    return sorted(
        (i["kind"], i["site"], i["topic"], i["partition"], i["origin"], i["first_seq"], i["last_seq"])
        for i in result.report["issues"]
    )


def part(dirs: dict[str, Path], site: str, p: int = 0) -> Path:
    return dirs[site] / "logs" / f"{SPEC.topic}-{p}"
