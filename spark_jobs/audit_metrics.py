"""The continuous audit's verdict as Prometheus metrics, in a node_exporter textfile.

``georep audit --every DURATION --metrics-textfile PATH`` rewrites ``PATH`` after every run from the history
(:mod:`spark_jobs.history`), in Prometheus' text format (``prometheus_client``), atomically: prometheus_client
writes a temporary file beside it and renames it, so node_exporter's textfile collector (which reads ``*.prom``)
never sees half a file. docs/audit.md, "Alerting on a divergence", lists the metrics and an alert rule.

Gauges describe the last run; ``georep_audit_divergent`` and ``georep_audit_findings`` describe the last run that
reached a verdict, so a run that could not run (a site down) neither raises nor clears a divergence alert;
``georep_audit_last_run_failed`` says it failed. Counters sum the history, so they survive a restart of the
continuous audit.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from spark_jobs.history import VERDICT_CLEAN, VERDICT_DIVERGENCE, VERDICT_ERROR, Run

PREFIX = "georep_audit_"
TEXTFILE_SUFFIX = ".prom"


class MetricsError(Exception):
    """A --metrics-textfile that cannot be written; the message says what to do."""


def check_textfile_path(path: Path) -> None:
    """Raises MetricsError for a path node_exporter would not read, or whose directory does not exist."""
    if path.suffix != TEXTFILE_SUFFIX:
        raise MetricsError(
            f"--metrics-textfile {path}: node_exporter's textfile collector reads only *{TEXTFILE_SUFFIX} files; "
            f"name it e.g. {path.with_suffix(TEXTFILE_SUFFIX).name}"
        )
    if not path.parent.is_dir():
        raise MetricsError(
            f"--metrics-textfile {path}: the directory {path.parent} does not exist; create it (node_exporter's "
            "--collector.textfile.directory)"
        )


class HistoryCollector(Collector):
    """The metric families of a history, the last run last."""

    def __init__(self, runs: list[Run], kinds: list[str], report: str) -> None:
        self.runs = runs
        self.kinds = kinds
        self.report = report

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(PREFIX + name, doc, labels=["report"])
        g.add_metric([self.report], float(value))
        return g

    def collect(self) -> Iterator[Metric]:
        if self.runs:
            yield from self._verdict()
            yield from self._last_run()
            yield from self._totals()

    def _verdict(self) -> Iterator[Metric]:
        last = self.runs[-1]
        completed = [r for r in self.runs if r.completed]
        clean = [r for r in self.runs if r.verdict == VERDICT_CLEAN]
        verdict = completed[-1] if completed else None
        yield self._gauge(
            "last_run_timestamp_seconds", "End of the last audit run (Unix time)", last.finished_at_ms / 1000
        )
        yield self._gauge(
            "last_success_timestamp_seconds",
            "End of the last audit run that found no divergence (Unix time; 0: none yet)",
            clean[-1].finished_at_ms / 1000 if clean else 0,
        )
        yield self._gauge("last_run_failed", "1 when the last run could not run (exit 2), else 0", not last.completed)
        yield self._gauge(
            "last_run_exit_code", "Exit code of the last run: 0 clean, 1 divergence, 2 error", last.exit_code
        )
        yield self._gauge(
            "divergent",
            "1 when the last audit that reached a verdict found a divergence, else 0",
            verdict is not None and verdict.verdict == VERDICT_DIVERGENCE,
        )
        findings = GaugeMetricFamily(
            PREFIX + "findings",
            "Issues per kind found by the last audit that reached a verdict",
            labels=["report", "kind"],
        )
        for kind in sorted(set(self.kinds) | set(verdict.findings if verdict else ())):
            findings.add_metric([self.report, kind], verdict.findings.get(kind, 0) if verdict else 0)
        yield findings

    def _last_run(self) -> Iterator[Metric]:
        last = self.runs[-1]
        yield self._gauge("duration_seconds", "Wall time of the last run", last.duration_s)
        yield self._gauge("last_audited_bytes", "Bytes of the sites' logs the last run audited", last.audited_bytes)
        yield self._gauge("last_audited_records", "Records the last run audited", last.audited_records)
        yield self._gauge(
            "last_bytes_moved", "Bytes the last run read (segment files; live: digests and batches)", last.bytes_moved
        )

    def _totals(self) -> Iterator[Metric]:
        audited = CounterMetricFamily(
            PREFIX + "audited_bytes", "Bytes audited, summed over the runs of the history", labels=["report"]
        )
        audited.add_metric([self.report], sum(r.audited_bytes for r in self.runs))
        yield audited
        runs = CounterMetricFamily(
            PREFIX + "runs", "Audit runs of the history, by verdict", labels=["report", "verdict"]
        )
        for v in (VERDICT_CLEAN, VERDICT_DIVERGENCE, VERDICT_ERROR):
            runs.add_metric([self.report, v], sum(1 for r in self.runs if r.verdict == v))
        yield runs


def exposition(runs: list[Run], report: str, kinds: list[str]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(HistoryCollector(runs, kinds, report))
    return registry


def write_textfile(path: Path, runs: list[Run], report: str, kinds: list[str]) -> None:
    """``path`` rewritten atomically (temporary file + rename) with the metrics of ``runs``."""
    try:
        write_to_textfile(str(path), exposition(runs, report, kinds))
    except OSError as exc:
        raise MetricsError(
            f"--metrics-textfile {path}: cannot write it ({exc}); check the directory's permissions"
        ) from None
