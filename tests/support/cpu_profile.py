"""A pytest plugin that charges each test the CPU it used: its own, that of the processes it started and reaped,
and that of the nodes the fork server started for it.

``make test`` is CPU-bound on two cores, so its wall time follows the CPU its tests use, not their durations under
four workers. Run ``python -m pytest -p tests.support.cpu_profile`` and read ``.pytest-cpu.tsv`` in the root
directory (seconds of CPU, then the test's id), or ``sort -rn .pytest-cpu.tsv | head`` for the dearest tests.
Nodes a fixture of wider scope holds, and the workers of a process pool, are charged to the test that reaps them.
"""

from __future__ import annotations

import multiprocessing.forkserver
import os
import resource
from collections.abc import Iterator

import pytest


def _forked_nodes_cpu_s() -> float:
    """CPU of the nodes the fork server (``tests/support/forkserver.py``) started and reaped: its children's."""
    pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")  # cutime, cstime


def _stat(pid: str) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None


def _live_children_cpu_s() -> float:
    """CPU of the live processes below this one, but for the fork server's (its nodes are counted as it reaps
    them): the Spark JVM a session fixture holds, with what it reaped, and a process pool's workers. Once reaped,
    a child's CPU moves to RUSAGE_CHILDREN, so nothing is counted twice."""
    forkserver = str(getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None))
    parents: dict[str, list[str]] = {}
    cpu: dict[str, float] = {}
    for pid in os.listdir("/proc"):
        fields = _stat(pid) if pid.isdigit() else None
        if fields is not None:
            parents.setdefault(fields[1].decode(), []).append(pid)
            cpu[pid] = sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [p for p in parents.get(str(os.getpid()), []) if p != forkserver]
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0.0)  # its own and its reaped children's; its live ones come in the walk
        todo += parents.get(pid, [])
    return total


def _cpu_s() -> float:
    own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return (
        own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime + _forked_nodes_cpu_s() + _live_children_cpu_s()
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    start = _cpu_s()
    yield
    used = _cpu_s() - start
    # One short line per test, appended with O_APPEND: xdist workers share the file without interleaving.
    fd = os.open(item.config.rootpath / ".pytest-cpu.tsv", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, f"{used:.2f}\t{item.nodeid}\n".encode())
    finally:
        os.close(fd)
