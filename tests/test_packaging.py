"""Issue 26: a server gets the runtime only. ``requirements-runtime.lock`` pins exactly what pyproject.toml's
runtime dependencies pull in, and the wheel ``python -m build`` makes, installed with it into a fresh venv, runs
``georep --version`` and a node."""

from __future__ import annotations

import importlib.metadata as metadata
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from georep import __version__
from tests.support.cli import serve_once

ROOT = Path(__file__).resolve().parent.parent
RUNTIME_LOCK = ROOT / "requirements-runtime.lock"
PACKAGED = ("pyproject.toml", "README.md", "georep", "topology", "offsets", "dedup", "cluster", "spark_jobs")


def pins(path: Path) -> dict[str, str]:
    lines = (line.strip() for line in path.read_text().splitlines())
    return {canonicalize_name(n): v for n, v in (line.split("==") for line in lines if line and line[0] != "#")}


def runtime_closure() -> dict[str, str]:
    """pyproject.toml's runtime dependencies and everything they require, at the versions installed here."""
    todo = [Requirement(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    found: dict[str, str] = {}
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if name in found:
            continue
        dist = metadata.distribution(requirement.name)
        found[name] = dist.version
        needs = (Requirement(r) for r in dist.requires or [])
        todo += [r for r in needs if r.marker is None or r.marker.evaluate({"extra": ""})]
    return found


def test_the_runtime_lock_pins_what_the_runtime_dependencies_need_at_the_full_locks_versions() -> None:
    runtime, full = pins(RUNTIME_LOCK), pins(ROOT / "requirements.lock")
    assert runtime == runtime_closure()
    assert {n: full.get(n) for n in runtime} == runtime, "requirements.lock pins these differently"
    assert "pytest" not in runtime and "mypy" not in runtime and "pyspark" not in runtime


@pytest.mark.slow
@pytest.mark.wheel  # a wheel built and installed with its runtime into a fresh venv: make wheel-check, in CI
def test_the_wheel_installed_with_the_runtime_lock_alone_runs_a_node(tmp_path: Path) -> None:
    source = tmp_path / "source"  # a copy: setuptools writes build/ beside the sources
    source.mkdir()
    for name in PACKAGED:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, source / name)
    built = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path / "dist"), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("georep-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    installed = subprocess.run([*pip, "-r", str(RUNTIME_LOCK), str(wheel)], capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr[-2000:]
    georep = str(venv / "bin" / "georep")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    version = subprocess.run([georep, "--version"], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert version.stdout.strip() == f"georep {__version__}", version.stderr
    data = tmp_path / "a"
    argv = [georep, "node", "--site", "a", "--listen", "127.0.0.1:0", "--data-dir", str(data), "--insecure"]
    serve_once(argv, data, cwd=tmp_path, env=env)
