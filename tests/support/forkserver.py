"""Start the tests' ``georep node`` processes as forks of a server that has already imported the node's modules.

A fresh ``python -m georep.cli node`` spends about 0.55 s of CPU importing modules before it serves, and the suite
starts a few hundred nodes. :func:`install` makes :data:`georep.server.process.launcher` ask multiprocessing's fork
server instead: a process started once per pytest process (each xdist worker has its own), single-threaded, that
imports :data:`PRELOAD` and then forks one child per node. The child is a real, separate ``georep node`` process:
it makes its own gRPC server, threads and event loop after the fork (the server never creates any: gRPC is not
fork-safe once initialised), with what ``Popen`` would have given it: stdin from /dev/null, stdout and stderr
appended to the node's log, ``sys.argv``, the environment and working directory of the test process at launch
time (the server's are those of when it started), default signal handlers. ``node.json`` records the same command
line as for ``Popen`` (``sys.executable -m georep.cli node ...``), so a drill restarts it as a plain process.

What differs from ``Popen``: the node is the fork server's child, which reaps it and passes its exit status back
(a node killed by SIGKILL reports -9, as ``Popen`` does); it dies with the fork server (``PR_SET_PDEATHSIG``), and
the server exits when the test process does, so a test process that is killed leaves no node behind.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import io
import logging
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.process
import multiprocessing.resource_tracker
import multiprocessing.util  # its exit handler, registered on import, must run after ours
import os
import signal
import subprocess
import sys
import threading
import traceback
import weakref
from pathlib import Path
from typing import Any

import georep.cli
from georep.server import process as node_process
from georep.server.process import Launched, popen_launcher

ENABLE_ENV = "GEOREP_TEST_FORKSERVER"  # "0": the tests start nodes with Popen, as 'georep up' does
# What a node imports before it serves. Importing them creates no thread, channel or event loop.
PRELOAD = [
    "georep.cli",
    "georep.cli.main",
    "georep.cli.node",
    "georep.node.serve",
    "georep.server.replicator",
    "tests.support.forkserver",
]
# Imported by nodes with a Kafka listener only (0.2 s: kafka-python); preloaded when it imports here.
PRELOAD_IF_IMPORTS = ["georep.kafka.server"]
PR_SET_PDEATHSIG = 1

_context = multiprocessing.get_context("forkserver")
_started: weakref.WeakSet[ForkedNode] = weakref.WeakSet()
_server_env: dict[str, str] | None = None  # read_at_load of the environment the fork server started with
_installed_by = 0  # the pid of the process that installed the launcher (a fork of it must not stop its server)


class ForkedNode:
    """A node forked by the fork server, with the part of ``subprocess.Popen`` that NodeProcess and the tests use."""

    def __init__(self, command: list[str], process: multiprocessing.process.BaseProcess) -> None:
        self.args = command
        self._process: multiprocessing.process.BaseProcess | None = process
        assert process.pid is not None
        self._pid = process.pid
        self._returncode: int | None = None

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def returncode(self) -> int | None:
        return self._returncode

    def poll(self) -> int | None:
        return self.wait(0) if self._process is not None and self._process.exitcode is not None else self._returncode

    def wait(self, timeout: float | None = None) -> int:
        if self._returncode is None:
            assert self._process is not None
            self._process.join(timeout)
            code = self._process.exitcode
            if code is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._returncode = code
            self._process.close()  # its pipe from the fork server
            self._process = None
        return self._returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never signal a pid that may already be another process's
            os.kill(self._pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def read_at_load(env: dict[str, str]) -> dict[str, str]:
    """The variables of ``env`` that the interpreter (``PYTHON*``) or gRPC (``GRPC_*``: its log level, for one)
    read when they load, as a node started with ``env`` would see them: a forked node has the fork server's."""
    seen = {"GRPC_VERBOSITY": "ERROR", **env}  # georep.cli's default, set before gRPC loads
    return {k: v for k, v in seen.items() if k.startswith(("GRPC_", "PYTHON"))}


def fork_launcher(command: list[str], log_path: Path) -> Launched:
    """Start ``command`` (``sys.executable -m georep.cli ARGS``) as a fork of the preloaded server; with ``Popen``
    when its environment differs from the server's in a variable read at load (the fork would not see it)."""
    global _server_env
    if _server_env is None:
        multiprocessing.forkserver.ensure_running()  # started with this environment
        _server_env = read_at_load(dict(os.environ))
    env = dict(os.environ)
    if command[:3] != [sys.executable, "-m", "georep.cli"] or read_at_load(env) != _server_env:
        return popen_launcher(command, log_path)
    args = (command[3:], env, os.getcwd(), str(log_path))
    process = _context.Process(target=_run_node, args=args, name="georep-node", daemon=True)
    process.start()
    node = ForkedNode(command, process)
    _started.add(node)
    return node


def _run_node(args: list[str], env: dict[str, str], cwd: str, log_path: str) -> None:
    """In the forked child: become ``python -m georep.cli ARGS`` started by Popen, run it, exit with its code."""
    # The fork server's "alive" pipe and the resource tracker's: held here, they would keep both alive after the
    # test process died. The node uses neither.
    for fd in (
        multiprocessing.forkserver._forkserver._forkserver_alive_fd,  # type: ignore[attr-defined]
        multiprocessing.resource_tracker._resource_tracker._fd,  # type: ignore[attr-defined]
    ):
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
    multiprocessing.forkserver._forkserver._forkserver_alive_fd = None  # type: ignore[attr-defined]
    multiprocessing.resource_tracker._resource_tracker._fd = None  # type: ignore[attr-defined]
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)  # as popen_launcher: a data dir is private
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(devnull)
    os.close(log)
    # As a fresh interpreter writing to a file: stdout block-buffered, stderr line-buffered.
    assert isinstance(sys.stdout, io.TextIOWrapper) and isinstance(sys.stderr, io.TextIOWrapper)
    sys.stdout.reconfigure(line_buffering=False)
    sys.stderr.reconfigure(line_buffering=True)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python sets it up at start
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # what importing georep.cli does in a fresh interpreter
    sys.argv = [str(Path(str(georep.cli.__file__)).with_name("__main__.py")), *args]  # as `python -m georep.cli`
    code = 1
    try:
        from georep.cli.main import main

        code = main(args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    except BaseException:
        traceback.print_exc()
    finally:
        # What the interpreter does on exit: wait for non-daemon threads, flush logging and the streams.
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code & 0xFF)


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1") != "0"


def install() -> None:
    """Make NodeProcess fork its nodes from the preloaded server (started at the first launch)."""
    global _installed_by
    optional = []
    for name in PRELOAD_IF_IMPORTS:  # the fork server would die of an error other than ImportError
        try:
            importlib.import_module(name)
        except Exception:
            continue
        optional.append(name)
    _context.set_forkserver_preload([*PRELOAD, *optional])
    node_process.launcher = fork_launcher
    _installed_by = os.getpid()
    atexit.register(uninstall)  # runs before multiprocessing's own exit handler, registered earlier


def uninstall() -> None:
    """Kill the nodes still running, stop the fork server and reap it (so its CPU time counts as this process's
    children's), and go back to Popen."""
    if os.getpid() != _installed_by:
        return
    node_process.launcher = popen_launcher
    for node in list(_started):
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            node.kill()
            node.wait(10)
    server: Any = multiprocessing.forkserver._forkserver
    with contextlib.suppress(OSError, ChildProcessError):
        server._stop()
    global _server_env
    _server_env = None
