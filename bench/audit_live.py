"""``bench/audit.py --live``: the live audit against the file audit, on three running sites over mutual TLS.

Run from the repository root::

    .venv/bin/python bench/audit.py --live                    # 300k records: a few minutes
    .venv/bin/python bench/audit.py --live --records 10M      # the issue's size (about 5 min on 2 cores)

Three sites a, b and c, one node each, linked as ``georep up`` links them (a cycle and its reverse), with mutual TLS
from a development CA and an auditor principal holding only the ``audit`` grant. Each site produces a third of the
coordinates through the georep producer (64 KiB batches, 100-byte values), and replication copies them everywhere,
so "records" counts every stored copy, as the file bench does. Then, on the same Spark session:

* the file audit over the nodes' segment files (the nodes are idle), and the live audit over the network;
  records and batches audited per second, per core of the master, and the CPU seconds of this process and its
  JVM per million records;
* bytes moved per site by the live audit (its digests and fetched batches, counted at the client as the data
  source reads them) against the bytes that site stores;
* 1% more records produced, then an incremental live audit (``--since`` the full one), timed against the full.

The issue's targets are printed beside each figure: bytes moved <= 1% of stored, live >= 50% of file mode's
throughput, incremental <= 10% of the full audit's time.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, from a checkout

from georep.client.producer import Producer
from georep.proto import georep_pb2 as pb
from georep.security import dev_ca
from georep.security.tls import TlsConfig
from spark_jobs.audit import cli_parser, run_audit
from spark_jobs.audit import main as audit_main
from spark_jobs.layout import list_segments, load_topology_for_audit
from tests.support.sites import TRIANGLE, Sites, converged, wait_until
from topology.model import Topology

SITES = ["a", "b", "c"]
TOPIC = "bench"
PARTITIONS = 4
VALUE_BYTES = 100
BATCH_BYTES = 64 << 10
FAR_FUTURE_MS = 4_000_000_000_000


@dataclass
class Timed:
    seconds: float
    cpu_s: float  # this process and its children (the JVM)
    result: Any


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and every process below it, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    tree, grew = {pid}, True
    while grew:
        more = {p for p, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    return sum(cpu.get(p, 0.0) for p in tree)


def timed(fn: Any) -> Timed:
    cpu0, t0 = tree_cpu_s(os.getpid()), time.perf_counter()
    result = fn()
    return Timed(time.perf_counter() - t0, tree_cpu_s(os.getpid()) - cpu0, result)


async def _produce_at(address: str, tls: TlsConfig, prefix: str, n: int) -> None:
    pad = b"x" * VALUE_BYTES
    async with Producer(address, batch_size=BATCH_BYTES, linger_ms=20, tls=tls) as producer:
        futures = []
        for i in range(n):
            futures.append(producer.send(TOPIC, pad, key=f"{prefix}{i}".encode()))
            if len(futures) >= 20_000:
                await asyncio.gather(*futures)
                futures.clear()
        await producer.flush()
        await asyncio.gather(*futures)


def produce_everywhere(sites: Sites, per_site: int, prefix: str, total_seqs: int) -> float:
    """``per_site`` records produced at each site at once; returns the seconds until every site holds them all."""
    assert sites.tls is not None
    t0 = time.perf_counter()

    async def all_sites() -> None:
        await asyncio.gather(*(_produce_at(sites.address(s), sites.tls, f"{prefix}{s}", per_site) for s in SITES))  # type: ignore[arg-type]

    asyncio.run(all_sites())
    wait_until("every site holds every record", lambda: converged(sites, SITES, TOPIC, total_seqs), 3600, 1.0)
    return time.perf_counter() - t0


def start_sites(root: Path) -> tuple[Sites, Path]:
    certs = root / "certs"
    sites = Sites(root, SITES, TRIANGLE, extra_args=["--segment-bytes-max", str(16 << 20)], tls_dir=certs)
    dev_ca.init(certs, dev_ca.plan(SITES, {}, ["auditor"]))
    sites.start()
    for s in SITES:
        sites.stub(s).PutAcl(pb.PutAclRequest(principal="client:auditor", operation="audit", resource="topic:**"))
    sites.stub("a").CreateTopic(pb.CreateTopicRequest(name=TOPIC, partitions=PARTITIONS))
    wait_until("the topic reaches every site", lambda: all(sites.vectors(s, TOPIC) for s in SITES), 60)
    return sites, certs


def live_audit(spark: Any, sites: Sites, certs: Path, report: Path, *more: str) -> dict[str, Any]:
    flags = ["--live", "--topology", str(sites.topology), "--report", str(report), "--tls-dir", str(certs)]
    args = cli_parser().parse_args([*flags, "--principal", "client:auditor", "--quiet", "--topics", TOPIC, *more])
    code = audit_main(args, out=lambda _line: None, spark=spark)
    if code != 0:
        raise SystemExit(f"the live audit exited {code}; see {report}")
    return dict(json.loads((report / "report.json").read_text()))


def file_audit(spark: Any, topology: Topology, sites: Sites, report: Path) -> dict[str, Any]:
    dirs = {s: sites.nodes[s].data_dir for s in SITES}
    result = run_audit(spark, topology, dirs, list_segments(dirs, (TOPIC,)), report, FAR_FUTURE_MS)
    if not result.clean:
        raise SystemExit("\n".join(result.summary))
    return result.report


def totals(report: dict[str, Any]) -> tuple[int, int]:
    sites = report["sites"].values()
    return sum(s["records"] for s in sites), sum(s["batches"] for s in sites)


def rate_line(name: str, t: Timed, report: dict[str, Any], cores: int) -> str:
    records, batches = totals(report)
    return (
        f"  {name:<12} {t.seconds:7.1f}s: {records / t.seconds / cores:>10,.0f} records/s/core, "
        f"{batches / t.seconds / cores:>8,.1f} batches/s/core ({records:,} records, {batches:,} batches); "
        f"CPU {t.cpu_s:.1f}s = {t.cpu_s / max(records, 1) * 1e6:.1f} s per M records"
    )


def bytes_lines(report: dict[str, Any]) -> list[str]:
    lines = []
    for site, r in sorted(report["read"]["per_site"].items()):
        moved = r["digest_bytes"] + r.get("fetched_bytes", 0)
        share = 100 * moved / r["stored_bytes"] if r["stored_bytes"] else 0.0
        lines.append(
            f"  site {site}: {moved / 1e6:8.3f} MB moved for {r['stored_bytes'] / 1e6:9.2f} MB stored = {share:.3f}% "
            f"({r['digests']:,} digests) [target <= 1%]"
        )
    return lines


def run(spark: Any, root: Path, records: int, cores: int) -> dict[str, Any]:
    """The whole live comparison; prints as it goes and returns the figures."""
    coordinates = max(3, records // len(SITES))
    per_site = coordinates // len(SITES)
    sites, certs = start_sites(root)
    try:
        produced_s = produce_everywhere(sites, per_site, "r", per_site * len(SITES))
        print(
            f"  produced {per_site * len(SITES):,} coordinates ({per_site * 9:,} stored records) in {produced_s:.0f}s"
        )
        topology = load_topology_for_audit(str(sites.topology))
        file_t = timed(lambda: file_audit(spark, topology, sites, root / "file-report"))
        live_t = timed(lambda: live_audit(spark, sites, certs, root / "live-full"))
        print(rate_line("file mode", file_t, file_t.result, cores))
        print(rate_line("live mode", live_t, live_t.result, cores))
        ratio = (totals(live_t.result)[0] / live_t.seconds) / (totals(file_t.result)[0] / file_t.seconds)
        print(f"  live / file throughput: {100 * ratio:.0f}% [target >= 50%]")
        for line in bytes_lines(live_t.result):
            print(line)
        more = max(1, per_site // 100)
        produce_everywhere(sites, more, "more", (per_site + more) * len(SITES))
        since_t = timed(
            lambda: live_audit(spark, sites, certs, root / "live-since", "--since", str(root / "live-full"))
        )
        print(
            f"  incremental after 1% more ({more * len(SITES):,} coordinates): {since_t.seconds:.1f}s = "
            f"{100 * since_t.seconds / live_t.seconds:.0f}% of the full live audit [target <= 10%]; "
            f"{since_t.result['read']['digests']:,} digests read"
        )
        return {
            "records": totals(live_t.result)[0],
            "file_s": file_t.seconds,
            "file_cpu_s": file_t.cpu_s,
            "live_s": live_t.seconds,
            "live_cpu_s": live_t.cpu_s,
            "since_s": since_t.seconds,
            "read": live_t.result["read"],
        }
    finally:
        sites.close()


if __name__ == "__main__":  # the same as bench/audit.py --live
    import audit  # bench/audit.py, beside this script

    sys.argv[1:1] = ["--live"]
    raise SystemExit(audit.main())
