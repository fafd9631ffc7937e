"""Start and stop ``georep node`` processes on this machine.

Used by ``georep demo``, the integration tests and the benchmarks. A node
writes ``node.json`` into its data dir once it is listening; that file gives
its real addresses (ports may be ephemeral) and its process id.

:data:`launcher` starts the process: ``subprocess.Popen`` of ``python -m georep.cli node ...``. The tests replace it
with one that forks each node from a server that has already imported the node's modules
(``tests/support/forkserver.py``); what they get back only needs the part of ``Popen`` that :class:`Launched` names.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from georep.security.tls import TlsConfig
from georep.storage.private import append_private, private_dir

NODE_INFO = "node.json"


def node_flags(tls: TlsConfig | None) -> list[str]:
    """The ``georep node`` flags that give it ``tls`` (``--insecure`` for ``None``)."""
    if tls is None:
        return ["--insecure"]
    flags = ["--tls-ca", str(tls.ca), "--tls-cert", str(tls.cert), "--tls-key", str(tls.key)]
    return [*flags, "--tls-server-name", tls.server_name] if tls.server_name else flags


class Launched(Protocol):
    """The part of ``subprocess.Popen`` a started node process must offer: ``wait`` raises
    ``subprocess.TimeoutExpired`` on timeout, and a process killed by a signal has ``returncode`` minus its number."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


def popen_launcher(command: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``command`` with stdin from /dev/null, its output appended to ``log_path``."""
    with append_private(log_path) as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


# How NodeProcess.launch starts ``command`` (always ``sys.executable -m georep.cli node ...``) logging to a path.
launcher: Callable[[list[str], Path], Launched] = popen_launcher


class NodeStartError(RuntimeError):
    """A node process exited or did not become ready in time."""


@dataclass
class NodeProcess:
    site: str
    data_dir: Path
    listen: str = "127.0.0.1:0"
    metrics_listen: str = "127.0.0.1:0"
    extra_args: list[str] = field(default_factory=list)
    log_path: Path | None = None
    proc: Launched | None = None
    address: str = ""
    metrics_address: str = ""
    kafka_address: str = ""  # the Kafka listener's HOST:PORT (--kafka-listen), from node.json
    node_id: int | None = None  # a node of a multi-node site
    tls: TlsConfig | None = None  # None: the node serves plaintext (--insecure)
    _logged_before: int = 0

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "georep.cli",
            "node",
            "--site",
            self.site,
            "--listen",
            self.listen,
            "--metrics-listen",
            self.metrics_listen,
            "--data-dir",
            str(self.data_dir),
            *node_flags(self.tls),
            *self.extra_args,
        ]

    def start(self, timeout_s: float = 30.0) -> NodeProcess:
        return self.launch().wait_ready(timeout_s)

    def launch(self) -> NodeProcess:
        """Start the process without waiting for it (a node of a multi-node site is ready only once a majority of
        its site's nodes run: launch them all, then :meth:`wait_ready`)."""
        private_dir(self.data_dir)
        log_path = self.log_path or self.data_dir / "node.log"
        self._logged_before = log_path.stat().st_size if log_path.exists() else 0
        self.proc = launcher(self.command(), log_path)
        return self

    def wait_ready(self, timeout_s: float = 30.0) -> NodeProcess:
        """Wait until the launched process serves (its ``node.json``); raises :class:`NodeStartError`."""
        assert self.proc is not None, "launch() first"
        info = self.data_dir / NODE_INFO  # a node.json of another live node stays: only our pid's counts
        log_path = self.log_path or self.data_dir / "node.log"
        logged_before = self._logged_before
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                with open(log_path, "rb") as log:
                    log.seek(logged_before)
                    tail = log.read().decode(errors="replace")[-2000:]  # what this process logged
                raise NodeStartError(f"georep node for site {self.site} exited with {self.proc.returncode}:\n{tail}")
            if info.exists():
                try:
                    data = json.loads(info.read_text())
                except json.JSONDecodeError:
                    data = {}
                if data.get("pid") == self.proc.pid:
                    self.address = data["listen"]
                    self.metrics_address = data.get("metrics", "")
                    self.kafka_address = data.get("kafka", "")
                    # Keep the port across restarts so clients can reconnect.
                    self.listen = self.address
                    if self.metrics_address:
                        self.metrics_listen = self.metrics_address
                    return self
            time.sleep(0.02)
        self.kill9()
        raise NodeStartError(f"georep node for site {self.site} was not ready after {timeout_s}s")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill9()
        return self.proc.returncode

    def restart(self, timeout_s: float = 30.0) -> NodeProcess:
        self.stop()
        return self.start(timeout_s)
