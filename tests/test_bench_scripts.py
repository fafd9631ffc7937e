"""Every benchmark script still starts: its imports resolve and it parses its options.

The benches are not run by ``make test`` (they time things, and the machines
are shared), so nothing else would notice a bench broken by a move of the
modules it uses, as ``bench/failover.py`` was by the move of the CLI into
``georep/cli/``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py"))


def test_every_bench_is_covered() -> None:
    assert {
        "produce.py",
        "replication.py",
        "ensemble.py",
        "site_cluster.py",
        "failover.py",
        "audit.py",
        "fuzz.py",
        "soak.py",
        "scale.py",
    } <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_script_starts(script: str) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True, timeout=120, cwd=BENCH.parent
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout


@pytest.mark.slow
def test_scale_bench_reports_a_tiny_size(tmp_path: Path) -> None:
    """bench/scale.py at a tiny size measures every figure of its row and draws the plot (no target is judged)."""
    out = tmp_path / "scale.png"
    args = ["--sizes", "4", "--topics", "2", "--records", "200", "--idle-s", "1", "--cluster-partitions", "0"]
    done = subprocess.run(
        [sys.executable, str(BENCH / "scale.py"), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=BENCH.parent,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "failed:" not in done.stdout, done.stdout[-3000:]
    assert "4 p x 1 t" in done.stdout and "4 p x 2 t" in done.stdout, done.stdout[-3000:]
    assert out.stat().st_size > 0
